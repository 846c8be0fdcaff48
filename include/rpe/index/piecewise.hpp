/// @file index/piecewise.hpp
/// @brief The piecewise index function of iRPE (paper eq. 18), bit-exact with the reference.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "../detail/bucket_count.hpp"
#include "../detail/float.hpp"
#include "../detail/math.hpp"
#include "../detail/validate.hpp"

namespace rpe::index {

/// @brief Piecewise index g (paper eq. 18): exact up to α, log-spaced from α to γ, capped at β.
///
/// `g(x) = round(x)` when `|x| ≤ α`; otherwise `trunc(sign(x)·min(round(v), β))` with
/// `v = α + ln(|x|/α) / ln(γ/α) · (β − α)`. Output in `[−beta_int(), beta_int()]` with
/// `beta_int() = int(β)` (truncation: β = 3.8 caps at 3).
///
/// Numerics follow the reference recipe exactly (its `piecewise_index`): `α`, `ln(γ/α)` and `β − α` are computed
/// in double and then cast to float32; `v` is evaluated step by step in float32 (`logf`);
/// `round` is half to even (the default rounding mode, as torch.round); the cap compares with
/// `float(β)`. An all-double or all-float evaluation, or `std::round`, gives other buckets for
/// some configurations. The result is finally clamped to `[−βi, βi]`, which changes no index the
/// reference keeps inside its table: it only stops the float rounding of `α` or `β` from giving
/// one beyond it (`β = α = 3.9999999999`: `float(α) = 4`, so g(4) was 4 > βi = 3; `β =
/// 1073741823.5`: `float(β) = 2^30`), where the reference would index out of its table (found by
/// fuzz/fuzz_index.cpp).
///
/// Fields are public (aggregate): `rpe::index::piecewise{.alpha = 1.9, .beta = 3.8, .gamma = 15.2}`.
/// Valid parameters: finite, `α > 0`, `β ≥ α`, `γ > α`, `β < 2^30`; checked by `validate()`,
/// which the term and bucket-id builders call once on the host.
/// Source: paper eq. 18; reference `piecewise_index` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
struct piecewise {
    double alpha = 1.9;   ///< α: offsets with |x| ≤ α keep their own index
    double beta = 3.8;    ///< β: the cap (may be non-integer; the index range is ±int(β))
    double gamma = 15.2;  ///< γ: the offset at which the log part reaches β

    /// @brief The reference's parameters from one ratio: `α = r, β = 2r, γ = 8r` (Python floats).
    static constexpr piecewise from_ratio(double ratio) { return {ratio, 2.0 * ratio, 8.0 * ratio}; }

    /// @brief `int(β)`: the output lies in `[−beta_int(), beta_int()]` (saturated at INT_MAX for a β
    /// beyond int, which validate() refuses: no undefined conversion before it runs).
    RPE_HOST_DEVICE constexpr int beta_int() const { return detail::saturating_int(beta); }

    /// @brief g at an integer offset (the reference's long input).
    RPE_HOST_DEVICE int operator()(std::int64_t x) const {
        const float xf = static_cast<float>(x);
        if (detail::math::fabs(xf) <= static_cast<float>(alpha)) return clamp_to_beta(x);
        return outer(xf);
    }

    /// @brief g at a real input (a distance): `round_half_even(x)` inside `|x| ≤ α`.
    RPE_HOST_DEVICE int operator()(float x) const {
        if (detail::math::fabs(x) <= static_cast<float>(alpha))
            return clamp_to_beta(static_cast<std::int64_t>(detail::math::nearbyint(x)));
        return outer(x);
    }

    /// @brief Throws rpe::invalid_argument `[rpe.index.piecewise] ...` for invalid α, β, γ.
    void validate() const { detail::validate_alpha_beta_gamma("index.piecewise", alpha, beta, gamma); }

    friend constexpr bool operator==(const piecewise&, const piecewise&) = default;

private:
    // |x| > α branch, float32 step by step as the reference.
    RPE_HOST_DEVICE int outer(float x) const {
        const float alpha_f = static_cast<float>(alpha);
        const float log_gamma_alpha_f = static_cast<float>(detail::math::log(gamma / alpha));
        const float beta_alpha_f = static_cast<float>(beta - alpha);
        const float beta_f = static_cast<float>(beta);
        float t = detail::math::fabs(x) / alpha_f;
        t = detail::math::log(t);  // float overload: logf
        t = t / log_gamma_alpha_f;
        t = detail::mul_no_contract(t, beta_alpha_f);  // no fused multiply-add: the reference rounds here
        const float v = alpha_f + t;
        const float r = detail::math::fmin(detail::math::nearbyint(v), beta_f);
        const float s = x > 0.0f ? r : -r;
        return clamp_to_beta(static_cast<std::int64_t>(s));  // truncation toward zero; |s| <= float(β) <= 2^30
    }

    // [−βi, βi]: float(α) or float(β) may round up beyond βi.
    RPE_HOST_DEVICE constexpr int clamp_to_beta(std::int64_t v) const {
        const std::int64_t b = beta_int();
        return static_cast<int>(v < -b ? -b : (v > b ? b : v));
    }
};

}  // namespace rpe::index
