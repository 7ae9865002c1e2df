// cpu.cpp — what this CPU can run, found with cpuid, and which kernel path is active.
#include "lab.h"

#include <cpuid.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace lab {

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}

static uint64_t xgetbv0() {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

CpuInfo cpu_info() {
    CpuInfo c;
    std::memset(&c, 0, sizeof c);
    unsigned r[4];
    cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    std::memcpy(c.vendor + 0, &r[1], 4);
    std::memcpy(c.vendor + 4, &r[3], 4);
    std::memcpy(c.vendor + 8, &r[2], 4);
    cpuid(0x80000000u, 0, r);
    if (r[0] >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) {
            cpuid(0x80000002u + i, 0, r);
            std::memcpy(c.brand + 16 * i, r, 16);
        }
        c.brand[63] = 0;
    }
    c.logical_cpus = online_cpus();

    cpuid(1, 0, r);
    const bool osxsave = r[2] & (1u << 27);
    c.sse42 = r[2] & (1u << 20);
    c.fma = r[2] & (1u << 12);
    c.f16c = r[2] & (1u << 29);
    c.avx = r[2] & (1u << 28);
    if (osxsave) {
        const uint64_t xcr0 = xgetbv0();
        c.os_avx = (xcr0 & 0x6) == 0x6;               // SSE + AVX state
        c.os_avx512 = (xcr0 & 0xe6) == 0xe6;          // + opmask, ZMM_Hi256, Hi16_ZMM
        c.os_amx = (xcr0 & 0x60000) == 0x60000;       // XTILECFG, XTILEDATA
    }
    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        c.avx2 = r[1] & (1u << 5);
        c.avx512f = r[1] & (1u << 16);
        c.avx512dq = r[1] & (1u << 17);
        c.avx512bw = r[1] & (1u << 30);
        c.avx512vl = r[1] & (1u << 31);
        c.avx512vnni = r[2] & (1u << 11);
        c.hybrid = r[3] & (1u << 15);
        c.amx_bf16 = r[3] & (1u << 22);
        c.amx_tile = r[3] & (1u << 24);
        cpuid(7, 1, r);
        c.avxvnni = r[0] & (1u << 4);
        c.avx512bf16 = r[0] & (1u << 5);
    }
    return c;
}

bool path_supported(int path) {
    static const CpuInfo c = cpu_info();
    const bool avx2 = c.os_avx && c.avx && c.avx2 && c.fma && c.f16c;
    const bool avx512 = avx2 && c.os_avx512 && c.avx512f && c.avx512dq && c.avx512bw &&
                        c.avx512vl && c.avx512vnni;
    switch (path) {
        case PATH_SCALAR: return true;
        case PATH_AVX2: return avx2;
        case PATH_AVXVNNI: return avx2 && c.avxvnni;
        case PATH_AVX512VNNI: return avx512;
        case PATH_VNNI256_EVEX: return avx512;
        default: return false;
    }
}

// Linux lends a process the AMX tiles' state only when asked (arch_prctl), once for all its threads.
static bool amx_lent() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int attention_mode(int path, int mode, int head_dim) {
    static const CpuInfo c = cpu_info();
    static const bool amx = c.amx_tile && c.amx_bf16 && c.os_amx && amx_lent();
    const bool hw = path == PATH_AVX512VNNI && path_supported(path) && c.avx512bf16 && head_dim % 16 == 0;
    if (mode == ATT_DEFAULT) return hw && amx ? ATT_AMX : hw ? ATT_BF16 : ATT_F32;
    if (mode == ATT_F32) return ATT_F32;
    if (mode == ATT_BF16) return hw || path == PATH_SCALAR ? ATT_BF16 : -1;
    if (mode == ATT_AMX) return (hw && amx) || path == PATH_SCALAR ? ATT_AMX : -1;
    return -1;
}

int best_path() {
    if (path_supported(PATH_AVX512VNNI)) return PATH_AVX512VNNI;
    if (path_supported(PATH_AVXVNNI)) return PATH_AVXVNNI;
    if (path_supported(PATH_AVX2)) return PATH_AVX2;
    return PATH_SCALAR;
}

// LAB_KERNEL_PATH may only lower the path: asking for more than the CPU has is ignored
// here, and lab/native.py turns it into an error before anything runs.
int active_path() {
    const int best = best_path();
    const char* env = std::getenv("LAB_KERNEL_PATH");
    if (!env || !*env) return best;
    const int p = path_from_name(env);
    return (p >= 0 && path_supported(p)) ? p : best;
}

static const char* const kPathNames[PATH_COUNT] = {
    "scalar", "avx2", "avxvnni", "avx512vnni", "vnni256evex"};

const char* path_name(int path) {
    return (path >= 0 && path < PATH_COUNT) ? kPathNames[path] : "unknown";
}

int path_from_name(const char* name) {
    for (int p = 0; p < PATH_COUNT; p++)
        if (std::strcmp(name, kPathNames[p]) == 0) return p;
    return -1;
}

// cpuid leaf 0x1A answers for the CPU the caller runs on, so hop there and back.
int core_type(int cpu) {
    static const CpuInfo c = cpu_info();
    if (!c.hybrid) return 0;
    cpu_set_t old, one;
    if (sched_getaffinity(0, sizeof old, &old) != 0) return 0;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) return 0;
    unsigned r[4];
    cpuid(0x1a, 0, r);
    sched_setaffinity(0, sizeof old, &old);
    return (int)(r[0] >> 24);
}

int online_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    return (int)sysconf(_SC_NPROCESSORS_ONLN);
}

}  // namespace lab
