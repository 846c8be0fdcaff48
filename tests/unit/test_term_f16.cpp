// The standalone terms (rpe::cpu::term_forward / term_backward over a descriptor, rpe::term,
// rpe::any_term) and the standalone RoPE rotation (rpe::rope_forward / rope_backward) on rpe::f16
// storage: the float kernels on float copies, each output rounded to f16 once. Checked (as the
// bf16 ones in test_attention_bf16.cpp): (1) bit for bit the float call's result rounded once,
// overwrite and accumulate, 1 or 2 threads; (2) against float64 on the same values within
// u·|ref| + 2^-25 + 16·N·2^-24·max|ref| per tensor (u = 2^-11 the one f16 rounding, 2^-25 half the
// subnormal step, N the longest float sum: D for a contextual forward, L for grad_x, B·H·L·L for a
// table's gradient); (3) errors name the argument.
#include <doctest/doctest.h>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu_paths.hpp"
#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_term_f16 {

namespace {

using rpe::f16;
constexpr double u_f16 = 1.0 / 2048;  // 2^-11

template <class T>
std::vector<T> cast_all(const std::vector<f16>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<T>(x[i]);
    return out;
}

std::vector<f16> random_f16(std::mt19937& rng, std::int64_t n, double sigma = 1.0) {
    std::normal_distribution<double> normal(0.0, sigma);
    std::vector<f16> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = f16(static_cast<float>(normal(rng)));
    return x;
}

template <class T>
rpe::tensor_ref<T> shaped(T* data, const std::vector<std::int64_t>& shape) {
    rpe::tensor_ref<T> r;
    r.data = data;
    r.rank = static_cast<int>(shape.size());
    for (std::size_t i = 0; i < shape.size(); ++i) r.shape[i] = shape[i];
    return r;
}

bool same_bits(const std::vector<f16>& a, const std::vector<f16>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

bool rounded_from(const std::vector<f16>& got, const std::vector<float>& f) {
    if (got.size() != f.size()) return false;
    for (std::size_t i = 0; i < f.size(); ++i)
        if (got[i].bits != f16(f[i]).bits) return false;
    return true;
}

double worst_ratio(const std::vector<f16>& got, const std::vector<double>& ref, std::int64_t n_sum) {
    REQUIRE(got.size() == ref.size());
    double most = 0;
    for (double r : ref) most = std::max(most, std::fabs(r));
    const double floor = 16.0 * static_cast<double>(n_sum) * 0x1p-24 * most + 0x1p-25;
    double worst = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
        const double g = static_cast<double>(got[i]);
        REQUIRE(std::isfinite(g));
        worst = std::max(worst, std::fabs(g - ref[i]) / (u_f16 * std::fabs(ref[i]) + floor));
    }
    return worst;
}

// One standalone term call in f16, float and double on the same values: forward and backward,
// overwrite and accumulate (see the file comment). Returns the worst ratio to the bound.
double check_term_f16(const rpe::term_spec& spec, std::int64_t b, int height, int width, std::uint32_t seed) {
    const auto term = rpe::make_term<double>(spec);
    const rpe::term_desc& desc = *term;
    const auto ids = desc.bucket_ids(height, width);
    const std::int64_t h = spec.num_heads, d = spec.head_dim, l = ids->length();
    const bool value = spec.target == rpe::target::value;
    std::mt19937 rng(seed);
    const auto tshape = desc.table_shape();
    std::int64_t tsize = 1;
    for (auto e : tshape) tsize *= e;
    std::vector<std::vector<f16>> tb;
    for (int t = 0; t < desc.num_tables(); ++t) tb.push_back(random_f16(rng, tsize, 0.5));
    const std::vector<std::int64_t> xshape{b, h, l, value ? l : d}, oshape{b, h, l, value ? d : l};
    const std::int64_t xsize = b * h * l * (value ? l : d), osize = b * h * l * (value ? d : l);
    const auto xb = spec.contextual ? random_f16(rng, xsize) : std::vector<f16>{};
    const auto out0 = random_f16(rng, osize), gob = random_f16(rng, osize), gx0 = random_f16(rng, xsize),
               gt0 = random_f16(rng, tsize);
    auto run = [&]<class T>(T, rpe::write mode, std::vector<T>& out, std::vector<T>& gx, std::vector<std::vector<T>>& gt) {
        std::vector<std::vector<T>> tabs;
        std::vector<rpe::tensor_ref<const T>> tv;
        tabs.reserve(tb.size());
        for (const auto& t : tb) {
            tabs.push_back(cast_all<T>(t));
            tv.push_back(shaped<const T>(tabs.back().data(), tshape));
        }
        const auto x = cast_all<T>(xb), go = cast_all<T>(gob);
        const rpe::tensor_ref<const T> xv = spec.contextual ? shaped<const T>(x.data(), xshape) : rpe::tensor_ref<const T>{};
        out = cast_all<T>(out0);
        rpe::cpu::term_forward<T>(desc, *ids, tv, xv, shaped<T>(out.data(), oshape), mode);
        gx = spec.contextual ? cast_all<T>(gx0) : std::vector<T>{};
        gt.assign(tb.size(), cast_all<T>(gt0));
        std::vector<rpe::tensor_ref<T>> gtv;
        for (auto& g : gt) gtv.push_back(shaped<T>(g.data(), tshape));
        rpe::cpu::term_backward<T>(desc, *ids, tv, xv, shaped<const T>(go.data(), oshape),
                                   spec.contextual ? shaped<T>(gx.data(), xshape) : rpe::tensor_ref<T>{}, gtv, mode);
    };
    double worst = 0;
    for (const auto mode : {rpe::write::overwrite, rpe::write::accumulate}) {
        CAPTURE(static_cast<int>(mode));
        std::vector<f16> oh, gxh;
        std::vector<float> of, gxf;
        std::vector<double> od, gxd;
        std::vector<std::vector<f16>> gth;
        std::vector<std::vector<float>> gtf;
        std::vector<std::vector<double>> gtd;
        run(f16{}, mode, oh, gxh, gth);
        {  // one thread: the same bits
            std::vector<f16> oh1, gxh1;
            std::vector<std::vector<f16>> gth1;
            rpe_test::set_threads(1);
            run(f16{}, mode, oh1, gxh1, gth1);
            rpe_test::set_threads(2);
            CHECK(same_bits(oh, oh1));
            CHECK(same_bits(gxh, gxh1));
            for (std::size_t t = 0; t < gth.size(); ++t) CHECK(same_bits(gth[t], gth1[t]));
        }
        run(0.0f, mode, of, gxf, gtf);
        run(0.0, mode, od, gxd, gtd);
        CHECK(rounded_from(oh, of));
        CHECK(rounded_from(gxh, gxf));
        for (std::size_t t = 0; t < gth.size(); ++t) CHECK(rounded_from(gth[t], gtf[t]));
        worst = std::max(worst, worst_ratio(oh, od, d + 2));
        if (spec.contextual) worst = std::max(worst, worst_ratio(gxh, gxd, l + 2));
        for (std::size_t t = 0; t < gth.size(); ++t) worst = std::max(worst, worst_ratio(gth[t], gtd[t], b * h * l * l + 1));
    }
    CHECK(worst <= 1.0);
    return worst;
}

}  // namespace

TEST_CASE("f16 standalone terms (rpe::cpu::term_forward / term_backward, rpe::term, any_term): float kernels rounded once") {
    struct config {
        rpe::method method;
        bool contextual;
        rpe::target target;
        bool shared;
        int skip;
    };
    const config configs[] = {
        {rpe::method::product, true, rpe::target::key, false, 1},   {rpe::method::product, true, rpe::target::query, true, 1},
        {rpe::method::product, true, rpe::target::value, false, 0}, {rpe::method::euclidean, false, rpe::target::key, false, 1},
        {rpe::method::cross, true, rpe::target::key, true, 2},      {rpe::method::cross, false, rpe::target::query, false, 0},
    };
    double worst = 0;
    std::uint32_t seed = 3;
    for (const auto& cf : configs) {
        rpe::term_spec spec;
        spec.method = cf.method;
        spec.contextual = cf.contextual;
        spec.target = cf.target;
        spec.ratio(1.9);
        spec.shared_head = cf.shared;
        spec.skip = cf.skip;
        spec.num_heads = 3;
        spec.head_dim = 8;
        CAPTURE(static_cast<int>(cf.method));
        CAPTURE(static_cast<int>(cf.target));
        worst = std::max(worst, check_term_f16(spec, 2, 3, 4, ++seed));
    }
    MESSAGE("f16 terms: worst |out - ref| / bound " << worst);

    // the compile-time term and its any_term take f16 too: the same bits as the float term rounded
    namespace mapping = rpe::mapping;
    const mapping::product<> prod{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::key, f16> t(
        prod, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    const auto ids = t.bucket_ids(3, 3);
    std::mt19937 rng(8);
    const auto shape = t.table_shape();
    const auto table = random_f16(rng, shape[0] * shape[1] * shape[2], 0.5);
    const std::int64_t l = 10;
    const auto x = random_f16(rng, 2 * l * 4);
    std::vector<f16> a(static_cast<std::size_t>(2 * l * l)), b(a.size());
    const rpe::tensor_ref<const f16> tv = shaped<const f16>(table.data(), shape), xv(x.data(), {1, 2, l, 4});
    t.forward(*ids, tv, xv, rpe::tensor_ref<f16>(a.data(), {1, 2, l, l}), rpe::write::overwrite);
    const auto any = rpe::make_any_term(t);
    const rpe::tensor_ref<const f16> tabs[] = {tv};
    any->forward(*ids, tabs, xv, rpe::tensor_ref<f16>(b.data(), {1, 2, l, l}), rpe::write::overwrite);
    CHECK(same_bits(a, b));
    std::vector<float> tf = cast_all<float>(table), xf = cast_all<float>(x), of(a.size());
    const rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::key, float> tfl(
        prod, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    tfl.forward(*ids, shaped<const float>(tf.data(), shape), rpe::tensor_ref<const float>(xf.data(), {1, 2, l, 4}),
                rpe::tensor_ref<float>(of.data(), {1, 2, l, l}), rpe::write::overwrite);
    CHECK(rounded_from(a, of));
    // errors name the argument, as in float
    CHECK(rpe_test::throws_with(
        [&] {
            t.forward(*ids, tv, xv, rpe::tensor_ref<f16>(a.data(), {1, 2, l, l - 1}), rpe::write::overwrite);
        },
        "out has shape"));
    CHECK(rpe_test::throws_with(
        [&] {
            t.backward(*ids, tv, xv, rpe::tensor_ref<const f16>(a.data(), {1, 2, l, l}),
                       rpe::tensor_ref<f16>(b.data(), {1, 2, l, 3}), rpe::tensor_ref<f16>{}, rpe::write::overwrite);
        },
        "grad_x"));
}

TEST_CASE(
    "f16 standalone RoPE (rpe::rope_forward / rope_backward): the float rotation rounded once; rope::mixed frequency gradient") {
    const std::int64_t b = 2, h = 2, d = 8;
    const int height = 3, width = 4, skip = 1;
    const std::int64_t l = skip + height * width;
    std::mt19937 rng(17);
    const auto x = random_f16(rng, b * h * l * d), gy = random_f16(rng, b * h * l * d),
               freqs = random_f16(rng, 2 * h * d / 2, 0.5);
    double worst = 0;
    for (const bool mixed : {false, true}) {
        CAPTURE(mixed);
        auto run = [&]<class T>(T, std::vector<T>& y, std::vector<T>& gx, std::vector<T>& gf) {
            const auto xt = cast_all<T>(x), gyt = cast_all<T>(gy), ft = cast_all<T>(freqs);
            rpe::rotary_embedding<T> r;
            r.skip = skip;
            if (mixed) {
                r.form = rpe::rope::mixed{};
                r.freqs = rpe::tensor_ref<const T>(ft.data(), {2, h, d / 2});
                gf.assign(ft.size(), T(-3.0f));
                r.grad_freqs = rpe::tensor_ref<T>(gf.data(), {2, h, d / 2});
            } else {
                r.form = rpe::rope::axial{.theta = 100.0f};
            }
            y.assign(xt.size(), T(-3.0f));
            gx.assign(xt.size(), T(-3.0f));
            rpe::rope_forward(r, height, width, rpe::tensor_ref<const T>(xt.data(), {b, h, l, d}),
                              rpe::tensor_ref<T>(y.data(), {b, h, l, d}));
            rpe::rope_backward(r, height, width, rpe::tensor_ref<const T>(xt.data(), {b, h, l, d}),
                               rpe::tensor_ref<const T>(gyt.data(), {b, h, l, d}), rpe::tensor_ref<T>(gx.data(), {b, h, l, d}));
        };
        std::vector<f16> yh, gxh, gfh;
        std::vector<float> yf, gxf, gff;
        std::vector<double> yd, gxd, gfd;
        run(f16{}, yh, gxh, gfh);
        {  // one thread: the same bits
            std::vector<f16> y1, gx1, gf1;
            rpe_test::set_threads(1);
            run(f16{}, y1, gx1, gf1);
            rpe_test::set_threads(2);
            CHECK(same_bits(yh, y1));
            CHECK(same_bits(gxh, gx1));
            CHECK(same_bits(gfh, gf1));
        }
        run(0.0f, yf, gxf, gff);
        run(0.0, yd, gxd, gfd);
        CHECK(rounded_from(yh, yf));
        CHECK(rounded_from(gxh, gxf));
        CHECK(rounded_from(gfh, gff));
        worst = std::max({worst, worst_ratio(yh, yd, 4), worst_ratio(gxh, gxd, 4)});
        if (mixed) worst = std::max(worst, worst_ratio(gfh, gfd, 2 * b * l * 4));
    }
    CHECK(worst <= 1.0);
    MESSAGE("f16 RoPE: worst |y - ref| / bound " << worst);
    std::vector<f16> y(x.size());
    const rpe::rotary_embedding<f16> r{.form = rpe::rope::axial{.theta = 100.0f}, .skip = skip};
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::rope_forward(r, height, width, rpe::tensor_ref<const f16>(x.data(), {b, h, l, d}),
                              rpe::tensor_ref<f16>(y.data(), {b, h, l - 1, d}));
        },
        "y has shape"));
}

}  // namespace rpe_unit_term_f16
