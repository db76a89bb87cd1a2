"""train.py: exact resume, crash-safe checkpoints, gradient accumulation, signals, a falling val loss."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import train
from model import Llama, LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ['--n_layer=2', '--n_embd=32', '--n_head=4', '--n_kv_head=2', '--intermediate_size=64',
         '--batch_size=4', '--seq_len=32', '--eval_iters=2', '--log_interval=1', '--device=cpu',
         '--warmup_iters=2', '--lr_decay_iters=8']


def run_train(*args, check=True, **kw):
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, **kw)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    run_train(*SMALL, '--max_iters=8', '--eval_interval=3', f'--out_dir={straight}')
    run_train(*SMALL, '--max_iters=5', '--eval_interval=3', f'--out_dir={split}')
    run_train(*SMALL, '--max_iters=8', '--eval_interval=3', f'--out_dir={split}', '--init_from=resume')
    a, b = read_log(straight), read_log(split)
    assert [r['iter'] for r in a] == list(range(8)) and [r['iter'] for r in b] == list(range(8))
    assert [r['loss'] for r in a] == [r['loss'] for r in b]  # bit for bit
    assert [r['lr'] for r in a] == [r['lr'] for r in b]
    assert a[0]['loss'] > a[-1]['loss']
    for key in ('tokens_per_s', 'mfu', 'peak_mem_bytes', 'offload_bytes'):
        assert key in a[-1]
    # a CPU has no datasheet peak: no MFU rather than one against a matmul timed once on a shared
    # machine (it read 61-488%)
    assert all(r['mfu'] is None and r['hfu'] is None for r in a)
    assert 'val_loss' in a[0] and 'val_loss' in a[3] and 'val_loss' not in a[1]


@pytest.mark.skipif(not any(shutil.which(c) for c in ('g++', 'c++', 'clang++')),
                    reason="torch.compile on a CPU builds C++ kernels: no C++ compiler here")
def test_compile_gives_the_losses_of_eager(tmp_path):
    """--compile=True trains the same model (bench/vs_nanogpt.py times it): the losses equal eager's up
    to the rounding of inductor's fused kernels, which sum in another order."""
    eager, compiled = str(tmp_path / 'eager'), str(tmp_path / 'compiled')
    run_train(*SMALL, '--max_iters=4', '--eval_interval=3', f'--out_dir={eager}')
    run_train(*SMALL, '--max_iters=4', '--eval_interval=3', f'--out_dir={compiled}', '--compile=True')
    a, b = read_log(eager), read_log(compiled)
    assert [r['iter'] for r in b] == [r['iter'] for r in a] == list(range(4))
    np.testing.assert_allclose([r['loss'] for r in b], [r['loss'] for r in a], rtol=1e-5)
    np.testing.assert_allclose(b[3]['val_loss'], a[3]['val_loss'], rtol=1e-5)


def test_resume_of_a_bf16_run_keeps_fp32_master_weights(tmp_path):
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    run_train(*SMALL, '--dtype=bfloat16', '--max_iters=6', '--eval_interval=100', f'--out_dir={straight}')
    run_train(*SMALL, '--dtype=bfloat16', '--max_iters=3', '--eval_interval=100', f'--out_dir={split}')
    run_train(*SMALL, '--dtype=bfloat16', '--max_iters=6', '--eval_interval=100', f'--out_dir={split}',
              '--init_from=resume')
    assert [r['loss'] for r in read_log(straight)] == [r['loss'] for r in read_log(split)]
    saved = checkpoint._Reader(checkpoint.latest(split)).read_metadata().state_dict_metadata
    masters = [v.properties.dtype for k, v in saved.items() if k.startswith('master.')]
    weights = [v.properties.dtype for k, v in saved.items() if k.startswith('model.')]
    assert len(masters) == len(weights) > 0
    assert set(masters) == {torch.float32} and set(weights) == {torch.bfloat16}


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    out = str(tmp_path / 'run')
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *SMALL, '--max_iters=100000',
                          '--eval_interval=100000', f'--out_dir={out}'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(os.path.join(out, 'log.jsonl'))
                                          and len(read_log(out)) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-2000:]
    assert checkpoint.meta(checkpoint.latest(out))['iter_num'] >= 3 and 'continue with --init_from=resume' in stdout


KILLED_WRITER = """
import sys, time, torch
sys.path.insert(0, {root!r})
import torch.distributed.checkpoint as dcp
import checkpoint, parallel
from model import Llama, LlamaConfig
torch.manual_seed(0)
model = Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
params = list(model.parameters())
opt = parallel.AdamW(list(model.named_parameters()), params, [{{'params': params}}], parallel.Mesh(), model.config)
checkpoint.save({out!r}, model, opt, parallel.Mesh(), iter_num=1)
print('saved', flush=True)
with torch.no_grad():
    for p in params:
        p.zero_()
finish = dcp.FileSystemWriter.finish
def slow_finish(self, *args, **kw):  # the data files are written; the process dies before the commit
    finish(self, *args, **kw)
    print('writing', flush=True)
    time.sleep(600)
dcp.FileSystemWriter.finish = slow_finish
checkpoint.save({out!r}, model, opt, parallel.Mesh(), iter_num=2)
"""


def test_a_process_killed_mid_checkpoint_leaves_the_previous_one(tmp_path):
    out = str(tmp_path / 'out')
    p = subprocess.Popen([sys.executable, '-c', KILLED_WRITER.format(root=ROOT, out=out)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == 'saved'
    assert p.stdout.readline().strip() == 'writing'  # the second checkpoint is being written...
    p.kill()
    p.wait()
    assert len(os.listdir(os.path.join(out, 'ckpt'))) == 2
    path = checkpoint.latest(out)  # ...and the first is the one found, whole
    assert checkpoint.meta(path)['iter_num'] == 1
    torch.manual_seed(0)
    ref = Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    model, _ = checkpoint.load_model(path)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b) and a.abs().sum() > 0, n


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=97))
    x = torch.randint(0, 97, (4, 24))
    y = torch.randint(0, 97, (4, 24))
    y[0, :20] = -100  # micro-steps with very different numbers of real targets
    y[2, 5:] = -100
    y[3, :] = -100  # and one with none at all

    def grads(micro):
        model.zero_grad(set_to_none=True)
        loss = train.forward_backward(model, micro, train.nullcontext())
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    big_loss, big = grads([(x, y)])
    acc_loss, acc = grads([(x[i:i + 1], y[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(acc_loss, big_loss, rtol=1e-6, atol=0)
    for name in big:
        err = (acc[name] - big[name]).norm() / big[name].norm()
        assert err < 1e-5, name
    # a mean of per-micro-step means would be a different loss: the test can tell them apart
    means = [model(x[i:i + 1], y[i:i + 1])[1] for i in range(3)]
    assert abs(torch.stack(means).mean() - big_loss) > 1e-2


def test_bf16_master_weights_accumulate_in_fp32():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    ref = Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    ref.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    masters = train.make_master_weights(model)
    assert all(m.dtype == torch.float32 for m in masters)
    x = torch.randint(0, 50, (2, 16))
    micro = [(x, x.roll(-1, 1))] * 3
    with torch.autocast('cpu', dtype=torch.bfloat16):
        train.forward_backward(model, micro, train.nullcontext())
    train.forward_backward(ref, micro, train.nullcontext())
    assert all(p.grad is None for p in model.parameters())  # folded into the masters right away
    for m, (name, p) in zip(masters, ref.named_parameters()):
        err = (m.grad - p.grad).norm() / p.grad.norm()
        assert m.grad.dtype == torch.float32 and err < 5e-2, name


def test_lr_schedule_warms_up_then_decays():
    lrs = [train.get_lr(i) for i in range(train.max_iters + 5)]
    peak = int(np.argmax(lrs))
    assert peak == train.warmup_iters and lrs[0] < lrs[peak] / 10
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    assert lrs[-1] == train.min_lr


def test_data_whose_vocabulary_does_not_fit_is_a_clear_error(tmp_path):
    p = run_train(*SMALL, '--vocab_size=100', '--max_iters=1', f'--out_dir={tmp_path}', check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr
    last = p.stderr.strip().splitlines()[-1]  # (a first run prepares the data: a progress bar before it)
    assert last.startswith('error:') and 'vocab_size' in last


def test_offload_that_does_not_fit_in_host_memory_stops_before_the_first_step(tmp_path):
    # 3 layers: block 0 is offloaded (offload.KEEP_LAST = 2); 4 x 1024 tokens x 64 x 4 bytes: its input
    # alone is 1 MiB (offload.MIN_BYTES), so it goes to host
    big = [*SMALL, '--n_layer=3', '--n_embd=64', '--seq_len=1024', '--offload=0.5', '--max_iters=1']
    p = run_train(*big, '--host_memory_budget_gb=1e-9', f'--out_dir={tmp_path / "tiny_budget"}', check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'GiB of host memory per rank (1 blocks)' in errors[0], p.stderr[-2000:]
    assert 'host_memory_budget_gb' in errors[0]
    assert not os.path.exists(tmp_path / 'tiny_budget' / 'log.jsonl')  # no step ran
    p = run_train(*SMALL, '--n_layer=3', '--offload=0.5', '--max_iters=1', f'--out_dir={tmp_path / "fits"}')
    assert 'offload=0.5: 0.00 GiB of host memory per rank (1 blocks)' in p.stdout


def test_init_from_a_hugging_face_directory_fine_tunes_it(tmp_path):
    torch.manual_seed(0)
    Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                      vocab_size=300)).save_pretrained(tmp_path / 'hf')
    out = str(tmp_path / 'out')
    run_train(*SMALL, f'--init_from={tmp_path / "hf"}', '--max_iters=3', f'--out_dir={out}')
    args = checkpoint.meta(checkpoint.latest(out))['model_args']
    assert args['vocab_size'] == 300 and args['n_layer'] == 1


def test_train_tiny_learns_and_samples(tmp_path):
    out = str(tmp_path / 'tiny')
    run_train(os.path.join(ROOT, 'config', 'train_tiny.py'), '--max_iters=150', '--eval_interval=50',
              '--batch_size=8', '--seq_len=128', f'--out_dir={out}', '--device=cpu')
    log = read_log(out)
    val = [r['val_loss'] for r in log if 'val_loss' in r]
    assert val[0] > 5.0  # ln(256) = 5.55: uniform over bytes at the start
    assert val[-1] < 0.55 * val[0]
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'sample.py'), f'--out_dir={out}', '--num_samples=1',
                        '--max_new_tokens=40', '--start=def '], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert 'def ' in p.stdout


COUNT_WORLD_REDUCES = """
import atexit, os, sys
sys.path.insert(0, {root!r})
import parallel, train
calls = []
real = parallel.all_reduce
def all_reduce(x, group, *args, **kw):
    if group is None:  # the world: only the loop's stop check reduces over every rank
        calls.append(1)
    return real(x, group, *args, **kw)
parallel.all_reduce = all_reduce
atexit.register(lambda: open(os.path.join({out!r}, 'reduces%s' % os.environ['RANK']), 'w').write(str(len(calls))))
sys.argv = ['train.py'] + {args!r}
train.main()
"""


def test_under_torchrun_the_stop_check_runs_on_log_steps_only(tmp_path):
    """Agreeing on a signal costs an all-reduce and a host sync: on log steps only, not every step."""
    out = tmp_path / 'out'
    script = tmp_path / 'count.py'
    script.write_text(COUNT_WORLD_REDUCES.format(root=ROOT, out=str(tmp_path), args=[
        *SMALL, '--tp_size=2', '--max_iters=7', '--log_interval=3', '--eval_interval=100', f'--out_dir={out}']))
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_log(out)
    assert [r['iter'] for r in rows] == [0, 3, 6]  # 7 steps, 3 of them logged
    assert [int((tmp_path / f'reduces{r}').read_text()) for r in (0, 1)] == [3, 3]
