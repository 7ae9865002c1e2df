// threadpool.cpp — persistent pinned workers and a spin barrier.
//
// The caller is thread 0. Workers spin on a generation counter for a while after each
// job (a decode step issues hundreds of jobs a few microseconds apart), then sleep on a
// futex so an idle pool costs nothing.
#include "threadpool.h"

#include <immintrin.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

namespace lab {

namespace {
constexpr int kSpinsBeforeSleep = 1 << 16;
thread_local bool t_pinned_by_scope = false;

bool pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
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

struct ThreadPool::Impl {
    int n = 1;
    bool pin = false;
    std::vector<int> cpus;
    std::vector<std::thread> threads;

    alignas(64) std::atomic<uint32_t> gen{0};
    alignas(64) std::atomic<int> pending{0};
    alignas(64) std::atomic<int> next{0};
    alignas(64) std::atomic<int> sleepers{0};
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

    // fn over [b, e) on thread tid. On the emulated slow core each piece is followed by a spin
    // as long as (factor - 1) times the piece, so every piece it takes, static or handed out,
    // takes `factor` times as long, as on a slower core, rather than the core going missing
    // for whole scheduler slices as it does beside a co-runner.
    void run(int b, int e, int tid) {
        if (tid != slow_tid) return fn(ctx, b, e, tid);
        const uint64_t t0 = __rdtsc();
        fn(ctx, b, e, tid);
        const uint64_t t1 = __rdtsc(), until = t1 + (uint64_t)((double)(t1 - t0) * slow_extra);
        while (__rdtsc() < until) _mm_pause();
    }

    void work(int tid) {
        if (chunk == SPLIT_WEIGHTED) {
            const int b = bounds[tid], e = bounds[tid + 1];
            const uint64_t t0 = __rdtsc();
            if (b < e) run(b, e, tid);
            spent[tid] = {__rdtsc() - t0, e - b};
            return;
        }
        if (chunk == 0) {
            const int b = (int)((int64_t)items * tid / n), e = (int)((int64_t)items * (tid + 1) / n);
            if (b < e) run(b, e, tid);
            return;
        }
        if (chunk < 0) {
            int b = next.load(std::memory_order_relaxed);
            while (b < items) {
                const int share = (items - b) / (2 * n), c = share > -chunk ? share : -chunk;
                if (!next.compare_exchange_weak(b, b + c, std::memory_order_relaxed)) continue;
                run(b, b + c < items ? b + c : items, tid);
                b = next.load(std::memory_order_relaxed);
            }
            return;
        }
        for (;;) {
            const int b = next.fetch_add(chunk, std::memory_order_relaxed);
            if (b >= items) break;
            run(b, b + chunk < items ? b + chunk : items, tid);
        }
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
            work(tid);
            pending.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    // This call's ranges: in proportion to the threads' shares of the speed, or equal while
    // those lie within WEIGHT_BAND of each other.
    void weigh() {
        const auto [lo, hi] = std::minmax_element(share.begin(), share.end());
        const bool even = *lo <= 0 || *hi < WEIGHT_BAND * *lo;
        double before = 0;
        for (int t = 0; t < n; t++) {
            bounds[t] = even ? (int)((int64_t)items * t / n) : std::min(items, (int)std::lround(items * before));
            before += share[t];
        }
        bounds[n] = items;
    }

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

    void start_job() {
        gen.fetch_add(1);
        if (sleepers.load() > 0) gen.notify_all();
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
    for (int t = 1; t < p.n; t++) p.threads.emplace_back([this, t] { impl_->worker(t); });
}

ThreadPool::~ThreadPool() {
    impl_->stop.store(true, std::memory_order_release);
    impl_->start_job();
    for (auto& t : impl_->threads) t.join();
    delete impl_;
}

int ThreadPool::size() const { return impl_->n; }
void ThreadPool::slow(int tid, double factor) {
    impl_->slow_tid = factor > 1 && tid >= 0 && tid < impl_->n ? tid : -1;
    impl_->slow_extra = factor > 1 ? factor - 1 : 0;
}
std::vector<double> ThreadPool::shares() const { return impl_->share; }
int ThreadPool::cpu(int tid) const { return impl_->pin ? impl_->cpus[tid] : -1; }
bool ThreadPool::pinned() const { return impl_->pin; }

void ThreadPool::parallel_for(int n, int chunk, RowFn fn, void* ctx) {
    Impl& p = *impl_;
    if (n <= 0) return;
    p.fn = fn;
    p.ctx = ctx;
    if (p.n == 1) return p.run(0, n, 0);
    PinScope scope(this);
    p.items = n;
    p.chunk = chunk;
    if (chunk == SPLIT_WEIGHTED) p.weigh();
    p.next.store(0, std::memory_order_relaxed);
    p.pending.store(p.n - 1, std::memory_order_relaxed);
    p.start_job();
    p.work(0);
    while (p.pending.load(std::memory_order_acquire) != 0) _mm_pause();
    if (chunk == SPLIT_WEIGHTED) p.learn();
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
