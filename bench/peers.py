"""
nanolong side by side with what a user would train the same Llama with instead (issue 40): the same
weights, length, batch and optimizer, one training step each, tokens/s and peak memory.

  hf plain         transformers' LlamaForCausalLM (SDPA attention), its own loss (labels)
  hf checkpointed  the same after model.gradient_checkpointing_enable(): each layer's forward
                   again in backward, transformers' recipe for long sequences
  ours plain       model.Llama with recompute='none', mlp_chunks=1, loss_chunks=1
  ours chunked     recompute='full' and automatic chunks (mlp_chunks=0, loss_chunks=0): the
                   laptop's long-context recipe (README)
and on a CUDA GPU (--device=cuda) also
  hf + liger       the checkpointed HF model with liger-kernel's Llama kernels (apply_liger_kernel_
                   to_llama: RMSNorm, RoPE, SwiGLU, and the fused linear cross-entropy, which never
                   holds the logits), the library long-context fine-tuning reaches for
(torchtitan, the issue's other GPU peer, is not here: its 0.3 builds a model from its own config
registry and trainer, with imports of its distributed stack that a lone process can't satisfy;
its own `torchrun ... -m torchtitan.train` at the same shape is the comparison to make.)

The model: --shape=tiny (a Llama of width 256, 2 layers, 4 heads, intermediate 768, vocabulary
128,256 as Llama 3's: bench.py's step shape, where the LM head and the loss are most of the work,
as in a long-context step of a small model), 1b (Llama-3.2-1B's: 16 layers of 2,048, 32 heads, 8 kv
heads, intermediate 8,192) or 8b (Llama-3-8B's blocks: 32 layers of 4,096, 32/8 heads, intermediate
14,336), fp32 on a CPU, bf16 on a GPU. Weights: ours, initialised with --seed, written once as a
Hugging Face directory (model.save_pretrained) that every process loads, so the first step's losses
agree (the loss column). Optimizer: torch's fused AdamW for every system (lr 1e-4, weight decay 0.1:
train.py's).

How each figure is taken. Every (system, length) runs in a process of its own, --rounds times, the
systems in turn within a round (a shared machine's drift hits them all alike); a process loads the
model, makes AdamW's state (a step on zero gradients) and runs one untimed step at the length
(kernels' first use at its shapes), then times --steps steps (forward, backward, AdamW,
zero_grad, loss.item()). tokens/s = tokens over the median of the rounds' steps. Peak: on a CPU the rise of the resident set over the model and
its states (VmHWM reset just before the timed steps, freed heap handed back first: bench.py's
way), the largest of the rounds; on a GPU torch.cuda.max_memory_allocated's rise over the same baseline. On a
2-core machine time with nothing else running: a second job halves a figure.

--mem_gb: after the table, for each system the longest length whose step's peak stays within it
(lengths doubling from 1,024 up to --max_len; a length is skipped, and the search ends, when the
last two measured peaks, extrapolated linearly, already exceed it by a fifth: this box's 24 GiB is
not to be run into). --mem_gb=0 skips the search. The table is printed with the command, machine,
versions and load averages; --results=bench/RESULTS.md appends it there as a new section.

Install the peers first (not in requirements.txt):
    pip install transformers                    # the CPU comparison
    pip install liger-kernel                    # on a CUDA machine, for --device=cuda

    python bench/peers.py                                      # CPU: 2,048 / 8,192 / 16,384
    python bench/peers.py --seq_lens=2048,8192 --rounds=5 --mem_gb=4
    python bench/peers.py --device=cuda --shape=1b --seq_lens=32768,131072 --mem_gb=140
"""
import ctypes
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configurator import check, configure, has_device  # noqa: E402

# -----------------------------------------------------------------------------
device = 'cpu'                   # 'cpu' | 'cuda'
shape = 'tiny'                   # 'tiny' | '1b' | '8b'
seq_lens = '2048,8192,16384'     # comma-separated; batch 1
systems = ''                     # comma-separated subset of the device's systems; '' = all
rounds = 3                       # processes per (system, length)
steps = 2                        # timed steps in each process; the median of all is reported
mem_gb = 0.0                     # the longest length each fits in this much; 0 = no search
max_len = 65536                  # the search's longest length
threads = 0                      # torch.set_num_threads; 0 = torch's default
results = ''  # 'bench/RESULTS.md': append the table there as a new section (then curate it)
model_dir = ''                   # internal: the HF directory the workers load
worker = ''                      # internal: run one (system, length) here and print JSON
seed = 1337
# -----------------------------------------------------------------------------
configure(globals())

SHAPES = {  # n_layer, n_embd, n_head, n_kv_head, intermediate_size
    'tiny': (2, 256, 4, 4, 768),
    '1b': (16, 2048, 32, 8, 8192),
    '8b': (32, 4096, 32, 8, 14336),
}
SYSTEMS = ['hf plain', 'hf checkpointed', 'ours plain', 'ours chunked']
if device == 'cuda':
    SYSTEMS += ['hf + liger']
OURS = {'ours plain': dict(recompute='none', mlp_chunks=1, loss_chunks=1),
        'ours chunked': dict(recompute='full', mlp_chunks=0, loss_chunks=0)}
VOCAB = 128256


def ints_at_least(text, least):
    """Whether text is a comma-separated list of whole numbers, each >= least ('' holds none):
    what main() reads without a ValueError."""
    items = [s.strip() for s in str(text).split(',') if s.strip()]
    return all(s.isdecimal() and int(s) >= least for s in items)


def appendable(path):
    """Whether the table can be appended to path (from the repository's root): a file we can
    write, or one we could create in a folder we can write in. Checked before the runs: a
    traceback after them loses the table."""
    path = os.path.join(ROOT, path)
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    folder = os.path.dirname(path)
    return os.path.isdir(folder) and os.access(folder, os.W_OK)


# what each key allows, checked before anything runs, in the driver and in each worker (a bad
# value would be a traceback, or an error in every row): configurator.check's rows (keys, what
# they allow, the check of one value)
RULES = [
    ('shape', f"must be one of {', '.join(SHAPES)}", lambda v: v in SHAPES),
    ('device', "must be 'cpu' or 'cuda' (on a machine with a GPU)",
     lambda v: v in ('cpu', 'cuda') and has_device(v)),
    ('rounds steps max_len', 'must be >= 1', lambda v: v >= 1),
    ('threads mem_gb', 'must be >= 0', lambda v: v >= 0),
    # torch's generators take 64 bits, and no sign
    ('seed', 'must be in [0, 2**63)', lambda v: 0 <= v < 2 ** 63),
    ('seq_lens', 'must be comma-separated whole numbers >= 1', lambda v: ints_at_least(v, 1)),
    ('results', "must be '' or a file we can append to, or create",
     lambda v: not v or appendable(v))]
check(globals(), RULES)
if threads:
    torch.set_num_threads(threads)
DTYPE = torch.float32
if device == 'cuda':
    DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- memory
def status(key):
    """A field of /proc/self/status, in bytes."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024
    return 0


def start_peak():
    """The baseline the step's peak rises from: freed heap handed back, the high-water mark reset."""
    if device == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    ctypes.CDLL('libc.so.6').malloc_trim(0)
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return status('VmRSS')


def peak_rise(base):
    if device == 'cuda':
        return torch.cuda.max_memory_allocated() - base
    return status('VmHWM') - base


# ----------------------------------------------------------------------------- the systems
def hf_model(name):
    """transformers' Llama on our weights; `name` says which of its recipes."""
    from transformers import LlamaForCausalLM
    if name == 'hf + liger':
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        # patches LlamaForCausalLM's class: the model made next takes the kernels
        apply_liger_kernel_to_llama()
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation='sdpa', dtype=DTYPE)
    if name != 'hf plain':
        model.gradient_checkpointing_enable()
    model.config.use_cache = False

    def loss(x, y):
        # its own loss: labels given as already shifted (transformers' shift_labels)
        return model(input_ids=x, labels=y, shift_labels=y.contiguous()).loss

    return model, loss


def ours_model(name):
    import chunked
    import offload
    from knobs import with_knobs
    from model import Llama
    # the techniques as train.py applies them in one process: chunked.py's modules, then offload's
    model = Llama.from_pretrained(model_dir)
    knobs = with_knobs(model.config, **OURS[name])
    model = offload.apply(chunked.apply(model, knobs), knobs)

    def loss(x, y):
        return model(x, y)[1]

    return model, loss


def step_worker(name, S, warm=True):
    torch.manual_seed(seed)
    if name.startswith('ours'):
        model, loss_fn = ours_model(name)
    else:
        model, loss_fn = hf_model(name)
    model.to(device=device, dtype=DTYPE)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    idx = torch.randint(0, VOCAB, (1, S + 1), generator=torch.Generator().manual_seed(seed))
    idx = idx.to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    # AdamW's state without a full-size step (zero gradients: no update), then one untimed step at
    # the length: a matmul's first call at a new shape pays for its kernel's setup (HF's first
    # step at 2,048 tokens took 1.3x its second; ours, whose chunks have the warm-up's shapes, no
    # more), and a run of many steps pays it once. The longest-length search (warm=False)
    # measures memory only: a 256-token warm-up
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if warm:
        step(x, y)
    else:
        step(x[:, :256], y[:, :256])
    base = start_peak()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step(x, y))
        if device == 'cuda':
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = peak_rise(base)
    return dict(times=times, peak=peak, tensors=tensor_peak(model, opt, step, x, y), loss=losses[0])


def tensor_peak(model, opt, step, x, y):
    """One more step (untimed) under torch's MemTracker: the bytes of live tensors at the step's
    peak beyond the parameters, buffers and optimizer state. The resident set also holds what the
    allocator keeps of freed memory: glibc's heap returns freed space only past a trim threshold
    that grows to twice the largest block freed (64 MiB at most), which a small step's figure
    can't tell from tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(x, y)
    snapshot = tracker.get_tracker_snapshot('peak')[torch.device(device, 0) if device == 'cuda'
                                                      else torch.device(device)]
    held = [v for k, v in snapshot.items()
            if getattr(k, 'value', k) in ('Parameter', 'Buffer', 'Optstate')]
    return snapshot['Total'] - sum(held)


# ----------------------------------------------------------------------------- the driver
def spawn(name, S, n_steps=None, warm=True):
    """One (system, length) in a fresh process, n_steps timed steps (--steps) after a warm-up step
    at S (warm; else at 256 tokens): its dict, or {'error': the last line it printed}."""
    args = [sys.executable, os.path.abspath(__file__), f'--device={device}', f'--shape={shape}',
            f'--seq_lens={seq_lens}', f'--threads={threads}', f'--seed={seed}',
            f'--steps={n_steps or steps}',
            f'--model_dir={model_dir}', '--worker=' + json.dumps(dict(name=name, S=S, warm=warm))]
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    lines = (p.stdout + p.stderr).strip().splitlines() or ['no output']
    if p.returncode != 0:
        return {'error': 'error: ' + lines[-1][:120]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def gb(b):
    return f'{b / 2**30:.2f} GiB' if b >= 2**30 else f'{b / 2**20:,.0f} MiB'


def loadavg():
    with open('/proc/loadavg') as f:
        return ' '.join(f.read().split()[:3])


def logits_bytes(name, S):
    """What a step at S holds of the [S, V] logits at once: HF's loss keeps the fp32 logits, their
    log-softmax and makes their gradient; ours plain one fp32 buffer that becomes the gradient;
    chunked and liger a chunk."""
    if name in ('hf plain', 'hf checkpointed'):
        return 3 * S * VOCAB * 4
    if name == 'ours plain':
        return S * VOCAB * 4
    return 0


def too_big(name, S):
    """A reason not to run (system, S) on this CPU: its logits alone past 80% of the memory
    available (the box would swap or be killed), else ''."""
    if device == 'cuda':
        return ''
    with open('/proc/meminfo') as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith('MemAvailable:'))
    need = logits_bytes(name, S)
    if need > 0.8 * available:
        return f'not run: its logits alone {gb(need)} > 80% of the {gb(available)} available'
    return ''


def measure(names, S):
    """{name: (median time, max peak, loss, runs)} over --rounds rounds, or {name: error}."""
    runs = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            result = {'error': too_big(name, S)}
            if not result['error']:
                result = spawn(name, S)
            print(f'  S={S:,} round {r + 1}/{rounds} {name}: {result}', flush=True)
            runs[name].append(result)
    out = {}
    for name, rs in runs.items():
        errors = [r['error'] for r in rs if 'error' in r]
        if errors:
            out[name] = errors[0]
        else:
            times = [x for r in rs for x in r['times']]
            out[name] = (statistics.median(times), max(r['peak'] for r in rs),
                         max(r['tensors'] for r in rs), rs[0]['loss'], times)
    return out


def table(names, lengths):
    """The side-by-side rows: tokens/s and peak of each system, and ours against HF's."""
    rows = []
    for S in lengths:
        load = loadavg()
        m = measure(names, S)
        for name in names:
            if isinstance(m[name], str):
                rows.append(f'| {S:,} | {name} | {m[name]} | | | | | | {load} |')
                continue
            t, peak, tensors, loss, times = m[name]
            # ours against HF's: plain against plain, chunked against checkpointed
            against = {'ours plain': 'hf plain', 'ours chunked': 'hf checkpointed'}.get(name)
            vs = ''
            if against in m and not isinstance(m[against], str):
                theirs = m[against]
                vs = (f'{theirs[0] / t:.2f}x, peak {peak / theirs[1]:.3f} '
                      f'(tensors {tensors / theirs[2]:.3f})')
            runs = ', '.join(f'{x:.2f}' for x in times)
            rows.append(f'| {S:,} | {name} | {S / t:,.0f} | {gb(peak)} | {gb(tensors)} | {vs} '
                        f'| {loss:.4f} | {runs} | {load} |')
            print(rows[-1], flush=True)
    return rows


def longest(names):
    """Each system's longest length (doubling from 1,024) whose peak stays within --mem_gb."""
    rows = []
    limit = mem_gb * 2**30
    for name in names:
        fits, peaks = None, []
        S = 1024
        while S <= max_len:
            if len(peaks) >= 2:
                # linear in S from the last two: stop before a length that cannot fit
                (s1, p1), (s2, p2) = peaks[-2:]
                if p2 + (p2 - p1) / (s2 - s1) * (S - s2) > 1.2 * limit:
                    break
            r = {'error': too_big(name, S)}
            if not r['error']:
                r = spawn(name, S, n_steps=1, warm=False)
            print(f'  longest {name} S={S:,}: {r}', flush=True)
            if 'error' in r or r['peak'] > limit:
                break
            fits = (S, r['peak'])
            peaks.append(fits)
            S *= 2
        if fits is None:
            rows.append(f'| {name} | < 1,024 | |')
        else:
            rows.append(f'| {name} | {fits[0]:,} | {gb(fits[1])} |')
        print(rows[-1], flush=True)
    return rows


def versions():
    out = [f'torch {torch.__version__}']
    for package in ('transformers', 'liger-kernel'):
        try:
            out.append(f'{package} {importlib.metadata.version(package)}')
        except importlib.metadata.PackageNotFoundError:
            pass
    return ', '.join(out)


def main():
    global model_dir
    names = SYSTEMS
    if systems:
        names = [s.strip() for s in systems.split(',')]
        unknown = [s for s in names if s not in SYSTEMS]
        if unknown:
            sys.exit(f"error: unknown systems {unknown}; on {device}: {', '.join(SYSTEMS)}")
    lengths = [int(s) for s in str(seq_lens).split(',') if s.strip()]
    from model import Llama, LlamaConfig
    L, h, heads, kv, I = SHAPES[shape]
    torch.manual_seed(seed)
    config = LlamaConfig(n_layer=L, n_embd=h, n_head=heads, n_kv_head=kv, intermediate_size=I,
                         vocab_size=VOCAB)
    with tempfile.TemporaryDirectory() as d:
        model_dir = d
        Llama(config).save_pretrained(d)
        rows = table(names, lengths)
        fit_rows = []
        if mem_gb:
            fit_rows = longest(names)
    cmd = 'python ' + ' '.join(shlex.quote(a) for a in ['bench/peers.py'] + sys.argv[1:])
    cpu = platform.processor() or platform.machine()
    with open('/proc/cpuinfo') as f:
        cpu = next((line.split(':', 1)[1].strip() for line in f
                    if line.startswith('model name')), cpu)
    where = f'{os.cpu_count()}-core CPU ({cpu}), {torch.get_num_threads()} threads, fp32'
    if device == 'cuda':
        where = f'{torch.cuda.get_device_name()}, bf16'
    text = (f'\n## Side by side with the peers, {shape} Llama '
            f'({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n'
            f'`{cmd}`\n\n{where}; {versions()}; {shape}: {L} layers of {h}, {heads} heads '
            f'({kv} kv), intermediate {I}, vocabulary {VOCAB:,}; batch 1; a process per run, '
            f'{rounds} rounds of {steps} steps, the median step; peak: the rise over the model and its AdamW '
            f'states, of the resident set over the timed steps and of the live tensors over one more '
            f'step (MemTracker). "vs HF": HF\'s step time over ours (ours plain against HF plain, '
            f'ours chunked against HF checkpointed) and our peaks over its.\n\n'
            '| tokens | system | tokens/s | peak (RSS) | peak (tensors) | vs HF | loss (first step) '
            '| step times (s) | load avg before |\n|---:|---|---:|---:|---:|---|---:|---|---|\n' + '\n'.join(rows) + '\n')
    if fit_rows:
        text += (f'\nThe longest length (doubling from 1,024, at most {max_len:,}) whose step '
                 f'peaks within {mem_gb:g} GiB:\n\n| system | longest | its peak |\n|---|---:|---:|\n'
                 + '\n'.join(fit_rows) + '\n')
    print(text)
    if results:
        with open(os.path.join(ROOT, results), 'a') as f:
            f.write(text)
        print(f'appended to {results}')


if worker:
    w = json.loads(worker)
    print(json.dumps(step_worker(w['name'], w['S'], w['warm'])))
else:
    main()
