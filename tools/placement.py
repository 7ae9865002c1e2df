"""How far apart the engine's first two CPUs sit, against the read ceiling, round by round
(docs/tuning.md, "The fast bus state is two dies").

A virtual machine's vCPUs land where the hypervisor puts them, and may move. Each round reads
the ceiling on every thread, times a cache line's round trip between the pool's threads 0 and
1, and reads the ceiling again; rounds whose two reads agree within lab.protocol.UNSTEADY are
banded by their read. Two dies show as a round trip several times one die's, and as a higher
ceiling: each die brings its own link to memory.

    .venv/bin/python tools/placement.py [--rounds 150] [--bands 40] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import kernels  # noqa: E402
from lab.costs import READ_MB  # noqa: E402
from lab.protocol import band_edges, read_buffer, read_sampler, round_trip_ns, steady_bands  # noqa: E402

TRIPS = 100_000


def measure(rounds: int, read_mb: int = READ_MB, trips: int = TRIPS, progress: bool = True) -> list[dict]:
    """Per round: the read ceiling before and after (GB/s) and the round trip (ns)."""
    from tqdm import tqdm
    pool = kernels.Pool(None)
    if pool.threads < 2:
        raise SystemExit("one CPU: there is no second CPU to time a round trip to")
    buf, _owner = read_buffer(read_mb << 20)
    read = read_sampler(buf, pool)
    out = []
    for _ in tqdm(range(rounds), desc="placement", unit="round", disable=not progress, file=sys.stderr):
        before = float(np.median(read()))
        trip = round_trip_ns(pool, trips)
        out.append({"read_before": before, "round_trip_ns": trip, "read_after": float(np.median(read()))})
    return out


def bands(rounds: list[dict], edges: list[float]) -> list[dict]:
    """The steady rounds by read ceiling (lab.protocol.steady_bands): per band the
    median read and the round trip's median and quartiles."""
    out = []
    for lo, hi, mine, gbps in steady_bands(rounds, edges):
        trips = [r["round_trip_ns"] for r in mine]
        out.append({"from_gbps": lo, "to_gbps": hi, "rounds": len(mine), "read_gbps": gbps,
                    "round_trip_ns": float(np.median(trips)),
                    "round_trip_iqr": [float(np.percentile(trips, 25)), float(np.percentile(trips, 75))]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--bands", type=band_edges, default="40", help="read GB/s where one band ends and the next begins")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("--rounds: a positive number")
    rounds = measure(a.rounds)
    res = {"bands": bands(rounds, a.bands), "rounds": rounds}
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for b in res["bands"]:
        lo, hi = b["round_trip_iqr"]
        print(f"read {b['from_gbps']:g}-{b['to_gbps']:g} GB/s: {b['rounds']} steady rounds, median {b['read_gbps']:.1f} GB/s, "
              f"round trip {b['round_trip_ns']:.0f} ns (IQR {lo:.0f}-{hi:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
