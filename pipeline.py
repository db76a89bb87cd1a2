"""
Pipeline parallelism: this rank's stage of the model (parallel.parallelize kept its blocks), driven through a step's
micro-batches by torch's own schedule (torch.distributed.pipelining), 1F1B or GPipe.

Stage r of p receives the activations of stage r - 1, runs its blocks and sends its output on; backward returns
the gradients the other way (parallel.py's header: what moves, the bubble, when pp pays). A schedule is the order
of those forwards and backwards over the M micro-batches (gradient_accumulation_steps), and with it how many are
in flight on a stage (forwarded, their activations kept, not yet backward):

  GPipe (Huang et al. 2019)            every forward, then every backward: M in flight on every stage
  1F1B (Narayanan et al. 2021)         stage r forwards p - r micro-batches, then alternates one backward, one
                                       forward: min(M, p - r) in flight, p on the first stage

So pp divides the model states by p but not the activations: the first stage keeps p micro-batches of L/p blocks,
one micro-batch's worth of all L blocks, as a rank without pp (Korthikanti et al. 2022). memory.py counts F in flight;
the dry run runs a stage's forwards and backwards in the schedule's order itself (Pipeline.step(fake=True)): torch's
schedule can't start on fake tensors or a fake process group: its warm-up exchanges shapes with the other stages.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import parallel


class Pipeline(nn.Module):
    """This rank's stage for torch's schedule: its forwards under autocast with the positions (RoPE's; the cp shard's);
    the last stage's loss_fn: the LM head and loss of a micro-batch, weighted as train.forward_backward weighs one."""

    def __init__(self, model, mesh, schedule, microbatches, autocast, device):
        super().__init__()
        self.model, self.mesh, self.autocast, self.count = model, mesh, autocast, 1
        self.dtype = autocast.fast_dtype if isinstance(autocast, torch.autocast) else torch.float32  # what moves
        self.in_flight = min(microbatches, mesh.pp - mesh.pp_rank) if schedule == '1f1b' else microbatches  # header
        stage = PipelineStage(self, mesh.pp_rank, mesh.pp, device, group=mesh.pp_group)
        # scale_grads=False: the weights below already make the sum of the micro-batches' losses the step's mean
        kind = Schedule1F1B if schedule == '1f1b' else ScheduleGPipe
        self.schedule = kind(stage, microbatches, loss_fn=lambda h, y: self(h, targets=y), scale_grads=False)

    def forward(self, x, positions=None, targets=None):  # targets: the last stage's loss_fn (above)
        with self.autocast:
            if targets is None:  # (contiguous: what a stage sends and receives is flat memory)
                return self.model(x, positions=positions).contiguous()
            return self.model.head(x, targets)[1] * ((targets != -100).sum() / self.count)

    def step(self, micro_batches, count, fake=False):
        """Every micro-batch's forward and backward; the sum of their weighted losses on the last stage, 0 before it.
        fake (the dry run, header) runs this stage's part itself: i's backward after forward i + in_flight - 1."""
        first, last, self.count = self.mesh.pp_rank == 0, self.mesh.pp_rank == self.mesh.pp - 1, count
        x, y = (torch.cat(t) for t in list(zip(*micro_batches))[:2])
        pos = micro_batches[0][2]  # the same for every micro-batch (doc_mask is refused); torch splits tensors by rows
        pos = (torch.arange(x.shape[1], device=x.device) if pos is None else pos).expand(len(x), -1)
        losses, kept = [], []
        if not fake:
            self.schedule.step(*[x] * first, target=y if last else None, losses=losses if last else None, positions=pos)
        for i, (x_i, y_i, *_) in enumerate(micro_batches if fake else []):
            h = x_i if first else self.received(x_i).requires_grad_()
            kept.append(self(self(h, pos[:len(h)]), targets=y_i) if last else self(h, pos[:len(h)]))
            while len(kept) == self.in_flight or kept and i == len(micro_batches) - 1:
                out = kept.pop(0)
                out.backward(None if last else torch.empty_like(out))  # (the next stage's gradient)
                last and losses.append(out.detach())
        return sum(losses) if last else torch.zeros((), device=x.device)

    def received(self, x):  # what the stage before sends for tokens x: its activations, sp's shard of them under tp
        return torch.empty(*x.shape[:-1], x.shape[-1] // self.mesh.tp, self.model.config.n_embd, dtype=self.dtype,
                           device=x.device)

    @torch.no_grad()
    def evaluate(self, x, y, positions=None):
        """The loss of one batch, on every stage: forward only, the stages in turn (a schedule of one micro-batch)."""
        r, group = self.mesh.pp_rank, self.mesh.pp_group
        h = x if r == 0 else self.received(x)
        r == 0 or dist.recv(h, group_src=r - 1, group=group)
        out = self(h, torch.arange(x.shape[1], device=x.device) if positions is None else positions)  # x's, not h's
        r == self.mesh.pp - 1 or dist.send(out, group_dst=r + 1, group=group)
        with self.autocast:
            loss = self.model.head(out, y)[1].float() if r == self.mesh.pp - 1 else torch.zeros((), device=x.device)
        return parallel.all_reduce(loss, group)
