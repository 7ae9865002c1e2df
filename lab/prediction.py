"""Measured against predicted speedup: the cost model (lab.spec) applied to the speculative
runs of lab.speedups.gamma_bench, per prompt group, drafter and γ."""
from __future__ import annotations

import numpy as np

from . import spec


def table(runs: list[dict], gammas, v: dict[int, float], c: float, o: float, step_ms: float) -> list[dict]:
    """One row per group, drafter and γ: α and the guesses a round made, fitted from the runs,
    the prediction from them and (v, c, o), and the measured speedup (geometric mean)."""
    cells = {}
    for x in runs:
        cells.setdefault((x["group"], x["drafter"], x["gamma"]), []).append(x)
    groups = dict.fromkeys(x["group"] for x in runs)
    return [_row(cells[(grp, dr, g)], v, c if dr == "draft" else None, o, step_ms)
            for grp in groups for dr in ("draft", "lookup") for g in gammas]


def _row(mine: list[dict], v: dict[int, float], c: float | None, o: float, step_ms: float) -> dict:
    """One cell's row; c None: a lookup drafter, whose cost per guess is its measured drafting time."""
    mean = lambda key: float(np.mean([x[key] for x in mine]))
    # lookup proposes fewer than gamma guesses when the context runs out of matches:
    # model the rounds with the guesses actually made
    ge = mean("drafted_per_round")
    alpha = spec.alpha_from_accepted(mean("accepted_per_round"), ge) if ge else 0.0
    cost = c if c is not None else mean("draft_ms_per_round") / max(ge, 1e-9) / step_ms
    first = mine[0]
    return {"group": first["group"], "drafter": first["drafter"], "gamma": first["gamma"], "alpha": alpha, "c": cost,
            "guesses_per_round": ge,
            "predicted": spec.tau(alpha, ge) / (ge * cost + spec.v_at(v, ge + 1) + o),
            "measured": spec.geomean(x["measured"] for x in mine),
            "tokens_per_round": mean("tokens_per_round"), "prompt_tokens_per_s": mean("prompt_tokens_per_s"),
            "plain_tokens_per_s": mean("plain_tokens_per_s")}
