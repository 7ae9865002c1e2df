"""How closely the PyTorch twin tracks the engine (docs/science.md §6): top-1 agreement and
mean total-variation distance of their next-token distributions, position by position."""
from __future__ import annotations

import numpy as np
import torch

from .perplexity import windows


def corpus_ids(name: str, text: str, config, tokenizer=None) -> list[int]:
    """Token ids of a text; tiny models (no tokenizer) take its bytes modulo their vocabulary."""
    if tokenizer is not None:
        return tokenizer(text)["input_ids"]
    return [b % config.tokenizer_size for b in text.encode()]


@torch.no_grad()
def engine_vs_twin(engine, twin, ids: list[int], window: int, count: int | None = None) -> dict:
    n = twin.config.tokenizer_size
    agree = total = 0
    tvd = 0.0
    for w in windows(ids, window, count):
        a = torch.from_numpy(engine.forward(w, 0)).float()
        twin.reset()
        b = twin.forward(w, 0)[:, :n].float()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        tvd += float(0.5 * (torch.softmax(a, -1) - torch.softmax(b, -1)).abs().sum(-1).sum())
        total += len(w)
    return {"positions": total, "top1_agreement": agree / total, "mean_tvd": tvd / total}
