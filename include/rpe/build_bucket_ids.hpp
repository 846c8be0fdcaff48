/// @file build_bucket_ids.hpp
/// @brief rpe::build_bucket_ids: evaluates a mapping once per offset of a grid and assembles the
/// bucket ids (prefer rpe::bucket_cache, which builds each configuration once).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "bucket_ids.hpp"
#include "bucket_key.hpp"
#include "concepts.hpp"
#include "detail/check.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace rpe {

namespace detail {

/// @brief Id of offset (dt, dr, dc) in table `table` of a 2D (dt must be 0) or 3D mapping.
template <GridMapping M>
int grid_bucket_of(const M& m, int dt, int dr, int dc, int table) {
    if constexpr (Mapping3D<M>)
        return static_cast<int>(m.bucket(dt, dr, dc));
    else
        return bucket_of(m, dr, dc, table);
}

/// @brief Bytes per id for K buckets (extra bucket included): 1, 2 or 4.
constexpr int id_bytes_for(std::int64_t k) { return k <= 256 ? 1 : (k <= 65536 ? 2 : 4); }

/// @brief What id_storage::automatic means for L tokens, K buckets and `tables` id sets.
inline id_storage automatic_storage(std::int64_t n, std::int64_t k, int tables) {
    const std::int64_t per_pair = id_bytes_for(k) * static_cast<std::int64_t>(tables);
    return n <= bucket_ids::auto_table_bytes / per_pair / std::max<std::int64_t>(n, 1) ? id_storage::table
                                                                                       : id_storage::on_the_fly;
}

template <class Id>
bucket_ids::storage narrow_ids(const std::vector<int>& ids) {
    std::vector<Id> v(ids.size());
    std::transform(ids.begin(), ids.end(), v.begin(), [](int x) { return static_cast<Id>(x); });
    return v;
}

/// @brief The sizes of an id build, checked before any mapping call or allocation.
struct id_plan {
    std::int64_t length = 0;                 ///< L
    std::int64_t buckets = 0;                ///< K, the extra bucket included
    int id_bytes = 1;                        ///< 1, 2 or 4
    id_storage storage = id_storage::table;  ///< resolved (never automatic)
    std::int64_t offsets = 0;                ///< per-offset ids per table, (2T−1)(2H−1)(2W−1)
    int skip_buckets = 1;                    ///< extra buckets for pairs touching a skip token (1, or 3 for BEiT)
};

/// @brief Checks the grid of an id build. @throws as build_bucket_ids.
inline void check_id_grid(int depth, int height, int width, int skip, bool mapping_3d) {
    require(depth >= 1, "bucket_ids", "depth = ", depth, "; expected >= 1");
    require(height >= 1, "bucket_ids", "height = ", height, "; expected >= 1");
    require(width >= 1, "bucket_ids", "width = ", width, "; expected >= 1");
    require(skip >= 0, "bucket_ids", "skip = ", skip, "; expected >= 0");
    require(mapping_3d || depth == 1, "bucket_ids", "depth = ", depth,
            " with a 2D mapping; expected depth = 1 (use a 3D mapping for T x H x W grids)");
}

/// @brief Checks the sizes of an id build on a checked grid (the mapping-independent part of
/// build_bucket_ids) and resolves `automatic` storage. `skip_buckets`: the mapping's
/// detail::skip_buckets_of (1 or 3). @throws as build_bucket_ids.
inline id_plan plan_bucket_ids(int depth, int height, int width, int skip, std::int64_t mapping_buckets, int tables,
                               id_storage storage, int skip_buckets = 1) {
    id_plan p;
    p.skip_buckets = skip_buckets;
    p.length = skip + static_cast<std::int64_t>(depth) * height * width;
    const std::int64_t n = p.length;
    if (n > std::numeric_limits<int>::max())
        throw out_of_range(message("bucket_ids", "L = skip + height*width = ", n, " for depth = ", depth, ", height = ", height,
                                   ", width = ", width, ", skip = ", skip, "; expected L < 2^31"));
    const std::int64_t k = mapping_buckets;
    require(k >= 1, "bucket_ids", "mapping num_buckets() = ", k, "; expected >= 1");
    p.buckets = k + (skip > 0 ? skip_buckets : 0);
    if (p.buckets - 1 > std::numeric_limits<std::uint32_t>::max() || p.buckets > std::numeric_limits<int>::max())
        throw out_of_range(message("bucket_ids", "num_buckets = ", p.buckets, " does not fit the id type"));
    p.id_bytes = id_bytes_for(p.buckets);
    // (L, L) bytes, saturated so that L near 2^31 does not overflow int64
    const std::int64_t per_pair = static_cast<std::int64_t>(p.id_bytes) * tables;
    const std::int64_t table_bytes =
        n > std::numeric_limits<std::int64_t>::max() / per_pair / n ? std::numeric_limits<std::int64_t>::max() : n * n * per_pair;
    if (storage == id_storage::automatic) storage = automatic_storage(n, p.buckets, tables);
    if (storage == id_storage::table && table_bytes > bucket_ids::max_bytes)
        throw out_of_range(message("bucket_ids", "an (L, L) id table for L = ", n, " needs ", table_bytes,
                                   " bytes; expected at most bucket_ids::max_bytes = ", bucket_ids::max_bytes,
                                   " (use id_storage::on_the_fly or automatic)"));
    p.storage = storage;
    // per-offset ids: (2T−1)(2H−1)(2W−1) per table, in 64-bit (2·width overflows int near 2^30);
    // each is evaluated into an int first: their count is bounded by max_bytes / 16 (1 GiB of ints)
    const std::int64_t od = 2 * std::int64_t{depth} - 1, oh = 2 * std::int64_t{height} - 1, ow = 2 * std::int64_t{width} - 1;
    if (od * oh > bucket_ids::max_bytes / 16 / ow)
        throw out_of_range(message("bucket_ids", "the per-offset ids of a ", depth, "x", height, "x", width,
                                   " grid number (2T-1)(2H-1)(2W-1) = ", od, "*", oh, "*", ow,
                                   "; expected at most bucket_ids::max_bytes / 16 = ", bucket_ids::max_bytes / 16));
    p.offsets = od * oh * ow;
    return p;
}

/// @brief Assembles bucket ids from each table's per-offset ids (ints below the extra ids): narrows
/// them to the id type and, for table storage, makes every (L, L) row once.
inline std::shared_ptr<const bucket_ids> assemble_bucket_ids(bucket_key key, const id_plan& p,
                                                             const std::vector<std::vector<int>>& per_offset) {
    std::vector<bucket_ids::storage> offsets;
    for (const auto& ids : per_offset)
        offsets.push_back(visit_id_width(p.id_bytes, [&]<class Id>() -> bucket_ids::storage { return narrow_ids<Id>(ids); }));
    key.storage = p.storage;
    const int total = static_cast<int>(p.buckets);
    if (p.storage == id_storage::on_the_fly)
        return std::make_shared<const bucket_ids>(std::move(key), total, std::move(offsets), std::vector<bucket_ids::storage>{},
                                                  p.skip_buckets);
    // Table storage: every row made once from the per-offset ids.
    const std::int64_t n = p.length;
    bucket_key row_key = key;
    row_key.storage = id_storage::on_the_fly;
    const bucket_ids rows_of(std::move(row_key), total, offsets, {}, p.skip_buckets);
    std::vector<bucket_ids::storage> matrices;
    for (int t = 0; t < static_cast<int>(offsets.size()); ++t)
        matrices.push_back(std::visit(
            [&](const auto& off) -> bucket_ids::storage {
                using Id = std::remove_cvref_t<decltype(off[0])>;
                std::vector<Id> v(static_cast<std::size_t>(n * n));
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n > 256)
#endif
                for (std::int64_t i = 0; i < n; ++i) (void)rows_of.rows<Id>(t, i, 1, false, v.data() + i * n);
                return v;
            },
            offsets[static_cast<std::size_t>(t)]));
    return std::make_shared<const bucket_ids>(std::move(key), total, std::move(offsets), std::move(matrices), p.skip_buckets);
}

}  // namespace detail

/// @brief Builds the bucket ids of mapping `m` on a `depth × height × width` grid after `skip`
/// extra tokens, without any cache. Prefer bucket_cache::get, which builds each configuration once.
///
/// The mapping is evaluated once per offset (dt, dr, dc) ∈ [−(T−1), T−1] × [−(H−1), H−1] ×
/// [−(W−1), W−1]; table storage then gathers the (L, L) matrices from those: O(offsets) mapping
/// calls + O(L²) (table) or O(1) (on the fly). A 2D mapping needs depth 1.
/// @throws rpe::invalid_argument `[rpe.bucket_ids] height = ...` for depth, height or width < 1,
///   skip < 0, a `storage` that is not an id_storage enumerator (`storage = 7; expected ...`),
///   a 2D mapping with depth > 1, invalid mapping parameters (its `validate()`) or a grid the
///   mapping rejects (its optional `validate_grid(height, width)`, e.g. a grid larger than a Swin window);
///   rpe::out_of_range when L overflows int, table storage would exceed bucket_ids::max_bytes,
///   or the mapping returns an id outside [0, num_buckets()) (a faulty custom mapping).
/// Thread-safety: reentrant. Source: reference `get_bucket_ids_2d`, extended to 3D.
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, int depth, int height, int width, int skip, id_storage storage) {
    detail::require_enum(storage, 3, "bucket_ids", "storage", "automatic, table or on_the_fly");
    detail::check_id_grid(depth, height, width, skip, Mapping3D<M>);
    detail::validate_policy(m);
    if constexpr (!Mapping3D<M>) detail::validate_grid_of(m, height, width);
    constexpr int tables = detail::num_tables_of<M>();
    constexpr int skip_buckets = detail::skip_buckets_of<M>();
    const detail::id_plan p = detail::plan_bucket_ids(depth, height, width, skip, static_cast<std::int64_t>(m.num_buckets()),
                                                      tables, storage, skip_buckets);
    const std::int64_t k = p.buckets - (skip > 0 ? skip_buckets : 0);
    const std::int64_t oh = 2 * std::int64_t{height} - 1, ow = 2 * std::int64_t{width} - 1;
    std::vector<std::vector<int>> per_offset;
    for (int t = 0; t < tables; ++t) {
        std::vector<int> ids(static_cast<std::size_t>(p.offsets));
        for (int dt = -(depth - 1); dt <= depth - 1; ++dt)
            for (int dr = -(height - 1); dr <= height - 1; ++dr)
                for (int dc = -(width - 1); dc <= width - 1; ++dc) {
                    const int id = detail::grid_bucket_of(m, dt, dr, dc, t);
                    if (id < 0 || id >= k)
                        throw out_of_range(detail::message("bucket_ids", "mapping returned bucket id ", id,
                                                           " for offset (dt = ", dt, ", dr = ", dr, ", dc = ", dc, ") in table ",
                                                           t, "; expected [0, ", k, ")"));
                    ids[static_cast<std::size_t>(((dt + depth - 1) * oh + (dr + height - 1)) * ow + (dc + width - 1))] = id;
                }
        per_offset.push_back(std::move(ids));
    }
    return detail::assemble_bucket_ids(
        bucket_key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip, depth, p.storage}, p, per_offset);
}

/// @brief Largest |coordinate| of a per-token position (rpe::build_bucket_ids(m, positions, skip),
/// attention_inputs::positions): 2^20. The positions' bounding box is bounded further by its
/// per-offset ids ((2T−1)(2H−1)(2W−1) ≤ bucket_ids::max_bytes / 16).
inline constexpr std::int32_t max_position = std::int32_t{1} << 20;

namespace detail {

/// @brief Checks per-token positions: `p` is (N, axes) int32, N ≥ 1 (N = `tokens` when
/// `tokens` ≥ 0), contiguous, non-null, every |value| ≤ max_position. `what` names L − skip in
/// the shape message (e.g. "L - skip = 9 - 1"). Returns N.
/// @throws rpe::invalid_argument `[rpe.<component>] <name> has shape (...); expected (N, 2)
///   integer (row, col) coordinates ...`, `<name>[i, a] = v; expected |value| <= rpe::max_position = 1048576`.
inline std::int64_t check_positions(const tensor_ref<const std::int32_t>& p, int axes, std::int64_t tokens, const char* component,
                                    const char* name, const char* what = "tokens") {
    const char* coords = axes == 3 ? "(t, row, col) for a 3D mapping" : "(row, col) for a 2D mapping";
    const bool ok = p.rank == 2 && p.extent(1) == axes && p.extent(0) >= 1 && (tokens < 0 || p.extent(0) == tokens);
    if (!ok)
        throw invalid_argument(message(component, name, " has shape ", p.shape_string(), "; expected (",
                                       tokens < 0 ? std::string("N >= 1") : std::to_string(tokens) + " = " + what, ", ", axes,
                                       ") integer coordinates ", coords));
    check_nonnull(p, component, name);
    for (std::int64_t i = 0; i < p.extent(0) * axes; ++i) {
        const std::int32_t v = p.data[i];
        if (v > max_position || v < -max_position)
            throw invalid_argument(message(component, name, "[", i / axes, ", ", i % axes, "] = ", v,
                                           "; expected |value| <= rpe::max_position = ", max_position));
    }
    return p.extent(0);
}

/// @brief The bounding box of checked positions (queries and keys together) and each grid
/// token's linear position in its offset space (detail::id_positions).
struct position_plan {
    int depth = 1, height = 1, width = 1;  ///< the box T × H × W
    std::vector<std::int64_t> query, key;  ///< (N) linear positions; key empty: the queries'
};

/// @brief The box and linear positions of checked positions `q` and `k` (k empty: q) with
/// `axes` coordinates (2: row, col; 3: t, row, col).
/// @throws rpe::out_of_range `[rpe.bucket_ids] positions span a TxHxW box ...` when its
///   per-offset ids would exceed bucket_ids::max_bytes / 16.
inline position_plan plan_positions(const tensor_ref<const std::int32_t>& q, const tensor_ref<const std::int32_t>& k, int axes) {
    std::int64_t lo[3] = {0, 0, 0}, hi[3] = {0, 0, 0};
    bool first = true;
    for (const auto* p : {&q, &k}) {
        if (p->data == nullptr) continue;
        for (std::int64_t i = 0; i < p->extent(0); ++i)
            for (int a = 0; a < axes; ++a) {
                const std::int64_t v = p->data[i * axes + a], at = a + 3 - axes;  // 2D: axis 0 is t = 0
                lo[at] = first ? v : std::min(lo[at], v);
                hi[at] = first ? v : std::max(hi[at], v);
                if (a == axes - 1) first = false;
            }
    }
    const std::int64_t t = hi[0] - lo[0] + 1, h = hi[1] - lo[1] + 1, w = hi[2] - lo[2] + 1;
    if ((2 * t - 1) * (2 * h - 1) > bucket_ids::max_bytes / 16 / (2 * w - 1))
        throw out_of_range(
            message("bucket_ids", "positions span a ", t, "x", h, "x", w,
                    " box: its per-offset ids number (2T-1)(2H-1)(2W-1) = ", (2 * t - 1) * (2 * h - 1) * (2 * w - 1),
                    "; expected at most bucket_ids::max_bytes / 16 = ", bucket_ids::max_bytes / 16));
    position_plan plan;
    plan.depth = static_cast<int>(t);
    plan.height = static_cast<int>(h);
    plan.width = static_cast<int>(w);
    const std::int64_t plane = (2 * h - 1) * (2 * w - 1), row = 2 * w - 1;
    const auto linear = [&](const tensor_ref<const std::int32_t>& p) {
        std::vector<std::int64_t> out(static_cast<std::size_t>(p.extent(0)));
        for (std::int64_t i = 0; i < p.extent(0); ++i) {
            std::int64_t c[3] = {lo[0], 0, 0};
            for (int a = 0; a < axes; ++a) c[a + 3 - axes] = p.data[i * axes + a];
            out[static_cast<std::size_t>(i)] = (c[0] - lo[0]) * plane + (c[1] - lo[1]) * row + (c[2] - lo[2]);
        }
        return out;
    };
    plan.query = linear(q);
    if (k.data != nullptr) plan.key = linear(k);
    return plan;
}

/// @brief Checks the positions of an id build for mapping type M (2 axes, or 3 for a
/// Mapping3D), `key_positions` (empty: the queries'; else any count N_k ≥ 1, cross-attention)
/// and skip; returns the plan. @throws as build_bucket_ids(m, positions, key_positions, skip).
inline position_plan check_id_positions(const tensor_ref<const std::int32_t>& positions,
                                        const tensor_ref<const std::int32_t>& key_positions, int skip, int axes) {
    require(skip >= 0, "bucket_ids", "skip = ", skip, "; expected >= 0");
    const std::int64_t n = check_positions(positions, axes, -1, "bucket_ids", "positions");
    std::int64_t nk = n;
    if (key_positions.data != nullptr || key_positions.rank != 0)
        nk = check_positions(key_positions, axes, -1, "bucket_ids", "key_positions");
    if (skip + std::max(n, nk) > std::numeric_limits<int>::max())
        throw out_of_range(message("bucket_ids", "L = skip + N = ", skip, " + ", std::max(n, nk), "; expected L < 2^31"));
    return plan_positions(positions, key_positions.data != nullptr ? key_positions : tensor_ref<const std::int32_t>{}, axes);
}

/// @brief check_id_positions for mapping type M: 2 axes, or 3 for a Mapping3D.
template <GridMapping M>
position_plan check_id_positions(const tensor_ref<const std::int32_t>& positions,
                                 const tensor_ref<const std::int32_t>& key_positions, int skip) {
    return check_id_positions(positions, key_positions, skip, Mapping3D<M> ? 3 : 2);
}

}  // namespace detail

/// @brief Builds the bucket ids of mapping `m` for `skip` extra tokens followed by N tokens at
/// per-token integer positions, without any cache for the per-offset ids (prefer
/// bucket_cache::get(m, positions, skip), which shares them per mapping and bounding box).
///
/// `positions`: (N, 2) int32 (row, col) for a 2D mapping, (N, 3) (t, row, col) for a Mapping3D,
/// contiguous, in any order (repeats allowed); `key_positions`: the keys' (N_k, A), or empty for
/// the queries' (self-attention). N_k may differ from N (cross-attention): the ids are then
/// (L, L_k), L = skip + N queries by L_k = skip + N_k keys (bucket_ids::key_length()), the skip
/// tokens first in both, and equal the query rows and key columns of the self-attention ids over
/// both sets together. Id (i, j) of grid tokens is the mapping's id of the offset
/// `pos_i − kpos_j` (t, row, col); pairs touching an extra token get the extra ids, as on a
/// grid. Positions equal to a grid's coordinates (token skip + r·W + c at (r, c)) give that
/// grid's ids exactly; any translation of all positions gives the same ids.
/// Cost: the mapping once per offset of the positions' bounding box T × H × W, (2T−1)(2H−1)(2W−1)
/// calls and ids (what a T × H × W grid's on-the-fly ids hold), plus N linear positions; no
/// (L, L) table: every row is made when read, O(L) each (storage always on_the_fly).
/// @throws rpe::invalid_argument `[rpe.bucket_ids] positions has shape ...; expected (N >= 1, 2)
///   integer coordinates (row, col) for a 2D mapping` (also key_positions, a null or strided
///   buffer), `positions[i, a] = v; expected |value| <= rpe::max_position = 1048576`, skip < 0,
///   invalid mapping parameters, a box the mapping rejects (its validate_grid, e.g. larger than a
///   Swin window); rpe::out_of_range for L ≥ 2^31 or a box whose per-offset ids exceed
///   bucket_ids::max_bytes / 16, or as build_bucket_ids for a faulty custom mapping.
/// Thread-safety: reentrant.
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, tensor_ref<const std::int32_t> positions,
                                                   tensor_ref<const std::int32_t> key_positions, int skip) {
    detail::position_plan p = detail::check_id_positions<M>(positions, key_positions, skip);
    auto box = build_bucket_ids(m, p.depth, p.height, p.width, skip, id_storage::on_the_fly);
    return std::make_shared<const bucket_ids>(std::move(box), std::move(p.query), std::move(p.key));
}

/// @brief Ids at positions for a mapping known only at run time (a registry family): as
/// build_bucket_ids(m, positions, key_positions, skip) with `axes` coordinates per position (2, or
/// 3 for a 3D mapping), the bounding box's ids from `box(depth, height, width)` (any storage: only
/// their per-offset ids are read). @throws as build_bucket_ids and as `box`.
template <class BoxFn>
std::shared_ptr<const bucket_ids> bucket_ids_at_positions(tensor_ref<const std::int32_t> positions,
                                                          tensor_ref<const std::int32_t> key_positions, int skip, int axes,
                                                          BoxFn&& box) {
    detail::position_plan p = detail::check_id_positions(positions, key_positions, skip, axes);
    std::shared_ptr<const bucket_ids> ids = box(p.depth, p.height, p.width);
    return std::make_shared<const bucket_ids>(std::move(ids), std::move(p.query), std::move(p.key));
}

/// @brief Self-attention form: `build_bucket_ids(m, positions, {}, skip)` (keys at the queries' positions).
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, tensor_ref<const std::int32_t> positions, int skip) {
    return build_bucket_ids(m, positions, tensor_ref<const std::int32_t>{}, skip);
}

/// @brief 2D form: `build_bucket_ids(m, 1, height, width, skip, storage)`.
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, int height, int width, int skip,
                                                   id_storage storage = id_storage::automatic) {
    return build_bucket_ids(m, 1, height, width, skip, storage);
}

}  // namespace rpe
