/// @file detail/offset_math.hpp
/// @brief Offset → bucket id index math shared by the host and the device: where the id of a
/// token pair sits among the per-offset ids, and one row of ids made from them (not API: use
/// rpe::bucket_ids). Pure RPE_HOST_DEVICE functions: no allocation, no exception.
///
/// Tokens: `skip` extra tokens, then a T × H × W grid in row-major order (token
/// `skip + (t·H + r)·W + c`). Per-offset ids: (2T−1)(2H−1)(2W−1) entries, offset (dt, dr, dc) at
/// `((dt + T − 1)(2H − 1) + (dr + H − 1))(2W − 1) + (dc + W − 1)`.
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace rpe::detail {

/// @brief The grid of a bucket id set: frames, rows, columns, extra tokens, and the extra ids.
struct id_grid {
    std::int64_t depth = 1;        ///< T
    std::int64_t height = 1;       ///< H
    std::int64_t width = 1;        ///< W
    std::int64_t skip = 0;         ///< extra tokens before the grid
    std::int64_t extra = 0;        ///< id of a pair whose query and key are both extra tokens (K − 1)
    std::int64_t extra_query = 0;  ///< id when only the query is an extra token (K − 1; BEiT: K − 3)
    std::int64_t extra_key = 0;    ///< id when only the key is an extra token (K − 1; BEiT: K − 2)

    /// @brief L = skip + T·H·W.
    RPE_HOST_DEVICE constexpr std::int64_t length() const { return skip + depth * height * width; }
    /// @brief Index into the per-offset ids of grid tokens i, j (both ≥ skip): the offset of
    /// query i relative to key j, (t_i − t_j, r_i − r_j, c_i − c_j).
    RPE_HOST_DEVICE constexpr std::int64_t offset_index(std::int64_t i, std::int64_t j) const {
        const std::int64_t hw = height * width, w = width;
        const std::int64_t gi = i - skip, gj = j - skip;
        const std::int64_t dt = gi / hw - gj / hw, dr = (gi % hw) / w - (gj % hw) / w, dc = gi % w - gj % w;
        return ((dt + depth - 1) * (2 * height - 1) + (dr + height - 1)) * (2 * w - 1) + (dc + w - 1);
    }
    /// @brief Id of a pair of query i and key j of which at least one is an extra token.
    RPE_HOST_DEVICE constexpr std::int64_t extra_id(std::int64_t i, std::int64_t j) const {
        return i < skip ? (j < skip ? extra : extra_query) : extra_key;
    }
    /// @brief Id of pair (i, j) from the per-offset ids `off` (any L × L position, extra tokens included).
    template <class Src>
    RPE_HOST_DEVICE constexpr std::int64_t id(const Src* off, std::int64_t i, std::int64_t j) const {
        return (i < skip || j < skip) ? extra_id(i, j) : static_cast<std::int64_t>(off[offset_index(i, j)]);
    }
};

/// @brief The skip tokens' part of row i of the ids (L = `n` entries in `dst`; id(i, j), or id(j, i)
/// when `transposed`, where the extra ids swap their roles): the whole row when i is a skip token
/// (returns true), else its first `skip` entries (returns false; the caller fills the rest).
template <class Id>
RPE_HOST_DEVICE bool fill_skip_ids(const id_grid& g, std::int64_t n, std::int64_t i, bool transposed, Id* dst) {
    const std::int64_t skip = g.skip;
    const Id row_extra = static_cast<Id>(transposed ? g.extra_key : g.extra_query);  // i extra, j a grid token
    const Id col_extra = static_cast<Id>(transposed ? g.extra_query : g.extra_key);  // i a grid token, j extra
    if (i < skip) {
        for (std::int64_t j = 0; j < skip; ++j) dst[j] = static_cast<Id>(g.extra);
        for (std::int64_t j = skip; j < n; ++j) dst[j] = row_extra;
        return true;
    }
    for (std::int64_t j = 0; j < skip; ++j) dst[j] = col_extra;
    return false;
}

/// @brief Row i of the ids (id(i, j) for every key j; with `transposed` id(j, i), the query
/// target's order) from the per-offset ids `off` into `dst` (L entries).
template <class Id, class Src>
RPE_HOST_DEVICE void fill_id_row(const id_grid& g, const Src* off, std::int64_t i, bool transposed, Id* dst) {
    const std::int64_t n = g.length(), skip = g.skip, t = g.depth, h = g.height, w = g.width;
    if (fill_skip_ids(g, n, i, transposed, dst)) return;
    const std::int64_t gi = i - skip, ti = gi / (h * w), ri = (gi / w) % h, ci = gi % w;
    const std::int64_t oh = 2 * h - 1, ow = 2 * w - 1;
    Id* out = dst + skip;
    for (std::int64_t tj = 0; tj < t; ++tj)
        for (std::int64_t rj = 0; rj < h; ++rj, out += w) {
            if (!transposed) {  // offsets (.., ci − cj) for cj = 0..W−1 run backwards through one offset row
                const Src* src = off + ((ti - tj + t - 1) * oh + (ri - rj + h - 1)) * ow + (ci + w - 1);
                for (std::int64_t cj = 0; cj < w; ++cj) out[cj] = static_cast<Id>(src[-cj]);
            } else {  // offsets (.., cj − ci) run forwards
                const Src* src = off + ((tj - ti + t - 1) * oh + (rj - ri + h - 1)) * ow + (w - 1 - ci);
                for (std::int64_t cj = 0; cj < w; ++cj) out[cj] = static_cast<Id>(src[cj]);
            }
        }
}

/// @brief Tokens at per-token positions instead of a grid: each grid token's position as one
/// linear index into the per-offset ids of a T × H × W box (the bounding box of the positions),
/// `lin = t·(2H−1)(2W−1) + r·(2W−1) + c` for box coordinates (t, r, c) (each ≥ 0), so that the
/// per-offset index of query i and key j is `base + lin_q[i] − lin_k[j]` with `base` the index of
/// offset (0, 0, 0). `key` may equal `query` (self-attention: one position per token); the keys
/// may number another count than the queries (cross-attention, L_k ≠ L).
struct id_positions {
    const std::int64_t* query = nullptr;  ///< (N) linear positions of the queries' grid tokens
    const std::int64_t* key = nullptr;    ///< (N_k) linear positions of the keys' grid tokens
    std::int64_t base = 0;                ///< per-offset index of offset (0, 0, 0): ((T−1)(2H−1) + H−1)(2W−1) + W−1
    /// @brief The query target's view (rpe::target::query reads id(j, i) of self-attention, the
    /// offset of the key relative to the query): queries and keys swapped, so that
    /// position_id(g, p.swapped(), off, j, i) is the id of offset kpos_j − qpos_i for query i and key j.
    RPE_HOST_DEVICE constexpr id_positions swapped() const { return id_positions{key, query, base}; }
};

/// @brief Id of pair (i, j) of tokens at positions (skip extra tokens, then grid tokens at the
/// linear positions `p`) from the per-offset ids `off`: the extra ids when i or j is an extra
/// token, else `off[base + query[i − skip] − key[j − skip]]` (the offset qpos_i − kpos_j). The
/// same id as rpe::bucket_ids::at at positions and fill_position_row; the CUDA attention's
/// kernels read ids at positions through it (the query target with p.swapped(), as j, i).
template <class Src>
RPE_HOST_DEVICE constexpr std::int64_t position_id(const id_grid& g, const id_positions& p, const Src* off, std::int64_t i,
                                                   std::int64_t j) {
    return (i < g.skip || j < g.skip) ? g.extra_id(i, j)
                                      : static_cast<std::int64_t>(off[p.base + p.query[i - g.skip] - p.key[j - g.skip]]);
}

/// @brief Row i of the ids of tokens at positions into `dst` (`n` = L_k = skip + N_k entries, one
/// per key j), from the per-offset ids `off`: id(i, j), the offset qpos_i − kpos_j; with
/// `transposed` the query target's id of query i and key j, the offset kpos_j − qpos_i with the
/// extra ids' roles swapped (on tokens of one set, id(j, i): the reference's rpe_q; with keys
/// apart, what self-attention over queries and keys together gives that pair). `g` gives skip and
/// the extra ids (its depth, height and width are the box's, unused here).
template <class Id, class Src>
RPE_HOST_DEVICE void fill_position_row(const id_grid& g, const id_positions& p, std::int64_t n, const Src* off, std::int64_t i,
                                       bool transposed, Id* dst) {
    const std::int64_t skip = g.skip;
    if (fill_skip_ids(g, n, i, transposed, dst)) return;
    Id* out = dst + skip;
    const std::int64_t m = n - skip;
    if (!transposed) {  // id(i, j): offset q_i − k_j
        const Src* src = off + p.base + p.query[i - skip];
        for (std::int64_t j = 0; j < m; ++j) out[j] = static_cast<Id>(src[-p.key[j]]);
    } else {  // the query target: offset k_j − q_i
        const Src* src = off + p.base - p.query[i - skip];
        for (std::int64_t j = 0; j < m; ++j) out[j] = static_cast<Id>(src[p.key[j]]);
    }
}

/// @brief Row j of the query target's ids in key order at positions (`n` = L = skip + N entries,
/// one per query i): the query target's id of query i and key j (fill_position_row with
/// `transposed`), the offset kpos_j − qpos_i; on tokens of one set, id(j, i) for every i (row j of
/// the ids).
template <class Id, class Src>
RPE_HOST_DEVICE void fill_position_key_row(const id_grid& g, const id_positions& p, std::int64_t n, const Src* off,
                                           std::int64_t j, Id* dst) {
    fill_position_row(g, p.swapped(), n, off, j, false, dst);
}

}  // namespace rpe::detail
