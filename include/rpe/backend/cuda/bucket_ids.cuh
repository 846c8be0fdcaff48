/// @file backend/cuda/bucket_ids.cuh
/// @brief Bucket ids on the device: a device copy of rpe::bucket_ids (compact ids, plus the
/// transposed matrix that the query target reads), cached per (configuration, device).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../bucket_id_set.hpp"
#include "../../detail/single_flight.hpp"
#include "error.cuh"

namespace rpe::cuda {

/// @brief Device copy of an rpe::bucket_ids: per table the (L, L) ids `id(i, j)` at [i, j] and
/// the transposed (L, L) ids `id(j, i)` at [i, j] (query target, coalesced reads), in the host
/// object's compact type (1, 2 or 4 bytes). Immutable; owns its device memory (freed when the
/// last shared owner goes away). Source: reference `get_bucket_ids_2d`, via the host ids.
class device_bucket_ids {
public:
    /// @brief Uploads `host` to the current device on `stream` and waits for that copy (the
    /// object is then usable from any stream).
    /// @throws rpe::cuda_error when an allocation or copy fails.
    device_bucket_ids(const rpe::bucket_ids& host, cudaStream_t stream)
        : length_(host.length()), num_buckets_(host.num_buckets()), num_tables_(host.num_tables()),
          id_bytes_(host.id_bytes()) {
        RPE_CUDA_CHECK(cudaGetDevice(&device_));
        const std::int64_t n = length_;
        const std::size_t bytes = static_cast<std::size_t>(n * n) * static_cast<std::size_t>(id_bytes_);
        try {
            for (int t = 0; t < num_tables_; ++t) {
                for (int transposed = 0; transposed < 2; ++transposed) {
                    void* p = nullptr;
                    RPE_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
                    buffers_.push_back(p);
                }
                auto upload = [&](auto id_type) {
                    using Id = decltype(id_type);
                    // rows() gives the (L, L) ids in both orders for table and on-the-fly host ids
                    std::vector<Id> buf(static_cast<std::size_t>(n * n));
                    for (int transposed = 0; transposed < 2; ++transposed) {
                        const Id* ids = host.rows<Id>(t, 0, n, transposed == 1, buf.data());
                        RPE_CUDA_CHECK(cudaMemcpyAsync(buffers_[2 * t + transposed], ids, bytes, cudaMemcpyHostToDevice, stream));
                        // `buf` is pageable host memory reused and then freed: wait for the copy
                        // (once per configuration and device; a cache hit never synchronises).
                        RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
                    }
                };
                if (id_bytes_ == 1)
                    upload(std::uint8_t{});
                else if (id_bytes_ == 2)
                    upload(std::uint16_t{});
                else
                    upload(std::uint32_t{});
            }
        } catch (...) {
            release();
            throw;
        }
    }
    device_bucket_ids(const device_bucket_ids&) = delete;
    device_bucket_ids& operator=(const device_bucket_ids&) = delete;
    ~device_bucket_ids() { release(); }

    [[nodiscard]] int length() const { return length_; }        ///< L
    [[nodiscard]] int num_buckets() const { return num_buckets_; }  ///< K, extra bucket included
    [[nodiscard]] int num_tables() const { return num_tables_; }    ///< 1, or 2 for Cross
    [[nodiscard]] int id_bytes() const { return id_bytes_; }        ///< 1, 2 or 4
    [[nodiscard]] int device() const { return device_; }            ///< the CUDA device holding the ids
    /// @brief Device bytes held (both orientations, all tables).
    [[nodiscard]] std::int64_t bytes() const {
        return std::int64_t{2} * num_tables_ * length_ * static_cast<std::int64_t>(length_) * id_bytes_;
    }

    /// @brief Calls `f(const Id*)` with the device pointer of table `table`'s (L, L) ids —
    /// `id(i, j)` at [i, j], or `id(j, i)` when `transposed` — Id the compact unsigned type.
    template <class F>
    decltype(auto) visit(int table, bool transposed, F&& f) const {
        const void* p = buffers_.at(static_cast<std::size_t>(2 * table + (transposed ? 1 : 0)));
        if (id_bytes_ == 1) return f(static_cast<const std::uint8_t*>(p));
        if (id_bytes_ == 2) return f(static_cast<const std::uint16_t*>(p));
        return f(static_cast<const std::uint32_t*>(p));
    }

private:
    void release() noexcept {
        for (void* p : buffers_) (void)cudaFree(p);  // errors at process exit (runtime unloaded) are ignored
        buffers_.clear();
    }

    int length_, num_buckets_, num_tables_, id_bytes_;
    int device_ = 0;
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
    /// @brief The device ids of `host` on the current device, uploaded on first use.
    /// @throws rpe::cuda_error when the device query, allocation or copy fails.
    std::shared_ptr<const device_bucket_ids> get(const rpe::bucket_ids& host, cudaStream_t stream = nullptr) {
        int device = 0;
        RPE_CUDA_CHECK(cudaGetDevice(&device));
        const entry_key key{host.key(), device};
        return entries_.get_or_build(key, [&] { return std::make_shared<const device_bucket_ids>(host, stream); });
    }
    /// @brief Number of (configuration, device) entries held.
    [[nodiscard]] std::size_t size() const { return entries_.size(); }
    /// @brief Uploads since construction (or the last clear).
    [[nodiscard]] std::size_t builds() const { return entries_.builds(); }
    /// @brief Drops every entry (objects already handed out stay valid).
    void clear() { entries_.clear(); }
    /// @brief The process-wide cache that CUDA terms and the fused attention use.
    static device_bucket_cache& global() {
        static device_bucket_cache cache;
        return cache;
    }

private:
    struct entry_key {
        bucket_key key;
        int device = 0;
        bool operator==(const entry_key& o) const { return device == o.device && key == o.key; }
    };
    struct entry_hash {
        std::size_t operator()(const entry_key& k) const noexcept {
            return bucket_key_hash{}(k.key) * 31u ^ std::hash<int>{}(k.device);
        }
    };
    detail::single_flight_cache<entry_key, std::shared_ptr<const device_bucket_ids>, entry_hash> entries_;
};

}  // namespace rpe::cuda
