/// @file mapping/euclidean.hpp
/// @brief Euclidean mappings (undirected): the reference code's (rounded distance) and the paper's.
#pragma once

#include <cmath>
#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/float.hpp"
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
#if !defined(__CUDA_ARCH__)
        if (!detail::bucket_count_fits(span)) bucket_overflow(span);
#endif
        return detail::bucket_count(span);
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::uint64_t sq = detail::square_sum(dr, dc);  // no int64 overflow at INT_MIN
        const float distance = std::nearbyint(std::sqrt(static_cast<float>(sq)));
        return index(distance) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const euclidean&, const euclidean&) = default;

private:
    // num_buckets() on the host with parameters whose count overflows int: validate() names the
    // parameter; parameters that pass it (a custom index function) get the count's message.
    template <class... E>
    [[noreturn]] void bucket_overflow(E... extents) const {
        validate();
        detail::throw_bucket_overflow("mapping.euclidean", "2*beta_int+1", extents...);
    }
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
#if !defined(__CUDA_ARCH__)
        if (!detail::bucket_count_fits(span)) bucket_overflow(span);
#endif
        return detail::bucket_count(span);
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::uint64_t sq = detail::square_sum(dr, dc);  // no int64 overflow at INT_MIN
        return index(std::sqrt(static_cast<float>(sq))) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const euclidean_paper&, const euclidean_paper&) = default;

private:
    // num_buckets() on the host with parameters whose count overflows int: validate() names the
    // parameter; parameters that pass it (a custom index function) get the count's message.
    template <class... E>
    [[noreturn]] void bucket_overflow(E... extents) const {
        validate();
        detail::throw_bucket_overflow("mapping.euclidean_paper", "2*beta_int+1", extents...);
    }
};

template <class I>
euclidean_paper(I) -> euclidean_paper<I>;

static_assert(Mapping<euclidean<>>);
static_assert(Mapping<euclidean_paper<>>);

}  // namespace rpe::mapping
