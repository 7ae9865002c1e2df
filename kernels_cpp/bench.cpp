// bench.cpp — the measurements the lab's ceilings come from: read bandwidth (and STREAM
// copy/triad beside it), the dot-product issue peak, and timed kernel calls. Loops run in
// C++ so no Python lands in a timing.
#include <immintrin.h>

#include <atomic>
#include <cstring>

#include "clock.h"
#include "threadpool.h"

namespace lab {

namespace {

// Per-thread results each on their own cache line.
struct alignas(64) Slot {
    uint64_t v = 0;
};

// A pass must not be optimised away: every path folds what it read into a checksum.
uint64_t read_scalar(const uint8_t* p, int64_t n) {
    uint64_t a = 0, b = 0;
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        uint64_t x, y;
        std::memcpy(&x, p + i, 8);
        std::memcpy(&y, p + i + 8, 8);
        a ^= x;
        b += y;
    }
    return a ^ b;
}

#pragma GCC push_options
#pragma GCC target("avx2")
uint64_t read_avx2(const uint8_t* p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i*)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
    }
    const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(x, 0) ^ (uint64_t)_mm256_extract_epi64(x, 3);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f")
uint64_t read_avx512(const uint8_t* p, int64_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i + 256 <= n; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(p + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(p + i + 192));
    }
    const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(x);
}
#pragma GCC pop_options

using ReadFn = uint64_t (*)(const uint8_t*, int64_t);

ReadFn read_fn() {
    const CpuInfo c = cpu_info();
    if (c.avx512f && c.os_avx512) return read_avx512;
    if (c.avx2 && c.os_avx) return read_avx2;
    return read_scalar;
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

void bench_read(const uint8_t* buf, int64_t bytes, ThreadPool* pool, int reps, double* secs) {
    const ReadFn fn = read_fn();
    const int n = pool ? pool->size() : 1;
    Slot slots[64];
    timed_passes(pool, reps, secs, [&](int part, int tid) {
        const int64_t b = bytes * part / n / 256 * 256, e = bytes * (part + 1) / n / 256 * 256;
        slots[tid % 64].v ^= fn(buf + b, e - b);
    });
    uint64_t x = 0;
    for (auto& s : slots) x ^= s.v;
    g_sink = x;
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
// Issue peak: 16 independent chains of the path's dot-product instruction
// ----------------------------------------------------------------------------

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
double peak_avx512(int64_t iters, int width) {
    __m512i acc[16];
    const __m512i w = _mm512_set1_epi32((int)(g_sink | 0x01010101)), a = _mm512_set1_epi32(0x02020202);
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
    __m256i acc2[16];
    const __m256i w2 = _mm512_castsi512_si256(w), a2 = _mm512_castsi512_si256(a);
    for (int i = 0; i < 16; i++) acc2[i] = _mm256_set1_epi32(i);
    const double t0 = now();
    if (width == 512) {
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], w, a);
    } else {
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < 16; i++) acc2[i] = _mm256_dpbusd_epi32(acc2[i], w2, a2);
    }
    const double dt = now() - t0;
    __m512i x = acc[0];
    for (int i = 1; i < 16; i++) x = _mm512_add_epi32(x, acc[i]);
    for (int i = 0; i < 16; i++) x = _mm512_add_epi32(x, _mm512_castsi256_si512(acc2[i]));
    g_sink = (uint64_t)_mm512_reduce_add_epi32(x);
    return (double)iters * 16 * (width / 8) / dt;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avxvnni")
double peak_avxvnni(int64_t iters) {
    __m256i acc[12];
    const __m256i w = _mm256_set1_epi32((int)(g_sink | 0x01010101)), a = _mm256_set1_epi32(0x02020202);
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_epi32(i);
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], w, a);
    const double dt = now() - t0;
    __m256i x = acc[0];
    for (int i = 1; i < 12; i++) x = _mm256_add_epi32(x, acc[i]);
    g_sink = (uint64_t)_mm256_extract_epi32(x, 0);
    return (double)iters * 12 * 32 / dt;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
double peak_avx2(int64_t iters) {     // maddubs + madd + add: the AVX2 stand-in for vpdpbusd
    __m256i acc[8];
    const __m256i w = _mm256_set1_epi32((int)(g_sink | 0x01010101)), a = _mm256_set1_epi32(0x02020202);
    const __m256i one = _mm256_set1_epi16(1);
    for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_epi32(i);
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), one));
    const double dt = now() - t0;
    __m256i x = acc[0];
    for (int i = 1; i < 8; i++) x = _mm256_add_epi32(x, acc[i]);
    g_sink = (uint64_t)_mm256_extract_epi32(x, 0);
    return (double)iters * 8 * 32 / dt;
}
#pragma GCC pop_options

double peak_scalar(int64_t iters) {
    int32_t acc[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t w = (int32_t)(g_sink & 7) + 3;
    const double t0 = now();
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++) acc[i] += w * (int32_t)(it & 127);
    const double dt = now() - t0;
    int64_t s = 0;
    for (int i = 0; i < 8; i++) s += acc[i];
    g_sink = (uint64_t)s;
    return (double)iters * 8 / dt;
}

}  // namespace

double bench_dot_peak(int path, int64_t iters) {
    if (!path_supported(path)) return 0.0;
    switch (path) {
        case PATH_AVX512VNNI: return peak_avx512(iters, 512);
        case PATH_VNNI256_EVEX: return peak_avx512(iters, 256);
        case PATH_AVXVNNI: return peak_avxvnni(iters);
        case PATH_AVX2: return peak_avx2(iters);
        default: return peak_scalar(iters);
    }
}

int bench_matmul(const PackedMat& W, const QActs& A, float* y, int path, ThreadPool* pool, int chunk,
                 int reps, double* secs) {
    PinScope pin(pool);
    int rc = matmul(W, A, y, W.rows, path, pool, chunk);   // warm-up, and the argument check
    for (int r = 0; rc == MM_OK && r < reps; r++) {
        const double t0 = now();
        matmul(W, A, y, W.rows, path, pool, chunk);
        secs[r] = now() - t0;
    }
    return rc;
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
