"""The speculative benchmark (`lab bench speculative`): plain against speculative decoding,
prompt by prompt, paired in time.

Each prompt's turn runs plain, then each speculative setting followed by plain again (plain,
setting 1, plain, setting 2, ..., plain): a setting's speedup is its tokens/s over the mean of
the two plain runs adjacent to it, so a bandwidth flip elsewhere in the turn cannot fake a
speedup; when those two disagree by more than protocol.UNSTEADY the setting's bracket runs again (once)
and the row says so; a bracket whose runs generate for under SHORT seconds in all (prefill
not counted) runs REPEATS times and each rate is its median repeat. Multi-turn prompts run
every turn, the later ones seeing the model's own earlier answers, as Spec-Bench does. Every
greedy speculative output must equal plain: a difference raises. The cost model's prediction
for each run comes from the rounds it actually made, priced by costs measured in the
bandwidth state its bracket ran in (CostStates), and the automatic policy plans each run with
those same costs.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import native, specbench
from .policy import STATE_GAP
from .protocol import steady
from .spec import geomean
from .errors import LabError

SHORT, REPEATS = 10.0, 3
MAX_TABLES = 4         # what a run measures at most, should plain runs never match a table


class SpeculationMismatch(LabError):
    """A greedy speculative output differed from plain greedy decoding."""


@dataclass(frozen=True)
class Setting:
    drafter: str                 # "draft" or "lookup" (fixed), or "auto"
    gamma: int | None = None     # fixed settings
    draft: str = "draft"         # which of run()'s drafts (and, for "auto", policies)

    @property
    def label(self) -> str:
        name = "" if self.draft == "draft" or self.drafter == "lookup" else f" ({self.draft})"
        return ("auto" if self.drafter == "auto" else f"{self.drafter} γ={self.gamma}") + name


def settings(draft: str | None, policy: str, gammas) -> list[Setting]:
    """The settings `lab bench speculative` runs: draft may be "lookup"."""
    drafter = "lookup" if draft in (None, "lookup") else "draft"
    if policy == "auto":
        return [Setting("auto")]
    if policy != "fixed":
        raise LabError(f"--policy must be fixed or auto, not {policy!r}")
    return [Setting(drafter, g) for g in gammas]


def predicted(result, costs) -> float:
    """The cost model's speedup for the rounds a run made: tokens over the sum of each
    round's cost -- the verification of γ + 1 tokens, the overhead, and in a draft round γ
    draft steps, the first of which catches up on the tokens the draft has not seen (after
    lookup rounds, several: c · v(n), v's shape standing in for the draft's) -- at the
    run's middle context."""
    if costs is None or not result.rounds:
        return float("nan")
    v, c = costs.at(result.prompt_tokens + len(result.tokens) // 2)
    top = max(v)
    spent, lag = 0.0, 1                       # lag: tokens the draft's cache lacks
    for (g, acc), kind in zip(result.per_round, result.kinds):
        spent += v[min(g + 1, top)] + costs.o
        if kind == "draft":
            spent += c * (_pass(v, lag) + g - 1)
            lag = 2 if acc == g else 1
        else:
            lag += acc + 1
    return len(result.tokens) / spent


class CostStates:
    """Cost tables (name -> Costs) for the bandwidth states a run meets. A bracket's predictions
    take the table whose target step, at the turn's context and for the run's draft, is nearest
    its plain runs'; when none is within STATE_GAP and `measure` (() -> name -> Costs) is given,
    a table is measured there and then (MAX_TABLES in all). Tables made on the fast bus
    mispredict slow brackets by ~13% (docs/tuning.md)."""

    def __init__(self, costs: dict, measure=None):
        self.tables = [costs] if costs else []
        self.measure = measure

    def _step(self, i: int, context: int, name: str | None) -> float | None:
        """Plain decoding, ms a token, when table i's costs for draft `name` (its first, when it
        has none) were measured: the target step and a round's overhead. Each draft's costs take
        minutes, and the bus can flip between two drafts' of one table."""
        c = self.costs(i, name)
        return s * (1 + c.o) if (s := c.step_at(context)) else None

    def pick(self, plain_ms: float, context: int, name: str | None = None) -> int:
        """The index of the table for a bracket whose plain runs took plain_ms a token."""
        if not self.tables:
            return -1
        gap = lambda i: abs(plain_ms / s - 1) if (s := self._step(i, context, name)) else 0.0
        best = min(range(len(self.tables)), key=gap)
        if gap(best) > STATE_GAP and self.measure is not None and len(self.tables) < MAX_TABLES:
            self.tables.append(self.measure())
            best = min(range(len(self.tables)), key=gap)   # the bus may have flipped back meanwhile
        return best

    def costs(self, i: int, name: str):
        return (self.tables[i].get(name) or next(iter(self.tables[i].values()))) if i >= 0 else None

    def policy(self, pol, name: str, plain_ms: float | None, context: int):
        """The automatic policy `pol` (for draft `name`) planning with the costs of the state
        plain decoding last ran in: its γ and drafter choices weigh c and v(k), which differ
        between states as much as the predictions do."""
        if plain_ms is None or not self.tables:
            return pol
        i = self.pick(plain_ms, context, name)
        return dataclasses.replace(pol, costs=self.costs(i, name)) if name in self.tables[i] else pol


def _pass(v: dict, n: int) -> float:
    """v(n) for a pass of n tokens, past the measured k as well: a draft catching up after
    long lookup runs passes dozens of tokens, in chunks of at most MAX_K, each costing v's
    measured slope per token beyond the last k measured (capping at that k under-priced
    summarization's catch-ups by a third)."""
    top, chunk = max(v), native.consts().max_k
    slope = (v[top] - v[1]) / (top - 1) if top > 1 else 1.0
    one = lambda k: v[k] if k <= top else v[top] + (k - top) * slope
    return (n // chunk) * one(chunk) + (one(n % chunk) if n % chunk else 0.0)


class Conversation:
    """Token ids of a prompt's turns, each turn after the model's own earlier answers."""

    def __init__(self, model: str):
        from .models import TINY
        self.tiny = TINY.get(model)
        self.tok = None
        if self.tiny is None:
            from transformers import AutoTokenizer
            from .models.registry import resolve
            self.tok = AutoTokenizer.from_pretrained(str(resolve(model)))
        self.thinking = False if model.startswith("qwen3") else None

    def ids(self, turns: list[str], answers: list[list[int]]) -> list[int]:
        if self.tok is not None:
            return specbench.chat_ids(self.tok, turns, self.thinking, answers)
        out = []                                 # tiny models: bytes, answers as they came
        for i, t in enumerate(turns):
            out += [b % self.tiny.tokenizer_size for b in t.encode()]
            if i < len(answers):
                out += answers[i]
        return out


def _steady(plain, run, rate, before=None):
    """before (the plain run just made) or a new one, the run, a plain run -- the three anew,
    once, when the two plain runs' rates differ by more than UNSTEADY (a bandwidth flip)."""
    for tries in (1, 2):
        first = before if before is not None and tries == 1 else plain()
        mine = run()
        last = plain()
        if steady(rate(first), rate(last)):
            break
    return (first, last), mine, tries


def _middle(xs: list, key):
    return sorted(xs, key=key)[(len(xs) - 1) // 2]


def bracket(plain, runs, run_of=lambda r: r):
    """Each run between two plain runs adjacent to it in time -- plain, run 1, plain, run 2, ...,
    plain -- so a bandwidth flip a few runs away cannot move its speedup. A bracket whose timed
    generation (prompts not counted: a long prompt's prefill would hide a short answer) adds
    up to under SHORT seconds runs REPEATS times, and its rates are then the median repeat's,
    so one stall in a second-long run cannot decide a row. run_of: the Result-like part
    (tokens, tokens_per_s) of what the callables return. No runs: two plain runs.
    -> per run: ((before, after) plain runs, result, tries: brackets run)."""
    rate = lambda r: run_of(r).tokens_per_s
    out, last = [], None
    for run in runs or [lambda: None]:
        reps = []
        while not reps or len(reps) < REPEATS and _timed(reps[0], run_of) < SHORT:
            reps.append(_steady(plain, run, rate, last))
            last = reps[-1][0][1]
        pair = _middle([r[0] for r in reps], lambda ab: rate(ab[0]) + rate(ab[1]))
        mine = None if reps[0][1] is None else _middle([r[1] for r in reps], rate)
        out.append((pair, mine, sum(r[2] for r in reps)))
    return out


def _timed(rep, run_of) -> float:
    """Seconds a bracket spent generating."""
    (first, last), mine, _ = rep
    return sum(len(run_of(r).tokens) / run_of(r).tokens_per_s for r in (first, last, mine) if r is not None)


def run(target, drafts: dict, prompts: list[dict], setting_list: list[Setting], max_new_tokens: int = 128,
        temperature: float = 0.0, seed: int = 0, costs: dict | None = None, policies: dict | None = None,
        target_name: str = "", progress: bool = True, measure_costs=None) -> dict:
    """drafts: name -> Engine or None (lookup alone); costs and policies: the same names ->
    this machine's Costs (for the predictions; lookup settings take any, c unused) and
    automatic Policy (for "auto" settings; it plans with the table of the state the bracket's
    latest plain run found). measure_costs: () -> such a dict, measured now, for a bracket in a
    bandwidth state no table was measured in (CostStates).
    -> {"rows": per prompt turn and setting, "summary": per group and overall,
        "cost_tables": every table the predictions used, by the rows' "costs_table"}"""
    from tqdm.auto import tqdm
    conv = Conversation(target_name)
    states, policies = CostStates(costs or {}, measure_costs), policies or {}
    rows, last_plain = [], {}        # last_plain: ms a token of the latest plain run
    turns_total = sum(len(p["turns"]) for p in prompts)
    bar = tqdm(total=turns_total, desc="speculative bench", unit="turn", disable=not progress, file=sys.stderr)

    def plain_run(ids):
        r = target.generate(ids, max_new_tokens, temperature=temperature, seed=seed)
        last_plain["ms"] = 1e3 / r.tokens_per_s
        return r

    def spec(ids, s: Setting):
        d = "lookup" if s.drafter == "lookup" else drafts.get(s.draft)
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        if s.drafter == "auto":
            return lambda: target.speculate(ids, d, policy=states.policy(
                policies[s.draft], s.draft, last_plain.get("ms"), len(ids) + max_new_tokens // 2), **kw)
        return lambda: target.speculate(ids, d, gamma=s.gamma, **kw)

    for p in prompts:
        answers: list[list[int]] = []
        for turn in range(len(p["turns"])):
            ids = conv.ids(p["turns"][:turn + 1], answers)
            brackets = bracket(lambda: plain_run(ids), [spec(ids, s) for s in setting_list])
            for s, ((a, b), r, tries) in zip(setting_list, brackets):
                plain_tps = (a.tokens_per_s + b.tokens_per_s) / 2
                table = states.pick(1e3 / plain_tps, len(ids) + len(a.tokens) // 2, s.draft)
                equal = r.tokens == a.tokens
                if temperature == 0 and not equal:
                    raise SpeculationMismatch(
                        f"prompt {p['id']} turn {turn + 1} ({s.label}): speculative output differs from plain "
                        f"at token {next(i for i, (x, y) in enumerate(zip(r.tokens + [-1], a.tokens + [-2])) if x != y)}")
                rows.append({"id": p["id"], "group": p["group"], "turn": turn + 1, "setting": s.label,
                             "new_tokens": len(r.tokens), "speedup": r.tokens_per_s / plain_tps,
                             "predicted": predicted(r, states.costs(table, s.draft)), "costs_table": table,
                             "tokens_per_round": r.tokens_per_round,
                             "alpha": r.acceptance, "equal_to_plain": equal, "plain_tokens_per_s": plain_tps,
                             "plain_spread": a.tokens_per_s / b.tokens_per_s - 1, "tries": tries,
                             "rounds": {k: r.kinds.count(k) for k in ("draft", "lookup", "plain")},
                             # what a later cost model needs to predict this run again
                             "prompt_tokens": r.prompt_tokens, "per_round": r.per_round, "kinds": r.kinds})
            (first_plain, _), _, _ = brackets[0]
            answers.append(first_plain.tokens)
            bar.update()
    bar.close()
    return {"rows": rows, "summary": summarize(rows),
            "cost_tables": [{k: c.model_dump() for k, c in t.items()} for t in states.tables]}


def summarize(rows: list[dict]) -> list[dict]:
    """Per setting, per group and overall: geometric means of speedup and prediction."""
    out = []
    for s in dict.fromkeys(r["setting"] for r in rows):
        for g in list(dict.fromkeys(r["group"] for r in rows)) + ["overall"]:
            mine = [r for r in rows if r["setting"] == s and g in ("overall", r["group"])]
            out.append({"setting": s, "group": g, "n": len(mine), "speedup": geomean(r["speedup"] for r in mine),
                        "predicted": geomean(r["predicted"] for r in mine),
                        "alpha": float(np.nanmean([r["alpha"] for r in mine])),
                        "tokens_per_round": float(np.mean([r["tokens_per_round"] for r in mine])),
                        "all_equal": all(r["equal_to_plain"] for r in mine)})
    return out


def prompts_from(path: str | Path | None, per_group: int | None) -> list[dict]:
    """Spec-Bench-format prompts (question_id, category, turns): the shipped dev set by default."""
    return specbench.prompts(per_group=per_group, path=Path(path) if path else None)


def print_summary(res: dict) -> None:
    rows = res["summary"]
    print(f"{'setting':14s} {'group':15s} {'n':>3s} {'speedup':>8s} {'predicted':>9s} {'alpha':>6s} {'tok/round':>9s}")
    for r in rows:
        print(f"{r['setting']:14s} {r['group']:15s} {r['n']:3d} {r['speedup']:8.3f} {r['predicted']:9.3f} "
              f"{r['alpha']:6.3f} {r['tokens_per_round']:9.2f}")


def dump(res: dict) -> str:
    return json.dumps(res, indent=1, default=float)
