/// @file make_term.hpp
/// @brief Run-time configured terms: rpe::term_spec (the reference's rpe config) and
/// rpe::make_term, for configurations read from files or command lines.
///
/// Not part of the umbrella <rpe/rpe.hpp>: make_term instantiates the id builder of every
/// built-in mapping, so only the translation units that use it pay for it. A program with several
/// such units links the CMake target rpe::make_term, which adds the one unit that instantiates it
/// and defines RPE_EXTERN_MAKE_TERM for the others; without CMake, instantiate it in one unit
/// (`template std::unique_ptr<rpe::any_term<float>> rpe::make_term<float>(const rpe::term_spec&);`,
/// and the same for double) and define RPE_EXTERN_MAKE_TERM in the others.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>

#include "any_term.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "index/clip.hpp"
#include "index/piecewise.hpp"
#include "mapping/cross.hpp"
#include "mapping/euclidean.hpp"
#include "mapping/product.hpp"
#include "mapping/quantization.hpp"
#include "mode.hpp"

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

namespace detail {

template <class S, class I>
std::unique_ptr<any_term<S>> make_term_with_index(const I& g, const term_spec& spec) {
    std::shared_ptr<const id_source> ids;
    int tables = 1;
    switch (spec.method) {
        case method::euclidean: ids = std::make_shared<id_source_for<mapping::euclidean<I>>>(mapping::euclidean<I>{g}); break;
        case method::quantization: ids = std::make_shared<id_source_for<mapping::quantization<I>>>(mapping::quantization<I>{g}); break;
        case method::cross:
            ids = std::make_shared<id_source_for<mapping::cross<I>>>(mapping::cross<I>{g});
            tables = 2;
            break;
        case method::product: ids = std::make_shared<id_source_for<mapping::product<I>>>(mapping::product<I>{g}); break;
        case method::euclidean_paper:
            ids = std::make_shared<id_source_for<mapping::euclidean_paper<I>>>(mapping::euclidean_paper<I>{g});
            break;
        case method::quantization_paper:
            ids = std::make_shared<id_source_for<mapping::quantization_paper<I>>>(mapping::quantization_paper<I>{g});
            break;
        default:
            throw invalid_argument(message("term_spec", "method = ", static_cast<int>(spec.method),
                                           "; expected euclidean, quantization, cross, product, euclidean_paper or quantization_paper"));
    }
    return make_runtime_term<S>(std::move(ids), tables, spec.contextual, spec.target, spec.num_heads, spec.head_dim,
                                spec.shared_head, spec.skip);
}

}  // namespace detail

/// @brief Builds the term that `spec` describes, in scalar type S (float or double).
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for bias mode on values, an index, method
///   or target outside its enum, and as rpe::term's constructor (invalid α, β, γ, heads,
///   head_dim, skip).
/// Source: reference `get_single_rpe_config` + `build_rpe` (microsoft/Cream, iRPE `irpe.py`).
/// Build cost: this instantiates every built-in mapping's id builder and five term kernel sets;
/// a program that links the instantiation unit defines RPE_EXTERN_MAKE_TERM to skip that here.
template <class S = float>
std::unique_ptr<any_term<S>> make_term(const term_spec& spec) {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "rpe: the scalar type must be float or double");
    (void)spec.num_buckets();  // validates α, β, γ with the term_spec prefix
    switch (spec.index) {
        case index_kind::clip: return detail::make_term_with_index<S>(index::clip{spec.beta}, spec);
        case index_kind::piecewise:
            return detail::make_term_with_index<S>(index::piecewise{spec.alpha, spec.beta, spec.gamma}, spec);
    }
    throw invalid_argument(detail::message("term_spec", "index = ", static_cast<int>(spec.index), "; expected piecewise or clip"));
}

#if defined(RPE_EXTERN_MAKE_TERM)
// Instantiated once in the program's instantiation unit (rpe's own tools: tools/common/make_term.cpp).
extern template std::unique_ptr<any_term<float>> make_term<float>(const term_spec&);
extern template std::unique_ptr<any_term<double>> make_term<double>(const term_spec&);
#endif

}  // namespace rpe
