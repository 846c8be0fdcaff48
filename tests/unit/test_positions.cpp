// iRPE at per-token positions (rpe::build_bucket_ids(m, positions, skip), term.bucket_ids(positions),
// attention_inputs::positions): positions equal to a grid give exactly the grid's ids for every
// registered mapping (built-in and a user's); a permuted grid gives the permuted ids, term outputs
// and fused attention outputs and gradients; irregular positions and key positions give the
// mapping's id of each offset (hand loop over the policy); the per-offset ids are cached per
// bounding box, not per layout; bad positions throw naming the parameter.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>
#include <rpe/families.hpp>
#include <rpe/mapping/product3d.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_positions {

namespace {

using pos_ref = rpe::tensor_ref<const std::int32_t>;

/// (N, A) coordinates of a depth × height × width grid in token order ((r, c), or (t, r, c) when axes = 3).
std::vector<std::int32_t> grid_positions(int depth, int height, int width, int axes) {
    std::vector<std::int32_t> p;
    for (int t = 0; t < depth; ++t)
        for (int r = 0; r < height; ++r)
            for (int c = 0; c < width; ++c) {
                if (axes == 3) p.push_back(t);
                p.push_back(r);
                p.push_back(c);
            }
    return p;
}

/// The rows of `p` ((N, axes)) in the order `perm` (row n of the result is row perm[n] of p).
std::vector<std::int32_t> permuted(const std::vector<std::int32_t>& p, const std::vector<int>& perm, int axes) {
    std::vector<std::int32_t> out;
    for (int n : perm)
        for (int a = 0; a < axes; ++a) out.push_back(p[static_cast<std::size_t>(n * axes + a)]);
    return out;
}

std::vector<int> random_permutation(int n, std::uint32_t seed) {
    std::vector<int> perm(static_cast<std::size_t>(n));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    return perm;
}

/// Token index of the grid ids that token i of the permuted layout is (skip tokens stay).
int source_token(int i, int skip, const std::vector<int>& perm) {
    return i < skip ? i : skip + perm[static_cast<std::size_t>(i - skip)];
}

/// Every id (all tables) of `ids` equals the grid id of the permuted pair; also rows() in both orders.
void check_permuted_ids(const rpe::bucket_ids& grid, const rpe::bucket_ids& pos, int skip, const std::vector<int>& perm) {
    REQUIRE(pos.length() == grid.length());
    REQUIRE(pos.num_buckets() == grid.num_buckets());
    REQUIRE(pos.num_tables() == grid.num_tables());
    CHECK(pos.id_bytes() == grid.id_bytes());
    CHECK(pos.at_positions());
    CHECK(pos.storage_kind() == rpe::id_storage::on_the_fly);
    const int n = pos.length();
    int wrong = 0;
    for (int t = 0; t < pos.num_tables(); ++t) {
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j)
                wrong += pos.at(t, i, j) != grid.at(t, source_token(i, skip, perm), source_token(j, skip, perm));
        rpe::visit_id_width(pos.id_bytes(), [&]<class Id>() {
            std::vector<Id> buf(static_cast<std::size_t>(n) * n);
            for (bool transposed : {false, true}) {
                const Id* r = pos.rows<Id>(t, 0, n, transposed, buf.data());
                for (int i = 0; i < n; ++i)
                    for (int j = 0; j < n; ++j)
                        wrong += static_cast<int>(r[i * n + j]) != (transposed ? pos.at(t, j, i) : pos.at(t, i, j));
            }
        });
    }
    CHECK(wrong == 0);
}

// A user's own mapping (as in test_core_custom_mapping.cpp): Manhattan distance through piecewise.
struct manhattan {
    rpe::index::piecewise index;
    int num_buckets() const { return index.beta_int() + 1; }
    int bucket(int dr, int dc) const { return index(std::int64_t{std::abs(dr) + std::abs(dc)}); }
    friend bool operator==(const manhattan&, const manhattan&) = default;
};
static_assert(rpe::Mapping<manhattan>);

template <class S>
std::vector<S> random_vector(std::size_t n, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<S> v(n);
    for (auto& e : v) e = static_cast<S>(normal(rng));
    return v;
}

/// x (B, H, L, inner) with its token axis permuted: token i of the result is token source_token(i) of x.
template <class S>
std::vector<S> permute_tokens(const std::vector<S>& x, int planes, int l, int inner, int skip, const std::vector<int>& perm) {
    std::vector<S> out(x.size());
    for (int p = 0; p < planes; ++p)
        for (int i = 0; i < l; ++i)
            std::copy_n(x.begin() + (static_cast<std::ptrdiff_t>(p) * l + source_token(i, skip, perm)) * inner, inner,
                        out.begin() + (static_cast<std::ptrdiff_t>(p) * l + i) * inner);
    return out;
}

/// (B, H, L, L) with both token axes permuted.
template <class S>
std::vector<S> permute_pairs(const std::vector<S>& x, int planes, int l, int skip, const std::vector<int>& perm) {
    std::vector<S> out(x.size());
    for (int p = 0; p < planes; ++p)
        for (int i = 0; i < l; ++i)
            for (int j = 0; j < l; ++j)
                out[(static_cast<std::size_t>(p) * l + i) * l + j] =
                    x[(static_cast<std::size_t>(p) * l + source_token(i, skip, perm)) * l + source_token(j, skip, perm)];
    return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
    return m;
}

const rpe::mapping::product<> product19{rpe::index::piecewise::from_ratio(1.9)};

}  // namespace

TEST_CASE("positions: a grid's positions give exactly its ids, for every registered mapping, skip 0..2") {
    // Every family of the registry (the built-ins, and the user's test_taxicab of test_registry.cpp
    // when linked into this program), on the grid, in a random order and translated.
    int families = 0;
    for (const auto& e : rpe::families().entries()) {
        if (e->info.kind != rpe::family_kind::mapping) continue;
        CAPTURE(e->info.name);
        int grids_done = 0;
        const struct { int depth, height, width; } grids[] = {{1, 3, 4}, {1, 1, 7}, {2, 3, 2}};
        for (const auto& g : grids) {
            for (int skip = 0; skip <= 2; ++skip) {
                CAPTURE(g.depth);
                CAPTURE(g.height);
                CAPTURE(g.width);
                CAPTURE(skip);
                const auto spec = rpe::families().defaults(e->info.name);
                rpe::visit_mapping(spec, {g.height, g.width}, [&](const auto& m) {
                    using M = std::remove_cvref_t<decltype(m)>;
                    bool three = false;
                    if constexpr (std::is_same_v<M, rpe::registered_mapping>)
                        three = m.entry->mapping_3d;
                    else
                        three = rpe::Mapping3D<M>;
                    if (three != (g.depth > 1)) return;  // 3D mappings on the T x H x W grid only
                    std::shared_ptr<const rpe::bucket_ids> grid;
                    try {
                        grid = rpe::bucket_ids_of(m, g.depth, g.height, g.width, skip);
                    } catch (const rpe::invalid_argument&) {
                        return;  // a grid the mapping rejects (1D families: 1 x L only)
                    }
                    const int axes = three ? 3 : 2, n = g.depth * g.height * g.width;
                    const auto p = grid_positions(g.depth, g.height, g.width, axes);
                    const std::vector<int> identity = [&] {
                        std::vector<int> v(static_cast<std::size_t>(n));
                        std::iota(v.begin(), v.end(), 0);
                        return v;
                    }();
                    check_permuted_ids(*grid, *rpe::bucket_ids_of(m, pos_ref(p.data(), {n, axes}), skip), skip, identity);
                    const auto perm = random_permutation(n, static_cast<std::uint32_t>(n * 7 + skip));
                    const auto pp = permuted(p, perm, axes);
                    check_permuted_ids(*grid, *rpe::bucket_ids_of(m, pos_ref(pp.data(), {n, axes}), skip), skip, perm);
                    auto shifted = pp;  // every position moved by the same vector: the same ids
                    for (std::size_t i = 0; i < shifted.size(); ++i)
                        shifted[i] += static_cast<std::int32_t>(i % axes == 0 ? -5 : 9);
                    check_permuted_ids(*grid, *rpe::bucket_ids_of(m, pos_ref(shifted.data(), {n, axes}), skip), skip, perm);
                    ++grids_done;
                });
            }
        }
        CHECK(grids_done > 0);
        ++families;
    }
    CHECK(families >= 14);  // euclidean ... alibi2d
}

TEST_CASE("positions: irregular positions and key positions give the mapping's id of each offset") {
    const manhattan m{rpe::index::piecewise::from_ratio(1.9)};
    // hand-made irregular layout (repeats and gaps): (0,0) (5,1) (-2,3) (0,0) (7,-4)
    const std::vector<std::int32_t> q = {0, 0, 5, 1, -2, 3, 0, 0, 7, -4};
    const std::vector<std::int32_t> k = {1, 1, -3, 0, 2, 2, 9, 9, 0, 4};
    const int skip = 1, n = 5;
    rpe::bucket_cache cache;
    using T = rpe::term<manhattan, rpe::mode::bias, rpe::target::key, double>;
    const T term(m, {.num_heads = 1, .head_dim = 1, .skip = skip});
    const auto ids = term.bucket_ids(pos_ref(q.data(), {n, 2}), cache);
    const auto cross = term.bucket_ids(pos_ref(q.data(), {n, 2}), pos_ref(k.data(), {n, 2}), cache);
    REQUIRE(ids->length() == skip + n);
    CHECK(ids->num_buckets() == m.num_buckets() + 1);
    CHECK(!ids->has_key_positions());
    CHECK(cross->has_key_positions());
    CHECK(ids->grid_string() == "5 positions");
    const int extra = m.num_buckets();
    for (int i = 0; i < skip + n; ++i)
        for (int j = 0; j < skip + n; ++j) {
            CAPTURE(i);
            CAPTURE(j);
            if (i < skip || j < skip) {
                CHECK(ids->at(0, i, j) == extra);
                CHECK(cross->at(0, i, j) == extra);
                continue;
            }
            const auto a = static_cast<std::size_t>(2 * (i - skip)), b = static_cast<std::size_t>(2 * (j - skip));
            CHECK(ids->at(0, i, j) == m.bucket(q[a] - q[b], q[a + 1] - q[b + 1]));
            CHECK(cross->at(0, i, j) == m.bucket(q[a] - k[b], q[a + 1] - k[b + 1]));
        }
    // hand-checked values: pairs (1, 2) offset (-5, -1) -> |6| -> g(6) = 3; (1, 4) same position -> 0
    CHECK(ids->at(0, 1, 2) == 3);
    CHECK(ids->at(0, 1, 4) == 0);
    // the transposed rows (query target) of key positions: entry (i, j) is the id of the key's offset
    // from the query, kpos_j − qpos_i (id(j, i) of self-attention over queries and keys together)
    std::vector<std::uint8_t> buf(static_cast<std::size_t>((skip + n) * (skip + n)));
    const std::uint8_t* r = cross->rows<std::uint8_t>(0, 0, skip + n, true, buf.data());
    int wrong = 0;
    for (int i = 0; i < skip + n; ++i)
        for (int j = 0; j < skip + n; ++j) {
            const auto a = static_cast<std::size_t>(2 * (i - skip)), b = static_cast<std::size_t>(2 * (j - skip));
            const int want = i < skip || j < skip ? extra : m.bucket(k[b] - q[a], k[b + 1] - q[a + 1]);
            wrong += r[i * (skip + n) + j] != want;
        }
    CHECK(wrong == 0);
    // on tokens of one set it is id(j, i)
    const std::uint8_t* rs = ids->rows<std::uint8_t>(0, 0, skip + n, true, buf.data());
    for (int i = 0; i < skip + n; ++i)
        for (int j = 0; j < skip + n; ++j) wrong += rs[i * (skip + n) + j] != ids->at(0, j, i);
    CHECK(wrong == 0);
    // the bias term over these ids: out[0, 0, i, j] = table[0, id(i, j)]
    std::vector<double> table(static_cast<std::size_t>(term.num_buckets()));
    std::iota(table.begin(), table.end(), 10.0);
    std::vector<double> out(static_cast<std::size_t>((skip + n) * (skip + n)));
    term.forward(*ids, {table.data(), {1, term.num_buckets()}}, {}, {out.data(), {1, 1, skip + n, skip + n}},
                 rpe::write::overwrite);
    for (int i = 0; i < skip + n; ++i)
        for (int j = 0; j < skip + n; ++j) CHECK(out[static_cast<std::size_t>(i * (skip + n) + j)] == 10.0 + ids->at(0, i, j));
}

TEST_CASE("positions: the per-offset ids are cached per bounding box, not per layout") {
    rpe::bucket_cache cache;
    const auto p = grid_positions(1, 4, 5, 2);
    const auto a = cache.get(product19, pos_ref(p.data(), {20, 2}), 1);
    const auto pp = permuted(p, random_permutation(20, 3), 2);
    const auto b = cache.get(product19, pos_ref(pp.data(), {20, 2}), 1);
    const std::vector<std::int32_t> sub = {0, 0, 3, 4, 2, 1};  // three tokens in the same 4 x 5 box
    const auto c = cache.get(product19, pos_ref(sub.data(), {3, 2}), 1);
    CHECK(cache.size() == 1);  // one entry: the 4 x 5 box's on-the-fly ids
    CHECK(cache.builds() == 1);
    CHECK(c->length() == 4);
    const auto grid = cache.get(product19, 1, 4, 5, 1, rpe::id_storage::on_the_fly);  // that very entry
    CHECK(cache.size() == 1);
    CHECK(a->bytes() == grid->bytes() + 20 * 8);
    CHECK(c->at(0, 1, 2) == grid->at(0, 1 + 0, 1 + 3 * 5 + 4));  // (0,0) vs (3,4)
    CHECK(c->at(0, 3, 2) == grid->at(0, 1 + 2 * 5 + 1, 1 + 3 * 5 + 4));
}

TEST_CASE("positions: 3D positions (t, row, col) of product3d give the T x H x W grid's ids, permuted") {
    const rpe::mapping::product3d<> m{};
    const int depth = 3, height = 2, width = 3, n = depth * height * width, skip = 1;
    const auto grid = rpe::build_bucket_ids(m, depth, height, width, skip, rpe::id_storage::table);
    const auto p = grid_positions(depth, height, width, 3);
    const auto perm = random_permutation(n, 11);
    const auto pp = permuted(p, perm, 3);
    check_permuted_ids(*grid, *rpe::build_bucket_ids(m, pos_ref(pp.data(), {n, 3}), skip), skip, perm);
    CHECK(rpe_test::throws_with(
        [&] {
            (void)rpe::build_bucket_ids(m, pos_ref(pp.data(), {27, 2}), skip);
        },
        "[rpe.bucket_ids] positions has shape (27, 2); expected (N >= 1, 3) integer coordinates "
        "(t, row, col) for a 3D mapping"));
}

TEST_CASE_TEMPLATE("positions: a permuted grid gives the permuted term outputs and gradients", S, float, double) {
    const int height = 3, width = 4, skip = 1, n = height * width, l = skip + n, b = 2, h = 2, d = 3;
    const auto perm = random_permutation(n, 5);
    const auto p = permuted(grid_positions(1, height, width, 2), perm, 2);
    const pos_ref positions(p.data(), {n, 2});
    const double tol = std::is_same_v<S, float> ? 1e-5 : 1e-12;
    const auto to_double = [](const std::vector<S>& v) { return std::vector<double>(v.begin(), v.end()); };
    SUBCASE("contextual product on keys") {
        using T = rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key, S>;
        const T t(product19, {.num_heads = h, .head_dim = d, .shared_head = false, .skip = skip});
        const auto grid = t.bucket_ids(height, width);
        const auto pos = t.bucket_ids(positions);
        const auto x = random_vector<S>(static_cast<std::size_t>(b * h * l * d), 1);
        const auto table = random_vector<S>(static_cast<std::size_t>(h * d * t.num_buckets()), 2);
        const auto xp = permute_tokens(x, b * h, l, d, skip, perm);
        std::vector<S> out(static_cast<std::size_t>(b * h * l * l)), outp(out.size());
        t.forward(*grid, {table.data(), {h, d, t.num_buckets()}}, {x.data(), {b, h, l, d}}, {out.data(), {b, h, l, l}},
                  rpe::write::overwrite);
        t.forward(*pos, {table.data(), {h, d, t.num_buckets()}}, {xp.data(), {b, h, l, d}}, {outp.data(), {b, h, l, l}},
                  rpe::write::overwrite);
        CHECK(max_abs_diff(to_double(outp), to_double(permute_pairs(out, b * h, l, skip, perm))) <= tol);
        // backward: grad_x permuted, grad_table equal
        const auto go = random_vector<S>(out.size(), 3);
        const auto gop = permute_pairs(go, b * h, l, skip, perm);
        std::vector<S> gx(x.size()), gxp(x.size()), gt(table.size()), gtp(table.size());
        t.backward(*grid, {table.data(), {h, d, t.num_buckets()}}, {x.data(), {b, h, l, d}}, {go.data(), {b, h, l, l}},
                   {gx.data(), {b, h, l, d}}, {gt.data(), {h, d, t.num_buckets()}}, rpe::write::overwrite);
        t.backward(*pos, {table.data(), {h, d, t.num_buckets()}}, {xp.data(), {b, h, l, d}}, {gop.data(), {b, h, l, l}},
                   {gxp.data(), {b, h, l, d}}, {gtp.data(), {h, d, t.num_buckets()}}, rpe::write::overwrite);
        CHECK(max_abs_diff(to_double(gxp), to_double(permute_tokens(gx, b * h, l, d, skip, perm))) <= tol);
        CHECK(max_abs_diff(to_double(gtp), to_double(gt)) <= 10 * tol);
    }
    SUBCASE("bias euclidean on queries (transposed ids)") {
        using T = rpe::term<rpe::mapping::euclidean<>, rpe::mode::bias, rpe::target::query, S>;
        const T t(rpe::mapping::euclidean<>{rpe::index::piecewise::from_ratio(1.9)},
                  {.num_heads = h, .head_dim = d, .skip = skip});
        const auto table = random_vector<S>(static_cast<std::size_t>(t.num_buckets()), 4);
        std::vector<S> out(static_cast<std::size_t>(h * l * l)), outp(out.size());
        t.forward(*t.bucket_ids(height, width), {table.data(), {1, t.num_buckets()}}, {}, {out.data(), {1, h, l, l}},
                  rpe::write::overwrite);
        t.forward(*t.bucket_ids(positions), {table.data(), {1, t.num_buckets()}}, {}, {outp.data(), {1, h, l, l}},
                  rpe::write::overwrite);
        CHECK(max_abs_diff(to_double(outp), to_double(permute_pairs(out, h, l, skip, perm))) == 0.0);
    }
    SUBCASE("contextual cross on values") {
        using T = rpe::term<rpe::mapping::cross<>, rpe::mode::contextual, rpe::target::value, S>;
        const T t(rpe::mapping::cross<>{rpe::index::piecewise::from_ratio(1.9)}, {.num_heads = h, .head_dim = d, .skip = skip});
        const int k = t.num_buckets();
        const auto a = random_vector<S>(static_cast<std::size_t>(b * h * l * l), 6);
        const auto t0 = random_vector<S>(static_cast<std::size_t>(k * d), 7), t1 = random_vector<S>(t0.size(), 8);
        const auto ap = permute_pairs(a, b * h, l, skip, perm);
        std::vector<S> out(static_cast<std::size_t>(b * h * l * d)), outp(out.size());
        const typename T::tables_type tables{rpe::tensor_ref<const S>(t0.data(), {1, k, d}),
                                             rpe::tensor_ref<const S>(t1.data(), {1, k, d})};
        t.forward(*t.bucket_ids(height, width), tables, {a.data(), {b, h, l, l}}, {out.data(), {b, h, l, d}},
                  rpe::write::overwrite);
        t.forward(*t.bucket_ids(positions), tables, {ap.data(), {b, h, l, l}}, {outp.data(), {b, h, l, d}},
                  rpe::write::overwrite);
        CHECK(max_abs_diff(to_double(outp), to_double(permute_tokens(out, b * h, l, d, skip, perm))) <= tol);
    }
}

TEST_CASE_TEMPLATE("positions: the fused attention at a permuted grid's positions gives the permuted outputs and gradients", S,
                   float, double) {
    const int height = 3, width = 5, skip = 1, n = height * width, l = skip + n, b = 2, h = 2, d = 4;
    const auto perm = random_permutation(n, 21);
    const auto p = permuted(grid_positions(1, height, width, 2), perm, 2);
    const double tol = std::is_same_v<S, float> ? 2e-5 : 1e-12;
    const auto to_double = [](const std::vector<S>& v) { return std::vector<double>(v.begin(), v.end()); };
    const rpe::term_desc tk =
        rpe::make_term_desc(product19, true, rpe::target::key, {.num_heads = h, .head_dim = d, .skip = skip});
    const rpe::term_desc tq =
        rpe::make_term_desc(rpe::mapping::euclidean<>{rpe::index::piecewise::from_ratio(1.9)}, false, rpe::target::query,
                            {.num_heads = h, .head_dim = d, .shared_head = false, .skip = skip});
    const rpe::term_desc tv = rpe::make_term_desc(rpe::mapping::cross<>{rpe::index::piecewise::from_ratio(1.9)}, true,
                                                  rpe::target::value, {.num_heads = h, .head_dim = d, .skip = skip});
    const auto size_of = [](const std::vector<std::int64_t>& s) {
        std::size_t z = 1;
        for (auto e : s) z *= static_cast<std::size_t>(e);
        return z;
    };
    const auto table_k = random_vector<S>(size_of(tk.table_shape()), 31);
    const auto table_q = random_vector<S>(size_of(tq.table_shape()), 32);
    const auto table_v0 = random_vector<S>(size_of(tv.table_shape()), 33), table_v1 = random_vector<S>(table_v0.size(), 34);
    const std::size_t qsize = static_cast<std::size_t>(b * h * l * d);
    const auto q = random_vector<S>(qsize, 35), k = random_vector<S>(qsize, 36), v = random_vector<S>(qsize, 37),
               go = random_vector<S>(qsize, 38);
    const auto qp = permute_tokens(q, b * h, l, d, skip, perm), kp = permute_tokens(k, b * h, l, d, skip, perm),
               vp = permute_tokens(v, b * h, l, d, skip, perm), gop = permute_tokens(go, b * h, l, d, skip, perm);
    const auto ref = [](const std::vector<S>& x, const std::vector<std::int64_t>& s) {
        rpe::tensor_ref<const S> r;
        r.data = x.data();
        r.rank = static_cast<int>(s.size());
        for (std::size_t i = 0; i < s.size(); ++i) r.shape[i] = s[i];
        return r;
    };
    struct grads {
        std::vector<S> q, k, v, tk, tq, tv0, tv1;
    };
    const std::vector<std::int32_t>* key_pos = nullptr;  // the keys' own positions, when set
    const auto run = [&](const std::vector<S>& qq, const std::vector<S>& kk, const std::vector<S>& vv, const std::vector<S>& gg,
                         bool at_positions, bool composed, std::vector<S>& out, grads& g) {
        rpe::attention_inputs<S> in;
        in.q = {qq.data(), {b, h, l, d}};
        in.k = {kk.data(), {b, h, l, d}};
        in.v = {vv.data(), {b, h, l, d}};
        if (at_positions) {
            in.positions = pos_ref(p.data(), {n, 2});
            if (key_pos) in.key_positions = pos_ref(key_pos->data(), {n, 2});
        } else {
            in.height = height;
            in.width = width;
        }
        g.tk.assign(table_k.size(), S(0));
        g.tq.assign(table_q.size(), S(0));
        g.tv0.assign(table_v0.size(), S(0));
        g.tv1.assign(table_v0.size(), S(0));
        const auto gref = [](std::vector<S>& x, const std::vector<std::int64_t>& s) {
            rpe::tensor_ref<S> r;
            r.data = x.data();
            r.rank = static_cast<int>(s.size());
            for (std::size_t i = 0; i < s.size(); ++i) r.shape[i] = s[i];
            return r;
        };
        in.rpe_k = {.term = &tk, .tables = {ref(table_k, tk.table_shape())}, .grad_tables = {gref(g.tk, tk.table_shape())}};
        in.rpe_q = {.term = &tq, .tables = {ref(table_q, tq.table_shape())}, .grad_tables = {gref(g.tq, tq.table_shape())}};
        in.rpe_v = {.term = &tv,
                    .tables = {ref(table_v0, tv.table_shape()), ref(table_v1, tv.table_shape())},
                    .grad_tables = {gref(g.tv0, tv.table_shape()), gref(g.tv1, tv.table_shape())}};
        out.assign(qsize, S(0));
        g.q.assign(qsize, S(0));
        g.k.assign(qsize, S(0));
        g.v.assign(qsize, S(0));
        const rpe::tensor_ref<S> o(out.data(), {b, h, l, d});
        if (composed) {
            std::vector<S> attn(static_cast<std::size_t>(b * h * l * l));
            rpe::composed_attention_forward(in, o, rpe::tensor_ref<S>(attn.data(), {b, h, l, l}));
            rpe::composed_attention_backward(in, {.grad_out = {gg.data(), {b, h, l, d}},
                                                  .grad_q = {g.q.data(), {b, h, l, d}},
                                                  .grad_k = {g.k.data(), {b, h, l, d}},
                                                  .grad_v = {g.v.data(), {b, h, l, d}},
                                                  .saved_attn = rpe::tensor_ref<const S>(attn.data(), {b, h, l, l})});
        } else {
            rpe::attention_forward(in, o);
            rpe::attention_backward(in, {.grad_out = {gg.data(), {b, h, l, d}},
                                         .grad_q = {g.q.data(), {b, h, l, d}},
                                         .grad_k = {g.k.data(), {b, h, l, d}},
                                         .grad_v = {g.v.data(), {b, h, l, d}}});
        }
    };
    std::vector<S> out, outp, outc;
    grads g, gp, gc;
    run(q, k, v, go, false, false, out, g);
    run(qp, kp, vp, gop, true, false, outp, gp);
    CHECK(max_abs_diff(to_double(outp), to_double(permute_tokens(out, b * h, l, d, skip, perm))) <= tol);
    CHECK(max_abs_diff(to_double(gp.q), to_double(permute_tokens(g.q, b * h, l, d, skip, perm))) <= tol);
    CHECK(max_abs_diff(to_double(gp.k), to_double(permute_tokens(g.k, b * h, l, d, skip, perm))) <= tol);
    CHECK(max_abs_diff(to_double(gp.v), to_double(permute_tokens(g.v, b * h, l, d, skip, perm))) <= tol);
    CHECK(max_abs_diff(to_double(gp.tk), to_double(g.tk)) <= 10 * tol);
    CHECK(max_abs_diff(to_double(gp.tq), to_double(g.tq)) <= 10 * tol);
    CHECK(max_abs_diff(to_double(gp.tv0), to_double(g.tv0)) <= 10 * tol);
    CHECK(max_abs_diff(to_double(gp.tv1), to_double(g.tv1)) <= 10 * tol);
    double mag = 0;
    for (S x : out) mag = std::max(mag, std::abs(static_cast<double>(x)));
    CHECK(mag > 0.1);  // not a trivially zero output
    // the composed baseline at the same positions agrees with the fused attention
    run(qp, kp, vp, gop, true, true, outc, gc);
    CHECK(max_abs_diff(to_double(outc), to_double(outp)) <= tol);
    CHECK(max_abs_diff(to_double(gc.q), to_double(gp.q)) <= tol);
    CHECK(max_abs_diff(to_double(gc.tk), to_double(gp.tk)) <= 10 * tol);
    // keys at positions of their own (same count): fused and composed agree (ids qpos_i - kpos_j,
    // the query target's rows transposed), and the result differs from the keys at the queries' positions
    auto other = permuted(grid_positions(1, height, width, 2), random_permutation(n, 22), 2);
    for (std::size_t i = 0; i < other.size(); ++i) other[i] += static_cast<std::int32_t>(i % 2 == 0 ? 1 : -2);
    key_pos = &other;
    std::vector<S> outk, outkc;
    grads gk, gkc;
    run(qp, kp, vp, gop, true, false, outk, gk);
    run(qp, kp, vp, gop, true, true, outkc, gkc);
    CHECK(max_abs_diff(to_double(outk), to_double(outkc)) <= tol);
    CHECK(max_abs_diff(to_double(gk.q), to_double(gkc.q)) <= tol);
    CHECK(max_abs_diff(to_double(gk.k), to_double(gkc.k)) <= tol);
    CHECK(max_abs_diff(to_double(gk.tq), to_double(gkc.tq)) <= 10 * tol);
    CHECK(max_abs_diff(to_double(gk.tv0), to_double(gkc.tv0)) <= 10 * tol);
    CHECK(max_abs_diff(to_double(outk), to_double(outp)) > 1e-3);
}

TEST_CASE("positions: bad positions throw naming the parameter and its value") {
    const std::vector<std::int32_t> p = {0, 0, 1, 2, 3, 4};
    const auto build = [&](pos_ref r, int skip = 0) { (void)rpe::build_bucket_ids(product19, r, skip); };
    CHECK(rpe_test::throws_with(
        [&] {
            build(pos_ref(p.data(), {2, 3}));
        },
        "[rpe.bucket_ids] positions has shape (2, 3); expected (N >= 1, 2) integer coordinates "
        "(row, col) for a 2D mapping"));
    CHECK(rpe_test::throws_with([&] { build(pos_ref(p.data(), {6})); }, "[rpe.bucket_ids] positions has shape (6,)"));
    CHECK(rpe_test::throws_with([&] { build(pos_ref(p.data(), {0, 2})); }, "[rpe.bucket_ids] positions has shape (0, 2)"));
    CHECK(rpe_test::throws_with([&] { build(pos_ref(nullptr, {3, 2})); }, "[rpe.bucket_ids] positions is a null buffer"));
    CHECK(rpe_test::throws_with([&] { build(pos_ref(p.data(), {3, 2}), -1); }, "[rpe.bucket_ids] skip = -1; expected >= 0"));
    std::vector<std::int32_t> far = p;
    far[3] = 2000000;
    CHECK(rpe_test::throws_with(
        [&] {
            build(pos_ref(far.data(), {3, 2}));
        },
        "[rpe.bucket_ids] positions[1, 1] = 2000000; expected |value| <= rpe::max_position = 1048576"));
    far[2] = 1048576;  // allowed values, but the box is too large for its per-offset ids
    far[3] = -1048576;
    CHECK(rpe_test::throws_with<rpe::out_of_range>(
        [&] {
            build(pos_ref(far.data(), {3, 2}));
        },
        "[rpe.bucket_ids] positions span a 1x1048577x1048581 box"));
    // key positions of another count: (L, L_k) ids (tests/unit/test_irpe_cross.cpp); the mapping's axes still
    const auto rect = rpe::build_bucket_ids(product19, pos_ref(p.data(), {3, 2}), pos_ref(p.data(), {2, 2}), 0);
    CHECK(rect->length() == 3);
    CHECK(rect->key_length() == 2);
    CHECK(rpe_test::throws_with(
        [&] {
            (void)rpe::build_bucket_ids(product19, pos_ref(p.data(), {3, 2}), pos_ref(p.data(), {2, 3}), 0);
        },
        "[rpe.bucket_ids] key_positions has shape (2, 3); expected (N >= 1, 2) integer coordinates (row, col)"));
    // a grid-only access of ids at positions
    const auto ids = rpe::build_bucket_ids(product19, pos_ref(p.data(), {3, 2}), 0);
    CHECK(rpe_test::throws_with([&] { ids->visit(0, [](const auto*) { return 0; }); }, "visit() needs table storage"));
    CHECK_THROWS_AS((void)ids->at(0, 3, 0), rpe::out_of_range);
    // the fused attention: positions of the wrong length, key_positions alone
    const int l = 4, d = 2;
    std::vector<float> q(static_cast<std::size_t>(l * d), 0.5f), out(q.size()), table(static_cast<std::size_t>(d * 50));
    const rpe::term_desc tk = rpe::make_term_desc(product19, true, rpe::target::key, {.num_heads = 1, .head_dim = d, .skip = 1});
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {1, 1, l, d}};
    in.rpe_k = {.term = &tk, .tables = {{table.data(), {1, d, 50}}}};
    in.positions = pos_ref(p.data(), {2, 2});
    const auto forward = [&] { rpe::attention_forward(in, {out.data(), {1, 1, l, d}}); };
    CHECK(rpe_test::throws_with(forward,
                                "[rpe.attention] positions has shape (2, 2); expected (3 = L - skip = 4 - 1 of rpe_k, 2) integer "
                                "coordinates (row, col) for a 2D mapping"));
    in.positions = pos_ref(p.data(), {3, 2});
    in.key_positions = pos_ref(p.data(), {3, 3});
    CHECK(rpe_test::throws_with(forward, "[rpe.attention] key_positions has shape (3, 3)"));
    in.positions = {};
    CHECK(rpe_test::throws_with(forward, "[rpe.attention] key_positions is given without positions"));
    in.key_positions = {};
    in.positions = pos_ref(p.data(), {3, 2});
    forward();  // and now it runs (height, width unset)
    CHECK(std::isfinite(out[0]));
    // without a term nothing reads them: refused, not ignored (forward and backward)
    in.rpe_k = {};
    CHECK(rpe_test::throws_with(forward,
                                "[rpe.attention] positions is given but no iRPE term (rpe_q, rpe_k, rpe_v) is attached; "
                                "expected none (nothing reads them"));
    in.key_positions = pos_ref(p.data(), {3, 2});
    std::vector<float> g(q.size());
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::attention_backward(in, {q.data(), {1, 1, l, d}}, {g.data(), {1, 1, l, d}}, {g.data(), {1, 1, l, d}},
                                    {g.data(), {1, 1, l, d}});
        },
        "[rpe.attention] positions and key_positions are given but no iRPE term"));
}

}  // namespace rpe_unit_positions
