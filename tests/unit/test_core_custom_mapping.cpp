// A custom mapping in a few lines, as a user would write it: the Manhattan distance |dr| + |dc|
// through the piecewise index. It plugs into rpe::term, the bucket cache and rpe::any_term like
// the built-in mappings; its term is checked against a hand loop.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include <rpe/any_term.hpp>  // make_any_term only (make_term is not instantiated here)
#include <rpe/bucket_cache.hpp>
#include <rpe/concepts.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_custom_mapping {

namespace {

// --- what a user writes ---------------------------------------------------------------------
/// Undirected Manhattan mapping: id = g(|dr| + |dc|) ∈ [0, βi], so K = βi + 1 (no unused rows).
struct manhattan {
    rpe::index::piecewise index;
    int num_buckets() const { return index.beta_int() + 1; }
    int bucket(int dr, int dc) const { return index(std::int64_t{std::abs(dr) + std::abs(dc)}); }
    void validate() const { index.validate(); }  // optional: checked once when a term or ids are built
    friend bool operator==(const manhattan&, const manhattan&) = default;
};
static_assert(rpe::Mapping<manhattan>);
using manhattan_key_term = rpe::term<manhattan, rpe::mode::contextual, rpe::target::key, double>;
// ---------------------------------------------------------------------------------------------

const manhattan m19{rpe::index::piecewise::from_ratio(1.9)};

int token(int r, int c, int w, int skip) { return skip + r * w + c; }

}  // namespace

TEST_CASE("custom mapping: Manhattan distance ids") {
    // ratio 1.9: g(0..7) = 0 1 2 2 3 3 3 3 (test_core_index.cpp); K = 3 + 1 = 4, +1 with skip.
    CHECK(m19.num_buckets() == 4);
    const int expected[8] = {0, 1, 2, 2, 3, 3, 3, 3};
    for (int dist = 0; dist < 8; ++dist) {
        CAPTURE(dist);
        CHECK(m19.bucket(dist, 0) == expected[dist]);
        CHECK(m19.bucket(0, -dist) == expected[dist]);
    }
    CHECK(m19.bucket(1, 1) == 2);   // |1| + |1| = 2 (Euclidean would say √2 → 1)
    CHECK(m19.bucket(-2, 1) == 2);  // 3
    CHECK(m19.bucket(2, -2) == 3);  // 4

    rpe::bucket_cache cache;
    const auto ids = cache.get(m19, 3, 4, 1);
    CHECK(ids->num_buckets() == 5);
    CHECK(ids->at(0, 0, 5) == 4);                                  // class token: the extra id K
    CHECK(ids->at(0, token(0, 0, 4, 1), token(2, 3, 4, 1)) == 3);  // |−2| + |−3| = 5 → 3
    CHECK(ids->at(0, token(1, 1, 4, 1), token(1, 2, 4, 1)) == 1);
    CHECK(ids->at(0, token(1, 1, 4, 1), token(0, 2, 4, 1)) == 2);
    // a custom mapping is its own cache entry, distinct from a built-in one with the same index
    CHECK(cache.get(rpe::mapping::euclidean<>{m19.index}, 3, 4, 1).get() != ids.get());
    CHECK(cache.get(manhattan{rpe::index::piecewise::from_ratio(1.9)}, 3, 4, 1).get() == ids.get());
    CHECK(cache.builds() == 2);
}

TEST_CASE("custom mapping: a contextual key term over it equals the hand loop") {
    const int H = 2, D = 3, B = 2, skip = 1, height = 3, width = 4;
    rpe_test::term_problem<manhattan_key_term> p(
        manhattan_key_term(m19, {.num_heads = H, .head_dim = D, .shared_head = false, .skip = skip}), B, height, width, 4242);
    const std::int64_t L = p.l, K = p.term.num_buckets();
    REQUIRE(K == 5);
    CHECK(p.term.table_shape() == std::vector<std::int64_t>{H, D, K});
    const auto out = p.forward();
    // out[b,h,i,j] = Σ_d x[b,h,i,d]·table[h,d,id(i,j)], the id computed here from the grid
    std::vector<double> naive(out.size(), 0.0), gx(p.x.size(), 0.0), gt(p.tables[0].size(), 0.0);
    for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t i = 0; i < L; ++i)
                for (std::int64_t j = 0; j < L; ++j) {
                    std::int64_t id = K - 1;
                    if (i >= skip && j >= skip) {
                        const std::int64_t ri = (i - skip) / width, ci = (i - skip) % width, rj = (j - skip) / width,
                                           cj = (j - skip) % width;
                        id = m19.bucket(static_cast<int>(ri - rj), static_cast<int>(ci - cj));
                    }
                    const std::size_t o = static_cast<std::size_t>(((b * H + h) * L + i) * L + j);
                    for (std::int64_t d = 0; d < D; ++d) {
                        const std::size_t xi = static_cast<std::size_t>(((b * H + h) * L + i) * D + d);
                        const std::size_t ti = static_cast<std::size_t>((h * D + d) * K + id);
                        naive[o] += p.x[xi] * p.tables[0][ti];
                        gx[xi] += p.grad_out[o] * p.tables[0][ti];
                        gt[ti] += p.grad_out[o] * p.x[xi];
                    }
                }
    CHECK(rpe_test::max_abs_diff(out, naive) <= 1e-12);
    std::vector<std::vector<double>> g;
    std::vector<double> gx_lib(p.x.size());
    p.term.backward(*p.ids, p.table_refs(), p.x_ref(), rpe_test::cview(p.grad_out, p.oshape), rpe_test::mview(gx_lib, p.xshape),
                    p.grad_refs(g), rpe::write::overwrite);
    CHECK(rpe_test::max_abs_diff(gx_lib, gx) <= 1e-12);
    CHECK(rpe_test::max_abs_diff(g[0], gt) <= 1e-12);

    // and through the type-erased interface
    const auto any = rpe::make_any_term(p.term);
    CHECK(any->num_buckets() == 5);
    std::vector<double> out_any(out.size());
    const rpe::tensor_ref<const double> tables[1] = {rpe_test::cview(p.tables[0], p.tshape)};
    any->forward(*p.ids, tables, p.x_ref(), rpe_test::mview(out_any, p.oshape), rpe::write::overwrite);
    CHECK(out_any == out);
}

TEST_CASE("custom mapping: its validate() runs when a term or ids are built") {
    const manhattan bad{rpe::index::piecewise{2.0, 1.0, 8.0}};
    CHECK(rpe_test::throws_with([&] { (void)manhattan_key_term(bad, {.num_heads = 1, .head_dim = 2}); }, "beta = 1"));
    CHECK(rpe_test::throws_with([&] { (void)rpe::build_bucket_ids(bad, 2, 2, 0); }, "beta = 1"));
}

}  // namespace rpe_unit_core_custom_mapping
