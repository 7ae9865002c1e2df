// vmath.h — vector math shared by the forward pass and the sampler.
#pragma once
#include <immintrin.h>

namespace lab {

// exp(x) for x <= 0: x = k ln2 + r, a degree-6 polynomial for e^r, 2^k through the exponent
// bits (relative error ~1e-7; underflows to 0 below -87). Its constants, for every width:
constexpr float EXP_MIN = -87.0f, EXP_LOG2E = 1.44269504f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                               5.0000001201e-1f};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 5; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The largest of x[0..n), n >= 1: eight lanes of maxima, then the lanes and the tail.
inline float max_avx2(const float* x, int n) {
    __m256 m = _mm256_set1_ps(x[0]);
    int i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float mx = lanes[0];
    for (int j = 1; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
// exp_neg, 16 lanes at a time.
inline __m512 exp_neg512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 5; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#pragma GCC pop_options

}  // namespace lab
