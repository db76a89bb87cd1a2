"""
The plan: from a laptop, in seconds, the longest sequence your GPUs can train and the layout and
memory knobs that reach it, or the fastest plan for a length you choose; then train.py's dry run
confirms it. It saves your hours of trial runs, one dry run at a time. The idea: Fujii et al. 2024
(arXiv 2411.06465: memory estimates that decide a layout before it runs), a search over layouts by
a cost model as Galvatron's and MindSpeed's auto-parallel do (they profile on the cluster; this
prices by formula, on a laptop), Megatron-LM's FLOPs and communication counts.

    python plan.py config/llama3_8b_node.py --gpus=8 --gpu_gb=80 --host_gb=2048   # the longest
    python plan.py config/llama3_8b_node.py --gpus=8 --seq_len=1048576            # the fastest

The keys are read as train.py reads them (a config file, then --key=value), plus plan.py's own
below: gpus, nodes, gpu_gb (a GPU's memory), host_gb (a node's; 0: 256 a GPU, a DGX's 2 TB over its
8), step (the lengths tried are its multiples; 0: 8,192 a GPU), peak_tflops and svg.

The search. A layout is train.py's keys tp_size, cp_size (cp_impl 'ulysses' or 'ring', or
cp_ring: Ulysses inside a node, the ring across), pp_size,
zero (0, 2, 3), offload_states and ep_size, dp the rest of the GPUs (parallel.check_layout says
which run). For each, memory.variants gives the memory knobs (recompute, mlp_chunks, loss_chunks,
offload's α; here also attention_chunks 1 or 0) and memory.estimate prices each setting on the
first and the last pipeline stage (about 0.05 ms an estimate). A plan fits when its fullest rank,
with the CUDA context and NCCL's buffers, is under 80% of the GPU (Fujii et al. 2024) and its
ranks' host memory (offload's block inputs, the states on the host) is under the node's.
  - without --seq_len: per layout the longest multiple of `step` that fits with the knobs that
    keep least (recompute='full', head groups; lengths doubled, then halved apart: fitting only
    gets harder with length), then its fastest knobs at that length; ranked longest first.
  - with --seq_len: every layout's knobs that fit, ranked by the predicted step time.
Pipeline layouts run at least pp micro-batches (1F1B's rule): their step holds that many sequences.
Of plans of equal step time the smallest wins, then the one of most chunks (headroom at the moments
other than the estimate's peak, which the dry run may find larger).

The dry run (train.py --dry_run=True: fake tensors on this CPU, rank 0 of the world) has the last
word, in ranked order: the winner, then each next plan within 3% of the best confirmed (the
runner-up within 3%; the next ones too where the dry run cut the winner's length). In the longest
search it moves the length: the layout is searched again with the GPU's memory scaled by what the
estimate missed (where the dry run said no, a shorter length; where it said yes, a longer one).
plan.svg draws the longest length against the GPUs (1 to 64, 8 a node) for 24, 80 and 141 GB.

The time model, one step of a rank (the letters of memory.py: b = 2 bytes, T = B·S/c tokens of a
micro-batch on a rank, M micro-batches, N the parameters, d = dp·c the ranks FSDP2 shards over):
  compute    model.flops_per_token's FLOPs (6·N + attention's causal pairs) × B·S·M / (t·c·pp),
             × (1 + memory.cost): recompute's and head groups' forward again, the MLP's chunks
             re-run, offload's copies that a block's forward does not hide (PCIe); over
             the peak × EFFICIENCY.
  on the critical path, each over its group's link (NVLINK within a node, NETWORK across):
    tp       4 collectives a block a pass (sp: all-gather before attention and the MLP,
             reduce-scatter after), each (t-1)/t · b·h·T (Korthikanti et al. 2022)
    Ulysses  4 all-to-alls a block a pass (q, k, v there, the output back), (u-1)/u ·
             b·(2q + 2kv)/t · T, q = H·hd (h where head_dim is n_embd / n_head); u = c, or
             cp_size / cp_ring (its group: u neighbours, NVLink where t·u fits a node)
    ep       2 all-to-alls an MoE block a pass (dispatch, combine), (ep-1)/ep · b·h·k·T
             a pass: forward, backward, and forward again under recompute (attention's alone by
             head groups)
  hidden behind compute (prefetched or pipelined), counted where they exceed it:
    ring     k, v sent r - 1 times a block forward, with dk, dv twice that backward: b·2kv/t · T
             (r = c, or cp_ring; its group spans t·c ranks: the network past a node)
    FSDP2    zero 2/3: all-gathers of b·N/(t·pp) (forward; again in backward for 3) and a
             reduce-scatter of 4·N/(t·pp), each (d-1)/d; zero 0, d > 1: an all-reduce, twice
             that; offload_states: the fp32 rows over PCIe, in twice and out once, 12·N/(t·pp·d)
  pp         the bubble: × (M + pp - 1)/M (1F1B and GPipe alike)
Not modelled: the CPU's AdamW step under offload_states (seconds, against minutes of compute at
the lengths it is for) and kernels' efficiency falling at small shapes.
The constants: the peak, --peak_tflops=989, an H100's or H200's dense bf16 TFLOP/s (NVIDIA's
datasheets); NVLINK 450e9 B/s one way (NVLink 4: 900 GB/s both ways); NETWORK
50e9 B/s a GPU (400 Gb/s InfiniBand NDR, a DGX H100's 8 ports); PCIe memory.PCIE (25e9 B/s each
way, what offload.py assumes); EFFICIENCY fitted on one bench/RESULTS.md row (the ~1B Llama on one
H200 at 131,072 tokens, recompute full, MLP and loss chunked: 11,430 tokens/s) and checked on its
others (tests/test_plan.py; the errors: bench/RESULTS.md).
"""
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import NamedTuple

import torch

import parallel
import train
from configurator import check, configure, die
from measure import GiB
from memory import FIT_FRACTION, PCIE, cost, estimate, overhead_bytes, variants
from knobs import KNOBS, Knobs, architecture
from model import flops_per_token, num_params

NVLINK, NETWORK = 450e9, 50e9
EFFICIENCY = 0.473  # fitted (the header): tests/test_plan.py
# plan.py's own keys and their defaults (train.py's are read beside them)
KEYS = dict(gpus=1, nodes=1, gpu_gb=80.0, host_gb=0.0, step=0, peak_tflops=989.0, svg='plan.svg')
RULES = [  # configurator.check's rows: (keys, what they allow, the check of one value)
    ('gpus nodes seq_len', 'must be >= 1', lambda v: v >= 1),
    ('gpu_gb peak_tflops', 'must be > 0', lambda v: v > 0),
    ('host_gb', 'must be >= 0 (0: 256 GB a GPU)', lambda v: v >= 0),
    ('step', 'must be >= 0 (0: 8,192 a GPU)', lambda v: v >= 0)]
# the sizes a layout's groups take, and plan.svg's GPU counts
POWERS = (1, 2, 4, 8, 16, 32, 64)


class Target(NamedTuple):
    """The machines, and train.py's settings estimate() reads beside a layout."""
    gpus: int
    per_node: int
    gpu_bytes: float
    host_bytes: float  # a node's
    peak: float
    settings: dict


class Plan(NamedTuple):
    seq_len: int
    layout: dict    # train.py's keys, and dp
    config: object  # the model's, its memory knobs set
    device: float   # bytes of the fullest rank, with the overhead
    host: float     # bytes of a node
    seconds: float  # of a step


def broken(c, gpus, layout, seq_len=None):
    """parallel.check_layout's reason why c can't run so (None: it can)."""
    return parallel.check_layout(c, gpus, layout['tp_size'], layout['cp_size'],
                                 layout['cp_impl'], seq_len, layout['zero'], 'cuda',
                                 torch.bfloat16, layout['offload_states'], layout['pp_size'],
                                 layout['gradient_accumulation_steps'], layout['pp_schedule'],
                                 layout['ep_size'], layout['cp_ring'])


def layouts(c, target):
    """Every layout of the target's GPUs that can run c: tp within a node, pp up to 8 stages, each
    with at least as many micro-batches (1F1B's rule: the step's tokens grow with them)."""
    s, n = target.settings, target.gpus
    sizes = [k for k in POWERS if n % k == 0]
    # the layout's own rules, whatever knobs the config set (plans() checks each setting's)
    plain = Knobs(**architecture(c))
    for tp, cp, pp, ep, ring, zero, on_host in itertools.product(
            sizes, sizes, sizes[:4], sizes, sizes, (0, 2, 3), (False, True)):
        # the ring's r of cp's c = u × r (parallel.py): 1 is Ulysses alone, c the ring alone,
        # between them Ulysses inside a node and the ring across (cp_ring)
        impl = 'ulysses'
        if ring == cp > 1:
            impl = 'ring'
        layout = dict(tp_size=tp, cp_size=cp, cp_impl=impl, cp_ring=ring * (1 < ring < cp),
                      pp_size=pp, dp=n // (tp * cp * pp), zero=zero, offload_states=on_host,
                      ep_size=ep, pp_schedule=s['pp_schedule'],
                      gradient_accumulation_steps=max(pp, s['gradient_accumulation_steps']))
        # (broken() says whether tp·cp·pp divides n and r divides c)
        within_node = tp <= min(target.per_node, 8)
        if within_node and cp % ring == 0 and not broken(plain, n, layout):
            yield layout


def plans(c, layout, seq_len, target, least=False):
    """Every setting of the memory knobs that fits layout at seq_len tokens, as Plans. least: only
    those that keep least (recompute='full', head groups), for the longest length; their step
    time is not asked."""
    pp = layout['pp_size']
    settings = {**target.settings, **layout}  # estimate's keywords
    tp, cp, dp = layout['tp_size'], layout['cp_size'], layout['dp']
    ring = parallel.ring_size(cp, layout['cp_impl'], layout['cp_ring'])
    # measure.Report's overhead: the CUDA context, a communicator per group of more than one rank
    groups = (tp, cp // ring, ring, dp, pp, cp * dp, target.gpus)
    overhead = overhead_bytes('cuda', sum(k > 1 for k in groups))
    # the host a rank may fill; offload's α is chosen for it (memory.variants)
    host = target.host_bytes / target.per_node
    for groups in (0,) if least else (1, 0):
        for v in variants(replace(c, attention_chunks=groups), settings['batch_size'], seq_len,
                          host, layout):
            if broken(v, target.gpus, layout, seq_len) or (least and v.recompute != 'full'):
                continue
            # the first stage (the embedding, the most micro-batches in flight) and the last
            # (the LM head); between them, stages like the first without its embedding
            es = [estimate(v, seq_len=seq_len, **settings, pp_rank=r) for r in {0, pp - 1}]
            device = max(e.total for e in es) + overhead
            node = max(e.host for e in es) * target.per_node
            if device <= FIT_FRACTION * target.gpu_bytes and node <= target.host_bytes:
                seconds = 0 if least else step_seconds(v, layout, seq_len, target)
                yield Plan(seq_len, layout, v, device, node, seconds)


def step_seconds(c, layout, seq_len, target):
    """The header's time model: one step's seconds."""
    t, cp, pp, dp, ep, M = (layout[k] for k in ('tp_size', 'cp_size', 'pp_size', 'dp', 'ep_size',
                                                'gradient_accumulation_steps'))
    B = target.settings['batch_size']
    # the same model without the memory knobs: what they cost is measured against it
    plain = Knobs(**architecture(c))
    flops = flops_per_token(c, seq_len) * B * seq_len * M / (t * cp * pp)
    compute = flops * (1 + cost(c, plain, B, seq_len)) / (target.peak * EFFICIENCY)

    def link(span):
        """A group's bytes/s: NVLink within a node, the network across (the grid is dp, pp, cp,
        tp: tp's ranks are neighbours, then cp's; FSDP2's and ep's span the job)."""
        return NVLINK if span <= target.per_node else NETWORK

    # a block's bytes on a rank (b = 2), a pass each: forward, backward, forward again
    bT, h, kv = 2 * B * seq_len / cp, c.n_embd, c.n_kv_head * c.head_dim
    q = c.n_head * c.head_dim  # the query width: attention's output too
    passes = 2 + (c.recompute != 'none')
    attention_passes = 2 + (c.recompute != 'none' or c.attention_chunks != 1)
    exposed = 4 * passes * (t - 1) / t * h * bT / link(t)
    # (a dense model's ep is 1: no term), in the MoE layers alone
    moe = sum(map(c.is_moe, range(c.n_layer))) / c.n_layer
    exposed += 2 * passes * (ep - 1) / ep * h * c.experts_per_token * bT / link(target.gpus) * moe
    # c = u × r (parallel.py): Ulysses' all-to-alls over its u neighbours wait; the ring's sends,
    # across the u-strided ranks (the whole cp span), hide behind attention: r - 1 a pass of the
    # ring rank's S/r tokens of K/u kv heads, as many bytes as T tokens of all K
    r = parallel.ring_size(cp, layout['cp_impl'], layout['cp_ring'])
    u = cp // r
    exposed += 4 * attention_passes * (u - 1) / u * (2 * q + 2 * kv) / t * bT / link(t * u)
    hidden = (attention_passes + 1) * (r - 1) * 2 * kv / t * bT / link(t * cp)
    # a micro-batch's FSDP2 gathers and reduce-scatter, or the step's all-reduce; the states' rows
    # over PCIe
    d, N = dp * cp, num_params(c) / (t * pp)
    runs = c.n_layer / pp * M
    hidden *= runs
    # (b·N gathered once, twice for zero 3, 4·N reduce-scattered; the all-reduce's 8·N: nothing
    # where d is 1)
    sends = M * (2 * (1 + (layout['zero'] == 3)) + 4) if layout['zero'] else 8
    hidden += sends * N * (d - 1) / d / link(target.gpus)
    if layout['offload_states']:
        hidden += M * 12 * N / d / PCIE
    seconds = compute + exposed * runs + max(0.0, hidden - compute)
    return seconds * (M + pp - 1) / M


def fastest(c, layout, seq_len, target, least=False):
    """The Plan of least step time of layout at seq_len, or None; of equal times the smallest,
    then the one of most chunks (headroom at the moments other than the estimate's peak)."""
    # (the chunks' values: memory.variants' largest is 4x the automatic count, 0)
    return min(plans(c, layout, seq_len, target, least), default=None,
               key=lambda p: (p.seconds, p.device, -p.config.loss_chunks - p.config.mlp_chunks))


def longest(c, layout, target, step):
    """The fastest Plan at the longest multiple of step that fits layout, or None: lengths doubled
    while they fit, then the gap halved (fitting only gets harder with length)."""
    lo, hi = 0, step
    while fastest(c, layout, hi, target, least=True):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fastest(c, layout, mid, target, least=True):
            lo = mid
        else:
            hi = mid
    return fastest(c, layout, lo, target) if lo else None


def search(c, target, step, seq_len=None):
    """Every layout's best Plan: the longest (seq_len None), longest first, or the fastest at
    seq_len; of equal lengths the fastest first, then the one that needs least host memory and
    least GPU memory."""
    found = [fastest(c, layout, seq_len, target) if seq_len else longest(c, layout, target, step)
             for layout in layouts(c, target)]
    return sorted(filter(None, found), key=lambda p: (-p.seq_len, p.seconds, p.host, p.device))


def tokens_per_s(p, target):
    tokens = target.settings['batch_size'] * p.layout['gradient_accumulation_steps'] * p.seq_len
    return p.layout['dp'] * tokens / p.seconds


def keys(p):
    """Plan p's keys: the layout (train.py's keys, and dp), then the memory knobs."""
    return {**p.layout, **{k: getattr(p.config, k) for k in KNOBS}}


def command(p, argv):
    """train.py's keys for plan p after argv (the user's): the layout, the knobs, the length."""
    chosen = [f'--{k}={v!r}' for k, v in keys(p).items() if k != 'dp']
    return argv + chosen + [f'--seq_len={p.seq_len}']


def dry_run(p, target, argv):
    """train.py's dry run of plan p, rank 0 of the world on this CPU: (fits, bytes a GPU with
    the overhead, host bytes a node)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, 'train.py', *command(p, argv),
               '--dry_run=True', f'--memory_budget_gb={target.gpu_bytes / GiB}',
               f'--host_memory_budget_gb={target.host_bytes / target.per_node / GiB}',
               f'--out_dir={out}']
        run = subprocess.run(cmd, env={**os.environ, 'WORLD_SIZE': str(target.gpus)},
                             capture_output=True, text=True)
        if run.returncode:
            die(f"the dry run failed: {' '.join(cmd)}: {run.stderr.strip()[-300:]}")
        report = json.loads(Path(out, 'memory.json').read_text())
    rank, host = report['ranks'][0], report.get('host', {}).get('measured', 0)
    return report['fits'], rank['measured']['total'] + rank['overhead'], host * target.per_node


def confirm(c, p, target, step, argv, longest_mode):
    """Plan p as the dry run confirms it, or None. In the longest search the dry run has the last
    word on the length: the layout is searched again with the GPU's memory scaled by what the
    estimate missed (estimate over dry run). Where the dry run said no, that length (or one step
    shorter) is tried, until one fits; where it said yes, a longer one, until one does not."""
    good = None
    while p:
        ok, device, host = dry_run(p, target, argv)
        print(f"dry run: {name(p)} at {p.seq_len:,} tokens: {device / GiB:.2f} GiB a GPU "
              f"(estimate {p.device / GiB:.2f}), {host / GiB:.2f} GiB of host a node: "
              f"{'fits' if ok else 'does not fit'}", flush=True)
        if ok:
            good = p
        if not longest_mode or good and not ok:
            return good
        scaled = target._replace(gpu_bytes=target.gpu_bytes * p.device / device)
        q = longest(c, p.layout, scaled, step)
        if ok and (not q or q.seq_len <= p.seq_len):
            return good  # the dry run's margin holds no more steps
        if not ok and (not q or q.seq_len >= p.seq_len):
            q = fastest(c, p.layout, p.seq_len - step, target)
        p = q
    return good


def name(p):
    """The layout and knobs that differ from train.py's defaults: 'cp_size=8 zero=3 ...'."""
    return ' '.join(f'{k}={v}' for k, v in keys(p).items() if v != getattr(train, k, None))


def draw(c, target, path):
    """plan.svg: the longest length against the GPUs (1 to 64, 8 a node), a line per GPU memory
    (24, 80, 141 GB), each GPU with the target's host memory. Hand-written SVG, log2 axes."""
    colors = {24: 'green', 80: 'blue', 141: 'red'}
    per_gpu = target.host_bytes / target.per_node
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="800" height="400" '
           'font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20">the longest sequence that fits (plan.py), by GPUs (x, 8 a node); '
           f'{per_gpu / GiB:.0f} GiB of host memory a GPU</text>']
    out += [f'<text x="{75 + 100 * i}" y="380">{n}</text>' for i, n in enumerate(POWERS)]
    for gb, color in colors.items():
        points = []
        for i, n in enumerate(POWERS):
            per_node = min(n, 8)
            t = target._replace(gpus=n, per_node=per_node, gpu_bytes=gb * GiB,
                                host_bytes=per_gpu * per_node)
            length = max((p.seq_len for p in search(c, t, 8192 * n)), default=0)
            if length:
                # 8,192 tokens at the bottom, 2^30 at the top
                x, y = 80 + 100 * i, 350 - 300 * (math.log2(length) - 13) / 17
                points.append(f'{x},{y:.0f}')
                out.append(f'<text x="{x}" y="{y - 4:.0f}" fill="{color}" font-size="9">'
                           f'{length / 1e6:.2f}M</text>')
            print(f"plan.svg: {gb} GB x {n}: {length:,} tokens", flush=True)
        out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}"/>')
        out.append(f'<text x="720" y="{points[-1].split(",")[1]}" fill="{color}">{gb} GB</text>')
    Path(path).write_text('\n'.join(out + ['</svg>']))


def main():
    argv = sys.argv[1:]
    cfg = configure({**vars(train), **KEYS}, argv)
    # train.py's keys, for its command line: all but plan.py's own
    passed = [a for a in argv if a[2:].partition('=')[0] not in [*KEYS, 'seq_len']]
    # the fastest at the command line's --seq_len; without it, the longest
    seq_len = cfg['seq_len'] if any(a.startswith('--seq_len=') for a in argv) else None
    check(cfg, RULES)
    n, nodes = cfg['gpus'], cfg['nodes']
    if n % nodes:
        die(f"gpus={n} must be a multiple of nodes={nodes}")
    per_node = n // nodes
    settings = {k: cfg[k] for k in ('batch_size', 'pp_schedule', 'gradient_accumulation_steps',
                                    'doc_mask', 'optimizer')}
    settings.update(dtype='bfloat16', device_type='cuda')
    target = Target(n, per_node, cfg['gpu_gb'] * GiB, (cfg['host_gb'] or 256 * per_node) * GiB,
                    cfg['peak_tflops'] * 1e12, settings)
    try:
        c = Knobs(**{f.name: cfg[f.name] for f in fields(Knobs) if cfg[f.name] is not None})
    except ValueError as e:
        die(e)
    step = cfg['step'] or 8192 * n
    start = time.time()
    ranked = search(c, target, step, seq_len)
    what = f"the longest in steps of {step:,}, longest first"
    if seq_len:
        what = f"at {seq_len:,} tokens, fastest first"
    print(f"{len(ranked)} layout(s) fit on {n} x {cfg['gpu_gb']:g} GB "
          f"({target.host_bytes / GiB:,.0f} GiB of host a node; searched in "
          f"{time.time() - start:.1f} s), {what}:")
    print(f"{'tokens':>13s} {'GiB a GPU':>10s} {'host a node':>12s} {'tokens/s':>10s}  plan")
    for i, p in enumerate(ranked[:10], 1):
        print(f"{i:2d} {p.seq_len:>10,} {p.device / GiB:>10.2f} {p.host / GiB:>12.2f} "
              f"{tokens_per_s(p, target):>10,.0f}  {name(p)}")
    # the winner, then each next plan the best confirmed doesn't beat by 3% (the runner-up within
    # 3%; the next where the dry run cut the winner's length)
    best = None
    for p in ranked:
        if best and seq_len and p.seconds > 1.03 * best.seconds:
            break
        if best and not seq_len and p.seq_len < 0.97 * best.seq_len:
            break
        q = confirm(c, p, target, step, passed, not seq_len)
        if q:
            # the longest confirmed, of equal lengths the fastest (of equals, the earlier)
            best = min(filter(None, (best, q)), key=lambda p: (-p.seq_len, p.seconds))
    if not best:
        die("no plan fits" + " (by dry run)" * bool(ranked))
    launch = ['python']
    if n > 1:
        launch = ['torchrun', f'--nproc_per_node={per_node}']
    if nodes > 1:
        launch.append(f'--nnodes={nodes}')
    print(f"the plan: {best.seq_len:,} tokens, {tokens_per_s(best, target):,.0f} tokens/s "
          f"predicted:\n  " + ' '.join(launch + ['train.py'] + command(best, passed)))
    if cfg['svg']:
        draw(c, target, cfg['svg'])
        print(f"wrote {cfg['svg']}")


if __name__ == '__main__':
    main()
