// The bf16 Linear layers of the CPU backend (rpe::detail::cpu, bf16_kernels.hpp; the whole-model
// bf16 benchmarks run on them): bf16_gemm_portable and, where this build has AVX512_BF16,
// bf16_gemm against a float64 product of the same bf16 values; bf16_pack_linear's panels;
// bf16_linear and bf16_linear_tiles (epilogue) on every path (AMX tiles where the unit is built for
// them and the OS grants them, vdpbf16ps, portable: the test hooks bf16_amx_off, bf16_portable_only),
// ragged sizes (rows not a multiple of 8 or of the 64-row tiles, a 32-row AMX block of 17 rows,
// outputs not a multiple of 32 or of the 128-wide panels, odd inner sizes), rows further apart than their length, 1 and 2 threads.
//
// Error model: the inputs are bf16 values, exact in float and double, so the reference (double
// sums of the same products) sees the same problem. Each product a·b is exact in float (8 × 8
// significant bits), the kd products of an output are summed in float (at most kd − 1 roundings
// of unit roundoff 2^-24 on partial sums bounded by Σ|a·b|), then scaled by alpha and added to
// C (two more): |C − ref| ≤ (kd + 2)·2^-24·(|alpha|·Σ_r |a_ir·b_rj| + |C0| + |ref|).
#include <doctest/doctest.h>
#include "cpu_paths.hpp"
#include <rpe/rpe.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_bf16_linear {

namespace {

using rpe::bf16;
namespace cpu = rpe::detail::cpu;

std::vector<bf16> random_bf16(std::size_t n, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<bf16> v(n);
    for (auto& e : v) e = bf16(normal(rng));
    return v;
}

double as_double(bf16 x) { return static_cast<double>(x); }

// worst |got − ref| / bound over C (m, n) rows ldc apart, for C = c0 + alpha·A·B, A (m, kd) rows
// lda apart, B(r, j) = b(r, j) (a callable); 0 means exact, ≤ 1 within the error model above.
template <class B>
double worst_ratio(const std::vector<float>& got, std::int64_t ldc, float c0, float alpha, const std::vector<bf16>& a,
                   std::int64_t lda, std::int64_t m, std::int64_t n, std::int64_t kd, B&& b) {
    double worst = 0;
    for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
            double ref = 0, mag = 0;
            for (std::int64_t r = 0; r < kd; ++r) {
                const double x = as_double(a[static_cast<std::size_t>(i * lda + r)]) * b(r, j);
                ref += x;
                mag += std::fabs(x);
            }
            ref = c0 + alpha * ref;
            const double bound =
                (static_cast<double>(kd) + 2) * 0x1p-24 * (std::fabs(alpha) * mag + std::fabs(c0) + std::fabs(ref)) + 1e-30;
            worst = std::max(worst, std::fabs(static_cast<double>(got[static_cast<std::size_t>(i * ldc + j)]) - ref) / bound);
        }
    return worst;
}

}  // namespace

TEST_CASE("bf16_gemm_portable (and bf16_gemm with AVX512_BF16) against float64: ragged sizes, strides, alpha, add") {
    using shape = std::array<std::int64_t, 3>;  // m, n, kd
    for (const auto [m, n, kd] :
         {shape{1, 1, 1}, shape{3, 5, 2}, shape{9, 33, 7}, shape{13, 70, 65}, shape{67, 129, 130}, shape{8, 32, 384}}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(kd);
        std::mt19937 rng(static_cast<std::uint32_t>(m * 7919 + n * 31 + kd));
        const std::int64_t lda = kd + 3, ldc = n + 5;  // rows further apart than their length
        const auto a = random_bf16(static_cast<std::size_t>(m * lda), rng);
        const auto b = random_bf16(static_cast<std::size_t>(kd * n), rng);  // B (kd, n) row-major
        std::vector<bf16> bp(static_cast<std::size_t>(cpu::bf16_pack_size(kd, n)));
        cpu::bf16_pack_rows(b.data(), n, kd, n, bp.data());
        auto bref = [&](std::int64_t r, std::int64_t j) { return as_double(b[static_cast<std::size_t>(r * n + j)]); };
        for (const bool add : {false, true}) {
            CAPTURE(add);
            const float c0 = add ? 0.75f : 0.0f, alpha = add ? -0.5f : 1.0f;
            std::vector<float> c(static_cast<std::size_t>(m * ldc), 0.75f);
            cpu::bf16_gemm_portable(m, n, kd, a.data(), lda, bp.data(), c.data(), ldc, alpha, add);
            CHECK(worst_ratio(c, ldc, c0, alpha, a, lda, m, n, kd, bref) <= 1.0);
            bool untouched = true;  // the columns past n of each row are not written
            for (std::int64_t i = 0; i < m; ++i)
                for (std::int64_t j = n; j < ldc; ++j) untouched = untouched && c[static_cast<std::size_t>(i * ldc + j)] == 0.75f;
            CHECK(untouched);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (cpu::cpu_has_avx512_bf16()) {
                std::vector<float> h(c.size(), 0.75f);
                cpu::bf16_gemm(m, n, kd, a.data(), lda, bp.data(), h.data(), ldc, alpha, add);
                CHECK(worst_ratio(h, ldc, c0, alpha, a, lda, m, n, kd, bref) <= 1.0);
            }
#endif
        }
    }
    // hand-checked: A = [[1, 2, 3]], B = [[1, 0], [0.5, 1], [-1, 2]] (kd 3: an odd last pair)
    const std::vector<bf16> a = {bf16(1.0f), bf16(2.0f), bf16(3.0f)};
    const std::vector<bf16> b = {bf16(1.0f), bf16(0.0f), bf16(0.5f), bf16(1.0f), bf16(-1.0f), bf16(2.0f)};
    std::vector<bf16> bp(static_cast<std::size_t>(cpu::bf16_pack_size(3, 2)));
    cpu::bf16_pack_rows(b.data(), 2, 3, 2, bp.data());
    std::vector<float> c(2, 10.0f);
    cpu::bf16_gemm_portable(1, 2, 3, a.data(), 3, bp.data(), c.data(), 2, 2.0f, true);
    CHECK(c[0] == 10.0f + 2.0f * (1.0f + 1.0f - 3.0f));  // 8
    CHECK(c[1] == 10.0f + 2.0f * (0.0f + 2.0f + 6.0f));  // 26
}

TEST_CASE("bf16_pack_linear: panels of 128 outputs, each W[panel]ᵀ packed by bf16_pack_transposed") {
    std::mt19937 rng(5);
    const std::int64_t n = 300, kd = 9, ldw = 11;  // 3 panels: 128, 128, 44 outputs
    const auto w = random_bf16(static_cast<std::size_t>(n * ldw), rng);
    const auto pw = cpu::bf16_pack_linear(w.data(), ldw, n, kd);
    CHECK(pw.n == n);
    CHECK(pw.kd == kd);
    CHECK(pw.panels() == 3);
    CHECK(pw.panel_size() == (kd + 1) / 2 * 128 * 2);
    REQUIRE(pw.packed.size() == static_cast<std::size_t>(3 * pw.panel_size()));
    // element (r, j) of B = Wᵀ: W(j, r), in panel p = j / 128 at [(r/2·npad + j%128)·2 + r%2], npad
    // the panel's width rounded up to 32 (128, 128, then 64 for the last 44 outputs)
    const std::int64_t npad[3] = {128, 128, 64};
    bool same = true;
    for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t r = 0; r < kd; ++r) {
            const std::int64_t p = j / 128, jj = j % 128;
            same = same && pw.packed[static_cast<std::size_t>(p * pw.panel_size() + ((r / 2) * npad[p] + jj) * 2 + r % 2)] ==
                               w[static_cast<std::size_t>(j * ldw + r)];
        }
    CHECK(same);
    bool zeros = true;  // the padding: the last panel's columns 44..63 and the odd kd's last pair half
    for (std::int64_t r = 0; r < kd + 1; ++r)
        for (std::int64_t jj = 0; jj < 64; ++jj) {
            if (2 * 128 + jj < n && r < kd) continue;
            zeros = zeros && pw.packed[static_cast<std::size_t>(2 * pw.panel_size() + ((r / 2) * 64 + jj) * 2 + r % 2)].bits == 0;
        }
    CHECK(zeros);
}

TEST_CASE("bf16_linear and bf16_linear_tiles against float64 on every path; 1 and 2 threads give the same bits") {
    using shape = std::array<std::int64_t, 3>;  // m (rows of x), n (outputs), kd (inputs)
    for (const auto [m, n, kd] : {shape{1, 1, 1}, shape{5, 130, 33}, shape{70, 257, 75}, shape{131, 128, 384}, shape{70, 257, 96},
                                  shape{3, 20, 32}, shape{49, 40, 64}}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(kd);
        std::mt19937 rng(static_cast<std::uint32_t>(m * 131 + n * 7 + kd));
        const std::int64_t ldx = kd + 2, ldw = kd + 1, ldy = n + 3;
        const auto x = random_bf16(static_cast<std::size_t>(m * ldx), rng);
        const auto w = random_bf16(static_cast<std::size_t>(n * ldw), rng);
        const auto bias = random_bf16(static_cast<std::size_t>(n), rng);
        const auto pw = cpu::bf16_pack_linear(w.data(), ldw, n, kd);
        auto wref = [&](std::int64_t r, std::int64_t j) { return as_double(w[static_cast<std::size_t>(j * ldw + r)]); };
        // 0: the unit's own path (AMX tiles where built, granted and kd % 32 == 0), 1: without AMX
        // (vdpbf16ps where built), 2: portable
        for (const int route : {0, 1, 2}) {
            CAPTURE(route);
            const rpe_test::bf16_amx_off_path amx_off(route == 1);
            const rpe_test::bf16_portable_path path(route == 2);
            CHECK(cpu::bf16_linear_uses_amx(pw) == (route == 0 && cpu::hw_amx && cpu::amx_granted() && kd % 32 == 0));
            std::vector<float> first;
            for (const int threads : {1, 2}) {
                CAPTURE(threads);
                rpe_test::set_threads(threads);
                // y = 0.5 + x·Wᵀ (add), and y = x·Wᵀ
                std::vector<float> y(static_cast<std::size_t>(m * ldy), 0.5f), y0(y.size(), 9.0f);
                cpu::bf16_linear(m, x.data(), ldx, pw, y.data(), ldy, true);
                cpu::bf16_linear(m, x.data(), ldx, pw, y0.data(), ldy, false);
                CHECK(worst_ratio(y, ldy, 0.5f, 1.0f, x, ldx, m, n, kd, wref) <= 1.0);
                CHECK(worst_ratio(y0, ldy, 0.0f, 1.0f, x, ldx, m, n, kd, wref) <= 1.0);
                bool untouched = true;
                for (std::int64_t i = 0; i < m; ++i)
                    for (std::int64_t j = n; j < ldy; ++j)
                        untouched = untouched && y0[static_cast<std::size_t>(i * ldy + j)] == 9.0f;
                CHECK(untouched);
                // the epilogue: bf16(x·Wᵀ + bias), every output written exactly once
                std::vector<bf16> yb(static_cast<std::size_t>(m * n));
                std::vector<int> writes(yb.size(), 0);
                cpu::bf16_linear_tiles(
                    m, x.data(), ldx, pw, nullptr, 0, false,
                    [&](std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, float* t, std::int64_t ldt) {
                        for (std::int64_t r = 0; r < rows; ++r)
                            for (std::int64_t j = 0; j < cols; ++j) {
                                const auto k = static_cast<std::size_t>((i0 + r) * n + j0 + j);
                                yb[k] = bf16(t[r * ldt + j] + static_cast<float>(bias[static_cast<std::size_t>(j0 + j)]));
                                ++writes[k];
                            }
                    });
                CHECK(std::all_of(writes.begin(), writes.end(), [](int c) { return c == 1; }));
                // the tile is y0's product (the same kernel, the same sums), so the rounded sum is
                // the rounding of y0 + bias in float
                bool epilogue_ok = true;
                for (std::int64_t i = 0; i < m; ++i)
                    for (std::int64_t j = 0; j < n; ++j)
                        epilogue_ok = epilogue_ok && yb[static_cast<std::size_t>(i * n + j)] ==
                                                         bf16(y0[static_cast<std::size_t>(i * ldy + j)] +
                                                              static_cast<float>(bias[static_cast<std::size_t>(j)]));
                CHECK(epilogue_ok);
                if (threads == 1)
                    first = y;
                else
                    CHECK(std::memcmp(first.data(), y.data(), y.size() * sizeof(float)) == 0);
            }
        }
    }
    rpe_test::set_threads(2);
}

TEST_CASE("bf16 products: the path of this build and CPU") {
    if (!(cpu::hw_amx && cpu::amx_granted()))
        MESSAGE(
            "bf16_linear's AMX route is not exercised here: the unit is not built for AMX-BF16 or the OS does not "
            "grant the tiles");
    const std::string isa = cpu::bf16_isa();
    CHECK((isa == "AVX512_BF16" || isa == "portable"));
    CHECK(cpu::bf16_hw_now() == (isa == "AVX512_BF16"));
    {
        const rpe_test::bf16_portable_path path(true);
        CHECK_FALSE(cpu::bf16_hw_now());
    }
}

}  // namespace rpe_unit_bf16_linear
