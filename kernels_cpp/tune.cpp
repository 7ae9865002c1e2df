// tune.cpp — the engine's speed-only choices (Tuning, lab.h) in force, and the timing
// lab/tune.py chooses them by.
#include "clock.h"
#include "formats.h"
#include "threadpool.h"

namespace lab {

Tuning default_tuning() {
    Tuning t;
#ifdef LAB_PREFETCH     // a build flag for sweeps (lab/native.py)
    t.prefetch_k1 = t.prefetch_k1_q8 = LAB_PREFETCH;
#endif
    return t;
}

static Tuning& in_force() {
    static Tuning t = default_tuning();
    return t;
}

Tuning tuning() { return in_force(); }

int set_tuning(const Tuning& t) {
    constexpr int FAR = 1 << 20;       // past any stream a prefetch could still serve
    bool ok = t.guided_min_bytes > 0 && t.guided_from_bytes >= 0 && t.att_split_k >= 0 && t.att_kv_l2_k >= 0;
    for (int d : {t.prefetch_k1, t.prefetch_k1_q8, t.prefetch_l1_k, t.prefetch_l2_k, t.prefetch_l1_k_q8,
                  t.prefetch_l2_k_q8})
        ok = ok && d >= 0 && d <= FAR;
    for (int n : {t.q4_streams, t.q8_streams, t.streams_k2}) ok = ok && n >= 1 && n <= MAX_STREAMS && (n & (n - 1)) == 0;
    ok = ok && t.two_groups_k >= TWO_GROUPS_FIRST && t.two_groups_k <= TWO_GROUPS_LAST;
    ok = ok && t.streams_k5 >= 1 && t.streams_k5 <= 2 && t.streams_k9 >= 1 && t.streams_k9 <= 2;
    if (!ok) return 1;
    in_force() = t;
    return 0;
}

int bench_matmul(const PackedMat& W, int walk_tiles, int slice_tiles, const QActs& A, float* y, int path,
                 ThreadPool* pool, int chunk, int reps, double* secs, int first) {
    if (walk_tiles == W.tiles && slice_tiles == W.tiles) walk_tiles = slice_tiles = 0;   // W whole, padding rows too
    else if (slice_tiles < 1 || walk_tiles < slice_tiles || walk_tiles > W.tiles || W.rows != W.tiles * TILE)
        return MM_SHAPE;
    const int slices = walk_tiles ? walk_tiles / slice_tiles : 1, walks = walk_tiles ? W.tiles / walk_tiles : 1;
    const int nb = W.cols / QK;
    PinScope pin(pool);
    auto walk = [&](int w) {
        int rc = MM_OK;
        for (int s = 0; s < slices && rc == MM_OK; s++) {
            const TileOffsets at = tile_offsets(W.fmt, nb, ((int64_t)w * walk_tiles + s * slice_tiles), 0);
            const PackedMat part = walk_tiles ? PackedMat{W.fmt, slice_tiles * TILE, W.cols, slice_tiles, W.d + at.d,
                                                          W.q + at.q} : W;
            rc = matmul_unwaited(part, A, y, part.rows, path, pool, chunk);   // as the engine calls it
        }
        return rc;
    };
    if (first < 0) return MM_SHAPE;
    int rc = walk((first + walks - 1) % walks);     // warm-up (and the argument check): the walk before the first
    for (int r = 0; rc == MM_OK && r < reps; r++) {
        const double t0 = now();
        rc = walk((first + r) % walks);
        secs[r] = now() - t0;
    }
    wait_redo_workers();        // W and A are the caller's to free once this returns
    return rc;
}

}  // namespace lab
