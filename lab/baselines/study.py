"""The baselines study: the lab beside llama.cpp and transformers in one run.

Two parts. `steps`: one-token decode at each context and v(k), the lab's and llama.cpp's
passes interleaved round by round with read passes, so every ratio pairs neighbours in
time. `generation`: Spec-Bench prompts, each system plain and speculative, every system's
runs for one prompt back to back, so a speedup over its own plain run, and over llama.cpp's
plain run, is a ratio of runs seconds apart. Greedy throughout: a speculative output that
differs from its own system's plain output is recorded (transformers in bf16 may differ)
and, for the lab and llama.cpp, raised.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import chain, zip_longest
from dataclasses import dataclass

import numpy as np

from .. import energy
from ..protocol import fill, flat, forward_samples, interleave, paired_ratio, read_buffer, read_sampler
from ..spec import geomean
from ..speculative import SpeculationMismatch, bracket
from . import Run


@dataclass
class System:
    """A system's ways of generating: "plain" plus its speculative settings, each
    ids -> Run. exact: its greedy speculative output must equal its plain output."""
    name: str
    settings: dict[str, Callable[[list[int]], Run]]
    exact: bool = True
    prompts: int | None = None          # run on only the first n prompts (slow systems)
    release: Callable[[], None] | None = None     # frees its models once its prompts are done


# ----------------------------------------------------------------------------
# Steps: decode tokens/s and v(k), with the read ceiling in the same rounds
# ----------------------------------------------------------------------------

def steps(lab_engine, llama=None, contexts=(256, 2048), ks=tuple(range(1, 17)), rounds: int = 3,
          reps: int = 3, mb: int = 512, progress: bool = True) -> list[dict]:
    """Per context and system: ms per k-token pass, v(k) paired with k = 1 round by round,
    tokens/s and GB/s of a decode step, and its share of the read ceiling."""
    from tqdm.auto import tqdm
    buf, _owner = read_buffer(mb << 20)
    reader = read_sampler(buf, lab_engine.pool)
    systems = {"lab": _LabPasses(lab_engine)}
    if llama is not None:
        systems["llama.cpp"] = llama
    out = []
    for ctx in tqdm(contexts, desc="steps", unit="context", disable=not progress, file=sys.stderr):
        for s in systems.values():
            s.fill(ctx)
        cands = {"read": reader}
        for name, s in systems.items():
            for k in ks:
                cands[f"{name}/{k}"] = (lambda s=s, k=k: s.pass_seconds(k, reps))
        samples = interleave(cands, rounds)
        out += [_step_record(name, s, samples, ctx, ks) for name, s in systems.items()]
    return out


def _step_record(name, s, samples, ctx, ks) -> dict:
    one = samples[f"{name}/1"]
    step = float(np.median(flat(one)))
    gbps = [[s.bytes_per_token / x / 1e9 for x in r] for r in one]
    return {"system": name, "context": ctx, "ms_per_token": step * 1e3, "tokens_per_s": 1 / step,
            "bytes_per_token": s.bytes_per_token, "gbps": float(np.median(flat(gbps))),
            "read_gbps": float(np.median(flat(samples["read"]))),
            "share_of_ceiling": paired_ratio(gbps, samples["read"])["median"],
            "v": {k: paired_ratio(samples[f"{name}/{k}"], one)["median"] for k in ks}}


class _LabPasses:
    """The lab's engine as `steps` times it: a filled cache, then k-token passes at its end."""

    def __init__(self, engine):
        self.e, self.ctx, self.batch = engine, 0, {}
        self.bytes_per_token = engine.weight_bytes

    def fill(self, ctx: int) -> None:
        self.ctx = ctx
        ids = fill(self.e, ctx)
        self.batch = {k: np.resize(ids[::-1], k).astype(np.int32) for k in range(1, 17)}

    def pass_seconds(self, k: int, reps: int) -> list[float]:
        return forward_samples(self.e, self.batch[k], self.ctx, reps)


# ----------------------------------------------------------------------------
# Generation: every system plain and speculative on the same prompts
# ----------------------------------------------------------------------------

def round_robin(prompts: list[dict]) -> list[dict]:
    """One prompt of each group in turn, so the first n (a slow system's share) span the groups."""
    groups: dict[str, list[dict]] = {}
    for p in prompts:
        groups.setdefault(p["group"], []).append(p)
    return [p for p in chain.from_iterable(zip_longest(*groups.values())) if p is not None]


def prompts_for(target: str, per_group: int | None) -> list[tuple[dict, list[int]]]:
    """The Spec-Bench dev prompts' first turns as the target's token ids, groups in turn."""
    from .. import specbench
    from ..speculative import Conversation
    conv = Conversation(target)
    return [(p, conv.ids(p["turns"][:1], [])) for p in round_robin(specbench.prompts(per_group=per_group))]


def generation(systems: list[System], prompts: list[tuple[dict, list[int]]], reference: str = "llama.cpp",
               progress: bool = True) -> dict:
    """prompts: (Spec-Bench prompt, its token ids). Per prompt, each system runs plain, its
    settings, plain again; the systems' order rotates from prompt to prompt so none is always
    first after a pause. -> {"rows", "summary"}"""
    from tqdm.auto import tqdm
    meter = energy.Meter()
    rows = []
    bar = tqdm(total=len(prompts), desc="baselines", unit="prompt", disable=not progress, file=sys.stderr)
    for i, (p, ids) in enumerate(prompts):
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        mine = [r for s in order if s.prompts is None or i < s.prompts for r in _bracket(s, p, ids, meter)]
        for s in systems:
            if s.release and s.prompts == i + 1:
                s.release()
        ref = [r for r in mine if r["system"] == reference and r["setting"] == "plain"]
        for r in mine:
            r["vs_reference"] = r["tokens_per_s"] / ref[0]["tokens_per_s"] if ref else float("nan")
        rows += mine
        bar.update()
    bar.close()
    return {"rows": rows, "summary": summarize(rows), "energy": energy.status()}


def _bracket(s: System, p: dict, ids: list[int], meter) -> list[dict]:
    """plain, then each setting and plain again (a setting's bracket again if its plain runs
    disagree) -> one row per setting, over its two plain runs' mean, and the plain row (the
    first two plain runs' mean)."""
    plain = lambda: _measured(s.settings["plain"], ids, meter)
    spec = {k: (lambda fn=fn: _measured(fn, ids, meter)) for k, fn in s.settings.items() if k != "plain"}
    brackets = bracket(plain, list(spec.values()), lambda m: m[0])
    ((first, e0), (last, e1)), _, tries = brackets[0]
    plain_tps = (first.tokens_per_s + last.tokens_per_s) / 2
    rows = [_row(s, p, "plain", first, plain_tps, plain_tps, _mean_energy(e0, e1), True, tries)
            | {"same_prefix": len(first.tokens)}]
    for k, (((a, _), (b, _)), (r, e), tries) in zip(spec, brackets):
        same = _common_prefix(r.tokens, first.tokens)
        if s.exact and r.tokens != first.tokens:
            raise SpeculationMismatch(f"{s.name} {k} on prompt {p['id']}: greedy output differs from its plain run "
                                      f"at token {same}")
        rows.append(_row(s, p, k, r, r.tokens_per_s, (a.tokens_per_s + b.tokens_per_s) / 2, e,
                         r.tokens == first.tokens, tries) | {"same_prefix": same})
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _measured(fn, ids, meter) -> tuple[Run, float | None]:
    """A run and its joules per token (None where the CPU's energy counters are not readable)."""
    before = meter.read() if meter.available else None
    run = fn(ids)
    if before is None or not run.tokens:
        return run, None
    j = sum(meter.joules(before, meter.read()).values())
    return run, j / len(run.tokens)


def _mean_energy(a, b):
    return (a + b) / 2 if a is not None and b is not None else None


def _row(s, p, setting, r: Run, tps, plain_tps, joules, equal, tries) -> dict:
    return {"id": p["id"], "group": p["group"], "system": s.name, "setting": setting,
            "new_tokens": len(r.tokens), "tokens_per_s": tps, "speedup": tps / plain_tps,
            "acceptance": r.acceptance, "equal_to_plain": equal, "joules_per_token": joules, "tries": tries}


def summarize(rows: list[dict]) -> list[dict]:
    """Per system and setting, per group and overall: geometric means of tokens/s and of the
    paired ratios."""
    out = []
    keys = dict.fromkeys((r["system"], r["setting"]) for r in rows)
    for system, setting in keys:
        mine = [r for r in rows if (r["system"], r["setting"]) == (system, setting)]
        for g in list(dict.fromkeys(r["group"] for r in mine)) + ["overall"]:
            sel = [r for r in mine if g in ("overall", r["group"])]
            j = [r["joules_per_token"] for r in sel if r["joules_per_token"] is not None]
            out.append({"system": system, "setting": setting, "group": g, "n": len(sel),
                        "tokens_per_s": geomean(r["tokens_per_s"] for r in sel),
                        "speedup": geomean(r["speedup"] for r in sel),
                        "vs_reference": geomean(r["vs_reference"] for r in sel),
                        "all_equal": all(r["equal_to_plain"] for r in sel),
                        "equal_share": float(np.mean([r["equal_to_plain"] for r in sel])),
                        "joules_per_token": float(np.median(j)) if j else None})
    return out


def best_speculative(summary: list[dict], system: str, group: str = "overall") -> dict | None:
    """A system's fastest speculative setting in a group (by its paired speedup)."""
    mine = [r for r in summary if r["system"] == system and r["group"] == group and r["setting"] != "plain"]
    return max(mine, key=lambda r: r["speedup"], default=None)

