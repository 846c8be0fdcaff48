/// @file fuzz/fuzz_common.hpp
/// @brief Shared helpers of rpe's libFuzzer harnesses: decoding policy parameters and offsets
/// from the fuzzer's bytes, and a failure report that aborts (so libFuzzer saves the input).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include <fuzzer/FuzzedDataProvider.h>

#include "rpe/error.hpp"
#include "rpe/index/clip.hpp"
#include "rpe/index/piecewise.hpp"

namespace rpe_fuzz {

/// @brief Prints `what` and aborts: libFuzzer reports a crash and writes the input to disk.
[[noreturn]] inline void fail(const std::string& what) {
    std::fprintf(stderr, "rpe fuzz check failed: %s\n", what.c_str());
    std::fflush(stderr);
    std::abort();
}

/// @brief Runs `f`, swallowing rpe's own exceptions (the expected reaction to bad bytes); any
/// other exception escapes and libFuzzer reports it.
template <class F>
void ours_only(F&& f) {
    try {
        f();
    } catch (const rpe::invalid_argument&) {
    } catch (const rpe::out_of_range&) {
    } catch (const rpe::runtime_error&) {}
}

/// @brief A policy parameter: raw double bits (NaN, ±inf, denormals, huge values), a small
/// decimal in [0, 40], a wide real, or one of the boundary values of rpe's validation.
inline double consume_param(FuzzedDataProvider& in) {
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0: {
            const auto bits = in.ConsumeIntegral<std::uint64_t>();
            double d;
            std::memcpy(&d, &bits, sizeof d);
            return d;
        }
        case 1: return in.ConsumeIntegralInRange<int>(0, 4000) / 100.0;
        case 2: return in.ConsumeFloatingPointInRange<double>(-2147483648.0, 2147483648.0);
        default: {
            static constexpr double special[] = {std::numeric_limits<double>::quiet_NaN(),
                                                 std::numeric_limits<double>::infinity(),
                                                 -std::numeric_limits<double>::infinity(),
                                                 0.0,
                                                 -0.0,
                                                 1073741824.0,
                                                 1073741823.0,
                                                 1073741823.5,
                                                 16777217.0,
                                                 16777216.5,
                                                 1e-300,
                                                 std::numeric_limits<double>::denorm_min(),
                                                 std::numeric_limits<double>::max(),
                                                 1.9,
                                                 3.8,
                                                 15.2,
                                                 1000.0,
                                                 1e9};
            return special[in.ConsumeIntegralInRange<std::size_t>(0, std::size(special) - 1)];
        }
    }
}

/// @brief An offset: small, medium, or any int except INT_MIN, whose square sum overflows int64
/// in mapping::euclidean (reported, not fixed here: see docs/fuzzing.md); `limit` caps |offset|.
inline int consume_offset(FuzzedDataProvider& in, int limit = std::numeric_limits<int>::max()) {
    int v;
    switch (in.ConsumeIntegralInRange<int>(0, 2)) {
        case 0: v = in.ConsumeIntegralInRange<int>(-64, 64); break;
        case 1: v = in.ConsumeIntegralInRange<int>(-65536, 65536); break;
        default: v = in.ConsumeIntegralInRange<int>(-std::numeric_limits<int>::max(), std::numeric_limits<int>::max());
    }
    if (v > limit) v = limit;
    if (v < -limit) v = -limit;
    return v;
}

/// @brief Text of an index function's parameters, for failure messages.
inline std::string describe(const rpe::index::piecewise& g) {
    std::ostringstream os;
    os.precision(17);
    os << "piecewise{alpha=" << g.alpha << ", beta=" << g.beta << ", gamma=" << g.gamma << "}";
    return os.str();
}
inline std::string describe(const rpe::index::clip& g) {
    std::ostringstream os;
    os.precision(17);
    os << "clip{beta=" << g.beta << "}";
    return os.str();
}

/// @brief Calls `f(g)` with a piecewise or a clip index function decoded from the input.
template <class F>
void with_index(FuzzedDataProvider& in, F&& f) {
    if (in.ConsumeBool()) {
        rpe::index::piecewise g;
        g.alpha = consume_param(in);
        g.beta = consume_param(in);
        g.gamma = consume_param(in);
        f(g);
    } else {
        rpe::index::clip g;
        g.beta = consume_param(in);
        f(g);
    }
}

}  // namespace rpe_fuzz
