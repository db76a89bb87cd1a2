"""
Ring attention: context parallelism that keeps each rank's S/c tokens of q, k and v and brings
each other rank's k, v to them, one step per rank (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"), each step's attention overlapped with the next step's transfer.

What it saves: attention's q, k, v, output and flash's workspace hold S/c tokens on every rank,
all heads kept (Ulysses needs the heads divisible by c; the ring doesn't). Its price in memory:
the k, v in flight, at most 3·2·B·(S/c)·K·hd·b bytes (the ones it computes on, the next ones
arriving, and the copy of ours it sends), and one part's k, v repeated to q's H heads for the
kernel. In time: c - 1 transfers of k, v forward, c - 1 of k, v and c - 1 of dk, dv backward, of
at most B·(S/c)·K·hd elements each (parallel.py's table), and a few kernel calls per step.

The cases of a step. Causal attention over S/c-token slabs would leave rank 0 idle once its
slab's keys have passed; the zigzag split (the Llama 3 paper's context parallelism, its 2·c
chunks of n = S/2c tokens) gives rank r chunks r and 2c-1-r, so every rank does the same work at
every step. At step s rank r attends rank r - s's keys, a part per pair of our query chunk a and
its key chunk b (ring_step):
- b = a (step 0, each of our chunks with itself): causal;
- b < a (every key before every query): all of them; from an earlier rank that is its first
  chunk against both of ours, from a later rank its two chunks against our second;
- b > a (every key after every query): nothing, so an earlier rank's second chunk is never sent.
Each step's keys come straight from their rank (one hop of s, not s hops around a ring: inside a
node NVLink joins every pair), and only the tokens some part attends.

A sliding window of W keys (model.py: a query sees the last W, itself included) cuts each part to
the queries and keys within W of each other, and where nothing is left the part is gone. With
W <= n (a chunk is at least a window), of the c steps these remain:
- step 0, both our chunks causally within the window;
- step 1, the last W - 1 keys of chunk r - 1 (rank r - 1's first) for our first chunk's first
  W - 1 queries (rank 0 has no chunk before its first: nothing);
- step c - 1, the last W - 1 keys of chunk 2c-2-r (rank r + 1's second) for our second chunk's
  first W - 1 queries (rank c - 1's second chunk follows its first: its step 0 has them);
- steps 2 to c - 2: nothing computed and nothing sent (their chunks are at least n tokens away).
So a windowed layer's ring moves at most 2·(W - 1) tokens of k, v a rank where the full one moves
(c - 1)·1.5·n on average (n from an earlier rank, 2n from a later), and computes about 2·n·W
query-key pairs where the full one computes S²/2c.
Flash takes a window as (left, right), the keys a query sees before and after the one lined up
with it (the last query with the last key); a part's is (W - 1 - d, d), d the distance from its
last key to its last query: the CUDA kernel's window_size, an additive mask on the CPU's.

Each part's (out, lse) merge by online softmax (Milakov & Gimelshein 2018: the running output is a
mean weighted by each part's sum of exponentials, sigmoid of their log-sum-exps' difference), in
fp32. Backward needs no merge: given the final output and log-sum-exp, every part's flash backward
is its exact share of dq and of the visiting dk, dv, which go back to the rank they came from.

Packed documents (doc_mask): a query attends its own document's keys only. Each part turns into
flash's variable-length problem: the query tokens and visiting key tokens of each document
present on both sides, packed one after the other; on CUDA one varlen kernel call per part (per
window where documents make them differ), on a CPU one call per document. Documents of any
length, cut anywhere by the chunks, need no padding (Megatron's packed format pads each to a
multiple of 2·c; torchtitan's balancer asks as much): a document absent from either side simply
drops out of that part.
"""
from itertools import pairwise, product

import numpy as np
import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.autograd import Function


def ring_shift(x, group, hop, size):
    """Send x [2, tokens, ...] to the rank `hop` places ahead in the group and receive `size` tokens
    from the rank `hop` places behind; the returned function waits for them (NCCL: on the stream,
    not the host). An empty side posts nothing (its peer computes the same sizes and expects
    nothing); hop 0 is our own x."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    received = x
    ops = []
    if hop % n:
        x = x.contiguous()
        received = x.new_empty(len(x), size, *x.shape[2:])
        if x.shape[1]:
            ops.append(dist.P2POp(dist.isend, x, group=group, group_peer=(r + hop) % n))
        if size:
            ops.append(dist.P2POp(dist.irecv, received, group=group, group_peer=(r - hop) % n))
    # one batch, so NCCL posts the send and the receive together (two separate calls deadlock a
    # ring); torch's batch can't be empty
    works = dist.batch_isend_irecv(ops) if ops else []

    def wait():
        for work in works:
            work.wait()
        return received
    return wait


def flash_error(device_type, dtype, head_dim):
    """None, or why ring attention's fused flash kernel can't run here (check_layout asks up
    front)."""
    if device_type == 'cpu':
        return None
    if device_type != 'cuda':
        return (f"cp_impl='ring' calls flash attention on CUDA or a CPU, not {device_type} "
                "(use cp_impl='ulysses')")
    cuda = "cp_impl='ring' on CUDA calls flash attention, which needs"
    if dtype not in (torch.float16, torch.bfloat16):
        return (f"{cuda} bfloat16 or float16, not {dtype} "
                "(use dtype='bfloat16' or cp_impl='ulysses')")
    if head_dim > 256 or head_dim % 8:
        return (f"{cuda} head_dim <= 256 and a multiple of 8, not {head_dim} "
                "(use cp_impl='ulysses')")
    return None


def _indices(values, device):
    """values (token indices, cu_seqlens) as the int32 tensor on `device` the kernels and index ops
    take (int32: a ring plan's are kept from forward to backward, the size of a layer's tokens)."""
    return torch.as_tensor(values, dtype=torch.int32, device=device)


def _one(t, rows):
    """Rows `rows` (a slice) of t [tokens, heads, hd] as a batch of one: [1, heads, rows, hd], what
    the CPU's flash kernel takes."""
    return t[rows].transpose(0, 1)[None]


def _cuda_kernel(q):
    """Whether flash runs CUDA's kernel: on CUDA, and in a dry run, whose fake tensors stand in for
    CUDA's (the kernel's shapes; the CPU's per-document calls and window masks are not what a GPU
    allocates)."""
    return q.is_cuda or active_fake_mode() is not None


def _mask(n_q, n_k, window, dtype):
    """flash's window (left, right) over n_q queries and n_k keys as SDPA's additive mask, for the
    CPU's kernel. Flash lines the last query up with the last key: query i is
    gap = i + n_k - n_q - j keys past key j, and sees it when -right <= gap <= left (-1: no
    bound)."""
    left, right = window
    gap = torch.arange(n_k - n_q, n_k)[:, None] - torch.arange(n_k)
    seen = (gap <= left) | (left < 0)
    seen &= (gap >= -right) | (right < 0)
    return torch.where(seen, 0.0, -torch.inf).to(dtype)


def _cpu_documents(q, k, v, cu_q, cu_k, window):
    """Each document's (its q rows, as a slice; the CPU kernel's keywords: its rows of q, k, v,
    causal, the window's mask where the window is more than causal or nothing)."""
    for (a, b), (c, d) in zip(pairwise(cu_q), pairwise(cu_k)):
        rows, cols = slice(a, b), slice(c, d)
        # the kernel's causal (which skips the blocks past the diagonal) lines the first query up
        # with the first key: flash's where both sides are as long. Any other window is a mask
        causal = window[1] == 0 and b - a == d - c
        mask = None
        if window != (-1, -1) and not (causal and window[0] < 0):
            mask = _mask(b - a, d - c, window, q.dtype)
        yield rows, dict(query=_one(q, rows), key=_one(k, cols), value=_one(v, cols),
                         is_causal=causal, attn_mask=mask)


def flash(q, k, v, cu_q, cu_k, window):
    """(out [Tq, H, hd], lse [H, Tq] fp32, saved: what its backward needs besides) of the fused
    flash kernel over documents packed one after the other: document i is rows cu_q[i]:cu_q[i+1]
    of q [Tq, H, hd] and cu_k[i]:cu_k[i+1] of k, v [Tk, H, hd] (flash-attn's cu_seqlens; k, v have
    q's heads), each under flash's `window` (left, right): the keys a query sees before and after
    the one lined up with it, -1 for all ((-1, 0): causal). On CUDA one variable-length call for
    them all; on a CPU one call per document. SDPA hides the log-sum-exp the ring merges with:
    torch's private aten kernels (varlen_attn returns it, but has no backward we could call with
    the merged output and lse)."""
    if why := flash_error(q.device.type, q.dtype, q.shape[-1]):
        raise ValueError(why)
    if _cuda_kernel(q):
        # cu_seqlens on the device, the longest documents, the window
        saved = dict(cum_seq_q=_indices(cu_q, q.device), cum_seq_k=_indices(cu_k, q.device),
                     max_q=int(np.diff(cu_q).max()), max_k=int(np.diff(cu_k).max()),
                     is_causal=window[1] == 0, window_size_left=window[0],
                     window_size_right=window[1])
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            query=q, key=k, value=v, dropout_p=0.0, return_debug_mask=False, **saved)
        return out, lse, dict(saved, rng_state=rng_state, unused=unused)
    outs, lses = [], []
    for rows, how in _cpu_documents(q, k, v, cu_q, cu_k, window):
        # a document: its rows of q, its cols of k, v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(dropout_p=0.0, **how)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1), {}


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, window, saved):
    """(dq, dk, dv) of flash(q, k, v, cu_q, cu_k, window) -> out, lse, saved."""
    if _cuda_kernel(q):
        # saved: cu_seqlens, the longest documents, the window, the forward's rng state (no
        # dropout: unused)
        return torch.ops.aten._flash_attention_backward(
            grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0.0,
            **saved)
    grads = []
    for rows, how in _cpu_documents(q, k, v, cu_q, cu_k, window):
        # as flash's loop: one document at a time
        doc_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out=_one(dout, rows), out=_one(out, rows), logsumexp=lse[None, :, rows],
            dropout_p=0.0, **how)
        # its dq, dk, dv, tokens first
        grads.append([g[0].transpose(0, 1) for g in doc_grads])
    # each of dq, dk, dv: the documents' one after the other
    return tuple(torch.cat(g) for g in zip(*grads))


def ring_step(docs, B, n, window, step, rank, world):
    """Step `step` of rank `rank` as flash's packed documents: (parts, needed). A part is (our query
    tokens, the visiting tokens they attend, cu_q, cu_k, flash's window), one per pair of a query
    chunk and a key chunk (and per window where documents make them differ); `needed`: the visiting
    tokens some part attends, which their rank sends. Tokens are indices into B·2n: each rank's
    rows one after the other, its two chunks in each. Zigzag: rank r holds chunks r and 2P-1-r of
    2P, n tokens each. docs: the starts of documents in the B whole sequences of 2·n·P tokens
    (None: one per sequence); window: the layer's sliding window (0: none)."""
    S = 2 * n * world
    W = window or S  # (no window: the whole past)
    if docs is None:
        docs = np.arange(B) * S
    ends = np.append(docs[1:], B * S)
    source = (rank - step) % world
    parts = []
    # a chunk's tokens (n a row): their row, their place in the chunk
    row, offset = np.divmod(np.arange(B * n), n)

    def kept(chunk, partner, lo, hi):
        """The tokens of `chunk` with a partner of their document in chunk `partner`, at places
        within [lo, hi) of theirs: (those tokens, how many of them in each document, each
        document's last one's place). A document's kept tokens are a run (a chunk cut by a
        document, then by the window)."""
        # each token's place in the B whole sequences; the partner chunk's first in its row
        places = row * S + chunk * n + offset
        partners = row * S + partner * n
        doc = np.searchsorted(docs, places, 'right') - 1
        first = np.maximum.reduce([docs[doc], partners, places + lo])
        paired = first < np.minimum.reduce([ends[doc], partners + n, places + hi])
        _, counts = np.unique(doc[paired], return_counts=True)
        # a rank's second chunk is one of the last P
        tokens = row * 2 * n + n * (chunk >= world) + offset
        return tokens[paired], counts, places[paired][np.cumsum(counts) - 1]

    for a, b in product([rank, 2 * world - 1 - rank], [source, 2 * world - 1 - source]):
        # our chunk a's queries, the visiting chunk b's keys
        if b > a:
            continue  # every key after every query
        # a query attends when a key of its document lies in (query - W, query], within chunk b;
        # a key is attended when a query of its document lies in [key, key + W), within chunk a
        q_tokens, q_counts, q_last = kept(a, b, 1 - W, 1)
        k_tokens, k_counts, k_last = kept(b, a, 0, W)
        # flash's lining up of the last query with the last key is the places' when
        # right = (last query's place - last key's place) and left = W - 1 - right
        right = q_last - k_last
        windows = np.stack([W - 1 - right, right], axis=1)
        if not window:
            # all of the past: causal in our own chunk (right 0), else every key
            windows[:] = (-1, 0 if a == b else -1)
        for w in np.unique(windows, axis=0):
            chosen = (windows == w).all(axis=1)
            parts.append((q_tokens[np.repeat(chosen, q_counts)],
                          k_tokens[np.repeat(chosen, k_counts)],
                          [0, *np.cumsum(q_counts[chosen])], [0, *np.cumsum(k_counts[chosen])],
                          tuple(w.tolist())))
    needed = np.unique(np.concatenate([[], *(part[1] for part in parts)])).astype(int)
    return parts, needed


# the plans made so far, by their arguments: every block and head group of a micro-batch asks for
# the same one (the same documents, shapes and window), and without documents every micro-batch
# does. Shared, a plan's int32 indices (10·c + 6 bytes a token on rank 0) are held once, not once
# per block, head group and micro-batch: at 10M tokens on 16 GPUs that was 15.5 GiB a rank of
# Llama-3-8B's (memory.py). A graph's node keeps its own reference; the cache forgets the oldest.
_PLANS = {}


def ring_plan(docs, B, n, window, group, device):
    """Every step's (parts, the number of visiting tokens that arrive, the tokens of ours we send):
    the parts' token indices on the device, their visiting tokens as places in what arrives; made
    once in forward, read again in backward (the documents don't change between them), and shared
    by every call with the same arguments."""
    key = (None if docs is None else np.asarray(docs).tobytes(), B, n, window, group, str(device))
    if key in _PLANS:
        return _PLANS[key]
    if len(_PLANS) >= 16:  # (a few windows' and micro-batches' plans)
        _PLANS.pop(next(iter(_PLANS)))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = []
    for step in range(world):
        parts, needed = ring_step(docs, B, n, window, step, rank, world)
        # what the rank `step` ahead attends of our tokens: what we send it
        _, sent = ring_step(docs, B, n, window, step, (rank + step) % world, world)
        # a part's visiting tokens: their places in what arrives (needed, in order); its packing
        # (cu_q, cu_k, window: flash's last arguments) as it is
        on_device = [(_indices(rows, device), _indices(np.searchsorted(needed, cols), device),
                      *packing) for rows, cols, *packing in parts]
        plan.append((on_device, len(needed), _indices(sent, device)))
    _PLANS[key] = plan
    return plan


def _visiting(kv, plan, group):
    """Each step's visiting k, v [2, tokens, K, hd]: the tokens of rank r - step that our queries
    attend, sent by it as kv heads (never repeated); the next step's arrive while we compute on
    these."""
    # step 0: our own tokens, each of which attends itself: all of kv, as it is
    visiting = kv
    for step, (_, size, sent) in enumerate(plan[1:], 1):
        # post the transfer of the next step's k, v, compute on these, then wait for the next's
        arriving = ring_shift(kv[:, sent], group, step, size)
        yield visiting
        visiting = arriving()
    yield visiting


def _tokens_first(t):
    """[B, heads, tokens, hd] -> [B·tokens, heads, hd], flash's packing (a view where t came from
    a [B, tokens, heads, hd] projection, as q, k, v do)."""
    return t.transpose(1, 2).flatten(0, 1)


class RingAttention(Function):
    """The attention core under ring attention (partial(RingAttention.apply, group)):
    q [B, H, 2n, hd], k, v [B, K, 2n, hd] zigzag shards -> y like q, causal, within documents
    (docs: doc_mask's starts in our rows' whole sequences) and the layer's sliding window.
    Forward: online softmax merges each part's flash (out, lse) over the visiting keys it attends.
    Backward: given the final out and lse, each part's flash backward is its exact share; the
    visiting tokens' dk, dv go home."""

    @staticmethod
    def forward(ctx, group, q, k, v, docs, window):
        B = len(q)
        q, kv = _tokens_first(q), torch.stack([_tokens_first(k), _tokens_first(v)])
        # the output so far and its log-sum-exp per query token and head, fp32
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], -torch.inf, dtype=torch.float32)
        ctx.saved, ctx.group = [], group
        # n: half of our 2n tokens, one chunk
        ctx.plan = ring_plan(docs, B, k.shape[2] // 2, window, group, q.device)
        # q heads per kv head: flash wants as many kv heads
        ctx.repeats = q.shape[1] // kv.shape[2]
        for (parts, _, _), visiting in zip(ctx.plan, _visiting(kv, ctx.plan, group)):
            for rows, cols, *packing in parts:
                k_part, v_part = visiting[:, cols].repeat_interleave(ctx.repeats, dim=2)
                part_out, part_lse, saved = flash(q[rows], k_part, v_part, *packing)
                part_lse = part_lse.T  # [tokens, H], as lse
                # online softmax: the output over the keys so far and this part's is their mean
                # weighted by each one's sum of exponentials; this part's share, e^l / (e^lse +
                # e^l), is sigmoid(l - lse) (1 at a token's first part: lse = -inf; every token
                # attends itself in step 0's first part of its chunk)
                share = torch.sigmoid(part_lse - lse[rows]).unsqueeze(-1)
                out[rows] = torch.lerp(out[rows], part_out.float(), share)
                lse[rows] = torch.logaddexp(lse[rows], part_lse)
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
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        saved = iter(ctx.saved)
        steps = zip(ctx.plan, _visiting(kv, ctx.plan, ctx.group))
        for step, ((parts, _, sent), visiting) in enumerate(steps):
            d_visiting = torch.zeros_like(visiting, dtype=torch.float32)
            for rows, cols, *packing in parts:
                k_part, v_part = visiting[:, cols].repeat_interleave(ctx.repeats, dim=2)
                dq_rows, dk, dv = flash_backward(dout[rows], q[rows], k_part, v_part, out[rows],
                                                 lse[rows].T.contiguous(), *packing, next(saved))
                dq.index_add_(0, rows, dq_rows.float())
                # dk, dv are per q head: sum each kv head's repeats
                per_kv_head = torch.stack([dk, dv]).float().unflatten(2, (-1, ctx.repeats)).sum(3)
                d_visiting.index_add_(1, cols, per_kv_head)
            # the visiting tokens' gradients go home to the rank `step` behind; the rank `step`
            # ahead sends those of the tokens we sent it
            dkv.index_add_(1, sent, ring_shift(d_visiting, ctx.group, -step, len(sent))())
        dq, dk, dv = (t.unflatten(0, (B, -1)).transpose(1, 2) for t in (dq, *dkv))
        return None, dq, dk, dv, None, None  # fp32: autograd casts each to its input's dtype
