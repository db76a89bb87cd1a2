"""eval.py: the passkey prompt's construction (data/passkey/prompt.py, which loads no core module),
the position buckets against train.evaluate's val loss and the LM head run once a token, eval.py
end to end on a trained checkpoint and on a Hugging Face directory (its pictures
parsed as SVG), measure.write_curves on a torn log, and data/passkey/prepare.py's format."""
import functools
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eval as ev
import measure
import parallel
import train
from data.passkey.prompt import (FILLER, NAMES, NEEDLE, NEEDLE_OF, QUESTION, QUESTION_OF, answer,
                                 multikey_prompt, passkey_prompt)
from data.tokenizer import get_tokenizer, read_docs, read_meta
from knobs import Knobs
from model import Llama
from sample import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=2', '--n_embd=32', '--n_head=4', '--n_kv_head=2', '--intermediate_size=64',
        '--batch_size=4', '--eval_iters=2', '--log_interval=1', '--device=cpu']


def run(script, *args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def svg(path):
    root = ET.parse(path).getroot()
    assert root.tag == '{http://www.w3.org/2000/svg}svg'
    return root


@pytest.fixture
def train_globals():
    """eval.read_config writes the config into train.py's globals: put them back after."""
    saved = dict(vars(train))
    yield
    for key in set(vars(train)) - set(saved):
        del vars(train)[key]
    vars(train).update(saved)


@pytest.fixture(scope='module')
def passkey_data(tmp_path_factory):
    """A small passkey corpus (64-token documents at most), prepared in-process."""
    spec = importlib.util.spec_from_file_location(
        'passkey_prepare', os.path.join(ROOT, 'data', 'passkey', 'prepare.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = str(tmp_path_factory.mktemp('passkey'))
    module.prepare(out, seq_len=128, train_docs=300, val_docs=40, seed=1)
    return out


def needle_at(ids, needle):
    """Where the sublist needle starts in ids (the first place), or -1."""
    for i in range(len(ids) - len(needle) + 1):
        if ids[i:i + len(needle)] == needle:
            return i
    return -1


# ----------------------------------------------------------------------------- the prompt
@pytest.mark.parametrize('kind', ['bytes', 'cl100k_base', 'hf'])
def test_passkey_prompt_has_its_length_and_the_key_at_its_depth(kind, tiny_hf):
    meta = {'tokenizer': kind}
    if kind == 'hf':  # a Llama-like tokenizer: encode adds a BOS to every text
        meta = {'tokenizer': 'hf', 'dir': tiny_hf.hf}
    encode, decode = get_tokenizer(meta)
    bos = encode('')
    needle = encode(NEEDLE.format(12345))[len(bos):]
    question = encode(QUESTION)[len(bos):]
    for length in (len(bos) + len(needle) + len(question), 100, 333, 1000):
        for depth in (0.0, 0.3, 0.5, 1.0):
            ids = passkey_prompt(encode, length, depth, 12345)
            assert abs(len(ids) - length) <= 1
            assert ids[:len(bos)] == bos and ids[-len(question):] == question
            room = length - len(bos) - len(needle) - len(question)
            # the needle's first token after depth x the filler
            start = needle_at(ids, needle)
            assert abs(start - len(bos) - depth * room) <= 1, (length, depth, start)
            text = decode(ids)
            assert text.count('12345') == 2 and text.endswith(QUESTION)


def test_a_prompt_too_short_for_the_needle_is_a_value_error():
    """(eval.py's main says a ValueError in one line)"""
    encode, _ = get_tokenizer({'tokenizer': 'bytes'})
    with pytest.raises(ValueError, match='passkey length 20: the needle and question alone'):
        passkey_prompt(encode, 20, 0.5, 12345)
    with pytest.raises(ValueError, match=r'passkey depth 1.5: must be in \[0, 1\]'):
        passkey_prompt(encode, 200, 1.5, 12345)


@pytest.mark.parametrize('kind', ['bytes', 'cl100k_base', 'hf'])
def test_multikey_prompt_has_k_needles_and_asks_for_the_one_at_its_depth(kind, tiny_hf):
    meta = {'tokenizer': kind}
    if kind == 'hf':
        meta = {'tokenizer': 'hf', 'dir': tiny_hf.hf}
    encode, decode = get_tokenizer(meta)
    bos = encode('')
    rng = random.Random(0)
    for k in (1, 2, 4):
        for length in (500, 1000):
            for depth in (0.0, 0.5, 1.0):
                ids, key = multikey_prompt(encode, length, depth, k, rng)
                assert len(ids) == length and ids[:len(bos)] == bos
                text = decode(ids)
                found = re.findall(r'The pass key of (\w+) is (\d{5})\. Remember it\. \2 is '
                                   r'the pass key of \1\. ', text)
                names = [name for name, _ in found]
                # k needles, k names of NAMES and k keys, none twice
                assert len(found) == k and len(set(names)) == k and set(names) <= set(NAMES)
                assert len({number for _, number in found}) == k
                asked = re.fullmatch(r'.*What is the pass key of (\w+)\? The pass key of \1 is',
                                     text, re.S).group(1)
                assert (asked, str(key)) in found
                needle = encode(NEEDLE_OF.format(name=asked, key=key))[len(bos):]
                question = encode(QUESTION_OF.format(name=asked))[len(bos):]
                assert ids[-len(question):] == question
                # the asked needle after depth x the filler: the room is what the needles and
                # the question leave, the needles before it the distractors drawn earlier
                start = needle_at(ids, needle)
                before = [n for n, _ in found[:names.index(asked)]]
                taken = sum(len(encode(NEEDLE_OF.format(name=n, key=number))[len(bos):])
                            for n, number in found if n in before)
                room = length - len(bos) - len(question) - sum(
                    len(encode(NEEDLE_OF.format(name=n, key=number))[len(bos):])
                    for n, number in found)
                assert abs(start - len(bos) - taken - depth * room) <= 1, (k, length, depth)
                # what the model should write next: the asked key, and no other
                assert decode(answer(encode, key)) == f' {key}.'


def test_a_multikey_prompt_too_short_or_with_too_many_needles_is_a_value_error():
    encode, _ = get_tokenizer({'tokenizer': 'bytes'})
    rng = random.Random(0)
    with pytest.raises(ValueError, match='multikey length 200: the 4 needles and question alone'):
        multikey_prompt(encode, 200, 0.5, 4, rng)
    with pytest.raises(ValueError, match=r'multikey needles 17: must be in \[1, 16\]'):
        multikey_prompt(encode, 5000, 0.5, 17, rng)
    with pytest.raises(ValueError, match=r'multikey needles 0'):
        multikey_prompt(encode, 5000, 0.5, 0, rng)
    with pytest.raises(ValueError, match=r'multikey depth -0.5: must be in \[0, 1\]'):
        multikey_prompt(encode, 5000, -0.5, 2, rng)


def test_the_passkey_prompt_loads_no_core_module():
    """data/passkey/prepare.py and its prompt import nothing from the repository's top level (the
    core: model, train, eval, ...), nor torch: preparing the corpus needs neither."""
    core = {name[:-3] for name in os.listdir(ROOT) if name.endswith('.py')}
    assert {'eval', 'model', 'train', 'chunked'} <= core
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('prepare', 'data/passkey/prepare.py')\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "import data.passkey.prompt\n"
            "print(' '.join(sys.modules))\n")
    # (python -c puts the working directory, ROOT, on sys.path: a core module would import)
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = set(p.stdout.split())
    assert 'data.passkey.prompt' in loaded and 'data.tokenizer' in loaded
    assert not loaded & (core | {'torch'}), loaded & (core | {'torch'})


def test_teacher_forced_verdicts_are_greedy_decodings_trial_by_trial(train_globals):
    """wrong_tokens' teacher-forced verdict on (prompt, answer) is sample.generate's greedy one:
    right (0 wrong) where greedy writes the answer, else not. A random model writes some 7
    tokens: those are right, and wrong with any one of them changed; the passkey's own
    answers (which it does not write) are not right. Rows of 2 a forward: spare rows too."""
    vars(train)['batch_size'] = 2
    encode, _ = get_tokenizer({'tokenizer': 'bytes'})
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                        vocab_size=256)).eval()
    rng = random.Random(0)
    for length in (110, 160):
        trials, keys = [], []
        for depth in (0.0, 0.5, 1.0):
            prompt, ids = ev.passkey_trial(encode, length + 1 - ev.ANSWER_ROOM, depth, rng)
            greedy = generate(model, torch.tensor([prompt]), 7, temperature=0)[0, len(prompt):]
            greedy = greedy.tolist()
            # a token changed: the first, one between (the tokens after it see another context:
            # 1 wrong at least), the last (exactly 1)
            for i in (0, 3, 6):
                changed = list(greedy)
                changed[i] = (changed[i] + 1) % 256
                trials.append((prompt, changed))
            trials.append((prompt, greedy))
            keys.append((prompt, ids))
        wrong = ev.wrong_tokens(model, None, parallel.Mesh(), nullcontext(), trials + keys, length)
        for k in range(3):
            first, between, last, right = wrong[4 * k:4 * k + 4]
            assert first >= 1 and between >= 1 and last == 1 and right == 0, wrong
        for (prompt, ids), n in zip(keys, wrong[len(trials):]):
            greedy = generate(model, torch.tensor([prompt]), len(ids), temperature=0)
            assert (n == 0) == (greedy[0, len(prompt):].tolist() == ids)


def test_a_cells_keys_are_the_same_whatever_else_a_run_asks_for(monkeypatch, train_globals):
    """retrieval seeds each (length, depth) cell alone: the keys of length 200 at depth 0.5 are
    the same asked alone or after other lengths and depths, and differ from cell to cell."""
    encode, _ = get_tokenizer({'tokenizer': 'bytes'})

    def keys(model, pipe, mesh, autocast, made, length):  # (in place of a forward: the answers)
        return [ids for _, ids in made]

    monkeypatch.setattr(ev, 'wrong_tokens', keys)
    make = functools.partial(ev.passkey_trial, encode)
    alone = ev.retrieval(None, None, parallel.Mesh(), None, make, [200], [0.5], 3, 'passkey')
    many = ev.retrieval(None, None, parallel.Mesh(), None, make, [150, 200], [0.0, 0.5], 3,
                        'passkey')
    assert many[1][1] == alone[0][0]
    assert many[0][1] != alone[0][0] and many[1][0] != alone[0][0]


def test_no_checkpoint_is_one_line(tmp_path, capsys, train_globals):
    with pytest.raises(SystemExit):
        ev.read_config([f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert err == f'error: no checkpoint in {tmp_path} (train one first: python train.py)\n'


@pytest.mark.parametrize('arg, says', [
    ('--passkey_lengths=[128.5]', "--passkey_lengths expects list[int], got '[128.5]'"),
    ("--passkey_lengths=['long']", "--passkey_lengths expects list[int], got \"['long']\""),
    ('--passkey_lengths=[0]', 'passkey_lengths=[0]: each a positive number of tokens'),
    ('--passkey_depths=[]', 'passkey_depths=[]: at least one depth'),
    ('--passkey_depths=[1.5]', 'passkey_depths=[1.5]: at least one depth, each in [0, 1]'),
    ('--passkey_trials=-3', 'passkey_trials=-3: must be >= 0'),
    ('--multikey_needles=[0]', 'multikey_needles=[0]: each a number of needles >= 1'),
])
def test_a_bad_eval_key_is_one_line_before_any_work(arg, says, capsys, train_globals):
    with pytest.raises(SystemExit) as e:
        ev.read_config(['--init_from=scratch', '--dataset=stdlib', '--device=cpu', arg])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: ') and says in err, err


# ----------------------------------------------------------------------------- loss by position
@pytest.mark.parametrize('doc_mask, loss_chunks', [(False, 1), (True, 3)])
def test_position_buckets_average_to_evaluates_val_loss(doc_mask, loss_chunks, tmp_path,
                                                        train_globals):
    cfg = ev.read_config(['--init_from=scratch', '--dataset=stdlib', '--seq_len=48',
                          '--batch_size=3', '--eval_iters=3', '--device=cpu',
                          f'--doc_mask={doc_mask}', f'--loss_chunks={loss_chunks}',
                          f'--out_dir={tmp_path}'])
    meta = train.read_dataset(1, 0)
    torch.manual_seed(0)
    model = Llama(Knobs(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                              vocab_size=256, loss_chunks=cfg['loss_chunks'])).eval()
    dev = torch.device('cpu')
    sums, counts = ev.loss_by_position(model, None, parallel.Mesh(), meta, nullcontext(), dev)
    expected = train.evaluate(model, meta, parallel.Mesh(), nullcontext(), dev)
    assert (sums.sum() / counts.sum()).item() == pytest.approx(expected, rel=1e-5)
    # each bucket against the whole [B, S, V] logits' losses, bucketed by hand
    generator = torch.Generator().manual_seed(train.seed + 1)
    reference = torch.zeros(7, dtype=torch.float64)
    for _ in range(3):
        x, y, positions, docs = train.get_batch(meta, 'val', 3, generator, dev)
        with torch.no_grad():
            logits = model(x, positions=positions, docs=docs)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction='none')
        if positions is None:
            positions = torch.arange(48).expand_as(y)
        for p, value in zip(positions[y != -100].tolist(), loss[y != -100].tolist()):
            reference[p.bit_length()] += value
    torch.testing.assert_close(sums, reference, rtol=1e-5, atol=1e-5)
    # 48 positions: buckets 0, 1, 2-3, 4-7, 8-15, 16-31, 32-47, every one of them with targets
    assert len(sums) == 7 and counts[:7].min() > 0
    if not doc_mask:  # each row's position p once a row: 2^(k-1) of them in bucket k
        assert counts.tolist() == [9, 9, 18, 36, 72, 144, 144]


class HeadRows(TorchDispatchMode):
    """The rows of every matrix product with `vocab` columns: the LM head's logits, whoever makes
    them (model.output's F.linear, chunked.py's torch.mm into its buffer, anything else)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        products = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        if func.overloadpacket in products and out.shape[-1] == self.vocab:
            self.rows.append(out.numel() // self.vocab)
        return out


@pytest.mark.parametrize('loss_chunks', [1, 3])
def test_loss_by_position_runs_the_lm_head_once_a_token(loss_chunks, tmp_path, train_globals):
    """Each target's logits are made once (not by the model's loss and then again for the
    buckets), and at most a chunk's at a time, never all B·S tokens' (loss_chunks = 1 too): 3 rows
    of 128 tokens, 384 > MIN_CHUNK_TOKENS = 256 of them."""
    ev.read_config(['--init_from=scratch', '--dataset=stdlib', '--seq_len=128', '--batch_size=3',
                    '--eval_iters=2', '--device=cpu', f'--loss_chunks={loss_chunks}', f'--out_dir={tmp_path}'])
    meta = train.read_dataset(1, 0)
    # (no other product in the model has 256 columns: n_embd 32, intermediate 64, 128 tokens)
    model = Llama(Knobs(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                        vocab_size=256, loss_chunks=loss_chunks)).eval()
    with HeadRows(256) as head:
        ev.loss_by_position(model, None, parallel.Mesh(), meta, nullcontext(),
                            torch.device('cpu'))
    # 2 batches of 3 x 128 tokens, each token's row of logits once
    assert sum(head.rows) == 2 * 3 * 128, head.rows
    assert max(head.rows) <= min(256, -(-3 * 128 // loss_chunks)), head.rows


# ----------------------------------------------------------------------------- end to end
def test_eval_end_to_end_on_a_checkpoint_trained_on_the_passkey_corpus(passkey_data, tmp_path):
    out = str(tmp_path / 'run')
    run('train.py', *TINY, f'--dataset={passkey_data}', '--seq_len=128', '--doc_mask=True',
        '--max_iters=3', '--eval_interval=2', f'--out_dir={out}')
    # the run's keys (dataset, seq_len, doc_mask) come from its checkpoint
    text = run('eval.py', f'--out_dir={out}', '--passkey_lengths=[112,128]',
               '--passkey_depths=[0.0,1.0]', '--passkey_trials=2', '--multikey_needles=[]')
    log = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
    assert 'val loss' in text and re.search(r'64 to\s+127', text)
    assert re.search(r'passkey accuracy\tdepth \\ length\t112\t128', text)
    assert len(re.findall(r'\n\t(0|1)\.0(\t\d+%){2}', text)) == 2
    cells = svg(os.path.join(out, 'passkey.svg')).findall('{http://www.w3.org/2000/svg}rect')
    assert len(cells) == 4
    assert svg(os.path.join(out, 'positions.svg')).findall('{http://www.w3.org/2000/svg}polyline')
    # train.py drew the run's curves at its evaluations
    lines = svg(os.path.join(out, 'curves.svg')).findall('{http://www.w3.org/2000/svg}polyline')
    # train loss, val loss (two evals: iters 0, 2), tokens/s, peak memory
    assert len(lines) == 4 and len(log) == 3


# ----------------------------------------------------------------------------- every layout
EVAL_ARGS = ['--passkey_lengths=[256,320]', '--passkey_depths=[0.0,0.5,1.0]', '--passkey_trials=3',
             '--multikey_needles=[2]']
LAYOUTS = [  # (name, processes, keys): each rank's piece of the model and of every batch
    ('cp 2 ring', 2, ['--cp_size=2', '--cp_impl=ring']),
    ('cp 2 Ulysses', 2, ['--cp_size=2']),
    ('tp 2 (and sp)', 2, ['--tp_size=2']),
    ('pp 2', 2, ['--pp_size=2', '--gradient_accumulation_steps=2']),  # (a pp run's: ga >= pp)
    ('Ulysses 2 x ring 2', 4, ['--cp_size=4', '--cp_ring=2']),
    # two dp ranks of half the rows each: the same global batch as one process's
    ('zero 3, dp 2', 2, ['--zero=3', '--batch_size=2'])]


@pytest.fixture(scope='module')
def trained(passkey_data, tmp_path_factory):
    """A checkpoint of 120 steps on the passkey corpus (one process), and one process's eval.json
    of it: the reference each layout must equal. (At this learning rate its answers are partly
    right: a few of the 7 answer tokens, a count that differs from trial to trial.)"""
    out = str(tmp_path_factory.mktemp('layouts') / 'run')
    run('train.py', *TINY, f'--dataset={passkey_data}', '--seq_len=128', '--doc_mask=True',
        '--max_iters=120', '--eval_interval=120', '--learning_rate=1e-2', '--warmup_iters=10',
        f'--out_dir={out}')
    run('eval.py', f'--out_dir={out}', *EVAL_ARGS)
    with open(os.path.join(out, 'eval.json')) as f:
        return out, json.load(f)


@pytest.mark.parametrize('nproc, args', [row[1:] for row in LAYOUTS],
                         ids=[row[0] for row in LAYOUTS])
def test_eval_under_a_layout_equals_one_process(trained, nproc, args):
    """torchrun eval.py under a layout: the loss by position equal to one process's, bucket by
    bucket (fp32, 1e-5), and each retrieval trial's wrong answer tokens the same, trial by trial."""
    out, one = trained
    os.remove(os.path.join(out, 'eval.json'))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
           f'--nproc_per_node={nproc}', os.path.join(ROOT, 'eval.py'), f'--out_dir={out}',
           *EVAL_ARGS, *args]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(out, 'eval.json')) as f:
        got = json.load(f)
    assert got['val_loss'] == pytest.approx(one['val_loss'], rel=1e-5)
    assert got['positions'] == pytest.approx(one['positions'], rel=1e-5)
    for what in ('passkey', 'multikey2'):
        assert got[what]['wrong_tokens'] == one[what]['wrong_tokens'], what
    # (a reference of verdicts that differ: a layout that mixed up its trials would show)
    assert len({n for cell in one['passkey']['wrong_tokens'] for row in cell for n in row}) > 1


@pytest.mark.parametrize('world, layout', [(1, []), (4, ['--tp_size=2', '--cp_size=2']),
                                            (2, ['--zero=3'])],
                         ids=['one GPU', 'tp 2 x cp 2', 'zero 3, dp 2'])
def test_eval_dry_run_peaks_in_a_forward_below_the_training_step(world, layout, tmp_path):
    """eval.py --dry_run=True at train.py's layout (WORLD_SIZE ranks, as the dry run takes
    them): the same estimate printed (the training step's), and a measured peak that is a
    forward's, below the training step's measured one."""
    env = {**os.environ, 'WORLD_SIZE': str(world), 'OMP_NUM_THREADS': '1'}
    reports = {}
    for script, name in (('train.py', 'memory.json'), ('eval.py', 'eval.memory.json')):
        out = tmp_path / script
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), 'config/train_tiny.py',
                            '--dry_run=True', *layout, f'--out_dir={out}'],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and 'verdict: fits' in p.stdout, p.stderr[-3000:]
        with open(out / name) as f:
            reports[script] = json.load(f)['ranks'][0]
    train_rank, eval_rank = reports['train.py'], reports['eval.py']
    assert eval_rank['world_size'] == train_rank['world_size'] == world
    assert eval_rank['estimate'] == train_rank['estimate']
    moment = eval_rank['measured']['moment']
    assert moment.startswith('forward') and 'backward' not in moment, moment
    assert 0 < eval_rank['measured']['total'] < train_rank['measured']['total']
    # no gradients, no optimizer state: a forward holds the weights and activations only
    assert eval_rank['measured']['grads'] == eval_rank['measured']['optimizer'] == 0


def test_eval_end_to_end_on_a_hugging_face_directory(tiny_hf, tmp_path):
    text = run('eval.py', f'--init_from={tiny_hf.hf}', f'--dataset={tiny_hf.data}',
               '--seq_len=16', '--batch_size=2', '--device=cpu', '--passkey_lengths=[112]',
               '--passkey_depths=[0.5]', '--passkey_trials=1', '--multikey_needles=[]',
               f'--out_dir={tmp_path}')
    assert 'val loss' in text and 'passkey accuracy' in text
    svg(tmp_path / 'positions.svg')
    svg(tmp_path / 'passkey.svg')


def test_eval_refuses_data_of_another_tokenizer(tiny_hf, tmp_path, capsys, train_globals):
    """train.setup's check (eval.py sets up as train.py does), one line."""
    cfg = ev.read_config([f'--init_from={tiny_hf.hf}', '--dataset=stdlib', '--device=cpu',
                          f'--out_dir={tmp_path}'])
    with pytest.raises(SystemExit):
        train.setup(cfg)
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and "made by the 'bytes' tokenizer" in err, err


def test_write_curves_takes_rows_missing_keys_and_a_torn_line(tmp_path):
    rows = [{'iter': 0, 'loss': 5.0, 'val_loss': 5.1, 'tokens_per_s': 100.0},
            {'iter': 1, 'loss': 4.0, 'peak_mem_bytes': 2 ** 30},
            {'iter': 2, 'loss': 3.0, 'tokens_per_s': 120.0, 'peak_mem_bytes': 2 ** 30}]
    # a run killed mid-line, then resumed: its next row lands on the torn line
    text = ''.join(json.dumps(r) + '\n' for r in rows) + '{"iter": 3, "lo' + json.dumps(rows[0])
    (tmp_path / 'log.jsonl').write_text(text)
    measure.write_curves(tmp_path)
    root = svg(tmp_path / 'curves.svg')
    lines = root.findall('{http://www.w3.org/2000/svg}polyline')
    # train loss (3 points), val loss (1), tokens/s (2), peak memory (2, flat)
    assert [len(line.get('points').split()) for line in lines] == [3, 1, 2, 2]


# ----------------------------------------------------------------------------- the corpus
def test_passkey_corpus_is_documents_of_prompt_and_answer(passkey_data):
    meta = read_meta(passkey_data, 130)
    meta['dir'] = passkey_data
    assert meta['tokenizer'] == 'bytes' and meta['docs'] is True
    _, decode = get_tokenizer(meta)
    for split in ('train', 'val'):
        ids = np.fromfile(os.path.join(passkey_data, f'{split}.bin'), dtype=meta['dtype'])
        starts = read_docs(meta, split)
        lengths = np.diff(starts, append=len(ids))
        assert len(starts) == {'train': 300, 'val': 40}[split] and lengths.max() <= 128
        for a, n in zip(starts[:20], lengths[:20]):
            doc = decode(ids[a:a + n].tolist())
            key = re.search(r'The pass key is (\d{5})\. Remember it\.', doc).group(1)
            assert doc.endswith(f'{QUESTION} {key}.\n')
            # before the needle: the filler from its start
            assert (FILLER * 3).startswith(doc.split('The pass key is')[0])


def test_multikey_corpus_is_documents_of_1_to_k_needles_and_the_asked_key(tmp_path):
    """prepare.py --needles=3: each document a multi-key prompt of 1 to 3 needles, then the
    answer, the key of the needle the question names; every k drawn."""
    spec = importlib.util.spec_from_file_location(
        'passkey_prepare', os.path.join(ROOT, 'data', 'passkey', 'prepare.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.prepare(str(tmp_path), seq_len=400, train_docs=60, val_docs=5, seed=1, needles=3)
    meta = read_meta(str(tmp_path), 401)
    meta['dir'] = str(tmp_path)
    assert meta['source'].endswith(', multi-key: 1 to 3 needles')
    _, decode = get_tokenizer(meta)
    ids = np.fromfile(tmp_path / 'train.bin', dtype=meta['dtype'])
    starts = read_docs(meta, 'train')
    ks = set()
    for a, n in zip(starts, np.diff(starts, append=len(ids))):
        doc = decode(ids[a:a + n].tolist())
        assert n <= 400
        keys = dict(re.findall(r'The pass key of (\w+) is (\d{5})\. Remember it\.', doc))
        asked, key = re.fullmatch(r'.*What is the pass key of (\w+)\? The pass key of \1 is '
                                  r'(\d{5})\.\n', doc, re.S).groups()
        assert keys[asked] == key
        ks.add(len(keys))
    assert ks == {1, 2, 3}


def test_write_curves_skips_foreign_lines_of_any_kind_and_says_so_once(tmp_path, capsys):
    """A resumed log holding bytes that aren't UTF-8, a bare number, a list, a row without a step
    or with text for a number: each line skipped, the rest drawn; said once, not at each call."""
    good = [{'iter': 0, 'loss': 5.0}, {'iter': 1, 'loss': 4.0, 'tokens_per_s': 'fast'},
            {'iter': 2, 'loss': float('nan')}, {'iter': 3, 'loss': 3.0}]
    foreign = [b'\xff\xfe', b'42', b'[1, 2]', b'{"loss": 2.0}', b'{"iter": "4", "loss": 2.0}', b'']
    text = b'\n'.join([json.dumps(r).encode() for r in good[:2]] + foreign
                      + [json.dumps(r).encode() for r in good[2:]])
    (tmp_path / 'log.jsonl').write_bytes(text)
    measure.write_curves(tmp_path)
    measure.write_curves(tmp_path)
    lines = svg(tmp_path / 'curves.svg').findall('{http://www.w3.org/2000/svg}polyline')
    # train loss: steps 0, 1 and 3 (step 2's NaN left out); no val loss, tokens/s or memory
    assert len(lines[0].get('points').split()) == 3
    assert capsys.readouterr().out.count('not train.py') == 1
