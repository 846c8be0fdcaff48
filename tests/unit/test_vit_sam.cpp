// Decomposed relative position (SAM / MViTv2) as rpe's contextual Cross term with a clip index:
// ids against SAM's `get_rel_pos` index, the linear resize and its backward, and the whole SAM
// attention (forward, q/k/v and table gradients) against golden data from segment-anything
// (tests/data/golden_vit/sam, tools/golden/gen_sam_alibi.py); finite-difference checks of the
// load + attention chain; the errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <rpe/attention.hpp>
#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_sam {

namespace {

using rpe_test::cview;
using rpe_test::mview;

std::string dir(const std::string& rel) { return std::string(RPE_TEST_DATA_DIR) + "/golden_vit/sam/" + rel; }

template <class S>
std::vector<S> cast(const std::vector<double>& v) {
    return std::vector<S>(v.begin(), v.end());
}

// One SAM attention problem: q, k, v (B, nH, L, D), SAM's tables, and the loss weights.
template <class S>
struct sam_problem {
    int b = 0, nh = 0, h = 0, w = 0, d = 0;
    std::int64_t lh = 0, lw = 0;
    std::vector<S> q, k, v, rel_h, rel_w, grad_out;
    [[nodiscard]] std::int64_t l() const { return static_cast<std::int64_t>(h) * w; }
    [[nodiscard]] std::vector<std::int64_t> qshape() const { return {b, nh, l(), d}; }
    [[nodiscard]] rpe::vit::decomposed_rel_pos_config config() const {
        return {.height = h, .width = w, .num_heads = nh, .head_dim = d};
    }
};

template <class S>
sam_problem<S> load_problem(const std::string& name, int b, int nh, int h, int w, int d, std::int64_t lh, std::int64_t lw) {
    sam_problem<S> p{b, nh, h, w, d, lh, lw, {}, {}, {}, {}, {}, {}};
    const std::string c = dir(name);
    const auto qs = p.qshape();
    p.q = cast<S>(rpe_test::load<double>(c, "q.npy", qs));
    p.k = cast<S>(rpe_test::load<double>(c, "k.npy", qs));
    p.v = cast<S>(rpe_test::load<double>(c, "v.npy", qs));
    p.grad_out = cast<S>(rpe_test::load<double>(c, "grad_out.npy", qs));
    p.rel_h = cast<S>(rpe_test::load<double>(c, "rel_pos_h.npy", {lh, d}));
    p.rel_w = cast<S>(rpe_test::load<double>(c, "rel_pos_w.npy", {lw, d}));
    return p;
}

// The results of one run: out and the gradients of q, k, v, rel_pos_h, rel_pos_w.
template <class S>
struct sam_result {
    std::vector<S> out, gq, gk, gv, grh, grw;
};

// SAM's attention through rpe: load the tables, run the fused (or composed) attention and its
// backward, take the tables' gradients back to SAM's two tables.
template <class S>
sam_result<S> run_sam(const sam_problem<S>& p, bool fused, bool backward = true) {
    const auto cfg = p.config();
    const auto term = rpe::vit::make_decomposed_rel_pos_term<S>(cfg);
    const auto shape = term.table_shape();
    const std::int64_t tsize = shape[0] * shape[1] * shape[2];
    std::vector<S> t0(static_cast<std::size_t>(tsize)), t1(t0.size()), g0(t0.size()), g1(t0.size());
    rpe::vit::load_decomposed_rel_pos<S>(cfg, cview(p.rel_h, {p.lh, p.d}), cview(p.rel_w, {p.lw, p.d}),
                                         {mview(t0, shape), mview(t1, shape)});
    const auto any = rpe::make_any_term(term);
    rpe::attention_inputs<S> in;
    const auto qs = p.qshape();
    in.q = cview(p.q, qs);
    in.k = cview(p.k, qs);
    in.v = cview(p.v, qs);
    in.height = p.h;
    in.width = p.w;
    in.rpe_k = {any.get(), {cview(t0, shape), cview(t1, shape)}, {mview(g0, shape), mview(g1, shape)}};
    sam_result<S> r;
    const std::size_t n = p.q.size();
    r.out.resize(n);
    std::vector<S> attn(static_cast<std::size_t>(p.b * p.nh * p.l() * p.l()));
    const rpe::tensor_ref<S> attn_ref = mview(attn, {p.b, p.nh, p.l(), p.l()});
    if (fused)
        rpe::attention_forward<S>(in, mview(r.out, qs));
    else
        rpe::composed_attention_forward<S>(in, mview(r.out, qs), attn_ref);
    if (!backward) return r;
    r.gq.resize(n);
    r.gk.resize(n);
    r.gv.resize(n);
    if (fused)
        rpe::attention_backward<S>(in, cview(p.grad_out, qs), mview(r.gq, qs), mview(r.gk, qs), mview(r.gv, qs));
    else
        rpe::composed_attention_backward<S>(in, {.grad_out = cview(p.grad_out, qs),
                                                 .grad_q = mview(r.gq, qs),
                                                 .grad_k = mview(r.gk, qs),
                                                 .grad_v = mview(r.gv, qs),
                                                 .saved_attn = attn_ref});
    r.grh.resize(p.rel_h.size());
    r.grw.resize(p.rel_w.size());
    rpe::vit::load_decomposed_rel_pos_backward<S>(cfg, {cview(g0, shape), cview(g1, shape)}, mview(r.grh, {p.lh, p.d}),
                                                  mview(r.grw, {p.lw, p.d}));
    return r;
}

struct attn_case {
    const char* name;
    int b, nh, h, w, d;
    std::int64_t lh, lw;
};
constexpr attn_case attn_cases[] = {
    {"attn_4x6", 2, 2, 4, 6, 8, 7, 11},
    {"attn_5x5_resized", 1, 3, 5, 5, 4, 7, 13},
    {"attn_3x7_resized", 1, 2, 3, 7, 6, 9, 5},
};

double dot(const std::vector<double>& a, const std::vector<double>& b) {
    long double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<long double>(a[i]) * static_cast<long double>(b[i]);
    return static_cast<double>(s);
}

// Central differences (h = 1e-6) of `loss` over every entry of `param` against `analytic`:
// |analytic − numeric| / max(|analytic|, |numeric|, 1e-2) < 1e-6 (test_core_gradcheck's rule).
void check_param(std::vector<double>& param, const std::vector<double>& analytic, const std::function<double()>& loss,
                 const std::string& name) {
    REQUIRE(param.size() == analytic.size());
    double worst = 0;
    for (std::size_t i = 0; i < param.size(); ++i) {
        const double saved = param[i];
        param[i] = saved + 1e-6;
        const double up = loss();
        param[i] = saved - 1e-6;
        const double down = loss();
        param[i] = saved;
        const double numeric = (up - down) / 2e-6;
        worst = std::max(worst, std::fabs(analytic[i] - numeric) / std::max({std::fabs(analytic[i]), std::fabs(numeric), 1e-2}));
    }
    INFO(name << ": worst relative error " << worst);
    CHECK(worst < 1e-6);
}

}  // namespace

TEST_CASE("decomposed rel pos: Cross ids are SAM's get_rel_pos rows, shifted into K = 2 max(H, W) - 1") {
    for (const auto& [h, w] : std::vector<std::pair<int, int>>{{4, 6}, {6, 4}, {14, 14}, {1, 6}, {4, 4}, {1, 1}}) {
        CAPTURE(h);
        CAPTURE(w);
        const auto idx_h = rpe_test::load<int>(dir("index"), "index_" + std::to_string(h) + ".npy", {h, h});
        const auto idx_w = rpe_test::load<int>(dir("index"), "index_" + std::to_string(w) + ".npy", {w, w});
        const auto term = rpe::vit::make_decomposed_rel_pos_term<float>({.height = h, .width = w, .num_heads = 1, .head_dim = 2});
        const int m = std::max(h, w);
        CHECK(term.num_buckets() == 2 * m - 1);
        CHECK(term.table_shape() == std::vector<std::int64_t>{1, 2, 2 * m - 1});
        const auto ids = term.bucket_ids(h, w);
        const int l = h * w;
        std::vector<int> want_rows(static_cast<std::size_t>(l * l)), want_cols(want_rows.size());
        for (int i = 0; i < l; ++i)
            for (int j = 0; j < l; ++j) {
                want_rows[static_cast<std::size_t>(i * l + j)] = idx_h[static_cast<std::size_t>((i / w) * h + j / w)] + (m - h);
                want_cols[static_cast<std::size_t>(i * l + j)] = idx_w[static_cast<std::size_t>((i % w) * w + j % w)] + (m - w);
            }
        rpe_test::check_exact(rpe_test::ids_matrix(*ids, 0), want_rows, "rows table ids");
        rpe_test::check_exact(rpe_test::ids_matrix(*ids, 1), want_cols, "cols table ids");
    }
}

TEST_CASE_TEMPLATE("decomposed rel pos: resize_rel_pos and its backward match get_rel_pos's F.interpolate", S, float, double) {
    const double tol = std::is_same_v<S, double> ? 1e-12 : 2e-6;
    for (const auto& [lin, lout, c] :
         std::vector<std::array<std::int64_t, 3>>{{5, 7, 3}, {15, 11, 2}, {3, 27, 4}, {27, 7, 3}, {2, 3, 1}, {1, 5, 2}}) {
        const std::string cd = dir("resize/" + std::to_string(lin) + "_to_" + std::to_string(lout));
        CAPTURE(cd);
        const auto rel = cast<S>(rpe_test::load<double>(cd, "rel_pos.npy", {lin, c}));
        const auto g = cast<S>(rpe_test::load<double>(cd, "grad_out.npy", {lout, c}));
        std::vector<S> out(static_cast<std::size_t>(lout * c)), grad(static_cast<std::size_t>(lin * c), S(7));
        rpe::vit::resize_rel_pos<S>(cview(rel, {lin, c}), mview(out, {lout, c}));
        rpe_test::check_close(out, rpe_test::load<double>(cd, "resized.npy"), tol, tol, "resized");
        rpe::vit::resize_rel_pos_backward<S>(cview(g, {lout, c}), mview(grad, {lin, c}), rpe::write::overwrite);
        rpe_test::check_close(grad, rpe_test::load<double>(cd, "grad_rel_pos.npy"), tol, tol, "grad_rel_pos");
        // accumulate adds to what is there
        auto twice = grad;
        rpe::vit::resize_rel_pos_backward<S>(cview(g, {lout, c}), mview(twice, {lin, c}), rpe::write::accumulate);
        for (std::size_t i = 0; i < grad.size(); ++i) CHECK(twice[i] == doctest::Approx(2 * grad[i]).epsilon(1e-6));
    }
    // equal lengths: a copy
    const std::vector<S> a{1, 2, 3, 4, 5, 6};
    std::vector<S> b(6);
    rpe::vit::resize_rel_pos<S>(cview(a, {3, 2}), mview(b, {3, 2}));
    CHECK(b == a);
}

TEST_CASE("decomposed rel pos: the loader places SAM's rows, scaled by D^1/2 for SAM's unscaled q") {
    // H = 2, W = 3 (m = 3, K = 5), D = 4: rel_pos_h (3, 4) goes to buckets 1..3, rel_pos_w (5, 4) to 0..4
    std::vector<double> rh(12), rw(20);
    for (std::size_t i = 0; i < rh.size(); ++i) rh[i] = 1.0 + static_cast<double>(i);
    for (std::size_t i = 0; i < rw.size(); ++i) rw[i] = -1.0 - static_cast<double>(i);
    rpe::vit::decomposed_rel_pos_config cfg{.height = 2, .width = 3, .num_heads = 1, .head_dim = 4};
    for (bool unscaled : {true, false}) {
        cfg.unscaled_query = unscaled;
        const double f = unscaled ? 2.0 : 1.0;  // 1 / (4^-1/2)
        std::vector<double> t0(20, 9.0), t1(20, 9.0);
        rpe::vit::load_decomposed_rel_pos<double>(cfg, cview(rh, {3, 4}), cview(rw, {5, 4}),
                                                  {mview(t0, {1, 4, 5}), mview(t1, {1, 4, 5})});
        for (int ch = 0; ch < 4; ++ch) {
            CHECK(t0[static_cast<std::size_t>(ch * 5 + 0)] == 0.0);
            CHECK(t0[static_cast<std::size_t>(ch * 5 + 4)] == 0.0);
            for (int r = 0; r < 3; ++r)
                CHECK(t0[static_cast<std::size_t>(ch * 5 + r + 1)] == f * rh[static_cast<std::size_t>(r * 4 + ch)]);
            for (int r = 0; r < 5; ++r)
                CHECK(t1[static_cast<std::size_t>(ch * 5 + r)] == f * rw[static_cast<std::size_t>(r * 4 + ch)]);
        }
    }
    // with a skip token: K = 6, the extra bucket is 0
    cfg.skip = 1;
    std::vector<double> t0(24, 9.0), t1(24, 9.0);
    rpe::vit::load_decomposed_rel_pos<double>(cfg, cview(rh, {3, 4}), cview(rw, {5, 4}),
                                              {mview(t0, {1, 4, 6}), mview(t1, {1, 4, 6})});
    for (int ch = 0; ch < 4; ++ch) CHECK(t1[static_cast<std::size_t>(ch * 6 + 5)] == 0.0);
    CHECK(t1[0] == -1.0);
}

TEST_CASE_TEMPLATE("decomposed rel pos: SAM's whole attention (forward, q/k/v and table gradients), fused and composed", S, float,
                   double) {
    // float: the golden data is float64; the float run rounds q, k, v, the tables and every product
    const double atol = std::is_same_v<S, double> ? 1e-10 : 2e-5, rtol = std::is_same_v<S, double> ? 1e-9 : 1e-4;
    for (const auto& c : attn_cases) {
        CAPTURE(c.name);
        const auto p = load_problem<S>(c.name, c.b, c.nh, c.h, c.w, c.d, c.lh, c.lw);
        const std::string cd = dir(c.name);
        for (bool fused : {true, false}) {
            CAPTURE(fused);
            const auto r = run_sam(p, fused);
            rpe_test::check_close(r.out, rpe_test::load<double>(cd, "out.npy"), atol, rtol, "out");
            rpe_test::check_close(r.gq, rpe_test::load<double>(cd, "grad_q.npy"), atol, rtol, "grad_q");
            rpe_test::check_close(r.gk, rpe_test::load<double>(cd, "grad_k.npy"), atol, rtol, "grad_k");
            rpe_test::check_close(r.gv, rpe_test::load<double>(cd, "grad_v.npy"), atol, rtol, "grad_v");
            rpe_test::check_close(r.grh, rpe_test::load<double>(cd, "grad_rel_pos_h.npy"), atol, rtol, "grad_rel_pos_h");
            rpe_test::check_close(r.grw, rpe_test::load<double>(cd, "grad_rel_pos_w.npy"), atol, rtol, "grad_rel_pos_w");
        }
    }
}

TEST_CASE("decomposed rel pos: without the D^1/2 factor the result is not SAM's (the option matters)") {
    const auto& c = attn_cases[0];
    auto p = load_problem<double>(c.name, c.b, c.nh, c.h, c.w, c.d, c.lh, c.lw);
    const auto want = rpe_test::load<double>(dir(c.name), "out.npy");
    const auto cfg_run = [&](bool unscaled) {
        // the same chain as run_sam with cfg.unscaled_query switched
        auto cfg = p.config();
        cfg.unscaled_query = unscaled;
        const auto term = rpe::vit::make_decomposed_rel_pos_term<double>(cfg);
        const auto shape = term.table_shape();
        std::vector<double> t0(static_cast<std::size_t>(shape[1] * shape[2])), t1(t0.size());
        rpe::vit::load_decomposed_rel_pos<double>(cfg, cview(p.rel_h, {p.lh, p.d}), cview(p.rel_w, {p.lw, p.d}),
                                                  {mview(t0, shape), mview(t1, shape)});
        const auto any = rpe::make_any_term(term);
        rpe::attention_inputs<double> in;
        in.q = cview(p.q, p.qshape());
        in.k = cview(p.k, p.qshape());
        in.v = cview(p.v, p.qshape());
        in.height = p.h;
        in.width = p.w;
        in.rpe_k = {any.get(), {cview(t0, shape), cview(t1, shape)}, {}};
        std::vector<double> out(p.q.size());
        rpe::attention_forward<double>(in, mview(out, p.qshape()));
        return out;
    };
    CHECK(rpe_test::max_abs_diff(cfg_run(true), want) < 1e-10);
    CHECK(rpe_test::max_abs_diff(cfg_run(false), want) > 1e-3);
}

TEST_CASE("decomposed rel pos: finite-difference gradients of load + fused attention (resized tables)") {
    // B 1, 2 heads, 3 x 2 grid, D 3; rel_pos_h of length 4 (resized to 5), rel_pos_w of length 3
    sam_problem<double> p;
    p.b = 1;
    p.nh = 2;
    p.h = 3;
    p.w = 2;
    p.d = 3;
    p.lh = 4;
    p.lw = 3;
    const auto n = static_cast<std::size_t>(p.b * p.nh * p.l() * p.d);
    p.q = rpe_test::random_normal<double>(n, 11);
    p.k = rpe_test::random_normal<double>(n, 12);
    p.v = rpe_test::random_normal<double>(n, 13);
    p.grad_out = rpe_test::random_normal<double>(n, 14);
    p.rel_h = rpe_test::random_normal<double>(static_cast<std::size_t>(p.lh * p.d), 15);
    p.rel_w = rpe_test::random_normal<double>(static_cast<std::size_t>(p.lw * p.d), 16);
    const auto r = run_sam(p, true);
    const auto loss = [&] { return dot(run_sam(p, true, false).out, p.grad_out); };
    check_param(p.q, r.gq, loss, "q");
    check_param(p.k, r.gk, loss, "k");
    check_param(p.v, r.gv, loss, "v");
    check_param(p.rel_h, r.grh, loss, "rel_pos_h");
    check_param(p.rel_w, r.grw, loss, "rel_pos_w");
    // the check has teeth: a rel_pos_h gradient off by 1e-4 in one entry fails it
    auto wrong = r.grh;
    wrong[2] += 1e-4;
    const double saved = p.rel_h[2];
    p.rel_h[2] = saved + 1e-6;
    const double up = loss();
    p.rel_h[2] = saved - 1e-6;
    const double down = loss();
    p.rel_h[2] = saved;
    CHECK(std::fabs(wrong[2] - (up - down) / 2e-6) > 1e-6 * std::max(std::fabs(wrong[2]), 1e-2));
}

TEST_CASE("decomposed rel pos: errors name the parameter and its value") {
    using rpe_test::throws_with;
    CHECK(throws_with([] { (void)rpe::vit::decomposed_rel_pos_mapping(0, 4); }, {"[rpe.vit.decomposed]", "height = 0"}));
    CHECK(throws_with([] { (void)rpe::vit::decomposed_rel_pos_mapping(4, -2); }, {"[rpe.vit.decomposed]", "width = -2"}));
    CHECK(throws_with(
        [] { (void)rpe::vit::make_decomposed_rel_pos_term<float>({.height = 2, .width = 2, .num_heads = 0, .head_dim = 2}); },
        {"[rpe.term]", "num_heads = 0"}));
    std::vector<float> a(12), b(10), c(12);
    CHECK(throws_with(
        [&] {
            rpe::vit::resize_rel_pos<float>(cview(a, {6, 2}), mview(b, {2, 5}));
        },
        {"out has shape (2, 5)", "C = 2"}));
    CHECK(throws_with([&] { rpe::vit::resize_rel_pos<float>(cview(a, {12}), mview(b, {5, 2})); }, {"rel_pos has shape (12,)"}));
    CHECK(throws_with([&] { rpe::vit::resize_rel_pos<float>(cview(a, {6, 2}), mview(a, {6, 2})); }, {"out overlaps rel_pos"}));
    CHECK(throws_with(
        [&] {
            rpe::vit::resize_rel_pos_backward<float>(cview(a, {6, 2}), mview(b, {2, 5}), rpe::write::overwrite);
        },
        {"grad_rel_pos has shape (2, 5)"}));
    // loader: a table of the wrong K, C that is not head_dim; nothing written on failure
    const rpe::vit::decomposed_rel_pos_config cfg{.height = 2, .width = 3, .num_heads = 1, .head_dim = 2};
    std::vector<float> rh(6, 1.f), rw(10, 1.f), t0(10, 5.f), t1(10, 5.f), bad(8, 5.f);
    CHECK(throws_with(
        [&] {
            rpe::vit::load_decomposed_rel_pos<float>(cfg, cview(rh, {3, 2}), cview(rw, {5, 2}),
                                                     {mview(t0, {1, 2, 5}), mview(bad, {1, 2, 4})});
        },
        {"[rpe.vit.decomposed] tables[1] has shape (1, 2, 4)", "expected (1, 2, 5)"}));
    CHECK(std::all_of(t0.begin(), t0.end(), [](float x) { return x == 5.f; }));
    CHECK(throws_with(
        [&] {
            rpe::vit::load_decomposed_rel_pos<float>(cfg, cview(rh, {2, 3}), cview(rw, {5, 2}),
                                                     {mview(t0, {1, 2, 5}), mview(t1, {1, 2, 5})});
        },
        {"rel_pos_h has shape (2, 3)", "head_dim = 2"}));
    CHECK(throws_with(
        [&] {
            rpe::vit::load_decomposed_rel_pos<float>(cfg, cview(rh, {3, 2}), cview(rw, {5, 2}),
                                                     {mview(t0, {1, 2, 5}), mview(t0, {1, 2, 5})});
        },
        {"tables[0] overlaps tables[1]"}));
    auto cfg0 = cfg;
    cfg0.head_dim = 0;
    CHECK(throws_with(
        [&] {
            rpe::vit::load_decomposed_rel_pos<float>(cfg0, cview(rh, {3, 2}), cview(rw, {5, 2}),
                                                     {mview(t0, {1, 2, 5}), mview(t1, {1, 2, 5})});
        },
        {"head_dim = 0"}));
    CHECK(throws_with(
        [&] {
            rpe::vit::load_decomposed_rel_pos_backward<float>(cfg, {cview(t0, {1, 2, 5}), cview(t1, {1, 2, 5})},
                                                              mview(rh, {3, 2}), mview(rh, {3, 2}));
        },
        {"grad_rel_pos_h overlaps grad_rel_pos_w"}));
}

TEST_CASE("decomposed rel pos: a term is bounded to its grid (a larger grid is refused, a smaller one reads its buckets)") {
    using rpe_test::throws_with;
    // built for 4 x 6 (beta = 5): SAM's tables hold rows for |drow| <= 3 and |dcol| <= 5 only
    const rpe::vit::decomposed_rel_pos_config cfg{.height = 4, .width = 6, .num_heads = 2, .head_dim = 3};
    const auto term = rpe::vit::make_decomposed_rel_pos_term<double>(cfg);
    const auto shape = term.table_shape();  // (1, 3, 11)
    std::vector<double> t0(33), t1(33);
    const auto rel_h = rpe_test::random_normal<double>(7 * 3, 41), rel_w = rpe_test::random_normal<double>(11 * 3, 42);
    rpe::vit::load_decomposed_rel_pos<double>(cfg, cview(rel_h, {7, 3}), cview(rel_w, {11, 3}),
                                              {mview(t0, shape), mview(t1, shape)});
    const auto tables = std::array<rpe::tensor_ref<const double>, 2>{cview(t0, shape), cview(t1, shape)};

    // taller (5 x 6, still within beta) or wider (4 x 7): the bucket ids, the cache and the term refuse
    CHECK(throws_with([&] { (void)term.bucket_ids(5, 6); },
                      {"[rpe.mapping.within_grid]", "grid = 5x6 is larger than the 4x6 grid the term was built for"}));
    CHECK(throws_with([&] { (void)term.bucket_ids(4, 7); },
                      {"[rpe.mapping.within_grid]", "grid = 4x7", "expected height <= 4 and width <= 6"}));
    CHECK(throws_with([&] { (void)rpe::bucket_cache::global().get(term.mapping(), 6, 6, 0); }, {"grid = 6x6"}));
    CHECK(throws_with([&] { (void)rpe::build_bucket_ids(term.mapping(), 5, 5, 1); }, {"grid = 5x5"}));
    // ids of the unbounded Cross (or of another bound) on the larger grid are another mapping's
    const std::int64_t lbig = 5 * 6;
    std::vector<double> x(static_cast<std::size_t>(2 * lbig * 3), 1.0), out(static_cast<std::size_t>(2 * lbig * lbig));
    const auto unbounded = rpe::build_bucket_ids(term.mapping().inner, 5, 6, 0);
    const auto other_bound = rpe::build_bucket_ids(rpe::vit::decomposed_rel_pos_mapping(5, 6), 5, 6, 0);
    for (const auto* ids : {unbounded.get(), other_bound.get()})
        CHECK(throws_with(
            [&] {
                term.forward(*ids, tables, cview(x, {1, 2, lbig, 3}), mview(out, {1, 2, lbig, lbig}), rpe::write::overwrite);
            },
            {"[rpe.term]", "built for another mapping"}));
    // the fused and the composed attention on the larger grid
    const auto any = rpe::make_any_term(term);
    rpe::attention_inputs<double> in;
    in.q = in.k = in.v = cview(x, {1, 2, lbig, 3});
    in.height = 5;
    in.width = 6;
    in.rpe_k = {any.get(), {tables[0], tables[1]}, {}};
    std::vector<double> o(x.size()), attn(out.size());
    CHECK(throws_with(
        [&] {
            rpe::attention_forward<double>(in, mview(o, {1, 2, lbig, 3}));
        },
        {"[rpe.mapping.within_grid]", "grid = 5x6"}));
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_forward<double>(in, mview(o, {1, 2, lbig, 3}), mview(attn, {1, 2, lbig, lbig}));
        },
        {"grid = 5x6"}));

    // a smaller grid (3 x 4) reads the 4 x 6 grid's buckets: the term on it equals the full grid's
    // term at the same tokens (query/key token (r, c) -> r * 6 + c)
    const auto big_ids = term.bucket_ids(4, 6), small_ids = term.bucket_ids(3, 4);
    const std::int64_t lb = 24, ls = 12;
    const auto xb = rpe_test::random_normal<double>(static_cast<std::size_t>(2 * lb * 3), 43);
    std::vector<double> xs(static_cast<std::size_t>(2 * ls * 3));
    const auto big_token = [](std::int64_t i) { return (i / 4) * 6 + i % 4; };
    for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t i = 0; i < ls; ++i)
            for (std::int64_t d = 0; d < 3; ++d)
                xs[static_cast<std::size_t>((h * ls + i) * 3 + d)] =
                    xb[static_cast<std::size_t>((h * lb + big_token(i)) * 3 + d)];
    std::vector<double> ob(static_cast<std::size_t>(2 * lb * lb)), os(static_cast<std::size_t>(2 * ls * ls));
    term.forward(*big_ids, tables, cview(xb, {1, 2, lb, 3}), mview(ob, {1, 2, lb, lb}), rpe::write::overwrite);
    term.forward(*small_ids, tables, cview(xs, {1, 2, ls, 3}), mview(os, {1, 2, ls, ls}), rpe::write::overwrite);
    const auto rows_big = rpe_test::ids_matrix(*big_ids, 0), cols_big = rpe_test::ids_matrix(*big_ids, 1);
    const auto rows_small = rpe_test::ids_matrix(*small_ids, 0), cols_small = rpe_test::ids_matrix(*small_ids, 1);
    int id_mismatches = 0, value_mismatches = 0;
    for (std::int64_t i = 0; i < ls; ++i)
        for (std::int64_t j = 0; j < ls; ++j) {
            const auto s = static_cast<std::size_t>(i * ls + j), b = static_cast<std::size_t>(big_token(i) * lb + big_token(j));
            id_mismatches += rows_small[s] != rows_big[b] || cols_small[s] != cols_big[b];
            id_mismatches += rows_small[s] != (i / 4 - j / 4) + 5 || cols_small[s] != (i % 4 - j % 4) + 5;
            for (std::size_t h = 0; h < 2; ++h)
                value_mismatches +=
                    std::fabs(os[h * ls * ls + s] - ob[h * lb * lb + b]) > 1e-12;  // rounding of q·T may vary with L
        }
    CHECK(id_mismatches == 0);
    CHECK(value_mismatches == 0);
    CHECK(rpe_test::max_abs_diff(os, std::vector<double>(os.size(), 0.0)) > 0.1);  // not trivially zero
    // the bound is part of the cache key: a 4 x 6 and a 6 x 6 term (same beta = 5) keep their own ids
    const auto wider = rpe::vit::make_decomposed_rel_pos_term<double>({.height = 6, .width = 6, .num_heads = 2, .head_dim = 3});
    CHECK(!(wider.mapping() == term.mapping()));
    CHECK(wider.mapping().inner == term.mapping().inner);
    const auto wider_ids = wider.bucket_ids(3, 4);
    CHECK(wider_ids.get() != small_ids.get());
    CHECK(rpe_test::ids_matrix(*wider_ids, 0) == rows_small);
    CHECK(
        throws_with([] { rpe::mapping::within_grid<rpe::mapping::cross<rpe::index::clip>>{.height = 0, .width = 2}.validate(); },
                    {"[rpe.mapping.within_grid]", "height = 0"}));
}

}  // namespace rpe_unit_vit_sam
