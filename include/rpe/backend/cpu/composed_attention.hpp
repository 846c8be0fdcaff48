/// @file backend/cpu/composed_attention.hpp
/// @brief The reference's attention step with iRPE (`RPEAttention.forward`), composed from single terms:
/// logits buffer, RPE terms, key padding mask, softmax, value term — forward and backward.
///
/// This is the plain, obviously-correct baseline (it materialises (B, H, L, L) logits); a fused
/// attention must give the same numbers.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../attention_inputs.hpp"
#include "attention.hpp"
#include "eigen.hpp"
#include "isa.hpp"
#include "term.hpp"
#include "kernels.hpp"
#include "rope.hpp"
#include "../../detail/check.hpp"
#include "../../error.hpp"
#include "../../tensor.hpp"

namespace rpe {

namespace detail {

/// A contiguous copy of a (B, H, L, D) view, strided or not.
template <class S>
std::vector<S> contiguous_copy(const tensor_ref<const S>& t) {
    std::vector<S> out(static_cast<std::size_t>(t.size()));
    std::size_t e = 0;
    for (std::int64_t a = 0; a < t.extent(0); ++a)
        for (std::int64_t b = 0; b < t.extent(1); ++b)
            for (std::int64_t c = 0; c < t.extent(2); ++c) {
                const S* row = t.data + a * t.stride(0) + b * t.stride(1) + c * t.stride(2);
                for (std::int64_t d = 0; d < t.extent(3); ++d) out[e++] = row[d * t.stride(3)];
            }
    return out;
}

/// Calls `step(inputs)` on contiguous copies of q, k and v when any of them is strided and
/// returns true; false (nothing called) when all three are contiguous.
template <class S, class F>
bool on_contiguous_qkv(const attention_inputs<S>& in, F&& step) {
    if (in.q.contiguous() && in.k.contiguous() && in.v.contiguous()) return false;
    const std::vector<std::int64_t> shape{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
    const auto q = contiguous_copy(in.q), k = contiguous_copy(in.k), v = contiguous_copy(in.v);
    attention_inputs<S> c = in;
    c.q = tensor_ref<const S>(q.data(), shape);
    c.k = tensor_ref<const S>(k.data(), shape);
    c.v = tensor_ref<const S>(v.data(), shape);
    step(c);
    return true;
}

/// `in` with q and k replaced by their rotations (rpe::rope_forward of in.rope's query and key
/// settings, written to `qr` and `kr`, resized to q's size, (B, H, L, D) contiguous) and RoPE off.
template <class S>
attention_inputs<S> rope_rotated(const attention_inputs<S>& in, std::vector<S>& qr, std::vector<S>& kr) {
    const std::vector<std::int64_t> shape{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
    qr.resize(static_cast<std::size_t>(in.q.size()));
    kr.resize(qr.size());
    rope_forward(query_rope(in.rope), in.height, in.width, in.q, tensor_ref<S>(qr.data(), shape));
    rope_forward(key_rope(in.rope), in.height, in.width, in.k, tensor_ref<S>(kr.data(), shape));
    attention_inputs<S> rotated = in;
    rotated.rope = {};
    rotated.q = tensor_ref<const S>(qr.data(), shape);
    rotated.k = tensor_ref<const S>(kr.data(), shape);
    return rotated;
}

}  // namespace detail

inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp: the step calls the CPU kernels

/// @brief Forward of the attention step (reference `RPEAttention.forward` without the
/// projections and dropout): `qs = q·s`, `s = opt.scale` (default `D^−½`); `logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·s)`;
/// mask; `attn = softmax_j(logits)`; `out = attn·v + rpe_v(attn)`. With `in.rope`, q and k are
/// first rotated by rpe::rope_forward into copies and the step runs on those. Strided q, k, v
/// are copied into contiguous buffers first (this is the plain baseline).
/// @param out  (B, H, L, D), written.
/// @param attn (B, H, L, L), written: the probabilities, needed by the backward.
/// @throws rpe::invalid_argument `[rpe.attention] ...` / `[rpe.term] ...` for mismatched shapes,
///   grid, heads, or a term on the wrong slot; checks run before any output is written.
/// Cost: O(B·H·L²·D) for the content products plus the terms' costs (rpe::term).
template <class S>
void composed_attention_forward(const attention_inputs<S>& in, tensor_ref<S> out, tensor_ref<S> attn,
                                const attention_options& opt = {}) {
    const auto s = detail::check_attention(in, cpu::attention_caps);
    detail::check_attention_outputs(in, s, out, attn, true);
    if (detail::on_contiguous_qkv(in, [&](const attention_inputs<S>& c) { composed_attention_forward(c, out, attn, opt); }))
        return;
    if (in.rope.enabled()) {  // RoPE: rotate q and k (rpe::rope_forward), then the same step without it
        std::vector<S> qr, kr;
        composed_attention_forward(detail::rope_rotated(in, qr, kr), out, attn, opt);
        return;
    }
    const auto ids_q = detail::ids_of(in.rpe_q, in);
    const auto ids_k = detail::ids_of(in.rpe_k, in);
    const auto ids_v = detail::ids_of(in.rpe_v, in);
    const S scale = static_cast<S>(detail::softmax_scale(opt, s.d));
    const std::int64_t n = s.l, planes = s.b * s.h;
    std::vector<S> qs(static_cast<std::size_t>(in.q.size())), ks;
    for (std::int64_t e = 0; e < in.q.size(); ++e) qs[e] = in.q.data[e] * scale;
    using detail::cpu::cmap;
    using detail::cpu::map;
    for (std::int64_t p = 0; p < planes; ++p)
        map<S>(attn.data + p * n * n, n, n).noalias() =
            cmap<S>(qs.data() + p * n * s.d, n, s.d) * cmap<S>(in.k.data + p * n * s.d, n, s.d).transpose();
    const tensor_ref<const S> qs_ref(qs.data(), {s.b, s.h, s.l, s.d});
    if (in.rpe_k.term)
        cpu::term_forward<S>(*in.rpe_k.term, *ids_k, in.rpe_k.tables,
                             in.rpe_k.term->contextual() ? qs_ref : tensor_ref<const S>{}, attn, write::accumulate);
    if (in.rpe_q.term) {
        tensor_ref<const S> ks_ref;
        if (in.rpe_q.term->contextual()) {
            ks.resize(static_cast<std::size_t>(in.k.size()));
            for (std::int64_t e = 0; e < in.k.size(); ++e) ks[e] = in.k.data[e] * scale;
            ks_ref = tensor_ref<const S>(ks.data(), {s.b, s.h, s.l, s.d});
        }
        cpu::term_forward<S>(*in.rpe_q.term, *ids_q, in.rpe_q.tables, ks_ref, attn, write::accumulate);
    }
    const bool masked = in.key_padding_mask.data != nullptr;
    for (std::int64_t p = 0; p < planes; ++p) {
        const std::uint8_t* mask = masked ? in.key_padding_mask.data + (p / s.h) * n : nullptr;
        for (std::int64_t i = 0; i < n; ++i) {
            S* row = attn.data + (p * n + i) * n;
            if (in.attn_mask.data)
                for (std::int64_t j = 0; j < n; ++j) row[j] += in.attn_mask.data[i * n + j];
            detail::cpu::softmax_row(row, n, mask);
        }
    }
    for (std::int64_t p = 0; p < planes; ++p)
        map<S>(out.data + p * n * s.d, n, s.d).noalias() =
            cmap<S>(attn.data + p * n * n, n, n) * cmap<S>(in.v.data + p * n * s.d, n, s.d);
    if (in.rpe_v.term) cpu::term_forward<S>(*in.rpe_v.term, *ids_v, in.rpe_v.tables, attn, out, write::accumulate);
}

/// @brief Backward of composed_attention_forward for `sum(out · grad_out)`, its tensors by name as
/// rpe::attention_backward's: `composed_attention_backward(in, {.grad_out = go, .grad_q = gq,
/// .grad_k = gk, .grad_v = gv, .saved_attn = attn}, opt)`.
/// @param g  `grad_out` (B, H, L, D); `grad_q`, `grad_k`, `grad_v` (B, H, L, D), written:
///   gradients for the unscaled q, k, v; `saved_attn` (B, H, L, L): the probabilities written by
///   the forward, required (this baseline does not recompute them).
/// The tables' gradients are written into each attention_term's `grad_tables` (when given).
/// Masked keys get exactly zero grad_k and grad_v rows. `opt`: the forward's (same scale).
/// @throws as the forward; rpe::invalid_argument `[rpe.attention] saved_attn = empty; expected the
///   (B, H, L, L) probabilities ...` when `g.saved_attn` is not given.
template <class S>
void composed_attention_backward(const attention_inputs<S>& in, const attention_gradients<S>& g,
                                 const attention_options& opt = {}) {
    const auto s = detail::check_attention(in, cpu::attention_caps);
    detail::require(g.saved_attn.data != nullptr || g.saved_attn.rank != 0, "attention",
                    "saved_attn = empty; expected the (B, H, L, L) probabilities of composed_attention_forward (the "
                    "composed backward does not recompute them)");
    detail::check_shape(g.saved_attn, {s.b, s.h, s.l, s.l}, "attention", "saved_attn");
    detail::check_nonnull(g.saved_attn, "attention", "saved_attn");
    detail::check_attention_gradients(in, s, g.saved_attn, g.grad_out, g.grad_q, g.grad_k, g.grad_v);
    const tensor_ref<const S> attn = g.saved_attn, grad_out = g.grad_out;
    const tensor_ref<S> grad_q = g.grad_q, grad_k = g.grad_k, grad_v = g.grad_v;
    if (detail::on_contiguous_qkv(in, [&](const attention_inputs<S>& c) { composed_attention_backward(c, g, opt); })) return;
    if (in.rope.enabled()) {  // RoPE: the step on rotated q, k, then rpe::rope_backward of both
        const std::vector<std::int64_t> shape{s.b, s.h, s.l, s.d};
        std::vector<S> qr, kr, gq(static_cast<std::size_t>(in.q.size())), gk(gq.size());
        composed_attention_backward(detail::rope_rotated(in, qr, kr),
                                    {.grad_out = grad_out,
                                     .grad_q = tensor_ref<S>(gq.data(), shape),
                                     .grad_k = tensor_ref<S>(gk.data(), shape),
                                     .grad_v = grad_v,
                                     .saved_attn = attn},
                                    opt);
        auto r = query_rope(in.rope);
        std::vector<S> fq, fk;
        if (r.grad_freqs.data) {
            fq.resize(static_cast<std::size_t>(r.grad_freqs.size()));
            fk.resize(fq.size());
            r.grad_freqs.data = fq.data();
        }
        rope_backward(r, in.height, in.width, in.q, tensor_ref<const S>(gq.data(), shape), grad_q);
        r = key_rope(in.rope);
        if (r.grad_freqs.data) r.grad_freqs.data = fk.data();
        rope_backward(r, in.height, in.width, in.k, tensor_ref<const S>(gk.data(), shape), grad_k);
        for (std::size_t e = 0; e < fq.size(); ++e) in.rope.grad_freqs.data[e] = fq[e] + fk[e];
        return;
    }
    const auto ids_q = detail::ids_of(in.rpe_q, in);
    const auto ids_k = detail::ids_of(in.rpe_k, in);
    const auto ids_v = detail::ids_of(in.rpe_v, in);
    const S scale = static_cast<S>(detail::softmax_scale(opt, s.d));
    const std::int64_t n = s.l, dd = s.d, planes = s.b * s.h;
    using detail::cpu::cmap;
    using detail::cpu::map;
    // The terms add into the input gradients (write::accumulate), so their table gradients are
    // zeroed first: this call overwrites them.
    auto grad_tables_of = [](const attention_term<S>& slot) {
        std::vector<tensor_ref<S>> g = slot.grad_tables;
        g.resize(static_cast<std::size_t>(slot.term->num_tables()));
        for (auto& t : g)
            if (t.data) std::fill(t.data, t.data + t.size(), S(0));
        return g;
    };

    // grad_v = attnᵀ·grad_out; grad_attn = grad_out·vᵀ (+ value term)
    std::vector<S> grad_attn(static_cast<std::size_t>(planes * n * n));
    for (std::int64_t p = 0; p < planes; ++p) {
        const auto a = cmap<S>(attn.data + p * n * n, n, n);
        const auto go = cmap<S>(grad_out.data + p * n * dd, n, dd);
        map<S>(grad_v.data + p * n * dd, n, dd).noalias() = a.transpose() * go;
        map<S>(grad_attn.data() + p * n * n, n, n).noalias() = go * cmap<S>(in.v.data + p * n * dd, n, dd).transpose();
    }
    tensor_ref<S> grad_attn_ref(grad_attn.data(), {s.b, s.h, s.l, s.l});
    if (in.rpe_v.term) {
        const auto g = grad_tables_of(in.rpe_v);
        cpu::term_backward<S>(*in.rpe_v.term, *ids_v, in.rpe_v.tables, attn, grad_out, grad_attn_ref, g, write::accumulate);
    }
    // softmax backward: grad_logits = a ⊙ (grad_attn − Σ_j grad_attn ⊙ a)
    for (std::int64_t r = 0; r < planes * n; ++r) {
        const S* a = attn.data + r * n;
        S* g = grad_attn.data() + r * n;
        S dot = 0;
        for (std::int64_t j = 0; j < n; ++j) dot += g[j] * a[j];
        for (std::int64_t j = 0; j < n; ++j) g[j] = a[j] * (g[j] - dot);
    }
    const tensor_ref<const S> grad_logits(grad_attn.data(), {s.b, s.h, s.l, s.l});
    // qs = q·s: grad_qs = grad_logits·k (+ key term); grad_q = s·grad_qs
    std::vector<S> qs(static_cast<std::size_t>(in.q.size())), ks(static_cast<std::size_t>(in.k.size()));
    for (std::int64_t e = 0; e < in.q.size(); ++e) qs[e] = in.q.data[e] * scale;
    for (std::int64_t e = 0; e < in.k.size(); ++e) ks[e] = in.k.data[e] * scale;
    const tensor_ref<const S> qs_ref(qs.data(), {s.b, s.h, s.l, s.d}), ks_ref(ks.data(), {s.b, s.h, s.l, s.d});
    for (std::int64_t p = 0; p < planes; ++p) {
        const auto gl = cmap<S>(grad_attn.data() + p * n * n, n, n);
        map<S>(grad_q.data + p * n * dd, n, dd).noalias() = gl * cmap<S>(in.k.data + p * n * dd, n, dd);
        map<S>(grad_k.data + p * n * dd, n, dd).noalias() = gl.transpose() * cmap<S>(qs.data() + p * n * dd, n, dd);
    }
    if (in.rpe_k.term) {
        const auto g = grad_tables_of(in.rpe_k);
        const bool ctx = in.rpe_k.term->contextual();
        cpu::term_backward<S>(*in.rpe_k.term, *ids_k, in.rpe_k.tables, ctx ? qs_ref : tensor_ref<const S>{}, grad_logits,
                              ctx ? grad_q : tensor_ref<S>{}, g, write::accumulate);
    }
    for (std::int64_t e = 0; e < grad_q.size(); ++e) grad_q.data[e] *= scale;
    if (in.rpe_q.term) {
        const auto g = grad_tables_of(in.rpe_q);
        if (in.rpe_q.term->contextual()) {
            std::vector<S> grad_ks(static_cast<std::size_t>(in.k.size()));
            cpu::term_backward<S>(*in.rpe_q.term, *ids_q, in.rpe_q.tables, ks_ref, grad_logits,
                                  tensor_ref<S>(grad_ks.data(), {s.b, s.h, s.l, s.d}), g, write::accumulate);
            for (std::int64_t e = 0; e < grad_k.size(); ++e) grad_k.data[e] += scale * grad_ks[e];
        } else {
            cpu::term_backward<S>(*in.rpe_q.term, *ids_q, in.rpe_q.tables, {}, grad_logits, {}, g, write::accumulate);
        }
    }
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
