// Swin / BEiT relative position bias and SwinV2 continuous position bias against timm's own
// outputs (tests/data/golden_vit/{swin,beit,swinv2}, made by tools/golden/gen_swin.py): ids
// exactly, coordinates within 1 ulp, biases and gradients to float tolerance; the BEiT skip
// buckets in every storage and order; finite-difference gradients of the CPB through the term and
// through the fused attention; and the errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <rpe/any_term.hpp>
#include <rpe/attention.hpp>
#include <rpe/bucket_cache.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/swin.hpp>
#include <rpe/vit/swin_bias.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_swin {

namespace {

namespace mapping = rpe::mapping;
namespace mode = rpe::mode;
using rpe::target;
using rpe_test::cview;
using rpe_test::mview;

std::string vit_dir(const std::string& family) { return std::string(RPE_TEST_DATA_DIR) + "/golden_vit/" + family; }

/// Distance in float32 units in the last place (same sign assumed by the callers' data).
std::int64_t ulps(float a, float b) {
    if (a == b) return 0;
    std::int32_t ia = 0, ib = 0;
    std::memcpy(&ia, &a, 4);
    std::memcpy(&ib, &b, 4);
    if (ia < 0) ia = std::numeric_limits<std::int32_t>::min() - ia;
    if (ib < 0) ib = std::numeric_limits<std::int32_t>::min() - ib;
    return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// SwinV2's CPB MLP, as timm builds it: Linear(2, 512) + ReLU + Linear(512, H, no bias), in float.
struct cpb_mlp {
    std::vector<float> w1, b1, w2;  // (512, 2), (512,), (H, 512)
    int heads = 0;
    template <class S>
    void operator()(rpe::tensor_ref<const S> coords, rpe::tensor_ref<S> raw) const {
        const std::int64_t k = coords.extent(0), hidden = static_cast<std::int64_t>(b1.size());
        std::vector<S> act(static_cast<std::size_t>(hidden));
        for (std::int64_t b = 0; b < k; ++b) {
            for (std::int64_t u = 0; u < hidden; ++u) {
                const S a = coords.data[b * 2] * S(w1[u * 2]) + coords.data[b * 2 + 1] * S(w1[u * 2 + 1]) + S(b1[u]);
                act[u] = a > S(0) ? a : S(0);
            }
            for (int h = 0; h < heads; ++h) {
                S s = 0;
                for (std::int64_t u = 0; u < hidden; ++u) s += act[u] * S(w2[h * hidden + u]);
                raw.data[b * heads + h] = s;
            }
        }
    }
};

cpb_mlp load_mlp(const std::string& d) {
    cpb_mlp m{rpe_test::load<float>(d, "cpb_w1.npy", {512, 2}), rpe_test::load<float>(d, "cpb_b1.npy", {512}),
              rpe_test::load<float>(d, "cpb_w2.npy", {2, 512}), 2};
    return m;
}

}  // namespace

TEST_CASE("swin: bucket ids equal timm's relative position index") {
    const std::string d = vit_dir("swin");
    for (auto [wh, ww] : {std::pair{7, 7}, std::pair{3, 5}, std::pair{4, 2}}) {
        INFO("window " << wh << "x" << ww);
        const mapping::swin m{.window_h = wh, .window_w = ww};
        CHECK(m.num_buckets() == (2 * wh - 1) * (2 * ww - 1));
        const auto expected =
            rpe_test::load<int>(d, "index_" + std::to_string(wh) + "x" + std::to_string(ww) + ".npy", {wh * ww, wh * ww});
        for (auto storage : {rpe::id_storage::table, rpe::id_storage::on_the_fly}) {
            const auto ids = rpe::build_bucket_ids(m, wh, ww, 0, storage);
            CHECK(ids->num_buckets() == m.num_buckets());
            std::vector<int> got;
            for (int i = 0; i < ids->length(); ++i)
                for (int j = 0; j < ids->length(); ++j) got.push_back(ids->at(0, i, j));
            rpe_test::check_exact(got, expected, "swin ids");
        }
    }
    // every bucket is used exactly by its offset, and a smaller grid reads a subset
    const mapping::swin w{.window_h = 3, .window_w = 5};
    CHECK(w.bucket(-2, -4) == 0);
    CHECK(w.bucket(0, 0) == 22);
    CHECK(w.bucket(2, 4) == 44);
    CHECK(w.bucket(3, 0) == -1);
    CHECK(w.bucket(0, -5) == -1);
    const auto small = rpe::build_bucket_ids(w, 2, 5, 0);
    CHECK(small->at(0, 0, 9) == w.bucket(-1, -4));
}

TEST_CASE("swin: grids larger than the window and bad windows are rejected") {
    const mapping::swin w{.window_h = 7, .window_w = 7};
    CHECK(rpe_test::throws_with([&] { (void)rpe::build_bucket_ids(w, 8, 7, 0); },
                                {"[rpe.mapping.swin]", "grid = 8x7", "larger than the window 7x7"}));
    CHECK(
        rpe_test::throws_with([&] { (void)rpe::bucket_cache::global().get(w, 7, 9, 0); }, {"[rpe.mapping.swin]", "grid = 7x9"}));
    const rpe::term<mapping::swin, mode::bias, target::key> t(w, {.num_heads = 2, .head_dim = 4, .shared_head = false});
    CHECK(rpe_test::throws_with([&] { (void)t.bucket_ids(14, 14); }, {"grid = 14x14"}));
    CHECK(rpe_test::throws_with([] { mapping::swin{.window_h = 0, .window_w = 7}.validate(); },
                                {"[rpe.mapping.swin]", "window_h = 0"}));
    CHECK(rpe_test::throws_with([] { mapping::swin{.window_h = 7, .window_w = 9000}.validate(); }, {"window_w = 9000"}));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::term<mapping::swin, mode::bias, target::key>(mapping::swin{.window_h = -1, .window_w = 2},
                                                                    {.num_heads = 1, .head_dim = 1});
        },
        {"window_h = -1"}));
    CHECK(rpe_test::throws_with([] { mapping::beit{.window_h = 3, .window_w = 0}.validate(); },
                                {"[rpe.mapping.beit]", "window_w = 0"}));
    CHECK(rpe_test::throws_with([] { (void)rpe::build_bucket_ids(mapping::beit{.window_h = 3, .window_w = 3}, 3, 4, 1); },
                                {"[rpe.mapping.beit]", "grid = 3x4"}));
}

TEST_CASE("swin: bias term with timm's table equals timm's relative position bias") {
    const std::string d = vit_dir("swin");
    const mapping::swin w{.window_h = 3, .window_w = 5};
    const int h = 2, k = w.num_buckets(), n = 15;
    const auto timm_table = rpe_test::load<float>(d, "table_kh_3x5.npy", {k, h});
    std::vector<float> table(static_cast<std::size_t>(h * k));
    rpe::table_from_timm<float>(cview(timm_table, {k, h}), mview(table, {h, k}));
    CHECK(table[1] == timm_table[2]);  // table[0, 1] = timm[1, 0]
    CHECK(table[k] == timm_table[1]);  // table[1, 0] = timm[0, 1]
    std::vector<float> back(table.size());
    rpe::table_to_timm<float>(cview(table, {h, k}), mview(back, {k, h}));
    CHECK(back == timm_table);

    const rpe::term<mapping::swin, mode::bias, target::key> t(w, {.num_heads = h, .head_dim = 8, .shared_head = false});
    CHECK(t.num_buckets() == 45);
    std::vector<float> out(static_cast<std::size_t>(h * n * n));
    t.forward(*t.bucket_ids(3, 5), cview(table, {h, k}), {}, mview(out, {1, h, n, n}), rpe::write::overwrite);
    rpe_test::check_exact(out, rpe_test::load<float>(d, "bias_3x5.npy", {1, h, n, n}), "swin bias");  // a gather: bit-exact

    CHECK(rpe_test::throws_with(
        [&] {
            rpe::table_from_timm<float>(cview(timm_table, {k, h}), mview(table, {k, h}));
        },
        {"[rpe.swin_bias]", "table has shape (45, 2); expected (2, 45)"}));
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::table_to_timm<float>(cview(table, {h, k}), mview(table, {k, h}));
        },
        {"timm_table overlaps table"}));
}

TEST_CASE("beit: three class-token buckets equal timm's index, every storage and order") {
    const std::string d = vit_dir("beit");
    for (auto [wh, ww] : {std::pair{3, 4}, std::pair{2, 2}}) {
        INFO("window " << wh << "x" << ww);
        const mapping::beit m{.window_h = wh, .window_w = ww};
        const int n = 1 + wh * ww, kk = (2 * wh - 1) * (2 * ww - 1) + 3;
        const auto expected = rpe_test::load<int>(d, "index_" + std::to_string(wh) + "x" + std::to_string(ww) + ".npy", {n, n});
        for (auto storage : {rpe::id_storage::table, rpe::id_storage::on_the_fly}) {
            const auto ids = rpe::build_bucket_ids(m, wh, ww, 1, storage);
            CHECK(ids->num_buckets() == kk);
            CHECK(ids->skip_buckets() == 3);
            std::vector<int> at, rows, rows_t;
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n; ++j) at.push_back(ids->at(0, i, j));
            rpe_test::check_exact(at, expected, "beit ids (at)");
            std::vector<std::uint8_t> buf(static_cast<std::size_t>(n * n));
            const auto* r = ids->rows<std::uint8_t>(0, 0, n, false, buf.data());
            rows.assign(r, r + n * n);
            rpe_test::check_exact(rows, expected, "beit ids (rows)");
            std::vector<std::uint8_t> buf_t(static_cast<std::size_t>(n * n));
            const auto* rt = ids->rows<std::uint8_t>(0, 0, n, true, buf_t.data());
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n; ++j) rows_t.push_back(rt[j * n + i]);  // transposed rows hold id(j, i) at (i, j)
            rpe_test::check_exact(rows_t, expected, "beit ids (transposed rows)");
        }
        CHECK(expected[1] == kk - 3);  // class → token
        CHECK(expected[n] == kk - 2);  // token → class
        CHECK(expected[0] == kk - 1);  // class → class
    }
    // no class token: the grid buckets only; two skip tokens: K−1 between them
    const mapping::beit m{.window_h = 2, .window_w = 2};
    CHECK(rpe::build_bucket_ids(m, 2, 2, 0)->num_buckets() == 9);
    const auto two = rpe::build_bucket_ids(m, 2, 2, 2);
    CHECK(two->num_buckets() == 12);
    CHECK(two->at(0, 0, 1) == 11);
    CHECK(two->at(0, 1, 3) == 9);
    CHECK(two->at(0, 4, 1) == 10);
    CHECK(two->at(0, 2, 3) == m.bucket(0, -1));
    // the default mapping keeps one shared extra bucket
    const auto sw = rpe::build_bucket_ids(mapping::swin{.window_h = 2, .window_w = 2}, 2, 2, 1);
    CHECK(sw->num_buckets() == 10);
    CHECK(sw->skip_buckets() == 1);
    CHECK((sw->at(0, 0, 2) == 9 && sw->at(0, 2, 0) == 9 && sw->at(0, 0, 0) == 9));
}

TEST_CASE("beit: bias term (class token, per-head tables) equals timm's relative position bias") {
    const std::string d = vit_dir("beit");
    const mapping::beit m{.window_h = 3, .window_w = 4};
    const int h = 2, k = m.num_buckets() + 3, n = 13;
    const auto timm_table = rpe_test::load<float>(d, "table_kh_3x4.npy", {k, h});
    std::vector<float> table(static_cast<std::size_t>(h * k));
    rpe::table_from_timm<float>(cview(timm_table, {k, h}), mview(table, {h, k}));
    using key_term = rpe::term<mapping::beit, mode::bias, target::key>;
    const key_term t(m, {.num_heads = h, .head_dim = 4, .shared_head = false, .skip = 1});
    CHECK(t.num_buckets() == k);
    CHECK(t.table_shape() == std::vector<std::int64_t>{h, k});
    const auto any = rpe::make_any_term(t);
    CHECK(any->num_buckets() == k);
    std::vector<float> out(static_cast<std::size_t>(h * n * n)), out_any(out.size());
    t.forward(*t.bucket_ids(3, 4), cview(table, {h, k}), {}, mview(out, {1, h, n, n}), rpe::write::overwrite);
    const std::vector<rpe::tensor_ref<const float>> tabs{cview(table, {h, k})};
    any->forward(*any->bucket_ids(3, 4), tabs, {}, mview(out_any, {1, h, n, n}), rpe::write::overwrite);
    const auto expected = rpe_test::load<float>(d, "bias_3x4.npy", {1, h, n, n});
    rpe_test::check_exact(out, expected, "beit bias");
    rpe_test::check_exact(out_any, expected, "beit bias (any_term)");
    // the query target reads id(j, i): class → token and token → class swap
    const rpe::term<mapping::beit, mode::bias, target::query> tq(
        m, {.num_heads = h, .head_dim = 4, .shared_head = false, .skip = 1});
    std::vector<float> out_q(out.size());
    tq.forward(*tq.bucket_ids(3, 4), cview(table, {h, k}), {}, mview(out_q, {1, h, n, n}), rpe::write::overwrite);
    int swapped = 0;
    for (int hh = 0; hh < h; ++hh)
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j) swapped += out_q[(hh * n + i) * n + j] == out[(hh * n + j) * n + i];
    CHECK(swapped == h * n * n);
}

TEST_CASE("beit: table gradient by central differences") {
    const mapping::beit m{.window_h = 2, .window_w = 3};
    const int h = 2, k = m.num_buckets() + 3, n = 7;
    const rpe::term<mapping::beit, mode::bias, target::key, double> t(
        m, {.num_heads = h, .head_dim = 1, .shared_head = false, .skip = 1});
    const auto ids = t.bucket_ids(2, 3);
    std::mt19937 rng(5);
    std::normal_distribution<double> nd;
    std::vector<double> table(static_cast<std::size_t>(h * k)), g(static_cast<std::size_t>(2 * h * n * n)), grad(table.size());
    for (auto& x : table) x = nd(rng);
    for (auto& x : g) x = nd(rng);
    const auto loss = [&] {
        std::vector<double> out(g.size());
        t.forward(*ids, cview(table, {h, k}), {}, mview(out, {2, h, n, n}), rpe::write::overwrite);
        long double s = 0;
        for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<long double>(out[i]) * g[i];
        return static_cast<double>(s);
    };
    t.backward(*ids, cview(table, {h, k}), {}, cview(g, {2, h, n, n}), {}, mview(grad, {h, k}), rpe::write::overwrite);
    double worst = 0;
    for (std::size_t i = 0; i < table.size(); ++i) {
        const double saved = table[i];
        table[i] = saved + 1e-6;
        const double up = loss();
        table[i] = saved - 1e-6;
        const double down = loss();
        table[i] = saved;
        const double num = (up - down) / 2e-6;
        worst = std::max(worst, std::fabs(num - grad[i]) / std::max({std::fabs(num), std::fabs(grad[i]), 1e-2}));
    }
    CHECK(worst < 1e-6);
    // the three class-token buckets collect their pairs: K−1 only the (0, 0) entry of each plane
    double s = 0;
    for (int b = 0; b < 2; ++b) s += g[static_cast<std::size_t>(b * h * n * n)];
    CHECK(grad[static_cast<std::size_t>(k - 1)] == doctest::Approx(s));
}

TEST_CASE("swinv2: log-spaced coordinates equal timm's gen_relative_log_coords") {
    const std::string d = vit_dir("swinv2");
    struct coords_case {
        const char* file;
        mapping::swin window;
        rpe::log_coords_config config;
    };
    const coords_case cases[] = {
        {"coords_3x5.npy", {3, 5}, {}},
        {"coords_8x8_pre12x12.npy", {8, 8}, {.pretrained_h = 12, .pretrained_w = 12}},
        {"coords_4x6_pre3x5.npy", {4, 6}, {.pretrained_h = 3, .pretrained_w = 5}},
        {"coords_3x5_cr.npy", {3, 5}, {.mode = rpe::log_coords::cr}},
        {"coords_1x4_cr.npy", {1, 4}, {.mode = rpe::log_coords::cr}},
        {"cpb_coords_3x5_pre4x4.npy", {3, 5}, {.pretrained_h = 4, .pretrained_w = 4}},
    };
    for (const auto& c : cases) {
        INFO(c.file);
        const int k = c.window.num_buckets();
        const auto expected = rpe_test::load<float>(d, c.file, {k, 2});
        const auto got = rpe::relative_log_coords(c.window, c.config);
        REQUIRE(got.size() == expected.size());
        std::int64_t worst = 0;
        for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, ulps(got[i], expected[i]));
        CHECK(worst <= 1);
    }
    // the centre bucket is (0, 0); the window's corners are ±8 before the log: ±log2(9)/3
    const auto c = rpe::relative_log_coords({3, 5});
    CHECK(c[22 * 2] == 0.0f);
    CHECK(c[0] == -std::log2(9.0f) / 3.0f);
    CHECK(c[44 * 2 + 1] == std::log2(9.0f) / 3.0f);
}

TEST_CASE("swinv2: coordinate errors") {
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::relative_log_coords({1, 4});
        },
        {"[rpe.log_coords]", "window_h = 1 with pretrained_h = 0 divides by zero"}));
    CHECK(rpe_test::throws_with([] { (void)rpe::relative_log_coords({4, 1}); }, {"window_w = 1"}));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::relative_log_coords({4, 4}, {.pretrained_h = 12, .pretrained_w = 0});
        },
        {"pretrained_h = 12, pretrained_w = 0", "both 0"}));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::relative_log_coords({4, 4}, {.pretrained_h = 1, .pretrained_w = 1});
        },
        {"pretrained_h = 1"}));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::relative_log_coords({4, 4}, {.mode = static_cast<rpe::log_coords>(5)});
        },
        {"mode = 5"}));
    CHECK(rpe_test::throws_with([] { (void)rpe::relative_log_coords({0, 4}); }, {"[rpe.mapping.swin]", "window_h = 0"}));
    // a 1-wide window is fine with a pre-training window, or in cr mode
    CHECK(rpe::relative_log_coords({1, 4}, {.pretrained_h = 8, .pretrained_w = 8}).size() == 14);
}

TEST_CASE("swinv2: CPB bias from the MLP equals timm's, and its gradient w.r.t. the MLP output") {
    const std::string d = vit_dir("swinv2");
    const auto mlp = load_mlp(d);
    const rpe::cpb_bias<float> cpb({3, 5}, {.num_heads = 2, .pretrained_h = 4, .pretrained_w = 4});
    const int h = 2, k = cpb.num_buckets(), n = 15;
    CHECK(k == 45);
    std::vector<float> raw(static_cast<std::size_t>(k * h)), table(raw.size());
    cpb.make_table(mlp, mview(raw, {k, h}), mview(table, {h, k}));
    rpe_test::check_close(raw, to_double(rpe_test::load<float>(d, "cpb_raw.npy", {k, h})), 1e-5, 1e-5, "cpb raw (MLP output)");
    const auto ids = cpb.bucket_ids();
    std::vector<float> out(static_cast<std::size_t>(h * n * n));
    cpb.forward(*ids, cview(raw, {k, h}), mview(out, {1, h, n, n}), rpe::write::overwrite);
    const auto expected = to_double(rpe_test::load<float>(d, "cpb_bias.npy", {1, h, n, n}));
    rpe_test::check_close(out, expected, 1e-5, 1e-5, "cpb bias");
    // the same through the term with make_table's table
    std::vector<float> out_t(out.size());
    cpb.term().forward(*ids, cview(table, {h, k}), {}, mview(out_t, {1, h, n, n}), rpe::write::overwrite);
    CHECK(out_t == out);
    // gradient: timm's autograd of sum(bias * g) w.r.t. the MLP output
    const auto g = rpe_test::load<float>(d, "cpb_grad_out.npy", {1, h, n, n});
    std::vector<float> grad_raw(raw.size(), 7.0f);
    cpb.backward(*ids, cview(raw, {k, h}), cview(g, {1, h, n, n}), mview(grad_raw, {k, h}), rpe::write::overwrite);
    rpe_test::check_close(grad_raw, to_double(rpe_test::load<float>(d, "cpb_grad_raw.npy", {k, h})), 1e-5, 1e-4, "cpb grad raw");
    std::vector<float> acc(raw.size(), 1.0f);
    cpb.backward(*ids, cview(raw, {k, h}), cview(g, {1, h, n, n}), mview(acc, {k, h}), rpe::write::accumulate);
    CHECK(acc[3] == doctest::Approx(grad_raw[3] + 1.0f));
}

TEST_CASE("swinv2: CPB gradient by central differences, with and without 16*sigmoid, term and fused attention") {
    for (bool sig : {true, false}) {
        INFO("sigmoid16 = " << sig);
        const int h = 2, d = 4, wh = 2, ww = 3, n = wh * ww;
        const rpe::cpb_bias<double> cpb({wh, ww}, {.num_heads = h, .head_dim = d, .sigmoid16 = sig});
        const int k = cpb.num_buckets();
        std::mt19937 rng(sig ? 11 : 12);
        std::normal_distribution<double> nd;
        std::vector<double> raw(static_cast<std::size_t>(k * h)), g(static_cast<std::size_t>(h * n * n));
        for (auto& x : raw) x = nd(rng);
        for (auto& x : g) x = nd(rng);
        const auto ids = cpb.bucket_ids();
        // (a) the term alone
        const auto loss_term = [&] {
            std::vector<double> out(g.size());
            cpb.forward(*ids, cview(raw, {k, h}), mview(out, {1, h, n, n}), rpe::write::overwrite);
            long double s = 0;
            for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<long double>(out[i]) * g[i];
            return static_cast<double>(s);
        };
        std::vector<double> grad(raw.size());
        cpb.backward(*ids, cview(raw, {k, h}), cview(g, {1, h, n, n}), mview(grad, {k, h}), rpe::write::overwrite);
        // (b) inside the fused attention as rpe_k
        const int b = 2;
        std::vector<double> q(static_cast<std::size_t>(b * h * n * d)), kk(q.size()), v(q.size()), go(q.size());
        for (auto* x : {&q, &kk, &v, &go})
            for (auto& e : *x) e = nd(rng);
        const auto any = rpe::make_any_term(cpb.term());
        std::vector<double> table(static_cast<std::size_t>(h * k));
        const auto inputs = [&] {
            rpe::attention_inputs<double> in;
            in.q = cview(q, {b, h, n, d});
            in.k = cview(kk, {b, h, n, d});
            in.v = cview(v, {b, h, n, d});
            in.height = wh;
            in.width = ww;
            in.rpe_k = {any.get(), {cview(table, {h, k})}, {}};
            return in;
        };
        const auto loss_attn = [&] {
            cpb.make_table(cview(raw, {k, h}), mview(table, {h, k}));
            std::vector<double> out(q.size());
            rpe::attention_forward(inputs(), mview(out, {b, h, n, d}));
            long double s = 0;
            for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<long double>(out[i]) * go[i];
            return static_cast<double>(s);
        };
        cpb.make_table(cview(raw, {k, h}), mview(table, {h, k}));
        std::vector<double> grad_table(table.size()), gq(q.size()), gk(q.size()), gv(q.size()), grad_attn(raw.size());
        auto in = inputs();
        in.rpe_k.grad_tables = {mview(grad_table, {h, k})};
        rpe::attention_backward(in, cview(go, {b, h, n, d}), mview(gq, {b, h, n, d}), mview(gk, {b, h, n, d}),
                                mview(gv, {b, h, n, d}));
        cpb.backward_table(cview(raw, {k, h}), cview(grad_table, {h, k}), mview(grad_attn, {k, h}), rpe::write::overwrite);
        double worst_term = 0, worst_attn = 0;
        for (std::size_t i = 0; i < raw.size(); ++i) {
            const double saved = raw[i];
            const double step = 1e-6;
            raw[i] = saved + step;
            const double up_t = loss_term(), up_a = loss_attn();
            raw[i] = saved - step;
            const double down_t = loss_term(), down_a = loss_attn();
            raw[i] = saved;
            const double nt = (up_t - down_t) / (2 * step), na = (up_a - down_a) / (2 * step);
            worst_term = std::max(worst_term, std::fabs(nt - grad[i]) / std::max({std::fabs(nt), std::fabs(grad[i]), 1e-2}));
            worst_attn =
                std::max(worst_attn, std::fabs(na - grad_attn[i]) / std::max({std::fabs(na), std::fabs(grad_attn[i]), 1e-2}));
        }
        CHECK(worst_term < 1e-6);
        CHECK(worst_attn < 1e-6);
        CHECK(std::any_of(grad_attn.begin(), grad_attn.end(), [](double x) { return std::fabs(x) > 1e-3; }));
    }
}

TEST_CASE("swinv2: CPB errors name the argument") {
    const rpe::cpb_bias<float> cpb({3, 5}, {.num_heads = 2});
    std::vector<float> raw(90), table(90), small(10);
    CHECK(rpe_test::throws_with(
        [&] {
            cpb.make_table(cview(raw, {2, 45}), mview(table, {2, 45}));
        },
        {"[rpe.cpb]", "raw has shape (2, 45); expected (45, 2)"}));
    CHECK(rpe_test::throws_with([&] { cpb.make_table(cview(raw, {45, 2}), mview(small, {2, 5})); }, {"table has shape (2, 5)"}));
    CHECK(rpe_test::throws_with([&] { cpb.make_table(cview(raw, {45, 2}), mview(raw, {2, 45})); }, {"table overlaps raw"}));
    bool called = false;
    CHECK(rpe_test::throws_with(
        [&] {
            cpb.make_table([&](rpe::tensor_ref<const float>, rpe::tensor_ref<float>) { called = true; }, mview(raw, {45, 2}),
                           mview(small, {2, 5}));
        },
        {"table has shape"}));
    CHECK(!called);  // checked before the MLP runs
    CHECK(rpe_test::throws_with(
        [&] {
            cpb.backward_table(cview(raw, {45, 2}), cview(table, {2, 45}), mview(small, {5, 2}), rpe::write::overwrite);
        },
        {"grad_raw has shape (5, 2); expected (45, 2)"}));
    CHECK(rpe_test::throws_with([] { (void)rpe::cpb_bias<float>({3, 5}, {.num_heads = 0}); }, {"[rpe.term]", "num_heads = 0"}));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::cpb_bias<float>({1, 5}, {.num_heads = 2});
        },
        {"[rpe.log_coords]", "window_h = 1"}));
    std::vector<float> out(2 * 15 * 15);
    CHECK(rpe_test::throws_with(
        [&] {
            cpb.forward(*cpb.bucket_ids(), cview(small, {5, 2}), mview(out, {1, 2, 15, 15}), rpe::write::overwrite);
        },
        {"raw has shape (5, 2)"}));
}

}  // namespace rpe_unit_vit_swin
