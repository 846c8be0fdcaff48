/// @file mapping/euclidean.hpp
/// @brief Euclidean mappings (undirected): the reference code's (rounded distance) and the paper's.
#pragma once

#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/float.hpp"
#include "../detail/math.hpp"
#include "../index/piecewise.hpp"

namespace rpe::mapping {

/// @brief Euclidean as the reference code: `id = g(round_half_even(sqrtf(float(dr²+dc²)))) + βi`.
///
/// Undirected: ids lie in [βi, 2βi], so the lower half of the `2βi+1` table rows is never read
/// (the reference allocates it; we keep its layout so trained weights load).
/// Source: paper eqs. 19–20 with the code's rounding; reference `_rp_2d_euclidean` in
/// microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
template <IndexFunction I = index::piecewise>
struct euclidean {
    I index{};  ///< the index function g applied to the rounded distance

    /// @brief `2βi+1` (only [βi, 2βi] is used).
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.euclidean", "2*beta_int+1", span);
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::uint64_t sq = detail::square_sum(dr, dc);  // no int64 overflow at INT_MIN
        const float distance = detail::math::nearbyint(detail::math::sqrt(static_cast<float>(sq)));
        return index(distance) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const euclidean&, const euclidean&) = default;
};

template <class I>
euclidean(I) -> euclidean<I>;

/// @brief Euclidean as the paper: `id = g(sqrtf(float(dr²+dc²))) + βi` on the unrounded distance.
///
/// Differs from mapping::euclidean only beyond α, where g sees the real distance (inside α,
/// g rounds half to even itself). Not the default: trained reference weights use the code's.
/// Source: paper eqs. 18–20.
template <IndexFunction I = index::piecewise>
struct euclidean_paper {
    I index{};  ///< the index function g applied to the real distance

    /// @brief `2βi+1` (only [βi, 2βi] is used).
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.euclidean_paper", "2*beta_int+1", span);
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::uint64_t sq = detail::square_sum(dr, dc);  // no int64 overflow at INT_MIN
        return index(detail::math::sqrt(static_cast<float>(sq))) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const euclidean_paper&, const euclidean_paper&) = default;
};

template <class I>
euclidean_paper(I) -> euclidean_paper<I>;

static_assert(Mapping<euclidean<>>);
static_assert(Mapping<euclidean_paper<>>);

}  // namespace rpe::mapping
