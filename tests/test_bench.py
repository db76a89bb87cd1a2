"""bench.py, bench/vs_nanogpt.py and bench/peers.py run end to end at toy sizes (their figures are for bench/RESULTS.md, not
for tests: nothing here is timed). What they compute is checked where it has a right answer: the step
benchmark's four variants train the same model, so their losses agree. A bad value of a key is one
'error: ' line naming it, before any benchmark starts (BAD_KEYS)."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ['--n_layer=1', '--n_embd=32', '--n_head=4', '--n_kv_head=2', '--intermediate_size=64', '--vocab_size=1000',
       '--results=']


def run(script, *args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def table_rows(out):
    return [[c.strip() for c in line.strip('|').split('|')] for line in out.splitlines()
            if line.startswith('| ') and not line.startswith('| seq_len') and not line.startswith('| N=')]


def test_step_mode_runs_every_variant_to_the_same_loss():
    rows = table_rows(run('bench.py', '--mode=step', '--seq_lens=300', *TOY))
    names = ('plain', 'recompute', 'chunked+recompute', 'chunked+recompute+heads')
    assert [(r[0], r[1]) for r in rows] == [('300', v) for v in names]
    assert len({float(r[7]) for r in rows}) == 1, rows  # recompute and chunking change memory, not the loss
    for r in rows:
        assert r[2].endswith(' GB') and float(r[3].replace(',', '')) > 0
        # GFLOP/s, the model's and the hardware's (recompute's forward counted: test_model checks the counts)
        assert 0 <= float(r[4].replace(',', '')) <= float(r[5].replace(',', ''))


def test_moe_mode_times_the_dense_mlp_and_two_moes_of_its_flops():
    """train_tiny's model with its dense MLP, then 8 experts top 2 and 32 top 4 of I/k each; each ratio is its
    median over the dense one's."""
    rows = table_rows(run('bench.py', '--mode=moe', '--reps=2', '--results='))
    names = [('dense', '384'), ('8 experts, top 2', '192'), ('32 experts, top 4', '96')]
    assert [(r[0], r[1]) for r in rows] == names
    medians = [float(r[2].removesuffix(' ms')) for r in rows]
    for r, median in zip(rows, medians):
        steps = [float(t) for t in r[3].split(', ')]
        assert len(steps) == 2 and min(steps) <= median <= max(steps)
        assert abs(float(r[4]) - median / medians[0]) < 2e-3, r


def test_loss_mode_runs_the_variants_in_rounds():
    names = ['ours chunked (auto)', 'ours chunked (384 tokens)', 'torch LCE chunk=256']
    rows = table_rows(run('bench.py', '--mode=loss', '--loss_tokens=600', '--reps=1', '--rounds=2',
                          '--variants=' + ','.join(names), *TOY))
    assert [r[0] for r in rows] == names
    for r in rows:
        assert 'error' not in r[1], r
        times = r[3].split(', ')
        assert len(times) == 2 and all(float(t) >= 0 for t in times)  # one run per round


def test_vs_nanogpt_times_both_trainers(tmp_path):
    sys.path.insert(0, ROOT)
    from data.char.prepare import prepare
    text = tmp_path / 'input.txt'
    text.write_text('the quick brown fox jumps over the lazy dog.\n' * 400)
    prepare(str(text), str(tmp_path / 'toy'))
    out = run('bench/vs_nanogpt.py', f'--dataset={tmp_path / "toy"}', '--steps=2', '--warmup=1')
    lines = [line for line in out.splitlines() if not line.startswith('Overriding:')]
    assert lines[0].startswith('parameters: nanoGPT ') and 'compile=none' in lines[0]
    assert lines[1].startswith('nanoGPT, GPT-2 block') and lines[2].startswith('nanolong, Llama')
    assert float(lines[3].rsplit(' ', 1)[1]) > 0


def test_docs_mode_times_one_process_and_the_ring_on_the_same_attention():
    rows = table_rows(run('bench.py', '--mode=docs', '--seq_lens=256', '--documents=0,4', '--windows=0,16',
                          '--q_heads=4', '--kv_heads=2', '--head_dim=16', '--reps=2', '--results='))
    runs = ('1 process, 1 thread', 'ring cp 2, 1 thread a rank')
    cells = [('256', n, w, how) for how in runs for w in ('none', '16') for n in ('no mask', '4')]
    assert [tuple(r[:4]) for r in rows] == cells
    for r in rows:
        times = r[5].split(', ')
        assert len(times) == 2 and all(float(t) >= 0 for t in times), r  # --reps runs, each timed
        assert float(r[6].replace(',', '')) > 0 and r[9].endswith(' s') and float(r[9][:-2]) >= 0
    # the ratio's base: each run's row with no mask and no window
    assert rows[0][7] == rows[4][7] == '1.00'
    # both runs compute the same attention (Σ y² of the ring's shards adds up to the one process's),
    # and the mask and the window change it
    one, ring = [[float(r[10]) for r in rows[i:i + 4]] for i in (0, 4)]
    assert ring == pytest.approx(one, rel=1e-4) and len(set(one)) == 4, rows
    # bytes sent: none in one process; the ring's busiest rank, under a window at most 2·(W - 1)
    # tokens of k, v a rank (ring.py's header) forward, as many again backward, and their dk, dv
    assert {r[8] for r in rows[:4]} == {'-'}
    sent = [int(r[8].replace(',', '')) for r in rows[4:]]
    token_bytes = 2 * 2 * 16 * 4  # k and v, 2 kv heads of 16, fp32
    assert 0 < sent[2] <= 3 * 2 * 15 * token_bytes < sent[0], sent


def test_docs_mode_runs_the_ring_alone():
    rows = table_rows(run('bench.py', '--mode=docs', '--seq_lens=256', '--documents=0', '--windows=64',
                          '--q_heads=2', '--kv_heads=1', '--head_dim=16', '--reps=1', '--one_process=False',
                          '--results='))
    assert [tuple(r[:4]) for r in rows] == [('256', 'no mask', '64', 'ring cp 2, 1 thread a rank')]
    # no run without a window: no ratio
    assert rows[0][7] == '-' and int(rows[0][8].replace(',', '')) > 0


def test_peers_side_by_side_trains_the_same_weights_to_the_same_loss():
    """bench/peers.py: Hugging Face's Llama and ours, plain and with their memory recipes, from one set of weights:
    the first step's loss is the same in all four (our model is HF's numerically), ours are compared with HF's, and
    the longest-length search stops where a step's peak passes --mem_gb (HF's 1,024-token step needs more than
    0.5 GiB: its logits, log-softmax and their gradient, 3 x 1,024 x 128,256 fp32). The search, a process of
    1,024 tokens a system (most of this test's time), runs for the two systems its checks are on: HF plain, which
    passes the limit, and ours chunked, which stays within it; the side-by-side table runs all four."""
    out = run('bench/peers.py', '--seq_lens=64', '--rounds=1', '--steps=1', '--mem_gb=0', '--results=')
    rows = [r for r in table_rows(out) if r[0] == '64'][:4]  # (printed as made, then as the table)
    assert [r[1] for r in rows] == ['hf plain', 'hf checkpointed', 'ours plain', 'ours chunked']
    assert len({r[6] for r in rows}) == 1, rows  # the first loss, to 4 decimals
    assert all(float(r[2].replace(',', '')) > 0 for r in rows)
    assert rows[2][5].endswith(')') and 'x, peak' in rows[2][5] and rows[0][5] == ''
    assert 'whose step peaks within' not in out  # --mem_gb=0: no search
    out = run('bench/peers.py', '--seq_lens=', '--systems=hf plain,ours chunked', '--mem_gb=0.5',
              '--max_len=1024', '--results=')
    assert not [r for r in table_rows(out) if len(r) > 3 and r[0] != 'tokens']  # no lengths: no side-by-side rows
    assert "longest hf plain S=1,024: {'times'" in out  # HF's step ran, and its peak passed the limit: no error
    longest = {r[0]: r[1] for r in table_rows(out) if len(r) == 3 and r[0] != 'system'}
    assert longest == {'hf plain': '< 1,024', 'ours chunked': '1,024'}, longest


# (case, the script and its arguments ({d}: a scratch folder holding an empty file, afile), what
# the error line names): each a key's bad value, refused in one line before any benchmark starts
BAD_KEYS = [
    ('bench: a word for seq_lens', ['bench.py', '--seq_lens=abc'], 'seq_lens='),
    ('bench: a word among documents', ['bench.py', '--mode=docs', '--documents=a'], 'documents='),
    ('bench: no timed runs', ['bench.py', '--reps=0'], 'reps='),
    ('bench: negative loss tokens', ['bench.py', '--mode=loss', '--loss_tokens=-5'],
     'loss_tokens='),
    ('bench: negative threads', ['bench.py', '--threads=-1'], 'threads='),
    ('bench: an unknown mode', ['bench.py', '--mode=fast'], 'mode='),
    ('bench: a negative window', ['bench.py', '--mode=docs', '--windows=0,-4'], 'windows='),
    ("bench: a length the ring can't cut", ['bench.py', '--mode=docs', '--seq_lens=100', '--cp=3'],
     'seq_lens='),
    ('bench: more documents than tokens',
     ['bench.py', '--mode=docs', '--seq_lens=256', '--documents=300'], 'documents='),
    ('bench: no rounds', ['bench.py', '--mode=moe', '--rounds=0'], 'rounds='),
    ('bench: heads that do not divide the width', ['bench.py', '--n_head=3'], 'n_head=3'),
    ('bench: results under a file', ['bench.py', '--results={d}/afile/r.md'], 'results='),
    ('peers: a word for seq_lens', ['bench/peers.py', '--seq_lens=x'], 'seq_lens='),
    ('peers: no rounds', ['bench/peers.py', '--rounds=0'], 'rounds='),
    ('peers: an unknown device', ['bench/peers.py', '--device=tpu'], 'device='),
    ('vs_nanogpt: a dataset not prepared', ['bench/vs_nanogpt.py', '--dataset={d}/none'],
     'dataset='),
    ('vs_nanogpt: no steps', ['bench/vs_nanogpt.py', '--steps=0'], 'steps='),
]


def refuse(argv, folder):
    """Run argv (a BAD_KEYS row's) with {d} as folder, made holding an empty file, afile."""
    (folder / 'afile').write_text('')
    argv = [a.format(d=folder) for a in argv]
    # a row that starts benchmarking instead is stopped here, and fails
    return subprocess.run([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope='module')
def refused(request, tmp_path_factory):
    """{case: (its process, its folder)} of the BAD_KEYS rows this session runs, two processes at a
    time: each spends its seconds importing torch."""
    chosen = [item.callspec.params['case'] for item in request.session.items
              if item.originalname == 'test_a_bad_key_is_one_line_before_any_work']
    rows = [row for row in BAD_KEYS if row[0] in chosen]
    folders = [tmp_path_factory.mktemp('refused') for _ in rows]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(refuse, [row[1] for row in rows], folders))
    return {row[0]: (p, folder) for row, p, folder in zip(rows, done, folders)}


@pytest.mark.parametrize('case, argv, names', BAD_KEYS, ids=[row[0] for row in BAD_KEYS])
def test_a_bad_key_is_one_line_before_any_work(refused, case, argv, names):
    p, folder = refused[case]
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith('error: '), p.stdout + p.stderr[-3000:]
    assert names in lines[0], lines
    # nothing written: the folder as it was made
    assert os.listdir(folder) == ['afile'] and (folder / 'afile').read_text() == ''
