// model.cpp — one model's forward pass over k tokens at a position, from the engine's
// weights file: embedding, RMSNorm, fused qkv, q/k norms (Qwen3), RoPE, grouped-query
// attention over a KV cache per [layer][kv_head] (fp16, or bf16 where attention multiplies
// in bf16), fused gate/up, SiLU, down, and the output layer (only the tokenizer's rows).
//
// Every step treats each token alike whatever k is — the same kernels, summation order
// and split over threads — so a k-token pass equals k single-token passes bit for bit
// (docs/science.md §3).
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "clock.h"
#include "formats.h"
#include "lab.h"
#include "threadpool.h"
#include "vmath.h"

namespace lab {

// ============================================================================
// Small vector helpers: a scalar reference and an AVX2 version each
// ============================================================================

namespace {

// Query rows (tokens x heads sharing a KV head) one attention task takes at most: their
// scores, [rows][context], are its scratch. 48 holds an 8-token verification of a model with
// 6 query heads a KV head in one task, which then reads that head's K and V once.
constexpr int ATT_ROWS = 48;
// A task's rows at most for `group` query heads a KV head: whole tokens, at least one.
constexpr int att_task_rows(int group) { return group > ATT_ROWS ? group : ATT_ROWS / group * group; }

// The K cache keeps each head's positions in blocks of K_BLOCK, dimension-major within a
// block ([D][K_BLOCK] fp16), so a vector of scores reads one dimension of K_BLOCK positions
// at once; each head's region is padded to whole blocks.
constexpr int K_BLOCK = 16;
inline size_t k_at(int t, int i, int D) {
    return (size_t)(t / K_BLOCK) * K_BLOCK * D + (size_t)i * K_BLOCK + t % K_BLOCK;
}
constexpr int k_cache_positions(int n) { return (n + K_BLOCK - 1) / K_BLOCK * K_BLOCK; }
// Where ATT_BF16 multiplies in bf16, the cache holds bf16 in the pairs vdpbf16ps reads: a K
// block as [D / 2][K_BLOCK] pairs of dimensions, V as [positions / 2][D] pairs of positions,
// so the kernel loads its operands with no conversion (docs/tuning.md). Same bytes either way.
inline size_t k_pair_at(int t, int i, int D) {
    return (size_t)(t / K_BLOCK) * K_BLOCK * D + (size_t)(i / 2) * 2 * K_BLOCK + (t % K_BLOCK) * 2 + i % 2;
}
inline size_t v_pair_at(int t, int i, int D) { return (size_t)(t / 2) * 2 * D + (size_t)2 * i + t % 2; }
inline uint16_t bf16_bits(float f) { return (uint16_t)(f32_bits(round_bf16(f)) >> 16); }
inline float bf16_value(uint16_t b) { return f32_from((uint32_t)b << 16); }

// Attention against one KV head for `tokens` consecutive query tokens: token j's `group`
// query heads (at q + j * q_stride, D floats each) see cached positions [0, n0 + j) and
// write their outputs at out + j * out_stride. The tokens share every K and V row they read.
//
// A windowed model (a draft, set_window) lets a row that has seen more than sink + window
// positions attend only to the first `sink` and to its recent ones from lo(r), a whole
// ATT_WINDOW_BLOCK on, so its cost stops growing with the context. A task skips the
// positions no row of it sees: its "virtual" positions are [0, sink) and then lo(0) on.
struct Queries {
    const float* q;
    size_t q_stride;
    float* out;
    size_t out_stride;
    int group, tokens, n0, D;
    int sink = 0, window = 0;                                        // window 0: the whole context

    int rows() const { return group * tokens; }
    int seen(int r) const { return n0 + r / group; }                 // positions row r sees
    int last() const { return n0 + tokens - 1; }                     // the most any row sees
    // the first recent position row r sees, or 0 when it sees them all
    int lo(int r) const {
        const int l = window ? std::max(seen(r) - window, 0) / ATT_WINDOW_BLOCK * ATT_WINDOW_BLOCK : 0;
        return l > sink ? l : 0;
    }
    // positions row r's own task would leave out; row 0's are the task's
    int skip(int r = 0) const { return lo(r) ? lo(r) - sink : 0; }
    int at(int v, int skip) const { return v < sink ? v : v + skip; }  // virtual position -> cached
    // row r's virtual positions: [0, head(r)) and [from(r), to(r)), in a task that skips `skip`
    int head(int r) const { return lo(r) ? sink : 0; }
    int from(int r, int skip) const { return lo(r) ? lo(r) - skip : 0; }
    int to(int r, int skip) const { return seen(r) - skip; }
    const float* qrow(int r) const { return q + (size_t)(r / group) * q_stride + (size_t)(r % group) * D; }
    float* orow(int r) const { return out + (size_t)(r / group) * out_stride + (size_t)(r % group) * D; }
};

// scores: [rows][last()] floats of scratch; row: ATT_BUF_ROWS x D floats, 64-byte aligned.
using AttendFn = void (*)(const Queries& a, const uint16_t* K, const uint16_t* V, float scale, float* scores,
                          float* row);

// The reference: one token at a time, one position at a time (a windowed row's positions
// in order: the sink's, then its recent ones). BF16: the products of ATT_BF16, from the bf16
// cache, queries and probabilities rounded to bf16 (its sums, one at a time, may differ from
// vdpbf16ps's pairs in the last bits).
template <bool BF16>
void attend_scalar(const Queries& a, const uint16_t* K, const uint16_t* V, float scale, float* scores,
                   float* row) {
    const int D = a.D;
    const auto op = [](float x) { return BF16 ? round_bf16(x) : x; };
    const auto k_value = [&](int t, int i) { return BF16 ? bf16_value(K[k_pair_at(t, i, D)]) : fp16_to_fp32(K[k_at(t, i, D)]); };
    const auto v_value = [&](int t, int i) { return BF16 ? bf16_value(V[v_pair_at(t, i, D)]) : fp16_to_fp32(V[(size_t)t * D + i]); };
    for (int r = 0; r < a.rows(); r++) {
        const int skip = a.skip(r), n = a.seen(r) - skip;
        const float* q = a.qrow(r);
        float* s = scores;
        for (int v = 0; v < n; v++) {
            const int t = a.at(v, skip);
            for (int i = 0; i < D; i++) row[i] = k_value(t, i);
            float acc = 0.f;
            for (int i = 0; i < D; i++) acc = std::fmaf(op(q[i]), row[i], acc);
            s[v] = acc * scale;
        }
        float mx = s[0], sum = 0.f;
        for (int t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
        for (int t = 0; t < n; t++) sum += s[t] = std::exp(s[t] - mx);
        const float inv = 1.0f / sum;
        for (int t = 0; t < n; t++) s[t] = op(s[t] * inv);
        float* o = a.orow(r);
        std::memset(o, 0, sizeof(float) * D);
        for (int v = 0; v < n; v++) {
            const int t = a.at(v, skip);
            for (int i = 0; i < D; i++) row[i] = v_value(t, i);
            for (int i = 0; i < D; i++) o[i] = std::fmaf(s[v], row[i], o[i]);
        }
    }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// Lines of the cache's next block, fetched a few at a time among the arithmetic on this one,
// so the stream from memory runs under the arithmetic: fetched in a burst before it, a block
// waited for memory and then left memory idle while its arithmetic ran (docs/tuning.md).
class Ahead {
  public:
    Ahead() = default;
    // `bytes` from `from`, spread over `steps` calls of step(); into L2 alone with `l2`
    Ahead(const void* from, size_t bytes, int steps, bool l2 = false)
        : p_((const char*)from), end_(p_ + bytes), l2_(l2) {
        const int lines = (int)((bytes + 63) / 64);
        every_ = steps > lines ? steps / lines : 1;
        per_ = lines > steps ? (lines + steps - 1) / steps : 1;
    }
    void step() {
        if (++n_ < every_ || p_ >= end_) return;
        n_ = 0;
        for (int j = 0; j < per_ && p_ < end_; j++, p_ += 64) line(p_);
    }
    void all() {                       // every line at once
        for (; p_ < end_; p_ += 64) line(p_);
    }

  private:
    const char* p_ = nullptr;
    const char* end_ = nullptr;
    int every_ = 1, per_ = 1, n_ = 0;
    bool l2_ = false;
    void line(const char* p) const {
        if (l2_) _mm_prefetch(p, _MM_HINT_T2);
        else _mm_prefetch(p, _MM_HINT_T0);
    }
};

// Blocks of the KV stream a task fetches ahead of its arithmetic: one block ahead left a
// one-token task waiting on memory on the Zen 5 (docs/tuning.md).
constexpr int AHEAD_BLOCKS = 2;
// Positions whose values, as floats (128 x D: 64 KB at D = 128, in L2), every row and every
// slice of D passes over, so V streams from memory once and is converted once. Longer blocks
// spread each slice's accumulators (loaded, stored, spilled) over more multiply-adds; 32
// positions, which fit L1, cost 8-token tasks 7% (docs/tuning.md). A task of one row group
// converts V where it uses it, with no buffer (attend.inc); for it the blocks only pace the
// fetches and the accumulators' reloads, and 128 measured best there too.
constexpr int VALUE_BLOCK = 128;
// Query rows summed together: each value loaded serves this many rows.
constexpr int VALUE_ROWS = 6;
// Positions whose scores are one tile: their K, as floats (D x 32: 16 KB at D = 128), serve
// every query row of the task from L1.
constexpr int SCORE_BLOCK = 32;
static_assert(SCORE_BLOCK % K_BLOCK == 0, "a score tile takes whole blocks of the K cache");
static_assert(ATT_WINDOW_BLOCK % SCORE_BLOCK == 0, "a window starts on whole score tiles");
// A task's K tiles, then its V blocks: one stream of blocks, block b + AHEAD_BLOCKS fetched
// under block b's arithmetic (the first ones at once, start()). Value blocks are cut where a
// windowed task's sink ends, so each is contiguous in the cache: the hb blocks of [0, hs),
// then those of [hs, n), n being the task's virtual positions.
struct KvBlocks {
    const Queries& a;
    const uint16_t *K, *V;
    int skip, n, hs, hb, nk, nv;
    bool l2;                           // Tuning's att_kv_l2_k: this task's requests go into L2
    KvBlocks(const Queries& q, const uint16_t* k, const uint16_t* v)
        : a(q), K(k), V(v), skip(q.skip()), n(q.last() - skip), hs(skip ? q.sink : 0),
          hb((hs + VALUE_BLOCK - 1) / VALUE_BLOCK), nk((n + SCORE_BLOCK - 1) / SCORE_BLOCK),
          nv(hb + (n - hs + VALUE_BLOCK - 1) / VALUE_BLOCK),
          l2(into_l2(q.tokens)) {}
    static bool into_l2(int tokens) {
        const int from = tuning().att_kv_l2_k;
        return from && tokens >= from;
    }
    int v_from(int j) const { return j < hb ? j * VALUE_BLOCK : hs + (j - hb) * VALUE_BLOCK; }
    int v_to(int j) const { return std::min(j < hb ? hs : n, v_from(j) + VALUE_BLOCK); }
    const uint16_t* k_at(int t0) const { return K + (size_t)a.at(t0, skip) * a.D; }   // a score tile's K
    const uint16_t* v_at(int j) const { return V + (size_t)a.at(v_from(j), skip) * a.D; }   // value block j
    // block b's lines (the K tiles, then the value blocks), spread over `steps` steps; none past the last
    Ahead ahead(int b, int steps) const {
        if (b >= nk + nv) return Ahead();
        if (b < nk) {
            const int t = b * SCORE_BLOCK;
            return Ahead(k_at(t), (size_t)k_cache_positions(std::min(SCORE_BLOCK, n - t)) * a.D * 2, steps, l2);
        }
        return Ahead(v_at(b - nk), (size_t)(v_to(b - nk) - v_from(b - nk)) * a.D * 2, steps, l2);
    }
    void start() const {
        for (int b = 1; b < AHEAD_BLOCKS; b++) ahead(b, 1).all();
    }
};

// The work buffer beside the scores, per thread: either block as floats.
constexpr int ATT_BUF_ROWS = SCORE_BLOCK > VALUE_BLOCK ? SCORE_BLOCK : VALUE_BLOCK;

// ATT_AMX's tiles: 16 query rows, a value step of 32 positions (16 pairs).
constexpr int AMX_ROWS = 16, AMX_POS = 32;
// A task's rows in whole tiles: ATT_AMX reads and writes scratch rows past its own.
constexpr int att_tile_rows(int rows) { return (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; }
// ATT_AMX's work buffer, offsets in floats: accumulators [rows][D], queries [rows][D] bf16, a
// step's tail of value pairs [16][D] and of probabilities [16][32] bf16, a step's output
// [2][16][16] (on a cache line, as D is a multiple of 16).
struct AmxLayout {
    size_t acc, q, v_tail, p_tail, out, end;
    constexpr AmxLayout(int rows, int D)
        : acc(0), q(acc + (size_t)rows * D), v_tail(q + (size_t)rows * D / 2), p_tail(v_tail + (size_t)AMX_ROWS * D),
          out(p_tail + AMX_ROWS * AMX_POS / 2), end(out + 2 * AMX_ROWS * 16) {}
};
// One task's scratch: the scores of `rows` rows (in whole tiles) over up to `ctx` positions,
// then the work buffer on a cache line of its own (16 floats of room to get there).
constexpr size_t att_scratch_floats(int rows, int ctx, int D) {
    return (size_t)att_tile_rows(rows) * ctx + std::max((size_t)ATT_BUF_ROWS * D, AmxLayout(att_tile_rows(rows), D).end) + 16;
}
inline float* att_buffer(float* scores, int rows, int ctx) {
    return (float*)(((uintptr_t)(scores + (size_t)att_tile_rows(rows) * ctx) + 63) & ~(uintptr_t)63);
}

namespace att256 {
struct Vec {
    using F = __m256;
    static constexpr int W = 8, ROWS = 2, REGS = 16;     // 8 score accumulators
    static constexpr int DIRECT_ROWS = 2;                // as many rows' score accumulators as fit
    static F zero() { return _mm256_setzero_ps(); }
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
    static F half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static F exp(F x) { return exp_neg(x); }
    static float hsum(F v) {
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
    }
};
#include "attend.inc"
}  // namespace att256
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
namespace att512 {
struct Vec {
    using F = __m512;
    static constexpr int W = 16, ROWS = 6, REGS = 32;    // 12 score accumulators
    static constexpr int DIRECT_ROWS = 8;                // a draft's 7 query heads a KV head, in one group
    static F zero() { return _mm512_setzero_ps(); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
    static F half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static F bcast(const float* p) { return _mm512_set1_ps(*p); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static F exp(F x) { return exp_neg512(x); }
    static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};
#include "attend.inc"
}  // namespace att512
#pragma GCC pop_options

// bf16 products: a target of their own, so the float kernels above compile as before.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")
namespace att512 {
#include "attend_bf16.inc"
}  // namespace att512
#pragma GCC pop_options

// AMX tiles: a target of their own, for the same reason.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace att512 {
#include "attend_amx.inc"
}  // namespace att512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// SiLU(gate) * up over n values, with the same exp.
void swiglu_avx2(const float* gate, const float* up, float* out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 neg = _mm256_min_ps(g, _mm256_sub_ps(_mm256_setzero_ps(), g));      // -|g|
        const __m256 e = exp_neg(neg);                                                   // e^-|g|
        const __m256 one = _mm256_set1_ps(1.0f);
        // sigmoid: 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0 -- one division either way
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
#pragma GCC pop_options

void swiglu_scalar(const float* gate, const float* up, float* out, int n) {
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// RMSNorm's sum of squares, in double: value i goes to lane i % 16 and the lanes are then
// added in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1). One order for the reference and the AVX2
// version, which agree bit for bit; a single chain of dependent adds over the hidden size
// cost more than the rest of the norm (docs/tuning.md). A float's square is exact in
// double, so a multiply-add is too.
constexpr int SS_LANES = 16;

double fold_lanes(double* l, const float* x, int i, int n) {
    for (int j = 0; i + j < n; j++) l[j] += (double)x[i + j] * x[i + j];     // the tail, < 16 values
    for (int w = SS_LANES / 2; w; w /= 2)
        for (int j = 0; j < w; j++) l[j] += l[j + w];
    return l[0];
}

double sum_squares_scalar(const float* x, int n) {
    double l[SS_LANES] = {};
    int i = 0;
    for (; i + SS_LANES <= n; i += SS_LANES)
        for (int j = 0; j < SS_LANES; j++) l[j] += (double)x[i + j] * x[i + j];
    return fold_lanes(l, x, i, n);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
double sum_squares_avx2(const float* x, int n) {
    __m256d a[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    int i = 0;
    for (; i + SS_LANES <= n; i += SS_LANES)
        for (int q = 0; q < 4; q++) {
            const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * q));
            a[q] = _mm256_fmadd_pd(v, v, a[q]);
        }
    alignas(32) double l[SS_LANES];
    for (int q = 0; q < 4; q++) _mm256_store_pd(l + 4 * q, a[q]);
    return fold_lanes(l, x, i, n);
}

// out[i] = w[i] * (x[i] * r) for the whole eights of n; returns how many it did.
int scale_avx2(const float* x, const float* w, float r, int n, float* out) {
    const __m256 vr = _mm256_set1_ps(r);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vr)));
    return i;
}
#pragma GCC pop_options

// out = w * (x / rms(x)); out may be x.
void rms_norm(const float* x, const float* w, int n, float eps, float* out, int path) {
    const bool simd = path != PATH_SCALAR;
    const double ss = simd ? sum_squares_avx2(x, n) : sum_squares_scalar(x, n);
    const float r = 1.0f / std::sqrt((float)(ss / n) + eps);
    for (int i = simd ? scale_avx2(x, w, r, n, out) : 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

}  // namespace

// ============================================================================
// Weights as the model sees them
// ============================================================================

struct Mat {
    int fmt = -1, rows = 0, cols = 0;
    PackedMat pm{};
    const float* f32 = nullptr;
};

struct Layer {
    const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr,
                *qkv_bias = nullptr;
    Mat qkv, o, gate_up, down;
};

struct Model::Impl {
    ModelFile file;
    FileHeader h{};
    std::string err;
    int max_ctx = 0, vocab = 0, q_dim = 0, kv_dim = 0, qkv_rows = 0;
    int att_rows = 0;                  // query rows one attention task holds at most
    int cache_ctx = 0;                 // positions a head's cache region holds: max_ctx in whole K blocks
    const float* norm = nullptr;
    Mat embed, output;
    // A trimmed draft: its kept output rows, which token each is, and the request's extras.
    Mat trim;
    Packed extra;
    int n_extra = 0;
    std::vector<int32_t> ids;          // trim's tokens, then extra's
    std::vector<uint8_t> kept;         // [vocab_size]: 1 where trim or extra has the token
    std::vector<Layer> layers;
    // on 2 MB pages, as the weights: attention streams the whole cache every step
    std::unique_ptr<Buffer> kbuf, vbuf;
    uint16_t* kcache() const { return (uint16_t*)kbuf->data(); }
    uint16_t* vcache() const { return (uint16_t*)vbuf->data(); }
    std::vector<float> cos_t, sin_t;
    std::vector<float> x, xn, qkv, att, gu, hb, tmp, logits_tmp;
    std::vector<float> scratch;        // per thread: att_scratch_floats, a task's scores and work buffer
    QActs acts;
    bool loaded = false;
    int split_tiles = SPLIT_AUTO;
    int att_sink = 0, att_window = 0;  // set_window
    int att_mode = ATT_DEFAULT;        // set_attention
    bool profiling = false;
    double stage_secs[N_STAGES] = {}, lap_start = 0;

    // Closes the current stage: the time since the last lap goes to stage s.
    void lap(int s) {
        if (!profiling) return;
        const double t = now();
        stage_secs[s] += t - lap_start;
        lap_start = t;
    }

    bool fail(const std::string& m) { err = m; return false; }
    bool bind(const char* name, Mat& m, int rows, int cols);
    bool bind(const char* name, const float*& p, int n);
    void embed_row(int tok, float* out) const;
    int mm(const Mat& W, const float* x, int k, float* y, int rows, ThreadPool* pool, int path, int stage,
           bool quantized = false, int64_t ldy = 0);
    int out_rows() const { return trim.fmt < 0 ? vocab : trim.rows + n_extra; }
    int output_logits(int n, float* logits, ThreadPool* pool, int path);
    bool bind_trim();
    void allocate();
    int ffn_hidden(int k, bool quantize, ThreadPool* pool, int path);
    bool redo_on(ThreadPool* pool) const;
    struct RedoAttention;
    void attend_task(AttendFn attend, int layer, int kvh, int j0, int n, int pos, float scale, float* out,
                     size_t out_stride, float* scores) const;
    bool quantize_att(int j, int kvh, int path);
    int rows_in(const float* add, const float* w, bool quantize, int k, ThreadPool* pool, int path);
    int attention(int layer, int k, int pos, bool quantize_out, ThreadPool* pool, int path);
    void prep_head(int layer, int kvh, int j, int pos, int path);
    void store_kv(int layer, int kvh, int p, const float* k, const float* v, int path);
    int chunk(const int32_t* tok, int k, int pos, float* logits, int mode, float* hidden, int hidden_stride,
              ThreadPool* pool, int path);
};

bool Model::Impl::bind(const char* name, Mat& m, int rows, int cols) {
    const TensorEntry* e = file.find(name);
    if (!e) return fail(std::string("the file has no tensor ") + name);
    if ((int)e->rows != rows || (int)e->cols != cols)
        return fail(std::string("tensor ") + name + " has a shape that does not match the header");
    if (e->fmt != FMT_F32 && e->fmt != FMT_Q8 && e->fmt != FMT_Q4)
        return fail(std::string("tensor ") + name + " is not a weight matrix (f32, q8 or q4)");
    m.fmt = (int)e->fmt; m.rows = rows; m.cols = cols;
    if (e->fmt == FMT_F32) m.f32 = (const float*)file.data(e);
    else m.pm = file.matrix(e);
    const int64_t bad = e->fmt == FMT_F32 ? -1 : first_nonfinite_scale(m.pm);
    if (bad >= 0)
        return fail(std::string("tensor ") + name + " has a NaN or inf scale (block " + std::to_string(bad) +
                    "): the file is corrupt; export it again");
    return true;
}

bool Model::Impl::bind(const char* name, const float*& p, int n) {
    const TensorEntry* e = file.find(name);
    if (!e) return fail(std::string("the file has no tensor ") + name);
    if (e->fmt != FMT_F32 || (int64_t)(e->rows * e->cols) != n)
        return fail(std::string("tensor ") + name + " is not an f32 vector of the expected size");
    p = (const float*)file.data(e);
    return true;
}

// A trimmed draft's file holds output_ids (the kept tokens) and output_trim (their rows).
bool Model::Impl::bind_trim() {
    const TensorEntry* e = file.find("output_ids");
    if (!e) return true;
    const int n = (int)(e->rows * e->cols);
    if (e->fmt != FMT_I32 || n < 1 || n > (int)h.vocab_size) return fail("output_ids is not a list of token ids");
    if (!bind("output_trim", trim, n, h.hidden_size)) return false;
    if (trim.fmt == FMT_F32) return fail("output_trim must be quantized (q8 or q4)");
    const int32_t* p = (const int32_t*)file.data(e);
    ids.assign(p, p + n);
    kept.assign(h.vocab_size, 0);
    for (int32_t t : ids) {
        if (t < 0 || t >= vocab || kept[t]) return fail("output_ids holds an id outside the tokenizer or twice");
        kept[t] = 1;
    }
    return true;
}

Model::Model() : impl_(new Impl) {}
Model::~Model() {
    wait_redo_workers();    // a late SPLIT_REDO worker may still read the weights and activations
    delete impl_;
}
const char* Model::error() const { return impl_->err.c_str(); }
const FileHeader& Model::config() const { return impl_->h; }
int Model::max_context() const { return impl_->max_ctx; }
void Model::set_chunk(int tiles) { impl_->split_tiles = tiles; }
bool Model::set_window(int sink, int window) {
    if (sink < 0 || window < 0 || sink % ATT_WINDOW_BLOCK) return false;
    impl_->att_sink = sink;
    impl_->att_window = window;
    return true;
}
void Model::set_attention(int mode) { impl_->att_mode = mode; }
int Model::vocab() const { return impl_->vocab; }
int Model::out_rows() const { return impl_->out_rows(); }
const int32_t* Model::out_ids() const { return impl_->trim.fmt < 0 ? nullptr : impl_->ids.data(); }

int Model::set_extra_rows(const int32_t* tokens, int n) {
    Impl& m = *impl_;
    if (m.trim.fmt < 0) return 0;
    if (m.output.fmt == FMT_F32) return -1;
    for (size_t i = m.trim.rows; i < m.ids.size(); i++) m.kept[m.ids[i]] = 0;
    m.ids.resize(m.trim.rows);
    for (int i = 0; i < n; i++) {
        const int32_t t = tokens[i];
        if (t >= 0 && t < m.vocab && !m.kept[t]) { m.kept[t] = 1; m.ids.push_back(t); }
    }
    m.n_extra = (int)m.ids.size() - m.trim.rows;
    if (m.n_extra) m.extra.gather(m.output.pm, m.ids.data() + m.trim.rows, m.n_extra);
    return m.n_extra;
}

void Model::profile(bool on) {
    impl_->profiling = on;
    std::fill(impl_->stage_secs, impl_->stage_secs + N_STAGES, 0.0);
}

void Model::stage_seconds(double* secs) const { std::copy(impl_->stage_secs, impl_->stage_secs + N_STAGES, secs); }

static int64_t mat_bytes(const Mat& w) {
    return w.fmt == FMT_F32 ? (int64_t)w.rows * w.cols * 4 : packed_nbytes(w.fmt, w.rows, w.cols);
}

void Model::stage_bytes(int64_t* bytes) const {
    const Impl& m = *impl_;
    std::fill(bytes, bytes + N_STAGES, 0);
    for (const Layer& l : m.layers) {
        bytes[STAGE_QKV] += mat_bytes(l.qkv);
        bytes[STAGE_O] += mat_bytes(l.o);
        bytes[STAGE_GATE_UP] += mat_bytes(l.gate_up);
        bytes[STAGE_DOWN] += mat_bytes(l.down);
    }
    Mat out = m.output;                  // only the tokenizer's rows are ever read
    out.rows = m.vocab;
    if (m.trim.fmt >= 0) {               // a trimmed draft: its kept rows and the request's
        out = m.trim;
        if (m.n_extra) bytes[STAGE_OUTPUT] += packed_nbytes(m.output.fmt, m.n_extra, m.output.cols);
    }
    bytes[STAGE_OUTPUT] += mat_bytes(out);
}

int64_t Model::weight_bytes() const {
    int64_t b[N_STAGES], total = 0;
    stage_bytes(b);
    for (int s = 0; s < N_STAGES; s++) total += b[s];
    return total;
}

bool Model::load(const char* path, int max_context, bool in_memory) {
    Impl& m = *impl_;
    if (m.loaded) return m.fail("this Model is already loaded");
    if (!m.file.open(path, in_memory)) return m.fail(m.file.error());
    m.h = *m.file.header();
    const FileHeader& h = m.h;
    if (max_context < 1) return m.fail("max_context must be at least 1");
    m.max_ctx = max_context;
    m.vocab = (int)h.tokenizer_size;
    m.q_dim = h.num_heads * h.head_dim;
    m.kv_dim = h.num_kv_heads * h.head_dim;
    m.qkv_rows = m.q_dim + 2 * m.kv_dim;
    const int H = h.hidden_size, I = h.intermediate_size;
    if (!m.bind("embed", m.embed, h.vocab_size, H) || !m.bind("norm", m.norm, H)) return false;
    if (h.tie_embeddings) m.output = m.embed;
    else if (!m.bind("output", m.output, h.vocab_size, H)) return false;
    m.layers.resize(h.num_layers);
    char name[96];
    for (uint32_t i = 0; i < h.num_layers; i++) {
        Layer& L = m.layers[i];
        auto nm = [&](const char* s) { std::snprintf(name, sizeof name, "layers.%u.%s", i, s); return name; };
        if (!m.bind(nm("attn_norm"), L.attn_norm, H) || !m.bind(nm("ffn_norm"), L.ffn_norm, H) ||
            !m.bind(nm("qkv"), L.qkv, m.qkv_rows, H) || !m.bind(nm("o"), L.o, H, m.q_dim) ||
            !m.bind(nm("gate_up"), L.gate_up, 2 * I, H) || !m.bind(nm("down"), L.down, H, I))
            return false;
        if (h.qk_norm && (!m.bind(nm("q_norm"), L.q_norm, h.head_dim) || !m.bind(nm("k_norm"), L.k_norm, h.head_dim)))
            return false;
        if (h.qkv_bias && !m.bind(nm("qkv_bias"), L.qkv_bias, m.qkv_rows)) return false;
    }
    if (!m.bind_trim()) return false;
    // An allocation past physical memory may "succeed" and then kill the process when touched.
    const uint64_t kv_mb = (uint64_t)h.num_layers * h.num_kv_heads * h.head_dim * max_context * 4 >> 20;
    const uint64_t ram_mb = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) >> 20;
    const auto no_room = [&] {
        return m.fail("a context of " + std::to_string(max_context) + " tokens needs a " + std::to_string(kv_mb) +
                      " MB KV cache; this machine has " + std::to_string(ram_mb) + " MB: ask for a shorter max_context");
    };
    if (kv_mb >= ram_mb) return no_room();
    try {
        m.allocate();
    } catch (const std::exception&) {      // bad_alloc, or length_error past max_size
        return no_room();
    }
    m.loaded = true;
    return true;
}

// The caches and work buffers: sized by the header (already bounded) and max_context.
void Model::Impl::allocate() {
    const int max_context = max_ctx, H = h.hidden_size, I = h.intermediate_size;
    cache_ctx = k_cache_positions(max_context);
    const size_t cache = (size_t)h.num_layers * h.num_kv_heads * cache_ctx * h.head_dim;
    for (auto* b : {&kbuf, &vbuf}) {
        *b = std::make_unique<Buffer>((int64_t)(cache * sizeof(uint16_t)));
        if (!(*b)->data()) throw std::bad_alloc();
        std::memset((*b)->data(), 0, cache * sizeof(uint16_t));
    }
    const int half = h.head_dim / 2;
    cos_t.resize((size_t)max_context * half);
    sin_t.resize((size_t)max_context * half);
    for (int i = 0; i < half; i++) {      // as torch: theta ** (2i / d) in float32, then 1 / that
        const float inv = 1.0f / std::pow((float)h.rope_theta, (float)(2 * i) / (float)h.head_dim);
        for (int p = 0; p < max_context; p++) {
            const float f = (float)p * inv;
            cos_t[(size_t)p * half + i] = std::cos(f);
            sin_t[(size_t)p * half + i] = std::sin(f);
        }
    }
    const int K = MAX_K;
    x.resize((size_t)K * H); xn.resize((size_t)K * H); tmp.resize((size_t)K * H);
    qkv.resize((size_t)K * qkv_rows); att.resize((size_t)K * q_dim);
    gu.resize((size_t)K * 2 * I); hb.resize((size_t)K * I);
    logits_tmp.resize((size_t)K * vocab);
    const int group = h.num_heads / h.num_kv_heads;
    att_rows = att_task_rows(group);
    scratch.resize((size_t)online_cpus() * att_scratch_floats(att_rows, max_context, h.head_dim) + 64);
}

// ============================================================================
// The forward pass
// ============================================================================

void Model::Impl::embed_row(int tok, float* out) const {
    const int H = h.hidden_size;
    if (embed.fmt == FMT_F32) {
        std::memcpy(out, embed.f32 + (int64_t)tok * H, H * sizeof(float));
        return;
    }
    const int nb = H / QK, tile = tok / TILE, lane = tok % TILE, ch = block_chunks(embed.fmt);
    for (int b = 0; b < nb; b++) {
        const TileOffsets at = tile_offsets(embed.fmt, nb, tile, b);
        const float d = fp16_to_fp32(embed.pm.d[at.d + lane]);
        const uint8_t* q = embed.pm.q + at.q;
        for (int c = 0; c < ch; c++)
            for (int j = 0; j < CHUNK_ROW; j++) {
                const uint8_t v = q[chunk_offset(c, lane) + j];
                if (embed.fmt == FMT_Q4) {
                    out[b * QK + 4 * c + j] = (float)((v & 15) - 8) * d;
                    out[b * QK + 16 + 4 * c + j] = (float)((v >> 4) - 8) * d;
                } else {
                    out[b * QK + 4 * c + j] = (float)(v - 128) * d;
                }
            }
    }
}

// y[t * rows + r] for the first `rows` rows of W (the output layer stops at the tokenizer).
// `quantized`: acts already hold xin's blocks.
int Model::Impl::mm(const Mat& W, const float* xin, int k, float* y, int rows, ThreadPool* pool, int path,
                    int stage, bool quantized, int64_t ldy) {
    if (!ldy) ldy = rows;
    const int chunk_tiles = split_tiles;
    lap(STAGE_SERIAL);
    if (W.fmt == FMT_F32) {
        const int cols = W.cols;
        // the quantizer stops the other formats at a NaN or inf; this keeps f32 from passing one on
        for (int64_t i = 0; i < (int64_t)k * cols; i++)
            if (!std::isfinite(xin[i])) return E_NONFINITE;
        for_range(pool, rows, 0, [&](int b, int e, int) {
            for (int r = b; r < e; r++)
                for (int t = 0; t < k; t++) {
                    const float* w = W.f32 + (int64_t)r * cols;
                    const float* xv = xin + (int64_t)t * cols;
                    float s = 0.f;
                    for (int c = 0; c < cols; c++) s = std::fmaf(w[c], xv[c], s);
                    y[(int64_t)t * ldy + r] = s;
                }
        });
        lap(stage);
        return E_OK;
    }
    int64_t bad = 0;
    if (!quantized && acts.quantize(xin, k, W.cols, path, &bad) != Q_OK) return E_NONFINITE;
    lap(STAGE_QUANTIZE);
    PackedMat pm = W.pm;
    pm.rows = rows;
    pm.tiles = (int)tile_count(rows);
    const int rc = matmul_unwaited(pm, acts, y, ldy, path, pool, chunk_tiles);
    lap(stage);
    return rc == MM_OK ? E_OK : E_PATH;
}

// 512 bits on the AVX-512 path, because attention's own time falls by more than the
// 512-bit float math slows the matmuls after it, except in a short single-token pass
// (docs/tuning.md). The width is fixed per path: a k-token pass must equal k single-token
// passes bit for bit.
// ATT_BF16 has a kernel at 512 bits only (attention_mode says where it runs).
static AttendFn attend_for(int path, int D, int mode) {
    const int runs = attention_mode(path, mode, D);
    if (path == PATH_SCALAR) return runs == ATT_F32 ? attend_scalar<false> : attend_scalar<true>;
    if (runs == ATT_AMX) return att512::attend_amx;
    if (path == PATH_AVX512VNNI && D % 16 == 0) return runs == ATT_BF16 ? att512::attend_bf16 : att512::attend;
    return att256::attend;
}

// Tokens per attention task: one KV head and up to this many tokens, whose query heads all
// share each K and V row it reads (a verification pass reads the cache once per task, not once
// per token). As many as the scratch's `rows` hold, or half of k from Tuning's att_split_k,
// in chunks as even as they can be, as long as every thread still gets a task.
int attention_per(int k, int group, int KV, int threads, int rows) {
    const int split = tuning().att_split_k;
    int per = std::min(k, rows / group);
    if (split && k >= split && per == k) per = (k + 1) / 2;
    const int chunks = (k + per - 1) / per;
    per = (k + chunks - 1) / chunks;
    while (per > 1 && KV * ((k + per - 1) / per) < threads) per--;
    return per;
}

// A layer's attention tasks on the pool, handed out one at a time: task(kvh, j0, n, scratch)
// runs tokens [j0, j0 + n) of KV head kvh on its thread's scratch.
template <class F>
void attention_tasks(ThreadPool* pool, int KV, int k, int per, float* scratch, size_t per_thread, F&& task) {
    const int chunks = (k + per - 1) / per;
    for_range(pool, KV * chunks, 1, [&](int b, int e, int tid) {
        for (int t = b; t < e; t++) {
            const int j0 = t % chunks * per;
            task(t / chunks, j0, std::min(per, k - j0), scratch + (size_t)tid * per_thread);
        }
    });
}

// A layer's attention tasks as SPLIT_REDO pieces (their rows prepared): task t's outputs into
// the computing thread's scratch, its scores in that thread's attention scratch, then into att
// and, with quantize, acts.
struct Model::Impl::RedoAttention {
    Impl* m;
    AttendFn attend;
    std::atomic<bool>* bad;
    int layer, k, pos, per, path;
    float scale;
    bool quantize;

    int chunks() const { return (k + per - 1) / per; }
    int head_floats() const { return m->h.num_heads / m->h.num_kv_heads * m->h.head_dim; }    // a token's rows
    // Task t: KV head, first token and token count.
    std::tuple<int, int, int> task(int t) const {
        const int j0 = t % chunks() * per;
        return {t / chunks(), j0, std::min(per, k - j0)};
    }
    static void compute(const void* job, int b, int e, float* out, int tid) {
        const RedoAttention& r = *(const RedoAttention*)job;
        const Impl& m = *r.m;
        float* scores = r.m->scratch.data() + (size_t)tid * att_scratch_floats(m.att_rows, m.max_ctx, m.h.head_dim);
        for (int t = b; t < e; t++) {
            const auto [kvh, j0, n] = r.task(t);
            m.attend_task(r.attend, r.layer, kvh, j0, n, r.pos, r.scale, out + (size_t)(t - b) * r.per * r.head_floats(),
                          r.head_floats(), scores);
        }
    }
    static void commit(const void* job, int b, int e, float* out, int) {
        const RedoAttention& r = *(const RedoAttention*)job;
        Impl& m = *r.m;
        const int rows = r.head_floats();
        for (int t = b; t < e; t++) {
            const auto [kvh, j0, n] = r.task(t);
            for (int j = j0; j < j0 + n; j++) {
                std::memcpy(m.att.data() + (size_t)j * m.q_dim + (size_t)kvh * rows,
                            out + ((size_t)(t - b) * r.per + (j - j0)) * rows, (size_t)rows * sizeof(float));
                if (r.quantize && !m.quantize_att(j, kvh, r.path)) *r.bad = true;
            }
        }
    }
};
static_assert(sizeof(Model::Impl::RedoAttention) <= REDO_JOB_BYTES, "an attention job fits the pool's copy");

// A layer's attention, with the work around it on the threads that need it. Where each task
// holds every token of its KV head, it prepares those tokens' rows itself (prep_head): the
// thread that reads a head's new K and V rows is the one that wrote them, and thread 0 no
// longer prepares every head alone. Otherwise, and under redo (a task computed twice must not
// prepare its rows twice, and a late one must write nothing), thread 0 prepares them first.
// With quantize_out, each task quantizes its own outputs into acts for the o projection.
int Model::Impl::attention(int layer, int k, int pos, bool quantize_out, ThreadPool* pool, int path) {
    const int D = h.head_dim, KV = h.num_kv_heads, group = h.num_heads / KV;
    const float scale = (float)std::pow((double)D, -0.5);
    const size_t per_thread = att_scratch_floats(att_rows, max_ctx, D);
    const AttendFn attend = attend_for(path, D, att_mode);
    const int per = attention_per(k, group, KV, pool ? pool->size() : 1, att_rows);
    const bool redo = redo_on(pool) && (size_t)per * group * D <= REDO_SCRATCH_FLOATS;
    const bool whole = per == k && !redo;
    if (!whole)
        for (int j = 0; j < k; j++)
            for (int kvh = 0; kvh < KV; kvh++) prep_head(layer, kvh, j, pos, path);
    lap(STAGE_SERIAL);
    if (quantize_out && acts.shape(k, q_dim) != Q_OK) return E_NONFINITE;
    std::atomic<bool> bad{false};
    if (redo) {
        const RedoAttention job{this, attend, &bad, layer, k, pos, per, path, scale, quantize_out};
        pool->parallel_redo(KV * job.chunks(), 1, 1, RedoAttention::compute, RedoAttention::commit, &job, sizeof job);
        return bad ? E_NONFINITE : E_OK;
    }
    attention_tasks(pool, KV, k, per, scratch.data(), per_thread, [&](int kvh, int j0, int n, float* scores) {
        if (whole)
            for (int j = 0; j < k; j++) prep_head(layer, kvh, j, pos, path);
        attend_task(attend, layer, kvh, j0, n, pos, scale, att.data() + (size_t)j0 * q_dim + (size_t)kvh * group * D, q_dim,
                    scores);
        for (int j = j0; quantize_out && j < j0 + n; j++)
            if (!quantize_att(j, kvh, path)) bad = true;
    });
    return bad ? E_NONFINITE : E_OK;
}

// KV head kvh's attention for tokens [j0, j0 + n) of a pass at pos (their rows prepared): into
// out, token j0's query heads first and each token out_stride floats after the last, with
// `scores` (a thread's attention scratch) to work in.
void Model::Impl::attend_task(AttendFn attend, int layer, int kvh, int j0, int n, int pos, float scale, float* out,
                              size_t out_stride, float* scores) const {
    const int D = h.head_dim, KV = h.num_kv_heads, group = h.num_heads / KV;
    const size_t base = (((size_t)layer * KV + kvh) * cache_ctx) * D;
    const Queries a{qkv.data() + (size_t)j0 * qkv_rows + (size_t)kvh * group * D, (size_t)qkv_rows, out, out_stride,
                    group, n, pos + j0 + 1, D, att_sink, att_window};
    attend(a, kcache() + base, vcache() + base, scale, scores, att_buffer(scores, att_rows, max_ctx));
}

// Token j's attention outputs of KV head kvh, from att into acts' blocks for the o projection;
// false at a value that is not finite.
bool Model::Impl::quantize_att(int j, int kvh, int path) {
    const int64_t task_blocks = (int64_t)h.num_heads / h.num_kv_heads * h.head_dim / QK;
    const int64_t b0 = (int64_t)j * (q_dim / QK) + kvh * task_blocks;
    int64_t at = 0;
    return acts.quantize_blocks(att.data(), b0, b0 + task_blocks, path, &at) == Q_OK;
}

// Token j's qkv row, KV head kvh's share: the bias, the norms and rotations of the head's
// query heads and its key head, then its K and V rows into the cache at position pos + j.
void Model::Impl::prep_head(int layer, int kvh, int j, int pos, int path) {
    const Layer& L = layers[layer];
    const int D = h.head_dim, half = D / 2, group = h.num_heads / h.num_kv_heads, p = pos + j;
    const int q0 = kvh * group * D, k0 = q_dim + kvh * D, v0 = q_dim + kv_dim + kvh * D;
    float* row = &qkv[(size_t)j * qkv_rows];
    if (L.qkv_bias)
        for (const auto& [at, n] : {std::pair{q0, group * D}, {k0, D}, {v0, D}})
            for (int i = at; i < at + n; i++) row[i] += L.qkv_bias[i];
    const float* c = &cos_t[(size_t)p * half];
    const float* s = &sin_t[(size_t)p * half];
    for (int hd = 0; hd <= group; hd++) {          // the query heads, then the key head
        float* x0 = row + (hd < group ? q0 + hd * D : k0);
        if (L.q_norm) rms_norm(x0, hd < group ? L.q_norm : L.k_norm, D, (float)h.rms_eps, x0, path);
        for (int i = 0; i < half; i++) {
            const float a = x0[i], b = x0[i + half];
            x0[i] = a * c[i] + (-b) * s[i];
            x0[i + half] = b * c[i] + a * s[i];
        }
    }
    store_kv(layer, kvh, p, row + k0, row + v0, path);
}

// Position p's K and V rows of one KV head into the cache, as the path's attention reads them.
void Model::Impl::store_kv(int layer, int kvh, int p, const float* k, const float* v, int path) {
    const int D = h.head_dim;
    const size_t head = ((size_t)layer * h.num_kv_heads + kvh) * cache_ctx * D;
    uint16_t *K = kcache() + head, *V = vcache() + head;
    if (attention_mode(path, att_mode, D) != ATT_F32) {
        for (int i = 0; i < D; i++) K[k_pair_at(p, i, D)] = bf16_bits(k[i]);
        for (int i = 0; i < D; i++) V[v_pair_at(p, i, D)] = bf16_bits(v[i]);
        return;
    }
    uint16_t khalf[MAX_HEAD_DIM];        // the K row in fp16, on its way into the blocked cache
    f32_to_f16_row(k, D, khalf, path);
    for (int i = 0; i < D; i++) K[k_at(p, i, D)] = khalf[i];
    f32_to_f16_row(v, D, V + (size_t)p * D, path);
}

// ffn_hidden's pieces [b, e), each 512 values (16 blocks) of one token's row: SiLU(gate) * up
// into `out` (hb, or a SPLIT_REDO thread's scratch, piece by piece), and from there into hb and,
// with acts, acts' blocks (publish; a redo job's commit).
struct Swiglu {
    static constexpr int PIECE = 16 * QK;
    const float* gu;
    float* hb;
    QActs* acts;                // null: no quantizing
    std::atomic<bool>* bad;
    int I, per_row, path;

    std::pair<int, int> span(int c) const {
        const int lo = c % per_row * PIECE;
        return {lo, std::min(I, lo + PIECE)};
    }
    void compute(int b, int e, float* out, bool in_place) const {
        const auto fn = path == PATH_SCALAR ? swiglu_scalar : swiglu_avx2;
        for (int c = b; c < e; c++) {
            const auto [lo, hi] = span(c);
            const float* g = gu + (size_t)(c / per_row) * 2 * I;
            fn(g + lo, g + I + lo, in_place ? out + (size_t)(c / per_row) * I + lo : out + (size_t)(c - b) * PIECE, hi - lo);
        }
    }
    void publish(int b, int e, const float* scratch) const {
        for (int c = b; c < e; c++) {
            const auto [lo, hi] = span(c);
            const int64_t j = c / per_row;
            if (scratch) std::memcpy(hb + j * I + lo, scratch + (size_t)(c - b) * PIECE, (hi - lo) * sizeof(float));
            int64_t at = 0;
            if (acts && acts->quantize_blocks(hb, (j * I + lo) / QK, (j * I + hi) / QK, path, &at) != Q_OK) *bad = true;
        }
    }
    static void redo_compute(const void* job, int b, int e, float* scratch, int) { ((const Swiglu*)job)->compute(b, e, scratch, false); }
    static void redo_commit(const void* job, int b, int e, float* scratch, int) { ((const Swiglu*)job)->publish(b, e, scratch); }
};
static_assert(sizeof(Swiglu) <= REDO_JOB_BYTES, "a SwiGLU job fits the pool's copy");

// Whether the engine's matmuls run SPLIT_REDO on this pool: then the work between them that
// can goes in redo pieces too (a worker the OS takes away inside it no longer holds thread 0).
bool Model::Impl::redo_on(ThreadPool* pool) const { return resolve_split(split_tiles, pool) == SPLIT_REDO; }

// SiLU(gate) * up into hb and, with `quantize`, on into acts' 8-bit blocks for the down
// projection: each thread quantizes what it just computed, so the down matrix's input is
// never read across cores as floats. The results do not depend on the split: static ranges,
// each thread's sized to its speed (SPLIT_WEIGHTED; a shared counter costs a cross-core
// transfer per piece, and equal halves keep a faster core waiting for a slower one), or redo's.
int Model::Impl::ffn_hidden(int k, bool quantize, ThreadPool* pool, int path) {
    const int I = h.intermediate_size, per_row = (I + Swiglu::PIECE - 1) / Swiglu::PIECE;
    if (quantize && acts.shape(k, I) != Q_OK) return E_NONFINITE;
    std::atomic<bool> bad{false};
    const Swiglu job{gu.data(), hb.data(), quantize ? &acts : nullptr, &bad, I, per_row, path};
    if (redo_on(pool))
        pool->parallel_redo(k * per_row, 1, REDO_SCRATCH_FLOATS / Swiglu::PIECE, Swiglu::redo_compute, Swiglu::redo_commit,
                            &job, sizeof job);
    else
        for_range(pool, k * per_row, SPLIT_WEIGHTED, [&](int b, int e, int) {
            for (int c = b; c < e; c++) {      // each piece quantized while it is in L1
                job.compute(c, c + 1, hb.data(), true);
                job.publish(c, c + 1, nullptr);
            }
        });
    return bad ? E_NONFINITE : E_OK;
}

// A matmul's input, token by token: x_j += add_j (unless add is null), xn_j = RMSNorm(x_j)
// and, with `quantize`, xn_j's blocks into acts. At k >= 2 the tokens split over the pool in
// static ranges (sized to the threads' speeds, SPLIT_WEIGHTED), so each thread keeps its own
// rows of x in its cache from layer to layer and thread 0 no longer norms and quantizes every
// token alone; one token stays on thread 0.
int Model::Impl::rows_in(const float* add, const float* w, bool quantize, int k, ThreadPool* pool, int path) {
    const int H = h.hidden_size;
    lap(STAGE_SERIAL);
    if (quantize && acts.shape(k, H) != Q_OK) return E_NONFINITE;
    std::atomic<bool> bad{false};
    const auto rows = [&](int b, int e, int) {
        for (int j = b; j < e; j++) {
            float* xj = &x[(size_t)j * H];
            if (add)
                for (int i = 0; i < H; i++) xj[i] += add[(size_t)j * H + i];
            rms_norm(xj, w, H, (float)h.rms_eps, &xn[(size_t)j * H], path);
            int64_t at = 0;
            if (quantize && acts.quantize_blocks(xn.data(), (int64_t)j * H / QK, (int64_t)(j + 1) * H / QK, path,
                                                 &at) != Q_OK)
                bad = true;
        }
    };
    if (k == 1) rows(0, 1, 0);
    else for_range(pool, k, SPLIT_WEIGHTED, [&](int b, int e, int t) { rows(b, e, t); });
    lap(STAGE_QUANTIZE);
    return bad ? E_NONFINITE : E_OK;
}

int Model::Impl::chunk(const int32_t* tok, int k, int pos, float* logits, int mode, float* hidden,
                       int hidden_stride, ThreadPool* pool, int path) {
    const int H = h.hidden_size, I = h.intermediate_size, D = h.head_dim;
    const float eps = (float)h.rms_eps;
    if (profiling) lap_start = now();
    for (int j = 0; j < k; j++) embed_row(tok[j], &x[(size_t)j * H]);
    const float* carry = nullptr;      // the last down projection's output, not yet added into x
    for (uint32_t l = 0; l < h.num_layers; l++) {
        const Layer& L = layers[l];
        const bool q_in = L.qkv.fmt != FMT_F32, gu_in = L.gate_up.fmt != FMT_F32;
        int rc = rows_in(carry, L.attn_norm, q_in, k, pool, path);
        if (rc || (rc = mm(L.qkv, xn.data(), k, qkv.data(), qkv_rows, pool, path, STAGE_QKV, q_in))) return rc;
        const bool att_acts = L.o.fmt != FMT_F32 && (h.num_heads / h.num_kv_heads * D) % QK == 0;
        if ((rc = attention(l, k, pos, att_acts, pool, path))) return rc;
        lap(STAGE_ATTENTION);
        if ((rc = mm(L.o, att.data(), k, tmp.data(), H, pool, path, STAGE_O, att_acts))) return rc;
        if ((rc = rows_in(tmp.data(), L.ffn_norm, gu_in, k, pool, path))) return rc;
        if ((rc = mm(L.gate_up, xn.data(), k, gu.data(), 2 * I, pool, path, STAGE_GATE_UP, gu_in))) return rc;
        const bool quantized = L.down.fmt != FMT_F32;
        if ((rc = ffn_hidden(k, quantized, pool, path))) return rc;
        lap(STAGE_SWIGLU);
        if ((rc = mm(L.down, hb.data(), k, tmp.data(), H, pool, path, STAGE_DOWN, quantized))) return rc;
        carry = tmp.data();
        if (hidden || l + 1 == h.num_layers) {        // the layer's output is wanted whole here
            for (size_t i = 0; i < (size_t)k * H; i++) x[i] += tmp[i];
            carry = nullptr;
        }
        if (hidden)
            for (int j = 0; j < k; j++)
                std::memcpy(hidden + (size_t)l * hidden_stride * H + (size_t)j * H, &x[(size_t)j * H], H * sizeof(float));
    }
    if (mode == LOGITS_NONE) { lap(STAGE_SERIAL); return E_OK; }
    const int first = mode == LOGITS_LAST ? k - 1 : 0, n = k - first;
    for (int j = 0; j < n; j++) rms_norm(&x[(size_t)(first + j) * H], norm, H, eps, &xn[(size_t)j * H], path);
    return output_logits(n, logits, pool, path);
}

// The logits of the n normed rows in xn: the whole vocabulary, or a trimmed draft's kept
// rows followed by the request's extra rows (the same quantized input for both).
int Model::Impl::output_logits(int n, float* logits, ThreadPool* pool, int path) {
    if (trim.fmt < 0) return mm(output, xn.data(), n, logits, vocab, pool, path, STAGE_OUTPUT);
    const int64_t ld = out_rows();
    int rc = mm(trim, xn.data(), n, logits, trim.rows, pool, path, STAGE_OUTPUT, false, ld);
    if (rc || !n_extra) return rc;
    Mat ex;
    ex.fmt = extra.view().fmt; ex.rows = n_extra; ex.cols = trim.cols; ex.pm = extra.view();
    return mm(ex, xn.data(), n, logits + trim.rows, n_extra, pool, path, STAGE_OUTPUT, true, ld);
}

int Model::forward(const int32_t* tokens, int k, int pos, float* logits, int mode, float* hidden,
                   ThreadPool* pool, int path) {
    Impl& m = *impl_;
    if (!m.loaded) return E_NOT_LOADED;
    if (k < 1) return E_EMPTY;
    if (pos < 0 || pos + k > m.max_ctx) return E_CONTEXT;
    if (!path_supported(path) || attention_mode(path, m.att_mode, (int)m.h.head_dim) < 0) return E_PATH;
    for (int j = 0; j < k; j++)
        if (tokens[j] < 0 || tokens[j] >= (int)m.h.vocab_size) return E_TOKEN;
    PinScope pin(pool);
    for (int s = 0; s < k; s += MAX_K) {
        const int n = k - s < MAX_K ? k - s : MAX_K;
        const bool last = s + n == k;
        const int mode_here = mode == LOGITS_ALL ? LOGITS_ALL : (mode == LOGITS_LAST && last ? LOGITS_LAST : LOGITS_NONE);
        float* out = mode == LOGITS_ALL ? logits + (size_t)s * m.out_rows() : logits;
        float* hid = hidden ? hidden + (size_t)s * m.h.hidden_size : nullptr;
        const int rc = m.chunk(tokens + s, n, pos + s, out, mode_here, hid, k, pool, path);
        if (rc) return rc;
    }
    return E_OK;
}

// ============================================================================
// Attention alone, for `lab bench kernels` and `lab tune`
// ============================================================================

// [-1, 1): a realistic spread of scores.
static float uniform(Rng& rng) { return (float)(2 * rng.uniform() - 1); }

// n random K or V values in the cache's format for this path's attention (any layout: the
// values are random).
static void random_cache(uint16_t* c, size_t n, int path, int D, int mode, Rng& rng) {
    const bool bf16 = attention_mode(path, mode, D) != ATT_F32;
    for (size_t i = 0; i < n; i++) c[i] = bf16 ? bf16_bits(uniform(rng)) : fp32_to_fp16(uniform(rng));
}

int bench_attention(int D, int group, int tokens, int n0, int path, int reps, double* secs, int mode) {
    if (D < 16 || D % 16 || group < 1 || tokens < 1 || tokens > MAX_K || n0 < 1 || reps < 1 || path < 0 ||
        path >= PATH_COUNT || !path_supported(path) || attention_mode(path, mode, D) < 0)
        return 1;
    const int n = n0 + tokens - 1, R = group * tokens;
    const size_t cached = (size_t)k_cache_positions(n) * D;
    std::vector<uint16_t> K(cached), V(cached);
    std::vector<float> q((size_t)R * D), out((size_t)R * D), scratch(att_scratch_floats(R, n, D));
    Rng rng(1);
    for (auto* c : {&K, &V}) random_cache(c->data(), c->size(), path, D, mode, rng);
    for (auto& x : q) x = uniform(rng);
    float* row = att_buffer(scratch.data(), R, n);
    const Queries a{q.data(), (size_t)group * D, out.data(), (size_t)group * D, group, tokens, n0, D};
    const AttendFn attend = attend_for(path, D, mode);
    const float scale = 1.0f / std::sqrt((float)D);
    attend(a, K.data(), V.data(), scale, scratch.data(), row);     // warm-up: pages, caches
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        attend(a, K.data(), V.data(), scale, scratch.data(), row);
        secs[r] = now() - t0;
    }
    return 0;
}

int AttentionStage::init(int D, int group, int KV, int tokens, int n0, int layers, int64_t cycle_bytes, int path,
                         int mode) {
    if (D < 16 || D % 16 || group < 1 || KV < 1 || tokens < 1 || tokens > MAX_K || n0 < 1 || layers < 1 ||
        cycle_bytes < 0 || path < 0 || path >= PATH_COUNT || !path_supported(path) || attention_mode(path, mode, D) < 0)
        return 1;
    D_ = D, group_ = group, KV_ = KV, tokens_ = tokens, n0_ = n0, layers_ = layers, path_ = path, mode_ = mode;
    head_ = (size_t)k_cache_positions(n0 + tokens - 1) * D;
    cycle_ = (int)std::max<int64_t>(layers, (cycle_bytes + 4 * head_ * KV - 1) / (4 * head_ * KV));   // fp16 K and V
    const size_t heads = (size_t)cycle_ * KV;
    K_ = std::make_unique<Buffer>((int64_t)(2 * head_ * heads));       // on 2 MB pages, as the engine's
    V_ = std::make_unique<Buffer>((int64_t)(2 * head_ * heads));
    Rng rng(1);
    for (auto* c : {K_.get(), V_.get()}) random_cache((uint16_t*)c->data(), head_ * heads, path, D, mode, rng);
    q_.resize((size_t)tokens * KV * group * D);
    out_.resize(q_.size());
    for (auto& x : q_) x = uniform(rng);
    return 0;
}

int AttentionStage::time(ThreadPool* pool, int reps, double* secs) {
    if (!cycle_ || reps < 1) return 1;
    const int n = n0_ + tokens_ - 1, rows = att_task_rows(group_), threads = pool ? pool->size() : 1;
    const size_t stride = (size_t)KV_ * group_ * D_, per_thread = att_scratch_floats(rows, n, D_);
    std::vector<float> scratch((size_t)threads * per_thread + 16);
    const AttendFn attend = attend_for(path_, D_, mode_);
    const float scale = 1.0f / std::sqrt((float)D_);
    const int per = attention_per(tokens_, group_, KV_, threads, rows);
    const auto* K = (const uint16_t*)K_->data();
    const auto* V = (const uint16_t*)V_->data();
    PinScope pin(pool);
    const auto stage = [&](int first) {
        for (int l = first; l < first + layers_; l++)
            attention_tasks(pool, KV_, tokens_, per, scratch.data(), per_thread, [&](int kvh, int j0, int m, float* sc) {
                const Queries a{q_.data() + (size_t)j0 * stride + (size_t)kvh * group_ * D_, stride,
                                out_.data() + (size_t)j0 * stride + (size_t)kvh * group_ * D_, stride, group_, m,
                                n0_ + j0, D_};
                const size_t at = ((size_t)(l % cycle_) * KV_ + kvh) * head_;
                attend(a, K + at, V + at, scale, sc, att_buffer(sc, rows, n));
            });
    };
    stage(next_ + cycle_ - layers_);            // warm-up (scratch, the pool): the layers the last stage read
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        stage(next_);
        secs[r] = now() - t0;
        next_ = (next_ + layers_) % cycle_;
    }
    return 0;
}

}  // namespace lab
