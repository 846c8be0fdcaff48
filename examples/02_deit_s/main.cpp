// DeiT-S with iRPE-K (contextual Product on keys, ratio 1.9, tables shared by the heads, as
// DeiT-iRPE) on random weights: the whole forward of two 224×224 images in C++ with Eigen and
// rpe's fused attention (examples/vit/vit_model.hpp; bench/bench_model.cpp times it). Loading
// trained weights instead: fill rpe::examples::vit_weights with pointers to them (the DeiT state
// dict's tensors, as examples/vit_digits does from a .safetensors file).
//
// Prints one line:
//   deit_s: iRPE-K L=197 K=50 logits=(2, 1000) finite=yes max|k - none|=0.0123 GMACs=9.29 rpe_mac_share=0.99% ok
//
// With --bf16, the same model in bf16 (examples/vit/vit_model_bf16.hpp: bf16 weights and
// activations, float accumulation; the model/deit_s/*/bf16 benchmarks) against the float model on
// the same bf16-rounded weights and images, one line:
//   deit_s: bf16 (AVX512_BF16) iRPE-K logits=(2, 1000) finite=yes max|bf16 - float|/max|logit|=0.0045 ok
// ("ok" when that ratio is at most 0.03, the benchmarks' tolerance: bench/bench_model.cpp).
#include "../vit/vit_model.hpp"  // rpe (and Eigen) first, see there
#include "../vit/vit_model_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// The bf16 run (--bf16): DeiT-S iRPE-K in bf16 against the float model on the bf16-rounded weights.
int run_bf16(const rpe::examples::vit_model<float>& model, std::vector<float> images, int n) {
    const rpe::examples::vit_model_bf16 bf(model);  // rounds and packs the weights once
    const auto& c = bf.config();
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes), ref(logits.size());
    const rpe::tensor_ref<const float> in(images.data(), {n, 3, 224, 224});
    bf.forward(in, rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}));
    for (auto& x : images) x = rpe::round_to_bf16(x);  // what the bf16 model's patches hold
    bf.rounded_float_model().forward(in, rpe::tensor_ref<float>(ref.data(), {n, c.num_classes}));
    bool finite = true;
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < logits.size(); ++i) {
        finite = finite && std::isfinite(logits[i]);
        diff = std::max(diff, std::fabs(static_cast<double>(logits[i]) - ref[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
    }
    const double err = scale > 0 ? diff / scale : diff;
    const bool ok = finite && err <= 0.03;
    std::printf("deit_s: bf16 (%s) iRPE-K logits=(%d, %d) finite=%s max|bf16 - float|/max|logit|=%.2g %s\n", bf.isa(), n,
                c.num_classes, finite ? "yes" : "no", err, ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    const char* usage =
        "usage: deit_s [--bf16]: DeiT-S with iRPE-K on random weights against the model without "
        "RPE (float), or with --bf16 the bf16 model against the float one\n";
    const std::string arg = argc > 1 ? argv[1] : "";
    if (arg == "--help" || arg == "-h") {
        std::fputs(usage, stdout);
        return 0;
    }
    const bool bf16 = arg == "--bf16";
    if (argc > 2 || (argc == 2 && !bf16)) {
        std::fprintf(stderr, "deit_s: unexpected argument '%s'; %s", argv[argc > 2 && bf16 ? 2 : 1], usage);
        return 2;
    }
    namespace ex = rpe::examples;
    // Same seed: the two models share every weight but the iRPE tables (make_random_vit).
    const auto model = ex::make_random_vit<float>(ex::deit_s_config("k"), {.seed = 1});
    const auto plain = ex::make_random_vit<float>(ex::deit_s_config(), {.seed = 1});
    const auto& c = model.config();
    const int n = 2;
    std::vector<float> images(static_cast<std::size_t>(n) * 3 * 224 * 224);
    for (std::size_t i = 0; i < images.size(); ++i) images[i] = std::sin(0.001f * static_cast<float>(i));
    if (bf16) return run_bf16(model, images, n);
    std::vector<float> logits(static_cast<std::size_t>(n) * c.num_classes), logits_none(logits.size());
    const rpe::tensor_ref<const float> in(images.data(), {n, 3, 224, 224});
    model.forward(in, rpe::tensor_ref<float>(logits.data(), {n, c.num_classes}));
    plain.forward(in, rpe::tensor_ref<float>(logits_none.data(), {n, c.num_classes}));

    bool finite = true;
    double diff = 0;
    for (std::size_t i = 0; i < logits.size(); ++i) {
        finite = finite && std::isfinite(logits[i]);
        diff = std::fmax(diff, std::fabs(static_cast<double>(logits[i]) - logits_none[i]));
    }
    const auto macs = ex::vit_macs(c, c.last_block_class_token_only);
    const bool ok = finite && diff > 0;
    std::printf("deit_s: iRPE-K L=%d K=%d logits=(%d, %d) finite=%s max|k - none|=%.3g GMACs=%.2f rpe_mac_share=%.2f%% %s\n",
                c.tokens, c.rpe_num_buckets, n, c.num_classes, finite ? "yes" : "no", diff, macs.total() * n * 1e-9,
                100 * macs.rpe / macs.base(), ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
