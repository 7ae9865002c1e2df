// model_file_fuzzer.cpp — libFuzzer harness over the engine's weights-file reader and set-up.
//
// Each input is the bytes of a weights file (lab/models/export.py writes real ones; the seed
// corpus holds the tiny models' files, see fuzz/seeds.py). The bytes go into a memfd, and
// its /proc/self/fd path goes to
//   1. lab::ModelFile::open(path, in_memory=false)  -- header, directory and tensor checks
//   2. lab::Model::load(path, max_context=64, in_memory=false) -- binding every tensor the
//      header promises and allocating the caches.
// Each must either succeed or return false with a message in error(); anything else (a
// crash, an ASan/UBSan report, an abort, a huge allocation) is a bug in kernels_cpp/.
// The harness also checks that the two agree: a file ModelFile refuses, Model refuses too.
//
// Built by `make fuzz` (see the Makefile's fuzz section) with clang and
// -fsanitize=fuzzer,address,undefined over every kernels_cpp/*.cpp, as lab/native.py
// compiles them. Run by hand:
//   build/fuzz/model_file_fuzzer -max_total_time=60 build/fuzz/corpus-cpp build/fuzz/seeds
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lab.h"

namespace {

constexpr int MAX_CONTEXT = 64;

int memfd() {
    static int fd = -1;
    if (fd < 0) {
        fd = memfd_create("lab-fuzz-model", 0);
        if (fd < 0) { std::perror("memfd_create"); std::abort(); }
    }
    return fd;
}

void put(int fd, const uint8_t* data, size_t size) {
    if (ftruncate(fd, 0) != 0) { std::perror("ftruncate"); std::abort(); }
    size_t done = 0;
    while (done < size) {
        const ssize_t n = pwrite(fd, data + done, size - done, (off_t)done);
        if (n <= 0) { std::perror("pwrite"); std::abort(); }
        done += (size_t)n;
    }
}

// bound: the size of the buffer the message lives in (ModelFile's is 512 bytes), or 0 when
// it is a std::string's (terminated by construction).
void need_message(const char* who, const char* err, size_t bound) {
    if (err == nullptr || err[0] == '\0') {
        std::fprintf(stderr, "%s returned false without a message\n", who);
        std::abort();
    }
    if (bound && std::memchr(err, 0, bound) == nullptr) {
        std::fprintf(stderr, "%s: message not nul-terminated\n", who);
        std::abort();
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const int fd = memfd();
    put(fd, data, size);
    char path[64];
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

    bool file_ok;
    {
        lab::ModelFile f;
        file_ok = f.open(path, false);
        if (!file_ok) {
            need_message("ModelFile::open", f.error(), 512);
        } else {
            // What the engine reads after open(): the header, every entry, find() by name.
            const lab::FileHeader* h = f.header();
            for (uint32_t i = 0; i < h->n_tensors; i++) {
                const lab::TensorEntry* e = f.tensor((int)i);
                if (f.find(e->name) == nullptr) { std::fprintf(stderr, "find() lost %s\n", e->name); std::abort(); }
            }
        }
    }
    {
        lab::Model m;
        const bool model_ok = m.load(path, MAX_CONTEXT, false);
        if (!model_ok) need_message("Model::load", m.error(), 0);
        if (model_ok && !file_ok) {
            std::fprintf(stderr, "Model::load accepted a file ModelFile::open refused\n");
            std::abort();
        }
        if (model_ok && (m.vocab() < 1 || m.max_context() != MAX_CONTEXT || m.out_rows() < 1)) {
            std::fprintf(stderr, "Model::load succeeded with vocab %d, context %d, rows %d\n", m.vocab(),
                         m.max_context(), m.out_rows());
            std::abort();
        }
        if (model_ok) (void)m.weight_bytes();
    }
    return 0;
}
