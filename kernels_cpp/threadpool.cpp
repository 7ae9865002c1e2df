// threadpool.cpp — persistent pinned workers and a spin barrier.
//
// The caller is thread 0. Workers spin on a generation counter for a while after each
// job (a decode step issues hundreds of jobs a few microseconds apart), then sleep on a
// futex so an idle pool costs nothing.
#include "threadpool.h"

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>

namespace lab {

namespace {
constexpr int kSpinsBeforeSleep = 1 << 16;
thread_local bool t_pinned_by_scope = false;
std::atomic<int> g_redo_inside{0};     // workers inside a parallel_redo job, over every pool
constexpr int kSlots = 8;               // jobs a late worker may fall behind before its job's slot is reused
constexpr int kJobWords = REDO_JOB_BYTES / 8;
static_assert(REDO_JOB_BYTES % 8 == 0, "a job is copied in whole words");
constexpr int kHead = 5;

bool pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

// Thread t's range [bounds[t], bounds[t + 1]) of `items`: in proportion to its speed, or even
// while the speeds lie within WEIGHT_BAND of each other (or one is not yet measured, 0).
void split_by_speed(const double* speed, int n, int items, int* bounds) {
    const auto [lo, hi] = std::minmax_element(speed, speed + n);
    const bool even = *lo <= 0 || *hi < WEIGHT_BAND * *lo;
    double total = 0, before = 0;
    for (int t = 0; t < n; t++) total += speed[t];
    for (int t = 0; t < n; t++) {
        bounds[t] = even ? (int)((int64_t)items * t / n) : std::min(items, (int)std::lround(items * before / total));
        before += speed[t];
    }
    bounds[n] = items;
}

std::vector<int> allowed_cpus() {
    std::vector<int> out;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &set)) out.push_back(c);
    return out;
}
}  // namespace

// A job as the workers read it: written by thread 0 before the job's generation is published,
// and, for a parallel_redo job, read back by a worker that may run late, so it is checked
// against the generation before and after (a seqlock) instead of trusted.
struct alignas(64) Slot {
    std::atomic<uint32_t> gen{0};           // 0 while being written
    // redo?, pieces, epoch, compute, commit, items and piece sizes; the job; the threads' shares
    std::atomic<uint64_t> words[kHead + kJobWords + REDO_MAX_THREADS + 1] = {};
};

// A worker's copy of a job, either kind: parallel_for's (epoch, static ranges or chunks, items)
// or parallel_redo's (also its pieces' functions, the job's bytes and its pieces' bounds).
struct RedoJob {
    bool redo = false;
    bool ranges = false;        // parallel_for: static ranges, else chunks handed out
    int pieces = 0;             // parallel_redo's pieces, parallel_for's items
    int items = 0, least = 1, most = 1;     // parallel_redo: items, and in a piece
    uint64_t epoch = 0;
    PieceFn compute = nullptr, commit = nullptr;
    uint64_t job[kJobWords];
    int owned[REDO_MAX_THREADS + 1];        // thread t's share of the items: [owned[t], owned[t + 1])
    int first[REDO_MAX_THREADS + 1];        // and of the pieces: [first[t], first[t + 1])
    int bounds[REDO_MAX_PIECES + 1];        // piece p: items [bounds[p], bounds[p + 1])

    std::pair<int, int> range(int p) const { return {bounds[p], bounds[p + 1]}; }

    // Each of the n threads' shares in pieces that shrink as they go, from `most` items to `least`
    // (the last takes what is left under `least`): a thread out of its own takes the others'
    // smallest; false where there would be more pieces than REDO_MAX_PIECES.
    bool lay_out(int n) {
        pieces = 0;
        for (int t = 0; t < n; t++) {
            first[t] = pieces;
            for (int at = owned[t]; at < owned[t + 1]; pieces++) {
                const int left = owned[t + 1] - at;
                int size = std::min(most, std::max(least, left / 2));
                if (left - size < least && left <= most) size = left;
                if (pieces == REDO_MAX_PIECES) return false;
                bounds[pieces] = at;
                at += size;
            }
        }
        first[n] = pieces;
        bounds[pieces] = items;
        return true;
    }
};

// A thread's parallel_redo pieces in one job: their items and cycles.
struct Done {
    uint64_t items = 0, cycles = 0;
};

// What a thread is computing under parallel_redo, written only by that thread, so thread 0 can
// tell a holder gone missing, or a slower one, from one about to finish: the piece
// (epoch << 16 | piece) and when it began, and its finished pieces in its last two jobs, a slot
// each by the epoch's parity (epoch, then items << 40 | cycles), so that a report that comes in
// after thread 0 closed its job survives the next one.
struct alignas(64) Holding {
    std::atomic<uint64_t> piece{0}, since{0}, spent_epoch[2]{}, spent[2]{};

    void report(uint64_t epoch, const Done& d) {
        const int s = epoch & 1;
        spent_epoch[s].store(0, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        spent[s].store(std::min<uint64_t>(d.items, (1 << 24) - 1) << 40 | std::min<uint64_t>(d.cycles, (1ull << 40) - 1),
                       std::memory_order_relaxed);
        spent_epoch[s].store(epoch, std::memory_order_release);
    }
    // Job `epoch`'s report, or {0, 0} where there is none (or it changed while read).
    Done reported(uint64_t epoch) const {
        const int s = epoch & 1;
        if (spent_epoch[s].load(std::memory_order_acquire) != epoch) return {};
        const uint64_t v = spent[s].load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (spent_epoch[s].load(std::memory_order_relaxed) != epoch) return {};
        return {v >> 40, v & ((1ull << 40) - 1)};
    }
};

struct ThreadPool::Impl {
    int n = 1;
    bool pin = false;
    std::vector<int> cpus;
    std::vector<std::thread> threads;

    alignas(64) std::atomic<uint32_t> gen{0};
    alignas(64) std::atomic<uint64_t> next{0};      // handed-out chunks: epoch << 32 | the next item
    alignas(64) std::atomic<int> done{0};           // items of handed-out chunks finished
    alignas(64) std::atomic<int> sleepers{0};
    // Each thread's static range: epoch << 2 | 0 free, 1 taken by its thread, 2 taken by thread 0
    // (its thread had not come for it), 3 finished. A range is claimed before anything of the
    // job is read, so a worker late for a job thread 0 has finished reads nothing of it.
    struct alignas(64) Claim { std::atomic<uint64_t> v{0}; };
    std::unique_ptr<Claim[]> claims;
    std::atomic<bool> stop{false};

    RowFn fn = nullptr;
    void* ctx = nullptr;
    int items = 0, chunk = 0;
    // SPLIT_WEIGHTED: each thread's share of the speed (an average over recent calls, 0 until
    // measured), this call's ranges, and each thread's cycles and items in it
    std::vector<double> share;
    std::vector<int> bounds;
    struct alignas(64) Spent { uint64_t cycles = 0; int items = 0; };
    std::vector<Spent> spent;
    int slow_tid = -1;          // ThreadPool::slow: the emulated slow core's thread, -1 for none
    double slow_extra = 0;      // its spin per unit of its work time: factor - 1
    // parallel_redo: the jobs' slots, the job under way (0: none), each piece's last commit
    // (epoch << 1, | 1 once written), and each thread's scratch
    Slot slots[kSlots];
    std::atomic<uint64_t> cur_epoch{0};
    uint64_t epochs = 0;
    std::unique_ptr<std::atomic<uint64_t>[]> commits{new std::atomic<uint64_t>[REDO_MAX_PIECES]()};
    std::unique_ptr<std::atomic<uint64_t>[]> takes{new std::atomic<uint64_t>[REDO_MAX_PIECES]()};   // the epoch it was last taken in
    std::vector<std::unique_ptr<float[]>> scratch;
    std::unique_ptr<Holding[]> holding;
    // Each worker's time an item over thread 0's in its recent jobs (thread 0's own), 1 until measured
    static constexpr int kRatios = 8;
    std::vector<std::array<double, kRatios>> ratios;
    std::vector<int> ratio_at;
    std::pair<uint64_t, double> closed[2] = {};             // the last two redo jobs, a slot by parity: epoch, thread 0's cycles an item
    std::vector<std::array<uint64_t, 2>> learned;           // each worker's jobs learned from, a slot by parity

    void publish(uint32_t g, const RedoJob& j) {
        Slot& s = slots[g % kSlots];
        s.gen.store(0, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        const uint64_t head[kHead] = {(uint64_t)j.redo | (uint64_t)j.ranges << 1 | (uint64_t)j.pieces << 8, j.epoch,
                                      (uint64_t)j.compute, (uint64_t)j.commit,
                                      (uint64_t)j.items | (uint64_t)j.least << 32 | (uint64_t)j.most << 48};
        for (int i = 0; i < kHead; i++) s.words[i].store(head[i], std::memory_order_relaxed);
        for (int i = 0; j.redo && i < kJobWords; i++) s.words[kHead + i].store(j.job[i], std::memory_order_relaxed);
        for (int i = 0; j.redo && i <= n; i++) s.words[kHead + kJobWords + i].store((uint64_t)j.owned[i], std::memory_order_relaxed);
        s.gen.store(g, std::memory_order_release);
    }

    // Job g as published, or false where its slot has since been reused (the job is long done).
    bool read(uint32_t g, RedoJob& j) {
        const Slot& s = slots[g % kSlots];
        if (s.gen.load(std::memory_order_acquire) != g) return false;
        uint64_t head[kHead];
        for (int i = 0; i < kHead; i++) head[i] = s.words[i].load(std::memory_order_relaxed);
        const bool redo = head[0] & 1;
        for (int i = 0; redo && i < kJobWords; i++) j.job[i] = s.words[kHead + i].load(std::memory_order_relaxed);
        for (int i = 0; redo && i <= n; i++) j.owned[i] = (int)s.words[kHead + kJobWords + i].load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (s.gen.load(std::memory_order_relaxed) != g) return false;
        j.redo = redo;
        j.ranges = head[0] >> 1 & 1;
        j.pieces = (int)(head[0] >> 8);
        j.epoch = head[1];
        j.compute = (PieceFn)head[2];
        j.commit = (PieceFn)head[3];
        j.items = (int)(uint32_t)head[4];
        j.least = (int)(head[4] >> 32 & 0xFFFF);
        j.most = (int)(head[4] >> 48);
        return !redo || j.lay_out(n);
    }

    // Writes piece p from this thread's scratch if no thread has begun to.
    void try_commit(const RedoJob& j, int p, int tid) {
        float* scr = scratch[tid].get();
        uint64_t v = commits[p].load(std::memory_order_acquire);
        if (v >> 1 >= j.epoch || !commits[p].compare_exchange_strong(v, j.epoch << 1, std::memory_order_acq_rel))
            return;
        const auto [b, e] = j.range(p);
        j.commit(j.job, b, e, scr, tid);
        commits[p].store(j.epoch << 1 | 1, std::memory_order_release);
    }

    // On the emulated slow core (ThreadPool::slow), a spin (factor - 1) times as long as the
    // work that began at t0, so each piece it takes, static, handed out or redone, takes
    // `factor` times as long, as on a slower core, rather than the core going missing for whole
    // scheduler slices as it does beside a co-runner.
    void slow_down(uint64_t t0, int self) const {
        if (self != slow_tid) return;
        const uint64_t t1 = __rdtsc(), until = t1 + (uint64_t)((double)(t1 - t0) * slow_extra);
        while (__rdtsc() < until) _mm_pause();
    }

    // Piece p into thread tid's scratch.
    void compute(const RedoJob& j, int p, int tid) {
        const uint64_t t0 = __rdtsc();
        const auto [b, e] = j.range(p);
        j.compute(j.job, b, e, scratch[tid].get(), tid);
        slow_down(t0, tid);
    }

    bool claim_piece(int p, uint64_t epoch) {
        uint64_t v = takes[p].load(std::memory_order_relaxed);
        return v < epoch && takes[p].compare_exchange_strong(v, epoch, std::memory_order_acq_rel);
    }

    // Piece p by thread tid, written out unless another thread has begun to write it.
    void do_piece(const RedoJob& j, int p, int tid, Done& done) {
        const uint64_t t0 = __rdtsc();
        Holding& h = holding[tid];
        h.since.store(t0, std::memory_order_relaxed);
        h.piece.store(j.epoch << 16 | (uint64_t)p, std::memory_order_release);
        compute(j, p, tid);
        try_commit(j, p, tid);
        const auto [b, e] = j.range(p);
        done.items += e - b;
        done.cycles += __rdtsc() - t0;
        h.report(j.epoch, done);
    }

    // Thread tid's own pieces (its share of them, in order), then, from the back, those of the
    // threads after it that none has taken yet; a worker stops once the job is over.
    Done take_pieces(const RedoJob& j, int tid) {
        Done done;
        for (int v = 0; v < n; v++) {
            const int t = (tid + v) % n, lo = j.first[t], hi = j.first[t + 1];
            for (int i = 0; i < hi - lo; i++) {
                if (tid && cur_epoch.load() != j.epoch) return done;
                const int p = v == 0 ? lo + i : hi - 1 - i;
                if (claim_piece(p, j.epoch)) do_piece(j, p, tid, done);
            }
        }
        return done;
    }

    // The median of worker t's recent times an item over thread 0's.
    double ratio(int t) const {
        std::array<double, kRatios> r = ratios[t];
        std::nth_element(r.begin(), r.begin() + kRatios / 2, r.end());
        return r[kRatios / 2];
    }

    // Each worker's time an item over thread 0's, from its report on job j and, where it came in
    // late, on the redo job before: a worker slow enough that thread 0 redoes its pieces finishes
    // them after the job is closed, and it is the one whose speed matters most.
    void learn_ratios(const RedoJob& j, double per_item) {
        closed[j.epoch & 1] = {j.epoch, per_item};
        for (int t = 1; t < n; t++)
            for (const auto& [e, own] : closed) {
                const Done d = holding[t].reported(e);
                if (!e || own <= 0 || !d.items || learned[t][e & 1] == e) continue;
                learned[t][e & 1] = e;
                ratios[t][ratio_at[t]++ % kRatios] = std::clamp((double)d.cycles / (double)d.items / own, 0.25, 4.0);
            }
    }

    // A redo job's epoch: the next, or the one after where that has the last redo job's parity,
    // so that job's report slots and `closed` entry outlive the parallel_for jobs between them.
    uint64_t redo_epoch() {
        const uint64_t last = std::max(closed[0].first, closed[1].first);
        uint64_t e = ++epochs;
        if (last && (e - last) % 2 == 0) e = ++epochs;
        return e;
    }

    // Each thread's share of job j's items, by its speed (1 / its ratio, as redo_speeds()).
    void share_out(RedoJob& j) const {
        double speed[REDO_MAX_THREADS];
        for (int t = 0; t < n; t++) speed[t] = t ? 1 / ratio(t) : 1.0;
        split_by_speed(speed, n, j.items, j.owned);
    }

    // Who holds piece p of job j, as far as thread 0 can tell: the worker and when it began,
    // or {0, 0} for none seen (handed out but not yet begun, or being written).
    std::pair<int, uint64_t> holder(const RedoJob& j, int p) const {
        const uint64_t tag = j.epoch << 16 | (uint64_t)p;
        for (int t = 1; t < n; t++) {
            if (holding[t].piece.load(std::memory_order_acquire) != tag) continue;
            const uint64_t since = holding[t].since.load(std::memory_order_relaxed);
            if (holding[t].piece.load(std::memory_order_acquire) == tag) return {t, since};
        }
        return {0, 0};
    }

    // Whether thread 0, at `per_item` cycles an item, should compute the unwritten piece p
    // itself at `now`: its holder is gone (3 of its time for the piece since it began, 3 of
    // thread 0's since thread 0 began waiting where none is seen), or it is slow enough that
    // thread 0 would finish the piece well first.
    bool redo_now(const RedoJob& j, int p, double per_item, uint64_t waiting, uint64_t now) const {
        if (per_item <= 0) return now - waiting >= (1 << 18);
        const auto [b, e] = j.range(p);
        const double own = per_item * (e - b);
        const auto [t, since] = holder(j, p);
        if (!t) return now - waiting >= 3 * own;
        const double r = ratio(t), began = (double)since;
        return now >= began + 3 * std::max(1.0, r) * own || began + r * own > now + 1.25 * own;
    }

    // Thread 0, once the pieces are handed out: every piece written at this epoch, computing a
    // piece too where redo_now says so.
    void sweep(const RedoJob& j, double per_item) {
        for (int p = j.pieces - 1; p >= 0; p--) {
            uint64_t waiting = 0;
            for (;;) {
                const uint64_t v = commits[p].load(std::memory_order_acquire);
                if (v == (j.epoch << 1 | 1)) break;
                const uint64_t now = __rdtsc();
                if (!waiting) waiting = now;
                if (v >> 1 == j.epoch || !redo_now(j, p, per_item, waiting, now)) {
                    _mm_pause();        // being written, or its holder may yet finish
                    continue;
                }
                compute(j, p, 0);
                try_commit(j, p, 0);
            }
        }
    }

    // Counted in g_redo_inside before anything the job points to is read, and only while the
    // job is under way, so that once wait_redo_workers() has seen none, none will read it.
    void redo_worker(const RedoJob& j, int tid) {
        g_redo_inside.fetch_add(1);
        if (cur_epoch.load() == j.epoch) take_pieces(j, tid);
        g_redo_inside.fetch_sub(1);
    }

    // fn over [b, e) as thread tid's, run by thread `self`.
    void run(int b, int e, int tid, int self) {
        const uint64_t t0 = __rdtsc();
        fn(ctx, b, e, tid);
        slow_down(t0, self);
    }

    // Thread r's static range, run by thread `self` (r's own, or thread 0 taking it over).
    void run_range(int r, int self) {
        const bool weighted = chunk == SPLIT_WEIGHTED;
        const int b = weighted ? bounds[r] : (int)((int64_t)items * r / n),
                  e = weighted ? bounds[r + 1] : (int)((int64_t)items * (r + 1) / n);
        const uint64_t t0 = __rdtsc();
        if (b < e) run(b, e, r, self);
        if (weighted) spent[r] = {__rdtsc() - t0, e - b};
    }

    bool claim(int r, uint64_t epoch, int how) {
        uint64_t free = epoch << 2;
        return claims[r].v.compare_exchange_strong(free, epoch << 2 | how, std::memory_order_acq_rel);
    }

    // Chunks of job j until none are left: fixed (chunk > 0) or guided (chunk < 0), each claimed
    // before anything of the job is read. The item count is the job's own copy: once thread 0
    // has seen every item done, it may set up the next job while `next` still says this one,
    // and a worker that read the next job's larger count would claim items past this job's end.
    void take_chunks(const RedoJob& j, int tid) {
        const uint64_t epoch = j.epoch;
        for (;;) {
            uint64_t v = next.load(std::memory_order_acquire);
            const int b = (int)(uint32_t)v;
            if (v >> 32 != epoch || b >= j.pieces) return;
            const int share = (j.pieces - b) / (2 * n), c = chunk > 0 ? chunk : std::max(share, -chunk);
            const int e = std::min(j.pieces, b + c);
            if (!next.compare_exchange_weak(v, epoch << 32 | (uint32_t)e, std::memory_order_acq_rel)) continue;
            run(b, e, tid, tid);
            done.fetch_add(e - b, std::memory_order_release);
        }
    }

    void work(const RedoJob& j, int tid) {
        if (!j.ranges) return take_chunks(j, tid);
        if (!claim(tid, j.epoch, 1)) return;        // thread 0 has taken it over
        run_range(tid, tid);
        claims[tid].v.store(j.epoch << 2 | 3, std::memory_order_release);
    }

    void worker(int tid) {
        if (pin) pin_self(cpus[tid]);
        uint32_t seen = 0;
        for (;;) {
            int spins = 0;
            uint32_t g;
            while ((g = gen.load(std::memory_order_acquire)) == seen) {
                if (++spins < kSpinsBeforeSleep) {
                    _mm_pause();
                    continue;
                }
                sleepers.fetch_add(1);
                if (gen.load() == seen) gen.wait(seen);
                sleepers.fetch_sub(1);
                spins = 0;
            }
            seen = g;
            if (stop.load(std::memory_order_acquire)) return;
            RedoJob j;
            if (!read(g, j)) continue;      // a job long done without this worker
            if (j.redo) redo_worker(j, tid);
            else work(j, tid);
        }
    }

    // This call's ranges: in proportion to the threads' shares of the speed, or equal while
    // those lie within WEIGHT_BAND of each other.
    void weigh() { split_by_speed(share.data(), n, items, bounds.data()); }

    // Each thread's share of the speed in the call just done (items a cycle, over all the
    // threads'), folded into the running average; calls where a thread had nothing are skipped.
    void learn() {
        constexpr double AVERAGE_OVER = 8;      // calls: a matrix or two of a pass
        double total = 0;
        for (const Spent& s : spent) {
            if (s.items == 0 || s.cycles == 0) return;
            total += (double)s.items / s.cycles;
        }
        for (int t = 0; t < n; t++) {
            const double now = (double)spent[t].items / spent[t].cycles / total;
            share[t] = share[t] == 0 ? now : share[t] + (now - share[t]) / AVERAGE_OVER;
        }
    }

    // Publishes job j and wakes the workers for it; returns its generation.
    uint32_t start_job(const RedoJob& j) {
        const uint32_t g = gen.load(std::memory_order_relaxed) + 1;    // only thread 0 moves it
        publish(g, j);
        gen.fetch_add(1);
        if (sleepers.load() > 0) gen.notify_all();
        return g;
    }
};

ThreadPool::ThreadPool(int nthreads, const std::vector<int>& cpus, bool pin) : impl_(new Impl) {
    Impl& p = *impl_;
    p.n = nthreads < 1 ? 1 : nthreads;
    p.cpus = cpus.empty() ? allowed_cpus() : cpus;
    p.pin = pin && (int)p.cpus.size() >= p.n;
    p.share.assign(p.n, 0.0);
    p.bounds.assign(p.n + 1, 0);
    p.spent.assign(p.n, {});
    p.claims.reset(new Impl::Claim[p.n]);
    for (int t = 0; t < p.n; t++) p.scratch.emplace_back(new float[REDO_SCRATCH_FLOATS]);
    p.holding.reset(new Holding[p.n]);
    p.ratios.assign(p.n, {});
    for (auto& r : p.ratios) r.fill(1.0);
    p.ratio_at.assign(p.n, 0);
    p.learned.assign(p.n, {0, 0});
    for (int t = 1; t < p.n; t++) p.threads.emplace_back([this, t] { impl_->worker(t); });
}

ThreadPool::~ThreadPool() {
    impl_->stop.store(true, std::memory_order_release);
    impl_->start_job(RedoJob{});
    for (auto& t : impl_->threads) t.join();
    delete impl_;
}

int ThreadPool::size() const { return impl_->n; }
void ThreadPool::slow(int tid, double factor) {
    impl_->slow_tid = factor > 1 && tid >= 0 && tid < impl_->n ? tid : -1;
    impl_->slow_extra = factor > 1 ? factor - 1 : 0;
}
std::vector<double> ThreadPool::shares() const { return impl_->share; }
std::vector<double> ThreadPool::redo_speeds() const {
    std::vector<double> out(impl_->n, 1.0);
    for (int t = 1; t < impl_->n; t++) out[t] = 1 / impl_->ratio(t);
    return out;
}
int ThreadPool::cpu(int tid) const { return impl_->pin ? impl_->cpus[tid] : -1; }
bool ThreadPool::pinned() const { return impl_->pin; }

void ThreadPool::parallel_for(int n, int chunk, RowFn fn, void* ctx) {
    Impl& p = *impl_;
    if (n <= 0) return;
    p.fn = fn;
    p.ctx = ctx;
    if (p.n == 1) return p.run(0, n, 0, 0);
    PinScope scope(this);
    p.items = n;
    p.chunk = chunk;
    if (chunk == SPLIT_WEIGHTED) p.weigh();
    RedoJob j;
    j.epoch = ++p.epochs;
    j.ranges = chunk == 0 || chunk == SPLIT_WEIGHTED;
    j.pieces = n;                   // a parallel_for job's items
    for (int t = 0; t < p.n; t++) p.claims[t].v.store(j.epoch << 2, std::memory_order_relaxed);
    p.next.store(j.epoch << 32, std::memory_order_relaxed);
    p.done.store(0, std::memory_order_relaxed);
    p.start_job(j);
    if (!j.ranges) {
        p.take_chunks(j, 0);
        while (p.done.load(std::memory_order_acquire) < n) _mm_pause();
        return;
    }
    p.work(j, 0);
    // a worker that has not come for its range by the time thread 0 is done with its own is
    // taken to be away (descheduled, or asleep): thread 0 runs that range itself
    bool taken_over = false;
    for (int t = 1; t < p.n; t++) {
        if (p.claim(t, j.epoch, 2)) {
            taken_over = true;
            p.run_range(t, 0);
            p.claims[t].v.store(j.epoch << 2 | 3, std::memory_order_release);
        }
        while (p.claims[t].v.load(std::memory_order_acquire) != (j.epoch << 2 | 3)) _mm_pause();
    }
    if (chunk == SPLIT_WEIGHTED && !taken_over) p.learn();
}

void ThreadPool::parallel_redo(int items, int least, int most, PieceFn compute, PieceFn commit, const void* job,
                               int job_bytes) {
    Impl& p = *impl_;
    if (items <= 0) return;
    RedoJob j;
    j.redo = true;
    j.items = items;
    j.epoch = p.redo_epoch();
    j.compute = compute;
    j.commit = commit;
    std::memset(j.job, 0, sizeof j.job);
    std::memcpy(j.job, job, std::min(job_bytes, REDO_JOB_BYTES));
    j.most = std::clamp(most, 1, 0xFFFF);
    j.least = std::clamp(least, 1, j.most);
    const bool shared = p.n > 1 && p.n <= REDO_MAX_THREADS;
    if (shared) p.share_out(j);
    if (!shared || !j.lay_out(p.n)) {      // or more pieces than commits: thread 0 alone, in pieces of `most`
        for (int b = 0; b < items; b += j.most) {
            const int e = std::min(items, b + j.most);
            const uint64_t t0 = __rdtsc();
            compute(j.job, b, e, p.scratch[0].get(), 0);
            p.slow_down(t0, 0);
            commit(j.job, b, e, p.scratch[0].get(), 0);
        }
        return;
    }
    PinScope scope(this);
    p.cur_epoch.store(j.epoch);     // before the job is published: a worker checks it after reading the job
    p.start_job(j);
    const Done own = p.take_pieces(j, 0);
    const double per_item = own.items ? (double)own.cycles / (double)own.items : 0;
    p.sweep(j, per_item);
    p.cur_epoch.store(0);
    p.learn_ratios(j, per_item);
}

void wait_redo_workers() {
    while (g_redo_inside.load() != 0) std::this_thread::yield();
}

PinScope::PinScope(ThreadPool* pool) {
    if (!pool || !pool->pinned() || t_pinned_by_scope) return;
    if (pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) != 0) return;
    active_ = pin_self(pool->cpu(0));
    t_pinned_by_scope = active_;
}

PinScope::~PinScope() {
    if (!active_) return;
    pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
    t_pinned_by_scope = false;
}

}  // namespace lab
