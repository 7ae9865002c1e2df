// lab.h — what Python sees of the C++ (loaded by cppyy beside the compiled library).
//
// Plain types and pointers only: numpy arrays pass zero-copy as pointers, and nothing
// here needs the SIMD headers, so cling parses it in a blink.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace lab {

// ----------------------------------------------------------------------------
// CPU and kernel paths
// ----------------------------------------------------------------------------

enum Path : int {
    PATH_SCALAR = 0,       // the reference every SIMD kernel is checked against
    PATH_AVX2 = 1,         // AVX2 + FMA + F16C, dot products through maddubs/madd
    PATH_AVXVNNI = 2,      // Intel hybrids: the VEX vpdpbusd on 256-bit registers
    PATH_AVX512VNNI = 3,   // AVX-512 F/BW/VL + VNNI on 512-bit registers
    PATH_VNNI256_EVEX = 4, // the AVX-VNNI kernel with the EVEX vpdpbusd: tests it on AVX-512 CPUs
    PATH_COUNT = 5
};

struct CpuInfo {
    char vendor[16];
    char brand[64];
    int logical_cpus;
    bool sse42, avx, avx2, fma, f16c, avxvnni;
    bool avx512f, avx512dq, avx512bw, avx512vl, avx512vnni, avx512bf16;
    bool amx_tile, amx_bf16;
    bool os_avx, os_avx512, os_amx;   // the OS saves the wide registers, the tiles (XCR0)
    bool hybrid;                // performance + efficiency cores
};

CpuInfo cpu_info();
bool path_supported(int path);
int best_path();                // the fastest path this CPU runs
int active_path();              // best_path(), lowered by LAB_KERNEL_PATH when set
const char* path_name(int path);
int path_from_name(const char* name);  // -1 when unknown
int core_type(int cpu);         // hybrid CPUs: 0x40 performance, 0x20 efficiency; 0 otherwise/unknown
// Attention's products. ATT_F32: fp16 K and V, as floats, times float queries and
// probabilities. ATT_BF16: all four rounded to bf16 (K and V as the cache stores them), each
// product exact, summed in float two at a time (vdpbf16ps: twice the multiply-adds per
// instruction of float FMAs). ATT_AMX: the same operands and cache, the products summed 32 at
// a time by AMX tiles, in the unit's own order (a matrix unit: a verification pass's
// attention stops growing with its tokens). A model's cache holds what its attention reads,
// so one model runs one attention mode from its first position to its last.
// ATT_DEFAULT: the fastest the path has in hardware: AMX, else bf16, else f32.
enum AttentionMode : int { ATT_DEFAULT = -1, ATT_F32 = 0, ATT_BF16 = 1, ATT_AMX = 2 };
// What `mode` runs as on `path` for heads of head_dim values: ATT_F32, ATT_BF16 or ATT_AMX, or
// -1 where the path cannot. bf16 runs on the AVX-512 path of a CPU with AVX512_BF16, amx where
// it also has AMX-BF16 and the OS lends this process the tiles, both with head_dim a multiple
// of 16; the scalar reference runs both as bf16 operands summed one at a time.
int attention_mode(int path, int mode, int head_dim);

// ----------------------------------------------------------------------------
// Thread pool: persistent workers pinned to their CPUs, spin barrier, caller is thread 0
// ----------------------------------------------------------------------------

using RowFn = void (*)(void* ctx, int begin, int end, int tid);
// A piece of SPLIT_REDO work, items [begin, end), by pool thread tid: into `scratch` (compute),
// or from it to where it belongs (commit).
using PieceFn = void (*)(const void* job, int begin, int end, float* scratch, int tid);
constexpr int REDO_JOB_BYTES = 96;                  // a parallel_redo job's copied bytes, at most
constexpr int REDO_MAX_PIECES = 4096;
constexpr int REDO_MAX_THREADS = 64;
constexpr int REDO_SCRATCH_FLOATS = 64 * 16 * 16;    // a thread's scratch: 64 tiles of 16 tokens

class ThreadPool {
public:
    ThreadPool(int nthreads, const std::vector<int>& cpus, bool pin);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;
    int size() const;
    int cpu(int tid) const;     // the CPU a thread is pinned to, -1 when unpinned
    bool pinned() const;
    // Calls fn over [0, n) in pieces: static contiguous ranges when chunk == 0; chunks of
    // `chunk` items handed out from an atomic counter when chunk > 0; guided when chunk < 0:
    // each hand-out takes a 1/(2 x threads) share of what is left, never fewer than -chunk;
    // SPLIT_WEIGHTED: static ranges sized to the threads' speeds in earlier weighted calls.
    // A static range whose worker has not come for it by the time thread 0 has finished its
    // own (the OS took the worker's core, or it sleeps) is run by thread 0 instead.
    void parallel_for(int n, int chunk, RowFn fn, void* ctx);
    // SPLIT_REDO: items [0, items), each thread's share of them in proportion to its speed as
    // this pool has timed it (even while the speeds are close), walked in pieces that shrink
    // from `most` items to `least`. Each thread takes its own pieces in order, then the others'
    // that no thread has taken, from the back. A piece is computed into the thread's scratch and
    // written out by the first thread to finish it; once none is left to take, thread 0 computes
    // any still unwritten whose holder has gone missing, or is so slow that thread 0 would finish
    // first. It returns when every piece is written, even while a worker is still inside one:
    // `job` (job_bytes <= REDO_JOB_BYTES) is copied, and whatever it points to must outlive the
    // call until wait_redo_workers() (a late worker still reads it; it never writes). A pool of
    // more than REDO_MAX_THREADS runs it on thread 0 alone (the engine takes the guided split there).
    void parallel_redo(int items, int least, int most, PieceFn compute, PieceFn commit, const void* job, int job_bytes);
    // Emulates a slower core for the threads section (lab.slowcore): thread tid's pieces of
    // work each take `factor` times as long; a factor of 1 or less turns it off.
    void slow(int tid, double factor);
    // Each thread's share of the speed over recent SPLIT_WEIGHTED calls (0s until one ran).
    std::vector<double> shares() const;
    // Each thread's speed over thread 0's as parallel_redo has timed it (the median of its recent
    // jobs; 1 until measured): what a redo job's shares follow.
    std::vector<double> redo_speeds() const;
    struct Impl;
private:
    Impl* impl_;
};

int online_cpus();
// Waits until no pool's worker is inside a parallel_redo job: before freeing what one may read.
void wait_redo_workers();

// The matmuls' split: guided, shares shrinking to Tuning::guided_min_bytes of weights, because
// a weight stream wants long runs per thread (each jump restarts the prefetchers and strands
// the prefetches past a run's end) while the shrinking tail keeps the threads finishing
// together on a shared machine. A matrix under Tuning::guided_from_bytes goes in static ranges
// instead (SPLIT_WEIGHTED): each hand-out is an atomic on a line the other cores share, which on
// so short a stream costs more than the balancing buys. The measurements: docs/tuning.md.
constexpr int SPLIT_GUIDED = -1;
// Static ranges, each thread's sized to its speed as the pool measured it over its recent
// SPLIT_WEIGHTED calls, so a slower core (an efficiency core, or one shared with other work)
// gets less; equal ranges while the threads run within WEIGHT_BAND of each other. The small
// matrices of the guided split go this way.
constexpr int SPLIT_WEIGHTED = -(1 << 30);
// The guided split's matrices in pieces that either thread may compute (ThreadPool::parallel_redo):
// a piece's result is the same bits whoever computes it, so thread 0 need not wait for a worker
// the OS has taken away for a scheduler slice, as beside another busy process. The engine's
// matmuls only (Model waits for late workers before freeing what they read).
constexpr int SPLIT_REDO = -(1 << 29);
// The engine's default: SPLIT_REDO or SPLIT_GUIDED as Tuning::redo_split says.
constexpr int SPLIT_AUTO = -(1 << 28);
// The split a call with `chunk` runs on `pool`: SPLIT_AUTO as the tuning says, SPLIT_REDO where
// the pool can run it (2 to REDO_MAX_THREADS threads), else SPLIT_GUIDED; any other as given.
int resolve_split(int chunk, const ThreadPool* pool);
constexpr double WEIGHT_BAND = 1.10;
// A windowed attention's recent positions start on a multiple of this, whole tiles of its
// scores and values, so a task's tiles never span the positions it skips.
constexpr int ATT_WINDOW_BLOCK = 32;

// ----------------------------------------------------------------------------
// Tuning: the choices made for speed only, measured per machine by `lab tune` (lab/tune.py).
// None changes a result: they move prefetch addresses, pick one of two prefetch schemes and
// split tiles over threads; whatever changes arithmetic order stays fixed per kernel path.
// ----------------------------------------------------------------------------

constexpr int MAX_STREAMS = 4;     // a kernel reads a share in a power of two of streams up to this (Tuning)
// Tuning::two_groups_k's range: the AVX-512 kernel has both shapes built for the token counts
// between (one group up to TWO_GROUPS_LAST - 1 tokens, two groups from TWO_GROUPS_FIRST).
constexpr int TWO_GROUPS_FIRST = 6, TWO_GROUPS_LAST = 17;
constexpr int STREAMS_K5_FROM = 5;     // the token counts Tuning::streams_k5 caps: this many up to STREAMS_K9_FROM - 1
constexpr int STREAMS_K9_FROM = 9;     // the token counts Tuning::streams_k9 caps: this many and more

struct Tuning {
    // The SIMD kernels ask for their weight stream this far ahead, in bytes of a 4-bit stream
    // (an 8-bit one goes as many blocks ahead): one token into L1, per format, 0 for no request
    // (on a Zen 4 the hardware prefetcher alone kept one stream fastest); k >= 2 into L1 and L2,
    // per format: on a Zen 4 the 8-bit stream, twice the bytes a multiply-add, ran fastest nearer.
    int prefetch_k1 = 0, prefetch_k1_q8 = 0;
    int prefetch_l1_k = 4096, prefetch_l2_k = 16384;
    int prefetch_l1_k_q8 = 1024, prefetch_l2_k_q8 = 16384;
    // Whether 1 to 8 tokens of a format take the single-token scheme, or the k >= 2 one (past
    // eight the arithmetic binds, and the k >= 2 scheme's far requests into L2 stay). The same
    // defaults on every CPU: two 4-bit tokens in the single scheme took 1.6x as long on an Emerald
    // Rapids-class Xeon, where an earlier Intel default had them (docs/tuning.md).
    bool q4_single_k1 = true, q8_single_k1 = true;
    bool q4_single_k2 = false, q4_single_k3 = false, q4_single_k4 = false;
    bool q8_single_k2 = true, q8_single_k3 = false, q8_single_k4 = false;
    bool q4_single_k5 = false, q4_single_k6 = false, q4_single_k7 = false, q4_single_k8 = false;
    bool q8_single_k5 = false, q8_single_k6 = false, q8_single_k7 = false, q8_single_k8 = false;
    // Whether the AVX-512 kernel's accumulators for 2 or 4 tokens of a format go through memory
    // each block rather than stay in registers: stream-bound cases where a machine first
    // measured ran faster that way (docs/tuning.md).
    bool q4_mem_acc_k2 = true, q4_mem_acc_k4 = false, q8_mem_acc_k2 = true, q8_mem_acc_k4 = true;
    // How many streams a SIMD kernel reads a thread's share in, per format: 1, 2 or 4
    // (MAX_STREAMS) equal parts of its tiles, a block of each in turn. One core kept more lines
    // in flight over several streams than over one (docs/tuning.md).
    int q4_streams = 1, q8_streams = 1;
    // The most streams the AVX-512 kernel reads a share in at two to four tokens (1, 2 or 4) and at
    // five to eight (1 or 2: it takes at most two there): four streams made one-token passes
    // faster while they made four- and eight-token ones slower on one machine, so each token
    // range is measured apart (docs/tuning.md).
    int streams_k2 = 1, streams_k5 = 1;
    // The most streams the AVX-512 kernel reads a share in from nine tokens on, 1 or 2: two
    // streams keep twice the accumulators, which read faster from memory and slower from cache
    // (docs/tuning.md).
    int streams_k9 = 1;
    // From this many tokens the AVX-512 kernel takes a tile's tokens in two groups, the second
    // reading the tiles' weights again from cache: in one group, one accumulator a token and
    // stream beside a block's 8 weight registers crowds the 32 registers (docs/tuning.md).
    int two_groups_k = 9;
    // Whether SPLIT_AUTO (the engine's matmuls) runs SPLIT_REDO or SPLIT_GUIDED: on quiet cores
    // they ran alike, and beside another busy process redo lost a third less (docs/tuning.md).
    bool redo_split = true;
    int64_t guided_min_bytes = 96 << 10;    // the smallest guided share, and redo's smallest piece
    int64_t guided_from_bytes = 4 << 20;    // smaller matrices go in static ranges (SPLIT_WEIGHTED)
    // From this many tokens (0: never) a KV head's attention goes to two tasks of half the
    // tokens each, not one: more tasks than threads, which the pool then evens out.
    int att_split_k = 0;
    // From this many tokens in a task (0: never), attention asks for its K and V into L2 rather
    // than L1: more lines in flight where the stream binds, where L1 requests wait for the few
    // buffers L1 has; a one-token task at a short context ran slower so (docs/tuning.md).
    int att_kv_l2_k = 0;
};
Tuning default_tuning();                    // the above (with LAB_PREFETCH's distance, where built with it)
Tuning tuning();                            // the values in force
int set_tuning(const Tuning& t);            // between kernel calls; 1 (and no change) when out of range

// ----------------------------------------------------------------------------
// Block formats (split layout: scales region, then bytes region; docs/science.md §2)
// ----------------------------------------------------------------------------

// FMT_I32 only in the weights file: token ids (a trimmed draft's output rows).
enum Format : int { FMT_F32 = 0, FMT_Q8 = 1, FMT_Q4 = 2, FMT_I32 = 3 };

enum QuantStatus : int { Q_OK = 0, Q_NONFINITE = 1, Q_SCALE_OVERFLOW = 2, Q_BAD_SHAPE = 3 };

// n is a multiple of 32; returns a QuantStatus and the index of the offending value.
int quantize_q8(const float* x, int64_t n, uint16_t* d, int8_t* q, int64_t* bad);
int quantize_q4(const float* x, int64_t n, uint16_t* d, uint8_t* q, int64_t* bad);
void dequantize_q8(const uint16_t* d, const int8_t* q, int64_t n, float* out);
void dequantize_q4(const uint16_t* d, const uint8_t* q, int64_t n, float* out);
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
// n values at once (the KV cache's rows): f32_to_f16's bits on every path, but for NaN payloads.
void f32_to_f16_row(const float* x, int64_t n, uint16_t* out, int path);
// n values rounded to bf16 as ATT_BF16 rounds attention's operands, as floats (round_bf16).
void round_bf16_row(const float* x, int64_t n, float* out);

// A quantized weight matrix [rows, cols] in the split layout; the memory belongs to the caller.
struct QMat {
    int fmt;                 // FMT_Q8 or FMT_Q4
    int rows, cols;          // cols is a multiple of 32
    const uint16_t* d;       // [rows * cols/32] fp16 scales
    const uint8_t* q;        // [rows * cols/32 * (16 or 32)] quantized bytes
};
QMat make_qmat(int fmt, int rows, int cols, const uint16_t* d, const uint8_t* q);

// The kernels' layout: rows in tiles of 16, so each register lane holds one row and a
// block's dot product needs no horizontal sum. One stream: in a tile, its blocks go in pairs,
// each pair a cache line of scales, then the two blocks' bytes (formats.h, tile_offsets):
//   scales of a block: [16 rows] fp16
//   bytes of a block:  [chunk][16 rows][4 bytes], chunks of four bytes of the row's block
//      (4 chunks for q4, nibbles as stored; 8 for q8, stored as q + 128)
// d points at the matrix's first byte, q at the first block's bytes, a line further.
// Rows past the end of the last tile, and a tile's last line of scales past an odd block, are zero.
constexpr int TILE = 16;

struct PackedMat {
    int fmt, rows, cols, tiles;
    const uint16_t* d;
    const uint8_t* q;
};

// Repacks (and owns) a matrix; from the split layout, or adopts already-packed memory.
class Packed {
public:
    Packed();
    ~Packed();
    Packed(const Packed&) = delete;
    Packed& operator=(const Packed&) = delete;
    int pack(const QMat& W);                 // MM_OK or MM_BAD_FORMAT / MM_SHAPE
    // Copies rows[0..n) of an already-packed matrix into tiles of their own (MM_SHAPE when
    // a row is out of range): a draft's output rows gathered per request.
    int gather(const PackedMat& src, const int32_t* rows, int n);
    PackedMat view() const { return m_; }
    int64_t nbytes() const;
private:
    void* mem_ = nullptr;
    PackedMat m_{};
};
void* alloc_huge(size_t bytes);   // 64-byte aligned; on 2 MB pages when large (free with free())

// Memory allocated the way weights are: on 2 MB pages when large (the KV cache, and benchmarks
// that must read like the kernels do).
class Buffer {
public:
    explicit Buffer(int64_t bytes) : p_((uint8_t*)alloc_huge((size_t)bytes)), n_(bytes) {}
    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    uint8_t* data() { return p_; }
    int64_t size() const { return n_; }
private:
    uint8_t* p_;
    int64_t n_;
};
int64_t packed_scale_count(int rows, int cols);   // fp16 scales in the packed layout
int64_t packed_byte_count(int fmt, int rows, int cols);
int64_t packed_nbytes(int fmt, int rows, int cols);     // the whole region: what a pass reads
// The first scale of W that is NaN or inf, as a row-major block index, or -1: the AVX-512
// kernel's exact scaling holds for finite scales only (matmul.cpp), so a file with one is refused.
int64_t first_nonfinite_scale(const PackedMat& W);

// An activation block's scale is a power of two 2^e, ACT_EXP_MIN <= e <= ACT_EXP_MAX, so an fp16
// weight scale (a normal float once converted, or 0) times it stays a normal float: the AVX-512
// kernel multiplies the two by adding e to the weight scale's exponent (docs/science.md §2).
constexpr int ACT_EXP_MIN = -100, ACT_EXP_MAX = 112;

// k tokens of one matmul input, quantized once to 8-bit blocks, with each block's
// offset corrections (-8 sum and -128 sum) and its scale's exponent e << 23 ready to broadcast.
class QActs {
public:
    QActs();
    ~QActs();
    QActs(const QActs&) = delete;
    QActs& operator=(const QActs&) = delete;
    // Returns Q_OK, or Q_NONFINITE with *bad the flat index of the first NaN, inf or value past
    // 127 * 2^ACT_EXP_MAX (about 6.6e35).
    int quantize(const float* x, int k, int cols, int path, int64_t* bad);
    // The same in parts, for threads that each quantize what they computed: shape() sets
    // the shape (Q_OK or Q_BAD_SHAPE), then blocks [b0, b1) of the flat k x nb blocks come
    // from x (the whole k x cols input), in any order; each block's bytes are quantize()'s.
    int shape(int k, int cols);
    int quantize_blocks(const float* x, int64_t b0, int64_t b1, int path, int64_t* bad);
    void export_blocks(int8_t* q, float* d, int32_t* s) const;  // [k][nb]
    int k() const { return k_; }
    int cols() const { return cols_; }
    int nb() const { return nb_; }
    // for the kernels (inline: a call inside a kernel loop would spill every vector register)
    const int8_t* q(int t) const { return q_ + (int64_t)t * nb_ * 32; }
    const float* d(int t) const { return d_ + (int64_t)t * nb_; }
    const int32_t* s(int t) const { return s_ + (int64_t)t * nb_; }
    const int32_t* corr(int t, int fmt) const { return (fmt == FMT_Q4 ? c4_ : c8_) + (int64_t)t * nb_; }
    const int32_t* exp23(int t) const { return e23_ + (int64_t)t * nb_; }   // e << 23, 0 where d is 0
private:
    void reserve(int64_t blocks);
    int k_ = 0, cols_ = 0, nb_ = 0;
    int64_t cap_ = 0;
    void* mem_ = nullptr;
    int8_t* q_ = nullptr; float* d_ = nullptr; int32_t* s_ = nullptr;
    int32_t* c4_ = nullptr; int32_t* c8_ = nullptr; int32_t* e23_ = nullptr;
};

constexpr int MAX_K = 16;

enum MatmulStatus : int {
    MM_OK = 0, MM_BAD_FORMAT = 1, MM_SHAPE = 2, MM_BAD_K = 3, MM_PATH_UNSUPPORTED = 4
};

// y[t * ldy + r] = sum_c W[r, c] * A[t, c] for t < A.k(), r < W.rows. Work is split over
// the pool by tiles of 16 rows: chunk 0 static, n > 0 n tiles at a time, SPLIT_GUIDED.
int matmul(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int path,
           ThreadPool* pool, int chunk);
// The same, returning under SPLIT_REDO while a late worker may still read W and A: the
// engine's, whose matrices and activations outlive its passes (it waits before freeing them).
int matmul_unwaited(const PackedMat& W, const QActs& A, float* y, int64_t ldy, int path,
                    ThreadPool* pool, int chunk);

// Times `reps` walks, each over the next walk_tiles tiles of W in one matmul call per
// consecutive slice of slice_tiles tiles, as a model's layers make them. The walks cycle
// through W from walk `first` on (a caller's next calls go on from first + reps), so a W several
// walks long, past the last-level cache, streams from memory every time. After one warm-up walk
// -> seconds per walk. walk = slice = W.tiles: W whole each time (padding rows too); otherwise
// W has whole tiles and whole walks, and a bad shape is MM_SHAPE.
int bench_matmul(const PackedMat& W, int walk_tiles, int slice_tiles, const QActs& A, float* y, int path,
                 ThreadPool* pool, int chunk, int reps, double* secs, int first = 0);

// ----------------------------------------------------------------------------
// The engine's weights file (written by lab/models/export.py, described in
// docs/file-format.md), memory-mapped read-only
// ----------------------------------------------------------------------------

enum Arch : uint32_t { ARCH_QWEN3 = 1, ARCH_QWEN2 = 2, ARCH_LLAMA = 3 };
constexpr uint32_t MODEL_FILE_VERSION = 2;

// The widest head a file may declare: a K row's conversion takes a buffer of this size.
constexpr int MAX_HEAD_DIM = 1024;

struct FileHeader {                 // 256 bytes at offset 0, little endian
    char magic[8];                  // "LABMODEL"
    uint32_t version;               // MODEL_FILE_VERSION
    uint32_t arch;                  // Arch
    uint32_t vocab_size, hidden_size, intermediate_size, num_layers;
    uint32_t num_heads, num_kv_heads, head_dim, tokenizer_size;
    uint32_t max_position, tie_embeddings, qk_norm, qkv_bias;
    uint32_t n_eos;
    int32_t eos[4];
    uint32_t n_tensors;
    double rope_theta, rms_eps;
    uint64_t dir_offset;            // n_tensors TensorEntry
    uint64_t meta_offset, meta_size;    // JSON for Python (source, scheme, tokenizer); C++ ignores it
    uint64_t data_offset, data_size;    // every tensor lies in here, 64-byte aligned
    uint8_t content_sha256[32];     // of the data region
    uint8_t reserved[80];
};

struct TensorEntry {                // 128 bytes
    char name[80];                  // nul-terminated
    uint32_t fmt;                   // Format
    uint32_t ndim;                  // 1 or 2
    uint64_t rows, cols;            // 1-D tensors: rows = 1
    uint64_t offset;                // absolute; q8/q4: the packed tiles, scales and bytes in one region
    uint64_t scales_bytes;          // the scales among them; 0 for f32
    uint64_t data_bytes;            // the bytes among them (f32: 4 * rows * cols)
};

class ModelFile {
public:
    ModelFile();
    ~ModelFile();
    ModelFile(const ModelFile&) = delete;
    ModelFile& operator=(const ModelFile&) = delete;
    // false: error() says what is wrong. With in_memory the checked file is copied onto
    // 2 MB pages (a decode step streams every byte; 4 KB page-cache pages cost TLB misses).
    bool open(const char* path, bool in_memory = false);
    const char* error() const { return err_; }
    const FileHeader* header() const { return (const FileHeader*)base_; }
    const TensorEntry* find(const char* name) const;   // nullptr when absent
    const TensorEntry* tensor(int i) const;
    const uint8_t* data(const TensorEntry* e) const { return base_ + e->offset; }
    PackedMat matrix(const TensorEntry* e) const;      // q8/q4 tensors as the kernels see them
    int64_t size() const { return size_; }
private:
    bool fail(const char* fmt, ...);
    bool check_header(const FileHeader& h);
    bool check_regions(const FileHeader& h);
    bool check_tensor(const TensorEntry& e, uint32_t i, const FileHeader& h);
    const uint8_t* base_ = nullptr;
    int64_t size_ = 0;
    bool owned_ = false;            // base_ is our copy rather than the mapping
    char err_[512] = {0};
};

// ----------------------------------------------------------------------------
// The engine: a model's forward pass over k tokens, sampling, and the round loop
// ----------------------------------------------------------------------------

enum EngineStatus : int {
    E_OK = 0, E_CONTEXT = 1, E_TOKEN = 2, E_EMPTY = 3, E_GAMMA = 4, E_VOCAB = 5, E_NOT_LOADED = 6,
    E_MISSING = 7, E_PATH = 8, E_NONFINITE = 9, E_POLICY = 10
};

enum LogitsMode : int { LOGITS_NONE = 0, LOGITS_LAST = 1, LOGITS_ALL = 2 };

// The parts of a forward pass, timed when profiling is on (`lab bench decode --stages`).
// SERIAL: what thread 0 does alone between pool calls (the embedding, the last residual add,
// and RoPE and the KV cache write where attention tasks split a head's tokens); QUANTIZE: a
// matmul's input rows, token by token (the residual add, RMSNorm and quantization; on the
// pool at k >= 2). ATTENTION includes each task's RoPE, KV cache write and the quantization
// of its outputs for the o projection, where a task holds every token of its head; SWIGLU
// includes the down projection's quantization, done by the threads that compute it.
enum Stage : int {
    STAGE_SERIAL = 0, STAGE_QUANTIZE, STAGE_QKV, STAGE_ATTENTION, STAGE_O, STAGE_GATE_UP,
    STAGE_SWIGLU, STAGE_DOWN, STAGE_OUTPUT, N_STAGES
};

class Model {
public:
    Model();
    ~Model();
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;
    bool load(const char* path, int max_context, bool in_memory = true);   // false: error() says why
    const char* error() const;
    const FileHeader& config() const;
    int max_context() const;
    int vocab() const;                               // the tokenizer's size
    // Logits per position: vocab(), or for a trimmed draft (a file with output_ids) its N
    // kept tokens and then the request's extra ones; out_ids() says which token each row
    // is (nullptr: the whole vocabulary in order).
    int out_rows() const;
    const int32_t* out_ids() const;
    // A trimmed draft: rows of the full output layer for those of ids[0..n) it lacks (the
    // prompt's names and numbers), replacing the last request's. Returns how many it added,
    // or -1 when the full output layer is not quantized. Other models: 0.
    int set_extra_rows(const int32_t* ids, int n);
    int64_t weight_bytes() const;                    // bytes one forward pass reads
    // Runs tokens[0..k) at positions pos..pos+k-1 (in chunks of up to 16), leaving them in
    // the KV cache. logits: [k][vocab] (LOGITS_ALL) or [vocab] (LOGITS_LAST); hidden, if
    // given: [layers][k][hidden_size] after every layer. Returns an EngineStatus.
    int forward(const int32_t* tokens, int k, int pos, float* logits, int mode, float* hidden,
                ThreadPool* pool, int path);
    // How matmuls split their tiles over the pool: 0 static halves, n > 0 chunks of n tiles,
    // SPLIT_GUIDED (the default: small matrices SPLIT_WEIGHTED). Results are identical either
    // way; only the timing moves.
    void set_chunk(int tiles);
    // Attention of a draft that need not be exact: a row that has seen more than
    // sink + window positions sees the first `sink` and its last `window` or up to
    // ATT_WINDOW_BLOCK - 1 more (window 0: every position). sink is a whole number of
    // blocks. A k-token pass still equals k single-token passes. Returns false otherwise.
    bool set_window(int sink, int window);
    // Attention's products (AttentionMode) for every later pass; a pass on a path that cannot
    // run them returns E_PATH. Changing it mid-context mixes the two in one cache's results.
    void set_attention(int mode);
    // Stage timing: profile(on) zeroes the sums; while on, every pass adds each stage's wall
    // time. stage_seconds copies the sums out, stage_bytes the weight bytes each stage reads
    // in one pass (the output layer: its logits rows for one token). Both [N_STAGES].
    void profile(bool on);
    void stage_seconds(double* secs) const;
    void stage_bytes(int64_t* bytes) const;
    struct Impl;
private:
    Impl* impl_;
};

struct SampleParams {
    float temperature = 0.f;         // 0: greedy
    int top_k = 0;                   // 0: off
    float top_p = 1.f;               // 1: off
};

// Sampling takes the kernel path as the matmuls do: its AVX2 code on every SIMD path, the
// scalar reference on PATH_SCALAR (and on a path this CPU lacks). sampler_name says which
// ("avx2" or "scalar") a path gets.
const char* sampler_name(int path);

// The first index holding the largest of x[0..n): every greedy pick.
int argmax(const float* x, int n, int path);

// The largest probability of softmax(logits[n]) (scratch: n floats): a greedy draft's
// confidence in its guess.
float top_probability(const float* logits, int n, float* scratch, int path);

// Warps logits[n] into probabilities (temperature, top-k, top-p); greedy puts all mass on
// the argmax. The distribution every sample and every acceptance test uses.
void warp(const float* logits, int n, const SampleParams& sp, float* probs, int path);

struct Rng {                         // xoshiro256**, seeded through splitmix64
    uint64_t s[4];
    explicit Rng(uint64_t seed = 0);
    uint64_t next();
    double uniform();                // [0, 1)
};
// Draws an index with probability probs[i] / (their sum): the weights need not add up to 1,
// entries <= 0 are never drawn (all of them <= 0: the argmax).
int sample(const float* probs, int n, Rng& rng, int path);

// docs/science.md §4: accept draft token x with probability min(1, p(x)/q(x)); on rejection
// draw from max(0, p - q) renormalised. Returns x when accepted, else the resampled token;
// *accepted says which.
int accept_or_resample(const float* p, const float* q, int n, int x, Rng& rng, bool* accepted, int path);
// For tests: `draws` times, x ~ q then accept_or_resample; out[i] is the token that results.
void accept_trials(const float* p, const float* q, int n, int draws, uint64_t seed, int32_t* out, int path);

// GEN_AUTO: each round chooses prompt lookup, the draft model or a plain step, and how
// many guesses, from the Policy.
enum GenMode : int { GEN_PLAIN = 0, GEN_DRAFT = 1, GEN_LOOKUP = 2, GEN_AUTO = 3 };

// Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
// last n tokens (the longest n <= ngram_max that occurs), up to gamma of them; *matched = n.
int lookup_ngram(const int32_t* ctx, int len, int ngram_max, int gamma, int32_t* out, int* matched);

// The automatic policy's inputs (lab/policy.py fills them): this machine's costs, in target
// steps, at the contexts they were measured at, and how likely a guess is to be accepted
// (calibrated offline on training prompts).
constexpr int CAL_BINS = 20;         // the draft's top probability, in 20 equal bins
constexpr int NGRAM_MAX = 8;
constexpr int COST_CONTEXTS = 4;
constexpr int VK = MAX_K + 2;        // v[k] for k = 0..MAX_K + 1 (v[0] unused)

struct Policy {
    int max_gamma = 8;               // guesses a round makes at most (verifies max_gamma + 1)
    int n_ctx = 0;                   // contexts with costs, ascending, at most COST_CONTEXTS
    int ctx[COST_CONTEXTS] = {};
    float c[COST_CONTEXTS] = {};     // a draft step over a target step
    float v[COST_CONTEXTS * VK] = {};    // [context][k]: a k-token pass over a 1-token pass
    float o = 0.f;                   // a round's overhead over a target step
    float draft_p[CAL_BINS] = {};    // P(a guess is accepted | the draft's top probability), the guesses before it accepted
    float draft_next[CAL_BINS] = {}; // P(the next guess is accepted | this one's top probability, this one accepted)
    float lookup_first[NGRAM_MAX + 1] = {};   // P(the first lookup guess is accepted | n-gram length matched)
    float lookup_next = 0.f;         // P(a later lookup guess is accepted | the one before was)
    int ngram_max = 3;               // the longest n-gram lookup matches (as calibrated; <= NGRAM_MAX)
    float draft_rate = 1.f;          // tokens per target step the draft is expected to give (before any round says)
};

// One round's plan in the automatic policy. Guesses are taken while the expected tokens one
// more adds -- the chance that it and every guess before it are accepted -- pay for what it
// costs (a draft step, if one is needed, and the longer verification) at `rate`, the tokens
// per target step the run makes: adding a guess that earns less than the average lowers it.
struct RoundPlan {
    float v[VK];
    float c, o, rate;
    float tokens = 1.f, cost = 0.f, reach = 1.f;   // expected tokens, cost so far; P(all taken accepted)
    int g = 0;
    RoundPlan(const Policy& p, int context, float rate);
    float extra_cost(bool draft_step) const { return (draft_step ? c : 0.f) + v[g + 2] - v[g + 1]; }
    bool worth(float a, bool draft_step) const { return reach * a >= rate * extra_cost(draft_step); }
    void take(float a, bool draft_step);
    float efficiency() const { return tokens / cost; }
};

struct GenParams {
    int mode = GEN_PLAIN;
    const Policy* policy = nullptr;  // GEN_AUTO
    int max_new_tokens = 128;
    int gamma = 4;                   // guesses per round, 1..16 (the pass verifies gamma + 1)
    float threshold = 0.f;           // draft stops early when its top probability falls below
    int ngram_max = 3;               // prompt lookup: longest n-gram matched
    SampleParams sample;
    uint64_t seed = 0;
    int n_eos = 0;
    int32_t eos[4] = {-1, -1, -1, -1};
};

// What a round drafted with (the kinds array of Generator::run).
enum RoundKind : int { ROUND_PLAIN = 0, ROUND_DRAFT = 1, ROUND_LOOKUP = 2 };

struct GenStats {
    int prompt_tokens = 0, new_tokens = 0, rounds = 0, drafted = 0, accepted = 0;
    double t_prompt = 0, t_draft = 0, t_verify = 0, t_sample = 0, t_total = 0;
    int stopped_on_eos = 0;
};

class Generator {
public:
    Generator(Model* target, Model* draft, ThreadPool* pool, int path);
    // Generates into out[0..max_new_tokens); per round, drafted[r], accepted[r] and kinds[r]
    // (a RoundKind; up to max_rounds). Returns an EngineStatus; stats() tells the rest.
    int run(const int32_t* prompt, int n_prompt, const GenParams& gp, int32_t* out,
            int32_t* drafted, int32_t* accepted, int32_t* kinds, int max_rounds);
    int produced() const;            // tokens written so far (for streaming from another thread)
    const GenStats& stats() const { return stats_; }
private:
    int emit(int32_t tok, int32_t* out, const GenParams& gp);
    Model* target_;
    Model* draft_;
    ThreadPool* pool_;
    int path_;
    GenStats stats_;
    std::atomic<int> produced_{0};    // polled by Python's streaming thread while run() writes
};

// ----------------------------------------------------------------------------
// Benchmarks (timings in seconds, one per repeat)
// ----------------------------------------------------------------------------

// A read pass over buf split over the pool; ahead > 0: each line is asked for into L1 that many
// bytes before it is read; each thread reads its slice in `streams` streams, 1 or 2 (else 1 is
// returned and nothing timed). lab/protocol.py takes the fastest loop as the read ceiling.
int bench_read(const uint8_t* buf, int64_t bytes, ThreadPool* pool, int reps, double* secs, int64_t ahead = 0,
               int streams = 1);
// Nanoseconds a cache line takes to go from the pool's thread 0 to thread 1 and back, over n
// round trips (0 for a pool of one): how far apart their CPUs sit.
double bench_round_trip(ThreadPool* pool, int n);
void bench_copy(float* dst, const float* src, int64_t n, ThreadPool* pool, int reps, double* secs);
void bench_triad(float* a, const float* b, const float* c, int64_t n, ThreadPool* pool,
                 int reps, double* secs);
// The dot-product issue peak on one thread, in int8 multiply-accumulates per second. A path's
// loops (independent chains of one instruction form at one width) are named
// "op/width/form/chains", "" past the last; bench_dot_variant times one over about n
// instructions, bench_dot_peak returns the best of them, each timed once.
const char* dot_variant(int path, int v);
double bench_dot_variant(int path, int v, int64_t n);
double bench_dot_peak(int path, int64_t n);
void fill_random(uint8_t* buf, int64_t n, uint64_t seed);
// Attention alone on one thread, as one task of a pass does it: `tokens` query tokens of
// `group` heads each (head_dim D) against one KV head with n0 positions cached before the
// first token. Seconds per call, one per repeat, after a warm-up; 1 for a bad argument.
int bench_attention(int D, int group, int tokens, int n0, int path, int reps, double* secs, int mode = ATT_DEFAULT);
// The attention stage of a pass on the pool, for lab/tune.py: `layers` layers of KV heads, each
// of n0 + tokens - 1 cached positions, `tokens` query tokens of `group` heads a KV head, its
// tasks as Model::attention splits and runs them but without their rows' preparation and the
// outputs' quantization. The caches, made once, fill cycle_bytes (at least `layers` layers');
// each stage timed takes the next `layers` of them, so that past the last-level cache K and V
// come from memory, as in a pass, where the weights stream between a layer's reads and the next's.
class AttentionStage {
public:
    // 0, or 1 for a bad argument (the stage then times nothing)
    int init(int D, int group, int KV, int tokens, int n0, int layers, int64_t cycle_bytes, int path,
             int mode = ATT_DEFAULT);
    // Seconds per stage, one per repeat, after a warm-up stage; 1 before a good init.
    int time(ThreadPool* pool, int reps, double* secs);
private:
    int D_ = 0, group_ = 0, KV_ = 0, tokens_ = 0, n0_ = 0, layers_ = 0, cycle_ = 0, path_ = 0, mode_ = 0, next_ = 0;
    size_t head_ = 0;                           // one KV head's cache, in values
    std::unique_ptr<Buffer> K_, V_;
    std::vector<float> q_, out_;
};
// Times `reps` forward passes of k tokens at pos (after one warm-up); logits: [k][vocab].
int bench_forward(Model& m, const int32_t* tokens, int k, int pos, int mode, ThreadPool* pool,
                  int path, int reps, double* secs, float* logits);

}  // namespace lab
