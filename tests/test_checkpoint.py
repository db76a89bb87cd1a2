"""checkpoint.py: a checkpoint saved under one layout loads under another (tp 2 -> tp 1, tp 4; one process
-> tp 2; zero=3 (FSDP2) shards of weights and moments -> one process) and the next two steps' losses are the
saving run's, which checks the weights (first loss) and AdamW's masters and moments (second). The same
layout reproduces them bit for bit. A directory without its commit marker is never loaded; a checkpoint
crafted to run code (its metadata, its tensors' bytes, DCP's bytes entries) is refused, in one line under
train.py and sample.py, and the code does not run. One process saves and loads without a word: no
warning, no log record, nothing on stderr.

Layouts run in spawned processes on gloo (CPU), one spawn of 2 ranks and one of 4; single-process
saves and loads run in the test's own process."""
import io
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import offload  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from conftest import apply_techniques  # noqa: E402
from knobs import Knobs  # noqa: E402
from model import Llama  # noqa: E402

# V = 37: padded vocabulary rows on tp 2 and 4; K = 2 kv heads: replicated on tp 4
CONFIG = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=37)
B, S = 4, 16


def build(world, tp, zero, dtype, seed):
    config = Knobs(**CONFIG)
    mesh = parallel.make_mesh(tp, 1, 'ulysses', config.n_kv_head) if world > 1 else parallel.Mesh()
    torch.manual_seed(seed)
    model = Llama(config)
    apply_techniques(model, mesh).to(torch.float32 if zero else dtype)  # FSDP2's fp32 rows are the masters
    if zero:
        parallel.shard_states(model, mesh, zero, dtype)
    masters = optim.make_master_weights(model)
    named = list(model.named_parameters())
    pieces = [parallel.local(m) for m in masters]
    groups = [{'params': [x for x in pieces if x.dim() >= 2], 'weight_decay': 0.1},
              {'params': [x for x in pieces if x.dim() < 2], 'weight_decay': 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True)
    opt = optim.MasterWeights(named, masters, pieces, [adamw], mesh, config)
    return model, masters, opt, mesh


def steps(run, first, n):
    """n training steps from step `first` (each its own batch): their losses."""
    model, masters, opt, mesh = run
    named = list(zip([n for n, _ in model.named_parameters()], masters))
    autocast = torch.autocast('cpu', torch.bfloat16) if masters[0].dtype != next(model.parameters()).dtype else nullcontext()
    out = []
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randint(0, CONFIG['vocab_size'], (B, S), generator=g) for _ in range(2))
        loss = train.forward_backward(model, [parallel.shard_batch(mesh, x, y)], autocast, mesh)
        parallel.sync_grads(named, mesh, model.config)
        parallel.clip_grad_norm_(named, 1.0, mesh, model.config)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def act(world, action, layout, path):
    """'save': 2 steps, save, 2 more; 'load': a differently initialised model loads, then 2 steps."""
    run = build(world, *layout, seed=0 if action == 'save' else 99)
    if action == 'save':
        steps(run, 0, 2)
        checkpoint.save(path, run[0], run[2], run[3], iter_num=2)
        return steps(run, 2, 2)
    meta = checkpoint.load(checkpoint.latest(path), run[0], run[2], run[3])
    return steps(run, meta['iter_num'], 2)


def _worker(rank, world, port, actions, out):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    results = {key: act(world, action, layout, os.path.join(out, src)) for key, action, layout, src in actions}
    if rank == 0:
        torch.save(results, os.path.join(out, f'world{world}.pt'))
    dist.destroy_process_group()


def spawn(world, actions, out):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, actions, out), nprocs=world)
    return torch.load(os.path.join(out, f'world{world}.pt'))


F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope='module')
def losses(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('ckpt'))
    r = {'single': act(1, 'save', (1, 0, F32), os.path.join(out, 'single'))}
    r.update(spawn(2, [('single->tp2', 'load', (2, 0, F32), 'single'),
                       ('tp2', 'save', (2, 0, F32), 'tp2'),
                       ('tp2->tp2', 'load', (2, 0, F32), 'tp2'),
                       ('dp2z', 'save', (1, 3, F32), 'dp2z'),
                       ('dp2z_bf16', 'save', (1, 3, BF16), 'dp2z_bf16'),
                       ('dp2z_bf16->dp2z_bf16', 'load', (1, 3, BF16), 'dp2z_bf16')], out))
    r['tp2->single'] = act(1, 'load', (1, 0, F32), os.path.join(out, 'tp2'))
    r['dp2z->single'] = act(1, 'load', (1, 0, F32), os.path.join(out, 'dp2z'))
    r.update(spawn(4, [('tp2->tp4', 'load', (4, 0, F32), 'tp2'),
                       ('tp2->tp2dp2z', 'load', (2, 2, F32), 'tp2'),
                       ('tp2dp2z', 'save', (2, 2, F32), 'tp2dp2z'),
                       ('tp2dp2z->tp4', 'load', (4, 0, F32), 'tp2dp2z')], out))
    r['tp2dp2z->single'] = act(1, 'load', (1, 0, F32), os.path.join(out, 'tp2dp2z'))
    r['dir'] = out
    return r


@pytest.mark.parametrize('spoil', ['missing', 'short'])
def test_a_checkpoint_missing_a_shard_is_one_line_before_anything_loads(losses, tmp_path, spoil):
    """Rank 1's file of a tp 2 checkpoint gone (or cut short): resume names it, before a model is built."""
    shutil.copytree(os.path.join(losses['dir'], 'tp2'), tmp_path / 'out')
    path = checkpoint.latest(str(tmp_path / 'out'))
    shard = os.path.join(path, '__1_0.distcp')
    if spoil == 'missing':
        os.remove(shard)
    else:
        os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(checkpoint.Error, match=f"__1_0.distcp is {spoil}: that rank's shard"):
        checkpoint.resume(str(tmp_path / 'out'), {})


@pytest.mark.parametrize('key', ['single->tp2', 'tp2->single', 'tp2->tp4', 'tp2->tp2dp2z', 'dp2z->single',
                                 'tp2dp2z->tp4', 'tp2dp2z->single'])
def test_a_checkpoint_loads_under_another_layout(losses, key):
    got, ref = losses[key], losses[key.split('->')[0]]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, ref)), (got, ref)


@pytest.mark.parametrize('key', ['tp2->tp2', 'dp2z_bf16->dp2z_bf16'])
def test_the_same_layout_resumes_bit_for_bit(losses, key):
    assert losses[key] == losses[key.split('->')[0]]


def test_an_uncommitted_checkpoint_is_never_loaded(tmp_path):
    act(1, 'save', (1, 0, F32), str(tmp_path))
    path = checkpoint.latest(str(tmp_path))
    assert checkpoint.meta(path)['iter_num'] == 2
    os.remove(os.path.join(path, 'COMMITTED'))
    assert checkpoint.latest(str(tmp_path)) is None


def test_one_process_saves_and_loads_without_a_warning(tmp_path, capfd, caplog):
    """On one process (train.py's default, sample.py, export) DCP warns on every save and load that
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a
    single process" (and to load): nothing a user can act on, so nothing of it reaches the user."""
    run = build(1, 1, 0, F32, seed=0)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG):
        warnings.simplefilter('always')
        checkpoint.save(str(tmp_path), run[0], run[2], run[3], iter_num=1)
        path = checkpoint.latest(str(tmp_path))
        checkpoint.load(path, run[0], run[2], run[3])
        checkpoint.load_model(path)
    assert [f'{w.category.__name__}: {w.message}' for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    out, err = capfd.readouterr()
    assert err == '' and out == ''


class Evil:
    """A pickle that runs a shell command when loaded: touches the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


def craft(path, kind, marker):
    """Make the checkpoint at path run a command when loaded, three ways."""
    if kind == 'metadata':  # DCP's .metadata is a pickle: the command in place of it
        with open(os.path.join(path, '.metadata'), 'wb') as f:
            pickle.dump(Evil(marker), f)
        return
    md = checkpoint._Reader(path).read_metadata()
    blob = io.BytesIO()
    torch.save(Evil(marker), blob)
    with open(os.path.join(path, '__0_0.distcp'), 'wb') as f:
        f.write(blob.getvalue())
    info = type(next(iter(md.storage_data.values())))('__0_0.distcp', 0, len(blob.getvalue()))
    if kind == 'data':  # every tensor's bytes a torch.save of the command
        md.storage_data = {k: info for k in md.storage_data}
    else:  # 'bytes': DCP's own data classes saying a weight is bytes, which DCP would torch.load(weights_only=False)
        key = next(k for k in md.state_dict_metadata if k.startswith('model.'))
        md.state_dict_metadata[key], md.storage_data[MetadataIndex(key)] = BytesStorageMetadata(), info
    md.storage_meta = None
    with open(os.path.join(path, '.metadata'), 'wb') as f:
        pickle.dump(md, f)


@pytest.mark.parametrize('kind', ['metadata', 'data', 'bytes'])
def test_a_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(tmp_path, kind):
    act(1, 'save', (1, 0, F32), str(tmp_path))
    path, marker = checkpoint.latest(str(tmp_path)), tmp_path / 'ran'
    craft(path, kind, marker)
    run = build(1, 1, 0, F32, seed=0)
    for load in (lambda: checkpoint.load_model(path), lambda: checkpoint.load(path, run[0], run[2], run[3])):
        with pytest.raises(checkpoint.Error, match='Unpickling'):
            load()
    assert not marker.exists()


def test_train_and_sample_refuse_a_crafted_checkpoint_in_one_line(tmp_path):
    out, marker = str(tmp_path / 'out'), tmp_path / 'ran'
    model = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=256))
    params = list(model.parameters())
    opt = optim.MasterWeights(list(model.named_parameters()), params, params, [torch.optim.AdamW(params)],
                              parallel.Mesh(), model.config)
    checkpoint.save(out, model, opt, parallel.Mesh(), torch.Generator(), iter_num=1, best_val_loss=9.0,
                    config={'dataset': 'stdlib'})
    craft(checkpoint.latest(out), 'metadata', marker)
    torch.save(Evil(marker), os.path.join(out, 'ckpt.pt'))  # nanoGPT's name: nothing here reads it
    for cmd in (['train.py', '--init_from=resume', '--device=cpu', '--max_iters=2'], ['sample.py', '--device=cpu']):
        p = subprocess.run([sys.executable, os.path.join(ROOT, cmd[0]), *cmd[1:], f'--out_dir={out}'], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
        last = p.stderr.strip().splitlines()[-1]
        # train.py's resume reads the metadata first (every shard there?), sample.py's load
        assert last.startswith(('error: cannot read', 'error: cannot load')) and 'UnpicklingError' in last, p.stderr[-3000:]
        assert not marker.exists()


@pytest.mark.parametrize('cut', ['.metadata', '__0_0.distcp'])
def test_a_truncated_checkpoint_says_why_in_one_line(tmp_path, cut):
    """A file cut short (a copy stopped midway) gave `cannot load ...: EOFError:` and no reason."""
    run = build(1, 1, 0, F32, seed=0)
    checkpoint.save(str(tmp_path), run[0], run[2], run[3], iter_num=1)
    path = checkpoint.latest(str(tmp_path))
    file = os.path.join(path, cut)
    with open(file, 'r+b') as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(checkpoint.Error) as e:
        checkpoint.load_model(path)
    line = str(e.value)
    assert line.startswith(f'cannot load {path}: ') and '\n' not in line, line
    assert not line.rstrip().endswith(':'), line  # a reason after the exception's name
