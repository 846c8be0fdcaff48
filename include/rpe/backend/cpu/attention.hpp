/// @file backend/cpu/attention.hpp
/// @brief Fused multi-head attention with iRPE on queries, keys and values (CPU): forward and
/// backward of the whole attention step, row block by row block, with no (B, H, L, L) buffer.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "../../any_term.hpp"  // rpe::any_term, make_any_term: the CPU terms that users attach to slots
#include "../../attention_inputs.hpp"
#include "../../bf16.hpp"
#include "../../f16.hpp"
#include "../../detail/check.hpp"
#include "../../detail/validate.hpp"
#include "../../error.hpp"
#include "../../tensor.hpp"
#include "eigen.hpp"
#include "isa.hpp"
#include "kernels.hpp"
#include "rope.hpp"
#include "simd.hpp"

namespace rpe {

namespace cpu {

/// @brief What the CPU attention supports (checked by the shared front): everything —
/// strided q/k/v (rows of D contiguous), the `attn` output and the backward from saved
/// probabilities, RoPE with the frequencies' gradient, both masks, 3D grids, any head dim,
/// per-token positions of the iRPE terms, packed sequences, key lengths, keys of another length
/// than the queries (without terms or packing), a forward on some query rows only (without packing).
inline constexpr attention_capabilities attention_caps{.backend = "cpu",
                                                       .strided_qkv = true,
                                                       .saved_probabilities = true,
                                                       .rope = true,
                                                       .rope_freqs_grad = true,
                                                       .key_padding_mask = true,
                                                       .attn_mask = true,
                                                       .grid_3d = true,
                                                       .max_head_dim = 0,
                                                       .positions = true,
                                                       .packed = true,
                                                       .key_lengths = true,
                                                       .cross_lengths = true,
                                                       .query_rows = true};

}  // namespace cpu

namespace detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

/// One lookup table of one term, prepared for the fused kernels.
template <class S, class Id>
struct fused_table {
    cpu::id_rows<Id> rows;     // id(i, j) for k and v; id(j, i) at [i, j] for q (transposed)
    int slot = 0;              // index of this table's block of ids (see load_block_ids)
    const Id* full = nullptr;  // (L, L_k) ids made once per call (see materialise_ids), or null
    const S* table = nullptr;  // bias (Ht, K); contextual q/k (Ht, D, K); v (Ht, K, D)
    S* grad = nullptr;         // same shape as table, or null
    std::int64_t table_heads = 1;
    std::int64_t k = 0;  // buckets of this table (extra bucket included)
    bool bias = false;
    S* partial = nullptr;             // (slots, partial_stride): per-(plane, chunk) gradient partials of a wave (backward)
    S* partial_base = nullptr;        // the buffer of `partial` (a wave's slots start within its first 64-byte line)
    std::int64_t partial_stride = 0;  // the table's size
    S* plane_partial = nullptr;       // split waves, contextual q: the plane's partial before it goes to its last slot
    [[nodiscard]] std::int64_t head(std::int64_t h) const { return table_heads == 1 ? 0 : h; }
};

template <class S, class Id>
struct fused_plan {
    // l: queries; lk: keys and values; with a term attached the ids are (l, lk) (keys of another
    // count at positions: cross-attention), their rows lk apart
    std::int64_t b = 0, h = 0, l = 0, d = 0, k = 0, rb = 0, lk = 0;
    S scale = 1;
    std::vector<fused_table<S, Id>> on_q, on_k, on_v;
    int tables = 0;                               // tables in on_q, on_k, on_v together
    cpu::plane_rows<S> qv, kv, vv;                // q, v as given (maybe strided); k as given, or the rotated copy with RoPE
    std::shared_ptr<const rope_table<S>> rope;    // cos/sin of the queries with RoPE, else null
    std::shared_ptr<const rope_table<S>> rope_k;  // of the keys (== rope unless key_positions)
    std::int64_t rope_skip = 0;
    const std::int32_t* key_len = nullptr;  // (B) valid key lengths (attention_inputs::key_lengths), or null: all L_k

    // Keys of plane p that are computed: key_lengths[b], or L_k.
    [[nodiscard]] std::int64_t keys(std::int64_t p) const { return key_len ? key_len[p / h] : lk; }

    // The scaled (and, with RoPE, rotated) queries of rows [i0, i0 + rb) of plane p into qs (rb, D).
    void load_queries(std::int64_t p, std::int64_t i0, std::int64_t rb, S* qs) const {
        const S* src = qv.plane(p) + i0 * qv.sl;
        if (rope)
            cpu::rope_rotate_rows(*rope, p % h, rope_skip, i0, rb, d, src, qs, scale, false, qv.sl);
        else
            cpu::map<S>(qs, rb, d) = qv.rows(p, i0, rb, d) * scale;
    }
};

// With RoPE: the rotated keys of plane p, rows [0, nk) (nk = plan.keys(p); padded keys are not
// read), into kr (L_k, D), contiguous: the forward's keys of one plane, rotated by the thread that
// takes the plane's row blocks, while they sit in its cache (the same values as rotate_keys).
template <class S, class Id>
void rotate_plane_keys(const fused_plan<S, Id>& plan, std::int64_t p, S* kr) {
    cpu::rope_rotate_rows(*plan.rope_k, p % plan.h, plan.rope_skip, 0, plan.keys(p), plan.d, plan.kv.plane(p), kr, S(1), false,
                          plan.kv.sl);
}

// With RoPE: the rotated keys of every plane into kr (B·H·L_k·D, contiguous), once per call.
template <class S, class Id>
void rotate_keys(fused_plan<S, Id>& plan, S* kr) {
    if (!plan.rope) return;
    const std::int64_t n = plan.lk, d = plan.d, planes = plan.b * plan.h;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t p = 0; p < planes; ++p)
        cpu::rope_rotate_rows(*plan.rope_k, p % plan.h, plan.rope_skip, 0, n, d, plan.kv.plane(p), kr + p * n * d, S(1), false,
                              plan.kv.sl);
    plan.kv = cpu::plane_rows<S>(kr, plan.h, n, d);
}

template <class S, class Id>
void add_tables(fused_plan<S, Id>& plan, const attention_term<S>& slot, const std::shared_ptr<const bucket_ids>& ids,
                std::vector<fused_table<S, Id>>& out, bool want_grads) {
    if (!slot.term) return;
    const auto shape = slot.term->table_shape();
    const int n = slot.term->num_tables();
    require(static_cast<int>(slot.tables.size()) == n, "attention", "a term holds ", slot.tables.size(), " tables; expected ", n);
    for (int t = 0; t < n; ++t) {
        fused_table<S, Id> ft;
        check_shape(slot.tables[static_cast<std::size_t>(t)], shape, "attention", "tables");
        check_nonnull(slot.tables[static_cast<std::size_t>(t)], "attention", "tables");
        ft.table = slot.tables[static_cast<std::size_t>(t)].data;
        if (want_grads && static_cast<std::size_t>(t) < slot.grad_tables.size())
            ft.grad = slot.grad_tables[static_cast<std::size_t>(t)].data;  // checked by check_grad_tables
        ft.table_heads = shape[0];
        ft.k = slot.term->num_buckets();
        ft.bias = !slot.term->contextual();
        ft.rows = cpu::id_rows<Id>{ids.get(), t, slot.term->target() == target::query};
        ft.slot = plan.tables++;
        out.push_back(std::move(ft));
    }
}

// Points blk[t.slot] at the (rb, L_k) ids of rows [i0, i0 + rb) of every table (stored rows, rows
// made once per call, or rows made into buf, rb_max·L_k ids per table).
template <class S, class Id>
void load_block_ids(const fused_plan<S, Id>& plan, std::int64_t i0, std::int64_t rb, Id* buf, const Id** blk) {
    for (const auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
        for (const auto& t : *group)
            blk[t.slot] = t.full ? t.full + i0 * plan.lk : t.rows(i0, rb, buf + t.slot * plan.rb * plan.lk);
}

// Ids that every (batch, head) plane would otherwise make again row by row (the query target's
// transposed order, a narrower stored type, on-the-fly storage) are made once per call into an
// (L, L_k) buffer when it takes at most this many bytes per table.
inline constexpr std::int64_t materialise_ids_bytes = std::int64_t{16} << 20;

template <class S, class Id>
bool needs_materialising(const fused_table<S, Id>& t, std::int64_t n, std::int64_t nk, std::int64_t planes) {
    const bool direct = !t.rows.transposed && t.rows.ids->storage_kind() == id_storage::table &&
                        t.rows.ids->id_bytes() == static_cast<int>(sizeof(Id));
    return !direct && planes > 1 && n * nk * static_cast<std::int64_t>(sizeof(Id)) <= materialise_ids_bytes;
}

// Declares the (L, L_k) buffers of the tables that need them (needs_materialising).
template <class S, class Id>
std::vector<cpu::shared_scratch<Id>> declare_full_ids(const fused_plan<S, Id>& plan, cpu::workspace& ws) {
    std::vector<cpu::shared_scratch<Id>> out;
    for (const auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
        for (const auto& t : *group)
            out.emplace_back(ws, needs_materialising(t, plan.l, plan.lk, plan.b * plan.h) ? plan.l * plan.lk : 0);
    return out;
}

// Fills the buffers declared by declare_full_ids (after ws.allocate()) and points the tables at them.
template <class S, class Id>
void materialise_ids(fused_plan<S, Id>& plan, const std::vector<cpu::shared_scratch<Id>>& full) {
    const std::int64_t n = plan.l, nk = plan.lk;
    std::size_t next = 0;
    for (auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
        for (auto& t : *group) {
            const auto& f = full[next++];
            if (f.empty()) continue;
            Id* dst = f.data();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n > 64)
#endif
            for (std::int64_t i = 0; i < n; ++i) {
                const Id* r = t.rows(i, 1, dst + i * nk);
                if (r != dst + i * nk) std::copy(r, r + nk, dst + i * nk);
            }
            t.full = dst;
        }
}

// The forward's faster layout of a block (block_probabilities; null: the plain one of the backward).
// Whether the float products that make the probabilities and the forward's output run on
// cpu::simd::gemm (AVX-512F float: faster than Eigen's general product at these shapes, and each
// element one multiply-add chain in order, see gemm_tile) rather than Eigen. The forward and the
// backward's recomputation take the same route, so their probabilities are the same bits.
template <class S>
inline constexpr bool simd_products =
#if defined(__AVX512F__)
    std::is_same_v<S, float>;
#else
    false;
#endif

// Row stride of the transposed keys [kᵀ | table_k] (D, nk + ΣK) of the simd products: whole
// 16-column tiles (simd::transpose_into writes them).
inline std::int64_t kt_stride(std::int64_t nk, std::int64_t extra) { return (nk + extra + 15) / 16 * 16; }

// xt (D, ldt) = [xᵀ | the tables] of plane p, the B of a simd product (x: the plane's (nk, D)
// rows, ldx apart; ldt = kt_stride(nk, ΣK)), zero past them. Keys (`values` false): kt = [kᵀ |
// table_k of each contextual key table, (D, K)], the logits' B. Values: vt = [vᵀ | table_vᵀ of
// each contextual value table, (K, D) transposed], the backward's B of dP = grad_out·vt (one
// product gives grad_out·vᵀ and the value terms' per-bucket products grad_out·table_vᵀ).
template <class S, class Id>
void transposed_operand(const fused_plan<S, Id>& plan, std::int64_t p, bool values, const S* x, std::int64_t ldx, std::int64_t nk,
                        S* xt, std::int64_t ldt) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>) {
        const std::int64_t d = plan.d, h = p % plan.h;
        cpu::simd::transpose_into(x, ldx, nk, d, xt, ldt);
        std::int64_t col = nk;
        for (const auto& t : values ? plan.on_v : plan.on_k) {
            if (!values && t.bias) continue;  // (every value term is contextual)
            const S* tab = t.table + t.head(h) * d * t.k;
            for (std::int64_t e = 0; e < d; ++e) {
                S* dst = xt + e * ldt + col;
                if (values)  // (K, D): column e
                    for (std::int64_t b = 0; b < t.k; ++b) dst[b] = tab[b * d + e];
                else  // (D, K): row e
                    std::copy_n(tab + e * t.k, t.k, dst);
            }
            col += t.k;
        }
        if (col > (nk + 15) / 16 * 16)  // transpose_into zeroed the columns up to nk rounded up to 16
            for (std::int64_t e = 0; e < d; ++e) std::fill(xt + e * ldt + col, xt + (e + 1) * ldt, 0.0f);
    }
#else
    (void)plan, (void)p, (void)values, (void)x, (void)ldx, (void)nk, (void)xt, (void)ldt;
#endif
}

// Whether the forward's contextual value terms (nv tables, ΣK buckets, D columns, nk keys) cost
// less looked up per key (simd::value_lookup_rows: a table row's ⌈D/16⌉ multiply-adds per key and
// table, ≈ 1.75 cycles each) than as per-bucket sums of the probabilities (a scalar scatter per key
// and table, ≈ 1 cycle) and their part of the output's product (ΣK·⌈D/16⌉ per row, ≈ 3 cycles
// each with the sums' reduction). The cycle figures were fitted to rpe_bench's forward on an AMD
// EPYC (Zen 4) at L = 65 and 197, D = 16 and 32, K = 50 (docs/benchmarks.md, "The value term by
// key"): the lookup wins at the digits demo's shapes (L = 65, D = 16: −11 % of the iRPE-QKV
// forward), breaks even at L = 197, D = 16, and loses at D ≥ 32 with L = 197.
inline bool value_lookup_pays(std::int64_t nk, std::int64_t d, std::int64_t nv, std::int64_t ksum) {
    if (d > 32) return false;
    const std::int64_t nc = (d + 15) / 16;
    return nv * nc * 7 * nk <= nv * 4 * nk + 12 * ksum * nc;
}

// o[i·ldo + c] *= f[i] for i < rows, c < d: the forward's normalisation of its output rows
// (Eigen's row expression peels scalars up to an aligned address: most of a 16-column row).
template <class S>
inline void scale_rows(S* o, std::int64_t ldo, std::int64_t rows, std::int64_t d, const S* f) {
    for (std::int64_t i = 0; i < rows; ++i) {
        S* r = o + i * ldo;
        const S s = f[i];
        std::int64_t c = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<S, float>) {
            const __m512 v = _mm512_set1_ps(s);
            for (; c < d; c += 16) {
                const __mmask16 m = cpu::simd::lanes(d - c);
                _mm512_mask_storeu_ps(r + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + c), v));
            }
        }
#endif
        for (; c < d; ++c) r[c] *= s;
    }
}

// cpu::simd::gemm where simd_products<S> (only called there).
template <class S>
void simd_gemm(std::int64_t m, std::int64_t n, std::int64_t kk, const S* a, std::int64_t a_rs, std::int64_t a_ks, const S* b,
               std::int64_t ldb, S* c, std::int64_t ldc, bool accumulate = false) {
    static_assert(simd_products<S>, "simd_gemm: only where simd_products<S>");
#if defined(__AVX512F__)
    cpu::simd::gemm(m, n, kk, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
#endif
}

template <class S, class Id>
struct block_layout {
    // lg's rows are ld apart (0: nk); with folded_k, columns [nk, nk + ΣK) of each row hold the
    // contextual key tables' per-bucket products qs·table_k, in on_k order (the forward's one
    // product against [k; table_kᵀ], see fused_forward; after the softmax the forward puts the
    // value terms' per-bucket sums there)
    std::int64_t ld = 0;
    bool folded_k = false;
    // per on_q table: its key-order ids (L_k, L), [j, i] = the query target's id of query i and
    // key j (contextual tables, AVX-512F float only), or null: the per-row gathers
    const Id* const* qid = nullptr;
    S* g = nullptr;                                  // with qid: scratch of L_k·query_chunk values
    static constexpr std::int64_t query_chunk = 32;  // rows per transposed lookup (a multiple of 16)
    // per row of the block: 1/Σ of its exponentials, the rows left unnormalised (softmax_row_exp;
    // the forward scales its (rb, D) output instead of the (rb, L) rows), or null: probabilities
    S* inv = nullptr;
};

// Logits of rows [i0, i0 + rb) of plane p into lg (rb, L), then the masked softmax in place
// (with lay->inv: the exponentials and their 1/Σ per row, block_layout).
// qs_blk (rb, D) are the scaled queries of those rows; tq holds the plane's products for the
// contextual q tables (plane_query_products); blk the block's ids per table (load_block_ids).
// Only the plane's first nk = plan.keys(p) keys are computed: lg is (rb, nk), the ids' rows stay L_k apart.
// logits_given: lg already holds qs·kᵀ (the bf16 forward's own product, or the forward's folded
// product, see block_layout); only the terms, masks and softmax follow. keys: the plane's keys
// (L, D) contiguous (the forward's rotated keys of this plane, rotate_plane_keys), or null:
// plan.kv. lay: the forward's layout of lg and lookups (block_layout), or null.
template <class S, class Id>
void block_probabilities(const fused_plan<S, Id>& plan, const attention_inputs<S>& in, std::int64_t p, std::int64_t i0,
                         std::int64_t rb, const S* qs_blk, const S* tq, const Id* const* blk, S* lg, S* work,
                         bool logits_given = false, const S* keys = nullptr, const block_layout<S, Id>* lay = nullptr) {
    using cpu::cmap;
    using cpu::map;
    // n: queries (the key-order ids' stride; read by the AVX-512 lookups only); ni = L_k: the id
    // rows' stride and the q products' rows
    [[maybe_unused]] const std::int64_t n = plan.l;
    const std::int64_t ni = plan.lk, nk = plan.keys(p), d = plan.d, h = p % plan.h;
    const std::int64_t ld = lay && lay->ld > 0 ? lay->ld : nk;
    const bool folded = lay && lay->folded_k;
    if (!logits_given) {
        cpu::map_strided<S> logits(lg, rb, nk, Eigen::OuterStride<>(ld));
        if (keys)
            logits.noalias() = cmap<S>(qs_blk, rb, d) * cpu::plane_rows<S>(keys, 1, plan.lk, d).rows(0, 0, nk, d).transpose();
        else
            logits.noalias() = cmap<S>(qs_blk, rb, d) * plan.kv.rows(p, 0, nk, d).transpose();
    }
    // contextual key terms: per-bucket products of the block, (rb, K) each, side by side in work
    // (folded: already in lg's columns past nk)
    std::int64_t offset = 0;
    if (!folded)
        for (const auto& t : plan.on_k)
            if (!t.bias) {
                map<S>(work + offset, rb, t.k).noalias() =
                    cmap<S>(qs_blk, rb, d) * cmap<S>(t.table + t.head(h) * d * t.k, d, t.k);
                offset += rb * t.k;
            }
    // contextual query terms with key-order ids: per key its row of products looked up by the
    // block's queries, added to the logits transposed (chunks of query_chunk rows)
    std::uint64_t looked_up = 0;  // bit q: table q done here
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>)
        if (lay && lay->qid)
            for (std::size_t q = 0; q < plan.on_q.size(); ++q) {
                const auto& t = plan.on_q[q];
                if (t.bias || !lay->qid[q] || q >= 64) continue;
                const S* w = tq + static_cast<std::int64_t>(q) * ni * plan.k;
                constexpr std::int64_t cr_max = block_layout<S, Id>::query_chunk;
                for (std::int64_t c0 = 0; c0 < rb; c0 += cr_max) {
                    const std::int64_t cr = std::min(cr_max, rb - c0);
                    cpu::simd::lookup_rows(w, t.k, lay->qid[q] + i0 + c0, n, nk, cr, lay->g, cr_max);
                    cpu::simd::add_transposed(lay->g, cr_max, cr, nk, lg + c0 * ld, ld);
                }
                looked_up |= std::uint64_t{1} << q;
            }
#endif
    // masks: rows stride(0) apart (a packed image's views into the whole sequence's masks)
    const std::uint8_t* mask =
        in.key_padding_mask.data ? in.key_padding_mask.data + (p / plan.h) * in.key_padding_mask.stride(0) : nullptr;
    // one pass per row while it sits in L1: gathers, masks, max, exp, normalisation
    for (std::int64_t i = 0; i < rb; ++i) {
        S* row = lg + i * ld;
        std::int64_t off = 0, col = nk;
        for (const auto& t : plan.on_k) {
            const S* w = t.table + t.head(h) * t.k;
            if (!t.bias) {
                w = folded ? row + col : work + off + i * t.k;  // folded: this row's own columns past nk
                off += rb * t.k;
                col += t.k;
            }
            cpu::gather_add(row, w, t.k, blk[t.slot] + i * ni, nk);
        }
        for (std::size_t q = 0; q < plan.on_q.size(); ++q) {
            const auto& t = plan.on_q[q];
            const Id* ids = blk[t.slot] + i * ni;  // transposed: [i, j] holds id(j, i)
            if (t.bias)
                cpu::gather_add(row, t.table + t.head(h) * t.k, t.k, ids, nk);
            else if (q >= 64 || !((looked_up >> q) & 1u))
                cpu::gather_add_strided(row, tq + static_cast<std::int64_t>(q) * ni * plan.k, t.k, ids, nk);
        }
        if (in.attn_mask.data)
            map<S>(row, 1, nk).array() += cmap<S>(in.attn_mask.data + (i0 + i) * in.attn_mask.stride(0), 1, nk).array();
        if (lay && lay->inv)
            lay->inv[i] = cpu::softmax_row_exp(row, nk, mask);
        else
            cpu::softmax_row(row, nk, mask);
    }
}

// Per plane: (k·s)·table_q[h'] (L_k, K) (k: plan.kv, the rotated copy with RoPE) of every contextual q table q, at buf + q·L_k·K (K = plan.k).
template <class S, class Id>
void plane_query_products(const fused_plan<S, Id>& plan, std::int64_t p, S* ks, S* buf) {
    using cpu::cmap;
    using cpu::map;
    const std::int64_t n = plan.lk, nk = plan.keys(p), d = plan.d, h = p % plan.h;  // rows of keys >= nk are not read
    bool have_ks = false;
    for (std::size_t q = 0; q < plan.on_q.size(); ++q) {
        const auto& t = plan.on_q[q];
        if (t.bias) continue;
        if (!have_ks) {
            map<S>(ks, nk, d) = plan.kv.rows(p, 0, nk, d) * plan.scale;
            have_ks = true;
        }
        const std::int64_t k = t.k;
        S* dst = buf + static_cast<std::int64_t>(q) * n * plan.k;
        if constexpr (simd_products<S>)
            simd_gemm(nk, k, d, static_cast<const S*>(ks), d, 1, t.table + t.head(h) * d * k, k, dst, k);
        else
            map<S>(dst, nk, k).noalias() = cmap<S>(ks, nk, d) * cmap<S>(t.table + t.head(h) * d * k, d, k);
    }
}

template <class S, class Id>
bool has_contextual_query(const fused_plan<S, Id>& plan) {
    return std::any_of(plan.on_q.begin(), plan.on_q.end(), [](const auto& t) { return !t.bias; });
}

// The contextual q products of every plane, (planes, nq, L_k, K), into tq, computed once before
// the row blocks (which may run on different threads); ks_s: (L_k, D) per thread.
template <class S, class Id>
void all_query_products(const fused_plan<S, Id>& plan, const cpu::thread_scratch<S>& ks_s, S* tq) {
    const std::int64_t n = plan.lk, planes = plan.b * plan.h;
    const std::int64_t per_plane = static_cast<std::int64_t>(plan.on_q.size()) * n * plan.k;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t p = 0; p < planes; ++p) plane_query_products(plan, p, ks_s.mine(), tq + p * per_plane);
}

// Rows per block of a call on L queries and L_k keys (attention_options::row_block, or automatic:
// about 128K logits per block).
inline std::int64_t row_block_of(const attention_options& opt, std::int64_t l, std::int64_t lk) {
    require(opt.row_block >= 0, "attention", "row_block = ", opt.row_block, "; expected >= 0");
    const std::int64_t rb =
        opt.row_block > 0 ? opt.row_block : std::max<std::int64_t>(32, (std::int64_t{1} << 17) / std::max<std::int64_t>(lk, 1));
    return std::max<std::int64_t>(1, std::min(rb, l));
}

template <class S, class Id>
fused_plan<S, Id> make_plan(const attention_inputs<S>& in, const std::shared_ptr<const bucket_ids>* ids, bool want_grads,
                            const attention_options& opt) {
    const attention_shape s{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3), in.k.extent(2)};  // checked
    fused_plan<S, Id> plan;
    plan.b = s.b;
    plan.h = s.h;
    plan.l = s.l;
    plan.lk = s.lk;
    plan.d = s.d;
    plan.scale = static_cast<S>(softmax_scale(opt, s.d));
    const attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    for (const auto* slot : slots)
        if (slot->term) plan.k = std::max<std::int64_t>(plan.k, slot->term->num_buckets());
    add_tables(plan, in.rpe_q, ids[0], plan.on_q, want_grads);
    add_tables(plan, in.rpe_k, ids[1], plan.on_k, want_grads);
    add_tables(plan, in.rpe_v, ids[2], plan.on_v, want_grads);
    plan.rb = row_block_of(opt, s.l, s.lk);
    plan.qv = cpu::plane_rows<S>(in.q);
    plan.kv = cpu::plane_rows<S>(in.k);
    plan.vv = cpu::plane_rows<S>(in.v);
    plan.key_len = in.key_lengths.data;
    if (in.rope.enabled()) {
        plan.rope = rope_query_table(in.rope, s.d, in.height, in.width);
        plan.rope_k = rope_key_table(in.rope, s.d, plan.rope);
        plan.rope_skip = in.rope.skip;
    }
    return plan;
}

// One forward problem of a call: the inputs (a whole call's, or one packed image's views), their
// ids (slots q, k, v) and the output rows.
template <class S>
struct forward_part {
    const attention_inputs<S>* in = nullptr;
    const std::shared_ptr<const bucket_ids>* ids = nullptr;
    tensor_ref<S> out;
};

// Row stride of the forward's logits block for nk keys and `extra` columns after them (the
// folded contextual key products, the value sums): nk without, else nk + extra rounded up to 16
// (64-byte rows for float; with the fold the product's remainder columns are zero).
inline std::int64_t lg_stride(std::int64_t nk, std::int64_t extra) { return extra > 0 ? (nk + extra + 15) / 16 * 16 : nk; }

// The forward's row stride of its logits block: with simd products always whole 16-column vectors
// (kt_stride: the logits' product writes its rows whole, see fused_forward), else lg_stride.
template <class S>
inline std::int64_t forward_lg_stride(std::int64_t nk, std::int64_t extra) {
    return simd_products<S> ? kt_stride(nk, extra) : lg_stride(nk, extra);
}

// The forward of one or more independent problems (the images of a packed sequence) in one
// parallel region: their (part, plane, row block) items share the threads, so small images do not
// leave threads idle. Each item is computed as in a call on its part alone (its own plan, ids, row
// block), by one thread, so the results do not depend on the thread count or on the other parts.
// attn: (B, H, L, L_k) probabilities of a single part, or empty.
template <class S, class Id>
void fused_forward(const std::vector<forward_part<S>>& parts, tensor_ref<S> attn, const attention_options& opt) {
    using cpu::cmap;
    using cpu::map;
    struct state {
        fused_plan<S, Id> plan;
        std::int64_t blocks = 0, items = 0, first = 0, tq_per_plane = 0;
        std::int64_t row0 = 0, rows = 0;  // the query rows computed: [row0, row0 + rows) (attention_options::query_rows)
        bool ctx_q = false;
        bool keys_per_plane = false;  // RoPE: each plane's keys rotated by the thread that takes its blocks
        std::int64_t kx_cols = 0;     // ΣK of the contextual key tables: folded into the logits' product
        std::int64_t vx_cols = 0;     // ΣK of the value tables: folded into the output's product
        bool q_lookup = false;        // contextual query tables looked up transposed (key-order ids)
        bool v_direct = false;        // value tables looked up per key (simd::value_lookup_rows), not folded
    };
    std::vector<state> st(parts.size());
    std::int64_t items = 0, lg_max = 0, work_max = 0, qs_max = 0, ids_max = 0, ks_max = 0, kp_max = 0, kx_max = 0, vx_max = 0,
                 vk_max = 0, g_max = 0, rb_all = 0, kt_max = 0;
    int tables_max = 0;
    for (std::size_t m = 0; m < parts.size(); ++m) {
        auto& x = st[m];
        x.plan = make_plan<S, Id>(*parts[m].in, parts[m].ids, false, opt);
        const auto& plan = x.plan;
        const std::int64_t n = plan.l, nkeys = plan.lk, rb_max = plan.rb;  // queries, keys
        x.row0 = opt.query_rows.begin;
        x.rows = opt.query_rows.end_of(n) - x.row0;
        x.blocks = (x.rows + rb_max - 1) / rb_max;
        x.items = plan.b * plan.h * x.blocks;
        x.first = items;
        items += x.items;
        x.ctx_q = has_contextual_query(plan);
        x.tq_per_plane = x.ctx_q ? static_cast<std::int64_t>(plan.on_q.size()) * nkeys * plan.k : 0;
        // RoPE keys: rotated plane by plane into the thread's (L, D) buffer as its blocks are taken
        // (still in cache for the logits' product), unless the contextual q products, computed
        // before the row blocks, need every plane's rotated keys first (then one (B, H, L, D) copy)
        x.keys_per_plane = plan.rope && !x.ctx_q;
        // contextual key tables: per plane [k; table_kᵀ] (nk + ΣK, D) in a per-thread buffer, so
        // that one product per block gives the logits and the per-bucket products (lg's rows are
        // nk + ΣK apart); with RoPE per plane, the keys are rotated straight into it
        for (const auto& t : plan.on_k) x.kx_cols += t.bias ? 0 : t.k;
        // value tables: per plane [v; table_v] (nk + ΣK, D), the per-bucket sums of the
        // probabilities written into lg's columns past nk, so that one product gives the output
        for (const auto& t : plan.on_v) x.vx_cols += t.k;
#if defined(__AVX512F__)
        if constexpr (simd_products<S>)
            x.v_direct =
                x.vx_cols > 0 && value_lookup_pays(nkeys, plan.d, static_cast<std::int64_t>(plan.on_v.size()), x.vx_cols) &&
                std::all_of(plan.on_v.begin(), plan.on_v.end(), [&](const auto& t) {
                    // finite tables only: the folded sums multiply every bucket's row (0·∞ = NaN, as
                    // in the reference and the float64 forward), the lookup only the rows keys use
                    return std::all_of(t.table, t.table + t.table_heads * t.k * plan.d, [](S e) { return std::isfinite(e); });
                });
#endif
        if (x.v_direct) x.vx_cols = 0;
        vx_max = std::max(vx_max, x.vx_cols > 0 ? (nkeys + x.vx_cols) * plan.d : 0);
        for (const auto& t : plan.on_v) vk_max = std::max(vk_max, t.k);
        // lg's rows (and with the fold the product's columns): n + ΣK rounded up to 16 (64-byte rows)
        const std::int64_t ld_max = forward_lg_stride<S>(nkeys, std::max(x.kx_cols, x.vx_cols));
        // simd products: per plane the transposed keys [kᵀ | table_k] (D, nk + ΣK) instead of kx
        // (RoPE keys rotated into kp first)
        kx_max = std::max(kx_max, x.kx_cols > 0 && !simd_products<S> ? ld_max * plan.d : 0);
        kt_max = std::max(kt_max, simd_products<S> ? plan.d * kt_stride(nkeys, x.kx_cols) : 0);
        kp_max = std::max(kp_max, x.keys_per_plane && (x.kx_cols == 0 || simd_products<S>) ? nkeys * plan.d : 0);
        lg_max = std::max(lg_max, rb_max * ld_max);
#if defined(__AVX512F__)
        // contextual query tables: key-order ids made once per call where they fit (as the
        // materialised ids), then per block a lookup by key and a transposed add (block_layout)
        x.q_lookup =
            std::is_same_v<S, float> && x.ctx_q && n * nkeys * static_cast<std::int64_t>(sizeof(Id)) <= materialise_ids_bytes;
        g_max = std::max(g_max, x.q_lookup ? nkeys * block_layout<S, Id>::query_chunk : 0);
#endif
        // work: (rb, K) per-bucket values, two side by side for Cross's two key tables
        work_max = std::max(work_max, 2 * rb_max * std::max<std::int64_t>(plan.k, 1));
        qs_max = std::max(qs_max, rb_max * plan.d);
        rb_all = std::max(rb_all, rb_max);
        ids_max = std::max(ids_max, plan.tables * rb_max * nkeys);
        ks_max = std::max(ks_max, x.ctx_q ? nkeys * plan.d : 0);
        tables_max = std::max(tables_max, plan.tables);
    }
    // every buffer is laid out here, in the calling thread's workspace, before the parallel region
    cpu::workspace ws;
    std::vector<cpu::shared_scratch<S>> tq_s, kr_s;  // per part: contextual q products; rotated keys (RoPE)
    std::vector<std::vector<cpu::shared_scratch<Id>>> full_ids;
    std::vector<cpu::shared_scratch<Id>> qid_s;  // per part: key-order ids of its contextual q tables
    for (auto& x : st) {
        const std::int64_t planes = x.plan.b * x.plan.h;
        const std::int64_t nq_ctx = std::count_if(x.plan.on_q.begin(), x.plan.on_q.end(), [](const auto& t) { return !t.bias; });
        qid_s.emplace_back(ws, x.q_lookup ? nq_ctx * x.plan.l * x.plan.lk : 0);
        tq_s.emplace_back(ws, planes * x.tq_per_plane);
        kr_s.emplace_back(ws, x.plan.rope && !x.keys_per_plane ? planes * x.plan.lk * x.plan.d : 0);
        full_ids.push_back(declare_full_ids(x.plan, ws));
    }
    cpu::thread_scratch<S> ks_s(ws, ks_max);
    cpu::thread_scratch<S> lg_s(ws, lg_max), work_s(ws, work_max);
    cpu::thread_scratch<S> qs_s(ws, qs_max), kp_s(ws, kp_max), kx_s(ws, kx_max), vx_s(ws, vx_max), g_s(ws, g_max),
        part_s(ws, 8 * vk_max), inv_s(ws, rb_all), kt_s(ws, kt_max);
    cpu::thread_scratch<Id> ids_s(ws, ids_max);
    cpu::thread_scratch<const Id*> blk_s(ws, tables_max);
    ws.allocate();
    std::vector<cpu::plane_rows_mut<S>> ov;              // out, or a packed image's rows of it
    std::vector<std::int64_t> firsts;                    // each part's first item
    std::vector<std::vector<const Id*>> qid(st.size());  // per part and on_q table: key-order ids, or null
    for (std::size_t m = 0; m < st.size(); ++m) {
        auto& plan = st[m].plan;
        qid[m].assign(plan.on_q.size(), nullptr);
        if (st[m].q_lookup) {
            const std::int64_t n = plan.l, nk = plan.lk;
            Id* next = qid_s[m].data();
            for (std::size_t t = 0; t < plan.on_q.size(); ++t) {
                if (plan.on_q[t].bias) continue;
                cpu::key_order_ids(plan.on_q[t].rows, n, nk, next);
                qid[m][t] = next;
                next += n * nk;
            }
        }
        materialise_ids(plan, full_ids[m]);
        if (!st[m].keys_per_plane) rotate_keys(plan, kr_s[m].data());
        if (st[m].ctx_q) all_query_products(plan, ks_s, tq_s[m].data());
        ov.emplace_back(parts[m].out);
        firsts.push_back(st[m].first);
    }
#if defined(_OPENMP)
#pragma omp parallel
#endif
    {
        S *lg = lg_s.mine(), *work = work_s.mine(), *qs = qs_s.mine(), *kp = kp_s.mine(), *kx = kx_s.mine(), *vx = vx_s.mine(),
          *part = part_s.mine(), *kt = kt_s.mine();
        Id* idbuf = ids_s.mine();
        const Id** blk = blk_s.mine();
        std::size_t kp_part = st.size();  // the (part, plane) whose keys kp (or kx, vx) holds: none yet
        std::int64_t kp_plane = -1;
        block_layout<S, Id> lay;
        lay.g = g_s.mine();
        S* const inv = inv_s.mine();  // per row of a block: 1/Σ of its exponentials (block_layout::inv)
        lay.inv = inv;
        // (part, plane, row block) items: a few planes on many threads still use every thread; each
        // block writes its own rows of out, so the thread count does not change any result
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (std::int64_t all = 0; all < items; ++all) {
            // the part of this item: the last whose first item is <= all
            const auto m = static_cast<std::size_t>(std::upper_bound(firsts.begin(), firsts.end(), all) - firsts.begin() - 1);
            const auto& x = st[m];
            const auto& plan = x.plan;
            const attention_inputs<S>& in = *parts[m].in;
            const std::int64_t item = all - x.first, n = plan.l, d = plan.d, rb_max = plan.rb;
            const std::int64_t p = item / x.blocks, i0 = x.row0 + (item % x.blocks) * rb_max, h = p % plan.h;
            const std::int64_t rb = std::min(rb_max, x.row0 + x.rows - i0);
            load_block_ids(plan, i0, rb, idbuf, blk);
            plan.load_queries(p, i0, rb, qs);
            const std::int64_t nk = plan.keys(p);  // keys >= nk are padding (key_lengths): not computed
            const bool fold = x.kx_cols > 0, vfold = x.vx_cols > 0;
            // lg's rows: the logits, then the contextual key products (fold), later the value sums (vfold)
            constexpr bool sp = simd_products<S>;  // the products on simd::gemm, kt instead of kx
            const std::int64_t ld = forward_lg_stride<S>(nk, std::max(x.kx_cols, x.vx_cols));
            const std::int64_t ldt = kt_stride(nk, x.kx_cols);
            if ((sp || x.keys_per_plane || fold || vfold) && (kp_part != m || kp_plane != p)) {
                if (vfold) {  // vx = [v; table_v] of this plane: (nk + ΣK, D)
                    map<S>(vx, nk, d) = plan.vv.rows(p, 0, nk, d);
                    std::int64_t row = nk;
                    for (const auto& t : plan.on_v) {
                        map<S>(vx + row * d, t.k, d) = cmap<S>(t.table + t.head(h) * t.k * d, t.k, d);
                        row += t.k;
                    }
                }
                if constexpr (sp) {  // kt = [kᵀ | table_k] of this plane: (D, nk + ΣK)
                    if (x.keys_per_plane) rotate_plane_keys(plan, p, kp);
                    transposed_operand(plan, p, false, x.keys_per_plane ? static_cast<const S*>(kp) : plan.kv.plane(p),
                                       x.keys_per_plane ? d : plan.kv.sl, nk, kt, ldt);
                } else if (fold) {  // kx = [k; table_kᵀ] of this plane: (nk + ΣK, D)
                    if (x.keys_per_plane)
                        rotate_plane_keys(plan, p, kx);
                    else
                        map<S>(kx, nk, d) = plan.kv.rows(p, 0, nk, d);
                    std::int64_t col = nk;
                    for (const auto& t : plan.on_k)
                        if (!t.bias) {
                            map<S>(kx + col * d, t.k, d) = cmap<S>(t.table + t.head(h) * d * t.k, d, t.k).transpose();
                            col += t.k;
                        }
                    std::fill(kx + col * d, kx + ld * d, S(0));  // the padding columns: zero logits, not read
                } else if (x.keys_per_plane) {
                    rotate_plane_keys(plan, p, kp);
                }
                kp_part = m;
                kp_plane = p;
            }
            // simd products: every column of kt (zeros past nk + ΣK), so that each row of lg is
            // written in whole vectors: the scalar reads of its last keys that follow (the bias
            // lookups' and the softmax's tails, L = 65: one key past 64) then take the values from
            // the store queue instead of waiting for a partly masked store to reach the cache
            // (a bias term at the digits demo's shapes: −13 %, docs/benchmarks.md)
            if constexpr (sp)
                simd_gemm(rb, ldt, d, static_cast<const S*>(qs), d, 1, static_cast<const S*>(kt), ldt, lg, ld);
            else if (fold)
                map<S>(lg, rb, ld).noalias() = cmap<S>(qs, rb, d) * cmap<S>(kx, ld, d).transpose();
            lay.ld = ld;
            lay.folded_k = fold;
            lay.qid = x.q_lookup ? qid[m].data() : nullptr;
            block_probabilities(plan, in, p, i0, rb, qs, tq_s[m].data() + p * x.tq_per_plane, blk, lg, work, sp || fold,
                                !sp && x.keys_per_plane && !fold ? static_cast<const S*>(kp) : nullptr, &lay);
            auto o = ov[m].rows(p, i0, rb, d);
            const cpu::cmap_strided<S> probs(lg, rb, nk, Eigen::OuterStride<>(ld));
            if (nk == 0) {
                o.setZero();     // every key padded: zero probabilities, zero output
            } else if (vfold) {  // out = [a | per-bucket sums of a]·[v; table_v]
                std::int64_t col = nk;
                for (const auto& t : plan.on_v) {
                    cpu::scatter_rows4(lg, ld, blk[t.slot], plan.lk, rb, nk, t.k, part, lg + col, ld);
                    col += t.k;
                }
                if constexpr (sp)
                    simd_gemm(rb, d, nk + x.vx_cols, static_cast<const S*>(lg), ld, 1, static_cast<const S*>(vx), d, o.data(),
                              ov[m].sl);
                else
                    o.noalias() =
                        cpu::cmap_strided<S>(lg, rb, nk + x.vx_cols, Eigen::OuterStride<>(ld)) * cmap<S>(vx, nk + x.vx_cols, d);
            } else if constexpr (sp) {
                simd_gemm(rb, d, nk, static_cast<const S*>(lg), ld, 1, plan.vv.plane(p), plan.vv.sl, o.data(), ov[m].sl);
#if defined(__AVX512F__)
                if (x.v_direct)  // out += Σ_j a(i,j)·table_v[id(i,j)], per key
                    for (const auto& t : plan.on_v)
                        cpu::simd::value_lookup_rows(static_cast<const S*>(lg), ld, blk[t.slot], plan.lk, rb, nk,
                                                     t.table + t.head(h) * t.k * d, d, o.data(), ov[m].sl);
#endif
            } else {
                o.noalias() = probs * plan.vv.rows(p, 0, nk, d);
            }
            // the rows' normalisation, on the (rb, D) output instead of the (rb, nk) exponentials
            // (the products are linear in them, value sums included)
            if (nk > 0) scale_rows(o.data(), ov[m].sl, rb, d, inv);
            if (attn.data)  // (B, H, L, L_k): the probabilities, as softmax_row gives them
                for (std::int64_t i = 0; i < rb; ++i) {
                    S* dst = attn.data + (p * n + i0 + i) * plan.lk;
                    const S* src = lg + i * ld;
                    if (nk > 0) cpu::map<S>(dst, 1, nk) = cpu::cmap<S>(src, 1, nk) * inv[i];
                    std::fill(dst + nk, dst + plan.lk, S(0));
                }
        }
    }
}

template <class S, class Id>
void fused_forward(const attention_inputs<S>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<S> out,
                   tensor_ref<S> attn, const attention_options& opt) {
    fused_forward<S, Id>(std::vector<forward_part<S>>{{&in, ids, out}}, attn, opt);
}

// The contextual q terms' key gradients (added into gk, (L_k, D)) and table partials of plane p
// from its summed per-(key, bucket) sums gq (one (L_k, K) block per q table, K = plan.k apart); the
// table partials go to partial slot `slot`: the plane's first chunk (item `first`), or (`split`:
// that slot has gone) they are computed in t.plane_partial at the alignment item `first` has in
// one buffer of every item and copied to `slot`, the plane's last chunk. The plane's other chunks
// hold zeros for these tables, so the item-order sums are the same either way. tt: with
// simd_products, scratch of K·D values (the scaled table transposed).
template <class S, class Id, class GK>
void plane_query_gradients(fused_plan<S, Id>& plan, const S* gq, std::int64_t p, std::int64_t slot, bool split,
                           std::int64_t first, std::int64_t per_line, GK& gk, S* tt) {
    using cpu::cmap;
    using cpu::map;
    const std::int64_t n = plan.lk, d = plan.d, k = plan.k, h = p % plan.h;  // n: keys
    for (std::size_t q = 0; q < plan.on_q.size(); ++q) {
        auto& t = plan.on_q[q];
        if (t.bias) continue;
        const std::int64_t tk = t.k;
        const S* const gp = gq + static_cast<std::int64_t>(q) * n * k;  // (L_k, K), rows K apart
        const S* const tp = t.table + t.head(h) * d * tk;               // (D, K)
        const auto g = cmap<S>(gp, n, tk);
        if constexpr (simd_products<S>) {  // gk += g·(s·table_q)ᵀ: the table scaled and transposed, (K, D)
            for (std::int64_t b = 0; b < tk; ++b)
                for (std::int64_t e = 0; e < d; ++e) tt[b * d + e] = plan.scale * tp[e * tk + b];
            simd_gemm(n, d, tk, gp, tk, 1, static_cast<const S*>(tt), d, gk.data(), gk.outerStride(), true);
        } else {
            gk.noalias() += plan.scale * (g * cmap<S>(tp, d, tk).transpose());
        }
        // Σ (k·s)ᵀ·g = s·kᵀ·g
        if (!t.grad) continue;
        S* const to = t.partial + slot * t.partial_stride;
        S* const dst = split ? t.plane_partial + (first * t.partial_stride) % per_line : to;
        if (split) std::fill(dst, dst + t.partial_stride, S(0));
        if constexpr (simd_products<S>) {  // dst holds zeros (only this writes a contextual q table's partial)
            simd_gemm(d, tk, n, plan.kv.plane(p), 1, plan.kv.sl, gp, tk, dst, tk);
            for (std::int64_t e = 0; e < d * tk; ++e) dst[e] *= plan.scale;
        } else {
            map<S>(dst, d, tk).noalias() += plan.scale * (plan.kv.rows(p, 0, n, d).transpose() * g);
        }
        if (split) std::copy(dst, dst + t.partial_stride, to);
    }
}

// Chunks of row blocks per plane in the backward: enough (plane, chunk) items for about 32
// threads, each with its own gradient accumulators summed in chunk order afterwards. Depends on
// the problem's shape only, never on the thread count or the memory budget.
inline std::int64_t backward_chunks(std::int64_t planes, std::int64_t blocks) {
    return std::clamp<std::int64_t>((32 + planes - 1) / planes, 1, blocks);
}

// The backward's chunking and its memory plan (attention_options::backward_budget_bytes). Items
// are (plane, chunk) pairs, item = plane·chunks + chunk; they run in waves of at most `slots`
// consecutive items, each item's partials in its wave slot. Either a wave holds whole planes
// (plane_slots of them, slots = plane_slots·chunks), or (split) a plane's chunks span several
// waves of one plane each and its per-(key, bucket) sums gather in one accumulator. A wave's
// slots of a buffer start at base + (first item · stride) mod (one 64-byte line), so every
// partial has the alignment it would have in one buffer of every item (Eigen's small products
// round by alignment): the bits do not depend on the budget, and equal those of one wave.
struct backward_layout {
    std::int64_t per_line = 1;  // elements of one 64-byte line (each buffer gets one more for the offsets)
    std::int64_t chunks = 1, blocks_per_chunk = 1, items = 0;
    std::int64_t slots = 0, plane_slots = 0;
    bool split = false;
    std::int64_t gq_stride = 0;    // per slot: per-(key, bucket) sums of the q tables, nq·L_k·K
    std::int64_t gkv_stride = 0;   // per slot: grad_k and grad_v partials, L·D each (chunks > 1)
    std::int64_t item_elems = 0;   // per slot, every partial (table partials included)
    std::int64_t plane_elems = 0;  // per plane in a wave: recomputed contextual q products, nq·L_k·K
    std::int64_t acc_elems = 0;    // split: one plane's accumulator of the per-(key, bucket) sums
    std::int64_t bytes = 0, min_bytes = 0, all_bytes = 0;
    // the offset of item (or plane) e's slot in a wave starting at e, for buffers of `stride`
    [[nodiscard]] std::int64_t phase(std::int64_t e, std::int64_t stride) const { return (e * stride) % per_line; }
};

// The layout of a backward over `in` (the shapes, terms and grad_tables of a checked call).
template <class S>
backward_layout backward_layout_of(const attention_inputs<S>& in, const attention_options& opt, bool saved_attn) {
    check_backward_budget(opt);
    backward_layout lay;
    // the partials' values: float for bf16 and f16 storage (their backward runs in float)
    using value_type = std::conditional_t<std::is_same_v<S, bf16> || std::is_same_v<S, f16>, float, S>;
    lay.per_line = std::max<std::int64_t>(1, 64 / static_cast<std::int64_t>(sizeof(value_type)));
    const std::int64_t planes = in.q.extent(0) * in.q.extent(1), n = in.q.extent(2), d = in.q.extent(3);
    const std::int64_t nkeys = in.k.extent(2);  // L_k
    std::int64_t k = 0, item = 0, grad_tables = 0, q_partials = 0, q_grad_tables = 0;
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        if (slot->term) k = std::max<std::int64_t>(k, slot->term->num_buckets());
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) {
        if (!slot->term) continue;
        const bool ctx = slot->term->contextual();
        const std::int64_t size = ctx ? d * slot->term->num_buckets() : slot->term->num_buckets();
        for (int t = 0; t < slot->term->num_tables(); ++t)
            if (static_cast<std::size_t>(t) < slot->grad_tables.size() && slot->grad_tables[static_cast<std::size_t>(t)].data) {
                item += size;
                ++grad_tables;
                if (ctx && slot == &in.rpe_q) q_partials += size, ++q_grad_tables;
            }
    }
    const bool ctx_q = in.rpe_q.term && in.rpe_q.term->contextual();
    const std::int64_t tq = ctx_q ? in.rpe_q.term->num_tables() * nkeys * k : 0;
    const std::int64_t rb = row_block_of(opt, n, nkeys), blocks = (n + rb - 1) / rb;
    lay.chunks = planes > 0 ? backward_chunks(planes, blocks) : 1;
    lay.blocks_per_chunk = (blocks + lay.chunks - 1) / lay.chunks;
    lay.items = planes * lay.chunks;
    lay.gq_stride = tq;
    lay.gkv_stride = lay.chunks > 1 ? nkeys * d : 0;
    lay.item_elems = item + lay.gq_stride + 2 * lay.gkv_stride;
    lay.plane_elems = ctx_q && !saved_attn ? tq : 0;
    // one line more per buffer: the per-slot buffers, the products; split also the accumulator
    // and the contextual q table partials of the plane
    const std::int64_t buffers = grad_tables + (ctx_q ? 1 : 0) + (lay.chunks > 1 ? 2 : 0) + (lay.plane_elems > 0 ? 1 : 0);
    const std::int64_t pad_whole = buffers * lay.per_line, pad_split = (buffers + 1 + q_grad_tables) * lay.per_line;
    const std::int64_t elem = static_cast<std::int64_t>(sizeof(value_type)), budget = opt.backward_budget_bytes / elem;
    const std::int64_t per_plane = lay.chunks * lay.item_elems + lay.plane_elems;
    // split: one plane's products, accumulator and contextual q table partials
    const std::int64_t split_fixed = lay.plane_elems + lay.gq_stride + q_partials + pad_split;
    lay.all_bytes = (planes * per_plane + pad_whole) * elem;
    const std::int64_t whole_min = per_plane + pad_whole, split_min = lay.item_elems + split_fixed;
    lay.min_bytes = (lay.chunks > 1 ? std::min(whole_min, split_min) : whole_min) * elem;
    // whole planes (at least one) when one fits, or when splitting a plane would not take less
    if (per_plane == 0 || whole_min <= budget || lay.chunks == 1 || whole_min <= split_min) {
        lay.plane_slots = per_plane == 0
                              ? std::max<std::int64_t>(planes, 1)
                              : std::clamp<std::int64_t>((budget - pad_whole) / per_plane, 1, std::max<std::int64_t>(planes, 1));
        lay.slots = lay.plane_slots * lay.chunks;
        lay.bytes = (lay.plane_slots * per_plane + pad_whole) * elem;
    } else {  // one plane's chunks in several waves
        lay.split = true;
        lay.plane_slots = 1;
        lay.acc_elems = lay.gq_stride;
        lay.slots = std::clamp<std::int64_t>((budget - split_fixed) / lay.item_elems, 1, lay.chunks - 1);
        lay.bytes = (lay.slots * lay.item_elems + split_fixed) * elem;
    }
    return lay;
}

// attn: the forward's (B, H, L, L_k) probabilities, or empty to recompute them block by block.
// grad_out, grad_q: (B, H, L, D); grad_k, grad_v: (B, H, L_k, D); rows of D contiguous (a packed image's views).
template <class S, class Id>
void fused_backward(const attention_inputs<S>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<const S> attn,
                    tensor_ref<const S> grad_out, tensor_ref<S> grad_q, tensor_ref<S> grad_k, tensor_ref<S> grad_v,
                    const attention_options& opt) {
    auto plan = make_plan<S, Id>(in, ids, true, opt);
    const cpu::plane_rows<S> gov(grad_out);
    const cpu::plane_rows_mut<S> gqv(grad_q), gkv(grad_k), gvv(grad_v);
    using cpu::cmap;
    using cpu::map;
    // n: queries (and the key-order ids' stride); nkeys: keys and values (and the id rows' stride)
    const std::int64_t n = plan.l, nkeys = plan.lk, d = plan.d, k = plan.k, rb_max = plan.rb, planes = plan.b * plan.h;
    const std::int64_t nq = static_cast<std::int64_t>(plan.on_q.size());
    const std::int64_t tq_per_plane = nq * nkeys * k;
    auto table_size = [&](const fused_table<S, Id>& t) { return t.bias ? t.k : d * t.k; };
    const bool ctx_q = has_contextual_query(plan);
    // the contextual q products feed the recomputed probabilities only (none when attn is given)
    const bool recompute_tq = ctx_q && attn.data == nullptr;
    const backward_layout lay = backward_layout_of(in, opt, attn.data != nullptr);
    const std::int64_t chunks = lay.chunks, blocks_per_chunk = lay.blocks_per_chunk, items = lay.items;
    // Per-slot accumulators (lay): table gradient partials and, with several chunks per plane,
    // grad_k / grad_v partials (L, D); one chunk writes grad_k / grad_v in place.
    // every buffer is laid out here, in the calling thread's workspace, before the parallel region
    cpu::workspace ws;
    std::vector<cpu::shared_scratch<S>> partial_s;
    for (auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
        for (auto& t : *group) {
            t.partial_stride = t.grad ? table_size(t) : 0;
            partial_s.emplace_back(ws, t.grad ? lay.slots * t.partial_stride + lay.per_line : 0);
            const bool plane_partial = lay.split && t.grad && !t.bias && group == &plan.on_q;
            partial_s.emplace_back(ws, plane_partial ? t.partial_stride + lay.per_line : 0);
        }
    // each buffer one line longer: a wave's slots start within its first line (backward_layout)
    const auto padded = [&](std::int64_t count) { return count > 0 ? count + lay.per_line : 0; };
    cpu::shared_scratch<S> gk_part(ws, padded(lay.slots * lay.gkv_stride)), gv_part(ws, padded(lay.slots * lay.gkv_stride));
    cpu::shared_scratch<S> gq_part(ws, padded(lay.slots * lay.gq_stride)), gq_acc(ws, padded(lay.acc_elems));
    cpu::shared_scratch<S> tq_s(ws, padded(lay.plane_slots * lay.plane_elems));
    cpu::thread_scratch<S> ks_s(ws, recompute_tq ? nkeys * d : 0);
    // The forward's layout (fused_forward): contextual key tables folded into the logits' product,
    // per plane [k; table_kᵀ] (nk + ΣK, D) in a per-thread buffer, so that the recomputed logits
    // and probabilities are the forward's; lg's and dp's rows ld = lg_stride(nk, ΣK) apart (the
    // forward's, value tables counted). dp's columns past nk then take the key tables' per-bucket
    // sums of dlogits, so that one product [dlogits | sums]·[k; table_kᵀ] gives dq.
    std::int64_t kx_cols = 0, vx_cols = 0;
    for (const auto& t : plan.on_k) kx_cols += t.bias ? 0 : t.k;
    for (const auto& t : plan.on_v) vx_cols += t.k;
    const bool fold = kx_cols > 0;
    const std::int64_t ld_max = lg_stride(nkeys, std::max(kx_cols, vx_cols));
    // contextual query tables (AVX-512F float): key-order ids, for the recomputed logits' lookups
    // per key (as the forward) and the per-(key, bucket) sums of dlogits accumulated per key
    bool q_lookup = false;
#if defined(__AVX512F__)
    q_lookup = std::is_same_v<S, float> && ctx_q && n * nkeys * static_cast<std::int64_t>(sizeof(Id)) <= materialise_ids_bytes;
#endif
    const std::int64_t nq_ctx = std::count_if(plan.on_q.begin(), plan.on_q.end(), [](const auto& t) { return !t.bias; });
    cpu::shared_scratch<Id> qid_s(ws, q_lookup ? nq_ctx * n * nkeys : 0);
    // rows per chunk of the per-key sums (a multiple of 16, at least the lookups' query_chunk): the
    // four partial sums of a key's row are cleared and added once per chunk
    constexpr std::int64_t sum_chunk = 64;
    static_assert(sum_chunk >= block_layout<S, Id>::query_chunk && sum_chunk % 16 == 0);
    cpu::thread_scratch<S> g_s(ws, q_lookup ? nkeys * sum_chunk : 0);
    cpu::thread_scratch<S> kx_s(ws, fold ? ld_max * d : 0), part_s(ws, 8 * std::max<std::int64_t>(k, 1));
    // simd products: the transposed keys [kᵀ | table_k] per plane, as the forward's (its probabilities' bits)
    cpu::thread_scratch<S> kt_s(ws, simd_products<S> ? d * kt_stride(nkeys, kx_cols) : 0);
    // [vᵀ | table_vᵀ] (D, nk + ΣK) of the plane (transposed_operand)
    cpu::thread_scratch<S> vt_s(ws, simd_products<S> ? d * kt_stride(nkeys, vx_cols) : 0);
    cpu::thread_scratch<S> tt_s(ws, simd_products<S> && ctx_q ? d * k : 0);  // plane_query_gradients' scaled table_qᵀ
    cpu::thread_scratch<S> lg_s(ws, rb_max * ld_max), dp_s(ws, rb_max * ld_max),
        work_s(ws, 2 * rb_max * std::max<std::int64_t>(k, 1));
    cpu::thread_scratch<S> qs_s(ws, rb_max * d), dqs_s(ws, rb_max * d);
    cpu::thread_scratch<Id> ids_s(ws, plan.tables * rb_max * nkeys);
    cpu::thread_scratch<const Id*> blk_s(ws, plan.tables);
    // RoPE: rotated keys; rope::mixed with grad_freqs: angle gradients (B·H, grid tokens, D/2)
    const bool rope_freqs = plan.rope && in.rope.grad_freqs.data != nullptr;
    const std::int64_t rope_n = plan.rope ? plan.rope->tokens : 0, rope_pairs = d / 2;
    // keys at their own positions: their angle gradients apart (their tokens' coordinates differ)
    const bool rope_k_apart = rope_freqs && plan.rope_k != plan.rope;
    const std::int64_t rope_nk = plan.rope_k ? plan.rope_k->tokens : 0;
    cpu::shared_scratch<S> kr_s(ws, plan.rope ? planes * nkeys * d : 0), ga_s(ws, rope_freqs ? planes * rope_n * rope_pairs : 0);
    cpu::shared_scratch<S> gak_s(ws, rope_k_apart ? planes * rope_nk * rope_pairs : 0);
    const auto ga_k = [&] { return rope_k_apart ? gak_s.data() : ga_s.data(); };  // after the workspace's allocate()
    const auto full_ids = declare_full_ids(plan, ws);
    ws.allocate();
    materialise_ids(plan, full_ids);
    rotate_keys(plan, kr_s.data());
    std::vector<const Id*> qid(plan.on_q.size(), nullptr);  // per on_q table: key-order ids, or null
    if (q_lookup)
        for (std::size_t t = 0, next = 0; t < plan.on_q.size(); ++t) {
            if (plan.on_q[t].bias) continue;
            Id* dst = qid_s.data() + static_cast<std::int64_t>(next++) * n * nkeys;
            cpu::key_order_ids(plan.on_q[t].rows, n, nkeys, dst);
            qid[t] = dst;
        }
    if (rope_freqs) std::fill(ga_s.data(), ga_s.data() + ga_s.count, S(0));
    if (rope_k_apart) std::fill(gak_s.data(), gak_s.data() + gak_s.count, S(0));
    std::size_t next = 0;
    for (auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
        for (auto& t : *group) {
            t.partial_base = t.grad ? partial_s[next].data() : nullptr;
            t.plane_partial = partial_s[next + 1].empty() ? nullptr : partial_s[next + 1].data();
            next += 2;
            if (t.grad) std::fill(t.grad, t.grad + t.table_heads * table_size(t), S(0));
        }
    for (std::int64_t i0 = 0; i0 < items;) {  // one wave: items [i0, i1) of planes [p0, p1)
        const std::int64_t p0 = i0 / chunks;
        const std::int64_t i1 = std::min({items, i0 + lay.slots, lay.split ? (p0 + 1) * chunks : items});
        const std::int64_t p1 = (i1 - 1) / chunks + 1;
        // the wave's slots: each partial at the alignment of its item in one buffer of every item
        S* const gq_w = gq_part.data() + lay.phase(i0, lay.gq_stride);
        S* const gk_w = gk_part.data() + lay.phase(i0, lay.gkv_stride);
        S* const gv_w = gv_part.data() + lay.phase(i0, lay.gkv_stride);
        S* const tq = tq_s.data() + lay.phase(p0, lay.plane_elems);
        for (auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
            for (auto& t : *group)
                if (t.grad) {
                    t.partial = t.partial_base + lay.phase(i0, t.partial_stride);
                    std::fill(t.partial, t.partial + (i1 - i0) * t.partial_stride, S(0));
                }
        if (ctx_q) std::fill(gq_w, gq_w + (i1 - i0) * lay.gq_stride, S(0));
#if defined(_OPENMP)
#pragma omp parallel
#endif
        {
            S *lg = lg_s.mine(), *dp = dp_s.mine(), *work = work_s.mine(), *qs = qs_s.mine(), *dqs = dqs_s.mine();
            S *kx = kx_s.mine(), *part = part_s.mine(), *kt = kt_s.mine(), *vt = vt_s.mine();
            Id* idbuf = ids_s.mine();
            const Id** blk = blk_s.mine();
            std::int64_t kx_plane = -1;  // the plane whose [k; table_kᵀ] kx holds: none yet
            block_layout<S, Id> bl;
            bl.g = g_s.mine();
            bl.qid = q_lookup ? qid.data() : nullptr;
            // the contextual q products of the planes that start in this wave (kept while their chunks last)
            if (recompute_tq) {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
                for (std::int64_t p = p0; p < p1; ++p)
                    if (p * chunks >= i0) plane_query_products(plan, p, ks_s.mine(), tq + (p - p0) * lay.plane_elems);
            }
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
            for (std::int64_t item = i0; item < i1; ++item) {
                const std::int64_t slot = item - i0, p = item / chunks, c = item % chunks, h = p % plan.h;
                const S* tqp = recompute_tq ? tq + (p - p0) * lay.plane_elems : nullptr;
                S* gq = ctx_q ? gq_w + slot * lay.gq_stride : nullptr;  // Σ dlogits per (j, bucket), contextual q tables
                auto gk_all = chunks > 1 ? cpu::map_strided<S>(gk_w + slot * lay.gkv_stride, nkeys, d, Eigen::OuterStride<>(d))
                                         : gkv.rows(p, 0, nkeys, d);
                auto gv_all = chunks > 1 ? cpu::map_strided<S>(gv_w + slot * lay.gkv_stride, nkeys, d, Eigen::OuterStride<>(d))
                                         : gvv.rows(p, 0, nkeys, d);
                // keys >= nk are padding (key_lengths): not computed, their gradient rows stay zero;
                // rows < nk: assigned by the chunk's first row block (the products' own zeroing,
                // not a pass of its own over the (L_k, D) gradients), then accumulated
                const std::int64_t nk = plan.keys(p);
                const std::int64_t i_first = c * blocks_per_chunk * rb_max,
                                   i_end = std::min(n, (c + 1) * blocks_per_chunk * rb_max);
                if (i_first >= i_end) {
                    gk_all.setZero();
                    gv_all.setZero();
                } else {
                    gk_all.bottomRows(nkeys - nk).setZero();
                    gv_all.bottomRows(nkeys - nk).setZero();
                }
                // ld: lg's and dp's row stride (the forward's); lg holds the block's probabilities
                // (given ones are copied into it)
                const std::int64_t ld = lg_stride(nk, std::max(kx_cols, vx_cols));
                auto gk = gk_all.topRows(nk);
                auto gv = gv_all.topRows(nk);
                const auto vp = plan.vv.rows(p, 0, nk, d);
                const auto kp = plan.kv.rows(p, 0, nk, d);
                constexpr bool sp = simd_products<S>;
                const std::int64_t ldt = kt_stride(nk, kx_cols);
                const std::int64_t ldv = kt_stride(nk, vx_cols);
                if (sp && kx_plane != p) {
                    if (!attn.data) transposed_operand(plan, p, false, plan.kv.plane(p), plan.kv.sl, nk, kt, ldt);
                    transposed_operand(plan, p, true, plan.vv.plane(p), plan.vv.sl, nk, vt, ldv);
                }
                if (fold && kx_plane != p) {  // kx = [k; table_kᵀ] of this plane (rotated k with RoPE), zero rows up to ld
                    map<S>(kx, nk, d) = kp;
                    std::int64_t col = nk;
                    for (const auto& t : plan.on_k)
                        if (!t.bias) {
                            map<S>(kx + col * d, t.k, d) = cmap<S>(t.table + t.head(h) * d * t.k, d, t.k).transpose();
                            col += t.k;
                        }
                    std::fill(kx + col * d, kx + ld * d, S(0));
                }
                kx_plane = p;
                bl.ld = ld;
                bl.folded_k = fold;
                for (std::int64_t i0r = i_first; i0r < i_end; i0r += rb_max) {
                    const std::int64_t rb = std::min(rb_max, n - i0r);
                    const bool first = i0r == i_first;
                    load_block_ids(plan, i0r, rb, idbuf, blk);
                    plan.load_queries(p, i0r, rb, qs);
                    if (attn.data) {
                        // the saved rows, copied: one sequential read of memory the forward wrote
                        // long before (the products then read them from cache, not from memory
                        // in their packing's strided order)
                        const S* src = attn.data + (p * n + i0r) * nkeys;
                        for (std::int64_t i = 0; i < rb; ++i) std::copy_n(src + i * nkeys, nk, lg + i * ld);
                    } else {  // the forward's logits: with the fold, one product gives qs·kᵀ and qs·table_k
                        if constexpr (sp)
                            simd_gemm(rb, nk + kx_cols, d, static_cast<const S*>(qs), d, 1, static_cast<const S*>(kt), ldt, lg,
                                      ld);
                        else if (fold)
                            map<S>(lg, rb, ld).noalias() = cmap<S>(qs, rb, d) * cmap<S>(kx, ld, d).transpose();
                        block_probabilities(plan, in, p, i0r, rb, qs, tqp, blk, lg, work, sp || fold,
                                            static_cast<const S*>(nullptr), &bl);
                    }
                    const auto P = cpu::cmap_strided<S>(lg, rb, nk, Eigen::OuterStride<>(ld));
                    const auto go = gov.rows(p, i0r, rb, d);
                    auto dP = cpu::map_strided<S>(dp, rb, nk, Eigen::OuterStride<>(ld));
                    if constexpr (sp) {  // dp = go·[vᵀ | table_vᵀ]: the value terms' go·table_vᵀ past column nk
                        simd_gemm(rb, nk + vx_cols, d, go.data(), gov.sl, 1, static_cast<const S*>(vt), ldv, dp, ld);
                        simd_gemm(nk, d, rb, static_cast<const S*>(lg), 1, ld, go.data(), gov.sl, gv.data(), gv.outerStride(),
                                  !first);
                    } else {
                        dP.noalias() = go * vp.transpose();
                        if (first)
                            gv.noalias() = P.transpose() * go;
                        else
                            gv.noalias() += P.transpose() * go;
                    }
                    std::int64_t vcol = nk;  // simd: the value table's go·table_vᵀ in dp's columns from vcol
                    for (auto& t : plan.on_v) {
                        const Id* idb = blk[t.slot];
                        const std::int64_t tk = t.k;
                        if constexpr (sp) {
                            for (std::int64_t i = 0; i < rb; ++i)
                                cpu::gather_add(dp + i * ld, dp + i * ld + vcol, tk, idb + i * nkeys, nk);
                            vcol += tk;
                        } else {
                            const auto tab = cmap<S>(t.table + t.head(h) * tk * d, tk, d);
                            map<S>(work, rb, tk).noalias() = go * tab.transpose();
                            for (std::int64_t i = 0; i < rb; ++i)
                                cpu::gather_add(dp + i * ld, work + i * tk, tk, idb + i * nkeys, nk);
                        }
                        if (t.grad) {  // per-bucket sums of the probabilities, branch-free
                            cpu::scatter_rows4(lg, ld, idb, nkeys, rb, nk, tk, part, work);
                            if constexpr (sp)
                                simd_gemm(tk, d, rb, static_cast<const S*>(work), 1, tk, go.data(), gov.sl,
                                          t.partial + slot * t.partial_stride, d, true);
                            else
                                map<S>(t.partial + slot * t.partial_stride, tk, d).noalias() +=
                                    cmap<S>(work, rb, tk).transpose() * go;
                        }
                    }
                    // softmax backward: dlogits = P ⊙ (dP − Σ_j dP ⊙ P), in dp
                    for (std::int64_t i = 0; i < rb; ++i) cpu::softmax_backward_row(lg + i * ld, dp + i * ld, nk);
                    const cpu::cmap_strided<S> dL(dp, rb, nk, Eigen::OuterStride<>(ld));
                    if constexpr (sp)
                        simd_gemm(nk, d, rb, static_cast<const S*>(dp), 1, ld, static_cast<const S*>(qs), d, gk.data(),
                                  gk.outerStride(), !first);
                    else if (first)
                        gk.noalias() = dL.transpose() * cmap<S>(qs, rb, d);
                    else
                        gk.noalias() += dL.transpose() * cmap<S>(qs, rb, d);
                    // contextual key tables (folded): per-bucket sums of dlogits (rb, K) into dp's
                    // columns past nk, for dq (below) and the table partials qsᵀ·sums
                    std::int64_t col = nk;
                    for (auto& t : plan.on_k) {
                        const Id* idb = blk[t.slot];
                        const std::int64_t tk = t.k;
                        if (t.bias) {
                            if (t.grad)
                                cpu::scatter_sum4(dp, ld, idb, nkeys, rb, nk, tk, part, t.partial + slot * t.partial_stride);
                            continue;
                        }
                        cpu::scatter_rows4(dp, ld, idb, nkeys, rb, nk, tk, part, dp + col, ld);
                        if (t.grad) {
                            if constexpr (sp)
                                simd_gemm(d, tk, rb, static_cast<const S*>(qs), 1, d, static_cast<const S*>(dp + col), ld,
                                          t.partial + slot * t.partial_stride, tk, true);
                            else
                                map<S>(t.partial + slot * t.partial_stride, d, tk).noalias() +=
                                    cmap<S>(qs, rb, d).transpose() *
                                    cpu::cmap_strided<S>(dp + col, rb, tk, Eigen::OuterStride<>(ld));
                        }
                        col += tk;
                    }
                    auto dq = map<S>(dqs, rb, d);
                    if (nk == 0) {
                        dq.setZero();           // every key padded: no logit depends on the queries
                    } else if constexpr (sp) {  // dq = [dlogits | sums]·[k; table_kᵀ], or dlogits·k
                        if (fold)
                            simd_gemm(rb, d, col, static_cast<const S*>(dp), ld, 1, static_cast<const S*>(kx), d, dqs, d);
                        else
                            simd_gemm(rb, d, nk, static_cast<const S*>(dp), ld, 1, plan.kv.plane(p), plan.kv.sl, dqs, d);
                    } else if (fold) {  // dq = [dlogits | sums | 0]·[k; table_kᵀ; 0]
                        for (std::int64_t i = 0; i < rb; ++i) std::fill(dp + i * ld + col, dp + (i + 1) * ld, S(0));
                        dq.noalias() = cmap<S>(dp, rb, ld) * cmap<S>(kx, ld, d);
                    } else {
                        dq.noalias() = dL * kp;  // (no contextual key tables)
                    }
                    for (std::size_t q = 0; q < plan.on_q.size(); ++q) {
                        auto& t = plan.on_q[q];
                        const Id* idb = blk[t.slot];  // [i, j] holds id(j, i)
                        const std::int64_t tk = t.k;
                        S* acc = t.bias ? (t.grad ? t.partial + slot * t.partial_stride : nullptr)
                                        : gq + static_cast<std::int64_t>(q) * nkeys * k;
                        if (!acc) continue;
                        if (t.bias) {
                            cpu::scatter_sum4(dp, ld, idb, nkeys, rb, nk, tk, part, acc);
                            continue;
                        }
#if defined(__AVX512F__)
                        if constexpr (std::is_same_v<S, float>)
                            if (q_lookup) {  // per key j its row of acc, from dlogits in key order (chunks of
                                             // sum_chunk rows) and the key-order ids: acc's row stays in L1
                                for (std::int64_t c0 = 0; c0 < rb; c0 += sum_chunk) {
                                    const std::int64_t cr = std::min(sum_chunk, rb - c0);
                                    cpu::simd::transpose_into(dp + c0 * ld, ld, cr, nk, bl.g, sum_chunk);
                                    // key j: row j of bl.g, ids qid[q][j·n + i0r + c0 …], added to acc's row j
                                    cpu::scatter_rows4<true>(bl.g, sum_chunk, qid[q] + i0r + c0, n, nk, cr, tk, part, acc, tk);
                                }
                                continue;
                            }
#endif
                        // keys j of a row hit different rows of acc: no store-to-load chains, no branch
                        for (std::int64_t i = 0; i < rb; ++i)
                            for (std::int64_t j = 0; j < nk; ++j) acc[j * tk + idb[i * nkeys + j]] += dp[i * ld + j];
                    }
                    // RoPE is not combined with packed images: with it, grad_q is contiguous
                    S* gq_rows = gqv.plane(p) + i0r * gqv.sl;
                    if (plan.rope) {  // dq is the gradient of the rotated, scaled queries qs
                        if (rope_freqs)
                            cpu::rope_angle_grad_rows(rope_pairs, plan.rope_skip, i0r, rb, qs, dqs,
                                                      ga_s.data() + p * rope_n * rope_pairs, plan.rope->layout, rope_n);
                        cpu::rope_rotate_rows(*plan.rope, h, plan.rope_skip, i0r, rb, d, dqs, gq_rows, plan.scale, true);
                    } else {
                        gqv.rows(p, i0r, rb, d) = dq * plan.scale;
                    }
                }
            }
            // Per plane: this wave's chunk partials added in chunk order; once the plane's last
            // chunk is in, the contextual q terms' key gradients and table partials from the
            // summed per-(key, bucket) sums.
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
            for (std::int64_t p = p0; p < p1; ++p) {
                const std::int64_t h = p % plan.h;
                const std::int64_t c0 = std::max(i0, p * chunks) - p * chunks, c1 = std::min(i1, (p + 1) * chunks) - p * chunks;
                const auto slot_of = [&](std::int64_t c) { return p * chunks + c - i0; };
                auto gk = gkv.rows(p, 0, nkeys, d);
                if (chunks > 1) {
                    auto gv = gvv.rows(p, 0, nkeys, d);
                    for (std::int64_t c = c0; c < c1; ++c) {
                        const auto pk = map<S>(gk_w + slot_of(c) * lay.gkv_stride, nkeys, d);
                        const auto pv = map<S>(gv_w + slot_of(c) * lay.gkv_stride, nkeys, d);
                        if (c == 0) {
                            gk = pk;
                            gv = pv;
                        } else {
                            gk += pk;
                            gv += pv;
                        }
                    }
                }
                S* gq = nullptr;  // the plane's summed per-(key, bucket) sums
                if (ctx_q) {
                    // split: the accumulator at the alignment of the plane's first chunk (its place in one wave)
                    gq = lay.split ? gq_acc.data() + lay.phase(p * chunks, lay.gq_stride) : gq_w + slot_of(0) * lay.gq_stride;
                    for (std::int64_t c = c0; c < c1; ++c) {
                        const S* src = gq_w + slot_of(c) * lay.gq_stride;
                        if (c == 0) {
                            if (src != gq) std::copy(src, src + tq_per_plane, gq);
                        } else {
                            for (std::int64_t e = 0; e < tq_per_plane; ++e) gq[e] += src[e];
                        }
                    }
                }
                if (c1 < chunks) continue;  // the plane's later chunks come in the next wave
                if (ctx_q)
                    plane_query_gradients(plan, gq, p, slot_of(lay.split ? chunks - 1 : 0), lay.split, p * chunks, lay.per_line,
                                          gk, tt_s.mine());
                if (plan.rope) {  // gk is the gradient of the rotated keys: rotate it back (contiguous grad_k with RoPE)
                    S* g = gkv.plane(p);
                    if (rope_freqs)
                        cpu::rope_angle_grad_rows(rope_pairs, plan.rope_skip, 0, nkeys, plan.kv.plane(p), g,
                                                  ga_k() + p * rope_nk * rope_pairs, plan.rope_k->layout, rope_nk);
                    cpu::rope_rotate_rows(*plan.rope_k, h, plan.rope_skip, 0, nkeys, d, g, g, S(1), true);
                }
            }
        }
        // Table gradients: this wave's partials added in item order (the same sums for every
        // budget and thread count), each into the table head of its plane.
        for (auto* group : {&plan.on_q, &plan.on_k, &plan.on_v})
            for (auto& t : *group) {
                if (!t.grad) continue;
                const std::int64_t size = table_size(t);
                for (std::int64_t e = i0; e < i1; ++e) {
                    S* dst = t.grad + (t.table_heads == 1 ? 0 : (e / chunks) % plan.h) * size;
                    const S* src = t.partial + (e - i0) * t.partial_stride;
                    for (std::int64_t x = 0; x < size; ++x) dst[x] += src[x];
                }
            }
        i0 = i1;
    }
    if (rope_freqs) cpu::rope_frequency_grad(*plan.rope, planes, plan.h, ga_s.data(), in.rope.grad_freqs.data);
    if (rope_k_apart) cpu::rope_frequency_grad(*plan.rope_k, planes, plan.h, gak_s.data(), in.rope.grad_freqs.data, true);
}

template <class S, class F>
void dispatch_ids(const attention_inputs<S>& in, id_storage storage, F&& f) {
    std::shared_ptr<const bucket_ids> ids[3] = {ids_of(in.rpe_q, in, storage), ids_of(in.rpe_k, in, storage),
                                                ids_of(in.rpe_v, in, storage)};
    int width = 1;
    for (const auto& i : ids)
        if (i) width = std::max(width, i->id_bytes());
    visit_id_width(width, [&]<class Id>() { f.template operator()<Id>(ids); });
}

// Packed sequences (attention_inputs::packed): each image runs as if alone on its views of q, k,
// v, out and the masks (its token range), with its own ids (its grid's, from the cache, or its
// positions'); nothing is computed for pairs of two images. The forward runs every image's items
// in one parallel region; the backward runs the images one after another.
template <class S>
void packed_forward(const attention_inputs<S>& in, tensor_ref<S> out, const attention_options& opt) {
    const auto images = packed_images(in);
    std::vector<std::array<std::shared_ptr<const bucket_ids>, 3>> ids(images.size());
    int width = 1;  // one id type for every image (the widest)
    for (std::size_t m = 0; m < images.size(); ++m) {
        const auto& c = images[m].in;
        ids[m] = {ids_of(c.rpe_q, c, opt.storage), ids_of(c.rpe_k, c, opt.storage), ids_of(c.rpe_v, c, opt.storage)};
        for (const auto& i : ids[m])
            if (i) width = std::max(width, i->id_bytes());
    }
    std::vector<forward_part<S>> parts;
    for (std::size_t m = 0; m < images.size(); ++m)
        parts.push_back({&images[m].in, ids[m].data(), token_slice(out, {2}, images[m].offset, images[m].length)});
    visit_id_width(width, [&]<class Id>() { fused_forward<S, Id>(parts, {}, opt); });
}

// The backward of packed_forward: each image's gradients into its rows. Images with fewer
// (batch, head, chunk) items than threads run side by side, one thread each (after the larger
// ones, which share the threads as a call of their own): every image's results are those of a call
// on it alone, whatever thread runs it. The table gradients go to one buffer per image, summed in
// image order at the end, so the results do not depend on the thread count.
template <class S>
void packed_backward(const attention_inputs<S>& in, const attention_gradients<S>& g, const attention_options& opt) {
    auto images = packed_images(in);
    const std::size_t count = images.size();
    std::vector<std::array<std::shared_ptr<const bucket_ids>, 3>> ids(count);
    for (std::size_t m = 0; m < count; ++m) {  // every image's ids first: a bad grid throws before any write
        const auto& c = images[m].in;
        ids[m] = {ids_of(c.rpe_q, c, opt.storage), ids_of(c.rpe_k, c, opt.storage), ids_of(c.rpe_v, c, opt.storage)};
    }
    // the table gradients wanted, and one buffer of each per image
    std::vector<tensor_ref<S>> wanted;
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->grad_tables)
            if (t.data) wanted.push_back(t);
    std::int64_t per_image = 0;
    for (const auto& t : wanted) per_image += t.size();
    std::vector<S> table_grads(static_cast<std::size_t>(per_image) * count);
    for (std::size_t m = 0; m < count; ++m) {
        S* next = table_grads.data() + static_cast<std::int64_t>(m) * per_image;
        for (auto* slot : {&images[m].in.rpe_q, &images[m].in.rpe_k, &images[m].in.rpe_v})
            for (auto& t : slot->grad_tables)
                if (t.data) {
                    t = tensor_ref<S>(next, std::span<const std::int64_t>(t.shape.data(), static_cast<std::size_t>(t.rank)));
                    next += t.size();
                }
    }
    const auto run = [&](std::size_t m, const attention_options& o) {
        const auto& img = images[m];
        const auto rows = [&](auto t) { return token_slice(t, {2}, img.offset, img.length); };
        int width = 1;
        for (const auto& i : ids[m])
            if (i) width = std::max(width, i->id_bytes());
        visit_id_width(width, [&]<class Id>() {
            fused_backward<S, Id>(img.in, ids[m].data(), {}, rows(g.grad_out), rows(g.grad_q), rows(g.grad_k), rows(g.grad_v), o);
        });
    };
    const int threads = cpu::max_threads();
    std::vector<std::size_t> small;  // images of fewer items than threads
    for (std::size_t m = 0; m < count; ++m) {
        if (threads > 1 && backward_layout_of(images[m].in, opt, false).items < threads)
            small.push_back(m);
        else
            run(m, opt);
    }
    if (!small.empty()) {
        // side by side, each within its share of the partials budget (the same results for every budget)
        attention_options o = opt;
        o.backward_budget_bytes = std::max<std::int64_t>(1, opt.backward_budget_bytes / threads);
        std::vector<std::exception_ptr> errors(small.size());
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1)
#endif
        for (std::size_t i = 0; i < small.size(); ++i) {
            try {
#if defined(_OPENMP)
                // this thread's task only: its nested regions (one thread) and Eigen's products see
                // one thread, as in a call on one thread. Otherwise Eigen takes its parallel product
                // path there (omp_get_num_threads() is 1, omp_get_max_threads() is not), blocked for
                // that many threads, and the bits depend on the thread count.
                omp_set_num_threads(1);
#endif
                run(small[i], o);  // its own parallel regions are nested: one thread
            } catch (...) {
                errors[i] = std::current_exception();
            }
        }
        for (const auto& e : errors)
            if (e) std::rethrow_exception(e);
    }
    for (std::size_t w = 0, off = 0; w < wanted.size(); off += static_cast<std::size_t>(wanted[w].size()), ++w)
        for (std::size_t m = 0; m < count; ++m) {
            const S* src = table_grads.data() + static_cast<std::int64_t>(m) * per_image + static_cast<std::int64_t>(off);
            S* dst = wanted[w].data;
            for (std::int64_t e = 0; e < wanted[w].size(); ++e) dst[e] = m == 0 ? src[e] : dst[e] + src[e];
        }
}

// The forward on rpe::bf16 storage (defined in attention_bf16.hpp, included at the end through
// attention_half.hpp).
template <class Id>
void fused_forward_bf16(const attention_inputs<bf16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<bf16> out,
                        tensor_ref<bf16> attn, const attention_options& opt);
// packed_forward on rpe::bf16 storage (attention_bf16.hpp): the portable path (attention_half.hpp).
inline void packed_forward_bf16(const attention_inputs<bf16>& in, tensor_ref<bf16> out, const attention_options& opt);
// The backward on rpe::bf16 storage (attention_bf16.hpp, over attention_half.hpp): in float, the
// gradients rounded once.
inline void fused_backward_bf16(const attention_inputs<bf16>& in, const attention_gradients<bf16>& g,
                                const attention_options& opt);
// The forward, packed forward and backward on rpe::f16 storage (attention_f16.hpp, over
// attention_half.hpp): in float, each output rounded to f16 once.
template <class Id>
void fused_forward_f16(const attention_inputs<f16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<f16> out,
                       tensor_ref<f16> attn, const attention_options& opt);
inline void packed_forward_f16(const attention_inputs<f16>& in, tensor_ref<f16> out, const attention_options& opt);
inline void fused_backward_f16(const attention_inputs<f16>& in, const attention_gradients<f16>& g, const attention_options& opt);

}  // namespace RPE_ISA_NS
}  // namespace detail

namespace cpu {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

/// @brief Fused forward of the attention step (reference `RPEAttention.forward`): `qs = q·s`,
/// `s = opt.scale` (default `D^−½`);
/// `logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·s) + attn_mask`, key padding mask (−∞), softmax over
/// keys, `out = a·v + rpe_v(a)` — equal to composed_attention_forward, computed per (batch, head)
/// and row block so that no (B, H, L, L) buffer exists unless `attn` is requested.
///
/// The contextual q/k terms use per-bucket products (qs·table per row block: rows·D·K; k·s·table
/// per head: L·D·K), the value term per-bucket sums of probabilities then one product, the bias
/// terms a gather. With `in.rope` (rpe::rotary_embedding), each query row block is rotated as it
/// is loaded (with the scaling) and each plane's keys just before its blocks into a per-thread
/// (L, D) buffer (with contextual q terms: once per call into a (B, H, L, D) copy), from a
/// cos/sin table (grid tokens, D/2) built once and cached (per grid; rope::mixed per frequency
/// values, per-token positions per their values: rpe::rope_table_of); the terms then see the rotated q and k (equal to rpe::rope_forward on q and k, then this call). Rows whose keys are all masked give zero probabilities and zero output (the
/// reference gives NaN); a NaN logit makes its row NaN. With `in.packed` (rpe::packed_sequences)
/// each image is computed alone on its rows (block-diagonal; no `attn` output); with
/// `in.key_lengths` only the first key_lengths[b] keys of batch element b are computed (the rest
/// padded, as by key_padding_mask). See docs/positions.md.
/// @param in   q (B, H, L, D), k, v (B, H, L_k, D) (L_k = L in self-attention; any L_k without
///   terms or packing: cross-attention, KV caches), contiguous or strided views with rows of D
///   contiguous (read in place, e.g. from a packed (B, L, 3, H, D) qkv), grid, optional terms and
///   masks (see attention_inputs).
/// @param out  (B, H, L, D), written.
/// @param attn (B, H, L, L_k) probabilities, written only when non-empty; pass `{}` otherwise.
/// @param opt  softmax scale, row block, id storage (attention_options; the stream is ignored).
/// @throws rpe::invalid_argument `[rpe.attention] ...` / `[rpe.term] ...` for mismatched shapes,
///   grid, heads, or a term on the wrong slot, before anything is written.
/// Threads: OpenMP over (batch, head, row block) items when enabled; each item is computed by
/// one thread in a fixed order, so results do not depend on the thread count (when called from
/// outside any OpenMP parallel region; see docs/attention.md).
/// S = rpe::bf16: bf16 storage of q, k, v, tables, attn_mask, RoPE frequencies, out and attn,
/// float accumulation, outputs rounded to bf16 once (detail::fused_forward_bf16: vdpbf16ps
/// products where the unit is built with AVX512_BF16, else the portable path, f16's below: float
/// conversion, q, k, v per chunk of batch elements whose float copies fit 64 MiB, and the float
/// kernels; accuracy in docs/attention.md, "bf16"). Calls with `in.packed`, `in.key_lengths` or
/// RoPE take the portable path.
/// S = rpe::f16 (IEEE binary16): f16 storage of the same tensors, float computation: the inputs
/// converted to float once (F16C / AVX-512F conversions where the unit has them; q, k, v per chunk
/// of batch elements whose float copies fit 64 MiB), the float forward, out and attn rounded to f16 once (detail::fused_forward_f16: bit for bit the
/// f16 rounding of the float forward on the f16 values; docs/attention.md, "f16").
template <class S>
void attention_forward(const attention_inputs<S>& in, tensor_ref<S> out, tensor_ref<S> attn = {},
                       const attention_options& opt = {}) {
    detail::check_attention_forward(in, out, attn, opt, attention_caps);
    if (in.packed.enabled()) {
        if constexpr (std::is_same_v<S, bf16>)
            return detail::packed_forward_bf16(in, out, opt);
        else if constexpr (std::is_same_v<S, f16>)
            return detail::packed_forward_f16(in, out, opt);
        else
            return detail::packed_forward(in, out, opt);
    }
    detail::dispatch_ids(in, opt.storage, [&]<class Id>(const std::shared_ptr<const bucket_ids>* ids) {
        if constexpr (std::is_same_v<S, bf16>)
            detail::fused_forward_bf16<Id>(in, ids, out, attn, opt);
        else if constexpr (std::is_same_v<S, f16>)
            detail::fused_forward_f16<Id>(in, ids, out, attn, opt);
        else
            detail::fused_forward<S, Id>(in, ids, out, attn, opt);
    });
}

/// @brief Fused backward of attention_forward for `sum(out · grad_out)`: writes the gradients
/// of the unscaled q, k, v (`g.grad_q`, `g.grad_k`, `g.grad_v`, overwritten) and of every table
/// given in the attention_terms' `grad_tables` (overwritten), from `g.grad_out`. Without
/// `g.saved_attn` it recomputes the probabilities row block by row block (no saved (B, H, L, L)
/// state); with it (the forward's `attn` output for the same inputs) it reuses them: the same
/// gradients up to float rounding, for the memory of one (B, H, L, L) tensor, and the logits,
/// contextual key products and softmax are not computed again (`saved_attn` from other inputs
/// gives wrong gradients: it is not checked against q and k). Padded keys get exactly zero
/// grad_k and grad_v rows. With `in.rope`, grad_q and grad_k are rotated back by the transpose
/// rotation and, for rope::mixed with `in.rope.grad_freqs` given, the frequencies' gradient
/// (2, H, D/2) is written (summed over q and k, batch and tokens in a fixed order).
/// @param g  grad_out, grad_q (B, H, L, D), grad_k, grad_v (B, H, L_k, D) and optional saved_attn
///   (B, H, L, L_k).
/// @param opt the forward's options (the same scale).
/// @throws as attention_forward, and rpe::invalid_argument for a saved_attn of another shape,
///   null, strided, or overlapping an output.
/// Threads: OpenMP over (batch, head, chunk of row blocks) items, about 32 in all (a count that
/// depends on B·H and L only); grad_k, grad_v and the table gradients are summed from per-item
/// partials in a fixed order, so results do not depend on the thread count. Memory: those
/// partials take items·(2·L·D + L·K per contextual query table + table sizes) values; the items
/// run in waves whose partials fit `opt.backward_budget_bytes` (default 256 MiB), with the same
/// results for every budget (plan_backward_scratch tells the bytes; see docs/attention.md).
/// S = rpe::bf16: bf16 storage of every input and output (q, k, v, tables, attn_mask, RoPE
/// frequencies, grad_out, saved_attn, grad_q, grad_k, grad_v, grad_tables, rope grad_freqs), the
/// computation in float: the inputs are converted to float once per call (contiguous copies), the
/// float backward runs (float accumulation of every sum, the table and frequency gradients
/// included, in its fixed order), and each gradient is rounded to bf16 once when written
/// (detail::fused_backward_bf16; accuracy in docs/attention.md, "bf16"). The table gradients are
/// therefore bf16 values (the output type is the call's S): to accumulate a table's gradient in
/// float over steps, add these per-call results into a float master copy. Extra memory of the
/// call: float copies of q, k, v, grad_out and the three gradients (7·B·H·L·D floats), of the tables
/// and their gradients, and of saved_attn (B·H·L·L floats) when given; the partials budget is
/// that of the float backward (plan_backward_scratch counts float partials for bf16).
/// S = rpe::f16: as bf16 (the same float copies, the float backward, each gradient rounded to f16
/// once: detail::fused_backward_f16; docs/attention.md, "f16").
template <class S>
void attention_backward(const attention_inputs<S>& in, const attention_gradients<S>& g, const attention_options& opt = {}) {
    detail::check_attention_backward(in, g, opt, attention_caps);
    if constexpr (std::is_same_v<S, bf16>) {
        detail::fused_backward_bf16(in, g, opt);
    } else if constexpr (std::is_same_v<S, f16>) {
        detail::fused_backward_f16(in, g, opt);
    } else {
        if (in.packed.enabled()) return detail::packed_backward(in, g, opt);
        detail::dispatch_ids(in, opt.storage, [&]<class Id>(const std::shared_ptr<const bucket_ids>* ids) {
            detail::fused_backward<S, Id>(in, ids, g.saved_attn, g.grad_out, g.grad_q, g.grad_k, g.grad_v, opt);
        });
    }
}

/// @brief attention_backward recomputing the probabilities, with the tensors by position:
/// `attention_backward(in, {.grad_out = grad_out, .grad_q = grad_q, .grad_k = grad_k,
/// .grad_v = grad_v}, opt)`. @throws as attention_backward.
template <class S>
void attention_backward(const attention_inputs<S>& in, tensor_ref<const S> grad_out, tensor_ref<S> grad_q, tensor_ref<S> grad_k,
                        tensor_ref<S> grad_v, const attention_options& opt = {}) {
    rpe::cpu::attention_backward(
        in, attention_gradients<S>{.grad_out = grad_out, .grad_q = grad_q, .grad_k = grad_k, .grad_v = grad_v}, opt);
}

/// @brief The memory plan of attention_backward for given inputs and options (see
/// plan_backward_scratch): what its per-item partials take.
struct backward_scratch {
    /// Bytes of the partials live at once (gradient partials of grad_k, grad_v and the tables, the
    /// contextual query tables' per-(key, bucket) sums, accumulator and products): at most
    /// `attention_options::backward_budget_bytes`, or `min_bytes` when that is larger.
    std::int64_t bytes = 0;
    std::int64_t min_bytes = 0;      ///< the least the chunking allows: one item's partials (and one (batch, head)'s sums)
    std::int64_t all_bytes = 0;      ///< every item's partials at once (an unlimited budget)
    std::int64_t items = 0;          ///< (batch, head, chunk of row blocks) items: B·H·chunks
    std::int64_t chunks = 0;         ///< chunks per (batch, head): a function of B·H, L and the row block only
    std::int64_t items_at_once = 0;  ///< items per wave (run in parallel), at most `items`
};

/// @brief The memory plan of attention_backward(in, g, opt): the bytes its per-item partials take
/// at once under `opt.backward_budget_bytes` (and without a budget), the items and the items per
/// wave. Depends on the shapes, the terms, which `grad_tables` are given, `opt.row_block`, the
/// budget and whether `g.saved_attn` is given (`saved_attn`), never on the thread count.
/// Per-thread buffers (logits blocks, about threads·(2·rows·L + 2·rows·K) values) and the (L, L) id
/// copies are not counted. For S = rpe::bf16 and rpe::f16 the partials are float values (that
/// backward runs in float); its float copies of the inputs and gradients (see attention_backward)
/// are not counted.
/// @throws rpe::invalid_argument as attention_backward for bad inputs or options (e.g.
///   `[rpe.attention] options.backward_budget_bytes = 0; expected > 0 (bytes)`).
template <class S>
backward_scratch plan_backward_scratch(const attention_inputs<S>& in, const attention_options& opt = {},
                                       bool saved_attn = false) {
    (void)detail::check_attention(in, attention_caps);
    const auto plan_of = [&](const attention_inputs<S>& one) {
        const auto lay = detail::backward_layout_of(one, opt, saved_attn);
        return backward_scratch{.bytes = lay.bytes,
                                .min_bytes = lay.min_bytes,
                                .all_bytes = lay.all_bytes,
                                .items = lay.items,
                                .chunks = lay.chunks,
                                .items_at_once = std::min(lay.slots, lay.items)};
    };
    if (!in.packed.enabled()) return plan_of(in);
    backward_scratch most;  // the images run one after another: the plan of the image that takes the most
    for (const auto& img : detail::packed_images(in)) {
        const auto one = plan_of(img.in);
        if (one.bytes >= most.bytes) most = one;
    }
    return most;
}

/// @brief The standalone RoPE rotation under the backend's name (as rpe::cuda::rope_forward /
/// rope_backward): rpe::rope_forward / rope_backward of backend/cpu/rope.hpp.
using rpe::rope_backward;
using rpe::rope_forward;

#if defined(RPE_EXTERN_ATTENTION)
// Instantiated once in the program's instantiation unit, src/attention.cpp (CMake: rpe::attention
// for a user's program, the object library rpe_attention for rpe's own), built for the same ISA
// (the same RPE_ISA_NS) as the units that include this. Without CMake, compile src/attention.cpp
// into the program and define RPE_EXTERN_ATTENTION in its other units.
extern template void attention_forward<float>(const attention_inputs<float>&, tensor_ref<float>, tensor_ref<float>,
                                              const attention_options&);
extern template void attention_forward<double>(const attention_inputs<double>&, tensor_ref<double>, tensor_ref<double>,
                                               const attention_options&);
extern template void attention_backward<float>(const attention_inputs<float>&, const attention_gradients<float>&,
                                               const attention_options&);
extern template void attention_backward<double>(const attention_inputs<double>&, const attention_gradients<double>&,
                                                const attention_options&);
extern template void attention_backward<float>(const attention_inputs<float>&, tensor_ref<const float>, tensor_ref<float>,
                                               tensor_ref<float>, tensor_ref<float>, const attention_options&);
extern template void attention_backward<double>(const attention_inputs<double>&, tensor_ref<const double>, tensor_ref<double>,
                                                tensor_ref<double>, tensor_ref<double>, const attention_options&);
extern template void attention_forward<bf16>(const attention_inputs<bf16>&, tensor_ref<bf16>, tensor_ref<bf16>,
                                             const attention_options&);
extern template void attention_backward<bf16>(const attention_inputs<bf16>&, const attention_gradients<bf16>&,
                                              const attention_options&);
extern template void attention_backward<bf16>(const attention_inputs<bf16>&, tensor_ref<const bf16>, tensor_ref<bf16>,
                                              tensor_ref<bf16>, tensor_ref<bf16>, const attention_options&);
extern template void attention_forward<f16>(const attention_inputs<f16>&, tensor_ref<f16>, tensor_ref<f16>,
                                            const attention_options&);
extern template void attention_backward<f16>(const attention_inputs<f16>&, const attention_gradients<f16>&,
                                             const attention_options&);
extern template void attention_backward<f16>(const attention_inputs<f16>&, tensor_ref<const f16>, tensor_ref<f16>,
                                             tensor_ref<f16>, tensor_ref<f16>, const attention_options&);
#endif

}  // namespace RPE_ISA_NS
}  // namespace cpu

using cpu::attention_backward;
using cpu::attention_forward;

}  // namespace rpe

// detail::fused_forward_bf16 / _f16 and the rest of the 16-bit storage, over the float kernels
// above (attention_half.hpp includes attention_bf16.hpp and attention_f16.hpp at its end)
#include "attention_half.hpp"
