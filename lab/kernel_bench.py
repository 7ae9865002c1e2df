"""Each kernel and k against the machine's ceilings (`lab bench kernels`): a DRAM-resident
matrix against the read ceiling, an L2-resident one against the dot-product issue peak; and
attention alone, the stage that grows with the context."""
from __future__ import annotations

import itertools
import os

import numpy as np

from . import kernels, native
from .ceilings import best_variant, dot_peak, dot_sampler
from .machine import machine
from .protocol import (attention_samples, flat, interleave, matmul_samples, paired_ratio, past_llc, read_buffer,
                       read_sampler, summary)

# Working sets: DRAM's, cycled through copies past the last-level cache (past_llc), streams from
# memory; L2's fits one core's 1 MB L2.
DRAM_SHAPE = {"q4": (57344, 8192), "q8": (30720, 8192)}     # about 264 and 267 MB
L2_SHAPE = {"q4": (256, 4096), "q8": (128, 4096)}            # about 590 and 557 KB
QUICK_DRAM_SHAPE = {"q4": (8192, 8192), "q8": (4096, 8192)}  # ~38 MB a walk


def kernel_records(fmt: str, shape, ks, pool: kernels.Pool, working_set: str, path: int,
                   peak_gmacs: float, rounds: int, reps: int, reader=None, chunk: int | str = "guided",
                   peak=None) -> list[dict]:
    """Times each k (interleaved); with `reader`, read-bandwidth samples ride in the same
    rounds and each share of bandwidth is a paired ratio. Shares of the issue peak are against
    `peak_gmacs`, or with `peak` (a `dot_sampler` riding in the same rounds) against the
    fastest of it and `peak_gmacs`, so a clock that rose during the run raises the peak too."""
    rows, cols = shape
    nbytes = int(native.lib().packed_nbytes(native.consts().formats[fmt], rows, cols))
    copies = -(-past_llc(nbytes) // nbytes) if working_set == "dram" else 1     # cycled, they stream from memory
    W = kernels.pack(kernels.random_qtensor(fmt, rows * copies, cols, seed=rows))
    rng = np.random.default_rng(0)
    acts = {k: kernels.Acts(rng.standard_normal((k, cols), dtype=np.float32), native.PATHS[path]) for k in ks}
    code = kernels.split_code(chunk)
    walks = itertools.count(0, reps)                # each call goes on round the cycle where the last stopped
    cands = {k: (lambda a=acts[k]: [nbytes / s / 1e9 for s in matmul_samples(W, a, pool, path, code, reps, rows,
                                                                               first=next(walks))])
             for k in ks}
    if reader:
        cands["read"] = reader
    if peak:
        cands["peak"] = peak
    samples = interleave(cands, rounds)
    top = max([peak_gmacs or 0.0, *flat(samples["peak"])]) if peak else peak_gmacs
    head = {"threads": pool.threads, "working_set": working_set, "rows": rows, "cols": cols,
            "weight_bytes": nbytes, "path": native.PATHS[path]}
    return [{"kernel": fmt, "k": k, **head, **_rates(samples, k, nbytes, rows * cols * k, top, pool.threads)}
            for k in ks]


def _rates(samples: dict, k: int, nbytes: int, macs: int, top: float | None, threads: int) -> dict:
    """One k's time, GB/s and GMAC/s, and its shares of the read ceiling and of the issue peak."""
    st = summary(flat(samples[k]))
    t = nbytes / st["median"] / 1e9
    share = paired_ratio(samples[k], samples["read"]) if "read" in samples else None
    return {"ms": t * 1e3, "ms_per_token": t * 1e3 / k,
            "gbps": st["median"], "gbps_iqr": st["iqr"], "gmacs": macs / t / 1e9,
            "read_gbps": float(np.median(flat(samples["read"]))) if share else None,
            "share_of_bandwidth": share["median"] if share else None,
            "share_of_bandwidth_iqr": share["iqr"] if share else None,
            "peak_gmacs": top, "share_of_peak": macs / t / 1e9 / (top * threads) if top else None}


def l2_records(fmt: str, ks, path: int, peak: dict, rounds: int, reps: int) -> list[dict]:
    """The kernel on an L2-resident matrix at one thread against the issue peak, whose best
    loop is timed again in the same rounds (`kernel_records`)."""
    rider = dot_sampler(peak["path"], best_variant(peak["variants"])["index"], 4_000_000, 3)
    return kernel_records(fmt, L2_SHAPE[fmt], ks, kernels.Pool(1), "l2", path, peak["gmacs"], rounds, reps, peak=rider)


ATTENTION_SHAPE = {"head_dim": 128, "group": 6}      # the 1.5B's: 12 query heads on 2 KV heads


def attention_records(path: int, contexts=(256, 2048), ks=(1, 4, 8), rounds: int = 5, reps: int = 20,
                      head_dim: int = ATTENTION_SHAPE["head_dim"], group: int = ATTENTION_SHAPE["group"]) -> list[dict]:
    """Attention alone on one thread, as one task of a pass runs it: k tokens' `group` query
    heads against one KV head of `context` cached positions (cache-resident), every (context, k)
    interleaved, in the products the path runs by default. GMAC/s counts the scores' and the
    values' multiply-adds."""
    from .engine import attention_mode
    products = attention_mode(path, None, head_dim)
    cells = [(c, k) for c in contexts for k in ks]
    samples = interleave({(c, k): (lambda c=c, k=k: attention_samples(head_dim, group, k, c, path, reps))
                          for c, k in cells}, rounds)
    out = []
    for c, k in cells:
        us = summary(flat(samples[c, k]))["median"] * 1e6
        out.append({"context": c, "k": k, "head_dim": head_dim, "group": group, "products": products, "us": us,
                    "gmacs": 2 * group * k * c * head_dim / us / 1e3})
    return out


def kernels_bench(ks=(1, 2, 4, 8, 16), fmts=("q4", "q8"), threads: int | None = None,
                  quick: bool = False, path: str | None = None) -> dict:
    """GMAC/s and GB/s of each kernel for each k: a DRAM-resident matrix at all threads,
    its read ceiling sampled in the same rounds; an L2-resident one at one thread against
    the dot-product issue peak (`dot_peak`), its best loop timed again in the same rounds.
    The kernels run with the engine's tuning, measured first as an Engine would if none is
    cached (LAB_TUNE=0: the defaults); `tuning` says which."""
    from . import tune
    tune.ensure()
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
    read_gbps = float(np.median([r["read_gbps"] for r in records if r["read_gbps"]]))
    for r in records:                                     # cache-resident: against the DRAM ceiling
        if r["share_of_bandwidth"] is None:
            r["share_of_bandwidth"] = r["gbps"] / read_gbps
    return {"machine": machine(), "path": native.PATHS[p], "threads": n, "tuning": tune.describe()["source"],
            "read_gbps": read_gbps, "dot_peak_gmacs": peak["gmacs"],
            "dot_peak_iqr": peak["gmacs_iqr"], "dot_peak_variant": peak["variant"],
            "dot_peak_variants": peak["variants"], "results": records,
            "attention": attention_records(p, rounds=3 if quick else 5)}
