"""The costs speculative decoding is predicted from (`lab bench vk`): v(k), c and o, each a
ratio to one target step measured in the same rounds."""
from __future__ import annotations

import numpy as np

from .machine import machine
from .protocol import fill, flat, forward_samples, interleave, paired_ratio, read_buffer, read_sampler, round_trip_ns

READ_MB = 256       # the read ceiling's buffer, at least (read_buffer raises it past the last-level cache)


def vk_bench(target, drafts: dict, contexts=None, ks=tuple(range(1, 17)), rounds: int = 5,
             reps: int = 3, progress: bool = False) -> dict:
    """v(k) = one target pass over k tokens / one single-token pass, k values interleaved, at
    each context; c = one draft step / one target step at the same context, for each of
    `drafts` (format -> Engine); o = a round's overhead (sampling, acceptance) / one target
    step, with the first draft (prompt lookup if none). contexts: the policy's by default.
    Each context's records carry the read ceiling sampled just before and after them
    (read_gbps_before, read_gbps_after) and the threads' round trip before them (round_trip_ns):
    the bus can change state between contexts, and v(k) differs between states."""
    from .policy import CONTEXTS
    it = contexts = CONTEXTS if contexts is None else contexts
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(contexts, desc="v(k)", unit="context")
    buf, _owner = read_buffer(READ_MB << 20)
    read = read_sampler(buf, target.pool)

    def at(ctx: int) -> list[dict]:
        before, trip = float(np.median(read())), round_trip_ns(target.pool)
        recs = records_at(target, drafts, ctx, ks, rounds, reps)
        after = float(np.median(read()))
        return [{**r, "read_gbps_before": before, "read_gbps_after": after, "round_trip_ns": trip} for r in recs]
    records = [r for ctx in it for r in at(ctx)]
    o = overhead(target, next(iter(drafts.values()), None))
    return {"machine": machine(), "threads": target.pool.threads, "records": records, "o": o["o_greedy"],
            "overhead": o}


def records_at(target, drafts: dict, ctx: int, ks, rounds: int, reps: int) -> list[dict]:
    """v(k) for each k and c for each draft (name -> Engine) at one context, every pass
    interleaved with the rest, each a ratio to the one-token pass of its round."""
    fill(target, ctx, *drafts.values())
    batch = {k: np.random.default_rng(k).integers(0, target.vocab, k).astype(np.int32) for k in ks}
    cands = {f"k{k}": (lambda k=k: forward_samples(target, batch[k], ctx, reps)) for k in ks}
    cands.update({f"draft-{s}": (lambda d=d: forward_samples(d, batch[1], ctx, reps)) for s, d in drafts.items()})
    samples = interleave(cands, rounds)

    def to_one(name: str) -> tuple[float, float, float]:
        st = paired_ratio(samples[name], samples["k1"])
        return st["median"], st["iqr"], float(np.median(flat(samples[name]))) * 1e3
    records = []
    for k in ks:
        v, iqr, ms = to_one(f"k{k}")
        records.append({"kind": "v", "context": ctx, "k": k, "v": v, "v_iqr": iqr, "ms": ms})
    for s in drafts:
        c, iqr, ms = to_one(f"draft-{s}")
        records.append({"kind": "c", "format": s, "context": ctx, "c": c, "c_iqr": iqr, "ms": ms})
    return records


def overhead(target, draft=None, gamma: int = 4, tokens: int = 64) -> dict:
    """o: the time a round spends outside the model passes (picking tokens, the acceptance
    rule), per round, over one target step — greedy and sampled (temperature 1)."""
    prompt = list(np.random.default_rng(1).integers(0, target.vocab, 32))
    step = float(np.median(forward_samples(target, np.array(prompt[-1:], np.int32), 32, 5)))
    out = {"target_step_ms": step * 1e3}
    for label, temp in (("greedy", 0.0), ("sampled", 1.0)):
        d = draft if draft is not None else "lookup"
        r = target.speculate(prompt, d, gamma=gamma, max_new_tokens=tokens, temperature=temp, seed=1)
        out[f"o_{label}"] = r.t_sample / r.rounds / step
    return out
