// model_file.cpp — maps the engine's weights file read-only and checks it before anything
// reads it: a truncated file, a wrong magic or version, an unknown architecture or a
// tensor that runs past the end is an error message, never a crash.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "formats.h"
#include "lab.h"

namespace lab {

static_assert(sizeof(FileHeader) == 256, "FileHeader is 256 bytes");
static_assert(sizeof(TensorEntry) == 128, "TensorEntry is 128 bytes");

ModelFile::ModelFile() = default;

ModelFile::~ModelFile() {
    if (owned_) std::free((void*)base_);
    else if (base_) munmap((void*)base_, (size_t)size_);
}

bool ModelFile::fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err_, sizeof err_, fmt, ap);
    va_end(ap);
    return false;
}

// Every count is bounded before anything multiplies or allocates with it: a crafted header
// must end in a message, never in a division by zero, a wrapped size or a huge allocation.
bool ModelFile::check_header(const FileHeader& h) {
    struct Field { const char* name; uint32_t value, lo, hi; };
    const Field fields[] = {
        {"vocab_size", h.vocab_size, 1, 1u << 24},        {"hidden_size", h.hidden_size, QK, 1u << 16},
        {"intermediate_size", h.intermediate_size, 1, 1u << 20}, {"num_layers", h.num_layers, 1, 1024},
        {"num_heads", h.num_heads, 1, 1024},              {"num_kv_heads", h.num_kv_heads, 1, h.num_heads},
        {"head_dim", h.head_dim, 8, MAX_HEAD_DIM},        {"tokenizer_size", h.tokenizer_size, 1, h.vocab_size},
        {"tie_embeddings", h.tie_embeddings, 0, 1},       {"qk_norm", h.qk_norm, 0, 1},
        {"qkv_bias", h.qkv_bias, 0, 1},                   {"n_eos", h.n_eos, 0, 4},
    };
    for (const Field& f : fields)
        if (f.value < f.lo || f.value > f.hi)
            return fail("its header says %s = %u, outside %u..%u", f.name, f.value, f.lo, f.hi);
    if (h.head_dim % 8 || h.num_heads % h.num_kv_heads || h.hidden_size % QK)
        return fail("its header's head_dim (a multiple of 8), heads or hidden size are inconsistent");
    if ((uint64_t)h.num_heads * h.head_dim > (1u << 16))
        return fail("its header says %u heads of %u, too wide", h.num_heads, h.head_dim);
    for (uint32_t i = 0; i < h.n_eos; i++)
        if (h.eos[i] < 0 || (uint32_t)h.eos[i] >= h.tokenizer_size)
            return fail("its end-of-sequence id %d is outside the tokenizer (%u)", h.eos[i], h.tokenizer_size);
    if (!(h.rope_theta > 0 && h.rope_theta < 1e12) || !(h.rms_eps > 0 && h.rms_eps < 1))
        return fail("its header's rope_theta or rms_eps is not a usable number");
    return true;
}

// Sizes are compared by subtraction from the file size, so no sum can wrap around 2^64.
bool ModelFile::check_regions(const FileHeader& h) {
    const uint64_t size = (uint64_t)size_;
    if (h.dir_offset % alignof(TensorEntry)) return fail("its tensor directory is not 8-byte aligned");
    if (h.dir_offset < sizeof(FileHeader) || h.dir_offset > size ||
        h.n_tensors > (size - h.dir_offset) / sizeof(TensorEntry))
        return fail("its tensor directory runs past the end of the file");
    if (h.data_offset > size || h.data_size > size - h.data_offset)
        return fail("it is %llu bytes but its data region runs past that", (unsigned long long)size);
    return true;
}

bool ModelFile::check_tensor(const TensorEntry& e, uint32_t i, const FileHeader& h) {
    const char* end = (const char*)std::memchr(e.name, 0, sizeof e.name);
    if (end == nullptr || end == e.name) return fail("tensor %u has no name", i);
    for (const char* c = e.name; c < end; c++)       // names go into messages: printable ASCII only
        if (*c < 0x20 || *c > 0x7e) return fail("tensor %u's name is not printable text", i);
    if (e.fmt > FMT_I32 || e.ndim < 1 || e.ndim > 2)
        return fail("tensor %s has format %u / %u dims the engine does not know", e.name, e.fmt, e.ndim);
    if (e.ndim == 1 && e.rows != 1) return fail("tensor %s is 1-D but has %llu rows", e.name,
                                                (unsigned long long)e.rows);
    const uint64_t lim = 1ull << 31;
    if (e.rows < 1 || e.cols < 1 || e.rows >= lim || e.cols >= lim || e.rows * e.cols >= (1ull << 40))
        return fail("tensor %s has shape %llu x %llu, outside what the engine holds", e.name,
                    (unsigned long long)e.rows, (unsigned long long)e.cols);
    uint64_t want_s = 0, want_d = e.rows * e.cols * 4;
    if (e.fmt == FMT_Q8 || e.fmt == FMT_Q4) {
        if (e.cols % QK)
            return fail("tensor %s has %llu columns, not a multiple of 32", e.name, (unsigned long long)e.cols);
        want_s = (uint64_t)packed_scale_count((int)e.rows, (int)e.cols) * SCALE_BYTES;
        want_d = (uint64_t)packed_byte_count((int)e.fmt, (int)e.rows, (int)e.cols);
    }
    if (e.scales_bytes != want_s || e.data_bytes != want_d)
        return fail("tensor %s's sizes do not match its shape", e.name);
    const uint64_t span = e.fmt == FMT_Q8 || e.fmt == FMT_Q4
                              ? (uint64_t)packed_nbytes((int)e.fmt, (int)e.rows, (int)e.cols) : want_d;  // bounded above
    if (e.offset % 64 || e.offset < h.data_offset || e.offset - h.data_offset > h.data_size ||
        span > h.data_size - (e.offset - h.data_offset))
        return fail("tensor %s lies outside the data region", e.name);
    return true;
}

bool ModelFile::open(const char* path, bool in_memory) {
    if (base_) return fail("this ModelFile is already open");
    const int fd = ::open(path, O_RDONLY);
    if (fd < 0) return fail("cannot open %s: %s", path, std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) { ::close(fd); return fail("cannot stat %s", path); }
    size_ = st.st_size;
    if (size_ < (int64_t)sizeof(FileHeader)) {
        ::close(fd);
        return fail("%s is %lld bytes, shorter than a header: truncated or not a lab model file",
                    path, (long long)size_);
    }
    void* p = mmap(nullptr, (size_t)size_, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return fail("cannot map %s: %s", path, std::strerror(errno));
    base_ = (const uint8_t*)p;
    const FileHeader& h = *header();
    if (std::memcmp(h.magic, "LABMODEL", 8) != 0)
        return fail("%s is not a lab model file (wrong magic); export one with lab.models.export", path);
    if (h.version != MODEL_FILE_VERSION)
        return fail("%s is model file version %u; this engine reads version %u: export it again", path,
                    h.version, MODEL_FILE_VERSION);
    if (h.arch < ARCH_QWEN3 || h.arch > ARCH_LLAMA)
        return fail("%s holds architecture %u, which the engine does not know (1 qwen3, 2 qwen2, 3 llama)",
                    path, h.arch);
    char why[sizeof err_];                 // the check's own message, before fail() rewrites err_
    auto named = [&](const char* advice) {
        std::memcpy(why, err_, sizeof why);
        return fail("%s: %s (%s)", path, why, advice);
    };
    if (!check_header(h)) return named("not a usable model file: export it again");
    if (!check_regions(h)) return named("truncated or corrupt: export or fetch it again");
    for (uint32_t i = 0; i < h.n_tensors; i++)
        if (!check_tensor(*tensor(i), i, h)) return named("corrupt: export it again");
    if (in_memory) {
        void* copy = alloc_huge((size_t)size_);
        if (!copy) return fail("%s: no memory for a %lld-byte copy", path, (long long)size_);
        std::memcpy(copy, base_, (size_t)size_);
        munmap((void*)base_, (size_t)size_);
        base_ = (const uint8_t*)copy;
        owned_ = true;
    }
    return true;
}

const TensorEntry* ModelFile::tensor(int i) const {
    return (const TensorEntry*)(base_ + header()->dir_offset) + i;
}

const TensorEntry* ModelFile::find(const char* name) const {
    if (!base_) return nullptr;
    for (uint32_t i = 0; i < header()->n_tensors; i++)
        if (std::strncmp(tensor(i)->name, name, sizeof tensor(i)->name) == 0) return tensor(i);
    return nullptr;
}

PackedMat ModelFile::matrix(const TensorEntry* e) const {
    const uint8_t* p = data(e);
    return PackedMat{(int)e->fmt, (int)e->rows, (int)e->cols, (int)tile_count((int64_t)e->rows),
                     (const uint16_t*)p, p + PAIR_SCALES};
}

}  // namespace lab
