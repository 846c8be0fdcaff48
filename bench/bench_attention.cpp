// Fused attention with iRPE (Google Benchmark): DeiT-S shapes and a 56x56 grid, with no RPE,
// contextual Product on k, and on q, k, v (ratio 1.9, class token, table shared by the heads);
// and a 128x128 grid whose bucket ids are computed on the fly; on DeiT-S also 2D RoPE on q and k
// (rope: rope-vit's RoPE-Axial θ = 100; rope_k: with contextual Product on k; rope_mixed:
// RoPE-Mixed with its frequency gradient in the backward; forward only: rope_cat, rope_dinov3,
// rope_mrope, and rope_positions / k_positions at per-token positions equal to the grid).
//
// Names (scripts read them): attention/<shape>/<rpe> is the float32 forward;
// attention_fwd_bwd/<shape>/<rpe> forward + backward; attention_composed/<shape>/<rpe> the
// unfused composition (materialised (B, H, L, L) logits) for comparison;
// attention/deit_s/<rpe>/bf16 the forward on rpe::bf16 storage (label: "AVX512_BF16" or
// "portable", the path taken), beside the floors floor/attention/deit_s (float, Eigen's
// products), floor/attention/deit_s/rpe_gemm (float, rpe's own product, AVX-512F builds) and
// floor/attention/deit_s/bf16; attention/digits/<rpe> the digits demo's shapes (B = 16, H = 4,
// 8 × 8 grid, D = 16) beside floor/attention/digits(/rpe_gemm).
// Counters: L; workspace_bytes (the calling thread's scratch buffer after the runs: the peak of
// the fused calls' scratch); on attention_fwd_bwd also partials_bytes (the backward's partials
// live at once under attention_options::backward_budget_bytes, rpe::cpu::plan_backward_scratch)
// and partials_all_bytes (without a budget); attention_fwd_bwd/grid64/qkv/budget_16MiB runs the
// backward under a 16 MiB budget; attention_fwd_bwd/deit_s/<rpe>/saved_attn the forward writing
// the (B, H, L, L) probabilities and the backward reading them (attention_gradients::saved_attn)
// instead of recomputing them. attention/packed4/k and attention_fwd_bwd/packed4/k: 4 images
// of different sizes packed into one sequence; .../packed4_each/k: the same 4 images as 4 calls.
#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// Each bench source has its own namespace: the sources may be compiled together (RPE_BENCH_UNITY_BATCH).
namespace rpe_bench_attention {
namespace {

using product = rpe::mapping::product<>;
template <rpe::target T>
using ctx_term = rpe::term<product, rpe::mode::contextual, T, float>;

struct attention_config {
    int b, h, height, width, d;
    std::string rpe_on;      // "", "k", "qkv"
    std::string rope;        // "", "axial", "mixed", "cat", "dinov3", "mrope"
    bool positions = false;  // iRPE and RoPE at per-token positions equal to the grid's coordinates
    std::int64_t budget = rpe::attention_options{}.backward_budget_bytes;  // the backward's partials
};

struct attention_case : attention_config {
    explicit attention_case(const attention_config& c) : attention_config(c) { setup(); }
    std::int64_t l() const { return 1 + static_cast<std::int64_t>(height) * width; }

    std::vector<float> q, k, v, grad_out, out, gq, gk, gv, attn;
    std::vector<float> tables[3], grads[3], freqs, grad_freqs;
    std::vector<std::int32_t> ipos;  // (N, 2) the grid's (row, col) as iRPE positions
    std::vector<float> rpos;         // (N, A) the same for the RoPE (mrope: (0, row, col))
    std::unique_ptr<rpe::any_term<float>> terms[3];
    rpe::attention_inputs<float> in;

    void setup() {
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
        const product m{rpe::index::piecewise::from_ratio(1.9)};
        in.q = {q.data(), {b, h, l(), d}};
        in.k = {k.data(), {b, h, l(), d}};
        in.v = {v.data(), {b, h, l(), d}};
        in.height = height;
        in.width = width;
        rpe::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        const char letters[3] = {'q', 'k', 'v'};
        for (int t = 0; t < 3; ++t) {
            if (rpe_on.find(letters[t]) == std::string::npos) continue;
            if (t == 0)
                terms[t] = rpe::make_any_term(ctx_term<rpe::target::query>(m, {.num_heads = h, .head_dim = d, .skip = 1}));
            if (t == 1) terms[t] = rpe::make_any_term(ctx_term<rpe::target::key>(m, {.num_heads = h, .head_dim = d, .skip = 1}));
            if (t == 2)
                terms[t] = rpe::make_any_term(ctx_term<rpe::target::value>(m, {.num_heads = h, .head_dim = d, .skip = 1}));
            const auto shape = terms[t]->table_shape();
            tables[t].resize(static_cast<std::size_t>(shape[0] * shape[1] * shape[2]));
            for (auto& e : tables[t]) e = 0.1f * normal(rng);
            grads[t].resize(tables[t].size());
            slots[t]->term = terms[t].get();
            slots[t]->tables = {rpe::tensor_ref<const float>(tables[t].data(), {shape[0], shape[1], shape[2]})};
            slots[t]->grad_tables = {rpe::tensor_ref<float>(grads[t].data(), {shape[0], shape[1], shape[2]})};
            (void)terms[t]->bucket_ids(height, width);  // warm cache: ids are built once per grid
        }
        const int axes = rope == "mrope" ? 3 : 2;
        if (positions) {
            for (int r = 0; r < height; ++r)
                for (int c = 0; c < width; ++c) {
                    ipos.insert(ipos.end(), {r, c});
                    if (axes == 3) rpos.push_back(0.0f);
                    rpos.insert(rpos.end(), {static_cast<float>(r), static_cast<float>(c)});
                }
            if (!rpe_on.empty()) in.positions = {ipos.data(), {static_cast<std::int64_t>(height) * width, 2}};
        }
        if (rope == "axial") {
            in.rope = {.form = rpe::rope::axial{.theta = 100.0f}, .skip = 1};
            (void)rpe::rope_table_of(in.rope, d, height, width);  // warm cache: cos/sin are built once per grid
        } else if (rope == "cat") {                               // timm's EVA-02 RotaryEmbeddingCat defaults
            in.rope = {.form = rpe::rope::cat{}, .skip = 1};
        } else if (rope == "dinov3") {  // DINOv3's own form and layout (rotate-half)
            in.rope = {.form = rpe::rope::custom{rpe::rope::dinov3{}}, .skip = 1, .layout = rpe::rope::layout::half};
        } else if (rope == "mrope") {  // Qwen-VL M-RoPE at D = 64: 32 pairs in sections 8, 12, 12
            in.rope = {.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 8, .section_h = 12, .section_w = 12}},
                       .skip = 1,
                       .layout = rpe::rope::layout::half};
        } else if (rope == "mixed") {
            freqs.resize(static_cast<std::size_t>(2 * h * d / 2));
            grad_freqs.resize(freqs.size());
            std::vector<float> angles(static_cast<std::size_t>(h));
            for (int i = 0; i < h; ++i) angles[static_cast<std::size_t>(i)] = 0.7f * static_cast<float>(i);
            rpe::rope::init_mixed_frequencies(10.0f, d, angles, freqs);
            in.rope = {.form = rpe::rope::mixed{},
                       .skip = 1,
                       .freqs = rpe::tensor_ref<const float>(freqs.data(), {2, h, d / 2}),
                       .grad_freqs = rpe::tensor_ref<float>(grad_freqs.data(), {2, h, d / 2})};
        }
        if (positions && !rope.empty())
            in.rope.positions = {rpos.data(), {static_cast<std::int64_t>(height) * width, axes}};
        else if (!rope.empty() && rope != "axial" && rope != "mixed")
            (void)rpe::rope_table_of(in.rope, d, height, width);  // warm cache
    }
    rpe::tensor_ref<float> view(std::vector<float>& x) { return {x.data(), {b, h, l(), d}}; }
};

enum class what { forward, forward_backward, forward_backward_saved, composed };

void run(benchmark::State& state, const attention_config& config, what w) {
    attention_case c(config);
    const std::int64_t l = c.l();
    if (w == what::composed || w == what::forward_backward_saved) c.attn.resize(static_cast<std::size_t>(c.b) * c.h * l * l);
    const rpe::attention_options opt{.backward_budget_bytes = c.budget};
    rpe::release_cpu_workspace();  // workspace_bytes below: this case's peak, not an earlier case's
    for (auto _ : state) {
        if (w == what::composed) {
            rpe::composed_attention_forward(c.in, c.view(c.out), rpe::tensor_ref<float>(c.attn.data(), {c.b, c.h, l, l}));
        } else if (w == what::forward_backward_saved) {  // the probabilities kept by the forward, read by the backward
            const rpe::tensor_ref<float> attn(c.attn.data(), {c.b, c.h, l, l});
            rpe::attention_forward(c.in, c.view(c.out), attn, opt);
            rpe::attention_backward(c.in,
                                    {.grad_out = rpe::tensor_ref<const float>(c.grad_out.data(), {c.b, c.h, l, c.d}),
                                     .grad_q = c.view(c.gq),
                                     .grad_k = c.view(c.gk),
                                     .grad_v = c.view(c.gv),
                                     .saved_attn = rpe::tensor_ref<const float>(c.attn.data(), {c.b, c.h, l, l})},
                                    opt);
        } else {
            rpe::attention_forward(c.in, c.view(c.out), {}, opt);
            if (w == what::forward_backward)
                rpe::attention_backward(c.in, rpe::tensor_ref<const float>(c.grad_out.data(), {c.b, c.h, l, c.d}), c.view(c.gq),
                                        c.view(c.gk), c.view(c.gv), opt);
        }
        benchmark::DoNotOptimize(c.out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * c.b * c.h * l * l);  // (query, key) pairs
    state.counters["L"] = static_cast<double>(l);
    if (w == what::composed) return;
    // the calling thread's scratch buffer after the runs: the largest any call of this case needed
    // (every thread's logits blocks, the backward's partials, id copies), in bytes
    const auto bytes = [](std::int64_t x) {
        return benchmark::Counter(static_cast<double>(x), benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
    };
    state.counters["workspace_bytes"] = bytes(static_cast<std::int64_t>(rpe::detail::cpu::arena::of_this_thread().capacity()));
    if (w == what::forward_backward ||
        w == what::forward_backward_saved) {  // the backward's partials live at once, and without a budget
        const auto plan = rpe::cpu::plan_backward_scratch(c.in, opt);
        state.counters["partials_bytes"] = bytes(plan.bytes);
        state.counters["partials_all_bytes"] = bytes(plan.all_bytes);
    }
}

// Packed sequences (attention_inputs::packed): 4 images of different sizes (NaFlexViT-like grids
// 14x14, 10x16, 8x8, 12x9, a class token each; B = 1, H = 6, D = 64, contextual Product on k) in
// one sequence (`packed4`), against the same 4 images as 4 calls on their own buffers
// (`packed4_each`: the sum that packed4 is compared with, target <= 1.1x on one thread).
struct packed_bench {
    static constexpr int h = 6, d = 64;
    static constexpr std::array<std::array<int, 2>, 4> grids{{{14, 14}, {10, 16}, {8, 8}, {12, 9}}};
    std::vector<attention_case> images;  // each image alone (its own q, k, v, tables, terms)
    std::vector<float> q, k, v, grad_out, out, gq, gk, gv, table, grad_table;
    std::vector<std::int32_t> lengths, grid_sizes;
    rpe::attention_inputs<float> in;  // the packed sequence
    std::int64_t l = 0;

    packed_bench() {
        images.reserve(grids.size());
        for (const auto& g : grids) {
            images.emplace_back(attention_config{1, h, g[0], g[1], d, "k", ""});
            lengths.push_back(static_cast<std::int32_t>(images.back().l()));
            grid_sizes.push_back(g[0]);
            grid_sizes.push_back(g[1]);
            l += images.back().l();
        }
        // the packed q, k, v, grad_out: the images' rows one after another (per head)
        for (auto [dst, member] : {std::pair{&q, &attention_case::q}, std::pair{&k, &attention_case::k},
                                   std::pair{&v, &attention_case::v}, std::pair{&grad_out, &attention_case::grad_out}}) {
            dst->resize(static_cast<std::size_t>(h * l * d));
            std::int64_t off = 0;
            for (auto& c : images) {
                const std::int64_t n = c.l();
                for (int hh = 0; hh < h; ++hh)
                    std::copy_n((c.*member).begin() + hh * n * d, n * d, dst->begin() + (hh * l + off) * d);
                off += n;
            }
        }
        out.resize(q.size());
        gq.resize(q.size());
        gk.resize(q.size());
        gv.resize(q.size());
        table = images.front().tables[1];  // one table shared by the images, as in a model
        grad_table.resize(table.size());
        const auto shape = images.front().terms[1]->table_shape();  // (1, D, K): shared by the heads
        for (auto& c : images) c.in.rpe_k.tables = {rpe::tensor_ref<const float>(table.data(), {shape[0], shape[1], shape[2]})};
        in.q = {q.data(), {1, h, l, d}};
        in.k = {k.data(), {1, h, l, d}};
        in.v = {v.data(), {1, h, l, d}};
        in.packed.lengths = {lengths.data(), {4}};
        in.packed.grids = {grid_sizes.data(), {4, 2}};
        in.rpe_k = images.front().in.rpe_k;
        in.rpe_k.grad_tables = {rpe::tensor_ref<float>(grad_table.data(), {shape[0], shape[1], shape[2]})};
    }
};

void run_packed(benchmark::State& state, bool each, bool backward) {
    packed_bench pb;
    const std::int64_t h = packed_bench::h, d = packed_bench::d;
    rpe::release_cpu_workspace();
    for (auto _ : state) {
        if (each) {
            for (auto& c : pb.images) {
                rpe::attention_forward(c.in, c.view(c.out));
                if (backward)
                    rpe::attention_backward(c.in, rpe::tensor_ref<const float>(c.grad_out.data(), {1, h, c.l(), d}), c.view(c.gq),
                                            c.view(c.gk), c.view(c.gv));
                benchmark::DoNotOptimize(c.out.data());
            }
        } else {
            rpe::attention_forward(pb.in, {pb.out.data(), {1, h, pb.l, d}});
            if (backward)
                rpe::attention_backward(pb.in, rpe::tensor_ref<const float>(pb.grad_out.data(), {1, h, pb.l, d}),
                                        {pb.gq.data(), {1, h, pb.l, d}}, {pb.gk.data(), {1, h, pb.l, d}},
                                        {pb.gv.data(), {1, h, pb.l, d}});
            benchmark::DoNotOptimize(pb.out.data());
        }
        benchmark::ClobberMemory();
    }
    std::int64_t pairs = 0;  // (query, key) pairs within the images
    for (const auto& c : pb.images) pairs += h * c.l() * c.l();
    state.SetItemsProcessed(state.iterations() * pairs);
    state.counters["L"] = static_cast<double>(pb.l);
}

// The bf16 forward (rpe::bf16 storage, float accumulation) on the float case's values rounded to bf16.
void run_bf16(benchmark::State& state, const attention_config& config) {
    attention_case c(config);
    const std::int64_t l = c.l();
    const auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<rpe::bf16> r(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) r[i] = rpe::bf16(x[i]);
        return r;
    };
    const auto q = to_bf16(c.q), k = to_bf16(c.k), v = to_bf16(c.v);
    std::vector<rpe::bf16> out(q.size()), tables[3];
    rpe::attention_inputs<rpe::bf16> in;
    in.q = {q.data(), {c.b, c.h, l, c.d}};
    in.k = {k.data(), {c.b, c.h, l, c.d}};
    in.v = {v.data(), {c.b, c.h, l, c.d}};
    in.height = c.height;
    in.width = c.width;
    const rpe::attention_term<float>* from[3] = {&c.in.rpe_q, &c.in.rpe_k, &c.in.rpe_v};
    rpe::attention_term<rpe::bf16>* to[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    for (int t = 0; t < 3; ++t) {
        if (!from[t]->term) continue;
        to[t]->term = from[t]->term;
        tables[t] = to_bf16(c.tables[t]);
        rpe::tensor_ref<const rpe::bf16> view;
        view.data = tables[t].data();
        view.rank = from[t]->tables[0].rank;
        view.shape = from[t]->tables[0].shape;
        to[t]->tables = {view};
    }
    rpe::release_cpu_workspace();
    for (auto _ : state) {
        rpe::attention_forward(in, rpe::tensor_ref<rpe::bf16>(out.data(), {c.b, c.h, l, c.d}));
        benchmark::DoNotOptimize(out.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * c.b * c.h * l * l);
    state.counters["L"] = static_cast<double>(l);
    state.counters["workspace_bytes"] =
        benchmark::Counter(static_cast<double>(rpe::detail::cpu::arena::of_this_thread().capacity()),
                           benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
    state.SetLabel(rpe::detail::cpu::bf16_attention_isa());
}

// The floor: the work no attention can avoid, per (b, h) plane one Eigen product S = Q·Kᵀ, the
// vectorised exp of the (L, L) block and one product O = S·V (fp32; no scale, max, sum or
// normalisation); fwd_bwd adds the four backward products dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K,
// dK = dSᵀ·Q and one elementwise pass dS = P ⊙ dP. Every attention benchmark is reported as a
// ratio to these (docs/benchmarks.md).
void floor_attention(benchmark::State& state, int b, int h, int height, int width, int d, bool backward) {
    using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Eigen::Index l = 1 + static_cast<Eigen::Index>(height) * width;
    const int planes = b * h;
    std::vector<mat> q(planes), k(planes), v(planes), go(planes), o(planes), dq(planes), dk(planes), dv(planes);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int p = 0; p < planes; ++p)
        for (auto* x : {&q[p], &k[p], &v[p], &go[p]})
            x->resize(l, d), *x = x->unaryExpr([&](float) { return 0.125f * normal(rng); });
    mat s(l, l), dp(l, l);
    for (auto _ : state) {
        for (int p = 0; p < planes; ++p) {
            s.noalias() = q[p] * k[p].transpose();
            s = s.array().exp();
            o[p].noalias() = s * v[p];
            if (backward) {
                dv[p].noalias() = s.transpose() * go[p];
                dp.noalias() = go[p] * v[p].transpose();
                dp.array() *= s.array();
                dq[p].noalias() = dp * k[p];
                dk[p].noalias() = dp.transpose() * q[p];
            }
        }
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * planes * l * l);
    state.counters["L"] = static_cast<double>(l);
}

#if defined(__AVX512F__)
// The float floor on rpe's own float product (cpu::simd::gemm, which the fused attention uses
// with AVX-512F): the same work as floor_attention, with Kᵀ and Vᵀ transposed once before the
// timing (rpe transposes the keys per plane and call, so this is below what it can reach).
void floor_attention_rpe_gemm(benchmark::State& state, int b, int h, int height, int width, int d, bool backward) {
    namespace simd = rpe::detail::cpu::simd;
    using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Eigen::Index l = 1 + static_cast<Eigen::Index>(height) * width;
    const int planes = b * h;
    std::vector<mat> q(planes), k(planes), v(planes), kt(planes), vt(planes), go(planes), o(planes), dq(planes), dk(planes),
        dv(planes);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int p = 0; p < planes; ++p) {
        for (auto* x : {&q[p], &k[p], &v[p], &go[p]})
            x->resize(l, d), *x = x->unaryExpr([&](float) { return 0.125f * normal(rng); });
        kt[p] = k[p].transpose();
        vt[p] = v[p].transpose();
        for (auto* x : {&o[p], &dq[p], &dk[p], &dv[p]}) x->resize(l, d);
    }
    mat s(l, l), dp(l, l);
    for (auto _ : state) {
        for (int p = 0; p < planes; ++p) {
            simd::gemm(l, l, d, q[p].data(), d, 1, kt[p].data(), l, s.data(), l);
            s = s.array().exp();
            simd::gemm(l, d, l, s.data(), l, 1, v[p].data(), d, o[p].data(), d);
            if (backward) {
                simd::gemm(l, d, l, s.data(), 1, l, go[p].data(), d, dv[p].data(), d);   // sᵀ·go
                simd::gemm(l, l, d, go[p].data(), d, 1, vt[p].data(), l, dp.data(), l);  // go·vᵀ
                dp.array() *= s.array();
                simd::gemm(l, d, l, dp.data(), l, 1, k[p].data(), d, dq[p].data(), d);  // dp·k
                simd::gemm(l, d, l, dp.data(), 1, l, q[p].data(), d, dk[p].data(), d);  // dpᵀ·q
            }
        }
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
    state.SetItemsProcessed(state.iterations() * planes * l * l);
    state.counters["L"] = static_cast<double>(l);
}
#endif

// The bf16 floor: per plane S = Q·Kᵀ from bf16 Q, K with float accumulation, the vectorised exp
// of S in float, S rounded to bf16 and O = S·V (bf16 V, float accumulation). With AVX512_BF16 in
// rpe_bench's build: vdpbf16ps on K and V packed once before the timing (rpe's bf16 product,
// label "AVX512_BF16"); with AMX-BF16 in the build (namespace amx_bf16) and granted by the OS,
// rpe's AMX product bf16_gemm_amx instead, S rounded into rows padded to 32 (label "AMX_BF16");
// otherwise Q, K, V and S converted to float in the loop and Eigen's float
// products (label "portable").
void floor_attention_bf16(benchmark::State& state, int b, int h, int height, int width, int d) {
    namespace cpu = rpe::detail::cpu;
    using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const std::int64_t l = 1 + static_cast<std::int64_t>(height) * width, planes = static_cast<std::int64_t>(b) * h;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<rpe::bf16> q(static_cast<std::size_t>(planes * l * d)), k(q.size()), v(q.size()),
        sb(static_cast<std::size_t>(l * l));
    for (auto* x : {&q, &k, &v})
        for (auto& e : *x) e = rpe::bf16(0.125f * normal(rng));
    std::vector<float> s(static_cast<std::size_t>(l * l)), o(static_cast<std::size_t>(planes * l * d));
#if defined(RPE_HAS_AMX_BF16)
    if (cpu::amx_granted()) {  // AMX tiles: S kept in bf16 rows of lp (l rounded up to 32, zeros past l)
        const std::int64_t lp = (l + 31) / 32 * 32, kp_size = cpu::bf16_pack_size_amx(d, l), vp_size = cpu::bf16_pack_size(lp, d);
        std::vector<rpe::bf16> kp(static_cast<std::size_t>(planes * kp_size)), vp(static_cast<std::size_t>(planes * vp_size)),
            sp(static_cast<std::size_t>(l * lp));
        for (std::int64_t p = 0; p < planes; ++p) {
            cpu::bf16_pack_transposed(k.data() + p * l * d, d, d, l, kp.data() + p * kp_size);
            cpu::bf16_pack_rows(v.data() + p * l * d, d, l, d, vp.data() + p * vp_size);
        }
        const cpu::amx_tiles tiles;
        for (auto _ : state) {
            for (std::int64_t p = 0; p < planes; ++p) {
                cpu::bf16_gemm_amx(l, l, d, q.data() + p * l * d, d, kp.data() + p * kp_size, s.data(), l, 1.0f, false);
                Eigen::Map<mat> sm(s.data(), l, l);
                sm = sm.array().exp();
                for (std::int64_t i = 0; i < l; ++i) cpu::float_to_bf16(s.data() + i * l, sp.data() + i * lp, l);
                cpu::bf16_gemm_amx(l, d, lp, sp.data(), lp, vp.data() + p * vp_size, o.data() + p * l * d, d, 1.0f, false);
            }
            benchmark::DoNotOptimize(o.data());
            benchmark::ClobberMemory();
        }
        state.SetItemsProcessed(state.iterations() * planes * l * l);
        state.counters["L"] = static_cast<double>(l);
        state.SetLabel(cpu::bf16_attention_isa());
        return;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const std::int64_t kp_size = cpu::bf16_pack_size(d, l), vp_size = cpu::bf16_pack_size(l, d);
    std::vector<rpe::bf16> kp(static_cast<std::size_t>(planes * kp_size)), vp(static_cast<std::size_t>(planes * vp_size));
    for (std::int64_t p = 0; p < planes; ++p) {
        cpu::bf16_pack_transposed(k.data() + p * l * d, d, d, l, kp.data() + p * kp_size);
        cpu::bf16_pack_rows(v.data() + p * l * d, d, l, d, vp.data() + p * vp_size);
    }
    for (auto _ : state) {
        for (std::int64_t p = 0; p < planes; ++p) {
            cpu::bf16_gemm(l, l, d, q.data() + p * l * d, d, kp.data() + p * kp_size, s.data(), l, 1.0f, false);
            Eigen::Map<mat> sm(s.data(), l, l);
            sm = sm.array().exp();
            cpu::float_to_bf16(s.data(), sb.data(), l * l);
            cpu::bf16_gemm(l, d, l, sb.data(), l, vp.data() + p * vp_size, o.data() + p * l * d, d, 1.0f, false);
        }
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
#else
    mat qf(l, d), kf(l, d), vf(l, d), sf(l, l);
    for (auto _ : state) {
        for (std::int64_t p = 0; p < planes; ++p) {
            cpu::bf16_to_float(q.data() + p * l * d, qf.data(), l * d);
            cpu::bf16_to_float(k.data() + p * l * d, kf.data(), l * d);
            cpu::bf16_to_float(v.data() + p * l * d, vf.data(), l * d);
            sf.noalias() = qf * kf.transpose();
            sf = sf.array().exp();
            cpu::float_to_bf16(sf.data(), sb.data(), l * l);
            cpu::bf16_to_float(sb.data(), sf.data(), l * l);
            Eigen::Map<mat>(o.data() + p * l * d, l, d).noalias() = sf * vf;
        }
        benchmark::DoNotOptimize(o.data());
        benchmark::ClobberMemory();
    }
#endif
    state.SetItemsProcessed(state.iterations() * planes * l * l);
    state.counters["L"] = static_cast<double>(l);
    state.SetLabel(cpu::bf16_isa());
}

const bool registered = [] {
    benchmark::RegisterBenchmark("floor/attention/deit_s", floor_attention, 8, 6, 14, 14, 64, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("floor/attention/deit_s/bf16", floor_attention_bf16, 8, 6, 14, 14, 64)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("floor/attention_fwd_bwd/deit_s", floor_attention, 8, 6, 14, 14, 64, true)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("floor/attention/digits", floor_attention, 16, 4, 8, 8, 16, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
#if defined(__AVX512F__)
    benchmark::RegisterBenchmark("floor/attention/deit_s/rpe_gemm", floor_attention_rpe_gemm, 8, 6, 14, 14, 64, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("floor/attention_fwd_bwd/deit_s/rpe_gemm", floor_attention_rpe_gemm, 8, 6, 14, 14, 64, true)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("floor/attention/digits/rpe_gemm", floor_attention_rpe_gemm, 16, 4, 8, 8, 16, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
#endif
    benchmark::RegisterBenchmark("floor/attention/grid64", floor_attention, 1, 1, 64, 64, 64, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    struct shape {
        const char* name;
        int b, h, height, width, d;
    };
    for (const shape s : {shape{"deit_s", 8, 6, 14, 14, 64}, shape{"grid56", 1, 6, 56, 56, 64}, shape{"grid64", 1, 1, 64, 64, 64},
                          shape{"digits", 16, 4, 8, 8, 16}})
        for (const char* on : {"none", "k", "qkv"}) {
            const attention_config c{s.b, s.h, s.height, s.width, s.d, std::string(on) == "none" ? "" : on, ""};
            const std::string tail = std::string(s.name) + "/" + on;
            benchmark::RegisterBenchmark(("attention/" + tail).c_str(), run, c, what::forward)
                ->Unit(benchmark::kMillisecond)
                ->UseRealTime();
            benchmark::RegisterBenchmark(("attention_fwd_bwd/" + tail).c_str(), run, c, what::forward_backward)
                ->Unit(benchmark::kMillisecond)
                ->UseRealTime();
            if (std::string(s.name) == "deit_s") {
                benchmark::RegisterBenchmark(("attention_composed/" + tail).c_str(), run, c, what::composed)
                    ->Unit(benchmark::kMillisecond)
                    ->UseRealTime();
                benchmark::RegisterBenchmark(("attention_fwd_bwd/" + tail + "/saved_attn").c_str(), run, c,
                                             what::forward_backward_saved)
                    ->Unit(benchmark::kMillisecond)
                    ->UseRealTime();
                benchmark::RegisterBenchmark(("attention/" + tail + "/bf16").c_str(), run_bf16, c)
                    ->Unit(benchmark::kMillisecond)
                    ->UseRealTime();
            }
        }
    // 2D RoPE on q and k, DeiT-S shapes (targets, one thread: rope ≤ 1.15x and rope_k ≤ 1.25x of
    // attention/deit_s/none; docs/rope.md)
    for (const auto& [name, on, form] :
         {std::array<const char*, 3>{"rope", "", "axial"}, std::array<const char*, 3>{"rope_k", "k", "axial"},
          std::array<const char*, 3>{"rope_mixed", "", "mixed"}}) {
        const attention_config c{8, 6, 14, 14, 64, on, form};
        benchmark::RegisterBenchmark((std::string("attention/deit_s/") + name).c_str(), run, c, what::forward)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark((std::string("attention_fwd_bwd/deit_s/") + name).c_str(), run, c, what::forward_backward)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
    // The newer rotary forms (forward; target ≤ 1.05x attention/deit_s/none) and per-token
    // positions equal to the grid (target ≤ 1.05x the grid case: rope_positions against rope,
    // k_positions against k; rope_mrope takes (0, row, col) position ids).
    for (const auto& [name, on, form, at_positions] :
         {std::tuple<const char*, const char*, const char*, bool>{"rope_cat", "", "cat", false},
          std::tuple<const char*, const char*, const char*, bool>{"rope_dinov3", "", "dinov3", false},
          std::tuple<const char*, const char*, const char*, bool>{"rope_mrope", "", "mrope", true},
          std::tuple<const char*, const char*, const char*, bool>{"rope_positions", "", "axial", true},
          std::tuple<const char*, const char*, const char*, bool>{"k_positions", "k", "", true}}) {
        attention_config c{8, 6, 14, 14, 64, on, form};
        c.positions = at_positions;
        benchmark::RegisterBenchmark((std::string("attention/deit_s/") + name).c_str(), run, c, what::forward)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
    // The backward under a 16 MiB budget of partials on the 64 x 64 grid (about 90 MB without):
    // the cost of running its 32 items in waves (same results; partials_bytes counter).
    {
        attention_config c{1, 1, 64, 64, 64, "qkv", ""};
        c.budget = std::int64_t{16} << 20;
        benchmark::RegisterBenchmark("attention_fwd_bwd/grid64/qkv/budget_16MiB", run, c, what::forward_backward)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    }
    // packed4: 4 images in one sequence; packed4_each: the same images as 4 calls (their sum)
    for (const bool backward : {false, true})
        for (const bool each : {false, true}) {
            const std::string name =
                std::string(backward ? "attention_fwd_bwd/" : "attention/") + (each ? "packed4_each/k" : "packed4/k");
            benchmark::RegisterBenchmark(name.c_str(), run_packed, each, backward)->Unit(benchmark::kMillisecond)->UseRealTime();
        }
    // A 128 x 128 grid (L = 16385): the automatic id storage computes ids on the fly (an (L, L)
    // table would be 268 MB), one head, forward only.
    for (const char* on : {"none", "k"}) {
        const attention_config c{1, 1, 128, 128, 32, std::string(on) == "none" ? "" : on, ""};
        benchmark::RegisterBenchmark(("attention/grid128_on_the_fly/" + std::string(on)).c_str(), run, c, what::forward)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(1);
    }
    return true;
}();

}  // namespace
}  // namespace rpe_bench_attention
