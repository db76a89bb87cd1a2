"""
Memory, measured: torch's MemTracker over one step, read as memory.py's categories at each moment
of the step (a block's forward, the LM head and loss, a block's backward, the optimizer's step;
named as memory.py's estimate names them) and at its peak, the moment the device holds most. That
is what memory.py's formula is checked against, on the device or on the dry run's fake tensors
(to_fake, fake_batch: shapes without data, on the CPU). Also the anatomy of the peak (train.py's
dry_run_anatomy): the tensors alive at it, largest first, each with the op and module that made
it, so a forker sees where a change's bytes went; and memory.svg, the step drawn moment by moment.

What it saves is time. MemTracker keeps a peak per module by walking every module's statistics
at every op: a step of L blocks, each of k ops and m modules, cost L·k·L·m. Tracker keeps one
peak per moment instead: L·k. A dry run of a long stage goes further (extrapolate): its blocks
are identical but where they stand, so it measures the stage with 4 and with 5 blocks and adds,
at each moment, (L - 5) times what the fifth block added: 9·k ops, whatever L, and the same bytes
as measuring all L. (Analytic formulas reason the same way, one layer's bytes times L, as
Korthikanti et al. 2022's activations do; here one block's bytes are measured, not counted.)

The report (Report, at the end): what train.py prints and writes to out_dir/memory.json, the
estimate (memory.py) beside the measured first step or the dry run, with the verdict, and the
memory knobs memory.py's planner finds when the estimate doesn't fit.
"""
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings
import weakref
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

import offload
import parallel
from configurator import die
from memory import (FIT_FRACTION, GiB, ROWS, describe, device_bytes, estimate, fits,
                    host_bytes_per_rank, overhead_bytes, plan, suggestions)

# a block's module (model.Llama's layers.<i>), or a block's moment (backward: block <i>)
BLOCK = re.compile(r'(?:layers\.|block )(\d+)$')
# memory.py's categories, as memory.svg stacks them, bottom up
COLORS = {'params': '#4e79a7', 'grads': '#f28e2b', 'optimizer': '#e15759', 'activations': '#76b7b2',
          'transient': '#59a14f', 'workspace': '#edc948'}


class Tracker(ExitStack):
    """The header's MemTracker: .breakdown() at the step's peak, .timeline() (each moment's
    peak), and the anatomy (.at_peak, if anatomy). Entered, it enters MemTracker and
    its hooks (a hook's handle removes it); left, it leaves them, last first. masters: train.py's
    fp32 gradient holders when they are not the parameters; inputs: tensors made before the step
    that it uses (the batch)."""

    def __init__(self, model, masters=(), optimizer=None, inputs=(), device=torch.device('cpu'),
                 anatomy=False, states_on_host=False):
        super().__init__()
        from torch.distributed._tools.mem_tracker import MemTracker

        class Moments(MemTracker):
            def _update_peak_stats(mt, peak_state):
                # MemTracker's walks every module's statistics at every op, for peaks per module we
                # never read: a step's cost grew as blocks x ops. Ours: the peak of each moment
                self.note(mt._curr_mem_snap.get(self.device, {}))

            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                self.look(func, out, args, kwargs)
                return out

        # MemTracker's keys are the tensors' devices
        if device.type == 'cuda' and device.index is None:
            device = torch.device('cuda', torch.cuda.current_device())
        self.device, self.root = device, model
        # its ModTracker: the modules an op runs in (parents), and whether in backward (is_bw)
        self.mt, self.anatomy = Moments(), anatomy
        self.mods = self.mt._mod_tracker
        self.inputs, self.params = inputs, list(model.parameters())
        # made: {storage: info}, a freed storage dropped as it dies
        self.made, self.top, self.at_peak, self.moment = weakref.WeakKeyDictionary(), -1, [], ''
        # the step's moments, each [name, its peak's bytes, MemTracker's categories then, the host's
        # gradients then]
        self.moments, self.stepping = [], False
        # offload_states: FSDP2's rows, their gradients (the host's at the device's peak) and
        # AdamW's states (local: a DTensor's storage is the whole tensor's) are host memory; the
        # device's peak is before AdamW's step
        self.on_host, self.adam = [], []
        if states_on_host:
            self.on_host = [parallel.local(p) for p in self.params]
            # (every state's tensors: {parameter: {name: tensor}}'s leaves)
            self.adam = [parallel.local(v) for v in tree_leaves(optimizer.state)]
        self.masters = [m for m in masters if all(m is not p for p in self.params)]
        # optim.MasterWeights' fp32 master rows, unless they are views of fp32 parameters:
        # optimizer bytes
        own = {parallel.local(p).untyped_storage() for p in self.params}
        self.state = [x for x in getattr(optimizer, 'pieces', ()) if x.untyped_storage() not in own]
        # torch's optimizers inside optim.MasterWeights: their states are MemTracker's Optstate
        self.optimizers = optimizer.optimizers if optimizer else []
        self.mt.track_external(model, *self.state, *self.inputs, *self.optimizers)

    def __enter__(self):
        # train.py writes a master's .grad after autograd's hook: MemTracker is told of it then
        for p, m in zip(self.params, self.masters):
            self.enter_context(p.register_post_accumulate_grad_hook(
                lambda p, m=m: self.mt.track_external(m.grad)))
        # gradient accumulation runs the model's forward again: MemTracker must forget the last one
        self.enter_context(
            torch.nn.modules.module.register_module_forward_pre_hook(self.forget_model))
        self.enter_context(warnings.catch_warnings())
        # its own hook sees .grad = None after ours
        warnings.filterwarnings('ignore', message='Expected a tensor')
        for optimizer in self.optimizers:
            self.enter_context(optimizer.register_step_pre_hook(self.optimizer_step))
        self.enter_context(self.mt)
        return self

    def forget_model(self, module, args):
        """Before each forward of the model, MemTracker's statistics of it dropped: it refuses a
        second forward (gradient accumulation) otherwise. We don't read them; its blocks' stay (pp's
        backward of an earlier micro-batch finds them). Returns None: the args stay."""
        if module is self.root:
            self.mt.memory_tracking.pop(module, None)

    def optimizer_step(self, *_):
        """From here on the moment is the optimizer's step (torch's AdamW.step fires this hook
        too)."""
        self.stepping = True

    def name(self):
        """The moment an op belongs to, named as memory.py's estimate names them; None: the one
        before's (RoPE's tables, the loss after the final norm, a pipeline's sends, ...)."""
        phase = 'backward' if self.mods.is_bw else 'forward'
        for parent in self.mods.parents:  # (a block's own modules end otherwise)
            if found := BLOCK.search(parent):
                return f"{phase}: block {found[1]}"
            if parent.endswith('.norm'):  # the final norm: the LM head and loss follow
                return 'forward and backward: LM head and loss'
            if parent.endswith('.tok_embeddings'):
                return f"{phase}: embedding"
        if self.stepping:
            return 'optimizer step'

    def note(self, now):
        """At every op, MemTracker's bytes by category now: the peak of the op's moment (a new
        moment when the name changes), with the host's gradients then (offload_states)."""
        if self.stepping and self.on_host:  # AdamW steps on the host: the device's peak was before
            return
        name = self.name()
        if not self.moments or name not in (None, self.moments[-1][0]):
            self.moments.append([name or 'forward', -1])  # (its peak's figures follow)
        moment = self.moments[-1]
        total = now.get('Total', 0)
        # its figures (a Counter: a category missing now is 0), then the host's gradients and pool
        if total > moment[1]:
            moment[1:] = (total, Counter(now),
                          sum(p.grad.to_local().nbytes for p in self.params
                              if self.on_host and p.grad is not None),
                          nbytes(offload.host_buffers()))

    def look(self, func, out, args, kwargs):
        """The anatomy: note each storage on our device an op makes (not one of its inputs': a view,
        in place), what made it and its category (made in forward: activations; in backward, a
        recompute's too, or by the optimizer: transient; or grads); at a new peak of the step keep
        those alive."""
        if not self.anatomy:
            return
        where = max(self.mods.parents, key=lambda m: (m.count('.'), m))
        if self.mods.is_bw:
            where += ' (backward)'
        category = 'transient' if self.mods.is_bw or not torch.is_grad_enabled() else 'activations'
        given = self.ours(args, kwargs)
        for storage, t in self.ours(out).items():
            # (setdefault: a storage is the first op's that made it)
            if storage not in given:
                self.made.setdefault(storage, dict(category=category, dtype=str(t.dtype)[6:],
                                                   shape=list(t.shape), op=str(func), module=where))
        if self.moments and self.moments[-1][1] > self.top:  # a new peak of the step
            self.top = self.moments[-1][1]
            self.moment = f"{func} in {where}"
            self.at_peak = sorted(self.alive(), key=lambda x: -x['bytes'])

    def ours(self, *trees):
        """{storage: tensor} of the tensors on our device in the trees (nested lists, tuples and
        dicts of them)."""
        return {t.untyped_storage(): t for t in tree_leaves(trees)
                if isinstance(t, torch.Tensor) and t.device == self.device}

    def alive(self):
        """What the step made and still holds, each {**info, 'bytes'}, but host memory (offload's
        buffers, even on a CPU)."""
        # (ours' keys: a storage on another device is never one the step made on ours)
        grads = self.ours([p.grad for p in self.params + self.masters])
        host = self.ours(offload.host_buffers())
        return [{**info, 'category': 'grads' if storage in grads else info['category'],
                 'bytes': storage.nbytes()}
                for storage, info in self.made.items() if storage not in host]

    def breakdown(self):
        """Our categories at the step's peak, the moment our device holds most, and its name (on a
        CPU standing in for it MemTracker's total counts the host's tensors too: not the device's
        peak)."""
        return peak(self.timeline())

    def timeline(self):
        """The step's moments in order, each {'moment': its name, category: bytes at its peak,
        'host': the host memory of the step}."""
        masters, inputs = nbytes(self.state), nbytes(self.inputs)
        rows, adam = nbytes(self.on_host), nbytes(self.adam)
        # the pool, the rows and, by the step, every gradient's
        self.host = nbytes(offload.host_buffers()) + 2 * rows + adam
        # on a CPU MemTracker counted the host's tensors with ours: taken out
        cpu = self.device.type == 'cpu'
        out = []
        for name, _, snap, host_grads, pool in self.moments:
            # MemTracker's categories on our device; its keys are str enums: 'Parameter' finds
            # _MemRefType.PARAM
            row = {'params': snap['Parameter'] + snap['Buffer'] - rows * cpu,
                   'grads': snap['Gradient'] + snap['Other'] - masters - inputs - host_grads * cpu,
                   'optimizer': snap['Optstate'] + masters - adam * cpu,
                   'activations': snap['Activation'] + inputs - pool * cpu,
                   'transient': snap['Temp'],
                   'workspace': 0}  # kernels' workspace is no tensor: memory.py counts it
            out.append({'moment': name, **row, 'total': sum(row.values()), 'host': self.host})
        return out


def peak(timeline):
    """The moment of a timeline (Tracker.timeline's) that holds most: the step's peak."""
    return max(timeline, key=lambda moment: moment['total'])


def nbytes(tensors):
    """Their storages' bytes, each storage once (views share one)."""
    return sum(s.nbytes() for s in {t.untyped_storage() for t in tensors})


# ----------------------------------------------------------------------------- the dry run
def to_fake(model, dtype):
    """model.to(dtype) for a model on the meta device, as FakeTensors on the CPU (Module.to can't
    make them in place): tied parameters stay tied. (The model has no buffers: RoPE's tables are
    made in its forward.)"""
    from torch._guards import active_fake_mode
    if active_fake_mode() is None:  # from here on every tensor is fake, until the process exits
        from torch._subclasses.fake_tensor import FakeTensorMode
        FakeTensorMode(allow_non_fake_inputs=True).__enter__()
    made = {}  # {parameter: its fake} (a tensor hashes by its identity)
    for m in model.modules():
        for k, p in m.named_parameters(recurse=False):
            # (every parameter of model.Llama is a float)
            new = torch.empty(p.shape, dtype=dtype, device='cpu')
            # a tied parameter's second module takes the fake its first made
            setattr(m, k, made.setdefault(p, torch.nn.Parameter(new, p.requires_grad)))
    return model

def fake_batch(batch_size, seq_len, vocab_size, doc_mask=False):
    """A batch as train.py's get_batch returns it, (x, y, positions, docs): inputs and targets,
    views of one (B, S+1) tensor; with doc_mask two documents a row, their positions and starts
    (a real window's are known when it is drawn; attention runs what a packed window runs, varlen
    on CUDA, which saves the same for any number of documents), else None."""
    xy = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    positions = docs = None
    if doc_mask:
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
        positions = positions.expand(batch_size, -1)
        docs = (np.arange(batch_size)[:, None] * seq_len + [0, half]).ravel()
    return xy[:, :-1], xy[:, 1:], positions, docs


def gib(n):
    """Bytes in GiB, MiB or KiB, whichever reads best (a table aligns it)."""
    if n is None:
        return '-'
    for unit, size in (('GiB', GiB), ('MiB', 2 ** 20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def anatomy(tracker, n, tensors):
    """The n largest tensors alive at the peak, of its `tensors` bytes: what a change to the code
    added or removed. Printed; returned for memory.json."""
    largest, made = tracker.at_peak[:n], sum(x['bytes'] for x in tracker.at_peak)
    print(f"anatomy of the peak, after {tracker.moment}: the {len(largest)} largest of the "
          f"{len(tracker.at_peak)} tensors made in the step and alive, {gib(made)} (the "
          f"other {gib(tensors - made)} were there before it: parameters, optimizer, batch):")
    for x in largest:
        print(f"  {gib(x['bytes']):>12s}  {x['category']:12s}{x['dtype']:9s}"
              f"{str(x['shape']):22s} {x['op']} in {x['module']}")
    return {'moment': tracker.moment, 'made_bytes': made, 'largest': largest}


# ----------------------------------------------------------------------------- fewer blocks
def renumbered(moment, past, shift):
    """A moment's name, its block numbered `shift` more if it is past `past`."""
    found = BLOCK.search(moment)
    if not found or int(found[1]) <= past:
        return moment
    return f"{moment[:found.start(1)]}{int(found[1]) + shift}"


def extrapolate(fewer, more, n, blocks, stage):
    """Pipeline stage `stage`'s step with `blocks` blocks, from the timelines (Tracker.timeline) of
    the same stage with n and n + 1 blocks. The blocks are identical but where they stand: the
    first (after the embedding or another stage), and the last KEEP_LAST, which offload.py keeps on
    the device. Run n + 1 has one more between, its stage's block 2 (counted from 0): without that
    block's moments its timeline is run n's, moment for moment, and that block's pair with those of
    run n's block 1 (both the last of those between). What one more block adds at a moment is the
    pair's difference; with `blocks` blocks the moment holds run n + 1's bytes plus
    (blocks - n - 1) times that. Exact while memory grows by the same bytes per block, as the
    states and the kept activations do. A moment of a block between the first and the last of
    those between lies between theirs: left out, and never the peak. Blocks are numbered in the
    whole model."""
    first = stage * (n + 1)  # run n + 1's first block (run n's: stage * n)
    added = blocks - n - 1  # blocks beyond run n + 1's
    ones = (m for m in fewer if m['moment'].endswith(f' block {stage * n + 1}'))
    rest = iter(fewer)
    out = []
    for m in more:
        other = next(ones if m['moment'].endswith(f' block {first + 2}') else rest)
        # its blocks 2 on are the stage's last; then all as the whole model numbers them
        name = renumbered(m['moment'], first + 1, added)
        row = {k: v + added * (v - other[k]) for k, v in m.items() if k != 'moment'}
        out.append({'moment': renumbered(name, first - 1, stage * blocks - first), **row})
    return out


# ----------------------------------------------------------------------------- the picture
def write_svg(path, timeline, measured, estimate, device):
    """memory.svg: the step's moments left to right, each a bar of its peak's bytes stacked by
    category (hover one for its figures) over its name, the peak's as `measured` (with the
    workspace no tensor shows) and labelled; the device's 80% line; the estimate's peak marked (a
    black dash at its total on the moments of its name). Hand-written SVG: any browser shows it."""
    width, height = 1000, 320
    # below a title band of 40; SVG's y grows downwards: a bar stands on the bottom
    bottom = 40 + height
    scale = height / max(measured['total'], 0.8 * device)  # the 80% line at the top at most
    bar = width / len(timeline)
    keys = ' '.join(f'<tspan fill="{color}">&#9632; {k}</tspan>' for k, color in COLORS.items())
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 10}" '
           f'height="{bottom + 170}" font-family="sans-serif" font-size="12">',
           f'<text x="4" y="16">memory per rank at each moment of one step: {keys} &#8212; '
           f"the estimate's peak <tspan fill='red'>- - 80% of the device, {gib(device)}</tspan>"
           '</text>']
    highest = peak(timeline)
    for i, m in enumerate(timeline):
        if m is highest:
            m = measured
        x, y = i * bar, bottom
        for k, color in COLORS.items():
            y -= scale * m[k]
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{0.9 * bar:.1f}" '
                       f'height="{scale * m[k]:.1f}" fill="{color}"><title>{m["moment"]}: {k} '
                       f'{gib(m[k])} of {gib(m["total"])}</title></rect>')
        out.append(f'<text transform="translate({x + bar / 3:.1f},{bottom + 4}) '
                   f'rotate(90)" font-size="7">{m["moment"]}</text>')
        if m is measured:
            out.append(f'<text x="{x}" y="{y - 6:.1f}">peak {gib(m["total"])}: {m["moment"]}'
                       '</text>')
        if m['moment'] == estimate.moment:
            mark = bottom - scale * estimate.total
            out.append(f'<path d="M{x:.1f},{mark:.1f}h{bar:.1f}" stroke="black" '
                       'stroke-width="2"/>')
    line = bottom - scale * 0.8 * device
    out.append(f'<path d="M0,{line:.1f}h{width}" stroke="red" stroke-dasharray="6 3"/>')
    Path(path).write_text('\n'.join(out + ['</svg>']) + '\n')


# ----------------------------------------------------------------------------- the run's curves
def write_lines(path, panels):
    """Line charts one above the other (curves.svg, eval.py's positions.svg): each panel a (title,
    [line, ...]), a line a list of (x, y) points, drawn blue then red and scaled to fill its panel;
    its ranges written in its title. SVG's y grows downwards: a panel's bottom minus y."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="620" height="{240 * len(panels)}" '
           'font-family="sans-serif" font-size="12">']
    for n, (title, lines) in enumerate(panels):
        points = sum(lines, [])  # (every line's)
        if not points:  # (a log without that key yet)
            continue
        xs, ys = zip(*points)
        x0, y0 = min(xs), min(ys)
        out.append(f'<text x="10" y="{240 * n + 20}">{title}: x {x0:.4g} to {max(xs):.4g}, '
                   f'y {y0:.4g} to {max(ys):.4g}</text>')
        # a single point, or a flat line, still has a range to divide by
        x_scale = 600 / max(max(xs) - x0, 1e-9)
        y_scale = 200 / max(max(ys) - y0, 1e-9)
        for color, line in zip(['blue', 'red'], lines):
            xy = [f'{10 + (x - x0) * x_scale:.1f},{240 * n + 230 - (y - y0) * y_scale:.1f}'
                  for x, y in line]
            out.append(f'<polyline points="{" ".join(xy)}" fill="none" stroke="{color}"/>')
    Path(path).write_text('\n'.join(out + ['</svg>']) + '\n')


_SKIPPED_SAID = set()  # the out_dirs whose unreadable log lines write_curves has said


def write_curves(out_dir):
    """out_dir/curves.svg from out_dir/log.jsonl, train.py's rows (it calls this at each
    evaluation): train and val loss, tokens/s and peak memory against the step."""
    # a picture must never stop the run that draws it: a line cut short by a crash (and a resumed
    # run's row appended to it), bytes that aren't UTF-8, a line of JSON that isn't a row: skipped
    rows = []
    skipped = 0
    for line in Path(out_dir, 'log.jsonl').read_text(errors='replace').splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and type(row.get('iter')) is int:
            rows.append(row)
        else:
            skipped += 1
    if skipped and out_dir not in _SKIPPED_SAID:
        _SKIPPED_SAID.add(out_dir)  # said once a run, not at every evaluation
        print(f"curves.svg: {skipped} line(s) of log.jsonl are not train.py's rows: skipped")

    def points(key, scale=float):
        """(step, value) of the rows holding a positive finite number at key."""
        return [(row['iter'], scale(row[key])) for row in rows
                if type(row.get(key)) in (int, float) and 0 < row[key] < math.inf]

    # the loss on a log scale: the first steps' would flatten the rest on a linear one
    write_lines(Path(out_dir, 'curves.svg'), [
        ('log10 loss (blue: train, red: val)',
         [points('loss', math.log10), points('val_loss', math.log10)]),
        ('tokens/s', [points('tokens_per_s')]),
        ('peak memory (bytes)', [points('peak_mem_bytes')])])


# ------------------------------------------------------------------------ a long stage's dry run
# train.py's dry run of a stage of many blocks measures it with few, each in a process of its own
# (the command again), and extrapolates (above).

def few_blocks(blocks, config, mesh, name):
    """The timeline of this dry run (train.py's) with `blocks` blocks a stage, every one measured:
    the command in a process of its own, as this rank, with config's every field (auto_memory's
    knobs, a Hugging Face directory's shape). name: its memory.json's."""
    fixed = [f'--{f.name}={getattr(config, f.name)!r}' for f in fields(config)]
    with tempfile.TemporaryDirectory() as tmp:
        rerun(mesh.rank, f"{blocks} blocks a stage",
              [*fixed, '--init_from=scratch', f'--n_layer={blocks * mesh.pp}',
               '--auto_memory=False', '--dry_run_full=True', f'--out_dir={tmp}'],
              stdout=subprocess.DEVNULL)
        return json.loads(Path(tmp, name).read_text())['timeline']


def rerun(rank, what, args=(), stdout=None):
    """The user's command again, with args after its own, as rank `rank` in a process of its own;
    one line stops us if it fails (its error is on our stderr), naming it by `what`."""
    env = {**os.environ, 'RANK': str(rank)}
    if subprocess.run([sys.executable, *sys.argv, *args], env=env, stdout=stdout).returncode:
        die(f"the dry run of {what} failed")


# ----------------------------------------------------------------------------- what train.py calls
class Report:
    """Made before the model is built, and changing nothing: auto_memory() returns the memory knobs
    that fit (rank 0 decides, every rank takes its knobs; train.py sets them in the config), then
    check(config) prints config's estimate and writes it to out_dir/memory.json, checks offload's
    host memory, and stops a run that can't fit with the changes that would fit (a dry run gives
    its verdict instead). `with report.measure(...)` around the first step adds the measured peak.
    memory.json: {"ranks": [{"rank", "estimate", "measured", "overhead", "device_bytes",
    "world_size", "tp_size", "cp_size", "seq_len"}], "peak_at", "fits", ...}."""

    def __init__(self, config, cfg, world, rank, mesh, device, dtype):
        self.cfg, self.world, self.rank, self.device = cfg, world, rank, device
        self.config, self.dry = config, cfg.get('dry_run')  # (the configured knobs: check's sets)
        # logged: train.py's first log row has carried the measured bytes
        self.measured, self.logged = None, False
        at = mesh.rank  # the dry run's rank, in its memory.json's name
        self.name = f'memory.rank{at}.json' if at > 0 else 'memory.json'
        # estimate's arguments: train.py's settings of the same names (batch_size, seq_len, zero,
        # ...), then the mesh's sizes and the weights' dtype over the settings' (dtype='auto'):
        # 'torch.bfloat16' is the setting's 'bfloat16'; a dry run's target is CUDA
        self.layout = {k: cfg[k] for k in inspect.signature(estimate).parameters if k in cfg}
        self.layout.update(dtype=str(dtype)[6:], device_type='cuda' if self.dry else device.type,
                           dp=mesh.dp, tp_size=mesh.tp, cp_size=mesh.cp, pp_size=mesh.pp,
                           pp_rank=mesh.pp_rank)
        self.budget = device_bytes(device, cfg.get('memory_budget_gb', 0), self.dry)
        # NCCL's communicators: one per group of more than one rank
        groups = [mesh.tp, mesh.cp // mesh.cp_ring, mesh.cp_ring, mesh.dp, mesh.pp,
                  mesh.cp * mesh.dp, world]
        self.overhead = overhead_bytes(self.layout['device_type'], sum(n > 1 for n in groups))
        self.host = host_bytes_per_rank(cfg.get('host_memory_budget_gb', 0), self.dry)
        where = f"rank {at} of {world}"
        if world > 1:
            where += f" (dp {mesh.dp} x pp {mesh.pp} x cp {mesh.cp} x tp {mesh.tp})"
        target = 'the target (dry run)' if self.dry else device
        self.title = (f"memory estimate per rank, {where}, {self.layout['dtype']} on {target}, "
                      f"batch {cfg['batch_size']} x {cfg['seq_len']} tokens:")

    def auto_memory(self):
        """The memory knobs the cheapest setting that fits changes ({}: the configured one, or
        none fits). Rank 0 plans and every rank takes its knobs: no rank's own free memory can
        make it differ."""
        chosen = [{}]
        if self.rank == 0:
            p = plan(self.config, self.budget, self.overhead, self.host, **self.layout)
            if p:
                chosen = [p.changed]
                print(f"auto_memory chose {describe(p.changed) or 'the configured setting'}: "
                      f"{gib(p.estimate.total)}, {100 * p.cost:+.1f}% step time")
            else:
                unknown = " (host memory unknown: set host_memory_budget_gb)" * (self.host is None)
                print("auto_memory: no setting of the memory knobs fits; keeping the configured one"
                      + unknown)
        if self.world > 1 and not self.dry and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(chosen, src=0)
        return chosen[0]

    def check(self, config):
        """config's estimate (the model's, as built): printed, its host memory checked, a run that
        can't fit stopped. memory.json is written by write(), once the run has started (a run
        stopped before, by a check or a checkpoint that won't load, writes nothing)."""
        self.config, self.est = config, estimate(config, **self.layout)
        if self.rank == 0:
            print(self.table(self.title))
        states_on_host = self.cfg.get('offload_states', False)
        if config.offload > 0 or states_on_host:
            self.check_host(states_on_host)
        if not self.dry and not fits(self.est, self.budget, self.overhead):
            self.stop([f"error: does not fit: {gib(self.est.total)} per rank + "
                       f"{gib(self.overhead)} overhead > 80% of {gib(self.budget)}, peak at "
                       f"{self.est.moment}"] + self.suggest())

    def check_host(self, states):
        """This rank's offloaded blocks (offload.host_bytes) and the states' rows in host memory:
        said, and a run stopped if they don't fit."""
        line = (f"offload={self.config.offload}{', offload_states=True' * states}: "
                f"{self.est.host / GiB:.2f} GiB of host memory per rank "
                f"({len(offload.offloaded_blocks(self.config))} blocks"
                f"{' and the model states' * states})")
        budget = self.cfg.get('host_memory_budget_gb', 0)
        if self.host is None:
            have = ' on the target'
        elif budget and self.host == int(budget * GiB):
            have = f", {self.host / GiB:.2f} GiB in host_memory_budget_gb"
        else:
            have = f", {self.host / GiB:.2f} GiB available"
        if self.host is not None and self.est.host > self.host:
            more = " (the states: 16 bytes per parameter over dp x cp ranks: more of them)" * states
            self.stop([f"error: {line}{have} per rank: lower offload, seq_len or batch_size, or "
                       f"recompute='full'{more}"])
        if self.rank == 0:
            print(line + have)

    def suggest(self):
        # (host memory unknown: None, no offload suggested)
        found = suggestions(self.config, self.budget, self.overhead, self.host, world=self.world,
                            **self.layout)
        if not found:
            return ["nothing within reach fits: fewer tokens per step (batch_size, seq_len) or "
                    "more GPUs"]
        return (["cheapest changes that fit (estimate per rank, extra step time):"]
                + [f"  {s.change:52s} {gib(s.estimate.total):>12s}  {100 * s.cost:+5.1f}%"
                   for s in found[:8]]
                + ["or --auto_memory=True to take the first memory knob setting above"])

    def stop(self, lines):
        if self.rank == 0:
            print('\n'.join(lines), file=sys.stderr)
        sys.exit(2)

    def table(self, title, measured=None, dry=False):
        """A row per category, estimate and (when given) measured with the error in percent (a
        category's relative to the measured total), a bar each (the device is 40 characters, 80%
        at 32), the verdict."""
        e, measured = self.est.as_dict(), measured or {}
        # a dry run's figure is the verdict's, the estimate otherwise
        label = 'dry run' if dry else 'measured'
        header = f"  {'':12s}{'estimate':>12s}"
        if measured:
            header += f"{label:>13s}{'error':>8s}"
        lines = [title, header]
        mt = measured.get('total')
        for k in ROWS:
            m = measured.get(k)
            if k == 'workspace' and not e[k] and not m:  # none: no row
                continue
            row = f"  {k:12s}{gib(e[k]):>12s}"
            if measured:
                err = ''
                if m is not None and mt:  # a category's error relative to the measured total
                    err = f"{100 * (e[k] - m) / mt:+7.1f}%"
                row += f"{gib(m):>13s}{err:>8s}"
            row += '  ' + '█' * min(80, round(40 * e[k] / self.budget))
            lines.append(row)
        if dry and e['workspace']:
            lines.append("  (the dry run's workspace is the formula's: fake tensors can't see "
                         "inside a CUDA kernel)")
        total = (mt if dry else e['total']) + self.overhead
        verdict = 'fits' if total <= FIT_FRACTION * self.budget else 'DOES NOT FIT'
        lines += [f"  {'+ overhead':12s}{gib(self.overhead):>12s}   (CUDA context, NCCL buffers: "
                  "not in tensors)",
                  f"  {'device':12s}{gib(self.budget):>12s}   80% rule: {gib(total)} of "
                  f"{gib(FIT_FRACTION * self.budget)} -> {verdict}",
                  f"  peak at: {self.est.moment}"]
        if self.est.host:
            lines[-1] += f"; {gib(self.est.host)} offloaded to host"
        if measured.get('moment'):  # (an eval's forward peaks elsewhere than training's step)
            lines.append(f"  {label} peak at: {measured['moment']}")
        return '\n'.join(lines)

    def write(self, **extra):
        rank = {'rank': self.rank, 'estimate': self.est.as_dict(), 'measured': self.measured,
                'overhead': self.overhead, 'device_bytes': self.budget, 'world_size': self.world,
                **{k: self.layout[k] for k in ('tp_size', 'cp_size', 'seq_len')}}
        report = {'ranks': [rank], 'peak_at': self.est.moment,
                  'fits': fits(self.est, self.budget, self.overhead), **extra}
        path = Path(self.cfg['out_dir'], self.name)
        # written beside it, then renamed: a reader never sees half a file
        tmp = Path(f'{path}.tmp')
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)
        return path

    @contextmanager
    def measure(self, model, masters, optimizer, compiled=False):
        """Around a step: the first one (rank 0) is measured, then reported (report). Compiled,
        MemTracker can't see into the graph: CUDA's peak only."""
        if self.measured is not None or self.rank != 0:
            yield
            return
        cuda, extra = self.device.type == 'cuda', {}
        largest = self.cfg['dry_run_anatomy']  # the anatomy's N (0: none)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if compiled:
            yield
            m = dict.fromkeys(ROWS)
        else:
            with Tracker(model, masters, optimizer, device=self.device,
                         anatomy=largest,
                         states_on_host=self.cfg['offload_states']) as tr:
                yield
            m, extra['timeline'] = tr.breakdown(), tr.timeline()
            if largest:
                extra['anatomy'] = anatomy(tr, largest, m['total'])
        # its peak holds what kernels allocate beside the tensors: the total, the rest workspace
        if cuda:
            allocated = torch.cuda.max_memory_allocated(self.device)
            extra['cuda'] = {'peak_allocated': allocated,
                             'peak_reserved': torch.cuda.max_memory_reserved(self.device)}
            m['workspace'] = None if compiled else max(0, allocated - m['total'])
            m['total'] = max(m['total'] or 0, allocated)
        self.report(m, **extra)

    def report(self, m, **extra):
        """The measured breakdown m (and m['host'], the host memory measured) printed beside the
        estimate and recorded (memory.json, and the step's timeline drawn in memory.svg), a dry
        run's with the verdict. m is the timeline's peak moment, the workspace added (a dry run's,
        or CUDA's beyond the tensors): memory.svg draws it there."""
        host = m.get('host')
        title = "memory after the first step (measured: tensors alive at the step's peak):"
        if self.dry:
            # fake tensors can't see inside a kernel: the formula's workspace, in every attention
            # backward (a few blocks' dry runs added it to theirs); the peak: the moment holding
            # most
            for row in extra['timeline']:
                if row['moment'].startswith('backward: block') and not row['workspace']:
                    row['workspace'] = round(self.est.kernel)
                    row['total'] += row['workspace']
            m = peak(extra['timeline'])
            title = "dry run: one step on fake tensors (CPU kernels standing in for CUDA's):"
        self.measured = m
        print(self.table(title, m, self.dry))
        # offloaded blocks and offload_states' rows, not the device's
        if self.est.host and host is not None:
            extra['host'] = {'estimate': round(self.est.host), 'measured': host}
            print(f"  host memory per rank: {gib(self.est.host)} estimated, {gib(host)} measured")
        if self.dry:
            # the dry run's verdict: its total, and its host memory where a budget is given
            ok = m['total'] + self.overhead <= FIT_FRACTION * self.budget
            host_ok = self.host is None or host <= self.host
            fit = ok and host_ok
            verdict = (f"verdict: {'fits' if fit else 'DOES NOT FIT'} on a "
                       f"{gib(self.budget)} device: dry run {gib(m['total'])} + "
                       f"{gib(self.overhead)} overhead "
                       f"{'<=' if ok else '>'} 80% ({gib(FIT_FRACTION * self.budget)})")
            if not host_ok:
                verdict += f"; host {gib(host)} > {gib(self.host)}"
            print(verdict)
            if not fit:
                print('\n'.join(self.suggest()))
            extra.update(fits=fit, verdict=verdict)
        path = self.write(dry_run=self.dry, **extra)
        if 'timeline' in extra:
            write_svg(path.with_suffix('.svg'), extra['timeline'], m, self.est, self.budget)
