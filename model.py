"""
The Llama model, as Hugging Face's LlamaForCausalLM computes it, in one file.

    token embedding -> n_layer x [ x + attention(RMSNorm(x)),  x + SwiGLU(RMSNorm(x)) ]
                    -> RMSNorm -> LM head

- grouped-query attention: F.scaled_dot_product_attention (flash on a GPU), `enable_gqa=True` (kv
  heads never repeated in memory), queries and keys rotated by RoPE (rope.py: `rope_theta`, an
  optional `rope_scaling` that extends a checkpoint's context, tables in fp32). Packed documents
  (train.py's doc_mask, as Llama 3 trains long contexts): on CUDA one variable-length flash
  kernel for all the window's documents (torch's varlen_attn), on a CPU one causal call per
  document, positions restarting at each.
- RMSNorm in fp32 with the config's eps, as HF computes it, a chunk of positions at a time (the
  Function at the end of this file), keeping no fp32 copy of x.
- no biases (Qwen2's on q, k, v apart, at 0); optional tied embeddings; weight init as
  GPT-2/nanoGPT do for Llama-shaped models: every weight N(0, 0.02) (Llama's `initializer_range`),
  the two projections writing into the residual stream (wo, w2) scaled by 1/sqrt(2·n_layer) so the
  residual's variance does not grow with depth; norms at 1.

The layers: this file is the Llama on one device (it imports rope.py and moe.py, nothing else of
nanolong), and a technique applies to a built model from outside, replacing whole modules with the
state-dict names kept, as torchtitan's plans do, in the order train.py shows: parallel.py shards
the weights, puts Megatron's f and g in the places kept for them (NoCollective: enter_tp,
leave_tp) and the layout's attention core in place of Core (Ulysses around it, the ring instead);
chunked.py swaps in its mini-sequence MLP, its chunked loss as the head and its head groups as
the attention; offload.py puts each block under its keep / recompute / offload policy; FSDP2 wraps
blocks. The heads a rank computes are counted from its weights' shapes. Nothing rebinds a method
or a config field afterwards (tests/test_budget.py checks), so a new attention variant changes
`attention()` and, for the ring, its cases in ring.py (the sliding window did). LlamaConfig is
the architecture alone, what a config.json holds; the memory knobs (mlp_chunks, loss_chunks,
attention_chunks, recompute, offload) are knobs.py's, which the techniques read. With
config.n_experts > 0 each block's MLP is moe.py's mixture of experts (Mixtral's block).
`Llama.from_pretrained()` reads a local HF Llama, Mistral, Ministral, Mixtral, Qwen2, Qwen3 or
Qwen3-MoE directory; `save_pretrained()` writes one that transformers loads back to the same logits
(a Mistral when every layer is windowed, a Ministral when some are, a Qwen2 with q, k, v biases, a
Qwen3 with q and k norms). Qwen's four differences (docs/models.md): a head's width decoupled from
the model's (head_dim: n_head·head_dim need not be n_embd), Qwen2's biases, Qwen3's RMSNorm over
each head's q and k before RoPE (Attention.qkv), Qwen3-MoE's experts of their own width, weights
not renormalised over the k (norm_topk_prob=False) and dense layers among the sparse ones.
"""

import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe import MoE
# (FP32_CHUNK is read from here too: memory.py)
from rope import (FP32_CHUNK, ROPE_SCALING_RULE, apply_rope, fp32_chunks, rope_frequencies,
                  rope_scaling_ok, rope_tables)


# ----------------------------------------------------------------------------- config
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
    # e.g. {"rope_type": "yarn", "factor": 4.0, ...}: rope.ROPE_SCALINGS
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # mixture of experts (moe.py): E experts of width intermediate_size, k per token; 0 = dense
    n_experts: int = 0
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.02  # the load-balancing loss's weight (Mixtral-8x7B's)
    # sliding-window attention (Mistral, Gemma 3, gpt-oss), as HF's config.json writes it: a query
    # sees the last sliding_window keys, itself included (0: every key before it); layer_types
    # None windows every layer, else one 'sliding_attention' or 'full_attention' a layer
    sliding_window: int = 0
    layer_types: list | None = None
    # the Qwen families (docs/models.md): a head's width (0: n_embd / n_head; Qwen3 and
    # Mistral-Nemo decouple it), Qwen2's biases on q, k and v, Qwen3's RMSNorm over each head's q
    # and k before RoPE; Qwen3-MoE's expert width (0: intermediate_size, Mixtral's), its chosen
    # weights renormalised over the k (True: Mixtral's) or not, and the layers whose MLP stays
    # dense (HF's mlp_only_layers)
    head_dim: int = 0
    attention_bias: bool = False
    qk_norm: bool = False
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: list | None = None

    def __post_init__(self):
        # every field's rule, as one line naming it: train.py stops on it before anything is
        # allocated
        at_least = dict(n_layer=1, n_head=1, n_kv_head=1, n_embd=1, intermediate_size=1,
                        vocab_size=1, n_experts=0, experts_per_token=1, sliding_window=0,
                        router_aux_loss_coef=0, head_dim=0, moe_intermediate_size=0)
        for key, least in at_least.items():
            if not getattr(self, key) >= least:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= {least}")
        # a head's width
        width = self.head_dim or self.n_embd // self.n_head
        rules = [
            ('rope_theta', type(self.rope_theta) in (int, float) and self.rope_theta > 0,
             'must be a number > 0'),
            ('rope_scaling', rope_scaling_ok(self.rope_scaling), ROPE_SCALING_RULE),
            ('norm_eps', self.norm_eps > 0, 'must be > 0'),
            ('n_embd', self.head_dim or self.n_embd % self.n_head == 0,
             f"must be divisible by n_head={self.n_head} (or give head_dim)"),
            ('n_head', self.n_head % self.n_kv_head == 0,
             f"must be divisible by n_kv_head={self.n_kv_head}"),
            # (named by the key that set it: head_dim, or n_embd where head_dim is 0)
            ('head_dim' if self.head_dim else 'n_embd', width % 2 == 0,
             "a head's width (head_dim, or n_embd / n_head) must be even (RoPE)"),
            ('dense_layers', set(self.dense_layers or []) <= set(range(self.n_layer)),
             f"must be None or layers of range(n_layer={self.n_layer})"),
            ('experts_per_token', self.n_experts == 0 or self.experts_per_token <= self.n_experts,
             f"must be <= n_experts={self.n_experts}"),
            ('layer_types', self.layer_types is None or (
                len(self.layer_types) == self.n_layer
                and set(self.layer_types) <= {'sliding_attention', 'full_attention'}),
             f"must be None or n_layer={self.n_layer} of 'sliding_attention', 'full_attention'"),
            ('sliding_window', self.sliding_window or 'sliding_attention' not in (
                self.layer_types or []), "must be > 0 where layer_types has 'sliding_attention'")]
        for key, ok, allowed in rules:
            if not ok:
                raise ValueError(f"{key}={getattr(self, key)!r}: {allowed}")
        # the widths 0 stands for, stored: every formula reads head_dim, an expert's width
        self.head_dim = width
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size

    def is_moe(self, layer):
        """Whether layer `layer`'s MLP is a mixture of experts (the others: the dense MLP)."""
        return self.n_experts > 0 and layer not in (self.dense_layers or [])

    def window(self, layer):
        """Layer `layer`'s sliding window: the keys a query sees, itself included (0: all)."""
        if self.layer_types is None or self.layer_types[layer] == 'sliding_attention':
            return self.sliding_window
        return 0


# ----------------------------------------------------------------------------- attention
def attention(q, k, v, docs=None, window=0, varlen=None):
    """The attention core: causal softmax(q kᵀ / sqrt(hd)) v over q [B, H, S, hd] and k, v
    [B, K, S, hd], K | H. With `docs` (doc_mask: the start of every document in the flattened B·S
    tokens, a host array, flash-attn's cu_seqlens) each document attends only to itself: one
    varlen kernel for them all (varlen; None: on CUDA), else one call per document. With a
    sliding `window` (> 0) a query sees the last `window` keys of its document, itself included:
    every row is then a document of the same two paths, varlen's window_size on CUDA, SDPA with
    the window's mask on a CPU. parallel.py's Ulysses calls this unchanged on the whole sequence
    for a share of the heads; ring.py has its own steps."""
    B, _, S, _ = q.shape
    if window and docs is None:
        docs = np.arange(B) * S
    if docs is None or (len(docs) == B and not window):
        # no documents, or one a row (each row begins one): the whole rows' causal attention, SDPA's
        # dense kernel (on one long document faster than varlen's: bench/RESULTS.md)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if varlen or (varlen is None and q.is_cuda):
        return one_kernel(q, k, v, docs, window)
    return per_document(q, k, v, docs, window)


def window_mask(n_q, n_k, window, device):
    """[n_q, n_k]: which keys each query sees, the queries the last n_q of n_k places: query i sees
    key j when 0 <= i - j < window (Hugging Face's rule for a sliding window)."""
    i = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    j = torch.arange(n_k, device=device)
    return (j <= i) & (j > i - window)


# a loop whose length changes with every batch: eager inside a compiled model
@torch.compiler.disable
def per_document(q, k, v, docs, window):
    """One causal SDPA call per document: exact on every device and kernel, and no S x S mask; each
    call saves for backward what one whole-window call would save of its tokens. The reference,
    and the CPU's way. (FlexAttention's document mask is one fused kernel on CUDA but has no CPU
    backward in torch 2.13.)"""
    B, _, S, _ = q.shape
    lengths = np.diff(np.append(docs, B * S)).tolist()
    # each document's q, k, v [1, heads, its tokens, hd] from one split of the flattened rows
    # (views; a document lies in one row). Not a slice per document: each slice's backward makes a
    # zero gradient of the whole window (1,000 documents: 4x slower than no mask, bench/RESULTS.md)
    splits = (t.transpose(0, 1).flatten(1, 2)[None].split(lengths, dim=2) for t in (q, k, v))
    y = []
    for q_doc, k_doc, v_doc in zip(*splits):
        T = q_doc.shape[2]
        mask = None
        if T > window > 0:  # (a document within its window is plain causal)
            mask = window_mask(T, T, window, q.device)
        y.append(F.scaled_dot_product_attention(q_doc, k_doc, v_doc, mask, is_causal=mask is None,
                                                enable_gqa=True))
    # [1, H, B·S, hd], the documents one after the other -> [B, H, S, hd]
    return torch.cat(y, dim=2).unflatten(2, (B, S)).squeeze(0).transpose(0, 1)


# the documents' lengths change with every batch: eager inside a compiled model
@torch.compiler.disable
def one_kernel(q, k, v, docs, window):
    """Every document of the batch in one call of torch's variable-length flash attention
    (varlen_attn, CUDA only): one kernel launch per layer where per_document makes one per
    document, kv heads not expanded, saving what SDPA's flash saves (q, k, v, out, an fp32
    log-sum-exp). Documents are packed one after the other, tokens first: [B·S, heads, hd] (a
    view: q, k, v come from [B, S, heads, hd] projections). A window of W keys is flash's
    window_size (W - 1 keys before the query, none after)."""
    from torch.nn.attention.varlen import varlen_attn
    B, _, S, _ = q.shape
    cuts = np.append(docs, B * S)
    cu_seqlens = torch.as_tensor(cuts, dtype=torch.int32, device=q.device)
    longest = int(np.diff(cuts).max())
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
    y = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest,
                    window_size=(window - 1, 0), enable_gqa=True)
    return y.unflatten(0, (B, S)).transpose(1, 2)


class Core(nn.Module):
    """The attention core as a module each Attention holds: `attend` (q, k, v, docs, window), on one
    device attention() above. A layout replaces the module whole (parallel.py: Ulysses around
    attention(), the ring in its place, varlen's kernel for a dry run that stands in for CUDA);
    sampling and evaluation build the same model, so they run the kernel training ran (varlen on
    CUDA, one call a document on a CPU)."""

    def __init__(self, attend=attention):
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v, docs, window=0):
        return self.attend(q, k, v, docs, window)


class NoCollective(nn.Module):
    """Where tensor parallelism puts a collective (Megatron's f before wq, wk, wv or w1, w3; g after
    wo or w2): parallel.py's plan replaces this module. In one process x itself, as a view: a step
    autograd sees, so a tracker of modules in backward (MemTracker) finds this one's bounds, which
    it can't on a module whose output is its input."""

    def forward(self, x):
        return x.view_as(x)


class Attention(nn.Module):
    """Grouped-query attention: q, k, v -> core -> output. `core` is the attention core (Core
    above: attention() on one device; a layout replaces the module); `window` is this layer's
    sliding window (0: none), which the core is handed with q, k, v. The heads are counted from
    the weights (view(B, S, -1, hd)), as torchtitan does: a plan that shards wq, wk, wv by heads
    (tensor parallelism) changes nothing here."""

    def __init__(self, config, window):
        super().__init__()
        self.window = window
        h, H, K, hd = config.n_embd, config.n_head, config.n_kv_head, config.head_dim
        self.head_dim = hd
        self.core = Core()
        self.wq = nn.Linear(h, H * hd, bias=config.attention_bias)
        self.wk = nn.Linear(h, K * hd, bias=config.attention_bias)
        self.wv = nn.Linear(h, K * hd, bias=config.attention_bias)
        self.wo = nn.Linear(H * hd, h, bias=False)
        # Qwen3's norms of each head's q and k (one weight [hd] for all heads: replicated under
        # tp); None: Llama's (not nn.Identity: a module that returns its input confuses torch's
        # module tracker, MemTracker, about which module's backward runs)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.norm_eps)
            self.k_norm = RMSNorm(hd, config.norm_eps)
        # Megatron's f and g: every tp rank gets all of x, and wo's partial sums are summed.
        # Nothing in one process; parallel.py's tensor-parallel plan puts its collectives here
        self.enter_tp = NoCollective()
        self.leave_tp = NoCollective()

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        q, k, v = self.project(x, cos, sin)
        if kv_cache is not None:
            return self.finish(self.cached(q, k, v, kv_cache))
        return self.finish(self.core(q, k, v, docs, self.window))

    # forward's two ends, each a part any caller may run on a range of the tokens (offload.py's
    # split runs the core once over two ranges' q, k, v)
    def project(self, x, cos, sin):
        """Tokens x -> their q, k, v: Megatron's f (nothing on one device), then qkv."""
        return self.qkv(self.enter_tp(x), cos, sin)

    def finish(self, a):
        """The core's output a -> attention's output: wo, then Megatron's g."""
        return self.leave_tp(self.out(a))

    def qkv(self, x, cos, sin, g=0, groups=1):
        """q [B, heads, S, hd] and k, v [B, kv heads, S, hd] of head group g of `groups` (by
        default all heads; chunked.py's head groups ask for one), RoPE applied: group g's rows of
        wq, wk, wv (a kv head's query heads are next to each other)."""
        B, S, _ = x.shape

        def heads(w, norm=None):
            """Group g's heads of x w [B, heads, S, hd], with w's bias (Qwen2's) and norm
            (Qwen3's) where the layer has them."""
            bias = w.bias
            if bias is not None:
                bias = bias.chunk(groups)[g]
            y = F.linear(x, w.weight.chunk(groups)[g], bias).view(B, S, -1, self.head_dim)
            if norm is not None:
                # normed as rows of hd: the norm's fp32 chunks (rope.fp32_chunks) are then of
                # tokens and heads, not each a whole head's tokens
                y = norm(y.flatten(0, -2)).view_as(y)
            return y.transpose(1, 2)

        q, k = heads(self.wq, self.q_norm), heads(self.wk, self.k_norm)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), heads(self.wv)

    def out(self, y, g=0, groups=1):
        """The output projection of head group g's attention output y [B, heads, S, hd]: its
        columns of wo."""
        return F.linear(y.transpose(1, 2).flatten(2), self.wo.weight.chunk(groups, dim=1)[g])

    def cached(self, q, k, v, kv_cache):
        """Sampling: the new tokens' keys and values appended to the cache; a new token sees the
        keys before it (the prompt's tokens causally), the last `window` of them with a window."""
        k, v = kv_cache.update(k, v)
        n_q, n_k = q.shape[2], k.shape[2]
        # the prompt (prefill) of a layer without a window: causal, no T x T mask (at 128K tokens
        # that mask is 16 GiB of bool), attention()'s dense SDPA
        if n_q == n_k and not self.window:
            return attention(q, k, v)
        mask = window_mask(n_q, n_k, self.window or n_k, q.device)
        return F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)


# ----------------------------------------------------------------------------- MLP
class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x). (chunked.py's apply swaps in its mini-sequences of it.)"""

    def __init__(self, config):
        super().__init__()
        h, I = config.n_embd, config.intermediate_size
        self.w1 = nn.Linear(h, I, bias=False)  # gate
        self.w3 = nn.Linear(h, I, bias=False)  # up
        self.w2 = nn.Linear(I, h, bias=False)  # down
        # Megatron's f and g, as Attention's
        self.enter_tp = NoCollective()
        self.leave_tp = NoCollective()

    def forward(self, x):
        x = self.enter_tp(x)
        return self.leave_tp(self.w2(F.silu(self.w1(x)) * self.w3(x)))


# ----------------------------------------------------------------------------- the block
class RMSNorm(nn.Module):
    """weight · rms_norm(x in fp32) cast to x's dtype, as HF computes it (bf16 sums of squares
    over 4096 channels lose digits), by _RMSNorm (the end of this file): it keeps x alone for
    backward."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if torch.compiler.is_compiling():
            # Dynamo can't trace the autograd.grad in _RMSNorm's backward; inductor fuses the
            # expression
            return _normalized(x, self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config, config.window(layer))
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        if config.is_moe(layer):
            # Mixtral's block: the same, its MLP a mixture of experts
            self.feed_forward = MoE(config)
        else:
            self.feed_forward = MLP(config)

    def forward(self, x, cos, sin, docs=None, kv_cache=None):
        return self.with_mlp(self.with_attention(x, cos, sin, docs, kv_cache))

    # the block's two residual halves (offload.py hooks the first's output)
    def with_attention(self, x, cos, sin, docs, kv_cache=None):
        """x + attention(RMSNorm(x))."""
        return x + self.attention(self.attention_norm(x), cos, sin, docs, kv_cache)

    def with_mlp(self, h):
        """h + MLP(RMSNorm(h))."""
        return h + self.feed_forward(self.ffn_norm(h))


# ----------------------------------------------------------------------------- the model
class Head(nn.Linear):
    """The LM head: logits x Wᵀ, or with targets (logits, mean cross-entropy over targets != -100),
    as transformers computes them: the [B, S, V] logits in fp32. (chunked.py's apply swaps in its
    loss, which never holds them.)"""

    def forward(self, x, targets=None):
        logits = super().forward(x)
        if targets is None:
            return logits
        # the mean over the targets that count (no target counting: 0, not 0 / 0)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction='sum')
        return logits, loss / (targets != -100).sum().clamp(min=1)


class Llama(nn.Module):
    """The model for `config`, on one device: the class says what it computes. The techniques
    apply to a built model from outside, in the order train.py shows: parallel.py's plan shards its
    weights and replaces the tensor-parallel places (enter_tp, leave_tp) with collectives and the
    attention cores with the layout's, chunked.py swaps in its mini-sequences, offload.py wraps its
    blocks."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        # by index, not a list: a pipeline stage (parallel.py) drops the blocks it doesn't own, the
        # names stay
        self.layers = nn.ModuleDict({str(i): Block(config, i)
                                     for i in range(config.n_layer)})
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        # f before the LM head: under tensor parallelism each rank's rows of the vocabulary need
        # every token (nothing here: parallel.py's plan)
        self.enter_tp = NoCollective()
        self.output = Head(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for m in self.modules():  # (a tied matrix twice, as nanoGPT's self.apply does)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if getattr(m, 'bias', None) is not None:  # Qwen2's q, k, v biases: 0, as HF's init
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith(('wo.weight', 'w2.weight')):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets=None, positions=None, docs=None, kv_caches=None, head=True):
        """idx [B, S] -> logits [B, S, V] (with kv_caches: the last token's, [B, 1, V]); with
        targets -> (logits or None, mean loss over targets != -100). `positions` [S] or [B, S] are
        the positions of idx's tokens (a shard of a longer sequence, the tokens after a kv cache,
        each token's place in its document); they default to 0..S-1. `docs`: see attention().
        head=False, or a pipeline stage without the head: the final norm's output [B, S, h], the
        LM head's input (a stage without the final norm: its last block's), for a caller that
        runs the head itself (pipeline.py's schedule, eval.py's loss by position). Always through
        here, not a method beside it: FSDP2 gathers the model's own weights around forward."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        # RoPE's tables from frequencies made here: a buffer would be rounded to bf16 by model.to().
        # (fp64 math, which autocast leaves alone; the inverse frequencies in fp32, as HF has them)
        inv_freq, scale = rope_frequencies(self.config)
        cos, sin = rope_tables(inv_freq.float(), positions, scale)
        # (a later pipeline stage has no embedding: idx are its activations)
        x = idx if self.tok_embeddings is None else self.tok_embeddings(idx)
        for i, block in self.layers.items():
            kv_cache = None if kv_caches is None else kv_caches[int(i)]
            x = block(x, cos, sin, docs, kv_cache)
        if self.norm is not None:
            x = self.enter_tp(self.norm(x))
        if not head or self.output is None:
            return x
        if kv_caches is not None:  # sampling reads the last token's logits: not a prompt's [T, V]
            x = x[:, -1:]
        return self.output(x, targets)

    # ------------------------------------------------------------------------- Hugging Face
    @classmethod
    def from_pretrained(cls, hf_dir, **overrides):
        """Load a local HF Llama, Mistral, Ministral or Mixtral directory: config.json +
        model.safetensors, or shards with an index, into Llama(config), its sliding
        window the one transformers computes (read_config). `overrides` set LlamaConfig
        fields: a new rope_theta or rope_scaling extends its context (the memory knobs: knobs.py,
        applied by the techniques)."""
        from safetensors.torch import load_file

        config = read_config(hf_dir, **overrides)
        files = ['model.safetensors']
        index = os.path.join(hf_dir, 'model.safetensors.index.json')
        if os.path.exists(index):
            with _reading(index), open(index) as f:
                files = sorted(set(json.load(f)['weight_map'].values()))
        hf_state = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            with _reading(path):
                hf_state.update(load_file(path))
        model = cls(config)
        state = {}
        for ours, theirs in _hf_names(config).items():
            with _reading(hf_dir):
                if isinstance(theirs, list):
                    # Mixtral's experts, a matrix each on disk: ours are stacked [E, ...]
                    state[ours] = torch.stack([hf_state.pop(name) for name in theirs])
                else:
                    state[ours] = hf_state.pop(theirs)
            shape = model.get_parameter(ours).shape
            if state[ours].shape != shape:
                raise ValueError(f"{hf_dir}: {theirs} is {list(state[ours].shape)}, config.json "
                                 f"makes it {list(shape)}")
        hf_state.pop('lm_head.weight', None)  # tied checkpoints may still carry a copy
        if hf_state:
            raise ValueError(f"{hf_dir}: unexpected weights {sorted(hf_state)[:5]}")
        model.load_state_dict(state, strict=False)  # strict would ask for the tied output twice
        return model

    def save_pretrained(self, out_dir):
        """HF's Llama config.json (rope_scaling's older form, read by every transformers), or
        Mixtral's when n_experts > 0, + model.safetensors. A sliding window on every layer is
        Mistral's config (Mixtral's with experts), on some layers Ministral's: transformers' Llama
        reads no window. Biases on q, k, v are Qwen2's config, q and k norms Qwen3's (Qwen3-MoE's
        with experts)."""
        from safetensors.torch import save_file
        c = self.config
        s = c.rope_scaling or {}
        # config.json's dict first: a config HF can't say is refused before anything is written
        hf = {theirs: getattr(c, ours) for ours, theirs in HF_CONFIG.items()}
        hf.update(model_type='llama', hidden_act='silu', head_dim=c.head_dim,
                  rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                  attention_bias=c.attention_bias,
                  mlp_bias=False,
                  # the context scaled to: transformers checks that YaRN's factor is this over the
                  # original's
                  max_position_embeddings=int(s.get('factor', 1)
                                              * s.get('original_max_position_embeddings', 8192)),
                  torch_dtype=str(next(self.parameters()).dtype).removeprefix('torch.'))
        # some layers windowed, the others not (LlamaConfig: a 'sliding_attention' has a window)
        mixed = len(set(c.layer_types or [])) > 1
        # (not mixed: every layer's window is layer 0's)
        if mixed or c.window(0):
            # Mistral: a Llama whose every layer sees the last sliding_window keys
            hf.update(model_type='mistral', sliding_window=c.sliding_window)
        if mixed:
            # Ministral: a Llama whose layer_types say which layers are windowed
            hf.update(model_type='ministral', layer_types=c.layer_types)
        if c.attention_bias or c.qk_norm:
            # Qwen2: biases on q, k, v, a dense model; Qwen3: norms of q and k (Qwen3-MoE's with
            # experts); neither windowed
            if hf['model_type'] != 'llama' or c.attention_bias and (c.qk_norm or c.n_experts):
                raise ValueError("attention_bias, qk_norm: Qwen2's (biases, dense) or Qwen3's "
                                 "(norms), without windows")
            hf['model_type'] = 'qwen2' if c.attention_bias else 'qwen3'
        if c.n_experts and c.qk_norm:
            hf.update({theirs: getattr(c, ours) for ours, theirs in HF_QWEN_MOE_CONFIG.items()},
                      model_type='qwen3_moe', mlp_only_layers=c.dense_layers or [],
                      decoder_sparse_step=1)
        elif c.n_experts:
            if mixed or c.dense_layers or not c.norm_topk_prob:
                raise ValueError("layer_types, dense_layers, norm_topk_prob=False: Mixtral has "
                                 "none (Qwen3-MoE, whose heads have qk_norm, the last two)")
            # (sliding_window stays: Mixtral windows every layer with it)
            hf.update({theirs: getattr(c, ours) for ours, theirs in HF_MOE_CONFIG.items()},
                      model_type='mixtral', intermediate_size=c.moe_intermediate_size)
        # transformers' class is the family's: LlamaForCausalLM, Qwen3MoeForCausalLM, ...
        family = hf['model_type'].title().replace('_', '')
        hf['architectures'] = [f"{family}ForCausalLM"]
        os.makedirs(out_dir, exist_ok=True)
        state = {}
        for ours, theirs in _hf_names(c).items():
            p = self.get_parameter(ours).detach().cpu()
            if isinstance(theirs, list):
                # an expert's matrix apiece, each a copy: safetensors refuses views of one storage
                state.update(zip(theirs, map(torch.clone, p)))
            else:
                state[theirs] = p.contiguous()
        save_file(state, Path(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
        Path(out_dir, 'config.json').write_text(json.dumps(hf, indent=2))


# LlamaConfig's fields as HF's config.json names them (the RoPE fields apart: two forms)
HF_CONFIG = {'n_layer': 'num_hidden_layers', 'n_head': 'num_attention_heads',
             'n_kv_head': 'num_key_value_heads', 'n_embd': 'hidden_size',
             'intermediate_size': 'intermediate_size', 'vocab_size': 'vocab_size',
             'norm_eps': 'rms_norm_eps', 'tie_embeddings': 'tie_word_embeddings'}
# the families nanolong reads (model_type), each with the sliding_window transformers gives it when
# config.json leaves the key out (None: no window)
HF_WINDOW = {'llama': None, 'mistral': 4096, 'ministral': 4096, 'mixtral': None, 'qwen2': None,
             'qwen3': None, 'qwen3_moe': None}
# and Mixtral's, which a 'mixtral' config.json always has
HF_MOE_CONFIG = {'n_experts': 'num_local_experts', 'experts_per_token': 'num_experts_per_tok',
                 'router_aux_loss_coef': 'router_aux_loss_coef'}
# Qwen3-MoE's (its dense-layer pattern apart)
HF_QWEN_MOE_CONFIG = HF_MOE_CONFIG | {'n_experts': 'num_experts',
                                      'moe_intermediate_size': 'moe_intermediate_size',
                                      'norm_topk_prob': 'norm_topk_prob'}


@contextmanager
def _reading(path):
    """A file from outside: whatever is wrong with it is one ValueError naming it."""
    try:
        yield
    except Exception as e:
        missing = 'missing ' if isinstance(e, KeyError) else ''
        raise ValueError(f"{path}: {missing}{getattr(e, 'strerror', 0) or e}") from None


def read_config(hf_dir, **overrides):
    """The LlamaConfig of a local HF directory's config.json, `overrides` (LlamaConfig fields)
    set: no weights read (train.py settles the layout and the memory knobs before it builds)."""
    path = os.path.join(hf_dir, 'config.json')
    with _reading(path), open(path) as f:
        hf = json.load(f)
        # other families differ in what the names can't say (Gemma's (1 + w) norms, Qwen2-MoE's
        # shared experts): refused, not loaded to wrong logits. No model_type: a hand-made Llama's
        model_type = hf.get('model_type', 'llama')
        if model_type not in HF_WINDOW:
            raise ValueError(f"model_type {model_type!r} is not a Llama (nanolong reads "
                             f"{', '.join(map(repr, HF_WINDOW))})")
        # Qwen2's biases are on q, k, v; the others' attention_bias puts one on o_proj too
        if hf.get('attention_bias') and model_type != 'qwen2':
            raise ValueError(f"attention_bias=True on a {model_type!r} (o_proj's bias too) is not "
                             "supported")
        if hf.get('use_sliding_window'):
            raise ValueError("use_sliding_window=True (Qwen's windowed layers) is not supported")
        # transformers 5's form, or the older one (with 'type' for 'rope_type')
        rope = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
        theta = rope.pop('rope_theta', hf.get('rope_theta', 10000.0))
        rope = {'rope_type': rope.pop('type', 'default'), **rope}
        # The sliding window as transformers computes it, for the same logits. Mistral and
        # Mixtral window every layer by sliding_window (null: none); Ministral the layers its
        # layer_types say (None: every layer). Mixtral reads no layer_types; MistralForCausalLM
        # neither (it warns), but AutoModel reads a 'mistral' config.json that has the key as
        # Ministral's, so we do. LlamaForCausalLM reads neither key (Qwen's, unless
        # use_sliding_window): a config.json that carries them is full attention there, so here.
        window = hf.get('sliding_window', HF_WINDOW[model_type]) or 0
        if model_type == 'llama' or model_type.startswith('qwen'):
            window = 0
        layer_types = hf.get('layer_types') if model_type in ('mistral', 'ministral') else None
        # HF's defaults for the keys it may leave out (Qwen3's head_dim: 128; Mixtral writes it
        # null: hidden_size / num_attention_heads)
        hf = {'rms_norm_eps': 1e-6, 'tie_word_embeddings': False, 'decoder_sparse_step': 1,
              'head_dim': 128 if model_type == 'qwen3' else None,
              # (Qwen3-MoE's name, the hub's; transformers 5 writes Mixtral's)
              'num_experts': hf.get('num_local_experts'), **hf}
        hf['num_key_value_heads'] = hf.get('num_key_value_heads') or hf['num_attention_heads']
        names = HF_CONFIG
        if model_type == 'mixtral':
            names = HF_CONFIG | HF_MOE_CONFIG
        if model_type == 'qwen3_moe':
            names = HF_CONFIG | HF_QWEN_MOE_CONFIG
        fields = {ours: hf[theirs] for ours, theirs in names.items()}
        rope_scaling = None if rope['rope_type'] == 'default' else rope
        # Qwen3-MoE's dense layers: mlp_only_layers, and those off every decoder_sparse_step-th
        # (none elsewhere)
        step = hf['decoder_sparse_step']
        dense = [i for i in range(hf['num_hidden_layers'])
                 if i in (hf.get('mlp_only_layers') or []) or (i + 1) % step]
        config = LlamaConfig(**fields, rope_theta=float(theta), rope_scaling=rope_scaling,
                             sliding_window=window, layer_types=layer_types,
                             head_dim=hf['head_dim'] or 0, attention_bias=model_type == 'qwen2',
                             qk_norm=model_type in ('qwen3', 'qwen3_moe'),
                             dense_layers=dense or None)
    # checked again: a bad override is the user's, not the file's
    return replace(config, **overrides)


def _hf_names(config):
    """Our parameter names -> HF's (the LM head is absent when tied: HF shares it too). Stacked
    experts -> a list of E names, one matrix each, as Mixtral's and Qwen3-MoE's checkpoints store
    them (transformers 5 fuses them in memory and still reads and writes these names)."""
    names = {'tok_embeddings.weight': 'model.embed_tokens.weight',
             'norm.weight': 'model.norm.weight'}
    if not config.tie_embeddings:
        names['output.weight'] = 'lm_head.weight'
    projections = {'wq': 'q_proj', 'wk': 'k_proj', 'wv': 'v_proj', 'wo': 'o_proj'}
    # a MoE block's router and experts: Mixtral's block_sparse_moe, or Qwen3-MoE's mlp (qk_norm)
    moe, experts = 'block_sparse_moe', {'w1': 'w1', 'w2': 'w2', 'w3': 'w3'}
    if config.qk_norm:
        moe, experts = 'mlp', {'w1': 'gate_proj', 'w2': 'down_proj', 'w3': 'up_proj'}
    for i in range(config.n_layer):
        ours, theirs = f'layers.{i}.', f'model.layers.{i}.'
        block = {'attention_norm': 'input_layernorm', 'ffn_norm': 'post_attention_layernorm'}
        block |= {f'attention.{w}': f'self_attn.{p}' for w, p in projections.items()}
        if config.qk_norm:
            block |= {'attention.q_norm': 'self_attn.q_norm',
                      'attention.k_norm': 'self_attn.k_norm'}
        if config.is_moe(i):
            block['feed_forward.router'] = f'{moe}.gate'
            for w, p in experts.items():
                names[f'{ours}feed_forward.experts.{w}'] = [
                    f'{theirs}{moe}.experts.{j}.{p}.weight' for j in range(config.n_experts)]
        else:
            block |= {'feed_forward.w1': 'mlp.gate_proj', 'feed_forward.w3': 'mlp.up_proj',
                      'feed_forward.w2': 'mlp.down_proj'}
        for o, t in block.items():
            names[f'{ours}{o}.weight'] = f'{theirs}{t}.weight'
        if config.attention_bias:  # Qwen2's
            for w in ('wq', 'wk', 'wv'):
                names[f'{ours}attention.{w}.bias'] = f'{theirs}self_attn.{projections[w]}.bias'
    return names


# ----------------------------------------------------------------------------- counts
def num_params(config, non_embedding=True, active=False):
    """Parameters of Llama(config), without the embedding table by default (a lookup, not a
    matmul); active: of the experts, only the k a token computes. The one parameter count:
    train.py's MFU and memory.py's model states read it."""
    h, V, E, hd = config.n_embd, config.vocab_size, config.n_experts, config.head_dim
    q, kv = config.n_head * hd, config.n_kv_head * hd
    # two norms, wq wo, wk wv; Qwen2's biases on q, k and v, Qwen3's norms of a head's q and k
    attention = 2 * h + 2 * h * q + 2 * h * kv
    attention += config.attention_bias * (q + 2 * kv) + config.qk_norm * 2 * hd
    # w1 w2 w3, or the router and E experts (k of them computed)
    dense = 3 * h * config.intermediate_size
    experts = config.experts_per_token if active else E
    moe = h * E + 3 * h * config.moe_intermediate_size * experts
    mlps = sum(moe if config.is_moe(i) else dense for i in range(config.n_layer))
    # a tied matrix counts once, as the head
    embedding = 0 if non_embedding or config.tie_embeddings else V * h
    return config.n_layer * attention + mlps + h + V * h + embedding


def attention_pairs(lengths, window=0):
    """The (query, key) pairs causal attention computes in documents of these lengths: in one of
    n tokens query i (1..n) sees min(i, W) keys, itself included, W the window (0: none, every key
    up to the query's, n(n + 1)/2 pairs)."""
    n = np.asarray(lengths)
    # queries 1..m see 1..m keys; past a window (m = W) each of the other n - m sees W
    m = np.minimum(n, window or n)
    # (a Python int: L layers of millions of tokens pass int64 once times 12·h)
    return int(np.sum(m * (m + 1) // 2 + (n - m) * window))


def flops_per_token(config, *lengths):
    """The model FLOPs per trained token (what MFU counts): 6·N + 12·a·P/T a token, N the
    non-embedding parameters plus the LM head, P the (query, key) pairs of the L layers
    (attention_pairs) in T tokens, a = n_head·head_dim the heads' width (h, Llama's n_embd, but
    where head_dim is decoupled: Qwen3). Attention trains 12·a FLOPs a pair (q·k and p·v, 2·a
    each forward, x3 with backward); causal attention's S(S + 1)/2 pairs make it 6·L·a·(S + 1),
    half of the 12·L·a·S that PaLM's appendix, Megatron's paper and torchtitan count (every query
    seeing every key), as FlashAttention's benchmarks (causal: half) and Megatron-LM's code
    (seq_len / 2) count it. A windowed layer counts its window's pairs. `lengths`: of the
    documents (doc_mask) of the batch's sequences, each counting its own pairs;
    flops_per_token(config, S): one of S.
    What the memory knobs run again on top: knobs.hardware_flops."""
    N = num_params(config, active=True)
    pairs = sum(attention_pairs(lengths, config.window(i)) for i in range(config.n_layer))
    return 6 * N + 12 * config.n_head * config.head_dim * pairs / sum(lengths)


# ----------------------------------------------------------------------------- RMSNorm in fp32
# RMSNorm's Function lives here, by its module, and not in rope.py: it is the model's layer, which
# only shares RoPE's chunks of fp32 (rope.fp32_chunks). Autograd on HF's expression (RMSNorm's
# forward when compiling) keeps an fp32 copy of x and x/rms for backward, and its backward holds
# five fp32 tensors the size of x at once: 4·(2 + 5)·B·S·h bytes. _RMSNorm keeps x alone, in its
# own dtype, and redoes a chunk of positions at a time in backward: 7·4·FP32_CHUNK bytes at most.

def _normalized(x, weight, eps):
    """HF's expression: weight · rms_norm(x in fp32), cast to x's dtype before the product."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
        for rows in fp32_chunks(x):
            out[rows] = _normalized(x[rows], weight, eps)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # y = x/rms, dy = g·weight: dx = (dy - y·mean(dy·y)) / rms, dweight = Σ g·y
        x, weight = ctx.saved_tensors
        # dweight summed over the chunks in fp32
        dx, dw = torch.empty_like(x), torch.zeros_like(weight, dtype=torch.float32)
        for rows in fp32_chunks(x):
            # dx by F.rms_norm's own backward on the chunk (its forward redone): CUDA's fused
            # kernel, the CPU's autograd ops, so the plain path's bits; a formula by hand would
            # round differently, and cost more on CUDA
            with torch.enable_grad():
                xf = x[rows].detach().float().requires_grad_()
                y = F.rms_norm(xf, x.shape[-1:], eps=ctx.eps).to(x.dtype)
            dw += (g[rows] * y).flatten(0, -2).sum(0, dtype=torch.float32)
            dx[rows] = torch.autograd.grad(y, xf, (g[rows] * weight).to(y.dtype))[0]
        return dx, dw.to(weight.dtype), None
