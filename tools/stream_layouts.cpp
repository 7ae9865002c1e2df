// stream_layouts.cpp — one core's (and two cores') rate through a 4-bit matrix in two layouts:
// "split", the tiles' scales in a region apart from their bytes (two streams, the engine's
// layout before file version 2), and "pairs", each pair of blocks a line of scales and then
// its bytes (one stream, the layout now). Each walk is the one-token kernel's work (unpack,
// vpdpbusd, scale, accumulate) or its loads alone, with no software prefetch or 8 KB ahead
// into L1; the pairs' loads alone are a plain read of one stream, the ceiling. Rounds interleave every walk;
// medians in GB/s of the matrix's bytes. docs/tuning.md, "One stream", has a Zen 4's answers.
//   g++ -O3 -march=native -pthread tools/stream_layouts.cpp -o /tmp/layouts && /tmp/layouts 30
#include <immintrin.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

constexpr int NB = 48;                     // blocks a row: the 1.5B's 1536 columns
constexpr int64_t TILES = 8192;            // 16 rows each: 113 MB, past any last-level cache
constexpr int64_t BLOCKS = NB * TILES;
constexpr int64_t BYTES = BLOCKS * (256 + 32);     // a block: 16 rows of 16 bytes, 16 fp16 scales

uint8_t *Q, *D;                            // the bytes (or the pairs), and the split layout's scales
alignas(64) int8_t A[NB * 32];
alignas(64) float AD[NB];
alignas(64) int32_t CORR[NB];
alignas(64) float Y[TILES * 16];

// On 2 MB pages, as the engine's weights are.
static uint8_t* big(size_t n) {
    n = (n + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    auto* p = (uint8_t*)aligned_alloc(2u << 20, n);
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0x37, n);
    return p;
}

static inline __m512i dp(__m512i s, __m512i w, const int8_t* a) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*(const int32_t*)a));
    return s;
}

// Tiles t0..t1 in one layout: the kernel's work (LOADS false) or its loads alone.
template <bool PAIRS, bool LOADS>
static void walk(int64_t ahead, int64_t t0, int64_t t1) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int64_t t = t0; t < t1; t++) {
        __m512 acc = _mm512_setzero_ps();
        __m512i x0 = _mm512_setzero_si512();
        for (int b = 0; b < NB; b++) {
            const int64_t blk = t * NB + b;
            const uint8_t* qb = PAIRS ? Q + blk / 2 * 576 + 64 + blk % 2 * 256 : Q + blk * 256;
            const uint8_t* db = PAIRS ? Q + blk / 2 * 576 + blk % 2 * 32 : D + blk * 32;
            if (ahead) {
                for (int g = PAIRS && b % 2 == 0 ? -1 : 0; g < 4; g++) _mm_prefetch((const char*)qb + ahead + g * 64, _MM_HINT_T0);
                if (!PAIRS && b % 2 == 0) _mm_prefetch((const char*)db + ahead / 8, _MM_HINT_T0);
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)db));
            __m512i w[8];
            for (int g = 0; g < 4; g++) {
                __m512i x = _mm512_load_si512(qb + g * 64);
                asm("" : "+v"(x));
                if (LOADS) {
                    x0 = _mm512_xor_si512(x0, x);
                    continue;
                }
                w[g] = _mm512_and_si512(x, nib);
                w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
            }
            if (LOADS) {
                acc = _mm512_add_ps(acc, dw);
                continue;
            }
            const int8_t* a = A + b * 32;
            __m512i s0 = _mm512_set1_epi32(CORR[b]), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = dp(s0, w[j], a + 4 * j);
                s1 = dp(s1, w[j + 1], a + 4 * j + 4);
            }
            const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(AD[b]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), d, acc);
        }
        _mm512_store_ps(Y + t * 16, _mm512_add_ps(acc, _mm512_castsi512_ps(x0)));
    }
}

// On CPU 0 alone, or on CPUs 0 and 1, each half of the tiles.
template <class F>
static void run(int threads, F f) {
    if (threads == 1) return f(0, TILES, 0);
    std::thread other([&] {
        cpu_set_t c;
        CPU_ZERO(&c);
        CPU_SET(1, &c);
        pthread_setaffinity_np(pthread_self(), sizeof c, &c);
        f(TILES / 2, TILES, 1);
    });
    f(0, TILES / 2, 0);
    other.join();
}

struct Walk {
    const char* name;
    void (*fn)(int64_t, int64_t, int64_t);    // ahead, t0, t1
    int64_t ahead;
};

int main(int argc, char** argv) {
    cpu_set_t c;
    CPU_ZERO(&c);
    CPU_SET(0, &c);
    pthread_setaffinity_np(pthread_self(), sizeof c, &c);
    Q = big(BYTES + (1 << 20)), D = big(BLOCKS * 32 + (1 << 20));
    for (int i = 0; i < NB * 32; i++) A[i] = (int8_t)(i % 7 - 3);
    for (int i = 0; i < NB; i++) AD[i] = 0.01f, CORR[i] = -8;
    const Walk walks[] = {
        {"split: loads alone", walk<false, true>, 0},
        {"split: kernel", walk<false, false>, 0},
        {"split: kernel, 8 KB ahead", walk<false, false>, 8192},
        {"pairs: loads alone", walk<true, true>, 0},
        {"pairs: kernel", walk<true, false>, 0},
        {"pairs: kernel, 8 KB ahead", walk<true, false>, 9216},    // as many blocks as 8 KB of bytes
    };
    const int n = sizeof walks / sizeof walks[0], rounds = argc > 1 ? atoi(argv[1]) : 20;
    for (int threads : {1, 2}) {
        std::vector<std::vector<double>> gbs(n);
        for (int r = 0; r < rounds; r++)
            for (int i = 0; i < n; i++) {
                const Walk& w = walks[r % 2 ? n - 1 - i : i];     // the order reverses each round
                const auto t0 = std::chrono::steady_clock::now();
                run(threads, [&](int64_t a, int64_t b, int) { w.fn(w.ahead, a, b); });
                const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                gbs[&w - walks].push_back(BYTES / s / 1e9);
            }
        printf("%d thread%s\n", threads, threads > 1 ? "s" : "");
        for (int i = 0; i < n; i++) {
            auto v = gbs[i];
            std::sort(v.begin(), v.end());
            printf("  %-28s %6.2f GB/s (IQR %.2f-%.2f)\n", walks[i].name, v[v.size() / 2], v[v.size() / 4], v[3 * v.size() / 4]);
        }
    }
}
