/// @file detail/math.hpp
/// @brief The few math functions of the policies, without `<cmath>` (not API).
///
/// `<cmath>` alone preprocesses to ~24k lines, and the policy headers are included everywhere.
/// On the host these are the compilers' builtins (GCC and Clang), the very functions libstdc++'s
/// and libc++'s `std::` overloads call (`std::log(float)` is `__builtin_logf`), so results are
/// bit-identical; in CUDA device code they are CUDA's math functions, as `std::` would give there.
#pragma once

#include "../config.hpp"

#if defined(_MSC_VER) && !defined(__clang__)
#include <cmath>
#endif

namespace rpe::detail::math {

#if defined(__CUDA_ARCH__)
RPE_HOST_DEVICE float fabs(float x) { return ::fabsf(x); }
RPE_HOST_DEVICE float log(float x) { return ::logf(x); }
RPE_HOST_DEVICE double log(double x) { return ::log(x); }
RPE_HOST_DEVICE float sqrt(float x) { return ::sqrtf(x); }
RPE_HOST_DEVICE double sqrt(double x) { return ::sqrt(x); }
RPE_HOST_DEVICE float nearbyint(float x) { return ::nearbyintf(x); }
RPE_HOST_DEVICE double nearbyint(double x) { return ::nearbyint(x); }
RPE_HOST_DEVICE float fmin(float a, float b) { return ::fminf(a, b); }
RPE_HOST_DEVICE double fmin(double a, double b) { return ::fmin(a, b); }
RPE_HOST_DEVICE double fmax(double a, double b) { return ::fmax(a, b); }
RPE_HOST_DEVICE float pow(float x, float y) { return ::powf(x, y); }
RPE_HOST_DEVICE float cos(float x) { return ::cosf(x); }
RPE_HOST_DEVICE float sin(float x) { return ::sinf(x); }
#elif defined(_MSC_VER) && !defined(__clang__)
inline float fabs(float x) { return std::fabs(x); }
inline float log(float x) { return std::log(x); }
inline double log(double x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline double sqrt(double x) { return std::sqrt(x); }
inline float nearbyint(float x) { return std::nearbyint(x); }
inline double nearbyint(double x) { return std::nearbyint(x); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline double fmin(double a, double b) { return std::fmin(a, b); }
inline double fmax(double a, double b) { return std::fmax(a, b); }
inline float pow(float x, float y) { return std::pow(x, y); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
#else
/// @brief `|x|` (std::fabs).
RPE_HOST_DEVICE float fabs(float x) { return __builtin_fabsf(x); }
/// @brief Natural logarithm (std::log: logf / log).
RPE_HOST_DEVICE float log(float x) { return __builtin_logf(x); }
RPE_HOST_DEVICE double log(double x) { return __builtin_log(x); }
/// @brief Square root (std::sqrt, correctly rounded).
RPE_HOST_DEVICE float sqrt(float x) { return __builtin_sqrtf(x); }
RPE_HOST_DEVICE double sqrt(double x) { return __builtin_sqrt(x); }
/// @brief Rounds in the current rounding mode (half to even by default), std::nearbyint.
RPE_HOST_DEVICE float nearbyint(float x) { return __builtin_nearbyintf(x); }
RPE_HOST_DEVICE double nearbyint(double x) { return __builtin_nearbyint(x); }
/// @brief std::fmin / std::fmax (a NaN argument gives the other one).
RPE_HOST_DEVICE float fmin(float a, float b) { return __builtin_fminf(a, b); }
RPE_HOST_DEVICE double fmin(double a, double b) { return __builtin_fmin(a, b); }
RPE_HOST_DEVICE double fmax(double a, double b) { return __builtin_fmax(a, b); }
/// @brief `x^y` in float (powf; std::pow(float, float)).
RPE_HOST_DEVICE float pow(float x, float y) { return __builtin_powf(x, y); }
/// @brief Cosine and sine in float (cosf, sinf; std::cos(float), std::sin(float)).
RPE_HOST_DEVICE float cos(float x) { return __builtin_cosf(x); }
RPE_HOST_DEVICE float sin(float x) { return __builtin_sinf(x); }
#endif

/// @brief std::isfinite, on the host (the policies' validate()).
#if defined(_MSC_VER) && !defined(__clang__)
inline bool isfinite(double x) { return std::isfinite(x); }
#else
inline bool isfinite(double x) { return __builtin_isfinite(x); }
#endif

}  // namespace rpe::detail::math
