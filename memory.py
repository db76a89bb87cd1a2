"""
Memory, accounted: a per-rank estimate you can follow on paper, the measured breakdown of the first step, a dry run on
fake tensors, a fit check and a planner. It saves nothing; it tells you before you run out.

Six categories, bytes per rank: params, grads, optimizer, activations (made by forward, kept for backward),
transient (every other tensor alive at that moment), workspace (what a CUDA kernel allocates inside itself: no
tensor shows it). `overhead` (CUDA context, NCCL buffers) is added to the total for the verdict: it must be under
80% of the device (Fujii et al. 2024, arXiv 2411.06465: in 454 runs on A100/H100 estimates under 80% never ran out).

The estimate (S tokens per sequence, B batch, h width, H heads, kv = K·hd, I MLP width, V vocabulary,
L layers, b bytes per element, N parameters, t = tp, c = cp, d = dp·c, α = offload, M micro-batches). Under pp
it is stage r's: its L/pp blocks, the embedding only on the first, the LM head only on the last; F = min(M, pp − r)
micro-batches in flight (1F1B; GPipe: M) each keep their activations, the stage's output (b·h/t per token) and on
the last stage their loss's kept bytes, all but the current one's "held" beside every moment (pipeline.py):

  states       per parameter of this rank (N/t for the matrices, norms whole), Megatron's mixed precision:
                 bf16: 2 (weights) + 4 (fp32 grads) + 12 (fp32 master, Adam m, v); fp32: 4 + 4 + 8
                 zero=2, 3 (FSDP2): (4 + 4 + 8)/d, the fp32 weights the masters, plus b bytes of what it gathers:
                 the embedding, final norm and LM head, and every block (zero=2, forward to backward) or one (3);
                 offload_states=True: that (4 + 4 + 8)/d in host memory (ALST, Bekman et al. 2025), reported apart
                 optimizer_in_backward (optim.py): b + 2b, the gradients one parameter at a time (at most the
                 embedding's b·V·h) beside its step's seven fp32 chunks (28·optim.STEP_CHUNK), in every moment
  activations  L · k · T, T = B·S/c tokens of a micro-batch, k the bytes a block keeps per token
               (offload.kept_bytes: 'none' all, 'selective' its input and attention's output, 'full' its
               input); k/t under tensor + sequence parallelism (Korthikanti et al. 2022), but 'none' keeps
               the gathered input of the column-parallel matmuls (b·h per token of all t ranks, twice).
               With α > 0 the first L - KEEP_LAST blocks keep on the device only what offload.py doesn't
               send (offload.block_bytes); the rest is host memory, reported apart, never in the total.
               Plus RoPE's fp32 cos and sin: 8·hd bytes per position (per token of B·S with doc_mask).
  transient    the largest of a few moments, each a working set per token × T plus weight-sized terms:
                 LM head    plain: the fp32 log-softmax kept (4V) and its gradients (8V) per token;
                            chunked.py's (loss_chunks > 1, or tp): dh (b·h·T) and the fp32 dW (4·V·h)
                            kept, one chunk's fp32 logits and gradient (4 + b)·V·T/M
                 a block's  backward, two moments (R what recompute rebuilt and offload brought back, u = b·h/t):
                            at the MLP  R + 2u (incoming gradient, dx) + chunked: one chunk's three buffers,
                                        3·b·I/t·T/M, and the fp32 dW1..3, 12·h·I/t (unchunked: 3·b·I/t·T)
                            past it     R less the MLP's input, + the larger of attention's backward (gradient
                                        in, dq, dk, dv, dx: b·(3h + 2kv)/t) and an RMSNorm's (dx, dy, the residual's:
                                        3u; 7 fp32 chunks, 28·model.FP32_CHUNK), + the block before's input back
                                        from host. Under sp + 2·b·h per token of all t (gathered inputs)
                 optimizer  every gradient; in bf16 the embedding's bf16 gradient before its fp32 copy
               gradients are alive as the moment has them: none at the LM head's forward (all from the
               second micro-step on), the head's at the last block, all but the embedding's at block 0.
  workspace    on a CUDA target in bf16, flash attention's backward beside its outputs (torch's copy of FA2:
               flash_attn/flash_api.cpp, mha_bwd) for its call's q [B, a, Sa, hd]: an fp32 dq accumulator and
               softmax_d, 4·B·Sa·a·(hd + 1) (Sa rounded up to 128, hd to 32); with grouped kv heads dk and dv
               expanded to every query head, 2·b·B·Sa·a·hd; under cp attention's output and its gradient come
               head-major and _flash_attention_backward (attention_backward.cu) copies both, 2·b·B·Sa·a·hd. The
               call: a = H/t, Sa = S (sp gathers the sequence); Ulysses a = H/(t·c); the ring Sa = S/c, its kv
               heads already repeated (a tensor). Alive in one attention backward: in the block-backward moments.

Measured (measure.py): MemTracker over the first step in our categories; on CUDA its peak is the total, workspace what
it holds beyond the tensors. The dry run (`--dry_run=True`): the same on rank 0 of the configured world with a fake
process group, FakeTensors (shapes, no data) and CPU autocast in bf16 for CUDA: exact for tensors, a kernel's workspace
the formula's at its peak; under pp the last stage's then, in a process of its own. `--dry_run_anatomy=N` lists
the N largest tensors alive at the peak, and what made them.
"""
import json
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch

import chunked
import offload
import parallel
from measure import Tracker, fake_batch, to_fake  # (the dry run's fake model and batch: train.py's)
from optim import STEP_CHUNK
from model import FP32_CHUNK, MEMORY_KNOBS, flops_per_token, num_params

CATEGORIES = ('params', 'grads', 'optimizer', 'activations', 'transient', 'workspace')
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
    workspace: float = 0
    moment: str = ''  # where in the step the peak is
    host: float = 0   # bytes waiting in host memory (offload), never in the total

    @property
    def total(self):
        return sum(getattr(self, k) for k in CATEGORIES)

    def as_dict(self):
        return {k: int(round(getattr(self, k))) for k in CATEGORIES + ('total',)}


def workspace(c, batch_size, seq_len, b=2, tp_size=1, cp_size=1, cp_impl='ulysses'):
    """What flash attention's backward allocates inside the kernel, for this rank's attention call: the
    header's formula. Not counted: its forward's split-KV accumulators (flash_api.cpp, set_params_splitkv),
    made only when B·a·Sa/64 can't fill the SMs (short sequences); cuBLAS's workspace (in the overhead)."""
    ring = cp_size > 1 and cp_impl == 'ring'
    a, Sa = c.n_head // tp_size // (1 if ring else cp_size), seq_len // cp_size if ring else seq_len
    grouped = not ring and max(1, c.n_kv_head // tp_size // cp_size) < a  # then flash expands kv heads itself
    up = lambda x, m: -(-x // m) * m
    return 4 * batch_size * up(Sa, 128) * a * (up(c.head_dim, 32) + 1) + \
        2 * (grouped + (cp_size > 1)) * b * batch_size * Sa * a * c.head_dim

def estimate(config, batch_size, seq_len, *, dtype='bfloat16', device_type='cuda', grad_accum=1,
             tp_size=1, cp_size=1, cp_impl='ulysses', dp=1, zero=0, doc_mask=False, in_backward=False,
             states_on_host=False, pp=1, stage=0, schedule='1f1b'):
    """Per-rank peak bytes of one training step of model.Llama(config) (of pipeline stage `stage`): the header's."""
    c, t, lo, hi = config, tp_size, stage * config.n_layer // pp, (stage + 1) * config.n_layer // pp
    L, first, last = hi - lo, stage == 0, stage == pp - 1  # this stage's blocks [lo, hi) (parallel.py)
    b, dt = (2, torch.bfloat16) if dtype in ('bfloat16', torch.bfloat16) else (4, torch.float32)
    bf16 = b == 2
    h, kv, I, V = c.n_embd, c.n_kv_head * c.head_dim, c.intermediate_size, c.vocab_size
    S = seq_len // cp_size          # one sequence's tokens on this rank
    T = batch_size * S              # a micro-batch's tokens on this rank (all t ranks' under sp)
    sp = t > 1                      # tensor parallelism comes with sequence parallelism

    # model states: this rank's parameters, 18 (16) bytes each, or 16/d with FSDP2 (zero=2, 3)
    block = ((num_params(c) - V * h - h) / c.n_layer - 2 * h) / t + 2 * h  # its matrices split over tp, 2 norms not
    N = L * block + V * h / t * (first + last * (not c.tie_embeddings)) + h * last
    d = dp * cp_size if zero else 1
    params, grads_all, optimizer = b * N, 4 * N, (2 * b if in_backward else 12 if bf16 else 8) * N
    g_emb = 4 * V * h / t * first              # the embedding's gradient, made last
    g_head = (4 * V * h / t + 4 * h) * last    # the LM head's (tied: its share, waiting for the embedding's)
    g_layer = 4 * block                        # one block's, made in its backward
    if zero > 1:  # FSDP2: every gradient's rows from the start (parallel.shard_states)
        root = N - L * g_layer / 4  # the embedding, final norm, LM head: gathered for the whole step
        params, optimizer = 4 * N / d + b * (root + g_layer / 4 * (L if zero == 2 else 1)), 8 * N / d
        grads_all, g_head, g_emb, g_layer = 4 * N / d, 4 * N / d, 0, 0
    if states_on_host:  # offload_states: the rows in host memory; on the device only what FSDP2 gathered
        params, grads_all, g_head, optimizer = params - 4 * N / d, 0, 0, 0

    # activations per layer and token (offload.py's count, then the layout's)
    # under sp the gathered inputs of wq|wk|wv and w1|w3 (every rank's tokens) replace two norm outputs
    gathered_in = 2 * b * h * (1 - 1 / t)
    full = offload.kept_bytes(replace(c, recompute='none', offload=0.0), 1, S, dt) / S  # all a block saves
    k = offload.kept_bytes(replace(c, offload=0.0), 1, S, dt) / S / t + (gathered_in if c.recompute == 'none' else 0)
    rebuilt = full / t + gathered_in - k  # what backward rebuilds (recompute), per token
    n_off, host = len(offload.offloaded_blocks(c)), offload.host_bytes(c, batch_size, S // t, dt, cp_size)
    P = host / n_off if n_off else 0  # one offloaded block's bytes in host memory
    host += 16 * N / d if states_on_host else 0
    stays = offload.block_bytes(c, batch_size, S // t, dt, cp_size)[1] / T  # an offloaded block's, on the device
    acts = ((L - n_off) * k + n_off * stays) * T + 8 * c.head_dim * (T if doc_mask or pp > 1 else S)

    # the LM head and loss, kept: the final norm's input and output, + chunked.py's dh and fp32 dW made in forward or
    # F.cross_entropy's fp32 log-softmax; transient: one chunk of fp32 logits (+ sp's gathered input) or its 2 gradients
    M = chunked.loss_chunks(c, T)
    chunks = M > 1 or sp
    head_kept = 2 * b * h / t * T + (b * h * T + 4 * V * h / t if chunks else 4 * V * T)
    head_tr = (4 + b) * V / t * math.ceil(T / M) + (b * h * T if sp else 0) if chunks else 8 * V * T
    # pp: F micro-batches in flight (1F1B: pp - stage; GPipe: all), each keeping its activations, the stage's output
    # (sent, kept for its backward) or its loss's; gradients exist at a forward only once a backward ran before it
    F = (min(grad_accum, pp - stage) if schedule == '1f1b' else grad_accum) if pp > 1 else 1
    sent = b * h / t * T * (not last)
    one = acts + sent + head_kept * last
    held, g_acc = (F - 1) * one, grads_all if grad_accum > F else 0

    # a block's backward at its MLP or at attention, plus what recompute or offload brings back
    gathered = b * h if sp else 0  # under sp the incoming gradient of a column-parallel matmul is whole
    Mm = chunked.mlp_chunks(c, S)
    mlp = (2 * b * h / t + 2 * gathered) * T + 3 * b * I / t * math.ceil(T / Mm) + 12 * h * I / t if Mm > 1 else \
        (b * h / t + gathered + 3 * b * I / t) * T
    attn = (b * (3 * h + 2 * kv) / t + gathered) * T
    norm = 3 * b * h / t * T + 28 * min(h / t * T, FP32_CHUNK)  # dx, dy, the residual's; 7 fp32 chunks (model.py)
    # at each stage the block's tensors not yet consumed: all at the MLP, then all but the MLP's
    mlp_saved = (full - offload.kept_bytes(replace(c, recompute='none', offload=0.0, mlp_chunks=2), 1, S, dt) / S) / t
    # (back: what comes back from host for the block before, once the MLP's backward is done: offload.py)
    stages = lambda alive, back=0: max(mlp + alive * T, max(attn, norm) + max(0, alive - mlp_saved) * T + back)
    ws, off = stages(rebuilt), full / t + gathered_in - stays  # off: an offloaded block's, all back or recomputed

    W = workspace(c, batch_size, seq_len, b, t, cp_size, cp_impl) if device_type == 'cuda' and bf16 else 0
    moments = {  # (grads, activations, transient, workspace): the workspace only where attention's backward runs
        'forward and backward: LM head and loss': (g_acc, held + acts + head_kept, head_tr, 0),
        f'backward: block {hi - 1}': (max(g_head, g_acc), held + acts + sent, ws, W),
        f'backward: block {lo}': (max(grads_all - g_emb - g_layer, g_acc), held + (stays if n_off else k) * T + sent,
                                  stages(off) if n_off else ws, W),
        'optimizer step': (grads_all, 0, 2 * V * h / t * first if bf16 else 0, 0),
    }
    if not last:  # the LM head is the last stage's
        del moments['forward and backward: LM head and loss']
    if 1 < F == grad_accum:  # no forward after the first backward: the second has every gradient, one less in flight
        moments[f'backward: block {hi - 1}, the second micro-batch'] = (grads_all, held - one + acts + sent, ws, W)
    if n_off > 1:  # block 1's backward: its own tensors back, block 0's host part prefetched
        moments['backward: block 1'] = (max(grads_all - g_emb - 2 * g_layer, g_acc), 2 * stays * T, stages(off, P), W)
    if in_backward:  # a gradient lives from its accumulation to its step, beside the step's fp32 chunks
        moments = {k: (min(g, b * V * h / t + 28 * STEP_CHUNK), *rest) for k, (g, *rest) in moments.items()}
    name, (g, a, tr, w) = max(moments.items(), key=lambda m: sum(m[1]))
    return Estimate(params, g, optimizer, a, tr, w, name, host)


# ----------------------------------------------------------------------------- budget, verdict and table
def device_bytes(device, budget_gb=0.0, dry_run=False):
    """memory_budget_gb if set; else 80 GiB (an H100's) for a dry run, the device's memory, or the RAM."""
    if budget_gb or dry_run:
        return int((budget_gb or 80) * GiB)
    return torch.cuda.get_device_properties(device).total_memory if device.type == 'cuda' else meminfo('MemTotal')

def host_bytes_per_rank(budget_gb=0.0, dry_run=False):
    """Host memory a rank may fill: host_memory_budget_gb, capped by this node's MemAvailable over its
    LOCAL_WORLD_SIZE ranks; a dry run stands in for another machine: the budget, or unknown (None)."""
    if dry_run:
        return int(budget_gb * GiB) if budget_gb else None
    free = meminfo('MemAvailable') // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    return min(free, int(budget_gb * GiB)) if budget_gb else free

def meminfo(key):
    """A /proc/meminfo figure in bytes; the physical memory where there is no /proc."""
    if os.path.exists('/proc/meminfo'):
        with open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))
    return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')

def overhead_bytes(device_type, communicators=0):
    """What tensors don't show: the CUDA context and its libraries' workspaces (about 0.6 GiB), and
    about 0.5 GiB of NCCL buffers per communicator (Fujii et al.)."""
    return 0 if device_type != 'cuda' else int(0.6 * GiB + 0.5 * GiB * communicators)

def fits(est, budget, overhead=0):
    return (est.total if isinstance(est, Estimate) else est) + overhead <= FIT_FRACTION * budget

def gib(n, width=8):
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    if n is None:
        return '-'
    unit, size = next((u, x) for u, x in (('GiB', GiB), ('MiB', 2 ** 20), ('KiB', 1024)) if abs(n) >= x or u == 'KiB')
    return f"{n / size:{width}.2f} {unit}"

def table(est, budget, overhead=0, measured=None, title='memory per rank', dry=False):
    """A row per category, estimate and (when given) measured with the error in percent (a category's
    relative to the measured total), a bar each (the device is 40 characters, 80% at 32), the verdict."""
    e, measured = est.as_dict(), measured or {}
    label = 'dry run' if dry else 'measured'  # a dry run's figure is the verdict's, the estimate otherwise
    lines = [title, f"  {'':12s}{'estimate':>12s}" + (f"{label:>13s}{'error':>8s}" if measured else '')]
    mt = measured.get('total')
    for k in [k for k in CATEGORIES + ('total',) if k != 'workspace' or e[k] or measured.get(k)]:
        m = measured.get(k)
        err = '' if m is None or not mt else f"{100 * (e[k] - m) / (m if k == 'total' else mt):+7.1f}%"
        row = f"  {k:12s}{gib(e[k]):>12s}" + (f"{gib(m):>13s}{err:>8s}" if measured else '')
        lines.append(row + '  ' + '█' * min(80, round(40 * e[k] / budget)) if budget else row)
    if dry and e['workspace']:
        lines.append("  (the dry run's workspace is the formula's: fake tensors can't see inside a CUDA kernel)")
    total = (mt if dry else e['total']) + overhead
    return '\n'.join(lines + [
        f"  {'+ overhead':12s}{gib(overhead):>12s}   (CUDA context, NCCL buffers: not in tensors)",
        f"  {'device':12s}{gib(budget):>12s}   80% rule: {gib(total, 0)} of "
        f"{gib(FIT_FRACTION * budget, 0)} -> {'fits' if total <= FIT_FRACTION * budget else 'DOES NOT FIT'}",
        f"  peak at: {est.moment}" + (f"; {gib(est.host, 0)} offloaded to host" if est.host else '')])


# ----------------------------------------------------------------------------- the planner
# What a knob costs, as a fraction of the step's compute (model.flops_per_token): recompute the FLOPs it re-runs;
# mlp_chunks > 1 re-runs x W1ᵀ and x W3ᵀ in backward (4·h·I per token and layer, nothing under 'full', which re-runs
# them anyway); loss_chunks nothing; offload offload.extra_time.
FLOPS, PCIE = 0.4 * 989e12, 25e9  # a stand-in for the machine: 40% of an H100's 989 TFLOP/s, PCIe 25 GB/s each way


def cost(c, base, batch_size, seq_len):
    """Extra step time of config c over base (the same model, other knobs), as a fraction of compute."""
    def extra(c):
        mfu, hfu = flops_per_token(c, seq_len)
        mlp = chunked.mlp_chunks(c, seq_len) > 1 and c.recompute != 'full'
        return (hfu - mfu) / mfu + (4 * c.n_layer * c.n_embd * c.intermediate_size / mfu if mlp else 0) + \
            (offload.extra_time(c, batch_size, seq_len, FLOPS, PCIE) if c.offload > 0 else 0)
    return extra(c) - extra(base)

def variants(c, batch_size, seq_len, host, layout):
    """Every recompute mode; chunks as configured, automatic or 4x that; offload at Memo's α and 1."""
    tp, cp = layout.get('tp_size', 1), layout.get('cp_size', 1)
    S, tokens = seq_len // cp, seq_len // cp // tp  # offload.py's tokens: this rank's sequence shard
    auto_m = chunked.mlp_chunks(replace(c, mlp_chunks=0), S)
    auto_l = chunked.loss_chunks(replace(c, loss_chunks=0), batch_size * S)
    mlps = sorted({c.mlp_chunks, 0, max(1, min(S, 4 * auto_m))} - ({0} if auto_m == 1 else set()))
    for rc in ('none', 'selective', 'full'):
        for m in mlps:
            for lc in sorted({c.loss_chunks, 0, max(1, min(batch_size * S, 4 * auto_l))}):
                yield (v := replace(c, recompute=rc, mlp_chunks=m, loss_chunks=lc, offload=0.0))
                if not host or c.n_layer <= offload.KEEP_LAST or layout.get('pp', 1) > 1:  # (pp refuses offload)
                    continue
                alpha = offload.choose_alpha(replace(v, offload=1.0), batch_size, tokens, torch.bfloat16,
                                             offload.block_forward_seconds(v, batch_size, tokens, FLOPS), PCIE, host)
                for a in sorted({round(alpha, 3), 1.0} - {0.0}):
                    if offload.host_bytes(w := replace(v, offload=a), batch_size, tokens, torch.bfloat16) <= host and \
                            not parallel.check_layout(w, tp * cp, tp, cp, layout.get('cp_impl', 'ulysses'), seq_len):
                        yield w

def knobs(c, base):
    return {k: getattr(c, k) for k in MEMORY_KNOBS if getattr(c, k) != getattr(base, k)}

def describe(changes):
    return ' '.join(f"--{k}={v!r}" for k, v in changes.items())  # strings quoted; a number's repr is its str

def options(config, budget, overhead, host, batch_size, seq_len, layout):
    """Every variant that fits, (cost, knobs changed, total, config, estimate), cheapest first."""
    return sorted([(round(cost(v, config, batch_size, seq_len), 9), len(knobs(v, config)), e.total, v, e)
                   for v in variants(config, batch_size, seq_len, host, layout)
                   if fits(e := estimate(v, batch_size, seq_len, **layout), budget, overhead)], key=lambda o: o[:3])

def plan(config, budget, overhead, host, batch_size, seq_len, **layout):
    """The cheapest knob setting that fits, as (config, estimate, cost), or None. A pure function of
    its arguments: every rank given the same ones reaches the same plan."""
    fit = options(config, budget, overhead, host, batch_size, seq_len, layout)
    return (fit[0][3], fit[0][4], fit[0][0]) if fit else None

def suggestions(config, budget, overhead, host, batch_size, seq_len, world=1, **layout):
    """[(command-line change, estimate, cost)] that fit: each knob alone at its cheapest, else the plan;
    then zero=2; then tp or cp 2, 4 or 8 times larger (more GPUs) with the knobs it needs."""
    fit = options(config, budget, overhead, host, batch_size, seq_len, layout)
    alone = {}
    for x, n, _, v, e in fit:  # cheapest first: the first of each knob changed alone
        if n == 1:
            alone.setdefault(next(iter(knobs(v, config))), (describe(knobs(v, config)), e, x))
    out = list(alone.values()) or [(describe(knobs(v, config)), e, x) for x, _, _, v, e in fit[:1]]
    if layout.get('dp', 1) * layout.get('cp_size', 1) > 1 and not layout.get('zero') and \
            fits(e := estimate(config, batch_size, seq_len, **{**layout, 'zero': 2}), budget, overhead):
        out.append(('--zero=2', e, 0.0))  # a reduce-scatter and an all-gather: the all-reduce's traffic
    device_type = layout.get('device_type', 'cuda')  # a new group brings NCCL's buffers
    comm = overhead_bytes(device_type, 1 + (world == 1)) - overhead_bytes(device_type)
    for key in ('tp_size', 'cp_size') if not layout.get('in_backward') else ():  # in backward: one GPU
        for factor in (2, 4, 8):
            bigger = {**layout, key: layout.get(key, 1) * factor}
            if not parallel.check_layout(config, world * factor, bigger.get('tp_size', 1), bigger.get('cp_size', 1),
                                         layout.get('cp_impl', 'ulysses'), seq_len) and \
                    (p := plan(config, budget, overhead + comm, host, batch_size, seq_len, **bigger)):
                change = f"--{key}={bigger[key]} {describe(knobs(p[0], config))}".strip()
                out.append((change + f" ({world * factor} GPUs)", p[1], p[2]))
                break
    return out


# ----------------------------------------------------------------------------- what train.py calls
class Report:
    """Made before anything is on the device: auto_memory's plan applied (rank 0 decides, every rank takes its knobs),
    the estimate printed and written to out_dir/memory.json, offload's host memory checked, and a run that can't fit
    stopped with the changes that would fit (a dry run gives its verdict instead). `with report.measure(...)` around
    the first step adds the measured peak. memory.json: {"ranks": [{"rank", "estimate", "measured", "overhead",
    "device_bytes", "world_size", "tp_size", "cp_size", "seq_len"}], "peak_at", "fits", ...}."""

    def __init__(self, model, cfg, world=1, rank=0, mesh=None, device=torch.device('cpu'), dtype=torch.float32):
        self.cfg, self.world, self.rank, self.device, self.config = cfg, world, rank, device, model.config
        self.dry, self.B, self.S = bool(cfg.get('dry_run')), cfg['batch_size'], cfg['seq_len']
        self.measured, self.logged, self.at = None, False, getattr(mesh, 'rank', 0)  # at: the dry run's rank
        tp, cp, dp, pp = (getattr(mesh, k, 1) for k in ('tp', 'cp', 'dp', 'pp'))
        self.layout = dict(dtype='bfloat16' if dtype == torch.bfloat16 else 'float32', tp_size=tp, cp_size=cp, dp=dp,
                           device_type='cuda' if self.dry else device.type, cp_impl=cfg.get('cp_impl', 'ulysses'),
                           grad_accum=cfg.get('gradient_accumulation_steps', 1), zero=cfg.get('zero', 0), pp=pp,
                           doc_mask=cfg.get('doc_mask', False), in_backward=cfg.get('optimizer_in_backward', False),
                           states_on_host=(states := cfg.get('offload_states', False)),
                           stage=getattr(mesh, 'pp_rank', 0), schedule=cfg.get('pp_schedule', '1f1b'))
        self.budget = device_bytes(device, cfg.get('memory_budget_gb', 0), self.dry)
        groups = sum(n > 1 for n in (tp, cp, dp, pp, cp * dp)) + (world > 1)  # NCCL communicators
        self.overhead = overhead_bytes(self.layout['device_type'], groups)
        self.host = host_bytes_per_rank(cfg.get('host_memory_budget_gb', 0), self.dry)
        cfg.get('auto_memory') and self.auto_memory(model)
        self.est = estimate(self.config, self.B, self.S, **self.layout)
        where = f"rank {self.at} of {world}" + (f" (dp {dp} x pp {pp} x cp {cp} x tp {tp})" if world > 1 else '')
        rank == 0 and print(table(self.est, self.budget, self.overhead, title=f"memory estimate per rank, {where}, "
                                  f"{self.layout['dtype']} on {'the target (dry run)' if self.dry else device}, "
                                  f"batch {self.B} x {self.S} tokens:"))
        if self.config.offload > 0 or states:  # this rank's offloaded blocks (offload.host_bytes), the states' rows
            line = (f"offload={self.config.offload}{', offload_states=True' * states}: {self.est.host / GiB:.2f} GiB "
                    f"of host memory per rank ({len(offload.offloaded_blocks(self.config))} blocks"
                    f"{' and the model states' * states})")
            budget = cfg.get('host_memory_budget_gb', 0)
            have = ' on the target' if self.host is None else f", {self.host / GiB:.2f} GiB " + \
                ('in host_memory_budget_gb' if budget and self.host == int(budget * GiB) else 'available')
            if self.host is not None and self.est.host > self.host:
                self.stop([f"error: {line}{have} per rank: lower offload, seq_len or batch_size, or recompute='full'"
                           + " (the states: 16 bytes per parameter over dp x cp ranks: more of them)" * states])
            rank == 0 and print(line + have)
        if not self.dry and not fits(self.est, self.budget, self.overhead):
            self.stop([f"error: does not fit: {gib(self.est.total, 0)} per rank + {gib(self.overhead, 0)} overhead "
                       f"> 80% of {gib(self.budget, 0)}, peak at {self.est.moment}"] + self.suggest())
        rank == 0 and self.write()  # only now: a run stopped by a check writes nothing

    def auto_memory(self, model):
        # rank 0 plans and every rank takes its knobs: no rank's own free memory can make it differ
        p = self.rank == 0 and plan(self.config, self.budget, self.overhead, self.host, self.B, self.S, **self.layout)
        chosen = [knobs(p[0], self.config) if p else None]
        if self.world > 1 and not self.dry and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(chosen, src=0)
        for k, v in (chosen[0] or {}).items():  # forward reads model.config's knobs at every call
            setattr(model.config, k, v)
        self.rank == 0 and print(f"auto_memory chose {describe(chosen[0]) or 'the configured setting'}: "
                                 f"{gib(p[1].total, 0)}, {100 * p[2]:+.1f}% step time" if p else
                                 "auto_memory: no setting of the memory knobs fits; keeping the configured one" +
                                 (" (host memory unknown: set host_memory_budget_gb)" if self.host is None else ''))

    def suggest(self):
        sug = suggestions(self.config, self.budget, self.overhead, self.host or 0, self.B, self.S, world=self.world,
                          **self.layout)
        return ["cheapest changes that fit (estimate per rank, extra step time):"] + \
            [f"  {d:52s} {gib(e.total)}  {100 * x:+5.1f}%" for d, e, x in sug[:8]] + \
            ["or --auto_memory=True to take the first memory knob setting above"] if sug else \
            ["nothing within reach fits: fewer tokens per step (batch_size, seq_len) or more GPUs"]

    def stop(self, lines):
        self.rank == 0 and print('\n'.join(lines), file=sys.stderr)
        sys.exit(2)

    def write(self, **extra):
        rank = {'rank': self.rank, 'estimate': self.est.as_dict(), 'measured': self.measured,
                'overhead': self.overhead, 'device_bytes': self.budget, 'world_size': self.world,
                'tp_size': self.layout['tp_size'], 'cp_size': self.layout['cp_size'], 'seq_len': self.S}
        extra = {'peak_at': self.est.moment, 'fits': fits(self.est, self.budget, self.overhead), **extra}
        path = os.path.join(self.cfg.get('out_dir', '.'), f"memory{f'.rank{self.at}' * (self.at > 0)}.json")
        with open(path + '.tmp', 'w') as f:  # then renamed: a reader never sees half a file
            json.dump({'ranks': [rank], **extra}, f, indent=1)
        os.replace(path + '.tmp', path)

    @contextmanager
    def measure(self, model, masters, optimizer, compiled=False):
        """Around a step: the first one (rank 0) is measured, printed beside the estimate and recorded,
        in a dry run with the verdict. Compiled, MemTracker can't see into the graph: CUDA's peak only."""
        if self.measured is not None or self.rank != 0:
            yield
            return
        cuda, n, extra = self.device.type == 'cuda', self.cfg.get('dry_run_anatomy', 0), {}
        cuda and torch.cuda.reset_peak_memory_stats(self.device)
        with nullcontext() if compiled else Tracker(model, masters, optimizer, device=self.device, anatomy=n > 0,
                                                    states_on_host=self.layout['states_on_host']) as tr:
            yield
        m = self.measured = dict.fromkeys(CATEGORIES + ('total',)) if compiled else tr.breakdown()
        if cuda:  # its peak holds what kernels allocate beside the tensors: the total, the rest of it workspace
            peak = torch.cuda.max_memory_allocated(self.device)
            extra['cuda'] = {'peak_allocated': peak, 'peak_reserved': torch.cuda.max_memory_reserved(self.device)}
            m['workspace'], m['total'] = None if compiled else max(0, peak - m['total']), max(m['total'] or 0, peak)
        if self.dry:  # fake tensors can't see inside a kernel: the formula's workspace, at its peak moment
            m['workspace'] = round(self.est.workspace)
            m['total'] += m['workspace']
        print(table(self.est, self.budget, self.overhead, m, dry=self.dry,
                    title="dry run: one step on fake tensors (CPU kernels standing in for CUDA's):" if self.dry
                    else "memory after the first step (measured: tensors alive at the step's peak):"))
        cuda and print(f"  cuda: peak allocated {gib(peak, 0)}, reserved {gib(extra['cuda']['peak_reserved'], 0)}")
        if self.est.host and not compiled:  # offloaded blocks and offload_states' rows, apart from the device's
            extra['host'] = {'estimate': round(self.est.host), 'measured': tr.host}
            print(f"  host memory per rank: {gib(self.est.host, 0)} estimated, {gib(tr.host, 0)} measured")
        if n and not compiled:  # where the peak's bytes are: what a change to the code added or removed
            made = sum(x['bytes'] for x in tr.at_peak)
            print(f"anatomy of the peak, after {tr.moment}: the {min(n, len(tr.at_peak))} largest of the "
                  f"{len(tr.at_peak)} tensors made in the step and alive, {gib(made, 0)} (the other "
                  f"{gib(m['total'] - m['workspace'] - made, 0)} were there before it: parameters, optimizer, batch):")
            print('\n'.join(f"  {gib(x['bytes'])}  {x['category']:12s}{x['dtype']:9s}{str(x['shape']):22s} "
                            f"{x['op']} in {x['module']}" for x in tr.at_peak[:n]))
            extra['anatomy'] = {'moment': tr.moment, 'made_bytes': made, 'largest': tr.at_peak[:n]}
        if self.dry:
            ok, host_ok = fits(m['total'], self.budget, self.overhead), self.host is None or tr.host <= self.host
            extra['fits'] = ok and host_ok  # the host's budget too, where given
            extra['verdict'] = (f"verdict: {'fits' if extra['fits'] else 'DOES NOT FIT'} on a {gib(self.budget, 0)} "
                                f"device: dry run {gib(m['total'], 0)} + {gib(self.overhead, 0)} overhead "
                                f"{'<=' if ok else '>'} 80% ({gib(FIT_FRACTION * self.budget, 0)})" +
                                ('' if host_ok else f"; host {gib(tr.host, 0)} > {gib(self.host, 0)}"))
            print('\n'.join([extra['verdict']] + ([] if extra['fits'] else self.suggest())))
        self.write(dry_run=self.dry, **extra)
