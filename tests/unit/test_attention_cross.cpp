// Cross-attention in the fused CPU attention: q (B, H, L, D) with k, v (B, H, L_k, D), L_k < L and
// L_k > L. Forward against a naive double reference written here (softmax((q·s)·kᵀ + masks)·v),
// with attn_mask (L, L_k), key_padding_mask (B, L_k) and key_lengths; backward against central
// finite differences of that reference (double) and from saved probabilities; SAM2's memory
// attention (queries on the grid, keys on the grid repeated plus unrotated pointer tokens) against
// rpe::rope_forward on q and k followed by the attention without RoPE, forward and backward; the
// 16-bit storage paths against the float attention on the same values; and the refusals (shapes,
// masks, key_lengths, terms on a grid and packed sequences with L_k != L, the composed baseline).
#include <doctest/doctest.h>
#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/rpe.hpp>

#include "golden.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_test_attention_cross {

namespace {

std::vector<double> random_values(std::int64_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = normal(rng);
    return x;
}

template <class T>
std::vector<T> cast_to(const std::vector<double>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = T(static_cast<float>(x[i]));
    return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
    return m;
}

// A cross-attention problem: q (B, H, L, D), k, v (B, H, L_k, D), grad_out (B, H, L, D), and
// optional masks: attn_mask (L, L_k) with a few −∞ and finite entries, key_padding_mask (B, L_k),
// key_lengths (B).
struct cross_problem {
    std::int64_t b = 2, h = 2, l = 5, lk = 7, d = 4;
    std::vector<double> q, k, v, go, mask;
    std::vector<std::uint8_t> kpm;
    std::vector<std::int32_t> lengths;
    bool with_mask = false, with_kpm = false, with_lengths = false;

    cross_problem(std::int64_t l_, std::int64_t lk_, unsigned seed) : l(l_), lk(lk_) {
        q = random_values(b * h * l * d, seed);
        k = random_values(b * h * lk * d, seed + 1);
        v = random_values(b * h * lk * d, seed + 2);
        go = random_values(b * h * l * d, seed + 3);
        mask = random_values(l * lk, seed + 4);
        for (std::int64_t i = 0; i < l; ++i) mask[static_cast<std::size_t>(i * lk + (i + 1) % lk)] = -INFINITY;
        kpm.assign(static_cast<std::size_t>(b * lk), 0);
        if (lk > 2) {
            kpm[static_cast<std::size_t>(lk - 2)] = 1;  // batch 0: one padded key
            kpm[static_cast<std::size_t>(lk)] = 1;      // batch 1: its first key padded
        }
        lengths = {static_cast<std::int32_t>(lk), static_cast<std::int32_t>(lk - 3)};
    }

    template <class S>
    rpe::attention_inputs<S> inputs(const std::vector<S>& qs, const std::vector<S>& ks, const std::vector<S>& vs,
                                    const std::vector<S>& ms) const {
        rpe::attention_inputs<S> in;
        in.q = {qs.data(), {b, h, l, d}};
        in.k = {ks.data(), {b, h, lk, d}};
        in.v = {vs.data(), {b, h, lk, d}};
        if (with_mask) in.attn_mask = {ms.data(), {l, lk}};
        if (with_kpm) in.key_padding_mask = {kpm.data(), {b, lk}};
        if (with_lengths) in.key_lengths = {lengths.data(), {b}};
        return in;
    }
    rpe::attention_inputs<double> inputs() const { return inputs(q, k, v, mask); }

    // The naive reference: probabilities (B, H, L, L_k) and out (B, H, L, D) of
    // softmax((q·s)·kᵀ + attn_mask, padded keys −∞)·v; a row whose keys are all masked: zeros.
    void reference(const std::vector<double>& qs, const std::vector<double>& ks, const std::vector<double>& vs,
                   std::vector<double>& out, std::vector<double>& probs) const {
        const double s = 1.0 / std::sqrt(static_cast<double>(d));
        out.assign(static_cast<std::size_t>(b * h * l * d), 0.0);
        probs.assign(static_cast<std::size_t>(b * h * l * lk), 0.0);
        for (std::int64_t bb = 0; bb < b; ++bb)
            for (std::int64_t hh = 0; hh < h; ++hh) {
                const std::int64_t p = bb * h + hh;
                for (std::int64_t i = 0; i < l; ++i) {
                    std::vector<double> row(static_cast<std::size_t>(lk));
                    double mx = -INFINITY;
                    for (std::int64_t j = 0; j < lk; ++j) {
                        double x = 0;
                        for (std::int64_t c = 0; c < d; ++c)
                            x += qs[static_cast<std::size_t>((p * l + i) * d + c)] * s *
                                 ks[static_cast<std::size_t>((p * lk + j) * d + c)];
                        if (with_mask) x += mask[static_cast<std::size_t>(i * lk + j)];
                        if (with_kpm && kpm[static_cast<std::size_t>(bb * lk + j)]) x = -INFINITY;
                        if (with_lengths && j >= lengths[static_cast<std::size_t>(bb)]) x = -INFINITY;
                        row[static_cast<std::size_t>(j)] = x;
                        mx = std::max(mx, x);
                    }
                    if (mx == -INFINITY) continue;  // every key masked: zero probabilities, zero output
                    double sum = 0;
                    for (auto& x : row) sum += (x = std::exp(x - mx));
                    for (std::int64_t j = 0; j < lk; ++j) {
                        const double a = row[static_cast<std::size_t>(j)] / sum;
                        probs[static_cast<std::size_t>((p * l + i) * lk + j)] = a;
                        for (std::int64_t c = 0; c < d; ++c)
                            out[static_cast<std::size_t>((p * l + i) * d + c)] +=
                                a * vs[static_cast<std::size_t>((p * lk + j) * d + c)];
                    }
                }
            }
    }
    // sum(out · grad_out) of the reference.
    double loss(const std::vector<double>& qs, const std::vector<double>& ks, const std::vector<double>& vs) const {
        std::vector<double> out, probs;
        reference(qs, ks, vs, out, probs);
        double sum = 0;
        for (std::size_t i = 0; i < out.size(); ++i) sum += out[i] * go[i];
        return sum;
    }
};

// The fused forward in double: out and attn.
void fused(const rpe::attention_inputs<double>& in, const cross_problem& pb, std::vector<double>& out,
           std::vector<double>& attn) {
    out.assign(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.d), 0.0);
    attn.assign(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.lk), -1.0);
    rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {pb.b, pb.h, pb.l, pb.d}),
                           rpe::tensor_ref<double>(attn.data(), {pb.b, pb.h, pb.l, pb.lk}));
}

struct grads {
    std::vector<double> q, k, v;
};

grads fused_backward(const rpe::attention_inputs<double>& in, const cross_problem& pb, const std::vector<double>* saved = nullptr,
                     const rpe::attention_options& opt = {}) {
    grads g{std::vector<double>(pb.q.size(), 7.0), std::vector<double>(pb.k.size(), 7.0), std::vector<double>(pb.v.size(), 7.0)};
    rpe::attention_gradients<double> ag{.grad_out = {pb.go.data(), {pb.b, pb.h, pb.l, pb.d}},
                                        .grad_q = {g.q.data(), {pb.b, pb.h, pb.l, pb.d}},
                                        .grad_k = {g.k.data(), {pb.b, pb.h, pb.lk, pb.d}},
                                        .grad_v = {g.v.data(), {pb.b, pb.h, pb.lk, pb.d}}};
    if (saved) ag.saved_attn = {saved->data(), {pb.b, pb.h, pb.l, pb.lk}};
    rpe::attention_backward(in, ag, opt);
    return g;
}

// Central finite differences of the reference's loss in each entry of x (one of pb.q, pb.k, pb.v).
std::vector<double> finite_differences(cross_problem pb, std::vector<double> cross_problem::*x) {
    const double eps = 1e-6;
    std::vector<double> g((pb.*x).size());
    for (std::size_t i = 0; i < g.size(); ++i) {
        const double keep = (pb.*x)[i];
        (pb.*x)[i] = keep + eps;
        const double up = pb.loss(pb.q, pb.k, pb.v);
        (pb.*x)[i] = keep - eps;
        const double down = pb.loss(pb.q, pb.k, pb.v);
        (pb.*x)[i] = keep;
        g[i] = (up - down) / (2 * eps);
    }
    return g;
}

}  // namespace

TEST_CASE("attention cross: L_k != L forward equals the naive reference (masks, key_lengths, attn)") {
    for (const auto& [l, lk] : {std::pair<std::int64_t, std::int64_t>{5, 7}, {7, 3}, {1, 9}, {6, 1}}) {
        for (int variant = 0; variant < 4; ++variant) {
            CAPTURE(l);
            CAPTURE(lk);
            CAPTURE(variant);
            cross_problem pb(l, lk, 11);
            pb.with_mask = variant == 1 || variant == 3;
            pb.with_kpm = (variant == 2 || variant == 3) && lk > 2;
            pb.with_lengths = variant == 3 && lk > 3;
            std::vector<double> out, attn, ref_out, ref_attn;
            fused(pb.inputs(), pb, out, attn);
            pb.reference(pb.q, pb.k, pb.v, ref_out, ref_attn);
            CHECK(max_abs_diff(out, ref_out) < 1e-12);
            CHECK(max_abs_diff(attn, ref_attn) < 1e-12);
            // float: the same within float rounding
            const auto qf = cast_to<float>(pb.q), kf = cast_to<float>(pb.k), vf = cast_to<float>(pb.v),
                       mf = cast_to<float>(pb.mask);
            std::vector<float> of(out.size()), af(attn.size());
            rpe::attention_forward(pb.inputs(qf, kf, vf, mf), rpe::tensor_ref<float>(of.data(), {pb.b, pb.h, l, pb.d}),
                                   rpe::tensor_ref<float>(af.data(), {pb.b, pb.h, l, lk}));
            CHECK(max_abs_diff(std::vector<double>(of.begin(), of.end()), ref_out) < 1e-5);
            CHECK(max_abs_diff(std::vector<double>(af.begin(), af.end()), ref_attn) < 1e-5);
            // row blocks of one row: the same values
            std::vector<double> out1(out.size());
            rpe::attention_forward(pb.inputs(), rpe::tensor_ref<double>(out1.data(), {pb.b, pb.h, l, pb.d}), {},
                                   {.row_block = 1});
            CHECK(max_abs_diff(out1, ref_out) < 1e-12);
        }
    }
}

TEST_CASE("attention cross: L_k != L backward matches finite differences and the saved-probabilities backward") {
    for (const auto& [l, lk] : {std::pair<std::int64_t, std::int64_t>{4, 6}, {6, 3}}) {
        for (int variant = 0; variant < 2; ++variant) {
            CAPTURE(l);
            CAPTURE(lk);
            CAPTURE(variant);
            cross_problem pb(l, lk, 21);
            pb.with_mask = variant == 1;
            pb.with_kpm = variant == 1;
            pb.with_lengths = variant == 1;
            const grads g = fused_backward(pb.inputs(), pb);
            CHECK(max_abs_diff(g.q, finite_differences(pb, &cross_problem::q)) < 1e-7);
            CHECK(max_abs_diff(g.k, finite_differences(pb, &cross_problem::k)) < 1e-7);
            CHECK(max_abs_diff(g.v, finite_differences(pb, &cross_problem::v)) < 1e-7);
            // from the forward's probabilities: the same gradients up to rounding
            std::vector<double> out, attn;
            fused(pb.inputs(), pb, out, attn);
            const grads gs = fused_backward(pb.inputs(), pb, &attn);
            CHECK(max_abs_diff(gs.q, g.q) < 1e-12);
            CHECK(max_abs_diff(gs.k, g.k) < 1e-12);
            CHECK(max_abs_diff(gs.v, g.v) < 1e-12);
            // one row per block, a tiny partials budget: the same gradients (the chunking depends on the shape only)
            const grads gb = fused_backward(pb.inputs(), pb, nullptr, {.row_block = 1, .backward_budget_bytes = 1});
            CHECK(max_abs_diff(gb.q, g.q) < 1e-12);
            CHECK(max_abs_diff(gb.k, g.k) < 1e-12);
            CHECK(max_abs_diff(gb.v, g.v) < 1e-12);
            if (variant == 1) {  // padded keys (key_lengths): exactly zero grad_k and grad_v rows
                for (std::int64_t hh = 0; hh < pb.h; ++hh)
                    for (std::int64_t j = pb.lengths[1]; j < lk; ++j)
                        for (std::int64_t c = 0; c < pb.d; ++c) {
                            const auto e = static_cast<std::size_t>(((pb.h + hh) * lk + j) * pb.d + c);
                            CHECK(g.k[e] == 0.0);
                            CHECK(g.v[e] == 0.0);
                        }
            }
        }
    }
}

namespace {

// SAM2's memory attention, small: queries on a 2 × 3 grid (L = 6), keys on that grid repeated
// R = 2 times plus 2 unrotated pointer tokens (L_k = 14), RoPE-Axial θ = 10000, D = 8.
struct sam2_problem {
    static constexpr int height = 2, width = 3, repeat = 2, pointers = 2;
    std::vector<float> key_pos = rpe::rope::repeated_grid_positions(height, width, repeat);
    cross_problem pb{height * width, repeat* height* width + pointers, 31};

    sam2_problem() {
        pb.d = 8;
        pb.q = random_values(pb.b * pb.h * pb.l * pb.d, 41);
        pb.k = random_values(pb.b * pb.h * pb.lk * pb.d, 42);
        pb.v = random_values(pb.b * pb.h * pb.lk * pb.d, 43);
        pb.go = random_values(pb.b * pb.h * pb.l * pb.d, 44);
    }
    template <class S>
    rpe::rotary_embedding<S> rope() const {
        rpe::rotary_embedding<S> r{.form = rpe::rope::axial{.theta = 10000.0f}};
        r.key_positions = rpe::tensor_ref<const float>(key_pos.data(), {repeat * height * width, 2});
        r.suffix = pointers;
        r.query_suffix = 0;
        return r;
    }
    rpe::attention_inputs<double> inputs() const {
        auto in = pb.inputs();
        in.height = height;
        in.width = width;
        in.rope = rope<double>();
        return in;
    }
    // The rotations alone: q on the grid, k at the repeated grid with the pointers unrotated.
    void rotated(std::vector<double>& qr, std::vector<double>& kr) const {
        qr.assign(pb.q.size(), 0.0);
        kr.assign(pb.k.size(), 0.0);
        const auto r = rope<double>();
        rpe::rope_forward(rpe::query_rope(r), height, width, rpe::tensor_ref<const double>(pb.q.data(), {pb.b, pb.h, pb.l, pb.d}),
                          rpe::tensor_ref<double>(qr.data(), {pb.b, pb.h, pb.l, pb.d}));
        rpe::rope_forward(rpe::key_rope(r), height, width, rpe::tensor_ref<const double>(pb.k.data(), {pb.b, pb.h, pb.lk, pb.d}),
                          rpe::tensor_ref<double>(kr.data(), {pb.b, pb.h, pb.lk, pb.d}));
    }
};

}  // namespace

TEST_CASE("attention cross: SAM2 memory attention with RoPE equals rope_forward on q and k, then the attention") {
    const sam2_problem sp;
    const auto& pb = sp.pb;
    std::vector<double> qr, kr;
    sp.rotated(qr, kr);
    // the key rotation: each memory frame's keys as the grid's rotation, the pointers unchanged
    for (std::int64_t p = 0; p < pb.b * pb.h; ++p)
        for (std::int64_t j = sp.repeat * sp.height * sp.width; j < pb.lk; ++j)
            for (std::int64_t c = 0; c < pb.d; ++c) {
                const auto e = static_cast<std::size_t>((p * pb.lk + j) * pb.d + c);
                CHECK(kr[e] == pb.k[e]);
            }
    std::vector<double> out, attn, ref_out, ref_attn;
    fused(sp.inputs(), pb, out, attn);
    pb.reference(qr, kr, pb.v, ref_out, ref_attn);
    CHECK(max_abs_diff(out, ref_out) < 1e-12);
    CHECK(max_abs_diff(attn, ref_attn) < 1e-12);
    // the fused attention without RoPE on the rotated q and k
    {
        auto plain = pb.inputs(qr, kr, pb.v, pb.mask);
        std::vector<double> out2(out.size());
        rpe::attention_forward(plain, rpe::tensor_ref<double>(out2.data(), {pb.b, pb.h, pb.l, pb.d}));
        CHECK(max_abs_diff(out2, out) < 1e-13);
    }
    // float: the fused RoPE against the rotations then the attention
    {
        const auto qf = cast_to<float>(pb.q), kf = cast_to<float>(pb.k), vf = cast_to<float>(pb.v);
        auto in = pb.inputs(qf, kf, vf, std::vector<float>{});
        in.height = sp.height;
        in.width = sp.width;
        in.rope = sp.rope<float>();
        std::vector<float> of(out.size()), qrf(qf.size()), krf(kf.size()), of2(out.size());
        rpe::attention_forward(in, rpe::tensor_ref<float>(of.data(), {pb.b, pb.h, pb.l, pb.d}));
        rpe::rope_forward(rpe::query_rope(in.rope), sp.height, sp.width, in.q,
                          rpe::tensor_ref<float>(qrf.data(), {pb.b, pb.h, pb.l, pb.d}));
        rpe::rope_forward(rpe::key_rope(in.rope), sp.height, sp.width, in.k,
                          rpe::tensor_ref<float>(krf.data(), {pb.b, pb.h, pb.lk, pb.d}));
        auto plain = pb.inputs(qrf, krf, vf, std::vector<float>{});
        rpe::attention_forward(plain, rpe::tensor_ref<float>(of2.data(), {pb.b, pb.h, pb.l, pb.d}));
        CHECK(max_abs_diff(std::vector<double>(of.begin(), of.end()), std::vector<double>(of2.begin(), of2.end())) < 2e-6);
        CHECK(max_abs_diff(std::vector<double>(of.begin(), of.end()), ref_out) < 1e-5);
    }
}

TEST_CASE("attention cross: SAM2 memory attention backward with RoPE (composition and finite differences)") {
    const sam2_problem sp;
    const auto& pb = sp.pb;
    const grads g = fused_backward(sp.inputs(), pb);
    // the composition: the attention's gradients of the rotated q and k, rotated back
    std::vector<double> qr, kr;
    sp.rotated(qr, kr);
    const grads gr = fused_backward(pb.inputs(qr, kr, pb.v, pb.mask), pb);
    std::vector<double> gq(pb.q.size()), gk(pb.k.size());
    const auto r = sp.rope<double>();
    rpe::rope_backward(rpe::query_rope(r), sp.height, sp.width,
                       rpe::tensor_ref<const double>(pb.q.data(), {pb.b, pb.h, pb.l, pb.d}),
                       rpe::tensor_ref<const double>(gr.q.data(), {pb.b, pb.h, pb.l, pb.d}),
                       rpe::tensor_ref<double>(gq.data(), {pb.b, pb.h, pb.l, pb.d}));
    rpe::rope_backward(rpe::key_rope(r), sp.height, sp.width,
                       rpe::tensor_ref<const double>(pb.k.data(), {pb.b, pb.h, pb.lk, pb.d}),
                       rpe::tensor_ref<const double>(gr.k.data(), {pb.b, pb.h, pb.lk, pb.d}),
                       rpe::tensor_ref<double>(gk.data(), {pb.b, pb.h, pb.lk, pb.d}));
    CHECK(max_abs_diff(g.q, gq) < 1e-12);
    CHECK(max_abs_diff(g.k, gk) < 1e-12);
    CHECK(max_abs_diff(g.v, gr.v) < 1e-12);
    // finite differences of the composition (rotation, then the reference)
    const double eps = 1e-6;
    const auto loss = [&](const std::vector<double>& q, const std::vector<double>& k) {
        std::vector<double> qq(q.size()), kk(k.size());
        rpe::rope_forward(rpe::query_rope(r), sp.height, sp.width,
                          rpe::tensor_ref<const double>(q.data(), {pb.b, pb.h, pb.l, pb.d}),
                          rpe::tensor_ref<double>(qq.data(), {pb.b, pb.h, pb.l, pb.d}));
        rpe::rope_forward(rpe::key_rope(r), sp.height, sp.width,
                          rpe::tensor_ref<const double>(k.data(), {pb.b, pb.h, pb.lk, pb.d}),
                          rpe::tensor_ref<double>(kk.data(), {pb.b, pb.h, pb.lk, pb.d}));
        return pb.loss(qq, kk, pb.v);
    };
    double worst = 0;
    std::vector<double> q = pb.q, k = pb.k;
    for (std::size_t i = 0; i < q.size(); i += 3) {
        const double keep = q[i];
        q[i] = keep + eps;
        const double up = loss(q, k);
        q[i] = keep - eps;
        const double down = loss(q, k);
        q[i] = keep;
        worst = std::max(worst, std::abs((up - down) / (2 * eps) - g.q[i]));
    }
    for (std::size_t i = 0; i < k.size(); i += 3) {
        const double keep = k[i];
        k[i] = keep + eps;
        const double up = loss(q, k);
        k[i] = keep - eps;
        const double down = loss(q, k);
        k[i] = keep;
        worst = std::max(worst, std::abs((up - down) / (2 * eps) - g.k[i]));
    }
    CHECK(worst < 1e-7);
    // saved probabilities: the same gradients
    std::vector<double> out, attn;
    fused(sp.inputs(), pb, out, attn);
    const grads gs = fused_backward(sp.inputs(), pb, &attn);
    CHECK(max_abs_diff(gs.q, g.q) < 1e-12);
    CHECK(max_abs_diff(gs.k, g.k) < 1e-12);
    CHECK(max_abs_diff(gs.v, g.v) < 1e-12);
}

TEST_CASE_TEMPLATE("attention cross: 16-bit storage is the rounding of the float attention on its values", H, rpe::bf16,
                   rpe::f16) {
    cross_problem pb(5, 8, 51);
    pb.with_mask = true;
    pb.with_kpm = true;
    const auto qh = cast_to<H>(pb.q), kh = cast_to<H>(pb.k), vh = cast_to<H>(pb.v), mh = cast_to<H>(pb.mask),
               goh = cast_to<H>(pb.go);
    const auto widen = [](const std::vector<H>& x) {
        std::vector<float> out(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i]);
        return out;
    };
    const auto qf = widen(qh), kf = widen(kh), vf = widen(vh), mf = widen(mh), gof = widen(goh);
    const std::int64_t b = pb.b, h = pb.h, l = pb.l, lk = pb.lk, d = pb.d;
    std::vector<H> oh(static_cast<std::size_t>(b * h * l * d)), ah(static_cast<std::size_t>(b * h * l * lk));
    rpe::attention_forward(pb.inputs(qh, kh, vh, mh), rpe::tensor_ref<H>(oh.data(), {b, h, l, d}),
                           rpe::tensor_ref<H>(ah.data(), {b, h, l, lk}));
    std::vector<float> of(oh.size()), af(ah.size());
    rpe::attention_forward(pb.inputs(qf, kf, vf, mf), rpe::tensor_ref<float>(of.data(), {b, h, l, d}),
                           rpe::tensor_ref<float>(af.data(), {b, h, l, lk}));
    for (std::size_t i = 0; i < oh.size(); ++i) CHECK(static_cast<float>(oh[i]) == static_cast<float>(H(of[i])));
    for (std::size_t i = 0; i < ah.size(); ++i) CHECK(static_cast<float>(ah[i]) == static_cast<float>(H(af[i])));
    // backward: the float backward's gradients rounded once
    std::vector<H> gqh(qh.size()), gkh(kh.size()), gvh(vh.size());
    rpe::attention_backward(pb.inputs(qh, kh, vh, mh), rpe::tensor_ref<const H>(goh.data(), {b, h, l, d}),
                            rpe::tensor_ref<H>(gqh.data(), {b, h, l, d}), rpe::tensor_ref<H>(gkh.data(), {b, h, lk, d}),
                            rpe::tensor_ref<H>(gvh.data(), {b, h, lk, d}));
    std::vector<float> gqf(qf.size()), gkf(kf.size()), gvf(vf.size());
    rpe::attention_backward(pb.inputs(qf, kf, vf, mf), rpe::tensor_ref<const float>(gof.data(), {b, h, l, d}),
                            rpe::tensor_ref<float>(gqf.data(), {b, h, l, d}), rpe::tensor_ref<float>(gkf.data(), {b, h, lk, d}),
                            rpe::tensor_ref<float>(gvf.data(), {b, h, lk, d}));
    for (std::size_t i = 0; i < gqh.size(); ++i) CHECK(static_cast<float>(gqh[i]) == static_cast<float>(H(gqf[i])));
    for (std::size_t i = 0; i < gkh.size(); ++i) CHECK(static_cast<float>(gkh[i]) == static_cast<float>(H(gkf[i])));
    for (std::size_t i = 0; i < gvh.size(); ++i) CHECK(static_cast<float>(gvh[i]) == static_cast<float>(H(gvf[i])));
}

TEST_CASE("attention cross: shapes, masks, key_lengths, terms and packing with L_k != L are refused by name") {
    cross_problem pb(5, 7, 61);
    std::vector<double> out(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.d));
    const rpe::tensor_ref<double> out_ref(out.data(), {pb.b, pb.h, pb.l, pb.d});
    const auto fwd = [&](const rpe::attention_inputs<double>& in) { rpe::attention_forward(in, out_ref); };
    {  // v of another length than k
        auto in = pb.inputs();
        in.v = {pb.v.data(), {pb.b, pb.h, pb.lk - 1, pb.d}};
        CHECK(rpe_test::throws_with([&] { fwd(in); },
                                    "[rpe.attention] v has shape (2, 2, 6, 4); expected (2, 2, 7, 4), the shape of k"));
    }
    {  // k of another head dim
        auto in = pb.inputs();
        in.k = {pb.k.data(), {pb.b, pb.h, pb.lk * 2, pb.d / 2}};
        CHECK(rpe_test::throws_with(
            [&] { fwd(in); },
            "[rpe.attention] k has shape (2, 2, 14, 2); expected (2, 2, L_k >= 1, 4): B, H, D of q (2, 2, 5, 4)"));
    }
    {  // attn_mask (L, L)
        auto in = pb.inputs();
        in.attn_mask = {pb.mask.data(), {pb.l, pb.l}};
        CHECK(rpe_test::throws_with([&] { fwd(in); }, {"attn_mask", "(5, 5)", "(5, 7)"}));
    }
    {  // key_padding_mask (B, L)
        auto in = pb.inputs();
        in.key_padding_mask = {pb.kpm.data(), {pb.b, pb.l}};
        CHECK(rpe_test::throws_with([&] { fwd(in); }, {"key_padding_mask", "(2, 5)", "(2, 7)"}));
    }
    {  // key_lengths beyond L_k
        std::vector<std::int32_t> lengths{7, 8};
        auto in = pb.inputs();
        in.key_lengths = {lengths.data(), {pb.b}};
        CHECK(rpe_test::throws_with(
            [&] { fwd(in); },
            "[rpe.attention] key_lengths[1] = 8; expected 0 <= length <= L_k = 7 (keys at index >= length are padding)"));
    }
    {  // attn output (B, H, L, L)
        std::vector<double> attn(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.l));
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(pb.inputs(), out_ref, rpe::tensor_ref<double>(attn.data(), {pb.b, pb.h, pb.l, pb.l}));
            },
            {"attn", "(2, 2, 5, 5)", "(2, 2, 5, 7)"}));
    }
    {  // grad_k of q's shape, saved_attn (B, H, L, L)
        std::vector<double> gq(pb.q.size()), gk(pb.k.size()), gv(pb.v.size()),
            saved(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.l));
        rpe::attention_gradients<double> g{.grad_out = {pb.go.data(), {pb.b, pb.h, pb.l, pb.d}},
                                           .grad_q = {gq.data(), {pb.b, pb.h, pb.l, pb.d}},
                                           .grad_k = {gk.data(), {pb.b, pb.h, pb.l, pb.d}},
                                           .grad_v = {gv.data(), {pb.b, pb.h, pb.lk, pb.d}}};
        CHECK(
            rpe_test::throws_with([&] { rpe::attention_backward(pb.inputs(), g); }, {"grad_k", "(2, 2, 5, 4)", "(2, 2, 7, 4)"}));
        g.grad_k = {gk.data(), {pb.b, pb.h, pb.lk, pb.d}};
        g.saved_attn = {saved.data(), {pb.b, pb.h, pb.l, pb.l}};
        CHECK(rpe_test::throws_with([&] { rpe::attention_backward(pb.inputs(), g); },
                                    {"saved_attn", "(2, 2, 5, 5)", "(2, 2, 5, 7)"}));
    }
    {  // an iRPE term with L_k != L on a grid: refused, naming positions (a grid describes one token set)
        using M = rpe::mapping::product<rpe::index::piecewise>;
        const M m{rpe::index::piecewise{.alpha = 1.0, .beta = 2.0, .gamma = 4.0}};
        const rpe::term_desc tk = rpe::make_term_desc(m, false, rpe::target::key, {.num_heads = 2, .head_dim = 4, .skip = 0});
        std::int64_t size = 1;
        for (auto e : tk.table_shape()) size *= e;
        std::vector<double> table(static_cast<std::size_t>(size));
        auto in = pb.inputs();
        in.height = 1;
        in.width = 5;
        in.rpe_k = {.term = &tk, .tables = {{table.data(), tk.table_shape()}}};
        CHECK(rpe_test::throws_with(
            [&] { fwd(in); },
            "[rpe.attention] rpe_k is attached with keys of another length than the queries (L = 5, L_k = 7) and no positions"));
        // at positions and key_positions: (L, L_k) ids (values: tests/unit/test_irpe_cross.cpp)
        std::vector<std::int32_t> pos(10), kpos(14);
        in.height = in.width = 0;
        in.positions = {pos.data(), {5, 2}};
        in.key_positions = {kpos.data(), {7, 2}};
        CHECK_NOTHROW(fwd(in));
    }
    {  // packed sequences with L_k != L: not supported
        std::vector<std::int32_t> lengths{2, 3};
        auto in = pb.inputs();
        in.packed.lengths = {lengths.data(), {2}};
        CHECK(rpe_test::throws_with<rpe::not_supported>(
            [&] { fwd(in); }, "[rpe.attention] packed sequences with keys of another length than the queries (L = 5, L_k = 7)"));
    }
    {  // the composed baseline does not take L_k != L
        std::vector<double> attn(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.lk));
        CHECK(rpe_test::throws_with<rpe::not_supported>(
            [&] {
                rpe::composed_attention_forward(pb.inputs(), out_ref,
                                                rpe::tensor_ref<double>(attn.data(), {pb.b, pb.h, pb.l, pb.lk}));
            },
            "[rpe.attention] keys of another length than the queries (L_k != L) is not supported by the composed backend"));
    }
    {  // RoPE: the keys' count is checked against L_k
        const sam2_problem sp;
        auto in = sp.inputs();
        in.rope.suffix = 1;  // L_k = 12 + 2, not 12 + 1
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
            },
            {"rope key_positions has shape (12, 2)", "(13, 2)"}));
        in = sp.inputs();
        in.rope.query_suffix = -1;  // the queries' suffix = suffix = 2: L = 6 is not skip + 2*3 + 2
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
            },
            "[rpe.attention] L = 6; expected rope skip + height*width + suffix = 0 + 2*3 + 2"));
        // queries on the grid (no rope positions) with a query_suffix that leaves no rotated token:
        // the grid's count is named, not positions the caller did not give
        for (const int qs : {6, 7}) {
            in = sp.inputs();
            in.rope.query_suffix = qs;
            const std::string expected =
                "[rpe.attention] L = 6; expected rope skip + height*width + query_suffix = 0 + 2*3 + " + std::to_string(qs);
            CHECK(rpe_test::throws_with(
                [&] {
                    rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
                },
                expected.c_str()));
        }
        in = sp.inputs();
        in.rope.skip = 13;  // skip 13 + suffix 1 = L_k = 14: no key at key_positions is left to rotate
        in.rope.query_suffix = -1;
        in.rope.suffix = 1;
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
            },
            "[rpe.attention] L_k = 14; expected rope skip + suffix = 13 + 1 below L_k (key_positions need rotated tokens)"));
        in = sp.inputs();
        in.rope.query_suffix = -2;
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
            },
            "[rpe.attention] rope query_suffix = -2; expected >= 0, or -1 for suffix"));
        in = sp.inputs();
        in.rope.key_positions = {};  // keys on the queries' grid: L_k = 0 + 2*3 + 2 expected
        CHECK(rpe_test::throws_with(
            [&] {
                rpe::attention_forward(in, rpe::tensor_ref<double>(out.data(), {sp.pb.b, sp.pb.h, sp.pb.l, sp.pb.d}));
            },
            "[rpe.attention] L_k = 14; expected rope skip + height*width + suffix = 0 + 2*3 + 2"));
    }
}

TEST_CASE("attention cross: a backend without cross_lengths refuses L_k != L and query_suffix by name") {
    cross_problem pb(5, 7, 71);
    rpe::attention_capabilities caps = rpe::cpu::attention_caps;
    caps.backend = "test";
    caps.cross_lengths = false;
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] { (void)rpe::detail::check_attention(pb.inputs(), caps); },
        "[rpe.attention] keys of another length than the queries (L_k != L) is not supported by the test backend"));
    {  // k alone of another length (v has the queries' length): k is named, not v
        cross_problem odd(5, 7, 73);
        auto in = odd.inputs();
        in.v = rpe::tensor_ref<const double>(in.v.data, {odd.b, odd.h, 5, odd.d});
        CHECK(rpe_test::throws_with([&] { (void)rpe::detail::check_attention(in, caps); },
                                    "[rpe.attention] k has shape (2, 2, 7, 4); expected (2, 2, 5, 4), the shape of q and v "
                                    "(the test backend takes keys of the queries' length)"));
        CHECK(rpe_test::throws_with([&] { (void)rpe::detail::check_attention(in, rpe::cpu::attention_caps); },
                                    "[rpe.attention] v has shape (2, 2, 5, 4); expected (2, 2, 7, 4), the shape of k"));
    }
    // self-attention shapes (L = L_k = 6) with RoPE's query_suffix set apart from suffix: the queries
    // at 4 positions + 2 unrotated tokens, the keys at 6 positions
    cross_problem self(6, 6, 72);
    auto in = self.inputs();
    std::vector<float> qpos(8, 1.0f), kpos(12, 2.0f);
    in.rope = {.form = rpe::rope::axial{.theta = 100.0f}};
    in.rope.positions = {qpos.data(), {4, 2}};
    in.rope.key_positions = {kpos.data(), {6, 2}};
    in.rope.query_suffix = 2;
    CHECK_NOTHROW((void)rpe::detail::check_attention(in, rpe::cpu::attention_caps));
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] { (void)rpe::detail::check_attention(in, caps); },
        "[rpe.attention] rope query_suffix other than suffix is not supported by the test backend"));
    in.rope.query_suffix = 0;  // = suffix: every backend with RoPE; the keys' positions then 6 - 0
    in.rope.positions = {kpos.data(), {6, 2}};
    CHECK_NOTHROW((void)rpe::detail::check_attention(in, caps));
    // keys at the queries' positions: L_k - skip - suffix rows needed
    in.rope.positions = {qpos.data(), {4, 2}};
    in.rope.query_suffix = 2;
    in.rope.key_positions = {};
    CHECK(rpe_test::throws_with([&] { (void)rpe::detail::check_attention(in, rpe::cpu::attention_caps); },
                                "[rpe.attention] L_k = 6; expected rope skip + N + suffix = 0 + 4 + 0"));
}

}  // namespace rpe_unit_test_attention_cross
