"""train.py: exact resume, crash-safe checkpoints, gradient accumulation, signals, a falling val loss."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import optim
import parallel
import train
from knobs import Knobs
from model import Llama, flops_per_token

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


def logged(out_dir, n):
    """Whether a running train.py has logged n rows (whole lines: the last may be mid-write)."""
    path = os.path.join(out_dir, 'log.jsonl')
    return os.path.exists(path) and open(path).read().count('\n') >= n


def wait_until(condition, p, what, deadline_s=600):
    """Poll until condition() holds. Fails at once if process p ended first (with its stderr where
    piped), and after deadline_s: these runs' steps take well under a second, so that is a hang, not
    a loaded machine (a wait sized by the clock fails only on a slow one)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if p.poll() is not None:
            err = p.stderr.read()[-3000:] if p.stderr else ''
            pytest.fail(f"the run ended (status {p.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"no {what} after {deadline_s} s")
        time.sleep(0.1)


@pytest.mark.parametrize('moe', [[], ['--n_experts=4', '--experts_per_token=2']], ids=['dense', 'moe'])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, moe):
    """Dense, and a mixture of experts (its router and aux loss carried across the checkpoint)."""
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    run_train(*SMALL, *moe, '--max_iters=8', '--eval_interval=3', f'--out_dir={straight}')
    run_train(*SMALL, *moe, '--max_iters=5', '--eval_interval=3', f'--out_dir={split}')
    run_train(*SMALL, *moe, '--max_iters=8', '--eval_interval=3', f'--out_dir={split}',
              '--init_from=resume')
    a, b = read_log(straight), read_log(split)
    assert [r['iter'] for r in a] == list(range(8)) and [r['iter'] for r in b] == list(range(8))
    assert [r['loss'] for r in a] == [r['loss'] for r in b]  # bit for bit
    assert [r['lr'] for r in a] == [r['lr'] for r in b]
    assert a[0]['loss'] > a[-1]['loss']
    for key in ('tokens_per_s', 'flops_per_token', 'mfu', 'peak_mem_bytes', 'offload_bytes'):
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


def test_a_muon_run_resumes_bit_for_bit(tmp_path):
    """optimizer='muon': Muon's momentum is made with the optimizer, saved and loaded back, so 3 steps and 3 resumed
    are 6 straight ones bit for bit (a momentum restarted from zero would change steps 5 and 6)."""
    straight, split = str(tmp_path / 'straight'), str(tmp_path / 'split')
    muon = [*SMALL, '--optimizer=muon', '--eval_interval=100']
    run_train(*muon, '--max_iters=6', f'--out_dir={straight}')
    run_train(*muon, '--max_iters=3', f'--out_dir={split}')
    run_train(*muon, '--max_iters=6', f'--out_dir={split}', '--init_from=resume')
    a, b = read_log(straight), read_log(split)
    assert [r['iter'] for r in b] == list(range(6))
    assert [r['loss'] for r in a] == [r['loss'] for r in b] and a[0]['loss'] > a[-1]['loss']
    # its checkpoint holds Muon's state, not AdamW's: resuming it with AdamW is one line
    p = run_train(*SMALL, '--max_iters=8', f'--out_dir={split}', '--init_from=resume', check=False)
    assert p.returncode != 0 and "optimizer='adamw', but" in p.stderr and 'Traceback' not in p.stderr
    # and on data of another tokenizer (the same ids, read as 256 characters): one line, nothing
    # written
    other = tmp_path / 'other'
    shutil.copytree(os.path.join(ROOT, 'data', 'stdlib'), other, ignore=shutil.ignore_patterns('*.py'))
    meta = json.loads((other / 'meta.json').read_text())
    (other / 'meta.json').write_text(json.dumps({**meta, 'tokenizer': 'char',
                                                 'chars': ''.join(map(chr, range(256)))}))
    before = {f: open(os.path.join(split, f), 'rb').read() for f in sorted(os.listdir(split))
              if os.path.isfile(os.path.join(split, f))}
    p = run_train(*muon, '--max_iters=8', f'--out_dir={split}', f'--dataset={other}',
                  '--init_from=resume', check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-3000:]
    assert "was trained on data of tokenizer 'bytes'" in lines[0] and 'char (chars sha256' in lines[0]
    after = {f: open(os.path.join(split, f), 'rb').read() for f in sorted(os.listdir(split))
             if os.path.isfile(os.path.join(split, f))}
    assert after == before


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


def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resumes_as_if_never_stopped(tmp_path):
    out = str(tmp_path / 'run')
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *SMALL, '--max_iters=100000',
                          '--eval_interval=100000', f'--out_dir={out}'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: logged(out, 3), p, '3 rows logged')
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-2000:]
    stopped_at = checkpoint.meta(checkpoint.latest(out))['iter_num']
    assert stopped_at >= 3 and 'continue with --init_from=resume' in stdout
    # resumed, it goes on as the run that was never stopped: every row and the weights, bit for bit
    end = stopped_at + 3
    run_train(*SMALL, f'--max_iters={end}', '--eval_interval=100000', f'--out_dir={out}',
              '--init_from=resume')
    straight = str(tmp_path / 'straight')
    run_train(*SMALL, f'--max_iters={end}', '--eval_interval=100000', f'--out_dir={straight}')
    ref = {r['iter']: r['loss'] for r in read_log(straight)}
    rows = [r for r in read_log(out) if r['iter'] < end]
    assert {r['iter'] for r in rows} == set(range(end))
    assert all(r['loss'] == ref[r['iter']] for r in rows)
    a, b = (checkpoint.load_model(checkpoint.latest(d))[0] for d in (out, straight))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


KILLED_WRITER = """
import sys, time, torch
sys.path.insert(0, {root!r})
import torch.distributed.checkpoint as dcp
import checkpoint, optim, parallel
from knobs import Knobs
from model import Llama
torch.manual_seed(0)
model = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
params = list(model.parameters())
opt = optim.MasterWeights(list(model.named_parameters()), params, params, [torch.optim.AdamW(params)], parallel.Mesh(),
                          model.config)
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
    ref = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    model, _ = checkpoint.load_model(path)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b) and a.abs().sum() > 0, n


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=97))
    x = torch.randint(0, 97, (4, 24))
    y = torch.randint(0, 97, (4, 24))
    y[0, :20] = -100  # micro-steps with very different numbers of real targets
    y[2, 5:] = -100
    y[3, :] = -100  # and one with none at all

    def grads(micro):
        model.zero_grad(set_to_none=True)
        loss = train.forward_backward(model, micro, train.nullcontext())
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    big_loss, big = grads([train.Batch(x, y)])
    acc_loss, acc = grads([train.Batch(x[i:i + 1], y[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(acc_loss, big_loss, rtol=1e-6, atol=0)
    for name in big:
        err = (acc[name] - big[name]).norm() / big[name].norm()
        assert err < 1e-5, name
    # a mean of per-micro-step means would be a different loss: the test can tell them apart
    means = [model(x[i:i + 1], y[i:i + 1])[1] for i in range(3)]
    assert abs(torch.stack(means).mean() - big_loss) > 1e-2


def test_bf16_master_weights_accumulate_in_fp32():
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    ref = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    ref.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    masters = optim.make_master_weights(model)
    assert all(m.dtype == torch.float32 for m in masters)
    x = torch.randint(0, 50, (2, 16))
    micro = [train.Batch(x, x.roll(-1, 1))] * 3
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
    # offload_states: the model's 16 bytes per parameter are host memory too, checked the same way
    states = [*big, '--zero=3', '--offload_states=True', '--host_memory_budget_gb=0.0015']  # the block's 1 MiB fits
    p = run_train(*states, f'--out_dir={tmp_path / "states"}', check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and 'GiB of host memory per rank (1 blocks and the model states)' in errors[0]
    assert '16 bytes per parameter over dp x cp' in errors[0] and not os.path.exists(tmp_path / 'states' / 'log.jsonl')


def test_init_from_a_hugging_face_directory_fine_tunes_it(tmp_path):
    torch.manual_seed(0)
    Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                      vocab_size=300)).save_pretrained(tmp_path / 'hf')
    out = str(tmp_path / 'out')
    run_train(*SMALL, f'--init_from={tmp_path / "hf"}', '--max_iters=3', f'--out_dir={out}')
    args = checkpoint.meta(checkpoint.latest(out))['model_args']
    assert args['vocab_size'] == 300 and args['n_layer'] == 1


def test_a_hugging_face_model_extended_by_rope_scaling_trains_resumes_and_exports_to_transformers(tmp_path):
    """--rope_scaling replaces the checkpoint's (its rope_theta stays); resume keeps it and refuses another (an
    architecture change); the export loads in transformers, with the scaling, to the same logits."""
    import transformers
    torch.manual_seed(0)
    Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=300,
                      rope_theta=500000.0)).save_pretrained(tmp_path / 'hf')
    yarn = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16}  # seq_len is 32
    out, hf = str(tmp_path / 'out'), str(tmp_path / 'export')
    run_train(*SMALL, f'--init_from={tmp_path / "hf"}', f'--rope_scaling={yarn}', '--max_iters=2', f'--out_dir={out}')
    args = checkpoint.meta(checkpoint.latest(out))['model_args']
    assert args['rope_scaling'] == yarn and args['rope_theta'] == 500000.0
    other = {**yarn, 'factor': 8.0}
    line = last_error(run_train(*SMALL, '--init_from=resume', f'--rope_scaling={other}', '--max_iters=3',
                                f'--out_dir={out}', check=False))
    assert line.startswith(f'error: --init_from=resume with rope_scaling={other}, but ') and repr(yarn) in line
    run_train(*SMALL, '--init_from=resume', '--max_iters=3', f'--out_dir={out}')  # not given: the checkpoint's
    assert checkpoint.meta(checkpoint.latest(out))['iter_num'] == 3
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'checkpoint.py'), 'export', out, hf], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with open(os.path.join(hf, 'config.json')) as f:
        assert json.load(f)['rope_scaling'] == yarn
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf, attn_implementation='eager').float()
    assert theirs.config.rope_parameters == {**yarn, 'rope_theta': 500000.0}
    ours = checkpoint.load_model(checkpoint.latest(out))[0]
    idx = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        ref = theirs(idx).logits
        assert ((ours(idx) - ref).norm() / ref.norm()).item() < 1e-5


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


# ----------------------------------------------------------------------------- when things go wrong

def files(path):
    """{relative path: bytes} of every file under path: to show a refused run wrote nothing."""
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), 'rb').read()
            for d, _, fs in os.walk(path) for f in fs}


def last_error(p):
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    return p.stderr.strip().splitlines()[-1]


def test_resume_refuses_another_architecture_and_a_new_run_refuses_to_overwrite(tmp_path):
    out = str(tmp_path / 'out')
    run_train(*SMALL, '--max_iters=2', f'--out_dir={out}')
    before = files(out)
    line = last_error(run_train(*SMALL, '--max_iters=4', f'--out_dir={out}', '--init_from=resume', '--n_layer=3',
                                '--n_embd=64', check=False))
    assert line.startswith('error: --init_from=resume with n_layer=3, n_embd=64, but ') and \
        'made with n_layer=2, n_embd=32' in line
    line = last_error(run_train(*SMALL, '--max_iters=4', f'--out_dir={out}', check=False))
    assert line.startswith(f'error: {out} holds a checkpoint') and '--overwrite=True' in line
    assert files(out) == before
    run_train(*SMALL, '--max_iters=2', f'--out_dir={out}', '--overwrite=True')
    assert [r['iter'] for r in read_log(out)] == [0, 1, 0, 1]  # the log is appended to, never truncated


def test_a_non_finite_step_changes_nothing_and_a_few_in_a_row_stop_the_run(monkeypatch, capsys):
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    masters = optim.make_master_weights(model)
    opt, scaler = train.make_optimizer(model, masters, 'cpu'), optim.LossScaler()
    x = torch.randint(0, 50, (2, 16))
    bad, real = set(), train.forward_backward

    def forward_backward(model, *args):
        loss = real(model, *args)
        if len(steps) in bad:  # one gradient goes non-finite, as an overflow in backward would make it
            next(model.parameters()).grad[0, 0] = float('inf')
        return loss
    monkeypatch.setattr(train, 'forward_backward', forward_backward)
    steps = []

    def step():
        state = [t.clone() for p in opt.pieces for t in (p, *opt.state[p].values())]
        train.train_step(model, [train.Batch(x, x.roll(-1, 1))], train.nullcontext(), parallel.Mesh(), opt,
                         scaler=scaler)
        steps.append(not all(torch.equal(a, b) for a, b in
                             zip(state, [t for p in opt.pieces for t in (p, *opt.state[p].values())])))
        return int(scaler.skipped)
    bad.update({1, 3, 4, 5})
    assert [step() for _ in range(5)] == [0, 1, 0, 1, 2]  # steps skipped in a row
    train.check_finite(scaler, 5, 1e-3)  # 2 in a row: a spike, not yet a divergence
    assert step() == 3
    assert steps == [True, False, True, False, False, False]  # weights, moments and step count untouched
    with pytest.raises(SystemExit):
        train.check_finite(scaler, 6, 1e-3)
    assert capsys.readouterr().err.startswith('error: iter 3: the loss or gradient norm is not finite')


def test_a_diverging_run_stops_at_the_step_and_keeps_the_good_checkpoint(tmp_path):
    out = str(tmp_path / 'out')
    run_train(*SMALL, '--max_iters=4', '--eval_interval=2', f'--out_dir={out}')
    path = checkpoint.latest(out)
    before = files(out + '/ckpt')
    p = run_train(*SMALL, '--max_iters=100', '--eval_interval=100', f'--out_dir={out}', '--init_from=resume',
                  '--learning_rate=1e4', '--warmup_iters=0', check=False)
    line = last_error(p)
    assert line.startswith('error: iter ') and 'not finite (3 steps in a row' in line, line
    first = int(line.split()[2].rstrip(':'))
    rows = read_log(out)
    assert 4 <= first and rows[-1]['iter'] == first + 2  # stopped at the third skipped step: no later step ran
    assert files(out + '/ckpt') == before  # nothing saved since: the good checkpoint, byte for byte
    model, _ = checkpoint.load_model(path)
    assert all(torch.isfinite(p).all() for p in model.parameters())


SLOW_SECOND_SAVE = """
import sys, time
sys.path.insert(0, {root!r})
import torch.distributed.checkpoint as dcp
import train
finish, saves = dcp.FileSystemWriter.finish, []
def slow_finish(self, *args, **kw):  # the second save's files are written, its commit marker is not
    finish(self, *args, **kw)
    saves.append(1)
    if len(saves) == 2:
        print('writing', flush=True)
        time.sleep(600)
dcp.FileSystemWriter.finish = slow_finish
sys.argv = ['train.py'] + {args!r}
train.main()
"""


def test_kill_9_mid_step_and_mid_checkpoint_then_resume_gives_the_uninterrupted_losses(tmp_path):
    """Every row logged by a run killed twice and resumed twice is the uninterrupted run's row of that step:
    a kill costs the steps since the last complete checkpoint, nothing else."""
    out, run = str(tmp_path / 'killed'), [*SMALL, '--eval_interval=3']
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *run, '--max_iters=100000',
                          f'--out_dir={out}'], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: logged(out, 5), p, '5 rows logged')
    p.kill()  # SIGKILL, mid-step
    p.wait()
    resumed_at = checkpoint.meta(checkpoint.latest(out))['iter_num']
    script = tmp_path / 'slow.py'
    script.write_text(SLOW_SECOND_SAVE.format(root=ROOT, args=[*run, '--max_iters=100000', f'--out_dir={out}',
                                                               '--init_from=resume']))
    p = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert 'writing\n' in p.stdout  # reads up to the line that says the second save is being written
    p.kill()  # SIGKILL, mid-checkpoint: its files written, not committed
    p.wait()
    assert checkpoint.meta(checkpoint.latest(out))['iter_num'] == resumed_at  # the one before it
    end = resumed_at + 4
    run_train(*run, f'--max_iters={end}', f'--out_dir={out}', '--init_from=resume')
    straight = str(tmp_path / 'straight')
    run_train(*run, f'--max_iters={end}', f'--out_dir={straight}')
    ref = {r['iter']: r['loss'] for r in read_log(straight)}
    rows = [r for r in read_log(out) if r['iter'] < end]
    assert {r['iter'] for r in rows} == set(range(end)) and len(rows) > end  # some steps ran twice
    assert all(r['loss'] == ref[r['iter']] for r in rows)  # bit for bit
    a, b = (checkpoint.load_model(checkpoint.latest(d))[0] for d in (out, straight))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    out = str(tmp_path / 'out')
    run_train(*SMALL, '--max_iters=3', '--eval_interval=2', f'--out_dir={out}')
    path, before = checkpoint.latest(out), files(out + '/ckpt')

    def small_disk():  # files stop growing at 100 kB (the checkpoint's tensors are 0.5 MB): write() fails
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    p = run_train(*SMALL, '--max_iters=6', '--eval_interval=2', f'--out_dir={out}', '--init_from=resume',
                  check=False, preexec_fn=small_disk)
    line = last_error(p)
    assert line.startswith(f'error: cannot write a checkpoint in {out} (the previous one is kept)') and \
        'File too large' in line
    assert checkpoint.latest(out) == path and {k: v for k, v in files(out + '/ckpt').items() if k in before} == before
    assert checkpoint.meta(path)['iter_num'] == 3


def workers(pid):
    """{RANK: pid} of torchrun's worker processes."""
    found = {}
    for d in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{d}/stat') as f:
                parent = int(f.read().rpartition(')')[2].split()[1])
            with open(f'/proc/{d}/environ', 'rb') as f:
                env = dict(v.split(b'=', 1) for v in f.read().split(b'\0') if b'=' in v)
        except OSError:  # gone, or not ours to read
            continue
        if parent == pid and b'RANK' in env:
            found[int(env[b'RANK'])] = int(d)
    return found


@pytest.mark.parametrize('how', ['killed', 'stopped'])
def test_under_torchrun_a_rank_killed_or_stopped_ends_the_job(tmp_path, how):
    """kill -9: the other rank's collective fails at once and torchrun ends it. SIGSTOP: the other rank's
    collective gives up after timeout_s, says which, and torchrun ends the stopped one (after its 30 s grace)."""
    out = str(tmp_path / 'out')
    p = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          os.path.join(ROOT, 'train.py'), *SMALL, '--tp_size=2', '--max_iters=100000',
                          '--eval_interval=100000', '--timeout_s=10', f'--out_dir={out}'], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    wait_until(lambda: logged(out, 3), p, '3 rows logged')
    rank1 = workers(p.pid)[1]
    os.kill(rank1, signal.SIGKILL if how == 'killed' else signal.SIGSTOP)
    t0 = time.time()
    try:
        _, stderr = p.communicate(timeout=60)
    finally:  # a job that did not end: end it, the stopped rank first
        if p.poll() is None:
            os.kill(rank1, signal.SIGKILL)
            p.kill()
    assert time.time() - t0 < 60 and p.returncode != 0
    assert '[rank0]: Traceback' not in stderr, stderr[-3000:]  # (torchrun's own traceback follows: not ours)
    errors = [line for line in stderr.splitlines() if line.startswith('error: rank 0: ')]
    if how == 'stopped':  # killed: torchrun's SIGTERM may reach rank 0 before the broken connection does
        assert len(errors) == 1 and ' (from ' in errors[0] and 'Timed out waiting 10000ms' in errors[0], stderr
        assert '(timeout_s=10: a rank died or stopped responding)' in errors[0]


def doc_dataset(path, starts, n=400, vocab=50):
    """A prepared dataset whose documents begin at `starts` in both splits (data/tokenizer.py's format)."""
    os.makedirs(path, exist_ok=True)
    for split in ('train', 'val'):
        (np.arange(n) % vocab).astype(np.uint16).tofile(os.path.join(path, f'{split}.bin'))
        np.save(os.path.join(path, f'{split}.docs.npy'), np.array(starts, dtype=np.int64))
    with open(os.path.join(path, 'meta.json'), 'w') as f:
        json.dump(dict(tokenizer='bytes', vocab_size=vocab, dtype='uint16', train_tokens=n, val_tokens=n,
                       docs=True), f)
    return str(path)


def test_get_batch_with_doc_mask(tmp_path, monkeypatch):
    """Each window's positions restart at every document (a document cut by the window's start begins at 0),
    a target that is the next document's first token is ignored, docs are the starts in the flat rows."""
    starts = [0, 7, 30, 31, 90, 200]
    monkeypatch.setattr(train, 'seq_len', 20)
    monkeypatch.setattr(train, 'doc_mask', True)
    meta = {'dir': doc_dataset(tmp_path, starts), 'dtype': 'uint16', 'docs': True}
    x, y, pos, docs = train.get_batch(meta, 'train', 64, torch.Generator().manual_seed(0), torch.device('cpu'))
    ix = torch.randint(400 - 20 - 1, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for row, i in enumerate(ix):
        t = np.arange(i, i + 21)
        first = np.array([max(max(s for s in starts if s <= j), i) for j in t])
        assert pos[row].tolist() == (t - first)[:-1].tolist()
        begins = (t - first)[1:] == 0
        assert (y[row][torch.from_numpy(begins)] == -100).all()
        assert y[row][torch.from_numpy(~begins)].tolist() == (t[1:][~begins] % 50).tolist()
        assert x[row].tolist() == (t[:-1] % 50).tolist()
    assert docs.tolist() == torch.nonzero(pos.flatten() == 0).flatten().tolist()
    assert any((pos[r] == 0).sum() > 1 for r in range(64))  # some windows hold several documents
    # without doc_mask: the same windows, the same shape of batch, positions and docs None
    monkeypatch.setattr(train, 'doc_mask', False)
    plain = train.get_batch(meta, 'train', 64, torch.Generator().manual_seed(0), torch.device('cpu'))
    assert torch.equal(plain.x, x) and torch.equal(plain.y[:, -1], torch.from_numpy(np.array(ix) + 20) % 50)
    assert plain.positions is None and plain.docs is None


def test_doc_mask_trains_and_refuses_what_it_cannot_do(tmp_path):
    data = doc_dataset(tmp_path / 'data', [0, 7, 30, 31, 90, 200, 333])
    p = run_train(*SMALL, '--doc_mask=True', f'--dataset={data}', '--max_iters=3', '--eval_interval=2',
                  f'--out_dir={tmp_path / "out"}')
    assert 'note: 4 training documents are longer than seq_len=32' in p.stdout
    rows = read_log(tmp_path / 'out')
    assert all(np.isfinite(r['loss']) for r in rows)
    # MFU's count is the step's documents' pairs: no more than one document a row's, less where a row holds two
    whole = flops_per_token(Knobs(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                                  vocab_size=50), 32)
    assert all(r['flops_per_token'] <= whole for r in rows) and min(r['flops_per_token'] for r in rows) < whole
    os.remove(os.path.join(data, 'train.docs.npy'))
    with open(os.path.join(data, 'meta.json')) as f:
        meta = json.load(f)
    with open(os.path.join(data, 'meta.json'), 'w') as f:
        json.dump({**meta, 'docs': False}, f)
    p = run_train(*SMALL, '--doc_mask=True', f'--dataset={data}', f'--out_dir={tmp_path / "out2"}', check=False)
    assert p.returncode == 2 and p.stderr.strip().startswith('error: doc_mask=True: dataset') and 'Traceback' not in p.stderr


# ----------------------------------------------------------------------------- fp16 and loss scaling
TINY_F16 = [os.path.join(ROOT, 'config', 'train_tiny.py'), '--device=cpu', '--batch_size=2', '--seq_len=64',
            '--log_interval=1', '--eval_iters=1']


def test_float16_tracks_float32_over_50_steps_and_resumes_exactly(tmp_path):
    """train_tiny's model in fp16 (CPU autocast, fp32 masters, the loss scaled by 2^16): its losses are fp32's to
    fp16's rounding over 50 steps; a resume at step 31 continues its losses and its loss scale bit for bit."""
    f32, f16, split = (str(tmp_path / n) for n in ('f32', 'f16', 'split'))
    run = [*TINY_F16, '--max_iters=50', '--eval_interval=30']
    run_train(*run, '--dtype=float32', f'--out_dir={f32}')
    run_train(*run, '--dtype=float16', f'--out_dir={f16}')
    a, b = read_log(f32), read_log(f16)
    assert [r['iter'] for r in b] == list(range(50))
    # each step's loss is one small batch's, and a step that overflows is skipped (2^16 overflows here in a few,
    # on this CPU): the mean of every 10 steps, and the val loss
    means = [np.array([r['loss'] for r in log]).reshape(5, 10).mean(1) for log in (a, b)]
    assert np.abs(means[1] / means[0] - 1).max() < 0.03, means
    assert abs(b[-1]['val_loss'] / a[-1]['val_loss'] - 1) < 0.04
    assert b[0]['loss_scale'] == [2.0 ** 16, 1.0] and a[0]['loss_scale'] is None
    run_train(*TINY_F16, '--max_iters=31', '--eval_interval=30', '--dtype=float16', f'--out_dir={split}')
    run_train(*run, '--dtype=float16', f'--out_dir={split}', '--init_from=resume')
    c = read_log(split)
    assert [r['iter'] for r in c] == list(range(50))
    assert [(r['loss'], r['loss_scale']) for r in c] == [(r['loss'], r['loss_scale']) for r in b]


def test_an_overflow_skips_its_step_and_halves_the_scale_until_the_floor(monkeypatch):
    """fp16: a step whose gradients overflow changes no weight, moment or step count, halves the loss scale and does
    not count toward stopping the run; clean steps count toward doubling it; at the floor (1) an overflow counts
    as a non-finite step."""
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=1, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=50))
    x = torch.randint(0, 50, (2, 16))
    model(x, x.roll(-1, 1))[1].backward()  # fp32: the gradient norm clipping must see in fp16
    norm32 = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    model.zero_grad(set_to_none=True)
    model.to(torch.float16)
    masters = optim.make_master_weights(model)
    opt = train.make_optimizer(model, masters, 'cpu')
    scaler = optim.LossScaler(True)  # 2^16, no clean step yet
    bad, real, steps, norms = set(), train.forward_backward, [], []
    clip = torch.nn.utils.clip_grads_with_norm_  # (one process: the norm train_step sums, then torch's clip)

    def clip_grads_with_norm_(params, max_norm, norm):
        norms.append(norm)
        return clip(params, max_norm, norm)
    monkeypatch.setattr(torch.nn.utils, 'clip_grads_with_norm_', clip_grads_with_norm_)

    def forward_backward(model, *args):
        loss = real(model, *args)
        if len(steps) in bad:  # a gradient of the scaled loss beyond fp16's range
            opt.masters[0].grad[0, 0] = float('inf')
        return loss
    monkeypatch.setattr(train, 'forward_backward', forward_backward)

    def step():
        state = [t.clone() for p in opt.pieces for t in (p, *opt.state[p].values())]
        with torch.autocast('cpu', dtype=torch.float16):
            train.train_step(model, [train.Batch(x, x.roll(-1, 1))], train.nullcontext(), parallel.Mesh(), opt,
                             scaler=scaler)
        steps.append(not all(torch.equal(a, b) for a, b in
                             zip(state, [t for p in opt.pieces for t in (p, *opt.state[p].values())])))
        return scaler.factor.item(), scaler.clean.item(), int(scaler.skipped)
    bad.update({1, 2})
    assert [step() for _ in range(4)] == [(2.0 ** 16, 1, 0), (2.0 ** 15, 0, 0), (2.0 ** 14, 0, 0), (2.0 ** 14, 1, 0)]
    assert steps == [True, False, False, True]
    assert abs(norms[0] / norm32 - 1) < 1e-2  # the gradients were divided by 2^16 before clipping
    monkeypatch.setattr(optim, 'SCALE_GROWTH', 2)
    assert step() == (2.0 ** 15, 0, 0)  # the second clean step in a row: doubled
    scaler.factor = torch.tensor(1.0)  # at the floor: an overflow is a non-finite step like any
    bad.update({5, 6})
    assert [step() for _ in range(2)] == [(1.0, 0, 1), (1.0, 0, 2)]


@pytest.mark.filterwarnings('ignore:CUDA is not available')  # (the autocast it makes, on this CPU)
def test_auto_picks_float16_on_a_cuda_gpu_without_bfloat16_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(train, 'device', 'cuda')
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: False)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda dev: 'Tesla V100-SXM2-32GB')
    dev, ptdtype, autocast = train.device_and_dtype()
    assert dev.type == 'cuda' and ptdtype == torch.float16 and autocast.fast_dtype == torch.float16
    assert capsys.readouterr().out.splitlines()[0] == (
        "dtype='auto': float16 with loss scaling (Tesla V100-SXM2-32GB has no bfloat16)")
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: True)
    assert train.device_and_dtype()[1] == torch.bfloat16


def test_a_second_run_in_the_same_out_dir_stops_in_one_line_and_writes_nothing(tmp_path):
    """The first run holds out_dir (flock) for its life; a second one, launched meanwhile, stops naming the holder
    and leaves every file as it was; once the first dies (SIGKILL: no cleanup), the kernel has released the lock."""
    out = str(tmp_path / 'out')
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, 'train.py'), *SMALL, '--max_iters=100000',
                              '--eval_interval=2', f'--out_dir={out}'], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: checkpoint.latest(out), first, 'its first checkpoint')
        first.send_signal(signal.SIGSTOP)  # still alive, still holding the lock, writing nothing meanwhile
        before = files(out)
        p = run_train(*SMALL, '--max_iters=3', f'--out_dir={out}', '--init_from=resume', check=False)
        line = last_error(p)
        assert line.startswith(f"error: out_dir={out!r} is in use by another run (pid {first.pid} on "), line
        assert files(out) == before
    finally:
        first.kill()
        first.wait()
    run_train(*SMALL, '--max_iters=3', f'--out_dir={out}', '--init_from=resume')


TRACE = '''
import json, os, sys
sys.argv = ['train.py', *{args!r}]
sys.path.insert(0, {root!r})
import train
files, calls, step = set(), [], train.train_step


def tracer(frame, event, arg):
    files.add(frame.f_code.co_filename)
    return tracer


def traced(*args, **kw):
    """train_step, its steps 3 and 4 traced: every Python frame they enter."""
    calls.append(1)
    if len(calls) not in (3, 4):
        return step(*args, **kw)
    sys.settrace(tracer)
    try:
        return step(*args, **kw)
    finally:
        sys.settrace(None)


train.train_step = traced
train.main()
ours = sorted(os.path.basename(f) for f in files if os.path.dirname(f) == {root!r})
print(json.dumps(ours))
'''


@pytest.mark.parametrize('knobs', [[], ['--mlp_chunks=2']])
def test_the_default_step_runs_five_files(tmp_path, knobs):
    """One process, the default config (train_tiny's shape, smaller): steps 3 and 4 of train.py's loop run code
    in train.py, model.py, rope.py, optim.py and chunked.py (the loss) only (train.py's header says so); a chunk
    knob adds none. No parallel.py, no MoE walk, no offload.py."""
    files = ['chunked.py', 'model.py', 'optim.py', 'rope.py', 'train.py']
    args = [*SMALL, '--max_iters=5', '--eval_interval=100', f'--out_dir={tmp_path}', *knobs]
    p = subprocess.run([sys.executable, '-c', TRACE.format(args=args, root=ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == files


def test_wandb_log_writes_an_offline_run_of_the_logged_rows(tmp_path):
    """nanoGPT's wandb_log: rank 0's rows, here with WANDB_MODE=offline (no network): a run in
    out_dir/wandb whose records hold the losses log.jsonl has."""
    out = tmp_path / 'out'
    env = {**os.environ, 'WANDB_MODE': 'offline', 'WANDB_SILENT': 'true'}
    run_train(*SMALL, '--max_iters=3', '--eval_interval=2', f'--out_dir={out}', '--wandb_log=True',
              '--wandb_run_name=tiny', env=env)
    runs = list((out / 'wandb').glob('offline-run-*'))
    assert len(runs) == 1
    files = list(runs[0].glob('run-*.wandb'))
    assert len(files) == 1 and files[0].stat().st_size > 0
    # the history's records (protobuf) hold each value as its JSON text: every row's loss
    data = files[0].read_bytes()
    rows = read_log(out)
    assert len(rows) == 3
    for row in rows:
        assert json.dumps(row['loss']).encode() in data
    assert b'tiny' in data  # the run's name


def test_wandb_log_without_wandb_is_one_line_and_makes_no_out_dir(tmp_path):
    """README: a run that stops on its input writes nothing. With wandb not importable (None in
    sys.modules: find_spec answers None, as for a package not installed) wandb_log=True stops
    before out_dir is made."""
    out = tmp_path / 'out'
    code = ("import runpy, sys; sys.modules['wandb'] = None; "
            f"sys.argv = ['train.py', *{[*SMALL, f'--out_dir={out}', '--wandb_log=True']!r}]; "
            "runpy.run_path('train.py', run_name='__main__')")
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode != 0 and lines == ['error: wandb_log=True needs wandb: pip install wandb']
    assert not out.exists()
