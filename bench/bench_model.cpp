// A whole model (Google Benchmark): DeiT-S inference forward in float, batch 8, random weights
// (fixed seed; nothing downloaded), on examples/vit/vit_model.hpp: Eigen GEMMs for the patch
// embedding, qkv, projection, MLP and head, rpe::attention_forward for the attention step.
//
// Names (scripts read them): model/deit_s/<variant> is the whole forward (224×224×3 images →
// 1000 logits), model/deit_s/<variant>/attention_only the 12 blocks' attention calls alone
// (vit_model::attention on a random (8, 197, 3·384) qkv buffer, the same calls as in the model).
//   variant: none; k (iRPE-K: contextual Product on keys, ratio 1.9, K = 50, table shared by the
//            heads, skip 1, as DeiT-iRPE); qkv (the same on q, k and v); rope_mixed (rope-vit's
//            RoPE-Mixed on q and k, per-block frequencies, class token unrotated)
// rpe's added time as a share of the model: (model/deit_s/<v> − model/deit_s/none) /
// model/deit_s/none, and, from the attention calls alone, (attention_only/<v> −
// attention_only/none) / model/deit_s/none (docs/benchmarks.md, "Whole model").
// Counters (model/…): images, GMACs (the model's multiply-accumulates per forward of the batch, by
// formula: rpe::examples::vit_macs), rpe_mac_share (iRPE + RoPE MACs / the MACs without them),
// attention_share (the attention stage's share of the forward's time, from the forward's own stage
// clock: about 110 clock reads per forward); attention_only: calls (12 per iteration).
// Threads: OMP_NUM_THREADS (rpe's kernels and Eigen's GEMMs); the batch is one chunk, so one
// thread runs everything when it is 1.
#include <benchmark/benchmark.h>

#include "../examples/vit/vit_model.hpp"  // rpe (and Eigen) first, see there

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using rpe::examples::vit_config;
using rpe::examples::vit_model;

constexpr int batch = 8;

vit_config deit_s(const std::string& variant) {
    if (variant == "k") return rpe::examples::deit_s_config("k");
    if (variant == "qkv") return rpe::examples::deit_s_config("qkv");
    if (variant == "rope_mixed") return rpe::examples::deit_s_config("", rpe::rope::mixed{});
    return rpe::examples::deit_s_config();
}

/// The model of `variant`, built once per process (random DeiT-S weights take about a second to
/// draw; a benchmark's repetitions and both benchmarks of a variant share them), one chunk of 8.
const vit_model<float>& model_of(const std::string& variant) {
    static std::map<std::string, std::unique_ptr<vit_model<float>>> models;
    auto& m = models[variant];
    if (!m) {
        m = std::make_unique<vit_model<float>>(rpe::examples::make_random_vit<float>(deit_s(variant), {.seed = 1}));
        m->set_chunk_size(batch);  // one chunk: OMP_NUM_THREADS threads inside rpe and Eigen
    }
    return *m;
}

std::vector<float> normal_values(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& e : v) e = normal(rng);
    return v;
}

void model_forward(benchmark::State& state, const std::string& variant) {
    const auto& model = model_of(variant);
    const auto& c = model.config();
    const std::vector<float> images = normal_values(static_cast<std::size_t>(batch) * c.in_chans * c.img_size * c.img_size, 2);
    std::vector<float> logits(static_cast<std::size_t>(batch) * c.num_classes);
    const rpe::tensor_ref<const float> in(images.data(), {batch, c.in_chans, c.img_size, c.img_size});
    const rpe::tensor_ref<float> out(logits.data(), {batch, c.num_classes});
    model.forward(in, out);  // warm: workspace, bucket ids
    rpe::examples::vit_stage_times times;
    for (auto _ : state) {
        model.forward(in, out, nullptr, &times);
        benchmark::DoNotOptimize(logits.data());
        benchmark::ClobberMemory();
    }
    const auto macs = rpe::examples::vit_macs(c, c.last_block_class_token_only);
    state.SetItemsProcessed(state.iterations() * batch);  // images
    state.counters["images"] = batch;
    state.counters["GMACs"] = macs.total() * batch * 1e-9;
    state.counters["rpe_mac_share"] = (macs.rpe + macs.rope) / macs.base();
    state.counters["attention_share"] = times.total() > 0 ? times.attention / times.total() : 0.0;
}

void model_attention_only(benchmark::State& state, const std::string& variant) {
    const auto& model = model_of(variant);
    const auto& c = model.config();
    const std::int64_t L = c.tokens, C = c.embed_dim, H = c.num_heads, D = c.head_dim;
    // q, k, v of unit scale (as after the qkv Linear of a trained model, roughly)
    const std::vector<float> qkv = normal_values(static_cast<std::size_t>(batch * L * 3 * C), 3);
    std::vector<float> out(static_cast<std::size_t>(batch * H * L * D));
    const rpe::tensor_ref<const float> qkv_ref(qkv.data(), {batch, L, 3 * C});
    const rpe::tensor_ref<float> out_ref(out.data(), {batch, H, L, D});
    for (int i = 0; i < c.depth; ++i) model.attention(i, qkv_ref, out_ref);  // warm
    for (auto _ : state) {
        for (int i = 0; i < c.depth; ++i) model.attention(i, qkv_ref, out_ref);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * batch);
    state.counters["calls"] = c.depth;
}

const bool registered = [] {
    for (const char* variant : {"none", "k", "qkv", "rope_mixed"}) {
        const std::string name = std::string("model/deit_s/") + variant;
        benchmark::RegisterBenchmark(name.c_str(), model_forward, std::string(variant))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark((name + "/attention_only").c_str(), model_attention_only, std::string(variant))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
    return true;
}();

}  // namespace
