// rpe::f16 (IEEE binary16 storage): hand-checked roundings (ties to even, overflow to ∞,
// subnormals, NaN), every one of the 65536 f16 values to float and back, and the array conversions
// of this unit's ISA (F16C / AVX-512F where built for them, backend/cpu/f16_kernels.hpp) against
// the portable ones bit for bit, on all f16 values and on a large sample of floats (random bit
// patterns, ties, the overflow threshold, subnormals, NaNs); the compiler's own _Float16
// conversion, where it has one, as a third opinion.
#include <doctest/doctest.h>
#include <rpe/backend/cpu/f16_kernels.hpp>
#include <rpe/f16.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_f16 {

namespace {

using rpe::f16;
namespace cpu = rpe::detail::cpu;

// The value of f16 bits h from the definition of binary16 (not from f16::float_bits): (−1)^s ·
// m·2^-24 for a zero exponent field, (−1)^s · (1024 + m)·2^(e − 25) otherwise (finite only).
double value_of(std::uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -mag : mag;
}

std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }

// A sample of floats meant to hit every branch of the rounding: random bit patterns, values whose
// 13 dropped bits are exactly the tie (normal f16 range) or near it, the overflow threshold
// 65520 and its neighbours, the subnormal range with its ties, ±0, ±∞ and NaNs (quiet,
// signalling, with payloads). An odd count, so the vector paths have tails.
std::vector<float> float_sample() {
    std::mt19937 rng(17);
    std::vector<float> x;
    for (int i = 0; i < (1 << 20); ++i) x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
    for (int i = 0; i < (1 << 16); ++i) {  // ties and their neighbours over the normal range
        const std::uint32_t u = (static_cast<std::uint32_t>(rng()) & 0x8fffe000u) | 0x1000u;
        for (int delta : {-1, 0, 1}) x.push_back(std::bit_cast<float>(u + static_cast<std::uint32_t>(delta)));
    }
    for (std::uint32_t u = 0x477fe000u - 64; u < 0x47800000u + 64; ++u)  // 65504 .. 65536 and around
        for (std::uint32_t s : {0u, 0x80000000u}) x.push_back(std::bit_cast<float>(u | s));
    for (std::uint32_t u = 0x32f00000u; u < 0x38900000u; u += 97) x.push_back(std::bit_cast<float>(u));  // subnormals
    for (int k = 0; k <= 2048; ++k) {  // every subnormal tie (k + ½)·2^-24 and exact k·2^-24
        x.push_back(std::ldexp(static_cast<float>(k) + 0.5f, -24));
        x.push_back(-std::ldexp(static_cast<float>(k), -24));
    }
    for (std::uint32_t u : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                            0xff800001u, 0x7fbfffffu, 0x7fc02000u, 0x7f801fffu, 0x00000001u, 0x807fffffu, 0x7f7fffffu})
        x.push_back(std::bit_cast<float>(u));
    x.push_back(1.0f);
    return x;
}

}  // namespace

TEST_CASE("rpe::f16 rounds to nearest, ties to even; overflow to infinity, subnormals, NaN, signed zero") {
    CHECK(f16(1.0f).bits == 0x3c00);
    CHECK(f16(-2.0f).bits == 0xc000);
    CHECK(f16(0.0f).bits == 0x0000);
    CHECK(f16(-0.0f).bits == 0x8000);
    CHECK(f16(0.5f).bits == 0x3800);
    CHECK(f16(0.1f).bits == 0x2e66);  // 0.0999755859375, the nearest f16
    CHECK(rpe::round_to_f16(0.1f) == 0.0999755859375f);
    // 1 + 2^-11 lies halfway between 1 (even) and 1 + 2^-10: to 1; 1 + 3·2^-11 between 1 + 2^-10
    // and 1 + 2^-9 (even): to 1 + 2^-9; just above the half rounds up
    CHECK(f16(1.0f + 0x1p-11f).bits == 0x3c00);
    CHECK(f16(1.0f + 3 * 0x1p-11f).bits == 0x3c02);
    CHECK(f16(1.0f + 0x1p-11f + 0x1p-20f).bits == 0x3c01);
    CHECK(f16(2047.0f).bits == 0x67ff);  // 11 significant bits: exact
    CHECK(f16(2049.0f).bits == 0x6800);  // tie between 2048 (even) and 2050
    // the largest finite f16, 65504; 65520 is the tie with 2^16 (odd 65504 loses): ∞
    CHECK(f16(65504.0f).bits == 0x7bff);
    CHECK(f16(65519.996f).bits == 0x7bff);
    CHECK(f16(65520.0f).bits == 0x7c00);
    CHECK(f16(-65520.0f).bits == 0xfc00);
    CHECK(f16(1e6f).bits == 0x7c00);
    CHECK(f16(std::numeric_limits<float>::max()).bits == 0x7c00);
    CHECK(f16(std::numeric_limits<float>::infinity()).bits == 0x7c00);
    CHECK(f16(-std::numeric_limits<float>::infinity()).bits == 0xfc00);
    // subnormals: k·2^-24; 2^-25 is the tie between 0 (even) and 2^-24; 3·2^-25 between 1 and 2 (even)
    CHECK(f16(0x1p-14f).bits == 0x0400);  // the smallest normal
    CHECK(f16(0x1p-24f).bits == 0x0001);  // the smallest subnormal
    CHECK(f16(0x1p-25f).bits == 0x0000);
    CHECK(f16(-0x1p-25f).bits == 0x8000);
    CHECK(f16(0x1p-25f + 0x1p-40f).bits == 0x0001);
    CHECK(f16(3 * 0x1p-25f).bits == 0x0002);
    CHECK(f16(5 * 0x1p-25f).bits == 0x0002);
    CHECK(f16(0x1p-14f - 0x1p-25f).bits == 0x0400);  // the tie between 1023·2^-24 (odd) and 2^-14: up
    CHECK(f16(0x1p-14f - 3 * 0x1p-25f).bits == 0x03fe);
    CHECK(f16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
    CHECK(static_cast<float>(f16::from_bits(0x0001)) == 0x1p-24f);
    CHECK(static_cast<float>(f16::from_bits(0x03ff)) == 1023 * 0x1p-24f);
    CHECK(static_cast<double>(f16::from_bits(0x4248)) == 3.140625);
    // NaN: quieted, sign kept, the top 9 payload bits kept (as vcvtps2ph)
    CHECK(f16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7e00);
    CHECK(f16(std::bit_cast<float>(0xffc00000u)).bits == 0xfe00);
    CHECK(f16(std::bit_cast<float>(0x7f800001u)).bits == 0x7e00);  // a signalling NaN stays a NaN
    CHECK(f16(std::bit_cast<float>(0x7fc02000u)).bits == 0x7e01);
    CHECK(std::isnan(static_cast<float>(f16::from_bits(0x7c01))));
    CHECK(bits_of(static_cast<float>(f16::from_bits(0x7c01))) == 0x7fc02000u);  // quieted, payload kept
    CHECK(bits_of(static_cast<float>(f16::from_bits(0xfe00))) == 0xffc00000u);
    CHECK(static_cast<float>(f16::from_bits(0x7c00)) == std::numeric_limits<float>::infinity());
    CHECK(bits_of(static_cast<float>(f16::from_bits(0x8000))) == 0x80000000u);
    static_assert(f16(0.25f).bits == 0x3400 && static_cast<float>(f16::from_bits(0xbc00)) == -1.0f);  // constexpr
}

TEST_CASE("every f16 value converts to float exactly and back to the same bits (NaNs: quieted)") {
    int wrong_value = 0, wrong_back = 0, wrong_nan = 0;
    for (std::uint32_t h = 0; h < 65536; ++h) {
        const auto x = f16::from_bits(static_cast<std::uint16_t>(h));
        const float v = static_cast<float>(x);
        if (((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff)) {  // NaN: a NaN of the same sign, quiet, payload kept
            wrong_nan += !(std::isnan(v) && std::signbit(v) == ((h & 0x8000) != 0) && f16(v).bits == (h | 0x200));
            continue;
        }
        if (((h >> 10) & 0x1f) == 0x1f)
            wrong_value += v != ((h & 0x8000) ? -1 : 1) * std::numeric_limits<float>::infinity();
        else
            wrong_value +=
                static_cast<double>(v) != value_of(static_cast<std::uint16_t>(h)) || std::signbit(v) != ((h & 0x8000) != 0);
        wrong_back += f16(v).bits != h;
    }
    CHECK(wrong_value == 0);
    CHECK(wrong_back == 0);
    CHECK(wrong_nan == 0);
}

TEST_CASE("f16 rounding is the nearest f16, ties to even, on a large sample (against the definition)") {
    // For finite |x| < 65520: the two f16 neighbours of x from the definition, the nearer (ties:
    // the even one) must be f16(x); beyond, ±∞.
    int wrong = 0;
    for (const float x : float_sample()) {
        if (std::isnan(x)) continue;
        const auto got = f16(x).bits;
        if (std::fabs(x) >= 65520.0f) {
            wrong += got != (std::signbit(x) ? 0xfc00 : 0x7c00);
            continue;
        }
        const double a = std::fabs(static_cast<double>(x));
        std::uint16_t lo = 0;  // the largest f16 magnitude ≤ a: binary search over the ordered positive bits
        for (std::uint16_t step = 0x4000; step; step >>= 1)
            if (lo + step <= 0x7bff && value_of(static_cast<std::uint16_t>(lo + step)) <= a)
                lo = static_cast<std::uint16_t>(lo + step);
        const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);  // 0x7c00 (∞) stands for 65536 here
        const double vlo = value_of(lo), vhi = hi == 0x7c00 ? 65536.0 : value_of(hi);
        std::uint16_t want = lo;
        if (a - vlo > vhi - a || (a - vlo == vhi - a && (lo & 1))) want = hi;
        if (a == vlo) want = lo;
        want = static_cast<std::uint16_t>(want | (std::signbit(x) ? 0x8000 : 0));
        wrong += got != want;
    }
    CHECK(wrong == 0);
}

TEST_CASE("f16 array conversions: this unit's hardware path and the portable one agree bit for bit") {
#if defined(__AVX512F__)
    CHECK(std::string(cpu::f16_isa()) == "AVX-512F");
#elif defined(__F16C__)
    CHECK(std::string(cpu::f16_isa()) == "F16C");
#else
    CHECK(std::string(cpu::f16_isa()) == "portable");
#endif
    MESSAGE("f16 conversions of this unit: " << std::string(cpu::f16_isa()));
    // all 65536 f16 values to float (an odd count from an odd offset: the tails too)
    std::vector<f16> all(65536 + 3);
    for (std::uint32_t h = 0; h < all.size(); ++h) all[h] = f16::from_bits(static_cast<std::uint16_t>(h));
    std::vector<float> hw(all.size()), sw(all.size());
    cpu::f16_to_float(all.data() + 1, hw.data(), static_cast<std::int64_t>(all.size()) - 1);
    cpu::f16_to_float_portable(all.data() + 1, sw.data(), static_cast<std::int64_t>(all.size()) - 1);
    int differ = 0;
    for (std::size_t i = 0; i + 1 < all.size(); ++i) differ += bits_of(hw[i]) != bits_of(sw[i]);
    CHECK(differ == 0);
    // a large sample of floats to f16
    const auto x = float_sample();
    std::vector<f16> h_hw(x.size()), h_sw(x.size());
    cpu::float_to_f16(x.data(), h_hw.data(), static_cast<std::int64_t>(x.size()));
    cpu::float_to_f16_portable(x.data(), h_sw.data(), static_cast<std::int64_t>(x.size()));
    differ = 0;
    for (std::size_t i = 0; i < x.size(); ++i) differ += h_hw[i].bits != h_sw[i].bits;
    CHECK(differ == 0);
    CHECK(x.size() > (1u << 20));
#if defined(__FLT16_MAX__)
    // the compiler's _Float16 (libgcc's or the hardware's rounding): a third opinion on finite values
    differ = 0;
    for (const float v : x) {
        if (std::isnan(v)) continue;
        const auto c = std::bit_cast<std::uint16_t>(static_cast<_Float16>(v));
        differ += c != f16(v).bits;
    }
    CHECK(differ == 0);
#endif
}

}  // namespace rpe_unit_f16
