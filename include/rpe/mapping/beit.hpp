/// @file mapping/beit.hpp
/// @brief BEiT's relative position index: Swin's window index plus three class-token buckets
/// (class → token, token → class, class → class), as a Mapping with `skip_buckets = 3`.
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/raise.hpp"
#include "swin.hpp"

namespace rpe::mapping {

/// @brief BEiT's relative position index on a Wh × Ww patch grid after the class token: grid pairs
/// as mapping::swin, `id = (dr + Wh − 1)(2Ww − 1) + (dc + Ww − 1)`; with `skip = 1` (the class
/// token) the table has `K = (2Wh − 1)(2Ww − 1) + 3` buckets and
/// - `K − 3` when the query is the class token and the key a patch (class → token, timm's row 0),
/// - `K − 2` when the query is a patch and the key the class token (token → class, column 0),
/// - `K − 1` for class → class (entry (0, 0)).
///
/// `num_buckets()` counts the grid buckets only; `skip_buckets = 3` makes rpe::build_bucket_ids,
/// the terms and the cache add the three (K = num_buckets() + 3 with skip > 0, + 0 without). With
/// more than one skip token, a pair of two skip tokens gets K − 1 and the rule above holds per token.
/// Tables: timm's `relative_position_bias_table` is (K, num_heads); rpe's bias term reads its
/// transpose (Ht, K) (rpe::table_from_timm in <rpe/vit/swin_bias.hpp>). BEiT's attention bias is
/// `rpe::term<mapping::beit, mode::bias, target::key>` with `skip = 1`, `shared_head = false`
/// (per layer) or one shared table (BEiT's `use_shared_rel_pos_bias`: the same (H, K) table in
/// every layer). Validation: as mapping::swin (window and grid).
/// Source: Bao et al., "BEiT: BERT Pre-Training of Image Transformers" (ICLR 2022), §2.2 / App.;
/// timm `gen_relative_position_index` in huggingface/pytorch-image-models `timm/models/beit.py`
/// (equal on 3×4 and 2×2 windows, tests/data/golden_vit/beit).
struct beit {
    int window_h = 14;  ///< Wh: patch rows (BEiT-B/16 at 224: 14)
    int window_w = 14;  ///< Ww: patch columns

    static constexpr int skip_buckets = 3;  ///< class → token, token → class, class → class

    /// @brief The Swin window index these ids use on the grid.
    RPE_HOST_DEVICE constexpr swin window() const { return swin{window_h, window_w}; }
    /// @brief `(2Wh − 1)(2Ww − 1)`: the grid buckets, before the three class-token buckets.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t rows = 2 * static_cast<std::int64_t>(window_h) - 1, cols = 2 * static_cast<std::int64_t>(window_w) - 1;
        return detail::mapping_bucket_count(*this, "mapping.beit", "(2*window_h-1)(2*window_w-1)", rows, cols);
    }
    /// @brief Id of the grid offset (dr, dc), as mapping::swin (−1 outside the window).
    RPE_HOST_DEVICE constexpr int bucket(int dr, int dc) const { return window().bucket(dr, dc); }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.beit] window_h = ...; expected [1, 8192]`
    /// (likewise window_w).
    void validate() const {
        detail::require(window_h >= 1 && window_h <= 8192, "mapping.beit", "window_h = ", window_h, "; expected [1, 8192]");
        detail::require(window_w >= 1 && window_w <= 8192, "mapping.beit", "window_w = ", window_w, "; expected [1, 8192]");
    }
    /// @brief Throws rpe::invalid_argument `[rpe.mapping.beit] grid = ... is larger than the window ...`.
    void validate_grid(int height, int width) const {
        detail::require(height <= window_h && width <= window_w, "mapping.beit", "grid = ", height, "x", width,
                        " is larger than the window ", window_h, "x", window_w,
                        "; expected height <= window_h and width <= window_w (BEiT's index covers offsets within its window)");
    }

    friend constexpr bool operator==(const beit&, const beit&) = default;
};

static_assert(Mapping<beit>);
static_assert(detail::skip_buckets_of<beit>() == 3 && detail::skip_buckets_of<swin>() == 1);

}  // namespace rpe::mapping
