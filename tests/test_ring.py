"""ring.py's pieces on one process: the flash wrappers against SDPA and the log-sum-exp by hand (causal, and under
flash's windows), and the ring's steps as documents (ring_step): over every rank and step, each query attends each
key of its own document at or before it and within its sliding window exactly once, whatever the documents'
lengths and the window; the steps a window never sees have no parts and send nothing. The ring itself, against one
process, under every layout: test_parallel.py. On CUDA: the varlen kernel against the CPU's per-document calls."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import cuda
import ring


def causal_lse(q, k):
    """log-sum-exp of each query's causal scores, by hand: q, k [heads, tokens, hd]."""
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    return scores.masked_fill(torch.ones(len(q[0]), len(k[0])).triu(1).bool(), -torch.inf).logsumexp(-1)


def test_flash_checks_before_calling_the_kernel_and_runs_per_document_on_a_cpu():
    q = torch.empty(4, 2, 8, device='meta')
    with pytest.raises(ValueError, match="cp_impl='ring' calls flash attention on CUDA or a CPU, not meta"):
        ring.flash(q, q, q, [0, 4], [0, 4], (-1, 0))
    # the CPU kernel, by keyword, one call per document: SDPA's output and the log-sum-exp of each
    q, k, v = torch.randn(3, 7, 2, 8, dtype=torch.float64).unbind(0)  # [tokens, heads, hd], packed
    out, lse, _ = ring.flash(q, k, v, [0, 3, 7], [0, 3, 7], (-1, 0))
    for a, b in ((0, 3), (3, 7)):
        q_doc, k_doc, v_doc = (t[a:b].transpose(0, 1) for t in (q, k, v))
        torch.testing.assert_close(out[a:b].transpose(0, 1),
                                   F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True))
        torch.testing.assert_close(lse[:, a:b], causal_lse(q_doc, k_doc))


def test_flash_backward_is_sdpa_backward_per_document():
    q, k, v, dout = (t.requires_grad_() for t in torch.randn(4, 9, 2, 8, dtype=torch.float64).unbind(0))
    cu = [0, 1, 5, 9]  # a one-token document among them
    out, lse, saved = ring.flash(q, k, v, cu, cu, (-1, 0))
    grads = ring.flash_backward(dout, q, k, v, out, lse, cu, cu, (-1, 0), saved)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
                     .transpose(0, 1) for a, b in zip(cu, cu[1:])])
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want)


def flash_window_mask(n_q, n_k, left, right):
    """flash's window by its definition (flash-attn's README): the last query lined up with the last key, query i
    sees key j when i + n_k - n_q - left <= j <= i + n_k - n_q + right, -1 for no bound."""
    i, j = np.arange(n_q)[:, None] + n_k - n_q, np.arange(n_k)[None, :]
    return torch.as_tensor(((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right)))


@pytest.mark.parametrize('window', [(2, 0), (3, 2), (0, 4), (-1, 1), (4, -1)])
def test_flash_under_a_window_is_sdpa_with_its_mask(window):
    """A window (left, right) on the CPU: out, lse and the gradients of SDPA under the mask the window means, each
    document lined up at its own end, a longer key side than query side."""
    q, dout = (t.requires_grad_() for t in torch.randn(2, 9, 2, 8, dtype=torch.float64).unbind(0))
    k, v = (t.requires_grad_() for t in torch.randn(2, 12, 2, 8, dtype=torch.float64).unbind(0))
    cu_q, cu_k = [0, 4, 9], [0, 7, 12]
    out, lse, saved = ring.flash(q, k, v, cu_q, cu_k, window)
    grads = ring.flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, window, saved)
    refs = []
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        mask = flash_window_mask(b - a, d - c, *window)
        q_doc, k_doc, v_doc = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        refs.append(F.scaled_dot_product_attention(q_doc, k_doc, v_doc, attn_mask=mask).transpose(0, 1))
        scores = (q_doc @ k_doc.transpose(1, 2) / 8 ** 0.5).masked_fill(~mask, -torch.inf)
        torch.testing.assert_close(lse[:, a:b], scores.logsumexp(-1))
    torch.testing.assert_close(out, torch.cat(refs))
    for got, want in zip(grads, torch.autograd.grad(torch.cat(refs), (q, k, v), dout)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize('window', [0, 1, 2, 3, 5, 9])
@pytest.mark.parametrize('world,lens', [
    (2, [[5, 11], [16], [3, 3, 10], [9, 7]]),
    (4, [[1] * 16, [16], [2, 13, 1], [1, 1, 14]]),   # one-token documents; one document; one across 3 ranks
    (4, [[7, 9, 8, 8]]),                              # documents ending inside chunks, on no chunk boundary
    (3, [[24], [5, 19]]),                             # an odd ring
])
def test_ring_steps_attend_each_pair_of_a_document_in_its_window_once(world, lens, window):
    B, S = len(lens), sum(lens[0])
    n = S // (2 * world)
    doc = np.repeat(np.arange(sum(map(len, lens))), [n_ for row in lens for n_ in row]).reshape(B, S)
    docs = np.flatnonzero(np.concatenate([[True], doc.ravel()[1:] != doc.ravel()[:-1]]))
    i = np.arange(S)
    gap = i[:, None] - i[None, :]
    want = (doc[:, :, None] == doc[:, None, :]) & (gap >= 0) & (gap < (window or S))
    got = np.zeros(want.shape, dtype=int)

    def place(r, tokens):  # (row, place in the sequence) of rank r's tokens, as ring_step counts them
        chunk = np.concatenate([np.arange(r * n, r * n + n), np.arange(S - r * n - n, S - r * n)])
        return tokens // (2 * n), chunk[tokens % (2 * n)]
    for rank in range(world):
        for step in range(world):
            parts, needed = ring.ring_step(docs, B, n, window, step, rank, world)
            source = (rank - step) % world
            # what the source sends is what the parts attend, and what it computes for us
            assert list(needed) == sorted({t for part in parts for t in part[1]})
            # and exactly the source's tokens some query of ours attends, by the mask itself
            rows, ks = place(source, np.arange(B * 2 * n))
            _, qs = place(rank, np.arange(2 * n))  # our places in a row
            attended = want[rows[:, None], qs[None, :], ks[:, None]].any(1)
            assert list(needed) == list(np.flatnonzero(attended))
            for q_tokens, k_tokens, cu_q, cu_k, (left, right) in parts:
                assert len(cu_q) == len(cu_k) and len(q_tokens) == cu_q[-1] and len(k_tokens) == cu_k[-1]
                for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
                    rows, qs = place(rank, q_tokens[a:b])
                    _, ks = place(source, k_tokens[c:d])
                    assert len(set(rows)) == 1 and len(set(doc[rows[0], np.concatenate([qs, ks])])) == 1
                    seen = flash_window_mask(b - a, d - c, left, right).numpy()
                    for qi, kj in np.argwhere(seen):
                        got[rows[0], qs[qi], ks[kj]] += 1
    assert (got == want).all()


def test_a_window_within_a_chunk_leaves_steps_0_1_and_the_last():
    """cp 4, 8 chunks of n = 8, W = 4 <= n: rank r's first chunk sees the tail of chunk r - 1 (rank r - 1's first:
    step 1), its second chunk the tail of chunk 2P - 2 - r (rank r + 1's second: step P - 1); step 2 has nothing on
    any rank. What a step sends is the W - 1 keys its queries reach, not the source's 2n."""
    world, n, W, B = 4, 8, 4, 1
    for rank in range(world):
        sizes = [len(ring.ring_step(None, B, n, W, step, rank, world)[1]) for step in range(world)]
        want = [2 * n, W - 1 if rank > 0 else 0, 0, W - 1 if rank < world - 1 else 0]
        assert sizes == want, rank
        full = [len(ring.ring_step(None, B, n, 0, step, rank, world)[1]) for step in range(world)]
        # the full causal ring: an earlier rank's first chunk, a later rank's two
        assert full == [2 * n] + [n if step <= rank else 2 * n for step in range(1, world)]


@cuda
def test_varlen_flash_on_cuda_is_the_cpus_per_document_calls():
    """The CUDA branch (one varlen kernel call for every document, its lse [H, tokens]) against the CPU's loop: out,
    lse and the gradients, in bf16 within its rounding."""
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = [0, 1, 130, 300, 301], [0, 1, 130, 300, 301]
    q, k, v, dout = torch.randn(4, 301, 4, 64, generator=g).unbind(0)
    want = ring.flash(q, k, v, cu_q, cu_k, (-1, 0))
    want_grads = ring.flash_backward(dout, q, k, v, *want[:2], cu_q, cu_k, (-1, 0), want[2])
    cuda_in = [t.cuda().bfloat16() for t in (q, k, v, dout)]
    out, lse, saved = ring.flash(*cuda_in[:3], cu_q, cu_k, (-1, 0))
    grads = ring.flash_backward(cuda_in[3], *cuda_in[:3], out, lse, cu_q, cu_k, (-1, 0), saved)
    torch.testing.assert_close(out.float().cpu(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want[1], atol=2e-2, rtol=2e-2)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.float().cpu(), ref, atol=5e-2, rtol=5e-2)
    # not causal (a step from another rank): keys of other lengths than the queries'
    cu_k = [0, 5, 60, 61, 70]
    k, v = torch.randn(2, 70, 4, 64, generator=g).unbind(0)
    want = ring.flash(q, k, v, cu_q, cu_k, (-1, -1))
    out, lse, _ = ring.flash(cuda_in[0], k.cuda().bfloat16(), v.cuda().bfloat16(), cu_q, cu_k, (-1, -1))
    torch.testing.assert_close(out.float().cpu(), want[0], atol=2e-2, rtol=2e-2)
    # a windowed layer's part (flash's own window_size on CUDA, SDPA's mask on the CPU)
    want = ring.flash(q, k, v, cu_q, cu_k, (5, 3))
    out, lse, _ = ring.flash(cuda_in[0], k.cuda().bfloat16(), v.cuda().bfloat16(), cu_q, cu_k, (5, 3))
    torch.testing.assert_close(out.float().cpu(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want[1], atol=2e-2, rtol=2e-2)
