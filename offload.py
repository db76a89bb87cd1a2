"""
Keep, recompute or offload: what each transformer block saves for its backward, and where it waits.

What it saves. Once chunked.py has removed the S×V and S×I peaks, what grows with the number of
tokens S is what every block keeps for its backward. Per token and per block, with b bytes per
element (2 in bf16, 4 in fp32), width h, H heads, kv = n_kv_head·head_dim, I the MLP's intermediate
size, a block keeps (recompute='none'; `saved_per_token` lists every tensor):

    input      x                                                    b·h
    attention  SDPA's output and its logsumexp (fp32)               b·h + 4·H
    other      2 RMSNorms (fp32 input, 1/rms, x/rms, output),       b·(6h + 2kv) + 8     in fp32
               q, k, v                                              b·(5h + 2kv) + 8h + 8 in bf16
               (+ 4·b·I for an unchunked MLP: x W1ᵀ, x W3ᵀ, silu, product)

(in bf16 the first RMSNorm keeps a fp32 copy of x, not x). `recompute` says what stays on the
device, `offload` = α (Memo's) what goes to host memory while the next blocks compute:

    recompute  kept on the device, α = 0     sent to host, α > 0                  recomputed in backward
    none       input + attention + other     input and attention whole,           "other" of the first S - α·S
                                             "other" of the last α·S tokens        tokens, attention not re-run
    selective  input + attention             input + attention                    all of "other", attention not re-run
    full       input                         input                                the whole block, attention too

    host bytes per offloaded block = B·S·(input + attention) + B·floor(α·S)·other      (none)
                                     B·S·(input + attention)                           (selective)
                                     B·S·b·h                                           (full)

and an offloaded block keeps nothing on the device that grows with S. The last KEEP_LAST blocks are
never offloaded (their backward comes right after their forward), nor are tensors under MIN_BYTES.
Llama 3 8B (h 4096, H 32, kv 1024, bf16, chunked MLP), per token per block: input 8.2 KB, attention
8.3 KB, other 77.8 KB. At 128K tokens and 32 layers the device keeps 361 GB with 'none', 69 GB with
'selective', 34 GB with 'full'; with selective + offload 4.3 GB (the last two blocks), sending 65 GB
per step to host; 'none' with α = 0.5 sends 218 GB. (tests/test_offload.py checks these formulas
against what autograd saves and what moves.)

Token-wise recomputation. Every op in a block but attention works on each token alone: the norms,
the q/k/v/o projections, RoPE (a rotation by the token's own position), the residual adds, the MLP.
So the tensors a block saved for tokens [0, s0) are a function of x[:, :s0] and of attention's
output for those tokens only, and we recompute them by running the block again on x[:, :s0] (and
cos/sin[:s0]) while attention's saved output is handed back instead of running attention again.
Attention itself can't be recomputed token-wise: the output of token t needs the keys and values
of every token up to t, and attention's backward needs q, k and v of *all* tokens (dk and dv of a
token sum over every later query). So its output goes to host whole, and q, k, v are stitched whole
for its backward: the recomputed first s0 tokens next to the last S - s0 tokens fetched from host.
Which dim of a saved tensor holds the tokens we learn by running the block on the s0 tokens of the
recompute once on fake tensors (shapes only) and comparing: `probe_token_dims`. Parameters, the
RoPE tables (shared by all blocks) and tensors without a token dim stay where they are.

Under parallelism (parallel.py) a block's input x holds this rank's S tokens, but inside the block
a tensor may hold several ranks' runs of S tokens, one after the other: sequence parallelism
all-gathers the tp ranks' shards before the column-parallel matmuls (q, k, v, the MLP's input and
attention hold tp·S tokens), Ulysses all-to-alls the cp ranks' shards into attention (cp·S), both
together tp·cp·S; the RoPE tables cover the tp ranks' positions. Run on x[:, :s0], the same
collectives bring every rank's first s0 tokens, run after run, so what is recomputed, and what
goes to host, is the first s0 (the last S - s0) tokens *of every run*: cos, sin and attention's
replayed output are cut that way, and a saved tensor's token dim holds `rows` runs of S tokens.
Every rank recomputes the same block at the same moment (backward runs in step), so the
collectives of the recompute pair up as the forward's did. Ring attention (cp_impl='ring') is the
exception: its output is merged from several SDPA calls by parallel.py's autograd Function, with
ring shifts between them, so there is no one attention output to hand back in a recompute, and a
prefix of a zigzag shard can't run the ring at all. With ring attention α > 0 therefore needs
recompute='full' (the block input is all that is kept) or recompute='none' with α = 1 (nothing is
recomputed): `layout_error` refuses the rest before anything is allocated. The host-byte formula
holds per rank, S this rank's tokens, for 'selective' and 'full'; for 'none' it does not quite:
sequence parallelism keeps a copy of the gathered input per column-parallel matmul (tp·S tokens
each), Ulysses sends q, k and v whole (three views of one all-to-all buffer) and keeps wo's input
apart from attention's output. train.py checks host memory with S/cp tokens at full width: more
than sequence parallelism sends, a little less than Ulysses does (11% at α = 1 in the tests' model).

Overlap (on CUDA; on a CPU the same code runs, streams are no-ops and copies plain copies). After a
block's forward its tensors are copied to host on a device->host stream while the next blocks
compute; at most MAX_IN_FLIGHT blocks' copies run before the compute stream waits for the oldest.
When block i's backward begins (the gradient of its output arrives), block i-1's tensors start
coming back on a host->device stream; the compute stream waits on an event for its own block's
copies only. Host memory is a pool: a buffer per block, allocated once at its exact size, pinned
with cudaHostRegister (`pin_memory()` rounds up to a power of two: up to 2× the host RAM), reused
every step (a pinned allocation per tensor cost public implementations 22-50% of their step time).

Where it comes from: Memo (Zhao et al. 2024, arXiv 2407.12117) offloads the layer input and the
attention output whole and a token fraction α of the rest, recomputing the others token-wise; with
it 7B trains at 1M tokens on 8 A800s at 52% MFU. torch's `save_on_cpu` is the synchronous
version of the offload; recomputation is Chen et al. 2016, selective recomputation Korthikanti et
al. 2022 (here via torch's non-reentrant checkpoint and its selective-checkpoint contexts).
"""
import math
import os
import warnings
import weakref
from contextlib import ExitStack, nullcontext

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy

import chunked

KEEP_LAST = 2        # the last blocks stay on the device: their backward comes right after their forward
MIN_BYTES = 1 << 20  # smaller tensors stay too: a copy costs a launch and an event, and saves nothing
MAX_IN_FLIGHT = 2    # blocks whose device->host copies may still run before compute waits (Memo: 2)

_SDPA_OPS = {getattr(torch.ops.aten, name).default for name in (
    '_scaled_dot_product_flash_attention', '_scaled_dot_product_efficient_attention',
    '_scaled_dot_product_cudnn_attention', '_scaled_dot_product_flash_attention_for_cpu')
    if hasattr(torch.ops.aten, name)}


# ----------------------------------------------------------------------------- how many bytes

def saved_per_token(config, dtype=torch.float32, seq_len=None):
    """[(what, bytes per token, kind)] for every tensor one block saves for backward with
    recompute='none'. dtype is the weights' and activations' dtype (train.py casts the model to it);
    seq_len only matters for mlp_chunks=0. kind is Memo's split: 'input' and 'attention' go to host
    whole, 'other' by tokens. Parameters, the RoPE tables (shared by every block) and token-less
    scalars are not listed: they stay where they are."""
    b, h, H = torch.empty(0, dtype=dtype).element_size(), config.n_embd, config.n_head
    kv, I = config.n_kv_head * config.head_dim, config.intermediate_size
    # RMSNorm works in fp32: it keeps its input as fp32 (x itself in fp32, a copy in bf16), 1/rms,
    # x/rms cast back, and the matmuls after it keep its output
    norm = lambda name: [(f'{name} 1/rms', 4, 'other'), (f'{name} x/rms', b * h, 'other'),
                         (f'{name} output', b * h, 'other')]
    saved = [('block input x', b * h, 'input') if b == 4 else ('attention_norm fp32 copy of x', 4 * h, 'other')]
    saved += norm('attention_norm') + [('q', b * h, 'other'), ('k', b * kv, 'other'), ('v', b * kv, 'other'),
                                       # wo keeps a view of the output ([B, S, H, hd] in memory)
                                       ('attention output', b * h, 'attention'),
                                       ('attention logsumexp', 4 * H, 'attention'),
                                       ('ffn_norm fp32 input (x + attention)', 4 * h, 'other')]
    saved += norm('ffn_norm')  # whose output is the MLP's input
    if chunked.mlp_chunks(config, seq_len) == 1:  # the plain MLP keeps its intermediates; chunked.py's keeps only its input
        saved += [(f'MLP {name}', b * I, 'other') for name in ('x W1ᵀ', 'x W3ᵀ', 'silu(x W1ᵀ)', 'product')]
    return saved


def kept_bytes(config, batch, seq_len, dtype=torch.float32):
    """Bytes one block keeps on the device for backward with offload off, for config.recompute."""
    saved = saved_per_token(config, dtype, seq_len)
    b = torch.empty(0, dtype=dtype).element_size()
    if config.recompute == 'none':
        per_token = sum(n for _, n, _ in saved)
    elif config.recompute == 'selective':  # checkpoint keeps the input, attention its outputs
        per_token = b * config.n_embd + sum(n for _, n, kind in saved if kind == 'attention')
    else:
        per_token = b * config.n_embd
    return batch * seq_len * per_token


def host_tokens(alpha, seq_len):
    """Tokens per sequence whose 'other' tensors go to host (the last ones): floor(α·S)."""
    return math.floor(alpha * seq_len)


def offloaded_blocks(config):
    """Indices of the blocks whose activations go to host."""
    return range(max(0, config.n_layer - KEEP_LAST)) if config.offload > 0 else range(0)


def block_host_bytes(config, batch, seq_len, dtype=torch.float32):
    """Bytes one offloaded block sends to host per forward (the table in the header, tiny tensors kept)."""
    if config.offload == 0:
        return 0
    b = torch.empty(0, dtype=dtype).element_size()
    sent = lambda per_token, tokens: batch * tokens * per_token if batch * seq_len * per_token >= MIN_BYTES else 0
    total = sent(b * config.n_embd, seq_len)  # the input, always whole: the recompute starts from it
    if config.recompute == 'full':
        return total
    n = host_tokens(config.offload, seq_len) if config.recompute == 'none' else 0
    for _, per_token, kind in saved_per_token(config, dtype, seq_len):
        if kind == 'attention':
            total += sent(per_token, seq_len)
        elif kind == 'other':
            total += sent(per_token, n)
    return total


def host_bytes(config, batch, seq_len, dtype=torch.float32):
    """Host memory one forward (one micro-step) needs: every offloaded block's bytes. The pool holds
    exactly this, reused by every micro-step."""
    return len(offloaded_blocks(config)) * block_host_bytes(config, batch, seq_len, dtype)


# ----------------------------------------------------------------------------- choosing α

def block_forward_seconds(config, batch, seq_len, flops_per_s):
    """One block's forward time at flops_per_s: 2 FLOPs per weight per token, and causal attention's
    2·S·h per token (QKᵀ and AV at half the S×S: flash kernels skip the masked blocks)."""
    h, kv, I = config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size
    weights = 2 * h * h + 2 * h * kv + 3 * h * I
    return batch * seq_len * (2 * weights + 2 * seq_len * h) / flops_per_s


def choose_alpha(config, batch, seq_len, dtype, block_forward_s, bandwidth, host_bytes_free):
    """Memo's rule: the largest α with (input + attention + α·other) / bandwidth <= one block's forward
    time (the copy hides behind the next block's compute) and with every offloaded block's bytes in
    host_bytes_free. bandwidth in bytes/s (PCIe, one direction: about 25e9 for Gen4 x16, 50e9 Gen5).
    Returns 0.0 when even the input and attention output can't be hidden or held (then offloading
    slows the step; recompute='full' is the cheaper way down); for 'full' and 'selective' α is 0 or 1
    (only whole tensors move)."""
    blocks = config.n_layer - KEEP_LAST
    if blocks <= 0:
        return 0.0
    b, tokens = torch.empty(0, dtype=dtype).element_size(), batch * seq_len
    saved = saved_per_token(config, dtype, seq_len)
    whole = b * config.n_embd + (0 if config.recompute == 'full' else
                                 sum(n for _, n, kind in saved if kind == 'attention'))
    other = sum(n for _, n, kind in saved if kind == 'other') if config.recompute == 'none' else 0
    byte_budget = min(bandwidth * block_forward_s, host_bytes_free / blocks) / tokens
    if byte_budget < whole:
        return 0.0
    if other == 0:
        return 1.0
    return min(1.0, (byte_budget - whole) / other)


def check_host_memory(config, batch, seq_len, dtype=torch.float32, budget_gb=0):
    """One line saying how much host memory offload takes per rank; raises MemoryError (one line) when
    it needs more than is available (MemAvailable shared by the ranks on this host) or than budget_gb."""
    need = host_bytes(config, batch, seq_len, dtype)
    available = _host_memory_available() // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    limit, what = available, 'available'
    if budget_gb and budget_gb * 2**30 < available:
        limit, what = int(budget_gb * 2**30), 'in host_memory_budget_gb'
    line = (f"offload={config.offload}: {need / 2**30:.2f} GiB of host memory per rank "
            f"({len(offloaded_blocks(config))} blocks), {limit / 2**30:.1f} GiB {what}")
    if need > limit:
        raise MemoryError(f"{line}: lower offload, seq_len or batch_size, or use recompute='full'")
    return line


def layout_error(recompute, alpha, cp_size=1, cp_impl='ulysses'):
    """None, or the one-line reason offload = alpha can't run with this recompute and context
    parallel layout (the header: ring attention can't be replayed). parallel.check_layout asks."""
    if alpha > 0 and cp_size > 1 and cp_impl == 'ring' and (recompute == 'selective' or
                                                            recompute == 'none' and alpha < 1):
        instead = "recompute='full', cp_impl='ulysses' or offload=1" if recompute == 'none' else \
            "recompute='full' or cp_impl='ulysses'"
        return (f"offload={alpha} with recompute={recompute!r} and cp_impl='ring': ring attention's output "
                f"can't be replayed in a recompute (offload.py); use {instead}")
    return None


def _host_memory_available():
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


# ----------------------------------------------------------------------------- the policy, per block

def _keep_attention(ctx, op, *args, **kwargs):
    # selective recompute: save what attention computed, recompute every matmul and norm around it
    return CheckpointPolicy.MUST_SAVE if op in _SDPA_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply(model):
    """Wrap every block of model (at build time, as torchtitan applies activation checkpointing) so
    that its forward keeps, recomputes or offloads what it saves as model.config says; model.forward
    stays a plain loop. Idempotent; the knobs are read at every call, so they may change later."""
    for i, block in enumerate(model.layers):
        if 'forward' in vars(block):
            continue
        inner = block.forward

        def forward(x, cos, sin, kv_cache=None, block=block, inner=inner, i=i):
            if kv_cache is not None:
                return inner(x, cos, sin, kv_cache)
            return run_block(block, inner, x, cos, sin, model.config, i)
        block.forward = forward
    return model


def run_block(block, fn, x, cos, sin, config, i):
    """block(x, cos, sin) for block i of config.n_layer, keeping, recomputing or offloading what it
    saves for backward as config.recompute and config.offload = α say (the header's table):
      α = 0, the last KEEP_LAST blocks, forwards without grad: the block as is ('none'), under torch's
        non-reentrant checkpoint ('full'), or with its selective contexts keeping attention ('selective');
      α > 0, 'full': torch's checkpoint, whose one saved tensor (the input) goes through our hooks;
      α > 0, 'none' / 'selective': our hooks take all the block saves and send input and attention whole,
        the other tensors of the last α·S tokens ('none') or of none ('selective'), the rest recomputed.
    Raises ValueError for what can't be recomputed that way (ring attention: `layout_error`)."""
    mode, alpha = config.recompute, config.offload
    saved = None
    if alpha == 0 or i >= config.n_layer - KEEP_LAST or not torch.is_grad_enabled():
        if mode == 'none':
            y = fn(x, cos, sin)
        elif mode == 'full':
            y = checkpoint(fn, x, cos, sin, use_reentrant=False)
        else:
            y = checkpoint(fn, x, cos, sin, use_reentrant=False,
                           context_fn=lambda: create_selective_checkpoint_contexts(_keep_attention))
    else:
        mesh = getattr(getattr(block, 'attention', None), 'mesh', None)  # parallel.py's blocks carry their layout
        why = mesh and layout_error(mode, alpha, mesh.cp, mesh.cp_impl)
        if why:
            raise ValueError(why)
        saved = _BlockActivations(_engine(x), block, x, cos, sin, i, mode, alpha)
        saved.fn = fn
        if mode == 'full':  # torch's checkpoint keeps only its inputs, through our hooks
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
                y = checkpoint(fn, x, cos, sin, use_reentrant=False)
        else:  # we keep input and attention and recompute the rest ourselves, token-wise
            if 0 < saved.n_host < saved.seq_len:
                saved.probe_token_dims()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack), _WatchAttention(saved.attention):
                y = fn(x, cos, sin)
        saved.offload()
    if alpha > 0 and torch.is_grad_enabled():
        _prefetch_on_backward(y, i, saved, _engine(x))
    return y


def _prefetch_on_backward(y, i, saved, eng):
    # When the gradient of this block's output arrives, this block's backward begins: start bringing
    # back the previous block if it was offloaded, so its copies run under this block's backward.
    # Only the block right after it: a later one would bring it back blocks early (the last
    # offloaded block came back when the last block's backward began, two blocks early)
    if i == 0:
        eng.last = None  # a new forward
    previous = eng.last
    if previous is not None and y.requires_grad and getattr(previous(), 'index', None) == i - 1:
        y.register_hook(lambda grad: _fetch(previous))
    if saved is not None:
        eng.last = weakref.ref(saved)


def _fetch(ref):
    saved = ref()
    if saved is not None:
        saved.fetch()


# ----------------------------------------------------------------------------- forward: pack, sort, send

KEEP, WHOLE, SPLIT, DROP = 'keep', 'whole', 'split', 'drop'


class _Group:
    """The saved tensors that share one storage: kept, sent whole, split by tokens, or dropped."""

    def __init__(self, kind, tensor):
        self.kind, self.tensor = kind, tensor  # the device tensor, until it is sent or dropped
        self.source = self.host = self.device = None  # what is copied out; its copy on host; back on the device
        self.token = None  # (dim, rows): the token dim holds `rows` runs of S tokens ([B·S, D] has B)
        self.unpacks = 0


def _key(t):  # which storage a tensor views (torch's own aliasing checks use this; fake tensors too)
    return t.untyped_storage()._cdata


def _meta(t):
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _storage_bytes(t):
    """All of t's storage as one uint8 tensor, a view (not Tensor.set_: under fake tensors, in the dry
    run, a storage once passed to set_ is never freed, and every offloaded block would stay counted)."""
    nbytes = t.untyped_storage().nbytes()
    return t.as_strided((1,), (1,), 0).view(torch.uint8).as_strided((nbytes,), (1,), 0)


def _as_view(base, meta):
    """The view `meta` describes, on base's storage (a storage's bytes come back as one uint8 tensor)."""
    shape, stride, offset, dtype = meta
    return _storage_bytes(base).view(dtype).as_strided(shape, stride, offset)


def _tokens(t, token, seq_len):
    dim, rows = token
    return t.unflatten(dim, (rows, seq_len)), dim + 1


def _prefix(t, dim, seq_len, s0):
    """The first s0 tokens of every run of seq_len tokens along dim (the header: under sequence or
    context parallelism a dim may hold several ranks' runs one after the other)."""
    dim %= t.dim()
    if s0 == seq_len:
        return t
    return t.unflatten(dim, (-1, seq_len)).narrow(dim + 1, 0, s0).flatten(dim, dim + 1)


class _WatchAttention(TorchDispatchMode):
    """Forward: remember what attention returned. Those tensors go to host whole, and come back in
    the recompute in place of attention."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SDPA_OPS:
            self.calls.append(out)
        return out


class _BlockActivations:
    """What one block saved in one forward, and where it is: on the device, on its way, on host."""

    def __init__(self, eng, block, x, cos, sin, index, mode, alpha):
        self.eng, self.block, self.cos, self.sin, self.index = eng, block, cos, sin, index
        self.seq_len = x.shape[1]
        self.n_host = host_tokens(alpha, self.seq_len) if mode == 'none' else 0  # 'other' tokens to host
        self.x_requires_grad = x.requires_grad
        types = [x.device.type] + (['cpu'] if x.device.type != 'cpu' else [])
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]
        self.packs = [x]  # pack 0 is the block input, whether autograd saves it or not: we need it
        self.attention = []  # what each attention call returned (forward), then how to rebuild it
        self.token_dims = None  # what the block saves on the tokens it recomputes (shapes)
        self.params = {_key(p) for p in block.parameters()} | {_key(cos), _key(sin)}
        self.buffer = None  # host memory from the pool, until this block is fetched
        self.d2h_done = self.h2d_done = None
        self.ready = False

    def pack(self, t):
        self.packs.append(t)
        return _Packed(self, len(self.packs) - 1)

    def probe_token_dims(self):
        """Find each saved tensor's token dim: run the block on the s0 tokens the recompute will run
        on, on fake tensors (shapes only: no memory, no compute), and see which dim differs from the
        real forward's. Once per block and input shape."""
        x, s0 = self.packs[0], self.seq_len - self.n_host
        probes = self.eng.probes.setdefault(self.block, {})
        key = (tuple(x.shape), s0, x.dtype, x.requires_grad, tuple(self.autocast))
        if key not in probes:
            shapes = []
            fake = nullcontext() if isinstance(x, FakeTensor) else FakeTensorMode(allow_non_fake_inputs=True)
            with fake, self._autocast(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: shapes.append(tuple(t.shape)), _unpack):
                xs = torch.empty((x.shape[0], s0) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
                self.fn(xs.requires_grad_(x.requires_grad), *self._rope(s0))
            probes[key] = shapes
        self.token_dims = probes[key]

    def _rope(self, s0):
        # cos and sin cover this rank's S positions, or (sequence parallel) every tp rank's, run after run
        return _prefix(self.cos, 0, self.seq_len, s0), _prefix(self.sin, 0, self.seq_len, s0)

    def _autocast(self):
        # autocast as it was in forward; no cache of cast weights, which would outlive this context
        stack = ExitStack()
        for device_type, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
        return stack

    def _token_dim(self, k):
        """(dim, rows) of pack k: its dim `dim` holds `rows` runs of tokens ([B·S, D] has B). None: it
        has no token dim. 'mixed': none we can split (several dims change with S)."""
        probe, full, s0 = self.token_dims[k - 1], self.packs[k].shape, self.seq_len - self.n_host
        changed = [d for d in range(len(full)) if probe[d] != full[d]] if len(probe) == len(full) else None
        if changed == []:
            return None
        if changed is None or len(changed) > 1 or probe[changed[0]] % s0 or \
                full[changed[0]] != probe[changed[0]] // s0 * self.seq_len:
            return 'mixed'
        return changed[0], probe[changed[0]] // s0

    def _sort(self):
        """Group the packs by storage and decide each group's fate (the header's table)."""
        if self.token_dims is not None and len(self.token_dims) != len(self.packs) - 1:
            # the block saves other tensors on s0 tokens (an automatic MLP chunk count that drops to
            # 1, say): a token-wise recompute can't rebuild them, so recompute all S tokens instead
            warnings.warn(f"offload: block {self.index} saves {len(self.packs) - 1} tensors on "
                          f"{self.seq_len} tokens but {len(self.token_dims)} on {self.seq_len - self.n_host}: "
                          f"recomputing every token instead of sending {self.n_host} to host")
            self.n_host, self.token_dims = 0, None
        attention = {_key(t) for out in self.attention for t in out if isinstance(t, torch.Tensor)}
        self.groups, self.group_of, self.meta = {}, [], []
        S, n = self.seq_len, self.n_host
        for k, t in enumerate(self.packs):
            key = _key(t)
            self.group_of.append(key)
            self.meta.append(_meta(t))
            if key in self.groups:
                g = self.groups[key]
                if g.kind == SPLIT and _meta(g.tensor) != _meta(t):
                    g.kind = WHOLE  # two different views of one storage: send the storage (we stitch one)
            elif key in self.params:
                g = _Group(KEEP, None)
            elif k == 0 or key in attention:
                g = _Group(WHOLE, t)
            elif n == 0:
                g = _Group(DROP, t)  # recomputed whole ('selective' with offload)
            elif n == S:
                g = _Group(WHOLE, t)  # α = 1: nothing is recomputed
            else:
                token = self._token_dim(k)
                g = _Group(KEEP if token is None else WHOLE if token == 'mixed' else SPLIT, t)
                g.token = token
            if g.kind != DROP and t.untyped_storage().nbytes() < MIN_BYTES:
                g.kind = KEEP
            self.groups.setdefault(key, g)
            g.unpacks += k > 0
        # keep what stays, per pack: a parameter is saved as itself and as its transpose
        self.kept = [t if self.groups[key].kind == KEEP else None for t, key in zip(self.packs, self.group_of)]
        if not any(g.kind in (SPLIT, DROP) for g in self.groups.values()):
            self.attention[:] = []  # nothing will be recomputed: nothing to replay, nothing to hold
        elif any(_key(out[0]) not in self.groups for out in self.attention):
            # the output autograd keeps is not an SDPA output (ring attention merges several):
            # layout_error refuses this up front; replaying would compute something else
            raise RuntimeError(f"offload: block {self.index}'s attention output is not saved by SDPA, so it "
                               f"can't be replayed in a recompute: use recompute='full'")
        # attention's outputs: those that travel are rebuilt from their group in the recompute
        self.attention[:] = [tuple(_FromGroup(t) if isinstance(t, torch.Tensor) and _key(t) in self.groups
                                   and self.groups[_key(t)].kind == WHOLE else t for t in out)
                             for out in self.attention]

    def offload(self):
        """End of this block's forward: send what goes to host, drop what is recomputed."""
        if len(self.packs) == 1:  # nothing saved (no gradient to compute): the input is not needed
            self.packs = None
            return
        self._sort()
        S, n, eng = self.seq_len, self.n_host, self.eng
        sources, sizes = [], []
        for g in self.groups.values():
            if g.kind == WHOLE:  # the storage's bytes, so that every view of it comes back as it was
                g.source = _storage_bytes(g.tensor)
            elif g.kind == SPLIT:  # the last n tokens
                t, dim = _tokens(g.tensor, g.token, S)
                g.source = t.narrow(dim, S - n, n)
            if g.kind in (WHOLE, SPLIT):
                sources.append(g)
                sizes.append(g.source.numel() * g.source.element_size())
        if sources:
            self.buffer = eng.pool.take(self.index, sum(_align(s) for s in sizes))
            ready = eng.mark()  # after this block's forward kernels: the copies read their results
            with eng.on(eng.d2h):
                eng.wait(ready, eng.d2h)
                eng.wait(self.buffer.ready, eng.d2h)  # the last host->device copy out of this buffer
                offset = 0
                for g, size in zip(sources, sizes):
                    g.host = self.buffer.data[offset:offset + size].view(g.source.dtype).view(g.source.shape)
                    g.host.copy_(g.source, non_blocking=eng.cuda)
                    offset += _align(size)
                self.d2h_done = eng.mark(eng.d2h)
            eng.count('bytes_to_host', sum(sizes))
            # the device tensors may be freed only once the copies have read them: the engine holds
            # them until the compute stream has waited for d2h_done (MAX_IN_FLIGHT blocks at most)
            eng.in_flight.append((self.d2h_done, [g.tensor for g in sources]))
            eng.retire(MAX_IN_FLIGHT if eng.cuda else 0)
        for g in self.groups.values():
            g.tensor = g.source = None
        self.packs = None

    # ------------------------------------------------------------------------- backward

    def fetch(self):
        """Host -> device on the copy stream. Called for block i-1 when block i's backward begins,
        or by this block's first unpack if that did not happen."""
        if self.buffer is None:
            return
        eng = self.eng
        eng.retire(0)  # backward has begun: every device->host copy must be done
        for g in self.groups.values():
            if g.host is not None:  # allocated on the compute stream, which frees it after use
                g.device = torch.empty(g.host.shape, dtype=g.host.dtype, device=eng.device)
        ready = eng.mark()  # that memory may still be read by kernels queued before now
        with eng.on(eng.h2d):
            eng.wait(self.d2h_done, eng.h2d)
            eng.wait(ready, eng.h2d)
            for g in self.groups.values():
                if g.host is not None:
                    g.device.copy_(g.host, non_blocking=eng.cuda)
                    eng.count('bytes_to_device', g.host.numel() * g.host.element_size())
                    g.host = None
            self.h2d_done = eng.mark(eng.h2d)
        eng.pool.give(self.index, self.buffer, self.h2d_done)  # reusable once h2d_done has passed
        self.buffer = None

    def unpack(self, k):
        g = self.groups[self.group_of[k]]
        if g.unpacks == 0:
            raise RuntimeError("offload: a saved tensor was unpacked twice (retain_graph is not supported)")
        if g.kind == KEEP:
            t, self.kept[k] = self.kept[k], None
        else:
            if not self.ready:
                self.materialize()
            t = g.device
            if g.kind != SPLIT and _meta(t) != self.meta[k]:
                # another view of the storage; a dropped one is recomputed whole (Ulysses' q, k, v)
                t = _as_view(t, self.meta[k])
        g.unpacks -= 1
        if g.unpacks == 0:
            g.device = None  # autograd holds what it took; we let go
        return t

    def materialize(self):
        """This block's backward begins: its copies must have arrived; recompute what was dropped."""
        self.ready = True
        self.fetch()  # nothing to do when it was prefetched
        self.eng.wait(self.h2d_done)  # the compute stream waits for this block's copies, no others
        if any(g.kind in (SPLIT, DROP) for g in self.groups.values()):
            self.recompute()
        self.attention = self.block = self.fn = self.cos = self.sin = self.kept[0] = None
        x = self.groups[self.group_of[0]]
        if x.unpacks == 0:
            x.device = None

    def recompute(self):
        """Run the block again on its first s0 tokens with attention's saved output handed back, and
        stitch each split tensor: recomputed prefix, then the suffix that came back from host."""
        S, s0 = self.seq_len, self.seq_len - self.n_host
        x = self.kept[0] if self.kept[0] is not None else _as_view(self.groups[self.group_of[0]].device, self.meta[0])
        x = x[:, :s0].detach().requires_grad_(self.x_requires_grad)
        replay = [tuple(self._rebuild(t) for t in out) for out in self.attention]
        first = {}  # pack index -> group, one pack per split or dropped group
        for k, key in enumerate(self.group_of):
            if self.groups[key].kind in (SPLIT, DROP) and key not in first.values():
                first[k] = key
        recomputed, count = {}, [0]

        def pack(t):
            count[0] += 1
            if count[0] in first:
                # detached: t's grad_fn belongs to this recompute's graph, whose nodes hold this very
                # hook (and so `recomputed`): a cycle that kept every block's recomputed tensors alive
                # until the end of backward
                recomputed[count[0]] = t.detach()
            if count[0] == len(self.group_of) - 1:
                raise _Recomputed  # every saved tensor is back: the rest of the block is not needed

        with self._autocast() as stack:  # as in forward (torch's checkpoint does the same)
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unpack))
            stack.enter_context(_ReplayAttention(replay, S, s0))
            try:
                self.fn(x, *self._rope(s0))
            except _Recomputed:
                pass
        if count[0] != len(self.group_of) - 1:
            raise RuntimeError(f"offload: block {self.index} saved {len(self.group_of) - 1} tensors in "
                               f"forward but {count[0]} when recomputed")
        for k, key in first.items():
            g, t = self.groups[key], recomputed[k]
            if g.kind == DROP:
                g.device = t
                continue
            shape, stride, _, dtype = self.meta[k]
            dim, rows = g.token
            if t.shape != shape[:dim] + (rows * s0,) + shape[dim + 1:]:
                raise RuntimeError(f"offload: block {self.index} recomputed a {tuple(t.shape)} tensor "
                                   f"for the first {s0} tokens of a {shape} one")
            out = torch.empty_strided(shape, stride, dtype=dtype, device=t.device)
            o, dim = _tokens(out, g.token, S)
            o.narrow(dim, 0, s0).copy_(_tokens(t, g.token, s0)[0])
            o.narrow(dim, s0, S - s0).copy_(g.device)
            g.device = out

    def _rebuild(self, t):
        """An attention output as the recompute needs it: from its group if it travelled, else itself."""
        return _as_view(self.groups[t.key].device, t.meta) if isinstance(t, _FromGroup) else t

    def __del__(self):  # a forward whose backward never ran: give its host memory back
        if getattr(self, 'buffer', None) is not None:
            self.eng.pool.give(self.index, self.buffer, self.d2h_done)


class _Recomputed(Exception):
    """Stops a recompute once it has every tensor the forward saved, as torch's checkpoint stops: the
    block's last matmul output, its reduction (a reduce-scatter under sequence parallelism) and the
    residual add would only add to backward's peak (every rank stops at the same point)."""


class _FromGroup:
    """Where an attention output went: the view `meta` of group `key`'s storage."""
    __slots__ = ('key', 'meta')

    def __init__(self, t):
        self.key, self.meta = _key(t), _meta(t)


class _Packed:
    __slots__ = ('saved', 'k')

    def __init__(self, saved, k):
        self.saved, self.k = saved, k


def _unpack(packed):
    return packed.saved.unpack(packed.k)


class _ReplayAttention(TorchDispatchMode):
    """Recompute: attention is not run again; its saved outputs come back, cut to the first s0
    tokens of every run of S (the output is [..., runs·S, head_dim]; the others are only saved,
    and we discard those)."""

    def __init__(self, outputs, seq_len, s0):
        super().__init__()
        self.outputs, self.seq_len, self.s0 = iter(outputs), seq_len, s0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _SDPA_OPS:
            return func(*args, **(kwargs or {}))
        out = list(next(self.outputs))
        out[0] = _prefix(out[0], -2, self.seq_len, self.s0)
        return tuple(out)


# ----------------------------------------------------------------------------- streams, events, host pool

def _align(nbytes, to=512):  # every carved tensor starts aligned, for any dtype and for DMA
    return -(-nbytes // to) * to


class _HostBuffer:
    PAGE = 4096

    def __init__(self, nbytes, pin):
        self.nbytes, self.ready, self.pinned = nbytes, None, False
        if not pin:
            self.data = torch.empty(nbytes, dtype=torch.uint8)
            return
        # pin exactly these pages with cudaHostRegister (page-aligned, so no page is shared with
        # another registration): pin_memory() would round the size up to a power of two
        self._raw = torch.empty(nbytes + 2 * self.PAGE, dtype=torch.uint8)
        start = -self._raw.data_ptr() % self.PAGE
        self.data = self._raw[start:start + nbytes]
        err = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), _align(nbytes, self.PAGE), 0))
        if err != 0:
            raise RuntimeError(f"offload: cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (cudaError {err})")
        self.pinned = True

    def __del__(self):
        if self.pinned:
            if self.ready is not None:  # no copy may still be reading these pages
                self.ready.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())


class HostPool:
    """Host memory for offloaded activations: a buffer per block, allocated at its exact size the
    first time and reused by every later forward (a second one only if a block is forwarded again
    before its backward, as a second micro-batch forwarded early would)."""

    def __init__(self, pin):
        self.pin, self.idle, self.busy = pin, {}, []
        self.reserved = self.in_use = self.allocations = 0

    def take(self, block, nbytes):
        idle = self.idle.setdefault(block, [])
        for buf in idle:
            if buf.nbytes >= nbytes:
                idle.remove(buf)
                break
        else:
            if idle:  # a longer sequence than before: give back a buffer that is now too small
                self.reserved -= idle.pop().nbytes
            buf = _HostBuffer(nbytes, self.pin)
            self.reserved += nbytes
            self.allocations += 1
        self.in_use += buf.nbytes
        self.busy.append(buf)
        return buf

    def give(self, block, buf, ready):
        buf.ready = ready
        self.in_use -= buf.nbytes
        self.busy.remove(buf)
        self.idle.setdefault(block, []).append(buf)


class _Engine:
    """Per device: the copy streams, the host pool, the blocks whose copies may still be running."""

    def __init__(self, device, fake=False):
        self.device, self.fake, self.cuda = device, fake, device.type == 'cuda' and not fake
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.pool = HostPool(pin=self.cuda)
        self.in_flight = []  # (event, device tensors the copies read)
        self.probes = weakref.WeakKeyDictionary()  # block -> {input shape...: what it saves on 2 tokens}
        self.last = None  # the last offloaded block of the current forward (a weak reference)

    def on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def mark(self, stream=None):
        """An event after the work queued so far on stream (the current one by default); None on a CPU."""
        return (stream or torch.cuda.current_stream(self.device)).record_event() if self.cuda else None

    def wait(self, event, stream=None):
        """stream (the current one by default) waits for event; the host thread does not."""
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def count(self, what, nbytes):
        if not self.fake:  # a dry run's fake bytes are not bytes moved
            _stats[what] += nbytes

    def retire(self, limit):
        # the compute stream waits for the oldest copies, then their device memory can be reused
        while len(self.in_flight) > limit:
            event, _ = self.in_flight.pop(0)
            self.wait(event)


_engines = {}
_stats = {'bytes_to_host': 0, 'bytes_to_device': 0}


def _engine(x):
    # fake tensors (memory.py's dry run) get their own engine: its pool holds fake buffers
    key = (str(x.device), isinstance(x, FakeTensor))
    if key not in _engines:
        _engines[key] = _Engine(x.device, fake=key[1])
    return _engines[key]


def bytes_to_host():
    """Bytes sent to host memory since the process started (train.py logs the difference per step)."""
    return _stats['bytes_to_host']


def stats():
    """Bytes moved each way since start, and the host pool: reserved, in use, allocations made."""
    pools = [e.pool for e in _engines.values() if not e.fake]
    return dict(_stats, host_reserved=sum(p.reserved for p in pools), host_in_use=sum(p.in_use for p in pools),
                host_allocations=sum(p.allocations for p in pools))


def host_buffers():
    """The host pool's buffers (every engine's, a dry run's fake ones too): host memory, which
    memory.py's measurement takes out of the device's even where both are the CPU."""
    return [buf.data for e in _engines.values() for bufs in e.pool.idle.values() for buf in bufs] + \
        [buf.data for e in _engines.values() for buf in e.pool.busy]


def reset():
    """Forget every engine and its host pool (tests; or to give the host memory back)."""
    _engines.clear()
