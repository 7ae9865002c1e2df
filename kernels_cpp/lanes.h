// lanes.h — where each block of a 16-block group lands in the SIMD kernels' registers,
// and the fixed order in which the sixteen per-residue sums are added at the end.
//
// Every path computes each block's dot product exactly in int32, then accumulates
// float(isum) * (d_w * d_a) into sixteen accumulators, one per block index mod 16, and
// finally adds them in one fixed tree. So every path gives the same bits as the scalar
// reference, and a k-token call gives the same bits as k single-token calls.
#pragma once

namespace lab {

// 512-bit kernels: lane 4k+j holds block 4j+k of the group.
constexpr int lane_block512(int p) { return 4 * (p % 4) + p / 4; }
// 256-bit kernels: two registers (lanes 0-7 and 8-15); lane 4h+j holds block 2j+h.
constexpr int lane_block256(int p) { return (p / 8) * 8 + 2 * (p % 4) + (p % 8) / 4; }

// The fixed tree over residues 0..15: r+8, then r+4, then r+2, then r+1.
inline float residue_tree(float R[16]) {
    for (int i = 0; i < 8; i++) R[i] += R[i + 8];
    for (int i = 0; i < 4; i++) R[i] += R[i + 4];
    for (int i = 0; i < 2; i++) R[i] += R[i + 2];
    return R[0] + R[1];
}

}  // namespace lab
