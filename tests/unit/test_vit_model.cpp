// The whole-model forward of examples/vit/vit_model.hpp (the model/deit_s/* benchmarks and the
// digits example run it): on small random models (16×16×3 images, patch 4, C 32, 4 heads, depth 2)
// against a forward written loop by loop in double from the definition (the attention step by
// rpe::composed_attention_forward, the unfused baseline), for no RPE, iRPE-K, iRPE-QKV, bias-mode
// iRPE, RoPE-Mixed; iRPE with zero tables against the model without it; the MAC count of DeiT-S
// by hand; and the errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../../examples/vit/vit_model.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_model {

namespace {

using rpe::examples::vit_config;
using rpe::examples::vit_model;

/// A small DeiT: 16×16×3 images, patch 4 (G 4, L 17), C 32, H 4 (D 8), depth 2, MLP 64, 5 classes,
/// iRPE contextual Product ratio 1.9 (K 50) on `rpe_on`, shared tables, skip 1.
vit_config small_config(const std::string& rpe_on = "", rpe::rope_form rope = {}) {
    vit_config c;
    c.img_size = 16, c.patch_size = 4, c.in_chans = 3, c.embed_dim = 32, c.depth = 2, c.num_heads = 4;
    c.mlp_hidden_dim = 64, c.num_classes = 5;
    c.rpe_on = rpe_on;
    c.rpe.ratio(1.9);
    c.rope = std::move(rope);
    return c;
}

/// Weights of std 0.2 (activations of order 1, so iRPE changes the logits visibly) and tables of 0.3.
constexpr rpe::examples::vit_random_init init{.seed = 11, .std = 0.2, .rpe_std = 0.3};

std::vector<float> images_of(const vit_config& c, int n) {
    std::vector<float> x(static_cast<std::size_t>(n) * c.in_chans * c.img_size * c.img_size);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.1));
    return x;
}

std::vector<float> forward(const vit_model<float>& model, const std::vector<float>& images, int n) {
    const auto& c = model.config();
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes);
    model.forward(rpe::tensor_ref<const float>(images.data(), {n, c.in_chans, c.img_size, c.img_size}),
                  rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}));
    return logits;
}

using vec = std::vector<double>;

/// LayerNorm of each row of x (rows, C), biased variance, in double.
vec layer_norm(const vec& x, std::int64_t rows, std::int64_t C, const float* w, const float* b, double eps) {
    vec y(x.size());
    for (std::int64_t r = 0; r < rows; ++r) {
        double mean = 0, var = 0;
        for (std::int64_t c = 0; c < C; ++c) mean += x[r * C + c];
        mean /= static_cast<double>(C);
        for (std::int64_t c = 0; c < C; ++c) var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
        var /= static_cast<double>(C);
        for (std::int64_t c = 0; c < C; ++c) y[r * C + c] = (x[r * C + c] - mean) / std::sqrt(var + eps) * w[c] + b[c];
    }
    return y;
}

/// y (rows, out) = x (rows, in) · Wᵀ + b, W (out, in) as nn.Linear, in double.
vec linear(const vec& x, std::int64_t rows, std::int64_t in, const float* w, const float* b, std::int64_t out) {
    vec y(static_cast<std::size_t>(rows * out));
    for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t o = 0; o < out; ++o) {
            double s = b ? b[o] : 0.0;
            for (std::int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
            y[r * out + o] = s;
        }
    return y;
}

/// The model's forward from its definition (vit_model.hpp's file comment), one image at a time,
/// in double but for the attention step: rpe::composed_attention_forward in float on the block's
/// q, k, v (the model's terms, tables, RoPE frequencies).
std::vector<float> reference_forward(const vit_model<float>& model, const std::vector<float>& images, int n) {
    const auto& c = model.config();
    const auto& w = model.weights();
    const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens, F = c.mlp_hidden_dim, G = c.grid;
    const std::int64_t P = c.patch_size, S = c.img_size, Cin = c.in_chans;
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes);
    for (std::int64_t img = 0; img < n; ++img) {
        const float* x = images.data() + img * Cin * S * S;
        vec z(static_cast<std::size_t>(L * C));
        for (std::int64_t ch = 0; ch < C; ++ch) z[ch] = static_cast<double>(w.cls_token[ch]) + w.pos_embed[ch];
        for (std::int64_t r = 0; r < G; ++r)
            for (std::int64_t col = 0; col < G; ++col) {
                const std::int64_t t = 1 + r * G + col;
                for (std::int64_t o = 0; o < C; ++o) {
                    double s = static_cast<double>(w.patch_b[o]) + w.pos_embed[t * C + o];
                    for (std::int64_t ci = 0; ci < Cin; ++ci)
                        for (std::int64_t ky = 0; ky < P; ++ky)
                            for (std::int64_t kx = 0; kx < P; ++kx)
                                s += static_cast<double>(w.patch_w[((o * Cin + ci) * P + ky) * P + kx]) *
                                     x[(ci * S + P * r + ky) * S + P * col + kx];
                    z[t * C + o] = s;
                }
            }
        for (int i = 0; i < c.depth; ++i) {
            const auto& bw = w.blocks[static_cast<std::size_t>(i)];
            const vec h = layer_norm(z, L, C, bw.norm1_w, bw.norm1_b, c.layer_norm_eps);
            const vec qkv = linear(h, L, C, bw.qkv_w, bw.qkv_b, 3 * C);
            std::vector<float> q(static_cast<std::size_t>(H * L * D)), k(q.size()), v(q.size()), out(q.size());
            for (std::int64_t hd = 0; hd < H; ++hd)
                for (std::int64_t l = 0; l < L; ++l)
                    for (std::int64_t d = 0; d < D; ++d) {
                        const auto e = static_cast<std::size_t>((hd * L + l) * D + d);
                        q[e] = static_cast<float>(qkv[l * 3 * C + hd * D + d]);
                        k[e] = static_cast<float>(qkv[l * 3 * C + C + hd * D + d]);
                        v[e] = static_cast<float>(qkv[l * 3 * C + 2 * C + hd * D + d]);
                    }
            rpe::attention_inputs<float> in;
            in.q = {q.data(), {1, H, L, D}};
            in.k = {k.data(), {1, H, L, D}};
            in.v = {v.data(), {1, H, L, D}};
            in.height = static_cast<int>(G);
            in.width = static_cast<int>(G);
            const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
            rpe::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
            for (int t = 0; t < 3; ++t) {
                const auto* term = model.rpe_term(targets[t]);
                if (!term) continue;
                const auto shape = term->table_shape();
                slots[t]->term = term;
                slots[t]->tables = {rpe::tensor_ref<const float>(bw.rpe_table[t], std::span<const std::int64_t>(shape))};
            }
            if (c.rope.index() != 0) {
                in.rope.form = c.rope;
                in.rope.skip = 1;
                if (bw.rope_freqs) in.rope.freqs = {bw.rope_freqs, {2, H, D / 2}};
            }
            std::vector<float> attn(static_cast<std::size_t>(H * L * L));
            rpe::composed_attention_forward(in, rpe::tensor_ref<float>(out.data(), {1, H, L, D}),
                                            rpe::tensor_ref<float>(attn.data(), {1, H, L, L}));
            vec o(static_cast<std::size_t>(L * C));
            for (std::int64_t hd = 0; hd < H; ++hd)
                for (std::int64_t l = 0; l < L; ++l)
                    for (std::int64_t d = 0; d < D; ++d)
                        o[l * C + hd * D + d] = out[static_cast<std::size_t>((hd * L + l) * D + d)];
            const vec proj = linear(o, L, C, bw.proj_w, bw.proj_b, C);
            for (std::size_t e = 0; e < z.size(); ++e) z[e] += proj[e];
            const vec h2 = layer_norm(z, L, C, bw.norm2_w, bw.norm2_b, c.layer_norm_eps);
            vec f = linear(h2, L, C, bw.fc1_w, bw.fc1_b, F);
            for (auto& e : f) e = 0.5 * e * (1.0 + std::erf(e / std::sqrt(2.0)));
            const vec mlp = linear(f, L, F, bw.fc2_w, bw.fc2_b, C);
            for (std::size_t e = 0; e < z.size(); ++e) z[e] += mlp[e];
        }
        const vec cls = layer_norm(vec(z.begin(), z.begin() + C), 1, C, w.norm_w, w.norm_b, c.layer_norm_eps);
        const vec out = linear(cls, 1, C, w.head_w, w.head_b, c.num_classes);
        for (int j = 0; j < c.num_classes; ++j)
            logits[static_cast<std::size_t>(img * c.num_classes + j)] = static_cast<float>(out[j]);
    }
    return logits;
}

double max_abs(const std::vector<float>& a) {
    double m = 0;
    for (const float e : a) m = std::max(m, std::fabs(static_cast<double>(e)));
    return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
    return m;
}

}  // namespace

TEST_CASE("vit_model: the forward equals a loop-by-loop reference forward (no RPE, iRPE, RoPE-Mixed)") {
    struct variant {
        const char* name;
        vit_config config;
    };
    vit_config bias_k = small_config("k");  // bias mode, per-head tables, Euclidean
    bias_k.rpe.contextual = false;
    bias_k.rpe.shared_head = false;
    bias_k.rpe.method = rpe::method::euclidean;
    const variant variants[] = {{"none", small_config()},
                                {"k", small_config("k")},
                                {"qkv", small_config("qkv")},
                                {"bias_euclidean_k", bias_k},
                                {"rope_mixed", small_config("", rpe::rope::mixed{})},
                                {"rope_mixed_k", small_config("k", rpe::rope::mixed{})}};
    const int n = 3;
    for (const auto& v : variants)
        for (const bool pruned : {true, false}) {
            CAPTURE(v.name);
            CAPTURE(pruned);
            vit_config c = v.config;
            c.last_block_class_token_only = pruned;
            const auto model = rpe::examples::make_random_vit<float>(c, init);
            const auto images = images_of(model.config(), n);
            const auto ours = forward(model, images, n);
            const auto ref = reference_forward(model, images, n);
            // float32 GEMMs of at most 64 products and a float32 attention step over two blocks:
            // at most 7.5e-7 relative to the largest logit here (AVX-512 build); 1e-5 leaves a
            // margin for other ISAs, while any real error (a missing bias, a wrong table, an
            // unrotated key) moves the logits by more than 1e-2 relative (the next test case).
            const double scale = max_abs(ref);
            CHECK(scale > 0.1);
            CHECK(max_abs_diff(ours, ref) <= 1e-5 * scale);
        }
}

// Layers large enough (rows · in · out ≥ 2^20) that the Linear layers' products split their
// columns, and for the projection's two 64-column strips also their rows, among the threads:
// with AVX-512F (rpe's product) the logits are the same bits on one and two threads; elsewhere
// (Eigen's product, whose blocking follows the thread count) within float rounding; both equal
// the reference forward.
TEST_CASE("vit_model: Linear layers shared among threads give the one-thread logits bit for bit") {
    vit_config c = small_config("k");
    c.img_size = 32, c.embed_dim = 128, c.mlp_hidden_dim = 512;  // L 65, D 32, depth 2 (the first block on every token)
    const int n = 4;
    const auto model = rpe::examples::make_random_vit<float>(c, init);
    const auto images = images_of(model.config(), n);
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    const auto one = forward(model, images, n);
#if defined(_OPENMP)
    omp_set_num_threads(2);
#endif
    const auto two = forward(model, images, n);
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    REQUIRE(one.size() == two.size());
    const auto ref = reference_forward(model, images, n);
    const double scale = max_abs(ref);
#if defined(__AVX512F__)
    for (std::size_t i = 0; i < one.size(); ++i) CHECK(one[i] == two[i]);
#else
    CHECK(max_abs_diff(one, two) <= 1e-5 * scale);
#endif
    CHECK(scale > 0.1);
    CHECK(max_abs_diff(one, ref) <= 1e-5 * scale);
}

TEST_CASE("vit_model: iRPE with zero tables computes the model without iRPE; nonzero tables change it") {
    const int n = 2;
    const auto none = rpe::examples::make_random_vit<float>(small_config(), init);
    const auto images = images_of(none.config(), n);
    const auto base = forward(none, images, n);
    const double scale = max_abs(base);
    for (const char* on : {"k", "qkv"}) {
        CAPTURE(on);
        auto zero = init;
        zero.rpe_std = 0;
        const auto z = forward(rpe::examples::make_random_vit<float>(small_config(on), zero), images, n);
        CHECK(max_abs_diff(z, base) <= 1e-5 * scale);  // the same sums but the extra zero terms
        const auto r = forward(rpe::examples::make_random_vit<float>(small_config(on), init), images, n);
        CHECK(max_abs_diff(r, base) >= 1e-2 * scale);
    }
    const auto rope = forward(rpe::examples::make_random_vit<float>(small_config("", rpe::rope::mixed{}), init), images, n);
    CHECK(max_abs_diff(rope, base) >= 1e-2 * scale);
}

TEST_CASE("vit_model: attention() is the forward's attention step, and the chunk size does not change the logits") {
    const auto model = rpe::examples::make_random_vit<float>(small_config("qkv"), init);
    const auto& c = model.config();
    const int n = 5;
    const auto images = images_of(c, n);
    const auto one_chunk = forward(model, images, n);
    auto chunked = rpe::examples::make_random_vit<float>(small_config("qkv"), init);
    chunked.set_chunk_size(2);
    // other GEMM shapes: rounding only (1.1e-6 here, logits of about 2)
    CHECK(max_abs_diff(forward(chunked, images, n), one_chunk) <= 1e-5 * max_abs(one_chunk));
    // trace: block 0's attention probabilities, recomputed from LN1 of the tokens by attention()
    rpe::examples::vit_trace<float> trace;
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes);
    model.forward(rpe::tensor_ref<const float>(images.data(), {n, c.in_chans, c.img_size, c.img_size}),
                  rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}), &trace);
    const std::int64_t L = c.tokens, C = c.embed_dim, H = c.num_heads, D = c.head_dim;
    const auto& bw = model.weights().blocks[0];
    const vec t(trace.tokens.begin(), trace.tokens.end());
    const vec h = layer_norm(t, n * L, C, bw.norm1_w, bw.norm1_b, c.layer_norm_eps);
    const vec qkv = linear(h, n * L, C, bw.qkv_w, bw.qkv_b, 3 * C);
    const std::vector<float> qkv_f(qkv.begin(), qkv.end());
    std::vector<float> out(static_cast<std::size_t>(n * H * L * D)), attn(static_cast<std::size_t>(n * H * L * L));
    model.attention(0, rpe::tensor_ref<const float>(qkv_f.data(), {n, L, 3 * C}),
                    rpe::tensor_ref<float>(out.data(), {n, H, L, D}), rpe::tensor_ref<float>(attn.data(), {n, H, L, L}));
    CHECK(max_abs_diff(attn, trace.attn.at(0)) <= 1e-5);
}

TEST_CASE("vit_model: DeiT-S configuration and MACs by formula") {
    const auto c = rpe::examples::deit_s_config("k");
    CHECK(c.tokens == 197);
    CHECK(c.grid == 14);
    CHECK(c.head_dim == 64);
    CHECK(c.rpe_num_buckets == 50);  // 7·7 product buckets + the class token's
    CHECK_FALSE(c.last_block_class_token_only);
    // By hand, per image: patch 196·768·384 = 57,802,752; per block qkv 197·384·1152 = 87,146,496,
    // q·kᵀ and a·v 2·6·197²·64 = 29,805,312, proj 197·384² = 29,048,832, MLP 2·197·384·1536 =
    // 232,390,656 (block 378,391,296; 12 blocks 4,540,695,552); head 384·1000 = 384,000.
    const auto m = rpe::examples::vit_macs(c, false);
    CHECK(m.patch_embed == 57802752.0);
    CHECK(m.qkv == 12 * 87146496.0);
    CHECK(m.attention == 12 * 29805312.0);
    CHECK(m.proj == 12 * 29048832.0);
    CHECK(m.mlp == 12 * 232390656.0);
    CHECK(m.head == 384000.0);
    CHECK(m.base() == 4598882304.0);
    // iRPE-K: 12 blocks · H·L·K·D = 12 · 6·197·50·64 = 12 · 3,782,400
    CHECK(m.rpe == 45388800.0);
    CHECK(m.rope == 0.0);
    CHECK(rpe::examples::vit_macs(rpe::examples::deit_s_config("qkv"), false).rpe == 3 * 45388800.0);
    CHECK(rpe::examples::vit_macs(rpe::examples::deit_s_config(), false).rpe == 0.0);
    // RoPE-Mixed: 12 · (2·6·196·64·2 rotations + 6·196·32·2 angles) = 12 · 376,320
    const auto r = rpe::examples::vit_macs(rpe::examples::deit_s_config("", rpe::rope::mixed{}), false);
    CHECK(r.rope == 4515840.0);
    CHECK(r.rpe == 0.0);
    // bias mode: a table look-up, no MACs
    auto bias = rpe::examples::deit_s_config("k");
    bias.rpe.contextual = false;
    CHECK(rpe::examples::vit_macs(bias, false).rpe == 0.0);
    // the last block's queries, attention rows, projection and MLP on the class token only: 196
    // rows fewer, each 384² (q) + 384² + 2·384·1536 + 2·6·197·64 (q·kᵀ and a·v of one row)
    CHECK(rpe::examples::vit_macs(c, true).base() == 4598882304.0 - 196.0 * (147456 + 147456 + 1179648 + 151296));
    // iRPE in the pruned last block: k and v on one row (6·50·64 each), q on every key (6·197·50·64)
    CHECK(rpe::examples::vit_macs(rpe::examples::deit_s_config("qkv"), true).rpe == 3 * 45388800.0 - 2 * 196.0 * 6 * 50 * 64);
}

TEST_CASE("vit_model: configurations, weights and shapes are checked") {
    auto bad = small_config();
    bad.num_heads = 5;
    CHECK_THROWS_WITH_AS(bad.derive(), "[rpe.vit_model] embed_dim = 32 is not a multiple of num_heads = 5",
                         rpe::invalid_argument);
    bad = small_config("kx");
    CHECK_THROWS_WITH_AS(bad.derive(), "[rpe.vit_model] rpe_on = 'kx'; expected letters of \"qkv\"", rpe::invalid_argument);
    bad = small_config("kk");
    CHECK_THROWS_WITH_AS(bad.derive(), "[rpe.vit_model] rpe_on = 'kk' names target k twice", rpe::invalid_argument);
    bad = small_config();
    bad.img_size = 18;
    CHECK_THROWS_WITH_AS(bad.derive(), "[rpe.vit_model] img_size = 18 is not a multiple of patch_size = 4",
                         rpe::invalid_argument);
    bad = small_config();
    bad.depth = 0;
    CHECK_THROWS_WITH_AS(bad.derive(), "[rpe.vit_model] depth = 0; expected >= 1", rpe::invalid_argument);
    bad = small_config("k");
    bad.rpe.skip = 0;
    CHECK_THROWS_WITH_AS(bad.derive(),
                         "[rpe.vit_model] rpe.skip = 0; expected 1 (the class token is the only token before the grid)",
                         rpe::invalid_argument);

    // a null weight is named as in the state dict
    const auto model = rpe::examples::make_random_vit<float>(small_config("k"), init);
    auto w = model.weights();
    w.blocks[1].fc1_w = nullptr;
    CHECK_THROWS_WITH_AS(vit_model<float>(small_config("k"), w), "[rpe.vit_model] weight blocks.1.mlp.fc1.weight is null",
                         rpe::invalid_argument);
    w = model.weights();
    w.blocks[0].rpe_table[1] = nullptr;
    CHECK_THROWS_WITH_AS(vit_model<float>(small_config("k"), w), "[rpe.vit_model] weight blocks.0.attn.rpe_k table is null",
                         rpe::invalid_argument);
    w = model.weights();
    w.blocks.pop_back();
    CHECK_THROWS_WITH_AS(vit_model<float>(small_config("k"), w), "[rpe.vit_model] weights hold 1 blocks; expected depth = 2",
                         rpe::invalid_argument);

    const auto& c = model.config();
    std::vector<float> images(2 * 3 * 16 * 16), logits(2 * 5), qkv(2 * 17 * 96), out(2 * 4 * 17 * 8);
    CHECK_THROWS_WITH_AS(
        model.forward(rpe::tensor_ref<const float>(images.data(), {2, 1, 16, 16}), rpe::tensor_ref<float>(logits.data(), {2, 5})),
        "[rpe.vit_model] images have shape (2, 1, 16, 16); expected (N, 3, 16, 16)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(
        model.forward(rpe::tensor_ref<const float>(images.data(), {2, 3, 16, 16}), rpe::tensor_ref<float>(logits.data(), {2, 4})),
        "[rpe.vit_model] logits have shape (2, 4); expected (2, 5)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(model.attention(c.depth, rpe::tensor_ref<const float>(qkv.data(), {2, 17, 96}),
                                         rpe::tensor_ref<float>(out.data(), {2, 4, 17, 8})),
                         "[rpe.vit_model] block = 2; expected in [0, 2)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(model.attention(0, rpe::tensor_ref<const float>(qkv.data(), {2, 16, 96}),
                                         rpe::tensor_ref<float>(out.data(), {2, 4, 17, 8})),
                         "[rpe.vit_model] qkv has shape (2, 16, 96); expected (B, 17, 96), contiguous", rpe::invalid_argument);
    auto m = rpe::examples::make_random_vit<float>(small_config(), init);
    CHECK_THROWS_WITH_AS(m.set_chunk_size(0), "[rpe.vit_model] chunk_size = 0; expected >= 1", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(rpe::examples::make_random_vit<float>(small_config(), {.std = -1}),
                         "[rpe.vit_model] init std = -1, rpe_std = 0.02; expected >= 0", rpe::invalid_argument);
}

}  // namespace rpe_unit_vit_model
