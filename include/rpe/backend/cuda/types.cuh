/// @file backend/cuda/types.cuh
/// @brief Scalar types of the CUDA backend: storage type S, accumulation type acc_t<S>, and the
/// conversions between them (host and device).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "../../config.hpp"

namespace rpe::cuda {

/// @brief The storage scalar types of the CUDA backend: float, double, __half and __nv_bfloat16.
/// fp16 and bf16 are storage only: every sum is accumulated in float (double for double).
template <class S>
concept DeviceScalar =
    std::is_same_v<S, float> || std::is_same_v<S, double> || std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;

/// @brief Accumulation type of storage type S: double for double, float otherwise.
template <class S>
using acc_t = std::conditional_t<std::is_same_v<S, double>, double, float>;

/// @brief Converts a stored value to its accumulation type.
template <class S>
RPE_HOST_DEVICE acc_t<S> to_acc(S v) {
    if constexpr (std::is_same_v<S, __half>)
        return __half2float(v);
    else if constexpr (std::is_same_v<S, __nv_bfloat16>)
        return __bfloat162float(v);
    else
        return v;
}

/// @brief Rounds an accumulated value to storage type S (round to nearest even).
template <class S, class A>
RPE_HOST_DEVICE S from_acc(A v) {
    if constexpr (std::is_same_v<S, __half>)
        return __float2half_rn(static_cast<float>(v));
    else if constexpr (std::is_same_v<S, __nv_bfloat16>)
        return __float2bfloat16_rn(static_cast<float>(v));
    else
        return static_cast<S>(v);
}

/// @brief Unit roundoff of S (2^-24 float, 2^-53 double, 2^-11 fp16, 2^-8 bf16), for tolerances.
template <class S>
constexpr double unit_roundoff() {
    if constexpr (std::is_same_v<S, __half>)
        return 1.0 / 2048.0;
    else if constexpr (std::is_same_v<S, __nv_bfloat16>)
        return 1.0 / 256.0;
    else if constexpr (std::is_same_v<S, double>)
        return 1.1102230246251565e-16;
    else
        return 5.9604644775390625e-08;
}

}  // namespace rpe::cuda
