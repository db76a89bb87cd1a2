"""
Mini-sequence MLP and chunked LM head + cross-entropy, as autograd Functions; attention by head
groups.

Two tensors grow with the number of tokens S and dwarf everything else in a long-context step
(b = bytes per element: 2 in bf16, 4 in fp32; h = width, I = MLP intermediate size, V = vocabulary):

  SwiGLU MLP   y = (silu(x W1ᵀ) * x W3ᵀ) W2ᵀ. Autograd keeps x W1ᵀ, x W3ᵀ, silu(x W1ᵀ) and the
               product: 4·I·b bytes per token per layer (Llama 3 8B: I = 14,336 -> 115 KB/token
               in bf16).
               mini-sequence: keep only x (which the block's norm produced anyway); forward and
               backward walk ceil(S/M)-token chunks, backward recomputes each chunk's
               intermediates.
               S·4·I·b kept  ->  0 kept, (S/M)·3·I·b transient inside the layer (three buffers,
               reused).
  LM head+loss logits = x Wᵀ are S×V; F.cross_entropy upcasts them to fp32, keeps the fp32
               log-softmax for backward, and backward makes an fp32 gradient of the same size:
               about S·V·(b + 4 + 4) bytes (V = 128,256, S = 8,192: 4.2 GB per fp32 copy).
               Ours makes the gradient in forward, softmax - onehot in the logits' own buffer,
               so nothing of that size is kept (loss_chunks = 1, the plain path: one S×V fp32
               buffer); chunked: one (S/M)×V fp32 buffer at a time, reused; kept from forward to
               backward only dx (S·h·b) and the fp32 weight gradient (V·h·4).
               S·V·(b + 8)  ->  (S/M)·V·4 (+ (S/M)·V·b for a low-precision copy in bf16).

How many chunks (mlp_chunks = 0 / loss_chunks = 0 in the config): make one chunk's transient about
the size of a tensor we hold anyway, so chunking never sets the peak:
    loss:  M = ceil(V / h)   -> one chunk's logits (S/M)·V ≈ S·h elements, the size of x
    MLP:   M = ceil(3I / h)  -> one chunk's backward, 3·(S/M)·I, ≈ S·h, the size of the block input
with at least MIN_CHUNK_TOKENS = 256 tokens per chunk (M <= ceil(S / 256): fewer rows make the
matmuls slow for little memory) and M in [1, S]. Llama 3 8B at S = 8,192: M = 32 for the loss, 11
for the MLP. Or from a memory budget: M = ceil(S · bytes_per_token / budget).

A third grows with the heads a rank's attention runs at once (a heads and the S_a tokens each sees:
a = H, S_a = S in one process; under Ulysses a = H/c of the whole sequence):

  attention    q, k, v (b·(h + 2kv) per token), the output (b·h) and flash attention's backward
               workspace (its fp32 dq accumulator, kv expanded to the query heads, Ulysses'
               head-major copies: about 4·a·hd + 4·b·a·hd per token of S_a, `workspace` below)
               exist for every head at once, forward to backward (recompute='none') or in the
               block's backward (recompute='full').
               by head groups (attention_chunks = G): a kv head with its query heads, or several,
               one group at a time: projections, RoPE, Ulysses' all-to-alls or the ring, the kernel
               and its share of wo; the output is the sum of the groups' (wo's columns split as the
               heads are). Each group runs under torch's checkpoint, so forward keeps only the
               norm's output x (kept anyway) and backward runs the group again, then its backward.
               b·(2h + 2kv)·S + W(a)  ->  b·(2h + 2kv)·S / G + W(a / G)
               Llama 3 8B under Ulysses over 8 GPUs at 5.5M tokens: 4 heads a rank -> 1; the
               workspace 31.6 -> 5.3 GiB a rank.
               The price: attention's forward once more in backward (a third time under
               recompute='full'), and the G groups' outputs summed in bf16 (rounded G times).

How many groups (attention_chunks = 0): one per kv head, the most a rank's heads allow: under
Ulysses each group must still give every one of the c ranks a query head and a kv head (Llama 3 8B,
c = 8: 4 groups of 8 query heads), under tensor parallelism the heads are the rank's.

Where it comes from: the Mini-Sequence Transformer (Luo et al. 2024, arXiv 2407.15892) chunks both
and, with activation recomputation, trains Llama 3 8B at 60K tokens on one 80 GB A100. Its public
code drops the last S mod M tokens of the loss and chunks the MLP with split + cat (which saves
nothing, see below); we do neither. The loss gradient computed in forward and handed to autograd is
Liger's fused linear cross-entropy (FLCE), also torch's `F.linear_cross_entropy(options=...)`.
Given a process group, the same loss runs over a shard of the vocabulary (Megatron's
vocabulary-parallel cross-entropy): ⌈V/t⌉ rows of W per rank, the logits [S/M, V/t], per chunk one
all-gather of S/M floats. Attention by head groups is UPipe's (Untied Ulysses, arXiv 2602.21196,
2026: Llama 3 8B at 5M tokens on 8 H100s), which keeps each group's output and logsumexp and calls
the kernel's backward itself; we run the group's forward again instead, so every attention
(SDPA, the document loop, Ulysses, the ring) works unchanged inside a group.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import MLP, Attention
from moe import Experts, MoE


# ----------------------------------------------------------------------------- how many chunks
# The header's floor: 16-token chunks of the LM head took 3x the time of 256-token ones
# (2026-11-23, a 2-core CPU), and 256·V·4 bytes = 131 MB for Llama 3's vocabulary is no more than
# the fp32 weight gradient whenever h >= 256.
MIN_CHUNK_TOKENS = 256
# fp16: the loss's g = softmax - onehot is made in forward, before any loss scale, so it is cast
# times LIFT: 2^4, what the starting loss scale 2^16 over a micro-batch of 4,096 tokens makes of
# plain autograd's g, so dx's and dW's fp16 sums stay as far below 65,504 as that path's. (2^12
# overflowed them in train_tiny's fp16 run; 1 let 50 steps drift 3.4% from fp32's losses:
# 2026-11-28)
LIFT = 16.0


def _auto_chunks(n_tokens, m):
    """The header's M = m, with MIN_CHUNK_TOKENS a chunk at least, in [1, n_tokens]."""
    return max(1, min(n_tokens, m, math.ceil(n_tokens / MIN_CHUNK_TOKENS)))

def auto_mlp_chunks(n_tokens, dim, intermediate):
    return _auto_chunks(n_tokens, math.ceil(3 * intermediate / dim))

def auto_loss_chunks(n_tokens, dim, vocab):
    return _auto_chunks(n_tokens, math.ceil(vocab / dim))

def mlp_chunks(config, n_tokens, width=0):
    """config.mlp_chunks, with 0 resolved from one sequence's n_tokens and the whole intermediate
    size (under tensor parallelism too: a rank's chunk, n·I/tp, is then about its block input),
    or `width` (the experts' rows: moe_intermediate_size). The one place a count is chosen:
    model.py, offload.py and memory.py all ask here."""
    return config.mlp_chunks or auto_mlp_chunks(int(n_tokens), config.n_embd,
                                                 width or config.intermediate_size)

def attention_chunks(config, heads, kv_heads, ulysses=1):
    """config.attention_chunks, with 0 resolved for this rank's `heads` query and `kv_heads` kv
    heads: the most groups (a kv head each at most) that still give each of Ulysses' `ulysses`
    ranks a query head of every group, and a kv head (its own, or one it shares)."""
    if config.attention_chunks:
        return config.attention_chunks
    # the most groups first
    for g in range(kv_heads, 1, -1):
        kv = kv_heads // g  # kv heads in a group
        spread = heads // g % ulysses == 0 and (kv % ulysses == 0 or ulysses % kv == 0)
        if kv_heads % g == 0 and spread:
            return g
    return 1

def loss_chunks(config, n_tokens):
    """config.loss_chunks, with 0 resolved from the n_tokens of one micro-batch (all its rows)."""
    return config.loss_chunks or auto_loss_chunks(int(n_tokens), config.n_embd, config.vocab_size)


# ----------------------------------------------------------------------------- small helpers
def _autocast(*tensors):
    """Our Functions run their matmuls by hand, so under autocast we cast the inputs once, up
    front, to what autocast would have used (as F.linear would), and switch autocast off inside."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    return [t.to(torch.get_autocast_dtype(device)) for t in tensors]

def _no_autocast(x):
    """Autocast off on x's device, inside our Functions (see _autocast)."""
    return torch.autocast(x.device.type, enabled=False)

def _mm_f32(a, b, out):
    """out (fp32) = a @ b. cuBLAS writes fp32 straight from bf16 inputs; the CPU has no such mm,
    so there we round the product to bf16 first (what the plain path's bf16 logits do anyway)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return out.copy_(torch.mm(a, b))

def _acc_mm_(acc, a, b, offsets=None):
    """acc (fp32) += a @ b, nothing where acc is None (no gradient wanted). Weight gradients are
    sums over every token: summing chunk after chunk in bf16 loses the small contributions, so the
    running sum is fp32 whatever the weights are. (A bf16 a @ b is rounded once per chunk, then
    added in fp32.) Autograd casts the sum back to the weight's dtype when we return it. Given
    offsets (see _mm): acc[e] += a's columns of group e @ b's rows of group e, or (b [E, ...])
    a's rows of group e @ b[e]."""
    if acc is None:
        return
    if offsets is None and a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(_mm(a, b, offsets))

def _mm(a, b, offsets, out=None):
    """a @ b (into out if given); given offsets (int32, group e's rows of a end at offsets[e]),
    b is [E, ...] and group e's rows multiply b[e]: every expert's rows in one grouped GEMM
    (grouped_mm has no out=: its result is copied)."""
    if offsets is None:
        return torch.mm(a, b, out=out)
    y = F.grouped_mm(a, b, offs=offsets)
    if out is None:
        return y
    return out.copy_(y)

def _chunks(N, n, offsets=None):
    """Rows [0, N) n at a time: each chunk's slice (a slice past N ends at N) and the groups'
    offsets within its rows (see _mm; None: no groups)."""
    for s in range(0, N, n):
        within = None if offsets is None else (offsets - s).clamp(0, n)
        yield slice(s, s + n), within


# ----------------------------------------------------------------------------- mini-sequence MLP
# Why not simply `torch.cat([mlp(c) for c in x.split(n)])`? Autograd records every chunk's forward
# and keeps that chunk's x W1ᵀ, x W3ᵀ, silu and product until backward: summed over the chunks,
# the same S × 4I the plain MLP keeps (tests/test_chunked.py counts the bytes). Chunking saves
# memory only if the intermediates are *not* kept: run forward under no_grad, recompute them in
# backward. The price is two of the nine matmuls again (x W1ᵀ and x W3ᵀ), about 20% more MLP FLOPs.

class _ChunkedMLP(torch.autograd.Function):
    """x [N, h] (every batch row's tokens, flattened) in chunks of n tokens. Experts (moe.py):
    weights [E, ...] and offsets, where each one's rows end (None: one MLP); a chunk of rows is
    cut wherever it falls, its own offsets (_chunks) giving each row its expert."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, n, offsets):
        # all we keep: the input (and the weights, kept anyway)
        ctx.save_for_backward(x, w1, w3, w2)
        ctx.n, ctx.offsets = n, offsets
        y = x.new_empty(len(x), w2.shape[-2])
        with _no_autocast(x):
            for chunk, o in _chunks(len(x), n, offsets):
                xc = x[chunk]
                # two statements: the previous chunk's `a` is freed before x W3ᵀ is made (on one
                # line three [n, I] buffers are alive at once: +0.30 GiB at 1M tokens)
                a = F.silu(_mm(xc, w1.mT, o), inplace=True)  # a := silu(x W1ᵀ)
                a.mul_(_mm(xc, w3.mT, o))                    # a := silu(x W1ᵀ) · x W3ᵀ
                _mm(a, w2.mT, o, out=y[chunk])               # y = a W2ᵀ
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w1, w3, w2 = ctx.saved_tensors
        # weight gradients accumulate over the chunks in fp32 (see _acc_mm_); None: not needed
        g1, g3, g2 = (w.new_zeros(w.shape, dtype=torch.float32) if need else None
                      for w, need in zip((w1, w3, w2), ctx.needs_input_grad[1:4]))
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        with _no_autocast(x):
            for chunk, o in _chunks(len(x), ctx.n, ctx.offsets):
                xc, gyc = x[chunk], gy[chunk]
                # Three [n, I] buffers, each reused in place: a working set of 3·n·I·b bytes.
                # silu'(a) = sig + silu·(1 - sig) needs sig and silu(a), not a: silu overwrites a.
                a = _mm(xc, w1.mT, o)  # recompute this chunk only
                b = _mm(xc, w3.mT, o)
                g = torch.sigmoid(a)
                a.mul_(g)                             # a := silu(x W1ᵀ)
                g.addcmul_(g, a, value=-1).add_(a)    # g := silu'(x W1ᵀ)
                g.mul_(b)                             # g := x W3ᵀ · silu'
                b.mul_(a)                             # b := silu(x W1ᵀ) · x W3ᵀ, W2's input
                _acc_mm_(g2, gyc.t(), b, o)  # dW2 += gyᵀ (silu(x W1ᵀ) · x W3ᵀ)
                _mm(gyc, w2, o, out=b)       # b := dz, the gradient of that product
                g.mul_(b)                    # g := d(x W1ᵀ) = dz · x W3ᵀ · silu'
                b.mul_(a)                    # b := d(x W3ᵀ) = dz · silu(x W1ᵀ)
                _acc_mm_(g1, g.t(), xc, o)   # dW1 += d(x W1ᵀ)ᵀ x
                _acc_mm_(g3, b.t(), xc, o)   # dW3 += d(x W3ᵀ)ᵀ x
                if dx is not None:
                    # dx = d(x W1ᵀ) W1 + d(x W3ᵀ) W3
                    _acc_mm_(_mm(g, w1, o, out=dx[chunk]), b, w3, o)
                del a, b, g  # before the next chunk's buffers exist, not after
        # (autograd casts the fp32 sums to the weights' dtype)
        return dx, g1, g3, g2, None, None


def chunked_mlp(x, w1, w3, w2, chunks, offsets=None):
    """SwiGLU MLP F.linear(silu(F.linear(x, w1)) * F.linear(x, w3), w2) over x [..., S, h] in
    ceil(tokens / chunks)-token pieces (all tokens of all batch rows, flattened), keeping only x
    for backward. Weights in nn.Linear layout [out, in], no biases. chunks = 0 picks
    auto_mlp_chunks. Given offsets (int32), E experts (moe.py): x [n, h] their rows one expert
    after the other, expert e's ending at offsets[e], weights stacked [E, out, in], and each
    matmul one grouped GEMM over every expert's rows (of a chunk, the experts whose rows it
    holds)."""
    h = x.shape[-1]
    tokens = x.numel() // h
    chunks = chunks or auto_mlp_chunks(tokens, h, w1.shape[-2])
    rows, w1, w3, w2 = _autocast(x.reshape(tokens, h), w1, w3, w2)
    # (no rows: the chunks' loop, which runs none; grouped_mm's backward fails on no rows)
    if chunks <= 1 and tokens:
        # autograd's matmuls, which keep x W1ᵀ, x W3ᵀ, silu and the product (4·I a token)
        y = _mm(F.silu(_mm(rows, w1.mT, offsets)) * _mm(rows, w3.mT, offsets), w2.mT, offsets)
    else:
        y = _ChunkedMLP.apply(rows, w1, w3, w2, max(1, math.ceil(tokens / chunks)), offsets)
    return y.view(*x.shape[:-1], w2.shape[-2])


# ------------------------------------------------------------------------- chunked LM head + loss
# loss = Σ_i valid_i · (logsumexp(x_i Wᵀ) - x_i W_{t_i}ᵀ) / count; with g_i = softmax(x_i Wᵀ) -
# onehot(t_i) (zero where t_i is ignored): dL/dx = g W / count, dL/dW = gᵀ x / count. Per chunk
# that is one matmul for the logits and two for the gradients. We compute the gradients in forward,
# while the chunk's logits are at hand, and hand them to autograd from backward (scaled by the
# incoming gradient): 3 matmuls in all. Recomputing in backward instead would redo the logits
# matmul, 4 in all, a third more of the dominant cost, for no memory gain (dx and dW are held
# either way at the start of backward, when every activation is still alive). Eval under no_grad
# does only the logits.
#
# Vocabulary parallel (the header's; `group` = the t tensor-parallel ranks): rank r holds rows
# [r·⌈V/t⌉, (r+1)·⌈V/t⌉) of W, the last rank's rows past V padding that never becomes a logit. Each
# rank runs the same loop on its rows; the all-gathered log-sum-exps of the ranks give the whole
# vocabulary's, which turns the local softmax into its share of the global one; the rank holding a
# token's target adds its logit (one all-reduce of one number at the end). dx is this rank's part
# of the sum over the vocabulary: parallel.py, which gathered the head's input, reduces its
# gradient.

def _ce_chunks(x, weight, targets, n, grad_x, grad_w, group, vocab_size):
    """x [N, h], weight [V, h] or this rank's [⌈V/t⌉, h], targets [N], n tokens a chunk ->
    (loss sum, count, dx·count, dW·count); dx, dW None where not wanted."""
    N, rows = len(x), len(weight)
    rank = 0 if group is None else dist.get_rank(group)
    # this rank's rows of the vocabulary are [first, first + real); the rest is padding
    first = rank * rows
    real = max(0, min(rows, vocab_size - first))
    want_grad = real > 0 and (grad_x or grad_w)
    # (-100: the target F.cross_entropy ignores by default, as HF's labels mark padding)
    valid = targets != -100
    # the targets whose logit this rank holds; the others point at row 0, masked below
    ours = valid & (targets >= first) & (targets < first + real)
    target_rows = torch.where(ours, targets - first, 0).unsqueeze(1)
    mask = valid.to(x.dtype).unsqueeze(1)
    # per token: the target's logit, and the log-sum-exp (a rank of padding only adds
    # exp(-inf) = 0)
    target_logit = x.new_zeros(N, dtype=torch.float32)
    lse = x.new_full((N,), -math.inf, dtype=torch.float32)
    # the one logits buffer, reused by every chunk
    buf = x.new_empty(min(n, N), real, dtype=torch.float32)
    dx = torch.zeros_like(x) if grad_x else None
    dW = weight.new_zeros(weight.shape, dtype=torch.float32) if grad_w else None
    for chunk, _ in _chunks(N, n):
        xc = x[chunk]
        logits = buf[:len(xc)]
        if real:
            _mm_f32(xc, weight[:real].t(), out=logits)
            # Everything in place on the chunk's buffer, which is far bigger than the caches: each
            # pass over it costs a trip to memory. softmax is one fused row-wise pass with one exp
            # per logit (log_softmax then exp would be two passes and two exps); the loss comes from
            # the two cheap reductions around it: logsumexp = max - log(max softmax), exact and
            # never log(0).
            target_logit[chunk] = logits.gather(1, target_rows[chunk]).squeeze(1)
            top = logits.amax(1)
            torch.softmax(logits, 1, out=logits)
            lse[chunk] = top - logits.amax(1).log()
        if group is not None:
            # the whole vocabulary's log-sum-exp; our softmax becomes our share of it
            every = lse.new_empty(dist.get_world_size(group) * len(xc))
            dist.all_gather_single(every, lse[chunk], group=group)
            whole = every.view(-1, len(xc)).logsumexp(0)
            if want_grad:
                logits.mul_((lse[chunk] - whole).exp().unsqueeze(1))
            lse[chunk] = whole
        if not want_grad:
            continue
        # g = softmax - onehot
        logits.scatter_add_(1, target_rows[chunk], -ours[chunk, None].float())
        if weight.dtype == torch.float16:
            # fp16 flushes what is below 2^-24 and rounds what is below 2^-14: the unlikely tokens'
            # probabilities, which plain autograd's g carries times the loss scale. LIFT does that
            # here (dx, dW come out LIFT times too: backward divides)
            logits.mul_(LIFT)
        # ignored rows still hold a softmax in g; we zero their contribution on the small [n, h]
        # side (dx rows, x rows) instead of another pass over the [n, V] buffer
        g = logits.to(weight.dtype)
        if grad_x:
            torch.mm(g, weight[:real], out=dx[chunk]).mul_(mask[chunk])
        if grad_w:
            _acc_mm_(dW[:real], g.t(), xc * mask[chunk])
    target_sum = torch.where(ours, target_logit, 0).sum()
    if group is not None:
        # each target's logit lives on one rank
        dist.all_reduce(target_sum, group=group)
    # count: a tensor, no host sync
    return (lse * valid).sum() - target_sum, valid.sum(), dx, dW


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, n, group, vocab_size, grad_enabled):
        grad_x, grad_w = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        with _no_autocast(x):
            loss_sum, count, dx, dW = _ce_chunks(x, weight, targets, n, grad_x, grad_w, group,
                                                 vocab_size)
        # kept as attributes, not save_for_backward: these are results, not inputs to recompute
        # from, and saved-tensor hooks (offload.py) must not move them to the host
        ctx.count, ctx.dx, ctx.dW = count, dx, dW
        ctx.lift = LIFT if weight.dtype == torch.float16 else 1.0
        return loss_sum / count.clamp(min=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.count is None:
            raise RuntimeError("chunked_cross_entropy: backward ran twice; "
                               "retain_graph is not supported")
        # mean over non-ignored targets; 0 targets -> 0 grads; fp16's LIFT undone
        scale = grad_loss / ctx.count.clamp(min=1) / ctx.lift
        dx, dW = ctx.dx, ctx.dW
        # drop our references so the buffers are scaled in place and handed to autograd (which can
        # then adopt dW as W.grad without a copy, or cast the fp32 dW to W's dtype), and nothing
        # outlives this backward
        ctx.count = ctx.dx = ctx.dW = None
        for grad in (dx, dW):
            if grad is not None:
                grad.mul_(scale)
        return dx, dW, None, None, None, None, None


def chunked_cross_entropy(x, weight, targets, chunks, group=None, vocab_size=None):
    """Mean cross-entropy of F.linear(x, weight) (fp32 logits) against targets, over the targets
    that are not -100 (F.cross_entropy's ignore_index): sum / max(count, 1), so an all-ignored
    batch gives 0. x [N, h] or [B, S, h], weight [V, h] (the LM head, possibly the tied
    embedding), targets [N] or [B, S].
    ceil(N / chunks) tokens' fp32 logits at a time. chunks = 0 picks auto_loss_chunks; chunks = 1
    is model.py's plain path: all N at once, in one buffer that becomes their gradient (no
    log-softmax kept, no gradient of the same size made in backward: F.cross_entropy on the
    logits holds three [N, V] fp32 tensors and takes 1.35x the time, 2026-11-28, a 2-core CPU,
    N = 2,048, V = 128,256). With a process group, weight is this rank's
    [⌈V/t⌉, h] rows of the vocabulary_size V (vocabulary parallel, above); every rank gets the
    loss."""
    x, targets = x.flatten(0, -2), targets.flatten()
    vocab_size = vocab_size or len(weight)
    # (x is [N, h] now)
    chunks = chunks or auto_loss_chunks(*x.shape, vocab_size)
    n = max(1, math.ceil(len(x) / chunks))
    # eval under no_grad: logits only (needs_input_grad doesn't see no_grad)
    x, weight = _autocast(x, weight)
    return _ChunkedCrossEntropy.apply(x, weight, targets, n, group, vocab_size,
                                      torch.is_grad_enabled())


# ------------------------------------------------------------------------- attention by head groups
# The header's third tensor, cut along the heads instead of the tokens: attention's softmax needs
# every key of a head, but no head needs another's. So the output is a sum over groups of heads
# (their columns of wo), and each group can run alone.

def head_groups(group, groups, x, *args):
    """Attention as the sum of `groups` head groups' outputs, one group at a time: group(x, *args,
    g, groups) is model.Attention.group, group g's projections, RoPE, attention (Ulysses'
    all-to-alls or the ring's steps inside) and wo. Each runs under torch's checkpoint: forward
    keeps x alone (the norm's output, which the block holds anyway) and frees the group's q, k, v,
    output and the kernel's memory before the next group starts; backward runs the group again,
    then its backward."""
    y = None
    for g in range(groups):
        y_g = checkpoint(group, x, *args, g, groups, use_reentrant=False)
        if y is None:
            y = y_g
        else:
            y = y + y_g
    return y


def workspace(c, batch_size, seq_len, b=2, tp_size=1, ulysses=1, ring=1):
    """What flash attention's backward allocates inside the kernel, for this rank's attention call
    (of one head group): memory.py's formula (its header), here beside what cuts it. Packed
    documents (varlen's kernel) take the same, plus 128 rows of dq's fp32 accumulator per document
    past the first of a row (flash_api.cpp's mha_varlen_bwd pads each): 4·a·hd·128 bytes each, not
    counted (a window's documents are known when it is drawn). Not counted either: its forward's
    split-KV accumulators (flash_api.cpp, set_params_splitkv), made only when B·a·Sa/64 can't fill
    the SMs (short sequences); cuBLAS's workspace (in the overhead). Context parallelism c = u × r
    (parallel.py): `ulysses` u, `ring` r."""
    G = c.attention_chunks  # (resolved: estimate)
    # a rank's H/(t·u·G) heads of a group (sp and Ulysses gather every token of them) over the
    # ring rank's S/r tokens (the ring keeps those)
    a, Sa = c.n_head // tp_size // ulysses // G, seq_len // ring
    # then flash expands grouped kv heads itself (the ring repeats them before the kernel: a tensor)
    grouped = ring == 1 and max(1, c.n_kv_head // tp_size // ulysses // G) < a
    Sa_tiles, hd_tiles = -(-Sa // 128) * 128, -(-c.head_dim // 32) * 32  # rounded up to its tiles
    accumulators = 4 * batch_size * Sa_tiles * a * (hd_tiles + 1)
    per_tensor = b * batch_size * Sa * a * c.head_dim
    return accumulators + 2 * (grouped + (ulysses * ring > 1)) * per_tensor


# ----------------------------------------------------------------------------- applied to a model
# The functions above swapped into a built model as whole modules that hold the model's own
# parameters under their own names (the state dict stays the model's), as torchtitan applies its
# plans. After parallel.py's plan (a rank's heads are then its weights' rows), before offload.py's.

def apply(model, knobs, ulysses=1, vocab_group=None):
    """Put the chunking knobs of `knobs` (a knobs.Knobs: model.config's architecture with them)
    into model: each MLP's mini-sequences (mlp_chunks != 1), the experts' grouped GEMM (chunked by
    mlp_chunks too), attention by head groups (attention_chunks != 1; `ulysses`: the ranks Ulysses
    spreads a group's heads over), and the chunked LM head + loss always (loss_chunks = 1 too: one
    chunk keeps no log-softmax, faster than F.cross_entropy's path, with a third of its memory),
    vocabulary parallel over vocab_group (the tensor-parallel ranks whose rows of the vocabulary
    the head holds)."""
    for block in model.layers.values():
        mlp = block.feed_forward
        if isinstance(mlp, MLP) and knobs.mlp_chunks != 1:
            block.feed_forward = ChunkedMLP(mlp, knobs)
        if isinstance(mlp, MoE):
            mlp.experts = GroupedExperts(mlp.experts, knobs)
        attention = block.attention
        heads = len(attention.wq.weight) // attention.head_dim
        kv_heads = len(attention.wk.weight) // attention.head_dim
        groups = attention_chunks(knobs, heads, kv_heads, ulysses)
        if groups != 1:
            block.attention = HeadGroups(attention, groups)
    # (a pipeline stage before the last has no head)
    if model.output is not None:
        model.output = ChunkedHead(model.output.weight, knobs, vocab_group)
    return model


def adopt(new, module):
    """new (a module being made, not by its class's __init__: that would make new modules) takes
    module's children and parameters under their own names (its state dict is module's)."""
    nn.Module.__init__(new)
    for name, child in module.named_children():
        new.add_module(name, child)
    for name, parameter in module.named_parameters(recurse=False):
        new.register_parameter(name, parameter)


class ChunkedMLP(MLP):
    """model.MLP in mini-sequences: chunked_mlp on its weights, config.mlp_chunks of one
    sequence's tokens (0: counted from its length at every forward)."""

    def __init__(self, mlp, config):
        adopt(self, mlp)
        self.config = config

    def forward(self, x):
        x = self.enter_tp(x)
        chunks = mlp_chunks(self.config, x.shape[-2])
        y = chunked_mlp(x, self.w1.weight, self.w3.weight, self.w2.weight, chunks)
        return self.leave_tp(y)


class GroupedExperts(Experts):
    """moe.Experts as one grouped GEMM a matmul (chunked_mlp given the offsets where each expert's
    rows end), the rows as one sequence of T·k tokens in mlp_chunks mini-sequences."""

    def __init__(self, experts, config):
        adopt(self, experts)
        self.config = config

    def forward(self, x, counts):
        # where each expert's rows end, as grouped_mm takes them (int32)
        offsets = torch.tensor(counts, device=x.device).cumsum(0).int()
        chunks = mlp_chunks(self.config, len(x), self.config.moe_intermediate_size)
        return chunked_mlp(x, self.w1, self.w3, self.w2, chunks, offsets)


class HeadGroups(Attention):
    """model.Attention by head groups (head_groups above): group g's q, k, v, the core and its share
    of wo, one group at a time. Sampling (a kv cache) runs all heads at once."""

    def __init__(self, attention, groups):
        adopt(self, attention)
        self.window, self.head_dim, self.groups = attention.window, attention.head_dim, groups
        # (Qwen3's q and k norms are children, adopted; Llama's None)
        self.q_norm, self.k_norm = attention.q_norm, attention.k_norm

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        if kv_cache is not None:
            return super().forward(x, cos, sin, docs, kv_cache)
        x = self.enter_tp(x)
        return self.leave_tp(head_groups(self.group, self.groups, x, cos, sin, docs))

    def group(self, x, cos, sin, docs, g, groups):
        """Head group g of `groups`: its q, k, v, the core and its share of wo."""
        a = self.core(*self.qkv(x, cos, sin, g, groups), docs, self.window)
        return self.out(a, g, groups)


class ChunkedHead(nn.Module):
    """The LM head (model.Head's weight, tied or not) with chunked_cross_entropy for its loss,
    config.loss_chunks chunks (0: counted from the micro-batch's tokens); under tensor parallelism
    (group) the weight holds this rank's rows of the vocabulary and the loss is vocabulary
    parallel."""

    def __init__(self, weight, config, group=None):
        super().__init__()
        self.weight, self.config, self.group = weight, config, group

    def forward(self, x, targets=None):
        if targets is None:
            if self.group is not None:
                raise NotImplementedError("logits under tensor parallelism: sample in one process "
                                          "(sample.py)")
            return F.linear(x, self.weight)
        return None, chunked_cross_entropy(x, self.weight, targets, self.config.loss_chunks,
                                           group=self.group, vocab_size=self.config.vocab_size)
