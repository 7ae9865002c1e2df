"""A pass (one token, or --k) against a tuning value, per bandwidth state (docs/tuning.md,
"Costs per bandwidth state, and where the fast bus leaves decode").

`lab tune` times its candidates in whichever state the bus is in while it runs; this asks
whether another state wants another value. Each round reads the ceiling (a 256 MB buffer, the
engine's threads), times a pass under every value of one Tuning field (the order
reversing each round), and reads the ceiling again. Rounds whose two reads agree within
UNSTEADY fall in the band of their read; per band: each value's median ms, its median
per-round ratio to the engine's default, and the pass's share of the read ceiling.

    .venv/bin/python tools/prefetch_states.py [--field prefetch_k1 --values 4096,8192,16384]
        [--rounds 120] [--bands 45,60] [--base prefetch_k1_q8=8192] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lab import tune  # noqa: E402
from lab.costs import READ_MB  # noqa: E402
from lab.engine import Engine  # noqa: E402
from lab.models.export import engine_file  # noqa: E402
from lab.protocol import UNSTEADY, band_edges, fill, forward_samples, read_buffer, read_sampler, steady_bands  # noqa: E402


def measure(engine, field: str, values: list, rounds: int, context: int, k: int = 1, read_mb: int = READ_MB,
            progress: bool = True, base: dict | None = None) -> list[dict]:
    """Per round: the read ceiling before and after (GB/s) and each value's ms a pass; the
    other fields as now, or as `base` says."""
    from tqdm import tqdm
    buf, _owner = read_buffer(read_mb << 20)
    read = read_sampler(buf, engine.pool)
    tokens = fill(engine, context)[-k:].astype(np.int32)
    restore, out = tune.current(), []
    base = {**restore, **(base or {})}
    try:
        for r in tqdm(range(rounds), desc="prefetch states", unit="round", disable=not progress, file=sys.stderr):
            before, ms = float(np.median(read())), {}
            for v in values if r % 2 == 0 else values[::-1]:
                tune.apply({**base, field: v})
                ms[v] = float(np.median(forward_samples(engine, tokens, context, 5))) * 1e3
            out.append({"read_before": before, "read_after": float(np.median(read())), "ms": ms})
    finally:
        tune.apply(restore)
    return out


def bands(rounds: list[dict], edges: list[float], default: int, weight_bytes: int) -> list[dict]:
    """The steady rounds by read ceiling: per band and value the median ms, the median ratio to
    `default` within a round, and the share of the ceiling."""
    out = []
    for lo, hi, mine, gbps in steady_bands(rounds, edges):
        rows = {v: {"ms": float(np.median([r["ms"][v] for r in mine])),
                    "ratio": float(np.median([r["ms"][v] / r["ms"][default] for r in mine]))} for v in sorted(mine[0]["ms"])}
        for x in rows.values():
            x["share"] = weight_bytes / (x["ms"] / 1e3) / 1e9 / gbps
        out.append({"from_gbps": lo, "to_gbps": hi, "rounds": len(mine), "read_gbps": gbps, "values": rows})
    return out


def parse_value(field: str, text: str):
    """A field's value from its text: false/true for a yes/no field, else a whole number."""
    if field not in tune.FIELDS:
        raise KeyError(field)
    return {"false": False, "true": True}[text] if field in tune.FLAGS else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--scheme", default="q4-q8out")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--k", type=int, default=1, help="tokens a pass (default 1: decode)")
    p.add_argument("--field", default="prefetch_k1", help="a Tuning field (lab.tune.FIELDS)")
    p.add_argument("--values", default="4096,8192,16384,32768", help="its values, comma-separated "
                   "(whole numbers, or false,true for a yes/no field); its default is always timed")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--bands", type=band_edges, default="45,60", help="read GB/s where one band ends and the next begins")
    p.add_argument("--base", default="", help="other fields' values for the sweep, e.g. prefetch_k1_q8=8192")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.field not in tune.FIELDS:
        raise SystemExit(f"--field: one of {', '.join(tune.FIELDS)}")
    try:
        values = [parse_value(a.field, x) for x in a.values.split(",")]
    except (KeyError, ValueError):
        raise SystemExit("--values: whole numbers (false,true for a yes/no field), comma-separated") from None
    try:
        base = {f: parse_value(f, v) for f, v in (x.split("=", 1) for x in a.base.split(",") if x)}
    except (KeyError, ValueError):
        raise SystemExit("--base: field=value pairs, comma-separated, of the fields in lab.tune.FIELDS") from None
    default = tune.defaults()[a.field]
    values = sorted({*values, default})
    if a.rounds < 1 or a.context < 1 or not 1 <= a.k <= a.context:
        raise SystemExit("--rounds and --context: positive numbers; --k: from 1 to the context")
    e = Engine(engine_file(a.model, a.scheme), threads=a.threads, max_context=a.context + 64)
    now = tune.current()
    try:
        for v in values:
            tune.apply({**now, **base, a.field: v})
    except ValueError as err:
        raise SystemExit(f"--values, --base: {err}") from None
    finally:
        tune.apply(now)
    rounds = measure(e, a.field, values, a.rounds, a.context, a.k, base=base)
    res = {"base": base, "model": a.model, "scheme": a.scheme, "context": a.context, "k": a.k, "threads": e.pool.threads,
           "field": a.field, "default": default, "bands": bands(rounds, a.bands, default, e.weight_bytes), "rounds": rounds}
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    steady = sum(b["rounds"] for b in res["bands"])
    print(f"{a.model} ({a.scheme}), {a.k}-token passes at context {a.context}, {e.pool.threads} threads: {steady} of {a.rounds} rounds "
          f"steady (the two reads within {UNSTEADY:.0%}); ratios against {a.field} = {str(default).lower()}")
    for b in res["bands"]:
        print(f"read {b['from_gbps']:g}-{b['to_gbps']:g} GB/s: {b['rounds']} rounds, median {b['read_gbps']:.1f} GB/s")
        for v, x in b["values"].items():
            print(f"  {str(v).lower():>6s}  {x['ms']:7.2f} ms  ratio {x['ratio']:.3f}  share of the ceiling {x['share']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
