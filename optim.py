"""
The optimizer step and what it keeps per parameter: torch's optimizers on fp32 master weights
(AdamW, or Muon for the blocks' matrices), fp16's loss scaler, or our own AdamW inside backward.

MasterWeights (Megatron's mixed precision, the default): bf16 weights, fp32 copies of them (the
masters), each bf16 gradient folded into its master's fp32 .grad as autograd makes it
(make_master_weights), torch's optimizers stepping the masters, copied back into the bf16 weights
after each step:
2 + 4 + 4 + s bytes per parameter, s the optimizer's own state (STATE_BYTES): AdamW's two moments
8 (18 in all), Muon's momentum 4. fp32 runs: 4 + 4 + s, the weights their own masters. zero=2, 3
(parallel.shard_states, FSDP2): the fp32 weights are the masters, and each of d = dp·cp ranks keeps
⌈rows/d⌉ rows of them, of their gradients and of the moments: (4 + 4 + 8)/d bytes, plus the block
FSDP2 gathers in bf16 while it computes. torch's optimizer steps each DTensor's local rows: on
DTensors of mixed placements it would gather whole tensors.

Muon (optimizer='muon'; Jordan 2024, torch.optim.Muon): the gradient's momentum, orthogonalized by
five Newton-Schulz iterations, is the update of each 2D matrix of the blocks (wq, wk, wv, wo, w1,
w2, w3); AdamW steps the embedding, the LM head, the norms and MoE's router and experts (stacked
3D: a fork could give Muon each expert's matrix), as Moonlight (Liu et al. 2025, arXiv 2502.16982)
and Kimi K2 train. adjust_lr_fn='match_rms_adamw' scales its update to AdamW's RMS (0.2·√max(A, B)
times the lr), so one learning rate and weight decay serve both. Its state is 4 bytes a matrix
parameter, half AdamW's. Newton-Schulz needs a whole matrix: tp and zero=2, 3 split them (train.py
refuses them); dp, pp, cp and ep keep them whole.

Every state is made when the optimizer is built (new_state), not in its first step as torch makes
it: step 1's memory is every step's, and a resumed run's DCP load fills it (a state made lazily
would start again from zero, silently).

LossScaler (dtype float16; Micikevicius et al. 2018): fp16 has 5 exponent bits to bf16's 8, so
gradients under 2^-24 would flush to zero; backward runs on the loss times a scale (2^16 at first)
and the gradients are divided by it before clipping. GradScaler's verbs and rule: scale(loss),
unscale_(masters), step(optimizer, ...) skipped on an overflow, update() halving the scale then
and doubling it after SCALE_GROWTH clean steps in a row. Ours, not torch's GradScaler or
ShardedGradScaler: found_inf is whether the loss or the clipped norm is finite, a norm already
summed over every shard (tp, pp, FSDP2's rows), so every rank of every layout skips the same steps
with no collective of its own; the scale has a floor of 1, where an overflow is a non-finite step
like any (train.check_finite stops a run after a few in a row); the checkpoint keeps [scale,
clean steps]. On the device, no host sync: a fused AdamW reads found_inf itself; others (Muon)
wait for it on the host, as GradScaler makes them (one sync a step). With bf16 or fp32 its scale
is 1, and it still skips a non-finite step.

AdamWInBackward (optimizer_in_backward=True, one rank; the Mini-Sequence Transformer's code,
torch's "optimizer step in backward" recipe): a post-accumulate-grad hook steps each parameter the
moment its gradient is whole and frees it, so a step's gradients never all exist; weights and
moments stay bf16: 2 + 2 + 2 = 6 bytes per parameter. An update under half a bf16 spacing of its
weight (2^-9 to 2^-8 of |w|) would round to nothing every step, so the step runs in fp32,
STEP_CHUNK elements at a time, each result rounded stochastically (up with probability the
remainder's share of the spacing: exact on average; Gupta et al. 2015, and for bf16 Zamirai et al.
2020, arXiv 2010.06192, who also weigh Kahan summation at 2 more bytes). No step-wide gradient: no
accumulation over micro-steps, no dp, cp or tp reduction (train.py refuses them); grad_clip clips
each tensor to its share, grad_clip·sqrt(size/N), which bounds the global norm (stricter when one
tensor spikes alone). A non-finite gradient skips its parameter.
"""
import math

import torch

from parallel import local, shard_spec

# elements of a parameter stepped at once in backward: seven fp32 temporaries, 448 MiB
STEP_CHUNK = 1 << 24
# the optimizer's own state, fp32 bytes per parameter it steps (memory.py's formula): AdamW's two
# moments; Muon's momentum, for the parameters muon_steps names (AdamW's for the rest)
STATE_BYTES = {'adamw': 8, 'muon': 4}
SCALE_GROWTH = 2000  # fp16: clean steps in a row that double the loss scale (GradScaler's)


def make_master_weights(model, in_backward=False):
    """The tensors whose .grad holds each parameter's step gradient, which torch's optimizers step
    (their local rows under FSDP2): the parameters (fp32, or in backward), or for bf16 their fp32
    copies, the master weights, into whose .grad a hook folds each bf16 gradient as autograd makes
    it: accumulated in fp32, no bf16 gradient outlives it."""
    params = list(model.parameters())
    if in_backward or all(p.dtype == torch.float32 for p in params):
        return params
    masters = [p.detach().float() for p in params]
    for p, m in zip(params, masters):
        def fold(p, m=m):
            m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
            p.grad = None
        p.register_post_accumulate_grad_hook(fold)
    return masters


def muon_steps(name, x):
    """Whether Muon steps this parameter: a 2D matrix of a block, not MoE's router."""
    return x.dim() == 2 and name.startswith('layers.') and not name.endswith('router.weight')


def optimizer_bytes(config, name, b, N, layers):
    """memory.py's optimizer bytes of N parameters of b bytes each, the blocks `layers` among them:
    the state of optimizer `name` (STATE_BYTES; under Muon AdamW's for all but the blocks'
    matrices) + a bf16 run's fp32 master weights."""
    h, kv = config.n_embd, config.n_kv_head * config.head_dim
    q = config.n_head * config.head_dim
    # the parameters of a block Muon steps (muon_steps'): attention's four matrices, a dense MLP's
    # three (an MoE's experts are stacked [E, ...]: AdamW's; so are biases and norms)
    I = config.intermediate_size
    matrices = sum(2 * h * q + 2 * h * kv + 3 * h * I * (not config.is_moe(i)) for i in layers)
    # (under AdamW the difference of states is 0: no matrix term)
    adamw = STATE_BYTES['adamw']
    return (adamw + 4 * (b == 2)) * N - (adamw - STATE_BYTES[name]) * matrices


def new_state(optimizer, group, x):
    """x's state in optimizer as its first step would make it: zeros (AdamW's step count where its
    step reads it: on the device when fused)."""
    if isinstance(optimizer, torch.optim.Muon):
        return {'momentum_buffer': torch.zeros_like(x)}
    step = torch.zeros((), device=x.device if group.get('fused') else 'cpu')
    return {'step': step, 'exp_avg': torch.zeros_like(x), 'exp_avg_sq': torch.zeros_like(x)}


class MasterWeights:
    """torch's optimizers (or AdamWInBackward) on this rank's pieces of the master weights, the
    bf16 weights copied from them after each step. named_params: this rank's; masters:
    make_master_weights'; pieces: what the optimizers step, one per parameter: the masters, or
    FSDP2's local rows of them. state and param_groups are the optimizers' (checkpoint.py, the lr
    schedule); rows: each piece's rows that are not the vocabulary's padding."""

    def __init__(self, named_params, masters, pieces, optimizers, mesh, config):
        # (the pairs unzipped)
        self.names, self.params = map(list, zip(*named_params))
        self.masters, self.pieces, self.optimizers = masters, pieces, optimizers
        # each parameter's rows that are not padding: the vocabulary's, ⌈V/t⌉ a tp rank, end at V
        V = config.vocab_size
        per_rank = math.ceil(V / mesh.tp)
        vocab_rows = max(0, min(per_rank, V - mesh.tp_rank * per_rank))
        self.rows = [vocab_rows if shard_spec(n, config, mesh.tp) == (0, 'vocab') else p.shape[0]
                     for n, p in named_params]
        # the state now, not in step 1: step 1's memory is every step's; DCP loads into it
        self.state, self.param_groups = {}, []
        for opt in optimizers:
            self.param_groups += opt.param_groups
            for group in opt.param_groups:
                for x in group['params']:
                    self.state[x] = opt.state[x] = new_state(opt, group, x)

    @torch.no_grad()
    def step(self, found_inf=None):
        """Each optimizer's step, skipped where found_inf is 1 (LossScaler's; None: taken), then
        the model's weights from their masters."""
        if isinstance(self.optimizers[0], AdamWInBackward):
            return  # backward took every parameter's step
        for m, x in zip(self.masters, self.pieces):
            if x is not m:  # FSDP2's DTensor: its gradient's local rows are its piece's
                x.grad = local(m.grad)
        for opt in self.optimizers:
            if opt.defaults.get('fused'):
                # fused AdamW reads found_inf on the device, as GradScaler hands it over: 1 skips
                # the whole update, weight decay and step count
                opt.found_inf = found_inf
            elif found_inf is not None and found_inf.item():
                continue  # the others skip on the host
            opt.step()
        for p, x in zip(self.params, self.pieces):
            # the bf16 weights from their fp32 masters
            if x.dtype != p.dtype:
                p.copy_(x)

    def zero_grad(self, set_to_none=True):
        for t in self.masters + self.pieces:
            t.grad = None


class LossScaler:
    """fp16's dynamic loss scale with GradScaler's verbs (the header); enabled=False (bf16, fp32):
    a scale of 1, a non-finite step still skipped. state: a checkpoint's [scale, clean steps]
    (None: 2^16 and 0). factor: the scale (a tensor on the device, or 1.0); skipped: the steps
    skipped in a row that count toward stopping (train.check_finite)."""

    def __init__(self, enabled=False, device='cpu', state=None):
        self.enabled = enabled
        self.factor, self.clean, self.found_inf, self.skipped = 1.0, None, None, 0
        if enabled:
            # [scale, clean steps]: two fp32 scalars on the device
            self.factor, self.clean = torch.tensor(state or [2.0 ** 16, 0], dtype=torch.float32,
                                                   device=device)

    def scale(self, loss):
        """What backward runs on: loss times the scale."""
        if not self.enabled:
            return loss
        return loss * self.factor

    def unscale_(self, masters):
        """The gradients of the loss itself, in fp32, in place."""
        if not self.enabled:
            return
        for m in masters:
            local(m.grad).div_(self.factor)

    def step(self, optimizer, *checks):
        """optimizer.step, skipped if any of checks (the loss, the gradient norm) is not finite:
        found_inf, on the device (no checks: None, the step taken)."""
        self.found_inf = None
        if checks:
            self.found_inf = torch.stack([~t.isfinite() for t in checks]).any().float()
        optimizer.step(self.found_inf)

    def update(self):
        """After the step: fp16's scale halved if it was skipped, doubled after SCALE_GROWTH clean
        steps, at least 1; skipped counted in a row (in fp16 once the scale is at its floor). On
        the device, no host sync."""
        if self.found_inf is None:
            return
        # (bf16, fp32: the factor is 1, every skipped step counts)
        stops = self.found_inf * (self.factor <= 1)
        if self.enabled:
            self.clean = (self.clean + 1) * (1 - self.found_inf)
            grow = self.clean >= SCALE_GROWTH
            # halved on an overflow (found_inf 1), doubled on growth (grow 1): powers of two, exact
            self.factor = (self.factor / (1 + self.found_inf) * (1 + grow)).clamp(min=1.0)
            self.clean = self.clean * ~grow
        self.skipped = (self.skipped + 1) * stops

    def state(self):
        """fp16's [scale, clean steps] for the checkpoint (resume continues both), else None."""
        if not self.enabled:
            return None
        return [self.factor.item(), self.clean.item()]


def stochastic_round(x, dtype):
    """fp32 x as dtype; to bf16 (the top 16 bits of an fp32) up or down at random, up with
    probability (the low 16 bits) / 2^16: a uniform 16-bit integer added to the bits carries into
    the top half that often."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.view(torch.int32) + torch.randint_like(x, 1 << 16, dtype=torch.int32)
    # the low bits zero: the cast is exact
    return (bits & -65536).view(torch.float32).to(dtype)


class AdamWInBackward(torch.optim.Optimizer):
    """Our AdamW, each parameter (bf16 or fp32: stepped in place) stepped by its gradient's hook
    as backward makes it, as torch's AdamW computes it; its state made by MasterWeights, which
    wraps it. max_norm: grad_clip (each tensor clipped to its share, the header). Each group
    holds its weight decay (train.make_optimizer's); eps is torch's AdamW's."""

    def __init__(self, groups, max_norm=math.inf, lr=1e-3, betas=(0.9, 0.999)):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=1e-8))
        self.max_norm = max_norm
        self.numel = 0  # (every group's elements: each tensor's share of max_norm)
        for group in self.param_groups:
            for x in group['params']:
                self.numel += x.numel()
                x.register_post_accumulate_grad_hook(lambda p, g=group: self.step_param(p, g))

    def step(self, closure=None):
        """Nothing left to do: backward took every parameter's step."""

    @torch.no_grad()
    def step_param(self, p, group):
        """AdamW on one parameter as torch's computes it, in fp32 a chunk at a time, rounded
        stochastically."""
        g, state, (b1, b2), lr = p.grad, self.state[p], group['betas'], group['lr']
        # freed when this returns: no other gradient of the step need exist beside it
        p.grad = None
        # a CPU tensor (not fused)
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
        tensors = (g, p, state['exp_avg'], state['exp_avg_sq'])
        for chunk in zip(*(y.view(-1).split(STEP_CHUNK) for y in tensors)):
            # fp32 copies (of fp32 ones too: kept if not ok)
            gf, wf, mf, vf = (y.to(torch.float32, copy=True) for y in chunk)
            # the clipped gradient
            mf.lerp_(gf.mul_(coef), 1 - b1)
            vf.mul_(b2).addcmul_(gf, gf, value=1 - b2)
            # mf / denom: -lr · m̂ / (√v̂ + eps)
            denom = (vf.sqrt() / bc2).add_(group['eps']).mul_(-bc1 / lr)
            wf.mul_(1 - lr * group['weight_decay']).addcdiv_(mf, denom)
            # back into the weight's, m's and v's chunks (chunk[0]: the gradient's)
            for old, new in zip(chunk[1:], (wf, mf, vf)):
                old.copy_(torch.where(ok, stochastic_round(new, old.dtype), old))
