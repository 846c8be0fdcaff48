// The bf16 whole-model forward of examples/vit/vit_model_bf16.hpp (the model/deit_s/*/bf16
// benchmarks and `deit_s --bf16` run it): on small random models (16×16×3 images, patch 4, C 32,
// 4 heads, depth 2, as test_vit_model.cpp) against vit_model<float> on the same bf16-rounded
// weights and bf16-rounded images, for no RPE, iRPE-K, iRPE-QKV, bias-mode iRPE, RoPE-Mixed, on
// both paths of the bf16 products (AVX512_BF16 where this build and CPU have it, and the portable
// kernel, forced with the test hook bf16_portable_only); the rounded weights; the attention step;
// the chunk size; errors.
//
// Tolerance of the logits: the two models compute the same function on the same values, but the
// bf16 one rounds every operand of a product to bf16 (unit roundoff u = 2^-8): per block the LN
// outputs, q, k, v, the probabilities (AVX512_BF16 path), the attention output and the GELU
// output, then the final LN output. Each rounding is a relative perturbation ≤ u of one operand,
// which moves a Linear's output by ≤ u·Σ|x·w| (of the order of u·|y| for terms of random sign);
// LayerNorm renormalises, and the residual stream adds the blocks' perturbations. With about 7
// roundings per block and 2 blocks, a random walk gives about u·√15 ≈ 0.015 of the logits'
// scale, the worst case 15·u ≈ 0.06. The bound checked is 0.03·max|logit| (measured: at most
// 0.0102 here, AVX512_BF16 and portable alike); a missing bias, an unrounded or wrong table, a wrong head or a
// skipped rounding either moves the logits by far more or leaves them equal to the float ones
// (the second check: the bf16 model really rounds, ≥ 1e-4·max|logit| apart).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../examples/vit/vit_model_bf16.hpp"
#include "cpu_paths.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_vit_model_bf16 {

namespace {

using rpe::examples::vit_config;
using rpe::examples::vit_model;
using rpe::examples::vit_model_bf16;

/// A small DeiT (as test_vit_model.cpp): 16×16×3 images, patch 4 (G 4, L 17), C 32, H 4 (D 8),
/// depth 2, MLP 64, 5 classes, iRPE contextual Product ratio 1.9 (K 50) on `rpe_on`.
vit_config small_config(const std::string& rpe_on = "", rpe::rope_form rope = {}) {
    vit_config c;
    c.img_size = 16, c.patch_size = 4, c.in_chans = 3, c.embed_dim = 32, c.depth = 2, c.num_heads = 4;
    c.mlp_hidden_dim = 64, c.num_classes = 5;
    c.rpe_on = rpe_on;
    c.rpe.ratio(1.9);
    c.rope = std::move(rope);
    return c;
}

/// Weights of std 0.2 (activations of order 1) and tables of 0.3, as test_vit_model.cpp.
constexpr rpe::examples::vit_random_init init{.seed = 11, .std = 0.2, .rpe_std = 0.3};

std::vector<float> images_of(const vit_config& c, int n) {
    std::vector<float> x(static_cast<std::size_t>(n) * c.in_chans * c.img_size * c.img_size);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.1));
    return x;
}

template <class Model>
std::vector<float> forward(const Model& model, const std::vector<float>& images, int n) {
    const auto& c = model.config();
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes);
    model.forward(rpe::tensor_ref<const float>(images.data(), {n, c.in_chans, c.img_size, c.img_size}),
                  rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}));
    return logits;
}

std::vector<float> rounded(std::vector<float> x) {
    for (auto& e : x) e = rpe::round_to_bf16(e);
    return x;
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

TEST_CASE("vit_model_bf16: logits against vit_model<float> on the same bf16-rounded weights and images, both paths") {
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
                                {"rope_mixed", small_config("", rpe::rope::mixed{})}};
    const int n = 3;
    double worst = 0;
    for (const auto& v : variants)
        for (const bool pruned : {true, false}) {
            CAPTURE(v.name);
            CAPTURE(pruned);
            vit_config c = v.config;
            c.last_block_class_token_only = pruned;
            const auto model = rpe::examples::make_random_vit<float>(c, init);
            const vit_model_bf16 bf(model);
            const auto images = images_of(model.config(), n);
            const auto ref = forward(bf.rounded_float_model(), rounded(images), n);
            const double scale = max_abs(ref);
            CHECK(scale > 0.1);
            for (const bool portable : {false, true}) {
                CAPTURE(portable);
                const rpe_test::bf16_portable_path path(portable);
                const auto got = forward(bf, images, n);
                const double err = max_abs_diff(got, ref) / scale;
                worst = std::max(worst, err);
                CHECK(err <= 0.03);
                CHECK(err >= 1e-4);
            }
        }
    MESSAGE("worst max|bf16 - float| / max|logit| on the small models: " << worst);
}

TEST_CASE("vit_model_bf16: the rounded weights, the paths agree, the chunk size does not change the logits") {
    const auto model = rpe::examples::make_random_vit<float>(small_config("qkv"), init);
    const vit_model_bf16 bf(model);
    const auto& c = bf.config();
    // every parameter of the reference is the float one rounded to bf16 (spot checks of each kind)
    const auto& w = model.weights();
    const auto& r = bf.rounded_float_model().weights();
    const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim;
    bool same = true;
    for (std::int64_t i = 0; i < 3 * C * C; ++i) same = same && r.blocks[1].qkv_w[i] == rpe::round_to_bf16(w.blocks[1].qkv_w[i]);
    for (std::int64_t i = 0; i < C * F; ++i) same = same && r.blocks[0].fc2_w[i] == rpe::round_to_bf16(w.blocks[0].fc2_w[i]);
    for (std::int64_t i = 0; i < F; ++i) same = same && r.blocks[0].fc1_b[i] == rpe::round_to_bf16(w.blocks[0].fc1_b[i]);
    for (std::int64_t i = 0; i < c.tokens * C; ++i) same = same && r.pos_embed[i] == rpe::round_to_bf16(w.pos_embed[i]);
    for (std::int64_t i = 0; i < 50 * 8; ++i)
        same = same && r.blocks[1].rpe_table[2][i] == rpe::round_to_bf16(w.blocks[1].rpe_table[2][i]);
    CHECK(same);
    CHECK(r.blocks[0].qkv_w != w.blocks[0].qkv_w);  // copies, not the float model's buffers
    CHECK(bf.chunk_size() == model.chunk_size());

    const int n = 5;
    const auto images = images_of(c, n);
    const auto hw = forward(bf, images, n);
    std::vector<float> portable;
    {
        const rpe_test::bf16_portable_path path(true);
        portable = forward(bf, images, n);
    }
    const double scale = max_abs(hw);
    // the paths differ in float summation order and, on AVX512_BF16, the rounded probabilities
    CHECK(max_abs_diff(hw, portable) <= 0.03 * scale);
    if (std::string(vit_model_bf16::isa()) == "portable") CHECK(max_abs_diff(hw, portable) == 0.0);

    vit_model_bf16 chunked(model);
    chunked.set_chunk_size(2);
    CHECK(max_abs_diff(forward(chunked, images, n), hw) <= 1e-6 * scale);
    CHECK_THROWS_WITH_AS(chunked.set_chunk_size(0), "[rpe.vit_model] chunk_size = 0; expected >= 1", rpe::invalid_argument);
}

TEST_CASE("vit_model_bf16: attention() against the float model's attention on the same bf16 q, k, v") {
    const auto model = rpe::examples::make_random_vit<float>(small_config("qkv"), init);
    const vit_model_bf16 bf(model);
    const auto& c = bf.config();
    const std::int64_t n = 2, L = c.tokens, C = c.embed_dim, H = c.num_heads, D = c.head_dim;
    std::vector<float> qkv(static_cast<std::size_t>(n * L * 3 * C));
    for (std::size_t i = 0; i < qkv.size(); ++i)
        qkv[i] = rpe::round_to_bf16(static_cast<float>(std::cos(0.7 * static_cast<double>(i))));
    std::vector<rpe::bf16> qkv_b(qkv.size()), out_b(static_cast<std::size_t>(n * H * L * D));
    for (std::size_t i = 0; i < qkv.size(); ++i) qkv_b[i] = rpe::bf16(qkv[i]);
    std::vector<float> out(out_b.size()), got(out_b.size());
    for (int block = 0; block < c.depth; ++block) {
        CAPTURE(block);
        bf.rounded_float_model().attention(block, rpe::tensor_ref<const float>(qkv.data(), {n, L, 3 * C}),
                                           rpe::tensor_ref<float>(out.data(), {n, H, L, D}));
        bf.attention(block, rpe::tensor_ref<const rpe::bf16>(qkv_b.data(), {n, L, 3 * C}),
                     rpe::tensor_ref<rpe::bf16>(out_b.data(), {n, H, L, D}));
        for (std::size_t i = 0; i < out.size(); ++i) got[i] = static_cast<float>(out_b[i]);
        // |v| ≤ 1: the output rounded once (≤ 2^-8·|out|) and the probabilities before P·v
        // (≤ 2^-8·Σ p·|v| ≤ 2^-8), plus float rounding (docs/attention.md, "bf16 storage")
        CHECK(max_abs_diff(got, out) <= 2.0 / 256 + 1e-5);
        CHECK(max_abs(out) > 0.1);
    }
    CHECK_THROWS_WITH_AS(bf.attention(c.depth, rpe::tensor_ref<const rpe::bf16>(qkv_b.data(), {n, L, 3 * C}),
                                      rpe::tensor_ref<rpe::bf16>(out_b.data(), {n, H, L, D})),
                         "[rpe.vit_model] block = 2; expected in [0, 2)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(bf.attention(0, rpe::tensor_ref<const rpe::bf16>(qkv_b.data(), {n, L - 1, 3 * C}),
                                      rpe::tensor_ref<rpe::bf16>(out_b.data(), {n, H, L, D})),
                         "[rpe.vit_model] qkv has shape (2, 16, 96); expected (B, 17, 96), contiguous", rpe::invalid_argument);
}

TEST_CASE("vit_model_bf16: shapes are checked before anything is written") {
    const auto model = rpe::examples::make_random_vit<float>(small_config("k"), init);
    const vit_model_bf16 bf(model);
    std::vector<float> images(2 * 3 * 16 * 16), logits(2 * 5, 7.0f);
    CHECK_THROWS_WITH_AS(
        bf.forward(rpe::tensor_ref<const float>(images.data(), {2, 1, 16, 16}), rpe::tensor_ref<float>(logits.data(), {2, 5})),
        "[rpe.vit_model] images have shape (2, 1, 16, 16); expected (N, 3, 16, 16)", rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(
        bf.forward(rpe::tensor_ref<const float>(images.data(), {2, 3, 16, 16}), rpe::tensor_ref<float>(logits.data(), {2, 4})),
        "[rpe.vit_model] logits have shape (2, 4); expected (2, 5)", rpe::invalid_argument);
    CHECK(std::all_of(logits.begin(), logits.end(), [](float x) { return x == 7.0f; }));
    const std::string isa = vit_model_bf16::isa();
    CHECK((isa == "AMX_BF16" || isa == "AVX512_BF16" || isa == "portable"));
}

}  // namespace rpe_unit_vit_model_bf16
