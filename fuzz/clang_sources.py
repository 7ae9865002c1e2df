"""Copies kernels_cpp/ for the clang fuzz build, translating GCC's target pragmas.

kernels_cpp/ marks its SIMD functions with GCC's pragmas (what lab/native.py compiles,
with g++):
    #pragma GCC push_options
    #pragma GCC target("avx2,fma,f16c")
    ...
    #pragma GCC pop_options
clang ignores `#pragma GCC target`, so the intrinsics inside would not compile. This
writes each source to OUT_DIR with those three lines replaced by clang's equivalent
(`#pragma clang attribute push(__attribute__((target("..."))), apply_to = function)` and
`#pragma clang attribute pop`), and `#pragma GCC unroll N` by clang's `#pragma unroll N`,
one line for one line, so file names and line numbers in
a sanitizer's stack trace are kernels_cpp/'s own. Any other GCC pragma is an error: the
fuzz build would otherwise quietly differ from the real one.

usage: python fuzz/clang_sources.py kernels_cpp OUT_DIR
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

TARGET = re.compile(r'^\s*#\s*pragma\s+GCC\s+target\s*\(\s*("[^"]*")\s*\)\s*$')
PUSH = re.compile(r"^\s*#\s*pragma\s+GCC\s+push_options\s*$")
POP = re.compile(r"^\s*#\s*pragma\s+GCC\s+pop_options\s*$")
UNROLL = re.compile(r"^(\s*)#\s*pragma\s+GCC\s+unroll\s+(\d+)\s*$")
OTHER = re.compile(r"^\s*#\s*pragma\s+GCC\b")


def translate(text: str, name: str) -> str:
    out, depth = [], 0
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        end = "\n" if line.endswith("\n") else ""
        if PUSH.match(line):
            out.append("// (fuzz build) " + line.strip() + end)
        elif m := TARGET.match(line):
            if depth:           # clang would apply only the outer region's target
                sys.exit(f"{name}:{n}: a target pragma inside another's region: close the outer one first")
            depth += 1
            out.append(f"#pragma clang attribute push(__attribute__((target({m.group(1)}))), apply_to = function)" + end)
        elif POP.match(line):
            if depth == 0:
                sys.exit(f"{name}:{n}: pop_options without a target pragma before it")
            depth -= 1
            out.append("#pragma clang attribute pop" + end)
        elif m := UNROLL.match(line):
            out.append(f"{m.group(1)}#pragma unroll {m.group(2)}" + end)
        elif OTHER.match(line):
            sys.exit(f"{name}:{n}: a GCC pragma the fuzz build does not translate: {line.strip()}")
        else:
            out.append(line)
    if depth:
        sys.exit(f"{name}: a target pragma without its pop_options")
    return "".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.exit(__doc__)
    src, dst = Path(argv[1]), Path(argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    wanted = {p.name for p in src.iterdir() if p.suffix in (".cpp", ".h", ".inc")}
    for stale in dst.iterdir():                 # a source removed upstream leaves the build too
        if stale.name not in wanted:
            stale.unlink()
    for name in sorted(wanted):
        new = translate((src / name).read_text(), name)
        out = dst / name
        if not out.exists() or out.read_text() != new:     # untouched files keep their mtime
            out.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
