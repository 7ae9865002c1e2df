"""The `lab` command.

  lab info                       this CPU, its kernel paths, and the native build
  lab models list|fetch NAME     the models the lab knows; get one into the cache
  lab bench bandwidth [--json]   read (and copy/triad) bandwidth against thread count
  lab bench kernels [--json]     each kernel and k against the read ceiling and issue peak
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import LabError


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


def cmd_info(args) -> int:
    from . import native
    info = native.cpu()
    info["library"] = str(native.build())
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"CPU           {info['model']} ({info['vendor']}), {info['logical_cpus']} logical CPUs")
    print(f"flags         {' '.join(f for f, on in info['flags'].items() if on)}")
    print(f"kernel paths  {', '.join(info['supported_paths'])} (active: {info['active_path']})")
    for op, path in info["kernels"].items():
        print(f"  {op:22s}{path}")
    print(f"library       {info['library']}")
    warning = native.warn_if_slow()
    if warning:
        print(f"note          {warning}")
    return 0


def _print_bandwidth(r: dict) -> None:
    print(f"{'kind':6s} {'threads':>7s} {'GB/s':>8s} {'IQR':>6s}")
    for x in sorted(r["results"], key=lambda x: (x["kind"], x["threads"])):
        print(f"{x['kind']:6s} {x['threads']:7d} {x['gbps']:8.1f} {x['gbps_iqr']:6.1f}")
    print(f"read ceiling: {r['read_gbps']:.1f} GB/s (IQR {r['read_gbps_iqr']:.1f}) "
          f"at {r['threads']} threads, {r['buffer_mb']} MB buffer")


def _print_kernels(r: dict) -> None:
    print(f"path {r['path']}, read ceiling {r['read_gbps']:.1f} GB/s, "
          f"dot peak {r['dot_peak_gmacs']:.0f} GMAC/s per thread")
    print(f"{'kernel':6s} {'set':4s} {'k':>3s} {'thr':>3s} {'ms':>9s} {'ms/tok':>9s} {'GMAC/s':>8s} "
          f"{'GB/s':>6s} {'%bw':>5s} {'%peak':>6s}")
    for x in r["results"]:
        bw = f"{100 * x['share_of_bandwidth']:5.0f}"
        print(f"{x['kernel']:6s} {x['working_set']:4s} {x['k']:3d} {x['threads']:3d} {x['ms']:9.3f} "
              f"{x['ms_per_token']:9.3f} {x['gmacs']:8.1f} {x['gbps']:6.1f} {bw} {100 * x['share_of_peak']:6.0f}")
    print("%bw: of the read ceiling (DRAM rows: paired with read passes in the same rounds); "
          "%peak: of the dot-product issue peak")


def cmd_bench(args) -> int:
    from . import bench
    if args.what == "bandwidth":
        r = bench.bandwidth(threads=args.threads, mb=args.mb or 512, rounds=args.rounds)
        show = _print_bandwidth
    else:
        r = bench.kernels_bench(ks=tuple(args.k), fmts=tuple(args.kernel), threads=args.threads[0] if args.threads else None,
                                quick=args.quick, path=args.path)
        show = _print_kernels
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        show(r)
    return 0


def cmd_models(args) -> int:
    from .models import registry
    if args.action == "list":
        rows = [registry.status(n) for n in registry.REGISTRY]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"cache: {registry.models_dir()}")
        for r in rows:
            size = f"{r['size'] / 1e6:9.1f} MB" if r["size"] else " " * 12
            state = "present" if r["present"] else "absent"
            check = " sha256 ok" if r["verified"] else ""
            print(f"{r['name']:20s} {state:8s}{size}{check}  {r['description']}")
        return 0
    for name in args.names:
        print(f"{name}: {registry.fetch(name)}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lab", description="Speculative decoding on a CPU: the lab's command.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="this CPU, its kernel paths and the native build")
    info.add_argument("--json", action="store_true")
    info.set_defaults(fn=cmd_info)

    m = sub.add_parser("models", help="the models the lab knows: list, fetch")
    m.add_argument("action", choices=["list", "fetch"])
    m.add_argument("names", nargs="*", help="models to fetch")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_models)

    b = sub.add_parser("bench", help="quick measurements, JSON out")
    b.add_argument("what", choices=["bandwidth", "kernels"])
    b.add_argument("--json", action="store_true", help="print machine-readable results")
    b.add_argument("--threads", type=_int_list, help="thread counts, e.g. 1,2 (kernels: the first)")
    b.add_argument("--mb", type=int, help="bandwidth buffer size in MB (default 512)")
    b.add_argument("--rounds", type=int, default=5, help="interleaved rounds (bandwidth)")
    b.add_argument("--k", type=_int_list, default=[1, 2, 4, 8, 16], help="token counts (kernels)")
    b.add_argument("--kernel", type=lambda s: s.split(","), default=["q4", "q8"], help="q4,q8")
    b.add_argument("--path", help="force a kernel path: scalar, avx2, avxvnni, avx512vnni")
    b.add_argument("--quick", action="store_true", help="smaller matrices and fewer repeats")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (LabError, ValueError, TypeError) as e:
        print(f"lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
