/// @file detail/single_flight.hpp
/// @brief A thread-safe single-flight cache: concurrent requests for one missing key build it
/// once (the others wait for that build), different keys build in parallel, and a failed build
/// throws to every waiter and leaves no entry. Used by the host bucket cache and the device id
/// cache (not API: use rpe::bucket_cache).
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace rpe::detail {

/// @brief Key → shared value, each value built once by the first caller that asks for it.
/// Never evicts; clear() drops every entry (values already handed out stay valid when Value is
/// a shared pointer).
template <class Key, class Value, class Hash>
class single_flight_cache {
public:
    /// @brief The value of `key`, built with `build()` on first use. @throws what `build` throws
    /// (to this caller and every caller waiting for the same key).
    Value get_or_build(const Key& key, const std::function<Value()>& build) {
        std::promise<Value> promise;
        std::shared_future<Value> future;
        bool inserted = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = entries_.find(key);
            if (it != entries_.end()) {
                future = it->second;
            } else {
                future = promise.get_future().share();
                entries_.emplace(key, future);
                ++builds_;
                inserted = true;
            }
        }
        if (inserted) {  // this call builds; concurrent callers of the same key wait on `future`
            try {
                promise.set_value(build());
            } catch (...) {
                promise.set_exception(std::current_exception());
                std::lock_guard<std::mutex> lock(mutex_);
                entries_.erase(key);
                throw;
            }
        }
        return future.get();
    }
    /// @brief Number of entries held (a build in flight included).
    [[nodiscard]] std::size_t size() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return entries_.size();
    }
    /// @brief Number of builds started since construction (or the last clear).
    [[nodiscard]] std::size_t builds() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return builds_;
    }
    /// @brief Drops every entry.
    void clear() {
        std::lock_guard<std::mutex> lock(mutex_);
        entries_.clear();
        builds_ = 0;
    }

private:
    mutable std::mutex mutex_;
    std::unordered_map<Key, std::shared_future<Value>, Hash> entries_;
    std::size_t builds_ = 0;
};

}  // namespace rpe::detail
