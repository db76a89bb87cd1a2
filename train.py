"""
Train a Llama. One process on a laptop CPU, a GPU, or Apple's MPS:

    python train.py                      # tiny model on the embedded corpus, minutes on a CPU
    python train.py config/train_tiny.py --max_iters=500 --device=cpu

As nanoGPT's train.py: the config (defaults below, then a config file, then --key=value), setup in
the order it happens, then one loop. Setup: prepare the data if it is missing; settle the model's
config (the keys, a checkpoint's or a Hugging Face directory's) and check it against the layout and
the data; the memory report (measure.Report, on memory.py's estimate), whose auto_memory returns
the memory knobs that fit (knobs.Knobs: the model's config with them); build the model from the
final config (or load its weights); print the estimate, stopping a run that can't fit; apply the
techniques in order (place_model: parallel.py's shards under torchrun, chunked.py's modules,
offload.py's keep / recompute / offload policy, FSDP2). A dry run then measures one step on fake
tensors (dry_run_step) instead of training. The loop: evaluate (and checkpoint), set the lr, sample
a global batch, run the micro-steps' forward and backward with the loss normalised by the number of
real target tokens across all of them, sync the gradients (several ranks), clip, the optimizer's
step (AdamW, or Muon), log.

The default path is short: on one process with every memory knob off, a step (train_step) runs
code in train.py, model.py, rope.py, optim.py and chunked.py's loss only (tests/test_train.py
traces one); the layouts add parallel.py, a mixture of experts moe.py.

Checkpoints (checkpoint.py) hold everything needed to continue exactly (weights, fp32 master
weights, optimizer, step, data sampler and RNG states), so `--init_from=resume` reproduces an
uninterrupted run's losses under any layout; SIGINT and SIGTERM save one and exit.

Precision: dtype='bfloat16' (CUDA's default) trains bf16 weights on fp32 gradients and master
weights, 18 bytes per parameter, or 6 with optimizer_in_backward; dtype='float32' (the CPU's) the
weights themselves (optim.py). dtype='float16' (GPUs without bf16: V100, T4) is bf16's recipe with
dynamic loss scaling (Micikevicius et al. 2018): fp16 has 5 exponent bits to bf16's 8, so
gradients under 2^-24 would flush to zero; backward runs on the loss times a scale (2^16 at first)
and the gradients are divided by it before clipping. A step whose gradients overflow is skipped
and the scale halved; SCALE_GROWTH clean steps in a row double it (torch's GradScaler's rule and
verbs: optim.LossScaler, which train_step calls in GradScaler's order, on the device).
optimizer='muon': torch's Muon for the blocks' matrices, AdamW for the rest (optim.py).
"""

import fcntl
import importlib.util
import json
import math
import os
import signal
import socket
import time
from collections import namedtuple
from contextlib import nullcontext, suppress
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from knobs import KNOBS, Knobs, architecture, hardware_flops, with_knobs
from model import Llama, flops_per_token, num_params, read_config
import checkpoint
import chunked
from configurator import (check, collective_failed, configure, die, has_device, pick_device,
                          writable)
from data.tokenizer import check_tokenizer, read_docs, read_meta, tokenizer_name
import parallel
import pipeline
import measure
import moe
import optim
import offload as offload_policy  # (`offload` itself is a config key below)

# -----------------------------------------------------------------------------
# default config: config/train_tiny.py, a model that learns to write Python on a laptop CPU in
# minutes
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 20
always_save_checkpoint = True  # every eval writes a checkpoint (atomically), not only the best
init_from = 'scratch'  # 'scratch' | 'resume' | path to a Hugging Face model directory
# nanoGPT's Weights & Biases logging, rank 0 (`pip install wandb`; WANDB_MODE=offline: no network)
wandb_log = False
wandb_project = 'nanolong'
wandb_run_name = 'run'
# True: a new run may start in an out_dir holding a checkpoint (kept until the new one is saved)
overwrite = False
# data
dataset = 'stdlib'  # data/<dataset>/{train,val}.bin; 'stdlib' is prepared on first use
# True: each token attends within its document only, positions restart at each (*.docs.npy)
doc_mask = False
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
# None: 10000.0 from scratch, a Hugging Face model's own; a larger one extends its context
rope_theta: float | None = None
# None: none from scratch, the model's own; {'rope_type': 'yarn', 'factor': 4.0, ...}: model.py
rope_scaling: dict | None = None
norm_eps = 1e-5
tie_embeddings = False
# mixture of experts (moe.py): n_experts 0 is the dense Llama; each token computes
# experts_per_token of them; the load-balancing loss's weight
n_experts = 0
experts_per_token = 2
router_aux_loss_coef = 0.02
# sliding-window attention (Mistral's): a query sees the last sliding_window keys, itself included
# (0: all); layer_types: None windows every layer, else one 'sliding_attention' or
# 'full_attention' a layer (None for either: from scratch 0 and None, a Hugging Face model's own).
# A key whose default is None says what it takes (`int | None`): the configurator checks it
sliding_window: int | None = None
layer_types: list[str] | None = None
# the Qwen families (docs/models.md; a Hugging Face model's own from init_from): a head's width
# (0: n_embd / n_head), biases on q, k, v (Qwen2), norms of each head's q and k (Qwen3); an
# expert's width (0: intermediate_size), its k weights renormalised (Mixtral) or not, the layers
# whose MLP stays dense (Qwen3-MoE)
head_dim = 0
attention_bias = False
qk_norm = False
moe_intermediate_size = 0
norm_topk_prob = True
dense_layers: list[int] | None = None
# memory knobs (chunked.py; offload.py)
mlp_chunks = 1
loss_chunks = 1
# head groups attention runs one at a time (chunked.py): 1 off, 0 one per kv head
attention_chunks = 1
recompute = 'none'
# Memo's alpha (offload.py): > 0 sends block inputs, attention and this fraction of the rest to host
offload = 0.0
# parallelism under torchrun (parallel.py): world = dp x pp x cp x tp ranks,
# dp = world / (pp_size * cp_size * tp_size)
tp_size = 1
cp_size = 1
cp_impl = 'ulysses'  # 'ulysses' | 'ring'
# both: the ring's ranks of cp_size, Ulysses inside each node, the ring across (parallel.py's
# c = u × r: cp_ring = r); 0: cp_impl's end of it ('ulysses' 1, 'ring' cp_size)
cp_ring = 0
pp_size = 1  # pipeline stages, each a run of blocks; its micro-batches: gradient_accumulation_steps
# '1f1b' | 'gpipe' (every micro-batch's forward, then every backward: more in flight)
pp_schedule = '1f1b'
# expert parallelism (moe.py): the experts split over groups of ep_size of the dp x cp ranks
ep_size = 1
# FSDP2 over the dp x cp ranks: 2 shards AdamW's states and the gradients, 3 the weights too
zero = 0
# True (zero=3): weights, gradients and AdamW's states in host memory, AdamW on the CPU
offload_states = False
# a collective waiting this long for a rank that died or hangs ends the job (README.md)
timeout_s = 300
# AdamW with linear warmup then cosine decay to min_lr
learning_rate = 2e-3
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99  # tokens per step are few here: a shorter second-moment memory trains faster
grad_clip = 1.0  # 0 disables
# 'adamw' | 'muon': Muon for the blocks' matrices, AdamW for the rest (optim.py)
optimizer = 'adamw'
# True (one rank): each parameter's step inside backward, no fp32 copies (optim.py)
optimizer_in_backward = False
warmup_iters = 50
lr_decay_iters = 0  # 0: decay over max_iters
min_lr = 2e-4
# system
device = 'auto'  # 'auto' (the first of cuda, mps, cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
# 'auto' (bfloat16 on CUDA, float16 on a CUDA GPU without bf16, else float32) | 'float32' | ...
dtype = 'auto'  # ... | 'bfloat16' | 'float16' (with loss scaling: the header)
compile = False
seed = 1337
# memory accounting (memory.py's estimate, measure.py's report): a report before the first step,
# measured after it, out_dir/memory.json
# one step on fake tensors on this CPU, standing in for the configured GPUs; then exit
dry_run = False
# a long stage's dry run measures a few blocks and extrapolates (dry_run_step); True: every block
dry_run_full = False
# N > 0: also list the N largest tensors alive at the measured peak (measure.py; every block)
dry_run_anatomy = 0
# GiB per device the run must fit in (80% rule); 0: the device's own (80 for a dry run)
memory_budget_gb = 0.0
host_memory_budget_gb = 0.0  # GiB of host memory for offloaded activations; 0: what is available
# let memory.py pick recompute / mlp_chunks / loss_chunks / offload: the cheapest that fits
auto_memory = False
# -----------------------------------------------------------------------------
# what each training key allows, checked before anything is read, allocated or written (the
# model's keys: knobs.Knobs, a model.LlamaConfig and the memory knobs; the rules between the layout
# keys: parallel.check_layout):
# (keys, what they allow, the check of one value)
RULES = [
    ('batch_size seq_len gradient_accumulation_steps eval_interval log_interval eval_iters '
     'tp_size cp_size pp_size ep_size', 'must be >= 1', lambda v: v >= 1),
    ('cp_ring max_iters warmup_iters lr_decay_iters vocab_size learning_rate min_lr weight_decay '
     'grad_clip memory_budget_gb host_memory_budget_gb dry_run_anatomy', 'must be >= 0',
     lambda v: 0 <= v < math.inf),
    # torch's generators take 64 bits; evaluate's is seeded with seed + 1
    ('seed', 'must be in [0, 2**63)', lambda v: 0 <= v < 2 ** 63),
    ('beta1 beta2', 'must be in [0, 1)', lambda v: 0 <= v < 1),
    ('dtype', "must be 'auto', 'float32', 'bfloat16' or 'float16'",
     lambda v: v in ('auto', 'float32', 'bfloat16', 'float16')),
    ('timeout_s', 'must be a number of seconds > 0', lambda v: 0 < v < math.inf),
    # a dry run stands in for the target's devices
    ('device', "must be 'auto', 'cpu' or a device this machine has ('cuda', 'cuda:1', 'mps')",
     lambda v: dry_run or v == 'auto' or has_device(v)),
    ('init_from', "must be 'scratch', 'resume' or a Hugging Face model directory",
     lambda v: dry_run or v in ('scratch', 'resume') or os.path.isdir(v)),
    ('out_dir', 'must be a directory we can write in, or create', writable),
    ('optimizer', "must be 'adamw' or 'muon'", lambda v: v in ('adamw', 'muon')),
    # Newton-Schulz orthogonalizes whole matrices: a layout that splits them can't run it
    ('optimizer', "Muon needs whole matrices: it runs under dp, pp, cp and ep, not tp_size > 1 "
     "or zero=2, 3", lambda v: v != 'muon' or tp_size == 1 and zero == 0),
    ('optimizer_in_backward', "needs one rank, gradient_accumulation_steps=1, zero=0 (no step's "
     "gradient to sum or share) and optimizer='adamw' (its own)",
     lambda v: not v or os.environ.get('WORLD_SIZE', '1') == '1' and zero == 0
     and tp_size == cp_size == gradient_accumulation_steps == 1 and optimizer == 'adamw')]


# ----------------------------------------------------------------------------- data
def read_dataset(world, rank):
    """data/<dataset>/meta.json, checked with its .bin files; rank 0 prepares the default corpus
    on first use."""
    if dry_run and vocab_size:  # a dry run reads no data: its vocabulary is all it needs
        return {'vocab_size': vocab_size}
    data_dir = Path(__file__).resolve().parent / 'data' / dataset
    meta_file = data_dir / 'meta.json'
    if rank == 0 and dataset == 'stdlib' and not meta_file.exists():
        import runpy  # prepare.py is a script in a folder, not a module of a package
        runpy.run_path(data_dir / 'prepare.py')['prepare'](data_dir)
    if world > 1:  # the others wait for rank 0's
        torch.distributed.barrier()
    if not meta_file.exists():
        die(f"dataset {dataset!r} is not prepared: run python data/{dataset}/prepare.py "
            f"(see README.md)")
    # get_batch starts its seq_len + 1 token windows before len - seq_len - 1; a dry run draws none
    try:
        meta = read_meta(data_dir, 0 if dry_run else seq_len + 2)
    except ValueError as e:
        die(e)
    meta['dir'] = data_dir
    # the ids against the vocabulary, on each split's first and last 2^20 tokens (cheap on any
    # corpus): one past vocab_size would be an IndexError in the embedding, mid-run
    for split in ('train', 'val'):
        ids = np.memmap(data_dir / f'{split}.bin', dtype=meta['dtype'], mode='r')
        largest = max(ids[:2**20].max(initial=0), ids[-2**20:].max(initial=0))
        if largest >= meta['vocab_size']:
            die(f"{data_dir / split}.bin holds token id {largest}, past meta.json's vocab_size="
                f"{meta['vocab_size']} (another tokenizer's data?): prepare it again")
    if not doc_mask:
        return meta
    starts = read_docs(meta, 'train')
    if starts is None:
        die(f"doc_mask=True: dataset {dataset!r} has no document boundaries (train.docs.npy): "
            f"prepare it again with its data/*/prepare.py, or set doc_mask=False")
    # said once: get_batch cuts them as it cuts the token stream
    longer = np.sum(np.diff(starts, append=meta['train_tokens']) > seq_len)
    if longer and rank == 0:
        print(f"note: {longer} training documents are longer than seq_len={seq_len}: a window "
              f"cuts them, each piece from position 0")
    return meta


# A micro-batch: inputs x [B, S] and next-token targets y (-100: not predicted). With doc_mask
# also each input's position in its document, and docs: the documents' starts in the flattened
# inputs (a numpy array: host metadata, model.attention); both None without.
Batch = namedtuple('Batch', 'x y positions docs', defaults=(None, None))


def get_batch(meta, split, n, generator, device):
    """n random windows of seq_len + 1 tokens: a Batch."""
    # a fresh memmap per batch: numpy's memmap otherwise keeps every page it touched resident
    data = np.memmap(Path(meta['dir'], f'{split}.bin'), dtype=meta['dtype'], mode='r')
    ix = torch.randint(len(data) - seq_len - 1, (n,), generator=generator).numpy()
    # t [n, seq_len + 1]: the windows' indices in the token stream
    t = np.add.outer(ix, np.arange(seq_len + 1))
    rows = data[t].astype(np.int64)
    if doc_mask:
        # n more rows: each token's place in its document, as if the window's first document
        # began at the window
        doc_starts = read_docs(meta, split)
        starts = np.maximum(doc_starts[np.searchsorted(doc_starts, t, 'right') - 1], t[:, :1])
        rows = np.concatenate([rows, t - starts])
    rows = torch.from_numpy(rows)
    if device.type == 'cuda':  # pinned: the copy below overlaps the previous step
        rows = rows.pin_memory()
    tokens, positions = rows.to(device, non_blocking=True).tensor_split([n])
    x, y = tokens[:, :-1], tokens[:, 1:]
    if not doc_mask:
        return Batch(x, y)
    # a document's first token is not predicted from the one before it
    y = y.masked_fill(positions[:, 1:] == 0, -100)
    docs = np.flatnonzero(rows[n:, :-1].numpy() == 0)
    return Batch(x, y, positions[:, :-1], docs)


def train_batches(meta, mesh, generator, device):
    """A step's micro-batches, this rank's share of each, and the lengths of the global batch's
    documents (doc_mask), else of its rows: MFU counts the attention pairs within them."""
    batches = [get_batch(meta, 'train', batch_size * mesh.dp, generator, device)
               for _ in range(gradient_accumulation_steps)]
    lengths = []
    for x, _, _, docs in batches:
        lengths.extend([seq_len] * len(x) if docs is None else np.diff(docs, append=x.numel()))
    # every rank samples the same global batch: shard_batch keeps our dp rank's rows and our
    # cp rank's tokens (one process: all of it)
    return [parallel.shard_batch(mesh, *batch) for batch in batches], lengths


# ---------------------------------------------------------------------------- one optimisation step
def dpcp_sum(t, mesh):
    """t summed over the ranks that split the step's tokens (dp x cp); t itself on one of them."""
    if mesh is None or mesh.dpcp_group is None:
        return t
    return parallel.all_reduce(t, mesh.dpcp_group)


def forward_backward(model, micro_batches, autocast, mesh=None, pipe=None, scaler=None):
    """Backward of the mean loss over every real target token of the step, returned detached (not
    a mean of per-micro-step means: micro-steps with more ignored targets must weigh less);
    backward runs on it times fp16's loss scale (scaler.scale; None: no scale). Under parallelism
    the count is the whole step's, over every dp × cp rank: the gradients summed over them are
    then the single-process ones."""
    scaler = scaler or optim.LossScaler()
    count = dpcp_sum(sum((y != -100).sum() for _, y, _, _ in micro_batches), mesh).clamp(min=1)
    if model.config.n_experts:  # their aux losses: a micro-step's mean, scaled as the loss is
        for layer in moe.moe_layers(model):
            layer.aux_weight = scaler.factor / len(micro_batches)
    if pipe is not None:
        # torch's schedule runs them, in its order (pipeline.py); the last stage has the loss,
        # scaled for its backward
        loss = pipe.step(micro_batches, count, scaler, fake=dry_run) / scaler.factor
        return dpcp_sum(parallel.all_reduce(loss, mesh.pp_group), mesh)
    total = 0.0
    for x, y, positions, docs in micro_batches:
        # this micro-step's mean, weighted; the logits are dropped here, or they would live
        # through backward (memory.py counts on it)
        with autocast:
            loss = model(x, y, positions, docs)[1] * ((y != -100).sum() / count)
        scaler.scale(loss).backward()
        total += loss.detach()
    return dpcp_sum(total, mesh)


def aux_loss(model, mesh):
    """The MoE layers' aux loss (moe.py) as one process computes it, averaged over the layers and
    the micro-steps since the last call (every rank calls it), then reset; None: a dense model."""
    if not model.config.n_experts:  # (no module walked for MoE layers)
        return None
    total = torch.zeros(())
    for layer in moe.moe_layers(model):
        total = total + layer.aux_loss / max(1, layer.aux_count)
        layer.aux_loss, layer.aux_count = 0.0, 0
    # each rank's layers and tokens' share (under sp a tp rank's tokens; else tp copies are equal;
    # a group of one rank is None)
    sp = mesh.sequence_parallel
    for group in (mesh.dpcp_group, mesh.pp_group, mesh.tp_group if sp else None):
        if group is not None:
            total = parallel.all_reduce(total, group)
    # (a mean over the MoE layers: Qwen3-MoE may keep some dense)
    c = model.config
    return total.item() / sum(map(c.is_moe, range(c.n_layer)))


def make_optimizer(model, masters, device_type, mesh=None):
    """torch's AdamW, and Muon for the blocks' matrices (optimizer='muon'), on fp32 master weights:
    under zero=2, 3 FSDP2's share per dp·cp rank; or our AdamW in backward (optim.py)."""
    named = list(model.named_parameters())
    # what torch steps: FSDP2's DTensors by their local rows (on DTensors of mixed placements it
    # gathers whole tensors)
    pieces = [parallel.local(m) for m in masters]
    # Muon: the blocks' matrices (Moonlight's split); AdamW: every other piece
    muon = [x for (n, _), x in zip(named, pieces) if optimizer == 'muon' and optim.muon_steps(n, x)]
    adamw = [x for x in pieces if all(x is not m for m in muon)]
    # weight decay on matrices only: norms' gains are not decayed (nanoGPT, Llama)
    groups = [{'params': [x for x in adamw if x.dim() >= 2], 'weight_decay': weight_decay},
              {'params': [x for x in adamw if x.dim() < 2], 'weight_decay': 0.0}]
    if optimizer_in_backward:
        optimizers = [optim.AdamWInBackward(groups, grad_clip or math.inf, learning_rate,
                                            (beta1, beta2))]
    else:
        # fused: one kernel for all parameters instead of a few per tensor, with no temporaries; on
        # a CPU it is also what makes the tiny models' step fast (2026-11-23, 2-core CPU, 4 layers
        # of width 128: 0.9 vs 5.9 ms); it reads found_inf on the device (optim.LossScaler)
        optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2),
                                        fused=device_type in ('cuda', 'cpu', 'mps'))]
    if muon:
        # its update's RMS matched to AdamW's (Moonlight): the same lr and weight decay serve both
        optimizers.append(torch.optim.Muon(muon, lr=learning_rate, weight_decay=weight_decay,
                                           adjust_lr_fn='match_rms_adamw'))
    return optim.MasterWeights(named, masters, pieces, optimizers, mesh or parallel.Mesh(),
                               model.config)


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # linear warmup: Adam's first updates are noisy at full lr
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    # (here warmup_iters <= it < decay_iters: the span is >= 1)
    ratio = (it - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train_step(model, batches, autocast, mesh, optimizer, pipe=None, scaler=None):
    """One step in GradScaler's order: forward and backward of every micro-batch on the scaled
    loss, the gradients synced (several ranks), unscaled (fp16) and clipped, the optimizer's step
    (skipped, as GradScaler skips one, if the loss or the gradient norm is not finite: on the
    device), the scale updated (optim.LossScaler; None: a scale of 1, as a dry run's step, whose
    bytes are the same). In backward (optim.py) each parameter stepped as backward made its
    gradient."""
    scaler = scaler or optim.LossScaler()
    loss = forward_backward(model, batches, autocast, mesh, pipe, scaler)
    checks = [loss]
    if not optimizer_in_backward:
        named_masters = list(zip(optimizer.names, optimizer.masters))  # (the model's names)
        if mesh.world > 1:  # each rank's gradients of the whole step (one process has them)
            parallel.sync_grads(named_masters, mesh, model.config)
        scaler.unscale_(optimizer.masters)
        # the whole model's norm, even unclipped (grad_clip=0: max_norm inf), to see a non-finite
        # one
        max_norm = grad_clip or math.inf
        if mesh.world == 1 and zero == 0:
            # one process holds every gradient whole: their squares summed as parallel.py sums a
            # rank's, to the bit (torch's clip_grad_norm_ takes a norm of norms: another rounding)
            squares = sum(torch.linalg.vector_norm(m.grad, dtype=torch.float32) ** 2
                          for m in optimizer.masters)
            norm = squares.sqrt()
            torch.nn.utils.clip_grads_with_norm_(optimizer.masters, max_norm, norm)
        else:  # every shard's squares, each element once
            norm = parallel.clip_grad_norm_(named_masters, max_norm, mesh, model.config)
        checks.append(norm)
    if dry_run:  # fake tensors hold no value to check: the step is taken (its bytes are the same)
        checks = []
    # updates the fp32 master rows, then the model's weights on every rank
    scaler.step(optimizer, *checks)
    scaler.update()
    optimizer.zero_grad()  # (to None)
    return loss


_MAX_SKIPS = 3  # non-finite steps in a row that end a run: a lone spike is skipped (GradScaler's)


def check_finite(scaler, iter_num, lr):
    """Stop without saving after _MAX_SKIPS skipped steps in a row (the scaler's count): the last
    checkpoint holds the last good weights."""
    n = int(scaler.skipped)
    if n >= _MAX_SKIPS:
        die(f"iter {iter_num - n}: the loss or gradient norm is not finite ({n} steps in a row, "
            f"lr {lr:g}); stopped without saving: resume the last checkpoint in {out_dir} with a "
            f"lower --learning_rate")


def make_out_dir(rank):
    """out_dir, made: the last check and the first thing written (a run stopped before leaves no
    out_dir). Rank 0 holds it (flock on out_dir/lock, naming the holder) until this process ends,
    crash included, the kernel letting go: a second run there stops here, having written nothing.
    Returns the lock's file (None on other ranks, and in a dry run: its stages run as processes of
    their own, each rank 0 to itself, and it trains nothing)."""
    if wandb_log and importlib.util.find_spec('wandb') is None:
        die("wandb_log=True needs wandb: pip install wandb")
    if dry_run and (Path(out_dir, 'ckpt').is_dir() or Path(out_dir, 'log.jsonl').exists()):
        die(f"out_dir={out_dir!r} holds a run: a dry run would overwrite its memory.json and "
            f"memory.svg (give the dry run another out_dir)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        die(f"out_dir={out_dir!r}: cannot create it: {e.strerror}")
    if rank > 0 or dry_run:
        return None
    path = Path(out_dir, 'lock')
    f = path.open('a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        die(f"out_dir={out_dir!r} is in use by another run ({path.read_text().strip()}): wait for "
            f"it to end, or use another out_dir")
    # the holder's name, through a file of its own: the lock is f's, and stays while f is open
    path.write_text(f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}")
    return f


@torch.no_grad()
def evaluate(model, meta, mesh, autocast, dev, pipe=None):
    """The mean val loss over eval_iters batches, the same batches at every eval."""
    model.eval()
    generator = torch.Generator().manual_seed(seed + 1)
    loss = 0  # [the sum of the batches' losses, each times its real targets; those targets]
    for _ in range(eval_iters):
        batch = get_batch(meta, 'val', batch_size * mesh.dp, generator, dev)
        x, y, positions, docs = parallel.shard_batch(mesh, *batch)  # (one process: all of it)
        with autocast:
            if pipe is None:
                mean = model(x, y, positions, docs)[1].float()
            else:  # pp: the last stage's, on every stage
                mean = pipe.evaluate(x, y, positions, docs)
        # each batch's mean weighs by its real targets (doc_mask ignores some), on every rank
        real = (y != -100).sum()
        loss += torch.stack([mean * real, real])
    model.train()
    for m in model.modules():
        if hasattr(m, 'reshard'):  # FSDP2: no backward came to free the gathered weights
            m.reshard()
    total, real = dpcp_sum(loss, mesh)
    return (total / real).item()


# ----------------------------------------------------------------------------- measurement
_PEAK_TFLOPS = {'H100': 989, 'H200': 989, 'H800': 989, 'A100': 312, 'A800': 312, 'L40S': 362,
                '4090': 165, 'A10G': 70, 'A10': 125}  # dense bf16, from the datasheets


def peak_flops(device, dtype, world):
    """The dense peak FLOP/s of `world` known GPUs (bf16; fp32 at half), to state MFU against;
    None elsewhere: a CPU has no figure worth trusting, and a matmul timed once at start on a
    shared machine swung MFU 61% to 488%."""
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else ''
    for key, tflops in _PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12 * world * (0.5 if dtype == torch.float32 else 1)
    return None


def peak_memory(device):
    """Bytes, the peak since the last call (the first: since start): the allocator's on CUDA, the
    process's resident set (VmHWM, Linux) elsewhere, or 0."""
    if device.type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    peak = 0
    with suppress(OSError):  # not Linux
        # 'VmHWM:    123456 kB'
        peak = int(Path('/proc/self/status').read_text().split('VmHWM:')[1].split()[0]) * 1024
    with suppress(OSError):  # not ours to write: the peak stays the one since start
        Path('/proc/self/clear_refs').write_text('5')  # VmHWM: the resident set now
    return peak


def write_log(rank, bar, row, val_loss, mem):
    """The progress bar's text and, on rank 0, a row of out_dir/log.jsonl (appended to: a run never
    loses an earlier run's rows)."""
    text = f"loss {row['loss']:.4f}"
    if val_loss is not None:
        row['val_loss'] = val_loss
        text += f" val {val_loss:.4f}"
    text += f" {row['tokens_per_s']:,.0f} tok/s"
    if row['mfu']:
        text += f" mfu {100 * row['mfu']:.1f}%"
    bar.set_postfix_str(text)
    if rank > 0:
        return
    if not mem.logged:  # the first row, after the measured step, carries its bytes (memory.json's)
        row['memory'] = {'estimate': mem.est.as_dict(), 'measured': mem.measured}
        mem.logged = True
    with Path(out_dir, 'log.jsonl').open('a') as log:
        print(json.dumps(row), file=log)
    if val_loss is not None:
        measure.write_curves(out_dir)  # curves.svg, the run so far
    if wandb_log:
        import wandb  # (start_log imported it)
        wandb.log(row, step=row['iter'])
    if bar.disable:  # not a terminal: a plain line per log step instead of the bar
        print(f"iter {row['iter']}: {text}", flush=True)


def start_log(cfg, config, mesh):
    """The run's size said (rank 0; the device, dtype and layout: in the memory report's title);
    with wandb_log, a Weights & Biases run in out_dir/wandb, the config its config. wandb is
    imported here only: it is no requirement of the trainer."""
    tokens_per_iter = gradient_accumulation_steps * batch_size * mesh.dp * seq_len  # global batch
    print(f"{num_params(config) / 1e6:.2f}M parameters (non-embedding), "
          f"{tokens_per_iter:,} tokens per step")
    if not wandb_log:
        return
    import wandb  # (make_out_dir checked it is installed)
    wandb.init(project=wandb_project, name=wandb_run_name, config=cfg, dir=out_dir)


# ----------------------------------------------------------------------------- setup
def device_and_dtype():
    """The device, the weights' dtype and the autocast context (bf16 on CUDA, fp16 on a CUDA GPU
    without bf16, fp32 elsewhere)."""
    if dry_run:
        # memory.py: rank 0 of WORLD_SIZE (else tp x cp x pp) ranks; this CPU (fake tensors)
        # stands in for their CUDA devices
        os.environ.setdefault('WORLD_SIZE', str(tp_size * cp_size * pp_size))
    # 'auto': the first this machine has
    dev = torch.device('cpu' if dry_run else pick_device(device))
    # 'auto': fp16 on a CUDA GPU without bf16, bf16 on the others (and a dry run's target), fp32
    # elsewhere
    ptdtype = torch.float32
    if dtype != 'auto':
        ptdtype = getattr(torch, dtype)
    elif dev.type == 'cuda' and not torch.cuda.is_bf16_supported():
        ptdtype = torch.float16
        if os.environ.get('RANK', '0') == '0':  # the first line the run prints
            print(f"dtype='auto': float16 with loss scaling ({torch.cuda.get_device_name(dev)} "
                  f"has no bfloat16)")
    elif dev.type == 'cuda' or dry_run:
        ptdtype = torch.bfloat16
    if ptdtype == torch.float16 and optimizer_in_backward:
        die("optimizer_in_backward=True with dtype float16: a parameter's step can't wait for "
            "the step's overflow check (loss scaling); use dtype='bfloat16' or 'float32'")
    # TF32 for fp32 matmuls (CUDA only; cuDNN has it by default). Not
    # set_float32_matmul_precision: that also changes the CPU's (oneDNN) fp32 matmuls
    torch.backends.cuda.matmul.allow_tf32 = True
    # fp32: a disabled autocast, no context of its own
    autocast = torch.autocast(dev.type, dtype=ptdtype, enabled=ptdtype != torch.float32)
    return dev, ptdtype, autocast


def model_config(meta, cfg, world, dev, ptdtype):
    """The model's config, settled before anything is built: the keys' (scratch), the checkpoint's
    model_args (resume) or a Hugging Face directory's config.json (its weights are read by
    build_model), checked against the layout and the data; returns (config, checkpoint or
    None)."""
    knobs = {k: cfg[k] for k in KNOBS}  # how forward runs: free to change on resume
    # the model's keys that were given (None: not given)
    given = {f.name: cfg[f.name] for f in fields(Knobs) if cfg[f.name] is not None}
    ckpt = None
    if init_from != 'resume' and not (overwrite or dry_run) and checkpoint.latest(out_dir):
        die(f"{out_dir} holds a checkpoint: --init_from=resume continues it, --overwrite=True "
            f"starts a new run (the old checkpoint stays until the new run saves one)")
    # a ValueError here is the user's input (Knobs' rules, a HF directory's files), not a
    # bug of ours
    if dry_run and init_from not in ('scratch', 'resume'):
        print(f"dry run: no weights read; the model's shape is {init_from}/config.json's where it "
              f"exists, else the config's")
    try:
        if init_from == 'resume':
            ckpt = checkpoint.resume(out_dir, cfg)  # the weights load after sharding (main)
            # the ids' meaning: another tokenizer's data trains the model on nonsense (older
            # checkpoints don't say)
            made = ckpt.get('tokenizer', tokenizer_name(meta))
            if made != tokenizer_name(meta):
                die(f"{out_dir} was trained on data of tokenizer {made}, dataset {dataset!r} is "
                    f"of {tokenizer_name(meta)}: prepare it again with the run's tokenizer")
            config = Knobs(**ckpt['model_args'], **knobs)
        elif init_from == 'scratch' or not os.path.isdir(init_from):  # (a dry run's: the config's)
            config = Knobs(**{**given, 'vocab_size': vocab_size or meta['vocab_size']})
        else:
            # its architecture, but a rope_theta or rope_scaling given: a new one extends the
            # model's context. The tokenizer first: another tokenizer's ids are nonsense to it
            check_tokenizer(meta, init_from)
            rope = {k: v for k, v in given.items() if 'rope' in k}
            config = with_knobs(read_config(init_from, **rope), **knobs)
    except ValueError as e:
        die(e)
    # this layout's rules (parallel.check_layout), on every rank, before anything is allocated
    why = parallel.check_layout(config, world, tp_size, cp_size, cp_impl, seq_len, zero, dev.type,
                                ptdtype, offload_states, pp_size, gradient_accumulation_steps,
                                pp_schedule, ep_size, cp_ring)
    if why:
        die(why)
    if meta['vocab_size'] > config.vocab_size:
        die(f"dataset {dataset!r} has vocab_size {meta['vocab_size']} ({meta.get('tokenizer')}), "
            f"more than the model's {config.vocab_size}: prepare it with the model's tokenizer")
    return config, ckpt


def build_model(config):
    """The model of config, once config is final, on one device: a Hugging Face directory's
    weights read into it, else initialised from the seed (a checkpoint's weights load after
    sharding: main). A dry run's is shapes only, on the meta device: no weights read, nothing
    allocated."""
    with torch.device('meta') if dry_run else nullcontext():
        if init_from in ('scratch', 'resume') or dry_run:
            return Llama(config)
        try:
            # config is config.json's with our knobs and RoPE: its every field over the file's
            return Llama.from_pretrained(init_from, **architecture(config))
        except ValueError as e:  # a shard missing, a tensor of the wrong shape: the user's files
            die(e)


def place_model(model, config, mesh, dev, ptdtype):
    """The techniques applied to the built model, in this order (each replaces or wraps whole
    modules, the state-dict names kept), then this rank's share of it on its device in its weights'
    dtype: every rank built the same full model, from the seed."""
    # 1. sharded (and staged) for this rank; one process keeps it whole
    if mesh.world > 1:
        parallel.parallelize(model, mesh)
    # 2. the layout's attention core: packed documents or sliding windows on CUDA take varlen's
    # kernel (not one call per document, nor SDPA with an S x S mask). A dry run stands in for
    # CUDA devices: varlen True (model.attention asks only where there are documents or windows);
    # None: the device decides
    varlen = True if dry_run else None
    parallel.apply_cores(model, mesh, varlen)
    # 3. the MLP's mini-sequences, the chunked loss (vocabulary parallel over tp), head groups
    # (Ulysses spreads a head group's heads over its cp_size / cp_ring ranks)
    chunked.apply(model, config, mesh.cp // mesh.cp_ring, mesh.tp_group)
    # 4. keep, recompute or offload each block's activations (every knob off: no block wrapped)
    offload_policy.apply(model, config)
    # zero=2, 3: fp32 rows are the masters, FSDP2 gathers them in ptdtype
    weights_dtype = torch.float32 if zero > 1 else ptdtype
    if dry_run:
        measure.to_fake(model, weights_dtype)
    else:
        model.to(device='cpu' if offload_states else dev, dtype=weights_dtype)
    # 5. FSDP2 shards the states over the dp x cp ranks, block by block via the GPU
    if zero > 1:
        parallel.shard_states(model, mesh, zero, ptdtype, offload_states)


def dry_run_step(mem, config, model, raw_model, autocast, mesh, optimizer, pipe):
    """One step on fake tensors, measured: the table and the verdict (measure.py). A stage of up to
    n + 1 blocks (or dry_run_full) runs it here; a longer one runs it with n and n + 1 blocks and
    extrapolates; under pp the last stage's dry run follows."""
    # n: the fewest blocks a stage extrapolates from, the first, one between, the last KEEP_LAST
    blocks, n = len(raw_model.layers), offload_policy.KEEP_LAST + 2
    if dry_run_full or dry_run_anatomy or blocks <= n + 1:
        # two micro-steps show what gradient accumulation adds; under pp one more than rank 0's
        # stage keeps in flight
        micro_steps = min(gradient_accumulation_steps, 2 if pipe is None else pipe.in_flight + 1)
        # made before the step: they are not the step's
        batches = [parallel.shard_batch(mesh, *measure.fake_batch(
            batch_size * mesh.dp, seq_len, config.vocab_size, doc_mask))
            for _ in range(micro_steps)]
        with mem.measure(pipe or raw_model, optimizer.masters, optimizer):
            train_step(model, batches, autocast, mesh, optimizer, pipe)
    else:
        # every block of a long stage measured on fake tensors takes minutes, and its blocks'
        # moments repeat: what one more block adds to each moment extrapolates them all, to the
        # byte (measure.extrapolate)
        fewer = measure.few_blocks(n, config, mesh, mem.name)
        more = measure.few_blocks(n + 1, config, mesh, mem.name)
        timeline = measure.extrapolate(fewer, more, n, blocks, mesh.pp_rank)
        print(f"(this stage's {blocks} blocks: measured with {n} and {n + 1}, each moment "
              f"extrapolated from what one more block adds to it; --dry_run_full=True measures "
              f"all {blocks})")
        mem.report(dict(measure.peak(timeline)), timeline=timeline)
    # the user's command (not a stage's run of it) under pp: rank 0 measured the first stage only.
    # The last stage holds what rank 0's does not (the final norm, the LM head and the loss) and
    # the fewest micro-batches in flight: the command again as the last rank (its table, verdict
    # and memory.rank<r>.json)
    if mesh.pp > 1 and mesh.pp_rank == 0 and 'RANK' not in os.environ:
        measure.rerun(mesh.world - 1, f"the last pipeline stage (rank {mesh.world - 1})")


def catch_signals():
    """SIGINT / SIGTERM: the loop finishes its step, saves and exits 0; a second signal interrupts
    at once. Returns the list of the signals received."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    return received


def setup(cfg):
    """What a run and an evaluation (eval.py) set up alike, in this order: the device and dtype,
    the ranks, the data, the model's config and this layout's mesh, the memory report, the model
    built on one device (place_model then applies the techniques). Returns (device, dtype,
    autocast, rank, meta, config, checkpoint or None, mesh, report, model)."""
    dev, ptdtype, autocast = device_and_dtype()
    torch.manual_seed(seed)  # on every rank: each builds the same full model, then shards it
    world, rank, local_rank = parallel.init_distributed(dev.type, dry_run, timeout_s,
                                                        one=offload_states)
    if world > 1 and dev.type == 'cuda':
        dev = torch.device('cuda', local_rank)
    meta = read_dataset(world, rank)
    config, ckpt = model_config(meta, cfg, world, dev, ptdtype)  # (nothing is built from it yet)
    # the ranks' grid; one process: Mesh(), every size 1 (a dry run's: on the CPU)
    mesh = parallel.make_mesh(tp_size, cp_size, cp_impl, config.n_kv_head, timeout_s=timeout_s,
                              device_type=dev.type, pp=pp_size, ep=ep_size, cp_ring=cp_ring)
    mem = measure.Report(config, cfg, world, rank, mesh, dev, ptdtype)  # (it changes nothing)
    if auto_memory:  # the cheapest memory knobs that fit (the layout's rules allow them)
        config = replace(config, **mem.auto_memory())
    model = build_model(config)  # (a bad HF file: stopped before out_dir)
    return dev, ptdtype, autocast, rank, meta, config, ckpt, mesh, mem, model


# -----------------------------------------------------------------------------
def main():
    """Setup, in the order it happens, then the loop: evaluate, set the lr, step, log."""
    cfg = configure(globals())  # a config file, then --key=value, over the defaults above
    check(cfg, RULES)
    dev, ptdtype, autocast, rank, meta, config, ckpt, mesh, mem, model = setup(cfg)
    world = mesh.world
    lock = make_out_dir(rank)  # (held while main runs)
    mem.check(config)  # the estimate, before anything is on the device: can it fit? (80% rule)
    place_model(model, config, mesh, dev, ptdtype)
    masters = optim.make_master_weights(model, optimizer_in_backward)
    optimizer = make_optimizer(model, masters, dev.type, mesh)
    scaler = optim.LossScaler(ptdtype == torch.float16, dev, (ckpt or {}).get('loss_scale'))
    data_gen = torch.Generator().manual_seed(seed)
    iter_num, best_val_loss = 0, math.inf
    if ckpt:  # weights, masters, moments and RNGs of any layout, into our pieces
        checkpoint.load(ckpt['path'], model, optimizer, mesh, data_gen)
        iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
    if rank == 0:  # the estimate, only now: a run stopped before has written nothing but its lock
        mem.write()
    raw_model = model
    model = torch.compile(model) if compile else model
    pipe = (pipeline.Pipeline(model, mesh, pp_schedule, gradient_accumulation_steps, autocast, dev)
            if pp_size > 1 else None)  # pp: torch's pipeline schedule over this rank's stage
    if dry_run:
        return dry_run_step(mem, config, model, raw_model, autocast, mesh, optimizer, pipe)
    device_flops = peak_flops(dev, ptdtype, world)  # MFU is per device: against all of them
    if rank == 0:
        start_log(cfg, config, mesh)

    def save():
        """A checkpoint of the run as it is now (every rank calls it); its directory."""
        return checkpoint.save(out_dir, raw_model, optimizer, mesh, data_gen, iter_num=iter_num,
                               best_val_loss=best_val_loss, config=cfg, loss_scale=scaler.state(),
                               tokenizer=tokenizer_name(meta))
    signals = catch_signals()  # the signals this rank received
    stop = False  # what every rank agreed on
    bar = tqdm(total=max_iters, initial=iter_num, dynamic_ncols=True, disable=rank > 0 or None)
    # the documents since the last row: tokens/s, their tokens over the time since t0; MFU's pairs
    t0, lengths = time.perf_counter(), []
    peak_memory(dev)  # (starts the peak the first row reports)
    while iter_num < max_iters and not stop:
        val_loss = None
        if iter_num % eval_interval == 0 or iter_num == max_iters - 1:
            t_eval = time.perf_counter()
            val_loss = evaluate(model, meta, mesh, autocast, dev, pipe)
            best_val_loss = min(best_val_loss, val_loss)
            if always_save_checkpoint and iter_num > 0:
                save()
            t0 += time.perf_counter() - t_eval  # tokens/s counts training time only
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group['lr'] = lr
        batches, step_lengths = train_batches(meta, mesh, data_gen, dev)
        lengths += step_lengths
        sent = offload_policy.stats()['bytes_to_host']
        with mem.measure(pipe or raw_model, masters, optimizer, compiled=compile):  # the first step
            loss = train_step(model, batches, autocast, mesh, optimizer, pipe, scaler)
        iter_num += 1
        bar.update()
        if world == 1:
            stop = bool(signals)
        if (iter_num - 1) % log_interval and val_loss is None and iter_num < max_iters and not stop:
            continue
        tokens_per_s = sum(lengths) / (time.perf_counter() - t0)
        mfu_flops, hfu_flops = flops_per_token(config, *lengths), hardware_flops(config, *lengths)
        # loss.item(): the step's only host sync; mfu None: no trusted peak; flops_per_token: the
        # model's, mfu's count (model.flops_per_token: causal attention's pairs, S(S + 1)/2)
        row = {'iter': iter_num - 1, 'loss': loss.item(), 'lr': lr, 'tokens_per_s': tokens_per_s,
               'flops_per_token': mfu_flops,
               'mfu': device_flops and tokens_per_s * mfu_flops / device_flops,
               'hfu': device_flops and tokens_per_s * hfu_flops / device_flops,
               'peak_mem_bytes': peak_memory(dev),
               'offload_bytes': offload_policy.stats()['bytes_to_host'] - sent,
               'loss_scale': scaler.state(),  # fp16's [scale, clean steps]; else None
               'aux_loss': aux_loss(raw_model, mesh)}
        write_log(rank, bar, row, val_loss, mem)
        check_finite(scaler, iter_num, lr)
        t0, lengths = time.perf_counter(), []
        if world > 1:  # ranks may see a signal in different steps: they agree on log steps only
            stop = bool(parallel.all_reduce(torch.tensor(len(signals), device=dev), None).item())
    bar.close()
    path = save()
    if rank == 0 and stop:
        print(f"stopped by a signal at iter {iter_num}; checkpoint saved in {path} (continue with "
              f"--init_from=resume)")
    elif rank == 0:
        print(f"done: {iter_num} iters, best val loss {best_val_loss:.4f}, checkpoint {path}")


if __name__ == '__main__':
    try:
        main()
    except checkpoint.Error as e:  # a crafted or damaged checkpoint, a full disk: the user's
        die(e)
    except RuntimeError as e:  # what gloo raises; NCCL's DistBackendError is one too
        collective_failed(e, timeout_s)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
