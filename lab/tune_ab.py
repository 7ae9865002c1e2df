"""The tuned kernels against their defaults on whole passes (`lab tune --ab`).

`lab tune` keeps a value only if it wins on its own matrices; this checks the promise that
matters to a user, that the tuned engine is never slower than the defaults, on the figures the
engine is judged by: the one-token pass (decode) and the k-token passes v(k) is read from, at
each context. Both variants run in one process, alternating pass by pass in A B B A order, so a
change in the machine's speed falls on both alike (docs/science.md §7).
"""
from __future__ import annotations

import math

import numpy as np

from . import tune
from .protocol import fill, flat, forward_samples, paired_ratios, summary

SLOWER = 1.02       # a figure is slower when its median paired ratio reaches this ...
CHANCE = 0.05       # ... in more rounds than chance would give (one-sided sign test)


def slower(ratios: list[float]) -> bool:
    """Whether a figure's per-round time ratios tuned / default say slower: a median at SLOWER or
    above, in so many of the rounds that equal speeds would show it with probability under
    CHANCE (so a handful of rounds can never say it: two read 1.03-1.04 on the same code)."""
    n, up = len(ratios), sum(r > 1 for r in ratios)
    p = sum(math.comb(n, i) for i in range(up, n + 1)) / 2 ** n
    return float(np.median(ratios)) >= SLOWER and p < CHANCE


def undecided(ratios: list[float]) -> bool:
    """Whether a figure reads slower by its median but in too few of its rounds to say so
    (`slower`): more rounds would tell, where "not slower" would claim what was not shown."""
    return float(np.median(ratios)) >= SLOWER and not slower(ratios)


def _pair(engine, tokens: np.ndarray, pos: int, variants: dict[str, dict], rounds: int, reps: int, bar) -> dict:
    """Each variant's seconds per round (reps passes over tokens at pos), in A B B A order."""
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    order = list(variants)
    for r in range(rounds):
        for v in order if r % 2 == 0 else order[::-1]:
            tune.apply(variants[v])
            times[v].append(forward_samples(engine, tokens, pos, reps))
        bar.update()
    return times


def ab(engine, contexts, ks, tuned: dict, rounds: int = 10, reps: int = 3, progress: bool = True) -> dict:
    """Tuned values against the defaults on engine's passes of each k at each context: per figure,
    each variant's median ms and the per-round time ratios tuned / default, their median and IQR; v(k)
    under each variant; and which figures the tuned values make slower. A figure whose kernels the
    tuned values cannot change (`tune.moves`) is timed too, a gauge of the noise, but never
    judged slower; one slower by its median in too few rounds to tell is `undecided`. The values
    in force are left as they were."""
    from tqdm import tqdm
    variants = {"default": tune.defaults(), "tuned": tuned}
    before = tune.current()
    rows = []
    try:
        with tqdm(total=len(contexts) * len(ks) * rounds, desc="lab tune --ab", unit="round",
                  disable=not progress) as bar:
            for ctx in contexts:
                ids = fill(engine, ctx)
                for k in ks:
                    t = _pair(engine, np.resize(ids, k).astype(np.int32), ctx, variants, rounds, reps, bar)
                    ratios = paired_ratios(t["tuned"], t["default"])
                    ratio = summary(ratios)
                    moved = tune.moves(variants["default"], tuned, k)
                    rows.append({"context": ctx, "k": k, **{f"{v}_ms": float(np.median(flat(t[v]))) * 1e3 for v in t},
                                 "ratio": ratio["median"], "q1": ratio["q1"], "q3": ratio["q3"],
                                 "ratios": ratios, "same_code": not moved, "slower": moved and slower(ratios),
                                 "undecided": moved and undecided(ratios)})
    finally:
        tune.apply(before)
    one = {r["context"]: r for r in rows if r["k"] == 1}
    for r in rows:
        if r["context"] in one:
            r.update({f"v_{v}": r[f"{v}_ms"] / one[r["context"]][f"{v}_ms"] for v in variants})
    return {"changed": {f: [variants["default"][f], v] for f, v in tuned.items() if v != variants["default"][f]},
            "rounds": rounds, "reps": reps, "results": rows,
            "slower": [{"context": r["context"], "k": r["k"]} for r in rows if r["slower"]],
            "undecided": [{"context": r["context"], "k": r["k"]} for r in rows if r["undecided"]]}
