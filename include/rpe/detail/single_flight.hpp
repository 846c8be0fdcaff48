/// @file detail/single_flight.hpp
/// @brief A thread-safe single-flight cache with a byte budget: concurrent requests for one
/// missing key build it once (the others wait for that build), different keys build in
/// parallel, a failed build throws to every waiter and leaves no entry, and the least recently
/// used entries are dropped when the held bytes exceed the budget. Used by the host bucket cache,
/// the RoPE table caches and the device caches (not API: use rpe::bucket_cache and its peers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace rpe {

/// @brief What a cache did since it was made (or since its last clear()), and what it holds now:
/// for monitoring a long-lived process. Read with `stats()` of rpe::bucket_cache and its peers.
struct cache_stats {
    std::size_t hits = 0;       ///< lookups that found their entry (built, or being built by another call)
    std::size_t misses = 0;     ///< lookups that built their entry (every build, a failed one included)
    std::size_t evictions = 0;  ///< entries dropped to stay within the budget
    std::size_t entries = 0;    ///< entries held now (builds in flight included)
    std::size_t bytes = 0;      ///< bytes held now by the finished entries
    std::size_t budget = 0;     ///< the byte budget in force
};

namespace detail {

/// @brief The default byte budget of each of rpe's caches: 64 MiB (the largest (L, L) id table
/// that id_storage::automatic keeps), or the environment variable `RPE_CACHE_BUDGET_MB` (a whole
/// number of MiB up to 2^40, read once per process; 0 keeps nothing between calls). Any other
/// value (signs, spaces, hex, beyond 2^40) is ignored: the default applies.
inline std::size_t default_cache_budget() {
    static const std::size_t budget = [] {
        constexpr std::size_t fallback = std::size_t{64} << 20;
        const char* env = std::getenv("RPE_CACHE_BUDGET_MB");
        if (env == nullptr || *env == '\0') return fallback;
        std::size_t mb = 0;
        for (const char* p = env; *p != '\0'; ++p) {
            if (*p < '0' || *p > '9' || mb > (std::size_t{1} << 40)) return fallback;
            mb = mb * 10 + static_cast<std::size_t>(*p - '0');
        }
        return mb << 20;
    }();
    return budget;
}

/// @brief Key → shared value, each value built once by the first caller that asks for it, the
/// values together held within a byte budget (least recently used out first).
///
/// A value handed out stays valid after its entry is evicted or cleared when Value is a shared
/// pointer (the cache only drops its own reference), so a running call never loses what it uses.
/// Builds run outside the lock: a call waits only for a build of its own key, never for another
/// key's build or an eviction. An entry larger than the whole budget is handed to its caller and
/// not kept (the entries held stay). Thread-safe.
template <class Key, class Value, class Hash>
class single_flight_cache {
public:
    /// @brief The size of a value in bytes, for the budget.
    using bytes_function = std::function<std::size_t(const Value&)>;

    /// @brief An empty cache with the given budget (default: default_cache_budget()).
    explicit single_flight_cache(std::size_t budget = default_cache_budget()) : budget_(budget) {}

    /// @brief The value of `key`, built with `build()` on first use; `bytes_of(value)` is what it
    /// counts against the budget (0 when not given).
    /// @throws what `build` throws (to this caller and every caller waiting for the same key).
    Value get_or_build(const Key& key, const std::function<Value()>& build, const bytes_function& bytes_of = {}) {
        std::promise<Value> promise;
        std::shared_future<Value> future;
        std::uint64_t ticket = 0;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = entries_.find(key);
            if (it != entries_.end()) {
                ++hits_;
                lru_.splice(lru_.begin(), lru_, it->second.lru);  // most recently used first
                future = it->second.value;
            } else {
                future = promise.get_future().share();
                lru_.push_front(key);
                ticket = ++tickets_;
                entries_.emplace(key, entry{future, 0, false, ticket, lru_.begin()});
                ++misses_;
            }
        }
        if (ticket != 0) {  // this call builds; concurrent callers of the same key wait on `future`
            Value value;
            try {
                value = build();
            } catch (...) {
                promise.set_exception(std::current_exception());
                std::lock_guard<std::mutex> lock(mutex_);
                erase_if_mine(key, ticket);
                throw;
            }
            const std::size_t bytes = bytes_of ? bytes_of(value) : 0;
            promise.set_value(value);
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = entries_.find(key);
            if (it != entries_.end() && it->second.ticket == ticket) {  // not cleared meanwhile
                if (bytes > budget_) {  // larger than the whole budget: handed out, not kept (the others stay)
                    ++evictions_;
                    lru_.erase(it->second.lru);
                    entries_.erase(it);
                } else {
                    it->second.ready = true;
                    it->second.bytes = bytes;
                    bytes_ += bytes;
                    evict_over_budget();
                }
            }
            return value;
        }
        return future.get();
    }

    /// @brief Sets the byte budget and evicts at once down to it.
    void set_budget(std::size_t bytes) {
        std::lock_guard<std::mutex> lock(mutex_);
        budget_ = bytes;
        evict_over_budget();
    }
    /// @brief The byte budget in force.
    [[nodiscard]] std::size_t budget() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return budget_;
    }
    /// @brief Counters and current holdings (see rpe::cache_stats).
    [[nodiscard]] cache_stats stats() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return {hits_, misses_, evictions_, entries_.size(), bytes_, budget_};
    }
    /// @brief Number of entries held (a build in flight included).
    [[nodiscard]] std::size_t size() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return entries_.size();
    }
    /// @brief Number of builds started since construction (or the last clear).
    [[nodiscard]] std::size_t builds() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return misses_;
    }
    /// @brief Drops every entry and resets the counters (the budget stays). Builds in flight
    /// finish for their callers and are not kept.
    void clear() {
        std::lock_guard<std::mutex> lock(mutex_);
        entries_.clear();
        lru_.clear();
        bytes_ = 0;
        hits_ = misses_ = evictions_ = 0;
    }

private:
    struct entry {
        std::shared_future<Value> value;
        std::size_t bytes = 0;
        bool ready = false;    // built (in flight entries are never evicted: their bytes are unknown)
        std::uint64_t ticket;  // which build made it (a clear() and a new build of the key make another)
        typename std::list<Key>::iterator lru;
    };

    // Drops least recently used finished entries while the bytes held exceed the budget.
    void evict_over_budget() {
        for (auto pos = lru_.end(); bytes_ > budget_ && pos != lru_.begin();) {
            --pos;
            auto it = entries_.find(*pos);
            if (!it->second.ready) continue;
            bytes_ -= it->second.bytes;
            ++evictions_;
            pos = lru_.erase(pos);
            entries_.erase(it);
        }
    }

    void erase_if_mine(const Key& key, std::uint64_t ticket) {
        auto it = entries_.find(key);
        if (it == entries_.end() || it->second.ticket != ticket) return;
        lru_.erase(it->second.lru);
        entries_.erase(it);
    }

    mutable std::mutex mutex_;
    std::unordered_map<Key, entry, Hash> entries_;
    std::list<Key> lru_;  // most recently used first
    std::size_t budget_;
    std::size_t bytes_ = 0;
    std::size_t hits_ = 0, misses_ = 0, evictions_ = 0;
    std::uint64_t tickets_ = 0;
};

}  // namespace detail
}  // namespace rpe
