/// @file bucket_ids.hpp
/// @brief The class rpe::bucket_ids: the bucket ids of every (query, key) token pair of a grid,
/// compact (per-offset ids, plus (L, L) matrices for table storage), and the rows kernels read.
/// Built by rpe::build_bucket_ids and shared through rpe::bucket_cache; <rpe/bucket_cache.hpp>
/// includes all three.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "bucket_key.hpp"
#include "detail/offset_math.hpp"
#include "error.hpp"

namespace rpe {

/// @brief The one dispatch on the id width: calls `f.template operator()<Id>()` with Id the
/// unsigned type of `bytes` bytes (std::uint8_t for 1, std::uint16_t for 2, std::uint32_t for 4)
/// and returns what f returns. Called once per call, so kernels take Id as a template argument
/// and never switch per element: `rpe::visit_id_width(ids.id_bytes(), [&]<class Id>() { ... })`.
/// @throws rpe::invalid_argument `[rpe.bucket_ids] id width = ...; expected 1, 2 or 4 bytes`.
template <class F>
decltype(auto) visit_id_width(int bytes, F&& f) {
    switch (bytes) {
        case 1: return f.template operator()<std::uint8_t>();
        case 2: return f.template operator()<std::uint16_t>();
        case 4: return f.template operator()<std::uint32_t>();
        default: break;
    }
    throw invalid_argument(detail::message("bucket_ids", "id width = ", bytes, " bytes; expected 1, 2 or 4 bytes"));
}

/// @brief Bucket ids of every (query, key) token pair of a grid, one id set per table (two for
/// Cross), in the smallest unsigned type holding the largest id.
///
/// Tokens: `skip` extra tokens, then the grid in row-major order (frame t, row r, column c:
/// token `skip + (t·H + r)·W + c`); `L = skip + T·H·W`. Id (i, j) of query token i and key token
/// j is the mapping's id of the offset (t_i − t_j, r_i − r_j, c_i − c_j); with `skip > 0` every pair
/// that touches an extra token (i < skip or j < skip) has the extra id `num_buckets()−1`, or with
/// `skip_buckets() == 3` (BEiT) `K−3` (only i extra), `K−2` (only j extra), `K−1` (both).
/// Id width: 1 byte when `num_buckets() ≤ 256`, 2 when ≤ 65536, else 4.
///
/// Storage: every object holds the per-offset ids ((2T−1)(2H−1)(2W−1) per table); `table`
/// storage also holds the (L, L) matrices, `on_the_fly` makes each row when a kernel reads it
/// (O(L) per row, the same order as reading a stored row), so grids of any size need no L² memory.
///
/// Tokens at per-token positions (at_positions(); made by rpe::build_bucket_ids(m, positions,
/// skip) or bucket_cache::get(m, positions, skip)): `skip` extra tokens, then N tokens at integer
/// coordinates (row, col) — (t, row, col) for 3D mappings — in any order, `L = skip + N`; id
/// (i, j) is the mapping's id of the offset pos_i − pos_j (with key positions apart, of
/// qpos_i − kpos_j). Keys apart may number another count N_k (cross-attention): the ids are then
/// (L, L_k) with `L_k = skip + N_k` (key_length()), skip rows and columns first, the same ids as
/// rows (queries) and columns (keys) of the self-attention ids over both token sets together
/// (docs/positions.md, "Queries and keys of different counts"). Such ids share the per-offset ids of the positions' bounding box T × H × W
/// (a grid's ids, on the fly; key() is that grid's key) and hold N positions: always on the fly.
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
    /// `skip_buckets`: 1 (every pair touching an extra token has id K−1) or 3 (BEiT: K−3, K−2, K−1).
    bucket_ids(bucket_key key, int num_buckets, std::vector<storage> offsets, std::vector<storage> tables, int skip_buckets = 1)
        : key_(std::move(key)),
          num_buckets_(num_buckets),
          skip_buckets_(skip_buckets),
          offsets_(std::move(offsets)),
          tables_(std::move(tables)) {}

    /// @brief Ids of tokens at positions (use build_bucket_ids(m, positions, skip) instead): they
    /// read the per-offset ids of `box` (the ids of the positions' bounding box grid, any storage,
    /// shared, not copied); `query` and `key` (N each; `key` empty: the queries') are each grid
    /// token's linear position in the box, `t·(2H−1)(2W−1) + r·(2W−1) + c` (see
    /// detail::id_positions).
    bucket_ids(std::shared_ptr<const bucket_ids> box, std::vector<std::int64_t> query, std::vector<std::int64_t> key)
        : key_(box->key_),
          num_buckets_(box->num_buckets_),
          skip_buckets_(box->skip_buckets_),
          box_(std::move(box)),
          query_(std::move(query)),
          key_positions_(std::move(key)) {
        key_.storage = id_storage::on_the_fly;
        const detail::id_grid g = grid();
        base_ = ((g.depth - 1) * (2 * g.height - 1) + (g.height - 1)) * (2 * g.width - 1) + (g.width - 1);
    }

    /// @brief The configuration these ids were built for (ids at positions: the key of their
    /// bounding box grid's per-offset ids, storage on_the_fly).
    [[nodiscard]] const bucket_key& key() const { return key_; }
    [[nodiscard]] int depth() const { return key_.depth; }    ///< grid frames (1 for images); at positions: the box's
    [[nodiscard]] int height() const { return key_.height; }  ///< grid rows; at positions: the bounding box's
    [[nodiscard]] int width() const { return key_.width; }    ///< grid columns; at positions: the bounding box's
    [[nodiscard]] int skip() const { return key_.skip; }      ///< extra tokens
    /// @brief True for ids of tokens at per-token positions (see the class comment), false on a grid.
    [[nodiscard]] bool at_positions() const { return box_ != nullptr; }
    /// @brief True when the keys have positions of their own (at_positions() only).
    [[nodiscard]] bool has_key_positions() const { return !key_positions_.empty(); }
    /// @brief The grid as text: "HxW", or "TxHxW" when depth > 1; at positions "N positions"
    /// (keys with positions of their own, of any count: "N positions, N_k key positions").
    [[nodiscard]] std::string grid_string() const {
        if (box_)
            return std::to_string(query_.size()) + " positions" +
                   (key_positions_.empty() ? std::string() : ", " + std::to_string(key_positions_.size()) + " key positions");
        return (key_.depth > 1 ? std::to_string(key_.depth) + "x" : std::string()) + std::to_string(key_.height) + "x" +
               std::to_string(key_.width);
    }
    /// @brief Sequence length `L = skip + depth·height·width`, or at positions `skip + N`: the
    /// queries' count, the rows of the ids.
    [[nodiscard]] int length() const {
        return key_.skip + (box_ ? static_cast<int>(query_.size()) : key_.depth * key_.height * key_.width);
    }
    /// @brief The keys' count L_k, the columns of the ids: length() unless the keys have positions
    /// of their own of another count (`skip + N_k`, cross-attention).
    [[nodiscard]] int key_length() const {
        return key_positions_.empty() ? length() : key_.skip + static_cast<int>(key_positions_.size());
    }
    /// @brief True when the ids are (L, L_k) with L_k ≠ L (keys at positions of another count).
    [[nodiscard]] bool rectangular() const { return key_length() != length(); }
    /// @brief Buckets per table, the extra skip bucket(s) included (the table's K).
    [[nodiscard]] int num_buckets() const { return num_buckets_; }
    /// @brief Extra buckets for pairs touching a skip token: 1, or 3 for BEiT-style mappings
    /// (see rpe::detail::skip_buckets_of); they are the last ids, used only when skip > 0.
    [[nodiscard]] int skip_buckets() const { return skip_buckets_; }
    /// @brief Number of id sets (1, or 2 for Cross).
    [[nodiscard]] int num_tables() const { return static_cast<int>(offs().size()); }
    /// @brief `id_storage::table` or `id_storage::on_the_fly`.
    [[nodiscard]] id_storage storage_kind() const { return key_.storage; }
    /// @brief Bytes per id: 1, 2 or 4.
    [[nodiscard]] int id_bytes() const {
        return std::visit([](const auto& v) { return static_cast<int>(sizeof(v[0])); }, offs().at(0));
    }
    /// @brief Bytes held, all tables: the per-offset ids plus, for table storage, the (L, L)
    /// matrices; at positions the positions (8 bytes per token, queries and keys) and the
    /// bounding box's ids that they share.
    [[nodiscard]] std::int64_t bytes() const {
        if (box_)
            return box_->bytes() + static_cast<std::int64_t>((query_.size() + key_positions_.size()) * sizeof(std::int64_t));
        std::int64_t b = 0;
        for (const auto* set : {&offsets_, &tables_})
            for (const auto& v : *set)
                b += std::visit([](const auto& x) { return static_cast<std::int64_t>(x.size() * sizeof(x[0])); }, v);
        return b;
    }
    /// @brief Id of pair (i, j) in table `table` (query i < L, key j < L_k); bounds-checked; any storage.
    /// @throws rpe::out_of_range `[rpe.bucket_ids] ...` when an index is outside its range.
    [[nodiscard]] int at(int table, int i, int j) const {
        const int n = length(), nk = key_length();
        if (table < 0 || table >= num_tables() || i < 0 || i >= n || j < 0 || j >= nk)
            throw out_of_range(detail::message("bucket_ids", "at(table = ", table, ", i = ", i, ", j = ", j,
                                               ") outside tables [0, ", num_tables(), ") x L = ", n, " x L_k = ", nk));
        if (i < skip() || j < skip()) return static_cast<int>(grid().extra_id(i, j));
        const std::int64_t index =
            box_ ? base_ + query_[static_cast<std::size_t>(i - skip())] - key_lin()[static_cast<std::size_t>(j - skip())]
                 : grid().offset_index(i, j);
        return std::visit([&](const auto& v) { return static_cast<int>(v[static_cast<std::size_t>(index)]); },
                          offs()[static_cast<std::size_t>(table)]);
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

    /// @brief Rows [i0, i0 + count) of table `table`'s ids as a (count, L_k) row-major block (one
    /// row per query, one entry per key): entry (r, j) is id(i0 + r, j), or with `transposed` the
    /// query target's id of query i0 + r and key j: id(j, i0 + r) on tokens of one set (the
    /// reference's rpe_q), at positions with keys apart the id of offset kpos_j − qpos_(i0+r) (what
    /// self-attention over both sets gives the pair; detail::fill_position_row). Returns a pointer
    /// into the stored matrix when possible (table storage, same Id type, not transposed), else
    /// fills `buf` (count·L_k elements) and returns it. No checks (hot path).
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
        const detail::id_grid g = grid();
        if (box_) {
            const detail::id_positions p{query_.data(), key_lin(), base_};
            const std::int64_t n = key_length();
            std::visit(
                [&](const auto& off) {
                    for (std::int64_t r = 0; r < count; ++r)
                        detail::fill_position_row(g, p, n, off.data(), i0 + r, transposed, buf + r * n);
                },
                offs()[static_cast<std::size_t>(table)]);
            return buf;
        }
        std::visit(
            [&](const auto& off) {
                for (std::int64_t r = 0; r < count; ++r)
                    detail::fill_id_row(g, off.data(), i0 + r, transposed, buf + r * length());
            },
            offsets_[static_cast<std::size_t>(table)]);
        return buf;
    }

    /// @brief The query target's ids in key order: rows [j0, j0 + count) as a (count, L) block
    /// (one row per key, one entry per query), entry (r, i) the query target's id of query i and
    /// key j0 + r (rows(..., transposed = true) at [i, j0 + r]); on tokens of one set row j of the
    /// ids, id(j0 + r, i). Fills `buf` (count·L) unless stored rows serve (table storage, same Id).
    template <class Id>
    const Id* key_rows(int table, std::int64_t j0, std::int64_t count, Id* buf) const {
        if (!box_ || key_positions_.empty()) return rows<Id>(table, j0, count, false, buf);
        const detail::id_grid g = grid();
        const detail::id_positions p{query_.data(), key_lin(), base_};
        const std::int64_t n = length();
        std::visit(
            [&](const auto& off) {
                for (std::int64_t r = 0; r < count; ++r) detail::fill_position_key_row(g, p, n, off.data(), j0 + r, buf + r * n);
            },
            offs()[static_cast<std::size_t>(table)]);
        return buf;
    }

    /// @brief The grid and extra id of these ids, for the offset math (detail/offset_math.hpp);
    /// at positions the bounding box grid (its length() is not these ids' L).
    [[nodiscard]] detail::id_grid grid() const {
        const bool three = skip_buckets_ == 3;
        return detail::id_grid{key_.depth,
                               key_.height,
                               key_.width,
                               key_.skip,
                               num_buckets_ - 1,
                               num_buckets_ - (three ? 3 : 1),
                               num_buckets_ - (three ? 2 : 1)};
    }
    /// @brief At positions: the ids of the positions' bounding box grid, whose per-offset ids these
    /// ids read (shared); null on a grid.
    [[nodiscard]] const std::shared_ptr<const bucket_ids>& box() const { return box_; }
    /// @brief At positions: the grid tokens' linear positions in the box's offset space and the
    /// index of offset (0, 0, 0) (detail::id_positions; `key` points at the queries' positions
    /// when the keys have none of their own; N and N_k = key_length() − skip of them), valid
    /// while this object lives; with grid() and the per-offset ids, id(i, j) =
    /// detail::position_id, and the query target's id of query i and key j
    /// detail::position_id(grid(), p.swapped(), off, j, i). All null on a grid.
    [[nodiscard]] detail::id_positions linear_positions() const {
        if (!box_) return {};
        return detail::id_positions{query_.data(), key_lin(), base_};
    }
    /// @brief Table `table`'s per-offset ids ((2T−1)(2H−1)(2W−1) entries, see detail/offset_math.hpp)
    /// as `f(const Id*, std::size_t count)`; returns what f returns. Any storage.
    template <class F>
    decltype(auto) visit_offsets(int table, F&& f) const {
        if (table < 0 || table >= num_tables())
            throw out_of_range(
                detail::message("bucket_ids", "visit_offsets(table = ", table, "); expected [0, ", num_tables(), ")"));
        return std::visit([&](const auto& v) -> decltype(auto) { return f(v.data(), v.size()); },
                          offs()[static_cast<std::size_t>(table)]);
    }

private:
    const std::vector<storage>& offs() const { return box_ ? box_->offsets_ : offsets_; }
    const std::int64_t* key_lin() const { return key_positions_.empty() ? query_.data() : key_positions_.data(); }

    bucket_key key_;
    int num_buckets_;
    int skip_buckets_ = 1;
    std::vector<storage> offsets_;
    std::vector<storage> tables_;
    // ids at positions: the bounding box grid's ids (per-offset ids shared), the grid tokens'
    // linear positions in its offset space (queries; keys when they differ) and offset (0, 0, 0)
    std::shared_ptr<const bucket_ids> box_;
    std::vector<std::int64_t> query_, key_positions_;
    std::int64_t base_ = 0;
};

}  // namespace rpe
