// rpe::attention_options::query_rows: a forward on some query rows only. The rows computed equal
// those rows of the call on every row (float, double, bf16 on both of its paths, f16; contextual
// q, k and v terms, a bias term, both masks, the attn output, small row blocks), the other rows of
// out and attn are left as they were, and bad ranges, the backward, packed sequences and the
// composed baseline are refused naming the option.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "cpu_paths.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_attention_query_rows {

namespace {

using M = rpe::mapping::product<rpe::index::piecewise>;

// B = 2, H = 2, a 3 x 4 grid with a class token (L = 13), D = 8; contextual terms on q, k and v
// (tables shared by the heads), a bias term on k is not combined with the contextual one (one
// term per slot): the bias mode is covered by `bias` = true (bias on k, contextual q and v).
template <class S>
struct rows_problem {
    static constexpr std::int64_t b = 2, h = 2, d = 8;
    static constexpr int height = 3, width = 4;
    static constexpr std::int64_t l = 1 + height * width;
    M mapping{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};
    rpe::term_desc tq, tk, tv;
    std::vector<S> q, k, v, tab_q, tab_k, tab_v, mask;
    std::vector<std::uint8_t> kpm;

    explicit rows_problem(bool bias)
        : tq(rpe::make_term_desc(mapping, true, rpe::target::query, {.num_heads = 2, .head_dim = 8, .skip = 1})),
          tk(rpe::make_term_desc(mapping, !bias, rpe::target::key,
                                 {.num_heads = 2, .head_dim = 8, .shared_head = !bias, .skip = 1})),
          tv(rpe::make_term_desc(mapping, true, rpe::target::value, {.num_heads = 2, .head_dim = 8, .skip = 1})) {
        std::mt19937 rng(99);
        std::normal_distribution<double> normal(0.0, 1.0);
        auto fill = [&](std::vector<S>& x, std::int64_t n, double scale) {
            x.resize(static_cast<std::size_t>(n));
            for (auto& e : x) e = static_cast<S>(scale * normal(rng));
        };
        for (auto* x : {&q, &k, &v}) fill(*x, b * h * l * d, 1.0);
        fill(tab_q, size(tq), 0.5);
        fill(tab_k, size(tk), 0.5);
        fill(tab_v, size(tv), 0.5);
        fill(mask, l * l, 0.3);
        kpm.assign(static_cast<std::size_t>(b * l), 0);
        kpm[static_cast<std::size_t>(l + 5)] = 1;  // key 5 of batch element 1 padded
    }
    static std::int64_t size(const rpe::term_desc& t) {
        std::int64_t n = 1;
        for (auto e : t.table_shape()) n *= e;
        return n;
    }
    rpe::attention_inputs<S> inputs() const {
        rpe::attention_inputs<S> in;
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        in.height = height;
        in.width = width;
        in.rpe_q = {.term = &tq, .tables = {{tab_q.data(), tq.table_shape()}}};
        in.rpe_k = {.term = &tk, .tables = {{tab_k.data(), tk.table_shape()}}};
        in.rpe_v = {.term = &tv, .tables = {{tab_v.data(), tv.table_shape()}}};
        in.attn_mask = {mask.data(), {l, l}};
        in.key_padding_mask = {kpm.data(), {b, l}};
        return in;
    }
};

double as_double(double x) { return x; }
double as_double(float x) { return x; }
double as_double(rpe::bf16 x) { return static_cast<float>(x); }
double as_double(rpe::f16 x) { return static_cast<float>(x); }

// The forward on rows [begin, end) against the forward on every row: rows inside within `tol`
// (relative to 1 + |value|) of it, rows outside still holding the sentinel they were filled with.
template <class S>
void check_rows(const rows_problem<S>& p, rpe::query_row_range rows, std::int64_t row_block, double tol) {
    CAPTURE(rows.begin);
    CAPTURE(rows.end);
    CAPTURE(row_block);
    const auto in = p.inputs();
    const std::int64_t b = p.b, h = p.h, l = p.l, d = p.d;
    const S sentinel = static_cast<S>(7.0f);
    std::vector<S> out_all(p.q.size()), attn_all(static_cast<std::size_t>(b * h * l * l));
    rpe::attention_forward(in, rpe::tensor_ref<S>(out_all.data(), {b, h, l, d}),
                           rpe::tensor_ref<S>(attn_all.data(), {b, h, l, l}), {.row_block = row_block});
    std::vector<S> out(out_all.size(), sentinel), attn(attn_all.size(), sentinel);
    rpe::attention_forward(in, rpe::tensor_ref<S>(out.data(), {b, h, l, d}), rpe::tensor_ref<S>(attn.data(), {b, h, l, l}),
                           {.row_block = row_block, .query_rows = rows});
    const std::int64_t end = rows.end == -1 ? l : rows.end;
    std::int64_t inside = 0;
    for (std::int64_t p0 = 0; p0 < b * h; ++p0)
        for (std::int64_t i = 0; i < l; ++i) {
            const bool in_range = i >= rows.begin && i < end;
            inside += in_range;
            for (auto [x, y, n] : {std::tuple{out.data(), out_all.data(), d}, std::tuple{attn.data(), attn_all.data(), l}})
                for (std::int64_t c = 0; c < n; ++c) {
                    const double got = as_double(x[(p0 * l + i) * n + c]), want = as_double(y[(p0 * l + i) * n + c]);
                    if (in_range)
                        REQUIRE(std::abs(got - want) <= tol * (1.0 + std::abs(want)));
                    else
                        REQUIRE(got == 7.0);
                }
        }
    CHECK(inside == b * h * (end - rows.begin));
}

const std::vector<rpe::query_row_range> ranges{{0, 1}, {0, -1}, {5, 13}, {3, 9}, {12, -1}, {4, 4}};

}  // namespace

TEST_CASE_TEMPLATE("attention query_rows: the rows computed equal the whole call's, the others are not written", S, float,
                   double) {
    // float: the products' bits may depend on where a row block starts (Eigen's kernels off
    // AVX-512F), hence a tolerance of a few roundings; double likewise (Eigen on every unit). On
    // AVX-512F the float products run on simd::gemm: the same bits (as documented).
#if defined(__AVX512F__)
    const double tol = std::is_same_v<S, float> ? 0.0 : 1e-12;
#else
    const double tol = std::is_same_v<S, float> ? 1e-5 : 1e-12;
#endif
    for (const bool bias : {false, true}) {
        CAPTURE(bias);
        const rows_problem<S> p(bias);
        for (const auto& r : ranges)
            for (const std::int64_t rb : {0, 2, 5}) check_rows(p, r, rb, tol);
    }
}

TEST_CASE_TEMPLATE("attention query_rows: 16-bit storage, every path", H, rpe::bf16, rpe::f16) {
    // the rows computed against the whole call's, within two roundings of the 16-bit format
    const double tol = std::is_same_v<H, rpe::bf16> ? 2.0 / 128 : 2.0 / 1024;
    const rows_problem<H> p(false);
    for (const bool portable : {false, true}) {  // bf16: AVX512_BF16 (where built and present) and portable
        CAPTURE(portable);
        const rpe_test::bf16_portable_path path(portable);
        for (const auto& r : ranges) check_rows(p, r, 0, tol);
    }
}

TEST_CASE("attention query_rows: bad ranges, the backward, packed sequences and the composed baseline are refused") {
    const rows_problem<double> p(false);
    const auto in = p.inputs();
    const std::int64_t b = p.b, h = p.h, l = p.l, d = p.d;
    const std::vector<std::int64_t> shape{b, h, l, d};
    std::vector<double> out(p.q.size(), 42.0);
    const rpe::tensor_ref<double> out_ref(out.data(), shape);
    for (const auto& [r, text] : std::vector<std::pair<rpe::query_row_range, const char*>>{
             {{-1, 3}, "[rpe.attention] options.query_rows = [-1, 3); expected 0 <= begin <= end <= L = 13 (end -1: L)"},
             {{0, 14}, "[rpe.attention] options.query_rows = [0, 14); expected 0 <= begin <= end <= L = 13 (end -1: L)"},
             {{5, 4}, "[rpe.attention] options.query_rows = [5, 4); expected 0 <= begin <= end <= L = 13 (end -1: L)"},
             {{14, -1}, "[rpe.attention] options.query_rows = [14, -1); expected 0 <= begin <= end <= L = 13 (end -1: L)"},
             {{0, -2}, "[rpe.attention] options.query_rows = [0, -2); expected 0 <= begin <= end <= L = 13 (end -1: L)"}}) {
        CHECK_THROWS_WITH_AS(rpe::attention_forward(in, out_ref, {}, {.query_rows = r}), text, rpe::invalid_argument);
    }
    for (double x : out) REQUIRE(x == 42.0);  // nothing written
    // the backward: every row's gradient is needed
    std::vector<double> go(p.q.size(), 1.0), gq(p.q.size()), gk(p.q.size()), gv(p.q.size());
    const rpe::attention_gradients<double> g{
        .grad_out = {go.data(), shape}, .grad_q = {gq.data(), shape}, .grad_k = {gk.data(), shape}, .grad_v = {gv.data(), shape}};
    CHECK_THROWS_WITH_AS(
        rpe::attention_backward(in, g, {.query_rows = {0, 1}}),
        doctest::Contains(
            "[rpe.attention] options.query_rows = [0, 1); expected every row, [0, -1) or [0, L = 13), in the backward"),
        rpe::invalid_argument);
    CHECK_NOTHROW(rpe::attention_backward(in, g, {.query_rows = {0, -1}}));
    CHECK_NOTHROW(rpe::attention_backward(in, g, {.query_rows = {0, l}}));  // every row, spelled out
    // the composed baseline computes every row
    std::vector<double> attn(static_cast<std::size_t>(b * h * l * l));
    CHECK_THROWS_WITH_AS(
        rpe::composed_attention_forward(in, out_ref, rpe::tensor_ref<double>(attn.data(), {b, h, l, l}), {.query_rows = {0, 1}}),
        "[rpe.attention] options.query_rows (some query rows only) is not supported by the composed backend", rpe::not_supported);
    // packed sequences: one image of the whole length
    const std::int32_t lengths[1] = {static_cast<std::int32_t>(l)}, grids[2] = {p.height, p.width};
    auto packed = in;
    packed.attn_mask = {};
    packed.key_padding_mask = {};
    packed.height = 0;  // each image's grid is in packed.grids
    packed.width = 0;
    packed.packed.lengths = {lengths, {1}};
    packed.packed.grids = {grids, {1, 2}};
    CHECK_NOTHROW(rpe::attention_forward(packed, out_ref));
    CHECK_THROWS_WITH_AS(rpe::attention_forward(packed, out_ref, {}, {.query_rows = {0, 1}}),
                         "[rpe.attention] options.query_rows (some query rows only) with packed sequences (packed) is not "
                         "supported by the cpu backend",
                         rpe::not_supported);
    // a backend without the feature
    const rpe::attention_capabilities no_rows{
        .backend = "test", .strided_qkv = true, .key_padding_mask = true, .attn_mask = true};
    CHECK_THROWS_WITH_AS(rpe::detail::check_attention_forward(in, out_ref, {}, {.query_rows = {0, 1}}, no_rows),
                         "[rpe.attention] options.query_rows (some query rows only) is not supported by the test backend",
                         rpe::not_supported);
    // [0, L) is every row: taken where the option is not
    CHECK_NOTHROW(rpe::detail::check_attention_forward(in, out_ref, {}, {.query_rows = {0, l}}, no_rows));
    CHECK_NOTHROW(
        rpe::composed_attention_forward(in, out_ref, rpe::tensor_ref<double>(attn.data(), {b, h, l, l}), {.query_rows = {0, l}}));
}

}  // namespace rpe_unit_attention_query_rows
