// Test rpe_isa_test: two units of one program (isa_unit.cpp built for the x86-64 baseline and for
// AVX2 + FMA + F16C; a third for AVX-512 + AVX512_BF16 and a fourth with AMX-BF16 too where the compiler takes them) run the same fused attention and term forward through rpe. rpe's ISA-dependent code
// is in a namespace per ISA (rpe/backend/cpu/isa.hpp), so each unit keeps its own copy: the two
// report their own ISA (through the functions' addresses, which the linker would merge) and
// give the same results up to float rounding. Exit 77 (skipped) on a CPU without AVX2 + FMA + F16C,
// after running the baseline unit alone.
#include <cmath>
#include <cstdio>
#include <cstring>
#if defined(RPE_ISA_TEST_AMX_UNIT)
#include <cpuid.h>
#endif

#include "isa_unit.hpp"

namespace {

int failures = 0;

void check(bool ok, const char* what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) ++failures;
}

// |a − b| ≤ atol + rtol·|b| for every element (default 1e-5 + 1e-4·|b|), and at least one nonzero.
bool close(const std::vector<float>& a, const std::vector<float>& b, const char* what, double atol = 1e-5, double rtol = 1e-4) {
    if (a.size() != b.size()) return false;
    double worst = 0;
    bool nonzero = false;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return false;
        nonzero = nonzero || a[i] != 0.0f;
        const double err = std::fabs(double(a[i]) - double(b[i]));
        if (err > atol + rtol * std::fabs(double(b[i]))) {
            std::printf("  %s[%zu]: %.9g vs %.9g\n", what, i, double(a[i]), double(b[i]));
            return false;
        }
        worst = err > worst ? err : worst;
    }
    std::printf("  %s: %zu values, largest difference %.3g\n", what, a.size(), worst);
    return nonzero;
}

}  // namespace

int main() {
    const isa_result base = run_baseline();
    std::printf("baseline unit: simd_isa %s, namespace %s\n", base.isa.c_str(), base.ns.c_str());
    check(base.isa == "SSE2", "the baseline unit runs the SSE2 kernels");
    check(base.ns == "sse2", "the baseline unit's rpe code is in namespace sse2");
#if defined(__GNUC__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    const bool avx2 = false;
#endif
    if (!avx2) {
        std::printf("this CPU lacks AVX2, FMA or F16C: the AVX2 unit is not run\n");
        return failures ? 1 : 77;
    }
    const isa_result wide = run_avx2();
    std::printf("AVX2 unit: simd_isa %s, namespace %s\n", wide.isa.c_str(), wide.ns.c_str());
    check(wide.isa == "AVX2", "the AVX2 unit runs the AVX2 kernels");
    check(wide.ns == "avx2_fma", "the AVX2 unit's rpe code is in namespace avx2_fma");
    check(base.attention_fn != wide.attention_fn, "each unit has its own rpe::attention_forward<float>");
    check(close(wide.attention, base.attention, "attention"), "attention outputs agree");
    check(close(wide.term, base.term, "term"), "term outputs agree");
    // bf16: both units take the portable path (float kernels, outputs rounded once): one bf16
    // rounding apart at most (2^-8 relative each)
    check(base.bf16_path == "portable" && wide.bf16_path == "portable",
          "the baseline and AVX2 units take the portable bf16 path");
    check(close(wide.attention_bf16, base.attention_bf16, "attention bf16", 0x1p-12, 0x1p-7), "bf16 attention outputs agree");
    // f16: the baseline unit converts with the portable code, the AVX2 unit (built with -mf16c)
    // with F16C: the same bits; the attention one f16 rounding (2^-11 relative) apart at most
    std::printf("f16 conversions: baseline %s, AVX2 unit %s\n", base.f16_path.c_str(), wide.f16_path.c_str());
    check(base.f16_path == "portable" && wide.f16_path == "F16C",
          "the baseline unit converts f16 portably, the AVX2 unit with F16C");
    check(base.f16_bits == wide.f16_bits && base.f16_bits.size() > 4000, "float -> f16: the same bits (portable and F16C)");
    check(base.f16_wide == wide.f16_wide && base.f16_wide.size() == 65536, "f16 -> float: the same bits on all 65536 values");
    check(close(wide.attention_f16, base.attention_f16, "attention f16", 0x1p-14, 0x1p-10), "f16 attention outputs agree");
#if defined(RPE_ISA_TEST_BF16_UNIT)
    const bool bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bf16");
    if (!bf16) {
        std::printf("this CPU lacks AVX-512 or AVX512_BF16: the AVX512_BF16 unit is not run\n");
        return failures ? 1 : 0;
    }
    const isa_result hw = run_avx512_bf16();
    std::printf("AVX512_BF16 unit: simd_isa %s, namespace %s, bf16 path %s\n", hw.isa.c_str(), hw.ns.c_str(),
                hw.bf16_path.c_str());
    check(hw.ns == "avx512_bf16", "the AVX512_BF16 unit's rpe code is in namespace avx512_bf16");
    check(hw.bf16_path == "AVX512_BF16", "the AVX512_BF16 unit takes the vdpbf16ps bf16 path");
    check(hw.attention_fn != wide.attention_fn && hw.attention_fn != base.attention_fn,
          "the AVX512_BF16 unit has its own rpe::attention_forward<float>");
    check(close(hw.attention, base.attention, "attention (AVX512_BF16 unit)"), "float attention outputs agree");
    // the hardware path also rounds the probabilities to bf16 before P·v: |v| ≤ 1 here, so
    // 2^-8 more than the two output roundings
    check(close(hw.attention_bf16, base.attention_bf16, "attention bf16 (AVX512_BF16 unit)", 0x1p-7, 0x1p-7),
          "bf16 attention outputs agree (vdpbf16ps and portable paths)");
    check(hw.f16_path == "AVX-512F", "the AVX512_BF16 unit converts f16 with AVX-512F");
    check(hw.f16_bits == base.f16_bits && hw.f16_wide == base.f16_wide,
          "f16 conversions: AVX-512F and portable give the same bits");
    check(close(hw.attention_f16, base.attention_f16, "attention f16 (AVX512_BF16 unit)", 0x1p-14, 0x1p-10),
          "f16 attention outputs agree");
#if defined(RPE_ISA_TEST_AMX_UNIT)
    unsigned ca = 0, cb = 0, cc = 0, cd = 0;  // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16
    if (!__get_cpuid_count(7, 0, &ca, &cb, &cc, &cd) || !((cd >> 24) & 1u) || !((cd >> 22) & 1u)) {
        std::printf("SKIP: this CPU lacks AMX-BF16: the AMX unit is not run\n");
        return failures ? 1 : 0;
    }
    const isa_result mx = run_amx_bf16();
    std::printf("AMX unit: simd_isa %s, namespace %s, bf16 path %s\n", mx.isa.c_str(), mx.ns.c_str(), mx.bf16_path.c_str());
    check(mx.ns == "amx_bf16", "the AMX unit's rpe code is in namespace amx_bf16");
    if (mx.bf16_path != "AMX_BF16")
        std::printf("SKIP: the OS does not grant the AMX tile state: the AMX unit ran its vdpbf16ps fallback\n");
    check(mx.bf16_path == "AMX_BF16" || mx.bf16_path == "AVX512_BF16",
          "the AMX unit takes the AMX tiles, or vdpbf16ps where the OS refuses them");
    check(mx.attention_fn != hw.attention_fn && mx.attention_fn != base.attention_fn,
          "the AMX unit has its own rpe::attention_forward<float>");
    check(close(mx.attention, base.attention, "attention (AMX unit)"), "float attention outputs agree");
    // AMX and vdpbf16ps: the same exact bf16 products summed in float in other orders, which can
    // move a bf16 rounding (of an exponential or the output) by one step: 2^-7 relative at most
    check(close(mx.attention_bf16, hw.attention_bf16, "attention bf16 (AMX unit vs AVX512_BF16 unit)", 0x1p-12, 0x1p-7),
          "bf16 attention outputs agree (AMX and vdpbf16ps paths)");
    check(close(mx.attention_bf16, base.attention_bf16, "attention bf16 (AMX unit)", 0x1p-7, 0x1p-7),
          "bf16 attention outputs agree (AMX and portable paths)");
#endif
#endif
    return failures ? 1 : 0;
}
