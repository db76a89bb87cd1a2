"""ring.py's pieces on one process: the flash wrappers against SDPA and the log-sum-exp by hand, and the ring's
steps as documents (ring_documents): over every rank and step, each query attends each key of its own document at
or before it exactly once, whatever the documents' lengths. The ring itself, against one process, under every
layout: test_parallel.py. On CUDA: the varlen kernel against the CPU's per-document calls."""
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
        ring.flash(q, q, q, [0, 4], [0, 4], True)
    # the CPU kernel, by keyword, one call per document: SDPA's output and the log-sum-exp of each
    q, k, v = torch.randn(3, 7, 2, 8, dtype=torch.float64).unbind(0)  # [tokens, heads, hd], packed
    out, lse, _ = ring.flash(q, k, v, [0, 3, 7], [0, 3, 7], True)
    for a, b in ((0, 3), (3, 7)):
        q_doc, k_doc, v_doc = (t[a:b].transpose(0, 1) for t in (q, k, v))
        torch.testing.assert_close(out[a:b].transpose(0, 1),
                                   F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True))
        torch.testing.assert_close(lse[:, a:b], causal_lse(q_doc, k_doc))


def test_flash_backward_is_sdpa_backward_per_document():
    q, k, v, dout = (t.requires_grad_() for t in torch.randn(4, 9, 2, 8, dtype=torch.float64).unbind(0))
    cu = [0, 1, 5, 9]  # a one-token document among them
    out, lse, saved = ring.flash(q, k, v, cu, cu, True)
    grads = ring.flash_backward(dout, q, k, v, out, lse, cu, cu, True, saved)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
                     .transpose(0, 1) for a, b in zip(cu, cu[1:])])
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize('world,lens', [
    (2, [[5, 11], [16], [3, 3, 10], [9, 7]]),
    (4, [[1] * 16, [16], [2, 13, 1], [1, 1, 14]]),   # one-token documents; one document; one across 3 ranks
    (4, [[7, 9, 8, 8]]),                              # documents ending inside chunks, on no chunk boundary
])
def test_ring_steps_attend_each_pair_of_a_document_once(world, lens):
    B, S = len(lens), sum(lens[0])
    n = S // (2 * world)
    doc = np.repeat(np.arange(sum(map(len, lens))), [n_ for row in lens for n_ in row]).reshape(B, S)
    docs = np.flatnonzero(np.concatenate([[True], doc.ravel()[1:] != doc.ravel()[:-1]]))
    want = np.zeros((B, S, S), dtype=int)
    i = np.arange(S)
    want[:] = (doc[:, :, None] == doc[:, None, :]) & (i[None, :, None] >= i[None, None, :])
    got = np.zeros_like(want)
    for rank in range(world):
        for step in range(world):
            q_tokens, k_tokens, cu_q, cu_k, causal = ring.ring_documents(docs, B, n, step, rank, world)
            assert len(cu_q) == len(cu_k) and len(q_tokens) == cu_q[-1] and len(k_tokens) == cu_k[-1]
            source = (rank - step) % world

            def place(r, tokens):  # (row, place in the sequence) of rank r's tokens, as ring_documents counts
                chunk = np.concatenate([np.arange(r * n, r * n + n), np.arange(S - r * n - n, S - r * n)])
                return tokens // (2 * n), chunk[tokens % (2 * n)]
            for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
                rows, qs = place(rank, q_tokens[a:b])
                _, ks = place(source, k_tokens[c:d])
                assert len(set(rows)) == 1 and len(set(doc[rows[0], qs])) == 1 and set(doc[rows[0], ks]) == set(
                    doc[rows[0], qs])  # one document on both sides
                for j, qp in enumerate(qs):
                    for kp in ks[:j + 1] if causal else ks:
                        got[rows[0], qp, kp] += 1
    assert (got == want).all()


@cuda
def test_varlen_flash_on_cuda_is_the_cpus_per_document_calls():
    """The CUDA branch (one varlen kernel call for every document, its lse [H, tokens]) against the CPU's loop: out,
    lse and the gradients, in bf16 within its rounding."""
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = [0, 1, 130, 300, 301], [0, 1, 130, 300, 301]
    q, k, v, dout = torch.randn(4, 301, 4, 64, generator=g).unbind(0)
    want = ring.flash(q, k, v, cu_q, cu_k, True)
    want_grads = ring.flash_backward(dout, q, k, v, *want[:2], cu_q, cu_k, True, want[2])
    cuda_in = [t.cuda().bfloat16() for t in (q, k, v, dout)]
    out, lse, saved = ring.flash(*cuda_in[:3], cu_q, cu_k, True)
    grads = ring.flash_backward(cuda_in[3], *cuda_in[:3], out, lse, cu_q, cu_k, True, saved)
    torch.testing.assert_close(out.float().cpu(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want[1], atol=2e-2, rtol=2e-2)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.float().cpu(), ref, atol=5e-2, rtol=5e-2)
    # not causal (a step from another rank): keys of other lengths than the queries'
    cu_k = [0, 5, 60, 61, 70]
    k, v = torch.randn(2, 70, 4, 64, generator=g).unbind(0)
    want = ring.flash(q, k, v, cu_q, cu_k, False)
    out, lse, _ = ring.flash(cuda_in[0], k.cuda().bfloat16(), v.cuda().bfloat16(), cu_q, cu_k, False)
    torch.testing.assert_close(out.float().cpu(), want[0], atol=2e-2, rtol=2e-2)
