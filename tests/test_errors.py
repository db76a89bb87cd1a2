"""Bad input of every kind a user controls (--key=value, config files, data directories, Hugging Face
directories): one line naming the key or the file, a nonzero exit, no traceback, and out_dir byte for
byte as it was (a missing one not created). Each case is train.py run as `__main__` in a process of its
own with its own argv, as a user would run it; the processes are forked from one that imported torch
once (fork_each), since the import is most of a case's seconds, and a few run at once."""
import inspect
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_bpe
from knobs import Knobs
from model import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ['config/train_tiny.py', '--device=cpu', '--max_iters=2', '--batch_size=2', '--seq_len=32', '--compile=False']
NO_DEVICE = 'cuda' if not torch.cuda.is_available() else f'cuda:{torch.cuda.device_count()}'

# (case, arguments after BASE ({d}: a folder of spoiled inputs made below), what the line must name)
CASES = [
    # the 34: 19 gave a traceback, 12 were accepted, 3 were already one line
    ('batch_size=0', ['--batch_size=0'], 'batch_size'),
    ('seq_len=0', ['--seq_len=0'], 'seq_len'),
    ('seq_len=-1', ['--seq_len=-1'], 'seq_len'),
    ('learning_rate=-1', ['--learning_rate=-1'], 'learning_rate'),
    ('offload=1.5', ['--offload=1.5'], 'offload=1.5: must be in [0, 1]'),
    ('offload=-0.1', ['--offload=-0.1'], 'offload'),
    ('n_head=3', ['--n_head=3'], 'n_head=3'),
    ('n_kv_head=3', ['--n_kv_head=3'], 'n_kv_head=3'),
    ('n_embd=20', ['--n_embd=20'], 'n_embd=20'),
    ('recompute=bogus', ['--recompute=bogus'], 'recompute'),
    ('device=cuda', [f'--device={NO_DEVICE}'], 'device'),
    ('device=bogus', ['--device=bogus'], 'device'),
    ('out_dir=/proc/x', ['--out_dir=/proc/x'], 'out_dir'),
    ('eval_interval=0', ['--eval_interval=0'], 'eval_interval'),
    ('log_interval=0', ['--log_interval=0'], 'log_interval'),
    ('gradient_accumulation_steps=0', ['--gradient_accumulation_steps=0'], 'gradient_accumulation_steps'),
    ('beta1=2.0', ['--beta1=2.0'], 'beta1'),
    ('beta2=1.5', ['--beta2=1.5'], 'beta2'),
    ('eval_iters=-1', ['--eval_iters=-1'], 'eval_iters'),
    ('n_layer=0', ['--n_layer=0'], 'n_layer'),
    ('max_iters=-1', ['--max_iters=-1'], 'max_iters'),
    ('grad_clip=-1', ['--grad_clip=-1'], 'grad_clip'),
    ('weight_decay=-1', ['--weight_decay=-1'], 'weight_decay'),
    ('mlp_chunks=-1', ['--mlp_chunks=-1'], 'mlp_chunks'),
    ('loss_chunks=-3', ['--loss_chunks=-3'], 'loss_chunks'),
    ('attention_chunks=3', ['--attention_chunks=3'], 'attention_chunks=3: must divide n_kv_head=4'),
    ('attention_chunks with a token-wise offload', ['--attention_chunks=0', '--offload=0.5'],
     'offload.py cuts attention by tokens, not heads'),
    ('intermediate_size=0', ['--intermediate_size=0'], 'intermediate_size'),
    ('rope_theta=0', ['--rope_theta=0'], 'rope_theta'),
    ('rope_scaling a list', ['--rope_scaling=[1,2]'], "--rope_scaling expects dict | None, got '[1,2]'"),
    ('timeout_s not positive', ['--timeout_s=-1'], 'timeout_s=-1: must be a number of seconds > 0'),
    ('more experts a token than experts', ['--n_experts=4', '--experts_per_token=5'],
     'experts_per_token=5: must be <= n_experts=4'),
    ('ep_size in one process', ['--n_experts=4', '--ep_size=2'], 'ep_size=2 must divide the 1 dp x cp ranks'),
    ('n_experts=-1', ['--n_experts=-1'], 'n_experts=-1: must be >= 0'),
    ('ep_size=0', ['--ep_size=0'], 'ep_size=0: must be >= 1'),  # (a ZeroDivisionError traceback before)
    ('float16 with the optimizer in backward', ['--dtype=float16', '--optimizer_in_backward=True'],
     "optimizer_in_backward=True with dtype float16: a parameter's step can't wait"),
    ('optimizer unknown', ['--optimizer=sgd'], "optimizer='sgd': must be 'adamw' or 'muon'"),
    # Muon orthogonalizes whole matrices: the layouts that split them (one rank: a dry run stands in for two)
    ('muon with tp', ['--optimizer=muon', '--tp_size=2', '--dry_run=True'],
     "optimizer='muon': Muon needs whole matrices: it runs under dp, pp, cp and ep, not tp_size > 1 or zero=2, 3"),
    ('muon with zero', ['--optimizer=muon', '--zero=3'], "optimizer='muon': Muon needs whole matrices"),
    ('muon in backward', ['--optimizer=muon', '--optimizer_in_backward=True'],
     "optimizer_in_backward=True: needs one rank, gradient_accumulation_steps=1, zero=0 (no step's gradient to "
     "sum or share) and optimizer='adamw'"),
    ('rope_scaling of an unknown type', ["--rope_scaling={{'rope_type': 'ntk', 'factor': 2.0}}"],  # ({{: format's)
     "rope_scaling={'rope_type': 'ntk', 'factor': 2.0}: must be None or a dict of 'rope_type' and its fields"),
    ('min_lr=-1', ['--min_lr=-1'], 'min_lr'),
    ('warmup_iters=-5', ['--warmup_iters=-5'], 'warmup_iters'),
    ('norm_eps=-1', ['--norm_eps=-1'], 'norm_eps'),
    ('host_memory_budget_gb=-1', ['--host_memory_budget_gb=-1'], 'host_memory_budget_gb'),
    ('unknown key', ['--batch_sise=2'], 'batch_sise'),
    # a constant train.py imports is no key (it was, and ended in a KeyError traceback)
    ('a constant as a key', ["--MEMORY_KNOBS=('x',)"], "unknown config key 'MEMORY_KNOBS'"),
    ('seed past 63 bits', ['--seed=100000000000000000000000'], 'seed=100000000000000000000000: must be in [0, 2**63)'),
    ('dry_run_anatomy=-1', ['--dry_run_anatomy=-1'], 'dry_run_anatomy=-1: must be >= 0'),
    ('wrong type', ['--batch_size=two'], 'batch_size'),
    ('dtype unknown', ['--dtype=float8'], "dtype='float8': must be 'auto', 'float32', 'bfloat16' or 'float16'"),
    # a rule between keys (the others: test_parallel.py), init_from and out_dir (the config file: test_configurator.py)
    ('tp_size=2 on one process', ['--tp_size=2'], 'tp_size'),
    ('offload_states without zero=3', ['--offload_states=True'], 'offload_states=True streams each block'),
    ('init_from not a directory', ['--init_from={d}/no_such_model'], 'init_from'),
    ('resume without a checkpoint', ['--init_from=resume'], 'init_from=resume'),
    ('out_dir under a file', ['--out_dir={d}/a_file/out'], 'out_dir'),
    # data directories (--dataset takes a path)
    ('dataset not prepared', ['--dataset={d}/no_meta'], 'no_meta'),
    ('meta.json not JSON', ['--dataset={d}/bad_json'], 'meta.json'),
    ('meta.json without dtype', ['--dataset={d}/no_dtype'], 'meta.json'),
    ('train.bin truncated mid-token', ['--dataset={d}/odd_bytes'], 'train.bin'),
    ('train.bin shorter than meta.json', ['--dataset={d}/short_of_meta'], 'train.bin'),
    ('val.bin missing', ['--dataset={d}/no_val'], 'val.bin'),
    ('data shorter than a sequence', ['--dataset={d}/one_sequence'], 'train.bin'),
    ('doc_mask without document boundaries', ['--doc_mask=True', '--dataset={d}/no_docs'], 'doc_mask=True'),
    ('docs file missing', ['--dataset={d}/docs_missing'], 'train.docs.npy: missing'),
    ('docs file not .npy', ['--dataset={d}/docs_not_npy'], 'train.docs.npy: not a .npy file'),
    ('docs not increasing', ['--dataset={d}/docs_repeated'], 'val.docs.npy: offsets not strictly increasing'),
    ('docs past the tokens', ['--dataset={d}/docs_past_end'], 'train.docs.npy'),
    # data made by another tokenizer than the checkpoint's tokenizer.json
    ('bytes data for an HF tokenizer', ['--init_from={d}/hf_tok'], "the 'bytes' tokenizer"),
    ('another HF tokenizer', ['--init_from={d}/hf_tok', '--dataset={d}/other_hf'], 'hf_tok/tokenizer.json'),
    # Hugging Face directories
    ('HF config.json not JSON', ['--init_from={d}/hf_bad_json'], 'config.json'),
    ('HF config.json without a key', ['--init_from={d}/hf_no_key'], 'hidden_size'),
    ('HF heads that do not divide', ['--init_from={d}/hf_heads'], 'n_kv_head=3'),
    ('HF shard missing', ['--init_from={d}/hf_no_shard'], 'model-00002-of-00002.safetensors'),
    ('HF tensor of the wrong shape', ['--init_from={d}/hf_shape'], 'up_proj'),
    ('HF rope_scaling of an unknown type', ['--init_from={d}/hf_rope'], 'config.json: rope_scaling='),
    ('HF extended with a rope_scaling missing a field',  # the user's mistake, not config.json's
     ['--init_from={d}/hf_ok', "--rope_scaling={{'rope_type': 'yarn'}}"], "error: rope_scaling={'rope_type': 'yarn'}"),
    ('HF safetensors cut short', ['--init_from={d}/hf_cut'], 'model.safetensors'),
    # a None default's type (its annotation in train.py), a list's elements, finite numbers
    ('sliding_window a word', ['--sliding_window=abc'], '--sliding_window expects int | None'),
    ('sliding_window True', ['--sliding_window=True'], '--sliding_window expects int | None'),
    ('sliding_window fractional', ['--sliding_window=1.5'], '--sliding_window expects int | None'),
    ('layer_types of lists', ['--layer_types=[[1],[2],[3],[4]]'], '--layer_types expects list[str]'),
    ('layer_types a dict', ["--layer_types={{0: 'x'}}"], '--layer_types expects list[str]'),
    ('rope_theta infinite', ['--rope_theta=1e999'], '--rope_theta=1e999: numbers must be finite'),
    ('rope_scaling factor infinite', ["--rope_scaling={{'rope_type': 'linear', 'factor': 1e999}}"],
     'numbers must be finite'),
    ('learning_rate nan from a config file', ['{d}/nan_config.py'], 'learning_rate=nan'),
    # checks before out_dir is made: the data's ids, a dry run into a run's out_dir
    ('token ids past the vocabulary', ['--dataset={d}/ids_past_vocab'], "past meta.json's vocab_size=200"),
    ('a dry run into a run', ['--dry_run=True', '--out_dir={d}/a_run'], 'holds a run'),
]


def dataset(path, n_train=1000, n_val=1000, docs=None, **meta):
    """A bytes dataset; docs: {split: what to np.save as its docs file}, meta.json saying docs."""
    os.makedirs(path)
    (np.arange(n_train) % 256).astype(np.uint16).tofile(os.path.join(path, 'train.bin'))
    (np.arange(n_val) % 256).astype(np.uint16).tofile(os.path.join(path, 'val.bin'))
    for split, starts in (docs or {}).items():
        np.save(os.path.join(path, f'{split}.docs.npy'), starts)
    meta = {**meta, 'docs': True} if docs else meta
    meta = {'tokenizer': 'bytes', 'vocab_size': 256, 'dtype': 'uint16', 'train_tokens': n_train,
            'val_tokens': n_val, **meta}
    with open(os.path.join(path, 'meta.json'), 'w') as f:
        json.dump({k: v for k, v in meta.items() if v is not None}, f)


def hf_dir(path, ok, edit=lambda hf: None):
    shutil.copytree(ok, path)
    with open(os.path.join(path, 'config.json')) as f:
        hf = json.load(f)
    edit(hf)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(hf, f)


EVAL = ['eval.py', '--init_from=scratch', '--dataset=stdlib', '--device=cpu']
SAMPLE = ['sample.py', '--device=cpu']
PLAN = ['plan.py', '--svg={d}/plan.svg']
# the other entry points: (case, the whole argv, what the line must name)
SCRIPT_CASES = [
    ('eval: a fractional passkey length', [*EVAL, '--passkey_lengths=[128.5]'], '--passkey_lengths'),
    ('eval: a word for a passkey length', [*EVAL, "--passkey_lengths=['long']"], '--passkey_lengths'),
    ('eval: a passkey length of 0', [*EVAL, '--passkey_lengths=[0]'], 'passkey_lengths=[0]'),
    ('eval: no depth', [*EVAL, '--passkey_depths=[]'], 'passkey_depths=[]'),
    ('eval: a depth past 1', [*EVAL, '--passkey_depths=[0.5, 2]'], 'passkey_depths=[0.5, 2.0]'),
    ('eval: a passkey length shorter than its question', [*EVAL, '--passkey_lengths=[5]'],
     'passkey at length 5'),
    ('eval: negative trials', [*EVAL, '--passkey_trials=-3'], 'passkey_trials=-3'),
    ('eval: a window of True', [*EVAL, '--sliding_window=True'], '--sliding_window'),
    ('eval: no checkpoint', ['eval.py', '--device=cpu'], 'no checkpoint'),
    ('sample: no such device', ['sample.py', '--device=bogus'], "device='bogus'"),
    ('sample: a GPU this machine lacks', ['sample.py', f'--device={NO_DEVICE}'], 'device='),
    ('sample: a negative temperature', [*SAMPLE, '--temperature=-1'], 'temperature=-1'),
    ('sample: a negative top_k', [*SAMPLE, '--top_k=-1'], 'top_k=-1'),
    ('sample: no samples', [*SAMPLE, '--num_samples=0'], 'num_samples=0'),
    ('sample: a word for num_samples', [*SAMPLE, '--num_samples=many'], '--num_samples'),
    ('sample: a missing prompt file', [*SAMPLE, '--start=FILE:{d}/no_prompt'], '--start=FILE:'),
    ('sample: a lone surrogate', [*SAMPLE, '--start=\udcff'], '--start'),
    ('sample: no checkpoint', SAMPLE, 'no checkpoint'),
    ('sample: an HF directory without weights', [*SAMPLE, '--init_from={d}/hf_no_weights'],
     'model.safetensors'),
    ('plan: a negative step', [*PLAN, '--step=-65536'], 'step=-65536'),
    ('plan: a negative seq_len', [*PLAN, '--seq_len=-8'], 'seq_len=-8'),
    ('plan: no peak', [*PLAN, '--peak_tflops=0'], 'peak_tflops=0'),
    ('plan: no GPU memory', [*PLAN, '--gpu_gb=0'], 'gpu_gb=0'),
    ('plan: negative host memory', [*PLAN, '--host_gb=-5'], 'host_gb=-5'),
    ('plan: infinite GPU memory', [*PLAN, '--gpu_gb=1e999'], '--gpu_gb=1e999'),
    ('plan: gpus not a multiple of nodes', [*PLAN, '--gpus=3', '--nodes=2'], 'gpus=3'),
]


def spoiled_inputs(d):
    """Every bad file the cases name, under d."""
    open(os.path.join(d, 'a_file'), 'w').close()
    with open(os.path.join(d, 'nan_config.py'), 'w') as f:
        f.write("learning_rate = float('nan')\n")
    dataset(os.path.join(d, 'no_meta'))
    os.remove(os.path.join(d, 'no_meta', 'meta.json'))
    dataset(os.path.join(d, 'bad_json'))
    with open(os.path.join(d, 'bad_json', 'meta.json'), 'w') as f:
        f.write('{"vocab_size": 256,')
    dataset(os.path.join(d, 'no_dtype'), dtype=None)
    dataset(os.path.join(d, 'odd_bytes'))
    with open(os.path.join(d, 'odd_bytes', 'train.bin'), 'ab') as f:
        f.write(b'\0')  # a copy cut off mid-token
    dataset(os.path.join(d, 'short_of_meta'), train_tokens=2000)
    dataset(os.path.join(d, 'no_val'))
    os.remove(os.path.join(d, 'no_val', 'val.bin'))
    dataset(os.path.join(d, 'one_sequence'), n_train=33)  # seq_len + 1 tokens: no window to draw at random
    dataset(os.path.join(d, 'no_docs'))
    good = np.array([0, 100, 500])
    dataset(os.path.join(d, 'docs_missing'), docs={'val': good})
    dataset(os.path.join(d, 'docs_not_npy'), docs={'train': good, 'val': good})
    with open(os.path.join(d, 'docs_not_npy', 'train.docs.npy'), 'wb') as f:
        f.write(b'0 100 500\n')
    dataset(os.path.join(d, 'docs_repeated'), docs={'train': good, 'val': np.array([0, 100, 100])})
    dataset(os.path.join(d, 'docs_past_end'), docs={'train': np.array([0, 1000]), 'val': good})
    dataset(os.path.join(d, 'other_hf'), tokenizer='hf', tokenizer_sha256='0' * 64)
    dataset(os.path.join(d, 'ids_past_vocab'), vocab_size=200)  # ids 0..255
    os.makedirs(os.path.join(d, 'a_run', 'ckpt'))  # an out_dir holding a run
    with open(os.path.join(d, 'a_run', 'log.jsonl'), 'w') as f:
        f.write('{"iter": 0, "loss": 5.0}\n')
    ok = os.path.join(d, 'hf_ok')
    torch.manual_seed(0)
    Llama(Knobs(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=256)
          ).save_pretrained(ok)
    hf_dir(os.path.join(d, 'hf_bad_json'), ok)
    with open(os.path.join(d, 'hf_bad_json', 'config.json'), 'w') as f:
        f.write('{"hidden_size": 32')
    hf_dir(os.path.join(d, 'hf_no_key'), ok, lambda hf: hf.pop('hidden_size'))
    hf_dir(os.path.join(d, 'hf_heads'), ok, lambda hf: hf.update(num_key_value_heads=3))
    hf_dir(os.path.join(d, 'hf_rope'), ok, lambda hf: hf.update(rope_scaling={'rope_type': 'longrope', 'factor': 2.0}))
    hf_dir(os.path.join(d, 'hf_no_shard'), ok)
    state = load_file(os.path.join(ok, 'model.safetensors'))
    os.rename(os.path.join(d, 'hf_no_shard', 'model.safetensors'),
              os.path.join(d, 'hf_no_shard', 'model-00001-of-00002.safetensors'))
    with open(os.path.join(d, 'hf_no_shard', 'model.safetensors.index.json'), 'w') as f:
        json.dump({'weight_map': {name: f'model-0000{1 + i % 2}-of-00002.safetensors'
                                  for i, name in enumerate(state)}}, f)
    hf_dir(os.path.join(d, 'hf_shape'), ok)
    state['model.layers.0.mlp.up_proj.weight'] = torch.zeros(63, 32)
    save_file(state, os.path.join(d, 'hf_shape', 'model.safetensors'))
    hf_dir(os.path.join(d, 'hf_cut'), ok)
    with open(os.path.join(d, 'hf_cut', 'model.safetensors'), 'r+b') as f:
        f.truncate(100)
    hf_dir(os.path.join(d, 'hf_no_weights'), ok)
    os.remove(os.path.join(d, 'hf_no_weights', 'model.safetensors'))
    hf_dir(os.path.join(d, 'hf_tok'), ok)
    tiny_bpe(['any text'], vocab_size=256).save(os.path.join(d, 'hf_tok', 'tokenizer.json'))


def snapshot(path):
    """Every file and folder under path with its bytes; None if path does not exist."""
    if not os.path.lexists(path):
        return None
    tree = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(folder, name)
            tree[os.path.relpath(p, path)] = open(p, 'rb').read() if os.path.isfile(p) else 'dir'
    return tree


def fork_each():
    """Run a script (argv[0]: train.py, eval.py, plan.py, sample.py) as `__main__` once per run of stdin's JSON {'runs': [[argv, stdout file, stderr
    file], ...], 'jobs': n}, n at a time, each in a process of its own forked from this one; print their
    exit codes as JSON. Run as the fresh `python -c` of the fixture below: importing torch and train.py's
    modules is ~90% of a case's seconds, so this process imports them once and each case forks from it.
    Nothing here runs a torch op, so no thread pool exists to fork. A child is the process `python
    train.py ARGS` would be after its imports: its own argv, fds 1 and 2 on its files, an uncaught
    exception's traceback and exit status 1, SystemExit's code; past 300 s SIGALRM ends it (a timeout,
    as subprocess.run's was)."""
    import json
    import os
    import signal
    import sys
    import types
    import importlib
    sys.path[0] = os.path.abspath('.')  # as `python train.py` has, the scripts' folder
    for name in ('train', 'eval', 'plan', 'sample'):
        # torch and every module the scripts import (their main() does not run)
        importlib.import_module(name)
    todo = json.load(sys.stdin)
    runs, jobs = todo['runs'], todo['jobs']
    codes, running = [None] * len(runs), {}
    for i, (argv, out, err) in enumerate(runs):
        if len(running) == jobs:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        script = os.path.abspath(argv[0])  # as `python train.py` has __file__
        sys.stdout.flush()  # (or a child would write this process's buffer into its file)
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            running[pid] = i
            continue
        code = 1
        try:
            signal.alarm(300)
            for fd, path in ((1, out), (2, err)):
                opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(opened, fd)
                os.close(opened)
            sys.argv = argv
            # as the interpreter runs a script (runpy.run_path would set argv[0] to its path)
            main = sys.modules['__main__'] = types.ModuleType('__main__')
            main.__file__ = script
            try:
                with open(script, 'rb') as f:
                    exec(compile(f.read(), script, 'exec'), vars(main))
                code = 0
            except SystemExit as e:  # the interpreter's rule for its code
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                sys.excepthook(*sys.exc_info())
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(codes))


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    """{case: (process, out_dir, its snapshot before)}: every case's train.py, a few at a time, each
    forked from one process that imported torch once (fork_each); process: its returncode, stdout
    and stderr."""
    d = str(tmp_path_factory.mktemp('inputs'))
    logs = str(tmp_path_factory.mktemp('logs'))
    spoiled_inputs(d)
    runs = []
    every = [(case, ['train.py', *BASE, *args], names) for case, args, names in CASES]
    for i, (case, args, _) in enumerate(every + SCRIPT_CASES):
        out_dir = os.path.join(d, 'out', str(i))
        if i % 2:  # half of them into an out_dir that holds something already
            os.makedirs(out_dir)
            with open(os.path.join(out_dir, 'notes.txt'), 'w') as f:
                f.write('mine\n')
        args = [a.format(d=d) for a in args]
        if not any(a.startswith('--out_dir=') for a in args):
            args.append(f'--out_dir={out_dir}')
        out_dir = next(a for a in args if a.startswith('--out_dir='))[len('--out_dir='):]
        runs.append((case, args, out_dir, snapshot(out_dir)))
    files = [(os.path.join(logs, f'{i}.out'), os.path.join(logs, f'{i}.err')) for i in range(len(runs))]
    todo = {'runs': [(argv, *f) for (_, argv, _, _), f in zip(runs, files)],
            'jobs': max(2, os.cpu_count() or 1)}
    driver = subprocess.run([sys.executable, '-c', inspect.getsource(fork_each) + 'fork_each()\n'],
                            cwd=ROOT, input=json.dumps(todo), capture_output=True, text=True,
                            timeout=300 * len(runs), env={**os.environ, 'OMP_NUM_THREADS': '1'})
    # its own output: the exit codes only (a warning at import would be in every case's output)
    assert driver.returncode == 0 and driver.stderr == '', driver.stderr[-3000:]
    done = {}
    for (case, argv, out_dir, before), code, (out, err) in zip(runs, json.loads(driver.stdout), files):
        with open(out) as o, open(err) as e:
            p = subprocess.CompletedProcess([sys.executable, *argv], code, o.read(), e.read())
        done[case] = (p, out_dir, before)
    return done


@pytest.mark.parametrize('case,names', [(c, n) for c, _, n in CASES + SCRIPT_CASES],
                         ids=[c for c, _, _ in CASES + SCRIPT_CASES])
def test_bad_input_is_one_line_and_leaves_out_dir_alone(results, case, names):
    p, out_dir, before = results[case]
    output = p.stdout + p.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert p.returncode != 0, output[-3000:]
    assert 'Traceback' not in output, output[-3000:]
    assert len(lines) == 1 and lines[0].startswith('error: ') and names in lines[0], output[-3000:]
    assert snapshot(out_dir) == before


def test_there_are_at_least_40_cases():
    assert len({c for c, _, _ in CASES}) == len(CASES) >= 40


def test_help_lists_the_settings_only():
    """--help lists train.py's settings, the keys: not a constant it defines or imports (MEMORY_KNOBS, SCALE_GROWTH
    were listed)."""
    p = subprocess.run([sys.executable, 'train.py', '--help'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    keys = [line[4:].partition('=')[0] for line in p.stdout.splitlines() if line.startswith('  --')]
    assert p.returncode == 0 and {'seq_len', 'out_dir', 'auto_memory'} <= set(keys), p.stdout
    assert {f.name for f in fields(Knobs)} <= set(keys)  # the model's own keys
    assert [k for k in keys if not k.islower()] == []


@pytest.mark.parametrize('args,names', [
    (['--batch_sise=2'], 'batch_sise'),  # the configurator, before any process group
    (['--tp_size=2', '--intermediate_size=383'], 'intermediate_size=383'),  # the layout, in the process group
], ids=['unknown key', 'layout'])
def test_under_torchrun_the_line_is_printed_once(tmp_path, args, names):
    out_dir = tmp_path / 'out'
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'train.py', *BASE, *args, f'--out_dir={out_dir}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    output = p.stdout + p.stderr
    assert p.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith('error: ')]
    assert len(errors) == 1 and names in errors[0], output[-3000:]
    assert not out_dir.exists()
