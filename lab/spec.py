"""The cost model of speculative decoding (docs/science.md §1) and what it needs from a run.

    speedup(γ) = τ(γ) / (γ·c + v(γ+1) + o),     τ(γ) = (1 − α^(γ+1)) / (1 − α)
"""
from __future__ import annotations

import numpy as np

from . import native


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


def round_cost(gamma: int, c: float, v: dict[int, float], o: float) -> float:
    """One round's time in target steps: γ draft steps, the verification pass, the overhead."""
    return gamma * c + v[gamma + 1] + o


def speedup(alpha: float, gamma: int, c: float, v: dict[int, float], o: float) -> float:
    return tau(alpha, gamma) / round_cost(gamma, c, v, o)


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


def geomean(xs) -> float:
    """The mean of ratios (speedups): geometric, so 0.5x and 2x average to 1x."""
    xs = [x for x in xs if x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def best_measured_gamma(rows: list[dict], key: str) -> int:
    """The γ whose rows have the highest geometric-mean `key` (a measured speedup)."""
    by_g: dict[int, list[float]] = {}
    for r in rows:
        by_g.setdefault(r["gamma"], []).append(r[key])
    return max(by_g, key=lambda g: geomean(by_g[g]))


def best_gammas(table: list[dict], gammas) -> list[dict]:
    """Per group (and overall) and drafter: the γ with the highest measured speedup, with the
    prediction at that γ (geometric means). table: rows of lab.prediction.table."""
    out = []
    groups = list(dict.fromkeys(r["group"] for r in table)) + ["overall"]
    for grp in groups:
        for dr in dict.fromkeys(r["drafter"] for r in table):
            mine = [r for r in table if r["drafter"] == dr and grp in ("overall", r["group"]) and r["gamma"] in gammas]
            g = best_measured_gamma(mine, "measured")
            at = [r for r in mine if r["gamma"] == g]
            out.append({"group": grp, "drafter": dr, "best γ": g, "measured": geomean(r["measured"] for r in at),
                        "predicted": geomean(r["predicted"] for r in at)})
    return out


# ----------------------------------------------------------------------------
# The offline round simulator (docs/science.md §5): rounds replayed from teacher-forced
# distributions along the target's own text, no engine in the loop.
# ----------------------------------------------------------------------------

def simulate_rounds(accept, gamma: int, rng=None) -> list[int]:
    """Accepted guesses per round while producing len(accept) tokens, as the engine's
    round loop does (up to γ guesses, the first rejection or the bonus token ends a round,
    the last token ends the run mid-round).

    accept[j] is whether (greedy: 0 or 1, the draft's top-1 equals the target's token j)
    or with what probability (sampling: min(1, q(x_j)/p(x_j)) for the target-sampled x_j)
    the draft's guess for token j is accepted; probabilities need a numpy Generator."""
    accept = np.asarray(accept, dtype=float)
    top = native.consts().max_k
    if not 1 <= gamma <= top:
        raise ValueError(f"gamma={gamma}: one round verifies 1 to {top} guesses")
    if rng is not None:
        accept = (rng.random(accept.size) < accept).astype(float)
    elif ((accept != 0) & (accept != 1)).any():
        raise ValueError("acceptance probabilities need rng= (a numpy Generator) to draw from")
    n, j, rounds = accept.size, 0, []
    while j < n:
        a = 0
        while a < gamma and j + a < n and accept[j + a]:
            a += 1
        rounds.append(a)
        j += a + 1
    return rounds


def simulated_tau(accept, gamma: int, draws: int = 0, seed: int = 0) -> float:
    """Tokens per round over the text: exact for 0/1 acceptance; the mean over `draws`
    seeded replays for probabilities."""
    n = len(accept)
    if not draws:
        return n / len(simulate_rounds(accept, gamma))
    rng = np.random.default_rng(seed)
    return float(np.mean([n / len(simulate_rounds(accept, gamma, rng)) for _ in range(draws)]))


def _softmax(x, temperature: float = 1.0):
    z = x / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def acceptance(target_logits, draft_logits, tokens=None, temperature: float = 1.0, chunk: int = 64) -> dict:
    """Per-position acceptance from teacher-forced logits [T, vocab] of the target and the
    draft along the same text: `match` (top-1 equal: α greedy), `beta` (1 − TVD at the
    temperature: the expected α when sampling) and, given the tokens the target sampled,
    `accept` = min(1, q(x)/p(x)) for the sampling simulator. Rows in chunks: [T, vocab]
    probabilities never exist at once."""
    t_all, d_all = np.asarray(target_logits), np.asarray(draft_logits)
    if t_all.shape != d_all.shape:
        raise ValueError(f"target logits {t_all.shape} and draft logits {d_all.shape} differ in shape")
    out = {"match": [], "beta": [], "accept": []}
    for s in range(0, t_all.shape[0], chunk):
        t, d = t_all[s:s + chunk].astype(np.float64), d_all[s:s + chunk].astype(np.float64)
        out["match"].append(t.argmax(-1) == d.argmax(-1))
        p, q = _softmax(t, temperature), _softmax(d, temperature)
        out["beta"].append(np.minimum(p, q).sum(-1))
        if tokens is not None:
            x = np.asarray(tokens[s:s + chunk])
            rows = np.arange(x.size)
            out["accept"].append(np.minimum(1.0, q[rows, x] / p[rows, x]))
    res = {k: np.concatenate(v) for k, v in out.items() if v}
    res["match"] = res["match"].astype(float)
    return res
