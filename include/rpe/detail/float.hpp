/// @file detail/float.hpp
/// @brief Float helpers that keep the reference's rounding (not API).
#pragma once

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

}  // namespace rpe::detail
