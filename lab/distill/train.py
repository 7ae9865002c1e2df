"""The training loop: AdamW, linear warm-up then cosine decay, gradient clipping, a
checkpoint that resumes where an interruption left off, and a progress bar with the loss
and throughput. On the CPU by default; on a GPU when one is present."""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import losses
from .student import Student
from .teacher import Item


@dataclass
class TrainConfig:
    loss: str = "weighted"          # one of losses.KINDS
    weight: float = 4.0             # extra weight on the stock draft's misses ("weighted")
    method: str = "full"            # one of student.METHODS
    rank: int = 16                  # LoRA rank
    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup: int = 5                 # steps of linear warm-up
    steps: int = 50
    batch: int = 4                  # sequences per step
    clip: float = 1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    seed: int = 0
    chunk: int = 16384              # vocabulary rows per chunk of the log-normaliser
    device: str = "auto"            # auto: cuda when available, else cpu
    qat: str | None = None          # train through this scheme's rounding (the engine's draft)

    def __post_init__(self):
        if self.loss not in losses.KINDS:
            raise ValueError(f"loss {self.loss!r}: choose one of {', '.join(losses.KINDS)}")
        if self.steps < 1 or self.batch < 1 or self.warmup < 0:
            raise ValueError("steps and batch must be at least 1, warmup at least 0")


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to zero at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))


def batch_at(cfg: TrainConfig, n: int, step: int) -> list[int]:
    """The items of a step: a seeded permutation per epoch, so any step is known without
    replaying the ones before it (which is what lets a run resume exactly)."""
    out = []
    for j in range(step * cfg.batch, (step + 1) * cfg.batch):
        epoch, i = divmod(j, n)
        out.append(int(np.random.default_rng([cfg.seed, epoch]).permutation(n)[i]))
    return out


def device_of(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


@torch.no_grad()
def evaluate(student: Student, held: list[Item], cfg: TrainConfig) -> dict:
    """Held-out loss and agreement of the student's distributions (the twin's under qat) with the teacher's:
    top-1 agreement (α greedy), on the stock draft's misses, and 1 − TVD of the coarsened
    distributions (a bound on α when sampling)."""
    w = student.output_matrix
    tot = {"loss": 0.0, "match": 0.0, "miss_match": 0.0, "misses": 0, "one_minus_tvd": 0.0, "n": 0}
    for it in held:
        h = student.hidden(it.tokens)[it.start:]
        t = it.teacher.to(h.device)
        logz = losses.log_normaliser(h, w, cfg.chunk)
        kind = cfg.loss if cfg.loss != "weighted" else "fkl"
        tot["loss"] += float(losses.per_position(kind, h, w, t, logz=logz).sum())
        tot["one_minus_tvd"] += float((1 - losses.per_position("tvd", h, w, t, logz=logz)).sum())
        best = _argmax(h, w, cfg.chunk)
        hit = best == t.ids[:, 0]
        tot["match"] += float(hit.sum())
        tot["miss_match"] += float(hit[t.stock_wrong].sum())
        tot["misses"] += int(t.stock_wrong.sum())
        tot["n"] += len(t)
    n = max(1, tot["n"])
    return {"held_loss": tot["loss"] / n, "alpha_greedy": tot["match"] / n,
            "alpha_on_stock_misses": tot["miss_match"] / max(1, tot["misses"]),
            "one_minus_tvd": tot["one_minus_tvd"] / n}


def _argmax(h: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    best_v = torch.full(h.shape[:1], float("-inf"))
    best_i = torch.zeros(h.shape[:1], dtype=torch.long)
    for a in range(0, w.shape[0], chunk):
        v, i = (h @ w[a:a + chunk].T).max(-1)
        better = v > best_v                              # strict: the first maximum wins, as argmax
        best_v, best_i = torch.where(better, v, best_v), torch.where(better, i + a, best_i)
    return best_i


@dataclass
class Run:
    student: Student
    history: list[dict] = field(default_factory=list)
    step: int = 0
    seconds: float = 0.0
    tokens: int = 0


def _save(path: Path, run: Run, opt, cfg: TrainConfig) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"config": asdict(cfg), "step": run.step, "seconds": run.seconds, "tokens": run.tokens,
                "history": run.history, "params": {n: t.detach().cpu() for n, t in run.student.trainable().items()},
                "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def _load(path: Path, run: Run, opt, cfg: TrainConfig) -> None:
    ck = torch.load(path, weights_only=False)
    if ck["config"] != asdict(cfg):
        diff = {k: (v, asdict(cfg)[k]) for k, v in ck["config"].items() if asdict(cfg).get(k) != v}
        raise ValueError(f"the checkpoint {path} was made with other settings {diff}; "
                         f"delete it or train into another folder")
    with torch.no_grad():
        for n, t in run.student.trainable().items():
            t.copy_(ck["params"][n])
    opt.load_state_dict(ck["opt"])
    run.student.refresh()
    run.step, run.seconds, run.tokens, run.history = ck["step"], ck["seconds"], ck["tokens"], ck["history"]


def train(student: Student, data: list[Item], held: list[Item], cfg: TrainConfig,
          checkpoint: str | Path | None = None, stop_at: int | None = None, progress: bool = True) -> Run:
    """Trains `student` in place on `data`; with a checkpoint path, resumes from it when it
    exists and saves to it every cfg.checkpoint_every steps and at the end. stop_at: return
    after that step, as an interruption would (for tests). -> the Run with its history:
    held-out metrics at step 0, every cfg.eval_every steps and at the end."""
    from tqdm.auto import tqdm
    if not data:
        raise ValueError("no training sequences: build the data first")
    dev = device_of(cfg)
    student.to_device(dev)
    params = student.trainable()
    opt = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    run = Run(student)
    path = Path(checkpoint) if checkpoint else None
    if path and path.exists():
        _load(path, run, opt, cfg)
    end = min(cfg.steps, stop_at if stop_at is not None else cfg.steps)
    bar = tqdm(total=cfg.steps, initial=run.step, desc=f"distill ({cfg.method}, {cfg.loss})", unit="step",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    with torch.device(dev):                     # factory calls inside the model follow the weights
        if not run.history:
            run.history.append({"step": 0, "tokens": 0, "seconds": 0.0, **evaluate(student, held, cfg)})
        while run.step < end:
            t0 = time.perf_counter()
            batch = [data[i] for i in batch_at(cfg, len(data), run.step)]
            ntok = sum(len(it) for it in batch)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, run.step)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for it in batch:
                h = student.hidden(it.tokens)[it.start:]
                part = losses.loss(cfg.loss, h, student.output_matrix, it.teacher.to(dev), cfg.weight, cfg.chunk) * (len(it) / ntok)
                part.backward()
                total += float(part.detach())
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.clip)
            opt.step()
            student.refresh()
            run.step += 1
            run.tokens += ntok
            run.seconds += time.perf_counter() - t0
            bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{run.tokens / run.seconds:.0f}")
            bar.update()
            if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
                run.history.append({"step": run.step, "tokens": run.tokens, "seconds": run.seconds,
                                    "train_loss": total, **evaluate(student, held, cfg)})
            if path and (run.step % cfg.checkpoint_every == 0 or run.step == end):
                _save(path, run, opt, cfg)
    bar.close()
    return run
