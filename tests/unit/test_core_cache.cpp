// rpe::bucket_cache (the cache key is the whole configuration): hits share one object,
// every part of the key separates entries, the reference's stale-id bug does not happen,
// concurrent use gives the single-threaded ids, and a failing build leaves nothing behind.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/caches.hpp>
#include <rpe/rope/axial.hpp>
#include <rpe/detail/single_flight.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/quantization.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_cache {

namespace {

using rpe::index::piecewise;
namespace mapping = rpe::mapping;

const mapping::product<> prod{piecewise::from_ratio(1.9)};

bool same_ids(const rpe::bucket_ids& a, const rpe::bucket_ids& b) {
    if (a.length() != b.length() || a.num_tables() != b.num_tables() || a.num_buckets() != b.num_buckets()) return false;
    for (int t = 0; t < a.num_tables(); ++t)
        if (rpe_test::ids_matrix(a, t) != rpe_test::ids_matrix(b, t)) return false;
    return true;
}

// A mapping whose id for offset (0, 0) is out of range: the build must fail.
struct faulty {
    int k = 4;
    int num_buckets() const { return k; }
    int bucket(int dr, int dc) const { return dr == 0 && dc == 0 ? k : 0; }
    friend bool operator==(const faulty&, const faulty&) = default;
};

}  // namespace

TEST_CASE("bucket_cache: the same configuration gives the same object, built once") {
    rpe::bucket_cache cache;
    CHECK(cache.size() == 0);
    CHECK(cache.builds() == 0);
    const auto a = cache.get(prod, 7, 7, 1);
    const auto b = cache.get(mapping::product<>{piecewise{1.9, 3.8, 15.2}}, 7, 7, 1);  // equal value, new object
    CHECK(a.get() == b.get());
    CHECK(cache.builds() == 1);
    CHECK(cache.size() == 1);
    CHECK(a->length() == 50);
    CHECK(same_ids(*a, *rpe::build_bucket_ids(prod, 7, 7, 1)));

    // a term asks the cache it is given
    const rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::key> t(
        prod, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    CHECK(t.bucket_ids(7, 7, cache).get() == a.get());
    CHECK(cache.builds() == 1);

    // clear drops entries; handed-out objects stay valid
    cache.clear();
    CHECK(cache.size() == 0);
    CHECK(cache.builds() == 0);
    CHECK(a->at(0, 0, 0) == 49);
    const auto c = cache.get(prod, 7, 7, 1);
    CHECK(c.get() != a.get());
    CHECK(cache.builds() == 1);
}

TEST_CASE("bucket_cache: each part of the key separates entries") {
    rpe::bucket_cache cache;
    const auto base = cache.get(prod, 5, 6, 1);
    std::vector<std::shared_ptr<const rpe::bucket_ids>> others;
    SUBCASE("skip") { others = {cache.get(prod, 5, 6, 0), cache.get(prod, 5, 6, 2)}; }
    SUBCASE("height") { others = {cache.get(prod, 4, 6, 1), cache.get(prod, 6, 6, 1)}; }
    SUBCASE("width") { others = {cache.get(prod, 5, 5, 1), cache.get(prod, 5, 7, 1)}; }
    SUBCASE("height and width swapped") { others = {cache.get(prod, 6, 5, 1)}; }
    SUBCASE("alpha, beta, gamma") {
        others = {cache.get(mapping::product<>{piecewise{1.0, 3.8, 15.2}}, 5, 6, 1),
                  cache.get(mapping::product<>{piecewise{1.9, 3.9, 15.2}}, 5, 6, 1),
                  cache.get(mapping::product<>{piecewise{1.9, 3.8, 16.0}}, 5, 6, 1)};
    }
    SUBCASE("mapping type, same index function") {
        const piecewise g = piecewise::from_ratio(1.9);
        others = {cache.get(mapping::euclidean<>{g}, 5, 6, 1), cache.get(mapping::quantization<>{g}, 5, 6, 1),
                  cache.get(mapping::cross<>{g}, 5, 6, 1), cache.get(mapping::euclidean_paper<>{g}, 5, 6, 1),
                  cache.get(mapping::quantization_paper<>{g}, 5, 6, 1)};
    }
    SUBCASE("index function type") { others = {cache.get(mapping::product<rpe::index::clip>{{3.0}}, 5, 6, 1)}; }
    CHECK(cache.size() == 1 + others.size());
    CHECK(cache.builds() == 1 + others.size());
    for (const auto& o : others) {
        CHECK(o.get() != base.get());
        CHECK_FALSE(o->key() == base->key());
    }
    // and asking again hits every entry
    CHECK(cache.get(prod, 5, 6, 1).get() == base.get());
    CHECK(cache.builds() == 1 + others.size());
}

TEST_CASE("a term of a const-qualified mapping type reads the unqualified type's ids, and the other way round") {
    // rpe::term<decltype(m)> for `const auto m = ...` is a term of `const M`: the ids' mapping key
    // drops the qualifier, so each term accepts the other's ids and gives the same output
    const auto m = prod;
    const rpe::term_config cfg{.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1};
    const rpe::term<decltype(m), rpe::mode::bias, rpe::target::key, float> qualified(m, cfg);
    const rpe::term<mapping::product<>, rpe::mode::bias, rpe::target::key, float> plain(prod, cfg);
    const auto ids_q = qualified.bucket_ids(3, 4);
    const auto ids_p = rpe::build_bucket_ids(prod, 3, 4, 1);
    CHECK(ids_q->key() == ids_p->key());
    CHECK(ids_q->key().holds(m));
    std::vector<float> table(static_cast<std::size_t>(2 * plain.num_buckets()));
    for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i % 17) - 8.f;
    const rpe::tensor_ref<const float> tab(table.data(), {2, plain.num_buckets()});
    std::vector<float> a(2 * 13 * 13), b(a.size()), c(a.size());
    qualified.forward(*ids_p, tab, {}, rpe::tensor_ref<float>(a.data(), {1, 2, 13, 13}), rpe::write::overwrite);
    plain.forward(*ids_q, tab, {}, rpe::tensor_ref<float>(b.data(), {1, 2, 13, 13}), rpe::write::overwrite);
    plain.forward(*ids_p, tab, {}, rpe::tensor_ref<float>(c.data(), {1, 2, 13, 13}), rpe::write::overwrite);
    CHECK(a == c);
    CHECK(b == c);
    CHECK(c[13] == table[static_cast<std::size_t>(ids_p->at(0, 1, 0))]);  // query 1, key 0 (the skip token): its bucket
}

TEST_CASE("bucket_cache: the reference's stale-id scenario (L = 50 with skip 1, then L = 49 with skip 0)") {
    // The reference caches per (height, width) and ignores skip, so a module that saw a 7x7 grid
    // with a class token (L = 50) returned those ids for L = 49 without one.
    rpe::bucket_cache cache;
    using key_term = rpe::term<mapping::product<>, rpe::mode::contextual, rpe::target::key, double>;
    const key_term with_cls(prod, {.num_heads = 1, .head_dim = 2, .skip = 1}), without_cls(prod, {.num_heads = 1, .head_dim = 2});
    const auto ids50 = with_cls.bucket_ids(7, 7, cache);
    const auto ids49 = without_cls.bucket_ids(7, 7, cache);
    CHECK(ids50->length() == 50);
    REQUIRE(ids49->length() == 49);
    CHECK(ids49.get() != ids50.get());
    CHECK(cache.builds() == 2);
    // the skip-0 ids are the golden ones
    rpe_test::check_exact(
        rpe_test::ids_matrix(*ids49),
        rpe_test::load<std::int64_t>(rpe_test::golden("bucket_ids/product_7x7_skip0_r1.9"), "bucket_ids.npy", {49, 49}),
        "product 7x7 skip 0");
    CHECK(ids49->num_buckets() == 49);
    // a skip-1 term given skip-0 ids (of a matching length for its x) rejects them
    std::vector<double> table(1 * 2 * 50), x(1 * 1 * 49 * 2, 1.0), out(49 * 49, 7.0);
    CHECK(rpe_test::throws_with(
        [&] {
            with_cls.forward(*ids49, rpe_test::cview(table, {1, 2, 50}), rpe_test::cview(x, {1, 1, 49, 2}),
                             rpe_test::mview(out, {1, 1, 49, 49}), rpe::write::overwrite);
        },
        {"skip = 0", "skip = 1"}));
    CHECK(out[0] == 7.0);  // untouched
}

TEST_CASE("bucket_cache: 8 threads on different grids give the single-threaded ids") {
    rpe::bucket_cache cache;
    const piecewise g = piecewise::from_ratio(1.9);
    struct job {
        int h, w, skip;
    };
    const job jobs[8] = {{7, 7, 1}, {5, 9, 0}, {14, 14, 1}, {3, 4, 2}, {9, 5, 1}, {12, 8, 0}, {1, 17, 3}, {16, 16, 1}};
    std::vector<std::shared_ptr<const rpe::bucket_ids>> prod_ids(8), cross_ids(8), same_key(8);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
            ready.fetch_add(1);
            while (ready.load() < 8) std::this_thread::yield();  // start together
            const job& j = jobs[t];
            prod_ids[static_cast<std::size_t>(t)] = cache.get(mapping::product<>{g}, j.h, j.w, j.skip);
            cross_ids[static_cast<std::size_t>(t)] = cache.get(mapping::cross<>{g}, j.h, j.w, j.skip);
            same_key[static_cast<std::size_t>(t)] = cache.get(mapping::euclidean<>{g}, 11, 13, 1);  // one key, 8 callers
        });
    for (auto& th : threads) th.join();
    for (int t = 0; t < 8; ++t) {
        CAPTURE(t);
        const job& j = jobs[t];
        CHECK(same_ids(*prod_ids[static_cast<std::size_t>(t)], *rpe::build_bucket_ids(mapping::product<>{g}, j.h, j.w, j.skip)));
        CHECK(same_ids(*cross_ids[static_cast<std::size_t>(t)], *rpe::build_bucket_ids(mapping::cross<>{g}, j.h, j.w, j.skip)));
        CHECK(same_key[static_cast<std::size_t>(t)].get() == same_key[0].get());
    }
    CHECK(same_ids(*same_key[0], *rpe::build_bucket_ids(mapping::euclidean<>{g}, 11, 13, 1)));
    CHECK(cache.size() == 17);    // 8 product + 8 cross + 1 euclidean
    CHECK(cache.builds() == 17);  // the shared key was built once
}

TEST_CASE("bucket_cache: a failing build leaves no entry") {
    rpe::bucket_cache cache;
    SUBCASE("invalid alpha (validation)") {
        const mapping::product<> bad{piecewise{-1.0, 3.8, 15.2}};
        CHECK(rpe_test::throws_with([&] { (void)cache.get(bad, 5, 5, 1); }, "alpha = -1"));
        CHECK(cache.size() == 0);
        CHECK_THROWS_AS((void)cache.get(bad, 5, 5, 1), rpe::invalid_argument);  // fails again, not a cached value
        CHECK(cache.size() == 0);
    }
    SUBCASE("invalid height (inside the build)") {
        CHECK(rpe_test::throws_with([&] { (void)cache.get(prod, 0, 5, 1); }, "height = 0"));
        CHECK(cache.size() == 0);
        CHECK_THROWS_AS((void)cache.get(prod, 0, 5, 1), rpe::invalid_argument);
        CHECK(cache.size() == 0);
    }
    SUBCASE("a custom mapping returning an out-of-range id") {
        CHECK(rpe_test::throws_with<rpe::out_of_range>([&] { (void)cache.get(faulty{}, 3, 3, 0); }, "bucket id 4"));
        CHECK(cache.size() == 0);
    }
    // the cache still works afterwards
    CHECK(cache.get(prod, 5, 5, 1)->length() == 26);
    CHECK(cache.size() == 1);
}

// ---------------------------------------------------------------------------------------------
// Budget, eviction, counters (a long-lived process that sees many grids stays bounded)
// ---------------------------------------------------------------------------------------------

TEST_CASE("bucket_cache: past its byte budget the least recently used grids are dropped, handed-out ids stay valid") {
    rpe::bucket_cache cache;
    // (L, L) tables of 1-byte ids plus the per-offset ids: bytes() of each grid, built alone
    const auto bytes_of = [](int h, int w) { return static_cast<std::size_t>(rpe::build_bucket_ids(prod, h, w, 1)->bytes()); };
    const std::size_t b10 = bytes_of(10, 10), b11 = bytes_of(11, 11), b12 = bytes_of(12, 12);
    CHECK(b10 == 101 * 101 + 19 * 19);  // L = 101: the (L, L) table and the (2H−1)(2W−1) per-offset ids
    cache.set_budget(b10 + b11 + b12);
    CHECK(cache.budget() == b10 + b11 + b12);
    const auto g10 = cache.get(prod, 10, 10, 1);
    (void)cache.get(prod, 11, 11, 1);
    (void)cache.get(prod, 12, 12, 1);
    CHECK(cache.stats().bytes == b10 + b11 + b12);
    CHECK(cache.stats().evictions == 0);
    (void)cache.get(prod, 10, 10, 1);  // a hit: 10x10 is now the most recently used, 11x11 the least
    rpe::cache_stats s = cache.stats();
    CHECK(s.hits == 1);
    CHECK(s.misses == 3);
    (void)cache.get(prod, 13, 13, 1);  // over the budget: 11x11 goes first, then 12x12 while still over
    s = cache.stats();
    CHECK(s.misses == 4);
    CHECK(s.evictions >= 1);
    CHECK(s.bytes <= cache.budget());
    CHECK(s.entries == 4 - s.evictions);
    CHECK(cache.get(prod, 10, 10, 1).get() == g10.get());  // kept: recently used
    CHECK(cache.stats().hits == 2);
    const std::size_t builds_before = cache.builds();
    const auto again = cache.get(prod, 11, 11, 1);  // dropped: built again, the same ids
    CHECK(cache.builds() == builds_before + 1);
    CHECK(same_ids(*again, *rpe::build_bucket_ids(prod, 11, 11, 1)));

    SUBCASE("set_budget evicts at once; ids handed out stay valid and unchanged") {
        cache.set_budget(0);
        s = cache.stats();
        CHECK(s.entries == 0);
        CHECK(s.bytes == 0);
        CHECK(g10->length() == 101);
        CHECK(same_ids(*g10, *rpe::build_bucket_ids(prod, 10, 10, 1)));
        // budget 0: nothing is kept between calls, every call still gets its ids
        const auto t = cache.get(prod, 9, 9, 1);
        CHECK(t->length() == 82);
        CHECK(cache.size() == 0);
        CHECK(cache.get(prod, 9, 9, 1).get() != t.get());
    }
    SUBCASE("clear drops everything and resets the counters, the budget stays") {
        const std::size_t budget = cache.budget();
        cache.clear();
        s = cache.stats();
        CHECK(s.entries == 0);
        CHECK(s.hits + s.misses + s.evictions + s.bytes == 0);
        CHECK(s.budget == budget);
    }
}

TEST_CASE("bucket_cache: the default budget is 64 MiB or RPE_CACHE_BUDGET_MB") {
    // CTest runs this case twice: as is, and with RPE_CACHE_BUDGET_MB=3 (test cache.budget_from_environment)
    const char* env = std::getenv("RPE_CACHE_BUDGET_MB");
    const std::size_t expected =
        env != nullptr && *env != '\0' ? static_cast<std::size_t>(std::stoull(env)) << 20 : std::size_t{64} << 20;
    CHECK(rpe::detail::default_cache_budget() == expected);
    CHECK(rpe::bucket_cache{}.budget() == expected);
    CHECK(rpe::bucket_cache::global().budget() == expected);
}

TEST_CASE("bucket_cache: 8 threads racing lookups, evictions and clear() get the single-threaded ids") {
    rpe::bucket_cache cache;
    cache.set_budget(3 * static_cast<std::size_t>(rpe::build_bucket_ids(prod, 12, 12, 1)->bytes()));  // a few grids at most
    std::vector<std::shared_ptr<const rpe::bucket_ids>> expected;
    for (int s = 4; s < 16; ++s) expected.push_back(rpe::build_bucket_ids(prod, s, s + 1, 1));
    std::atomic<int> ready{0}, wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
            ready.fetch_add(1);
            while (ready.load() < 8) std::this_thread::yield();
            for (int i = 0; i < 60; ++i) {
                const int s = 4 + (i * 7 + t * 3) % 12;
                const auto ids = cache.get(prod, s, s + 1, 1);
                if (!same_ids(*ids, *expected[static_cast<std::size_t>(s - 4)])) wrong.fetch_add(1);
                if (t == 0 && i % 15 == 14) cache.clear();
                if (t == 1 && i % 20 == 19) cache.set_budget(cache.budget() / 2 + 1);
                (void)cache.stats();
            }
        });
    for (auto& th : threads) th.join();
    CHECK(wrong.load() == 0);
    const rpe::cache_stats s = cache.stats();
    CHECK(s.bytes <= s.budget);
    CHECK(s.entries <= 12);
}

TEST_CASE("caches: RoPE tables count against their budget; set_cache_budget and cache_statistics cover both host caches") {
    const std::size_t old_ids = rpe::bucket_cache::global().budget(), old_rope = rpe::detail::rope_cache().budget();
    rpe::clear_caches();
    const rpe::rotary_embedding<float> r{.form = rpe::rope::axial{.theta = 77.0f}, .skip = 1};
    // one (1, 8x8 tokens, D/2 = 8 pairs) float table: cos and sin
    const std::size_t table_bytes = 2 * 64 * 8 * sizeof(float);
    const auto t8 = rpe::rope_table_of(r, 16, 8, 8);
    CHECK(rpe::cache_statistics().rope_tables.bytes == table_bytes);
    CHECK(rpe::cache_statistics().rope_tables.misses == 1);
    CHECK(rpe::rope_table_of(r, 16, 8, 8).get() == t8.get());  // a hit
    CHECK(rpe::cache_statistics().rope_tables.hits == 1);
    // a budget of two 8x8 tables: larger grids push the oldest out, values unchanged when rebuilt
    rpe::set_cache_budget(2 * table_bytes);
    for (int s = 9; s < 14; ++s) (void)rpe::rope_table_of(r, 16, s, s);
    const rpe::host_cache_stats st = rpe::cache_statistics();
    CHECK(st.rope_tables.budget == 2 * table_bytes);
    CHECK(st.bucket_ids.budget == 2 * table_bytes);
    CHECK(st.rope_tables.bytes <= 2 * table_bytes);
    CHECK(st.rope_tables.evictions >= 4);
    const auto again = rpe::rope_table_of(r, 16, 8, 8);
    CHECK(again.get() != t8.get());  // built again
    CHECK(again->cos == t8->cos);
    CHECK(again->sin == t8->sin);
    rpe::set_cache_budget(0);
    CHECK(rpe::cache_statistics().rope_tables.entries == 0);
    rpe::bucket_cache::global().set_budget(old_ids);
    rpe::detail::rope_cache().set_budget(old_rope);
    rpe::clear_caches();
}

TEST_CASE("bucket_cache: an entry larger than the whole budget is handed out and not kept; the others stay") {
    rpe::bucket_cache cache;
    const std::size_t small = static_cast<std::size_t>(rpe::build_bucket_ids(prod, 6, 6, 1)->bytes());
    cache.set_budget(4 * small);
    (void)cache.get(prod, 6, 6, 1);
    (void)cache.get(prod, 5, 7, 1);
    const auto big = cache.get(prod, 30, 30, 1);  // far beyond the budget
    CHECK(big->length() == 901);
    const rpe::cache_stats s = cache.stats();
    CHECK(s.entries == 2);  // the two small grids stay
    CHECK(s.evictions == 1);
    CHECK(s.bytes <= s.budget);
    CHECK(cache.get(prod, 6, 6, 1) != nullptr);
    CHECK(cache.stats().hits == 1);
}

}  // namespace rpe_unit_core_cache
