// iRPE terms with keys of another count than the queries (cross-attention, L_k != L) on the CPU:
// the (L, L_k) bucket ids at positions and key_positions against the self-attention ids over one
// token set holding both (hand-built), for a directed mapping and for BEiT's three skip buckets;
// the standalone terms (bias, contextual on q, k, v; shared and per-head tables) against their
// formulas written here, forward, and central finite differences (double), backward; the fused
// attention with each term mode attached against a composed reference written here (logits =
// (q·s)·kᵀ + the terms from the positions and tables, softmax, value term), forward in double and
// float, backward against finite differences in q, k, v and every table (float: against the double
// gradients), on Product and on Cross (two tables, each one's gradient); 16-bit storage (bf16, f16)
// with terms: bit for bit the float call rounded once, and within the float64 bounds; and the
// refusals (wrong positions counts, missing key_positions, a grid with L_k != L, packing, a
// backend without cross_lengths, a standalone term's shapes).
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include "golden.hpp"
#include "half_checks.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_test_irpe_cross {

namespace {

using product = rpe::mapping::product<rpe::index::piecewise>;
// directed (offset and its negation get different ids), so the query target's order shows
const product prod{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};

rpe::tensor_ref<const std::int32_t> pos_ref(const std::vector<std::int32_t>& p) {
    return rpe::tensor_ref<const std::int32_t>(p.data(), {static_cast<std::int64_t>(p.size() / 2), 2});
}

// Hand-made positions (row, col): 4 queries and 6 keys, irregular, one shared position (0, 0),
// a repeat among the keys.
const std::vector<std::int32_t> qpos4 = {0, 0, 1, 2, -1, 1, 2, -1};
const std::vector<std::int32_t> kpos6 = {0, 1, 3, 0, -2, -2, 1, 1, 0, 0, 3, 0};

std::vector<double> random_values(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 0.5);
    std::vector<double> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
    return m;
}

std::int64_t size_of(const std::vector<std::int64_t>& shape) {
    std::int64_t z = 1;
    for (auto e : shape) z *= e;
    return z;
}

// Cross (two tables: rows g(dr), cols g(dc)), the same directed index as `prod`.
using cross_mapping = rpe::mapping::cross<rpe::index::piecewise>;
const cross_mapping crossm{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};

// Ids of queries at `q` and keys at `k` (both (N, 2)) after `skip` extra tokens, from the mapping's
// bucket(dr, dc) (`prod`, or table `table` of `crossm` when `cross` is set): the key target's
// id(i, j), offset qpos_i − kpos_j, and the query target's, offset kpos_j − qpos_i; pairs touching
// an extra token: the extra bucket K − 1.
struct hand_ids {
    const std::vector<std::int32_t>*q, *k;
    int skip = 0, extra = 0;
    bool cross = false;
    int table = 0;
    int bucket(int dr, int dc) const { return cross ? crossm.bucket(dr, dc, table) : prod.bucket(dr, dc); }
    int key(std::int64_t i, std::int64_t j) const {
        if (i < skip || j < skip) return extra;
        const auto a = static_cast<std::size_t>(2 * (i - skip)), b = static_cast<std::size_t>(2 * (j - skip));
        return bucket((*q)[a] - (*k)[b], (*q)[a + 1] - (*k)[b + 1]);
    }
    int query(std::int64_t i, std::int64_t j) const {
        if (i < skip || j < skip) return extra;
        const auto a = static_cast<std::size_t>(2 * (i - skip)), b = static_cast<std::size_t>(2 * (j - skip));
        return bucket((*k)[b] - (*q)[a], (*k)[b + 1] - (*q)[a + 1]);
    }
};

// Compares ids of queries Q and keys K (L, L_k) with the self-attention ids `u` over skip extra
// tokens then Q then K: at(), rows(), the query target's rows and key_rows(). Returns the
// mismatches.
int mismatches_against_union(const rpe::bucket_ids& ids, const rpe::bucket_ids& u, int nq, int nk, int skip) {
    const int l = skip + nq, lk = skip + nk;
    const auto uq = [&](int i) { return i; };                                      // queries: the union's first tokens
    const auto uk = [&](int j) { return j < skip ? j : skip + nq + (j - skip); };  // keys after them
    int wrong = 0;
    for (int t = 0; t < ids.num_tables(); ++t) {
        rpe::visit_id_width(ids.id_bytes(), [&]<class Id>() {
            std::vector<Id> r(static_cast<std::size_t>(l * lk)), rq(r.size()), kr(r.size());
            const Id* a = ids.rows<Id>(t, 0, l, false, r.data());
            const Id* b = ids.rows<Id>(t, 0, l, true, rq.data());
            const Id* c = ids.key_rows<Id>(t, 0, lk, kr.data());
            for (int i = 0; i < l; ++i)
                for (int j = 0; j < lk; ++j) {
                    const int key_id = u.at(t, uq(i), uk(j)), query_id = u.at(t, uk(j), uq(i));
                    wrong += ids.at(t, i, j) != key_id;
                    wrong += static_cast<int>(a[i * lk + j]) != key_id;
                    wrong += static_cast<int>(b[i * lk + j]) != query_id;
                    wrong += static_cast<int>(c[j * l + i]) != query_id;
                }
        });
    }
    return wrong;
}

}  // namespace

TEST_CASE("irpe cross: (L, L_k) ids equal the query rows and key columns of the ids over both token sets") {
    for (const int skip : {0, 1, 2}) {
        CAPTURE(skip);
        std::vector<std::int32_t> both = qpos4;
        both.insert(both.end(), kpos6.begin(), kpos6.end());
        const auto ids = rpe::build_bucket_ids(prod, pos_ref(qpos4), pos_ref(kpos6), skip);
        const auto u = rpe::build_bucket_ids(prod, pos_ref(both), skip);
        REQUIRE(ids->length() == skip + 4);
        REQUIRE(ids->key_length() == skip + 6);
        CHECK(ids->rectangular());
        CHECK(!u->rectangular());
        CHECK(u->key_length() == u->length());
        CHECK(ids->grid_string() == "4 positions, 6 key positions");
        CHECK(u->grid_string() == "10 positions");
        // keys at positions of their own of the queries' count are named too
        CHECK(rpe::build_bucket_ids(prod, pos_ref(qpos4), pos_ref(qpos4), skip)->grid_string() == "4 positions, 4 key positions");
        CHECK(mismatches_against_union(*ids, *u, 4, 6, skip) == 0);
        // and the mapping's ids, by hand: query 1 at (1, 2), key 2 at (-2, -2): offset (3, 4)
        const hand_ids hand{&qpos4, &kpos6, skip, prod.num_buckets()};
        int wrong = 0;
        for (int i = 0; i < skip + 4; ++i)
            for (int j = 0; j < skip + 6; ++j) wrong += ids->at(0, i, j) != hand.key(i, j);
        CHECK(wrong == 0);
        CHECK(ids->at(0, skip + 1, skip + 2) == prod.bucket(3, 4));
        CHECK(prod.bucket(3, 4) != prod.bucket(-3, -4));  // directed: the query target's order matters
        // keys fewer than queries: the same rule
        const auto few = rpe::build_bucket_ids(prod, pos_ref(kpos6), pos_ref(qpos4), skip);
        std::vector<std::int32_t> rev = kpos6;
        rev.insert(rev.end(), qpos4.begin(), qpos4.end());
        CHECK(mismatches_against_union(*few, *rpe::build_bucket_ids(prod, pos_ref(rev), skip), 6, 4, skip) == 0);
        // bounds of at(): i < L, j < L_k
        CHECK_NOTHROW((void)ids->at(0, skip + 3, skip + 5));
        CHECK(rpe_test::throws_with<rpe::out_of_range>([&] { (void)ids->at(0, skip + 4, 0); }, "outside tables [0, 1) x L = "));
    }
    {  // BEiT's three skip buckets: each extra id keeps its role (query extra, key extra, both)
        const rpe::mapping::beit beit{.window_h = 8, .window_w = 8};
        std::vector<std::int32_t> both = qpos4;
        both.insert(both.end(), kpos6.begin(), kpos6.end());
        const auto ids = rpe::build_bucket_ids(beit, pos_ref(qpos4), pos_ref(kpos6), 1);
        const auto u = rpe::build_bucket_ids(beit, pos_ref(both), 1);
        CHECK(mismatches_against_union(*ids, *u, 4, 6, 1) == 0);
        const int k = ids->num_buckets();
        CHECK(ids->at(0, 0, 3) == k - 3);  // class query, patch key
        CHECK(ids->at(0, 3, 0) == k - 2);  // patch query, class key
        CHECK(ids->at(0, 0, 0) == k - 1);
    }
    {  // through a term and the cache: the same ids; key positions of their own count, 3D too
        rpe::bucket_cache cache;
        using T = rpe::term<product, rpe::mode::bias, rpe::target::key, double>;
        const T term(prod, {.num_heads = 1, .head_dim = 1, .skip = 1});
        const auto a = term.bucket_ids(pos_ref(qpos4), pos_ref(kpos6), cache);
        const auto b = rpe::build_bucket_ids(prod, pos_ref(qpos4), pos_ref(kpos6), 1);
        int wrong = 0;
        for (int i = 0; i < 5; ++i)
            for (int j = 0; j < 7; ++j) wrong += a->at(0, i, j) != b->at(0, i, j);
        CHECK(wrong == 0);
    }
}

namespace {

// One standalone term with rectangular ids, double: forward against the formula, backward against
// central finite differences of sum(out · G).
struct term_case {
    bool contextual = false;
    rpe::target target = rpe::target::key;
    bool shared = true;
};

void check_term_case(const term_case& tc) {
    const int skip = 1, heads = 2, dim = 3;
    const std::int64_t b = 2, l = skip + 4, lk = skip + 6;
    const rpe::term_desc desc = rpe::make_term_desc(
        prod, tc.contextual, tc.target, {.num_heads = heads, .head_dim = dim, .shared_head = tc.shared, .skip = skip});
    const auto ids = desc.bucket_ids(pos_ref(qpos4), pos_ref(kpos6));
    const hand_ids hand{&qpos4, &kpos6, skip, desc.num_buckets() - 1};
    const auto tshape = desc.table_shape();
    std::vector<double> table = random_values(static_cast<std::size_t>(size_of(tshape)), 3);
    const bool value = tc.target == rpe::target::value, query = tc.target == rpe::target::query;
    std::vector<std::int64_t> xshape;
    if (tc.contextual)
        xshape = value ? std::vector<std::int64_t>{b, heads, l, lk} : std::vector<std::int64_t>{b, heads, query ? lk : l, dim};
    std::vector<double> x = random_values(static_cast<std::size_t>(xshape.empty() ? 0 : size_of(xshape)), 4);
    const std::vector<std::int64_t> oshape = !tc.contextual ? std::vector<std::int64_t>{1, heads, l, lk}
                                             : value        ? std::vector<std::int64_t>{b, heads, l, dim}
                                                            : std::vector<std::int64_t>{b, heads, l, lk};
    const std::int64_t ht = tc.shared ? 1 : heads, kk = desc.num_buckets();
    // the formula (paper eqs. 13–17 with the reference's rpe_q order)
    const auto formula = [&](const std::vector<double>& tab, const std::vector<double>& xx) {
        std::vector<double> o(static_cast<std::size_t>(size_of(oshape)), 0.0);
        for (std::int64_t bb = 0; bb < oshape[0]; ++bb)
            for (std::int64_t h = 0; h < heads; ++h) {
                const std::int64_t th = ht == 1 ? 0 : h, p = bb * heads + h;
                for (std::int64_t i = 0; i < l; ++i)
                    for (std::int64_t j = 0; j < lk; ++j) {
                        const int id = query ? hand.query(i, j) : hand.key(i, j);
                        if (!tc.contextual) {
                            o[static_cast<std::size_t>((p * l + i) * lk + j)] = tab[static_cast<std::size_t>(th * kk + id)];
                        } else if (value) {
                            const double a = xx[static_cast<std::size_t>((p * l + i) * lk + j)];
                            for (int c = 0; c < dim; ++c)
                                o[static_cast<std::size_t>((p * l + i) * dim + c)] +=
                                    a * tab[static_cast<std::size_t>((th * kk + id) * dim + c)];
                        } else {
                            const std::int64_t row = query ? j : i, rows = query ? lk : l;
                            double s = 0;
                            for (int c = 0; c < dim; ++c)
                                s += xx[static_cast<std::size_t>((p * rows + row) * dim + c)] *
                                     tab[static_cast<std::size_t>((th * dim + c) * kk + id)];
                            o[static_cast<std::size_t>((p * l + i) * lk + j)] = s;
                        }
                    }
            }
        return o;
    };
    const auto xref = [&](const std::vector<double>& xx) {
        return tc.contextual ? rpe::tensor_ref<const double>(xx.data(), xshape) : rpe::tensor_ref<const double>{};
    };
    std::vector<double> out(static_cast<std::size_t>(size_of(oshape)), -1.0);
    const std::array<rpe::tensor_ref<const double>, 1> tabs{rpe::tensor_ref<const double>(table.data(), tshape)};
    rpe::cpu::term_forward<double>(desc, *ids, tabs, xref(x), rpe::tensor_ref<double>(out.data(), oshape), rpe::write::overwrite);
    CHECK(max_abs_diff(out, formula(table, x)) < 1e-12);
    // backward of sum(out · G) against central differences (the term is linear in x and in the table)
    const std::vector<double> g = random_values(out.size(), 5);
    const auto loss = [&](const std::vector<double>& tab, const std::vector<double>& xx) {
        const auto o = formula(tab, xx);
        double s = 0;
        for (std::size_t e = 0; e < o.size(); ++e) s += o[e] * g[e];
        return s;
    };
    std::vector<double> gx(x.size(), 9.0), gt(table.size(), 9.0);
    const std::array<rpe::tensor_ref<double>, 1> gts{rpe::tensor_ref<double>(gt.data(), tshape)};
    rpe::cpu::term_backward<double>(desc, *ids, tabs, xref(x), rpe::tensor_ref<const double>(g.data(), oshape),
                                    tc.contextual ? rpe::tensor_ref<double>(gx.data(), xshape) : rpe::tensor_ref<double>{}, gts,
                                    rpe::write::overwrite);
    const double eps = 1e-6;
    const auto fd = [&](std::vector<double>& v, const std::function<double()>& f) {
        std::vector<double> d(v.size());
        for (std::size_t e = 0; e < v.size(); ++e) {
            const double keep = v[e];
            v[e] = keep + eps;
            const double up = f();
            v[e] = keep - eps;
            const double down = f();
            v[e] = keep;
            d[e] = (up - down) / (2 * eps);
        }
        return d;
    };
    CHECK(max_abs_diff(gt, fd(table, [&] { return loss(table, x); })) < 1e-7);
    if (tc.contextual) CHECK(max_abs_diff(gx, fd(x, [&] { return loss(table, x); })) < 1e-7);
}

}  // namespace

TEST_CASE("irpe cross: standalone terms with (L, L_k) ids, forward (formula) and backward (finite differences)") {
    for (const bool shared : {true, false}) {
        CAPTURE(shared);
        SUBCASE("bias, key") { check_term_case({false, rpe::target::key, shared}); }
        SUBCASE("bias, query") { check_term_case({false, rpe::target::query, shared}); }
        SUBCASE("contextual, key") { check_term_case({true, rpe::target::key, shared}); }
        SUBCASE("contextual, query") { check_term_case({true, rpe::target::query, shared}); }
        SUBCASE("contextual, value") { check_term_case({true, rpe::target::value, shared}); }
    }
}

TEST_CASE("irpe cross: a standalone term names the (L, L_k) shapes it expects") {
    const rpe::term_desc kb = rpe::make_term_desc(prod, false, rpe::target::key, {.num_heads = 1, .head_dim = 2, .skip = 1});
    const auto ids = kb.bucket_ids(pos_ref(qpos4), pos_ref(kpos6));
    std::vector<double> table(static_cast<std::size_t>(kb.num_buckets())), out(5 * 5);
    const std::array<rpe::tensor_ref<const double>, 1> tabs{rpe::tensor_ref<const double>(table.data(), kb.table_shape())};
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::cpu::term_forward<double>(kb, *ids, tabs, {}, rpe::tensor_ref<double>(out.data(), {1, 1, 5, 5}),
                                           rpe::write::overwrite);
        },
        "[rpe.term] out has shape (1, 1, 5, 5); expected (B >= 1, 1, L, L_k) with L = 5, L_k = 7 (bucket ids: skip 1 + 4 "
        "positions, 6 key positions)"));
    const rpe::term_desc qc = rpe::make_term_desc(prod, true, rpe::target::query, {.num_heads = 1, .head_dim = 2, .skip = 1});
    const auto qids = qc.bucket_ids(pos_ref(qpos4), pos_ref(kpos6));
    std::vector<double> qt(static_cast<std::size_t>(size_of(qc.table_shape()))), x(5 * 2), o(5 * 7);
    const std::array<rpe::tensor_ref<const double>, 1> qtabs{rpe::tensor_ref<const double>(qt.data(), qc.table_shape())};
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::cpu::term_forward<double>(qc, *qids, qtabs, rpe::tensor_ref<const double>(x.data(), {1, 1, 5, 2}),
                                           rpe::tensor_ref<double>(o.data(), {1, 1, 5, 7}), rpe::write::overwrite);
        },
        "[rpe.term] x has shape (1, 1, 5, 2); expected (B >= 1, 1, 7, 2) with L = 5, L_k = 7"));
}

namespace {

// A cross-attention problem with iRPE terms at positions: q (B, H, L, D), k, v (B, H, L_k, D),
// L = skip + N queries at qpos, L_k = skip + N_k keys at kpos; terms on q, k, v as a config says,
// on Product (one table per slot) or Cross (two: rows, then cols, held one after the other).
struct slot_config {
    bool on = false, contextual = false, shared = true;
};
struct cross_config {
    slot_config q, k, v;
    int skip = 1;
    bool cross = false;  // the Cross mapping (two tables per slot) instead of Product
};

struct irpe_problem {
    std::int64_t b = 2, h = 2, d = 3, l = 0, lk = 0;
    int skip = 1;
    bool cross = false;
    std::vector<std::int32_t> qp, kp;
    std::vector<double> q, k, v, go;
    std::array<std::optional<rpe::term_desc>, 3> desc;  // q, k, v slots (only those `on`)
    std::array<bool, 3> on{}, ctx{};
    std::array<std::vector<double>, 3> table;  // a slot's tables one after the other (Cross: rows, cols)

    irpe_problem(const cross_config& c, const std::vector<std::int32_t>& qpos, const std::vector<std::int32_t>& kpos)
        : skip(c.skip), cross(c.cross), qp(qpos), kp(kpos) {
        l = skip + static_cast<std::int64_t>(qp.size() / 2);
        lk = skip + static_cast<std::int64_t>(kp.size() / 2);
        q = random_values(static_cast<std::size_t>(b * h * l * d), 61);
        k = random_values(static_cast<std::size_t>(b * h * lk * d), 62);
        v = random_values(static_cast<std::size_t>(b * h * lk * d), 63);
        go = random_values(static_cast<std::size_t>(b * h * l * d), 64);
        const slot_config* s[3] = {&c.q, &c.k, &c.v};
        const rpe::target tg[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
        for (int i = 0; i < 3; ++i) {
            on[i] = s[i]->on;
            ctx[i] = s[i]->contextual || i == 2;
            if (!on[i]) continue;
            const rpe::term_config tc{
                .num_heads = static_cast<int>(h), .head_dim = static_cast<int>(d), .shared_head = s[i]->shared, .skip = skip};
            desc[i].emplace(cross ? rpe::make_term_desc(crossm, ctx[i], tg[i], tc)
                                  : rpe::make_term_desc(prod, ctx[i], tg[i], tc));
            table[i] = random_values(static_cast<std::size_t>(desc[i]->num_tables() * size_of(desc[i]->table_shape())), 70 + i);
        }
    }

    // Views of slot i's tables, one after the other from `data`, each of shape table_shape().
    template <class T>
    std::vector<rpe::tensor_ref<T>> views(std::size_t i, T* data) const {
        const auto shape = desc[i]->table_shape();
        std::vector<rpe::tensor_ref<T>> r;
        for (int t = 0; t < desc[i]->num_tables(); ++t) r.emplace_back(data + t * size_of(shape), shape);
        return r;
    }

    rpe::attention_inputs<double> inputs(const std::vector<double>& qs, const std::vector<double>& ks,
                                         const std::vector<double>& vs, const std::array<std::vector<double>, 3>& tabs) const {
        rpe::attention_inputs<double> in;
        in.q = {qs.data(), {b, h, l, d}};
        in.k = {ks.data(), {b, h, lk, d}};
        in.v = {vs.data(), {b, h, lk, d}};
        in.positions = pos_ref(qp);
        in.key_positions = pos_ref(kp);
        rpe::attention_term<double>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int i = 0; i < 3; ++i)
            if (on[i]) *slots[i] = {.term = &*desc[i], .tables = views(static_cast<std::size_t>(i), tabs[i].data())};
        return in;
    }
    rpe::attention_inputs<double> inputs() const { return inputs(q, k, v, table); }

    // The composed reference: logits = (q·s)·kᵀ + terms from the positions (hand_ids) and tables,
    // softmax, out = a·v + the value term.
    std::vector<double> reference(const std::vector<double>& qs, const std::vector<double>& ks, const std::vector<double>& vs,
                                  const std::array<std::vector<double>, 3>& tabs) const {
        const double s = 1.0 / std::sqrt(static_cast<double>(d));
        std::vector<double> out(static_cast<std::size_t>(b * h * l * d), 0.0);
        for (std::int64_t bb = 0; bb < b; ++bb)
            for (std::int64_t hh = 0; hh < h; ++hh) {
                const std::int64_t p = bb * h + hh;
                for (std::int64_t i = 0; i < l; ++i) {
                    std::vector<double> row(static_cast<std::size_t>(lk));
                    for (std::int64_t j = 0; j < lk; ++j) {
                        double x = 0;
                        for (std::int64_t c = 0; c < d; ++c)
                            x += qs[static_cast<std::size_t>((p * l + i) * d + c)] * s *
                                 ks[static_cast<std::size_t>((p * lk + j) * d + c)];
                        for (int t = 0; t < 2; ++t) {  // 0: q slot, 1: k slot
                            if (!on[t]) continue;
                            const std::int64_t kk = desc[t]->num_buckets(), th = desc[t]->shared_head() ? 0 : hh;
                            for (int tt = 0; tt < desc[t]->num_tables(); ++tt) {  // Cross: rows term + cols term
                                const hand_ids hid{&qp, &kp, skip, desc[t]->num_buckets() - 1, cross, tt};
                                const int id = t == 0 ? hid.query(i, j) : hid.key(i, j);
                                const double* tab = tabs[t].data() + tt * size_of(desc[t]->table_shape());
                                if (!ctx[t]) {
                                    x += tab[th * kk + id];
                                } else {  // q slot: (k·s)·table at the query target's id; k slot: (q·s)·table
                                    for (std::int64_t c = 0; c < d; ++c) {
                                        const double xc = t == 0 ? ks[static_cast<std::size_t>((p * lk + j) * d + c)]
                                                                 : qs[static_cast<std::size_t>((p * l + i) * d + c)];
                                        x += xc * s * tab[(th * d + c) * kk + id];
                                    }
                                }
                            }
                        }
                        row[static_cast<std::size_t>(j)] = x;
                    }
                    const double mx = *std::max_element(row.begin(), row.end());
                    double sum = 0;
                    for (auto& x : row) sum += (x = std::exp(x - mx));
                    for (std::int64_t j = 0; j < lk; ++j) {
                        const double a = row[static_cast<std::size_t>(j)] / sum;
                        for (std::int64_t c = 0; c < d; ++c) {
                            double val = vs[static_cast<std::size_t>((p * lk + j) * d + c)];
                            if (on[2]) {
                                const std::int64_t kk = desc[2]->num_buckets(), th = desc[2]->shared_head() ? 0 : hh;
                                for (int tt = 0; tt < desc[2]->num_tables(); ++tt) {
                                    const hand_ids hid{&qp, &kp, skip, desc[2]->num_buckets() - 1, cross, tt};
                                    val += tabs[2][static_cast<std::size_t>(tt * size_of(desc[2]->table_shape()) +
                                                                            (th * kk + hid.key(i, j)) * d + c)];
                                }
                            }
                            out[static_cast<std::size_t>((p * l + i) * d + c)] += a * val;
                        }
                    }
                }
            }
        return out;
    }
    double loss(const std::vector<double>& qs, const std::vector<double>& ks, const std::vector<double>& vs,
                const std::array<std::vector<double>, 3>& tabs) const {
        const auto out = reference(qs, ks, vs, tabs);
        double s = 0;
        for (std::size_t e = 0; e < out.size(); ++e) s += out[e] * go[e];
        return s;
    }
};

std::vector<double> fd_of(std::vector<double>& x, const std::function<double()>& f) {
    const double eps = 1e-6;
    std::vector<double> g(x.size());
    for (std::size_t e = 0; e < x.size(); ++e) {
        const double keep = x[e];
        x[e] = keep + eps;
        const double up = f();
        x[e] = keep - eps;
        const double down = f();
        x[e] = keep;
        g[e] = (up - down) / (2 * eps);
    }
    return g;
}

void check_cross_config(const cross_config& c, const std::vector<std::int32_t>& qpos, const std::vector<std::int32_t>& kpos) {
    irpe_problem pb(c, qpos, kpos);
    // forward, double: the composed reference
    std::vector<double> out(pb.q.size(), -1.0), attn(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.lk), -1.0);
    rpe::attention_forward(pb.inputs(), rpe::tensor_ref<double>(out.data(), {pb.b, pb.h, pb.l, pb.d}),
                           rpe::tensor_ref<double>(attn.data(), {pb.b, pb.h, pb.l, pb.lk}));
    const auto ref = pb.reference(pb.q, pb.k, pb.v, pb.table);
    CHECK(max_abs_diff(out, ref) < 1e-12);
    // one row per block: the same
    std::vector<double> out1(out.size());
    rpe::attention_forward(pb.inputs(), rpe::tensor_ref<double>(out1.data(), {pb.b, pb.h, pb.l, pb.d}), {}, {.row_block = 1});
    CHECK(max_abs_diff(out1, ref) < 1e-12);
    // float (its own lookups where the unit has AVX-512): within float rounding
    {
        const auto f = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
        const auto qf = f(pb.q), kf = f(pb.k), vf = f(pb.v);
        std::array<std::vector<float>, 3> tf{f(pb.table[0]), f(pb.table[1]), f(pb.table[2])};
        rpe::attention_inputs<float> in;
        in.q = {qf.data(), {pb.b, pb.h, pb.l, pb.d}};
        in.k = {kf.data(), {pb.b, pb.h, pb.lk, pb.d}};
        in.v = {vf.data(), {pb.b, pb.h, pb.lk, pb.d}};
        in.positions = pos_ref(pb.qp);
        in.key_positions = pos_ref(pb.kp);
        rpe::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int i = 0; i < 3; ++i)
            if (pb.on[i])
                *slots[i] = {.term = &*pb.desc[i], .tables = pb.views<const float>(static_cast<std::size_t>(i), tf[i].data())};
        std::vector<float> of(out.size());
        rpe::attention_forward(in, rpe::tensor_ref<float>(of.data(), {pb.b, pb.h, pb.l, pb.d}));
        CHECK(max_abs_diff(std::vector<double>(of.begin(), of.end()), ref) < 1e-5);
    }
    // backward, double: finite differences of the reference in q, k, v and every table
    std::array<std::vector<double>, 3> gt;
    std::vector<double> gq(pb.q.size(), 7.0), gk(pb.k.size(), 7.0), gv(pb.v.size(), 7.0);
    auto in = pb.inputs();
    rpe::attention_term<double>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    for (int i = 0; i < 3; ++i)
        if (pb.on[i]) {
            gt[static_cast<std::size_t>(i)].assign(pb.table[static_cast<std::size_t>(i)].size(), 7.0);
            slots[i]->grad_tables = pb.views(static_cast<std::size_t>(i), gt[static_cast<std::size_t>(i)].data());
        }
    const rpe::attention_gradients<double> ag{.grad_out = {pb.go.data(), {pb.b, pb.h, pb.l, pb.d}},
                                              .grad_q = {gq.data(), {pb.b, pb.h, pb.l, pb.d}},
                                              .grad_k = {gk.data(), {pb.b, pb.h, pb.lk, pb.d}},
                                              .grad_v = {gv.data(), {pb.b, pb.h, pb.lk, pb.d}}};
    rpe::attention_backward(in, ag);
    const auto loss = [&] { return pb.loss(pb.q, pb.k, pb.v, pb.table); };
    CHECK(max_abs_diff(gq, fd_of(pb.q, loss)) < 1e-7);
    CHECK(max_abs_diff(gk, fd_of(pb.k, loss)) < 1e-7);
    CHECK(max_abs_diff(gv, fd_of(pb.v, loss)) < 1e-7);
    for (std::size_t i = 0; i < 3; ++i)
        if (pb.on[i]) {
            CAPTURE(i);
            CHECK(max_abs_diff(gt[i], fd_of(pb.table[i], loss)) < 1e-7);
        }
    // from the forward's probabilities, and with one row per block and a tiny budget: the same gradients
    std::vector<double> gq2(gq.size()), gk2(gk.size()), gv2(gv.size());
    std::array<std::vector<double>, 3> gt2;
    for (std::size_t i = 0; i < 3; ++i)
        if (pb.on[i]) {
            gt2[i].assign(gt[i].size(), 0.0);
            slots[i]->grad_tables = pb.views(i, gt2[i].data());
        }
    rpe::attention_gradients<double> ag2 = ag;
    ag2.grad_q = {gq2.data(), {pb.b, pb.h, pb.l, pb.d}};
    ag2.grad_k = {gk2.data(), {pb.b, pb.h, pb.lk, pb.d}};
    ag2.grad_v = {gv2.data(), {pb.b, pb.h, pb.lk, pb.d}};
    ag2.saved_attn = {attn.data(), {pb.b, pb.h, pb.l, pb.lk}};
    rpe::attention_backward(in, ag2);
    CHECK(max_abs_diff(gq2, gq) < 1e-12);
    CHECK(max_abs_diff(gk2, gk) < 1e-12);
    CHECK(max_abs_diff(gv2, gv) < 1e-12);
    ag2.saved_attn = {};
    rpe::attention_backward(in, ag2, {.row_block = 1, .backward_budget_bytes = 1});
    CHECK(max_abs_diff(gq2, gq) < 1e-12);
    CHECK(max_abs_diff(gk2, gk) < 1e-12);
    CHECK(max_abs_diff(gv2, gv) < 1e-12);
    for (std::size_t i = 0; i < 3; ++i)
        if (pb.on[i]) CHECK(max_abs_diff(gt2[i], gt[i]) < 1e-12);
    // float backward (its own per-key sums where the unit has AVX-512): the double gradients within float rounding
    {
        const auto f = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
        const auto qf = f(pb.q), kf = f(pb.k), vf = f(pb.v), gof = f(pb.go);
        std::array<std::vector<float>, 3> tf{f(pb.table[0]), f(pb.table[1]), f(pb.table[2])}, gtf;
        rpe::attention_inputs<float> fin;
        fin.q = {qf.data(), {pb.b, pb.h, pb.l, pb.d}};
        fin.k = {kf.data(), {pb.b, pb.h, pb.lk, pb.d}};
        fin.v = {vf.data(), {pb.b, pb.h, pb.lk, pb.d}};
        fin.positions = pos_ref(pb.qp);
        fin.key_positions = pos_ref(pb.kp);
        rpe::attention_term<float>* fslots[3] = {&fin.rpe_q, &fin.rpe_k, &fin.rpe_v};
        for (std::size_t i = 0; i < 3; ++i)
            if (pb.on[i]) {
                gtf[i].assign(tf[i].size(), 0.0f);
                *fslots[i] = {.term = &*pb.desc[i],
                              .tables = pb.views<const float>(i, tf[i].data()),
                              .grad_tables = pb.views(i, gtf[i].data())};
            }
        std::vector<float> gqf(gq.size()), gkf(gk.size()), gvf(gv.size());
        rpe::attention_backward(fin, {.grad_out = {gof.data(), {pb.b, pb.h, pb.l, pb.d}},
                                      .grad_q = {gqf.data(), {pb.b, pb.h, pb.l, pb.d}},
                                      .grad_k = {gkf.data(), {pb.b, pb.h, pb.lk, pb.d}},
                                      .grad_v = {gvf.data(), {pb.b, pb.h, pb.lk, pb.d}}});
        const auto d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
        CHECK(max_abs_diff(d(gqf), gq) < 1e-4);
        CHECK(max_abs_diff(d(gkf), gk) < 1e-4);
        CHECK(max_abs_diff(d(gvf), gv) < 1e-4);
        for (std::size_t i = 0; i < 3; ++i)
            if (pb.on[i]) CHECK(max_abs_diff(d(gtf[i]), gt[i]) < 1e-4);
    }
}

}  // namespace

TEST_CASE("irpe cross: the fused attention with L_k != L and each term mode equals the composed reference") {
    const std::vector<std::int32_t> q3 = {0, 0, 2, 1, -1, 2};  // 3 queries: L_k > L and L_k < L below
    const slot_config off{}, bias_shared{true, false, true}, bias_per_head{true, false, false}, ctx_shared{true, true, true},
        ctx_per_head{true, true, false};
    const std::vector<cross_config> configs = {
        {off, bias_shared, off, 1},                 // bias on keys, shared
        {bias_per_head, off, off, 1},               // bias on queries, per head
        {off, ctx_per_head, off, 1},                // contextual keys, per head
        {ctx_shared, off, off, 1},                  // contextual queries, shared
        {off, off, ctx_per_head, 1},                // contextual values, per head
        {ctx_per_head, ctx_shared, ctx_shared, 2},  // all three
        {bias_shared, ctx_per_head, off, 0},        // no skip tokens
    };
    for (std::size_t c = 0; c < configs.size(); ++c) {
        CAPTURE(c);
        check_cross_config(configs[c], qpos4, kpos6);  // L_k > L
        check_cross_config(configs[c], kpos6, q3);     // L_k < L
    }
}

TEST_CASE("irpe cross: the Cross mapping (rows and cols tables) in the fused attention with L_k != L, both tables' gradients") {
    // the two tables of one offset hold different ids (rows g(dr), cols g(dc)), so a swapped or
    // dropped table shows in the forward and in each table's gradient
    CHECK(crossm.bucket(3, -1, 0) != crossm.bucket(3, -1, 1));
    CHECK(crossm.bucket(3, -1, 0) != crossm.bucket(-3, 1, 0));  // directed: the query target's order matters
    // the (L, L_k) ids of both tables at the positions, by hand
    for (const int skip : {0, 1}) {
        CAPTURE(skip);
        const auto ids = rpe::build_bucket_ids(crossm, pos_ref(qpos4), pos_ref(kpos6), skip);
        REQUIRE(ids->num_tables() == 2);
        int wrong = 0;
        for (int t = 0; t < 2; ++t) {
            const hand_ids hand{&qpos4, &kpos6, skip, crossm.num_buckets(), true, t};
            for (int i = 0; i < skip + 4; ++i)
                for (int j = 0; j < skip + 6; ++j) wrong += ids->at(t, i, j) != hand.key(i, j);
        }
        CHECK(wrong == 0);
        // query 1 at (1, 2), key 2 at (-2, -2): offset (3, 4)
        CHECK(ids->at(0, skip + 1, skip + 2) == crossm.bucket(3, 4, 0));
        CHECK(ids->at(1, skip + 1, skip + 2) == crossm.bucket(3, 4, 1));
    }
    const std::vector<std::int32_t> q3 = {0, 0, 2, 1, -1, 2};  // 3 queries: L_k > L and L_k < L below
    const slot_config off{}, bias_shared{true, false, true}, bias_per_head{true, false, false}, ctx_shared{true, true, true},
        ctx_per_head{true, true, false};
    const std::vector<cross_config> configs = {
        {off, bias_shared, off, 1, true},                 // bias on keys, shared
        {bias_per_head, off, off, 1, true},               // bias on queries, per head
        {off, ctx_per_head, off, 1, true},                // contextual keys, per head
        {ctx_shared, off, off, 1, true},                  // contextual queries, shared
        {off, off, ctx_per_head, 1, true},                // contextual values, per head
        {ctx_per_head, ctx_shared, ctx_shared, 2, true},  // all three
        {bias_shared, ctx_per_head, off, 0, true},        // no skip tokens
    };
    for (std::size_t c = 0; c < configs.size(); ++c) {
        CAPTURE(c);
        check_cross_config(configs[c], qpos4, kpos6);  // L_k > L
        check_cross_config(configs[c], kpos6, q3);     // L_k < L
    }
}

namespace {

// The problem's inputs on storage S (q, k, v and each slot's tables from the vectors given).
template <class S>
rpe::attention_inputs<S> inputs_of(const irpe_problem& pb, const std::vector<S>& q, const std::vector<S>& k,
                                   const std::vector<S>& v, const std::array<std::vector<S>, 3>& tabs) {
    rpe::attention_inputs<S> in;
    in.q = {q.data(), {pb.b, pb.h, pb.l, pb.d}};
    in.k = {k.data(), {pb.b, pb.h, pb.lk, pb.d}};
    in.v = {v.data(), {pb.b, pb.h, pb.lk, pb.d}};
    in.positions = pos_ref(pb.qp);
    in.key_positions = pos_ref(pb.kp);
    rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    for (std::size_t i = 0; i < 3; ++i)
        if (pb.on[i]) *slots[i] = {.term = &*pb.desc[i], .tables = pb.views(i, tabs[i].data())};
    return in;
}

// The forward's output and probabilities, and the backward's gradients (q, k, v, each slot's tables).
template <class S>
struct cross_run {
    std::vector<S> out, attn, q, k, v;
    std::array<std::vector<S>, 3> tables;
};

template <class S>
cross_run<S> run_on(const irpe_problem& pb, rpe::attention_inputs<S> in, const std::vector<S>& go) {
    cross_run<S> r;
    const std::int64_t b = pb.b, h = pb.h, l = pb.l, lk = pb.lk, d = pb.d;
    r.out.assign(static_cast<std::size_t>(b * h * l * d), S(-3.0f));
    r.attn.assign(static_cast<std::size_t>(b * h * l * lk), S(-3.0f));
    rpe::attention_forward(in, rpe::tensor_ref<S>(r.out.data(), {b, h, l, d}), rpe::tensor_ref<S>(r.attn.data(), {b, h, l, lk}));
    r.q.assign(static_cast<std::size_t>(b * h * l * d), S(-3.0f));
    r.k.assign(static_cast<std::size_t>(b * h * lk * d), S(-3.0f));
    r.v.assign(r.k.size(), S(-3.0f));
    rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    for (std::size_t i = 0; i < 3; ++i)
        if (pb.on[i]) {
            r.tables[i].assign(pb.table[i].size(), S(-3.0f));
            slots[i]->grad_tables = pb.views(i, r.tables[i].data());
        }
    rpe::attention_backward(in, {.grad_out = {go.data(), {b, h, l, d}},
                                 .grad_q = {r.q.data(), {b, h, l, d}},
                                 .grad_k = {r.k.data(), {b, h, lk, d}},
                                 .grad_v = {r.v.data(), {b, h, lk, d}}});
    return r;
}

}  // namespace

// 16-bit storage takes the portable path with L_k != L (docs/attention.md, "Cross-attention"): the
// float attention on the (exact) widened values, each result rounded once. So, as the 16-bit
// cross tests of test_attention_cross.cpp without terms: bit for bit the float call rounded once,
// forward (out, attn) and backward (q, k, v and every table, both of Cross); and against float64
// (the composed reference, the double backward) within the bounds of test_attention_bf16.cpp.
TEST_CASE_TEMPLATE("irpe cross: 16-bit storage with L_k != L and iRPE terms is the float attention rounded once", H, rpe::bf16,
                   rpe::f16) {
    const std::vector<std::int32_t> q3 = {0, 0, 2, 1, -1, 2};
    const slot_config off{}, bias_shared{true, false, true}, bias_per_head{true, false, false}, ctx_shared{true, true, true},
        ctx_per_head{true, true, false};
    const std::vector<cross_config> configs = {
        {ctx_per_head, ctx_shared, ctx_per_head, 1, false},  // Product, contextual on q, k, v
        {bias_per_head, ctx_per_head, ctx_shared, 2, true},  // Cross: bias on q, contextual k and v
        {ctx_shared, bias_shared, off, 0, true},             // Cross: contextual q, bias k, no skip
    };
    const auto half = [](const std::vector<double>& x) {
        std::vector<H> o(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) o[i] = H(static_cast<float>(x[i]));
        return o;
    };
    const double u = rpe_test::half_traits<H>::u;
    for (std::size_t c = 0; c < configs.size(); ++c)
        for (const bool more_keys : {true, false}) {
            CAPTURE(c);
            CAPTURE(more_keys);
            const irpe_problem pb(configs[c], more_keys ? qpos4 : kpos6, more_keys ? kpos6 : q3);
            REQUIRE(pb.l != pb.lk);
            const auto qh = half(pb.q), kh = half(pb.k), vh = half(pb.v), goh = half(pb.go);
            const std::array<std::vector<H>, 3> th{half(pb.table[0]), half(pb.table[1]), half(pb.table[2])};
            using rpe_test::cast_all;
            const auto qf = cast_all<float>(qh), kf = cast_all<float>(kh), vf = cast_all<float>(vh), gof = cast_all<float>(goh);
            const std::array<std::vector<float>, 3> tf{cast_all<float>(th[0]), cast_all<float>(th[1]), cast_all<float>(th[2])};
            const auto qd = cast_all<double>(qh), kd = cast_all<double>(kh), vd = cast_all<double>(vh),
                       god = cast_all<double>(goh);
            const std::array<std::vector<double>, 3> td{cast_all<double>(th[0]), cast_all<double>(th[1]),
                                                        cast_all<double>(th[2])};
            const auto got = run_on(pb, inputs_of(pb, qh, kh, vh, th), goh);
            const auto fl = run_on(pb, inputs_of(pb, qf, kf, vf, tf), gof);
            CHECK(rpe_test::rounded_from(got.out, fl.out));
            CHECK(rpe_test::rounded_from(got.attn, fl.attn));
            CHECK(rpe_test::rounded_from(got.q, fl.q));
            CHECK(rpe_test::rounded_from(got.k, fl.k));
            CHECK(rpe_test::rounded_from(got.v, fl.v));
            for (std::size_t i = 0; i < 3; ++i)
                if (pb.on[i]) {
                    CAPTURE(i);
                    CHECK(rpe_test::rounded_from(got.tables[i], fl.tables[i]));
                }
            // against float64 on the same values: the composed reference (out: one rounding to H
            // and the float computation's 1e-5 of the float check above)
            const auto ref = pb.reference(qd, kd, vd, td);
            double worst = 0;
            for (std::size_t e = 0; e < ref.size(); ++e)
                worst = std::max(worst, std::abs(static_cast<double>(got.out[e]) - ref[e]) / (u * std::abs(ref[e]) + 2e-5));
            CHECK(worst <= 1.0);
            // the gradients against the double backward (itself checked against finite differences
            // above), with test_attention_bf16.cpp's bound: sums of N = L_k + D + K terms, a table's
            // over B·H·L pairs more
            const auto dd = run_on(pb, inputs_of(pb, qd, kd, vd, td), god);
            std::int64_t kmax = 0;
            for (std::size_t i = 0; i < 3; ++i)
                if (pb.on[i]) kmax = std::max<std::int64_t>(kmax, pb.desc[i]->num_buckets());
            const std::int64_t n_sum = std::max(pb.l, pb.lk) + pb.d + kmax;
            CHECK(rpe_test::worst_ratio(got.q, dd.q, n_sum) <= 1.0);
            CHECK(rpe_test::worst_ratio(got.k, dd.k, n_sum) <= 1.0);
            CHECK(rpe_test::worst_ratio(got.v, dd.v, n_sum) <= 1.0);
            for (std::size_t i = 0; i < 3; ++i)
                if (pb.on[i]) {
                    CAPTURE(i);
                    CHECK(rpe_test::worst_ratio(got.tables[i], dd.tables[i], n_sum * pb.b * pb.h * pb.l) <= 1.0);
                }
        }
}

TEST_CASE("irpe cross: wrong positions counts, missing key_positions and a grid with L_k != L are refused by name") {
    irpe_problem pb({{}, {true, true, false}, {}, 1}, qpos4, kpos6);  // L = 5, L_k = 7, skip 1
    std::vector<double> out(pb.q.size());
    const auto fwd = [&](const rpe::attention_inputs<double>& in) {
        rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {pb.b, pb.h, pb.l, pb.d}));
    };
    CHECK_NOTHROW(fwd(pb.inputs()));
    {  // the queries' positions of another count
        auto in = pb.inputs();
        in.positions = pos_ref(kpos6);
        CHECK(rpe_test::throws_with([&] { fwd(in); },
                                    "[rpe.attention] positions has shape (6, 2); expected (4 = L - skip = 5 - 1 of rpe_k, 2)"));
    }
    {  // the keys' positions of another count than L_k - skip
        auto in = pb.inputs();
        in.key_positions = pos_ref(qpos4);
        CHECK(rpe_test::throws_with(
            [&] { fwd(in); }, "[rpe.attention] key_positions has shape (4, 2); expected (6 = L_k - skip = 7 - 1 of rpe_k, 2)"));
    }
    {  // no key_positions
        auto in = pb.inputs();
        in.key_positions = {};
        CHECK(rpe_test::throws_with([&] { fwd(in); },
                                    "[rpe.attention] key_positions is empty with keys of another length than the queries "
                                    "(L = 5, L_k = 7) and rpe_k attached; expected the keys' positions"));
    }
    {  // a grid alone: one token set
        auto in = pb.inputs();
        in.positions = {};
        in.key_positions = {};
        in.height = 1;
        in.width = 4;
        CHECK(rpe_test::throws_with([&] { fwd(in); },
                                    "[rpe.attention] rpe_k is attached with keys of another length than the queries (L = 5, "
                                    "L_k = 7) and no positions; expected positions (the queries') and key_positions"));
    }
    {                                                                   // L_k no longer than skip
        irpe_problem two({{}, {true, false, true}, {}, 1}, qpos4, {});  // L_k = skip + 0
        auto in = two.inputs();
        std::vector<std::int32_t> one = {0, 0};
        in.key_positions = pos_ref(one);
        CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] L_k = 1 of k; expected more than skip = 1 of rpe_k"));
    }
    {  // packed sequences with L_k != L: not supported
        auto in = pb.inputs();
        std::vector<std::int32_t> lengths{2, 3};
        in.positions = {};
        in.key_positions = {};
        in.packed.lengths = {lengths.data(), {2}};
        CHECK(rpe_test::throws_with<rpe::not_supported>(
            [&] { fwd(in); }, "[rpe.attention] packed sequences with keys of another length than the queries (L = 5, L_k = 7)"));
    }
    {  // a backend without cross_lengths (the CUDA attention's caps) refuses L_k != L by name, terms or not
        rpe::attention_capabilities caps = rpe::cpu::attention_caps;
        caps.backend = "test";
        caps.cross_lengths = false;
        CHECK(rpe_test::throws_with<rpe::not_supported>(
            [&] { (void)rpe::detail::check_attention(pb.inputs(), caps); },
            "[rpe.attention] keys of another length than the queries (L_k != L) is not supported by the test backend"));
    }
}

}  // namespace rpe_unit_test_irpe_cross
