"""Distillation losses: the chunked log-normaliser against torch's dense one (values and
gradients), every loss against its textbook formula with a dense teacher, the sparse
teacher's coarsening."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.distill import losses

torch.manual_seed(0)


def dense_case(n=6, hidden=8, vocab=37):
    h = torch.randn(n, hidden, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.float64, requires_grad=True)
    tl = torch.randn(n, vocab, dtype=torch.float64) * 2
    nxt = tl.argmax(-1)
    stock = torch.randint(0, vocab, (n,))
    t = losses.sparse_teacher(tl.numpy(), vocab, nxt.numpy(), stock.numpy())     # k = vocab: nothing left over
    t.logp = t.logp.double()
    return h, w, tl, t


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
def test_chunked_log_normaliser_equals_dense(chunk):
    h, w, _, _ = dense_case()
    assert torch.autograd.gradcheck(lambda a, b: losses.log_normaliser(a, b, chunk), (h, w))
    got = losses.log_normaliser(h, w, chunk)
    torch.testing.assert_close(got, torch.logsumexp(h @ w.T, -1), rtol=1e-12, atol=1e-12)
    (got * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (torch.logsumexp(h @ w.T, -1) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)


def test_losses_match_their_formulas():
    h, w, tl, t = dense_case()
    logq = F.log_softmax(h @ w.T, -1)
    logp = F.log_softmax(tl, -1)
    p, q = logp.exp(), logq.exp()
    want = {"ce": -logq.gather(1, t.next_token[:, None])[:, 0],
            "fkl": (p * (logp - logq)).sum(-1),
            "rkl": (q * (logq - logp)).sum(-1),
            "tvd": 0.5 * (p - q).abs().sum(-1)}
    for kind, ref in want.items():
        got = losses.per_position(kind, h, w, t, chunk=7)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=kind)   # rest bucket ~ EPS
    wts = 1 + 4.0 * t.stock_wrong.double()
    torch.testing.assert_close(losses.loss("weighted", h, w, t, 4.0), (want["fkl"] * wts).sum() / wts.sum(),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="choose one of"):
        losses.loss("kl", h, w, t)


def test_chunked_loss_equals_unchunked_with_gradients():
    h, w, _, t = dense_case(vocab=50)
    t = losses.sparse_teacher(np.random.default_rng(1).normal(size=(6, 50)) * 3, 5, np.arange(6), np.zeros(6))
    grads = []
    for chunk in (3, 50):
        h.grad = w.grad = None
        losses.loss("rkl", h.float(), w.float(), t, chunk=chunk).backward()
        grads.append((h.grad.clone(), w.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


def test_sparse_teacher_coarsens_exactly():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 30)) * 3
    t = losses.sparse_teacher(x, 5, x.argmax(1), x.argmax(1))
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.sort(p, 1)[:, ::-1][:, :5]
    np.testing.assert_allclose(t.logp.exp().numpy(), top, rtol=1e-5)
    np.testing.assert_allclose(t.rest.numpy(), 1 - top.sum(1), rtol=1e-4, atol=1e-6)
    assert (t.ids[:, 0].numpy() == x.argmax(1)).all() and not t.stock_wrong.any()
    # the forward KL of the coarsened pair never exceeds the full one
    w, h = torch.randn(30, 6), torch.randn(4, 6)
    full = (torch.from_numpy(p).float() * (torch.from_numpy(np.log(p)).float() - F.log_softmax(h @ w.T, -1))).sum(-1)
    assert (losses.per_position("fkl", h, w, t) <= full + 1e-5).all()
