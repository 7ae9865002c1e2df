// threadpool.h — the pool's internals, shared by the C++ files that run work on it.
#pragma once
#include "lab.h"

#include <sched.h>

#include <utility>

namespace lab {

// Keeps the calling thread on the pool's CPU 0 for a whole loop of parallel_for calls,
// so the loop pays the two affinity syscalls once instead of per call.
class PinScope {
public:
    explicit PinScope(ThreadPool* pool);
    ~PinScope();
private:
    bool active_ = false;
    cpu_set_t saved_;
};

// parallel_for with a lambda: f(begin, end, tid).
template <class F>
void for_range(ThreadPool* pool, int n, int chunk, F&& f) {
    auto tramp = [](void* ctx, int b, int e, int tid) { (*static_cast<F*>(ctx))(b, e, tid); };
    if (!pool) {
        f(0, n, 0);
        return;
    }
    pool->parallel_for(n, chunk, tramp, (void*)&f);
}

}  // namespace lab
