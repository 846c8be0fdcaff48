/// @file mapping/quantization.hpp
/// @brief Quantization mappings (undirected): the reference code's (squared distance) and the
/// paper's (rank of the distinct distances, eq. 21).
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/float.hpp"
#include "../detail/math.hpp"
#include "../index/piecewise.hpp"

namespace rpe::mapping {

/// @brief Quantization as the reference code: `id = g(dr² + dc²) + βi` (g on the *squared*
/// distance, an integer).
///
/// Undirected: ids lie in [βi, 2βi] of a `2βi+1` table.
/// Source: reference `_rp_2d_quant` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py` (the paper's
/// eq. 21 differs: see quantization_paper).
template <IndexFunction I = index::piecewise>
struct quantization {
    I index{};  ///< the index function g applied to the squared distance

    /// @brief `2βi+1` (only [βi, 2βi] is used).
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.quantization", "2*beta_int+1", span);
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        // dr² + dc² reaches 2^63 only for dr = dc = INT_MIN: saturate (g is flat that far out)
        const std::uint64_t sq = detail::square_sum(dr, dc);
        constexpr auto int64_max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
        return index(static_cast<std::int64_t>(sq > int64_max ? int64_max : sq)) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const quantization&, const quantization&) = default;
};

template <class I>
quantization(I) -> quantization<I>;

/// @brief Quantization as the paper (eq. 21): the distances {0, 1, √2, 2, √5, …} are numbered
/// 0, 1, 2, … in increasing order and g is applied to that rank: `id = g(rank(dr²+dc²)) + βi`,
/// where `rank(n)` counts the integers m < n that are a sum of two squares.
///
/// Assumes g is non-decreasing on non-negative inputs (piecewise and clip are), so the count stops
/// at the saturating rank `r_sat`, the smallest r ≥ 1 with `g(r) ≥ βi` (found by bisection):
/// `id = g(min(rank(n), r_sat)) + βi`. The count sieves the sums a² + b² < n block by block in a
/// 2 KiB bit set on the stack (no allocation). Cost per call: O(log n) evaluations of g plus
/// O(m + (m / 16384)·√m) for the m ≤ n scanned until the count reaches `r_sat`; a grid of H×W
/// costs O(H·W·m). (The first version counted with a trial test per integer, O(m^1.5) per call:
/// ~h^5 for an h×h grid with a slowly saturating g, e.g. β = 1000; the ids are the same.)
/// Source: paper eq. 21 (the reference's `quantize_values` helper, which nothing calls).
template <IndexFunction I = index::piecewise>
struct quantization_paper {
    I index{};  ///< the index function g applied to the rank of the distance

    /// @brief `2βi+1` (only [βi, 2βi] is used).
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(index.beta_int());
        return detail::mapping_bucket_count(*this, "mapping.quantization_paper", "2*beta_int+1", span);
    }

    /// @brief True when m = a² + b² for some integers a, b (m ≥ 0). O(√m).
    RPE_HOST_DEVICE static bool is_sum_of_two_squares(std::int64_t m) {
        for (std::int64_t a = 0; 2 * a * a <= m; ++a) {
            const std::int64_t rest = m - a * a;
            const auto b = static_cast<std::int64_t>(isqrt(static_cast<std::uint64_t>(rest)));
            if (b * b == rest) return true;
        }
        return false;
    }

    /// @brief `min(rank(n), stop)`: how many m < n are a sum of two squares, counting no further
    /// than `stop`.
    RPE_HOST_DEVICE static std::int64_t count_sums_of_two_squares(std::uint64_t n, std::int64_t stop) {
        constexpr std::uint64_t block = 16384;  // bits per block: 2 KiB on the stack
        std::uint64_t bits[block / 64];
        std::int64_t count = 0;
        for (std::uint64_t lo = 0; lo < n && count < stop; lo += block) {
            const std::uint64_t hi = n - lo < block ? n : lo + block;  // this block: [lo, hi)
            for (std::uint64_t& w : bits) w = 0;
            // every a² + b² in [lo, hi) with 0 ≤ a ≤ b
            for (std::uint64_t a = 0; 2 * a * a < hi; ++a) {
                const std::uint64_t a2 = a * a;
                std::uint64_t b = a;
                if (a2 + b * b < lo) {
                    b = isqrt(lo - a2);
                    if (a2 + b * b < lo) ++b;
                }
                for (; a2 + b * b < hi; ++b) {
                    const std::uint64_t m = a2 + b * b - lo;
                    bits[m / 64] |= std::uint64_t{1} << (m % 64);
                }
            }
            for (const std::uint64_t w : bits) {
                count += std::popcount(w);
                if (count >= stop) return stop;
            }
        }
        return count;
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::uint64_t sq = detail::square_sum(dr, dc);
        const std::int64_t rank = count_sums_of_two_squares(sq, saturating_rank(sq));
        return index(rank) + index.beta_int();
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const quantization_paper&, const quantization_paper&) = default;

private:
    // floor(√x), exact for every x < 2^64 that square_sum() can produce (x ≤ 2^63).
    RPE_HOST_DEVICE static std::uint64_t isqrt(std::uint64_t x) {
        auto r = static_cast<std::uint64_t>(detail::math::sqrt(static_cast<double>(x)));
        while (r * r > x) --r;
        while ((r + 1) * (r + 1) <= x) ++r;
        return r;
    }

    // The smallest r in [1, limit] with g(r) ≥ βi (bisection; g non-decreasing), else limit + 1.
    // rank(n) ≤ n, so limit = n suffices.
    RPE_HOST_DEVICE std::int64_t saturating_rank(std::uint64_t n) const {
        constexpr auto most = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max() - 1);
        const auto limit = static_cast<std::int64_t>(n > most ? most : n);
        const int cap = index.beta_int();
        if (limit < 1 || index(limit) < cap) return limit + 1;
        std::int64_t lo = 0, hi = limit;  // g(r) < βi for 1 ≤ r ≤ lo; g(hi) ≥ βi
        while (hi - lo > 1) {
            const std::int64_t mid = lo + (hi - lo) / 2;
            if (index(mid) >= cap)
                hi = mid;
            else
                lo = mid;
        }
        return hi;
    }
};

template <class I>
quantization_paper(I) -> quantization_paper<I>;

static_assert(Mapping<quantization<>>);
static_assert(Mapping<quantization_paper<>>);

}  // namespace rpe::mapping
