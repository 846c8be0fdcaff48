/// @file mapping/cross.hpp
/// @brief Cross mapping (directed): a row bucket and a column bucket, each in its own table.
#pragma once

#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../index/piecewise.hpp"

namespace rpe::mapping {

/// @brief Cross (paper eqs. 22–24): table 0 (rows) `g(dr) + βi`, table 1 (cols) `g(dc) + βi`.
///
/// Two id matrices and two lookup tables; the term is the sum of the rows term and the cols
/// term. `num_buckets() = 2βi+1` per table before the skip bucket.
/// Source: paper eqs. 22–24; reference `_rp_2d_cross_rows` / `_rp_2d_cross_cols` (method ids 41,
/// 42) in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
template <IndexFunction I = index::piecewise>
struct cross {
    static constexpr int num_tables = 2;  ///< rows table (0) and cols table (1)
    I index{};                            ///< the index function g applied to each axis offset

    /// @brief `2βi+1` per table.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.cross", "2*beta_int+1", span);
    }

    /// @brief Id in table `table` (0 rows, 1 cols) of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc, int table) const {
        return index(static_cast<std::int64_t>(table == 0 ? dr : dc)) + index.beta_int();
    }

    /// @brief Id in the rows table (table 0).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const { return bucket(dr, dc, 0); }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const cross&, const cross&) = default;
};

template <class I>
cross(I) -> cross<I>;

static_assert(Mapping<cross<>>);

}  // namespace rpe::mapping
