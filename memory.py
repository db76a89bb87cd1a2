"""
Memory, accounted: a per-rank estimate you can follow on paper, the fit check, and the planner of
the memory knobs (auto_memory's choice and the suggestions a run that can't fit prints). It saves
nothing; it tells you before you run out. What the first step measures, the dry run and the report
train.py prints beside the estimate are measure.py's.

Six categories, bytes per rank: params, grads, optimizer, activations (made by forward, kept for
backward), transient (every other tensor alive at that moment), workspace (what a CUDA kernel
allocates inside itself: no tensor shows it). `overhead` (CUDA context, NCCL buffers) is added to
the total for the verdict: it must be under 80% of the device (Fujii et al. 2024, arXiv
2411.06465: in 454 runs on A100/H100 estimates under 80% never ran out).

The estimate, in these letters (the code's names are these letters or whole words): S tokens per
sequence, B batch, h width, H heads, q = H·hd (the query width: h but where head_dim decouples
it), kv = K·hd, I MLP width, V vocabulary, L layers, b bytes per
element, N parameters, t = tp, c = cp, d = dp·c, α = offload, M micro-batches. Under pp it is
stage r's: its L/pp blocks, the embedding only on the first, the LM head only on the last;
F = min(M, pp − r) micro-batches in flight (1F1B; GPipe: M) each keep their activations, the
stage's output (b·h/t per token) and on the last stage their loss's kept bytes, all but the
current one's "held" beside every moment (pipeline.py):

  states       per parameter of this rank (N/t for the matrices and q, k, v's biases; norms,
               Qwen3's q and k norms and an MoE layer's router whole), Megatron's mixed
               precision, bf16: 2 (weights) + 4 (fp32 grads) + 12 (fp32 master, Adam m, v);
               fp32: 4 + 4 + 8. The optimizer's state, from optim.STATE_BYTES: AdamW's m, v 8;
               optimizer='muon': Muon's momentum 4 for the blocks' matrices (attention's, a dense
               MLP's), AdamW's 8 for the rest (optim.optimizer_bytes)
                 zero=2, 3 (FSDP2): (4 + 4 + 8)/d, the fp32 weights the masters, plus b bytes of
                 what it gathers: the embedding, final norm and LM head, and every block (zero=2,
                 forward to backward) or one (3); params are per moment: from backward's end on
                 (the root's reduce-scatter, the optimizer's step) FSDP2 has freed all it
                 gathered, and they are the fp32 rows alone, 4·N/d (offload_states: none)
                 offload_states=True: that (4 + 4 + 8)/d in host memory (ALST, Bekman et al.
                 2025), reported apart
                 optimizer_in_backward (optim.py): b + 2b, the gradients one parameter at a time
                 (at most the embedding's b·V·h) beside its step's seven fp32 chunks
                 (28·optim.STEP_CHUNK), in every moment
  activations  L · k · T, T = B·S/c tokens of a micro-batch, k the bytes a block keeps per token
               (offload.kept_bytes: 'none' all, 'selective' its input and attention's output,
               'full' its input; by head groups attention keeps the norm's output alone); k/t
               under tensor + sequence parallelism (Korthikanti et al. 2022), but 'none' keeps
               the gathered input of the column-parallel matmuls (b·h per token of all t ranks,
               twice). With α > 0 the first L - KEEP_LAST blocks keep on the
               device only what offload.py doesn't send (offload.block_bytes); the rest is host
               memory, reported apart, never in the total. Plus RoPE's fp32 cos and sin: 8·hd
               bytes per position (per token of B·S with doc_mask).
               Under the ring (r > 1 of c = u × r, parallel.py) also ring.ring_plan: int32
               indices of the tokens its r steps compute on and send, on rank 0 16 bytes per
               token at step 0 and 10 at each other, 10·r + 6 (rank j: 2j more; a sliding window
               or packed documents: fewer) of the ring's u·T tokens (Ulysses' u ranks' T), one
               plan shared by every block and head group of the same window (ring.py), per
               micro-batch with doc_mask: P·(10·r + 6)·u·T, P = the stage's windows (× M). An
               attribute of the graph's node (ctx.plan), not a saved tensor: recompute and
               offload leave it on the device, and the node outlives backward (the dry run holds
               every micro-batch's at the optimizer's step, gc.collect() or not): in every
               moment, the embedding's and the optimizer's too.
  transient    at the step's peak: the moment of a few whose params + grads + activations +
               transient + workspace is largest, each a working set per token × T plus
               weight-sized terms:
                 LM head    chunked.py's (loss_chunks = 1 too): dh (b·h·T) and the fp32 dW
                            (4·V·h) kept, one chunk's fp32 logits and gradient, (4 + b)·V/t per
                            token of its T / loss_chunks
                 a block's  backward, two moments (R what recompute rebuilt and offload brought
                            back, u = b·h/t):
                            at the MLP  R + 2u (incoming gradient, dx) + chunked: one chunk's
                                        three buffers, 3·b·I/t per token of its T / mlp_chunks,
                                        and the fp32 dW1..3, 12·h·I/t (unchunked: 3·b·I/t·T)
                            past it     R less the MLP's (unchunked: its four kept tensors,
                                        4·b·I/t), + the larger of attention's backward (gradient
                                        in, dq, dk, dv, dx: b·(2h + q + 2kv)/t; by G > 1 head
                                        groups the gradient in, dx and one group's q, k, v,
                                        output and their gradients, b·(2h + 2·(2q + 2kv)/G)/t)
                                        and an RMSNorm's
                                        (dx, dy, the residual's: 3u; 7 fp32 chunks,
                                        28·model.FP32_CHUNK), + the block before's input back
                                        from host. Under sp + 2·b·h per token of all t
                                        (gathered inputs). Qwen3's q norm (qk_norm): its
                                        backward, an RMSNorm's of width w = q/(t·G) (rows of
                                        hd), 3·b·w·T + 28·min(w·T, FP32_CHUNK), once the
                                        MLP's backward freed what it
                                        kept and, without head groups, attention's its q, k,
                                        v, output and the ffn norm's two: R less the MLP's
                                        less b·(2q + 2kv + 2h)/t
                 root       zero > 1: at backward's end FSDP2 reduce-scatters the embedding's,
                            final norm's and LM head's gradients (N_root of them) from a whole
                            fp32 copy and its divided copy: (8 + 4/d)·N_root; beside the fp32
                            rows alone (none under offload_states): the root's post-backward
                            has freed the gathered bf16 parameters
                 optimizer  every gradient; in bf16 the embedding's bf16 gradient before its fp32
                            copy
               gradients (and under FSDP2 params) are alive as the moment has them: none at the
               LM head's forward (all from the second micro-step on), the head's at the last
               block, all but the embedding's at block 0.
  MoE          (n_experts > 0, moe.memory_terms) a rank holds E/ep of the experts (under tp
               their I/t), and under zero > 1 their fp32 rows over the d/ep ranks holding the
               same ones: 4·N/d with N counting all E. In place of the plain MLP's kept bytes,
               per token: its three [T·k, h] copies (routed, the experts' outputs, weighted:
               3·b·h·k, whole under sp), the router's fp32 probabilities and the pairs' int64
               indices, and unchunked the experts' 4·b·I/t for each of the k; in a block's
               backward at the MoE the incoming gradient and the larger of two [T·k, h] copies
               (three under ep: the forward's dispatch) and one expert's backward on its
               n = ep·T·k/E tokens (chunked.mlp_chunks(n): a chunk's 3·b·I/t and the fp32
               12·h·I/t; unchunked 2·b·I/t·n), I an expert's (moe_intermediate_size). Dense
               layers among them (dense_layers) keep a plain MLP's: activations count each layer
               by its kind, a block's backward is an MoE layer's (the peak's), the states hold
               the experts of the MoE layers alone
  workspace    on a CUDA target in bf16, flash attention's backward beside its outputs (torch's
               copy of FA2: flash_attn/flash_api.cpp, mha_bwd) for its call's q [B, a, Sa, hd]: an
               fp32 dq accumulator and softmax_d, 4·B·Sa·a·(hd + 1) (Sa rounded up to 128, hd to
               32); with grouped kv heads dk and dv expanded to every query head, 2·b·B·Sa·a·hd;
               under cp attention's output and its gradient come head-major and
               _flash_attention_backward (attention_backward.cu) copies both, 2·b·B·Sa·a·hd. The
               call: a = H/t, Sa = S (sp gathers the sequence); Ulysses a = H/(t·c); the ring
               Sa = S/c, its kv heads already repeated (a tensor); by head groups a/G
               (attention_chunks, chunked.py). Alive in one attention backward: in the
               block-backward moments. (chunked.workspace: beside the head groups that cut it.)

Measured (measure.py): MemTracker over the first step in our categories; on CUDA its peak is the
total, workspace what it holds beyond the tensors. The dry run (`--dry_run=True`): the same on rank
0 of the configured world with a fake process group, FakeTensors (shapes, no data) and CPU autocast
in bf16 for CUDA: exact for tensors, a kernel's workspace the formula's in every block's backward
(the peak is the moment that then holds most); under pp the
last stage's then, in a process of its own. `--dry_run_anatomy=N` lists the N largest tensors alive
at the peak, and what made them.
"""
import itertools
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

import chunked
import moe
import offload
import parallel
from optim import STEP_CHUNK, optimizer_bytes
from knobs import KNOBS, hardware_flops
from model import FP32_CHUNK, flops_per_token, num_params

GiB = 2 ** 30
CATEGORIES = ('params', 'grads', 'optimizer', 'activations', 'transient', 'workspace')
ROWS = CATEGORIES + ('total',)  # the table's and memory.json's
FIT_FRACTION = 0.8  # Fujii et al. 2024


# ----------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    # the peak moment's (moments()), then the optimizer's state, in every moment
    params: float
    grads: float
    activations: float
    transient: float
    workspace: float
    optimizer: float
    moment: str  # where in the step the peak is
    host: float  # bytes waiting in host memory (offload), never in the total
    kernel: float  # the workspace of every attention backward (the peak's may be another)

    @property
    def total(self):
        return sum(getattr(self, k) for k in CATEGORIES)

    def as_dict(self):
        return {k: round(getattr(self, k)) for k in ROWS}  # (ints)


class Rank(NamedTuple):
    """One rank's share of a step, in the header's letters."""
    config: object
    b: int
    t: int
    sequence: int  # S/c: one sequence's tokens on this rank
    T: int         # a micro-batch's tokens on this rank (under sp: of all t ranks)
    lo: int        # its pipeline stage's L blocks: lo .. lo + L - 1 (parallel.py)
    L: int
    first: bool    # the first stage: it has the embedding
    last: bool     # the last stage: the final norm, the LM head and the loss
    F: int
    M: int
    # moe.memory_terms (zeros for a dense model): an MoE layer's bytes per token beyond a plain
    # MLP's, its backward's working set, the parameters of the experts on the other ep ranks
    moe_kept: float
    moe_backward: float
    away: float
    moe_layers: int  # of the L (config.is_moe; the others' MLPs dense)


class States(NamedTuple):
    """The model states on the device, and the gradients alive as backward reaches a moment."""
    params: float
    optimizer: float
    host: float            # offload_states: the fp32 rows, in host memory
    grads: float           # all of them: from the second micro-batch on, and at the step
    at_last_block: float   # the LM head's and final norm's, made first
    at_first_block: float  # all but the embedding's and the block's own
    at_block_1: float      # all but the embedding's and two blocks'
    at_root: float         # FSDP2's reduce-scatter of the embedding's, final norm's, LM head's
    params_at_end: float   # params from backward's end on: FSDP2 has freed what it gathered


def model_states(r, d, zero, in_backward, on_host, name):
    """This rank's N parameters, at the header's bytes each, and its gradients as backward makes
    them. name: the optimizer's."""
    c, b, t = r.config, r.b, r.t
    h, V = c.n_embd, c.vocab_size
    vocab = V * h / t  # the embedding's parameters on this rank, or the LM head's
    # a block's on average: its norms (Qwen3's q and k norms too) and an MoE layer's router not
    # split; under ep (moe.py) E/ep experts of each MoE layer
    moe = r.moe_layers / r.L
    whole = 2 * h + 2 * c.head_dim * c.qk_norm + h * c.n_experts * moe
    block = ((num_params(c) - V * h - h) / c.n_layer - whole) / t + whole - r.away * moe
    # the root's (FSDP2's root module's): the embedding, the LM head (untied), the final norm
    root = vocab * (r.first + r.last * (not c.tie_embeddings)) + h * r.last
    N = r.L * block + root
    # the optimizer's state (optim.STATE_BYTES) + bf16's fp32 master
    params, grads, optimizer = b * N, 4 * N, optimizer_bytes(c, name, b, N, range(r.lo, r.lo + r.L))
    # gradients made first (the LM head's and final norm's; tied, its share, waiting for the
    # embedding's), in a block's backward, and last (the embedding's)
    head, in_block, embedding = 4 * (vocab + h) * r.last, 4 * block, 4 * vocab * r.first
    # under FSDP2: this rank's rows of every parameter, in fp32 (of its E/ep experts', over d/ep)
    shard = 4 * (N + r.moe_layers * r.away) / d
    at_root = gathered = 0
    if zero > 1:
        # at backward's end the root's gradients, whole, go to fp32 for the reduce-scatter: that
        # copy, its divided copy and this rank's rows
        at_root = (8 + 4 / d) * root
        # FSDP2: the fp32 rows over d from the start (parallel.shard_states); gathered in b bytes,
        # the root from forward to backward's end, and every block (2) or one (3). The root's
        # post-backward frees them all before its reduce-scatter (the dry run: its rows alone)
        gathered = b * (root + block * (r.L if zero == 2 else 1))
        params = shard + gathered
        # the root's gradients wait, whole and in b bytes, for backward's end; a block's are
        # reduce-scattered as it ends (the LM head's and final norm's alone as blocks run)
        grads, optimizer, in_block, embedding = shard, 2 * shard, 0, 0
        head = b * (vocab + h) * r.last
    if on_host:  # offload_states: the rows in host memory; on the device what FSDP2 gathered
        params, grads, head, optimizer = gathered, 0, 0, 0
    alive = [grads, head, grads - embedding - in_block, grads - embedding - 2 * in_block]
    if in_backward:
        # optim.py (one rank, zero=0): AdamW's moments in b bytes, no fp32 copy; the gradients one
        # at a time (the embedding's at most), beside its step's fp32 chunks
        optimizer = 2 * b * N
        alive = [min(g, b * vocab + 28 * STEP_CHUNK) for g in alive]
    return States(params, optimizer, 4 * shard * on_host, *alive, at_root, params - gathered)


class Kept(NamedTuple):
    """What a block keeps from its forward to its backward, per token of this rank."""
    kept: float     # k
    rebuilt: float  # R: what its backward rebuilds (recompute)
    device: float   # k of a block offload.py sends to host: what it keeps (no offload: k)
    fetched: float  # its R: what comes back from host or is rebuilt (no offload: R)
    host: float     # what it sends, per micro-batch
    sent: int       # how many blocks send (offload.offloaded_blocks: all but the last KEEP_LAST)


def kept_per_token(r, batch_size, cp_size, dtype):
    """k and R of a block, and of one that offload.py sends to host: offload.py's counts, then
    the layout's."""
    c, t, sequence = r.config, r.t, r.sequence

    def per_token(config):
        """offload.kept_bytes of one sequence, per token of this rank."""
        return offload.kept_bytes(config, 1, sequence, dtype) / sequence / t

    # under sp the gathered inputs of wq|wk|wv and w1|w3 (every rank's tokens) replace two norm
    # outputs; an MoE keeps its own (moe.py)
    gathered_in = 2 * r.b * c.n_embd * (1 - 1 / t) + r.moe_kept
    # all a block saves: what recompute='none' keeps
    everything = per_token(replace(c, recompute='none')) + gathered_in
    kept = per_token(c)
    if c.recompute == 'none':
        kept += gathered_in
    # offload.py's tokens: this rank's sequence shard
    host, device = offload.block_bytes(c, batch_size, sequence // t, dtype, cp_size)
    device /= r.T
    sent = len(offload.offloaded_blocks(c))
    if not sent:
        device = kept
    return Kept(kept, everything - kept, device, everything - device, host, sent)


def block_backward(r, rebuilt, back=0):
    """A block's backward, the larger of its two moments: at the MLP, with R = `rebuilt` bytes per
    token rebuilt or brought back, and past it, less the MLP's, with `back` bytes of the block
    before coming back from host (offload.py)."""
    c, b, t, T = r.config, r.b, r.t, r.T
    h, I = c.n_embd, c.intermediate_size
    u = b * h / t
    gathered = b * h * (t > 1)  # under sp a column-parallel matmul's incoming gradient: whole
    mlp_chunks = chunked.mlp_chunks(c, r.sequence)
    mlp_kept = 0
    if mlp_chunks > 1:
        at_mlp = (2 * u + 2 * gathered) * T + 3 * b * I / t * math.ceil(T / mlp_chunks)
        at_mlp += 12 * h * I / t
    else:
        mlp_kept = 4 * b * I / t
        at_mlp = (u + gathered + 3 * b * I / t) * T
    if r.moe_layers:
        # moe.py's in place of the plain MLP's: what it keeps (freed past it), its backward (the
        # peak's: an MoE layer's, dense ones among them or not)
        mlp_kept += r.moe_kept
        at_mlp = r.moe_backward
    # gradient in, dq, dk, dv, dx; by G head groups the gradient in, dx and one group's q, k, v,
    # output and their gradients
    G, q, kv = c.attention_chunks, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    per_token = 2 * h + q + 2 * kv
    if G > 1:
        per_token = 2 * h + 2 * (2 * q + 2 * kv) / G
    attention = (b * per_token / t + gathered) * T
    norm = 3 * u * T + 28 * min(h / t * T, FP32_CHUNK)
    # Qwen3's q norm's backward, as an RMSNorm's, on a group's q (its rows of hd), once the MLP's
    # backward freed what it kept, and without head groups attention's: q, k, v and the output,
    # and the ffn norm's two
    w = c.qk_norm * q / t / G
    qk_norm = 3 * b * w * T + 28 * min(w * T, FP32_CHUNK)
    freed = mlp_kept + (G == 1) * b * (2 * q + 2 * kv + 2 * h) / t
    past_mlp = max(max(attention, norm) + max(0, rebuilt - mlp_kept) * T,
                   qk_norm + (rebuilt - freed) * T) + back
    return max(at_mlp + rebuilt * T, past_mlp)


def moments(r, states, kept, activations, workspace, graph):
    """The step's moments, each (params, grads, activations, transient, workspace): the workspace
    only in attention's backward; gradients at a forward only once a backward ran before it; from
    backward's end on params are states.params_at_end (FSDP2 has freed what it gathered). Under pp
    F - 1 micro-batches are held, each keeping its activations and the stage's output (sent on,
    kept for its backward) or its loss's. `graph`: what the step's autograd graphs hold beside
    their saved tensors (ring.py's plans), alive in every moment: "held" with them."""
    b, t, T = r.b, r.t, r.T
    h, V = r.config.n_embd, r.config.vocab_size
    # the final norm, LM head and loss. Kept: the norm's input and output, and chunked.py's dh and
    # fp32 dW made in forward (one chunk too: the plain path). Transient: one chunk's fp32 logits
    # (which become their gradient), its copy in b < 4 bytes (+ sp's gathered input)
    loss_chunks = chunked.loss_chunks(r.config, T)
    head_kept = 2 * b * h / t * T + b * h * T + 4 * V * h / t
    head_transient = (4 + b * (b < 4)) * V / t * math.ceil(T / loss_chunks) + b * h * T * (t > 1)
    output = b * h / t * T * (not r.last)
    one = activations + output + head_kept * r.last
    held = (r.F - 1) * one + graph
    # gradients at a forward: only once an earlier micro-batch's backward made them
    accumulated = states.grads * (r.M > r.F)
    at_block = block_backward(r, kept.rebuilt)
    params = states.params
    out = {}
    if r.last:
        out['forward and backward: LM head and loss'] = (
            params, accumulated, held + activations + head_kept, head_transient, 0)
    out[f'backward: block {r.lo + r.L - 1}'] = (
        params, max(states.at_last_block, accumulated), held + activations + output, at_block,
        workspace)
    out[f'backward: block {r.lo}'] = (params, max(states.at_first_block, accumulated),
                                      held + kept.device * T + output,
                                      block_backward(r, kept.fetched), workspace)
    # from backward's end on FSDP2 holds no parameter it gathered: the root's post-backward frees
    # them (the root's; no block's is left) before its reduce-scatter (the dry run's params there:
    # the fp32 rows, none under offload_states)
    if states.at_root:
        out['backward: embedding'] = (states.params_at_end, states.grads, graph,
                                      states.at_root, 0)
    out['optimizer step'] = (states.params_at_end, states.grads, graph,
                             2 * V * h / t * r.first * (b == 2), 0)
    if 1 < r.F == r.M:  # no forward after the first backward: the second has every gradient
        out[f'backward: block {r.lo + r.L - 1}, the second micro-batch'] = (
            params, states.grads, held - one + activations + output, at_block, workspace)
    if kept.sent > 1:
        # block 1's backward: its own tensors back, block 0's host part prefetched
        out['backward: block 1'] = (params, max(states.at_block_1, accumulated),
                                    2 * kept.device * T + graph,
                                    block_backward(r, kept.fetched, kept.host), workspace)
    return out


def estimate(config, batch_size, seq_len, *, dtype='bfloat16', device_type='cuda', dp=1,
             tp_size=1, cp_size=1, cp_impl='ulysses', pp_size=1, pp_rank=0, pp_schedule='1f1b',
             gradient_accumulation_steps=1, zero=0, offload_states=False,
             optimizer_in_backward=False, doc_mask=False, ep_size=1, optimizer='adamw', cp_ring=0):
    """Per-rank peak bytes of one training step of model.Llama(config) on pipeline stage pp_rank:
    the header's model states, and the step's largest moment of the rest. The keywords are
    train.py's settings of the same names, and the mesh's dp and pp_rank."""
    M = gradient_accumulation_steps
    ring = parallel.ring_size(cp_size, cp_impl, cp_ring)
    ulysses = cp_size // ring  # (parallel.py's c = u × r)
    G = chunked.attention_chunks(config, config.n_head // tp_size, config.n_kv_head // tp_size or 1,
                                 ulysses)
    c = replace(config, attention_chunks=G)
    dtype = getattr(torch, dtype)  # 'bfloat16': torch.bfloat16
    b = dtype.itemsize
    sequence = seq_len // cp_size
    # in flight: 1F1B fills the stages from this one on (without pp: 1); GPipe runs every forward
    F = min(M, pp_size - pp_rank)
    if pp_schedule == 'gpipe' and pp_size > 1:
        F = M
    lo, hi = pp_rank * c.n_layer // pp_size, (pp_rank + 1) * c.n_layer // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    pairs = batch_size * sequence * c.experts_per_token  # (the experts' rows, their chunks)
    r = Rank(c, b, tp_size, sequence, batch_size * sequence, lo, hi - lo, first, last, F, M,
             *moe.memory_terms(c, batch_size, sequence, b, tp_size, ep_size,
                               chunked.mlp_chunks(c, pairs, c.moe_intermediate_size),
                               chunked.mlp_chunks(c, sequence)),
             sum(map(c.is_moe, range(lo, hi))))
    # (FSDP2 shards over the dp x cp ranks: d counts only under zero > 1)
    states = model_states(r, dp * cp_size, zero, optimizer_in_backward, offload_states, optimizer)
    kept = kept_per_token(r, batch_size, cp_size, dtype)
    # the ring's (r > 1) ring.ring_plan: each step's parts as int32 indices of our tokens and of
    # the visiting ones they attend, and the tokens we send; on rank 0 16 bytes a token at step 0
    # and 10 at each of the r - 1 others (rank j: 2j more), of the ring's tokens: Ulysses' u
    # ranks' T each. One plan for every block and head group of a micro-batch with the same
    # window (ring.py shares them), and for every micro-batch without documents. It is
    # ctx.plan, an attribute of the graph's node, not a saved tensor: no recompute frees it and
    # offload never sees it; and the node outlives backward (the dry run: every block's of every
    # micro-batch is alive at the optimizer's step, gc.collect() or not)
    plans = len({c.window(layer) for layer in range(lo, hi)}) * (M if doc_mask else 1)
    graph = plans * (10 * ring + 6) * r.T * ulysses * (ring > 1)
    activations = ((r.L - kept.sent) * kept.kept + kept.sent * kept.device) * r.T
    # k is an MoE layer's: a dense one keeps a plain MLP's (and under recompute, nothing else)
    activations -= (r.L - r.moe_layers) * r.moe_kept * r.T * (c.recompute == 'none')
    # RoPE's fp32 cos and sin, per position (of every token, with doc_mask or pp)
    activations += 8 * c.head_dim * (r.T if doc_mask or pp_size > 1 else sequence)
    W = 0
    if device_type == 'cuda' and b == 2:
        W = chunked.workspace(c, batch_size, seq_len, b, tp_size, ulysses, ring)
    step = moments(r, states, kept, activations, W, graph)
    highest = max(step, key=lambda moment: sum(step[moment]))  # the step's peak
    host = kept.sent * kept.host + states.host
    return Estimate(*step[highest], states.optimizer, highest, host, W)


# ----------------------------------------------------------------------- budget, verdict and table
def device_bytes(device, budget_gb, dry_run):
    """memory_budget_gb if set; else 80 GiB (an H100's) for a dry run, the device's memory, or
    the RAM."""
    if budget_gb or dry_run:
        return int((budget_gb or 80) * GiB)
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    return meminfo('MemTotal')

def host_bytes_per_rank(budget_gb=0.0, dry_run=False):
    """Host memory a rank may fill: host_memory_budget_gb, capped by this node's MemAvailable over
    its LOCAL_WORLD_SIZE ranks; a dry run stands in for another machine: the budget, or unknown
    (None)."""
    if dry_run:
        return int(budget_gb * GiB) if budget_gb else None
    free = meminfo('MemAvailable') // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    return min(free, int(budget_gb * GiB)) if budget_gb else free

def meminfo(key):
    """A /proc/meminfo figure in bytes; the physical memory where there is no /proc."""
    try:
        with open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
    except FileNotFoundError:
        return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')

def overhead_bytes(device_type, communicators=0):
    """What tensors don't show: the CUDA context and its libraries' workspaces (about 0.6 GiB), and
    about 0.5 GiB of NCCL buffers per communicator (Fujii et al.)."""
    return 0 if device_type != 'cuda' else int(0.6 * GiB + 0.5 * GiB * communicators)

def fits(est, budget, overhead=0):
    return est.total + overhead <= FIT_FRACTION * budget

# ----------------------------------------------------------------------------- the planner
# What a knob costs, as a fraction of the step's compute (knobs.hardware_flops): recompute the
# FLOPs it re-runs; mlp_chunks > 1 re-runs x W1ᵀ and x W3ᵀ in backward (4·h·I per token and layer,
# an MoE layer's for each of its k experts; nothing under 'full', which re-runs them anyway);
# loss_chunks nothing; offload offload.extra_time. The machine: 40% of an H100's 989 TFLOP/s,
# PCIe at 25 GB/s each way.
FLOPS, PCIE = 0.4 * 989e12, 25e9


def cost(c, base, batch_size, seq_len):
    """Extra step time of config c over base (the same model, other knobs), as a fraction of
    the compute."""
    def extra(c):
        mfu = flops_per_token(c, seq_len)
        time = (hardware_flops(c, seq_len) - mfu) / mfu  # recompute
        if chunked.mlp_chunks(c, seq_len) > 1 and c.recompute != 'full':
            # of a dense MLP's width, or an MoE layer's k experts'
            widths = [c.moe_intermediate_size * c.experts_per_token if c.is_moe(i)
                      else c.intermediate_size for i in range(c.n_layer)]
            time += 4 * c.n_embd * sum(widths) / mfu
        # offload (none with α = 0)
        return time + offload.extra_time(c, batch_size, seq_len, FLOPS, PCIE)
    return extra(c) - extra(base)

def variants(c, batch_size, seq_len, host, layout):
    """Every recompute mode; chunks as configured, automatic or 4x that; offload at Memo's α
    and at 1."""
    layout = {**estimate.__kwdefaults__, **layout}  # estimate's keywords, its defaults for the rest
    tp, cp = layout['tp_size'], layout['cp_size']
    # one sequence's tokens on this rank; offload.py's: this rank's sequence shard
    sequence = seq_len // cp
    tokens = sequence // tp
    auto_mlp = chunked.mlp_chunks(replace(c, mlp_chunks=0), sequence)
    auto_loss = chunked.loss_chunks(replace(c, loss_chunks=0), batch_size * sequence)
    mlps = {c.mlp_chunks, 0, min(sequence, 4 * auto_mlp)}
    if auto_mlp == 1:  # automatic would be 1 again
        mlps.discard(0)
    losses = {c.loss_chunks, 0, min(batch_size * sequence, 4 * auto_loss)}
    # offload needs host memory and a block to send (KEEP_LAST stay), and no pp (it refuses offload)
    may_offload = host and c.n_layer > offload.KEEP_LAST and layout['pp_size'] == 1
    for rc, m, lc in itertools.product(('none', 'selective', 'full'), sorted(mlps), sorted(losses)):
        v = replace(c, recompute=rc, mlp_chunks=m, loss_chunks=lc, offload=0.0)
        yield v
        if may_offload:
            seconds = offload.block_forward_seconds(v, batch_size, tokens, FLOPS)
            alpha = offload.choose_alpha(replace(v, offload=1.0), batch_size, tokens,
                                         torch.bfloat16, seconds, PCIE, host)
            for a in sorted({round(alpha, 3), 1.0} - {0.0}):
                w = replace(v, offload=a)
                sent = offload.host_bytes(w, batch_size, tokens, torch.bfloat16)
                broken = parallel.check_layout(w, tp * cp, tp, cp, layout['cp_impl'], seq_len,
                                               cp_ring=layout['cp_ring'])
                if sent <= host and not broken:
                    yield w

def knobs(c, base):
    return {k: getattr(c, k) for k in KNOBS if getattr(c, k) != getattr(base, k)}

def describe(changes):
    # strings quoted; a number's repr is its str
    return ' '.join(f"--{k}={v!r}" for k, v in changes.items())


class Option(NamedTuple):
    config: object  # the model's, its knobs set
    changed: dict   # the knobs it changes: knobs(config, the configured one)
    estimate: Estimate
    cost: float     # extra step time, a fraction of compute


class Suggestion(NamedTuple):
    change: str  # to the command line
    estimate: Estimate
    cost: float


def options(config, budget, overhead, host, batch_size, seq_len, layout):
    """Every variant that fits, cheapest first, then fewest knobs changed, then smallest."""
    fit = []
    for v in variants(config, batch_size, seq_len, host, layout):
        e = estimate(v, batch_size, seq_len, **layout)
        if fits(e, budget, overhead):
            # (rounded: two settings of the same cost compare equal)
            fit.append(Option(v, knobs(v, config), e,
                              round(cost(v, config, batch_size, seq_len), 9)))
    return sorted(fit, key=lambda o: (o.cost, len(o.changed), o.estimate.total))

def plan(config, budget, overhead, host, batch_size, seq_len, **layout):
    """The cheapest knob setting that fits, an Option, or None. A pure function of its arguments:
    every rank given the same ones reaches the same plan."""
    fit = options(config, budget, overhead, host, batch_size, seq_len, layout)
    return fit[0] if fit else None

def suggestions(config, budget, overhead, host, batch_size, seq_len, world=1, **layout):
    """The Suggestions that fit: each knob alone at its cheapest, else the plan; then zero=2; then
    tp or cp 2, 4 or 8 times larger (more GPUs) with the knobs it needs."""
    layout = {**estimate.__kwdefaults__, **layout}  # estimate's keywords, its defaults for the rest
    fit = options(config, budget, overhead, host, batch_size, seq_len, layout)
    alone = {}  # (a knob,): the first (cheapest) option changing it alone
    for o in fit:
        if len(o.changed) == 1:
            alone.setdefault(tuple(o.changed), o)
    # no knob alone: the plan
    chosen = list(alone.values()) or fit[:1]
    out = [Suggestion(describe(o.changed), o.estimate, o.cost) for o in chosen]
    if layout['dp'] * layout['cp_size'] > 1 and not layout['zero']:
        e = estimate(config, batch_size, seq_len, **{**layout, 'zero': 2})
        # a reduce-scatter and an all-gather: the all-reduce's traffic
        if fits(e, budget, overhead):
            out.append(Suggestion('--zero=2', e, 0.0))
    if layout['optimizer_in_backward']:  # the step in backward: one GPU
        return out
    device_type = layout['device_type']  # a new group brings NCCL's buffers
    comm = overhead_bytes(device_type, 1 + (world == 1)) - overhead_bytes(device_type)
    for key in ('tp_size', 'cp_size'):
        for factor in (2, 4, 8):
            bigger = {**layout, key: layout[key] * factor}
            tp, cp = bigger['tp_size'], bigger['cp_size']
            if parallel.check_layout(config, world * factor, tp, cp, layout['cp_impl'], seq_len,
                                     cp_ring=layout['cp_ring']):
                continue
            if (p := plan(config, budget, overhead + comm, host, batch_size, seq_len, **bigger)):
                change = f"--{key}={bigger[key]} {describe(p.changed)}".strip()
                out.append(Suggestion(f"{change} ({world * factor} GPUs)", p.estimate, p.cost))
                break
    return out
