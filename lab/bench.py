"""The engine's benchmarks, built on the measuring protocol (lab.protocol): decode steps,
v(k), c and o, thread configurations and speculation over gamma."""
from __future__ import annotations

import os

import numpy as np

from . import kernels
from .machine import machine
from .protocol import fill, flat, forward_samples, interleave, paired_ratio, read_buffer, read_sampler, summary


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
