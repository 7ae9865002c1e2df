"""Tuning by measurement: the engine's speed-only choices, timed on this machine.

The choices (the C++ `Tuning`, kernels_cpp/lab.h): the SIMD kernels' prefetch distances for
one token (per format) and for k >= 2, whether each of 1 to 8 tokens takes the single-token scheme
(per format), whether the AVX-512 kernel's 2- and 4-token accumulators go through memory (per
format), how many streams each format's kernels read a thread's share in, from how many tokens
the AVX-512 kernel takes a tile's tokens in two groups and the most streams it takes per token
range (each of these but the k >= 2 distances also timed from cache), which split the engine's
matmuls take (guided shares, or redo's pieces that thread 0 computes again rather than wait for a
worker gone missing), the matrix size from which the guided split turns from static ranges to
guided shares, and the smallest share or piece (the split's three judged on quiet cores, with one
core shared with a co-runner and with one worker slowed, lab.slowcore, keeping the value that
holds up on all three; the single-token stages likewise on every thread and on one). None of them
changes a result (tests/test_tune.py checks every candidate bit for bit); the choices that change
arithmetic order stay fixed per kernel path.

`tune()` times each candidate against the default with the real kernels on a working set past the
last-level cache, candidates interleaved round by round; the one with the lowest median ratio, if
MARGIN or lower, is timed against the default again and kept only if it clearly wins there (where
it does not, the runner-up likewise, `_nominees`). The stream counts, judged first, are judged once
more where the schemes and distances chosen after them changed what one token runs (SECOND_LOOK).
A run whose read ceiling moved says so (`unsteady`): a scheme can win in one bus state and lose in
the other. The result is cached as JSON beside the native builds, keyed by CPU model, kernel path
and the build's sources (`native.loaded_key`). Loading the library applies a valid cache and never
measures; the first Engine measures when nothing valid is cached (`ensure`), `lab tune` measures
again; LAB_TUNE=0 keeps the defaults.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from . import kernels, native
from .files import write_text_atomic
from .kernel_bench import ATTENTION_SHAPE, L2_SHAPE
from .protocol import (interleave, matmul_samples, past_llc, read_buffer, read_sampler, round_trip_ns, steady,
                       summary)
from .slowcore import SlowCore, slowed

SINGLE_K = tuple(range(1, 9))   # the token counts whose prefetch scheme is chosen, per format
SINGLE = {f"{fmt}_single_k{k}": (fmt, k) for fmt in ("q4", "q8") for k in SINGLE_K}   # field -> what it moves
MEM_ACC = {f"{fmt}_mem_acc_k{k}": (fmt, k) for fmt in ("q4", "q8") for k in (2, 4)}      # the AVX-512 path's only
FLAGS = (*SINGLE, *MEM_ACC, "redo_split")      # the yes/no fields
STREAMS = {f"{fmt}_streams": fmt for fmt in ("q4", "q8")}      # field -> its format
# k >= 2: each format's (into L1, into L2) distance fields, and its stage
MULTI = {"q4": ("prefetch_l1_k", "prefetch_l2_k"), "q8": ("prefetch_l1_k_q8", "prefetch_l2_k_q8")}
MULTI_STAGE = {"q4": "prefetch_k", "q8": "prefetch_k_q8"}
# The most streams per token range, format-free (kernels_cpp/matmul.cpp, stream_cap) -> the token
# counts each is judged on: two to four, five to eight, nine and more.
STREAM_CAPS = {"streams_k2": (2, 4), "streams_k5": (5, 8), "streams_k9": (12, 16)}
ACCUMULATORS = (*STREAM_CAPS, "two_groups_k")   # how many accumulators the AVX-512 kernel keeps: _register_times
FIELDS = ("prefetch_k1", "prefetch_k1_q8", *MULTI["q4"], *MULTI["q8"], *FLAGS, *STREAMS, *ACCUMULATORS,
          "guided_min_bytes", "guided_from_bytes", "att_split_k", "att_kv_l2_k")
REGISTERS = (*MEM_ACC, *ACCUMULATORS)   # where the AVX-512 kernel keeps its accumulators: its path's only
MB = 1 << 20
# What the tuner tries besides the default (which it always tries).
PREFETCH_K1 = (0, 1024, 2048, 4096, 8192, 16384)   # per format; 0: the hardware prefetcher alone
# k >= 2: (into L1, into L2); 0 into L1 leaves the near lines to the hardware prefetcher
PREFETCH_K = ((0, 8192), (0, 16384), (1024, 8192), (1024, 16384), (2048, 8192), (2048, 16384), (4096, 16384),
              (4096, 32768), (8192, 32768))
MULTI_K = (4, 8)        # the token counts a multi-token distance is judged on: its stream binds at 4, arithmetic at 8
# The stream counts are judged first, under the default one-token scheme, and once more where the
# schemes and distances chosen after them changed what one token runs: another count can win there
# (docs/tuning.md).
SECOND_LOOK = tuple(STREAMS)
AGAIN = "again"         # a second look's name in a tuning record: "q4_streams again"
STREAMS_K = (1,)        # the token counts a format's stream count is judged on: decode's (from two tokens the caps bind)
# two_groups_k's candidates beside its range's ends (native.consts().two_groups). 10 takes nine
# tokens, a verification of eight guesses, in one group: there the accumulators still fit the
# registers, where from ten on one group reads slower from cache (docs/tuning.md).
TWO_GROUPS_INNER = (8, 9, 10, 13)
GUIDED_FROM = (1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB)
SPLIT_SIZES = (1 * MB, 2 * MB, 4 * MB, 8 * MB)   # the matrix sizes the split threshold is judged on
GUIDED_MIN = (32 << 10, 64 << 10, 192 << 10, 384 << 10)
SHARE_SIZES = (8 * MB, 32 * MB)   # guided matrices the smallest share is judged on
ATT_SPLIT_K = (0, 8)              # from k tokens a KV head's attention goes to two tasks (0: never)
ATT_KV_L2_K = (0, 1, 2)           # from k tokens in a task its K and V requests go into L2 (0: never)
# The attention stage both attention fields are judged on: an 8-token verification at context
# 2048 of the 1.5B's heads (ATTENTION_SHAPE, 2 KV heads), its 28 layers' K and V from memory
# (cycled past the last-level cache, as the weights streaming between layers evict them in a pass).
ATT_STAGE = {"kv_heads": 2, "tokens": 8, "context": 2048, "layers": 28}
ATT_KV_TOKENS = (1, 8)  # att_kv_l2_k moves one-token passes too: judged on the stage's sum at both
MARGIN = 0.98           # a candidate replaces the default at a median paired time ratio this low,
                        # and only if it was faster in three rounds of four (upper quartile < 1)
                        # when timed alone against it (twice as long where only its median won:
                        # _head_to_head); the first timing, of every candidate, only
                        # nominates those with the lowest medians, if that low (_nominees)
NOMINEES = 2            # the most candidates a stage times head to head
# A one-token stage's candidate, a stream cap's and a scheme flag's are also timed on a matrix in
# L2 (one thread; `lab bench kernels`' L2 shape) against the untuned defaults, and where one is more
# than this much slower there, that ratio counts: a stream tuned for memory must not thrash L1 when
# the weights are cached (docs/tuning.md, "Tuned never slower from cache").
CACHED_LIMIT = 1.05
# Judged only below four tokens, the limit is wider: the L2 figure starts at four and no pass
# reads its weights from L2, and at 1.05 the 8-bit one-token distance, near it from L2, was kept or
# refused by noise, which moved two-token passes by 9% (docs/tuning.md).
CACHED_LIMIT_FEW, FEW_TOKENS = 1.15, 4
CACHED_CALLS = 50       # calls a repeat of a cache-resident timing: each takes 5-40 us
CACHE_FORMAT = 1
COLS = 2048             # the tuner's matrices: about a Qwen hidden size, so tiles are model-sized
SLOW_DUTY = 0.5         # the split is judged with one core this busy with other work as well,
SLOW_FACTOR = 2.0       # and with one worker this many times slower, as on an efficiency core

_state: dict = {"source": "default", "file": None, "tried": False, "read_gbps": None, "round_trip_ns": None}
_noted: set[str] = set()


# ----------------------------------------------------------------------------
# The values in force
# ----------------------------------------------------------------------------

def _as_dict(t) -> dict:
    return {f: bool(getattr(t, f)) if f in FLAGS else int(getattr(t, f)) for f in FIELDS}


def stream_cap(k: int) -> str | None:
    """The field that caps k tokens' streams (kernels_cpp/matmul.cpp, stream_cap); None at one token."""
    c = native.consts()
    return None if k < 2 else "streams_k2" if k < c.streams_k5_from else "streams_k5" if k < c.streams_k9_from \
        else "streams_k9"


def moves(a: dict, b: dict, k: int) -> bool:
    """Whether a k-token pass can run different kernel code under tunings a and b: a field that
    only moves other token counts leaves it alone (`lab tune --ab` judges only the passes that move)."""
    diff = {f for f in FIELDS if a[f] != b[f]}
    if diff & {"redo_split", "guided_min_bytes", "guided_from_bytes"}:
        return True
    for f in ("att_split_k", "att_kv_l2_k"):          # attention's choices, from a token count on
        if f in diff and k >= min(x[f] for x in (a, b) if x[f]):
            return True
    if stream_cap(k) in diff:
        return True
    lo, hi = sorted((a["two_groups_k"], b["two_groups_k"]))
    if lo <= k < hi:                                   # one group under one tuning, two under the other
        return True
    for fmt, k1 in (("q4", "prefetch_k1"), ("q8", "prefetch_k1_q8")):
        if {f"{fmt}_single_k{k}", f"{fmt}_mem_acc_k{k}", f"{fmt}_streams"} & diff:
            return True
        flag = f"{fmt}_single_k{k}"
        single = flag in a and (a[flag] or b[flag])        # under either tuning
        multi = not (flag in a and a[flag] and b[flag])
        if (single and k1 in diff) or (multi and diff & set(MULTI[fmt])):
            return True
    return False


def defaults() -> dict:
    """The engine's defaults on this CPU (docs/tuning.md has the measurements behind them)."""
    return _as_dict(native.lib().default_tuning())


def current() -> dict:
    """The values the kernels use now."""
    return _as_dict(native.lib().tuning())


def apply(values: dict, ns=None) -> None:
    """Sets the kernels' values (fields left out keep their defaults); call between kernel calls."""
    ns = ns or native.lib()
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown tuning fields {sorted(unknown)}; the fields are {', '.join(FIELDS)}")
    t = ns.default_tuning()
    for f, v in values.items():
        setattr(t, f, v)
    if ns.set_tuning(t):
        raise ValueError(f"tuning values out of range: {values}")


def two_groups() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """two_groups_k's candidates (two groups from the first token count built for them, from
    TWO_GROUPS_INNER's, or one group wherever it is built) and the token counts that tell them
    apart: one below each candidate past the first, which it takes in one group and the
    candidate before it in two."""
    first, last = native.consts().two_groups
    cands = (first, *TWO_GROUPS_INNER, last)
    return cands, tuple(c - 1 for c in cands[1:])


def stream_counts() -> tuple[int, ...]:
    """Every stream count the kernels take: the powers of two up to MAX_STREAMS (kernels_cpp/lab.h)."""
    return tuple(1 << i for i in range(native.consts().max_streams.bit_length()))


def candidates(base: dict | None = None) -> dict[str, dict[str, dict]]:
    """Per stage, each candidate's label -> the fields it sets; every value the tuner can pick."""
    base = base or defaults()
    k1 = {f: sorted({*PREFETCH_K1, base[f]}) for f in ("prefetch_k1", "prefetch_k1_q8")}
    pairs = {fmt: sorted({*PREFETCH_K, (base[l1], base[l2])}) for fmt, (l1, l2) in MULTI.items()}
    froms = sorted({*GUIDED_FROM, base["guided_from_bytes"]})
    mins = sorted({*GUIDED_MIN, base["guided_min_bytes"]})
    return {   # in the order they are timed: the stream counts first, the distances for those streams
        **{f: {str(v): {f: v} for v in sorted({*stream_counts(), base[f]})} for f in STREAMS},
        "streams_k2": {str(v): {"streams_k2": v} for v in stream_counts()},
        "streams_k5": {str(v): {"streams_k5": v} for v in (1, 2)},
        **{f: {str(v): {f: v} for v in vs} for f, vs in k1.items()},
        **{MULTI_STAGE[fmt]: {f"{a}/{b}": {l1: a, l2: b} for a, b in pairs[fmt]} for fmt, (l1, l2) in MULTI.items()},
        "streams_k9": {str(v): {"streams_k9": v} for v in (1, 2)},
        **{f: {str(v).lower(): {f: v} for v in (False, True)} for f in (*SINGLE, *MEM_ACC)},
        "two_groups_k": {str(v): {"two_groups_k": v} for v in sorted({*two_groups()[0], base["two_groups_k"]})},
        "redo_split": {str(v).lower(): {"redo_split": v} for v in (False, True)},
        "guided_from_bytes": {str(v): {"guided_from_bytes": v} for v in froms},
        "guided_min_bytes": {str(v): {"guided_min_bytes": v} for v in mins},
        "att_split_k": {str(v): {"att_split_k": v} for v in sorted({*ATT_SPLIT_K, base["att_split_k"]})},
        "att_kv_l2_k": {str(v): {"att_kv_l2_k": v} for v in sorted({*ATT_KV_L2_K, base["att_kv_l2_k"]})},
    }


# ----------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------

def key(ns=None) -> dict:
    """What a cached tuning is valid for: this CPU model, kernel path and build of the sources."""
    ns = ns or native.lib()
    brand = bytes(ns.cpu_info().brand).split(b"\0")[0].decode(errors="replace").strip()
    return {"cpu": brand, "path": str(ns.path_name(ns.active_path())), "sources": native.loaded_key()}


def cache_file(k: dict) -> Path:
    """Inside the build's own folder: two builds used in turn (an A/B) keep their own tunings."""
    cpu = hashlib.sha256(k["cpu"].encode()).hexdigest()[:8]
    return native.cache_dir() / "native" / k["sources"] / f"tuning-{k['path']}-{cpu}.json"


def _note(text: str) -> None:
    if text not in _noted:
        _noted.add(text)
        print(f"lab: note: {text}", file=sys.stderr)


_WHAT = {"cpu": "another CPU", "path": "another kernel path", "sources": "another build of kernels_cpp/",
         "format": "another version of the lab"}


def load(ns=None) -> dict | None:
    """The cached tuning for this CPU, path and build, or None; one that is stale or foreign is
    ignored with a one-line note on stderr."""
    k = key(ns)
    f = cache_file(k)
    try:
        rec = json.loads(f.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _note(f"ignoring the kernel tuning in {f}: unreadable ({type(e).__name__}); `lab tune` measures again")
        return None
    differs = [name for name in ("cpu", "path", "sources") if rec.get(name) != k[name]]
    if rec.get("format") != CACHE_FORMAT or set(rec.get("values", {})) != set(FIELDS):
        differs.append("format")
    if differs:
        _note(f"ignoring the kernel tuning in {f}: measured for {', '.join(_WHAT[d] for d in differs)}; "
              f"defaults until it is measured again (`lab tune`)")
        return None
    return rec


def save(rec: dict) -> Path:
    """Writes a tune() result as this machine's cache (never a half-written file)."""
    f = cache_file(rec)
    f.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(f, json.dumps(rec, indent=2))


def use(rec: dict, ns=None) -> None:
    """Puts a tuning (a tune() result or a loaded cache) in force and records where it came from."""
    apply(rec["values"], ns)
    _state.update(source=f"tuned at {rec['date']}", file=str(cache_file(rec)), read_gbps=rec.get("read_gbps"),
                  round_trip_ns=rec.get("round_trip_ns"))


def skipped() -> bool:
    return os.environ.get("LAB_TUNE", "").strip() == "0"


def on_load(ns) -> None:
    """native.lib() calls this once: the cached tuning goes in force; nothing is measured."""
    if skipped():
        _state.update(source="LAB_TUNE=0", file=None, read_gbps=None, round_trip_ns=None)
        return
    rec = load(ns)
    if rec:
        use(rec, ns)


def ensure(progress: bool = True) -> None:
    """The engine's first use in a process: measures and caches when nothing valid is cached."""
    native.lib()
    if skipped() or _state["source"] != "default" or _state["tried"]:
        return
    _state["tried"] = True
    lock = native.cache_dir() / "native" / "tuning.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fd:                 # another process tuning now: wait for its result
        fcntl.flock(fd, fcntl.LOCK_EX)
        rec = load()
        if rec is None:
            print("lab: tuning the kernels to this CPU, once per build (`lab tune` redoes it, "
                  "LAB_TUNE=0 skips it)", file=sys.stderr)
            rec = tune(progress=progress)
            save(rec)
            if note := unsteady(rec):
                _note(note)
    use(rec)


def unsteady(rec: dict) -> str | None:
    """A note where the read ceiling moved while `rec` (a tuning, or describe()) was measured: one
    scheme can win in one bus state and lose in the other (docs/tuning.md)."""
    read = rec.get("read_gbps") or {}
    before, after = read.get("before"), read.get("after")
    if not (before and after) or steady(before, after):
        return None
    return (f"the read ceiling moved from {before:.1f} to {after:.1f} GB/s while the tuner measured, so its "
            f"choices may suit one bus state only; run `lab tune` again when the machine is steady")


def describe() -> dict:
    """The values in force, the defaults, and where the values came from."""
    return {"source": _state["source"], "file": _state["file"], "read_gbps": _state["read_gbps"],
            "round_trip_ns": _state["round_trip_ns"], "values": current(), "defaults": defaults()}


def lines(d: dict | None = None) -> list[str]:
    """describe() for people: one line per field, the default beside a tuned value."""
    d = d or describe()
    out = [f"tuning        {d['source']}" + (f" ({d['file']})" if d["file"] else "")]
    if d.get("read_gbps"):      # the bandwidth state the choices were made in (the bus flips)
        out.append(f"  read ceiling          {d['read_gbps']['before']:.1f} GB/s before, "
                   f"{d['read_gbps']['after']:.1f} after")
    trip = d.get("round_trip_ns") or {}
    if trip.get("before"):      # and where the threads sat: one die, or two with a link each
        out.append(f"  threads' round trip   {trip['before']:.0f} ns before, {trip['after']:.0f} after")
    if note := unsteady(d):
        out.append(f"  note                  {note}")
    for f in FIELDS:
        v, dv = d["values"][f], d["defaults"][f]
        out.append(f"  {f:22s}{v}" + ("" if v == dv else f" (default {dv})"))
    return out


# ----------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------

class _Bench:
    """The tuner's working set: a 4-bit and an 8-bit matrix, each timed `mb` MB at a time and
    cycled through so that it streams from memory (`past_llc`), activations for the k it
    times, and a pool of every CPU this process may use."""

    def __init__(self, mb: int, reps: int, threads: int | None):
        ns = native.lib()
        self.mb, self._read, self._stages = mb, None, {}
        self.path = int(ns.active_path())
        self.path_name = str(ns.path_name(self.path))
        self.pool = self.matmul_pool = kernels.Pool(threads)
        self.one = kernels.Pool(1) if self.pool.threads > 1 else self.pool
        self.reps = reps
        self.guided, self.auto = int(ns.SPLIT_GUIDED), int(ns.SPLIT_AUTO)
        self.W, self.walk, self.tile_bytes, self.acts, self._next = {}, {}, {}, {}, {"q4": 0, "q8": 0}
        self._cached: dict = {}       # (fmt, k) -> an L2 matrix and activations (cached())
        self._l2: dict = {}           # fmt -> its L2 matrix, one for every k
        rng = np.random.default_rng(0)
        tile = native.consts().tile
        for fmt in ("q4", "q8"):
            self.tile_bytes[fmt] = tile_bytes = int(ns.packed_nbytes(native.consts().formats[fmt], tile, COLS))
            tiles = max(1, mb * MB // tile_bytes)                   # timed at a time
            walks = -(-past_llc(mb * MB) // (tiles * tile_bytes))   # cycled, they stream from memory
            self.walk[fmt] = tiles * tile
            self.W[fmt] = kernels.pack(kernels.random_qtensor(fmt, walks * tiles * tile, COLS, seed=tiles))
        for k in sorted({1, *MULTI_K, *SINGLE_K, *STREAMS_K, *(k for ks in STREAM_CAPS.values() for k in ks), *two_groups()[1]}):
            x = rng.standard_normal((k, COLS), dtype=np.float32)
            self.acts[k] = kernels.Acts(x, self.path_name)

    def matmul(self, fmt: str, k: int, call: int | None = None) -> list[float]:
        """Seconds per pass over `mb` MB of the matrix, in one call or in calls of `call` bytes,
        split the engine's way over `matmul_pool` (SPLIT_AUTO, as redo_split says), so each
        value is timed in the split it will run in."""
        return self._walk(fmt, k, self.matmul_pool, self.auto, call)

    def attention(self, tokens: int = ATT_STAGE["tokens"]) -> list[float]:
        """Seconds per attention stage of a pass of `tokens` tokens (ATT_STAGE's otherwise) on
        the pool, its caches past the last-level cache; each made on first use (other users of
        the bench never read them)."""
        ns, secs, a = native.lib(), np.zeros(self.reps), ATT_STAGE
        if tokens not in self._stages:
            self._stages[tokens] = stage = ns.AttentionStage()
            if stage.init(ATTENTION_SHAPE["head_dim"], ATTENTION_SHAPE["group"], a["kv_heads"], tokens, a["context"],
                          a["layers"], past_llc(0), self.path):
                raise RuntimeError(f"the attention stage refused {tokens} tokens of {a} on path {self.path_name}")
        self._stages[tokens].time(self.pool._pool, self.reps, secs)
        return list(secs)

    def cached(self, fmt: str, k: int) -> list[float]:
        """Seconds per product of an L2-resident matrix of fmt at k tokens on one thread, for each
        of CACHED_CALLS calls; the matrix (one a format, whatever k) and activations are made on
        first use."""
        if (fmt, k) not in self._cached:
            rows, cols = L2_SHAPE[fmt]
            if fmt not in self._l2:
                self._l2[fmt] = kernels.pack(kernels.random_qtensor(fmt, rows, cols, seed=1))
            x = np.random.default_rng(k).standard_normal((k, cols), dtype=np.float32)
            self._cached[fmt, k] = (self._l2[fmt], kernels.Acts(x, self.path_name))
        W, acts = self._cached[fmt, k]
        return matmul_samples(W, acts, self.one, self.path, 0, CACHED_CALLS)

    @contextlib.contextmanager
    def one_thread(self):
        """Matrix products on one thread meanwhile."""
        self.matmul_pool = self.one
        try:
            yield
        finally:
            self.matmul_pool = self.pool

    def read_gbps(self) -> float:
        """The read ceiling now, over a buffer past the last-level cache: which bandwidth state
        this is. The buffer is made on first use: other users of the bench never read it."""
        if self._read is None:
            buf, owner = read_buffer(self.mb * MB)
            self._read = (read_sampler(buf, self.pool), buf, owner)
        return float(np.median(self._read[0]()))

    def multi(self, fmt: str) -> list[float]:
        """Seconds per pass at each of MULTI_K tokens, summed per repeat."""
        return _summed(self.matmul(fmt, k) for k in MULTI_K)

    def slices(self, size: int, chunk: int) -> list[float]:
        """Seconds per walk over `mb` MB of the 4-bit matrix at one token in calls on consecutive
        slices of `size` bytes (as a model's layers call it), each slice split by `chunk` over
        every thread."""
        return self._walk("q4", 1, self.pool, chunk, size)

    def _walk(self, fmt: str, k: int, pool, chunk: int, call: int | None) -> list[float]:
        """Seconds per walk over the next `mb` MB of fmt's matrix at k tokens on pool, in calls of
        `call` bytes (None: one call), each split by `chunk`."""
        tile = native.consts().tile
        per = self.walk[fmt] // tile if call is None else int(min(max(1, round(call / self.tile_bytes[fmt])),
                                                                  self.walk[fmt] // tile))
        first, self._next[fmt] = self._next[fmt], self._next[fmt] + self.reps     # on round the cycle
        return matmul_samples(self.W[fmt], self.acts[k], pool, self.path, chunk, self.reps, self.walk[fmt], per * tile,
                              first)


def _summed(timings) -> list[float]:
    """Several timings' seconds, added repeat by repeat."""
    return [sum(t) for t in zip(*timings)]


def _per_round(cands: dict[str, Callable[[], list[float]]], rounds: int, bar) -> dict[str, list[float]]:
    """Each candidate's median seconds per round, candidates interleaved within each round, in
    reverse order every other round so that going first or last favours none of them."""
    out: dict[str, list[float]] = {name: [] for name in cands}
    names = list(cands)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name, secs in interleave({n: cands[n] for n in order}, 1).items():
            out[name].append(float(np.median(secs[0])))
        bar.update()
    return out


def _one_token(values: dict, fmt: str) -> dict:
    """What a format's one-token passes run besides their stream count: its single-token scheme flag
    and distance, and the k >= 2 scheme's distances, which one token takes where the flag is off."""
    fields = [f for f, x in ONE_THREAD.items() if x == fmt and f not in STREAMS] + list(MULTI[fmt])
    return {f: values[f] for f in fields}


def stage_of(look: str) -> str:
    """The stage a tuning record's entry measured: itself, or the stage a second look looked at."""
    return look.removesuffix(f" {AGAIN}")


def _pick(times: dict[str, list[float]], default: str) -> tuple[str, dict]:
    """The fastest candidate if it clearly beats the default (MARGIN), else the default; and each
    candidate's median and IQR of per-round time ratios to the default."""
    ratios = {name: summary([a / b for a, b in zip(t, times[default])]) for name, t in times.items()}
    best = min(ratios, key=lambda n: ratios[n]["median"])
    clear = ratios[best]["median"] <= MARGIN and ratios[best]["q3"] < 1
    chosen = best if clear else default
    return chosen, {n: {"ratio": r["median"], "iqr": r["iqr"]} for n, r in ratios.items()}


def _nominees(ratios: dict, default: str) -> list[str]:
    """The NOMINEES candidates with the lowest median ratios that are MARGIN or lower, best
    first: one round in four against them is noise on a shared bus, so head-to-head timings
    decide, and where the best fails its own the runner-up is still timed (two_groups_k's best
    here, one group at 16 tokens, sat at the cached limit and failed in one run of three, where
    the runner-up, 13, would have cut 9- to 12-token passes by a sixth)."""
    fast = sorted((n for n in ratios if n != default and ratios[n]["ratio"] <= MARGIN), key=lambda n: ratios[n]["ratio"])
    return fast[:NOMINEES]


def _nominee(ratios: dict, default: str) -> str:
    """The best of `_nominees`, or the default where there is none."""
    return next(iter(_nominees(ratios, default)), default)


def _label(cands: dict[str, dict], values: dict) -> str:
    return next(name for name, sets in cands.items() if all(values[f] == v for f, v in sets.items()))


def _stage_samplers(b: _Bench) -> dict[str, Callable[[], list[float]]]:
    """What each other stage times: the kernels whose speed its values move (the single-token
    stages: _stream_times; the scheme flags from two tokens: _scheme_flag_times)."""
    return {**{stage: (lambda fmt=fmt: b.multi(fmt)) for fmt, stage in MULTI_STAGE.items()}, "att_split_k": b.attention,
            "att_kv_l2_k": lambda: _summed(b.attention(k) for k in ATT_KV_TOKENS)}


def _threshold_times(b: _Bench, base: dict, cands: dict[str, dict], rounds: int, bar) -> dict[str, list[float]]:
    """Each threshold's seconds per round over walks of every SPLIT_SIZES slice size, from static
    and guided walks of each size timed once a round."""
    def walk(size, static):
        def run():
            apply({**base, "guided_from_bytes": 0})     # guided whatever the size
            return b.slices(size, 0 if static else b.guided)
        return run
    walks = {(s, st): walk(s, st) for s in SPLIT_SIZES for st in (True, False)}
    got = _per_round({f"{s}/{st}": fn for (s, st), fn in walks.items()}, rounds, bar)
    return {name: [sum(got[f"{s}/{s < sets['guided_from_bytes']}"][r] for s in SPLIT_SIZES)
                   for r in range(rounds)]
            for name, sets in cands.items()}


def _scheme_times(b: _Bench, base: dict, cands: dict[str, dict], rounds: int, bar) -> dict[str, list[float]]:
    """Each split's (redo_split's) seconds per round over walks of every SPLIT_SIZES slice size."""
    def walk(sets):
        def run():
            apply({**base, **sets})
            return _summed(b.slices(size, b.auto) for size in SPLIT_SIZES)
        return run
    return _per_round({name: walk(sets) for name, sets in cands.items()}, rounds, bar)


def _share_times(b: _Bench, base: dict, cands: dict[str, dict], rounds: int, bar) -> dict[str, list[float]]:
    """Each smallest share's (or redo piece's) seconds per round over walks of every SHARE_SIZES
    size, in the split chosen."""
    def walk(sets):
        def run():
            apply({**base, **sets, "guided_from_bytes": 0})
            return [sum(x) for x in zip(*(b.slices(size, b.auto) for size in SHARE_SIZES))]
        return run
    return _per_round({n: walk(sets) for n, sets in cands.items()}, rounds, bar)


def _held_up(timer, b: _Bench, base: dict, cands: dict[str, dict], rounds: int, bar) -> dict[str, list[float]]:
    """Each candidate's time ratio to the default, per round: the worst of the ratios on quiet
    cores, with the last worker's core shared with a co-runner (which takes it away in
    scheduler slices) and with that worker slowed (lab.slowcore: both emulate an efficiency
    core), so the split chosen is one that holds up on each."""
    default = _label(cands, base)
    slow_cpu = b.pool.cpus[-1]
    quiet = timer(b, base, cands, rounds, bar)
    with SlowCore(slow_cpu, SLOW_DUTY):
        shared = timer(b, base, cands, rounds, bar)
    with slowed(b.pool, slow_cpu, SLOW_FACTOR):
        slow = timer(b, base, cands, rounds, bar)
    return _worse_of([quiet, shared, slow], default)


SPLIT_TIMERS = {"redo_split": _scheme_times, "guided_from_bytes": _threshold_times,
                "guided_min_bytes": _share_times}   # timed 3 times: _held_up
# The single-token stream's stages, timed on every thread and again on one, each round's ratio the
# worse of the two: where the threads do not share one link to memory, as when a hypervisor
# puts two vCPUs on different dies, each core's own memory parallelism binds (docs/tuning.md).
# stage -> its format: each format's one-token distance, its one-token scheme flag, and its
# stream count (which moves every token count, and each core's memory parallelism above all)
# The calls a one-token stream is timed in: the 4-bit body's as a layer's large matrices make them
# (2-30 MB in the models the lab runs: in the 1.5B's 1.3-16 MB calls, the k >= 2 scheme for one
# token took 0.973 of the pass's time, where one call over the whole walk read 0.979-0.982 and
# failed MARGIN), the 8-bit output layer's in one call.
STREAM_CALL = {"q4": 8 * MB, "q8": None}
# A stream count's calls: its streams start afresh in every piece of a call, and a small
# matrix's few pieces gained more from them than a large one's, so the 4-bit body's are timed
# as a layer makes them: small matrices (2 MB: the 1.5B's attention projections) and large ones
# (16 MB: its MLP's). The 8-bit output layer's in one call.
STREAMS_CALLS = {"q4": (2 * MB, 16 * MB), "q8": (None,)}
ONE_THREAD = {"prefetch_k1": "q4", "prefetch_k1_q8": "q8", **{f: fmt for f, (fmt, k) in SINGLE.items() if k == 1},
              **STREAMS}
# The scheme flags from two tokens on -> (format, tokens): each timed at its own, from memory and from L2.
SCHEME_FLAGS = {f: fk for f, fk in (SINGLE | MEM_ACC).items() if f not in ONE_THREAD}


def single_ks(fmt: str, values: dict) -> list[int]:
    """The token counts that run `fmt`'s single-token scheme under `values`: its distance moves
    them all, and a distance that helps one token lost 1.5-4.4% at two (docs/tuning.md)."""
    return [k for k in SINGLE_K if values[f"{fmt}_single_k{k}"]]


def stream_timings(stage: str, base: dict) -> list[tuple[tuple[int, int | None], ...]]:
    """The timings a one-token stream's stage takes, each the walks (tokens, call bytes) summed in
    it: a distance at every count that runs its scheme (at one token where none does) and the
    one-token scheme's own flag at one token, in STREAM_CALL's calls; a stream count in one timing
    of STREAMS_K in STREAMS_CALLS' calls (each timing's ratio is a worst-of term, and the worst of
    more noisy terms overstates the true ratio)."""
    fmt = ONE_THREAD[stage]
    if stage in STREAMS:
        return [tuple((k, call) for k in STREAMS_K for call in STREAMS_CALLS[fmt])]
    ks = [1] if stage in SINGLE else single_ks(fmt, base) or [1]
    return [((k, STREAM_CALL[fmt]),) for k in ks]


def _worse_of(timings: list[dict], default: str | None) -> dict[str, list[float]]:
    """Per candidate and round, the largest of its time ratios to the default over the timings."""
    return {n: [max(t[n][r] / t[default][r] for t in timings) for r in range(len(timings[0][n]))]
            for n in timings[0]}


def _bar_rounds(stage: str, rounds: int, threads: int = 1, base: dict | None = None) -> int:
    """The progress bar's rounds for one timing of a stage's candidates on `threads` threads."""
    if stage in ONE_THREAD:   # its timings from memory, each on every thread and on one, and its cached timing
        return rounds * (len(stream_timings(stage, base or defaults())) * (2 if threads > 1 else 1) + 1)
    if stage in ACCUMULATORS:     # from memory, and cached at each format and token count
        return rounds * (len(_memory_counts(stage)) + 2 * len(_register_ks(stage)))
    if stage in SCHEME_FLAGS:     # from memory, and cached
        return rounds * 2
    return rounds * (3 if stage in SPLIT_TIMERS else 1)


def _times(stage: str, cands: dict[str, dict], b: _Bench, base: dict, rounds: int, bar) -> dict[str, list[float]]:
    if stage in SPLIT_TIMERS:
        return _held_up(SPLIT_TIMERS[stage], b, base, cands, rounds, bar)
    if stage in ONE_THREAD:
        return _stream_times(stage, b, base, cands, rounds, bar)
    if stage in ACCUMULATORS:
        return _register_times(stage, b, base, cands, rounds, bar)
    if stage in SCHEME_FLAGS:
        return _scheme_flag_times(stage, b, base, cands, rounds, bar)
    sample = _stage_samplers(b)[stage]
    return _per_round({n: (lambda sets=sets: (apply({**base, **sets}), sample())[1]) for n, sets in cands.items()},
                      rounds, bar)


def _stream_times(stage: str, b: _Bench, base: dict, cands: dict[str, dict], rounds: int, bar) -> dict[str, list[float]]:
    """A one-token stream stage's ratios to the default per round: the worst over its timings
    (stream_timings), each on every thread and on one, and its cached timing against the
    defaults' (key None) where that is past its limit (cached_limit, _past_limit)."""
    timings, fmt = [], ONE_THREAD[stage]
    walked = stream_timings(stage, base)
    settings = {**{n: {**base, **sets} for n, sets in cands.items()}, None: defaults()}
    ks = tuple(sorted({k for walks in walked for k, _ in walks}))
    cached = _by_code(settings, ks, lambda k: b.cached(fmt, k), rounds, bar)
    for walks in walked:
        fns = {n: (lambda sets=sets, walks=walks: (apply({**base, **sets}),
                                                    _summed(b.matmul(fmt, k, call) for k, call in walks))[1])
               for n, sets in cands.items()}
        timings.append(_per_round(fns, rounds, bar))
        if b.pool.threads > 1:
            with b.one_thread():
                timings.append(_per_round(fns, rounds, bar))
    default = _label(cands, base)
    return _past_limit(_worse_of(timings, default), _worse_of([cached], None), cached_limit(ks))


def _register_ks(stage: str) -> tuple[int, ...]:
    """The token counts an ACCUMULATORS stage is judged on."""
    return STREAM_CAPS.get(stage) or two_groups()[1]


def _memory_counts(stage: str) -> list[tuple[int, ...]]:
    """An ACCUMULATORS stage's timings from memory, each the token counts summed in it: a stream cap
    at each of its counts apart, the worse ratio counting (summed, two streams' win at two tokens
    hid their loss at four, 1-4% on whole passes, docs/tuning.md); two_groups_k over its counts
    summed, most of which run one code under both candidates."""
    ks = _register_ks(stage)
    return [(k,) for k in ks] if stage in STREAM_CAPS else [ks]


def _register_times(stage: str, b: _Bench, base: dict, cands: dict[str, dict], rounds: int,
                    bar) -> dict[str, list[float]]:
    """A stream cap's (streams_k2, _k5, _k9) or two_groups_k's ratios to the default per round:
    both formats from memory (_memory_counts), and the worst cached timing where that is past
    its limit, of each format at each of those counts where the candidate runs other code than
    the reference (`moves`): more accumulators pay from memory and cost from cache. The stream
    caps are judged against the untuned defaults. two_groups_k against the values chosen so far with the
    default grouping, so it weighs the grouping's own cost; the streams' cost is the stream caps'."""
    ks, fmts = _register_ks(stage), ("q4", "q8")
    tried = {n: {**base, **sets} for n, sets in cands.items()}
    memory = [_by_code(tried, counts, lambda k: _summed(b.matmul(fmt, k) for fmt in fmts), rounds, bar)
              for counts in _memory_counts(stage)]
    reference = defaults() if stage in STREAM_CAPS else {**base, stage: defaults()[stage]}
    settings = {**tried, None: reference}
    cached = {(fmt, k): _worse_of([_by_code(settings, (k,), lambda k, fmt=fmt: b.cached(fmt, k), rounds, bar)], None)
              for fmt in fmts for k in ks}

    def worst(n: str) -> list[float]:
        moved = [key for key in cached if moves(settings[n], reference, key[1])]
        return [max([1.0, *(cached[key][n][r] for key in moved)]) for r in range(rounds)]
    return _past_limit(_worse_of(memory, _label(cands, base)), {n: worst(n) for n in cands}, cached_limit(ks))


def _scheme_flag_times(stage: str, b: _Bench, base: dict, cands: dict[str, dict], rounds: int,
                       bar) -> dict[str, list[float]]:
    """A scheme flag's ratios to the default per round at its format and token count: from
    memory, and from L2 against the untuned defaults where that is past its limit. The k >= 2
    scheme's requests into L2 won 30% from memory at two 8-bit tokens and cost 20% on a matrix
    already in L2, where the single scheme at the tuned one-token distance lost nothing on whole
    passes (docs/tuning.md)."""
    fmt, k = SCHEME_FLAGS[stage]
    tried = {n: {**base, **sets} for n, sets in cands.items()}
    memory = _by_code(tried, (k,), lambda k: b.matmul(fmt, k), rounds, bar)
    cached = _by_code({**tried, None: defaults()}, (k,), lambda k: b.cached(fmt, k), rounds, bar)
    return _past_limit(_worse_of([memory], _label(cands, base)), _worse_of([cached], None), cached_limit((k,)))


def _by_code(settings: dict, counts: tuple[int, ...], sample: Callable[[int], list[float]], rounds: int,
             bar) -> dict:
    """Each setting's seconds per round summed over `counts`, `sample(k)` timing one setting of each
    group that runs the same kernel code at k tokens (`moves`), the others given its times:
    two_groups_k's six candidates run two codes at each count, one group or two, and a candidate
    that runs the defaults' code from L2 is not timed against them twice."""
    plan, fns = {}, {}
    for k in counts:
        for n, values in settings.items():
            rep = next((r for r, j in fns if j == k and not moves(settings[r], values, k)), n)
            plan[n, k] = rep, k
            fns.setdefault((rep, k), lambda values=values, k=k: (apply(values), sample(k))[1])
    times = _per_round(fns, rounds, bar)
    return {n: [sum(times[plan[n, k]][r] for k in counts) for r in range(rounds)] for n in settings}


def _head_to_head(stage: str, pair: dict[str, dict], default: str, b: _Bench, base: dict, rounds: int,
                  bar) -> tuple[str, dict, int]:
    """A nominee timed alone against the default: `_pick`'s verdict, its ratios and the rounds they
    came from. Where the nominee wins on the median but not in three rounds of four, it is timed as
    long again and judged on all the rounds: one noisy timing on a shared bus otherwise kept the
    single-token scheme for one 4-bit token, 8% slower on one-token passes (docs/tuning.md)."""
    nominee = next(n for n in pair if n != default)
    times: dict[str, list[float]] = {n: [] for n in pair}
    for _ in range(2):
        bar.total += _bar_rounds(stage, rounds, b.pool.threads, base)
        more = _times(stage, pair, b, base, rounds, bar)
        times = {n: times[n] + more[n] for n in pair}
        chosen, ratios = _pick(times, default)
        if chosen != default or ratios[nominee]["ratio"] > MARGIN:
            break
    return chosen, ratios, len(times[default])


def cached_limit(counts) -> float:
    """The cached limit of a timing from L2 at these token counts: CACHED_LIMIT where one is
    FEW_TOKENS or more, else CACHED_LIMIT_FEW."""
    return CACHED_LIMIT if max(counts) >= FEW_TOKENS else CACHED_LIMIT_FEW


def _past_limit(ratios: dict[str, list[float]], cached: dict[str, list[float]],
                limit: float = CACHED_LIMIT) -> dict[str, list[float]]:
    """Each round's ratio, or, for a candidate clearly past `limit` from cache (its cached
    ratio past it in three rounds of four), the larger of that and the round's cached ratio.
    Judged on the rounds together, not one by one: a candidate at the limit otherwise took its
    cached ratio in some rounds only, and the spread failed it head to head however fast it read
    from memory (docs/tuning.md)."""
    return {n: [max(r, c) for r, c in zip(ratios[n], cached[n])] if np.percentile(cached[n], 25) > limit
            else ratios[n] for n in ratios}


def tune(progress: bool = True, mb: int = 64, rounds: int = 10, reps: int = 3,
         threads: int | None = None) -> dict:
    """Measures every stage's candidates on this machine and returns the values chosen, with each
    candidate's median time ratio to the default; the values in force are left as they were.
    The candidate with the lowest median ratio, if MARGIN or lower, is timed against the default
    once more, alone, for as many rounds (or twice as many: `_head_to_head`), and kept only if it
    clearly wins there; where it does not, the runner-up is timed so too (`_nominees`).
    mb: the MB of each matrix timed at a time (cycled through a matrix past the last-level cache,
    so the weights stream from memory); 64 MB in 10 rounds chose as 256 MB in 15 did, in a
    fifth of the time (docs/tuning.md)."""
    from tqdm import tqdm
    before = current()                          # builds the library first, if it must
    start = time.perf_counter()
    b = _Bench(mb, reps, threads)
    base, stages = defaults(), candidates()
    # what this path and pool can move
    prefetching, split, registers = b.path_name != "scalar", b.pool.threads > 1, b.path_name == "avx512vnni"
    split_stages = (*SPLIT_TIMERS, "att_split_k")      # only a pool's split moves them
    run = [s for s in stages if (split if s in split_stages else registers if s in REGISTERS else prefetching)]
    measured, chosen, confirmed = {}, {}, {}
    judged_under = {}       # a SECOND_LOOK stage -> the one-token values its first look left in force
    read_before, trip_before = b.read_gbps(), round_trip_ns(b.pool)
    try:
        with tqdm(total=sum(_bar_rounds(s, rounds, b.pool.threads, base) for s in run), desc="lab tune", unit="round",
                  disable=not progress, file=sys.stderr) as bar:
            def judge(stage: str, look: str) -> None:
                cands, default = stages[stage], _label(stages[stage], base)
                _, measured[look] = _pick(_times(stage, cands, b, base, rounds, bar), default)
                chosen[look] = default
                for nominee in _nominees(measured[look], default):    # each timed once more, until one wins
                    pair = {n: cands[n] for n in (default, nominee)}
                    again, ratios, timed = _head_to_head(stage, pair, default, b, base, rounds, bar)
                    confirmed.setdefault(look, []).append({"candidate": nominee, **ratios[nominee], "rounds": timed})
                    if again != default:
                        chosen[look] = again
                        break
                base.update(cands[chosen[look]])

            for stage in run:
                judge(stage, stage)
                if stage in SECOND_LOOK:
                    judged_under[stage] = _one_token(base, ONE_THREAD[stage])
            for stage, under in judged_under.items():
                if _one_token(base, ONE_THREAD[stage]) != under:
                    bar.total += _bar_rounds(stage, rounds, b.pool.threads, base)
                    judge(stage, f"{stage} {AGAIN}")
    finally:
        apply(before)
    return {"format": CACHE_FORMAT, **key(), "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "seconds": round(time.perf_counter() - start, 1), "values": base, "defaults": defaults(),
            "chosen": chosen, "measured": measured, "confirmed": confirmed, "mb": mb, "rounds": rounds,
            "threads": b.pool.threads, "read_gbps": {"before": read_before, "after": b.read_gbps()},
            "round_trip_ns": {"before": trip_before, "after": round_trip_ns(b.pool)},
            "slow_core": {"cpu": b.pool.cpus[-1], "duty": SLOW_DUTY, "factor": SLOW_FACTOR} if split else None}
