// Bucket-id build (Google Benchmark): time and bytes per grid up to 128x128 (L = 16384), cold
// (rpe::build_bucket_ids, no cache), next to the bytes of the reference's int64 (L, L) table(s).
//
// Names (scripts read them):
//   bucket_ids/build/<mapping>/<grid>      (L, L) tables (id_storage::table); mapping product (ratio
//                                          1.9), euclidean (ratio 20) or cross (ratio 20, two id
//                                          matrices, as the reference's two)
//   bucket_ids/on_the_fly/<mapping>/<grid> id_storage::on_the_fly: only the per-offset ids, no (L, L)
//   bucket_ids/cache_hit/product/<grid>    rpe::bucket_cache::get of a configuration already held
// grids: 14x14+1 (class token), 25x38, 28x28, 56x56, 64x64, 96x96, 128x128.
// Counters: id_bytes (ours, all tables), int64_bytes (the reference: 8 bytes per pair per table),
// bytes_per_pair (ours), L.
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <string>
#include <vector>

#include "bench_common.hpp"

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_bucket_ids {
namespace {

using rpe_bench::grid;

void set_counters(benchmark::State& state, const rpe::bucket_ids& ids, bool built) {
    const double n = ids.length();
    const double tables = ids.num_tables();
    if (built) state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n * n * tables));  // ids written
    state.counters["id_bytes"] = static_cast<double>(ids.bytes());
    state.counters["int64_bytes"] = n * n * 8.0 * tables;
    state.counters["bytes_per_pair"] = static_cast<double>(ids.bytes()) / (n * n * tables);
    state.counters["L"] = n;
}

template <class M>
void build(benchmark::State& state, M m, grid g, rpe::id_storage storage) {
    std::shared_ptr<const rpe::bucket_ids> ids;
    for (auto _ : state) {
        ids.reset();  // the previous matrix is freed outside the next build, as a fresh process would
        ids = rpe::build_bucket_ids(m, g.height, g.width, g.skip, storage);
        benchmark::DoNotOptimize(ids.get());
    }
    set_counters(state, *ids, true);
}

void cache_hit(benchmark::State& state, grid g) {
    const rpe::mapping::product<> m{rpe::index::piecewise::from_ratio(1.9)};
    rpe::bucket_cache cache;
    const auto held = cache.get(m, g.height, g.width, g.skip);
    for (auto _ : state) benchmark::DoNotOptimize(cache.get(m, g.height, g.width, g.skip).get());
    set_counters(state, *held, false);
}

const bool registered = [] {
    const std::vector<grid> grids{{14, 14, 1}, {25, 38, 0}, {28, 28, 0}, {56, 56, 0}, {64, 64, 0}, {96, 96, 0}, {128, 128, 0}};
    const rpe::mapping::product<> product{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::mapping::euclidean<> euclidean{rpe::index::piecewise::from_ratio(20.0)};
    const rpe::mapping::cross<> cross{rpe::index::piecewise::from_ratio(20.0)};
    for (const grid& g : grids) {
        std::string tail = "/";  // appended: "/" + string trips g++ 12's false -Wrestrict
        tail += g.name();
        for (const auto storage : {rpe::id_storage::table, rpe::id_storage::on_the_fly}) {
            const std::string kind = storage == rpe::id_storage::table ? "bucket_ids/build/" : "bucket_ids/on_the_fly/";
            benchmark::RegisterBenchmark((kind + "product" + tail).c_str(), build<rpe::mapping::product<>>, product, g, storage)
                ->Unit(benchmark::kMillisecond);
            benchmark::RegisterBenchmark((kind + "euclidean" + tail).c_str(), build<rpe::mapping::euclidean<>>, euclidean, g,
                                         storage)
                ->Unit(benchmark::kMillisecond);
            benchmark::RegisterBenchmark((kind + "cross" + tail).c_str(), build<rpe::mapping::cross<>>, cross, g, storage)
                ->Unit(benchmark::kMillisecond);
        }
        benchmark::RegisterBenchmark(("bucket_ids/cache_hit/product" + tail).c_str(), cache_hit, g)
            ->Unit(benchmark::kMicrosecond);
    }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_bucket_ids
