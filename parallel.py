"""
Tensor, sequence, context and data parallelism over torchrun, as hooks on the model's own modules.

A mesh of world = d × c × t ranks (t fastest: a tp group is neighbouring GPUs on one node). S tokens
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
  d   data parallel: other sequences; gradients summed over d·c, ZeRO-1 over d·c (below the marker).

parallelize(model, mesh) shards the weights in place and hooks Megatron's f (before the column-parallel
matmuls: identity, or all-gather of the sequence) and g (after the row-parallel ones: all-reduce, or
reduce-scatter) onto block.attention and block.feed_forward, which read their head counts from the
weights' shapes; wraps Attention.attend for c; and sets Llama.vocab_group, so the LM head's loss is
chunked.py's, vocabulary parallel. A fork that changes model.attention runs under t and Ulysses as is.

What moves per block, forward (backward), B·S·h elements each unless said; every collective is one of
the six functions below (chunked.py's loss makes its own):
  t               2 all-reduce (2)                                  f before wq|w1, g after wo|w2
  t with sp       2 all-gather + 2 reduce-scatter (2 + 2)           the same volume
  c Ulysses       2 all-to-all (2): q, k, v packed in one, the output in the other   (H/c heads move)
  c ring          c-1 shifts of k, v (c-1 of k, v + c of dk, dv); kv heads, never repeated ones
  recompute=full  the forward's again in backward but the last g (torch's checkpoint stops early)
Per step: embedding 1 (g), LM head input 1 (f), per loss chunk one all-gather of [B·S/chunks]
log-sum-exps, 1 all-reduce of the target logits.
"""
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function


# ----------------------------------------------------------------------------- setup: torchrun, mesh

@dataclass
class Mesh:
    """Where this rank sits: rank = (dp_rank · cp + cp_rank) · tp + tp_rank. Groups are None when of size 1."""
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
    dp_group: object = None
    dpcp_group: object = None   # the ranks holding the same weights: gradients are summed over it
    kv_group: object = None     # tp ranks sharing one kv head (K < t)


def check_layout(config, world, tp, cp, cp_impl='ulysses', seq_len=None, zero=0, device_type='cpu',
                 dtype=torch.float32):
    """None, or the one-line reason this layout can't run config (a LlamaConfig or anything with its
    fields), asked on every rank before anything is allocated. The one owner of the layout rules."""
    c, S, H, K, hd = config, seq_len, config.n_head, config.n_kv_head, config.n_embd // config.n_head
    if tp < 1 or cp < 1 or world % (tp * cp):
        return f"world size {world} is not divisible by tp_size * cp_size = {tp} * {cp}"
    if H % tp:
        return f"n_head={H} is not divisible by tp_size={tp}"
    if K % tp and tp % K:
        return f"n_kv_head={K} and tp_size={tp}: one must divide the other (kv heads are split or replicated)"
    if c.intermediate_size % tp:
        return f"intermediate_size={c.intermediate_size} is not divisible by tp_size={tp}"
    if cp_impl not in ('ulysses', 'ring'):
        return f"cp_impl must be 'ulysses' or 'ring', got {cp_impl!r}"
    if zero not in (0, 1):
        return f"zero must be 0 or 1, got {zero!r}"
    if cp > 1 and cp_impl == 'ulysses':
        if S % cp:
            return f"seq_len={S} is not divisible by cp_size={cp}"
        if (H // tp) % cp:
            return f"n_head / tp_size = {H // tp} heads per rank are not divisible by cp_size={cp} (Ulysses)"
        if (K // tp or 1) % cp and cp % (K // tp or 1):
            return f"{K // tp or 1} kv heads per rank and cp_size={cp}: one must divide the other (Ulysses)"
    if cp > 1 and cp_impl == 'ring':
        if S % (2 * cp):
            return f"seq_len={S} is not divisible by 2 * cp_size = {2 * cp} (ring attention's zigzag chunks)"
        if flash_error(device_type, dtype, hd):
            return flash_error(device_type, dtype, hd)
        # offload.py's token-wise recompute hands attention's saved output back: the ring's is merged
        # from several kernel calls with shifts between them, nothing to hand back
        if c.offload > 0 and (c.recompute == 'selective' or c.recompute == 'none' and c.offload < 1):
            instead = "recompute='full', cp_impl='ulysses' or offload=1" if c.recompute == 'none' else \
                "recompute='full' or cp_impl='ulysses'"
            return (f"offload={c.offload} with recompute={c.recompute!r} and cp_impl='ring': ring attention's "
                    f"output can't be replayed in a recompute (offload.py); use {instead}")
    if tp > 1 and (S // cp) % tp:
        return f"seq_len / cp_size = {S // cp} is not divisible by tp_size={tp} (sequence parallelism)"
    return None


def wait_for_every_rank(what, timeout=60):
    """Under torchrun, return once every rank has reached this call (or after `timeout` seconds): torchrun
    kills all ranks the moment one exits, so a rank that stops with a message waits here until every rank
    has printed its own. Through the launcher's TCP store: no process group needed, nothing allocated."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    if world == 1 or 'MASTER_ADDR' not in os.environ:
        return
    key = f"nanolong/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/{what}"
    try:
        store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                              timeout=timedelta(seconds=timeout))
        store.add(key, 1)
        deadline = time.monotonic() + timeout
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, ValueError):  # no store to reach (not torchrun): nobody to wait for
        pass


def init_distributed(device_type):
    """Under torchrun: join the process group (NCCL on CUDA, gloo on CPU); returns (world, rank, local_rank)."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    if world == 1:
        return 1, 0, 0
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
    if backend == 'nccl':
        torch.cuda.set_device(local_rank)
    # a rank blocked in a collective gives up after this; torchrun's agent normally kills it sooner
    dist.init_process_group(backend, timeout=timedelta(seconds=int(os.environ.get('NANOLONG_PG_TIMEOUT', 300))))
    return world, dist.get_rank(), local_rank


def make_mesh(tp, cp, cp_impl='ulysses', n_kv_head=None, sequence_parallel=True):
    """The d × c × t mesh of the current process group. Every rank creates every group, in order."""
    if not dist.is_initialized():
        return Mesh(cp_impl=cp_impl, sequence_parallel=sequence_parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // (tp * cp)
    m = Mesh(world, rank, dp, cp, tp, rank // (cp * tp), rank // tp % cp, rank % tp, cp_impl, sequence_parallel)
    at = lambda d, c, t: (d * cp + c) * tp + t

    def groups(sets):  # new_group is collective: all ranks build all sets; keep ours
        mine = None
        for ranks in sets:
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine = g
        return mine
    m.tp_group = groups([[at(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)])
    m.cp_group = groups([[at(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)])
    m.dp_group = groups([[at(d, c, t) for d in range(dp)] for c in range(cp) for t in range(tp)])
    m.dpcp_group = groups([[at(d, c, t) for d in range(dp) for c in range(cp)] for t in range(tp)])
    if n_kv_head is not None and n_kv_head < tp:
        g = tp // n_kv_head
        m.kv_group = groups([[at(d, c, h * g + j) for j in range(g)]
                             for d in range(dp) for c in range(cp) for h in range(n_kv_head)])
    return m


# ----------------------------------------------------------------------------- the collectives
# Every byte that moves between ranks moves here (tests count the calls). Tensors are made contiguous
# with the split dimension first, because the collectives work on flat memory.

def all_reduce(x, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x, dim, group):
    """Concatenate every rank's x along dim (rank order)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x, dim, group):
    """Sum x over the ranks and keep this rank's 1/n slice along dim."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def all_to_all(x, group):
    """x [n, ...]: x[j] goes to rank j; out[j] is what rank j sent us."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def ring_shift(x, group):
    """Start sending x to the next rank of the ring and receiving the previous one's; the returned
    function waits (on NCCL the stream waits, not the host) and gives what arrived."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    recv = torch.empty_like(x)
    # one batch, so NCCL posts the send and the receive together (two separate calls deadlock a ring)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dist.get_global_rank(group, (r + 1) % n), group),
                                    dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group)])

    def wait():
        for w in works:
            w.wait()
        return recv
    return wait


def broadcast(x, src, group):
    dist.broadcast(x, src=src, group=group)
    return x


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
    """f, before column-parallel matmuls: every tp rank needs all of x [B, S, h]. Under sp, all-gather the
    sequence (backward: the ranks' partial dx, reduce-scattered); else x as is (backward: all-reduce)."""
    g = mesh.tp_group
    if mesh.tp == 1:
        return x
    if mesh.sequence_parallel:  # contiguous once: with B > 1, wq, wk, wv (w1, w3) would each keep a copy
        return _Pair.apply(x, lambda x: all_gather(x, 1, g).contiguous(), lambda d: reduce_scatter(d, 1, g))
    return _Pair.apply(x, lambda x: x.view_as(x), lambda d: all_reduce(d.contiguous().clone(), g))


def leave_tp(x, mesh):
    """g, after row-parallel matmuls (partial sums): reduce-scatter to our sequence shard (sp) or all-reduce."""
    g = mesh.tp_group
    if mesh.tp == 1:
        return x
    if mesh.sequence_parallel:
        return _Pair.apply(x, lambda x: reduce_scatter(x, 1, g), lambda d: all_gather(d, 1, g))
    return _Pair.apply(x, lambda x: all_reduce(x.contiguous().clone(), g), lambda d: d)


# ----------------------------------------------------------------------------- sharding the weights

def shard_spec(name, config, tp):
    """(dim, kind) of a parameter's split over tp, kind 'vocab', 'kv' (maybe replicated) or 'even'; None: replicated."""
    if tp == 1 or 'norm' in name:
        return None
    if name in ('tok_embeddings.weight', 'output.weight'):
        return 0, 'vocab'
    if name.endswith(('wk.weight', 'wv.weight')):
        return 0, 'kv'
    if name.endswith(('wq.weight', 'w1.weight', 'w3.weight')):
        return 0, 'even'
    if name.endswith(('wo.weight', 'w2.weight')):
        return 1, 'even'
    raise ValueError(f"no tensor-parallel rule for parameter {name}")


def shard(name, full, tp_rank, tp, config):
    """This tp rank's piece of a full tensor (a weight, its gradient or an AdamW moment)."""
    spec = shard_spec(name, config, tp)
    if spec is None:
        return full.clone()
    dim, kind = spec
    if kind == 'vocab':  # ⌈V/t⌉ rows per rank; the last rank's rows past V are zeros, never a logit
        n = math.ceil(full.shape[0] / tp)
        full = torch.cat([full, full.new_zeros(n * tp - full.shape[0], *full.shape[1:])])
    if kind == 'kv' and config.n_kv_head < tp:  # kv head h lives on tp ranks h·g .. h·g + g-1
        hd = config.head_dim
        h = tp_rank // (tp // config.n_kv_head)
        return full[h * hd:(h + 1) * hd].clone()
    return full.chunk(tp, dim)[tp_rank].clone()


def unshard(name, pieces, config):
    """The full tensor from the tp ranks' pieces (in tp rank order)."""
    tp = len(pieces)
    spec = shard_spec(name, config, tp)
    if spec is None:
        return pieces[0]
    dim, kind = spec
    if kind == 'kv' and config.n_kv_head < tp:
        pieces = pieces[::tp // config.n_kv_head]
    full = torch.cat(pieces, dim)
    return full[:config.vocab_size] if kind == 'vocab' else full


def is_replica(name, mesh, config):
    """True where this rank's tensor is a copy of another tp rank's (count it once in norms, save it once)."""
    spec = shard_spec(name, config, mesh.tp)
    if spec is None:
        return mesh.tp_rank > 0
    return spec[1] == 'kv' and config.n_kv_head < mesh.tp and mesh.tp_rank % (mesh.tp // config.n_kv_head) > 0


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank·n, (tp_rank+1)·n) of the table; other ids look up zeros; the ranks' sum is the lookup."""

    def __init__(self, weight, mesh):
        super().__init__()
        self.mesh, self.weight = mesh, weight

    def forward(self, idx):
        n = self.weight.shape[0]
        local = idx - self.mesh.tp_rank * n
        outside = (local < 0) | (local >= n)
        e = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(e, self.mesh)  # all-reduce, or reduce-scatter to our sequence shard (sp)


# ----------------------------------------------------------------------------- attention over c

def ulysses(attend, group, q, k, v):
    """Attention.attend under Ulysses: q [B, H, S/c, hd], k, v [B, K, S/c, hd] on contiguous sequence
    shards -> y like q. One all-to-all turns sequence shards of every head into the whole sequence of
    H/c heads (and K/c kv heads, the same groups SDPA's enable_gqa forms), `attend` runs there as it
    would in one process, one all-to-all turns back."""
    c, (B, H, Sc, hd) = dist.get_world_size(group), q.shape
    if k.shape[1] < c:  # fewer kv heads than ranks: each rank needs the kv head of its q heads
        k, v = (t.repeat_interleave(c // t.shape[1], dim=1) for t in (k, v))
    K = k.shape[1]
    split = lambda t: t.view(B, c, t.shape[1] // c, Sc, hd)  # head groups, one per destination rank
    qkv = torch.cat([split(q), split(k), split(v)], dim=2).movedim(1, 0)
    qkv = _Pair.apply(qkv, lambda x: all_to_all(x, group), lambda d: all_to_all(d, group))
    qkv = qkv.movedim(0, 2).reshape(B, (H + 2 * K) // c, c * Sc, hd)  # [source = sequence shard] in order
    y = attend(*qkv.split([H // c, K // c, K // c], dim=1))
    y = y.reshape(B, H // c, c, Sc, hd).movedim(2, 0)
    y = _Pair.apply(y, lambda x: all_to_all(x, group), lambda d: all_to_all(d, group))
    return y.movedim(0, 1).reshape(B, H, Sc, hd)


def flash_error(device_type, dtype, head_dim):
    """None, or why ring attention's fused flash kernel can't run here (check_layout asks up front)."""
    if device_type == 'cuda' and dtype not in (torch.float16, torch.bfloat16):
        return f"cp_impl='ring' on CUDA calls flash attention, which needs bfloat16 or float16, not {dtype} " \
               "(use dtype='bfloat16' or cp_impl='ulysses')"
    if device_type == 'cuda' and (head_dim > 256 or head_dim % 8):
        return f"cp_impl='ring' on CUDA calls flash attention, which needs head_dim <= 256 and a multiple " \
               f"of 8, not {head_dim} (use cp_impl='ulysses')"
    if device_type not in ('cuda', 'cpu'):
        return f"cp_impl='ring' calls flash attention on CUDA or a CPU, not {device_type} (use cp_impl='ulysses')"
    return None


def flash(q, k, v, causal, backward=None):
    """(out, lse [B, H, S] fp32, what backward needs) of the fused flash kernel: SDPA hides the
    log-sum-exp the ring merges with, so this is the project's one call of a private aten kernel, by
    keyword. With backward = (dout, out, lse, saved): (dq, dk, dv). k, v have q's head count."""
    why = flash_error(q.device.type, q.dtype, q.shape[-1])
    if why:
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


def _ring_steps(kv, group):
    """Rank r of P holds zigzag chunks r and 2P-1-r of 2P (n tokens each). At step s it holds the k, v of
    rank (r - s) mod P and yields (its q rows, those kv rows, causal, kv): step 0 is causal over our own
    chunks; an earlier rank's first chunk precedes all our tokens (its second follows them all); a later
    rank's two chunks precede our second chunk and follow our first. The next k, v moves meanwhile."""
    P, r, n = dist.get_world_size(group), dist.get_rank(group), kv.shape[3] // 2
    for s in range(P):
        nxt = ring_shift(kv, group) if s < P - 1 else None
        if s == 0:
            yield slice(None), slice(None), True, kv
        else:
            yield (slice(None), slice(0, n), False, kv) if (r - s) % P < r else (slice(n, None), slice(None), False, kv)
        kv = nxt() if nxt else kv


class _RingAttention(Function):
    """Each step's flash kernel gives (out, lse) over one block of keys; the online softmax merges them.
    Backward: with the final out and lse each block's flash backward is its exact share of the gradient,
    and dk, dv travel around the ring with their k, v until they are back with their owner."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        H = q.shape[1]
        rep = lambda t: t.repeat_interleave(H // k.shape[1], dim=1).contiguous()  # the kernel: q's head count
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        ctx.saved = []
        for rows, cols, causal, kv in _ring_steps(torch.stack([k, v]), group):  # kv heads travel, not repeats
            o, l, saved = flash(q[:, :, rows].contiguous(), rep(kv[0][:, :, cols]), rep(kv[1][:, :, cols]), causal)
            new = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1) + \
                o.float() * (l - new).exp().unsqueeze(-1)
            lse[:, :, rows] = new
            ctx.saved.append(saved)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        H, K = q.shape[1], k.shape[1]
        rep = lambda t: t.repeat_interleave(H // K, dim=1).contiguous()
        fold = lambda g: g.float().view(g.shape[0], K, H // K, *g.shape[2:]).sum(2)  # repeats -> kv heads
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        steps = _ring_steps(torch.stack([k, v]), ctx.group)
        for (rows, cols, causal, kv), saved in zip(steps, ctx.saved):
            part = lambda t: t[:, :, rows].contiguous()
            g = flash(part(q), rep(kv[0][:, :, cols]), rep(kv[1][:, :, cols]), causal,
                      backward=(part(dout), part(out), part(lse), saved))
            dq[:, :, rows] += g[0].float()
            dkv[0][:, :, cols] += fold(g[1])
            dkv[1][:, :, cols] += fold(g[2])
            dkv = ring_shift(dkv, ctx.group)()  # after P shifts each dk, dv is back with its owner
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring(group, q, k, v):
    """Attention.attend under ring attention: q [B, H, 2n, hd], k, v [B, K, 2n, hd] on zigzag shards
    (chunks r and 2c-1-r of 2c) -> y like q. Causal softmax attention only: it runs its own kernel."""
    return _RingAttention.apply(q, k, v, group)


def shard_batch(x, y, mesh):
    """A global micro-batch (the same on every rank) -> this rank's (x, y[, positions]): our dp rank's
    rows, our cp rank's tokens (contiguous for Ulysses; zigzag chunks r and 2c-1-r of 2c for the ring)."""
    n, (c, r) = x.shape[0] // mesh.dp, (mesh.cp, mesh.cp_rank)
    x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
    if c == 1:
        return x, y
    S, k = x.shape[1], x.shape[1] // (2 * c)  # k: tokens per zigzag chunk
    pos = torch.arange(r * S // c, (r + 1) * S // c) if mesh.cp_impl == 'ulysses' else \
        torch.cat([torch.arange(r * k, (r + 1) * k), torch.arange((2 * c - 1 - r) * k, (2 * c - r) * k)])
    pos = pos.to(x.device)
    return x[:, pos], y[:, pos], pos


# ----------------------------------------------------------------------------- the model, parallel

def parallelize(model, mesh):
    """Shard a full model (every rank built the same one from the same seed) for this rank, in place,
    and hook the collectives onto its own modules; parameter names stay the model's."""
    c = model.config
    if mesh.tp > 1:
        for name, p in list(model.named_parameters()):
            module = model.get_submodule(name.rsplit('.', 1)[0])
            module.weight = nn.Parameter(shard(name, p.data, mesh.tp_rank, mesh.tp, c))
        if c.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, mesh)
        for block in model.layers:
            for m in (block.attention, block.feed_forward):
                m.register_forward_pre_hook(lambda m, args: (enter_tp(args[0], mesh), *args[1:]))
                m.register_forward_hook(lambda m, args, y: leave_tp(y, mesh))
        model.norm.register_forward_hook(lambda m, args, y: enter_tp(y, mesh))  # the LM head's input
        model.vocab_group = mesh.tp_group  # Llama.head: chunked.py's loss over our rows of the vocabulary
    for block in model.layers:
        attn = block.attention
        if mesh.cp > 1 and mesh.cp_impl == 'ulysses':
            attn.attend = functools.partial(ulysses, attn.attend, mesh.cp_group)
        elif mesh.cp > 1:
            attn.attend = functools.partial(ring, mesh.cp_group)
        attn.mesh = mesh  # offload.py reads the layout here
    model.mesh = mesh
    return model


# ----------------------------------------------------------------------------- gradients, clipping, optimizer

def sync_grads(named_params, mesh, config):
    """After backward: make each rank's gradients those of the whole step. named_params: (name, tensor
    holding .grad), the model's names. Under sp the norms saw only our tokens: sum over tp. Replicated kv
    heads: sum over the copies. Everything: sum over dp × cp (the loss was already divided by the
    step's global token count, so a sum is the exact token-weighted mean)."""
    def flat_all_reduce(tensors, group):
        if group is None or not tensors:
            return
        grads = [p.grad for p in tensors]
        buf = all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
        for g, piece in zip(grads, buf.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
    for p in (p for _, p in named_params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if mesh.tp > 1 and mesh.sequence_parallel:
        flat_all_reduce([p for n, p in named_params if shard_spec(n, config, mesh.tp) is None], mesh.tp_group)
    flat_all_reduce([p for n, p in named_params if n.endswith(('wk.weight', 'wv.weight'))], mesh.kv_group)
    flat_all_reduce([p for _, p in named_params], mesh.dpcp_group)


def clip_grad_norm_(named_params, max_norm, mesh, config):
    """torch.nn.utils.clip_grad_norm_ over the whole model: squares of every shard, each element once."""
    sq = sum((p.grad.float().pow(2).sum() for n, p in named_params if not is_replica(n, mesh, config)),
             torch.zeros((), device=named_params[0][1].device))
    if mesh.tp_group is not None:
        all_reduce(sq, mesh.tp_group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, p in named_params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


class ShardedAdamW:
    """zero=1: each parameter's AdamW moments live on one rank of its dp × cp group (the largest tensors
    spread first); that rank updates it and broadcasts the new values. Gradients stay all-reduced."""

    def __init__(self, groups, mesh, **kw):
        self.mesh, self.group = mesh, mesh.dpcp_group
        n = mesh.dp * mesh.cp
        me = (mesh.dp_rank * mesh.cp + mesh.cp_rank)
        load = [0] * n
        self.owner = {}
        for p in sorted((p for g in groups for p in g['params']), key=lambda p: -p.numel()):
            o = min(range(n), key=lambda i: load[i])  # ties go to the lowest rank: the same on every rank
            self.owner[p], load[o] = o, load[o] + p.numel()
        self.params = [p for g in groups for p in g['params']]
        local = [{**g, 'params': [p for p in g['params'] if self.owner[p] == me]} for g in groups]
        self.optim = torch.optim.AdamW(local, **kw)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def step(self):
        self.optim.step()
        if self.group is None:
            return
        for o in range(self.mesh.dp * self.mesh.cp):  # one broadcast per owner, its parameters flattened
            mine = [p for p in self.params if self.owner[p] == o]
            if not mine:
                continue
            buf = broadcast(torch.cat([p.data.reshape(-1) for p in mine]), dist.get_global_rank(self.group, o), self.group)
            with torch.no_grad():
                for p, piece in zip(mine, buf.split([p.numel() for p in mine])):
                    p.copy_(piece.view_as(p))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, sd):
        self.optim.load_state_dict(sd)


def gather_full(named_tensors, mesh, config, grads=False):
    """{name: full tensor} on every rank: the tp pieces of each parameter (or its .grad) all-gathered."""
    out = {}
    for n, p in named_tensors:
        t = (p.grad if grads else p.data).contiguous()
        if mesh.tp > 1:
            pieces = all_gather(t.unsqueeze(0), 0, mesh.tp_group).unbind(0)
            t = unshard(n, list(pieces), config)
        out[n] = t.clone()
    return out


# ----------------------------------------------------------------------------- checkpoints
# Under torchrun each rank writes out_dir/ckpt/rank{r}.pt: its shards keyed by parameter name (weights,
# fp32 masters, AdamW moments), written once (by the first dp×cp rank, or under zero=1 by the owner),
# then a barrier, then rank 0 writes out_dir/ckpt/COMMITTED. A directory without it is never loaded.
# Reading assembles the full tensors from any layout's shards into the single-process ckpt.pt format
# (consolidate), so a run resumes under any layout, and `python parallel.py export out_dir hf_dir`
# writes one Hugging Face directory from any of them.

def _opt_state(optimizer, p):
    st = optimizer.state.get(p)
    return None if not st else {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}


def save_sharded(out_dir, mesh, config, names, masters, model, optimizer, scalars, save_fn):
    """Every rank writes its shard (save_fn: train.save_checkpoint, atomic), barrier, rank 0 commits."""
    d = os.path.join(out_dir, 'ckpt')
    marker = os.path.join(d, 'COMMITTED')
    if mesh.rank == 0:
        os.makedirs(d, exist_ok=True)
        if os.path.exists(marker):
            os.remove(marker)  # from here until the new marker, this directory is not a checkpoint
    dist.barrier()
    first = mesh.dp_rank == 0 and mesh.cp_rank == 0
    zero = isinstance(optimizer, ShardedAdamW)
    mine = lambda m: optimizer.owner[m] == mesh.dp_rank * mesh.cp + mesh.cp_rank if zero else first
    params = dict(model.named_parameters())
    state = {'tp': mesh.tp, 'tp_rank': mesh.tp_rank,
             'model': {n: params[n].detach().cpu() for n in names} if first else {},
             'masters': {n: m.detach().cpu() for n, m in zip(names, masters)}
             if first and masters[0] is not params[names[0]] else {},
             'optim': {n: _opt_state(optimizer, m) for n, m in zip(names, masters) if mine(m) and _opt_state(optimizer, m)},
             'param_groups': [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]}
    if mesh.rank == 0:
        state.update(scalars)
    save_fn(os.path.join(d, f'rank{mesh.rank:05d}.pt'), state)
    dist.barrier()
    if mesh.rank == 0:
        import json
        with open(marker + '.tmp', 'w') as f:
            json.dump({'world': mesh.world, 'iter_num': scalars['iter_num']}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + '.tmp', marker)


def latest_checkpoint(out_dir):
    """The newest loadable checkpoint of out_dir: its ckpt.pt or its committed ckpt/ directory; None if neither."""
    single, marker = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'ckpt', 'COMMITTED')
    found = [p for p in (single, marker) if os.path.exists(p)]
    return max(found, key=os.path.getmtime) if found else None


def consolidate(path, config_from_args, opt_order):
    """A checkpoint (ckpt.pt, or ckpt/COMMITTED of any layout) in the single-process format: full 'model'
    state dict, 'masters' list and 'optimizer' state dict in opt_order(config) order, plus the scalars."""
    if not path.endswith('COMMITTED'):
        return torch.load(path, map_location='cpu', weights_only=False)
    import json
    d = os.path.dirname(path)
    with open(path) as f:
        world = json.load(f)['world']
    files = [torch.load(os.path.join(d, f'rank{r:05d}.pt'), map_location='cpu', weights_only=False, mmap=True)
             for r in range(world)]
    head = files[0]
    config = config_from_args(head['model_args'])
    tp = head['tp']

    def full(key):  # {name: full tensor} from the files holding `key`, one piece per tp rank
        pieces = [{} for _ in range(tp)]
        for f in files:
            pieces[f['tp_rank']].update(f[key])
        return {n: unshard(n, [pieces[t][n] for t in range(tp)], config) for n in pieces[0]}
    ckpt = {k: v for k, v in head.items() if k not in ('tp', 'tp_rank', 'model', 'masters', 'optim', 'param_groups')}
    ckpt['model'] = full('model')
    names = list(ckpt['model'])
    if config.tie_embeddings:  # one parameter, two state-dict entries
        ckpt['model']['output.weight'] = ckpt['model']['tok_embeddings.weight']
    masters = full('masters')
    if masters:
        ckpt['masters'] = [masters[n] for n in names]
    optim = [{} for _ in range(tp)]
    for f in files:
        optim[f['tp_rank']].update(f['optim'])
    order = opt_order(config)
    groups = head['param_groups']
    state = {}
    for i, n in enumerate(o for g in order for o in g):
        if n in optim[0]:
            st = dict(optim[0][n])
            for k in ('exp_avg', 'exp_avg_sq'):
                st[k] = unshard(n, [optim[t][n][k] for t in range(tp)], config)
            state[i] = st
    ids = iter(range(sum(len(g) for g in order)))
    ckpt['optimizer'] = {'state': state, 'param_groups': [{**g, 'params': [next(ids) for _ in o]}
                                                         for g, o in zip(groups, order)]}
    return ckpt


def restore_sharded(ckpt, mesh, config, names, masters, optimizer, opt_order):
    """Load a consolidated checkpoint's masters and AdamW moments into this rank's shards."""
    with torch.no_grad():
        if 'masters' in ckpt:
            for n, m, full in zip(names, masters, ckpt['masters']):
                m.copy_(shard(n, full, mesh.tp_rank, mesh.tp, config))
    order = [n for g in opt_order(config) for n in g]
    saved = {order[i]: st for i, st in ckpt['optimizer']['state'].items()}
    master_of = dict(zip(names, masters))
    sd = optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g['params'])}
    sd['state'] = {}
    for n, st in saved.items():
        m = master_of[n]
        if id(m) in index:
            sd['state'][index[id(m)]] = {k: shard(n, v, mesh.tp_rank, mesh.tp, config) if k.startswith('exp_avg') else v
                                         for k, v in st.items()}
    optimizer.load_state_dict(sd)


if __name__ == '__main__':
    # python parallel.py export OUT_DIR HF_DIR: one Hugging Face directory from a checkpoint of any layout
    if len(sys.argv) != 4 or sys.argv[1] != 'export':
        sys.exit("usage: python parallel.py export OUT_DIR HF_DIR")
    from model import Llama, LlamaConfig
    path = latest_checkpoint(sys.argv[2])
    if path is None:
        sys.exit(f"error: no committed checkpoint in {sys.argv[2]}")
    ckpt = consolidate(path, lambda a: LlamaConfig(**a), lambda c: [[], []])
    model = Llama(LlamaConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.save_pretrained(sys.argv[3])
    print(f"wrote {sys.argv[3]} from {path}")
