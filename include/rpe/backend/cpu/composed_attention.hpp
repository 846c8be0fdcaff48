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
#include <type_traits>
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

/// @brief What the composed baseline supports: the CPU attention's features, except keys of
/// another length than the queries (attention_capabilities::cross_lengths) and a forward on some
/// query rows only (attention_options::query_rows): refused with rpe::not_supported; the fused
/// CPU attention takes them.
inline constexpr attention_capabilities composed_attention_caps = [] {
    attention_capabilities c = ::rpe::cpu::attention_caps;
    c.backend = "composed";
    c.cross_lengths = false;
    c.query_rows = false;
    return c;
}();

/// @brief The scalar types of the composed baseline: float and double (bf16 and f16 are
/// rpe::attention_forward's / attention_backward's).
template <class S>
inline constexpr bool composed_scalar = std::is_same_v<S, float> || std::is_same_v<S, double>;

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

/// A contiguous copy of a 2D view (a packed image's block of a mask).
template <class T>
std::vector<std::remove_const_t<T>> contiguous_copy_2d(const tensor_ref<T>& t) {
    std::vector<std::remove_const_t<T>> out;
    out.reserve(static_cast<std::size_t>(t.size()));
    for (std::int64_t a = 0; a < t.extent(0); ++a)
        for (std::int64_t b = 0; b < t.extent(1); ++b) out.push_back(t.data[a * t.stride(0) + b * t.stride(1)]);
    return out;
}

/// One packed image's inputs with contiguous copies of its q, k, v and masks (the composed
/// baseline's checks want contiguous masks).
template <class S>
struct composed_image {
    std::vector<S> q, k, v;
    std::vector<std::uint8_t> kpm;
    std::vector<S> mask;
    attention_inputs<S> in;
    std::vector<std::int64_t> shape;
    explicit composed_image(const packed_image<S>& img) : in(img.in) {
        shape = {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
        q = contiguous_copy(in.q);
        k = contiguous_copy(in.k);
        v = contiguous_copy(in.v);
        in.q = tensor_ref<const S>(q.data(), shape);
        in.k = tensor_ref<const S>(k.data(), shape);
        in.v = tensor_ref<const S>(v.data(), shape);
        if (!is_empty_view(in.key_padding_mask)) {
            kpm = contiguous_copy_2d(in.key_padding_mask);
            in.key_padding_mask = tensor_ref<const std::uint8_t>(kpm.data(), {shape[0], shape[2]});
        }
        if (!is_empty_view(in.attn_mask)) {
            mask = contiguous_copy_2d(in.attn_mask);
            in.attn_mask = tensor_ref<const S>(mask.data(), {shape[2], shape[2]});
        }
    }
};

/// `in` with its key_lengths turned into a key_padding_mask (kept in `mask`, (B, L); keys at
/// index >= key_lengths[b] padded, or'ed with the given mask).
template <class S>
attention_inputs<S> lengths_as_mask(const attention_inputs<S>& in, std::vector<std::uint8_t>& mask) {
    const std::int64_t b = in.q.extent(0), l = in.q.extent(2);
    mask.assign(static_cast<std::size_t>(b * l), 0);
    for (std::int64_t i = 0; i < b; ++i)
        for (std::int64_t j = 0; j < l; ++j)
            mask[static_cast<std::size_t>(i * l + j)] =
                j >= in.key_lengths.data[i] || (in.key_padding_mask.data && in.key_padding_mask.data[i * l + j]);
    attention_inputs<S> c = in;
    c.key_lengths = {};
    c.key_padding_mask = tensor_ref<const std::uint8_t>(mask.data(), {b, l});
    return c;
}

/// Copies the (B, H, len, inner) buffer `src` into rows [off, off + len) of axis 2 of `dst` (B, H, L, inner).
template <class S>
void put_rows(const std::vector<S>& src, tensor_ref<S> dst, std::int64_t off, std::int64_t len) {
    const std::int64_t planes = dst.extent(0) * dst.extent(1), l = dst.extent(2), inner = dst.extent(3);
    for (std::int64_t p = 0; p < planes; ++p)
        std::copy_n(src.begin() + p * len * inner, len * inner, dst.data + (p * l + off) * inner);
}

}  // namespace detail

inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp: the step calls the CPU kernels

/// @brief Forward of the attention step (reference `RPEAttention.forward` without the
/// projections and dropout): `qs = q·s`, `s = opt.scale` (default `D^−½`); `logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·s)`;
/// mask; `attn = softmax_j(logits)`; `out = attn·v + rpe_v(attn)`. With `in.rope`, q and k are
/// first rotated by rpe::rope_forward into copies and the step runs on those. Strided q, k, v
/// are copied into contiguous buffers first (this is the plain baseline). With `in.packed`, each
/// image runs alone on copies of its tokens (`attn` block-diagonal, zero between images); with
/// `in.key_lengths`, the keys past each length are padded through a key padding mask.
/// @param out  (B, H, L, D), written.
/// @param attn (B, H, L, L), written: the probabilities, needed by the backward.
/// @throws rpe::invalid_argument `[rpe.attention] ...` / `[rpe.term] ...` for mismatched shapes,
///   grid, heads, or a term on the wrong slot; checks run before any output is written.
/// Cost: O(B·H·L²·D) for the content products plus the terms' costs (rpe::term).
/// S: float or double (rpe::bf16 is refused at compile time: rpe::attention_forward takes it).
template <class S>
void composed_attention_forward(const attention_inputs<S>& in, tensor_ref<S> out, tensor_ref<S> attn,
                                const attention_options& opt = {}) {
    static_assert(
        detail::composed_scalar<S>,
        "rpe: composed_attention_forward (the plain baseline) takes float or double; for rpe::bf16 / rpe::f16 storage use "
        "rpe::attention_forward (the fused attention)");
    if constexpr (detail::composed_scalar<S>) {  // else the static_assert alone speaks: no errors from the body
        const auto s = detail::check_attention(in, detail::composed_attention_caps);
        detail::require_feature(!opt.query_rows.whole(s.l), false, detail::composed_attention_caps,
                                "options.query_rows (some query rows only)");
        detail::check_attention_outputs(in, s, out, attn, true);
        if (in.packed.enabled()) {  // each image alone on copies of its tokens; attn block-diagonal, 0 across images
            std::fill(attn.data, attn.data + attn.size(), S(0));
            for (const auto& img : detail::packed_images(in)) {
                detail::composed_image<S> c(img);
                const std::int64_t len = img.length, planes = s.b * s.h;
                std::vector<S> o(static_cast<std::size_t>(planes * len * s.d)), a(static_cast<std::size_t>(planes * len * len));
                composed_attention_forward(c.in, tensor_ref<S>(o.data(), c.shape), tensor_ref<S>(a.data(), {s.b, s.h, len, len}),
                                           opt);
                detail::put_rows(o, out, img.offset, len);
                for (std::int64_t p = 0; p < planes; ++p)
                    for (std::int64_t i = 0; i < len; ++i)
                        std::copy_n(a.begin() + (p * len + i) * len, len,
                                    attn.data + (p * s.l + img.offset + i) * s.l + img.offset);
            }
            return;
        }
        if (!detail::is_empty_view(in.key_lengths)) {  // valid key lengths: the same step with the mask they make
            std::vector<std::uint8_t> mask;
            composed_attention_forward(detail::lengths_as_mask(in, mask), out, attn, opt);
            return;
        }
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
/// S: float or double (rpe::bf16 is refused at compile time: rpe::attention_backward takes it).
template <class S>
void composed_attention_backward(const attention_inputs<S>& in, const attention_gradients<S>& g,
                                 const attention_options& opt = {}) {
    static_assert(
        detail::composed_scalar<S>,
        "rpe: composed_attention_backward (the plain baseline) takes float or double; for rpe::bf16 / rpe::f16 storage use "
        "rpe::attention_backward (the fused attention)");
    if constexpr (detail::composed_scalar<S>) {  // else the static_assert alone speaks: no errors from the body
        const auto s = detail::check_attention(in, detail::composed_attention_caps);
        detail::require_feature(!opt.query_rows.whole(s.l), false, detail::composed_attention_caps,
                                "options.query_rows (some query rows only)");
        detail::require(g.saved_attn.data != nullptr || g.saved_attn.rank != 0, "attention",
                        "saved_attn = empty; expected the (B, H, L, L) probabilities of composed_attention_forward (the "
                        "composed backward does not recompute them)");
        detail::check_shape(g.saved_attn, {s.b, s.h, s.l, s.l}, "attention", "saved_attn");
        detail::check_nonnull(g.saved_attn, "attention", "saved_attn");
        detail::check_attention_gradients(in, s, g.saved_attn, g.grad_out, g.grad_q, g.grad_k, g.grad_v);
        const tensor_ref<const S> attn = g.saved_attn, grad_out = g.grad_out;
        const tensor_ref<S> grad_q = g.grad_q, grad_k = g.grad_k, grad_v = g.grad_v;
        if (in.packed.enabled()) {  // each image alone; the table gradients summed in image order
            bool first = true;
            for (const auto& img : detail::packed_images(in)) {
                detail::composed_image<S> c(img);
                const std::int64_t len = img.length, planes = s.b * s.h;
                const auto rows = [&](const tensor_ref<const S>& t) {
                    return detail::contiguous_copy(detail::token_slice(t, {2}, img.offset, len));
                };
                const auto go = rows(grad_out);
                std::vector<S> a(static_cast<std::size_t>(planes * len * len));
                for (std::int64_t p = 0; p < planes; ++p)
                    for (std::int64_t i = 0; i < len; ++i)
                        std::copy_n(attn.data + (p * s.l + img.offset + i) * s.l + img.offset, len,
                                    a.begin() + (p * len + i) * len);
                std::vector<S> gq(go.size()), gk(go.size()), gv(go.size());
                std::vector<std::vector<S>> gt;  // the image's table gradients
                for (auto* slot : {&c.in.rpe_q, &c.in.rpe_k, &c.in.rpe_v})
                    for (auto& t : slot->grad_tables)
                        if (t.data) {
                            gt.emplace_back(static_cast<std::size_t>(t.size()));
                            t = tensor_ref<S>(gt.back().data(), std::span<const std::int64_t>(t.shape.data(), t.rank));
                        }
                composed_attention_backward(c.in,
                                            {.grad_out = tensor_ref<const S>(go.data(), c.shape),
                                             .grad_q = tensor_ref<S>(gq.data(), c.shape),
                                             .grad_k = tensor_ref<S>(gk.data(), c.shape),
                                             .grad_v = tensor_ref<S>(gv.data(), c.shape),
                                             .saved_attn = tensor_ref<const S>(a.data(), {s.b, s.h, len, len})},
                                            opt);
                detail::put_rows(gq, grad_q, img.offset, len);
                detail::put_rows(gk, grad_k, img.offset, len);
                detail::put_rows(gv, grad_v, img.offset, len);
                std::size_t next = 0;
                for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
                    for (const auto& t : slot->grad_tables)
                        if (t.data) {
                            const auto& src = gt[next++];
                            for (std::int64_t e = 0; e < t.size(); ++e) t.data[e] = first ? src[e] : t.data[e] + src[e];
                        }
                first = false;
            }
            return;
        }
        if (!detail::is_empty_view(in.key_lengths)) {
            std::vector<std::uint8_t> mask;
            composed_attention_backward(detail::lengths_as_mask(in, mask), g, opt);
            return;
        }
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
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
