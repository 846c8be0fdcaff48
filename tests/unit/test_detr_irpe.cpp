// The DETR encoder layer with iRPE of examples/03_detr against the reference's own
// (microsoft/Cream iRPE/DETR-with-iRPE TransformerEncoderLayer + RPEMultiheadAttention, run by
// tools/golden/gen_detr_irpe.py on a padded batch of 3 images, 3x4, 5x3 and 4x5, in a 5x5 grid;
// tests/data/golden_detr/README.md): at every valid query, the self-attention's output and the
// layer's output equal the reference's for the four ways of running the batch — the padded grid
// with the key padding mask (the reference's way), the same with key lengths, a packed sequence,
// and one call per image — and the padded grid's ids at an image's pairs are the image's own.
#include <doctest/doctest.h>

#include "../../examples/03_detr/detr_layer.hpp"
#include "golden.hpp"

#include <cstdint>
#include <string>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_detr_irpe {

namespace {

namespace dt = rpe::examples::detr;

std::string case_dir(const std::string& name) { return std::string(RPE_TEST_DATA_DIR) + "/golden_detr/" + name; }

/// One golden case: its folder and the --enc_rpe2d configuration it was made with (meta.json).
struct detr_case {
    const char* folder;
    double ratio;
    bool shared_head;
    const char* rpe_on;
};

constexpr detr_case cases[] = {{"layer_rpe_2_0_product_ctx_1_k", 2.0, true, "k"},
                               {"layer_rpe_1_9_product_ctx_0_qkv", 1.9, false, "qkv"}};
constexpr int C = 32, NHEAD = 4, FF = 64, B = 3, HP = 5, WP = 5, L = HP * WP;

dt::encoder_layer load_layer(const detr_case& c) {
    const auto dir = case_dir(c.folder);
    auto f = [&](const char* name) { return rpe_test::load<float>(dir, std::string(name) + ".npy"); };
    dt::layer_weights w;
    w.in_proj_weight = f("in_proj_weight");
    w.in_proj_bias = f("in_proj_bias");
    w.out_proj_weight = f("out_proj_weight");
    w.out_proj_bias = f("out_proj_bias");
    w.linear1_weight = f("linear1_weight");
    w.linear1_bias = f("linear1_bias");
    w.linear2_weight = f("linear2_weight");
    w.linear2_bias = f("linear2_bias");
    w.norm1_weight = f("norm1_weight");
    w.norm1_bias = f("norm1_bias");
    w.norm2_weight = f("norm2_weight");
    w.norm2_bias = f("norm2_bias");
    const std::string on = c.rpe_on;
    for (const char t : on) w.rpe_table[t == 'q' ? 0 : (t == 'k' ? 1 : 2)] = f((std::string("rpe_") + t + "_table").c_str());
    return {
        dt::layer_config{
            .d_model = C, .nhead = NHEAD, .dim_feedforward = FF, .ratio = c.ratio, .shared_head = c.shared_head, .rpe_on = on},
        std::move(w)};
}

/// The golden batch: padded (B, L, C) inputs as the reference got them, its mask, and the images.
struct golden_batch {
    std::vector<float> src, pos;
    std::vector<std::uint8_t> mask;
    std::vector<std::int32_t> sizes;  // (B, 2)
    std::vector<dt::image> images;    // each image's valid tokens, row-major
};

golden_batch load_batch(const std::string& dir) {
    golden_batch g;
    g.src = rpe_test::load<float>(dir, "src.npy", {B, L, C});
    g.pos = rpe_test::load<float>(dir, "pos.npy", {B, L, C});
    g.mask = rpe_test::load<std::uint8_t>(dir, "key_padding_mask.npy", {B, L});
    g.sizes = rpe_test::load<std::int32_t>(dir, "sizes.npy", {B, 2});
    for (int b = 0; b < B; ++b) {
        dt::image im{.height = g.sizes[2 * b], .width = g.sizes[2 * b + 1]};
        for (int r = 0; r < im.height; ++r)
            for (int c = 0; c < im.width; ++c)
                for (int e = 0; e < C; ++e) {
                    const auto i = static_cast<std::size_t>((b * L + r * WP + c) * C + e);
                    im.src.push_back(g.src[i]);
                    im.pos.push_back(g.pos[i]);
                    CHECK(g.mask[static_cast<std::size_t>(b * L + r * WP + c)] == 0);
                }
        g.images.push_back(std::move(im));
    }
    return g;
}

/// The rows of the valid queries of a padded (B, L, C) array, image after image (the packed order).
template <class T>
std::vector<T> valid_rows(const std::vector<T>& x, const golden_batch& g) {
    std::vector<T> v;
    for (int b = 0; b < B; ++b)
        for (int r = 0; r < g.images[static_cast<std::size_t>(b)].height; ++r)
            for (int c = 0; c < g.images[static_cast<std::size_t>(b)].width; ++c)
                for (int e = 0; e < C; ++e) v.push_back(x[static_cast<std::size_t>((b * L + r * WP + c) * C + e)]);
    return v;
}

/// attn_out and out at the valid queries against the reference's float32 and float64 results.
/// Tolerance: the reference's own float32 results differ from its float64 ones by at most
/// 6.4e-7 here (meta.json); rpe sums in another order, so 1e-5 + 1e-4·|expected|.
void check_against_reference(const std::string& dir, const golden_batch& g, const std::vector<float>& attn,
                             const std::vector<float>& out, const std::string& how) {
    for (const auto& [mine, name] : {std::pair{&attn, "attn_out"}, std::pair{&out, "out"}}) {
        const auto ref32 = valid_rows(rpe_test::load<double>(dir, std::string(name) + ".npy", {B, L, C}), g);
        const auto ref64 = valid_rows(rpe_test::load<double>(dir, std::string(name) + "_f64.npy", {B, L, C}), g);
        rpe_test::check_close(*mine, ref64, 1e-5, 1e-4, how + ": " + name + " vs float64 reference");
        rpe_test::check_close(*mine, ref32, 1e-5, 1e-4, how + ": " + name + " vs float32 reference");
    }
}

}  // namespace

TEST_CASE("detr_irpe: the encoder layer on the padded grid with the key padding mask reproduces the reference") {
    for (const auto& c : cases) {
        INFO("case " << c.folder);
        const auto dir = case_dir(c.folder);
        const auto layer = load_layer(c);
        const auto g = load_batch(dir);
        std::vector<float> attn(static_cast<std::size_t>(B * L * C)), out(attn.size());
        const rpe::tensor_ref<const std::uint8_t> mask(g.mask.data(), {B, L});
        // the reference's inputs as they are, padded tokens holding random values (never attended)
        layer.forward({g.src.data(), {B, L, C}}, {g.pos.data(), {B, L, C}}, {.height = HP, .width = WP, .key_padding_mask = mask},
                      {attn.data(), {B, L, C}}, {out.data(), {B, L, C}});
        check_against_reference(dir, g, valid_rows(attn, g), valid_rows(out, g), "padded + mask");

        // with key lengths (last valid key + 1: 2*5+4, 4*5+3, 3*5+5) the padded rows are skipped
        const auto pb = dt::padded_batch::make(g.images, C);
        CHECK(pb.height == HP);
        CHECK(pb.width == WP);
        CHECK(pb.key_lengths == std::vector<std::int32_t>{14, 23, 20});
        CHECK(pb.mask == g.mask);
        const rpe::tensor_ref<const std::int32_t> lengths(pb.key_lengths.data(), {B});
        std::fill(attn.begin(), attn.end(), -7.0f);
        std::fill(out.begin(), out.end(), -7.0f);
        layer.forward({g.src.data(), {B, L, C}}, {g.pos.data(), {B, L, C}},
                      {.height = HP, .width = WP, .key_padding_mask = mask, .key_lengths = lengths}, {attn.data(), {B, L, C}},
                      {out.data(), {B, L, C}});
        check_against_reference(dir, g, valid_rows(attn, g), valid_rows(out, g), "padded + mask + key_lengths");
    }
}

TEST_CASE("detr_irpe: the packed sequence and one call per image reproduce the reference's padded batch") {
    for (const auto& c : cases) {
        INFO("case " << c.folder);
        const auto dir = case_dir(c.folder);
        const auto layer = load_layer(c);
        const auto g = load_batch(dir);

        const auto pk = dt::packed_batch::make(g.images);
        CHECK(pk.tokens == 12 + 15 + 20);
        CHECK(pk.lengths == std::vector<std::int32_t>{12, 15, 20});
        std::vector<float> attn(static_cast<std::size_t>(pk.tokens * C)), out(attn.size());
        layer.forward({pk.src.data(), {1, pk.tokens, C}}, {pk.pos.data(), {1, pk.tokens, C}}, pk.layout(),
                      {attn.data(), {1, pk.tokens, C}}, {out.data(), {1, pk.tokens, C}});
        check_against_reference(dir, g, attn, out, "packed");

        std::vector<float> attn_each, out_each;
        for (const auto& im : g.images) {
            const std::int64_t n = static_cast<std::int64_t>(im.height) * im.width;
            std::vector<float> a(static_cast<std::size_t>(n * C)), o(a.size());
            layer.forward({im.src.data(), {1, n, C}}, {im.pos.data(), {1, n, C}}, {.height = im.height, .width = im.width},
                          {a.data(), {1, n, C}}, {o.data(), {1, n, C}});
            attn_each.insert(attn_each.end(), a.begin(), a.end());
            out_each.insert(out_each.end(), o.begin(), o.end());
        }
        check_against_reference(dir, g, attn_each, out_each, "one call per image");
        // packed is each image alone: the same to float rounding (here the same kernels and blocks)
        CHECK(rpe_test::max_abs_diff(attn, attn_each) <= 1e-6);
        CHECK(rpe_test::max_abs_diff(out, out_each) <= 1e-6);
    }
}

TEST_CASE("detr_irpe: the padded grid's ids at an image's pairs are the image's own ids, exactly") {
    for (const auto& c : cases) {
        INFO("case " << c.folder);
        const auto layer = load_layer(c);
        const auto g = load_batch(case_dir(c.folder));
        for (const char t : std::string(c.rpe_on)) {
            const auto* term = layer.term(t);
            REQUIRE(term != nullptr);
            CHECK(term->num_buckets() == (c.ratio == 2.0 ? 81 : 49));  // (2·int(2r) + 1)², skip 0
            const auto padded = term->bucket_ids(HP, WP);
            for (const auto& im : g.images) {
                const auto own = term->bucket_ids(im.height, im.width);
                std::vector<int> expect, got;
                for (int i = 0; i < im.height * im.width; ++i)
                    for (int j = 0; j < im.height * im.width; ++j) {
                        expect.push_back(own->at(0, i, j));
                        got.push_back(padded->at(0, (i / im.width) * WP + i % im.width, (j / im.width) * WP + j % im.width));
                    }
                rpe_test::check_exact(got, expect, "ids of image " + std::to_string(im.height) + "x" + std::to_string(im.width));
            }
        }
    }
}

TEST_CASE("detr_irpe: the example layer refuses bad weights and inputs, naming them") {
    const auto layer = load_layer(cases[0]);
    dt::layer_weights w;
    CHECK(rpe_test::throws_with(
        [&] { dt::encoder_layer bad(dt::layer_config{.d_model = C, .nhead = NHEAD, .dim_feedforward = FF}, w); },
        "[rpe.detr_layer] weight in_proj_weight has 0 elements; expected 3072"));
    CHECK(rpe_test::throws_with([&] { dt::encoder_layer bad(dt::layer_config{.d_model = C, .nhead = 5}, w); },
                                "[rpe.detr_layer] d_model = 32, nhead = 5"));
    std::vector<float> x(static_cast<std::size_t>(2 * 6 * C)), y(x.size());
    CHECK(rpe_test::throws_with(
        [&] {
            layer.forward({x.data(), {2, 6, C}}, {x.data(), {2, 6, C}}, {.height = 2, .width = 2}, {y.data(), {2, 6, C}});
        },
        "[rpe.attention]"));  // 6 tokens on a 2x2 grid
    CHECK(rpe_test::throws_with(
        [&] {
            layer.forward({x.data(), {2, 6, C}}, {x.data(), {2, 3, 2 * C}}, {.height = 2, .width = 3}, {y.data(), {2, 6, C}});
        },
        "[rpe.detr_layer] pos has shape (2, 3, 64); expected (2, 6, 32) as src"));
    // key lengths inside a packed sequence: each image is attended alone already
    const std::vector<std::int32_t> lengths = {6}, grids = {2, 3}, keys = {4};
    dt::token_layout t;
    t.packed.lengths = {lengths.data(), {1}};
    t.packed.grids = {grids.data(), {1, 2}};
    t.key_lengths = {keys.data(), {1}};
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] {
            layer.forward({x.data(), {1, 6, C}}, {x.data(), {1, 6, C}}, t, {y.data(), {1, 6, C}});
        },
        "key_lengths"));
}

}  // namespace rpe_unit_detr_irpe
