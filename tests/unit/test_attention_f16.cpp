// The fused attention on rpe::f16 (IEEE binary16) storage: rpe::attention_forward /
// attention_backward with S = rpe::f16. The f16 path converts its inputs to float (exactly), runs
// the float kernels and rounds each output once, so:
// (1) every f16 output (out, attn, grad_q, grad_k, grad_v, the table and RoPE-frequency
//     gradients) is, bit for bit, the f16 rounding of the float path's result on the same values
//     (the f16 inputs as floats, contiguous); strided q/k/v, 1 or 2 threads and any partials
//     budget give the same bits;
// (2) against the float64 composed attention on the same values, each output element satisfies
//     |out − ref| ≤ u·|ref| + 2^-25 + 1e-5·(1 + |ref| + Σ_j p_ij·|v_jd|), u = 2^-11 the one f16
//     rounding (11 significant bits; 2^-25: half the subnormal step, for outputs below 2^-14), the
//     last term the float path's error (as in the bf16 tests); each probability
//     |attn − ref| ≤ u·ref + 2^-25 + 1e-6; each gradient |g − ref| ≤ u·|ref| + 2^-25 +
//     16·N·2^-24·max|G_ref| (N = L + D + K summed terms, as the bf16 backward's tests);
// (3) bad arguments are refused naming the argument, before any output is written, and mixed
//     scalar types do not compile. Cases: no RPE, contextual Product on k and on q, k, v, bias and
//     Cross terms, shared and per-head tables, skip tokens, both masks, odd D, RoPE (axial; mixed
//     with its frequency gradient), key_lengths, packed sequences, saved probabilities.
#include <doctest/doctest.h>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_paths.hpp"
#include "golden.hpp"
#include "half_attention_checks.hpp"
#include "half_checks.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_attention_f16 {

namespace {

using rpe::f16;
constexpr double u_f16 = 1.0 / 2048;  // 2^-11
constexpr double sub_f16 = 0x1p-25;   // half the subnormal step

template <class T, class U>
rpe::tensor_ref<T> view_as(T* data, const rpe::tensor_ref<U>& t) {
    rpe::tensor_ref<T> r;
    r.data = data;
    r.rank = t.rank;
    r.shape = t.shape;
    return r;
}

// One attention problem with the same values (f16-rounded N(0, σ²) draws) in f16, float and double.
struct tri_case {
    std::int64_t b = 0, h = 0, l = 0, d = 0;
    std::vector<f16> q, k, v, mask, freqs;
    std::vector<float> qf, kf, vf, maskf, freqsf;
    std::vector<double> qd, kd, vd, maskd, freqsd;
    std::vector<std::uint8_t> kpm;
    std::vector<std::vector<f16>> tables;
    std::vector<std::vector<float>> tables_f;
    std::vector<std::vector<double>> tables_d;
    std::vector<std::unique_ptr<rpe::any_term<double>>> terms;
    rpe::attention_inputs<f16> in;
    rpe::attention_inputs<float> inf;
    rpe::attention_inputs<double> ind;
    std::mt19937 rng;

    tri_case(std::int64_t b_, std::int64_t h_, std::int64_t d_, int height, int width, int skip, std::uint32_t seed)
        : b(b_), h(h_), l(skip + height * width), d(d_), rng(seed) {
        const std::int64_t n = b * h * l * d;
        fill(q, qf, qd, n, 1.0);
        fill(k, kf, kd, n, 1.0);
        fill(v, vf, vd, n, 1.0);
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        inf.q = {qf.data(), {b, h, l, d}};
        inf.k = {kf.data(), {b, h, l, d}};
        inf.v = {vf.data(), {b, h, l, d}};
        ind.q = {qd.data(), {b, h, l, d}};
        ind.k = {kd.data(), {b, h, l, d}};
        ind.v = {vd.data(), {b, h, l, d}};
        in.height = inf.height = ind.height = height;
        in.width = inf.width = ind.width = width;
        tables.reserve(6);
        tables_f.reserve(6);
        tables_d.reserve(6);
    }
    void fill(std::vector<f16>& x, std::vector<float>& y, std::vector<double>& z, std::int64_t n, double sigma) {
        std::normal_distribution<double> normal(0.0, sigma);
        x.resize(static_cast<std::size_t>(n));
        y.resize(x.size());
        z.resize(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) {
            x[i] = f16(static_cast<float>(normal(rng)));
            y[i] = static_cast<float>(x[i]);
            z[i] = static_cast<double>(x[i]);
        }
    }
    void add_term(rpe::method method, bool contextual, rpe::target target, bool shared, int skip) {
        rpe::term_spec spec;
        spec.method = method;
        spec.contextual = contextual;
        spec.target = target;
        spec.ratio(1.9);
        spec.shared_head = shared;
        spec.skip = skip;
        spec.num_heads = static_cast<int>(h);
        spec.head_dim = static_cast<int>(d);
        terms.push_back(rpe::make_term<double>(spec));
        const auto& t = *terms.back();
        const int s = target == rpe::target::query ? 0 : target == rpe::target::key ? 1 : 2;
        rpe::attention_term<f16>* slot[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        rpe::attention_term<float>* slot_f[] = {&inf.rpe_q, &inf.rpe_k, &inf.rpe_v};
        rpe::attention_term<double>* slot_d[] = {&ind.rpe_q, &ind.rpe_k, &ind.rpe_v};
        slot[s]->term = slot_f[s]->term = slot_d[s]->term = &t;  // one descriptor serves every scalar type
        const auto shape = t.table_shape();
        std::int64_t size = 1;
        for (auto e : shape) size *= e;
        rpe::tensor_ref<const double> like;
        like.rank = static_cast<int>(shape.size());
        for (std::size_t i = 0; i < shape.size(); ++i) like.shape[i] = shape[i];
        for (int n = 0; n < t.num_tables(); ++n) {
            fill(tables.emplace_back(), tables_f.emplace_back(), tables_d.emplace_back(), size, 0.5);
            slot[s]->tables.push_back(view_as<const f16>(tables.back().data(), like));
            slot_f[s]->tables.push_back(view_as<const float>(tables_f.back().data(), like));
            slot_d[s]->tables.push_back(view_as<const double>(tables_d.back().data(), like));
        }
    }
    void add_key_padding_mask(bool whole_batch_element) {
        kpm.resize(static_cast<std::size_t>(b * l));
        std::uniform_int_distribution<int> coin(0, 3);
        for (auto& m : kpm) m = static_cast<std::uint8_t>(coin(rng) == 0);
        if (whole_batch_element) std::fill(kpm.begin(), kpm.begin() + l, std::uint8_t{1});  // fully masked rows
        in.key_padding_mask = inf.key_padding_mask = ind.key_padding_mask = {kpm.data(), {b, l}};
    }
    void add_attn_mask() {
        fill(mask, maskf, maskd, l * l, 1.0);
        std::uniform_int_distribution<int> die(0, 5);
        for (std::size_t i = 0; i < mask.size(); ++i)
            if (die(rng) == 0) {
                mask[i] = f16(-std::numeric_limits<float>::infinity());
                maskf[i] = -std::numeric_limits<float>::infinity();
                maskd[i] = -std::numeric_limits<double>::infinity();
            }
        in.attn_mask = {mask.data(), {l, l}};
        inf.attn_mask = {maskf.data(), {l, l}};
        ind.attn_mask = {maskd.data(), {l, l}};
    }
    template <class F>
    void set_rope(F form, int skip, bool with_freqs) {
        in.rope = {.form = form, .skip = skip};
        inf.rope = {.form = form, .skip = skip};
        ind.rope = {.form = form, .skip = skip};
        if (with_freqs) {
            fill(freqs, freqsf, freqsd, 2 * h * d / 2, 0.5);
            in.rope.freqs = {freqs.data(), {2, h, d / 2}};
            inf.rope.freqs = {freqsf.data(), {2, h, d / 2}};
            ind.rope.freqs = {freqsd.data(), {2, h, d / 2}};
        }
    }
};

template <class T>
struct fwd {
    std::vector<T> out, attn;
};

// attention_forward on `in` (attn requested unless packed; for double the composed attention,
// attn always).
template <class T>
fwd<T> forward_of(const rpe::attention_inputs<T>& in, const rpe::attention_options& opt = {}) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), l = in.q.extent(2), d = in.q.extent(3);
    fwd<T> r;
    r.out.assign(static_cast<std::size_t>(b * h * l * d), T(-3.0f));
    rpe::tensor_ref<T> attn;
    if (!in.packed.enabled() || std::is_same_v<T, double>) {
        r.attn.assign(static_cast<std::size_t>(b * h * l * l), T(-3.0f));
        attn = rpe::tensor_ref<T>(r.attn.data(), {b, h, l, l});
    }
    if constexpr (std::is_same_v<T, double>)
        rpe::composed_attention_forward(in, rpe::tensor_ref<T>(r.out.data(), {b, h, l, d}), attn, opt);
    else
        rpe::attention_forward(in, rpe::tensor_ref<T>(r.out.data(), {b, h, l, d}), attn, opt);
    return r;
}

// Whether every f16 value is the float one rounded once (bit for bit); whether two hold the same bits.
using rpe_test::rounded_from;
using rpe_test::same_bits;

// The f16 forward of the case: (1) the float forward rounded once, bit for bit; (2) within the
// float64 bound of the file comment. Returns the worst |out − ref| / bound.
double check_forward(tri_case& c, const rpe::attention_options& opt = {}) {
    const auto got = forward_of(c.in, opt);
    const auto fl = forward_of(c.inf, opt);
    CHECK(rounded_from(got.out, fl.out));
    CHECK(rounded_from(got.attn, fl.attn));
    const auto ref = forward_of(c.ind, opt);
    double worst = 0;
    for (std::int64_t p = 0; p < c.b * c.h; ++p)
        for (std::int64_t i = 0; i < c.l; ++i)
            for (std::int64_t e = 0; e < c.d; ++e) {
                double pv = 0;  // Σ_j p_ij·|v_je|: the scale of the float path's error
                for (std::int64_t j = 0; j < c.l; ++j)
                    pv += ref.attn[static_cast<std::size_t>((p * c.l + i) * c.l + j)] *
                          std::fabs(c.vd[static_cast<std::size_t>((p * c.l + j) * c.d + e)]);
                const std::size_t x = static_cast<std::size_t>((p * c.l + i) * c.d + e);
                const double r = std::fabs(ref.out[x]);
                const double bound = u_f16 * r + sub_f16 + 1e-5 * (1 + r + pv);
                const double g = static_cast<double>(got.out[x]);
                REQUIRE(std::isfinite(g));
                worst = std::max(worst, std::fabs(g - ref.out[x]) / bound);
            }
    double worst_p = 0;  // the probabilities (none with packed sequences)
    for (std::size_t x = 0; x < got.attn.size(); ++x)
        worst_p =
            std::max(worst_p, std::fabs(static_cast<double>(got.attn[x]) - ref.attn[x]) / (u_f16 * ref.attn[x] + sub_f16 + 1e-6));
    CHECK(worst <= 1.0);
    CHECK(worst_p <= 1.0);
    return worst;
}

// The gradients of one backward call: q, k, v, every table (slot order q, k, v), rope freqs.
template <class T>
struct grads {
    std::vector<T> q, k, v, freqs;
    std::vector<std::vector<T>> tables;
};

// attention_backward on `in` (for double: the composed forward then its backward) with every
// table's gradient and, for rope::mixed, the frequencies' gradient requested.
template <class T>
grads<T> backward_of(rpe::attention_inputs<T> in, const std::vector<T>& go, const rpe::attention_options& opt = {},
                     const std::vector<T>* saved = nullptr) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), l = in.q.extent(2), d = in.q.extent(3);
    grads<T> g;
    const std::size_t n = static_cast<std::size_t>(b * h * l * d);
    g.q.assign(n, T(-3.0f));
    g.k.assign(n, T(-3.0f));
    g.v.assign(n, T(-3.0f));
    g.tables.reserve(6);
    for (auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) {
        slot->grad_tables.clear();
        for (const auto& t : slot->tables) {
            g.tables.emplace_back(static_cast<std::size_t>(t.size()), T(-3.0f));
            slot->grad_tables.push_back(view_as<T>(g.tables.back().data(), t));
        }
    }
    if (in.rope.is_mixed()) {
        g.freqs.assign(static_cast<std::size_t>(in.rope.freqs.size()), T(-3.0f));
        in.rope.grad_freqs = view_as<T>(g.freqs.data(), in.rope.freqs);
    }
    rpe::attention_gradients<T> ag{.grad_out = rpe::tensor_ref<const T>(go.data(), {b, h, l, d}),
                                   .grad_q = rpe::tensor_ref<T>(g.q.data(), {b, h, l, d}),
                                   .grad_k = rpe::tensor_ref<T>(g.k.data(), {b, h, l, d}),
                                   .grad_v = rpe::tensor_ref<T>(g.v.data(), {b, h, l, d})};
    std::vector<T> attn;
    if constexpr (std::is_same_v<T, double>) {
        std::vector<T> out(n);
        attn.assign(static_cast<std::size_t>(b * h * l * l), 0.0);
        rpe::composed_attention_forward(in, rpe::tensor_ref<T>(out.data(), {b, h, l, d}),
                                        rpe::tensor_ref<T>(attn.data(), {b, h, l, l}), opt);
        ag.saved_attn = rpe::tensor_ref<const T>(attn.data(), {b, h, l, l});
        rpe::composed_attention_backward(in, ag, opt);
    } else {
        if (saved) ag.saved_attn = rpe::tensor_ref<const T>(saved->data(), {b, h, l, l});
        rpe::attention_backward(in, ag, opt);
    }
    return g;
}

bool same_grads(const grads<f16>& a, const grads<f16>& b) {
    if (!(same_bits(a.q, b.q) && same_bits(a.k, b.k) && same_bits(a.v, b.v) && same_bits(a.freqs, b.freqs))) return false;
    if (a.tables.size() != b.tables.size()) return false;
    for (std::size_t t = 0; t < a.tables.size(); ++t)
        if (!same_bits(a.tables[t], b.tables[t])) return false;
    return true;
}

// Worst |got − ref| / (u·|ref| + 2^-25 + 16·N·2^-24·max|ref|) over one gradient tensor (≤ 1 passes).
using rpe_test::worst_ratio;

struct backward_check {
    grads<f16> got;
    double worst = 0;
};

// The case's f16 backward: (1) the float backward rounded once, bit for bit, every gradient;
// (2) within the float64 composed backward's bound. Returns the gradients and the worst ratio.
backward_check check_backward(tri_case& c, const rpe::attention_options& opt = {}) {
    std::vector<f16> go;
    std::vector<float> gof;
    std::vector<double> god;
    c.fill(go, gof, god, c.b * c.h * c.l * c.d, 1.0);
    backward_check r;
    r.got = backward_of(c.in, go, opt);
    const auto fl = backward_of(c.inf, gof, opt);
    CHECK(rounded_from(r.got.q, fl.q));
    CHECK(rounded_from(r.got.k, fl.k));
    CHECK(rounded_from(r.got.v, fl.v));
    CHECK(rounded_from(r.got.freqs, fl.freqs));
    REQUIRE(r.got.tables.size() == fl.tables.size());
    for (std::size_t t = 0; t < fl.tables.size(); ++t) CHECK(rounded_from(r.got.tables[t], fl.tables[t]));
    const auto ref = backward_of(c.ind, god, opt);
    std::int64_t k = 0;
    for (const auto& t : c.terms) k = std::max<std::int64_t>(k, t->num_buckets());
    const std::int64_t n_sum = c.l + c.d + k;
    r.worst =
        std::max({worst_ratio(r.got.q, ref.q, n_sum), worst_ratio(r.got.k, ref.k, n_sum), worst_ratio(r.got.v, ref.v, n_sum)});
    if (!ref.freqs.empty()) r.worst = std::max(r.worst, worst_ratio(r.got.freqs, ref.freqs, n_sum * c.b * c.l));
    for (std::size_t t = 0; t < ref.tables.size(); ++t)  // a table's gradient sums over B·H·L·L pairs
        r.worst = std::max(r.worst, worst_ratio(r.got.tables[t], ref.tables[t], n_sum * c.b * c.h * c.l));
    CHECK(r.worst <= 1.0);
    return r;
}

struct config {
    const char* name;
    std::int64_t b, h, d;
    int height, width, skip;
    const char* terms;  // "k", "qkv": contextual Product; "Bk", "Bq": bias Euclidean; "Cq", "Cqkv": Cross
    bool shared, kpm, attn_mask;
};

const config configs[] = {
    {"none", 2, 3, 16, 3, 4, 1, "", true, false, false},
    {"k shared", 2, 3, 16, 4, 4, 1, "k", true, false, false},
    {"k per head, no skip", 1, 2, 8, 5, 3, 0, "k", false, false, false},
    {"qkv shared", 2, 2, 8, 4, 5, 1, "qkv", true, false, false},
    {"qkv per head, masks", 2, 2, 6, 3, 3, 1, "qkv", false, true, true},
    {"bias k, odd D", 1, 3, 5, 4, 4, 1, "Bk", false, false, true},
    {"bias q, no skip", 2, 2, 8, 3, 3, 0, "Bq", true, true, false},
    {"Cross q, skip 2", 2, 2, 8, 3, 4, 2, "Cq", true, true, false},
    {"Cross qkv, skip 2", 2, 2, 8, 3, 4, 2, "Cqkv", false, false, false},
    {"deit-like k, D 64", 1, 2, 64, 7, 7, 1, "k", true, false, false},
};

void add_terms(tri_case& c, const config& cf) {
    const std::string t = cf.terms;
    const rpe::target all[] = {rpe::target::query, rpe::target::key, rpe::target::value};
    if (t == "k") c.add_term(rpe::method::product, true, rpe::target::key, cf.shared, cf.skip);
    if (t == "qkv")
        for (auto tg : all) c.add_term(rpe::method::product, true, tg, cf.shared, cf.skip);
    if (t == "Bk") c.add_term(rpe::method::euclidean, false, rpe::target::key, cf.shared, cf.skip);
    if (t == "Bq") c.add_term(rpe::method::euclidean, false, rpe::target::query, cf.shared, cf.skip);
    if (t == "Cq") c.add_term(rpe::method::cross, true, rpe::target::query, cf.shared, cf.skip);
    if (t == "Cqkv")
        for (auto tg : all) c.add_term(rpe::method::cross, true, tg, cf.shared, cf.skip);
    if (cf.kpm) c.add_key_padding_mask(true);
    if (cf.attn_mask) c.add_attn_mask();
}

}  // namespace

TEST_CASE("f16 attention forward: the float forward rounded once; within one f16 rounding of the float64 composed attention") {
    double worst = 0;
    for (const auto& cf : configs) {
        CAPTURE(cf.name);
        tri_case c(cf.b, cf.h, cf.d, cf.height, cf.width, cf.skip, 11);
        add_terms(c, cf);
        const double w = check_forward(c);
        worst = std::max(worst, w);
        MESSAGE(std::string(cf.name) << ": worst |out - ref| / bound " << w);
    }
    MESSAGE("f16 forward: worst |out - ref| / bound " << worst);
}

TEST_CASE("f16 attention forward: row blocks, strided q, k, v and 1 or 2 threads give the same bits") {
    tri_case c(2, 2, 8, 4, 4, 1, 5);
    c.add_term(rpe::method::product, true, rpe::target::query, false, 1);
    c.add_term(rpe::method::product, true, rpe::target::key, false, 1);
    c.add_term(rpe::method::product, true, rpe::target::value, true, 1);
    c.add_key_padding_mask(false);
    rpe_test::set_threads(1);
    const auto one = forward_of(c.in);
    rpe_test::set_threads(2);
    const auto two = forward_of(c.in);
    CHECK(same_bits(one.out, two.out));
    CHECK(same_bits(one.attn, two.attn));
    check_forward(c, {.row_block = 3});
    // the same q, k, v read in place from a packed (B, L, 3, H, D) buffer
    std::vector<f16> packed(static_cast<std::size_t>(c.b * c.l * 3 * c.h * c.d));
    for (std::int64_t bb = 0; bb < c.b; ++bb)
        for (std::int64_t hh = 0; hh < c.h; ++hh)
            for (std::int64_t i = 0; i < c.l; ++i)
                for (std::int64_t e = 0; e < c.d; ++e) {
                    const std::size_t src = static_cast<std::size_t>(((bb * c.h + hh) * c.l + i) * c.d + e);
                    const std::size_t dst = static_cast<std::size_t>((((bb * c.l + i) * 3) * c.h + hh) * c.d + e);
                    packed[dst] = c.q[src];
                    packed[dst + static_cast<std::size_t>(c.h * c.d)] = c.k[src];
                    packed[dst + static_cast<std::size_t>(2 * c.h * c.d)] = c.v[src];
                }
    const std::int64_t sb = c.l * 3 * c.h * c.d, sh = c.d, sl = 3 * c.h * c.d;
    auto strided = c.in;
    strided.q = rpe::tensor_ref<const f16>::with_strides(packed.data(), {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
    strided.k = rpe::tensor_ref<const f16>::with_strides(packed.data() + c.h * c.d, {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
    strided.v = rpe::tensor_ref<const f16>::with_strides(packed.data() + 2 * c.h * c.d, {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
    const auto s = forward_of(strided);
    CHECK(same_bits(one.out, s.out));
    CHECK(same_bits(one.attn, s.attn));
    // the backward too, with the smallest partials budget (items in waves of one)
    std::vector<f16> go;
    std::vector<float> gof;
    std::vector<double> god;
    c.fill(go, gof, god, c.b * c.h * c.l * c.d, 1.0);
    rpe_test::set_threads(1);
    const auto g1 = backward_of(c.in, go);
    rpe_test::set_threads(2);
    CHECK(same_grads(g1, backward_of(c.in, go)));
    CHECK(same_grads(g1, backward_of(strided, go)));
    CHECK(same_grads(g1, backward_of(c.in, go, {.backward_budget_bytes = 1})));
    // the partials' plan counts float values for f16 (its backward runs in float), as for float
    auto plain = c.inf;
    for (auto* slot : {&plain.rpe_q, &plain.rpe_k, &plain.rpe_v}) slot->grad_tables.clear();
    const auto ph = rpe::cpu::plan_backward_scratch(c.in), pf = rpe::cpu::plan_backward_scratch(plain);
    CHECK(ph.bytes == pf.bytes);
    CHECK(ph.items == pf.items);
}

TEST_CASE("f16 attention forward in chunks of batch elements: the same bits as in one chunk") {
    // half_forward_chunk_bytes bounds the float copies the forward holds: 1 byte gives one batch
    // element per chunk; key_padding_mask and key_lengths are cut per chunk, q, k, v read strided
    tri_case c(3, 2, 8, 3, 4, 1, 19);
    for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value})
        c.add_term(rpe::method::product, true, tg, false, 1);
    c.add_key_padding_mask(false);
    c.add_attn_mask();
    for (std::int64_t bb = 0; bb < c.b; ++bb) c.kpm[static_cast<std::size_t>(bb * c.l)] = 0;  // no fully masked row
    const std::vector<std::int32_t> lengths{13, 7, 10};
    c.in.key_lengths = c.inf.key_lengths = c.ind.key_lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {c.b});
    const auto whole = forward_of(c.in);
    check_forward(c);
    rpe_test::check_chunked_forward(c.in, whole.out, whole.attn);
}

TEST_CASE("f16 attention with RoPE, key_lengths and packed sequences: the float path rounded once") {
    SUBCASE("RoPE axial, contextual Product on k") {
        tri_case c(1, 2, 8, 4, 4, 1, 9);
        c.add_term(rpe::method::product, true, rpe::target::key, true, 1);
        c.set_rope(rpe::rope::axial{.theta = 100.0f}, 1, false);
        check_forward(c);
        const auto r = check_backward(c);
        MESSAGE("RoPE axial backward: worst |grad - ref| / bound " << r.worst);
    }
    SUBCASE("rope::mixed with its frequencies in f16 and their gradient") {
        tri_case c(2, 2, 8, 3, 4, 1, 41);
        c.add_term(rpe::method::product, true, rpe::target::key, true, 1);
        c.set_rope(rpe::rope::mixed{}, 1, true);
        check_forward(c);
        const auto r = check_backward(c);
        CHECK(r.got.freqs.size() == c.freqs.size());
        MESSAGE("rope::mixed backward: worst |grad - ref| / bound " << r.worst);
    }
    SUBCASE("key_lengths (qkv contextual Product)") {
        tri_case c(3, 2, 8, 4, 4, 1, 21);  // L = 17
        for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value})
            c.add_term(rpe::method::product, true, tg, true, 1);
        const std::vector<std::int32_t> lengths{5, 17, 1};
        c.in.key_lengths = c.inf.key_lengths = c.ind.key_lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {c.b});
        check_forward(c);
        const auto r = check_backward(c);
        bool zero = true;  // padded keys get exactly zero grad_k and grad_v
        for (std::int64_t p = 0; p < c.b * c.h; ++p)
            for (std::int64_t j = lengths[static_cast<std::size_t>(p / c.h)]; j < c.l; ++j)
                for (std::int64_t e = 0; e < c.d; ++e) {
                    const std::size_t x = static_cast<std::size_t>((p * c.l + j) * c.d + e);
                    zero = zero && r.got.k[x].bits == 0 && r.got.v[x].bits == 0;
                }
        CHECK(zero);
    }
    SUBCASE("packed: 3 images (grids 2x3, 3x3, 1x4, a class token each), Product on k and v") {
        tri_case c(2, 2, 8, 1, 21, 1, 23);  // L = 7 + 10 + 5 = 22
        c.add_term(rpe::method::product, true, rpe::target::key, false, 1);
        c.add_term(rpe::method::product, true, rpe::target::value, true, 1);
        const std::vector<std::int32_t> lengths{7, 10, 5}, grids{2, 3, 3, 3, 1, 4};
        for (auto* p : {&c.in.packed, &c.inf.packed, &c.ind.packed}) {
            p->lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {3});
            p->grids = rpe::tensor_ref<const std::int32_t>(grids.data(), {3, 2});
        }
        c.in.height = c.in.width = c.inf.height = c.inf.width = c.ind.height = c.ind.width = 0;
        check_forward(c);
        const auto r = check_backward(c);
        MESSAGE("packed backward: worst |grad - ref| / bound " << r.worst);
    }
}

TEST_CASE("f16 attention backward: the float backward rounded once; within one f16 rounding of the float64 composed backward") {
    double worst = 0;
    for (const auto& cf : configs) {
        CAPTURE(cf.name);
        tri_case c(cf.b, cf.h, cf.d, cf.height, cf.width, cf.skip, 13);
        add_terms(c, cf);
        const auto r = check_backward(c);
        worst = std::max(worst, r.worst);
        MESSAGE(std::string(cf.name) << ": worst |grad - ref| / bound " << r.worst);
    }
    MESSAGE("f16 backward: worst |grad - ref| / bound " << worst);
}

TEST_CASE("f16 attention backward from saved probabilities: the float backward on the same saved values") {
    tri_case c(2, 2, 8, 3, 4, 1, 31);
    for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value})
        c.add_term(rpe::method::product, true, tg, true, 1);
    std::vector<f16> go;
    std::vector<float> gof;
    std::vector<double> god;
    c.fill(go, gof, god, c.b * c.h * c.l * c.d, 1.0);
    const auto fw = forward_of(c.in);  // the f16 forward's probabilities, rounded to f16
    const auto got = backward_of(c.in, go, {}, &fw.attn);
    std::vector<float> saved(fw.attn.size());
    for (std::size_t i = 0; i < saved.size(); ++i) saved[i] = static_cast<float>(fw.attn[i]);
    const auto fl = backward_of(c.inf, gof, {}, &saved);
    CHECK(rounded_from(got.q, fl.q));
    CHECK(rounded_from(got.k, fl.k));
    CHECK(rounded_from(got.v, fl.v));
    for (std::size_t t = 0; t < fl.tables.size(); ++t) CHECK(rounded_from(got.tables[t], fl.tables[t]));
    // against float64 (recomputed probabilities): the saved probabilities carry an f16 rounding
    // each (relative u), which moves the gradients by about u times their size: within 4u·max|G|
    const auto ref = backward_of(c.ind, god);
    double worst = 0;
    for (const auto& [g, r] : {std::pair{&got.q, &ref.q}, std::pair{&got.k, &ref.k}, std::pair{&got.v, &ref.v}}) {
        double most = 0, err = 0;
        for (std::size_t i = 0; i < r->size(); ++i) {
            most = std::max(most, std::fabs((*r)[i]));
            err = std::max(err, std::fabs(static_cast<double>((*g)[i]) - (*r)[i]));
        }
        worst = std::max(worst, err / (4 * u_f16 * most));
    }
    CHECK(worst <= 1.0);
    MESSAGE("saved_attn in f16: worst |grad - ref| / (4u max|grad|) " << worst);
}

TEST_CASE("f16 attention: outputs beyond the f16 range are infinite, as any f16 rounding") {
    // v = 60000 everywhere (an f16 value) and a bias value term adding ≥ 6000: every output is
    // above 65520 in float, so its f16 is +∞ (the float path itself is finite)
    tri_case c(1, 1, 4, 2, 2, 0, 3);
    std::fill(c.v.begin(), c.v.end(), f16(60000.0f));
    std::fill(c.vf.begin(), c.vf.end(), 60000.0f);
    c.add_term(rpe::method::product, true, rpe::target::value, true, 0);
    std::fill(c.tables.back().begin(), c.tables.back().end(), f16(8000.0f));
    std::fill(c.tables_f.back().begin(), c.tables_f.back().end(), 8000.0f);
    const auto got = forward_of(c.in);
    const auto fl = forward_of(c.inf);
    CHECK(rounded_from(got.out, fl.out));
    bool all_inf = true;
    for (std::size_t i = 0; i < got.out.size(); ++i)
        all_inf = all_inf && got.out[i].bits == 0x7c00 && std::isfinite(fl.out[i]) && fl.out[i] >= 65520.0f;
    CHECK(all_inf);
}

namespace {

// A golden attention case in f16: q, k, v and the tables (float files) rounded to f16; the terms
// from rpe::make_term (their spec from meta.json). check_forward's two checks, then against the
// golden output itself (float64 from the unrounded inputs): rounding the inputs to f16 (relative
// 2^-11) moves the logits by about 2^-10·s·Σ|q||k| and the outputs by about that times |v| (the
// bf16 test's 2^-5 for u = 2^-8, scaled by 2^-3): within 2^-8·(1 + |golden|).
void run_golden_f16(const std::string& dir, double& worst_kernel, double& worst_golden) {
    using json = nlohmann::json;
    const json meta = rpe_test::read_meta<json>(dir);
    const std::int64_t b = meta.at("batch").get<std::int64_t>(), h = meta.at("heads").get<std::int64_t>(),
                       l = meta.at("L").get<std::int64_t>(), d = meta.at("head_dim").get<std::int64_t>();
    const int height = meta.at("height").get<int>(), width = meta.at("width").get<int>(), skip = meta.at("skip").get<int>();
    tri_case c(b, h, d, height, width, skip, 1);
    REQUIRE(c.l == l);
    const std::vector<std::int64_t> qshape{b, h, l, d};
    auto round_into = [](const std::vector<float>& src, std::vector<f16>& x, std::vector<float>& y, std::vector<double>& z) {
        x.resize(src.size());
        y.resize(src.size());
        z.resize(src.size());
        for (std::size_t i = 0; i < src.size(); ++i) {
            x[i] = f16(src[i]);
            y[i] = static_cast<float>(x[i]);
            z[i] = static_cast<double>(x[i]);
        }
    };
    round_into(rpe_test::load<float>(dir, "q.npy", qshape), c.q, c.qf, c.qd);
    round_into(rpe_test::load<float>(dir, "k.npy", qshape), c.k, c.kf, c.kd);
    round_into(rpe_test::load<float>(dir, "v.npy", qshape), c.v, c.vf, c.vd);
    if (meta.value("key_padding_mask", false)) {
        c.kpm = rpe_test::load<std::uint8_t>(dir, "key_padding_mask.npy", {b, l});
        c.in.key_padding_mask = c.inf.key_padding_mask = c.ind.key_padding_mask = {c.kpm.data(), {b, l}};
    }
    const std::string on = meta.at("rpe_on").get<std::string>(), method = meta.at("method").get<std::string>();
    const char letters[3] = {'q', 'k', 'v'};
    const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
    for (int t = 0; t < 3; ++t) {
        if (on.find(letters[t]) == std::string::npos) continue;
        rpe::term_spec spec;
        spec.method = method == "product" ? rpe::method::product
                      : method == "cross" ? rpe::method::cross
                                          : rpe::method::euclidean;
        spec.contextual = meta.at("mode").get<std::string>() == "contextual";
        spec.target = targets[t];
        spec.alpha = meta.at("alpha").get<double>();
        spec.beta = meta.at("beta").get<double>();
        spec.gamma = meta.at("gamma").get<double>();
        spec.shared_head = meta.at("shared_head").get<bool>();
        spec.skip = skip;
        spec.num_heads = static_cast<int>(h);
        spec.head_dim = static_cast<int>(d);
        c.terms.push_back(rpe::make_term<double>(spec));
        const auto& term = *c.terms.back();
        REQUIRE(term.num_buckets() == meta.at("num_buckets").get<int>());
        rpe::attention_term<f16>* slot[] = {&c.in.rpe_q, &c.in.rpe_k, &c.in.rpe_v};
        rpe::attention_term<float>* slot_f[] = {&c.inf.rpe_q, &c.inf.rpe_k, &c.inf.rpe_v};
        rpe::attention_term<double>* slot_d[] = {&c.ind.rpe_q, &c.ind.rpe_k, &c.ind.rpe_v};
        slot[t]->term = slot_f[t]->term = slot_d[t]->term = &term;
        const auto shape = term.table_shape();
        rpe::tensor_ref<const double> like;
        like.rank = static_cast<int>(shape.size());
        for (std::size_t i = 0; i < shape.size(); ++i) like.shape[i] = shape[i];
        for (const auto& e : meta.at("rpe").at(std::string(1, letters[t])).at("tables")) {
            round_into(rpe_test::load<float>(dir, e.at("table").get<std::string>(), shape), c.tables.emplace_back(),
                       c.tables_f.emplace_back(), c.tables_d.emplace_back());
            slot[t]->tables.push_back(view_as<const f16>(c.tables.back().data(), like));
            slot_f[t]->tables.push_back(view_as<const float>(c.tables_f.back().data(), like));
            slot_d[t]->tables.push_back(view_as<const double>(c.tables_d.back().data(), like));
        }
    }
    worst_kernel = std::max(worst_kernel, check_forward(c));
    const auto got = forward_of(c.in);
    const auto golden_out = rpe_test::load<double>(dir, "output_f64.npy", qshape);
    double w = 0;
    for (std::size_t x = 0; x < golden_out.size(); ++x)
        w = std::max(w, std::fabs(static_cast<double>(got.out[x]) - golden_out[x]) / (1 + std::fabs(golden_out[x])));
    CHECK(w <= 0x1p-8);
    worst_golden = std::max(worst_golden, w);
}

}  // namespace

TEST_CASE("f16 attention reproduces every golden attention case (f16-rounded inputs)") {
    namespace fs = std::filesystem;
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(rpe_test::golden("attention")))
        if (fs::exists(e.path() / "meta.json")) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    CHECK(dirs.size() == 9);
    double worst_kernel = 0, worst_golden = 0;
    for (const auto& dir : dirs) {
        INFO("case " << dir);
        run_golden_f16(dir, worst_kernel, worst_golden);
    }
    MESSAGE("golden in f16: worst |out - ref| / bound " << worst_kernel << "; worst |out - golden| / (1 + |golden|) "
                                                        << worst_golden);
}

TEST_CASE("f16 attention: bad arguments of the forward and the backward are refused, naming the argument") {
    tri_case c(1, 2, 4, 2, 3, 1, 2);
    c.add_term(rpe::method::product, true, rpe::target::key, true, 1);
    rpe_test::check_refused_arguments(c.in);
}

}  // namespace rpe_unit_attention_f16
