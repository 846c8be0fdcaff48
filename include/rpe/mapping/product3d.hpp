/// @file mapping/product3d.hpp
/// @brief 3D Product mapping for video tokens: one bucket per (frame, row, column) index triple.
#pragma once

#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/raise.hpp"
#include "../index/piecewise.hpp"

namespace rpe::mapping {

/// @brief Product on a depth × height × width (T × H × W) grid: paper eq. 25 extended to three
/// axes, each with its own index function:
/// `id = ((g_t(dt) + βt)·(2βr+1) + (g_r(dr) + βr))·(2βc+1) + (g_c(dc) + βc)`,
/// offsets (dt, dr, dc) = (t_i − t_j, r_i − r_j, c_i − c_j) (query minus key, as the 2D mappings).
///
/// Directed. `num_buckets() = (2βt+1)(2βr+1)(2βc+1)` before the skip bucket. With depth 1 the
/// offset dt is always 0 and the ids are those of mapping::product<Ir> with `row == col` shifted
/// by `βt·(2βr+1)(2βc+1)`. Validation: each index function's, and the bucket count must fit int.
/// Tokens are ordered frame-major: token `skip + (t·H + r)·W + c` (see rpe::bucket_ids).
/// Source: paper eq. 25 (Product), applied per axis; not in the reference implementation.
template <IndexFunction It = index::piecewise, IndexFunction Ir = It, IndexFunction Ic = Ir>
struct product3d {
    static constexpr int dimensions = 3;  ///< marks a Mapping3D
    It time{};                            ///< g_t, applied to the frame offset dt
    Ir row{};                             ///< g_r, applied to the row offset dr
    Ic col{};                             ///< g_c, applied to the column offset dc

    /// @brief `(2βt+1)(2βr+1)(2βc+1)`.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t st = detail::span_of(time.beta_int()), sr = detail::span_of(row.beta_int()),
                           sc = detail::span_of(col.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.product3d", "(2*beta_t+1)(2*beta_r+1)(2*beta_c+1)", st, sr, sc);
    }

    /// @brief Id of offset (dt, dr, dc) in [0, num_buckets()).
    RPE_HOST_DEVICE int bucket(int dt, int dr, int dc) const {
        const int bt = time.beta_int(), br = row.beta_int(), bc = col.beta_int();
        return ((time(static_cast<std::int64_t>(dt)) + bt) * (2 * br + 1) + (row(static_cast<std::int64_t>(dr)) + br)) *
                   (2 * bc + 1) +
               (col(static_cast<std::int64_t>(dc)) + bc);
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters or too many buckets.
    void validate() const {
        detail::validate_policy(time);
        detail::validate_policy(row);
        detail::validate_policy(col);
        const std::int64_t st = detail::span_of(time.beta_int()), sr = detail::span_of(row.beta_int()),
                           sc = detail::span_of(col.beta_int());
        // the same bound as num_buckets(): at most 2^31 - 1 buckets
        detail::require(detail::bucket_count_fits(st, sr, sc), "mapping.product3d", "beta_int (time, row, col) = (",
                        time.beta_int(), ", ", row.beta_int(), ", ", col.beta_int(), ") gives ", st, "*", sr, "*", sc,
                        " buckets; expected at most 2^31 - 1");
    }

    friend constexpr bool operator==(const product3d&, const product3d&) = default;
};

static_assert(Mapping3D<product3d<>>);
static_assert(!Mapping<product3d<>>);

}  // namespace rpe::mapping
