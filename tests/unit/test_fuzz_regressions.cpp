// Regression tests for the defects the libFuzzer harnesses in fuzz/ found (or that were found
// while writing them); docs/fuzzing.md lists them. The committed crash inputs replay under
// fuzz/corpus/<harness>/regress-*.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>

#include <rpe/bucket_cache.hpp>
#include <rpe/error.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/io/safetensors.hpp>
#include <rpe/mapping/quantization.hpp>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_fuzz_regressions {

namespace {

using rpe::index::clip;
using rpe::index::piecewise;

// rank(n) by definition (eq. 21): how many m < n are a sum of two squares.
std::int64_t rank_by_definition(std::int64_t n) {
    std::int64_t rank = 0;
    for (std::int64_t m = 0; m < n; ++m) {
        bool found = false;
        for (std::int64_t a = 0; a * a <= m && !found; ++a)
            for (std::int64_t b = a; a * a + b * b <= m && !found; ++b) found = a * a + b * b == m;
        rank += found ? 1 : 0;
    }
    return rank;
}

// A fresh empty directory under the temp folder.
std::string temp_directory(const char* name) {
    const auto dir = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(dir);
    return dir.string();
}

}  // namespace

TEST_CASE("fuzz regression: io::load_npy on a directory throws rpe::runtime_error, not std::bad_alloc") {
    // The stream of a directory reports a size near 2^63; load_npy allocated that much.
    const std::string dir = temp_directory("rpe_fuzz_regression_dir_npy");
    CHECK_THROWS_WITH_AS((void)rpe::io::load_npy(dir), ("[rpe.npy] " + dir + ": is a directory, expected a .npy file").c_str(),
                         rpe::runtime_error);
    CHECK_THROWS_AS((void)rpe::io::load_npy(dir + "/no such file.npy"), rpe::runtime_error);
}

TEST_CASE("fuzz regression: io::safetensors_file::load on a directory names the directory") {
    const std::string dir = temp_directory("rpe_fuzz_regression_dir_safetensors");
    CHECK_THROWS_WITH_AS((void)rpe::io::safetensors_file::load(dir),
                         ("[rpe.safetensors] " + dir + ": is a directory, expected a .safetensors file").c_str(),
                         rpe::runtime_error);
}

TEST_CASE("fuzz regression: io::load_npy still reads a file written by save_npy") {
    const std::string dir = temp_directory("rpe_fuzz_regression_npy_roundtrip");
    const std::string path = dir + "/a.npy";
    const float data[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e30f, -7.0f};
    const std::int64_t shape[2] = {2, 3};
    rpe::io::save_npy(path, data, std::span<const std::int64_t>(shape));
    const auto a = rpe::io::load_npy(path);
    CHECK(a.dtype == "<f4");
    CHECK(a.shape == std::vector<std::int64_t>{2, 3});
    CHECK(a.as<float>() == std::vector<float>(data, data + 6));
}

TEST_CASE("fuzz regression: index::clip of a real input stays in [-beta_int, beta_int] for huge beta") {
    // float(beta_int()) rounded up (244223630 → 244223632, 1073741823 → 2^30): one past the table.
    const clip a{244223630.55686283};
    a.validate();
    CHECK(a(-3.08417241e+38f) == -244223630);
    CHECK(a(3.08417241e+38f) == 244223630);
    const clip b{1073741823.0};
    CHECK(b(9.08217745e+11f) == 1073741823);
    CHECK(b(-2.55066317e+09f) == -1073741823);
    CHECK(b(std::numeric_limits<float>::infinity()) == 1073741823);
    CHECK(b(std::numeric_limits<float>::quiet_NaN()) == 1073741823);  // NaN: βi, as before
    // unchanged where it was right: round half to even, then clip
    const clip c{3.0};
    CHECK(c(2.5f) == 2);
    CHECK(c(-3.5f) == -3);
    CHECK(c(1e9f) == 3);
}

TEST_CASE("fuzz regression: index::piecewise stays in [-beta_int, beta_int] when float(alpha) or float(beta) rounds up") {
    SUBCASE("alpha = beta = 3.9999999999: float(alpha) = 4 let g(4) = 4 > beta_int = 3") {
        const piecewise g{3.9999999999, 3.9999999999, 10.0};
        g.validate();
        CHECK(g.beta_int() == 3);
        CHECK(g(std::int64_t{4}) == 3);
        CHECK(g(std::int64_t{-4}) == -3);
        CHECK(g(4.0f) == 3);
        CHECK(g(std::int64_t{3}) == 3);
        CHECK(g(std::int64_t{100}) == 3);
    }
    SUBCASE("beta = 1073741823.5: float(beta) = 2^30") {
        const piecewise g{1073741823.5, 1073741823.5, 1.7976931348623157e+308};
        g.validate();
        CHECK(g(std::numeric_limits<std::int64_t>::min() + 53971) == -1073741823);
        CHECK(g(std::numeric_limits<std::int64_t>::max()) == 1073741823);
    }
    SUBCASE("beta = 1073741823: a NaN distance gives -beta_int") {
        const piecewise g{3.2, 1073741823.0, 5.07};
        g.validate();
        CHECK(g(std::numeric_limits<float>::quiet_NaN()) == -1073741823);
    }
    SUBCASE("beta = 244199215.55686283 with a denormal alpha") {
        const piecewise g{4.9406564584124654e-324, 244199215.55686283, 244223557.43186235};
        // validate() now refuses this alpha (float(alpha) = 0: issue 16); the clamp still holds
        // for a policy used without validation
        CHECK_THROWS_WITH_AS(g.validate(), doctest::Contains("underflows float32"), rpe::invalid_argument);
        CHECK(g(-5139.125f) == -244199215);
    }
    SUBCASE("the reference's values are unchanged (ratio 1.9)") {
        const piecewise g = piecewise::from_ratio(1.9);
        const int want[] = {0, 1, 2, 2, 3, 3, 3};  // g(0..6): v(2) = 1.95, v(3) = 2.32, v(4) = 2.58
        for (int x = 0; x <= 6; ++x) {
            CAPTURE(x);
            CHECK(g(std::int64_t{x}) == want[x]);
            CHECK(g(std::int64_t{-x}) == -want[x]);
        }
    }
}

TEST_CASE("fuzz regression: mapping::quantization with dr = dc = INT_MIN (square sum 2^63) saturates without overflow") {
    constexpr int lo = std::numeric_limits<int>::min();
    const rpe::mapping::quantization<> q{piecewise::from_ratio(1.9)};
    CHECK(q.bucket(lo, lo) == 6);
    CHECK(q.bucket(lo, 0) == 6);
    const rpe::mapping::quantization_paper<clip> p{clip{3.0}};
    CHECK(p.bucket(lo, lo) == 6);
    CHECK(p.bucket(0, 0) == 3);
}

TEST_CASE("quantization_paper: the fast rank equals the definition of eq. 21") {
    // clip beta = 1000 never saturates here, so the id is the rank itself (+ 1000).
    const rpe::mapping::quantization_paper<clip> p{clip{1000.0}};
    for (int dr = -12; dr <= 12; ++dr)
        for (int dc = -12; dc <= 12; ++dc) {
            CAPTURE(dr);
            CAPTURE(dc);
            CHECK(p.bucket(dr, dc) == 1000 + rank_by_definition(std::int64_t{dr} * dr + std::int64_t{dc} * dc));
        }
    // counting stops at `stop`; the counts of the first squares 0..10: 0 1 2 2 3 4 4 4 5 6 6
    using qp = rpe::mapping::quantization_paper<clip>;
    const std::int64_t want[] = {0, 1, 2, 3, 3, 4, 5, 5, 5, 6, 7};  // rank(n) for n = 0..10
    for (std::uint64_t n = 0; n <= 10; ++n) {
        CAPTURE(n);
        CHECK(qp::count_sums_of_two_squares(n, 1000) == want[n]);
        CHECK(qp::count_sums_of_two_squares(n, 2) == std::min<std::int64_t>(want[n], 2));
    }
    // across block boundaries (16384 bits per block)
    for (std::uint64_t n : {16383u, 16384u, 16385u, 40000u}) {
        CAPTURE(n);
        CHECK(qp::count_sums_of_two_squares(n, std::numeric_limits<std::int64_t>::max()) ==
              rank_by_definition(static_cast<std::int64_t>(n)));
    }
    CHECK(qp::is_sum_of_two_squares(25));
    CHECK(qp::is_sum_of_two_squares(0));
    CHECK_FALSE(qp::is_sum_of_two_squares(21));
    // saturating piecewise: ratio 1.9 ranks 0, 1, 2, 3, 4 → g = 0, 1, 2, 2, 3 (+3); far away 6
    const rpe::mapping::quantization_paper<> r{piecewise::from_ratio(1.9)};
    CHECK(r.bucket(0, 0) == 3);
    CHECK(r.bucket(1, 0) == 4);
    CHECK(r.bucket(1, 1) == 5);
    CHECK(r.bucket(2, 0) == 5);
    CHECK(r.bucket(2, 1) == 6);
    CHECK(r.bucket(100, 100) == 6);
}

TEST_CASE("quantization_paper: a slowly saturating g on a 64x64 grid builds quickly") {
    // clip beta = 1000 saturates only at rank 1000 (squared distance ~3300): the first version
    // took ~4 s here (-O2) with O(n^1.5) work per offset; now ~0.05 s.
    const auto start = std::chrono::steady_clock::now();
    const auto ids = rpe::build_bucket_ids(rpe::mapping::quantization_paper<clip>{clip{1000.0}}, 64, 64, 0);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(seconds < 3.0);
    // token (20, 20) vs (0, 0): squared distance 800, its rank by definition (< 1000)
    CHECK(rank_by_definition(800) < 1000);
    CHECK(ids->at(0, 20 * 64 + 20, 0) == 1000 + rank_by_definition(800));
    // token (63, 63) vs (0, 0): squared distance 7938, rank beyond 1000: saturated
    CHECK(rank_by_definition(7938) > 1000);
    CHECK(ids->at(0, 64 * 64 - 1, 0) == 2000);
    CHECK(ids->at(0, 0, 0) == 1000);
}

}  // namespace rpe_unit_fuzz_regressions
