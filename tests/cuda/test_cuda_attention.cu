// The fused CUDA attention forward and backward against the CPU fused attention
// (rpe::attention_forward / attention_backward, gradients of q, k, v and every table):
// random inputs with iRPE on q, k, v (contextual and bias, shared and per head, Cross, skip
// tokens, key padding mask with an all-masked row, additive attn_mask) in float, double, fp16
// and bf16; the iRPE terms at per-token positions (a permuted grid, key positions apart, 3D,
// Cross's two tables, positions in host memory) and valid key lengths (key_lengths) against the
// CPU fused attention given the same positions and lengths, in float and double; and the golden
// attention vectors' output in float32.
#include <doctest/doctest.h>

#include <rpe/cuda.cuh>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/product3d.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention_instances.cuh"
#include "cuda_test.cuh"
#include "golden_cases.hpp"

namespace {

using namespace rpe_cuda_test;

struct attn_config {
    std::string on;  // subset of "qkv"
    rpe::method method = rpe::method::product;
    bool contextual = true;
    bool shared = true;
    int skip = 1, batch = 2, heads = 2, dim = 16, height = 4, width = 5;
    bool padding = false, additive = false;
    double ratio = 1.9;
};

/// Attaches `term` to the GPU-side `slot`: its tables (`host`, each of term.table_shape()) copied
/// to the device as S, and gradient tables on the device filled with 99 (a table gradient the
/// backward leaves unwritten then fails the comparison). The device buffers are appended to
/// `dtables` and `dgtables`, which own them (in slot order: the checks read dgtables in turn).
template <class S>
void attach_device_tables(rpe::cuda::attention_term<S>& slot, const rpe::term_desc& term,
                          const std::vector<std::vector<float>>& host, std::vector<std::unique_ptr<device_vec<S>>>& dtables,
                          std::vector<std::unique_ptr<device_vec<S>>>& dgtables) {
    slot.term = &term;
    for (const auto& t : host) {
        dtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(t)));
        slot.tables.push_back(dtables.back()->cref(term.table_shape()));
        dgtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(std::vector<float>(t.size(), 99.f))));
        slot.grad_tables.push_back(dgtables.back()->ref(term.table_shape()));
    }
}

template <class S>
void compare_attention(const attn_config& cfg, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const std::int64_t b = cfg.batch, h = cfg.heads, l = cfg.skip + cfg.height * cfg.width, d = cfg.dim;
    INFO("on " << cfg.on << ", method " << static_cast<int>(cfg.method) << ", contextual " << cfg.contextual << ", L " << l
               << ", D " << d << ", S " << sizeof(S) << " bytes");
    const std::vector<std::int64_t> qshape{b, h, l, d};
    const auto q = random_floats(b * h * l * d, seed + 1), k = random_floats(b * h * l * d, seed + 2),
               v = random_floats(b * h * l * d, seed + 3);
    std::vector<std::uint8_t> mask;
    if (cfg.padding) {
        mask.assign(static_cast<std::size_t>(b * l), 0);
        for (std::int64_t j = l - 3; j < l; ++j) mask[static_cast<std::size_t>(j)] = 1;  // batch 0: 3 padded keys
        if (b > 1) std::fill(mask.begin() + l, mask.begin() + 2 * l, std::uint8_t{1});   // batch 1: all masked
    }
    std::vector<float> am;
    if (cfg.additive) am = random_floats(l * l, seed + 4, 0.5f);

    // terms (configuration, shared by both backends) and tables
    std::unique_ptr<rpe::any_term<float>> cfg_terms[3];
    std::unique_ptr<rpe::any_term<C>> cpu_terms[3];
    std::vector<std::vector<float>> tables[3];
    const char letters[3] = {'q', 'k', 'v'};
    for (int s = 0; s < 3; ++s) {
        if (cfg.on.find(letters[s]) == std::string::npos) continue;
        rpe::term_spec spec;
        spec.method = cfg.method;
        spec.contextual = cfg.contextual || s == 2;
        spec.target = rpe::parse_target(std::string(1, letters[s]));
        spec.ratio(cfg.ratio);
        spec.shared_head = cfg.shared;
        spec.skip = cfg.skip;
        spec.num_heads = cfg.heads;
        spec.head_dim = cfg.dim;
        cfg_terms[s] = rpe::make_term<float>(spec);
        cpu_terms[s] = rpe::make_term<C>(spec);
        const auto shape = cfg_terms[s]->table_shape();
        for (int t = 0; t < cfg_terms[s]->num_tables(); ++t)
            tables[s].push_back(random_floats(count(shape), seed + 10 + 3 * s + t, 0.5f));
    }

    // CPU
    auto cv = [](const std::vector<float>& x) { return std::vector<C>(x.begin(), x.end()); };
    const auto cq = cv(q), ck = cv(k), cvv = cv(v), cam = cv(am);
    std::vector<std::vector<C>> ctables[3];
    rpe::attention_inputs<C> cin;
    cin.q = view<const C>(cq.data(), qshape);
    cin.k = view<const C>(ck.data(), qshape);
    cin.v = view<const C>(cvv.data(), qshape);
    cin.height = cfg.height;
    cin.width = cfg.width;
    if (!mask.empty()) cin.key_padding_mask = view<const std::uint8_t>(mask.data(), {b, l});
    if (!am.empty()) cin.attn_mask = view<const C>(cam.data(), {l, l});
    rpe::attention_term<C>* cslots[3] = {&cin.rpe_q, &cin.rpe_k, &cin.rpe_v};
    for (int s = 0; s < 3; ++s) {
        if (!cpu_terms[s]) continue;
        cslots[s]->term = cpu_terms[s].get();
        for (const auto& t : tables[s]) ctables[s].push_back(cv(t));
        for (const auto& t : ctables[s]) cslots[s]->tables.push_back(view<const C>(t.data(), cpu_terms[s]->table_shape()));
    }
    std::vector<C> cout(static_cast<std::size_t>(b * h * l * d));
    rpe::attention_forward(cin, view<C>(cout.data(), qshape));
    const auto gout = random_floats(b * h * l * d, seed + 5);
    const auto cgout = cv(gout);
    std::vector<C> cgq(cout.size()), cgk(cout.size()), cgv(cout.size());
    std::vector<std::vector<C>> cgtables[3];
    for (int s = 0; s < 3; ++s) {
        if (!cpu_terms[s]) continue;
        for (const auto& t : tables[s]) cgtables[s].emplace_back(t.size());
        for (auto& t : cgtables[s]) cslots[s]->grad_tables.push_back(view<C>(t.data(), cpu_terms[s]->table_shape()));
    }
    rpe::attention_backward(cin, view<const C>(cgout.data(), qshape), view<C>(cgq.data(), qshape), view<C>(cgk.data(), qshape),
                            view<C>(cgv.data(), qshape));

    // GPU
    device_vec<S> dq(to_storage<S>(q)), dk(to_storage<S>(k)), dv(to_storage<S>(v)), dam(to_storage<S>(am)),
        dout(static_cast<std::size_t>(b * h * l * d));
    device_vec<std::uint8_t> dmask(mask);
    std::vector<std::unique_ptr<device_vec<S>>> dtables, dgtables;
    device_vec<S> dgout(to_storage<S>(gout)), dgq(cout.size()), dgk(cout.size()), dgv(cout.size());
    rpe::cuda::attention_inputs<S> gin;
    gin.q = dq.cref(qshape);
    gin.k = dk.cref(qshape);
    gin.v = dv.cref(qshape);
    gin.height = cfg.height;
    gin.width = cfg.width;
    if (!mask.empty()) gin.key_padding_mask = dmask.cref({b, l});
    if (!am.empty()) gin.attn_mask = dam.cref({l, l});
    rpe::cuda::attention_term<S>* gslots[3] = {&gin.rpe_q, &gin.rpe_k, &gin.rpe_v};
    for (int s = 0; s < 3; ++s)
        if (cfg_terms[s]) attach_device_tables(*gslots[s], *cfg_terms[s], tables[s], dtables, dgtables);
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::attention_forward(gin, dout.ref(qshape), {}, {.stream = stream});
    rpe::cuda::attention_backward(gin, dgout.cref(qshape), dgq.ref(qshape), dgk.ref(qshape), dgv.ref(qshape), {.stream = stream});
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    // logits are sums of D products (the RPE terms add a few more); the output a sum of L
    // probabilities times values (plus K bucket sums)
    check_attention_results<S, C>(b, h, l, d, dout, dgq, dgk, dgv, cout, cgq, cgk, cgv, dgtables, cgtables);
}

template <class S>
void attention_suite(unsigned seed) {
    SUBCASE("no RPE") { compare_attention<S>({.on = ""}, seed); }
    SUBCASE("contextual k (iRPE-K), product, shared, skip 1") { compare_attention<S>({.on = "k"}, seed); }
    SUBCASE("contextual q, per head, skip 0") { compare_attention<S>({.on = "q", .shared = false, .skip = 0}, seed); }
    SUBCASE("contextual v") { compare_attention<S>({.on = "v"}, seed); }
    SUBCASE("contextual q, k, v with padding and an all-masked batch") {
        compare_attention<S>({.on = "qkv", .padding = true}, seed);
    }
    SUBCASE("bias q and k, euclidean, per head, additive mask") {
        compare_attention<S>(
            {.on = "qk", .method = rpe::method::euclidean, .contextual = false, .shared = false, .additive = true}, seed);
    }
    SUBCASE("cross, contextual q, k, v, per head") {
        compare_attention<S>({.on = "qkv", .method = rpe::method::cross, .shared = false}, seed);
    }
    SUBCASE("larger: L = 50, D = 64, three tiles of keys") {
        compare_attention<S>({.on = "qkv", .batch = 1, .heads = 3, .dim = 64, .height = 7, .width = 7}, seed);
    }
    // double at D = 128 needs about 76 KB of shared memory per block: more than sm_75 offers
    if constexpr (!std::is_same_v<S, double>) {
        SUBCASE("D = 128 and DETR's product ratio 2 without class token") {
            compare_attention<S>({.on = "k",
                                  .skip = 0,
                                  .batch = 1,
                                  .heads = 1,
                                  .dim = 128,
                                  .height = 6,
                                  .width = 9,
                                  .padding = true,
                                  .ratio = 2.0},
                                 seed);
        }
    }
}

// The iRPE terms at per-token positions and key lengths: one call of each backend on the same
// inputs, the CPU's results the reference (its positions and key_lengths are documented and
// unit-tested against the grid and against key_padding_mask). Terms from rpe::make_term_desc (one
// descriptor for both backends; the tables in each backend's memory).
enum class at_mapping { product, cross, product3d };

struct at_config {
    std::string on = "qkv";  // subset of "qkv"
    at_mapping mapping = at_mapping::product;
    bool contextual = true;  // of the q and k terms (the value term is contextual)
    bool shared = true;
    int skip = 1, batch = 2, heads = 2, dim = 16;
    std::vector<std::int32_t> positions = {};      // (N, axes), or empty: the grid height x width
    std::vector<std::int32_t> key_positions = {};  // (N_k, axes): N_k != N gives keys of another count (L_k != L), or empty
    int height = 4, width = 5;                     // the grid when positions is empty
    std::vector<std::int32_t> key_lengths = {};    // (B), or empty
    bool padding = false;                          // also a key_padding_mask (batch 0: its last 2 keys)
    bool host_positions = false;                   // positions and key_lengths in host memory on the GPU side too
    bool attn_mask = false;                        // also an additive attn_mask (L, L_k) of random values
};

template <class S>
void compare_attention_at(const at_config& cfg, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const int axes = cfg.mapping == at_mapping::product3d ? 3 : 2;
    const bool at_positions = !cfg.positions.empty();
    const std::int64_t tokens = at_positions ? static_cast<std::int64_t>(cfg.positions.size()) / axes : cfg.height * cfg.width;
    const std::int64_t key_tokens =
        cfg.key_positions.empty() ? tokens : static_cast<std::int64_t>(cfg.key_positions.size()) / axes;
    const std::int64_t b = cfg.batch, h = cfg.heads, l = cfg.skip + tokens, lk = cfg.skip + key_tokens, d = cfg.dim;
    INFO("on " << cfg.on << ", mapping " << static_cast<int>(cfg.mapping) << ", L " << l << ", L_k " << lk << ", positions "
               << at_positions << ", key positions " << !cfg.key_positions.empty() << ", key lengths " << cfg.key_lengths.size()
               << ", S " << sizeof(S) << " bytes");
    const std::vector<std::int64_t> qshape{b, h, l, d}, kshape{b, h, lk, d};
    const auto q = random_floats(b * h * l * d, seed + 1), k = random_floats(b * h * lk * d, seed + 2),
               v = random_floats(b * h * lk * d, seed + 3), gout = random_floats(b * h * l * d, seed + 5);
    std::vector<std::uint8_t> mask;
    if (cfg.padding) {
        mask.assign(static_cast<std::size_t>(b * lk), 0);
        mask[static_cast<std::size_t>(lk - 1)] = mask[static_cast<std::size_t>(lk - 2)] = 1;
    }

    // one descriptor per slot, for both backends
    const auto g19 = rpe::index::piecewise::from_ratio(1.9);
    std::optional<rpe::term_desc> terms[3];
    std::vector<std::vector<float>> tables[3];
    const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
    for (int s = 0; s < 3; ++s) {
        if (cfg.on.find("qkv"[s]) == std::string::npos) continue;
        const rpe::term_config tc{.num_heads = cfg.heads, .head_dim = cfg.dim, .shared_head = cfg.shared, .skip = cfg.skip};
        const bool contextual = cfg.contextual || s == 2;
        if (cfg.mapping == at_mapping::product)
            terms[s] = rpe::make_term_desc(rpe::mapping::product<>{g19}, contextual, targets[s], tc);
        else if (cfg.mapping == at_mapping::cross)
            terms[s] = rpe::make_term_desc(rpe::mapping::cross<>{g19}, contextual, targets[s], tc);
        else
            terms[s] = rpe::make_term_desc(rpe::mapping::product3d<>{g19, g19, g19}, contextual, targets[s], tc);
        for (int t = 0; t < terms[s]->num_tables(); ++t)
            tables[s].push_back(random_floats(count(terms[s]->table_shape()), seed + 10 + 3 * s + t, 0.5f));
    }
    const std::vector<std::int64_t> pshape{tokens, axes}, kpshape{key_tokens, axes};

    // CPU
    auto cv = [](const std::vector<float>& x) { return std::vector<C>(x.begin(), x.end()); };
    const auto cq = cv(q), ck = cv(k), cvv = cv(v), cgout = cv(gout);
    std::vector<std::vector<C>> ctables[3], cgtables[3];
    rpe::attention_inputs<C> cin;
    cin.q = view<const C>(cq.data(), qshape);
    cin.k = view<const C>(ck.data(), kshape);
    cin.v = view<const C>(cvv.data(), kshape);
    if (!at_positions) {
        cin.height = cfg.height;
        cin.width = cfg.width;
    } else {
        cin.positions = view<const std::int32_t>(cfg.positions.data(), pshape);
        if (!cfg.key_positions.empty()) cin.key_positions = view<const std::int32_t>(cfg.key_positions.data(), kpshape);
    }
    if (!cfg.key_lengths.empty()) cin.key_lengths = view<const std::int32_t>(cfg.key_lengths.data(), {b});
    if (!mask.empty()) cin.key_padding_mask = view<const std::uint8_t>(mask.data(), {b, lk});
    const auto am = cfg.attn_mask ? random_floats(l * lk, seed + 7) : std::vector<float>{};
    const auto cam = std::vector<C>(am.begin(), am.end());
    if (cfg.attn_mask) cin.attn_mask = view<const C>(cam.data(), {l, lk});
    rpe::attention_term<C>* cslots[3] = {&cin.rpe_q, &cin.rpe_k, &cin.rpe_v};
    for (int s = 0; s < 3; ++s) {
        if (!terms[s]) continue;
        cslots[s]->term = &*terms[s];
        for (const auto& t : tables[s]) {
            ctables[s].push_back(cv(t));
            cgtables[s].emplace_back(t.size());
        }
        for (std::size_t t = 0; t < tables[s].size(); ++t) {
            cslots[s]->tables.push_back(view<const C>(ctables[s][t].data(), terms[s]->table_shape()));
            cslots[s]->grad_tables.push_back(view<C>(cgtables[s][t].data(), terms[s]->table_shape()));
        }
    }
    std::vector<C> cout(static_cast<std::size_t>(b * h * l * d)), cgq(cout.size()), cgk(k.size()), cgv(k.size());
    rpe::attention_forward(cin, view<C>(cout.data(), qshape));
    rpe::attention_backward(cin, view<const C>(cgout.data(), qshape), view<C>(cgq.data(), qshape), view<C>(cgk.data(), kshape),
                            view<C>(cgv.data(), kshape));

    // GPU: the same positions and key lengths, in device memory (or host memory)
    device_vec<S> dq(to_storage<S>(q)), dk(to_storage<S>(k)), dv(to_storage<S>(v)), dgout(to_storage<S>(gout)), dout(cout.size()),
        dgq(cout.size()), dgk(k.size()), dgv(k.size());
    device_vec<std::uint8_t> dmask(mask);
    device_vec<std::int32_t> dpos(cfg.positions), dkpos(cfg.key_positions), dlengths(cfg.key_lengths);
    rpe::cuda::attention_inputs<S> gin;
    gin.q = dq.cref(qshape);
    gin.k = dk.cref(kshape);
    gin.v = dv.cref(kshape);
    gin.height = cin.height;
    gin.width = cin.width;
    if (at_positions) {
        gin.positions = cfg.host_positions ? cin.positions : dpos.cref(pshape);
        if (!cfg.key_positions.empty()) gin.key_positions = cfg.host_positions ? cin.key_positions : dkpos.cref(kpshape);
    }
    if (!cfg.key_lengths.empty()) gin.key_lengths = cfg.host_positions ? cin.key_lengths : dlengths.cref({b});
    if (!mask.empty()) gin.key_padding_mask = dmask.cref({b, lk});
    device_vec<S> dam(to_storage<S>(am));
    if (cfg.attn_mask) gin.attn_mask = dam.cref({l, lk});
    std::vector<std::unique_ptr<device_vec<S>>> dtables, dgtables;
    rpe::cuda::attention_term<S>* gslots[3] = {&gin.rpe_q, &gin.rpe_k, &gin.rpe_v};
    for (int s = 0; s < 3; ++s)
        if (terms[s]) attach_device_tables(*gslots[s], *terms[s], tables[s], dtables, dgtables);
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::attention_forward(gin, dout.ref(qshape), {}, {.stream = stream});
    rpe::cuda::attention_backward(gin, dgout.cref(qshape), dgq.ref(qshape), dgk.ref(kshape), dgv.ref(kshape), {.stream = stream});
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    check_attention_results<S, C>(b, h, std::max(l, lk), d, dout, dgq, dgk, dgv, cout, cgq, cgk, cgv, dgtables, cgtables);
    // padded keys (key_lengths): exactly zero grad_k and grad_v rows; batches without a valid key: zero output
    if (!cfg.key_lengths.empty()) {
        const auto gk = dgk.host(), gv = dgv.host(), o = dout.host();
        int nonzero = 0;
        for (std::int64_t bb = 0; bb < b; ++bb)
            for (std::int64_t hh = 0; hh < h; ++hh)
                for (std::int64_t j = 0; j < std::max(l, lk); ++j)
                    for (std::int64_t c = 0; c < d; ++c) {
                        const auto ek = static_cast<std::size_t>(((bb * h + hh) * lk + j) * d + c);
                        const auto eq = static_cast<std::size_t>(((bb * h + hh) * l + j) * d + c);
                        if (j < lk && j >= cfg.key_lengths[static_cast<std::size_t>(bb)])
                            nonzero += rpe::cuda::to_acc(gk[ek]) != 0 || rpe::cuda::to_acc(gv[ek]) != 0;
                        if (j < l && cfg.key_lengths[static_cast<std::size_t>(bb)] == 0) nonzero += rpe::cuda::to_acc(o[eq]) != 0;
                    }
        CHECK(nonzero == 0);
    }
}

template <class S>
void attention_at_suite(unsigned seed) {
    const auto grid45 = permuted_grid(1, 4, 5, 7);  // a 4 x 5 grid's 20 positions, scrambled
    SUBCASE("a permuted 4 x 5 grid: contextual q, k, v, skip 1") { compare_attention_at<S>({.positions = grid45}, seed); }
    SUBCASE("a permuted grid, bias q and k per head, skip 0") {
        compare_attention_at<S>({.on = "qk", .contextual = false, .shared = false, .skip = 0, .positions = grid45}, seed);
    }
    // irregular positions (repeats, gaps, negative coordinates) and other key positions
    std::vector<std::int32_t> irregular, keys;
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> coord(-4, 6);
    for (int i = 0; i < 2 * 23; ++i) {
        irregular.push_back(coord(rng));
        keys.push_back(coord(rng));
    }
    SUBCASE("irregular positions and key positions apart: contextual q, k, v, skip 1") {
        compare_attention_at<S>({.positions = irregular, .key_positions = keys}, seed);
    }
    SUBCASE("key positions apart: contextual k and v with a key padding mask; bias q; per head") {
        compare_attention_at<S>({.on = "kv", .shared = false, .positions = irregular, .key_positions = keys, .padding = true},
                                seed);
        compare_attention_at<S>({.on = "q", .contextual = false, .shared = false, .positions = irregular, .key_positions = keys},
                                seed);
    }
    SUBCASE("Cross (two tables) at key positions apart, skip 2") {
        compare_attention_at<S>({.mapping = at_mapping::cross, .skip = 2, .positions = irregular, .key_positions = keys}, seed);
    }
    SUBCASE("3D product3d at a permuted 2 x 3 x 4 grid, key positions another permutation") {
        compare_attention_at<S>({.mapping = at_mapping::product3d,
                                 .positions = permuted_grid(2, 3, 4, 11),
                                 .key_positions = permuted_grid(2, 3, 4, 12)},
                                seed);
    }
    SUBCASE("positions and key_lengths in host memory") {
        compare_attention_at<S>(
            {.positions = grid45, .key_positions = permuted_grid(1, 4, 5, 8), .key_lengths = {13, 21}, .host_positions = true},
            seed);
    }
    SUBCASE("key_lengths on the grid: contextual q, k, v; batch 1 without a valid key") {
        compare_attention_at<S>({.key_lengths = {9, 0}}, seed);
    }
    SUBCASE("key_lengths and a key padding mask, L = 50 (two tiles of keys), at positions") {
        compare_attention_at<S>({.batch = 3, .positions = permuted_grid(1, 7, 7, 9), .key_lengths = {37, 50, 1}, .padding = true},
                                seed);
    }
    // keys of another count than the queries (L_k != L): (L, L_k) ids at positions and key_positions
    std::vector<std::int32_t> many_keys;  // 45 keys: two tiles of 32 and more
    for (int i = 0; i < 2 * 45; ++i) many_keys.push_back(coord(rng));
    SUBCASE("L_k > L: 45 keys against 23 queries, contextual q, k, v, skip 1, key padding, key_lengths, an (L, L_k) mask") {
        compare_attention_at<S>(
            {.positions = irregular, .key_positions = many_keys, .key_lengths = {46, 30}, .padding = true, .attn_mask = true},
            seed);
    }
    SUBCASE("L_k < L: 20 keys against 49 queries (two tiles), contextual q, k, v per head, padding, key_lengths, a mask") {
        compare_attention_at<S>({.shared = false,
                                 .positions = permuted_grid(1, 7, 7, 9),
                                 .key_positions = grid45,
                                 .key_lengths = {21, 12},
                                 .padding = true,
                                 .attn_mask = true},
                                seed);
    }
    SUBCASE("L_k < L: 20 keys (a permuted 4 x 5 grid) against 49 queries (7 x 7), bias q and k per head, skip 0") {
        compare_attention_at<S>({.on = "qk",
                                 .contextual = false,
                                 .shared = false,
                                 .skip = 0,
                                 .positions = permuted_grid(1, 7, 7, 9),
                                 .key_positions = grid45},
                                seed);
    }
    SUBCASE("L_k != L: Cross (two tables), contextual q, k, v, skip 2, positions in host memory") {
        compare_attention_at<S>(
            {.mapping = at_mapping::cross, .skip = 2, .positions = irregular, .key_positions = many_keys, .host_positions = true},
            seed);
    }
}

// Packed sequences (attention_inputs::packed): several images in one sequence, each attended
// alone, against the CPU fused attention's packed call on the same inputs (whose packing is
// unit-tested against one call per image). Terms from rpe::make_term_desc (one descriptor for both
// backends).
struct packed_config {
    std::string on = "qkv";  // subset of "qkv"
    bool contextual = true;  // of the q and k terms (the value term is contextual)
    bool shared = true;
    int skip = 1, batch = 2, heads = 2, dim = 16;
    std::vector<std::array<int, 2>> grids = {{2, 3}, {3, 4}, {1, 5}};  // (height, width) per image
    bool at_positions = false;  // packed.positions (each image's grid, permuted) in place of packed.grids
    bool padding = false;       // a key_padding_mask (batch 0: the last key of every image but the first)
    bool additive = false;      // an additive (L, L) attn_mask
    bool host_packed = false;   // lengths, grids, positions in host memory on the GPU side too
};

template <class S>
void compare_attention_packed(const packed_config& cfg, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const std::int64_t m_count = static_cast<std::int64_t>(cfg.grids.size());
    std::vector<std::int32_t> lengths, grids, positions;
    std::int64_t l = 0;
    for (std::size_t m = 0; m < cfg.grids.size(); ++m) {
        const auto [gh, gw] = cfg.grids[m];
        lengths.push_back(cfg.skip + gh * gw);
        grids.push_back(gh);
        grids.push_back(gw);
        const auto p = permuted_grid(1, gh, gw, seed + 50 + static_cast<unsigned>(m));
        positions.insert(positions.end(), p.begin(), p.end());
        l += lengths.back();
    }
    const std::int64_t b = cfg.batch, h = cfg.heads, d = cfg.dim;
    INFO("on " << cfg.on << ", contextual " << cfg.contextual << ", M " << m_count << ", L " << l << ", positions "
               << cfg.at_positions << ", S " << sizeof(S) << " bytes");
    const std::vector<std::int64_t> qshape{b, h, l, d};
    const auto q = random_floats(b * h * l * d, seed + 1), k = random_floats(b * h * l * d, seed + 2),
               v = random_floats(b * h * l * d, seed + 3), gout = random_floats(b * h * l * d, seed + 5);
    std::vector<std::uint8_t> mask;
    if (cfg.padding) {
        mask.assign(static_cast<std::size_t>(b * l), 0);
        for (std::int64_t m = 1, end = lengths[0]; m < m_count; ++m) {
            end += lengths[static_cast<std::size_t>(m)];
            mask[static_cast<std::size_t>(end - 1)] = 1;
        }
    }
    std::vector<float> am;
    if (cfg.additive) am = random_floats(l * l, seed + 4, 0.5f);

    const auto g19 = rpe::index::piecewise::from_ratio(1.9);
    std::optional<rpe::term_desc> terms[3];
    std::vector<std::vector<float>> tables[3];
    const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
    for (int s = 0; s < 3; ++s) {
        if (cfg.on.find("qkv"[s]) == std::string::npos) continue;
        const rpe::term_config tc{.num_heads = cfg.heads, .head_dim = cfg.dim, .shared_head = cfg.shared, .skip = cfg.skip};
        terms[s] = rpe::make_term_desc(rpe::mapping::product<>{g19}, cfg.contextual || s == 2, targets[s], tc);
        tables[s].push_back(random_floats(count(terms[s]->table_shape()), seed + 10 + 3 * s, 0.5f));
    }
    const std::vector<std::int64_t> pshape{l - m_count * cfg.skip, 2};

    // CPU
    auto cv = [](const std::vector<float>& x) { return std::vector<C>(x.begin(), x.end()); };
    const auto cq = cv(q), ck = cv(k), cvv = cv(v), cgout = cv(gout), cam = cv(am);
    std::vector<std::vector<C>> ctables[3], cgtables[3];
    rpe::attention_inputs<C> cin;
    cin.q = view<const C>(cq.data(), qshape);
    cin.k = view<const C>(ck.data(), qshape);
    cin.v = view<const C>(cvv.data(), qshape);
    cin.packed.lengths = view<const std::int32_t>(lengths.data(), {m_count});
    if (cfg.at_positions)
        cin.packed.positions = view<const std::int32_t>(positions.data(), pshape);
    else if (!cfg.on.empty())
        cin.packed.grids = view<const std::int32_t>(grids.data(), {m_count, 2});
    if (!mask.empty()) cin.key_padding_mask = view<const std::uint8_t>(mask.data(), {b, l});
    if (!am.empty()) cin.attn_mask = view<const C>(cam.data(), {l, l});
    rpe::attention_term<C>* cslots[3] = {&cin.rpe_q, &cin.rpe_k, &cin.rpe_v};
    for (int s = 0; s < 3; ++s) {
        if (!terms[s]) continue;
        cslots[s]->term = &*terms[s];
        ctables[s].push_back(cv(tables[s][0]));
        cgtables[s].emplace_back(tables[s][0].size());
        cslots[s]->tables.push_back(view<const C>(ctables[s][0].data(), terms[s]->table_shape()));
        cslots[s]->grad_tables.push_back(view<C>(cgtables[s][0].data(), terms[s]->table_shape()));
    }
    std::vector<C> cout(static_cast<std::size_t>(b * h * l * d)), cgq(cout.size()), cgk(cout.size()), cgv(cout.size());
    rpe::attention_forward(cin, view<C>(cout.data(), qshape));
    rpe::attention_backward(cin, view<const C>(cgout.data(), qshape), view<C>(cgq.data(), qshape), view<C>(cgk.data(), qshape),
                            view<C>(cgv.data(), qshape));

    // GPU: the same packing, its views in device memory (or host memory); outputs pre-filled with
    // 99 (a row the packed call leaves unwritten fails the comparison)
    const std::vector<float> filled(cout.size(), 99.f);
    device_vec<S> dq(to_storage<S>(q)), dk(to_storage<S>(k)), dv(to_storage<S>(v)), dgout(to_storage<S>(gout)),
        dam(to_storage<S>(am)), dout(to_storage<S>(filled)), dgq(to_storage<S>(filled)), dgk(to_storage<S>(filled)),
        dgv(to_storage<S>(filled));
    device_vec<std::uint8_t> dmask(mask);
    device_vec<std::int32_t> dlengths(lengths), dgrids(grids), dpos(positions);
    rpe::cuda::attention_inputs<S> gin;
    gin.q = dq.cref(qshape);
    gin.k = dk.cref(qshape);
    gin.v = dv.cref(qshape);
    gin.packed.lengths = cfg.host_packed ? cin.packed.lengths : dlengths.cref({m_count});
    if (cfg.at_positions)
        gin.packed.positions = cfg.host_packed ? cin.packed.positions : dpos.cref(pshape);
    else if (!cfg.on.empty())
        gin.packed.grids = cfg.host_packed ? cin.packed.grids : dgrids.cref({m_count, 2});
    if (!mask.empty()) gin.key_padding_mask = dmask.cref({b, l});
    if (!am.empty()) gin.attn_mask = dam.cref({l, l});
    std::vector<std::unique_ptr<device_vec<S>>> dtables, dgtables;
    rpe::cuda::attention_term<S>* gslots[3] = {&gin.rpe_q, &gin.rpe_k, &gin.rpe_v};
    for (int s = 0; s < 3; ++s)
        if (terms[s]) attach_device_tables(*gslots[s], *terms[s], tables[s], dtables, dgtables);
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::attention_forward(gin, dout.ref(qshape), {}, {.stream = stream});
    rpe::cuda::attention_backward(gin, dgout.cref(qshape), dgq.ref(qshape), dgk.ref(qshape), dgv.ref(qshape), {.stream = stream});
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    check_attention_results<S, C>(b, h, l, d, dout, dgq, dgk, dgv, cout, cgq, cgk, cgv, dgtables, cgtables);
}

template <class S>
void attention_packed_suite(unsigned seed) {
    SUBCASE("3 images (2 x 3, 3 x 4, 1 x 5), skip 1: contextual q, k, v, shared") { compare_attention_packed<S>({}, seed); }
    SUBCASE("bias q and k per head, skip 2, a key padding mask and an additive mask") {
        compare_attention_packed<S>(
            {.on = "qk", .contextual = false, .shared = false, .skip = 2, .padding = true, .additive = true}, seed);
    }
    SUBCASE("contextual v alone, skip 0, packed.positions (permuted grids)") {
        compare_attention_packed<S>({.on = "v", .skip = 0, .at_positions = true}, seed);
    }
    SUBCASE("contextual q, k, v at packed.positions in host memory, a key padding mask") {
        compare_attention_packed<S>({.at_positions = true, .padding = true, .host_packed = true}, seed);
    }
    SUBCASE("B = H = 1 (contiguous image rows, no gather), bias q and k, contextual v, an image of 7 x 7 (two key tiles)") {
        compare_attention_packed<S>(
            {.contextual = false, .batch = 1, .heads = 1, .grids = {{7, 7}, {2, 2}, {3, 5}}, .padding = true}, seed);
    }
    SUBCASE("one image (the whole sequence: no gather)") {
        compare_attention_packed<S>({.grids = {{4, 5}}, .host_packed = true}, seed);
    }
    SUBCASE("no term: lengths only") { compare_attention_packed<S>({.on = "", .skip = 0, .additive = true}, seed); }
}

// The tensor-core forward (fp16, bf16; attention_options::tensor_cores = true) against the SIMT
// forward (tensor_cores = false) on the same device inputs: random q, k, v, terms from rpe::make_term_desc (product
// mapping, ratio 1.9), optional masks, key lengths, positions and a NaN logit.
struct tc_config {
    std::string on;  // subset of "qk" (no value term: the tensor-core kernel does not take one)
    bool contextual = true;
    bool shared = true;
    int skip = 1, batch = 2, heads = 3, dim = 64, height = 14, width = 14;
    int keys = 0;                                // L_k (no term), or 0: L
    bool padding = false;                        // key_padding_mask: batch 0 keys 10..12
    bool additive = false;                       // an additive (L, L) attn_mask
    bool nan_row = false;                        // attn_mask(5, 7) = NaN: row 5 of every plane NaN (key 7 valid)
    bool at_positions = false;                   // positions: a permuted grid, key positions another one
    std::vector<std::int32_t> key_lengths = {};  // (B), or empty
};

template <class S>
void compare_tensor_cores(const tc_config& cfg, unsigned seed) {
    const std::int64_t b = cfg.batch, h = cfg.heads, tokens = cfg.height * cfg.width, l = cfg.skip + tokens, d = cfg.dim;
    const std::int64_t lk = cfg.keys > 0 ? cfg.keys : l;
    INFO("on '" << cfg.on << "', contextual " << cfg.contextual << ", B " << b << ", H " << h << ", L " << l << ", L_k " << lk
                << ", D " << d << ", S " << sizeof(S) << " bytes");
    const std::vector<std::int64_t> qshape{b, h, l, d}, kshape{b, h, lk, d};
    const auto q = random_floats(b * h * l * d, seed + 1), k = random_floats(b * h * lk * d, seed + 2),
               v = random_floats(b * h * lk * d, seed + 3);
    std::vector<std::uint8_t> mask;
    if (cfg.padding) {
        mask.assign(static_cast<std::size_t>(b * lk), 0);
        for (std::int64_t j = 10; j < 13; ++j) mask[static_cast<std::size_t>(j)] = 1;
    }
    std::vector<float> am;
    if (cfg.additive) am = random_floats(l * lk, seed + 4, 0.5f);
    if (cfg.nan_row && am.empty()) am.assign(static_cast<std::size_t>(l * lk), 0.f);
    if (cfg.nan_row) am[static_cast<std::size_t>(5 * lk + 7)] = std::numeric_limits<float>::quiet_NaN();
    const auto g19 = rpe::index::piecewise::from_ratio(1.9);
    std::optional<rpe::term_desc> terms[2];
    std::vector<std::unique_ptr<device_vec<S>>> dtables;
    rpe::cuda::attention_inputs<S> gin;
    rpe::cuda::attention_term<S>* gslots[2] = {&gin.rpe_q, &gin.rpe_k};
    const rpe::target targets[2] = {rpe::target::query, rpe::target::key};
    for (int s = 0; s < 2; ++s) {
        if (cfg.on.find("qk"[s]) == std::string::npos) continue;
        const rpe::term_config tc{.num_heads = cfg.heads, .head_dim = cfg.dim, .shared_head = cfg.shared, .skip = cfg.skip};
        terms[s] = rpe::make_term_desc(rpe::mapping::product<>{g19}, cfg.contextual, targets[s], tc);
        gslots[s]->term = &*terms[s];
        dtables.push_back(
            std::make_unique<device_vec<S>>(to_storage<S>(random_floats(count(terms[s]->table_shape()), seed + 10 + s, 0.5f))));
        gslots[s]->tables.push_back(dtables.back()->cref(terms[s]->table_shape()));
    }
    device_vec<S> dq(to_storage<S>(q)), dk(to_storage<S>(k)), dv(to_storage<S>(v)), dam(to_storage<S>(am)),
        dtc(static_cast<std::size_t>(b * h * l * d)), dsimt(static_cast<std::size_t>(b * h * l * d));
    device_vec<std::uint8_t> dmask(mask);
    device_vec<std::int32_t> dlengths(cfg.key_lengths);
    const auto pos = permuted_grid(1, cfg.height, cfg.width, seed + 20),
               kpos = permuted_grid(1, cfg.height, cfg.width, seed + 21);
    gin.q = dq.cref(qshape);
    gin.k = dk.cref(kshape);
    gin.v = dv.cref(kshape);
    if (cfg.at_positions) {
        gin.positions = view<const std::int32_t>(pos.data(), {tokens, 2});  // host memory
        gin.key_positions = view<const std::int32_t>(kpos.data(), {tokens, 2});
    } else if (!cfg.on.empty()) {  // the terms' grid (without a term there is none)
        gin.height = cfg.height;
        gin.width = cfg.width;
    }
    if (!mask.empty()) gin.key_padding_mask = dmask.cref({b, lk});
    if (!am.empty()) gin.attn_mask = dam.cref({l, lk});
    if (!cfg.key_lengths.empty()) gin.key_lengths = dlengths.cref({b});
    REQUIRE(rpe::cuda::attention_forward_uses_tensor_cores(gin, {.tensor_cores = true}));
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(gin, {.tensor_cores = false}));
    rpe::cuda::attention_forward(gin, dtc.ref(qshape), {}, {.tensor_cores = true});
    rpe::cuda::attention_forward(gin, dsimt.ref(qshape), {}, {.tensor_cores = false});
    const auto tc = to_double(dtc.host()), simt = to_double(dsimt.host());

    // NaN rows: the same elements NaN in both (row 5 of every plane whose row 5 sees key 7)
    std::size_t nan_tc = 0, nan_both = 0, nan_simt = 0;
    std::vector<double> tc_finite, simt_finite;
    for (std::size_t e = 0; e < tc.size(); ++e) {
        nan_tc += tc[e] != tc[e];
        nan_simt += simt[e] != simt[e];
        nan_both += tc[e] != tc[e] && simt[e] != simt[e];
        if (simt[e] == simt[e]) {
            tc_finite.push_back(tc[e]);
            simt_finite.push_back(simt[e]);
        }
    }
    CHECK(nan_tc == nan_simt);
    CHECK(nan_both == nan_simt);
    CHECK((nan_simt > 0) == cfg.nan_row);
    // Both kernels compute the logits in float from the same S inputs (the same products in
    // another order: ~1e-6 relative) and round the output to S once; the tensor-core kernel also
    // rounds each probability to S before P·v (relative error ≤ u, independent across keys), so
    // |tc − simt| ≤ one rounding of the output (2u·|out|: the two float values may round to
    // neighbours) + the probabilities' rounding, about u·sqrt(Σ_j p_j² v_j²) ≤ u·rms(v)-scale per
    // element and a few u·rms(out) at the tails of ~1e5 elements: atol 8u·rms(simt), rtol 4u (a
    // float64 simulation of both kernels' roundings on these shapes, N(0, 1) inputs, 64-key
    // tiles: at most 0.35 of this bound in fp16 and bf16). A missing or misplaced term, mask or
    // rescaling differs by O(rms).
    const double u = rpe::cuda::unit_roundoff<S>();
    double ss = 0;
    for (double x : simt_finite) ss += x * x;
    const double rms = std::sqrt(ss / static_cast<double>(std::max<std::size_t>(simt_finite.size(), 1)));
    check_close("tensor-core vs SIMT forward", tc_finite, simt_finite, 8 * u * rms, 4 * u);
    // batch elements without a valid key (key_lengths 0): zeros in both
    for (std::size_t bb = 0; bb < cfg.key_lengths.size(); ++bb)
        if (cfg.key_lengths[bb] == 0) {
            int nonzero = 0;
            for (std::int64_t e = static_cast<std::int64_t>(bb) * h * l * d; e < (static_cast<std::int64_t>(bb) + 1) * h * l * d;
                 ++e)
                nonzero += tc[static_cast<std::size_t>(e)] != 0;
            CHECK(nonzero == 0);
        }
}

template <class S>
void tensor_core_suite(unsigned seed) {
    SUBCASE("no RPE, L = 197, D = 64") { compare_tensor_cores<S>({}, seed); }
    SUBCASE("iRPE-K (contextual key, shared), L = 197, D = 64") { compare_tensor_cores<S>({.on = "k"}, seed); }
    SUBCASE("bias q and k per head, attn_mask with a NaN logit, key padding mask, key_lengths (70, 0), L = 100") {
        compare_tensor_cores<S>({.on = "qk",
                                 .contextual = false,
                                 .shared = false,
                                 .height = 9,
                                 .width = 11,
                                 .padding = true,
                                 .additive = true,
                                 .nan_row = true,
                                 .key_lengths = {70, 0}},
                                seed);
    }
    SUBCASE("no RPE, keys of another count (L = 100, L_k = 150), attn_mask, key padding mask, key_lengths (150, 77)") {
        compare_tensor_cores<S>(
            {.height = 9, .width = 11, .keys = 150, .padding = true, .additive = true, .key_lengths = {150, 77}}, seed);
    }
    SUBCASE("contextual q and k per head, D = 128, L = 55") {
        compare_tensor_cores<S>({.on = "qk", .shared = false, .batch = 1, .heads = 2, .dim = 128, .height = 6, .width = 9}, seed);
    }
    SUBCASE("iRPE-K at positions apart from the key positions, key_lengths, skip 0, D = 32, L = 49") {
        compare_tensor_cores<S>(
            {.on = "k", .skip = 0, .dim = 32, .height = 7, .width = 7, .at_positions = true, .key_lengths = {49, 30}}, seed);
    }
    SUBCASE("contextual q, D = 16, L = 21, one key tile") {
        compare_tensor_cores<S>({.on = "q", .batch = 1, .heads = 2, .dim = 16, .height = 4, .width = 5}, seed);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda fused attention on packed sequences matches the CPU fused attention's packed call", S, float, double,
                   __half, __nv_bfloat16) {
    attention_packed_suite<S>(500);
}

TEST_CASE_TEMPLATE("cuda fused attention forward and backward match the CPU fused attention", S, float, double, __half,
                   __nv_bfloat16) {
    attention_suite<S>(300);
}

TEST_CASE_TEMPLATE("cuda fused attention at per-token positions and key lengths matches the CPU fused attention", S, float,
                   double, __half, __nv_bfloat16) {
    attention_at_suite<S>(400);
}

TEST_CASE_TEMPLATE("cuda fused attention: the tensor-core forward matches the SIMT forward", S, __half, __nv_bfloat16) {
    tensor_core_suite<S>(600);
}

TEST_CASE("cuda fused attention matches the golden attention outputs and gradients in float32") {
    const auto cases = load_attention_cases(std::string(RPE_TEST_DATA_DIR) + "/golden");
    REQUIRE(cases.size() >= 9);
    for (const auto& c : cases) {
        INFO("case " << c.name);
        const std::int64_t b = c.batch, h = c.heads, l = c.length, d = c.head_dim;
        const std::vector<std::int64_t> qshape{b, h, l, d};
        device_vec<float> dq(c.q), dk(c.k), dv(c.v), dout(static_cast<std::size_t>(b * h * l * d));
        device_vec<std::uint8_t> dmask(c.key_padding_mask);
        rpe::cuda::attention_inputs<float> in;
        in.q = dq.cref(qshape);
        in.k = dk.cref(qshape);
        in.v = dv.cref(qshape);
        in.height = c.height;
        in.width = c.width;
        if (!c.key_padding_mask.empty()) in.key_padding_mask = dmask.cref({b, l});
        std::unique_ptr<rpe::any_term<float>> terms[3];
        std::vector<std::unique_ptr<device_vec<float>>> tables, grads;
        rpe::cuda::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        const char letters[3] = {'q', 'k', 'v'};
        for (int s = 0; s < 3; ++s) {
            if (c.rpe_on.find(letters[s]) == std::string::npos) continue;
            rpe::term_spec spec;
            spec.method = rpe::parse_method(c.method);
            spec.contextual = c.contextual;
            spec.target = rpe::parse_target(std::string(1, letters[s]));
            spec.alpha = c.alpha;
            spec.beta = c.beta;
            spec.gamma = c.gamma;
            spec.shared_head = c.shared_head;
            spec.skip = c.skip;
            spec.num_heads = c.heads;
            spec.head_dim = c.head_dim;
            terms[s] = rpe::make_term<float>(spec);
            slots[s]->term = terms[s].get();
            for (const auto& t : c.tables[s]) {
                tables.push_back(std::make_unique<device_vec<float>>(t));
                slots[s]->tables.push_back(tables.back()->cref(terms[s]->table_shape()));
                grads.push_back(std::make_unique<device_vec<float>>(t.size()));
                slots[s]->grad_tables.push_back(grads.back()->ref(terms[s]->table_shape()));
            }
        }
        device_vec<float> dgo(c.grad_out), dgq(c.q.size()), dgk(c.q.size()), dgv(c.q.size());
        rpe::cuda::attention_forward(in, dout.ref(qshape));
        rpe::cuda::attention_backward(in, dgo.cref(qshape), dgq.ref(qshape), dgk.ref(qshape), dgv.ref(qshape));
        auto dbl = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
        check_close(c.name + " output", dbl(dout.host()), c.out.values, c.out.atol, c.out.rtol);
        check_close(c.name + " grad_q", dbl(dgq.host()), c.grad_q.values, c.grad_q.atol, c.grad_q.rtol);
        check_close(c.name + " grad_k", dbl(dgk.host()), c.grad_k.values, c.grad_k.atol, c.grad_k.rtol);
        check_close(c.name + " grad_v", dbl(dgv.host()), c.grad_v.values, c.grad_v.atol, c.grad_v.rtol);
        std::size_t g = 0;
        for (int s = 0; s < 3; ++s)
            for (const auto& e : c.grad_tables[s]) {
                check_close(c.name + " " + e.file, dbl(grads[g]->host()), e.values, e.atol, e.rtol);
                ++g;
            }
    }
}

TEST_SUITE("host") {
TEST_CASE("cuda fused attention checks positions and key_lengths in host memory as the CPU does, before any CUDA call") {
    // host buffers: the shared front's checks throw before any kernel (host memory is read in place)
    std::vector<float> q(2 * 1 * 4 * 2), out(q.size()), table(2 * 50);
    std::vector<std::int32_t> pos = {0, 0, 1, 2, 3, 1}, kpos = {0, 0, 1, 1};
    using P = rpe::mapping::product<rpe::index::piecewise>;
    const rpe::term_desc tk = rpe::make_term_desc(P{rpe::index::piecewise::from_ratio(1.9)}, true, rpe::target::key,
                                                  {.num_heads = 1, .head_dim = 2, .skip = 1});
    rpe::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {2, 1, 4, 2}};
    in.rpe_k = {.term = &tk, .tables = {{table.data(), {1, 2, 50}}}};
    in.positions = rpe::tensor_ref<const std::int32_t>(pos.data(), {3, 2});
    const auto both = [&](const std::string& expected) {
        CHECK_THROWS_WITH_AS(rpe::attention_forward(in, {out.data(), {2, 1, 4, 2}}), doctest::Contains(expected.c_str()),
                             rpe::invalid_argument);
        CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, {out.data(), {2, 1, 4, 2}}), doctest::Contains(expected.c_str()),
                             rpe::invalid_argument);
    };
    in.key_positions = rpe::tensor_ref<const std::int32_t>(kpos.data(), {2, 2});
    both("[rpe.attention] key_positions has shape (2, 2); expected (3 = L - skip = 4 - 1 of rpe_k, 2)");
    in.key_positions = {};
    pos[3] = rpe::max_position + 1;
    both("[rpe.attention] positions[1, 1] = 1048577; expected |value| <= rpe::max_position = 1048576");
    pos[3] = 2;
    const std::vector<std::int32_t> lengths = {4, 5};
    in.key_lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {2});
    both("[rpe.attention] key_lengths[1] = 5; expected 0 <= length <= L = 4");
}

TEST_CASE("cuda attention_forward_uses_tensor_cores: fp16 and bf16 at D a multiple of 16, no value term, aligned, allowed") {
    // host buffers: each of these is refused before any CUDA call
    std::vector<__half> h(2 * 64 + 8);
    std::vector<float> f(2 * 64);
    std::vector<__nv_bfloat16> t(2 * 64);
    const rpe::term_desc tv = rpe::make_term_desc(rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, true,
                                                  rpe::target::value, {.num_heads = 1, .head_dim = 64, .skip = 0});
    const rpe::attention_options on{.tensor_cores = true};
    rpe::attention_inputs<float> fin;
    fin.q = fin.k = fin.v = {f.data(), {1, 1, 2, 64}};
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(fin, on));  // float: SIMT
    rpe::attention_inputs<__half> hin;
    hin.q = hin.k = hin.v = {h.data(), {1, 1, 4, 24}};
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(hin, on));  // D = 24
    hin.q = hin.k = hin.v = {h.data(), {1, 1, 2, 64}};
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(hin, {.tensor_cores = false}));
    const char* env = std::getenv("RPE_CUDA_ATTENTION_TENSOR_CORES");  // the default: on, unless it says 0
    CHECK(rpe::detail::gpu::tensor_cores_by_default() == (env == nullptr || *env == '\0' || std::string(env) != "0"));
    hin.rpe_v = {.term = &tv};
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(hin, on));  // a value term
    hin.rpe_v = {};
    const bool aligned = reinterpret_cast<std::uintptr_t>(h.data()) % 16 == 0;
    hin.v = {h.data() + (aligned ? 1 : 0), {1, 1, 2, 64}};
    if (!aligned) hin.q = hin.k = hin.v;
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(hin, on));  // v not 16-byte aligned
    rpe::attention_inputs<__nv_bfloat16> bin;
    bin.q = bin.k = bin.v = {t.data(), {1, 1, 2, 144}};
    CHECK_FALSE(rpe::cuda::attention_forward_uses_tensor_cores(bin, on));  // D = 144 > 128
}

TEST_CASE("cuda fused attention checks packed sequences in host memory as the CPU does, before any CUDA call") {
    // host buffers: the shared front's checks (check_packed_front, check_packed_term) and what it
    // refuses with packing on both backends (RoPE, key_lengths, keys of another length) throw
    // before any CUDA call, with the CPU's messages
    std::vector<float> q(2 * 1 * 9 * 2), kv(2 * 1 * 8 * 2), out(q.size()), gq(q.size()), gk(q.size()), gv(q.size()),
        table(2 * 50);
    std::vector<std::int32_t> lengths = {5, 4}, grids = {2, 2, 1, 3}, key_lengths = {9, 9};
    const rpe::term_desc tk = rpe::make_term_desc(rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, true,
                                                  rpe::target::key, {.num_heads = 1, .head_dim = 2, .skip = 1});
    rpe::cuda::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {2, 1, 9, 2}};
    in.rpe_k = {.term = &tk, .tables = {{table.data(), {1, 2, 50}}}};
    in.packed.lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {2});
    in.packed.grids = rpe::tensor_ref<const std::int32_t>(grids.data(), {2, 2});
    const rpe::tensor_ref<float> o{out.data(), {2, 1, 9, 2}};
    const auto cuda_backward = [&] {
        rpe::cuda::attention_backward(in, {q.data(), {2, 1, 9, 2}}, {gq.data(), {2, 1, 9, 2}}, {gk.data(), {2, 1, 9, 2}},
                                      {gv.data(), {2, 1, 9, 2}});
    };
    const auto invalid = [&](const std::string& expected) {  // the CPU's message, from both CUDA calls
        CHECK_THROWS_WITH_AS(rpe::attention_forward(in, o), doctest::Contains(expected.c_str()), rpe::invalid_argument);
        CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, o), doctest::Contains(expected.c_str()), rpe::invalid_argument);
        CHECK_THROWS_WITH_AS(cuda_backward(), doctest::Contains(expected.c_str()), rpe::invalid_argument);
    };
    const auto refused = [&](const std::string& feature) {  // refused with packing by both backends
        CHECK_THROWS_WITH_AS(rpe::attention_forward(in, o), (feature + " is not supported by the cpu backend").c_str(),
                             rpe::not_supported);
        CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, o), (feature + " is not supported by the cuda backend").c_str(),
                             rpe::not_supported);
        CHECK_THROWS_WITH_AS(cuda_backward(), (feature + " is not supported by the cuda backend").c_str(), rpe::not_supported);
    };
    lengths[1] = 5;
    invalid("[rpe.attention] packed.lengths sum to 10; expected L = 9 of q (every token in one image)");
    lengths[1] = 4;
    grids[3] = 4;
    invalid(
        "[rpe.attention] packed.grids[1] = (1, 4) gives skip + height*width = 5 tokens of rpe_k; expected "
        "packed.lengths[1] = 4");
    grids[3] = 3;
    in.height = 2;
    invalid("[rpe.attention] height = 2, width = 0, depth = 1 with packed; expected 0, 0, 1");
    in.height = 0;
    in.key_lengths = rpe::tensor_ref<const std::int32_t>(key_lengths.data(), {2});
    refused(
        "[rpe.attention] key_lengths with packed sequences (packed; each image is attended alone, give a "
        "key_padding_mask for padded tokens)");
    in.key_lengths = {};
    in.rope = {.form = rpe::rope::axial{.theta = 100.0f}};
    refused("[rpe.attention] rope with packed sequences (packed)");
    in.rope = {};
    // the probabilities output: the cuda backend has none (with packing or not)
    std::vector<float> attn(2 * 1 * 9 * 9);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, o, {attn.data(), {2, 1, 9, 9}}),
                         "[rpe.attention] the attn output (probabilities) is not supported by the cuda backend",
                         rpe::not_supported);
    // keys of another length with packing: refused by both backends (the shared front)
    in.k = in.v = {kv.data(), {2, 1, 8, 2}};
    in.rpe_k = {};
    in.packed.grids = {};
    const char* packed_cross =
        "[rpe.attention] packed sequences with keys of another length than the queries (L = 9, L_k = 8); "
        "expected L_k = L (each image attends to itself)";
    CHECK_THROWS_WITH_AS(rpe::attention_forward(in, o), packed_cross, rpe::not_supported);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, o), packed_cross, rpe::not_supported);
}

// The message of what `f` throws (rpe::invalid_argument or rpe::not_supported), or "" when it returns.
template <class F>
std::string thrown(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

TEST_CASE("cuda fused attention with keys of another length refuses bad calls as the CPU does, before any CUDA call") {
    // host buffers: nothing reaches the device; each call must throw the CPU's message
    std::vector<float> q(1 * 1 * 6 * 4), kv(1 * 1 * 7 * 4), out(q.size()), g(q.size()), gk(kv.size()), gv(kv.size());
    rpe::attention_inputs<float> in;
    in.q = {q.data(), {1, 1, 6, 4}};
    in.k = in.v = {kv.data(), {1, 1, 7, 4}};
    const auto same = [&](const char* what) {
        INFO(what);
        const std::string cpu = thrown([&] { rpe::attention_forward(in, {out.data(), {1, 1, 6, 4}}); });
        const std::string gpu = thrown([&] { rpe::cuda::attention_forward(in, {out.data(), {1, 1, 6, 4}}); });
        CHECK(!cpu.empty());
        CHECK(gpu == cpu);
        const std::string gpu_b = thrown([&] {
            rpe::cuda::attention_backward(in, {g.data(), {1, 1, 6, 4}}, {out.data(), {1, 1, 6, 4}}, {gk.data(), {1, 1, 7, 4}},
                                          {gv.data(), {1, 1, 7, 4}});
        });
        CHECK(!gpu_b.empty());
    };
    in.v = {q.data(), {1, 1, 6, 4}};  // v of another length than k
    same("v of another length than k");
    in.v = in.k;
    std::vector<float> mask(6 * 6);  // attn_mask (L, L) instead of (L, L_k)
    in.attn_mask = {mask.data(), {6, 6}};
    same("attn_mask (L, L)");
    in.attn_mask = {};
    std::vector<std::int32_t> lengths{8};
    in.key_lengths = {lengths.data(), {1}};
    same("key_lengths above L_k");
    in.key_lengths = {};
    // an iRPE term on a grid: L_k != L needs positions and key_positions
    const auto desc = rpe::make_term_desc(rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, false,
                                          rpe::target::key, {.num_heads = 1, .head_dim = 4, .shared_head = true, .skip = 1});
    std::vector<float> table(static_cast<std::size_t>(count(desc.table_shape())));
    in.rpe_k.term = &desc;
    in.rpe_k.tables = {view<const float>(table.data(), desc.table_shape())};
    in.height = 1;
    in.width = 5;
    same("an iRPE term on a grid");
    std::vector<std::int32_t> pos(10, 0), kpos(2 * 5, 0);
    in.height = in.width = 0;
    in.positions = {pos.data(), {5, 2}};
    in.key_positions = {kpos.data(), {5, 2}};  // 5 keys, L_k - skip = 6 expected
    same("key_positions of another count than L_k - skip");
}
}  // TEST_SUITE("host")

TEST_CASE("cuda fused attention rejects bad arguments") {
    device_vec<float> q(2 * 2 * 10 * 8), out(2 * 2 * 10 * 8), big(1 * 1 * 4 * 256);
    rpe::cuda::attention_inputs<float> in;
    in.q = q.cref({2, 2, 10, 8});
    in.k = q.cref({2, 2, 10, 8});
    in.v = q.cref({2, 2, 9, 8});
    in.height = 3;
    in.width = 3;
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, out.ref({2, 2, 10, 8})),
                         doctest::Contains("[rpe.attention] v has shape"), rpe::invalid_argument);
    in.v = q.cref({2, 2, 10, 8});
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, q.ref({2, 2, 10, 8})), doctest::Contains("overlaps"),
                         rpe::invalid_argument);
    rpe::cuda::attention_inputs<float> wide;
    wide.q = wide.k = wide.v = big.cref({1, 1, 4, 256});
    wide.height = 2;
    wide.width = 2;
    device_vec<float> wout(4 * 256);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(wide, wout.ref({1, 1, 4, 256})), doctest::Contains("head dim D = 256"),
                         rpe::invalid_argument);
}
