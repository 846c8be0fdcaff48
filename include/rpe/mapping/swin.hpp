/// @file mapping/swin.hpp
/// @brief Swin Transformer's relative position index inside a (Wh, Ww) attention window, as a
/// Mapping: one bucket per 2D offset, (2Wh−1)(2Ww−1) buckets.
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/raise.hpp"

namespace rpe::mapping {

/// @brief Swin's relative position index: the offset (dr, dc) = (r_i − r_j, c_i − c_j) of query i
/// relative to key j inside one Wh × Ww window gets `id = (dr + Wh − 1)(2Ww − 1) + (dc + Ww − 1)`,
/// so `num_buckets() = (2Wh − 1)(2Ww − 1)` and every offset has its own bucket (no index function).
///
/// Use it on the window's grid (`height = Wh, width = Ww`, no skip tokens: Swin attends within a
/// window). A smaller grid reads a subset of the buckets; a grid taller or wider than the window
/// has offsets the index does not cover, and `validate_grid` (called by rpe::build_bucket_ids,
/// hence by every term and the cache) rejects it. `bucket` returns −1 for such an offset.
///
/// Tables: timm keeps `relative_position_bias_table` as (K, num_heads); an rpe bias term reads
/// (Ht, K) = its transpose (rpe::table_from_timm in <rpe/vit/swin_bias.hpp> converts). The bias of
/// Swin's attention is then `rpe::term<mapping::swin, mode::bias, target::key>` with per-head
/// tables (`shared_head = false`): `logits[b,h,i,j] += table[h, id(i,j)]`.
///
/// Valid parameters (checked by `validate()` on the host): `1 ≤ window_h, window_w ≤ 8192`.
/// Source: Liu et al., "Swin Transformer" (ICCV 2021), §3.2 "Relative position bias";
/// timm `get_relative_position_index` (huggingface/pytorch-image-models
/// `timm/models/swin_transformer.py`, and `gen_relative_position_index` in
/// `timm/layers/pos_embed_rel.py`): equal to both on 7×7, 3×5 and 4×2 windows (tests/data/golden_vit/swin).
struct swin {
    int window_h = 7;  ///< Wh: window rows
    int window_w = 7;  ///< Ww: window columns

    /// @brief `(2Wh − 1)(2Ww − 1)`.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t rows = 2 * static_cast<std::int64_t>(window_h) - 1, cols = 2 * static_cast<std::int64_t>(window_w) - 1;
        return detail::mapping_bucket_count(*this, "mapping.swin", "(2*window_h-1)(2*window_w-1)", rows, cols);
    }

    /// @brief Id of the offset (dr, dc), in [0, num_buckets()); −1 when |dr| ≥ Wh or |dc| ≥ Ww
    /// (outside the window: never reached through a validated grid).
    RPE_HOST_DEVICE constexpr int bucket(int dr, int dc) const {
        const int r = dr + window_h - 1, c = dc + window_w - 1;
        if (r < 0 || r > 2 * window_h - 2 || c < 0 || c > 2 * window_w - 2) return -1;
        return r * (2 * window_w - 1) + c;
    }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.swin] window_h = ...; expected [1, 8192]`
    /// (likewise window_w).
    void validate() const {
        detail::require(window_h >= 1 && window_h <= 8192, "mapping.swin", "window_h = ", window_h, "; expected [1, 8192]");
        detail::require(window_w >= 1 && window_w <= 8192, "mapping.swin", "window_w = ", window_w, "; expected [1, 8192]");
    }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.swin] grid = 8x7 is larger than the window
    /// 7x7; ...` when `height > window_h` or `width > window_w` (offsets beyond the index).
    void validate_grid(int height, int width) const {
        detail::require(height <= window_h && width <= window_w, "mapping.swin", "grid = ", height, "x", width,
                        " is larger than the window ", window_h, "x", window_w,
                        "; expected height <= window_h and width <= window_w (Swin's index covers offsets "
                        "within one window: partition the tokens into windows first)");
    }

    friend constexpr bool operator==(const swin&, const swin&) = default;
};

static_assert(Mapping<swin>);
static_assert(swin{.window_h = 2, .window_w = 3}.num_buckets() == 15 && swin{.window_h = 2, .window_w = 3}.bucket(-1, -2) == 0 &&
              swin{.window_h = 2, .window_w = 3}.bucket(1, 2) == 14 && swin{.window_h = 2, .window_w = 3}.bucket(2, 0) == -1);

}  // namespace rpe::mapping
