/// @file mapping/shaw.hpp
/// @brief Shaw et al.'s clipped relative positions for token sequences (1D), as a Mapping on a
/// 1 × L grid.
///
/// Sign conventions side by side: the 2D mappings take the offset *query − key*,
/// `(dr, dc) = (r_i − r_j, c_i − c_j)` (the reference's convention). The 1D sources (Shaw et al.
/// 2018, T5) use *key − query*, `j − i`. A sequence is a one-row grid (height 1, width L), token
/// i at column i, so `dc = i − j` and the 1D offset is `j − i = −dc`.
#pragma once

#include <cstdint>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/raise.hpp"

namespace rpe::mapping {

/// @brief Shaw et al.'s clip for sequences: `id = clamp(j − i, −k, k) + k` with `j − i = −dc`,
/// so `2k+1` buckets; id `k` is the query's own position, ids above k are keys after the query.
///
/// Use on a `1 × L` grid (`height = 1, width = L`). Only the column offset is read: `dr` is
/// ignored, so on an `H × W` grid with `H > 1` this is the 1D encoding of the horizontal axis
/// (every row offset shares the buckets of its column offset, like Cross's cols table).
/// `shaw{.k = 2}`: offsets …,−3,−2 → 0; −1 → 1; 0 → 2; 1 → 3; 2,3,… → 4.
/// Valid parameters: `0 ≤ k < 2^30`, checked by `validate()` on the host.
/// Source: Shaw, Uszkoreit, Vaswani, "Self-Attention with Relative Position Representations"
/// (NAACL 2018), eqs. 3–5: `a_ij = w_clip(j−i, k)`, tables of `2k+1` vectors for keys and values.
struct shaw {
    int k = 16;  ///< clipping distance: offsets beyond ±k share the end buckets

    /// @brief `2k+1`.
    RPE_HOST_DEVICE constexpr int num_buckets() const {
        const std::int64_t span = detail::span_of(k);
        return detail::mapping_bucket_count(*this, "mapping.shaw", "2*k+1", span);
    }

    /// @brief Id of the offset `j − i = −dc` (dr ignored), in [0, 2k].
    RPE_HOST_DEVICE constexpr int bucket(int dr, int dc) const {
        (void)dr;
        const std::int64_t x = -static_cast<std::int64_t>(dc);  // key − query
        const std::int64_t c = x < -k ? -k : (x > k ? k : x);
        return static_cast<int>(c + k);
    }

    /// @brief Throws rpe::invalid_argument `[rpe.mapping.shaw] k = ...` unless `0 ≤ k < 2^30`.
    void validate() const { detail::require(k >= 0 && k < (1 << 30), "mapping.shaw", "k = ", k, "; expected 0 <= k < 2^30"); }

    friend constexpr bool operator==(const shaw&, const shaw&) = default;
};

static_assert(Mapping<shaw>);
static_assert(shaw{.k = 2}.bucket(0, 5) == 0 && shaw{.k = 2}.bucket(0, 0) == 2 && shaw{.k = 2}.bucket(0, -1) == 3);

}  // namespace rpe::mapping
