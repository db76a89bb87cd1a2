"""
Pipeline parallelism: this rank's stage of the model (parallel.parallelize kept its blocks),
driven through a step's micro-batches by torch's own schedule (torch.distributed.pipelining), 1F1B
or GPipe.

Stage r of p receives the activations of stage r - 1, runs its blocks and sends its output on;
backward returns the gradients the other way (parallel.py's header: what moves, the bubble, when pp
pays). A schedule is the order of those forwards and backwards over the M micro-batches
(gradient_accumulation_steps), and with it how many are in flight on a stage (forwarded, their
activations kept, not yet backward):

  GPipe (Huang et al. 2019)       every forward, then every backward: M in flight on every stage
  1F1B (Narayanan et al. 2021)    stage r forwards p - r micro-batches, then alternates one
                                  backward, one forward: min(M, p - r) in flight, p on the first

So pp divides the model states by p but not the activations: the first stage keeps p micro-batches
of L/p blocks, one micro-batch's worth of all L blocks, as a rank without pp (Korthikanti et al.
2022). memory.py counts F in flight; the dry run runs a stage's forwards and backwards in the
schedule's order itself (Pipeline.fake_step): torch's schedule can't start on fake tensors or a fake
process group, its warm-up exchanges shapes with the other stages.

What a stage's blocks need besides the activations travels as keyword arguments, which the schedule
splits by rows as it splits the batch: RoPE's positions of each micro-batch and, for packed
documents (doc_mask), a boolean row per sequence that marks its documents' first tokens (_starts);
every stage has them, so each micro-batch attends within its own documents.
"""
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import parallel


def _positions(x, positions):
    """RoPE's positions of tokens x [B, S] (the cp shard's, or 0 .. S-1), a row per sequence: x's,
    not a stage's input's, which under sp holds S/t of them."""
    if positions is None:
        return torch.arange(x.shape[1], device=x.device).expand(len(x), -1)
    return positions


def _starts(x, docs, cp):
    """doc_mask's documents (docs: their starts in the flattened rows) as rows torch's schedule can
    split as it splits x: True at each document's first token of the rows' whole sequences
    (x's tokens · cp), a numpy array. None without."""
    if docs is None:
        return None
    starts = np.zeros(x.numel() * cp, dtype=bool)
    starts[docs] = True
    return starts.reshape(len(x), -1)


class Pipeline(nn.Module):
    """This rank's stage for torch's schedule: its forwards under autocast with the positions; the
    last stage's loss_fn: the LM head and loss of a micro-batch, weighted as
    train.forward_backward weighs one."""

    def __init__(self, model, mesh, schedule, microbatches, autocast, device):
        super().__init__()
        self.model, self.mesh, self.autocast = model, mesh, autocast
        self.first, self.last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp - 1
        # what moves between the stages
        self.dtype = getattr(autocast, 'fast_dtype', torch.float32)  # (nullcontext: fp32)
        # micro-batches in flight on this stage (the header)
        self.in_flight = (min(microbatches, mesh.pp - mesh.pp_rank) if schedule == '1f1b'
                          else microbatches)
        stage = PipelineStage(self, mesh.pp_rank, mesh.pp, device, group=mesh.pp_group)
        kind = Schedule1F1B if schedule == '1f1b' else ScheduleGPipe
        # scale_grads=False: forward's weights already make the sum of the micro-batches' losses
        # the step's mean
        self.schedule = kind(stage, microbatches, loss_fn=lambda h, y: self(h, targets=y),
                             scale_grads=False)

    def forward(self, x, positions=None, targets=None, starts=None):
        """The stage's blocks on x (starts: _starts'); with targets (the last stage's loss_fn), the
        LM head's loss of x, weighted by its share of the step's count of targets, scaled."""
        with self.autocast:
            if targets is None:  # contiguous: what a stage sends and receives is flat memory
                docs = None if starts is None else np.flatnonzero(starts)
                return self.model(x, positions=positions, docs=docs, head=False).contiguous()
            loss = self.model.output(x, targets)[1] * ((targets != -100).sum() / self.count)
            return self.scaler.scale(loss)

    def step(self, micro_batches, count, scaler, fake=False):
        """Every micro-batch's forward and backward, in torch's schedule: the sum of their weighted
        losses times the loss scale (scaler: optim.LossScaler; what backward runs on) on the last
        stage, 0 before it. micro_batches: (x, y, positions, docs) each; count: the step's targets.
        fake (the dry run): fake_step in the schedule's stead."""
        self.count, self.scaler = count, scaler
        losses = []  # the last stage's, one per micro-batch
        if fake:
            self.fake_step(micro_batches, losses)
        else:
            # the micro-batches as one batch, as torch's schedule takes it: it splits every input
            # by rows, each micro-batch's positions and documents with its tokens
            xs, ys, positions, docs = zip(*micro_batches)
            kwargs = dict(positions=torch.cat([_positions(x, p) for x, p in zip(xs, positions)]))
            if docs[0] is not None:  # doc_mask: a tensor, or the schedule won't split it
                starts = [_starts(x, d, self.mesh.cp) for x, d in zip(xs, docs)]
                kwargs['starts'] = torch.from_numpy(np.concatenate(starts))
            # x: the first stage's input (torch's schedule gives a later stage the one before's
            # output); y: the last stage's targets
            self.schedule.step(torch.cat(xs), target=torch.cat(ys), losses=losses, **kwargs)
        return sum(losses, torch.zeros((), device=micro_batches[0][0].device))

    def fake_step(self, micro_batches, losses):
        """The dry run's step (the header): this stage's forwards and backwards of the
        micro-batches, run by hand in the schedule's order. The stage runs alone: what it would
        receive is an empty tensor, the gradient from the stage after too; what it would send is
        dropped. The last stage's losses go to losses."""
        # In the schedule's order, F = self.in_flight (1F1B: min(M, p - r); GPipe: M):
        #   1. forward micro-batch i, keeping its output (its activations live until its backward)
        #   2. once F are kept, backward the oldest (micro-batch i - F + 1): F in flight at most
        #   3. after the last forward, backward every kept one, oldest first (1F1B's cool-down)
        kept = []
        for i, (x, y, positions, docs) in enumerate(micro_batches):
            h = x if self.first else self.received(x).requires_grad_()
            out = self(h, _positions(x, positions), starts=_starts(x, docs, self.mesh.cp))
            if self.last:  # the LM head and loss too
                out = self(out, targets=y)
            kept.append(out)
            while len(kept) == self.in_flight or kept and i == len(micro_batches) - 1:
                out = kept.pop(0)
                out.backward(None if self.last else torch.empty_like(out))
                if self.last:
                    losses.append(out.detach())

    def received(self, x):
        """What the stage before sends for tokens x: its activations (sp's shard of them)."""
        return x.new_empty(len(x), x.shape[1] // self.mesh.tp, self.model.config.n_embd,
                           dtype=self.dtype)

    @torch.no_grad()
    def hidden(self, x, positions=None, docs=None, fake=False):
        """One batch forward only, the stages in turn (a schedule of one micro-batch): the last
        stage's output, the LM head's input; None on the stages before it. fake (eval.py's dry
        run): the stage alone, as fake_step runs it."""
        rank, group = self.mesh.pp_rank, self.mesh.pp_group
        h = x
        if not self.first:  # the stage before's output
            h = self.received(x)
            if not fake:
                dist.recv(h, group_src=rank - 1, group=group)
        out = self(h, _positions(x, positions), starts=_starts(x, docs, self.mesh.cp))
        if self.last:
            return out
        if not fake:
            dist.send(out, group_dst=rank + 1, group=group)
        return None

    @torch.no_grad()
    def evaluate(self, x, y, positions=None, docs=None):
        """The loss of one batch, on every stage (hidden's forward)."""
        out = self.hidden(x, positions, docs)
        loss = torch.zeros((), device=x.device)
        if self.last:
            with self.autocast:
                loss = self.model.output(out, y)[1].float()
        return parallel.all_reduce(loss, self.mesh.pp_group)  # the last stage's, on every stage
