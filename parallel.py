"""
Tensor, sequence, context and data parallelism over torchrun, written so you can see every byte move.

A mesh of world = dp × cp × tp ranks (tp fastest: a tp group is neighbouring GPUs on one node).
Per rank, with P parameters, S tokens per sequence, b bytes per element, h width:

  tp  Megatron (Shoeybi 2019): wq/wk/wv and w1/w3 split by output (heads, intermediate), wo and w2 by
      input; embedding and LM head split by vocabulary. Weights, grads, optimizer states: P / tp.
  sp  sequence parallel (Korthikanti 2022): between the matmuls, norms and residuals hold S / tp tokens:
      the activations kept per layer drop from s·b·h·(10 + 24/t) to s·b·h·34/t (Megatron's count).
      Its price is transient: the all-gathered input of the column-parallel matmuls and the partial
      sums of the row-parallel ones are whole S·h·b tensors on every rank, inside the block only.
  cp  context parallel: every activation holds S / cp tokens; attention either swaps sequence shards for
      head shards (DeepSpeed-Ulysses, all-to-all) or passes k, v around a ring (ring attention, zigzag).
  dp  data parallel: different sequences, gradients summed over dp × cp; zero=1 keeps each AdamW moment
      on one of the dp·cp ranks (ZeRO-1, Rajbhandari 2019): optimizer states 8·P/tp -> 8·P/(tp·dp·cp).

Every collective goes through the six functions below; the autograd Functions around them say what the
backward moves. Collectives per transformer block, forward (backward), B·S·h elements each unless said:
  tp without sp   2 all-reduce (2 all-reduce)                      f before wq|w1, g after wo|w2
  tp with sp      2 all-gather + 2 reduce-scatter (2 + 2)          same volume as the all-reduces
  cp ulysses      2 all-to-all (2): q,k,v packed in one, the output in the other   (heads/cp move)
  cp ring         cp-1 ring shifts of k,v (cp-1 of k,v + cp of dk,dv); kv heads, never repeated ones
  recompute=full  the forward's once more in backward, but the last reduction (after w2): torch's
                  checkpoint stops recomputing once it has every tensor backward saves
Once per step: embedding 1 (all-reduce or reduce-scatter), LM head 1 in (gather / copy) + one
all-gather of [tokens/chunks] log-sum-exps per loss chunk + 1 all-reduce of the target logits; then the
token count, the loss, grads (norms over tp under sp, replicated kv heads over their copies, everything
over dp × cp as one flat buffer), the clipping norm; with zero=1 one broadcast per dp·cp rank.
"""
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

import chunked
from model import apply_rope
from offload import layout_error as offload_layout_error


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
    kv_group: object = None     # tp ranks sharing one kv head (n_kv_head < tp)


def check_layout(world, tp, cp, cp_impl, seq_len, n_head, n_kv_head, intermediate_size, zero=0,
                 recompute='none', offload=0.0):
    """None, or the one-line reason this layout can't run (checked on every rank before anything),
    with these recompute and offload knobs (offload.py can't replay ring attention)."""
    if tp < 1 or cp < 1 or world % (tp * cp):
        return f"world size {world} is not divisible by tp_size * cp_size = {tp} * {cp}"
    if n_head % tp:
        return f"n_head={n_head} is not divisible by tp_size={tp}"
    if n_kv_head % tp and tp % n_kv_head:
        return f"n_kv_head={n_kv_head} and tp_size={tp}: one must divide the other (kv heads are split or replicated)"
    if intermediate_size % tp:
        return f"intermediate_size={intermediate_size} is not divisible by tp_size={tp}"
    if cp_impl not in ('ulysses', 'ring'):
        return f"cp_impl must be 'ulysses' or 'ring', got {cp_impl!r}"
    if zero not in (0, 1):
        return f"zero must be 0 or 1, got {zero!r}"
    if cp > 1 and cp_impl == 'ring' and seq_len % (2 * cp):
        return f"seq_len={seq_len} is not divisible by 2 * cp_size = {2 * cp} (ring attention's zigzag chunks)"
    if cp > 1 and cp_impl == 'ulysses':
        kv = max(1, n_kv_head // tp)
        if seq_len % cp:
            return f"seq_len={seq_len} is not divisible by cp_size={cp}"
        if (n_head // tp) % cp:
            return f"n_head / tp_size = {n_head // tp} heads per rank are not divisible by cp_size={cp} (Ulysses)"
        if kv % cp and cp % kv:
            return f"{kv} kv heads per rank and cp_size={cp}: one must divide the other (Ulysses)"
    if tp > 1 and (seq_len // cp) % tp:
        return f"seq_len / cp_size = {seq_len // cp} is not divisible by tp_size={tp} (sequence parallelism)"
    return offload_layout_error(recompute, offload, cp, cp_impl)


def wait_for_every_rank(what, timeout=60):
    """Under torchrun, return once every rank has reached this call (or after `timeout` seconds).

    torchrun kills all ranks the moment one exits, so a rank that stops with a message first waits here
    until every rank has printed its own. It counts on the launcher's TCP store, so it works before
    there is a process group (and allocates nothing on the device)."""
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
    """The dp × cp × tp mesh of the current process group. Every rank creates every group, in order."""
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
    """Start sending x to the next rank of the ring and receiving the previous one's; wait() returns it."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    recv = torch.empty_like(x)
    # one batch, so NCCL posts the send and the receive together (two separate calls deadlock a ring)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dist.get_global_rank(group, (r + 1) % n), group),
                                    dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % n), group)])
    return _Pending(recv, works)


class _Pending:
    def __init__(self, tensor, works):
        self.tensor, self.works = tensor, works

    def wait(self):  # on NCCL this makes the stream wait, not the host: no cuda synchronize
        for w in self.works:
            w.wait()
        return self.tensor


def broadcast(x, src, group):
    dist.broadcast(x, src=src, group=group)
    return x


# ----------------------------------------------------------------------------- autograd around them

class _Copy(Function):        # Megatron's f: the input of a column-parallel matmul, used by every tp rank
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):     # each rank's matmul contributed a part of dx: sum them
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _Reduce(Function):      # Megatron's g: the partial sums of a row-parallel matmul
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(Function):   # sp: sequence shards -> the whole sequence, before a column-parallel matmul
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # [B, S, h] in memory: with B > 1 the gathered [S, B, h] order would make each matmul after
        # this (wq, wk, wv; w1, w3) keep its own contiguous copy for backward; one copy here is shared
        return all_gather(x, 1, group).contiguous()

    @staticmethod
    def backward(ctx, g):     # the ranks' partial dx, summed, and only our tokens kept
        return reduce_scatter(g, 1, ctx.group), None


class _ScatterSeq(Function):  # sp: partial sums of the whole sequence -> our shard of the sum
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, 1, ctx.group), None


class _AllToAll(Function):    # Ulysses; all-to-all is its own inverse, so backward is one more
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_to_all(g, ctx.group), None


def enter_tp(x, mesh):
    """Before column-parallel matmuls: gather the sequence (sp) or mark the copy (tp)."""
    if mesh.tp == 1:
        return x
    return _GatherSeq.apply(x, mesh.tp_group) if mesh.sequence_parallel else _Copy.apply(x, mesh.tp_group)


def leave_tp(x, mesh):
    """After row-parallel matmuls: reduce-scatter to our sequence shard (sp) or all-reduce (tp)."""
    if mesh.tp == 1:
        return x
    return _ScatterSeq.apply(x, mesh.tp_group) if mesh.sequence_parallel else _Reduce.apply(x, mesh.tp_group)


# ----------------------------------------------------------------------------- sharding the weights

def _vocab_shard(V, tp):
    return math.ceil(V / tp)  # rows per rank; the last rank's rows past V are padding, zeros, never used


def shard_spec(name, config, tp):
    """(dim, kind) of a parameter's split over tp: kind 'vocab', 'kv' (may be replicated) or 'even'; None: replicated."""
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
    if kind == 'vocab':
        n = _vocab_shard(full.shape[0], tp)
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


# ----------------------------------------------------------------------------- attention over cp

def _attend_local(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _repeat_kv(x, n_head):  # kv heads -> one per q head (GQA), grouped as SDPA's enable_gqa groups them
    return x if x.shape[1] == n_head else x.repeat_interleave(n_head // x.shape[1], dim=1)


def ulysses_attention(q, k, v, mesh):
    """q [B, H, S/cp, hd], k, v [B, K, S/cp, hd] on contiguous sequence shards -> y like q.
    One all-to-all turns sequence shards of all heads into all of the sequence for heads/cp, one turns back."""
    cp, (B, H, Sc, hd) = mesh.cp, q.shape
    if k.shape[1] < cp:  # fewer kv heads than ranks: each rank needs the kv head of its q heads
        k, v = _repeat_kv(k, cp), _repeat_kv(v, cp)
    K = k.shape[1]
    split = lambda t: t.view(B, cp, t.shape[1] // cp, Sc, hd)  # head groups, one per destination rank
    qkv = torch.cat([split(q), split(k), split(v)], dim=2).movedim(1, 0)
    qkv = _AllToAll.apply(qkv, mesh.cp_group)  # [cp (source = sequence shard), B, heads/cp, Sc, hd]
    qkv = qkv.movedim(0, 2).reshape(B, (H + 2 * K) // cp, cp * Sc, hd)
    q, k, v = qkv.split([H // cp, K // cp, K // cp], dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    y = y.view(B, H // cp, cp, Sc, hd).movedim(2, 0)
    y = _AllToAll.apply(y, mesh.cp_group)  # [cp (source = head group), B, H/cp, Sc, hd]
    return y.movedim(0, 1).reshape(B, H, Sc, hd)


def _flash_fwd(q, k, v, causal):
    """(out, lse [B, H, S] fp32, extra) from the fused kernel; k, v already have q's head count."""
    if q.is_cuda:
        out, lse, *extra = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse, extra[:6]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _flash_bwd(dout, q, k, v, out, lse, causal, extra):
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset)[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)[:3]


def _ring_pieces(s, r, c, P):
    """At ring step s rank r holds the k, v of rank (r - s) mod P. Zigzag: rank r's tokens are chunk r then
    chunk 2P-1-r of 2P. Returns (q rows, kv rows, causal): step 0 is causal over our own two chunks; an
    earlier rank's first chunk precedes all our tokens (its second chunk follows them all); a later
    rank's two chunks both precede our second chunk and follow our first."""
    if s == 0:
        return slice(None), slice(None), True
    return (slice(None), slice(0, c), False) if (r - s) % P < r else (slice(c, None), slice(None), False)


class _RingAttention(Function):

    @staticmethod
    def forward(ctx, q, k, v, group):
        P, r, H, c = dist.get_world_size(group), dist.get_rank(group), q.shape[1], q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # what travels: the kv heads, not repeated
        extras = []
        for s in range(P):
            nxt = ring_shift(kv, group) if s < P - 1 else None  # the next block moves while we compute
            rows, cols, causal = _ring_pieces(s, r, c, P)
            o, l, extra = _flash_fwd(q[:, :, rows].contiguous(), _repeat_kv(kv[0][:, :, cols], H).contiguous(),
                                     _repeat_kv(kv[1][:, :, cols], H).contiguous(), causal)
            extras.append(extra)
            new = torch.logaddexp(lse[:, :, rows], l)  # online softmax: merge this block's (out, lse)
            out[:, :, rows] = out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1) + \
                o.float() * (l - new).exp().unsqueeze(-1)
            lse[:, :, rows] = new
            if nxt is not None:
                kv = nxt.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.extras = group, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, H, c = ctx.group, q.shape[1], q.shape[2] // 2
        P, r, K = dist.get_world_size(group), dist.get_rank(group), k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its k, v
        fold = lambda g: g.view(g.shape[0], K, H // K, *g.shape[2:]).sum(2)  # repeated heads -> kv heads
        for s in range(P):
            nxt = ring_shift(kv, group) if s < P - 1 else None
            rows, cols, causal = _ring_pieces(s, r, c, P)
            # with the final out and lse, each block's flash backward gives its exact share of the gradient
            g = _flash_bwd(dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(),
                           _repeat_kv(kv[0][:, :, cols], H).contiguous(), _repeat_kv(kv[1][:, :, cols], H).contiguous(),
                           out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal, ctx.extras[s])
            dq[:, :, rows] += g[0].float()
            dkv[0][:, :, cols] += fold(g[1].float())
            dkv[1][:, :, cols] += fold(g[2].float())
            dkv = ring_shift(dkv, group).wait()  # after P shifts each dk, dv is back with its owner
            if nxt is not None:
                kv = nxt.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q, k, v, mesh):
    """q [B, H, 2c, hd], k, v [B, K, 2c, hd] on zigzag shards (chunks r and 2cp-1-r of 2cp) -> y like q."""
    return _RingAttention.apply(q, k, v, mesh.cp_group)


def cp_shard(S, mesh):
    """The positions [S/cp] of this cp rank's tokens: contiguous for Ulysses, zigzag for the ring."""
    if mesh.cp == 1:
        return torch.arange(S)
    if mesh.cp_impl == 'ulysses':
        n = S // mesh.cp
        return torch.arange(mesh.cp_rank * n, (mesh.cp_rank + 1) * n)
    c, r = S // (2 * mesh.cp), mesh.cp_rank
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * mesh.cp - 1 - r) * c, (2 * mesh.cp - r) * c)])


def shard_batch(x, y, mesh):
    """A global micro-batch (the same on every rank) -> this rank's (x, y[, positions]): our dp rank's
    rows, our cp rank's tokens; what model(x, y, positions) takes."""
    n = x.shape[0] // mesh.dp
    x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
    if mesh.cp == 1:
        return x, y
    pos = cp_shard(x.shape[1], mesh).to(x.device)
    return x[:, pos], y[:, pos], pos


# ----------------------------------------------------------------------------- the parallel modules

class ParallelAttention(nn.Module):
    """model.Attention on this rank's heads (tp) and sequence shard (sp, cp). Same parameter names."""

    def __init__(self, attn, mesh):
        super().__init__()
        self.mesh, self.head_dim = mesh, attn.head_dim
        self.wq, self.wk, self.wv, self.wo = attn.wq, attn.wk, attn.wv, attn.wo
        self.n_head = attn.wq.weight.shape[0] // attn.head_dim
        self.n_kv_head = attn.wk.weight.shape[0] // attn.head_dim

    def forward(self, x, cos, sin, kv_cache=None):
        if kv_cache is not None:
            raise NotImplementedError("sampling with a kv cache runs in one process (sample.py)")
        x = enter_tp(x, self.mesh)
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos, sin: the positions of our shard
        if self.mesh.cp == 1:
            y = _attend_local(q, k, v)
        elif self.mesh.cp_impl == 'ulysses':
            y = ulysses_attention(q, k, v, self.mesh)
        else:
            y = ring_attention(q, k, v, self.mesh)
        return leave_tp(self.wo(y.transpose(1, 2).reshape(B, S, -1)), self.mesh)


class ParallelMLP(nn.Module):
    """model.MLP with w1, w3 split by output and w2 by input: one reduction for the whole MLP."""

    def __init__(self, mlp, mesh):
        super().__init__()
        self.mesh, self.config = mesh, mlp.config
        self.w1, self.w3, self.w2 = mlp.w1, mlp.w3, mlp.w2

    def forward(self, x):
        x = enter_tp(x, self.mesh)
        chunks = chunked.mlp_chunks(self.config, x.shape[-2])
        y = chunked.chunked_mlp(x, self.w1.weight, self.w3.weight, self.w2.weight, chunks)
        return leave_tp(y, self.mesh)


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


class _VocabParallelCrossEntropy(Function):
    """chunked.py's loss over a vocabulary shard: logits [tokens/chunks, V/tp] at a time, never the full V.
    Per chunk one all-gather of the ranks' log-sum-exps (tokens/chunks floats each) gives the softmax's
    normaliser; the gradients are computed in forward as in chunked.py. The padding rows of the last
    shard get logit -inf: probability 0, gradient 0."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunks, vocab_size, mesh):
        shape, h, t = h.shape, h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        N, n_local = h.shape[0], weight.shape[0]
        lo = mesh.tp_rank * n_local
        n_real = max(0, min(n_local, vocab_size - lo))  # columns of ours that are not padding
        valid = t != -100
        count = valid.sum()
        ours = valid & (t >= lo) & (t < lo + n_local)
        tgt = torch.where(ours, t - lo, 0).unsqueeze(1)
        need_h, need_w = ctx.needs_input_grad[:2]
        dh = torch.empty_like(h) if need_h else None
        dW = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        target_logit = torch.zeros(N, dtype=torch.float32, device=h.device)
        step = max(1, math.ceil(N / max(1, chunks)))
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, step):
                e = min(s + step, N)
                logits = torch.empty(e - s, n_local, dtype=torch.float32, device=h.device)
                chunked._mm_f32(h[s:e], weight.t(), out=logits)
                logits[:, n_real:] = -math.inf
                target_logit[s:e] = logits.gather(1, tgt[s:e]).squeeze(1) * ours[s:e]
                lse[s:e] = all_gather(logits.logsumexp(1).unsqueeze(0), 0, mesh.tp_group).logsumexp(0)
                if not (need_h or need_w):
                    continue
                p = logits.sub_(lse[s:e].unsqueeze(1)).exp_()  # softmax over the whole vocabulary, our columns
                p.scatter_add_(1, tgt[s:e], -ours[s:e].float().unsqueeze(1))  # - onehot where the target is ours
                p.mul_(valid[s:e].unsqueeze(1))
                g = p.to(weight.dtype)
                if need_h:
                    torch.mm(g, weight, out=dh[s:e])  # our vocabulary's part of dh: enter_tp's backward sums
                if need_w:
                    chunked._acc_mm_(dW, g.t(), h[s:e])
        target_logit = all_reduce(target_logit.sum(), mesh.tp_group)  # one rank holds each target's logit
        ctx.count, ctx.dh, ctx.dW, ctx.w_dtype = count, None if dh is None else dh.view(shape), dW, weight.dtype
        return ((lse * valid).sum() - target_logit) / count.clamp(min=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        scale = grad_loss / ctx.count.clamp(min=1)
        dh, dW = ctx.dh, ctx.dW
        ctx.dh = ctx.dW = None
        dh = None if dh is None else dh.mul_(scale)
        dW = None if dW is None else dW.mul_(scale).to(ctx.w_dtype)
        return dh, dW, None, None, None, None


def vocab_parallel_head(model, mesh, x, targets=None):
    """Llama.head under tp: the final norm's output (a sequence shard under sp) -> loss, or full logits."""
    h = enter_tp(x, mesh)
    w = model.output.weight
    dt = chunked._autocast_dtype(h.device.type)
    if dt is not None:
        h, w = h.to(dt), w.to(dt)
    if targets is None:  # sampling / inspection: gather the vocabulary (not a training path)
        return all_gather(F.linear(h, w), h.dim() - 1, mesh.tp_group)[..., :model.config.vocab_size]
    chunks = chunked.loss_chunks(model.config, h.shape[0] * h.shape[1])
    return None, _VocabParallelCrossEntropy.apply(h, w, targets, chunks, model.config.vocab_size, mesh)


def parallelize(model, mesh):
    """Shard a full model (every rank built the same one from the same seed) for this rank, in place."""
    c = model.config
    if mesh.tp > 1:
        tied = c.tie_embeddings
        for name, p in list(model.named_parameters()):
            module = model.get_submodule(name.rsplit('.', 1)[0])
            module.weight = nn.Parameter(shard(name, p.data, mesh.tp_rank, mesh.tp, c))
        if tied:
            model.output.weight = model.tok_embeddings.weight
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings.weight, mesh)
        model.head = lambda x, targets=None: vocab_parallel_head(model, mesh, x, targets)
    for block in model.layers:
        block.attention = ParallelAttention(block.attention, mesh)
        if mesh.tp > 1:
            block.feed_forward = ParallelMLP(block.feed_forward, mesh)
    model.mesh = mesh
    return model


# ----------------------------------------------------------------------------- gradients, clipping, optimizer
# After backward every rank holds fp32 gradients of its tp shards, for its own tokens. sync_grads sums
# them in buckets of BUCKET_BYTES (DDP's 25 MB): at most one bucket is ever copied, not the whole model.
# AdamW below keeps the fp32 master weights and moments of rows; with zero=1 each of the d = dp·cp
# ranks keeps only ⌈rows/d⌉ rows of every tensor (Megatron's distributed optimizer: per parameter
# 2 + 4 + 12/d bytes with bf16 weights, 4 + 4 + 8/d in fp32, instead of 2 + 4 + 12 or 4 + 4 + 8) and
# all-gathers the new rows after each step. torch's ZeroRedundancyOptimizer gives whole tensors to
# ranks (uneven: the embedding alone can be a rank's share) and updates tensors every rank holds in
# full, so it can't own masters that exist only as shards.

BUCKET_BYTES = 25 * 2**20


def all_reduce_buckets(grads, group):
    """Sum each tensor over group, in place, a bucket at a time (a tensor larger than a bucket alone, uncopied)."""
    if group is None:
        return
    bucket = []

    def flush():
        if len(bucket) == 1:
            all_reduce(bucket[0], group)
        elif bucket:
            flat = all_reduce(torch.cat([g.reshape(-1) for g in bucket]), group)
            for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))
        bucket.clear()
    for g in grads:
        if bucket and sum(b.nbytes for b in bucket) + g.nbytes > BUCKET_BYTES:
            flush()
        bucket.append(g)
    flush()


def sync_grads(named_params, mesh, config):
    """After backward: make each rank's gradients those of the whole step. named_params: (name, tensor
    holding .grad), the model's names. Under sp the norms saw only our tokens: sum over tp. Replicated kv
    heads: sum over the copies. Everything: sum over dp × cp (the loss was already divided by the
    step's global token count, so a sum is the exact token-weighted mean)."""
    for _, p in named_params:
        if p.grad is None:
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    if mesh.tp > 1 and mesh.sequence_parallel:
        all_reduce_buckets([p.grad for n, p in named_params if shard_spec(n, config, mesh.tp) is None], mesh.tp_group)
    all_reduce_buckets([p.grad for n, p in named_params if n.endswith(('wk.weight', 'wv.weight'))], mesh.kv_group)
    all_reduce_buckets([p.grad for _, p in named_params], mesh.dpcp_group)


def clip_grad_norm_(named_params, max_norm, mesh, config):
    """torch.nn.utils.clip_grad_norm_ over the whole model: squares of every shard, each element once."""
    sq = sum((torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2
              for n, p in named_params if not is_replica(n, mesh, config)),
             torch.zeros((), device=named_params[0][1].device))
    if mesh.tp_group is not None:
        all_reduce(sq, mesh.tp_group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, p in named_params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def real_rows(name, p, mesh, config):
    """Rows of this rank's tensor that hold the model (the last tp ranks' vocabulary rows past V are padding)."""
    spec = shard_spec(name, config, mesh.tp)
    if spec is None or spec[1] != 'vocab':
        return p.shape[0]
    n = _vocab_shard(config.vocab_size, mesh.tp)
    return max(0, min(n, config.vocab_size - mesh.tp_rank * n))


def row_share(rows, d, j):
    """(first row, count) of rank j of d: ⌈rows/d⌉ each, the last ones fewer (DTensor's Shard(0) split)."""
    n = math.ceil(rows / d)
    first = min(rows, j * n)
    return first, min(rows, first + n) - first


class AdamW(torch.optim.AdamW):
    """torch's AdamW on fp32 master rows. named_params: this rank's parameters; masters: one per parameter,
    holding its fp32 .grad (the parameter itself in fp32). groups: torch's param groups, of masters.
    zero=1 with dp·cp > 1: rows row_share(rows, d, j) of every tensor, updated here, then all-gathered
    into the parameters of every rank; else every row. An fp32 parameter's rows are views (updated in
    place); a bf16 one's are fp32 copies: the master weights."""

    def __init__(self, named_params, masters, groups, mesh, config, zero=0, **kw):
        self.group = mesh.dpcp_group if zero else None
        d, j = (dist.get_world_size(self.group), dist.get_rank(self.group)) if self.group else (1, 0)
        self.names, self.params, self.masters = [n for n, _ in named_params], [p for _, p in named_params], masters
        self.rows = [real_rows(n, p, mesh, config) for n, p in named_params]
        self.shares = [row_share(r, d, j) for r in self.rows]
        self.pieces = [p.detach().narrow(0, a, n).float() for p, (a, n) in zip(self.params, self.shares)]
        piece_of = {id(m): x for m, x in zip(masters, self.pieces)}
        super().__init__([{**g, 'params': [piece_of[id(m)] for m in g['params']]} for g in groups], **kw)

    @torch.no_grad()
    def step(self):
        for m, x, (a, n) in zip(self.masters, self.pieces, self.shares):
            if m.grad is not None:
                x.grad = m.grad.narrow(0, a, n)
        super().step()
        for p, x, rows in zip(self.params, self.pieces, self.rows):
            if self.group is not None:  # every rank's rows, padded to the same count for the all-gather
                n = math.ceil(rows / dist.get_world_size(self.group))
                x = all_gather(F.pad(x.to(p.dtype), (0, 0) * (x.dim() - 1) + (0, n - x.shape[0])), 0, self.group)
            if self.group is not None or x.dtype != p.dtype:  # else x is a view of p's own rows
                p[:rows].copy_(x[:rows])

    def zero_grad(self, set_to_none=True):
        for t in self.masters + self.pieces:
            t.grad = None


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
