/// @file detail/term_checks.hpp
/// @brief The backend-neutral front of a term: its run-time layout (heads, head dim, buckets,
/// skip, mode, target) and every argument check of forward and backward, shared by the CPU
/// term, the CUDA term and the run-time terms (rpe::any_term), so a bad input gets the same
/// exception from each (not API: use rpe::term or rpe::any_term).
///
/// Checks are cheap on success: they compare values and format a message only when they fail.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "../bucket_ids.hpp"
#include "../error.hpp"
#include "../mode.hpp"
#include "../tensor.hpp"
#include "check.hpp"
#include "validate.hpp"

namespace rpe::detail {

/// @brief Problem sizes of one term call, as the kernels of every backend read them.
struct term_dims {
    std::int64_t batch = 1;        ///< B
    std::int64_t heads = 1;        ///< H
    std::int64_t length = 0;       ///< L (queries: rows of the ids)
    std::int64_t key_length = 0;   ///< L_k (keys: columns of the ids; L unless keys at positions of another count)
    std::int64_t dim = 1;          ///< D (head dim)
    std::int64_t buckets = 0;      ///< K (extra bucket included)
    std::int64_t table_heads = 1;  ///< Ht
    [[nodiscard]] std::int64_t table_head(std::int64_t h) const { return table_heads == 1 ? 0 : h; }
};

/// @brief A term's configuration as run-time values: what every backend checks calls against.
struct term_layout {
    int num_heads = 1;                      ///< H
    int head_dim = 1;                       ///< D
    bool shared_head = true;                ///< one table for all heads (Ht = 1)
    int skip = 0;                           ///< extra tokens before the grid
    int num_buckets = 0;                    ///< K, the extra skip bucket included
    int num_tables = 1;                     ///< 1, or 2 for Cross
    bool bias = false;                      ///< bias (true) or contextual (false) mode
    rpe::target target = rpe::target::key;  ///< q, k or v

    [[nodiscard]] int table_heads() const { return shared_head ? 1 : num_heads; }  ///< Ht
    /// @brief Shape of each table: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::array<std::int64_t, 3> table_extents() const {
        if (bias) return {table_heads(), num_buckets, 0};
        if (target == rpe::target::value) return {table_heads(), num_buckets, head_dim};
        return {table_heads(), head_dim, num_buckets};
    }
    [[nodiscard]] int table_rank() const { return bias ? 2 : 3; }  ///< 2 (bias) or 3 (contextual)
};

/// @brief Validates a term's configuration and returns its layout. `mapping_buckets()` is called
/// after the checks of heads, head_dim and skip: it validates the mapping and returns its
/// num_buckets() (without the skip bucket). `skip_buckets`: the extra buckets with skip tokens
/// (the mapping's detail::skip_buckets_of: 1, or 3 for BEiT).
/// @throws rpe::invalid_argument `[rpe.term] num_heads = ...; expected >= 1` (also head_dim,
///   skip, bias mode on values, K outside [1, 2^31 − 1)), and what `mapping_buckets` throws.
template <class BucketsFn>
term_layout make_term_layout(BucketsFn&& mapping_buckets, int num_tables, int num_heads, int head_dim, bool shared_head, int skip,
                             bool bias, rpe::target target, int skip_buckets = 1) {
    require(num_heads >= 1, "term", "num_heads = ", num_heads, "; expected >= 1");
    require(head_dim >= 1, "term", "head_dim = ", head_dim, "; expected >= 1");
    require(skip >= 0, "term", "skip = ", skip, "; expected >= 0");
    require(target == rpe::target::query || target == rpe::target::key || target == rpe::target::value, "term",
            "target = ", static_cast<int>(target), "; expected query, key or value");
    require(!(bias && target == rpe::target::value), "term",
            "mode = bias with target = v: bias mode on values does not exist (paper eq. 17; the reference raises "
            "NotImplementedError)");
    const std::int64_t k = static_cast<std::int64_t>(mapping_buckets()) + (skip > 0 ? skip_buckets : 0);
    require(k >= 1 && k < 2147483647, "term", "num_buckets = ", k, " (mapping buckets + skip bucket); expected [1, 2^31 - 1)");
    return term_layout{num_heads, head_dim, shared_head, skip, static_cast<int>(k), num_tables, bias, target};
}

/// @brief Checks that `mode` is write::overwrite or write::accumulate (not a value cast from an int).
/// @throws rpe::invalid_argument `[rpe.term] mode = 7; expected write::overwrite or write::accumulate`.
inline void check_write_mode(write mode) { require_enum(mode, 2, "term", "mode", "write::overwrite or write::accumulate"); }

/// @brief Name of table argument `t` in messages: "table" for single-table terms, else "tables[t]".
inline const char* table_name(int num_tables, int t) {
    static constexpr std::array<const char*, 2> tables{"tables[0]", "tables[1]"};
    return num_tables == 1 ? "table" : tables[static_cast<std::size_t>(t & 1)];
}

/// @brief "tables[t]" (or with `grad`, "grad_tables[t]"): the backward's names, indexed for every term.
inline const char* indexed_table_name(int t, bool grad = false) {
    static constexpr std::array<const char*, 2> tables{"tables[0]", "tables[1]"};
    static constexpr std::array<const char*, 2> grads{"grad_tables[0]", "grad_tables[1]"};
    return (grad ? grads : tables)[static_cast<std::size_t>(t & 1)];
}

/// @brief True when the view has the given rank and extents (no allocation, no formatting).
template <class T>
bool has_extents(const tensor_ref<T>& t, std::span<const std::int64_t> expected) {
    if (t.rank != static_cast<int>(expected.size())) return false;
    for (int i = 0; i < t.rank; ++i)
        if (t.extent(i) != expected[static_cast<std::size_t>(i)]) return false;
    return true;
}

/// @brief Throws `[rpe.<component>] <name> has shape (...); expected (...)` unless the view has
/// exactly `expected` (formats only on failure).
template <class T>
void require_extents(const tensor_ref<T>& t, std::span<const std::int64_t> expected, const char* component, const char* name) {
    if (!has_extents(t, expected))
        throw invalid_argument(message(component, name, " has shape ", t.shape_string(), "; expected ",
                                       detail::shape_string(std::vector<std::int64_t>(expected.begin(), expected.end()))));
}

/// @brief Empty view (`{}`): no data and rank 0, the "skip this argument" value.
template <class T>
bool is_empty_view(const tensor_ref<T>& t) {
    return t.data == nullptr && t.rank == 0;
}

/// @brief Checks ids, tables, x and the (L, L_k)- or (L, D)-shaped buffer `y` (out or grad_out) of
/// a term call (L_k = ids.key_length(), L unless keys at positions of another count: then x is
/// (B, H, L_k, D) for the query target, whose x is k); returns the kernel sizes. `mapping`: the term's mapping key (ids must hold it).
/// @throws rpe::invalid_argument `[rpe.term] ...` naming the argument and its shape.
template <class S>
term_dims check_term_call(const term_layout& lay, const mapping_key_base& mapping, const bucket_ids& ids,
                          std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x, tensor_ref<const S> y,
                          const char* y_name) {
    require(static_cast<int>(tables.size()) == lay.num_tables, "term", "tables holds ", tables.size(), " tables; expected ",
            lay.num_tables);
    if (!(ids.key().mapping && ids.key().mapping->equals(mapping)))
        throw invalid_argument(message("term",
                                       "bucket ids were built for another mapping (type or alpha/beta/gamma); "
                                       "expected this term's mapping"));
    require(ids.skip() == lay.skip, "term", "bucket ids have skip = ", ids.skip(), "; expected this term's skip = ", lay.skip);
    require(ids.num_tables() == lay.num_tables, "term", "bucket ids hold ", ids.num_tables(), " tables; expected ",
            lay.num_tables);
    const std::int64_t n = ids.length(), nk = ids.key_length();
    term_dims d;
    d.length = n;
    d.key_length = nk;
    const auto lengths = [&] { return n == nk ? concat("L = ", n) : concat("L = ", n, ", L_k = ", nk); };  // on failure only
    d.buckets = lay.num_buckets;
    d.dim = lay.head_dim;
    d.heads = lay.num_heads;
    d.table_heads = lay.table_heads();
    const auto shape = lay.table_extents();
    const std::span<const std::int64_t> table_shape(shape.data(), static_cast<std::size_t>(lay.table_rank()));
    for (int t = 0; t < lay.num_tables; ++t)
        require_extents(tables[static_cast<std::size_t>(t)], table_shape, "term", table_name(lay.num_tables, t));
    if (lay.bias) {
        if (!(y.rank == 4 && y.extent(0) >= 1 && (y.extent(1) == d.table_heads || y.extent(1) == d.heads) && y.extent(2) == n &&
              y.extent(3) == nk))
            throw invalid_argument(
                message("term", y_name, " has shape ", y.shape_string(), "; expected (B >= 1, ",
                        (d.heads == d.table_heads ? std::to_string(d.heads)
                                                  : std::to_string(d.heads) + " or " + std::to_string(d.table_heads)),
                        n == nk ? ", L, L) with " : ", L, L_k) with ", lengths(), " (bucket ids: skip ", ids.skip(), " + ",
                        ids.grid_string(), ")"));
        require(is_empty_view(x), "term", "x must be empty ({}) in bias mode: the bias term does not read an input");
        d.batch = y.extent(0);
    } else {
        const bool value = lay.target == rpe::target::value, query = lay.target == rpe::target::query;
        // x: a (L, L_k) for v, q (L rows) for the key target, k (L_k rows) for the query target
        const std::int64_t x_rows = query ? nk : n, x_last = value ? nk : d.dim;
        if (!(x.rank == 4 && x.extent(0) >= 1 && x.extent(1) == d.heads && x.extent(2) == x_rows && x.extent(3) == x_last))
            throw invalid_argument(message("term", "x has shape ", x.shape_string(), "; expected (B >= 1, ", d.heads, ", ",
                                           x_rows, ", ", x_last, ") with ", lengths(),
                                           n == nk ? " = skip " : " (bucket ids: skip ", ids.skip(), " + ", ids.grid_string(),
                                           n == nk ? "" : ")"));
        d.batch = x.extent(0);
        const std::array<std::int64_t, 4> y_shape{d.batch, d.heads, n, value ? d.dim : nk};
        require_extents(y, y_shape, "term", y_name);
        check_nonnull(x, "term", "x");
    }
    check_nonnull(y, "term", y_name);
    for (int t = 0; t < lay.num_tables; ++t)
        check_nonnull(tables[static_cast<std::size_t>(t)], "term", table_name(lay.num_tables, t));
    return d;
}

/// @brief Every check of a term's forward: check_term_call, then `out` separate from x and the tables.
/// @throws rpe::invalid_argument `[rpe.term] ...`.
template <class S>
term_dims check_term_forward(const term_layout& lay, const mapping_key_base& mapping, const bucket_ids& ids,
                             std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x, tensor_ref<S> out) {
    const term_dims d = check_term_call<S>(lay, mapping, ids, tables, x, out, "out");
    check_no_overlap(out, x, "term", "out", "x");
    for (int t = 0; t < lay.num_tables; ++t)
        check_no_overlap(out, tables[static_cast<std::size_t>(t)], "term", "out", table_name(lay.num_tables, t));
    return d;
}

/// @brief Every check of a term's backward: check_term_call on grad_out, then each requested
/// output (`grad_x` unless empty, each `grad_tables[t]` unless empty) with the right shape,
/// non-null and separate from every input and every other output; `grad_x` must be empty in bias
/// mode. Returns the kernel sizes. @throws rpe::invalid_argument `[rpe.term] ...`.
template <class S>
term_dims check_term_backward(const term_layout& lay, const mapping_key_base& mapping, const bucket_ids& ids,
                              std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x, tensor_ref<const S> grad_out,
                              tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables) {
    const term_dims d = check_term_call<S>(lay, mapping, ids, tables, x, grad_out, "grad_out");
    require(static_cast<int>(grad_tables.size()) == lay.num_tables, "term", "grad_tables holds ", grad_tables.size(),
            " tables; expected ", lay.num_tables);
    const auto shape = lay.table_extents();
    const std::span<const std::int64_t> table_shape(shape.data(), static_cast<std::size_t>(lay.table_rank()));
    for (int t = 0; t < lay.num_tables; ++t) {
        const auto& g = grad_tables[static_cast<std::size_t>(t)];
        if (is_empty_view(g)) continue;
        const char* name = indexed_table_name(t, true);
        require_extents(g, table_shape, "term", name);
        check_nonnull(g, "term", name);
        for (int u = 0; u < lay.num_tables; ++u) {
            check_no_overlap(g, tables[static_cast<std::size_t>(u)], "term", name, indexed_table_name(u));
            if (u < t) check_no_overlap(g, grad_tables[static_cast<std::size_t>(u)], "term", name, indexed_table_name(u, true));
        }
        check_no_overlap(g, grad_out, "term", name, "grad_out");
        check_no_overlap(g, x, "term", name, "x");
    }
    if (lay.bias) {
        require(is_empty_view(grad_x), "term", "grad_x must be empty ({}) in bias mode: the bias term has no input");
    } else if (!is_empty_view(grad_x)) {
        require_extents(grad_x, std::span<const std::int64_t>(x.shape.data(), static_cast<std::size_t>(x.rank)), "term",
                        "grad_x");
        check_nonnull(grad_x, "term", "grad_x");
        check_no_overlap(grad_x, grad_out, "term", "grad_x", "grad_out");
        check_no_overlap(grad_x, x, "term", "grad_x", "x");
        for (int t = 0; t < lay.num_tables; ++t) {
            check_no_overlap(grad_x, tables[static_cast<std::size_t>(t)], "term", "grad_x", indexed_table_name(t));
            check_no_overlap(grad_x, grad_tables[static_cast<std::size_t>(t)], "term", "grad_x", indexed_table_name(t, true));
        }
    }
    return d;
}

}  // namespace rpe::detail
