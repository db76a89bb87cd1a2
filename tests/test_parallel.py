"""parallel.py against one process: for every layout, one training step's loss, every gradient (gathered
from the shards) and the updated weights equal the single-process step (fp32, relative 1e-5); the
collectives per block are what parallel.py's header says; a vocabulary shard of padding only, eval under
no_grad and a fork's attention variant (a sliding window) behave as in one process; check_layout refuses
what can't run in one line; train.py under torchrun gives the single-process losses, resumes exactly,
and a rank that raises takes every rank down.

Ranks are spawned processes on gloo (CPU). One spawn of 2 ranks and one of 4 run every layout of that
size (process start-up is most of the cost), each writing what rank 0 gathered; the tests compare."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import offload  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import ring  # noqa: E402
import train  # noqa: E402
from knobs import Knobs  # noqa: E402
from model import Llama  # noqa: E402
from conftest import apply_techniques, cuda  # noqa: E402
from test_chunked import CountMatmuls  # noqa: E402

RTOL = 1e-5
# 37 is divisible by neither 2 nor 4: the vocabulary is padded; chunked MLP and loss; GQA
MODEL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=37,
             mlp_chunks=3, loss_chunks=3)
B, S = 4, 16

# Qwen's differences together (model.py): a decoupled head width (4 heads of 12 on a 32 wide model), biases on q, k
# and v (each tp rank's rows of them, copied with kv heads when K < t), norms of each head's q and k (replicated over
# tp: each rank's heads give a share of their gradients, summed over tp with sp or without)
QWEN = dict(head_dim=12, attention_bias=True, qk_norm=True)

# name: (world, tp, cp, cp_impl, sequence_parallel, zero, model overrides)
LAYOUTS = {
    'tp':            (2, 2, 1, 'ulysses', False, 0, dict(recompute='selective')),
    'sp':            (2, 2, 1, 'ulysses', True, 0, dict(n_kv_head=1, recompute='full')),  # kv heads < tp
    'cp_ulysses':    (2, 1, 2, 'ulysses', True, 0, dict(recompute='selective')),
    'cp_ring':       (2, 1, 2, 'ring', True, 0, dict(recompute='full')),
    'dp':            (2, 1, 1, 'ulysses', True, 0, {}),
    'dp_zero2':      (2, 1, 1, 'ulysses', True, 2, {}),
    'dp_zero3':      (2, 1, 1, 'ulysses', True, 3, dict(recompute='full', offload=1.0)),
    'dp_zero3_host': (2, 1, 1, 'ulysses', True, 3, dict(host=True)),  # offload_states: FSDP2's rows on the host
    'tp4_gqa':       (4, 4, 1, 'ulysses', True, 0, dict(tie_embeddings=True)),  # 2 kv heads on 4 ranks
    'tp_cp_ulysses': (4, 2, 2, 'ulysses', True, 0, {}),  # 1 kv head per tp rank, 2 cp ranks: replicated
    'tp_cp_ring':    (4, 2, 2, 'ring', True, 0, dict(n_kv_head=1, recompute='full')),
    'dp_tp':         (4, 2, 1, 'ulysses', True, 0, {}),
    'dp_cp_zero2':   (4, 1, 2, 'ulysses', True, 2, dict(recompute='selective')),
    'dp_tp_zero3':   (4, 2, 1, 'ulysses', True, 3, {}),
    # V = 5 on tp 4: 2 rows per rank, rank 3's are all padding (it gave a NaN loss: -inf · 0)
    'tp4_vocab5':    (4, 4, 1, 'ulysses', True, 0, dict(vocab_size=5)),
    # sliding windows (sliding_window, layer_types): under tp + sp by head groups, Ulysses with documents, the ring
    # with a window longer than its chunks (S / 2c = 4 tokens) and, on cp 4, shorter (2 chunks of 2: steps skipped)
    # with documents and a full layer among the windowed
    'tp_window':     (2, 2, 1, 'ulysses', True, 0, dict(sliding_window=5, n_head=8, n_kv_head=4,
                                                        attention_chunks=2)),
    'cp_window':     (2, 1, 2, 'ulysses', True, 0, dict(sliding_window=3, docs=True, recompute='selective')),
    'ring_window':   (2, 1, 2, 'ring', True, 0, dict(sliding_window=5, recompute='full')),
    'ring4_window':  (4, 1, 4, 'ring', True, 0, dict(sliding_window=2, docs=[[1] * 16, [16], [2, 13, 1], [1, 1, 14]],
                                                     layer_types=['sliding_attention', 'full_attention'])),
    # packed documents (doc_mask): attention within each, as in one process (which equals each alone: test_model)
    'tp_docs':       (2, 2, 1, 'ulysses', True, 0, dict(docs=True, recompute='selective')),
    'cp_docs':       (2, 1, 2, 'ulysses', True, 0, dict(docs=True, recompute='full')),
    # and over dp (each rank its rows' documents) with FSDP2's sharded states
    'dp_docs_zero2': (2, 1, 1, 'ulysses', True, 2, dict(docs=True)),
    'dp_docs_zero3': (2, 1, 1, 'ulysses', True, 3, dict(docs=True, recompute='full')),
    # attention by head groups (attention_chunks): each against one process with all heads at once (reference)
    'tp_groups':     (2, 2, 1, 'ulysses', True, 0, dict(n_head=8, n_kv_head=4, attention_chunks=2,
                                                        recompute='selective')),
    'cp_groups':     (2, 1, 2, 'ulysses', True, 0, dict(n_head=8, n_kv_head=4, attention_chunks=0)),  # 4
    'ring_groups':   (2, 1, 2, 'ring', True, 0, dict(attention_chunks=2, recompute='full')),
    'docs_groups':   (2, 1, 2, 'ulysses', True, 0, dict(n_head=8, n_kv_head=4, docs=True, attention_chunks=2,
                                                        recompute='full')),
    'zero3_groups':  (2, 1, 1, 'ulysses', True, 3, dict(attention_chunks=2, recompute='full', offload=1.0)),
    'tp_cp_groups':  (4, 2, 2, 'ulysses', True, 0, dict(n_head=8, n_kv_head=4, attention_chunks=0)),  # 2
    # packed documents under ring attention: each step attends within documents, cut anywhere by the zigzag chunks
    'ring_docs':     (2, 1, 2, 'ring', True, 0, dict(docs=True, recompute='full')),
    'tp_ring_docs':  (4, 2, 2, 'ring', True, 0, dict(docs=True, recompute='full')),
    # cp 4 (8 chunks of 2 tokens): 16 one-token documents, a window that is one document, documents across 3 and
    # more ranks' chunks
    'ring4_docs':    (4, 1, 4, 'ring', True, 0, dict(docs=[[1] * 16, [16], [2, 13, 1], [1, 1, 14]], recompute='full')),
    # the Qwen block (QWEN) under tp without and with sp (kv heads copied), Ulysses with documents, the ring with a
    # window, FSDP2 with head groups and offload, tp x Ulysses by head groups
    'tp_qwen':       (2, 2, 1, 'ulysses', False, 0, dict(QWEN, recompute='selective')),
    'sp_qwen':       (2, 2, 1, 'ulysses', True, 0, dict(QWEN, n_kv_head=1, recompute='full', offload=1.0)),
    'cp_qwen':       (2, 1, 2, 'ulysses', True, 0, dict(QWEN, docs=True, recompute='selective')),
    'ring_qwen':     (2, 1, 2, 'ring', True, 0, dict(QWEN, sliding_window=5, recompute='full')),
    'zero3_qwen':    (2, 1, 1, 'ulysses', True, 3, dict(QWEN, attention_chunks=2, recompute='full', offload=1.0)),
    'tp_cp_qwen':    (4, 2, 2, 'ulysses', True, 0, dict(QWEN, n_head=8, n_kv_head=4, attention_chunks=0)),  # 2
    # context parallelism in two dimensions, Ulysses 2 x the ring 2 (cp_ring, parallel.py's c = u x r): documents
    # cut by both splits, a window (3) shorter than a ring chunk (S / 2r = 4), head groups, offload under
    # recompute, and one kv head that Ulysses copies to its two ranks (Qwen's block)
    'u2_ring2_docs':    (4, 1, 4, 'ulysses', True, 0, dict(cp_ring=2, docs=True, recompute='full')),
    'u2_ring2_window':  (4, 1, 4, 'ulysses', True, 0, dict(cp_ring=2, sliding_window=3, docs=[[1] * 16, [16],
                                                           [2, 13, 1], [1, 1, 14]], recompute='full')),
    'u2_ring2_groups':  (4, 1, 4, 'ulysses', True, 0, dict(cp_ring=2, n_head=8, n_kv_head=4, attention_chunks=2,
                                                           recompute='full')),
    'u2_ring2_offload': (4, 1, 4, 'ring', True, 0, dict(cp_ring=2, recompute='full', offload=1.0)),
    'u2_ring2_qwen':    (4, 1, 4, 'ulysses', True, 0, dict(QWEN, cp_ring=2, n_kv_head=1, recompute='full')),
}
# the head groups attention runs per block in the layouts above (attention_chunks; 0 resolved by chunked.py)
GROUPS = {'cp_groups': 4, 'ring_groups': 2, 'docs_groups': 2, 'tp_cp_groups': 2, 'tp_window': 2, 'tp_cp_qwen': 2,
          'u2_ring2_groups': 2}
DOC_LENS = [[5, 11], [16], [3, 3, 10], [9, 7]]  # the documents of global_batch's rows, for 'docs' layouts


def doc_lens(overrides):
    """The documents of a layout's rows: docs=True takes DOC_LENS; a list, its own; None: no doc_mask."""
    docs = overrides.get('docs')
    return DOC_LENS if docs is True else docs
LR = 0.1
# AdamW's first step moves a weight by lr·g/(|g| + eps): for a gradient near 0 a change δg in its
# last bits (reduction order) moves the weight by up to lr·δg/eps. torch's eps=1e-8 let a 1e-11
# rounding of one gradient move its weight by 1.2e-3·lr on CI; 1e-6 bounds that well below the
# Decision's 1e-3·lr while a wrong shard or a missed update still moves weights by about lr.
EPS = 1e-6


def model_config(overrides):
    return Knobs(**{**MODEL, **{k: v for k, v in overrides.items() if k not in ('docs', 'host', 'cp_ring')}})


def new_model(overrides, mesh=None):
    """Llama from seed 0 (the same on every rank), before the techniques apply."""
    torch.manual_seed(0)
    return perturbed(Llama(model_config(overrides)))


def perturbed(model):
    """Qwen's biases and q, k norms moved off their init (zeros, ones), the same on every rank: a bias shard or a norm
    out of place then changes the loss."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('bias', 'q_norm.weight', 'k_norm.weight')):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def global_batch(vocab_size=MODEL['vocab_size']):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab_size, (B, S), generator=g)
    y = torch.randint(0, vocab_size, (B, S), generator=g)
    y[0, :11] = -100  # dp ranks and micro-steps with different numbers of real targets
    y[3, 5:9] = -100
    return x, y


def gather_full(named_tensors, mesh, config, grads=False):
    """{name: full tensor} on every rank: the tp pieces of each parameter (or its .grad) all-gathered and
    put back together: kv heads replicated when K < t counted once, the vocabulary's padding rows cut."""
    out = {}
    for n, p in named_tensors:
        t = p.grad if grads else p.data
        t = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()  # zero=2, 3: FSDP2's rows gathered
        spec = parallel.shard_spec(n, config, mesh.tp)
        if spec is not None:
            pieces = parallel.all_gather(t.unsqueeze(0), 0, mesh.tp_group).unbind(0)
            if spec[1] == 'kv' and config.n_kv_head < mesh.tp:
                pieces = pieces[::mesh.tp // config.n_kv_head]
            t = torch.cat(pieces, spec[0])[:config.vocab_size] if spec[1] == 'vocab' else torch.cat(pieces, spec[0])
        out[n] = t.clone()
    return out


def one_step(model, mesh, config, zero, docs=None):
    """A train.py step: two micro-batches (this rank's rows, this cp rank's tokens; with docs, packed documents),
    grad sync, clipping at a norm it reaches, then SGD (AdamW for zero=2, 3). Returns (loss, grad norm, grads, new
    weights)."""
    from conftest import packed_batch
    x, y = global_batch(config.vocab_size)
    micro = [(x[i::2], y[i::2]) if not docs else packed_batch(docs[i::2], config.vocab_size, seed=i)
             for i in range(2)]  # 2 micro-steps of 2 rows
    micro = [parallel.shard_batch(mesh, *m) for m in micro]
    loss = train.forward_backward(model, micro, nullcontext(), mesh)
    named = list(model.named_parameters())
    parallel.sync_grads(named, mesh, config)
    norm = parallel.clip_grad_norm_(named, 0.5, mesh, config)
    grads = gather_full(named, mesh, config, grads=True)
    if zero:
        params = [p for _, p in named]
        pieces = [parallel.local(p) for p in params]
        opt = optim.MasterWeights(named, params, pieces, [torch.optim.AdamW(pieces, lr=LR, eps=EPS)], mesh, config)
    else:
        opt = torch.optim.SGD([p for _, p in named], lr=LR)
    opt.step()
    return loss.item(), norm.item(), grads, gather_full(named, mesh, config)


def reference(overrides, zero):
    # one process, all heads at once: a layout with attention_chunks equals attention_chunks=1
    overrides = {k: v for k, v in overrides.items() if k != 'attention_chunks'}
    model = apply_techniques(new_model(overrides))
    return one_step(model, parallel.Mesh(), model.config, zero, doc_lens(overrides))


def eval_matmuls(model, mesh):
    """Matmuls of an eval forward (no_grad) on this rank's share of the batch: the LM head's loss does the
    logits only (3 chunks, 3 matmuls), with or without tensor parallelism."""
    x, y, *pos = parallel.shard_batch(mesh, *global_batch(model.config.vocab_size))
    with torch.no_grad(), CountMatmuls() as count:
        model(x, y, *pos)
    return count.n


# ----------------------------------------------------------------------------- the spawned ranks

COUNTED = ('all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'ring_shift')


def count_collectives(fn):
    """How many times each collective runs inside fn() (parallel's functions, wrapped)."""
    counts = dict.fromkeys(COUNTED, 0)
    home = {name: ring if name == 'ring_shift' else parallel for name in COUNTED}  # the module that calls it
    saved = {name: getattr(home[name], name) for name in COUNTED}

    def wrap(name):
        def counted(*args, **kw):
            counts[name] += 1
            return saved[name](*args, **kw)
        return counted
    for name in COUNTED:
        setattr(home[name], name, wrap(name))
    try:
        fn()
    finally:
        for name, f in saved.items():
            setattr(home[name], name, f)
    return {k: v for k, v in counts.items() if v}


def per_block_counts(mesh, overrides):
    """Collectives of one forward + backward with 2 layers minus with 1: what one block costs."""
    def run(n_layer):
        layers = {'n_layer': n_layer}
        if overrides.get('layer_types'):
            layers['layer_types'] = overrides['layer_types'][:n_layer]
        model = apply_techniques(new_model({**overrides, **layers}), mesh)
        x, y = global_batch(model.config.vocab_size)
        x, y, *pos = parallel.shard_batch(mesh, x, y)
        return count_collectives(lambda: model(x, y, *pos)[1].backward())
    one, two = run(1), run(2)
    return {k: two.get(k, 0) - one.get(k, 0) for k in two if two.get(k, 0) != one.get(k, 0)}


def record_sync_buffers(step, model):
    """Run step() with BUCKET_BYTES = 8 KiB (the largest gradients of MODEL): the bytes of every tensor
    sync_grads all-reduces that is not itself a gradient (a bucket's copy), and how many calls it made."""
    calls, real_all_reduce, real_sync = [], parallel.all_reduce, parallel.sync_grads

    def sync(*args, **kw):
        parallel.all_reduce = lambda x, *a, **k: calls.append((x.data_ptr(), x.nbytes)) or real_all_reduce(x, *a, **k)
        try:
            return real_sync(*args, **kw)
        finally:
            parallel.all_reduce = real_all_reduce
    parallel.sync_grads, bucket, parallel.BUCKET_BYTES = sync, getattr(parallel, 'BUCKET_BYTES', None), 8192
    try:
        step()
    finally:
        parallel.sync_grads, parallel.BUCKET_BYTES = real_sync, bucket
    grads = {parallel.local(p.grad).data_ptr() for p in model.parameters()}
    return {'calls': len(calls), 'largest_copy': max((n for ptr, n in calls if ptr not in grads), default=0),
            'grad_bytes': sum(parallel.local(p.grad).nbytes for p in model.parameters())}


@pytest.mark.parametrize('name', [n for n, layout in LAYOUTS.items() if (layout[0] // (layout[1] * layout[2]) > 1
                                  or layout[2] > 1) and layout[5] < 2])  # zero=2, 3: FSDP2 reduce-scatters
def test_gradients_are_summed_in_buckets(results, name):
    """Over dp × cp every gradient is summed, a bucket at a time: no copy is larger than a bucket (before,
    one flat fp32 copy of every gradient: 4 bytes per parameter more at the peak)."""
    sync = results[name]['sync']
    assert 0 < sync['largest_copy'] <= 8192 < sync['grad_bytes'], sync
    assert sync['calls'] >= sync['grad_bytes'] // 8192


def _worker(rank, world, port, names, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    for name in names:
        _, tp, cp, cp_impl, sp, zero, overrides = LAYOUTS[name]
        config = model_config(overrides)
        mesh = parallel.make_mesh(tp, cp, cp_impl, config.n_kv_head, sp, cp_ring=overrides.get('cp_ring', 0))
        model = apply_techniques(new_model(overrides), mesh)
        if zero > 1:
            parallel.shard_states(model, mesh, zero, torch.float32, overrides.get('host', False))
        matmuls = eval_matmuls(model, mesh)
        result = one_step(model, mesh, config, zero, doc_lens(overrides))
        sync = record_sync_buffers(lambda: one_step(model, mesh, config, zero), model)
        counts = per_block_counts(mesh, {k: v for k, v in overrides.items() if k != 'recompute'})
        counts_recompute = per_block_counts(mesh, {**overrides, 'recompute': 'full'})
        if rank == 0:
            torch.save({'step': result, 'block': counts, 'block_recompute': counts_recompute, 'eval': matmuls,
                        'sync': sync},
                       os.path.join(out_dir, f'{name}.pt'))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp('parallel')
    for world in (2, 4):
        names = [n for n, layout in LAYOUTS.items() if layout[0] == world]
        mp.spawn(_worker, args=(world, free_port(), names, str(out)), nprocs=world)
    return {name: torch.load(out / f'{name}.pt') for name in LAYOUTS}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_one_step_equals_single_process(results, name):
    *_, zero, overrides = LAYOUTS[name]
    loss, norm, grads, weights = results[name]['step']
    ref_loss, ref_norm, ref_grads, ref_weights = reference(overrides, zero)
    assert abs(loss - ref_loss) <= RTOL * ref_loss, (loss, ref_loss)
    assert ref_norm > 0.5 and abs(norm - ref_norm) <= RTOL * ref_norm  # clipping was active
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert grads[n].shape == ref_grads[n].shape, n
        assert rel(grads[n], ref_grads[n]) <= RTOL, (n, rel(grads[n], ref_grads[n]))
        if zero:  # AdamW: tiny gradients' rounding moves a weight (see EPS); the Decision's atol
            torch.testing.assert_close(weights[n], ref_weights[n], rtol=0, atol=1e-3 * LR)
        else:
            assert rel(weights[n], ref_weights[n]) <= RTOL, n
    variant = ('sliding_window', 'layer_types', 'docs')
    if any(k in overrides for k in variant):  # the variant ran: not the causal model's gradients
        causal = reference({k: v for k, v in overrides.items() if k not in variant}, zero)[2]
        assert rel(grads['layers.0.attention.wq.weight'], causal['layers.0.attention.wq.weight']) > 0.05


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_eval_does_no_gradient_work(results, name):
    """Under no_grad the vocabulary-parallel loss computes the logits only, as chunked.py's does in one
    process (it made dW and ran both gradient matmuls per chunk under tp: 9 matmuls for 3)."""
    *_, overrides = LAYOUTS[name]
    if name in GROUPS:  # as many head groups as the layout ran (each group: its own matmuls)
        overrides = {**overrides, 'attention_chunks': GROUPS[name]}
    assert results[name]['eval'] == eval_matmuls(apply_techniques(new_model(overrides)), parallel.Mesh())


# per block, forward + backward (parallel.py's header); the ring calls ring_shift once a step but step 0 (its own k,
# v: no call), backward again for k, v and once a step for dk, dv home (step 0's hop 0: no message): 3·cp - 2
EXPECTED_PER_BLOCK = {
    'tp': {'all_reduce': 4},
    'sp': {'all_gather': 4, 'reduce_scatter': 4},
    'cp_ulysses': {'all_to_all': 4},
    'cp_ring': {'ring_shift': 4},
    'dp': {},
    'dp_zero2': {},
    'dp_zero3': {},
    'dp_zero3_host': {},
    'tp4_gqa': {'all_gather': 4, 'reduce_scatter': 4},
    'tp_cp_ulysses': {'all_gather': 4, 'reduce_scatter': 4, 'all_to_all': 4},
    'tp_cp_ring': {'all_gather': 4, 'reduce_scatter': 4, 'ring_shift': 4},
    'dp_tp': {'all_gather': 4, 'reduce_scatter': 4},
    'dp_cp_zero2': {'all_to_all': 4},
    'dp_tp_zero3': {'all_gather': 4, 'reduce_scatter': 4},
    'tp4_vocab5': {'all_gather': 4, 'reduce_scatter': 4},
    'tp_window': {'all_gather': 4, 'reduce_scatter': 4},
    'cp_window': {'all_to_all': 4},
    'ring_window': {'ring_shift': 4},
    'ring4_window': {'ring_shift': 10},  # (a step whose sides are both empty posts no message: ring.py)
    'tp_docs': {'all_gather': 4, 'reduce_scatter': 4},
    'cp_docs': {'all_to_all': 4},
    'dp_docs_zero2': {},
    'dp_docs_zero3': {},
    # per group: its all-to-alls (or ring shifts) forward, again in its checkpoint's recompute, and backward
    'tp_groups': {'all_gather': 4, 'reduce_scatter': 4},
    'cp_groups': {'all_to_all': 4 * 6},
    'ring_groups': {'ring_shift': 2 * 5},
    'docs_groups': {'all_to_all': 2 * 6},
    'zero3_groups': {},
    'tp_cp_groups': {'all_gather': 4, 'reduce_scatter': 4, 'all_to_all': 2 * 6},
    'ring_docs': {'ring_shift': 4},
    'tp_ring_docs': {'all_gather': 4, 'reduce_scatter': 4, 'ring_shift': 4},
    'ring4_docs': {'ring_shift': 10},
    'tp_qwen': {'all_reduce': 4},
    'sp_qwen': {'all_gather': 4, 'reduce_scatter': 4},
    'cp_qwen': {'all_to_all': 4},
    'ring_qwen': {'ring_shift': 4},
    'zero3_qwen': {},
    'tp_cp_qwen': {'all_gather': 4, 'reduce_scatter': 4, 'all_to_all': 2 * 6},
    # Ulysses' all-to-alls around the ring's shifts (r = 2: 3·r - 2)
    'u2_ring2_docs': {'all_to_all': 4, 'ring_shift': 4},
    'u2_ring2_window': {'all_to_all': 4, 'ring_shift': 4},  # (r = 2: the one other step is step r - 1)
    'u2_ring2_groups': {'all_to_all': 2 * 6, 'ring_shift': 2 * 5},
    'u2_ring2_offload': {'all_to_all': 4, 'ring_shift': 4},
    'u2_ring2_qwen': {'all_to_all': 4, 'ring_shift': 4},
}
# recompute='full' runs each block's forward again in backward, but torch's checkpoint stops once it has
# every tensor backward needs: the block's last reduction (after w2), whose output nothing saves, is skipped.
# The ring calls ring_shift cp - 1 times
FORWARD_PER_BLOCK = {'all_reduce': 1, 'all_gather': 2, 'reduce_scatter': 1, 'all_to_all': 2, 'ring_shift': 1}


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_collectives_per_block(results, name):
    assert results[name]['block'] == EXPECTED_PER_BLOCK[name]
    groups = GROUPS.get(name, 1)  # cp's collectives run per head group
    shifts = parallel.ring_size(*LAYOUTS[name][2:4], LAYOUTS[name][-1].get('cp_ring', 0)) - 1  # a forward's
    again = {k: v + FORWARD_PER_BLOCK[k] * (groups if k in ('all_to_all', 'ring_shift') else 1)
             * (shifts if k == 'ring_shift' else 1) for k, v in EXPECTED_PER_BLOCK[name].items()}
    assert results[name]['block_recompute'] == again


# ----------------------------------------------------------------------------- offload under sp and cp

# (tp, cp, cp_impl, recompute, offload) on 2 ranks, sequence parallel with tp: S = 16 tokens are 8 per
# rank, so offload 0.5 sends the last 4 of every rank's run to host and recomputes the first 4
OFFLOAD_LAYOUTS = [(2, 1, 'ulysses', 'none', 0.5), (2, 1, 'ulysses', 'none', 1.0), (2, 1, 'ulysses', 'selective', 1.0),
                   (2, 1, 'ulysses', 'full', 0.5), (1, 2, 'ulysses', 'none', 0.5), (1, 2, 'ulysses', 'none', 1.0),
                   (1, 2, 'ulysses', 'selective', 0.5), (1, 2, 'ring', 'none', 1.0), (1, 2, 'ring', 'full', 0.5),
                   (1, 2, 'ring', 'none', 0.5), (1, 2, 'ring', 'selective', 1.0)]  # the last two are refused


def _offload_worker(rank, world, port, out_dir):
    import measure
    import offload
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    offload.KEEP_LAST, offload.MIN_BYTES = 0, 0  # our model is tiny: offload both blocks, every tensor
    dist.init_process_group('gloo')
    results = {}
    for layout in OFFLOAD_LAYOUTS:
        tp, cp, cp_impl, recompute, alpha = layout
        runs = []
        for a in (0.0, alpha):  # the same layout with offload off, then on
            config = model_config(dict(recompute=recompute, offload=a))
            why = parallel.check_layout(config, world, tp, cp, cp_impl, S)
            if why:  # refused up front, as train.py does
                runs.append(why)
                continue
            mesh = parallel.make_mesh(tp, cp, cp_impl, config.n_kv_head)
            torch.manual_seed(0)
            model = apply_techniques(Llama(config), mesh)
            before = offload.stats()
            loss, _, grads, _ = one_step(model, mesh, config, zero=0)
            moved = {k: offload.stats()[k] - before[k] for k in ('bytes_to_host', 'bytes_to_device')}
            runs.append((loss, grads, moved, offload.stats()['host_in_use']))
        results[layout] = runs
    # backward's peak (measure.Tracker) under sequence parallelism with a model whose activations
    # dominate: 'selective' with offload against without
    for alpha in (0.0, 1.0):
        offload.reset()
        config = Knobs(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=384, vocab_size=64,
                             recompute='selective', offload=alpha, loss_chunks=4)
        torch.manual_seed(0)
        mesh = parallel.make_mesh(2, 1, 'ulysses', config.n_kv_head)
        model = apply_techniques(Llama(config), mesh)
        x = torch.randint(0, 64, (2, 1024), generator=torch.Generator().manual_seed(1))
        tracker = measure.Tracker(model, inputs=[x])
        with tracker:
            model(x, x.roll(-1, 1))[1].backward()
        results['sp peak', alpha] = tracker.breakdown()['total']
    if rank == 0:
        torch.save(results, os.path.join(out_dir, 'offload.pt'))
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def offload_results(tmp_path_factory):
    out = tmp_path_factory.mktemp('offload')
    mp.spawn(_offload_worker, args=(2, free_port(), str(out)), nprocs=2)
    return torch.load(out / 'offload.pt')


@pytest.mark.parametrize('layout', OFFLOAD_LAYOUTS, ids=lambda l: '-'.join(map(str, l)))
def test_offload_under_sp_and_cp_gives_the_gradients_of_offload_off(offload_results, layout, monkeypatch):
    """Under sequence parallelism a block's input holds 8 tokens and its q, k, v 16; under Ulysses attention
    holds both ranks' runs: the token-wise recompute cuts every run (offload.py's header). Ring attention
    can't be replayed: refused with check_layout's one line."""
    import offload
    monkeypatch.setattr(offload, 'KEEP_LAST', 0)  # as the ranks ran
    monkeypatch.setattr(offload, 'MIN_BYTES', 0)
    tp, cp, cp_impl, recompute, alpha = layout
    (ref_loss, ref_grads, _, _), run = offload_results[layout]
    why = parallel.check_layout(model_config(dict(recompute=recompute, offload=alpha)), 2, tp, cp, cp_impl, S)
    if isinstance(run, str):
        assert run == why and '\n' not in why and f"recompute={recompute!r} and cp_impl='ring'" in why
        assert "recompute='full'" in why
        return
    assert why is None
    loss, grads, moved, host_in_use = run
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    for n in ref_grads:
        assert rel(grads[n], ref_grads[n]) <= 1e-6, (n, rel(grads[n], ref_grads[n]))
    assert moved['bytes_to_host'] > 0 and moved['bytes_to_device'] == moved['bytes_to_host']
    assert host_in_use == 0
    if recompute != 'none':  # only whole tensors move, the input (and attention's output): the formula's
        # bytes on this rank's tokens, for 2 micro-steps of 2 rows (Ulysses: its output apart, offload.py)
        assert moved['bytes_to_host'] == 2 * offload.host_bytes(model_config(dict(recompute=recompute, offload=alpha)),
                                                                2, S // (tp * cp), cp_size=cp)


def test_offload_under_sp_holds_no_more_than_offload_off(offload_results):
    """'selective' with offload keeps nothing of a block but on host, and its recompute stops once every
    saved tensor is back (as torch's checkpoint does), before the last matmul and its reduce-scatter,
    which would hold two whole-sequence tensors on top of the recomputed block."""
    off, on = offload_results['sp peak', 0.0], offload_results['sp peak', 1.0]
    assert on <= off, (on, off)


# ----------------------------------------------------------------------------- train.py under torchrun

TINY = [os.path.join(ROOT, 'config', 'train_tiny.py'), '--device=cpu', '--seq_len=64', '--eval_iters=1',
        '--log_interval=1', '--eval_interval=1000', '--n_kv_head=2']


def torchrun(nproc, *args, check=True, timeout=600):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
           os.path.join(ROOT, 'train.py'), *args] if nproc > 1 else [sys.executable, os.path.join(ROOT, 'train.py'), *args]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def losses(out_dir):
    return [row['loss'] for row in read_log(out_dir)]


def assert_close_losses(got, ref):
    assert [r['iter'] for r in got] == [r['iter'] for r in ref]
    for a, b in zip(got, ref):
        assert abs(a['loss'] - b['loss']) <= 1e-5 * b['loss'], (got, ref)
        assert ('val_loss' in a) == ('val_loss' in b)
        assert abs(a.get('val_loss', 1) - b.get('val_loss', 1)) <= 1e-5 * b.get('val_loss', 1)


@pytest.fixture(scope='module')
def single_run(tmp_path_factory):
    """One process: 4 steps, a copy of its checkpoint (ckpt.pt) at step 4, then resumed to 6 steps."""
    out, at4 = tmp_path_factory.mktemp('single'), tmp_path_factory.mktemp('single4')
    torchrun(1, *TINY, '--batch_size=4', '--max_iters=4', f'--out_dir={out}')
    shutil.copytree(out, at4, dirs_exist_ok=True)
    torchrun(1, *TINY, '--batch_size=4', '--max_iters=6', f'--out_dir={out}', '--init_from=resume')
    return read_log(out), str(at4)


@pytest.mark.parametrize('nproc,layout,resume', [
    (2, ['--tp_size=2'], 'from one process'),            # resume the single-process ckpt.pt under tp
    (2, ['--cp_size=2', '--cp_impl=ring'], None),
    (2, ['--batch_size=2', '--zero=3'], 'in one process'),  # dp = 2, half the rows each: same global batch
    (1, ['--zero=3', '--offload_states=True'], 'in one process'),  # FSDP2 over one rank, its states on the host
    # (zero=3 with the states on the host over 2 ranks: test_float16_layouts_train_as_one_process runs it)
    # pp 2 x dp 2, FSDP2 per stage (GPipe: one micro-batch is enough), its states on the host, read whole
    (4, ['--batch_size=2', '--pp_size=2', '--pp_schedule=gpipe', '--zero=3', '--offload_states=True'], 'in one process'),
])
def test_train_tiny_losses_do_not_depend_on_the_layout(tmp_path, single_run, nproc, layout, resume):
    ref, single_at4 = single_run
    out = str(tmp_path / 'run')
    torchrun(nproc, *TINY, '--batch_size=4', *layout, '--max_iters=4', f'--out_dir={out}')
    assert_close_losses(read_log(out), ref[:4])
    if resume == 'from one process':
        out = str(tmp_path / 'resumed')
        shutil.copytree(single_at4, out)
        torchrun(nproc, *TINY, '--batch_size=4', *layout, '--max_iters=6', f'--out_dir={out}', '--init_from=resume')
    elif resume == 'in one process':  # FSDP2's shards of 2 ranks, read whole
        torchrun(1, *TINY, '--batch_size=4', '--max_iters=6', f'--out_dir={out}', '--init_from=resume')
    if resume:
        assert_close_losses(read_log(out), ref)


@pytest.fixture(scope='module')
def single_f16(tmp_path_factory):
    """One process in fp16 (CPU autocast, fp32 masters, loss scaling): 4 steps."""
    out = tmp_path_factory.mktemp('single_f16')
    torchrun(1, *TINY, '--batch_size=4', '--max_iters=4', '--dtype=float16', F16_WINDOW, f'--out_dir={out}')
    return read_log(out)


# fp16's runs are windowed (seq_len 64): the window under fp16 in every layout. (Shorter windows overflow the
# embedding's fp16 gradient, a sum over a whole rank's tokens, at the first scale in one process but not on 2 cp
# ranks: the scales would differ for a reason that isn't the window's)
F16_WINDOW = '--sliding_window=48'


@pytest.mark.parametrize('nproc,layout', [
    (1, ['--mlp_chunks=3', '--loss_chunks=3', '--recompute=selective', '--offload=1.0']),
    (2, ['--tp_size=2']),
    (2, ['--cp_size=2', '--cp_impl=ulysses']),
    (2, ['--batch_size=2', '--zero=2']),  # dp 2: half the rows each, FSDP2 gathering fp16
    (2, ['--cp_size=2', '--cp_impl=ring']),
    (2, ['--batch_size=2', '--zero=3', '--offload_states=True']),  # FSDP2's rows and AdamW on the host
    (2, ['--pp_size=2', '--pp_schedule=gpipe']),
])
def test_float16_layouts_train_as_one_process(tmp_path, single_f16, nproc, layout):
    """fp16 with dynamic loss scaling under the memory knobs (chunked MLP and loss see the scaled gradient,
    recompute, offload), tp, Ulysses, the ring (its merge in fp32), zero 2 (FSDP2 gathers fp16), zero 3 with the
    states on the host, and pp (the schedule's loss scaled once): the losses of one process in fp16, to fp16's
    rounding of sums in another order, and the same loss scale."""
    out = str(tmp_path / 'run')
    torchrun(nproc, *TINY, '--batch_size=4', *layout, '--max_iters=4', '--dtype=float16', F16_WINDOW,
             f'--out_dir={out}')
    got = read_log(out)
    assert [r['iter'] for r in got] == [r['iter'] for r in single_f16]
    for a, b in zip(got, single_f16):
        assert abs(a['loss'] - b['loss']) <= 2e-3 * b['loss'], (got, single_f16)
        assert a['loss_scale'] == b['loss_scale']


# the Qwen block on train_tiny's model (4 heads of 48 on 128 wide, biases on q, k, v, q and k norms)
QWEN_TINY = ['--head_dim=48', '--attention_bias=True', '--qk_norm=True']


@pytest.fixture(scope='module')
def single_f16_qwen(tmp_path_factory):
    """single_f16 with the Qwen block."""
    out = tmp_path_factory.mktemp('single_f16_qwen')
    torchrun(1, *TINY, '--batch_size=4', '--max_iters=4', '--dtype=float16', *QWEN_TINY, f'--out_dir={out}')
    return read_log(out)


@pytest.mark.parametrize('nproc,layout', [(2, ['--tp_size=2']), (2, ['--cp_size=2', '--cp_impl=ulysses'])],
                         ids=['tp2', 'ulysses2'])
def test_float16_qwen_trains_as_one_process(tmp_path, single_f16_qwen, nproc, layout):
    """fp16 through the Qwen block's biases and q, k norms (the norms in fp32, cast back): tp and Ulysses give
    one process's losses and loss scale."""
    out = str(tmp_path / 'run')
    torchrun(nproc, *TINY, '--batch_size=4', *layout, '--max_iters=4', '--dtype=float16', *QWEN_TINY,
             f'--out_dir={out}')
    got = read_log(out)
    assert [r['iter'] for r in got] == [r['iter'] for r in single_f16_qwen]
    for a, b in zip(got, single_f16_qwen):
        assert abs(a['loss'] - b['loss']) <= 2e-3 * b['loss'], (got, single_f16_qwen)
        assert a['loss_scale'] == b['loss_scale']


@pytest.fixture(scope='module')
def single_muon(tmp_path_factory):
    """One process, optimizer='muon': 4 steps."""
    out = tmp_path_factory.mktemp('single_muon')
    torchrun(1, *TINY, '--batch_size=4', '--max_iters=4', '--optimizer=muon', f'--out_dir={out}')
    return read_log(out)


@pytest.mark.parametrize('nproc,layout', [(2, ['--batch_size=2']), (2, ['--pp_size=2', '--pp_schedule=gpipe'])],
                         ids=['dp2', 'pp2'])
def test_muon_under_dp_and_pp_trains_as_one_process(tmp_path, single_muon, nproc, layout):
    """Muon orthogonalizes each matrix whole: dp 2 (the gradients summed, every rank the same update) and pp 2 (each
    stage its own blocks' matrices) give one process's losses."""
    out = str(tmp_path / 'run')
    torchrun(nproc, *TINY, '--batch_size=4', *layout, '--max_iters=4', '--optimizer=muon', f'--out_dir={out}')
    assert_close_losses(read_log(out), single_muon)


def test_zero2_resumes_twice_at_a_decaying_lr_as_an_uninterrupted_run(tmp_path):
    """dp 2 with zero=2, resumed at steps 3 and 5 of a decaying schedule: the same lrs and losses, bit for
    bit. Before, the optimizer kept the param groups and state that load_state_dict replaced: after a
    resume the schedule no longer reached it (back to peak lr) and later checkpoints held zeroed moments."""
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    run = ['--batch_size=2', '--zero=2', '--warmup_iters=1', '--lr_decay_iters=8', '--learning_rate=1e-2',
           '--min_lr=1e-4']
    torchrun(2, *TINY, *run, '--max_iters=8', f'--out_dir={straight}')
    torchrun(2, *TINY, *run, '--max_iters=3', f'--out_dir={split}')
    torchrun(2, *TINY, *run, '--max_iters=5', f'--out_dir={split}', '--init_from=resume')
    torchrun(2, *TINY, *run, '--max_iters=8', f'--out_dir={split}', '--init_from=resume')
    a, b = read_log(straight), read_log(split)
    assert [r['iter'] for r in b] == list(range(8))
    assert [r['lr'] for r in a] == [r['lr'] for r in b] and a[1]['lr'] > a[-1]['lr']
    assert [r['loss'] for r in a] == [r['loss'] for r in b]


def test_resume_under_tp_cp_equals_an_uninterrupted_run_and_exports(tmp_path):
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    layout = ['--tp_size=2', '--cp_size=2', '--cp_impl=ring', '--batch_size=2']
    torchrun(4, *TINY, *layout, '--max_iters=6', f'--out_dir={straight}')
    torchrun(4, *TINY, *layout, '--max_iters=3', f'--out_dir={split}')
    assert os.path.exists(os.path.join(checkpoint.latest(split), 'COMMITTED'))
    assert not os.path.exists(os.path.join(split, 'ckpt.pt'))
    other = str(tmp_path / 'other')
    shutil.copytree(split, other)
    torchrun(4, *TINY, *layout, '--max_iters=6', f'--out_dir={split}', '--init_from=resume')
    assert losses(straight) == losses(split)  # the same layout: bit for bit
    # another layout (one process) resumes the same checkpoint to the same losses, to fp32 tolerance
    torchrun(1, *TINY, '--batch_size=2', '--max_iters=6', f'--out_dir={other}', '--init_from=resume')
    for a, b in zip(losses(other), losses(straight)):
        assert abs(a - b) <= 1e-5 * b
    # a checkpoint without its marker is never loaded
    os.remove(os.path.join(checkpoint.latest(straight), 'COMMITTED'))
    p = torchrun(1, *TINY, '--max_iters=7', f'--out_dir={straight}', '--init_from=resume', check=False)
    assert p.returncode == 2 and 'no checkpoint' in p.stderr
    # one Hugging Face directory from the 4-rank shards
    hf = str(tmp_path / 'hf')
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'checkpoint.py'), 'export', split, hf], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    model, meta = checkpoint.load_model(checkpoint.latest(split))
    exported, full = Llama.from_pretrained(hf), dict(model.named_parameters())
    for n, p in exported.named_parameters():
        assert torch.equal(p, full[n]), n
    assert meta['iter_num'] == 6
    # sample.py reads the 4-rank shards as they are, and greedy decoding agrees with the export
    greedy = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, 'sample.py'), '--num_samples=1',
                                        '--max_new_tokens=8', '--temperature=0', '--device=cpu', *a],
                                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    a, b = greedy(f'--out_dir={split}'), greedy(f'--init_from={hf}', '--dataset=stdlib')
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    text = lambda p: [line for line in p.stdout.splitlines() if not line.startswith('Overriding')]
    assert text(a) == text(b) and len(''.join(text(a))) > 8


@pytest.mark.parametrize('layout,reason', [
    (['--tp_size=3'], 'not divisible by pp_size * cp_size * tp_size'),
    # offload.py can't replay ring attention in a token-wise recompute
    (['--cp_size=2', '--cp_impl=ring', '--offload=0.5'], "offload=0.5 with recompute='none' and cp_impl='ring'"),
])
def test_an_impossible_layout_is_one_line_for_the_job(tmp_path, layout, reason):
    p = torchrun(2, *TINY, *layout, '--max_iters=1', f'--out_dir={tmp_path}', check=False, timeout=120)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.startswith('error:')]
    assert len(lines) == 1 and reason in lines[0], p.stderr[-2000:]  # rank 0's: every rank stops on it



@pytest.mark.parametrize('layout,reason', [
    (dict(world=6, tp=4), 'not divisible by pp_size * cp_size * tp_size'),
    (dict(world=3, tp=3), 'n_head=4 is not divisible by tp_size=3'),
    (dict(world=4, tp=4, n_kv_head=1, n_head=8), None),  # kv heads replicated
    (dict(world=4, tp=4, n_kv_head=3, n_head=12, n_embd=48), 'n_kv_head=3 and tp_size=4: one must divide the other'),
    (dict(world=3, cp=3, n_kv_head=2, n_head=6, n_embd=48, seq_len=18), "6 query and 2 kv heads per rank (n_head, n_kv_head / tp_size) don't split over Ulysses' 3 ranks (cp_size / cp_ring); cp_ring = 3 does"),
    (dict(world=4, tp=4, n_kv_head=2, n_head=8, n_embd=64), None),
    (dict(world=8, tp=8, n_kv_head=4, n_head=8, n_embd=64), None),
    (dict(world=2, tp=2, intermediate_size=63), 'intermediate_size=63 is not divisible by tp_size=2'),
    (dict(world=2, cp=2, cp_impl='star'), "cp_impl must be 'ulysses' or 'ring'"),
    (dict(zero=1), 'zero=1 became 2: FSDP2 shards the gradients too'),
    (dict(world=2, tp=2, zero=3), 'zero=3 shards over the dp x cp ranks: there is one'),
    (dict(world=2, tp=2, zero=3, states_on_host=True), None),  # FSDP2 over one rank: it streams the weights in
    (dict(world=2, zero=2, states_on_host=True), 'offload_states=True streams each block'),
    (dict(world=2, cp=2, seq_len=15), 'seq_len=15 is not divisible by cp_size=2'),
    (dict(world=8, cp=8), "4 query and 2 kv heads per rank (n_head, n_kv_head / tp_size) don't split over Ulysses' 8 "
                          "ranks (cp_size / cp_ring); cp_ring = 2 or 4 or 8 does"),
    (dict(world=4, cp=4, n_kv_head=3, n_head=6, n_embd=48), "6 query and 3 kv heads per rank"),
    (dict(world=4, cp=4, n_kv_head=3, n_head=6, n_embd=48), "cp_ring = 4 does"),  # the ring alone: any count
    # two dimensions (c = u x r): Ulysses' rules over u = cp / cp_ring ranks, the ring's zigzag over all 2·cp chunks
    (dict(world=8, cp=8, cp_ring=2), None),  # 4 heads over u = 4
    (dict(world=4, cp=4, cp_ring=3), 'cp_ring=3 must divide cp_size=4'),
    (dict(world=4, cp=4, cp_ring=-1), 'cp_ring=-1 must divide cp_size=4'),
    (dict(world=8, cp=8, cp_ring=2, n_head=6, n_kv_head=2, n_embd=48, seq_len=32),
     "6 query and 2 kv heads per rank (n_head, n_kv_head / tp_size) don't split over Ulysses' 4 ranks (cp_size / "
     "cp_ring); cp_ring = 4 or 8 does"),
    (dict(world=8, cp=8, cp_ring=4, n_head=6, n_kv_head=2, n_embd=48, seq_len=32), None),
    (dict(world=4, cp=4, cp_ring=2, seq_len=12), 'seq_len=12 is not divisible by 2 * cp_size = 8'),
    (dict(world=4, cp=4, cp_ring=2, cp_impl='ring'), None),  # cp_ring decides the split
    (dict(world=4, cp=4, cp_ring=2, offload=0.5), "offload=0.5 with recompute='none' and cp_impl='ring'"),
    (dict(world=4, cp=4, cp_ring=2, n_head=8, n_kv_head=4, attention_chunks=4), None),  # 2 heads over u = 2
    (dict(world=8, cp=8, cp_ring=2, n_head=8, n_kv_head=4, attention_chunks=4),
     "attention_chunks=4: Ulysses spreads each group's 2 query and 1 kv heads over 4 ranks"),
    (dict(world=2, cp=2, seq_len=18, cp_impl='ring'), 'not divisible by 2 * cp_size = 4'),
    (dict(world=4, tp=4, seq_len=18), 'seq_len / cp_size = 18 is not divisible by tp_size=4 (sequence parallelism)'),
    (dict(world=2, cp=2, cp_impl='ring', device_type='cuda'), "needs bfloat16 or float16, not torch.float32"),
    (dict(world=2, cp=2, cp_impl='ring', device_type='cuda', dtype=torch.bfloat16, n_embd=48),
     'head_dim <= 256 and a multiple of 8, not 12'),
    (dict(world=2, cp=2, cp_impl='ring', device_type='cuda', dtype=torch.bfloat16), None),
    (dict(world=2, cp=2, cp_impl='ring', device_type='mps'), 'not mps'),
    (dict(world=2, cp=2, cp_impl='ring', offload=0.5), "offload=0.5 with recompute='none' and cp_impl='ring'"),
    (dict(world=2, cp=2, cp_impl='ring', offload=1.0), None),
    (dict(world=2, cp=2, cp_impl='ring', offload=0.5, recompute='full'), None),
    (dict(world=2, cp=2, cp_impl='ring', offload=0.5, recompute='selective'), "recompute='full' or cp_impl='ulysses'"),
    (dict(world=2, tp=2, n_head=8, n_kv_head=4, attention_chunks=4),
     'attention_chunks=4 does not divide the 2 kv heads per tp rank'),
    (dict(world=2, tp=2, n_head=8, n_kv_head=4, attention_chunks=2), None),
    (dict(world=4, cp=4, n_head=8, n_kv_head=4, attention_chunks=4),
     "attention_chunks=4: Ulysses spreads each group's 2 query and 1 kv heads over 4 ranks"),
    (dict(world=4, cp=4, n_head=8, n_kv_head=4, attention_chunks=2), None),  # 4 query heads, 2 kv heads copied
    (dict(world=4, cp=4, n_head=8, n_kv_head=4, attention_chunks=0), None),  # chunked.py picks 2
    (dict(world=2, cp=2, cp_impl='ring', n_head=8, n_kv_head=4, attention_chunks=4), None),  # the ring: any
    (dict(world=6, pp=4), 'not divisible by pp_size * cp_size * tp_size = 4 * 1 * 1'),
    (dict(world=16, pp=2, cp=2, tp=2, microbatches=2), None),  # dp 2 x pp 2 x cp 2 x tp 2
    (dict(world=4, pp=4, microbatches=4), 'pp_size=4 stages need a block each: n_layer=2'),
    (dict(world=2, pp=2), "pp_schedule='1f1b' runs gradient_accumulation_steps=1 micro-batches through 2 stages"),
    (dict(world=2, pp=2, schedule='gpipe'), None),
    (dict(world=2, pp=2, microbatches=2, schedule='zb'), "pp_schedule must be '1f1b' or 'gpipe'"),
    (dict(world=2, pp=2, microbatches=2, tie_embeddings=True), 'tie_embeddings=True with pp_size > 1'),
    (dict(world=2, pp=2, microbatches=2, offload=0.5), 'offload=0.5 with pp_size > 1'),
    (dict(world=4, pp=2, microbatches=2, zero=3), None),  # FSDP2 over the dp ranks of each stage
    (dict(world=2, pp=2, microbatches=2, zero=3), 'zero=3 shards over the dp x cp ranks: there is one'),
    # FSDP2 over 3 or 6 ranks: the vocabulary's columns (n_embd=32) split unevenly, which it can't
    (dict(world=3, zero=3), 'zero=3 splits the vocabulary\'s tensors by column over the 3 dp x cp ranks: '
                            'n_embd=32 is not divisible by them'),
    (dict(world=6, tp=2, zero=2), 'over the 3 dp x cp ranks: n_embd=32'),
    (dict(world=3, zero=0), None),
    (dict(world=4, zero=2), None),
    # mixture of experts (moe.py): ep over the dp x cp ranks holding the same weights
    (dict(world=4, ep=4, n_experts=4), None),
    (dict(world=8, tp=2, cp=2, ep=2, n_experts=4), None),  # 2 dp x cp ranks a tp rank
    (dict(world=4, tp=2, ep=4, n_experts=4), 'ep_size=4 must divide the 2 dp x cp ranks holding the same weights'),
    (dict(world=4, ep=4, n_experts=6), 'n_experts=6 is not divisible by ep_size=4'),
    (dict(world=2, ep=2), 'ep_size=2 splits experts: n_experts=0'),
    (dict(n_experts=4, offload=0.5), "offload=0.5 with recompute='none' and n_experts=4"),
    (dict(n_experts=4, offload=0.5, recompute='selective'), None),
    (dict(n_experts=4, offload=1.0), None),
])
def test_check_layout_owns_every_rule(layout, reason):
    """One line or None, before anything is allocated. Ring attention's flash kernel is refused here for
    fp32 or odd head dims on CUDA (it raised inside the kernel), and the wrapper refuses the same way."""
    run = dict(world=1, tp=1, cp=1, cp_impl='ulysses', seq_len=16, zero=0, device_type='cpu', dtype=torch.float32,
               states_on_host=False, pp=1, microbatches=1, schedule='1f1b', ep=1, cp_ring=0)
    run.update({k: layout.pop(k) for k in list(layout) if k in run})
    why = parallel.check_layout(model_config({'n_embd': 32, **layout}), **run)
    assert why is None if reason is None else (reason in why and '\n' not in why), why


SLOW_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
import configurator
if os.environ['RANK'] == '1':
    time.sleep(3)  # rank 0 reaches its exit first; torchrun would kill rank 1 before it says anything
print('error: rank', os.environ['RANK'], file=sys.stderr, flush=True)
configurator.wait_for_every_rank('died')
sys.exit(2)
"""


def test_a_rank_that_stops_waits_until_every_rank_has_said_why(tmp_path):
    script = tmp_path / 'slow_rank.py'
    script.write_text(SLOW_RANK.format(root=ROOT))
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert sorted(l for l in p.stderr.splitlines() if l.startswith('error:')) == ['error: rank 0', 'error: rank 1']

RAISER = """
import sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
import train
real = train.get_batch
def get_batch(*args, **kw):  # rank 1 fails in its third step, while rank 0 waits in a collective
    if dist.get_rank() == 1 and get_batch.calls == 2:
        open({stamp!r}, 'w').write(repr(time.time()))
        raise RuntimeError('rank 1 fails on purpose')
    get_batch.calls += 1
    return real(*args, **kw)
get_batch.calls = 0
train.get_batch = get_batch
sys.argv = ['train.py'] + {args!r}
train.main()
"""


def test_a_rank_that_raises_takes_every_rank_down(tmp_path):
    script = tmp_path / 'raiser.py'
    stamp = str(tmp_path / 'raised_at')
    script.write_text(RAISER.format(root=ROOT, stamp=stamp, args=[*TINY, '--tp_size=2', '--max_iters=50',
                                                                  f'--out_dir={tmp_path / "out"}']))
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert p.returncode != 0 and 'rank 1 fails on purpose' in p.stderr
    assert time.time() - float(open(stamp).read()) < 60  # rank 0, blocked in a collective, is gone too


def test_sequence_parallel_memory_is_what_the_estimate_says(tmp_path):
    """With batch > 1 the all-gathered [B, S, h] input of the column-parallel matmuls is made contiguous once:
    before, wq, wk, wv (and w1, w3) each kept their own copy, 17% more than memory.py counts. Rank 0's
    measured first step (memory.json) is within the estimate's 10%."""
    torchrun(2, *TINY, '--tp_size=2', '--batch_size=4', '--max_iters=1', f'--out_dir={tmp_path}')
    with open(os.path.join(tmp_path, 'memory.json')) as f:
        rank0 = json.load(f)['ranks'][0]
    est, measured = rank0['estimate']['total'], rank0['measured']['total']
    assert abs(est - measured) <= 0.10 * measured, (est, measured)


def test_parallel_mlp_chunks_as_the_estimate_counts_them(tmp_path):
    """mlp_chunks=0 under tp: model.MLP on a rank's shard picks the chunk count memory.py picks (one sequence,
    the whole intermediate size), so the dry run of rank 0 of 2 (fake tensors, real kernels' bookkeeping) is
    what the estimate says. Before, it chunked by the rank's intermediate size: fewer chunks, 8% more."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *TINY, '--n_embd=512', '--n_head=8',
                        '--intermediate_size=1376', '--n_layer=2', '--seq_len=2048', '--batch_size=1',
                        '--mlp_chunks=0', '--recompute=full', '--tp_size=2', '--dry_run=True', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, 'WORLD_SIZE': '2'})
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(tmp_path, 'memory.json')) as f:
        rank0 = json.load(f)['ranks'][0]
    est, measured = rank0['estimate']['total'], rank0['measured']['total']
    assert abs(est - measured) <= 0.10 * measured, (est, measured)


@pytest.mark.parametrize('layout', [['--cp_size=2'], ['--cp_size=2', '--cp_impl=ring'], ['--tp_size=2', '--cp_size=2']],
                         ids=['ulysses', 'ring', 'tp-ulysses'])
def test_head_groups_dry_run_is_what_the_estimate_says(tmp_path, layout):
    """attention_chunks=0 (one kv head's group at a time) at 32K tokens, rank 0's dry run (bf16, the CUDA target: flash
    attention's workspace by group) within the estimate's 10%, and under the same dry run with all heads at once."""
    totals = []
    for groups in (0, 1):
        out = tmp_path / str(groups)
        p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *TINY, '--n_embd=512', '--n_head=8',
                            '--n_kv_head=4', '--intermediate_size=1376', '--n_layer=2', '--seq_len=32768',
                            '--batch_size=1', '--mlp_chunks=0', '--loss_chunks=0', '--recompute=full', *layout,
                            f'--attention_chunks={groups}', '--dry_run=True', f'--out_dir={out}'],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, 'WORLD_SIZE': '4'})
        assert p.returncode == 0, p.stderr[-2000:]
        with open(out / 'memory.json') as f:
            rank0 = json.load(f)['ranks'][0]
        est, measured = rank0['estimate']['total'], rank0['measured']['total']
        assert abs(est - measured) <= 0.10 * measured, (groups, est, measured)
        totals.append(measured)
    assert totals[0] < totals[1]


@pytest.mark.parametrize('layout', [[], ['--cp_size=2'], ['--cp_size=2', '--cp_impl=ring'],
                                    ['--pp_size=2', '--gradient_accumulation_steps=2']],
                         ids=['one', 'ulysses', 'ring', 'pp'])
def test_doc_mask_dry_run_is_what_the_estimate_says(tmp_path, layout):
    """doc_mask at 32K tokens, rank 0's dry run (bf16, the CUDA target) within the estimate's 10%; attention is
    torch's varlen kernel (model.one_kernel: one call per block, the anatomy names it), the ring's per step its own
    flash calls."""
    out = tmp_path / 'out'
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *TINY, '--n_embd=512', '--n_head=8',
                        '--n_kv_head=4', '--intermediate_size=1376', '--n_layer=2', '--seq_len=32768',
                        '--batch_size=1', '--mlp_chunks=0', '--loss_chunks=0', '--recompute=none', *layout,
                        '--doc_mask=True', '--dry_run=True', '--dry_run_anatomy=100', f'--out_dir={out}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, 'WORLD_SIZE': '2'})
    assert p.returncode == 0, p.stderr[-2000:]
    with open(out / 'memory.json') as f:
        rank0 = json.load(f)['ranks'][0]
    est, measured = rank0['estimate']['total'], rank0['measured']['total']
    assert abs(est - measured) <= 0.10 * measured, (est, measured)
    # recompute none: every block's attention output is alive at its stage's peak, named by the op that made it
    lines = p.stdout.splitlines()
    for i in range(2):
        made = [line for line in lines if '_varlen_attn.default' in line and f'layers.{i}.attention' in line]
        assert len(made) > 0 if '--cp_impl=ring' not in layout else made == [], p.stdout[-3000:]


def test_the_lm_head_peak_under_tp_is_what_the_estimate_says(tmp_path):
    """A bf16 step whose peak is the vocabulary-parallel loss's forward (Llama 3's vocabulary, 16K tokens,
    tp 2, 32 loss chunks): the dry run of rank 0 is the estimate for the kernels it ran, within 10% (-4.1%:
    a CPU's matmul makes a bf16 chunk of logits before its fp32 copy, CUDA's writes fp32). Before, the last
    block's output stayed bound in Llama.forward through the head (now rebound to the final norm's output)
    and the estimate left out that norm output's sequence shard, bound while the loss runs. (With the
    automatic 251 chunks the peak is a block's backward since flash's workspace is counted there only.)"""
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *TINY, '--n_embd=512', '--n_head=8',
                        '--intermediate_size=1376', '--n_layer=2', '--vocab_size=128256', '--seq_len=16384',
                        '--batch_size=1', '--mlp_chunks=0', '--loss_chunks=32', '--recompute=full', '--tp_size=2',
                        '--dtype=bfloat16', '--dry_run=True', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, 'WORLD_SIZE': '2'})
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(tmp_path, 'memory.json')) as f:  # the dry run's peak: the head's forward (no gradients yet)
        assert json.load(f)['ranks'][0]['measured']['grads'] == 0
    # the dry run's table: estimate (CPU kernels) and dry run side by side, then the error
    total = [line for line in p.stdout.splitlines() if line.strip().startswith('total') and '%' in line][-1]
    error = float(total.split('%')[0].split()[-1])
    assert abs(error) <= 10, total


def _rope_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group('gloo')
    model = apply_techniques(new_model(dict(recompute='full')))
    parallel.shard_states(model, parallel.make_mesh(1, 1), 3, torch.bfloat16)
    seen = []
    model.layers['0'].register_forward_pre_hook(lambda m, args: seen.append((args[1].dtype, args[2].dtype)))
    x, y = global_batch()
    model(x[rank::2], y[rank::2])[1].backward()
    if rank == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


def test_fsdp_keeps_the_rope_tables_fp32(tmp_path):
    """zero=3 in bf16: FSDP2's mixed precision would cast every block's forward inputs, RoPE's cos and sin too:
    bf16 positions, wrong at long context (and a copy kept per block). The block sees the fp32 tables."""
    mp.spawn(_rope_worker, args=(2, free_port(), str(tmp_path / 'seen.pt')), nprocs=2)
    assert torch.load(tmp_path / 'seen.pt') == [(torch.float32, torch.float32)]


# ----------------------------------------------------------------------------- pipeline parallelism
# name: (world, pp, tp, cp, cp_impl, zero, pp_schedule, model overrides); PP_M micro-batches of 2 rows each
PP_LAYOUTS = {
    'pp2_1f1b':      (2, 2, 1, 1, 'ulysses', 0, '1f1b', dict(recompute='selective')),
    'pp2_gpipe':     (2, 2, 1, 1, 'ulysses', 0, 'gpipe', {}),
    'pp4_1f1b':      (4, 4, 1, 1, 'ulysses', 0, '1f1b', dict(n_layer=4)),
    'pp4_gpipe':     (4, 4, 1, 1, 'ulysses', 0, 'gpipe', dict(n_layer=4, recompute='full')),
    'pp2_tp2':       (4, 2, 2, 1, 'ulysses', 0, '1f1b', {}),
    'pp2_cp2':       (4, 2, 1, 2, 'ulysses', 0, '1f1b', dict(recompute='selective')),
    'pp2_ring2':     (4, 2, 1, 2, 'ring', 0, 'gpipe', dict(recompute='full')),
    'pp2_dp2_zero3': (4, 2, 1, 1, 'ulysses', 3, '1f1b', {}),
    # attention by head groups, against one process with all heads at once
    'pp2_groups':    (2, 2, 1, 1, 'ulysses', 0, '1f1b', dict(attention_chunks=2)),
    'pp2_cp2_groups': (4, 2, 1, 2, 'ulysses', 0, 'gpipe', dict(n_head=8, n_kv_head=4, attention_chunks=0,
                                                              recompute='full')),
    # packed documents, other ones in each micro-batch (PP_DOCS), under both schedules, with tp, Ulysses and the ring
    'pp2_docs':      (2, 2, 1, 1, 'ulysses', 0, '1f1b', dict(docs=True)),
    'pp2_tp2_docs':  (4, 2, 2, 1, 'ulysses', 0, 'gpipe', dict(docs=True, recompute='selective')),
    'pp2_cp2_docs':  (4, 2, 1, 2, 'ulysses', 0, '1f1b', dict(docs=True)),
    'pp2_ring2_docs': (4, 2, 1, 2, 'ring', 0, 'gpipe', dict(docs=True, recompute='full')),
    # sliding windows: every layer's, and a full layer on stage 0 with a windowed one on stage 1 under the ring
    'pp2_window':    (2, 2, 1, 1, 'ulysses', 0, 'gpipe', dict(sliding_window=5)),
    'pp2_ring2_window': (4, 2, 1, 2, 'ring', 0, '1f1b', dict(docs=True, sliding_window=3,
                                                             layer_types=['full_attention', 'sliding_attention'])),
    # the Qwen block over stages, with tp
    'pp2_tp2_qwen':  (4, 2, 2, 1, 'ulysses', 0, '1f1b', dict(QWEN, recompute='selective')),
}
PP_M = 4
PP_DOCS = [[[5, 11], [16]], [[3, 3, 10], [1] * 16], [[16], [2, 13, 1]], [[9, 7], [4, 4, 4, 4]]]  # per micro-batch


def pp_step(model, mesh, config, pipe=None, docs=False):
    """A train.py step of PP_M micro-batches of 2 rows (dp: 1 each), some targets ignored (with docs: packed
    documents, PP_DOCS), then the evaluation of the first (train.evaluate's call): (loss, grad norm, grads, its val
    loss)."""
    from conftest import packed_batch
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, config.vocab_size, (2 * PP_M, S), generator=g) for _ in range(2))
    y[0, :11], y[5, 3:9] = -100, -100
    micro = [(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]) if not docs else packed_batch(PP_DOCS[i], config.vocab_size, i)
             for i in range(PP_M)]
    micro = [parallel.shard_batch(mesh, *m) for m in micro]
    loss = train.forward_backward(model, micro, nullcontext(), mesh, pipe)
    named = list(model.named_parameters())
    parallel.sync_grads(named, mesh, config)
    norm = parallel.clip_grad_norm_(named, 0.5, mesh, config)
    with torch.no_grad():  # weighted by its real targets, summed over dp x cp (train.evaluate)
        val = model(*micro[0])[1] if pipe is None else pipe.evaluate(*micro[0])
        val = torch.stack([val * (micro[0][1] != -100).sum(), (micro[0][1] != -100).sum().float()])
        val = val if mesh.dpcp_group is None else parallel.all_reduce(val, mesh.dpcp_group)
    return loss.item(), norm.item(), gather_full(named, mesh, config, grads=True), (val[0] / val[1]).item()


def _pp_worker(rank, world, port, names, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    for name in names:
        _, pp, tp, cp, cp_impl, zero, schedule, overrides = PP_LAYOUTS[name]
        config = model_config(overrides)
        mesh = parallel.make_mesh(tp, cp, cp_impl, config.n_kv_head, pp=pp)
        model = apply_techniques(new_model(overrides), mesh)
        if zero > 1:
            parallel.shard_states(model, mesh, zero, torch.float32)
        pipe = pipeline.Pipeline(model, mesh, schedule, PP_M, nullcontext(), torch.device('cpu'))
        result = pp_step(model, mesh, config, pipe, 'docs' in overrides)
        if mesh.dp_rank == mesh.cp_rank == mesh.tp_rank == 0:  # one rank per stage: its blocks' gradients
            torch.save(result, os.path.join(out_dir, f'{name}.{mesh.pp_rank}.pt'))
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def pp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp('pipeline')
    for world in (2, 4):
        names = [n for n, layout in PP_LAYOUTS.items() if layout[0] == world]
        mp.spawn(_pp_worker, args=(world, free_port(), names, str(out)), nprocs=world)
    return {name: [torch.load(out / f'{name}.{r}.pt') for r in range(PP_LAYOUTS[name][1])] for name in PP_LAYOUTS}


@pytest.mark.parametrize('name', list(PP_LAYOUTS))
def test_a_pipeline_step_equals_single_process(pp_results, name):
    """torch's schedule over our stages (pipeline.Pipeline), with tp, Ulysses or the ring, FSDP2: every stage's loss
    and gradient norm are one process's, and the stages' gradients together are its gradients, each once."""
    overrides = {k: v for k, v in PP_LAYOUTS[name][-1].items() if k != 'attention_chunks'}  # all heads at once
    ref_loss, ref_norm, ref_grads, ref_val = pp_step(apply_techniques(new_model(overrides)), parallel.Mesh(),
                                                     model_config(overrides), docs='docs' in overrides)
    grads = {}
    for loss, norm, stage_grads, val in pp_results[name]:
        assert abs(loss - ref_loss) <= RTOL * ref_loss and abs(norm - ref_norm) <= RTOL * ref_norm, (loss, ref_loss)
        assert abs(val - ref_val) <= RTOL * ref_val, (val, ref_val)
        assert not grads.keys() & stage_grads.keys()  # a stage holds its own blocks only
        grads.update(stage_grads)
    assert ref_norm > 0.5 and grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert rel(grads[n], ref_grads[n]) <= RTOL, (n, rel(grads[n], ref_grads[n]))


def test_a_pipeline_trains_as_one_process_and_resumes_on_other_stage_counts(tmp_path):
    """train.py with pp 2 (1F1B, 4 micro-batches): the losses and val losses of one process; its checkpoint (each
    stage's own blocks) resumes in one process and on pp 4, both as the uninterrupted run."""
    run = [*TINY, '--batch_size=2', '--gradient_accumulation_steps=4', '--eval_interval=3']
    ref, pp2 = str(tmp_path / 'ref'), str(tmp_path / 'pp2')
    torchrun(1, *run, '--max_iters=6', f'--out_dir={ref}')
    torchrun(2, *run, '--pp_size=2', '--max_iters=4', f'--out_dir={pp2}')
    assert_close_losses(read_log(pp2), read_log(ref)[:4])
    for nproc in (1, 4):
        out = str(tmp_path / f'resumed{nproc}')
        shutil.copytree(pp2, out)
        torchrun(nproc, *run, f'--pp_size={nproc}', '--max_iters=6', f'--out_dir={out}', '--init_from=resume')
        assert_close_losses(read_log(out), read_log(ref))


@cuda
def test_states_on_the_host_on_one_cuda_rank_train_as_on_the_gpu(tmp_path):
    """FSDP2's CPUOffloadPolicy on one CUDA rank (zero=3, offload_states=True: the fp32 rows, gradients and AdamW's
    moments in host memory, the step on the CPU): the bf16 losses of the states kept on the GPU, to bf16's
    rounding."""
    run = [*TINY, '--device=cuda', '--dtype=bfloat16', '--batch_size=4', '--max_iters=4']
    torchrun(1, *run, f'--out_dir={tmp_path / "gpu"}')
    torchrun(1, *run, '--zero=3', '--offload_states=True', f'--out_dir={tmp_path / "host"}')
    for a, b in zip(read_log(tmp_path / 'host'), read_log(tmp_path / 'gpu')):
        assert abs(a['loss'] - b['loss']) <= 2e-2 * b['loss'], (a, b)
