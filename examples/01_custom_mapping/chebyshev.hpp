// A custom mapping policy, as a user writes it: the Chebyshev (chessboard) distance
// max(|dr|, |dc|) through rpe's piecewise index. Nothing in the library changes: the policy
// satisfies rpe::Mapping, so bucket ids, terms, the cache, rpe::make_any_term and the fused
// attention take it like a built-in mapping. See docs/custom_mapping.md.
#pragma once

#include <cstdint>

#include <rpe/concepts.hpp>
#include <rpe/config.hpp>
#include <rpe/index/piecewise.hpp>

namespace example {

/// @brief Chebyshev mapping (undirected): `id = g(max(|dr|, |dc|))` ∈ [0, βi], so
/// `num_buckets() = βi + 1` (no unused rows, unlike the reference's Euclidean table).
///
/// Every key on the square ring at distance d around the query shares one bucket: ratio 1.9
/// gives rings {0}, {1}, {2, 3}, {4, …} → ids 0, 1, 2, 3.
/// Offsets follow the library's 2D convention `(dr, dc) = (r_i − r_j, c_i − c_j)`.
struct chebyshev {
    rpe::index::piecewise index{};  ///< g, applied to the Chebyshev distance

    /// @brief `βi + 1`.
    RPE_HOST_DEVICE constexpr int num_buckets() const { return index.beta_int() + 1; }

    /// @brief Id of offset (dr, dc), in [0, βi]. No allocation, no exception: runs in a CUDA kernel too.
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::int64_t r = dr < 0 ? -static_cast<std::int64_t>(dr) : dr;
        const std::int64_t c = dc < 0 ? -static_cast<std::int64_t>(dc) : dc;
        return index(r > c ? r : c);
    }

    /// @brief Host-side check, called once when a term or bucket ids are built.
    /// @throws rpe::invalid_argument for invalid α, β, γ (the index's own check).
    void validate() const { index.validate(); }

    /// Equality: the bucket cache tells configurations apart by type and by this.
    friend constexpr bool operator==(const chebyshev&, const chebyshev&) = default;
};

static_assert(rpe::Mapping<chebyshev>);

}  // namespace example
