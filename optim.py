"""
AdamW, and what it keeps per parameter: Megatron's fp32 master weights, or the step inside backward.

Megatron's mixed precision (the default): bf16 weights, each gradient folded into an fp32 holder as
autograd makes it, AdamW on fp32 master weights and moments: 2 + 4 + 12 = 18 bytes per parameter
(fp32 runs: 4 + 4 + 8). zero=2, 3 (parallel.shard_states, FSDP2): the fp32 weights are the masters,
and each of d = dp·cp ranks keeps ⌈rows/d⌉ rows of them, of their gradients and of the moments:
16/d bytes, plus the block FSDP2 gathers in bf16 while it computes.

optimizer_in_backward=True (one rank; the Mini-Sequence Transformer's code, torch's "optimizer step
in backward" recipe): a post-accumulate-grad hook steps each parameter the moment its gradient is
whole and frees it, so a step's gradients never all exist; weights and moments stay bf16:
2 + 2 + 2 = 6 bytes per parameter. An update under half a bf16 spacing of its weight (2^-9 to 2^-8
of |w|) would round to nothing every step, so the step runs in fp32, STEP_CHUNK elements at a time,
each result rounded stochastically (up with probability the remainder's share of the spacing: exact
on average; Gupta et al. 2015, and for bf16 Zamirai et al. 2020, arXiv 2010.06192, who also weigh
Kahan summation at 2 more bytes). No step-wide gradient: no accumulation over micro-steps, no dp, cp
or tp reduction (train.py refuses them); grad_clip clips each tensor to its share,
grad_clip·sqrt(size/N), which bounds the global norm (stricter when one tensor spikes alone). A
non-finite gradient skips its parameter.
"""
import math

import torch

from parallel import local, shard_spec

# elements of a parameter stepped at once in backward: seven fp32 temporaries, 448 MiB
STEP_CHUNK = 1 << 24


def make_master_weights(model, in_backward=False):
    """The tensors whose .grad holds each parameter's step gradient: the parameters (fp32, or in
    backward), or for bf16 memory-less fp32 holders (stride-0 views of one zero; the masters live
    in the optimizer) into whose .grad a hook folds each bf16 gradient as autograd makes it:
    accumulated in fp32, no bf16 gradient outlives it."""
    params = list(model.parameters())
    if in_backward or all(p.dtype == torch.float32 for p in params):
        return params
    masters = [p.new_zeros((), dtype=torch.float32).expand(p.shape) for p in params]
    for p, m in zip(params, masters):
        def fold(p, m=m):
            m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
            p.grad = None
        p.register_post_accumulate_grad_hook(fold)
    return masters

def stochastic_round(x, dtype):
    """fp32 x as dtype; to bf16 (the top 16 bits of an fp32) up or down at random, up with
    probability (the low 16 bits) / 2^16: a uniform 16-bit integer added to the bits carries into
    the top half that often."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.view(torch.int32) + torch.randint_like(x, 1 << 16, dtype=torch.int32)
    # the low bits zero: the cast is exact
    return (bits & -65536).view(torch.float32).to(dtype)


class AdamW(torch.optim.AdamW):
    """torch's AdamW on fp32 rows: the parameters themselves when fp32 (zero=2, 3: a DTensor's
    ⌈rows/d⌉), or fp32 copies of bf16 ones (the masters), copied back after each step.
    named_params: this rank's; masters and groups: make_master_weights' and torch's, of them.
    in_backward: step_in_backward steps each as its gradient is made."""

    def __init__(self, named_params, masters, groups, mesh, config, in_backward=False,
                 max_norm=math.inf, **kw):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = masters
        self.in_backward = in_backward
        self.max_norm = max_norm
        # each parameter's rows that are not padding: the vocabulary's, ⌈V/t⌉ a tp rank, end at V
        V, per_rank = config.vocab_size, math.ceil(config.vocab_size / mesh.tp)
        vocab_rows = max(0, min(per_rank, V - mesh.tp_rank * per_rank))
        self.rows = [vocab_rows if shard_spec(n, config, mesh.tp) == (0, 'vocab') else p.shape[0]
                     for n, p in named_params]
        # What torch's AdamW steps. FSDP2's DTensors by their local rows: torch's AdamW on DTensors
        # of mixed placements gathers whole tensors.
        self.pieces = [local(p) if p.dtype == torch.float32 or in_backward else p.detach().float()
                       for p in self.params]
        self.numel = sum(x.numel() for x in self.pieces)
        piece_of = {id(m): x for m, x in zip(masters, self.pieces)}
        groups = [{**g, 'params': [piece_of[id(m)] for m in g['params']]} for g in groups]
        super().__init__(groups, **kw)
        # the state now, not in step 1: step 1's memory is every step's; DCP loads into it
        for g in self.param_groups:
            on_device = g['fused'] or g['capturable']
            for x in g['params']:
                step = torch.zeros((), device=x.device if on_device else 'cpu')
                self.state[x] = {'step': step, 'exp_avg': torch.zeros_like(x),
                                 'exp_avg_sq': torch.zeros_like(x)}
                if in_backward:
                    # x is the parameter itself (one rank, no FSDP2): its gradient's hook steps it
                    x.register_post_accumulate_grad_hook(lambda p, g=g: self.step_in_backward(p, g))

    @torch.no_grad()
    def step_in_backward(self, p, group):
        """AdamW on one parameter as torch's computes it, in fp32 a chunk at a time, rounded
        stochastically."""
        g, state, (b1, b2), lr = p.grad, self.state[p], group['betas'], group['lr']
        # freed when this returns: no other gradient of the step need exist beside it
        p.grad = None
        # a CPU tensor (fused=False)
        state['step'] += 1
        # bias corrections in fp64 as torch's, as tensors (fake in a dry run): no host sync
        k = state['step'].double()
        bc1, bc2 = 1 - b1 ** k, (1 - b2 ** k).sqrt()
        # (summed in fp32 inside, no fp32 copy of g)
        norm = torch.linalg.vector_norm(g).float()
        # else this parameter stays as it was: on the device, no host sync
        ok = norm.isfinite()
        # clipped to its share of grad_clip, max_norm·sqrt(its size / all): if every tensor keeps to
        # it, the whole does
        share = self.max_norm * math.sqrt(g.numel() / self.numel)
        coef = (share / (norm + 1e-6)).clamp(max=1.0)
        tensors = (p, state['exp_avg'], state['exp_avg_sq'], g)
        chunks = (y.view(-1).split(STEP_CHUNK) for y in tensors)
        for w, m, v, gc in zip(*chunks):
            # fp32 copies (of fp32 ones too: kept if not ok)
            gf, wf, mf, vf = (y.to(torch.float32, copy=True) for y in (gc, w, m, v))
            # the clipped gradient
            mf.lerp_(gf.mul_(coef), 1 - b1)
            vf.mul_(b2).addcmul_(gf, gf, value=1 - b2)
            # mf / denom: -lr · m̂ / (√v̂ + eps)
            denom = (vf.sqrt() / bc2).add_(group['eps']).mul_(-bc1 / lr)
            wf.mul_(1 - lr * group['weight_decay']).addcdiv_(mf, denom)
            for old, new in ((w, wf), (m, mf), (v, vf)):
                old.copy_(torch.where(ok, stochastic_round(new, old.dtype), old))

    @torch.no_grad()
    def step(self):
        if self.in_backward:
            return
        for m, x in zip(self.masters, self.pieces):
            # (the same tensor when the parameters are fp32)
            x.grad = local(m.grad)
        super().step()
        for p, x in zip(self.params, self.pieces):
            # the bf16 weights from their fp32 masters
            if x.dtype != p.dtype:
                p.copy_(x)

    def zero_grad(self, set_to_none=True):
        for t in self.masters + self.pieces:
            t.grad = None
