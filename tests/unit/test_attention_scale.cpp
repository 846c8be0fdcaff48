// The softmax scale of rpe::attention_options: a non-default scale gives the values of a plain
// hand-written reference (forward), the fused backward matches central finite differences of
// that reference, the composed baseline agrees, the saved-probabilities backward agrees, and a
// non-finite scale is refused. Also the capability checks of the shared front (a backend that
// lacks a feature gives rpe::not_supported naming it) and the term descriptor.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_attention_scale {

namespace {

using M = rpe::mapping::product<rpe::index::piecewise>;

// One small problem in double: B = 1, H = 2, a 2 x 3 grid with one skip token (L = 7), D = 4;
// a contextual key term, a bias query term (per-head tables) and a contextual value term.
struct scaled_problem {
    static constexpr std::int64_t b = 1, h = 2, d = 4;
    static constexpr int height = 2, width = 3, skip = 1;
    static constexpr std::int64_t l = skip + height * width;
    M mapping{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};
    rpe::term_desc tk = rpe::make_term_desc(mapping, true, rpe::target::key, {.num_heads = 2, .head_dim = 4, .skip = 1});
    rpe::term_desc tq =
        rpe::make_term_desc(mapping, false, rpe::target::query, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    rpe::term_desc tv = rpe::make_term_desc(mapping, true, rpe::target::value, {.num_heads = 2, .head_dim = 4, .skip = 1});
    std::vector<double> q, k, v, go, tab_k, tab_q, tab_v;

    scaled_problem() {
        std::mt19937 rng(1234);
        std::normal_distribution<double> normal(0.0, 1.0);
        auto fill = [&](std::vector<double>& x, std::int64_t n) {
            x.resize(static_cast<std::size_t>(n));
            for (auto& e : x) e = normal(rng);
        };
        for (auto* x : {&q, &k, &v, &go}) fill(*x, b * h * l * d);
        fill(tab_k, size(tk));
        fill(tab_q, size(tq));
        fill(tab_v, size(tv));
    }
    static std::int64_t size(const rpe::term_desc& t) {
        std::int64_t n = 1;
        for (auto e : t.table_shape()) n *= e;
        return n;
    }
    rpe::attention_inputs<double> inputs() const {
        rpe::attention_inputs<double> in;
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.height = height;
        in.width = width;
        in.rpe_k = {.term = &tk, .tables = {{tab_k.data(), tk.table_shape()}}};
        in.rpe_q = {.term = &tq, .tables = {{tab_q.data(), tq.table_shape()}}};
        in.rpe_v = {.term = &tv, .tables = {{tab_v.data(), tv.table_shape()}}};
        return in;
    }

    // The reference, written out: logits_ij = s·q_i·k_j + s·q_i·Tk[:, id(i, j)] + Tq[h, id(j, i)],
    // softmax over j, out_i = Σ_j a_ij (v_j + Tv[id(i, j), :]).
    std::vector<double> reference(double s) const {
        const auto ids = tk.bucket_ids(height, width);
        const std::int64_t kk = tk.num_buckets();
        std::vector<double> out(static_cast<std::size_t>(b * h * l * d), 0.0);
        for (std::int64_t hh = 0; hh < h; ++hh)
            for (std::int64_t i = 0; i < l; ++i) {
                const double* qi = q.data() + (hh * l + i) * d;
                std::vector<double> lg(static_cast<std::size_t>(l));
                double mx = -std::numeric_limits<double>::infinity();
                for (std::int64_t j = 0; j < l; ++j) {
                    const double* kj = k.data() + (hh * l + j) * d;
                    const int idij = ids->at(0, static_cast<int>(i), static_cast<int>(j));
                    const int idji = ids->at(0, static_cast<int>(j), static_cast<int>(i));
                    double x = 0;
                    for (std::int64_t c = 0; c < d; ++c)
                        x += s * qi[c] * (kj[c] + tab_k[static_cast<std::size_t>(c * kk + idij)]);
                    x += tab_q[static_cast<std::size_t>(hh * kk + idji)];
                    lg[static_cast<std::size_t>(j)] = x;
                    mx = std::max(mx, x);
                }
                double sum = 0;
                for (auto& x : lg) sum += (x = std::exp(x - mx));
                for (std::int64_t j = 0; j < l; ++j) {
                    const double a = lg[static_cast<std::size_t>(j)] / sum;
                    const int idij = ids->at(0, static_cast<int>(i), static_cast<int>(j));
                    for (std::int64_t c = 0; c < d; ++c)
                        out[static_cast<std::size_t>((hh * l + i) * d + c)] +=
                            a *
                            (v[static_cast<std::size_t>((hh * l + j) * d + c)] + tab_v[static_cast<std::size_t>(idij * d + c)]);
                }
            }
        return out;
    }
    double loss(double s) const {
        const auto out = reference(s);
        double x = 0;
        for (std::size_t e = 0; e < out.size(); ++e) x += out[e] * go[e];
        return x;
    }
};

}  // namespace

TEST_CASE("attention scale: a non-default scale gives the hand-written reference (fused and composed)") {
    scaled_problem p;
    const auto in = p.inputs();
    const std::vector<std::int64_t> shape{p.b, p.h, p.l, p.d};
    for (const double s : {0.8, 1.0 / std::sqrt(4.0)}) {
        CAPTURE(s);
        const auto ref = p.reference(s);
        std::vector<double> out(ref.size()), out_c(ref.size()), attn(static_cast<std::size_t>(p.b * p.h * p.l * p.l));
        rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), shape), {}, {.scale = s});
        rpe::composed_attention_forward(in, rpe::tensor_ref<double>(out_c.data(), shape),
                                        rpe::tensor_ref<double>(attn.data(), {p.b, p.h, p.l, p.l}), {.scale = s});
        for (std::size_t e = 0; e < ref.size(); ++e) {
            CHECK(out[e] == doctest::Approx(ref[e]).epsilon(1e-12));
            CHECK(out_c[e] == doctest::Approx(ref[e]).epsilon(1e-12));
        }
    }
    // the default is 1/sqrt(D): unset and explicit give the same values (up to the rounding of
    // Eigen's products, which may differ between calls with differently aligned buffers)
    std::vector<double> a(p.q.size()), c(p.q.size());
    rpe::attention_forward(in, rpe::tensor_ref<double>(a.data(), shape));
    rpe::attention_forward(in, rpe::tensor_ref<double>(c.data(), shape), {}, {.scale = 0.5});
    for (std::size_t e = 0; e < a.size(); ++e) CHECK(a[e] == doctest::Approx(c[e]).epsilon(1e-13));
    // and 0.8 differs from the default (the option is not ignored)
    rpe::attention_forward(in, rpe::tensor_ref<double>(c.data(), shape), {}, {.scale = 0.8});
    double diff = 0;
    for (std::size_t e = 0; e < a.size(); ++e) diff = std::max(diff, std::abs(a[e] - c[e]));
    CHECK(diff > 1e-3);
}

TEST_CASE("attention scale: the fused backward with a non-default scale matches finite differences") {
    scaled_problem p;
    const double s = 0.8, eps = 1e-6;
    const std::vector<std::int64_t> shape{p.b, p.h, p.l, p.d};
    std::vector<double> gq(p.q.size()), gk(p.q.size()), gv(p.q.size()), gtk(p.tab_k.size()), gtq(p.tab_q.size()),
        gtv(p.tab_v.size());
    auto in = p.inputs();
    in.rpe_k.grad_tables = {{gtk.data(), p.tk.table_shape()}};
    in.rpe_q.grad_tables = {{gtq.data(), p.tq.table_shape()}};
    in.rpe_v.grad_tables = {{gtv.data(), p.tv.table_shape()}};
    rpe::attention_backward(in,
                            {.grad_out = {p.go.data(), shape},
                             .grad_q = {gq.data(), shape},
                             .grad_k = {gk.data(), shape},
                             .grad_v = {gv.data(), shape}},
                            {.scale = s});
    auto fd = [&](std::vector<double>& x, std::size_t e) {
        const double x0 = x[e];
        x[e] = x0 + eps;
        const double up = p.loss(s);
        x[e] = x0 - eps;
        const double down = p.loss(s);
        x[e] = x0;
        return (up - down) / (2 * eps);
    };
    const std::pair<std::vector<double>*, std::vector<double>*> pairs[] = {{&p.q, &gq},      {&p.k, &gk},      {&p.v, &gv},
                                                                           {&p.tab_k, &gtk}, {&p.tab_q, &gtq}, {&p.tab_v, &gtv}};
    for (const auto& [x, g] : pairs)
        for (std::size_t e = 0; e < x->size(); ++e) CHECK((*g)[e] == doctest::Approx(fd(*x, e)).epsilon(1e-6).scale(1.0));

    // the backward from the saved probabilities (by name) gives the same gradients
    std::vector<double> out(p.q.size()), attn(static_cast<std::size_t>(p.b * p.h * p.l * p.l));
    rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), shape),
                           rpe::tensor_ref<double>(attn.data(), {p.b, p.h, p.l, p.l}), {.scale = s});
    std::vector<double> gq2(p.q.size()), gk2(p.q.size()), gv2(p.q.size());
    rpe::attention_backward(in,
                            {.grad_out = {p.go.data(), shape},
                             .grad_q = {gq2.data(), shape},
                             .grad_k = {gk2.data(), shape},
                             .grad_v = {gv2.data(), shape},
                             .saved_attn = {attn.data(), {p.b, p.h, p.l, p.l}}},
                            {.scale = s});
    for (std::size_t e = 0; e < gq.size(); ++e) {
        CHECK(gq2[e] == doctest::Approx(gq[e]).epsilon(1e-12));
        CHECK(gk2[e] == doctest::Approx(gk[e]).epsilon(1e-12));
        CHECK(gv2[e] == doctest::Approx(gv[e]).epsilon(1e-12));
    }
}

TEST_CASE("attention scale: a non-finite scale is refused before anything is written") {
    scaled_problem p;
    const auto in = p.inputs();
    const std::vector<std::int64_t> shape{p.b, p.h, p.l, p.d};
    std::vector<double> out(p.q.size(), 42.0);
    for (const double s : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
        CHECK_THROWS_WITH_AS(rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), shape), {}, {.scale = s}),
                             doctest::Contains("[rpe.attention] options.scale = "), rpe::invalid_argument);
    for (double x : out) REQUIRE(x == 42.0);
}

TEST_CASE("attention capabilities: a feature the backend lacks is rpe::not_supported naming it") {
    scaled_problem p;
    auto in = p.inputs();
    const rpe::attention_capabilities none{.backend = "test"};
    const rpe::attention_capabilities all = rpe::cpu::attention_caps;
    CHECK_NOTHROW(rpe::detail::check_attention(in, all));
    std::vector<std::uint8_t> kpm(static_cast<std::size_t>(p.b * p.l), 0);
    in.key_padding_mask = {kpm.data(), {p.b, p.l}};
    CHECK_THROWS_WITH_AS(rpe::detail::check_attention(in, none),
                         "[rpe.attention] key_padding_mask is not supported by the test backend", rpe::not_supported);
    in.key_padding_mask = {};
    // a strided q (rows of D contiguous) on a backend without strided views
    std::vector<double> wide(static_cast<std::size_t>(p.b * p.h * p.l * 2 * p.d));
    in.q = rpe::tensor_ref<const double>::with_strides(wide.data(), {p.b, p.h, p.l, p.d},
                                                       {p.h * p.l * 2 * p.d, p.l * 2 * p.d, 2 * p.d, 1});
    CHECK_NOTHROW(rpe::detail::check_attention(in, all));
    CHECK_THROWS_WITH_AS(rpe::detail::check_attention(in, none),
                         "[rpe.attention] q is a strided view (shape (1, 2, 7, 4), strides (112, 56, 8, 1)); strided q, k, v "
                         "views are not supported by the test backend",
                         rpe::not_supported);
    // not_supported is an argument error
    CHECK_THROWS_AS(rpe::detail::check_attention(in, none), rpe::invalid_argument);
    // the saved probabilities by name, on a backend without them
    in = p.inputs();
    const std::vector<std::int64_t> shape{p.b, p.h, p.l, p.d};
    std::vector<double> go(p.q.size()), gq(p.q.size()), gk(p.q.size()), gv(p.q.size()),
        attn(static_cast<std::size_t>(p.l * p.l * p.h));
    const rpe::attention_gradients<double> g{.grad_out = {go.data(), shape},
                                             .grad_q = {gq.data(), shape},
                                             .grad_k = {gk.data(), shape},
                                             .grad_v = {gv.data(), shape},
                                             .saved_attn = {attn.data(), {p.b, p.h, p.l, p.l}}};
    const rpe::attention_capabilities no_saved{.backend = "test", .strided_qkv = true};
    CHECK_THROWS_WITH_AS(
        rpe::detail::check_attention_backward(in, g, {}, no_saved),
        "[rpe.attention] the backward from saved probabilities (saved_attn) is not supported by the test backend",
        rpe::not_supported);
    CHECK_NOTHROW(rpe::detail::check_attention_backward(in, g, {}, all));
}

TEST_CASE("term descriptor: configuration, injectable cache, and the CPU term functions over it") {
    M m{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};
    rpe::bucket_cache cache;
    const auto d =
        rpe::make_term_desc(m, false, rpe::target::key, {.num_heads = 3, .head_dim = 8, .shared_head = false, .skip = 1}, &cache);
    CHECK(d.num_heads() == 3);
    CHECK(d.head_dim() == 8);
    CHECK(d.skip() == 1);
    CHECK_FALSE(d.contextual());
    CHECK(d.target() == rpe::target::key);
    CHECK(d.num_tables() == 1);
    CHECK(d.table_shape() == std::vector<std::int64_t>{3, d.num_buckets()});
    // ids come from the injected cache, not the global one
    const auto ids = d.bucket_ids(2, 3);
    CHECK(cache.size() == 1);
    CHECK(ids->length() == 7);
    // the compile-time term's descriptor and the run-time one agree with the CPU term
    rpe::term<M, rpe::mode::bias, rpe::target::key, double> t(m,
                                                              {.num_heads = 3, .head_dim = 8, .shared_head = false, .skip = 1});
    CHECK(t.desc().num_buckets() == d.num_buckets());
    std::vector<double> table(static_cast<std::size_t>(3 * d.num_buckets()));
    for (std::size_t e = 0; e < table.size(); ++e) table[e] = 0.25 * static_cast<double>(e % 7) - 0.5;
    std::vector<double> out_t(static_cast<std::size_t>(3 * 49)), out_d(out_t.size());
    const rpe::tensor_ref<const double> tab(table.data(), {3, d.num_buckets()});
    t.forward(*ids, tab, {}, rpe::tensor_ref<double>(out_t.data(), {1, 3, 7, 7}), rpe::write::overwrite);
    const rpe::tensor_ref<const double> tabs[] = {tab};
    rpe::cpu::term_forward<double>(d, *ids, tabs, {}, rpe::tensor_ref<double>(out_d.data(), {1, 3, 7, 7}), rpe::write::overwrite);
    for (std::size_t e = 0; e < out_t.size(); ++e) CHECK(out_d[e] == out_t[e]);
    // out(h, i, j) = table[h, id(i, j)]
    CHECK(out_d[static_cast<std::size_t>(2 * 49 + 3 * 7 + 5)] ==
          table[static_cast<std::size_t>(2 * d.num_buckets() + ids->at(0, 3, 5))]);
    // bias mode on values does not exist
    CHECK_THROWS_WITH_AS(rpe::make_term_desc(m, false, rpe::target::value, {.num_heads = 1, .head_dim = 1}),
                         doctest::Contains("[rpe.term] mode = bias with target = v"), rpe::invalid_argument);
}

}  // namespace rpe_unit_attention_scale
