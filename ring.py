"""
Ring attention: context parallelism that keeps each rank's S/c tokens of q, k and v and passes k, v
around the c ranks of the cp group, one step per rank (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"), each step's attention overlapped with the next k, v's transfer.

What it saves: attention's q, k, v, output and flash's workspace hold S/c tokens on every rank,
all heads kept (Ulysses needs the heads divisible by c; the ring doesn't). Its price in memory:
the k, v in flight, 2·2·B·(S/c)·K·hd·b bytes (the ones it computes on, the next ones arriving),
and one step's k, v repeated to q's H heads for the kernel. In time: c - 1 shifts of k, v
forward, c - 1 of k, v and c of dk, dv backward, B·(S/c)·K·hd elements each (parallel.py's
table), and c kernel calls per attention where one would do.

The cases of a step. Causal attention over S/c-token slabs would leave rank 0 idle once its
slab's keys have passed; the zigzag split (the Llama 3 paper's context parallelism, its 2·c
chunks) gives rank r chunks r and 2c-1-r, so every rank does the same work at every step
(ring_step_blocks): step 0 its own two chunks, causally; from an earlier rank, that rank's first
chunk (it precedes all of ours); from a later rank, its two chunks against our second chunk only.

Each step's (out, lse) merge by online softmax (Milakov & Gimelshein 2018: the running output is a
mean weighted by each part's sum of exponentials, sigmoid of their log-sum-exps' difference), in
fp32. Backward needs no merge: given the final output and log-sum-exp, every step's flash backward
is its exact share of dq and of the visiting dk, dv, which travel on with k, v until they are home.

Packed documents (doc_mask): a query attends its own document's keys only. Each step turns into
flash's variable-length problem (ring_documents): the step's query tokens and visiting key tokens
of each document present on both sides, packed one after the other; on CUDA one varlen kernel
call per step, on a CPU one call per document. Documents of any length, cut anywhere by the
chunks, need no padding (Megatron's packed format pads each to a multiple of 2·c; torchtitan's
balancer asks as much): a document absent from either side simply drops out of that step.
"""
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Function


def ring_shift(x, group):
    """Send x to the next rank, get the previous one's; the returned function waits for it (NCCL: on
    the stream, not the host)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    # one batch, so NCCL posts the send and the receive together (two separate calls deadlock a
    # ring)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, group=group, group_peer=(r + 1) % n),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(r - 1) % n)])

    def wait():
        for work in works:
            work.wait()
        return received
    return wait


def flash_error(device_type, dtype, head_dim):
    """None, or why ring attention's fused flash kernel can't run here (check_layout asks up
    front)."""
    cuda = "cp_impl='ring' on CUDA calls flash attention, which needs"
    if device_type not in ('cuda', 'cpu'):
        return (f"cp_impl='ring' calls flash attention on CUDA or a CPU, not {device_type} "
                "(use cp_impl='ulysses')")
    if device_type == 'cuda' and dtype not in (torch.float16, torch.bfloat16):
        return (f"{cuda} bfloat16 or float16, not {dtype} "
                "(use dtype='bfloat16' or cp_impl='ulysses')")
    if device_type == 'cuda' and (head_dim > 256 or head_dim % 8):
        return f"{cuda} head_dim <= 256 and a multiple of 8, not {head_dim} (use cp_impl='ulysses')"
    return None


def _one(t, first, last):
    """Tokens [first, last) of t [tokens, heads, hd] as a batch of one: [1, heads, tokens, hd],
    what the CPU's flash kernel takes."""
    return t[first:last].transpose(0, 1)[None]


def flash(q, k, v, cu_q, cu_k, causal):
    """(out [Tq, H, hd], lse [H, Tq] fp32, saved: what its backward needs besides) of the fused
    flash kernel over documents packed one after the other: document i is rows cu_q[i]:cu_q[i+1]
    of q [Tq, H, hd] and cu_k[i]:cu_k[i+1] of k, v [Tk, H, hd] (flash-attn's cu_seqlens; k, v have
    q's heads). On CUDA one variable-length call for them all; on a CPU one call per document.
    SDPA hides the log-sum-exp the ring merges with: torch's private aten kernels (varlen_attn
    returns it, but has no backward we could call with the merged output and lse)."""
    if why := flash_error(q.device.type, q.dtype, q.shape[-1]):
        raise ValueError(why)
    if q.is_cuda:
        cu = [torch.as_tensor(c, dtype=torch.int32, device=q.device) for c in (cu_q, cu_k)]
        longest = [int(np.diff(c).max()) for c in (cu_q, cu_k)]
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            query=q, key=k, value=v, cum_seq_q=cu[0], cum_seq_k=cu[1], max_q=longest[0],
            max_k=longest[1], dropout_p=0.0, is_causal=causal, return_debug_mask=False)
        return out, lse, dict(cum_seq_q=cu[0], cum_seq_k=cu[1], max_q=longest[0],
                              max_k=longest[1], rng_state=rng_state, unused=unused)
    outs, lses = [], []
    for (a, b), (c, d) in zip(pairwise(cu_q), pairwise(cu_k)):
        # document [a, b) of q, [c, d) of k, v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query=_one(q, a, b), key=_one(k, c, d), value=_one(v, c, d), dropout_p=0.0,
            is_causal=causal)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1), {}


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, saved):
    """(dq, dk, dv) of flash(q, k, v, cu_q, cu_k, causal) -> out, lse, saved."""
    if q.is_cuda:
        # saved: cu_seqlens, the longest documents, the forward's rng state (no dropout: unused)
        return torch.ops.aten._flash_attention_backward(
            grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0.0,
            is_causal=causal, **saved)
    grads = []
    for (a, b), (c, d) in zip(pairwise(cu_q), pairwise(cu_k)):
        # as flash's loop: one document at a time
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out=_one(dout, a, b), query=_one(q, a, b), key=_one(k, c, d),
            value=_one(v, c, d), out=_one(out, a, b), logsumexp=lse[None, :, a:b], dropout_p=0.0,
            is_causal=causal)
        grads.append([g[0].transpose(0, 1) for g in (dq, dk, dv)])
    dq, dk, dv = zip(*grads)
    return torch.cat(dq), torch.cat(dk), torch.cat(dv)


def ring_step_blocks(step, rank, world, n):
    """At ring step `step`, which of our query rows attend which rows of the visiting k, v, and
    whether causally. Zigzag: rank r holds chunks r and 2P-1-r of 2P, n tokens each."""
    everything, first, second = slice(None), slice(0, n), slice(n, None)
    source = (rank - step) % world  # whose k, v we hold at this step
    if step == 0:
        # our own two chunks: causal within them (chunk r precedes chunk 2P-1-r)
        return everything, everything, True
    if source < rank:
        # an earlier rank: its first chunk precedes all our tokens, its second follows them all
        return everything, first, False
    # a later rank: both its chunks follow our first chunk and precede our second
    return second, everything, False


def ring_documents(docs, B, n, step, rank, world):
    """Step `step`'s attention as documents (flash's packing): (our query tokens that attend,
    the visiting tokens they attend, cu_q, cu_k, causal), tokens as indices into B·2n (each
    rank's rows one after the other, its two chunks in each). A query attends the keys of its own
    document only: a document absent from either side drops out of the step, so documents of any
    length, cut anywhere, need no padding. docs: the starts of documents in the B whole
    sequences of 2·n·world tokens (None: one per sequence)."""
    rows, cols, causal = ring_step_blocks(step, rank, world, n)
    S = 2 * n * world
    if docs is None:
        docs = np.arange(B) * S

    def tokens(r, part):
        # rank r's tokens `part` of each of its rows: (index in B·2n, place in the B·S tokens)
        place = np.concatenate([np.arange(r * n, r * n + n), np.arange(S - r * n - n, S - r * n)])
        row = np.arange(B)[:, None]
        return (row * 2 * n + np.arange(2 * n)[part]).ravel(), (row * S + place[part]).ravel()

    q_tokens, q_places = tokens(rank, rows)
    k_tokens, k_places = tokens((rank - step) % world, cols)
    # each token's document (both sides' places ascend: a document is a run of tokens)
    q_docs, k_docs = (np.searchsorted(docs, p, 'right') for p in (q_places, k_places))
    q_kept, k_kept = np.isin(q_docs, k_docs), np.isin(k_docs, q_docs)
    cu_q, cu_k = ([0, *np.cumsum(np.unique(d, return_counts=True)[1])]
                  for d in (q_docs[q_kept], k_docs[k_kept]))
    return q_tokens[q_kept], k_tokens[k_kept], cu_q, cu_k, causal


def ring_plan(docs, B, n, group, device):
    """Every step's ring_documents, the token indices on the device: made once in forward, read
    again in backward (the documents don't change between them)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = []
    for step in range(world):
        q_tokens, k_tokens, cu_q, cu_k, causal = ring_documents(docs, B, n, step, rank, world)
        rows = torch.as_tensor(q_tokens, device=device)
        cols = torch.as_tensor(k_tokens, device=device)
        plan.append((rows, cols, cu_q, cu_k, causal))
    return plan


def _ring_steps(q, kv, plan, group):
    """Around the ring, one step per rank: (our query tokens, the visiting tokens they attend,
    cu_q, cu_k, causal: the step's plan; the visiting k, v's tokens with q's heads). q [B·2n, H,
    hd], kv [2, B·2n, K, hd]: tokens first. At step s we hold rank r - s's k, v; the next rank's
    move meanwhile, as kv heads (never repeats)."""
    world = len(plan)
    repeats = q.shape[1] // kv.shape[2]  # q heads per kv head: flash wants as many kv heads as q
    for step, (rows, cols, cu_q, cu_k, causal) in enumerate(plan):
        if step < world - 1:  # the next k, v move while we compute on these
            arriving = ring_shift(kv, group)
        k_step, v_step = kv[:, cols].repeat_interleave(repeats, dim=2)
        yield rows, cols, cu_q, cu_k, causal, k_step, v_step
        if step < world - 1:
            kv = arriving()


def _tokens_first(t):
    """[B, heads, tokens, hd] -> [B·tokens, heads, hd], flash's packing (a view where t came from
    a [B, tokens, heads, hd] projection, as q, k, v do)."""
    return t.transpose(1, 2).flatten(0, 1)


class RingAttention(Function):
    """The attention core under ring attention (partial(RingAttention.apply, group)):
    q [B, H, 2n, hd], k, v [B, K, 2n, hd] zigzag shards -> y like q, causal, within documents
    (docs: doc_mask's starts in our rows' whole sequences). Forward: online softmax merges each
    step's flash (out, lse) over the visiting keys of our documents. Backward: given the final out
    and lse, each step's flash backward is its exact share; dk, dv ride the ring home."""

    @staticmethod
    def forward(ctx, group, q, k, v, docs=None):
        B = len(q)
        q, kv = _tokens_first(q), torch.stack([_tokens_first(k), _tokens_first(v)])
        # the output so far and its log-sum-exp per query token and head, fp32
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], -torch.inf, dtype=torch.float32)
        ctx.saved, ctx.group = [], group
        ctx.plan = ring_plan(docs, B, len(q) // B // 2, group, q.device)
        for rows, _, cu_q, cu_k, causal, k_step, v_step in _ring_steps(q, kv, ctx.plan, group):
            if len(rows) == 0:  # none of our documents is among the visiting tokens
                ctx.saved.append(None)
                continue
            block_out, block_lse, saved = flash(q[rows], k_step, v_step, cu_q, cu_k, causal)
            block_lse = block_lse.T  # [tokens, H], as lse
            # online softmax: the output over the keys so far and this block's is their mean
            # weighted by each one's sum of exponentials; this block's share, e^l / (e^lse + e^l),
            # is sigmoid(l - lse) (1 at the first block: lse = -inf; every token attends itself
            # at step 0)
            share = torch.sigmoid(block_lse - lse[rows]).unsqueeze(-1)
            out[rows] = torch.lerp(out[rows], block_out.float(), share)
            lse[rows] = torch.logaddexp(lse[rows], block_lse)
            ctx.saved.append(saved)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        return out.unflatten(0, (B, -1)).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        B = len(dout)
        dout = _tokens_first(dout)
        dq = torch.zeros_like(q, dtype=torch.float32)
        # the visiting k, v's gradients travel with them: P shifts bring each dk, dv home
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        steps = zip(_ring_steps(q, kv, ctx.plan, ctx.group), ctx.saved)
        for (rows, cols, cu_q, cu_k, causal, k_step, v_step), saved in steps:
            if saved is not None:
                dq_rows, dk, dv = flash_backward(dout[rows], q[rows], k_step, v_step, out[rows],
                                                 lse[rows].T.contiguous(), cu_q, cu_k, causal,
                                                 saved)
                dq.index_add_(0, rows, dq_rows.float())
                # dk, dv are per q head: sum each kv head's repeats
                per_kv_head = torch.stack([dk, dv]).float().unflatten(2, (kv.shape[2], -1)).sum(3)
                dkv.index_add_(1, cols, per_kv_head)
            dkv = ring_shift(dkv, ctx.group)()
        dq, dk, dv = (t.unflatten(0, (B, -1)).transpose(1, 2) for t in (dq, *dkv))
        return None, dq, dk, dv, None  # fp32: autograd casts each to its input's dtype
