// matmul.cpp — quantized weights x 8-bit activations, for one token or k tokens sharing
// one pass over the weights. Four paths, one result: see lanes.h for the fixed order.
#include <immintrin.h>

#include "lanes.h"
#include "matmul_common.h"
#include "threadpool.h"

namespace lab {

using RowsFn = void (*)(const QMat&, const QActs&, float*, int64_t, int, int);

// ============================================================================
// Scalar reference
// ============================================================================

namespace scalar {

template <int FMT>
static int32_t block_dot(const uint8_t* w, const int8_t* a) {
    int32_t sum = 0;
    if (FMT == FMT_Q4) {
        for (int i = 0; i < QK / 2; i++) {
            sum += ((w[i] & 15) - 8) * a[i];
            sum += ((w[i] >> 4) - 8) * a[i + QK / 2];
        }
    } else {
        for (int i = 0; i < QK; i++) sum += (int8_t)w[i] * a[i];
    }
    return sum;
}

template <int FMT>
static void rows(const QMat& W, const QActs& A, float* y, int64_t ldy, int r0, int r1) {
    const int nb = W.cols / QK, bpb = FMT == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    for (int r = r0; r < r1; r++) {
        for (int t = 0; t < A.k(); t++) {
            const int8_t* a = A.q(t);
            const float* da = A.d(t);
            float R[16] = {0};
            for (int b = 0; b < nb; b++) {
                const int64_t i = (int64_t)r * nb + b;
                const int32_t isum = block_dot<FMT>(W.q + i * bpb, a + b * QK);
                R[b % 16] += (float)isum * (fp16_to_fp32(W.d[i]) * da[b]);
            }
            y[t * ldy + r] = residue_tree(R);
        }
    }
}

}  // namespace scalar

// ============================================================================
// 256-bit: AVX2 (maddubs + madd)
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Dot {
    static constexpr bool q8_offset = false;
    static inline __m256i q4(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) {
        // nibbles <= 15, so a pair of products stays far inside int16
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wlo, alo), _mm256_maddubs_epi16(whi, ahi));
        return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    // 8-bit weights are signed: move the sign onto the activation, |w| <= 127 keeps int16 safe
    static inline __m256i q8(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) {
        const __m256i one = _mm256_set1_epi16(1);
        const __m256i lo = _mm256_maddubs_epi16(_mm256_abs_epi8(wlo), _mm256_sign_epi8(alo, wlo));
        const __m256i hi = _mm256_maddubs_epi16(_mm256_abs_epi8(whi), _mm256_sign_epi8(ahi, whi));
        return _mm256_add_epi32(_mm256_madd_epi16(lo, one), _mm256_madd_epi16(hi, one));
    }
    static inline __m256i q8_prep(__m256i w) { return w; }
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
struct Dot {
    static constexpr bool q8_offset = true;
    static inline __m256i q4(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) {
        return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wlo, alo), whi, ahi);
    }
    static inline __m256i q8(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) { return q4(wlo, whi, alo, ahi); }
    // w + 128 as unsigned; the -128*sum(a) correction comes back in the lanes
    static inline __m256i q8_prep(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); }
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
struct Dot {
    static constexpr bool q8_offset = true;
    static inline __m256i q4(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) {
        return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wlo, alo), whi, ahi);
    }
    static inline __m256i q8(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) { return q4(wlo, whi, alo, ahi); }
    static inline __m256i q8_prep(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); }
};
#include "matmul256.inc"
}  // namespace vnni256evex
#pragma GCC pop_options

// ============================================================================
// 512-bit: AVX-512 VNNI (weights of a whole group stay in registers across tokens)
// ============================================================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
namespace avx512 {

static inline __m512i reduce4(__m512i s0, __m512i s1, __m512i s2, __m512i s3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// lane_block512 is a 4x4 transpose, so the same index list maps lanes to residues and back.
static inline __m512i transpose_idx() {
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

static inline float finish(__m512 acc) {
    const __m512 v = _mm512_permutexvar_ps(transpose_idx(), acc);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

template <int FMT>
static void rows(const QMat& W, const QActs& A, float* y, int64_t ldy, int r0, int r1) {
    const int nb = W.cols / QK, ng = (nb + 15) / 16, k = A.k();
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAX_K];
    TailScratch tail;
    for (int r = r0; r < r1; r++) {
        for (int t = 0; t < k; t++) acc[t] = _mm512_setzero_ps();
        for (int g = 0; g < ng; g++) {
            const Group G = row_group(W, r, g, tail);
            const __m512 dw = _mm512_permutexvar_ps(
                transpose_idx(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)G.d)));
            __m512i lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                if (FMT == FMT_Q4) {
                    const __m512i x = _mm512_loadu_si512(G.q + j * 64);
                    lo[j] = _mm512_and_si512(x, nib);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
                } else {
                    const __m512i x = _mm512_loadu_si512(G.q + j * 128);
                    const __m512i y2 = _mm512_loadu_si512(G.q + j * 128 + 64);
                    lo[j] = _mm512_xor_si512(_mm512_shuffle_i32x4(x, y2, 0x88), flip);
                    hi[j] = _mm512_xor_si512(_mm512_shuffle_i32x4(x, y2, 0xdd), flip);
                }
            }
            for (int t = 0; t < k; t++) {
                const int8_t* a = A.lanes(t) + (int64_t)g * 512;
                __m512i s[4];
                for (int j = 0; j < 4; j++) {
                    const __m512i z = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], _mm512_load_si512(a + j * 128));
                    s[j] = _mm512_dpbusd_epi32(z, hi[j], _mm512_load_si512(a + j * 128 + 64));
                }
                const __m512i c = _mm512_load_si512(A.lane_corr(t, 1, FMT) + g * 16);
                const __m512i isum = _mm512_add_epi32(reduce4(s[0], s[1], s[2], s[3]), c);
                const __m512 d = _mm512_mul_ps(dw, _mm512_load_ps(A.lane_d(t, 1) + g * 16));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), d));
            }
        }
        for (int t = 0; t < k; t++) y[t * ldy + r] = finish(acc[t]);
    }
}

}  // namespace avx512
#pragma GCC pop_options

// ============================================================================
// Dispatch
// ============================================================================

static RowsFn rows_for(int path, int fmt) {
    const bool q4 = fmt == FMT_Q4;
    switch (path) {
        case PATH_SCALAR: return q4 ? scalar::rows<FMT_Q4> : scalar::rows<FMT_Q8>;
        case PATH_AVX2: return q4 ? avx2::rows<FMT_Q4> : avx2::rows<FMT_Q8>;
        case PATH_AVXVNNI: return q4 ? avxvnni::rows<FMT_Q4> : avxvnni::rows<FMT_Q8>;
        case PATH_AVX512VNNI: return q4 ? avx512::rows<FMT_Q4> : avx512::rows<FMT_Q8>;
        case PATH_VNNI256_EVEX: return q4 ? vnni256evex::rows<FMT_Q4> : vnni256evex::rows<FMT_Q8>;
        default: return nullptr;
    }
}

QMat make_qmat(int fmt, int rows, int cols, const uint16_t* d, const uint8_t* q) {
    return QMat{fmt, rows, cols, d, q};
}

int matmul(const QMat& W, const QActs& A, float* y, int64_t ldy, int path, ThreadPool* pool, int chunk) {
    if (W.fmt != FMT_Q4 && W.fmt != FMT_Q8) return MM_BAD_FORMAT;
    if (W.cols != A.cols() || W.cols % QK != 0 || W.rows < 1 || ldy < W.rows) return MM_SHAPE;
    if (A.k() < 1 || A.k() > MAX_K) return MM_BAD_K;
    if (!path_supported(path)) return MM_PATH_UNSUPPORTED;
    const RowsFn fn = rows_for(path, W.fmt);
    for_range(pool, W.rows, chunk, [&](int b, int e, int) { fn(W, A, y, ldy, b, e); });
    return MM_OK;
}

}  // namespace lab
