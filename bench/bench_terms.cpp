// Every term variant (Google Benchmark), forward: mapping × mode × target × shared/per-head table
// on the grids 14x14 + class token (DeiT), 28x28, 56x56 and 25x38 (DETR encoder), batch 1 and 8,
// float and double; H = 6 heads, D = 64. Terms come from rpe::make_term (the run-time variant list),
// with the reference's ratios: Product 1.9, Euclidean 20, Quantization 33, Cross 20 (the paper
// variants as their code variants). Bucket ids are warm (built once per grid by the cache).
//
// Names (scripts read them):
//   term/<mapping>/<mode>_<target>/<shared|perhead>/<grid>/b<B>/<f32|f64>
//       mode bias|ctx, target q|k|v; grid 14x14+1, 28x28, 56x56, 25x38
//   naive/ctx_k/<grid>/b<B>/<f32|f64>
//       the naive O(L²·D) contextual key term (Product 1.9, shared table): one dot product per
//       pair; compare with term/product/ctx_k/shared/<grid>/b<B>/<f32|f64> (O(L·K·D) + O(L²)).
//   term/<family>/... also for every mapping family a user's unit adds to rpe's registry
//       (RPE_REGISTER_MAPPING, docs/custom_mapping.md) when linked into rpe_bench or loaded by
//       RPE_BENCH_PLUGINS=lib1.so:lib2.so, with its default parameters.
// Counters: id_bytes (bucket-id storage of the grid, all tables), L, K, flops (rate of the
// per-bucket matrix products, 2·B·H·L·K·D per table; 2·B·H·L²·D for naive), bytes_per_second
// (x read + out written + ids read per (batch, head)). Cases above RPE_BENCH_MAX_GB (default 3)
// of buffers are reported as skipped.
#include <benchmark/benchmark.h>
#include <rpe/any_term.hpp>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_terms {
namespace {

using rpe_bench::grid;

constexpr int heads = 6;
constexpr int head_dim = 64;

struct mapping_row {
    std::string name;         // the registry's family name
    rpe::family_spec family;  // the family and its parameters
};

struct mode_row {
    const char* name;
    bool contextual;
    rpe::target target;
};

struct term_config {
    mapping_row mapping;
    mode_row mode;
    bool shared;
    grid g;
    int batch;
};

template <class S>
void run_term(benchmark::State& state, const term_config& c) {
    std::unique_ptr<rpe::any_term<S>> term;
    try {
        term = rpe::make_term<S>(c.mapping.family,
                                 {.contextual = c.mode.contextual,
                                  .target = c.mode.target,
                                  .num_heads = heads,
                                  .head_dim = head_dim,
                                  .shared_head = c.shared,
                                  .skip = c.g.skip},
                                 {c.g.height, c.g.width});
    } catch (const rpe::invalid_argument& e) {  // a mode or target the family does not take
        state.SkipWithError(e.what());
        return;
    }

    const std::int64_t n = c.g.length(), b = c.batch, k = term->num_buckets(), planes = b * heads;
    const bool value = c.mode.target == rpe::target::value;
    const std::int64_t x_size = !c.mode.contextual ? 0 : planes * n * (value ? n : head_dim);
    const std::int64_t out_size = planes * n * (value ? head_dim : n);
    const auto shape = term->table_shape();
    const std::int64_t table_size = shape[0] * shape[1] * (shape.size() > 2 ? shape[2] : 1);
    const int tables = term->num_tables();
    if (rpe_bench::too_big(state, static_cast<std::int64_t>(sizeof(S)) * (x_size + out_size + tables * table_size))) return;

    const auto ids = term->bucket_ids(c.g.height, c.g.width);  // warm: built once per grid
    std::vector<S> x = rpe_bench::random_vector<S>(x_size), out(static_cast<std::size_t>(out_size));
    std::vector<std::vector<S>> table_data;
    std::vector<rpe::tensor_ref<const S>> table_refs;
    for (int t = 0; t < tables; ++t) {
        table_data.push_back(rpe_bench::random_vector<S>(table_size, 0.1, 11u + static_cast<unsigned>(t)));
        rpe::tensor_ref<const S> r;  // (Ht, K) or (Ht, D, K) or (Ht, K, D)
        r.data = table_data.back().data();
        r.rank = static_cast<int>(shape.size());
        for (std::size_t i = 0; i < shape.size(); ++i) r.shape[i] = shape[i];
        table_refs.push_back(r);
    }
    const rpe::tensor_ref<const S> x_ref =
        c.mode.contextual ? rpe::tensor_ref<const S>(x.data(), {b, heads, n, value ? n : head_dim}) : rpe::tensor_ref<const S>{};
    const rpe::tensor_ref<S> out_ref(out.data(), {b, heads, n, value ? head_dim : n});

    for (auto _ : state) {
        term->forward(*ids, table_refs, x_ref, out_ref, rpe::write::overwrite);
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    const double it = static_cast<double>(state.iterations());
    state.SetBytesProcessed(static_cast<std::int64_t>(it) *
                            (static_cast<std::int64_t>(sizeof(S)) * (x_size + out_size) + planes * ids->bytes()));
    state.counters["id_bytes"] = static_cast<double>(ids->bytes());
    state.counters["L"] = static_cast<double>(n);
    state.counters["K"] = static_cast<double>(k);
    if (c.mode.contextual)
        state.counters["flops"] =
            benchmark::Counter(2.0 * static_cast<double>(planes * n * k * head_dim * tables) * it, benchmark::Counter::kIsRate);
}

template <class S>
void run_naive(benchmark::State& state, const grid& g, int batch) {
    using product = rpe::mapping::product<>;
    const product m{rpe::index::piecewise::from_ratio(1.9)};
    const std::int64_t n = g.length(), planes = static_cast<std::int64_t>(batch) * heads;
    const std::int64_t x_size = planes * n * head_dim, out_size = planes * n * n;
    if (rpe_bench::too_big(state, static_cast<std::int64_t>(sizeof(S)) * (x_size + out_size))) return;
    const auto ids = rpe::bucket_cache::global().get(m, g.height, g.width, g.skip);
    const std::int64_t k = ids->num_buckets();
    const std::vector<S> x = rpe_bench::random_vector<S>(x_size);
    const std::vector<S> table_kd = rpe_bench::random_vector<S>(k * head_dim, 0.1, 11u);  // (K, D)
    std::vector<S> out(static_cast<std::size_t>(out_size));
    for (auto _ : state) {
        ids->visit(0, [&](const auto* id) {
            rpe_bench::naive_contextual_key(x.data(), table_kd.data(), id, planes, n, head_dim, out.data());
        });
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    const double it = static_cast<double>(state.iterations());
    state.SetBytesProcessed(static_cast<std::int64_t>(it) *
                            (static_cast<std::int64_t>(sizeof(S)) * (x_size + out_size) + planes * ids->bytes()));
    state.counters["id_bytes"] = static_cast<double>(ids->bytes());
    state.counters["L"] = static_cast<double>(n);
    state.counters["K"] = static_cast<double>(k);
    state.counters["flops"] =
        benchmark::Counter(2.0 * static_cast<double>(planes * n * n * head_dim) * it, benchmark::Counter::kIsRate);
}

const bool registered = [] {
    // the reference's ratios per method (rpe::method order: the registry's first six families)
    const std::pair<rpe::method, double> irpe[] = {
        {rpe::method::product, 1.9}, {rpe::method::euclidean, 20.0},       {rpe::method::quantization, 33.0},
        {rpe::method::cross, 20.0},  {rpe::method::euclidean_paper, 20.0}, {rpe::method::quantization_paper, 33.0},
    };
    std::vector<mapping_row> mappings;
    for (const auto& [method, ratio] : irpe) {
        rpe::term_spec t;
        t.method = method;
        t.ratio(ratio);
        mappings.push_back({rpe::method_name(method), rpe::to_family_spec(t)});
    }
    // a user's families: linked in, or loaded from RPE_BENCH_PLUGINS (colon-separated paths)
    if (const char* env = std::getenv("RPE_BENCH_PLUGINS")) {
        std::string paths = env;
        for (std::size_t at = 0; at <= paths.size();) {
            const auto end = std::min(paths.find(':', at), paths.size());
            const std::string path = paths.substr(at, end - at);
            if (path.empty()) {  // "a::b" or a trailing ':'
                at = end + 1;
                continue;
            }
            // a plugin that cannot be loaded ends the suite: its families' benchmarks would be
            // silently missing from the results
            if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
                const char* why = dlerror();
                std::fprintf(stderr,
                             "rpe_bench: RPE_BENCH_PLUGINS: '%s' cannot be loaded: %s; expected a shared library that "
                             "registers mappings (RPE_REGISTER_MAPPING)\n",
                             path.c_str(), why ? why : "unknown error");
                std::exit(EXIT_FAILURE);
            }
            // its RPE_REGISTER_MAPPING refusals (a name already taken), recorded during its static
            // initialisation: the suite ends here (static initialisation: nothing has run yet)
            const auto refused = rpe::registry::global().take_load_errors();
            if (!refused.empty()) {
                std::fprintf(stderr, "rpe_bench: RPE_BENCH_PLUGINS: '%s' cannot be loaded:", path.c_str());
                for (const auto& why : refused) std::fprintf(stderr, " %s;", why.c_str());
                std::fprintf(stderr, " expected mapping names and aliases not registered yet\n");
                std::exit(EXIT_FAILURE);
            }
            at = end + 1;
        }
    }
    for (const auto& e : rpe::families().entries())
        if (e->info.group == "user") mappings.push_back({e->info.name, rpe::families().defaults(e->info.name)});
    const mode_row modes[] = {
        {"bias_k", false, rpe::target::key}, {"bias_q", false, rpe::target::query}, {"ctx_k", true, rpe::target::key},
        {"ctx_q", true, rpe::target::query}, {"ctx_v", true, rpe::target::value},
    };
    for (const auto& m : mappings)
        for (const auto& md : modes)
            for (const bool shared : {true, false})
                for (const grid& g : rpe_bench::term_grids())
                    for (const int batch : {1, 8}) {
                        const term_config c{m, md, shared, g, batch};
                        const std::string name = "term/" + m.name + "/" + md.name + "/" + (shared ? "shared" : "perhead") + "/" +
                                                 g.name() + "/b" + std::to_string(batch);
                        benchmark::RegisterBenchmark((name + "/f32").c_str(), run_term<float>, c)->Unit(benchmark::kMicrosecond);
                        benchmark::RegisterBenchmark((name + "/f64").c_str(), run_term<double>, c)->Unit(benchmark::kMicrosecond);
                    }
    for (const grid& g : rpe_bench::term_grids())
        for (const int batch : {1, 8}) {
            const std::string name = "naive/ctx_k/" + g.name() + "/b" + std::to_string(batch);
            benchmark::RegisterBenchmark((name + "/f32").c_str(), run_naive<float>, g, batch)->Unit(benchmark::kMicrosecond);
            benchmark::RegisterBenchmark((name + "/f64").c_str(), run_naive<double>, g, batch)->Unit(benchmark::kMicrosecond);
        }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_terms
