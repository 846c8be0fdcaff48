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
#include <string>
#include <type_traits>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "concepts.hpp"
#include "detail/validate.hpp"
#include "error.hpp"

namespace rpe {

namespace detail {

/// @brief Type-erased mapping value, so one cache (and one id object) can hold any mapping.
struct mapping_key_base {
    virtual ~mapping_key_base() = default;
    [[nodiscard]] virtual bool equals(const mapping_key_base& other) const = 0;
    [[nodiscard]] virtual std::type_index type() const = 0;
};

template <GridMapping M>
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

/// @brief How a bucket_ids object holds its ids.
enum class id_storage {
    automatic,   ///< `table` while the (L, L) matrices fit bucket_ids::auto_table_bytes, else `on_the_fly`
    table,       ///< (L, L) id matrices; refused beyond bucket_ids::max_bytes
    on_the_fly,  ///< only the per-offset ids, O(T·H·W) memory; each row of ids is made when read
};

/// @brief The whole configuration that determines bucket ids: the mapping (its type, index
/// function and α, β, γ), the grid depth, height and width, the number of skip tokens, and the
/// storage (never `automatic` in a built object's key).
struct bucket_key {
    std::shared_ptr<const detail::mapping_key_base> mapping;  ///< the mapping value, type-erased
    int height = 0;                                           ///< grid rows
    int width = 0;                                            ///< grid columns
    int skip = 0;                                             ///< extra tokens before the grid
    int depth = 1;                                            ///< grid frames (3D mappings; 1 for images)
    id_storage storage = id_storage::table;                   ///< how the ids are held

    /// @brief True when the mapping (type and value), depth, height, width, skip and storage all match.
    [[nodiscard]] bool operator==(const bucket_key& o) const {
        return height == o.height && width == o.width && skip == o.skip && depth == o.depth && storage == o.storage &&
               mapping && o.mapping && mapping->equals(*o.mapping);
    }

    /// @brief True when this key was made from mapping `m` (same type and value).
    template <GridMapping M>
    [[nodiscard]] bool holds(const M& m) const {
        return mapping && mapping->equals(detail::mapping_key<M>(m));
    }
};

/// @brief Hash of a bucket_key (mapping type, sizes, storage; equal mapping values of one type
/// share a hash and are told apart by `==`).
struct bucket_key_hash {
    std::size_t operator()(const bucket_key& k) const noexcept {
        std::size_t h = k.mapping ? k.mapping->type().hash_code() : 0;
        for (int v : {k.height, k.width, k.skip, k.depth, static_cast<int>(k.storage)}) h = h * 1000003u ^ std::hash<int>{}(v);
        return h;
    }
};

/// @brief Bucket ids of every (query, key) token pair of a grid, one id set per table (two for
/// Cross), in the smallest unsigned type holding the largest id.
///
/// Tokens: `skip` extra tokens, then the grid in row-major order (frame t, row r, column c:
/// token `skip + (t·H + r)·W + c`); `L = skip + T·H·W`. Id (i, j) of query token i and key token
/// j is the mapping's id of the offset (t_i − t_j, r_i − r_j, c_i − c_j); with `skip > 0` every pair
/// that touches an extra token (i < skip or j < skip) has the extra id `num_buckets()−1`.
/// Id width: 1 byte when `num_buckets() ≤ 256`, 2 when ≤ 65536, else 4.
///
/// Storage: every object holds the per-offset ids ((2T−1)(2H−1)(2W−1) per table); `table`
/// storage also holds the (L, L) matrices, `on_the_fly` makes each row when a kernel reads it
/// (O(L) per row, the same order as reading a stored row), so grids of any size need no L² memory.
/// Immutable after construction; share it freely between threads, terms and layers.
/// Source: reference `get_bucket_ids_2d` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py` (2D).
class bucket_ids {
public:
    /// @brief Largest (L, L) storage (all tables) that `id_storage::table` accepts: 4 GiB.
    static constexpr std::int64_t max_bytes = std::int64_t{4} << 30;
    /// @brief Largest (L, L) storage that `id_storage::automatic` keeps as a table: 64 MiB
    /// (L ≤ 8192 with 1-byte ids); larger grids get on-the-fly ids.
    static constexpr std::int64_t auto_table_bytes = std::int64_t{64} << 20;

    using storage = std::variant<std::vector<std::uint8_t>, std::vector<std::uint16_t>, std::vector<std::uint32_t>>;

    /// @brief Assembles ids (use build_bucket_ids or bucket_cache::get instead). `offsets`: one
    /// per-offset id array per table; `tables`: the (L, L) matrices, empty for on-the-fly storage.
    bucket_ids(bucket_key key, int num_buckets, std::vector<storage> offsets, std::vector<storage> tables)
        : key_(std::move(key)), num_buckets_(num_buckets), offsets_(std::move(offsets)), tables_(std::move(tables)) {}

    /// @brief The configuration these ids were built for.
    [[nodiscard]] const bucket_key& key() const { return key_; }
    [[nodiscard]] int depth() const { return key_.depth; }    ///< grid frames (1 for images)
    [[nodiscard]] int height() const { return key_.height; }  ///< grid rows
    [[nodiscard]] int width() const { return key_.width; }    ///< grid columns
    [[nodiscard]] int skip() const { return key_.skip; }      ///< extra tokens
    /// @brief The grid as text: "HxW", or "TxHxW" when depth > 1.
    [[nodiscard]] std::string grid_string() const {
        return (key_.depth > 1 ? std::to_string(key_.depth) + "x" : std::string()) + std::to_string(key_.height) + "x" +
               std::to_string(key_.width);
    }
    /// @brief Sequence length `L = skip + depth·height·width`.
    [[nodiscard]] int length() const { return key_.skip + key_.depth * key_.height * key_.width; }
    /// @brief Buckets per table, the extra skip bucket included (the table's K).
    [[nodiscard]] int num_buckets() const { return num_buckets_; }
    /// @brief Number of id sets (1, or 2 for Cross).
    [[nodiscard]] int num_tables() const { return static_cast<int>(offsets_.size()); }
    /// @brief `id_storage::table` or `id_storage::on_the_fly`.
    [[nodiscard]] id_storage storage_kind() const { return key_.storage; }
    /// @brief Bytes per id: 1, 2 or 4.
    [[nodiscard]] int id_bytes() const {
        return std::visit([](const auto& v) { return static_cast<int>(sizeof(v[0])); }, offsets_.at(0));
    }
    /// @brief Bytes held, all tables: the per-offset ids plus, for table storage, the (L, L) matrices.
    [[nodiscard]] std::int64_t bytes() const {
        std::int64_t b = 0;
        for (const auto* set : {&offsets_, &tables_})
            for (const auto& v : *set) b += std::visit([](const auto& x) { return static_cast<std::int64_t>(x.size() * sizeof(x[0])); }, v);
        return b;
    }
    /// @brief Id of pair (i, j) in table `table`; bounds-checked; any storage.
    /// @throws rpe::out_of_range `[rpe.bucket_ids] ...` when an index is outside its range.
    [[nodiscard]] int at(int table, int i, int j) const {
        const int n = length();
        if (table < 0 || table >= num_tables() || i < 0 || i >= n || j < 0 || j >= n)
            throw out_of_range(detail::message("bucket_ids", "at(table = ", table, ", i = ", i, ", j = ", j,
                                               ") outside tables [0, ", num_tables(), ") x L = ", n));
        if (i < skip() || j < skip()) return num_buckets_ - 1;
        return std::visit([&](const auto& v) { return static_cast<int>(v[offset_index(i, j)]); },
                          offsets_[static_cast<std::size_t>(table)]);
    }
    /// @brief Calls `f(ids)` with `const Id*` pointing at table `table`'s (L, L) ids, row-major,
    /// Id the stored unsigned type; returns what f returns. Table storage only.
    /// @throws rpe::invalid_argument for on-the-fly ids (use at() or rows()).
    template <class F>
    decltype(auto) visit(int table, F&& f) const {
        detail::require(key_.storage == id_storage::table, "bucket_ids",
                        "visit() needs table storage; these ids are computed on the fly (use at() or rows())");
        if (table < 0 || table >= num_tables())
            throw out_of_range(detail::message("bucket_ids", "visit(table = ", table, "); expected [0, ", num_tables(), ")"));
        return std::visit([&](const auto& v) -> decltype(auto) { return f(v.data()); },
                          tables_.at(static_cast<std::size_t>(table)));
    }

    /// @brief Rows [i0, i0 + count) of table `table`'s ids as a (count, L) row-major block:
    /// entry (r, j) is id(i0 + r, j), or with `transposed` id(j, i0 + r) (the query target's
    /// order). Returns a pointer into the stored matrix when possible (table storage, same Id
    /// type, not transposed), else fills `buf` (count·L elements) and returns it. No checks (hot path).
    template <class Id>
    const Id* rows(int table, std::int64_t i0, std::int64_t count, bool transposed, Id* buf) const {
        if (!transposed && key_.storage == id_storage::table) {
            const Id* direct = std::visit(
                [&](const auto& v) -> const Id* {
                    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(v[0])>, Id>)
                        return v.data() + i0 * length();
                    else
                        return nullptr;
                },
                tables_[static_cast<std::size_t>(table)]);
            if (direct) return direct;
        }
        std::visit([&](const auto& off) {
            for (std::int64_t r = 0; r < count; ++r) fill_row(off.data(), i0 + r, transposed, buf + r * length());
        }, offsets_[static_cast<std::size_t>(table)]);
        return buf;
    }

private:
    // Index into the per-offset ids of grid tokens i, j (both ≥ skip).
    [[nodiscard]] std::size_t offset_index(std::int64_t i, std::int64_t j) const {
        const std::int64_t hw = static_cast<std::int64_t>(key_.height) * key_.width, w = key_.width;
        const std::int64_t gi = i - key_.skip, gj = j - key_.skip;
        const std::int64_t dt = gi / hw - gj / hw, dr = (gi % hw) / w - (gj % hw) / w, dc = gi % w - gj % w;
        return static_cast<std::size_t>(((dt + key_.depth - 1) * (2 * std::int64_t{key_.height} - 1) + (dr + key_.height - 1)) * (2 * w - 1) +
                                        (dc + w - 1));
    }

    // Row i of ids (id(i, j) for every j, or id(j, i) when transposed) into dst (L entries).
    template <class Id, class Src>
    void fill_row(const Src* off, std::int64_t i, bool transposed, Id* dst) const {
        const std::int64_t n = length(), skip = key_.skip, t = key_.depth, h = key_.height, w = key_.width;
        const Id extra = static_cast<Id>(num_buckets_ - 1);
        if (i < skip) {
            std::fill(dst, dst + n, extra);
            return;
        }
        std::fill(dst, dst + skip, extra);
        const std::int64_t g = i - skip, ti = g / (h * w), ri = (g / w) % h, ci = g % w;
        const std::int64_t oh = 2 * h - 1, ow = 2 * w - 1;
        Id* out = dst + skip;
        for (std::int64_t tj = 0; tj < t; ++tj)
            for (std::int64_t rj = 0; rj < h; ++rj, out += w) {
                if (!transposed) {  // offsets (.., ci − cj) for cj = 0..W−1 run backwards through one offset row
                    const Src* src = off + ((ti - tj + t - 1) * oh + (ri - rj + h - 1)) * ow + (ci + w - 1);
                    for (std::int64_t cj = 0; cj < w; ++cj) out[cj] = static_cast<Id>(src[-cj]);
                } else {            // offsets (.., cj − ci) run forwards
                    const Src* src = off + ((tj - ti + t - 1) * oh + (rj - ri + h - 1)) * ow + (w - 1 - ci);
                    for (std::int64_t cj = 0; cj < w; ++cj) out[cj] = static_cast<Id>(src[cj]);
                }
            }
    }

    bucket_key key_;
    int num_buckets_;
    std::vector<storage> offsets_;
    std::vector<storage> tables_;
};

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

}  // namespace detail

/// @brief Builds the bucket ids of mapping `m` on a `depth × height × width` grid after `skip`
/// extra tokens, without any cache. Prefer bucket_cache::get, which builds each configuration once.
///
/// The mapping is evaluated once per offset (dt, dr, dc) ∈ [−(T−1), T−1] × [−(H−1), H−1] ×
/// [−(W−1), W−1]; table storage then gathers the (L, L) matrices from those: O(offsets) mapping
/// calls + O(L²) (table) or O(1) (on the fly). A 2D mapping needs depth 1.
/// @throws rpe::invalid_argument `[rpe.bucket_ids] height = ...` for depth, height or width < 1,
///   skip < 0, a `storage` that is not an id_storage enumerator (`storage = 7; expected ...`), a 2D mapping with depth > 1, or invalid mapping parameters (its `validate()`);
///   rpe::out_of_range when L overflows int, table storage would exceed bucket_ids::max_bytes,
///   or the mapping returns an id outside [0, num_buckets()) (a faulty custom mapping).
/// Thread-safety: reentrant. Source: reference `get_bucket_ids_2d` (SPEC §3), extended to 3D.
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, int depth, int height, int width, int skip,
                                                   id_storage storage) {
    detail::require_enum(storage, 3, "bucket_ids", "storage", "automatic, table or on_the_fly");
    detail::require(depth >= 1, "bucket_ids", "depth = ", depth, "; expected >= 1");
    detail::require(height >= 1, "bucket_ids", "height = ", height, "; expected >= 1");
    detail::require(width >= 1, "bucket_ids", "width = ", width, "; expected >= 1");
    detail::require(skip >= 0, "bucket_ids", "skip = ", skip, "; expected >= 0");
    detail::require(Mapping3D<M> || depth == 1, "bucket_ids", "depth = ", depth,
                    " with a 2D mapping; expected depth = 1 (use a 3D mapping for T x H x W grids)");
    detail::validate_policy(m);
    const std::int64_t n = skip + static_cast<std::int64_t>(depth) * height * width;
    if (n > std::numeric_limits<int>::max())
        throw out_of_range(detail::message("bucket_ids", "L = skip + height*width = ", n, " for depth = ", depth,
                                           ", height = ", height, ", width = ", width, ", skip = ", skip,
                                           "; expected L < 2^31"));
    const std::int64_t k = static_cast<std::int64_t>(m.num_buckets());
    detail::require(k >= 1, "bucket_ids", "mapping num_buckets() = ", k, "; expected >= 1");
    const std::int64_t total = k + (skip > 0 ? 1 : 0);
    if (total - 1 > std::numeric_limits<std::uint32_t>::max() || total > std::numeric_limits<int>::max())
        throw out_of_range(detail::message("bucket_ids", "num_buckets = ", total, " does not fit the id type"));
    const int id_bytes = detail::id_bytes_for(total);
    constexpr int tables = detail::num_tables_of<M>();
    // (L, L) bytes, saturated so that L near 2^31 does not overflow int64
    const std::int64_t per_pair = static_cast<std::int64_t>(id_bytes) * tables;
    const std::int64_t table_bytes = n > std::numeric_limits<std::int64_t>::max() / per_pair / n
                                         ? std::numeric_limits<std::int64_t>::max()
                                         : n * n * per_pair;
    if (storage == id_storage::automatic) storage = detail::automatic_storage(n, total, tables);
    if (storage == id_storage::table && table_bytes > bucket_ids::max_bytes)
        throw out_of_range(detail::message("bucket_ids", "an (L, L) id table for L = ", n, " needs ", table_bytes,
                                           " bytes; expected at most bucket_ids::max_bytes = ", bucket_ids::max_bytes,
                                           " (use id_storage::on_the_fly or automatic)"));

    // per-offset ids: (2T−1)(2H−1)(2W−1) per table, in 64-bit (2·width overflows int near 2^30);
    // each is evaluated into an int first: their count is bounded by max_bytes / 16 (1 GiB of ints)
    const std::int64_t od = 2 * std::int64_t{depth} - 1, oh = 2 * std::int64_t{height} - 1, ow = 2 * std::int64_t{width} - 1;
    if (od * oh > bucket_ids::max_bytes / 16 / ow)
        throw out_of_range(detail::message("bucket_ids", "the per-offset ids of a ", depth, "x", height, "x", width,
                                           " grid number (2T-1)(2H-1)(2W-1) = ", od, "*", oh, "*", ow,
                                           "; expected at most bucket_ids::max_bytes / 16 = ", bucket_ids::max_bytes / 16));
    std::vector<bucket_ids::storage> offsets;
    for (int t = 0; t < tables; ++t) {
        std::vector<int> ids(static_cast<std::size_t>(od * oh * ow));
        for (int dt = -(depth - 1); dt <= depth - 1; ++dt)
            for (int dr = -(height - 1); dr <= height - 1; ++dr)
                for (int dc = -(width - 1); dc <= width - 1; ++dc) {
                    const int id = detail::grid_bucket_of(m, dt, dr, dc, t);
                    if (id < 0 || id >= k)
                        throw out_of_range(detail::message("bucket_ids", "mapping returned bucket id ", id, " for offset (dt = ",
                                                           dt, ", dr = ", dr, ", dc = ", dc, ") in table ", t,
                                                           "; expected [0, ", k, ")"));
                    ids[static_cast<std::size_t>(((dt + depth - 1) * oh + (dr + height - 1)) * ow + (dc + width - 1))] = id;
                }
        offsets.push_back(id_bytes == 1   ? detail::narrow_ids<std::uint8_t>(ids)
                          : id_bytes == 2 ? detail::narrow_ids<std::uint16_t>(ids)
                                          : detail::narrow_ids<std::uint32_t>(ids));
    }
    bucket_key key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip, depth, storage};
    if (storage == id_storage::on_the_fly)
        return std::make_shared<const bucket_ids>(std::move(key), static_cast<int>(total), std::move(offsets),
                                                  std::vector<bucket_ids::storage>{});
    // Table storage: every row made once from the per-offset ids.
    bucket_key row_key = key;
    row_key.storage = id_storage::on_the_fly;
    const bucket_ids rows_of(std::move(row_key), static_cast<int>(total), offsets, {});
    std::vector<bucket_ids::storage> matrices;
    for (int t = 0; t < tables; ++t)
        matrices.push_back(std::visit([&](const auto& off) -> bucket_ids::storage {
            using Id = std::remove_cvref_t<decltype(off[0])>;
            std::vector<Id> v(static_cast<std::size_t>(n * n));
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n > 256)
#endif
            for (std::int64_t i = 0; i < n; ++i) (void)rows_of.rows<Id>(t, i, 1, false, v.data() + i * n);
            return v;
        }, offsets[static_cast<std::size_t>(t)]));
    return std::make_shared<const bucket_ids>(std::move(key), static_cast<int>(total), std::move(offsets), std::move(matrices));
}

/// @brief 2D form: `build_bucket_ids(m, 1, height, width, skip, storage)`.
template <GridMapping M>
std::shared_ptr<const bucket_ids> build_bucket_ids(const M& m, int height, int width, int skip,
                                                   id_storage storage = id_storage::automatic) {
    return build_bucket_ids(m, 1, height, width, skip, storage);
}

/// @brief Thread-safe cache of bucket ids keyed by the whole configuration (mapping type and
/// value, height, width, skip). Every term and layer that asks for the same configuration gets
/// the same shared object; a new resolution at inference time simply adds an entry.
///
/// Concurrent `get`s of one missing key build it once (the others wait); different keys build
/// in parallel. A failed build throws to every waiter and leaves no entry.
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
            const std::int64_t k = static_cast<std::int64_t>(m.num_buckets()) + (skip > 0 ? 1 : 0);
            storage = detail::automatic_storage(n, k, detail::num_tables_of<M>());
        }
        bucket_key key{std::make_shared<detail::mapping_key<M>>(m), height, width, skip, depth, storage};
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
                promise.set_value(build_bucket_ids(m, depth, height, width, skip, storage));
            } catch (...) {
                promise.set_exception(std::current_exception());
                std::lock_guard<std::mutex> lock(mutex_);
                entries_.erase(key);
                throw;
            }
        }
        return future.get();
    }

    /// @brief 2D form: `get(m, 1, height, width, skip, storage)`.
    template <GridMapping M>
    std::shared_ptr<const bucket_ids> get(const M& m, int height, int width, int skip,
                                          id_storage storage = id_storage::automatic) {
        return get(m, 1, height, width, skip, storage);
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
