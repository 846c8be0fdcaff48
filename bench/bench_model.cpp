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
// bf16 (model/deit_s/<variant>/bf16 and .../bf16/attention_only, variant none, k, qkv): the same
// model (the same random weights, rounded to bf16) run by examples/vit/vit_model_bf16.hpp: bf16
// weights and activations, float accumulation (vdpbf16ps on AVX512_BF16, else the portable
// kernel; the label names the path), float residual stream, LayerNorm, softmax and GELU in float;
// the weights are rounded and packed once, outside the timing. attention_only runs the 12
// bf16 attention calls on a random bf16 qkv buffer. Set-up check (once per variant, not timed): the
// bf16 model's logits against vit_model<float> on the same bf16-rounded weights and images; the
// benchmark stops with an error when max |Δlogit| > 0.03 · max |logit| (see model_bf16_of for the
// figures measured and the tolerance's justification) and reports the measured ratio as the
// counter bf16_logit_err.
// Threads: OMP_NUM_THREADS (rpe's kernels and Eigen's GEMMs); the batch is one chunk, so one
// thread runs everything when it is 1.
#include <benchmark/benchmark.h>

#include "../examples/vit/vit_model.hpp"  // rpe (and Eigen) first, see there
#include "../examples/vit/vit_model_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_model {
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

std::vector<float> images_of(const vit_config& c) {
    return normal_values(static_cast<std::size_t>(batch) * c.in_chans * c.img_size * c.img_size, 2);
}

/// The bf16 model of `variant` (on model_of(variant)'s weights rounded to bf16, packed once) and
/// its set-up check: logits of the benchmark's images against vit_model<float> on the same
/// bf16-rounded weights and bf16-rounded images (so only the activations' bf16 roundings
/// differ). `error` is max |Δlogit| / max |logit|, `failure` a message when it exceeds the
/// tolerance.
///
/// Tolerance 0.03. Only the activations' bf16 roundings differ (unit roundoff u = 2^-8; the
/// relative error of one rounding has an RMS of about 0.0016): about 7 rounded operands per
/// block (LN1 output, q, k, v, the probabilities on the AVX512_BF16 path, the attention output,
/// LN2 output, GELU output) over 12 blocks and the final LN, each moving its product's output by
/// about that relative amount, add up as a random walk to at most about 0.0016·√85 ≈ 0.015 of the
/// logits' RMS (LayerNorm and the residual stream damp them: measured 0.0045), and max |logit|
/// is about 3.6× the RMS. Measured (seed 1, batch 8) max |Δlogit| / max |logit|: 0.0052 (none),
/// 0.0049 (k), 0.0047 (qkv) with one thread, 0.0052, 0.0056, 0.0051 with two, on AVX512_BF16;
/// 0.0054, 0.0048, 0.0052 on the portable path (bf16_portable_only, one thread); for scale,
/// rounding the weights to bf16 moves the float model's logits by 0.005–0.006 of max |logit|.
/// 0.03 leaves 5× margin for other machines and paths.
struct bf16_model {
    std::unique_ptr<rpe::examples::vit_model_bf16> model;
    double error = 0;
    std::string failure;
};

const bf16_model& model_bf16_of(const std::string& variant) {
    static std::map<std::string, bf16_model> models;
    auto& m = models[variant];
    if (!m.model) {
        m.model = std::make_unique<rpe::examples::vit_model_bf16>(model_of(variant));
        m.model->set_chunk_size(batch);
        const auto& c = m.model->config();
        auto images = images_of(c);
        std::vector<float> got(static_cast<std::size_t>(batch) * c.num_classes), want(got.size());
        const rpe::tensor_ref<const float> in(images.data(), {batch, c.in_chans, c.img_size, c.img_size});
        m.model->forward(in, rpe::tensor_ref<float>(got.data(), {batch, c.num_classes}));
        for (auto& x : images) x = rpe::round_to_bf16(x);
        m.model->rounded_float_model().forward(in, rpe::tensor_ref<float>(want.data(), {batch, c.num_classes}));
        double diff = 0, scale = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
            diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
            scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
        }
        m.error = scale > 0 ? diff / scale : diff;
        if (!(m.error <= 0.03))
            m.failure = "bf16 logits differ from the float model's on the same bf16 weights by " + std::to_string(m.error) +
                        " of max |logit| (tolerance 0.03)";
    }
    return m;
}

void model_forward(benchmark::State& state, const std::string& variant) {
    const auto& model = model_of(variant);
    const auto& c = model.config();
    const std::vector<float> images = images_of(c);
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

void model_forward_bf16(benchmark::State& state, const std::string& variant) {
    const auto& m = model_bf16_of(variant);
    if (!m.failure.empty()) {
        state.SkipWithError(m.failure.c_str());
        return;
    }
    const auto& model = *m.model;
    const auto& c = model.config();
    const std::vector<float> images = images_of(c);
    std::vector<float> logits(static_cast<std::size_t>(batch) * c.num_classes);
    const rpe::tensor_ref<const float> in(images.data(), {batch, c.in_chans, c.img_size, c.img_size});
    const rpe::tensor_ref<float> out(logits.data(), {batch, c.num_classes});
    model.forward(in, out);  // warm: workspace, bucket ids
    rpe::examples::vit_stage_times times;
    for (auto _ : state) {
        model.forward(in, out, &times);
        benchmark::DoNotOptimize(logits.data());
        benchmark::ClobberMemory();
    }
    const auto macs = rpe::examples::vit_macs(c, c.last_block_class_token_only);
    state.SetItemsProcessed(state.iterations() * batch);
    state.SetLabel(model.isa());
    state.counters["images"] = batch;
    state.counters["GMACs"] = macs.total() * batch * 1e-9;
    state.counters["rpe_mac_share"] = (macs.rpe + macs.rope) / macs.base();
    state.counters["attention_share"] = times.total() > 0 ? times.attention / times.total() : 0.0;
    state.counters["bf16_logit_err"] = m.error;
}

void model_attention_only_bf16(benchmark::State& state, const std::string& variant) {
    const auto& m = model_bf16_of(variant);
    if (!m.failure.empty()) {
        state.SkipWithError(m.failure.c_str());
        return;
    }
    const auto& model = *m.model;
    const auto& c = model.config();
    const std::int64_t L = c.tokens, C = c.embed_dim, H = c.num_heads, D = c.head_dim;
    // the float benchmark's q, k, v rounded to bf16
    const std::vector<float> qkv_f = normal_values(static_cast<std::size_t>(batch * L * 3 * C), 3);
    std::vector<rpe::bf16> qkv(qkv_f.size()), out(static_cast<std::size_t>(batch * H * L * D));
    rpe::detail::cpu::float_to_bf16(qkv_f.data(), qkv.data(), static_cast<std::int64_t>(qkv.size()));
    const rpe::tensor_ref<const rpe::bf16> qkv_ref(qkv.data(), {batch, L, 3 * C});
    const rpe::tensor_ref<rpe::bf16> out_ref(out.data(), {batch, H, L, D});
    for (int i = 0; i < c.depth; ++i) model.attention(i, qkv_ref, out_ref);  // warm
    for (auto _ : state) {
        for (int i = 0; i < c.depth; ++i) model.attention(i, qkv_ref, out_ref);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * batch);
    state.SetLabel(rpe::detail::cpu::bf16_attention_isa());
    state.counters["calls"] = c.depth;
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
    for (const char* variant : {"none", "k", "qkv"}) {
        const std::string name = std::string("model/deit_s/") + variant + "/bf16";
        benchmark::RegisterBenchmark(name.c_str(), model_forward_bf16, std::string(variant))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark((name + "/attention_only").c_str(), model_attention_only_bf16, std::string(variant))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_model
