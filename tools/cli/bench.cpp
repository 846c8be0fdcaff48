// `rpe bench`: time and memory of mapping variants for the user's own shapes — bucket ids (build
// time, bytes), lookup tables (bytes), and the fused attention (rpe::attention_forward, and with
// --pass fwd_bwd also rpe::attention_backward with the tables' gradients) without RPE, with a
// term on keys, and with terms on queries, keys and values. The attention variants are timed
// interleaved: each round runs every (variant, pass) once, the order rotated by one per round,
// so a slow spell of the machine touches every variant alike; the spread over the rounds is
// reported (median, min, quartiles, max), as a table or as CSV (--format csv).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
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

double elapsed_ms(std::chrono::steady_clock::time_point a) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

// Median wall time of `repeat` runs of f after one untimed warm-up run, in milliseconds.
double median_ms(int repeat, const std::function<void()>& f) {
    f();
    std::vector<double> t;
    for (int r = 0; r < repeat; ++r) {
        const auto a = std::chrono::steady_clock::now();
        f();
        t.push_back(elapsed_ms(a));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// The spread of a variant's times: quantiles by linear interpolation between the sorted samples
// (numpy's default), so the median of an even count is the mean of the two middle samples.
struct spread {
    double min = 0, q1 = 0, median = 0, q3 = 0, max = 0;
};

spread spread_of(std::vector<double> t) {
    std::sort(t.begin(), t.end());
    const auto at = [&](double f) {
        const double pos = f * static_cast<double>(t.size() - 1);
        const auto i = static_cast<std::size_t>(std::floor(pos));
        const std::size_t j = std::min(i + 1, t.size() - 1);
        return t[i] + (t[j] - t[i]) * (pos - static_cast<double>(i));
    };
    return {t.front(), at(0.25), at(0.5), at(0.75), t.back()};
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

// One term with its random tables (and their gradients' buffers), ready for an attention_term slot.
struct bench_term {
    std::unique_ptr<rpe::any_term<float>> term;
    std::vector<std::vector<float>> tables, grads;
    rpe::attention_term<float> slot() {
        rpe::attention_term<float> s;
        s.term = term.get();
        for (const auto& t : tables) s.tables.push_back(view<const float>(t.data(), term->table_shape()));
        for (auto& g : grads) s.grad_tables.push_back(view<float>(g.data(), term->table_shape()));
        return s;
    }
    [[nodiscard]] std::int64_t bytes() const {
        std::int64_t b = 0;
        for (const auto& t : tables) b += static_cast<std::int64_t>(t.size() * sizeof(float));
        return b;
    }
};

// The benchmark's memory budget: inputs, outputs, gradients and every lookup table (and its
// gradient with fwd_bwd) of all the variants together (they are timed interleaved, so all live).
constexpr double bench_budget_bytes = 8.0 * (1ull << 30);

// A term on target tg with random tables (their size checked by check_bench_budget first), and
// buffers for their gradients when `grads`.
bench_term make_bench_term(const mapping_config& m, rpe::term_spec spec, rpe::target tg, unsigned seed, bool grads) {
    spec.target = tg;
    bench_term b;
    b.term = make_cli_term(m, spec);
    std::int64_t n = 1;
    for (auto e : b.term->table_shape()) n *= e;
    for (int t = 0; t < b.term->num_tables(); ++t) {
        b.tables.push_back(random_values(static_cast<std::size_t>(n), seed + static_cast<unsigned>(t), 0.02f));
        if (grads) b.grads.emplace_back(static_cast<std::size_t>(n));
    }
    return b;
}

// The lookup tables of one mapping (`targets` terms whose tables all have the key term's element
// count, twice with their gradients) plus `used` bytes so far must fit the budget; their size
// follows from --ratio/--alpha/--beta/--gamma (K) and --heads/--dim and is checked in double (no
// overflow) before anything is allocated. Returns the bytes used with these tables.
double check_bench_budget(const mapping_config& m, rpe::term_spec spec, int targets, double used, bool grads) {
    spec.target = rpe::target::key;
    const auto term = make_cli_term(m, spec);
    double elems = 1.0;
    for (auto e : term->table_shape()) elems *= static_cast<double>(e);
    used += elems * term->num_tables() * targets * sizeof(float) * (grads ? 2 : 1);
    if (used > bench_budget_bytes)
        throw usage_error("--ratio/--beta/--heads/--dim", "the " + std::to_string(targets) + " lookup tables of " + m.describe() +
                                                              " (K = " + std::to_string(term->num_buckets()) +
                                                              ") with the inputs take " + std::to_string(used / (1ull << 30)) +
                                                              " GiB, more than the 8 GiB this benchmark allows");
    return used;
}

enum class pass { fwd, fwd_bwd };
const char* pass_name(pass p) { return p == pass::fwd ? "fwd" : "fwd_bwd"; }

// One attention variant: no RPE, or one mapping's terms on k (rpe "k") or on q, k (and v) ("qkv"
// in contextual mode, "qk" in bias mode), with the samples of each pass.
struct variant {
    std::string mapping = "none", rpe = "none";
    int k = 0;
    double ids_ms = 0;
    std::int64_t ids_bytes = 0, table_bytes = 0;
    rpe::attention_inputs<float> in;
    std::vector<double> times[2];  // per pass (index: pass)
};

// A field of a CSV row: quoted, inner quotes doubled (mapping descriptions hold commas).
std::string csv_quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"') out += '"';
        out += c;
    }
    return out + "\"";
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
    std::vector<pass> passes;
    for (const auto& p : o.passes) {
        const pass x = p == "fwd" ? pass::fwd : pass::fwd_bwd;  // the values are checked by the option
        if (std::find(passes.begin(), passes.end(), x) == passes.end()) passes.push_back(x);
    }
    const bool backward = std::find(passes.begin(), passes.end(), pass::fwd_bwd) != passes.end();
    const std::int64_t B = o.batch, H = o.heads, D = o.dim, L = o.skip + static_cast<std::int64_t>(g.height) * g.width;
    const std::vector<std::int64_t> qshape{B, H, L, D};
    const double elems = static_cast<double>(B) * H * L * L;
    if (elems * sizeof(float) > bench_budget_bytes)
        throw usage_error("--grid/--batch/--heads", "B*H*L*L = " + std::to_string(elems) +
                                                        " logits exceed the 8 GiB this benchmark allows for (B, H, L, L)");
    // q, k, v, out; with fwd_bwd also grad_out, grad_q, grad_k, grad_v
    const double inputs = (backward ? 8.0 : 4.0) * static_cast<double>(B) * H * L * D;
    if (inputs * sizeof(float) > bench_budget_bytes)
        throw usage_error("--dim/--grid/--batch/--heads", (backward ? "8*B*H*L*D = " : "4*B*H*L*D = ") + std::to_string(inputs) +
                                                              " floats exceed the 8 GiB this benchmark allows");
    const auto q = random_values(static_cast<std::size_t>(B * H * L * D), 1, 1.0f);
    const auto k = random_values(q.size(), 2, 1.0f);
    const auto v = random_values(q.size(), 3, 1.0f);
    const auto grad_out = backward ? random_values(q.size(), 4, 1.0f) : std::vector<float>{};
    std::vector<float> out(q.size()), gq(backward ? q.size() : 0), gk(gq.size()), gv(gq.size());
    int threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    std::string pass_list;
    for (auto p : passes) pass_list += std::string(pass_list.empty() ? "" : ",") + pass_name(p);
    const bool csv = o.format == "csv";
    if (!csv) {
        std::printf("shapes: B=%lld H=%lld L=%lld D=%lld (grid %dx%d, skip %d), %s mode, %d thread(s)\n",
                    static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(L), static_cast<long long>(D),
                    g.height, g.width, o.skip, contextual ? "contextual" : "bias", threads);
        std::printf(
            "timing: pass %s, %d interleaved round(s) after %d warm-up round(s): each round runs every variant and "
            "pass once, the order rotated by one per round; ids: median of %d cold build(s)\n",
            pass_list.c_str(), o.repeat, o.warmup, o.repeat);
    }

    rpe::attention_inputs<float> base;
    base.q = view<const float>(q.data(), qshape);
    base.k = view<const float>(k.data(), qshape);
    base.v = view<const float>(v.data(), qshape);
    base.height = g.height;
    base.width = g.width;
    std::deque<bench_term> terms;  // stable addresses: the variants' slots point at them
    std::vector<variant> variants(1);
    variants[0].in = base;
    double used = inputs * sizeof(float);
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
        used = check_bench_budget(m, spec, contextual ? 3 : 2, used, backward);
        auto& tk = terms.emplace_back(make_bench_term(m, spec, rpe::target::key, 10, backward));
        auto& tq = terms.emplace_back(make_bench_term(m, spec, rpe::target::query, 20, backward));
        bench_term* tv = contextual ? &terms.emplace_back(make_bench_term(m, spec, rpe::target::value, 30, backward)) : nullptr;
        (void)tk.term->bucket_ids(g.height, g.width);  // warm the shared cache: the timings below are warm

        variant with_k;
        with_k.mapping = m.describe();
        with_k.rpe = "k";
        with_k.k = ids->num_buckets();
        with_k.ids_ms = t_ids;
        with_k.ids_bytes = ids->bytes();
        with_k.table_bytes = tk.bytes();
        with_k.in = base;
        with_k.in.rpe_k = tk.slot();
        variant with_all = with_k;
        with_all.rpe = contextual ? "qkv" : "qk";
        with_all.in.rpe_q = tq.slot();
        with_all.table_bytes += tq.bytes();
        if (tv) {
            with_all.in.rpe_v = tv->slot();
            with_all.table_bytes += tv->bytes();
        }
        variants.push_back(std::move(with_k));
        variants.push_back(std::move(with_all));
    }

    const auto run_once = [&](const variant& x, pass p) {
        rpe::attention_forward(x.in, view<float>(out.data(), qshape));
        if (p == pass::fwd_bwd)
            rpe::attention_backward(x.in, view<const float>(grad_out.data(), qshape), view<float>(gq.data(), qshape),
                                    view<float>(gk.data(), qshape), view<float>(gv.data(), qshape));
    };
    // (variant, pass) pairs, timed round-robin
    const std::size_t np = passes.size(), runs = variants.size() * np;
    for (int w = 0; w < o.warmup; ++w)
        for (std::size_t i = 0; i < runs; ++i) run_once(variants[i / np], passes[i % np]);
    for (int r = 0; r < o.repeat; ++r)
        for (std::size_t i = 0; i < runs; ++i) {
            const std::size_t at = (i + static_cast<std::size_t>(r)) % runs;
            auto& x = variants[at / np];
            const pass p = passes[at % np];
            const auto a = std::chrono::steady_clock::now();
            run_once(x, p);
            x.times[static_cast<int>(p)].push_back(elapsed_ms(a));
        }

    if (csv)
        std::printf(
            "mapping,rpe,pass,mode,B,H,L,D,threads,K,ids_ms,ids_bytes,table_bytes,rounds,warmup,median_ms,min_ms,q1_ms,q3_ms,max_"
            "ms,"
            "median_over_none\n");
    else
        std::printf("%-62s %6s %9s %11s %12s\n", "variant", "K", "ids ms", "ids bytes", "table bytes");
    if (!csv)
        for (std::size_t i = 1; i < variants.size(); i += 2) {
            const auto& x = variants[i + 1];  // the mapping's q, k (, v) variant: all its tables
            std::printf("%-62s %6d %9.3f %11lld %12lld\n", x.mapping.c_str(), x.k, x.ids_ms, static_cast<long long>(x.ids_bytes),
                        static_cast<long long>(x.table_bytes));
        }
    if (!csv)
        std::printf("%-62s %4s %-7s %9s %9s %9s %9s %9s %7s\n", "attention (ms)", "rpe", "pass", "median", "min", "q1", "q3",
                    "max", "/none");
    for (const auto p : passes) {
        const double none = spread_of(variants[0].times[static_cast<int>(p)]).median;
        for (const auto& x : variants) {
            const auto s = spread_of(x.times[static_cast<int>(p)]);
            const double ratio = none > 0 ? s.median / none : 0.0;
            if (csv) {
                const bool rpe = x.rpe != "none";
                std::printf("%s,%s,%s,%s,%lld,%lld,%lld,%lld,%d,%s,%s,%s,%s,%d,%d,%.6f,%.6f,%.6f,%.6f,%.6f,%.4f\n",
                            csv_quote(x.mapping).c_str(), x.rpe.c_str(), pass_name(p), contextual ? "contextual" : "bias",
                            static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(L),
                            static_cast<long long>(D), threads, rpe ? std::to_string(x.k).c_str() : "",
                            rpe ? std::to_string(x.ids_ms).c_str() : "", rpe ? std::to_string(x.ids_bytes).c_str() : "",
                            std::to_string(x.table_bytes).c_str(), o.repeat, o.warmup, s.median, s.min, s.q1, s.q3, s.max, ratio);
            } else {
                std::printf("%-62s %4s %-7s %9.3f %9.3f %9.3f %9.3f %9.3f %7.2f\n", x.mapping.c_str(), x.rpe.c_str(),
                            pass_name(p), s.median, s.min, s.q1, s.q3, s.max, ratio);
            }
        }
    }
    return 0;
}

}  // namespace rpe_cli
