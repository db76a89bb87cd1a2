"""
Keep, recompute or offload: what each transformer block saves for its backward, and where it waits.

Once chunked.py has removed the S×V and S×I peaks, what grows with S is what every block keeps for
backward. Per token and block, recompute='none' keeps (`saved_per_token`, tensor by tensor):

    qkv        q, k, v as attention gets them                 b·(q + 2kv)
    attention  its output and logsumexp (fp32)                b·q + 4·H
    other      2 RMSNorms (input, output; no fp32 copy)       4·b·h     (+ 4·b·I unchunked MLP)
               Qwen3's q and k norms (their inputs)           b·(q + kv)

(q = H·hd, the query and attention-output width, h where head_dim is n_embd / n_head; kv = K·hd.)

`recompute` says what stays on the device; `offload` = α (Memo's) what goes to host memory while
the next blocks compute, with n = floor(α·S) host tokens:

    recompute  kept, α = 0        sent to host, α > 0                    recomputed in backward
    none       everything         qkv + attention whole; the last n      the first S - n tokens'
                                  tokens' other and wo input; the        other tensors
                                  first S - n tokens' input
    selective  input + attention  input + qkv + attention                all of other
    full       input              input                                  the whole block

    host bytes per block = B·(S-n)·b·h + B·S·(qkv + attention) + B·n·(other + b·q)
                               (none; selective: n = 0)
                           B·S·b·h  (full)

plus B·S·b·q under Ulysses when S - n > 0 (the all-to-all's output is not what attention saves).
By head groups (chunked.py's attention_chunks) attention keeps the norm's output alone: no qkv or
attention, nor wo's input; its groups can't run on two token ranges, so offload cuts no tokens
there ('full', or 'none' with α = 1: parallel.check_layout says so).
The last KEEP_LAST blocks are never offloaded, nor is a tensor under MIN_BYTES.

The cut (`_Split`, its events numbered above it): all but the attention core works on each token
alone, so the block's parts (model.py's Attention.project, Attention.core, Attention.finish,
Block.with_mlp) run in order: q, k, v of tokens [0, S-n) under torch's checkpoint and of [S-n, S)
with what they save sent to host, the core once on both ranges' q, k, v, then the rest of each
range; in backward the first range's
recompute takes its tokens of the core's output back from host instead of attending again. Ring
attention merges its kernels in its own Function, whose output can't be taken back so: 'full' or α =
1 only (parallel.check_layout). A weight's gradient is the sum of the two ranges' parts: in bf16
rounded twice, within bf16's 2^-8 of the plain path's.

A block's tensors go to host on a side stream while the next blocks compute (at most MAX_IN_FLIGHT
blocks' copies in flight) and come back on another once the next block's MLP backward is done (so
they don't add to its peak; on a CPU streams are no-ops), into host buffers reused every step (a
forward never backpropagated keeps its buffer until `reset()`). From: Memo (Zhao et al. 2024,
arXiv 2407.12117), torch's `save_on_cpu`, recomputation (Chen et al. 2016), selective recomputation
(Korthikanti et al. 2022).

The policy wraps each block from outside (`apply`: a Policy module in the block's place, holding
its modules under their own names); with every knob off (recompute='none', offload=0) it wraps
none: the model runs as model.py writes it, and nothing here runs.
"""
import math
import weakref
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import (checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn, CheckpointPolicy)

import chunked
from model import Block

# the last blocks stay on the device: their backward comes right after their forward
KEEP_LAST = 2
# smaller tensors stay too: a copy costs a launch and an event, and saves nothing
MIN_BYTES = 1 << 20
# blocks whose device->host copies may still run before compute waits (Memo: 2)
MAX_IN_FLIGHT = 2


# ----------------------------------------------------------------------------- how many bytes
def saved_per_token(config, dtype=torch.float32, seq_len=None):
    """Bytes per token of each tensor a block saves with recompute='none', by the header's kind:
    qkv: q, k, v as attention gets them; attention: its output (wo keeps a view) and logsumexp
    (fp32); other: attention_norm's input and output, ffn_norm's input and output, the plain
    MLP's x W1ᵀ, x W3ᵀ, silu(x W1ᵀ) and their product (chunked.py's keeps only its input), and
    Qwen3's q and k norms' inputs."""
    b, h = dtype.itemsize, config.n_embd
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    saved = {'qkv': [b * q, b * kv, b * kv],
             'attention': [b * q, 4 * config.n_head],
             'other': [b * h] * 4}
    if config.attention_chunks != 1:
        # by head groups (chunked.py): attention keeps only its input, the norm's output (then
        # not 'other'), and rebuilds the rest one group at a time
        saved['qkv'], saved['attention'] = [], [saved['other'].pop()]
    elif config.qk_norm:
        # Qwen3's norms of q and k keep their inputs (the projections' outputs): norms' tensors,
        # which recompute rebuilds and offload sends for the last n tokens alone
        saved['other'] += [b * q, b * kv]
    if chunked.mlp_chunks(config, seq_len) == 1:
        saved['other'] += [b * config.intermediate_size] * 4
    return saved


def _per_token(config, dtype, seq_len, *kinds):
    saved = saved_per_token(config, dtype, seq_len)
    return sum(sum(saved[kind]) for kind in kinds)


def kept_bytes(config, batch, seq_len, dtype=torch.float32):
    """Bytes one block keeps on the device for backward with offload off, for config.recompute."""
    block_input = dtype.itemsize * config.n_embd  # per token
    if config.recompute == 'none':
        per_token = _per_token(config, dtype, seq_len, 'qkv', 'attention', 'other')
    elif config.recompute == 'selective':
        per_token = block_input + _per_token(config, dtype, seq_len, 'attention')
    else:  # 'full'
        per_token = block_input
    return batch * seq_len * per_token


def offloaded_blocks(config):
    """The blocks that send their tensors to host: all but the last KEEP_LAST (none with α = 0)."""
    return range(config.n_layer - KEEP_LAST if config.offload > 0 else 0)


def block_bytes(config, batch, seq_len, dtype=torch.float32, cp_size=1):
    """(host, device): the bytes an offloaded block sends to host per forward (the header's formula;
    cp_size > 1: Ulysses) and those it keeps on the device (its saved tensors under MIN_BYTES)."""
    if config.offload == 0:
        return 0, 0
    # B·b·h: a token of the block's input, in every sequence of the batch; B·b·q of attention's
    # output
    bh, S = batch * dtype.itemsize * config.n_embd, seq_len
    bq = batch * dtype.itemsize * config.n_head * config.head_dim
    if config.recompute == 'full':
        pieces = [bh * S]  # the block's input
    else:
        n = math.floor(config.offload * S) if config.recompute == 'none' else 0  # the last n tokens
        # the first S - n tokens' input (checkpoint's), wo's input for the last n (a view of their
        # attention output, packed apart from it; by head groups none), then every saved tensor
        pieces = [bh * (S - n), bq * n * (config.attention_chunks == 1)]
        if cp_size > 1 and n < S:
            pieces.append(bq * S)  # Ulysses: the output the recompute replays
        for kind, sizes in saved_per_token(config, dtype, S).items():
            tokens = n if kind == 'other' else S
            pieces += [batch * per_token * tokens for per_token in sizes]
    host = sum(p for p in pieces if p >= MIN_BYTES)
    return host, sum(pieces) - host


def host_bytes(config, batch, seq_len, dtype=torch.float32, cp_size=1):
    """Host memory one forward (one micro-step) needs; the pool holds this, reused every
    micro-step."""
    return len(offloaded_blocks(config)) * block_bytes(config, batch, seq_len, dtype, cp_size)[0]


# ----------------------------------------------------------------------------- choosing α
def block_forward_seconds(config, batch, seq_len, flops_per_s):
    """One block's forward at flops_per_s: 2 FLOPs per weight per token, and causal attention's
    2·S·q (q = H·hd)."""
    h, kv, I = config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size
    q = config.n_head * config.head_dim
    weights = 2 * h * q + 2 * h * kv + 3 * h * I
    return batch * seq_len * (2 * weights + 2 * seq_len * q) / flops_per_s


def choose_alpha(config, batch, seq_len, dtype, block_forward_s, bandwidth, host_bytes_free):
    """Memo's rule: the largest α whose b·h + qkv + attention + α·other bytes per token cross
    in a block's forward at bandwidth (bytes/s) and fit host_bytes_free; 0.0 if α = 0 doesn't;
    0 or 1 unless 'none'."""
    blocks = config.n_layer - KEEP_LAST
    whole = dtype.itemsize * config.n_embd
    if config.recompute != 'full':
        whole += _per_token(config, dtype, seq_len, 'qkv', 'attention')
    if blocks <= 0:
        return 0.0
    budget = min(bandwidth * block_forward_s, host_bytes_free / blocks) / (batch * seq_len)
    if budget < whole:
        return 0.0
    if config.recompute != 'none':
        return 1.0
    other = _per_token(config, dtype, seq_len, 'other')
    return min(1.0, (budget - whole) / other)


def extra_time(config, batch, seq_len, flops_per_s, bandwidth):
    """What offloading adds to a step, as a fraction of its compute (3 forwards per block): the
    copies that don't hide behind a block's forward, and with 'none' the token-wise recompute of
    the other 1 - α."""
    t_fwd = block_forward_seconds(config, batch, seq_len, flops_per_s)
    blocks = len(offloaded_blocks(config))
    sent = block_bytes(config, batch, seq_len, torch.bfloat16)[0] / bandwidth
    redo = 0
    if config.recompute == 'none':
        redo = (1 - config.offload) * 2 / 3 * blocks / config.n_layer
    return blocks * max(0.0, sent - t_fwd) / (3 * config.n_layer * t_fwd) + redo


# ------------------------------------------------------------------------ the policy, per block
def apply(model, knobs):
    """Put each block under the policy of `knobs`' recompute and offload (a knobs.Knobs), as
    torchtitan applies checkpointing: model.layers[i] becomes a Policy holding the block's own
    modules. Apply once the knobs are final (train.py builds the model after auto_memory), and
    once."""
    # nothing to keep, recompute or offload (the default): no block is wrapped, the model runs as
    # model.py writes it (the wrapper would only call the block's own forward)
    if knobs.recompute == 'none' and knobs.offload == 0:
        return model
    for i, block in list(model.layers.items()):
        model.layers[i] = Policy(block, knobs, int(i))
    return model


class Policy(Block):
    """Block i under the keep / recompute / offload policy: the block's own modules, adopted under
    their own names (its parameters and state dict are the block's), and Block's forward run under
    the policy."""

    def __init__(self, block, config, i):
        # not Block.__init__: that would make new modules; these are the block's
        chunked.adopt(self, block)
        self.config = config
        self.i = i

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        if kv_cache is not None or not torch.is_grad_enabled():
            # sampling or evaluation: nothing is kept for a backward
            return super().forward(x, cos, sin, docs, kv_cache)
        # (blocks 0..k-1: `<`, as torch.compile may trace i as a symbolic int, which `in` can't
        # take)
        if self.i < len(offloaded_blocks(self.config)):
            return _offload(self, x, cos, sin, docs)
        return _keep_or_recompute(self.hooked, self.config.recompute, x, cos, sin, docs)

    def hooked(self, x, cos, sin, docs):
        """Block's forward, its attention half's output hooked for block i-1's prefetch."""
        h = self.with_attention(x, cos, sin, docs)
        if self.config.offload > 0:
            _prefetch(self.i, h)
        return self.with_mlp(h)


def _prefetch(i, h):
    """On block i's attention half's output h: block i-1, if offloaded in the forward under way,
    starts coming back once h has its gradient, i.e. once block i's MLP backward is done (its
    tensors don't add to that peak), before block i-1's backward needs them. (A recompute in
    backward runs this again: a hook on a recomputed tensor never runs.)"""
    previous = _offloaded.get(i - 1)
    if previous is None or not h.requires_grad:
        return
    # The hook holds block i-1 weakly: a spent graph can outlive its step (MemTracker's hooks keep
    # them), and a strong reference would keep that block's tensors (RoPE's tables among them) too.
    previous = weakref.ref(previous)

    def fetch_previous(grad):
        block = previous()
        if block is not None:
            block.fetch()

    h.register_hook(fetch_previous)


def _keep_or_recompute(forward, recompute, *args):
    """A block on the device (its `forward`, args: x, cos, sin, docs) keeps everything ('none'),
    its input ('full'), or its input and attention's output ('selective': checkpoint keeps what
    SDPA saves, any kernel)."""
    if recompute == 'none':
        return forward(*args)
    # 'full': checkpoint's default context, which saves nothing inside
    context = noop_context_fn
    if recompute == 'selective':
        context = partial(create_selective_checkpoint_contexts, _keep_attention)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context)


def _keep_attention(ctx, op, *args, **kwargs):
    if 'scaled_dot_product' in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# eager under torch.compile too: saved-tensor hooks, side streams
@torch.compiler.disable
def _offload(block, x, cos, sin, docs):
    """Block i's forward (a Policy's: Block's forward, hooked), its saved tensors sent to host (the
    header's table, α > 0)."""
    c = block.config
    # cos, sin and the weights are shared by every block: they stay
    keep = [t.untyped_storage() for t in (cos, sin, *block.parameters())]
    saved = Offloaded(_device(x), block.i, keep)
    S = x.shape[1]
    n = math.floor(c.offload * S) if c.recompute == 'none' else 0  # the last n tokens: to host
    with saved_tensors_hooks(saved.pack, saved.unpack):
        if c.recompute == 'full' or n == S:
            # 'full': torch's checkpoint saves the block's input only, through our hooks, to host;
            # 'none' with α = 1: no token is recomputed, all the block saves goes to host
            y = _keep_or_recompute(block.hooked, c.recompute, x, cos, sin, docs)
        else:
            y = _Split(block, cos, sin, docs, S, S - n).forward(x)
    saved.send()
    _offloaded[block.i] = saved  # for block i+1's _prefetch
    return y


# The header's cut, as the events it performs, each a call of the block's parts (model.py's
# Attention.project, Attention.core, then `rest`: Attention.finish and Block.with_mlp), in this
# order, all under the block's hooks to host:
#
# forward (`forward`)
#   1. The first range, tokens [0, s0): its q, k, v (the norm, Attention.project) under torch's
#      checkpoint, which drops what they save (its input goes to host through our hooks) and makes
#      them again in backward.
#   2. The second range, tokens [s0, S): its q, k, v; what they save goes to host.
#   3. The core once, on both ranges' q, k, v joined: every token. What it saves goes to host
#      whole; its output `a` is not dropped (5 needs it).
#   4. The second range's rest (wo, the residual, the MLP) on its tokens of `a`: what
#      it saves goes to host.
#   5. The first range's rest on its tokens of `a`, under torch's checkpoint, whose inputs are the
#      first step's x (sent once) and the whole `a`: checkpoint saves its inputs through our hooks,
#      so `a` goes to host too (the tensor the core saved: no second copy, but under Ulysses, whose
#      `a` is another tensor). The block's output: the first range's, then the second's.
# backward (autograd, once the next block's backward has fetched this block's tensors back)
#   6. The first range's MLP and wo need what they saved: checkpoint runs its rest again, from its
#      inputs, x and `a` (back from host, requiring grad as in forward, so that the ops after them
#      save what they saved then; the gradient flows through the forward's graph). Their backward
#      runs.
#   7. The second range's MLP and wo run backward on what they saved, from host.
#   8. The core's backward gets its output's gradient from both ranges, and gives every token's
#      q, k, v theirs: the second range's projections and norm run backward on what they saved,
#      from host; the first range's after checkpoint ran them again (step 1's recompute).
# With s0 = S ('selective', or n = 0) there is no second range: steps 2, 4 and 7 vanish.
@dataclass
class _Split:
    block: object           # the block (a Policy): its parts
    cos: torch.Tensor
    sin: torch.Tensor
    docs: object
    S: int                  # tokens in a run
    s0: int                 # the first range is [0, s0) of each run, the second [s0, S)

    def forward(self, x):
        first = x[:, :self.s0]
        # 1.
        q, k, v = checkpoint(self.qkv, first, 0, self.s0, use_reentrant=False)
        if self.s0 < self.S:  # (an empty view of x would keep all of x alive)
            second = x[:, self.s0:]
            # 2.
            second_qkv = self.qkv(second, self.s0, self.S)
            # in each run of S tokens (one per tp rank under sequence parallelism): the first
            # range's tokens, then the second's
            q, k, v = map(self.join, (q, k, v), second_qkv)
        # 3.
        a = self.block.attention.core(q, k, v, self.docs, self.block.attention.window)
        y2 = None
        if self.s0 < self.S:
            # 4.
            y2 = self.rest(second, a, self.s0, self.S)
        # 5. (and 6: checkpoint's recompute in backward)
        y = checkpoint(self.rest, first, a, 0, self.s0, use_reentrant=False)
        if y2 is None:
            return y
        return torch.cat([y, y2], 1)

    def qkv(self, x, lo, hi):
        """Steps 1 and 2: q, k, v of tokens [lo, hi) of each run (x: theirs)."""
        cos, sin = self.tokens(self.cos, lo, hi), self.tokens(self.sin, lo, hi)
        return self.block.attention.project(self.block.attention_norm(x), cos, sin)

    def rest(self, x, a, lo, hi):
        """Steps 4 and 5 (and 5's recompute, 6): the block's output for x's tokens [lo, hi) of each
        run, given the core's output a of every token (the attention half's output hooked for the
        prefetch, as Policy.hooked does)."""
        h = x + self.block.attention.finish(self.tokens(a, lo, hi))
        _prefetch(self.block.i, h)
        return self.block.with_mlp(h)

    def tokens(self, t, lo, hi):
        """Tokens lo..hi of every run of S tokens along dim -2 (under sequence parallelism a run
        per tp rank)."""
        return t.unflatten(-2, (-1, self.S))[..., lo:hi, :].flatten(-3, -2)

    def join(self, first, second):
        """The inverse of tokens: in each run of S tokens along dim -2, `first`'s s0 tokens then
        `second`'s S - s0."""
        both = [first.unflatten(-2, (-1, self.s0)), second.unflatten(-2, (-1, self.S - self.s0))]
        return torch.cat(both, -2).flatten(-3, -2)


# ------------------------------------------------------------ one block's tensors, to host and back
# (eq=False: an object with a life, weakly referenced in _offloaded, compared by identity)
@dataclass(eq=False)
class Offloaded:
    """One block's saved tensors: pack (its forward), send (the forward's end), fetch (block i+1's
    backward), wait and unpack (its own backward)."""
    dev: SimpleNamespace    # _device's
    index: int              # the block's
    keep: list              # storages that stay where they are (cos, sin, the weights)
    # device tensors: to send (forward), then back (backward); how many saves of each are left
    tensors: list = field(default_factory=list)
    uses: list = field(default_factory=list)
    host: list = None       # their copies in `buffer`, from send to fetch
    buffer: object = None   # the pool's _Buffer, from send to fetch
    back: object = None     # the event after the copies back
    ready: bool = False     # whether its backward has begun (wait)

    def pack(self, t):
        if t.nbytes < MIN_BYTES or t.untyped_storage() in self.keep:
            return t  # stays where it is
        # a tensor saved twice (by a norm, by a view) goes once
        for k, u in enumerate(self.tensors):
            if _where(u) == _where(t):
                self.uses[k] += 1
                return k
        self.tensors.append(t)
        self.uses.append(1)
        return len(self.tensors) - 1

    def send(self):
        if not self.tensors:
            return
        dev = self.dev
        self.buffer = dev.pool.take(sum(_align(t.nbytes) for t in self.tensors))
        ready = _mark(dev)  # after this block's forward kernels: the copies read their results
        with torch.cuda.stream(dev.d2h):  # None: a no-op
            _wait(ready)
            # and after the last host->device copy out of this buffer
            _wait(self.buffer.ready)
            self.host, offset = [], 0
            for t in self.tensors:
                # with t's strides where t is dense (attention's output is [B, S, H, hd] in memory):
                # it comes back with them, and what backward views of it stays a view, not a copy
                stride = torch.empty_like(t, device='meta').stride()
                carved = self.buffer.data[offset:offset + t.nbytes].view(t.dtype)
                self.host.append(carved.as_strided(t.shape, stride).copy_(t, non_blocking=dev.cuda))
                offset += _align(t.nbytes)
            sent = _mark(dev)
        if not dev.fake:  # a dry run's fake bytes are not moved
            _stats['bytes_to_host'] += sum(h.nbytes for h in self.host)
        # freed once compute has waited for these copies (_retire)
        dev.in_flight.append((sent, self.tensors))
        self.tensors = None
        _retire(dev, MAX_IN_FLIGHT if dev.cuda else 0)

    def fetch(self):
        if self.buffer is None:
            return
        dev = self.dev
        _retire(dev, 0)  # backward has begun: every device->host copy must be done
        # allocated on the compute stream, which frees them after use
        self.tensors = [torch.empty_like(h, device=dev.device) for h in self.host]
        # that memory may still be read by kernels queued before now; and compute has waited for
        # this block's device->host copies (_retire): they are done too
        ready = _mark(dev)
        with torch.cuda.stream(dev.h2d):
            _wait(ready)
            for t, h in zip(self.tensors, self.host):
                t.copy_(h, non_blocking=dev.cuda)
            self.back = _mark(dev)
        if not dev.fake:
            _stats['bytes_to_device'] += sum(h.nbytes for h in self.host)
        dev.pool.give(self.buffer, self.back)  # reusable once `back` has passed
        self.buffer = self.host = None

    def wait(self):
        """This block's backward begins: its own copies (no others) must have arrived."""
        self.ready = True
        self.fetch()  # nothing to do when it was prefetched
        _wait(self.back)

    def unpack(self, k):
        if isinstance(k, torch.Tensor):
            return k  # pack left it where it was
        if not self.ready:
            self.wait()
        t = self.tensors[k]
        if t is None:
            raise RuntimeError("offload: a saved tensor was unpacked twice "
                               "(retain_graph is not supported)")
        self.uses[k] -= 1
        if self.uses[k] == 0:
            self.tensors[k] = None  # autograd holds what it took; we let go
        return t


def _where(t):
    """A saved tensor's memory: the same storage (storages compare by identity), dtype, shape and
    strides."""
    return t.untyped_storage(), t.dtype, t.shape, t.stride(), t.storage_offset()


# ---------------------------------------------------------------------- host pool, streams, events
def _align(nbytes, to=512):  # every carved tensor starts aligned, for any dtype and for DMA
    return -(-nbytes // to) * to


# (eq=False: the pool's lists find a buffer by identity)
@dataclass(eq=False)
class _Buffer:
    """One allocation of the pool, nbytes uint8s; `ready`: the last host->device copy out of it has
    passed."""
    data: torch.Tensor
    nbytes: int
    ready: object = None


class HostPool:
    """Host buffers, reused every forward: one per offloaded block of a forward (two forwards
    before a backward: two each). The one place host memory is made, pinned with cudaHostRegister
    (`pin_memory()` rounds up to a power of two)."""

    def __init__(self, pin):
        self.pin, self.idle, self.buffers = pin, [], []
        self.allocations = 0

    def take(self, nbytes):
        for buf in self.idle:
            if buf.nbytes >= nbytes:  # the first big enough
                self.idle.remove(buf)
                return buf
        if self.idle:  # a longer sequence than before: give back a buffer that is now too small
            self.release(self.idle.pop())
        buf = _Buffer(self.allocate(nbytes), nbytes)
        self.buffers.append(buf)
        self.allocations += 1
        return buf

    def allocate(self, nbytes):
        if not self.pin:
            return torch.empty(nbytes, dtype=torch.uint8)
        # page-aligned, for cudaHostRegister
        page = 4096
        raw = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        data = raw[start:start + nbytes]
        if int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), _align(nbytes, page), 0)):
            raise RuntimeError(f"offload: cudaHostRegister of {nbytes / 2**30:.2f} GiB failed")
        return data

    def give(self, buf, ready):
        buf.ready = ready
        self.idle.append(buf)

    def release(self, buf):
        if self.pin:
            # no copy may still be reading these pages (a rare wait: a longer sequence, reset())
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(buf.data.data_ptr())
        self.buffers.remove(buf)


_devices = {}
_stats = {'bytes_to_host': 0, 'bytes_to_device': 0}
# the blocks offloaded in the forward under way, by index, while they live (a block's index is
# unique within a forward, on any device)
_offloaded = weakref.WeakValueDictionary()


def _device(x):
    """Per device (fake tensors: their own): copy streams (CUDA only), host pool, copies in
    flight."""
    fake = isinstance(x, FakeTensor)
    key = (x.device, fake)
    if key not in _devices:
        cuda = x.device.type == 'cuda' and not fake
        _devices[key] = SimpleNamespace(
            device=x.device, fake=fake, cuda=cuda, pool=HostPool(pin=cuda), in_flight=[],
            # the copy streams, device->host and host->device (a CPU has none)
            d2h=torch.cuda.Stream(x.device) if cuda else None,
            h2d=torch.cuda.Stream(x.device) if cuda else None)
    return _devices[key]


def _mark(dev):
    """An event after the work queued so far on the current stream (a copy stream inside
    `with torch.cuda.stream(...)`); None on a CPU."""
    if not dev.cuda:
        return None
    return torch.cuda.current_stream(dev.device).record_event()


def _wait(event):
    """The current stream waits for the event (None, on a CPU: nothing to wait for); the host does
    not."""
    if event is not None:
        event.wait()


def _retire(dev, limit):
    """Compute waits for the oldest copies; then their device memory is free."""
    while len(dev.in_flight) > limit:
        _wait(dev.in_flight.pop(0)[0])


def stats():
    """Bytes moved each way since start (train.py logs bytes_to_host's rise per step) and the host
    pools' sizes."""
    pools = [d.pool for d in _devices.values() if not d.fake]
    reserved = sum(buf.nbytes for p in pools for buf in p.buffers)
    idle = sum(buf.nbytes for p in pools for buf in p.idle)
    return dict(_stats, host_reserved=reserved, host_in_use=reserved - idle,
                host_allocations=sum(p.allocations for p in pools))


def host_buffers():
    """The host pool's tensors alive now (fake ones in a dry run): host memory, not the device's."""
    return [buf.data for d in _devices.values() for buf in d.pool.buffers]


def reset():
    """Give every pool's host memory back and forget the devices (tests; a forward without
    backward)."""
    for d in _devices.values():
        for buf in list(d.pool.buffers):
            d.pool.release(buf)
    _devices.clear()
