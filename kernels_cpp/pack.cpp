// pack.cpp — from the split layout (row after row) to the kernels' tiles of 16 rows
// (the layout: lab.h, PackedMat, and docs/science.md §2).
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "formats.h"
#include "lab.h"

namespace lab {

int64_t packed_scale_count(int rows, int cols) {
    return tile_count(rows) * TILE * (cols / QK);   // in 64 bits: rows near 2^31 must not wrap
}

int64_t packed_byte_count(int fmt, int rows, int cols) {
    return packed_scale_count(rows, cols) * block_bytes(fmt);
}

int64_t packed_nbytes(int fmt, int rows, int cols) {
    return packed_scale_count(rows, cols) * SCALE_BYTES + packed_byte_count(fmt, rows, cols);
}

// Big matrices go on 2 MB pages where the kernel allows: a decode step walks every byte
// once, and 4 KB pages would cost a TLB miss every 4 KB of it.
void* alloc_huge(size_t bytes) {
    constexpr size_t HUGE_PAGE = 2u << 20;
    if (bytes < HUGE_PAGE) return std::aligned_alloc(64, (size_t)line_up((int64_t)bytes));
    void* p = std::aligned_alloc(HUGE_PAGE, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
    if (p) madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

Buffer::~Buffer() { std::free(p_); }

Packed::Packed() = default;
Packed::~Packed() { std::free(mem_); }

int64_t Packed::nbytes() const {
    return mem_ ? packed_nbytes(m_.fmt, m_.rows, m_.cols) : 0;
}

// A fresh packed matrix's memory in mem (the old one freed): its scales, then its bytes on a
// line of their own.
static void take_regions(void*& mem, int fmt, int rows, int cols, uint16_t** d, uint8_t** q) {
    const int64_t dbytes = line_up(packed_scale_count(rows, cols) * SCALE_BYTES);
    std::free(mem);
    mem = alloc_huge((size_t)(dbytes + line_up(packed_byte_count(fmt, rows, cols))));
    *d = (uint16_t*)mem;
    *q = (uint8_t*)mem + dbytes;
}

int Packed::pack(const QMat& W) {
    if (W.fmt != FMT_Q4 && W.fmt != FMT_Q8) return MM_BAD_FORMAT;
    if (W.rows < 1 || W.cols < QK || W.cols % QK) return MM_SHAPE;
    const int nb = W.cols / QK, tiles = (int)tile_count(W.rows);
    const int bpb = block_bytes(W.fmt), chunks = block_chunks(W.fmt);
    uint16_t* d;
    uint8_t* q;
    take_regions(mem_, W.fmt, W.rows, W.cols, &d, &q);
    const uint8_t flip = W.fmt == FMT_Q8 ? 0x80 : 0;   // q8 bytes enter vpdpbusd unsigned
    for (int t = 0; t < tiles; t++) {
        for (int b = 0; b < nb; b++) {
            const TileOffsets at = tile_offsets(W.fmt, nb, t, b);
            uint8_t* dst = q + at.q;
            for (int i = 0; i < TILE; i++) {
                const int r = t * TILE + i;
                if (r >= W.rows) {
                    d[at.d + i] = 0;
                    for (int c = 0; c < chunks; c++) std::memset(dst + chunk_offset(c, i), flip, CHUNK_ROW);
                    continue;
                }
                d[at.d + i] = W.d[(int64_t)r * nb + b];
                const uint8_t* src = W.q + ((int64_t)r * nb + b) * bpb;
                for (int c = 0; c < chunks; c++)
                    for (int j = 0; j < CHUNK_ROW; j++) dst[chunk_offset(c, i) + j] = src[c * CHUNK_ROW + j] ^ flip;
            }
        }
    }
    m_ = PackedMat{W.fmt, W.rows, W.cols, tiles, d, q};
    return MM_OK;
}

int Packed::gather(const PackedMat& src, const int32_t* rows, int n) {
    if (src.fmt != FMT_Q4 && src.fmt != FMT_Q8) return MM_BAD_FORMAT;
    if (n < 1) return MM_SHAPE;
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= src.rows) return MM_SHAPE;
    const int nb = src.cols / QK, tiles = (int)tile_count(n), chunks = block_chunks(src.fmt);
    const int64_t ns = packed_scale_count(n, src.cols), nq = packed_byte_count(src.fmt, n, src.cols);
    uint16_t* d;
    uint8_t* q;
    take_regions(mem_, src.fmt, n, src.cols, &d, &q);
    std::memset(d, 0, (size_t)ns * SCALE_BYTES);            // rows past n: zero scales, the zero byte
    std::memset(q, src.fmt == FMT_Q8 ? 0x80 : 0, (size_t)nq);
    for (int i = 0; i < n; i++) {
        const int st = rows[i] / TILE, sl = rows[i] % TILE, dt = i / TILE, dl = i % TILE;
        for (int b = 0; b < nb; b++) {
            const TileOffsets from = tile_offsets(src.fmt, nb, st, b), to = tile_offsets(src.fmt, nb, dt, b);
            d[to.d + dl] = src.d[from.d + sl];
            for (int c = 0; c < chunks; c++)
                std::memcpy(q + to.q + chunk_offset(c, dl), src.q + from.q + chunk_offset(c, sl), CHUNK_ROW);
        }
    }
    m_ = PackedMat{src.fmt, n, src.cols, tiles, d, q};
    return MM_OK;
}

}  // namespace lab
