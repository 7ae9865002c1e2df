"""Stock against distilled drafts, as the engine runs them: agreement with the target along
its own answers (α greedy, α sampled, α on the stock draft's misses, simulated τ(γ)), and
the speedup each draft buys in the engine."""
from __future__ import annotations

import sys

import numpy as np
from tqdm.auto import tqdm

from .. import spec
from .teacher import teacher_forced


def agreement(target, drafts: dict, samples, gammas=tuple(range(1, 9)), temperature: float = 1.0) -> list[dict]:
    """One row per sample and draft. The first draft is the stock one: its misses (top-1
    unlike the target's token) are the positions `miss_matches` counts for every draft."""
    rows = []
    for s in tqdm(samples, desc="agreement", unit="seq", file=sys.stderr):
        tl = teacher_forced(target, s.prompt, s.answer)
        misses = None
        for name, d in drafts.items():
            acc = spec.acceptance(tl, teacher_forced(d, s.prompt, s.answer), temperature=temperature)
            m = acc["match"].astype(bool)
            if misses is None:
                misses = ~m
            rows.append({"id": s.id, "group": s.source, "draft": name, "positions": int(m.size), "match": m.astype(int).tolist(),
                         "matches": int(m.sum()), "beta": float(acc["beta"].sum()),
                         "stock_misses": int(misses.sum()), "miss_matches": int((m & misses).sum()),
                         **{f"rounds_{g}": len(spec.simulate_rounds(m, g)) for g in gammas}})
    return rows


def summarize(rows: list[dict], gammas=tuple(range(1, 9)), by: str = "group") -> list[dict]:
    """Per group (and overall) and draft: α greedy, α sampled (mean 1 − TVD), α on the
    stock draft's misses, and simulated tokens per round τ(γ)."""
    out = []
    for grp in list(dict.fromkeys(r[by] for r in rows)) + ["overall"]:
        for d in dict.fromkeys(r["draft"] for r in rows):
            mine = [r for r in rows if r["draft"] == d and grp in ("overall", r[by])]
            n = sum(r["positions"] for r in mine)
            out.append({by: grp, "draft": d, "positions": n,
                        "alpha_greedy": sum(r["matches"] for r in mine) / n,
                        "alpha_sampled": sum(r["beta"] for r in mine) / n,
                        "alpha_on_stock_misses": sum(r["miss_matches"] for r in mine) / max(1, sum(r["stock_misses"] for r in mine)),
                        **{f"tau_{g}": n / sum(r[f"rounds_{g}"] for r in mine) for g in gammas}})
    return out


def speedups(target, drafts: dict, prompts, gammas=(1, 2, 3, 4), max_new_tokens: int = 64) -> list[dict]:
    """Greedy speculative against plain decoding per prompt, each draft at each γ between two
    plain runs adjacent to it (lab.speculative.bracket) so drift hits them alike; every output is
    checked equal to plain. prompts: (group, ids)."""
    from ..speculative import SpeculationMismatch, bracket
    rows = []
    settings = [(g, name, d) for g in gammas for name, d in drafts.items()]
    for group, ids in tqdm(prompts, desc="speedups", unit="prompt", file=sys.stderr):
        runs = [lambda g=g, d=d: target.speculate(ids, d, gamma=g, max_new_tokens=max_new_tokens) for g, _, d in settings]
        for (g, name, _), ((a, b), r, _) in zip(settings, bracket(lambda: target.generate(ids, max_new_tokens), runs)):
            plain_tps = (a.tokens_per_s + b.tokens_per_s) / 2
            if r.tokens != a.tokens:
                raise SpeculationMismatch(f"speculative output differs from plain ({group}, {name}, gamma {g})")
            rows.append({"group": group, "draft": name, "gamma": g, "speedup": r.tokens_per_s / plain_tps,
                         "tokens_per_round": r.tokens_per_round, "acceptance": r.acceptance,
                         "accepted": [acc for _, acc in r.per_round]})
    return rows


def simulator_check(agreement_rows: list[dict], speedup_rows: list[dict]) -> dict:
    """The greedy simulator against the engine on the same prompts: rounds whose accepted
    counts the simulation reproduces exactly, out of all (rows paired in order; the engine's
    runs must have produced the same answers, i.e. the same max_new_tokens)."""
    sims = {}
    for r in agreement_rows:
        sims.setdefault(r["draft"], []).append(r["match"])
    same = total = 0
    for d, matches in sims.items():
        runs = [r for r in speedup_rows if r["draft"] == d]
        per_prompt = len(runs) // max(1, len(matches))
        for i, m in enumerate(matches):
            for r in runs[i * per_prompt:(i + 1) * per_prompt]:
                sim = spec.simulate_rounds(m, r["gamma"])
                same += sum(a == b for a, b in zip(sim, r["accepted"])) if len(sim) == len(r["accepted"]) else 0
                total += len(r["accepted"])
    return {"rounds": total, "equal": same}


def best_speedups(rows: list[dict]) -> list[dict]:
    """Per draft: the γ with the highest geometric-mean speedup over all prompts."""
    out = []
    for d in dict.fromkeys(r["draft"] for r in rows):
        g = spec.best_measured_gamma([r for r in rows if r["draft"] == d], "speedup")
        at = [r for r in rows if r["draft"] == d and r["gamma"] == g]
        out.append({"draft": d, "best γ": g, "speedup": spec.geomean(r["speedup"] for r in at),
                    "tokens_per_round": float(np.mean([r["tokens_per_round"] for r in at])),
                    "acceptance": float(np.mean([r["acceptance"] for r in at]))})
    return out
