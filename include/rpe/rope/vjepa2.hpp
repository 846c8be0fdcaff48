/// @file rope/vjepa2.hpp
/// @brief rpe::rope::vjepa2: V-JEPA 2's 3D rotary position embedding over (frame, row, col), a
/// fixed-frequency policy with three position axes and its own channel layout
/// (rope::layout::vjepa2), used as `rope::custom{rope::vjepa2{...}}`.
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"
#include "layout.hpp"

namespace rpe::rope {

/// @brief V-JEPA 2's RoPE (Assran et al., 2025). A head of D channels is cut into three slices of
/// `s = 2·⌊⌊D/3⌋/2⌋` channels (frame, row, col; D = 64: 20, D = 80: 26, D = 96: 32) followed by
/// `D − 3s` channels passed through unrotated. Slice a has `m = s/2` frequencies
/// `ω_k = 1 / θ^(k/m)` (float32: `k/m` rounded, the power, the reciprocal; θ = 10000 in the
/// source) and turns by `pos_a · ω_k`, pos = (frame, row, col) of the token. Channels follow
/// rope::layout::vjepa2 (required: the source's `x·cos + rot(x)·sin` with rot pairing adjacent
/// channels but cos, sin of the m angles tiled twice over the slice, so channel l of a slice
/// takes angle `l mod m`).
/// The table holds D/2 entries per token: entry `a·m + k` (k < m) is `pos_a · ω_k`; entries from
/// 3m on (the passed-through channels) are 0.
/// Positions: rotary_embedding::positions (N, 3) (frame, row, col), integer or real (the source's
/// ids: token i of a T×H×W clip at (i div HW, (i mod HW) div W, i mod W), or those of the kept
/// tokens of a mask; rope::grid_positions makes them). On the 2D grid (no positions) a token at
/// (row, col) has the ids (0, row, col): one frame.
/// Source: huggingface/transformers `models/vjepa2/modeling_vjepa2.py` (rotate_queries_or_keys,
/// VJEPA2RopeAttention.get_position_ids and apply_rotary_embeddings); facebookresearch/vjepa2
/// `src/models/utils/modules.py` (RoPEAttention, rotate_queries_or_keys).
struct vjepa2 {
    float theta = 10000.0f;  ///< frequency base (the source's fixed 10000)

    static constexpr int head_dim_multiple = 2;
    /// V-JEPA 2's channel layout (rope::default_layout_of), the only one it runs in.
    static constexpr layout default_layout = layout::vjepa2;
    /// The form runs in layout::vjepa2 only (rope::required_layout_of).
    static constexpr layout required_layout = layout::vjepa2;
    /// Three position axes (frame, row, col): rotary_embedding::positions is (N, 3).
    static constexpr int position_axes = 3;

    /// @brief Channels per axis slice for head dim D: `2·⌊⌊D/3⌋/2⌋` (the source's d_dim = h_dim = w_dim).
    RPE_HOST_DEVICE static constexpr int slice(int head_dim) { return 2 * ((head_dim / 3) / 2); }
    /// @brief Frequency k of a slice of m = s/2 frequencies (float32, as the source).
    RPE_HOST_DEVICE float omega(int k, int m) const {
        const float e = static_cast<float>(k) / static_cast<float>(m);
        return 1.0f / detail::math::pow(theta, e);
    }
    /// @brief Angle (radians, float32) of table entry `pair` (< D/2) at the ids (frame, row, col):
    /// `pos_a · ω_k` for entry a·m + k, 0 for the passed-through entries.
    RPE_HOST_DEVICE float angle_at(float frame, float row, float col, int pair, int head_dim) const {
        const int m = slice(head_dim) / 2;
        if (m == 0 || pair >= 3 * m) return 0.0f;
        const int a = pair / m;
        return (a == 0 ? frame : a == 1 ? row : col) * omega(pair % m, m);
    }
    /// @brief Angle of table entry `pair` at grid token (row, col): the ids (0, row, col).
    RPE_HOST_DEVICE float angle(int row, int col, int pair, int head_dim, int /*height*/, int /*width*/) const {
        return angle_at(0.0f, static_cast<float>(row), static_cast<float>(col), pair, head_dim);
    }
    /// @throws rpe::invalid_argument `[rpe.rope] theta = ...; expected finite and > 0`.
    void validate() const {
        detail::require(detail::math::isfinite(theta) && theta > 0.0f, "rope", "theta = ", theta, "; expected finite and > 0");
    }
    /// @brief The head against the form: D >= 6 (slices of at least 2 channels).
    /// @throws rpe::invalid_argument `[rpe.rope] vjepa2 head_dim D = 4 gives slices of 0 channels; expected D >= 6 ...`.
    void check_head_dim(int head_dim) const {
        detail::require(slice(head_dim) >= 2, "rope", "vjepa2 head_dim D = ", head_dim, " gives slices of ", slice(head_dim),
                        " channels (2*((D/3)/2)); expected D >= 6 (three slices of at least one pair)");
    }
    friend bool operator==(const vjepa2&, const vjepa2&) = default;
};

}  // namespace rpe::rope

static_assert(rpe::RotaryPolicy<rpe::rope::vjepa2>);
