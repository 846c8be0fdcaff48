// The standalone terms (rpe::cpu::term_forward / term_backward over a descriptor, rpe::term,
// rpe::any_term) and the standalone RoPE rotation (rpe::rope_forward / rope_backward) on 16-bit
// storage, rpe::bf16 and rpe::f16 (each test a template over the two): the float kernels on float
// copies, each output rounded once. Checked: (1) bit for bit the float call's result rounded once,
// overwrite and accumulate, 1 or 2 threads; (2) against float64 on the same values (16-bit values
// are exact in float and double) within u·|ref| + 16·N·2^-24·max|ref| + tiny per tensor (u the one
// rounding, 2^-8 for bf16, 2^-11 for f16; tiny 2^-25 for f16, half its subnormal step, 1e-30 for
// bf16; N the longest float sum: D for a contextual forward, L for grad_x, B·H·L·L for a table's
// gradient); (3) errors name the argument.
#include <doctest/doctest.h>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu_paths.hpp"
#include "golden.hpp"
#include "half_checks.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_term_half {

namespace {

using rpe_test::cast_all;
using rpe_test::random_half;
using rpe_test::rounded_from;
using rpe_test::same_bits;
using rpe_test::shaped;
using rpe_test::worst_ratio;

// One standalone term call in H, float and double on the same values: forward and backward,
// overwrite and accumulate (see the file comment). Returns the worst ratio to the bound.
template <class H>
double check_term(const rpe::term_spec& spec, std::int64_t b, int height, int width, std::uint32_t seed) {
    const auto term = rpe::make_term<double>(spec);
    const rpe::term_desc& desc = *term;
    const auto ids = desc.bucket_ids(height, width);
    const std::int64_t h = spec.num_heads, d = spec.head_dim, l = ids->length();
    const bool value = spec.target == rpe::target::value;
    std::mt19937 rng(seed);
    const auto tshape = desc.table_shape();
    std::int64_t tsize = 1;
    for (auto e : tshape) tsize *= e;
    std::vector<std::vector<H>> tb;
    for (int t = 0; t < desc.num_tables(); ++t) tb.push_back(random_half<H>(rng, tsize, 0.5));
    const std::vector<std::int64_t> xshape{b, h, l, value ? l : d}, oshape{b, h, l, value ? d : l};
    const std::int64_t xsize = b * h * l * (value ? l : d), osize = b * h * l * (value ? d : l);
    const auto xb = spec.contextual ? random_half<H>(rng, xsize) : std::vector<H>{};
    const auto out0 = random_half<H>(rng, osize), gob = random_half<H>(rng, osize), gx0 = random_half<H>(rng, xsize),
               gt0 = random_half<H>(rng, tsize);
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
        std::vector<H> oh, gxh;
        std::vector<float> of, gxf;
        std::vector<double> od, gxd;
        std::vector<std::vector<H>> gth;
        std::vector<std::vector<float>> gtf;
        std::vector<std::vector<double>> gtd;
        run(H{}, mode, oh, gxh, gth);
        {  // one thread: the same bits
            std::vector<H> oh1, gxh1;
            std::vector<std::vector<H>> gth1;
            rpe_test::set_threads(1);
            run(H{}, mode, oh1, gxh1, gth1);
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

TEST_CASE_TEMPLATE(
    "16-bit standalone terms (rpe::cpu::term_forward / term_backward, rpe::term, any_term): float kernels "
    "rounded once",
    H, rpe::bf16, rpe::f16) {
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
        worst = std::max(worst, check_term<H>(spec, 2, 3, 4, ++seed));
    }
    MESSAGE(std::string(rpe_test::half_traits<H>::name) << " terms: worst |out - ref| / bound " << worst);

    // the compile-time term and its any_term take H too: the same bits as the descriptor's call, and
    // as the float term rounded
    namespace mapping = rpe::mapping;
    const mapping::product<> prod{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::key, H> t(
        prod, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    const auto ids = t.bucket_ids(3, 3);
    std::mt19937 rng(8);
    const auto shape = t.table_shape();
    const auto table = random_half<H>(rng, shape[0] * shape[1] * shape[2], 0.5);
    const std::int64_t l = 10;
    const auto x = random_half<H>(rng, 2 * l * 4);
    std::vector<H> a(static_cast<std::size_t>(2 * l * l)), b(a.size());
    const rpe::tensor_ref<const H> tv = shaped<const H>(table.data(), shape), xv(x.data(), {1, 2, l, 4});
    t.forward(*ids, tv, xv, rpe::tensor_ref<H>(a.data(), {1, 2, l, l}), rpe::write::overwrite);
    const auto any = rpe::make_any_term(t);
    const rpe::tensor_ref<const H> tabs[] = {tv};
    any->forward(*ids, tabs, xv, rpe::tensor_ref<H>(b.data(), {1, 2, l, l}), rpe::write::overwrite);
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
            t.forward(*ids, tv, xv, rpe::tensor_ref<H>(a.data(), {1, 2, l, l - 1}), rpe::write::overwrite);
        },
        "out has shape"));
    CHECK(rpe_test::throws_with(
        [&] {
            t.backward(*ids, tv, xv, rpe::tensor_ref<const H>(a.data(), {1, 2, l, l}), rpe::tensor_ref<H>(b.data(), {1, 2, l, 3}),
                       rpe::tensor_ref<H>{}, rpe::write::overwrite);
        },
        "grad_x"));
}

TEST_CASE_TEMPLATE(
    "16-bit standalone RoPE (rpe::rope_forward / rope_backward): the float rotation rounded once; rope::mixed frequency gradient",
    H, rpe::bf16, rpe::f16) {
    const std::int64_t b = 2, h = 2, d = 8;
    const int height = 3, width = 4, skip = 1;
    const std::int64_t l = skip + height * width;
    std::mt19937 rng(17);
    const auto x = random_half<H>(rng, b * h * l * d), gy = random_half<H>(rng, b * h * l * d),
               freqs = random_half<H>(rng, 2 * h * d / 2, 0.5);
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
        std::vector<H> yh, gxh, gfh;
        std::vector<float> yf, gxf, gff;
        std::vector<double> yd, gxd, gfd;
        run(H{}, yh, gxh, gfh);
        {  // one thread: the same bits
            std::vector<H> y1, gx1, gf1;
            rpe_test::set_threads(1);
            run(H{}, y1, gx1, gf1);
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
        // the double rotation's table holds cos/sin rounded to double, the float one's to float:
        // 2^-24 relative on each product, inside the bound's float term
        worst = std::max({worst, worst_ratio(yh, yd, 4), worst_ratio(gxh, gxd, 4)});
        if (mixed) worst = std::max(worst, worst_ratio(gfh, gfd, 2 * b * l * 4));
    }
    CHECK(worst <= 1.0);
    MESSAGE(std::string(rpe_test::half_traits<H>::name) << " RoPE: worst |y - ref| / bound " << worst);
    // bad shapes are refused naming the argument
    std::vector<H> y(x.size());
    const rpe::rotary_embedding<H> r{.form = rpe::rope::axial{.theta = 100.0f}, .skip = skip};
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::rope_forward(r, height, width, rpe::tensor_ref<const H>(x.data(), {b, h, l, d}),
                              rpe::tensor_ref<H>(y.data(), {b, h, l - 1, d}));
        },
        "y has shape"));
}

}  // namespace rpe_unit_term_half
