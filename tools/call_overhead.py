"""What a parallel call costs the engine beside its weight stream (docs/tuning.md, "Costs per
bandwidth state, and where the fast bus leaves decode").

1. An empty parallel_for on the pinned pool, and one whose workers first read 64 lines that
   thread 0 has just written (as a matmul's workers read its quantized activations): µs a call,
   the median of 7 batches of 20,000 calls, compiled by cling against the engine's own pool.
2. A 256 MB 4-bit matrix (the tuner's, 2,048 columns) walked from memory in calls on slices of
   16 KB to 16 MB, static halves, the sizes interleaved, each round between two reads of the
   read ceiling: per bus state (`--bands`, steady rounds only), each size's ms a walk, its share
   of the ceiling, and µs a call; the time over the largest slices' is what the calls cost.
   Where a hypervisor puts the two vCPUs on different dies, short calls lose there alone
   (docs/tuning.md, "Short calls, and the two cores' rates, in the fast state").

    .venv/bin/python tools/call_overhead.py [--threads N] [--rounds 5] [--bands 40]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import kernels, native, tune  # noqa: E402
from lab.protocol import band_edges, steady_bands  # noqa: E402

SLICES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]

TIMER = r"""
#include "threadpool.h"
#include <algorithm>
#include <chrono>
namespace lab_tools {
// Median µs a call over 7 batches of n calls; lines > 0: thread 0 writes that many lines before
// each call and every thread reads them inside it.
double parallel_for_us(lab::ThreadPool* pool, int n, int lines) {
    static float shared[16 * 256] __attribute__((aligned(64)));
    static volatile float sink;
    lab::PinScope pin(pool);
    double t[7];
    for (int rep = 0; rep < 7; rep++) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < 16 * lines; j += 16) shared[j] += 1.f;
            lab::for_range(pool, pool->size(), 0, [&](int, int, int) {
                float s = 0.f;
                for (int j = 0; j < 16 * lines; j += 16) s += shared[j];
                if (lines) sink = s;
            });
        }
        t[rep] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n * 1e6;
    }
    std::sort(t, t + 7);
    return t[3];
}
}
"""


def parallel_for_us(pool: kernels.Pool, calls: int, lines: int) -> float:
    """Median µs a call over 7 batches of `calls` (TIMER)."""
    import cppyy
    native.lib()
    if not hasattr(cppyy.gbl, "lab_tools"):
        cppyy.cppdef(TIMER)
    return float(cppyy.gbl.lab_tools.parallel_for_us(pool._pool, calls, lines))


def walks(b: "tune._Bench", rounds: int, progress: bool = True) -> list[dict]:
    """Per round: the read ceiling before and after (GB/s) and each slice size's seconds a walk."""
    from tqdm import tqdm
    out = []
    for r in tqdm(range(rounds), desc="walks", unit="round", disable=not progress, file=sys.stderr):
        before, secs = b.read_gbps(), {}
        for s in SLICES if r % 2 == 0 else SLICES[::-1]:
            secs[s] = float(np.median(b.slices(s, 0)))
        out.append({"read_before": before, "read_after": b.read_gbps(), "secs": secs})
    return out


def by_state(rounds: list[dict], edges: list[float], total: int) -> list[dict]:
    """The steady rounds by read ceiling: per band and slice size the median seconds a walk, its
    share of the ceiling and the µs a call."""
    out = []
    for lo, hi, mine, gbps in steady_bands(rounds, edges):
        sizes = {}
        for s in SLICES:
            med = float(np.median([r["secs"][s] for r in mine]))
            sizes[s] = {"secs": med, "share": total / med / 1e9 / gbps, "us_a_call": med / (total / s) * 1e6}
        out.append({"from_gbps": lo, "to_gbps": hi, "rounds": len(mine), "read_gbps": gbps, "sizes": sizes})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5, help="walks of every size (default 5)")
    ap.add_argument("--bands", type=band_edges, default="", help="read GB/s where one bus state ends and the next begins, e.g. 40")
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit("--rounds: a positive number")
    pool = kernels.Pool(a.threads)
    for lines in (0, 64):
        us = parallel_for_us(pool, 20000, lines)
        print(f"parallel_for on {pool.threads} threads, {lines:2d} lines thread 0 wrote: {us:.2f} us a call")
    b = tune._Bench(256, 3, a.threads)
    tile = int(native.lib().packed_nbytes(native.consts().formats["q4"], 16, tune.COLS))
    total = b.W["q4"].rows // 16 * tile
    rounds = walks(b, a.rounds)
    for band in by_state(rounds, a.bands, total):
        print(f"read {band['from_gbps']:g}-{band['to_gbps']:g} GB/s: {band['rounds']} of {a.rounds} rounds, "
              f"median {band['read_gbps']:.1f} GB/s")
        for s, x in band["sizes"].items():
            print(f"  slices of {s >> 10:6d} KB: walk {x['secs'] * 1e3:6.2f} ms, share of the ceiling {x['share']:.3f}, "
                  f"{total / s:6.0f} calls, {x['us_a_call']:7.2f} us a call")


if __name__ == "__main__":
    main()
