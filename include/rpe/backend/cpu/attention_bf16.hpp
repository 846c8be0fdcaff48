/// @file backend/cpu/attention_bf16.hpp
/// @brief The fused attention forward and backward on rpe::bf16 storage (not API:
/// rpe::cpu::attention_forward / attention_backward with S = rpe::bf16 call them). Included at the
/// end of backend/cpu/attention_half.hpp.
///
/// Two paths, the same results up to float rounding (docs/attention.md, "bf16"):
/// - AVX512_BF16 (hw_bf16, bf16_kernels.hpp), without RoPE: per plane k packed once (kᵀ in pairs,
///   with the bf16 contextual key tables' columns after the L keys) and v; one vdpbf16ps product
///   per block of rows gives the scaled logits and the contextual key products; the contextual
///   query products s·(k·table_q) on vdpbf16ps per plane (the bf16 tables packed once per call),
///   looked up per block by key and added transposed; bias gathers from float copies of the
///   tables (converted once per call); the softmax per row in float, its exponentials rounded to
///   bf16 for P·v (as flash attention does on GPUs) and the product scaled by 1/Σe; the value
///   terms from the float probabilities. In an amx_bf16 unit (isa.hpp) where cpu::amx_granted()
///   (and not the test hook cpu::bf16_amx_off), those three products run on AMX tiles
///   (cpu::bf16_gemm_amx, the same packed operands: pairs padded to 32 with zeros, the bf16
///   exponentials' rows padded to 32 columns); each OpenMP thread loads its tile configuration
///   at the start of its parallel region and releases the tiles at the end (bf16_hw::gemm_tiles).
///   A future bf16 backward could put its four products (dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K,
///   dK = dSᵀ·Q) on the same kernel; today the backward is the float one.
/// - portable (no AVX512_BF16 in this unit or the CPU, RoPE, key_lengths, packed sequences, or the
///   test hook bf16_portable_only): the 16-bit glue of attention_half.hpp, shared with rpe::f16:
///   q, k, v, tables, attn_mask and RoPE frequencies converted to float once per call (contiguous
///   copies; q, k, v per chunk of batch elements whose float copies fit
///   cpu::half_forward_chunk_bytes), the float forward, outputs rounded to bf16 once.
/// The backward (fused_backward_bf16) has the portable path only: the inputs, grad_out and
/// saved_attn converted to float once, the float backward, each gradient rounded to bf16 once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "../../bf16.hpp"
#include "attention_half.hpp"  // half_glue and the float kernels (attention_half.hpp includes this file at its end)
#include "bf16_kernels.hpp"

namespace rpe::detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

// The portable path: half_glue::forward (float copies per chunk of batch elements, the float
// forward, outputs rounded to bf16 once).
template <class Id>
void fused_forward_bf16_portable(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids,
                                 tensor_ref<bf16> out, tensor_ref<bf16> attn, const attention_options& opt) {
    half_glue::forward<bf16, Id>(in, ids, out, attn, opt);
}

// Packed sequences (attention_inputs::packed) on the portable path: everything converted to
// float, packed_forward (every image alone on its rows), the output rounded once.
inline void packed_forward_bf16(const attention_inputs<bf16>& in, tensor_ref<bf16> out, const attention_options& opt) {
    half_glue::packed_forward<bf16>(in, out, opt);
}

// The bf16 backward (rpe::cpu::attention_backward with S = rpe::bf16), on a checked call: q, k, v,
// tables, attn_mask, RoPE frequencies (half_glue::float_inputs), grad_out and saved_attn converted
// to float once (contiguous copies), the float backward (fused_backward, or packed_backward with
// in.packed) into float gradients, each gradient rounded to bf16 once: grad_q, grad_k, grad_v, the
// requested grad_tables and rope grad_freqs. Every gradient, the table gradients included, is
// summed in float by the float backward (its fixed order: thread-count independent) and rounded
// only when written. Nothing is written before the float backward has returned, so a call that
// throws (a bad grid, positions) leaves the outputs untouched.
inline void fused_backward_bf16(const attention_inputs<bf16>& in, const attention_gradients<bf16>& g,
                                const attention_options& opt) {
    half_glue::backward<bf16>(in, g, opt);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace bf16_hw {

// B(r, j0 + j) = rows[r·sl + j] (r < kd, j < n) into a packed B of npad columns (the layout of
// cpu::bf16_pack_columns), zeroed before: v for P·v, or a contextual key table (D, K) beside the
// keys, so that one product gives the logits and the per-bucket products. Two rows at a time, 16
// columns per vector (the pair of a column is one 32-bit word).
inline void pack_rows_at(const bf16* rows, std::int64_t sl, std::int64_t kd, std::int64_t n, std::int64_t npad, std::int64_t j0,
                         bf16* bp) {
    for (std::int64_t r = 0; r < kd; r += 2) {
        const bf16* a = rows + r * sl;
        const bf16* b = r + 1 < kd ? a + sl : nullptr;  // an odd kd's last pair: a zero partner
        bf16* dst = bp + ((r / 2) * npad + j0) * 2;
        std::int64_t j = 0;
        if (b)
            for (; j + 16 <= n; j += 16) {
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j)));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j)));
                _mm512_storeu_si512(dst + 2 * j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        for (; j < n; ++j) {
            dst[2 * j] = a[j];
            if (b) dst[2 * j + 1] = b[j];
        }
    }
}

using cpu::simd::add_transposed;  // simd.hpp: shared with the float forward
using cpu::simd::lanes;
using cpu::simd::lookup_rows;
using cpu::simd::transpose16;

// Packs kᵀ from the rows of k: B(r, j) = rows[j·sl + r] (r < kd, j < n) into a packed B of npad
// columns (bf16_pack_columns), zeroed first; 16 keys × 16 pairs at a time (a pair is one 32-bit
// word: a 16 × 16 transpose).
inline void pack_transposed_at(const bf16* rows, std::int64_t sl, std::int64_t kd, std::int64_t n, std::int64_t npad,
                               std::int64_t size, bf16* bp) {
    std::memset(static_cast<void*>(bp), 0, static_cast<std::size_t>(size) * sizeof(bf16));
    const std::int64_t pairs = kd / 2;
    __m512 r[16];
    for (std::int64_t j0 = 0; j0 < n; j0 += 16) {
        const std::int64_t jr = std::min<std::int64_t>(16, n - j0);
        for (std::int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const __mmask16 pm = lanes(pairs - p0);
            for (int l = 0; l < 16; ++l)
                r[l] = l < jr ? _mm512_maskz_loadu_ps(pm, rows + (j0 + l) * sl + 2 * p0) : _mm512_setzero_ps();
            transpose16(r);  // r[m][l] = pair p0 + m of key j0 + l
            for (std::int64_t m = 0; m < std::min<std::int64_t>(16, pairs - p0); ++m)
                _mm512_mask_storeu_ps(bp + ((p0 + m) * npad + j0) * 2, lanes(jr), r[m]);
        }
        if (kd & 1)
            for (std::int64_t j = j0; j < j0 + jr; ++j) bp[(pairs * npad + j) * 2] = rows[j * sl + kd - 1];
    }
}

// Elements of a bf16 row of n exponentials as softmax_row_bf16 writes them (n rounded up to 32:
// a whole number of AMX A tiles' 32 columns, zeros past n).
inline std::int64_t padded_row(std::int64_t n) { return (n + 31) / 32 * 32; }

// The softmax of one row of n float logits, keys with mask[j] != 0 excluded (mask may be null),
// as cpu::softmax_row: max-subtracted, e_j = exp(x_j − max) (0 below the smallest normal number
// and for −∞), 1/Σe. Writes the e_j rounded to bf16 (vcvtneps2bf16: to nearest even) into pe
// (padded_row(n) elements, zeros past n) and returns 1/Σe (P·v then takes Σⱼ bf16(e_j)·v_j and
// scales by it); in place of the row `keep`: nothing, the float exponentials e_j (for the value
// terms' sums, scaled with the output) or the float probabilities e_j/Σe (for attn). A NaN or +∞
// logit: the row (kept) and pe NaN, returns 1; every key masked (or −∞): zeros, returns 0.
enum class row_keep { nothing, exponentials, probabilities };
inline float softmax_row_bf16(float* row, std::int64_t n, const std::uint8_t* mask, bf16* pe, row_keep keep) {
    const bool kept = keep != row_keep::nothing;
    constexpr float inf = std::numeric_limits<float>::infinity();
    if (mask)
        for (std::int64_t j = 0; j < n; ++j)
            if (mask[j]) row[j] = -inf;
    const __m512 ninf = _mm512_set1_ps(-inf);
    const std::int64_t full = n / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
    __m512 mx = ninf, my = ninf;  // two chains of maxima: their latency, not throughput, bounds one
    __mmask16 nan = 0;
    std::int64_t j = 0;
    for (; j + 32 <= full; j += 32) {
        const __m512 x = _mm512_loadu_ps(row + j), y = _mm512_loadu_ps(row + j + 16);
        nan |= _mm512_cmp_ps_mask(x, y, _CMP_UNORD_Q);  // either lane NaN
        mx = _mm512_max_ps(mx, x);
        my = _mm512_max_ps(my, y);
    }
    if (j < full) {
        const __m512 x = _mm512_loadu_ps(row + j);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, x);
    }
    if (tail) {
        const __m512 x = _mm512_mask_loadu_ps(ninf, tail, row + full);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        my = _mm512_max_ps(my, x);
    }
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(mx, my));
    const std::int64_t np = padded_row(n);
    if (nan || m == inf) {  // NaN, as exp(∞ − ∞) would give
        if (kept) std::fill(row, row + n, std::numeric_limits<float>::quiet_NaN());
        std::fill(pe, pe + n, bf16::from_bits(0x7fc0));
        std::fill(pe + n, pe + np, bf16::from_bits(0));
        return 1.0f;
    }
    if (m == -inf) {
        if (kept) std::fill(row, row + n, 0.0f);
        std::fill(pe, pe + np, bf16::from_bits(0));
        return 0.0f;
    }
    // exp(x − max) as softmax_row: its exp (cpu::simd::exp_nonpositive, Eigen's vectorised exp's bits),
    // the smallest normal number subtracted and clamped at 0 (an exact 0 for masked keys and past n)
    const __m512 pm = _mm512_set1_ps(m), tiny = _mm512_set1_ps(std::numeric_limits<float>::min()), zero = _mm512_setzero_ps();
    __m512 acc = zero;
    for (j = 0; j < np; j += 16) {
        // past the row's tail (np is a multiple of 32): nothing read, exponentials 0
        const __mmask16 lm = j < full ? __mmask16(0xffff) : (j == full ? tail : __mmask16(0));
        const __m512 x = _mm512_mask_loadu_ps(ninf, lm, row + j);
        const __m512 e = _mm512_max_ps(_mm512_sub_ps(cpu::simd::exp_nonpositive(_mm512_sub_ps(x, pm)), tiny), zero);
        acc = _mm512_add_ps(acc, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pe + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
        if (kept) _mm512_mask_storeu_ps(row + j, lm, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(acc);
    if (keep == row_keep::probabilities) {
        const __m512 pi = _mm512_set1_ps(inv);
        for (j = 0; j < full; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), pi));
        if (tail) _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), pi));
    }
    return inv;
}

// The AMX tiles of one thread of the bf16 forward while it lives (cpu::amx_tiles: configured,
// then released), when `on`; nothing otherwise (and in units without AMX).
struct gemm_tiles {
#if defined(RPE_HAS_AMX_BF16)
    std::optional<cpu::amx_tiles> tiles;
    explicit gemm_tiles(bool on) {
        if (on) tiles.emplace();
    }
#else
    explicit gemm_tiles(bool) {}
#endif
};

}  // namespace bf16_hw

// The AVX512_BF16 path (see the file comment); no RoPE, no key_lengths, L_k = L (every plane's L keys).
// Per plane, once: kᵀ packed in pairs with the contextual key tables' (D, K) columns after the L
// keys (the plane's head), v packed, and the contextual query terms' products s·(k·table_q) on
// vdpbf16ps (or AMX: see the file comment) from the tables packed once per call. Per block of
// rows: one product gives the
// scaled logits and the contextual key products, (rb, L + ΣK) rows; the bias and contextual
// gathers, masks and softmax_row_bf16 (exponentials rounded to bf16) per row; P·v on vdpbf16ps,
// scaled by 1/Σe; the value terms from the float probabilities. Every row's result depends on
// that row only (not on the row blocks or threads).
template <class Id>
void fused_forward_bf16_hw(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<bf16> out,
                           tensor_ref<bf16> attn, const attention_options& opt) {
    using cpu::cmap;
    using cpu::map;
    // float tables (the bias gathers and the value terms) and attn_mask; q, k, v: views of their
    // shape with no data (read as bf16 below)
    half_glue::float_inputs<bf16> f(in);
    for (auto* x : {&f.in.q, &f.in.k, &f.in.v})
        *x = tensor_ref<const float>(nullptr, {in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)});
    auto plan = make_plan<float, Id>(f.in, ids, false, opt);
    const std::int64_t n = plan.l, d = plan.d, planes = plan.b * plan.h;
    const bool amx = cpu::bf16_amx_now();          // the block products on AMX tiles
    const std::int64_t dpad = (d + 31) / 32 * 32;  // d rounded up to AMX's 32
    // rows per block: at most 32, so that a block's logits and exponentials stay in L1/L2 between
    // the passes (the results do not depend on it)
    const std::int64_t rb_max = std::min<std::int64_t>(plan.rb, 32);
    plan.rb = rb_max;
    // the query rows computed: [row0, row0 + rows) (attention_options::query_rows)
    const std::int64_t row0 = opt.query_rows.begin, rows = opt.query_rows.end_of(n) - row0;
    const std::int64_t blocks = (rows + rb_max - 1) / rb_max, items = planes * blocks;
    // contextual key tables: their columns after the L keys of each plane's packed kᵀ
    std::vector<std::int64_t> kcol(plan.on_k.size(), 0);
    std::int64_t ncols = n;
    for (std::size_t t = 0; t < plan.on_k.size(); ++t)
        if (!plan.on_k[t].bias) {
            kcol[t] = ncols;
            ncols += plan.on_k[t].k;
        }
    // contextual query tables: packed per table and head, once per call
    std::vector<std::int64_t> qpack(plan.on_q.size(), -1);
    std::int64_t qpack_size = 0;
    for (std::size_t t = 0; t < plan.on_q.size(); ++t)
        if (!plan.on_q[t].bias) {
            qpack[t] = qpack_size;
            qpack_size += plan.on_q[t].table_heads * cpu::bf16_pack_size(dpad, plan.on_q[t].k);
        }
    const bool ctx_q = qpack_size > 0;
    // the float row kept: the probabilities for attn; else the exponentials for the value sums
    // (scaled with the output, as the float forward does), else nothing
    const auto keep = attn.data            ? bf16_hw::row_keep::probabilities
                      : !plan.on_v.empty() ? bf16_hw::row_keep::exponentials
                                           : bf16_hw::row_keep::nothing;
    const std::int64_t tq_per_plane = ctx_q ? static_cast<std::int64_t>(plan.on_q.size()) * n * plan.k : 0;
    // the packed B operands hold their pairs up to the inner dimension rounded up to 32 (zeros
    // past it), so that AMX reads whole tiles; vdpbf16ps reads the pairs up to d (or n) only
    const std::int64_t np = bf16_hw::padded_row(n);
    const std::int64_t npad_k = cpu::bf16_pack_columns(ncols), kp_size = cpu::bf16_pack_size(dpad, ncols);
    const std::int64_t vp_size = cpu::bf16_pack_size(np, d);
    const std::int64_t vk =
        std::max<std::int64_t>(1, std::accumulate(plan.on_v.begin(), plan.on_v.end(), std::int64_t{0},
                                                  [](std::int64_t a, const auto& t) { return std::max(a, t.k); }));
    const cpu::plane_rows<bf16> qb(in.q), kb(in.k), vb(in.v);
    cpu::workspace ws;
    cpu::shared_scratch<float> tq_s(ws, planes * tq_per_plane);
    cpu::shared_scratch<bf16> kp_s(ws, planes * kp_size), vp_s(ws, planes * vp_size), qt_s(ws, qpack_size);
    cpu::thread_scratch<float> lg_s(ws, rb_max * ncols), work_s(ws, rb_max * vk), o_s(ws, rb_max * d), inv_s(ws, rb_max);
    cpu::thread_scratch<bf16> pb_s(ws, rb_max * np);
    // contextual query terms: id(j, i) rows (key j, every query i), made once per call, and per
    // block the (L, rb) terms of its queries looked up and added transposed; where those ids would
    // take more than materialise_ids_bytes per table, per row gathers from the transposed ids
    const std::int64_t rbp = bf16_hw::padded_row(rb_max);
    const std::int64_t nq_ctx = std::count_if(plan.on_q.begin(), plan.on_q.end(), [](const auto& t) { return !t.bias; });
    const bool q_lookup = n * n * static_cast<std::int64_t>(sizeof(Id)) <= materialise_ids_bytes;
    cpu::shared_scratch<Id> qid_s(ws, q_lookup ? nq_ctx * n * n : 0);
    cpu::thread_scratch<float> g_s(ws, ctx_q && q_lookup ? n * rbp : 0), part_s(ws, 8 * vk);
    cpu::thread_scratch<Id> ids_s(ws, plan.tables * rb_max * n);
    cpu::thread_scratch<const Id*> blk_s(ws, plan.tables);
    const auto full_ids = declare_full_ids(plan, ws);
    ws.allocate();
    materialise_ids(plan, full_ids);
    bf16* const kp = kp_s.data();
    bf16* const vp = vp_s.data();
    bf16* const qt = qt_s.data();
    float* const tq = tq_s.data();
    const float scale = plan.scale;
    std::vector<const Id*> qid(plan.on_q.size(), nullptr);
    for (std::size_t t = 0, next = 0; t < plan.on_q.size(); ++t) {
        if (plan.on_q[t].bias || !q_lookup) continue;
        Id* dst = qid_s.data() + static_cast<std::int64_t>(next++) * n * n;
        cpu::key_order_ids(plan.on_q[t].rows, n, n, dst);
        qid[t] = dst;
    }
    if (ctx_q) std::memset(static_cast<void*>(qt), 0, static_cast<std::size_t>(qpack_size) * sizeof(bf16));
    for (std::size_t t = 0; t < plan.on_q.size(); ++t) {
        if (qpack[t] < 0) continue;
        const auto& ft = plan.on_q[t];
        const bf16* table = in.rpe_q.tables[t].data;
        for (std::int64_t hh = 0; hh < ft.table_heads; ++hh)
            cpu::bf16_pack_rows(table + hh * d * ft.k, ft.k, d, ft.k, qt + qpack[t] + hh * cpu::bf16_pack_size(dpad, ft.k));
    }
    // the block products: AMX tiles (each thread configures its own: gemm_tiles) or vdpbf16ps
    const auto gemm = [amx](std::int64_t m, std::int64_t nc, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* b,
                            float* c, std::int64_t ldc, float alpha) {
#if defined(RPE_HAS_AMX_BF16)
        if (amx) {
            cpu::bf16_gemm_amx(m, nc, kd, a, lda, b, c, ldc, alpha, false);
            return;
        }
#else
        static_cast<void>(amx);
#endif
        cpu::bf16_gemm(m, nc, kd, a, lda, b, c, ldc, alpha, false);
    };
#if defined(_OPENMP)
#pragma omp parallel
#endif
    {
        const bf16_hw::gemm_tiles tiles(amx && ctx_q);  // the only product of this loop: s·(k·table_q)
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (std::int64_t p = 0; p < planes; ++p) {
            const std::int64_t h = p % plan.h;
            bf16* kpp = kp + p * kp_size;
            bf16_hw::pack_transposed_at(kb.plane(p), kb.sl, d, n, npad_k, kp_size, kpp);
            for (std::size_t t = 0; t < plan.on_k.size(); ++t) {
                const auto& ft = plan.on_k[t];
                if (!ft.bias)
                    bf16_hw::pack_rows_at(in.rpe_k.tables[t].data + ft.head(h) * d * ft.k, ft.k, d, ft.k, npad_k, kcol[t], kpp);
            }
            std::memset(static_cast<void*>(vp + p * vp_size), 0, static_cast<std::size_t>(vp_size) * sizeof(bf16));
            bf16_hw::pack_rows_at(vb.plane(p), vb.sl, n, d, cpu::bf16_pack_columns(d), 0, vp + p * vp_size);
            for (std::size_t t = 0; t < plan.on_q.size(); ++t) {  // s·(k·table_q[h']) (L, K) at tq + t·L·K_max
                const auto& ft = plan.on_q[t];
                if (qpack[t] >= 0)
                    gemm(n, ft.k, d, kb.plane(p), kb.sl, qt + qpack[t] + ft.head(h) * cpu::bf16_pack_size(dpad, ft.k),
                         tq + p * tq_per_plane + static_cast<std::int64_t>(t) * n * plan.k, ft.k, scale);
            }
        }
    }
#if defined(_OPENMP)
#pragma omp parallel
#endif
    {
        float *lg = lg_s.mine(), *work = work_s.mine(), *o = o_s.mine(), *inv = inv_s.mine(), *g = g_s.mine(),
              *part = part_s.mine();
        bf16* pb = pb_s.mine();
        Id* idbuf = ids_s.mine();
        const Id** blk = blk_s.mine();
        const bf16_hw::gemm_tiles tiles(amx);
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (std::int64_t item = 0; item < items; ++item) {
            const std::int64_t p = item / blocks, i0 = row0 + (item % blocks) * rb_max, h = p % plan.h;
            const std::int64_t rb = std::min(rb_max, row0 + rows - i0);
            load_block_ids(plan, i0, rb, idbuf, blk);
            // s·(q·kᵀ) and s·(q·table_k) of the contextual key tables, float accumulation
            gemm(rb, ncols, d, qb.plane(p) + i0 * qb.sl, qb.sl, kp + p * kp_size, lg, ncols, scale);
            for (std::size_t t = 0; t < plan.on_q.size(); ++t) {  // + tq[j, id(j, i)] (query target, contextual)
                const auto& ft = plan.on_q[t];
                if (ft.bias || !q_lookup) continue;
                const float* tqt = tq + p * tq_per_plane + static_cast<std::int64_t>(t) * n * plan.k;
                bf16_hw::lookup_rows(tqt, ft.k, qid[t] + i0, n, n, rb, g, rbp);
                bf16_hw::add_transposed(g, rbp, rb, n, lg, ncols);
            }
            const std::uint8_t* mask =
                in.key_padding_mask.data ? in.key_padding_mask.data + (p / plan.h) * in.key_padding_mask.stride(0) : nullptr;
            for (std::int64_t i = 0; i < rb; ++i) {
                float* row = lg + i * ncols;
                for (std::size_t t = 0; t < plan.on_k.size(); ++t) {
                    const auto& ft = plan.on_k[t];
                    cpu::gather_add(row, ft.bias ? ft.table + ft.head(h) * ft.k : row + kcol[t], ft.k, blk[ft.slot] + i * n, n);
                }
                for (std::size_t t = 0; t < plan.on_q.size(); ++t) {
                    const auto& ft = plan.on_q[t];
                    const Id* rid = blk[ft.slot] + i * n;  // transposed: [i, j] holds id(j, i)
                    if (ft.bias)
                        cpu::gather_add(row, ft.table + ft.head(h) * ft.k, ft.k, rid, n);
                    else if (!q_lookup)
                        cpu::gather_add_strided(row, tq + p * tq_per_plane + static_cast<std::int64_t>(t) * n * plan.k, ft.k, rid,
                                                n);
                }
                if (f.in.attn_mask.data)  // the float copy, (L, L) contiguous
                    map<float>(row, 1, n).array() += cmap<float>(f.in.attn_mask.data + (i0 + i) * n, 1, n).array();
                inv[i] = bf16_hw::softmax_row_bf16(row, n, mask, pb + i * np, keep);
            }
            // out = (Σⱼ bf16(e_j)·v_j + the value terms of the float exponentials)/Σe, or with the
            // probabilities kept (attn) the value terms of those after the scaling
            // (AMX: the inner dimension np, the zeros of pb past n against vp's zero pairs past n)
            gemm(rb, d, amx ? np : n, pb, np, vp + p * vp_size, o, d, 1.0f);
            auto om = map<float>(o, rb, d);
            const auto value_terms = [&] {
                for (const auto& t : plan.on_v) {
                    cpu::scatter_rows4(lg, ncols, blk[t.slot], n, rb, n, t.k, part, work);
                    om.noalias() += cmap<float>(work, rb, t.k) * cmap<float>(t.table + t.head(h) * t.k * d, t.k, d);
                }
            };
            if (keep == bf16_hw::row_keep::exponentials) value_terms();
            for (std::int64_t i = 0; i < rb; ++i) om.row(i) *= inv[i];
            if (keep == bf16_hw::row_keep::probabilities) value_terms();
            cpu::float_to_bf16(o, out.data + (p * n + i0) * d, rb * d);
            if (attn.data)
                for (std::int64_t i = 0; i < rb; ++i) cpu::float_to_bf16(lg + i * ncols, attn.data + (p * n + i0 + i) * n, n);
        }
    }
}
#endif

// The bf16 forward: the AVX512_BF16 path where this unit is built for it and the CPU reports it
// (and no RoPE, no key_lengths, keys as many as queries, no test hook), the portable path otherwise (packed sequences:
// packed_forward_bf16, always portable).
template <class Id>
void fused_forward_bf16(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<bf16> out,
                        tensor_ref<bf16> attn, const attention_options& opt) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (!in.rope.enabled() && is_empty_view(in.key_lengths) && in.k.extent(2) == in.q.extent(2) &&
        !cpu::bf16_portable_only.load(std::memory_order_relaxed) && cpu::cpu_has_avx512_bf16()) {
        fused_forward_bf16_hw<Id>(in, ids, out, attn, opt);
        return;
    }
#endif
    fused_forward_bf16_portable<Id>(in, ids, out, attn, opt);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail
