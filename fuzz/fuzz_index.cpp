// libFuzzer harness: the index functions (piecewise, clip) with fuzzed parameters and inputs.
// Property: validate() throws rpe::invalid_argument, or every output lies in [-beta_int, beta_int]
// (for integer offsets and for real distances, NaN and infinities included). UBSan catches
// float-to-int conversions out of range.
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_common.hpp"

namespace {

float consume_distance(FuzzedDataProvider& in) {
    if (in.ConsumeBool()) {
        const auto bits = in.ConsumeIntegral<std::uint32_t>();
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
    return static_cast<float>(in.ConsumeIntegralInRange<int>(-100000, 100000)) / 16.0f;
}

std::int64_t consume_integer(FuzzedDataProvider& in) {
    if (in.ConsumeBool()) return in.ConsumeIntegral<std::int64_t>();
    return in.ConsumeIntegralInRange<std::int64_t>(-70000, 70000);
}

template <class G>
void check(const G& g, FuzzedDataProvider& in) {
    try {
        g.validate();
    } catch (const rpe::invalid_argument&) {
        return;  // our exception at validate(): fine
    }
    const int b = g.beta_int();
    if (b < 0) rpe_fuzz::fail(rpe_fuzz::describe(g) + ": beta_int() = " + std::to_string(b) + " < 0");
    for (int k = 0; k < 8 && in.remaining_bytes() > 0; ++k) {
        if (in.ConsumeBool()) {
            const std::int64_t x = consume_integer(in);
            const int y = g(x);
            if (y < -b || y > b)
                rpe_fuzz::fail(rpe_fuzz::describe(g) + ": g(int64 " + std::to_string(x) + ") = " + std::to_string(y) +
                               " outside [-" + std::to_string(b) + ", " + std::to_string(b) + "]");
        } else {
            const float x = consume_distance(in);
            const int y = g(x);
            if (y < -b || y > b) {
                char buf[64];
                std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(x));
                rpe_fuzz::fail(rpe_fuzz::describe(g) + ": g(float " + buf + ") = " + std::to_string(y) + " outside [-" +
                               std::to_string(b) + ", " + std::to_string(b) + "]");
            }
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    rpe_fuzz::with_index(in, [&](const auto& g) { check(g, in); });
    return 0;
}
