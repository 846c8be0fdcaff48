// `rpe bench`: time and memory of mapping variants for the user's own shapes — bucket ids (build
// time, bytes), lookup tables (bytes), and the fused attention (rpe::attention_forward) without
// RPE, with a term on keys, and with terms on queries, keys and values.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <rpe/attention.hpp>

#include "cli.hpp"

namespace rpe_cli {

namespace {

// Median wall time of `repeat` runs of f after one untimed warm-up run, in milliseconds.
double median_ms(int repeat, const std::function<void()>& f) {
    f();
    std::vector<double> t;
    for (int r = 0; r < repeat; ++r) {
        const auto a = std::chrono::steady_clock::now();
        f();
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

std::vector<float> random_values(std::size_t n, unsigned seed, float sigma) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> dist(0.0f, sigma);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(gen);
    return v;
}

template <class T>
rpe::tensor_ref<T> view(T* data, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<T>(data, std::span<const std::int64_t>(shape));  // checks rank <= 4
}

// One term with its random tables, ready for an attention_term slot.
struct bench_term {
    std::unique_ptr<rpe::any_term<float>> term;
    std::vector<std::vector<float>> tables;
    rpe::attention_term<float> slot() const {
        rpe::attention_term<float> s;
        s.term = term.get();
        for (const auto& t : tables) s.tables.push_back(view<const float>(t.data(), term->table_shape()));
        return s;
    }
    [[nodiscard]] std::int64_t bytes() const {
        std::int64_t b = 0;
        for (const auto& t : tables) b += static_cast<std::int64_t>(t.size() * sizeof(float));
        return b;
    }
};

// The benchmark's memory budget: inputs, output and every lookup table of a variant together.
constexpr double bench_budget_bytes = 8.0 * (1ull << 30);

// A term on target tg with random tables (their size checked by check_bench_budget first).
bench_term make_bench_term(const mapping_config& m, rpe::term_spec spec, rpe::target tg, unsigned seed) {
    spec.target = tg;
    bench_term b;
    b.term = make_cli_term(m, spec);
    std::int64_t n = 1;
    for (auto e : b.term->table_shape()) n *= e;
    for (int t = 0; t < b.term->num_tables(); ++t)
        b.tables.push_back(random_values(static_cast<std::size_t>(n), seed + static_cast<unsigned>(t), 0.02f));
    return b;
}

// The lookup tables of one variant (`targets` terms whose tables all have the key term's element
// count) plus `used` bytes of inputs must fit the budget; their size follows from
// --ratio/--alpha/--beta/--gamma (K) and --heads/--dim and is checked in double (no overflow)
// before anything is allocated.
void check_bench_budget(const mapping_config& m, rpe::term_spec spec, int targets, double used) {
    spec.target = rpe::target::key;
    const auto term = make_cli_term(m, spec);
    double elems = 1.0;
    for (auto e : term->table_shape()) elems *= static_cast<double>(e);
    used += elems * term->num_tables() * targets * sizeof(float);
    if (used > bench_budget_bytes)
        throw usage_error("--ratio/--beta/--heads/--dim", "the " + std::to_string(targets) + " lookup tables of " + m.describe() +
                                                              " (K = " + std::to_string(term->num_buckets()) +
                                                              ") with the inputs take " + std::to_string(used / (1ull << 30)) +
                                                              " GiB, more than the 8 GiB this benchmark allows");
}

}  // namespace

int run_bench(const std::vector<mapping_config>& maps, const bench_options& o) {
    const auto g = parse_grid(o.grid, "--grid");
    bool contextual = true;
    try {
        contextual = rpe::parse_contextual(o.mode);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--mode", e.what());
    }
    const std::int64_t B = o.batch, H = o.heads, D = o.dim, L = o.skip + static_cast<std::int64_t>(g.height) * g.width;
    const std::vector<std::int64_t> qshape{B, H, L, D};
    const double elems = static_cast<double>(B) * H * L * L;
    if (elems * sizeof(float) > bench_budget_bytes)
        throw usage_error("--grid/--batch/--heads", "B*H*L*L = " + std::to_string(elems) +
                                                        " logits exceed the 8 GiB this benchmark allows for (B, H, L, L)");
    const double inputs = 4.0 * static_cast<double>(B) * H * L * D;  // q, k, v, out
    if (inputs * sizeof(float) > bench_budget_bytes)
        throw usage_error("--dim/--grid/--batch/--heads",
                          "4*B*H*L*D = " + std::to_string(inputs) + " floats exceed the 8 GiB this benchmark allows");
    const auto q = random_values(static_cast<std::size_t>(B * H * L * D), 1, 1.0f);
    const auto k = random_values(q.size(), 2, 1.0f);
    const auto v = random_values(q.size(), 3, 1.0f);
    std::vector<float> out(q.size());
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    std::printf("shapes: B=%lld H=%lld L=%lld D=%lld (grid %dx%d, skip %d), %s mode, %d thread(s), median of %d run(s)\n",
                static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(L), static_cast<long long>(D),
                g.height, g.width, o.skip, contextual ? "contextual" : "bias", threads, o.repeat);

    rpe::attention_inputs<float> base;
    base.q = view<const float>(q.data(), qshape);
    base.k = view<const float>(k.data(), qshape);
    base.v = view<const float>(v.data(), qshape);
    base.height = g.height;
    base.width = g.width;
    const double t_plain = median_ms(o.repeat, [&] { rpe::attention_forward(base, view<float>(out.data(), qshape)); });
    std::printf("attention without RPE: %.3f ms\n", t_plain);
    std::printf("%-62s %6s %9s %11s %12s %10s %10s %10s\n", "variant", "K", "ids ms", "ids bytes", "table bytes", "+k ms",
                contextual ? "+qkv ms" : "+qk ms", "qkv/none");
    for (const auto& mc : maps) {
        const mapping_config m = mc.for_grid(g);
        std::shared_ptr<const rpe::bucket_ids> ids;
        const double t_ids = median_ms(o.repeat, [&] { ids = build_ids(m, g.height, g.width, o.skip); });  // cold: no cache
        rpe::term_spec spec;
        spec.contextual = contextual;
        spec.num_heads = static_cast<int>(H);
        spec.head_dim = static_cast<int>(D);
        spec.shared_head = true;
        spec.skip = o.skip;
        check_bench_budget(m, spec, contextual ? 3 : 2, inputs * sizeof(float));  // q, k, v, out and the tables
        const auto tk = make_bench_term(m, spec, rpe::target::key, 10);
        const auto tq = make_bench_term(m, spec, rpe::target::query, 20);
        bench_term tv;
        if (contextual) tv = make_bench_term(m, spec, rpe::target::value, 30);
        (void)tk.term->bucket_ids(g.height, g.width);  // warm the shared cache: the timings below are warm

        auto with_k = base;
        with_k.rpe_k = tk.slot();
        const double t_k = median_ms(o.repeat, [&] { rpe::attention_forward(with_k, view<float>(out.data(), qshape)); });
        auto with_all = with_k;
        with_all.rpe_q = tq.slot();
        if (contextual) with_all.rpe_v = tv.slot();
        const double t_all = median_ms(o.repeat, [&] { rpe::attention_forward(with_all, view<float>(out.data(), qshape)); });
        const std::int64_t table_bytes = tk.bytes() + tq.bytes() + (contextual ? tv.bytes() : 0);
        std::printf("%-62s %6d %9.3f %11lld %12lld %10.3f %10.3f %10.2f\n", m.describe().c_str(), ids->num_buckets(), t_ids,
                    static_cast<long long>(ids->bytes()), static_cast<long long>(table_bytes), t_k, t_all,
                    t_plain > 0 ? t_all / t_plain : 0.0);
    }
    return 0;
}

}  // namespace rpe_cli
