// 1D mappings for token sequences on a 1 × L grid: T5 relative buckets against the T5 formula
// (written out again here, independently of include/rpe/mapping/t5.hpp) and Shaw et al.'s clip
// against the loop formulas of the Shaw article (seeds/shaw_relative_attention_article.txt),
// through rpe::term (contextual key and value terms) and rpe::attention_forward.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <rpe/any_term.hpp>
#include <rpe/attention.hpp>
#include <rpe/bucket_cache.hpp>
#include <rpe/mapping/shaw.hpp>
#include <rpe/mapping/t5.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_mapping_1d {

namespace {

// T5's `_relative_position_bucket` for one relative position (memory − query = j − i), step by
// step as the Python: integer halving, float32 log of float32(n) / max_exact, the denominator
// math.log(max_distance / max_exact) in double then float32, the product with (nb − max_exact)
// in float32, `.to(long)` (truncation), then the min with nb − 1.
int t5_formula(std::int64_t relative_position, bool bidirectional, int num_buckets, int max_distance) {
    std::int64_t relative_buckets = 0;
    std::int64_t n = relative_position;
    if (bidirectional) {
        num_buckets /= 2;
        relative_buckets += (n > 0 ? 1 : 0) * num_buckets;
        n = std::abs(n);
    } else {
        n = -std::min<std::int64_t>(n, 0);
    }
    const int max_exact = num_buckets / 2;
    const bool is_small = n < max_exact;
    const float scaled = static_cast<float>(n) / static_cast<float>(max_exact);
    const float log_ratio = static_cast<float>(std::log(static_cast<double>(max_distance) / max_exact));
    const float v = std::log(scaled) / log_ratio * static_cast<float>(num_buckets - max_exact);
    std::int64_t if_large = max_exact + static_cast<std::int64_t>(is_small ? 0.0f : v);
    if_large = std::min<std::int64_t>(if_large, num_buckets - 1);
    return static_cast<int>(relative_buckets + (is_small ? n : if_large));
}

// bucket of T5 relative position j − i: on a one-row grid dc = i − j = −(j − i)
int t5_at(const rpe::mapping::t5& m, int relative_position) { return m.bucket(0, -relative_position); }

}  // namespace

TEST_CASE("t5 buckets equal the T5 formula at every offset in -1000..1000") {
    const rpe::mapping::t5 configs[] = {
        {},                                                            // T5: 32, 128, bidirectional
        {.buckets = 32, .max_distance = 128, .bidirectional = false},  // T5 decoder
        {.buckets = 64, .max_distance = 256, .bidirectional = true},
        {.buckets = 16, .max_distance = 50, .bidirectional = false},
        {.buckets = 11, .max_distance = 20, .bidirectional = true},  // odd: last id unused
        {.buckets = 4, .max_distance = 2, .bidirectional = true},    // smallest bidirectional
        {.buckets = 2, .max_distance = 3, .bidirectional = false},   // smallest causal
    };
    for (const auto& m : configs) {
        CAPTURE(m.buckets);
        CAPTURE(m.max_distance);
        CAPTURE(m.bidirectional);
        REQUIRE_NOTHROW(m.validate());
        int mismatches = 0, first_bad = 0;
        for (int rel = -1000; rel <= 1000; ++rel) {
            const int got = t5_at(m, rel);
            const int want = t5_formula(rel, m.bidirectional, m.buckets, m.max_distance);
            if (got != want || got < 0 || got >= m.num_buckets()) {
                if (mismatches++ == 0) first_bad = rel;
            }
        }
        CAPTURE(first_bad);
        CHECK(mismatches == 0);
    }
}

TEST_CASE("t5 buckets: hand-checked values of the default configurations") {
    // Bidirectional, 32 buckets, max_distance 128: nb = 16 per direction, max_exact = 8; keys
    // before the query (j − i < 0) in 0..15, after it in 16..31. Beyond 8 the log part:
    // 8 + trunc(ln(n/8) / ln(16) · 8): n = 16 → 8 + 2 = 10, n = 32 → 12, n = 64 → 14,
    // n = 127 → 8 + trunc(7.98) = 15, n ≥ 128 → capped at 15.
    const rpe::mapping::t5 enc{};
    CHECK(enc.num_buckets() == 32);
    CHECK(t5_at(enc, 0) == 0);
    CHECK(t5_at(enc, -1) == 1);
    CHECK(t5_at(enc, -7) == 7);
    CHECK(t5_at(enc, -8) == 8);
    CHECK(t5_at(enc, -15) == 9);
    CHECK(t5_at(enc, -16) == 10);
    CHECK(t5_at(enc, -32) == 12);
    CHECK(t5_at(enc, -64) == 14);
    CHECK(t5_at(enc, -127) == 15);
    CHECK(t5_at(enc, -128) == 15);
    CHECK(t5_at(enc, -100000) == 15);
    CHECK(t5_at(enc, 1) == 17);
    CHECK(t5_at(enc, 7) == 23);
    CHECK(t5_at(enc, 8) == 24);
    CHECK(t5_at(enc, 16) == 26);
    CHECK(t5_at(enc, 128) == 31);
    CHECK(t5_at(enc, 2000000000) == 31);
    // Causal, 32 buckets: keys after the query share bucket 0; max_exact = 16, and
    // 16 + trunc(ln(n/16) / ln(8) · 16): n = 32 → 16 + 5 = 21 (5.33), n = 64 → 26 (10.67).
    const rpe::mapping::t5 dec{.buckets = 32, .max_distance = 128, .bidirectional = false};
    CHECK(t5_at(dec, 5) == 0);
    CHECK(t5_at(dec, 0) == 0);
    CHECK(t5_at(dec, -1) == 1);
    CHECK(t5_at(dec, -15) == 15);
    CHECK(t5_at(dec, -16) == 16);
    CHECK(t5_at(dec, -32) == 21);
    CHECK(t5_at(dec, -64) == 26);
    CHECK(t5_at(dec, -128) == 31);
    CHECK(t5_at(dec, -5000) == 31);
    // dr is ignored (the mapping reads the column offset only)
    CHECK(enc.bucket(3, -16) == enc.bucket(0, -16));
}

TEST_CASE("t5 bucket ids on a 1 x L grid and the cache key") {
    const rpe::mapping::t5 m{};
    const int L = 300;
    const auto ids = rpe::build_bucket_ids(m, 1, L, 0);
    CHECK(ids->num_buckets() == 32);
    CHECK(ids->id_bytes() == 1);
    int mismatches = 0;
    for (int i = 0; i < L; ++i)
        for (int j = 0; j < L; ++j) mismatches += ids->at(0, i, j) != t5_formula(j - i, true, 32, 128);
    CHECK(mismatches == 0);
    // with a skip token, the extra id K = 32 and the table has 33 rows
    const auto with_cls = rpe::build_bucket_ids(m, 1, 10, 1);
    CHECK(with_cls->num_buckets() == 33);
    CHECK(with_cls->at(0, 0, 4) == 32);
    CHECK(with_cls->at(0, 1, 4) == t5_formula(3, true, 32, 128));
    // the whole configuration is the cache key: causal and bidirectional are distinct entries
    rpe::bucket_cache cache;
    const auto a = cache.get(m, 1, 20, 0);
    const auto b = cache.get(rpe::mapping::t5{.bidirectional = false}, 1, 20, 0);
    CHECK(a.get() != b.get());
    CHECK(cache.get(rpe::mapping::t5{}, 1, 20, 0).get() == a.get());
    CHECK(cache.builds() == 2);
}

TEST_CASE("t5 and shaw reject invalid parameters") {
    using rpe_test::throws_with;
    CHECK(throws_with([] { rpe::mapping::t5{.buckets = 3}.validate(); }, {"[rpe.mapping.t5] num_buckets = 3", "[4, 2^30)"}));
    CHECK(
        throws_with([] { rpe::mapping::t5{.buckets = 1, .bidirectional = false}.validate(); }, {"num_buckets = 1", "[2, 2^30)"}));
    CHECK(throws_with([] { rpe::mapping::t5{.buckets = 32, .max_distance = 8}.validate(); },
                      {"[rpe.mapping.t5] max_distance = 8", "max_exact = 8"}));
    CHECK(throws_with([] { (void)rpe::build_bucket_ids(rpe::mapping::t5{.max_distance = -1}, 1, 4, 0); }, "max_distance = -1"));
    CHECK(throws_with([] { rpe::mapping::shaw{.k = -1}.validate(); }, {"[rpe.mapping.shaw] k = -1", "0 <= k < 2^30"}));
    CHECK(throws_with([] { rpe::mapping::shaw{.k = 1 << 30}.validate(); }, "k = 1073741824"));
    using key_term = rpe::term<rpe::mapping::shaw, rpe::mode::contextual, rpe::target::key, double>;
    CHECK(throws_with([] { (void)key_term(rpe::mapping::shaw{.k = -3}, {.num_heads = 1, .head_dim = 4}); }, "k = -3"));
    CHECK_NOTHROW(rpe::mapping::shaw{.k = 0}.validate());
}

TEST_CASE("shaw clip ids: clamp(j - i, -k, k) + k on a 1 x L grid") {
    const rpe::mapping::shaw m{.k = 3};
    CHECK(m.num_buckets() == 7);
    static_assert(rpe::mapping::shaw{.k = 3}.bucket(0, 0) == 3);  // constexpr
    // offset j − i = −dc
    CHECK(m.bucket(0, 0) == 3);
    CHECK(m.bucket(0, -1) == 4);  // key one after the query
    CHECK(m.bucket(0, 1) == 2);   // key one before
    CHECK(m.bucket(0, -3) == 6);
    CHECK(m.bucket(0, -9) == 6);
    CHECK(m.bucket(0, 9) == 0);
    CHECK(m.bucket(5, -1) == 4);  // dr is ignored
    const int L = 12;
    const auto ids = rpe::build_bucket_ids(m, 1, L, 0);
    int mismatches = 0;
    for (int i = 0; i < L; ++i)
        for (int j = 0; j < L; ++j) mismatches += ids->at(0, i, j) != std::clamp(j - i, -3, 3) + 3;
    CHECK(mismatches == 0);
}

TEST_CASE("shaw: the article's loop formulas equal the contextual key and value terms and the fused attention") {
    // Seed article (Shaw et al. as implemented step by step): a table of 2k+1 vectors a^K, a^V;
    // e_ij = (q_i·k_j + q_i·a^K_{clip(j−i)}) / √d; α = softmax_j(e); z_i = Σ_j α_ij (v_j + a^V_{clip(j−i)}).
    const int L = 9, D = 4, k = 2, K = 2 * k + 1;
    const auto q = rpe_test::random_normal<double>(L * D, 11);
    const auto kk = rpe_test::random_normal<double>(L * D, 12);
    const auto v = rpe_test::random_normal<double>(L * D, 13);
    const auto a_k = rpe_test::random_normal<double>(K * D, 14, 0.5);  // (2k+1, D), row per offset
    const auto a_v = rpe_test::random_normal<double>(K * D, 15, 0.5);
    auto idx = [&](int i, int j) { return std::max(-k, std::min(k, j - i)) + k; };
    const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));

    std::vector<double> scores(L * L), alpha(L * L), z(L * D, 0.0);
    for (int i = 0; i < L; ++i) {
        for (int j = 0; j < L; ++j) {
            double content = 0, position = 0;
            for (int d = 0; d < D; ++d) {
                content += q[i * D + d] * kk[j * D + d];
                position += q[i * D + d] * a_k[idx(i, j) * D + d];
            }
            scores[i * L + j] = (content + position) * inv_sqrt_d;
        }
        const double mx = *std::max_element(scores.begin() + i * L, scores.begin() + (i + 1) * L);
        double sum = 0;
        for (int j = 0; j < L; ++j) sum += alpha[i * L + j] = std::exp(scores[i * L + j] - mx);
        for (int j = 0; j < L; ++j) alpha[i * L + j] /= sum;
        for (int j = 0; j < L; ++j)
            for (int d = 0; d < D; ++d) z[i * D + d] += alpha[i * L + j] * (v[j * D + d] + a_v[idx(i, j) * D + d]);
    }

    // the library: Shaw on a 1 × L grid, no skip token; key table (1, D, K) = a^Kᵀ, value table (1, K, D) = a^V
    const rpe::mapping::shaw m{.k = k};
    using key_term = rpe::term<rpe::mapping::shaw, rpe::mode::contextual, rpe::target::key, double>;
    using value_term = rpe::term<rpe::mapping::shaw, rpe::mode::contextual, rpe::target::value, double>;
    const key_term tk(m, {.num_heads = 1, .head_dim = D});
    const value_term tv(m, {.num_heads = 1, .head_dim = D});
    REQUIRE(tk.num_buckets() == K);
    const auto ids = tk.bucket_ids(1, L);
    std::vector<double> table_k(D * K), table_v = a_v;
    for (int d = 0; d < D; ++d)
        for (int b = 0; b < K; ++b) table_k[d * K + b] = a_k[b * D + d];
    const std::vector<std::int64_t> xshape{1, 1, L, D}, lshape{1, 1, L, L};

    SUBCASE("contextual key term: (q·s)kᵀ + term = the article's scores") {
        std::vector<double> qs(q), logits(L * L);
        for (auto& x : qs) x *= inv_sqrt_d;
        tk.forward(*ids, rpe_test::cview(table_k, {1, D, K}), rpe_test::cview(qs, xshape), rpe_test::mview(logits, lshape),
                   rpe::write::overwrite);
        for (int i = 0; i < L; ++i)
            for (int j = 0; j < L; ++j)
                for (int d = 0; d < D; ++d) logits[i * L + j] += qs[i * D + d] * kk[j * D + d];
        CHECK(rpe_test::max_abs_diff(logits, scores) <= 1e-12);
    }
    SUBCASE("contextual value term: α·v + term = the article's z") {
        std::vector<double> out(L * D);
        tv.forward(*ids, rpe_test::cview(table_v, {1, K, D}), rpe_test::cview(alpha, lshape), rpe_test::mview(out, xshape),
                   rpe::write::overwrite);
        for (int i = 0; i < L; ++i)
            for (int j = 0; j < L; ++j)
                for (int d = 0; d < D; ++d) out[i * D + d] += alpha[i * L + j] * v[j * D + d];
        CHECK(rpe_test::max_abs_diff(out, z) <= 1e-12);
    }
    SUBCASE("rpe::attention_forward with the Shaw key and value terms = the article's z") {
        const auto any_k = rpe::make_any_term(tk);
        const auto any_v = rpe::make_any_term(tv);
        rpe::attention_inputs<double> in;
        in.q = rpe_test::cview(q, xshape);
        in.k = rpe_test::cview(kk, xshape);
        in.v = rpe_test::cview(v, xshape);
        in.height = 1;
        in.width = L;
        in.rpe_k = {any_k.get(), {rpe_test::cview(table_k, {1, D, K})}, {}};
        in.rpe_v = {any_v.get(), {rpe_test::cview(table_v, {1, K, D})}, {}};
        std::vector<double> out(L * D), attn(L * L);
        rpe::attention_forward(in, rpe_test::mview(out, xshape), rpe_test::mview(attn, lshape));
        CHECK(rpe_test::max_abs_diff(attn, alpha) <= 1e-12);
        CHECK(rpe_test::max_abs_diff(out, z) <= 1e-12);
    }
}

}  // namespace rpe_unit_mapping_1d
