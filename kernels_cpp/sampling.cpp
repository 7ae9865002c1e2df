// sampling.cpp — the seeded generator, the warped distribution (temperature, top-k,
// top-p), sampling from it, and the acceptance rule of speculative sampling
// (docs/science.md §4).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "lab.h"
#include "vmath.h"

namespace lab {

// ----------------------------------------------------------------------------
// xoshiro256**, seeded through splitmix64
// ----------------------------------------------------------------------------

Rng::Rng(uint64_t seed) {
    for (auto& x : s) {
        seed += 0x9E3779B97F4A7C15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        x = z ^ (z >> 31);
    }
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t Rng::next() {
    const uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double Rng::uniform() { return (double)(next() >> 11) * 0x1.0p-53; }

// ----------------------------------------------------------------------------
// The warped distribution
// ----------------------------------------------------------------------------

// Sampling's vector code needs only AVX2, which every SIMD path has; a path this CPU lacks
// takes the scalar reference rather than faulting.
static bool use_avx2(int path) { return path != PATH_SCALAR && path_supported(path); }

const char* sampler_name(int path) { return use_avx2(path) ? "avx2" : "scalar"; }

static int argmax_scalar(const float* x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The scalar loop's answer (the first index holding the maximum) for any input without NaNs,
// in two vector passes instead of one with a loop-carried index: the largest value, then
// where it first is. (Logits are checked finite upstream; with NaNs it stays in range.)
static int argmax_avx2(const float* x, int n) {
    const float mx = max_avx2(x, n);
    const __m256 vmx = _mm256_set1_ps(mx);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmx, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == mx) return i;
    return argmax_scalar(x, n);                   // NaNs: no lane ever equals the maximum
}
#pragma GCC pop_options

int argmax(const float* x, int n, int path) {
    return use_avx2(path) ? argmax_avx2(x, n) : argmax_scalar(x, n);
}

// e^((l - mx) / T) for every logit, and their sum: the part of warping that touches all
// ~152k entries every time.
static double softmax_numerators_scalar(const float* l, int n, float mx, float inv_t, float* out) {
    double z = 0;
    for (int i = 0; i < n; i++) z += out[i] = std::exp((l[i] - mx) * inv_t);
    return z;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static double softmax_numerators_avx2(const float* l, int n, float mx, float inv_t, float* out) {
    const __m256 vmx = _mm256_set1_ps(mx), vt = _mm256_set1_ps(inv_t);
    __m256d z4 = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_neg(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), vmx), vt));
        _mm256_storeu_ps(out + i, e);
        z4 = _mm256_add_pd(z4, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    }
    alignas(32) double zz[4];
    _mm256_store_pd(zz, z4);
    double z = (zz[0] + zz[1]) + (zz[2] + zz[3]);
    for (; i < n; i++) z += out[i] = std::exp((l[i] - mx) * inv_t);
    return z;
}
#pragma GCC pop_options

// The path's kernel, from the logits' maximum so that no term overflows.
static double softmax_numerators(const float* l, int n, float inv_t, float* out, int path) {
    if (use_avx2(path)) return softmax_numerators_avx2(l, n, max_avx2(l, n), inv_t, out);
    return softmax_numerators_scalar(l, n, l[argmax_scalar(l, n)], inv_t, out);
}

// The maximum's own numerator is e^0 = 1, so its probability is one over the sum.
float top_probability(const float* logits, int n, float* scratch, int path) {
    return (float)(1.0 / softmax_numerators(logits, n, 1.f, scratch, path));
}

// Top-k keeps the k largest logits, ties broken toward the lower token id; top-p then keeps
// the shortest prefix of those (most probable first) whose mass reaches top_p.
void warp(const float* logits, int n, const SampleParams& sp, float* probs, int path) {
    if (sp.temperature > 0.f && (sp.top_k <= 0 || sp.top_k >= n) && sp.top_p >= 1.f) {
        // temperature alone: no sorting, every entry is written, only the maximum's value counts
        const float inv = (float)(1.0 / softmax_numerators(logits, n, 1.0f / sp.temperature, probs, path));
        for (int i = 0; i < n; i++) probs[i] *= inv;
        return;
    }
    const int top = argmax(logits, n, path);
    std::fill(probs, probs + n, 0.f);
    if (sp.temperature <= 0.f) {
        probs[top] = 1.f;
        return;
    }
    std::vector<int> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    auto before = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int keep = n;
    if (sp.top_k > 0 && sp.top_k < n) {
        keep = sp.top_k;
        std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), before);
    } else if (sp.top_p < 1.f) {
        std::sort(idx.begin(), idx.end(), before);
    }
    std::vector<double> e(keep);
    double z = 0;
    for (int i = 0; i < keep; i++) z += e[i] = std::exp(((double)logits[idx[i]] - logits[top]) / sp.temperature);
    if (sp.top_p < 1.f) {
        double cum = 0;
        int cut = keep;
        for (int i = 0; i < keep; i++)
            if ((cum += e[i] / z) >= sp.top_p) { cut = i + 1; break; }
        keep = cut;
        z = 0;
        for (int i = 0; i < keep; i++) z += e[i];
    }
    for (int i = 0; i < keep; i++) probs[idx[i]] = (float)(e[i] / z);
}

// ----------------------------------------------------------------------------
// Drawing from weights
// ----------------------------------------------------------------------------

// A draw from weights w(0..n) (any total; entries <= 0 never drawn) locates u * total in
// their running sum. One running sum over ~152k entries is a chain of dependent additions
// and the sampler's whole cost, so the sum runs in blocks: each block in four fixed lanes,
// the blocks in order, then u is found among the blocks and last inside its block. The
// order of additions is fixed by the code alone, so a seed gives one sample on every CPU.
constexpr int DRAW_BLOCK = 256;

struct Probs {                                   // sample(): probs, negatives as 0
    const float* p;
    double operator()(int j) const { return p[j] > 0.f ? (double)p[j] : 0.0; }
};

struct Residual {                                // the acceptance rule's max(0, p - q)
    const float *p, *q;
    double operator()(int j) const { return (double)std::max(0.f, p[j] - q[j]); }
};

template <class W>
static double block_sum_scalar(const W& w, int b, int e) {
    double l0 = 0, l1 = 0, l2 = 0, l3 = 0;
    int i = b;
    for (; i + 4 <= e; i += 4) { l0 += w(i); l1 += w(i + 1); l2 += w(i + 2); l3 += w(i + 3); }
    for (; i < e; i++) l0 += w(i);
    return (l0 + l1) + (l2 + l3);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The same four lanes, one register: the same additions in the same order.
static inline __m256d four(const Probs& w, int i) {
    const __m128 x = _mm_loadu_ps(w.p + i);
    return _mm256_cvtps_pd(_mm_and_ps(x, _mm_cmpgt_ps(x, _mm_setzero_ps())));
}

static inline __m256d four(const Residual& w, int i) {
    const __m128 x = _mm_sub_ps(_mm_loadu_ps(w.p + i), _mm_loadu_ps(w.q + i));
    return _mm256_cvtps_pd(_mm_and_ps(x, _mm_cmpgt_ps(x, _mm_setzero_ps())));
}

template <class W>
static double block_sum_avx2(const W& w, int b, int e) {
    __m256d l = _mm256_setzero_pd();
    int i = b;
    for (; i + 4 <= e; i += 4) l = _mm256_add_pd(l, four(w, i));
    alignas(32) double v[4];
    _mm256_store_pd(v, l);
    for (; i < e; i++) v[0] += w(i);
    return (v[0] + v[1]) + (v[2] + v[3]);
}
#pragma GCC pop_options

// -> the index drawn, or -1 when no weight is positive.
template <class W>
static int draw(const W& w, int n, Rng& rng, int path) {
    const int nb = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    const auto block_sum = use_avx2(path) ? block_sum_avx2<W> : block_sum_scalar<W>;
    std::vector<double> sums(nb);
    double total = 0;
    for (int b = 0; b < nb; b++) total += sums[b] = block_sum(w, b * DRAW_BLOCK, std::min(n, (b + 1) * DRAW_BLOCK));
    if (!(total > 0)) return -1;
    const double u = rng.uniform() * total;
    double cum = 0;
    int b = 0;
    for (; b < nb && !(u < cum + sums[b]); b++) cum += sums[b];
    if (b == nb)                                  // rounding put u at the very total
        for (int i = n - 1;; i--)
            if (w(i) > 0) return i;
    int last = -1;
    for (int i = b * DRAW_BLOCK, e = std::min(n, i + DRAW_BLOCK); i < e; i++) {
        const double x = w(i);
        if (!(x > 0)) continue;
        cum += x;
        last = i;
        if (u < cum) return i;
    }
    return last;                                  // the block's own rounding left u past it
}

int sample(const float* probs, int n, Rng& rng, int path) {
    const int i = draw(Probs{probs}, n, rng, path);
    return i < 0 ? argmax(probs, n, path) : i;
}

int accept_or_resample(const float* p, const float* q, int n, int x, Rng& rng, bool* accepted, int path) {
    if (q[x] > 0.f && rng.uniform() * q[x] < p[x]) {    // u < p(x)/q(x), without the division
        *accepted = true;
        return x;
    }
    *accepted = false;
    // the residual max(0, p - q), normalised; p itself when p <= q everywhere
    const int i = draw(Residual{p, q}, n, rng, path);
    return i < 0 ? sample(p, n, rng, path) : i;
}

void accept_trials(const float* p, const float* q, int n, int draws, uint64_t seed, int32_t* out, int path) {
    Rng rng(seed);
    bool ok;
    for (int i = 0; i < draws; i++) out[i] = accept_or_resample(p, q, n, sample(q, n, rng, path), rng, &ok, path);
}

}  // namespace lab
