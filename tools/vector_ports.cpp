// vector_ports.cpp — which instructions share vpdpbusd's issue slots on this core: each loop
// issues 12 independent vpdpbusd (zmm) and, beside them, three of one other instruction; a
// loop slower than the first says the extra instructions take slots vpdpbusd needs.
// docs/tuning.md has a Zen 5's answers ("The k-token kernel's loads") and a Zen 4's ("A Zen 4: ...").
//   g++ -O2 -mavx512f -mavx512bw -mavx512vnni tools/vector_ports.cpp -o /tmp/ports && /tmp/ports
#include <algorithm>
#include <chrono>
#include <cstdio>

#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
                "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "r8", "r9", "r10"
#define R(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n"
#define M(i) "vpdpbusd (%0)%{1to16%}, %%zmm31, %%zmm" #i "\n"
#define REG R(0) R(1) R(2) R(3) R(4) R(5) R(6) R(7) R(8) R(9) R(10) R(11)
#define BCST M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define THREE(op) op "12\n" op "13\n" op "14\n"

alignas(64) static char buf[256];

struct Loop {
    const char* name;
    void (*run)(long n);
};
// the loop inside each function: no call between iterations
#define LOOP(name, text) {name, [](long n) { for (long i = 0; i < n; i++) asm volatile(text :: "r"(buf) : CLOBBER); }}
static const Loop loops[] = {
    LOOP("12 vpdpbusd", REG),
    LOOP("  + 3 vfmadd231ps", REG THREE("vfmadd231ps %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vmulps", REG THREE("vmulps %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vaddps", REG THREE("vaddps %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vcvtdq2ps", REG THREE("vcvtdq2ps %%zmm29, %%zmm")),
    LOOP("  + 3 vcvtph2ps", REG THREE("vcvtph2ps %%ymm29, %%zmm")),
    LOOP("  + 3 vpaddd", REG THREE("vpaddd %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vpandd", REG THREE("vpandd %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vpsrlw", REG THREE("vpsrlw $4, %%zmm29, %%zmm")),
    LOOP("  + 3 zmm loads", REG THREE("vmovdqu64 (%0), %%zmm")),
    LOOP("  + 3 vpshufd", REG THREE("vpshufd $0x55, %%zmm29, %%zmm")),
    LOOP("  + 3 vpermd", REG THREE("vpermd %%zmm29, %%zmm28, %%zmm")),
    LOOP("  + 3 vpbroadcastd from xmm", REG THREE("vpbroadcastd %%xmm29, %%zmm")),
    LOOP("  + 3 vbroadcasti32x4 loads", REG THREE("vbroadcasti32x4 (%0), %%zmm")),
    LOOP("  + 3 vpbroadcastd loads", REG THREE("vpbroadcastd (%0), %%zmm")),
    LOOP("12 vpdpbusd, broadcast operand", BCST),
    LOOP("  + 3 zmm loads", BCST THREE("vmovdqu64 (%0), %%zmm")),
    LOOP("  + 3 vpbroadcastd loads", BCST THREE("vpbroadcastd (%0), %%zmm")),
    LOOP("  + 3 vpshufd", BCST THREE("vpshufd $0x55, %%zmm29, %%zmm")),
    LOOP("  + 3 general-register loads", BCST "mov (%0), %%r8\n mov 8(%0), %%r9\n mov 16(%0), %%r10\n"),
};

int main() {
    using clk = std::chrono::steady_clock;
    constexpr long n = 20000000;
    for (const Loop& l : loops) {
        double best = 1e9;
        for (int r = 0; r < 5; r++) {
            const auto t0 = clk::now();
            l.run(n);
            best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count());
        }
        std::printf("%-34s %.3f ns a loop, vpdpbusd %.2f G/s\n", l.name, best / n * 1e9, 12.0 * n / best / 1e9);
    }
}
