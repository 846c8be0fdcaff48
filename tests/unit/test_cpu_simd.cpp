// The vectorised row kernels of the CPU backend (backend/cpu/simd.hpp) against plain loops:
// gathers by bucket id (K up to 64 in registers, larger K, per-key tables; 1-, 2- and 4-byte ids;
// row lengths that are not a multiple of the vector width), the per-bucket sums of the fused
// attention (scatter_rows4, scatter_sum4: the same bits as their four-partial formula), the softmax's edge cases, the
// attention's float product (simd::gemm, AVX-512F) and the scratch workspace.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_cpu_simd {

namespace {

using rpe::detail::cpu::gather_row;
using rpe::detail::cpu::gather_row_strided;

template <class S, class Id>
void check_gathers(std::int64_t k, std::int64_t n, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    std::vector<S> w(static_cast<std::size_t>(n * k)), base(static_cast<std::size_t>(n));
    std::vector<Id> ids(static_cast<std::size_t>(n));
    for (auto& e : w) e = static_cast<S>(normal(rng));
    for (auto& e : base) e = static_cast<S>(normal(rng));
    for (auto& e : ids) e = static_cast<Id>(std::uniform_int_distribution<std::int64_t>(0, k - 1)(rng));
    ids[0] = static_cast<Id>(k - 1);  // the last bucket (the skip bucket of a term)
    std::vector<S> add = base, set = base, add_s = base, set_s = base;
    gather_row<true>(add.data(), w.data(), k, ids.data(), n);
    gather_row<false>(set.data(), w.data(), k, ids.data(), n);
    gather_row_strided<true>(add_s.data(), w.data(), k, ids.data(), n);
    gather_row_strided<false>(set_s.data(), w.data(), k, ids.data(), n);
    for (std::int64_t j = 0; j < n; ++j) {
        const auto jj = static_cast<std::size_t>(j);
        // one addition per element in every path: exact equality with the plain loop
        CHECK(add[jj] == base[jj] + w[ids[jj]]);
        CHECK(set[jj] == w[ids[jj]]);
        CHECK(add_s[jj] == base[jj] + w[static_cast<std::size_t>(j * k) + ids[jj]]);
        CHECK(set_s[jj] == w[static_cast<std::size_t>(j * k) + ids[jj]]);
    }
}

}  // namespace

TEST_CASE("cpu gathers equal plain loops for every K, row length and id width") {
    for (const std::int64_t k : {1, 2, 15, 16, 17, 32, 33, 50, 63, 64, 65, 200, 300})
        for (const std::int64_t n : {1, 7, 16, 17, 65, 197}) {
            CAPTURE(k);
            CAPTURE(n);
            check_gathers<float, std::uint16_t>(k, n, 1);
            check_gathers<float, std::uint32_t>(k, n, 2);
            check_gathers<double, std::uint32_t>(k, n, 3);
            if (k <= 256) {
                check_gathers<float, std::uint8_t>(k, n, 4);
                check_gathers<double, std::uint8_t>(k, n, 5);
            }
        }
}

namespace {

// Per-bucket sums as scatter_into4's doc states them: key j into partial j mod 4 (the last n mod 4
// keys into partial 0), each partial in key order, then (p0 + p1) + (p2 + p3).
template <class S, class Id>
std::vector<S> four_partial_sums(const S* g, const Id* r, std::int64_t n, std::int64_t k) {
    std::vector<S> part(static_cast<std::size_t>(4 * k), S(0)), out(static_cast<std::size_t>(k));
    for (std::int64_t j = 0; j < n; ++j) {
        const std::int64_t u = j < n / 4 * 4 ? j % 4 : 0;
        part[static_cast<std::size_t>(u * k + r[j])] += g[j];
    }
    for (std::int64_t b = 0; b < k; ++b) {
        const auto at = [&](std::int64_t u) { return part[static_cast<std::size_t>(u * k + b)]; };
        out[static_cast<std::size_t>(b)] = (at(0) + at(1)) + (at(2) + at(3));
    }
    return out;
}

template <class S, class Id>
void check_bucket_sums(std::int64_t k, std::int64_t n, std::int64_t rows, std::uint32_t seed) {
    using rpe::detail::cpu::scatter_rows4;
    using rpe::detail::cpu::scatter_sum4;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal;
    // g's rows ld = n + k apart, the sums written into each row's columns past n (the fused
    // attention's [logits | sums] layout), ids' rows n + 3 apart
    const std::int64_t ld = n + k, ldi = n + 3;
    std::vector<S> g(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * ld));
    std::vector<Id> ids(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * ldi));
    for (auto& e : g) e = static_cast<S>(normal(rng));
    // runs of one bucket (as the clipped buckets far from a query) and random ids
    for (std::size_t e = 0; e < ids.size(); ++e)
        ids[e] = static_cast<Id>(e % 11 < 6 ? 0 : std::uniform_int_distribution<std::int64_t>(0, k - 1)(rng));
    const std::vector<S> g0 = g;
    std::vector<S> part(static_cast<std::size_t>(8 * k), S(1234));  // scratch: any contents
    scatter_rows4(g.data(), ld, ids.data(), ldi, rows, n, k, part.data(), g.data() + n, ld);
    std::vector<S> total(static_cast<std::size_t>(k), S(0.5)), expect_total = total;
    scatter_sum4(g0.data(), ld, ids.data(), ldi, rows, n, k, part.data(), total.data());
    std::vector<S> block_part(static_cast<std::size_t>(4 * k), S(0));
    for (std::int64_t i = 0; i < rows; ++i) {
        CAPTURE(i);
        const S* gi = g0.data() + i * ld;
        const Id* ri = ids.data() + i * ldi;
        const auto want = four_partial_sums(gi, ri, n, k);
        double plain_max = 0;
        for (std::int64_t b = 0; b < k; ++b) {
            // the same additions in the same order: the same bits
            CHECK(g[static_cast<std::size_t>(i * ld + n + b)] == want[static_cast<std::size_t>(b)]);
            double plain = 0;
            for (std::int64_t j = 0; j < n; ++j) plain += ri[j] == b ? static_cast<double>(gi[j]) : 0.0;
            plain_max = std::max(plain_max, std::abs(plain - static_cast<double>(want[static_cast<std::size_t>(b)])));
        }
        CHECK(plain_max <= 1e-5);
        for (std::int64_t j = 0; j < n; ++j)
            CHECK(g[static_cast<std::size_t>(i * ld + j)] == g0[static_cast<std::size_t>(i * ld + j)]);
        for (std::int64_t j = 0; j < n; ++j) {  // scatter_sum4: partial j mod 4 over the whole block
            const std::int64_t u = j < n / 4 * 4 ? j % 4 : 0;
            block_part[static_cast<std::size_t>(u * k + ri[j])] += gi[j];
        }
    }
    for (std::int64_t b = 0; b < k; ++b) {
        const auto at = [&](std::int64_t u) { return block_part[static_cast<std::size_t>(u * k + b)]; };
        expect_total[static_cast<std::size_t>(b)] += (at(0) + at(1)) + (at(2) + at(3));
    }
    CHECK(total == expect_total);
}

}  // namespace

TEST_CASE("cpu per-bucket sums (scatter_rows4, scatter_sum4) are the four-partial sums, bit for bit") {
    for (const std::int64_t k : {1, 2, 7, 50, 64, 300})
        for (const std::int64_t n : {0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 65, 197})
            for (const std::int64_t rows : {0, 1, 2, 5}) {
                CAPTURE(k);
                CAPTURE(n);
                CAPTURE(rows);
                if (k <= 256) {
                    check_bucket_sums<float, std::uint8_t>(k, n, rows, 11);
                    check_bucket_sums<double, std::uint8_t>(k, n, rows, 12);
                }
                check_bucket_sums<float, std::uint16_t>(k, n, rows, 13);
                check_bucket_sums<float, std::uint32_t>(k, n, rows, 14);
            }
}

TEST_CASE("cpu softmax row: values, masks, -inf, NaN, +inf, all masked, lengths around the vector width") {
    using rpe::detail::cpu::softmax_row;
    const float inf = std::numeric_limits<float>::infinity();
    for (const std::int64_t n : {1, 3, 15, 16, 17, 33, 197}) {
        CAPTURE(n);
        std::vector<float> row(static_cast<std::size_t>(n)), ref(row.size());
        std::vector<std::uint8_t> mask(row.size(), 0);
        for (std::int64_t j = 0; j < n; ++j) row[static_cast<std::size_t>(j)] = static_cast<float>(std::sin(0.7 * j) * 5);
        if (n > 2) {
            mask[1] = 1;                                      // a padded key
            row[2] = -inf;                                    // an attn_mask −∞
            row[static_cast<std::size_t>(n - 1)] = -1000.0f;  // exp underflows to 0 after the max
        }
        double m = -1e300, sum = 0;
        for (std::int64_t j = 0; j < n; ++j)
            if (!mask[static_cast<std::size_t>(j)]) m = std::max(m, static_cast<double>(row[static_cast<std::size_t>(j)]));
        for (std::int64_t j = 0; j < n; ++j) {
            const auto jj = static_cast<std::size_t>(j);
            ref[jj] = mask[jj] ? 0.0f : static_cast<float>(std::exp(static_cast<double>(row[jj]) - m));
            sum += ref[jj];
        }
        for (auto& e : ref) e = static_cast<float>(e / sum);
        softmax_row(row.data(), n, mask.data());
        for (std::size_t j = 0; j < row.size(); ++j) CHECK(row[j] == doctest::Approx(ref[j]).epsilon(1e-6));
        if (n > 2) {
            CHECK(row[1] == 0.0f);  // exactly zero, not a denormal
            CHECK(row[2] == 0.0f);
            CHECK(row[static_cast<std::size_t>(n - 1)] == 0.0f);
        }
    }
    std::vector<float> nan_row{1.0f,  std::numeric_limits<float>::quiet_NaN(),
                               2.0f,  3.0f,
                               4.0f,  5.0f,
                               6.0f,  7.0f,
                               8.0f,  9.0f,
                               10.0f, 11.0f,
                               12.0f, 13.0f,
                               14.0f, 15.0f,
                               16.0f, 17.0f};
    softmax_row(nan_row.data(), static_cast<std::int64_t>(nan_row.size()), nullptr);
    for (float x : nan_row) CHECK(std::isnan(x));
    std::vector<float> inf_row(20, 1.0f);
    inf_row[19] = inf;
    softmax_row(inf_row.data(), 20, nullptr);
    for (float x : inf_row) CHECK(std::isnan(x));
    std::vector<float> masked(20, 1.0f);
    std::vector<std::uint8_t> all(20, 1);
    softmax_row(masked.data(), 20, all.data());
    for (float x : masked) CHECK(x == 0.0f);
}

TEST_CASE("cpu softmax row exponentials: 1/sum returned, softmax_row's bits, a NaN at any position, all masked") {
    using rpe::detail::cpu::softmax_row;
    using rpe::detail::cpu::softmax_row_exp;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (const std::int64_t n : {1, 5, 16, 31, 32, 33, 47, 197}) {
        CAPTURE(n);
        std::vector<float> x(static_cast<std::size_t>(n));
        for (std::int64_t j = 0; j < n; ++j)
            x[static_cast<std::size_t>(j)] = static_cast<float>(std::cos(0.3 * j) * 4 + 0.01 * j);
        // the exponentials times the returned factor are softmax_row's probabilities, bit for bit
        std::vector<float> e = x, probs = x;
        const float inv = softmax_row_exp(e.data(), n, nullptr);
        softmax_row(probs.data(), n, nullptr);
        double m = -1e300, sum = 0;
        for (float v : x) m = std::max(m, static_cast<double>(v));
        for (float v : x) sum += std::exp(static_cast<double>(v) - m);
        CHECK(inv == doctest::Approx(1.0 / sum).epsilon(1e-6));
        for (std::size_t j = 0; j < x.size(); ++j) {
            CHECK(e[j] == doctest::Approx(std::exp(static_cast<double>(x[j]) - m)).epsilon(1e-6));
            CHECK(e[j] * inv == probs[j]);
        }
        // a NaN in any lane of the max's two accumulators, its packet loop or the scalar tail
        // makes the whole row NaN (and 1 is returned, so that a scaled output stays NaN)
        for (std::int64_t at = 0; at < n; ++at) {
            std::vector<float> r = x;
            r[static_cast<std::size_t>(at)] = nan;
            CAPTURE(at);
            CHECK(softmax_row_exp(r.data(), n, nullptr) == 1.0f);
            CHECK(std::all_of(r.begin(), r.end(), [](float v) { return std::isnan(v); }));
        }
        // every key masked: zeros and 1, so that the output is zero
        std::vector<float> r = x;
        std::vector<std::uint8_t> all(x.size(), 1);
        CHECK(softmax_row_exp(r.data(), n, all.data()) == 1.0f);
        CHECK(std::all_of(r.begin(), r.end(), [](float v) { return v == 0.0f; }));
    }
}

TEST_CASE("cpu softmax backward row equals the formula and does not depend on the row's alignment") {
    using rpe::detail::cpu::softmax_backward_row;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal;
    std::vector<float> p(64), dp(64);
    for (auto& e : p) e = std::abs(normal(rng));
    for (auto& e : dp) e = normal(rng);
    const std::int64_t n = 37;
    double dot = 0;
    for (std::int64_t j = 0; j < n; ++j)
        dot += static_cast<double>(p[static_cast<std::size_t>(j)]) * dp[static_cast<std::size_t>(j)];
    std::vector<float> a(dp.begin(), dp.begin() + n);
    softmax_backward_row(p.data(), a.data(), n);
    for (std::int64_t j = 0; j < n; ++j) {
        const auto jj = static_cast<std::size_t>(j);
        CHECK(a[jj] == doctest::Approx(p[jj] * (dp[jj] - dot)).epsilon(1e-5));
    }
    // the same row at another offset in memory gives the same bits
    std::vector<float> p2(p.size() + 3), dp2(dp.size() + 3);
    std::copy(p.begin(), p.end(), p2.begin() + 3);
    std::copy(dp.begin(), dp.begin() + n, dp2.begin() + 3);
    softmax_backward_row(p2.data() + 3, dp2.data() + 3, n);
    for (std::int64_t j = 0; j < n; ++j) CHECK(dp2[static_cast<std::size_t>(j) + 3] == a[static_cast<std::size_t>(j)]);
}

#if defined(__AVX512F__)
// simd::gemm: every element is one fused multiply-add chain over k in order, from 0 or from C
// (accumulate), so it must equal std::fma applied in that order bit for bit, whatever the tile
// (rows 1..8 left over, 1..4 vectors of columns, a masked last vector; inner lengths split into
// blocks of 128 or not), A row-major or transposed through its strides; nothing outside the m × n
// block of C is written.
TEST_CASE("cpu simd gemm equals an in-order fma chain per element, every tile remainder, strided and transposed A") {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    for (const bool accumulate : {false, true})
        for (const bool transposed : {false, true})
            for (const std::int64_t m : {1, 3, 7, 8, 13, 65})
                for (const std::int64_t n : {1, 16, 17, 50, 64, 65, 128, 247})
                    for (const std::int64_t kk : {0, 1, 16, 115, 161, 300}) {
                        CAPTURE(accumulate);
                        CAPTURE(transposed);
                        CAPTURE(m);
                        CAPTURE(n);
                        CAPTURE(kk);
                        // A (m, kk): row-major with lda = kk + 3, or Aᵀ of a (kk, m) matrix with lda = m + 5
                        const std::int64_t lda = transposed ? m + 5 : kk + 3, ldb = n + 7, ldc = n + 9;
                        const std::int64_t a_rs = transposed ? 1 : lda, a_ks = transposed ? lda : 1;
                        std::vector<float> a(static_cast<std::size_t>((transposed ? kk : m) * lda + 1)),
                            b(static_cast<std::size_t>(kk * ldb + 1)), c(static_cast<std::size_t>((m + 1) * ldc));
                        for (auto& e : a) e = normal(rng);
                        for (auto& e : b) e = normal(rng);
                        for (auto& e : c) e = normal(rng);
                        const std::vector<float> c0 = c;
                        rpe::detail::cpu::simd::gemm(m, n, kk, a.data(), a_rs, a_ks, b.data(), ldb, c.data(), ldc, accumulate);
                        for (std::int64_t i = 0; i <= m; ++i)
                            for (std::int64_t j = 0; j < ldc; ++j) {
                                const auto at = static_cast<std::size_t>(i * ldc + j);
                                if (i == m || j >= n) {  // outside the block: untouched
                                    REQUIRE(c[at] == c0[at]);
                                    continue;
                                }
                                float want = accumulate ? c0[at] : 0.0f;
                                double exact = accumulate ? c0[at] : 0.0;
                                for (std::int64_t k = 0; k < kk; ++k) {
                                    const float x = a[static_cast<std::size_t>(i * a_rs + k * a_ks)];
                                    const float y = b[static_cast<std::size_t>(k * ldb + j)];
                                    want = std::fma(x, y, want);
                                    exact += static_cast<double>(x) * y;
                                }
                                REQUIRE(c[at] == want);
                                REQUIRE(std::abs(c[at] - exact) <= 1e-5 * (1.0 + static_cast<double>(kk)));
                            }
                    }
}

// The forward's value term looked up per key (simd::value_lookup_rows, AVX-512F): per row and 16
// columns, chains of fused multiply-adds over the keys in the documented order (d ≤ 16: four
// chains, j mod 4, the last n mod 4 keys into the first, added as (c0 + c1) + (c2 + c3); d ≤ 32:
// two chains, j mod 2, the last odd key into the first, added as c0 + c1), then added to the
// output; checked bit for bit against that order and within float rounding against a double sum.
#if defined(__AVX512F__)
template <class Id>
void check_value_lookup(std::int64_t d, std::int64_t n, std::int64_t k, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const std::int64_t rows = 3, lda = n + 5, ldi = n + 3, ldo = d + 7;
    std::vector<float> a(static_cast<std::size_t>(rows * lda)), t(static_cast<std::size_t>(k * d)),
        o(static_cast<std::size_t>(rows * ldo + 1));
    std::vector<Id> ids(static_cast<std::size_t>(rows * ldi));
    for (auto& e : a) e = std::abs(normal(rng));
    for (auto& e : t) e = normal(rng);
    for (auto& e : o) e = normal(rng);
    for (auto& e : ids) e = static_cast<Id>(std::uniform_int_distribution<std::int64_t>(0, k - 1)(rng));
    const std::vector<float> o0 = o;
    rpe::detail::cpu::simd::value_lookup_rows(a.data(), lda, ids.data(), ldi, rows, n, t.data(), d, o.data(), ldo);
    const std::int64_t chains = d <= 16 ? 4 : 2;
    for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t c = 0; c < ldo; ++c) {
            const auto at = static_cast<std::size_t>(i * ldo + c);
            if (c >= d) {  // outside the row's d columns: untouched
                REQUIRE(o[at] == o0[at]);
                continue;
            }
            float chain[4] = {0, 0, 0, 0};
            double exact = o0[at];
            for (std::int64_t j = 0; j < n; ++j) {
                const float w = a[static_cast<std::size_t>(i * lda + j)];
                const float x = t[static_cast<std::size_t>(ids[static_cast<std::size_t>(i * ldi + j)] * d + c)];
                const std::int64_t s = j < n / chains * chains ? j % chains : 0;
                chain[s] = std::fma(w, x, chain[s]);
                exact += static_cast<double>(w) * x;
            }
            const float sum = chains == 4 ? (chain[0] + chain[1]) + (chain[2] + chain[3]) : chain[0] + chain[1];
            REQUIRE(o[at] == o0[at] + sum);
            REQUIRE(std::abs(o[at] - exact) <= 1e-5 * (1.0 + static_cast<double>(n)));
        }
}
#endif

TEST_CASE("cpu value lookup rows: a fixed fma chain order per 16 columns, bit for bit, any d <= 32 and key count") {
#if defined(__AVX512F__)
    std::uint32_t seed = 1;
    for (const std::int64_t d : {1, 5, 16, 17, 31, 32})
        for (const std::int64_t n : {0, 1, 3, 4, 5, 7, 65, 66}) {
            CAPTURE(d);
            CAPTURE(n);
            check_value_lookup<std::uint8_t>(d, n, 50, seed++);
            check_value_lookup<std::uint16_t>(d, n, 300, seed++);
        }
#else
    MESSAGE("built without AVX-512F: simd::value_lookup_rows is not compiled");
#endif
}

// The softmax's exp (simd::exp_nonpositive) against Eigen's pexp<Packet16f>, after the softmax's
// flush (subtract the smallest normal number, clamp at 0): the same bits for every float in
// [−90, −80] (around where results leave the normal range) and for every 97th float of (−80, 0],
// −0, −∞; and the values themselves against std::exp.
TEST_CASE("cpu softmax exp equals Eigen's vectorised exp after the softmax's flush, bit for bit") {
    const __m512 tiny = _mm512_set1_ps(std::numeric_limits<float>::min()), zero = _mm512_setzero_ps();
    const auto flushed = [&](__m512 e) { return _mm512_max_ps(_mm512_sub_ps(e, tiny), zero); };
    std::vector<float> xs = {-0.0f, 0.0f, -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::max()};
    const auto bits = [](float f) {
        std::uint32_t u;
        std::memcpy(&u, &f, 4);
        return u;
    };
    const auto from = [](std::uint32_t u) {
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    };
    for (std::uint32_t u = bits(-80.0f); u <= bits(-90.0f); ++u) xs.push_back(from(u));  // negative: larger bits, larger |x|
    for (std::uint32_t u = bits(-0.0f) + 1; u < bits(-80.0f); u += 97) xs.push_back(from(u));
    while (xs.size() % 16) xs.push_back(-1.0f);
    std::size_t mismatches = 0, checked = 0;
    for (std::size_t i = 0; i < xs.size(); i += 16) {
        const __m512 x = _mm512_loadu_ps(xs.data() + i);
        alignas(64) float ours[16], eigen[16], raw[16];
        const __m512 e = rpe::detail::cpu::simd::exp_nonpositive(x);
        _mm512_store_ps(raw, e);
        _mm512_store_ps(ours, flushed(e));
        _mm512_store_ps(eigen, flushed(Eigen::internal::pexp(x)));
        mismatches += static_cast<std::size_t>(std::memcmp(ours, eigen, sizeof ours) != 0);
        for (int l = 0; l < 16; ++l, ++checked) {
            const double want = std::exp(static_cast<double>(xs[i + static_cast<std::size_t>(l)]));
            if (want >= 1e-37)
                REQUIRE(std::abs(raw[l] - want) <= 3e-7 * want);  // a few ulp
            else  // the flush subtracts 1.18e-38 (the smallest normal number): 0 below it
                REQUIRE((want < 1.1e-38 ? ours[l] == 0.0f : ours[l] <= 1.000001 * want));
        }
    }
    CHECK(checked > 2'000'000);
    CHECK(mismatches == 0);
}

// simd::gemm_bt takes B as (n, kk) rows (nn.Linear's W) and packs strips of Bᵀ itself: the same
// chains, so the same bits as gemm on an explicit Bᵀ, for any column range [j0, j1) (a thread's
// share), inner lengths around the packing's blocks (160, 128) and every strip remainder; the
// columns outside [j0, j1) and the rows past m are not written.
TEST_CASE("cpu simd gemm_bt equals gemm on the transposed B, bit for bit, for any column range") {
    namespace simd = rpe::detail::cpu::simd;
    std::mt19937 rng(12);
    std::normal_distribution<float> normal;
    alignas(64) static float pack[simd::gemm_bt_pack_floats];
    for (const bool accumulate : {false, true})
        for (const std::int64_t m : {1, 5, 13, 40})
            for (const std::int64_t n : {1, 17, 64, 100, 193})
                for (const std::int64_t kk : {0, 1, 15, 17, 160, 161, 300})
                    for (const auto& [j0, j1] : {std::pair<std::int64_t, std::int64_t>{0, n}, {n / 3, n - n / 4}}) {
                        CAPTURE(accumulate);
                        CAPTURE(m);
                        CAPTURE(n);
                        CAPTURE(kk);
                        CAPTURE(j0);
                        CAPTURE(j1);
                        const std::int64_t lda = kk + 3, ldb = kk + 5, ldc = n + 9;
                        std::vector<float> a(static_cast<std::size_t>(m * lda + 1)), b(static_cast<std::size_t>(n * ldb + 1)),
                            bt(static_cast<std::size_t>(kk * n + 1)), c(static_cast<std::size_t>((m + 1) * ldc));
                        for (auto& e : a) e = normal(rng);
                        for (auto& e : b) e = normal(rng);
                        for (auto& e : c) e = normal(rng);
                        for (std::int64_t k = 0; k < kk; ++k)
                            for (std::int64_t j = 0; j < n; ++j)
                                bt[static_cast<std::size_t>(k * n + j)] = b[static_cast<std::size_t>(j * ldb + k)];
                        std::vector<float> want = c;
                        simd::gemm(m, j1 - j0, kk, a.data(), lda, 1, bt.data() + j0, n, want.data() + j0, ldc, accumulate);
                        simd::gemm_bt(m, j0, j1, kk, a.data(), lda, 1, b.data(), ldb, c.data(), ldc, accumulate, pack);
                        REQUIRE(std::memcmp(c.data(), want.data(), c.size() * sizeof(float)) == 0);
                        // and real values: one element against a double sum
                        if (j1 > j0 && kk > 0 && !accumulate) {
                            double exact = 0;
                            for (std::int64_t k = 0; k < kk; ++k)
                                exact += static_cast<double>(a[static_cast<std::size_t>((m - 1) * lda + k)]) *
                                         b[static_cast<std::size_t>((j1 - 1) * ldb + k)];
                            REQUIRE(std::abs(c[static_cast<std::size_t>((m - 1) * ldc + j1 - 1)] - exact) <=
                                    1e-5 * (1.0 + static_cast<double>(kk)));
                        }
                    }
}
#endif

TEST_CASE("cpu workspace: reused across calls, released on request, results unchanged") {
    namespace cpu = rpe::detail::cpu;
    rpe::release_cpu_workspace();
    CHECK(cpu::arena::of_this_thread().capacity() == 0);
    const rpe::mapping::product<> m{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key> t(
        m, {.num_heads = 2, .head_dim = 4, .skip = 1});
    const auto ids = t.bucket_ids(3, 3);
    const int l = ids->length(), k = t.num_buckets();
    std::vector<float> x(static_cast<std::size_t>(2 * l * 4), 0.25f), table(static_cast<std::size_t>(4 * k), 0.5f);
    std::vector<float> a(static_cast<std::size_t>(2 * l * l)), b(a.size());
    t.forward(*ids, {table.data(), {1, 4, k}}, {x.data(), {1, 2, l, 4}}, {a.data(), {1, 2, l, l}}, rpe::write::overwrite);
    const auto held = cpu::arena::of_this_thread().capacity();
    CHECK(held > 0);
    t.forward(*ids, {table.data(), {1, 4, k}}, {x.data(), {1, 2, l, 4}}, {b.data(), {1, 2, l, l}}, rpe::write::overwrite);
    CHECK(cpu::arena::of_this_thread().capacity() == held);  // no new allocation
    CHECK(a == b);
    CHECK(a[0] == doctest::Approx(4 * 0.25 * 0.5));
    rpe::release_cpu_workspace();
    CHECK(cpu::arena::of_this_thread().capacity() == 0);
    t.forward(*ids, {table.data(), {1, 4, k}}, {x.data(), {1, 2, l, 4}}, {b.data(), {1, 2, l, l}}, rpe::write::overwrite);
    CHECK(a == b);
}

}  // namespace rpe_unit_cpu_simd
