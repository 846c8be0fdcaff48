/// @file attention_inputs.hpp
/// @brief The inputs of the attention step (rpe::attention_term, rpe::attention_inputs) and their
/// checks: the backend-neutral front that the composed baseline, the fused CPU attention and the
/// CUDA attention all call, so a bad input gets the same exception from each.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "any_term.hpp"
#include "bucket_id_set.hpp"
#include "bucket_key.hpp"
#include "detail/check.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "rotary.hpp"
#include "tensor.hpp"

namespace rpe {

/// @brief One RPE term attached to the attention step: the term (null = none), its lookup
/// table(s) (1, or 2 for Cross: rows, cols) and, for backward, where their gradients go
/// (empty = not wanted).
template <class S>
struct attention_term {
    const any_term<S>* term = nullptr;                ///< the configured term, or null
    std::vector<tensor_ref<const S>> tables = {};        ///< its table(s), shapes term->table_shape()
    std::vector<tensor_ref<S>> grad_tables = {};         ///< gradients of the tables (backward), or empty
};

/// @brief Inputs of the attention step.
///
/// q, k, v: (B, H, L, D), projected and unscaled; `L = skip + depth·height·width` (depth 1
/// unless the terms use a 3D mapping). They may be strided views whose last stride is 1
/// (tensor_ref::with_strides; e.g. read in place from a packed (B, L, 3, H, D) qkv projection);
/// outputs, masks and tables are contiguous. The grid size is
/// given explicitly (the reference's default of a square ⌊√L⌋ grid is not guessed).
/// attn_mask: optional (L, L) additive mask (DETR's float `attn_mask`), added to the logits after
/// all RPE terms; −∞ entries mask a pair.
/// key_padding_mask: optional (B, L), nonzero = padded key (DETR): those logits become −∞ after
/// all RPE terms are added. Rows whose keys are all masked give zero probabilities and zero
/// output (the reference gives NaN there).
/// rope: optional 2D rotary position embedding of q and k (rpe::rotary_embedding; 2D grids only,
/// `L = rope.skip + height*width`): q and k are rotated first, and everything after (q·kᵀ and
/// the iRPE terms, contextual ones included) sees the rotated q and k, as if rpe::rope_forward
/// had been applied to both before the attention.
template <class S>
struct attention_inputs {
    using scalar_type = S;                          ///< element type of q, k, v, tables, masks
    static constexpr bool strided_qkv = true;       ///< q, k, v may be strided views (last stride 1)
    tensor_ref<const S> q, k, v;                    ///< (B, H, L, D), contiguous or strided (rows of D contiguous)
    int height = 0;                                 ///< grid rows
    int width = 0;                                  ///< grid columns
    attention_term<S> rpe_q, rpe_k, rpe_v;          ///< RPE on queries, keys, values (each optional)
    tensor_ref<const S> attn_mask;                  ///< (L, L) additive, or empty
    tensor_ref<const std::uint8_t> key_padding_mask;  ///< (B, L) or empty
    int depth = 1;                                  ///< grid frames (3D mappings on T x H x W video grids)
    rotary_embedding<S> rope = {};                  ///< RoPE on q and k (form std::monostate = none)
};

namespace detail {

/// @brief (B, H, L, D) of an attention call.
struct attention_shape {
    std::int64_t b, h, l, d;
};

/// @brief Checks q, k, v, the grid (depth, height, width), the masks and each attached term
/// (slot, heads, head dim, skip + grid = L, tables' count and shapes) of any backend's attention
/// inputs (`In`: rpe::attention_inputs or rpe::cuda::attention_inputs). Returns (B, H, L, D).
/// @throws rpe::invalid_argument `[rpe.attention] ...` naming the argument.
template <class In>
attention_shape check_attention(const In& in) {
    require(in.q.rank == 4, "attention", "q has shape ", in.q.shape_string(), "; expected (B, H, L, D)");
    attention_shape s{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
    require(s.b >= 1 && s.h >= 1 && s.l >= 1 && s.d >= 1, "attention", "q has shape ", in.q.shape_string(),
            "; expected positive extents");
    // q sets (B, H, L, D); k and v must match it
    if (!in.k.has_shape({s.b, s.h, s.l, s.d}))
        throw invalid_argument(message("attention", "k has shape ", in.k.shape_string(), "; expected ", in.q.shape_string(),
                                       ", the shape of q"));
    if (!in.v.has_shape({s.b, s.h, s.l, s.d}))
        throw invalid_argument(message("attention", "v has shape ", in.v.shape_string(), "; expected ", in.q.shape_string(),
                                       ", the shape of q"));
    // q, k, v may be strided views (rows of D contiguous) where the backend reads them so
    // (In::strided_qkv); elsewhere a strided view is rejected by check_nonnull
    if constexpr (requires { In::strided_qkv; }) {
        check_strided_rows(in.q, "attention", "q");
        check_strided_rows(in.k, "attention", "k");
        check_strided_rows(in.v, "attention", "v");
    } else {
        check_nonnull(in.q, "attention", "q");
        check_nonnull(in.k, "attention", "k");
        check_nonnull(in.v, "attention", "v");
    }
    if (in.attn_mask.rank != 0 || in.attn_mask.data != nullptr) {
        check_shape(in.attn_mask, {s.l, s.l}, "attention", "attn_mask");
        check_nonnull(in.attn_mask, "attention", "attn_mask");
    }
    if (in.key_padding_mask.rank != 0 || in.key_padding_mask.data != nullptr) {
        check_shape(in.key_padding_mask, {s.b, s.l}, "attention", "key_padding_mask");
        check_nonnull(in.key_padding_mask, "attention", "key_padding_mask");
    }
    using slot_type = std::remove_cvref_t<decltype(in.rpe_q)>;
    const slot_type* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    static constexpr const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
    static constexpr const char* table_names[] = {"rpe_q table", "rpe_k table", "rpe_v table"};
    const target wanted[] = {target::query, target::key, target::value};
    for (int i = 0; i < 3; ++i) {
        const auto& slot = *slots[i];
        if (!slot.term) continue;
        const auto& t = *slot.term;
        require(t.target() == wanted[i], "attention", names[i], " holds a term on target ", target_letter(t.target()),
                "; expected ", target_letter(wanted[i]));
        require(t.num_heads() == s.h, "attention", names[i], " has num_heads = ", t.num_heads(), "; expected H = ", s.h, " of q");
        require(t.head_dim() == s.d, "attention", names[i], " has head_dim = ", t.head_dim(), "; expected D = ", s.d, " of q");
        if (s.l != t.skip() + static_cast<std::int64_t>(in.depth) * in.height * in.width)
            throw invalid_argument(message("attention", "L = ", s.l, " of q; expected skip + ", in.depth == 1 ? "" : "depth*",
                                           "height*width = ", t.skip(), " + ",
                                           in.depth == 1 ? std::string() : std::to_string(in.depth) + "*", in.height, "*",
                                           in.width));
        require(static_cast<int>(slot.tables.size()) == t.num_tables(), "attention", names[i], " tables holds ",
                slot.tables.size(), " tables; expected ", t.num_tables());
        const auto shape = t.table_shape();
        for (const auto& tab : slot.tables) {
            check_shape(tab, shape, "attention", table_names[i]);
            check_nonnull(tab, "attention", table_names[i]);
        }
    }
    // RoPE (rpe::attention_inputs and rpe::cuda::attention_inputs; an input type without the field has none)
    if constexpr (requires { in.rope; }) check_rope(in.rope, s.h, s.l, s.d, in.depth, in.height, in.width, "attention");
    return s;
}

/// @brief Throws when an output view overlaps q, k, v, the masks or the terms' tables.
template <class In, class T>
void check_output_overlap(const In& in, const tensor_ref<T>& out, std::string_view name) {
    for (const auto* x : {&in.q, &in.k, &in.v}) check_no_overlap(out, *x, "attention", name, "q/k/v");
    check_no_overlap(out, in.attn_mask, "attention", name, "attn_mask");
    check_no_overlap(out, in.key_padding_mask, "attention", name, "key_padding_mask");
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->tables) check_no_overlap(out, t, "attention", name, "a lookup table");
    if constexpr (requires { in.rope; }) check_no_overlap(out, in.rope.freqs, "attention", name, "rope freqs");
}

/// @brief Checks the attention_terms' grad_tables: each given entry (data or shape set) has its
/// table's shape and data, and is separate from the inputs, from `others` (the call's other
/// buffers: grad_out, attn, grad_q/k/v) and from every other grad_tables entry.
template <class In>
void check_grad_tables(const In& in,
                       std::initializer_list<std::pair<tensor_ref<const typename In::scalar_type>, const char*>> others) {
    using S = typename In::scalar_type;
    using slot_type = std::remove_cvref_t<decltype(in.rpe_q)>;
    const slot_type* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    static constexpr const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
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
            check_output_overlap(in, g, name);
            for (const auto& [other, other_name] : others) check_no_overlap(g, other, "attention", name, other_name);
            for (const auto& [prev, prev_name] : seen) check_no_overlap(g, prev, "attention", name, prev_name);
            seen.emplace_back(tensor_ref<const S>(g), name);
        }
    }
}

/// @brief The forward's output checks: `out` (B, H, L, D) and, when `attn` is given (or
/// `attn_required`), `attn` (B, H, L, L), each non-null and separate from every input and from
/// each other. @throws rpe::invalid_argument `[rpe.attention] ...`.
template <class In, class S>
void check_attention_outputs(const In& in, const attention_shape& s, const tensor_ref<S>& out, const tensor_ref<S>& attn,
                             bool attn_required) {
    check_shape(out, {s.b, s.h, s.l, s.d}, "attention", "out");
    check_nonnull(out, "attention", "out");
    const bool with_attn = attn_required || attn.data != nullptr || attn.rank != 0;
    if (with_attn) {
        check_shape(attn, {s.b, s.h, s.l, s.l}, "attention", "attn");
        check_nonnull(attn, "attention", "attn");
    }
    check_output_overlap(in, out, "out");
    if (with_attn) {
        check_output_overlap(in, attn, "attn");
        check_no_overlap(out, attn, "attention", "out", "attn");
    }
}

/// @brief The backward's checks of grad_out and the outputs grad_q, grad_k, grad_v (each
/// (B, H, L, D), non-null, separate from the inputs, from `attn` (when given), grad_out and each
/// other) and of the terms' grad_tables. @throws rpe::invalid_argument `[rpe.attention] ...`.
template <class In, class S>
void check_attention_gradients(const In& in, const attention_shape& s, const tensor_ref<const S>& attn,
                               const tensor_ref<const S>& grad_out, const tensor_ref<S>& grad_q, const tensor_ref<S>& grad_k,
                               const tensor_ref<S>& grad_v) {
    const std::vector<std::int64_t> shape{s.b, s.h, s.l, s.d};
    check_shape(grad_out, shape, "attention", "grad_out");
    check_nonnull(grad_out, "attention", "grad_out");
    const tensor_ref<S>* outs[] = {&grad_q, &grad_k, &grad_v};
    static constexpr const char* names[] = {"grad_q", "grad_k", "grad_v"};
    for (int i = 0; i < 3; ++i) {
        check_shape(*outs[i], shape, "attention", names[i]);
        check_nonnull(*outs[i], "attention", names[i]);
        check_output_overlap(in, *outs[i], names[i]);
        check_no_overlap(*outs[i], attn, "attention", names[i], "attn");
        check_no_overlap(*outs[i], grad_out, "attention", names[i], "grad_out");
        for (int j = 0; j < i; ++j) check_no_overlap(*outs[i], *outs[j], "attention", names[i], names[j]);
    }
    check_grad_tables(in, {{attn, "attn"}, {grad_out, "grad_out"}, {grad_q, "grad_q"}, {grad_k, "grad_k"}, {grad_v, "grad_v"}});
    if constexpr (requires { in.rope; }) {
        if (check_rope_gradient(in.rope, s.h, s.d, "attention")) {
            const auto& g = in.rope.grad_freqs;
            check_output_overlap(in, g, "rope grad_freqs");
            check_no_overlap(g, attn, "attention", "rope grad_freqs", "attn");
            check_no_overlap(g, grad_out, "attention", "rope grad_freqs", "grad_out");
            for (int i = 0; i < 3; ++i) check_no_overlap(g, *outs[i], "attention", "rope grad_freqs", names[i]);
            for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
                for (const auto& t : slot->grad_tables) check_no_overlap(g, t, "attention", "rope grad_freqs", "a grad_tables entry");
        }
    }
}

/// @brief The host bucket ids of an attached term on the inputs' grid (null without a term).
template <class Slot, class In>
std::shared_ptr<const bucket_ids> ids_of(const Slot& slot, const In& in, id_storage storage = id_storage::automatic) {
    return slot.term ? slot.term->bucket_ids(in.depth, in.height, in.width, storage) : nullptr;
}

}  // namespace detail
}  // namespace rpe
