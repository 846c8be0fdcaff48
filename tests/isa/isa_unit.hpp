/// @file isa_unit.hpp
/// @brief What one unit of test rpe_isa_test reports (see CMakeLists.txt): the same fused
/// attention (float and bf16) and term forward on the same inputs, computed by the rpe code of that unit's ISA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct isa_result {
    std::vector<float> attention;         ///< rpe::attention_forward output (B, H, L, D)
    std::vector<float> term;              ///< rpe::term::forward output (B, H, L, L)
    std::string isa;                      ///< rpe::detail::cpu::simd_isa(), called through its address
    std::string ns;                       ///< rpe::detail::cpu::isa_namespace(), through its address
    const void* attention_fn = nullptr;   ///< &rpe::attention_forward<float> as this unit sees it
    std::vector<float> attention_bf16;    ///< the same attention on rpe::bf16 storage (values as float)
    std::string bf16_path;                ///< detail::cpu::bf16_attention_isa(): "AMX_BF16", "AVX512_BF16", "portable"
    std::vector<float> attention_f16;     ///< the same attention on rpe::f16 storage (values as float)
    std::vector<std::uint16_t> f16_bits;  ///< detail::cpu::float_to_f16 of a fixed sample (ties, range ends, NaN)
    std::vector<std::uint32_t> f16_wide;  ///< detail::cpu::f16_to_float of all 65536 f16 values, as bits
    std::string f16_path;                 ///< rpe::detail::cpu::f16_isa(): "AVX-512F", "F16C" or "portable"
};

isa_result run_baseline();     // unit compiled with -march=x86-64
isa_result run_avx2();         // unit compiled with -mavx2 -mfma -mf16c
isa_result run_avx512_bf16();  // unit compiled with -march=x86-64-v4 -mavx512bf16 (when the compiler takes it)
isa_result run_amx_bf16();     // unit compiled with those and -mamx-tile -mamx-bf16 (when the compiler takes them)
