/// @file backend/cpu/attention_bf16.hpp
/// @brief The fused attention forward and backward on rpe::bf16 storage (not API:
/// rpe::cpu::attention_forward / attention_backward with S = rpe::bf16 call them). Included at the
/// end of backend/cpu/attention.hpp.
///
/// Two paths, the same results up to float rounding (docs/attention.md, "bf16"):
/// - AVX512_BF16 (hw_bf16, bf16_kernels.hpp), without RoPE: q·kᵀ and P·v on vdpbf16ps from k and
///   v packed once per call, float accumulation; the probabilities are rounded to bf16 for P·v
///   (as flash attention does on GPUs); the iRPE terms, masks and softmax are the float kernels
///   on float copies of the tables (converted once per call) and of the query block (contextual
///   key terms) or the keys (contextual query terms); the value term from the float
///   probabilities.
/// - portable (no AVX512_BF16 in this unit or the CPU, RoPE, key_lengths, packed sequences, or the
///   test hook bf16_portable_only): q, k, v,
///   tables, attn_mask and RoPE frequencies converted to float once per call (contiguous copies,
///   3·B·H·L·D floats), the float forward, outputs rounded to bf16 once.
/// The backward (fused_backward_bf16) has the portable path only: the inputs, grad_out and
/// saved_attn converted to float once, the float backward, each gradient rounded to bf16 once.
#pragma once

#include <cstdint>
#include <vector>

#include "../../bf16.hpp"
#include "attention.hpp"  // the float kernels (attention.hpp includes this file at its end)
#include "bf16_kernels.hpp"

namespace rpe::detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

// Float copies of a bf16 call's inputs, and attention_inputs<float> over them (terms and masks
// shared): tables, attn_mask and RoPE frequencies always; q, k, v (contiguous (B, H, L, D)) when
// `qkv`, else views of q's shape with no data (the AVX512_BF16 path reads the bf16 ones).
struct bf16_float_inputs {
    std::vector<std::vector<float>> tables;
    std::vector<float> q, k, v, attn_mask, freqs;
    attention_inputs<float> in;
};

inline std::vector<float> bf16_contiguous_to_float(const tensor_ref<const bf16>& t) {
    std::vector<float> out(static_cast<std::size_t>(t.size()));
    cpu::bf16_to_float(t.data, out.data(), t.size());
    return out;
}

// (B, H, L, D) bf16 rows (maybe strided) to a contiguous float (B, H, L, D).
inline std::vector<float> bf16_rows_to_float(const tensor_ref<const bf16>& t) {
    const std::int64_t b = t.extent(0), h = t.extent(1), n = t.extent(2), d = t.extent(3);
    std::vector<float> out(static_cast<std::size_t>(b * h * n * d));
    for (std::int64_t p = 0; p < b * h; ++p)
        for (std::int64_t i = 0; i < n; ++i)
            cpu::bf16_to_float(t.data + (p / h) * t.stride(0) + (p % h) * t.stride(1) + i * t.stride(2),
                               out.data() + (p * n + i) * d, d);
    return out;
}

// make_float_inputs copies the inputs field by field: these mirrors of the fields it knows fail to
// compile when attention_inputs or rotary_embedding gains one (forward the new field there, and
// in the AVX512_BF16 path, or refuse it for bf16).
struct bf16_known_rope_fields {
    rope_form form;
    int skip;
    tensor_ref<const bf16> freqs;
    tensor_ref<bf16> grad_freqs;
    rope::layout layout;
    tensor_ref<const float> positions, key_positions;
    int suffix;
};
static_assert(sizeof(bf16_known_rope_fields) == sizeof(rotary_embedding<bf16>),
              "rpe::rotary_embedding gained a field: forward it in detail::make_float_inputs (attention_bf16.hpp)");
struct bf16_known_input_fields {
    tensor_ref<const bf16> q, k, v;
    int height, width;
    attention_term<bf16> rpe_q, rpe_k, rpe_v;
    tensor_ref<const bf16> attn_mask;
    tensor_ref<const std::uint8_t> key_padding_mask;
    int depth;
    rotary_embedding<bf16> rope;
    tensor_ref<const std::int32_t> positions, key_positions;
    packed_sequences packed;
    tensor_ref<const std::int32_t> key_lengths;
};
static_assert(sizeof(bf16_known_input_fields) == sizeof(attention_inputs<bf16>),
              "rpe::attention_inputs gained a field: forward it in detail::make_float_inputs and handle it in "
              "fused_forward_bf16_hw (attention_bf16.hpp)");

inline void make_float_inputs(const attention_inputs<bf16>& in, bool qkv, bf16_float_inputs& f) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), n = in.q.extent(2), d = in.q.extent(3);
    auto& fi = f.in;
    if (qkv) {
        f.q = bf16_rows_to_float(in.q);
        f.k = bf16_rows_to_float(in.k);
        f.v = bf16_rows_to_float(in.v);
    }
    fi.q = tensor_ref<const float>(qkv ? f.q.data() : nullptr, {b, h, n, d});
    fi.k = tensor_ref<const float>(qkv ? f.k.data() : nullptr, {b, h, n, d});
    fi.v = tensor_ref<const float>(qkv ? f.v.data() : nullptr, {b, h, n, d});
    fi.height = in.height;
    fi.width = in.width;
    fi.depth = in.depth;
    fi.key_padding_mask = in.key_padding_mask;
    fi.positions = in.positions;
    fi.key_positions = in.key_positions;
    fi.packed = in.packed;            // int32 lengths, grids, positions: shared, not converted
    fi.key_lengths = in.key_lengths;  // int32: shared
    std::size_t count = 0;
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) count += slot->tables.size();
    f.tables.reserve(count);  // the views below point into these vectors
    const attention_term<bf16>* from[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    attention_term<float>* to[] = {&fi.rpe_q, &fi.rpe_k, &fi.rpe_v};
    for (int s = 0; s < 3; ++s) {
        to[s]->term = from[s]->term;
        for (const auto& t : from[s]->tables) {
            f.tables.push_back(bf16_contiguous_to_float(t));
            tensor_ref<const float> v;
            v.data = f.tables.back().data();
            v.rank = t.rank;
            v.shape = t.shape;
            to[s]->tables.push_back(v);
        }
    }
    if (in.attn_mask.data) {
        f.attn_mask = bf16_contiguous_to_float(in.attn_mask);
        fi.attn_mask = tensor_ref<const float>(f.attn_mask.data(), {n, n});
    }
    if (in.rope.enabled()) {
        fi.rope.form = in.rope.form;
        fi.rope.skip = in.rope.skip;
        fi.rope.layout = in.rope.layout;
        fi.rope.positions = in.rope.positions;
        fi.rope.key_positions = in.rope.key_positions;
        fi.rope.suffix = in.rope.suffix;
        if (in.rope.freqs.data) {
            f.freqs = bf16_contiguous_to_float(in.rope.freqs);
            fi.rope.freqs.data = f.freqs.data();
            fi.rope.freqs.rank = in.rope.freqs.rank;
            fi.rope.freqs.shape = in.rope.freqs.shape;
        }
    }
}

// The portable path: everything converted to float, the float forward, outputs rounded once.
template <class Id>
void fused_forward_bf16_portable(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids,
                                 tensor_ref<bf16> out, tensor_ref<bf16> attn, const attention_options& opt) {
    bf16_float_inputs f;
    make_float_inputs(in, true, f);
    std::vector<float> fo(static_cast<std::size_t>(out.size())), fa(attn.data ? static_cast<std::size_t>(attn.size()) : 0);
    tensor_ref<float> fov(fo.data(), {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)});
    tensor_ref<float> fav;
    if (attn.data) fav = tensor_ref<float>(fa.data(), {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(2)});
    fused_forward<float, Id>(f.in, ids, fov, fav, opt);
    cpu::float_to_bf16(fo.data(), out.data, out.size());
    if (attn.data) cpu::float_to_bf16(fa.data(), attn.data, attn.size());
}

// Packed sequences (attention_inputs::packed) on the portable path: everything converted to
// float, packed_forward (every image alone on its rows), the output rounded once.
inline void packed_forward_bf16(const attention_inputs<bf16>& in, tensor_ref<bf16> out, const attention_options& opt) {
    bf16_float_inputs f;
    make_float_inputs(in, true, f);
    std::vector<float> fo(static_cast<std::size_t>(out.size()));
    packed_forward<float>(f.in, tensor_ref<float>(fo.data(), {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)}),
                          opt);
    cpu::float_to_bf16(fo.data(), out.data, out.size());
}

// The bf16 backward (rpe::cpu::attention_backward with S = rpe::bf16), on a checked call: q, k, v,
// tables, attn_mask, RoPE frequencies (make_float_inputs), grad_out and saved_attn converted to
// float once (contiguous copies), the float backward (fused_backward, or packed_backward with
// in.packed) into float gradients, each gradient rounded to bf16 once: grad_q, grad_k, grad_v, the
// requested grad_tables and rope grad_freqs. Every gradient, the table gradients included, is
// summed in float by the float backward (its fixed order: thread-count independent) and rounded
// only when written. Nothing is written before the float backward has returned, so a call that
// throws (a bad grid, positions) leaves the outputs untouched.
inline void fused_backward_bf16(const attention_inputs<bf16>& in, const attention_gradients<bf16>& g,
                                const attention_options& opt) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), n = in.q.extent(2), d = in.q.extent(3);
    bf16_float_inputs f;
    make_float_inputs(in, true, f);
    // float buffers of the requested table gradients, wired into the float inputs' slots
    const attention_term<bf16>* from[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    attention_term<float>* to[] = {&f.in.rpe_q, &f.in.rpe_k, &f.in.rpe_v};
    std::size_t wanted = 0;
    for (const auto* slot : from)
        for (const auto& t : slot->grad_tables) wanted += t.data ? 1 : 0;
    std::vector<std::vector<float>> grad_tables;
    grad_tables.reserve(wanted);  // the views below point into these vectors
    std::vector<std::pair<const float*, tensor_ref<bf16>>> table_outs;
    for (int s = 0; s < 3; ++s) {
        to[s]->grad_tables.assign(from[s]->grad_tables.size(), tensor_ref<float>{});
        for (std::size_t t = 0; t < from[s]->grad_tables.size(); ++t) {
            const auto& gt = from[s]->grad_tables[t];
            if (!gt.data) continue;  // not wanted
            grad_tables.emplace_back(static_cast<std::size_t>(gt.size()));
            tensor_ref<float> v;
            v.data = grad_tables.back().data();
            v.rank = gt.rank;
            v.shape = gt.shape;
            to[s]->grad_tables[t] = v;
            table_outs.emplace_back(v.data, gt);
        }
    }
    std::vector<float> grad_freqs;
    if (in.rope.grad_freqs.data) {
        grad_freqs.resize(static_cast<std::size_t>(in.rope.grad_freqs.size()));
        f.in.rope.grad_freqs.data = grad_freqs.data();
        f.in.rope.grad_freqs.rank = in.rope.grad_freqs.rank;
        f.in.rope.grad_freqs.shape = in.rope.grad_freqs.shape;
    }
    const std::vector<float> go = bf16_contiguous_to_float(g.grad_out);
    const std::vector<float> saved = g.saved_attn.data ? bf16_contiguous_to_float(g.saved_attn) : std::vector<float>{};
    const std::size_t elems = static_cast<std::size_t>(b * h * n * d);
    std::vector<float> gq(elems), gk(elems), gv(elems);
    const attention_gradients<float> fg{
        .grad_out = tensor_ref<const float>(go.data(), {b, h, n, d}),
        .grad_q = tensor_ref<float>(gq.data(), {b, h, n, d}),
        .grad_k = tensor_ref<float>(gk.data(), {b, h, n, d}),
        .grad_v = tensor_ref<float>(gv.data(), {b, h, n, d}),
        .saved_attn = g.saved_attn.data ? tensor_ref<const float>(saved.data(), {b, h, n, n}) : tensor_ref<const float>{}};
    if (in.packed.enabled()) {
        packed_backward<float>(f.in, fg, opt);
    } else {
        dispatch_ids(f.in, opt.storage, [&]<class Id>(const std::shared_ptr<const bucket_ids>* ids) {
            fused_backward<float, Id>(f.in, ids, fg.saved_attn, fg.grad_out, fg.grad_q, fg.grad_k, fg.grad_v, opt);
        });
    }
    // every gradient rounded to bf16 once
    cpu::float_to_bf16(gq.data(), g.grad_q.data, g.grad_q.size());
    cpu::float_to_bf16(gk.data(), g.grad_k.data, g.grad_k.size());
    cpu::float_to_bf16(gv.data(), g.grad_v.data, g.grad_v.size());
    for (const auto& [src, dst] : table_outs) cpu::float_to_bf16(src, dst.data, dst.size());
    if (in.rope.grad_freqs.data) cpu::float_to_bf16(grad_freqs.data(), in.rope.grad_freqs.data, in.rope.grad_freqs.size());
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The AVX512_BF16 path (see the file comment); no RoPE, no key_lengths (every plane's L keys).
template <class Id>
void fused_forward_bf16_hw(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<bf16> out,
                           tensor_ref<bf16> attn, const attention_options& opt) {
    using cpu::cmap;
    using cpu::map;
    bf16_float_inputs f;
    make_float_inputs(in, false, f);
    auto plan = make_plan<float, Id>(f.in, ids, false, opt);
    const std::int64_t n = plan.l, d = plan.d, k = plan.k, rb_max = plan.rb, planes = plan.b * plan.h;
    const std::int64_t blocks = (n + rb_max - 1) / rb_max, items = planes * blocks;
    const bool ctx_q = has_contextual_query(plan);
    const bool ctx_k = std::any_of(plan.on_k.begin(), plan.on_k.end(), [](const auto& t) { return !t.bias; });
    const std::int64_t tq_per_plane = ctx_q ? static_cast<std::int64_t>(plan.on_q.size()) * n * k : 0;
    const std::int64_t kp_size = cpu::bf16_pack_size(d, n), vp_size = cpu::bf16_pack_size(n, d);
    const cpu::plane_rows<bf16> qb(in.q), kb(in.k), vb(in.v);
    cpu::workspace ws;
    cpu::shared_scratch<float> tq_s(ws, planes * tq_per_plane);
    cpu::thread_scratch<float> ks_s(ws, ctx_q ? n * d : 0);
    cpu::shared_scratch<float> kf_s(ws, ctx_q ? planes * n * d : 0);  // float keys for the contextual query products
    cpu::shared_scratch<bf16> kp_s(ws, planes * kp_size), vp_s(ws, planes * vp_size);
    cpu::thread_scratch<float> lg_s(ws, rb_max * n), work_s(ws, 2 * rb_max * std::max<std::int64_t>(k, 1));
    cpu::thread_scratch<float> qs_s(ws, ctx_k ? rb_max * d : 0), o_s(ws, rb_max * d);
    cpu::thread_scratch<bf16> pb_s(ws, rb_max * n);
    cpu::thread_scratch<Id> ids_s(ws, plan.tables * rb_max * n);
    cpu::thread_scratch<const Id*> blk_s(ws, plan.tables);
    const auto full_ids = declare_full_ids(plan, ws);
    ws.allocate();
    materialise_ids(plan, full_ids);
    bf16* const kp = kp_s.data();
    bf16* const vp = vp_s.data();
    float* const kf = kf_s.data();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        cpu::bf16_pack_transposed(kb.plane(p), kb.sl, d, n, kp + p * kp_size);
        cpu::bf16_pack_rows(vb.plane(p), vb.sl, n, d, vp + p * vp_size);
        if (ctx_q)
            for (std::int64_t i = 0; i < n; ++i) cpu::bf16_to_float(kb.plane(p) + i * kb.sl, kf + (p * n + i) * d, d);
    }
    if (ctx_q) {
        plan.kv = cpu::plane_rows<float>(kf, plan.h, n, d);
        all_query_products(plan, ks_s, tq_s.data());
    }
    const float* tq = tq_s.data();
    const float scale = plan.scale;
#if defined(_OPENMP)
#pragma omp parallel
#endif
    {
        float *lg = lg_s.mine(), *work = work_s.mine(), *qs = qs_s.mine(), *o = o_s.mine();
        bf16* pb = pb_s.mine();
        Id* idbuf = ids_s.mine();
        const Id** blk = blk_s.mine();
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (std::int64_t item = 0; item < items; ++item) {
            const std::int64_t p = item / blocks, i0 = (item % blocks) * rb_max, h = p % plan.h;
            const std::int64_t rb = std::min(rb_max, n - i0);
            load_block_ids(plan, i0, rb, idbuf, blk);
            const bf16* qrows = qb.plane(p) + i0 * qb.sl;
            // logits: s·(q·kᵀ), float accumulation
            cpu::bf16_gemm(rb, n, d, qrows, qb.sl, kp + p * kp_size, lg, n, scale, false);
            if (ctx_k)  // the scaled float queries of the block, for the contextual key terms' products
                for (std::int64_t i = 0; i < rb; ++i) {
                    cpu::bf16_to_float(qrows + i * qb.sl, qs + i * d, d);
                    for (std::int64_t e = 0; e < d; ++e) qs[i * d + e] *= scale;
                }
            block_probabilities(plan, f.in, p, i0, rb, qs, tq + p * tq_per_plane, blk, lg, work, true);
            // out = P·v (P rounded to bf16) + the value terms (from the float P)
            cpu::float_to_bf16(lg, pb, rb * n);
            cpu::bf16_gemm(rb, d, n, pb, n, vp + p * vp_size, o, d, 1.0f, false);
            auto om = map<float>(o, rb, d);
            for (const auto& t : plan.on_v) {
                cpu::scatter_rows(lg, blk[t.slot], rb, n, t.k, work);
                om.noalias() += cmap<float>(work, rb, t.k) * cmap<float>(t.table + t.head(h) * t.k * d, t.k, d);
            }
            cpu::float_to_bf16(o, out.data + (p * n + i0) * d, rb * d);
            if (attn.data) cpu::float_to_bf16(lg, attn.data + (p * n + i0) * n, rb * n);
        }
    }
}
#endif

// The bf16 forward: the AVX512_BF16 path where this unit is built for it and the CPU reports it
// (and no RoPE, no key_lengths, no test hook), the portable path otherwise (packed sequences:
// packed_forward_bf16, always portable).
template <class Id>
void fused_forward_bf16(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<bf16> out,
                        tensor_ref<bf16> attn, const attention_options& opt) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (!in.rope.enabled() && is_empty_view(in.key_lengths) && !cpu::bf16_portable_only.load(std::memory_order_relaxed) &&
        cpu::cpu_has_avx512_bf16()) {
        fused_forward_bf16_hw<Id>(in, ids, out, attn, opt);
        return;
    }
#endif
    fused_forward_bf16_portable<Id>(in, ids, out, attn, opt);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail
