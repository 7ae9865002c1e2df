"""The steps of a distillation run that a notebook strings together: the data for a pair,
and a training run kept in the cache under a key of everything that shapes it (so a
re-run picks up the finished or interrupted run instead of starting over)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from .. import specbench
from . import data, teacher
from .student import Student
from .train import TrainConfig, train


def prepare(target, target_name: str, stock, sources, per_source: int, held_out: float, max_new_tokens: int,
            max_prompt_tokens: int, top_k: int, seed: int = 0) -> dict:
    """Prompts (decontaminated, split), the target's answers and the teacher items."""
    if target.vocab != stock.vocab:
        raise ValueError(f"the draft's vocabulary ({stock.vocab}) differs from the target's ({target.vocab}): "
                         f"choose a draft from the target's family")
    sel = data.select(sources, per_source, seed)
    train_p, held_p = data.split(sel["prompts"], held_out)
    out = {"selection": sel, "train_prompts": train_p, "held_prompts": held_p}
    for part, ps in (("train", train_p), ("held", held_p)):
        samples = data.answers(target, target_name, ps, max_new_tokens, max_prompt_tokens)
        out[f"{part}_samples"] = samples
        out[f"{part}_items"] = teacher.items(samples, target, stock, top_k)
    return out


def specbench_samples(target, target_name: str, per_group: int, max_new_tokens: int) -> list:
    """The target's greedy answers to the Spec-Bench development prompts (evaluation only)."""
    ps = [data.Prompt(f"specbench-{p['id']}", p["group"], p["turns"][0]) for p in specbench.prompts(per_group=per_group)]
    return data.answers(target, target_name, ps, max_new_tokens, max_prompt_tokens=4096)


def run_dir(target, draft_name: str, cfg: TrainConfig, items) -> Path:
    from ..models.export import content_id
    key = json.dumps([content_id(target.file), draft_name, asdict(cfg), [(it.id, len(it)) for it in items]])
    return data.distill_dir() / "runs" / hashlib.sha256(key.encode()).hexdigest()[:16]


def distill(target, draft_name: str, train_items, held_items, cfg: TrainConfig, scheme: str, progress: bool = True):
    """Trains (or resumes) a student of the stock draft and exports it under `scheme`.
    -> (the Run, the path of the distilled draft's engine file)."""
    from ..models.export import export, up_to_date
    from ..models.load import load
    m = load(draft_name)
    student = Student(m.config, m.weights, cfg.method, cfg.rank, seed=cfg.seed, qat=cfg.qat)
    d = run_dir(target, draft_name, cfg, train_items)
    d.mkdir(parents=True, exist_ok=True)
    run = train(student, train_items, held_items, cfg, d / "checkpoint.pt", progress=progress)
    out = d / f"{scheme}.lab"
    if not up_to_date(out):
        export(m.config, student.merged_weights(), out, scheme, {"source": draft_name, "distilled": asdict(cfg)})
    return run, out
