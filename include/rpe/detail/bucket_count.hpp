/// @file detail/bucket_count.hpp
/// @brief Overflow-free bucket counts for the mappings' num_buckets() (not API).
#pragma once

#include <cstdint>
#include <string>

#include "../config.hpp"
#include "../error.hpp"

namespace rpe::detail {

/// @brief `int(v)` truncated toward zero, saturated to [INT_MIN, INT_MAX]; NaN gives 0. Unlike
/// `static_cast<int>`, defined for every double (β = 1e300 gives INT_MAX, not UB).
RPE_HOST_DEVICE constexpr int saturating_int(double v) {
    if (!(v == v)) return 0;
    if (v >= 2147483647.0) return 2147483647;
    if (v <= -2147483648.0) return -2147483647 - 1;
    return static_cast<int>(v);
}

/// @brief `2·b + 1` in int64 (no overflow for any int b).
RPE_HOST_DEVICE constexpr std::int64_t span_of(int b) { return 2 * static_cast<std::int64_t>(b) + 1; }

/// @brief True when the product of the given extents (each in [0, 2^33)) fits in int (at most
/// 2^31 − 1 buckets); checked step by step without overflow.
template <class... E>
RPE_HOST_DEVICE constexpr bool bucket_count_fits(E... extents) {
    std::int64_t n = 1;
    bool fits = true;
    ((fits = fits && extents >= 0 && (extents == 0 || n <= 2147483647 / extents), n = fits ? n * extents : n), ...);
    return fits;
}

/// @brief The product of the extents as an int; its caller checks bucket_count_fits first (on the
/// host it throws through the mapping's validate() when they do not fit).
template <class... E>
RPE_HOST_DEVICE constexpr int bucket_count(E... extents) {
    std::int64_t n = 1;
    ((n *= extents), ...);
    return static_cast<int>(n);
}

/// @brief Throws rpe::invalid_argument `[rpe.<component>] num_buckets = <formula> = e1 * e2 ...
/// does not fit in int; expected at most 2^31 - 1 buckets`: a mapping's num_buckets() on the
/// host for parameters whose count overflows, after its validate() found nothing more precise.
template <class... E>
[[noreturn]] void throw_bucket_overflow(const char* component, const char* formula, E... extents) {
    std::string product;
    ((product += (product.empty() ? "" : " * ") + std::to_string(extents)), ...);
    throw invalid_argument(message(component, "num_buckets = ", formula, " = ", product,
                                   " does not fit in int; expected at most 2^31 - 1 buckets"));
}

}  // namespace rpe::detail
