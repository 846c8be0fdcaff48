// A custom mapping in the benchmarks without touching the library: the Chebyshev policy of
// examples/01_custom_mapping next to the built-in Product, for bucket ids (cold build, no cache)
// and the fused attention with contextual terms on keys and values (DeiT-S shapes, class token).
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "../examples/01_custom_mapping/chebyshev.hpp"

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_custom_mapping {
namespace {

template <class M>
M make_mapping() {
    return M{rpe::index::piecewise::from_ratio(1.9)};
}

// Bucket ids of an n × n grid with a class token, built without the cache. Arg: n.
template <class M>
void BM_CustomMapping_Ids(benchmark::State& state) {
    const int n = static_cast<int>(state.range(0));
    const M m = make_mapping<M>();
    std::int64_t bytes = 0;
    for (auto _ : state) {
        const auto ids = rpe::build_bucket_ids(m, n, n, 1);
        bytes = ids->bytes();
        benchmark::DoNotOptimize(ids.get());
    }
    const std::int64_t l = 1 + static_cast<std::int64_t>(n) * n;
    state.SetItemsProcessed(state.iterations() * l * l);  // (query, key) pairs
    state.SetBytesProcessed(state.iterations() * bytes);
    state.counters["num_buckets"] = make_mapping<M>().num_buckets() + 1;
}
BENCHMARK_TEMPLATE(BM_CustomMapping_Ids, example::chebyshev)->ArgsProduct({{14, 28, 56}})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_CustomMapping_Ids, rpe::mapping::product<>)->ArgsProduct({{14, 28, 56}})->Unit(benchmark::kMillisecond);

// attention_forward, B=8, H=6, 14×14 + class token, D=64, contextual terms on k and v (shared
// tables, warm cache). Arg: n (grid side).
template <class M>
void BM_CustomMapping_Attention(benchmark::State& state) {
    const int b = 8, h = 6, d = 64, n = static_cast<int>(state.range(0));
    const std::int64_t l = 1 + static_cast<std::int64_t>(n) * n;
    const M m = make_mapping<M>();
    const auto rpe_k =
        rpe::make_any_term(rpe::term<M, rpe::mode::contextual, rpe::target::key>(m, {.num_heads = h, .head_dim = d, .skip = 1}));
    const auto rpe_v = rpe::make_any_term(
        rpe::term<M, rpe::mode::contextual, rpe::target::value>(m, {.num_heads = h, .head_dim = d, .skip = 1}));
    const std::int64_t k = rpe_k->num_buckets();
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randn = [&](std::int64_t count) {
        std::vector<float> v(static_cast<std::size_t>(count));
        for (auto& x : v) x = normal(rng);
        return v;
    };
    const auto q = randn(b * h * l * d), key = randn(b * h * l * d), v = randn(b * h * l * d);
    const auto tk = randn(d * k), tv = randn(k * d);
    std::vector<float> out(q.size());
    rpe::attention_inputs<float> in;
    in.q = {q.data(), {b, h, l, d}};
    in.k = {key.data(), {b, h, l, d}};
    in.v = {v.data(), {b, h, l, d}};
    in.height = n;
    in.width = n;
    in.rpe_k = {.term = rpe_k.get(), .tables = {{tk.data(), {1, d, k}}}, .grad_tables = {}};
    in.rpe_v = {.term = rpe_v.get(), .tables = {{tv.data(), {1, k, d}}}, .grad_tables = {}};
    (void)rpe_k->bucket_ids(n, n);  // warm cache
    for (auto _ : state) {
        rpe::attention_forward(in, {out.data(), {b, h, l, d}});
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * b * h * l * l);
    state.counters["num_buckets"] = static_cast<double>(k);
}
BENCHMARK_TEMPLATE(BM_CustomMapping_Attention, example::chebyshev)->Arg(14)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_CustomMapping_Attention, rpe::mapping::product<>)->Arg(14)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace rpe_bench_custom_mapping
