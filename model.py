"""
The Llama model, as Hugging Face's LlamaForCausalLM computes it, in one file.

    token embedding -> n_layer x [ x + attention(RMSNorm(x)),  x + SwiGLU(RMSNorm(x)) ] -> RMSNorm -> LM head

- RMSNorm in fp32 with the config's eps, RoPE with `rope_theta` and an optional `rope_scaling` (`linear`, `llama3`,
  `yarn`: transformers' formulas, a checkpoint's context extended), angles computed in fp64 and kept in fp32 (in bf16
  the positions of a long sequence are wrong), in the rotate-half convention of HF checkpoints. Both compute in fp32 a
  chunk of positions at a time, as autograd Functions that keep no fp32 copy of x, q or k.
- grouped-query attention: F.scaled_dot_product_attention (flash on a GPU), `enable_gqa=True` (kv heads never repeated
  in memory). Packed documents (train.py's doc_mask, as Llama 3 trains long contexts): one causal call per document,
  positions restarting at each.
- no biases; optional tied embeddings; weight init as GPT-2/nanoGPT do for Llama-shaped models: every weight
  N(0, 0.02) (Llama's `initializer_range`), the two projections writing into the residual stream (wo, w2) scaled by
  1/sqrt(2·n_layer) so the residual's variance does not grow with depth; norms at 1.

The memory knobs of LlamaConfig (mlp_chunks, loss_chunks, recompute, offload) change how forward runs, never what it
computes: MLP and the LM head chunk (chunked.py), and `offload.apply(model)` wraps each block to keep, recompute or
offload at build time, so forward is a plain loop over blocks. Tensor and context parallelism shard the weights and
wrap `Attention.attend` (parallel.py): a new attention variant changes `attention()` alone. `Llama.from_pretrained()`
reads a local HF directory; `save_pretrained()` writes one that transformers loads back to the same logits.
"""

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import chunked


MEMORY_KNOBS = ('mlp_chunks', 'loss_chunks', 'recompute', 'offload')


@dataclass
class LlamaConfig:
    # architecture (defaults: a laptop-sized model)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 128
    intermediate_size: int = 384
    vocab_size: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "yarn", "factor": 4.0, ...}: ROPE_SCALINGS
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # memory knobs: how forward runs, not what it computes
    mlp_chunks: int = 1     # mini-sequences of the MLP; 1 = off, 0 = automatic (chunked.py)
    loss_chunks: int = 1    # chunks of the LM head + loss; 1 = off, 0 = automatic (chunked.py)
    recompute: str = 'none'  # 'none' | 'full' | 'selective' (offload.py)
    offload: float = 0.0    # Memo's alpha: fraction of kept activations sent to host (offload.py)

    def __post_init__(self):
        # every field's rule, as one line naming it: train.py stops on it before anything is allocated
        for key, least in dict(n_layer=1, n_head=1, n_kv_head=1, n_embd=1, intermediate_size=1, vocab_size=1,
                               mlp_chunks=0, loss_chunks=0).items():
            if not getattr(self, key) >= least:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= {least}" + " (0: automatic)" * (least == 0))
        for key, ok, allowed in [
                ('rope_theta', type(self.rope_theta) in (int, float) and self.rope_theta > 0, 'must be a number > 0'),
                ('rope_scaling', rope_scaling_ok(self.rope_scaling), ROPE_SCALING_RULE),
                ('norm_eps', self.norm_eps > 0, 'must be > 0'),
                ('offload', 0 <= self.offload <= 1, 'must be in [0, 1]'),
                ('recompute', self.recompute in ('none', 'full', 'selective'), "must be 'none', 'full' or 'selective'"),
                ('n_embd', self.n_embd % self.n_head == 0, f"must be divisible by n_head={self.n_head}"),
                ('n_head', self.n_head % self.n_kv_head == 0, f"must be divisible by n_kv_head={self.n_kv_head}"),
                ('n_embd', self.head_dim % 2 == 0, f"n_embd / n_head = {self.head_dim} must be even (RoPE)")]:
            if not ok:
                raise ValueError(f"{key}={getattr(self, key)!r}: {allowed}")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


# ----------------------------------------------------------------------------- RoPE
# rope_scaling's types, as transformers names and computes them: each one's required fields, then its optional ones
ROPE_SCALINGS = {'default': ((), ()), 'linear': (('factor',), ()),
                 'llama3': (('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'), ()),
                 'yarn': (('factor', 'original_max_position_embeddings'),
                          ('attention_factor', 'beta_fast', 'beta_slow', 'mscale', 'mscale_all_dim', 'truncate'))}
ROPE_SCALING_RULE = "must be None or a dict of 'rope_type' and its fields ([optional]): " + '; '.join(' '.join((
    kind, *need, *(f'[{f}]' for f in may))) for kind, (need, may) in ROPE_SCALINGS.items()) + " (numbers > 0, or " \
    "None if optional; original_max_position_embeddings an int, truncate a bool)"


def rope_scaling_ok(s):
    """None, or one of ROPE_SCALINGS with its required fields, typed as transformers reads them; no unknown field."""
    kind = s.get('rope_type') if isinstance(s, dict) else None
    if not isinstance(kind, str) or kind not in ROPE_SCALINGS:
        return s is None
    need, may = ROPE_SCALINGS[kind]
    given = {k: v for k, v in s.items() if k != 'rope_type'}
    return set(need) <= set(given) <= set(need + may) and all(
        isinstance(v, bool) if k == 'truncate' else v is None and k in may or type(v) in (int, float) and v > 0
        and (type(v) is int or k != 'original_max_position_embeddings') for k, v in given.items())

def rope_frequencies(config):
    """(inverse frequencies theta^(-2i/d) in fp64 with the rope scaling applied, the factor cos and sin are
    multiplied by: YaRN's attention factor, 1 otherwise), as transformers' _compute_*_parameters return them."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    kind, factor = scaling.get('rope_type', 'default'), scaling.get('factor')
    old_len = scaling.get('original_max_position_embeddings')  # llama3 and yarn: the context trained at
    if kind == 'linear':  # position interpolation: position p is rotated as p / factor
        return inv_freq / factor, 1.0
    if kind == 'llama3':
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between
        lo, hi = scaling['low_freq_factor'], scaling['high_freq_factor']
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if kind == 'yarn':
        # YaRN: divide by `factor` the dimensions turning fewer than beta_slow times in the original context, keep
        # those turning more than beta_fast times, ramp in between; cos and sin scaled by 0.1·ln(factor) + 1 (mscale)
        dim = lambda turns: d * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))
        lo, hi = dim(scaling.get('beta_fast') or 32), dim(scaling.get('beta_slow') or 1)
        if scaling.get('truncate', True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
        mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        m, m_all = scaling.get('mscale'), scaling.get('mscale_all_dim')
        attention_factor = scaling.get('attention_factor') or (mscale(m) / mscale(m_all) if m and m_all else mscale(1))
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention_factor
    return inv_freq, 1.0

def rope_tables(inv_freq, positions, scale=1.0):
    """cos and sin [S, head_dim] for integer positions [S] ([B, 1, S, head_dim] for [B, S]: a row per sequence,
    broadcast over heads), times scale (YaRN's attention factor); fp64 math, fp32 result. In HF's rotate-half layout
    (channel i pairs with i + d/2), the sin table carrying its sign (-sin for the first half): no negation to apply."""
    positions = positions if positions.dim() == 1 else positions[:, None]
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


FP32_CHUNK = 1 << 26  # elements RoPE and RMSNorm hold in fp32 at once (256 MiB): a few positions, not all


def _positions(x):  # slices of dim -2 (positions, rows treated apart) of about FP32_CHUNK elements of x each
    n = max(1, FP32_CHUNK * x.shape[-2] // max(1, x.numel()))
    return [slice(s, s + n) for s in range(0, x.shape[-2], n)]

def _rotate(x, cos, sin, transpose=False):
    out, R = torch.empty_like(x), lambda t: torch.cat(t.chunk(2, dim=-1)[::-1], dim=-1)
    for s in _positions(x):
        xf, c, si = x[..., s, :].float(), cos[..., s, :], sin[..., s, :]
        out[..., s, :] = xf * c + (R(xf * si) if transpose else R(xf) * si)
    return out


class _Rope(torch.autograd.Function):
    # apply_rope: x [B, H, S, hd] -> x·cos + R(x)·sin (R swaps x's halves) in fp32, cast to x's dtype. Autograd
    # on that makes five fp32 tensors of q's size in forward and backward; here a chunk's, and only the tables (which
    # all layers share) are saved. R is its own transpose: backward, g·cos + R(g·sin), rotates by -θ (autograd's bits)
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        return _rotate(g, *ctx.saved_tensors, transpose=True), None, None


apply_rope = _Rope.apply


# ----------------------------------------------------------------------------- the block
class RMSNorm(nn.Module):
    """weight · rms_norm(x in fp32) cast to x's dtype, as HF computes it (bf16 sums of squares over 4096 channels
    lose digits). Autograd on that expression keeps an fp32 copy of x and x/rms, and its backward holds five fp32
    tensors the size of x at once: _RMSNorm keeps x alone, and redoes a chunk of rows at a time in backward."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if torch.compiler.is_compiling():  # Dynamo can't trace autograd.grad; inductor fuses the expression
            return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
        for s in _positions(x):  # F.rms_norm: one fused kernel on CUDA
            out[..., s, :] = weight * F.rms_norm(x[..., s, :].float(), x.shape[-1:], eps=eps).to(x.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # y = x/rms, dy = g·weight: dx = (dy - y·mean(dy·y)) / rms, dweight = Σ g·y
        x, weight = ctx.saved_tensors
        dx, dw = torch.empty_like(x), torch.zeros_like(weight, dtype=torch.float32)  # dw summed in fp32
        for s in _positions(x):
            # dx by F.rms_norm's own backward on the chunk (its forward redone): CUDA's fused kernel, the CPU's
            # autograd ops, so the plain path's bits; a formula by hand would round differently, and cost more on CUDA
            with torch.enable_grad():
                xf = x[..., s, :].detach().float().requires_grad_()
                y = F.rms_norm(xf, x.shape[-1:], eps=ctx.eps).to(x.dtype)
            dw += (g[..., s, :] * y).flatten(0, -2).sum(0, dtype=torch.float32)
            dx[..., s, :] = torch.autograd.grad(y, xf, (g[..., s, :] * weight).to(y.dtype))[0]
        return dx, dw.to(weight.dtype), None


def attention(q, k, v, docs=None):
    """The attention core: causal softmax(q kᵀ / sqrt(hd)) v over q [B, H, S, hd], k, v [B, K, S, hd], K | H. With
    `docs` (doc_mask: the start of every document in the flattened B·S tokens, a CPU int64 tensor, flash-attn's
    cu_seqlens) each document attends only to itself. A fork that adds a variant (a sliding window) changes this
    function; parallel.py's Ulysses calls it unchanged on the whole sequence for a share of the heads."""
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return per_document(q, k, v, docs)

@torch.compiler.disable  # a loop whose length changes with every batch: eager inside a compiled model
def per_document(q, k, v, docs):
    """One causal SDPA call per document: exact on every device and kernel (flash on CUDA: no mask tensor),
    and no S x S mask; each call saves for backward what one whole-window call would save of its tokens.
    (FlexAttention's document mask is one fused kernel on CUDA but has no CPU backward in torch 2.13.)"""
    B, S, cuts = q.shape[0], q.shape[2], docs.tolist() + [q.shape[0] * q.shape[2]]
    doc = lambda t, a, b: t[a // S, None, :, a % S:a % S + b - a]  # tokens a..b-1 of the flattened batch, one row's
    y = [F.scaled_dot_product_attention(doc(q, a, b), doc(k, a, b), doc(v, a, b), is_causal=True, enable_gqa=True)
         for a, b in zip(cuts, cuts[1:])]
    return (y[0] if len(y) == 1 else torch.cat(y, dim=2)).unflatten(2, (B, S)).squeeze(0).transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.attend = attention  # parallel.py wraps it for context parallelism (Ulysses, ring)
        self.wq = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        B, S, _ = x.shape
        # heads from the weights' shapes: under tensor parallelism this rank holds a share of them
        q, k, v = (w(x).view(B, S, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            y = self.attend(q, k, v, docs)
        else:  # sampling: append to the cache; one new token sees every key
            k, v = kv_cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config  # mlp_chunks, read at every forward (chunked.mlp_chunks)
        self.w1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.n_embd, bias=False)  # down

    def forward(self, x):
        chunks = chunked.mlp_chunks(self.config, x.shape[-2])  # from one sequence's length
        return chunked.chunked_mlp(x, self.w1.weight, self.w3.weight, self.w2.weight, chunks)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = MLP(config)

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, docs, kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))


# ----------------------------------------------------------------------------- the model
class Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        # by index, not a list: a pipeline stage (parallel.py) drops the blocks it doesn't own, the names stay
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.vocab_group = None  # parallel.py: the tensor-parallel group the vocabulary is split over
        self.pipelined = False  # parallel.py: a pipeline stage returns its activations; the schedule applies the head
        for m in self.modules():  # (a tied matrix twice, as nanoGPT's self.apply does)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith('wo.weight') or name.endswith('w2.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets=None, positions=None, docs=None, kv_caches=None):
        """idx [B, S] -> logits [B, S, V]; with targets -> (logits or None, mean loss over targets != -100).
        `positions` [S] or [B, S] are the positions of idx's tokens (a shard of a longer sequence, the tokens
        after a kv cache, each token's place in its document); they default to 0..S-1. `docs`: see attention()."""
        positions = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        # RoPE tables outside autocast, from frequencies made here: a buffer would be rounded to bf16 by model.to()
        inv_freq, scale = rope_frequencies(self.config)
        with torch.autocast(idx.device.type, enabled=False):
            cos, sin = rope_tables(inv_freq.float(), positions, scale)
        x = idx if self.tok_embeddings is None else self.tok_embeddings(idx)  # (a later pipeline stage: activations)
        for i, block in self.layers.items():
            x = block(x, cos, sin, docs) if kv_caches is None else block(x, cos, sin, kv_cache=kv_caches[int(i)])
        x = x if self.norm is None else self.norm(x)
        return x if self.pipelined else self.head(x, targets)

    def head(self, x, targets=None):
        """LM head: logits, or (logits or None, loss) with targets. Under tensor parallelism (vocab_group set)
        output.weight holds this rank's rows of the vocabulary, and the loss is chunked.py's, vocabulary parallel."""
        if targets is None:
            if self.vocab_group is not None:
                raise NotImplementedError("logits under tensor parallelism: sample in one process (sample.py)")
            return self.output(x)
        chunks = chunked.loss_chunks(self.config, targets.numel())
        if chunks == 1 and self.vocab_group is None:  # the plain path keeps the [B, S, V] logits, hands them back
            logits = self.output(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction='sum')
            return logits, loss / (targets != -100).sum().clamp(min=1)
        return None, chunked.chunked_cross_entropy(x, self.output.weight, targets, chunks, group=self.vocab_group,
                                                   vocab_size=self.config.vocab_size)

    # ------------------------------------------------------------------------- Hugging Face checkpoints
    @classmethod
    def from_pretrained(cls, hf_dir, **overrides):
        """Load a local HF Llama directory: config.json + model.safetensors, or shards with an index. `overrides` set
        LlamaConfig fields: the memory knobs; a new rope_theta or rope_scaling extends its context."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        @contextmanager
        def reading(path):  # a file from outside: whatever is wrong with it is one ValueError naming it
            try:
                yield
            except (OSError, KeyError, TypeError, AttributeError, ArithmeticError, ValueError, SafetensorError) as e:
                raise ValueError(f"{path}: {'missing ' * isinstance(e, KeyError)}{getattr(e, 'strerror', 0) or e}") \
                    from None

        with reading(path := os.path.join(hf_dir, 'config.json')), open(path) as f:
            hf = json.load(f)
            rope = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})  # transformers 5's form, or older
            theta = rope.pop('rope_theta', hf.get('rope_theta', 10000.0))
            rope = {'rope_type': rope.pop('type', 'default'), **rope}  # (the older form's 'type')
            n_head = hf['num_attention_heads']
            if hf.get('head_dim', hf['hidden_size'] // n_head) * n_head != hf['hidden_size']:
                raise ValueError("head_dim * num_attention_heads != hidden_size is not supported")
            config = LlamaConfig(
                n_layer=hf['num_hidden_layers'], n_head=n_head, n_kv_head=hf.get('num_key_value_heads') or n_head,
                n_embd=hf['hidden_size'], intermediate_size=hf['intermediate_size'], vocab_size=hf['vocab_size'],
                rope_theta=float(theta), rope_scaling=rope if rope['rope_type'] != 'default' else None,
                norm_eps=hf.get('rms_norm_eps', 1e-6), tie_embeddings=hf.get('tie_word_embeddings', False))
        config = replace(config, **overrides)  # checked again: a bad override is the user's, not the file's
        files = ['model.safetensors']
        if os.path.exists(index := os.path.join(hf_dir, 'model.safetensors.index.json')):
            with reading(index), open(index) as f:
                files = sorted(set(json.load(f)['weight_map'].values()))
        hf_state = {}
        for name in files:
            with reading(path := os.path.join(hf_dir, name)):
                hf_state.update(load_file(path))
        model = cls(config)
        params, state = dict(model.named_parameters()), {}
        for ours, theirs in _hf_names(config).items():
            state[ours] = hf_state.pop(theirs, None)
            if state[ours] is None or state[ours].shape != params[ours].shape:
                raise ValueError(f"{hf_dir}: {theirs} " + ('is missing' if state[ours] is None else
                                 f"is {list(state[ours].shape)}, config.json makes it {list(params[ours].shape)}"))
        hf_state.pop('lm_head.weight', None)  # tied checkpoints may still carry a copy
        if hf_state:
            raise ValueError(f"{hf_dir}: unexpected weights {sorted(hf_state)[:5]}")
        model.load_state_dict(state, strict=False)  # strict would ask for the tied output twice
        return model

    def save_pretrained(self, out_dir):
        """HF's Llama config.json (rope_scaling's older form, read by every transformers) + model.safetensors."""
        from safetensors.torch import save_file
        c, s = self.config, self.config.rope_scaling or {}
        os.makedirs(out_dir, exist_ok=True)
        state = {theirs: self.get_parameter(ours).detach().cpu().contiguous() for ours, theirs in _hf_names(c).items()}
        save_file(state, os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
        hf = dict(architectures=['LlamaForCausalLM'], model_type='llama', hidden_act='silu',
                  num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                  hidden_size=c.n_embd, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                  vocab_size=c.vocab_size, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                  rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False,
                  # the context scaled to: transformers checks that YaRN's factor is this over the original's
                  max_position_embeddings=int(s.get('factor', 1) * s.get('original_max_position_embeddings', 8192)),
                  torch_dtype=str(next(self.parameters()).dtype).removeprefix('torch.'))
        with open(os.path.join(out_dir, 'config.json'), 'w') as f:
            json.dump(hf, f, indent=2)


def num_params(config, non_embedding=True):
    """Parameters of Llama(config), without the embedding table by default (a lookup, not a matmul). The one
    parameter count: train.py's MFU and memory.py's model states read it."""
    h, kv, I, V = config.n_embd, config.n_kv_head * config.head_dim, config.intermediate_size, config.vocab_size
    per_layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * I  # two norms, wq wo, wk wv, w1 w2 w3
    embedding = 0 if non_embedding or config.tie_embeddings else V * h  # a tied matrix counts once, as the head
    return config.n_layer * per_layer + h + V * h + embedding

def flops_per_token(config, seq_len):
    """(model FLOPs, hardware FLOPs) per trained token: 6·N + 12·L·h·S, N the non-embedding parameters plus the LM
    head (Megatron, PaLM and Memo count attention this way, causal or not). Recompute re-runs forward: +2·N + 4·L·h·S
    per token for 'full' (the MLP and the projections for 'selective', the attention kernel not)."""
    c, N = config, num_params(config)
    attn = 12 * c.n_layer * c.n_embd * seq_len
    recompute = {'none': 0, 'full': 2 * N + attn // 3, 'selective': 2 * (N - c.vocab_size * c.n_embd)}
    return 6 * N + attn, 6 * N + attn + recompute[c.recompute]

def _hf_names(config):
    """Our parameter names -> HF's (the LM head is absent when tied: HF shares it too)."""
    names = {'tok_embeddings.weight': 'model.embed_tokens.weight', 'norm.weight': 'model.norm.weight',
             **({} if config.tie_embeddings else {'output.weight': 'lm_head.weight'})}
    ours = {f'attention.w{p}': f'self_attn.{p}_proj' for p in 'qkvo'} | {
        'feed_forward.w1': 'mlp.gate_proj', 'feed_forward.w3': 'mlp.up_proj', 'feed_forward.w2': 'mlp.down_proj',
        'attention_norm': 'input_layernorm', 'ffn_norm': 'post_attention_layernorm'}
    return names | {f'layers.{i}.{a}.weight': f'model.layers.{i}.{b}.weight'
                    for i in range(config.n_layer) for a, b in ours.items()}


class KVCache:
    """Keys and values of one layer for sampling, preallocated to max_len."""

    def __init__(self, batch, n_kv_head, head_dim, max_len, device, dtype):
        self.k = torch.zeros(batch, n_kv_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = 0

    def update(self, k, v):
        end = self.len + k.shape[2]
        self.k[:, :, self.len:end], self.v[:, :, self.len:end] = k, v
        self.len = end
        return self.k[:, :, :end], self.v[:, :, :end]
