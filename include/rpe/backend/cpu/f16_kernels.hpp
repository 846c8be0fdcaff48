/// @file backend/cpu/f16_kernels.hpp
/// @brief rpe::f16 array conversions of the CPU backend (not API): f16 → float (exact) and
/// float → f16 (to nearest, ties to even), in the hardware where the unit is built for it.
///
/// The instruction set is the including unit's (isa.hpp): with AVX-512F, 16 values per
/// instruction (`_mm512_cvtph_ps`, `_mm512_cvtps_ph` with `_MM_FROUND_TO_NEAREST_INT`); with F16C
/// (`__F16C__`, e.g. `-march=haswell`, `x86-64-v3` or `native` on any AVX2 CPU; plain `-mavx2`
/// does not imply it), 8 (`_mm256_cvtph_ps`, `_mm256_cvtps_ph`); elsewhere, and for the tails, the
/// portable conversions of rpe::f16 (f16::round_bits, f16::float_bits). Every path gives the same
/// bits (checked on every binary32 value against vcvtps2ph while writing these, and by the unit
/// tests on all 65536 f16 values and a large sample of floats). No CPU of the x86-64 baseline has
/// fp16 arithmetic to use here (AVX512-FP16 is Sapphire Rapids' only): rpe computes in float.
#pragma once

#include <cstdint>

#include "../../f16.hpp"
#include "isa.hpp"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

/// @brief The conversion instructions of this unit's f16 paths: "AVX-512F", "F16C" or "portable".
inline constexpr const char* f16_isa() {
#if defined(__AVX512F__)
    return "AVX-512F";
#elif defined(__F16C__)
    return "F16C";
#else
    return "portable";
#endif
}

/// @brief dst[i] = float(src[i]) for i < n, with the portable conversion only (f16::float_bits).
inline void f16_to_float_portable(const f16* src, float* dst, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// @brief dst[i] = f16(src[i]) for i < n, with the portable rounding only (f16::round_bits).
inline void float_to_f16_portable(const float* src, f16* dst, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = f16(src[i]);
}

/// @brief dst[i] = float(src[i]) for i < n (exact; a signalling NaN comes back quieted), in the
/// hardware where this unit has it (f16_isa()).
inline void f16_to_float(const f16* src, float* dst, std::int64_t n) {
    std::int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    f16_to_float_portable(src + i, dst + i, n - i);
}

/// @brief dst[i] = f16(src[i]) for i < n: to nearest, ties to even (the bits of f16::round_bits on
/// every path), in the hardware where this unit has it (f16_isa()).
inline void float_to_f16(const float* src, f16* dst, std::int64_t n) {
    std::int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    float_to_f16_portable(src + i, dst + i, n - i);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
