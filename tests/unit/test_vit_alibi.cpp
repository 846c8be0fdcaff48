// 2D ALiBi (CROMA) as rpe's bias term on the product mapping with a clip index and a fixed,
// generated table: slopes and the (H, N, N) bias against CROMA's get_2dalibi, the whole CROMA
// attention (forward, q/k/v gradients) against golden data from its Attention module
// (tests/data/golden_vit/alibi, tools/golden/gen_sam_alibi.py), finite-difference checks of q,
// k, v through the fused attention with ALiBi, non-square grids and skip tokens, the errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <rpe/attention.hpp>
#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/vit/alibi_2d.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_alibi {

namespace {

using rpe_test::cview;
using rpe_test::mview;

std::string dir(const std::string& rel) { return std::string(RPE_TEST_DATA_DIR) + "/golden_vit/alibi/" + rel; }

struct bias_case {
    int heads, side;
};
constexpr bias_case bias_cases[] = {{8, 4}, {12, 3}, {6, 5}, {16, 2}, {1, 3}, {3, 4}};

// bias/h<heads>_s<side>.npy (appended piecewise: g++ 12's -Wrestrict misfires on "h" + string)
std::string bias_file(int heads, int side) {
    std::string f = "h";
    f += std::to_string(heads);
    f += "_s";
    f += std::to_string(side);
    f += ".npy";
    return f;
}

// The (H, L, L) bias that the term adds: out of a bias-mode forward on a (1, H, L, L) output.
template <class S>
std::vector<S> bias_of(const rpe::vit::alibi_2d_config& c) {
    const auto term = rpe::vit::make_alibi_2d_term<S>(c);
    const auto table = rpe::vit::alibi_2d_table<S>(c);
    const auto ids = term.bucket_ids(c.height, c.width);
    const std::int64_t l = c.skip + static_cast<std::int64_t>(c.height) * c.width;
    std::vector<S> out(static_cast<std::size_t>(c.num_heads * l * l));
    term.forward(*ids, cview(table, term.table_shape()), {}, mview(out, {1, c.num_heads, l, l}), rpe::write::overwrite);
    return out;
}

// CROMA's attention through rpe: q, k, v (B, H, L, D) on a side x side grid.
template <class S>
struct alibi_run {
    std::vector<S> out, gq, gk, gv;
};
template <class S>
alibi_run<S> run_alibi(const rpe::vit::alibi_2d_config& c, int batch, const std::vector<S>& q, const std::vector<S>& k,
                       const std::vector<S>& v, const std::vector<S>& grad_out, bool fused, bool backward = true) {
    const auto term = rpe::vit::make_alibi_2d_term<S>(c);
    const auto table = rpe::vit::alibi_2d_table<S>(c);
    const auto any = rpe::make_any_term(term);
    const std::int64_t l = c.skip + static_cast<std::int64_t>(c.height) * c.width;
    const std::vector<std::int64_t> qs{batch, c.num_heads, l, c.head_dim};
    rpe::attention_inputs<S> in;
    in.q = cview(q, qs);
    in.k = cview(k, qs);
    in.v = cview(v, qs);
    in.height = c.height;
    in.width = c.width;
    in.rpe_k = {any.get(), {cview(table, term.table_shape())}, {}};  // fixed: no table gradient
    alibi_run<S> r;
    r.out.resize(q.size());
    std::vector<S> attn(static_cast<std::size_t>(batch * c.num_heads * l * l));
    const auto attn_ref = mview(attn, {batch, c.num_heads, l, l});
    if (fused)
        rpe::attention_forward<S>(in, mview(r.out, qs));
    else
        rpe::composed_attention_forward<S>(in, mview(r.out, qs), attn_ref);
    if (!backward) return r;
    r.gq.resize(q.size());
    r.gk.resize(q.size());
    r.gv.resize(q.size());
    if (fused)
        rpe::attention_backward<S>(in, cview(grad_out, qs), mview(r.gq, qs), mview(r.gk, qs), mview(r.gv, qs));
    else
        rpe::composed_attention_backward<S>(in, {.grad_out = cview(grad_out, qs),
                                                 .grad_q = mview(r.gq, qs),
                                                 .grad_k = mview(r.gk, qs),
                                                 .grad_v = mview(r.gv, qs),
                                                 .saved_attn = attn_ref});
    return r;
}

}  // namespace

TEST_CASE("2D ALiBi: slopes as ALiBi's get_slopes") {
    // powers of two: start = 2^(-8/n), m_i = start^(i+1)
    const auto s8 = rpe::vit::alibi_slopes(8);
    REQUIRE(s8.size() == 8);
    for (int i = 0; i < 8; ++i) CHECK(s8[static_cast<std::size_t>(i)] == std::ldexp(1.0, -(i + 1)));
    const auto s16 = rpe::vit::alibi_slopes(16);
    for (int i = 0; i < 16; ++i)
        CHECK(s16[static_cast<std::size_t>(i)] == doctest::Approx(std::pow(2.0, -0.5 * (i + 1))).epsilon(1e-15));
    // 12 = 8 + 4: the 8 slopes of 8 heads, then slopes 0, 2, 4, 6 of 16 heads
    const auto s12 = rpe::vit::alibi_slopes(12);
    REQUIRE(s12.size() == 12);
    for (int i = 0; i < 8; ++i) CHECK(s12[static_cast<std::size_t>(i)] == s8[static_cast<std::size_t>(i)]);
    for (int i = 0; i < 4; ++i) CHECK(s12[static_cast<std::size_t>(8 + i)] == s16[static_cast<std::size_t>(2 * i)]);
    CHECK(rpe::vit::alibi_slopes(1) == std::vector<double>{std::ldexp(1.0, -8)});
    // against CROMA: its bias between patches 0 and 1 (distance 1) is -float(slope)
    for (const auto& c : bias_cases) {
        CAPTURE(c.heads);
        const std::int64_t n = c.side * c.side;
        const auto bias = rpe_test::load<float>(dir("bias"), bias_file(c.heads, c.side), {c.heads, n, n});
        const auto s = rpe::vit::alibi_slopes(c.heads);
        for (int h = 0; h < c.heads; ++h)
            CHECK(-static_cast<float>(s[static_cast<std::size_t>(h)]) == bias[static_cast<std::size_t>(h * n * n + 1)]);
    }
}

TEST_CASE_TEMPLATE("2D ALiBi: the term's bias is CROMA's get_2dalibi", S, float, double) {
    for (const auto& c : bias_cases) {
        CAPTURE(c.heads);
        CAPTURE(c.side);
        const std::int64_t n = c.side * c.side;
        const auto want = rpe_test::load<double>(dir("bias"), bias_file(c.heads, c.side), {c.heads, n, n});
        const auto got = bias_of<S>({.height = c.side, .width = c.side, .num_heads = c.heads, .head_dim = 4});
        // float: bit-exact (same float product); double: to float32 rounding of CROMA's values
        if constexpr (std::is_same_v<S, float>)
            rpe_test::check_close(got, want, 1e-300, 0.0, "bias (float)");  // exact (atol > 0: 0/0 is no match)
        else
            rpe_test::check_close(got, want, 1e-7, 1e-7, "bias (double)");
    }
}

TEST_CASE("2D ALiBi: non-square grids and skip tokens") {
    // 3 x 5 grid, 3 heads, one class token: pairs with it get 0, the rest -m_h * Euclidean distance
    const rpe::vit::alibi_2d_config c{.height = 3, .width = 5, .num_heads = 3, .head_dim = 2, .skip = 1};
    const auto term = rpe::vit::make_alibi_2d_term<double>(c);
    CHECK(term.num_buckets() == 9 * 9 + 1);
    CHECK(term.table_shape() == std::vector<std::int64_t>{3, 82});
    const auto got = bias_of<double>(c);
    const auto s = rpe::vit::alibi_slopes(3);
    const int l = 16;
    for (int h = 0; h < 3; ++h)
        for (int i = 0; i < l; ++i)
            for (int j = 0; j < l; ++j) {
                double want = 0;
                if (i > 0 && j > 0) {
                    const int dr = (i - 1) / 5 - (j - 1) / 5, dc = (i - 1) % 5 - (j - 1) % 5;
                    want = -s[static_cast<std::size_t>(h)] * std::sqrt(static_cast<double>(dr * dr + dc * dc));
                }
                CHECK(got[static_cast<std::size_t>((h * l + i) * l + j)] == doctest::Approx(want).epsilon(1e-15));
            }
}

TEST_CASE_TEMPLATE("2D ALiBi: CROMA's whole attention (forward and q/k/v gradients), fused and composed", S, float, double) {
    struct attn_case {
        const char* name;
        int b, heads, side, d;
    };
    for (const auto& c : {attn_case{"attn_h4_s3", 2, 4, 3, 8}, attn_case{"attn_h6_s4", 1, 6, 4, 4}}) {
        CAPTURE(c.name);
        const std::string cd = dir(c.name);
        const std::int64_t n = c.side * c.side;
        const std::vector<std::int64_t> qs{c.b, c.heads, n, c.d};
        const auto q = rpe_test::load<S>(cd, "q.npy", qs), k = rpe_test::load<S>(cd, "k.npy", qs),
                   v = rpe_test::load<S>(cd, "v.npy", qs);
        const auto g = rpe_test::load<S>(cd, "grad_out.npy", qs);
        const rpe::vit::alibi_2d_config cfg{.height = c.side, .width = c.side, .num_heads = c.heads, .head_dim = c.d};
        for (bool fused : {true, false}) {
            CAPTURE(fused);
            const auto r = run_alibi<S>(cfg, c.b, q, k, v, g, fused);
            // the golden data is CROMA's float32 computation
            rpe_test::check_close(r.out, rpe_test::load<double>(cd, "out.npy"), 1e-5, 1e-4, "out");
            rpe_test::check_close(r.gq, rpe_test::load<double>(cd, "grad_q.npy"), 1e-5, 1e-4, "grad_q");
            rpe_test::check_close(r.gk, rpe_test::load<double>(cd, "grad_k.npy"), 1e-5, 1e-4, "grad_k");
            rpe_test::check_close(r.gv, rpe_test::load<double>(cd, "grad_v.npy"), 1e-5, 1e-4, "grad_v");
        }
    }
}

TEST_CASE("2D ALiBi: finite-difference gradients of q, k, v through the fused attention") {
    // B 2, 3 heads, 2 x 3 grid with a class token, D 4
    const rpe::vit::alibi_2d_config c{.height = 2, .width = 3, .num_heads = 3, .head_dim = 4, .skip = 1};
    const std::size_t n = 2 * 3 * 7 * 4;
    auto q = rpe_test::random_normal<double>(n, 21), k = rpe_test::random_normal<double>(n, 22),
         v = rpe_test::random_normal<double>(n, 23);
    const auto g = rpe_test::random_normal<double>(n, 24);
    const auto r = run_alibi<double>(c, 2, q, k, v, g, true);
    const auto loss = [&] {
        const auto o = run_alibi<double>(c, 2, q, k, v, g, true, false).out;
        long double s = 0;
        for (std::size_t i = 0; i < o.size(); ++i) s += static_cast<long double>(o[i]) * g[i];
        return static_cast<double>(s);
    };
    const auto check = [&](std::vector<double>& p, const std::vector<double>& analytic, const char* name) {
        double worst = 0;
        for (std::size_t i = 0; i < p.size(); ++i) {
            const double saved = p[i];
            p[i] = saved + 1e-6;
            const double up = loss();
            p[i] = saved - 1e-6;
            const double down = loss();
            p[i] = saved;
            const double num = (up - down) / 2e-6;
            worst = std::max(worst, std::fabs(analytic[i] - num) / std::max({std::fabs(analytic[i]), std::fabs(num), 1e-2}));
        }
        INFO(name << ": worst relative error " << worst);
        CHECK(worst < 1e-6);
    };
    check(q, r.gq, "q");
    check(k, r.gk, "k");
    check(v, r.gv, "v");
    // ALiBi changes the result (and so the gradients being checked): without it out differs
    const auto any = rpe::make_any_term(rpe::vit::make_alibi_2d_term<double>(c));
    rpe::attention_inputs<double> plain;
    plain.q = cview(q, {2, 3, 7, 4});
    plain.k = cview(k, {2, 3, 7, 4});
    plain.v = cview(v, {2, 3, 7, 4});
    plain.height = 2;
    plain.width = 3;
    std::vector<double> out(n);
    // no term: L must equal height*width, so compare on the grid tokens only via a skip-free run
    const rpe::vit::alibi_2d_config c0{.height = 2, .width = 3, .num_heads = 3, .head_dim = 4};
    const auto q0 = rpe_test::random_normal<double>(2 * 3 * 6 * 4, 31);
    const auto with = run_alibi<double>(c0, 2, q0, q0, q0, q0, true, false).out;
    plain.q = plain.k = plain.v = cview(q0, {2, 3, 6, 4});
    out.resize(q0.size());
    rpe::attention_forward<double>(plain, mview(out, {2, 3, 6, 4}));
    CHECK(rpe_test::max_abs_diff(with, out) > 1e-3);
}

TEST_CASE("2D ALiBi: errors name the parameter and its value") {
    using rpe_test::throws_with;
    CHECK(throws_with([] { (void)rpe::vit::alibi_slopes(0); }, {"[rpe.vit.alibi]", "num_heads = 0"}));
    CHECK(throws_with([] { (void)rpe::vit::alibi_2d_mapping(0, 3); }, {"[rpe.vit.alibi]", "height = 0"}));
    CHECK(throws_with([] { (void)rpe::vit::alibi_2d_mapping(3, 40000); }, {"width = 40000"}));
    // (2·max(H, W) − 1)² buckets must fit in int: 23170 is the largest side (review: 23171 overflowed in product.hpp)
    CHECK(throws_with([] { (void)rpe::vit::alibi_2d_mapping(1, 23171); }, {"width = 23171", "<= 23170"}));
    CHECK(rpe::vit::alibi_2d_mapping(1, 23170).num_buckets() == 46339 * 46339);
    CHECK(throws_with([] { (void)rpe::vit::alibi_2d_table<float>({.height = 2, .width = 2, .num_heads = -1, .head_dim = 2}); },
                      {"num_heads = -1"}));
    CHECK(throws_with(
        [] { (void)rpe::vit::alibi_2d_table<float>({.height = 2, .width = 2, .num_heads = 2, .head_dim = 2, .skip = -1}); },
        {"skip = -1"}));
    std::vector<float> t(2 * 8);
    CHECK(throws_with(
        [&] {
            rpe::vit::alibi_2d_table<float>({.height = 2, .width = 2, .num_heads = 2, .head_dim = 2}, mview(t, {2, 8}));
        },
        {"[rpe.vit.alibi] table has shape (2, 8)", "expected (2, 9)"}));
    CHECK(throws_with([] { (void)rpe::vit::make_alibi_2d_term<float>({.height = 2, .width = 2, .num_heads = 2, .head_dim = 0}); },
                      {"[rpe.term]", "head_dim = 0"}));
}

TEST_CASE("2D ALiBi: a term is bounded to its grid (a larger grid is refused, a smaller one reads its buckets)") {
    using rpe_test::throws_with;
    // built for 3 x 5 (beta = 4); a 5 x 3 grid has no offset beyond beta but is taller: refused too
    const rpe::vit::alibi_2d_config c{.height = 3, .width = 5, .num_heads = 2, .head_dim = 2};
    const auto term = rpe::vit::make_alibi_2d_term<double>(c);
    const auto table = rpe::vit::alibi_2d_table<double>(c);
    CHECK(throws_with([&] { (void)term.bucket_ids(4, 5); },
                      {"[rpe.mapping.within_grid]", "grid = 4x5 is larger than the 3x5 grid the term was built for"}));
    CHECK(throws_with([&] { (void)term.bucket_ids(3, 6); }, {"grid = 3x6", "expected height <= 3 and width <= 5"}));
    CHECK(throws_with([&] { (void)term.bucket_ids(5, 3); }, {"grid = 5x3"}));
    CHECK(throws_with([&] { (void)rpe::bucket_cache::global().get(term.mapping(), 9, 9, 1); }, {"grid = 9x9"}));
    // ids of the unbounded Product on a larger grid (the silent clip) are another mapping's
    const std::int64_t lbig = 4 * 5;
    std::vector<double> out(static_cast<std::size_t>(2 * lbig * lbig));
    const auto unbounded = rpe::build_bucket_ids(term.mapping().inner, 4, 5, 0);
    CHECK(throws_with(
        [&] {
            term.forward(*unbounded, cview(table, term.table_shape()), {}, mview(out, {1, 2, lbig, lbig}), rpe::write::overwrite);
        },
        {"[rpe.term]", "built for another mapping"}));
    // the fused and the composed attention on the larger grid
    const auto any = rpe::make_any_term(term);
    std::vector<double> x(static_cast<std::size_t>(2 * lbig * 2), 0.5), o(x.size());
    rpe::attention_inputs<double> in;
    in.q = in.k = in.v = cview(x, {1, 2, lbig, 2});
    in.height = 4;
    in.width = 5;
    in.rpe_k = {any.get(), {cview(table, term.table_shape())}, {}};
    CHECK(throws_with(
        [&] {
            rpe::attention_forward<double>(in, mview(o, {1, 2, lbig, 2}));
        },
        {"[rpe.mapping.within_grid]", "grid = 4x5"}));
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_forward<double>(in, mview(o, {1, 2, lbig, 2}), mview(out, {1, 2, lbig, lbig}));
        },
        {"grid = 4x5"}));

    // a smaller grid (2 x 3) with the 3 x 5 term: the bias of the full grid at the same tokens, which
    // is -m_h times the Euclidean distance
    const auto big = bias_of<double>(c);  // (2, 15, 15)
    const auto small_ids = term.bucket_ids(2, 3);
    std::vector<double> small(2 * 6 * 6);
    term.forward(*small_ids, cview(table, term.table_shape()), {}, mview(small, {1, 2, 6, 6}), rpe::write::overwrite);
    const auto slopes = rpe::vit::alibi_slopes(2);
    int mismatches = 0;
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 6; ++i)
            for (int j = 0; j < 6; ++j) {
                const int bi = (i / 3) * 5 + i % 3, bj = (j / 3) * 5 + j % 3, dr = i / 3 - j / 3, dc = i % 3 - j % 3;
                const double got = small[static_cast<std::size_t>((h * 6 + i) * 6 + j)];
                mismatches += got != big[static_cast<std::size_t>((h * 15 + bi) * 15 + bj)];
                mismatches += std::fabs(got + slopes[static_cast<std::size_t>(h)] * std::sqrt(dr * dr + dc * dc)) > 1e-15;
            }
    CHECK(mismatches == 0);
    // the bound is part of the cache key: a 5 x 5 term (same beta) keeps its own ids of the 2 x 3 grid
    const auto square = rpe::vit::make_alibi_2d_term<double>({.height = 5, .width = 5, .num_heads = 2, .head_dim = 2});
    CHECK(square.mapping().inner == term.mapping().inner);
    CHECK(!(square.mapping() == term.mapping()));
    const auto square_ids = square.bucket_ids(2, 3);
    CHECK(square_ids.get() != small_ids.get());
    CHECK(rpe_test::ids_matrix(*square_ids) == rpe_test::ids_matrix(*small_ids));
}

}  // namespace rpe_unit_vit_alibi
