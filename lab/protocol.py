"""The measuring protocol (docs/science.md §7) and the timed calls it is applied to.

Warm up; interleave the things compared (A B A B ...); report medians with the
interquartile range; measure the ceiling in the same run as what is compared with it.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Callable

import numpy as np

from . import kernels, native


# Two rates of one thing further apart than this: the bus changed state between them (some
# machines flip between two read ceilings within minutes, and what was measured across a flip
# mixes the two).
UNSTEADY = 0.15


def steady(a: float, b: float) -> bool:
    """Whether two rates of one thing (two reads of the ceiling, two plain runs) agree within UNSTEADY."""
    return abs(a / b - 1) <= UNSTEADY


def band_edges(text: str) -> list[float]:
    """An argparse type: the read ceilings (GB/s, comma-separated) where one bus state's band
    ends and the next begins."""
    try:
        return sorted(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError("GB/s, comma-separated, e.g. 40 or 45,60") from None


def steady_bands(rounds: list[dict], edges: list[float]) -> list[tuple[float, float, list[dict], float]]:
    """The rounds whose two reads agree within UNSTEADY, by read ceiling, [0, e1), [e1, e2), ...:
    per band that has any, (from GB/s, to GB/s, its rounds, their median read)."""
    steady_rounds = [r for r in rounds if steady(r["read_after"], r["read_before"])]
    out = []
    for lo, hi in zip([0.0, *edges], [*edges, float("inf")]):
        mine = [r for r in steady_rounds if lo <= (r["read_before"] + r["read_after"]) / 2 < hi]
        if mine:
            out.append((lo, hi, mine, float(np.median([(r["read_before"] + r["read_after"]) / 2 for r in mine]))))
    return out


def summary(samples) -> dict:
    """Median and interquartile range of a list of timings (or rates)."""
    a = np.asarray(samples, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "iqr": float(q3 - q1), "n": int(a.size)}


def interleave(candidates: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[list[float]]]:
    """Run each candidate once per round, in turn (A B A B ...): name -> one list of samples per round."""
    out: dict[str, list[list[float]]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            out[name].append(list(fn()))
    return out


def flat(rounds: list[list[float]]) -> list[float]:
    return [x for r in rounds for x in r]


def paired_ratios(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """median(a) / median(b) within each round: on a shared machine, neighbours in time see
    the same noise, so their ratio is steadier than the ratio of the two overall medians."""
    return [float(np.median(x) / np.median(y)) for x, y in zip(a, b)]


def paired_ratio(a: list[list[float]], b: list[list[float]]) -> dict:
    """Median and IQR over rounds of paired_ratios."""
    return summary(paired_ratios(a, b))


# ----------------------------------------------------------------------------
# The read ceiling, sampled beside what is compared with it
# ----------------------------------------------------------------------------

def llc_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache Linux reports for CPU 0, the last level's size (0 when it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for f in caches.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


# A container's memory limit and use, cgroup v2's files and v1's: /proc/meminfo shows the host's.
CGROUP_MEMORY = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                 (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


def available_bytes(meminfo: Path = Path("/proc/meminfo"), cgroups=CGROUP_MEMORY) -> int | None:
    """The memory Linux says is available for new work, within this container's limit where
    one is set (None when neither says)."""
    room = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in meminfo.read_text().splitlines() if x.startswith("MemAvailable:"))
        room.append(int(line.split()[1]) << 10)
    for limit, used in cgroups:
        with contextlib.suppress(OSError, ValueError):      # "max" (v2) or a huge number: no limit
            room.append(int(limit.read_text()) - int(used.read_text()))
    return min(room) if room else None


def past_llc(nbytes: int) -> int:
    """A working set of at least nbytes that streams from memory when cycled: twice the
    last-level cache (a cycle a little past it still hits some: under a 480 MB L3 the tuner's
    4-bit matrix read 7% faster in 512 MB than in 1 GB, docs/tuning.md), capped at an eighth
    of the memory available (the tuner holds five such sets at once) so that a small machine
    is not pushed to swap; what is asked for always stands."""
    room = available_bytes()
    want = 2 * llc_bytes()
    return max(nbytes, want if room is None else min(want, room // 8))


def read_buffer(nbytes: int):
    """A buffer for read passes from memory: at least nbytes, raised past the last-level cache
    (past_llc), allocated like the kernels' weights (2 MB pages where allowed) and filled with
    random bytes -> (array, owner); keep the owner alive as long as the array."""
    ns, nbytes = native.lib(), past_llc(nbytes)
    owner = ns.Buffer(nbytes)
    view = owner.data()
    view.reshape((nbytes,))
    buf = np.frombuffer(view, dtype=np.uint8)
    ns.fill_random(buf, nbytes, 1)
    return buf, owner


def round_trip_ns(pool: kernels.Pool, trips: int = 20_000) -> float | None:
    """Nanoseconds for a cache line's round trip between the pool's threads 0 and 1 (None for a
    pool of one): on a virtual machine, which says whether its vCPUs share a die, and with it a
    link to memory (docs/tuning.md, "The fast bus state is two dies")."""
    return float(native.lib().bench_round_trip(pool._pool, trips)) if pool.threads > 1 else None


# The read loops the read ceiling is the fastest of, (bytes ahead, streams): plain loads, each line
# asked for into L1 that many bytes ahead, and each thread's slice read in two streams. A ceiling
# a simple loop beats is no ceiling: on a Sapphire Rapids-class Xeon the plain loop read 30.9 GB/s
# and one asking 1 KB ahead 34.1, and one build of that loop read 8% less where its two-stream
# form did not (docs/tuning.md).
READ_LOOPS = ((0, 1), (256, 1), (1024, 1), (1024, 2))


def read_passes(buf: np.ndarray, nbytes: int, pool, reps: int) -> list[float]:
    """Seconds of `reps` read passes over buf[:nbytes] on the pool (a kernels.Pool's C++ pool):
    those of the READ_LOOPS loop with the lowest median."""
    kernels.check_array(buf, "buf", np.uint8, 1, align=64)     # the loops load whole aligned lines
    if not 0 < nbytes <= buf.size:
        raise ValueError(f"nbytes must be in 1..{buf.size} (buf's size), got {nbytes}")
    ns, runs = native.lib(), []
    for ahead, streams in READ_LOOPS:
        secs = np.zeros(reps)
        ns.bench_read(buf, nbytes, pool, reps, secs, ahead, streams)
        runs.append(list(secs))
    return min(runs, key=lambda secs: float(np.median(secs)))


def read_sampler(buf: np.ndarray, pool: kernels.Pool, reps: int = 3) -> Callable[[], list[float]]:
    """One call: `reps` read passes over buf, the fastest loop's (read_passes) -> GB/s each."""
    return lambda: [buf.size / s / 1e9 for s in read_passes(buf, buf.size, pool._pool, reps)]


# ----------------------------------------------------------------------------
# Timed calls: C++ times each repeat, so no Python sits inside a timing
# ----------------------------------------------------------------------------

def matmul_samples(W, acts, pool, path, chunk, reps, walk_rows: int | None = None,
                   slice_rows: int | None = None, first: int = 0) -> list[float]:
    """Seconds for each of reps products of the packed W with acts: of W whole, or, with
    walk_rows, of its next walk_rows rows each time from walk `first` on, cycling through W (a
    W past the last-level cache then streams from memory each time, if each call goes on where
    the last stopped: first + reps), in calls of slice_rows rows (as a model's layers make them;
    default one call a walk)."""
    ns, tile, tiles = native.lib(), native.consts().tile, W.view().tiles
    walk = walk_rows // tile if walk_rows else tiles
    part = slice_rows // tile if slice_rows else walk
    y = np.empty((acts.k, W.rows if part == tiles else part * tile), np.float32)
    secs = np.zeros(reps)
    rc = ns.bench_matmul(W.view(), walk, part, acts._acts, y, path, kernels._pool_ptr(pool), chunk, reps, secs,
                         first % max(1, tiles // walk))
    if rc:
        raise RuntimeError(f"bench_matmul failed with code {rc}")
    return list(secs)


def forward_samples(engine, tokens: np.ndarray, pos: int, reps: int) -> list[float]:
    """Seconds for each of reps passes over tokens at pos: one token's pass makes the last
    logits (a decode step), k tokens' every position's (a verification)."""
    ns = native.lib()
    k = tokens.size
    mode = native.consts().logits["last" if k == 1 else "all"]
    logits = np.zeros((k, engine.vocab), np.float32)
    secs = np.zeros(reps)
    rc = ns.bench_forward(engine._m, tokens, k, pos, mode, engine.pool._pool, engine.path_id, reps, secs, logits)
    if rc:
        raise RuntimeError(f"bench_forward failed with code {rc}")
    return list(secs)


def attention_samples(head_dim: int, group: int, k: int, context: int, path: int, reps: int) -> list[float]:
    """Seconds for each of reps calls of attention alone (one task, one thread): k tokens'
    `group` query heads against one KV head of `context` cached positions."""
    ns = native.lib()
    secs = np.zeros(reps)
    rc = ns.bench_attention(head_dim, group, k, context, path, reps, secs)
    if rc:
        raise RuntimeError(f"bench_attention refused head_dim {head_dim}, group {group}, k {k}, context {context}")
    return list(secs)


def fill(engine, context: int, *others) -> np.ndarray:
    """Puts the same `context` tokens in the cache of engine and each of `others` (random ids:
    attention's cost does not read them)."""
    ids = np.random.default_rng(0).integers(0, engine.vocab, context).astype(np.int32)
    for e in (engine, *others):
        e.forward(ids, 0, logits="none")
    return ids
