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
#include <string>
#include <string_view>
#include <type_traits>

#include "any_term.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "families.hpp"
#include "mode.hpp"

namespace rpe {

/// @brief The iRPE mappings known by name at run time: the first six built-in families of
/// <rpe/families.hpp> (rpe::builtin_family), in the same order.
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

namespace detail {

/// The six method names, "a, b, ... or f" (from the registry).
inline std::string method_names() {
    std::string s;
    for (int m = 0; m < 6; ++m)
        s += (m == 0 ? "" : (m == 5 ? " or " : ", ")) + families().entries().at(static_cast<std::size_t>(m))->info.name;
    return s;
}

}  // namespace detail

/// @brief The registry name of a method ("euclidean", ...).
inline std::string method_name(method m) {
    detail::require_enum(m, 6, "term_spec", "method", detail::method_names().c_str());
    return families().entries().at(static_cast<std::size_t>(m))->info.name;
}

/// @brief Parses a method name: "euclidean" (or the reference's "euc"), "quantization" ("quant"),
/// "cross", "product", "euclidean_paper", "quantization_paper" (the iRPE families of the registry).
/// @throws rpe::invalid_argument `[rpe.term_spec] method = '...'; expected one of ...`.
inline method parse_method(std::string_view name) {
    const auto e = families().find(name);
    if (e && e->builtin >= 0 && e->builtin < 6 && e->info.name == name) return static_cast<method>(e->builtin);
    if (e && e->builtin >= 0 && e->builtin < 6) {  // an alias: one without presets names the method
        for (const auto& a : e->info.aliases)
            if (a.name == name && a.presets.empty()) return static_cast<method>(e->builtin);
    }
    throw invalid_argument(detail::message("term_spec", "method = '", name, "'; expected ", detail::method_names()));
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
        detail::require_enum(method, 6, "term_spec", "method", detail::method_names().c_str());
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

/// @brief The registry spec of `spec`'s mapping: family = the method's name, index, α, β, γ.
/// @throws rpe::invalid_argument for a method or index outside its enum.
inline family_spec to_family_spec(const term_spec& spec) {
    detail::require_enum(spec.index, 2, "term_spec", "index", "piecewise or clip");
    family_spec f = families().defaults(method_name(spec.method));
    f.set("index", spec.index == index_kind::clip ? 1 : 0)
        .set("alpha", spec.alpha)
        .set("beta", spec.beta)
        .set("gamma", spec.gamma);
    return f;
}

/// @brief Builds the term of family `spec` (any mapping family of the registry, a user's
/// included) with mode, target and shape `o`, on grid `g` (for the families whose window or β
/// follows the grid; 0 × 0 when the spec gives them), in scalar type S (float or double).
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for an unknown family, a mode or target
///   the family does not take; the mapping's and rpe::term's own errors.
/// Build cost: instantiates every built-in mapping's id builder (see the file comment).
template <class S = float>
std::unique_ptr<any_term<S>> make_term(const family_spec& spec, const term_options& o, grid_extent g = {}) {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>,
                  "rpe: make_term's scalar type must be float or double (for rpe::bf16 / rpe::f16 storage, run a float term's "
                  "descriptor with rpe::cpu::term_forward<rpe::bf16 or rpe::f16> / term_backward)");
    check_family_terms(family_of(spec.family), o.contextual, o.target);
    return visit_mapping(spec, g, [&](const auto& m) { return term_of<S>(m, o); });
}

/// @brief Builds the term that `spec` describes, in scalar type S (float or double).
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for bias mode on values, an index, method
///   or target outside its enum, and as rpe::term's constructor (invalid α, β, γ, heads,
///   head_dim, skip).
/// Source: reference `get_single_rpe_config` + `build_rpe` (microsoft/Cream, iRPE `irpe.py`).
/// Build cost: this instantiates every built-in mapping's id builder and five term kernel sets;
/// a program that links the instantiation unit defines RPE_EXTERN_MAKE_TERM to skip that here.
template <class S = float>
std::unique_ptr<any_term<S>> make_term(const term_spec& spec) {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>,
                  "rpe: make_term's scalar type must be float or double (for rpe::bf16 / rpe::f16 storage, run a float term's "
                  "descriptor with rpe::cpu::term_forward<rpe::bf16 or rpe::f16> / term_backward)");
    (void)spec.num_buckets();  // validates α, β, γ with the term_spec prefix
    return make_term<S>(to_family_spec(spec),
                        term_options{spec.contextual, spec.target, spec.num_heads, spec.head_dim, spec.shared_head, spec.skip});
}

#if defined(RPE_EXTERN_MAKE_TERM)
// Instantiated once in the program's instantiation unit, src/make_term.cpp (CMake: rpe::make_term for a
// user's program, the object library rpe_make_term for rpe's own).
extern template std::unique_ptr<any_term<float>> make_term<float>(const term_spec&);
extern template std::unique_ptr<any_term<double>> make_term<double>(const term_spec&);
extern template std::unique_ptr<any_term<float>> make_term<float>(const family_spec&, const term_options&, grid_extent);
extern template std::unique_ptr<any_term<double>> make_term<double>(const family_spec&, const term_options&, grid_extent);
#endif

}  // namespace rpe
