// rpe::term properties (paper eqs. 13–17) on random data: write::accumulate, bias broadcasting, the
// naive O(L²·D) definitions of the contextual terms, and shared-table gradient collection.
// (The golden term cases and rpe::make_term are in test_core_term.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/term.hpp>
#include <rpe/make_term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_term_props {

namespace {

using rpe::target;
using rpe::index::piecewise;
namespace mapping = rpe::mapping;
namespace mode = rpe::mode;
using rpe_test::cview;
using rpe_test::mview;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Term types used below: Product (one table) and Cross (two tables) in each (mode, target).
// ---------------------------------------------------------------------------------------------
namespace {

const piecewise r19 = piecewise::from_ratio(1.9);

template <class M, class Md, target Tg, class S>
rpe_test::term_problem<rpe::term<M, Md, Tg, S>> make_problem(int heads, int dim, bool shared, int skip, int height, int width,
                                                             int batch, unsigned seed) {
    return {rpe::term<M, Md, Tg, S>(M{r19}, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip}), batch,
            height, width, seed};
}

}  // namespace

// Each (mapping, mode, target) once, alternating the scalar type (compile time matters).
TEST_CASE_TEMPLATE("write::accumulate adds: forward and backward into prefilled buffers", T,
                   rpe::term<mapping::product<>, mode::bias, target::key, float>,
                   rpe::term<mapping::product<>, mode::bias, target::query, double>,
                   rpe::term<mapping::product<>, mode::contextual, target::key, double>,
                   rpe::term<mapping::product<>, mode::contextual, target::query, float>,
                   rpe::term<mapping::product<>, mode::contextual, target::value, float>,
                   rpe::term<mapping::cross<>, mode::bias, target::query, double>,
                   rpe::term<mapping::cross<>, mode::contextual, target::key, float>,
                   rpe::term<mapping::cross<>, mode::contextual, target::value, double>) {
    using S = typename T::scalar_type;
    const rpe_test::term_problem<T> p(
        T(typename T::mapping_type{r19}, {.num_heads = 3, .head_dim = 4, .shared_head = false, .skip = 1}), 2, 3, 4, 101);
    const std::vector<S> fresh = p.forward();
    const auto prefill = rpe_test::random_normal<S>(fresh.size(), 7);
    std::vector<S> acc = prefill;
    p.term.forward(*p.ids, p.table_refs(), p.x_ref(), mview(acc, p.oshape), rpe::write::accumulate);
    std::vector<S> expected(fresh.size());
    for (std::size_t i = 0; i < fresh.size(); ++i) expected[i] = prefill[i] + fresh[i];
    const double tol = std::is_same_v<S, float> ? 1e-5 : 1e-12;
    CHECK(rpe_test::max_abs_diff(acc, expected) <= tol);
    CHECK(rpe_test::max_abs_diff(acc, prefill) > 0.1);  // the term is not zero here

    // backward: overwrite into garbage, then accumulate into a prefill
    std::vector<std::vector<S>> g_over, g_acc;
    std::vector<S> gx_over(p.x.size(), S(123)), gx_acc = rpe_test::random_normal<S>(p.x.size(), 8);
    const std::vector<S> gx_prefill = gx_acc;
    auto go_refs = p.grad_refs(g_over);
    for (auto& g : g_over) std::fill(g.begin(), g.end(), S(123));
    p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape),
                    p.xshape.empty() ? rpe::tensor_ref<S>{} : mview(gx_over, p.xshape), go_refs, rpe::write::overwrite);
    auto ga_refs = p.grad_refs(g_acc);
    std::vector<std::vector<S>> g_prefill;
    for (auto& g : g_acc) {  // fill in place: ga_refs point into these buffers
        const auto r = rpe_test::random_normal<S>(g.size(), 9);
        std::copy(r.begin(), r.end(), g.begin());
        g_prefill.push_back(g);
    }
    p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape),
                    p.xshape.empty() ? rpe::tensor_ref<S>{} : mview(gx_acc, p.xshape), ga_refs, rpe::write::accumulate);
    for (std::size_t t = 0; t < g_acc.size(); ++t) {
        std::vector<S> sum(g_acc[t].size());
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = g_prefill[t][i] + g_over[t][i];
        CHECK(rpe_test::max_abs_diff(g_acc[t], sum) <= 10 * tol);
    }
    if (!p.xshape.empty()) {
        std::vector<S> sum(gx_acc.size());
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = gx_prefill[i] + gx_over[i];
        CHECK(rpe_test::max_abs_diff(gx_acc, sum) <= 10 * tol);
    }
}

TEST_CASE_TEMPLATE("bias output broadcast to (B, H, L, L) equals the (1, Ht, L, L) result repeated", T,
                   rpe::term<mapping::product<>, mode::bias, target::key, double>,
                   rpe::term<mapping::product<>, mode::bias, target::query, float>,
                   rpe::term<mapping::cross<>, mode::bias, target::key, double>) {
    using S = typename T::scalar_type;
    for (bool shared : {true, false}) {
        CAPTURE(shared);
        const int H = 3, B = 2;
        const rpe_test::term_problem<T> p(
            T(typename T::mapping_type{r19}, {.num_heads = H, .head_dim = 4, .shared_head = shared, .skip = 1}), 1, 3, 4, 202);
        const std::int64_t l = p.l, ht = shared ? 1 : H, plane = l * l;
        const std::vector<S> small = p.forward();  // (1, Ht, L, L)
        REQUIRE(static_cast<std::int64_t>(small.size()) == ht * plane);
        std::vector<S> big(static_cast<std::size_t>(B * H * plane), S(-5));
        p.term.forward(*p.ids, p.table_refs(), {}, mview(big, {B, H, l, l}), rpe::write::overwrite);
        bool repeated = true;
        for (std::int64_t bb = 0; bb < B; ++bb)
            for (std::int64_t hh = 0; hh < H; ++hh)
                for (std::int64_t e = 0; e < plane; ++e)
                    repeated = repeated && big[static_cast<std::size_t>((bb * H + hh) * plane + e)] ==
                                               small[static_cast<std::size_t>((shared ? 0 : hh) * plane + e)];
        CHECK(repeated);
        // (B, Ht, L, L) with B > 1 works too when Ht = H or Ht = 1
        std::vector<S> mid(static_cast<std::size_t>(B * ht * plane));
        p.term.forward(*p.ids, p.table_refs(), {}, mview(mid, {B, ht, l, l}), rpe::write::overwrite);
        CHECK(std::equal(small.begin(), small.end(), mid.begin()));
        CHECK(std::equal(small.begin(), small.end(), mid.begin() + ht * plane));

        // backward of a broadcast grad equals backward of its sum over the broadcast axes
        const auto g_big = rpe_test::random_normal<S>(big.size(), 31);
        std::vector<S> g_small(small.size(), S(0));
        for (std::int64_t bb = 0; bb < B; ++bb)
            for (std::int64_t hh = 0; hh < H; ++hh)
                for (std::int64_t e = 0; e < plane; ++e)
                    g_small[static_cast<std::size_t>((shared ? 0 : hh) * plane + e)] +=
                        g_big[static_cast<std::size_t>((bb * H + hh) * plane + e)];
        std::vector<std::vector<S>> gt_big, gt_small;
        p.term.backward(*p.ids, p.table_refs(), {}, cview(g_big, {B, H, l, l}), {}, p.grad_refs(gt_big), rpe::write::overwrite);
        p.term.backward(*p.ids, p.table_refs(), {}, cview(g_small, {1, ht, l, l}), {}, p.grad_refs(gt_small),
                        rpe::write::overwrite);
        for (std::size_t t = 0; t < gt_big.size(); ++t)
            CHECK(rpe_test::max_abs_diff(gt_big[t], gt_small[t]) <= (std::is_same_v<S, float> ? 1e-4 : 1e-12));
    }
}

// ---------------------------------------------------------------------------------------------
// Contextual terms against the naive O(L²·D) definition (paper eqs. 15–17) on a random case: 2 heads with
// per-head tables, skip 2, a 3x4 grid; Product (one table) and Cross (sum of two).
// ---------------------------------------------------------------------------------------------
TEST_CASE_TEMPLATE("contextual terms equal the naive loops", M, mapping::product<>, mapping::cross<>) {
    using S = double;
    const int H = 2, D = 5, B = 2, skip = 2, height = 3, width = 4;
    constexpr int nt = rpe::detail::num_tables_of<M>();

    SUBCASE("key: out[b,h,i,j] = sum_d x[b,h,i,d] table[h,d,id(i,j)]") {
        auto p = make_problem<M, mode::contextual, target::key, S>(H, D, false, skip, height, width, B, 11);
        const auto out = p.forward();
        const std::int64_t L = p.l, K = p.term.num_buckets();
        REQUIRE(L == 14);
        std::vector<S> naive(out.size(), 0), gx(p.x.size(), 0);
        std::vector<std::vector<S>> gt(nt, std::vector<S>(p.tables[0].size(), 0));
        for (int t = 0; t < nt; ++t)
            for (std::int64_t b = 0; b < B; ++b)
                for (std::int64_t h = 0; h < H; ++h)
                    for (std::int64_t i = 0; i < L; ++i)
                        for (std::int64_t j = 0; j < L; ++j) {
                            const std::int64_t id = p.ids->at(t, static_cast<int>(i), static_cast<int>(j));
                            const std::size_t o = static_cast<std::size_t>(((b * H + h) * L + i) * L + j);
                            for (std::int64_t d = 0; d < D; ++d) {
                                const std::size_t xi = static_cast<std::size_t>(((b * H + h) * L + i) * D + d);
                                const std::size_t ti = static_cast<std::size_t>((h * D + d) * K + id);
                                naive[o] += p.x[xi] * p.tables[static_cast<std::size_t>(t)][ti];
                                gx[xi] += p.grad_out[o] * p.tables[static_cast<std::size_t>(t)][ti];
                                gt[static_cast<std::size_t>(t)][ti] += p.grad_out[o] * p.x[xi];
                            }
                        }
        CHECK(rpe_test::max_abs_diff(out, naive) <= 1e-12);
        std::vector<std::vector<S>> g;
        std::vector<S> gx_lib(p.x.size());
        p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), mview(gx_lib, p.xshape), p.grad_refs(g),
                        rpe::write::overwrite);
        CHECK(rpe_test::max_abs_diff(gx_lib, gx) <= 1e-12);
        for (int t = 0; t < nt; ++t)
            CHECK(rpe_test::max_abs_diff(g[static_cast<std::size_t>(t)], gt[static_cast<std::size_t>(t)]) <= 1e-12);
    }
    SUBCASE("query: out[b,h,i,j] = sum_d x[b,h,j,d] table[h,d,id(j,i)] (the transposed pair)") {
        auto p = make_problem<M, mode::contextual, target::query, S>(H, D, false, skip, height, width, B, 12);
        const auto out = p.forward();
        const std::int64_t L = p.l, K = p.term.num_buckets();
        std::vector<S> naive(out.size(), 0), gx(p.x.size(), 0);
        std::vector<std::vector<S>> gt(nt, std::vector<S>(p.tables[0].size(), 0));
        for (int t = 0; t < nt; ++t)
            for (std::int64_t b = 0; b < B; ++b)
                for (std::int64_t h = 0; h < H; ++h)
                    for (std::int64_t i = 0; i < L; ++i)
                        for (std::int64_t j = 0; j < L; ++j) {
                            const std::int64_t id = p.ids->at(t, static_cast<int>(j), static_cast<int>(i));
                            const std::size_t o = static_cast<std::size_t>(((b * H + h) * L + i) * L + j);
                            for (std::int64_t d = 0; d < D; ++d) {
                                const std::size_t xj = static_cast<std::size_t>(((b * H + h) * L + j) * D + d);
                                const std::size_t ti = static_cast<std::size_t>((h * D + d) * K + id);
                                naive[o] += p.x[xj] * p.tables[static_cast<std::size_t>(t)][ti];
                                gx[xj] += p.grad_out[o] * p.tables[static_cast<std::size_t>(t)][ti];
                                gt[static_cast<std::size_t>(t)][ti] += p.grad_out[o] * p.x[xj];
                            }
                        }
        CHECK(rpe_test::max_abs_diff(out, naive) <= 1e-12);
        // the query term is not the key term: with the same x and table the outputs differ
        auto pk = make_problem<M, mode::contextual, target::key, S>(H, D, false, skip, height, width, B, 12);
        CHECK(rpe_test::max_abs_diff(pk.forward(), out) > 1e-3);
        std::vector<std::vector<S>> g;
        std::vector<S> gx_lib(p.x.size());
        p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), mview(gx_lib, p.xshape), p.grad_refs(g),
                        rpe::write::overwrite);
        CHECK(rpe_test::max_abs_diff(gx_lib, gx) <= 1e-12);
        for (int t = 0; t < nt; ++t)
            CHECK(rpe_test::max_abs_diff(g[static_cast<std::size_t>(t)], gt[static_cast<std::size_t>(t)]) <= 1e-12);
    }
    SUBCASE("value: out[b,h,i,d] = sum_j a[b,h,i,j] table[h,id(i,j),d]") {
        auto p = make_problem<M, mode::contextual, target::value, S>(H, D, false, skip, height, width, B, 13);
        const auto out = p.forward();
        const std::int64_t L = p.l;
        std::vector<S> naive(out.size(), 0), ga(p.x.size(), 0);
        std::vector<std::vector<S>> gt(nt, std::vector<S>(p.tables[0].size(), 0));
        for (int t = 0; t < nt; ++t)
            for (std::int64_t b = 0; b < B; ++b)
                for (std::int64_t h = 0; h < H; ++h)
                    for (std::int64_t i = 0; i < L; ++i)
                        for (std::int64_t j = 0; j < L; ++j) {
                            const std::int64_t id = p.ids->at(t, static_cast<int>(i), static_cast<int>(j));
                            const std::size_t ai = static_cast<std::size_t>(((b * H + h) * L + i) * L + j);
                            for (std::int64_t d = 0; d < D; ++d) {
                                const std::size_t o = static_cast<std::size_t>(((b * H + h) * L + i) * D + d);
                                const std::size_t ti = static_cast<std::size_t>((h * p.term.num_buckets() + id) * D + d);
                                naive[o] += p.x[ai] * p.tables[static_cast<std::size_t>(t)][ti];
                                ga[ai] += p.grad_out[o] * p.tables[static_cast<std::size_t>(t)][ti];
                                gt[static_cast<std::size_t>(t)][ti] += p.grad_out[o] * p.x[ai];
                            }
                        }
        CHECK(rpe_test::max_abs_diff(out, naive) <= 1e-12);
        std::vector<std::vector<S>> g;
        std::vector<S> ga_lib(p.x.size());
        p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), mview(ga_lib, p.xshape), p.grad_refs(g),
                        rpe::write::overwrite);
        CHECK(rpe_test::max_abs_diff(ga_lib, ga) <= 1e-12);
        for (int t = 0; t < nt; ++t)
            CHECK(rpe_test::max_abs_diff(g[static_cast<std::size_t>(t)], gt[static_cast<std::size_t>(t)]) <= 1e-12);
    }
}

TEST_CASE("a shared table collects every head and batch element") {
    // Ht = 1: grad_table = Σ_b Σ_h of the per-(b,h) contributions, equal to a per-head term's
    // grad_tables summed over heads when every head's table is the shared one.
    using T = rpe::term<mapping::product<>, mode::contextual, target::key, double>;
    const int H = 3;
    const rpe_test::term_problem<T> shared(T(mapping::product<>{r19}, {.num_heads = H, .head_dim = 4, .skip = 1}), 2, 3, 3, 303);
    const T per_head(mapping::product<>{r19}, {.num_heads = H, .head_dim = 4, .shared_head = false, .skip = 1});
    const std::int64_t tsize = static_cast<std::int64_t>(shared.tables[0].size());
    std::vector<double> tiled(static_cast<std::size_t>(H * tsize));
    for (int h = 0; h < H; ++h) std::copy(shared.tables[0].begin(), shared.tables[0].end(), tiled.begin() + h * tsize);
    const auto tshape_h = per_head.table_shape();
    std::vector<double> out_s = shared.forward(), out_h(out_s.size());
    per_head.forward(*shared.ids, cview(tiled, tshape_h), shared.x_ref(), mview(out_h, shared.oshape), rpe::write::overwrite);
    CHECK(rpe_test::max_abs_diff(out_s, out_h) <= 1e-12);
    std::vector<std::vector<double>> g;
    std::vector<double> g_h(tiled.size());
    shared.term.backward(*shared.ids, shared.table_refs(), shared.x_ref(), cview(shared.grad_out, shared.oshape), {},
                         shared.grad_refs(g), rpe::write::overwrite);
    per_head.backward(*shared.ids, cview(tiled, tshape_h), shared.x_ref(), cview(shared.grad_out, shared.oshape), {},
                      mview(g_h, tshape_h), rpe::write::overwrite);
    std::vector<double> summed(static_cast<std::size_t>(tsize), 0.0);
    for (int h = 0; h < H; ++h)
        for (std::int64_t e = 0; e < tsize; ++e)
            summed[static_cast<std::size_t>(e)] += g_h[static_cast<std::size_t>(h * tsize + e)];
    CHECK(rpe_test::max_abs_diff(g[0], summed) <= 1e-12);
}

}  // namespace rpe_unit_core_term_props
