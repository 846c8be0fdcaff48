// 2D rotary position embedding on the GPU against the CPU implementation on the same inputs:
// the standalone rotation (rpe::cuda::rope_forward / rope_backward, the mixed frequencies'
// gradient included) for RoPE-Axial, RoPE-Mixed and timm's RotaryEmbeddingCat with skip tokens
// in float, double and fp16; the fused CUDA attention with attention_inputs::rope (alone, with
// an iRPE-K term, with iRPE on q, k, v and key padding) forward and backward in float and double;
// suffix tokens, per-token positions (every 2D form, rope::mrope, the keys at their own
// positions in the attention), the device table cache; and, host-side (no device needed), bad
// RoPE inputs through the CUDA entry points raising the CPU's exception with the CPU's message.
#include <doctest/doctest.h>

#include <rpe/cuda.cuh>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rope/mrope.hpp>
#include <rpe/rope/positions.hpp>
#include <rpe/rope/vjepa2.hpp>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attention_instances.cuh"
#include "cuda_test.cuh"

namespace {

using namespace rpe_cuda_test;

// 0: RoPE-Axial (rope-vit, θ = 100); 1: RoPE-Mixed (learned frequencies); 2: timm's cat in
// EVA-02's configuration with a reference grid; 3: timm's cat in pixels, 'xy' indexing;
// 4: DINOv3 (rope::custom, half layout); 5: rope::mrope sections (2, 2, 2) (3-axis positions,
// half layout, D = 12); 6: RoPE-Axial through rope::custom; 7: V-JEPA 2 (its own layout, 3-axis
// positions, D = 14: slices of 4 channels, the last 2 channels copied).
rpe::rope_form form_of(int form) {
    switch (form) {
        case 0: return rpe::rope::axial{.theta = 100.0f};
        case 1: return rpe::rope::mixed{};
        case 2: return rpe::rope::cat{.ref_height = 2, .ref_width = 3};
        case 4: return rpe::rope::custom{rpe::rope::dinov3{}};
        case 5: return rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2}};
        case 6: return rpe::rope::custom{rpe::rope::axial{.theta = 10.0f}};
        case 7: return rpe::rope::custom{rpe::rope::vjepa2{}};
        default: return rpe::rope::cat{.in_pixels = true, .xy_indexing = true};
    }
}
rpe::rope::layout layout_of(int form) {
    if (form == 7) return rpe::rope::layout::vjepa2;
    return form == 4 || form == 5 ? rpe::rope::layout::half : rpe::rope::layout::pairs;
}
int axes_of(int form) { return form == 5 || form == 7 ? 3 : 2; }

// n random per-token positions of `axes` coordinates, real-valued in [−1, 4) (seeded).
std::vector<float> random_positions(std::int64_t n, int axes, unsigned seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.f, 4.f);
    std::vector<float> p(static_cast<std::size_t>(n * axes));
    for (auto& v : p) v = dist(gen);
    return p;
}

// The comparison rule of test_cuda_attention.cu: tolerance eps·rms(expected) + eps·|expected|,
// eps = c·u·√len (c = 4 for fp16/bf16, 16 otherwise).
template <class S, class C>
void check_vs(const std::string& what, const std::vector<double>& gpu, const std::vector<C>& cpu, double len) {
    const bool low = std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
    const double e = (low ? 4.0 : 16.0) * rpe::cuda::unit_roundoff<S>() * std::sqrt(len);
    std::vector<double> ex(cpu.begin(), cpu.end());
    double ss = 0;
    for (double x : ex) ss += x * x;
    check_close(what, gpu, ex, e * std::sqrt(ss / static_cast<double>(std::max<std::size_t>(ex.size(), 1))), e);
}

struct rope_config {
    int form = 0;
    int skip = 1, batch = 2, heads = 3, dim = 8, height = 3, width = 4;
    int suffix = 0;          // trailing unrotated tokens
    bool positions = false;  // random per-token positions (height·width of them) instead of the grid
};

// Standalone rotation: forward and backward (grad_freqs for mixed) on the GPU against the CPU
// (same type for float and double; float on the fp16-rounded inputs for fp16).
template <class S>
void compare_rope(const rope_config& cfg, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const std::int64_t n = cfg.height * cfg.width, b = cfg.batch, h = cfg.heads, l = cfg.skip + n + cfg.suffix, d = cfg.dim;
    INFO("form " << cfg.form << ", skip " << cfg.skip << ", suffix " << cfg.suffix << ", positions " << cfg.positions << ", grid "
                 << cfg.height << "x" << cfg.width << ", D " << d << ", S " << sizeof(S) << " bytes");
    const int axes = axes_of(cfg.form);
    const std::vector<std::int64_t> pshape{n, axes};
    const auto pos = random_positions(n, axes, seed + 4);
    const std::vector<std::int64_t> shape{b, h, l, d}, fshape{2, h, d / 2};
    const auto x = round_through<S>(random_floats(b * h * l * d, seed + 1));
    const auto gy = round_through<S>(random_floats(b * h * l * d, seed + 2));
    const auto f = round_through<S>(random_floats(2 * h * d / 2, seed + 3, 0.6f));
    const bool mixed = cfg.form == 1;

    // CPU
    auto cv = [](const std::vector<float>& v) { return std::vector<C>(v.begin(), v.end()); };
    const auto cx = cv(x), cgy = cv(gy), cf = cv(f);
    std::vector<C> cy(cx.size()), cgx(cx.size()), cgf(cf.size(), C(-7));
    rpe::rotary_embedding<C> cr{.form = form_of(cfg.form), .skip = cfg.skip};
    cr.layout = layout_of(cfg.form);
    cr.suffix = cfg.suffix;
    if (cfg.positions) cr.positions = view<const float>(pos.data(), pshape);
    if (mixed) {
        cr.freqs = view<const C>(cf.data(), fshape);
        cr.grad_freqs = view<C>(cgf.data(), fshape);
    }
    rpe::rope_forward(cr, cfg.height, cfg.width, view<const C>(cx.data(), shape), view<C>(cy.data(), shape));
    rpe::rope_backward(cr, cfg.height, cfg.width, view<const C>(cx.data(), shape), view<const C>(cgy.data(), shape),
                       view<C>(cgx.data(), shape));

    // GPU (outputs poisoned first)
    device_vec<S> dx(to_storage<S>(x)), dgy(to_storage<S>(gy)), df(to_storage<S>(f));
    device_vec<S> dy(to_storage<S>(std::vector<float>(x.size(), 99.f))), dgx(to_storage<S>(std::vector<float>(x.size(), 99.f))),
        dgf(to_storage<S>(std::vector<float>(f.size(), 99.f)));
    device_vec<float> dpos(pos);
    rpe::rotary_embedding<S> gr{.form = form_of(cfg.form), .skip = cfg.skip};
    gr.layout = layout_of(cfg.form);
    gr.suffix = cfg.suffix;
    if (cfg.positions) gr.positions = dpos.cref(pshape);  // device memory
    if (mixed) {
        gr.freqs = df.cref(fshape);
        gr.grad_freqs = dgf.ref(fshape);
    }
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::rope_forward(gr, cfg.height, cfg.width, dx.cref(shape), dy.ref(shape), stream);
    rpe::cuda::rope_backward(gr, cfg.height, cfg.width, dx.cref(shape), dgy.cref(shape), dgx.ref(shape), stream);
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    check_vs<S>("y", to_double(dy.host()), cy, 4.0);  // a rotation: a few roundings per element
    check_vs<S>("grad_x", to_double(dgx.host()), cgx, 4.0);
    if (mixed) check_vs<S>("grad_freqs", to_double(dgf.host()), cgf, static_cast<double>(b * l));
    // the skip and suffix tokens are copied exactly, the others rotated (a test that ignored RoPE would fail)
    const auto y = to_double(dy.host());
    for (std::size_t i = 0; i < static_cast<std::size_t>(cfg.skip * d); ++i) CHECK(y[i] == static_cast<double>(x[i]));
    const auto gx = to_double(dgx.host());
    for (std::int64_t p = 0; p < b * h; ++p)
        for (auto i = static_cast<std::size_t>((p * l + cfg.skip + n) * d); i < static_cast<std::size_t>((p + 1) * l * d); ++i) {
            CHECK(y[i] == static_cast<double>(x[i]));
            CHECK(gx[i] == static_cast<double>(gy[i]));
        }
    double moved = 0;
    for (std::size_t i = 0; i < y.size(); ++i) moved = std::max(moved, std::fabs(y[i] - static_cast<double>(x[i])));
    CHECK(moved > 0.01);  // mrope's h and w pairs turn slowly: about 0.05 on a 3 x 4 grid
}

struct rope_attn_config {
    int form = 0;
    std::string on;  // iRPE terms: subset of "qkv" (contextual product, shared heads)
    bool padding = false;
    int skip = 1, batch = 2, heads = 2, dim = 16, height = 3, width = 4;
    int suffix = 0;              // trailing unrotated tokens
    bool positions = false;      // queries at random per-token positions (height·width of them)
    bool key_positions = false;  // keys at other random positions
    int key_tokens = -1;         // with key_positions: that many keys (L_k = skip + key_tokens + suffix), -1: height·width
    int query_suffix = -1;       // the queries' unrotated trailing tokens (rotary_embedding::query_suffix), -1: suffix
};

// The fused CUDA attention with RoPE (and iRPE terms) against the CPU fused attention.
template <class S>
void compare_rope_attention(const rope_attn_config& cfg, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const std::int64_t n = cfg.height * cfg.width, nk = cfg.key_tokens < 0 ? n : cfg.key_tokens, b = cfg.batch, h = cfg.heads,
                       d = cfg.dim;
    const std::int64_t l = cfg.skip + n + (cfg.query_suffix < 0 ? cfg.suffix : cfg.query_suffix), lk = cfg.skip + nk + cfg.suffix;
    INFO("form " << cfg.form << ", on '" << cfg.on << "', padding " << cfg.padding << ", L " << l << ", L_k " << lk << ", D " << d
                 << ", suffix " << cfg.suffix << ", query_suffix " << cfg.query_suffix << ", positions " << cfg.positions
                 << ", key_positions " << cfg.key_positions << ", S " << sizeof(S) << " bytes");
    const int axes = axes_of(cfg.form);
    const std::vector<std::int64_t> pshape{n, axes}, kpshape{nk, axes};
    const auto qpos = random_positions(n, axes, seed + 6), kpos = random_positions(nk, axes, seed + 7);
    const std::vector<std::int64_t> shape{b, h, l, d}, kshape{b, h, lk, d}, fshape{2, h, d / 2};
    const auto q = random_floats(b * h * l * d, seed + 1), k = random_floats(b * h * lk * d, seed + 2),
               v = random_floats(b * h * lk * d, seed + 3), go = random_floats(b * h * l * d, seed + 4),
               f = random_floats(2 * h * d / 2, seed + 5, 0.6f);
    const bool mixed = cfg.form == 1;
    std::vector<std::uint8_t> mask;
    if (cfg.padding) {
        mask.assign(static_cast<std::size_t>(b * lk), 0);
        for (std::int64_t j = lk - 3; j < lk; ++j) mask[static_cast<std::size_t>(j)] = 1;  // batch 0: 3 padded keys
    }
    std::unique_ptr<rpe::any_term<float>> cfg_terms[3];
    std::unique_ptr<rpe::any_term<C>> cpu_terms[3];
    std::vector<float> tables[3];
    const char letters[3] = {'q', 'k', 'v'};
    for (int s = 0; s < 3; ++s) {
        if (cfg.on.find(letters[s]) == std::string::npos) continue;
        rpe::term_spec spec;
        spec.method = rpe::method::product;
        spec.contextual = true;
        spec.target = rpe::parse_target(std::string(1, letters[s]));
        spec.ratio(1.9);
        spec.skip = cfg.skip;
        spec.num_heads = cfg.heads;
        spec.head_dim = cfg.dim;
        cfg_terms[s] = rpe::make_term<float>(spec);
        cpu_terms[s] = rpe::make_term<C>(spec);
        tables[s] = random_floats(count(cfg_terms[s]->table_shape()), seed + 10 + static_cast<unsigned>(s), 0.5f);
    }

    // CPU
    auto cv = [](const std::vector<float>& x) { return std::vector<C>(x.begin(), x.end()); };
    const auto cq = cv(q), ck = cv(k), cvv = cv(v), cgo = cv(go), cf = cv(f);
    std::vector<C> ctables[3], cgtables[3];
    rpe::attention_inputs<C> cin;
    cin.q = view<const C>(cq.data(), shape);
    cin.k = view<const C>(ck.data(), kshape);
    cin.v = view<const C>(cvv.data(), kshape);
    cin.height = cfg.height;
    cin.width = cfg.width;
    if (!mask.empty()) cin.key_padding_mask = view<const std::uint8_t>(mask.data(), {b, lk});
    std::vector<C> cgf(f.size(), C(-7));
    cin.rope = {.form = form_of(cfg.form), .skip = cfg.skip};
    cin.rope.layout = layout_of(cfg.form);
    cin.rope.suffix = cfg.suffix;
    cin.rope.query_suffix = cfg.query_suffix;
    if (cfg.positions) cin.rope.positions = view<const float>(qpos.data(), pshape);
    if (cfg.key_positions) cin.rope.key_positions = view<const float>(kpos.data(), kpshape);
    if (mixed) {
        cin.rope.freqs = view<const C>(cf.data(), fshape);
        cin.rope.grad_freqs = view<C>(cgf.data(), fshape);
    }
    rpe::attention_term<C>* cslots[3] = {&cin.rpe_q, &cin.rpe_k, &cin.rpe_v};
    for (int s = 0; s < 3; ++s) {
        if (!cpu_terms[s]) continue;
        ctables[s] = cv(tables[s]);
        cgtables[s].assign(tables[s].size(), C(-7));
        cslots[s]->term = cpu_terms[s].get();
        cslots[s]->tables.push_back(view<const C>(ctables[s].data(), cpu_terms[s]->table_shape()));
        cslots[s]->grad_tables.push_back(view<C>(cgtables[s].data(), cpu_terms[s]->table_shape()));
    }
    std::vector<C> cout(q.size()), cgq(q.size()), cgk(k.size()), cgv(k.size());
    rpe::attention_forward(cin, view<C>(cout.data(), shape));
    rpe::attention_backward(cin, view<const C>(cgo.data(), shape), view<C>(cgq.data(), shape), view<C>(cgk.data(), kshape),
                            view<C>(cgv.data(), kshape));

    // GPU
    device_vec<S> dq(to_storage<S>(q)), dk(to_storage<S>(k)), dv(to_storage<S>(v)), dgo(to_storage<S>(go)), df(to_storage<S>(f));
    const std::vector<float> poison(q.size(), 99.f), kpoison(k.size(), 99.f);
    device_vec<S> dout(to_storage<S>(poison)), dgq(to_storage<S>(poison)), dgk(to_storage<S>(kpoison)),
        dgv(to_storage<S>(kpoison)), dgf(to_storage<S>(std::vector<float>(f.size(), 99.f)));
    device_vec<std::uint8_t> dmask(mask);
    std::vector<std::unique_ptr<device_vec<S>>> dtables, dgtables;
    rpe::cuda::attention_inputs<S> gin;
    gin.q = dq.cref(shape);
    gin.k = dk.cref(kshape);
    gin.v = dv.cref(kshape);
    gin.height = cfg.height;
    gin.width = cfg.width;
    if (!mask.empty()) gin.key_padding_mask = dmask.cref({b, lk});
    device_vec<float> dqpos(qpos), dkpos(kpos);
    gin.rope = {.form = form_of(cfg.form), .skip = cfg.skip};
    gin.rope.layout = layout_of(cfg.form);
    gin.rope.suffix = cfg.suffix;
    gin.rope.query_suffix = cfg.query_suffix;
    if (cfg.positions) gin.rope.positions = dqpos.cref(pshape);  // device memory
    if (cfg.key_positions) gin.rope.key_positions = dkpos.cref(kpshape);
    if (mixed) {
        gin.rope.freqs = df.cref(fshape);
        gin.rope.grad_freqs = dgf.ref(fshape);
    }
    rpe::cuda::attention_term<S>* gslots[3] = {&gin.rpe_q, &gin.rpe_k, &gin.rpe_v};
    for (int s = 0; s < 3; ++s) {
        if (!cfg_terms[s]) continue;
        gslots[s]->term = cfg_terms[s].get();
        dtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(tables[s])));
        gslots[s]->tables.push_back(dtables.back()->cref(cfg_terms[s]->table_shape()));
        dgtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(std::vector<float>(tables[s].size(), 99.f))));
        gslots[s]->grad_tables.push_back(dgtables.back()->ref(cfg_terms[s]->table_shape()));
    }
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::attention_forward(gin, dout.ref(shape), {}, {.stream = stream});
    rpe::cuda::attention_backward(gin, dgo.cref(shape), dgq.ref(shape), dgk.ref(kshape), dgv.ref(kshape), {.stream = stream});
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    const double len = static_cast<double>(d + std::max(l, lk));
    check_vs<S>("out", to_double(dout.host()), cout, len);
    check_vs<S>("grad_q", to_double(dgq.host()), cgq, len);
    check_vs<S>("grad_k", to_double(dgk.host()), cgk, len);
    check_vs<S>("grad_v", to_double(dgv.host()), cgv, len);
    if (mixed) check_vs<S>("grad_freqs", to_double(dgf.host()), cgf, static_cast<double>(b * l * lk));
    std::size_t u = 0;
    for (int s = 0; s < 3; ++s)
        if (cfg_terms[s])
            check_vs<S>(std::string("grad table ") + letters[s], to_double(dgtables[u++]->host()), cgtables[s],
                        static_cast<double>(b * h * l * lk));
}

}  // namespace

TEST_CASE_TEMPLATE("cuda rope_forward and rope_backward match the CPU rotation (mixed frequency gradient included)", S, float,
                   double, __half) {
    SUBCASE("axial, skip 1") { compare_rope<S>({.form = 0}, 400); }
    SUBCASE("mixed, skip 1") { compare_rope<S>({.form = 1}, 410); }
    SUBCASE("mixed, skip 0, D = 6, 4 x 5 grid") {
        compare_rope<S>({.form = 1, .skip = 0, .dim = 6, .height = 4, .width = 5}, 420);
    }
    SUBCASE("cat (EVA-02, reference grid), skip 2") { compare_rope<S>({.form = 2, .skip = 2}, 430); }
    SUBCASE("cat in pixels, xy, skip 0, D = 16") {
        compare_rope<S>({.form = 3, .skip = 0, .dim = 16, .height = 5, .width = 3}, 440);
    }
    SUBCASE("mixed, larger: B 3, H 4, D 64, 7 x 7 grid") {
        compare_rope<S>({.form = 1, .batch = 3, .heads = 4, .dim = 64, .height = 7, .width = 7}, 450);
    }
    SUBCASE("suffix on the grid: axial, skip 1, suffix 3") { compare_rope<S>({.form = 0, .suffix = 3}, 460); }
    SUBCASE("suffix on the grid: mixed, skip 0, suffix 2") { compare_rope<S>({.form = 1, .skip = 0, .suffix = 2}, 465); }
    SUBCASE("dinov3 (custom, half layout) on the grid") { compare_rope<S>({.form = 4, .suffix = 1}, 470); }
    SUBCASE("mrope on the grid (ids (0, row, col)), D = 12") { compare_rope<S>({.form = 5, .dim = 12}, 475); }
    for (int form : {0, 1, 2, 3, 4, 6}) {
        SUBCASE(("2D form " + std::to_string(form) + " at random positions, skip 1, suffix 2").c_str()) {
            compare_rope<S>({.form = form, .suffix = 2, .positions = true}, 480 + static_cast<unsigned>(form));
        }
    }
    SUBCASE("mrope at random 3-axis positions, skip 2, suffix 1, D = 12") {
        compare_rope<S>({.form = 5, .skip = 2, .dim = 12, .suffix = 1, .positions = true}, 490);
    }
    SUBCASE("vjepa2 on the grid (ids (0, row, col)), D = 14, suffix 1") {
        compare_rope<S>({.form = 7, .dim = 14, .suffix = 1}, 496);
    }
    SUBCASE("vjepa2 at random 3-axis positions, D = 14, skip 0, suffix 2") {
        compare_rope<S>({.form = 7, .skip = 0, .dim = 14, .suffix = 2, .positions = true}, 497);
    }
    SUBCASE("mixed at random positions, larger: B 2, H 4, D 64, 49 tokens, skip 0, suffix 4") {
        compare_rope<S>({.form = 1, .skip = 0, .heads = 4, .dim = 64, .height = 7, .width = 7, .suffix = 4, .positions = true},
                        495);
    }
}

TEST_CASE_TEMPLATE("cuda fused attention with RoPE matches the CPU fused attention (forward, backward, frequency gradient)", S,
                   float, double) {
    SUBCASE("axial alone") { compare_rope_attention<S>({.form = 0}, 500); }
    SUBCASE("axial with iRPE-K") { compare_rope_attention<S>({.form = 0, .on = "k"}, 510); }
    SUBCASE("mixed alone") { compare_rope_attention<S>({.form = 1}, 520); }
    SUBCASE("mixed with iRPE-K") { compare_rope_attention<S>({.form = 1, .on = "k"}, 530); }
    SUBCASE("mixed with iRPE on q, k, v and key padding") {
        compare_rope_attention<S>({.form = 1, .on = "qkv", .padding = true}, 540);
    }
    SUBCASE("cat (EVA-02) alone, skip 0") { compare_rope_attention<S>({.form = 2, .skip = 0}, 550); }
    SUBCASE("cat (EVA-02) with iRPE-K, skip 2") { compare_rope_attention<S>({.form = 2, .on = "k", .skip = 2}, 560); }
    SUBCASE("mixed, larger: L = 50, D = 64, iRPE-K") {
        compare_rope_attention<S>({.form = 1, .on = "k", .batch = 1, .heads = 3, .dim = 64, .height = 7, .width = 7}, 570);
    }
    SUBCASE("axial on the grid with suffix 2") { compare_rope_attention<S>({.form = 0, .suffix = 2}, 580); }
    SUBCASE("mixed on the grid with suffix 3 and key padding") {
        compare_rope_attention<S>({.form = 1, .padding = true, .suffix = 3}, 585);
    }
    for (int form : {0, 1, 2, 4}) {
        SUBCASE(("form " + std::to_string(form) + ": queries and keys at their own positions, suffix 1").c_str()) {
            compare_rope_attention<S>({.form = form, .suffix = 1, .positions = true, .key_positions = true},
                                      590 + static_cast<unsigned>(form));
        }
    }
    SUBCASE("mixed: queries at positions, keys the same") { compare_rope_attention<S>({.form = 1, .positions = true}, 600); }
    SUBCASE("mixed: queries on the grid, keys at positions") {
        compare_rope_attention<S>({.form = 1, .key_positions = true}, 605);
    }
    SUBCASE("vjepa2: queries and keys at 3-axis positions, D = 14") {
        compare_rope_attention<S>({.form = 7, .dim = 14, .positions = true, .key_positions = true}, 615);
    }
    SUBCASE("vjepa2 on the grid with suffix 2, D = 14") { compare_rope_attention<S>({.form = 7, .dim = 14, .suffix = 2}, 620); }
    SUBCASE("mrope: queries and keys at 3-axis positions, D = 12") {
        compare_rope_attention<S>({.form = 5, .dim = 12, .positions = true, .key_positions = true}, 610);
    }
    // keys of another count than the queries (L_k != L)
    SUBCASE("SAM2 memory attention: axial, queries the 3 x 4 grid, keys the grid 3 times + 4 unrotated pointer tokens") {
        compare_rope_attention<S>({.form = 0, .skip = 0, .suffix = 4, .key_positions = true, .key_tokens = 36, .query_suffix = 0},
                                  630);
    }
    SUBCASE("mixed (frequency gradient): queries at positions with suffix 1, 7 keys at positions with suffix 2, key padding") {
        compare_rope_attention<S>({.form = 1,
                                   .padding = true,
                                   .suffix = 2,
                                   .positions = true,
                                   .key_positions = true,
                                   .key_tokens = 7,
                                   .query_suffix = 1},
                                  635);
    }
    SUBCASE("vjepa2: 40 keys at 3-axis positions against 12 queries at theirs, D = 14") {
        compare_rope_attention<S>({.form = 7, .dim = 14, .positions = true, .key_positions = true, .key_tokens = 40}, 640);
    }
}

TEST_CASE("cuda rope: the fixed forms' device tables are uploaded once per (policy, D, grid, type)") {
    auto& cache = rpe::cuda::device_rope_cache::global();
    cache.clear();
    const std::vector<std::int64_t> shape{1, 2, 13, 8}, other{1, 2, 17, 8};
    device_vec<float> x(2 * 13 * 8), y(2 * 13 * 8), x2(2 * 17 * 8), y2(2 * 17 * 8);
    const rpe::rotary_embedding<float> r{.form = rpe::rope::axial{.theta = 100.0f}, .skip = 1};
    rpe::cuda::rope_forward(r, 3, 4, x.cref(shape), y.ref(shape));
    rpe::cuda::rope_forward(r, 3, 4, x.cref(shape), y.ref(shape));
    CHECK(cache.builds() == 1);
    rpe::cuda::rope_forward(r, 4, 4, x2.cref(other), y2.ref(other));  // another grid
    CHECK(cache.builds() == 2);
    const rpe::rotary_embedding<float> r2{.form = rpe::rope::axial{.theta = 10.0f}, .skip = 1};
    rpe::cuda::rope_forward(r2, 3, 4, x.cref(shape), y.ref(shape));  // another θ
    CHECK(cache.builds() == 3);
    CHECK(cache.size() == 3);
    RPE_CUDA_CHECK(cudaDeviceSynchronize());
}

// Host-side: every bad RoPE input fails in the shared checks before any CUDA call, so the host
// pointers below never reach a kernel, and the CUDA entry points must raise the CPU's exception
// with the CPU's message (CTest cuda.host_checks runs this suite without a device).
namespace {

template <class Cpu, class Gpu>
void same_error(Cpu&& cpu, Gpu&& gpu, const std::string& expected) {
    std::string cm = "(no exception)", gm = "(no exception)";
    try {
        cpu();
    } catch (const rpe::invalid_argument& e) {
        cm = e.what();
    }
    try {
        gpu();
    } catch (const rpe::invalid_argument& e) {
        gm = e.what();
    }
    INFO("expected '" << expected << "'");
    CHECK(cm.find(expected) != std::string::npos);
    CHECK(gm == cm);
}

}  // namespace

TEST_SUITE("host") {
TEST_CASE("cuda attention rejects bad RoPE inputs with the CPU attention's exceptions") {
    const std::int64_t b = 2, h = 2, l = 13, d = 8;
    const std::vector<std::int64_t> shape{b, h, l, d}, fshape{2, h, d / 2};
    const auto q = random_floats(b * h * l * d, 1), f = random_floats(2 * h * d / 2, 2);
    std::vector<float> out(q.size()), gq(q.size()), gk(q.size()), gv(q.size()), gf(f.size()), go(q.size());
    const auto base = [&](auto& in) {
        using S = float;
        in.q = view<const S>(q.data(), shape);
        in.k = view<const S>(q.data(), shape);
        in.v = view<const S>(q.data(), shape);
        in.height = 3;
        in.width = 4;
        in.rope.form = rpe::rope::axial{.theta = 100.0f};
        in.rope.skip = 1;
    };
    // each mutation (a generic lambda) applied to a CPU and a CUDA input, then forward or backward on both
    const auto check = [&](auto&& mutate, const std::string& expected, bool backward) {
        rpe::attention_inputs<float> cin;
        rpe::cuda::attention_inputs<float> gin;
        base(cin);
        base(gin);
        mutate(cin);
        mutate(gin);
        if (!backward) {
            same_error([&] { rpe::attention_forward(cin, view<float>(out.data(), shape)); },
                       [&] { rpe::cuda::attention_forward(gin, view<float>(out.data(), shape)); }, expected);
        } else {
            same_error(
                [&] {
                    rpe::attention_backward(cin, view<const float>(go.data(), shape), view<float>(gq.data(), shape),
                                            view<float>(gk.data(), shape), view<float>(gv.data(), shape));
                },
                [&] {
                    rpe::cuda::attention_backward(gin, view<const float>(go.data(), shape), view<float>(gq.data(), shape),
                                                  view<float>(gk.data(), shape), view<float>(gv.data(), shape));
                },
                expected);
        }
    };
    const auto mixed = [&](auto& in) {
        in.rope.form = rpe::rope::mixed{};
        in.rope.freqs = view<const float>(f.data(), fshape);
    };
    check([](auto& in) { in.rope.form = rpe::rope::axial{.theta = -2.0f}; }, "[rpe.rope] theta = -2", false);
    check([](auto& in) { in.rope.form = rpe::rope::cat{.temperature = 0.0f}; }, "temperature = 0", false);
    check([](auto& in) { in.rope.form = rpe::rope::cat{.ref_height = 3}; }, "ref_height, ref_width = 3, 0", false);
    check([](auto& in) { in.rope.skip = 2; }, "[rpe.attention] L = 13; expected rope skip + height*width = 2 + 3*4", false);
    check([](auto& in) { in.rope.skip = -1; }, "rope skip = -1", false);
    check(
        [](auto& in) {
            in.depth = 2;
            in.width = 2;
        },
        "rope needs a 2D grid; depth = 2", false);
    check([](auto& in) { in.rope.form = rpe::rope::mixed{}; }, "rope freqs", false);
    check(
        [&](auto& in) {
            mixed(in);
            in.rope.freqs = view<const float>(f.data(), {2, h * d / 2});
        },
        "rope freqs has shape (2, 8)", false);
    check([&](auto& in) { in.rope.freqs = view<const float>(f.data(), fshape); },
          "rope freqs is given for a fixed-frequency form", false);
    check(
        [&](auto& in) {
            mixed(in);
            in.rope.freqs = view<const float>(out.data(), fshape);
        },
        "out overlaps rope freqs", false);
    check([&](auto& in) { in.rope.grad_freqs = view<float>(gf.data(), fshape); },
          "rope grad_freqs is given for a fixed-frequency form", true);
    check(
        [&](auto& in) {
            mixed(in);
            in.rope.grad_freqs = view<float>(gq.data(), shape);
        },
        "rope grad_freqs has shape (2, 2, 13, 8)", true);
    check(
        [&](auto& in) {
            mixed(in);
            in.rope.grad_freqs = view<float>(gk.data(), fshape);
        },
        "rope grad_freqs overlaps grad_k", true);
    check(
        [&](auto& in) {
            mixed(in);
            in.rope.grad_freqs = view<float>(const_cast<float*>(f.data()), fshape);
        },
        "rope grad_freqs overlaps rope freqs", true);
}

TEST_CASE("cuda attention refuses strided q, k, v (which the CPU attention reads in place): not supported") {
    const std::int64_t b = 2, h = 2, l = 13, d = 8;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto qkv = random_floats(b * l * 3 * h * d, 3);
    std::vector<float> out(static_cast<std::size_t>(b * h * l * d));
    rpe::cuda::attention_inputs<float> in;
    const auto packed = [&](int t) {
        return rpe::tensor_ref<const float>::with_strides(qkv.data() + t * h * d, {b, h, l, d}, {l * 3 * h * d, d, 3 * h * d, 1});
    };
    in.q = packed(0);
    in.k = view<const float>(qkv.data(), shape);
    in.v = view<const float>(qkv.data(), shape);
    in.height = 3;
    in.width = 4;
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, view<float>(out.data(), shape)),
                         doctest::Contains("[rpe.attention] q is a strided view (shape (2, 2, 13, 8), strides (624, 8, 48, 1)); "
                                           "strided q, k, v views are not supported by the cuda backend"),
                         rpe::not_supported);
}

TEST_CASE("cuda rope_forward and rope_backward reject bad inputs with the CPU rotation's exceptions") {
    const std::vector<std::int64_t> odd{1, 1, 13, 6}, ok{1, 1, 13, 8}, rank3{13, 6, 1}, fshape{2, 1, 4};
    std::vector<float> x6(78), y6(78), x8(104), y8(104), g8(104), f(8), gf(8);
    rpe::rotary_embedding<float> r{.form = rpe::rope::axial{}, .skip = 1};
    const auto fwd = [&](const std::vector<std::int64_t>& xs, float* x, const std::vector<std::int64_t>& ys, float* y, int height,
                         const std::string& expected) {
        same_error([&] { rpe::rope_forward(r, height, 4, view<const float>(x, xs), view<float>(y, ys)); },
                   [&] { rpe::cuda::rope_forward(r, height, 4, view<const float>(x, xs), view<float>(y, ys)); }, expected);
    };
    fwd(odd, x6.data(), odd, y6.data(), 3, "[rpe.rope] rope needs head_dim D = 6 to be a positive multiple of 4");
    fwd(ok, x8.data(), ok, x8.data(), 3, "y overlaps x");
    fwd(ok, x8.data(), ok, y8.data(), 4, "L = 13");
    fwd(rank3, x6.data(), odd, y6.data(), 3, "x has shape (13, 6, 1)");
    fwd(ok, x8.data(), odd, y6.data(), 3, "y has shape (1, 1, 13, 6)");
    const auto bwd = [&](const std::vector<std::int64_t>& gs, const std::string& expected) {
        same_error(
            [&] {
                rpe::rope_backward(r, 3, 4, view<const float>(x8.data(), ok), view<const float>(g8.data(), gs),
                                   view<float>(y8.data(), ok));
            },
            [&] {
                rpe::cuda::rope_backward(r, 3, 4, view<const float>(x8.data(), ok), view<const float>(g8.data(), gs),
                                         view<float>(y8.data(), ok));
            },
            expected);
    };
    bwd(odd, "grad_y has shape");
    r.grad_freqs = view<float>(gf.data(), fshape);
    bwd(ok, "rope grad_freqs is given for a fixed-frequency form");
    r.form = rpe::rope::mixed{};
    r.freqs = view<const float>(f.data(), fshape);
    r.grad_freqs = view<float>(y8.data(), fshape);
    bwd(ok, "rope grad_freqs overlaps grad_x");
    r.grad_freqs = view<float>(gf.data(), {2, 4});
    bwd(ok, "rope grad_freqs has shape (2, 4)");
}

TEST_CASE(
    "cuda attention: what the backend lacks (attn output, saved probabilities) is rpe::not_supported, before any CUDA call") {
    const std::int64_t b = 1, h = 2, l = 10, d = 8;
    const std::vector<std::int64_t> shape{b, h, l, d}, ashape{b, h, l, l};
    const auto x = random_floats(b * h * l * d, 5);
    std::vector<float> out(x.size()), attn(static_cast<std::size_t>(b * h * l * l)), gq(x.size()), gk(x.size()), gv(x.size());
    rpe::attention_inputs<float> in;  // the same type as rpe::cuda::attention_inputs
    in.q = in.k = in.v = view<const float>(x.data(), shape);
    in.height = 2;
    in.width = 5;
    CHECK_FALSE(rpe::cuda::attention_caps.saved_probabilities);
    CHECK_FALSE(rpe::cuda::attention_caps.strided_qkv);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, view<float>(out.data(), shape), view<float>(attn.data(), ashape)),
                         "[rpe.attention] the attn output (probabilities) is not supported by the cuda backend",
                         rpe::not_supported);
    const rpe::attention_gradients<float> g{.grad_out = view<const float>(x.data(), shape),
                                            .grad_q = view<float>(gq.data(), shape),
                                            .grad_k = view<float>(gk.data(), shape),
                                            .grad_v = view<float>(gv.data(), shape),
                                            .saved_attn = view<const float>(attn.data(), ashape)};
    CHECK_THROWS_WITH_AS(
        rpe::cuda::attention_backward(in, g),
        "[rpe.attention] the backward from saved probabilities (saved_attn) is not supported by the cuda backend",
        rpe::not_supported);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, view<float>(out.data(), shape), {}, {.scale = std::nan("")}),
                         doctest::Contains("[rpe.attention] options.scale = "), rpe::invalid_argument);
}

TEST_CASE("cuda rope: bad positions, key_positions and suffix raise the CPU's exceptions before any CUDA call") {
    const std::int64_t l = 7, d = 12;
    const std::vector<std::int64_t> shape{1, 1, l, d};
    const auto x = random_floats(l * d, 9);
    std::vector<float> y(x.size()), pos3(static_cast<std::size_t>(3 * l), 1.0f), pos2(static_cast<std::size_t>(2 * l), 1.0f);
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{rpe::rope::mrope{.section_t = 2, .section_h = 2, .section_w = 2}}};
    r.layout = rpe::rope::layout::half;
    const auto fwd = [&](const std::string& expected) {
        same_error([&] { rpe::rope_forward(r, 1, 1, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
                   [&] { rpe::cuda::rope_forward(r, 1, 1, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
                   expected);
    };
    r.positions = view<const float>(pos2.data(), {l, 2});
    fwd("rope positions has shape (7, 2); expected 3 axes (t, h, w)");
    r.positions = view<const float>(pos3.data(), {l - 1, 3});
    fwd("rope positions has shape (6, 3)");
    pos3[4] = std::nanf("");
    r.positions = view<const float>(pos3.data(), {l, 3});
    fwd("rope positions[1, 1] = nan; expected finite");
    pos3[4] = 1.0f;
    r.key_positions = view<const float>(pos3.data(), {l, 3});
    fwd("rope key_positions is given to a standalone rotation");
    r.key_positions = {};
    r.suffix = -1;
    fwd("rope suffix = -1");
    r.suffix = 2;  // then 5 rotated tokens: 7 positions are too many
    fwd("rope positions has shape (7, 3)");
    r.form = rpe::rope::axial{};
    r.layout = rpe::rope::layout::pairs;
    r.positions = view<const float>(pos2.data(), {l - 2, 2});
    r.suffix = 1;  // 6 rotated tokens
    fwd("rope positions has shape (5, 2)");
    r.positions = {};
    r.suffix = 2;
    same_error([&] { rpe::rope_forward(r, 2, 2, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
               [&] { rpe::cuda::rope_forward(r, 2, 2, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
               "L = 7; expected rope skip + height*width + suffix = 0 + 2*2 + 2");
    // the attention: a bad key_positions is the CPU attention's message too
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = view<const float>(x.data(), shape);
    in.height = 1;
    in.width = 7;
    in.rope = {.form = rpe::rope::axial{}};
    in.rope.key_positions = view<const float>(pos3.data(), {l, 3});
    same_error([&] { rpe::attention_forward(in, view<float>(y.data(), shape)); },
               [&] { rpe::cuda::attention_forward(in, view<float>(y.data(), shape)); },
               "rope key_positions has shape (7, 3); expected 2 axes (row, col)");
}

TEST_CASE("cuda rope: rope::vjepa2 in another layout raises the CPU's exception before any CUDA call") {
    const std::int64_t b = 1, h = 1, l = 6, d = 14;
    const std::vector<std::int64_t> shape{b, h, l, d};
    const auto x = random_floats(b * h * l * d, 10);
    std::vector<float> y(x.size());
    const auto pos = rpe::rope::grid_positions(2, 1, 3);
    rpe::rotary_embedding<float> r{.form = rpe::rope::custom{rpe::rope::vjepa2{}}};
    r.layout = rpe::rope::layout::pairs;
    r.positions = view<const float>(pos.data(), {l, 3});
    same_error([&] { rpe::rope_forward(r, 1, 1, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
               [&] { rpe::cuda::rope_forward(r, 1, 1, view<const float>(x.data(), shape), view<float>(y.data(), shape)); },
               "rope layout = pairs for a form that runs in its own layout");
}
}  // TEST_SUITE("host")
