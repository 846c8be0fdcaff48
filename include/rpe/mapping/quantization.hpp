/// @file mapping/quantization.hpp
/// @brief Quantization mappings (undirected): the reference code's (squared distance) and the
/// paper's (rank of the distinct distances, eq. 21).
#pragma once

#include <cmath>
#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
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
    RPE_HOST_DEVICE constexpr int num_buckets() const { return 2 * index.beta_int() + 1; }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::int64_t sq = static_cast<std::int64_t>(dr) * dr + static_cast<std::int64_t>(dc) * dc;
        return index(sq) + index.beta_int();
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
/// once g reaches βi. Cost per call: O(r·√n) for the rank r at which g saturates.
/// Source: paper eq. 21 (the reference's `quantize_values` helper, which nothing calls).
template <IndexFunction I = index::piecewise>
struct quantization_paper {
    I index{};  ///< the index function g applied to the rank of the distance

    /// @brief `2βi+1` (only [βi, 2βi] is used).
    RPE_HOST_DEVICE constexpr int num_buckets() const { return 2 * index.beta_int() + 1; }

    /// @brief True when m = a² + b² for some integers a, b.
    RPE_HOST_DEVICE static bool is_sum_of_two_squares(std::int64_t m) {
        for (std::int64_t a = 0; 2 * a * a <= m; ++a) {
            const std::int64_t rest = m - a * a;
            auto b = static_cast<std::int64_t>(std::sqrt(static_cast<double>(rest)));
            while (b * b > rest) --b;
            while ((b + 1) * (b + 1) <= rest) ++b;
            if (b * b == rest) return true;
        }
        return false;
    }

    /// @brief Id of offset (dr, dc).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::int64_t sq = static_cast<std::int64_t>(dr) * dr + static_cast<std::int64_t>(dc) * dc;
        const int cap = index.beta_int();
        std::int64_t rank = 0;
        for (std::int64_t m = 0; m < sq; ++m) {
            if (!is_sum_of_two_squares(m)) continue;
            ++rank;
            if (index(rank) >= cap) break;  // saturated: any larger rank gives the same id
        }
        return index(rank) + cap;
    }

    /// @brief Throws rpe::invalid_argument for invalid index parameters.
    void validate() const { detail::validate_policy(index); }

    friend constexpr bool operator==(const quantization_paper&, const quantization_paper&) = default;
};

template <class I>
quantization_paper(I) -> quantization_paper<I>;

static_assert(Mapping<quantization<>>);
static_assert(Mapping<quantization_paper<>>);

}  // namespace rpe::mapping
