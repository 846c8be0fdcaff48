/// @file rope/axial.hpp
/// @brief rpe::rope::axial: RoPE-Axial of rope-vit (2D rotary position embedding, fixed
/// frequencies, x and y each on half of the channel pairs).
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"

namespace rpe::rope {

/// @brief RoPE-Axial (Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024):
/// channel pair p (channels 2p, 2p+1, rotated as the complex number x_2p + i·x_2p+1) of a head
/// of D channels at grid token (row, col) turns by
///   p <  D/4: col · f_p,   p >= D/4: row · f_(p − D/4),   f_j = 1 / θ^(4j / D)
/// (float32 as the source: `4j / D` in float32, then `θ^e`, then `1 / …`, then the product with
/// the coordinate). Tokens are numbered row-major after the skip tokens (t_x = t mod width,
/// t_y = t div width, the source's init_t_xy with end_x = width).
/// D must be a multiple of 4. `theta` must be finite and > 0 (checked by validate()).
/// Source: naver-ai/rope-vit `deit/models_v2_rope.py`, compute_axial_cis (θ = 100 in the
/// rope_axial_deit_* models) and apply_rotary_emb.
struct axial {
    float theta = 100.0f;  ///< base of the frequencies (rope-vit's rope_theta)

    static constexpr int head_dim_multiple = 4;

    /// @brief Frequency f_j = 1 / θ^(4j / D) of band j in [0, D/4) (float32).
    RPE_HOST_DEVICE float frequency(int band, int head_dim) const {
        const float e = static_cast<float>(4 * band) / static_cast<float>(head_dim);
        return 1.0f / detail::math::pow(theta, e);
    }
    /// @brief Angle (radians) of pair `pair` at (row, col); height unused.
    RPE_HOST_DEVICE float angle(int row, int col, int pair, int head_dim, int /*height*/, int /*width*/) const {
        const int quarter = head_dim / 4;
        return pair < quarter ? static_cast<float>(col) * frequency(pair, head_dim)
                              : static_cast<float>(row) * frequency(pair - quarter, head_dim);
    }
    /// @brief Angle (radians) of pair `pair` at the real coordinates (y, x) of a per-token
    /// position (rpe::rotary_embedding::positions): `x · f_p` (p < D/4), else `y · f_(p − D/4)`;
    /// at (row, col) of the grid it is angle(row, col, ...) bit for bit.
    RPE_HOST_DEVICE float angle_at(float y, float x, int pair, int head_dim) const {
        const int quarter = head_dim / 4;
        return pair < quarter ? x * frequency(pair, head_dim) : y * frequency(pair - quarter, head_dim);
    }
    /// @throws rpe::invalid_argument `[rpe.rope] theta = ...; expected finite and > 0`.
    void validate() const {
        detail::require(detail::math::isfinite(theta) && theta > 0.0f, "rope", "theta = ", theta, "; expected finite and > 0");
    }
    friend bool operator==(const axial&, const axial&) = default;
};

}  // namespace rpe::rope

static_assert(rpe::RotaryPolicy<rpe::rope::axial>);
