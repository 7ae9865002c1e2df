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
    const uint64_t dir_end = h.dir_offset + (uint64_t)h.n_tensors * sizeof(TensorEntry);
    if (h.dir_offset < sizeof(FileHeader) || dir_end > (uint64_t)size_)
        return fail("%s: its tensor directory runs past the end of the file (truncated?)", path);
    if (h.data_offset + h.data_size > (uint64_t)size_)
        return fail("%s is %lld bytes but its data region ends at %llu: truncated", path, (long long)size_,
                    (unsigned long long)(h.data_offset + h.data_size));
    for (uint32_t i = 0; i < h.n_tensors; i++) {
        const TensorEntry& e = *tensor(i);
        if (std::memchr(e.name, 0, sizeof e.name) == nullptr) return fail("%s: tensor %u has no name", path, i);
        if (e.fmt > FMT_I32 || e.ndim < 1 || e.ndim > 2)
            return fail("%s: tensor %s has format %u / %u dims the engine does not know", path, e.name, e.fmt, e.ndim);
        uint64_t want_s = 0, want_d = e.rows * e.cols * 4;
        if (e.fmt == FMT_Q8 || e.fmt == FMT_Q4) {
            if (e.cols % QK) return fail("%s: tensor %s has %llu columns, not a multiple of 32", path,
                                         e.name, (unsigned long long)e.cols);
            want_s = packed_scale_count((int)e.rows, (int)e.cols) * 2;
            want_d = packed_byte_count((int)e.fmt, (int)e.rows, (int)e.cols);
        }
        if (e.scales_bytes != want_s || e.data_bytes < want_d)
            return fail("%s: tensor %s's sizes do not match its shape", path, e.name);
        const uint64_t end = e.offset + ((e.scales_bytes + 63) / 64 * 64) + e.data_bytes;
        if (e.offset % 64 || e.offset < h.data_offset || end > h.data_offset + h.data_size)
            return fail("%s: tensor %s lies outside the data region (truncated?)", path, e.name);
    }
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
    return PackedMat{(int)e->fmt, (int)e->rows, (int)e->cols, (int)((e->rows + TILE - 1) / TILE),
                     (const uint16_t*)p, p + (e->scales_bytes + 63) / 64 * 64};
}

}  // namespace lab
