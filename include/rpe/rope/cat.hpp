/// @file rope/cat.hpp
/// @brief rpe::rope::cat: timm's RotaryEmbeddingCat / apply_rot_embed_cat (EVA-02's 2D rotary
/// position embedding).
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"

namespace rpe::rope {

/// @brief timm's RotaryEmbeddingCat with apply_rot_embed_cat (half = false, the form EVA-02 uses):
/// channel pair p (channels 2p, 2p+1; the source's sin/cos are repeat-interleaved so both
/// channels of a pair share one angle, and `rot(x)` = [−x1, x0, −x3, x2, …]) of a head of D
/// channels at grid token (row, col) turns by `t_a · band_b` with `nb = D/4`, `a = p div nb`
/// (axis), `b = p mod nb`:
/// - axis 0 is the row coordinate and axis 1 the column one (`xy_indexing = false`, timm's
///   grid_indexing 'ij', EVA-02's); `xy_indexing = true` ('xy') swaps them;
/// - bands: `in_pixels = false` (EVA-02): `1 / temperature^(b / nb)`; `in_pixels = true` (the
///   class's default): `linspace(1, max_res/2, nb)·π` (`linear_bands`) or
///   `2^linspace(0, log2(max_res) − 1, nb)·π`;
/// - coordinates along an axis of s tokens: `in_pixels = false`: `i + grid_offset`;
///   `in_pixels = true`: `linspace(−1, 1, s)[i]`; then, when a reference shape is set
///   (`ref_height`, `ref_width` > 0; timm's ref_feat_shape, EVA-02's resize scheme),
///   `t / s · ref`.
/// All in float32 as the source (torch.linspace's two-sided formula included).
/// EVA-02 (timm eva.py, rope_type 'cat'): in_pixels = false, temperature 10000, grid_offset 0,
/// 'ij', ref_feat_shape (16, 16) (= the pretraining grid, 224/14) for the patch14 models.
/// Not covered: `half = true` (rotate_half layout, used by other timm models) and the
/// per-batch cached `get_batch_embeds`.
/// D must be a multiple of 4; validate() checks the parameters.
/// Source: timm `timm/layers/pos_embed_sincos.py`, RotaryEmbeddingCat, build_rotary_pos_embed,
/// build_fourier_pos_embed, pixel_freq_bands, freq_bands, apply_rot_embed_cat.
struct cat {
    float temperature = 10000.0f;  ///< band base when in_pixels = false
    bool in_pixels = false;        ///< pixel bands and [−1, 1] coordinates (timm's default: true; EVA-02: false)
    float max_res = 224.0f;        ///< in_pixels: highest resolution of the bands
    bool linear_bands = false;     ///< in_pixels: linearly spaced bands (else log-spaced)
    float grid_offset = 0.0f;      ///< in_pixels = false: added to the integer coordinates
    int ref_height = 0;            ///< reference grid rows (ref_feat_shape[0]); 0 = none (both or neither)
    int ref_width = 0;             ///< reference grid columns (ref_feat_shape[1]); 0 = none
    bool xy_indexing = false;      ///< grid_indexing 'xy' (columns on axis 0); false = 'ij'

    static constexpr int head_dim_multiple = 4;

    /// @brief torch.linspace(start, end, steps)[i] in float32 (two-sided: from start below
    /// steps/2, from end above).
    RPE_HOST_DEVICE static float linspace(float start, float end, int steps, int i) {
        if (steps == 1) return start;
        const float step = (end - start) / static_cast<float>(steps - 1);
        return i < steps / 2 ? start + step * static_cast<float>(i) : end - step * static_cast<float>(steps - i - 1);
    }
    /// @brief Band b of nb (float32).
    RPE_HOST_DEVICE float band(int b, int nb) const {
        if (!in_pixels) return 1.0f / detail::math::pow(temperature, static_cast<float>(b) / static_cast<float>(nb));
        const float pi = 3.14159265358979323846f;
        if (linear_bands) return linspace(1.0f, max_res / 2.0f, nb, b) * pi;
        const float top = static_cast<float>(detail::math::log(static_cast<double>(max_res)) / detail::math::log(2.0) - 1.0);
        return detail::math::pow(2.0f, linspace(0.0f, top, nb, b)) * pi;
    }
    /// @brief Coordinate of index i on an axis of s tokens with reference extent ref (0 = none).
    RPE_HOST_DEVICE float coordinate(int i, int s, int ref) const {
        float t = in_pixels ? linspace(-1.0f, 1.0f, s, i) : static_cast<float>(i) + grid_offset;
        if (ref > 0) t = t / static_cast<float>(s) * static_cast<float>(ref);
        return t;
    }
    /// @brief Angle (radians) of pair `pair` at (row, col) of a height × width grid.
    RPE_HOST_DEVICE float angle(int row, int col, int pair, int head_dim, int height, int width) const {
        const int nb = head_dim / 4;
        const bool first = pair < nb;
        const bool on_rows = xy_indexing ? !first : first;
        const float t = on_rows ? coordinate(row, height, ref_height) : coordinate(col, width, ref_width);
        return t * band(first ? pair : pair - nb, nb);
    }
    /// @brief Angle (radians) of pair `pair` at the coordinates (y, x) of a per-token position
    /// (rpe::rotary_embedding::positions), taken as the source's coordinates `t` themselves
    /// (after its linspace / offset / reference scaling): `t_axis · band`. With
    /// in_pixels = false, grid_offset 0 and no reference grid (the coordinates are the indices)
    /// it is angle(row, col, ...) at (row, col), bit for bit.
    RPE_HOST_DEVICE float angle_at(float y, float x, int pair, int head_dim) const {
        const int nb = head_dim / 4;
        const bool first = pair < nb;
        const bool on_rows = xy_indexing ? !first : first;
        return (on_rows ? y : x) * band(first ? pair : pair - nb, nb);
    }
    /// @throws rpe::invalid_argument `[rpe.rope] <field> = ...; expected ...`.
    void validate() const {
        detail::require(detail::math::isfinite(temperature) && temperature > 0.0f, "rope", "temperature = ", temperature,
                        "; expected finite and > 0");
        detail::require(detail::math::isfinite(max_res) && max_res > 0.0f, "rope", "max_res = ", max_res,
                        "; expected finite and > 0");
        detail::require(detail::math::isfinite(grid_offset), "rope", "grid_offset = ", grid_offset, "; expected finite");
        detail::require(ref_height >= 0 && ref_width >= 0 && (ref_height > 0) == (ref_width > 0), "rope",
                        "ref_height, ref_width = ", ref_height, ", ", ref_width, "; expected both > 0 or both 0");
    }
    friend bool operator==(const cat&, const cat&) = default;
};

}  // namespace rpe::rope

static_assert(rpe::RotaryPolicy<rpe::rope::cat>);
