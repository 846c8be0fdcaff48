/// @file detail/bucket_count.hpp
/// @brief Overflow-free bucket counts for the mappings' num_buckets() (not API).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../config.hpp"
#include "raise.hpp"

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
    message_part parts[3 + 2 * sizeof...(E)];
    int n = 0;
    parts[n++] = "num_buckets = ";
    parts[n++] = formula;
    parts[n++] = " = ";
    const auto add = [&](std::int64_t e) {
        if (n > 3) parts[n++] = " * ";
        parts[n++] = e;
    };
    (add(static_cast<std::int64_t>(extents)), ...);
    parts[n++] = " does not fit in int; expected at most 2^31 - 1 buckets";
    raise_invalid_argument(component, parts, n);
}

/// @brief The bucket count of a mapping's num_buckets(): the product of `extents` (each in
/// [0, 2^33)) as an int. On the host, outside constant evaluation, it first runs `m.validate()`
/// (so invalid parameters, e.g. a NaN β or a negative count, throw rpe::invalid_argument naming the
/// parameter), then throws throw_bucket_overflow's message when the product does not fit in int
/// (parameters that pass validate(), e.g. a custom index function's beta_int()). In device code
/// (and in constant expressions) it only multiplies.
/// @param component the mapping's message id, e.g. `"mapping.product"`.
/// @param formula the count as the message spells it, e.g. `"(2*beta_int+1)^2"`.
template <class M, class... E>
RPE_HOST_DEVICE constexpr int mapping_bucket_count(const M& m, const char* component, const char* formula, E... extents) {
#if !defined(__CUDA_ARCH__)
    if (!std::is_constant_evaluated()) {
        m.validate();
        if (!bucket_count_fits(extents...)) throw_bucket_overflow(component, formula, extents...);
    }
#else
    (void)m, (void)component, (void)formula;
#endif
    return bucket_count(extents...);
}

}  // namespace rpe::detail
