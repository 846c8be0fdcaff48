/// @file isa_unit.hpp
/// @brief What one unit of test rpe_isa_test reports (see CMakeLists.txt): the same fused
/// attention and term forward on the same inputs, computed by the rpe code of that unit's ISA.
#pragma once

#include <string>
#include <vector>

struct isa_result {
    std::vector<float> attention;        ///< rpe::attention_forward output (B, H, L, D)
    std::vector<float> term;             ///< rpe::term::forward output (B, H, L, L)
    std::string isa;                     ///< rpe::detail::cpu::simd_isa(), called through its address
    std::string ns;                      ///< rpe::detail::cpu::isa_namespace(), through its address
    const void* attention_fn = nullptr;  ///< &rpe::attention_forward<float> as this unit sees it
};

isa_result run_baseline();  // unit compiled with -march=x86-64
isa_result run_avx2();      // unit compiled with -mavx2 -mfma
