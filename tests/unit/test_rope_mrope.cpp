// Qwen-VL multimodal RoPE (rpe::rope::mrope: Qwen2-VL / Qwen2.5-VL sections, Qwen3-VL interleaved)
// with per-token (t, h, w) positions: golden data from transformers' own code
// (tools/golden/gen_qwen_mrope.py → tests/data/golden_vit/rope/mrope_*), finite-difference
// gradients of the rotation, the fused attention against rotate-then-attend, and the errors.
#include <doctest/doctest.h>
#include <rpe/rope/mrope.hpp>
#include <rpe/rpe.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_rope_mrope {

namespace {

using json = nlohmann::json;
using rpe_test::cview;
using rpe_test::load;
using rpe_test::mview;
using rpe_test::random_normal;

const char* const kCases[] = {"mrope_qwen2vl_d128", "mrope_qwen25vl_d80_video", "mrope_qwen3vl_d128_interleaved",
                              "mrope_qwen3vl_d64_interleaved"};

rpe::rope::mrope policy_of(const json& m) {
    rpe::rope::mrope p;
    p.theta = m.at("theta").get<float>();
    p.section_t = m.at("sections")[0].get<int>();
    p.section_h = m.at("sections")[1].get<int>();
    p.section_w = m.at("sections")[2].get<int>();
    p.interleaved = m.at("interleaved").get<bool>();
    return p;
}

// A random (b, h, l, d) problem: q, k, v and the upstream gradient, rotated by M-RoPE.
struct mrope_problem {
    std::int64_t b = 2, h = 2, l = 0, d = 12;
    int skip = 1, suffix = 1;
    std::vector<double> q, k, v, go;
    std::vector<float> qp, kp;
    rpe::attention_inputs<double> in;
    mrope_problem(std::int64_t n, unsigned seed) {
        l = skip + n + suffix;
        const auto size = static_cast<std::size_t>(b * h * l * d);
        q = random_normal<double>(size, seed);
        k = random_normal<double>(size, seed + 1);
        v = random_normal<double>(size, seed + 2);
        go = random_normal<double>(size, seed + 3);
        qp = random_normal<float>(static_cast<std::size_t>(3 * n), seed + 4, 3.0);
        kp = random_normal<float>(static_cast<std::size_t>(3 * n), seed + 5, 3.0);
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.rope.form = rpe::rope::custom{rpe::rope::mrope{.theta = 100.0f, .section_t = 2, .section_h = 2, .section_w = 2}};
        in.rope.layout = rpe::rope::layout::half;
        in.rope.skip = skip;
        in.rope.suffix = suffix;
        in.rope.positions = cview(qp, {n, 3});
        in.rope.key_positions = cview(kp, {n, 3});
    }
    [[nodiscard]] std::vector<std::int64_t> shape() const { return {b, h, l, d}; }
};

}  // namespace

TEST_CASE_TEMPLATE("rope: M-RoPE (rope::mrope) against transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL", S, float, double) {
    for (const char* name : kCases) {
        CAPTURE(name);
        const auto dir = rpe_test::rope_golden_dir(name);
        const auto m = rpe_test::read_meta<json>(dir);
        const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
        const std::vector<std::int64_t> shape{b, h, l, d};
        rpe::rotary_embedding<S> r{.form = rpe::rope::custom{policy_of(m)}};
        r.layout = rpe::rope::layout::half;
        const auto pos = load<float>(dir, "positions.npy", {l, 3});
        r.positions = cview(pos, {l, 3});
        const auto x = load<S>(dir, "x.npy", shape);
        const auto gy = load<S>(dir, "grad_y.npy", shape);
        std::vector<S> y(x.size()), gx(x.size());
        rpe::rope_forward(r, 1, 1, cview(x, shape), mview(y, shape));
        rpe::rope_backward(r, 1, 1, cview(x, shape), cview(gy, shape), mview(gx, shape));
        // float32 as the source: within 1e-5 relative (1e-6 absolute near zero)
        rpe_test::check_close(y, load<double>(dir, "y.npy", shape), 1e-6, 1e-5, std::string(name) + " y");
        rpe_test::check_close(gx, load<double>(dir, "grad_x.npy", shape), 1e-6, 1e-5, std::string(name) + " grad_x");
        // the layout matters: Qwen's channels are rotate-half, and sections are not interleaved
        auto other = r;
        other.layout = rpe::rope::layout::pairs;
        std::vector<S> yo(x.size());
        rpe::rope_forward(other, 1, 1, cview(x, shape), mview(yo, shape));
        CHECK(rpe_test::max_abs_diff(yo, y) > 1e-2);
        auto flipped = policy_of(m);
        flipped.interleaved = !flipped.interleaved;
        other = r;
        other.form = rpe::rope::custom{flipped};
        rpe::rope_forward(other, 1, 1, cview(x, shape), mview(yo, shape));
        CHECK(rpe_test::max_abs_diff(yo, y) > 1e-2);
    }
}

TEST_CASE("rope: M-RoPE pairs follow the sources' sections and interleaving") {
    const rpe::rope::mrope sections{};  // 16, 24, 24 (Qwen2-VL)
    CHECK(sections.axis(0) == 0);
    CHECK(sections.axis(15) == 0);
    CHECK(sections.axis(16) == 1);
    CHECK(sections.axis(39) == 1);
    CHECK(sections.axis(40) == 2);
    CHECK(sections.axis(63) == 2);
    const rpe::rope::mrope inter{.section_t = 24, .section_h = 20, .section_w = 20, .interleaved = true};  // Qwen3-VL
    int count[3] = {0, 0, 0};
    for (int j = 0; j < 64; ++j) ++count[inter.axis(j)];
    CHECK(count[0] == 24);
    CHECK(count[1] == 20);
    CHECK(count[2] == 20);
    CHECK(inter.axis(0) == 0);
    CHECK(inter.axis(1) == 1);
    CHECK(inter.axis(2) == 2);
    CHECK(inter.axis(58) == 1);
    CHECK(inter.axis(59) == 2);
    CHECK(inter.axis(60) == 0);  // from 3·20 on: t
    CHECK(inter.axis(61) == 0);
    // inv_freq_j = 1 / θ^(2j/D), angle = id · inv_freq: pair 16 (h) at h = 3 with θ = 1e6, D = 128
    CHECK(sections.angle_at(7.0f, 3.0f, 5.0f, 16, 128) == doctest::Approx(3.0 / std::pow(1e6, 32.0 / 128.0)).epsilon(1e-6));
    CHECK(sections.angle_at(7.0f, 3.0f, 5.0f, 0, 128) == 7.0f);
    // the grid is an image alone: ids (0, row, col)
    CHECK(sections.angle(2, 5, 45, 128, 4, 6) == sections.angle_at(0.0f, 2.0f, 5.0f, 45, 128));
}

TEST_CASE("rope: M-RoPE on the grid equals positions (0, row, col); text ids (n, n, n) are 1D RoPE") {
    const int height = 3, width = 4, skip = 2;
    const std::int64_t b = 1, h = 2, d = 16, n = height * width, l = skip + n;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<float>(static_cast<std::size_t>(b * h * l * d), 91);
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 3, .section_w = 3}},
                                   .skip = skip};
    r.layout = rpe::rope::layout::half;
    std::vector<float> grid(x.size()), at(x.size());
    rpe::rope_forward(r, height, width, cview(x, shape), mview(grid, shape));
    std::vector<float> pos;
    for (int t = 0; t < n; ++t) pos.insert(pos.end(), {0.0f, static_cast<float>(t / width), static_cast<float>(t % width)});
    r.positions = cview(pos, {n, 3});
    rpe::rope_forward(r, 1, 1, cview(x, shape), mview(at, shape));
    CHECK(at == grid);
    for (std::int64_t e = 0; e < skip * d; ++e) CHECK(grid[static_cast<std::size_t>(e)] == x[static_cast<std::size_t>(e)]);
    // equal ids on the three axes (text tokens): every pair turns by n·inv_freq_j, whatever the
    // sections or interleaving
    for (int t = 0; t < n; ++t)
        pos[static_cast<std::size_t>(3 * t)] = pos[static_cast<std::size_t>(3 * t + 1)] =
            pos[static_cast<std::size_t>(3 * t + 2)] = static_cast<float>(t + 1);
    std::vector<float> a(x.size()), c(x.size());
    rpe::rope_forward(r, 1, 1, cview(x, shape), mview(a, shape));
    r.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 4, .section_h = 2, .section_w = 2, .interleaved = true}};
    rpe::rope_forward(r, 1, 1, cview(x, shape), mview(c, shape));
    CHECK(a == c);
}

TEST_CASE("rope: finite-difference gradients of the M-RoPE rotation (real positions, skip and suffix)") {
    for (const bool interleaved : {false, true}) {
        CAPTURE(interleaved);
        const int skip = 1, suffix = 2;
        const std::int64_t b = 2, h = 2, d = 12, n = 5, l = skip + n + suffix;
        const std::vector<std::int64_t> shape{b, h, l, d};
        auto x = random_normal<double>(static_cast<std::size_t>(b * h * l * d), 101);
        const auto g = random_normal<double>(x.size(), 102);
        const auto pos = random_normal<float>(static_cast<std::size_t>(3 * n), 103, 4.0);
        rpe::rotary_embedding<double> r{
            .form = rpe::rope::custom{rpe::rope::mrope{
                .theta = 50.0f, .section_t = 2, .section_h = 2, .section_w = 2, .interleaved = interleaved}},
            .skip = skip};
        r.layout = rpe::rope::layout::half;
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
        const double eps = 1e-6;
        for (std::size_t i = 0; i < x.size(); i += 3)
            CHECK(gx[i] == doctest::Approx(rpe_test::central_difference(x, i, eps, objective)).epsilon(1e-6));
    }
}

TEST_CASE("rope: fused attention with M-RoPE equals rotate-then-attend (query and key positions (N, 3))") {
    mrope_problem p(6, 200);
    const auto shape = p.shape();
    const auto size = p.q.size();
    auto run = [&](bool fused) {
        std::vector<std::vector<double>> r(4, std::vector<double>(size, -5.0));
        if (fused) {
            const rpe::attention_options opt{.row_block = 3};
            rpe::attention_forward(p.in, mview(r[0], shape), {}, opt);
            rpe::attention_backward(p.in, cview(p.go, shape), mview(r[1], shape), mview(r[2], shape), mview(r[3], shape), opt);
        } else {
            std::vector<double> attn(static_cast<std::size_t>(p.b * p.h * p.l * p.l));
            const std::vector<std::int64_t> ashape{p.b, p.h, p.l, p.l};
            rpe::composed_attention_forward(p.in, mview(r[0], shape), mview(attn, ashape));
            rpe::composed_attention_backward(p.in, {.grad_out = cview(p.go, shape),
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
    // the composed reference rotates q at positions and k at key_positions by rope_forward
    std::vector<double> qr(size), kr(size), ref(size);
    rpe::rope_forward(rpe::query_rope(p.in.rope), 1, 1, cview(p.q, shape), mview(qr, shape));
    rpe::rope_forward(rpe::key_rope(p.in.rope), 1, 1, cview(p.k, shape), mview(kr, shape));
    auto plain = p.in;
    plain.rope = {};
    plain.q = cview(qr, shape);
    plain.k = cview(kr, shape);
    rpe::attention_forward(plain, mview(ref, shape));
    CHECK(rpe_test::max_abs_diff(ref, fused[0]) < 1e-10);
    // the keys' positions matter
    p.in.rope.key_positions = {};
    CHECK(rpe_test::max_abs_diff(run(true)[0], fused[0]) > 1e-3);
}

TEST_CASE("rope: M-RoPE errors name the parameter, its value and the shapes") {
    const std::int64_t b = 1, h = 1, d = 12, n = 4, l = 1 + n;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_normal<float>(static_cast<std::size_t>(b * h * l * d), 111);
    std::vector<float> y(x.size());
    std::vector<float> pos(static_cast<std::size_t>(3 * n), 1.0f);
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2}},
                                   .skip = 1};
    r.layout = rpe::rope::layout::half;
    auto fwd = [&] { rpe::rope_forward(r, 2, 2, cview(x, shape), mview(y, shape)); };
    fwd();  // the grid: ids (0, row, col)
    r.positions = cview(pos, {n, 3});
    fwd();  // well-formed
    CHECK(rpe::rope_position_axes(r.form) == 3);
    CHECK(rpe::rope_position_axes(rpe::rope_form{rpe::rope::axial{}}) == 2);
    // (N, 2) positions to the 3-axis form, and (N, 3) to a 2D form
    r.positions = cview(pos, {n, 2});
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] rope positions has shape (4, 2); expected 3 axes (t, h, w), shape (4, 3)"));
    r.positions = cview(pos, {n - 1, 3});
    CHECK(rpe_test::throws_with(fwd, {"rope positions", "(3, 3)", "(4, 3)"}));
    r.positions = cview(pos, {n, 3});
    auto axial = r;
    axial.form = rpe::rope::axial{};
    CHECK(rpe_test::throws_with([&] { rpe::rope_forward(axial, 2, 2, cview(x, shape), mview(y, shape)); },
                                "[rpe.rope] rope positions has shape (4, 3); expected 2 axes (row, col), shape (4, 2)"));
    pos[5] = std::nanf("");
    CHECK(rpe_test::throws_with(fwd, "rope positions[1, 2] = nan; expected finite"));
    pos[5] = 1.0f;
    // the sections against the head: D/2 = 6 pairs
    r.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 3, .section_w = 3}};
    CHECK(rpe_test::throws_with(
        fwd, "[rpe.rope] mrope sections = 2,3,3 sum to 8 frequency pairs; expected D/2 = 6 (head_dim D = 12)"));
    r.form = rpe::rope::custom{rpe::rope::mrope{.section_t = -1, .section_h = 4, .section_w = 3}};
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] mrope sections = -1,4,3; expected counts of frequency pairs >= 0"));
    r.form = rpe::rope::custom{rpe::rope::mrope{.theta = 0.0f, .section_t = 2, .section_h = 2, .section_w = 2}};
    CHECK(rpe_test::throws_with(fwd, "[rpe.rope] theta = 0; expected finite and > 0"));
    // the fused attention's key_positions take the form's axes too
    r.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2}};
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = cview(x, shape);
    in.height = in.width = 2;
    in.rope = r;
    in.rope.key_positions = cview(pos, {n, 2});
    CHECK(rpe_test::throws_with([&] { rpe::attention_forward(in, mview(y, shape)); },
                                "[rpe.attention] rope key_positions has shape (4, 2); expected 3 axes (t, h, w), shape (4, 3)"));
    // the parameters are the table cache's key
    const rpe::rotary_embedding<float> a{.form =
                                             rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2}}};
    const rpe::rotary_embedding<float> c{
        .form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2, .interleaved = true}}};
    CHECK(rpe::rope_table_of(a, 12, 2, 2)->cos != rpe::rope_table_of(c, 12, 2, 2)->cos);
}

TEST_CASE("rope: Qwen2-VL's vision encoder RoPE is rope::cat, layout half, at the patches' (h, w) ids") {
    // not M-RoPE: 2D RoPE on (h, w) in the 2x2 merge-block order (transformers'
    // Qwen2VLVisionRotaryEmbedding + apply_rotary_pos_emb_vision)
    const auto dir = rpe_test::rope_golden_dir("qwen2vl_vision_d80_4x6");
    const auto m = rpe_test::read_meta<json>(dir);
    const std::int64_t b = m.at("batch"), h = m.at("heads"), l = m.at("L"), d = m.at("head_dim");
    const std::vector<std::int64_t> shape{b, h, l, d};
    rpe::rotary_embedding<float> r{.form = rpe::rope::cat{.temperature = m.at("temperature").get<float>()}};
    r.layout = rpe::rope::layout::half;
    const auto pos = load<float>(dir, "positions.npy", {l, 2});
    r.positions = cview(pos, {l, 2});
    const auto x = load<float>(dir, "x.npy", shape);
    std::vector<float> y(x.size());
    rpe::rope_forward(r, 1, 1, cview(x, shape), mview(y, shape));
    rpe_test::check_close(y, load<double>(dir, "y.npy", shape), 1e-6, 1e-5, "qwen2vl vision y");
}

}  // namespace rpe_unit_rope_mrope
