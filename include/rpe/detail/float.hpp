/// @file detail/float.hpp
/// @brief Numeric helpers: float products that keep the reference's rounding, overflow-free
/// squared distances (not API).
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace rpe::detail {

/// @brief `a * b` rounded to float before any later addition: compilers allowed to contract
/// (`-ffp-contract=fast`, the GNU dialect's default, or nvcc) could otherwise fuse it with the
/// following add into an FMA and change the piecewise index at near-ties.
RPE_HOST_DEVICE float mul_no_contract(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    volatile float product = a * b;
    return product;
#endif
}

/// @brief `dr² + dc²` in uint64, without the int64 overflow of `dr = dc = INT_MIN` (2^63).
RPE_HOST_DEVICE constexpr std::uint64_t square_sum(int dr, int dc) {
    const std::uint64_t r = dr < 0 ? 0 - static_cast<std::uint64_t>(dr) : static_cast<std::uint64_t>(dr);
    const std::uint64_t c = dc < 0 ? 0 - static_cast<std::uint64_t>(dc) : static_cast<std::uint64_t>(dc);
    return r * r + c * c;
}

}  // namespace rpe::detail
