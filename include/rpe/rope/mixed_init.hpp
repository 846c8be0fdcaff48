/// @file rope/mixed_init.hpp
/// @brief rpe::rope::init_mixed_frequencies: rope-vit's initial RoPE-Mixed frequencies (apart
/// from the policy header rope/mixed.hpp, which every unit includes); like the policy headers it
/// includes neither `<cmath>` nor `<span>` (detail/math.hpp; any contiguous range of floats).
/// Included by <rpe/rope/rotary.hpp> and the umbrella headers.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "../detail/math.hpp"
#include "../detail/raise.hpp"
#include "mixed.hpp"

namespace rpe::rope {

/// @brief rope-vit's initial RoPE-Mixed frequencies (init_random_2d_freqs) for given per-head
/// rotations: with `mag_j = 1 / θ^(4j / D)` (j < D/4) and head h's angle a_h (rope-vit draws it
/// uniformly in [0, 2π); `rotate = false` there is a_h = 0),
/// `fx[h] = [mag·cos(a_h), mag·cos(π/2 + a_h)]`, `fy[h] = [mag·sin(a_h), mag·sin(π/2 + a_h)]`.
/// @param angles (H) float, any contiguous range with data() and size() (std::vector, std::span, std::array).
/// @param out (2, H, D/2) float, H = angles.size(), written (a contiguous range as `angles`).
/// @throws rpe::invalid_argument `[rpe.rope] ...` for head_dim not a positive multiple of 4,
///   θ not finite and > 0, or out.size() != 2·H·D/2.
template <class Angles, class Out>
requires requires(const Angles& a, Out& o) {
    { a.data() } -> std::convertible_to<const float*>;
    { o.data() } -> std::convertible_to<float*>;
    a.size();
    o.size();
}
void init_mixed_frequencies(float theta, int head_dim, const Angles& angles, Out&& out) {
    detail::require(head_dim >= 4 && head_dim % 4 == 0, "rope", "head_dim = ", head_dim, "; expected a positive multiple of 4");
    detail::require(detail::math::isfinite(theta) && theta > 0.0f, "rope", "theta = ", theta, "; expected finite and > 0");
    const std::int64_t h = static_cast<std::int64_t>(angles.size()), half = head_dim / 2, quarter = head_dim / 4;
    detail::require(static_cast<std::int64_t>(out.size()) == 2 * h * half, "rope", "out holds ", out.size(),
                    " values; expected 2*H*D/2 = ", 2 * h * half);
    const float half_pi = 1.57079632679489661923f;
    for (std::int64_t i = 0; i < h; ++i) {
        const float a = angles.data()[i];
        for (std::int64_t j = 0; j < quarter; ++j) {
            const float mag = 1.0f / detail::math::pow(theta, static_cast<float>(4 * j) / static_cast<float>(head_dim));
            float* fx = out.data() + i * half;
            float* fy = out.data() + (h + i) * half;
            fx[j] = mag * detail::math::cos(a);
            fx[quarter + j] = mag * detail::math::cos(half_pi + a);
            fy[j] = mag * detail::math::sin(a);
            fy[quarter + j] = mag * detail::math::sin(half_pi + a);
        }
    }
}

}  // namespace rpe::rope
