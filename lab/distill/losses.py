"""Distillation losses against a sparse teacher, computed over the vocabulary in chunks.

The teacher (the target) is kept as its top-k log-probabilities plus the mass left over;
the student is compared on the same coarsened distribution (top-k tokens and one "rest"
bucket), which is exact for cross-entropy and a lower bound for KL and TVD. The student's
log-normaliser runs over the output matrix in chunks of rows, forward and backward, so a
[positions, vocabulary] tensor never exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("ce", "fkl", "rkl", "tvd", "weighted")
EPS = 1e-9


class ChunkedLogZ(torch.autograd.Function):
    """logsumexp(h @ W.T, -1) with W [vocab, hidden] visited `chunk` rows at a time; the
    backward recomputes each chunk's logits instead of keeping them."""

    @staticmethod
    def forward(ctx, h, w, chunk):
        m = torch.full(h.shape[:1], float("-inf"), dtype=h.dtype)
        s = torch.zeros(h.shape[:1], dtype=h.dtype)
        for a in range(0, w.shape[0], chunk):
            logits = h @ w[a:a + chunk].T
            new = torch.maximum(m, logits.amax(-1))
            s = s * torch.exp(m - new) + torch.exp(logits - new[:, None]).sum(-1)
            m = new
        logz = m + torch.log(s)
        ctx.save_for_backward(h, w, logz)
        ctx.chunk = chunk
        return logz

    @staticmethod
    def backward(ctx, grad):
        h, w, logz = ctx.saved_tensors
        gh = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for a in range(0, w.shape[0], ctx.chunk):
            wc = w[a:a + ctx.chunk]
            g = torch.exp(h @ wc.T - logz[:, None]) * grad[:, None]       # softmax · upstream
            if gh is not None:
                gh += g @ wc
            if gw is not None:
                gw[a:a + ctx.chunk] = g.T @ h
        return gh, gw, None


def log_normaliser(h: torch.Tensor, w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    return ChunkedLogZ.apply(h, w, chunk)


@dataclass
class Teacher:
    """The target's next-token distributions at N positions: top-k ids and log-probs, the
    token its text continues with, and whether the stock draft's top-1 missed it."""
    ids: torch.Tensor          # [N, k] int64
    logp: torch.Tensor         # [N, k] float32
    next_token: torch.Tensor   # [N] int64
    stock_wrong: torch.Tensor  # [N] bool

    @property
    def rest(self) -> torch.Tensor:
        return (1.0 - self.logp.exp().sum(-1)).clamp_min(EPS)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, dev) -> "Teacher":
        return Teacher(self.ids.to(dev), self.logp.to(dev), self.next_token.to(dev), self.stock_wrong.to(dev))


def sparse_teacher(logits: np.ndarray, k: int, next_token, stock_top1=None) -> Teacher:
    """Top-k log-probabilities (temperature 1) of logits [N, vocab]; stock_top1 [N]: the stock
    draft's greedy guesses (a miss is where it differs from the target's own top-1)."""
    x = np.asarray(logits, np.float64)
    k = min(k, x.shape[1])
    ids = np.argpartition(-x, k - 1, axis=1)[:, :k]
    ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(x, ids, 1), axis=1), 1)   # best first
    m = x.max(1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(x - m).sum(1))
    logp = np.take_along_axis(x, ids, 1) - logz[:, None]
    wrong = (np.zeros(len(x), bool) if stock_top1 is None else np.asarray(stock_top1) != ids[:, 0])
    return Teacher(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logp.astype(np.float32)),
                   torch.as_tensor(np.asarray(next_token), dtype=torch.long), torch.from_numpy(wrong))


def per_position(kind: str, h: torch.Tensor, w: torch.Tensor, t: Teacher, chunk: int = 8192,
                 logz: torch.Tensor | None = None) -> torch.Tensor:
    """The loss at each position: h [N, hidden] the student's final hidden states, w its
    output matrix (rows up to the tokenizer's length); logz, when already computed, saves
    the pass over the vocabulary."""
    if kind not in KINDS:
        raise ValueError(f"loss {kind!r}: choose one of {', '.join(KINDS)}")
    logz = log_normaliser(h, w, chunk) if logz is None else logz
    if kind == "ce":
        return logz - (h * w[t.next_token]).sum(-1)
    logq = torch.einsum("nh,nkh->nk", h, w[t.ids]) - logz[:, None]
    q, p = logq.exp(), t.logp.exp()
    q_rest, p_rest = (1.0 - q.sum(-1)).clamp_min(EPS), t.rest
    if kind in ("fkl", "weighted"):
        return (p * (t.logp - logq)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    if kind == "rkl":
        return (q * (logq - t.logp)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
    return 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())


def loss(kind: str, h: torch.Tensor, w: torch.Tensor, t: Teacher, weight: float = 4.0,
         chunk: int = 8192) -> torch.Tensor:
    """The mean loss; `weighted` is forward KL with positions the stock draft got wrong
    counted 1 + weight times."""
    per = per_position(kind, h, w, t, chunk)
    if kind != "weighted":
        return per.mean()
    wts = 1.0 + weight * t.stock_wrong.float()
    return (per * wts).sum() / wts.sum()
