/// @file mapping/t5.hpp
/// @brief T5's relative position buckets for token sequences (1D), bidirectional (encoder) and
/// causal (decoder), as a Mapping on a 1 × L grid.
///
/// Sign conventions side by side: the 2D mappings take the offset *query − key*,
/// `(dr, dc) = (r_i − r_j, c_i − c_j)` (the reference's convention). T5 takes `relative_position = memory_position −
/// query_position = j − i` (*key − query*). On a one-row grid (height 1, width L, token i at
/// column i) `dc = i − j`, so T5's relative position is `−dc`.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/math.hpp"
#include "../detail/raise.hpp"

namespace rpe::mapping {

/// @brief T5 relative buckets: `num_buckets` ids, exact for small distances, log-spaced up to
/// `max_distance`, one shared bucket beyond.
///
/// With `n = j − i = −dc` (dr ignored, see below) and `nb = num_buckets`:
/// - bidirectional: `nb ← nb / 2` (integer division), `offset = (n > 0) ? nb : 0`, `n ← |n|`;
///   causal: `offset = 0`, `n ← max(−n, 0)` (keys after the query all share bucket 0);
/// - `max_exact = nb / 2`; `n < max_exact` → `offset + n`;
/// - else `offset + min(nb − 1, max_exact + trunc(logf(float(n) / float(max_exact)) /
///   float(ln(max_distance / max_exact)) · float(nb − max_exact)))`, in float32 as T5 (the
///   denominator is computed in double, as Python's math.log, then rounded to float32).
///
/// The cap is taken in float before the conversion to integer (the same ids as T5's cap after the
/// conversion, without an out-of-range float→int conversion for extreme parameters).
/// Only the column offset is read: `dr` is ignored, so on an `H × W` grid with `H > 1` this is
/// the 1D encoding of the horizontal axis. Ids lie in `[0, num_buckets)`. As in T5, a
/// bidirectional mapping never uses id `nb/2` (offset 0 goes to the "before" half), nor, with an
/// odd `num_buckets`, the last id: 32 buckets use 31.
/// Valid parameters (checked by `validate()` on the host): `num_buckets` in `[4, 2^30)` (
/// bidirectional) or `[2, 2^30)` (causal), so that `max_exact ≥ 1`; `max_distance > max_exact`.
/// On CUDA the id can differ from the host's where the device's `logf` rounds differently from
/// the host's at an exact bucket boundary.
/// Source: Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
/// Transformer" (JMLR 2020), §2.1; the function `_relative_position_bucket` of the T5 code
/// (tensorflow/mesh `mesh_tensorflow/transformer/transformer_layers.py`, and Hugging Face
/// `T5Attention._relative_position_bucket` in `transformers/models/t5/modeling_t5.py`; equal to
/// the latter run in PyTorch at every offset in −1000..1000 for nine configurations).
/// Defaults are T5's: 32 buckets, max_distance 128, bidirectional.
struct t5 {
    int buckets = 32;           ///< number of buckets (rows of the table), both directions together
    int max_distance = 128;     ///< distances ≥ this share the last bucket of their direction
    bool bidirectional = true;  ///< true: encoder (both directions); false: decoder (causal)

    /// @brief `buckets`. On the host (outside constant evaluation) it runs validate() first, so a
    /// count outside the valid range (a negative one included) throws rpe::invalid_argument
    /// `[rpe.mapping.t5] num_buckets = ...; expected [...]` instead of being returned.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
#if !defined(__CUDA_ARCH__)
        if (!std::is_constant_evaluated()) validate();
#endif
        return buckets;
    }

    /// @brief `max_exact` of the formula: half of the buckets of one direction.
    RPE_HOST_DEVICE constexpr int max_exact() const { return (bidirectional ? buckets / 2 : buckets) / 2; }

    /// @brief Id of T5's relative position `j − i = −dc` (dr ignored), in [0, num_buckets()).
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        (void)dr;
        std::int64_t n = -static_cast<std::int64_t>(dc);  // key − query
        int nb = buckets;
        int offset = 0;
        if (bidirectional) {
            nb /= 2;
            offset = n > 0 ? nb : 0;
            n = n < 0 ? -n : n;
        } else {
            n = n < 0 ? -n : 0;
        }
        const int exact = nb / 2;
        if (n < exact) return offset + static_cast<int>(n);
        const float ratio = static_cast<float>(n) / static_cast<float>(exact);
        const float denom = static_cast<float>(detail::math::log(static_cast<double>(max_distance) / static_cast<double>(exact)));
        const float v = detail::math::log(ratio) / denom * static_cast<float>(nb - exact);
        const int cap = nb - 1 - exact;
        if (!(v < static_cast<float>(cap))) return offset + nb - 1;
        return offset + exact + static_cast<int>(v);  // v ∈ [0, cap): truncation toward zero
    }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.t5] num_buckets = ...` or
    /// `... max_distance = ...` for the parameters the class comment excludes.
    void validate() const {
        const int least = bidirectional ? 4 : 2;
        detail::require(buckets >= least && buckets < (1 << 30), "mapping.t5", "num_buckets = ", buckets, "; expected [", least,
                        ", 2^30) for ", bidirectional ? "bidirectional" : "causal", " buckets");
        detail::require(max_distance > max_exact(), "mapping.t5", "max_distance = ", max_distance,
                        "; expected > max_exact = ", max_exact(), " (half of the buckets of one direction)");
    }

    friend constexpr bool operator==(const t5&, const t5&) = default;
};

static_assert(Mapping<t5>);

}  // namespace rpe::mapping
