// bench.cpp — the measurements the lab's ceilings come from: read bandwidth (and STREAM
// copy/triad beside it), the dot-product issue peak, and timed kernel calls. Loops run in
// C++ so no Python lands in a timing.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "clock.h"
#include "threadpool.h"

namespace lab {

namespace {

// Per-thread results each on their own cache line.
struct alignas(64) Slot {
    uint64_t v = 0;
};

// Calls step(q) on each STEP bytes of [p, p + n) in S streams: S equal parts (whole steps), a
// step of each in turn, then what is left in one. Each path's loop passes its own step, defined
// under its target, so the step's loads and requests are that path's.
template <int S, int STEP, class F>
__attribute__((always_inline)) inline void in_streams(const uint8_t* p, int64_t n, F&& step) {
    const int64_t part = n / S / STEP * STEP;
    for (int64_t i = 0; i + STEP <= part; i += STEP)
        for (int s = 0; s < S; s++) step(p + s * part + i);
    for (int64_t i = S * part; i + STEP <= n; i += STEP) step(p + i);
}

// A pass must not be optimised away: every path folds what it read into a checksum. With
// `ahead`, each line is asked for into L1 that many bytes before it is read.
template <int S>
uint64_t read_scalar(const uint8_t* p, int64_t n, int64_t ahead) {
    uint64_t a = 0, b = 0;
    in_streams<S, 16>(p, n, [&](const uint8_t* q) {
        uint64_t x, y;
        if (ahead && (uintptr_t)q % 64 == 0) __builtin_prefetch(q + ahead, 0, 3);
        std::memcpy(&x, q, 8);
        std::memcpy(&y, q + 8, 8);
        a ^= x;
        b += y;
    });
    return a ^ b;
}

#pragma GCC push_options
#pragma GCC target("avx2")
template <int S>
uint64_t read_avx2(const uint8_t* p, int64_t n, int64_t ahead) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    in_streams<S, 128>(p, n, [&](const uint8_t* q) {
        if (ahead) {
            __builtin_prefetch(q + ahead, 0, 3);
            __builtin_prefetch(q + ahead + 64, 0, 3);
        }
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i*)(q)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i*)(q + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i*)(q + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i*)(q + 96)));
    });
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(x, 0) ^ (uint64_t)_mm256_extract_epi64(x, 3);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f")
template <int S>
uint64_t read_avx512(const uint8_t* p, int64_t n, int64_t ahead) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    in_streams<S, 256>(p, n, [&](const uint8_t* q) {
        if (ahead)
            for (int j = 0; j < 256; j += 64) __builtin_prefetch(q + ahead + j, 0, 3);
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(q));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(q + 64));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(q + 128));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(q + 192));
    });
    const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(x);
}
#pragma GCC pop_options

using ReadFn = uint64_t (*)(const uint8_t*, int64_t, int64_t);

template <int S>
ReadFn read_fn() {
    const CpuInfo c = cpu_info();
    if (c.avx512f && c.os_avx512) return read_avx512<S>;
    if (c.avx2 && c.os_avx) return read_avx2<S>;
    return read_scalar<S>;
}

volatile uint64_t g_sink;

// Splits [0, n) into one 256-byte-aligned slice per thread and times `reps` passes.
template <class F>
void timed_passes(ThreadPool* pool, int reps, double* secs, F&& pass) {
    PinScope pin(pool);
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for_range(pool, pool ? pool->size() : 1, 1, [&](int b, int, int tid) { pass(b, tid); });
        secs[r] = now() - t0;
    }
}

}  // namespace

int bench_read(const uint8_t* buf, int64_t bytes, ThreadPool* pool, int reps, double* secs, int64_t ahead,
               int streams) {
    if (streams != 1 && streams != 2) return 1;
    const ReadFn fn = streams == 2 ? read_fn<2>() : read_fn<1>();
    const int n = pool ? pool->size() : 1;
    Slot slots[64];
    timed_passes(pool, reps, secs, [&](int part, int tid) {
        const int64_t b = bytes * part / n / 256 * 256, e = bytes * (part + 1) / n / 256 * 256;
        slots[tid % 64].v ^= fn(buf + b, e - b, ahead);
    });
    uint64_t x = 0;
    for (auto& s : slots) x ^= s.v;
    g_sink = x;
    return 0;
}

double bench_round_trip(ThreadPool* pool, int n) {
    if (!pool || pool->size() < 2 || n < 1) return 0;
    alignas(64) std::atomic<int> flag{0};
    double secs = 0;
    PinScope pin(pool);
    // one item per thread (a static split): thread 0 sends 2i + 1, thread 1 answers 2i + 2;
    // the clock starts after the first round trip, which waits for thread 1 to wake
    for_range(pool, pool->size(), 0, [&](int, int, int tid) {
        if (tid > 1) return;
        double t0 = 0;
        for (int i = 0; i <= n; i++) {
            const int ask = 2 * i + 1, answer = 2 * i + 2;
            if (tid == 0) flag.store(ask, std::memory_order_release);
            while (flag.load(std::memory_order_acquire) != (tid == 0 ? answer : ask)) _mm_pause();
            if (tid == 1) flag.store(answer, std::memory_order_release);
            if (i == 0) t0 = now();
        }
        if (tid == 0) secs = now() - t0;
    });
    return secs / n * 1e9;
}

void bench_copy(float* dst, const float* src, int64_t n, ThreadPool* pool, int reps, double* secs) {
    const int nt = pool ? pool->size() : 1;
    timed_passes(pool, reps, secs, [&](int part, int) {
        const int64_t b = n * part / nt, e = n * (part + 1) / nt;
        std::memcpy(dst + b, src + b, (e - b) * sizeof(float));
    });
}

void bench_triad(float* a, const float* b, const float* c, int64_t n, ThreadPool* pool, int reps, double* secs) {
    const int nt = pool ? pool->size() : 1;
    timed_passes(pool, reps, secs, [&](int part, int) {
        const int64_t lo = n * part / nt, hi = n * (part + 1) / nt;
        for (int64_t i = lo; i < hi; i++) a[i] = b[i] + 3.0f * c[i];
    });
}

// ----------------------------------------------------------------------------
// Issue peak: the path's dot-product instruction issued every way a kernel could
// ----------------------------------------------------------------------------
// A variant is one loop of independent chains of one instruction form at one register
// width; the path's peak is its best variant, since no kernel issues faster than the core's
// best loop. Each instruction is written in asm, so every loop issues exactly what its name says.

namespace {

struct Variant {
    std::string name;              // "op/width/form/chains"
    double (*run)(int64_t n);      // MAC/s over about n dot-product instructions
};

std::string variant_name(const char* op, int width, const char* form, int chains) {
    return std::string(op) + "/" + std::to_string(width) + "/" + form + "/" + std::to_string(chains);
}

// The activation bytes the broadcast forms read (L1-resident, never written). The asm takes
// their address in a register, not as an "m" operand, which would keep every chain in memory.
alignas(64) int8_t g_act[64];

// Folds the chains into g_sink, so none is dead code (summed in registers: an array whose
// address escaped would keep the chains in memory).
template <class V, int C>
inline void keep(const V (&acc)[C]) {
    V s = acc[0];
    for (int i = 1; i < C; i++) s += acc[i];
    uint64_t x = 0;
    std::memcpy(&x, &s, sizeof s < sizeof x ? sizeof s : sizeof x);     // every chain reaches lane 0
    g_sink = x;
}

// In every loop below each chain must live in its own register: the chain loop is unrolled
// by pragma (GCC stops at 16 by itself), and each chain goes through a local around its asm,
// since an asm writing an array element straight in keeps the whole array in memory.

// The scalar reference's multiply-add: one imul and one add per MAC, each chain in its
// own general register (the empty asm keeps the compiler from vectorising the chains).
template <int C>
double dot_scalar(int64_t n) {
    uint32_t acc[C], w = 3, x = 5;
    for (int i = 0; i < C; i++) acc[i] = i;
    asm("" : "+r"(w), "+r"(x));
    const int64_t iters = n / C;
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 32
        for (int i = 0; i < C; i++) {
            uint32_t s = acc[i] * w + x;
            asm("" : "+r"(s));
            acc[i] = s;
        }
    const double dt = now() - t0;
    keep(acc);
    return (double)iters * C / dt;
}

template <int... C>
void add_scalar(std::vector<Variant>& out) {
    (out.push_back({variant_name("imul", 32, "reg", C), dot_scalar<C>}), ...);
}

#pragma GCC push_options
#pragma GCC target("avx2")
// The AVX2 stand-in for vpdpbusd: maddubs + madd + add per 32 MACs; PAIR is the 4-bit
// kernels' form, two maddubs summed in int16 before one madd, per 64 MACs.
template <int C, bool PAIR>
double dot_avx2(int64_t n) {
    __m256i acc[C], w = {}, a = {}, one = {};
    for (int i = 0; i < C; i++) acc[i] = _mm256_set1_epi32(i);
    asm("" : "+x"(w), "+x"(a), "+x"(one));
    const int64_t iters = n / C;
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 32
        for (int i = 0; i < C; i++) {
            __m256i s = acc[i], t, u;
            if constexpr (PAIR)
                asm("vpmaddubsw %4, %3, %1\n\tvpmaddubsw %4, %3, %2\n\tvpaddw %2, %1, %1\n\t"
                    "vpmaddwd %5, %1, %1\n\tvpaddd %1, %0, %0"
                    : "+x"(s), "=&x"(t), "=&x"(u) : "x"(w), "x"(a), "x"(one));
            else
                asm("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"
                    : "+x"(s), "=&x"(t) : "x"(w), "x"(a), "x"(one));
            acc[i] = s;
        }
    const double dt = now() - t0;
    keep(acc);
    return (double)iters * C * (PAIR ? 64 : 32) / dt;
}

template <bool PAIR, int... C>
void add_avx2(std::vector<Variant>& out) {
    (out.push_back({variant_name(PAIR ? "maddubs-pair" : "maddubs", 256, "reg", C), dot_avx2<C, PAIR>}), ...);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avxvnni")
// The VEX vpdpbusd of AVX-VNNI: 16 registers, and no broadcast operand (a separate broadcast
// load would only add an instruction, never speed the loop).
template <int C>
double dot_vex(int64_t n) {
    __m256i acc[C], w = {}, a = {};
    for (int i = 0; i < C; i++) acc[i] = _mm256_set1_epi32(i);
    asm("" : "+x"(w), "+x"(a));
    const int64_t iters = n / C;
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 32
        for (int i = 0; i < C; i++) {
            __m256i s = acc[i];
            asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(s) : "x"(w), "x"(a));
            acc[i] = s;
        }
    const double dt = now() - t0;
    keep(acc);
    return (double)iters * C * 32 / dt;
}

template <int... C>
void add_vex(std::vector<Variant>& out) {
    (out.push_back({variant_name("vpdpbusd-vex", 256, "reg", C), dot_vex<C>}), ...);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
// The EVEX vpdpbusd on zmm (V = __m512i) or ymm: acc += w . a, the four activation bytes
// from a register or broadcast by the instruction's own memory operand ({1toN}), the form
// matmul.cpp's dpbusd_bcst issues.
template <class V, int C, bool BCST>
double dot_evex(int64_t n) {
    V acc[C], w = {}, a = {};
    for (int i = 0; i < C; i++) acc[i] = V{} + i;
    asm("" : "+v"(w), "+v"(a));
    const int64_t iters = n / C;
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
#pragma GCC unroll 32
        for (int i = 0; i < C; i++) {
            V s = acc[i];
            if constexpr (!BCST)
                asm("vpdpbusd %2, %1, %0" : "+v"(s) : "v"(w), "v"(a));
            else if constexpr (sizeof(V) == 64)
                asm("vpdpbusd (%2)%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "r"(g_act));
            else
                asm("vpdpbusd (%2)%{1to8%}, %1, %0" : "+v"(s) : "v"(w), "r"(g_act));
            acc[i] = s;
        }
    const double dt = now() - t0;
    keep(acc);
    return (double)iters * C * sizeof(V) / dt;      // one MAC per byte of the register
}

// 32 registers: the weights, the activations (register form) and up to 30 chains.
template <class V, bool BCST, int... C>
void add_evex_form(std::vector<Variant>& out) {
    (out.push_back({variant_name("vpdpbusd", 8 * sizeof(V), BCST ? "bcst" : "reg", C), dot_evex<V, C, BCST>}), ...);
}

void add_evex(std::vector<Variant>& out, int width) {
    if (width == 512) {
        add_evex_form<__m512i, false, 4, 8, 12, 16, 24, 30>(out);
        add_evex_form<__m512i, true, 4, 8, 12, 16, 24, 30>(out);
    } else {
        add_evex_form<__m256i, false, 4, 8, 12, 16, 24, 30>(out);
        add_evex_form<__m256i, true, 4, 8, 12, 16, 24, 30>(out);
    }
}
#pragma GCC pop_options

// Each path's loops: the instructions its kernels may issue, at the widths it has, with up
// to as many chains as registers allow (16 under VEX, less w, a and temporaries).
const std::vector<Variant>& variants(int path) {
    static const auto table = [] {
        std::vector<std::vector<Variant>> t(PATH_COUNT);
        add_scalar<4, 8, 10>(t[PATH_SCALAR]);
        add_avx2<false, 4, 8, 12>(t[PATH_AVX2]);
        add_avx2<true, 4, 8, 10>(t[PATH_AVX2]);
        add_vex<4, 8, 12, 14>(t[PATH_AVXVNNI]);
        add_evex(t[PATH_AVX512VNNI], 512);
        add_evex(t[PATH_AVX512VNNI], 256);
        add_evex(t[PATH_VNNI256_EVEX], 256);
        return t;
    }();
    return table[path];
}

}  // namespace

const char* dot_variant(int path, int v) {
    if (path < 0 || path >= PATH_COUNT || v < 0 || v >= (int)variants(path).size()) return "";
    return variants(path)[v].name.c_str();
}

double bench_dot_variant(int path, int v, int64_t n) {
    if (!path_supported(path) || !*dot_variant(path, v)) return 0.0;
    return variants(path)[v].run(n);
}

double bench_dot_peak(int path, int64_t n) {
    double best = 0.0;
    for (int v = 0; *dot_variant(path, v); v++) best = std::max(best, bench_dot_variant(path, v, n));
    return best;
}

int bench_forward(Model& m, const int32_t* tokens, int k, int pos, int mode, ThreadPool* pool,
                  int path, int reps, double* secs, float* logits) {
    PinScope pin(pool);
    int rc = m.forward(tokens, k, pos, logits, mode, nullptr, pool, path);
    for (int r = 0; rc == E_OK && r < reps; r++) {
        const double t0 = now();
        rc = m.forward(tokens, k, pos, logits, mode, nullptr, pool, path);
        secs[r] = now() - t0;
    }
    return rc;
}

void fill_random(uint8_t* buf, int64_t n, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        std::memcpy(buf + i, &s, 8);
    }
    for (; i < n; i++) buf[i] = (uint8_t)(s >> (8 * (i & 7)));
}

}  // namespace lab
