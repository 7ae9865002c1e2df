// threadpool.cpp — persistent pinned workers and a spin barrier.
//
// The caller is thread 0. Workers spin on a generation counter for a while after each
// job (a decode step issues hundreds of jobs a few microseconds apart), then sleep on a
// futex so an idle pool costs nothing.
#include "threadpool.h"

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
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

    void work(int tid) {
        if (chunk == 0) {
            const int b = (int)((int64_t)items * tid / n), e = (int)((int64_t)items * (tid + 1) / n);
            if (b < e) fn(ctx, b, e, tid);
            return;
        }
        if (chunk < 0) {
            int b = next.load(std::memory_order_relaxed);
            while (b < items) {
                const int share = (items - b) / (2 * n), c = share > -chunk ? share : -chunk;
                if (!next.compare_exchange_weak(b, b + c, std::memory_order_relaxed)) continue;
                fn(ctx, b, b + c < items ? b + c : items, tid);
                b = next.load(std::memory_order_relaxed);
            }
            return;
        }
        for (;;) {
            const int b = next.fetch_add(chunk, std::memory_order_relaxed);
            if (b >= items) break;
            fn(ctx, b, b + chunk < items ? b + chunk : items, tid);
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
    for (int t = 1; t < p.n; t++) p.threads.emplace_back([this, t] { impl_->worker(t); });
}

ThreadPool::~ThreadPool() {
    impl_->stop.store(true, std::memory_order_release);
    impl_->start_job();
    for (auto& t : impl_->threads) t.join();
    delete impl_;
}

int ThreadPool::size() const { return impl_->n; }
int ThreadPool::cpu(int tid) const { return impl_->pin ? impl_->cpus[tid] : -1; }
bool ThreadPool::pinned() const { return impl_->pin; }

void ThreadPool::parallel_for(int n, int chunk, RowFn fn, void* ctx) {
    Impl& p = *impl_;
    if (p.n == 1 || n <= 0) {
        if (n > 0) fn(ctx, 0, n, 0);
        return;
    }
    PinScope scope(this);
    p.fn = fn;
    p.ctx = ctx;
    p.items = n;
    p.chunk = chunk;
    p.next.store(0, std::memory_order_relaxed);
    p.pending.store(p.n - 1, std::memory_order_relaxed);
    p.start_job();
    p.work(0);
    while (p.pending.load(std::memory_order_acquire) != 0) _mm_pause();
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
