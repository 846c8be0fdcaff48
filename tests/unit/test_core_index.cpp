// Index functions (the reference's piecewise_index): the golden index cases exactly, hand-checked values of the
// piecewise index g (paper eq. 18) at the points where a careless port differs, and clip.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_index {

namespace {

using rpe::index::clip;
using rpe::index::piecewise;

struct index_case {
    const char* dir;  // under tests/data/golden/
    piecewise g;      // α, β, γ of its meta.json
};

// Every case of tests/data/golden/index (README "What is in this set"); the parameters are
// the meta.json's alpha/beta/gamma (α = r, β = 2r, γ = 8r for the ratio cases).
const index_case golden_index_cases[] = {
    {"index/r1.9", piecewise::from_ratio(1.9)},         {"index/r2.0", piecewise::from_ratio(2.0)},
    {"index/r1.0", piecewise::from_ratio(1.0)},         {"index/r20.0", piecewise::from_ratio(20.0)},
    {"index/a1.0_b2.0_g4.0", piecewise{1.0, 2.0, 4.0}},
};

}  // namespace

TEST_CASE("index::piecewise matches every golden index case exactly (integer offsets and float inputs)") {
    for (const auto& c : golden_index_cases) {
        const std::string dir = rpe_test::golden(c.dir);
        INFO("case " << c.dir);
        c.g.validate();

        const auto offsets = rpe_test::load<std::int64_t>(dir, "offsets.npy", {4001});
        CHECK(offsets.front() == -2000);
        CHECK(offsets.back() == 2000);
        std::vector<int> out;
        for (std::int64_t x : offsets) out.push_back(c.g(x));
        rpe_test::check_exact(out, rpe_test::load<std::int64_t>(dir, "index.npy", {4001}), "index.npy");

        const auto inputs = rpe_test::load<float>(dir, "float_inputs.npy", {2001});
        std::vector<int> out_f;
        for (float x : inputs) out_f.push_back(c.g(x));
        rpe_test::check_exact(out_f, rpe_test::load<std::int64_t>(dir, "index_float.npy", {2001}), "index_float.npy");
    }
}

TEST_CASE("index::piecewise hand-checked values") {
    SUBCASE("ratio 1.9 per axis, x = -7..7") {
        // Source: examples/data/digits/README.md, "iRPE buckets B[i, j]" ("product, per axis
        // x = -7..7 -> g"), and the paper's example: the 7 indices cover {0}, {±1}, {±2,±3}, {±4…}.
        const piecewise g = piecewise::from_ratio(1.9);
        const int expected[15] = {-3, -3, -3, -3, -2, -2, -1, 0, 1, 2, 2, 3, 3, 3, 3};
        for (int x = -7; x <= 7; ++x) {
            CAPTURE(x);
            CHECK(g(std::int64_t{x}) == expected[x + 7]);
            CHECK(g(static_cast<float>(x)) == expected[x + 7]);  // same on the float path
        }
    }
    SUBCASE("from_ratio gives the reference's alpha = r, beta = 2r, gamma = 8r") {
        // Source: the reference's float32 recipe; meta.json of index/r1.9 gives alpha_hex 0x1.e666666666666p+0,
        // beta_hex 0x1.e666666666666p+1, gamma_hex 0x1.e666666666666p+3, i.e. the literals below.
        CHECK(piecewise::from_ratio(1.9) == piecewise{1.9, 3.8, 15.2});
        CHECK(piecewise::from_ratio(20.0) == piecewise{20.0, 40.0, 160.0});
        CHECK(piecewise{} == piecewise::from_ratio(1.9));  // the defaults are the DeiT config
    }
    SUBCASE("round half to even at an exact tie: alpha=2, beta=3, gamma=8 at x = +-4") {
        // Source: golden README "Rounding edge cases": v = 2 + ln(4/2)/ln(8/2)·(3−2)
        // = 2.5 exactly; the reference (torch.round, half to even) gives 2, std::round gives 3.
        const piecewise g{2.0, 3.0, 8.0};
        CHECK(g(std::int64_t{4}) == 2);
        CHECK(g(std::int64_t{-4}) == -2);
        CHECK(g(4.0f) == 2);
        CHECK(g(-4.0f) == -2);
        CHECK(g(std::int64_t{5}) == 3);  // v = 2 + ln(2.5)/ln(4) = 2.66 → 3: the tie is only at 4
    }
    SUBCASE("the reference's mixed double/float32 recipe: alpha=9, beta=42, gamma=49 at x=21") {
        // Source: the reference gives 26 here, an all-float32 evaluation 25.
        const piecewise g{9.0, 42.0, 49.0};
        CHECK(g(std::int64_t{21}) == 26);
        CHECK(g(std::int64_t{-21}) == -26);
        CHECK(g(21.0f) == 26);
    }
    SUBCASE("a non-integer beta caps at int(beta): beta = 3.8 gives 3") {
        // Source: the reference's piecewise_index (min(β_f, round(v)) = 3.8 then truncation toward zero → 3).
        const piecewise g = piecewise::from_ratio(1.9);
        CHECK(g.beta_int() == 3);
        CHECK(g(std::int64_t{1000000}) == 3);
        CHECK(g(std::int64_t{-1000000}) == -3);
        CHECK(g(1.0e9f) == 3);
        CHECK(g(std::int64_t{15}) == 3);  // near gamma = 15.2: v ≈ 3.79 → round 4 → min 3.8 → 3
    }
    SUBCASE("inside alpha the float path rounds half to even") {
        // Source: the reference's piecewise_index (|x| ≤ α → round(x), torch.round semantics).
        const piecewise g = piecewise::from_ratio(1.9);
        CHECK(g(0.5f) == 0);
        CHECK(g(1.5f) == 2);
        CHECK(g(-0.5f) == 0);
        CHECK(g(-1.5f) == -2);
        CHECK(g(1.4f) == 1);
        CHECK(g(1.9f) == 2);  // |x| ≤ α (equal in float32) → round(1.9) = 2
    }
    SUBCASE("odd symmetry, monotonicity and range [-beta_int, beta_int]") {
        for (const auto& c : golden_index_cases) {
            CAPTURE(c.dir);
            int prev = c.g(std::int64_t{-5000});
            bool odd = true, monotone = true, in_range = true;
            for (std::int64_t x = -5000; x <= 5000; ++x) {
                const int v = c.g(x);
                odd = odd && c.g(-x) == -v;
                monotone = monotone && v >= prev;
                in_range = in_range && v >= -c.g.beta_int() && v <= c.g.beta_int();
                prev = v;
            }
            CHECK(odd);
            CHECK(monotone);
            CHECK(in_range);
            CHECK(c.g(std::int64_t{5000}) == c.g.beta_int());  // saturates
        }
    }
}

TEST_CASE("index::clip values and range") {
    // Source: Shaw et al.: clip(x) = max(−βi, min(βi, x)), βi = int(β).
    SUBCASE("integer offsets, beta = 3") {
        const clip g{3.0};
        CHECK(g.beta_int() == 3);
        const int expected[11] = {-3, -3, -3, -2, -1, 0, 1, 2, 3, 3, 3};
        for (int x = -5; x <= 5; ++x) {
            CAPTURE(x);
            CHECK(g(std::int64_t{x}) == expected[x + 5]);
        }
        CHECK(g(std::int64_t{1} << 40) == 3);  // no overflow on large offsets
        CHECK(g(-(std::int64_t{1} << 40)) == -3);
    }
    SUBCASE("non-integer beta truncates: beta = 3.8 gives range [-3, 3]") {
        const clip g{3.8};
        CHECK(g.beta_int() == 3);
        CHECK(g(std::int64_t{4}) == 3);
        CHECK(g(std::int64_t{-4}) == -3);
        CHECK(g(3.7f) == 3);
    }
    SUBCASE("real inputs round half to even, then clip") {
        const clip g{3.0};
        CHECK(g(2.5f) == 2);
        CHECK(g(1.5f) == 2);
        CHECK(g(-2.5f) == -2);
        CHECK(g(0.4f) == 0);
        CHECK(g(100.0f) == 3);
        CHECK(g(-100.0f) == -3);
    }
    SUBCASE("beta = 0 maps everything to 0") {
        const clip g{0.0};
        CHECK(g.beta_int() == 0);
        CHECK(g(std::int64_t{7}) == 0);
        CHECK(g(std::int64_t{-7}) == 0);
        CHECK(g(0.7f) == 0);
    }
    SUBCASE("equality compares beta") {
        CHECK(clip{3.0} == clip{3.0});
        CHECK_FALSE(clip{3.0} == clip{4.0});
    }
}

}  // namespace rpe_unit_core_index
