"""
Benchmark of the memory knobs on the CPU (issue 3, "Benchmark"); prints a markdown table with the
command, machine, torch version, date and load averages; --results=bench/RESULTS.md appends it there as a
new section (bench/RESULTS.md is curated by hand: one section per claim).

  --mode=step  one training step (forward + backward + AdamW step) of a 2-layer Llama, width 256,
               4 heads (4 kv heads), intermediate 768, vocabulary 128,256, batch 1, fp32, at each of
               --seq_lens, for the variants
                 plain              recompute='none', mlp_chunks=1, loss_chunks=1
                 recompute          recompute='full', mlp_chunks=1, loss_chunks=1
                 chunked+recompute  recompute='full', mlp_chunks=0, loss_chunks=0 (automatic)
                 +heads             that, and attention_chunks=0 (one head group at a time)
               with the model's and the hardware's GFLOP/s (model.flops_per_token, knobs.hardware_flops: attention's
               groups run their forward again in backward, counted in the hardware's)
  --mode=loss  the LM head + loss alone, forward + backward, N=8192 tokens, D=256, V=128,256:
               ours chunked_cross_entropy (automatic chunks: 256 tokens each here, and 384-token
               chunks), torch F.linear_cross_entropy with LinearCrossEntropyOptions (batch_chunk_size
               256 and 384, and the defaults), plain F.cross_entropy(h @ W.T), and the three unavoidable
               matmuls alone (logits, input grad, weight grad, full size, no_grad).
  --mode=docs  packed documents (doc_mask, issue 29) and sliding windows (issue 39): the attention
               core alone, forward + backward, of one sequence of S tokens (batch 1, fp32, --q_heads
               query heads sharing --kv_heads kv heads of --head_dim: by default one of Llama-3-8B's
               8 kv-head groups, 4 q heads on 1 kv head of 128) at each of --seq_lens, cut into each
               of --documents documents (0: no mask, plain causal SDPA): n - 1 distinct cut points
               drawn at random (--seed), so the lengths are roughly exponential with mean S/n, as
               packing real documents gives; under each of --windows sliding windows W (a query
               sees the last W keys of its document, itself included; 0: none, full causal). Each
               run twice: in one process (model.attention: one SDPA call a document, per_document's;
               --one_process=False skips it, --cp=0 skips the ring) and as ring attention over --cp
               gloo processes (ring.RingAttention on each rank's zigzag shard), every process with
               --rank_threads threads. Default 1: the ring has cp times the cores, its ideal cp
               times the tokens/s; one thread a process because on a 2-core machine a 2-thread
               process is many times slower once anything else runs, its OpenMP threads waiting on
               each other (--cp=0 --rank_threads=2: one process on 2 threads). tokens/s = S / the
               median of --reps timed runs after one warm-up run (a ring run's time: its slowest
               rank's, the ranks started together by a barrier); "vs full causal" divides it by the
               same run's tokens/s with no mask and no window at that S. Bytes sent (the ring's):
               what the busiest rank's ring.ring_shift calls sent in one forward + backward (the
               max over ranks, as the time is the slowest rank's), each call that goes to another
               rank and has tokens counting its x's bytes: k, v forward, k, v again and dk, dv
               backward. Beside it the CPU time a run took (time.process_time, the ring's summed
               over its ranks): what the work costs whatever else shares the machine, where the wall
               time of a ring that needs every core is spoilt by any other process. The checksum,
               the sum of the output's squares (the ring's: over its ranks), is the same for every
               run of one S and window and, no mask and 1 document being the same attention, for
               those two.
  --mode=moe   mixture of experts (issue 40): training steps (forward + backward + AdamW step, fp32)
               of config/train_tiny.py's model and batch (4 layers, h 128, 16 x 256 tokens, the
               byte vocabulary of 256) with, as each block's MLP, the variants
                 dense               train_tiny's SwiGLU, I = 384
                 8 experts, top 2    moe.py's MoE, 8 experts of I = 384 / 2 (Mixtral's shape)
                 32 experts, top 4   32 experts of I = 384 / 4 (fine-grained: Qwen3-MoE, DeepSeek)
               each MoE computing k experts of I/k a token: the dense MLP's active FLOPs (and a
               router of h·E). mlp_chunks=1 (train_tiny's: unchunked). Each variant runs --rounds
               times in a fresh process, the variants in turn within a round; a run is one
               warm-up step, then --reps timed ones. Reported: the median of a variant's timed
               steps and its ratio to the dense one's (the issue's goal: at most 1.15). --label
               names the code in the title: to time another checkout's moe.py, run this file
               from a copy of that checkout (bench.py imports the model from its own folder).

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
    python bench.py --mode=docs --seq_lens=4096,16384
    python bench.py --mode=moe --reps=5 --rounds=3

Issue 39's figure, the ring alone, full causal against a sliding window of 4,096: --mode=docs
--seq_lens=65536 --documents=0 --windows=0,4096 --cp=4 --one_process=False.
"""
import ctypes
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from configurator import check, configure, die, writable

# -----------------------------------------------------------------------------
mode = 'step'                 # 'step' | 'loss' | 'docs' | 'moe'
seq_lens = '2048,8192'        # step and docs modes: comma-separated
variants = ''                 # comma-separated subset of the mode's variants; '' = all
n_layer, n_embd, n_head, n_kv_head, intermediate_size, vocab_size = 2, 256, 4, 4, 768, 128256
batch_size = 1                # step mode: sequences per step (train_tiny's shape: 16 x 256)
loss_tokens = 8192            # loss mode: N
reps = 3                      # loss, docs and moe modes: timed runs per variant and round (median)
rounds = 1                    # loss and moe modes: rounds over the variants (a fresh process per variant and round)
slow_reps = 1                 # loss mode: timed runs for the slow variants (plain, torch LCE default)
warmup = 'cheap'              # step mode: 'cheap' (see above) | 'full' (one whole step first)
mem_limit_gb = 20.0           # estimated logits above this: reported OOM, not run (box: 23 GiB RAM)
threads = 0                   # torch.set_num_threads; 0 = torch's default
documents = '0,1,16,1000'     # docs mode: documents per sequence, comma-separated; 0 = no mask
windows = '0'                 # docs mode: sliding windows W, comma-separated; 0 = none (causal)
q_heads, kv_heads, head_dim = 4, 1, 128  # docs mode: one of Llama-3-8B's 8 kv-head groups
cp = 2                        # docs mode: ring attention's ranks (0: one process only)
one_process = True            # docs mode: time model.attention in one process too (False: ring only)
rank_threads = 1              # docs mode: threads of each process, the one and each ring rank
label = ''                    # moe mode: what code ran, for the table's title (e.g. "before: main's moe.py")
results = ''  # 'bench/RESULTS.md': append the table there as a new section (then curate it)
worker = ''                   # internal: run one variant in this process and print JSON
seed = 1337
# -----------------------------------------------------------------------------
configure(globals())


def ints(text):
    """The whole numbers of a comma-separated list ('2048,8192'; blanks between commas skipped)."""
    return [int(s) for s in str(text).split(',') if s.strip()]


def ints_at_least(text, least):
    """Whether text is a comma-separated list of whole numbers, each >= least ('' holds none):
    what ints() reads without a ValueError."""
    items = [s.strip() for s in str(text).split(',') if s.strip()]
    return all(s.isdecimal() and int(s) >= least for s in items)


def appendable(path):
    """Whether the table can be appended to path: a file we can write, or one we could create (its
    folder made as needed). Checked before the benchmark: a traceback after hours of it loses the
    table."""
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    return writable(os.path.dirname(os.path.abspath(path)))


# what each key allows, checked before any worker starts, in the driver and in each worker (a bad
# value would be a traceback, or an error in every row): configurator.check's rows (keys, what
# they allow, the check of one value), the cross-key ones after the keys they read
RULES = [
    ('mode', "must be 'step', 'loss', 'docs' or 'moe'",
     lambda v: v in ('step', 'loss', 'docs', 'moe')),
    ('warmup', "must be 'cheap' or 'full'", lambda v: v in ('cheap', 'full')),
    ('n_layer n_embd n_head n_kv_head intermediate_size vocab_size batch_size loss_tokens reps '
     'rounds slow_reps q_heads kv_heads head_dim rank_threads', 'must be >= 1', lambda v: v >= 1),
    ('threads cp mem_limit_gb', 'must be >= 0', lambda v: v >= 0),
    # torch's generators and numpy's take 64 bits, and no sign
    ('seed', 'must be in [0, 2**63)', lambda v: 0 <= v < 2 ** 63),
    ('seq_lens', 'must be comma-separated whole numbers >= 1', lambda v: ints_at_least(v, 1)),
    ('documents windows', 'must be comma-separated whole numbers >= 0 (0: none)',
     lambda v: ints_at_least(v, 0)),
    # SDPA's grouped-query attention shares each kv head among q_heads / kv_heads query heads
    ('q_heads', f'must be a multiple of kv_heads={kv_heads}', lambda v: v % kv_heads == 0),
    ('cp', 'must be >= 1 with one_process=False (else nothing runs)',
     lambda v: one_process or v >= 1),
    # the ring's zigzag shard cuts a sequence into 2 * cp equal chunks
    ('seq_lens', f'must be multiples of 2 * cp = {2 * cp} in docs mode (the ring\'s chunks)',
     lambda v: mode != 'docs' or all(S % max(1, 2 * cp) == 0 for S in ints(v))),
    # n documents are n - 1 distinct cut points among a sequence's S - 1
    ('documents', f'must be at most the shortest of seq_lens={seq_lens!r} in docs mode',
     lambda v: mode != 'docs' or all(n <= S for n in ints(v) for S in ints(seq_lens))),
    ('results', "must be '' or a file we can append to, or create",
     lambda v: not v or appendable(v))]
check(globals(), RULES)
# (imported after the table: a refused key is said without the second this import takes)
from model import LlamaConfig  # noqa: E402
try:
    # the model's own rules (n_embd by n_head, ...), here rather than in every worker's row
    LlamaConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
                intermediate_size=intermediate_size, vocab_size=vocab_size)
except ValueError as e:
    die(e)

STEP_VARIANTS = {  # name -> (recompute, mlp_chunks, loss_chunks, attention_chunks)
    'plain': ('none', 1, 1, 1),
    'recompute': ('full', 1, 1, 1),
    'chunked+recompute': ('full', 0, 0, 1),
    'chunked+recompute+heads': ('full', 0, 0, 0),
}
# moe mode: name -> (n_experts, experts_per_token, intermediate_size as a fraction of train_tiny's):
# each MoE computes k experts of I/k a token, the dense MLP's active FLOPs
MOE_VARIANTS = {
    'dense': (0, 1, 1),
    '8 experts, top 2': (8, 2, 2),
    '32 experts, top 4': (32, 4, 4),
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
    from knobs import Knobs, hardware_flops
    from model import Llama, flops_per_token
    import chunked
    import offload
    recompute, mlp_chunks, loss_chunks, attention_chunks = STEP_VARIANTS[name]
    torch.manual_seed(seed)
    cfg = Knobs(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                intermediate_size=intermediate_size, vocab_size=vocab_size,
                recompute=recompute, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks,
                attention_chunks=attention_chunks)
    # the techniques as train.py applies them in one process: chunked.py's modules, then offload's
    model = offload.apply(chunked.apply(Llama(cfg), cfg), cfg)
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
    return dict(peak=peak_rise(base), base=base, time=dt, tok_s=tok_s, loss=loss,
                mflops=flops_per_token(cfg, S) * tok_s, hflops=hardware_flops(cfg, S) * tok_s)


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


def tiny_shape():
    """config/train_tiny.py's model and batch (its byte vocabulary: 256)."""
    tiny = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config', 'train_tiny.py')) as f:
        exec(f.read(), tiny)
    return tiny


def moe_worker(name):
    """Training steps (forward + backward + AdamW) of train_tiny's model with variant `name`'s MLP:
    one warm-up step, then --reps timed ones."""
    from knobs import Knobs
    from model import Llama
    import chunked
    tiny = tiny_shape()
    E, k, fraction = MOE_VARIANTS[name]
    torch.manual_seed(seed)
    cfg = Knobs(n_layer=tiny['n_layer'], n_head=tiny['n_head'], n_kv_head=tiny['n_kv_head'],
                n_embd=tiny['n_embd'], intermediate_size=tiny['intermediate_size'] // fraction,
                vocab_size=256, n_experts=E, experts_per_token=k)
    # (the experts' grouped GEMM and the chunked loss, as train.py runs them)
    model = chunked.apply(Llama(cfg), cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)  # as train.py
    idx = torch.randint(0, 256, (tiny['batch_size'], tiny['seq_len'] + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss = step()
        ts.append(time.perf_counter() - t0)
    return dict(times=ts, loss=loss)


def in_rounds(names, shown):
    """{name: its runs}: --rounds rounds, each running every variant once in turn (a fresh process,
    the load average before it in r['load']), each run's times printed by shown(seconds)."""
    runs = {name: [] for name in names}
    for rnd in range(rounds):
        for name in names:
            load = loadavg()
            r = spawn(dict(name=name))
            r['load'] = load
            runs[name].append(r)
            print(f'round {rnd + 1}/{rounds} {name}: ' + (r['error'] if 'error' in r else
                  ', '.join(shown(x) for x in r['times'])), flush=True)
    return runs


def moe_table():
    """moe mode's rows: --rounds rounds, each running every variant once in turn (a fresh process),
    a variant's time the median of all its timed steps, and its ratio to the dense one's."""
    names = pick(MOE_VARIANTS)
    runs = in_rounds(names, lambda x: '%.1f ms' % (1e3 * x))
    tiny = tiny_shape()
    medians, rows = {}, []
    for name in names:
        E, k, fraction = MOE_VARIANTS[name]
        la = ' / '.join(r['load'] for r in runs[name])
        errors = [r['error'] for r in runs[name] if 'error' in r]
        if errors:
            rows.append(f'| {name} | - | error: {errors[0]} | - | - | {la} |')
            continue
        times = [x for r in runs[name] for x in r['times']]
        medians[name] = statistics.median(times)
        vs = '-'
        if 'dense' in medians:
            vs = f'{medians[name] / medians["dense"]:.3f}'
        rows.append(f'| {name} | {tiny["intermediate_size"] // fraction} | {1e3 * medians[name]:.1f} ms | '
                    f'{", ".join("%.1f" % (1e3 * x) for x in times)} | {vs} | {la} |')
        print(rows[-1], flush=True)
    return rows


def sequence_docs(S, n):
    """The starts of n documents in a sequence of S tokens (None: no mask): n - 1 distinct cut
    points at random, the same ones in every process (seeded)."""
    if n == 0:
        return None
    cuts = np.random.default_rng(seed).choice(np.arange(1, S), n - 1, replace=False)
    return np.concatenate([[0], np.sort(cuts)])


class CountingShift:
    """ring.ring_shift, counting the bytes this rank sends: a call's x where it goes to another
    rank (hop not 0 mod the world) and has tokens (ring_shift posts nothing for an empty side)."""

    def __init__(self, shift):
        self.shift = shift
        self.sent = 0

    def __call__(self, x, group, hop, size):
        import torch.distributed as dist
        if hop % dist.get_world_size(group) and x.shape[1]:
            self.sent += x.nelement() * x.element_size()
        return self.shift(x, group, hop, size)


def docs_worker(S, n, window, rank, world, init):
    """Forward + backward of the attention core under sliding window `window` (0: none):
    model.attention in one process (world 0), or this rank's share of ring attention over `world`
    gloo processes, with the bytes its ring_shift calls sent in one run."""
    from model import attention
    import ring
    import torch.distributed as dist
    # ring.py looks ring_shift up in its module at each call: ours counts, then shifts
    shift = CountingShift(ring.ring_shift)
    ring.ring_shift = shift
    g = torch.Generator().manual_seed(seed)
    # [B, S, heads, hd] as the projections make them, every rank the whole sequence (seeded alike)
    q = torch.randn(1, S, q_heads, head_dim, generator=g)
    k = torch.randn(1, S, kv_heads, head_dim, generator=g)
    v = torch.randn(1, S, kv_heads, head_dim, generator=g)
    dy = torch.randn(1, S, q_heads, head_dim, generator=g)
    docs = sequence_docs(S, n)
    if world:
        dist.init_process_group('gloo', init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=1800))
        # our zigzag shard, chunks rank and 2·world-1-rank of 2·world (parallel.shard_batch)
        ours = torch.arange(S).view(2 * world, -1)[[rank, -1 - rank]].flatten()
        q, k, v, dy = (t[:, ours] for t in (q, k, v, dy))
    # -> [B, heads, S, hd], transposed views as the model's attention gets them
    q, k, v, dy = (t.transpose(1, 2) for t in (q, k, v, dy))
    for t in (q, k, v):
        t.requires_grad_()

    def run():
        for t in (q, k, v):
            t.grad = None
        shift.sent = 0
        if world:
            y = ring.RingAttention.apply(dist.group.WORLD, q, k, v, docs, window)
        else:
            y = attention(q, k, v, docs, window)
        y.backward(dy)
        return y

    run()  # warm-up
    ts, cpu = [], []
    for _ in range(reps):
        if world:
            dist.barrier()  # the ranks start together: a run lasts until its slowest rank ends
        t0, c0 = time.perf_counter(), time.process_time()
        y = run()
        ts.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if world:
        dist.destroy_process_group()
    # every run sends the same: the last one's bytes
    return dict(times=ts, cpu=cpu, sent=shift.sent,
                checksum=y.detach().double().square().sum().item())


if worker:
    if threads:
        torch.set_num_threads(threads)
    w = json.loads(worker)
    if mode == 'docs':
        r = docs_worker(w['S'], w['n'], w['window'], w['rank'], w['world'], w['init'])
    elif mode == 'moe':
        r = moe_worker(w['name'])
    else:
        r = step_worker(w['name'], w['S']) if mode == 'step' else loss_worker(w['name'])
    print('RESULT ' + json.dumps(r), flush=True)
    sys.exit(0)

# ----------------------------------------------------------------------------- driver


def start(spec, n_threads=None):
    """Start a worker on spec; (process, its stdout, its stderr): files, not pipes, so that of two
    ranks waiting on each other neither blocks on a full pipe the driver is not reading yet."""
    args = [sys.executable, os.path.abspath(__file__), f'--mode={mode}',
            f'--worker={json.dumps(spec)}']
    for k in ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'intermediate_size', 'vocab_size',
              'batch_size', 'loss_tokens', 'reps', 'slow_reps', 'warmup', 'threads', 'seed',
              'q_heads', 'kv_heads', 'head_dim'):  # not rounds: the driver's
        value = globals()[k]
        args.append(f'--{k}={value!r}' if isinstance(value, str) else f'--{k}={value}')
    if n_threads is not None:  # after --threads: the last one counts
        args.append(f'--threads={n_threads}')
    out = tempfile.TemporaryFile('w+')
    err = tempfile.TemporaryFile('w+')
    p = subprocess.Popen(args, stdout=out, stderr=err, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return p, out, err


def finish(started):
    """Wait for a started worker; its RESULT, or its last line of stderr as the error."""
    p, out, err = started
    p.wait()
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close()
    err.close()
    for line in stdout.splitlines():
        if line.startswith('RESULT '):
            return json.loads(line[7:])
    return dict(error=(stderr.strip().splitlines() or [f'exit {p.returncode}'])[-1])


def spawn(spec, n_threads=None):
    return finish(start(spec, n_threads))


def gb(b):
    return f'{b / 1e9:.2f} GB'


def pick(all_names):
    names = [v.strip() for v in variants.split(',') if v.strip()] or list(all_names)
    for v in names:
        if v not in all_names:
            print(f'error: unknown variant {v!r}; one of {list(all_names)}', file=sys.stderr)
            sys.exit(2)
    return names


def wait_all(started):
    """Wait for every rank; a rank that failed has its partners killed (they would wait for it in
    a collective until gloo's timeout). Their results, or errors, in rank order."""
    while any(p.poll() is None for p, _, _ in started):
        if any(p.poll() not in (None, 0) for p, _, _ in started):
            for p, _, _ in started:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return [finish(s) for s in started]


def docs_cell(S, n, window, world):
    """A sequence of S tokens, n documents (0: no mask) under sliding window `window` (0: none) in
    one process (world 0) or on `world` ring ranks: dict(times, cpu, sent, checksum), a ring's
    times its slowest rank's in each run, its CPU times the sum of its ranks', its bytes sent
    its busiest rank's (one process: None); or dict(error)."""
    spec = dict(S=S, n=n, window=window, rank=0, world=world, init='')
    if not world:
        r = spawn(spec, rank_threads)
        if 'error' not in r:
            r['sent'] = None
        return r
    # gloo's ranks meet at a file of their own: no port to pick, none to collide with another's
    folder = tempfile.mkdtemp()
    spec['init'] = 'file://' + os.path.join(folder, 'store')
    started = [start(dict(spec, rank=r), rank_threads) for r in range(world)]
    ranks = wait_all(started)
    shutil.rmtree(folder, ignore_errors=True)
    failed = [r for r in ranks if 'error' in r]
    if failed:
        return failed[0]
    times = [max(run) for run in zip(*(r['times'] for r in ranks))]
    cpu = [sum(run) for run in zip(*(r['cpu'] for r in ranks))]
    return dict(times=times, cpu=cpu, sent=max(r['sent'] for r in ranks),
                checksum=sum(r['checksum'] for r in ranks))


def plural(n, word):
    return f'{n} {word}' if n == 1 else f'{n} {word}s'


def docs_row(S, cells, r, base, load):
    """One docs row: its first cells (seq_len, documents, window, run), then docs_cell's result r
    for S tokens, its tokens/s against `base` (None: no ratio), and the load average before it."""
    first = '| ' + ' | '.join(cells)
    if 'error' in r:
        return f'{first} | error: {r["error"]} | - | - | - | - | - | - | {load} |'
    t = statistics.median(r['times'])
    ratio = '-'
    if base:
        ratio = f'{S / t / base:.2f}'
    runs = ', '.join('%.2f' % x for x in r['times'])
    sent = '-'
    if r['sent'] is not None:
        sent = f'{r["sent"]:,}'
    cpu = statistics.median(r['cpu'])
    return (f'{first} | {t:.2f} s | {runs} | {S / t:,.0f} | {ratio} | {sent} '
            f'| {cpu:.2f} s | {r["checksum"]:.6g} | {load} |')


def docs_table():
    """docs mode's rows, printed as they come: each sequence length, each run (one process, then
    the ring), each sliding window, each document count."""
    counts = ints(documents)
    widths = ints(windows)
    labels = {}
    if one_process:
        labels[0] = f'1 process, {plural(rank_threads, "thread")}'
    if cp:
        labels[cp] = f'ring cp {cp}, {plural(rank_threads, "thread")} a rank'
    table = []
    for S in ints(seq_lens):
        for world in labels:
            full = None  # this run's tokens/s with no mask and no window, the ratio's base
            for window in widths:
                for n in counts:
                    load = loadavg()
                    r = docs_cell(S, n, window, world)
                    if n == 0 and window == 0 and 'error' not in r:
                        full = S / statistics.median(r['times'])
                    cells = [f'{S:,}', f'{n:,}' if n else 'no mask',
                             f'{window:,}' if window else 'none', labels[world]]
                    row = docs_row(S, cells, r, full, load)
                    print(row, flush=True)
                    table.append(row)
    return table


rows, loads = [], []
if mode == 'step':
    header = ('| seq_len | variant | peak RSS rise | tokens/s | model GFLOP/s | hardware GFLOP/s | step time '
              '| loss | load avg before |\n|---:|---|---:|---:|---:|---:|---:|---:|---|')
    for S in ints(seq_lens):
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
    runs = in_rounds(names, lambda x: '%.2f s' % x)
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
elif mode == 'docs':
    heads = f'{plural(q_heads, "q head")}, {plural(kv_heads, "kv head")}'
    header = (f'| seq_len (batch 1; {heads}, head_dim {head_dim}, '
              'fp32) | documents | window | run | fwd+bwd (median) | runs | tokens/s '
              '| vs full causal, no mask | bytes sent (fwd+bwd, busiest rank) '
              '| CPU time (median, all processes) | checksum (Σ y²) | load avg before |\n'
              '|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---|')
    rows = docs_table()
elif mode == 'moe':
    tiny = tiny_shape()
    header = (f'| {tiny["n_layer"]} layers, h {tiny["n_embd"]}, batch {tiny["batch_size"]} x '
              f'{tiny["seq_len"]}, fp32: MLP | I (an expert\'s) | step (median) | steps (ms) '
              '| vs dense | load avg before (each round) |\n|---|---:|---:|---|---:|---|')
    rows = moe_table()

if results:
    cmd = 'python ' + ' '.join(shlex.quote(a) for a in ['bench.py'] + sys.argv[1:])
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((l.split(':', 1)[1].strip() for l in f if l.startswith('model name')), cpu)
    except OSError:
        pass
    title = mode
    note = 'timings are indicative; peak RSS rises do not depend on the load'
    n_threads = f'{torch.get_num_threads()} threads'
    if mode == 'docs':  # no memory column; each run's threads are in its row
        title = ("Packed documents (issue 29), sliding windows (issue 39): attention's "
                 'throughput on a CPU')
        note = 'timings are indicative'
        n_threads = 'threads: the run column'
    if mode == 'moe':
        title = 'Mixture of experts (issue 40): a training step against the dense one of the same FLOPs'
        note = 'timings are indicative'
    if label:
        title += f' [{label}]'
    text = (f'\n## {title} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n'
            f'`{cmd}`\n\n'
            f'Machine: {os.cpu_count()}-core CPU ({cpu}), torch {torch.__version__} '
            f'({n_threads}), fp32, Linux {platform.release()}. '
            f'Other processes were sharing the CPU (load averages 1/5/15 min before each run in the last '
            f'column): {note}.\n\n'
            + header + '\n' + '\n'.join(rows) + '\n')
    os.makedirs(os.path.dirname(results) or '.', exist_ok=True)
    with open(results, 'a') as f:
        f.write(text)
    print(f'appended to {results}')
