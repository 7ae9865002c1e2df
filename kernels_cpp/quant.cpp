// quant.cpp — quantizers for weights (8- and 4-bit) and activations (8-bit), and the
// activation buffer the kernels read. lab/formats.py mirrors every rule byte for byte
// (docs/science.md §2).
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <cstdlib>

#include "formats.h"
#include "lab.h"

namespace lab {

uint16_t f32_to_f16(float f) { return fp32_to_fp16(f); }
float f16_to_f32(uint16_t h) { return fp16_to_fp32(h); }

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
// The whole eights of n; returns how many it did. F16C rounds to nearest even as
// fp32_to_fp16 does (only NaN payloads may differ).
static int64_t f32_to_f16_f16c(const float* x, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}
#pragma GCC pop_options

void round_bf16_row(const float* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i++) out[i] = round_bf16(x[i]);
}

void f32_to_f16_row(const float* x, int64_t n, uint16_t* out, int path) {
    const bool simd = path != PATH_SCALAR && path_supported(path);
    for (int64_t i = simd ? f32_to_f16_f16c(x, n, out) : 0; i < n; i++) out[i] = fp32_to_fp16(x[i]);
}

// ============================================================================
// Weights (scalar: quantized once, at export)
// ============================================================================

// First non-finite index in a block, or -1.
static int find_nonfinite(const float* x) {
    for (int i = 0; i < QK; i++)
        if (!std::isfinite(x[i])) return i;
    return -1;
}

// Rounds half away from zero (roundf), clamped to the int8 range the kernels expect.
static int8_t round_q8(float v) {
    float r = std::roundf(v);
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    return (int8_t)r;
}

int quantize_q8(const float* x, int64_t n, uint16_t* d, int8_t* q, int64_t* bad) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float* xb = x + b * QK;
        const int nf = find_nonfinite(xb);
        if (nf >= 0) { *bad = b * QK + nf; return Q_NONFINITE; }
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = std::fmax(amax, std::fabs(xb[i]));
        const float s = amax / 127.f;
        const uint16_t h = fp32_to_fp16(s);
        if ((h & 0x7fff) >= 0x7c00) { *bad = b * QK; return Q_SCALE_OVERFLOW; }
        d[b] = h;
        for (int i = 0; i < QK; i++) q[b * QK + i] = s == 0.f ? 0 : round_q8(xb[i] / s);
    }
    return Q_OK;
}

int quantize_q4(const float* x, int64_t n, uint16_t* d, uint8_t* q, int64_t* bad) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float* xb = x + b * QK;
        const int nf = find_nonfinite(xb);
        if (nf >= 0) { *bad = b * QK + nf; return Q_NONFINITE; }
        float amax = 0.f, m = 0.f;                     // the first value of largest magnitude
        for (int i = 0; i < QK; i++)
            if (std::fabs(xb[i]) > amax) { amax = std::fabs(xb[i]); m = xb[i]; }
        const float s = m / -8.f;
        const uint16_t h = fp32_to_fp16(s);
        if ((h & 0x7fff) >= 0x7c00) { *bad = b * QK; return Q_SCALE_OVERFLOW; }
        d[b] = h;
        uint8_t qs[QK];
        for (int i = 0; i < QK; i++) {
            if (s == 0.f) { qs[i] = 8; continue; }
            const float v = std::floor(xb[i] / s + 8.5f);
            qs[i] = (uint8_t)(v < 0.f ? 0.f : (v > 15.f ? 15.f : v));
        }
        for (int i = 0; i < QK / 2; i++) q[b * Q4_BYTES + i] = qs[i] | (qs[i + QK / 2] << 4);
    }
    return Q_OK;
}

void dequantize_q8(const uint16_t* d, const int8_t* q, int64_t n, float* out) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float s = fp16_to_fp32(d[b]);
        for (int i = 0; i < QK; i++) out[b * QK + i] = q[b * QK + i] * s;
    }
}

void dequantize_q4(const uint16_t* d, const uint8_t* q, int64_t n, float* out) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float s = fp16_to_fp32(d[b]);
        for (int i = 0; i < QK / 2; i++) {
            const uint8_t v = q[b * Q4_BYTES + i];
            out[b * QK + i] = ((int)(v & 15) - 8) * s;
            out[b * QK + i + QK / 2] = ((int)(v >> 4) - 8) * s;
        }
    }
}

// ============================================================================
// Activations: one block at a time, three paths with identical results
// ============================================================================

// The largest magnitude an activation may have: 127 at the largest scale (lab.h).
constexpr float ACT_MAX = 127.f * 0x1p112f;
static_assert(ACT_EXP_MAX == 112, "ACT_MAX is 127 * 2^ACT_EXP_MAX");

// First index in a block that is NaN, inf or past ACT_MAX, or -1.
static int find_unquantizable(const float* x) {
    for (int i = 0; i < QK; i++)
        if (!(std::fabs(x[i]) <= ACT_MAX)) return i;
    return -1;
}

// A block's scale from its largest magnitude: 0 for an all-zero block, else the smallest power
// of two 2^e with amax <= 127 * 2^e, e at least ACT_EXP_MIN; *e23 gets e << 23 (0 for 0).
static float act_scale(float amax, int32_t* e23) {
    *e23 = 0;
    if (amax == 0.f) return 0.f;
    // From the bits, not frexp and ldexp, whose calls cost more than the block's arithmetic:
    // amax = m * 2^(E - 126) with 0.5 <= m < 1, and m * 2^7 <= 127 exactly when the stored
    // mantissa is at most 63 * 2^17. A subnormal amax always takes the smallest exponent.
    const uint32_t b = f32_bits(amax), E = b >> 23;
    int e = E == 0 ? ACT_EXP_MIN : (int)E - 126 - ((b & 0x7fffff) <= (63u << 17) ? 7 : 6);
    e = e < ACT_EXP_MIN ? ACT_EXP_MIN : e;
    *e23 = e * (1 << 23);
    return f32_from((uint32_t)(e + 127) << 23);
}

// Each returns the index of the first value it cannot quantize (find_unquantizable), or -1.
static int quantize_act_scalar(const float* x, int8_t* q, float* d, int32_t* s, int32_t* e23) {
    const int nf = find_unquantizable(x);
    if (nf >= 0) return nf;
    float amax = 0.f;
    for (int i = 0; i < QK; i++) amax = std::fmax(amax, std::fabs(x[i]));
    const float sc = act_scale(amax, e23);
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
        q[i] = sc == 0.f ? 0 : round_q8(x[i] / sc);
        sum += q[i];
    }
    *d = sc;
    *s = sum;
    return -1;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Half away from zero: trunc, then step one away when the dropped fraction is >= 0.5.
static inline __m256 round_away256(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 frac = _mm256_and_ps(_mm256_sub_ps(v, t), absmask);
    const __m256 step = _mm256_or_ps(_mm256_set1_ps(1.f), _mm256_andnot_ps(absmask, v));
    const __m256 big = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(big, step));
}

static int quantize_act_avx2(const float* x, int8_t* q, float* d, int32_t* s, int32_t* e23) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 act_max = _mm256_set1_ps(ACT_MAX);
    __m256 v[4], mx = _mm256_setzero_ps();
    int finite = 0xff;
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        const __m256 a = _mm256_and_ps(v[j], absmask);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, act_max, _CMP_LE_OQ));
        mx = _mm256_max_ps(mx, a);
    }
    if (finite != 0xff) return find_unquantizable(x);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float sc = act_scale(_mm_cvtss_f32(m4), e23);
    *d = sc;
    if (sc == 0.f) {
        std::memset(q, 0, QK);
        *s = 0;
        return -1;
    }
    const __m256 inv = _mm256_set1_ps(1.f / sc), lim = _mm256_set1_ps(127.f);   // x / sc exactly: sc is 2^e
    __m256i qi[4];
    for (int j = 0; j < 4; j++) {
        __m256 r = round_away256(_mm256_mul_ps(v[j], inv));
        r = _mm256_max_ps(_mm256_min_ps(r, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        qi[j] = _mm256_cvtps_epi32(r);
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *s = _mm_cvtsi128_si32(s4);
    // pack 32 int32 -> 32 int8, restoring order after the in-lane packs
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p8, order));
    return -1;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
static int quantize_act_avx512(const float* x, int8_t* q, float* d, int32_t* s, int32_t* e23) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    const __m512 act_max = _mm512_set1_ps(ACT_MAX);
    const __mmask16 ok = _mm512_cmp_ps_mask(a0, act_max, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, act_max, _CMP_LE_OQ);
    if (ok != 0xffff) return find_unquantizable(x);
    const float sc = act_scale(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)), e23);
    *d = sc;
    if (sc == 0.f) {
        std::memset(q, 0, QK);
        *s = 0;
        return -1;
    }
    // x / sc exactly: sc is 2^e, its reciprocal 2^-e a normal float (ACT_EXP_MIN..ACT_EXP_MAX)
    const __m512 inv = _mm512_set1_ps(1.f / sc), half = _mm512_set1_ps(0.5f), lim = _mm512_set1_ps(127.f);
    __m512i qi[2];
    const __m512 vv[2] = {v0, v1};
    for (int j = 0; j < 2; j++) {
        const __m512 v = _mm512_mul_ps(vv[j], inv);
        const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
        const __m512 step = _mm512_or_ps(_mm512_set1_ps(1.f), _mm512_and_ps(v, _mm512_set1_ps(-0.f)));
        __m512 r = _mm512_mask_add_ps(t, big, t, step);
        r = _mm512_max_ps(_mm512_min_ps(r, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
        qi[j] = _mm512_cvtps_epi32(r);
    }
    *s = _mm512_reduce_add_epi32(_mm512_add_epi32(qi[0], qi[1]));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qi[0]));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qi[1]));
    return -1;
}

// Sixteen blocks at once. One block's two horizontal reductions (its largest magnitude and its
// sum) and its scalar scale cost more than its rounding, so sixteen blocks' registers are
// reduced together, a transpose as they go, and their scales made in one register.
constexpr int ACT_GROUP = 16;

// One register of v[0..15]'s reductions by op: lane i holds op over v[i]'s sixteen lanes.
template <class Op>
static inline __m512 reduce16(__m512 (&v)[ACT_GROUP], Op op) {
    __m512 r[8], t[4], u[2];
    for (int i = 0; i < 8; i++)      // quarters 0-1: v[2i] folded to 8 lanes; 2-3: v[2i + 1]
        r[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)      // quarter j: v[4i + j] folded to 4 lanes
        t[i] = op(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88), _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)      // quarter j: lanes 0-1 v[8i + j], lanes 2-3 v[8i + 4 + j]
        u[i] = op(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    // quarter j: v[j], v[4 + j], v[8 + j], v[12 + j]; the permute puts v[i] in lane i
    const __m512 w = op(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

// act_scale on sixteen blocks' largest magnitudes: the scales, their reciprocals (0 for 0) and e << 23.
static inline void act_scales16(__m512 amax, __m512* sc, __m512* inv, __m512i* e23) {
    const __m512i b = _mm512_castps_si512(amax), one = _mm512_set1_epi32(1);
    const __mmask16 nonzero = _mm512_test_epi32_mask(b, b);
    const __mmask16 more = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffff)),
                                                  _mm512_set1_epi32(63 << 17));
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(133));   // E - 126 - 7
    e = _mm512_mask_add_epi32(e, more, e, one);
    e = _mm512_max_epi32(e, _mm512_set1_epi32(ACT_EXP_MIN));      // and a subnormal's E of 0 lands here
    const __m512i k127 = _mm512_set1_epi32(127);
    *e23 = _mm512_maskz_slli_epi32(nonzero, e, 23);
    *sc = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(nonzero, _mm512_add_epi32(e, k127), 23));
    *inv = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(nonzero, _mm512_sub_epi32(k127, e), 23));
}

// 16 values' |v| / sc rounded half away from zero, clamped to 127, with v's sign. |v| * inv is
// exact; adding 0.5 toward zero and truncating gives floor(|v| * inv + 0.5) exactly, since that
// integer is a float no larger than the rounded-down sum.
static inline __m512i round_q8_16(__m512 v, __m512 inv) {
    const __m512 u = _mm512_add_round_ps(_mm512_mul_ps(_mm512_abs_ps(v), inv), _mm512_set1_ps(0.5f),
                                         _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512i n = _mm512_min_epi32(_mm512_cvtt_roundps_epi32(u, _MM_FROUND_NO_EXC), _mm512_set1_epi32(127));
    return _mm512_mask_sub_epi32(n, _mm512_movepi32_mask(_mm512_castps_si512(v)), _mm512_setzero_si512(), n);
}

// Blocks [0, 16) of x; false when one holds a value it cannot quantize (the caller finds it).
static bool quantize_act16_avx512(const float* x, int8_t* q, float* d, int32_t* s, int32_t* e23, int32_t* c4,
                                  int32_t* c8) {
    const __m512 act_max = _mm512_set1_ps(ACT_MAX);
    __m512 m[ACT_GROUP];
    __mmask16 ok = 0xffff;
    for (int i = 0; i < ACT_GROUP; i++) {
        const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(x + i * QK)), a1 = _mm512_abs_ps(_mm512_loadu_ps(x + i * QK + 16));
        ok &= _mm512_cmp_ps_mask(a0, act_max, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, act_max, _CMP_LE_OQ);
        m[i] = _mm512_max_ps(a0, a1);
    }
    if (ok != 0xffff) return false;
    __m512 sc, inv;
    __m512i e;
    act_scales16(reduce16(m, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }), &sc, &inv, &e);
    __m512 sums[ACT_GROUP];
    for (int i = 0; i < ACT_GROUP; i++) {
        const __m512 inv_i = _mm512_permutexvar_ps(_mm512_set1_epi32(i), inv);
        const __m512i q0 = round_q8_16(_mm512_loadu_ps(x + i * QK), inv_i);
        const __m512i q1 = round_q8_16(_mm512_loadu_ps(x + i * QK + 16), inv_i);
        _mm_storeu_si128((__m128i*)(q + i * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + i * QK + 16), _mm512_cvtepi32_epi8(q1));
        sums[i] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
    }
    const __m512i sum = _mm512_castps_si512(reduce16(sums, [](__m512 a, __m512 b) {
        return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    }));
    _mm512_storeu_ps(d, sc);
    _mm512_storeu_si512(s, sum);
    _mm512_storeu_si512(e23, e);
    _mm512_storeu_si512(c4, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-8)));
    _mm512_storeu_si512(c8, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
    return true;
}
#pragma GCC pop_options

// ============================================================================
// QActs: the activation buffer
// ============================================================================

QActs::QActs() = default;
QActs::~QActs() {
    wait_redo_workers();    // a late SPLIT_REDO worker may still read the activations
    std::free(mem_);
}

// One allocation, 64-byte aligned regions: q (32 bytes a block), then d, s, c4, c8, e23.
void QActs::reserve(int64_t blocks) {
    if (blocks <= cap_) return;
    wait_redo_workers();
    std::free(mem_);
    const size_t bytes = (size_t)blocks * (QK + 5 * 4) + 6 * 64;
    mem_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    cap_ = blocks;
}

static char* carve(char*& p, size_t bytes) {
    char* out = p;
    p += (bytes + 63) / 64 * 64;
    return out;
}

int QActs::shape(int k, int cols) {
    if (k < 1 || cols < QK || cols % QK != 0) return Q_BAD_SHAPE;
    k_ = k; cols_ = cols; nb_ = cols / QK;
    const int64_t n = (int64_t)k * nb_;
    reserve(n);
    char* p = (char*)mem_;
    q_ = (int8_t*)carve(p, n * QK);
    d_ = (float*)carve(p, n * 4);
    s_ = (int32_t*)carve(p, n * 4);
    c4_ = (int32_t*)carve(p, n * 4);
    c8_ = (int32_t*)carve(p, n * 4);
    e23_ = (int32_t*)carve(p, n * 4);
    return Q_OK;
}

int QActs::quantize_blocks(const float* x, int64_t b0, int64_t b1, int path, int64_t* bad) {
    auto block = path == PATH_AVX512VNNI || path == PATH_VNNI256_EVEX ? quantize_act_avx512
               : path == PATH_SCALAR                                 ? quantize_act_scalar
                                                                     : quantize_act_avx2;
    if (!path_supported(path)) block = quantize_act_scalar;
    // Whole lines of zeros first, then the blocks' scattered 4- and 16-byte stores: partial
    // stores into lines another core has just read were slow, and whole-line writes avoid
    // that (docs/tuning.md).
    std::memset(q_ + b0 * QK, 0, (size_t)(b1 - b0) * QK);
    for (int32_t* a : {(int32_t*)d_, s_, c4_, c8_, e23_}) std::memset(a + b0, 0, (size_t)(b1 - b0) * 4);
    const bool wide = block == quantize_act_avx512;
    for (int64_t b = b0; b < b1; b++) {
        if (wide && b1 - b >= ACT_GROUP &&
            quantize_act16_avx512(x + b * QK, q_ + b * QK, d_ + b, s_ + b, e23_ + b, c4_ + b, c8_ + b)) {
            b += ACT_GROUP - 1;
            continue;
        }
        const int nf = block(x + b * QK, q_ + b * QK, d_ + b, s_ + b, e23_ + b);
        if (nf >= 0) { *bad = b * QK + nf; return Q_NONFINITE; }
        c4_[b] = -8 * s_[b];
        c8_[b] = -128 * s_[b];
    }
    return Q_OK;
}

int QActs::quantize(const float* x, int k, int cols, int path, int64_t* bad) {
    const int rc = shape(k, cols);
    return rc != Q_OK ? rc : quantize_blocks(x, 0, (int64_t)k * nb_, path, bad);
}

void QActs::export_blocks(int8_t* q, float* d, int32_t* s) const {
    const int64_t n = (int64_t)k_ * nb_;
    std::memcpy(q, q_, (size_t)n * QK);
    std::memcpy(d, d_, (size_t)n * 4);
    std::memcpy(s, s_, (size_t)n * 4);
}

}  // namespace lab
