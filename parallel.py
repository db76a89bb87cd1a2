"""
Tensor, sequence, context, pipeline and data parallelism over torchrun, as hooks on the model's own
modules.

A mesh of world = d × p × c × t ranks (t fastest: a tp group is neighbouring GPUs on one node). S
tokens per sequence, B sequences per rank, h width, H heads, K kv heads, I the MLP's width, V
vocabulary, N parameters, b bytes per element. What each dimension saves, per rank:

  t   tensor parallel (Megatron, Shoeybi 2019): wq, wk, wv, w1, w3 split by output (heads, I), wo,
      w2 by input, embedding and LM head by vocabulary rows (⌈V/t⌉ each, the last rank's past V
      padding); kv heads replicated when K < t. Weights, gradients, optimizer states: N -> about
      N/t.
  sp  sequence parallel (Korthikanti 2022), on with t: norms and residuals hold S/t tokens;
      activations kept per layer S·B·h·(10 + 24/t) bytes -> S·B·h·34/t (Megatron's count, bf16).
      The price is transient: the gathered input and the partial sums of the matmuls are whole
      S·B·h·b tensors.
  c   context parallel: every activation holds S/c tokens. Attention swaps sequence shards for head
      shards (DeepSpeed-Ulysses, Jacobs 2023: the model's own attention on the whole sequence, H/c
      heads) or passes k, v around a ring (ring attention, Liu 2023: ring.py, its own chapter).
      Or both, c = u × r (cp_ring = r; USP, Fang & Zhao 2024; Megatron's hierarchical a2a+p2p):
      Ulysses inside groups of u neighbouring ranks (a node's NVLink), the ring across r of those
      groups (the network). Ulysses' all-to-all turns S/c tokens of all heads into its ring rank's
      S/r tokens of H/u heads, and the ring runs on those, r steps. The order of the tokens
      (shard_batch) makes the two agree: ring rank j holds zigzag chunks j and 2r-1-j of 2r, and
      Ulysses rank i of it the i-th u-th of those 2·S/2r tokens, so that the all-to-all, which
      puts its ranks' tokens one after the other, hands the ring exactly its two chunks:
        r = 1       Ulysses alone: one chunk pair, the whole sequence, in u contiguous shards;
        u = 1       the ring alone: each rank its two chunks whole;
        1 < r < c   both: H/t heads must divide by u (Ulysses' rule), any count by r (the
                    ring's); cp_rank = j·u + i, so a Ulysses group is u neighbours.
  p   pipeline parallel (GPipe, Huang 2019; 1F1B, Narayanan 2021): stage r keeps blocks
      [r·L/p, (r+1)·L/p) (the embedding on the first, the LM head on the last): states N -> N/p, no
      collective inside a layer. Not the activations: the first stage holds p micro-batches in
      flight under 1F1B (pipeline.py).
  d   data parallel: other sequences. Gradients are summed over dp × cp in ~25 MB buckets (DDP's),
      never one flat copy of them all; or FSDP2 (shard_states: torch's fully_shard, ZeRO,
      Rajbhandari 2020) keeps 1/d of every fp32 row of the tp shard over the d = dp·c ranks holding
      the same weights: zero=2 the gradients and AdamW's moments, zero=3 the weights too:
      16·N/(t·d) bytes; offload_states=True keeps those rows in host memory.
  e   expert parallel (a mixture of experts, moe.py): groups of e of those d ranks share out each
      layer's E experts, E/e a rank: the experts' states / e (then FSDP2's rows of them over the
      d/e ranks holding the same ones); each token's k rows go to their experts' ranks and back.

The model is built for one device (Llama(config)); the plan applies from outside, torchtitan's
way, in calls train.py makes in order. parallelize(model, mesh) keeps this pipeline stage's blocks,
shards the weights in place (each Attention then counts n_head/t heads from its weights) and puts
Megatron's f and g (Collective(enter_tp), Collective(leave_tp)) in the places the model keeps for
them (Attention's and the MLP's enter_tp / leave_tp, the LM head's input), and a mixture of experts'
ParallelMoE (tp, ep).
apply_cores(model, mesh) puts the layout's attention core in every Attention (Ulysses around
model.Core, or the ring in its place). chunked.apply then makes the LM head's loss vocabulary
parallel over the tp group. A fork that changes model.attention runs under t and Ulysses as is. On
one process (Mesh(): every group None) no collective runs: shard_batch returns the batch,
parallelize and sync_grads change nothing, and clip_grad_norm_ is torch's.

What moves per block, forward (backward), B·S·h elements each unless said; every collective is one
of the four functions below or ring.py's ring_shift (chunked.py's loss makes its own):
  t               2 all-reduce (2)                          f before wq|w1, g after wo|w2
  t with sp       2 all-gather + 2 reduce-scatter (2 + 2)   the same volume
  c Ulysses       2 all-to-all (2): q, k, v packed in one, the output in the other (H/c heads move)
  c ring          c-1 sends of k, v (c-1 of k, v + c-1 of dk, dv), each of the tokens the receiving
                  rank attends (at most S/c; a window's far steps none); kv heads, never repeated
  c = u × r       Ulysses' 2 (2) over u ranks, then the ring's r-1 (2·(r-1)) over r, of S/r tokens
                  of K/u kv heads: as many bytes a send as the ring alone's
  recompute=full  the forward's again in backward but the last g (torch's checkpoint stops early)
  d, zero=2       1 all-gather of its rows in bf16 before its forward (2·N_block/t bytes), kept to
                  its backward, 1 reduce-scatter of its fp32 gradients after it (4·N_block/t);
                  zero=3 gathers again for backward
  offload_states  its fp32 rows come in from the host before each all-gather, its gradients' rows
                  go out after
  p, per stage    1 send of its output to the next stage, B·S·h/(c·t) elements, point to point
                  (1 gradient back)
  e (MoE)         1 all-to-all of E counts, 2 of variable sizes (2): the T·k pairs' rows out to
                  their experts and back (k·B·S·h/c elements, of which a share (e-1)/e leaves);
                  1 all-reduce of E counts over dp·c (the aux loss's f)
Per step: embedding 1 (g), LM head input 1 (f), per loss chunk one all-gather of [B·S/chunks]
log-sum-exps, 1 all-reduce of the target logits. FSDP2 gathers the embedding, final norm and LM
head once (before the forward, kept to the end of the backward) and reduce-scatters their gradients
last.

A pipeline of p stages over M micro-batches (gradient_accumulation_steps) idles (p - 1)/(M + p - 1)
of a step, its bubble, 1F1B and GPipe alike: M >= 4p keeps it under 20%. It pays where the states
don't fit t × d sharding on one node's fast links: its sends are small and few, fit for the slower
links between nodes.
"""
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch._subclasses.fake_tensor import FakeTensor

from model import Core, attention
from moe import MoE
from ring import RingAttention, flash_error


# ---------------------------------------------------------------------------- setup: torchrun, mesh
@dataclass
class Mesh:
    """Where this rank sits: rank = ((dp_rank·pp + pp_rank)·cp + cp_rank)·tp + tp_rank (the sizes
    and the coordinates in the grid's order: make_mesh relies on it). A group is None when of size
    1 (one process: every group); dpcp_group: the ranks holding the same weights; kv_group: the tp
    ranks sharing one kv head (K < t); ulysses_group, ring_group: cp's two dimensions (the header's
    c = u × r, cp_ring r: its rank cp_rank // u in the ring, cp_rank % u in Ulysses)."""
    world: int = 1
    rank: int = 0
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    cp_ring: int = 1
    sequence_parallel: bool = True
    tp_group: object = None
    ulysses_group: object = None
    ring_group: object = None
    pp_group: object = None
    dpcp_group: object = None
    kv_group: object = None
    # FSDP2's DeviceMesh of the dpcp ranks (of one rank too: offload_states), made before fake
    # tensors
    dpcp_mesh: object = None
    # expert parallelism (moe.py): groups of ep of the dpcp ranks, each rank E/ep experts;
    # edp_group: the dpcp ranks holding the same experts (FSDP2's edp_mesh over them)
    ep: int = 1
    ep_rank: int = 0
    ep_group: object = None
    edp_group: object = None
    edp_mesh: object = None


def ring_size(cp, cp_impl='ulysses', cp_ring=0):
    """The ring's r of c = u × r: cp_ring, or cp_impl's end of the split ('ulysses': 1, 'ring':
    c)."""
    if cp_ring:
        return cp_ring
    return cp if cp_impl == 'ring' else 1


def check_layout(config, world, tp, cp, cp_impl='ulysses', seq_len=None, zero=0, device_type='cpu',
                 dtype=torch.float32, states_on_host=False, pp=1, microbatches=1, schedule='1f1b',
                 ep=1, cp_ring=0):
    """None, or the one-line reason this layout can't run config (a LlamaConfig or anything with its
    fields), asked on every rank before anything is allocated. The one owner of the layout rules:
    the first broken rule, in the order below, is the answer."""
    c, S, H, K = config, seq_len or 0, config.n_head, config.n_kv_head
    if min(tp, cp, pp) < 1 or world % (tp * cp * pp):
        return (f"world size {world} is not divisible by pp_size * cp_size * tp_size = "
                f"{pp} * {cp} * {tp}")
    heads, kv_heads, tokens = H // tp, K // tp or 1, S // cp  # per tp rank; per cp rank
    if H % tp:
        return f"n_head={H} is not divisible by tp_size={tp}"
    if K % tp and tp % K:
        return (f"n_kv_head={K} and tp_size={tp}: one must divide the other (kv heads split or "
                "copied)")
    for key in ('intermediate_size', 'moe_intermediate_size'):
        if getattr(c, key) % tp:
            return f"{key}={getattr(c, key)} is not divisible by tp_size={tp}"
    if cp_impl not in ('ulysses', 'ring'):
        return f"cp_impl must be 'ulysses' or 'ring', got {cp_impl!r}"
    if cp_ring < 0 or cp % (cp_ring or 1):
        return (f"cp_ring={cp_ring} must divide cp_size={cp} (the ring's ranks; Ulysses' are "
                "cp_size / cp_ring)")
    ring = ring_size(cp, cp_impl, cp_ring)
    if zero == 1:
        return "zero must be 0, 2 or 3, got 1 (zero=1 became 2: FSDP2 shards the gradients too)"
    if zero not in (0, 2, 3):
        return f"zero must be 0, 2 or 3, got {zero!r}"
    if zero > 1 and world == tp * pp and not states_on_host:
        return f"zero={zero} shards over the dp x cp ranks: there is one (world {world}, tp {tp})"
    # FSDP2 pads rows it can't split evenly, not columns, and the vocabulary's tensors split by
    # column (shard_states): their columns must divide (3 or 6 GPUs and a power-of-two width)
    if zero > 1 and c.n_embd % (world // (tp * pp)):
        return (f"zero={zero} splits the vocabulary's tensors by column over the "
                f"{world // (tp * pp)} dp x cp ranks: n_embd={c.n_embd} is not divisible by them")
    if states_on_host and zero != 3:
        return "offload_states=True streams each block's weights in from the host: zero=3"
    if ep < 1 or world // (tp * pp) % ep:
        return (f"ep_size={ep} must divide the {world // (tp * pp)} dp x cp ranks holding the same "
                f"weights (world {world} / (tp_size {tp} * pp_size {pp}))")
    if ep > 1 and c.n_experts == 0:
        return f"ep_size={ep} splits experts: n_experts=0 (a dense MLP)"
    if c.n_experts % ep:
        return f"n_experts={c.n_experts} is not divisible by ep_size={ep}"
    if c.n_experts and c.recompute == 'none' and 0 < c.offload < 1:
        return (f"offload={c.offload} with recompute='none' and n_experts={c.n_experts}: "
                "offload.py cuts a block's tokens in two, the router balances the micro-batch's "
                "together; use recompute='selective' or 'full', or offload=1")
    # offload.py's token-wise recompute replays attention's output, made once from every token's
    # q, k, v ('selective', or 'none' with α < 1: its _Split)
    token_wise = c.recompute == 'selective' or c.recompute == 'none' and c.offload < 1
    replay = c.offload > 0 and token_wise
    groups = c.attention_chunks or 1  # (0: chunked.py picks a count that fits the layout)
    if kv_heads % groups:
        return f"attention_chunks={groups} does not divide the {kv_heads} kv heads per tp rank"
    if c.attention_chunks != 1 and replay:
        return (f"attention_chunks={c.attention_chunks} with offload={c.offload} and recompute="
                f"{c.recompute!r}: offload.py cuts attention by tokens, not heads; use "
                "recompute='full', or offload=1 with recompute='none'")
    if why := context_error(c, heads, kv_heads, S, cp, ring, replay, device_type, dtype):
        return why
    if tokens % tp:
        return (f"seq_len / cp_size = {tokens} is not divisible by tp_size={tp} (sequence "
                "parallelism)")
    if schedule not in ('1f1b', 'gpipe'):
        return f"pp_schedule must be '1f1b' or 'gpipe', got {schedule!r}"
    if pp > c.n_layer:
        return f"pp_size={pp} stages need a block each: n_layer={c.n_layer}"
    if pp > 1:
        if schedule == '1f1b' and microbatches < pp:
            return (f"pp_schedule='1f1b' runs gradient_accumulation_steps={microbatches} "
                    f"micro-batches through {pp} stages: it needs at least as many (or "
                    "pp_schedule='gpipe')")
        if c.tie_embeddings:
            return "tie_embeddings=True with pp_size > 1: one weight on the first and last stage"
        if c.offload > 0:
            return (f"offload={c.offload} with pp_size > 1: offload.py's host pool holds one "
                    "micro-batch's blocks, a stage keeps up to pp_size; use recompute")
    return None


def context_error(c, heads, kv_heads, S, cp, ring, replay, device_type, dtype):
    """check_layout's rules of context parallelism, c = u × r (the header): Ulysses' over its u
    ranks, the ring's over its r, for `heads` query and `kv_heads` kv heads a tp rank; `replay`:
    offload.py would replay attention's output in a recompute."""
    u = cp // ring
    groups = c.attention_chunks or 1
    # Ulysses' rules over its u ranks (each holds at u = 1: the ring alone)
    kv_group = kv_heads // groups
    if groups > 1 and (heads // groups % u or kv_group % u and u % kv_group):
        return (f"attention_chunks={groups}: Ulysses spreads each group's {heads // groups} "
                f"query and {kv_group} kv heads over {u} ranks; make fewer groups")
    if S % cp and ring == 1:
        return f"seq_len={S} is not divisible by cp_size={cp}"
    if heads % u or kv_heads % u and u % kv_heads:
        # the splits c = u × r whose u takes our heads (r = c: the ring, any count)
        rings = [r for r in range(1, cp + 1) if cp % r == 0 and not heads % (cp // r)
                 and not (kv_heads % (cp // r) and cp // r % kv_heads)]
        return (f"{heads} query and {kv_heads} kv heads per rank (n_head, n_kv_head / tp_size) "
                f"don't split over Ulysses' {u} ranks (cp_size / cp_ring); cp_ring = "
                f"{' or '.join(map(str, rings))} does")
    if ring > 1:
        if S % (2 * cp):
            return f"seq_len={S} is not divisible by 2 * cp_size = {2 * cp} (ring's zigzag chunks)"
        # (None: the kernel runs here)
        if kernel := flash_error(device_type, dtype, c.head_dim):
            return kernel
        # (the ring's output is merged from several kernel calls: it can't be replayed)
        instead = (", cp_impl='ulysses' or offload=1" if c.recompute == 'none'
                   else " or cp_impl='ulysses'")
        if replay:
            return (f"offload={c.offload} with recompute={c.recompute!r} and cp_impl='ring': ring "
                    "attention's output can't be replayed in a recompute (offload.py); use "
                    f"recompute='full'{instead}")
    return None


def init_distributed(device_type, fake=False, timeout_s=300, one=False):
    """(world, rank, local_rank). Under torchrun: its process group (NCCL on CUDA, gloo on CPU);
    one: a group of one rank all the same (FSDP2's, offload_states); fake (the dry run): rank RANK
    (0) of WORLD_SIZE, whose collectives return at once. One process, none of these: no group."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    if fake and (world > 1 or one):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group('fake', store=FakeStore(), rank=int(os.environ.get('RANK', 0)),
                                world_size=world)
    if fake or world == 1 and not one:
        return world, 0, 0
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    if device_type == 'cuda':
        torch.cuda.set_device(local_rank)
    # no torchrun (one): our own store
    alone = dict(store=dist.HashStore(), rank=0, world_size=1) if world == 1 else {}
    # a rank blocked in a collective gives up after timeout_s (a rank died or hangs); torchrun's
    # agent may end it sooner
    dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo',
                            timeout=timedelta(seconds=timeout_s), **alone)
    return world, dist.get_rank(), local_rank


def make_mesh(tp, cp, cp_impl='ulysses', n_kv_head=None, sequence_parallel=True, timeout_s=None,
              device_type='cpu', pp=1, ep=1, cp_ring=0):
    """The d × p × c × t mesh of the current process group; without one, Mesh(): one rank, no
    group."""
    if not dist.is_initialized():
        return Mesh(sequence_parallel=sequence_parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    # the ranks as a grid [dp, pp, cp, tp]; a group is a row of it along its dimensions
    grid = torch.arange(world).view(-1, pp, cp, tp)
    # Mesh's fields in the grid's order: its sizes (dp, pp, cp, tp), then where we sit in it
    where = (grid == rank).nonzero()[0].tolist()
    ring = ring_size(cp, cp_impl, cp_ring)
    mesh = Mesh(world, rank, *grid.shape, *where, ring, sequence_parallel)
    # a group's own default timeout is 30 minutes, not the world's
    timeout = timeout_s and timedelta(seconds=timeout_s)

    def group(rows):
        """Our group of the rows of ranks, None for one rank. Making groups is collective: every
        rank builds every group, in the same order."""
        if rows.shape[1] == 1:
            return None
        return dist.new_subgroups_by_enumeration(rows.tolist(), timeout=timeout)[0]

    def fsdp_mesh(group):
        """FSDP2's DeviceMesh over our group. It needs a group of one rank too (offload_states on
        its own): then a group per rank (new_subgroups is collective too)."""
        return DeviceMesh.from_group(group or dist.new_subgroups(1)[0], device_type)

    mesh.tp_group = group(grid.reshape(-1, tp))
    # a cp group's ranks in cp_rank order, j·u + i: Ulysses' u neighbours, the ring's every u-th
    cp_rows = grid.transpose(2, 3).reshape(-1, ring, cp // ring)
    mesh.ulysses_group = group(cp_rows.flatten(0, 1))
    mesh.ring_group = group(cp_rows.transpose(1, 2).flatten(0, 1))
    mesh.pp_group = group(grid.movedim(1, 3).reshape(-1, pp))
    # the ranks holding the same weights: one pp stage, one tp shard
    dpcp = grid.permute(1, 3, 0, 2).reshape(pp * tp, -1)
    mesh.dpcp_group = group(dpcp)
    mesh.dpcp_mesh = fsdp_mesh(mesh.dpcp_group)
    mesh.edp_group = mesh.dpcp_group
    if ep > 1:
        # ep neighbours of a dpcp row share out the experts; every ep-th of the row holds the same
        mesh.ep = ep
        mesh.ep_group = group(dpcp.reshape(-1, ep))
        # (our place in the dpcp row, dp_rank·cp + cp_rank, mod ep: the group's ranks are in order)
        mesh.ep_rank = dist.get_rank(mesh.ep_group)
        edp = dpcp.reshape(pp * tp, -1, ep).transpose(1, 2)
        mesh.edp_group = group(edp.flatten(0, 1))
        mesh.edp_mesh = fsdp_mesh(mesh.edp_group)
    if n_kv_head is not None and n_kv_head < tp:
        # kv head j lives on tp ranks j·g .. j·g + g-1, g = t/K
        mesh.kv_group = group(grid.reshape(-1, tp // n_kv_head))
    return mesh


# ----------------------------------------------------------------------------- the collectives
# Every byte between ranks moves here (tests count the calls), contiguous with the split dimension
# first: flat memory.

def all_reduce(x, group):
    """The sum, in place; a host tensor (offload_states) through the GPU where NCCL needs it."""
    y = x.cuda() if x.is_cpu and dist.get_backend(group) == 'nccl' else x
    dist.all_reduce(y, group=group)
    return x.copy_(y)


def all_gather(x, dim, group):
    """Every rank's x, concatenated along dim in rank order."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty(dist.get_world_size(group) * len(x), *x.shape[1:])
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x, dim, group):
    """x summed over the ranks, this rank's 1/n slice along dim."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty(len(x) // dist.get_world_size(group), *x.shape[1:])
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def all_to_all(x, group, out_sizes=None, in_sizes=None):
    """x [n, ...]: x[j] goes to rank j; out[j] is what rank j sent us. With sizes (moe.py):
    in_sizes[j] rows of x go to rank j, out_sizes[j] rows come from rank j."""
    x = x.contiguous()
    rows = len(x) if out_sizes is None else sum(out_sizes)
    out = x.new_empty(rows, *x.shape[1:])
    dist.all_to_all_single(out, x, out_sizes, in_sizes, group=group)
    return out


# ----------------------------------------------------------------------------- Megatron's f and g
class _Pair(torch.autograd.Function):
    """A collective in forward, its adjoint in backward."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_fn(g), None, None


def enter_tp(x, mesh):
    """f, before the column-parallel matmuls: every tp rank needs all of x [B, S, h]; backward sums
    the partial dx."""
    g = mesh.tp_group
    # contiguous once: with B > 1, wq, wk, wv (w1, w3) would each make their own copy
    if mesh.sequence_parallel:
        return _Pair.apply(x, lambda x: all_gather(x, 1, g).contiguous(),
                           lambda d: reduce_scatter(d, 1, g))
    return _Pair.apply(x, lambda x: x.view_as(x), lambda d: all_reduce(d.contiguous().clone(), g))


class Collective(nn.Module):
    """f or g as a module (Collective(enter_tp, mesh), Collective(leave_tp, mesh)): parallelize puts
    it in the model's place for it (Attention.enter_tp, MLP.leave_tp, ...: model.NoCollective)."""

    def __init__(self, collective, mesh):
        super().__init__()
        self.collective, self.mesh = collective, mesh

    def forward(self, x):
        return self.collective(x, self.mesh)


def exchange(x, group, send=None, received=None):
    """x's rows, send[j] of them to rank j; received[j] rows come from rank j (expert parallelism's
    dispatch, moe.py); without sizes x[j] goes to rank j (Ulysses). An all-to-all's adjoint is the
    one back: gradients return as rows came."""
    return _Pair.apply(x, lambda x: all_to_all(x, group, received, send),
                       lambda d: all_to_all(d, group, send, received))


def leave_tp(x, mesh):
    """g, after the row-parallel matmuls (partial sums): reduce-scatter to our sequence shard (sp)
    or all-reduce."""
    g = mesh.tp_group
    if mesh.sequence_parallel:
        return _Pair.apply(x, lambda x: reduce_scatter(x, 1, g), lambda d: all_gather(d, 1, g))
    return _Pair.apply(x, lambda x: all_reduce(x.contiguous().clone(), g), lambda d: d)


# ----------------------------------------------------------------------------- sharding the weights
TP_SPLITS = {('tok_embeddings.weight', 'output.weight'): (0, 'vocab'),
             # (Qwen2's biases split with their rows)
             ('wk.weight', 'wv.weight', 'wk.bias', 'wv.bias'): (0, 'kv'),
             ('wq.weight', 'wq.bias', 'w1.weight', 'w3.weight'): (0, 'even'),
             ('wo.weight', 'w2.weight'): (1, 'even'),
             # moe.py's experts, stacked [E, I, h] and [E, h, I]: each expert's I split
             ('experts.w1', 'experts.w3'): (1, 'even'),
             ('experts.w2',): (2, 'even')}


def shard_spec(name, config, tp):
    """(dim, kind) of a parameter's split over tp, kind 'vocab', 'kv' (maybe replicated) or 'even';
    None: replicated."""
    if tp == 1 or 'norm' in name or name.endswith('router.weight'):
        return None
    for ends, spec in TP_SPLITS.items():
        if name.endswith(ends):
            return spec
    raise ValueError(f"no tensor-parallel rule for parameter {name}")


def is_replica(name, mesh, config):
    """True where this rank's tensor is a copy of another tp rank's (count it once in norms, save it
    once)."""
    spec = shard_spec(name, config, mesh.tp)
    if spec is None:  # a norm, whole on every tp rank
        return mesh.tp_rank > 0
    copies = mesh.tp // config.n_kv_head  # of each kv head, when K < t
    return spec[1] == 'kv' and copies > 1 and mesh.tp_rank % copies > 0


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank·n, (tp_rank+1)·n) of the table; other ids look up zeros; the ranks' sum is the
    lookup."""

    def __init__(self, weight, mesh):
        super().__init__()
        self.mesh, self.weight = mesh, weight

    def forward(self, idx):
        rows = len(self.weight)
        # (an id another rank holds looks up its row here, idx % rows, then zeros)
        outside = idx // rows != self.mesh.tp_rank
        e = F.embedding(idx % rows, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(e, self.mesh)  # all-reduce, or reduce-scatter to our sequence shard (sp)


# ----------------------------------------------------------------------------- attention over c
def ulysses(attend, group, q, k, v, docs=None, window=0):
    """The attention core under Ulysses: q [B, H, S/c, hd], k, v [B, K, S/c, hd] on contiguous
    sequence shards -> y like q. One all-to-all turns sequence shards of every head into the whole
    sequence of H/c heads (and K/c kv heads, the groups SDPA's enable_gqa forms), `attend` runs
    there as in one process (its window too), one all-to-all turns back."""
    c = dist.get_world_size(group)
    if k.shape[1] < c:  # fewer kv heads than ranks: each rank needs the kv head of its q heads
        k, v = (t.repeat_interleave(c // t.shape[1], dim=1) for t in (k, v))
    # an all-to-all is its own adjoint (exchange): the gradients go back the way the tensors came
    # q, k, v as [c, B, heads/c, S/c, hd], packed in one: head group j goes to rank j
    qkv = torch.cat([t.unflatten(1, (c, -1)) for t in (q, k, v)], dim=2).movedim(1, 0)
    qkv = exchange(qkv, group)
    # from rank j came sequence shard j of our heads: in rank order, the whole sequence
    qkv = qkv.movedim(0, 2).flatten(2, 3)
    # (docs: the whole sequence's)
    y = attend(*qkv.split([t.shape[1] // c for t in (q, k, v)], dim=1), docs, window)
    # back: sequence shard j of our heads to rank j
    y = exchange(y.unflatten(2, (c, -1)).movedim(2, 0), group)
    return y.movedim(0, 1).flatten(1, 2)


def shard_batch(mesh, x, y, positions=None, docs=None):
    """A global micro-batch (the same on every rank) -> this rank's (x, y, positions, docs): our dp
    rank's rows, our cp rank's tokens (the header's c = u × r: contiguous for Ulysses alone, zigzag
    chunks j and 2c-1-j of 2c for the ring alone) and their positions; docs (document starts in
    the flattened rows, model.attention) of our rows' whole sequences. One process: the batch as
    it is."""
    S, n = x.shape[1], len(x) // mesh.dp  # n rows per dp rank
    first = mesh.dp_rank * n
    rows = slice(first, first + n)
    x, y = x[rows], y[rows]
    if positions is not None:
        positions = positions[rows]
    if docs is not None:  # counted from our first row
        docs = docs - first * S
        docs = docs[(docs >= 0) & (docs < n * S)]
    if mesh.cp == 1:
        return x, y, positions, docs
    u = mesh.cp // mesh.cp_ring  # (the header's c = u × r)
    ring_rank, ulysses_rank = divmod(mesh.cp_rank, u)
    tokens = torch.arange(S, device=x.device)
    if mesh.cp_ring > 1:  # our ring rank j's zigzag chunks j and 2r-1-j
        tokens = tokens.view(2 * mesh.cp_ring, -1)[[ring_rank, -1 - ring_rank]].flatten()
    ours = tokens.view(u, -1)[ulysses_rank]  # Ulysses': our contiguous u-th of them
    positions = ours if positions is None else positions[:, ours]
    return x[:, ours], y[:, ours], positions, docs


# ----------------------------------------------------------------------------- the model, parallel
def parallelize(model, mesh):
    """The plan: shard a full model (every rank built the same one, from the seed) in
    place; names stay the model's. In order: pp keeps this stage's blocks; tp
    shards the weights and puts f, g in the model's places for them (attention, the MLP, the LM
    head's input); a mixture of experts becomes a ParallelMoE. (Context parallelism is the attention
    core's: apply_cores.)"""
    c, t = model.config, mesh.tp
    # this rank's stage: blocks [lo, hi), the embedding on the first, norm and LM head on the last
    # (pp = 1: one stage, all of them)
    lo = mesh.pp_rank * c.n_layer // mesh.pp
    hi = (mesh.pp_rank + 1) * c.n_layer // mesh.pp
    for i in list(model.layers):
        if not lo <= int(i) < hi:
            del model.layers[i]
    if lo > 0:
        model.tok_embeddings = None
    if hi < c.n_layer:
        model.norm = model.output = None
    for name, p in model.named_parameters():
        if '.experts.' in name:  # this ep rank's experts (of all: one process)
            p.data = p.data.chunk(mesh.ep)[mesh.ep_rank].clone()
        spec = shard_spec(name, c, t)
        if spec is None:  # a norm (or t = 1): whole on every tp rank
            continue
        dim, kind = spec
        full = p.data
        if kind == 'vocab':
            # ⌈V/t⌉ rows per rank; the last rank's rows past V are zeros, never a logit
            full = F.pad(full, (0, 0, 0, -len(full) % t))
        if kind == 'kv' and c.n_kv_head < t:
            # kv head j lives on tp ranks j·g .. j·g + g-1, g = t/K
            piece = full.chunk(c.n_kv_head)[mesh.tp_rank // (t // c.n_kv_head)]
        else:
            piece = full.chunk(t, dim)[mesh.tp_rank]
        # (a tied LM head shares the parameter: its piece too)
        p.data = piece.clone()
    # Megatron's f and g in the model's places for them (t > 1); a mixture of experts becomes a
    # ParallelMoE, which gathers and reduces itself (its router runs on the rank's own tokens)
    for block in model.layers.values():
        hooked = [block.attention]
        if isinstance(block.feed_forward, MoE):
            block.feed_forward = ParallelMoE(block.feed_forward, mesh)
        else:
            hooked.append(block.feed_forward)
        if t > 1:
            for m in hooked:
                m.enter_tp = Collective(enter_tp, mesh)
                m.leave_tp = Collective(leave_tp, mesh)
    if t > 1:
        # f before the LM head; the embedding by vocabulary rows
        model.enter_tp = Collective(enter_tp, mesh)
        if model.tok_embeddings is not None:
            model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, mesh)


def apply_cores(model, mesh, varlen=None):
    """Every Attention's core for this layout: model.attention (one varlen kernel for packed
    documents on CUDA, varlen None; True for a dry run that stands in for CUDA), under context
    parallelism Ulysses around it, the ring (ring.py) in its place, or Ulysses around the ring."""
    attend = partial(attention, varlen=varlen)
    # c = u × r: the ring in model.attention's place, and Ulysses' all-to-alls around it
    if mesh.ring_group is not None:
        attend = partial(RingAttention.apply, mesh.ring_group)
    if mesh.ulysses_group is not None:
        attend = partial(ulysses, attend, mesh.ulysses_group)
    for block in model.layers.values():
        block.attention.core = Core(attend)


# ----------------------------------------------------------------------------- experts, parallel
class ParallelMoE(MoE):
    """moe.MoE over the layout (moe.py's header): under tp every rank runs its slice of every
    expert on all tokens (gathered with their weights and choices, the output reduced); under ep
    each expert's rows go to the rank that owns it and back (two all-to-alls); the balance loss's
    counts are the micro-batch's, summed over the dp·cp ranks. Holds the MoE's own modules."""

    def __init__(self, moe, mesh):
        nn.Module.__init__(self)
        self.router, self.experts = moe.router, moe.experts
        self.config, self.mesh = moe.config, mesh
        self.aux_weight, self.aux_loss, self.aux_count = 1.0, 0.0, 0

    def route(self, x, chosen, weights):
        """moe.MoE.route; under tp every rank runs its slice of every expert on all tokens: they
        are gathered, with their weights (whose gradient is summed back, as x's) and choices, and
        the outputs summed (Megatron's f and g)."""
        mesh = self.mesh
        if mesh.tp == 1:
            return super().route(x, chosen, weights)
        x, weights = enter_tp(x, mesh), enter_tp(weights, mesh)
        if mesh.sequence_parallel:
            chosen = all_gather(chosen, 1, mesh.tp_group)
        return leave_tp(super().route(x, chosen, weights), mesh)

    def pair_counts(self, chosen):
        """The micro-batch's pairs of each expert: summed over the tp ranks' sequence shards (sp)
        and over the dp·cp ranks."""
        mesh = self.mesh
        counts = super().pair_counts(chosen)
        if mesh.tp > 1 and mesh.sequence_parallel:
            all_reduce(counts, mesh.tp_group)
        if mesh.dpcp_group is not None:
            all_reduce(counts, mesh.dpcp_group)
        return counts

    def dispatch(self, x, counts):
        """The experts' outputs for x [T·k, h], grouped by expert (counts[e] rows of expert e), at
        the ep ranks that own them."""
        mesh = self.mesh
        if mesh.ep == 1:
            return self.experts(x, counts)
        ep, group = mesh.ep, mesh.ep_group
        n = len(counts) // ep  # experts a rank holds
        # ours[j][e]: our rows for rank j's expert e; rows for rank j: its experts', next to each
        # other
        ours = [counts[j * n:(j + 1) * n] for j in range(ep)]
        send = [sum(row) for row in ours]
        # theirs[j][e]: rows rank j sends our expert e
        if isinstance(x, FakeTensor):
            # the dry run (no values): every rank routes as we do, balanced
            theirs = [ours[mesh.ep_rank]] * ep
        else:
            theirs = all_to_all(torch.tensor(ours, device=x.device), group).tolist()
        received = [sum(row) for row in theirs]
        # from each rank come its rows for our experts, by expert: the order that groups them by
        # expert (output_size: a length the dry run's fake tensors can't compute)
        expert = torch.arange(n, device=x.device).repeat(ep)
        rows = torch.tensor(theirs, device=x.device).flatten()
        order = expert.repeat_interleave(rows, output_size=sum(received)).argsort(stable=True)
        # (one expression: the rows as they came are freed once regrouped)
        x = exchange(x, group, send, received)[order]
        y = self.experts(x, [sum(column) for column in zip(*theirs)])[order.argsort()]
        # back in the order they came, and to the ranks they came from
        return exchange(y, group, received, send)


def shard_states(model, mesh, zero, dtype, on_host=False):
    """ZeRO-2 or 3 through FSDP2 over the d = dp·cp ranks holding the same weights (the header: what
    moves, when): ⌈rows/d⌉ rows of every fp32 tensor of this tp shard, gathered in dtype; on_host:
    the rows in host memory."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    vocab = {id(m.weight) for m in (model.output, model.tok_embeddings) if m is not None}
    # cast_forward_inputs=False: else each block keeps a bf16 copy of RoPE's fp32 tables (wrong at
    # long context)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if on_host else OffloadPolicy()
    def shard(module, over, reshard):
        """fully_shard module over the DeviceMesh `over`, its gradients reduced as a sum."""
        # the vocabulary's tp shards end in padding rows: FSDP2 splits them by column, the rows
        # stay whole
        fully_shard(module, mesh=over, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=host,
                    shard_placement_fn=lambda p: Shard(1) if id(p) in vocab else Shard(0))
        # a sum: forward_backward weighs each rank's loss by the step's tokens
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)

    for block in model.layers.values():
        # (a dense layer among Qwen3-MoE's has no experts)
        if mesh.ep > 1 and hasattr(block.feed_forward, 'experts'):
            # the experts' rows over the ranks holding the same experts
            shard(block.feed_forward.experts, mesh.edp_mesh, zero == 3)
        shard(block, mesh.dpcp_mesh, zero == 3)
    shard(model, mesh.dpcp_mesh, False)


# ------------------------------------------------------------------------- gradients and clipping
# (AdamW: optim.py)
# DDP's: at most one bucket is ever copied, never the whole model's gradients
BUCKET_BYTES = 25 * 2**20


def all_reduce_buckets(grads, group):
    """Sum each tensor over group, in place, a bucket at a time (a tensor larger than a bucket
    alone, uncopied). No group (one rank): nothing to do."""
    if group is None:
        return
    bucket = []
    for g in [*grads, None]:  # None: the last bucket
        if bucket and (g is None or sum(b.nbytes for b in bucket) + g.nbytes > BUCKET_BYTES):
            if len(bucket) == 1:
                all_reduce(bucket[0], group)
            else:
                flat = all_reduce(torch.cat([b.flatten() for b in bucket]), group)
                for b, piece in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(piece.view_as(b))
            bucket = []
        bucket.append(g)


def sync_grads(named_params, mesh, config):
    """After backward, each rank's gradients of the whole step. named_params: (model's name, tensor
    holding .grad). The norms saw only our tokens under sp: summed over tp; replicated kv heads over
    the copies; everything over dp × cp (the loss was divided by the step's global token count: a
    sum is the mean). One process: every group is None, nothing moves."""
    for _, p in named_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [(n, local(p.grad)) for n, p in named_params]
    # the norms and MoE's router, whole on every tp rank (t = 1: all, and no group): under sp
    # each saw its tokens; Qwen3's q and k norms saw the rank's heads, sp or not
    heads = ('q_norm.weight', 'k_norm.weight')
    all_reduce_buckets([g for n, g in grads if shard_spec(n, config, mesh.tp) is None
                        and (mesh.sequence_parallel or n.endswith(heads))], mesh.tp_group)
    # replicated kv heads: over their copies (K >= t: no group)
    kv = ('wk.weight', 'wv.weight', 'wk.bias', 'wv.bias')
    all_reduce_buckets([g for n, g in grads if n.endswith(kv)], mesh.kv_group)
    # zero=2, 3: FSDP2 reduce-scattered them over dp·cp in backward
    if not isinstance(named_params[0][1], DTensor):
        all_reduce_buckets([g for n, g in grads if '.experts.' not in n], mesh.dpcp_group)
        # experts: over the ranks holding the same ones (all dpcp ranks without ep)
        all_reduce_buckets([g for n, g in grads if '.experts.' in n], mesh.edp_group)


def local(x):
    """This rank's rows of an FSDP2 tensor (a leaf, sharing its storage), or x."""
    return x.to_local().detach() if isinstance(x, DTensor) else x


def clip_grad_norm_(named_params, max_norm, mesh, config):
    """torch.nn.utils.clip_grad_norm_ over the whole model: squares of every shard, each element
    once."""
    # (tensors: under ep a stage may hold only dense layers, Qwen3-MoE's)
    squares, experts = torch.zeros(()), torch.zeros(())
    for n, p in named_params:
        if is_replica(n, mesh, config):
            continue
        square = torch.linalg.vector_norm(local(p.grad), dtype=torch.float32) ** 2
        if '.experts.' in n:
            experts = experts + square
        else:
            squares = squares + square
    # each element once: summed over tp's shards, pp's stages and FSDP2's rows (over dp·cp); the
    # ep ranks' experts are others (FSDP2's rows of them too: summed over dp·cp)
    fsdp = isinstance(named_params[0][1], DTensor)
    if mesh.ep_group is not None and not fsdp:
        all_reduce(experts, mesh.ep_group)
    squares = squares + experts
    for group in (mesh.tp_group, mesh.pp_group, mesh.dpcp_group if fsdp else None):
        if group is not None:
            all_reduce(squares, group)
    norm = squares.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, p in named_params:
        local(p.grad).mul_(coef.to(p.grad.dtype))
    return norm
