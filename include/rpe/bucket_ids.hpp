/// @file bucket_ids.hpp
/// @brief Bucket ids of every (query, key) token pair of a grid, compact, built once and shared
/// through a thread-safe cache.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "concepts.hpp"
#include "error.hpp"

namespace rpe {

namespace detail {

/// @brief Type-erased mapping value, so one cache (and one id object) can hold any mapping.
struct mapping_key_base {
    virtual ~mapping_key_base() = default;
    [[nodiscard]] virtual bool equals(const mapping_key_base& other) const = 0;
    [[nodiscard]] virtual std::type_index type() const = 0;
};

template <Mapping M>
struct mapping_key final : mapping_key_base {
    M mapping;
    explicit mapping_key(const M& m) : mapping(m) {}
    [[nodiscard]] bool equals(const mapping_key_base& other) const override {
        const auto* o = dynamic_cast<const mapping_key<M>*>(&other);
        return o != nullptr && o->mapping == mapping;
    }
    [[nodiscard]] std::type_index type() const override { return typeid(M); }
};

}  // namespace detail

/// @brief The whole configuration that determines bucket ids: the mapping (its type, index
/// function and α, β, γ), the grid height and width, and the number of skip tokens.
struct bucket_key {
    std::shared_ptr<const detail::mapping_key_base> mapping;  ///< the mapping value, type-erased
    int height = 0;                                           ///< grid rows
    int width = 0;                                            ///< grid columns
    int skip = 0;                                             ///< extra tokens before the grid

    /// @brief True when the mapping (type and value), height, width and skip all match.
    [[nodiscard]] bool operator==(const bucket_key& o) const {
        return height == o.height && width == o.width && skip == o.skip && mapping && o.mapping &&
               mapping->equals(*o.mapping);
    }

    /// @brief True when this key was made from mapping `m` (same type and value).
    template <Mapping M>
    [[nodiscard]] bool holds(const M& m) const {
        return mapping && mapping->equals(detail::mapping_key<M>(m));
    }
};

/// @brief Hash of a bucket_key (mapping type, height, width, skip; equal mapping values of one
/// type share a hash and are told apart by `==`).
struct bucket_key_hash {
    std::size_t operator()(const bucket_key& k) const noexcept {
        std::size_t h = k.mapping ? k.mapping->type().hash_code() : 0;
        for (int v : {k.height, k.width, k.skip}) h = h * 1000003u ^ std::hash<int>{}(v);
        return h;
    }
};

/// @brief Bucket ids (L, L) of a grid, one matrix per table (two for Cross), row-major, entry
/// [i, j] for query token i and key token j, in the smallest unsigned type holding the largest id.
///
/// Ids run over `0..num_buckets()−1`; with `skip > 0` every pair that touches an extra token
/// (i < skip or j < skip) has the extra id `num_buckets()−1`. Id width: 1 byte when
/// `num_buckets() ≤ 256`, 2 when ≤ 65536, else 4. Immutable after construction; share it
/// freely between threads, terms and layers.
/// Source: reference `get_bucket_ids_2d` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
class bucket_ids {
public:
    /// @brief Largest total storage (all tables) the (L, L) builder accepts: 4 GiB.
    static constexpr std::int64_t max_bytes = std::int64_t{4} << 30;

    using storage = std::variant<std::vector<std::uint8_t>, std::vector<std::uint16_t>, std::vector<std::uint32_t>>;

    bucket_ids(bucket_key key, int num_buckets, std::vector<storage> tables)
        : key_(std::move(key)), num_buckets_(num_buckets), tables_(std::move(tables)) {}

    /// @brief The configuration these ids were built for.
    [[nodiscard]] const bucket_key& key() const { return key_; }
    [[nodiscard]] int height() const { return key_.height; }  ///< grid rows
    [[nodiscard]] int width() const { return key_.width; }    ///< grid columns
    [[nodiscard]] int skip() const { return key_.skip; }      ///< extra tokens
    /// @brief Sequence length `L = skip + height·width`.
    [[nodiscard]] int length() const { return key_.skip + key_.height * key_.width; }
    /// @brief Buckets per table, the extra skip bucket included (the table's K).
    [[nodiscard]] int num_buckets() const { return num_buckets_; }
    /// @brief Number of id matrices (1, or 2 for Cross).
    [[nodiscard]] int num_tables() const { return static_cast<int>(tables_.size()); }
    /// @brief Bytes per id: 1, 2 or 4.
    [[nodiscard]] int id_bytes() const {
        return std::visit([](const auto& v) { return static_cast<int>(sizeof(v[0])); }, tables_.at(0));
    }
    /// @brief Bytes of id storage, all tables.
    [[nodiscard]] std::int64_t bytes() const {
        return static_cast<std::int64_t>(tables_.size()) * length() * length() * id_bytes();
    }
    /// @brief Id of pair (i, j) in table `table`; bounds-checked.
    /// @throws rpe::out_of_range `[rpe.bucket_ids] ...` when an index is outside its range.
    [[nodiscard]] int at(int table, int i, int j) const {
        const int n = length();
        if (table < 0 || table >= num_tables() || i < 0 || i >= n || j < 0 || j >= n)
            throw out_of_range(detail::message("bucket_ids", "at(table = ", table, ", i = ", i, ", j = ", j,
                                               ") outside tables [0, ", num_tables(), ") x L = ", n));
        return std::visit([&](const auto& v) { return static_cast<int>(v[static_cast<std::size_t>(i) * n + j]); },
                          tables_[static_cast<std::size_t>(table)]);
    }
    /// @brief Calls `f(ids)` with `const Id*` pointing at table `table`'s (L, L) ids, Id the
    /// stored unsigned type; returns what f returns.
    template <class F>
    decltype(auto) visit(int table, F&& f) const {
        return std::visit([&](const auto& v) -> decltype(auto) { return f(v.data()); },
                          tables_.at(static_cast<std::size_t>(table)));
    }

private:
    bucket_key key_;
    int num_buckets_;
    std::vector<storage> tables_;
};

namespace detail {

template <class Id>
std::vector<Id> fill_ids(const std::vector<int>& offset_ids, int height, int width, int skip, int extra_id) {
    const std::int64_t n = skip + static_cast<std::int64_t>(height) * width;
    std::vector<Id> ids(static_cast<std::size_t>(n * n));
    const int ow = 2 * width - 1;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n > 256)
#endif
    for (std::int64_t i = 0; i < n; ++i) {
        Id* row = ids.data() + i * n;
        if (i < skip) {
            std::fill(row, row + n, static_cast<Id>(extra_id));
            continue;
        }
        std::fill(row, row + skip, static_cast<Id>(extra_id));
        const int ri = static_cast<int>((i - skip) / width), ci = static_cast<int>((i - skip) % width);
        for (int rj = 0; rj < height; ++rj) {
            // offsets (ri - rj, ci - cj) for cj = 0..width-1 run backwards through one offset row
            const int* src = offset_ids.data() + static_cast<std::size_t>(ri - rj + height - 1) * ow + (ci + width - 1);
            Id* dst = row + skip + static_cast<std::int64_t>(rj) * width;
            for (int cj = 0; cj < width; ++cj) dst[cj] = static_cast<Id>(src[-cj]);
        }
    }
    return ids;
}

}  // namespace detail

/// @brief Builds the bucket ids of mapping `m` on a `height × width` grid after `skip` extra
/// tokens, without any cache. Prefer bucket_cache::get, which builds each configuration once.
///
/// The mapping is evaluated once per offset (dr, dc) ∈ [−(H−1), H−1] × [−(W−1), W−1], then the
/// (L, L) matrices are gathered from that offset table: O((2H−1)(2W−1)) mapping calls + O(L²).
/// @throws rpe::invalid_argument `[rpe.bucket_ids] height = ...` for height < 1, width < 1,
///   skip < 0, or invalid mapping parameters (the mapping's `validate()`);
///   rpe::out_of_range when L overflows int, the storage would exceed bucket_ids::max_bytes,
///   or the mapping returns an id outside [0, num_buckets()) (a faulty custom mapping).
/// Thread-safety: reentrant. Source: reference `get_bucket_ids_2d` (SPEC §3).
template <Mapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, int height, int width, int skip) {
    detail::require(height >= 1, "bucket_ids", "height = ", height, "; expected >= 1");
    detail::require(width >= 1, "bucket_ids", "width = ", width, "; expected >= 1");
    detail::require(skip >= 0, "bucket_ids", "skip = ", skip, "; expected >= 0");
    detail::validate_policy(m);
    const std::int64_t n = skip + static_cast<std::int64_t>(height) * width;
    if (n > std::numeric_limits<int>::max())
        throw out_of_range(detail::message("bucket_ids", "L = skip + height*width = ", n, " for height = ", height,
                                           ", width = ", width, ", skip = ", skip, "; expected L < 2^31"));
    const std::int64_t k = static_cast<std::int64_t>(m.num_buckets());
    detail::require(k >= 1, "bucket_ids", "mapping num_buckets() = ", k, "; expected >= 1");
    const std::int64_t total = k + (skip > 0 ? 1 : 0);
    if (total - 1 > std::numeric_limits<std::uint32_t>::max() || total > std::numeric_limits<int>::max())
        throw out_of_range(detail::message("bucket_ids", "num_buckets = ", total, " does not fit the id type"));
    const int id_bytes = total <= 256 ? 1 : (total <= 65536 ? 2 : 4);
    constexpr int tables = detail::num_tables_of<M>();
    const std::int64_t bytes = n * n * id_bytes * tables;
    if (bytes > bucket_ids::max_bytes)
        throw out_of_range(detail::message("bucket_ids", "an (L, L) id matrix for L = ", n, " needs ", bytes,
                                           " bytes; expected at most bucket_ids::max_bytes = ", bucket_ids::max_bytes));

    const int oh = 2 * height - 1, ow = 2 * width - 1;
    std::vector<bucket_ids::storage> storage;
    for (int t = 0; t < tables; ++t) {
        std::vector<int> offset_ids(static_cast<std::size_t>(oh) * ow);
        for (int dr = -(height - 1); dr <= height - 1; ++dr)
            for (int dc = -(width - 1); dc <= width - 1; ++dc) {
                const int id = detail::bucket_of(m, dr, dc, t);
                if (id < 0 || id >= k)
                    throw out_of_range(detail::message("bucket_ids", "mapping returned bucket id ", id, " for offset (dr = ",
                                                       dr, ", dc = ", dc, ") in table ", t, "; expected [0, ", k, ")"));
                offset_ids[static_cast<std::size_t>(dr + height - 1) * ow + (dc + width - 1)] = id;
            }
        const int extra = static_cast<int>(k);
        if (id_bytes == 1)
            storage.emplace_back(detail::fill_ids<std::uint8_t>(offset_ids, height, width, skip, extra));
        else if (id_bytes == 2)
            storage.emplace_back(detail::fill_ids<std::uint16_t>(offset_ids, height, width, skip, extra));
        else
            storage.emplace_back(detail::fill_ids<std::uint32_t>(offset_ids, height, width, skip, extra));
    }
    bucket_key key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip};
    return std::make_shared<const bucket_ids>(std::move(key), static_cast<int>(total), std::move(storage));
}

/// @brief Thread-safe cache of bucket ids keyed by the whole configuration (mapping type and
/// value, height, width, skip). Every term and layer that asks for the same configuration gets
/// the same shared object; a new resolution at inference time simply adds an entry.
///
/// Concurrent `get`s of one missing key build it once (the others wait); different keys build
/// in parallel. A failed build throws to every waiter and leaves no entry.
class bucket_cache {
public:
    /// @brief The ids of (m, height, width, skip), built on first use.
    /// @throws as build_bucket_ids.
    template <Mapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, int height, int width, int skip) {
        detail::validate_policy(m);
        bucket_key key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip};
        std::promise<std::shared_ptr<const bucket_ids>> promise;
        std::shared_future<std::shared_ptr<const bucket_ids>> future;
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
                promise.set_value(build_bucket_ids(m, height, width, skip));
            } catch (...) {
                promise.set_exception(std::current_exception());
                std::lock_guard<std::mutex> lock(mutex_);
                entries_.erase(key);
                throw;
            }
        }
        return future.get();
    }

    /// @brief Number of configurations held.
    [[nodiscard]] std::size_t size() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return entries_.size();
    }
    /// @brief Number of builds started since construction (or the last clear): a hit builds nothing.
    [[nodiscard]] std::size_t builds() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return builds_;
    }
    /// @brief Drops every entry (objects already handed out stay valid: they are shared).
    void clear() {
        std::lock_guard<std::mutex> lock(mutex_);
        entries_.clear();
        builds_ = 0;
    }

    /// @brief The process-wide cache that terms use by default.
    static bucket_cache& global() {
        static bucket_cache cache;
        return cache;
    }

private:
    mutable std::mutex mutex_;
    std::unordered_map<bucket_key, std::shared_future<std::shared_ptr<const bucket_ids>>, bucket_key_hash> entries_;
    std::size_t builds_ = 0;
};

}  // namespace rpe
