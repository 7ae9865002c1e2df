"""The cost model of speculative decoding (SCIENCE.md §1) and what it needs from a run.

    speedup(γ) = τ(γ) / (γ·c + v(γ+1) + o),     τ(γ) = (1 − α^(γ+1)) / (1 − α)
"""
from __future__ import annotations


def tau(alpha: float, gamma: int) -> float:
    """Expected tokens per round with γ guesses accepted independently with probability α."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def v_at(v: dict[int, float], k: float) -> float:
    """v at a fractional k (rounds that verify different numbers of tokens), linearly."""
    lo = int(k)
    if lo >= max(v):
        return v[max(v)]
    return v[lo] + (k - lo) * (v[lo + 1] - v[lo])


def speedup(alpha: float, gamma: int, c: float, v: dict[int, float], o: float) -> float:
    return tau(alpha, gamma) / (gamma * c + v[gamma + 1] + o)


def best_gamma(alpha: float, c: float, v: dict[int, float], o: float, gammas=range(1, 9)) -> tuple[int, float]:
    return max(((g, speedup(alpha, g, c, v, o)) for g in gammas if g + 1 in v), key=lambda x: x[1])


def alpha_from_accepted(mean_accepted: float, gamma: float) -> float:
    """Solves E[accepted guesses per round] = α(1 − α^γ)/(1 − α) for α (bisection)."""
    mean_accepted = min(max(mean_accepted, 0.0), gamma)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tau(mid, gamma) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_gammas(table: list[dict], gammas) -> list[dict]:
    """Per group (and overall) and drafter: the gamma with the highest mean measured speedup,
    with the prediction at that gamma. table: rows of lab.bench.gamma_bench."""
    out = []
    groups = list(dict.fromkeys(r["group"] for r in table)) + ["overall"]
    for grp in groups:
        for dr in dict.fromkeys(r["drafter"] for r in table):
            mine = [r for r in table if r["drafter"] == dr and grp in ("overall", r["group"])]
            mean = lambda key, g: sum(r[key] for r in mine if r["gamma"] == g) / max(1, sum(r["gamma"] == g for r in mine))
            g = max(gammas, key=lambda g: mean("measured", g))
            out.append({"group": grp, "drafter": dr, "best γ": g, "measured": mean("measured", g),
                        "predicted": mean("predicted", g)})
    return out
