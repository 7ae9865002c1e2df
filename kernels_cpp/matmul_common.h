// matmul_common.h — what every kernel path shares: the loop over rows and groups of
// sixteen blocks, with the last, partial group copied into zero-padded scratch.
#pragma once
#include <cstring>

#include "formats.h"
#include "lab.h"

namespace lab {

// One group of 16 blocks of one row: its fp16 scales and quantized bytes.
struct Group {
    const uint16_t* d;
    const uint8_t* q;
};

// Scratch for a partial group: zero scales make the padded blocks add exactly +0.
struct TailScratch {
    alignas(64) uint16_t d[16];
    alignas(64) uint8_t q[16 * Q8_BYTES];
};

inline Group row_group(const QMat& W, int r, int g, TailScratch& tail) {
    const int nb = W.cols / QK, bpb = W.fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES;
    const int64_t first = (int64_t)r * nb + g * 16;
    const int n = nb - g * 16 < 16 ? nb - g * 16 : 16;
    if (n == 16) return {W.d + first, W.q + first * bpb};
    std::memset(&tail, 0, sizeof tail);
    std::memcpy(tail.d, W.d + first, n * 2);
    std::memcpy(tail.q, W.q + first * bpb, (size_t)n * bpb);
    return {tail.d, tail.q};
}

}  // namespace lab
