/// @file rope/dinov3.hpp
/// @brief rpe::rope::dinov3: DINOv3's 2D rotary position embedding (RopePositionEmbedding; timm's
/// RotaryEmbeddingDinoV3), a fixed-frequency policy used as `rope::custom{rope::dinov3{...}}`
/// with the rotate-half layout.
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"
#include "cat.hpp"
#include "layout.hpp"

namespace rpe::rope {

/// @brief DINOv3's coordinate normalisation (`normalize_coords`).
enum class dinov3_normalize : unsigned char {
    separate = 0,  ///< each axis by its own size (DINOv3's default)
    max = 1,       ///< both axes by max(height, width)
    min = 2,       ///< both axes by min(height, width)
};

/// @brief DINOv3's RoPE (Siméoni et al., 2025). For a head of D channels (D a multiple of 4),
/// `nq = D/4` periods and pair j (j < D/2) on axis `a = j div nq` (0: rows, 1: columns; DINOv3's
/// coordinates are (h, w)) with period index `k = j mod nq`:
/// - coordinates (float32): `c = 2·((i + 0.5) / n) − 1` along an axis of s tokens, n = s
///   (`separate`), max(H, W) or min(H, W); then the training augmentations as already-sampled
///   values, in DINOv3's order: `c = c + shift_a`, `c = c · jitter_a`, `c = c · rescale` (the
///   defaults 0, 1, 1 leave c unchanged: no augmentation, as at inference);
/// - periods (float32): `base^(2k / (D/2))` (DINOv3's `base`, timm's `temperature`; default 100),
///   or, with min_period and max_period both > 0, `min_period · (max_period/min_period)^e_k` with
///   `e = linspace(0, 1, nq)`;
/// - angle `(2π · c_a) / period_k` (2π rounded to float32 first, as torch does with a Python float).
/// Channels pair j with j + D/2 (rope::layout::half: `x·cos + rotate_half(x)·sin`); the CLS and
/// storage (register) tokens are rotary_embedding::skip (1 + 4 in the released models).
/// Per-token positions (rotary_embedding::positions, angle_at) are DINOv3's own coordinates,
/// already in its (−1, 1) frame: the augmentations apply to them, the normalisation does not.
/// Source: facebookresearch/dinov3 `dinov3/layers/rope_position_encoding.py`,
/// RopePositionEmbedding; timm `timm/layers/pos_embed_sincos.py`, RotaryEmbeddingDinoV3.
struct dinov3 {
    float base = 100.0f;                                      ///< period base (used unless min_period and max_period are given)
    float min_period = 0.0f;                                  ///< with max_period: the min/max period schedule (0 = none)
    float max_period = 0.0f;                                  ///< with min_period (0 = none)
    dinov3_normalize normalize = dinov3_normalize::separate;  ///< coordinate normalisation
    float shift_y = 0.0f, shift_x = 0.0f;                     ///< sampled shift per axis (DINOv3's shift_hw)
    float jitter_y = 1.0f, jitter_x = 1.0f;                   ///< sampled jitter multipliers per axis (jitter_hw)
    float rescale = 1.0f;                                     ///< sampled rescale multiplier (both axes)

    static constexpr int head_dim_multiple = 4;
    /// DINOv3's channel pairing (rope::default_layout_of): rotate-half.
    static constexpr layout default_layout = layout::half;

    /// @brief Period k of nq = D/4 (float32).
    RPE_HOST_DEVICE float period(int k, int head_dim) const {
        const int nq = head_dim / 4;
        if (min_period > 0.0f && max_period > 0.0f) {
            const float ratio = max_period / min_period;
            return min_period * detail::math::pow(ratio, cat::linspace(0.0f, 1.0f, nq, k));
        }
        const float e = (2.0f * static_cast<float>(k)) / static_cast<float>(head_dim / 2);
        return detail::math::pow(base, e);
    }
    /// @brief The normalised coordinate of index i along an axis of s tokens of a height × width
    /// grid, in (−1, 1), before the augmentations.
    RPE_HOST_DEVICE float grid_coordinate(int i, int s, int height, int width) const {
        const int n = normalize == dinov3_normalize::separate ? s
                      : normalize == dinov3_normalize::max    ? (height > width ? height : width)
                                                              : (height < width ? height : width);
        const float t = (static_cast<float>(i) + 0.5f) / static_cast<float>(n);
        return 2.0f * t - 1.0f;
    }
    /// @brief The augmentations applied to coordinate c of axis a (0 rows, 1 columns).
    RPE_HOST_DEVICE float augment(float c, int axis) const {
        c = c + (axis == 0 ? shift_y : shift_x);
        c = c * (axis == 0 ? jitter_y : jitter_x);
        return c * rescale;
    }
    /// @brief Angle (radians) of pair `pair` at the (augmented) coordinates (y, x).
    RPE_HOST_DEVICE float angle_of(float cy, float cx, int pair, int head_dim) const {
        const int nq = head_dim / 4;
        const int axis = pair / nq;
        const float two_pi = 6.28318530717958647692f;
        return (two_pi * (axis == 0 ? cy : cx)) / period(pair % nq, head_dim);
    }
    /// @brief Angle (radians) of pair `pair` at grid token (row, col) of a height × width grid.
    RPE_HOST_DEVICE float angle(int row, int col, int pair, int head_dim, int height, int width) const {
        return angle_of(augment(grid_coordinate(row, height, height, width), 0),
                        augment(grid_coordinate(col, width, height, width), 1), pair, head_dim);
    }
    /// @brief Angle at DINOv3 coordinates (y, x) given per token (already normalised; the
    /// augmentations apply).
    RPE_HOST_DEVICE float angle_at(float y, float x, int pair, int head_dim) const {
        return angle_of(augment(y, 0), augment(x, 1), pair, head_dim);
    }
    /// @throws rpe::invalid_argument `[rpe.rope] <field> = ...; expected ...`.
    void validate() const {
        const bool periods = min_period != 0.0f || max_period != 0.0f;
        if (periods)
            detail::require(detail::math::isfinite(min_period) && detail::math::isfinite(max_period) && min_period > 0.0f &&
                                max_period > 0.0f,
                            "rope", "min_period, max_period = ", min_period, ", ", max_period,
                            "; expected both finite and > 0 (or both 0 for base)");
        else
            detail::require(detail::math::isfinite(base) && base > 0.0f, "rope", "base = ", base, "; expected finite and > 0");
        detail::require(
            normalize == dinov3_normalize::separate || normalize == dinov3_normalize::max || normalize == dinov3_normalize::min,
            "rope", "normalize = ", static_cast<int>(normalize), "; expected separate, max or min");
        detail::require(detail::math::isfinite(shift_y) && detail::math::isfinite(shift_x), "rope", "shift = ", shift_y, ", ",
                        shift_x, "; expected finite");
        detail::require(
            detail::math::isfinite(jitter_y) && detail::math::isfinite(jitter_x) && jitter_y > 0.0f && jitter_x > 0.0f, "rope",
            "jitter = ", jitter_y, ", ", jitter_x, "; expected finite and > 0");
        detail::require(detail::math::isfinite(rescale) && rescale > 0.0f, "rope", "rescale = ", rescale,
                        "; expected finite and > 0");
    }
    friend bool operator==(const dinov3&, const dinov3&) = default;
};

}  // namespace rpe::rope

static_assert(rpe::RotaryPolicy<rpe::rope::dinov3>);
