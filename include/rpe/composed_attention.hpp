/// @file composed_attention.hpp
/// @brief The reference's attention step with iRPE (SPEC §4), composed from single terms:
/// logits buffer, RPE terms, key padding mask, softmax, value term — forward and backward.
///
/// This is the plain, obviously-correct baseline (it materialises (B, H, L, L) logits); a fused
/// attention must give the same numbers.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "any_term.hpp"
#include "backend/cpu/kernels.hpp"
#include "detail/check.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace rpe {

/// @brief One RPE term attached to the attention step: the term (null = none), its lookup
/// table(s) (1, or 2 for Cross: rows, cols) and, for backward, where their gradients go
/// (empty = not wanted).
template <class S>
struct attention_term {
    const any_term<S>* term = nullptr;                ///< the configured term, or null
    std::vector<tensor_ref<const S>> tables;          ///< its table(s), shapes term->table_shape()
    std::vector<tensor_ref<S>> grad_tables;           ///< gradients of the tables (backward), or empty
};

/// @brief Inputs of the attention step.
///
/// q, k, v: (B, H, L, D), projected and unscaled; `L = skip + depth·height·width` (depth 1
/// unless the terms use a 3D mapping). The grid size is
/// given explicitly (the reference's default of a square ⌊√L⌋ grid is not guessed).
/// attn_mask: optional (L, L) additive mask (DETR's float `attn_mask`), added to the logits after
/// all RPE terms; −∞ entries mask a pair.
/// key_padding_mask: optional (B, L), nonzero = padded key (DETR): those logits become −∞ after
/// all RPE terms are added. Rows whose keys are all masked give zero probabilities and zero
/// output (the reference gives NaN there).
template <class S>
struct attention_inputs {
    tensor_ref<const S> q, k, v;                    ///< (B, H, L, D)
    int height = 0;                                 ///< grid rows
    int width = 0;                                  ///< grid columns
    attention_term<S> rpe_q, rpe_k, rpe_v;          ///< RPE on queries, keys, values (each optional)
    tensor_ref<const S> attn_mask;                  ///< (L, L) additive, or empty
    tensor_ref<const std::uint8_t> key_padding_mask;  ///< (B, L) or empty
    int depth = 1;                                  ///< grid frames (3D mappings on T x H x W video grids)
};

namespace detail {

template <class S>
struct attention_shape {
    std::int64_t b, h, l, d;
};

template <class S>
attention_shape<S> check_attention(const attention_inputs<S>& in) {
    require(in.q.rank == 4, "attention", "q has shape ", in.q.shape_string(), "; expected (B, H, L, D)");
    attention_shape<S> s{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
    require(s.b >= 1 && s.h >= 1 && s.l >= 1 && s.d >= 1, "attention", "q has shape ", in.q.shape_string(),
            "; expected positive extents");
    // q sets (B, H, L, D); k and v must match it
    require(in.k.has_shape({s.b, s.h, s.l, s.d}), "attention", "k has shape ", in.k.shape_string(), "; expected ",
            in.q.shape_string(), ", the shape of q");
    require(in.v.has_shape({s.b, s.h, s.l, s.d}), "attention", "v has shape ", in.v.shape_string(), "; expected ",
            in.q.shape_string(), ", the shape of q");
    check_nonnull(in.q, "attention", "q");
    check_nonnull(in.k, "attention", "k");
    check_nonnull(in.v, "attention", "v");
    if (in.attn_mask.rank != 0 || in.attn_mask.data != nullptr) {
        check_shape(in.attn_mask, {s.l, s.l}, "attention", "attn_mask");
        check_nonnull(in.attn_mask, "attention", "attn_mask");
    }
    if (in.key_padding_mask.rank != 0 || in.key_padding_mask.data != nullptr) {
        check_shape(in.key_padding_mask, {s.b, s.l}, "attention", "key_padding_mask");
        check_nonnull(in.key_padding_mask, "attention", "key_padding_mask");
    }
    const attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
    const target wanted[] = {target::query, target::key, target::value};
    for (int i = 0; i < 3; ++i) {
        const auto& slot = *slots[i];
        if (!slot.term) continue;
        require(slot.term->target() == wanted[i], "attention", names[i], " holds a term on target ",
                target_letter(slot.term->target()), "; expected ", target_letter(wanted[i]));
        require(slot.term->num_heads() == s.h, "attention", names[i], " has num_heads = ", slot.term->num_heads(),
                "; expected H = ", s.h, " of q");
        require(slot.term->head_dim() == s.d, "attention", names[i], " has head_dim = ", slot.term->head_dim(),
                "; expected D = ", s.d, " of q");
        require(s.l == slot.term->skip() + static_cast<std::int64_t>(in.depth) * in.height * in.width, "attention", "L = ", s.l,
                " of q; expected skip + ", in.depth == 1 ? "" : "depth*", "height*width = ", slot.term->skip(), " + ",
                in.depth == 1 ? std::string() : std::to_string(in.depth) + "*", in.height, "*", in.width);
        require(static_cast<int>(slot.tables.size()) == slot.term->num_tables(), "attention", names[i], " tables holds ",
                slot.tables.size(), " tables; expected ", slot.term->num_tables());
        const auto shape = slot.term->table_shape();
        for (const auto& t : slot.tables) {
            check_shape(t, shape, "attention", std::string(names[i]) + " table");
            check_nonnull(t, "attention", std::string(names[i]) + " table");
        }
    }
    return s;
}

/// @brief Throws when an output view overlaps q, k, v, the masks or the terms' tables.
template <class S, class T>
void check_output_overlap(const attention_inputs<S>& in, const tensor_ref<T>& out, const char* name) {
    for (const tensor_ref<const S>* x : {&in.q, &in.k, &in.v}) check_no_overlap(out, *x, "attention", name, "q/k/v");
    check_no_overlap(out, in.attn_mask, "attention", name, "attn_mask");
    check_no_overlap(out, in.key_padding_mask, "attention", name, "key_padding_mask");
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->tables) check_no_overlap(out, t, "attention", name, "a lookup table");
}

/// @brief Checks the attention_terms' grad_tables: each given entry (data or shape set) has its
/// table's shape and data, and is separate from the inputs, from `others` (the call's other
/// buffers: grad_out, attn, grad_q/k/v) and from every other grad_tables entry.
template <class S>
void check_grad_tables(const attention_inputs<S>& in, std::initializer_list<std::pair<tensor_ref<const S>, const char*>> others) {
    const attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
    std::vector<std::pair<tensor_ref<const S>, std::string>> seen;
    for (int i = 0; i < 3; ++i) {
        const auto& slot = *slots[i];
        if (!slot.term) continue;
        require(slot.grad_tables.size() <= static_cast<std::size_t>(slot.term->num_tables()), "attention", names[i],
                " grad_tables holds ", slot.grad_tables.size(), " entries; expected at most ", slot.term->num_tables());
        for (std::size_t t = 0; t < slot.grad_tables.size(); ++t) {
            const auto& g = slot.grad_tables[t];
            if (g.data == nullptr && g.rank == 0) continue;  // not wanted
            const std::string name = std::string(names[i]) + " grad_tables[" + std::to_string(t) + "]";
            check_shape(g, slot.term->table_shape(), "attention", name);
            check_nonnull(g, "attention", name);
            check_output_overlap(in, g, name.c_str());
            for (const auto& [other, other_name] : others) check_no_overlap(g, other, "attention", name, other_name);
            for (const auto& [prev, prev_name] : seen) check_no_overlap(g, prev, "attention", name, prev_name);
            seen.emplace_back(tensor_ref<const S>(g), name);
        }
    }
}

template <class S>
std::shared_ptr<const bucket_ids> ids_of(const attention_term<S>& slot, const attention_inputs<S>& in,
                                         id_storage storage = id_storage::automatic) {
    return slot.term ? slot.term->bucket_ids(in.depth, in.height, in.width, storage) : nullptr;
}

}  // namespace detail

/// @brief Forward of the attention step (SPEC §4, reference `RPEAttention.forward` without the
/// projections and dropout): `qs = q·s`, `s = D^−½`; `logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·s)`;
/// mask; `attn = softmax_j(logits)`; `out = attn·v + rpe_v(attn)`.
/// @param out  (B, H, L, D), written.
/// @param attn (B, H, L, L), written: the probabilities, needed by the backward.
/// @throws rpe::invalid_argument `[rpe.attention] ...` / `[rpe.term] ...` for mismatched shapes,
///   grid, heads, or a term on the wrong slot; checks run before any output is written.
/// Cost: O(B·H·L²·D) for the content products plus the terms' costs (rpe::term).
template <class S>
void composed_attention_forward(const attention_inputs<S>& in, tensor_ref<S> out, tensor_ref<S> attn) {
    const auto s = detail::check_attention(in);
    detail::check_shape(out, {s.b, s.h, s.l, s.d}, "attention", "out");
    detail::check_shape(attn, {s.b, s.h, s.l, s.l}, "attention", "attn");
    detail::check_nonnull(out, "attention", "out");
    detail::check_nonnull(attn, "attention", "attn");
    detail::check_output_overlap(in, out, "out");
    detail::check_output_overlap(in, attn, "attn");
    detail::check_no_overlap(out, attn, "attention", "out", "attn");
    const auto ids_q = detail::ids_of(in.rpe_q, in);
    const auto ids_k = detail::ids_of(in.rpe_k, in);
    const auto ids_v = detail::ids_of(in.rpe_v, in);
    const S scale = static_cast<S>(1.0 / std::sqrt(static_cast<double>(s.d)));
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
        in.rpe_k.term->forward(*ids_k, in.rpe_k.tables, in.rpe_k.term->contextual() ? qs_ref : tensor_ref<const S>{}, attn,
                               write::accumulate);
    if (in.rpe_q.term) {
        tensor_ref<const S> ks_ref;
        if (in.rpe_q.term->contextual()) {
            ks.resize(static_cast<std::size_t>(in.k.size()));
            for (std::int64_t e = 0; e < in.k.size(); ++e) ks[e] = in.k.data[e] * scale;
            ks_ref = tensor_ref<const S>(ks.data(), {s.b, s.h, s.l, s.d});
        }
        in.rpe_q.term->forward(*ids_q, in.rpe_q.tables, ks_ref, attn, write::accumulate);
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
    if (in.rpe_v.term) in.rpe_v.term->forward(*ids_v, in.rpe_v.tables, attn, out, write::accumulate);
}

/// @brief Backward of composed_attention_forward for `sum(out · grad_out)`.
/// @param attn     (B, H, L, L): the probabilities written by the forward.
/// @param grad_out (B, H, L, D).
/// @param grad_q, grad_k, grad_v (B, H, L, D), written: gradients for the unscaled q, k, v.
/// The tables' gradients are written into each attention_term's `grad_tables` (when given).
/// Masked keys get exactly zero grad_k and grad_v rows.
/// @throws as the forward.
template <class S>
void composed_attention_backward(const attention_inputs<S>& in, tensor_ref<const S> attn, tensor_ref<const S> grad_out,
                                 tensor_ref<S> grad_q, tensor_ref<S> grad_k, tensor_ref<S> grad_v) {
    const auto s = detail::check_attention(in);
    const std::vector<std::int64_t> qshape{s.b, s.h, s.l, s.d};
    detail::check_shape(attn, {s.b, s.h, s.l, s.l}, "attention", "attn");
    detail::check_shape(grad_out, qshape, "attention", "grad_out");
    detail::check_shape(grad_q, qshape, "attention", "grad_q");
    detail::check_shape(grad_k, qshape, "attention", "grad_k");
    detail::check_shape(grad_v, qshape, "attention", "grad_v");
    detail::check_nonnull(attn, "attention", "attn");
    detail::check_nonnull(grad_out, "attention", "grad_out");
    const tensor_ref<S>* outs[] = {&grad_q, &grad_k, &grad_v};
    const char* out_names[] = {"grad_q", "grad_k", "grad_v"};
    for (int i = 0; i < 3; ++i) {
        detail::check_nonnull(*outs[i], "attention", out_names[i]);
        detail::check_output_overlap(in, *outs[i], out_names[i]);
        detail::check_no_overlap(*outs[i], attn, "attention", out_names[i], "attn");
        detail::check_no_overlap(*outs[i], grad_out, "attention", out_names[i], "grad_out");
        for (int j = 0; j < i; ++j) detail::check_no_overlap(*outs[i], *outs[j], "attention", out_names[i], out_names[j]);
    }
    detail::check_grad_tables(in, {{attn, "attn"}, {grad_out, "grad_out"}, {grad_q, "grad_q"}, {grad_k, "grad_k"},
                                   {grad_v, "grad_v"}});
    const auto ids_q = detail::ids_of(in.rpe_q, in);
    const auto ids_k = detail::ids_of(in.rpe_k, in);
    const auto ids_v = detail::ids_of(in.rpe_v, in);
    const S scale = static_cast<S>(1.0 / std::sqrt(static_cast<double>(s.d)));
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
        in.rpe_v.term->backward(*ids_v, in.rpe_v.tables, attn, grad_out, grad_attn_ref, g, write::accumulate);
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
        in.rpe_k.term->backward(*ids_k, in.rpe_k.tables, ctx ? qs_ref : tensor_ref<const S>{}, grad_logits,
                                ctx ? grad_q : tensor_ref<S>{}, g, write::accumulate);
    }
    for (std::int64_t e = 0; e < grad_q.size(); ++e) grad_q.data[e] *= scale;
    if (in.rpe_q.term) {
        const auto g = grad_tables_of(in.rpe_q);
        if (in.rpe_q.term->contextual()) {
            std::vector<S> grad_ks(static_cast<std::size_t>(in.k.size()));
            in.rpe_q.term->backward(*ids_q, in.rpe_q.tables, ks_ref, grad_logits,
                                    tensor_ref<S>(grad_ks.data(), {s.b, s.h, s.l, s.d}), g, write::accumulate);
            for (std::int64_t e = 0; e < grad_k.size(); ++e) grad_k.data[e] += scale * grad_ks[e];
        } else {
            in.rpe_q.term->backward(*ids_q, in.rpe_q.tables, {}, grad_logits, {}, g, write::accumulate);
        }
    }
}

}  // namespace rpe
