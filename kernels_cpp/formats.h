// formats.h — the lab's block formats, where their blocks lie in the packed tiles, and fp16
// conversion.
//
// The shapes follow ggml's Q8_0 and Q4_0 so a GGUF path stays open, but tensors are
// stored split: all of a tensor's fp16 scales first, then all of its quantized bytes.
// The rounding rules are those of docs/science.md §2 and are mirrored byte for byte by
// lab/formats.py.
#pragma once
#include <cstdint>
#include <cstring>

#include "lab.h"   // TILE and the Format codes the tile layout is made of

namespace lab {

constexpr int QK = 32;  // weights per block, for every format

// ----------------------------------------------------------------------------
// Block structs (the interleaved ggml view; the split layout stores the same fields apart)
// ----------------------------------------------------------------------------

struct BlockQ8 {            // 8-bit weights: value = q * d
    uint16_t d;             // fp16 scale
    int8_t q[QK];
};
static_assert(sizeof(BlockQ8) == 34, "BlockQ8 must match ggml's Q8_0");

struct BlockQ4 {            // 4-bit weights: value = (q - 8) * d
    uint16_t d;             // fp16 scale
    uint8_t q[QK / 2];      // low nibbles: weights 0-15, high nibbles: weights 16-31
};
static_assert(sizeof(BlockQ4) == 18, "BlockQ4 must match ggml's Q4_0");

// Sizes read off the structs, so the ggml shapes above are their only statement.
constexpr int SCALE_BYTES = sizeof(BlockQ8::d);     // one fp16 scale, in either format
constexpr int Q4_BYTES = sizeof(BlockQ4::q);        // quantized bytes per block
constexpr int Q8_BYTES = sizeof(BlockQ8::q);
static_assert(sizeof(BlockQ4::d) == SCALE_BYTES, "both formats share the scales region's type");

constexpr int block_bytes(int fmt) { return fmt == FMT_Q4 ? Q4_BYTES : Q8_BYTES; }

// Bytes padded to whole cache lines: a packed matrix's bytes start on the line after its
// scales, in memory and in a file.
constexpr int64_t line_up(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// ----------------------------------------------------------------------------
// The packed tile layout (lab.h, PackedMat): where each tile's blocks lie
// ----------------------------------------------------------------------------

// A chunk holds four bytes of each of a tile's rows: each row's bytes fill one 32-bit lane,
// and a chunk is one cache line and one 512-bit register.
constexpr int CHUNK_ROW = 4;                      // one row's bytes in a chunk
constexpr int CHUNK = TILE * CHUNK_ROW;           // a chunk's bytes
static_assert(CHUNK == 64, "a chunk is one cache line and one 512-bit register");
static_assert(Q4_BYTES % CHUNK_ROW == 0 && Q8_BYTES % CHUNK_ROW == 0, "a block fills whole chunks");

constexpr int block_chunks(int fmt) { return block_bytes(fmt) / CHUNK_ROW; }
constexpr int64_t tile_count(int64_t rows) { return (rows + TILE - 1) / TILE; }

// Tiles follow each other in one stream, and in a tile its nb blocks in pairs: a cache line
// with the pair's 2 x TILE scales, then each block's TILE rows of bytes (block_chunks
// chunks). A kernel thus reads every line of its share in order, and one thread's stream
// from memory outran the same bytes read as two streams, scales apart (docs/tuning.md).
constexpr int PAIR_SCALES = 2 * TILE * SCALE_BYTES;       // a pair's line of scales
static_assert(PAIR_SCALES == 64, "a pair's scales fill one cache line");
constexpr int64_t pair_bytes(int fmt) { return PAIR_SCALES + 2 * block_chunks(fmt) * CHUNK; }
// A tile's bytes: an odd last block has a pair's line of scales to itself.
constexpr int64_t packed_tile_bytes(int fmt, int nb) {
    return ((int64_t)nb + 1) / 2 * PAIR_SCALES + (int64_t)nb * block_chunks(fmt) * CHUNK;   // nb < 2^26
}

// Offsets add up: tile t's block b lies at offsets(t, 0) + offsets(0, b), so a kernel can
// walk a tile from its first block. d counts fp16 scales from the matrix's first byte, q
// bytes from the first block's bytes (PackedMat).
struct TileOffsets {
    int64_t d, q;           // the block's first scale and first byte
};
constexpr TileOffsets tile_offsets(int fmt, int nb, int64_t tile, int b) {
    const int64_t at = tile * packed_tile_bytes(fmt, nb) + b / 2 * pair_bytes(fmt);
    return {(at + b % 2 * TILE * SCALE_BYTES) / SCALE_BYTES, at + b % 2 * block_chunks(fmt) * CHUNK};
}
// Row `lane`'s bytes of chunk c, from the block's first byte.
constexpr int chunk_offset(int c, int lane) { return c * CHUNK + lane * CHUNK_ROW; }

static_assert(tile_offsets(FMT_Q4, 2, 0, 1).q == block_chunks(FMT_Q4) * CHUNK &&
              tile_offsets(FMT_Q8, 2, 0, 2).q == pair_bytes(FMT_Q8) &&
              tile_offsets(FMT_Q4, 3, 1, 0).q == 2 * PAIR_SCALES + 3 * block_chunks(FMT_Q4) * CHUNK &&
              tile_offsets(FMT_Q4, 3, 0, 1).d == TILE,
              "a pair's blocks back to back after its scales; an odd tile's last line of scales half used");

// ----------------------------------------------------------------------------
// fp16 <-> fp32, round to nearest even (what numpy's astype(float16) does)
// ----------------------------------------------------------------------------

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t fp32_to_fp16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00;         // NaN stays NaN
    if (ax >= 0x47800000u) return sign | 0x7c00;        // >= 65536 (or inf) -> inf
    uint32_t h, rem, half;
    if (ax >= 0x38800000u) {                            // normal half: rebias exponent 127 -> 15
        const uint32_t r = ax - 0x38000000u;
        h = r >> 13; rem = r & 0x1fffu; half = 0x1000u;
    } else {                                            // subnormal half: units of 2^-24
        const uint32_t e = ax >> 23;
        if (e < 102) return sign;                       // below 2^-25: rounds to zero
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t s = 126 - e;                     // 14..24
        h = m >> s; rem = m & ((1u << s) - 1); half = 1u << (s - 1);
    }
    if (rem > half || (rem == half && (h & 1))) h++;    // a carry into the exponent is correct
    return sign | (uint16_t)h;
}

inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return f32_from(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = (float)m * 0x1p-24f;            // exact
        return sign ? -v : v;
    }
    return f32_from(sign | ((e + 112) << 23) | (m << 13));
}

// bf16 as vcvtneps2bf16 rounds: to nearest, ties to even, a denormal to a zero of its sign
// (NaN payloads aside), returned as the float it stands for.
inline float round_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7f800000u) == 0) return f32_from(x & 0x80000000u);
    if ((x & 0x7fffffffu) > 0x7f800000u) return f;
    x += 0x7fffu + ((x >> 16) & 1);
    return f32_from(x & 0xffff0000u);
}

}  // namespace lab
