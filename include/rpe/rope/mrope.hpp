/// @file rope/mrope.hpp
/// @brief rpe::rope::mrope: the multimodal rotary position embedding (M-RoPE) of the Qwen-VL
/// language models (Qwen2-VL, Qwen2.5-VL sections; Qwen3-VL interleaved), a fixed-frequency policy
/// with three position axes (t, h, w), used as `rope::custom{rope::mrope{...}}` with the
/// rotate-half layout and per-token positions (N, 3).
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"
#include "layout.hpp"

namespace rpe::rope {

/// @brief Qwen-VL's M-RoPE (Wang et al., 2024, Qwen2-VL; Qwen3-VL's interleaved variant). A head
/// of D channels has D/2 pairs; pair j turns by `pos_a · inv_freq_j` where
/// - `inv_freq_j = 1 / θ^(2j / D)` (float32: the exponent `(2j) / D` rounded, then the power, then
///   the reciprocal, as `1.0 / (base ** (arange(0, D, 2).float() / D))`);
/// - `pos = (t, h, w)` are the token's three position ids (the source's `position_ids`, as its
///   `get_rope_index` gives them: text tokens (n, n, n), vision tokens (t, h, w) offset by the
///   text before them), passed per token as rotary_embedding::positions (N, 3);
/// - the axis a of pair j: sections (`interleaved` false; Qwen2-VL, Qwen2.5-VL): the pairs are
///   split into consecutive chunks of `section_t`, `section_h`, `section_w` pairs (axes t, h, w);
///   interleaved (Qwen3-VL): a = h when `j mod 3 = 1` and `j < 3·section_h`, a = w when
///   `j mod 3 = 2` and `j < 3·section_w`, else t (section_t is then only part of the sum).
/// The sections are numbers of frequency pairs (the source's `mrope_section`) and must sum to D/2
/// (check_head_dim). Channels pair j with j + D/2 (rope::layout::half: `x·cos + rotate_half(x)·sin`).
/// On the grid (no positions) a token at (row, col) has the ids (0, row, col): an image alone,
/// as `get_rope_index` numbers an image at the start of a sequence.
/// Source: huggingface/transformers `models/qwen2_vl/modeling_qwen2_vl.py` (Qwen2VLRotaryEmbedding:
/// compute_default_rope_parameters, forward, recomposition_frequencies; apply_rotary_pos_emb),
/// `models/qwen2_5_vl` (the same), `models/qwen3_vl/modeling_qwen3_vl.py`
/// (Qwen3VLTextRotaryEmbedding.recomposition_frequencies, the interleaved layout).
struct mrope {
    float theta = 1000000.0f;  ///< rope_theta (Qwen2-VL and Qwen2.5-VL: 1e6; Qwen3-VL checkpoints: 5e6)
    int section_t = 16;        ///< frequency pairs on the temporal ids (mrope_section[0])
    int section_h = 24;        ///< frequency pairs on the height ids (mrope_section[1])
    int section_w = 24;        ///< frequency pairs on the width ids (mrope_section[2])
    bool interleaved = false;  ///< Qwen3-VL's interleaved layout instead of consecutive sections

    static constexpr int head_dim_multiple = 2;
    /// Qwen-VL's channel pairing (rope::default_layout_of): rotate-half.
    static constexpr layout default_layout = layout::half;
    /// Three position axes (t, h, w): rotary_embedding::positions is (N, 3).
    static constexpr int position_axes = 3;

    /// @brief The source's inverse frequency of pair j (float32).
    RPE_HOST_DEVICE float inv_freq(int pair, int head_dim) const {
        const float e = static_cast<float>(2 * pair) / static_cast<float>(head_dim);
        return 1.0f / detail::math::pow(theta, e);
    }
    /// @brief The axis of pair j: 0 (t), 1 (h) or 2 (w).
    RPE_HOST_DEVICE int axis(int pair) const {
        if (interleaved) {
            if (pair % 3 == 1 && pair < 3 * section_h) return 1;
            if (pair % 3 == 2 && pair < 3 * section_w) return 2;
            return 0;
        }
        return pair < section_t ? 0 : pair < section_t + section_h ? 1 : 2;
    }
    /// @brief Angle (radians, float32) of pair `pair` at the position ids (t, h, w).
    RPE_HOST_DEVICE float angle_at(float t, float h, float w, int pair, int head_dim) const {
        const int a = axis(pair);
        return (a == 0 ? t : a == 1 ? h : w) * inv_freq(pair, head_dim);
    }
    /// @brief Angle of pair `pair` at grid token (row, col): the ids (0, row, col).
    RPE_HOST_DEVICE float angle(int row, int col, int pair, int head_dim, int /*height*/, int /*width*/) const {
        return angle_at(0.0f, static_cast<float>(row), static_cast<float>(col), pair, head_dim);
    }
    /// @throws rpe::invalid_argument `[rpe.rope] theta = ...` or `[rpe.rope] mrope sections = ...`.
    void validate() const {
        detail::require(detail::math::isfinite(theta) && theta > 0.0f, "rope", "theta = ", theta, "; expected finite and > 0");
        detail::require(section_t >= 0 && section_h >= 0 && section_w >= 0 && section_t + section_h + section_w >= 1, "rope",
                        "mrope sections = ", section_t, ",", section_h, ",", section_w,
                        "; expected counts of frequency pairs >= 0 with a positive sum");
    }
    /// @brief The sections against the head: their sum is D/2.
    /// @throws rpe::invalid_argument `[rpe.rope] mrope sections = t,h,w sum to S; expected D/2 = ...`.
    void check_head_dim(int head_dim) const {
        const long long sum = static_cast<long long>(section_t) + section_h + section_w;
        detail::require(2 * sum == head_dim, "rope", "mrope sections = ", section_t, ",", section_h, ",", section_w, " sum to ",
                        sum, " frequency pairs; expected D/2 = ", head_dim / 2, " (head_dim D = ", head_dim, ")");
    }
    friend bool operator==(const mrope&, const mrope&) = default;
};

}  // namespace rpe::rope

static_assert(rpe::RotaryPolicy<rpe::rope::mrope>);
