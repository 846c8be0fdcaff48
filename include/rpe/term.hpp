/// @file term.hpp
/// @brief rpe::term: one RPE term (mapping × mode × target) with forward and backward.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels.hpp"
#include "backend/tags.hpp"
#include "bucket_ids.hpp"
#include "concepts.hpp"
#include "detail/check.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "tensor.hpp"

namespace rpe {

/// @brief How an output buffer is written: replaced, or added to (to sum terms into logits).
enum class write { overwrite, accumulate };

namespace detail {
template <class Md, target Tg>
inline constexpr bool valid_mode_target = !(std::is_same_v<Md, mode::bias> && Tg == target::value);
}  // namespace detail

/// @brief A valid (mode, target) pair: bias mode on values does not exist (paper eq. 17 defines
/// values in contextual mode only; the reference raises NotImplementedError).
template <class Md, target Tg>
concept ModeOnTarget = Mode<Md> && detail::valid_mode_target<Md, Tg>;

/// @brief One iRPE term: a mapping M (with its index function), a mode, a target, a scalar type
/// and a backend, composed at compile time.
///
/// The term holds the configuration only; the lookup table(s) stay the caller's (a parameter of
/// their model) and are passed by view, as are inputs and outputs. Shapes (B batch, H heads,
/// L = skip + height·width tokens, D head dim, K = num_buckets() with the extra bucket,
/// Ht = table_heads() = 1 when shared else H):
///
/// | mode, target        | table        | x            | out          |
/// |---------------------|--------------|--------------|--------------|
/// | bias, key / query   | (Ht, K)      | unused ({})  | (Bo, Ho, L, L), Bo ≥ 1, Ho ∈ {Ht, H}: broadcast |
/// | contextual, key     | (Ht, D, K)   | (B, H, L, D) = q·s | (B, H, L, L) |
/// | contextual, query   | (Ht, D, K)   | (B, H, L, D) = k·s | (B, H, L, L) |
/// | contextual, value   | (Ht, K, D)   | (B, H, L, L) = a   | (B, H, L, D) |
///
/// Cross has two tables (rows, cols) and two id matrices; the term is their sum.
///
/// Errors: the constructor throws rpe::invalid_argument `[rpe.term] ...` for num_heads < 1,
/// head_dim < 1, skip < 0 or invalid mapping parameters; forward/backward throw
/// rpe::invalid_argument for ids built for another configuration (mapping, skip), a shape that
/// does not match, a null or overlapping buffer. Exception guarantee: every check runs before
/// anything is written, so a call that throws leaves the outputs untouched.
/// Thread-safety: const member functions may run concurrently on distinct outputs.
/// Source: paper eqs. 13–17; reference `iRPE` module and `build_rpe` in microsoft/Cream
/// `iRPE/DeiT-with-iRPE/irpe.py`.
template <GridMapping M, Mode Md, target Tg, class S = float, Backend B = backend::cpu>
    requires ModeOnTarget<Md, Tg>  // bias mode on values does not exist
class term {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "rpe: the scalar type must be float or double");
    static_assert(std::is_same_v<B, backend::cpu>,
                  "rpe: this header provides the CPU backend; include <rpe/cuda.cuh> and compile with nvcc for backend::cuda");

public:
    using mapping_type = M;
    using mode_type = Md;
    using scalar_type = S;
    using backend_type = B;
    static constexpr target target_kind = Tg;                       ///< query, key or value
    static constexpr int num_tables = detail::num_tables_of<M>();   ///< 1, or 2 for Cross
    static constexpr bool is_bias = std::is_same_v<Md, mode::bias>; ///< bias mode
    using tables_type = std::array<tensor_ref<const S>, num_tables>;  ///< the lookup table(s)
    using grad_tables_type = std::array<tensor_ref<S>, num_tables>;   ///< their gradients

    /// @brief Configures the term. `shared_head`: one table for all heads (Ht = 1), else one per head.
    /// @throws rpe::invalid_argument `[rpe.term] num_heads = ...` (see the class comment).
    term(M mapping, int num_heads, int head_dim, bool shared_head, int skip)
        : mapping_(mapping), num_heads_(num_heads), head_dim_(head_dim), shared_head_(shared_head), skip_(skip) {
        detail::require(num_heads >= 1, "term", "num_heads = ", num_heads, "; expected >= 1");
        detail::require(head_dim >= 1, "term", "head_dim = ", head_dim, "; expected >= 1");
        detail::require(skip >= 0, "term", "skip = ", skip, "; expected >= 0");
        detail::validate_policy(mapping_);
        const std::int64_t k = static_cast<std::int64_t>(mapping_.num_buckets()) + (skip > 0 ? 1 : 0);
        detail::require(k >= 1 && k < 2147483647, "term", "num_buckets = ", k, " (mapping buckets + skip bucket); expected [1, 2^31 - 1)");
        num_buckets_ = static_cast<int>(k);
    }

    [[nodiscard]] const M& mapping() const { return mapping_; }  ///< the mapping policy
    [[nodiscard]] int num_heads() const { return num_heads_; }   ///< H
    [[nodiscard]] int head_dim() const { return head_dim_; }     ///< D
    [[nodiscard]] bool shared_head() const { return shared_head_; }
    [[nodiscard]] int skip() const { return skip_; }             ///< extra tokens before the grid
    [[nodiscard]] int table_heads() const { return shared_head_ ? 1 : num_heads_; }  ///< Ht
    /// @brief K: buckets per table, the extra skip bucket included (reference `num_buckets`).
    [[nodiscard]] int num_buckets() const { return num_buckets_; }
    /// @brief Shape of each lookup table: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::vector<std::int64_t> table_shape() const {
        if constexpr (is_bias) return {table_heads(), num_buckets_};
        else if constexpr (Tg == target::value) return {table_heads(), num_buckets_, head_dim_};
        else return {table_heads(), head_dim_, num_buckets_};
    }

    /// @brief The shared bucket ids of this term's mapping and skip on a height × width grid.
    /// @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, 1, height, width, skip_, id_storage::automatic);
    }
    /// @brief The shared bucket ids on a depth × height × width grid (depth > 1 needs a Mapping3D).
    /// @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, depth, height, width, skip_, id_storage::automatic);
    }
    /// @brief As above, held as `storage` says (on_the_fly: no (L, L) table, for large grids).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width, id_storage storage,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, depth, height, width, skip_, storage);
    }

    /// @brief Forward: writes (or adds) the term into `out`. See the class comment for shapes.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers.
    void forward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x, tensor_ref<S> out,
                 write mode = write::overwrite) const {
        detail::require_enum(mode, 2, "term", "mode", "write::overwrite or write::accumulate");
        const auto d = check(ids, tables, x, out, "out");
        detail::check_no_overlap(out, x, "term", "out", "x");
        for (int t = 0; t < num_tables; ++t) detail::check_no_overlap(out, tables[t], "term", "out", "table");
        const bool acc = mode == write::accumulate;
        for (int t = 0; t < num_tables; ++t) {
            const bool acc_t = acc || t > 0;
            detail::cpu::with_id_type(ids.id_bytes(), [&]<class Id>() {
                const detail::cpu::id_rows<Id> id{&ids, t, Tg == target::query};
                if constexpr (is_bias)
                    detail::cpu::bias_forward(d, id, tables[t].data, out.extent(0), out.extent(1), acc_t, out.data);
                else if constexpr (Tg == target::value)
                    detail::cpu::contextual_v_forward(d, id, x.data, tables[t].data, acc_t, out.data);
                else
                    detail::cpu::contextual_qk_forward(d, id, x.data, tables[t].data, acc_t, out.data);
            });
        }
    }

    /// @brief Single-table convenience overload of forward.
    void forward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x, tensor_ref<S> out,
                 write mode = write::overwrite) const
        requires(num_tables == 1)
    {
        forward(ids, tables_type{table}, x, out, mode);
    }

    /// @brief Backward of `sum(out · grad_out)`: gradient for the input x (`grad_x`, shape of x;
    /// pass `{}` to skip it, and for bias mode) and for each table (`grad_tables`, shapes of the
    /// tables; pass `{}` entries to skip). A shared table collects every head and batch element.
    /// With write::accumulate the gradients are added to the buffers.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers.
    void backward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, const grad_tables_type& grad_tables,
                  write mode = write::overwrite) const {
        detail::require_enum(mode, 2, "term", "mode", "write::overwrite or write::accumulate");
        const auto d = check(ids, tables, x, grad_out, "grad_out");
        // Every output (grad_x and each grad_tables[t]) must be separate from every input and
        // from the other outputs: all checks run before anything is written.
        const auto shape = table_shape();
        for (int t = 0; t < num_tables; ++t)
            if (grad_tables[t].data != nullptr || grad_tables[t].rank != 0) {
                const std::string name = "grad_tables[" + std::to_string(t) + "]";
                detail::check_shape(grad_tables[t], shape, "term", name);
                detail::check_nonnull(grad_tables[t], "term", name);
                for (int u = 0; u < num_tables; ++u) {
                    detail::check_no_overlap(grad_tables[t], tables[u], "term", name, "tables[" + std::to_string(u) + "]");
                    if (u < t) detail::check_no_overlap(grad_tables[t], grad_tables[u], "term", name, "grad_tables[" + std::to_string(u) + "]");
                }
                detail::check_no_overlap(grad_tables[t], grad_out, "term", name, "grad_out");
                detail::check_no_overlap(grad_tables[t], x, "term", name, "x");
            }
        if constexpr (is_bias)
            detail::require(grad_x.data == nullptr && grad_x.rank == 0, "term",
                            "grad_x must be empty ({}) in bias mode: the bias term has no input");
        const bool want_x = !is_bias && (grad_x.data != nullptr || grad_x.rank != 0);
        if (want_x) {
            detail::check_shape(grad_x, std::vector<std::int64_t>(x.shape.begin(), x.shape.begin() + x.rank), "term", "grad_x");
            detail::check_nonnull(grad_x, "term", "grad_x");
            detail::check_no_overlap(grad_x, grad_out, "term", "grad_x", "grad_out");
            detail::check_no_overlap(grad_x, x, "term", "grad_x", "x");
            for (int t = 0; t < num_tables; ++t) {
                detail::check_no_overlap(grad_x, tables[t], "term", "grad_x", "tables[" + std::to_string(t) + "]");
                detail::check_no_overlap(grad_x, grad_tables[t], "term", "grad_x", "grad_tables[" + std::to_string(t) + "]");
            }
        }
        const bool acc = mode == write::accumulate;
        for (int t = 0; t < num_tables; ++t) {
            S* gt = grad_tables[t].data;
            S* gx = want_x ? grad_x.data : nullptr;
            const bool acc_x = acc || t > 0;
            detail::cpu::with_id_type(ids.id_bytes(), [&]<class Id>() {
                const detail::cpu::id_rows<Id> id{&ids, t, Tg == target::query};
                if constexpr (is_bias) {
                    if (gt) detail::cpu::bias_backward(d, id, grad_out.data, grad_out.extent(0), grad_out.extent(1), acc, gt);
                } else if constexpr (Tg == target::value) {
                    if (gx) detail::cpu::contextual_v_backward(d, id, x.data, tables[t].data, grad_out.data, acc_x, gx, static_cast<S*>(nullptr));
                    if (gt) detail::cpu::contextual_v_backward(d, id, x.data, tables[t].data, grad_out.data, acc, static_cast<S*>(nullptr), gt);
                } else {
                    // one scatter of grad_out serves both gradients
                    if (gx || gt) detail::cpu::contextual_qk_backward(d, id, x.data, tables[t].data, grad_out.data, acc_x, acc, gx, gt);
                }
            });
        }
    }

    /// @brief Single-table convenience overload of backward.
    void backward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, tensor_ref<S> grad_table,
                  write mode = write::overwrite) const
        requires(num_tables == 1)
    {
        backward(ids, tables_type{table}, x, grad_out, grad_x, grad_tables_type{grad_table}, mode);
    }

private:
    // Validates ids, tables, x and the (L, L)- or (L, D)-shaped buffer `y` (out or grad_out);
    // returns the kernel sizes.
    detail::cpu::dims check(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x,
                            tensor_ref<const S> y, const char* y_name) const {
        detail::require(ids.key().holds(mapping_), "term",
                        "bucket ids were built for another mapping (type or alpha/beta/gamma); expected this term's mapping");
        detail::require(ids.skip() == skip_, "term", "bucket ids have skip = ", ids.skip(), "; expected this term's skip = ", skip_);
        detail::require(ids.num_tables() == num_tables, "term", "bucket ids hold ", ids.num_tables(), " tables; expected ", num_tables);
        const std::int64_t n = ids.length();
        detail::cpu::dims d;
        d.length = n;
        d.buckets = num_buckets_;
        d.dim = head_dim_;
        d.heads = num_heads_;
        d.table_heads = table_heads();
        const auto shape = table_shape();
        for (int t = 0; t < num_tables; ++t)
            detail::check_shape(tables[t], shape, "term", num_tables == 1 ? std::string("table") : "tables[" + std::to_string(t) + "]");
        if constexpr (is_bias) {
            detail::require(y.rank == 4 && y.extent(0) >= 1 && (y.extent(1) == d.table_heads || y.extent(1) == d.heads) &&
                                y.extent(2) == n && y.extent(3) == n,
                            "term", y_name, " has shape ", y.shape_string(), "; expected (B >= 1, ",
                            (d.heads == d.table_heads ? std::to_string(d.heads)
                                                      : std::to_string(d.heads) + " or " + std::to_string(d.table_heads)),
                            ", L, L) with L = ", n, " (bucket ids: skip ", ids.skip(), " + ", ids.grid_string(), ")");
            detail::require(x.data == nullptr && x.rank == 0, "term", "x must be empty ({}) in bias mode: the bias term does not read an input");
            d.batch = y.extent(0);
        } else {
            detail::require(x.rank == 4 && x.extent(0) >= 1 && x.extent(1) == d.heads && x.extent(2) == n &&
                                x.extent(3) == (Tg == target::value ? n : d.dim),
                            "term", "x has shape ", x.shape_string(), "; expected (B >= 1, ", d.heads, ", ", n, ", ",
                            (Tg == target::value ? n : d.dim), ") with L = ", n, " = skip ", ids.skip(), " + ", ids.grid_string());
            d.batch = x.extent(0);
            const std::int64_t last = Tg == target::value ? d.dim : n;
            detail::check_shape(y, {d.batch, d.heads, n, last}, "term", y_name);
            detail::check_nonnull(x, "term", "x");
        }
        detail::check_nonnull(y, "term", y_name);
        for (int t = 0; t < num_tables; ++t)
            detail::check_nonnull(tables[t], "term", num_tables == 1 ? std::string("table") : "tables[" + std::to_string(t) + "]");
        return d;
    }

    M mapping_;
    int num_heads_;
    int head_dim_;
    bool shared_head_;
    int skip_;
    int num_buckets_ = 0;
};

}  // namespace rpe
