"""
Mixture of experts: Mixtral's MLP (a router and E SwiGLU experts, k of them per token), on one
device. (Expert and tensor parallelism over torchrun are parallel.py's ParallelMoE, which replaces
this module; the grouped GEMM and its mini-sequences are chunked.py's GroupedExperts, which replaces
Experts: this file imports no technique.)

model.py's Block takes this MoE for its MLP when config.n_experts > 0 (0: the dense Llama):

    logits = x Wrᵀ                 Wr [E, h], the router, in fp32 (as Mixtral's)
    top k of the E logits per token, weights = softmax over those k   (Mixtral: softmax over all E,
                                   then the top k renormalised: the same numbers)
    y = Σ over the k chosen e of weight_e · SwiGLU_e(x)   (each expert a Llama MLP of width I)

Per token it computes k experts, 6·3·h·I·k FLOPs of training against the dense MLP's 6·3·h·I; its
parameters are E times the MLP's (3·h·I·E + h·E a layer), every one with its states (2 + 4 + 12
bytes in bf16): Mixtral-8x7B holds 46.7B parameters and computes 12.9B a token; under ep a rank
holds E/ep experts and their states. The memory it keeps for backward per token and layer (b bytes
per element; memory_terms at the end of this file, which memory.py counts): three copies of each
of the token's k (token, expert) pairs, 3·b·h·k (the rows the experts take, their outputs, the
outputs weighted, which index_add keeps), the router's fp32 probabilities over E and over the
chosen k, 4·(E + k), and the pairs' int64 indices, 24·k; no [S, I] tensor. Its backward's working
set is the larger of two [T·k, h] copies (their gradients; under ep an all-to-all's send and
receive buffers) and the experts' backward.

The tokens: the T·k (token, expert) pairs are sorted by expert (stable: token order within one),
the experts run on their rows of that one gathered [T·k, h] copy, and the outputs are weighted
and summed back onto their tokens (index_add).

Here the experts run one after the other, each on its rows (the reference, as transformers
loops); in training they run as one (chunked.py's GroupedExperts, a grouped GEMM: torchtitan's
GroupedExperts, torch's F.grouped_mm; the idea of MegaBlocks, Gale et al. 2022, which computes
all experts as one block-sparse product): each matmul of the SwiGLU, forward and backward, is
one call over every expert's rows, the weights
stacked [E, ...] and offsets (where each expert's rows end) telling each row its expert; not a
Python loop of E small matmuls, whose calls cost more than their FLOPs at fine grain (many small
experts: Qwen3-MoE, DeepSeek). The rows are chunked as the dense MLP chunks its S tokens, as one
sequence of T·k (chunked.py's mlp_chunks and _ChunkedMLP, which takes the offsets): a chunk is a
slice of the rows wherever it falls, the experts whose rows it holds in one call, so a long
sequence's routed tokens never hold T·k·I at once (unchunked, the experts keep 4·b·I per pair, k
times the dense MLP's per token). Why slices of all the rows, not the c-th part of each expert's:
a slice is a view (no gather), the loop is chunked.py's own, and mlp_chunks's automatic count makes
a chunk's working set about the [T·k, h] copies the MoE holds anyway (chunked.py's rule), as the
loop's per-expert chunks were. What it costs: backward accumulates the fp32 weight gradients of
the rank's E/ep experts at once (12·h·I·E/ep bytes; the loop, one expert's), grouped_mm has no
out= (its dz comes as a fourth [n, I] buffer for a moment), an unchunked backward works on all the
rows at once (2·b·I·T·k), and a fixed mlp_chunks = M cuts all the rows in M (the loop cut each
expert's). grouped_mm needs strides of multiples of 16 bytes: h and a rank's I multiples of 8 in
bf16 (4 in fp32). Measured (bench.py --mode=moe: train_tiny's model, fp32, a 2-core CPU; the
step's time over a dense step of the same active FLOPs; bench/RESULTS.md, 2026-11-28), medians
of the runs: on two threads 8 experts top 2 went from 1.16x to 1.13x, 32 experts top 4 from 1.37x
to 1.27x; on one thread, two runs each, 1.09, 1.08x -> 1.08, 1.09x and 1.18, 1.25x -> 1.14,
1.25x. The machine is shared: one code's ratio moved by up to 15% between runs, so only the 32
experts' gain on two threads stands out of the noise. What is left on a CPU: its grouped_mm is a
loop of matmuls in C++ (32 experts' small ones take 1.4x the time of one of their FLOPs) and
routing's gather, weights and sums.

Load balancing (Switch Transformer, Fedus et al. 2021; Mixtral's `router_aux_loss_coef`): with f_e
the fraction of the T·k pairs routed to e and P_e the router's mean probability for e over the T
tokens, aux = E · Σ_e f_e · P_e (k when balanced), averaged over the layers. It trains the router
(f, a count, has no gradient). The step's loss backpropagates coef · aux: each layer hands its aux
gradient to autograd from the backward of its output (_AuxLoss, Megatron's way: a pipeline stage
has no loss to add it to), and the log has it apart (`aux_loss`). (transformers' Mixtral computes
f and P over all layers' tokens at once, which crosses layers; Switch's is per layer.) Over several
ranks f and T are the micro-batch's (counts summed over the dp·cp ranks), P our tokens' share: the
ranks' aux add up to one process's, and so do the gradients.

Expert parallelism (GShard, Lepikhin et al. 2020; ep = mesh.ep, over the dp·cp ranks that hold the
same weights): rank j of an ep group holds experts [j·E/ep, (j+1)·E/ep). Each rank sends each
expert's rows to its owner and gets them back, two all-to-alls of variable sizes per layer (the
sizes exchanged first, E numbers). Parameters and states of the experts: E/ep of them a rank.
Under tensor parallelism the router runs on the rank's tokens (its sequence shard), then tokens,
weights and choices are gathered as the dense MLP's input is (Megatron's f), each expert's I split
over tp (w1, w3 by rows, w2 by columns) and the output reduced (g).

Sources: Shazeer et al. 2017 (sparsely gated MoE); Jiang et al. 2024 (Mixtral); Fedus et al. 2021
(Switch: the balance loss, top-k routing); Lepikhin et al. 2020 (GShard: expert parallelism by
all-to-all).
"""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor


class Experts(nn.Module):
    """E SwiGLU MLPs, weights stacked: w1, w3 [E, I, h], w2 [E, h, I] (each expert's in nn.Linear's
    layout). parallel.py leaves a rank its E/ep experts, and its slice of each one's I under tp."""

    def __init__(self, config):
        super().__init__()
        E, h, I = config.n_experts, config.n_embd, config.moe_intermediate_size
        # model.py's init: N(0, 0.02), the projection into the residual stream scaled by depth
        down_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.w1 = nn.Parameter(torch.empty(E, I, h).normal_(std=0.02))  # gate
        self.w3 = nn.Parameter(torch.empty(E, I, h).normal_(std=0.02))  # up
        self.w2 = nn.Parameter(torch.empty(E, h, I).normal_(std=down_std))  # down

    def forward(self, x, counts):
        """x [n, h]: each expert's tokens one after the other, counts[e] of expert e's."""
        y = [F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
             for e, rows in enumerate(x.split(counts))]
        return torch.cat(y)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = Experts(config)
        # train.py: the aux loss's weight in the step's loss (1 / micro-batches, x fp16's scale)
        self.aux_weight = 1.0
        # for the log: the sum of the aux losses backward has seen (this rank's share), their count
        self.aux_loss = 0.0
        self.aux_count = 0

    # host-side split sizes in the middle: eager inside a compiled model
    @torch.compiler.disable
    def forward(self, x):
        logits = self.router(x).float()
        top, chosen = logits.topk(self.config.experts_per_token, dim=-1)
        # the k chosen weights: renormalised over them (Mixtral's, norm_topk_prob), or their
        # probabilities over all E (Qwen3-MoE's norm_topk_prob=False)
        weights = F.softmax(top, dim=-1)
        if not self.config.norm_topk_prob:
            weights = F.softmax(logits, dim=-1).gather(-1, chosen)
        weights = weights.to(x.dtype)
        y = self.route(x, chosen, weights)
        aux = balance_loss(logits, chosen, self.pair_counts(chosen))
        return _AuxLoss.apply(y, aux, self)

    def pair_counts(self, chosen):
        """The (token, expert) pairs of each expert in the micro-batch (fp32: the aux loss's f)."""
        E = self.config.n_experts
        # a histogram of the chosen experts, a bin each: its shape is known without the values (a
        # dry run's fake tensors), bincount's is not
        return torch.histc(chosen.float(), bins=E, min=0, max=E)

    def route(self, x, chosen, weights):
        """Each token's k experts' outputs, weighted and summed: like x."""
        k = self.config.experts_per_token
        tokens = x.flatten(0, -2)
        # the T·k (token, expert) pairs, grouped by expert; token order within an expert
        order = chosen.flatten().argsort(stable=True)
        token = order // k
        counts = expert_counts(chosen, self.config.n_experts)
        # (index_select: its backward adds the rows back by index_add; indexing's, index_put with
        # accumulate, took 8-10x the time on a 2-core CPU at [T·k, h] = [16,384, 128])
        y = self.dispatch(tokens.index_select(0, token), counts)
        y = y * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(tokens).index_add(0, token, y).view_as(x)

    def dispatch(self, x, counts):
        """The experts' outputs for x [T·k, h], grouped by expert (counts[e] rows of expert e): here
        (under ep, parallel.py's ParallelMoE sends them to the ranks that own them)."""
        return self.experts(x, counts)


def expert_counts(chosen, n_experts):
    """How many of the (token, expert) pairs go to each expert: a host list, the split sizes. In the
    dry run (fake tensors: shapes, no values) what balanced routing sends, which the aux loss trains
    toward."""
    pairs = chosen.numel()
    if isinstance(chosen, FakeTensor):
        return [pairs // n_experts + (e < pairs % n_experts) for e in range(n_experts)]
    return torch.bincount(chosen.flatten(), minlength=n_experts).tolist()


def balance_loss(logits, chosen, counts):
    """This rank's share of the header's aux loss, E · Σ_e f_e · P_e: f (counts, the pairs of each
    expert, no gradient) and T of the whole micro-batch, P summed over our tokens (the router's:
    under sp a tp rank's share of the sequence, else the ranks' copies are equal and autograd takes
    one). E is the count of counts, one an expert."""
    T = counts.sum() / chosen.shape[-1]
    probability = F.softmax(logits, dim=-1).flatten(0, -2).sum(0)
    return len(counts) * (counts * probability).sum() / T ** 2


class _AuxLoss(torch.autograd.Function):
    """y unchanged; its backward hands the aux loss its gradient, coef / n_layer times the step's
    weight, and adds the aux loss to the log (once per micro-batch: a recompute re-runs forward,
    not this backward)."""

    @staticmethod
    def forward(ctx, y, aux, moe):
        ctx.moe, ctx.aux = moe, aux.detach()
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        moe = ctx.moe
        moe.aux_loss += ctx.aux
        moe.aux_count += 1
        c = moe.config
        # (a mean over the MoE layers: Qwen3-MoE may keep some dense)
        layers = sum(map(c.is_moe, range(c.n_layer)))
        weight = c.router_aux_loss_coef / layers * moe.aux_weight
        return g, torch.full_like(ctx.aux, weight), None


def moe_layers(model):
    """The MoE layers of model (a stage's under pp)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def memory_terms(config, batch, sequence, b, t, ep, chunks, dense_chunks):
    """memory.py's terms for one layer's MoE (the header's; zeros for a dense model), b bytes an
    element, on a rank of `batch` sequences of `sequence` tokens, T = batch·sequence of them (under
    tp all t ranks' tokens, which the experts take): (the bytes it keeps per token beyond what
    offload.kept_bytes counts for a block, its backward's working set beyond what it keeps, the
    parameters of the experts the other ep ranks hold). The rows the rank's experts take when
    balanced: n = T·k (under ep its E/ep experts' share of the T·k pairs of each ep rank).
    `chunks`: the experts' mini-sequences over the n rows, `dense_chunks` a dense MLP's over one
    sequence (chunked.mlp_chunks of each: memory.py asks)."""
    k, E = config.experts_per_token, config.n_experts
    if not E:
        return 0, 0, 0
    h, I = config.n_embd, config.moe_intermediate_size / t
    T = batch * sequence
    n = T * k
    # the routed copies, the experts' outputs, their weighted copies (index_add keeps them); the
    # router's fp32 probabilities (its rank's tokens) and the pairs' three int64 indices
    kept = 3 * b * h * k + 4 * (E + k) / t + 24 * k
    if dense_chunks == 1:
        # offload.py counts a plain MLP's four [S, I] tensors (its own width): a block with an MoE
        # has none
        kept -= 4 * b * config.intermediate_size / t
    # the experts' backward: one chunk's three [n, I] buffers and a fourth (grouped_mm's dz, copied
    # into one: chunked.py's _mm) and the fp32 dW1..3 of the rank's E/ep experts, or (unchunked,
    # keeping four) two more [n, I] at once, of all n rows (one grouped GEMM)
    expert = 4 * b * I * math.ceil(n / chunks) + 12 * h * I * E / ep
    if chunks == 1:
        kept += 4 * b * I * k
        expert = 2 * b * I * n
    # the gradient coming in (under sp of all t ranks' tokens), and the larger of two [T·k, h]
    # copies (at its backward's start the gradients of two; under ep an all-to-all's send and
    # receive buffers) and the experts' backward (the copies weighed by then freed)
    backward = b * h * (1 / t + (t > 1)) * T + max(2 * b * h * n, expert)
    # of the experts a layer, the other ep ranks hold all but E/ep (with their states)
    away = 3 * h * I * E * (1 - 1 / ep)
    return kept, backward, away
