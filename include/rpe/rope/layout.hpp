/// @file rope/layout.hpp
/// @brief rpe::rope::layout: which two channels of a head a rotary embedding turns together.
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace rpe::rope {

/// @brief The channel pairing of every rotary form (rpe::rotary_embedding::layout). A head of D
/// channels has D/2 pairs; pair j (whose angle is the form's angle of pair j) is the channels
/// (vjepa2, V-JEPA 2's own layout, is the exception: see it)
/// - `pairs`: (2j, 2j+1), rotated as the complex number x_2j + i·x_2j+1 (rope-vit's complex
///   product; timm's apply_rot_embed_cat with half = false; EVA-02);
/// - `half`: (j, j + D/2), "rotate-half" (`x·cos + rotate_half(x)·sin` with
///   `rotate_half(x) = [−x2, x1]`: DINOv3, Qwen2-VL, timm's half = true, GPT-NeoX style).
/// Either way `y_a = c·x_a − s·x_b`, `y_b = s·x_a + c·x_b` for the pair's channels (a, b).
enum class layout : unsigned char {
    pairs = 0,  ///< channels (2j, 2j+1)
    half = 1,   ///< channels (j, j + D/2)
    /// V-JEPA 2's own channel layout, only for rope::vjepa2 (its required_layout): three slices of
    /// s = 2·⌊D/6⌋ channels (frame, row, col), then D − 3s channels passed through; in slice a,
    /// channel l (l < s) takes table entry `a·s/2 + (l mod s/2)` and partners channel l xor 1:
    /// `y_l = cos·x_l − sin·x_l+1` (l even), `y_l = cos·x_l + sin·x_l−1` (l odd). The two channels
    /// of a partnership turn by different angles (entries l and l+1 mod s/2): not a rotation,
    /// kept by V-JEPA 2 for checkpoint compatibility (transformers' rotate_queries_or_keys).
    vjepa2 = 2,
};

/// @brief First channel of pair j among `pairs` = D/2 pairs.
RPE_HOST_DEVICE constexpr std::int64_t first_channel(layout l, std::int64_t j, std::int64_t /*pairs*/) {
    return l == layout::half ? j : 2 * j;
}
/// @brief Distance from the first to the second channel of a pair: 1 (pairs) or D/2 (half).
RPE_HOST_DEVICE constexpr std::int64_t pair_stride(layout l, std::int64_t pairs) { return l == layout::half ? pairs : 1; }

/// @brief The channel pairing of policy P's reference model: `P::default_layout` when P declares
/// it (rope::dinov3 and rope::mrope: `half`; rope::vjepa2: `vjepa2`), else `pairs` (rope-vit's axial and mixed, timm's cat
/// as EVA-02 uses it). The `rpe rope` tool's default --layout; rpe::rotary_embedding::layout itself
/// defaults to `pairs` whatever the form.
template <class P>
constexpr layout default_layout_of() {
    if constexpr (requires { P::default_layout; })
        return P::default_layout;
    else
        return layout::pairs;
}
/// @brief The same for the policy value `p` (e.g. in a visitor of rpe::visit_rope).
template <class P>
constexpr layout default_layout_of(const P& /*p*/) {
    return default_layout_of<P>();
}

/// @brief The layout that policy P runs in, whatever rpe::rotary_embedding::layout says it
/// should be: `P::required_layout` when P declares it (rope::vjepa2: layout::vjepa2), else −1
/// (any of pairs and half). A form with a required layout is refused in another one, and
/// layout::vjepa2 is refused for the forms without it (detail::check_rope).
template <class P>
constexpr int required_layout_of() {
    if constexpr (requires { P::required_layout; })
        return static_cast<int>(P::required_layout);
    else
        return -1;
}

/// @brief "pairs", "half" or "vjepa2" ("?" for a value outside the enumeration).
constexpr const char* layout_name(layout l) {
    return l == layout::pairs ? "pairs" : l == layout::half ? "half" : l == layout::vjepa2 ? "vjepa2" : "?";
}

}  // namespace rpe::rope
