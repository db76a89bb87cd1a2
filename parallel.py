"""
Tensor, sequence, context, pipeline and data parallelism over torchrun, as hooks on the model's own modules.

A mesh of world = d × p × c × t ranks (t fastest: a tp group is neighbouring GPUs on one node). S tokens
per sequence, B sequences per rank, h width, H heads, K kv heads, I the MLP's width, V vocabulary,
N parameters, b bytes per element. What each dimension saves, per rank:

  t   tensor parallel (Megatron, Shoeybi 2019): wq, wk, wv, w1, w3 split by output (heads, I), wo, w2
      by input, embedding and LM head by vocabulary rows (⌈V/t⌉ each, the last rank's past V padding);
      kv heads replicated when K < t. Weights, gradients, optimizer states: N -> about N/t.
  sp  sequence parallel (Korthikanti 2022), on with t: norms and residuals hold S/t tokens; activations
      kept per layer S·B·h·(10 + 24/t) bytes -> S·B·h·34/t (Megatron's count, bf16). The price is
      transient: the gathered input and the partial sums of the matmuls are whole S·B·h·b tensors.
  c   context parallel: every activation holds S/c tokens. Attention swaps sequence shards for head
      shards (DeepSpeed-Ulysses, Jacobs 2023: the model's own attention on the whole sequence, H/c
      heads) or passes k, v around a ring (ring attention, Liu 2023; zigzag halves balance the mask).
  p   pipeline parallel (GPipe, Huang 2019; 1F1B, Narayanan 2021): stage r keeps blocks [r·L/p, (r+1)·L/p) (the
      embedding on the first, the LM head on the last): states N -> N/p, no collective inside a layer. Not the
      activations: the first stage holds p micro-batches in flight under 1F1B (pipeline.py).
  d   data parallel: other sequences. Gradients are summed over dp × cp in ~25 MB buckets (DDP's), never one flat copy
      of them all; or FSDP2 (shard_states: torch's fully_shard, ZeRO, Rajbhandari 2020) keeps 1/d of every fp32
      row of the tp shard over the d = dp·c ranks holding the same weights: zero=2 the gradients and AdamW's
      moments, zero=3 the weights too: 16·N/(t·d) bytes; offload_states=True keeps those rows in host memory.

parallelize(model, mesh) shards the weights in place, hooks Megatron's f, g onto block.attention and block.feed_forward
(they read their head counts from the weights' shapes), wraps Attention.attend for c, sets Llama.vocab_group
(chunked.py's vocabulary-parallel loss): a fork that changes model.attention runs under t and Ulysses as is.

What moves per block, forward (backward), B·S·h elements each unless said; every collective is one of
the five functions below (chunked.py's loss makes its own):
  t               2 all-reduce (2)                                  f before wq|w1, g after wo|w2
  t with sp       2 all-gather + 2 reduce-scatter (2 + 2)           the same volume
  c Ulysses       2 all-to-all (2): q, k, v packed in one, the output in the other   (H/c heads move)
  c ring          c-1 shifts of k, v (c-1 of k, v + c of dk, dv); kv heads, never repeated ones
  recompute=full  the forward's again in backward but the last g (torch's checkpoint stops early)
  d, zero=2       1 all-gather of its rows in bf16 before its forward (2·N_block/t bytes), kept to its backward,
                  1 reduce-scatter of its fp32 gradients after it (4·N_block/t); zero=3 gathers again for backward
  offload_states  its fp32 rows come in from the host before each all-gather, its gradients' rows go out after
  p, per stage    1 send of its output to the next stage, B·S·h/(c·t) elements, point to point (1 gradient back)
Per step: embedding 1 (g), LM head input 1 (f), per loss chunk one all-gather of [B·S/chunks]
log-sum-exps, 1 all-reduce of the target logits. FSDP2 gathers the embedding, final norm and LM head once
(before the forward, kept to the end of the backward) and reduce-scatters their gradients last.
A pipeline of p stages over M micro-batches (gradient_accumulation_steps) idles (p - 1)/(M + p - 1) of a step, its
bubble, 1F1B and GPipe alike: M >= 4p keeps it under 20%. It pays where the states don't fit t × d sharding on
one node's fast links: its sends are small and few, fit for the slower links between nodes.
"""
import functools
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


# ----------------------------------------------------------------------------- setup: torchrun, mesh
@dataclass
class Mesh:
    """Where this rank sits: rank = ((dp_rank·pp + pp_rank)·cp + cp_rank)·tp + tp_rank. A group is None when of
    size 1; dpcp_group: the ranks holding the same weights; kv_group: the tp ranks sharing one kv head (K < t)."""
    world: int = 1
    rank: int = 0
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    cp_impl: str = 'ulysses'
    sequence_parallel: bool = True
    tp_group: object = None
    cp_group: object = None
    dpcp_group: object = None
    kv_group: object = None
    dpcp_mesh: object = None  # FSDP2's DeviceMesh of them (of one rank too: offload_states), made before fake tensors
    pp: int = 1  # (after the others: a Mesh(...) by position predates pp)
    pp_rank: int = 0
    pp_group: object = None


def check_layout(config, world, tp, cp, cp_impl='ulysses', seq_len=None, zero=0, device_type='cpu',
                 dtype=torch.float32, doc_mask=False, states_on_host=False, pp=1, microbatches=1, schedule='1f1b'):
    """None, or the one-line reason this layout can't run config (a LlamaConfig or anything with its
    fields), asked on every rank before anything is allocated. The one owner of the layout rules."""
    c, S, H, K = config, seq_len or 0, config.n_head, config.n_kv_head
    if tp < 1 or cp < 1 or pp < 1 or world % (tp * cp * pp):
        return f"world size {world} is not divisible by pp_size * cp_size * tp_size = {pp} * {cp} * {tp}"
    uly, ring = cp > 1 and cp_impl == 'ulysses', cp > 1 and cp_impl == 'ring'
    h, k, s = H // tp, K // tp or 1, S // cp  # heads, kv heads per tp rank; tokens per cp rank
    # offload.py's token-wise recompute replays attention's saved output: the ring's is merged from several calls
    replay = ring and c.offload > 0 and (c.recompute == 'selective' or c.recompute == 'none' and c.offload < 1)
    rules = [
        (H % tp, f"n_head={H} is not divisible by tp_size={tp}"),
        (K % tp and tp % K, f"n_kv_head={K} and tp_size={tp}: one must divide the other (kv heads split or copied)"),
        (c.intermediate_size % tp, f"intermediate_size={c.intermediate_size} is not divisible by tp_size={tp}"),
        (cp_impl not in ('ulysses', 'ring'), f"cp_impl must be 'ulysses' or 'ring', got {cp_impl!r}"),
        (zero not in (0, 2, 3), f"zero must be 0, 2 or 3, got {zero!r}" + " (zero=1 became 2: FSDP2 shards the "
         "gradients too)" * (zero == 1)),
        (zero > 1 and world == tp * pp and not states_on_host,
         f"zero={zero} shards over the dp x cp ranks: there is one (world {world}, tp {tp})"),
        (states_on_host and zero != 3, "offload_states=True streams each block's weights in from the host: zero=3"),
        (uly and S % cp, f"seq_len={S} is not divisible by cp_size={cp}"),
        (uly and h % cp, f"n_head / tp_size = {h} heads per rank are not divisible by cp_size={cp} (Ulysses)"),
        (uly and k % cp and cp % k, f"{k} kv heads per rank and cp_size={cp}: one must divide the other (Ulysses)"),
        (ring and S % (2 * cp), f"seq_len={S} is not divisible by 2 * cp_size = {2 * cp} (ring's zigzag chunks)"),
        (ring, ring and flash_error(device_type, dtype, c.n_embd // H)),
        (ring and doc_mask, "doc_mask=True with cp_impl='ring': a document crosses the ring's zigzag chunks, and "
         "each step would need its own mask; use cp_impl='ulysses' (it sees whole documents)"),
        (replay, replay and f"offload={c.offload} with recompute={c.recompute!r} and cp_impl='ring': ring attention's "
         "output can't be replayed in a recompute (offload.py); use recompute='full'"
         + (", cp_impl='ulysses' or offload=1" if c.recompute == 'none' else " or cp_impl='ulysses'")),
        (tp > 1 and s % tp, f"seq_len / cp_size = {s} is not divisible by tp_size={tp} (sequence parallelism)"),
        (schedule not in ('1f1b', 'gpipe'), f"pp_schedule must be '1f1b' or 'gpipe', got {schedule!r}"),
        (pp > c.n_layer, f"pp_size={pp} stages need a block each: n_layer={c.n_layer}"),
        (pp > 1 and schedule == '1f1b' and microbatches < pp, f"pp_schedule='1f1b' runs gradient_accumulation_steps="
         f"{microbatches} micro-batches through {pp} stages: it needs at least as many (or pp_schedule='gpipe')"),
        (pp > 1 and c.tie_embeddings, "tie_embeddings=True with pp_size > 1: one weight on the first and last stage"),
        (pp > 1 and doc_mask, "doc_mask=True with pp_size > 1: torch's schedule can't split the documents' starts"),
        (pp > 1 and c.offload > 0, f"offload={c.offload} with pp_size > 1: offload.py's host pool holds one "
         "micro-batch's blocks, a stage keeps up to pp_size; use recompute"),
    ]
    return next((why for bad, why in rules if bad and why), None)

def init_distributed(device_type, fake=False, timeout_s=300, one=False):
    """(world, rank, local_rank), in torchrun's process group (NCCL on CUDA, gloo on CPU) or one: a group of one rank
    (FSDP2's, offload_states); fake (the dry run): rank RANK (0) of WORLD_SIZE whose collectives return at once."""
    world, local_rank = int(os.environ.get('WORLD_SIZE', 1)), int(os.environ.get('LOCAL_RANK', 0))
    if world == 1 and not one or fake:
        if fake and (world > 1 or one):
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group('fake', store=FakeStore(), rank=int(os.environ.get('RANK', 0)), world_size=world)
        return world, 0, 0
    if device_type == 'cuda':
        torch.cuda.set_device(local_rank)
    # a rank blocked in a collective gives up after timeout_s (a rank died or hangs); torchrun's agent may end it sooner
    alone = dict(store=dist.HashStore(), rank=0, world_size=1) if world == 1 else {}  # no torchrun: our own store
    dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo', timeout=timedelta(seconds=timeout_s), **alone)
    return world, dist.get_rank(), local_rank

def make_mesh(tp, cp, cp_impl='ulysses', n_kv_head=None, sequence_parallel=True, timeout_s=None, device_type='cpu',
              pp=1):
    """The d × p × c × t mesh of the current process group. Every rank creates every group, in order."""
    if not dist.is_initialized():
        return Mesh(cp_impl=cp_impl, sequence_parallel=sequence_parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = torch.arange(world).view(-1, pp, cp, tp)  # [dp, pp, cp, tp]
    m = Mesh(world, rank, len(grid), cp, tp, rank // (pp * cp * tp), rank // tp % cp, rank % tp, cp_impl,
             sequence_parallel, pp=pp, pp_rank=rank // (cp * tp) % pp)
    timeout = timeout_s and timedelta(seconds=timeout_s)  # a group's own default is 30 minutes, not the world's

    def groups(sets, one=False):  # new_group is collective: every rank builds every group, in order; keep ours
        made = [(dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 or one else None, ranks)
                for ranks in sets.tolist()]
        return next(g for g, ranks in made if rank in ranks)
    m.tp_group = groups(grid.reshape(-1, tp))
    m.cp_group = groups(grid.transpose(2, 3).reshape(-1, cp))
    m.pp_group = groups(grid.permute(0, 2, 3, 1).reshape(-1, pp))
    m.dpcp_group = groups(dpcp := grid.permute(1, 3, 0, 2).reshape(pp * tp, -1))  # one pp stage, one tp shard
    m.dpcp_mesh = DeviceMesh.from_group(m.dpcp_group or groups(dpcp, one=True), device_type)
    if n_kv_head is not None and n_kv_head < tp:  # kv head h on tp ranks h·g .. h·g + g-1, g = t/K
        m.kv_group = groups(grid.reshape(-1, tp // n_kv_head))
    return m


# ----------------------------------------------------------------------------- the collectives
# Every byte between ranks moves here (tests count the calls), contiguous with the split dimension first: flat memory.

def all_reduce(x, group):  # the sum, in place; a host tensor (offload_states) through the GPU where NCCL needs it
    y = x.cuda() if x.is_cpu and dist.get_backend(group) == 'nccl' else x
    dist.all_reduce(y, group=group)
    return x.copy_(y)

def all_gather(x, dim, group):  # every rank's x, concatenated along dim in rank order
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)

def reduce_scatter(x, dim, group):  # x summed over the ranks, this rank's 1/n slice along dim
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)

def all_to_all(x, group):  # x [n, ...]: x[j] goes to rank j; out[j] is what rank j sent us
    out = torch.empty_like(x := x.contiguous())
    dist.all_to_all_single(out, x, group=group)
    return out

def ring_shift(x, group):
    """Send x to the next rank, get the previous one's; the returned function waits for it (NCCL: stream, not host)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(x := x.contiguous())
    # one batch, so NCCL posts the send and the receive together (two separate calls deadlock a ring)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dist.get_global_rank(group, (r + 1) % n), group),
                                    dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group)])

    def wait():
        for w in works:
            w.wait()
        return recv
    return wait


# ----------------------------------------------------------------------------- Megatron's f and g
class _Pair(Function):
    """A collective in forward, its adjoint in backward."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_fn(g), None, None


def enter_tp(x, mesh):
    """f, before the column-parallel matmuls: every tp rank needs all of x [B, S, h]; backward sums the partial dx."""
    g = mesh.tp_group
    if mesh.sequence_parallel:  # contiguous once: with B > 1, wq, wk, wv (w1, w3) would each keep a copy
        return _Pair.apply(x, lambda x: all_gather(x, 1, g).contiguous(), lambda d: reduce_scatter(d, 1, g))
    return _Pair.apply(x, lambda x: x.view_as(x), lambda d: all_reduce(d.contiguous().clone(), g))

def leave_tp(x, mesh):
    """g, after the row-parallel matmuls (partial sums): reduce-scatter to our sequence shard (sp) or all-reduce."""
    g = mesh.tp_group
    if mesh.sequence_parallel:
        return _Pair.apply(x, lambda x: reduce_scatter(x, 1, g), lambda d: all_gather(d, 1, g))
    return _Pair.apply(x, lambda x: all_reduce(x.contiguous().clone(), g), lambda d: d)


# ----------------------------------------------------------------------------- sharding the weights
TP_SPLITS = {('tok_embeddings.weight', 'output.weight'): (0, 'vocab'), ('wk.weight', 'wv.weight'): (0, 'kv'),
             ('wq.weight', 'w1.weight', 'w3.weight'): (0, 'even'), ('wo.weight', 'w2.weight'): (1, 'even')}


def shard_spec(name, config, tp):
    """(dim, kind) of a parameter's split over tp, kind 'vocab', 'kv' (maybe replicated) or 'even'; None: replicated."""
    if tp == 1 or 'norm' in name:
        return None
    spec = next((spec for ends, spec in TP_SPLITS.items() if name.endswith(ends)), None)
    if spec is None:
        raise ValueError(f"no tensor-parallel rule for parameter {name}")
    return spec

def is_replica(name, mesh, config):
    """True where this rank's tensor is a copy of another tp rank's (count it once in norms, save it once)."""
    spec, K = shard_spec(name, config, mesh.tp), config.n_kv_head
    return mesh.tp_rank > 0 if spec is None else spec[1] == 'kv' and K < mesh.tp and mesh.tp_rank % (mesh.tp // K) > 0


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank·n, (tp_rank+1)·n) of the table; other ids look up zeros; the ranks' sum is the lookup."""

    def __init__(self, weight, mesh):
        super().__init__()
        self.mesh, self.weight = mesh, weight

    def forward(self, idx):
        local = idx - self.mesh.tp_rank * self.weight.shape[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        e = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(e, self.mesh)  # all-reduce, or reduce-scatter to our sequence shard (sp)


# ----------------------------------------------------------------------------- attention over c
def ulysses(attend, group, q, k, v, docs=None):
    """Attention.attend under Ulysses: q [B, H, S/c, hd], k, v [B, K, S/c, hd] on contiguous sequence shards -> y
    like q. One all-to-all turns sequence shards of every head into the whole sequence of H/c heads (and K/c kv
    heads, the groups SDPA's enable_gqa forms), `attend` runs there as in one process, one all-to-all turns back."""
    c, (B, H, Sc, hd) = dist.get_world_size(group), q.shape
    if k.shape[1] < c:  # fewer kv heads than ranks: each rank needs the kv head of its q heads
        k, v = (t.repeat_interleave(c // t.shape[1], dim=1) for t in (k, v))
    K = k.shape[1]
    split = lambda t: t.view(B, c, t.shape[1] // c, Sc, hd)  # head groups, one per destination rank
    swap = lambda t: _Pair.apply(t, lambda x: all_to_all(x, group), lambda d: all_to_all(d, group))  # self-adjoint
    qkv = swap(torch.cat([split(q), split(k), split(v)], dim=2).movedim(1, 0))
    qkv = qkv.movedim(0, 2).reshape(B, (H + 2 * K) // c, c * Sc, hd)  # [source = sequence shard] in order
    y = attend(*qkv.split([H // c, K // c, K // c], dim=1), docs)  # docs: of the whole sequence, as in one process
    y = swap(y.reshape(B, H // c, c, Sc, hd).movedim(2, 0))
    return y.movedim(0, 1).reshape(B, H, Sc, hd)

def flash_error(device_type, dtype, head_dim):
    """None, or why ring attention's fused flash kernel can't run here (check_layout asks up front)."""
    cuda = "cp_impl='ring' on CUDA calls flash attention, which needs"
    if device_type not in ('cuda', 'cpu'):
        return f"cp_impl='ring' calls flash attention on CUDA or a CPU, not {device_type} (use cp_impl='ulysses')"
    if device_type == 'cuda' and dtype not in (torch.float16, torch.bfloat16):
        return f"{cuda} bfloat16 or float16, not {dtype} (use dtype='bfloat16' or cp_impl='ulysses')"
    if device_type == 'cuda' and (head_dim > 256 or head_dim % 8):
        return f"{cuda} head_dim <= 256 and a multiple of 8, not {head_dim} (use cp_impl='ulysses')"

def flash(q, k, v, causal, backward=None):
    """(out, lse [B, H, S] fp32, saved) of the fused flash kernel; with backward=(dout, out, lse, saved): (dq, dk, dv).
    k, v have q's heads. SDPA hides the log-sum-exp the ring merges with: the one private aten kernel, by keyword."""
    if why := flash_error(q.device.type, q.dtype, q.shape[-1]):
        raise ValueError(why)
    aten, kw = torch.ops.aten, dict(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal)
    if backward is None and q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(**kw)
        return out, lse, dict(cum_seq_q=cq, cum_seq_k=ck, max_q=mq, max_k=mk, philox_seed=seed, philox_offset=offset)
    if backward is None:
        return *aten._scaled_dot_product_flash_attention_for_cpu(**kw), {}
    dout, out, lse, saved = backward
    bwd = aten._scaled_dot_product_flash_attention_backward if q.is_cuda else \
        aten._scaled_dot_product_flash_attention_for_cpu_backward
    return bwd(grad_out=dout, out=out, logsumexp=lse, **kw, **saved)[:3]

def _ring_steps(q, k, v, group):
    """Rank r of P holds zigzag chunks r and 2P-1-r of 2P (n tokens each). At step s it holds the k, v of rank (r - s)
    mod P and yields (its q rows, those kv rows, causal, k, v with q's heads): step 0 is causal over our own chunks; an
    earlier rank's first chunk precedes all our tokens (its second follows them all); a later rank's two chunks precede
    our second chunk and follow our first. The next k, v (kv heads, not repeats) move meanwhile."""
    P, r, n, rep = dist.get_world_size(group), dist.get_rank(group), k.shape[2] // 2, q.shape[1] // k.shape[1]
    every, first, second, kv = slice(None), slice(0, n), slice(n, None), torch.stack([k, v])
    for s in range(P):
        nxt = ring_shift(kv, group) if s < P - 1 else None
        rows, cols, causal = (every, every, True) if s == 0 else (every, first, False) if (r - s) % P < r else \
            (second, every, False)
        yield rows, cols, causal, *(t[:, :, cols].repeat_interleave(rep, dim=1).contiguous() for t in kv)
        kv = nxt() if nxt else kv


class RingAttention(Function):
    """Attention.attend under ring attention (partial(RingAttention.apply, group)): q [B, H, 2n, hd], k, v [B, K, 2n,
    hd] zigzag shards -> y like q, causal. Online softmax merges each step's flash (out, lse) over one block of keys;
    backward: given the final out and lse, each block's flash backward is its exact share; dk, dv ride the ring home."""

    @staticmethod
    def forward(ctx, group, q, k, v):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        ctx.saved, ctx.group = [], group
        for rows, cols, causal, k_heads, v_heads in _ring_steps(q, k, v, group):
            o, l, saved = flash(q[:, :, rows].contiguous(), k_heads, v_heads, causal)
            new = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1) + \
                o.float() * (l - new).exp().unsqueeze(-1)
            lse[:, :, rows] = new
            ctx.saved.append(saved)
        ctx.save_for_backward(q, k, v, out := out.to(q.dtype), lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        fold = lambda g: g.float().view(g.shape[0], k.shape[1], -1, *g.shape[2:]).sum(2)  # repeats -> kv heads
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        for (rows, cols, causal, k_heads, v_heads), saved in zip(_ring_steps(q, k, v, ctx.group), ctx.saved):
            part = lambda t: t[:, :, rows].contiguous()
            dq_, dk, dv = flash(part(q), k_heads, v_heads, causal, backward=(part(dout), part(out), part(lse), saved))
            dq[:, :, rows] += dq_.float()
            dkv[:, :, :, cols] += torch.stack([fold(dk), fold(dv)])
            dkv = ring_shift(dkv, ctx.group)()  # after P shifts each dk, dv is back with its owner
        return None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def shard_batch(mesh, x, y, positions=None, docs=None):
    """A global micro-batch (the same on every rank) -> this rank's (x, y, positions, docs): our dp rank's rows,
    our cp rank's tokens (contiguous for Ulysses; zigzag chunks r and 2c-1-r of 2c for the ring) and their
    positions; docs (document starts in the flattened rows, model.attention) of our rows' whole sequences."""
    n, c, r, S = x.shape[0] // mesh.dp, mesh.cp, mesh.cp_rank, x.shape[1]
    rows = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
    x, y, positions = x[rows], y[rows], positions if positions is None else positions[rows]
    docs = docs if docs is None else docs[(docs >= rows.start * S) & (docs < rows.stop * S)] - rows.start * S
    if c == 1:
        return x, y, positions, docs
    tokens = torch.arange(S, device=x.device)
    pos = tokens.view(c, -1)[r] if mesh.cp_impl == 'ulysses' else tokens.view(2 * c, -1)[[r, 2 * c - 1 - r]].flatten()
    return x[:, pos], y[:, pos], pos if positions is None else positions[:, pos], docs


# ----------------------------------------------------------------------------- the model, parallel
def parallelize(model, mesh):
    """Shard a full model (every rank built the same one) in place, hook the collectives on; names stay the model's."""
    c = model.config
    if mesh.pp > 1:  # this rank's stage: blocks [lo, hi), the embedding on the first, norm and LM head on the last
        lo, hi = mesh.pp_rank * c.n_layer // mesh.pp, (mesh.pp_rank + 1) * c.n_layer // mesh.pp
        model.layers = nn.ModuleDict({i: block for i, block in model.layers.items() if lo <= int(i) < hi})
        for name in ['tok_embeddings'] * (lo > 0) + ['norm', 'output'] * (hi < c.n_layer):
            setattr(model, name, None)
        model.pipelined = True
    if mesh.tp > 1:
        for name, p in list(model.named_parameters()):
            dim, kind, t, full = *(shard_spec(name, c, mesh.tp) or (0, None)), mesh.tp, p.data
            if kind == 'vocab':  # ⌈V/t⌉ rows per rank; the last rank's rows past V are zeros, never a logit
                full = F.pad(full, (0, 0, 0, -full.shape[0] % t))
            if kind == 'kv' and c.n_kv_head < t:  # kv head h lives on tp ranks h·g .. h·g + g-1, g = t/K
                full = full.chunk(c.n_kv_head)[mesh.tp_rank // (t // c.n_kv_head)]
            elif kind:
                full = full.chunk(t, dim)[mesh.tp_rank]
            model.get_submodule(name.rsplit('.', 1)[0]).weight = nn.Parameter(full.clone())
        if c.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        if model.tok_embeddings is not None:
            model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, mesh)
        for block in model.layers.values():
            for m in (block.attention, block.feed_forward):
                m.register_forward_pre_hook(lambda m, args: (enter_tp(args[0], mesh), *args[1:]))
                m.register_forward_hook(lambda m, args, y: leave_tp(y, mesh))
        model.norm and model.norm.register_forward_hook(lambda m, args, y: enter_tp(y, mesh))  # the LM head's input
        model.vocab_group = mesh.tp_group  # Llama.head: chunked.py's loss over our rows of the vocabulary
    for attn in [block.attention for block in model.layers.values() if mesh.cp > 1]:
        attn.attend = functools.partial(ulysses, attn.attend, mesh.cp_group) if mesh.cp_impl == 'ulysses' else \
            lambda q, k, v, docs: RingAttention.apply(mesh.cp_group, q, k, v)  # docs: refused by check_layout
    model.mesh = mesh
    return model

def shard_states(model, mesh, zero, dtype, on_host=False):
    """ZeRO-2 or 3 through FSDP2 over the d = dp·cp ranks holding the same weights (the header: what moves, when):
    ⌈rows/d⌉ rows of every fp32 tensor of this tp shard, gathered in dtype; on_host: the rows in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    # the vocabulary's tp shards end in padding rows: FSDP2 splits them by column, the rows stay whole
    vocab = {id(m.weight) for m in (model.output, model.tok_embeddings) if m is not None}
    by_column = lambda p: Shard(1) if id(p) in vocab else Shard(0)
    # cast_forward_inputs=False: else each block keeps a bf16 copy of RoPE's fp32 tables (wrong at long context)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if on_host else OffloadPolicy()
    kw = dict(mesh=mesh.dpcp_mesh, mp_policy=mp, shard_placement_fn=by_column, offload_policy=host)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=zero == 3, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    for m in (*model.layers.values(), model):
        m.set_gradient_divide_factor(1.0)  # a sum: forward_backward weighs each rank's loss by the step's tokens
        m.set_force_sum_reduction_for_comms(True)
    return model


# ----------------------------------------------------------------------------- gradients and clipping (AdamW: optim.py)
BUCKET_BYTES = 25 * 2**20  # DDP's: at most one bucket is ever copied, never the whole model's gradients


def all_reduce_buckets(grads, group):
    """Sum each tensor over group, in place, a bucket at a time (a tensor larger than a bucket alone, uncopied)."""
    if group is None:
        return
    bucket = []
    for g in [*grads, None]:  # None: the last bucket
        if bucket and (g is None or sum(b.nbytes for b in bucket) + g.nbytes > BUCKET_BYTES):
            if len(bucket) == 1:
                all_reduce(bucket[0], group)
            else:
                flat = all_reduce(torch.cat([b.reshape(-1) for b in bucket]), group)
                for b, piece in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(piece.view_as(b))
            bucket = []
        bucket.append(g)

def sync_grads(named_params, mesh, config):
    """After backward, each rank's gradients of the whole step. named_params: (model's name, tensor holding
    .grad). The norms saw only our tokens under sp: summed over tp; replicated kv heads over the copies;
    everything over dp × cp (the loss was divided by the step's global token count: a sum is the mean)."""
    for _, p in named_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    fsdp = isinstance(named_params[0][1], DTensor)  # zero=2, 3: FSDP2 reduce-scattered over dp·cp in backward
    grads = [(n, local(p.grad)) for n, p in named_params]
    if mesh.tp > 1 and mesh.sequence_parallel:
        all_reduce_buckets([g for n, g in grads if shard_spec(n, config, mesh.tp) is None], mesh.tp_group)
    all_reduce_buckets([g for n, g in grads if n.endswith(('wk.weight', 'wv.weight'))], mesh.kv_group)
    all_reduce_buckets([g for _, g in grads], None if fsdp else mesh.dpcp_group)

def local(x):  # this rank's rows of an FSDP2 tensor (a leaf, sharing its storage), or x
    return x.to_local().detach() if isinstance(x, DTensor) else x

def clip_grad_norm_(named_params, max_norm, mesh, config):
    """torch.nn.utils.clip_grad_norm_ over the whole model: squares of every shard, each element once."""
    sq = sum(torch.linalg.vector_norm(local(p.grad), dtype=torch.float32) ** 2
             for n, p in named_params if not is_replica(n, mesh, config))
    for group in (mesh.tp_group, mesh.pp_group, isinstance(named_params[0][1], DTensor) and mesh.dpcp_group):
        sq = all_reduce(sq, group) if group else sq
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, p in named_params:
        local(p.grad).mul_(coef.to(p.grad.dtype))
    return norm
