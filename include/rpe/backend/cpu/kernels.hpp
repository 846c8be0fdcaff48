/// @file backend/cpu/kernels.hpp
/// @brief CPU kernels of the RPE terms on raw row-major buffers (not API: use rpe::term).
///
/// Shapes in CuTe-like notation. `Ht` table heads (1 when shared), `h' = Ht == 1 ? 0 : h`.
/// Ids come row by row from an id_rows source (stored or made on the fly, see bucket_ids::rows),
/// one row of L_k ids per query; its `transposed` flag selects the query target's pair order:
/// entry (i, j) reads id(j, i) (keys at positions of another count: the id of offset kpos_j − qpos_i).
/// L queries, L_k keys (L_k = L but for keys at positions of another count, cross-attention).
/// Every kernel is parallel over (b, h) with OpenMP when enabled; table gradients are summed
/// from per-(b, h) partials in a fixed order, so results do not depend on the thread count.
#pragma once

#include "eigen.hpp"
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../bucket_ids.hpp"
#include "../../detail/term_checks.hpp"
#include "isa.hpp"
#include "simd.hpp"
#include "workspace.hpp"

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

template <class S>
using row_matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using cmap = Eigen::Map<const row_matrix<S>>;
template <class S>
using map = Eigen::Map<row_matrix<S>>;
/// Rows `stride` elements apart (a plane of a strided q, k or v).
template <class S>
using cmap_strided = Eigen::Map<const row_matrix<S>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// @brief The (B, H) planes of a (B, H, L, D) input whose rows of D values are contiguous:
/// plane p = b·H + h starts at `data + b·sb + h·sh`, its rows `sl` apart (the C-order strides
/// for a contiguous view, the view's own for a strided one).
template <class S>
struct plane_rows {
    const S* data = nullptr;
    std::int64_t heads = 1, sb = 0, sh = 0, sl = 0;
    plane_rows() = default;
    explicit plane_rows(const tensor_ref<const S>& t)
        : data(t.data), heads(t.extent(1)), sb(t.stride(0)), sh(t.stride(1)), sl(t.stride(2)) {}
    /// A contiguous (planes, L, D) buffer.
    plane_rows(const S* contiguous, std::int64_t h, std::int64_t l, std::int64_t d)
        : data(contiguous), heads(h), sb(h * l * d), sh(l * d), sl(d) {}
    [[nodiscard]] const S* plane(std::int64_t p) const { return data + (p / heads) * sb + (p % heads) * sh; }
    /// Rows [i0, i0 + rows) of plane p as an Eigen map (rows, d).
    [[nodiscard]] cmap_strided<S> rows(std::int64_t p, std::int64_t i0, std::int64_t rows, std::int64_t d) const {
        return cmap_strided<S>(plane(p) + i0 * sl, rows, d, Eigen::OuterStride<>(sl));
    }
};

/// Writable rows `stride` elements apart (a plane of an output, maybe a view into a packed sequence).
template <class S>
using map_strided = Eigen::Map<row_matrix<S>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// @brief The (B, H) planes of a writable (B, H, L, D) output (rows of D contiguous), as plane_rows.
template <class S>
struct plane_rows_mut {
    S* data = nullptr;
    std::int64_t heads = 1, sb = 0, sh = 0, sl = 0;
    plane_rows_mut() = default;
    explicit plane_rows_mut(const tensor_ref<S>& t)
        : data(t.data), heads(t.extent(1)), sb(t.stride(0)), sh(t.stride(1)), sl(t.stride(2)) {}
    [[nodiscard]] S* plane(std::int64_t p) const { return data + (p / heads) * sb + (p % heads) * sh; }
    /// Rows [i0, i0 + rows) of plane p as an Eigen map (rows, d).
    [[nodiscard]] map_strided<S> rows(std::int64_t p, std::int64_t i0, std::int64_t rows, std::int64_t d) const {
        return map_strided<S>(plane(p) + i0 * sl, rows, d, Eigen::OuterStride<>(sl));
    }
};

/// @brief C (m, n) = A (m, kk) · B (kk, n), or C += A · B with `accumulate`: B row-major with rows
/// `ldb` apart, A's element (r, k) at a[r·a_rs + k·a_ks] (row-major: a_rs = lda, a_ks = 1; the
/// transpose of a row-major matrix: a_rs = 1, a_ks = its lda), C's rows `ldc` apart. float in a
/// unit with AVX-512F: simd::gemm (each element one in-order multiply-add chain); otherwise Eigen.
template <class S>
void matmul(std::int64_t m, std::int64_t n, std::int64_t kk, const S* a, std::int64_t a_rs, std::int64_t a_ks, const S* b,
            std::int64_t ldb, S* c, std::int64_t ldc, bool accumulate = false) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>) {
        simd::gemm(m, n, kk, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
        return;
    }
#endif
    using strided = Eigen::Map<const row_matrix<S>, Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;
    const strided am(a, m, kk, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(a_rs, a_ks));
    const cmap_strided<S> bm(b, kk, n, Eigen::OuterStride<>(ldb));
    Eigen::Map<row_matrix<S>, Eigen::Unaligned, Eigen::OuterStride<>> cm(c, m, n, Eigen::OuterStride<>(ldc));
    if (accumulate)
        cm.noalias() += am * bm;
    else
        cm.noalias() = am * bm;
}

/// @brief Problem sizes shared by the kernels (the front's term_dims).
using dims = term_dims;

/// @brief Start a thread team only when the work (about planes·L·(L + K·D) operations) is large
/// enough to pay for it.
inline bool worth_threads(std::int64_t planes, std::int64_t n, std::int64_t k, std::int64_t d) {
    return planes > 1 && planes * n * (n + k * d) > (std::int64_t{1} << 16);
}

/// @brief One id set of a bucket_ids object as rows of Id, in the order a kernel reads them.
template <class Id>
struct id_rows {
    const bucket_ids* ids = nullptr;
    int table = 0;
    bool transposed = false;  ///< query target: row i holds id(j, i) for every j
    /// @brief Rows [i0, i0 + count) as a (count, L_k) block; `buf` holds count·L_k ids if needed.
    const Id* operator()(std::int64_t i0, std::int64_t count, Id* buf) const {
        return ids->template rows<Id>(table, i0, count, transposed, buf);
    }
};

/// @brief Key-order ids of a query-target id set: dst (L_k, L) with dst[j·L + i] the query
/// target's id of query i and key j (id(j, i) on tokens of one set; bucket_ids::key_rows), row j
/// those of key j's pairs with every query i, for the contextual query term looked up per key
/// (simd::lookup_rows). `n` = L queries, `nk` = L_k keys. Rows made in parallel over j with
/// OpenMP when L_k > 64 (each row written by one thread: the same ids for every thread count).
template <class Id>
void key_order_ids(const id_rows<Id>& rows, std::int64_t n, std::int64_t nk, Id* dst) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (nk > 64)
#endif
    for (std::int64_t j = 0; j < nk; ++j) {
        const Id* r = rows.ids->template key_rows<Id>(rows.table, j, 1, dst + j * n);
        if (r != dst + j * n) std::copy(r, r + n, dst + j * n);
    }
}

/// @brief Calls `f.template operator()<Id>()` with Id the unsigned type of `bytes` bytes (1, 2, 4).
template <class F>
void with_id_type(int bytes, F&& f) {
    if (bytes == 1)
        f.template operator()<std::uint8_t>();
    else if (bytes == 2)
        f.template operator()<std::uint16_t>();
    else
        f.template operator()<std::uint32_t>();
}

/// @brief o[r[j]] += g[j] for j < n, summing runs of equal ids in a register first: neighbouring
/// keys often share a bucket (far offsets clip to the same one), and adding them one by one into
/// the same memory word serialises on store-to-load forwarding.
template <class S, class Id>
inline void scatter_row(const S* g, const Id* r, std::int64_t n, S* o) {
    if (n <= 0) return;
    Id cur = r[0];
    S acc = g[0];
    for (std::int64_t j = 1; j < n; ++j) {
        if (r[j] == cur) {
            acc += g[j];
        } else {
            o[cur] += acc;
            cur = r[j];
            acc = g[j];
        }
    }
    o[cur] += acc;
}

/// @brief Key target: S[i, id(i,j)] += g[i,j]; query target: S[j, id(j,i)] += g[i,j].  g: (L, L_k);
/// S: (L, K) for the key target, (L_k, K) for the query target. `row` is scratch for one id row (L_k).
template <class S, class Id>
void scatter_add(const S* g, const id_rows<Id>& ids, std::int64_t n, std::int64_t nk, std::int64_t k, Id* row, S* out) {
    std::fill(out, out + (ids.transposed ? nk : n) * k, S(0));
    for (std::int64_t i = 0; i < n; ++i) {
        const S* gi = g + i * nk;
        const Id* r = ids(i, 1, row);
        if (!ids.transposed) {
            scatter_row(gi, r, nk, out + i * k);
        } else {
            for (std::int64_t j = 0; j < nk; ++j) out[j * k + r[j]] += gi[j];
        }
    }
}

/// @brief Row-block scatter: out[i, idb[i,j]] = Σ_j g[i,j] over `rows` rows of length n, idb the
/// block's (rows, L) ids.  out: (rows, K)
template <class S, class Id>
void scatter_rows(const S* g, const Id* idb, std::int64_t rows, std::int64_t n, std::int64_t k, S* out) {
    std::fill(out, out + rows * k, S(0));
    for (std::int64_t i = 0; i < rows; ++i) scatter_row(g + i * n, idb + i * n, n, out + i * k);
}

/// @brief scatter_rows over the first n keys of rows `g_stride` (g) and `id_stride` (idb) apart
/// (valid key lengths: n keys of rows of L), into rows `out_stride` apart (0: k).
template <class S, class Id>
void scatter_rows(const S* g, std::int64_t g_stride, const Id* idb, std::int64_t id_stride, std::int64_t rows, std::int64_t n,
                  std::int64_t k, S* out, std::int64_t out_stride = 0) {
    const std::int64_t lo = out_stride > 0 ? out_stride : k;
    for (std::int64_t i = 0; i < rows; ++i) {
        S* o = out + i * lo;
        std::fill(o, o + k, S(0));
        scatter_row(g + i * g_stride, idb + i * id_stride, n, o);
    }
}

/// @brief part[(j mod 4)·k + r[j]] += g[j] for j < n (ids < k; the last n mod 4 keys into the first
/// array): one row into the four partial sums of scatter_rows4 / scatter_sum4, no branch on the ids.
/// One-byte ids are read eight at a time (one load instead of eight; the same additions in the
/// same order).
template <class S, class Id>
inline void scatter_into4(const S* g, const Id* r, std::int64_t n, std::int64_t k, S* part) {
    S *p0 = part, *p1 = part + k, *p2 = part + 2 * k, *p3 = part + 3 * k;
    std::int64_t j = 0;
    if constexpr (sizeof(Id) == 1 && std::endian::native == std::endian::little)
        for (; j + 8 <= n; j += 8) {
            std::uint64_t w = 0;
            std::memcpy(&w, r + j, 8);
            p0[w & 255u] += g[j];
            p1[(w >> 8) & 255u] += g[j + 1];
            p2[(w >> 16) & 255u] += g[j + 2];
            p3[(w >> 24) & 255u] += g[j + 3];
            p0[(w >> 32) & 255u] += g[j + 4];
            p1[(w >> 40) & 255u] += g[j + 5];
            p2[(w >> 48) & 255u] += g[j + 6];
            p3[w >> 56] += g[j + 7];
        }
    for (; j + 4 <= n; j += 4) {
        p0[r[j]] += g[j];
        p1[r[j + 1]] += g[j + 1];
        p2[r[j + 2]] += g[j + 2];
        p3[r[j + 3]] += g[j + 3];
    }
    for (; j < n; ++j) p0[r[j]] += g[j];
}

/// @brief out[b] = (or += with `accumulate`) (p0[b] + p1[b]) + (p2[b] + p3[b]) for b < k, the four
/// partial sums of scatter_into4 (part: p0 … p3, k each), which it leaves zero for the next row.
template <bool accumulate, class S>
inline void reduce4_clear(S* part, std::int64_t k, S* out) {
    const S *p0 = part, *p1 = part + k, *p2 = part + 2 * k, *p3 = part + 3 * k;
    for (std::int64_t b = 0; b < k; ++b) {
        const S sum = (p0[b] + p1[b]) + (p2[b] + p3[b]);
        if constexpr (accumulate)
            out[b] += sum;
        else
            out[b] = sum;
    }
    std::fill(part, part + 4 * k, S(0));
}

/// @brief out[i·ldo + b] = Σ_{j < n, ids[i·ldi + j] = b} g[i·ldg + j] for i < rows, b < k (ids < k;
/// ldo 0: k): the value terms' per-bucket sums of the probabilities in the fused forwards. Four
/// partial sums per bucket (keys j mod 4), added as (p0 + p1) + (p2 + p3) at the end, so that
/// repeated buckets do not serialise on store-to-load forwarding and no branch depends on the ids
/// (scatter_row's runs mispredict where runs are short). Two sets of partials take turns: row i's
/// are added up while row i + 1 scatters into the other set, so that the vector loads of the sums
/// do not wait for row i's last scalar stores. part: 8·k values of scratch. out's rows may lie in
/// g's rows past column n (the fused attention's [logits | sums] buffers): row i − 1 is written
/// after row i is read. With `accumulate` the sums are added to out's rows instead (the query
/// term's per-key sums in the fused backward).
template <bool accumulate = false, class S, class Id>
inline void scatter_rows4(const S* g, std::int64_t ldg, const Id* ids, std::int64_t ldi, std::int64_t rows, std::int64_t n,
                          std::int64_t k, S* part, S* out, std::int64_t ldo = 0) {
    const std::int64_t lo = ldo > 0 ? ldo : k;
    std::fill(part, part + 8 * k, S(0));
    for (std::int64_t i = 0; i < rows; ++i) {
        scatter_into4(g + i * ldg, ids + i * ldi, n, k, part + (i & 1) * 4 * k);
        if (i > 0) reduce4_clear<accumulate>(part + ((i - 1) & 1) * 4 * k, k, out + (i - 1) * lo);
    }
    if (rows > 0) reduce4_clear<accumulate>(part + ((rows - 1) & 1) * 4 * k, k, out + (rows - 1) * lo);
}

/// @brief out[b] += Σ_{i < rows, j < n, ids[i·ldi + j] = b} g[i·ldg + j] for b < k (ids < k): the
/// bias tables' gradients of a row block in the fused backward, branch-free as scatter_rows4 (four
/// partial sums per bucket over the whole block, keys j mod 4, added to out as (p0 + p1) + (p2 + p3)
/// at the end); part: 4·k values of scratch.
template <class S, class Id>
inline void scatter_sum4(const S* g, std::int64_t ldg, const Id* ids, std::int64_t ldi, std::int64_t rows, std::int64_t n,
                         std::int64_t k, S* part, S* out) {
    std::fill(part, part + 4 * k, S(0));
    for (std::int64_t i = 0; i < rows; ++i) scatter_into4(g + i * ldg, ids + i * ldi, n, k, part);
    reduce4_clear<true>(part, k, out);
}

/// @brief Key target: o[i,j] (+)= T[i, id(i,j)]; query target: o[i,j] (+)= T[j, id(j,i)].  o: (L, L_k);
/// T: (L, K) for the key target, (L_k, K) for the query target, or with `per_token` false one row
/// (K) shared by all tokens (bias). Vectorised (gather_row), one pass over the output (written, or
/// added to when `accumulate`).
template <class S, class Id>
void gather(const S* t, const id_rows<Id>& ids, std::int64_t n, std::int64_t nk, std::int64_t k, bool per_token, bool accumulate,
            Id* row, S* o) {
    for (std::int64_t i = 0; i < n; ++i) {
        S* oi = o + i * nk;
        const Id* r = ids(i, 1, row);
        if (accumulate) {
            if (!per_token)
                gather_row<true>(oi, t, k, r, nk);
            else if (!ids.transposed)
                gather_row<true>(oi, t + i * k, k, r, nk);
            else
                gather_row_strided<true>(oi, t, k, r, nk);
        } else {
            if (!per_token)
                gather_row<false>(oi, t, k, r, nk);
            else if (!ids.transposed)
                gather_row<false>(oi, t + i * k, k, r, nk);
            else
                gather_row_strided<false>(oi, t, k, r, nk);
        }
    }
}

/// @brief grad_table (Ht, size) (+)= Σ_p partial[p] over planes p = (b, h), each into table head
/// h' of h = p % heads, summed in plane order (so the result does not depend on the thread count).
/// With `chunks` > 1, partial holds planes·chunks entries, plane p's at [p·chunks, (p+1)·chunks),
/// summed in that order.
template <class S>
void reduce_partials(const S* partial, std::int64_t planes, std::int64_t heads, std::int64_t table_heads, std::int64_t size,
                     bool accumulate, S* grad_table, std::int64_t chunks = 1) {
    if (!accumulate) std::fill(grad_table, grad_table + table_heads * size, S(0));
    for (std::int64_t e = 0; e < planes * chunks; ++e) {
        S* dst = grad_table + (table_heads == 1 ? 0 : (e / chunks) % heads) * size;
        const S* src = partial + e * size;
        for (std::int64_t x = 0; x < size; ++x) dst[x] += src[x];
    }
}

/// @brief Bias forward. table (Ht, K); out (Bo, Ho, L, L_k) with Ho ∈ {Ht, H}: out[b,h,i,j] (+)= table[h', id].
template <class S, class Id>
void bias_forward(const dims& d, const id_rows<Id>& ids, const S* table, std::int64_t out_batch, std::int64_t out_heads,
                  bool accumulate, S* out) {
    const std::int64_t n = d.length, nk = d.key_length, planes = out_batch * out_heads;
    workspace ws;
    thread_scratch<Id> row(ws, nk);
    ws.allocate();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (planes > 1 && n * nk > 4096)
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        const std::int64_t h = p % out_heads;
        const S* th = table + (d.table_heads == 1 ? 0 : h) * d.buckets;
        gather(th, ids, n, nk, d.buckets, false, accumulate, row.mine(), out + p * n * nk);
    }
}

/// @brief Bias backward. grad (Bo, Ho, L, L_k) → grad_table (Ht, K) (+)= Σ over pairs, batch and
/// (for a shared table) heads, accumulated in plane order.
template <class S, class Id>
void bias_backward(const dims& d, const id_rows<Id>& ids, const S* grad, std::int64_t grad_batch, std::int64_t grad_heads,
                   bool accumulate, S* grad_table) {
    const std::int64_t n = d.length, nk = d.key_length, k = d.buckets;
    const std::int64_t planes = grad_batch * grad_heads;
    workspace ws;
    shared_scratch<S> partial_s(ws, planes * k);
    thread_scratch<Id> row(ws, nk);
    ws.allocate();
    S* partial = partial_s.data();
    std::fill(partial, partial + planes * k, S(0));
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (planes > 1 && n * nk > 4096)
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        S* acc = partial + p * k;
        const S* g = grad + p * n * nk;
        for (std::int64_t i = 0; i < n; ++i) {
            const Id* r = ids(i, 1, row.mine());
            scatter_row(g + i * nk, r, nk, acc);
        }
    }
    reduce_partials(partial, planes, grad_heads, d.table_heads, k, accumulate, grad_table);
}

/// @brief Contextual q/k forward (paper eqs. 15–16): per (b, h) T = x·table[h'] (X, K), then
/// gather. x (B, H, X, D) with X = L (key target: x = q) or L_k (query target: x = k); table
/// (Ht, D, K); out (B, H, L, L_k). O(B·H·X·D·K + B·H·L·L_k).
template <class S, class Id>
void contextual_qk_forward(const dims& d, const id_rows<Id>& ids, const S* x, const S* table, bool accumulate, S* out) {
    const std::int64_t n = d.length, nk = d.key_length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    const std::int64_t nx = ids.transposed ? nk : n;  // rows of x
    workspace ws;
    thread_scratch<S> work(ws, nx * k);
    thread_scratch<Id> row(ws, nk);
    ws.allocate();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (worth_threads(planes, std::max(n, nk), k, dd))
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        S* t = work.mine();
        matmul(nx, k, dd, x + p * nx * dd, dd, 1, table + d.table_head(p % d.heads) * dd * k, k, t, k);
        gather(t, ids, n, nk, k, true, accumulate, row.mine(), out + p * n * nk);
    }
}

/// @brief Contextual q/k backward: G = scatter(grad) (L, K), once for both outputs;
/// grad_x (+)= G·table[h']ᵀ (added when `accumulate_x`); grad_table[h'] (+)= Σ_b,(h) xᵀ·G (added
/// when `accumulate_table`). Either output may be null (not wanted).
template <class S, class Id>
void contextual_qk_backward(const dims& d, const id_rows<Id>& ids, const S* x, const S* table, const S* grad, bool accumulate_x,
                            bool accumulate_table, S* grad_x, S* grad_table) {
    const std::int64_t n = d.length, nk = d.key_length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    const std::int64_t nx = ids.transposed ? nk : n;  // rows of x: L (key target), L_k (query target)
    workspace ws;
    thread_scratch<S> work(ws, nx * k);
    thread_scratch<Id> row(ws, nk);
    shared_scratch<S> partial_s(ws, grad_table ? planes * dd * k : 0);
    ws.allocate();
    S* partial = partial_s.data();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (worth_threads(planes, std::max(n, nk), k, dd))
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        S* g = work.mine();
        scatter_add(grad + p * n * nk, ids, n, nk, k, row.mine(), g);
        const S* th = table + d.table_head(p % d.heads) * dd * k;
        if (grad_x) {
            map<S> gx(grad_x + p * nx * dd, nx, dd);
            if (accumulate_x)
                gx.noalias() += cmap<S>(g, nx, k) * cmap<S>(th, dd, k).transpose();
            else
                gx.noalias() = cmap<S>(g, nx, k) * cmap<S>(th, dd, k).transpose();
        }
        if (grad_table) matmul(dd, k, nx, x + p * nx * dd, 1, dd, static_cast<const S*>(g), k, partial + p * dd * k, k);  // xᵀ·G
    }
    if (grad_table) {
        reduce_partials(partial, planes, d.heads, d.table_heads, dd * k, accumulate_table, grad_table);
    }
}

/// @brief Contextual value forward (paper eq. 17): S = scatter(a) (L, K); out (+)= S·table[h'].
/// a (B, H, L, L_k); table (Ht, K, D); out (B, H, L, D). O(B·H·(L·L_k + L·K·D)).
template <class S, class Id>
void contextual_v_forward(const dims& d, const id_rows<Id>& ids, const S* a, const S* table, bool accumulate, S* out) {
    const std::int64_t n = d.length, nk = d.key_length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    workspace ws;
    thread_scratch<S> work(ws, n * k);
    thread_scratch<Id> row(ws, nk);
    ws.allocate();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (worth_threads(planes, std::max(n, nk), k, dd))
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        S* s = work.mine();
        scatter_add(a + p * n * nk, ids, n, nk, k, row.mine(), s);
        map<S> o(out + p * n * dd, n, dd);
        const auto th = cmap<S>(table + d.table_head(p % d.heads) * k * dd, k, dd);
        if (accumulate)  // (Eigen: simd::gemm measured 7–10% slower on this product)
            o.noalias() += cmap<S>(s, n, k) * th;
        else
            o.noalias() = cmap<S>(s, n, k) * th;
    }
}

/// @brief Contextual value backward (a, grad_a (B, H, L, L_k)): grad_a[i,j] (+)= (grad_out·table[h']ᵀ)[i, id(i,j)];
/// grad_table[h'] (+)= Σ Sᵀ·grad_out. Either output may be null.
template <class S, class Id>
void contextual_v_backward(const dims& d, const id_rows<Id>& ids, const S* a, const S* table, const S* grad_out, bool accumulate,
                           S* grad_a, S* grad_table) {
    const std::int64_t n = d.length, nk = d.key_length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    workspace ws;
    thread_scratch<S> work(ws, n * k);
    thread_scratch<Id> row(ws, nk);
    shared_scratch<S> partial_s(ws, grad_table ? planes * k * dd : 0);
    ws.allocate();
    S* partial = partial_s.data();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (worth_threads(planes, std::max(n, nk), k, dd))
#endif
    for (std::int64_t p = 0; p < planes; ++p) {
        S* w = work.mine();
        const auto th = cmap<S>(table + d.table_head(p % d.heads) * k * dd, k, dd);
        const auto go = cmap<S>(grad_out + p * n * dd, n, dd);
        if (grad_a) {
            map<S>(w, n, k).noalias() = go * th.transpose();
            gather(w, ids, n, nk, k, true, accumulate, row.mine(), grad_a + p * n * nk);
        }
        if (grad_table) {
            scatter_add(a + p * n * nk, ids, n, nk, k, row.mine(), w);
            map<S>(partial + p * k * dd, k, dd).noalias() = cmap<S>(w, n, k).transpose() * go;
        }
    }
    if (grad_table) {
        reduce_partials(partial, planes, d.heads, d.table_heads, k * dd, accumulate, grad_table);
    }
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
