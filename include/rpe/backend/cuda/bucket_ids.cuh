/// @file backend/cuda/bucket_ids.cuh
/// @brief Bucket ids on the device: the per-offset ids of an rpe::bucket_ids uploaded once per
/// (configuration, device); kernels compute the id of pair (i, j) from them with the offset math
/// the host uses (detail/offset_math.hpp). No (L, L) id buffer exists on the device, whatever
/// the host storage.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../bucket_ids.hpp"
#include "../../detail/offset_math.hpp"
#include "../../detail/single_flight.hpp"
#include "error.cuh"

namespace rpe::cuda {

/// @brief Throws rpe::not_supported `[rpe.bucket_ids] bucket ids at per-token positions (N
/// positions) are not a grid's: the device id cache uploads a grid's per-offset ids; expected
/// their bounding box's ids (bucket_ids::box()) ...` for host ids built from positions
/// (bucket_ids::at_positions()): device_bucket_ids holds per-offset ids only, and the CUDA terms
/// and attention upload the box's (cached) and the linear positions (per call) themselves.
/// Called before any CUDA call.
inline void refuse_positions(const rpe::bucket_ids& host) {
    if (host.at_positions())
        throw not_supported(detail::message("bucket_ids", "bucket ids at per-token positions (", host.grid_string(),
                                            ") are not a grid's: the device id cache uploads a grid's per-offset ids; "
                                            "expected their bounding box's ids (bucket_ids::box())"));
}

/// @brief The ids of one table on the device as a function of the token pair: `ids(i, j)` is
/// id(i, j), or with `transposed` id(j, i) (the query target's order), computed from the
/// per-offset ids `offsets` (device memory, compact type Id) and the grid; with `pos.query` set
/// (tokens at per-token positions) from the bounding box's per-offset ids and the tokens' linear
/// positions in it (device memory) through detail::position_id, as bucket_ids::at. Trivially
/// copyable: passed to kernels by value.
template <class Id>
struct device_id_view {
    const Id* offsets = nullptr;  ///< (2T−1)(2H−1)(2W−1) per-offset ids, device memory
    detail::id_grid grid{};       ///< frames, rows, columns, skip, extra id (at positions: the box's)
    bool transposed = false;      ///< true: ids(i, j) = id(j, i)
    detail::id_positions pos{};   ///< at positions: (N) query and key linear positions, device memory; else null

    /// @brief Id of pair (i, j) in this view's orientation, in [0, K).
    RPE_HOST_DEVICE std::int64_t operator()(std::int64_t i, std::int64_t j) const {
        const std::int64_t a = transposed ? j : i, b = transposed ? i : j;
        // at positions the query target's id of (i, j) is that of offset kpos_j − qpos_i (pos.swapped())
        return pos.query ? detail::position_id(grid, transposed ? pos.swapped() : pos, offsets, a, b) : grid.id(offsets, a, b);
    }
};

/// @brief Device copy of an rpe::bucket_ids: per table its per-offset ids ((2T−1)(2H−1)(2W−1)
/// entries in the host object's compact type, 1, 2 or 4 bytes) and the grid; kernels read ids
/// through device_id_view. Immutable; owns its device memory (freed when the last shared owner
/// goes away). Device bytes: O(T·H·W) per table, also for grids whose (L, L) ids the host
/// computes on the fly. Source: reference `get_bucket_ids_2d`, via the host ids.
class device_bucket_ids {
public:
    /// @brief Uploads the per-offset ids of `host` to the current device on `stream` and waits
    /// for that copy (the object is then usable from any stream). `id_bytes` > host.id_bytes()
    /// widens the ids to that width (1, 2 or 4), so that every table of one call shares one id
    /// type; 0 keeps the host's width.
    /// @throws rpe::cuda_error when an allocation or copy fails; rpe::invalid_argument for a
    ///   width other than 0, 1, 2 or 4; rpe::not_supported for ids at positions (refuse_positions:
    ///   upload their box() instead).
    device_bucket_ids(const rpe::bucket_ids& host, cudaStream_t stream, int id_bytes = 0)
        : length_(host.length()),
          num_buckets_(host.num_buckets()),
          num_tables_(host.num_tables()),
          id_bytes_(std::max(host.id_bytes(), id_bytes)),
          grid_(host.grid()) {
        refuse_positions(host);
        RPE_CUDA_CHECK(cudaGetDevice(&device_));
        try {
            for (int t = 0; t < num_tables_; ++t) {
                host.visit_offsets(t, [&](const auto* off, std::size_t count) {
                    visit_id_width(id_bytes_, [&]<class Id>() {
                        using HostId = std::remove_cvref_t<decltype(*off)>;
                        std::vector<Id> wide;  // the ids at the wider width, when asked
                        const void* src = off;
                        if constexpr (!std::is_same_v<HostId, Id>) {
                            wide.assign(off, off + count);
                            src = wide.data();
                        }
                        const std::size_t bytes = count * sizeof(Id);
                        void* p = nullptr;
                        RPE_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
                        buffers_.push_back(p);
                        offset_bytes_ += static_cast<std::int64_t>(bytes);
                        // the host ids stay alive in the caller, but they are pageable memory: wait for
                        // the copy (once per configuration and device; a cache hit never synchronises)
                        RPE_CUDA_CHECK(cudaMemcpyAsync(p, src, bytes, cudaMemcpyHostToDevice, stream));
                        RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
                    });
                });
            }
        } catch (...) {
            release();
            throw;
        }
    }
    device_bucket_ids(const device_bucket_ids&) = delete;
    device_bucket_ids& operator=(const device_bucket_ids&) = delete;
    ~device_bucket_ids() { release(); }

    [[nodiscard]] int length() const { return length_; }                 ///< L
    [[nodiscard]] int num_buckets() const { return num_buckets_; }       ///< K, extra bucket included
    [[nodiscard]] int num_tables() const { return num_tables_; }         ///< 1, or 2 for Cross
    [[nodiscard]] int id_bytes() const { return id_bytes_; }             ///< 1, 2 or 4
    [[nodiscard]] int device() const { return device_; }                 ///< the CUDA device holding the ids
    [[nodiscard]] const detail::id_grid& grid() const { return grid_; }  ///< grid and extra id
    /// @brief Device bytes held: the per-offset ids of every table.
    [[nodiscard]] std::int64_t bytes() const { return offset_bytes_; }

    /// @brief Calls `f(device_id_view<Id>)` with the view of table `table`'s ids — `id(i, j)`,
    /// or `id(j, i)` when `transposed` — Id the compact unsigned type; returns what f returns.
    template <class F>
    decltype(auto) visit(int table, bool transposed, F&& f) const {
        const void* p = buffers_.at(static_cast<std::size_t>(table));
        return visit_id_width(id_bytes_, [&]<class Id>() -> decltype(auto) {
            return f(device_id_view<Id>{static_cast<const Id*>(p), grid_, transposed});
        });
    }
    /// @brief As visit(table, transposed, f) for tokens at per-token positions: the view reads these
    /// per-offset ids (the positions' bounding box's) at the linear positions `pos` (device memory,
    /// N each; detail::position_id), `grid` giving skip and the extra ids (the host ids' grid()).
    template <class F>
    decltype(auto) visit(int table, bool transposed, const detail::id_grid& grid, const detail::id_positions& pos, F&& f) const {
        const void* p = buffers_.at(static_cast<std::size_t>(table));
        return visit_id_width(id_bytes_, [&]<class Id>() -> decltype(auto) {
            return f(device_id_view<Id>{static_cast<const Id*>(p), grid, transposed, pos});
        });
    }
    /// @brief Table `table`'s per-offset ids (device memory; type by id_bytes()).
    [[nodiscard]] const void* offsets(int table) const { return buffers_.at(static_cast<std::size_t>(table)); }

private:
    void release() noexcept {
        for (void* p : buffers_) (void)cudaFree(p);  // errors at process exit (runtime unloaded) are ignored
        buffers_.clear();
    }

    int length_, num_buckets_, num_tables_, id_bytes_;
    detail::id_grid grid_;
    int device_ = 0;
    std::int64_t offset_bytes_ = 0;
    std::vector<void*> buffers_;
};

/// @brief Thread-safe cache of device bucket ids keyed by (bucket_key, device): every term and
/// call that uses one configuration on one device shares one upload.
///
/// A miss uploads the host ids and waits for that copy on the caller's stream (once per
/// configuration and device; concurrent misses of one key upload once, through the same
/// single-flight cache as the host ids); a hit does no CUDA call beyond cudaGetDevice.
class device_bucket_cache {
public:
    /// @brief The device ids of `host` on the current device, uploaded on first use, at least
    /// `id_bytes` wide (0: the host's width; see device_bucket_ids).
    /// @throws rpe::cuda_error when the device query, allocation or copy fails; rpe::not_supported
    ///   `[rpe.bucket_ids] bucket ids at per-token positions (N positions) are not a grid's ...`
    ///   for ids built from positions (bucket_ids::at_positions(); pass their box()), before any
    ///   CUDA call.
    std::shared_ptr<const device_bucket_ids> get(const rpe::bucket_ids& host, cudaStream_t stream = nullptr, int id_bytes = 0) {
        refuse_positions(host);
        int device = 0;
        RPE_CUDA_CHECK(cudaGetDevice(&device));
        const entry_key key{host.key(), device, std::max(host.id_bytes(), id_bytes)};
        return entries_.get_or_build(
            key, [&] { return std::make_shared<const device_bucket_ids>(host, stream, id_bytes); },
            [](const std::shared_ptr<const device_bucket_ids>& ids) { return static_cast<std::size_t>(ids->bytes()); });
    }
    /// @brief Number of (configuration, device) entries held.
    [[nodiscard]] std::size_t size() const { return entries_.size(); }
    /// @brief Uploads since construction (or the last clear).
    [[nodiscard]] std::size_t builds() const { return entries_.builds(); }
    /// @brief Drops every entry (objects already handed out stay valid).
    void clear() { entries_.clear(); }
    /// @brief Sets the byte budget of the device ids held (least recently used dropped past it).
    void set_budget(std::size_t bytes) { entries_.set_budget(bytes); }
    /// @brief The byte budget in force (default: detail::default_cache_budget()).
    [[nodiscard]] std::size_t budget() const { return entries_.budget(); }
    /// @brief Hits, misses, evictions, entries and device bytes held.
    [[nodiscard]] cache_stats stats() const { return entries_.stats(); }
    /// @brief The process-wide cache that CUDA terms and the fused attention use.
    static device_bucket_cache& global() {
        static device_bucket_cache cache;
        return cache;
    }

private:
    struct entry_key {
        bucket_key key;
        int device = 0;
        int id_bytes = 1;
        bool operator==(const entry_key& o) const { return device == o.device && id_bytes == o.id_bytes && key == o.key; }
    };
    struct entry_hash {
        std::size_t operator()(const entry_key& k) const noexcept {
            return (bucket_key_hash{}(k.key) * 31u ^ std::hash<int>{}(k.device)) * 31u ^ std::hash<int>{}(k.id_bytes);
        }
    };
    detail::single_flight_cache<entry_key, std::shared_ptr<const device_bucket_ids>, entry_hash> entries_;
};

}  // namespace rpe::cuda
