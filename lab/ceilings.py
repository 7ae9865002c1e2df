"""The machine's two ceilings: read bandwidth (what decoding streams weights at) and the
dot-product issue peak (what the kernels compute at)."""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from . import kernels, native
from .machine import machine
from .protocol import READ_LOOPS, flat, interleave, read_buffer, summary


def _thread_counts(threads) -> list[int]:
    n = len(os.sched_getaffinity(0))
    return sorted(set(threads)) if threads else list(range(1, n + 1))


def _time(fn, reps: int) -> list[float]:
    secs = np.zeros(reps)
    fn(secs)
    return list(secs)


# The read loops, each its own kind (lab.protocol.READ_LOOPS: plain loads, each line asked for
# that many bytes ahead, a thread's slice in two streams): where one reads more, the chart shows it.
READ_KINDS = {", ".join(["read"] + ([f"{a} B ahead"] if a else []) + ([f"{s} streams"] if s > 1 else [])): (a, s)
              for a, s in READ_LOOPS}


def bandwidth(threads=None, mb: int = 512, rounds: int = 5, reps: int = 4) -> dict:
    """Read-only bandwidth of each READ_KINDS loop, copy and triad (GB/s) against thread count;
    the read ceiling, the fastest read. mb: the buffers' size, raised past the last-level cache
    (`read_buffer`; the result's buffer_mb)."""
    ns = native.lib()
    buf, _owner = read_buffer(mb << 20)               # at least mb, streaming from memory
    nbytes = buf.size
    n = nbytes // 4 // 3                              # copy/triad: three arrays, same footprint
    a, b, c = (kernels.aligned_empty((n,), np.float32) for _ in range(3))
    for arr in (a, b, c):
        arr.fill(1.0)
    pools = {t: kernels.Pool(t) for t in _thread_counts(threads)}
    cands = {}
    for t, pool in pools.items():
        p = pool._pool
        for kind, (ahead, streams) in READ_KINDS.items():
            cands[f"{kind}/{t}"] = lambda p=p, a=ahead, st=streams: _time(
                lambda s: ns.bench_read(buf, nbytes, p, reps, s, a, st), reps)
        cands[f"copy/{t}"] = lambda p=p: _time(lambda s: ns.bench_copy(a, b, n, p, reps, s), reps)
        cands[f"triad/{t}"] = lambda p=p: _time(lambda s: ns.bench_triad(a, b, c, n, p, reps, s), reps)
    for fn in cands.values():                         # warm-up: page faults, frequency
        fn()
    moved = {**dict.fromkeys(READ_KINDS, nbytes), "copy": 2 * 4 * n, "triad": 3 * 4 * n}   # STREAM's byte counts
    rows = [_rate_row(name, moved, secs) for name, secs in interleave(cands, rounds).items()]
    best = max((r for r in rows if r["kind"] in READ_KINDS), key=lambda r: r["gbps"])     # the fastest loop
    return {"machine": machine(), "buffer_mb": nbytes >> 20, "read_gbps": best["gbps"],
            "read_gbps_iqr": best["gbps_iqr"], "threads": best["threads"], "results": rows}


def _rate_row(name: str, moved: dict, secs: list[list[float]]) -> dict:
    """One "kind/threads" candidate's timings as GB/s: median, IQR and quartiles."""
    kind, t = name.split("/")
    st = summary([moved[kind] / s / 1e9 for s in flat(secs)])
    return {"kind": kind, "threads": int(t), "gbps": st["median"], "gbps_iqr": st["iqr"],
            "gbps_q1": st["q1"], "gbps_q3": st["q3"], "n": st["n"]}


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
