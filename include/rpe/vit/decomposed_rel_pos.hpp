/// @file vit/decomposed_rel_pos.hpp
/// @brief Decomposed relative position (MViTv2, SAM's image encoder): `q·R_h[Δrow] + q·R_w[Δcol]`
/// as rpe's contextual Cross term with a clip index, SAM's two tables loaded into it, and
/// `get_rel_pos`'s linear resize of a table with its backward.
///
/// Mapping of SAM onto rpe (height H, width W, m = max(H, W), β = m − 1): SAM picks row
/// `Δ + (H−1)` of `rel_pos_h` (2H−1, C) and row `Δ + (W−1)` of `rel_pos_w` (2W−1, C) for the offset
/// Δ = query − key along each axis. rpe's `mapping::cross<index::clip>` with β = m − 1 gives
/// id `Δ + β` in each of its two tables of K = 2m − 1 buckets, so SAM's row r of `rel_pos_h` goes to
/// bucket `r + (m − H)` of the rows table (likewise for W); the other buckets are never used on an
/// H × W grid and are zero. The term is the contextual term on keys (target::key): with the fused
/// attention it adds `(q·s)·T[:, id]` to the logits, where `s = D^−½` (rpe's convention, the
/// reference iRPE's). SAM adds `q·R` with the *unscaled* q, so the loader stores `T = R / s`
/// (option `unscaled_query`, the default): the logits then equal SAM's to float rounding.
///
/// Limits: query and key grids of one size only (rpe's attention has one token grid). MViTv2's
/// pooled attention (q_size ≠ k_size, scaled coordinates in `get_rel_pos`) is not supported:
/// a term covers one H × W grid for both. The mapping is bounded to the grid it was built for
/// (mapping::within_grid): a taller or wider grid, where the clip index would merge the far
/// offsets, is rejected with `[rpe.mapping.within_grid] grid = ... is larger than the HxW grid the
/// term was built for` by the bucket ids, the cache and the attention; a smaller grid reads a subset
/// of the buckets (unused rows of SAM's tables then stay unread).
/// Source: facebookresearch/segment-anything `segment_anything/modeling/image_encoder.py`
/// (`get_rel_pos`, `add_decomposed_rel_pos`, `Attention`); Li et al., MViTv2 (CVPR 2022).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/term_checks.hpp"
#include "../error.hpp"
#include "../index/clip.hpp"
#include "../mapping/cross.hpp"
#include "../mapping/within_grid.hpp"
#include "../mode.hpp"
#include "../tensor.hpp"
#include "../term.hpp"

namespace rpe::vit {

/// @brief The mapping type of a decomposed relative position: Cross with a clip index, bounded to
/// the grid it was built for.
using decomposed_rel_pos_mapping_type = mapping::within_grid<mapping::cross<index::clip>>;
static_assert(Mapping<decomposed_rel_pos_mapping_type> && decomposed_rel_pos_mapping_type::num_tables == 2);

/// @brief The mapping of a decomposed relative position on an H × W grid:
/// `mapping::cross<index::clip>{clip{β = max(H, W) − 1}}` (ids Δrow + β and Δcol + β; no offset of
/// the grid is clipped) in `mapping::within_grid{.height = H, .width = W}`, which rejects a taller
/// or wider grid.
/// @throws rpe::invalid_argument `[rpe.vit.decomposed] height = ...` for a side < 1 or > 2^29.
inline decomposed_rel_pos_mapping_type decomposed_rel_pos_mapping(int height, int width) {
    rpe::detail::require(height >= 1 && height <= (1 << 29), "vit.decomposed", "height = ", height,
                         "; expected 1 <= height <= 2^29");
    rpe::detail::require(width >= 1 && width <= (1 << 29), "vit.decomposed", "width = ", width, "; expected 1 <= width <= 2^29");
    return {.inner = mapping::cross<index::clip>{index::clip{static_cast<double>((height > width ? height : width) - 1)}},
            .height = height,
            .width = width};
}

/// @brief The term type of a decomposed relative position: contextual Cross (clip index, bounded
/// to its grid) on keys.
template <class S = float>
using decomposed_rel_pos_term = term<decomposed_rel_pos_mapping_type, mode::contextual, target::key, S>;

/// @brief Configuration of a decomposed relative position (SAM `Attention(use_rel_pos=True)`).
struct decomposed_rel_pos_config {
    int height = 0;              ///< grid rows H (SAM `input_size[0]`, or the window size)
    int width = 0;               ///< grid columns W
    int num_heads = 0;           ///< heads; SAM shares its two tables across heads (Ht = 1)
    int head_dim = 0;            ///< D = C, the tables' channel count
    int skip = 0;                ///< tokens before the grid (SAM: none); they get the zero extra bucket
    bool unscaled_query = true;  ///< SAM adds q·R with the unscaled q: store R·D^½ (see the file comment)
};

/// @brief The term of `c`: `decomposed_rel_pos_term<S>(decomposed_rel_pos_mapping(H, W),
/// {.num_heads, .head_dim, .shared_head = true, .skip})`. Its two tables have shape
/// (1, D, K), K = 2·max(H, W) − 1 (+1 with skip).
/// @throws rpe::invalid_argument `[rpe.vit.decomposed] ...` for a bad grid, `[rpe.term] ...` for
///   bad heads, head_dim or skip.
template <class S = float>
decomposed_rel_pos_term<S> make_decomposed_rel_pos_term(const decomposed_rel_pos_config& c) {
    return decomposed_rel_pos_term<S>(
        decomposed_rel_pos_mapping(c.height, c.width),
        term_config{.num_heads = c.num_heads, .head_dim = c.head_dim, .shared_head = true, .skip = c.skip});
}

namespace detail_decomposed {

/// Source position and weights of output row `o` of the linear resize (in → out rows): PyTorch's
/// `F.interpolate(mode="linear", align_corners=False)` without scale_factor, in S arithmetic:
/// `x = max(0, (in/out)·(o + ½) − ½)`, `i0 = min(⌊x⌋, in−1)`, `λ = clamp(x − i0, 0, 1)`,
/// `i1 = i0 + (i0 < in−1)`, row = (1−λ)·in[i0] + λ·in[i1].
template <class S>
struct resize_tap {
    std::int64_t i0, i1;
    S w0, w1;
};
template <class S>
resize_tap<S> resize_tap_of(std::int64_t o, std::int64_t in, std::int64_t out) {
    const S scale = static_cast<S>(in) / static_cast<S>(out);
    S x = scale * (static_cast<S>(o) + static_cast<S>(0.5)) - static_cast<S>(0.5);
    if (x < 0) x = 0;
    std::int64_t i0 = static_cast<std::int64_t>(std::floor(x));
    if (i0 > in - 1) i0 = in - 1;
    S lambda = x - static_cast<S>(i0);
    lambda = lambda < 0 ? S(0) : (lambda > 1 ? S(1) : lambda);
    return {i0, i0 + (i0 < in - 1 ? 1 : 0), static_cast<S>(1) - lambda, lambda};
}

template <class T>
void check_rel_pos_table(const tensor_ref<T>& t, const char* name) {
    rpe::detail::require(t.rank == 2 && t.extent(0) >= 1 && t.extent(1) >= 1, "vit.decomposed", name, " has shape ",
                         t.shape_string(), "; expected (length, C) with length, C >= 1");
    rpe::detail::check_nonnull(t, "vit.decomposed", name);
}

}  // namespace detail_decomposed

/// @brief SAM `get_rel_pos`'s resize: `out` (Lout, C) = the linear interpolation of `rel_pos`
/// (Lin, C) along its rows (PyTorch `F.interpolate(..., mode="linear")`, align_corners=False;
/// SAM resizes to Lout = 2·max(q, k) − 1 when Lin differs). Lin == Lout copies.
/// @throws rpe::invalid_argument `[rpe.vit.decomposed] ...` for ranks, a channel count that
///   differs, a null or overlapping buffer (checked before anything is written).
/// Complexity O(Lout·C). Source: `get_rel_pos` in segment-anything `image_encoder.py`.
template <class S>
void resize_rel_pos(tensor_ref<const S> rel_pos, tensor_ref<S> out) {
    detail_decomposed::check_rel_pos_table(rel_pos, "rel_pos");
    detail_decomposed::check_rel_pos_table(out, "out");
    rpe::detail::require(out.extent(1) == rel_pos.extent(1), "vit.decomposed", "out has shape ", out.shape_string(),
                         "; expected C = ", rel_pos.extent(1), " columns as rel_pos");
    rpe::detail::check_no_overlap(out, rel_pos, "vit.decomposed", "out", "rel_pos");
    const std::int64_t in = rel_pos.extent(0), n = out.extent(0), c = rel_pos.extent(1);
    for (std::int64_t o = 0; o < n; ++o) {
        const auto t = detail_decomposed::resize_tap_of<S>(o, in, n);
        for (std::int64_t ch = 0; ch < c; ++ch)
            out.data[o * c + ch] = t.w0 * rel_pos.data[t.i0 * c + ch] + t.w1 * rel_pos.data[t.i1 * c + ch];
    }
}

/// @brief Backward of resize_rel_pos for `sum(out · grad_out)`: `grad_rel_pos` (Lin, C) gets each
/// output row's gradient spread over its two source rows with the interpolation weights;
/// `mode` (required): write::overwrite replaces grad_rel_pos, write::accumulate adds to it.
/// @throws as resize_rel_pos (grad_out in place of rel_pos, grad_rel_pos in place of out).
template <class S>
void resize_rel_pos_backward(tensor_ref<const S> grad_out, tensor_ref<S> grad_rel_pos, write mode) {
    detail_decomposed::check_rel_pos_table(grad_out, "grad_out");
    detail_decomposed::check_rel_pos_table(grad_rel_pos, "grad_rel_pos");
    rpe::detail::require(grad_rel_pos.extent(1) == grad_out.extent(1), "vit.decomposed", "grad_rel_pos has shape ",
                         grad_rel_pos.shape_string(), "; expected C = ", grad_out.extent(1), " columns as grad_out");
    rpe::detail::check_no_overlap(grad_rel_pos, grad_out, "vit.decomposed", "grad_rel_pos", "grad_out");
    rpe::detail::check_write_mode(mode);
    const std::int64_t in = grad_rel_pos.extent(0), n = grad_out.extent(0), c = grad_out.extent(1);
    if (mode == write::overwrite) std::fill(grad_rel_pos.data, grad_rel_pos.data + in * c, S(0));
    for (std::int64_t o = 0; o < n; ++o) {
        const auto t = detail_decomposed::resize_tap_of<S>(o, in, n);
        for (std::int64_t ch = 0; ch < c; ++ch) {
            grad_rel_pos.data[t.i0 * c + ch] += t.w0 * grad_out.data[o * c + ch];
            grad_rel_pos.data[t.i1 * c + ch] += t.w1 * grad_out.data[o * c + ch];
        }
    }
}

namespace detail_decomposed {

// Shared checks of the loader and its backward; returns K.
template <class A, class B, class T>
std::int64_t check_decomposed_load(const decomposed_rel_pos_config& c, const tensor_ref<A>& h, const tensor_ref<B>& w,
                                   const std::array<tensor_ref<T>, 2>& tables, const char* h_name, const char* w_name,
                                   const char* tables_name) {
    const auto m = decomposed_rel_pos_mapping(c.height, c.width);  // checks the grid
    rpe::detail::require(c.head_dim >= 1, "vit.decomposed", "head_dim = ", c.head_dim, "; expected >= 1");
    rpe::detail::require(c.skip >= 0, "vit.decomposed", "skip = ", c.skip, "; expected >= 0");
    check_rel_pos_table(h, h_name);
    check_rel_pos_table(w, w_name);
    rpe::detail::require(h.extent(1) == c.head_dim, "vit.decomposed", h_name, " has shape ", h.shape_string(),
                         "; expected C = head_dim = ", c.head_dim, " columns");
    rpe::detail::require(w.extent(1) == c.head_dim, "vit.decomposed", w_name, " has shape ", w.shape_string(),
                         "; expected C = head_dim = ", c.head_dim, " columns");
    const std::int64_t k = m.num_buckets() + (c.skip > 0 ? 1 : 0);
    for (int t = 0; t < 2; ++t) {
        const std::string name = std::string(tables_name) + "[" + std::to_string(t) + "]";
        rpe::detail::check_shape(tables[static_cast<std::size_t>(t)], {1, c.head_dim, k}, "vit.decomposed", name);
        rpe::detail::check_nonnull(tables[static_cast<std::size_t>(t)], "vit.decomposed", name);
        rpe::detail::check_no_overlap(tables[static_cast<std::size_t>(t)], h, "vit.decomposed", name, h_name);
        rpe::detail::check_no_overlap(tables[static_cast<std::size_t>(t)], w, "vit.decomposed", name, w_name);
    }
    rpe::detail::check_no_overlap(tables[0], tables[1], "vit.decomposed", std::string(tables_name) + "[0]",
                                  std::string(tables_name) + "[1]");
    return k;
}

template <class S>
S decomposed_table_factor(const decomposed_rel_pos_config& c) {
    // the attention's s = D^-1/2, as it rounds it; tables hold R / s
    const S s = static_cast<S>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    return c.unscaled_query ? static_cast<S>(1) / s : static_cast<S>(1);
}

}  // namespace detail_decomposed

/// @brief Loads SAM's `rel_pos_h` (Lh, C) and `rel_pos_w` (Lw, C) into the term's two tables
/// `tables[0]` (rows) and `tables[1]` (cols), each (1, D, K) with C = D, K = 2·max(H, W) − 1
/// (+1 with skip). A table whose length is not 2H − 1 (2W − 1) is first resized as SAM's
/// `get_rel_pos` does (resize_rel_pos). Then, with m = max(H, W):
/// `tables[0][0, d, r + m − H] = f·R_h[r, d]` for r < 2H − 1, `f = D^½` when `c.unscaled_query`
/// (SAM), else 1; every other entry (unused buckets, the skip bucket) is 0.
/// @throws rpe::invalid_argument `[rpe.vit.decomposed] ...` for a bad grid, head_dim, skip, a
///   table shape, a null or overlapping buffer (all checks run before anything is written).
template <class S>
void load_decomposed_rel_pos(const decomposed_rel_pos_config& c, tensor_ref<const S> rel_pos_h, tensor_ref<const S> rel_pos_w,
                             const std::array<tensor_ref<S>, 2>& tables) {
    const std::int64_t k =
        detail_decomposed::check_decomposed_load(c, rel_pos_h, rel_pos_w, tables, "rel_pos_h", "rel_pos_w", "tables");
    const std::int64_t m = c.height > c.width ? c.height : c.width, d = c.head_dim;
    const S f = detail_decomposed::decomposed_table_factor<S>(c);
    const int sides[2] = {c.height, c.width};
    const tensor_ref<const S> src[2] = {rel_pos_h, rel_pos_w};
    for (int t = 0; t < 2; ++t) {
        const std::int64_t len = 2 * static_cast<std::int64_t>(sides[t]) - 1;
        std::vector<S> resized;
        const S* r = src[t].data;
        if (src[t].extent(0) != len) {
            resized.resize(static_cast<std::size_t>(len * d));
            resize_rel_pos<S>(src[t], tensor_ref<S>(resized.data(), {len, d}));
            r = resized.data();
        }
        S* dst = tables[static_cast<std::size_t>(t)].data;  // (1, D, K)
        std::fill(dst, dst + d * k, S(0));
        const std::int64_t shift = m - sides[t];
        for (std::int64_t row = 0; row < len; ++row)
            for (std::int64_t ch = 0; ch < d; ++ch) dst[ch * k + row + shift] = f * r[row * d + ch];
    }
}

/// @brief Backward of load_decomposed_rel_pos: from the gradients of the two term tables
/// `grad_tables` (each (1, D, K), e.g. the fused attention's `grad_tables`) to the gradients of
/// SAM's `rel_pos_h` (Lh, C) and `rel_pos_w` (Lw, C), through the resize when Lh ≠ 2H − 1
/// (Lw ≠ 2W − 1). Unused buckets' gradients are dropped (they are zero from the attention).
/// @throws as load_decomposed_rel_pos.
template <class S>
void load_decomposed_rel_pos_backward(const decomposed_rel_pos_config& c, const std::array<tensor_ref<const S>, 2>& grad_tables,
                                      tensor_ref<S> grad_rel_pos_h, tensor_ref<S> grad_rel_pos_w) {
    const std::int64_t k = detail_decomposed::check_decomposed_load(c, grad_rel_pos_h, grad_rel_pos_w, grad_tables,
                                                                    "grad_rel_pos_h", "grad_rel_pos_w", "grad_tables");
    rpe::detail::check_no_overlap(grad_rel_pos_h, grad_rel_pos_w, "vit.decomposed", "grad_rel_pos_h", "grad_rel_pos_w");
    const std::int64_t m = c.height > c.width ? c.height : c.width, d = c.head_dim;
    const S f = detail_decomposed::decomposed_table_factor<S>(c);
    const int sides[2] = {c.height, c.width};
    const tensor_ref<S> dst[2] = {grad_rel_pos_h, grad_rel_pos_w};
    for (int t = 0; t < 2; ++t) {
        const std::int64_t len = 2 * static_cast<std::int64_t>(sides[t]) - 1;
        const bool resized = dst[t].extent(0) != len;
        std::vector<S> tmp(resized ? static_cast<std::size_t>(len * d) : 0);
        S* g = resized ? tmp.data() : dst[t].data;  // (len, D)
        const S* src = grad_tables[static_cast<std::size_t>(t)].data;
        const std::int64_t shift = m - sides[t];
        for (std::int64_t row = 0; row < len; ++row)
            for (std::int64_t ch = 0; ch < d; ++ch) g[row * d + ch] = f * src[ch * k + row + shift];
        if (resized) resize_rel_pos_backward<S>(tensor_ref<const S>(tmp.data(), {len, d}), dst[t], write::overwrite);
    }
}

}  // namespace rpe::vit
