// The vision-transformer encodings of issue 15 in the fused attention (Google Benchmark), beside
// the iRPE variant they replace: SAM's decomposed relative position (contextual Cross, clip index,
// SAM's tables loaded) and CROMA's 2D ALiBi (bias Product, clip index, fixed table), against no
// RPE and iRPE's contextual Product on k (ratio 1.9, shared table).
//
// Names (scripts read them): vit/attention/<shape>/<variant> is the float32 forward,
// vit/attention_fwd_bwd/<shape>/<variant> forward + backward (q, k, v gradients; the SAM tables'
// gradients too; none for ALiBi's fixed table).
//   shape:   sam_14x14 (SAM ViT-B window: B 4, 12 heads, D 64, 14x14, no class token),
//            croma_15x15 (CROMA base on 120 px: B 4, 12 heads, D 64, 15x15)
//   variant: none, irpe_product_k, sam_decomposed, alibi2d
// Counter L; items = (query, key) pairs.
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <memory>
#include <random>
#include <string>
#include <vector>

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_vit {
namespace {

struct vit_case {
    int b, h, height, width, d;
    std::string variant;
    std::int64_t l() const { return static_cast<std::int64_t>(height) * width; }

    std::vector<float> q, k, v, grad_out, out, gq, gk, gv;
    std::vector<std::vector<float>> tables, grads;
    std::unique_ptr<rpe::any_term<float>> term;
    rpe::attention_inputs<float> in;

    vit_case(int b_, int h_, int height_, int width_, int d_, std::string variant_)
        : b(b_), h(h_), height(height_), width(width_), d(d_), variant(std::move(variant_)) {
        std::mt19937 rng(7);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const std::int64_t n = static_cast<std::int64_t>(b) * h * l() * d;
        for (auto* x : {&q, &k, &v, &grad_out}) {
            x->resize(static_cast<std::size_t>(n));
            for (auto& e : *x) e = normal(rng);
        }
        out.resize(q.size());
        gq.resize(q.size());
        gk.resize(q.size());
        gv.resize(q.size());
        in.q = {q.data(), {b, h, l(), d}};
        in.k = {k.data(), {b, h, l(), d}};
        in.v = {v.data(), {b, h, l(), d}};
        in.height = height;
        in.width = width;
        std::vector<std::int64_t> shape;
        if (variant == "irpe_product_k") {
            term = rpe::make_any_term(rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key, float>(
                rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, {.num_heads = h, .head_dim = d}));
            shape = term->table_shape();
            tables.emplace_back(static_cast<std::size_t>(shape[0] * shape[1] * shape[2]));
            for (auto& e : tables[0]) e = 0.1f * normal(rng);
        } else if (variant == "sam_decomposed") {
            const rpe::vit::decomposed_rel_pos_config c{.height = height, .width = width, .num_heads = h, .head_dim = d};
            const auto t = rpe::vit::make_decomposed_rel_pos_term<float>(c);
            shape = t.table_shape();
            std::vector<float> rh(static_cast<std::size_t>((2 * height - 1) * d)),
                rw(static_cast<std::size_t>((2 * width - 1) * d));
            for (auto* x : {&rh, &rw})
                for (auto& e : *x) e = 0.1f * normal(rng);
            tables.assign(2, std::vector<float>(static_cast<std::size_t>(shape[1] * shape[2])));
            rpe::vit::load_decomposed_rel_pos<float>(c, {rh.data(), {2 * height - 1, d}}, {rw.data(), {2 * width - 1, d}},
                                                     {rpe::tensor_ref<float>(tables[0].data(), {1, shape[1], shape[2]}),
                                                      rpe::tensor_ref<float>(tables[1].data(), {1, shape[1], shape[2]})});
            term = rpe::make_any_term(t);
        } else if (variant == "alibi2d") {
            const rpe::vit::alibi_2d_config c{.height = height, .width = width, .num_heads = h, .head_dim = d};
            term = rpe::make_any_term(rpe::vit::make_alibi_2d_term<float>(c));
            shape = term->table_shape();
            tables.push_back(rpe::vit::alibi_2d_table<float>(c));
        }
        if (!term) return;
        in.rpe_k.term = term.get();
        const std::vector<std::int64_t> s = shape;
        for (auto& t : tables)
            in.rpe_k.tables.push_back(rpe::tensor_ref<const float>(t.data(), std::span<const std::int64_t>(s)));
        if (variant != "alibi2d")  // ALiBi's table is fixed: no gradient
            for (auto& t : tables) {
                grads.emplace_back(t.size());
                in.rpe_k.grad_tables.push_back(rpe::tensor_ref<float>(grads.back().data(), std::span<const std::int64_t>(s)));
            }
        (void)term->bucket_ids(height, width);  // warm cache
    }
    rpe::tensor_ref<float> view(std::vector<float>& x) { return {x.data(), {b, h, l(), d}}; }
};

void run(benchmark::State& state, int b, int h, int height, int width, int d, const std::string& variant, bool backward) {
    vit_case c(b, h, height, width, d, variant);
    for (auto _ : state) {
        rpe::attention_forward(c.in, c.view(c.out));
        if (backward)
            rpe::attention_backward(c.in, rpe::tensor_ref<const float>(c.grad_out.data(), {b, h, c.l(), d}), c.view(c.gq),
                                    c.view(c.gk), c.view(c.gv));
        benchmark::DoNotOptimize(c.out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * b * h * c.l() * c.l());
    state.counters["L"] = static_cast<double>(c.l());
}

const bool registered = [] {
    struct shape {
        const char* name;
        int b, h, height, width, d;
    };
    for (const shape s : {shape{"sam_14x14", 4, 12, 14, 14, 64}, shape{"croma_15x15", 4, 12, 15, 15, 64}})
        for (const char* variant : {"none", "irpe_product_k", "sam_decomposed", "alibi2d"})
            for (const bool backward : {false, true}) {
                const std::string name =
                    std::string(backward ? "vit/attention_fwd_bwd/" : "vit/attention/") + s.name + "/" + variant;
                benchmark::RegisterBenchmark(name.c_str(), run, s.b, s.h, s.height, s.width, s.d, std::string(variant), backward)
                    ->Unit(benchmark::kMillisecond)
                    ->UseRealTime();
            }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_vit
