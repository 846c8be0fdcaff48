/// @file mapping/within_grid.hpp
/// @brief A mapping bounded to the grid it was built for: forwards the ids of an inner mapping and
/// rejects a taller or wider grid (used by SAM's decomposed term and 2D ALiBi).
#pragma once

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/raise.hpp"
#include "cross.hpp"

namespace rpe::mapping {

/// @brief The ids of `inner`, valid on grids of at most `height` × `width`.
///
/// Some mappings are sized for one grid: SAM's decomposed term and 2D ALiBi use a clip index with
/// β = max(H, W) − 1 so that every offset of an H × W grid has its own bucket, and their tables
/// hold values for those offsets only. On a taller or wider grid the clip index would merge the
/// far offsets into the edge buckets (a wrong answer, not an error). `validate_grid` (called by
/// rpe::build_bucket_ids, hence by every term, the bucket cache and the attention) rejects such a
/// grid; a smaller grid reads a subset of the buckets, with the same ids as on the full grid.
/// `num_buckets`, `bucket`, `num_tables` and `skip_buckets` are the inner mapping's; the bound is
/// part of the value (operator==), so the cache keeps the ids of different bounds apart.
/// Valid parameters (checked by `validate()` on the host): `height, width ≥ 1` and the inner
/// mapping's own.
template <Mapping M>
struct within_grid {
    static constexpr int num_tables = detail::num_tables_of<M>();      ///< the inner mapping's
    static constexpr int skip_buckets = detail::skip_buckets_of<M>();  ///< the inner mapping's
    M inner{};                                                         ///< the mapping whose ids are used
    int height = 1;  ///< the largest grid height it accepts (the grid it was built for)
    int width = 1;   ///< the largest grid width it accepts

    /// @brief The inner mapping's buckets per table.
    RPE_HOST_DEVICE constexpr int num_buckets() const { return static_cast<int>(inner.num_buckets()); }

    /// @brief The inner mapping's id of offset (dr, dc) in table `table` (0 for one-table mappings).
    RPE_HOST_DEVICE constexpr int bucket(int dr, int dc, int table) const {
        if constexpr (num_tables > 1)
            return static_cast<int>(inner.bucket(dr, dc, table));
        else
            return static_cast<int>(inner.bucket(dr, dc));
    }

    /// @brief The inner mapping's id of offset (dr, dc) in table 0.
    RPE_HOST_DEVICE constexpr int bucket(int dr, int dc) const { return bucket(dr, dc, 0); }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.within_grid] height = ...; expected >= 1`
    /// (likewise width), or the inner mapping's error.
    void validate() const {
        detail::require(height >= 1, "mapping.within_grid", "height = ", height, "; expected >= 1");
        detail::require(width >= 1, "mapping.within_grid", "width = ", width, "; expected >= 1");
        detail::validate_policy(inner);
    }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.within_grid] grid = 9x9 is larger than
    /// the 8x8 grid the term was built for; ...` when the grid is taller or wider than the bound.
    void validate_grid(int grid_height, int grid_width) const {
        detail::require(grid_height <= height && grid_width <= width, "mapping.within_grid", "grid = ", grid_height, "x",
                        grid_width, " is larger than the ", height, "x", width,
                        " grid the term was built for; expected height <= ", height, " and width <= ", width,
                        " (its buckets cover the offsets of that grid only: build the term for the largest grid it runs on)");
        detail::validate_grid_of(inner, grid_height, grid_width);
    }

    friend constexpr bool operator==(const within_grid&, const within_grid&) = default;
};

static_assert(Mapping<within_grid<cross<>>> && within_grid<cross<>>::num_tables == 2 && within_grid<cross<>>::skip_buckets == 1);

}  // namespace rpe::mapping
