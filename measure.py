"""
Memory, measured: torch's MemTracker over one step, read as memory.py's categories at the step's
peak (what memory.py's formula is checked against, on the device or the dry run's fake tensors),
and the anatomy of that peak (train.py's dry_run_anatomy): the tensors alive at it, largest first,
each with the op and module that made it, so a forker sees where a change's bytes went. The dry
run's model and batch are fake tensors (to_fake, fake_batch): shapes without data, on the CPU.
"""
import warnings
import weakref
from collections import Counter
from contextlib import ExitStack

import torch
from torch.utils._pytree import tree_leaves

import offload
import parallel


class Tracker(ExitStack):
    """The header's MemTracker (.breakdown()) and anatomy (.at_peak, if anatomy). Entered, it enters
    MemTracker and its hooks (a hook's handle removes it); left, it leaves them, last first.
    masters: train.py's fp32 gradient holders when they are not the parameters; inputs: tensors made
    before the step that it uses (the batch)."""

    def __init__(self, model, masters=(), optimizer=None, inputs=(), device=torch.device('cpu'),
                 anatomy=False, states_on_host=False):
        super().__init__()
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed._tools.mod_tracker import ModTracker  # MemTracker's: holds no tensor

        class Anatomy(MemTracker):  # it updates its peak as an op returns: look then
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                return self.look(func, out, args, kwargs)

        # MemTracker's keys are the tensors' devices
        if device.type == 'cuda' and device.index is None:
            device = torch.device('cuda', torch.cuda.current_device())
        self.device, self.root, self.optimizer = device, model, optimizer
        self.mt = Anatomy() if anatomy or states_on_host else MemTracker()
        self.mods = ModTracker() if anatomy else None
        self.inputs, self.params = inputs, list(model.parameters())
        self.made, self.top, self.at_peak, self.moment = {}, -1, [], ''
        self.host_grads, self.before_step = 0, None
        # offload_states: FSDP2's rows, their gradients (the host's at the device's peak) and
        # AdamW's moments (local: a DTensor's storage is the whole tensor's) are host memory; the
        # device's peak is before AdamW's step
        self.on_host, self.moments = [], []
        if states_on_host:
            self.on_host = [parallel.local(p) for p in self.params]
            for state in optimizer.state.values():
                self.moments += [parallel.local(v) for v in state.values()]
        self.masters = [m for m in masters if all(m is not p for p in self.params)]
        # optim.AdamW's fp32 master rows, unless they are views of fp32 parameters: optimizer bytes
        own = [parallel.local(p).untyped_storage() for p in self.params]
        pieces = getattr(optimizer, 'pieces', ())
        self.state = [x for x in pieces if all(x.untyped_storage() is not s for s in own)]
        self.mt.track_external(model, *self.state, *self.inputs, optimizer)  # (None: skipped)

    def __enter__(self):
        # train.py writes a master's .grad after autograd's hook: MemTracker is told of it then
        for p, m in zip(self.params, self.masters):
            self.enter_context(p.register_post_accumulate_grad_hook(
                lambda p, m=m: self.mt.track_external(m.grad)))
        # gradient accumulation runs the model's forward again: MemTracker must forget the last one
        self.enter_context(
            torch.nn.modules.module.register_module_forward_pre_hook(self.forget_model))
        self.enter_context(warnings.catch_warnings())
        # its own hook sees .grad = None after ours
        warnings.filterwarnings('ignore', message='Expected a tensor')
        if self.mods is not None:
            self.enter_context(self.mods)
        if self.on_host:  # AdamW steps on the host: the device's peak is the one before its step
            self.enter_context(self.optimizer.register_step_pre_hook(self.peak_before_step))
        self.enter_context(self.mt)
        return self

    def forget_model(self, module, args):
        """Before each forward of the model, MemTracker's statistics of it dropped: it refuses a
        second forward (gradient accumulation) otherwise. We don't read them; its blocks' stay (pp's
        backward of an earlier micro-batch finds them). Returns None: the args stay."""
        if module is self.root:
            self.mt.memory_tracking.pop(module, None)

    def peak_before_step(self, *_):
        """offload_states: AdamW steps on the host, so the device's peak is MemTracker's before the
        step. torch's AdamW.step fires this hook too: the first call counts."""
        if not self.before_step:
            self.before_step = self.mt.get_tracker_snapshot('peak')

    def look(self, func, out, args, kwargs):
        """Note each storage on our device an op makes (not one of its inputs': a view, in place),
        what made it and its category (made in forward: activations; in backward, a recompute's too,
        or by the optimizer: transient; or grads); at a new peak of MemTracker's, the one breakdown
        reads, keep those alive, and the bytes of the host gradients then (offload_states)."""
        total = self.mt.get_tracker_snapshot().get(self.device, {}).get('Total', 0)
        # (offload_states: AdamW's step is on the host)
        peak = total > self.top and self.before_step is None
        if peak:
            self.top = total
        if peak and self.on_host:
            self.host_grads = sum(p.grad.to_local().nbytes for p in self.params
                                  if p.grad is not None)
        if self.mods is None:  # no anatomy
            return out
        where = max(self.mods.parents, key=lambda m: (m.count('.'), m))
        if self.mods.is_bw:
            where += ' (backward)'
        category = 'transient' if self.mods.is_bw or not torch.is_grad_enabled() else 'activations'
        given = self.ours(args, kwargs)
        for k, t in self.ours(out).items():
            if k not in given and k not in self.made:
                # dropped from made as it is freed: a freed storage's id is reused
                info = dict(category=category, dtype=str(t.dtype)[6:], shape=list(t.shape),
                            op=str(func), module=where)
                storage = weakref.ref(t.untyped_storage(), lambda _, k=k: self.made.pop(k, None))
                self.made[k] = (storage, info)
        if peak:
            self.moment = f"{func} in {where}"
            self.at_peak = sorted(self.alive(), key=lambda x: -x['bytes'])
        return out

    def ours(self, *trees):
        """{storage id: tensor} of the tensors on our device in the trees (nested lists, tuples and
        dicts of them)."""
        return {id(t.untyped_storage()): t for t in tree_leaves(trees)
                if isinstance(t, torch.Tensor) and t.device == self.device}

    def alive(self):
        """What the step made and still holds, each {**info, 'bytes'}, but host memory (offload's
        buffers, even on a CPU)."""
        grads = {id(p.grad.untyped_storage()) for p in self.params + self.masters
                 if p.grad is not None}
        host = {id(b.untyped_storage()) for b in offload.host_buffers()}
        rows = []
        for k, (ref, info) in list(self.made.items()):
            storage = ref()
            if storage is not None and k not in host:
                rows.append({**info, 'bytes': storage.nbytes()})
                if k in grads:
                    rows[-1]['category'] = 'grads'
        return rows

    def breakdown(self):
        snap = self.before_step or self.mt.get_tracker_snapshot('peak')
        # MemTracker's categories on our device (a missing one: 0); its keys are str enums:
        # 'Parameter' finds _MemRefType.PARAM
        snap = Counter(snap.get(self.device, {}))
        masters, inputs = nbytes(self.state), nbytes(self.inputs)
        pool, rows = nbytes(offload.host_buffers()), nbytes(self.on_host)
        moments = nbytes(self.moments)
        self.host = pool + 2 * rows + moments  # the rows and, by the step, every gradient's
        # on a CPU MemTracker counted the host's tensors with ours: taken out
        cpu = self.device.type == 'cpu'
        out = {'params': snap['Parameter'] + snap['Buffer'] - rows * cpu,
               'grads': snap['Gradient'] + snap['Other'] - masters - inputs - self.host_grads * cpu,
               'optimizer': snap['Optstate'] + masters - moments * cpu,
               'activations': snap['Activation'] + inputs - pool * cpu,
               'transient': snap['Temp'],
               'workspace': 0}  # kernels' workspace is no tensor: memory.py counts it
        return {**out, 'total': sum(out.values())}


def nbytes(tensors):
    """Their storages' bytes, each storage once (views share one), the storages kept alive while
    compared: a freed one's id is reused."""
    return sum({id(s): s.nbytes() for s in [t.untyped_storage() for t in tensors]}.values())


# ----------------------------------------------------------------------------- the dry run
def to_fake(model, dtype):
    """model.to(dtype) for a model on the meta device, as FakeTensors on the CPU (Module.to can't
    make them in place): tied parameters stay tied. (The model has no buffers: RoPE's tables are
    made in its forward.)"""
    from torch._guards import active_fake_mode
    if active_fake_mode() is None:  # from here on every tensor is fake, until the process exits
        from torch._subclasses.fake_tensor import FakeTensorMode
        FakeTensorMode(allow_non_fake_inputs=True).__enter__()
    made = {}  # a tied parameter is made once (a tensor hashes by its identity)
    for m in model.modules():
        for k, p in m.named_parameters(recurse=False):
            if p not in made:
                # (every parameter of model.Llama is a float)
                new = torch.empty(p.shape, dtype=dtype, device='cpu')
                made[p] = torch.nn.Parameter(new, p.requires_grad)
            setattr(m, k, made[p])
    return model

def fake_batch(batch_size, seq_len, vocab_size, doc_mask=False):
    """A batch as train.py's get_batch returns it, (x, y, positions, docs): inputs and targets,
    views of one (B, S+1) tensor; with doc_mask per-row positions, one document per row, else None.
    docs stays None: one document per row is what attention does without them, and documents
    attended one by one save what the whole window's would."""
    xy = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    positions = torch.arange(seq_len).expand(batch_size, -1) if doc_mask else None
    return xy[:, :-1], xy[:, 1:], positions, None
