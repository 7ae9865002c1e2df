"""The benchmarks built on the measuring protocol (lab.protocol): bandwidth, the kernels,
decode steps, v(k), c and o, thread configurations and speculation over gamma."""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from . import kernels, native
from .machine import machine
from .protocol import (fill, flat, forward_samples, interleave, matmul_samples, paired_ratio, read_buffer,
                       read_sampler, summary)


# ----------------------------------------------------------------------------
# Bandwidth
# ----------------------------------------------------------------------------

def _thread_counts(threads) -> list[int]:
    n = len(os.sched_getaffinity(0))
    return sorted(set(threads)) if threads else list(range(1, n + 1))


def _time(fn, reps: int) -> list[float]:
    secs = np.zeros(reps)
    fn(secs)
    return list(secs)


def bandwidth(threads=None, mb: int = 512, rounds: int = 5, reps: int = 4) -> dict:
    """Read-only, copy and triad bandwidth (GB/s) against thread count; the read ceiling."""
    ns = native.lib()
    nbytes = mb << 20
    buf, _owner = read_buffer(nbytes)
    n = nbytes // 4 // 3                              # copy/triad: three arrays, same footprint
    a, b, c = (kernels.aligned_empty((n,), np.float32) for _ in range(3))
    for arr in (a, b, c):
        arr.fill(1.0)
    pools = {t: kernels.Pool(t) for t in _thread_counts(threads)}
    cands = {}
    for t, pool in pools.items():
        p = pool._pool
        cands[f"read/{t}"] = lambda p=p: _time(lambda s: ns.bench_read(buf, nbytes, p, reps, s), reps)
        cands[f"copy/{t}"] = lambda p=p: _time(lambda s: ns.bench_copy(a, b, n, p, reps, s), reps)
        cands[f"triad/{t}"] = lambda p=p: _time(lambda s: ns.bench_triad(a, b, c, n, p, reps, s), reps)
    for fn in cands.values():                         # warm-up: page faults, frequency
        fn()
    samples = interleave(cands, rounds)
    moved = {"read": nbytes, "copy": 2 * 4 * n, "triad": 3 * 4 * n}   # STREAM's byte counts
    rows = []
    for name, secs in samples.items():
        kind, t = name.split("/")
        rates = [moved[kind] / s / 1e9 for s in flat(secs)]
        st = summary(rates)
        rows.append({"kind": kind, "threads": int(t), "gbps": st["median"], "gbps_iqr": st["iqr"],
                     "gbps_q1": st["q1"], "gbps_q3": st["q3"], "n": st["n"]})
    reads = [r for r in rows if r["kind"] == "read"]
    best = max(reads, key=lambda r: r["gbps"])
    return {"machine": machine(), "buffer_mb": mb, "read_gbps": best["gbps"],
            "read_gbps_iqr": best["gbps_iqr"], "threads": best["threads"], "results": rows}


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------

def dot_variants(path: str | None = None) -> list[dict]:
    """The issue-peak loops a path has: instruction, register width, operand form ("reg", or
    "bcst": the activation bytes broadcast from memory by the instruction) and chains."""
    ns = native.lib()
    p = native.path_id(path)
    out = []
    while name := str(ns.dot_variant(p, len(out))):
        op, width, form, chains = name.split("/")
        out.append({"variant": name, "op": op, "width": int(width), "form": form, "chains": int(chains)})
    return out


def dot_sampler(path: str | None, variant: int, n: int, reps: int = 1) -> Callable[[], list[float]]:
    """One call: `reps` timings of one issue-peak loop over n instructions -> GMAC/s each."""
    ns = native.lib()
    p = native.path_id(path)
    return lambda: [ns.bench_dot_variant(p, variant, n) / 1e9 for _ in range(reps)]


def best_variant(rows: list[dict]) -> dict:
    """The fastest loop; a tie goes to the first name in sort order, so the order the loops
    were listed or timed in never changes the answer."""
    return max(sorted(rows, key=lambda r: r["variant"]), key=lambda r: r["gmacs"])


def dot_peak(path: str | None = None, n: int = 32_000_000, reps: int = 7) -> dict:
    """The dot-product issue peak on one thread, in int8 GMAC/s: the best of the path's loops
    (`dot_variants`), each timed `reps` times over n instructions, the loops interleaved. A
    loop's rate is its fastest timing: another process or a preempted vCPU only ever slows a
    loop that touches no memory, so the fastest is the closest to what the core can do."""
    ns = native.lib()
    name = native.PATHS[native.path_id(path)]
    rows = dot_variants(name)
    cands = {i: dot_sampler(name, i, n) for i in range(len(rows))}
    for i in cands:                                   # warm-up: wakes the wide units, settles the clock
        ns.bench_dot_variant(native.path_id(name), i, n // 10)
    samples = interleave(cands, reps)
    for i, r in enumerate(rows):
        st = summary(flat(samples[i]))
        r.update(index=i, gmacs=max(flat(samples[i])), gmacs_median=st["median"], gmacs_iqr=st["iqr"])
    best = best_variant(rows)
    return {"path": name, "gmacs": best["gmacs"], "gmacs_iqr": best["gmacs_iqr"], "variant": best["variant"],
            "variants": rows}


# Working sets: DRAM is far past the 32 MB last-level cache; L2 fits one core's 1 MB L2.
DRAM_SHAPE = {"q4": (57344, 8192), "q8": (30720, 8192)}     # about 264 and 267 MB
L2_SHAPE = {"q4": (256, 4096), "q8": (128, 4096)}            # about 590 and 557 KB
QUICK_DRAM_SHAPE = {"q4": (8192, 8192), "q8": (4096, 8192)}  # ~38 MB: still past the LLC


def kernel_records(fmt: str, shape, ks, pool: kernels.Pool, working_set: str, path: int,
                   peak_gmacs: float, rounds: int, reps: int, reader=None, chunk: int | str = "guided",
                   peak=None) -> list[dict]:
    """Times each k (interleaved); with `reader`, read-bandwidth samples ride in the same
    rounds and each share of bandwidth is a paired ratio. Shares of the issue peak are against
    `peak_gmacs`, or with `peak` (a `dot_sampler` riding in the same rounds) against the
    fastest of it and `peak_gmacs`, so a clock that rose during the run raises the peak too."""
    rows, cols = shape
    W = kernels.pack(kernels.random_qtensor(fmt, rows, cols, seed=rows))
    rng = np.random.default_rng(0)
    acts = {k: kernels.Acts(rng.standard_normal((k, cols), dtype=np.float32), native.PATHS[path]) for k in ks}
    code = kernels.split_code(chunk)
    cands = {k: (lambda a=acts[k]: [W.nbytes / s / 1e9 for s in matmul_samples(W, a, pool, path, code, reps)])
             for k in ks}
    if reader:
        cands["read"] = reader
    if peak:
        cands["peak"] = peak
    samples = interleave(cands, rounds)
    out = []
    for k in ks:
        st = summary(flat(samples[k]))
        gbps = st["median"]
        t = W.nbytes / gbps / 1e9
        macs = rows * cols * k
        share = paired_ratio(samples[k], samples["read"]) if reader else None
        top = max([peak_gmacs or 0.0, *flat(samples["peak"])]) if peak else peak_gmacs
        out.append({
            "kernel": fmt, "k": k, "threads": pool.threads, "working_set": working_set,
            "rows": rows, "cols": cols, "weight_bytes": W.nbytes, "path": native.PATHS[path],
            "ms": t * 1e3, "ms_per_token": t * 1e3 / k,
            "gbps": gbps, "gbps_iqr": st["iqr"], "gmacs": macs / t / 1e9,
            "read_gbps": float(np.median(flat(samples["read"]))) if reader else None,
            "share_of_bandwidth": share["median"] if share else None,
            "share_of_bandwidth_iqr": share["iqr"] if share else None,
            "peak_gmacs": top, "share_of_peak": macs / t / 1e9 / (top * pool.threads) if top else None,
        })
    return out


def l2_records(fmt: str, ks, path: int, peak: dict, rounds: int, reps: int) -> list[dict]:
    """The kernel on an L2-resident matrix at one thread against the issue peak, whose best
    loop is timed again in the same rounds (`kernel_records`)."""
    rider = dot_sampler(peak["path"], best_variant(peak["variants"])["index"], 4_000_000, 3)
    return kernel_records(fmt, L2_SHAPE[fmt], ks, kernels.Pool(1), "l2", path, peak["gmacs"], rounds, reps, peak=rider)


def kernels_bench(ks=(1, 2, 4, 8, 16), fmts=("q4", "q8"), threads: int | None = None,
                  quick: bool = False, path: str | None = None) -> dict:
    """GMAC/s and GB/s of each kernel for each k: a DRAM-resident matrix at all threads,
    its read ceiling sampled in the same rounds; an L2-resident one at one thread against
    the dot-product issue peak (`dot_peak`), its best loop timed again in the same rounds."""
    p = native.path_id(path)
    n = len(os.sched_getaffinity(0)) if threads is None else threads
    peak = dot_peak(native.PATHS[p], n=4_000_000 if quick else 32_000_000, reps=5 if quick else 7)
    rounds, reps = (3, 2) if quick else (9, 3)
    pool_all = kernels.Pool(n)
    buf, _owner = read_buffer((64 if quick else 512) << 20)
    reader = read_sampler(buf, pool_all)
    reader()                                              # warm-up: page faults
    records = []
    for fmt in fmts:
        dram = (QUICK_DRAM_SHAPE if quick else DRAM_SHAPE)[fmt]
        records += kernel_records(fmt, dram, ks, pool_all, "dram", p, peak["gmacs"], rounds, reps, reader)
        records += l2_records(fmt, ks, p, peak, rounds * 3, reps * 5)
    reads = [r["read_gbps"] for r in records if r["read_gbps"]]
    for r in records:                                     # cache-resident: against the DRAM ceiling
        if r["share_of_bandwidth"] is None:
            r["share_of_bandwidth"] = r["gbps"] / float(np.median(reads))
    return {"machine": machine(), "path": native.PATHS[p], "threads": n,
            "read_gbps": float(np.median(reads)), "dot_peak_gmacs": peak["gmacs"],
            "dot_peak_iqr": peak["gmacs_iqr"], "dot_peak_variant": peak["variant"],
            "dot_peak_variants": peak["variants"], "results": records}


# ----------------------------------------------------------------------------
# The engine: decode rate against the ceiling, v(k), c, o
# ----------------------------------------------------------------------------

def decode_bench(model: str, scheme: str = "q4-q8out", threads: int | None = None, context: int = 256,
                 rounds: int = 7, reps: int = 5, stages: bool = False) -> dict:
    """One-token decode steps at a fixed context (the output layer included), paired round by
    round with read passes: tokens/s, bytes read per token, share of the read ceiling.
    stages=True also times each stage of the pass (`stage_records`)."""
    from .engine import Engine
    from .models.export import engine_file
    path = engine_file(model, scheme)
    e = Engine(path, threads=threads, max_context=max(context + 64, 512))
    ids = fill(e, context)
    tok = ids[-1:].copy()
    buf, _owner = read_buffer(512 << 20)
    reader = read_sampler(buf, e.pool)
    reader()
    per_round = []                          # stage seconds per pass, one dict a round

    def step():
        e.profile(stages)
        secs = forward_samples(e, tok, context, reps)
        if stages:
            per_round.append({k: v / (reps + 1) for k, v in e.stage_seconds().items()})   # + the warm-up pass
            e.profile(False)
        return [e.weight_bytes / s / 1e9 for s in secs]
    samples = interleave({"step": step, "read": reader}, rounds)
    share = paired_ratio(samples["step"], samples["read"])
    gbps = summary(flat(samples["step"]))
    tps = gbps["median"] * 1e9 / e.weight_bytes
    out = {"machine": machine(), "model": model, "format": scheme, "file": str(path),
           "threads": e.pool.threads, "context": context, "tokens_per_s": tps,
           "ms_per_token": 1e3 / tps, "bytes_per_token": e.weight_bytes,
           "read_gbps": float(np.median(flat(samples["read"]))), "gbps": gbps["median"],
           "share_of_ceiling": share["median"], "share_of_ceiling_iqr": share["iqr"]}
    if stages:
        out["stages"] = stage_records(per_round, e.stage_bytes(), [np.median(r) for r in samples["read"]])
    return out


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


def vk_bench(target: str, draft: str | None = None, scheme: str = "q4-q8out", threads: int | None = None,
             contexts=(128, 512, 2048), ks=tuple(range(1, 17)), rounds: int = 5, reps: int = 3,
             draft_schemes=("q4-q8out", "q8"), progress: bool = False) -> dict:
    """v(k) = one target pass over k tokens / one single-token pass, k values interleaved, at
    each context; c = one draft step / one target step at the same context; o = a round's
    overhead (sampling, acceptance) / one target step."""
    from .engine import Engine
    from .models.export import engine_file
    pool = kernels.Pool(threads)
    top = max(contexts) + max(ks) + 64
    t = Engine(engine_file(target, scheme), pool=pool, max_context=top)
    drafts = {s: Engine(engine_file(draft, s), pool=pool, max_context=top) for s in draft_schemes} if draft else {}
    records, it = [], contexts
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(contexts, desc="v(k)", unit="context")
    for ctx in it:
        ids = fill(t, ctx)
        for d in drafts.values():
            d.forward(ids, 0, logits="none")
        batch = {k: np.random.default_rng(k).integers(0, t.vocab, k).astype(np.int32) for k in ks}
        cands = {f"k{k}": (lambda k=k: forward_samples(t, batch[k], ctx, reps)) for k in ks}
        for s, d in drafts.items():
            cands[f"draft-{s}"] = lambda d=d: forward_samples(d, batch[1], ctx, reps)
        samples = interleave(cands, rounds)
        one = samples["k1"]
        for k in ks:
            st = paired_ratio(samples[f"k{k}"], one)
            records.append({"kind": "v", "model": target, "context": ctx, "k": k, "v": st["median"],
                            "v_iqr": st["iqr"], "ms": float(np.median(flat(samples[f"k{k}"]))) * 1e3})
        for s in drafts:
            st = paired_ratio(samples[f"draft-{s}"], one)
            records.append({"kind": "c", "model": draft, "format": s, "context": ctx, "c": st["median"],
                            "c_iqr": st["iqr"], "ms": float(np.median(flat(samples[f"draft-{s}"]))) * 1e3})
    o = overhead(t, drafts.get(scheme) or next(iter(drafts.values()), None))
    return {"machine": machine(), "target": target, "draft": draft, "format": scheme, "threads": pool.threads,
            "records": records, "o": o["o_greedy"], "overhead": o}


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


def speculative_bench(target: str, draft: str | None, prompt_ids: list[tuple[str, list[int]]],
                      gammas=(4,), scheme: str = "q4-q8out", threads: int | None = None,
                      max_new_tokens: int = 128, lookup: bool = True) -> dict:
    """Greedy plain against greedy speculative decoding (draft model and prompt lookup) on
    the same prompts, run back to back: generation tokens/s (prompt pass apart), speedup,
    acceptance, tokens per round — and a check that every speculative output equals plain."""
    from .engine import Engine
    from .models.export import engine_file
    pool = kernels.Pool(threads)
    t = Engine(engine_file(target, scheme), pool=pool)
    drafts = {}
    if draft:
        drafts[f"draft-{draft}"] = Engine(engine_file(draft, scheme), pool=pool)
    if lookup:
        drafts["lookup"] = "lookup"
    rows = []
    for label, ids in prompt_ids:
        plain = t.generate(ids, max_new_tokens)
        for name, d in drafts.items():
            for g in gammas:
                r = t.speculate(ids, d, gamma=g, max_new_tokens=max_new_tokens)
                if r.tokens != plain.tokens:
                    raise RuntimeError(f"speculative output differs from plain on {label} ({name}, gamma {g})")
                rows.append({"prompt": label, "drafter": name, "gamma": g, "new_tokens": len(r.tokens),
                             "plain_tokens_per_s": plain.tokens_per_s, "tokens_per_s": r.tokens_per_s,
                             "speedup": r.tokens_per_s / plain.tokens_per_s, "acceptance": r.acceptance,
                             "tokens_per_round": r.tokens_per_round, "prompt_tokens": r.prompt_tokens,
                             "prompt_tokens_per_s": r.prompt_tokens_per_s,
                             "wall_speedup": plain.t_total / r.t_total})
    return {"machine": machine(), "target": target, "draft": draft, "format": scheme,
            "threads": pool.threads, "max_new_tokens": max_new_tokens, "rows": rows}


SPLITS = {"static": 0, "dynamic": 8, "guided": "guided"}   # names -> Engine.set_chunk


def threads_bench(target: str, draft: str, scheme: str = "q4-q8out", context: int = 256, gamma: int = 4,
                  rounds: int = 5, reps: int = 3, max_threads: int | None = None) -> list[dict]:
    """A draft step, a target step and a verification pass (gamma + 1 tokens), each timed under
    every configuration: thread count, pinned or not, and the split of tiles — static halves,
    fixed 8-tile hand-outs ("dynamic") or shrinking shares ("guided", the engine's default)."""
    from .engine import Engine
    from .models.export import engine_file
    n = len(os.sched_getaffinity(0)) if max_threads is None else max_threads
    configs = [(t, pin, chunk) for t in range(1, n + 1) for pin in ((True, False) if t > 1 else (True,))
               for chunk in (SPLITS if t > 1 else ("static",))]
    rows = []
    for t, pin, chunk in configs:
        pool = kernels.Pool(t, pin=pin)
        te = Engine(engine_file(target, scheme), pool=pool, max_context=context + 32)
        de = Engine(engine_file(draft, scheme), pool=pool, max_context=context + 32)
        for e in (te, de):
            e.set_chunk(SPLITS[chunk])
        ids = fill(te, context)
        de.forward(ids, 0, logits="none")
        one = ids[-1:].copy()
        batch = np.resize(ids, gamma + 1).astype(np.int32)
        cands = {"draft step": lambda: forward_samples(de, one, context, reps),
                 "target step": lambda: forward_samples(te, one, context, reps),
                 f"verification (k={gamma + 1})": lambda: forward_samples(te, batch, context, reps)}
        for phase, secs in interleave(cands, rounds).items():
            st = summary(flat(secs))
            rows.append({"phase": phase, "threads": t, "pinned": pin, "split": chunk,
                         "ms": st["median"] * 1e3, "ms_iqr": st["iqr"] * 1e3,
                         "config": f"{t} thr, {'pinned' if pin else 'unpinned'}, {chunk}"})
    return rows


def gamma_bench(target: str, draft: str, prompts: list[tuple[str, list[int]]], gammas=(1, 2, 3, 4),
                scheme: str = "q4-q8out", max_new_tokens: int = 64, context: int = 256, rounds: int = 3,
                threads: int | None = None) -> dict:
    """Measured against predicted speedup over gamma, per prompt group, for the draft model and
    prompt lookup. prompts: (group, token ids). Every speculative output is checked against
    plain greedy decoding. Costs (c, v, o) come from vk_bench at `context`."""
    from . import spec
    from .engine import Engine
    from .models.export import engine_file
    pool = kernels.Pool(threads)
    ks = tuple(range(1, max(gammas) + 2))
    costs = vk_bench(target, draft, scheme, threads, (context,), ks, rounds=rounds, draft_schemes=(scheme,))
    v = {r["k"]: r["v"] for r in costs["records"] if r["kind"] == "v"}
    c = next(r["c"] for r in costs["records"] if r["kind"] == "c")
    step_ms = next(r["ms"] for r in costs["records"] if r["kind"] == "v" and r["k"] == 1)
    t = Engine(engine_file(target, scheme), pool=pool, max_context=4096)
    d = Engine(engine_file(draft, scheme), pool=pool, max_context=4096)
    runs = []
    for group, ids in prompts:
        plain = t.generate(ids, max_new_tokens)
        for drafter, dr in (("draft", d), ("lookup", "lookup")):
            for g in gammas:
                r = t.speculate(ids, dr, gamma=g, max_new_tokens=max_new_tokens)
                if r.tokens != plain.tokens:
                    raise RuntimeError(f"speculative output differs from plain ({group}, {drafter}, gamma {g})")
                runs.append({"group": group, "drafter": drafter, "gamma": g, "measured": r.tokens_per_s / plain.tokens_per_s,
                             "tokens_per_round": r.tokens_per_round, "accepted_per_round": r.accepted / r.rounds,
                             "drafted_per_round": r.drafted / r.rounds,
                             "draft_ms_per_round": r.t_draft / r.rounds * 1e3,
                             "prompt_tokens_per_s": plain.prompt_tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s})
    table = []
    for group in dict.fromkeys(p[0] for p in prompts):
        for drafter in ("draft", "lookup"):
            for g in gammas:
                mine = [x for x in runs if (x["group"], x["drafter"], x["gamma"]) == (group, drafter, g)]
                # lookup proposes fewer than gamma guesses when the context runs out of matches:
                # model the rounds with the guesses actually made
                ge = float(np.mean([x["drafted_per_round"] for x in mine]))
                alpha = spec.alpha_from_accepted(float(np.mean([x["accepted_per_round"] for x in mine])), ge) if ge else 0.0
                cost = c if drafter == "draft" else float(np.mean([x["draft_ms_per_round"] for x in mine])) / max(ge, 1e-9) / step_ms
                table.append({"group": group, "drafter": drafter, "gamma": g, "alpha": alpha, "c": cost,
                              "guesses_per_round": ge,
                              "predicted": spec.tau(alpha, ge) / (ge * cost + spec.v_at(v, ge + 1) + costs["o"]),
                              "measured": float(np.exp(np.mean(np.log([x["measured"] for x in mine])))),
                              "tokens_per_round": float(np.mean([x["tokens_per_round"] for x in mine])),
                              "prompt_tokens_per_s": float(np.mean([x["prompt_tokens_per_s"] for x in mine])),
                              "plain_tokens_per_s": float(np.mean([x["plain_tokens_per_s"] for x in mine]))})
    return {"machine": machine(), "target": target, "draft": draft, "format": scheme, "context": context,
            "v": v, "c": c, "o": costs["o"], "runs": runs, "table": table}
