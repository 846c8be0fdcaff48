// The fused attention (rpe::attention_forward / attention_backward) equals the composition of
// single terms (rpe::composed_attention_*) for random shapes, term combinations, masks, row
// blocks, thread counts and id storages (tables, on the fly); and the fused results do not depend
// on the thread count.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

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
        const rpe::method methods[] = {rpe::method::product, rpe::method::cross, rpe::method::euclidean, rpe::method::quantization};
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

template <class S>
struct results {
    std::vector<S> out, attn, gq, gk, gv;
    std::vector<std::vector<S>> gt;
};

template <class S>
results<S> run(random_attention<S>& c, bool fused, std::int64_t row_block,
               rpe::id_storage storage = rpe::id_storage::automatic) {
    results<S> r;
    const auto n = static_cast<std::size_t>(c.b * c.h * c.l * c.d);
    r.out.assign(n, S(-3));
    r.gq.assign(n, S(-3));
    r.gk.assign(n, S(-3));
    r.gv.assign(n, S(-3));
    r.attn.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.l), S(-3));
    c.bind_grads(r.gt);
    const rpe::tensor_ref<S> attn(r.attn.data(), {c.b, c.h, c.l, c.l});
    auto view = [&](std::vector<S>& x) { return rpe::tensor_ref<S>(x.data(), {c.b, c.h, c.l, c.d}); };
    const rpe::tensor_ref<const S> go(c.go.data(), {c.b, c.h, c.l, c.d});
    if (fused) {
        const rpe::attention_options opt{.row_block = row_block, .storage = storage};
        rpe::attention_forward(c.in, view(r.out), attn, opt);
        rpe::attention_backward(c.in, go, view(r.gq), view(r.gk), view(r.gv), opt);
    } else {
        rpe::composed_attention_forward(c.in, view(r.out), attn);
        rpe::composed_attention_backward(c.in, rpe::tensor_ref<const S>(attn), go, view(r.gq), view(r.gk), view(r.gv));
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

void set_threads([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
}

}  // namespace

TEST_CASE("fused attention equals the composed attention on random configurations") {
    for (std::uint32_t seed = 1; seed <= 40; ++seed) {
        CAPTURE(seed);
        random_attention<double> c(seed);
        const auto composed = run(c, false, 0);
        const std::int64_t row_block = 1 + static_cast<std::int64_t>(seed % 5);
        set_threads(1 + static_cast<int>(seed % 3));
        // ids as (L, L) tables and computed on the fly (rpe::id_storage) give the same results
        for (const auto storage : {rpe::id_storage::table, rpe::id_storage::on_the_fly}) {
            CAPTURE(static_cast<int>(storage));
            const auto fused = run(c, true, row_block, storage);
            CHECK(max_rel_diff(fused.out, composed.out) < 1e-12);
            CHECK(max_rel_diff(fused.attn, composed.attn) < 1e-12);
            CHECK(max_rel_diff(fused.gq, composed.gq) < 1e-12);
            CHECK(max_rel_diff(fused.gk, composed.gk) < 1e-12);
            CHECK(max_rel_diff(fused.gv, composed.gv) < 1e-12);
            REQUIRE(fused.gt.size() == composed.gt.size());
            for (std::size_t t = 0; t < fused.gt.size(); ++t) CHECK(max_rel_diff(fused.gt[t], composed.gt[t]) < 1e-12);
        }
    }
    set_threads(2);
}

TEST_CASE("fused attention gives bit-identical results for 1, 2 and 4 threads") {
    for (std::uint32_t seed = 100; seed < 110; ++seed) {
        CAPTURE(seed);
        random_attention<float> c(seed);
        set_threads(1);
        const auto one = run(c, true, 3);
        for (int threads : {2, 4}) {
            set_threads(threads);
            const auto many = run(c, true, 3);
            CHECK(many.out == one.out);
            CHECK(many.gq == one.gq);
            CHECK(many.gk == one.gk);
            CHECK(many.gv == one.gv);
            CHECK(many.gt == one.gt);
        }
    }
    set_threads(2);
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
        CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d + 1})), rpe::invalid_argument);
    }
    SUBCASE("wrong grid") {
        c.in.height += 1;
        if (c.in.rpe_q.term || c.in.rpe_k.term || c.in.rpe_v.term)
            CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d})), rpe::invalid_argument);
    }
    SUBCASE("out aliases q") {
        CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(c.q.data(), {c.b, c.h, c.l, c.d})), rpe::invalid_argument);
    }
    SUBCASE("negative row block") {
        CHECK_THROWS_AS(rpe::attention_forward(c.in, rpe::tensor_ref<float>(out.data(), {c.b, c.h, c.l, c.d}), {}, {.row_block = -1}),
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
