/// @file index/clip.hpp
/// @brief The clip index function of Shaw et al. (paper eqs. 7–9), as a drop-in for piecewise.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/math.hpp"
#include "../detail/validate.hpp"

namespace rpe::index {

/// @brief Clip index: `clip(x) = max(−βi, min(βi, round(x)))` with `βi = int(β)`.
///
/// Integer offsets are used as they are; real inputs are rounded half to even first (as the
/// piecewise index does inside α). Output in `[−beta_int(), beta_int()]`.
/// Valid parameters: finite `0 ≤ β < 2^30`, checked by `validate()`.
/// Source: Shaw et al. 2018 (paper eqs. 7–9); the paper's tab. 3 compares it with eq. 18.
struct clip {
    double beta = 3.0;  ///< β: offsets beyond ±int(β) share the end buckets

    /// @brief `int(β)` (saturated at INT_MAX for a β beyond int, which validate() refuses).
    RPE_HOST_DEVICE constexpr int beta_int() const { return detail::saturating_int(beta); }

    /// @brief clip at an integer offset.
    RPE_HOST_DEVICE constexpr int operator()(std::int64_t x) const {
        const std::int64_t b = beta_int();
        return static_cast<int>(x < -b ? -b : (x > b ? b : x));
    }

    /// @brief clip at a real input: round half to even, then clip; NaN gives βi.
    ///
    /// The clip is done in double, where ±βi is exact (in float, βi ≥ 2^24 may round up and give
    /// an index beyond the table: found by fuzz/fuzz_index.cpp).
    RPE_HOST_DEVICE int operator()(float x) const {
        const double b = static_cast<double>(beta_int());
        return static_cast<int>(detail::math::fmax(-b, detail::math::fmin(b, detail::math::nearbyint(static_cast<double>(x)))));
    }

    /// @brief Throws rpe::invalid_argument `[rpe.index.clip] ...` for an invalid β.
    void validate() const { detail::validate_clip_beta("index.clip", beta); }

    friend constexpr bool operator==(const clip&, const clip&) = default;
};

}  // namespace rpe::index
