// clock.h — wall time in seconds, for every timing the engine and the benchmarks take.
#pragma once
#include <chrono>

namespace lab {

inline double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace lab
