// Swin / BEiT relative position bias and the SwinV2 continuous position bias beside the iRPE
// variants: bucket ids (cold build, no cache) and the fused attention with a per-head bias on keys.
//
//   vit/swin/ids/<mapping>/<window>              build_bucket_ids of one window (no cache)
//   vit/swin/attn/<variant>/<window>/b<B>        attention_forward, B windows, H = 4, D = 32
//   vit/swin/attn_bwd/<variant>/<window>/b<B>    forward + attention_backward (+ the CPB chain rule)
//
// Variants: none (no RPE), swin (Swin bias table), beit (BEiT, class token + 3 buckets), swinv2
// (CPB: 16·sigmoid table from a given MLP output, then the Swin bias; the MLP itself is the
// caller's and not timed), product (iRPE Product, bias mode, per-head tables) for comparison.
// ctest bench.smoke_vit_swin runs each once (--benchmark_min_time=0.01).
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_vit_swin {
namespace {

using rpe_bench::random_vector;

enum class variant { none, swin, beit, swinv2, product };

const char* name_of(variant v) {
    switch (v) {
        case variant::none: return "none";
        case variant::swin: return "swin";
        case variant::beit: return "beit";
        case variant::swinv2: return "swinv2";
        case variant::product: return "product";
    }
    return "?";
}

// One attention problem over B windows of w × w tokens (plus the class token for BEiT).
struct problem {
    int b, h = 4, d = 32, w;
    variant v;
    int skip() const { return v == variant::beit ? 1 : 0; }
    std::int64_t length() const { return skip() + static_cast<std::int64_t>(w) * w; }
};

struct setup {
    problem p;
    std::unique_ptr<rpe::any_term<float>> term;
    std::unique_ptr<rpe::cpb_bias<float>> cpb;
    std::vector<float> q, k, v, out, grad_out, gq, gk, gv, table, grad_table, raw, grad_raw;
    rpe::attention_inputs<float> in;

    explicit setup(problem pr) : p(pr) {
        const std::int64_t l = p.length(), n = static_cast<std::int64_t>(p.b) * p.h * l * p.d;
        q = random_vector<float>(n, 1.0, 1);
        k = random_vector<float>(n, 1.0, 2);
        v = random_vector<float>(n, 1.0, 3);
        grad_out = random_vector<float>(n, 1.0, 4);
        out.resize(static_cast<std::size_t>(n));
        gq.resize(out.size());
        gk.resize(out.size());
        gv.resize(out.size());
        const rpe::term_config cfg{.num_heads = p.h, .head_dim = p.d, .shared_head = false, .skip = p.skip()};
        switch (p.v) {
            case variant::none: break;
            case variant::swin:
                term = rpe::make_any_term(rpe::term<rpe::mapping::swin, rpe::mode::bias, rpe::target::key>({p.w, p.w}, cfg));
                break;
            case variant::beit:
                term = rpe::make_any_term(rpe::term<rpe::mapping::beit, rpe::mode::bias, rpe::target::key>({p.w, p.w}, cfg));
                break;
            case variant::product:
                term = rpe::make_any_term(rpe::term<rpe::mapping::product<>, rpe::mode::bias, rpe::target::key>(
                    rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, cfg));
                break;
            case variant::swinv2:
                cpb = std::make_unique<rpe::cpb_bias<float>>(rpe::mapping::swin{p.w, p.w},
                                                             rpe::cpb_config{.num_heads = p.h, .head_dim = p.d});
                term = rpe::make_any_term(cpb->term());
                raw = random_vector<float>(static_cast<std::int64_t>(cpb->num_buckets()) * p.h, 1.0, 5);
                grad_raw.resize(raw.size());
                break;
        }
        in.q = {q.data(), {p.b, p.h, l, p.d}};
        in.k = {k.data(), {p.b, p.h, l, p.d}};
        in.v = {v.data(), {p.b, p.h, l, p.d}};
        in.height = p.w;
        in.width = p.w;
        if (term) {
            const std::int64_t kk = term->num_buckets();
            table = random_vector<float>(p.h * kk, 0.02, 6);
            grad_table.resize(table.size());
            in.rpe_k = {.term = term.get(), .tables = {{table.data(), {p.h, kk}}}, .grad_tables = {}};
            (void)term->bucket_ids(p.w, p.w);  // warm cache
        }
    }
    void make_table() {  // SwinV2: the table from the MLP output, every step (it changes with the MLP)
        if (cpb) cpb->make_table({raw.data(), {cpb->num_buckets(), p.h}}, {table.data(), {p.h, cpb->num_buckets()}});
    }
    void forward() {
        make_table();
        rpe::attention_forward(in, {out.data(), {p.b, p.h, p.length(), p.d}});
    }
    void backward() {
        auto bin = in;
        if (term) bin.rpe_k.grad_tables = {{grad_table.data(), {p.h, term->num_buckets()}}};
        const std::int64_t l = p.length();
        rpe::attention_backward(bin, {grad_out.data(), {p.b, p.h, l, p.d}}, {gq.data(), {p.b, p.h, l, p.d}},
                                {gk.data(), {p.b, p.h, l, p.d}}, {gv.data(), {p.b, p.h, l, p.d}});
        if (cpb)
            cpb->backward_table({raw.data(), {cpb->num_buckets(), p.h}}, {grad_table.data(), {p.h, cpb->num_buckets()}},
                                {grad_raw.data(), {cpb->num_buckets(), p.h}}, rpe::write::overwrite);
    }
};

void BM_VitSwin_Attention(benchmark::State& state, problem p, bool with_backward) {
    setup s(p);
    for (auto _ : state) {
        s.forward();
        if (with_backward) s.backward();
        benchmark::DoNotOptimize(s.out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * p.b * p.h * p.length() * p.length());
    state.counters["num_buckets"] = s.term ? s.term->num_buckets() : 0;
}

template <class M>
void BM_VitSwin_Ids(benchmark::State& state, M m, int w, int skip) {
    std::int64_t bytes = 0;
    for (auto _ : state) {
        const auto ids = rpe::build_bucket_ids(m, w, w, skip);
        bytes = ids->bytes();
        benchmark::DoNotOptimize(ids.get());
    }
    const std::int64_t l = skip + static_cast<std::int64_t>(w) * w;
    state.SetItemsProcessed(state.iterations() * l * l);
    state.counters["id_bytes"] = static_cast<double>(bytes);
}

const bool registered = [] {
    for (int w : {7, 12, 16}) {
        const std::string win = std::to_string(w) + "x" + std::to_string(w);
        benchmark::RegisterBenchmark(("vit/swin/ids/swin/" + win).c_str(), BM_VitSwin_Ids<rpe::mapping::swin>,
                                     rpe::mapping::swin{w, w}, w, 0)
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("vit/swin/ids/beit/" + win + "+1").c_str(), BM_VitSwin_Ids<rpe::mapping::beit>,
                                     rpe::mapping::beit{w, w}, w, 1)
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("vit/swin/ids/product/" + win).c_str(), BM_VitSwin_Ids<rpe::mapping::product<>>,
                                     rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, w, 0)
            ->Unit(benchmark::kMicrosecond);
    }
    // Swin-T stage 1 at 224: 64 windows of 7 × 7 per image; SwinV2 at 256: 8 × 8 windows; a
    // 14 × 14 grid is BEiT-B/16's (one "window" = the image).
    for (auto [w, b] : {std::pair{7, 64}, std::pair{8, 64}, std::pair{14, 8}})
        for (variant v : {variant::none, variant::swin, variant::beit, variant::swinv2, variant::product})
            for (bool bwd : {false, true}) {
                const std::string name = std::string("vit/swin/") + (bwd ? "attn_bwd/" : "attn/") + name_of(v) + "/" +
                                         std::to_string(w) + "x" + std::to_string(w) + "/b" + std::to_string(b);
                benchmark::RegisterBenchmark(name.c_str(), BM_VitSwin_Attention, problem{.b = b, .w = w, .v = v}, bwd)
                    ->Unit(benchmark::kMillisecond)
                    ->UseRealTime();
            }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_vit_swin
