/// @file any_term.hpp
/// @brief Run-time configured terms: rpe::term_spec (the reference's rpe config), rpe::any_term
/// (a type-erased term) and rpe::make_term, for configurations read from files or command lines.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"
#include "index/clip.hpp"
#include "index/piecewise.hpp"
#include "mapping/cross.hpp"
#include "mapping/euclidean.hpp"
#include "mapping/product.hpp"
#include "mapping/quantization.hpp"
#include "mode.hpp"
#include "term.hpp"

namespace rpe {

/// @brief The 2D mappings known by name at run time.
enum class method {
    euclidean,           ///< mapping::euclidean (reference code, rounded distance; reference id 0)
    quantization,        ///< mapping::quantization (reference code, squared distance; id 1)
    cross,               ///< mapping::cross (two tables; ids 41, 42)
    product,             ///< mapping::product (id 3)
    euclidean_paper,     ///< mapping::euclidean_paper (unrounded distance)
    quantization_paper,  ///< mapping::quantization_paper (eq. 21 rank)
};

/// @brief The index functions known by name at run time.
enum class index_kind {
    piecewise,  ///< index::piecewise (eq. 18), the reference's
    clip,       ///< index::clip (Shaw et al.), uses beta only
};

/// @brief Parses a method name: "euclidean" (or the reference's "euc"), "quantization" ("quant"),
/// "cross", "product", "euclidean_paper", "quantization_paper".
/// @throws rpe::invalid_argument `[rpe.term_spec] method = '...'; expected one of ...`.
inline method parse_method(std::string_view name) {
    if (name == "euclidean" || name == "euc") return method::euclidean;
    if (name == "quantization" || name == "quant") return method::quantization;
    if (name == "cross") return method::cross;
    if (name == "product") return method::product;
    if (name == "euclidean_paper") return method::euclidean_paper;
    if (name == "quantization_paper") return method::quantization_paper;
    throw invalid_argument(detail::message("term_spec", "method = '", name,
                                           "'; expected euclidean, quantization, cross, product, euclidean_paper or quantization_paper"));
}

/// @brief Parses a mode name: "bias" or "contextual" (or the reference's "ctx"); returns true for contextual.
/// @throws rpe::invalid_argument `[rpe.term_spec] mode = '...'`.
inline bool parse_contextual(std::string_view name) {
    if (name == "contextual" || name == "ctx") return true;
    if (name == "bias") return false;
    throw invalid_argument(detail::message("term_spec", "mode = '", name, "'; expected bias or contextual"));
}

/// @brief Parses a target letter or word: q/query, k/key, v/value.
/// @throws rpe::invalid_argument `[rpe.term_spec] target = '...'`.
inline target parse_target(std::string_view name) {
    if (name == "q" || name == "query") return target::query;
    if (name == "k" || name == "key") return target::key;
    if (name == "v" || name == "value") return target::value;
    throw invalid_argument(detail::message("term_spec", "target = '", name, "'; expected q, k or v"));
}

/// @brief A term's whole configuration as run-time values, as the reference's
/// `get_single_rpe_config` + `build_rpe` take them.
///
/// `num_buckets()` reports K exactly as the reference: `(2βi+1)²` for Product, `2βi+1` otherwise,
/// plus one extra bucket when `skip > 0`.
struct term_spec {
    rpe::method method = rpe::method::product;  ///< the mapping
    index_kind index = index_kind::piecewise;   ///< the index function
    bool contextual = true;                     ///< contextual (true) or bias (false) mode
    rpe::target target = rpe::target::key;      ///< q, k or v
    double alpha = 1.9;                         ///< α (piecewise)
    double beta = 3.8;                          ///< β (piecewise cap; clip range)
    double gamma = 15.2;                        ///< γ (piecewise)
    bool shared_head = true;                    ///< one table for all heads
    int skip = 1;                               ///< extra tokens (class token) before the grid
    int num_heads = 1;                          ///< H
    int head_dim = 1;                           ///< D

    /// @brief Sets α = r, β = 2r, γ = 8r as the reference's `ratio`.
    term_spec& ratio(double r) {
        alpha = r;
        beta = 2.0 * r;
        gamma = 8.0 * r;
        return *this;
    }

    /// @brief K, the extra bucket included, as the reference's `get_num_buckets` (+1 with skip).
    /// @throws rpe::invalid_argument for invalid α, β, γ, or a method, index or target that is not
    ///   one of its enumerators (`[rpe.term_spec] index = 7; expected piecewise or clip`).
    [[nodiscard]] int num_buckets() const {
        detail::require_enum(method, 6, "term_spec", "method", "euclidean, quantization, cross, product, euclidean_paper or quantization_paper");
        detail::require_enum(index, 2, "term_spec", "index", "piecewise or clip");
        detail::require_enum(target, 3, "term_spec", "target", "query, key or value");
        if (index == index_kind::piecewise)
            detail::validate_alpha_beta_gamma("term_spec", alpha, beta, gamma);
        else
            detail::validate_clip_beta("term_spec", beta);
        const std::int64_t span = 2 * static_cast<std::int64_t>(beta) + 1;
        const std::int64_t k = (method == rpe::method::product ? span * span : span) + (skip > 0 ? 1 : 0);
        detail::require(k < 2147483647, "term_spec", "num_buckets = ", k, " for beta = ", beta, "; expected < 2^31 - 1");
        return static_cast<int>(k);
    }
};

/// @brief A term of any compile-time type behind one run-time interface (virtual calls per
/// forward/backward, nothing per element). Tables are passed as spans of 1 (or 2 for Cross) views.
/// Shapes, errors and guarantees are those of rpe::term.
template <class S>
class any_term {
public:
    virtual ~any_term() = default;
    [[nodiscard]] virtual int num_tables() const = 0;                       ///< 1, or 2 for Cross
    [[nodiscard]] virtual int num_buckets() const = 0;                      ///< K with the extra bucket
    [[nodiscard]] virtual int num_heads() const = 0;                        ///< H
    [[nodiscard]] virtual int head_dim() const = 0;                         ///< D
    [[nodiscard]] virtual int skip() const = 0;                             ///< extra tokens
    [[nodiscard]] virtual bool contextual() const = 0;                      ///< mode
    [[nodiscard]] virtual rpe::target target() const = 0;                   ///< q, k or v
    [[nodiscard]] virtual std::vector<std::int64_t> table_shape() const = 0;  ///< each table's shape
    /// @brief The shared bucket ids (global cache) of this term on a depth × height × width grid
    /// (depth > 1 needs a 3D mapping), held as `storage` says. @throws as bucket_cache::get.
    [[nodiscard]] virtual std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                            id_storage storage) const = 0;
    /// @brief bucket_ids(depth, height, width, id_storage::automatic).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width) const {
        return bucket_ids(depth, height, width, id_storage::automatic);
    }
    /// @brief The shared bucket ids of this term on a height × width grid (automatic storage).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width) const {
        return bucket_ids(1, height, width, id_storage::automatic);
    }
    /// @brief rpe::term::forward. @throws rpe::invalid_argument when tables.size() != num_tables().
    virtual void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                         tensor_ref<S> out, write mode = write::overwrite) const = 0;
    /// @brief rpe::term::backward. @throws rpe::invalid_argument when a span's size != num_tables().
    virtual void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                          tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                          write mode = write::overwrite) const = 0;
};

namespace detail {

template <class Term>
class any_term_impl final : public any_term<typename Term::scalar_type> {
    using S = typename Term::scalar_type;
    static constexpr int n = Term::num_tables;

    template <class T>
    static std::array<tensor_ref<T>, n> to_array(std::span<const tensor_ref<T>> s, const char* name) {
        require(static_cast<int>(s.size()) == n, "term", name, " holds ", s.size(), " tables; expected ", n);
        std::array<tensor_ref<T>, n> a;
        for (int i = 0; i < n; ++i) a[static_cast<std::size_t>(i)] = s[static_cast<std::size_t>(i)];
        return a;
    }

public:
    explicit any_term_impl(Term t) : term_(std::move(t)) {}
    [[nodiscard]] int num_tables() const override { return n; }
    [[nodiscard]] int num_buckets() const override { return term_.num_buckets(); }
    [[nodiscard]] int num_heads() const override { return term_.num_heads(); }
    [[nodiscard]] int head_dim() const override { return term_.head_dim(); }
    [[nodiscard]] int skip() const override { return term_.skip(); }
    [[nodiscard]] bool contextual() const override { return !Term::is_bias; }
    [[nodiscard]] rpe::target target() const override { return Term::target_kind; }
    [[nodiscard]] std::vector<std::int64_t> table_shape() const override { return term_.table_shape(); }
    using any_term<S>::bucket_ids;
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                    id_storage storage) const override {
        return term_.bucket_ids(depth, height, width, storage);
    }
    void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                 tensor_ref<S> out, write mode) const override {
        term_.forward(ids, to_array(tables, "tables"), x, out, mode);
    }
    void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                  write mode) const override {
        term_.backward(ids, to_array(tables, "tables"), x, grad_out, grad_x, to_array(grad_tables, "grad_tables"), mode);
    }

private:
    Term term_;
};

template <class S, class M>
std::unique_ptr<any_term<S>> make_term_for(const M& m, const term_spec& spec) {
    auto wrap = [&]<class Md, target Tg>() -> std::unique_ptr<any_term<S>> {
        using T = term<M, Md, Tg, S>;
        return std::make_unique<any_term_impl<T>>(T(m, spec.num_heads, spec.head_dim, spec.shared_head, spec.skip));
    };
    if (spec.contextual) {
        switch (spec.target) {
            case target::query: return wrap.template operator()<mode::contextual, target::query>();
            case target::key: return wrap.template operator()<mode::contextual, target::key>();
            case target::value: return wrap.template operator()<mode::contextual, target::value>();
        }
    } else {
        switch (spec.target) {
            case target::query: return wrap.template operator()<mode::bias, target::query>();
            case target::key: return wrap.template operator()<mode::bias, target::key>();
            case target::value:
                throw invalid_argument(message("term_spec", "mode = bias with target = v: bias mode on values does not exist "
                                                            "(paper eq. 17; the reference raises NotImplementedError)"));
        }
    }
    throw invalid_argument(message("term_spec", "target = ", static_cast<int>(spec.target), " is not a target"));
}

template <class S, class I>
std::unique_ptr<any_term<S>> make_term_with_index(const I& g, const term_spec& spec) {
    switch (spec.method) {
        case method::euclidean: return make_term_for<S>(mapping::euclidean<I>{g}, spec);
        case method::quantization: return make_term_for<S>(mapping::quantization<I>{g}, spec);
        case method::cross: return make_term_for<S>(mapping::cross<I>{g}, spec);
        case method::product: return make_term_for<S>(mapping::product<I>{g}, spec);
        case method::euclidean_paper: return make_term_for<S>(mapping::euclidean_paper<I>{g}, spec);
        case method::quantization_paper: return make_term_for<S>(mapping::quantization_paper<I>{g}, spec);
    }
    throw invalid_argument(message("term_spec", "method = ", static_cast<int>(spec.method), " is not a method"));
}

}  // namespace detail

/// @brief Wraps a compile-time term (any mapping, custom ones included) as an any_term.
template <class Term>
std::unique_ptr<any_term<typename Term::scalar_type>> make_any_term(Term t) {
    return std::make_unique<detail::any_term_impl<Term>>(std::move(t));
}

/// @brief Builds the term that `spec` describes, in scalar type S (float or double).
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for bias mode on values, and as
///   rpe::term's constructor (invalid α, β, γ, heads, head_dim, skip).
/// Source: reference `get_single_rpe_config` + `build_rpe` in microsoft/Cream `iRPE/.../irpe.py`.
template <class S = float>
std::unique_ptr<any_term<S>> make_term(const term_spec& spec) {
    (void)spec.num_buckets();  // validates α, β, γ with the term_spec prefix
    if (spec.index == index_kind::clip) return detail::make_term_with_index<S>(index::clip{spec.beta}, spec);
    return detail::make_term_with_index<S>(index::piecewise{spec.alpha, spec.beta, spec.gamma}, spec);
}

}  // namespace rpe
