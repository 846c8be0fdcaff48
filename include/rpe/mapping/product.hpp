/// @file mapping/product.hpp
/// @brief Product mapping (directed): one bucket per (row index, column index) pair.
#pragma once

#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/raise.hpp"
#include "../index/piecewise.hpp"

namespace rpe::mapping {

/// @brief Product (paper eq. 25): `id = (g(dr) + βi)·(2βi+1) + (g(dc) + βi)`.
///
/// Directed: (dr, dc) and (−dr, −dc) get different ids. `num_buckets() = (2βi+1)²` before the
/// skip bucket (ratio 1.9: 49, 50 with a class token). Validation: the index function's, and
/// `(2βi+1)² + 1` must fit in int.
/// Source: paper eq. 25; reference `_rp_2d_product` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
template <IndexFunction I = index::piecewise>
struct product {
    I index{};  ///< the index function g applied to each axis offset

    /// @brief `(2βi+1)²`.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.product", "(2*beta_int+1)^2", span, span);
    }

    /// @brief Id of offset (dr, dc) in [0, num_buckets()).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const int b = index.beta_int();
        return (index(static_cast<std::int64_t>(dr)) + b) * (2 * b + 1) + (index(static_cast<std::int64_t>(dc)) + b);
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters or too many buckets.
    void validate() const {
        detail::validate_policy(index);
        const std::int64_t span = 2 * static_cast<std::int64_t>(index.beta_int()) + 1;
        detail::require(span * span < 2147483647, "mapping.product", "beta_int = ", index.beta_int(),
                        " gives (2*beta_int+1)^2 = ", span * span, " buckets; expected fewer than 2^31 - 1");
    }

    friend constexpr bool operator==(const product&, const product&) = default;
};

template <class I>
product(I) -> product<I>;

static_assert(Mapping<product<>>);

}  // namespace rpe::mapping
