"""The automatic speculation policy: what the round loop needs to decide a round, and where
it comes from (the cost model it plans with: docs/science.md §1).

- Costs: this machine's v(k), c and o at a few contexts, measured once per machine, build of
  the engine (and its tuning) and pair of models (lab.protocol: interleaved, medians of paired
  ratios) and cached under cache_dir()/costs/.
- Calibration: how likely a guess is to be accepted, from the draft's confidence (its top
  probability) or from the length of the n-gram prompt lookup matched; fitted on training
  prompts (never Spec-Bench) along the target's own answers, and stored beside the draft's
  weights file.

Each file names what it was made for; one made for another machine or other models is
refused with a message naming both sides.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ValidationError

from . import native, spec, tune
from .errors import LabError
from .files import write_text_atomic

TEMPERATURES = (0.0, 0.7, 1.0)     # the calibration's tables; a request takes the nearest
# The contexts costs are measured at (at most the engine's COST_CONTEXTS); 1024 because long
# prompts (summarization, RAG) verify between 1,000 and 1,500 tokens.
CONTEXTS = (128, 512, 1024, 2048)
# Plain decoding this much faster or slower than a cost table's target step: another bandwidth
# state, whose v(k) and c differ (the states of docs/science.md §7 are 30-50% apart).
STATE_GAP = 0.12


class PolicyFileError(LabError):
    """A costs or calibration file that does not fit this machine or these models."""


def _consts():
    ns = native.lib()
    return int(ns.CAL_BINS), int(ns.NGRAM_MAX), int(ns.COST_CONTEXTS), int(ns.VK), int(ns.MAX_K)


def _content(engine) -> str | None:
    from .models.export import content_id
    return None if engine is None else content_id(engine.file)


def _save(path: Path, model: BaseModel) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, model.model_dump_json(indent=1))


def _load(cls, path: Path, what: str):
    try:
        return cls.model_validate_json(Path(path).read_text())
    except (OSError, ValidationError, ValueError) as e:
        raise PolicyFileError(f"{path} is not a {what} file ({str(e).splitlines()[0]}): delete it and "
                              f"let the lab make it again") from None


def _check_models(obj, path, target, draft, what: str) -> None:
    want = (_content(target), _content(draft))
    if (obj.target, obj.draft) != want:
        raise PolicyFileError(
            f"{path}: these {what} were made for target {obj.target[:12]} and draft {(obj.draft or 'none')[:12]}; "
            f"this is target {want[0][:12]} ({target.file.name}) and draft {(want[1] or 'none')[:12]}: "
            f"make them again for this pair")


# ----------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------

class Costs(BaseModel):
    machine: dict                    # cpu, kernel path, threads
    target: str                      # content ids of the weights files
    draft: str | None
    contexts: list[int]
    v: list[list[float]]             # [context][k], k = 0..MAX_K + 1 (v[0] unused)
    c: list[float]                   # per context: a draft step over a target step (0: no draft)
    o: float                         # a round's overhead over a target step, greedy
    o_sampled: float
    # per context: the target's one-token pass, ms, when these were measured -- which bandwidth
    # state they belong to (speculative.CostStates); empty in tables made before it was kept
    step_ms: list[float] = []

    def at(self, context: int) -> tuple[dict[int, float], float]:
        """v (k -> v(k)) and c at `context`, linear between the measured contexts (constant
        past either end): attention's share of a pass grows with the context, so the
        nearest measured one would price a 1,000-token prompt at 512's costs."""
        xs = np.asarray(self.contexts, float)
        v = np.asarray(self.v, float)
        vk = [float(np.interp(context, xs, v[:, k])) for k in range(1, v.shape[1])]
        return dict(enumerate(vk, 1)), float(np.interp(context, xs, self.c))

    def step_at(self, context: int) -> float | None:
        """The target's one-token pass at `context` when these were measured, ms (None: not kept)."""
        return float(np.interp(context, self.contexts, self.step_ms)) if self.step_ms else None


def machine_id(threads: int) -> dict:
    c = native.cpu()
    return {"cpu": c["model"], "kernel_path": c["active_path"], "threads": int(threads)}


def costs_path(target, draft) -> Path:
    # another build of the engine, or other tuning values, runs at other speeds: another table
    m = {**machine_id(target.pool.threads), "contexts": CONTEXTS, "engine": native.loaded_key(),
         "tuning": tune.current(), "attention": [e.attention for e in (target, draft) if e is not None]}
    key = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:12]
    pair = f"{_content(target)[:16]}-{(_content(draft) or 'lookup')[:16]}"
    return native.cache_dir() / "costs" / f"{key}-{pair}.json"


def costs_at(target, drafts: dict, context: int, kmax: int = 9, rounds: int = 3,
             reps: int = 2) -> tuple[list[float], dict, float]:
    """v(0..kmax), each draft's c (name -> c) and the one-token pass in ms at one context, as
    `lab bench vk` measures them (lab.costs). v is made non-decreasing in k: k + 1 tokens never
    cost less than k, so a dip is noise."""
    from .costs import records_at
    rec = records_at(target, drafts, context, range(1, kmax + 1), rounds, reps)
    v = isotonic(np.array([r["v"] for r in rec if r["kind"] == "v"]), np.ones(kmax))
    step = next(r["ms"] for r in rec if r["kind"] == "v" and r["k"] == 1)
    return [0.0] + [float(x) for x in v], {r["format"]: r["c"] for r in rec if r["kind"] == "c"}, step


def step_ms(target, context: int) -> float:
    """The target's one-token pass at `context` now, ms."""
    from .costs import records_at
    return records_at(target, {}, context, [1], rounds=3, reps=2)[0]["ms"]


def measure_costs(target, draft=None, contexts=CONTEXTS, kmax: int = 9, rounds: int = 7, reps: int = 2,
                  progress: bool = True) -> Costs:
    """v(k) for k = 1..kmax (a round of kmax - 1 guesses at most) and c at each context that
    fits both caches, and o; measured once more when the target's step at any context has
    moved by STATE_GAP by the end (a table from two bandwidth states fits neither; a flip
    and a flip back can leave the first context alone)."""
    from tqdm.auto import tqdm
    from .costs import overhead
    _, _, ncx, vk, max_k = _consts()
    kmax = min(kmax, max_k + 1)
    top = min(target.max_context, draft.max_context if draft else target.max_context) - (kmax + 1)
    ctxs = [c for c in contexts if c <= top][:ncx] or [max(1, top)]
    for desc in ("this machine's costs", "the costs again (the bus flipped meanwhile)"):
        vs, cs, steps = [], [], []
        for ctx in tqdm(ctxs, desc=desc, unit="context", disable=not progress, file=sys.stderr):
            v, c, step = costs_at(target, {"draft": draft} if draft else {}, ctx, kmax, rounds, reps)
            vs.append(v)
            cs.append(c.get("draft", 0.0))
            steps.append(step)
        if all(abs(step_ms(target, c) / s - 1) <= STATE_GAP for c, s in zip(ctxs, steps)):   # one state throughout
            break
    o = overhead(target, draft, tokens=32)
    return Costs(machine=machine_id(target.pool.threads), target=_content(target), draft=_content(draft),
                 contexts=ctxs, v=vs, c=cs, o=o["o_greedy"], o_sampled=o["o_sampled"], step_ms=steps)


def load_costs(path: Path, target, draft) -> Costs:
    c = _load(Costs, path, "costs")
    here = machine_id(target.pool.threads)
    if c.machine != here:
        raise PolicyFileError(f"{path}: these costs were measured on {c.machine}; this is {here}: "
                              f"measure them here (lab bench speculative does it once per machine)")
    _check_models(c, path, target, draft, "costs")
    return c


def costs_for(target, draft=None, progress: bool = True, fresh: bool = False) -> Costs:
    """This machine's costs for the pair: from the cache, or measured once and cached (or now,
    when `fresh`, so a prediction pairs with a run in the same bandwidth state)."""
    path = costs_path(target, draft)
    if path.exists() and not fresh:
        c = load_costs(path, target, draft)
        if c.step_ms:                   # an older table does not say which bandwidth state it is
            return c
    c = measure_costs(target, draft, progress=progress)
    _save(path, c)
    return c


# ----------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------

class Table(BaseModel):
    draft_p: list[float]             # [CAL_BINS]: P(accepted | the draft's top probability)
    draft_next: list[float]          # [CAL_BINS]: P(the next accepted | this one's top probability, accepted)
    lookup_first: list[float]        # [NGRAM_MAX + 1]: P(first lookup guess accepted | n matched)
    lookup_next: float               # P(a later lookup guess accepted | the one before was)
    draft_alpha: float               # the draft's mean acceptance over every position
    positions: int                   # how many positions the table was fitted on


class Calibration(BaseModel):
    target: str
    draft: str | None
    ngram_max: int
    prompts: int
    tables: dict[str, Table]         # by temperature ("0.0", "0.7", "1.0")

    def table(self, temperature: float) -> Table:
        key = min(self.tables, key=lambda t: abs(float(t) - temperature))
        return self.tables[key]


def calibration_path(target, draft) -> Path:
    """Beside the draft's weights file (lookup alone: beside the target's), per target."""
    base = draft.file if draft is not None else target.file
    return base.with_name(f"{base.name}.calib-{_content(target)[:12]}.json")


def isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing fit of y with weights w (pool adjacent violators): a surer draft
    is never calibrated as less likely to be right."""
    blocks = []                                        # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            b = blocks.pop()
            a = blocks[-1]
            a[0] = (a[0] * a[1] + b[0] * b[1]) / max(a[1] + b[1], 1e-12)
            a[1] += b[1]
            a[2] += b[2]
    return np.concatenate([[v] * n for v, _, n in blocks])


def _binned(conf: np.ndarray, acc: np.ndarray, bins: int, weight: np.ndarray | None = None) -> list[float]:
    """P(accept) per confidence bin (positions weighed by `weight`): each bin's mean pulled
    toward its centre by two pseudo positions, then made non-decreasing."""
    w = np.ones(conf.size) if weight is None else weight
    b = np.clip((conf * bins).astype(int), 0, bins - 1)
    n = np.bincount(b, weights=w, minlength=bins)
    hits = np.bincount(b, weights=acc * w, minlength=bins)
    centre = (np.arange(bins) + 0.5) / bins
    return isotonic((hits + 2 * centre) / (n + 2), n + 2).tolist()


def _softmax(x: np.ndarray, t: float) -> np.ndarray:
    """float32 rows (-inf allowed), summed in float64."""
    e = np.exp((x - x.max(-1, keepdims=True)) / np.float32(t))
    return e / e.sum(-1, keepdims=True, dtype=np.float64).astype(np.float32)


def teacher_forced(engine, prompt: list[int], answer: list[int], chunk: int = 16):
    """Logits predicting each answer token, in chunks -> yields (start, [n, vocab])."""
    if len(prompt) > 1:
        engine.forward(prompt[:-1], 0, logits="none")
    seq = [prompt[-1]] + answer[:-1]
    for s in range(0, len(seq), chunk):
        yield s, engine.forward(seq[s:s + chunk], len(prompt) - 1 + s, logits="all")


def lookup(ctx: list[int], ngram_max: int, gamma: int) -> tuple[int, list[int]]:
    """The engine's prompt lookup on a context -> (n-gram length matched, continuation)."""
    ns = native.lib()
    a = np.asarray(ctx, np.int32)
    out, matched = np.zeros(gamma, np.int32), np.zeros(1, np.int32)
    g = int(ns.lookup_ngram(a, a.size, ngram_max, gamma, out, matched))
    return int(matched[0]), out[:g].tolist()


def _lookup_rounds(prompt: list[int], answer: list[int], ngram_max: int, gamma: int) -> list:
    """At each position j where lookup matches: (j, n-gram length, the guesses a round would
    verify along the target's text -- up to and including the first wrong one)."""
    out = []
    for j in range(len(answer)):
        n, cont = lookup(prompt + answer[:j], ngram_max, gamma)
        guesses = []
        for i, tok in enumerate(cont[:len(answer) - j]):
            guesses.append(tok)
            if tok != answer[j + i]:
                break
        if guesses:
            out.append((j, n, guesses))
    return out


def calibrate(target, draft, samples, temperatures=TEMPERATURES, ngram_max: int = 8,
              progress: bool = True) -> Calibration:
    """Fits the tables on (prompt ids, answer ids) pairs, the answers being the target's
    greedy text: along it, a guess at position j is accepted, given every guess before it
    was, exactly when the draft's top token (or lookup's) is the target's."""
    from tqdm.auto import tqdm
    bins, nmax, _, _, max_k = _consts()
    rec = {t: {"conf": [], "acc": [], "lf": [[] for _ in range(nmax + 1)], "ln": [],
               "conf_prev": [], "acc_next": [], "w_prev": []} for t in temperatures}
    for prompt, answer in tqdm(samples, desc="calibration", unit="prompt", disable=not progress, file=sys.stderr):
        ans = np.asarray(answer)
        runs = _lookup_rounds(prompt, answer, ngram_max, max_k)
        if draft is not None:
            draft.set_extra_rows(prompt)
            drf = np.concatenate([x for _, x in teacher_forced(draft, prompt, answer)])
        tgt = np.concatenate([x for _, x in teacher_forced(target, prompt, answer)]) if any(temperatures) else None
        for t in temperatures:
            r = rec[t]
            p = _softmax(tgt, t) if t else None
            if draft is not None:
                q = _softmax(drf, t or 1.0)
                conf = q.max(-1)
                acc = (drf.argmax(-1) == ans).astype(float) if not t else np.minimum(p, q).sum(-1)
                r["conf"].append(conf)
                r["acc"].append(acc)
                # the next guess, weighed by the chance this one was accepted
                r["conf_prev"].append(conf[:-1])
                r["acc_next"].append(acc[1:])
                r["w_prev"].append(acc[:-1])
            for j, n, cont in runs:
                for i, tok in enumerate(cont):
                    (r["lf"][n] if i == 0 else r["ln"]).append(float(tok == answer[j + i]) if not t else float(p[j + i, tok]))
    tables = {}
    for t, r in rec.items():
        conf = np.concatenate(r["conf"]) if r["conf"] else np.zeros(0)
        acc = np.concatenate(r["acc"]) if r["acc"] else np.zeros(0)
        tables[str(t)] = Table(
            draft_p=_binned(conf, acc, bins),
            draft_next=_binned(np.concatenate(r["conf_prev"]), np.concatenate(r["acc_next"]), bins,
                               np.concatenate(r["w_prev"])) if r["conf_prev"] else _binned(conf, acc, bins),
            lookup_first=[(sum(x) + 0.5) / (len(x) + 2) for x in r["lf"]],
            lookup_next=(sum(r["ln"]) + 0.5) / (len(r["ln"]) + 2),
            draft_alpha=float(acc.mean()) if acc.size else 0.0, positions=int(conf.size or sum(map(len, r["lf"]))))
    return Calibration(target=_content(target), draft=_content(draft), ngram_max=ngram_max,
                       prompts=len(samples), tables=tables)


def prior_calibration(target, draft, ngram_max: int = 8) -> Calibration:
    """Before any fit: acceptance = the draft's confidence; lookup by match length."""
    bins, nmax, *_ = _consts()
    centres = ((np.arange(bins) + 0.5) / bins).tolist()
    tab = Table(draft_p=centres, draft_next=centres,
                lookup_first=[0.0] + [min(0.9, 0.2 + 0.1 * n) for n in range(1, nmax + 1)],
                lookup_next=0.7, draft_alpha=0.6 if draft is not None else 0.0, positions=0)
    return Calibration(target=_content(target), draft=_content(draft), ngram_max=ngram_max, prompts=0,
                       tables={"0.0": tab})


def load_calibration(path: Path, target, draft) -> Calibration:
    c = _load(Calibration, path, "calibration")
    _check_models(c, path, target, draft, "calibration tables")
    return c


def save_calibration(calib: Calibration, target, draft) -> Path:
    return _save(calibration_path(target, draft), calib)


# ----------------------------------------------------------------------------
# The policy handed to the round loop
# ----------------------------------------------------------------------------

@dataclass
class Policy:
    costs: Costs
    table: Table
    max_gamma: int = 8
    ngram_max: int = 8               # lookup's longest n-gram, as the table was fitted

    def draft_rate(self) -> float:
        """The speedup the draft alone is expected to give at its best γ (its prior in the loop;
        below 1 the loop starts out preferring plain steps)."""
        if self.costs.draft is None:
            return 0.0
        v, c = self.costs.at(512)
        gammas = [g for g in range(1, self.max_gamma + 1) if g + 1 in v]
        return spec.best_gamma(self.table.draft_alpha, c, v, self.costs.o, gammas)[1]

    def native(self):
        """The C++ lab::Policy (keep it alive while a generation runs on it)."""
        ns = native.lib()
        bins, nmax, ncx, vk, max_k = _consts()
        top = min(max_k, min(len(v) for v in self.costs.v) - 2)
        if not 1 <= self.max_gamma <= top:
            raise LabError(f"max_gamma={self.max_gamma}: the costs cover rounds of 1 to {top} guesses")
        p = ns.Policy()
        p.max_gamma, p.n_ctx, p.o = self.max_gamma, len(self.costs.contexts), self.costs.o
        for i, (ctx, c, v) in enumerate(zip(self.costs.contexts, self.costs.c, self.costs.v)):
            p.ctx[i], p.c[i] = ctx, c
            v = [0.0, *isotonic(np.asarray(v[1:]), np.ones(len(v) - 1))]   # a longer pass never costs less
            for k in range(vk):
                p.v[i * vk + k] = v[min(k, len(v) - 1)]
        for i, (x, y) in enumerate(zip(self.table.draft_p[:bins], self.table.draft_next[:bins])):
            p.draft_p[i], p.draft_next[i] = x, y
        for i, x in enumerate(self.table.lookup_first[:nmax + 1]):
            p.lookup_first[i] = x
        p.lookup_next, p.draft_rate, p.ngram_max = self.table.lookup_next, self.draft_rate(), self.ngram_max
        return p


_warned: set = set()


def policy_for(target, draft=None, temperature: float = 0.0, max_gamma: int = 8, progress: bool = True) -> Policy:
    """The automatic policy for the pair on this machine: cached costs (measured here once)
    and the calibration beside the draft's file (before one is fitted: the prior, said once)."""
    costs = costs_for(target, draft, progress=progress)
    path = calibration_path(target, draft)
    if path.exists():
        calib = load_calibration(path, target, draft)
    else:
        if path not in _warned:
            print(f"lab: no calibration at {path}; the policy uses its prior (fit one: lab bench speculative "
                  f"--calibrate)", file=sys.stderr)
            _warned.add(path)
        calib = prior_calibration(target, draft)
    return Policy(costs, calib.table(temperature), max_gamma, calib.ngram_max)


def fitted_policy(target, draft, target_name: str, temperature: float = 0.0, max_gamma: int = 8,
                  refit: bool = False, sources=None, per_source: int = 24, max_new_tokens: int = 128) -> Policy:
    """The automatic policy with a fitted calibration: fitted first, on the training prompts
    (never Spec-Bench), where none is saved beside the draft or refit asks."""
    if refit or not calibration_path(target, draft).exists():
        from .vocab import training_samples
        samples = training_samples(target, target_name, sources, per_source, max_new_tokens)
        save_calibration(calibrate(target, draft, samples), target, draft)
    return policy_for(target, draft, temperature, max_gamma)
