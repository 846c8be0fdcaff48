/// @file rope/mixed.hpp
/// @brief rpe::rope::mixed: RoPE-Mixed of rope-vit (2D rotary position embedding with learned
/// per-head frequencies).
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "../detail/math.hpp"
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
    RPE_HOST_DEVICE static double angle_at(double y, double x, double fx, double fy) {
        return detail::rounded_dot2(x, fx, y, fy);
    }
    /// @brief As angle(int, int, float, float), in double.
    RPE_HOST_DEVICE static double angle(int row, int col, double fx, double fy) {
        return detail::rounded_dot2(static_cast<double>(col), fx, static_cast<double>(row), fy);
    }
    void validate() const {}
    friend bool operator==(const mixed&, const mixed&) = default;
};

}  // namespace rpe::rope
