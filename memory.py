"""
Memory, accounted: a per-rank estimate you can follow on paper, the measured breakdown of the first
step, a dry run on fake tensors, a fit check and a planner. It saves nothing; it tells you before you
run out.

Five categories, bytes per rank: params, grads, optimizer, activations (made by forward, kept for
backward), transient (everything else alive at that moment). `total` is tensor bytes at the peak;
`overhead` (CUDA context, NCCL buffers) is added back only for the verdict: total + overhead must be
under 80% of the device (Fujii et al. 2024, arXiv 2411.06465: in 454 runs on A100/H100 estimates under
80% never ran out).

The estimate (notation: S tokens per sequence, B batch, h width, H heads, kv = K·hd, I MLP intermediate,
V vocabulary, L layers, b bytes per element, N parameters, t = tp, c = cp, d = dp·c, α = offload):

  states       per parameter of this rank (N/t for the matrices, norms whole):
                 bf16: 2 (weights) + 4 (fp32 grads) + 12 (fp32 master, Adam m, v); zero=1: 2 + 4 + 12/d
                 fp32: 4 + 4 + 8;                                               zero=1: 4 + 4 + 8/d
               (Megatron's mixed precision and distributed optimizer; Korthikanti et al. 2022)
  activations  T = B·S/c tokens of a micro-batch on this rank, k bytes kept per token and layer:
                 L · k · T
               k is offload.py's (`kept_bytes`: 'none' keeps every tensor of a block, 'selective' its
               input and attention's output, 'full' its input); under tensor + sequence parallelism
               (Korthikanti et al. 2022) k/t, but with 'none' the gathered input of the column-parallel
               matmuls (b·h per token of all t ranks, attention's and the MLP's). With offload α > 0
               the first L - KEEP_LAST blocks keep on the device only their tensors under MIN_BYTES;
               the rest waits in host memory (offload.host_bytes), reported apart, never in the total.
  transient    the largest of a few moments, each a per-token working set × T plus weight-sized terms:
                 LM head    plain: the fp32 log-softmax kept (4V) and its gradients (8V) per token;
                            chunked.py's (loss_chunks > 1, and under tp): dh (b·h·T) and the fp32 dW
                            (4·V·h) kept, one chunk's fp32 logits and gradient (4 + b)·V·T/M
                 a block's  backward at the MLP (incoming gradient, x W1ᵀ/x W3ᵀ/product gradients
                            b·3I; chunked: one chunk's six b·I·T/M tensors and the fp32 dW1..3, 12·h·I)
                            or at attention (dq, dk, dv and the incoming gradient: b·(3h + 2kv)),
                            plus whatever recompute rebuilds (under sp with the gathered inputs of the
                            column-parallel matmuls, 2·b·h per token of all t ranks), plus with offload
                            what comes back from host for it and for the block before (prefetched)
                 optimizer  every gradient; in bf16 the embedding's bf16 gradient before its fp32 copy
               gradients are alive as the moment has them: none at the LM head's forward (all from the
               second micro-step on), the head's at the last block, all but the embedding's at block 0.

Measured: torch's MemTracker over the first step (its categories: parameters + buffers, gradients,
optimizer states, activations = made in forward, transient = its temp). The fp32 masters are
registered with it as external tensors and their gradients re-registered as they are made (train.py
writes them itself, after autograd); the host pool's buffers (offload.host_buffers) are host memory,
taken out of the device's total. MemTracker files gradients made fresh each step under temp until
their parameter's hook runs, and a forward peak's working set under activations: categories are
compared relative to the total. On CUDA torch.cuda's peak is read beside it.

The dry run (`--dry_run=True`): rank 0 of the configured world with a fake process group, the model
built on the meta device then made of FakeTensors (shapes and storages, no data), one step under the
MemTracker: the exact answer, and the verdict. CPU autocast in bf16 stands in for CUDA.
"""
import math
import os
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch

import chunked
import offload
import parallel
from model import num_params, flops_per_token

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
    moment: str = ''  # where in the step the peak is
    host: float = 0   # bytes waiting in host memory (offload), never in the total

    @property
    def total(self):
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self):
        return {k: int(round(getattr(self, k))) for k in CATEGORIES + ('total',)}


def estimate(config, batch_size, seq_len, *, dtype='bfloat16', device_type='cuda', grad_accum=1,
             tp_size=1, cp_size=1, dp=1, zero=0):
    """Per-rank peak bytes of one training step of model.Llama(config) (the header's formula), as an
    Estimate: its five categories, .total, .moment (where the peak is), .host (offloaded bytes)."""
    c, t, L = config, tp_size, config.n_layer
    bf16 = dtype in ('bfloat16', torch.bfloat16)
    b, dt = (2, torch.bfloat16) if bf16 else (4, torch.float32)
    h, kv, I, V = c.n_embd, c.n_kv_head * c.head_dim, c.intermediate_size, c.vocab_size
    S = seq_len // cp_size          # one sequence's tokens on this rank
    T = batch_size * S              # a micro-batch's tokens on this rank (all t ranks' under sp)
    sp = t > 1                      # tensor parallelism comes with sequence parallelism

    # model states: this rank's parameters, 18 (16) bytes each, the 12 (8) of the optimizer over d
    norms = (2 * L + 1) * h
    N = (num_params(c, non_embedding=False) - norms) / t + norms
    d = dp * cp_size if zero else 1
    params, grads_all = b * N, 4 * N
    optimizer = (12 if bf16 else 8) * N / d
    g_emb = 4 * V * h / t           # the embedding's gradient, made last
    g_head = 4 * V * h / t + 4 * h  # the LM head's (tied: its share, waiting for the embedding's)
    g_layer = 4 * (N - V * h / t * (1 if c.tie_embeddings else 2) - h) / L  # one block's, made in its backward

    # activations per layer and token (offload.py's count, then the layout's)
    # under sp the gathered inputs of wq|wk|wv and w1|w3 (every rank's tokens) replace two norm outputs
    gathered_in = 2 * b * h * (1 - 1 / t)
    full = offload.kept_bytes(replace(c, recompute='none', offload=0.0), 1, S, dt) / S  # all a block saves
    k = offload.kept_bytes(replace(c, offload=0.0), 1, S, dt) / S / t + (gathered_in if c.recompute == 'none' else 0)
    rebuilt = full / t + gathered_in - k  # what backward rebuilds (recompute), per token
    n_off = len(offload.offloaded_blocks(c))
    host = offload.host_bytes(c, batch_size, S // t, dt, cp_size)
    P = host / n_off if n_off else 0  # one offloaded block's bytes in host memory
    stays = offload.block_bytes(c, batch_size, S // t, dt, cp_size)[1] / T  # an offloaded block's, on the device
    acts = ((L - n_off) * k + n_off * stays) * T

    # the LM head and loss; gradients exist at its forward only from the second micro-step on
    g_acc = grads_all if grad_accum > 1 else 0
    head_kept = (4 + 2 * b) * h / t * T   # the final norm: its fp32 input, x/rms, output
    M = chunked.loss_chunks(c, T)
    if M > 1 or sp:   # chunked.py: dh and the fp32 dW made in forward; one chunk of fp32 logits
        head_kept += b * h * T + 4 * V * h / t
        head_tr = (4 + b) * V / t * math.ceil(T / M) + (b * h * T if sp else 0)  # + the gathered input
    else:             # F.cross_entropy: the fp32 log-softmax kept, its two gradients in backward
        head_kept += 4 * V * T
        head_tr = 8 * V * T

    # a block's backward at its MLP or at attention, plus what recompute or offload brings back
    gathered = b * h if sp else 0  # under sp the incoming gradient of a column-parallel matmul is whole
    Mm = chunked.mlp_chunks(c, S)
    if Mm > 1:
        mlp = (2 * b * h / t + 2 * gathered) * T + 6 * b * I / t * math.ceil(T / Mm) + 12 * h * I / t
    else:
        mlp = (b * h / t + gathered + 3 * b * I / t) * T
    attn = (b * (3 * h + 2 * kv) / t + gathered) * T
    norm = (b * h + 20 * h) / t * T  # an RMSNorm's backward works in fp32: five h-wide tensors
    # at each stage the block's tensors not yet consumed: all at the MLP, then all but the MLP's
    mlp_saved = (full - offload.kept_bytes(replace(c, recompute='none', offload=0.0, mlp_chunks=2), 1, S, dt) / S) / t
    stages = lambda alive: max(mlp + alive * T, max(attn, norm) + max(0, alive - mlp_saved) * T)
    ws, ws_off = stages(rebuilt), stages(full / t + gathered_in - stays)  # offloaded: all back or recomputed

    moments = {
        'forward and backward: LM head and loss': (g_acc, acts + head_kept, head_tr),
        f'backward: block {L - 1}': (max(g_head, g_acc), acts, ws),
        'backward: block 0': (max(grads_all - g_emb - g_layer, g_acc), (stays if n_off else k) * T,
                              ws_off if n_off else ws),
        'optimizer step': (grads_all, 0, 2 * V * h / t if bf16 else 0),
    }
    if n_off > 1:  # block 1's backward: its own tensors back, block 0's host part prefetched
        moments['backward: block 1'] = (max(grads_all - g_emb - 2 * g_layer, g_acc), 2 * stays * T, ws_off + P)
    name, (g, a, tr) = max(moments.items(), key=lambda m: sum(m[1]))
    return Estimate(params, g, optimizer, a, tr, name, host)


# ----------------------------------------------------------------------------- the measurement

class Tracker:
    """torch's MemTracker over a step, read as our five categories at its peak (.breakdown(), .peak).
    model: the module (or its parameters); masters: the optimizer's fp32 copies when they are not the
    parameters; inputs: tensors made before the step that it uses (the batch)."""

    def __init__(self, model, masters=(), optimizer=None, inputs=(), device=None):
        from torch.distributed._tools.mem_tracker import MemTracker
        self.mt, self.device = MemTracker(), device
        self.root = model if isinstance(model, torch.nn.Module) else None
        self.params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
        self.masters = [m for m in masters if all(m is not p for p in self.params)]
        self.inputs = list(inputs)
        # parallel.AdamW keeps the fp32 master rows (its param groups' tensors) unless they are the
        # parameters' own (fp32 weights): counted with the optimizer
        own = [p.untyped_storage() for p in self.params]
        self.state = [x for x in getattr(optimizer, 'pieces', ()) if all(x.untyped_storage() is not s for s in own)]
        # (the masters list holds train.py's fp32 gradient holders: they own no memory, their .grad does)
        self.mt.track_external(*([model] if isinstance(model, torch.nn.Module) else self.params),
                               *([optimizer] if optimizer is not None else []), *self.state, *self.inputs)

    def __enter__(self):
        # train.py writes a master's .grad itself, after autograd's hook: register it then (as "other",
        # with the masters; .breakdown() tells them apart)
        self.hooks = [p.register_post_accumulate_grad_hook(lambda p, m=m: self.mt.track_external(m.grad))
                      for p, m in zip(self.params, self.masters)] if self.masters else []
        # MemTracker refuses a second forward of the model (gradient accumulation) unless its
        # per-module statistics, which we don't read, are reset first; this hook runs before its own
        self.hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: self.mt.reset_mod_stats() if m is self.root else None))
        self.quiet = warnings.catch_warnings()
        self.quiet.__enter__()
        warnings.filterwarnings('ignore', message='Expected a tensor')  # its own hook sees .grad = None after ours
        self.mt.__enter__()
        return self

    def __exit__(self, *exc):
        self.mt.__exit__(*exc)
        self.quiet.__exit__(*exc)
        for hook in self.hooks:
            hook.remove()

    def breakdown(self):
        peaks = self.mt.get_tracker_snapshot('peak')
        dev = self.device if self.device is not None else max(peaks, key=lambda k: peaks[k]['Total'], default=None)
        snap = {getattr(k, 'value', k): v for k, v in peaks.get(dev, {}).items()}
        # each storage once (views share one), the storages kept alive while compared: a freed one's id is reused
        nbytes = lambda ts: sum({id(s): s.nbytes() for s in [t.untyped_storage() for t in ts]}.values())
        masters, inputs = nbytes(self.state), nbytes(self.inputs)
        self.host = nbytes(offload.host_buffers())  # the host pool: host memory, also on a CPU
        host = self.host if dev is not None and torch.device(dev).type == 'cpu' else 0
        out = {'params': snap.get('Parameter', 0) + snap.get('Buffer', 0),
               'grads': snap.get('Gradient', 0) + snap.get('Other', 0) - masters - inputs,
               'optimizer': snap.get('Optstate', 0) + masters,
               'activations': snap.get('Activation', 0) + inputs - host,
               'transient': snap.get('Temp', 0)}
        out['total'] = sum(out.values())
        return out

    peak_at = property(breakdown)
    peak = property(lambda self: self.breakdown()['total'])


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
    (collectives return at once). Returns the device: the CPU, whose bf16 autocast stands in for
    CUDA's (fake CUDA tensors abort in SDPA backward on a CPU build)."""
    os.environ.setdefault('WORLD_SIZE', str(world_size))
    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('LOCAL_RANK', '0')
    if world_size > 1 and not torch.distributed.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        torch.distributed.init_process_group('fake', store=FakeStore(), rank=0, world_size=world_size)
    return torch.device('cpu')


def to_fake(model, dtype):
    """model.to(dtype) for a model built on the meta device, as FakeTensors on the CPU, in the active
    FakeTensorMode or one entered for the rest of the process (Module.to can't convert fake
    parameters in place). Parameters shared by two modules stay shared; buffers keep their dtype."""
    from torch._guards import active_fake_mode
    if active_fake_mode() is None:  # from here on every tensor is fake, until the process exits
        from torch._subclasses.fake_tensor import FakeTensorMode
        FakeTensorMode(allow_non_fake_inputs=True).__enter__()
    made = {}

    def fake(t, dt):
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dt, device='cpu')
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)]
    for m in model.modules():
        for k, p in m.named_parameters(recurse=False):
            setattr(m, k, fake(p, dtype if p.is_floating_point() else p.dtype))
        for k, buf in m.named_buffers(recurse=False):
            setattr(m, k, fake(buf, buf.dtype))  # stays a buffer, persistent or not
    return model


def fake_batch(batch_size, seq_len, vocab_size):
    """A batch as train.py's get_batch returns it: inputs and targets, views of one (B, S+1) tensor."""
    xy = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return xy[:, :-1], xy[:, 1:]


# ----------------------------------------------------------------------------- budget and verdict

def device_bytes(device, budget_gb=0.0, dry_run=False):
    """What the run is checked against: memory_budget_gb if set; else 80 GiB for a dry run (an
    H100's), the device's own memory on CUDA, the machine's RAM on a CPU."""
    if budget_gb:
        return int(budget_gb * GiB)
    if dry_run:
        return 80 * GiB
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    return meminfo('MemTotal')


def host_bytes_per_rank(budget_gb=0.0, dry_run=False):
    """Host memory one rank may fill with offloaded activations: host_memory_budget_gb (per rank) if
    set, capped on a real run by this node's MemAvailable shared by its LOCAL_WORLD_SIZE ranks. A dry
    run stands in for another machine: its host memory is host_memory_budget_gb, or unknown (None)."""
    if dry_run:
        return int(budget_gb * GiB) if budget_gb else None
    free = meminfo('MemAvailable') // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    return min(free, int(budget_gb * GiB)) if budget_gb else free


def meminfo(key):
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def overhead_bytes(device_type, communicators=0):
    """What tensors don't show, added back for the verdict: the CUDA context with its library
    workspaces (about 0.6 GiB) and NCCL's buffers, about 0.5 GiB per communicator (Fujii et al.)."""
    return 0 if device_type != 'cuda' else int(0.6 * GiB + 0.5 * GiB * communicators)


def fits(est, budget, overhead=0):
    total = est.total if isinstance(est, Estimate) else est
    return total + overhead <= FIT_FRACTION * budget


# ----------------------------------------------------------------------------- the report

def _gib(n, width=8):
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    if n is None:
        return '-'
    for unit, size in (('GiB', GiB), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
        if abs(n) >= size or unit == 'KiB':
            return f"{n / size:{width}.2f} {unit}"


def table(est, budget, overhead=0, measured=None, title='memory per rank', measured_label='measured'):
    """A row per category, estimate and (when given) measured with the error in percent (a category's
    relative to the measured total), a bar each (the device is 40 characters, 80% at 32), the verdict."""
    e = est.as_dict() if isinstance(est, Estimate) else est
    lines = [title, f"  {'':12s}{'estimate':>12s}" + (f"{measured_label:>13s}{'error':>8s}" if measured else '')]
    mt = measured.get('total') if measured else None
    for k in CATEGORIES + ('total',):
        row = f"  {k:12s}{_gib(e[k]):>12s}"
        if measured:
            m = measured.get(k)
            err = '' if m is None or not mt else f"{100 * (e[k] - m) / (m if k == 'total' else mt):+7.1f}%"
            row += f"{_gib(m):>13s}{err:>8s}"
        lines.append(row + '  ' + '█' * min(80, round(40 * e[k] / budget)) if budget else row)
    total = (mt if mt is not None and measured_label == 'dry run' else e['total']) + overhead
    lines.append(f"  {'+ overhead':12s}{_gib(overhead):>12s}   (CUDA context, NCCL buffers: not in tensors)")
    lines.append(f"  {'device':12s}{_gib(budget):>12s}   80% rule: {_gib(total, 0)} of "
                 f"{_gib(FIT_FRACTION * budget, 0)} -> {'fits' if total <= FIT_FRACTION * budget else 'DOES NOT FIT'}")
    if isinstance(est, Estimate):
        lines.append(f"  peak at: {est.moment}" + (f"; {_gib(est.host, 0)} offloaded to host" if est.host else ''))
    return '\n'.join(lines)


def write_json(path, ranks, **extra):
    """out_dir/memory.json: {"ranks": [{"rank", "estimate", "measured", "overhead", "device_bytes",
    "world_size", "tp_size", "cp_size", "seq_len"}], ...extra}, written atomically."""
    import json
    with open(path + '.tmp', 'w') as f:
        json.dump({'ranks': ranks, **extra}, f, indent=1)
    os.replace(path + '.tmp', path)


# ----------------------------------------------------------------------------- fit check and planner
#
# What a knob costs, as a fraction of the step's compute (model.flops_per_token): recompute the
# FLOPs it re-runs; mlp_chunks > 1 re-runs x W1ᵀ and x W3ᵀ in backward (4·h·I per token and layer,
# nothing under 'full', which re-runs them anyway); loss_chunks nothing; offload α the copies that
# don't hide behind a block's forward, and with 'none' the token-wise recompute of the other 1 - α.
# A stand-in for the machine: 40% of an H100's 989 TFLOP/s, PCIe at 25 GB/s each way.
FLOPS, PCIE = 0.4 * 989e12, 25e9
KNOBS = ('recompute', 'mlp_chunks', 'loss_chunks', 'offload')


def cost(c, base, batch_size, seq_len):
    """Extra step time of config c over base (the same model, other knobs), as a fraction of compute."""
    def extra(c):
        mfu, hfu = flops_per_token(c, seq_len)
        x = (hfu - mfu) / mfu
        if chunked.mlp_chunks(c, seq_len) > 1 and c.recompute != 'full':
            x += 4 * c.n_layer * c.n_embd * c.intermediate_size / mfu
        if c.offload > 0:
            t_fwd = offload.block_forward_seconds(c, batch_size, seq_len, FLOPS)
            sent = offload.block_host_bytes(c, batch_size, seq_len, torch.bfloat16) / PCIE
            blocks = len(offload.offloaded_blocks(c))
            x += blocks * max(0.0, sent - t_fwd) / (3 * c.n_layer * t_fwd)
            if c.recompute == 'none':
                x += (1 - c.offload) * 2 / 3 * blocks / c.n_layer
        return x
    return extra(c) - extra(base)


def variants(c, batch_size, seq_len, host, layout):
    """Knob settings worth trying: every recompute mode, chunks as configured, automatic or 4x that,
    and (with host memory known) offload at Memo's α and at 1 when host memory holds it."""
    S = seq_len // layout.get('cp_size', 1)
    auto_m = chunked.mlp_chunks(replace(c, mlp_chunks=0), S)
    auto_l = chunked.loss_chunks(replace(c, loss_chunks=0), batch_size * S)
    mlps = sorted({c.mlp_chunks, 0, max(1, min(S, 4 * auto_m))} - ({0} if auto_m == 1 else set()))
    for rc in ('none', 'selective', 'full'):
        for m in mlps:
            for lc in sorted({c.loss_chunks, 0, max(1, min(batch_size * S, 4 * auto_l))}):
                v = replace(c, recompute=rc, mlp_chunks=m, loss_chunks=lc, offload=0.0)
                yield v
                if not host or c.n_layer <= offload.KEEP_LAST:
                    continue
                tp, cp = layout.get('tp_size', 1), layout.get('cp_size', 1)
                tokens = S // tp  # offload.py's tokens: this rank's sequence shard
                alpha = offload.choose_alpha(replace(v, offload=1.0), batch_size, tokens, torch.bfloat16,
                                             offload.block_forward_seconds(v, batch_size, tokens, FLOPS), PCIE, host)
                for a in sorted({round(alpha, 3), 1.0} - {0.0}):
                    w = replace(v, offload=a)
                    if offload.host_bytes(w, batch_size, tokens, torch.bfloat16) <= host and \
                            not parallel.check_layout(w, tp * cp, tp, cp, layout.get('cp_impl', 'ulysses'), seq_len):
                        yield w


def knobs(c, base):
    return {k: getattr(c, k) for k in KNOBS if getattr(c, k) != getattr(base, k)}


def describe(changes):
    return ' '.join(f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in changes.items())


def plan(config, budget, overhead, host, batch_size, seq_len, **layout):
    """The cheapest knob setting whose estimate fits, as (config, estimate, cost); at equal cost the
    fewest changes, then the smallest. None when none fits. A pure function of its arguments: every
    rank given the same ones reaches the same plan."""
    est = {k: v for k, v in layout.items() if k != 'cp_impl'}
    options = []
    for v in variants(config, batch_size, seq_len, host, layout):
        e = estimate(v, batch_size, seq_len, **est)
        if fits(e, budget, overhead):
            options.append((round(cost(v, config, batch_size, seq_len), 9), len(knobs(v, config)), e.total, v, e))
    options.sort(key=lambda o: o[:3])
    return (options[0][3], options[0][4], options[0][0]) if options else None


def suggestions(config, budget, overhead, host, batch_size, seq_len, world=1, **layout):
    """What would make a run fit, [(command-line change, estimate, cost)]: each knob alone at its
    cheapest fitting value, or the planner's combination; then zero=1; then tp or cp 2, 4, 8 times
    larger (more GPUs), each with the cheapest knobs that fit there."""
    best = {}
    est = {k: v for k, v in layout.items() if k != 'cp_impl'}
    for v in variants(config, batch_size, seq_len, host, layout):
        change = knobs(v, config)
        e = estimate(v, batch_size, seq_len, **est)
        x = cost(v, config, batch_size, seq_len)
        k = next(iter(change), None)
        if len(change) == 1 and fits(e, budget, overhead) and (x, e.total) < best.get(k, (1e9, 0, 0))[:2]:
            best[k] = (x, e.total, describe(change), e)
    out = [(d, e, x) for x, _, d, e in sorted(best.values(), key=lambda o: o[:2])]
    if not out and (p := plan(config, budget, overhead, host, batch_size, seq_len, **layout)):
        out.append((describe(knobs(p[0], config)), p[1], p[2]))
    dp, cp = layout.get('dp', 1), layout.get('cp_size', 1)
    if dp * cp > 1 and not layout.get('zero'):
        if fits(e := estimate(config, batch_size, seq_len, **{**est, 'zero': 1}), budget, overhead):
            out.append(('--zero=1', e, 0.0))
    device_type = layout.get('device_type', 'cuda')  # a new group brings NCCL's buffers
    comm = overhead_bytes(device_type, 1 + (world == 1)) - overhead_bytes(device_type)
    for key in ('tp_size', 'cp_size'):
        for factor in (2, 4, 8):
            n = layout.get(key, 1) * factor
            n_layout = {**layout, key: n}
            if parallel.check_layout(config, world * factor, n_layout.get('tp_size', 1), n_layout.get('cp_size', 1),
                                     layout.get('cp_impl', 'ulysses'), seq_len):
                continue
            p = plan(config, budget, overhead + comm, host, batch_size, seq_len, **{**layout, key: n})
            if p is not None:
                change = f"--{key}={n} {describe(knobs(p[0], config))}".strip()
                out.append((change + f" ({world * factor} GPUs)", p[1], p[2]))
                break
    return out


# ----------------------------------------------------------------------------- what train.py calls

class Report:
    """Report(model, cfg, ...) before anything is on the device: the estimate printed and written to
    out_dir/memory.json, auto_memory's plan applied (rank 0 decides, every rank gets its knobs), the
    host memory offload needs checked, and a run that can't fit stopped with the changes that would
    fit (a dry run reports its verdict instead). `with report.measure(model, masters, optimizer):`
    around the first step prints and records the measured peak beside the estimate;
    report.dry_run(step, model, masters, optimizer, batches) runs one step on fake tensors."""

    def __init__(self, model, cfg, world=1, rank=0, mesh=None, device=torch.device('cpu'), dtype=torch.float32):
        self.cfg, self.world, self.rank, self.device = cfg, world, rank, device
        self.dry, self.B, self.S = bool(cfg.get('dry_run')), cfg['batch_size'], cfg['seq_len']
        tp, cp, dp = (getattr(mesh, k, 1) for k in ('tp', 'cp', 'dp'))
        self.layout = dict(dtype='bfloat16' if dtype == torch.bfloat16 else 'float32',
                           device_type='cuda' if self.dry else device.type,
                           grad_accum=cfg.get('gradient_accumulation_steps', 1), tp_size=tp, cp_size=cp, dp=dp,
                           zero=cfg.get('zero', 0))
        self.budget = device_bytes(device, cfg.get('memory_budget_gb', 0), self.dry)
        groups = sum(n > 1 for n in (tp, cp, dp, cp * dp)) + (world > 1)
        self.overhead = overhead_bytes(self.layout['device_type'], groups)
        self.host = host_bytes_per_rank(cfg.get('host_memory_budget_gb', 0), self.dry)
        self.config, self.measured, self.logged = model.config, None, False
        self.path = os.path.join(cfg.get('out_dir', '.'), 'memory.json')
        if cfg.get('auto_memory'):
            self.auto_memory(model)
        self.est = estimate(self.config, self.B, self.S, **self.layout)
        if rank == 0:
            where = f"rank 0 of {world}" + (f" (dp {dp} x cp {cp} x tp {tp})" if world > 1 else '')
            print(table(self.est, self.budget, self.overhead, title=f"memory estimate per rank, {where}, "
                        f"{self.layout['dtype']} on {'the target (dry run)' if self.dry else device}, "
                        f"batch {self.B} x {self.S} tokens:"))
            self.write()
        if self.config.offload > 0:  # offload.py's tokens per rank: the sequence shard, S / (cp·tp)
            need = offload.host_bytes(self.config, self.B, self.S // (cp * tp), dtype, cp)
            line = (f"offload={self.config.offload}: {need / GiB:.2f} GiB of host memory per rank "
                    f"({len(offload.offloaded_blocks(self.config))} blocks)")
            budget = cfg.get('host_memory_budget_gb', 0)
            limit = 'in host_memory_budget_gb' if budget and self.host == int(budget * GiB) else 'available'
            if self.host is not None and need > self.host:
                self.stop([f"error: {line}, {self.host / GiB:.2f} GiB {limit} per rank: lower offload, seq_len "
                           f"or batch_size, or use recompute='full'"])
            rank == 0 and print(line + (f", {self.host / GiB:.2f} GiB {limit}" if self.host is not None
                                        else ' on the target'))
        if not self.dry and not fits(self.est, self.budget, self.overhead):
            self.stop([f"error: does not fit: {_gib(self.est.total, 0)} per rank + {_gib(self.overhead, 0)} overhead "
                       f"> 80% of {_gib(self.budget, 0)}, peak at {self.est.moment}"] + self.suggest())

    def auto_memory(self, model):
        # rank 0 plans and every rank takes its knobs: no rank's own free memory can make it differ
        p = plan(self.config, self.budget, self.overhead, self.host, self.B, self.S,
                 cp_impl=self.cfg.get('cp_impl', 'ulysses'), **self.layout) if self.rank == 0 else None
        chosen = [knobs(p[0], self.config) if p else None]
        if self.world > 1 and not self.dry and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            self.rank == 0 and print("auto_memory: no setting of recompute / mlp_chunks / loss_chunks / offload "
                                     "fits; keeping the configured one" + (" (host memory unknown: "
                                     "set host_memory_budget_gb to let it offload)" if self.host is None else ''))
            return
        for k, v in chosen[0].items():  # forward reads model.config's knobs at every call
            setattr(model.config, k, v)
        self.rank == 0 and print(f"auto_memory chose {describe(chosen[0]) or 'the configured setting'}: "
                                 f"{_gib(p[1].total, 0)}, {100 * p[2]:+.1f}% step time")

    def suggest(self):
        sug = suggestions(self.config, self.budget, self.overhead, self.host or 0, self.B, self.S, world=self.world,
                          cp_impl=self.cfg.get('cp_impl', 'ulysses'), **self.layout)
        if not sug:
            return ["nothing within reach fits: fewer tokens per step (batch_size, seq_len) or more GPUs"]
        return ["cheapest changes that fit (estimate per rank, extra step time):"] + \
            [f"  {d:52s} {_gib(e.total)}  {100 * x:+5.1f}%" for d, e, x in sug[:8]] + \
            ["or --auto_memory=True to take the first memory knob setting above"]

    def stop(self, lines):
        if self.rank == 0:
            print('\n'.join(lines), file=sys.stderr)
        sys.exit(2)

    def write(self, **extra):
        rank = {'rank': self.rank, 'estimate': self.est.as_dict(), 'measured': self.measured,
                'overhead': self.overhead, 'device_bytes': self.budget, 'world_size': self.world,
                'tp_size': self.layout['tp_size'], 'cp_size': self.layout['cp_size'], 'seq_len': self.S}
        extra = {'fits': fits(self.est, self.budget, self.overhead), **extra}
        write_json(self.path, [rank], peak_at=self.est.moment, **extra)

    def measure(self, model, masters, optimizer, compiled=False):
        """Around a step: the first one (rank 0) is measured, printed beside the estimate, recorded."""
        if self.measured is not None or self.rank != 0:
            return nullcontext()
        return self._first_step(model, masters, optimizer, compiled)

    @contextmanager
    def _first_step(self, model, masters, optimizer, compiled):
        cuda = self.device.type == 'cuda'
        cuda and torch.cuda.reset_peak_memory_stats(self.device)
        tracker = nullcontext() if compiled else Tracker(model, masters, optimizer, device=self.device)
        with tracker:
            yield
        self.measured = dict.fromkeys(CATEGORIES + ('total',)) if compiled else tracker.breakdown()
        extra = {}
        if cuda:
            extra['cuda'] = {'peak_allocated': torch.cuda.max_memory_allocated(self.device),
                             'peak_reserved': torch.cuda.max_memory_reserved(self.device)}
            self.measured['total'] = self.measured['total'] or extra['cuda']['peak_allocated']
        print(table(self.est, self.budget, self.overhead, measured=self.measured,
                    title="memory after the first step (measured: tensors alive at the step's peak):"))
        if cuda:
            print(f"  cuda: peak allocated {_gib(extra['cuda']['peak_allocated'], 0)}, "
                  f"reserved {_gib(extra['cuda']['peak_reserved'], 0)}")
        self.write(**extra)

    def dry_run(self, step, model, masters, optimizer, batches):
        """One step on fake tensors under the MemTracker, the table, the verdict (by the dry run)."""
        with Tracker(model, masters, optimizer, device=torch.device('cpu')) as tracker:
            step(batches)
        self.measured = tracker.breakdown()
        total = self.measured['total'] + self.overhead
        ok = total <= FIT_FRACTION * self.budget
        verdict = (f"verdict: {'fits' if ok else 'DOES NOT FIT'} on a {_gib(self.budget, 0)} device: dry run "
                   f"{_gib(self.measured['total'], 0)} + {_gib(self.overhead, 0)} overhead {'<=' if ok else '>'} "
                   f"80% ({_gib(FIT_FRACTION * self.budget, 0)})")
        if self.rank == 0:
            print(table(self.est, self.budget, self.overhead, measured=self.measured, measured_label='dry run',
                        title="dry run: one step on fake tensors (CPU kernels standing in for CUDA's):"))
            print(verdict)
            if not ok:
                print('\n'.join(self.suggest()))
            self.write(dry_run=True, verdict=verdict, fits=ok)
        return ok
