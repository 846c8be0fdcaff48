/// @file bf16.hpp
/// @brief rpe::bf16, the bfloat16 storage type of the CPU backend (backend-free, no Eigen).
///
/// bfloat16 is the upper half of an IEEE binary32: 1 sign, 8 exponent and 7 fraction bits (8
/// significant bits, unit roundoff 2^-8), the range of float. rpe::bf16 is a 16-bit value type
/// with exactly those bits, so buffers of it are bit-compatible with Eigen::bfloat16, CUDA's
/// `__nv_bfloat16`, PyTorch's `at::BFloat16` and NumPy's ml_dtypes.bfloat16 (reinterpret the
/// pointer). It is a storage type: rpe converts it to float to compute (exactly) and rounds
/// results back once, to nearest even. It is a struct of its own rather than Eigen::bfloat16
/// because the backend-free core (rpe::attention_inputs, <rpe/core.hpp>) includes no Eigen.
#pragma once

#include <bit>
#include <cstdint>

namespace rpe {

/// @brief bfloat16 storage: the upper 16 bits of a binary32 (see the file comment).
/// Conversions are explicit: `rpe::bf16(x)` rounds a float to nearest, ties to even (NaN stays
/// a quiet NaN of the same sign, ±∞ stays ±∞, finite values above the largest bf16 (about
/// 3.39e38) round to ±∞, denormals are kept); `static_cast<float>(b)` is exact.
struct bf16 {
    std::uint16_t bits = 0;  ///< the raw bits (sign, exponent, 7 fraction bits)

    bf16() = default;
    /// @brief Rounds `x` to nearest, ties to even.
    constexpr explicit bf16(float x) : bits(round_bits(x)) {}
    /// @brief The exact float value.
    constexpr explicit operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
    /// @brief The exact value as a double (two steps: bf16 → float → double, both exact).
    constexpr explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

    /// @brief A bf16 with the given raw bits.
    static constexpr bf16 from_bits(std::uint16_t b) {
        bf16 r;
        r.bits = b;
        return r;
    }
    /// @brief The bits of `x` rounded to nearest, ties to even (see bf16(float)).
    static constexpr std::uint16_t round_bits(float x) {
        const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet
        return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    /// @brief Equal bits (so +0 != −0 and NaN == the same NaN): a storage comparison.
    friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "rpe::bf16 must be 16 bits, as __nv_bfloat16 and Eigen::bfloat16");

/// @brief `x` rounded to bf16 and back (to nearest, ties to even): what storing in bf16 keeps.
constexpr float round_to_bf16(float x) { return static_cast<float>(bf16(x)); }

}  // namespace rpe
