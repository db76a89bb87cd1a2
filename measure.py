"""
Memory, measured: torch's MemTracker over one step, read as memory.py's categories at the step's peak (what
memory.py's formula is checked against, on the device or the dry run's fake tensors), and the anatomy of that
peak (train.py's dry_run_anatomy): the tensors alive at it, largest first, each with the op and module that
made it, so a forker sees where a change's bytes went. The dry run's model and batch are fake tensors (to_fake,
fake_batch): shapes without data, on the CPU.
"""
import warnings
import weakref
from contextlib import ExitStack

import torch

import offload
import parallel


class Tracker(ExitStack):  # entered, it enters MemTracker and hooks (a hook's handle removes it): left, last first
    """The header's MemTracker (.breakdown()) and anatomy (.at_peak, if anatomy). masters: train.py's fp32 gradient
    holders when they are not the parameters; inputs: tensors made before the step that it uses (the batch)."""

    def __init__(self, model, masters=(), optimizer=None, inputs=(), device=torch.device('cpu'), anatomy=False,
                 states_on_host=False):
        super().__init__()
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.mod_tracker import ModTracker  # MemTracker's own: holds no tensor alive

        class Anatomy(MemTracker):  # it updates its peak as an op returns: look then
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                return self.look(func, super().__torch_dispatch__(func, types, args, kwargs), args, kwargs)
        if device.type == 'cuda' and device.index is None:  # MemTracker's keys are the tensors' devices: cuda:N
            device = torch.device('cuda', torch.cuda.current_device())
        self.mt, self.root, self.device = (Anatomy if anatomy or states_on_host else MemTracker)(), model, device
        self.inputs, self.optimizer, self.params = list(inputs), optimizer, list(model.parameters())
        self.mods, self.made, self.top, self.at_peak, self.moment = ModTracker() if anatomy else None, {}, -1, [], ''
        # offload_states: FSDP2's rows, their gradients (the host's at the device's peak) and AdamW's moments (local: a
        # DTensor's storage is the whole tensor's) are host memory; the device's peak is before AdamW's step
        self.on_host = [p.to_local() for p in self.params] if states_on_host else []
        self.moments = [v.to_local() if hasattr(v, 'to_local') else v for st in getattr(optimizer, 'state', {}).values()
                        for v in st.values()] * states_on_host
        self.host_grads, self.before_step = 0, None
        self.masters = [m for m in masters if all(m is not p for p in self.params)]
        # optim.AdamW's fp32 master rows, unless they are views of fp32 parameters: optimizer bytes
        own = [parallel.local(p).untyped_storage() for p in self.params]
        self.state = [x for x in getattr(optimizer, 'pieces', ()) if all(x.untyped_storage() is not s for s in own)]
        self.mt.track_external(model, *self.state, *self.inputs, *([optimizer] if optimizer is not None else []))

    def __enter__(self):
        # train.py writes a master's .grad after autograd's hook: register it then
        for p, m in zip(self.params, self.masters):
            self.enter_context(p.register_post_accumulate_grad_hook(lambda p, m=m: self.mt.track_external(m.grad)))
        # MemTracker refuses a second forward of the model (gradient accumulation) unless the model's statistics,
        # which we don't read, are dropped first (its blocks' stay: pp's backward of an earlier one finds them)
        self.enter_context(torch.nn.modules.module.register_module_forward_pre_hook(  # (returns None: the args stay)
            lambda m, args: self.mt.memory_tracking.pop(m, None) and None if m is self.root else None))
        self.enter_context(warnings.catch_warnings())
        warnings.filterwarnings('ignore', message='Expected a tensor')  # its own hook sees .grad = None after ours
        self.mods and self.enter_context(self.mods)
        if self.on_host:  # AdamW steps on the host (torch's AdamW.step fires the hook too: the first call counts)
            self.enter_context(self.optimizer.register_step_pre_hook(  # the device's peak: MemTracker's before it
                lambda *_: self.before_step or setattr(self, 'before_step', self.mt.get_tracker_snapshot('peak'))))
        self.enter_context(self.mt)
        return self

    def look(self, func, out, args, kwargs):
        """Note each storage on our device an op makes (not one of its inputs': a view, in place), what made it
        and its category (made in forward: activations; in backward, a recompute's too, or by the optimizer:
        transient; or grads); at a new peak of MemTracker's, the one breakdown reads, keep those alive, and
        the bytes of the host gradients then (offload_states)."""
        total = self.mt.get_tracker_snapshot().get(self.device, {}).get('Total', 0)
        peak = total > self.top and self.before_step is None  # (offload_states: AdamW's step is on the host)
        self.top = max(self.top, total)
        if peak and self.on_host:
            self.host_grads = sum(p.grad.to_local().nbytes for p in self.params if p.grad is not None)
        if self.mods is None:  # no anatomy
            return out
        ours = lambda xs: {id(t.untyped_storage()): t for x in xs for t in (x if isinstance(x, (tuple, list)) else [x])
                           if isinstance(t, torch.Tensor) and t.device == self.device}
        where = max(self.mods.parents, key=lambda m: (m.count('.'), m)) + (' (backward)' if self.mods.is_bw else '')
        step = 'transient' if self.mods.is_bw or not torch.is_grad_enabled() else 'activations'
        given = ours([*args, *(kwargs or {}).values()])
        for k, t in ours([out]).items():
            if k not in given and k not in self.made:  # dropped as it is freed: a freed storage's id is reused
                info = dict(category=step, dtype=str(t.dtype)[6:], shape=list(t.shape), op=str(func), module=where)
                self.made[k] = (weakref.ref(t.untyped_storage(), lambda _, k=k: self.made.pop(k, None)), info)
        if peak:
            grads = {id(p.grad.untyped_storage()) for p in self.params + self.masters if p.grad is not None}
            host = {id(b.untyped_storage()) for b in offload.host_buffers()}  # host memory, even on a CPU
            self.moment = f"{func} in {where}"
            self.at_peak = sorted(({**info, 'bytes': st.nbytes()} | ({'category': 'grads'} if k in grads else {})
                                   for k, (ref, info) in list(self.made.items()) if (st := ref()) is not None
                                   and k not in host), key=lambda x: -x['bytes'])
        return out

    def breakdown(self):
        snap = self.before_step or self.mt.get_tracker_snapshot('peak')
        snap = {getattr(k, 'value', k): v for k, v in snap.get(self.device, {}).items()}
        # each storage once (views share one), the storages kept alive while compared: a freed one's id is reused
        nbytes = lambda ts: sum({id(s): s.nbytes() for s in [t.untyped_storage() for t in ts]}.values())
        masters, inputs = nbytes(self.state), nbytes(self.inputs)
        pool, rows, moments = nbytes(offload.host_buffers()), nbytes(self.on_host), nbytes(self.moments)
        self.host = pool + 2 * rows + moments  # the rows and, by the step, every gradient's
        cpu = self.device.type == 'cpu'  # then MemTracker counted the host's tensors with ours: taken out
        out = {'params': snap.get('Parameter', 0) + snap.get('Buffer', 0) - rows * cpu,
               'grads': snap.get('Gradient', 0) + snap.get('Other', 0) - masters - inputs - self.host_grads * cpu,
               'optimizer': snap.get('Optstate', 0) + masters - moments * cpu,
               'activations': snap.get('Activation', 0) + inputs - pool * cpu,
               'transient': snap.get('Temp', 0), 'workspace': 0}  # kernels' workspace is no tensor: memory.py counts it
        return {**out, 'total': sum(out.values())}


# ----------------------------------------------------------------------------- the dry run
def to_fake(model, dtype):
    """model.to(dtype) for a model on the meta device, as FakeTensors on the CPU (Module.to can't make
    them in place): tied parameters stay tied. (The model has no buffers: model.py makes RoPE's tables.)"""
    from torch._guards import active_fake_mode
    if active_fake_mode() is None:  # from here on every tensor is fake, until the process exits
        from torch._subclasses.fake_tensor import FakeTensorMode
        FakeTensorMode(allow_non_fake_inputs=True).__enter__()
    made = {}  # a tied parameter is made once
    for m in model.modules():
        for k, p in m.named_parameters(recurse=False):
            if id(p) not in made:
                new = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device='cpu')
                made[id(p)] = torch.nn.Parameter(new, p.requires_grad)
            setattr(m, k, made[id(p)])
    return model

def fake_batch(batch_size, seq_len, vocab_size, doc_mask=False):
    """A batch as train.py's get_batch returns it (inputs and targets, views of one (B, S+1) tensor); with doc_mask
    per-row positions and one document per row: documents attended one by one save what the whole window's would."""
    xy = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return xy[:, :-1], xy[:, 1:], *[torch.arange(seq_len).expand(batch_size, -1)] * doc_mask
