/// @file detail/validate.hpp
/// @brief Host-side parameter checks shared by the policies (not API).
#pragma once

#include <type_traits>

#include "math.hpp"
#include "raise.hpp"

namespace rpe::detail {

/// @brief Index-range limit: β must stay below 2^30 so that ids and table sizes fit in int.
inline constexpr double max_beta = 1073741824.0;

/// @brief Checks α, β, γ of the piecewise index: finite, α > 0, β ≥ α, γ > α, β < 2^30, and
/// the two values index::piecewise computes from them in limited precision:
/// - `float(α)` must be a normal float32 (≥ 2^-126 ≈ 1.1754944e-38): the index divides `|x|` by
///   it, so `float(α) = 0` (α < 7.0e-46, e.g. 1e-310) divides by zero, and a subnormal
///   `float(α)` is 0 wherever subnormals are flushed (CUDA `-ftz`, `-ffast-math` hosts);
/// - `γ/α` (double) must be finite: `ln(γ/α)` is the divisor of the log part, and γ/α beyond
///   1.8e308 (γ = 1e300 with α = 1e-10) makes it infinite, so every |x| > α would get round(α).
/// β needs no such check: α ≤ β < 2^30, so float(β), float(β − α) neither overflow nor
/// underflow to a value the index divides by.
/// @throws rpe::invalid_argument `[rpe.<component>] alpha = ... must be ...`, `alpha = 1e-310
///   underflows float32 ...`, `gamma / alpha = ... overflows double ...`.
inline void validate_alpha_beta_gamma(const char* component, double alpha, double beta, double gamma) {
    require(math::isfinite(alpha), component, "alpha = ", alpha, " must be finite");
    require(math::isfinite(beta), component, "beta = ", beta, " must be finite");
    require(math::isfinite(gamma), component, "gamma = ", gamma, " must be finite");
    require(alpha > 0.0, component, "alpha = ", alpha, " must be > 0");
    require(beta >= alpha, component, "beta = ", beta, " must be >= alpha = ", alpha);
    require(gamma > alpha, component, "gamma = ", gamma, " must be > alpha = ", alpha);
    require(beta < max_beta, component, "beta = ", beta, " must be < 2^30");
    require(static_cast<float>(alpha) >= __FLT_MIN__, component, "alpha = ", alpha,
            " underflows float32 (float(alpha) = ", static_cast<float>(alpha),
            ", the index divides by it); expected float(alpha) >= 1.1754943508222875e-38, the smallest normal float32");
    require(math::isfinite(gamma / alpha), component, "gamma / alpha = ", gamma, " / ", alpha,
            " overflows double (ln(gamma / alpha) would be infinite); expected gamma / alpha <= 1.7976931348623157e+308");
}

/// @brief Checks the β of the clip index: finite, 0 ≤ β < 2^30.
inline void validate_clip_beta(const char* component, double beta) {
    require(math::isfinite(beta), component, "beta = ", beta, " must be finite");
    require(beta >= 0.0, component, "beta = ", beta, " must be >= 0");
    require(beta < max_beta, component, "beta = ", beta, " must be < 2^30");
}

/// @brief Checks that `value` is one of the `count` enumerators `0 .. count-1` of its scoped enum
/// (a value made by `static_cast<E>(7)` is not).
/// @param name the parameter as the caller spells it, e.g. `"storage"`.
/// @param expected the enumerators' names, e.g. `"automatic, table or on_the_fly"`.
/// @throws rpe::invalid_argument `[rpe.<component>] <name> = 7; expected <expected>`.
template <class E>
void require_enum(E value, int count, const char* component, const char* name, const char* expected) {
    static_assert(std::is_enum_v<E>, "rpe: require_enum checks an enum value");
    const auto v = static_cast<long long>(static_cast<std::underlying_type_t<E>>(value));
    require(v >= 0 && v < count, component, name, " = ", v, "; expected ", expected);
}

}  // namespace rpe::detail
