"""
Train a Llama. One process on a laptop CPU, a GPU, or Apple's MPS:

    python train.py                                   # tiny model on the embedded corpus, minutes on a CPU
    python train.py config/train_tiny.py --max_iters=500 --device=cpu

The loop, in the order it runs: read the config (defaults below, then a config file, then --key=value), prepare
the data if it is missing, build or load the model, print the memory estimate (memory.py), shard it (parallel.py),
wrap its blocks' keep / recompute / offload policy (offload.py), then step: sample a global batch, run the
micro-steps' forward and backward with the loss normalised by the number of real target tokens across all of them,
sync gradients, clip, AdamW, log, evaluate, checkpoint. Checkpoints (checkpoint.py) hold everything needed to
continue exactly (weights, fp32 master weights, optimizer, step, data sampler and RNG states), so
`--init_from=resume` reproduces an uninterrupted run's losses under any layout; SIGINT and SIGTERM save one and exit.

Precision: dtype='bfloat16' (CUDA's default) trains bf16 weights on fp32 gradients and master weights, 18 bytes
per parameter, or 6 with optimizer_in_backward; dtype='float32' (the CPU's) the weights themselves (optim.py).
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch
from tqdm import tqdm

from model import Llama, LlamaConfig, MEMORY_KNOBS as _KNOBS, flops_per_token, num_params
import checkpoint
from configurator import collective_failed, configure, die, has_device, writable
from data.tokenizer import check_tokenizer, read_docs, read_meta
import parallel
import pipeline
import memory
import optim
import offload as offload_policy  # (`offload` itself is a config key below)

_ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# default config: config/train_tiny.py, a model that learns to write Python on a laptop CPU in minutes
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 20
always_save_checkpoint = True  # every eval writes a checkpoint (atomically), not only the best
init_from = 'scratch'  # 'scratch' | 'resume' | path to a Hugging Face model directory
overwrite = False  # True: a new run may start in an out_dir holding a checkpoint (kept until the new one is saved)
# data
dataset = 'stdlib'  # data/<dataset>/{train,val}.bin; 'stdlib' is prepared on first use
doc_mask = False  # True: each token attends within its document only, positions restart at each (*.docs.npy)
gradient_accumulation_steps = 1
batch_size = 16  # sequences per micro-step (per data-parallel rank)
seq_len = 256
# model (vocab_size 0: take it from the dataset's meta.json)
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
intermediate_size = 384
vocab_size = 0
rope_theta = None  # None: 10000.0 from scratch, a Hugging Face model's own; a larger one extends its context
rope_scaling = None  # None: none from scratch, the model's own; {'rope_type': 'yarn', 'factor': 4.0, ...}: model.py
norm_eps = 1e-5
tie_embeddings = False
# memory knobs (chunked.py; offload.py)
mlp_chunks = 1
loss_chunks = 1
recompute = 'none'
offload = 0.0  # Memo's alpha (offload.py): > 0 sends block inputs, attention and this fraction of the rest to host
# parallelism under torchrun (parallel.py): world = dp x pp x cp x tp ranks, dp = world / (pp_size * cp_size * tp_size)
tp_size = 1
cp_size = 1
cp_impl = 'ulysses'  # 'ulysses' | 'ring'
pp_size = 1  # pipeline stages, each a run of blocks; its micro-batches: gradient_accumulation_steps
pp_schedule = '1f1b'  # '1f1b' | 'gpipe' (every micro-batch's forward, then every backward: more in flight)
zero = 0  # FSDP2 over the dp x cp ranks: 2 shards AdamW's states and the gradients, 3 the weights too
offload_states = False  # True (zero=3): weights, gradients and AdamW's states in host memory, AdamW on the CPU
timeout_s = 300  # a collective waiting this long for a rank that died or hangs ends the job (README.md)
# AdamW with linear warmup then cosine decay to min_lr
learning_rate = 2e-3
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99  # tokens per step are few here: a shorter second-moment memory trains faster
grad_clip = 1.0  # 0 disables
optimizer_in_backward = False  # True (one rank): each parameter's step inside backward, no fp32 copies (optim.py)
warmup_iters = 50
lr_decay_iters = 0  # 0: decay over max_iters
min_lr = 2e-4
# system
device = 'auto'  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'  # 'auto' (bfloat16 on CUDA, else float32) | 'float32' | 'bfloat16'
compile = False
seed = 1337
# memory accounting (memory.py): a report before the first step, measured after it, out_dir/memory.json
dry_run = False  # one step on fake tensors on this CPU, standing in for the configured GPUs; then exit
dry_run_anatomy = 0  # N > 0: also list the N largest tensors alive at the measured peak (measure.py)
memory_budget_gb = 0.0  # GiB per device the run must fit in (80% rule); 0: the device's own (80 for a dry run)
host_memory_budget_gb = 0.0  # GiB of host memory for offloaded activations; 0: what is available
auto_memory = False  # let memory.py pick recompute / mlp_chunks / loss_chunks / offload: the cheapest that fits
# -----------------------------------------------------------------------------
# what each training key allows, checked before anything is read, allocated or written (the model's keys:
# model.LlamaConfig; the rules between the layout keys: parallel.check_layout)
_RULES = [
    (('batch_size', 'seq_len', 'gradient_accumulation_steps', 'eval_interval', 'log_interval', 'eval_iters',
      'tp_size', 'cp_size', 'pp_size'), 'must be >= 1', lambda v: v >= 1),
    (('max_iters', 'warmup_iters', 'lr_decay_iters', 'vocab_size', 'learning_rate', 'min_lr', 'weight_decay',
      'grad_clip', 'memory_budget_gb', 'host_memory_budget_gb'), 'must be >= 0', lambda v: 0 <= v < math.inf),
    (('beta1', 'beta2'), 'must be in [0, 1)', lambda v: 0 <= v < 1),
    (('dtype',), "must be 'auto', 'float32' or 'bfloat16' (float16 needs loss scaling)",
     lambda v: v in ('auto', 'float32', 'bfloat16')),
    (('device',), "must be 'auto', 'cpu' or a device this machine has ('cuda', 'cuda:1', 'mps')",
     lambda v: dry_run or v == 'auto' or has_device(v)),  # a dry run stands in for the target's devices
    (('init_from',), "must be 'scratch', 'resume' or a Hugging Face model directory",
     lambda v: v in ('scratch', 'resume') or os.path.isdir(v)),
    (('out_dir',), 'must be a directory we can write in, or create', writable),
    (('optimizer_in_backward',), "needs one rank, gradient_accumulation_steps=1 and zero=0 (no step's gradient "
     "to sum or share)", lambda v: not v or os.environ.get('WORLD_SIZE', '1') == '1' and zero == 0 and tp_size ==
     cp_size == gradient_accumulation_steps == 1)]


# ----------------------------------------------------------------------------- data
def read_dataset(world, rank):
    """data/<dataset>/meta.json, checked with its .bin files; rank 0 prepares the default corpus on first use."""
    if dry_run and vocab_size:  # a dry run reads no data: its vocabulary is all it needs
        return {'vocab_size': vocab_size}
    data_dir = os.path.join(_ROOT, 'data', dataset)
    path = os.path.join(data_dir, 'meta.json')
    if rank == 0 and dataset == 'stdlib' and not os.path.exists(path):
        import runpy  # prepare.py is a script in a folder, not a module of a package
        runpy.run_path(os.path.join(data_dir, 'prepare.py'))['prepare'](data_dir)
    world > 1 and torch.distributed.barrier()
    if not os.path.exists(path):
        die(f"dataset {dataset!r} is not prepared: run python data/{dataset}/prepare.py (see README.md)")
    try:  # get_batch starts its seq_len + 1 token windows before len - seq_len - 1; a dry run draws none
        meta = {**read_meta(data_dir, 0 if dry_run else seq_len + 2), 'dir': data_dir}
    except ValueError as e:
        die(e)
    if doc_mask and (starts := read_docs(meta, 'train')) is None:
        die(f"doc_mask=True: dataset {dataset!r} has no document boundaries (train.docs.npy): prepare it again "
            f"with its data/*/prepare.py, or set doc_mask=False")
    if doc_mask and rank == 0 and (n := np.sum(np.diff(starts, append=meta['train_tokens']) > seq_len)):
        print(f"note: {n} training documents are longer than seq_len={seq_len}: a window cuts them, each piece "
              f"from position 0")  # said once: get_batch cuts them as it cuts the token stream
    return meta

def get_batch(meta, split, n, generator, device):
    """n random windows of seq_len + 1 tokens: inputs and next-token targets; with doc_mask also each input's position
    in its document (below) and the documents' starts in the flattened inputs (model.attention; on the host)."""
    # a fresh memmap per batch: numpy's memmap otherwise keeps every page it touched resident
    data = np.memmap(os.path.join(meta['dir'], f'{split}.bin'), dtype=meta['dtype'], mode='r')
    ix = torch.randint(len(data) - seq_len - 1, (n,), generator=generator).tolist()
    xyp = [data[i:i + seq_len + 1].astype(np.int64) for i in ix]
    if doc_mask:  # each token's place in its document, as if the window's first document began at the window
        starts = read_docs(meta, split)
        for t in (np.arange(i, i + seq_len + 1) for i in ix):
            xyp.append(t - np.maximum(starts[np.searchsorted(starts, t, 'right') - 1], t[0]))
    xyp = torch.from_numpy(np.stack(xyp))  # pinned below on CUDA: the copy overlaps the previous step
    xy, pos = (xyp.pin_memory() if device.type == 'cuda' else xyp).to(device, non_blocking=True).tensor_split([n])
    y = xy[:, 1:].masked_fill(pos[:, 1:] == 0, -100) if doc_mask else xy[:, 1:]  # a document's first: not predicted
    return (xy[:, :-1], y) + ((pos[:, :-1], (xyp[n:, :-1].flatten() == 0).nonzero()[:, 0]) if doc_mask else ())


# ----------------------------------------------------------------------------- one optimisation step
def forward_backward(model, micro_batches, autocast, mesh=None, pipe=None):
    """Backward of the mean loss over every real target token of the step, returned detached (not a mean of
    per-micro-step means: micro-steps with more ignored targets must weigh less). Under parallelism the count is
    the whole step's, over every dp × cp rank: the gradients summed over them are then the single-process ones."""
    dpcp_sum = lambda t: t if mesh is None or mesh.dpcp_group is None else parallel.all_reduce(t, mesh.dpcp_group)
    count = dpcp_sum(sum((y != -100).sum() for _, y, *_ in micro_batches)).clamp(min=1)
    if pipe is not None:  # torch's schedule runs them, in its order (pipeline.py); the last stage has the loss
        return dpcp_sum(parallel.all_reduce(pipe.step(micro_batches, count, fake=dry_run), mesh.pp_group))
    total = 0.0
    for x, y, *rest in micro_batches:  # rest: positions, docs
        with autocast:  # the logits are dropped here, or they would live through backward (memory.py counts on it)
            loss = model(x, y, *rest)[1] * ((y != -100).sum() / count)  # this micro-step's mean, weighted
        loss.backward()
        total = total + loss.detach()
    return dpcp_sum(total)

def make_optimizer(model, masters, device_type, mesh=None):
    """AdamW on fp32 master weights (optim.AdamW): under zero=2, 3 FSDP2's share per dp·cp rank; or in backward."""
    # weight decay on matrices only: norms' gains are not decayed (nanoGPT, Llama)
    decay = [m for p, m in zip(model.parameters(), masters) if p.dim() >= 2]
    no_decay = [m for p, m in zip(model.parameters(), masters) if p.dim() < 2]
    groups = [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
    # fused: one kernel for all parameters instead of a few per tensor, with no temporaries; on a CPU
    # it is also what makes the tiny models' step fast (2026-11-23, 2-core CPU, 4 layers of width 128: 0.9 vs 5.9 ms)
    fused = device_type in ('cuda', 'cpu', 'mps') and not optimizer_in_backward  # (fused skips a step: train_step)
    return optim.AdamW(list(model.named_parameters()), masters, groups, mesh or parallel.Mesh(), model.config,
                       in_backward=optimizer_in_backward, max_norm=grad_clip or math.inf, lr=learning_rate,
                       betas=(beta1, beta2), fused=fused)

def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # linear warmup: Adam's first updates are noisy at full lr
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# ----------------------------------------------------------------------------- measurement
def peak_flops(device, dtype):
    """The datasheet's dense peak FLOP/s of a known GPU (bf16; fp32 at half), to state MFU against; None elsewhere:
    a CPU has no figure worth trusting, and a matmul timed once at start on a shared machine swung MFU 61% to 488%."""
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else ''
    tflops = next((t for key, t in (('H100', 989), ('H200', 989), ('H800', 989), ('A100', 312), ('A800', 312),
                                    ('L40S', 362), ('4090', 165), ('A10G', 70), ('A10', 125)) if key in name), None)
    return tflops and tflops * 1e12 * (1 if dtype == torch.bfloat16 else 0.5)

def peak_memory(device, reset=False):
    """Bytes: the allocator's peak on CUDA, the process's peak resident set (VmHWM, Linux) elsewhere, or 0.
    reset=True starts a new peak (VmHWM through /proc/self/clear_refs; elsewhere the peak is since start)."""
    if device.type == 'cuda':
        return torch.cuda.reset_peak_memory_stats(device) if reset else torch.cuda.max_memory_allocated(device)
    if reset and os.access('/proc/self/clear_refs', os.W_OK):
        with open('/proc/self/clear_refs', 'w') as f:
            return f.write('5')
    status = open('/proc/self/status').read().splitlines() if os.path.exists('/proc/self/status') else []
    return next((int(line.split()[1]) * 1024 for line in status if line.startswith('VmHWM:')), 0)


# ----------------------------------------------------------------------------- setup
def model_from_config(meta, cfg, world, dev, ptdtype):
    """Build (or load) the model named by init_from, its config and layout checked before the model is
    allocated (a Hugging Face model is checked as it loads); returns (model, checkpoint or None)."""
    knobs = {k: cfg[k] for k in _KNOBS if k in cfg}  # how forward runs: free to change on resume
    given = {f.name: cfg[f.name] for f in fields(LlamaConfig) if cfg.get(f.name) is not None}  # None: not given
    model = ckpt = None
    if init_from != 'resume' and not (overwrite or dry_run) and checkpoint.latest(out_dir):
        die(f"{out_dir} holds a checkpoint: --init_from=resume continues it, --overwrite=True starts a new run "
            f"(the old checkpoint stays until the new run saves one)")
    try:  # a ValueError here is the user's input (LlamaConfig's rules, a HF directory's files), not our bug
        if init_from == 'scratch':
            config = LlamaConfig(**{**given, 'vocab_size': vocab_size or meta['vocab_size']})
        elif init_from == 'resume':
            ckpt = checkpoint.resume(out_dir, cfg)  # the weights load after sharding (main)
            config = LlamaConfig(**ckpt['model_args'], **knobs)
        else:  # its architecture, but a rope_theta or rope_scaling given: a new one extends the model's context
            check_tokenizer(meta, init_from)  # before the weights load: another tokenizer's ids are nonsense to it
            model = Llama.from_pretrained(init_from, **{k: v for k, v in given.items() if k in knobs or 'rope' in k})
            config = model.config
    except ValueError as e:
        die(e)
    check_layout(config, world, dev, ptdtype)
    if meta['vocab_size'] > config.vocab_size:
        die(f"dataset {dataset!r} has vocab_size {meta['vocab_size']} ({meta.get('tokenizer')}), more than "
            f"the model's {config.vocab_size}: prepare it with the model's tokenizer")
    return model or Llama(config), ckpt

def device_and_dtype():
    """The device, the weights' dtype and the autocast context (bf16 on CUDA, fp32 elsewhere)."""
    dev = torch.device(device if device != 'auto' else 'cuda' if torch.cuda.is_available() else
                       'mps' if torch.backends.mps.is_available() else 'cpu')
    if dry_run:  # memory.py: rank 0 of WORLD_SIZE (else tp x cp x pp) ranks; this CPU (fake tensors) stands in for CUDA
        dev = torch.device('cpu')
        os.environ.setdefault('WORLD_SIZE', str(tp_size * cp_size * pp_size))
    ptdtype = getattr(torch, dtype if dtype != 'auto' else 'bfloat16' if dev.type == 'cuda' or dry_run else 'float32')
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on CUDA only
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if ptdtype == torch.bfloat16 else nullcontext()
    return dev, ptdtype, autocast

def check_layout(config, world, dev, ptdtype):
    """Stop on every rank, in one line, before anything is allocated, if this layout can't run config."""
    why = parallel.check_layout(config, world, tp_size, cp_size, cp_impl, seq_len, zero, dev.type, ptdtype, doc_mask,
                                offload_states, pp_size, gradient_accumulation_steps, pp_schedule)
    why and die(why)

def train_step(model, batches, autocast, mesh, named_masters, optimizer, pipe=None):
    """Forward and backward of every micro-batch, gradient sync and clipping, AdamW (or in backward: optim.py): one
    step. A step whose loss or gradient norm is not finite changes nothing (as GradScaler skips one), on the device."""
    loss = forward_backward(model, batches, autocast, mesh, pipe)
    bad = (~loss.isfinite()).float()
    if not optimizer.in_backward:
        parallel.sync_grads(named_masters, mesh, model.config)  # (one process: nothing to sync)
        # every shard's norm, even unclipped (grad_clip=0: max_norm inf), to see a non-finite one
        norm = parallel.clip_grad_norm_(named_masters, optimizer.max_norm, mesh, model.config)
        # fused AdamW reads found_inf as GradScaler sets it: 1 skips the whole update, weight decay and step count
        bad = optimizer.found_inf = torch.maximum(bad, (~norm.isfinite()).float())
        optimizer.step()  # updates the fp32 master rows, then the model's weights on every rank
        optimizer.zero_grad(set_to_none=True)
    optimizer.skipped = (getattr(optimizer, 'skipped', 0) + 1) * bad  # in a row: check_finite
    return loss


_MAX_SKIPS = 3  # non-finite steps in a row that end a run: a lone spike is skipped, as GradScaler does

def check_finite(optimizer, iter_num, lr):
    """Stop without saving after _MAX_SKIPS skipped steps in a row: the last checkpoint holds the last good weights."""
    if (n := int(optimizer.skipped)) >= _MAX_SKIPS:
        die(f"iter {iter_num - n}: the loss or gradient norm is not finite ({n} steps in a row, lr {lr:g}); stopped "
            f"without saving: resume the last checkpoint in {out_dir} with a lower --learning_rate")

@torch.no_grad()
def evaluate(model, meta, mesh, autocast, dev, pipe=None):
    """The mean val loss over eval_iters batches, the same batches at every eval."""
    model.eval()
    gen, loss = torch.Generator().manual_seed(seed + 1), 0
    for _ in range(eval_iters):
        x, y, *rest = parallel.shard_batch(mesh, *get_batch(meta, 'val', batch_size * mesh.dp, gen, dev))
        with autocast:  # each batch's mean weighs by its real targets (doc_mask ignores some), on every rank
            part = model(x, y, *rest)[1].float() if pipe is None else pipe.evaluate(x, y, rest[0])  # (pp: the last's)
            loss = loss + torch.stack([part * (y != -100).sum(), (y != -100).sum()])
    model.train()
    for m in (m for m in model.modules() if hasattr(m, 'reshard')):  # FSDP2: no backward came to free the gathered
        m.reshard()
    loss = loss if mesh.dpcp_group is None else parallel.all_reduce(loss, mesh.dpcp_group)
    return (loss[0] / loss[1]).item()

def dry_run_step(step, mem, model, masters, optimizer, mesh, pipe):
    """One step on fake tensors, measured: the table and the verdict. Two micro-steps show what gradient accumulation
    adds; under pp one more than rank 0's stage keeps in flight, then the last stage's dry run in a fresh process."""
    n, V = min(gradient_accumulation_steps, 2 if pipe is None else pipe.in_flight + 1), model.config.vocab_size
    batches = [parallel.shard_batch(mesh, *memory.fake_batch(batch_size * mesh.dp, seq_len, V, doc_mask))
               for _ in range(n)]  # made before the step: not the step's
    with mem.measure(pipe or model, masters, optimizer):
        step(batches)
    if mesh.pp > 1 and mesh.pp_rank == 0:  # the LM head and loss, the fewest in flight
        subprocess.run([sys.executable, *sys.argv], env={**os.environ, 'RANK': str(mesh.world - 1)}, check=True)

def catch_signals():
    """SIGINT / SIGTERM: the loop finishes its step, saves and exits 0; a second signal interrupts at once."""
    stop = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: stop.append(signum) or signal.signal(signum, signal.SIG_DFL))
    return stop


# -----------------------------------------------------------------------------
def main():
    configure(globals())
    cfg = {k: v for k, v in globals().items() if k[0] != '_' and isinstance(v, (int, float, str, dict, type(None)))}
    for keys, allowed, ok in _RULES:
        for key in (k for k in keys if not ok(cfg[k])):
            die(f"{key}={cfg[key]!r}: {allowed}")
    dev, ptdtype, autocast = device_and_dtype()
    torch.manual_seed(seed)  # the same on every rank: every rank builds the same full model, then shards it
    world, rank, local_rank = parallel.init_distributed(dev.type, dry_run, timeout_s, one=offload_states)
    dev = torch.device('cuda', local_rank) if world > 1 and dev.type == 'cuda' else dev
    meta = read_dataset(world, rank)
    with torch.device('meta') if dry_run else nullcontext():  # a dry run's model is shapes only
        model, ckpt = model_from_config(meta, cfg, world, dev, ptdtype)
    mesh = parallel.make_mesh(tp_size, cp_size, cp_impl, model.config.n_kv_head, timeout_s=timeout_s,
                              device_type=dev.type, pp=pp_size)  # (a dry run's: the CPU)
    try:  # the last check, and the first thing written: a run stopped by any check before leaves no out_dir
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        die(f"out_dir={out_dir!r}: cannot create it: {e.strerror}")
    # the memory report, before anything is on the device: stops here if the run can't fit (80% rule) or
    # offload's host memory can't hold it; auto_memory=True first sets the cheapest knobs that fit
    mem = memory.Report(model, cfg, world, rank, mesh, dev, ptdtype)
    check_layout(model.config, world, dev, ptdtype)  # the knobs as auto_memory left them
    n_params, (mfu_flops, hfu_flops) = num_params(model.config), flops_per_token(model.config, seq_len)
    parallel.parallelize(model, mesh)  # the full model, initialised from the seed, sharded (and staged) for this rank
    names = [n for n, _ in model.named_parameters()]
    offload_policy.apply(model)  # keep, recompute or offload each block's activations (offload.py)
    wdtype = torch.float32 if zero > 1 else ptdtype  # zero=2, 3: fp32 rows are the masters, FSDP2 gathers in ptdtype
    memory.to_fake(model, wdtype) if dry_run else model.to(device='cpu' if offload_states else dev, dtype=wdtype)
    zero > 1 and parallel.shard_states(model, mesh, zero, ptdtype, offload_states)  # block by block via the GPU
    masters = optim.make_master_weights(model, optimizer_in_backward)
    optimizer = make_optimizer(model, masters, dev.type, mesh)
    data_gen = torch.Generator().manual_seed(seed)
    iter_num, best_val_loss = (ckpt['iter_num'], ckpt['best_val_loss']) if ckpt is not None else (0, float('inf'))
    if ckpt is not None:  # weights, masters, moments and RNGs of any layout, into this rank's pieces
        checkpoint.load(ckpt['path'], model, optimizer, mesh, data_gen)
    raw_model, model = model, torch.compile(model) if compile else model
    pipe = pipeline.Pipeline(model, mesh, pp_schedule, gradient_accumulation_steps, autocast, dev) \
        if pp_size > 1 else None  # torch's pipeline schedule over this rank's stage
    step = lambda batches: train_step(model, batches, autocast, mesh, list(zip(names, masters)), optimizer, pipe)
    save = lambda it: checkpoint.save(out_dir, raw_model, optimizer, mesh, data_gen, iter_num=it,
                                      best_val_loss=best_val_loss, config=cfg)
    if dry_run:
        return dry_run_step(step, mem, raw_model, masters, optimizer, mesh, pipe)

    device_flops = (peak := peak_flops(dev, ptdtype)) and peak * world  # MFU is per device: against all of them
    tokens_per_iter = gradient_accumulation_steps * batch_size * mesh.dp * seq_len  # the global batch
    layout = f", {world} ranks: dp {mesh.dp} x pp {mesh.pp} ({pp_schedule}) x cp {mesh.cp} ({cp_impl}) x tp {mesh.tp}" \
        if world > 1 else ''
    rank == 0 and print(f"{n_params / 1e6:.2f}M parameters (non-embedding), {tokens_per_iter:,} tokens per step, "
                        f"device {dev} {str(ptdtype).removeprefix('torch.')}{layout}")
    signals, stop = catch_signals(), False  # signals this rank received; stop: what every rank agreed on
    log = open(os.path.join(out_dir, 'log.jsonl'), 'a') if rank == 0 else None  # appended: never lose a row
    bar = tqdm(total=max_iters, initial=iter_num, dynamic_ncols=True, disable=None if rank == 0 else True)
    t0, it0 = time.perf_counter(), iter_num  # tokens/s: the steps since it0, over the time since t0
    peak_memory(dev, reset=True)
    while iter_num < max_iters and not stop:
        val_loss = None
        if iter_num % eval_interval == 0 or iter_num == max_iters - 1:
            t_eval = time.perf_counter()
            val_loss = evaluate(model, meta, mesh, autocast, dev, pipe)
            best_val_loss = min(best_val_loss, val_loss)
            always_save_checkpoint and iter_num > 0 and save(iter_num)
            t0 += time.perf_counter() - t_eval  # tokens/s counts training time only
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group['lr'] = lr
        # every rank samples the same global batch; shard_batch keeps our dp rank's rows, our cp rank's tokens
        batches = [parallel.shard_batch(mesh, *get_batch(meta, 'train', batch_size * mesh.dp, data_gen, dev))
                   for _ in range(gradient_accumulation_steps)]
        sent = offload_policy.stats()['bytes_to_host']
        with mem.measure(pipe or raw_model, masters, optimizer, compiled=compile):  # the first step only
            loss = step(batches)
        iter_num += 1
        bar.update(1)
        if (iter_num - 1) % log_interval and val_loss is None and iter_num < max_iters and not (world == 1 and signals):
            continue
        tps = (iter_num - it0) * tokens_per_iter / (time.perf_counter() - t0)
        row = {'iter': iter_num - 1, 'loss': loss.item(), 'lr': lr, 'tokens_per_s': tps,  # the step's only host sync
               'mfu': device_flops and tps * mfu_flops / device_flops,  # None: no trusted peak
               'hfu': device_flops and tps * hfu_flops / device_flops,
               'peak_mem_bytes': peak_memory(dev), 'offload_bytes': offload_policy.stats()['bytes_to_host'] - sent}
        write_log(log, bar, row, val_loss, mem)
        check_finite(optimizer, iter_num, lr)
        t0, it0 = time.perf_counter(), iter_num
        peak_memory(dev, reset=True)
        # ranks may see a signal in different steps: they agree on log steps only (a sync every step stalls the GPUs)
        stop = bool(parallel.all_reduce(torch.tensor(len(signals), device=dev), None).item() if world > 1 else signals)
    bar.close()
    path = save(iter_num)
    rank == 0 and print(f"stopped by a signal at iter {iter_num}; checkpoint saved in {path} (continue with "
                        f"--init_from=resume)" if stop else f"done: {iter_num} iters, best val loss "
                        f"{best_val_loss:.4f}, checkpoint {path}")

def write_log(log, bar, row, val_loss, mem):
    """One log.jsonl row (rank 0 only: log is None elsewhere) and the progress bar's postfix."""
    if val_loss is not None:
        row['val_loss'] = val_loss
    if log is not None:
        if mem.measured is not None and not mem.logged:  # the first row after the measured step carries its bytes
            row['memory'] = {'estimate': mem.est.as_dict(), 'measured': mem.measured}  # as memory.json has them
            mem.logged = True
        print(json.dumps(row), file=log, flush=True)
    bar.set_postfix_str(f"loss {row['loss']:.4f}" + (f" val {val_loss:.4f}" if val_loss is not None else '') +
                        f" {row['tokens_per_s']:,.0f} tok/s" + (f" mfu {100 * row['mfu']:.1f}%" if row['mfu'] else ''))
    if bar.disable and log is not None:  # not a terminal: a plain line per log step instead of the bar
        print(f"iter {row['iter']}: {bar.postfix}", flush=True)


if __name__ == '__main__':
    try:
        main()
    except checkpoint.Error as e:  # a crafted or damaged checkpoint, a full disk: the user's, so one line
        die(e)
    except RuntimeError as e:  # what gloo raises; NCCL's DistBackendError is one too
        collective_failed(e, timeout_s)
    torch.distributed.is_initialized() and torch.distributed.destroy_process_group()
