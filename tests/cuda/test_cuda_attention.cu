// The fused CUDA attention forward and backward against the CPU fused attention
// (rpe::attention_forward / attention_backward, gradients of q, k, v and every table):
// random inputs with iRPE on q, k, v (contextual and bias, shared and per head, Cross, skip
// tokens, key padding mask with an all-masked row, additive attn_mask) in float, double, fp16
// and bf16; and the golden attention vectors' output in float32.
#include <doctest/doctest.h>

#include <rpe/cuda.cuh>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <cmath>
#include <limits>
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
    for (int s = 0; s < 3; ++s) {
        if (!cfg_terms[s]) continue;
        gslots[s]->term = cfg_terms[s].get();
        for (const auto& t : tables[s]) {
            dtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(t)));
            gslots[s]->tables.push_back(dtables.back()->cref(cfg_terms[s]->table_shape()));
            dgtables.push_back(std::make_unique<device_vec<S>>(to_storage<S>(std::vector<float>(t.size(), 99.f))));
            gslots[s]->grad_tables.push_back(dgtables.back()->ref(cfg_terms[s]->table_shape()));
        }
    }
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    rpe::cuda::attention_forward(gin, dout.ref(qshape), {}, {.stream = stream});
    rpe::cuda::attention_backward(gin, dgout.cref(qshape), dgq.ref(qshape), dgk.ref(qshape), dgv.ref(qshape), {.stream = stream});
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    // tolerance: logits are sums of D products (the RPE terms add a few more); the output a sum of
    // L probabilities times values (plus K bucket sums)
    const double u = rpe::cuda::unit_roundoff<S>();
    const bool low = std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
    const double n = static_cast<double>(d + l);
    const double eps = (low ? 4.0 : 16.0) * u * std::sqrt(n);
    std::vector<double> expected(cout.begin(), cout.end());
    double s2 = 0;
    for (double x : expected) s2 += x * x;
    const double rms = std::sqrt(s2 / static_cast<double>(expected.size()));
    check_close("out", to_double(dout.host()), expected, eps * rms, eps);
    auto check_vs = [&](const std::string& what, const std::vector<double>& gpu, const std::vector<C>& cpu, double len) {
        const double e = (low ? 4.0 : 16.0) * u * std::sqrt(len);
        std::vector<double> ex(cpu.begin(), cpu.end());
        double ss = 0;
        for (double x : ex) ss += x * x;
        check_close(what, gpu, ex, e * std::sqrt(ss / static_cast<double>(std::max<std::size_t>(ex.size(), 1))), e);
    };
    check_vs("grad_q", to_double(dgq.host()), cgq, n);
    check_vs("grad_k", to_double(dgk.host()), cgk, n);
    check_vs("grad_v", to_double(dgv.host()), cgv, n);
    std::size_t u_index = 0;
    for (int s = 0; s < 3; ++s)
        for (std::size_t t = 0; t < cgtables[s].size(); ++t)
            check_vs(std::string("grad table ") + "qkv"[s] + std::to_string(t), to_double(dgtables[u_index++]->host()),
                     cgtables[s][t], static_cast<double>(b * h * l * l));
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

}  // namespace

TEST_CASE_TEMPLATE("cuda fused attention forward and backward match the CPU fused attention", S, float, double, __half,
                   __nv_bfloat16) {
    attention_suite<S>(300);
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
TEST_CASE("cuda fused attention refuses per-token positions of the iRPE terms before any CUDA call") {
    // host buffers: the shared front refuses the feature from cuda::attention_caps before any CUDA call
    std::vector<float> q(1 * 1 * 4 * 2), out(q.size()), table(2 * 50);
    const std::vector<std::int32_t> pos = {0, 0, 1, 2, 3, 1};
    using P = rpe::mapping::product<rpe::index::piecewise>;
    const rpe::term_desc tk = rpe::make_term_desc(P{rpe::index::piecewise::from_ratio(1.9)}, true, rpe::target::key,
                                                  {.num_heads = 1, .head_dim = 2, .skip = 1});
    rpe::cuda::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {1, 1, 4, 2}};
    in.rpe_k = {.term = &tk, .tables = {{table.data(), {1, 2, 50}}}};
    in.positions = rpe::tensor_ref<const std::int32_t>(pos.data(), {3, 2});
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, {out.data(), {1, 1, 4, 2}}),
                         "[rpe.attention] per-token positions of the iRPE terms (positions) is not supported by the cuda backend",
                         rpe::not_supported);
}

TEST_CASE("cuda fused attention refuses packed sequences and key lengths before any CUDA call") {
    // host buffers: the shared front refuses both features from cuda::attention_caps before any CUDA call
    std::vector<float> q(1 * 1 * 5 * 2), out(q.size()), gq(q.size()), gk(q.size()), gv(q.size());
    const std::vector<std::int32_t> lengths = {3, 2}, key_lengths = {4};
    rpe::cuda::attention_inputs<float> in;
    in.q = in.k = in.v = {q.data(), {1, 1, 5, 2}};
    in.packed.lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {2});
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, {out.data(), {1, 1, 5, 2}}),
                         "[rpe.attention] packed sequences (packed) is not supported by the cuda backend", rpe::not_supported);
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_backward(in, {q.data(), {1, 1, 5, 2}}, {gq.data(), {1, 1, 5, 2}},
                                                       {gk.data(), {1, 1, 5, 2}}, {gv.data(), {1, 1, 5, 2}}),
                         "[rpe.attention] packed sequences (packed) is not supported by the cuda backend", rpe::not_supported);
    in.packed = {};
    in.height = 2;
    in.width = 2;
    in.key_lengths = rpe::tensor_ref<const std::int32_t>(key_lengths.data(), {1});
    CHECK_THROWS_WITH_AS(rpe::cuda::attention_forward(in, {out.data(), {1, 1, 5, 2}}),
                         "[rpe.attention] valid key lengths (key_lengths) is not supported by the cuda backend",
                         rpe::not_supported);
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
