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
    return tile_count(rows) * packed_tile_bytes(fmt, cols / QK);
}

int64_t first_nonfinite_scale(const PackedMat& W) {
    const int nb = W.cols / QK;
    for (int t = 0; t < W.tiles; t++)
        for (int b = 0; b < nb; b++) {
            const uint16_t* d = W.d + tile_offsets(W.fmt, nb, t, b).d;
            for (int i = 0; i < TILE; i++)
                if ((d[i] & 0x7c00) == 0x7c00) return ((int64_t)t * TILE + i) * nb + b;
        }
    return -1;
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
Packed::~Packed() {
    wait_redo_workers();    // a late SPLIT_REDO worker may still read the weights
    std::free(mem_);
}

int64_t Packed::nbytes() const {
    return mem_ ? packed_nbytes(m_.fmt, m_.rows, m_.cols) : 0;
}

// A fresh packed matrix's memory in mem (the old one freed), zeroed, and its d and q
// (PackedMat); every block's bytes set to `fill` in every row.
static void take_regions(void*& mem, int fmt, int rows, int cols, uint8_t fill, uint16_t** d, uint8_t** q) {
    const int64_t n = packed_nbytes(fmt, rows, cols);
    wait_redo_workers();        // a late SPLIT_REDO worker may still read the old matrix
    std::free(mem);
    mem = alloc_huge((size_t)n);
    std::memset(mem, 0, (size_t)n);
    *d = (uint16_t*)mem;
    *q = (uint8_t*)mem + PAIR_SCALES;
    const int nb = cols / QK;
    if (fill)
        for (int64_t t = 0; t < tile_count(rows); t++)
            for (int b = 0; b < nb; b++)
                std::memset(*q + tile_offsets(fmt, nb, t, b).q, fill, (size_t)block_chunks(fmt) * CHUNK);
}

int Packed::pack(const QMat& W) {
    if (W.fmt != FMT_Q4 && W.fmt != FMT_Q8) return MM_BAD_FORMAT;
    if (W.rows < 1 || W.cols < QK || W.cols % QK) return MM_SHAPE;
    const int nb = W.cols / QK, tiles = (int)tile_count(W.rows);
    const int bpb = block_bytes(W.fmt), chunks = block_chunks(W.fmt);
    uint16_t* d;
    uint8_t* q;
    const uint8_t flip = W.fmt == FMT_Q8 ? 0x80 : 0;   // q8 bytes enter vpdpbusd unsigned
    take_regions(mem_, W.fmt, W.rows, W.cols, flip, &d, &q);
    for (int t = 0; t < tiles; t++) {
        for (int b = 0; b < nb; b++) {
            const TileOffsets at = tile_offsets(W.fmt, nb, t, b);
            uint8_t* dst = q + at.q;
            for (int i = 0; i < TILE; i++) {
                const int r = t * TILE + i;
                if (r >= W.rows) continue;      // zero scale, the zero byte: take_regions
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
    uint16_t* d;
    uint8_t* q;
    take_regions(mem_, src.fmt, n, src.cols, src.fmt == FMT_Q8 ? 0x80 : 0, &d, &q);    // rows past n: zero
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
