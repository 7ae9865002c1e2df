// matmul.cpp — quantized weights x 8-bit activations, for one token or k tokens sharing
// one pass over the weights.
//
// One result on every path. Each block's dot product is exact in int32; each row then
// accumulates acc = fma(float(isum), d_w * d_a, acc) over its blocks in order. Tiles put
// one row in each register lane, so no path ever sums across lanes, and the scalar
// reference, AVX2, AVX-VNNI and AVX-512 VNNI agree bit for bit — as do a k-token call
// and k single-token calls, and any split of the tiles over threads (docs/science.md §3).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "formats.h"
#include "lab.h"
#include "threadpool.h"

namespace lab {

using TilesFn = void (*)(const PackedMat&, const QActs&, float*, int64_t, int, int);

static inline int32_t load4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Writes a tile's rows of every token, leaving out the padding rows past the end.
static void store_tile(const PackedMat& W, float* y, int64_t ldy, int tile, int k,
                       const float (*acc)[TILE]) {
    const int r0 = tile * TILE, n = W.rows - r0 < TILE ? W.rows - r0 : TILE;
    for (int t = 0; t < k; t++) std::memcpy(y + t * ldy + r0, acc[t], n * sizeof(float));
}

// ============================================================================
// How far ahead the SIMD kernels ask for their weight streams (Tuning, lab.h; the
// measurements: docs/tuning.md). Distances are in bytes of a 4-bit stream (an 8-bit one goes
// the same number of blocks, twice the bytes), one request per line. One token is bound by
// the stream, so it may ask prefetch_k1 ahead into L1 and nothing more: on a Zen 4 a further
// request into L2 slowed it, on a Sapphire Rapids-class Xeon the 4-bit stream wanted it. Several
// tokens are bound by arithmetic as much as by the stream, and the hardware prefetcher falls
// behind a stream read that slowly, so they ask into L2 far ahead and into L1 near. The scales
// lie in the same stream (formats.h, tile_offsets).
// ============================================================================

// Whether k tokens of a format take the single-token scheme: one to eight tokens, where the
// stream binds them, as Tuning says per format and k (measured per machine).
static inline bool stream_bound(int fmt, int k, const Tuning& tn) {
    const bool q4 = fmt == FMT_Q4;
    switch (k) {
        case 1: return q4 ? tn.q4_single_k1 : tn.q8_single_k1;
        case 2: return q4 ? tn.q4_single_k2 : tn.q8_single_k2;
        case 3: return q4 ? tn.q4_single_k3 : tn.q8_single_k3;
        case 4: return q4 ? tn.q4_single_k4 : tn.q8_single_k4;
        case 5: return q4 ? tn.q4_single_k5 : tn.q8_single_k5;
        case 6: return q4 ? tn.q4_single_k6 : tn.q8_single_k6;
        case 7: return q4 ? tn.q4_single_k7 : tn.q8_single_k7;
        case 8: return q4 ? tn.q4_single_k8 : tn.q8_single_k8;
        default: return false;
    }
}

// One kernel call's requests ahead, in bytes from a block's first byte.
struct StreamAhead {
    int64_t l1 = 0, l2 = 0;    // 0 for none

    StreamAhead(int fmt, bool single, const Tuning& tn) {
        const int ch = block_chunks(fmt);
        const bool q8 = fmt == FMT_Q8;
        const int k1 = q8 ? tn.prefetch_k1_q8 : tn.prefetch_k1;
        l1 = (int64_t)(single ? k1 : q8 ? tn.prefetch_l1_k_q8 : tn.prefetch_l1_k) * ch / 4;
        l2 = single ? 0 : (int64_t)(q8 ? tn.prefetch_l2_k_q8 : tn.prefetch_l2_k) * ch / 4;
    }

    // Block b's requests: its CH chunks' lines `l1` (and `l2`) ahead, and, for the first block
    // of a pair, the pair's line of scales before them: every line of the stream once.
    // always inlined: a call would make the kernel spill its vector registers around it; one
    // pointer a distance, its lines at constant offsets from it, so the addresses cost no arithmetic
    template <int CH>
    __attribute__((always_inline)) inline void block(const uint8_t* qb, int b) const {
        const bool pair_start = b % 2 == 0;
        if (l1) lines<CH, _MM_HINT_T0>((const char*)qb + l1, pair_start);
        if (l2) lines<CH, _MM_HINT_T2>((const char*)qb + l2, pair_start);
    }

    // HINT an _MM_HINT_* value, as _mm_prefetch translates it (whose hint type GCC and clang
    // declare differently)
    template <int CH, int HINT>
    __attribute__((always_inline)) static inline void lines(const char* p, bool pair_start) {
        if (pair_start) __builtin_prefetch(p - CHUNK, 0, HINT & 3);
        for (int g = 0; g < CH; g++) __builtin_prefetch(p + g * CHUNK, 0, HINT & 3);
    }
};

// A tile's blocks in order: block b's bytes and scales, each pointer moved by one add a block,
// where tile_offsets per block took a score of scalar instructions beside the vector work.
template <int FMT>
struct BlockWalk {
    const uint8_t* q;
    const uint16_t* d;
    BlockWalk() = default;
    BlockWalk(const PackedMat& W, int tile) {
        const TileOffsets start = tile_offsets(FMT, W.cols / QK, tile, 0);
        q = W.q + start.q;
        d = W.d + start.d;
    }
    void next(int b) {      // from block b to b + 1: a pair's second block, or the next pair
        constexpr int BLOCK = block_chunks(FMT) * CHUNK;
        q += b % 2 ? BLOCK + PAIR_SCALES : BLOCK;
        d += b % 2 ? pair_bytes(FMT) / SCALE_BYTES - TILE : TILE;
    }
};

// How many streams k tokens of a format read a thread's share in (Tuning).
static inline int streams(int fmt, const Tuning& tn) { return fmt == FMT_Q4 ? tn.q4_streams : tn.q8_streams; }

// Calls f(tiles, n) on the tiles t0..t1 in groups of n = `count` that a kernel reads side by side:
// the range in `count` equal parts, a tile of each at a time, so that each part is one stream
// from memory; the tiles that do not divide go one at a time at the end.
template <class F>
static void stream_groups(int t0, int t1, int count, F&& f) {
    const int part = (t1 - t0) / count;
    int tiles[MAX_STREAMS];
    for (int i = 0; i < part; i++) {
        for (int n = 0; n < count; n++) tiles[n] = t0 + n * part + i;
        f(tiles, count);
    }
    for (int t = t0 + count * part; t < t1; t++) f(&t, 1);
}

// ============================================================================
// Scalar reference (reads the same packed tiles as the SIMD kernels)
// ============================================================================

namespace scalar {

template <int FMT>
static int32_t block_dot(const uint8_t* qb, int lane, const int8_t* a) {
    int32_t sum = 0;
    for (int c = 0; c < block_chunks(FMT); c++)
        for (int j = 0; j < CHUNK_ROW; j++) {
            const uint8_t v = qb[chunk_offset(c, lane) + j];
            if (FMT == FMT_Q4)
                sum += ((v & 15) - 8) * a[4 * c + j] + ((v >> 4) - 8) * a[QK / 2 + 4 * c + j];
            else
                sum += (v - 128) * a[4 * c + j];
        }
    return sum;
}

template <int FMT>
static void tiles(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int t0, int t1) {
    const int nb = W.cols / QK, k = A.k();
    float acc[MAX_K][TILE];
    for (int tile = t0; tile < t1; tile++) {
        for (int t = 0; t < k; t++)
            for (int i = 0; i < TILE; i++) {
                float sum = 0.f;
                for (int b = 0; b < nb; b++) {
                    const TileOffsets at = tile_offsets(FMT, nb, tile, b);
                    const int32_t isum = block_dot<FMT>(W.q + at.q, i, A.q(t) + b * QK);
                    sum = std::fmaf((float)isum, fp16_to_fp32(W.d[at.d + i]) * A.d(t)[b], sum);
                }
                acc[t][i] = sum;
            }
        store_tile(W, y, ldy, tile, k, acc);
    }
}

}  // namespace scalar

// ============================================================================
// 256-bit: AVX2 (maddubs + madd)
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
template <int FMT>
struct Dot {
    static constexpr bool q8_biased = false;
    // maddubs wants unsigned weights: undo the packed +128 and move the sign onto a
    static inline __m256i prep(__m256i x) { return _mm256_xor_si256(x, _mm256_set1_epi8((char)0x80)); }
    static inline __m256i dot8(__m256i w, __m256i a) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)),
                                 _mm256_set1_epi16(1));
    }
    static inline __m256i pair(__m256i s, __m256i w0, __m256i a0, __m256i w1, __m256i a1) {
        if (FMT == FMT_Q4) {   // nibbles <= 15: both pairs of products fit one int16 sum
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
            return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        }
        return _mm256_add_epi32(s, _mm256_add_epi32(dot8(w0, a0), dot8(w1, a1)));
    }
};
#include "matmul256.inc"
}  // namespace avx2
#pragma GCC pop_options

// ============================================================================
// 256-bit: AVX-VNNI (Intel hybrids; VEX vpdpbusd)
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avxvnni {
template <int FMT>
struct Dot {
    static constexpr bool q8_biased = true;
    static inline __m256i prep(__m256i x) { return x; }
    static inline __m256i pair(__m256i s, __m256i w0, __m256i a0, __m256i w1, __m256i a1) {
        return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, w0, a0), w1, a1);
    }
};
#include "matmul256.inc"
}  // namespace avxvnni
#pragma GCC pop_options

// ============================================================================
// 256-bit: the AVX-VNNI kernel with the EVEX vpdpbusd (AVX512-VNNI + VL), for testing
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni256evex {
template <int FMT>
struct Dot {
    static constexpr bool q8_biased = true;
    static inline __m256i prep(__m256i x) { return x; }
    static inline __m256i pair(__m256i s, __m256i w0, __m256i a0, __m256i w1, __m256i a1) {
        return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s, w0, a0), w1, a1);
    }
};
#include "matmul256.inc"
}  // namespace vnni256evex
#pragma GCC pop_options

// ============================================================================
// 512-bit: AVX-512 VNNI (a tile is one register; a block's weights stay in registers
// while every token passes)
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
namespace avx512 {

// s + w . (the 4 activation bytes at a, in every lane), the bytes broadcast by the
// instruction's own memory operand: no separate broadcast to issue per token and block.
static inline __m512i dpbusd_bcst(__m512i s, __m512i w, const int8_t* a) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*(const int32_t*)a));
    return s;
}

// Each token's per-block values, loaded where each stream uses them (LEAN below): as plain
// broadcasts the compiler loads each once for all the streams of a group and keeps it, and
// where registers run short it spills them. `volatile`, so no stream's load merges with another's.
static inline __m512i bcst_load(const int32_t* p) {
    __m512i r;
    asm volatile("vpbroadcastd %1, %0" : "=v"(r) : "m"(*p));
    return r;
}

// x + (*p in every lane) where m is set, 0 elsewhere: the broadcast in the add's own operand.
static inline __m512i maskz_add_bcst(__mmask16 m, __m512i x, const int32_t* p) {
    __m512i r;
    asm("vpaddd %2%{1to16%}, %1, %0%{%3%}%{z%}" : "=v"(r) : "v"(x), "m"(*p), "Yk"(m));
    return r;
}

// k is a template argument, so the accumulators stay in registers and the token loop
// unrolls instead of loading and storing each accumulator per token and block. Some
// stream-bound cases measured slower that way, so for 2 and 4 tokens the accumulators may go
// through memory each block instead (an empty asm taking each as a memory operand), as
// Tuning says per format; measured, not understood (docs/tuning.md).
static inline bool through_memory(int fmt, int k, const Tuning& tn) {
    const bool q4 = fmt == FMT_Q4;
    if (k == 2) return q4 ? tn.q4_mem_acc_k2 : tn.q8_mem_acc_k2;
    if (k == 4) return q4 ? tn.q4_mem_acc_k4 : tn.q8_mem_acc_k4;
    return false;
}

// One block of a tile for the G tokens from `tok0` on: vacc[t] += its products, and the walk on
// to the next block. Always inlined, so the accumulators stay in registers. LEAN: each token's
// values loaded per stream (bcst_load, maskz_add_bcst) rather than kept in registers.
template <int FMT, int G, bool MEM, bool PREFETCH_AHEAD, bool LEAN>
__attribute__((always_inline)) static inline void block_pass(const QActs& A, BlockWalk<FMT>& walk, int b, int tok0,
                                                             __m512* vacc, const StreamAhead& ahead) {
    constexpr int CH = block_chunks(FMT);
    const uint8_t* qb = walk.q;
    // the weights stream from memory once: ask for them well before they are needed
    if (PREFETCH_AHEAD) ahead.block<CH>(qb, b);
    const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)walk.d));
    // d_w * 2^e, exactly: d_w's bits plus e << 23 where d_w is not 0 (fp16 makes it a
    // normal float, e's range keeps the sum one, and files with a NaN or inf scale are
    // refused), 0 where it is. An integer add runs beside vpdpbusd, where a multiply took
    // one of its issue slots; vfpclassps, to pass inf through too, cost 3-4% (docs/tuning.md).
    const __m512i dwi = _mm512_castps_si512(dw);
    const __mmask16 nonzero = _mm512_test_epi32_mask(dwi, _mm512_set1_epi32(0x7fffffff));
    __m512i w[8];                                   // w[j] meets activation bytes 4j..4j+3
    for (int g = 0; g < CH; g++) {
        __m512i x = _mm512_load_si512(qb + g * CHUNK);
        // one load feeds both nibbles: the compiler would fold it into each, and the core
        // moves only two loads a cycle into its vector unit, each broadcast operand one of them
        asm("" : "+v"(x));
        if (FMT == FMT_Q4) {
            w[g] = _mm512_and_si512(x, _mm512_set1_epi8(0x0f));
            w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0f));
        } else {
            w[g] = x;
        }
    }
    // Two chains a token, so a few tokens are not bound by vpdpbusd's latency; from four tokens
    // the tokens' own chains hide it, and one chain saves an add a token and block (3-4% from
    // L2), except where the accumulators go through memory (3% slower there; docs/tuning.md).
    // Integer sums: the same bits either way.
    constexpr bool ONE_CHAIN = G >= 4 && !MEM;
    // unrolled whole, or from ten tokens GCC keeps a loop and the accumulators go to memory
#pragma GCC unroll 16
    for (int t = 0; t < G; t++) {
        const int8_t* a = A.q(tok0 + t) + b * QK;
        const int32_t* corr = A.corr(tok0 + t, FMT) + b;
        __m512i s0 = LEAN ? bcst_load(corr) : _mm512_set1_epi32(*corr), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            s0 = dpbusd_bcst(s0, w[j], a + 4 * j);
            if (ONE_CHAIN) s0 = dpbusd_bcst(s0, w[j + 1], a + 4 * j + 4);
            else s1 = dpbusd_bcst(s1, w[j + 1], a + 4 * j + 4);
        }
        const int32_t* e = A.exp23(tok0 + t) + b;
        const __m512 d = _mm512_castsi512_ps(LEAN ? maskz_add_bcst(nonzero, dwi, e)
                                                  : _mm512_maskz_add_epi32(nonzero, dwi, _mm512_set1_epi32(*e)));
        const __m512i s = ONE_CHAIN ? s0 : _mm512_add_epi32(s0, s1);
        vacc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, vacc[t]);
        if (MEM) asm volatile("" : "+m"(vacc[t]));
    }
    walk.next(b);
}

// NT tiles' rows for the G tokens from `tok0` on, every block in order, a block of each tile
// in turn (NT streams). Only the first group of a tile asks for the streams ahead
// (PREFETCH_AHEAD); MEM: the accumulators go through memory.
template <int FMT, int K, int G, bool MEM, bool PREFETCH_AHEAD, int NT>
static inline void tile_pass(const PackedMat& W, const QActs& A, const int* tiles, int tok0, float (*acc)[K][TILE],
                             const StreamAhead& ahead) {
    // every loop over the streams unrolled whole, or the accumulators and walks stay in memory
    __m512 vacc[NT][G];
    // the accumulators, each token's two broadcast values kept across the streams, a block's 8
    // weight registers and about 4 temporaries: past 32 registers, the values are loaded per use
    constexpr bool LEAN = NT > 1 && NT * G + 2 * G + 8 + 4 > 32;
    BlockWalk<FMT> walks[NT];
#pragma GCC unroll 4
    for (int n = 0; n < NT; n++) {
        walks[n] = BlockWalk<FMT>(W, tiles[n]);
        for (int t = 0; t < G; t++) vacc[n][t] = _mm512_setzero_ps();
    }
    for (int b = 0; b < W.cols / QK; b++)
#pragma GCC unroll 4
        for (int n = 0; n < NT; n++) block_pass<FMT, G, MEM, PREFETCH_AHEAD, LEAN>(A, walks[n], b, tok0, vacc[n], ahead);
#pragma GCC unroll 4
    for (int n = 0; n < NT; n++)
        for (int t = 0; t < G; t++) _mm512_store_ps(acc[n][tok0 + t], vacc[n][t]);
}

// NT tiles side by side (stream_groups), all K tokens, in one group or, TWO, two: the second
// reads the tiles' weights again from cache, where one group's accumulators beside a block's 8
// weight registers would crowd the 32 registers (Tuning::two_groups_k).
template <int FMT, int K, bool MEM, int NT, bool TWO>
static void tile_group(const PackedMat& W, const QActs& A, float* y, int64_t ldy, const int* tiles,
                       const StreamAhead& ahead) {
    constexpr int G1 = TWO ? (K + 1) / 2 : K, G2 = K - G1;
    alignas(64) float acc[NT][K][TILE];
    tile_pass<FMT, K, G1, MEM, true, NT>(W, A, tiles, 0, acc, ahead);
    if constexpr (G2 > 0) tile_pass<FMT, K, G2, MEM, false, NT>(W, A, tiles, G1, acc, ahead);
    for (int n = 0; n < NT; n++) store_tile(W, y, ldy, tiles[n], K, acc[n]);
}

// The most streams k >= 2 tokens take, per token range (Tuning::streams_k2, streams_k5, streams_k9).
static inline int stream_cap(int k, const Tuning& tn) {
    return k >= STREAMS_K9_FROM ? tn.streams_k9 : k >= STREAMS_K5_FROM ? tn.streams_k5 : k >= 2 ? tn.streams_k2 : MAX_STREAMS;
}

// Every stream group of tiles t0..t1 in one or two groups of tokens. Only the shapes the tuning's
// range can ask for are built (TWO_GROUPS_FIRST, TWO_GROUPS_LAST): two groups below the first
// and one group from the last would each stand in for the other, and never run.
template <int FMT, int K, bool MEM, int MOST, bool TWO>
static void groups(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int t0, int t1, const Tuning& tn,
                   const StreamAhead& ahead) {
    if constexpr (TWO ? K >= TWO_GROUPS_FIRST : K < TWO_GROUPS_LAST)
        stream_groups(t0, t1, std::min({streams(FMT, tn), MOST, stream_cap(K, tn)}),
                      [&](const int* tiles, int n) {
            if constexpr (MOST == 4)
                if (n == 4) return tile_group<FMT, K, MEM, 4, TWO>(W, A, y, ldy, tiles, ahead);
            if (n == 2) tile_group<FMT, K, MEM, 2, TWO>(W, A, y, ldy, tiles, ahead);
            else tile_group<FMT, K, MEM, 1, TWO>(W, A, y, ldy, tiles, ahead);
        });
    else groups<FMT, K, MEM, MOST, !TWO>(W, A, y, ldy, t0, t1, tn, ahead);
}

template <int FMT, int K, bool MEM = false>
static void tiles_k(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int t0, int t1, const Tuning& tn) {
    static_assert(MAX_STREAMS == 4, "a group of each stream count the tuning allows");
    // each stream keeps an accumulator a token beside a block's 8 weight registers: past four
    // tokens two streams already spill some, and still read faster from memory (docs/tuning.md)
    constexpr int MOST = K < STREAMS_K5_FROM ? 4 : 2;
    const StreamAhead ahead(FMT, stream_bound(FMT, K, tn), tn);
    if (K >= tn.two_groups_k) groups<FMT, K, MEM, MOST, true>(W, A, y, ldy, t0, t1, tn, ahead);
    else groups<FMT, K, MEM, MOST, false>(W, A, y, ldy, t0, t1, tn, ahead);
}

using TunedFn = void (*)(const PackedMat&, const QActs&, float*, int64_t, int, int, const Tuning&);

template <int FMT, int... I>
constexpr std::array<TunedFn, sizeof...(I)> by_k(std::integer_sequence<int, I...>) {
    return {tiles_k<FMT, I + 1>...};
}

template <int FMT>
static void tiles(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int t0, int t1) {
    static constexpr auto by_tokens = by_k<FMT>(std::make_integer_sequence<int, MAX_K>{});
    const Tuning tn = tuning();
    const int k = A.k();
    if (through_memory(FMT, k, tn))
        return (k == 2 ? tiles_k<FMT, 2, true> : tiles_k<FMT, 4, true>)(W, A, y, ldy, t0, t1, tn);
    by_tokens[k - 1](W, A, y, ldy, t0, t1, tn);
}

}  // namespace avx512
#pragma GCC pop_options

// ============================================================================
// Dispatch
// ============================================================================

static TilesFn tiles_for(int path, int fmt) {
    const bool q4 = fmt == FMT_Q4;
    switch (path) {
        case PATH_SCALAR: return q4 ? scalar::tiles<FMT_Q4> : scalar::tiles<FMT_Q8>;
        case PATH_AVX2: return q4 ? avx2::tiles<FMT_Q4> : avx2::tiles<FMT_Q8>;
        case PATH_AVXVNNI: return q4 ? avxvnni::tiles<FMT_Q4> : avxvnni::tiles<FMT_Q8>;
        case PATH_AVX512VNNI: return q4 ? avx512::tiles<FMT_Q4> : avx512::tiles<FMT_Q8>;
        case PATH_VNNI256_EVEX: return q4 ? vnni256evex::tiles<FMT_Q4> : vnni256evex::tiles<FMT_Q8>;
        default: return nullptr;
    }
}

QMat make_qmat(int fmt, int rows, int cols, const uint16_t* d, const uint8_t* q) {
    return QMat{fmt, rows, cols, d, q};
}

// SPLIT_REDO: a piece is consecutive tiles, computed as a matrix of its own (tile offsets add
// up, formats.h) into a thread's scratch, its rows then copied to y.
struct RedoMatmul {
    PackedMat W;
    const QActs* A;
    float* y;
    int64_t ldy;
    TilesFn fn;

    PackedMat part(int t0, int t1) const {
        const TileOffsets at = tile_offsets(W.fmt, W.cols / QK, t0, 0);
        PackedMat v = W;
        v.d = W.d + at.d;
        v.q = W.q + at.q;
        v.tiles = t1 - t0;
        v.rows = std::min(v.tiles * TILE, W.rows - t0 * TILE);
        return v;
    }
    static void compute(const void* job, int t0, int t1, float* scratch, int) {
        const RedoMatmul& m = *(const RedoMatmul*)job;
        const PackedMat v = m.part(t0, t1);
        m.fn(v, *m.A, scratch, v.rows, 0, v.tiles);
    }
    static void commit(const void* job, int t0, int t1, float* scratch, int) {
        const RedoMatmul& m = *(const RedoMatmul*)job;
        const PackedMat v = m.part(t0, t1);
        float* y0 = m.y + (int64_t)t0 * TILE;
        for (int t = 0; t < m.A->k(); t++) std::memcpy(y0 + t * m.ldy, scratch + (int64_t)t * v.rows, v.rows * sizeof(float));
    }
};
static_assert(sizeof(RedoMatmul) <= REDO_JOB_BYTES, "a SPLIT_REDO job fits the pool's copy");
static_assert(REDO_SCRATCH_FLOATS >= 64 * TILE * MAX_K, "64 tiles fit a thread's scratch");

int resolve_split(int chunk, const ThreadPool* pool) {
    if (chunk == SPLIT_AUTO) chunk = tuning().redo_split ? SPLIT_REDO : SPLIT_GUIDED;
    if (chunk == SPLIT_REDO && !(pool && pool->size() > 1 && pool->size() <= REDO_MAX_THREADS)) chunk = SPLIT_GUIDED;
    return chunk;
}

// Whether the guided split takes W in static ranges: under Tuning::guided_from_bytes of weights.
static bool in_static_ranges(const PackedMat& W, const Tuning& tn) {
    return packed_nbytes(W.fmt, TILE, W.cols) * W.tiles < tn.guided_from_bytes;
}

// The guided split's smallest share in tiles of W (Tuning::guided_min_bytes of weights).
static int64_t min_share_tiles(const PackedMat& W, const Tuning& tn) {
    const int64_t tile_bytes = packed_nbytes(W.fmt, TILE, W.cols);
    return (tn.guided_min_bytes + tile_bytes - 1) / tile_bytes;
}

// Pieces that shrink from 64 tiles (or what fits the scratch) down to guided_min_bytes: a
// thread's first pieces long for the kernel's streams, its last short, so that a thread out of
// work takes small ones from the others and a piece held by a worker gone missing costs little
// to compute again. A matrix the guided split takes in static ranges (under guided_from_bytes)
// goes in two pieces a thread: there each piece's restart of the streams cost more than a
// finer tail bought (docs/tuning.md).
static void redo(const PackedMat& W, const QActs& A, float* y, int64_t ldy, TilesFn fn, ThreadPool* pool) {
    const RedoMatmul job{W, &A, y, ldy, fn};
    const Tuning tn = tuning();
    const int most = std::min(64, REDO_SCRATCH_FLOATS / (TILE * A.k()));
    int64_t least = min_share_tiles(W, tn);
    if (in_static_ranges(W, tn))
        least = std::max<int64_t>(least, (W.tiles + 2 * pool->size() - 1) / (2 * pool->size()));
    least = std::min<int64_t>(least, most);
    pool->parallel_redo(W.tiles, (int)least, most, RedoMatmul::compute, RedoMatmul::commit, &job, sizeof job);
}

int matmul(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int path, ThreadPool* pool, int chunk) {
    const int rc = matmul_unwaited(W, A, y, ldy, path, pool, chunk);
    if (resolve_split(chunk, pool) == SPLIT_REDO) wait_redo_workers();   // the caller may free W and A once this returns
    return rc;
}

int matmul_unwaited(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int path, ThreadPool* pool,
                    int chunk) {
    if (W.fmt != FMT_Q4 && W.fmt != FMT_Q8) return MM_BAD_FORMAT;
    if (W.cols != A.cols() || W.cols % QK != 0 || W.rows < 1 || ldy < W.rows ||
        W.tiles != tile_count(W.rows))
        return MM_SHAPE;
    if (A.k() < 1 || A.k() > MAX_K) return MM_BAD_K;
    if (!path_supported(path)) return MM_PATH_UNSUPPORTED;
    const TilesFn fn = tiles_for(path, W.fmt);
    chunk = resolve_split(chunk, pool);
    if (chunk == SPLIT_REDO) {
        redo(W, A, y, ldy, fn, pool);
        return MM_OK;
    }
    if (chunk == SPLIT_GUIDED) {    // the pool's smallest share in tiles, from bytes; small matrices weighted static
        const Tuning tn = tuning();
        chunk = in_static_ranges(W, tn) ? SPLIT_WEIGHTED : -(int)min_share_tiles(W, tn);
    }
    for_range(pool, W.tiles, chunk, [&](int b, int e, int) { fn(W, A, y, ldy, b, e); });
    return MM_OK;
}

}  // namespace lab
