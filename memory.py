"""
Memory, accounted: an analytical per-rank estimate, a measured breakdown, a dry run on fake tensors,
a fit check and a planner. It saves nothing; it tells you before you run out.

Five categories, in bytes per rank (DESIGN.md): params, grads, optimizer, activations (made by forward
and kept for backward), transient (everything else alive at that moment: a layer's backward working
set, a recomputed layer, a logits chunk, optimizer temporaries). `total` is their sum at the peak,
tensor bytes only; `overhead` (CUDA context, NCCL buffers) is added back only for the fit verdict.

The estimate. N parameters on this rank (matrices / tp, norms whole), L layers, width h, kv =
n_kv_head·head_dim, I intermediate, V vocabulary, H heads, a = 2 (bf16) or 4 (fp32) bytes, T =
batch_size·seq_len/cp tokens of one micro-batch on this rank. Under tensor parallelism h, kv, I, V, H
below are per rank (/tp): Megatron's sequence parallelism splits every per-token tensor t ways
(Korthikanti et al. 2022), but the all-gathered input of the column-parallel matmuls (a·h_full).

  params      N·2 (bf16 weights) or N·4                                   Megatron's mixed precision
  grads       N·4: fp32 gradients (with bf16 weights those of the fp32 masters, train.py)
  optimizer   N·4 fp32 masters (bf16 only) + N·8 Adam m, v; zero=1 (parallel.ShardedAdamW) spreads
              whole tensors' m, v over the dp·cp ranks: 2 + 4 + 12 = 18 bytes per parameter
              (Korthikanti et al. 2022; Fujii et al. 2024), 6 + 4 + 8/(dp·cp) with zero=1

  activations kept per layer and token, read off model.py's autograd graph: Korthikanti et al.
  2022's 34·s·b·h count (their Eq. 2) redone for a Llama block: RMSNorm computed in fp32, RoPE, GQA
  through flash SDPA (no S² term; with the math kernel add Korthikanti's 5·a·s/h·…), SwiGLU. Fujii et
  al. 2024's Llama estimator is the same idea in bf16: s·b·h·(12 + 4k/a + 8·ffn/h).
     each RMSNorm   4h + 4 + 2ah   its fp32 input (a copy in bf16, the input itself in fp32), 1/rms,
                                   x/rms, the output (the next matmul's input)
     attention      a(2h + 2kv) + 4H   rotated q and k, v, SDPA's output, its fp32 logsumexp
     MLP            4aI            x W1ᵀ, silu, x W3ᵀ and their product; 0 with mlp_chunks > 1
  K = 2·(4h + 4 + 2ah) + a(2h + 2kv) + 4H + 4aI = 32h + 8kv + 16I + 4H + 8 bytes in fp32
  recompute='none' keeps K·T per layer, 'selective' (2ah + 4H)·T (input, SDPA output and logsumexp),
  'full' ah·T (the input: Korthikanti's 2sbh).
  offload = α > 0 (offload.py, Memo): the first n_off = L - KEEP_LAST layers keep on the device only
  those of the tensors offload.py's hooks see that are under MIN_BYTES (`small`); the hooks see with
  'none' all of K (and the input a·h in bf16), with 'selective' the input, SDPA's output and its
  logsumexp, with 'full' the input. The rest, P = offload.block_host_bytes per layer, is in host
  memory: Estimate.host = n_off·P, reported apart and never in a category or the total. (On a CPU
  host and device are one RAM; the Tracker tells the host pool's buffers apart by who made them.)
  The LM head: the final RMSNorm; loss_chunks = 1 the fp32 log-softmax 4V·T; loss_chunks > 1 the
  gradients chunked.py computes in forward, dh (a·h·T) and dW (4·V·h).

  transient: the step is walked as moments, each the sum of what is alive then; the largest moment is
  the estimate, its categories the breakdown (tests/test_memory.py measures them):
     head forward    the logits 4V·T (bf16: + their 2V·T bf16 original) | a chunk: 4nV + its matmul
     head backward   d(NLL) and d(log-softmax) beside the log-softmax, 8V·T | dW's bf16 cast
     layer backward  the last layer and the first (kept activations fall and gradients grow linearly
                     in between), each at its largest stage:
                       MLP      incoming grad + dp, ds, du: a(h + 3I)·T; chunked: incoming grad, dx,
                                fp32 accumulators for dW1, dW3, dW2 (12hI), 7aI·n for chunk 2 (its
                                a, b, sigmoid, silu, silu·b beside chunk 1's db, da), n = T/chunks
                       RMSNorm  five fp32 tensors of width h (20h) beside the incoming grad
                       SDPA     dq, dk, dv beside q, k, v, the output and the incoming grads
                       RoPE     14h of fp32 rotations (q) beside dk, dv
                     with recompute, the layer's recomputed tensors (K minus what was kept)
     offloaded layer i < n_off, at each stage: its tensors back from host or recomputed (all K,
                     transient but `small`), + P of layer i-1, prefetched when layer i's backward
                     begins (i > 0); 'none' with α < 1, while stitching: + (1 - α)·(K - input -
                     SDPA's outputs)·T recomputed first tokens beside their stitched copies (+ the
                     bf16 input a·h·T, freed once recomputed). Layers 1 and 0 stand for the run
                     (gradients grow linearly in between; layer 0 prefetches nothing)
     kept layers     with offload, the first kept layer (n_off) + P: offload.py prefetches the
                     last offloaded layer when the backward of the layer after it begins
     CUDA offload    until backward begins, the device tensors of the last min(MAX_IN_FLIGHT,
                     n_off) layers sent wait for their copies: that many (seen - small)·T over
                     the LM head, the final norm and a checkpointed last layer's forward
     embedding bwd   the table's gradient (bf16: beside its fp32 copy for the master)
     optimizer       fused AdamW (train.py's, on every device): nothing; per-tensor AdamW: sqrt(v)
                     and sqrt(v)/c of one fp32 tensor beside the previous tensor's denominator
  Gradient accumulation: from the second micro-step on every gradient exists throughout.

The measurement: `Tracker`, a dispatch-level tracker (torch's MemTracker idea; its totals agree):
every storage an op makes is counted until freed, categorised when made (forward -> activations,
backward and optimizer step -> transient, and at a forward peak what backward did not find alive
-> transient) and re-categorised by identity (parameters; .grad of a parameter or of its fp32 master;
optimizer state). Buffers of offload.py's host pool are host memory, not the device's, also on a
CPU: counted apart (Tracker.host_peak, to hold against Estimate.host), never in the total.
MemTracker itself counts fresh gradients made with set_to_none=True as temp and never sees
train.py's fp32 masters. On CUDA, torch.cuda's peaks are read beside it, per phase.

The dry run (train.py --dry_run=True): a fake process group of the configured world size, the model
built on the meta device and turned into FakeTensors on the CPU (to_fake), one train step (forward,
backward, AdamW) under the Tracker: shapes, dtypes and storages, no data, nothing allocated. CPU
autocast in bf16 stands in for CUDA (fake CUDA tensors abort in SDPA backward on a CPU build); the
estimate beside it is for the CPU kernels that ran (device_type='cpu': the chunked loss's bf16 matmul
copy), the verdict for CUDA's.

Fit: total + overhead <= 80% of the device's memory (Fujii et al. 2024, arXiv 2411.06465: over 454
runs on A100/H100, estimates under 80% of the memory never ran out).
"""
import math
import os
import sys
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import chunked

CATEGORIES = ('params', 'grads', 'optimizer', 'activations', 'transient')
GiB = 2 ** 30
FIT_FRACTION = 0.8  # Fujii et al. 2024


# ----------------------------------------------------------------------------- the estimate

@dataclass
class Estimate:
    params: float = 0
    grads: float = 0
    optimizer: float = 0
    activations: float = 0
    transient: float = 0
    moment: str = ''   # where in the step the peak is
    host: float = 0    # bytes offloaded to host memory at the peak (offload > 0)
    moments: dict = field(default_factory=dict)  # every moment's total, for the curious

    @property
    def total(self):
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self):
        return {k: int(round(getattr(self, k))) for k in CATEGORIES + ('total',)}


def estimate(config, batch_size, seq_len, *, dtype='bfloat16', device_type='cuda', grad_accum=1,
             tp_size=1, cp_size=1, dp=1, zero=0, fused_optimizer=None):
    """Per-rank peak bytes of one training step of model.Llama(config) as train.py runs it, by
    category, as an Estimate (.total, .moment: where the peak is, .moments: every moment's total,
    .host: bytes offloaded to host). dtype: 'bfloat16' (bf16 weights and activations, fp32 grads and
    masters) or 'float32'. device_type: 'cuda' or 'cpu', the kernels (on a CPU the chunked loss's bf16
    matmul makes a copy). fused_optimizer: AdamW(fused=True); by default train.py's choice (fused).
    grad_accum: micro-steps per step. tp_size, cp_size, dp, zero: the parallel layout (DESIGN.md).
    Every term is in the module docstring."""
    c = config
    bf16 = dtype in ('bfloat16', torch.bfloat16)
    a = 2 if bf16 else 4
    cpu = device_type != 'cuda'
    fused = True if fused_optimizer is None else fused_optimizer
    t, L = tp_size, c.n_layer
    hf, kvf = c.n_embd, c.n_kv_head * c.head_dim
    h, kv, I, V, H = hf / t, kvf / t, c.intermediate_size / t, c.vocab_size / t, c.n_head / t
    S = seq_len / cp_size
    T = batch_size * S  # tokens of one micro-batch on this rank

    # model states
    layer_params = 2 * hf + (2 * hf * hf + 2 * kvf * hf + 3 * hf * c.intermediate_size) / t
    head_params = 0 if c.tie_embeddings else V * hf
    n_params = L * layer_params + V * hf + head_params + hf
    n_tensors = 9 * L + 2 + (not c.tie_embeddings)
    params = n_params * (2 if bf16 else 4) + c.head_dim // 2 * 4  # + the RoPE inv_freq buffer
    grads_all = 4 * n_params
    # fp32 masters (bf16 weights) + Adam m, v; zero=1 (parallel.ShardedAdamW) spreads the moments
    # of whole tensors over the dp·cp ranks, largest first: rank 0's share
    sizes = [V * hf] + [hf * h, kv * hf, kv * hf, h * hf, hf * I, hf * I, I * hf] * L + [head_params]
    sizes = [x for x in sizes if x] + [hf] * (2 * L + 1)
    share = _zero_share(sizes, dp * cp_size) if zero and dp * cp_size > 1 else sum(sizes)
    optimizer = (4 * n_params if bf16 else 0) + 8 * share + 4 * n_tensors  # + the step counts
    g_layer = 4 * layer_params
    # the head's weight gradient. Tied to the embedding, it waits in autograd's input buffer (made
    # by the loss: activations if chunked.py made it in forward) until the embedding's is added.
    g_head = 4 * hf + (0 if c.tie_embeddings else 4 * V * hf)  # + the final norm's
    tied = (2 if bf16 else 4) * V * hf if c.tie_embeddings else 0

    # chunk counts as model.py resolves them: the MLP's from the sequence, the loss's from all tokens
    mlp_chunks = chunked.mlp_chunks(c, S)
    n_mlp = math.ceil(T / mlp_chunks)
    # one layer's tensors kept for backward, bytes per token (module docstring)
    norm = 4 * h + 4 + 2 * a * h
    it = dict(n1=norm, q=a * h, k=a * kv, v=a * kv, o=a * h, lse=4 * H,
              n2x=4 * h + 4, n2ny=2 * a * h, mlp=3 * a * I if mlp_chunks == 1 else 0,
              mlp_p=a * I if mlp_chunks == 1 else 0)  # the product, freed first in backward
    sp = t > 1  # parallel.py: tensor parallelism comes with sequence parallelism
    if sp:  # a norm's output is all-gathered and the column-parallel matmuls keep that copy: all T
        # tokens at full width, a·h_full per token instead of a·h (parallel.enter_tp)
        it.update(n1=norm - a * h, n2ny=a * h, g1=a * hf, g2=a * hf)
    K = sum(it.values())
    inp = a * h  # a block's input; in fp32 it is also its first norm's input, so part of n1
    kept = {'none': K, 'selective': inp + it['o'] + it['lse'], 'full': inp}[c.recompute]
    # offload = α > 0 (offload.py, Memo): blocks but the last KEEP_LAST send what they keep to host
    # and keep on the device only tensors under MIN_BYTES; backward brings a block back (and the
    # previous block's host part with it, prefetched) and recomputes the rest
    n_off, host, small, fetched, prefetch, stitch, in_flight = 0, 0, 0, 0, 0, 0, 0
    if c.offload > 0:
        import offload as off
        dt = torch.bfloat16 if bf16 else torch.float32
        n_off = len(off.offloaded_blocks(c))
        pieces = dict(n1=[4 * h, 4 * h / hf, a * h] + ([] if sp else [a * h]), q=[a * h], k=[a * kv],
                      v=[a * kv], o=[a * h], lse=[4 * H], n2x=[4 * h, 4 * h / hf],
                      n2ny=[a * h] * (1 if sp else 2), mlp=[a * I] * 3 if it['mlp'] else [],
                      mlp_p=[a * I] if it['mlp_p'] else [], g1=[a * hf], g2=[a * hf])
        whole = {'none': it['o'] + it['lse'], 'selective': it['o'] + it['lse'], 'full': 0}[c.recompute]
        # what the block's hooks see: 'none' all it saves, 'selective' attention's outputs, 'full'
        # (torch's checkpoint) nothing, and always the input (fp32: n1's own first piece)
        seen = {'none': [p for k in it for p in pieces[k]], 'selective': pieces['o'] + pieces['lse'],
                'full': []}[c.recompute] + ([inp] if bf16 or c.recompute != 'none' else [])
        small = sum(p for p in seen if T * p < off.MIN_BYTES)  # stay: all else went or is recomputed
        # under sequence parallelism the input is a sequence shard and attention's outputs a head
        # shard: T/t tokens at full width ('none' also sends all-gathered tensors: T tokens, a bound)
        block_host = off.block_host_bytes(c, batch_size, int(S) if c.recompute == 'none' else int(S) // t, dt)
        host = n_off * block_host
        # the block input comes back whole. In fp32 it is what the first RMSNorm keeps (part of n1);
        # in bf16 (the norm keeps an fp32 copy) it is freed once the block is recomputed
        fetched = inp if bf16 else 0
        prefetch = block_host / T
        if c.recompute == 'none':  # the recomputed first tokens, until stitched to the fetched rest
            stitch = (1 - off.host_tokens(c.offload, int(S)) / S) * (K - inp - whole)
        if not cpu:  # CUDA: the device tensors of the last MAX_IN_FLIGHT blocks sent wait for their
            # copies until backward begins (the whole tensor, also where only its last α·S tokens went)
            in_flight = min(off.MAX_IN_FLIGHT, n_off) * T * (sum(seen) - small)
    per_layer = [small if i < n_off else kept for i in range(L)]

    # what lives through the whole step
    # train.py's get_batch: one int64 (B·dp, S+1) tensor per micro-step, sampled on every rank (and
    # under cp the rank's tokens gathered into copies)
    inputs = grad_accum * 8 * batch_size * (dp * (seq_len + 1) + (2 * S if cp_size > 1 else 0))
    rope = 2 * S * c.head_dim * 4  # cos and sin, fp32
    base = inputs + rope
    # gradients: from the second micro-step on, all of them exist and backward adds into them
    grads_at = (lambda made: grads_all) if grad_accum > 1 else (lambda made: made)
    tcopy = 8 if batch_size > 1 else 0  # targets (a strided view) flattened: an int64 copy

    # the LM head and loss
    lc = chunked.loss_chunks(c, T)
    n_ce = math.ceil(T / lc)
    if sp:  # parallel.py's vocabulary-parallel loss, chunked even with loss_chunks=1: the gathered
        # h; per chunk fp32 logits p (4nV) and, in bf16, the gradient g (2nV; on a CPU first the
        # bf16 matmul, 2nV) and dW's matmul (2Vh). From the second chunk on the previous p and g are
        # still bound when the next logits are made: 10nV (+2nV on a CPU)
        head_kept = T * (norm - a * h + a * hf) + 4 * V * hf  # the final norm, dh (full), dW
        nv, mm = n_ce * V, (2 * n_ce * V if cpu and bf16 else 0)
        if bf16:
            chunk = max(10 * nv + mm, 6 * nv + 2 * V * hf) if lc > 1 else 6 * nv + 2 * V * hf
        else:
            chunk = 8 * nv if lc > 1 else 4 * nv
        head_fwd = T * (a * hf + a * h + 18) + chunk  # + the norm's output shard, bound while the loss runs
        head_bwd = 2 * V * hf if bf16 else 0
    elif lc == 1:
        head_kept = T * (norm + 4 * V + tcopy)  # final norm, fp32 log-softmax, flat targets
        head_fwd = T * (4 * V if not bf16 else 6 * V)  # the logits (and their fp32 copy)
        head_bwd = T * 8 * V  # d(NLL) and d(log-softmax), fp32
    else:
        # the final norm but its output (the loss saves no input), dh and the fp32 dW (computed in
        # forward); its output is alive only while the loss runs
        head_kept = T * (norm - a * h + a * h) + 4 * V * hf
        # fp32: h·mask for dW. bf16: the chunk's bf16 gradient g lives on into the next chunk, beside
        # the next g (and, on a CPU, the bf16 logits matmul before its fp32 copy)
        old_g = 2 * n_ce * V if lc > 1 else 0
        chunk = (4 * n_ce * hf if not bf16 else
                 max(old_g + 2 * n_ce * V, 2 * n_ce * V + 2 * n_ce * hf + 2 * V * hf))
        head_fwd = T * (a * h + tcopy + 1 + 8 + a + 12) + 4 * n_ce * V + 4 * n_ce + chunk
        head_bwd = 2 * V * hf if bf16 else 0  # dW cast to bf16 beside the fp32 one

    moments = {}

    def moment(name, grads, activations, transient):
        moments[name] = Estimate(params, grads, optimizer, activations, transient, name, host)

    body = base + sum(per_layer) * T + in_flight
    moment('forward: LM head and loss', grads_at(0), body + head_kept, head_fwd)
    moment('backward: LM head and loss', grads_at(0), body + head_kept, head_bwd)
    tied_act, tied_tr = (tied, 0) if lc > 1 else (0, tied)
    moment('backward: final norm', grads_at(g_head), body + T * (4 * h + 4) + tied_act,
           T * 20 * h + tied_tr)

    # a layer's backward, at its largest stage. Each stage: (items of this layer still alive,
    # working set per token, working set in bytes, this layer's gradients already made)
    if mlp_chunks == 1:
        mlp_ws, mlp_abs, mlp_g = a * h + 3 * a * I, 0, 4 * hf * I  # dp, ds, du; dW2 made
    else:
        # chunk k's a, b, sigmoid, silu, dz and 1 - sigmoid: 6·n·I. Chunk k-1's db and da (silu and dz
        # updated in place) stay bound until chunk k rebinds them, so chunk 2 peaks at 7·n·I; in bf16
        # dW's matmul adds a 2·h·I temporary beside silu·b
        n2, mm = min(n_mlp, T - n_mlp), (2 * hf * I if bf16 else 0)
        per_chunk = max(a * I * max(6 * n_mlp, 5 * n_mlp + 2 * n2), a * I * (5 * n2 + 2 * n_mlp) + mm,
                        5 * a * n_mlp * I + mm)
        # the incoming gradient and dx (all-gathered and full width under tp)
        mlp_ws, mlp_abs, mlp_g = a * h + (2 * a * hf if sp else a * h), 12 * hf * I + per_chunk, 0
    attn_g = 12 * hf * I + 4 * hf + 4 * hf * hf / t
    stages = [
        ('MLP', set(it) - {'mlp_p'}, mlp_ws, mlp_abs, mlp_g),
        ('norm', set(it) - {'mlp', 'mlp_p', 'n2ny', 'g2'}, a * h + 20 * h, 0, 12 * hf * I),
        ('attention', {'n1', 'g1', 'q', 'k', 'v', 'o', 'lse'} & set(it), a * (3 * h + 2 * kv), 0, attn_g),
        ('RoPE', {'n1', 'g1'} & set(it), a * (h + 2 * kv) + 14 * h, 0, attn_g),
    ]
    if mlp_chunks != 1:  # the end: the fp32 accumulators (and in bf16 their bf16 casts) while the
        # last chunk's a, b, sigmoid, db, da are still bound
        n_last = T - (math.ceil(T / n_mlp) - 1) * n_mlp
        stages.append(('MLP end', set(it) - {'mlp_p'}, mlp_ws, (18 if bf16 else 12) * hf * I + 5 * a * n_last * I, 0))
    if stitch:
        stages.append(('offload recompute', set(it), stitch + fetched, 0, 0))

    def split(alive, i):  # layer i's live items -> (activations, transient) per token
        own = sum(it[k] for k in alive)
        if i < n_off:  # brought back from host or recomputed in backward: transient, but the small
            # tensors that stayed on the device
            act = min(small, own)
            return act, own - act + (prefetch if i > 0 else 0)
        # offload.py prefetches the last offloaded block when the block after it (the first kept
        # one) begins its backward: it is on the device beside that block's backward only
        early = prefetch if n_off and i == n_off else 0
        if c.recompute == 'none':
            return own, early
        act = inp + (it['o'] + it['lse'] if c.recompute == 'selective' and 'o' in alive else 0)
        return act, own - act + (inp if bf16 else 0) + early  # fp32: the input is part of n1

    # kept activations fall and gradients grow linearly in i within the offloaded and the kept
    # layers: their ends suffice (layer 0 prefetches nothing: 1 to n_off - 1 is the offloaded run)
    for i in sorted({L - 1, n_off, n_off - 1, 1 if n_off > 1 else 0, 0} & set(range(L))):
        for name, alive, ws, ws_abs, g_in in stages:
            if name == 'offload recompute' and i >= n_off:
                continue
            act, tr = split(alive, i)
            moment(f'backward: layer {i} {name}',
                   grads_at(g_head + (L - 1 - i) * g_layer + g_in),
                   base + sum(per_layer[:i]) * T + act * T + tied_act, ws * T + ws_abs + tr * T + tied_tr)
    if c.recompute != 'none':  # a checkpointed layer's forward: its residual, MLP input and MLP
        mlp_fwd = T * 3 * a * I if mlp_chunks == 1 else T * a * h + 3 * a * n_mlp * I
        moment('forward: last layer', grads_at(0), body, T * 2 * a * h + mlp_fwd)
    # the table's gradient: bf16, beside its fp32 copy for the master; fp32 tied, beside the head's
    emb = 2 * V * hf if bf16 else (4 * V * hf if c.tie_embeddings else 0)
    moment('backward: embedding', grads_all, base, a * h * T + emb)
    # per-tensor AdamW: sqrt(v) and sqrt(v)/c for each fp32 tensor, while the previous tensor's
    # denominator is still alive (train.py's order: matrices, then the norms' gains)
    opt_ws = max(4 * (prev + 2 * cur) for prev, cur in zip([0] + sizes, sizes))
    moment('optimizer step', grads_all, 0, 0 if fused else opt_ws)

    peak = max(moments.values(), key=lambda m: m.total)
    return replace(peak, moments={k: m.total for k, m in moments.items()})


def _zero_share(sizes, n):
    """parallel.ShardedAdamW's assignment: tensors largest first, each to the least loaded rank
    (ties to the lowest); rank 0's total."""
    load = [0] * n
    for x in sorted(sizes, reverse=True):
        i = min(range(n), key=lambda r: load[r])
        load[i] += x
    return load[0]


def materialize_optimizer_state(optimizer):
    """Make the optimizer's state now (AdamW makes it lazily, in the first step), so that the first
    step's memory is every step's and an OOM comes before, not after, the first step. One step with
    zero gradients and lr = 0 (AdamW's update and decay are then exactly zero), then the step counts
    reset: the state is the one the first real step would have made, and the weights are untouched."""
    lrs = [g['lr'] for g in optimizer.param_groups]
    params = [p for g in optimizer.param_groups for p in g['params'] if p.grad is None]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g['lr'] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g['lr'] = lr
    for state in optimizer.state.values():
        if isinstance(state.get('step'), torch.Tensor):
            state['step'].zero_()
        elif 'step' in state:
            state['step'] = 0
    for p in params:
        p.grad = None


# ----------------------------------------------------------------------------- the measurement

class Tracker(TorchDispatchMode):
    """Tensor bytes alive after every op, by category; the peak, its breakdown and the peak of each
    phase (forward, backward, optimizer). Storages are counted once however many views share them.
    params: the model's parameters; masters: the optimizer's fp32 copies (or the parameters again);
    inputs: tensors made before the step that it uses (the batch)."""

    def __init__(self, params=(), masters=(), optimizer=None, inputs=(), timeline=False, device_type=None):
        super().__init__()
        self.device_type = device_type  # count only storages on this kind of device (None: all)
        self.params, self.masters, self.optimizer = list(params), list(masters), optimizer
        self.live = {}  # id(storage) -> [bytes, category, weakref, clock when made]
        self.now = dict.fromkeys(CATEGORIES, 0)
        self.total = self.peak = 0
        self.peak_at, self.peak_phase, self.phase_peak = dict(self.now), None, {}
        self.clock, self.in_opt, self.last_phase = 0.0, False, None
        self.pending, self.deaths = None, []  # a peak in forward, until backward says what it kept
        self.timeline = [] if timeline else None
        self.host_live, self.host_now, self.host_peak = {}, 0, 0  # offload's host pool (_host below)
        for p in self.params:
            self._add(p, 'params')
        for m in self.masters:
            if all(m is not p for p in self.params):
                self._add(m, 'optimizer')  # fp32 masters: DESIGN's 12 optimizer bytes hold them
        for x in inputs:
            self._add(x, 'activations')
        self._tag_optimizer_state()

    def _add(self, t, cat):
        if not isinstance(t, torch.Tensor):
            return
        if self.device_type is not None and t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        if id(st) in self.host_live:  # a view of offload's host pool
            return
        rec = self.live.get(id(st))
        n = st.nbytes()
        if rec is not None:
            if n != rec[0]:  # resized in place
                self.now[rec[1]] += n - rec[0]
                self.total += n - rec[0]
                rec[0] = n
            return
        key = id(st)
        self.live[key] = [n, cat, weakref.ref(st, lambda _, key=key: self._free(key)), self.clock]
        self.now[cat] += n
        self.total += n

    def _host(self, t):
        # a buffer of offload's host pool is host memory, not the device's, even on a CPU where both
        # are the same RAM: counted apart (host_now, host_peak), never in a category or the total
        st = t.untyped_storage()
        key, n = id(st), st.nbytes()
        self.host_live[key] = (n, weakref.ref(st, lambda _, key=key: self._host_free(key)))
        self.host_now += n
        self.host_peak = max(self.host_peak, self.host_now)

    def _host_free(self, key):
        n, _ = self.host_live.pop(key, (0, None))
        self.host_now -= n

    def _free(self, key):
        rec = self.live.pop(key, None)
        if rec is not None:
            self.now[rec[1]] -= rec[0]
            self.total -= rec[0]
            if self.pending is not None and rec[1] == 'activations':
                self.deaths.append((rec[3], self.clock, rec[0]))

    def _tag(self, t, cat):
        if t is None:
            return
        rec = self.live.get(id(t.untyped_storage()))
        if rec is None:
            self._add(t, cat)
        elif rec[1] != cat:
            self.now[rec[1]] -= rec[0]
            self.now[cat] += rec[0]
            rec[1] = cat

    def _tag_optimizer_state(self):
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._tag(v, 'optimizer')

    def _tag_grads(self, *_):
        for p in self.params:
            self._tag(p.grad, 'grads')
        for m in self.masters:
            self._tag(m.grad, 'grads')

    def __enter__(self):
        self._hooks = [p.register_post_accumulate_grad_hook(self._tag_grads)
                       for p in self.params if p.requires_grad]
        self._hooks += [register_optimizer_step_pre_hook(self._opt_pre),
                        register_optimizer_step_post_hook(self._opt_post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._settle()
        return super().__exit__(*exc)

    def _opt_pre(self, *_):
        self._tag_grads()
        self.in_opt = True

    def _opt_post(self, *_):
        self.in_opt = False
        self._tag_optimizer_state()

    def phase(self):
        if self.in_opt:
            return 'optimizer'
        return 'backward' if torch._C._current_graph_task_id() != -1 else 'forward'

    def _settle(self):
        """A peak inside forward: of what forward had made then, only what backward still found
        alive was kept for backward (activations); the rest was that moment's working set."""
        if self.pending is not None:
            born_by = self.pending
            gone = sum(n for born, died, n in self.deaths if born <= born_by < died)
            self.peak_at['activations'] -= gone
            self.peak_at['transient'] += gone
        self.pending, self.deaths = None, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.clock = math.floor(self.clock) + 1.0
        phase = self.phase()
        if phase != self.last_phase:
            if self.last_phase == 'forward':
                self._settle()
            self.on_phase(self.last_phase, phase)
            self.last_phase = phase
        out = func(*args, **(kwargs or {}))
        cat = 'activations' if phase == 'forward' else 'transient'
        if func is torch.ops.aten.empty.memory_format and _in_host_pool():
            self._host(out)
        for x in tree_flatten(out)[0]:
            self._add(x, cat)
        if self.timeline is not None:
            self.timeline.append((str(func), phase, self.total, dict(self.now)))
        if self.total > self.phase_peak.get(phase, 0):
            self.phase_peak[phase] = self.total
        if self.total > self.peak:
            self.pending, self.deaths = None, []
            self.peak, self.peak_at, self.peak_phase = self.total, dict(self.now), phase
            if phase == 'forward':
                self.pending = self.clock
        self.clock += 0.5  # frees from here on happen after this op's measurement
        return out

    def on_phase(self, old, new):
        """Called when the step moves from one phase to the next (subclasses: CUDA peaks)."""

    def breakdown(self):
        b = {k: int(v) for k, v in self.peak_at.items()}
        b['total'] = int(self.peak)
        return b


def _in_host_pool():
    """Is this allocation offload's host pool making a buffer? Nothing in the tensor tells (on a CPU,
    and in a dry run, host and device are both the CPU): who called torch.empty does."""
    import offload
    code = offload._HostBuffer.__init__.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


# ----------------------------------------------------------------------------- the dry run

def dry_run_world(tp_size=1, cp_size=1):
    """The world a dry run stands in for: WORLD_SIZE if set (dp = world / (tp·cp)), else tp·cp."""
    return int(os.environ.get('WORLD_SIZE', tp_size * cp_size))


def dry_run_ranks():
    """(world, rank, local_rank) of a dry run: rank 0 of the fake process group's world."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return world, 0, 0


def start_dry_run(world_size=1):
    """Make this process rank 0 of a world_size job that allocates nothing: a fake process group
    (collectives return at once); the model is then built on the meta device and to_fake makes it
    FakeTensors (shapes, dtypes and storages, no data) and enters FakeTensorMode for the rest.
    Returns the device for train.py: the CPU, with bf16 autocast standing in for CUDA (fake CUDA
    tensors abort in SDPA backward on a CPU build)."""
    os.environ.setdefault('WORLD_SIZE', str(world_size))
    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('LOCAL_RANK', '0')
    if world_size > 1 and not torch.distributed.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        torch.distributed.init_process_group('fake', store=FakeStore(), rank=0, world_size=world_size)
    return torch.device('cpu')


_fake_mode = None


def to_fake(model, dtype):
    """model.to(dtype) for a model built on the meta device, as FakeTensors on the CPU, in the
    active FakeTensorMode or, if none is, one entered for the rest of the process. (Module.to can't make or convert fake parameters:
    it swaps their contents in place, which torch refuses for tensors the fake mode holds weak
    references to.) Parameters shared by two modules stay shared."""
    global _fake_mode
    from torch._guards import active_fake_mode
    if active_fake_mode() is None:  # from here on every tensor is fake, until the process exits
        from torch._subclasses.fake_tensor import FakeTensorMode
        _fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        _fake_mode.__enter__()
    made = {}

    def fake(t, dt):
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dt, device='cpu')
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)]
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = fake(p, dtype if p.is_floating_point() else p.dtype)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = fake(b, b.dtype)  # the RoPE frequencies stay fp32
    return model


def fake_batch(batch_size, seq_len, vocab_size):
    """A batch as train.py's get_batch returns it: inputs and targets, views of one (B, S+1) tensor."""
    xy = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return xy[:, :-1], xy[:, 1:]


# ----------------------------------------------------------------------------- budget and verdict

def device_bytes(device, budget_gb=0.0, dry_run=False):
    """The memory the run is checked against: memory_budget_gb if set (GiB); else 80 GiB for a dry
    run (an H100's), the device's own memory on CUDA, the machine's RAM on a CPU."""
    if budget_gb:
        return int(budget_gb * GiB)
    if dry_run:
        return 80 * GiB
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    return _meminfo('MemTotal')


def host_bytes_available(budget_gb=0.0):
    """Host memory for offloaded activations: host_memory_budget_gb if set, else MemAvailable."""
    return int(budget_gb * GiB) if budget_gb else _meminfo('MemAvailable')


def _meminfo(key):
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def overhead_bytes(device_type, communicators=0):
    """What tensor accounting can't see, added back for the verdict: the CUDA context with its
    cuBLAS/cuDNN workspaces (about 0.6 GiB) and NCCL's buffers, about 0.5 GiB per communicator
    (Fujii et al. 2024). Allocator fragmentation is what the 80% rule leaves room for."""
    if device_type != 'cuda':
        return 0
    return int(0.6 * GiB + 0.5 * GiB * communicators)


def fits(est, budget, overhead=0):
    return est.total + overhead <= FIT_FRACTION * budget


# ----------------------------------------------------------------------------- the report

_BAR_WIDTH = 40  # characters for the whole device
_EIGHTHS = ' ▏▎▍▌▋▊▉'


def _bar(n, budget):
    cells = max(0.0, n / budget * _BAR_WIDTH) if budget else 0.0
    full, part = int(cells), int((cells - int(cells)) * 8)
    bar = '█' * min(full, 2 * _BAR_WIDTH) + (_EIGHTHS[part].strip() if full < 2 * _BAR_WIDTH else '»')
    return bar


def _gib(n, width=8):
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    if n is None:
        return '-'
    for unit, size in (('GiB', GiB), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
        if abs(n) >= size or unit == 'KiB':
            return f"{n / size:{width}.2f} {unit}"


def table(est, budget, overhead=0, measured=None, title='memory per rank', measured_label='measured'):
    """The report: a row per category with its bar (the device's memory is 40 characters wide, the
    80% line at 32), the total, the overhead, the device and the verdict; measured beside the
    estimate when given, with the error in percent (a category's error is relative to the total)."""
    e = est.as_dict() if isinstance(est, Estimate) else est
    lines = [title]
    head = f"  {'':12s}{'estimate':>12s}"
    if measured:
        head += f"{measured_label:>13s}{'error':>8s}"
    lines.append(head)
    mt = measured.get('total') if measured else None
    for k in CATEGORIES + ('total',):
        row = f"  {k:12s}{_gib(e[k]):>12s}"
        if measured:
            m = measured.get(k)
            err = '' if m is None or not mt else f"{100 * (e[k] - m) / (m if k == 'total' else mt):+7.1f}%"
            row += f"{_gib(m):>13s}{err:>8s}"
        lines.append(row + '  ' + _bar(e[k], budget))
    pad = 2 + 12 + 12 + (21 if measured else 0) + 2
    mark = int(FIT_FRACTION * _BAR_WIDTH)
    lines.append(' ' * pad + '─' * (mark - 1) + '┴' + '─' * (_BAR_WIDTH - mark - 1) + '┤  80% | device')
    limit = FIT_FRACTION * budget
    verdict = 'fits' if e['total'] + overhead <= limit else 'DOES NOT FIT'
    lines.append(f"  {'+ overhead':12s}{_gib(overhead):>12s}   (CUDA context, NCCL buffers: not in tensors)")
    lines.append(f"  {'device':12s}{_gib(budget):>12s}   80% rule: {_gib(e['total'] + overhead, 0)} of "
                 f"{_gib(limit, 0)} -> {verdict} ({100 * (e['total'] + overhead) / budget:.0f}% of the device)")
    if isinstance(est, Estimate):
        lines.append(f"  peak at: {est.moment}" + (f"; {est.host / GiB:.2f} GiB offloaded to host" if est.host else ''))
    return '\n'.join(lines)


def write_json(path, ranks, **extra):
    """out_dir/memory.json as DESIGN.md has it: {"ranks": [{"rank", "estimate", "measured", "overhead",
    "device_bytes", "world_size", "tp_size", "cp_size", "seq_len"}]} (+ extra top-level keys)."""
    import json
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump({'ranks': ranks, **extra}, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- fit check and planner
#
# What a change costs, as a fraction of the step's compute time (model FLOPs 6·N + 12·L·h·S per token):
#   recompute   the FLOPs it re-runs (model.Llama.estimate_flops_per_token: 'full' +2·N + 4·L·h·S,
#               'selective' +2·(N - head)), a third of the step for 'full'
#   mlp_chunks  the MLP's backward re-runs x W1ᵀ and x W3ᵀ per chunk: +4·h·I per token and layer
#               (nothing with recompute='full', which re-runs them anyway)
#   loss_chunks nothing: the chunked loss does the plain loss's three matmuls (chunked.py)
#   offload α   what the copies take beyond one layer's forward (offload.py's choose_alpha hides
#               them exactly; α = 1 may not be), plus the token-wise recompute of the other 1 - α
#   zero=1      one broadcast of the updated weights: counted as nothing
# A stand-in for the machine: 40% of an H100's 989 TFLOP/s, PCIe at 25 GB/s each way.
FLOPS, PCIE = 0.4 * 989e12, 25e9


def _flops(c, seq_len):
    """(model, hardware) FLOPs per token, from model.py's own formula."""
    from model import flops_per_token
    return flops_per_token(c, seq_len)


def cost(c, base, batch_size, seq_len, dtype='bfloat16'):
    """Extra step time of config c over base (same model, other knobs), as a fraction of compute."""
    mfu, hfu = _flops(c, seq_len)
    extra = (hfu - mfu) / mfu
    chunks = chunked.mlp_chunks(c, seq_len)
    if chunks > 1 and c.recompute != 'full':
        extra += 4 * c.n_layer * c.n_embd * c.intermediate_size / mfu
    if c.offload > 0:
        import offload
        dt = torch.bfloat16 if dtype in ('bfloat16', torch.bfloat16) else torch.float32
        t_fwd = offload.block_forward_seconds(c, batch_size, seq_len, FLOPS)
        sent = offload.block_host_bytes(c, batch_size, seq_len, dt) / PCIE
        blocks = len(offload.offloaded_blocks(c))
        t_step = 3 * c.n_layer * t_fwd
        extra += blocks * max(0.0, sent - t_fwd) / t_step
        if c.recompute == 'none':  # the 1 - α of the other tensors, recomputed token-wise
            extra += (1 - c.offload) * 2 / 3 * blocks / c.n_layer
    return extra - (cost(base, base, batch_size, seq_len, dtype) if c is not base else 0)


def _variants(c, seq_len, host_free, batch_size, dtype, device_type):
    """Knob settings worth trying from c: every recompute mode, MLP and loss chunks as they are, automatic
    or 4x automatic, offload off or at choose_alpha's α (on CUDA)."""
    from dataclasses import replace as dc_replace
    auto_m = chunked.mlp_chunks(dc_replace(c, mlp_chunks=0), seq_len)
    auto_l = chunked.loss_chunks(dc_replace(c, loss_chunks=0), batch_size * seq_len)
    mlps = sorted({c.mlp_chunks, 0, max(1, min(seq_len, 4 * auto_m))} - ({0} if auto_m == 1 else set()))
    losses = sorted({c.loss_chunks, 0, max(1, min(batch_size * seq_len, 4 * auto_l))})
    for rc in ('none', 'selective', 'full'):
        for m in mlps:
            for lc in losses:
                v = dc_replace(c, recompute=rc, mlp_chunks=m, loss_chunks=lc, offload=0.0)
                yield v
                if device_type == 'cuda' and c.n_layer > 2:
                    import offload
                    dt = torch.bfloat16 if dtype in ('bfloat16', torch.bfloat16) else torch.float32
                    probe = dc_replace(v, offload=1.0)
                    alpha = offload.choose_alpha(probe, batch_size, seq_len, dt,
                                                 offload.block_forward_seconds(v, batch_size, seq_len, FLOPS),
                                                 PCIE, host_free)
                    for a in {alpha, 1.0} - {0.0}:
                        if offload.host_bytes(dc_replace(v, offload=a), batch_size, seq_len, dt) <= host_free:
                            yield dc_replace(v, offload=round(a, 3))


def _knobs(c, base):
    return {k: getattr(c, k) for k in ('recompute', 'mlp_chunks', 'loss_chunks', 'offload')
            if getattr(c, k) != getattr(base, k)}


def plan(config, budget, overhead, host_free, batch_size, seq_len, **kw):
    """The cheapest knob setting (recompute, chunks, offload) whose estimate fits, as
    (config, estimate, cost, reasons) with reasons a few lines saying why; None when nothing fits."""
    options = []
    for v in _variants(config, seq_len // kw.get('cp_size', 1), host_free, batch_size,
                       kw.get('dtype', 'bfloat16'), kw.get('device_type', 'cuda')):
        e = estimate(v, batch_size, seq_len, **kw)
        x = cost(v, config, batch_size, seq_len)
        options.append((round(x, 9), len(_knobs(v, config)), e.total, v, e, x))
    # the cheapest; at equal cost the fewest changes to the configuration, then the smallest
    fitting = sorted((o for o in options if fits(o[4], budget, overhead)), key=lambda o: o[:3])
    if not fitting:
        return None
    _, _, _, v, e, x = fitting[0]
    reasons = [f"{_describe(_knobs(v, config)) or 'nothing to change'}: {e.total / GiB:.2f} GiB, "
               f"{100 * x:+.1f}% step time (cheapest of {len(fitting)} settings that fit)"]
    for _, _, _, v2, e2, x2 in fitting[1:4]:
        reasons.append(f"  next: {_describe(_knobs(v2, config))}: {e2.total / GiB:.2f} GiB, {100 * x2:+.1f}%")
    return v, e, x, reasons


def _describe(knobs):
    return ' '.join(f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in knobs.items())


def suggestions(config, budget, overhead, host_free, batch_size, seq_len, world=1, **kw):
    """The cheapest changes that would make a run fit, [(command-line change, estimate, cost)]: each
    knob alone at its cheapest value that fits (cheapest first), or the planner's combination if no
    knob alone does; then zero=1 and larger tp / cp (more GPUs) with their per-rank estimates."""
    from dataclasses import replace as dc_replace
    best = {}  # knob -> its cheapest value that fits
    for v in _variants(config, seq_len // kw.get('cp_size', 1), host_free, batch_size,
                       kw.get('dtype', 'bfloat16'), kw.get('device_type', 'cuda')):
        knobs = _knobs(v, config)
        if len(knobs) == 1:
            e = estimate(v, batch_size, seq_len, **kw)
            x = cost(v, config, batch_size, seq_len)
            k = next(iter(knobs))
            if fits(e, budget, overhead) and (k not in best or (x, e.total) < (best[k][2], best[k][1].total)):
                best[k] = (_describe(knobs), e, x)
    out = sorted(best.values(), key=lambda o: (o[2], o[1].total))
    if not out:
        p = plan(config, budget, overhead, host_free, batch_size, seq_len, **kw)
        if p is not None:
            out.append((_describe(_knobs(p[0], config)), p[1], p[2]))
    dp, cp, tp = kw.get('dp', 1), kw.get('cp_size', 1), kw.get('tp_size', 1)
    more = []  # changes of the layout: zero=1 costs a broadcast, larger tp / cp more GPUs
    if dp * cp > 1 and not kw.get('zero'):
        e = estimate(config, batch_size, seq_len, **{**kw, 'zero': 1})
        if fits(e, budget, overhead):
            more.append(('--zero=1', e, 0.0))
    for key, name in (('tp_size', 'tp_size'), ('cp_size', 'cp_size')):
        for factor in (2, 4, 8):
            n = kw.get(key, 1) * factor
            if (key == 'tp_size' and (config.n_head % n or config.intermediate_size % n)) or \
                    (key == 'cp_size' and seq_len % (2 * n)):
                continue
            e = estimate(config, batch_size, seq_len, **{**kw, key: n})
            # a new group (and the world's, when there was none) brings NCCL's buffers
            comm = overhead_bytes(kw.get('device_type', 'cuda'), 1 + (world == 1)) - overhead_bytes(kw.get('device_type', 'cuda'))
            if fits(e, budget, overhead + comm):
                more.append((f"--{name}={n} ({world * factor} GPUs)", e, 0.0))
                break
    return out + more


def apply_knobs(model, knobs):
    """Set memory knobs on a built model: its config, which forward reads at every call."""
    for k, v in knobs.items():
        setattr(model.config, k, v)


# ----------------------------------------------------------------------------- train.py's side

class _CudaPhases(Tracker):
    """The Tracker, plus torch.cuda's allocated bytes after every op, kept per phase."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        n = torch.cuda.memory_allocated()
        if n > self.cuda_phase.get(self.last_phase, 0):
            self.cuda_phase[self.last_phase] = n
        return out


class Report:
    """What train.py calls. Report(model, cfg, ...) prints the estimate before anything is on the
    device, writes out_dir/memory.json, applies the planner's choice (auto_memory=True) and stops
    the run when it does not fit (but in a dry run, which reports a verdict instead).
    measure(...) wraps the first step: measured beside the estimate, into memory.json.
    dry_run(step, batches) runs one step on fake tensors, reports, and exits."""

    def __init__(self, model, cfg, world=1, rank=0, mesh=None, device=torch.device('cpu'),
                 dtype=torch.float32, optimizer_fused=None):
        self.cfg, self.world, self.rank, self.device = cfg, world, rank, device
        self.dry = bool(cfg.get('dry_run'))
        self.B, self.S = cfg['batch_size'], cfg['seq_len']
        tp, cp, dp = (getattr(mesh, k, 1) for k in ('tp', 'cp', 'dp'))
        if self.dry and mesh is None:
            tp, cp = cfg.get('tp_size', 1), cfg.get('cp_size', 1)
            dp = max(1, world // (tp * cp))
        self.kw = dict(dtype='bfloat16' if dtype == torch.bfloat16 else 'float32',
                       device_type='cuda' if self.dry else device.type,
                       grad_accum=cfg.get('gradient_accumulation_steps', 1),
                       tp_size=tp, cp_size=cp, dp=dp, zero=cfg.get('zero', 0))
        groups = sum(n > 1 for n in (tp, cp, dp, cp * dp)) + (world > 1)
        self.budget = device_bytes(device, cfg.get('memory_budget_gb', 0), self.dry)
        self.overhead = overhead_bytes(self.kw['device_type'], groups)
        self.host_free = host_bytes_available(cfg.get('host_memory_budget_gb', 0))
        self.config = model.config
        self.measured = None
        self.logged = False  # train.py puts the measurement into the first log.jsonl row after it
        self.path = os.path.join(cfg.get('out_dir', '.'), 'memory.json')
        if cfg.get('auto_memory'):
            self._plan(model)
        self.est = self._estimate()
        if rank == 0:
            where = f"rank 0 of {world}" + (f" (dp {dp} x cp {cp} x tp {tp})" if world > 1 else '')
            what = 'the target device (dry run)' if self.dry else str(device)
            print(table(self.est, self.budget, self.overhead,
                        title=f"memory estimate per rank, {where}, {self.kw['dtype']} on {what}, "
                              f"batch {self.B} x {self.S} tokens:"))
            self._write()
        if not self.dry and not fits(self.est, self.budget, self.overhead):
            self._stop()

    def _estimate(self, **kw):
        return estimate(self.config, self.B, self.S, **{**self.kw, **kw})

    def _plan(self, model):
        p = plan(self.config, self.budget, self.overhead, self.host_free, self.B, self.S, **self.kw)
        if p is None:
            if self.rank == 0:
                print("auto_memory: no setting of recompute / mlp_chunks / loss_chunks / offload fits; "
                      "keeping the configured one")
            return
        v, _, _, reasons = p
        knobs = _knobs(v, self.config)
        apply_knobs(model, knobs)
        if self.rank == 0:
            print(f"auto_memory chose {_describe(knobs) or 'the configured setting'}\n  " + '\n  '.join(reasons))

    def _stop(self):
        import sys
        e, limit = self.est, FIT_FRACTION * self.budget
        lines = [f"error: does not fit: {_gib(e.total, 0)} per rank + {_gib(self.overhead, 0)} overhead "
                 f"> 80% of {_gib(self.budget, 0)} ({_gib(limit, 0)}), peak at {e.moment}"]
        sug = suggestions(self.config, self.budget, self.overhead, self.host_free, self.B, self.S,
                          world=self.world, **self.kw)
        if sug:
            lines.append("cheapest changes that fit (estimate per rank, extra step time):")
            lines += [f"  {d:44s} {_gib(s.total)}  {100 * x:+5.1f}%" for d, s, x in sug[:8]]
            lines.append("or --auto_memory=True to take the first memory knob setting above")
        else:
            lines.append("nothing within reach fits: fewer tokens per step (batch_size, seq_len) or more GPUs")
        if self.rank == 0:
            print('\n'.join(lines), file=sys.stderr)
        sys.exit(2)

    def _write(self, **extra):
        rank = {'rank': self.rank, 'estimate': self.est.as_dict(), 'measured': self.measured,
                'overhead': self.overhead, 'device_bytes': self.budget, 'world_size': self.world,
                'tp_size': self.kw['tp_size'], 'cp_size': self.kw['cp_size'], 'seq_len': self.S}
        extra.setdefault('fits', fits(self.est, self.budget, self.overhead))
        write_json(self.path, [rank], peak_at=self.est.moment, **extra)

    def tracker(self, model, masters, optimizer, batches):
        inputs = [t for b in batches for t in b if isinstance(t, torch.Tensor)]
        cls = _CudaPhases if self.device.type == 'cuda' and not self.dry else Tracker
        t = cls(list(model.parameters()), masters, optimizer, inputs, device_type=self.device.type)
        t.cuda_phase = {}
        return t

    def measure(self, model, masters, optimizer, batches, compiled=False):
        """Context manager for a step: the first one is measured (a dispatch-level Tracker, and on
        CUDA torch.cuda's peaks per phase), printed beside the estimate, written to memory.json."""
        from contextlib import contextmanager, nullcontext
        if self.measured is not None or self.rank != 0:
            return nullcontext()

        @contextmanager
        def first_step():
            tr = self.tracker(model, masters, optimizer, batches) if not compiled else nullcontext()
            if self.device.type == 'cuda':
                torch.cuda.reset_peak_memory_stats(self.device)
            with tr:
                yield
            cuda = {}
            if self.device.type == 'cuda':
                cuda = {'peak_allocated': torch.cuda.max_memory_allocated(self.device),
                        'peak_reserved': torch.cuda.max_memory_reserved(self.device),
                        'phases': getattr(tr, 'cuda_phase', {})}
            self.measured = tr.breakdown() if not compiled else dict.fromkeys(CATEGORIES, None)
            if compiled:
                self.measured['total'] = cuda.get('peak_allocated')
            print(table(self.est, self.budget, self.overhead, measured=self.measured,
                        title="memory after the first step (measured: tensors alive at the step's peak, "
                              f"in {getattr(tr, 'peak_phase', '?')}):"))
            if cuda:
                print(f"  cuda: peak allocated {cuda['peak_allocated'] / GiB:.2f} GiB, reserved "
                      f"{cuda['peak_reserved'] / GiB:.2f} GiB; by phase: " +
                      ', '.join(f"{k} {v / GiB:.2f}" for k, v in cuda['phases'].items() if k))
            self._write(**({'cuda': cuda} if cuda else {}))
        return first_step()

    def dry_run(self, step, model, masters, optimizer, batches):
        """One training step on fake tensors under the Tracker; the report; the verdict."""
        import time
        t0 = time.perf_counter()
        tr = self.tracker(model, masters, optimizer, batches)
        with tr:
            step(batches)
        self.measured = tr.breakdown()
        fused = any(g.get('fused') for g in optimizer.param_groups)
        here = self._estimate(device_type='cpu', fused_optimizer=fused)  # the kernels that ran
        if self.rank == 0:
            print(table(here, self.budget, self.overhead, measured=self.measured, measured_label='dry run',
                        title=f"dry run: one step on fake tensors in {time.perf_counter() - t0:.1f} s "
                              f"(CPU kernels standing in for CUDA; peak in {tr.peak_phase}):"))
        # the verdict: the estimate for the target's kernels, or what the dry run saw if more
        seen = self.measured['total'] - (here.total - self.est.total)
        total = max(self.est.total, seen)
        ok = total + self.overhead <= FIT_FRACTION * self.budget
        verdict = (f"verdict: {'fits' if ok else 'DOES NOT FIT'} on a {_gib(self.budget, 0)} device: "
                   f"{_gib(total, 0)} + {_gib(self.overhead, 0)} overhead "
                   f"{'<=' if ok else '>'} 80% ({_gib(FIT_FRACTION * self.budget, 0)})")
        if self.rank == 0:
            if seen > 1.05 * self.est.total:
                print(f"note: the dry run holds {_gib(seen - self.est.total, 0)} more than the estimate "
                      f"accounts for (at its peak, in {tr.peak_phase}): the verdict goes by the dry run")
            print(verdict)
            if not ok:
                sug = suggestions(self.config, self.budget, self.overhead, self.host_free, self.B, self.S,
                                  world=self.world, **self.kw)
                for d, s, x in sug[:8]:
                    print(f"  {d:44s} {_gib(s.total)}  {100 * x:+5.1f}%")
            self._write(dry_run=True, verdict=verdict, fits=ok)
        return ok
