// V-JEPA 2's 3D RoPE (rpe::rope::vjepa2, layout vjepa2) and SAM2's memory-attention RoPE (form
// sam2: rope::axial θ = 10000, keys at the query grid repeated, a suffix unrotated): golden data
// from the sources' own code (tools/golden/gen_vjepa2_rope.py, gen_sam2_rope.py →
// tests/data/golden_vit/rope/{vjepa2,sam2}_*), finite-difference gradients, the fused attention
// against rotate-then-attend, the registry entries and the errors.
#include <doctest/doctest.h>
#include <rpe/families.hpp>
#include <rpe/rope/positions.hpp>
#include <rpe/rope/vjepa2.hpp>
#include <rpe/rpe.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_rope_vjepa2_sam2 {

namespace {

using json = nlohmann::json;
using rpe_test::cview;
using rpe_test::load;
using rpe_test::mview;
using rpe_test::random_normal;

const char* const kVjepa2Cases[] = {"vjepa2_d64_2x4x4", "vjepa2_d80_3x3x3_masked", "vjepa2_d96_2x3x3", "vjepa2_d32_4x2x2"};
const char* const kSam2Cases[] = {"sam2_d256_4x4_repeat3_suffix8", "sam2_d64_3x3_repeat2_suffix4", "sam2_d32_5x5_self"};

rpe::rotary_embedding<float> vjepa2_embedding(float theta = 10000.0f) {
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{rpe::rope::vjepa2{.theta = theta}}};
    r.layout = rpe::rope::layout::vjepa2;
    return r;
}

}  // namespace

TEST_CASE_TEMPLATE("rope: V-JEPA 2 (rope::vjepa2) against transformers' VJEPA2RopeAttention", S, float, double) {
    for (const char* name : kVjepa2Cases) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
        const std::vector<std::int64_t> shape{b, h, l, d};
        CHECK(rpe::rope::vjepa2::slice(static_cast<int>(d)) == m.at("slice").get<int>());
        rpe::rotary_embedding<S> r{.form = rpe::rope::custom{rpe::rope::vjepa2{.theta = m.at("theta").get<float>()}}};
        r.layout = rpe::rope::layout::vjepa2;
        const auto pos = load<float>(dir, "positions.npy", {l, 3});
        r.positions = cview(pos, {l, 3});
        const auto x = load<S>(dir, "x.npy", shape);
        const auto gy = load<S>(dir, "grad_y.npy", shape);
        std::vector<S> y(x.size()), gx(x.size());
        rpe::rope_forward(r, 1, 1, cview(x, shape), mview(y, shape));
        rpe::rope_backward(r, 1, 1, cview(x, shape), cview(gy, shape), mview(gx, shape));
        rpe_test::check_close(y, load<double>(dir, "y.npy", shape), 1e-6, 1e-5, std::string(name) + " y");
        rpe_test::check_close(gx, load<double>(dir, "grad_x.npy", shape), 1e-6, 1e-5, std::string(name) + " grad_x");
        // the passed-through channels are x itself
        const std::int64_t through = m.at("passed_through").get<std::int64_t>();
        CHECK(through == d - 3 * rpe::rope::vjepa2::slice(static_cast<int>(d)));
        for (std::int64_t t = 0; t < b * h * l; ++t)
            for (std::int64_t c = d - through; c < d; ++c)
                CHECK(y[static_cast<std::size_t>(t * d + c)] == x[static_cast<std::size_t>(t * d + c)]);
        // an unmasked clip is its TxHxW grid (rope::grid_positions)
        if (m.at("kept").is_null()) {
            const auto& g = m.at("grid_thw");
            CHECK(rpe::rope::grid_positions(g[0].get<int>(), g[1].get<int>(), g[2].get<int>()) == pos);
        }
    }
}

TEST_CASE("rope: V-JEPA 2's layout by hand: tiled angles per slice, adjacent partners, pass-through") {
    // D = 14: slices of s = 2*((14/3)/2) = 4 channels (m = 2 frequencies), 2 channels through
    const rpe::rope::vjepa2 p{.theta = 100.0f};
    CHECK(rpe::rope::vjepa2::slice(14) == 4);
    CHECK(rpe::rope::vjepa2::slice(64) == 20);
    CHECK(rpe::rope::vjepa2::slice(80) == 26);
    CHECK(rpe::rope::vjepa2::slice(96) == 32);
    CHECK(p.omega(0, 2) == 1.0f);
    CHECK(p.omega(1, 2) == doctest::Approx(0.1).epsilon(1e-7));  // 1/100^(1/2)
    const float frame = 2.0f, row = 3.0f, col = 5.0f;
    const std::vector<float> pos{frame, row, col};
    auto r = vjepa2_embedding(100.0f);
    r.positions = cview(pos, {1, 3});
    const std::vector<std::int64_t> shape{1, 1, 1, 14};
    const auto x = random_normal<double>(14, 7);
    const std::vector<float> xf(x.begin(), x.end());
    std::vector<float> y(14);
    rpe::rope_forward(r, 1, 1, cview(xf, shape), mview(y, shape));
    const double axis[3] = {frame, row, col};
    for (int a = 0; a < 3; ++a)
        for (int l = 0; l < 4; ++l) {
            const int c = 4 * a + l;
            const double ang = axis[a] * std::pow(100.0, -(l % 2) / 2.0);  // angle l mod m
            const double expect = l % 2 == 0 ? std::cos(ang) * xf[c] - std::sin(ang) * xf[c + 1]
                                             : std::cos(ang) * xf[c] + std::sin(ang) * xf[c - 1];
            CAPTURE(c);
            CHECK(y[static_cast<std::size_t>(c)] == doctest::Approx(expect).epsilon(1e-6));
        }
    CHECK(y[12] == xf[12]);
    CHECK(y[13] == xf[13]);
    // not a rotation: the two channels of a partnership turn by different angles, so the norm changes
    double n0 = 0, n1 = 0;
    for (int c = 0; c < 12; ++c) {
        n0 += double(xf[c]) * xf[c];
        n1 += double(y[c]) * y[c];
    }
    CHECK(std::abs(n1 - n0) > 1e-3);
    // the grid is one frame: ids (0, row, col)
    CHECK(p.angle(3, 5, 4, 14, 4, 6) == p.angle_at(0.0f, 3.0f, 5.0f, 4, 14));
    CHECK(p.angle_at(frame, row, col, 1, 14) == frame * p.omega(1, 2));
    CHECK(p.angle_at(frame, row, col, 5, 14) == col * p.omega(1, 2));
    CHECK(p.angle_at(frame, row, col, 6, 14) == 0.0f);  // a passed-through entry
    // theta matters and is the table cache's key
    auto r2 = vjepa2_embedding(10000.0f);
    CHECK(rpe::rope_table_of(r, 14, 2, 3)->cos != rpe::rope_table_of(r2, 14, 2, 3)->cos);
}

TEST_CASE("rope: V-JEPA 2 on the grid equals positions (0, row, col); TxHxW grids are rope::grid_positions") {
    const int height = 3, width = 4, skip = 1, suffix = 2;
    const std::int64_t b = 2, h = 2, d = 20, n = height * width, l = skip + n + suffix;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<float>(static_cast<std::size_t>(b * h * l * d), 31);
    auto r = vjepa2_embedding();
    r.skip = skip;
    r.suffix = suffix;
    std::vector<float> grid(x.size()), at(x.size());
    rpe::rope_forward(r, height, width, cview(x, shape), mview(grid, shape));
    const auto pos = rpe::rope::grid_positions(1, height, width);
    r.positions = cview(pos, {n, 3});
    rpe::rope_forward(r, 1, 1, cview(x, shape), mview(at, shape));
    CHECK(at == grid);
    for (std::int64_t e = 0; e < skip * d; ++e) CHECK(grid[static_cast<std::size_t>(e)] == x[static_cast<std::size_t>(e)]);
    for (std::int64_t e = (l - suffix) * d; e < l * d; ++e)
        CHECK(grid[static_cast<std::size_t>(e)] == x[static_cast<std::size_t>(e)]);
    const auto clip = rpe::rope::grid_positions(2, 2, 3);
    REQUIRE(clip.size() == 36);
    CHECK(std::vector<float>(clip.begin() + 3 * 7, clip.begin() + 3 * 8) == std::vector<float>{1.0f, 0.0f, 1.0f});  // token 7
    CHECK(rpe_test::throws_with([] { (void)rpe::rope::grid_positions(0, 2, 3); },
                                "[rpe.rope] grid frames, height, width = 0, 2, 3; expected >= 1"));
}

TEST_CASE("rope: finite-difference gradients of the V-JEPA 2 map (real positions, skip and suffix)") {
    const int skip = 1, suffix = 2;
    const std::int64_t b = 2, h = 2, d = 16, n = 5, l = skip + n + suffix;  // slices of 4, 4 channels through
    const std::vector<std::int64_t> shape{b, h, l, d};
    auto x = random_normal<double>(static_cast<std::size_t>(b * h * l * d), 41);
    const auto g = random_normal<double>(x.size(), 42);
    const auto pos = random_normal<float>(static_cast<std::size_t>(3 * n), 43, 4.0);
    rpe::rotary_embedding<double> r{.form = rpe::rope::custom{rpe::rope::vjepa2{.theta = 50.0f}}, .skip = skip};
    r.layout = rpe::rope::layout::vjepa2;
    r.suffix = suffix;
    r.positions = cview(pos, {n, 3});
    std::vector<double> gx(x.size());
    rpe::rope_backward(r, 1, 1, cview(x, shape), cview(g, shape), mview(gx, shape));
    auto objective = [&] {
        std::vector<double> y(x.size());
        rpe::rope_forward(r, 1, 1, cview(x, shape), mview(y, shape));
        double s = 0;
        for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * g[i];
        return s;
    };
    for (std::size_t i = 0; i < x.size(); i += 3)
        CHECK(gx[i] == doctest::Approx(rpe_test::central_difference(x, i, 1e-6, objective)).epsilon(1e-6));
}

TEST_CASE("rope: fused attention with V-JEPA 2 equals rotate-then-attend (forward and backward)") {
    const int skip = 1, suffix = 1;
    const std::int64_t b = 2, h = 2, d = 14, n = 6, l = skip + n + suffix;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto size = static_cast<std::size_t>(b * h * l * d);
    const auto q = random_normal<double>(size, 51), k = random_normal<double>(size, 52), v = random_normal<double>(size, 53),
               go = random_normal<double>(size, 54);
    const auto qp = rpe::rope::grid_positions(2, 1, 3);
    const auto kp = random_normal<float>(static_cast<std::size_t>(3 * n), 55, 3.0);
    rpe::attention_inputs<double> in;
    in.q = cview(q, shape);
    in.k = cview(k, shape);
    in.v = cview(v, shape);
    in.rope.form = rpe::rope::custom{rpe::rope::vjepa2{}};
    in.rope.layout = rpe::rope::layout::vjepa2;
    in.rope.skip = skip;
    in.rope.suffix = suffix;
    in.rope.positions = cview(qp, {n, 3});
    in.rope.key_positions = cview(kp, {n, 3});
    auto run = [&](bool fused) {
        std::vector<std::vector<double>> r(4, std::vector<double>(size, -5.0));
        if (fused) {
            const rpe::attention_options opt{.row_block = 3};
            rpe::attention_forward(in, mview(r[0], shape), {}, opt);
            rpe::attention_backward(in, cview(go, shape), mview(r[1], shape), mview(r[2], shape), mview(r[3], shape), opt);
        } else {
            std::vector<double> attn(static_cast<std::size_t>(b * h * l * l));
            const std::vector<std::int64_t> ashape{b, h, l, l};
            rpe::composed_attention_forward(in, mview(r[0], shape), mview(attn, ashape));
            rpe::composed_attention_backward(in, {.grad_out = cview(go, shape),
                                                  .grad_q = mview(r[1], shape),
                                                  .grad_k = mview(r[2], shape),
                                                  .grad_v = mview(r[3], shape),
                                                  .saved_attn = cview(attn, ashape)});
        }
        return r;
    };
    const auto fused = run(true), composed = run(false);
    for (int i = 0; i < 4; ++i) {
        CAPTURE(i);
        CHECK(rpe_test::max_abs_diff(fused[static_cast<std::size_t>(i)], composed[static_cast<std::size_t>(i)]) < 1e-10);
    }
    // the reference: rope_forward of q at positions and k at key_positions, then plain attention
    std::vector<double> qr(size), kr(size), ref(size);
    rpe::rope_forward(rpe::query_rope(in.rope), 1, 1, cview(q, shape), mview(qr, shape));
    rpe::rope_forward(rpe::key_rope(in.rope), 1, 1, cview(k, shape), mview(kr, shape));
    auto plain = in;
    plain.rope = {};
    plain.q = cview(qr, shape);
    plain.k = cview(kr, shape);
    rpe::attention_forward(plain, mview(ref, shape));
    CHECK(rpe_test::max_abs_diff(ref, fused[0]) < 1e-10);
}

TEST_CASE("rope: V-JEPA 2 errors name the parameter, its value and the shapes") {
    const std::int64_t b = 1, h = 1, d = 14, n = 4, l = 1 + n;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<float>(static_cast<std::size_t>(b * h * l * d), 61);
    std::vector<float> y(x.size());
    std::vector<float> pos(static_cast<std::size_t>(3 * n), 1.0f);
    auto r = vjepa2_embedding();
    r.skip = 1;
    auto fwd = [&] { rpe::rope_forward(r, 2, 2, cview(x, shape), mview(y, shape)); };
    fwd();  // the grid
    r.positions = cview(pos, {n, 3});
    fwd();
    // bad positions: two axes, the wrong count, not finite
    r.positions = cview(pos, {n, 2});
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] rope positions has shape (4, 2); expected 3 axes (t, h, w), shape (4, 3)"));
    r.positions = cview(pos, {n - 1, 3});
    CHECK(rpe_test::throws_with(fwd, {"rope positions", "(3, 3)", "(4, 3)"}));
    r.positions = cview(pos, {n, 3});
    pos[4] = std::nanf("");
    CHECK(rpe_test::throws_with(fwd, "rope positions[1, 1] = nan; expected finite"));
    pos[4] = 1.0f;
    // a bad grid: L against skip + height*width
    r.positions = {};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 3, 2, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] L = 5; expected rope skip + height*width = 1 + 3*2"));
    // the head: odd, or too small for three slices
    const std::vector<std::int64_t> odd{b, h, l, 15};
    const auto x15 = random_normal<float>(static_cast<std::size_t>(b * h * l * 15), 62);
    std::vector<float> y15(x15.size());
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 2, 2, cview(x15, odd), mview(y15, odd)); },
                                "[rpe.rope] rope needs head_dim D = 15 to be a positive multiple of 2"));
    const std::vector<std::int64_t> small{b, h, l, 4};
    const auto x4 = random_normal<float>(static_cast<std::size_t>(b * h * l * 4), 63);
    std::vector<float> y4(x4.size());
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(r, 2, 2, cview(x4, small), mview(y4, small)); },
                                "[rpe.rope] vjepa2 head_dim D = 4 gives slices of 0 channels (2*((D/3)/2)); expected D >= 6"));
    // theta
    r.form = rpe::rope::custom{rpe::rope::vjepa2{.theta = -2.0f}};
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] theta = -2; expected finite and > 0"));
    // the layout: vjepa2 runs in its own, and its layout only with it
    r.form = rpe::rope::custom{rpe::rope::vjepa2{}};
    r.layout = rpe::rope::layout::pairs;
    CHECK(rpe_test::throws_with(fwd,
                                "[rpe.rope] rope layout = pairs for a form that runs in its own layout; expected "
                                "rope::layout::vjepa2 (rope::default_layout_of)"));
    auto axial = vjepa2_embedding();
    axial.form = rpe::rope::axial{};
    axial.skip = 1;
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(axial, 2, 2, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] rope layout = vjepa2 for a form other than rope::vjepa2; expected pairs or half"));
    axial.form = rpe::rope::mixed{};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(axial, 2, 2, cview(x, shape), mview(y, shape)); },
                                "rope layout = vjepa2 for a form other than rope::vjepa2"));
}

TEST_CASE("rope: SAM2's memory attention (form sam2) against sam2's RoPEAttention: repeated key grid, unrotated suffix") {
    for (const char* name : kSam2Cases) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), d = m.at("head_dim"), lq = m.at("L_q"), lk = m.at("L_k");
        const int height = m.at("height"), width = m.at("width"), repeat = m.at("repeat"), suffix = m.at("suffix");
        // the form by name, as the CLI and the torch operators make it
        const auto spec = rpe::parse_family_spec("sam2", rpe::family_kind::rope);
        rpe::rotary_embedding<float> r;
        r.form = rpe::visit_rope(spec, [](const auto& p) { return rpe::rope_form_of(p); });
        r.layout = rpe::visit_rope(spec, [](const auto& p) { return rpe::rope::default_layout_of(p); });
        CHECK(r.form == rpe::rope_form{rpe::rope::axial{.theta = m.at("theta").get<float>()}});
        CHECK(r.layout == rpe::rope::layout::pairs);
        // queries: the grid
        const std::vector<std::int64_t> qs{b, h, lq, d}, ks{b, h, lk, d};
        const auto q = load<float>(dir, "q.npy", qs);
        std::vector<float> qr(q.size());
        rpe::rope_forward(r, height, width, cview(q, qs), mview(qr, qs));
        rpe_test::check_close(qr, load<double>(dir, "q_rot.npy", qs), 1e-6, 1e-5, std::string(name) + " q");
        // keys: the grid once per memory frame, then `suffix` object-pointer tokens unrotated
        const auto kp = rpe::rope::repeated_grid_positions(height, width, repeat);
        auto rk = r;
        rk.positions = cview(kp, {repeat * height * width, 2});
        rk.suffix = suffix;
        const auto k = load<float>(dir, "k.npy", ks);
        const auto gk = load<float>(dir, "grad_k_rot.npy", ks);
        std::vector<float> kr(k.size()), gx(k.size());
        rpe::rope_forward(rk, 1, 1, cview(k, ks), mview(kr, ks));
        rpe::rope_backward(rk, 1, 1, cview(k, ks), cview(gk, ks), mview(gx, ks));
        rpe_test::check_close(kr, load<double>(dir, "k_rot.npy", ks), 1e-6, 1e-5, std::string(name) + " k");
        rpe_test::check_close(gx, load<double>(dir, "grad_k.npy", ks), 1e-6, 1e-5, std::string(name) + " grad_k");
        // each memory frame is the grid's rotation bit for bit; the suffix is k itself
        if (repeat == 1 && suffix == 0) {
            std::vector<float> kg(k.size());
            rpe::rope_forward(r, height, width, cview(k, ks), mview(kg, ks));
            CHECK(kg == kr);
        }
        for (std::int64_t t = 0; t < b * h; ++t)
            for (std::int64_t i = lk - suffix; i < lk; ++i)
                for (std::int64_t c = 0; c < d; ++c) {
                    const auto e = static_cast<std::size_t>((t * lk + i) * d + c);
                    CHECK(kr[e] == k[e]);
                }
    }
}

TEST_CASE("rope: SAM2 presets: the registry entry, repeated grid positions and their errors") {
    const auto s = rpe::parse_family_spec("sam2", rpe::family_kind::rope);
    CHECK(rpe::to_string(s) == "sam2:theta=10000");
    const auto t = rpe::parse_family_spec("sam2:theta=100", rpe::family_kind::rope);
    CHECK(rpe::visit_rope(t, [](const auto& p) { return rpe::rope_form_of(p); }) ==
          rpe::rope_form{rpe::rope::axial{.theta = 100.0f}});
    const auto v = rpe::parse_family_spec("vjepa2", rpe::family_kind::rope);
    CHECK(rpe::to_string(v) == "vjepa2:theta=10000");
    CHECK(rpe::visit_rope(v, [](const auto& p) { return rpe::rope_form_of(p); }) ==
          rpe::rope_form{rpe::rope::custom{rpe::rope::vjepa2{}}});
    CHECK(rpe::visit_rope(v, [](const auto& p) { return rpe::rope::default_layout_of(p); }) == rpe::rope::layout::vjepa2);
    CHECK(rpe::visit_rope(v, [](const auto& p) { return rpe::rope_position_axes(rpe::rope_form_of(p)); }) == 3);
    const auto p = rpe::rope::repeated_grid_positions(2, 3, 2);
    REQUIRE(p.size() == 24);
    CHECK(std::vector<float>(p.begin() + 2 * 6, p.begin() + 2 * 8) == std::vector<float>{0.0f, 0.0f, 0.0f, 1.0f});  // copy 2
    CHECK(std::vector<float>(p.begin() + 2 * 5, p.begin() + 2 * 6) == std::vector<float>{1.0f, 2.0f});
    CHECK(rpe_test::throws_with([] { (void)rpe::rope::repeated_grid_positions(2, 3, 0); },
                                "[rpe.rope] repeat = 0; expected >= 1 (copies of the grid)"));
    CHECK(rpe_test::throws_with([] { (void)rpe::rope::repeated_grid_positions(0, 3, 2); },
                                "[rpe.rope] grid height, width = 0, 3; expected >= 1"));
}

}  // namespace rpe_unit_rope_vjepa2_sam2
