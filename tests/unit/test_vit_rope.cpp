// 2D rotary position embedding (rpe::rope_forward / rope_backward, rpe::attention_inputs::rope):
// golden data from rope-vit (RoPE-Axial, RoPE-Mixed) and timm (RotaryEmbeddingCat, EVA-02's
// configuration and others) in tests/data/golden_vit/rope; finite-difference gradients of the
// rotation and of the fused attention; the fused attention with RoPE (alone and with iRPE
// terms) against the composed reference (rotate q and k explicitly, then the attention without
// RoPE); errors.
#include <doctest/doctest.h>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>
#include <rpe/rope/dinov3.hpp>
#include <rpe/rope/rotary.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_rope {

namespace {

using json = nlohmann::json;
using rpe_test::cview;
using rpe_test::load;
using rpe_test::mview;
using rpe_test::random_normal;

// The embedding a golden case describes (freqs bound for the mixed form).
template <class S>
rpe::rotary_embedding<S> embedding_of(const json& m, const std::vector<S>& freqs) {
    rpe::rotary_embedding<S> r;
    r.skip = m.at("skip").get<int>();
    const std::string form = m.at("form");
    const std::int64_t h = m.at("heads"), d = m.at("head_dim");
    if (form == "axial") {
        r.form = rpe::rope::axial{.theta = m.at("theta").get<float>()};
    } else if (form == "mixed") {
        r.form = rpe::rope::mixed{};
        r.freqs = cview(freqs, {2, h, d / 2});
    } else {
        rpe::rope::cat c;
        c.in_pixels = m.at("in_pixels").get<bool>();
        if (m.contains("temperature")) c.temperature = m.at("temperature").get<float>();
        if (m.contains("max_res")) c.max_res = m.at("max_res").get<float>();
        if (m.contains("linear_bands")) c.linear_bands = m.at("linear_bands").get<bool>();
        if (m.contains("grid_offset")) c.grid_offset = m.at("grid_offset").get<float>();
        if (m.contains("grid_indexing")) c.xy_indexing = m.at("grid_indexing").get<std::string>() == "xy";
        if (m.contains("ref_feat_shape")) {
            c.ref_height = m.at("ref_feat_shape")[0].get<int>();
            c.ref_width = m.at("ref_feat_shape")[1].get<int>();
        }
        r.form = c;
    }
    return r;
}

const char* const golden_cases[] = {"axial_t100_3x4_skip1",    "mixed_t10_4x3_skip1",  "cat_eva02_3x4_ref2x3_skip1",
                                    "cat_offset_xy_4x3_skip2", "cat_pixels_3x5_skip0", "cat_pixels_linear_2x3_ref4x4_skip1"};

}  // namespace

TEST_CASE_TEMPLATE("rope: golden rotation, table and gradients (rope-vit, timm)", S, float, double) {
    // float: the sources' own float32 arithmetic; double: the same float32 angles, cos/sin and
    // products in double (the golden values carry float32 rounding, hence the same tolerance)
    const double atol = 2e-5, rtol = 2e-5;
    for (const char* name : golden_cases) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
        const int height = m.at("height"), width = m.at("width");
        const std::vector<std::int64_t> shape{b, h, l, d};
        const bool mixed = m.at("form") == "mixed";
        const auto freqs = mixed ? load<S>(dir, "freqs.npy", {2, h, d / 2}) : std::vector<S>{};
        auto r = embedding_of<S>(m, freqs);
        const auto x = load<S>(dir, "x.npy", shape);
        const auto gy = load<S>(dir, "grad_y.npy", shape);
        std::vector<S> y(x.size(), S(-9)), gx(x.size(), S(-9)), gf(freqs.size(), S(-9));
        rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape));
        rpe_test::check_close(y, load<double>(dir, "y.npy"), atol, rtol, std::string(name) + " y");
        // skip tokens are copied exactly
        for (std::int64_t p = 0; p < b * h; ++p)
            for (std::int64_t e = 0; e < r.skip * d; ++e) CHECK(y[p * l * d + e] == x[p * l * d + e]);
        // the table's cos / sin
        const auto t = rpe::rope_table_of(r, d, height, width);
        rpe_test::check_close(t->cos, load<double>(dir, "cos.npy"), 2e-6, 2e-6, std::string(name) + " cos");
        rpe_test::check_close(t->sin, load<double>(dir, "sin.npy"), 2e-6, 2e-6, std::string(name) + " sin");
        if (mixed) r.grad_freqs = mview(gf, {2, h, d / 2});
        rpe::rope_backward(r, height, width, cview(x, shape), cview(gy, shape), mview(gx, shape));
        rpe_test::check_close(gx, load<double>(dir, "grad_x.npy"), atol, rtol, std::string(name) + " grad_x");
        if (mixed) rpe_test::check_close(gf, load<double>(dir, "grad_freqs.npy"), 1e-4, 1e-4, std::string(name) + " grad_freqs");
    }
}

TEST_CASE("rope: layout half against timm's rotate-half (apply_rot_embed_cat, half=True)") {
    for (const char* name : {"axial_t100_3x4_skip1_half", "cat_eva02_3x4_ref2x3_skip1_half"}) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
        const std::vector<std::int64_t> shape{b, h, l, d};
        auto r = embedding_of<float>(m, {});
        r.layout = rpe::rope::layout::half;
        const auto x = load<float>(dir, "x.npy", shape);
        std::vector<float> y(x.size());
        rpe::rope_forward(r, m.at("height").get<int>(), m.at("width").get<int>(), cview(x, shape), mview(y, shape));
        rpe_test::check_close(y, load<double>(dir, "y.npy"), 2e-5, 2e-5, std::string(name) + " y");
    }
}

TEST_CASE("rope: the fixed forms' tables are cached per (policy, D, grid, scalar type)") {
    rpe::rotary_embedding<float> a{.form = rpe::rope::axial{.theta = 123.0f}, .skip = 1};
    const auto t1 = rpe::rope_table_of(a, 8, 3, 5);
    const auto t2 = rpe::rope_table_of(a, 8, 3, 5);
    CHECK(t1.get() == t2.get());
    CHECK(rpe::rope_table_of(a, 8, 5, 3).get() != t1.get());
    a.form = rpe::rope::axial{.theta = 124.0f};
    CHECK(rpe::rope_table_of(a, 8, 3, 5).get() != t1.get());
    a.form = rpe::rope::cat{};
    CHECK(rpe::rope_table_of(a, 8, 3, 5).get() != t1.get());
    CHECK(t1->tokens == 15);
    CHECK(t1->pairs == 4);
    // axial: pair 0 turns by col·1, pair 2 (the y half) by row·1 (f_0 = 1)
    CHECK(t1->cos[(1 * 5 + 2) * 4 + 0] == doctest::Approx(std::cos(2.0)));
    CHECK(t1->cos[(1 * 5 + 2) * 4 + 2] == doctest::Approx(std::cos(1.0)));
}

TEST_CASE("rope: tables made from data (mixed frequencies, per-token positions) are cached by the data's values") {
    // rope::mixed on the grid: one table per frequency values, shared by equal values in another buffer
    const std::int64_t heads = 2, pairs = 4, d = 2 * pairs;
    std::vector<float> freqs(static_cast<std::size_t>(2 * heads * pairs));
    for (std::size_t i = 0; i < freqs.size(); ++i) freqs[i] = 0.1f * static_cast<float>(i) - 0.7f;
    const std::vector<float> same = freqs;
    rpe::rotary_embedding<float> m{.form = rpe::rope::mixed{}, .freqs = cview(freqs, {2, heads, pairs})};
    const auto t1 = rpe::rope_table_of(m, d, 3, 5);
    CHECK(rpe::rope_table_of(m, d, 3, 5).get() == t1.get());
    auto m2 = m;
    m2.freqs = cview(same, {2, heads, pairs});
    CHECK(rpe::rope_table_of(m2, d, 3, 5).get() == t1.get());
    CHECK(rpe::rope_table_of(m, d, 5, 3).get() != t1.get());  // the grid
    m2.layout = rpe::rope::layout::half;
    CHECK(rpe::rope_table_of(m2, d, 3, 5).get() != t1.get());  // the layout
    // a training step's new values: a new table with the new angles (the old one unchanged)
    const std::vector<float> cos1 = t1->cos;
    freqs[3] += 0.25f;
    const auto t3 = rpe::rope_table_of(m, d, 3, 5);
    CHECK(t3.get() != t1.get());
    CHECK(t1->cos == cos1);
    CHECK(t3->cos[(1 * 5 + 2) * pairs + 3] == std::cos(rpe::rope::mixed::angle(1, 2, freqs[3], freqs[heads * pairs + 3])));
    CHECK(t3->cos[(1 * 5 + 2) * pairs + 3] != cos1[(1 * 5 + 2) * pairs + 3]);
    freqs[3] -= 0.25f;
    CHECK(rpe::rope_table_of(m, d, 3, 5).get() == t1.get());
    // positions: one table per (form, positions' values, D, layout), equal to the grid's values
    std::vector<float> pos;
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 5; ++c) pos.insert(pos.end(), {static_cast<float>(r), static_cast<float>(c)});
    const std::vector<float> pos_copy = pos;
    rpe::rotary_embedding<float> a{.form = rpe::rope::axial{.theta = 123.0f}, .skip = 1};
    a.positions = cview(pos, {15, 2});
    const auto p1 = rpe::rope_query_table(a, d, 1, 1);
    CHECK(rpe::rope_query_table(a, d, 1, 1).get() == p1.get());
    CHECK(rpe::rope_position_table(a, cview(pos_copy, {15, 2}), d).get() == p1.get());
    auto grid = a;
    grid.positions = {};
    CHECK(p1->cos == rpe::rope_table_of(grid, d, 3, 5)->cos);  // positions = the grid: its values, cached apart
    CHECK(rpe::rope_table_of(grid, d, 3, 5).get() != p1.get());
    a.form = rpe::rope::axial{.theta = 124.0f};
    CHECK(rpe::rope_query_table(a, d, 1, 1).get() != p1.get());  // the policy
    a.form = rpe::rope::axial{.theta = 123.0f};
    pos[5] = 2.5f;
    const auto p2 = rpe::rope_query_table(a, d, 1, 1);
    CHECK(p2.get() != p1.get());  // the values
    CHECK(p2->cos != p1->cos);
    // mixed at positions: keyed by the frequencies and the positions
    m.positions = cview(pos_copy, {15, 2});
    const auto q1 = rpe::rope_query_table(m, d, 1, 1);
    CHECK(q1->cos == t1->cos);
    CHECK(q1.get() != t1.get());
    CHECK(rpe::rope_query_table(m, d, 1, 1).get() == q1.get());
    freqs[0] = 3.0f;
    CHECK(rpe::rope_query_table(m, d, 1, 1).get() != q1.get());
}

TEST_CASE("rope: the table cache keys a fixed form by every parameter of its policy") {
    using rpe::rope::cat;
    auto table = [](rpe::rope_form form, std::int64_t d = 8, int height = 3, int width = 5) {
        const rpe::rotary_embedding<float> r{.form = std::move(form)};
        return rpe::rope_table_of(r, d, height, width).get();
    };
    const cat base{.temperature = 100.0f, .max_res = 64.0f, .ref_height = 0, .ref_width = 0};
    const auto* t0 = table(base);
    CHECK(table(base) == t0);  // an equal value shares the entry
    // each parameter on its own gives another entry (before: only the form, sizes and
    // temperature were hashed, the rest compared through the whole struct)
    const cat one_each[] = {
        {.temperature = 101.0f, .max_res = 64.0f},
        {.temperature = 100.0f, .in_pixels = true, .max_res = 64.0f},
        {.temperature = 100.0f, .max_res = 65.0f},
        {.temperature = 100.0f, .max_res = 64.0f, .linear_bands = true},
        {.temperature = 100.0f, .max_res = 64.0f, .grid_offset = 0.5f},
        {.temperature = 100.0f, .max_res = 64.0f, .ref_height = 6, .ref_width = 10},
        {.temperature = 100.0f, .max_res = 64.0f, .xy_indexing = true},
    };
    for (const auto& c : one_each) CHECK(table(c) != t0);
    CHECK(table(base, 12) != t0);       // D
    CHECK(table(base, 8, 5, 3) != t0);  // grid
    const rpe::rotary_embedding<double> rd{.form = base};
    CHECK(static_cast<const void*>(rpe::rope_table_of(rd, 8, 3, 5).get()) != static_cast<const void*>(t0));  // scalar type
    // another form with the same number: axial θ = 100 against cat temperature 100
    CHECK(table(rpe::rope::axial{.theta = 100.0f}) != t0);
    CHECK(table(rpe::rope::axial{.theta = 100.0f}) != table(rpe::rope::axial{.theta = 100.5f}));
}

namespace {

// A user-defined form, declared here only: angle (row + col)·rate / (1 + pair).
struct diagonal_form {
    float rate = 0.5f;
    static constexpr int head_dim_multiple = 2;
    float angle(int row, int col, int pair, int /*head_dim*/, int /*height*/, int /*width*/) const {
        return static_cast<float>(row + col) * rate / static_cast<float>(1 + pair);
    }
    void validate() const { rpe::detail::require(std::isfinite(rate), "rope", "rate = ", rate, "; expected finite"); }
    friend bool operator==(const diagonal_form&, const diagonal_form&) = default;
};
static_assert(rpe::RotaryPolicy<diagonal_form>);

// The same fields and angle under another type: a different form.
struct other_diagonal_form : diagonal_form {
    friend bool operator==(const other_diagonal_form&, const other_diagonal_form&) = default;
};
static_assert(rpe::RotaryPolicy<other_diagonal_form>);

}  // namespace

TEST_CASE("rope: a user-defined form (rope::custom) rotates, caches and checks with no edit to rpe") {
    const int B = 1, H = 2, height = 2, width = 3, skip = 1, D = 6, L = skip + height * width;
    const std::vector<std::int64_t> shape{B, H, L, D};
    const auto x = random_normal<float>(static_cast<std::size_t>(B * H * L * D), 7);
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{diagonal_form{.rate = 0.5f}}, .skip = skip};
    std::vector<float> y(x.size());
    rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape));
    // by hand: token 0 copied; token 1 + t at (row, col) = (t / 3, t % 3), pair p turned by
    // (row + col)·0.5 / (1 + p)
    for (int p = 0; p < B * H; ++p)
        for (int i = 0; i < L; ++i)
            for (int j = 0; j < D / 2; ++j) {
                const std::size_t e = static_cast<std::size_t>((p * L + i) * D + 2 * j);
                double a = 0;
                if (i >= skip)
                    a = static_cast<double>(static_cast<float>((i - skip) / width + (i - skip) % width) * 0.5f /
                                            static_cast<float>(1 + j));
                const double c = std::cos(a), sn = std::sin(a);
                CHECK(y[e] == doctest::Approx(c * x[e] - sn * x[e + 1]).epsilon(1e-6));
                CHECK(y[e + 1] == doctest::Approx(sn * x[e] + c * x[e + 1]).epsilon(1e-6));
            }
    // the backward is the transpose rotation: it takes y back to x
    std::vector<float> back(x.size());
    rpe::rope_backward(r, height, width, cview(x, shape), cview(y, shape), mview(back, shape));
    for (std::size_t e = 0; e < x.size(); ++e) CHECK(back[e] == doctest::Approx(x[e]).epsilon(1e-5));

    // cached by the held policy's type and value
    auto table = [&](rpe::rope_form form) {
        const rpe::rotary_embedding<float> e{.form = std::move(form)};
        return rpe::rope_table_of(e, D, height, width).get();
    };
    const auto* t = table(rpe::rope::custom{diagonal_form{.rate = 0.5f}});
    CHECK(table(rpe::rope::custom{diagonal_form{.rate = 0.5f}}) == t);
    CHECK(table(rpe::rope::custom{diagonal_form{.rate = 0.25f}}) != t);
    CHECK(table(rpe::rope::custom{other_diagonal_form{{.rate = 0.5f}}}) != t);
    CHECK(table(rpe::rope::custom{rpe::rope::axial{.theta = 100.0f}}) == table(rpe::rope::axial{.theta = 100.0f}));
    CHECK(t->cos[static_cast<std::size_t>((1 * width + 2) * (D / 2) + 1)] == doctest::Approx(std::cos(0.75)));

    // the fused attention takes it like the built-in forms: equal to rotating q and k first
    rpe::attention_inputs<float> in;
    const auto q = random_normal<float>(x.size(), 8), k = random_normal<float>(x.size(), 9),
               v = random_normal<float>(x.size(), 10);
    in.q = cview(q, shape);
    in.k = cview(k, shape);
    in.v = cview(v, shape);
    in.height = height;
    in.width = width;
    in.rope = r;
    std::vector<float> fused(x.size()), qr(x.size()), kr(x.size()), plain(x.size());
    rpe::attention_forward(in, mview(fused, shape));
    rpe::rope_forward(r, height, width, cview(q, shape), mview(qr, shape));
    rpe::rope_forward(r, height, width, cview(k, shape), mview(kr, shape));
    in.q = cview(qr, shape);
    in.k = cview(kr, shape);
    in.rope = {};
    rpe::attention_forward(in, mview(plain, shape));
    for (std::size_t e = 0; e < x.size(); ++e) CHECK(fused[e] == doctest::Approx(plain[e]).epsilon(1e-5));

    // checks: the held policy's, the head-dim multiple, an empty custom
    r.form = rpe::rope::custom{diagonal_form{.rate = std::numeric_limits<float>::quiet_NaN()}};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] rate = nan"));
    r.form = rpe::rope::custom{};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] custom form holds no policy"));
    r.form = rpe::rope::custom{rpe::rope::axial{}};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] rope needs head_dim D = 6 to be a positive multiple of 4"));
}

TEST_CASE("rope: init_mixed_frequencies is rope-vit's init_random_2d_freqs") {
    const auto dir = rpe_test::rope_golden_dir("mixed_t10_4x3_skip1");
    const auto m = rpe_test::read_meta<json>(dir);
    const int h = m.at("heads"), d = m.at("head_dim");
    const auto freqs = load<float>(dir, "freqs.npy", {2, h, d / 2});
    // the golden's random per-head angles, read back from band 0 (mag_0 = 1)
    std::vector<float> angles(static_cast<std::size_t>(h));
    for (int i = 0; i < h; ++i) angles[i] = std::atan2(freqs[(h + i) * (d / 2)], freqs[i * (d / 2)]);
    std::vector<float> out(freqs.size());
    rpe::rope::init_mixed_frequencies(10.0f, d, angles, out);
    std::vector<double> expected(freqs.begin(), freqs.end());
    rpe_test::check_close(out, expected, 1e-6, 1e-5, "init");
    CHECK(rpe_test::throws_with([&] { rpe::rope::init_mixed_frequencies(10.0f, 6, angles, out); }, "head_dim = 6"));
    CHECK(rpe_test::throws_with([&] { rpe::rope::init_mixed_frequencies(-1.0f, d, angles, out); }, "theta = -1"));
}

TEST_CASE("rope: RoPE-Mixed angles round each product, then the sum, as rope-vit and timm (no FMA)") {
    // The sources compute `t_x·fx + t_y·fy` as two float32 products, then their sum. The
    // reference here: each product in double (exact for an int times a float), rounded once to
    // float, then the sum in double rounded once (correctly rounded, so equal to float32's
    // add): no expression that a compiler could contract. The test's own build uses
    // -march=native, where an unguarded `col*fx + row*fy` becomes an FMA.
    std::mt19937 gen(2024);
    std::uniform_real_distribution<float> dist(-1.5f, 1.5f);
    const int height = 23, width = 31;
    const std::int64_t heads = 2, pairs = 8;
    std::vector<float> freqs(static_cast<std::size_t>(2 * heads * pairs));
    for (auto& f : freqs) f = dist(gen);
    const rpe::rotary_embedding<float> r{.form = rpe::rope::mixed{}, .freqs = cview(freqs, {2, heads, pairs})};
    const auto t = rpe::rope_table_of(r, 2 * pairs, height, width);
    int fused_differs = 0, checked = 0;
    for (std::int64_t h = 0; h < heads; ++h)
        for (int row = 0; row < height; ++row)
            for (int col = 0; col < width; ++col)
                for (std::int64_t j = 0; j < pairs; ++j) {
                    const float fx = freqs[static_cast<std::size_t>(h * pairs + j)];
                    const float fy = freqs[static_cast<std::size_t>((heads + h) * pairs + j)];
                    const auto px = static_cast<float>(static_cast<double>(col) * static_cast<double>(fx));
                    const auto py = static_cast<float>(static_cast<double>(row) * static_cast<double>(fy));
                    const auto expected = static_cast<float>(static_cast<double>(px) + static_cast<double>(py));
                    const float got = rpe::rope::mixed::angle(row, col, fx, fy);
                    if (got != expected) {
                        CAPTURE(row);
                        CAPTURE(col);
                        CHECK(got == expected);
                    }
                    // the table holds cos/sin of exactly that angle
                    const auto e = static_cast<std::size_t>(t->at(h, row * width + col) + j);
                    if (t->cos[e] != std::cos(expected) || t->sin[e] != std::sin(expected))
                        CHECK(t->cos[e] == std::cos(expected));
                    fused_differs += std::fma(static_cast<float>(col), fx, py) != expected;
                    ++checked;
                }
    CHECK(checked == heads * height * width * pairs);
    // the case is one where a fused multiply-add would round differently
    CHECK(fused_differs > 10);
    // double: the same two rounded products and rounded sum, in double
    const double dx = 0.1234567890123, dy = -0.987654321;
    volatile double qx = 7 * dx, qy = 5 * dy;
    CHECK(rpe::rope::mixed::angle(5, 7, dx, dy) == qx + qy);
}

namespace {

// sum(y · g) of rope_forward, in double
double rope_objective(const rpe::rotary_embedding<double>& r, int height, int width, const std::vector<double>& x,
                      const std::vector<double>& g, const std::vector<std::int64_t>& shape) {
    std::vector<double> y(x.size());
    rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape));
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * g[i];
    return s;
}

}  // namespace

TEST_CASE("rope: finite-difference gradients of the rotation (x and the mixed frequencies)") {
    const int height = 3, width = 2, skip = 1;
    const std::int64_t b = 2, h = 2, d = 8, l = skip + height * width;
    const std::vector<std::int64_t> shape{b, h, l, d};
    auto x = random_normal<double>(static_cast<std::size_t>(b * h * l * d), 11);
    const auto g = random_normal<double>(x.size(), 12);
    auto freqs = random_normal<double>(static_cast<std::size_t>(2 * h * d / 2), 13, 0.7);
    rpe::rotary_embedding<double> forms[3];
    forms[0].form = rpe::rope::axial{.theta = 100.0f};
    forms[1].form = rpe::rope::mixed{};
    forms[2].form = rpe::rope::cat{.ref_height = 2, .ref_width = 4};
    for (int f = 0; f < 6; ++f) {
        auto& r = forms[f % 3];
        r.layout = f < 3 ? rpe::rope::layout::pairs : rpe::rope::layout::half;
        CAPTURE(r.form.index());
        CAPTURE(rpe::rope::layout_name(r.layout));
        r.skip = skip;
        if (r.is_mixed()) r.freqs = cview(freqs, {2, h, d / 2});
        std::vector<double> gx(x.size()), gf(freqs.size());
        auto rb = r;
        if (r.is_mixed()) rb.grad_freqs = mview(gf, {2, h, d / 2});
        rpe::rope_backward(rb, height, width, cview(x, shape), cview(g, shape), mview(gx, shape));
        const double eps = 1e-6;
        for (std::size_t i = 0; i < x.size(); i += 7) {
            const double x0 = x[i];
            x[i] = x0 + eps;
            const double fp = rope_objective(r, height, width, x, g, shape);
            x[i] = x0 - eps;
            const double fm = rope_objective(r, height, width, x, g, shape);
            x[i] = x0;
            CHECK(gx[i] == doctest::Approx((fp - fm) / (2 * eps)).epsilon(1e-6));
        }
        if (!r.is_mixed()) continue;
        double largest = 0;
        for (std::size_t i = 0; i < freqs.size(); ++i) {
            const double f0 = freqs[i];
            freqs[i] = f0 + eps;
            const double fp = rope_objective(r, height, width, x, g, shape);
            freqs[i] = f0 - eps;
            const double fm = rope_objective(r, height, width, x, g, shape);
            freqs[i] = f0;
            CHECK(gf[i] == doctest::Approx((fp - fm) / (2 * eps)).epsilon(1e-6));
            largest = std::max(largest, std::fabs(gf[i]));
        }
        CHECK(largest > 0.1);  // a real gradient, not zeros
    }
}

namespace {

// A random attention problem with RoPE (and optionally iRPE terms on q, k, v).
template <class S>
struct rope_problem {
    std::int64_t b = 2, h = 2, l = 0, d = 8;
    int height = 3, width = 4, skip = 1;
    std::vector<S> q, k, v, go, freqs;
    std::vector<std::vector<S>> tables;
    std::vector<std::unique_ptr<rpe::any_term<S>>> terms;
    rpe::attention_inputs<S> in;

    rope_problem(int form, bool irpe, unsigned seed) {
        l = skip + height * width;
        const auto n = static_cast<std::size_t>(b * h * l * d);
        q = random_normal<S>(n, seed);
        k = random_normal<S>(n, seed + 1);
        v = random_normal<S>(n, seed + 2);
        go = random_normal<S>(n, seed + 3);
        freqs = random_normal<S>(static_cast<std::size_t>(2 * h * d / 2), seed + 4, 0.6);
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.height = height;
        in.width = width;
        in.rope.skip = skip;
        if (form == 0) in.rope.form = rpe::rope::axial{.theta = 100.0f};
        if (form == 1) {
            in.rope.form = rpe::rope::mixed{};
            in.rope.freqs = {freqs.data(), {2, h, d / 2}};
        }
        if (form == 2) in.rope.form = rpe::rope::cat{.ref_height = 2, .ref_width = 2};
        if (!irpe) return;
        const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
        rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        tables.reserve(3);
        for (int t = 0; t < 3; ++t) {
            rpe::term_spec spec;
            spec.method = t == 1 ? rpe::method::product : rpe::method::euclidean;
            spec.contextual = true;
            spec.target = targets[t];
            spec.ratio(1.9);
            spec.skip = skip;
            spec.num_heads = static_cast<int>(h);
            spec.head_dim = static_cast<int>(d);
            terms.push_back(rpe::make_term<S>(spec));
            slots[t]->term = terms.back().get();
            const auto shape = terms.back()->table_shape();
            std::int64_t size = 1;
            for (auto e : shape) size *= e;
            tables.push_back(random_normal<S>(static_cast<std::size_t>(size), seed + 10 + t, 0.5));
            rpe::tensor_ref<const S> ref;
            ref.data = tables.back().data();
            ref.rank = static_cast<int>(shape.size());
            for (std::size_t i = 0; i < shape.size(); ++i) ref.shape[i] = shape[i];
            slots[t]->tables.push_back(ref);
        }
    }
    [[nodiscard]] std::vector<std::int64_t> shape() const { return {b, h, l, d}; }
};

template <class S>
struct rope_results {
    std::vector<S> out, gq, gk, gv, gf;
    std::vector<std::vector<S>> gt;
};

template <class S>
rope_results<S> run_rope(rope_problem<S>& p, bool fused, std::int64_t row_block) {
    rope_results<S> r;
    const auto n = p.q.size();
    const auto shape = p.shape();
    r.out.assign(n, S(-5));
    r.gq.assign(n, S(-5));
    r.gk.assign(n, S(-5));
    r.gv.assign(n, S(-5));
    r.gf.assign(p.freqs.size(), S(-5));
    auto in = p.in;
    if (in.rope.is_mixed()) in.rope.grad_freqs = mview(r.gf, {2, p.h, p.d / 2});
    r.gt.reserve(p.tables.size());
    std::size_t next = 0;
    for (auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->tables) {
            auto& g = r.gt.emplace_back(p.tables[next++].size(), S(-5));
            rpe::tensor_ref<S> ref;
            ref.data = g.data();
            ref.rank = t.rank;
            ref.shape = t.shape;
            slot->grad_tables.push_back(ref);
        }
    if (fused) {
        const rpe::attention_options opt{.row_block = row_block};
        rpe::attention_forward(in, mview(r.out, shape), {}, opt);
        rpe::attention_backward(in, cview(p.go, shape), mview(r.gq, shape), mview(r.gk, shape), mview(r.gv, shape), opt);
    } else {
        std::vector<S> attn(static_cast<std::size_t>(p.b * p.h * p.l * p.l));
        const std::vector<std::int64_t> ashape{p.b, p.h, p.l, p.l};
        rpe::composed_attention_forward(in, mview(r.out, shape), mview(attn, ashape));
        rpe::composed_attention_backward(in, {.grad_out = cview(p.go, shape),
                                              .grad_q = mview(r.gq, shape),
                                              .grad_k = mview(r.gk, shape),
                                              .grad_v = mview(r.gv, shape),
                                              .saved_attn = cview(attn, ashape)});
    }
    return r;
}

}  // namespace

TEST_CASE_TEMPLATE("rope: layout half is layout pairs on permuted channels, exactly (forward, backward, fused)", S, float,
                   double) {
    // half pairs channel j with j + D/2; pairs pairs 2j with 2j+1. Moving channel 2j to j and
    // 2j+1 to j + D/2 turns one into the other, the same arithmetic on the same values.
    const int height = 3, width = 4, skip = 2;
    const std::int64_t b = 2, h = 3, d = 12, pairs = d / 2, l = skip + height * width;
    const std::vector<std::int64_t> shape{b, h, l, d};
    auto permute = [](const std::vector<S>& v, std::int64_t dd = 12) {  // pairs order -> half order, per row of dd
        std::vector<S> o(v.size());
        const std::int64_t np = dd / 2, rows = static_cast<std::int64_t>(v.size()) / dd;
        for (std::int64_t row = 0; row < rows; ++row)
            for (std::int64_t j = 0; j < np; ++j) {
                o[static_cast<std::size_t>(row * dd + j)] = v[static_cast<std::size_t>(row * dd + 2 * j)];
                o[static_cast<std::size_t>(row * dd + j + np)] = v[static_cast<std::size_t>(row * dd + 2 * j + 1)];
            }
        return o;
    };
    const auto x = random_normal<S>(static_cast<std::size_t>(b * h * l * d), 31);
    const auto g = random_normal<S>(x.size(), 32);
    const auto freqs = random_normal<S>(static_cast<std::size_t>(2 * h * pairs), 33, 0.7);
    const auto xh = permute(x), gh = permute(g);
    rpe::rope_form forms[] = {rpe::rope::axial{.theta = 100.0f}, rpe::rope::mixed{},
                              rpe::rope::cat{.ref_height = 2, .ref_width = 2},
                              rpe::rope::cat{.in_pixels = true, .max_res = 32.0f}};
    for (const auto& form : forms) {
        CAPTURE(form.index());
        rpe::rotary_embedding<S> rp{.form = form, .skip = skip};
        if (rp.is_mixed()) rp.freqs = cview(freqs, {2, h, pairs});
        auto rh = rp;
        rh.layout = rpe::rope::layout::half;
        std::vector<S> yp(x.size()), yh(x.size()), gxp(x.size()), gxh(x.size()), gfp(freqs.size()), gfh(freqs.size());
        rpe::rope_forward(rp, height, width, cview(x, shape), mview(yp, shape));
        rpe::rope_forward(rh, height, width, cview(xh, shape), mview(yh, shape));
        CHECK(yh == permute(yp));
        CHECK(yh != xh);
        if (rp.is_mixed()) {
            rp.grad_freqs = mview(gfp, {2, h, pairs});
            rh.grad_freqs = mview(gfh, {2, h, pairs});
        }
        rpe::rope_backward(rp, height, width, cview(x, shape), cview(g, shape), mview(gxp, shape));
        rpe::rope_backward(rh, height, width, cview(xh, shape), cview(gh, shape), mview(gxh, shape));
        CHECK(gxh == permute(gxp));
        if (rp.is_mixed()) CHECK(gfh == gfp);
        // the tables: the same cos/sin, cached apart, each recording its layout
        const auto tp = rpe::rope_table_of(rp, d, height, width), th = rpe::rope_table_of(rh, d, height, width);
        CHECK(tp->cos == th->cos);
        CHECK(tp->layout == rpe::rope::layout::pairs);
        CHECK(th->layout == rpe::rope::layout::half);
        if (!rp.is_mixed()) {
            CHECK(tp.get() != th.get());
            CHECK(rpe::rope_table_of(rh, d, height, width).get() == th.get());
        }
    }
    // the fused attention: half on permuted q, k equals pairs (the dot products sum the
    // channels in another order: equal to rounding)
    const double tol = std::is_same_v<S, float> ? 1e-5 : 1e-12;
    for (int form = 0; form < 3; ++form) {
        CAPTURE(form);
        rope_problem<S> p(form, false, 300 + static_cast<unsigned>(form));
        const auto shp = p.shape();
        std::vector<S> op(p.q.size()), oh(p.q.size());
        rpe::attention_forward(p.in, mview(op, shp));
        auto in = p.in;
        const auto qh = permute(p.q, p.d), kh = permute(p.k, p.d);
        in.q = cview(qh, shp);
        in.k = cview(kh, shp);
        in.rope.layout = rpe::rope::layout::half;
        rpe::attention_forward(in, mview(oh, shp));
        CHECK(rpe_test::max_abs_diff(op, oh) < tol);
    }
    // a value outside the enumeration is refused, naming it
    rpe::rotary_embedding<S> bad{.form = rpe::rope::axial{}, .skip = skip};
    bad.layout = static_cast<rpe::rope::layout>(7);
    std::vector<S> y(x.size());
    CHECK(rpe_test::throws_with(
        [&] { rpe::rope_forward(bad, height, width, cview(x, shape), mview(y, shape)); },
        "[rpe.rope] rope layout = 7; expected rope::layout::pairs, rope::layout::half or rope::layout::vjepa2"));
}

TEST_CASE_TEMPLATE("rope: fused attention equals rotate-then-attend (alone and with iRPE q, k, v terms)", S, float, double) {
    const double tol = std::is_same_v<S, float> ? 2e-4 : 1e-10;
    for (int form = 0; form < 6; ++form)
        for (bool irpe : {false, true})
            for (std::int64_t rb : {0, 5}) {
                CAPTURE(form);
                CAPTURE(irpe);
                CAPTURE(rb);
                rope_problem<S> p(form % 3, irpe, 100 + static_cast<unsigned>(form));
                if (form >= 3) p.in.rope.layout = rpe::rope::layout::half;
                const auto f = run_rope(p, true, rb);
                const auto c = run_rope(p, false, 0);
                CHECK(rpe_test::max_abs_diff(f.out, c.out) < tol);
                CHECK(rpe_test::max_abs_diff(f.gq, c.gq) < tol);
                CHECK(rpe_test::max_abs_diff(f.gk, c.gk) < tol);
                CHECK(rpe_test::max_abs_diff(f.gv, c.gv) < tol);
                if (form % 3 == 1) CHECK(rpe_test::max_abs_diff(f.gf, c.gf) < 10 * tol);
                for (std::size_t t = 0; t < f.gt.size(); ++t) CHECK(rpe_test::max_abs_diff(f.gt[t], c.gt[t]) < 10 * tol);
            }
}

TEST_CASE("rope: the composed reference is rope_forward on q and k, then the attention without RoPE") {
    rope_problem<double> p(1, true, 7);
    const auto shape = p.shape();
    std::vector<double> qr(p.q.size()), kr(p.k.size()), out1(p.q.size()), out2(p.q.size());
    rpe::rope_forward(p.in.rope, p.height, p.width, cview(p.q, shape), mview(qr, shape));
    rpe::rope_forward(p.in.rope, p.height, p.width, cview(p.k, shape), mview(kr, shape));
    auto plain = p.in;
    plain.rope = {};
    plain.q = cview(qr, shape);
    plain.k = cview(kr, shape);
    rpe::attention_forward(plain, mview(out1, shape));
    rpe::attention_forward(p.in, mview(out2, shape));
    CHECK(rpe_test::max_abs_diff(out1, out2) < 1e-12);
    // and RoPE changes the result (the test above would pass with the rotation ignored otherwise)
    plain.q = cview(p.q, shape);
    plain.k = cview(p.k, shape);
    rpe::attention_forward(plain, mview(out1, shape));
    CHECK(rpe_test::max_abs_diff(out1, out2) > 1e-3);
}

TEST_CASE("rope: finite-difference gradients of the fused attention with RoPE-Mixed and iRPE") {
    rope_problem<double> p(1, true, 21);
    const auto shape = p.shape();
    const auto r = run_rope(p, true, 4);
    auto objective = [&] {
        std::vector<double> out(p.q.size());
        rpe::attention_forward(p.in, mview(out, shape), {}, rpe::attention_options{.row_block = 4});
        double s = 0;
        for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * p.go[i];
        return s;
    };
    const double eps = 1e-6;
    auto fd = [&](std::vector<double>& x, std::size_t i) { return rpe_test::central_difference(x, i, eps, objective); };
    for (std::size_t i = 0; i < p.q.size(); i += 13) {
        CHECK(r.gq[i] == doctest::Approx(fd(p.q, i)).epsilon(1e-5));
        CHECK(r.gk[i] == doctest::Approx(fd(p.k, i)).epsilon(1e-5));
    }
    for (std::size_t i = 0; i < p.freqs.size(); ++i) CHECK(r.gf[i] == doctest::Approx(fd(p.freqs, i)).epsilon(1e-5));
}

TEST_CASE("rope: errors name the parameter and its value") {
    rope_problem<float> p(0, false, 3);
    const auto shape = p.shape();
    std::vector<float> out(p.q.size()), y(p.q.size()), gf(p.freqs.size());
    auto fwd = [&](const rpe::attention_inputs<float>& in) { rpe::attention_forward(in, mview(out, shape)); };
    auto in = p.in;
    in.rope.form = rpe::rope::axial{.theta = -2.0f};
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.rope] theta = -2"));
    in.rope.form = rpe::rope::cat{.temperature = 0.0f};
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "temperature = 0"));
    in.rope.form = rpe::rope::cat{.ref_height = 3};
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "ref_height, ref_width = 3, 0"));
    in = p.in;
    in.rope.skip = 2;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, {"[rpe.attention] L = 13", "rope skip + height*width = 2 + 3*4"}));
    in.rope.skip = -1;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "rope skip = -1"));
    in = p.in;
    in.depth = 2;
    in.width = 2;
    in.height = 3;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "depth = 2"));
    in = p.in;
    in.rope.form = rpe::rope::mixed{};
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "rope freqs"));
    in.rope.freqs = cview(p.freqs, {2, p.h * p.d / 2});
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "rope freqs has shape (2, 8)"));
    in = p.in;
    in.rope.freqs = cview(p.freqs, {2, p.h, p.d / 2});
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "rope freqs is given for a fixed-frequency form"));
    in = p.in;
    in.rope.grad_freqs = mview(gf, {2, p.h, p.d / 2});
    std::vector<float> gq(out.size()), gk(out.size()), gv(out.size());
    CHECK(rpe_test::throws_with(
        [&] { rpe::attention_backward(in, cview(p.go, shape), mview(gq, shape), mview(gk, shape), mview(gv, shape)); },
        "rope grad_freqs is given for a fixed-frequency form"));
    in.rope.form = rpe::rope::mixed{};
    in.rope.freqs = cview(p.freqs, {2, p.h, p.d / 2});
    in.rope.grad_freqs = mview(gq, shape);  // overlaps grad_q
    CHECK(rpe_test::throws_with(
        [&] { rpe::attention_backward(in, cview(p.go, shape), mview(gq, shape), mview(gk, shape), mview(gv, shape)); },
        "rope grad_freqs has shape"));
    // head_dim: a multiple of 4 for the 2D fixed forms, of 2 for mixed
    const std::vector<std::int64_t> odd{1, 1, 13, 6};
    std::vector<float> x6(78), y6(78);
    rpe::rotary_embedding<float> r{.form = rpe::rope::axial{}, .skip = 1};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 3, 4, cview(x6, odd), mview(y6, odd)); },
                                "[rpe.rope] rope needs head_dim D = 6 to be a positive multiple of 4"));
    const std::vector<std::int64_t> ok{1, 1, 13, 8};
    std::vector<float> x8(104), y8(104);
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 3, 4, cview(x8, ok), mview(x8, ok)); }, "y overlaps x"));
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 4, 4, cview(x8, ok), mview(y8, ok)); }, "L = 13"));
    rpe::rope_forward(r, 3, 4, cview(x8, ok), mview(y8, ok));  // the same call on a 3x4 grid is fine
    const std::vector<std::int64_t> rank3{13, 6, 1};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 3, 4, cview(x6, rank3), mview(y6, odd)); }, "x has shape (13, 6, 1)"));
    // an invalid form never reaches the table: the checks run before anything is written
    y = std::vector<float>(y.size(), 3.0f);
    in = p.in;
    in.rope.form = rpe::rope::axial{.theta = std::nanf("")};
    CHECK_THROWS_AS(rpe::attention_forward(in, mview(y, shape)), rpe::invalid_argument);
    CHECK(y[0] == 3.0f);
}

TEST_CASE("rope: fused results (mixed frequency gradient included) do not depend on the thread count") {
#if defined(_OPENMP)
    rope_problem<float> p(1, true, 31);
    const int before = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto one = run_rope(p, true, 3);
    omp_set_num_threads(3);
    const auto three = run_rope(p, true, 3);
    omp_set_num_threads(before);
    CHECK(one.out == three.out);
    CHECK(one.gq == three.gq);
    CHECK(one.gk == three.gk);
    CHECK(one.gf == three.gf);
    CHECK(one.gt == three.gt);
#else
    MESSAGE("built without OpenMP: one thread only");
#endif
}

namespace {

// (N, 2) positions (row, col) of a height × width grid, row-major, `times` over.
std::vector<float> grid_positions(int height, int width, int times = 1) {
    std::vector<float> p;
    for (int t = 0; t < times; ++t)
        for (int i = 0; i < height * width; ++i) {
            p.push_back(static_cast<float>(i / width));
            p.push_back(static_cast<float>(i % width));
        }
    return p;
}

}  // namespace

TEST_CASE_TEMPLATE("rope: per-token positions equal to the grid give exactly the grid result", S, float, double) {
    const int height = 3, width = 4, skip = 1;
    const std::int64_t b = 2, h = 2, d = 8, pairs = d / 2, n = height * width, l = skip + n;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<S>(static_cast<std::size_t>(b * h * l * d), 41);
    const auto g = random_normal<S>(x.size(), 42);
    const auto freqs = random_normal<S>(static_cast<std::size_t>(2 * h * pairs), 43, 0.7);
    const auto pos = grid_positions(height, width);
    rpe::rope_form forms[] = {rpe::rope::axial{.theta = 100.0f}, rpe::rope::mixed{}, rpe::rope::cat{}};
    for (int f = 0; f < 6; ++f) {
        rpe::rotary_embedding<S> rg{.form = forms[f % 3], .skip = skip};
        rg.layout = f < 3 ? rpe::rope::layout::pairs : rpe::rope::layout::half;
        CAPTURE(f);
        if (rg.is_mixed()) rg.freqs = cview(freqs, {2, h, pairs});
        auto rp = rg;
        rp.positions = cview(pos, {n, 2});
        std::vector<S> yg(x.size()), yp(x.size()), gxg(x.size()), gxp(x.size()), gfg(freqs.size()), gfp(freqs.size());
        rpe::rope_forward(rg, height, width, cview(x, shape), mview(yg, shape));
        rpe::rope_forward(rp, height, width, cview(x, shape), mview(yp, shape));
        CHECK(yp == yg);
        if (rg.is_mixed()) {
            rg.grad_freqs = mview(gfg, {2, h, pairs});
            rp.grad_freqs = mview(gfp, {2, h, pairs});
        }
        rpe::rope_backward(rg, height, width, cview(x, shape), cview(g, shape), mview(gxg, shape));
        rpe::rope_backward(rp, height, width, cview(x, shape), cview(g, shape), mview(gxp, shape));
        CHECK(gxp == gxg);
        CHECK(gfp == gfg);
        // the fused attention, queries and keys at the grid's positions
        rope_problem<S> p(f % 3, true, 500 + static_cast<unsigned>(f));
        p.in.rope.layout = rg.layout;
        if (f % 3 == 2) p.in.rope.form = rpe::rope::cat{};  // coordinates = indices (no reference grid)
        const auto pp = grid_positions(p.height, p.width);
        const auto grid = run_rope(p, true, 5);
        p.in.rope.positions = cview(pp, {p.height * p.width, 2});
        p.in.rope.key_positions = cview(pp, {p.height * p.width, 2});
        const auto at = run_rope(p, true, 5);
        // the rotation is the same bit for bit (above); the fused forward's output agrees to
        // rounding (double: not bitwise, the gradients are)
        CHECK(rpe_test::max_abs_diff(at.out, grid.out) < (std::is_same_v<S, float> ? 1e-6 : 1e-14));
        CHECK(at.gq == grid.gq);
        CHECK(at.gk == grid.gk);
        CHECK(at.gv == grid.gv);
        // the keys' frequency gradient is summed apart, then added: equal to rounding
        if (f % 3 == 1) CHECK(rpe_test::max_abs_diff(at.gf, grid.gf) < (std::is_same_v<S, float> ? 1e-4 : 1e-12));
    }
}

TEST_CASE("rope: SAM2-style keys: the query grid repeated twice, then unrotated memory tokens") {
    // SAM2's memory attention rotates the keys of two memory frames at the same grid positions
    // and leaves the trailing object-pointer tokens unrotated (axial RoPE, θ = 10000).
    const int height = 2, width = 3, suffix = 4;
    const std::int64_t b = 1, h = 2, d = 8, n = height * width, lk = 2 * n + suffix;
    const std::vector<std::int64_t> shape{b, h, lk, d}, half_shape{b, h, n, d};
    const auto k = random_normal<double>(static_cast<std::size_t>(b * h * lk * d), 51);
    const auto pos = grid_positions(height, width, 2);
    for (auto lay : {rpe::rope::layout::pairs, rpe::rope::layout::half}) {
        rpe::rotary_embedding<double> r{.form = rpe::rope::axial{.theta = 10000.0f}};
        r.layout = lay;
        r.positions = cview(pos, {2 * n, 2});
        r.suffix = suffix;
        std::vector<double> y(k.size());
        rpe::rope_forward(r, 1, 1, cview(k, shape), mview(y, shape));
        // each frame as the grid's rotation of that frame alone
        rpe::rotary_embedding<double> grid{.form = r.form};
        grid.layout = lay;
        for (std::int64_t frame = 0; frame < 2; ++frame) {
            std::vector<double> part(static_cast<std::size_t>(b * h * n * d)), rotated(part.size());
            for (std::int64_t p = 0; p < b * h; ++p)
                for (std::int64_t e = 0; e < n * d; ++e) part[p * n * d + e] = k[p * lk * d + frame * n * d + e];
            rpe::rope_forward(grid, height, width, cview(part, half_shape), mview(rotated, half_shape));
            for (std::int64_t p = 0; p < b * h; ++p)
                for (std::int64_t e = 0; e < n * d; ++e)
                    if (y[p * lk * d + frame * n * d + e] != rotated[p * n * d + e])
                        CHECK(y[p * lk * d + frame * n * d + e] == rotated[p * n * d + e]);
        }
        // the suffix is copied
        for (std::int64_t p = 0; p < b * h; ++p)
            for (std::int64_t e = 2 * n * d; e < lk * d; ++e) CHECK(y[p * lk * d + e] == k[p * lk * d + e]);
        // and the backward's transpose rotation leaves it alone too
        std::vector<double> gx(k.size());
        rpe::rope_backward(r, 1, 1, cview(k, shape), cview(k, shape), mview(gx, shape));
        for (std::int64_t p = 0; p < b * h; ++p)
            for (std::int64_t e = 2 * n * d; e < lk * d; ++e) CHECK(gx[p * lk * d + e] == k[p * lk * d + e]);
    }
}

TEST_CASE("rope: finite-difference gradients at real positions, with a suffix and other key positions") {
    const int skip = 1, suffix = 2;
    const std::int64_t b = 2, h = 2, d = 8, n = 5, l = skip + n + suffix;
    const std::vector<std::int64_t> shape{b, h, l, d};
    auto x = random_normal<double>(static_cast<std::size_t>(b * h * l * d), 61);
    const auto g = random_normal<double>(x.size(), 62);
    auto freqs = random_normal<double>(static_cast<std::size_t>(2 * h * d / 2), 63, 0.7);
    const auto pos = random_normal<float>(static_cast<std::size_t>(2 * n), 64, 1.5);  // DINOv3-like real coordinates
    rpe::rope_form forms[] = {rpe::rope::axial{.theta = 100.0f}, rpe::rope::mixed{}, rpe::rope::cat{}};
    for (int f = 0; f < 6; ++f) {
        CAPTURE(f);
        rpe::rotary_embedding<double> r{.form = forms[f % 3], .skip = skip};
        r.layout = f < 3 ? rpe::rope::layout::pairs : rpe::rope::layout::half;
        r.positions = cview(pos, {n, 2});
        r.suffix = suffix;
        if (r.is_mixed()) r.freqs = cview(freqs, {2, h, d / 2});
        std::vector<double> gx(x.size()), gf(freqs.size());
        auto rb = r;
        if (r.is_mixed()) rb.grad_freqs = mview(gf, {2, h, d / 2});
        rpe::rope_backward(rb, 1, 1, cview(x, shape), cview(g, shape), mview(gx, shape));
        const double eps = 1e-6;
        auto objective = [&] {
            std::vector<double> y(x.size());
            rpe::rope_forward(r, 1, 1, cview(x, shape), mview(y, shape));
            double s = 0;
            for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * g[i];
            return s;
        };
        for (std::size_t i = 0; i < x.size(); i += 5)
            CHECK(gx[i] == doctest::Approx(rpe_test::central_difference(x, i, eps, objective)).epsilon(1e-6));
        if (!r.is_mixed()) continue;
        for (std::size_t i = 0; i < freqs.size(); ++i)
            CHECK(gf[i] == doctest::Approx(rpe_test::central_difference(freqs, i, eps, objective)).epsilon(1e-6));
    }
    // the fused attention with keys at other positions than the queries equals the composed
    // reference (rotate q at positions, k at key_positions, attend), gradients included
    for (int form = 0; form < 3; ++form) {
        CAPTURE(form);
        rope_problem<double> p(form, true, 700 + static_cast<unsigned>(form));
        const std::int64_t rot = p.height * p.width;
        const auto qp = random_normal<float>(static_cast<std::size_t>(2 * rot), 71, 2.0);
        const auto kp = random_normal<float>(static_cast<std::size_t>(2 * rot), 72, 2.0);
        p.in.rope.positions = cview(qp, {rot, 2});
        p.in.rope.key_positions = cview(kp, {rot, 2});
        const auto fused = run_rope(p, true, 5);
        const auto composed = run_rope(p, false, 0);
        CHECK(rpe_test::max_abs_diff(fused.out, composed.out) < 1e-10);
        CHECK(rpe_test::max_abs_diff(fused.gq, composed.gq) < 1e-10);
        CHECK(rpe_test::max_abs_diff(fused.gk, composed.gk) < 1e-10);
        if (form == 1) CHECK(rpe_test::max_abs_diff(fused.gf, composed.gf) < 1e-9);
        // and the keys' positions matter
        p.in.rope.key_positions = {};
        CHECK(rpe_test::max_abs_diff(run_rope(p, true, 5).out, fused.out) > 1e-3);
    }
}

TEST_CASE("rope: per-token position errors name the parameter and its value") {
    const std::int64_t b = 1, h = 1, d = 8, n = 4, l = 1 + n;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<float>(static_cast<std::size_t>(b * h * l * d), 81);
    std::vector<float> y(x.size());
    std::vector<float> pos(static_cast<std::size_t>(3 * n), 0.5f);
    rpe::rotary_embedding<float> r{.form = rpe::rope::axial{}, .skip = 1};
    auto fwd = [&] { rpe::rope_forward(r, 2, 2, cview(x, shape), mview(y, shape)); };
    r.positions = cview(pos, {n, 3});
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] rope positions has shape (4, 3); expected 2 axes (row, col)"));
    r.positions = cview(pos, {n - 1, 2});
    CHECK(rpe_test::throws_with(fwd, "rope positions"));
    r.positions = cview(pos, {n, 2});
    pos[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK(rpe_test::throws_with(fwd, "rope positions[1, 1] = nan; expected finite"));
    pos[3] = 0.0f;
    fwd();  // well-formed
    r.suffix = -2;
    CHECK(rpe_test::throws_with(fwd, "rope suffix = -2; expected >= 0"));
    r.suffix = 0;
    r.key_positions = cview(pos, {n, 2});
    CHECK(rpe_test::throws_with(fwd, "rope key_positions is given to a standalone rotation"));
    r.key_positions = {};
    r.positions = {};
    r.suffix = 1;  // L = 5 = 1 + 2*2 + 1 needs a 2x2 grid minus a token
    CHECK(rpe_test::throws_with(fwd, "L = 5; expected rope skip + height*width + suffix = 1 + 2*2 + 1"));
}

TEST_CASE("rope: DINOv3 (rope::dinov3, layout half) against timm's RotaryEmbeddingDinoV3") {
    for (const char* name : {"dinov3_base100_4x6_skip5", "dinov3_minmax_5x3_max_skip1", "dinov3_aug_3x4_min_skip5"}) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
        const int height = m.at("height"), width = m.at("width"), skip = m.at("skip");
        const std::vector<std::int64_t> shape{b, h, l, d};
        rpe::rope::dinov3 p;
        if (m.contains("base")) {
            p.base = m.at("base").get<float>();
        } else {
            p.min_period = m.at("min_period").get<float>();
            p.max_period = m.at("max_period").get<float>();
        }
        const std::string norm = m.at("normalize");
        p.normalize = norm == "max"   ? rpe::rope::dinov3_normalize::max
                      : norm == "min" ? rpe::rope::dinov3_normalize::min
                                      : rpe::rope::dinov3_normalize::separate;
        if (m.contains("shift")) {
            p.shift_y = m.at("shift")[0].get<float>();
            p.shift_x = m.at("shift")[1].get<float>();
            p.jitter_y = m.at("jitter")[0].get<float>();
            p.jitter_x = m.at("jitter")[1].get<float>();
            p.rescale = m.at("rescale").get<float>();
        }
        rpe::rotary_embedding<float> r{.form = rpe::rope::custom{p}, .skip = skip};
        r.layout = rpe::rope::layout::half;
        const auto x = load<float>(dir, "x.npy", shape);
        const auto expected = load<double>(dir, "y.npy", shape);
        std::vector<float> y(x.size());
        rpe::rope_forward(r, height, width, cview(x, shape), mview(y, shape));
        rpe_test::check_close(y, expected, 1e-6, 1e-5, std::string(name) + " y");
        for (std::int64_t e = 0; e < skip * d; ++e) CHECK(y[static_cast<std::size_t>(e)] == x[static_cast<std::size_t>(e)]);
        // DINOv3's own coordinates of the grid as per-token positions: the grid's result exactly
        if (!m.contains("shift")) {
            const auto pos = load<float>(dir, "positions.npy", {height * width, 2});
            auto rp = r;
            rp.positions = cview(pos, {height * width, 2});
            std::vector<float> yp(x.size());
            rpe::rope_forward(rp, 1, 1, cview(x, shape), mview(yp, shape));
            CHECK(yp == y);
        }
    }
    // errors name the parameter and its value
    auto invalid = [](rpe::rope::dinov3 p) { return [p] { p.validate(); }; };
    CHECK(rpe_test::throws_with(invalid({.base = -1.0f}), "[rpe.rope] base = -1; expected finite and > 0"));
    CHECK(rpe_test::throws_with(invalid({.min_period = 2.0f}), "min_period, max_period = 2, 0"));
    CHECK(rpe_test::throws_with(invalid({.rescale = 0.0f}), "rescale = 0; expected finite and > 0"));
    CHECK(rpe_test::throws_with(invalid({.jitter_y = -1.0f}), "jitter = -1, 1"));
    // the parameters are the table cache's key: another shift is another table
    const rpe::rotary_embedding<float> a{.form = rpe::rope::custom{rpe::rope::dinov3{}}};
    const rpe::rotary_embedding<float> c{.form = rpe::rope::custom{rpe::rope::dinov3{.shift_y = 0.25f}}};
    CHECK(rpe::rope_table_of(a, 8, 2, 2).get() != rpe::rope_table_of(c, 8, 2, 2).get());
    CHECK(rpe::rope_table_of(a, 8, 2, 2)->cos != rpe::rope_table_of(c, 8, 2, 2)->cos);
}

}  // namespace rpe_unit_vit_rope
