// Shared helpers of the unit tests on 16-bit storage (rpe::bf16, rpe::f16): each type's unit
// roundoff and error floor (half_traits), random 16-bit values, and the checks that a 16-bit result
// is the float one rounded once (bits) and within the float64 bound of the one rounding plus the
// float sums.
#pragma once

#include <doctest/doctest.h>
#include <rpe/bf16.hpp>
#include <rpe/f16.hpp>
#include <rpe/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace rpe_test {

/// Per 16-bit type: `u`, the unit roundoff of one rounding to it; `tiny`, what the bounds add for
/// values near 0 (f16: half the subnormal step 2^-25; bf16: 1e-30, against a zero bound only, its
/// subnormals reaching 2^-133); `name` for messages.
template <class H>
struct half_traits;
template <>
struct half_traits<rpe::bf16> {
    static constexpr double u = 0x1p-8;
    static constexpr double tiny = 1e-30;
    static constexpr const char* name = "bf16";
};
template <>
struct half_traits<rpe::f16> {
    static constexpr double u = 0x1p-11;
    static constexpr double tiny = 0x1p-25;
    static constexpr const char* name = "f16";
};

/// n values N(0, sigma²) rounded to H.
template <class H>
std::vector<H> random_half(std::mt19937& rng, std::int64_t n, double sigma = 1.0) {
    std::normal_distribution<double> normal(0.0, sigma);
    std::vector<H> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = H(static_cast<float>(normal(rng)));
    return x;
}

/// Every value of x converted to T.
template <class T, class H>
std::vector<T> cast_all(const std::vector<H>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<T>(x[i]);
    return out;
}

/// A contiguous view of `data` with the given shape.
template <class T>
rpe::tensor_ref<T> shaped(T* data, const std::vector<std::int64_t>& shape) {
    rpe::tensor_ref<T> r;
    r.data = data;
    r.rank = static_cast<int>(shape.size());
    for (std::size_t i = 0; i < shape.size(); ++i) r.shape[i] = shape[i];
    return r;
}

/// Whether a and b hold the same 16-bit values, bit for bit.
template <class H>
bool same_bits(const std::vector<H>& a, const std::vector<H>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

/// Whether every 16-bit value is the float one rounded once (bit for bit).
template <class H>
bool rounded_from(const std::vector<H>& got, const std::vector<float>& f) {
    if (got.size() != f.size()) return false;
    for (std::size_t i = 0; i < f.size(); ++i)
        if (got[i].bits != H(f[i]).bits) return false;
    return true;
}

/// Worst |got − ref| / (u·|ref| + 16·N·2^-24·max|ref| + tiny) over one tensor (≤ 1 passes): one
/// rounding to H, and float sums of at most N = n_sum terms whose magnitudes are allowed 16 times
/// the tensor's largest entry.
template <class H>
double worst_ratio(const std::vector<H>& got, const std::vector<double>& ref, std::int64_t n_sum) {
    REQUIRE(got.size() == ref.size());
    double most = 0;
    for (double r : ref) most = std::max(most, std::fabs(r));
    const double floor = 16.0 * static_cast<double>(n_sum) * 0x1p-24 * most + half_traits<H>::tiny;
    double worst = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
        const double g = static_cast<double>(got[i]);
        REQUIRE(std::isfinite(g));
        worst = std::max(worst, std::fabs(g - ref[i]) / (half_traits<H>::u * std::fabs(ref[i]) + floor));
    }
    return worst;
}

}  // namespace rpe_test
