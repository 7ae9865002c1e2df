"""The target's next-token distributions along its own answers, kept sparse (top-k and the
mass left over), with the stock draft's top-1 at every position: what the losses need,
computed once by the engines and cached per sample."""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.export import content_id
from .data import Sample, distill_dir
from .losses import Teacher, sparse_teacher


@dataclass
class Item:
    """One training sequence: tokens = prompt + answer without its last token; the positions
    from `start` on predict the answer, and `teacher` holds the target there."""
    id: str
    source: str
    tokens: list[int]
    start: int
    teacher: Teacher

    def __len__(self) -> int:
        return len(self.teacher)


def teacher_forced(engine, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Logits [len(answer), vocab]: row j predicts answer[j], from one pass of the engine
    (a k-token pass equals the single steps that produced the answer, bit for bit)."""
    return engine.forward(list(prompt) + list(answer[:-1]), 0)[len(prompt) - 1:]


def _key(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def items(samples: list[Sample], target, draft, k: int = 32, cache: Path | None = None,
          progress: bool = True) -> list[Item]:
    """Items for samples: the target engine's top-k at each answer position and the stock
    draft engine's greedy guess there, cached as one .npz per sample."""
    from tqdm.auto import tqdm
    cache = Path(cache or distill_dir() / "teacher")
    cache.mkdir(parents=True, exist_ok=True)
    pair = (content_id(target.file), content_id(draft.file))
    out = []
    for s in tqdm(samples, desc="teacher distributions", unit="seq", disable=not progress, file=sys.stderr):
        f = cache / f"{_key(*pair, k, s.prompt, s.answer)}.npz"
        if not f.exists():
            tl = teacher_forced(target, s.prompt, s.answer)
            stock = teacher_forced(draft, s.prompt, s.answer).argmax(-1)
            t = sparse_teacher(tl, k, s.answer, stock)
            tmp = f.with_suffix(".partial.npz")
            np.savez(tmp, ids=t.ids.numpy().astype(np.int32), logp=t.logp.numpy(), stock=stock.astype(np.int32))
            tmp.replace(f)
        z = np.load(f)
        ids = torch.from_numpy(z["ids"].astype(np.int64))
        t = Teacher(ids, torch.from_numpy(z["logp"]), torch.tensor(s.answer, dtype=torch.long),
                    torch.from_numpy(z["stock"].astype(np.int64)) != ids[:, 0])
        out.append(Item(s.id, s.source, list(s.prompt) + list(s.answer[:-1]), len(s.prompt) - 1, t))
    return out
