"""memory.py: the estimate (a formula) against the measured peak of train.py's step (CPU, real tensors,
torch's MemTracker, measure.py), the measurement against a hand count, fake tensors against real ones, 7B
dry runs, flash attention's workspace by hand, the anatomy of a dry run's peak, the fit check's
suggestions, the planner and its host memory."""
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import memory  # noqa: E402
import offload  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from model import Llama, LlamaConfig, num_params  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30


def step(cfg, B, S, dtype='float32', gas=1, fake=False):
    """One training step as train.py runs it in one process (AdamW state made up front, batches as
    get_batch returns them), under memory.Tracker. Returns the tracker."""
    torch.manual_seed(0)
    offload.reset()  # a fresh host pool: this step allocates its buffers (the tracker takes them out)
    ptdtype = torch.bfloat16 if dtype == 'bfloat16' else torch.float32
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.device('meta'):
            model = Llama(cfg)
    else:
        mode = nullcontext()
    with mode:
        model = offload.apply(memory.to_fake(model, ptdtype) if fake else Llama(cfg).to(dtype=ptdtype))
        masters = optim.make_master_weights(model)
        opt = train.make_optimizer(model, masters, 'cpu')
        autocast = torch.autocast('cpu', dtype=torch.bfloat16) if ptdtype == torch.bfloat16 else nullcontext()
        batches = [memory.fake_batch(B, S, cfg.vocab_size) for _ in range(gas)]
        tr = memory.Tracker(model, masters, opt, [t for b in batches for t in b], device=torch.device('cpu'))
        with tr:
            train.forward_backward(model, batches, autocast)
            torch.nn.utils.clip_grad_norm_(masters, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)  # optim.AdamW wrote the new weights
    return tr


def errors(est, measured):
    """(total error, worst error of params, grads, optimizer, error of activations + transient), all
    relative to the measured total. MemTracker files what a recompute rebuilds in backward and a
    forward peak's working set under activations, the estimate under transient: the two are compared
    together."""
    e, m = est.as_dict(), measured
    rel = lambda k: (e[k] - m[k]) / m['total']
    work = (e['activations'] + e['transient'] - m['activations'] - m['transient']) / m['total']
    return rel('total'), max(abs(rel(k)) for k in ('params', 'grads', 'optimizer')), work


def cfg(L=2, h=64, H=4, K=2, I=None, V=384, **knobs):
    return LlamaConfig(n_layer=L, n_head=H, n_kv_head=K, n_embd=h, intermediate_size=I or 3 * h,
                       vocab_size=V, **knobs)


# 30 configurations: depth, width, GQA ratio (1, 2, 4, 8), sequence length, batch, MLP and loss
# chunks (off, odd counts, automatic), recompute modes, tied embeddings, gradient accumulation, bf16,
# activation offload (α = 0.5 and 1, every recompute mode, fp32 and bf16)
GRID = [
    (cfg(), 2, 128, 'float32', 1),
    (cfg(L=1, h=32, H=4, K=4), 2, 256, 'float32', 1),
    (cfg(L=3, h=96, H=6, K=3, I=200), 1, 256, 'float32', 1),
    (cfg(L=2, h=64, H=8, K=1), 2, 192, 'float32', 1),
    (cfg(L=4, h=32, H=2, K=1, I=64), 3, 128, 'float32', 1),
    (cfg(mlp_chunks=4), 2, 256, 'float32', 1),
    (cfg(mlp_chunks=3, loss_chunks=5), 1, 301, 'float32', 1),
    (cfg(loss_chunks=4), 2, 256, 'float32', 1),
    (cfg(mlp_chunks=0, loss_chunks=0), 2, 512, 'float32', 1),
    (cfg(recompute='full'), 2, 256, 'float32', 1),
    (cfg(recompute='full', mlp_chunks=2, loss_chunks=2), 2, 256, 'float32', 1),
    (cfg(L=3, recompute='full', mlp_chunks=0, loss_chunks=0), 1, 512, 'float32', 1),
    (cfg(recompute='selective'), 2, 256, 'float32', 1),
    (cfg(L=3, h=96, H=6, K=2, recompute='selective', mlp_chunks=3, loss_chunks=3), 2, 200, 'float32', 1),
    (cfg(L=1, recompute='selective', loss_chunks=7), 3, 96, 'float32', 1),
    (cfg(tie_embeddings=True), 2, 128, 'float32', 1),
    (cfg(tie_embeddings=True, loss_chunks=3, recompute='full'), 2, 256, 'float32', 1),
    (cfg(L=3, tie_embeddings=True, mlp_chunks=2, recompute='selective'), 1, 384, 'float32', 1),
    (cfg(), 1, 256, 'float32', 2),
    (cfg(mlp_chunks=2, loss_chunks=2, recompute='full'), 2, 128, 'float32', 2),
    (cfg(L=1, h=128, H=4, K=1, V=1000), 2, 64, 'float32', 1),  # model states dominate
    (cfg(), 2, 128, 'bfloat16', 1),
    (cfg(recompute='full', mlp_chunks=3, loss_chunks=3), 2, 192, 'bfloat16', 1),
    (cfg(L=3, recompute='selective', mlp_chunks=2, loss_chunks=0), 1, 384, 'bfloat16', 2),
    # offload (offload.py): the first L - KEEP_LAST blocks send what they keep to host. Only tensors
    # of at least MIN_BYTES (1 MiB) travel, hence the tokens × width; the smaller ones (1/rms,
    # logsumexp, k and v at width 128) stay on the device
    (cfg(L=4, h=128, offload=0.5), 2, 1024, 'float32', 1),  # the other half recomputed token-wise
    (cfg(L=5, h=128, H=4, K=1, offload=1.0, mlp_chunks=2, loss_chunks=2), 2, 1024, 'float32', 2),
    (cfg(L=5, h=128, offload=1.0, recompute='selective'), 2, 1024, 'float32', 1),  # peak: layer 1
    (cfg(L=4, h=128, H=4, K=4, offload=0.5, recompute='full', mlp_chunks=0, loss_chunks=0), 1, 2048, 'float32', 1),
    (cfg(L=3, h=64, I=96, V=128, offload=1.0, recompute='full', mlp_chunks=2), 8, 1024, 'bfloat16', 1),
    (cfg(L=3, h=64, I=96, V=128, offload=1.0, recompute='selective'), 8, 1024, 'bfloat16', 1),
]


@pytest.mark.parametrize('i', range(len(GRID)))
def test_estimate_matches_the_measured_peak(i):
    c, B, S, dtype, gas = GRID[i]
    tr = step(c, B, S, dtype, gas)
    est = memory.estimate(c, B, S, dtype=dtype, device_type='cpu', grad_accum=gas)
    total, states, work = errors(est, tr.breakdown())
    assert abs(total) < 0.10, f"total {100 * total:+.1f}% (estimate at {est.moment})"
    assert states < 0.05, f"a model state is off by {100 * states:.1f}% of the total"
    assert abs(work) < 0.10, f"activations + transient off by {100 * work:+.1f}% of the total"
    # what went to host is counted apart (the host pool's buffers, also on a CPU), not in the total
    assert tr.host == pytest.approx(est.host, rel=1e-3) and (est.host > 0) == (c.offload > 0)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_measured_categories_are_a_hand_count(dtype):
    """The measurement on a tiny model: the categories sum to the total; the parameters, the
    optimizer's state (fp32 masters in bf16, Adam m and v, a step count per tensor) and, at a peak
    in the LM head's backward, no gradients yet, as counted by hand."""
    c = cfg(L=1, h=32, H=4, K=4, V=512)  # the plain loss: the peak is the head's backward
    m = step(c, 2, 64, dtype).breakdown()
    n, tensors = num_params(c, non_embedding=False), 9 + 3
    b = 2 if dtype == 'bfloat16' else 4
    assert m['total'] == sum(m[k] for k in memory.CATEGORIES)
    assert m['params'] == b * n
    assert m['optimizer'] == (4 * n if b == 2 else 0) + 8 * n + 4 * tensors
    assert m['grads'] == 0
    V, T = c.vocab_size, 2 * 64
    assert m['transient'] >= 8 * V * T  # d(NLL) and d(log-softmax), fp32


@pytest.mark.parametrize('c,dtype', [(cfg(mlp_chunks=2, loss_chunks=3), 'float32'),
                                     (cfg(recompute='full', loss_chunks=2), 'bfloat16'),
                                     (cfg(recompute='selective', tie_embeddings=True), 'float32')])
def test_fake_tensors_see_what_real_ones_do(c, dtype):
    real = step(c, 2, 192, dtype).breakdown()
    fake = step(c, 2, 192, dtype, fake=True).breakdown()
    assert abs(fake['total'] - real['total']) <= 0.02 * real['total']
    for k in memory.CATEGORIES:
        assert abs(fake[k] - real[k]) <= 0.02 * real['total'], k


def test_first_step_shows_the_steady_state():
    """optim.AdamW makes its state when it is built (torch's makes it lazily, in the first step), so
    the first step already holds every step's memory; and its steps are torch's AdamW's."""
    c = cfg()
    torch.manual_seed(0)
    a, b = Llama(c), Llama(c)
    b.load_state_dict(a.state_dict())
    ob = train.make_optimizer(b, list(b.parameters()), 'cpu')
    assert len(ob.state) == len(list(b.parameters()))
    assert all(float(s['step']) == 0 and not s['exp_avg'].any() and not s['exp_avg_sq'].any() for s in ob.state.values())
    groups = [{'params': [p for p in a.parameters() if p.dim() >= 2], 'weight_decay': train.weight_decay},
              {'params': [p for p in a.parameters() if p.dim() < 2], 'weight_decay': 0.0}]
    oa = torch.optim.AdamW(groups, lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=True)
    for _ in range(2):
        x, y = memory.fake_batch(2, 64, c.vocab_size)
        for model, opt in ((a, oa), (b, ob)):
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


LLAMA2_7B = dict(n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, intermediate_size=11008, vocab_size=32000)


def test_dry_run_of_llama2_7b_on_one_gpu_at_128k_tokens(tmp_path):
    """config/llama2_7b_one_gpu.py: Llama-2-7B's shape at 131,072 tokens on one 80 GB GPU fits, by dry run, with the
    step in backward (6 bytes per parameter); at Megatron's 18 no length does (model states alone: 113 GiB)."""
    c = LlamaConfig(**LLAMA2_7B)
    assert not memory.fits(memory.estimate(c, 1, 1024), 80 * GiB)
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), os.path.join(ROOT, 'config', 'llama2_7b_one_gpu.py'),
                        '--dry_run=True', f'--out_dir={tmp_path / "out"}'], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'verdict: fits' in p.stdout
    assert 'memory estimate per rank' in p.stdout and 'dry run: one step on fake tensors' in p.stdout
    report = json.loads((tmp_path / 'out' / 'memory.json').read_text())
    rank = report['ranks'][0]
    assert report['fits'] is True
    assert set(rank) == {'rank', 'estimate', 'measured', 'overhead', 'device_bytes', 'world_size',
                         'tp_size', 'cp_size', 'seq_len'}
    assert set(rank['estimate']) == set(rank['measured']) == set(memory.CATEGORIES) | {'total'}
    assert rank['device_bytes'] == 80 * GiB and rank['seq_len'] == 131072
    # flash attention's fp32 dq accumulator and softmax_d, 32 heads of 128 (no grouped kv heads), in the
    # estimate at its peak (a block's backward) and added, as the formula's, to the dry run's total
    assert rank['estimate']['workspace'] == rank['measured']['workspace'] == 4 * 131072 * 32 * (128 + 1)
    assert "the dry run's workspace is the formula's" in p.stdout
    # the formula a little above the dry run (2026-11-23: 54.37 against 52.56 GiB, +3.4%)
    assert abs(rank['estimate']['total'] - rank['measured']['total']) < 0.05 * rank['measured']['total']
    # bf16 weights and bf16 AdamW moments, measured as the formula counts them: 2 + 4 bytes per parameter
    assert rank['estimate']['params'] == pytest.approx(2 * 6.74e9, rel=0.01)
    assert rank['measured']['optimizer'] == pytest.approx(4 * 6.74e9, rel=0.01)


@pytest.mark.parametrize('config,world,seq_len', [('llama3_8b_host', 1, 262144), ('llama3_8b_node', 8, 2097152)])
def test_dry_run_with_the_states_on_the_host(tmp_path, config, world, seq_len):
    """The states-on-host configs at 4 of their 32 blocks and shorter lengths (their headers: the whole
    dry runs): FSDP2 runs on fake tensors over 1 and 8 ranks; the host holds 16 bytes per parameter over the
    dp x cp ranks and the offloaded blocks, as the estimate says, and the device's total is the estimate's."""
    env = {**os.environ, 'WORLD_SIZE': str(world), 'OMP_NUM_THREADS': '1'}
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), os.path.join(ROOT, 'config', config + '.py'),
                        '--dry_run=True', '--n_layer=4', f'--seq_len={seq_len}', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and 'verdict: fits' in p.stdout, p.stderr[-3000:]
    report = json.loads((tmp_path / 'memory.json').read_text())
    est, measured = report['ranks'][0]['estimate'], report['ranks'][0]['measured']
    c = LlamaConfig(n_layer=4, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336, vocab_size=128256)
    blocks = 2 * seq_len // world * 4096 * 2  # 2 of 4 block inputs offloaded (offload.KEEP_LAST = 2), bf16
    assert report['host']['estimate'] == pytest.approx(16 * num_params(c, False) / world + blocks, rel=1e-3)
    assert report['host']['measured'] == pytest.approx(report['host']['estimate'], rel=1e-2)
    assert est['optimizer'] == measured['optimizer'] == 0  # AdamW's moments: host memory
    assert abs(est['total'] - measured['total']) < 0.07 * measured['total'], (est, measured)


def test_dry_run_of_a_pipeline_measures_the_first_and_the_last_stage(tmp_path):
    """pp 2 over 4 blocks, 4 micro-batches: rank 0's stage (blocks 0-1: 2 micro-batches in flight under 1F1B, all 4
    under GPipe) and, in a process of its own, the last stage's (blocks 2-3 and the LM head: memory.rank1.json), each
    as the estimate says; the first stage's activations are the in-flight micro-batches'."""
    runs = {}
    for schedule in ('1f1b', 'gpipe'):
        out = tmp_path / schedule
        p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--n_layer=4', '--n_head=8', '--n_kv_head=8',
                            '--n_embd=512', '--intermediate_size=1376', '--vocab_size=32000', '--seq_len=8192',
                            '--batch_size=1', '--gradient_accumulation_steps=4', '--pp_size=2', '--recompute=full',
                            f'--pp_schedule={schedule}', '--dry_run=True', f'--out_dir={out}'], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**os.environ, 'WORLD_SIZE': '2'})
        assert p.returncode == 0 and p.stdout.count('verdict: fits') == 2, p.stderr[-3000:]
        assert 'rank 0 of 2 (dp 1 x pp 2 x cp 1 x tp 1)' in p.stdout and 'rank 1 of 2' in p.stdout
        runs[schedule] = [json.loads((out / name).read_text())['ranks'][0] for name in ('memory.json',
                                                                                       'memory.rank1.json')]
        for rank in runs[schedule]:
            est, measured = rank['estimate'], rank['measured']
            assert abs(est['total'] - measured['total']) < 0.05 * measured['total'], (schedule, est, measured)
    # 1F1B's peak: the steady state, one micro-batch held beside the current one (gradients made); GPipe's: its
    # second backward, two held (every forward ran first). Each holds 2 block inputs, its output sent on (bf16) and
    # RoPE's fp32 tables
    one = 3 * 8192 * 512 * 2 + 8 * 64 * 8192
    (f1, _), (f4, _) = runs['1f1b'], runs['gpipe']
    assert f4['measured']['activations'] - f1['measured']['activations'] == pytest.approx(one, rel=0.02)


def test_dry_run_of_the_70b_4d_config_at_16_of_its_80_blocks(tmp_path):
    """config/llama3_70b_4d.py (its header: the whole dry run, minutes) at 16 of its 80 blocks, 4 per stage: on 64 fake
    ranks, dp 2 x pp 4 x cp 2 x tp 4, rank 0's stage and the last stage's fit, each its estimate; rank 0 keeps the 4
    micro-batches 1F1B has in flight there: 16 block inputs of S/8 tokens (recompute='full')."""
    env = {**os.environ, 'WORLD_SIZE': '64', 'OMP_NUM_THREADS': '1'}
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), os.path.join(ROOT, 'config', 'llama3_70b_4d.py'),
                        '--dry_run=True', '--n_layer=16', f'--out_dir={tmp_path}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=env)
    assert p.returncode == 0 and p.stdout.count('verdict: fits') == 2, p.stderr[-3000:]
    assert 'rank 0 of 64 (dp 2 x pp 4 x cp 2 x tp 4)' in p.stdout and 'rank 63 of 64' in p.stdout
    first, last = (json.loads((tmp_path / name).read_text())['ranks'][0] for name in ('memory.json', 'memory.rank63.json'))
    # the last stage's estimate misses FSDP2's buffers beside its few blocks (the block after's fp32 gradients waiting
    # in its reduce-scatter, the LM head's copies): 8% low at 4 blocks a stage, 3.2% at the config's 20
    for rank, within in ((first, 0.05), (last, 0.10)):
        est, measured = rank['estimate'], rank['measured']
        assert abs(est['total'] - measured['total']) < within * measured['total'], (est, measured)
    assert first['measured']['activations'] > 16 * 16384 * 8192 * 2


def test_dry_run_fits_when_it_should(tmp_path):
    """A 1B-ish model at 16K tokens with full recompute fits one 80 GB GPU, and says so."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--n_layer=16', '--n_head=32',
                        '--n_kv_head=8', '--n_embd=2048', '--intermediate_size=8192', '--vocab_size=32000',
                        '--seq_len=16384', '--batch_size=1', '--recompute=full', '--mlp_chunks=0',
                        '--loss_chunks=0', '--dry_run=True', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'verdict: fits' in p.stdout
    assert json.loads((tmp_path / 'memory.json').read_text())['fits'] is True


SETUP = dict(dtype='bfloat16', device_type='cuda')
MiB = 2 ** 20


@pytest.mark.parametrize('layout,gqa,mha', [
    # Llama-3-8B (32 query heads, 8 kv heads, hd 128), Llama-2-7B (32 and 32) at 131,072 tokens. One GPU: the
    # fp32 dq accumulator 4·S·32·128 = 2 GiB, softmax_d 4·S·32 = 16 MiB, with grouped kv heads dk and dv expanded
    # to 32 heads in bf16, 2·2·S·32·128 = 2 GiB
    ({}, 2 * GiB + 16 * MiB + 2 * GiB, 2 * GiB + 16 * MiB),
    # tp 2: 16 heads of the whole (gathered) sequence; kv 4 of them, still grouped
    (dict(tp_size=2), 1 * GiB + 8 * MiB + 1 * GiB, 1 * GiB + 8 * MiB),
    # Ulysses cp 2: the whole sequence for 16 heads; the output and its gradient come head-major: copied, 1 GiB
    (dict(cp_size=2), 1 * GiB + 8 * MiB + 1 * GiB + 1 * GiB, 1 * GiB + 8 * MiB + 1 * GiB),
    # the ring, cp 2: 32 heads of S/2 tokens; kv heads repeated before the kernel (a tensor); the copies, 1 GiB
    (dict(cp_size=2, cp_impl='ring'), 1 * GiB + 8 * MiB + 1 * GiB, 1 * GiB + 8 * MiB + 1 * GiB)])
def test_workspace_is_flash_attentions_backward_by_hand(layout, gqa, mha):
    S = 131072
    for c, want in ((LLAMA3_8B, gqa), (cfg(L=32, h=4096, H=32, K=32, I=11008, V=32000), mha)):
        c = replace(c, recompute='full', offload=1.0, mlp_chunks=0, loss_chunks=0)  # the peak: a block's backward
        assert memory.workspace(c, 1, S, 2, layout.get('tp_size', 1), layout.get('cp_size', 1),
                                layout.get('cp_impl', 'ulysses')) == want
        est = memory.estimate(c, 1, S, **SETUP, **layout)
        assert est.moment.startswith('backward: block') and est.workspace == want
        # on top of the same moment's tensors: a CPU runs no CUDA kernel; fp32 on CUDA takes another, not counted
        cpu = memory.estimate(c, 1, S, dtype='bfloat16', device_type='cpu', **layout)
        assert cpu.workspace == 0 and cpu.moment == est.moment and est.total == cpu.total + want
        assert memory.estimate(c, 1, S, dtype='float32', device_type='cuda', **layout).workspace == 0


def test_workspace_rounds_and_stays_in_attentions_moments():
    # the kernel rounds the sequence up to 128 and hd up to 32: 300 tokens, hd 16, 4 heads over 2 kv heads
    c = cfg(L=2, h=64, H=4, K=2)
    assert memory.workspace(c, 2, 300) == 4 * 2 * 384 * 4 * (32 + 1) + 2 * 2 * 2 * 300 * 4 * 16
    # alive in an attention backward only: a peak at the LM head (a large vocabulary, the plain loss) has none
    head = memory.estimate(cfg(L=2, h=64, V=32000), 2, 1024, **SETUP)
    assert head.moment.startswith('forward and backward: LM head') and head.workspace == 0


@pytest.mark.parametrize('c,B,S,budget', [
    (cfg(L=16, h=2048, H=32, K=8, I=8192, V=32000), 1, 32768, 80 * GiB),
    (cfg(L=16, h=2048, H=32, K=8, I=8192, V=128256), 2, 8192, 40 * GiB),
    (cfg(L=32, h=4096, H=32, K=8, I=14336, V=128256, recompute='full'), 1, 8192, 80 * GiB)])
def test_suggestions_really_fit(c, B, S, budget):
    over = memory.overhead_bytes('cuda')
    assert not memory.fits(memory.estimate(c, B, S, **SETUP), budget, over)
    sug = memory.suggestions(c, budget, over, 1 << 40, B, S, world=1, **SETUP)
    assert sug, "nothing suggested"
    for text, est, cost in sug:
        assert est.total + over <= 0.8 * budget, text
        # what the line says is what was estimated: apply it and estimate again
        knobs, layout = {}, {}
        for arg in text.split(' (')[0].split():
            k, v = arg[2:].split('=')
            (layout if k in ('tp_size', 'cp_size', 'zero') else knobs)[k] = eval(v)
        again = memory.estimate(replace(c, **knobs), B, S, **SETUP, **layout)
        assert again.total == est.total and memory.fits(again, budget, over), text
    costs = [x for text, _, x in sug if 'GPUs' not in text and 'zero' not in text]
    assert costs == sorted(costs)


def test_planner_picks_the_cheapest_setting_that_fits():
    c = cfg(L=16, h=2048, H=32, K=8, I=8192, V=32000)
    over = memory.overhead_bytes('cuda')
    # plenty of memory: change nothing
    v, est, cost = memory.plan(c, 10 ** 6 * GiB, over, 1 << 40, 1, 4096, **SETUP)
    assert memory.knobs(v, c) == {} and cost == 0
    # a budget chunking alone meets: no recompute (it costs FLOPs; chunking does not)
    chunked = replace(c, mlp_chunks=0, loss_chunks=0)
    need = memory.estimate(chunked, 1, 16384, **SETUP).total + over
    v, est, cost = memory.plan(c, need / 0.8 * 1.01, over, 1 << 40, 1, 16384, **SETUP)
    assert v.recompute == 'none' and memory.fits(est, need / 0.8 * 1.01, over)
    # tighter: it must recompute, and picks the cheaper mode that fits over 'full'
    budget = 40 * GiB
    v, est, cost = memory.plan(c, budget, over, 1 << 40, 1, 32768, **SETUP)
    assert memory.fits(est, budget, over) and cost > 0
    for w in memory.variants(c, 1, 32768, 1 << 40, {}):
        if memory.fits(memory.estimate(w, 1, 32768, **SETUP), budget, over):
            assert memory.cost(w, c, 1, 32768) >= cost - 1e-9


def test_train_stops_before_allocating_when_it_does_not_fit(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--device=cpu', '--n_layer=2',
                        '--n_embd=64', '--n_head=4', '--n_kv_head=2', '--intermediate_size=192',
                        '--vocab_size=256', '--batch_size=4', '--seq_len=512', '--memory_budget_gb=0.03',
                        f'--out_dir={tmp_path}'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith('error:'))  # after any data-prep progress bar
    assert err[first].startswith('error: does not fit:')
    assert any('--recompute=' in line or '--mlp_chunks=' in line or '--loss_chunks=' in line
               for line in err[first + 1:])
    assert not (tmp_path / 'log.jsonl').exists()  # stopped before the first step


def test_train_prints_measured_beside_the_estimate(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--device=cpu', '--n_layer=2',
                        '--n_embd=64', '--n_head=4', '--n_kv_head=2', '--intermediate_size=192',
                        '--batch_size=4', '--seq_len=128', '--max_iters=2', '--eval_iters=1',
                        '--eval_interval=100', '--mlp_chunks=2', '--loss_chunks=2', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'memory estimate per rank' in p.stdout and 'memory after the first step' in p.stdout
    rank = json.loads((tmp_path / 'memory.json').read_text())['ranks'][0]
    est, meas = rank['estimate'], rank['measured']
    assert abs(est['total'] - meas['total']) < 0.05 * meas['total']
    assert rank['world_size'] == 1 and rank['overhead'] == 0  # a CPU has no CUDA context
    # the first log row (after the measured step) carries the same bytes; no later row does
    rows = [json.loads(line) for line in (tmp_path / 'log.jsonl').read_text().splitlines()]
    assert [r['iter'] for r in rows] == [0, 1] and 'memory' not in rows[1]
    assert rows[0]['memory'] == {'estimate': est, 'measured': meas}
    assert set(meas) == set(memory.CATEGORIES) | {'total'} and meas['total'] == sum(meas[k] for k in memory.CATEGORIES)
    assert meas['params'] > 0 and meas['activations'] > 0


def test_anatomy_of_a_dry_runs_peak(tmp_path):
    """--dry_run_anatomy lists the tensors alive at the peak the table reports. Issue 14's setting (full recompute,
    block inputs on the host, MLP and loss chunks automatic) at a small width: the peak is block 0's ffn RMSNorm
    backward, and at it the tensors of at least a full width (S·h bf16) are counted here one by one, so a change that
    adds one to the peak fails this test."""
    S, h, I = 1024, 64, 192
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--n_layer=4', f'--n_embd={h}', '--n_head=4',
                        '--n_kv_head=2', f'--intermediate_size={I}', '--vocab_size=256', f'--seq_len={S}',
                        '--batch_size=1', '--recompute=full', '--offload=1.0', '--dtype=bfloat16', '--dry_run=True',
                        '--mlp_chunks=0', '--loss_chunks=0', '--dry_run_anatomy=100', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / 'memory.json').read_text())
    m, anatomy = report['ranks'][0]['measured'], report['anatomy']
    assert 'anatomy of the peak, after' in p.stdout and anatomy['moment'] in p.stdout
    # the table's moment: what the step made and still holds, plus what was there before it: the model states and
    # the batch (one (1, S + 1) int64 tensor that the model reads in place)
    assert anatomy['made_bytes'] + m['params'] + m['optimizer'] + 8 * (S + 1) == m['total'] - m['workspace']
    assert anatomy['moment'].endswith('in Llama.layers.0.ffn_norm (backward)')
    wide = sorted(x['bytes'] for x in anatomy['largest'] if x['bytes'] >= 2 * S * h)
    # fp32, in the RMSNorm's backward on one chunk of rows (here all S: model.FP32_CHUNK is 2^26 elements): the
    # input's fp32 copy and F.rms_norm's CPU autograd temporaries (6 × 4·S·h); bf16 S·h: block 0's input, the
    # gradient reaching block 0, the recomputed attention half (attention_norm's output, q, attention's output, the
    # residual x + attention), the MLP's dx, and the norm's output, incoming gradient · weight and dx (10 × 2·S·h).
    # No S·I tensor: the MLP's chunk buffers, three of S/M × I, were freed with its backward.
    assert wide == [2 * S * h] * 10 + [4 * S * h] * 6, [
        (x['bytes'], x['shape'], x['op'], x['module']) for x in anatomy['largest'] if x['bytes'] >= 2 * S * h]


# ----------------------------------------------------------------------------- auto_memory and host memory

LLAMA3_8B = cfg(L=32, h=4096, H=32, K=8, I=14336, V=128256)


def test_suggestions_combine_a_layout_with_the_knobs_it_needs():
    """Llama 3 8B at 64K tokens on one 80 GB GPU: no knob alone fits, nor tp alone; tp 4 with selective
    recompute does, and is suggested (before, 'nothing within reach fits')."""
    over = memory.overhead_bytes('cuda')
    sug = memory.suggestions(LLAMA3_8B, 80 * GiB, over, 0, 1, 65536, world=1, **SETUP)
    lines = [text for text, _, _ in sug]
    assert any('--tp_size=' in t and '--recompute=' in t for t in lines), lines
    for text, est, _ in sug:
        assert memory.fits(est, 80 * GiB, over), text


def test_planner_sizes_offload_with_the_tokens_offload_sends():
    """Under tp offload.py sends S / (cp·tp) tokens per rank: host memory for exactly that much must be
    enough for the planner to offer offload (it sized it with S / cp before, and refused)."""
    c, B, S, layout = replace(LLAMA3_8B, n_layer=8), 1, 32768, dict(tp_size=2, cp_size=2)
    full = replace(c, recompute='full', offload=1.0, mlp_chunks=0, loss_chunks=0)
    host = offload.host_bytes(full, B, S // 4, torch.bfloat16)
    offered = [v for v in memory.variants(c, B, S, host, layout) if v.offload > 0]
    assert any(v.recompute == 'full' and v.offload == 1.0 for v in offered)
    assert all(offload.host_bytes(v, B, S // 4, torch.bfloat16) <= host for v in offered)
    # and the estimate's host bytes, which Report checks against host memory, are the same count
    assert memory.estimate(full, B, S, tp_size=2, cp_size=2).host == host


def test_host_memory_is_the_targets_and_shared_by_a_nodes_ranks(monkeypatch):
    monkeypatch.setattr(memory, 'meminfo', lambda key: 64 * GiB)
    # a dry run stands in for another machine: its host memory is the budget, or unknown
    assert memory.host_bytes_per_rank(0.0, dry_run=True) is None
    assert memory.host_bytes_per_rank(16.0, dry_run=True) == 16 * GiB
    # a real run: MemAvailable shared by the node's ranks, capped by the budget
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '8')
    assert memory.host_bytes_per_rank(0.0) == 8 * GiB
    assert memory.host_bytes_per_rank(4.0) == 4 * GiB and memory.host_bytes_per_rank(100.0) == 8 * GiB
    # with host memory unknown the planner offers no offload; given, it may
    c = replace(LLAMA3_8B, n_layer=8)
    assert all(v.offload == 0 for v in memory.variants(c, 1, 32768, None, {}))
    assert any(v.offload > 0 for v in memory.variants(c, 1, 32768, 1 << 40, {}))


PLAN_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import memory
from model import Llama, LlamaConfig
dist.init_process_group('gloo')
rank = dist.get_rank()
memory.meminfo = lambda key: 1 << 40
if rank == 1:  # what this rank would plan alone (its own device or host memory could make it differ)
    memory.plan = lambda *args, **kw: None
with torch.device('meta'):  # shapes only: the report is made before anything is allocated
    model = Llama(LlamaConfig(n_layer=8, n_head=16, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                              vocab_size=32000, mlp_chunks=0, loss_chunks=0))
cfg = dict(batch_size=1, seq_len=32768, auto_memory=True, memory_budget_gb=20, out_dir={out!r})
memory.Report(model, cfg, 2, rank, None, torch.device('cpu'), torch.bfloat16)
open(os.path.join({out!r}, 'plan%d' % rank), 'w').write('%s %s' % (model.config.recompute, model.config.offload))
dist.destroy_process_group()
"""


def test_every_rank_reaches_rank_0s_plan(tmp_path):
    script = tmp_path / 'plan.py'
    script.write_text(PLAN_WORKER.format(root=ROOT, out=str(tmp_path)))
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert p.returncode == 0, p.stderr[-3000:]
    # each rank writes its own file: two ranks printing to one pipe interleave their lines
    plans = [(tmp_path / f'plan{r}').read_text().split() for r in (0, 1)]
    assert plans[0] == plans[1], plans
    assert plans[0] != ['none', '0.0']  # rank 0's plan, not the configured setting
