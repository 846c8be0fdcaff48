/// @file rope/rounding.hpp
/// @brief Products rounded to their type before any later addition, whatever the compiler's
/// contraction flags (not API): the rotary forms' angles round as their sources do.
#pragma once

#include "../config.hpp"

namespace rpe::detail {

/// @brief `a * b` rounded to T (float or double) before it meets any addition. GNU compilers
/// contract `a*b + c` into one fused multiply-add under `-ffp-contract=fast` (their default, so
/// under `-march=native` with FMA), across statements too; an empty asm statement that takes
/// the product in and out of a register hides it from that fusion and costs nothing else (no
/// volatile store). nvcc's device code uses the explicitly rounded intrinsics.
template <class T>
RPE_HOST_DEVICE T rounded_product(T a, T b) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == sizeof(float))
        return __fmul_rn(a, b);
    else
        return __dmul_rn(a, b);
#else
    T p = a * b;
#if defined(__GNUC__) || defined(__clang__)
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(p));
#elif defined(__aarch64__)
    __asm__("" : "+w"(p));
#else
    __asm__("" : "+m"(p));
#endif
#endif
    return p;
#endif
}

/// @brief `a*b + c*d` as two rounded products, then their rounded sum (never an FMA).
template <class T>
RPE_HOST_DEVICE T rounded_dot2(T a, T b, T c, T d) {
    return rounded_product(a, b) + rounded_product(c, d);
}

}  // namespace rpe::detail
