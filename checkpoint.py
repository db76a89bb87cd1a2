"""
Checkpoints through torch.distributed.checkpoint (DCP): one format for one process and for every
torchrun layout, and any layout loads any other's.

out_dir/ckpt/<k>/ is the k-th save: DCP's files (each rank writes its pieces), meta.json (iter_num,
best_val_loss, config, model_args) and, last, rank 0's COMMITTED. A directory without COMMITTED is
never loaded: a crash mid-save leaves the previous checkpoint; the older ones are removed once the
new one is committed. Saved, by parameter name n (b bytes of weights + 4 of fp32 master with bf16
weights + 8 of AdamW moments per parameter, each element once):

  model.n                              the weights, as the model holds them (bf16 or fp32)
  master.n                             fp32 master weights, when the weights are bf16
  optim.n.exp_avg, .exp_avg_sq, .step  AdamW's state
  rng.torch, rng.data                  torch's and the data sampler's RNG states

Each piece goes to DCP as a DTensor placed in the full tensor: its tp shard (vocabulary rows ⌈V/t⌉ a
rank, the padding left out; kv heads replicated over a kv group when K < t) and, with zero=2 or 3,
its FSDP2 rows of the dp·cp share. DCP keys by name and keeps one copy of equal pieces: tp shards as
plain tensors would keep one rank's and load back wrong, silently. Placed, a checkpoint reshards
(tp 2 loads on tp 1 or 4, zero=3 over dp 2 in one process), the optimizer's state keyed by parameter
name in every layout. Loading unpickles no code: DCP reads tensors with weights_only, and its
metadata goes through an unpickler that admits data classes only.

    python checkpoint.py export OUT_DIR HF_DIR     # a Hugging Face directory from any checkpoint
"""
import contextlib
import functools
import json
import os
import pickle
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from knobs import architecture
from model import Llama, LlamaConfig
import parallel


# ------------------------------------------------------------------------- where each piece lies
@functools.cache
def _device_mesh(world, tp, shards, device_type, pp, cp, ep):
    """All ranks as a DeviceMesh (pp, shards, tp/shards, ep, dp·cp/ep): a tensor split `shards`
    ways over the tp ranks, each piece held by tp/shards of them (kv heads when K < t; else shards
    = t). tp comes before dp·cp: an FSDP2 share is rows of this rank's tp shard. (A stage's names
    are its own: pp replicates.) dp·cp is two dimensions, (ep, dp·cp/ep): the ep ranks' experts,
    then FSDP2's rows of them over the ranks holding the same ones (parallel.py's groups); with ep
    = 1 (every tensor but experts) the first is of size 1 and the second all dp·cp ranks."""
    # [dp, pp, cp, tp] -> [pp, tp, dp, cp] -> [pp, tp, ep, dp·cp/ep]
    ranks = torch.arange(world).view(-1, pp, cp, tp).permute(1, 3, 0, 2)
    ranks = ranks.reshape(pp, shards, tp // shards, -1, ep).transpose(-1, -2)
    return DeviceMesh(device_type, ranks, mesh_dim_names=('pp', 'tp', 'tp_copy', 'ep', 'edp'))

def _placed(name, mesh, config, full, fsdp_dim, local):
    """local (this rank's piece of the tensor `name`, whose full shape and strides are the meta
    tensor full's) with its place in it: its tp shard and, under zero=2, 3, FSDP2's rows (or
    columns: fsdp_dim) of that shard over the dp·cp ranks."""
    spec = parallel.shard_spec(name, config, mesh.tp)
    ep = mesh.ep if '.experts.' in name else 1  # experts: E/ep of them a rank (moe.py)
    if mesh.world == 1 or (spec is None and fsdp_dim is None and ep == 1):
        # every rank holds the same tensor: DCP's one copy is right
        return local
    # a norm (no spec): whole on every tp rank
    on_tp = Replicate() if spec is None else Shard(spec[0])
    shards = mesh.tp
    if spec and spec[1] == 'kv':
        # K kv heads over t ranks: when K < t, each is on t/K of them
        shards = min(config.n_kv_head, mesh.tp)
    # the experts split over the ep ranks, FSDP2's rows over the ranks that hold the same ones
    on_ep = Shard(0) if ep > 1 else Replicate()
    on_edp = Replicate() if fsdp_dim is None else Shard(fsdp_dim)
    where = _device_mesh(mesh.world, mesh.tp, shards, local.device.type, mesh.pp, mesh.cp, ep)
    return DTensor.from_local(local, where, [Replicate(), on_tp, Replicate(), on_ep, on_edp],
                              shape=full.shape, stride=full.stride())

def state_dict(model, optimizer, mesh, data_gen):
    """{key: tensor or DTensor}: views of the live tensors, which DCP writes out or loads into."""
    config = model.config
    with torch.device('meta'):
        full = dict(Llama(config).named_parameters())
    sd = {}
    for n, p, x, rows in zip(optimizer.names, optimizer.params, optimizer.pieces, optimizer.rows):
        # zero=2, 3: FSDP2's piece of the tp shard, split along dim (parallel.py)
        dim = p.placements[0].dim if isinstance(p, DTensor) else None
        # the vocabulary's padding rows left out, unless FSDP2 split the rows
        mine = slice(None) if dim == 0 else slice(rows)
        # each of its tensors placed as the weight
        place = functools.partial(_placed, n, mesh, config, full[n], dim)
        sd['model.' + n] = place(parallel.local(p.detach())[mine])
        # bf16 weights: the fp32 rows the optimizer updates are the masters
        if p.dtype != x.dtype:
            sd['master.' + n] = place(x[mine])
        # exp_avg, exp_avg_sq: placed as the weight; step: one scalar
        # (none: eval.py loads the weights alone)
        for k, v in optimizer.state.get(x, {}).items():
            if k != 'step':
                v = place(v[mine])
            sd[f'optim.{n}.{k}'] = v
    sd['rng.torch'] = torch.get_rng_state()
    if data_gen is not None:
        sd['rng.data'] = data_gen.get_state()
    return sd


class Error(Exception):
    """A checkpoint that can't be read or written (a crafted or damaged file, a full disk): one
    line, no traceback."""


@contextlib.contextmanager
def _one_line(what):
    """What a user sees of a checkpoint's save or load: nothing, or one line.
    - On one process (no process group) DCP warns on every save and load that torch.distributed is
      uninitialized and it assumes one process, and still does when told so (no_dist=True, torch
      2.13): nothing a user can act on, so we ignore that one warning.
    - Where a file or the disk fails: Error(what, the first line of why). DCP wraps each rank's
      exception, with its traceback in the text, in a CheckpointException (a BaseException)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', 'torch.distributed is disabled, unavailable or')
            yield
    except (CheckpointException, pickle.UnpicklingError, OSError, ValueError, EOFError) as e:
        if isinstance(e, CheckpointException):
            e = next(iter(e.failures.values()))[0]
        # its first sentence: torch's run on. A cut file's EOFError says nothing: we say it
        why = str(e).strip().replace('. ', '\n').partition('\n')[0]
        why = why or 'a file ends early (cut short)'
        raise Error(f"{what}: {type(e).__name__}: {why}") from None


# ----------------------------------------------------------------------------- save
def _saves(root):
    """The k of every out_dir/ckpt/<k>/, committed or not, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(k) for k in os.listdir(root) if k.isdigit())

def _fsync_write(directory, name, text):
    with open(os.path.join(directory, name), 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())

def save(out_dir, model, optimizer, mesh, data_gen=None, **scalars):
    """Every rank calls it. scalars (iter_num, best_val_loss, config) go to meta.json."""
    with _one_line(f"cannot write a checkpoint in {out_dir} (the previous one is kept)"):
        root = os.path.join(out_dir, 'ckpt')
        done = _saves(root)
        path = os.path.join(root, f'{max(done, default=0) + 1:06d}')
        # 1. every rank has chosen the same k before any makes the directory
        if dist.is_initialized():
            dist.barrier()
        os.makedirs(path, exist_ok=True)
        # 2. every rank writes its pieces, and DCP its metadata
        dcp.save(state_dict(model, optimizer, mesh, data_gen),
                 storage_writer=dcp.FileSystemWriter(path))
        # 3. dcp.save returned: every rank's files and DCP's metadata are written. Rank 0 writes
        #    meta.json, then COMMITTED (from now on the checkpoint loads), then removes the older
        #    ones
        if mesh.rank == 0:
            args = architecture(model.config)  # (the knobs are free to change on resume)
            _fsync_write(path, 'meta.json', json.dumps({**scalars, 'model_args': args}))
            _fsync_write(path, 'COMMITTED', '')
            for k in done:
                shutil.rmtree(os.path.join(root, f'{k:06d}'), ignore_errors=True)
        # 4. no rank returns before the checkpoint is committed
        if dist.is_initialized():
            dist.barrier()
    return path


# ----------------------------------------------------------------------------- load
def latest(out_dir):
    """The newest committed checkpoint directory of out_dir, or None."""
    root = os.path.join(out_dir, 'ckpt')
    for k in reversed(_saves(root)):
        path = os.path.join(root, f'{k:06d}')
        if os.path.exists(os.path.join(path, 'COMMITTED')):
            return path
    return None

def resume(out_dir, cfg):
    """The newest committed checkpoint's meta.json and 'path', refused where cfg gives another
    architecture or optimizer (another's state is not in it)."""
    path = latest(out_dir)
    if path is None:
        raise Error(f"--init_from=resume but there is no checkpoint in {out_dir}")
    with _one_line(f"cannot read {out_dir}"):
        m = {**meta(path), 'path': path}
        # each rank's file, whole: before we allocate
        for info in _Reader(path).read_metadata().storage_data.values():
            file = os.path.join(path, info.relative_path)
            if not os.path.exists(file) or os.path.getsize(file) < info.offset + info.length:
                lost = 'short' if os.path.exists(file) else 'missing'
                raise Error(f"{file} is {lost}: that rank's shard of the checkpoint is lost; "
                            "resume an earlier checkpoint (move this one away) or start over")
    was = m['config']
    differ = [k for k in [*m['model_args'], 'optimizer']
              if cfg.get(k) is not None and k in was and cfg[k] != was[k]]
    if differ:
        ours = ', '.join(f'{k}={cfg[k]!r}' for k in differ)
        theirs = ', '.join(f'{k}={was[k]!r}' for k in differ)
        raise Error(f"--init_from=resume with {ours}, but {path} was made with {theirs}: "
                    "resume with its config or another out_dir")
    return m

def meta(path):
    with open(os.path.join(path, 'meta.json')) as f:
        return json.load(f)


class _DataOnly(pickle.Unpickler):
    """DCP's metadata is a pickle of its own data classes: admit those our saves write, torch's
    dtypes and sizes, no code. Not BytesStorageMetadata: DCP reads such an entry's bytes with
    torch.load(weights_only=False)."""
    # by full name: module.name (a name pickle splits elsewhere resolves to the same object)
    ADMITTED = {
        'torch.distributed.checkpoint.metadata.Metadata',
        'torch.distributed.checkpoint.metadata.MetadataIndex',
        'torch.distributed.checkpoint.metadata.StorageMeta',
        'torch.distributed.checkpoint.metadata.TensorProperties',
        'torch.distributed.checkpoint.metadata.TensorStorageMetadata',
        'torch.distributed.checkpoint.metadata.ChunkStorageMetadata',
        'torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING',
        'torch.distributed.checkpoint.filesystem._StorageInfo',
        'collections.OrderedDict',
        'torch.Size',
        'pathlib.PosixPath',
        # torch.layout pickles as this lookup
        'torch.serialization._get_layout'}

    def find_class(self, module, name):
        # checked before the import: importing a module can run code
        is_dtype = module == 'torch' and isinstance(getattr(torch, name, 0), torch.dtype)
        if f'{module}.{name}' in self.ADMITTED or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}: refused "
                                     "(it could run code)")


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get('rank')), 'rb') as f:
            md = _DataOnly(f).load()
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load(path, model, optimizer, mesh, data_gen=None):
    """Load a checkpoint of any layout into this rank's weights, masters, moments and RNGs, in
    place; its meta.json."""
    with _one_line(f"cannot load {path}"):
        saved = _Reader(path).read_metadata().state_dict_metadata
        sd = state_dict(model, optimizer, mesh, data_gen)
        # the checkpoint's key for each of our tensors
        first, second = {}, {}
        for key, t in sd.items():
            kind, _, n = key.partition('.')
            if kind == 'model' and 'master.' + n in saved and 'master.' + n not in sd:
                # our fp32 weights from a bf16 run's fp32 masters
                first['master.' + n] = t
            elif kind == 'master' and key not in saved:
                # our fp32 masters from an fp32 run's weights, which our bf16 weights load from
                # too: DCP loads a key into one tensor, so this one in a second load
                second['model.' + n] = t
            else:
                # the same key
                first[key] = t
        # (an empty second: no load)
        for keys in filter(None, (first, second)):
            dcp.load(keys, storage_reader=_Reader(path))
        torch.set_rng_state(sd['rng.torch'])
        if data_gen is not None:
            data_gen.set_state(sd['rng.data'])
        return meta(path)

def load_model(path):
    """The full model of a checkpoint of any layout, in this one process (sample.py, export)."""
    with _one_line(f"cannot load {path}"):
        m = meta(path)
        model = Llama(LlamaConfig(**m['model_args']))
        saved = _Reader(path).read_metadata().state_dict_metadata
        # a bf16 run's fp32 masters where it saved them
        sd = {('master.' if 'master.' + n in saved else 'model.') + n: p.detach()
              for n, p in model.named_parameters()}
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
