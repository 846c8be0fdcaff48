// A DETR encoder layer with iRPE (the reference's configuration rpe-2.0-product-ctx-1-k: contextual
// Product on keys, ratio 2.0, 9 × 9 buckets, table shared by the heads, no class token) over four
// feature maps of different sizes, run three ways and each checked against one call per image:
//
//   padded  the batch padded to its largest height and width (DETR's NestedTensor) with the key
//           padding mask, as the reference runs it (microsoft/Cream iRPE/DETR-with-iRPE), and the
//           same with key_lengths (the padded rows after each image's last valid key skipped);
//   packed  the images' tokens one after another in one sequence (attention_inputs::packed).
//
// Bucket ids: the padded grid's ids at an image's valid pairs equal the image's own ids exactly
// (they depend on the offset only, and padding is at the bottom and right). Values: the padded
// outputs at valid queries and the packed outputs equal the per-image ones to float rounding.
// "pairs" counts the (query, key) logits each way computes (docs/positions.md, "DETR").
//
// Prints one line (the differences depend on the CPU and compiler; each must be <= 1e-4):
//   detr: rpe-2.0-product-ctx-1-k C=64 H=8 K=81 images 6x8,9x5,7x7,4x10 padded 9x10: ids exact,
//   mask 7.2e-07 (pairs 32400), mask+key_lengths 7.2e-07 (pairs 22500), packed 0 (pairs 8330) ok
#include "detr_layer.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    // No options: the run is fixed (it is a check). Anything given gets the usage, not a silent run.
    if (argc > 1) {
        const char* usage =
            "usage: detr (no options): runs one DETR encoder layer with iRPE three ways (padded with "
            "the key padding mask, with key_lengths, packed) and checks each against one call per "
            "image\n";
        const std::string arg = argv[1];
        if (arg == "--help" || arg == "-h") {
            std::fputs(usage, stdout);
            return 0;
        }
        std::fprintf(stderr, "detr: unexpected argument '%s'; %s", arg.c_str(), usage);
        return 2;
    }
    namespace dt = rpe::examples::detr;
    const dt::layer_config cfg{
        .d_model = 64, .nhead = 8, .dim_feedforward = 128, .ratio = 2.0, .shared_head = true, .rpe_on = "k"};
    const auto layer = dt::encoder_layer::random(cfg, 7);
    const int C = cfg.d_model;

    // four feature maps of different sizes, random features and position embeddings
    std::vector<dt::image> images;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const auto& [h, w] : {std::pair{6, 8}, {9, 5}, {7, 7}, {4, 10}}) {
        dt::image im{.height = h, .width = w};
        for (int i = 0; i < h * w * C; ++i) im.src.push_back(normal(rng));
        for (int i = 0; i < h * w * C; ++i) im.pos.push_back(0.5f * normal(rng));
        images.push_back(std::move(im));
    }

    // one call per image: the check of the batched calls
    std::vector<std::vector<float>> single;
    for (const auto& im : images) {
        const std::int64_t n = static_cast<std::int64_t>(im.height) * im.width;
        std::vector<float> a(static_cast<std::size_t>(n * C)), o(a.size());
        layer.forward({im.src.data(), {1, n, C}}, {im.pos.data(), {1, n, C}}, {.height = im.height, .width = im.width},
                      {a.data(), {1, n, C}}, {o.data(), {1, n, C}});
        single.push_back(std::move(o));
    }

    // (a) padded: the padded grid with the key padding mask (the reference's way), then with key lengths too
    const auto pb = dt::padded_batch::make(images, C);
    const std::int64_t B = pb.batch, L = pb.tokens;
    const rpe::tensor_ref<const std::uint8_t> mask(pb.mask.data(), {B, L});
    const rpe::tensor_ref<const std::int32_t> lengths(pb.key_lengths.data(), {B});
    auto run_padded = [&](const dt::token_layout& t) {
        std::vector<float> a(static_cast<std::size_t>(B * L * C)), o(a.size());
        layer.forward({pb.src.data(), {B, L, C}}, {pb.pos.data(), {B, L, C}}, t, {a.data(), {B, L, C}}, {o.data(), {B, L, C}});
        double diff = 0;  // at valid queries against the image alone
        for (std::size_t b = 0; b < images.size(); ++b)
            for (int r = 0; r < images[b].height; ++r)
                for (int c = 0; c < images[b].width; ++c)
                    for (int e = 0; e < C; ++e) {
                        const auto i = (static_cast<std::size_t>(b) * static_cast<std::size_t>(L) +
                                        static_cast<std::size_t>(pb.token(r, c))) *
                                           static_cast<std::size_t>(C) +
                                       static_cast<std::size_t>(e);
                        const auto j = static_cast<std::size_t>((r * images[b].width + c) * C + e);
                        diff = std::fmax(diff, std::fabs(static_cast<double>(o[i]) - single[b][j]));
                    }
        return diff;
    };
    const double d_mask = run_padded({.height = pb.height, .width = pb.width, .key_padding_mask = mask});
    const double d_lengths =
        run_padded({.height = pb.height, .width = pb.width, .key_padding_mask = mask, .key_lengths = lengths});

    // (b) packed: one sequence, each image attended alone
    const auto pk = dt::packed_batch::make(images);
    std::vector<float> pa(static_cast<std::size_t>(pk.tokens * C)), po(pa.size());
    layer.forward({pk.src.data(), {1, pk.tokens, C}}, {pk.pos.data(), {1, pk.tokens, C}}, pk.layout(),
                  {pa.data(), {1, pk.tokens, C}}, {po.data(), {1, pk.tokens, C}});
    double d_packed = 0;
    for (std::size_t m = 0; m < images.size(); ++m)
        for (std::size_t j = 0; j < single[m].size(); ++j)
            d_packed = std::fmax(
                d_packed, std::fabs(static_cast<double>(po[static_cast<std::size_t>(pk.offsets[m] * C) + j]) - single[m][j]));

    // ids: the padded grid's at each image's valid pairs equal the image's own, exactly
    const auto* term = layer.term('k');
    const auto padded_ids = term->bucket_ids(pb.height, pb.width);
    bool ids_exact = true;
    for (const auto& im : images) {
        const auto own = term->bucket_ids(im.height, im.width);
        for (int i = 0; i < im.height * im.width; ++i)
            for (int j = 0; j < im.height * im.width; ++j)
                ids_exact =
                    ids_exact && own->at(0, i, j) == padded_ids->at(0, static_cast<int>(pb.token(i / im.width, i % im.width)),
                                                                    static_cast<int>(pb.token(j / im.width, j % im.width)));
    }

    // (query, key) pairs computed: B·L² with the mask, Σ L·len_b with key lengths, Σ L_m² packed
    std::int64_t pairs_lengths = 0, pairs_packed = 0;
    for (std::size_t b = 0; b < images.size(); ++b) {
        pairs_lengths += L * pb.key_lengths[b];
        pairs_packed += static_cast<std::int64_t>(pb.valid_count[b]) * pb.valid_count[b];
    }
    const double tol = 1e-4;
    const bool ok = ids_exact && d_mask <= tol && d_lengths <= tol && d_packed <= tol;
    std::string sizes;
    for (const auto& im : images)
        sizes += (sizes.empty() ? "" : ",") + std::to_string(im.height) + "x" + std::to_string(im.width);
    std::printf(
        "detr: rpe-2.0-product-ctx-1-k C=%d H=%d K=%d images %s padded %dx%d: ids %s, mask %.2g (pairs %lld), "
        "mask+key_lengths %.2g (pairs %lld), packed %.2g (pairs %lld) %s\n",
        C, cfg.nhead, term->num_buckets(), sizes.c_str(), pb.height, pb.width, ids_exact ? "exact" : "DIFFER", d_mask,
        static_cast<long long>(B * L * L), d_lengths, static_cast<long long>(pairs_lengths), d_packed,
        static_cast<long long>(pairs_packed), ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
