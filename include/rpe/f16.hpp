/// @file f16.hpp
/// @brief rpe::f16, the IEEE binary16 (half precision) storage type of the CPU backend
/// (backend-free, no Eigen, no intrinsics).
///
/// binary16: 1 sign, 5 exponent (bias 15) and 10 fraction bits (11 significant bits, unit
/// roundoff 2^-11); normal numbers from 2^-14 (about 6.1e-5) to 65504, subnormals down to 2^-24
/// (about 6.0e-8). rpe::f16 is a 16-bit value type with exactly those bits, so buffers of it are
/// bit-compatible with `_Float16`, CUDA's `__half`, Eigen::half, PyTorch's `at::Half` and NumPy's
/// float16 (reinterpret the pointer). It is a storage type: rpe converts it to float to compute
/// (exactly) and rounds results back once, to nearest even. The conversions here are portable
/// and constexpr; the CPU kernels convert arrays with the hardware's F16C / AVX-512F instructions
/// where the unit is built for them (backend/cpu/f16_kernels.hpp), with the same bits.
#pragma once

#include <bit>
#include <cstdint>

namespace rpe {

/// @brief IEEE binary16 storage (see the file comment).
/// Conversions are explicit: `rpe::f16(x)` rounds a float to nearest, ties to even, as the F16C
/// instruction vcvtps2ph with `_MM_FROUND_TO_NEAREST_INT` does (bit for bit): finite values of
/// magnitude ≥ 65520 round to ±∞, values below 2^-14 to subnormals (below 2^-25, and 2^-25 itself,
/// to ±0), ±∞ stays ±∞, a NaN stays a NaN of the same sign, quieted, with the top 9 bits of its
/// payload. `static_cast<float>(h)` is exact; a signalling NaN comes back quieted (as vcvtph2ps).
struct f16 {
    std::uint16_t bits = 0;  ///< the raw bits (sign, 5 exponent bits, 10 fraction bits)

    f16() = default;
    /// @brief Rounds `x` to nearest, ties to even.
    constexpr explicit f16(float x) : bits(round_bits(x)) {}
    /// @brief The exact float value.
    constexpr explicit operator float() const { return std::bit_cast<float>(float_bits(bits)); }
    /// @brief The exact value as a double (two steps: f16 → float → double, both exact).
    constexpr explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

    /// @brief An f16 with the given raw bits.
    static constexpr f16 from_bits(std::uint16_t b) {
        f16 r;
        r.bits = b;
        return r;
    }
    /// @brief The bits of `x` rounded to nearest, ties to even (see f16(float)).
    static constexpr std::uint16_t round_bits(float x) {
        const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
        const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
        const std::uint32_t a = u & 0x7fffffffu;
        if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN: quiet
        if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // ≥ 65520 (the tie above 65504), ∞
        if (a >= 0x38800000u) {  // a normal f16 (≥ 2^-14): rebias the exponent (127 → 15), round off 13 bits
            const std::uint32_t m = a - 0x38000000u;
            return static_cast<std::uint16_t>(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
        }
        if (a <= 0x33000000u) return sign;  // ≤ 2^-25: ±0 (2^-25 is the tie between 0 and 2^-24: even)
        // a subnormal f16: k·2^-24 with k = round(|x|·2^24) = round(mant·2^(e − 126)), e ∈ [102, 112]
        const std::uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
        std::uint32_t k = mant >> shift;
        const std::uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (k & 1u))) ++k;  // k = 1024 is 2^-14, the smallest normal: right bits
        return static_cast<std::uint16_t>(sign | k);
    }
    /// @brief The binary32 bits of the f16 with bits `h` (exact; a NaN quieted, sign and payload kept).
    static constexpr std::uint32_t float_bits(std::uint16_t h) {
        const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
        const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
        if (e == 0x1fu) return sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);  // ∞, or NaN (quiet)
        if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);                      // normal: rebias 15 → 127
        if (m == 0) return sign;                                                       // ±0
        // subnormal m·2^-24: normalise (m has its leading 1 at bit 9 − s)
        std::uint32_t s = 0;
        while (!(m << s & 0x400u)) ++s;
        return sign | ((113u - s) << 23) | (((m << s) & 0x3ffu) << 13);
    }
    /// @brief Equal bits (so +0 != −0 and NaN == the same NaN): a storage comparison.
    friend constexpr bool operator==(f16 a, f16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(f16) == 2 && alignof(f16) == 2, "rpe::f16 must be 16 bits, as __half and _Float16");
static_assert(f16(1.0f).bits == 0x3c00 && f16(65504.0f).bits == 0x7bff && f16(0x1p-24f).bits == 0x0001);
static_assert(static_cast<float>(f16::from_bits(0x0001)) == 0x1p-24f && static_cast<float>(f16::from_bits(0x7bff)) == 65504.0f);

/// @brief `x` rounded to f16 and back (to nearest, ties to even): what storing in f16 keeps.
constexpr float round_to_f16(float x) { return static_cast<float>(f16(x)); }

}  // namespace rpe
