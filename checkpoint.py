"""
Checkpoints through torch.distributed.checkpoint (DCP): one format for one process and for every
torchrun layout, and any layout loads any other's.

out_dir/ckpt/<k>/ is the k-th save: DCP's files (each rank writes its pieces), meta.json (iter_num, best_val_loss,
config, model_args) and, last, rank 0's COMMITTED. A directory without COMMITTED is never loaded: a crash mid-save
leaves the previous checkpoint; the older ones are removed once the new one is committed. Saved, by parameter name n
(b bytes of weights + 4 of fp32 master with bf16 weights + 8 of AdamW moments per parameter, each element once):

  model.n                                          the weights, as the model holds them (bf16 or fp32)
  master.n                                         fp32 master weights, when the weights are bf16
  optim.n.exp_avg, optim.n.exp_avg_sq, optim.n.step AdamW's state
  rng.torch, rng.data                              torch's and the data sampler's RNG states

Each piece goes to DCP as a DTensor placed in the full tensor: its tp shard (vocabulary rows ⌈V/t⌉ a rank, the
padding left out; kv heads replicated over a kv group when K < t) and, with zero=2 or 3, its FSDP2 rows of the dp·cp
share. DCP keys by name and keeps one copy of equal pieces: tp shards as plain tensors would keep one rank's and load
back wrong, silently. Placed, a checkpoint reshards (tp 2 loads on tp 1 or 4, zero=3 over dp 2 in one process), the
optimizer's state keyed by parameter name in every layout. Loading unpickles no code: DCP reads tensors with
weights_only, and its metadata goes through an unpickler that admits data classes only.

    python checkpoint.py export OUT_DIR HF_DIR     # a Hugging Face directory from any checkpoint
"""
import functools
import json
import os
import pickle
import shutil
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from model import MEMORY_KNOBS, Llama, LlamaConfig
import parallel


# ----------------------------------------------------------------------------- where each piece lies
@functools.cache
def _device_mesh(world, tp, kv_heads, device_type, pp=1, cp=1):
    """All ranks as a DeviceMesh (pp, tp, dp·cp), or (pp, K, t/K, dp·cp) to place kv heads replicated K < t ways. tp
    comes before dp·cp: an FSDP2 share is rows of this rank's tp shard. (A stage's names are its own: pp replicates.)"""
    ranks = torch.arange(world).view(-1, pp, cp, tp).permute(1, 3, 0, 2)  # [dp, pp, cp, tp] -> [pp, tp, dp, cp]
    tp_dims, names = ((kv_heads, tp // kv_heads), ('kv', 'kv_copy')) if kv_heads else ((tp,), ('tp',))
    return DeviceMesh(device_type, ranks.reshape(pp, *tp_dims, -1), mesh_dim_names=('pp', *names, 'dpcp'))

def _placed(name, local, mesh, config, shape, fsdp_dim=None):
    """local (this rank's piece of the tensor `name`, whose full shape is shape) with its place in it: its tp shard
    and, under zero=2, 3, FSDP2's rows (or columns: fsdp_dim) of that shard over the dp·cp ranks."""
    spec = parallel.shard_spec(name, config, mesh.tp)
    if mesh.world == 1 or (spec is None and fsdp_dim is None):
        return local  # every rank holds the same tensor: DCP's one copy is right
    kv = spec is not None and spec[1] == 'kv' and config.n_kv_head < mesh.tp
    on_tp = [Replicate()] if spec is None else [Shard(0), Replicate()] if kv else [Shard(spec[0])]
    dm = _device_mesh(mesh.world, mesh.tp, config.n_kv_head if kv else 0, local.device.type, mesh.pp, mesh.cp)
    return DTensor.from_local(local, dm, [Replicate()] + on_tp + [Replicate() if fsdp_dim is None else Shard(fsdp_dim)],
                              shape=shape, stride=torch.empty(shape, device='meta').stride())

def state_dict(model, optimizer, mesh, data_gen=None):
    """{key: tensor or DTensor}: views of the live tensors, which DCP writes out or loads into."""
    config = model.config
    with torch.device('meta'):
        shapes = {n: p.shape for n, p in Llama(config).named_parameters()}
    sd = {}
    for n, p, x, rows in zip(optimizer.names, optimizer.params, optimizer.pieces, optimizer.rows):
        dim = p.placements[0].dim if isinstance(p, DTensor) else None  # zero=2, 3: FSDP2's piece (parallel.py)
        mine = lambda t: parallel.local(t)[:rows] if dim != 0 else parallel.local(t)  # no padding rows
        sd['model.' + n] = _placed(n, mine(p.detach()), mesh, config, shapes[n], dim)
        if p.dtype != x.dtype:  # bf16 weights: the fp32 rows the optimizer updates are the masters
            sd['master.' + n] = _placed(n, x[:rows], mesh, config, shapes[n])
        for k, v in optimizer.state[x].items():  # exp_avg, exp_avg_sq: placed as the weight; step: one scalar
            sd[f'optim.{n}.{k}'] = v if k == 'step' else _placed(n, mine(v), mesh, config, shapes[n], dim)
    sd['rng.torch'] = torch.get_rng_state()
    if data_gen is not None:
        sd['rng.data'] = data_gen.get_state()
    return sd


class Error(Exception):
    """A checkpoint that can't be read or written (a crafted or damaged file, a full disk): one line, no traceback."""


def _one_line(what):
    """fn(path, ...) raising Error(what, the first line of why) where a file or the disk fails it. DCP wraps
    each rank's exception, with its traceback in the text, in a CheckpointException (a BaseException)."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(path, *args, **kw):
            try:
                return fn(path, *args, **kw)
            except (CheckpointException, pickle.UnpicklingError, OSError, ValueError) as e:
                e = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
                why = str(e).strip().replace('. ', '\n').partition('\n')[0]  # its first sentence: torch's run on
                raise Error(f"{what.format(path=path)}: {type(e).__name__}: {why}") from None
        return wrapped
    return decorate


# ----------------------------------------------------------------------------- save
def _fsync_write(path, text):
    with open(path, 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())

@_one_line("cannot write a checkpoint in {path} (the previous one is kept)")
def save(out_dir, model, optimizer, mesh, data_gen=None, **scalars):
    """Every rank calls it. scalars (iter_num, best_val_loss, config) go to meta.json."""
    root = os.path.join(out_dir, 'ckpt')
    done = [int(k) for k in os.listdir(root) if k.isdigit()] if os.path.isdir(root) else []
    path = os.path.join(root, f'{max(done, default=0) + 1:06d}')
    if dist.is_initialized():  # every rank has chosen the same k before any makes the directory
        dist.barrier()
    os.makedirs(path, exist_ok=True)
    dcp.save(state_dict(model, optimizer, mesh, data_gen), storage_writer=dcp.FileSystemWriter(path))
    if mesh.rank == 0:  # dcp.save returned: every rank's files and DCP's metadata are written
        args = {k: v for k, v in asdict(model.config).items() if k not in MEMORY_KNOBS}
        _fsync_write(os.path.join(path, 'meta.json'), json.dumps({**scalars, 'model_args': args}))
        _fsync_write(os.path.join(path, 'COMMITTED'), '')
        for k in done:
            shutil.rmtree(os.path.join(root, f'{k:06d}'), ignore_errors=True)
    if dist.is_initialized():  # no rank returns before the checkpoint is committed
        dist.barrier()
    return path


# ----------------------------------------------------------------------------- load
def latest(out_dir):
    """The newest committed checkpoint directory of out_dir, or None."""
    root = os.path.join(out_dir, 'ckpt')
    ks = sorted((int(k) for k in os.listdir(root) if k.isdigit()), reverse=True) if os.path.isdir(root) else []
    return next((p for p in (os.path.join(root, f'{k:06d}') for k in ks)
                 if os.path.exists(os.path.join(p, 'COMMITTED'))), None)

@_one_line("cannot read {path}")
def resume(out_dir, cfg):
    """The newest committed checkpoint's meta.json and 'path', refused where cfg gives another architecture."""
    path = latest(out_dir)
    if path is None:
        raise Error(f"--init_from=resume but there is no checkpoint in {out_dir}")
    m = {**meta(path), 'path': path}
    for info in _Reader(path).read_metadata().storage_data.values():  # each rank's file, whole: before we allocate
        file = os.path.join(path, info.relative_path)
        if not os.path.exists(file) or os.path.getsize(file) < info.offset + info.length:
            raise Error(f"{file} is {'short' if os.path.exists(file) else 'missing'}: that rank's shard of the "
                        f"checkpoint is lost; resume an earlier checkpoint (move this one away) or start over")
    was = m['config']
    differ = [k for k in m['model_args'] if cfg.get(k) is not None and k in was and cfg[k] != was[k]]
    if differ:
        raise Error(f"--init_from=resume with {', '.join(f'{k}={cfg[k]!r}' for k in differ)}, but {path} was made "
                    f"with {', '.join(f'{k}={was[k]!r}' for k in differ)}: resume with its config or another out_dir")
    return m

def meta(path):
    with open(os.path.join(path, 'meta.json')) as f:
        return json.load(f)


class _DataOnly(pickle.Unpickler):
    """DCP's metadata is a pickle of its own data classes: admit those our saves write, torch's dtypes and sizes,
    no code. Not BytesStorageMetadata: DCP reads such an entry's bytes with torch.load(weights_only=False)."""
    ADMITTED = {('torch.distributed.checkpoint.metadata', n) for n in ('Metadata', 'MetadataIndex', 'StorageMeta',
                'TensorProperties', 'TensorStorageMetadata', 'ChunkStorageMetadata', '_MEM_FORMAT_ENCODING')} | {
        ('torch.distributed.checkpoint.filesystem', '_StorageInfo'), ('collections', 'OrderedDict'), ('torch', 'Size'),
        ('pathlib', 'PosixPath'), ('torch.serialization', '_get_layout')}  # torch.layout pickles as this lookup

    def find_class(self, module, name):  # checked before the import: importing a module can run code
        if (module, name) in self.ADMITTED or module == 'torch' and isinstance(getattr(torch, name, 0), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}: refused (it could run code)")


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get('rank')), 'rb') as f:
            md = _DataOnly(f).load()
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


@_one_line("cannot load {path}")
def load(path, model, optimizer, mesh, data_gen=None):
    """Load a checkpoint of any layout into this rank's weights, masters, moments and RNGs, in place; its meta.json."""
    saved = _Reader(path).read_metadata().state_dict_metadata
    sd = state_dict(model, optimizer, mesh, data_gen)
    # fp32 weights load from a bf16 run's masters; bf16 runs' masters from fp32 weights (below)
    sd = {('master.' + k[6:] if k.startswith('model.') and 'master.' + k[6:] in saved
           and 'master.' + k[6:] not in sd else k): v for k, v in sd.items()}
    missing = [k for k in sd if k.startswith('master.') and k not in saved]
    dcp.load({k: v for k, v in sd.items() if k not in missing}, storage_reader=_Reader(path))
    if missing:
        dcp.load({'model.' + k[7:]: sd[k] for k in missing}, storage_reader=_Reader(path))
    torch.set_rng_state(sd['rng.torch'])
    if data_gen is not None:
        data_gen.set_state(sd['rng.data'])
    return meta(path)

@_one_line("cannot load {path}")
def load_model(path, **knobs):
    """The full model of a checkpoint of any layout, in this one process (sample.py, export)."""
    m = meta(path)
    model = Llama(LlamaConfig(**m['model_args'], **knobs))
    saved = _Reader(path).read_metadata().state_dict_metadata
    sd = {('master.' if 'master.' + n in saved else 'model.') + n: p.detach() for n, p in model.named_parameters()}
    dcp.load(sd, storage_reader=_Reader(path), no_dist=True)
    return model, m


if __name__ == '__main__':
    if len(sys.argv) != 4 or sys.argv[1] != 'export':
        sys.exit("usage: python checkpoint.py export OUT_DIR HF_DIR")
    path = latest(sys.argv[2])
    if path is None:
        sys.exit(f"error: no committed checkpoint in {sys.argv[2]}")
    load_model(path)[0].save_pretrained(sys.argv[3])
    print(f"wrote {sys.argv[3]} from {path}")
