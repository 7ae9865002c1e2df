"""Greedy speculative against plain decoding on the same prompts, run back to back, every
speculative output checked against plain: speedups per drafter and γ, and over γ against
the cost model's prediction (the γ notebook)."""
from __future__ import annotations

from . import prediction
from .costs import vk_bench
from .machine import machine
from .speculative import SpeculationMismatch


def checked_runs(target, drafters: dict, prompts: list[tuple[str, list[int]]], gammas, max_new_tokens: int):
    """Per prompt (label, ids): its plain run, then each drafter's (name -> draft Engine or
    "lookup") speculative run at each γ -> (label, name, γ, plain, speculative) each; raises
    when a speculative output differs from plain."""
    for label, ids in prompts:
        plain = target.generate(ids, max_new_tokens)
        for name, d in drafters.items():
            for g in gammas:
                r = target.speculate(ids, d, gamma=g, max_new_tokens=max_new_tokens)
                if r.tokens != plain.tokens:
                    raise SpeculationMismatch(f"speculative output differs from plain on {label} ({name}, gamma {g})")
                yield label, name, g, plain, r


def speculative_bench(target, drafters: dict, prompt_ids: list[tuple[str, list[int]]], gammas=(4,),
                      max_new_tokens: int = 128) -> dict:
    """Generation tokens/s (prompt pass apart), speedup, acceptance and tokens per round of
    each drafter (name -> draft Engine or "lookup") at each γ, per prompt."""
    rows = [{"prompt": label, "drafter": name, "gamma": g, "new_tokens": len(r.tokens),
             "plain_tokens_per_s": plain.tokens_per_s, "tokens_per_s": r.tokens_per_s,
             "speedup": r.tokens_per_s / plain.tokens_per_s, "acceptance": r.acceptance,
             "tokens_per_round": r.tokens_per_round, "prompt_tokens": r.prompt_tokens,
             "prompt_tokens_per_s": r.prompt_tokens_per_s, "wall_speedup": plain.t_total / r.t_total}
            for label, name, g, plain, r in checked_runs(target, drafters, prompt_ids, gammas, max_new_tokens)]
    return {"machine": machine(), "threads": target.pool.threads, "max_new_tokens": max_new_tokens, "rows": rows}


def gamma_bench(target, draft, prompts: list[tuple[str, list[int]]], gammas=(1, 2, 3, 4), max_new_tokens: int = 64,
                context: int = 256, rounds: int = 3) -> dict:
    """Measured against predicted speedup over γ, per prompt group, for the draft model and
    prompt lookup. prompts: (group, token ids). Costs (c, v, o) come from vk_bench at
    `context`, so both engines need room for context + max(gammas) + 1 tokens."""
    costs = vk_bench(target, {"draft": draft}, (context,), tuple(range(1, max(gammas) + 2)), rounds=rounds)
    v = {r["k"]: r["v"] for r in costs["records"] if r["kind"] == "v"}
    c = next(r["c"] for r in costs["records"] if r["kind"] == "c")
    runs = [{"group": group, "drafter": name, "gamma": g, "measured": r.tokens_per_s / plain.tokens_per_s,
             "tokens_per_round": r.tokens_per_round, "accepted_per_round": r.accepted / r.rounds,
             "drafted_per_round": r.drafted / r.rounds, "draft_ms_per_round": r.t_draft / r.rounds * 1e3,
             "prompt_tokens_per_s": plain.prompt_tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s}
            for group, name, g, plain, r in checked_runs(target, {"draft": draft, "lookup": "lookup"}, prompts,
                                                         gammas, max_new_tokens)]
    step_ms = next(r["ms"] for r in costs["records"] if r["kind"] == "v" and r["k"] == 1)
    return {"machine": machine(), "context": context, "v": v, "c": c, "o": costs["o"], "runs": runs,
            "table": prediction.table(runs, gammas, v, c, costs["o"], step_ms)}
