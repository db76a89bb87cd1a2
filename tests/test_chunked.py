"""chunked.py against the plain computation: same loss, same input and weight gradients (fp32,
relative 1e-5), for odd lengths, ignored targets, tied embeddings, gradient accumulation, bf16."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chunked import auto_loss_chunks, auto_mlp_chunks, chunked_cross_entropy, chunked_mlp  # noqa: E402

RTOL = 1e-5        # fp32: chunked vs plain, relative (norm-based)
BF16_RTOL = 2e-2   # bf16: both bf16 paths vs the fp32 reference, relative (norm-based)
D, V, I = 32, 300, 80


def rel(a, b):
    """Norm-based relative error of a against the reference b."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def plain_loss(h, w, t):
    count = (t != -100).sum()
    return F.cross_entropy(F.linear(h, w).float().flatten(0, -2), t.flatten(), reduction='sum') / count.clamp(min=1)


def plain_mlp(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def loss_case(shape, seed=0, ignore=(), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[list(ignore)] = -100
    return h, w, t


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


def check_loss(h, w, t, chunks, rtol=RTOL):
    ref = plain_loss(h, w, t)
    out = chunked_cross_entropy(h, w, t, chunks)
    assert abs(out.item() - ref.item()) <= rtol * max(abs(ref.item()), 1e-6)
    for a, b in zip(grads(out, h, w), grads(ref, h, w)):
        assert rel(a, b) <= rtol


# ----------------------------------------------------------------------------- loss

@pytest.mark.parametrize("n,chunks", [(37, 5), (37, 2), (37, 64), (37, 37), (36, 4), (37, 0)])
def test_loss_matches_plain(n, chunks):
    # 37 tokens in 5 chunks: 8,8,8,8,5 (ragged last chunk); 64 chunks > 37 tokens; one token per chunk
    h, w, t = loss_case((n,), ignore=(3, 4, 30))
    check_loss(h, w, t, chunks)


def test_loss_batch_dims():
    h, w, t = loss_case((3, 37), seed=1, ignore=(0, 50, 110))
    check_loss(h, w, t, 7)


def test_loss_all_ignored_chunks():
    # chunks of 8 tokens: the first two chunks and the ragged last one have only -100 targets
    h, w, t = loss_case((37,), seed=2, ignore=list(range(16)) + list(range(32, 37)))
    check_loss(h, w, t, 5)


def test_loss_all_ignored_input():
    h, w, t = loss_case((37,), seed=3, ignore=range(37))
    out = chunked_cross_entropy(h, w, t, 5)
    assert out.item() == 0.0
    gh, gw = grads(out, h, w)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


def test_loss_tied_embeddings():
    # the same weight is the embedding and the LM head in one graph: both gradients must sum
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    lin = (torch.randn(D, D, generator=g) * 0.2).requires_grad_()
    idx, t = torch.randint(0, V, (2, 37), generator=g), torch.randint(0, V, (2, 37), generator=g)
    t[0, :5] = -100

    def run(loss_fn):
        h = torch.tanh(F.linear(F.embedding(idx, w), lin))
        return grads(loss_fn(h), w, lin)

    ref = run(lambda h: plain_loss(h, w, t))
    out = run(lambda h: chunked_cross_entropy(h, w, t, 6))
    for a, b in zip(out, ref):
        assert rel(a, b) <= RTOL


def test_loss_gradient_accumulation():
    # three micro-steps backward into the same .grad, each loss divided by the number of steps
    h0, w0, _ = loss_case((37,), seed=5)
    steps = [loss_case((37,), seed=10 + i, ignore=(i, 20 + i))[2] for i in range(3)]

    def run(loss_fn):
        h = h0.detach().clone().requires_grad_()
        w = w0.detach().clone().requires_grad_()
        for i, t in enumerate(steps):
            (loss_fn(h * (i + 1), w, t) / len(steps)).backward()
        return h.grad, w.grad

    for a, b in zip(run(lambda h, w, t: chunked_cross_entropy(h, w, t, 5)), run(plain_loss)):
        assert rel(a, b) <= RTOL


def test_loss_frozen_head_and_frozen_input():
    h, w, t = loss_case((37,), seed=6, ignore=(1,))
    ref_h, ref_w = grads(plain_loss(h, w, t), h, w)
    (gh,) = grads(chunked_cross_entropy(h, w.detach(), t, 5), h)
    assert rel(gh, ref_h) <= RTOL
    (gw,) = grads(chunked_cross_entropy(h.detach(), w, t, 5), w)
    assert rel(gw, ref_w) <= RTOL


def test_loss_bf16():
    # bf16 inputs: the chunked loss keeps fp32 logits, so it is no further from the fp32 reference
    # than the plain bf16 path (both within 2e-2 relative, loss and every gradient)
    h, w, t = loss_case((2, 37), seed=7, ignore=(0, 40))
    ref = plain_loss(h, w, t)
    ref_g = grads(ref, h, w)
    hb, wb = (x.detach().bfloat16().requires_grad_() for x in (h, w))
    for loss in (chunked_cross_entropy(hb, wb, t, 5), plain_loss(hb, wb, t)):
        assert loss.dtype == torch.float32
        assert abs(loss.item() - ref.item()) <= BF16_RTOL * abs(ref.item())
        for a, b in zip(grads(loss, hb, wb), ref_g):
            assert a.dtype == torch.bfloat16 and rel(a, b) <= BF16_RTOL


def test_loss_bf16_autocast():
    h, w, t = loss_case((37,), seed=8, ignore=(5,))
    ref = plain_loss(h, w, t)
    ref_g = grads(ref, h, w)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, t, 4)
    assert abs(loss.item() - ref.item()) <= BF16_RTOL * abs(ref.item())
    for a, b in zip(grads(loss, h, w), ref_g):
        assert a.dtype == torch.float32 and rel(a, b) <= BF16_RTOL


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return func(*args, **(kwargs or {}))


def test_loss_no_grad_same_loss_and_no_gradient_work():
    h, w, t = loss_case((37,), seed=9, ignore=(2, 3))
    with CountMatmuls() as train:
        loss = chunked_cross_entropy(h, w, t, 5)
    assert train.n == 3 * 5  # logits, dh, dW per chunk: the gradients are made in forward
    with torch.no_grad(), CountMatmuls() as ev:
        loss_eval = chunked_cross_entropy(h, w, t, 5)
    assert ev.n == 5  # the logits only
    assert loss_eval.grad_fn is None and loss_eval.item() == loss.item()
    with CountMatmuls() as frozen:  # nothing requires grad: no gradient work either
        chunked_cross_entropy(h.detach(), w.detach(), t, 5)
    assert frozen.n == 5


def test_loss_backward_twice_raises():
    h, w, t = loss_case((37,), seed=11)
    loss = chunked_cross_entropy(h, w, t, 5)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_loss_agrees_with_torch_linear_cross_entropy():
    h, w, t = loss_case((37,), seed=12, ignore=(0, 9, 36))
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8, chunking_method=None)
    ref = F.linear_cross_entropy(h, w, t, ignore_index=-100, options=opts)
    out = chunked_cross_entropy(h, w, t, 5)
    assert abs(out.item() - ref.item()) <= RTOL * abs(ref.item())
    for a, b in zip(grads(out, h, w), grads(ref, h, w)):
        assert rel(a, b) <= RTOL


# ----------------------------------------------------------------------------- MLP

def mlp_case(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=g).to(dtype).requires_grad_()
    ws = [(torch.randn(*s, generator=g) * 0.2).to(dtype).requires_grad_() for s in ((I, D), (I, D), (D, I))]
    return x, *ws


@pytest.mark.parametrize("shape,chunks", [((37,), 5), ((37,), 64), ((37,), 37), ((2, 37), 3), ((2, 3, 37), 4),
                                          ((37,), 0)])
def test_mlp_matches_plain(shape, chunks):
    x, w1, w3, w2 = mlp_case(shape, seed=len(shape) + chunks)
    ref = plain_mlp(x, w1, w3, w2)
    out = chunked_mlp(x, w1, w3, w2, chunks)
    assert out.shape == ref.shape and rel(out, ref) <= RTOL
    gy = torch.randn_like(ref)
    for a, b in zip(grads((out * gy).sum(), x, w1, w3, w2), grads((ref * gy).sum(), x, w1, w3, w2)):
        assert rel(a, b) <= RTOL


def test_mlp_gradient_accumulation_and_frozen_weight():
    x0, w1, w3, w2 = mlp_case((37,), seed=20)
    w3 = w3.detach()  # a frozen weight gets no gradient and costs no gradient matmul

    def run(fn):
        x = x0.detach().clone().requires_grad_()
        ws = [w.detach().clone().requires_grad_() for w in (w1, w2)]
        for i in range(3):
            fn(x * (i + 1), ws[0], w3, ws[1]).square().mean().backward()
        return x.grad, ws[0].grad, ws[1].grad

    for a, b in zip(run(lambda x, a, b, c: chunked_mlp(x, a, b, c, 5)), run(plain_mlp)):
        assert rel(a, b) <= RTOL


def test_mlp_bf16():
    # bf16 weights: weight gradients are accumulated over the chunks in fp32, returned in bf16
    x, w1, w3, w2 = mlp_case((2, 37), seed=21)
    gy = torch.randn(2, 37, D)
    ref = plain_mlp(x, w1, w3, w2)
    ref_g = grads((ref * gy).sum(), x, w1, w3, w2)
    xb, w1b, w3b, w2b = (t.detach().bfloat16().requires_grad_() for t in (x, w1, w3, w2))
    for fn in (lambda: chunked_mlp(xb, w1b, w3b, w2b, 5), lambda: plain_mlp(xb, w1b, w3b, w2b)):
        out = fn()
        assert out.dtype == torch.bfloat16 and rel(out, ref) <= BF16_RTOL
        for a, b in zip(grads((out * gy.bfloat16()).sum(), xb, w1b, w3b, w2b), ref_g):
            assert a.dtype == torch.bfloat16 and rel(a, b) <= BF16_RTOL
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = chunked_mlp(x, w1, w3, w2, 5)
    assert out.dtype == torch.bfloat16 and rel(out, ref) <= BF16_RTOL
    for a, b in zip(grads((out.float() * gy).sum(), x, w1, w3, w2), ref_g):
        assert a.dtype == torch.float32 and rel(a, b) <= BF16_RTOL


def saved_bytes(fn):
    """Bytes autograd keeps for backward while running fn (counted at pack time)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_mlp_keeps_only_its_input_and_split_cat_keeps_everything():
    x, w1, w3, w2 = mlp_case((2, 64), seed=22)
    n_tok, b = 2 * 64, 4
    x_bytes, w_bytes = n_tok * D * b, 3 * I * D * b
    chunked = saved_bytes(lambda: chunked_mlp(x, w1, w3, w2, 8))
    assert chunked == x_bytes + w_bytes  # x and the weights (which exist anyway), nothing S × I
    # split + cat: autograd keeps every chunk's x W1ᵀ, x W3ᵀ, silu and product, as the plain MLP does
    intermediates = 4 * n_tok * I * b
    split_cat = saved_bytes(lambda: torch.cat([plain_mlp(c, w1, w3, w2) for c in x.split(16, dim=1)], dim=1))
    plain = saved_bytes(lambda: plain_mlp(x, w1, w3, w2))
    assert plain >= intermediates and split_cat >= intermediates
    assert split_cat - chunked > intermediates - w_bytes


def test_mlp_backward_holds_three_chunk_buffers():
    # MemTracker over the backward: its peak of temporaries is dx, the fp32 sums of dW1, dW3, dW2 and one chunk's
    # three S/M × I buffers (reused in place), to the byte: a fourth buffer per chunk fails this
    from torch.distributed._tools.mem_tracker import MemTracker
    N, M = 1024, 8
    x, w1, w3, w2 = mlp_case((N,), seed=23)
    y = chunked_mlp(x, w1, w3, w2, M)
    gy = torch.randn_like(y)
    mt = MemTracker()
    mt.track_external(x, w1, w3, w2, y, gy)
    with mt:
        torch.autograd.backward(y, gy)
    temp = next(v for k, v in mt.get_tracker_snapshot('peak')[torch.device('cpu')].items() if str(k).endswith('TEMP'))
    assert temp == 4 * (N * D + 3 * I * D + 3 * (N // M) * I)


# ----------------------------------------------------------------------------- chunk counts

def test_auto_chunk_counts():
    # Llama 3 8B at 8K tokens: 32 loss chunks (4,096 wide, 128,256 vocabulary), 11 MLP chunks
    assert auto_loss_chunks(8192, 4096, 128256) == 32
    assert auto_mlp_chunks(8192, 4096, 14336) == 11
    # one chunk's logits are about the hidden state's size: (S/M)·V ≈ S·D
    S, Dm, Vm = 65536, 2048, 128256
    M = auto_loss_chunks(S, Dm, Vm)
    assert M == 63 and abs(-(-S // M) * Vm / (S * Dm) - 1) < 0.05
    # ... but no chunk under 256 tokens (MIN_CHUNK_TOKENS): short inputs get fewer, bigger chunks
    assert auto_loss_chunks(8192, 256, 128256) == 32 and auto_loss_chunks(300, 256, 128256) == 2
    assert auto_loss_chunks(10, 256, 128256) == 1 and auto_mlp_chunks(1024, 64, 4096) == 4
    assert auto_loss_chunks(100000, 4096, 1000) == 1 and auto_mlp_chunks(0, 64, 256) == 1


# ----------------------------------------------------------------------------- attention by head groups
from conftest import apply_techniques, cuda, packed_batch  # noqa: E402
from knobs import Knobs  # noqa: E402
from model import Llama  # noqa: E402
import offload  # noqa: E402

GROUPED = dict(n_layer=2, n_head=8, n_kv_head=4, n_embd=64, intermediate_size=96, vocab_size=97)


def grouped_step(dtype=torch.float32, docs=False, **knobs):
    """Loss and every gradient of one forward + backward of a 2-block Llama (8 query heads, 4 kv heads)."""
    torch.manual_seed(0)
    model = apply_techniques(Llama(Knobs(**GROUPED, **knobs)).to(dtype))
    if docs:
        x, y, pos, starts = packed_batch([[5, 27], [32], [3, 3, 26]], GROUPED['vocab_size'])
    else:
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, GROUPED['vocab_size'], (3, 32), generator=g) for _ in range(2))
        pos = starts = None
    _, loss = model(x, y, pos, starts)
    loss.backward()
    offload.reset()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize('groups', [2, 4, 0])
@pytest.mark.parametrize('knobs', [dict(), dict(recompute='full'), dict(recompute='selective'),
                                   dict(recompute='full', offload=1.0), dict(offload=1.0),
                                   dict(docs=True), dict(docs=True, recompute='full', mlp_chunks=3)],
                         ids=lambda k: '-'.join(f'{a}={b}' for a, b in k.items()) or 'plain')
def test_attention_by_head_groups_equals_all_heads_at_once(groups, knobs):
    ref_loss, ref = grouped_step(**knobs)
    loss, got = grouped_step(attention_chunks=groups, **knobs)
    assert abs(loss - ref_loss) <= RTOL * ref_loss
    for n in ref:
        assert rel(got[n], ref[n]) <= RTOL, n


def test_attention_by_head_groups_in_bf16_is_within_its_rounding():
    _, exact = grouped_step()
    _, whole = grouped_step(torch.bfloat16)
    loss, grouped = grouped_step(torch.bfloat16, attention_chunks=4)
    for n in exact:  # the groups' outputs are summed in bf16: rounded G times, as close as all heads at once
        assert rel(grouped[n], exact[n]) <= max(BF16_RTOL, 1.5 * rel(whole[n], exact[n])), n


def test_attention_by_head_groups_keeps_its_input_alone():
    """After forward, all heads at once keep q, k, v, the output and its logsumexp; G groups keep the
    block's normed input only (chunked.head_groups' checkpoints), and backward holds one group's q, k, v at a time."""
    from torch.distributed._tools.mem_tracker import MemTracker
    B, S, h, hd, H, K = 2, 256, 64, 8, 8, 4
    kept, peak = {}, {}
    for G in (1, 4):
        torch.manual_seed(0)
        attention = apply_techniques(Llama(Knobs(**GROUPED, attention_chunks=G))).layers['0'].attention
        x = torch.randn(B, S, h, requires_grad=True)
        cos, sin = torch.ones(S, hd), torch.zeros(S, hd)
        mt = MemTracker()
        mt.track_external(attention, x, cos, sin)
        with mt:
            y = attention(x, cos, sin)
            kept[G] = sum(v for k, v in mt.get_tracker_snapshot()[torch.device('cpu')].items()
                          if str(k).endswith(('ACT', 'TEMP')))
            y.sum().backward()
        peak[G] = mt.get_tracker_snapshot('peak')[torch.device('cpu')]['Total']
    b = 4
    q_k_v_out = B * S * b * (2 * h + 2 * K * hd)
    assert kept[4] == B * S * h * b  # y itself: nothing else outlives forward
    assert kept[1] >= kept[4] + q_k_v_out  # + q, k, v and the output (wo's input: a view of it)
    assert peak[1] - peak[4] >= q_k_v_out * 3 / 4  # backward: a quarter of q, k, v and the output at once


def test_attention_chunks_counts_and_refusals():
    from chunked import attention_chunks
    c = Knobs(n_head=32, n_kv_head=8, n_embd=4096, attention_chunks=0)
    assert attention_chunks(c, 32, 8) == 8        # one process: a kv head and its 4 query heads a group
    assert attention_chunks(c, 32, 8, 8) == 4     # Ulysses over 8: 8 query heads a group, one per rank
    assert attention_chunks(c, 16, 4, 2) == 4     # tp 2 (4 kv heads a rank), Ulysses 2: 4 query heads
    assert attention_chunks(c, 4, 1) == 1         # tp 8: one kv head a rank
    assert attention_chunks(Knobs(n_head=32, n_kv_head=8, n_embd=4096, attention_chunks=2), 32, 8, 8) == 2
    with pytest.raises(ValueError, match=r"attention_chunks=3: must divide n_kv_head=4"):
        Knobs(**GROUPED, attention_chunks=3)
    # offload.py's token-wise cut runs attention once on every token: refused, as the layout rules are
    from parallel import check_layout
    split = check_layout(Knobs(**GROUPED, attention_chunks=2, offload=0.5), 1, 1, 1)
    assert split.startswith("attention_chunks=2 with offload=0.5 and recompute='none': offload.py cuts attention")
    assert 'by tokens, not heads' in check_layout(Knobs(**GROUPED, attention_chunks=0, offload=1.0,
                                                              recompute='selective'), 1, 1, 1)
    # the block whole: 'none' with α = 1, or 'full'
    assert check_layout(Knobs(**GROUPED, attention_chunks=4, offload=1.0), 1, 1, 1) is None
    assert check_layout(Knobs(**GROUPED, attention_chunks=4, offload=0.5, recompute='full'), 1, 1, 1) is None


@cuda
def test_attention_by_head_groups_on_cuda_holds_less_for_the_same_gradients():
    """On a CUDA GPU in bf16 (SDPA's flash kernel, its real workspace): one kv head's group at a time gives all
    heads' loss and gradients within bf16's rounding, and the allocator's peak of a step is lower."""
    shape = dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=512, intermediate_size=1024, vocab_size=97,
                 recompute='full', mlp_chunks=0, loss_chunks=0)
    idx = torch.randint(0, 97, (1, 16384), device='cuda')
    runs = []
    for groups in (1, 0):
        torch.manual_seed(0)
        model = apply_techniques(Llama(Knobs(**shape, attention_chunks=groups)).cuda())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            _, loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        peak = torch.cuda.max_memory_allocated() - base
        runs.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}, peak))
    (loss1, grads1, peak1), (loss2, grads2, peak2) = runs
    assert abs(loss2 - loss1) < 1e-2 * loss1
    assert all(rel(grads2[n], grads1[n]) < BF16_RTOL for n in grads1)
    print(f'peak of a step: all heads {peak1 / 2**20:.0f} MiB, by head groups {peak2 / 2**20:.0f} MiB')
    assert peak2 < peak1
