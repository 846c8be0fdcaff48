// The fused attention (rpe::attention_forward / attention_backward) equals the composition of
// single terms (rpe::composed_attention_*) for random shapes, term combinations, masks, row
// blocks, thread counts and id storages (tables, on the fly); and the fused results do not depend
// on the thread count.
#include <doctest/doctest.h>
#include "cpu_paths.hpp"
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_attention_fused {

namespace {

template <class S>
struct random_attention {
    std::int64_t b, h, l, d;
    int height, width;
    std::vector<S> q, k, v, go, mask_add;
    std::vector<std::uint8_t> kpm;
    std::vector<std::vector<S>> tables;
    std::vector<std::unique_ptr<rpe::any_term<S>>> terms;
    rpe::attention_inputs<S> in;

    explicit random_attention(std::uint32_t seed) {
        std::mt19937 rng(seed);
        auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
        std::normal_distribution<double> normal(0.0, 1.0);
        b = uni(1, 2);
        h = uni(1, 3);
        d = uni(1, 6);
        height = uni(1, 5);
        width = uni(1, 6);
        const int skip = uni(0, 2);
        l = skip + height * width;
        for (auto* x : {&q, &k, &v, &go}) {
            x->resize(static_cast<std::size_t>(b * h * l * d));
            for (auto& e : *x) e = static_cast<S>(normal(rng));
        }
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.height = height;
        in.width = width;
        const rpe::method methods[] = {rpe::method::product, rpe::method::cross, rpe::method::euclidean,
                                       rpe::method::quantization};
        rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
        tables.reserve(6);
        for (int t = 0; t < 3; ++t) {
            if (uni(0, 2) == 0) continue;  // this target has no term
            rpe::term_spec spec;
            spec.method = methods[uni(0, 3)];
            spec.contextual = t == 2 || uni(0, 2) != 0;
            spec.target = targets[t];
            spec.ratio(uni(0, 1) ? 1.9 : 1.0);
            spec.shared_head = uni(0, 1) == 1;
            spec.skip = skip;
            spec.num_heads = static_cast<int>(h);
            spec.head_dim = static_cast<int>(d);
            terms.push_back(rpe::make_term<S>(spec));
            slots[t]->term = terms.back().get();
            const auto shape = terms.back()->table_shape();
            for (int n = 0; n < terms.back()->num_tables(); ++n) {
                auto& tab = tables.emplace_back();
                std::int64_t size = 1;
                for (auto e : shape) size *= e;
                tab.resize(static_cast<std::size_t>(size));
                for (auto& e : tab) e = static_cast<S>(0.5 * normal(rng));
                rpe::tensor_ref<const S> ref;
                ref.data = tab.data();
                ref.rank = static_cast<int>(shape.size());
                for (std::size_t i = 0; i < shape.size(); ++i) ref.shape[i] = shape[i];
                slots[t]->tables.push_back(ref);
            }
        }
        if (uni(0, 1)) {  // key padding mask, sometimes a whole batch element (fully masked rows)
            kpm.resize(static_cast<std::size_t>(b * l));
            for (auto& m : kpm) m = static_cast<std::uint8_t>(uni(0, 3) == 0);
            if (uni(0, 2) == 0) std::fill(kpm.begin(), kpm.begin() + l, std::uint8_t{1});
            in.key_padding_mask = {kpm.data(), {b, l}};
        }
        if (uni(0, 1)) {  // additive mask with a few -inf entries
            mask_add.resize(static_cast<std::size_t>(l * l));
            for (auto& m : mask_add) m = uni(0, 5) == 0 ? -std::numeric_limits<S>::infinity() : static_cast<S>(normal(rng));
            in.attn_mask = {mask_add.data(), {l, l}};
        }
    }

    // Grad-table views over `storage` (one buffer per table), assigned to the slots.
    void bind_grads(std::vector<std::vector<S>>& storage) {
        storage.clear();
        storage.reserve(tables.size());
        std::size_t next = 0;
        for (auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) {
            slot->grad_tables.clear();
            for (const auto& t : slot->tables) {
                auto& g = storage.emplace_back(tables[next++].size(), S(-7));
                rpe::tensor_ref<S> ref;
                ref.data = g.data();
                ref.rank = t.rank;
                ref.shape = t.shape;
                slot->grad_tables.push_back(ref);
            }
        }
    }
};

// A contextual Product term (ratio 1.9: K = 50 on an 8 x 8 grid, skip 1) on `target`, h heads of d.
rpe::term_spec contextual_product(rpe::target target, std::int64_t h, std::int64_t d) {
    rpe::term_spec spec;
    spec.method = rpe::method::product;
    spec.contextual = true;
    spec.target = target;
    spec.ratio(1.9);
    spec.skip = 1;
    spec.num_heads = static_cast<int>(h);
    spec.head_dim = static_cast<int>(d);
    return spec;
}

template <class S>
struct results {
    std::vector<S> out, attn, gq, gk, gv;
    std::vector<std::vector<S>> gt;
};

// Output, gradient and probability buffers of `c`'s shapes, prefilled with -3 (a kernel that
// skips an entry shows), the table gradients bound.
template <class S>
results<S> prefilled_results(random_attention<S>& c) {
    results<S> r;
    const auto n = static_cast<std::size_t>(c.b * c.h * c.l * c.d);
    r.out.assign(n, S(-3));
    r.gq.assign(n, S(-3));
    r.gk.assign(n, S(-3));
    r.gv.assign(n, S(-3));
    r.attn.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.l), S(-3));
    c.bind_grads(r.gt);
    return r;
}

template <class S>
results<S> run(random_attention<S>& c, bool fused, std::int64_t row_block, rpe::id_storage storage = rpe::id_storage::automatic,
               std::int64_t budget = rpe::attention_options{}.backward_budget_bytes) {
    results<S> r = prefilled_results(c);
    const rpe::tensor_ref<S> attn(r.attn.data(), {c.b, c.h, c.l, c.l});
    auto view = [&](std::vector<S>& x) { return rpe::tensor_ref<S>(x.data(), {c.b, c.h, c.l, c.d}); };
    const rpe::tensor_ref<const S> go(c.go.data(), {c.b, c.h, c.l, c.d});
    if (fused) {
        const rpe::attention_options opt{.row_block = row_block, .storage = storage, .backward_budget_bytes = budget};
        rpe::attention_forward(c.in, view(r.out), attn, opt);
        rpe::attention_backward(c.in, go, view(r.gq), view(r.gk), view(r.gv), opt);
    } else {
        rpe::composed_attention_forward(c.in, view(r.out), attn);
        rpe::composed_attention_backward(c.in, {.grad_out = go,
                                                .grad_q = view(r.gq),
                                                .grad_k = view(r.gk),
                                                .grad_v = view(r.gv),
                                                .saved_attn = rpe::tensor_ref<const S>(attn)});
    }
    return r;
}

template <class S>
double max_rel_diff(const std::vector<S>& a, const std::vector<S>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
        if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
        worst = std::max(worst, std::fabs(x - y) / (1.0 + std::fabs(y)));
    }
    return worst;
}

// grad_q, grad_k, grad_v and every table gradient of a and b within `tol` (max_rel_diff).
template <class S>
void check_gradients_close(const results<S>& a, const results<S>& b, double tol) {
    CHECK(max_rel_diff(a.gq, b.gq) < tol);
    CHECK(max_rel_diff(a.gk, b.gk) < tol);
    CHECK(max_rel_diff(a.gv, b.gv) < tol);
    REQUIRE(a.gt.size() == b.gt.size());
    for (std::size_t t = 0; t < a.gt.size(); ++t) CHECK(max_rel_diff(a.gt[t], b.gt[t]) < tol);
}

}  // namespace

TEST_CASE("fused attention equals the composed attention on random configurations") {
    for (std::uint32_t seed = 1; seed <= 40; ++seed) {
        CAPTURE(seed);
        random_attention<double> c(seed);
        const auto composed = run(c, false, 0);
        const std::int64_t row_block = 1 + static_cast<std::int64_t>(seed % 5);
        rpe_test::set_threads(1 + static_cast<int>(seed % 3));
        // ids as (L, L) tables and computed on the fly (rpe::id_storage) give the same results
        for (const auto storage : {rpe::id_storage::table, rpe::id_storage::on_the_fly}) {
            CAPTURE(static_cast<int>(storage));
            const auto fused = run(c, true, row_block, storage);
            CHECK(max_rel_diff(fused.out, composed.out) < 1e-12);
            CHECK(max_rel_diff(fused.attn, composed.attn) < 1e-12);
            check_gradients_close(fused, composed, 1e-12);
        }
    }
    rpe_test::set_threads(2);
}

TEST_CASE("float forward with a contextual value term: looked up per key (small D) and folded (D = 64) agree with float64") {
    // The digits demo's shapes (8 x 8 grid and a class token, Product with K = 50, contextual on
    // k and v): the AVX-512F forward looks the value table up per key for D <= 32 at L = 65 and
    // folds it into the output's product for D = 64 (detail::value_lookup_pays); both against the
    // float64 forward of the same inputs.
    const std::int64_t b = 2, h = 2, l = 65;
    for (const std::int64_t d : {16, 20, 32, 64}) {
        CAPTURE(d);
        CHECK(rpe::detail::value_lookup_pays(l, d, 1, 50) == (d <= 32));
        std::mt19937 rng(static_cast<std::uint32_t>(d));
        std::normal_distribution<float> normal;
        const auto n = static_cast<std::size_t>(b * h * l * d);
        std::vector<float> q(n), k(n), v(n), out(n, -3.0f);
        for (auto* x : {&q, &k, &v})
            for (auto& e : *x) e = normal(rng);
        std::vector<std::unique_ptr<rpe::any_term<float>>> terms;
        std::vector<float> tables[2];
        std::vector<double> tables64[2];
        rpe::attention_inputs<float> in;
        rpe::attention_inputs<double> in64;
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.height = in.width = in64.height = in64.width = 8;
        std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()), out64(n);
        in64.q = {q64.data(), {b, h, l, d}};
        in64.k = {k64.data(), {b, h, l, d}};
        in64.v = {v64.data(), {b, h, l, d}};
        std::vector<std::unique_ptr<rpe::any_term<double>>> terms64;
        const rpe::target targets[2] = {rpe::target::key, rpe::target::value};
        rpe::attention_term<float>* slots[2] = {&in.rpe_k, &in.rpe_v};
        rpe::attention_term<double>* slots64[2] = {&in64.rpe_k, &in64.rpe_v};
        for (int t = 0; t < 2; ++t) {
            rpe::term_spec spec = contextual_product(targets[t], h, d);
            spec.shared_head = true;
            terms.push_back(rpe::make_term<float>(spec));
            terms64.push_back(rpe::make_term<double>(spec));
            slots[t]->term = terms.back().get();
            slots64[t]->term = terms64.back().get();
            const auto shape = terms.back()->table_shape();
            REQUIRE(shape[0] * shape[1] * shape[2] == 50 * d);
            tables[t].resize(static_cast<std::size_t>(50 * d));
            for (auto& e : tables[t]) e = 0.5f * normal(rng);
            tables64[t].assign(tables[t].begin(), tables[t].end());
            slots[t]->tables = {rpe::tensor_ref<const float>(tables[t].data(), {shape[0], shape[1], shape[2]})};
            slots64[t]->tables = {rpe::tensor_ref<const double>(tables64[t].data(), {shape[0], shape[1], shape[2]})};
        }
        rpe::attention_forward(in, rpe::tensor_ref<float>(out.data(), {b, h, l, d}));
        rpe::attention_forward(in64, rpe::tensor_ref<double>(out64.data(), {b, h, l, d}));
        double worst = 0;
        for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(out[i] - out64[i]) / (1.0 + std::abs(out64[i])));
        CHECK(worst < 2e-6);
        CHECK(worst > 0);  // float rounding shows: the float forward ran
        // a NaN in the value table spreads to every output as in float64 (the folded sums
        // multiply every bucket's row: 0·NaN = NaN), whatever D: non-finite value tables take the fold
        tables[1][0] = std::numeric_limits<float>::quiet_NaN();
        tables64[1][0] = std::numeric_limits<double>::quiet_NaN();
        rpe::attention_forward(in, rpe::tensor_ref<float>(out.data(), {b, h, l, d}));
        rpe::attention_forward(in64, rpe::tensor_ref<double>(out64.data(), {b, h, l, d}));
        for (std::size_t i = 0; i < n; ++i) REQUIRE(std::isnan(out[i]) == std::isnan(out64[i]));
        CHECK(std::isnan(out[0]));
    }
}

TEST_CASE("fused attention gives bit-identical results for 1, 2 and 4 threads") {
    for (std::uint32_t seed = 100; seed < 110; ++seed) {
        CAPTURE(seed);
        random_attention<float> c(seed);
        rpe_test::set_threads(1);
        const auto one = run(c, true, 3);
        for (int threads : {2, 4}) {
            rpe_test::set_threads(threads);
            const auto many = run(c, true, 3);
            CHECK(many.out == one.out);
            CHECK(many.gq == one.gq);
            CHECK(many.gk == one.gk);
            CHECK(many.gv == one.gv);
            CHECK(many.gt == one.gt);
        }
    }
    rpe_test::set_threads(2);
}

TEST_CASE("fused attention: fully masked rows give zeros, padded keys get zero gradients") {
    random_attention<double> c(3);
    // mask every key of batch element 0 and key 0 of the others
    c.kpm.assign(static_cast<std::size_t>(c.b * c.l), 0);
    std::fill(c.kpm.begin(), c.kpm.begin() + c.l, std::uint8_t{1});
    for (std::int64_t bb = 1; bb < c.b; ++bb) c.kpm[static_cast<std::size_t>(bb * c.l)] = 1;
    c.in.key_padding_mask = {c.kpm.data(), {c.b, c.l}};
    c.in.attn_mask = {};
    const auto r = run(c, true, 2);
    const auto plane = static_cast<std::size_t>(c.h * c.l * c.d);
    for (std::size_t i = 0; i < plane; ++i) {
        REQUIRE(r.out[i] == 0.0);
        REQUIRE(r.gq[i] == 0.0);
        REQUIRE(r.gk[i] == 0.0);
        REQUIRE(r.gv[i] == 0.0);
    }
    for (std::size_t i = 0; i < static_cast<std::size_t>(c.h * c.l * c.l); ++i) REQUIRE(r.attn[i] == 0.0);
    for (double x : r.out) CHECK_FALSE(std::isnan(x));
    if (c.b > 1)  // key 0 of batch element 1 is padded: its grad_k and grad_v rows are exactly zero
        for (std::int64_t hh = 0; hh < c.h; ++hh)
            for (std::int64_t e = 0; e < c.d; ++e) {
                const auto at = static_cast<std::size_t>(((1 * c.h + hh) * c.l + 0) * c.d + e);
                CHECK(r.gk[at] == 0.0);
                CHECK(r.gv[at] == 0.0);
            }
}

TEST_CASE("fused attention rejects bad arguments before writing") {
    random_attention<float> c(5);
    std::vector<float> out(static_cast<std::size_t>(c.b * c.h * c.l * c.d), 42.0f);
    SUBCASE("wrong out shape") {
        CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d + 1})),
                        rpe::invalid_argument);
    }
    SUBCASE("wrong grid") {
        c.in.height += 1;
        if (c.in.rpe_q.term || c.in.rpe_k.term || c.in.rpe_v.term)
            CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d})),
                            rpe::invalid_argument);
    }
    SUBCASE("out aliases q") {
        CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(c.q.data(), {c.b, c.h, c.l, c.d})),
                        rpe::invalid_argument);
    }
    SUBCASE("negative row block") {
        CHECK_THROWS_AS(
            rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d}), {}, {.row_block = -1}),
            rpe::invalid_argument);
    }
    for (float x : out) REQUIRE(x == 42.0f);
}

TEST_CASE("attention: a NaN query makes its row NaN, not zeros; other rows stay finite") {
    for (bool fused : {false, true}) {
        CAPTURE(fused);
        random_attention<double> c(11);
        c.in.key_padding_mask = {};
        c.in.attn_mask = {};
        c.q[0] = std::numeric_limits<double>::quiet_NaN();  // batch 0, head 0, query 0
        const auto r = run(c, fused, 2);
        for (std::int64_t e = 0; e < c.d; ++e) CHECK(std::isnan(r.out[static_cast<std::size_t>(e)]));
        for (std::int64_t j = 0; j < c.l; ++j) CHECK(std::isnan(r.attn[static_cast<std::size_t>(j)]));
        for (std::size_t e = static_cast<std::size_t>(c.d); e < static_cast<std::size_t>(c.l * c.d); ++e)
            CHECK_FALSE(std::isnan(r.out[e]));
    }
}

namespace {

// q, k, v of `c` copied into one packed (B, L, 3, H, D) buffer (the layout of a qkv projection
// reshaped as timm/DeiT do), and strided (B, H, L, D) views of it in c.in.
template <class S>
std::vector<S> pack_qkv(random_attention<S>& c) {
    const std::int64_t b = c.b, h = c.h, l = c.l, d = c.d;
    std::vector<S> qkv(static_cast<std::size_t>(b * l * 3 * h * d), S(-99));
    const std::vector<S>* src[3] = {&c.q, &c.k, &c.v};
    for (int w = 0; w < 3; ++w)
        for (std::int64_t bb = 0; bb < b; ++bb)
            for (std::int64_t hh = 0; hh < h; ++hh)
                for (std::int64_t i = 0; i < l; ++i)
                    for (std::int64_t e = 0; e < d; ++e)
                        qkv[static_cast<std::size_t>((((bb * l + i) * 3 + w) * h + hh) * d + e)] =
                            (*src[w])[static_cast<std::size_t>(((bb * h + hh) * l + i) * d + e)];
    return qkv;
}

template <class S>
void view_packed(random_attention<S>& c, const std::vector<S>& qkv) {
    const std::int64_t b = c.b, h = c.h, l = c.l, d = c.d;
    auto at = [&](int w) {
        return rpe::tensor_ref<const S>::with_strides(qkv.data() + w * h * d, {b, h, l, d}, {l * 3 * h * d, d, 3 * h * d, 1});
    };
    c.in.q = at(0);
    c.in.k = at(1);
    c.in.v = at(2);
}

// Equal up to the rounding of the matrix products (Eigen may pick another kernel for a strided
// operand): 1e-13 relative in double, 1e-6 in float.
template <class S>
void check_same(const results<S>& a, const results<S>& b) {
    const double tol = sizeof(S) == 8 ? 1e-13 : 1e-6;
    CHECK(max_rel_diff(a.out, b.out) < tol);
    CHECK(max_rel_diff(a.attn, b.attn) < tol);
    check_gradients_close(a, b, tol);
}

}  // namespace

TEST_CASE("attention reads q, k, v in place from a packed (B, L, 3, H, D) buffer: the same results as contiguous copies") {
    rpe_test::set_threads(2);
    for (std::uint32_t seed = 1; seed <= 20; ++seed) {
        CAPTURE(seed);
        random_attention<double> c(seed);
        const auto fused = run(c, true, 1 + seed % 4), composed = run(c, false, 0);
        const auto qkv = pack_qkv(c);
        view_packed(c, qkv);
        REQUIRE_FALSE(c.in.q.contiguous());
        check_same(run(c, true, 1 + seed % 4), fused);
        check_same(run(c, false, 0), composed);
    }
}

namespace {

// The composed baseline with options: forward, then the backward from its probabilities.
template <class S>
results<S> run_composed(random_attention<S>& c, const rpe::attention_options& opt) {
    results<S> r;
    const auto n = static_cast<std::size_t>(c.b * c.h * c.l * c.d);
    for (auto* x : {&r.out, &r.gq, &r.gk, &r.gv}) x->assign(n, S(-3));
    r.attn.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.l), S(-3));
    c.bind_grads(r.gt);
    const rpe::tensor_ref<S> attn(r.attn.data(), {c.b, c.h, c.l, c.l});
    auto view = [&](std::vector<S>& x) { return rpe::tensor_ref<S>(x.data(), {c.b, c.h, c.l, c.d}); };
    rpe::composed_attention_forward(c.in, view(r.out), attn, opt);
    rpe::composed_attention_backward(c.in,
                                     {.grad_out = rpe::tensor_ref<const S>(c.go.data(), {c.b, c.h, c.l, c.d}),
                                      .grad_q = view(r.gq),
                                      .grad_k = view(r.gk),
                                      .grad_v = view(r.gv),
                                      .saved_attn = rpe::tensor_ref<const S>(attn)},
                                     opt);
    return r;
}

}  // namespace

TEST_CASE("composed attention keeps a custom scale on strided q, k, v (its contiguous copies get the options)") {
    for (std::uint32_t seed = 1; seed <= 6; ++seed) {
        CAPTURE(seed);
        random_attention<double> c(seed);
        const rpe::attention_options opt{.scale = 0.3};
        const auto contiguous = run_composed(c, opt);
        // the scale matters here: the default 1/sqrt(D) gives other probabilities (D = 1 aside)
        if (c.d != 1) CHECK(max_rel_diff(run_composed(c, {}).attn, contiguous.attn) > 1e-6);
        const auto qkv = pack_qkv(c);
        view_packed(c, qkv);
        REQUIRE_FALSE(c.in.q.contiguous());
        check_same(run_composed(c, opt), contiguous);
    }
}

TEST_CASE("attention on strided q, k, v with RoPE (axial, mixed with frequency gradient) and a contextual key term") {
    for (int form = 0; form < 2; ++form) {
        CAPTURE(form);
        random_attention<float> c(7);
        c.in.key_padding_mask = {};
        c.in.attn_mask = {};
        // a fixed shape RoPE accepts: D = 8, a 3 x 4 grid and one skip token
        c.b = 2, c.h = 2, c.d = 8, c.height = 3, c.width = 4, c.l = 1 + 12;
        std::mt19937 rng(3);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto* x : {&c.q, &c.k, &c.v, &c.go}) {
            x->resize(static_cast<std::size_t>(c.b * c.h * c.l * c.d));
            for (auto& e : *x) e = normal(rng);
        }
        const std::vector<std::int64_t> shape{c.b, c.h, c.l, c.d};
        c.in.q = rpe::tensor_ref<const float>(c.q.data(), shape);
        c.in.k = rpe::tensor_ref<const float>(c.k.data(), shape);
        c.in.v = rpe::tensor_ref<const float>(c.v.data(), shape);
        c.in.height = c.height;
        c.in.width = c.width;
        c.terms.clear();
        c.tables.clear();
        c.in.rpe_q = {};
        c.in.rpe_v = {};
        rpe::term_spec spec;
        spec.method = rpe::method::product;
        spec.contextual = true;
        spec.target = rpe::target::key;
        spec.skip = 1;
        spec.num_heads = 2;
        spec.head_dim = 8;
        c.terms.push_back(rpe::make_term<float>(spec));
        const auto tshape = c.terms.back()->table_shape();
        auto& tab = c.tables.emplace_back(static_cast<std::size_t>(tshape[0] * tshape[1] * tshape[2]));
        for (auto& e : tab) e = 0.5f * normal(rng);
        c.in.rpe_k = {.term = c.terms.back().get(), .tables = {rpe::tensor_ref<const float>(tab.data(), tshape)}};
        std::vector<float> freqs(2 * 2 * 4), gf_plain(freqs.size()), gf_strided(freqs.size());
        for (auto& e : freqs) e = normal(rng);
        c.in.rope.skip = 1;
        if (form == 0) {
            c.in.rope.form = rpe::rope::axial{.theta = 100.0f};
        } else {
            c.in.rope.form = rpe::rope::mixed{};
            c.in.rope.freqs = {freqs.data(), {2, 2, 4}};
            c.in.rope.grad_freqs = {gf_plain.data(), {2, 2, 4}};
        }
        const auto plain = run(c, true, 5);
        const auto qkv = pack_qkv(c);
        view_packed(c, qkv);
        if (form == 1) c.in.rope.grad_freqs = {gf_strided.data(), {2, 2, 4}};
        check_same(run(c, true, 5), plain);
        CHECK(max_rel_diff(gf_strided, gf_plain) < 1e-6);
        // and the composed baseline (rotate, then attend) agrees on the strided views
        const auto composed = run(c, false, 0);
        CHECK(max_rel_diff(composed.out, plain.out) < 1e-5);
        CHECK(max_rel_diff(composed.gq, plain.gq) < 1e-5);
        CHECK(max_rel_diff(composed.gk, plain.gk) < 1e-5);
        // one token repeated along L (a row stride of 0, as torch's expand gives): every token
        // is rotated by its own angle from the one row
        for (auto* x : {&c.q, &c.k})
            for (std::int64_t p = 0; p < c.b * c.h; ++p)
                for (std::int64_t i = 1; i < c.l; ++i)
                    std::copy_n(x->data() + p * c.l * c.d, c.d, x->data() + (p * c.l + i) * c.d);
        c.in.q = rpe::tensor_ref<const float>(c.q.data(), shape);
        c.in.k = rpe::tensor_ref<const float>(c.k.data(), shape);
        c.in.v = rpe::tensor_ref<const float>(c.v.data(), shape);
        if (form == 1) c.in.rope.grad_freqs = {gf_plain.data(), {2, 2, 4}};
        const auto repeated = run(c, true, 5);
        c.in.q = rpe::tensor_ref<const float>::with_strides(c.q.data(), {c.b, c.h, c.l, c.d}, {c.h * c.l * c.d, c.l * c.d, 0, 1});
        c.in.k = rpe::tensor_ref<const float>::with_strides(c.k.data(), {c.b, c.h, c.l, c.d}, {c.h * c.l * c.d, c.l * c.d, 0, 1});
        if (form == 1) c.in.rope.grad_freqs = {gf_strided.data(), {2, 2, 4}};
        check_same(run(c, true, 5), repeated);
        CHECK(max_rel_diff(gf_strided, gf_plain) < 1e-6);
    }
}

TEST_CASE("attention: a batch stride of 0 broadcasts one (H, L, D) block to every batch element") {
    std::uint32_t seed = 1;
    while (random_attention<double>(seed).b < 2) ++seed;  // a configuration with two batch elements
    random_attention<double> c(seed);
    REQUIRE(c.b == 2);
    // every batch element gets batch 0's q, k, v: copy them, then view batch 0 with stride 0
    const std::int64_t plane = c.h * c.l * c.d;
    for (auto* x : {&c.q, &c.k, &c.v}) std::copy(x->begin(), x->begin() + plane, x->begin() + plane);
    const auto full = run(c, true, 2);
    std::vector<const double*> bases = {c.q.data(), c.k.data(), c.v.data()};
    c.in.q = rpe::tensor_ref<const double>::with_strides(bases[0], {c.b, c.h, c.l, c.d}, {0, c.l * c.d, c.d, 1});
    c.in.k = rpe::tensor_ref<const double>::with_strides(bases[1], {c.b, c.h, c.l, c.d}, {0, c.l * c.d, c.d, 1});
    c.in.v = rpe::tensor_ref<const double>::with_strides(bases[2], {c.b, c.h, c.l, c.d}, {0, c.l * c.d, c.d, 1});
    check_same(run(c, true, 2), full);
}

TEST_CASE("strided views: rejected where not supported, checked where supported") {
    random_attention<float> c(5);
    std::vector<float> out(static_cast<std::size_t>(c.b * c.h * c.l * c.d), 42.0f);
    const rpe::tensor_ref<float> out_view(out.data(), {c.b, c.h, c.l, c.d});
    const auto qkv = pack_qkv(c);
    SUBCASE("the last stride must be 1") {
        c.in.q = rpe::tensor_ref<const float>::with_strides(c.q.data(), {c.b, c.h, c.l, c.d}, {0, 0, 0, 2});
        if (c.d > 1)
            CHECK_THROWS_WITH_AS(rpe::attention_forward(c.in, out_view), doctest::Contains("q has strides (0, 0, 0, 2)"),
                                 rpe::invalid_argument);
    }
    SUBCASE("an output inside the packed buffer's span overlaps q/k/v") {
        view_packed(c, qkv);
        rpe::tensor_ref<float> aliased(const_cast<float*>(qkv.data()) + c.h * c.d, {c.b, c.h, c.l, c.d});
        CHECK_THROWS_WITH_AS(rpe::attention_forward(c.in, aliased), doctest::Contains("overlaps q/k/v"), rpe::invalid_argument);
        std::vector<float> attn(static_cast<std::size_t>(c.b * c.h * c.l * c.l));
        CHECK_THROWS_WITH_AS(
            rpe::composed_attention_forward(c.in, aliased, rpe::tensor_ref<float>(attn.data(), {c.b, c.h, c.l, c.l})),
            doctest::Contains("overlaps q/k/v"), rpe::invalid_argument);
    }
    SUBCASE("the terms take contiguous buffers only") {
        rpe::term_spec spec;
        spec.method = rpe::method::product;
        spec.contextual = true;
        spec.target = rpe::target::key;
        spec.skip = static_cast<int>(c.l - c.height * c.width);
        spec.num_heads = static_cast<int>(c.h);
        spec.head_dim = static_cast<int>(c.d);
        const auto t = rpe::make_term<float>(spec);
        const auto ids = t->bucket_ids(c.height, c.width);
        const auto tshape = t->table_shape();
        std::vector<float> tab(static_cast<std::size_t>(tshape[0] * tshape[1] * tshape[2]), 0.5f);
        const rpe::tensor_ref<const float> tables[] = {{tab.data(), tshape}};
        std::vector<float> y(static_cast<std::size_t>(c.b * c.h * c.l * c.l));
        view_packed(c, qkv);
        CHECK_THROWS_WITH_AS(
            t->forward(*ids, tables, c.in.q, rpe::tensor_ref<float>(y.data(), {c.b, c.h, c.l, c.l}), rpe::write::overwrite),
            doctest::Contains("x is a strided view"), rpe::invalid_argument);
    }
    SUBCASE("with_strides checks its arguments") {
        CHECK_THROWS_WITH_AS(rpe::tensor_ref<const float>::with_strides(c.q.data(), {2, 3}, {3}),
                             doctest::Contains("strides has 1 entries; expected 2"), rpe::invalid_argument);
        CHECK_THROWS_WITH_AS(rpe::tensor_ref<const float>::with_strides(c.q.data(), {2, 3}, {-3, 1}),
                             doctest::Contains("strides[0] = -3 is negative"), rpe::invalid_argument);
        CHECK_THROWS_AS(rpe::tensor_ref<const float>::with_strides(c.q.data(), {3, 3}, {std::int64_t{1} << 62, 1}),
                        rpe::out_of_range);
        // a span that fits int64 elements but not int64 bytes
        CHECK_THROWS_WITH_AS(rpe::tensor_ref<const float>::with_strides(c.q.data(), {3, 8}, {(std::int64_t{1} << 61) + 1, 1}),
                             doctest::Contains("overflows int64 bytes"), rpe::out_of_range);
        const auto v = rpe::tensor_ref<const float>::with_strides(c.q.data(), {2, 3}, {3, 1});
        CHECK(v.contiguous());
        CHECK(v.span() == 6);
        const auto w = rpe::tensor_ref<const float>::with_strides(c.q.data(), {2, 3}, {5, 1});
        CHECK_FALSE(w.contiguous());
        CHECK(w.span() == 8);
        CHECK(w.strides_string() == "(5, 1)");
    }
    for (float x : out) REQUIRE(x == 42.0f);
}

TEST_CASE("fused attention backward from the forward's probabilities equals the recomputing backward") {
    for (std::uint32_t seed = 1; seed <= 24; ++seed) {
        CAPTURE(seed);
        random_attention<double> c(seed);
        const std::int64_t row_block = 1 + static_cast<std::int64_t>(seed % 4);
        rpe_test::set_threads(1 + static_cast<int>(seed % 2));
        const auto recomputed = run(c, true, row_block);  // its attn is the forward's probabilities
        results<double> r;
        const auto n = static_cast<std::size_t>(c.b * c.h * c.l * c.d);
        r.gq.assign(n, -3.0);
        r.gk.assign(n, -3.0);
        r.gv.assign(n, -3.0);
        c.bind_grads(r.gt);
        auto view = [&](std::vector<double>& x) { return rpe::tensor_ref<double>(x.data(), {c.b, c.h, c.l, c.d}); };
        rpe::attention_backward(c.in,
                                {.grad_out = rpe::tensor_ref<const double>(c.go.data(), {c.b, c.h, c.l, c.d}),
                                 .grad_q = view(r.gq),
                                 .grad_k = view(r.gk),
                                 .grad_v = view(r.gv),
                                 .saved_attn = rpe::tensor_ref<const double>(recomputed.attn.data(), {c.b, c.h, c.l, c.l})},
                                {.row_block = row_block});
        check_gradients_close(r, recomputed, 1e-12);
    }
    rpe_test::set_threads(2);
}

TEST_CASE("fused attention backward from probabilities: attn is checked before anything is written") {
    random_attention<float> c(6);
    const auto n = static_cast<std::size_t>(c.b * c.h * c.l * c.d);
    std::vector<float> attn(static_cast<std::size_t>(c.b * c.h * c.l * c.l), 0.5f), gq(n, 42.0f), gk(n, 42.0f), gv(n, 42.0f);
    const rpe::tensor_ref<const float> go(c.go.data(), {c.b, c.h, c.l, c.d});
    auto view = [&](std::vector<float>& x) { return rpe::tensor_ref<float>(x.data(), {c.b, c.h, c.l, c.d}); };
    auto grads = [&](rpe::tensor_ref<const float> saved) {
        return rpe::attention_gradients<float>{
            .grad_out = go, .grad_q = view(gq), .grad_k = view(gk), .grad_v = view(gv), .saved_attn = saved};
    };
    CHECK_THROWS_WITH_AS(
        rpe::attention_backward(c.in, grads(rpe::tensor_ref<const float>(attn.data(), {c.b, c.h, c.l, c.l + 1}))),
        doctest::Contains("saved_attn has shape"), rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(rpe::attention_backward(c.in, grads(rpe::tensor_ref<const float>(nullptr, {c.b, c.h, c.l, c.l}))),
                         doctest::Contains("saved_attn is a null buffer"), rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(rpe::attention_backward(c.in, grads(rpe::tensor_ref<const float>(gq.data(), {c.b, c.h, c.l, c.l}))),
                         doctest::Contains("grad_q overlaps attn"), rpe::invalid_argument);
    for (const auto* g : {&gq, &gk, &gv})
        for (float x : *g) REQUIRE(x == 42.0f);
}

namespace {

// The backward's gradients of `c` (recomputing the probabilities, or from the forward's saved
// ones) under `budget` bytes of partials.
template <class S>
results<S> run_backward(random_attention<S>& c, std::int64_t row_block, std::int64_t budget, bool saved) {
    results<S> r = prefilled_results(c);
    auto view = [&](std::vector<S>& x) { return rpe::tensor_ref<S>(x.data(), {c.b, c.h, c.l, c.d}); };
    const rpe::attention_options opt{.row_block = row_block, .backward_budget_bytes = budget};
    const rpe::tensor_ref<S> attn(r.attn.data(), {c.b, c.h, c.l, c.l});
    rpe::attention_forward(c.in, view(r.out), attn, opt);
    rpe::attention_gradients<S> g{.grad_out = rpe::tensor_ref<const S>(c.go.data(), {c.b, c.h, c.l, c.d}),
                                  .grad_q = view(r.gq),
                                  .grad_k = view(r.gk),
                                  .grad_v = view(r.gv)};
    if (saved) g.saved_attn = rpe::tensor_ref<const S>(attn);
    rpe::attention_backward(c.in, g, opt);
    return r;
}

}  // namespace

TEST_CASE("fused backward: bit-identical results for every backward budget and 1 or 2 threads") {
    int split = 0, waves = 0;  // how many runs took the split and the whole-plane multi-wave paths
    for (std::uint32_t seed = 200; seed < 216; ++seed) {
        CAPTURE(seed);
        random_attention<float> c(seed);
        const std::int64_t row_block = 1 + seed % 2;  // small blocks: many chunks per (batch, head)
        for (bool saved : {false, true}) {
            CAPTURE(saved);
            rpe_test::set_threads(1);
            const auto ref = run_backward(c, row_block, rpe::attention_options{}.backward_budget_bytes, saved);
            const auto plan = rpe::cpu::plan_backward_scratch(c.in, {.row_block = row_block}, saved);
            REQUIRE(plan.items == c.b * c.h * plan.chunks);
            CHECK(plan.items_at_once == plan.items);  // the default budget holds these small problems at once
            CHECK(plan.bytes == plan.all_bytes);
            const std::int64_t per_plane = plan.all_bytes / (c.b * c.h);
            // 1 byte: one item at a time; between one item and one plane: split planes; a few planes
            for (const std::int64_t budget : {std::int64_t{1}, plan.min_bytes, plan.min_bytes + per_plane / 3, per_plane,
                                              2 * per_plane - 1, plan.all_bytes - 1}) {
                CAPTURE(budget);
                const auto at =
                    rpe::cpu::plan_backward_scratch(c.in, {.row_block = row_block, .backward_budget_bytes = budget}, saved);
                CHECK(at.bytes <= std::max(budget, plan.min_bytes));
                CHECK(at.items_at_once >= 1);
                if (at.bytes > 0 && at.items_at_once < plan.chunks) ++split;
                if (at.items_at_once >= plan.chunks && at.items_at_once < plan.items) ++waves;
                for (int threads : {1, 2}) {
                    CAPTURE(threads);
                    rpe_test::set_threads(threads);
                    const auto r = run_backward(c, row_block, budget, saved);
                    CHECK(r.gq == ref.gq);
                    CHECK(r.gk == ref.gk);
                    CHECK(r.gv == ref.gv);
                    CHECK(r.gt == ref.gt);
                }
            }
        }
    }
    CHECK(split > 0);
    CHECK(waves > 0);
    rpe_test::set_threads(2);
}

namespace {

// A contextual iRPE Product term on queries (one head, shared table) for plan_backward_scratch.
std::unique_ptr<rpe::any_term<float>> contextual_query_product(double ratio, int skip, int head_dim) {
    rpe::term_spec spec;
    spec.method = rpe::method::product;
    spec.contextual = true;
    spec.target = rpe::target::query;
    spec.ratio(ratio);
    spec.skip = skip;
    spec.num_heads = 1;
    spec.head_dim = head_dim;
    return rpe::make_term<float>(spec);
}

}  // namespace

TEST_CASE("plan_backward_scratch: hand-checked bytes of a contextual query term, bounded by the budget") {
    // B = H = 1, a 4 x 4 grid (L = 16), D = 4, Product ratio 1 on queries (K = 5·5 = 25), table
    // (1, 4, 25) with its gradient, row_block 1: 16 blocks, chunks = min(32, 16) = 16 items.
    // Per item (floats): table partial 100, per-(key, bucket) sums L·K = 400, grad_k and grad_v
    // partials 64 each: 628; per (batch, head) the recomputed query products 400 more; each buffer
    // one 16-float line more (5 buffers). All at once: 16·628 + 400 + 80 = 10528 floats = 42112
    // bytes. Split: one plane's products 400, accumulator 400, table partial 100 and 7 lines (112):
    // 1012 floats plus 628 per item; the least is one item: 1640 floats.
    const auto term = contextual_query_product(1.0, 0, 4);
    REQUIRE(term->num_buckets() == 25);
    std::vector<float> q(16 * 4, 0.5f), table(100, 0.1f), grad(100);
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {1, 1, 16, 4}};
    in.height = in.width = 4;
    in.rpe_q.term = term.get();
    in.rpe_q.tables = {{table.data(), {1, 4, 25}}};
    in.rpe_q.grad_tables = {{grad.data(), {1, 4, 25}}};
    auto plan = [&](std::int64_t budget, bool saved = false) {
        return rpe::cpu::plan_backward_scratch(in, {.row_block = 1, .backward_budget_bytes = budget}, saved);
    };
    const auto all = plan(rpe::attention_options{}.backward_budget_bytes);
    CHECK(all.chunks == 16);
    CHECK(all.items == 16);
    CHECK(all.items_at_once == 16);
    CHECK(all.all_bytes == 42112);
    CHECK(all.bytes == 42112);
    CHECK(all.min_bytes == 1640 * 4);
    const auto tiny = plan(1);
    CHECK(tiny.bytes == 1640 * 4);
    CHECK(tiny.items_at_once == 1);
    const auto mid = plan(10000);  // 2500 floats: (2500 - 1012) / 628 = 2 items at once
    CHECK(mid.items_at_once == 2);
    CHECK(mid.bytes == (2 * 628 + 1012) * 4);
    CHECK(mid.bytes <= 10000);
    CHECK(plan(42112).items_at_once == 16);
    CHECK(plan(42111).items_at_once == 15);  // split: (10527 - 1012) / 628 = 15
    CHECK(plan(42111).bytes == (15 * 628 + 1012) * 4);
    // saved probabilities: no recomputed products (400 floats and their line fewer)
    CHECK(plan(rpe::attention_options{}.backward_budget_bytes, true).all_bytes == 42112 - 416 * 4);
    // the backward itself under those budgets (split waves of 1, 2 and 15 items, whole planes):
    // the same bits, the table gradient included
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> qx(64), kx(64), vx(64), go(64);
    for (auto* x : {&qx, &kx, &vx, &go, &table})
        for (auto& e : *x) e = normal(rng);
    in.q = {qx.data(), {1, 1, 16, 4}};
    in.k = {kx.data(), {1, 1, 16, 4}};
    in.v = {vx.data(), {1, 1, 16, 4}};
    auto grads = [&](std::int64_t budget) {
        std::vector<float> g(3 * 64 + 100);
        rpe::attention_backward(in,
                                {.grad_out = rpe::tensor_ref<const float>(go.data(), {1, 1, 16, 4}),
                                 .grad_q = rpe::tensor_ref<float>(g.data(), {1, 1, 16, 4}),
                                 .grad_k = rpe::tensor_ref<float>(g.data() + 64, {1, 1, 16, 4}),
                                 .grad_v = rpe::tensor_ref<float>(g.data() + 128, {1, 1, 16, 4})},
                                {.row_block = 1, .backward_budget_bytes = budget});
        std::copy(grad.begin(), grad.end(), g.begin() + 192);
        return g;
    };
    const auto ref = grads(rpe::attention_options{}.backward_budget_bytes);
    for (const std::int64_t budget : {std::int64_t{1}, std::int64_t{10000}, std::int64_t{42111}}) {
        CAPTURE(budget);
        CHECK(grads(budget) == ref);
    }
    // without the table's gradient: 100 floats fewer per item, one buffer fewer
    in.rpe_q.grad_tables.clear();
    CHECK(plan(rpe::attention_options{}.backward_budget_bytes).all_bytes == 42112 - (16 * 100 + 16) * 4);
}

TEST_CASE("plan_backward_scratch: the issue's 100 x 100 grid with K = 1090 stays within the budget") {
    // Product ratio 8 (beta 16: 33·33 buckets) with a class token: K = 1090; D = 8; B = H = 1;
    // L = 10001. Without a budget the 32 items' per-(key, bucket) sums alone take 32·L·K floats.
    const auto term = contextual_query_product(8.0, 1, 8);
    REQUIRE(term->num_buckets() == 1090);
    const std::int64_t l = 10001;
    std::vector<float> q(static_cast<std::size_t>(l * 8), 0.5f), table(8 * 1090, 0.1f), grad(8 * 1090);
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {1, 1, l, 8}};
    in.height = in.width = 100;
    in.rpe_q.term = term.get();
    in.rpe_q.tables = {{table.data(), {1, 8, 1090}}};
    in.rpe_q.grad_tables = {{grad.data(), {1, 8, 1090}}};
    const auto def = rpe::cpu::plan_backward_scratch(in);
    CHECK(def.chunks == 32);
    CHECK(def.all_bytes > std::int64_t{32} * l * 1090 * 4);  // ~1.4 GB
    CHECK(def.bytes <= rpe::attention_options{}.backward_budget_bytes);
    CHECK(def.items_at_once >= 2);
    const std::int64_t per_item = static_cast<std::int64_t>(l) * 1090 * 4;
    for (const std::int64_t budget : {std::int64_t{64} << 20, std::int64_t{1} << 30, std::int64_t{1}}) {
        CAPTURE(budget);
        const auto p = rpe::cpu::plan_backward_scratch(in, {.backward_budget_bytes = budget});
        CHECK(p.bytes <= std::max(budget, p.min_bytes));
        CHECK(p.min_bytes < 4 * per_item);  // one item, the products and the accumulator
    }
}

TEST_CASE("attention options: a backward budget <= 0 is rejected, naming the option and its value") {
    random_attention<float> c(5);
    std::vector<float> out(static_cast<std::size_t>(c.b * c.h * c.l * c.d), 42.0f), gq(out), gk(out), gv(out);
    auto view = [&](std::vector<float>& x) { return rpe::tensor_ref<float>(x.data(), {c.b, c.h, c.l, c.d}); };
    const rpe::tensor_ref<const float> go(c.go.data(), {c.b, c.h, c.l, c.d});
    CHECK_THROWS_WITH_AS(rpe::attention_backward(c.in, go, view(gq), view(gk), view(gv), {.backward_budget_bytes = 0}),
                         "[rpe.attention] options.backward_budget_bytes = 0; expected > 0 (bytes)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(rpe::attention_forward(c.in, view(out), {}, {.backward_budget_bytes = -5}),
                         "[rpe.attention] options.backward_budget_bytes = -5; expected > 0 (bytes)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(rpe::cpu::plan_backward_scratch(c.in, {.backward_budget_bytes = -1}),
                         doctest::Contains("options.backward_budget_bytes = -1"), rpe::invalid_argument);
    for (float x : out) CHECK(x == 42.0f);
    for (float x : gq) CHECK(x == 42.0f);
}

TEST_CASE(
    "float fused backward: the recomputed probabilities are the forward's (the same gradients as from saved ones, bit for bit)") {
    // contextual q, k and v terms (the folded key product, the key-order query lookups with
    // AVX-512F), 1 + 7 x 7 tokens, D = 16: products large enough for Eigen's blocked kernels
    const std::int64_t b = 1, h = 2, height = 7, width = 7, l = 1 + height * width, d = 16, n = b * h * l * d;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(n), k(n), v(n), go(n), out(n), attn(static_cast<std::size_t>(b * h * l * l));
    for (auto* x : {&q, &k, &v, &go})
        for (auto& e : *x) e = normal(rng);
    rpe::attention_inputs<float> in;
    in.q = {q.data(), {b, h, l, d}};
    in.k = {k.data(), {b, h, l, d}};
    in.v = {v.data(), {b, h, l, d}};
    in.height = static_cast<int>(height);
    in.width = static_cast<int>(width);
    std::vector<std::unique_ptr<rpe::any_term<float>>> terms;
    std::vector<float> tables[3];
    std::vector<float> grads[2][3];
    rpe::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
    for (int t = 0; t < 3; ++t) {
        const rpe::term_spec spec = contextual_product(targets[t], h, d);
        terms.push_back(rpe::make_term<float>(spec));
        slots[t]->term = terms.back().get();
        const auto shape = terms.back()->table_shape();
        tables[t].resize(static_cast<std::size_t>(shape[0] * shape[1] * shape[2]));
        for (auto& e : tables[t]) e = 0.3f * normal(rng);
        slots[t]->tables = {rpe::tensor_ref<const float>(tables[t].data(), {shape[0], shape[1], shape[2]})};
    }
    rpe_test::set_threads(1);
    rpe::attention_forward(in, rpe::tensor_ref<float>(out.data(), {b, h, l, d}),
                           rpe::tensor_ref<float>(attn.data(), {b, h, l, l}));
    std::vector<float> gq[2], gk[2], gv[2];
    for (int saved = 0; saved < 2; ++saved) {
        for (auto* x : {&gq[saved], &gk[saved], &gv[saved]}) x->assign(static_cast<std::size_t>(n), -3.0f);
        for (int t = 0; t < 3; ++t) {
            const auto shape = terms[static_cast<std::size_t>(t)]->table_shape();
            grads[saved][t].assign(tables[t].size(), -3.0f);
            slots[t]->grad_tables = {rpe::tensor_ref<float>(grads[saved][t].data(), {shape[0], shape[1], shape[2]})};
        }
        auto view = [&](std::vector<float>& x) { return rpe::tensor_ref<float>(x.data(), {b, h, l, d}); };
        rpe::attention_gradients<float> g{.grad_out = rpe::tensor_ref<const float>(go.data(), {b, h, l, d}),
                                          .grad_q = view(gq[saved]),
                                          .grad_k = view(gk[saved]),
                                          .grad_v = view(gv[saved])};
        if (saved) g.saved_attn = rpe::tensor_ref<const float>(attn.data(), {b, h, l, l});
        rpe::attention_backward(in, g);
    }
    rpe_test::set_threads(2);
    CHECK(gq[0] == gq[1]);
    CHECK(gk[0] == gk[1]);
    CHECK(gv[0] == gv[1]);
    for (int t = 0; t < 3; ++t) CHECK(grads[0][t] == grads[1][t]);
    CHECK(std::isfinite(gq[0][5]));
    CHECK(gq[0][5] != -3.0f);
}

}  // namespace rpe_unit_attention_fused
