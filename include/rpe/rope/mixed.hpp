/// @file rope/mixed.hpp
/// @brief rpe::rope::mixed: RoPE-Mixed of rope-vit (2D rotary position embedding with learned
/// per-head frequencies).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "../config.hpp"
#include "../detail/raise.hpp"
#include "rounding.hpp"

namespace rpe::rope {

/// @brief RoPE-Mixed (Heo et al., ECCV 2024): channel pair p of head h at grid token
/// (row, col) turns by `col · fx[h, p] + row · fy[h, p]` (float32: each product, then the sum),
/// with learned frequencies `freqs` (2, H, D/2): [0] = fx, [1] = fy. rope-vit keeps one model's
/// frequencies as a (2, depth, H·D/2) parameter; `freqs[:, layer]` viewed (2, H, D/2) is this
/// layout. The frequencies are given with the call (rpe::rotary_embedding::freqs), so a
/// training step's values are used as they are; their gradient comes from the backward.
/// D must be even.
/// Source: naver-ai/rope-vit `deit/models_v2_rope.py`, compute_mixed_cis, init_t_xy,
/// apply_rotary_emb (θ = 10 in the rope_mixed_deit_* models, used only by the initialisation).
struct mixed {
    static constexpr int head_dim_multiple = 2;

    /// @brief Angle (radians) from the pair's frequencies: `col·fx` and `row·fy` each rounded,
    /// then their rounded sum, as rope-vit and timm compute it (never one fused multiply-add,
    /// whatever the compiler flags; detail::rounded_dot2). float32 as the sources; the double
    /// overload (a double rotation) rounds the same way in double.
    RPE_HOST_DEVICE static float angle(int row, int col, float fx, float fy) {
        return detail::rounded_dot2(static_cast<float>(col), fx, static_cast<float>(row), fy);
    }
    /// @brief Angle at the real coordinates (y, x) of a per-token position
    /// (rpe::rotary_embedding::positions): `x·fx` and `y·fy` rounded, then their sum; equal to
    /// angle(row, col, fx, fy) at (row, col).
    RPE_HOST_DEVICE static float angle_at(float y, float x, float fx, float fy) { return detail::rounded_dot2(x, fx, y, fy); }
    /// @brief As angle_at(float, float, float, float), in double.
    RPE_HOST_DEVICE static double angle_at(double y, double x, double fx, double fy) { return detail::rounded_dot2(x, fx, y, fy); }
    /// @brief As angle(int, int, float, float), in double.
    RPE_HOST_DEVICE static double angle(int row, int col, double fx, double fy) {
        return detail::rounded_dot2(static_cast<double>(col), fx, static_cast<double>(row), fy);
    }
    void validate() const {}
    friend bool operator==(const mixed&, const mixed&) = default;
};

/// @brief rope-vit's initial RoPE-Mixed frequencies (init_random_2d_freqs) for given per-head
/// rotations: with `mag_j = 1 / θ^(4j / D)` (j < D/4) and head h's angle a_h (rope-vit draws it
/// uniformly in [0, 2π); `rotate = false` there is a_h = 0),
/// `fx[h] = [mag·cos(a_h), mag·cos(π/2 + a_h)]`, `fy[h] = [mag·sin(a_h), mag·sin(π/2 + a_h)]`.
/// @param out (2, H, D/2) float, H = angles.size(), written.
/// @throws rpe::invalid_argument `[rpe.rope] ...` for head_dim not a positive multiple of 4,
///   θ not finite and > 0, or out.size() != 2·H·D/2.
inline void init_mixed_frequencies(float theta, int head_dim, std::span<const float> angles, std::span<float> out) {
    detail::require(head_dim >= 4 && head_dim % 4 == 0, "rope", "head_dim = ", head_dim, "; expected a positive multiple of 4");
    detail::require(std::isfinite(theta) && theta > 0.0f, "rope", "theta = ", theta, "; expected finite and > 0");
    const std::int64_t h = static_cast<std::int64_t>(angles.size()), half = head_dim / 2, quarter = head_dim / 4;
    detail::require(static_cast<std::int64_t>(out.size()) == 2 * h * half, "rope", "out holds ", out.size(),
                    " values; expected 2*H*D/2 = ", 2 * h * half);
    const float half_pi = 1.57079632679489661923f;
    for (std::int64_t i = 0; i < h; ++i) {
        const float a = angles[static_cast<std::size_t>(i)];
        for (std::int64_t j = 0; j < quarter; ++j) {
            const float mag = 1.0f / std::pow(theta, static_cast<float>(4 * j) / static_cast<float>(head_dim));
            float* fx = out.data() + i * half;
            float* fy = out.data() + (h + i) * half;
            fx[j] = mag * std::cos(a);
            fx[quarter + j] = mag * std::cos(half_pi + a);
            fy[j] = mag * std::sin(a);
            fy[quarter + j] = mag * std::sin(half_pi + a);
        }
    }
}

}  // namespace rpe::rope
