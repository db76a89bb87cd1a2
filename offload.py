"""
Keep, recompute or offload: what each transformer block saves for its backward, and where it waits.

Once chunked.py has removed the S×V and S×I peaks, what grows with S is what every block keeps for
backward. Per token and block, recompute='none' keeps (`saved_per_token` lists each tensor):

    qkv        q, k, v as attention gets them                 b·(h + 2kv)
    attention  its output and logsumexp (fp32)                b·h + 4·H
    other      2 RMSNorms (input, output; no fp32 copy)       4·b·h             (+ 4·b·I unchunked MLP)

`recompute` says what stays on the device; `offload` = α (Memo's) what goes to host memory while the
next blocks compute, with n = floor(α·S) host tokens:

    recompute  kept, α = 0        sent to host, α > 0                          recomputed in backward
    none       everything         qkv + attention whole; the last n tokens'    the first S - n tokens'
                                  other and wo input; the first S - n' input   other tensors
    selective  input + attention  input + qkv + attention                      all of other
    full       input              input                                        the whole block

    host bytes per block = B·(S-n)·b·h + B·S·(qkv + attention) + B·n·(other + b·h)   (none; selective: n = 0)
                           B·S·b·h                                                  (full)

plus B·S·b·h under Ulysses when S - n > 0 (the all-to-all's output is not what attention saves). The
last KEEP_LAST blocks are never offloaded, nor is a tensor under MIN_BYTES.

The cut (`_split`): all but the attention core works on each token alone, so the block runs on tokens [0, S-n) under
torch's checkpoint and on [S-n, S) with its saved tensors sent to host. The two meet in `block.attention.attend`: the
first range's runs the second range's block, whose attend runs the core once on both ranges' q, k, v (`_tokens` cuts
each tp rank's run under sequence parallelism) and hands its output back to the first range's recompute, not attended
again. Ring attention merges its kernels in its own Function: 'full' or α = 1 only (parallel.check_layout). A weight's
gradient is then the sum of the two ranges' parts: in bf16 rounded twice, within bf16's 2^-8 of the plain path's.

A block's tensors go to host on a side stream while the next blocks compute (at most MAX_IN_FLIGHT
blocks' copies in flight) and come back on another once the next block's MLP backward is done (so they
don't add to its peak; on a CPU streams are no-ops), into host buffers reused every step (a forward never
backpropagated keeps its buffer until `reset()`). From: Memo (Zhao et al. 2024, arXiv 2407.12117), torch's
`save_on_cpu`, recomputation (Chen et al. 2016), selective recomputation (Korthikanti et al. 2022).
"""
import math
import weakref
from functools import partial
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy

import chunked

KEEP_LAST = 2        # the last blocks stay on the device: their backward comes right after their forward
MIN_BYTES = 1 << 20  # smaller tensors stay too: a copy costs a launch and an event, and saves nothing
MAX_IN_FLIGHT = 2    # blocks whose device->host copies may still run before compute waits (Memo: 2)


# ----------------------------------------------------------------------------- how many bytes
def saved_per_token(config, dtype=torch.float32, seq_len=None):
    """[(what, bytes per token, the header's kind)] of each tensor a block saves with recompute='none'."""
    b, h, kv, I = dtype.itemsize, config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size
    norm = lambda name: [(f'{name} input', b * h, 'other'), (f'{name} output', b * h, 'other')]
    saved = norm('attention_norm') + [('q', b * h, 'qkv'), ('k', b * kv, 'qkv'), ('v', b * kv, 'qkv'),
                                      ('attention output (wo keeps a view)', b * h, 'attention'),
                                      ('attention logsumexp', 4 * config.n_head, 'attention')] + norm('ffn_norm')
    if chunked.mlp_chunks(config, seq_len) == 1:  # chunked.py's MLP keeps only its input
        saved += [(f'MLP {name}', b * I, 'other') for name in ('x W1ᵀ', 'x W3ᵀ', 'silu(x W1ᵀ)', 'product')]
    return saved

def _per_token(config, dtype, seq_len, *kinds):
    return sum(n for _, n, kind in saved_per_token(config, dtype, seq_len) if kind in kinds)

def kept_bytes(config, batch, seq_len, dtype=torch.float32):
    """Bytes one block keeps on the device for backward with offload off, for config.recompute."""
    bh = dtype.itemsize * config.n_embd
    return batch * seq_len * {'none': _per_token(config, dtype, seq_len, 'qkv', 'attention', 'other'), 'full': bh,
                              'selective': bh + _per_token(config, dtype, seq_len, 'attention')}[config.recompute]

def offloaded_blocks(config):
    return range(max(0, config.n_layer - KEEP_LAST)) if config.offload > 0 else range(0)

def block_bytes(config, batch, seq_len, dtype=torch.float32, cp_size=1):
    """(host, device): the bytes an offloaded block sends to host per forward (the header's formula;
    cp_size > 1: Ulysses) and those it keeps on the device (its saved tensors under MIN_BYTES)."""
    if config.offload == 0:
        return 0, 0
    bh, S = dtype.itemsize * config.n_embd, seq_len
    n = math.floor(config.offload * S) if config.recompute == 'none' else 0  # the last n tokens
    pieces = [bh * S] if config.recompute == 'full' else \
        [bh * (S - n), bh * n] + ([bh * S] if cp_size > 1 and n < S else []) + \
        [per_token * (n if kind == 'other' else S) for _, per_token, kind in saved_per_token(config, dtype, S)]
    pieces = [batch * p for p in pieces]
    return sum(p for p in pieces if p >= MIN_BYTES), sum(p for p in pieces if p < MIN_BYTES)

def host_bytes(config, batch, seq_len, dtype=torch.float32, cp_size=1):
    """Host memory one forward (one micro-step) needs; the pool holds this, reused every micro-step."""
    return len(offloaded_blocks(config)) * block_bytes(config, batch, seq_len, dtype, cp_size)[0]


# ----------------------------------------------------------------------------- choosing α
def block_forward_seconds(config, batch, seq_len, flops_per_s):
    """One block's forward at flops_per_s: 2 FLOPs per weight per token, and causal attention's 2·S·h."""
    h, kv, I = config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size
    return batch * seq_len * (2 * (2 * h * h + 2 * h * kv + 3 * h * I) + 2 * seq_len * h) / flops_per_s

def choose_alpha(config, batch, seq_len, dtype, block_forward_s, bandwidth, host_bytes_free):
    """Memo's rule: the largest α whose b·h + qkv + attention + α·other bytes per token cross in a block's
    forward at bandwidth (bytes/s) and fit host_bytes_free; 0.0 if α = 0 doesn't; 0 or 1 unless 'none'."""
    blocks = config.n_layer - KEEP_LAST
    whole = dtype.itemsize * config.n_embd + (
        0 if config.recompute == 'full' else _per_token(config, dtype, seq_len, 'qkv', 'attention'))
    other = _per_token(config, dtype, seq_len, 'other') if config.recompute == 'none' else 0
    budget = min(bandwidth * block_forward_s, host_bytes_free / max(blocks, 1)) / (batch * seq_len)
    if blocks <= 0 or budget < whole:
        return 0.0
    return 1.0 if other == 0 else min(1.0, (budget - whole) / other)

def extra_time(config, batch, seq_len, flops_per_s, bandwidth):
    """What offloading adds to a step, as a fraction of its compute (3 forwards per block): the copies that
    don't hide behind a block's forward, and with 'none' the token-wise recompute of the other 1 - α."""
    t_fwd, blocks = block_forward_seconds(config, batch, seq_len, flops_per_s), len(offloaded_blocks(config))
    sent = block_bytes(config, batch, seq_len, torch.bfloat16)[0] / bandwidth
    redo = (1 - config.offload) * 2 / 3 * blocks / config.n_layer if config.recompute == 'none' else 0
    return blocks * max(0.0, sent - t_fwd) / (3 * config.n_layer * t_fwd) + redo


# ----------------------------------------------------------------------------- the policy, per block
def apply(model):
    """Wrap each block's forward (as torchtitan applies checkpointing): it reads model.config at every call."""
    for i, block in model.layers.items():
        if 'forward' not in vars(block):
            block.forward = partial(_block_forward, model, int(i), block, block.forward)
    return model

def _keep_attention(ctx, op, *args, **kwargs):  # selective, α = 0: checkpoint keeps SDPA's outputs (any kernel)
    return CheckpointPolicy.MUST_SAVE if 'scaled_dot_product' in str(op) else CheckpointPolicy.PREFER_RECOMPUTE

def _block_forward(model, i, block, inner, x, cos, sin, docs=None, kv_cache=None):
    c, saved = model.config, None
    if kv_cache is not None or not torch.is_grad_enabled():
        return inner(x, cos, sin, docs, kv_cache)
    # block i-1, if offloaded, comes back once block i's attention output has its gradient: after its MLP backward
    last = None if c.offload == 0 or i == 0 else _device(x).last  # i == 0: a new forward
    def on_attention(module, args, a):  # (returns None: the output stays)
        a.register_hook(lambda grad: last[1]() and last[1]().fetch()) if a.requires_grad else None
    hook = block.attention.register_forward_hook(on_attention) if last is not None and last[0] == i - 1 else None
    try:
        if i in offloaded_blocks(c):
            y, saved = _offload(block, inner, x, cos, sin, docs, c.recompute, c.offload, i)
        elif c.recompute == 'none':
            y = inner(x, cos, sin, docs)
        else:
            y = checkpoint(inner, x, cos, sin, docs, use_reentrant=False, **({} if c.recompute == 'full' else dict(
                context_fn=partial(create_selective_checkpoint_contexts, _keep_attention))))
    finally:
        hook and hook.remove()  # a recompute in backward runs the block again: not this hook
    if c.offload > 0:
        _device(x).last = (i, weakref.ref(saved)) if saved is not None else last
    return y

@torch.compiler.disable  # saved-tensor hooks, side streams, a swapped attention: eager under compile too
def _offload(block, inner, x, cos, sin, docs, mode, alpha, i):
    keep = [t.untyped_storage() for t in (cos, sin, *block.parameters())]  # shared by every block: stay
    saved = Offloaded(_device(x), i, keep)
    with saved_tensors_hooks(saved.pack, _unpack):
        if mode == 'full':  # torch's checkpoint saves its input only, through our hooks
            y = checkpoint(inner, x, cos, sin, docs, use_reentrant=False)
        else:
            n = math.floor(alpha * x.shape[1]) if mode == 'none' else 0
            y = _split(block.attention, inner, x, cos, sin, docs, x.shape[1] - n, saved)
    saved.send()
    return y, saved

def _tokens(t, S, lo, hi):
    """Tokens lo..hi of every run of S tokens along dim -2 (under sequence parallelism a run per tp rank)."""
    return t if (lo, hi) == (0, S) else t.unflatten(-2, (-1, S))[..., lo:hi, :].flatten(-3, -2)

def _split(attention, inner, x, cos, sin, docs, s0, saved):
    """The header's cut: tokens [0, s0) under checkpoint, [s0, S) to host (s0 = S: 'selective'; 0: α = 1)."""
    S, real = x.shape[1], attention.attend
    state = {'late x': x[:, s0:]} if s0 < S else {}  # (an empty view would keep x alive)

    def run(attend, *args):  # the block with attention.attend swapped for ours
        outer, attention.attend = attention.attend, attend
        try:
            return inner(*args)
        finally:
            attention.attend = outer

    def core(q, k, v, docs):  # every token's q, k, v: attention once, what it saves to host whole
        if 'early' in state:  # each run: the early range's tokens, then the late one's
            runs = state['early'][0].shape[-2] // s0
            q, k, v = (torch.cat([e.unflatten(-2, (runs, -1)), t.unflatten(-2, (runs, -1))], -2).flatten(-3, -2)
                       for e, t in zip(state.pop('early'), (q, k, v)))
        a = real(q, k, v, docs)
        if s0:  # the early range's recompute gets it back instead of attending again
            state['replay'] = saved.pack(a)
        state['a'], state['grad'] = a, a.requires_grad
        return a

    attend_late = lambda q, k, v, docs: _tokens(core(q, k, v, docs), S, s0, S)
    late_block = lambda: run(attend_late, state.pop('late x'), _tokens(cos, S, s0, S), _tokens(sin, S, s0, S), docs)

    def attend_early(q, k, v, docs):
        if 'replay' in state and 'a' not in state:  # backward: the early range's recompute
            # requiring grad as in forward, so that the ops after it save what they saved then
            return _tokens(_unpack(state['replay']), S, 0, s0).detach().requires_grad_(state['grad'])
        with saved_tensors_hooks(saved.pack, _unpack):
            if s0 < S:  # the late range's block, whose attention runs the core
                state['early'] = (q, k, v)
                state['late y'] = late_block()
            else:
                core(q, k, v, docs)
        return _tokens(state.pop('a'), S, 0, s0)

    if s0 == 0:
        return late_block()
    early = lambda x0: run(attend_early, x0, _tokens(cos, S, 0, s0), _tokens(sin, S, 0, s0), docs)
    y = checkpoint(early, x[:, :s0], use_reentrant=False)
    return y if s0 == S else torch.cat([y, state.pop('late y')], 1)


# ----------------------------------------------------------------------------- one block's tensors, to host and back
class Offloaded:
    """One block's tensors: pack (forward), send (its end), fetch (block i+1's backward), wait and unpack."""

    def __init__(self, dev, index, keep):
        self.dev, self.index, self.keep = dev, index, keep
        self.tensors, self.uses = [], []  # device tensors: to send (forward), then back (backward)
        self.host, self.buffer, self.sent, self.back, self.ready = None, None, None, None, False

    def pack(self, t):
        if t.nbytes < MIN_BYTES or any(t.untyped_storage() is s for s in self.keep):
            return t  # stays where it is
        for k, u in enumerate(self.tensors):  # a tensor saved twice (by a norm, by a view) goes once
            if u.untyped_storage() is t.untyped_storage() and u.dtype == t.dtype and \
                    (u.shape, u.stride(), u.storage_offset()) == (t.shape, t.stride(), t.storage_offset()):
                self.uses[k] += 1
                return self, k
        self.tensors.append(t)
        self.uses.append(1)
        return self, len(self.tensors) - 1

    def send(self):
        if not self.tensors:
            return
        dev, sizes = self.dev, [t.nbytes for t in self.tensors]
        self.buffer = dev.pool.take(self.index, sum(_align(n) for n in sizes))
        ready = _mark(dev)  # after this block's forward kernels: the copies read their results
        with torch.cuda.stream(dev.d2h):  # None: a no-op
            _wait(ready, self.buffer.ready, stream=dev.d2h)  # and the last host->device copy out of this buffer
            self.host, offset = [], 0
            for t, n in zip(self.tensors, sizes):
                # in t's memory order (attention's output is [B, S, H, hd] in memory): it comes back
                # with t's strides, and what backward views of it stays a view, not a copy
                order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
                h = self.buffer.data[offset:offset + n].view(t.dtype).view([t.shape[d] for d in order])
                self.host.append(h.permute([order.index(d) for d in range(t.dim())]).copy_(t, non_blocking=dev.cuda))
                offset += _align(n)
            self.sent = _mark(dev, dev.d2h)
        _stats['bytes_to_host'] += 0 if dev.fake else sum(sizes)  # a dry run's fake bytes are not moved
        dev.in_flight.append((self.sent, self.tensors))  # freed once compute has waited for these copies (_retire)
        self.tensors = [None] * len(sizes)
        _retire(dev, MAX_IN_FLIGHT if dev.cuda else 0)

    def fetch(self):
        if self.buffer is None:
            return
        dev = self.dev
        _retire(dev, 0)  # backward has begun: every device->host copy must be done
        # allocated on the compute stream, which frees them after use
        self.tensors = [torch.empty_like(h, device=dev.device) for h in self.host]
        ready = _mark(dev)  # that memory may still be read by kernels queued before now
        with torch.cuda.stream(dev.h2d):
            _wait(self.sent, ready, stream=dev.h2d)
            for t, h in zip(self.tensors, self.host):
                t.copy_(h, non_blocking=dev.cuda)
            self.back = _mark(dev, dev.h2d)
        _stats['bytes_to_device'] += 0 if dev.fake else sum(h.nbytes for h in self.host)
        dev.pool.give(self.index, self.buffer, self.back)  # reusable once `back` has passed
        self.buffer = self.host = None

    def wait(self):
        """This block's backward begins: its own copies (no others) must have arrived."""
        self.ready = True
        self.fetch()  # nothing to do when it was prefetched
        _wait(self.back)

    def unpack(self, k):
        self.ready or self.wait()
        t = self.tensors[k]
        if t is None:
            raise RuntimeError("offload: a saved tensor was unpacked twice (retain_graph is not supported)")
        self.uses[k] -= 1
        if self.uses[k] == 0:
            self.tensors[k] = None  # autograd holds what it took; we let go
        return t


def _unpack(packed):
    return packed if isinstance(packed, torch.Tensor) else packed[0].unpack(packed[1])


# ----------------------------------------------------------------------------- host pool, streams, events
def _align(nbytes, to=512):  # every carved tensor starts aligned, for any dtype and for DMA
    return -(-nbytes // to) * to


class _Buffer:  # one allocation of the pool; `ready`: the last host->device copy out of it has passed
    def __init__(self, data):
        self.data, self.nbytes, self.ready = data, data.numel(), None


class HostPool:
    """A buffer per block (two if forwarded twice before its backward), reused every forward; the one place
    host memory is made, pinned with cudaHostRegister (`pin_memory()` rounds up to a power of two)."""

    def __init__(self, pin):
        self.pin, self.idle, self.buffers = pin, {}, []
        self.reserved = self.in_use = self.allocations = 0

    def take(self, block, nbytes, page=4096):
        idle = self.idle.setdefault(block, [])
        buf = next((buf for buf in idle if buf.nbytes >= nbytes), None)
        if buf is not None:
            idle.remove(buf)
        else:
            if idle:  # a longer sequence than before: give back a buffer that is now too small
                self.release(idle.pop())
            raw = torch.empty(nbytes + (2 * page if self.pin else 0), dtype=torch.uint8)
            start = -raw.data_ptr() % page if self.pin else 0
            buf = _Buffer(raw[start:start + nbytes])
            if self.pin and int(torch.cuda.cudart().cudaHostRegister(buf.data.data_ptr(), _align(nbytes, page), 0)):
                raise RuntimeError(f"offload: cudaHostRegister of {nbytes / 2**30:.2f} GiB failed")
            self.buffers.append(buf)
            self.reserved, self.allocations = self.reserved + nbytes, self.allocations + 1
        self.in_use += buf.nbytes
        return buf

    def give(self, block, buf, ready):
        buf.ready, self.in_use = ready, self.in_use - buf.nbytes
        self.idle.setdefault(block, []).append(buf)

    def release(self, buf):
        if self.pin:
            buf.ready and buf.ready.synchronize()  # no copy may still be reading these pages
            torch.cuda.cudart().cudaHostUnregister(buf.data.data_ptr())
        self.buffers.remove(buf)
        self.reserved -= buf.nbytes


_devices, _stats = {}, {'bytes_to_host': 0, 'bytes_to_device': 0}


def _device(x):
    """Per device (fake tensors: their own): copy streams (CUDA only), host pool, copies in flight."""
    key = (str(x.device), isinstance(x, FakeTensor))
    if key not in _devices:
        cuda = x.device.type == 'cuda' and not key[1]
        d2h, h2d = (torch.cuda.Stream(x.device), torch.cuda.Stream(x.device)) if cuda else (None, None)
        _devices[key] = SimpleNamespace(device=x.device, fake=key[1], cuda=cuda, d2h=d2h, h2d=h2d,
                                        pool=HostPool(pin=cuda), in_flight=[], last=None)
    return _devices[key]

def _mark(dev, stream=None):  # an event after the work queued so far on stream (default: current)
    return (stream or torch.cuda.current_stream(dev.device)).record_event() if dev.cuda else None

def _wait(*events, stream=None):  # stream (default: current) waits for each event (not None); the host does not
    for event in filter(None, events):
        event.wait(stream)

def _retire(dev, limit):  # compute waits for the oldest copies; then their device memory is free
    while len(dev.in_flight) > limit:
        _wait(dev.in_flight.pop(0)[0])

def stats():
    """Bytes moved each way since start (train.py logs bytes_to_host's rise per step) and the host pools' sizes."""
    pools = [d.pool for d in _devices.values() if not d.fake]
    return dict(_stats, host_reserved=sum(p.reserved for p in pools), host_in_use=sum(p.in_use for p in pools),
                host_allocations=sum(p.allocations for p in pools))

def host_buffers():
    """The host pool's tensors alive now (fake ones in a dry run): host memory, not the device's."""
    return [buf.data for d in _devices.values() for buf in d.pool.buffers]

def reset():
    """Give every pool's host memory back and forget the devices (tests; a forward without backward)."""
    for d in _devices.values():
        for buf in list(d.pool.buffers):
            d.pool.release(buf)
    _devices.clear()
