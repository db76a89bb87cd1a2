"""
Benchmark of the memory knobs on the CPU (issue 3, "Benchmark"); prints a markdown table and appends
it, with the command, machine, torch version, date and load averages, to bench/RESULTS.md.

  --mode=step  one training step (forward + backward + AdamW step) of a 2-layer Llama, width 256,
               4 heads (4 kv heads), intermediate 768, vocabulary 128,256, batch 1, fp32, at each of
               --seq_lens, for the variants
                 plain              recompute='none', mlp_chunks=1, loss_chunks=1
                 recompute          recompute='full', mlp_chunks=1, loss_chunks=1
                 chunked+recompute  recompute='full', mlp_chunks=0, loss_chunks=0 (automatic)
                 +heads             that, and attention_chunks=0 (one head group at a time)
               with the model's and the hardware's GFLOP/s (model.flops_per_token: attention's
               groups run their forward again in backward, counted in the hardware's)
  --mode=loss  the LM head + loss alone, forward + backward, N=8192 tokens, D=256, V=128,256:
               ours chunked_cross_entropy (automatic chunks: 256 tokens each here, and 384-token
               chunks), torch F.linear_cross_entropy with LinearCrossEntropyOptions (batch_chunk_size
               256 and 384, and the defaults), plain F.cross_entropy(h @ W.T), and the three unavoidable
               matmuls alone (logits, input grad, weight grad, full size, no_grad).

How: every (variant, seq_len) runs in a fresh subprocess, so its peak resident set is its own.
  memory   peak RSS rise = VmHWM - VmRSS, with VmHWM reset (echo 5 > /proc/self/clear_refs) and freed
           heap handed back to the OS (malloc_trim) just before the measured work. step mode: after the
           model, AdamW state (created by an optimizer step on zero gradients, which leaves Adam's
           update at 0) and a short 256-token warm-up step exist, so the rise is activations, logits,
           gradients and the optimizer's transients. --warmup=full instead runs one whole step at the
           measured seq_len first.
  time     step mode: the one measured step -> tokens/s. loss mode: the median of --reps runs (the
           first one included: it is also the one the memory peak covers) in each of --rounds rounds;
           a round runs every variant once, in turn, so a shared machine's drift hits them all alike.
A variant whose loss path keeps the full logits (loss_chunks=1) is not run when its estimate
3 * S * V * 4 bytes (fp32 logits, the log-softmax kept for backward, and their gradient) exceeds
--mem_limit_gb: it is reported as "OOM (est. X GB)".

The machine may be shared: timings are indicative (the load average before each run is recorded),
memory figures do not depend on the load.

    python bench.py --mode=step --seq_lens=2048,8192
    python bench.py --mode=loss
"""
import ctypes
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from configurator import configure

# -----------------------------------------------------------------------------
mode = 'step'                 # 'step' | 'loss'
seq_lens = '2048,8192'        # step mode: comma-separated
variants = ''                 # comma-separated subset of the mode's variants; '' = all
n_layer, n_embd, n_head, n_kv_head, intermediate_size, vocab_size = 2, 256, 4, 4, 768, 128256
batch_size = 1                # step mode: sequences per step (train_tiny's shape: 16 x 256)
loss_tokens = 8192            # loss mode: N
reps = 3                      # loss mode: timed runs per variant and round (median)
rounds = 1                    # loss mode: rounds over the variants (a fresh process per variant and round)
slow_reps = 1                 # loss mode: timed runs for the slow variants (plain, torch LCE default)
warmup = 'cheap'              # step mode: 'cheap' (see above) | 'full' (one whole step first)
mem_limit_gb = 20.0           # estimated logits above this: reported OOM, not run (box: 23 GiB RAM)
threads = 0                   # torch.set_num_threads; 0 = torch's default
results = 'bench/RESULTS.md'  # '' = print only
worker = ''                   # internal: run one variant in this process and print JSON
seed = 1337
# -----------------------------------------------------------------------------
configure(globals())

STEP_VARIANTS = {  # name -> (recompute, mlp_chunks, loss_chunks, attention_chunks)
    'plain': ('none', 1, 1, 1),
    'recompute': ('full', 1, 1, 1),
    'chunked+recompute': ('full', 0, 0, 1),
    'chunked+recompute+heads': ('full', 0, 0, 0),
}
LOSS_VARIANTS = ['ours chunked (auto)', 'ours chunked (384 tokens)', 'torch LCE chunk=256',
                 'torch LCE chunk=384', 'torch LCE default', 'plain F.cross_entropy(h@W.T)', '3 matmuls alone']
SLOW = {'torch LCE default', 'plain F.cross_entropy(h@W.T)'}


def status(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024
    return 0


def start_peak():
    """Hand freed heap back, reset VmHWM; returns the RSS the rise is measured from."""
    try:
        ctypes.CDLL('libc.so.6').malloc_trim(0)
    except OSError:
        pass
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return status('VmRSS')


def peak_rise(base):
    return status('VmHWM') - base


def loadavg():
    with open('/proc/loadavg') as f:
        return ' '.join(f.read().split()[:3])


# ----------------------------------------------------------------------------- workers (one process each)

def step_worker(name, S):
    from model import Llama, LlamaConfig, flops_per_token
    import offload
    recompute, mlp_chunks, loss_chunks, attention_chunks = STEP_VARIANTS[name]
    torch.manual_seed(seed)
    cfg = LlamaConfig(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                      intermediate_size=intermediate_size, vocab_size=vocab_size,
                      recompute=recompute, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                      attention_chunks=attention_chunks)
    model = offload.apply(Llama(cfg))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)  # as train.py
    idx = torch.randint(0, vocab_size, (batch_size, S + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    if warmup == 'full':
        step(x, y)
    else:  # AdamW state without a full-size step, then a short step to warm the kernels up
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step(x[:, :256], y[:, :256])
    base = start_peak()
    t0 = time.perf_counter()
    loss = step(x, y)
    dt = time.perf_counter() - t0
    tok_s = batch_size * S / dt
    model_flops, hardware_flops = flops_per_token(cfg, S)
    return dict(peak=peak_rise(base), base=base, time=dt, tok_s=tok_s, loss=loss,
                mflops=model_flops * tok_s, hflops=hardware_flops * tok_s)


def loss_worker(name):
    from chunked import chunked_cross_entropy
    N, D, V = loss_tokens, n_embd, vocab_size
    torch.manual_seed(seed)
    h = (torch.randn(N, D) * 0.5).requires_grad_()
    W = (torch.randn(V, D) * 0.05).requires_grad_()
    t = torch.randint(0, V, (N,))

    def fb(fn):
        def run():
            h.grad = W.grad = None
            fn().backward()
        return run

    def mm3():
        with torch.no_grad():
            L = h @ W.t()
            dh = L @ W  # noqa: F841
            dW = L.t() @ h  # noqa: F841

    LCE = torch.nn.LinearCrossEntropyOptions
    fns = {
        'ours chunked (auto)': fb(lambda: chunked_cross_entropy(h, W, t, 0)),
        'ours chunked (384 tokens)': fb(lambda: chunked_cross_entropy(h, W, t, math.ceil(N / 384))),
        'torch LCE chunk=256': fb(lambda: F.linear_cross_entropy(
            h, W, t, options=LCE(batch_chunk_size=256, chunking_method=None))),
        'torch LCE chunk=384': fb(lambda: F.linear_cross_entropy(
            h, W, t, options=LCE(batch_chunk_size=384, chunking_method=None))),
        'torch LCE default': fb(lambda: F.linear_cross_entropy(h, W, t, options=LCE())),
        'plain F.cross_entropy(h@W.T)': fb(lambda: F.cross_entropy(h @ W.t(), t)),
        '3 matmuls alone': mm3,
    }
    run = fns[name]
    n = slow_reps if name in SLOW else reps
    base = start_peak()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return dict(peak=peak_rise(base), base=base, times=ts, time=statistics.median(ts))


if worker:
    if threads:
        torch.set_num_threads(threads)
    w = json.loads(worker)
    r = step_worker(w['name'], w['S']) if mode == 'step' else loss_worker(w['name'])
    print('RESULT ' + json.dumps(r), flush=True)
    sys.exit(0)

# ----------------------------------------------------------------------------- driver


def spawn(spec):
    args = [sys.executable, os.path.abspath(__file__), f'--mode={mode}', f'--worker={json.dumps(spec)}']
    for k in ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'intermediate_size', 'vocab_size',
              'batch_size', 'loss_tokens', 'reps', 'slow_reps', 'warmup', 'threads', 'seed'):  # not rounds: the driver's
        args.append(f'--{k}={globals()[k]!r}' if isinstance(globals()[k], str) else f'--{k}={globals()[k]}')
    p = subprocess.run(args, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    for line in p.stdout.splitlines():
        if line.startswith('RESULT '):
            return json.loads(line[7:])
    return dict(error=(p.stderr.strip().splitlines() or [f'exit {p.returncode}'])[-1])


def gb(b):
    return f'{b / 1e9:.2f} GB'


def pick(all_names):
    names = [v.strip() for v in variants.split(',') if v.strip()] or list(all_names)
    for v in names:
        if v not in all_names:
            print(f'error: unknown variant {v!r}; one of {list(all_names)}', file=sys.stderr)
            sys.exit(2)
    return names


rows, loads = [], []
if mode == 'step':
    header = ('| seq_len | variant | peak RSS rise | tokens/s | model GFLOP/s | hardware GFLOP/s | step time '
              '| loss | load avg before |\n|---:|---|---:|---:|---:|---:|---:|---:|---|')
    for S in [int(s) for s in str(seq_lens).split(',') if s.strip()]:
        for name in pick(STEP_VARIANTS):
            la = loadavg()
            est = 3 * batch_size * S * vocab_size * 4
            if STEP_VARIANTS[name][2] == 1 and est > mem_limit_gb * 1e9:
                row = f'| {S:,} | {name} | OOM (est. {est / 1e9:.0f} GB logits > {mem_limit_gb:g} GB) | - | - | - | - | - | {la} |'
            else:
                r = spawn(dict(name=name, S=S))
                if 'error' in r:
                    row = f'| {S:,} | {name} | error: {r["error"]} | - | - | - | - | - | {la} |'
                else:
                    row = (f'| {S:,} | {name} | {gb(r["peak"])} | {r["tok_s"]:,.0f} | {r["mflops"] / 1e9:,.1f} '
                           f'| {r["hflops"] / 1e9:,.1f} | {r["time"]:.2f} s | {r["loss"]:.4f} | {la} |')
            print(row, flush=True)
            rows.append(row)
elif mode == 'loss':
    header = (f'| N={loss_tokens:,}, D={n_embd}, V={vocab_size:,} | peak RSS rise | time (median) | runs | load avg before |\n'
              '|---|---:|---:|---|---|')
    names = pick(LOSS_VARIANTS)
    runs = {name: [] for name in names}
    for rnd in range(rounds):
        for name in names:
            load = loadavg()
            r = spawn(dict(name=name))
            r['load'] = load
            runs[name].append(r)
            print(f'round {rnd + 1}/{rounds} {name}: ' + (r['error'] if 'error' in r else
                  ', '.join('%.2f s' % x for x in r['times'])), flush=True)
    for name in names:
        ok = [r for r in runs[name] if 'error' not in r]
        la = ' / '.join(r['load'] for r in runs[name]) if rounds == 1 else \
            '1-min %.2f to %.2f' % (min(float(r['load'].split()[0]) for r in runs[name]),
                                   max(float(r['load'].split()[0]) for r in runs[name]))
        if len(ok) < len(runs[name]):
            row = f'| {name} | error: {next(r["error"] for r in runs[name] if "error" in r)} | - | - | {la} |'
        else:
            times = [x for r in ok for x in r['times']]
            row = (f'| {name} | {gb(max(r["peak"] for r in ok))} | {statistics.median(times):.2f} s | '
                   f'{", ".join("%.2f" % x for x in times)} | {la} |')
        print(row, flush=True)
        rows.append(row)
else:
    print(f"error: mode must be 'step' or 'loss', got {mode!r}", file=sys.stderr)
    sys.exit(2)

if results:
    cmd = 'python ' + ' '.join(shlex.quote(a) for a in ['bench.py'] + sys.argv[1:])
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((l.split(':', 1)[1].strip() for l in f if l.startswith('model name')), cpu)
    except OSError:
        pass
    text = (f'\n## {mode} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n'
            f'`{cmd}`\n\n'
            f'Machine: {os.cpu_count()}-core CPU ({cpu}), torch {torch.__version__} '
            f'({torch.get_num_threads()} threads), fp32, Linux {platform.release()}. '
            f'Other processes were sharing the CPU (load averages 1/5/15 min before each run in the last '
            f'column): timings are indicative; peak RSS rises do not depend on the load.\n\n'
            + header + '\n' + '\n'.join(rows) + '\n')
    os.makedirs(os.path.dirname(results) or '.', exist_ok=True)
    with open(results, 'a') as f:
        f.write(text)
    print(f'appended to {results}')
