"""The measuring protocol (SCIENCE.md §4) and the benchmarks built on it.

Warm up; interleave the things compared (A B A B ...); report medians with the
interquartile range; measure the ceiling in the same run as what is compared with it;
record the machine with every result.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np

from . import kernels, native
from .formats import QK

ROOT = Path(__file__).resolve().parent.parent


def summary(samples) -> dict:
    """Median and interquartile range of a list of timings (or rates)."""
    a = np.asarray(samples, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "iqr": float(q3 - q1), "n": int(a.size)}


def interleave(candidates: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Run each candidate once per round, in turn (A B A B ...), collecting its samples."""
    out: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            out[name].extend(fn())
    return out


def commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    """What every result is recorded with."""
    c = native.cpu()
    return {
        "cpu": c["model"], "vendor": c["vendor"], "logical_cpus": c["logical_cpus"],
        "flags": [f for f, on in c["flags"].items() if on], "hybrid": c["flags"]["hybrid"],
        "kernel_path": c["active_path"], "python": platform.python_version(),
        "commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


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
    buf = kernels.aligned_empty((nbytes,), np.uint8)
    ns.fill_random(buf, nbytes, 1)
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
        rates = [moved[kind] / s / 1e9 for s in secs]
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

def dot_peak(path: str | None = None, iters: int = 2_000_000, reps: int = 7) -> dict:
    """The dot-product instruction's issue peak on one thread, in int8 GMAC/s."""
    ns = native.lib()
    p = native.path_id(path)
    ns.bench_dot_peak(p, iters // 10)
    st = summary([ns.bench_dot_peak(p, iters) / 1e9 for _ in range(reps)])
    return {"path": native.PATHS[p], "gmacs": st["median"], "gmacs_iqr": st["iqr"]}


# Working sets: DRAM is far past the 32 MB last-level cache; L2 fits one core's 1 MB L2.
DRAM_SHAPE = {"q4": (57344, 8192), "q8": (30720, 8192)}     # about 264 and 267 MB
L2_SHAPE = {"q4": (256, 4096), "q8": (128, 4096)}            # about 590 and 557 KB
QUICK_DRAM_SHAPE = {"q4": (8192, 8192), "q8": (4096, 8192)}  # ~38 MB: still past the LLC


def _matmul_samples(W, acts, pool, path, chunk, reps):
    ns = native.lib()
    y = np.empty((acts.k, W.rows), np.float32)
    secs = np.zeros(reps)
    rc = ns.bench_matmul(kernels.qmat(W), acts._acts, y, path, kernels._pool_ptr(pool), chunk, reps, secs)
    if rc:
        raise RuntimeError(f"bench_matmul failed with code {rc}")
    return list(secs)


def kernel_records(fmt: str, shape, ks, pool: kernels.Pool, working_set: str, path: int,
                   peak_gmacs: float, read_gbps: float, rounds: int, reps: int, chunk: int = 0) -> list[dict]:
    rows, cols = shape
    W = kernels.random_qtensor(fmt, rows, cols, seed=rows)
    rng = np.random.default_rng(0)
    acts = {k: kernels.Acts(rng.standard_normal((k, cols), dtype=np.float32), native.PATHS[path]) for k in ks}
    cands = {k: (lambda a=acts[k]: _matmul_samples(W, a, pool, path, chunk, reps)) for k in ks}
    samples = interleave(cands, rounds)
    out = []
    for k, secs in samples.items():
        st = summary(secs)
        t = st["median"]
        gmacs = rows * cols * k / t / 1e9
        gbps = W.nbytes / t / 1e9
        out.append({
            "kernel": fmt, "k": k, "threads": pool.threads, "working_set": working_set,
            "rows": rows, "cols": cols, "weight_bytes": W.nbytes, "path": native.PATHS[path],
            "ms": t * 1e3, "ms_iqr": st["iqr"] * 1e3, "ms_per_token": t * 1e3 / k,
            "gmacs": gmacs, "gbps": gbps,
            "share_of_bandwidth": gbps / read_gbps if read_gbps else None,
            "share_of_peak": gmacs / (peak_gmacs * pool.threads) if peak_gmacs else None,
        })
    return out


def kernels_bench(ks=(1, 2, 4, 8, 16), fmts=("q4", "q8"), threads: int | None = None,
                  quick: bool = False, path: str | None = None) -> dict:
    """GMAC/s and GB/s of each kernel for each k, against the read ceiling and issue peak
    measured in the same run: DRAM-resident matrix at all threads, L2-resident at one."""
    p = native.path_id(path)
    n = threads or len(os.sched_getaffinity(0))
    bw = bandwidth(threads=[n], mb=256 if quick else 512, rounds=3 if quick else 5)
    peak = dot_peak(native.PATHS[p], iters=300_000 if quick else 2_000_000)
    rounds, reps = (3, 2) if quick else (7, 3)
    pool_all, pool_one = kernels.Pool(n), kernels.Pool(1)
    records = []
    for fmt in fmts:
        dram = (QUICK_DRAM_SHAPE if quick else DRAM_SHAPE)[fmt]
        records += kernel_records(fmt, dram, ks, pool_all, "dram", p, peak["gmacs"], bw["read_gbps"], rounds, reps)
        records += kernel_records(fmt, L2_SHAPE[fmt], ks, pool_one, "l2", p, peak["gmacs"], bw["read_gbps"],
                                  rounds * 3, reps * 5)
    return {"machine": machine(), "path": native.PATHS[p], "threads": n,
            "read_gbps": bw["read_gbps"], "read_gbps_iqr": bw["read_gbps_iqr"],
            "dot_peak_gmacs": peak["gmacs"], "dot_peak_iqr": peak["gmacs_iqr"],
            "results": records}
