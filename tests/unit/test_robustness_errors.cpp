// Robustness (docs/errors.md): aliasing between gradient buffers, null buffers that carry a
// shape, messages that name the right parameter, and the numerical edge cases (huge logits,
// NaN inputs, denormals) with their documented behaviour.
#include <doctest/doctest.h>
#include <rpe/io/npy.hpp>
#include <rpe/rpe.hpp>

#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_robustness_errors {

namespace {

using rpe::target;
using rpe::index::piecewise;
using rpe_test::cview;
using rpe_test::mview;
using rpe_test::throws_with;
namespace mapping = rpe::mapping;
namespace mode = rpe::mode;

const piecewise r19 = piecewise::from_ratio(1.9);

using key_term = rpe::term<mapping::product<>, mode::contextual, target::key, double>;
using cross_key_term = rpe::term<mapping::cross<>, mode::contextual, target::key, double>;
using bias_term = rpe::term<mapping::product<>, mode::bias, target::key, double>;

bool all_equal(const std::vector<double>& v, double x) {
    for (double e : v)
        if (e != x) return false;
    return true;
}

// One attention setup: B=2, H=2, L=13 (skip 1 + 3x4), D=3, contextual key and value terms (float or double).
template <class S>
struct attention_setup {
    std::int64_t b = 2, h = 2, l = 13, d = 3;
    std::unique_ptr<rpe::any_term<S>> tk, tv;
    std::vector<S> q, k, v, go, tab_k, tab_v;
    rpe::attention_inputs<S> in;
    explicit attention_setup(double scale = 1.0) {
        tk = rpe::make_any_term(rpe::term<mapping::product<>, mode::contextual, target::key, S>(
            mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3, .skip = 1}));
        tv = rpe::make_any_term(rpe::term<mapping::product<>, mode::contextual, target::value, S>(
            mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3, .skip = 1}));
        auto gen = [&](std::size_t n, unsigned seed) {
            const auto r = rpe_test::random_normal<double>(n, seed);
            std::vector<S> out(n);
            for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<S>(r[i] * scale);
            return out;
        };
        q = gen(static_cast<std::size_t>(b * h * l * d), 1);
        k = gen(q.size(), 2);
        v = gen(q.size(), 3);
        go = gen(q.size(), 4);
        tab_k = gen(static_cast<std::size_t>(d * tk->num_buckets()), 5);
        tab_v = gen(static_cast<std::size_t>(d * tv->num_buckets()), 6);
        in.q = cview(q, {b, h, l, d});
        in.k = cview(k, {b, h, l, d});
        in.v = cview(v, {b, h, l, d});
        in.height = 3;
        in.width = 4;
        in.rpe_k = {tk.get(), {cview(tab_k, {1, d, tk->num_buckets()})}, {}};
        in.rpe_v = {tv.get(), {cview(tab_v, {1, tv->num_buckets(), d})}, {}};
    }
    [[nodiscard]] std::vector<std::int64_t> shape() const { return {b, h, l, d}; }
};

}  // namespace

TEST_CASE("errors: term backward rejects every aliasing between its outputs and inputs, and writes nothing") {
    rpe_test::term_problem<key_term> p(
        key_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3, .shared_head = false, .skip = 1}), 2, 3, 4, 7);
    std::vector<std::vector<double>> gt;
    auto grads = p.grad_refs(gt);
    std::vector<double> gx(p.x.size(), -5.0);
    const auto g_out = cview(p.grad_out, p.oshape);
    std::vector<double> big(p.x.size() + p.tables[0].size() + 64, -5.0);  // one buffer to carve overlapping views from
    SUBCASE("grad_x inside a table") {
        std::vector<double> tab = p.tables[0];
        tab.resize(std::max(tab.size(), p.x.size()));
        auto tab_ref = p.table_refs();
        tab_ref[0].data = tab.data();
        CHECK(throws_with(
            [&] { p.term.backward(*p.ids, tab_ref, p.x_ref(), g_out, mview(tab, p.xshape), grads, rpe::write::overwrite); },
            "grad_x overlaps tables[0]"));
    }
    SUBCASE("grad_x over grad_tables") {
        grads[0].data = big.data() + 8;
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, p.table_refs(), p.x_ref(), g_out, mview(big, p.xshape), grads, rpe::write::overwrite);
            },
            "grad_x overlaps grad_tables[0]"));
        CHECK(all_equal(big, -5.0));
    }
    SUBCASE("grad_tables over x") {
        std::vector<double> x = p.x;
        x.resize(x.size() + gt[0].size());
        grads[0].data = x.data() + 1;
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, p.table_refs(), cview(x, p.xshape), g_out, mview(gx, p.xshape), grads,
                                rpe::write::overwrite);
            },
            "grad_tables[0] overlaps x"));
        CHECK(all_equal(gx, -5.0));
    }
    SUBCASE("a null gradient buffer that carries a shape is an error, not skipped") {
        grads[0].data = nullptr;
        CHECK(throws_with(
            [&] { p.term.backward(*p.ids, p.table_refs(), p.x_ref(), g_out, mview(gx, p.xshape), grads, rpe::write::overwrite); },
            "grad_tables[0] is a null buffer"));
        rpe::tensor_ref<double> null_gx = mview(gx, p.xshape);
        null_gx.data = nullptr;
        CHECK(throws_with(
            [&] { p.term.backward(*p.ids, p.table_refs(), p.x_ref(), g_out, null_gx, p.grad_refs(gt), rpe::write::overwrite); },
            "grad_x is a null buffer"));
        CHECK(all_equal(gx, -5.0));
    }
}

TEST_CASE("errors: Cross gradient tables must not share memory; bias backward takes no grad_x") {
    rpe_test::term_problem<cross_key_term> p(cross_key_term(mapping::cross<>{r19}, {.num_heads = 1, .head_dim = 2}), 1, 3, 3, 9);
    std::vector<std::vector<double>> gt;
    auto grads = p.grad_refs(gt);
    grads[1].data = grads[0].data;
    std::vector<double> gx(p.x.size());
    CHECK(throws_with(
        [&] {
            p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), mview(gx, p.xshape), grads,
                            rpe::write::overwrite);
        },
        "grad_tables[1] overlaps grad_tables[0]"));

    rpe_test::term_problem<bias_term> b(bias_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3}), 1, 3, 3, 9);
    std::vector<std::vector<double>> bg;
    std::vector<double> junk(16);
    CHECK(throws_with(
        [&] {
            b.term.backward(*b.ids, b.table_refs(), {}, cview(b.grad_out, b.oshape), mview(junk, {16}), b.grad_refs(bg),
                            rpe::write::overwrite);
        },
        "grad_x must be empty"));
}

TEST_CASE("errors: attention backward rejects gradient tables aliasing outputs or each other, before writing") {
    attention_setup<double> a;
    const auto shape = a.shape();
    const std::size_t n = a.q.size();
    std::vector<double> gq(n, -5.0), gk(n, -5.0), gv(n, -5.0), attn(static_cast<std::size_t>(a.b * a.h * a.l * a.l));
    std::vector<double> out(n);
    rpe::composed_attention_forward(a.in, mview(out, shape), mview(attn, {a.b, a.h, a.l, a.l}));
    std::vector<double> gtk(a.tab_k.size(), -5.0), gtv(a.tab_v.size(), -5.0);
    const auto tk_shape = a.tk->table_shape(), tv_shape = a.tv->table_shape();
    auto both = [&](const char* expected) {
        CHECK(throws_with(
            [&] { rpe::attention_backward(a.in, cview(a.go, shape), mview(gq, shape), mview(gk, shape), mview(gv, shape)); },
            expected));
        CHECK(throws_with(
            [&] {
                rpe::composed_attention_backward(a.in, {.grad_out = cview(a.go, shape),
                                                        .grad_q = mview(gq, shape),
                                                        .grad_k = mview(gk, shape),
                                                        .grad_v = mview(gv, shape),
                                                        .saved_attn = cview(attn, {a.b, a.h, a.l, a.l})});
            },
            expected));
        CHECK(all_equal(gq, -5.0));
        CHECK(all_equal(gk, -5.0));
        CHECK(all_equal(gv, -5.0));
    };
    SUBCASE("a key table gradient over grad_q") {
        std::vector<double> shared(std::max(n, gtk.size()) + 8, -5.0);
        a.in.rpe_k.grad_tables = {rpe::tensor_ref<double>(shared.data(), {1, 3, a.tk->num_buckets()})};
        gq.assign(n, -5.0);
        CHECK(throws_with(
            [&] { rpe::attention_backward(a.in, cview(a.go, shape), mview(shared, shape), mview(gk, shape), mview(gv, shape)); },
            "overlaps grad_q"));
    }
    SUBCASE("two terms' table gradients in one buffer") {
        std::vector<double> one(gtk.size() + gtv.size(), -5.0);
        a.in.rpe_k.grad_tables = {rpe::tensor_ref<double>(one.data(), {tk_shape[0], tk_shape[1], tk_shape[2]})};
        a.in.rpe_v.grad_tables = {rpe::tensor_ref<double>(one.data() + 3, {tv_shape[0], tv_shape[1], tv_shape[2]})};
        both("rpe_v grad_tables[0] overlaps rpe_k grad_tables[0]");
        CHECK(all_equal(one, -5.0));
    }
    SUBCASE("the value table gradient over grad_out") {
        std::vector<double> go2 = a.go;
        go2.resize(n + gtv.size());
        a.in.rpe_v.grad_tables = {rpe::tensor_ref<double>(go2.data() + 2, {tv_shape[0], tv_shape[1], tv_shape[2]})};
        CHECK(throws_with(
            [&] {
                rpe::composed_attention_backward(a.in, {.grad_out = cview(go2, shape),
                                                        .grad_q = mview(gq, shape),
                                                        .grad_k = mview(gk, shape),
                                                        .grad_v = mview(gv, shape),
                                                        .saved_attn = cview(attn, {a.b, a.h, a.l, a.l})});
            },
            "rpe_v grad_tables[0] overlaps grad_out"));
        CHECK(all_equal(gv, -5.0));  // grad_v is not written before the check (it was)
    }
    SUBCASE("a null table gradient that carries a shape") {
        a.in.rpe_k.grad_tables = {rpe::tensor_ref<double>(nullptr, {1, 3, a.tk->num_buckets()})};
        both("rpe_k grad_tables[0] is a null buffer");
    }
}

namespace {

// The composed backward takes its tensors by name (rpe::attention_gradients), as the fused one: the
// positional (attn, grad_out, grad_q, grad_k, grad_v) form, two same-typed views in a row, is gone.
template <class S>
concept composed_backward_positional = requires(const rpe::attention_inputs<S>& in, rpe::tensor_ref<const S> c,
                                                rpe::tensor_ref<S> m) {
    rpe::composed_attention_backward(in, c, c, m, m, m);
};
template <class S>
concept composed_backward_by_name = requires(const rpe::attention_inputs<S>& in, const rpe::attention_gradients<S>& g) {
    rpe::composed_attention_backward(in, g, rpe::attention_options{});
};
static_assert(!composed_backward_positional<float> && !composed_backward_positional<double>);
static_assert(composed_backward_by_name<float> && composed_backward_by_name<double>);

}  // namespace

TEST_CASE("errors: messages name the right parameter (k blamed for q's shape, broadcast heads, B = 0)") {
    attention_setup<double> a;
    std::vector<double> q2(a.q.size());
    a.in.q = cview(q2, {2, 1, 13, 6});  // q has another head count: k must match q
    std::vector<double> out(a.q.size());
    CHECK(throws_with(
        [&] {
            rpe::attention_forward(a.in, mview(out, {2, 1, 13, 6}));
        },
        "k has shape (2, 2, 13, 3); expected (2, 1, L_k >= 1, 6): B, H, D of q (2, 1, 13, 6)"));
    rpe_test::term_problem<bias_term> b(bias_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3, .shared_head = false}),
                                        1, 3, 3, 9);
    std::vector<double> o(9 * 9 * 3);
    CHECK(throws_with(
        [&] {
            b.term.forward(*b.ids, b.table_refs(), {}, mview(o, {1, 3, 9, 9}), rpe::write::overwrite);
        },
        "expected (B >= 1, 2, L, L)"));
    rpe_test::term_problem<key_term> k(key_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 3}), 1, 3, 3, 9);
    std::vector<double> none;
    CHECK(throws_with(
        [&] {
            k.term.forward(*k.ids, k.table_refs(), cview(none, {0, 2, 9, 3}), mview(none, {0, 2, 9, 9}), rpe::write::overwrite);
        },
        "x has shape (0, 2, 9, 3); expected (B >= 1, 2, 9, 3)"));
}

namespace {
// A mapping with the largest bucket count an int holds: with a skip bucket, K no longer fits.
struct huge_mapping {
    int num_buckets() const { return 2147483647; }
    int bucket(int, int) const { return 0; }
    friend bool operator==(const huge_mapping&, const huge_mapping&) = default;
};
}  // namespace

TEST_CASE("errors: K too large for the id type or for int") {
    CHECK(throws_with<rpe::out_of_range>([] { (void)rpe::build_bucket_ids(huge_mapping{}, 2, 2, 1); },
                                         "num_buckets = 2147483648 does not fit the id type"));
    CHECK(throws_with(
        [] {
            (void)rpe::term<huge_mapping, mode::contextual, target::key>(huge_mapping{},
                                                                         {.num_heads = 1, .head_dim = 1, .skip = 1});
        },
        "num_buckets = 2147483648"));
    CHECK(throws_with([] { mapping::product<rpe::index::clip>{rpe::index::clip{40000}}.validate(); }, "beta_int = 40000"));
}

// A custom index function that accepts any β: num_buckets() reports the count itself.
struct lenient_clip {
    double beta = 0;
    constexpr int beta_int() const { return rpe::detail::saturating_int(beta); }
    constexpr int operator()(std::int64_t x) const {
        return static_cast<int>(x < -beta_int() ? -beta_int() : (x > beta_int() ? beta_int() : x));
    }
    int operator()(float x) const { return (*this)(static_cast<std::int64_t>(x)); }
    void validate() const {}
    friend constexpr bool operator==(const lenient_clip&, const lenient_clip&) = default;
};

TEST_CASE("errors: a bucket count that overflows int throws from num_buckets(), before validate() is called") {
    // β beyond int (undefined conversion before) and counts beyond 2^31 (wrapped before): the
    // mapping's own validate() names the parameter
    CHECK(throws_with(
        [] {
            (void)mapping::product{rpe::index::piecewise{1.9, 1e300, 2e300}}.num_buckets();
        },
        "[rpe.index.piecewise] beta = 1.0000000000000001e+300 must be < 2^30"));
    CHECK(
        throws_with([] { (void)mapping::euclidean{rpe::index::clip{3e9}}.num_buckets(); }, "[rpe.index.clip] beta = 3000000000"));
    CHECK(throws_with([] { (void)mapping::product<rpe::index::clip>{rpe::index::clip{40000}}.num_buckets(); },
                      "[rpe.mapping.product] beta_int = 40000 gives (2*beta_int+1)^2 = 6400160001 buckets"));
    CHECK(throws_with(
        [] {
            (void)mapping::product3d<>{.time = {1.9, 5e7, 6e7}}.num_buckets();
        },
        "[rpe.mapping.product3d] beta_int (time, row, col) = (50000000, 3, 3)"));
    CHECK(throws_with([] { (void)mapping::shaw{.k = 2000000000}.num_buckets(); }, "[rpe.mapping.shaw] k = 2000000000"));
    CHECK(throws_with([] { (void)mapping::swin{.window_h = 100000, .window_w = 100000}.num_buckets(); },
                      "[rpe.mapping.swin] window_h = 100000"));
    CHECK(throws_with([] { (void)mapping::beit{.window_h = 0}.num_buckets(); }, "[rpe.mapping.beit] window_h = 0"));
    // parameters that pass validate() but not the count: the count's own message
    CHECK(throws_with([] { (void)mapping::product<lenient_clip>{lenient_clip{40000}}.num_buckets(); },
                      "[rpe.mapping.product] beta_int = 40000 gives (2*beta_int+1)^2 = 6400160001 buckets"));
    CHECK(throws_with([] { (void)mapping::cross<lenient_clip>{lenient_clip{1e10}}.num_buckets(); },
                      "[rpe.mapping.cross] num_buckets = 2*beta_int+1 = 4294967295 does not fit in int; "
                      "expected at most 2^31 - 1 buckets"));
    CHECK(throws_with([] { (void)mapping::euclidean<lenient_clip>{lenient_clip{1e10}}.num_buckets(); },
                      "num_buckets = 2*beta_int+1 = 4294967295 does not fit in int"));
    // the largest valid counts are unchanged
    CHECK(mapping::product<rpe::index::clip>{rpe::index::clip{23169}}.num_buckets() == 46339 * 46339);
    CHECK(mapping::euclidean<rpe::index::clip>{rpe::index::clip{1073741823}}.num_buckets() == 2147483647);
    CHECK(rpe::index::piecewise{1.9, 1e300, 2e300}.beta_int() == 2147483647);  // saturated, no UB
    CHECK(rpe::index::clip{std::nan("")}.beta_int() == 0);
    // a NaN β gives beta_int() = 0, a count that fits: num_buckets() still refuses it, naming β
    CHECK(throws_with(
        [] {
            (void)mapping::cross{rpe::index::piecewise{1.9, std::nan(""), 15.2}}.num_buckets();
        },
        "[rpe.index.piecewise] beta = nan must be finite"));
}

TEST_CASE("errors: num_buckets() and validate() agree (T5 counts, NaN beta, product3d at 2^31 - 1)") {
    // T5: a negative or too small count throws from num_buckets() as from validate(), naming it
    for (const int n : {-3, 0, 3}) {
        const mapping::t5 m{.buckets = n};
        const std::string msg =
            "[rpe.mapping.t5] num_buckets = " + std::to_string(n) + "; expected [4, 2^30) for bidirectional buckets";
        CHECK(throws_with([&] { m.validate(); }, msg.c_str()));
        CHECK(throws_with([&] { (void)m.num_buckets(); }, msg.c_str()));
    }
    CHECK(throws_with([] { (void)mapping::t5{.buckets = -1, .bidirectional = false}.num_buckets(); },
                      "[rpe.mapping.t5] num_buckets = -1; expected [2, 2^30) for causal buckets"));
    CHECK(mapping::t5{}.num_buckets() == 32);
    static_assert(mapping::t5{.buckets = -3}.num_buckets() == -3);  // constant evaluation only multiplies
    // NaN β, every index-based mapping: both name β
    const rpe::index::clip nan_clip{std::nan("")};
    CHECK(throws_with([&] { (void)mapping::euclidean<rpe::index::clip>{nan_clip}.num_buckets(); },
                      "[rpe.index.clip] beta = nan must be finite"));
    CHECK(throws_with([&] { (void)mapping::quantization<rpe::index::clip>{nan_clip}.num_buckets(); },
                      "[rpe.index.clip] beta = nan must be finite"));
    CHECK(throws_with([&] { (void)mapping::product<rpe::index::clip>{nan_clip}.num_buckets(); },
                      "[rpe.index.clip] beta = nan must be finite"));
    CHECK(throws_with([&] { mapping::product<rpe::index::clip>{nan_clip}.validate(); },
                      "[rpe.index.clip] beta = nan must be finite"));
    // product3d: exactly 2^31 - 1 buckets (spans 1, 1, 2^31 - 1) is valid for both; one more span is not
    const mapping::product3d<rpe::index::clip> largest{.time = {0.0}, .row = {0.0}, .col = {1073741823.0}};
    CHECK_NOTHROW(largest.validate());
    CHECK(largest.num_buckets() == 2147483647);
    const mapping::product3d<rpe::index::clip> over{.time = {1.0}, .row = {0.0}, .col = {1073741823.0}};
    CHECK(throws_with([&] { over.validate(); },
                      "[rpe.mapping.product3d] beta_int (time, row, col) = (1, 0, 1073741823) gives 3*1*2147483647 buckets; "
                      "expected at most 2^31 - 1"));
    CHECK(
        throws_with([&] { (void)over.num_buckets(); }, "[rpe.mapping.product3d] beta_int (time, row, col) = (1, 0, 1073741823)"));
}

TEST_CASE_TEMPLATE("numerics: huge logits (1e30) give exact one-hot rows, never NaN", S, float, double) {
    attention_setup<S> a;
    const auto shape = a.shape();
    const std::int64_t l = a.l;
    std::vector<S> mask(static_cast<std::size_t>(l * l), S(0));
    for (std::int64_t i = 0; i < l; ++i) {
        mask[static_cast<std::size_t>(i * l + (i * 5) % l)] = S(1e30);              // one huge logit per row
        if (i % 2) mask[static_cast<std::size_t>(i * l + (i + 1) % l)] = S(-1e30);  // and a hugely negative one
    }
    a.in.attn_mask = cview(mask, {l, l});
    std::vector<S> fused(a.q.size()), composed(a.q.size()), attn(static_cast<std::size_t>(a.b * a.h * l * l));
    rpe::attention_forward(a.in, mview(fused, shape), mview(attn, {a.b, a.h, l, l}));
    int bad = 0;
    for (std::int64_t p = 0; p < a.b * a.h; ++p)
        for (std::int64_t i = 0; i < l; ++i)
            for (std::int64_t j = 0; j < l; ++j)
                bad += attn[static_cast<std::size_t>((p * l + i) * l + j)] != (j == (i * 5) % l ? S(1) : S(0));
    CHECK(bad == 0);
    rpe::composed_attention_forward(a.in, mview(composed, shape), mview(attn, {a.b, a.h, l, l}));
    for (const auto x : fused) REQUIRE(std::isfinite(x));
    CHECK(rpe_test::max_abs_diff(fused, composed) < 1e-5);
}

TEST_CASE("numerics: a NaN input spoils only its own (batch, head) plane, forward and backward") {
    attention_setup<double> clean, dirty;
    dirty.q[5] = std::numeric_limits<double>::quiet_NaN();  // batch 0, head 0, token 1
    const auto shape = clean.shape();
    const std::size_t n = clean.q.size(), plane = static_cast<std::size_t>(clean.l * clean.d);
    auto run = [&](attention_setup<double>& a) {
        std::vector<std::vector<double>> r(4, std::vector<double>(n));
        rpe::attention_forward(a.in, mview(r[0], shape));
        rpe::attention_backward(a.in, cview(a.go, shape), mview(r[1], shape), mview(r[2], shape), mview(r[3], shape));
        return r;
    };
    const auto c = run(clean), d = run(dirty);
    // out: only row 1 of plane 0 is NaN
    for (std::size_t e = 0; e < n; ++e) {
        const bool in_row = e / static_cast<std::size_t>(clean.d) == 1;
        CHECK_MESSAGE(std::isnan(d[0][e]) == in_row, e);
        if (!in_row) CHECK(d[0][e] == c[0][e]);
    }
    // gradients: NaN within plane 0 (every key sees the NaN row), the other planes exactly as without it
    for (int g = 1; g < 4; ++g)
        for (std::size_t e = plane; e < n; ++e) REQUIRE(d[static_cast<std::size_t>(g)][e] == c[static_cast<std::size_t>(g)][e]);
    CHECK(std::isnan(d[2][0]));
}

TEST_CASE("numerics: denormal inputs give finite results equal to the double computation") {
    attention_setup<float> f(1e-39);  // every input is a float denormal (below 1.18e-38)
    attention_setup<double> dd(1e-39);
    REQUIRE(std::fpclassify(f.q[0]) == FP_SUBNORMAL);
    const auto shape = f.shape();
    std::vector<float> out(f.q.size());
    std::vector<double> ref(dd.q.size());
    rpe::attention_forward(f.in, mview(out, shape));
    rpe::attention_forward(dd.in, mview(ref, shape));
    double worst = 0;
    for (std::size_t e = 0; e < out.size(); ++e) {
        REQUIRE(std::isfinite(out[e]));
        worst = std::max(worst, std::fabs(static_cast<double>(out[e]) - ref[e]));
    }
    CHECK(worst < 1e-43);  // the float results are the denormal averages, to some 70 denormal steps (1.4e-45 each)
}

TEST_CASE("errors: grids whose per-offset ids overflow 32-bit sizes are refused, not UB") {
    // width near INT_MAX: 2W - 1 overflows int; the per-offset ids would need 16 GiB
    const mapping::euclidean<rpe::index::clip> m{rpe::index::clip{40000.0}};
    CHECK(throws_with<rpe::out_of_range>([&] { (void)rpe::build_bucket_ids(m, 1, 2147483647, 0); },
                                         {"per-offset ids", "(2T-1)(2H-1)(2W-1)"}));
    // dr = dc = INT_MIN: the squared distance does not overflow (found by reading, confirmed with UBSan)
    const int lo = std::numeric_limits<int>::min();
    CHECK(mapping::euclidean<>{r19}.bucket(lo, lo) == 2 * r19.beta_int());
    CHECK(mapping::euclidean_paper<>{r19}.bucket(lo, lo) == 2 * r19.beta_int());
}

TEST_CASE("errors: outputs over the masks, null attn or grad_out, visit() and run-time shapes beyond rank 4") {
    attention_setup<double> a;
    const auto shape = a.shape();
    const std::int64_t l = a.l;
    std::vector<double> buf(static_cast<std::size_t>(a.b * a.h * l * l), 0.0);  // holds any of the views below
    a.in.attn_mask = cview(buf, {l, l});
    // out written over attn_mask would change the logits while they are computed
    CHECK(throws_with([&] { rpe::attention_forward(a.in, mview(buf, shape)); }, "out overlaps attn_mask"));
    std::vector<double> attn(static_cast<std::size_t>(a.b * a.h * l * l));
    std::vector<double> out(a.q.size());
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_forward(a.in, mview(out, shape), mview(buf, {a.b, a.h, l, l}));
        },
        "attn overlaps attn_mask"));
    std::vector<std::uint8_t> pad(static_cast<std::size_t>(a.b * l) * sizeof(double), 0);
    a.in.attn_mask = {};
    a.in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(pad.data(), {a.b, l});
    // out over the bytes of key_padding_mask
    rpe::tensor_ref<double> out_over_pad(reinterpret_cast<double*>(pad.data()), {a.b, a.h, l, a.d});
    std::vector<std::uint8_t> big_pad(static_cast<std::size_t>(a.b * a.h * l * a.d) * sizeof(double), 0);
    a.in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(big_pad.data(), {a.b, l});
    out_over_pad.data = reinterpret_cast<double*>(big_pad.data());
    CHECK(throws_with([&] { rpe::attention_forward(a.in, out_over_pad); }, "out overlaps key_padding_mask"));
    a.in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(pad.data(), {a.b, l});
    std::vector<double> gq(a.q.size()), gk(a.q.size()), gv(a.q.size());
    // null attn or grad_out in the composed backward: an error, not a crash
    rpe::composed_attention_forward(a.in, mview(out, shape), mview(attn, {a.b, a.h, l, l}));
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_backward(a.in, {.grad_out = cview(a.go, shape),
                                                    .grad_q = mview(gq, shape),
                                                    .grad_k = mview(gk, shape),
                                                    .grad_v = mview(gv, shape),
                                                    .saved_attn = rpe::tensor_ref<const double>(nullptr, {a.b, a.h, l, l})});
        },
        "saved_attn is a null buffer"));
    // the probabilities not given at all: the composed backward does not recompute them
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_backward(a.in, {.grad_out = cview(a.go, shape),
                                                    .grad_q = mview(gq, shape),
                                                    .grad_k = mview(gk, shape),
                                                    .grad_v = mview(gv, shape)});
        },
        "[rpe.attention] saved_attn = empty; expected the (B, H, L, L) probabilities of composed_attention_forward"));
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_backward(a.in, {.grad_out = rpe::tensor_ref<const double>(nullptr, shape),
                                                    .grad_q = mview(gq, shape),
                                                    .grad_k = mview(gk, shape),
                                                    .grad_v = mview(gv, shape),
                                                    .saved_attn = cview(attn, {a.b, a.h, l, l})});
        },
        "grad_out is a null buffer"));
    // visit() of a table that does not exist
    const auto ids = rpe::build_bucket_ids(mapping::product<>{r19}, 3, 4, 1, rpe::id_storage::table);
    CHECK(throws_with<rpe::out_of_range>([&] { ids->visit(3, [](const auto*) { return 0; }); }, "visit(table = 3)"));
    // a run-time shape (e.g. read from a file) of rank 5
    const std::vector<std::int64_t> rank5{1, 1, 1, 4, 8};
    CHECK(throws_with([&] { (void)rpe::tensor_ref<double>(buf.data(), std::span<const std::int64_t>(rank5)); }, "rank 5 > 4"));
}

TEST_CASE("errors: load_npy rejects a stream that is not .npy after its first chunk (/dev/zero never ends)") {
    CHECK(throws_with<rpe::runtime_error>([] { (void)rpe::io::load_npy("/dev/zero"); }, "/dev/zero"));
}

}  // namespace rpe_unit_robustness_errors
