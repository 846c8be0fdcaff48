// Bucket ids held as (L, L) tables or computed on the fly (rpe::id_storage), 3D grids
// (mapping::product3d on T × H × W video tokens), and large grids (256 × 256, L = 65537) that
// need no L² memory.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_robustness_ids {

namespace {

using rpe::id_storage;
using rpe::index::clip;
using rpe::index::piecewise;
using rpe_test::cview;
using rpe_test::mview;
using rpe_test::throws_with;
namespace mapping = rpe::mapping;

const piecewise r19 = piecewise::from_ratio(1.9);

// Every id of `a` read through rows() (both orders, whole and in blocks) and at() equals `b`'s at().
template <class Id>
void check_rows_equal(const rpe::bucket_ids& a, const rpe::bucket_ids& b) {
    const std::int64_t n = a.length();
    std::vector<Id> buf(static_cast<std::size_t>(n * n));
    for (int t = 0; t < a.num_tables(); ++t)
        for (const bool transposed : {false, true}) {
            CAPTURE(t);
            CAPTURE(transposed);
            const Id* whole = a.rows<Id>(t, 0, n, transposed, buf.data());
            std::vector<Id> copy(whole, whole + n * n);
            std::int64_t bad = 0;
            for (std::int64_t i = 0; i < n; ++i) {
                std::vector<Id> one(static_cast<std::size_t>(n));
                const Id* r = a.rows<Id>(t, i, 1, transposed, one.data());
                for (std::int64_t j = 0; j < n; ++j) {
                    const int expected = transposed ? b.at(t, static_cast<int>(j), static_cast<int>(i))
                                                    : b.at(t, static_cast<int>(i), static_cast<int>(j));
                    bad +=
                        (static_cast<int>(copy[static_cast<std::size_t>(i * n + j)]) != expected) +
                        (static_cast<int>(r[j]) != expected) +
                        (a.at(t, static_cast<int>(i), static_cast<int>(j)) != b.at(t, static_cast<int>(i), static_cast<int>(j)));
                }
            }
            CHECK(bad == 0);
        }
}

// Contextual key term by its definition: out[b,h,i,j] = Σ_d x[b,h,i,d]·table[h', d, id(i, j)].
std::vector<double> key_term_by_definition(const rpe::bucket_ids& ids, const std::vector<double>& x,
                                           const std::vector<double>& table, std::int64_t b, std::int64_t h, std::int64_t d,
                                           std::int64_t k, bool shared) {
    const std::int64_t n = ids.length();
    std::vector<double> out(static_cast<std::size_t>(b * h * n * n));
    for (std::int64_t p = 0; p < b * h; ++p)
        for (std::int64_t i = 0; i < n; ++i)
            for (std::int64_t j = 0; j < n; ++j) {
                const std::int64_t id = ids.at(0, static_cast<int>(i), static_cast<int>(j));
                const std::int64_t th = shared ? 0 : p % h;
                double s = 0;
                for (std::int64_t e = 0; e < d; ++e)
                    s +=
                        x[static_cast<std::size_t>((p * n + i) * d + e)] * table[static_cast<std::size_t>((th * d + e) * k + id)];
                out[static_cast<std::size_t>((p * n + i) * n + j)] = s;
            }
    return out;
}

}  // namespace

TEST_CASE("bucket ids: on-the-fly ids equal the (L, L) table for every mapping, skip and order") {
    for (int skip : {0, 1, 2})
        for (int h : {1, 3, 6})
            for (int w : {1, 5, 7}) {
                CAPTURE(skip);
                CAPTURE(h);
                CAPTURE(w);
                auto both = [&](const auto& m) {
                    const auto table = rpe::build_bucket_ids(m, h, w, skip, id_storage::table);
                    const auto fly = rpe::build_bucket_ids(m, h, w, skip, id_storage::on_the_fly);
                    CHECK(table->storage_kind() == id_storage::table);
                    CHECK(fly->storage_kind() == id_storage::on_the_fly);
                    CHECK(fly->bytes() < table->bytes() + 1);
                    check_rows_equal<std::uint8_t>(*fly, *table);
                    check_rows_equal<std::uint32_t>(*table, *fly);  // widened copies
                };
                both(mapping::product<>{r19});
                both(mapping::cross<>{r19});
                both(mapping::euclidean<>{r19});
                both(mapping::quantization<>{r19});
            }
}

TEST_CASE("bucket ids: storage is part of the cache key; automatic picks the table for small grids") {
    rpe::bucket_cache cache;
    const mapping::product<> m{r19};
    const auto a = cache.get(m, 14, 14, 1);
    const auto t = cache.get(m, 14, 14, 1, id_storage::table);
    const auto f = cache.get(m, 14, 14, 1, id_storage::on_the_fly);
    CHECK(a.get() == t.get());
    CHECK(a->storage_kind() == id_storage::table);
    CHECK(f.get() != t.get());
    CHECK(cache.size() == 2);
    // 197 × 197 one-byte ids, plus the 27 × 27 per-offset ids
    CHECK(t->bytes() == 197 * 197 + 27 * 27);
    CHECK(f->bytes() == 27 * 27);
    CHECK(throws_with([&] { f->visit(0, [](const auto*) { return 0; }); }, "visit() needs table storage"));
}

TEST_CASE("terms give the same results with table and on-the-fly ids (every mode and target)") {
    const mapping::cross<> m{r19};
    const auto fly = rpe::build_bucket_ids(m, 3, 5, 1, id_storage::on_the_fly);
    auto run = [&]<class Md, rpe::target Tg>() {
        using term_type = rpe::term<mapping::cross<>, Md, Tg, double>;
        rpe_test::term_problem<term_type> p(term_type(m, {.num_heads = 2, .head_dim = 3, .shared_head = false, .skip = 1}), 2, 3,
                                            5, 17);
        const auto& table = p.ids;
        REQUIRE(table->storage_kind() == id_storage::table);
        auto gt_a = std::vector<std::vector<double>>{};
        auto gt_b = std::vector<std::vector<double>>{};
        const auto out_a = p.forward();
        std::vector<double> gx_a(p.x.size()), gx_b(p.x.size());
        p.term.backward(*table, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape),
                        p.xshape.empty() ? rpe::tensor_ref<double>{} : mview(gx_a, p.xshape), p.grad_refs(gt_a),
                        rpe::write::overwrite);
        std::vector<double> out_b(out_a.size());
        p.term.forward(*fly, p.table_refs(), p.x_ref(), mview(out_b, p.oshape), rpe::write::overwrite);
        p.term.backward(*fly, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape),
                        p.xshape.empty() ? rpe::tensor_ref<double>{} : mview(gx_b, p.xshape), p.grad_refs(gt_b),
                        rpe::write::overwrite);
        CHECK(out_a == out_b);
        CHECK(gx_a == gx_b);
        CHECK(gt_a == gt_b);
    };
    run.operator()<rpe::mode::bias, rpe::target::key>();
    run.operator()<rpe::mode::bias, rpe::target::query>();
    run.operator()<rpe::mode::contextual, rpe::target::key>();
    run.operator()<rpe::mode::contextual, rpe::target::query>();
    run.operator()<rpe::mode::contextual, rpe::target::value>();
}

TEST_CASE("product3d: hand-checked ids on a 2 x 3 x 3 grid with a class token") {
    // clip(1) on every axis: 3·3·3 = 27 buckets, id = ((g(dt)+1)·3 + g(dr)+1)·3 + g(dc)+1, extra id 27
    const mapping::product3d<clip> m{clip{1}, clip{1}, clip{1}};
    CHECK(m.num_buckets() == 27);
    const auto ids = rpe::build_bucket_ids(m, 2, 3, 3, 1, id_storage::automatic);
    CHECK(ids->length() == 19);
    CHECK(ids->num_buckets() == 28);
    CHECK(ids->grid_string() == "2x3x3");
    auto tok = [](int t, int r, int c) { return 1 + (t * 3 + r) * 3 + c; };
    CHECK(ids->at(0, 0, 5) == 27);                        // class token query
    CHECK(ids->at(0, 7, 0) == 27);                        // class token key
    CHECK(ids->at(0, tok(0, 0, 0), tok(1, 2, 2)) == 0);   // offset (-1, -2, -2) → (-1, -1, -1)
    CHECK(ids->at(0, tok(1, 1, 1), tok(0, 0, 0)) == 26);  // (1, 1, 1)
    CHECK(ids->at(0, tok(0, 1, 2), tok(1, 1, 0)) == 5);   // (-1, 0, 2 → 1): (0·3 + 1)·3 + 2
    CHECK(ids->at(0, tok(1, 0, 1), tok(1, 0, 1)) == 13);  // (0, 0, 0), the centre
    CHECK(ids->at(0, tok(1, 2, 0), tok(0, 2, 1)) == 21);  // (1, 0, -1): (2·3 + 1)·3 + 0
    // every pair against the mapping called directly
    const auto fly = rpe::build_bucket_ids(m, 2, 3, 3, 1, id_storage::on_the_fly);
    int bad = 0;
    for (int i = 1; i < 19; ++i)
        for (int j = 1; j < 19; ++j) {
            const int gi = i - 1, gj = j - 1;
            const int expected = m.bucket(gi / 9 - gj / 9, (gi % 9) / 3 - (gj % 9) / 3, gi % 3 - gj % 3);
            bad += (ids->at(0, i, j) != expected) + (fly->at(0, i, j) != expected);
        }
    CHECK(bad == 0);
    check_rows_equal<std::uint8_t>(*fly, *ids);
    // depth 1: the 2D Product ids shifted by βt·(2βr+1)(2βc+1)
    const auto flat = rpe::build_bucket_ids(mapping::product3d<piecewise>{r19, r19, r19}, 1, 4, 5, 0, id_storage::table);
    const auto flat2d = rpe::build_bucket_ids(mapping::product<>{r19}, 4, 5, 0);
    bad = 0;
    for (int i = 0; i < 20; ++i)
        for (int j = 0; j < 20; ++j) bad += flat->at(0, i, j) != flat2d->at(0, i, j) + 3 * 49;
    CHECK(bad == 0);
}

TEST_CASE("product3d: validation and the depth of 2D mappings") {
    CHECK(throws_with([] { (void)rpe::build_bucket_ids(mapping::product<>{r19}, 2, 3, 3, 0, id_storage::automatic); },
                      "depth = 2 with a 2D mapping"));
    CHECK(throws_with(
        [] {
            (void)rpe::build_bucket_ids(mapping::product3d<clip>{clip{1}, clip{1}, clip{1}}, 0, 3, 3, 0, id_storage::automatic);
        },
        "depth = 0"));
    CHECK(throws_with([] { mapping::product3d<clip>{clip{-1}, clip{1}, clip{1}}.validate(); }, "beta = -1"));
    CHECK(throws_with(
        [] {
            mapping::product3d<clip>{clip{2000}, clip{2000}, clip{2000}}.validate();
        },
        "buckets; expected at most 2^31 - 1"));
    static_assert(rpe::Mapping3D<mapping::product3d<>> && !rpe::Mapping<mapping::product3d<>>);
    static_assert(!rpe::Mapping3D<mapping::cross<>>);  // Cross's bucket(dr, dc, table) is not a 3D mapping
}

TEST_CASE("product3d: the contextual key term equals its definition; fused equals composed attention") {
    const mapping::product3d<clip> m{clip{1}, clip{2}, clip{1}};
    using key_term = rpe::term<mapping::product3d<clip>, rpe::mode::contextual, rpe::target::key, double>;
    const key_term term(m, {.num_heads = 2, .head_dim = 3, .shared_head = false, .skip = 1});
    const auto ids = term.bucket_ids(2, 3, 4);
    REQUIRE(ids->length() == 25);
    const std::int64_t b = 2, h = 2, d = 3, k = term.num_buckets(), n = 25;
    const auto x = rpe_test::random_normal<double>(static_cast<std::size_t>(b * h * n * d), 31);
    const auto table = rpe_test::random_normal<double>(static_cast<std::size_t>(h * d * k), 32);
    std::vector<double> out(static_cast<std::size_t>(b * h * n * n));
    term.forward(*ids, cview(table, {h, d, k}), cview(x, {b, h, n, d}), mview(out, {b, h, n, n}), rpe::write::overwrite);
    CHECK(rpe_test::max_abs_diff(out, key_term_by_definition(*ids, x, table, b, h, d, k, false)) < 1e-13);

    // the attention step on a video grid: q, k, v terms, fused (both storages) vs composed
    using bias_q = rpe::term<mapping::product3d<clip>, rpe::mode::bias, rpe::target::query, double>;
    using value_term = rpe::term<mapping::product3d<clip>, rpe::mode::contextual, rpe::target::value, double>;
    const auto tk = rpe::make_any_term(term);
    const auto tq = rpe::make_any_term(bias_q(m, {.num_heads = 2, .head_dim = 3, .skip = 1}));
    const auto tv = rpe::make_any_term(value_term(m, {.num_heads = 2, .head_dim = 3, .skip = 1}));
    const auto q = rpe_test::random_normal<double>(static_cast<std::size_t>(b * h * n * d), 33);
    const auto kk = rpe_test::random_normal<double>(q.size(), 34), v = rpe_test::random_normal<double>(q.size(), 35);
    const auto tab_q = rpe_test::random_normal<double>(static_cast<std::size_t>(k), 36);
    const auto tab_v = rpe_test::random_normal<double>(static_cast<std::size_t>(k * d), 37);
    rpe::attention_inputs<double> in;
    in.q = cview(q, {b, h, n, d});
    in.k = cview(kk, {b, h, n, d});
    in.v = cview(v, {b, h, n, d});
    in.depth = 2;
    in.height = 3;
    in.width = 4;
    in.rpe_q = {tq.get(), {cview(tab_q, {1, k})}, {}};
    in.rpe_k = {tk.get(), {cview(table, {h, d, k})}, {}};
    in.rpe_v = {tv.get(), {cview(tab_v, {1, k, d})}, {}};
    std::vector<double> composed(q.size()), attn(static_cast<std::size_t>(b * h * n * n));
    rpe::composed_attention_forward(in, mview(composed, {b, h, n, d}), mview(attn, {b, h, n, n}));
    for (const auto storage : {id_storage::table, id_storage::on_the_fly}) {
        std::vector<double> fused(q.size());
        rpe::attention_forward(in, mview(fused, {b, h, n, d}), {}, {.row_block = 4, .storage = storage});
        CHECK(rpe_test::max_abs_diff(fused, composed) < 1e-12);
    }
    in.depth = 3;  // L no longer matches the grid
    CHECK(throws_with(
        [&] {
            rpe::attention_forward(in, mview(composed, {b, h, n, d}));
        },
        "L = 25 of q; expected skip + depth*height*width = 1 + 3*3*4"));
}

TEST_CASE("a 256 x 256 grid (L = 65537) works with on-the-fly ids and no L^2 memory") {
    const mapping::product<> m{r19};
    rpe::bucket_cache cache;
    const auto ids = cache.get(m, 256, 256, 1);  // automatic: too large for a table
    REQUIRE(ids->storage_kind() == id_storage::on_the_fly);
    CHECK(ids->length() == 65537);
    CHECK(ids->bytes() == 511 * 511);  // per-offset ids only (1 byte each), not 65537² = 4.3 GB
    // the table path refuses clearly (more than bucket_ids::max_bytes = 4 GiB)
    CHECK(throws_with<rpe::out_of_range>([&] { (void)cache.get(m, 256, 256, 1, id_storage::table); },
                                         {"L = 65537", "bucket_ids::max_bytes"}));
    // ids at random pairs, and whole rows far into the matrix (i·L beyond 2^31), against the mapping
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> tok(0, 65536);
    int bad = 0;
    auto expected = [&](int i, int j) {
        if (i < 1 || j < 1) return 49;  // the extra (class token) bucket: K - 1 = 49
        const int gi = i - 1, gj = j - 1;
        return m.bucket(gi / 256 - gj / 256, gi % 256 - gj % 256);
    };
    for (int s = 0; s < 20000; ++s) {
        const int i = tok(rng), j = tok(rng);
        bad += ids->at(0, i, j) != expected(i, j);
    }
    std::vector<std::uint8_t> row(65537);
    for (const int i : {0, 1, 40000, 65536})
        for (const bool transposed : {false, true}) {
            const std::uint8_t* r = ids->rows<std::uint8_t>(0, i, 1, transposed, row.data());
            for (int j = 0; j < 65537; j += 7) bad += r[j] != (transposed ? expected(j, i) : expected(i, j));
        }
    CHECK(bad == 0);
}

TEST_CASE("fused attention on a 64 x 64 grid: on-the-fly ids give bit-identical results to the table") {
    const mapping::product<> m{r19};
    using bias_k = rpe::term<mapping::product<>, rpe::mode::bias, rpe::target::key, float>;
    using ctx_q = rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::query, float>;
    using ctx_v = rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::value, float>;
    const auto tk = rpe::make_any_term(bias_k(m, {.num_heads = 1, .head_dim = 4, .skip = 1}));
    const auto tq = rpe::make_any_term(ctx_q(m, {.num_heads = 1, .head_dim = 4, .skip = 1}));
    const auto tv = rpe::make_any_term(ctx_v(m, {.num_heads = 1, .head_dim = 4, .skip = 1}));
    const std::int64_t n = 4097, d = 4, k = tk->num_buckets();
    const auto q = rpe_test::random_normal<float>(static_cast<std::size_t>(n * d), 41);
    const auto kk = rpe_test::random_normal<float>(q.size(), 42), v = rpe_test::random_normal<float>(q.size(), 43);
    const auto go = rpe_test::random_normal<float>(q.size(), 44);
    const auto tab_k = rpe_test::random_normal<float>(static_cast<std::size_t>(k), 45);
    const auto tab_q = rpe_test::random_normal<float>(static_cast<std::size_t>(d * k), 46);
    const auto tab_v = rpe_test::random_normal<float>(static_cast<std::size_t>(k * d), 47);
    rpe::attention_inputs<float> in;
    in.q = cview(q, {1, 1, n, d});
    in.k = cview(kk, {1, 1, n, d});
    in.v = cview(v, {1, 1, n, d});
    in.height = 64;
    in.width = 64;
    in.rpe_k = {tk.get(), {cview(tab_k, {1, k})}, {}};
    in.rpe_q = {tq.get(), {cview(tab_q, {1, d, k})}, {}};
    in.rpe_v = {tv.get(), {cview(tab_v, {1, k, d})}, {}};
    std::vector<std::vector<float>> r(2, std::vector<float>(q.size())), gq = r, gk = r, gv = r,
                                                                        gt(2, std::vector<float>(tab_q.size()));
    for (int s = 0; s < 2; ++s) {
        const rpe::attention_options opt{.row_block = 0, .storage = s == 0 ? id_storage::table : id_storage::on_the_fly};
        in.rpe_q.grad_tables = {mview(gt[static_cast<std::size_t>(s)], {1, d, k})};
        rpe::attention_forward(in, mview(r[static_cast<std::size_t>(s)], {1, 1, n, d}), {}, opt);
        rpe::attention_backward(in, cview(go, {1, 1, n, d}), mview(gq[static_cast<std::size_t>(s)], {1, 1, n, d}),
                                mview(gk[static_cast<std::size_t>(s)], {1, 1, n, d}),
                                mview(gv[static_cast<std::size_t>(s)], {1, 1, n, d}), opt);
    }
    CHECK(r[0] == r[1]);
    CHECK(gq[0] == gq[1]);
    CHECK(gk[0] == gk[1]);
    CHECK(gv[0] == gv[1]);
    CHECK(gt[0] == gt[1]);
    for (const float x : r[0]) REQUIRE(std::isfinite(x));
}

}  // namespace rpe_unit_robustness_ids
