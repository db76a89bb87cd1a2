"""offload.py: keep / recompute / offload gives the plain path's loss and gradients, moves the bytes
its formula says, keeps on the device what its formula says, and leaves nothing behind on the
host."""
import dataclasses
import gc
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import measure
import offload
from conftest import apply_techniques, cuda
from knobs import Knobs
from model import Llama, rope_frequencies, rope_tables

B, S, V = 2, 37, 61  # an odd length: no chunk count or token fraction divides it


@pytest.fixture(autouse=True)
def offload_every_block(monkeypatch):
    # our models are tiny: send every block and every tensor, unless a test says otherwise
    monkeypatch.setattr(offload, 'KEEP_LAST', 0)
    monkeypatch.setattr(offload, 'MIN_BYTES', 0)
    offload.reset()
    # one thread: these matmuls are tiny, and on a busy 2-core box OpenMP's threads wait for each
    # other (a step takes 50x longer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    offload.reset()


def config(**knobs):
    args = dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=80, vocab_size=V)
    return Knobs(**{**args, **knobs})


def batch(seed=1, batch_size=B, seq_len=S):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (batch_size, seq_len), generator=g)
    targets = idx.roll(-1, 1)
    targets[0, :5] = -100
    return idx, targets


def step(model, idx, targets):
    """Loss and every parameter's gradient of one forward + backward (bf16 models under
    autocast)."""
    model.zero_grad(set_to_none=True)
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def same_model(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return apply_techniques(Llama(cfg).to(dtype))


_reference = {}


def reference(chunks, dtype=torch.float32):
    """The plain path (recompute none, offload off), once per chunking and dtype."""
    if (chunks, dtype) not in _reference:
        cfg = config(mlp_chunks=chunks[0], loss_chunks=chunks[1])
        _reference[chunks, dtype] = step(same_model(cfg, dtype), *batch())
    return _reference[chunks, dtype]


# ----------------------------------------------------------------- same numbers, formula's bytes

@pytest.mark.parametrize('chunks', [(1, 1), (3, 4)], ids=['plain', 'chunked'])
@pytest.mark.parametrize('alpha', [0.0, 0.5, 1.0])
@pytest.mark.parametrize('mode', ['none', 'selective', 'full'])
def test_loss_and_gradients_identical_and_bytes_match_formula(mode, alpha, chunks):
    cfg = config(recompute=mode, offload=alpha, mlp_chunks=chunks[0], loss_chunks=chunks[1])
    ref_loss, ref_grads = reference(chunks)
    sent = offload.stats()['bytes_to_host']
    loss, grads = step(same_model(cfg), *batch())
    assert rel(loss, ref_loss) <= 1e-6
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= 1e-6, name
    moved = offload.stats()['bytes_to_host'] - sent
    assert moved == offload.host_bytes(cfg, B, S) == cfg.n_layer * offload.block_bytes(cfg, B, S)[0]
    assert (moved > 0) == (alpha > 0)
    stats = offload.stats()
    assert stats['bytes_to_device'] == stats['bytes_to_host']  # all of it came back
    assert stats['host_in_use'] == 0  # and nothing is left on the host


@pytest.mark.parametrize('mode,alpha',
                         [('none', 0.3), ('none', 1.0), ('selective', 0.5), ('full', 0.5)])
def test_bf16_same_gradients_and_bytes(mode, alpha):
    """train.py's bf16: weights and activations bf16 under autocast (RMSNorm's fp32 math in its own
    Function)."""
    ref_loss, ref_grads = reference((3, 4), torch.bfloat16)
    cfg = config(recompute=mode, offload=alpha, mlp_chunks=3, loss_chunks=4)
    sent = offload.stats()['bytes_to_host']
    loss, grads = step(same_model(cfg, torch.bfloat16), *batch())
    assert rel(loss, ref_loss) <= 1e-6
    # 'none' with 0 < α < 1 runs the block on two token ranges: a weight's gradient is the sum of
    # two bf16 parts instead of one bf16 matmul over every token, equal within bf16's rounding
    # (2^-8)
    tol = 1e-2 if mode == 'none' and 0 < alpha < 1 else 1e-6
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= tol, name
    assert offload.stats()['bytes_to_host'] - sent == offload.host_bytes(cfg, B, S, torch.bfloat16)


def test_formula_by_hand():
    """The header's per-token table for one case, written out: fp32, chunked MLP, h 32, kv 16,
    H 4."""
    cfg = config(mlp_chunks=3, offload=0.5)
    h, kv, H, b = 32, 16, 4, 4
    saved = offload.saved_per_token(cfg, torch.float32, S)
    assert sum(saved['qkv']) == b * (h + 2 * kv)
    assert sum(saved['attention']) == b * h + 4 * H
    assert sum(saved['other']) == 4 * b * h
    n = 18  # floor(0.5 · 37): the last 18 tokens to host, the first 19 recomputed from their input
    qkv_and_attention = b * (2 * h + 2 * kv) + 4 * H
    assert offload.block_bytes(cfg, B, S)[0] == (B * (S - n) * b * h + B * S * qkv_and_attention
                                                   + B * n * (4 * b * h + b * h))
    selective = config(mlp_chunks=3, offload=0.5, recompute='selective')
    assert offload.block_bytes(selective, B, S)[0] == B * S * (b * h + qkv_and_attention)
    bf16 = offload.saved_per_token(cfg, torch.bfloat16, S)['other']
    # each norm's input and output in bf16: no fp32 copy (model.py's RMSNorm)
    assert sum(bf16) == 4 * 2 * h
    unchunked = offload.saved_per_token(config(mlp_chunks=1), torch.float32, S)
    # 4·b·I
    assert sum(map(sum, unchunked.values())) - sum(map(sum, saved.values())) == 4 * b * 80


def test_every_knob_off_wraps_no_block():
    """The default path is model.py's: with nothing to keep, recompute or offload, apply wraps no
    block; any knob on wraps every block."""
    plain = apply_techniques(Llama(config()))
    assert not any(isinstance(block, offload.Policy) for block in plain.layers.values())
    for knobs in (dict(recompute='full'), dict(recompute='selective'), dict(offload=0.5)):
        model = Llama(config(**knobs))
        names = model.state_dict().keys()
        wrapped = offload.apply(model, model.config)
        assert all(isinstance(block, offload.Policy) for block in wrapped.layers.values()), knobs
        assert wrapped.state_dict().keys() == names  # the blocks' own names
        assert not any('forward' in vars(m) for m in wrapped.modules())  # no method rebound


# ------------------------------------------------------------------------ what stays on the device

class _Created(TorchDispatchMode):
    """Weak references to every tensor the ops inside create."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out


def kept_after_forward(cfg, dtype, mlp_chunks):
    """Bytes of the tensors one block's forward created (its input included) that are still alive
    when it has returned, but its output: what the block keeps for backward, measured."""
    torch.manual_seed(0)
    model = apply_techniques(Llama(dataclasses.replace(cfg, n_layer=1)).to(dtype))
    block = model.layers['0']  # wrapped, unless every knob is off
    cos, sin = rope_tables(rope_frequencies(cfg)[0], torch.arange(S))
    x0 = torch.randn(B, S, cfg.n_embd, dtype=dtype, requires_grad=True)
    created = _Created()
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), created:
        x = x0 * 1  # the block's input, created here so that we see whether the block keeps it
        y = block(x, cos, sin)
    del x
    gc.collect()
    not_kept = [y, cos, sin, *block.parameters(), *offload.host_buffers()]
    skip = [t.untyped_storage() for t in not_kept]
    alive = []  # storages, once each
    for ref in created.refs:
        t = ref()
        if t is not None and not any(t.untyped_storage() is s for s in skip + alive):
            alive.append(t.untyped_storage())
    # on a CPU the host pool is made of the same memory: it is not the device's (host_buffers)
    return sum(s.nbytes() for s in alive), y


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('mlp_chunks', [1, 3])
@pytest.mark.parametrize('mode', ['none', 'selective', 'full'])
def test_kept_bytes_formula_matches_measurement(mode, mlp_chunks, dtype):
    cfg = config(recompute=mode, mlp_chunks=mlp_chunks)
    kept, _ = kept_after_forward(cfg, dtype, mlp_chunks)
    assert kept == offload.kept_bytes(cfg, B, S, dtype)
    # with offload the device keeps nothing that grows with S: it is on the host or recomputed
    cfg = config(recompute=mode, mlp_chunks=mlp_chunks, offload=0.5)
    kept, y = kept_after_forward(cfg, dtype, mlp_chunks)
    assert kept == 0
    assert offload.stats()['host_in_use'] >= offload.block_bytes(cfg, B, S, dtype)[0] > 0
    y.float().sum().backward()  # and it all comes back
    assert offload.stats()['host_in_use'] == 0


@pytest.mark.parametrize('mode', ['none', 'selective', 'full'])
def test_kept_bytes_of_a_qwen3_shaped_block(mode):
    """head_dim 16 of 4 heads, a query width of 64 = 2·n_embd, q, k, v biases and q and k norms (issue 52): a block
    keeps q and attention's output at that width and, with every tensor kept, the norms' inputs, b·(q + kv) a token
    more: the formula's bytes exactly (n_embd for the query width: 2·b·32 a token fewer in every mode but 'full'),
    and what goes to host at least its count."""
    cfg = config(recompute=mode, head_dim=16, attention_bias=True, qk_norm=True)
    kept, _ = kept_after_forward(cfg, torch.bfloat16, 1)
    assert kept == offload.kept_bytes(cfg, B, S, torch.bfloat16)
    cfg = dataclasses.replace(cfg, offload=0.5)
    kept, y = kept_after_forward(cfg, torch.bfloat16, 1)
    assert kept == 0
    assert offload.stats()['host_in_use'] >= offload.block_bytes(cfg, B, S, torch.bfloat16)[0] > 0
    y.float().sum().backward()
    assert offload.stats()['host_in_use'] == 0


@pytest.mark.parametrize('mode,alpha', [('none', 0.5), ('selective', 1.0), ('full', 0.5)])
def test_the_qwen_block_under_recompute_and_offload_has_its_gradients(mode, alpha):
    """The Qwen block (head_dim decoupled, q, k, v biases off zero, q and k norms off one) under each policy,
    the token split included (offload's first range recomputed, its core run once over both ranges' q, k, v): the
    loss and every gradient of the plain block."""
    from test_parallel import perturbed
    qwen = dict(head_dim=16, attention_bias=True, qk_norm=True)
    torch.manual_seed(0)
    ref_loss, ref_grads = step(apply_techniques(perturbed(Llama(config(**qwen)))), *batch())
    torch.manual_seed(0)
    loss, grads = step(apply_techniques(perturbed(Llama(config(recompute=mode, offload=alpha, **qwen)))), *batch())
    assert rel(loss, ref_loss) <= 1e-6
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= 1e-6, name
    assert offload.stats()['bytes_to_host'] > 0


def backward_peak(cfg, seq_len=256):
    """measure.Tracker over one forward + backward: the peak, and its activations + working set (the
    peak but parameters and gradients, which grow with depth whatever offload does)."""
    # a fresh host pool: the tracker tells host buffers from device memory as they are made
    offload.reset()
    model = same_model(cfg)
    idx, targets = batch(seq_len=seq_len)
    tracker = measure.Tracker(model, inputs=[idx, targets])
    with tracker:
        model(idx, targets)[1].backward()
    peak = tracker.breakdown()
    return peak['total'], peak['activations'] + peak['transient']


@pytest.mark.parametrize('mode,alpha', [('selective', 1.0), ('none', 0.5)])
def test_a_recomputed_block_is_freed_when_its_backward_is_done(mode, alpha):
    """One block's recomputed tensors at a time: with offload the peak's activations and working set
    don't grow with depth (a recompute's graph holding its own tensors would keep every block's
    recomputed copy to the end of backward), and the peak is no higher than offload off's, which
    keeps every block's input and attention ('selective') or everything. (With 'selective' q, k and
    v come back with attention's output, but only once the MLP's backward is done: below offload
    off's peak.)"""
    # the plain MLP: a recomputed block is large
    knobs = dict(recompute=mode, mlp_chunks=1, loss_chunks=4)
    two, six = (backward_peak(config(n_layer=n, offload=alpha, **knobs)) for n in (2, 6))
    assert six[1] == two[1]
    assert six[0] <= backward_peak(config(n_layer=6, **knobs))[0]
    if mode == 'selective':
        # two blocks: in block 1's backward offload off keeps block 0's input and attention all
        # along; offload brings them (and q, k, v) back after block 1's MLP backward, its peak
        assert two[0] < backward_peak(config(n_layer=2, **knobs))[0]


def test_tiny_tensors_and_last_blocks_stay(monkeypatch):
    cfg = config(recompute='none', offload=0.5, mlp_chunks=3, loss_chunks=4)
    ref_loss, ref_grads = reference((3, 4))
    for keep_last, min_bytes in [(2, 0), (0, 1000), (2, 1 << 20)]:
        monkeypatch.setattr(offload, 'KEEP_LAST', keep_last)
        monkeypatch.setattr(offload, 'MIN_BYTES', min_bytes)
        sent = offload.stats()['bytes_to_host']
        loss, grads = step(same_model(cfg), *batch())
        assert rel(loss, ref_loss) <= 1e-6
        assert all(rel(g, ref_grads[n]) <= 1e-6 for n, g in grads.items())
        assert offload.stats()['bytes_to_host'] - sent == offload.host_bytes(cfg, B, S)
    assert offload.host_bytes(cfg, B, S) == 0  # 1 MiB: every tensor of this model is tiny
    monkeypatch.setattr(offload, 'MIN_BYTES', 0)
    everything = offload.block_bytes(cfg, B, S)[0]
    assert offload.host_bytes(cfg, B, S) == everything  # block 0 of 3 only
    monkeypatch.setattr(offload, 'KEEP_LAST', 0)
    # attention's logsumexp, B·S·H·4 = 1184 bytes, stays
    monkeypatch.setattr(offload, 'MIN_BYTES', 2000)
    assert offload.block_bytes(cfg, B, S)[0] == everything - B * S * 4 * 4


# ------------------------------------------------------------------------- host memory over steps

def test_no_leak_and_flat_host_memory_over_30_steps():
    cfg = config(recompute='none', offload=0.5, mlp_chunks=3, loss_chunks=4)
    model = same_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pools, sent = None, offload.stats()['bytes_to_host']
    for it in range(30):
        idx, targets = batch(seed=it)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = offload.stats()
        assert stats['host_in_use'] == 0  # every block came back: nothing left on the host
        assert stats['host_allocations'] == cfg.n_layer  # a buffer per block, allocated once
        assert stats['host_reserved'] >= offload.host_bytes(cfg, B, S)
        buffers = [b.data_ptr() for b in offload.host_buffers()]
        assert len(buffers) == cfg.n_layer
        assert pools is None or buffers == pools  # the same memory, step after step
        pools = buffers
    assert offload.stats()['bytes_to_host'] - sent == 30 * offload.host_bytes(cfg, B, S)


@pytest.mark.parametrize('order', ['f1 b1 f2 b2', 'f1 f2 b1 b2'])
def test_gradient_accumulation(order):
    """Two micro-steps: gradients add up as without offload, also with both forwards before either
    backward (then the pool hands each block a second buffer)."""
    micro = [batch(seed=7), batch(seed=8)]
    grads = []
    for alpha in (0.0, 0.5):
        model = same_model(config(recompute='none', offload=alpha, mlp_chunks=3, loss_chunks=4))
        if order == 'f1 b1 f2 b2':
            for idx, targets in micro:
                model(idx, targets)[1].backward()
        else:
            losses = [model(idx, targets)[1] for idx, targets in micro]
            for loss in losses:
                loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        assert rel(g, grads[0][name]) <= 1e-6, name
    stats = offload.stats()
    assert stats['host_in_use'] == 0
    assert stats['host_allocations'] == (3 if order == 'f1 b1 f2 b2' else 6)


def test_host_pool_reuses_grows_and_doubles_up():
    pool = offload.HostPool(pin=False)

    def in_use():
        return sum(buf.nbytes for buf in pool.buffers if buf not in pool.idle)
    a = pool.take(1000)
    pool.give(a, None)
    assert pool.take(800) is a and pool.allocations == 1  # reused, not reallocated
    c = pool.take(500)  # a second forward before the first one's backward: a second buffer
    assert c is not a and pool.allocations == 2 and in_use() == 1500
    pool.give(a, None)
    pool.give(c, None)
    d = pool.take(2000)  # longer sequences: a bigger buffer replaces a small one
    # c (500) went
    assert d.nbytes == 2000 and pool.allocations == 3
    assert sum(buf.nbytes for buf in pool.buffers) == 1000 + 2000  # reserved
    pool.give(d, None)
    assert in_use() == 0


# ----------------------------------------------------------------------------- order of the copies

def test_backward_prefetches_the_previous_block(monkeypatch):
    """Block i-1 starts coming back during block i's backward, once its attention output has its
    gradient (its MLP's backward done), before block i-1's backward needs it: two blocks' tensors on
    the device at most."""
    events = []
    fetch, wait = offload.Offloaded.fetch, offload.Offloaded.wait

    def logged_fetch(self):
        if self.buffer is not None:
            events.append(('fetch', self.index))
        fetch(self)

    def logged_wait(self):
        events.append(('use', self.index))
        wait(self)
    monkeypatch.setattr(offload.Offloaded, 'fetch', logged_fetch)
    monkeypatch.setattr(offload.Offloaded, 'wait', logged_wait)
    cfg = config(n_layer=4, recompute='none', offload=0.5, mlp_chunks=3)
    step(same_model(cfg), *batch())
    expected = [('fetch', i) for i in range(4)] + [('use', i) for i in range(4)]
    assert sorted(events) == sorted(expected)
    at = events.index
    for j in range(3):  # block j comes back while block j+1's backward runs, not earlier
        assert at(('use', j + 1)) < at(('fetch', j)) < at(('use', j))
    # with the last blocks kept, the last offloaded one is prefetched too, when the kept block after
    # it begins its backward: not before block 3's backward is done (its weights' gradients made)
    events.clear()
    monkeypatch.setattr(offload, 'KEEP_LAST', 2)
    model = same_model(cfg)
    for p in model.layers['3'].parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(('grad', 3)))
    step(model, *batch())
    last_grad_of_block_3 = max(i for i, e in enumerate(events) if e == ('grad', 3))
    assert last_grad_of_block_3 < events.index(('fetch', 1)) < events.index(('use', 1))


# ----------------------------------------------------------------------------- edges

def test_token_ranges_may_chunk_the_mlp_differently():
    # mlp_chunks=0 chunks the MLP at 300 tokens (chunked.py: >= 256 tokens a chunk) but not at 150:
    # each token range of the block picks its own count, and the gradients stay the plain path's
    cfg = config(n_layer=2, mlp_chunks=0)
    idx, targets = batch(seq_len=300, batch_size=1)
    ref_loss, ref_grads = step(same_model(cfg), idx, targets)
    cfg = config(n_layer=2, mlp_chunks=0, recompute='none', offload=0.5)
    loss, grads = step(same_model(cfg), idx, targets)
    assert rel(loss, ref_loss) <= 1e-6
    assert all(rel(g, ref_grads[n]) <= 1e-6 for n, g in grads.items())


def test_fake_tensors_run_without_host_memory():
    """memory.py's dry run: fake tensors go through the same policy, and no real memory is taken."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    cfg = config(recompute='none', offload=0.5, mlp_chunks=3, loss_chunks=4)
    before = offload.stats()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = apply_techniques(Llama(cfg))
        idx = torch.randint(0, V, (B, S))
        _, loss = model(idx, idx)
        loss.backward()
    assert isinstance(loss, FakeTensor)
    assert offload.stats() == before


# ------------------------------------------------------------------------ choosing α, host memory

LLAMA3_8B = dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                 vocab_size=128256)


def test_choose_alpha_is_memo_rule():
    cfg = Knobs(**LLAMA3_8B, recompute='none', mlp_chunks=4, offload=0.5)
    seq, bf16 = 131072, torch.bfloat16
    saved = offload.saved_per_token(cfg, bf16, seq)
    whole = 2 * 4096 + sum(saved['qkv']) + sum(saved['attention'])  # b·h: the input or wo's
    other = sum(saved['other'])
    tokens, blocks = seq, cfg.n_layer - offload.KEEP_LAST
    # the transfer of input + attention + α·other just fits one block's forward: α = 0.5
    t = tokens * (whole + 0.5 * other) / 25e9
    assert offload.choose_alpha(cfg, 1, seq, bf16, t, 25e9, float('inf')) == pytest.approx(0.5)
    # host memory for a quarter of the others only
    host = blocks * tokens * (whole + 0.25 * other)
    assert offload.choose_alpha(cfg, 1, seq, bf16, t, 25e9, host) == pytest.approx(0.25)
    # can't even hide input and attention: don't offload
    too_short = 0.5 * tokens * whole / 25e9
    assert offload.choose_alpha(cfg, 1, seq, bf16, too_short, 25e9, float('inf')) == 0.0
    # only whole tensors move with full / selective
    for mode in ('full', 'selective'):
        c = Knobs(**LLAMA3_8B, recompute=mode, mlp_chunks=4)
        assert offload.choose_alpha(c, 1, seq, bf16, t, 25e9, float('inf')) == 1.0
        assert offload.choose_alpha(c, 1, seq, bf16, t, 25e9, 1e6) == 0.0
    # the α it picks does fit: the formula's bytes within both limits
    fwd = offload.block_forward_seconds(cfg, 1, seq, 400e12)
    alpha = offload.choose_alpha(cfg, 1, seq, bf16, fwd, 25e9, 1e12)
    assert 0 < alpha <= 1
    chosen = Knobs(**LLAMA3_8B, recompute='none', mlp_chunks=4, offload=alpha)
    assert offload.block_bytes(chosen, 1, seq, bf16)[0] <= fwd * 25e9 * (1 + 1e-9)
    assert offload.host_bytes(chosen, 1, seq, bf16) <= 1e12


# ----------------------------------------------------------------------------- torch.compile

def test_compile_with_offload_runs_and_gives_the_losses_of_eager(tmp_path):
    """compile=True with offload > 0 and recompute 'none' died with a segfault (exit 139): the
    offloaded blocks now run eagerly (torch.compiler.disable), the rest compiled, and offload moves
    its bytes; the losses are eager's up to the rounding of inductor's fused kernels."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = {}
    for compiled in (True, False):
        out = tmp_path / str(compiled)
        args = ['config/train_tiny.py', '--device=cpu', f'--compile={compiled}', '--offload=0.5',
                '--recompute=none', '--seq_len=512', '--batch_size=4', '--max_iters=2',
                '--eval_iters=1', f'--out_dir={out}']
        run = subprocess.run([sys.executable, 'train.py', *args], cwd=repo, capture_output=True,
                             text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=900)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        rows[compiled] = [json.loads(line) for line in open(out / 'log.jsonl')]
    assert all(r['offload_bytes'] > 0 for r in rows[True])
    assert [r['iter'] for r in rows[True]] == [r['iter'] for r in rows[False]] == [0, 1]
    for a, b in zip(rows[True], rows[False]):
        assert abs(a['loss'] - b['loss']) <= 1e-5 * b['loss'], (rows[True], rows[False])


@pytest.mark.parametrize('knobs', [dict(mlp_chunks=3, loss_chunks=4), dict(recompute='full'),
                                   dict(recompute='selective', offload=1.0),
                                   dict(recompute='none', offload=0.5),
                                   dict(recompute='full', offload=0.5)],
                         ids=['chunked', 'full', 'selective+offload', 'offload 0.5',
                              'full+offload'])
@pytest.mark.parametrize('window', [0, 3], ids=['no window', 'window 3'])
def test_doc_mask_under_every_knob(knobs, window):
    """Packed documents (doc_mask), with or without a sliding window, give the plain path's loss
    and gradients under chunking, recompute and offload: the documents' starts and the layer's
    window reach attention in the recompute and in the token-wise split too."""
    from conftest import packed_batch
    x, y, pos, docs = packed_batch([[5, 11], [16]], vocab=V)
    runs = []
    for cfg in (config(sliding_window=window), config(sliding_window=window, **knobs)):
        model = same_model(cfg)
        loss = model(x, y, pos, docs)[1]
        loss.backward()
        runs.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (loss, grads) = runs
    assert abs(loss - ref) <= 1e-5 * ref
    for n in ref_grads:
        assert rel(grads[n], ref_grads[n]) <= 1e-5, n


@cuda
@pytest.mark.parametrize('recompute', ['none', 'full'])
def test_offload_on_cuda_streams_is_exact_and_sends_to_pinned_host_memory(recompute):
    """On a CUDA GPU offload.py's copies run on their own streams into pinned host memory, overlapping the
    blocks' compute: the loss and gradients equal the plain path's (fp32), everything sent came back, and a copy
    out of the pool's memory returns before it is done (pinned: asynchronous; pageable memory makes the host
    wait). (The bytes differ from the CPU's formula: CUDA's fp32 attention kernel saves other tensors.)"""
    torch.manual_seed(0)
    plain = Llama(config()).cuda()
    idx, targets = (t.cuda() for t in batch())
    want = step(plain, idx, targets)
    model = apply_techniques(Llama(config(recompute=recompute, offload=1.0)).cuda())
    model.load_state_dict(plain.state_dict())
    got = step(model, idx, targets)
    torch.cuda.synchronize()
    assert rel(got[0], want[0]) < 1e-5
    assert all(rel(got[1][n], want[1][n]) < 1e-5 for n in want[1])
    stats = offload.stats()
    assert stats['bytes_to_host'] == stats['bytes_to_device'] > 0
    n = 256 << 20
    target = torch.empty(n, dtype=torch.uint8, device='cuda')
    waited = {}
    pool = offload.HostPool(pin=True)
    sources = {'pool': pool.take(n), 'pageable': torch.empty(n, dtype=torch.uint8)}
    for kind, source in sources.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.copy_(source.data if kind == 'pool' else source, non_blocking=True)
        returned = time.perf_counter() - t0
        torch.cuda.synchronize()
        waited[kind] = (returned, time.perf_counter() - t0)
    pool.release(sources['pool'])  # unregistered before its pages go back to the allocator
    assert waited['pool'][0] < waited['pool'][1] / 4 and waited['pageable'][0] > waited['pageable'][1] / 2, waited
