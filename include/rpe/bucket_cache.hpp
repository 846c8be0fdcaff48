/// @file bucket_cache.hpp
/// @brief rpe::bucket_cache: the thread-safe single-flight cache of bucket ids that every term
/// and layer shares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "bucket_ids.hpp"
#include "bucket_key.hpp"
#include "build_bucket_ids.hpp"
#include "concepts.hpp"
#include "detail/single_flight.hpp"
#include "detail/validate.hpp"
#include "tensor.hpp"

namespace rpe {

/// @brief Thread-safe cache of bucket ids keyed by the whole configuration (mapping type and
/// value, height, width, skip). Every term and layer that asks for the same configuration gets
/// the same shared object; a new resolution at inference time simply adds an entry.
///
/// Concurrent `get`s of one missing key build it once (the others wait); different keys build
/// in parallel. A failed build throws to every waiter and leaves no entry.
///
/// Memory: the ids held count against a byte budget (bucket_ids::bytes(); default 64 MiB, or
/// `RPE_CACHE_BUDGET_MB`; set_budget()); past it the least recently used configurations are
/// dropped, so a process that sees many grid sizes stays bounded. Ids handed out stay valid
/// (shared ownership): a running call never loses its ids, and a dropped configuration is simply
/// built again on its next use. stats() gives hits, misses, evictions and the bytes held.
class bucket_cache {
public:
    /// @brief The ids of (m, depth, height, width, skip, storage), built on first use.
    /// `id_storage::automatic` is resolved first (table up to bucket_ids::auto_table_bytes), so it
    /// shares the entry of the storage it picks.
    /// @throws as build_bucket_ids.
    template <GridMapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, int depth, int height, int width, int skip, id_storage storage) {
        detail::require_enum(storage, 3, "bucket_ids", "storage", "automatic, table or on_the_fly");  // before the key
        detail::validate_policy(m);
        if (storage == id_storage::automatic && depth >= 1 && height >= 1 && width >= 1 && skip >= 0) {
            const std::int64_t n = skip + static_cast<std::int64_t>(depth) * height * width;
            const std::int64_t k = static_cast<std::int64_t>(m.num_buckets()) + (skip > 0 ? detail::skip_buckets_of<M>() : 0);
            storage = detail::automatic_storage(n, k, detail::num_tables_of<M>());
        }
        bucket_key key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip, depth, storage};
        return entries_.get_or_build(
            key, [&] { return build_bucket_ids(m, depth, height, width, skip, storage); },
            [](const std::shared_ptr<const bucket_ids>& ids) { return static_cast<std::size_t>(ids->bytes()); });
    }

    /// @brief 2D form: `get(m, 1, height, width, skip, storage)`.
    template <GridMapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, int height, int width, int skip,
                                          id_storage storage = id_storage::automatic) {
        return get(m, 1, height, width, skip, storage);
    }

    /// @brief The ids of mapping `m` for `skip` extra tokens followed by tokens at per-token
    /// positions (`key_positions`: the keys', or empty for the queries'), as
    /// build_bucket_ids(m, positions, key_positions, skip), with the per-offset ids of the
    /// positions' bounding box taken from this cache: one entry per (mapping, box T × H × W, skip),
    /// the entry of that grid's on-the-fly ids, shared by every layout of tokens in the same box.
    /// The returned object (the N linear positions) is not cached: a new layout adds no entry.
    /// @throws as build_bucket_ids(m, positions, key_positions, skip).
    template <GridMapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, tensor_ref<const std::int32_t> positions,
                                          tensor_ref<const std::int32_t> key_positions, int skip) {
        detail::validate_policy(m);  // before the positions, as the grid form
        detail::position_plan p = detail::check_id_positions<M>(positions, key_positions, skip);
        auto box = get(m, p.depth, p.height, p.width, skip, id_storage::on_the_fly);
        return std::make_shared<const bucket_ids>(std::move(box), std::move(p.query), std::move(p.key));
    }

    /// @brief Self-attention form: `get(m, positions, {}, skip)` (keys at the queries' positions).
    template <GridMapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, tensor_ref<const std::int32_t> positions, int skip) {
        return get(m, positions, tensor_ref<const std::int32_t>{}, skip);
    }

    /// @brief Number of configurations held.
    [[nodiscard]] std::size_t size() const { return entries_.size(); }
    /// @brief Number of builds started since construction (or the last clear): a hit builds nothing.
    [[nodiscard]] std::size_t builds() const { return entries_.builds(); }
    /// @brief Drops every entry and resets the counters (objects already handed out stay valid:
    /// they are shared).
    void clear() { entries_.clear(); }
    /// @brief Sets the byte budget of the ids held and drops least recently used entries down to it
    /// at once (0: keep nothing between calls).
    void set_budget(std::size_t bytes) { entries_.set_budget(bytes); }
    /// @brief The byte budget in force (default: detail::default_cache_budget()).
    [[nodiscard]] std::size_t budget() const { return entries_.budget(); }
    /// @brief Hits, misses, evictions since construction (or the last clear), entries and bytes held.
    [[nodiscard]] cache_stats stats() const { return entries_.stats(); }

    /// @brief The process-wide cache that terms use by default.
    static bucket_cache& global() {
        static bucket_cache cache;
        return cache;
    }

private:
    detail::single_flight_cache<bucket_key, std::shared_ptr<const bucket_ids>, bucket_key_hash> entries_;
};

}  // namespace rpe
