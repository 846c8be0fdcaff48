/// @file backend/cuda/attention.cuh
/// @brief rpe::cuda::attention_forward: fused multi-head attention with iRPE on queries, keys
/// and values and optional 2D RoPE on q and k on the GPU, flash-attention style (online softmax,
/// no (L, L) buffer).
#pragma once

#include <cub/warp/warp_reduce.cuh>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../attention_inputs.hpp"
#include "../../detail/check.hpp"
#include "../../error.hpp"
#include "../../tensor.hpp"
#include "../../term_desc.hpp"
#include "bucket_ids.cuh"
#include "error.cuh"
#include "kernels.cuh"
#include "rope.cuh"
#include "types.cuh"

namespace rpe::cuda {

/// @brief One RPE term attached to the CUDA attention: rpe::attention_term, the same type as the
/// CPU's (a term descriptor, host memory, and its lookup table(s) in device memory).
template <class S>
using attention_term = rpe::attention_term<S>;

/// @brief Inputs of the CUDA attention: rpe::attention_inputs, the same type as the CPU's, with
/// device pointers (q, k, v, masks, tables, RoPE freqs and grad_freqs) and host term descriptors.
template <class S>
using attention_inputs = rpe::attention_inputs<S>;

/// @brief What the CUDA attention supports (checked by the shared front): contiguous q, k, v only
/// (no strided views), no `attn` output and no backward from saved probabilities (there is no
/// (L, L) buffer), RoPE with the frequencies' gradient (RoPE positions, key_positions and suffix
/// included, rope::vjepa2's layout too), both masks, 3D grids, D ≤ 128, per-token positions of
/// the iRPE terms (positions, key_positions), valid key lengths (key_lengths) and packed
/// sequences (packed: lengths, grids, positions), each in device or host memory (packing without
/// RoPE and without key_lengths, as on the CPU), and keys of another count than the queries
/// (cross_lengths: k, v (B, H, L_k, D), masks (L, L_k) and (B, L_k), key_lengths ≤ L_k; iRPE terms
/// then at positions and key_positions, their (L, L_k) ids; RoPE's query_suffix apart from its
/// suffix: SAM2's memory attention), as on the CPU; packing with L_k ≠ L is refused, as on the CPU
/// (rpe::not_supported before any CUDA call).
inline constexpr attention_capabilities attention_caps{.backend = "cuda",
                                                       .strided_qkv = false,
                                                       .saved_probabilities = false,
                                                       .rope = true,
                                                       .rope_freqs_grad = true,
                                                       .key_padding_mask = true,
                                                       .attn_mask = true,
                                                       .grid_3d = true,
                                                       .max_head_dim = 128,
                                                       .positions = true,
                                                       .packed = true,
                                                       .key_lengths = true,
                                                       .cross_lengths = true};

}  // namespace rpe::cuda

namespace rpe::detail::gpu {

inline constexpr int attn_warps = 4;  // query (or key) rows per block, one warp each
inline constexpr int attn_max_dim = 128;
inline constexpr int attn_max_tables = 2;

// The ids of pair (i, j) for one table, computed from the per-offset ids (device memory, of the
// call's one id type Id: every table's ids are uploaded at the call's widest width, so the
// kernels take Id as a template argument and never switch on the width) by the host's offset
// math: id(i, j) for k and v, id(j, i) for q (transposed). At per-token positions
// (attention_inputs::positions) `pos` holds the grid tokens' linear positions in the bounding
// box's offset space (device memory) and `grid` the box with the term's skip and extra ids:
// detail::position_id, as the host's bucket_ids::at; on a grid pos.query is null.
struct attn_ids {
    const void* offsets = nullptr;
    bool transposed = false;
    id_grid grid{};
    id_positions pos{};
};

struct attn_table {
    attn_ids ids;                 // row and column kernels alike: ids(i, j) of pair (i, j)
    const void* table = nullptr;  // bias (Ht, K); contextual q/k (Ht, D, K); v (Ht, K, D); storage type S
    const void* prod =
        nullptr;  // acc-type: q: (B·H, L_k, K) (k·s)·table; k (backward): (B·H, L, K) qs·table; v (backward): (B·H, L, K) grad_out·tableᵀ
    void* rows = nullptr;  // backward, acc-type (B·H, L, K) per-row bucket sums (q: (B·H, L_k, K)): k: of dlogits by id(i, j);
                           // q: of dlogits by id(j, i), per key j; v: of probabilities
    int k = 0;
    int table_heads = 1;
    bool bias = false;
    int slot = 0;  // offset of this table's K values in the warp's shared scratch (products)
    int hist = 0;  // offset of this table's K bucket sums in the warp's shared scratch (backward)
};

struct attn_args {
    const void *q = nullptr, *k = nullptr, *v = nullptr, *attn_mask = nullptr;
    const std::uint8_t* key_padding_mask = nullptr;
    const std::int32_t* key_lengths = nullptr;  // (B) valid keys per batch element (device), or null: all L_k
    void* out = nullptr;
    const void* grad_out = nullptr;
    void *grad_q = nullptr, *grad_k = nullptr, *grad_v = nullptr;
    void* stats = nullptr;  // backward, acc-type (B·H, L, 3): row max, row sum, Σ_j P·dP
    std::int64_t n = 0, d = 0, heads = 1, planes = 0;
    std::int64_t m = 0;  // keys and values per plane (L_k; n when the keys are the queries' count)
    double scale = 1;
    attn_table on_q[attn_max_tables], on_k[attn_max_tables], on_v[attn_max_tables];
    int nq = 0, nk = 0, nv = 0;
    int scratch = 0;  // acc-type scratch slots per warp (after its two D-vectors)
};

template <class Id>
__device__ inline std::int64_t load_id(const attn_ids& v, std::int64_t i, std::int64_t j) {
    const std::int64_t a = v.transposed ? j : i, b = v.transposed ? i : j;
    const Id* off = static_cast<const Id*>(v.offsets);
    // at positions the query target's id of (i, j) is that of offset kpos_j − qpos_i (pos.swapped())
    return v.pos.query ? position_id(v.grid, v.transposed ? v.pos.swapped() : v.pos, off, a, b) : v.grid.id(off, a, b);
}

// Keys of batch element b that are computed: key_lengths[b], or all L_k; keys at index ≥ it are
// padding (probability 0, zero gradients), never used (the last tile may load their rows; no product reads them).
__device__ inline std::int64_t valid_keys(const attn_args& a, std::int64_t b) {
    return a.key_lengths ? static_cast<std::int64_t>(a.key_lengths[b]) : a.m;
}

// Full-warp reductions through CUB's WarpReduce (shuffle-based for 32 lanes: its TempStorage
// holds nothing, so a local one serves), the result broadcast from lane 0 to every lane.
struct fmax_op {  // fmax: a NaN operand is ignored, as in the CPU softmax's running maximum
    template <class A>
    __device__ A operator()(A a, A b) const {
        return fmax(a, b);
    }
};
template <class A>
__device__ inline A warp_max(A v) {
    using reduce = cub::WarpReduce<A>;
    typename reduce::TempStorage tmp;
    return __shfl_sync(0xffffffffu, reduce(tmp).Reduce(v, fmax_op{}), 0);
}
template <class A>
__device__ inline A warp_sum(A v) {
    using reduce = cub::WarpReduce<A>;
    typename reduce::TempStorage tmp;
    return __shfl_sync(0xffffffffu, reduce(tmp).Sum(v), 0);
}

template <class S>
__device__ inline const S* head_table(const attn_table& t, std::int64_t h, std::int64_t size) {
    return static_cast<const S*>(t.table) + (t.table_heads == 1 ? 0 : h) * size;
}

// The RPE terms and the additive mask of logit (i, j), row-kernel view: contextual key products of
// row i in the warp's scratch, contextual query products from the (B·H, L_k, K) temporary.
template <class S, class A, class Id>
__device__ inline A row_terms(const attn_args& a, std::int64_t p, std::int64_t h, std::int64_t i, std::int64_t j,
                              const A* scratch) {
    const std::int64_t e = i * a.m + j;
    A s = 0;
    for (int t = 0; t < a.nk; ++t) {
        const attn_table& tb = a.on_k[t];
        const std::int64_t id = load_id<Id>(tb.ids, i, j);
        s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id]) : scratch[tb.slot + id];
    }
    for (int t = 0; t < a.nq; ++t) {
        const attn_table& tb = a.on_q[t];
        const std::int64_t id = load_id<Id>(tb.ids, i, j);  // id(j, i)
        s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id]) : static_cast<const A*>(tb.prod)[(p * a.m + j) * tb.k + id];
    }
    if (a.attn_mask) s += to_acc(static_cast<const S*>(a.attn_mask)[e]);
    return s;
}

// Per warp, for query row i: qs (D) and the contextual key products qs·table (K per table).
template <class S, class A>
__device__ inline void load_query_row(const attn_args& a, std::int64_t p, std::int64_t h, std::int64_t i, A* qs, A* scratch,
                                      int lane) {
    const std::int64_t dd = a.d;
    for (std::int64_t c = lane; c < dd; c += 32)
        qs[c] = to_acc(static_cast<const S*>(a.q)[(p * a.n + i) * dd + c]) * static_cast<A>(a.scale);
    __syncwarp();
    for (int t = 0; t < a.nk; ++t) {
        const attn_table& tb = a.on_k[t];
        if (tb.bias) continue;
        const S* tab = head_table<S>(tb, h, dd * tb.k);
        for (int c = lane; c < tb.k; c += 32) {
            A s = 0;
            for (std::int64_t e = 0; e < dd; ++e) s += qs[e] * to_acc(tab[e * tb.k + c]);
            scratch[tb.slot + c] = s;
        }
    }
}

// Stages rows [r0, r0 + 32) of x (B·H, n, D) of plane p into tile (32, D + 1) as A (times mul):
// n = L for q and grad_out, L_k for k and v; rows from n on are zeros.
template <class S, class A>
__device__ inline void stage_tile(const S* x, std::int64_t p, std::int64_t r0, std::int64_t n, std::int64_t dd, A mul, A* tile) {
    for (std::int64_t e = threadIdx.x; e < 32 * dd; e += blockDim.x) {
        const std::int64_t rr = e / dd, c = e % dd, r = r0 + rr;
        tile[rr * (dd + 1) + c] = r < n ? to_acc(x[(p * n + r) * dd + c]) * mul : A(0);
    }
}

// Forward: one warp per query row, attn_warps rows per block, 32-key tiles of k and v staged in
// shared memory (converted to A), online softmax (running max m, running sum l); the output and
// the value term's per-bucket probability sums are rescaled together.
template <class S, class A, class Id>
__global__ void __launch_bounds__(attn_warps * 32) attention_forward_kernel(attn_args args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const std::int64_t n = args.n, dd = args.d;
    A* ktile = reinterpret_cast<A*>(smem_raw);  // (32, D + 1)
    A* vtile = ktile + 32 * (dd + 1);           // (32, D + 1)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    A* qs = vtile + 32 * (dd + 1) + warp * (2 * dd + args.scratch);  // (D): scaled query of this warp's row
    A* scratch = qs + 2 * dd;                                        // contextual-k products, v bucket sums
    S* out = static_cast<S*>(args.out);
    const A neg_inf = -std::numeric_limits<A>::infinity();

    for (std::int64_t p = blockIdx.y; p < args.planes; p += gridDim.y) {
        const std::int64_t h = p % args.heads, b = p / args.heads;
        const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * attn_warps + warp;
        const bool active = i < n;
        if (active) {
            load_query_row<S, A>(args, p, h, i, qs, scratch, lane);
            for (int t = 0; t < args.nv; ++t)
                for (int c = lane; c < args.on_v[t].k; c += 32) scratch[args.on_v[t].hist + c] = 0;
            __syncwarp();
        }
        A m = neg_inf, l = 0;
        A o[attn_max_dim / 32];
#pragma unroll
        for (int r = 0; r < attn_max_dim / 32; ++r) o[r] = 0;
        bool nan_seen = false;
        const std::int64_t nk = valid_keys(args, b);  // keys >= nk: padding (key_lengths), not computed
        for (std::int64_t j0 = 0; j0 < nk; j0 += 32) {
            __syncthreads();  // the previous tile is no longer read
            stage_tile<S, A>(static_cast<const S*>(args.k), p, j0, args.m, dd, A(1), ktile);
            stage_tile<S, A>(static_cast<const S*>(args.v), p, j0, args.m, dd, A(1), vtile);
            __syncthreads();
            if (!active) continue;
            const std::int64_t j = j0 + lane;
            A s = neg_inf;
            if (j < nk) {
                s = 0;
                for (std::int64_t c = 0; c < dd; ++c) s += qs[c] * ktile[lane * (dd + 1) + c];
                s += row_terms<S, A, Id>(args, p, h, i, j, scratch);
                if (args.key_padding_mask && args.key_padding_mask[b * args.m + j]) s = neg_inf;
                if (s != s) {  // NaN: the reference's softmax gives a NaN row
                    nan_seen = true;
                    s = neg_inf;
                }
            }
            nan_seen = __any_sync(0xffffffffu, nan_seen);
            const A m_new = fmax(m, warp_max(s));
            if (m_new == neg_inf) continue;  // every key so far masked
            const A alpha = m == neg_inf ? A(0) : exp(m - m_new);
            const A pj = s == neg_inf ? A(0) : exp(s - m_new);
            l = l * alpha + warp_sum(pj);
#pragma unroll
            for (int r = 0; r < attn_max_dim / 32; ++r) o[r] *= alpha;
            for (int t = 0; t < args.nv; ++t)
                for (int c = lane; c < args.on_v[t].k; c += 32) scratch[args.on_v[t].hist + c] *= alpha;
            __syncwarp();
            const int tile_keys = static_cast<int>(nk - j0 < 32 ? nk - j0 : 32);  // padded keys' v rows unread
            for (int jj = 0; jj < tile_keys; ++jj) {
                const A pb = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
                for (int r = 0; r < attn_max_dim / 32; ++r) {
                    const std::int64_t c = lane + 32 * r;
                    if (c < dd) o[r] += pb * vtile[jj * (dd + 1) + c];
                }
            }
            if (j < nk && pj != A(0))
                for (int t = 0; t < args.nv; ++t) {
                    const attn_table& tb = args.on_v[t];
                    atomicAdd(scratch + tb.hist + load_id<Id>(tb.ids, i, j), pj);
                }
            __syncwarp();
            m = m_new;
        }
        if (active) {
            const A inv = l > A(0) ? A(1) / l : A(0);  // l == 0: every key masked → zeros
#pragma unroll
            for (int r = 0; r < attn_max_dim / 32; ++r) {
                const std::int64_t c = lane + 32 * r;
                if (c >= dd) continue;
                A acc = o[r];
                for (int t = 0; t < args.nv; ++t) {
                    const attn_table& tb = args.on_v[t];
                    const S* tab = head_table<S>(tb, h, tb.k * dd);
                    for (int u = 0; u < tb.k; ++u) acc += scratch[tb.hist + u] * to_acc(tab[u * dd + c]);
                }
                const A val = nan_seen ? std::numeric_limits<A>::quiet_NaN() : acc * inv;
                out[(p * n + i) * dd + c] = from_acc<S>(val);
            }
        }
        __syncthreads();  // qs and scratch are rewritten for the next plane
    }
}

// Tensor-core forward (fp16, bf16; D a multiple of 16, ≤ 128; no value term): nvcuda::wmma
// 16×16×16 fragments with float accumulators. A block of attn_warps warps takes tc_rows query
// rows of one plane (16 per warp) and walks the valid keys in tiles of tc_keys: the q tile (once
// per plane) and each k and v tile are staged in S in shared memory (rows padded by tc_pad
// elements; rows past L or past the valid keys are zeros); each warp computes its 16 × tc_keys
// scores q·kᵀ (float), then per element scale, the RPE terms and masks (as row_terms; the
// contextual key products qs·table come from a (B·H, L, K) temporary as the query ones), the
// online softmax per row (float; two lanes per row), P rounded to S, and O += P·v with O in shared
// memory (float, rescaled by exp(m_old − m_new) before each tile's product).
inline constexpr int tc_rows = 16 * attn_warps;  // query rows per block
inline constexpr int tc_keys = 64;               // keys per tile
inline constexpr int tc_pad = 8;                 // S elements of padding per staged row (keeps 32-byte rows' alignment)
inline constexpr int tc_sld = tc_keys + 4;       // row stride of a warp's float scores
inline constexpr int tc_pld = tc_keys + 8;       // row stride of a warp's probabilities (S)

// Byte offsets of the tensor-core kernel's shared memory (every part 32-byte aligned, as wmma's
// loads and stores require): q, k, v tiles (tc_rows or tc_keys rows of ld_x S), then per warp its
// scores (16 × tc_sld float), probabilities (16 × tc_pld S) and output rows (16 × ld_o float).
struct tc_layout {
    int ld_x = 0, ld_o = 0;
    std::int64_t q = 0, k = 0, v = 0, sc = 0, pr = 0, o = 0, bytes = 0;
};
__host__ __device__ inline tc_layout tc_smem_layout(std::int64_t d, std::int64_t s_bytes) {
    tc_layout t;
    t.ld_x = static_cast<int>(d) + tc_pad;
    t.ld_o = static_cast<int>(d) + 4;
    t.k = t.q + tc_rows * t.ld_x * s_bytes;
    t.v = t.k + tc_keys * t.ld_x * s_bytes;
    t.sc = t.v + tc_keys * t.ld_x * s_bytes;
    t.pr = t.sc + attn_warps * 16 * tc_sld * 4;
    t.o = t.pr + attn_warps * 16 * tc_pld * s_bytes;
    t.bytes = t.o + attn_warps * 16 * t.ld_o * 4;
    return t;
}

// Whether this compilation pass has the wmma fragments of S: fp16 from sm_70, bf16 from sm_80
// (the host pass: yes; the host checks the kernel's PTX version before launching it).
template <class S>
__host__ __device__ constexpr bool tc_arch_has() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
    return false;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    return std::is_same_v<S, __half>;
#else
    return std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
#endif
}

// Rows [r0, r0 + rows) of x (B·H, n, D) of plane p (n = L for q, L_k for k and v) into tile (rows, ld) of S, zeros at rows ≥
// `valid`: 16-byte copies (D a multiple of 16, x 16-byte aligned: checked by the host).
template <class S>
__device__ inline void tc_stage(const S* x, std::int64_t p, std::int64_t r0, int rows, std::int64_t valid, std::int64_t n, int dd,
                                S* tile, int ld) {
    const int chunks = dd / 8;
    for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
        const int rr = e / chunks, ch = e % chunks;
        const std::int64_t r = r0 + rr;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < valid) val = *reinterpret_cast<const uint4*>(x + (p * n + r) * dd + ch * 8);
        *reinterpret_cast<uint4*>(tile + rr * ld + ch * 8) = val;
    }
}

// The RPE terms and the additive mask of logit (i, j), tensor-core kernel's view: as row_terms,
// with the contextual key products qs·table of row i read from a (B·H, L, K) temporary as the
// query products (k·s)·table of key j from theirs (B·H, L_k, K).
template <class S, class A, class Id>
__device__ inline A pair_terms(const attn_args& a, std::int64_t p, std::int64_t h, std::int64_t i, std::int64_t j) {
    A s = 0;
    for (int t = 0; t < a.nk; ++t) {
        const attn_table& tb = a.on_k[t];
        const std::int64_t id = load_id<Id>(tb.ids, i, j);
        s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id]) : static_cast<const A*>(tb.prod)[(p * a.n + i) * tb.k + id];
    }
    for (int t = 0; t < a.nq; ++t) {
        const attn_table& tb = a.on_q[t];
        const std::int64_t id = load_id<Id>(tb.ids, i, j);  // id(j, i)
        s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id]) : static_cast<const A*>(tb.prod)[(p * a.m + j) * tb.k + id];
    }
    if (a.attn_mask) s += to_acc(static_cast<const S*>(a.attn_mask)[i * a.m + j]);
    return s;
}

template <class S, class A, class Id>
__global__ void __launch_bounds__(attn_warps * 32) attention_forward_tc_kernel(attn_args args) {
    if constexpr (!tc_arch_has<S>()) {
        __trap();  // never launched: the host checks the PTX version first
    } else {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
        namespace wmma = nvcuda::wmma;
        extern __shared__ __align__(128) unsigned char tc_smem[];
        const std::int64_t n = args.n;
        const int dd = static_cast<int>(args.d);
        const tc_layout lay = tc_smem_layout(dd, sizeof(S));
        const int ldx = lay.ld_x, ldo = lay.ld_o;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        S* qt = reinterpret_cast<S*>(tc_smem + lay.q);
        S* kt = reinterpret_cast<S*>(tc_smem + lay.k);
        S* vt = reinterpret_cast<S*>(tc_smem + lay.v);
        A* sc = reinterpret_cast<A*>(tc_smem + lay.sc) + warp * 16 * tc_sld;  // this warp's scores, then logits
        S* pr = reinterpret_cast<S*>(tc_smem + lay.pr) + warp * 16 * tc_pld;  // this warp's probabilities
        A* ob = reinterpret_cast<A*>(tc_smem + lay.o) + warp * 16 * ldo;      // this warp's unnormalised output rows
        S* out = static_cast<S*>(args.out);
        const A neg_inf = -std::numeric_limits<A>::infinity();
        const A scale = static_cast<A>(args.scale);
        const int r = lane / 2, half = lane % 2;  // the row of this lane pair; this lane's keys 2t + half
        const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.x) * tc_rows, w0 = i0 + warp * 16, i = w0 + r;
        const bool warp_active = w0 < n, row_active = i < n;
        using frag_a = wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major>;
        using frag_kt = wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major>;  // kᵀ: k's rows as columns
        using frag_v = wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::row_major>;
        using frag_c = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

        for (std::int64_t p = blockIdx.y; p < args.planes; p += gridDim.y) {
            const std::int64_t h = p % args.heads, b = p / args.heads;
            __syncthreads();  // the previous plane's q tile and output rows are no longer read
            tc_stage<S>(static_cast<const S*>(args.q), p, i0, tc_rows, n, n, dd, qt, ldx);
            for (int e = lane; e < 16 * ldo; e += 32) ob[e] = 0;
            __syncwarp();
            A m = neg_inf, l = 0;
            bool nan_seen = false;
            const std::int64_t nk = valid_keys(args, b);  // keys >= nk: padding (key_lengths), staged as zeros
            for (std::int64_t j0 = 0; j0 < nk; j0 += tc_keys) {
                __syncthreads();  // the previous tile is no longer read
                tc_stage<S>(static_cast<const S*>(args.k), p, j0, tc_keys, nk, args.m, dd, kt, ldx);
                tc_stage<S>(static_cast<const S*>(args.v), p, j0, tc_keys, nk, args.m, dd, vt, ldx);
                __syncthreads();
                if (!warp_active) continue;
                // scores (16 × tc_keys) = q rows · kᵀ, float
                for (int jj = 0; jj < tc_keys / 16; ++jj) {
                    frag_c acc;
                    wmma::fill_fragment(acc, 0.0f);
                    if (j0 + jj * 16 < nk)
                        for (int c0 = 0; c0 < dd; c0 += 16) {
                            frag_a fa;
                            frag_kt fb;
                            wmma::load_matrix_sync(fa, qt + warp * 16 * ldx + c0, ldx);
                            wmma::load_matrix_sync(fb, kt + jj * 16 * ldx + c0, ldx);
                            wmma::mma_sync(acc, fa, fb, acc);
                        }
                    wmma::store_matrix_sync(sc + jj * 16, acc, tc_sld, wmma::mem_row_major);
                }
                __syncwarp();
                // logits: scale, RPE terms, masks (−∞; a NaN makes the row NaN), then the online softmax
                A tile_max = neg_inf;
                for (int t = 0; t < tc_keys / 2; ++t) {
                    const int c = 2 * t + half;
                    const std::int64_t j = j0 + c;
                    A s = neg_inf;
                    if (row_active && j < nk) {
                        s = sc[r * tc_sld + c] * scale + pair_terms<S, A, Id>(args, p, h, i, j);
                        if (args.key_padding_mask && args.key_padding_mask[b * args.m + j]) s = neg_inf;
                        if (s != s) {  // NaN: the reference's softmax gives a NaN row
                            nan_seen = true;
                            s = neg_inf;
                        }
                    }
                    sc[r * tc_sld + c] = s;
                    tile_max = fmax(tile_max, s);
                }
                tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
                nan_seen = __shfl_xor_sync(0xffffffffu, static_cast<int>(nan_seen), 1) != 0 || nan_seen;
                const A m_new = fmax(m, tile_max);
                const A alpha = m == neg_inf ? A(0) : exp(m - m_new);  // m_new = −∞: the row has no key yet, all zeros
                A sum = 0;
                for (int t = 0; t < tc_keys / 2; ++t) {
                    const int c = 2 * t + half;
                    const A s = sc[r * tc_sld + c];
                    const A pj = s == neg_inf ? A(0) : exp(s - m_new);
                    pr[r * tc_pld + c] = from_acc<S>(pj);
                    sum += pj;
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                l = l * alpha + sum;
                for (int c = half; c < dd; c += 2) ob[r * ldo + c] *= alpha;
                m = m_new;
                __syncwarp();
                // O (16 × D) += P (16 × tc_keys) · v tile (tc_keys × D)
                for (int c0 = 0; c0 < dd; c0 += 16) {
                    frag_c acc;
                    wmma::load_matrix_sync(acc, ob + c0, ldo, wmma::mem_row_major);
                    for (int kk = 0; kk < tc_keys / 16; ++kk) {
                        if (j0 + kk * 16 >= nk) break;  // zero probabilities, zero rows
                        frag_a fa;
                        frag_v fb;
                        wmma::load_matrix_sync(fa, pr + kk * 16, tc_pld);
                        wmma::load_matrix_sync(fb, vt + kk * 16 * ldx + c0, ldx);
                        wmma::mma_sync(acc, fa, fb, acc);
                    }
                    wmma::store_matrix_sync(ob + c0, acc, ldo, wmma::mem_row_major);
                }
                __syncwarp();
            }
            if (warp_active) {  // out = O / l (l = 0: every key masked → zeros; NaN rows NaN), coalesced rows
                if (half == 0) sc[r * tc_sld] = nan_seen ? std::numeric_limits<A>::quiet_NaN() : (l > A(0) ? A(1) / l : A(0));
                __syncwarp();
                for (int e = lane; e < 16 * dd; e += 32) {
                    const int rr = e / dd, c = e % dd;
                    if (w0 + rr < n) out[(p * n + w0 + rr) * dd + c] = from_acc<S>(ob[rr * ldo + c] * sc[rr * tc_sld]);
                }
            }
        }
#endif
    }
}

// Backward, row pass (one warp per query row i): recomputes the row's max m and sum l, then
// Σ_j P·dP, then dlogits dS = P ⊙ (dP − Σ P·dP) and writes grad_q = s·Σ_j dS_ij k_j, the per-row
// bucket sums of dS (key tables) and of P (value tables), and the row statistics.
// dP_ij = grad_out_i · v_j + (grad_out_i · table_v[id(i, j)]) with the latter from `prod`.
template <class S, class A, class Id>
__global__ void __launch_bounds__(attn_warps * 32) attention_backward_rows_kernel(attn_args args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const std::int64_t n = args.n, dd = args.d;
    A* ktile = reinterpret_cast<A*>(smem_raw);
    A* vtile = ktile + 32 * (dd + 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    A* qs = vtile + 32 * (dd + 1) + warp * (2 * dd + args.scratch);
    A* go = qs + dd;
    A* scratch = go + dd;
    const A neg_inf = -std::numeric_limits<A>::infinity();
    for (std::int64_t p = blockIdx.y; p < args.planes; p += gridDim.y) {
        const std::int64_t h = p % args.heads, b = p / args.heads;
        const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * attn_warps + warp;
        const bool active = i < n;
        if (active) {
            load_query_row<S, A>(args, p, h, i, qs, scratch, lane);
            for (std::int64_t c = lane; c < dd; c += 32)
                go[c] = to_acc(static_cast<const S*>(args.grad_out)[(p * n + i) * dd + c]);
            for (int t = 0; t < args.nk; ++t)
                for (int c = lane; c < args.on_k[t].k; c += 32) scratch[args.on_k[t].hist + c] = 0;
            for (int t = 0; t < args.nv; ++t)
                for (int c = lane; c < args.on_v[t].k; c += 32) scratch[args.on_v[t].hist + c] = 0;
            __syncwarp();
        }
        A m = neg_inf, l = 0, dsum = 0;
        A dq[attn_max_dim / 32];
#pragma unroll
        for (int r = 0; r < attn_max_dim / 32; ++r) dq[r] = 0;
        const std::int64_t nk = valid_keys(args, b);  // keys >= nk: padding (key_lengths), not computed
        for (int pass = 0; pass < 3; ++pass) {        // 0: m and l; 1: Σ P·dP; 2: dS and its sums
            for (std::int64_t j0 = 0; j0 < nk; j0 += 32) {
                __syncthreads();
                stage_tile<S, A>(static_cast<const S*>(args.k), p, j0, args.m, dd, A(1), ktile);
                if (pass > 0) stage_tile<S, A>(static_cast<const S*>(args.v), p, j0, args.m, dd, A(1), vtile);
                __syncthreads();
                if (!active) continue;
                const std::int64_t j = j0 + lane;
                A s = neg_inf;
                if (j < nk) {
                    s = 0;
                    for (std::int64_t c = 0; c < dd; ++c) s += qs[c] * ktile[lane * (dd + 1) + c];
                    s += row_terms<S, A, Id>(args, p, h, i, j, scratch);
                    if ((args.key_padding_mask && args.key_padding_mask[b * args.m + j]) || s != s) s = neg_inf;
                }
                if (pass == 0) {
                    const A m_new = fmax(m, warp_max(s));
                    if (m_new == neg_inf) continue;
                    const A alpha = m == neg_inf ? A(0) : exp(m - m_new);
                    l = l * alpha + warp_sum(s == neg_inf ? A(0) : exp(s - m_new));
                    m = m_new;
                    continue;
                }
                const A pj = (l > A(0) && s != neg_inf) ? exp(s - m) / l : A(0);
                A dp = 0;
                if (j < nk) {
                    for (std::int64_t c = 0; c < dd; ++c) dp += go[c] * vtile[lane * (dd + 1) + c];
                    for (int t = 0; t < args.nv; ++t) {
                        const attn_table& tb = args.on_v[t];
                        dp += static_cast<const A*>(tb.prod)[(p * n + i) * tb.k + load_id<Id>(tb.ids, i, j)];
                    }
                }
                if (pass == 1) {
                    dsum += pj * dp;
                    continue;
                }
                const A ds = pj * (dp - dsum);
                const int tile_keys = static_cast<int>(nk - j0 < 32 ? nk - j0 : 32);  // padded keys' k rows unread
                for (int jj = 0; jj < tile_keys; ++jj) {
                    const A db = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
                    for (int r = 0; r < attn_max_dim / 32; ++r) {
                        const std::int64_t c = lane + 32 * r;
                        if (c < dd) dq[r] += db * ktile[jj * (dd + 1) + c];
                    }
                }
                if (j < nk) {
                    for (int t = 0; t < args.nk; ++t) {
                        const attn_table& tb = args.on_k[t];
                        if (tb.rows) atomicAdd(scratch + tb.hist + load_id<Id>(tb.ids, i, j), ds);
                    }
                    for (int t = 0; t < args.nv; ++t) {
                        const attn_table& tb = args.on_v[t];
                        if (tb.rows && pj != A(0)) atomicAdd(scratch + tb.hist + load_id<Id>(tb.ids, i, j), pj);
                    }
                }
            }
            if (pass == 1) dsum = warp_sum(dsum);
        }
        if (active) {
            __syncwarp();
#pragma unroll
            for (int r = 0; r < attn_max_dim / 32; ++r) {
                const std::int64_t c = lane + 32 * r;
                if (c < dd) static_cast<S*>(args.grad_q)[(p * n + i) * dd + c] = from_acc<S>(dq[r] * static_cast<A>(args.scale));
            }
            for (int t = 0; t < args.nk; ++t)
                if (args.on_k[t].rows)
                    for (int c = lane; c < args.on_k[t].k; c += 32)
                        static_cast<A*>(args.on_k[t].rows)[(p * n + i) * args.on_k[t].k + c] = scratch[args.on_k[t].hist + c];
            for (int t = 0; t < args.nv; ++t)
                if (args.on_v[t].rows)
                    for (int c = lane; c < args.on_v[t].k; c += 32)
                        static_cast<A*>(args.on_v[t].rows)[(p * n + i) * args.on_v[t].k + c] = scratch[args.on_v[t].hist + c];
            if (lane == 0) {
                A* st = static_cast<A*>(args.stats) + (p * n + i) * 3;
                st[0] = m;
                st[1] = l;
                st[2] = dsum;
            }
        }
        __syncthreads();
    }
}

// Backward, column pass (one warp per key j < L_k, lanes over 32-query tiles): with the row statistics,
// recomputes P_ij and dS_ij and writes grad_k = Σ_i dS_ij qs_i, grad_v = Σ_i P_ij grad_out_i and
// the per-key bucket sums of dS by id(j, i) (query tables).
template <class S, class A, class Id>
__global__ void __launch_bounds__(attn_warps * 32) attention_backward_cols_kernel(attn_args args) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const std::int64_t n = args.n, m = args.m, dd = args.d;
    A* qtile = reinterpret_cast<A*>(smem_raw);  // (32, D + 1): scaled queries
    A* gtile = qtile + 32 * (dd + 1);           // (32, D + 1): grad_out rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    A* kj = gtile + 32 * (dd + 1) + warp * (2 * dd + args.scratch);
    A* vj = kj + dd;
    A* scratch = vj + dd;
    const A neg_inf = -std::numeric_limits<A>::infinity();
    for (std::int64_t p = blockIdx.y; p < args.planes; p += gridDim.y) {
        const std::int64_t h = p % args.heads, b = p / args.heads;
        const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * attn_warps + warp;
        const bool active = j < m;
        const bool padded = active && ((args.key_padding_mask && args.key_padding_mask[b * m + j]) || j >= valid_keys(args, b));
        if (active) {
            for (std::int64_t c = lane; c < dd; c += 32) {
                kj[c] = to_acc(static_cast<const S*>(args.k)[(p * m + j) * dd + c]);
                vj[c] = to_acc(static_cast<const S*>(args.v)[(p * m + j) * dd + c]);
            }
            for (int t = 0; t < args.nq; ++t)
                for (int c = lane; c < args.on_q[t].k; c += 32) scratch[args.on_q[t].hist + c] = 0;
            __syncwarp();
        }
        A dk[attn_max_dim / 32], dv[attn_max_dim / 32];
#pragma unroll
        for (int r = 0; r < attn_max_dim / 32; ++r) dk[r] = dv[r] = 0;
        for (std::int64_t i0 = 0; i0 < n; i0 += 32) {
            __syncthreads();
            stage_tile<S, A>(static_cast<const S*>(args.q), p, i0, n, dd, static_cast<A>(args.scale), qtile);
            stage_tile<S, A>(static_cast<const S*>(args.grad_out), p, i0, n, dd, A(1), gtile);
            __syncthreads();
            if (!active || padded) continue;  // a padded key: P = 0 for every query
            const std::int64_t i = i0 + lane;
            A pj = 0, ds = 0;
            if (i < n) {
                A s = 0;
                for (std::int64_t c = 0; c < dd; ++c) s += qtile[lane * (dd + 1) + c] * kj[c];
                for (int t = 0; t < args.nk; ++t) {
                    const attn_table& tb = args.on_k[t];
                    const std::int64_t id = load_id<Id>(tb.ids, i, j);  // id(i, j)
                    s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id])
                                 : static_cast<const A*>(tb.prod)[(p * n + i) * tb.k + id];
                }
                for (int t = 0; t < args.nq; ++t) {
                    const attn_table& tb = args.on_q[t];
                    const std::int64_t id = load_id<Id>(tb.ids, i, j);  // id(j, i)
                    s += tb.bias ? to_acc(head_table<S>(tb, h, tb.k)[id])
                                 : static_cast<const A*>(tb.prod)[(p * m + j) * tb.k + id];
                }
                if (args.attn_mask) s += to_acc(static_cast<const S*>(args.attn_mask)[i * m + j]);
                const A* st = static_cast<const A*>(args.stats) + (p * n + i) * 3;
                pj = (st[1] > A(0) && s == s && s != neg_inf) ? exp(s - st[0]) / st[1] : A(0);
                A dp = 0;
                for (std::int64_t c = 0; c < dd; ++c) dp += gtile[lane * (dd + 1) + c] * vj[c];
                for (int t = 0; t < args.nv; ++t) {
                    const attn_table& tb = args.on_v[t];
                    dp += static_cast<const A*>(tb.prod)[(p * n + i) * tb.k + load_id<Id>(tb.ids, i, j)];
                }
                ds = pj * (dp - st[2]);
                for (int t = 0; t < args.nq; ++t) {
                    const attn_table& tb = args.on_q[t];
                    if (tb.rows) atomicAdd(scratch + tb.hist + load_id<Id>(tb.ids, i, j), ds);
                }
            }
            for (int ii = 0; ii < 32; ++ii) {
                const A pb = __shfl_sync(0xffffffffu, pj, ii), db = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
                for (int r = 0; r < attn_max_dim / 32; ++r) {
                    const std::int64_t c = lane + 32 * r;
                    if (c < dd) {
                        dv[r] += pb * gtile[ii * (dd + 1) + c];
                        dk[r] += db * qtile[ii * (dd + 1) + c];
                    }
                }
            }
        }
        if (active) {
            __syncwarp();
#pragma unroll
            for (int r = 0; r < attn_max_dim / 32; ++r) {
                const std::int64_t c = lane + 32 * r;
                if (c < dd) {
                    static_cast<S*>(args.grad_k)[(p * m + j) * dd + c] = from_acc<S>(dk[r]);
                    static_cast<S*>(args.grad_v)[(p * m + j) * dd + c] = from_acc<S>(dv[r]);
                }
            }
            for (int t = 0; t < args.nq; ++t)
                if (args.on_q[t].rows)
                    for (int c = lane; c < args.on_q[t].k; c += 32)
                        static_cast<A*>(args.on_q[t].rows)[(p * m + j) * args.on_q[t].k + c] = scratch[args.on_q[t].hist + c];
        }
        __syncthreads();
    }
}

}  // namespace rpe::detail::gpu

namespace rpe::detail::gpu {

// What the kernel arguments of one call point at, alive until the call's work is enqueued
// (the stream-ordered buffers are freed after it on the call's stream): the tables' device ids
// (cached), at positions the linear positions of each slot's ids (queries, keys), and the
// key_lengths uploaded from their host copy.
struct attention_resources {
    std::vector<std::shared_ptr<const cuda::device_bucket_ids>> ids;
    std::vector<std::unique_ptr<device_buffer<std::int64_t>>> positions;
    std::unique_ptr<device_buffer<std::int32_t>> key_lengths;
};

// The kernel arguments of checked inputs (the public front checks them first) whose positions
// and key_lengths are in host memory (host_checked_inputs): the tables' device ids, uploaded at
// the call's widest id width (returned in `id_bytes`, for the one dispatch on the id type), and at
// positions the ids' linear positions (ids = term->bucket_ids(positions, key_positions), the
// CPU's; the device reads the per-offset ids of their bounding box), kept alive in `keep`.
template <class S>
attn_args prepare_attention(const rpe::attention_inputs<S>& in, double scale, cudaStream_t stream, attention_resources& keep,
                            int& id_bytes) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), n = in.q.extent(2), dd = in.q.extent(3);
    attn_args args;
    args.q = in.q.data;
    args.k = in.k.data;
    args.v = in.v.data;
    args.attn_mask = in.attn_mask.data;
    args.key_padding_mask = in.key_padding_mask.data;
    if (!is_empty_view(in.key_lengths)) {  // host memory (checked) -> a pageable copy -> device
        const std::vector<std::int32_t> lengths(in.key_lengths.data, in.key_lengths.data + b);
        keep.key_lengths = upload(lengths.data(), b, stream);
        args.key_lengths = keep.key_lengths->get();
    }
    args.n = n;
    args.m = in.k.extent(2);
    args.d = dd;
    args.heads = h;
    args.planes = b * h;
    args.scale = scale;
    const rpe::attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    const target wanted[] = {target::query, target::key, target::value};
    attn_table* dst[] = {args.on_q, args.on_k, args.on_v};
    int* counts[] = {&args.nq, &args.nk, &args.nv};
    std::shared_ptr<const bucket_ids> host_ids[3];
    id_bytes = 1;
    for (int s = 0; s < 3; ++s)
        if (slots[s]->term) {
            host_ids[s] = ids_of(*slots[s], in);  // the grid's, or at in.positions (host copies)
            id_bytes = std::max(id_bytes, host_ids[s]->id_bytes());
        }
    for (int s = 0; s < 3; ++s) {
        const auto& slot = *slots[s];
        if (!slot.term) continue;
        const term_desc& t = *slot.term;
        const auto shape = t.table_shape();
        const bucket_ids& host = *host_ids[s];
        // at positions: the bounding box grid's per-offset ids (a grid's ids, cached per box) and
        // the N query and key linear positions of these ids
        keep.ids.push_back(cuda::device_bucket_cache::global().get(host.at_positions() ? *host.box() : host, stream, id_bytes));
        const auto& dev = *keep.ids.back();
        id_positions pos{};
        if (host.at_positions()) {
            const id_positions hp = host.linear_positions();
            keep.positions.push_back(upload(hp.query, host.length() - host.skip(), stream));
            pos.query = keep.positions.back()->get();
            pos.key = pos.query;
            if (hp.key != hp.query) {  // the keys' own: N_k = L_k − skip of them
                keep.positions.push_back(upload(hp.key, host.key_length() - host.skip(), stream));
                pos.key = keep.positions.back()->get();
            }
            pos.base = hp.base;
        }
        for (int u = 0; u < t.num_tables(); ++u) {
            attn_table& at = dst[s][(*counts[s])++];
            at.table = slot.tables[static_cast<std::size_t>(u)].data;
            at.k = t.num_buckets();
            at.table_heads = static_cast<int>(shape[0]);
            at.bias = !t.contextual();
            // ids(i, j) of pair (i, j): id(i, j) for k and v, id(j, i) for q
            at.ids = attn_ids{dev.offsets(u), wanted[s] == target::query, host.grid(), pos};
        }
    }
    return args;
}

template <class A>
std::int64_t attention_smem(const attn_args& a) {
    return static_cast<std::int64_t>(sizeof(A)) * (2 * 32 * (a.d + 1) + attn_warps * (2 * a.d + a.scratch));
}

// Launches `kernel` with one warp per row of `rows` (the queries L for the forward and the
// backward's row pass, the keys L_k for its column pass) and the planes on the grid's y.
template <class Kernel, class A>
void launch_attention(Kernel kernel, const attn_args& args, std::int64_t rows, cudaStream_t stream, const char* what) {
    const std::int64_t smem = attention_smem<A>(args);
    int device = 0, smem_max = 0;
    RPE_CUDA_CHECK(cudaGetDevice(&device));
    RPE_CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    require(smem <= smem_max, "attention", "shared memory need = ", smem, " bytes (D = ", args.d,
            ", bucket slots per row = ", args.scratch, "); expected at most ", smem_max, " on this device");
    RPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const dim3 grid(static_cast<unsigned>((rows + attn_warps - 1) / attn_warps),
                    static_cast<unsigned>(std::min<std::int64_t>(args.planes, 65535)));
    kernel<<<grid, attn_warps * 32, static_cast<std::size_t>(smem), stream>>>(args);
    check_launch(what);
}

// (B·H, R, K) = alpha · x (B·H, R, D) · table[h'] (D, K) for each contextual table of `tables`,
// into prod; R = `rows` (L for x = q or grad_out, L_k for x = k).
template <class S, class A>
void table_products(attn_table* tables, int count, const S* x, std::int64_t rows, const attn_args& a, A alpha, A* buf,
                    bool transposed_v, cudaStream_t stream) {
    std::int64_t off = 0;
    for (int t = 0; t < count; ++t) {
        auto& at = tables[t];
        if (at.bias) continue;
        gemm_shape g{rows, at.k, a.d, a.planes, rows * a.d, a.d * at.k, rows * at.k, true, a.heads, at.table_heads};
        if (transposed_v)  // value table (Ht, K, D): x · tableᵀ
            gemm<false, true, A>(g, x, static_cast<const S*>(at.table), buf + off, false, alpha, stream);
        else
            gemm<false, false, A>(g, x, static_cast<const S*>(at.table), buf + off, false, alpha, stream);
        at.prod = buf + off;
        off += a.planes * rows * at.k;
    }
}

// Elements of the (B·H, R, K) products of the contextual tables of `tables` (all of them with `all`).
inline std::int64_t contextual_size(const attn_table* tables, int count, std::int64_t rows, const attn_args& a,
                                    bool all = false) {
    std::int64_t s = 0;
    for (int t = 0; t < count; ++t)
        if (all || !tables[t].bias) s += a.planes * rows * tables[t].k;
    return s;
}

// Whether the forward takes the tensor-core kernel when attention_options::tensor_cores is
// unset: tc_default_on, or the environment variable RPE_CUDA_ATTENTION_TENSOR_CORES when set
// (`0`: off, anything else: on), read once per process.
inline constexpr bool tc_default_on = true;  // run on an H200 on 2026-12-04 (docs/cuda.md)
inline bool tensor_cores_by_default() {
    static const bool on = [] {
        const char* e = std::getenv("RPE_CUDA_ATTENTION_TENSOR_CORES");
        if (e == nullptr || *e == '\0') return tc_default_on;
        return std::strcmp(e, "0") != 0;
    }();
    return on;
}

template <int N>
__global__ void tc_probe_kernel() {}

// Whether the tensor-core forward kernel of S runs on the current device: the PTX version the
// device's code of this program was built from (cudaFuncGetAttributes of a kernel of it; it is
// the __CUDA_ARCH__ of the kernels' pass) has S's fragments, and the kernel's shared memory for
// head dim d fits the device's opt-in limit.
template <class S>
bool tc_device_supports(std::int64_t d) {
    cudaFuncAttributes attr{};
    RPE_CUDA_CHECK(cudaFuncGetAttributes(&attr, tc_probe_kernel<0>));
    const int need = std::is_same_v<S, __nv_bfloat16> ? 80 : 70;
    if (attr.ptxVersion < need) return false;
    int device = 0, smem_max = 0;
    RPE_CUDA_CHECK(cudaGetDevice(&device));
    RPE_CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return tc_smem_layout(d, sizeof(S)).bytes <= smem_max;
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether the forward of these (checked) inputs takes the tensor-core kernel: S fp16 or bf16,
// D a multiple of 16 and ≤ 128, no value term, q and k and v 16-byte aligned, `tensor_cores`
// (attention_options::tensor_cores, or tensor_cores_by_default when unset), and a device that
// runs it (tc_device_supports).
template <class S>
bool tensor_core_forward(const rpe::attention_inputs<S>& in, std::optional<bool> tensor_cores) {
    if constexpr (!std::is_same_v<S, __half> && !std::is_same_v<S, __nv_bfloat16>) {
        return false;
    } else {
        const std::int64_t d = in.q.extent(3);
        if (!tensor_cores.value_or(tensor_cores_by_default()) || d % 16 != 0 || d > attn_max_dim || in.rpe_v.term != nullptr)
            return false;
        if (!aligned16(in.q.data) || !aligned16(in.k.data) || !aligned16(in.v.data)) return false;
        return tc_device_supports<S>(d);
    }
}

// The forward after the checks: the kernels on in.q, in.k as given (already rotated with RoPE):
// the tensor-core kernel where tensor_core_forward says so (the contextual key products qs·table
// computed first into a (B·H, L, K) temporary, a batched GEMM), else the SIMT kernel.
template <class S>
void attention_forward_impl(const rpe::attention_inputs<S>& in, tensor_ref<S> out, double scale, std::optional<bool> tensor_cores,
                            cudaStream_t stream) {
    using A = acc_t<S>;
    detail::gpu::attention_resources keep;
    int id_bytes = 1;
    auto args = detail::gpu::prepare_attention(in, scale, stream, keep, id_bytes);
    args.out = out.data;
    if (tensor_core_forward(in, tensor_cores)) {
        // (B·H, L_k, K) per q table, (B·H, L, K) per k table
        detail::gpu::device_buffer<A> tq(detail::gpu::contextual_size(args.on_q, args.nq, args.m, args), stream);
        detail::gpu::device_buffer<A> tk(detail::gpu::contextual_size(args.on_k, args.nk, args.n, args), stream);
        detail::gpu::table_products(args.on_q, args.nq, in.k.data, args.m, args, static_cast<A>(args.scale), tq.get(), false,
                                    stream);
        detail::gpu::table_products(args.on_k, args.nk, in.q.data, args.n, args, static_cast<A>(args.scale), tk.get(), false,
                                    stream);
        const std::int64_t smem = tc_smem_layout(args.d, sizeof(S)).bytes;
        visit_id_width(id_bytes, [&]<class Id>() {
            const auto kernel = detail::gpu::attention_forward_tc_kernel<S, A, Id>;
            RPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
            const dim3 grid(static_cast<unsigned>((args.n + tc_rows - 1) / tc_rows),
                            static_cast<unsigned>(std::min<std::int64_t>(args.planes, 65535)));
            kernel<<<grid, attn_warps * 32, static_cast<std::size_t>(smem), stream>>>(args);
            check_launch("attention_forward_tc_kernel");
        });
        return;
    }
    int scratch = 0;  // per warp: contextual key products, then value bucket sums
    for (int t = 0; t < args.nk; ++t)
        if (!args.on_k[t].bias) {
            args.on_k[t].slot = scratch;
            scratch += args.on_k[t].k;
        }
    for (int t = 0; t < args.nv; ++t) {
        args.on_v[t].hist = scratch;
        scratch += args.on_v[t].k;
    }
    args.scratch = scratch;
    // (B·H, L_k, K) per q table
    detail::gpu::device_buffer<A> tq(detail::gpu::contextual_size(args.on_q, args.nq, args.m, args), stream);
    detail::gpu::table_products(args.on_q, args.nq, in.k.data, args.m, args, static_cast<A>(args.scale), tq.get(), false, stream);
    visit_id_width(id_bytes, [&]<class Id>() {
        detail::gpu::launch_attention<decltype(&detail::gpu::attention_forward_kernel<S, A, Id>), A>(
            detail::gpu::attention_forward_kernel<S, A, Id>, args, args.n, stream, "attention_forward_kernel");
    });
}

// The backward after the checks: gradients of in.q, in.k as given (the rotated ones with RoPE).
template <class S>
void attention_backward_impl(const rpe::attention_inputs<S>& in, tensor_ref<const S> grad_out, tensor_ref<S> grad_q,
                             tensor_ref<S> grad_k, tensor_ref<S> grad_v, double softmax_scale, cudaStream_t stream) {
    using A = acc_t<S>;
    detail::gpu::attention_resources keep;
    int id_bytes = 1;
    auto args = detail::gpu::prepare_attention(in, softmax_scale, stream, keep, id_bytes);
    const std::int64_t h = args.heads, n = args.n, m = args.m, dd = args.d, planes = args.planes;
    const auto rows_of = [&](int s) { return s == 0 ? m : n; };  // q tables: per key (L_k); k, v tables: per query (L)
    args.grad_out = grad_out.data;
    args.grad_q = grad_q.data;
    args.grad_k = grad_k.data;
    args.grad_v = grad_v.data;
    // which tables want gradients; per-row bucket sums are needed for every contextual q/k table
    // (they feed grad_q / grad_k) and for the others only when their gradient is wanted
    const rpe::attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    detail::gpu::attn_table* groups[] = {args.on_q, args.on_k, args.on_v};
    const int counts[] = {args.nq, args.nk, args.nv};
    S* grads[3][detail::gpu::attn_max_tables] = {};
    std::int64_t rows_size = 0;
    for (int s = 0; s < 3; ++s)
        for (int t = 0; t < counts[s]; ++t) {
            const auto& g = slots[s]->grad_tables;
            grads[s][t] = static_cast<std::size_t>(t) < g.size() ? g[static_cast<std::size_t>(t)].data : nullptr;
            if (grads[s][t] || (s < 2 && !groups[s][t].bias)) rows_size += planes * rows_of(s) * groups[s][t].k;
        }
    detail::gpu::device_buffer<A> rows(rows_size, stream);
    {
        std::int64_t off = 0;
        for (int s = 0; s < 3; ++s)
            for (int t = 0; t < counts[s]; ++t)
                if (grads[s][t] || (s < 2 && !groups[s][t].bias)) {
                    groups[s][t].rows = rows.get() + off;
                    off += planes * rows_of(s) * groups[s][t].k;
                }
    }
    // products: q tables (k·s)·table, k tables qs·table, v tables grad_out·tableᵀ
    detail::gpu::device_buffer<A> tq(detail::gpu::contextual_size(args.on_q, args.nq, m, args), stream);
    detail::gpu::device_buffer<A> tk(detail::gpu::contextual_size(args.on_k, args.nk, n, args), stream);
    detail::gpu::device_buffer<A> wv(detail::gpu::contextual_size(args.on_v, args.nv, n, args), stream);
    detail::gpu::table_products(args.on_q, args.nq, in.k.data, m, args, static_cast<A>(args.scale), tq.get(), false, stream);
    detail::gpu::table_products(args.on_k, args.nk, in.q.data, n, args, static_cast<A>(args.scale), tk.get(), false, stream);
    detail::gpu::table_products(args.on_v, args.nv, grad_out.data, n, args, A(1), wv.get(), true, stream);
    detail::gpu::device_buffer<A> stats(planes * n * 3, stream);
    args.stats = stats.get();

    // row pass: scratch per warp = contextual k products, then k bucket sums, then v bucket sums
    int scratch = 0;
    for (int t = 0; t < args.nk; ++t)
        if (!args.on_k[t].bias) {
            args.on_k[t].slot = scratch;
            scratch += args.on_k[t].k;
        }
    for (int t = 0; t < args.nk; ++t) {
        args.on_k[t].hist = scratch;
        scratch += args.on_k[t].k;
    }
    for (int t = 0; t < args.nv; ++t) {
        args.on_v[t].hist = scratch;
        scratch += args.on_v[t].k;
    }
    args.scratch = scratch;
    visit_id_width(id_bytes, [&]<class Id>() {
        detail::gpu::launch_attention<decltype(&detail::gpu::attention_backward_rows_kernel<S, A, Id>), A>(
            detail::gpu::attention_backward_rows_kernel<S, A, Id>, args, n, stream, "attention_backward_rows_kernel");
    });
    // column pass: scratch per warp = q bucket sums (the row pass's k products now come from tk)
    scratch = 0;
    for (int t = 0; t < args.nq; ++t) {
        args.on_q[t].hist = scratch;
        scratch += args.on_q[t].k;
    }
    args.scratch = scratch;
    visit_id_width(id_bytes, [&]<class Id>() {
        detail::gpu::launch_attention<decltype(&detail::gpu::attention_backward_cols_kernel<S, A, Id>), A>(
            detail::gpu::attention_backward_cols_kernel<S, A, Id>, args, m, stream, "attention_backward_cols_kernel");
    });

    // tables: input gradients through the contextual tables, then table gradients
    const A scale = static_cast<A>(args.scale);
    std::int64_t part_size = 0;
    for (int s = 0; s < 3; ++s)
        for (int t = 0; t < counts[s]; ++t)
            if (grads[s][t] && !groups[s][t].bias) part_size = std::max<std::int64_t>(part_size, planes * dd * groups[s][t].k);
    detail::gpu::device_buffer<A> part(part_size, stream);
    for (int s = 0; s < 3; ++s)
        for (int t = 0; t < counts[s]; ++t) {
            const auto& at = groups[s][t];
            const std::int64_t k = at.k;
            const S* table = static_cast<const S*>(at.table);
            const A* g = static_cast<const A*>(at.rows);
            const std::int64_t r = rows_of(s);  // G's rows: L_k for q tables, L for k and v tables
            if (s < 2 && !at.bias) {            // grad_q (k tables) or grad_k (q tables) += s · G · tableᵀ
                detail::gpu::gemm_shape gs{r, dd, k, planes, r * k, dd * k, r * dd, true, h, at.table_heads};
                detail::gpu::gemm<false, true, A>(gs, g, table, s == 1 ? grad_q.data : grad_k.data, true, scale, stream);
            }
            if (!grads[s][t]) continue;
            if (at.bias) {  // bucket sums per row, reduced over rows, batch and (shared) heads
                detail::gpu::reduce_partials(g, planes, h, at.table_heads, r, k, false, grads[s][t], stream);
            } else if (s < 2) {  // grad_table (D, K) = Σ s · xᵀ · G, x = q (k tables) or k (q tables)
                detail::gpu::gemm_shape gs{dd, k, r, planes, r * dd, r * k, dd * k, false, h, at.table_heads};
                detail::gpu::gemm<true, false, A>(gs, s == 1 ? in.q.data : in.k.data, g, part.get(), false, scale, stream);
                detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, h, at.table_heads, 1, dd * k, false,
                                             grads[s][t], stream);
            } else {  // value table (K, D) = Σ Svᵀ · grad_out
                detail::gpu::gemm_shape gs{k, dd, n, planes, n * k, n * dd, k * dd, false, h, at.table_heads};
                detail::gpu::gemm<true, false, A>(gs, g, grad_out.data, part.get(), false, A(1), stream);
                detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, h, at.table_heads, 1, k * dd, false,
                                             grads[s][t], stream);
            }
        }
}

// q and k rotated by in.rope into device scratch (storage type S, stream-ordered, freed at scope
// exit) and the inputs that the kernels then read: `in` with those q, k and no rope. q turns by
// table tq, k by tk (the keys' positions; tq's when the keys have none).
template <class S>
struct rotated_inputs {
    device_buffer<S> q, k;  // (B, H, L, D) and (B, H, L_k, D)
    rpe::attention_inputs<S> inputs;

    rotated_inputs(const rpe::attention_inputs<S>& in, const attention_shape& s, const rope_view<acc_t<S>>& tq,
                   const rope_view<acc_t<S>>& tk, cudaStream_t stream)
        : q(s.b * s.h * s.l * s.d, stream), k(s.b * s.h * s.lk * s.d, stream), inputs(in) {
        rope_rotate<S>(tq, in.q.data, q.get(), s.b * s.h, s.h, s.l, false, stream);
        rope_rotate<S>(tk, in.k.data, k.get(), s.b * s.h, s.h, s.lk, false, stream);
        inputs.q.data = q.get();
        inputs.k.data = k.get();
        inputs.rope = {};
    }
};

// The attention inputs with every view that the shared front checks read on the host in host
// memory: RoPE positions (host_rope_positions), the iRPE terms' positions and key_positions when a
// term is attached (also what the ids are built from; without a term nothing reads them: they stay
// as given, neither copied nor waited for), key_lengths (uploaded again by prepare_attention) and
// the packed sequences' lengths, grids and positions (attention_inputs::packed: the images' token
// ranges, grids and ids are made on the host).
// `in` itself when none of these is in device memory, else a copy pointing at host copies (waited
// for).
template <class S>
struct host_checked_inputs {
    host_rope_positions<S> hp;
    std::vector<std::int32_t> positions, key_positions, key_lengths;
    std::vector<std::int32_t> packed_lengths, packed_grids, packed_positions;  // attention_inputs::packed's views
    std::optional<rpe::attention_inputs<S>> copy;
    host_checked_inputs(const rpe::attention_inputs<S>& in, cudaStream_t stream) : hp(in.rope, stream) {
        bool copied = false;
        const bool with_terms = in.rpe_q.term || in.rpe_k.term || in.rpe_v.term;  // the only readers of positions
        const auto pos = with_terms ? host_view(in.positions, positions, stream, copied) : in.positions;
        const auto kpos = with_terms ? host_view(in.key_positions, key_positions, stream, copied) : in.key_positions;
        const auto lengths = host_view(in.key_lengths, key_lengths, stream, copied);
        const packed_sequences pk{host_view(in.packed.lengths, packed_lengths, stream, copied),
                                  host_view(in.packed.grids, packed_grids, stream, copied),
                                  host_view(in.packed.positions, packed_positions, stream, copied)};
        if (copied) RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
        if (copied || in.rope.has_positions()) {
            copy.emplace(in);
            copy->rope = hp.r;
            copy->positions = pos;
            copy->key_positions = kpos;
            copy->key_lengths = lengths;
            copy->packed = pk;
        }
    }
    host_checked_inputs(const host_checked_inputs&) = delete;  // copy points into the vectors
    host_checked_inputs& operator=(const host_checked_inputs&) = delete;
    const rpe::attention_inputs<S>& of(const rpe::attention_inputs<S>& in) const { return copy ? *copy : in; }
};

// Copies `height` rows of `width` elements from src (rows `src_pitch` elements apart) to dst
// (rows `dst_pitch` apart) on `stream`: one cudaMemcpy2DAsync (device or host memory alike).
template <class T>
void copy_rows(T* dst, std::int64_t dst_pitch, const T* src, std::int64_t src_pitch, std::int64_t width, std::int64_t height,
               cudaStream_t stream) {
    if (width <= 0 || height <= 0) return;
    const std::size_t e = sizeof(T);
    RPE_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(dst_pitch) * e, src, static_cast<std::size_t>(src_pitch) * e,
                                     static_cast<std::size_t>(width) * e, static_cast<std::size_t>(height), cudaMemcpyDefault,
                                     stream));
}

// A packed image's rows of a contiguous (B, H, L, D) tensor (`slice` = token_slice(x, {2}, off,
// len): (B, H, len, D), planes L·D apart) as a contiguous (B, H, len, D) view: the slice itself when
// it is contiguous (one image, or B·H = 1), else `scratch` (B·H·len·D elements), filled with the
// rows when `gather` (inputs; outputs are written back by put_rows).
template <class T>
tensor_ref<T> image_rows(const tensor_ref<T>& slice, std::remove_const_t<T>* scratch, bool gather, cudaStream_t stream) {
    const std::int64_t shape[] = {slice.extent(0), slice.extent(1), slice.extent(2), slice.extent(3)};
    if (slice.contiguous()) return tensor_ref<T>(slice.data, shape);
    const std::int64_t row = slice.extent(2) * slice.extent(3);
    if (gather) copy_rows<std::remove_const_t<T>>(scratch, row, slice.data, slice.stride(1), row, shape[0] * shape[1], stream);
    return tensor_ref<T>(scratch, shape);
}

// Writes image rows computed into `rows` (image_rows of `slice`) back into the slice's rows of the
// whole tensor (nothing when they are the slice itself).
template <class T>
void put_rows(const tensor_ref<T>& slice, const tensor_ref<T>& rows, cudaStream_t stream) {
    if (rows.data == slice.data) return;
    const std::int64_t row = slice.extent(2) * slice.extent(3);
    copy_rows(slice.data, slice.stride(1), rows.data, row, row, slice.extent(0) * slice.extent(1), stream);
}

// A packed image's masks as contiguous device views: its (len, len) block of attn_mask (L, L)
// and its (B, len) columns of key_padding_mask (B, L), gathered into `am`, `kpm` when they are
// not contiguous.
template <class S>
void image_masks(rpe::attention_inputs<S>& c, S* am, std::uint8_t* kpm, cudaStream_t stream) {
    if (!is_empty_view(c.attn_mask)) {
        const std::int64_t len = c.attn_mask.extent(0);
        if (!c.attn_mask.contiguous()) copy_rows(am, len, c.attn_mask.data, c.attn_mask.stride(0), len, len, stream);
        c.attn_mask = tensor_ref<const S>(c.attn_mask.contiguous() ? c.attn_mask.data : am, {len, len});
    }
    if (!is_empty_view(c.key_padding_mask)) {
        const std::int64_t b = c.key_padding_mask.extent(0), len = c.key_padding_mask.extent(1);
        if (!c.key_padding_mask.contiguous())
            copy_rows(kpm, len, c.key_padding_mask.data, c.key_padding_mask.stride(0), len, b, stream);
        c.key_padding_mask =
            tensor_ref<const std::uint8_t>(c.key_padding_mask.contiguous() ? c.key_padding_mask.data : kpm, {b, len});
    }
}

// dst[e] = dst[e] + src[e] (in A, rounded to S once: the CPU's sum of the images' table gradients).
template <class S>
__global__ void add_into_kernel(S* __restrict__ dst, const S* __restrict__ src, std::int64_t n) {
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
        dst[e] = from_acc<S>(to_acc(dst[e]) + to_acc(src[e]));
}

// The scratch of the packed calls: per image rows of q, k, v and one or more outputs
// ((B, H, longest, D) each; none when B·H = 1: the rows are then contiguous) and its masks
// ((longest, longest), (B, longest)), allocated once for the longest image (0: one image, nothing
// gathered) and reused image after image (stream-ordered).
template <class S>
struct packed_scratch {
    std::int64_t rows;
    device_buffer<S> am;
    device_buffer<std::uint8_t> kpm;
    std::vector<std::unique_ptr<device_buffer<S>>> x;
    packed_scratch(const rpe::attention_inputs<S>& in, std::int64_t longest, int count, cudaStream_t stream)
        : rows(in.q.extent(0) * in.q.extent(1) == 1 ? 0 : in.q.extent(0) * in.q.extent(1) * longest * in.q.extent(3)),
          am(is_empty_view(in.attn_mask) ? 0 : longest * longest, stream),
          kpm(is_empty_view(in.key_padding_mask) ? 0 : in.q.extent(0) * longest, stream) {
        for (int i = 0; i < count; ++i) x.push_back(std::make_unique<device_buffer<S>>(rows, stream));
    }
    S* operator[](int i) const { return x[static_cast<std::size_t>(i)]->get(); }
};

template <class S>
std::int64_t longest_image(const std::vector<packed_image<S>>& images) {
    std::int64_t longest = 0;
    for (const auto& img : images) longest = std::max(longest, img.length);
    return longest;
}

// Packed sequences (attention_inputs::packed, checked): each image runs as a call of its own on
// its rows of q, k, v (its grid's or its positions' ids, its block of the masks), its output
// scattered into its rows of out, image after image on the stream. Per image: the kernels and
// GEMMs of one call on (B, H, len, D), and (when the rows are not contiguous: more than one image
// and B·H > 1) 3 cudaMemcpy2DAsync gathers of q, k, v, one of each mask, and 1 scatter of out.
template <class S>
void packed_forward(const rpe::attention_inputs<S>& in, tensor_ref<S> out, double scale, std::optional<bool> tensor_cores,
                    cudaStream_t stream) {
    const auto images = packed_images(in);
    const packed_scratch<S> buf(in, images.size() == 1 ? 0 : longest_image(images), 4, stream);
    for (const auto& img : images) {
        rpe::attention_inputs<S> c = img.in;
        c.q = image_rows(c.q, buf[0], true, stream);
        c.k = image_rows(c.k, buf[1], true, stream);
        c.v = image_rows(c.v, buf[2], true, stream);
        image_masks(c, buf.am.get(), buf.kpm.get(), stream);
        const auto slice = token_slice(out, {2}, img.offset, img.length);
        const auto rows = image_rows(slice, buf[3], false, stream);
        attention_forward_impl(c, rows, scale, tensor_cores, stream);
        put_rows(slice, rows, stream);
    }
}

// The backward of packed_forward: each image's gradients of q, k, v into its rows (gathered
// grad_out, as the forward's inputs: 4 gathers and 3 scatters per image when not contiguous); the
// table gradients of image 0 written in place, each later image's into scratch and added
// (add_into_kernel, one launch per table and image: the images' sum in image order, as the CPU's).
template <class S>
void packed_backward(const rpe::attention_inputs<S>& in, const attention_gradients<S>& g, double scale, cudaStream_t stream) {
    auto images = packed_images(in);
    const packed_scratch<S> buf(in, images.size() == 1 ? 0 : longest_image(images), 7, stream);
    std::int64_t table_size = 0;  // every wanted table gradient, for the images after the first
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->grad_tables)
            if (t.data) table_size += t.size();
    const device_buffer<S> tables(images.size() > 1 ? table_size : 0, stream);
    for (std::size_t m = 0; m < images.size(); ++m) {
        const auto& img = images[m];
        rpe::attention_inputs<S> c = img.in;
        c.q = image_rows(c.q, buf[0], true, stream);
        c.k = image_rows(c.k, buf[1], true, stream);
        c.v = image_rows(c.v, buf[2], true, stream);
        image_masks(c, buf.am.get(), buf.kpm.get(), stream);
        const auto rows = [&](auto t) { return token_slice(t, {2}, img.offset, img.length); };
        const tensor_ref<const S> grad_out = image_rows(rows(g.grad_out), buf[3], true, stream);
        const tensor_ref<S> sq = rows(g.grad_q), sk = rows(g.grad_k), sv = rows(g.grad_v);
        const tensor_ref<S> gq = image_rows(sq, buf[4], false, stream), gk = image_rows(sk, buf[5], false, stream),
                            gv = image_rows(sv, buf[6], false, stream);
        std::vector<std::pair<tensor_ref<S>, S*>> sums;  // (a table gradient, image m's scratch of it), m > 0
        if (m > 0) {
            S* next = tables.get();
            for (auto* slot : {&c.rpe_q, &c.rpe_k, &c.rpe_v})
                for (auto& t : slot->grad_tables)
                    if (t.data) {
                        sums.emplace_back(t, next);
                        t = tensor_ref<S>(next, std::span<const std::int64_t>(t.shape.data(), static_cast<std::size_t>(t.rank)));
                        next += t.size();
                    }
        }
        attention_backward_impl(c, grad_out, gq, gk, gv, scale, stream);
        put_rows(sq, gq, stream);
        put_rows(sk, gk, stream);
        put_rows(sv, gv, stream);
        for (const auto& [given, scratch] : sums) {
            const std::int64_t n = given.size();
            const int blocks = static_cast<int>(std::min<std::int64_t>((n + 255) / 256, 4096));
            add_into_kernel<S><<<blocks, 256, 0, stream>>>(given.data, scratch, n);
            check_launch("add_into_kernel");
        }
    }
}

// The q and k tables of an attention call with RoPE (checked): q at rope.positions (or the grid),
// k at rope.key_positions (or the queries' table).
template <class S>
struct rope_qk_tables {
    rope_call_table<S> q;
    std::optional<rope_call_table<S>> k;
    rope_qk_tables(const rotary_embedding<S>& r, const attention_shape& s, int height, int width, cudaStream_t stream)
        : q(r, query_positions(r), s.h, s.d, height, width, stream) {
        if (r.key_positions.data) k.emplace(r, &r.key_positions, s.h, s.d, height, width, stream);
    }
    const rope_view<acc_t<S>>& qv() const { return q.view(); }
    const rope_view<acc_t<S>>& kv() const { return k ? k->view() : q.view(); }
};

}  // namespace rpe::detail::gpu

namespace rpe::cuda {

/// @brief Fused forward of the attention step on the GPU (the reference's `RPEAttention.forward` order), as rpe::attention_forward:
/// `qs = q·s`, `s = opt.scale` (default `D^−½`); `logits = qs·kᵀ + rpe_k(qs) + rpe_q(k·s) + attn_mask`, key padding
/// mask (−∞), softmax over keys, `out = a·v + rpe_v(a)`; no (B, H, L, L) buffer: one warp per
/// query row streams 32-key tiles with an online softmax (flash-attention style) and keeps the
/// value term's per-bucket probability sums in shared memory. fp16 and bf16 calls with D a
/// multiple of 16 and no value term take a tensor-core kernel instead (64 query rows per
/// block, 64-key tiles, wmma 16×16×16 products with float accumulation, probabilities rounded to
/// S for P·v; attention_forward_uses_tensor_cores says whether a call takes it; `opt.tensor_cores
/// = false` or the environment variable RPE_CUDA_ATTENTION_TENSOR_CORES=0 keep the SIMT kernel):
/// the same results within S's rounding.
///
/// Contextual key terms: per row, qs·table (K values) in shared memory; contextual query terms:
/// (k·s)·table per (b, h), a (B, H, L_k, K) temporary (batched GEMM) read by bucket; bias terms:
/// table reads. Rows whose keys are all masked give zeros (the reference gives NaN); a NaN logit
/// makes its row NaN. Probabilities are not returned (there is no (L, L) buffer): a non-empty
/// `attn` is refused (attention_caps, rpe::not_supported).
/// @param in     device q (B, H, L, D), k and v (B, H, L_k, D) (contiguous), masks, tables; host
///   term descriptors.
/// @param out    (B, H, L, D), device, written.
/// @param attn   must be empty (`{}`): the CUDA backend has no saved-probabilities output.
/// @param opt    `opt.scale` the softmax scale; `opt.stream` the caller's stream (nothing waits:
///   a miss of the bucket-id cache or of the fixed RoPE tables' cache waits for its upload);
///   `opt.tensor_cores` chooses the fp16/bf16 kernel (unset: the process default); row_block ignored.
/// @pre D ≤ 128; S float, double, __half or __nv_bfloat16 (float accumulation; double for double).
/// @throws rpe::invalid_argument `[rpe.attention] ...` for mismatched shapes, grid, heads, a term
///   on the wrong slot, D > 128 or a shared-memory need beyond the device's; rpe::cuda_error.
/// Source: paper eqs. 13–17 with the reference's attention order (`RPEAttention.forward`).
///
/// With `in.rope` (rpe::rotary_embedding, device freqs): q and k are rotated first into device
/// scratch (B·H·(L + L_k)·D elements of S), as rpe::cuda::rope_forward on both (q at `rope.positions`
/// or the grid, k at `rope.key_positions` when given, else as q; positions in device memory are
/// copied to the host and waited for, host memory is read in place; skip and suffix tokens
/// copied), and the kernels then run on the rotated q and k (same meaning and checks as the
/// CPU's attention_inputs::rope).
///
/// With `in.positions` (and `in.key_positions`): the iRPE terms' ids are those of
/// rpe::build_bucket_ids(m, positions, key_positions, skip), as on the CPU (docs/positions.md):
/// with a term attached, positions in device memory are copied to the host and waited for (host
/// memory is read in place; without a term they are not read), checked by the shared front, and the ids built there (the term's bucket_ids(positions,
/// key_positions): the per-offset ids of the positions' bounding box, uploaded once per box to the
/// device id cache, and each token's linear position in it, uploaded per call, 8 bytes per token
/// and side); the kernels read id(i, j) = per-offset id of pos_i − kpos_j. With `in.key_lengths`
/// ((B,) int32, device or host memory, copied to the host and checked there: 0 ≤ length ≤ L_k, then
/// uploaded): keys at index ≥ key_lengths[b] are padding, never used (as a key_padding_mask marking
/// them; rows without a valid key give zeros).
///
/// Keys of another count than the queries (L_k ≠ L, as the CPU's attention_inputs): the row kernel
/// streams L_k keys, attn_mask is (L, L_k), key_padding_mask (B, L_k), key_lengths at most L_k; iRPE
/// terms need `in.positions` (L − skip) and `in.key_positions` (L_k − skip) (their (L, L_k) ids, the
/// CPU's); with RoPE, k turns at `rope.key_positions` (L_k − skip − suffix) and q at `rope.positions`
/// or the grid, with `rope.query_suffix` unrotated trailing queries (SAM2's memory attention).
///
/// With `in.packed` (rpe::packed_sequences; lengths, grids, positions in device memory are copied
/// to the host and waited for): each image runs as a call of its own on its tokens, as on the CPU
/// (its grid's or positions' ids, its block of the masks; no pair of two images is computed), the
/// images one after another on the stream. When an image's rows are not contiguous (more than one
/// image and B·H > 1) they are gathered into scratch of the longest image's size (4 buffers of
/// B·H·len·D elements of S, reused) and its output scattered back: per image the launches of one
/// call plus 4 cudaMemcpy2DAsync (q, k, v, out) and one per mask. No RoPE, no key_lengths and no
/// `attn` with packing (rpe::not_supported, as on the CPU).
template <class S>
void attention_forward(const attention_inputs<S>& in_given, tensor_ref<S> out, tensor_ref<S> attn = {},
                       const attention_options& opt = {}) {
    const detail::gpu::host_checked_inputs<S> checked(in_given, opt.stream);  // positions, key_lengths read on the host
    const attention_inputs<S>& in = checked.of(in_given);
    const auto shape = detail::check_attention_forward(in, out, attn, opt, attention_caps);  // the shared front
    const double scale = detail::softmax_scale(opt, shape.d);
    cudaStream_t stream = opt.stream;
    if (in.packed.enabled()) {  // no RoPE with packing (the shared front)
        detail::gpu::packed_forward(in, out, scale, opt.tensor_cores, stream);
        return;
    }
    if (!in.rope.enabled()) {
        detail::gpu::attention_forward_impl(in, out, scale, opt.tensor_cores, stream);
        return;
    }
    const detail::gpu::rope_qk_tables<S> tables(in.rope, shape, in.height, in.width, stream);
    const detail::gpu::rotated_inputs<S> rot(in, shape, tables.qv(), tables.kv(), stream);
    detail::gpu::attention_forward_impl(rot.inputs, out, scale, opt.tensor_cores, stream);
}

/// @brief Whether rpe::cuda::attention_forward takes its tensor-core kernel for these inputs and
/// options (docs/cuda.md, Algorithms): S `__half` or `__nv_bfloat16`, head dim D a multiple of 16
/// and ≤ 128, no value term (`in.rpe_v`), q, k and v 16-byte aligned (with RoPE q and k are
/// rotated into aligned scratch: only v counts), `opt.tensor_cores` not false (unset: the
/// process default, on; the environment variable RPE_CUDA_ATTENTION_TENSOR_CORES=0 turns it off
/// for every call whose option is unset), and a current device that runs it (the program's device code for it built for
/// sm_70+ (fp16) or sm_80+ (bf16), its shared memory — 71,680 bytes at D = 64, 112,640 at
/// D = 128 — within the device's per-block limit). Everything else takes the SIMT kernel; the
/// backward always does. Does not check the inputs (attention_forward does).
/// @throws rpe::cuda_error when the device cannot be queried.
template <class S>
bool attention_forward_uses_tensor_cores(const attention_inputs<S>& in, const attention_options& opt = {}) {
    if (in.q.rank != 4) return false;
    attention_inputs<S> c = in;
    if (in.rope.enabled()) c.q.data = c.k.data = nullptr;  // the rotated copies: device scratch, aligned
    return detail::gpu::tensor_core_forward(c, opt.tensor_cores);
}

/// @brief Deprecated form of attention_forward with the stream by position: use
/// `attention_forward(in, out, {}, {.stream = stream})`.
template <class S>
[[deprecated("use rpe::cuda::attention_forward(in, out, {}, {.stream = stream})")]] void attention_forward(
    const attention_inputs<S>& in, tensor_ref<S> out, cudaStream_t stream) {
    rpe::cuda::attention_forward(in, out, tensor_ref<S>{}, attention_options{.stream = stream});
}

/// @brief Fused backward of attention_forward for `sum(out · grad_out)` on the GPU, as
/// rpe::attention_backward: gradients of the unscaled q, k, v (written) and of every table given
/// in the attention_terms' `grad_tables` (overwritten), without any (B, H, L, L) buffer.
///
/// Two passes flash-attention style: a row pass (one warp per query row: recomputes the row's
/// softmax statistics, Σ_j P·dP, then dlogits dS = P ⊙ (dP − Σ P·dP); writes grad_q and the
/// per-row bucket sums of dS (key terms) and P (value term)) and a column pass (one warp per key:
/// recomputes P and dS from the row statistics; writes grad_k, grad_v and the per-key bucket sums
/// of dS (query terms)); then batched GEMMs apply the tables (grad_q += s·G_k·table_kᵀ,
/// grad_k += s·G_q·table_qᵀ) and the table gradients are per-(b, h) GEMM partials reduced in a
/// fixed order. Temporaries: (B, H, L, K) per table ((B, H, L_k, K) for query tables) and (B, H, L, 3) statistics.
/// Padded keys get exactly zero grad_k and grad_v rows; fully masked rows zero grad_q.
/// @param g   grad_out, grad_q (B, H, L, D), grad_k, grad_v (B, H, L_k, D), device; `g.saved_attn` must be empty
///   (attention_caps: no backward from saved probabilities, rpe::not_supported).
/// @param opt the forward's options (the same scale; the stream).
/// @throws as attention_forward, and for overlapping outputs.
///
/// With `in.rope`: the kernels run on the rotated q and k (recomputed, as in the forward), then
/// grad_q and grad_k are rotated back (Rᵀ) and, for rope::mixed with `in.rope.grad_freqs` given
/// (device, (2, H, D/2), overwritten), the frequencies' gradient is the sum over q and k of
/// `x_t · (g_2p+1·y_2p − g_2p·y_2p+1)` (`fy`: y_t; (x_t, y_t) the token's column and row, or its
/// positions' x and y: q's and k's own) per (b, h) plane, then over the batch in a
/// fixed order (deterministic). @throws also `[rpe.attention] rope grad_freqs ...` as the CPU.
///
/// With L_k ≠ L: as attention_forward; the column pass runs one warp per key (L_k), the query
/// tables' per-key bucket sums are (B, H, L_k, K).
///
/// With `in.positions` / `in.key_lengths`: as attention_forward (the same ids; padded keys' grad_k
/// and grad_v rows are exactly zero and add nothing to the tables' gradients).
///
/// With `in.packed`: as attention_forward, each image a backward call of its own into its rows of
/// grad_q, grad_k, grad_v (per image, when not contiguous: 4 gathers — q, k, v, grad_out — and 3
/// scatters; 7 scratch buffers of the longest image's B·H·len·D); the table gradients are the
/// images' sum in image order (the first image's written in place, each later one's computed into
/// scratch of the tables' size and added by one small kernel per table), as the CPU's.
template <class S>
void attention_backward(const attention_inputs<S>& in_given, const attention_gradients<S>& g, const attention_options& opt = {}) {
    const detail::gpu::host_checked_inputs<S> checked(in_given, opt.stream);  // positions, key_lengths read on the host
    const attention_inputs<S>& in = checked.of(in_given);
    const auto shape = detail::check_attention_backward(in, g, opt, attention_caps);  // the shared front
    const double scale = detail::softmax_scale(opt, shape.d);
    cudaStream_t stream = opt.stream;
    const tensor_ref<const S> grad_out = g.grad_out;
    const tensor_ref<S> grad_q = g.grad_q, grad_k = g.grad_k, grad_v = g.grad_v;
    if (in.packed.enabled()) {  // no RoPE with packing (the shared front)
        detail::gpu::packed_backward(in, g, scale, stream);
        return;
    }
    if (!in.rope.enabled()) {
        detail::gpu::attention_backward_impl(in, grad_out, grad_q, grad_k, grad_v, scale, stream);
        return;
    }
    const detail::gpu::rope_qk_tables<S> tables(in.rope, shape, in.height, in.width, stream);
    const detail::gpu::rotated_inputs<S> rot(in, shape, tables.qv(), tables.kv(), stream);
    detail::gpu::attention_backward_impl(rot.inputs, grad_out, grad_q, grad_k, grad_v, scale, stream);
    // grad_q, grad_k now hold the gradients of the rotated q and k
    const std::int64_t planes = shape.b * shape.h;
    if (in.rope.grad_freqs.data != nullptr)
        detail::gpu::rope_frequency_grad<S>(tables.qv(), rot.q.get(), grad_q.data, tables.kv(), rot.k.get(), grad_k.data, false,
                                            planes, shape.h, shape.l, shape.lk, in.rope.grad_freqs.data, stream);
    detail::gpu::rope_rotate<S>(tables.qv(), grad_q.data, grad_q.data, planes, shape.h, shape.l, true, stream);
    detail::gpu::rope_rotate<S>(tables.kv(), grad_k.data, grad_k.data, planes, shape.h, shape.lk, true, stream);
}

/// @brief attention_backward recomputing the probabilities, with the tensors by position (as
/// rpe::cpu::attention_backward's): `attention_backward(in, {.grad_out = grad_out, .grad_q =
/// grad_q, .grad_k = grad_k, .grad_v = grad_v}, opt)`. @throws as attention_backward.
template <class S>
void attention_backward(const attention_inputs<S>& in, tensor_ref<const S> grad_out, tensor_ref<S> grad_q, tensor_ref<S> grad_k,
                        tensor_ref<S> grad_v, const attention_options& opt = {}) {
    rpe::cuda::attention_backward(
        in, attention_gradients<S>{.grad_out = grad_out, .grad_q = grad_q, .grad_k = grad_k, .grad_v = grad_v}, opt);
}

/// @brief Deprecated form with the stream by position: use
/// `attention_backward(in, grad_out, grad_q, grad_k, grad_v, {.stream = stream})`.
template <class S>
[[deprecated("use rpe::cuda::attention_backward(in, grad_out, grad_q, grad_k, grad_v, {.stream = stream})")]] void
attention_backward(const attention_inputs<S>& in, tensor_ref<const S> grad_out, tensor_ref<S> grad_q, tensor_ref<S> grad_k,
                   tensor_ref<S> grad_v, cudaStream_t stream) {
    rpe::cuda::attention_backward(in, grad_out, grad_q, grad_k, grad_v, attention_options{.stream = stream});
}

}  // namespace rpe::cuda
