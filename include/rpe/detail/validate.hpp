/// @file detail/validate.hpp
/// @brief Host-side parameter checks shared by the policies (not API).
#pragma once

#include <cmath>
#include <string>

#include "../error.hpp"

namespace rpe::detail {

/// @brief Index-range limit: β must stay below 2^30 so that ids and table sizes fit in int.
inline constexpr double max_beta = 1073741824.0;

/// @brief Checks α, β, γ of the piecewise index: finite, α > 0, β ≥ α, γ > α, β < 2^30.
/// @throws rpe::invalid_argument `[rpe.<component>] alpha = ... must be ...`.
inline void validate_alpha_beta_gamma(const char* component, double alpha, double beta, double gamma) {
    require(std::isfinite(alpha), component, "alpha = ", alpha, " must be finite");
    require(std::isfinite(beta), component, "beta = ", beta, " must be finite");
    require(std::isfinite(gamma), component, "gamma = ", gamma, " must be finite");
    require(alpha > 0.0, component, "alpha = ", alpha, " must be > 0");
    require(beta >= alpha, component, "beta = ", beta, " must be >= alpha = ", alpha);
    require(gamma > alpha, component, "gamma = ", gamma, " must be > alpha = ", alpha);
    require(beta < max_beta, component, "beta = ", beta, " must be < 2^30");
}

/// @brief Checks the β of the clip index: finite, 0 ≤ β < 2^30.
inline void validate_clip_beta(const char* component, double beta) {
    require(std::isfinite(beta), component, "beta = ", beta, " must be finite");
    require(beta >= 0.0, component, "beta = ", beta, " must be >= 0");
    require(beta < max_beta, component, "beta = ", beta, " must be < 2^30");
}

}  // namespace rpe::detail
