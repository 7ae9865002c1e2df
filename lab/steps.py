"""An engine's passes timed: decode steps against the read ceiling (`lab bench decode`), and
draft steps, target steps and verifications under each thread configuration, with and
without one slow core."""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from . import kernels, native, slowcore
from .machine import machine
from .protocol import (fill, flat, forward_samples, interleave, paired_ratio, read_buffer, read_sampler, round_trip_ns,
                       summary)


def decode_bench(engine, context: int = 256, rounds: int = 7, reps: int = 5, stages: bool = False,
                 k: int = 1) -> dict:
    """One-token decode steps at a fixed context (the output layer included), paired round by
    round with read passes: tokens/s, bytes read per token, share of the read ceiling.
    stages=True also times each stage of the pass (`stage_records`); k > 1 times k-token
    passes (a verification's) instead of one-token steps. The threads' round trip before and
    after says where the machine put them."""
    tok = fill(engine, context)[-k:].copy()
    buf, _owner = read_buffer(512 << 20)
    reader = read_sampler(buf, engine.pool)
    reader()
    per_round = []                          # stage seconds per pass, one dict a round

    def step():
        engine.profile(stages)
        secs = forward_samples(engine, tok, context, reps)
        if stages:
            per_round.append({name: s / (reps + 1) for name, s in engine.stage_seconds().items()})   # + the warm-up pass
            engine.profile(False)
        return [engine.weight_bytes / s / 1e9 for s in secs]
    trip_before = round_trip_ns(engine.pool)
    samples = interleave({"step": step, "read": reader}, rounds)
    out = {"machine": machine(), "file": str(engine.file), "threads": engine.pool.threads, "context": context,
           "k": k, **_decode_rates(samples, engine.weight_bytes, k),
           "round_trip_ns": {"before": trip_before, "after": round_trip_ns(engine.pool)}}
    if stages:
        reads, nbytes = [np.median(r) for r in samples["read"]], engine.stage_bytes()
        out["stages"] = stage_records(per_round, nbytes, reads)
        out["matrices"] = matrices_record(per_round, nbytes, reads)
    return out


def _decode_rates(samples: dict, nbytes: int, k: int = 1) -> dict:
    """Tokens/s and GB/s of the passes (k tokens each), and their share of the read passes
    beside them."""
    share = paired_ratio(samples["step"], samples["read"])
    gbps = summary(flat(samples["step"]))["median"]
    passes = gbps * 1e9 / nbytes
    return {"tokens_per_s": k * passes, "ms_per_token": 1e3 / (k * passes), "ms_per_pass": 1e3 / passes,
            "bytes_per_token": nbytes / k, "bytes_per_pass": nbytes,
            "read_gbps": float(np.median(flat(samples["read"]))), "gbps": gbps,
            "share_of_ceiling": share["median"], "share_of_ceiling_iqr": share["iqr"]}


def stage_records(per_round: list[dict], nbytes: dict, read_gbps: list[float]) -> list[dict]:
    """Per stage: median ms per pass, its part of the pass, and for the stages that stream
    weights their GB/s and share of the read ceiling, each paired with its round's read passes."""
    out = []
    for name in per_round[0]:
        secs = [r[name] for r in per_round]
        parts = [r[name] / sum(r.values()) for r in per_round]
        rec = {"stage": name, "ms": float(np.median(secs)) * 1e3, "part": float(np.median(parts)),
               "bytes": nbytes[name]}
        if nbytes[name]:
            rec["gbps"] = float(np.median([nbytes[name] / s / 1e9 for s in secs]))
            rec["share_of_ceiling"] = float(np.median([nbytes[name] / s / 1e9 / g for s, g in zip(secs, read_gbps)]))
        out.append(rec)
    return out


def matrices_record(per_round: list[dict], nbytes: dict, read_gbps: list[float]) -> dict:
    """The pass in two parts: its matrices alone, their bytes over their stages' time (what the
    pass would read were the work between them free), and that work's ms and part of the pass."""
    streaming = [name for name in per_round[0] if nbytes[name]]
    total = sum(nbytes[name] for name in streaming)
    mats = [sum(r[name] for name in streaming) for r in per_round]
    between = [sum(r.values()) - m for r, m in zip(per_round, mats)]
    return {"share_of_ceiling": float(np.median([total / m / 1e9 / g for m, g in zip(mats, read_gbps)])),
            "between_ms": float(np.median(between)) * 1e3,
            "between_part": float(np.median([b / (b + m) for b, m in zip(between, mats)]))}


SPLITS = {"static": 0, "dynamic": 8, "guided": "guided", "redo": "redo"}   # names -> Engine.set_chunk


def threads_bench(target, draft, context: int = 256, gamma: int = 4, rounds: int = 5, reps: int = 3,
                  max_threads: int | None = None, duties=(0.0,), factors=()) -> list[dict]:
    """A draft step, a target step and a verification pass (gamma + 1 tokens), each timed under
    every configuration: thread count, pinned or not, and the split of tiles — static halves,
    fixed 8-tile hand-outs ("dynamic"), shrinking shares ("guided") or shares sized to speed
    in pieces thread 0 computes again rather than wait for an absent worker ("redo"; the
    engine's default picks one of the last two, `lab tune`) —
    and under each condition of `slowcore.conditions`: a hybrid CPU's real performance and
    efficiency cores, elsewhere the last CPU shared with a co-runner busy each of `duties`, then
    its worker slowed by each of `factors` (emulated efficiency cores; each row has the
    slow-down measured for its condition).
    Each row also has `ideal_ms`: the phase's total work over the cores' total speed, each
    core's speed timed as one pinned thread alone on it under the same condition.
    The engines get their own pools and their default split back afterwards."""
    allowed = sorted(os.sched_getaffinity(0))
    n = len(allowed) if max_threads is None else max_threads
    configs = [(t, pin, split) for t in range(1, n + 1) for pin in ((True, False) if t > 1 else (True,))
               for split in (SPLITS if t > 1 else ("static",))]
    ids = fill(target, context, draft)      # timed passes write past `context` only: one fill serves all
    rows = []
    for cond in slowcore.conditions(native.cpu()["core_types"], allowed, duties, factors):
        slowdown = _slowdown(target, cond, ids, context, reps)
        pools = {(t, pin): _pool(cond, t, cond["cpus"][:t] if cond["cpus"] else None, pin) for t, pin, _ in configs}
        alone = {("alone", c): (_pool(cond, 1, [c]), "static") for c in pools[n, True].cpus}
        with slowcore.SlowCore(cond["slow_cpu"], cond["duty"]):
            timed = _phases(target, draft, ids, context, gamma, rounds, reps,
                            {**{(t, pin, split): (pools[t, pin], split) for t, pin, split in configs}, **alone})
        ideal = _ideal_ms({key: timed.pop(key) for key in list(timed) if key[0] == "alone"})
        rows += [{"phase": phase, "threads": t, "pinned": pin, "split": split, **ms,
                  "condition": cond["label"], "slowdown": slowdown, "ideal_ms": ideal[phase],
                  "config": f"{t} thr, {'pinned' if pin else 'unpinned'}, {split}"}
                 for (t, pin, split, phase), ms in timed.items()]
    return rows


def _ideal_ms(alone: dict) -> dict:
    """Per phase, its time if the work were shared in proportion to each core's speed with
    nothing lost to sharing it: 1 / sum over the cores of 1 / (its time alone).
    alone: {("alone", cpu, phase): {"ms": ...}}"""
    speed = {}
    for (_, _, phase), ms in alone.items():
        speed[phase] = speed.get(phase, 0.0) + 1.0 / ms["ms"]
    return {phase: 1.0 / s for phase, s in speed.items()}


def _pool(cond: dict, threads: int, cpus: list[int] | None = None, pin: bool = True) -> kernels.Pool:
    """A pool for the condition: its worker for the slow CPU slowed where the condition says."""
    pool = kernels.Pool(threads, cpus=cpus, pin=pin)
    if cond["factor"] > 1 and cond["slow_cpu"] in pool.cpus:
        pool.slow(cond["slow_cpu"], cond["factor"])
    return pool


def _slowdown(engine, cond: dict, ids, context: int, reps: int, rounds: int = 5) -> float:
    """How much slower a one-thread target step runs on the condition's slow CPU: beside its
    co-runner than alone, slowed than not, or on the efficiency core than on the performance core."""
    def step_on(cpu, factor=1.0):
        with _configured((engine,), kernels.Pool(1, cpus=[cpu]).slow(cpu, factor), "static"):
            return float(np.median(forward_samples(engine, one, context, reps)))
    one = ids[-1:].copy()
    if cond["duty"]:
        return slowcore.factor(cond["slow_cpu"], cond["duty"], lambda: step_on(cond["slow_cpu"]), rounds)
    if cond["factor"] > 1:
        cpu = cond["slow_cpu"]
        return float(np.median([step_on(cpu, cond["factor"]) / step_on(cpu) for _ in range(rounds)]))
    if cond["cpus"]:
        return float(np.median([step_on(cond["slow_cpu"]) / step_on(cond["cpus"][0]) for _ in range(rounds)]))
    return 1.0


def holds_up(rows: list[dict]) -> list[dict]:
    """Per phase and split, over the pinned configurations with every thread: its time over the
    best split's under each condition, and the worst of those; the split with the smallest
    worst is the one that holds up when a core is slow. `worst_vs_ideal`: the split's largest
    time over the ideal (`ideal_ms`) under any condition."""
    n = max(r["threads"] for r in rows)
    mine = [r for r in rows if r["threads"] == n and r["pinned"]]
    out = []
    for phase in dict.fromkeys(r["phase"] for r in mine):
        best = {c: min(r["ms"] for r in mine if r["phase"] == phase and r["condition"] == c)
                for c in dict.fromkeys(r["condition"] for r in mine)}
        for split in dict.fromkeys(r["split"] for r in mine):
            own = [r for r in mine if r["phase"] == phase and r["split"] == split]
            ratios = {r["condition"]: r["ms"] / best[r["condition"]] for r in own}
            out.append({"phase": phase, "split": split, **ratios, "worst": max(ratios.values()),
                        "worst_vs_ideal": max(r["ms"] / r["ideal_ms"] for r in own)})
    for phase in dict.fromkeys(r["phase"] for r in out):
        pick = min((r for r in out if r["phase"] == phase), key=lambda r: r["worst"])
        pick["holds_up"] = True
    return out


@contextmanager
def _configured(engines, pool: kernels.Pool, split: str):
    """The engines on `pool` with `split`, for the block's length."""
    saved = [e.pool for e in engines]
    for e in engines:
        e.pool = pool
        e.set_chunk(SPLITS[split])
    try:
        yield
    finally:
        for e, p in zip(engines, saved):
            e.pool = p
            e.set_chunk("auto")


def _phases(target, draft, ids, context: int, gamma: int, rounds: int, reps: int, setups: dict) -> dict[tuple, dict]:
    """Median and IQR ms of a draft step, a target step and a verification at `context` (both
    caches holding `ids`) under each setup (name -> (pool, split)), every setup and phase
    interleaved round by round, so the splits compared see the same state of the machine.
    -> {(*name, phase): ms}"""
    one = ids[-1:].copy()
    batch = np.resize(ids, gamma + 1).astype(np.int32)
    passes = {"draft step": (draft, one), "target step": (target, one),
              f"verification (k={gamma + 1})": (target, batch)}

    def timed(pool, split, engine, tokens):
        def run():
            with _configured((engine,), pool, split):
                return forward_samples(engine, tokens, context, reps)
        return run
    cands = {(*name, phase): timed(pool, split, e, toks)
             for name, (pool, split) in setups.items() for phase, (e, toks) in passes.items()}
    stats = {key: summary(flat(secs)) for key, secs in interleave(cands, rounds).items()}
    return {key: {"ms": st["median"] * 1e3, "ms_iqr": st["iqr"] * 1e3} for key, st in stats.items()}
