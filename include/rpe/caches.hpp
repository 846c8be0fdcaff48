/// @file caches.hpp
/// @brief The process-wide host caches as one: their byte budget and their counters, for a
/// long-lived process (a server, a training job that sees many image sizes).
///
/// rpe keeps what it builds per configuration in process-wide caches: the bucket ids
/// (rpe::bucket_cache::global(), keyed by mapping, grid and skip) and the fixed RoPE forms'
/// cos/sin tables (keyed by policy, head dim, grid and element type); the CUDA backend keeps
/// their device copies (rpe::cuda::set_cache_budget in <rpe/cuda.cuh>). Each cache holds at most
/// its byte budget — by default 64 MiB each, or `RPE_CACHE_BUDGET_MB` MiB from the environment
/// (read once) — and drops least recently used entries past it. An entry in use by a running call
/// is never freed under it (the call holds a shared reference); a dropped entry is built again on
/// its next use, with the same values.
#pragma once

#include <cstddef>

#include "bucket_cache.hpp"
#include "detail/single_flight.hpp"
#include "rope/rotary.hpp"

namespace rpe {

/// @brief What each host cache did and holds (hits, misses, evictions, entries, bytes, budget).
struct host_cache_stats {
    cache_stats bucket_ids;   ///< rpe::bucket_cache::global()
    cache_stats rope_tables;  ///< the fixed RoPE forms' cos/sin tables
};

/// @brief Sets the byte budget of every process-wide host cache (bucket ids, RoPE tables) and
/// drops least recently used entries down to it at once; 0 keeps nothing between calls.
/// Thread-safe; calls running meanwhile keep what they hold.
inline void set_cache_budget(std::size_t bytes) {
    bucket_cache::global().set_budget(bytes);
    detail::rope_cache().set_budget(bytes);
}

/// @brief The counters and holdings of the process-wide host caches. Thread-safe.
inline host_cache_stats cache_statistics() { return {bucket_cache::global().stats(), detail::rope_cache().stats()}; }

/// @brief Drops every entry of the process-wide host caches and resets their counters (budgets
/// stay). Values already handed out stay valid. Thread-safe.
inline void clear_caches() {
    bucket_cache::global().clear();
    detail::rope_cache().clear();
}

}  // namespace rpe
