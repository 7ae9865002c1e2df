"""Two versions of the attention kernel in one binary, timed alternately (docs/tuning.md).

A is the engine's own attention on the AVX-512 path with float products (`att512::attend`,
compiled from kernels_cpp/model.cpp as it stands); B is a variant of kernels_cpp/attend.inc — a
file of your own (--variant), or the engine's with one part left out (--drop
values|scores|softmax), which says what that part costs — or the engine's bf16 products
(--bf16: `att512::attend_bf16`, attend_bf16.inc). Each call of A and B takes one task of a pass: k tokens of the
1.5B's head shape (or --head's) against one KV head of --context positions, cache-resident, or with
--memory cycled over heads four times the last-level cache in all, so K and V come from
memory (over fewer, a large L3 serves them); first, the float peak the loops are
held against (16 chains of 512-bit FMAs). A and B alternate call by call,
which of them goes first alternating too; an identical B reads about 1.02 (B/A median).

    .venv/bin/python tools/attend_ab.py --drop values
    .venv/bin/python tools/attend_ab.py --variant my_attend.inc --memory
    .venv/bin/python tools/attend_ab.py --bf16
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lab import native  # noqa: E402

BUILD = ROOT / "build" / "attend_ab"
# The calls each part of attend.inc is made by (a task of one row group has its own); dropping
# a part puts `if (0)` before each.
PARTS = {"values": ("with_rows<VALUE_ROWS>(", "with_rows<Vec::DIRECT_ROWS>(R, [&](auto rows)"),
         "scores": ("with_rows<Vec::ROWS>(", "with_rows<Vec::DIRECT_ROWS>(R, [&](auto g)"),
         "softmax": ("softmax_rows(a, scores",)}

MAIN = r'''
#include "model.cpp"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace lab { namespace { namespace variant {
using Vec = att512::Vec;
#include "variant.inc"
} } }
#pragma GCC pop_options

#include <cstdio>
#include <cstdlib>
#include <span>

#ifndef B_ATTEND
#define B_ATTEND variant::attend
#endif

// The float peak the loops are held against: 16 independent chains of 512-bit FMAs, one thread.
#pragma GCC push_options
#pragma GCC target("avx512f")
static double fma_peak_gmacs(long n) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_ps(0.01f * (i + 1));
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    const double t0 = lab::now();
    for (long r = 0; r < n; r++)
        for (int i = 0; i < 16; i++) a[i] = _mm512_fmadd_ps(a[i], m, c);
    const double t = lab::now() - t0;
    float sink = 0;
    for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(a[i]);
    if (sink == 12345.f) std::printf(" ");              // the chains' results are used
    return 16.0 * 16 * n / t / 1e9;
}
#pragma GCC pop_options

int main(int argc, char** argv) {
    using namespace lab;
    const int n0 = std::atoi(argv[1]), calls = std::atoi(argv[2]), D = std::atoi(argv[4]), group = std::atoi(argv[5]);
    const size_t set_bytes = std::strtoull(argv[3], nullptr, 10);
    double peak = 0;
    for (int r = 0; r < 5; r++) peak = std::max(peak, fma_peak_gmacs(20000000));
    std::printf("float FMA peak, one thread: %.1f G multiply-adds a second (the best of 5)\n", peak);
    for (int tokens : {1, 5, 8}) {
        const int n = n0 + tokens - 1, R = group * tokens;
        const size_t cached = (size_t)k_cache_positions(n) * D;
        // memory mode: enough heads that their K and V fill set_bytes; else one, cache-resident
        const size_t heads = std::max<size_t>(1, (set_bytes + 4 * cached - 1) / (4 * cached));
        Buffer KB((int64_t)(2 * cached * heads)), VB((int64_t)(2 * cached * heads));   // on 2 MB pages, as the engine's
        const std::span<uint16_t> K((uint16_t*)KB.data(), cached * heads), V((uint16_t*)VB.data(), cached * heads);
        std::vector<float> q((size_t)R * D), out((size_t)R * D), scratch(att_scratch_floats(R, n, D));
        Rng rng(1);
        for (auto& x : K) x = fp32_to_fp16((float)(2 * rng.uniform() - 1));
        for (auto& x : V) x = fp32_to_fp16((float)(2 * rng.uniform() - 1));
        for (auto& x : q) x = (float)(2 * rng.uniform() - 1);
        float* buf = att_buffer(scratch.data(), R, n);
        const Queries a{q.data(), (size_t)group * D, out.data(), (size_t)group * D, group, tokens, n0, D};
        std::vector<double> ta, tb, ratio;
        for (int c = 0; c < calls; c++) {
            double t[2];
            for (int w = 0; w < 2; w++) {
                const bool a_now = (c + w) % 2 == 0;
                const size_t h = (size_t)((2 * c + w) % heads) * cached;
                const double t0 = now();
                (a_now ? att512::attend : B_ATTEND)(a, K.data() + h, V.data() + h, 0.088f, scratch.data(), buf);
                t[a_now ? 0 : 1] = now() - t0;
            }
            ta.push_back(t[0]);
            tb.push_back(t[1]);
            ratio.push_back(t[1] / t[0]);
        }
        for (auto* v : {&ta, &tb, &ratio}) std::sort(v->begin(), v->end());
        const auto at = [&](const std::vector<double>& v, double f) { return v[(size_t)(f * (v.size() - 1))]; };
        const double macs = 2.0 * R * n0 * D;
        std::printf("k=%d  A min %.0f median %.0f us (%.0f GMAC/s at its fastest) | B min %.0f median %.0f us | "
                    "B/A median %.3f (IQR %.3f-%.3f) | K and V over %zu heads, %.3f MB\n", tokens, ta[0] * 1e6,
                    at(ta, .5) * 1e6, macs / ta[0] / 1e9, tb[0] * 1e6, at(tb, .5) * 1e6, at(ratio, .5), at(ratio, .25),
                    at(ratio, .75), heads, 4.0 * cached * heads / 1e6);
    }
}
'''


def variant_source(variant: Path | None, drop: str | None) -> str:
    src = (variant or native.SOURCE_DIR / "attend.inc").read_text()
    if drop:
        for call in PARTS[drop]:
            if src.count(call) != 1:
                raise SystemExit(f"--drop {drop}: attend.inc no longer makes that part by one `{call}` call; "
                                 f"update PARTS in {Path(__file__).name}")
            src = src.replace(call, "if (0) " + call)
    return src


def build(variant_src: str, defines: tuple[str, ...] = ()) -> Path:
    """The binary for this variant and these sources (cached by their content)."""
    others = sorted(p for p in native.SOURCE_DIR.glob("*.cpp") if p.name != "model.cpp")
    key = hashlib.sha256(variant_src.encode() + MAIN.encode() + "".join(defines).encode() + b"".join(
        p.read_bytes() for p in sorted(native.SOURCE_DIR.iterdir()) if p.is_file())).hexdigest()[:16]
    exe = BUILD / f"attend_ab-{key}"
    if exe.exists():
        return exe
    BUILD.mkdir(parents=True, exist_ok=True)
    (BUILD / "variant.inc").write_text(variant_src)
    (BUILD / "main.cpp").write_text(MAIN)
    flags = [f for f in native.flags() if f not in ("-fPIC", "-shared")]
    cmd = [native.compiler(), *flags, *defines, f"-I{BUILD}", f"-I{native.SOURCE_DIR}", str(BUILD / "main.cpp"),
           *map(str, others), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"the A/B binary did not build:\n{r.stderr[-4000:]}")
    return exe


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0, from sysfs (256 MB where sysfs does not say)."""
    texts = [f.read_text().strip() for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    return max((int(t[:-1]) << 10 for t in texts if t.endswith("K") and t[:-1].isdigit()), default=256 << 20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--variant", type=Path, help="B: this attend.inc instead of the engine's")
    g.add_argument("--drop", choices=sorted(PARTS), help="B: the engine's attend.inc without this part")
    g.add_argument("--bf16", action="store_true", help="B: the engine's attention with bf16 products")
    p.add_argument("--context", type=int, default=2048, help="cached positions (default 2048)")
    p.add_argument("--calls", type=int, default=400, help="calls of each version per k (default 400)")
    p.add_argument("--head", default="128x6", help="head_dim x query heads per KV head (default 128x6, the "
                   "1.5B's; the 0.5B draft's: 64x7)")
    p.add_argument("--memory", action="store_true",
                   help="cycle K and V over heads four times the last-level cache, so they come from memory")
    a = p.parse_args(argv)
    if "avx512vnni" not in native.supported_paths():
        raise SystemExit("this CPU lacks the AVX-512 path whose attention the A/B times")
    D, _, group = a.head.partition("x")
    if a.context < 1 or a.calls < 1 or not (D.isdigit() and group.isdigit() and int(D) % 16 == 0 and int(group) >= 1):
        raise SystemExit("--context and --calls: give positive numbers; --head: DxG, D a multiple of 16")
    exe = build(variant_source(a.variant, a.drop), ("-DB_ATTEND=att512::attend_bf16",) if a.bf16 else ())
    out = subprocess.run([str(exe), str(a.context), str(a.calls), str(4 * last_level_cache_bytes() if a.memory else 0), D, group],
                         capture_output=True, text=True, check=True).stdout
    print(out, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
