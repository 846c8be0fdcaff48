// The cases that tools/compare_reference.py runs side by side with the reference implementation
// (microsoft/Cream iRPE, PyTorch): DeiT-S shapes B=8, H=6, L=197 (14x14 + class token), D=64,
// Product ratio 1.9 (α=1.9, β=3.8, γ=15.2; K = 7·7 + 1 = 50), float32.
//
// Names (the script filters on '^ref/'; keep them):
//   ref/ctx_product_k_fwd      contextual key term forward, table shared by the heads (1, D, K);
//                              x = q·s (B, H, L, D) → (B, H, L, L); ids warm (the reference's module
//                              caches its ids too)
//   ref/ctx_product_k_fwd_bwd  the same forward, then backward: grad_x and grad_table
//   ref/ctx_product_v_fwd      contextual value term forward, shared table (1, K, D);
//                              a (B, H, L, L) → (B, H, L, D)
//   ref/bias_product_k_fwd     bias key term forward, one table per head (H, K) → (1, H, L, L),
//                              as the reference returns it (broadcast over the batch)
//   ref/bucket_ids_56x56       rpe::build_bucket_ids, cold (no cache), 56x56 + class token
//   ref/bucket_ids_128x128     the same, 128x128 + class token (L = 16385)
// Counters: id_bytes (ours) and int64_bytes (the reference's (L, L) int64 table) for the builds.
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <vector>

#include "bench_common.hpp"

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_reference {
namespace {

using product = rpe::mapping::product<>;
constexpr int b = 8, h = 6, d = 64, side = 14, skip = 1;
constexpr std::int64_t l = skip + side * side;  // 197

product ratio_1_9() { return product{rpe::index::piecewise::from_ratio(1.9)}; }

template <rpe::target T>
using ctx_term = rpe::term<product, rpe::mode::contextual, T, float>;
using bias_term = rpe::term<product, rpe::mode::bias, rpe::target::key, float>;

void ctx_k(benchmark::State& state, bool with_backward) {
    const ctx_term<rpe::target::key> term(ratio_1_9(), {.num_heads = h, .head_dim = d, .skip = skip});
    const auto ids = term.bucket_ids(side, side);
    const std::int64_t k = term.num_buckets();
    const auto x = rpe_bench::random_vector<float>(b * h * l * d);
    const auto table = rpe_bench::random_vector<float>(d * k, 0.1, 11u);
    const auto grad_out = rpe_bench::random_vector<float>(b * h * l * l, 1.0, 13u);
    std::vector<float> out(static_cast<std::size_t>(b * h * l * l)), grad_x(x.size()), grad_table(table.size());
    const rpe::tensor_ref<const float> x_ref(x.data(), {b, h, l, d}), table_ref(table.data(), {1, d, k});
    for (auto _ : state) {
        term.forward(*ids, table_ref, x_ref, {out.data(), {b, h, l, l}}, rpe::write::overwrite);
        if (with_backward)
            term.backward(*ids, table_ref, x_ref, {grad_out.data(), {b, h, l, l}}, {grad_x.data(), {b, h, l, d}},
                          {grad_table.data(), {1, d, k}}, rpe::write::overwrite);
        benchmark::DoNotOptimize(out.data());
        benchmark::DoNotOptimize(grad_table.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * b * h * l * l);  // (query, key) pairs
}

void ctx_v(benchmark::State& state) {
    const ctx_term<rpe::target::value> term(ratio_1_9(), {.num_heads = h, .head_dim = d, .skip = skip});
    const auto ids = term.bucket_ids(side, side);
    const std::int64_t k = term.num_buckets();
    const auto a = rpe_bench::random_vector<float>(b * h * l * l);
    const auto table = rpe_bench::random_vector<float>(k * d, 0.1, 11u);
    std::vector<float> out(static_cast<std::size_t>(b * h * l * d));
    for (auto _ : state) {
        term.forward(*ids, {table.data(), {1, k, d}}, {a.data(), {b, h, l, l}}, {out.data(), {b, h, l, d}},
                     rpe::write::overwrite);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * b * h * l * l);
}

void bias_k(benchmark::State& state) {
    const bias_term term(ratio_1_9(), {.num_heads = h, .head_dim = d, .shared_head = false, .skip = skip});
    const auto ids = term.bucket_ids(side, side);
    const std::int64_t k = term.num_buckets();
    const auto table = rpe_bench::random_vector<float>(h * k, 0.1, 11u);
    std::vector<float> out(static_cast<std::size_t>(h * l * l));
    for (auto _ : state) {
        term.forward(*ids, {table.data(), {h, k}}, {}, {out.data(), {1, h, l, l}}, rpe::write::overwrite);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * h * l * l);
}

void build_ids(benchmark::State& state, int grid_side) {
    const product m = ratio_1_9();
    std::int64_t bytes = 0;
    for (auto _ : state) {
        // cold (no cache), as the reference: the whole (L, L) table
        const auto ids = rpe::build_bucket_ids(m, grid_side, grid_side, skip, rpe::id_storage::table);
        bytes = ids->bytes();
        benchmark::DoNotOptimize(ids.get());
    }
    const std::int64_t n = skip + static_cast<std::int64_t>(grid_side) * grid_side;
    state.SetItemsProcessed(state.iterations() * n * n);
    state.counters["id_bytes"] = static_cast<double>(bytes);
    state.counters["int64_bytes"] = static_cast<double>(n * n * 8);
    state.counters["L"] = static_cast<double>(n);
}

const bool registered = [] {
#if defined(RPE_BUILD_MARCH)
    benchmark::AddCustomContext("rpe_march", RPE_BUILD_MARCH);  // see cmake/rpeWarnings.cmake (RPE_NATIVE)
#endif
    benchmark::AddCustomContext("rpe_isa", rpe::detail::cpu::simd_isa());  // the CPU kernels' vector paths
    benchmark::RegisterBenchmark("ref/ctx_product_k_fwd", ctx_k, false)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ref/ctx_product_k_fwd_bwd", ctx_k, true)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ref/ctx_product_v_fwd", ctx_v)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ref/bias_product_k_fwd", bias_k)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ref/bucket_ids_56x56", build_ids, 56)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("ref/bucket_ids_128x128", build_ids, 128)->Unit(benchmark::kMillisecond);
    return true;
}();

}  // namespace
}  // namespace rpe_bench_reference
