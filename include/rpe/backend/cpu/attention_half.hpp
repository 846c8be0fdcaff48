/// @file backend/cpu/attention_half.hpp
/// @brief The fused attention forward and backward on 16-bit storage, rpe::bf16 and rpe::f16, in
/// float (not API: attention_bf16.hpp's portable path and attention_f16.hpp call it). Included at
/// the end of backend/cpu/attention.hpp; includes the two per-type files at its own end.
///
/// fp32 compute: q, k, v, the tables, attn_mask and the RoPE frequencies converted to float once
/// per call (contiguous copies, exact; the forward converts q, k, v per chunk of batch elements,
/// see cpu::half_forward_chunk_bytes), the float forward or backward (fused_forward /
/// fused_backward / packed_forward / packed_backward<float>: the float kernels themselves, every
/// sum in float), and each output rounded to the storage type once (to nearest even). So a 16-bit
/// result is bit for bit the rounding of the float path's result on the same (16-bit-valued)
/// inputs. Written once for any 16-bit storage type H with exact float conversions (the
/// `to_float` / `from_float` overloads below: bf16_kernels.hpp's and f16_kernels.hpp's).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "../../bf16.hpp"
#include "../../f16.hpp"
#include "attention.hpp"  // the float kernels (attention.hpp includes this file at its end)
#include "bf16_kernels.hpp"
#include "f16_kernels.hpp"

namespace rpe::detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

namespace half_glue {

// n values of 16-bit storage to float (exact) and back (rounded once, to nearest even), one
// overload pair per type: bf16_kernels.hpp's and f16_kernels.hpp's array conversions (vector code
// where the unit has it, the scalar rounding's bits on every path).
inline void to_float(const bf16* src, float* dst, std::int64_t n) { cpu::bf16_to_float(src, dst, n); }
inline void from_float(const float* src, bf16* dst, std::int64_t n) { cpu::float_to_bf16(src, dst, n); }
inline void to_float(const f16* src, float* dst, std::int64_t n) { cpu::f16_to_float(src, dst, n); }
inline void from_float(const float* src, f16* dst, std::int64_t n) { cpu::float_to_f16(src, dst, n); }

template <class H>
std::vector<float> contiguous_to_float(const tensor_ref<const H>& t) {
    std::vector<float> out(static_cast<std::size_t>(t.size()));
    to_float(t.data, out.data(), t.size());
    return out;
}

// (B, H, L, D) rows (maybe strided) to a contiguous float (B, H, L, D).
template <class H>
std::vector<float> rows_to_float(const tensor_ref<const H>& t) {
    const std::int64_t b = t.extent(0), h = t.extent(1), n = t.extent(2), d = t.extent(3);
    std::vector<float> out(static_cast<std::size_t>(b * h * n * d));
    for (std::int64_t p = 0; p < b * h; ++p)
        for (std::int64_t i = 0; i < n; ++i)
            to_float(t.data + (p / h) * t.stride(0) + (p % h) * t.stride(1) + i * t.stride(2), out.data() + (p * n + i) * d, d);
    return out;
}

template <class From, class To>
void set_view(To& to, float* data, const From& from) {  // a float view of `from`'s shape over `data`
    to.data = data;
    to.rank = from.rank;
    to.shape = from.shape;
}

// float_inputs copies the inputs field by field: this mirror of the fields it knows fails to
// compile when attention_inputs gains one (forward the new field there, and in bf16's AVX512_BF16
// path, or refuse it for 16-bit storage). rotary_embedding's fields are mirrored by
// cpu::rope_known_fields (rope.hpp), whose assertion names this file too.
template <class H>
struct known_input_fields {
    tensor_ref<const H> q, k, v;
    int height, width;
    attention_term<H> rpe_q, rpe_k, rpe_v;
    tensor_ref<const H> attn_mask;
    tensor_ref<const std::uint8_t> key_padding_mask;
    int depth;
    rotary_embedding<H> rope;
    tensor_ref<const std::int32_t> positions, key_positions;
    packed_sequences packed;
    tensor_ref<const std::int32_t> key_lengths;
};
static_assert(sizeof(known_input_fields<bf16>) == sizeof(attention_inputs<bf16>) &&
                  sizeof(known_input_fields<f16>) == sizeof(attention_inputs<f16>),
              "rpe::attention_inputs gained a field: forward it in detail::half_glue::float_inputs (attention_half.hpp) and "
              "handle it in fused_forward_bf16_hw (attention_bf16.hpp)");

// Float copies of a 16-bit call's inputs and attention_inputs<float> over them (terms, masks,
// positions, packing shared): the tables, attn_mask and the RoPE frequencies, and q, k, v of the
// batch elements that load_batch names (contiguous (nb, H, L, D)).
template <class H>
struct float_inputs {
    std::vector<std::vector<float>> tables;
    std::vector<float> q, k, v, attn_mask, freqs;
    attention_inputs<float> in;

    // Everything but q, k, v (load_batch converts those); the per-batch views (key_padding_mask,
    // key_lengths) over every batch element.
    explicit float_inputs(const attention_inputs<H>& from) {
        const std::int64_t n = from.q.extent(2);
        in.height = from.height;
        in.width = from.width;
        in.depth = from.depth;
        in.key_padding_mask = from.key_padding_mask;
        in.positions = from.positions;
        in.key_positions = from.key_positions;
        in.packed = from.packed;            // int32 lengths, grids, positions: shared
        in.key_lengths = from.key_lengths;  // int32: shared
        std::size_t count = 0;
        for (const auto* slot : {&from.rpe_q, &from.rpe_k, &from.rpe_v}) count += slot->tables.size();
        tables.reserve(count);  // the views below point into these vectors
        const attention_term<H>* src[] = {&from.rpe_q, &from.rpe_k, &from.rpe_v};
        attention_term<float>* dst[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int s = 0; s < 3; ++s) {
            dst[s]->term = src[s]->term;
            for (const auto& t : src[s]->tables) {
                tables.push_back(contiguous_to_float(t));
                tensor_ref<const float> view;
                set_view(view, tables.back().data(), t);
                dst[s]->tables.push_back(view);
            }
        }
        if (from.attn_mask.data) {
            attn_mask = contiguous_to_float(from.attn_mask);
            in.attn_mask = tensor_ref<const float>(attn_mask.data(), {n, from.k.extent(2)});
        }
        if (from.rope.enabled()) {
            in.rope.form = from.rope.form;
            in.rope.skip = from.rope.skip;
            in.rope.layout = from.rope.layout;
            in.rope.positions = from.rope.positions;
            in.rope.key_positions = from.rope.key_positions;
            in.rope.suffix = from.rope.suffix;
            in.rope.query_suffix = from.rope.query_suffix;
            if (from.rope.freqs.data) {
                freqs = contiguous_to_float(from.rope.freqs);
                set_view(in.rope.freqs, freqs.data(), from.rope.freqs);
            }
        }
    }
    // q, k, v of batch elements [b0, b0 + nb) as float (contiguous (nb, H, L, D)), and the per-batch
    // views of `in` cut to them: `in` is then the call restricted to those batch elements.
    void load_batch(const attention_inputs<H>& from, std::int64_t b0, std::int64_t nb) {
        const std::int64_t h = from.q.extent(1), n = from.q.extent(2), d = from.q.extent(3), nk = from.k.extent(2);
        const auto cut = [&](auto t) {  // batch elements [b0, b0 + nb) of a view whose first extent is B
            if (!t.data) return t;
            t.data += b0 * t.stride(0);
            t.shape[0] = nb;
            return t;
        };
        q = rows_to_float(cut(from.q));
        k = rows_to_float(cut(from.k));
        v = rows_to_float(cut(from.v));
        in.q = tensor_ref<const float>(q.data(), {nb, h, n, d});
        in.k = tensor_ref<const float>(k.data(), {nb, h, nk, d});
        in.v = tensor_ref<const float>(v.data(), {nb, h, nk, d});
        in.key_padding_mask = cut(from.key_padding_mask);
        in.key_lengths = cut(from.key_lengths);
    }
    float_inputs(const float_inputs&) = delete;  // `in` points into the vectors
    float_inputs& operator=(const float_inputs&) = delete;
};

}  // namespace half_glue
}  // namespace RPE_ISA_NS
}  // namespace rpe::detail

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {
/// @brief The most bytes of float copies (q, k, v, out and, when requested, attn) that the 16-bit
/// forward (rpe::f16, and rpe::bf16's portable path) holds at once (not API; a tuning and test
/// hook): it converts and runs the batch elements in chunks that fit (at least one element per
/// chunk). The results do not depend on it: every (batch, head) plane is computed alone by the
/// float forward.
inline std::atomic<std::int64_t> half_forward_chunk_bytes{std::int64_t{64} << 20};
}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu

namespace rpe::detail {
inline namespace RPE_ISA_NS {
namespace half_glue {

// The forward: the float forward on float copies, out and attn rounded once, over chunks of batch
// elements whose float copies fit cpu::half_forward_chunk_bytes (the tables, attn_mask and RoPE
// frequencies converted once for all chunks).
template <class H, class Id>
void forward(const attention_inputs<H>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<H> out, tensor_ref<H> attn,
             const attention_options& opt) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), n = in.q.extent(2), d = in.q.extent(3), nk = in.k.extent(2);
    const std::int64_t per_element = static_cast<std::int64_t>(sizeof(float)) * h *
                                     (2 * n * d + 2 * nk * d + (attn.data ? n * nk : 0));  // q, out, k, v (, attn)
    const std::int64_t budget = cpu::half_forward_chunk_bytes.load(std::memory_order_relaxed);
    const std::int64_t chunk =
        std::clamp<std::int64_t>(per_element > 0 ? budget / per_element : b, 1, std::max<std::int64_t>(b, 1));
    float_inputs<H> f(in);
    std::vector<float> fo, fa;
    for (std::int64_t b0 = 0; b0 < b; b0 += chunk) {
        const std::int64_t nb = std::min(chunk, b - b0);
        f.load_batch(in, b0, nb);
        fo.resize(static_cast<std::size_t>(nb * h * n * d));
        fa.resize(attn.data ? static_cast<std::size_t>(nb * h * n * nk) : 0);
        const tensor_ref<float> fav = attn.data ? tensor_ref<float>(fa.data(), {nb, h, n, nk}) : tensor_ref<float>{};
        fused_forward<float, Id>(f.in, ids, tensor_ref<float>(fo.data(), {nb, h, n, d}), fav, opt);
        // the rows computed only (attention_options::query_rows; every row by default): the others are not written
        const std::int64_t r0 = opt.query_rows.begin, rows = opt.query_rows.end_of(n) - r0;
        for (std::int64_t p = 0; p < nb * h; ++p) {
            from_float(fo.data() + (p * n + r0) * d, out.data + ((b0 * h + p) * n + r0) * d, rows * d);
            if (attn.data) from_float(fa.data() + (p * n + r0) * nk, attn.data + ((b0 * h + p) * n + r0) * nk, rows * nk);
        }
    }
}

// Packed sequences (attention_inputs::packed): packed_forward<float> on float copies, out rounded once.
template <class H>
void packed_forward(const attention_inputs<H>& in, tensor_ref<H> out, const attention_options& opt) {
    float_inputs<H> f(in);
    f.load_batch(in, 0, in.q.extent(0));
    std::vector<float> fo(static_cast<std::size_t>(out.size()));
    detail::packed_forward<float>(
        f.in, tensor_ref<float>(fo.data(), {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)}), opt);
    from_float(fo.data(), out.data, out.size());
}

// The backward on a checked call: the inputs (float_inputs), grad_out and saved_attn converted to
// float once, the float backward (fused_backward, or packed_backward with in.packed) into float
// gradients, each gradient rounded once: grad_q, grad_k, grad_v, the requested grad_tables and
// rope grad_freqs. Every sum, the table gradients' included, is the float backward's (its fixed
// order: thread-count independent). Nothing is written before the float backward has returned.
template <class H>
void backward(const attention_inputs<H>& in, const attention_gradients<H>& g, const attention_options& opt) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), n = in.q.extent(2), d = in.q.extent(3), nk = in.k.extent(2);
    float_inputs<H> f(in);
    f.load_batch(in, 0, b);
    const attention_term<H>* from[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    attention_term<float>* to[] = {&f.in.rpe_q, &f.in.rpe_k, &f.in.rpe_v};
    std::size_t wanted = 0;
    for (const auto* slot : from)
        for (const auto& t : slot->grad_tables) wanted += t.data ? 1 : 0;
    std::vector<std::vector<float>> grad_tables;
    grad_tables.reserve(wanted);  // the views below point into these vectors
    std::vector<std::pair<const float*, tensor_ref<H>>> table_outs;
    for (int s = 0; s < 3; ++s) {
        to[s]->grad_tables.assign(from[s]->grad_tables.size(), tensor_ref<float>{});
        for (std::size_t t = 0; t < from[s]->grad_tables.size(); ++t) {
            const auto& gt = from[s]->grad_tables[t];
            if (!gt.data) continue;  // not wanted
            grad_tables.emplace_back(static_cast<std::size_t>(gt.size()));
            set_view(to[s]->grad_tables[t], grad_tables.back().data(), gt);
            table_outs.emplace_back(grad_tables.back().data(), gt);
        }
    }
    std::vector<float> grad_freqs;
    if (in.rope.grad_freqs.data) {
        grad_freqs.resize(static_cast<std::size_t>(in.rope.grad_freqs.size()));
        set_view(f.in.rope.grad_freqs, grad_freqs.data(), in.rope.grad_freqs);
    }
    const std::vector<float> go = contiguous_to_float(g.grad_out);
    const std::vector<float> saved = g.saved_attn.data ? contiguous_to_float(g.saved_attn) : std::vector<float>{};
    const std::size_t elems = static_cast<std::size_t>(b * h * n * d), key_elems = static_cast<std::size_t>(b * h * nk * d);
    std::vector<float> gq(elems), gk(key_elems), gv(key_elems);
    const attention_gradients<float> fg{
        .grad_out = tensor_ref<const float>(go.data(), {b, h, n, d}),
        .grad_q = tensor_ref<float>(gq.data(), {b, h, n, d}),
        .grad_k = tensor_ref<float>(gk.data(), {b, h, nk, d}),
        .grad_v = tensor_ref<float>(gv.data(), {b, h, nk, d}),
        .saved_attn = g.saved_attn.data ? tensor_ref<const float>(saved.data(), {b, h, n, nk}) : tensor_ref<const float>{}};
    if (in.packed.enabled()) {
        packed_backward<float>(f.in, fg, opt);
    } else {
        dispatch_ids(f.in, opt.storage, [&]<class Id>(const std::shared_ptr<const bucket_ids>* ids) {
            fused_backward<float, Id>(f.in, ids, fg.saved_attn, fg.grad_out, fg.grad_q, fg.grad_k, fg.grad_v, opt);
        });
    }
    from_float(gq.data(), g.grad_q.data, g.grad_q.size());
    from_float(gk.data(), g.grad_k.data, g.grad_k.size());
    from_float(gv.data(), g.grad_v.data, g.grad_v.size());
    for (const auto& [src, dst] : table_outs) from_float(src, dst.data, dst.size());
    if (in.rope.grad_freqs.data) from_float(grad_freqs.data(), in.rope.grad_freqs.data, in.rope.grad_freqs.size());
}

}  // namespace half_glue
}  // namespace RPE_ISA_NS
}  // namespace rpe::detail

// The per-type entry points over this glue. Included here rather than by attention.hpp: each of
// them needs this file's definitions, whichever of the four headers a unit includes first.
#include "attention_bf16.hpp"  // detail::fused_forward_bf16 (and its AVX512_BF16 path), packed_forward_bf16, fused_backward_bf16
#include "attention_f16.hpp"   // detail::fused_forward_f16, packed_forward_f16, fused_backward_f16
