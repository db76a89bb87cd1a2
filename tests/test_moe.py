"""moe.py: the MoE MLP against a loop over experts as transformers' Mixtral writes it (outputs and every
gradient), with chunked experts, an expert that gets no token and every token on one expert; the aux loss
against Switch's formula by hand and its gradient against autograd's; expert parallelism (ep) under dp, zero
2 / 3, tp (with and without sequence parallelism), Ulysses and ring against one process (one step: loss,
norm, every gradient, updated weights; spawned ranks on gloo); train.py: a tiny Mixtral trains on the default
corpus, pp 2 x ep 2 gives one process's losses, an ep 2 checkpoint resumes on ep 1 and ep 4."""
import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import offload  # noqa: E402
import parallel  # noqa: E402
from conftest import apply_techniques  # noqa: E402
from knobs import Knobs  # noqa: E402
from model import Llama  # noqa: E402
from moe import Experts, MoE, moe_layers  # noqa: E402
from test_parallel import (MODEL, RTOL, LR, TINY, assert_close_losses, free_port, gather_full,  # noqa: E402
                           one_step, perturbed, read_log, rel, torchrun)

CONFIG = dict(MODEL, n_experts=4, experts_per_token=2)


def hf_moe(moe, x):
    """transformers' MixtralSparseMoeBlock, written out: softmax over all experts, the top k renormalised, a
    loop over experts, index_add of each one's weighted output."""
    E = moe.experts
    logits = moe.router(x).flatten(0, 1)
    weights, chosen = F.softmax(logits.float(), dim=-1).topk(moe.config.experts_per_token, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    tokens = x.flatten(0, 1)
    y = torch.zeros_like(tokens)
    for e in range(moe.config.n_experts):
        token, slot = torch.where(chosen == e)
        h = tokens[token]
        out = F.linear(F.silu(F.linear(h, E.w1[e])) * F.linear(h, E.w3[e]), E.w2[e])
        y.index_add_(0, token, out * weights[token, slot, None])
    return y.view_as(x)


def biased(moe, bias):
    """The router with a bias: expert e's logit + bias[e] (a large one forces every token's choice)."""
    moe.router.bias = nn.Parameter(torch.tensor(bias, dtype=torch.float32))
    return moe


@pytest.mark.parametrize('mlp_chunks,k,bias', [
    (1, 2, None), (3, 2, None), (0, 1, None),
    (2, 2, [0, 0, 0, -1e4]),   # expert 3 gets no token
    (2, 1, [1e4, 0, 0, 0]),    # every token on expert 0
])
def test_moe_equals_mixtrals_loop_over_experts(mlp_chunks, k, bias):
    torch.manual_seed(0)
    config = Knobs(n_embd=32, intermediate_size=48, n_experts=4, experts_per_token=k, mlp_chunks=mlp_chunks)
    moe = MoE(config)
    if bias:
        biased(moe, bias)
    x = torch.randn(2, 24, 32, requires_grad=True)
    g = torch.randn(2, 24, 32)
    y = moe(x)
    grads = torch.autograd.grad((y * g).sum(), [x, *moe.parameters()])
    ref = hf_moe(moe, x)
    # the reference's gradients plus the aux loss's (which moe's backward adds): coef / n_layer · aux
    aux_weight = config.router_aux_loss_coef / config.n_layer
    ref_grads = torch.autograd.grad((ref * g).sum() + aux_weight * aux_by_hand(moe, x),
                                    [x, *moe.parameters()])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if bias == [0, 0, 0, -1e4]:
        assert grads[-1][3].abs().max() == 0 and grads[-1][:3].abs().min() > 0  # w2 of expert 3: no token
    assert moe.aux_loss.item() == pytest.approx(aux_by_hand(moe, x).item(), rel=1e-6)


@pytest.mark.parametrize('mlp_chunks', [1, 3, 0])
@pytest.mark.parametrize('counts', [[7, 0, 30, 3], [0, 0, 40, 0], [0, 0, 0, 0]],
                         ids=['uneven', 'one-expert', 'no-rows'])
def test_grouped_experts_equal_a_loop_over_experts(mlp_chunks, counts):
    """Experts: a grouped GEMM per matmul over every expert's rows (chunks cut across experts' rows, an expert
    with no row among them) against a loop of each expert's own SwiGLU on its rows: outputs and every gradient."""
    torch.manual_seed(0)
    config = Knobs(n_embd=32, intermediate_size=48, n_experts=4, mlp_chunks=mlp_chunks)
    experts = Experts(config)
    x = torch.randn(sum(counts), 32, requires_grad=True)
    g = torch.randn(sum(counts), 32)
    y = experts(x, counts)
    grads = torch.autograd.grad((y * g).sum(), [x, *experts.parameters()])
    ref = torch.cat([F.linear(F.silu(F.linear(t, w1)) * F.linear(t, w3), w2)
                     for t, w1, w3, w2 in zip(x.split(counts), experts.w1, experts.w3, experts.w2)])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *experts.parameters()], allow_unused=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-5, atol=1e-6)
    # an expert without a row has no gradient, the others do
    for e, n in enumerate(counts):
        assert (grads[-1][e].abs().max() > 0) == (n > 0)


def aux_by_hand(moe, x):
    """Switch's E · Σ_e f_e · P_e, f_e the fraction of the T·k choices on e, P_e the mean probability of e."""
    E, k = moe.config.n_experts, moe.config.experts_per_token
    logits = moe.router(x).flatten(0, 1).float()
    chosen = logits.topk(k, dim=-1).indices
    f = torch.stack([(chosen == e).float().sum() for e in range(E)]) / len(logits)
    return E * (f * F.softmax(logits, -1).mean(0)).sum()


def test_balanced_routing_gives_an_aux_loss_of_k_and_training_pulls_toward_it():
    """aux is k when every expert gets T·k/E choices and the router is uniform; skewed routing is higher, and
    the aux loss's gradient, alone, makes the router more uniform."""
    torch.manual_seed(0)
    config = Knobs(n_embd=16, intermediate_size=16, n_experts=4, experts_per_token=2)
    moe = MoE(config)
    x = torch.randn(1, 64, 16)
    with torch.no_grad():
        moe.router.weight.zero_()
    assert aux_by_hand(moe, x).item() == pytest.approx(2.0)
    biased(moe, [3.0, 0, 0, 0])
    skewed = aux_by_hand(moe, x).item()
    assert skewed > 2.2
    opt = torch.optim.SGD(moe.router.parameters(), lr=0.5)
    for _ in range(10):
        moe.aux_weight = 1 / config.router_aux_loss_coef * config.n_layer  # the aux loss alone, weight 1
        (moe(x) * 0).sum().backward()
        opt.step()
        opt.zero_grad()
    assert aux_by_hand(moe, x).item() < skewed - 0.1


# ----------------------------------------------------------------------------- expert parallelism

QWEN_MOE = dict(head_dim=12, qk_norm=True, moe_intermediate_size=32, norm_topk_prob=False, dense_layers=[1])

# name: (world, tp, cp, cp_impl, sequence_parallel, zero, ep, model overrides)
EP_LAYOUTS = {
    'ep2':          (2, 1, 1, 'ulysses', True, 0, 2, {}),
    'ep2_empty':    (2, 1, 1, 'ulysses', True, 0, 2, dict(bias=[0, 0, 0, -1e4])),  # expert 3 (rank 1's) no token
    'ep2_one':      (2, 1, 1, 'ulysses', True, 2, 2, dict(experts_per_token=1, bias=[1e4, 0, 0, 0])),  # all on 0
    'tp_no_sp':     (2, 2, 1, 'ulysses', False, 0, 1, dict(recompute='selective')),
    'cp_ep2':       (2, 1, 2, 'ulysses', True, 0, 2, dict(recompute='full')),
    'tp_ep2':       (4, 2, 1, 'ulysses', True, 0, 2, dict(recompute='selective')),
    'dp_cp_zero3_ep2': (4, 1, 2, 'ulysses', True, 3, 2, {}),  # the experts' rows over the 2 ranks holding them
    'ring_ep4':     (4, 1, 2, 'ring', True, 0, 4, dict(recompute='full', sliding_window=5)),  # Mixtral's window
    'tp_cp_ep2':    (4, 2, 2, 'ulysses', True, 2, 2, {}),
    # Qwen3-MoE's: experts of their own width, weights not renormalised, layer 1 dense, q and k norms, with tp and ep
    'ep2_qwen':     (2, 1, 1, 'ulysses', True, 2, 2, QWEN_MOE),
    'tp_ep2_qwen':  (4, 2, 1, 'ulysses', True, 0, 2, dict(QWEN_MOE, recompute='selective')),
}


def new_moe_model(overrides, mesh=None):
    torch.manual_seed(0)
    config = Knobs(**{**CONFIG, **{k: v for k, v in overrides.items() if k != 'bias'}})
    model = perturbed(Llama(config))
    if 'bias' in overrides:
        for block in model.layers.values():
            biased(block.feed_forward, overrides['bias'])
    return model


def gather_experts(full, mesh):
    """gather_full's tensors with the experts' pieces of every ep rank put together (dim 0)."""
    for n, t in full.items():
        if '.experts.' in n and mesh.ep > 1:
            full[n] = torch.cat(parallel.all_gather(t.unsqueeze(0), 0, mesh.ep_group).unbind(0))
    return full


def _ep_worker(rank, world, port, names, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    for name in names:
        _, tp, cp, cp_impl, sp, zero, ep, overrides = EP_LAYOUTS[name]
        mesh = parallel.make_mesh(tp, cp, cp_impl, CONFIG['n_kv_head'], sp, ep=ep)
        model = apply_techniques(new_moe_model(overrides), mesh)
        if zero > 1:
            parallel.shard_states(model, mesh, zero, torch.float32)
        loss, norm, grads, weights = one_step(model, mesh, model.config, zero)
        step = (loss, norm, gather_experts(grads, mesh), gather_experts(weights, mesh))
        if rank == 0:
            torch.save(step, os.path.join(out_dir, f'{name}.pt'))
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def ep_results(tmp_path_factory):
    out = tmp_path_factory.mktemp('ep')
    for world in (2, 4):
        names = [n for n, layout in EP_LAYOUTS.items() if layout[0] == world]
        mp.spawn(_ep_worker, args=(world, free_port(), names, str(out)), nprocs=world)
    return {name: torch.load(out / f'{name}.pt') for name in EP_LAYOUTS}


@pytest.mark.parametrize('name', list(EP_LAYOUTS))
def test_expert_parallel_step_equals_one_process(ep_results, name):
    *_, zero, ep, overrides = EP_LAYOUTS[name]
    loss, norm, grads, weights = ep_results[name]
    model = apply_techniques(new_moe_model(overrides))
    ref_loss, ref_norm, ref_grads, ref_weights = one_step(model, parallel.Mesh(), model.config, zero)
    assert abs(loss - ref_loss) <= RTOL * ref_loss, (loss, ref_loss)
    assert abs(norm - ref_norm) <= RTOL * ref_norm, (norm, ref_norm)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert grads[n].shape == ref_grads[n].shape, n
        assert rel(grads[n], ref_grads[n]) <= RTOL or ref_grads[n].abs().max() == 0, (n, rel(grads[n], ref_grads[n]))
        if zero:  # AdamW: the Decision's atol, where a gradient is not so small that its sign is noise
            sure = ref_grads[n].abs() > 1e-6
            torch.testing.assert_close(weights[n][sure], ref_weights[n][sure], rtol=0, atol=1e-3 * LR)
        else:
            assert rel(weights[n], ref_weights[n]) <= RTOL, n
    if 'bias' in overrides:  # the routing was as forced: an expert without a token has no gradient
        idle = [e for e, b in enumerate(overrides['bias']) if b < 0 or b == 0 and max(overrides['bias']) > 1e3]
        for e in idle:
            assert ref_grads['layers.0.feed_forward.experts.w2'][e].abs().max() == 0


# ----------------------------------------------------------------------------- train.py

MOE = ['--n_experts=4', '--experts_per_token=2']


def test_a_tiny_mixtral_trains_on_the_default_corpus_and_logs_its_aux_loss(tmp_path):
    torchrun(1, *TINY, *MOE, '--batch_size=4', '--max_iters=30', '--learning_rate=3e-3', '--warmup_iters=5',
             f'--out_dir={tmp_path}')
    rows = read_log(tmp_path)
    first, last = rows[0], rows[-1]
    assert last['loss'] < first['loss'] - 1.0, (first, last)
    assert all(1.9 < r['aux_loss'] < 4 for r in rows), [r['aux_loss'] for r in rows]  # k = 2 when balanced


@pytest.fixture(scope='module')
def single_moe(tmp_path_factory):
    """One process: 3 steps, then resumed to 5 (the uninterrupted run's losses: resume is exact)."""
    out = tmp_path_factory.mktemp('single_moe')
    torchrun(1, *TINY, *MOE, '--batch_size=4', '--max_iters=5', f'--out_dir={out}')
    return read_log(out)


def test_pipeline_with_expert_parallelism_trains_as_one_process(tmp_path, single_moe):
    """pp 2 x dp 2 with ep 2 in each stage (GPipe, one micro-batch of 2 rows a dp rank: the same global batch)."""
    out = str(tmp_path / 'run')
    torchrun(4, *TINY, *MOE, '--batch_size=2', '--pp_size=2', '--pp_schedule=gpipe', '--ep_size=2',
             '--max_iters=3', f'--out_dir={out}')
    got = read_log(out)
    same_losses(got, single_moe[:3])
    # (the first row's aux loss is not compared: on its first step torch's schedule runs micro-batch 0 through
    # the stage once more, forward and backward, to learn the shapes, and the log's mean counts it)
    assert all(abs(a['aux_loss'] - b['aux_loss']) <= 1e-5 * b['aux_loss'] for a, b in zip(got[1:], single_moe[1:3]))


def same_losses(got, want):
    assert [r['iter'] for r in got] == [r['iter'] for r in want]
    assert all(abs(a['loss'] - b['loss']) <= 1e-5 * b['loss'] for a, b in zip(got, want)), (got, want)


def test_an_ep2_checkpoint_resumes_on_ep1_and_ep4(tmp_path, single_moe):
    out = str(tmp_path / 'ep2')
    torchrun(2, *TINY, *MOE, '--batch_size=2', '--ep_size=2', '--zero=3', '--max_iters=3', f'--out_dir={out}')
    same_losses(read_log(out), single_moe[:3])
    for nproc, layout in [(1, []), (4, ['--batch_size=1', '--ep_size=4'])]:
        resumed = str(tmp_path / f'resumed{nproc}')
        shutil.copytree(out, resumed)
        torchrun(nproc, *TINY, *MOE, '--batch_size=4', *layout, '--max_iters=5', f'--out_dir={resumed}',
                 '--init_from=resume')
        same_losses(read_log(resumed), single_moe)


@pytest.mark.parametrize('knobs', [dict(recompute='full'), dict(recompute='selective'), dict(offload=1.0),
                                   dict(recompute='full', offload=0.5), dict(mlp_chunks=0, loss_chunks=0)])
def test_recompute_and_offload_take_the_moe_block_as_a_block(knobs):
    """Each knob gives the plain model's loss and gradients (the aux loss's included): its recompute runs the
    router and the experts again, and the aux loss's gradient is handed to backward once."""
    def step(overrides):
        model = apply_techniques(new_moe_model(overrides))
        x, y = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(0)).unbind(0)
        loss = model(x[None], y[None])[1]
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, moe_layers(model)[0].aux_count
    loss, grads, count = step(knobs)
    ref_loss, ref_grads, _ = step({})
    assert count == 1
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7)
    offload.reset()
