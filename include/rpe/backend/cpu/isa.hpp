/// @file backend/cpu/isa.hpp
/// @brief The instruction set of the including translation unit, as a namespace name (not API).
///
/// The CPU kernels are inline code whose machine code depends on the ISA flags of the unit that
/// compiles them (`-march`, `-mavx2`, ...). In a program whose units are built for different
/// ISAs, one inline function of one name would keep one copy (the linker picks it: the wrong
/// vector path, or an illegal instruction on a CPU without it). So every ISA-dependent function
/// of rpe (the CPU backend, and rpe's own inline or template code that instantiates it) lives in
/// `inline namespace RPE_ISA_NS`, named after the ISA: units built for different ISAs get
/// distinct symbols, and callers still write `rpe::attention_forward`, `rpe::detail::cpu::...`.
/// Member functions of ISA-neutral class templates (rpe::term::forward, ...) carry the same name
/// as an ABI tag (`RPE_ISA_TAG`, g++ and clang).
///
/// Tiers (the first that the compiler's predefined macros enable): `amx_bf16` (`__AMX_TILE__`,
/// `__AMX_BF16__`, `__AVX512BF16__` and `__AVX512F__`, e.g. `-march=native` on Sapphire Rapids: the
/// bf16 attention forward's block products on AMX tiles, falling back at run time to vdpbf16ps
/// where the OS refuses the tile state), `avx512_bf16` (`__AVX512F__`
/// and `__AVX512BF16__`: the bf16 attention's vdpbf16ps products, bf16_kernels.hpp), `avx512`
/// (`__AVX512F__`), `avx2_fma`, `avx2`, `avx`, `sse4` (`__SSE4_1__`), `sse2` (the x86-64 baseline), `neon`,
/// `generic`. Define RPE_ISA_NS (an identifier) before including rpe to separate finer
/// distinctions. Not covered: Eigen's own inline code (its matrix products) and the user's inline
/// code that calls rpe keep one copy per program, as they would without rpe.
#pragma once

#if !defined(RPE_ISA_NS)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define RPE_ISA_NS amx_bf16
#elif defined(__AVX512F__) && defined(__AVX512BF16__)
#define RPE_ISA_NS avx512_bf16
#elif defined(__AVX512F__)
#define RPE_ISA_NS avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define RPE_ISA_NS avx2_fma
#elif defined(__AVX2__)
#define RPE_ISA_NS avx2
#elif defined(__AVX__)
#define RPE_ISA_NS avx
#elif defined(__SSE4_1__)
#define RPE_ISA_NS sse4
#elif defined(__SSE2__) || defined(_M_X64)
#define RPE_ISA_NS sse2
#elif defined(__ARM_NEON)
#define RPE_ISA_NS neon
#else
#define RPE_ISA_NS generic
#endif
#endif

#define RPE_ISA_STR2(x) #x
#define RPE_ISA_STR(x) RPE_ISA_STR2(x)

/// The ISA namespace's name as an ABI tag on member functions of ISA-neutral classes that call
/// the CPU kernels (their mangled names then differ per ISA like the namespace's functions).
#if defined(__GNUC__) || defined(__clang__)
#define RPE_ISA_TAG [[gnu::abi_tag(RPE_ISA_STR(RPE_ISA_NS))]]
#else
#define RPE_ISA_TAG
#endif

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {

/// @brief Name of the instruction set whose explicit vector paths the CPU kernels of this
/// translation unit take: "AVX-512F", "AVX2", "SSE2", "NEON" or "scalar".
inline constexpr const char* simd_isa() {
#if defined(__AVX512F__)
    return "AVX-512F";
#elif defined(__AVX2__)
    return "AVX2";
#elif defined(__SSE2__)
    return "SSE2";
#elif defined(__ARM_NEON)
    return "NEON";
#else
    return "scalar";
#endif
}

/// @brief The name of this unit's ISA namespace (RPE_ISA_NS), e.g. "avx2_fma".
inline constexpr const char* isa_namespace() { return RPE_ISA_STR(RPE_ISA_NS); }

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
