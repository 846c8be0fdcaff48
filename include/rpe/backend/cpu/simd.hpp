/// @file backend/cpu/simd.hpp
/// @brief Vectorised row kernels of the CPU backend (not API): gathers of per-bucket values by
/// bucket id, the masked softmax of a logits row and its backward.
///
/// The instruction set is the one the including translation unit is compiled for: AVX-512F
/// (`__AVX512F__`) or AVX2 (`__AVX2__`) code paths where the compiler enables them, portable
/// loops otherwise. rpe never adds ISA flags to a consumer's target; compile with `-march=native`
/// (or the flags of your deployment machine) to get the wide paths. The gathers add one value per
/// element on every path (the same bits on every ISA); the softmax's sums follow the packet
/// width, so its results differ between ISAs by float rounding (and Eigen's vectorised `exp` vs
/// the C library's). Everything here is in the ISA namespace of isa.hpp, so units of one program
/// built for different ISAs each keep their own copy.
#pragma once

#include "eigen.hpp"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Eigen's packet types are vector types with attributes (__m128, __m512); naming them as template
// arguments (unpacket_traits<Packet>) makes g++ warn that the attributes are ignored, as Eigen's
// own headers do internally.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

namespace rpe::detail::cpu {

inline namespace RPE_ISA_NS {

#if defined(__AVX512F__) || defined(__AVX2__)
namespace simd {
#if defined(__AVX512F__)
/// 16 ids as int32 lanes (zero-extended).
template <class Id>
inline __m512i load_ids16(const Id* ids) {
    if constexpr (sizeof(Id) == 1)
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ids)));
    else if constexpr (sizeof(Id) == 2)
        return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids)));
    else
        return _mm512_loadu_si512(ids);
}
/// The first `count` of 16 lanes (none for count ≤ 0).
inline __mmask16 lanes(std::int64_t count) {
    return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << count) - 1u);
}
#endif
#if defined(__AVX2__)
/// 8 ids as int32 lanes (zero-extended).
template <class Id>
inline __m256i load_ids8(const Id* ids) {
    if constexpr (sizeof(Id) == 1) {
        std::int64_t v;
        std::memcpy(&v, ids, 8);
        return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v));
    } else if constexpr (sizeof(Id) == 2) {
        return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ids)));
    } else {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids));
    }
}
#endif
}  // namespace simd
#endif

/// @brief row[j] += w[ids[j]] (Add) or row[j] = w[ids[j]] for j < n: one lookup table `w` of `k` values for the whole row
/// (a bias table, or one row of per-bucket products), ids < k.
///
/// float with AVX-512: for k ≤ 64 the table sits in four registers and each 16 ids are looked up
/// with two two-source permutes and a blend (no memory gather); larger k and AVX2 use hardware
/// gathers; otherwise a scalar loop.
template <bool Add = true, class S, class Id>
inline void gather_row(S* row, const S* w, std::int64_t k, const Id* ids, std::int64_t n) {
    std::int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>) {
        if (k <= 64) {  // masked loads: no lane past k is read
            const __m512 t0 = _mm512_maskz_loadu_ps(simd::lanes(k), w), t1 = _mm512_maskz_loadu_ps(simd::lanes(k - 16), w + 16),
                         t2 = _mm512_maskz_loadu_ps(simd::lanes(k - 32), w + 32),
                         t3 = _mm512_maskz_loadu_ps(simd::lanes(k - 48), w + 48);
            const __m512i bit5 = _mm512_set1_epi32(32);
            for (; j + 16 <= n; j += 16) {
                const __m512i idx = simd::load_ids16(ids + j);
                const __m512 lo = _mm512_permutex2var_ps(t0, idx, t1);
                const __m512 hi = _mm512_permutex2var_ps(t2, idx, t3);
                const __m512 v = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, bit5), lo, hi);
                _mm512_storeu_ps(row + j, Add ? _mm512_add_ps(_mm512_loadu_ps(row + j), v) : v);
            }
        } else {
            for (; j + 16 <= n; j += 16) {
                const __m512 v = _mm512_i32gather_ps(simd::load_ids16(ids + j), w, 4);
                _mm512_storeu_ps(row + j, Add ? _mm512_add_ps(_mm512_loadu_ps(row + j), v) : v);
            }
        }
    }
#elif defined(__AVX2__)
    if constexpr (std::is_same_v<S, float>) {
        for (; j + 8 <= n; j += 8) {
            const __m256 v = _mm256_i32gather_ps(w, simd::load_ids8(ids + j), 4);
            _mm256_storeu_ps(row + j, Add ? _mm256_add_ps(_mm256_loadu_ps(row + j), v) : v);
        }
    }
#endif
    (void)k;
    for (; j < n; ++j) {
        if constexpr (Add)
            row[j] += w[ids[j]];
        else
            row[j] = w[ids[j]];
    }
}

/// @brief row[j] += w[ids[j]] (see gather_row).
template <class S, class Id>
inline void gather_add(S* row, const S* w, std::int64_t k, const Id* ids, std::int64_t n) {
    gather_row<true>(row, w, k, ids, n);
}

/// @brief row[j] (+)= w[j·k + ids[j]] for j < n: a different table of k values per key j (the query
/// target's per-bucket products, (n, k) row-major), ids < k.
template <bool Add = true, class S, class Id>
inline void gather_row_strided(S* row, const S* w, std::int64_t k, const Id* ids, std::int64_t n) {
    std::int64_t j = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float>) {
        if (16 * k < (std::int64_t{1} << 30)) {
            const __m512i lane_k = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(static_cast<int>(k)));
            for (; j + 16 <= n; j += 16) {
                const __m512i idx = _mm512_add_epi32(lane_k, simd::load_ids16(ids + j));
                const __m512 v = _mm512_i32gather_ps(idx, w + j * k, 4);
                _mm512_storeu_ps(row + j, Add ? _mm512_add_ps(_mm512_loadu_ps(row + j), v) : v);
            }
        }
    }
#elif defined(__AVX2__)
    if constexpr (std::is_same_v<S, float>) {
        if (8 * k < (std::int64_t{1} << 30)) {
            const __m256i lane_k =
                _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(k)));
            for (; j + 8 <= n; j += 8) {
                const __m256i idx = _mm256_add_epi32(lane_k, simd::load_ids8(ids + j));
                const __m256 v = _mm256_i32gather_ps(w + j * k, idx, 4);
                _mm256_storeu_ps(row + j, Add ? _mm256_add_ps(_mm256_loadu_ps(row + j), v) : v);
            }
        }
    }
#endif
    for (; j < n; ++j) {
        if constexpr (Add)
            row[j] += w[j * k + ids[j]];
        else
            row[j] = w[j * k + ids[j]];
    }
}

/// @brief row[j] += w[j·k + ids[j]] (see gather_row_strided).
template <class S, class Id>
inline void gather_add_strided(S* row, const S* w, std::int64_t k, const Id* ids, std::int64_t n) {
    gather_row_strided<true>(row, w, k, ids, n);
}

#if defined(__AVX512F__)
namespace simd {
// The transposed lookups of the contextual query term (float forward and the AVX512_BF16 bf16
// forward): per key j, its row of per-bucket products looked up by the block's queries' ids
// (lookup_rows), then added to the logits transposed (add_transposed), instead of one gather
// per (query, 16 keys) from 16 different rows.

// Transposes the 16 × 16 matrix of 32-bit elements r[l][m] in place (r[m][l]).
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int k = 0; k < 8; ++k) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
        const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * k + 1]), e = _mm512_castps_pd(t[4 * k + 3]);
        r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
        r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
    }
    // r[4k + c], 128-bit block b: column 4b + c of rows 4k..4k+3
    for (int c = 0; c < 4; ++c) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        const __m512 v0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), v1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_f32x4(u0, v0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u1, v1, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(u0, v0, 0xdd);
        t[12 + c] = _mm512_shuffle_f32x4(u1, v1, 0xdd);
    }
    for (int l = 0; l < 16; ++l) r[l] = t[l];
}

// lg[i·ldl + j] += g[j·ldg + i] for i < rows, j < n: a (n, rows) block added transposed, in
// 16 × 16 tiles (g is read in whole tiles: ldg ≥ rows rounded up to 16; the lanes past `rows`
// are not used).
inline void add_transposed(const float* g, std::int64_t ldg, std::int64_t rows, std::int64_t n, float* lg, std::int64_t ldl) {
    __m512 r[16];
    for (std::int64_t i0 = 0; i0 < rows; i0 += 16) {
        const std::int64_t ir = std::min<std::int64_t>(16, rows - i0);
        for (std::int64_t j0 = 0; j0 < n; j0 += 16) {
            const std::int64_t jr = std::min<std::int64_t>(16, n - j0);
            const __mmask16 jm = lanes(jr);
            for (int l = 0; l < 16; ++l) r[l] = l < jr ? _mm512_loadu_ps(g + (j0 + l) * ldg + i0) : _mm512_setzero_ps();
            transpose16(r);  // r[m][l] = g(j0 + l, i0 + m)
            for (std::int64_t m = 0; m < ir; ++m) {
                float* row = lg + (i0 + m) * ldl + j0;
                _mm512_mask_storeu_ps(row, jm, _mm512_add_ps(_mm512_maskz_loadu_ps(jm, row), r[m]));
            }
        }
    }
}

// g[j·ldg + i] = a[i·lda + j] for i < rows, j < n: a (rows, n) block transposed into g (n, rows)
// in 16 × 16 tiles (the float backward's dlogits in key order); g's rows are written in whole
// tiles (ldg ≥ rows rounded up to 16), zeros in the lanes past `rows`.
inline void transpose_into(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t n, float* g, std::int64_t ldg) {
    __m512 r[16];
    for (std::int64_t i0 = 0; i0 < rows; i0 += 16) {
        const std::int64_t ir = std::min<std::int64_t>(16, rows - i0);
        for (std::int64_t j0 = 0; j0 < n; j0 += 16) {
            const std::int64_t jr = std::min<std::int64_t>(16, n - j0);
            const __mmask16 jm = lanes(jr);
            for (int l = 0; l < 16; ++l) r[l] = l < ir ? _mm512_maskz_loadu_ps(jm, a + (i0 + l) * lda + j0) : _mm512_setzero_ps();
            transpose16(r);  // r[m][l] = a(i0 + l, j0 + m)
            for (std::int64_t m = 0; m < jr; ++m) _mm512_storeu_ps(g + (j0 + m) * ldg + i0, r[m]);
        }
    }
}

// g[j·ldg + i] = w[j·k + ids[j·ldi + i]] for j < n, i < rows (ids < k): per key j a lookup of its
// own row of k values (the contextual query term's products) by the ids of the block's queries.
template <class Id>
inline void lookup_rows(const float* w, std::int64_t k, const Id* ids, std::int64_t ldi, std::int64_t n, std::int64_t rows,
                        float* g, std::int64_t ldg) {
    if (k > 64) {
        for (std::int64_t j = 0; j < n; ++j) gather_row<false>(g + j * ldg, w + j * k, k, ids + j * ldi, rows);
        return;
    }
    const __mmask16 m0 = lanes(k), m1 = lanes(k - 16), m2 = lanes(k - 32), m3 = lanes(k - 48);
    const __m512i bit5 = _mm512_set1_epi32(32);
    for (std::int64_t j = 0; j < n; ++j) {
        const float* wj = w + j * k;
        const __m512 t0 = _mm512_maskz_loadu_ps(m0, wj), t1 = k > 16 ? _mm512_maskz_loadu_ps(m1, wj + 16) : _mm512_setzero_ps();
        const __m512 t2 = k > 32 ? _mm512_maskz_loadu_ps(m2, wj + 32) : _mm512_setzero_ps();
        const __m512 t3 = k > 48 ? _mm512_maskz_loadu_ps(m3, wj + 48) : _mm512_setzero_ps();
        const Id* idj = ids + j * ldi;
        for (std::int64_t i = 0; i < rows; i += 16) {
            __m512i idx;
            if (i + 16 <= rows) {
                idx = load_ids16(idj + i);
            } else {  // the tail: ids past `rows` may lie past the buffer
                Id tail[16] = {};
                std::copy(idj + i, idj + rows, tail);
                idx = load_ids16(tail);
            }
            const __m512 lo = _mm512_permutex2var_ps(t0, idx, t1), hi = _mm512_permutex2var_ps(t2, idx, t3);
            _mm512_storeu_ps(g + j * ldg + i, _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, bit5), lo, hi));
        }
    }
}

// One row of value_lookup_rows, d ≤ 16 (m: its lanes): four multiply-add chains take the keys in
// turn (j mod 4; the last n mod 4 keys go to the first), added as (c0 + c1) + (c2 + c3).
template <class Id>
inline void value_lookup_row16(const float* a, const Id* ids, std::int64_t n, const float* t, std::int64_t d, __mmask16 m,
                               float* o) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    std::int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[j]), _mm512_maskz_loadu_ps(m, t + std::int64_t(ids[j]) * d), c0);
        c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[j + 1]), _mm512_maskz_loadu_ps(m, t + std::int64_t(ids[j + 1]) * d), c1);
        c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[j + 2]), _mm512_maskz_loadu_ps(m, t + std::int64_t(ids[j + 2]) * d), c2);
        c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[j + 3]), _mm512_maskz_loadu_ps(m, t + std::int64_t(ids[j + 3]) * d), c3);
    }
    for (; j < n; ++j) c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[j]), _mm512_maskz_loadu_ps(m, t + std::int64_t(ids[j]) * d), c0);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3));
    _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), sum));
}

// The same for 16 < d ≤ 32 (m: the lanes of the second 16 columns): two chains per 16 columns,
// keys j mod 2 (the last odd key to the first), added as c0 + c1.
template <class Id>
inline void value_lookup_row32(const float* a, const Id* ids, std::int64_t n, const float* t, std::int64_t d, __mmask16 m,
                               float* o) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, e0 = c0, e1 = c0;
    std::int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        const float *r0 = t + std::int64_t(ids[j]) * d, *r1 = t + std::int64_t(ids[j + 1]) * d;
        const __m512 w0 = _mm512_set1_ps(a[j]), w1 = _mm512_set1_ps(a[j + 1]);
        c0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(r0), c0);
        e0 = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, r0 + 16), e0);
        c1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(r1), c1);
        e1 = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m, r1 + 16), e1);
    }
    if (j < n) {
        const float* r0 = t + std::int64_t(ids[j]) * d;
        const __m512 w0 = _mm512_set1_ps(a[j]);
        c0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(r0), c0);
        e0 = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, r0 + 16), e0);
    }
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_add_ps(c0, c1)));
    _mm512_mask_storeu_ps(o + 16, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o + 16), _mm512_add_ps(e0, e1)));
}

// o[i·ldo + c] += Σ_{j < n} a[i·lda + j] · t[ids[i·ldi + j]·d + c] for i < rows, c < d ≤ 32
// (ids < the table's rows): the contextual value term of a row block, each key's table row
// weighted by its (unnormalised) probability, without the per-bucket sums (the forward's choice
// at small D, fused_forward). Per row and 16 columns the keys are summed in a fixed order of
// chains (value_lookup_row16 / 32), whatever the block or thread count.
template <class Id>
inline void value_lookup_rows(const float* a, std::int64_t lda, const Id* ids, std::int64_t ldi, std::int64_t rows,
                              std::int64_t n, const float* t, std::int64_t d, float* o, std::int64_t ldo) {
    const __mmask16 m = lanes(d <= 16 ? d : d - 16);
    for (std::int64_t i = 0; i < rows; ++i)
        if (d <= 16)
            value_lookup_row16(a + i * lda, ids + i * ldi, n, t, d, m, o + i * ldo);
        else
            value_lookup_row32(a + i * lda, ids + i * ldi, n, t, d, m, o + i * ldo);
}

// The float products of the fused attention (AVX-512F): C (m, n) = A (m, kk) · B (kk, n), or
// C += A · B, B row-major (rows ldb apart), A element (r, k) at a[r·a_rs + k·a_ks] (a row-major
// A: a_rs = lda, a_ks = 1; Aᵀ of a row-major matrix: a_rs = 1, a_ks = lda), C rows ldc apart.
// Register tiles of R rows × NV vectors of 16 columns (the last one masked), the A element
// broadcast against the B row: each C element is one fused multiply-add chain over k = 0..kk−1
// in order (starting from 0, or from C with `accumulate`), so its bits depend neither on m, n
// nor on the tiling: a folded product ([k; tableᵀ] in one B) gives the same logits as separate
// ones, and the backward's recomputed probabilities equal the forward's. On the attention's
// shapes it ran at 1.1–1.6× the speed of Eigen's general product, which packs both operands
// first (docs/benchmarks.md).
template <int R, int NV, bool Acc>
inline void gemm_tile(const float* a, std::int64_t a_rs, std::int64_t a_ks, const float* b, std::int64_t ldb, float* c,
                      std::int64_t ldc, std::int64_t kk, __mmask16 last) {
    __m512 acc[R][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            acc[r][v] = !Acc          ? _mm512_setzero_ps()
                        : v == NV - 1 ? _mm512_maskz_loadu_ps(last, c + r * ldc + 16 * v)
                                      : _mm512_loadu_ps(c + r * ldc + 16 * v);
    for (std::int64_t k = 0; k < kk; ++k) {
        __m512 bv[NV];
        const float* bk = b + k * ldb;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, bk + 16 * v) : _mm512_loadu_ps(bk + 16 * v);
        const float* ak = a + k * a_ks;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512 av = _mm512_set1_ps(ak[r * a_rs]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            if (v == NV - 1)
                _mm512_mask_storeu_ps(c + r * ldc + 16 * v, last, acc[r][v]);
            else
                _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
        }
}

// The last `rows` (< R + 1) rows of gemm_rows in one tile of exactly that many rows.
template <int R, int NV, bool Acc>
inline void gemm_rest(std::int64_t rows, const float* a, std::int64_t a_rs, std::int64_t a_ks, const float* b, std::int64_t ldb,
                      float* c, std::int64_t ldc, std::int64_t kk, __mmask16 last) {
    if constexpr (R > 0) {
        if (rows == R)
            gemm_tile<R, NV, Acc>(a, a_rs, a_ks, b, ldb, c, ldc, kk, last);
        else
            gemm_rest<R - 1, NV, Acc>(rows, a, a_rs, a_ks, b, ldb, c, ldc, kk, last);
    }
}

// gemm_tile over m rows in tiles of RM rows (the rest in one smaller tile).
template <int NV, int RM, bool Acc>
inline void gemm_rows(std::int64_t m, const float* a, std::int64_t a_rs, std::int64_t a_ks, const float* b, std::int64_t ldb,
                      float* c, std::int64_t ldc, std::int64_t kk, __mmask16 last) {
    std::int64_t i = 0;
    for (; i + RM <= m; i += RM) gemm_tile<RM, NV, Acc>(a + i * a_rs, a_rs, a_ks, b, ldb, c + i * ldc, ldc, kk, last);
    gemm_rest<RM - 1, NV, Acc>(m - i, a + i * a_rs, a_rs, a_ks, b, ldb, c + i * ldc, ldc, kk, last);
}

template <bool Acc>
inline void gemm_panel(std::int64_t m, std::int64_t n, std::int64_t kk, const float* a, std::int64_t a_rs, std::int64_t a_ks,
                       const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
    for (std::int64_t j = 0; j < n; j += 64) {
        const std::int64_t w = std::min<std::int64_t>(64, n - j);
        const int nv = static_cast<int>((w + 15) / 16);
        const __mmask16 last = lanes(w - 16 * (nv - 1));
        switch (nv) {
            case 1: gemm_rows<1, 8, Acc>(m, a, a_rs, a_ks, b + j, ldb, c + j, ldc, kk, last); break;
            case 2: gemm_rows<2, 6, Acc>(m, a, a_rs, a_ks, b + j, ldb, c + j, ldc, kk, last); break;
            case 3: gemm_rows<3, 4, Acc>(m, a, a_rs, a_ks, b + j, ldb, c + j, ldc, kk, last); break;
            default: gemm_rows<4, 4, Acc>(m, a, a_rs, a_ks, b + j, ldb, c + j, ldc, kk, last); break;
        }
    }
}

// gemm_panel over the inner index in blocks of 128 where it is longer than 160 (so that 128 rows
// of a 64-column strip of B, 32 KB, stay in L1 while every row tile reads them), the later blocks
// accumulated onto C: the chains go on from C's float values, so the bits are those of one pass.
template <bool Acc>
inline void gemm(std::int64_t m, std::int64_t n, std::int64_t kk, const float* a, std::int64_t a_rs, std::int64_t a_ks,
                 const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
    constexpr std::int64_t kc = 128;
    if (kk <= kc + 32) {
        gemm_panel<Acc>(m, n, kk, a, a_rs, a_ks, b, ldb, c, ldc);
        return;
    }
    gemm_panel<Acc>(m, n, kc, a, a_rs, a_ks, b, ldb, c, ldc);
    for (std::int64_t k0 = kc; k0 < kk; k0 += kc)
        gemm_panel<true>(m, n, std::min(kc, kk - k0), a + k0 * a_ks, a_rs, a_ks, b + k0 * ldb, ldb, c, ldc);
}

// C = A · B (accumulate false) or C += A · B, see gemm_tile.
inline void gemm(std::int64_t m, std::int64_t n, std::int64_t kk, const float* a, std::int64_t a_rs, std::int64_t a_ks,
                 const float* b, std::int64_t ldb, float* c, std::int64_t ldc, bool accumulate = false) {
    if (m <= 0 || n <= 0) return;
    if (accumulate)
        gemm<true>(m, n, kk, a, a_rs, a_ks, b, ldb, c, ldc);
    else
        gemm<false>(m, n, kk, a, a_rs, a_ks, b, ldb, c, ldc);
}

/// Floats of gemm_bt's packing buffer: one 64-column strip of Bᵀ, up to 160 inner rows.
inline constexpr std::int64_t gemm_bt_pack_floats = 160 * 64;

/// @brief C (m, n) = A · Bᵀ (accumulate: C += A · Bᵀ) with B given as (n, kk), rows ldb apart,
/// e.g. nn.Linear's weight W (out, in) for y = x·Wᵀ; A read through strides as in gemm. Columns
/// [j0, j1) of C only (a thread's share). Each 64-column strip of Bᵀ is packed, as many inner rows
/// at a time as gemm's blocks (all kk ≤ 160, else 128), into `pack` (gemm_bt_pack_floats floats,
/// 64-byte aligned) and multiplied by gemm's register tiles: every element is the same in-order
/// chain as gemm's on an explicit Bᵀ, so the bits equal gemm(…, Bᵀ, …)'s. The packing costs one
/// pass over B per call (Eigen's general product packs both operands).
inline void gemm_bt(std::int64_t m, std::int64_t j0, std::int64_t j1, std::int64_t kk, const float* a, std::int64_t a_rs,
                    std::int64_t a_ks, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, bool accumulate,
                    float* pack) {
    if (m <= 0 || j1 <= j0) return;
    constexpr std::int64_t kc = 128;
    const std::int64_t step = kk <= kc + 32 ? std::max<std::int64_t>(kk, 1) : kc;
    for (std::int64_t j = j0; j < j1; j += 64) {
        const std::int64_t w = std::min<std::int64_t>(64, j1 - j);
        if (kk == 0) {  // C = 0 (or unchanged)
            gemm_panel<false>(accumulate ? 0 : m, w, 0, a, a_rs, a_ks, pack, 64, c + j, ldc);
            continue;
        }
        for (std::int64_t k0 = 0; k0 < kk; k0 += step) {
            const std::int64_t kb = std::min(step, kk - k0);
            transpose_into(b + j * ldb + k0, ldb, w, kb, pack, 64);  // pack (kb, 64) = Bᵀ's block
            if (accumulate || k0 > 0)
                gemm_panel<true>(m, w, kb, a + k0 * a_ks, a_rs, a_ks, pack, 64, c + j, ldc);
            else
                gemm_panel<false>(m, w, kb, a + k0 * a_ks, a_rs, a_ks, pack, 64, c + j, ldc);
        }
    }
}
}  // namespace simd
#endif

#if defined(__AVX512F__)
namespace simd {
/// exp(x) of 16 lanes with x ≤ 0 or −∞ (a softmax's logit − max), for softmax_row_exp: Eigen 3.4's
/// pexp<Packet16f> (the same clamp, reduction, polynomial and operation order) without what such
/// x never need (the upper clamp, the max with x that lets +∞ through) and with 2^m applied by
/// one vscalefps instead of building its bits: the same bits wherever the result is at least
/// the smallest normal float (both are y·2^m exactly there); below it, where either gives a value
/// under that bound, the caller flushes both to 0 (softmax_row_exp's `tiny`). About 15 instead
/// of 19 vector operations per 16 values.
inline __m512 exp_nonpositive(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    const __m512 m = _mm512_floor_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
    const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.6931471805599453f), xc);
    const __m512 r2 = _mm512_mul_ps(r, r), r3 = _mm512_mul_ps(r2, r);
    __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
    __m512 y1 = _mm512_fmadd_ps(_mm512_set1_ps(4.1665795894E-2f), r, _mm512_set1_ps(1.6666665459E-1f));
    const __m512 y2 = _mm512_add_ps(r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y1 = _mm512_fmadd_ps(y1, r, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, r3, y1);
    y = _mm512_fmadd_ps(y, r2, y2);
    return _mm512_scalef_ps(y, m);
}
}  // namespace simd
#endif

// exp(x) of a packet of x ≤ 0 or −∞ for softmax_row_exp: simd::exp_nonpositive for AVX-512 float
// packets, Eigen's pexp otherwise (the same bits after the caller's flush of values below the
// smallest normal number).
template <class P>
inline P softmax_exp(const P& x) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<P, __m512>) return simd::exp_nonpositive(x);
#endif
    return Eigen::internal::pexp(x);
}

/// @brief The exponentials of a softmax row in place, without its normalisation: keys with
/// `mask[j] != 0` excluded (mask may be null), `row[j] = exp(x_j − max)` (exactly 0 for a −∞ or
/// masked logit and below the smallest normal number, which the C library gives as denormals);
/// returns 1/Σⱼ row[j], by which the caller scales the row or, cheaper, what it computes from it
/// (the fused forward: the (rows, D) output, not the (rows, L) probabilities). A NaN or +∞
/// logit makes the whole row NaN and returns 1; a row whose keys are all masked (or all −∞)
/// becomes zeros and returns 1 (the reference gives NaN there). Max-subtracted, so logits up to
/// ±FLT_MAX do not overflow. Vectorised with Eigen's packet functions (any ISA Eigen supports;
/// on AVX-512F float the exp is simd::exp_nonpositive, the same bits as Eigen's there): two
/// passes over the row while it sits in cache (max with a NaN check; exp and sum).
template <class S>
S softmax_row_exp(S* row, std::int64_t n, const std::uint8_t* mask) {
    constexpr S neg_inf = -std::numeric_limits<S>::infinity();
    if (mask)
        for (std::int64_t j = 0; j < n; ++j)
            if (mask[j]) row[j] = neg_inf;
    using namespace Eigen::internal;
    using P = typename packet_traits<S>::type;
    constexpr std::int64_t w = unpacket_traits<P>::size;
    // pass 1: the maximum (two accumulators: the max's latency, not its throughput, bounds one),
    // NaNs found apart (x == x fails), not through a NaN-propagating max of three instructions
    S m = neg_inf;
    bool nan = false;
    std::int64_t j = 0;
    if (n >= w) {
        P m0 = pset1<P>(neg_inf), m1 = m0;
        P ok = ptrue(m0);
        for (; j + 2 * w <= n; j += 2 * w) {
            const P a = ploadu<P>(row + j), b = ploadu<P>(row + j + w);
            ok = pand(ok, pand(pcmp_eq(a, a), pcmp_eq(b, b)));
            m0 = pmax(m0, a);
            m1 = pmax(m1, b);
        }
        for (; j + w <= n; j += w) {
            const P a = ploadu<P>(row + j);
            ok = pand(ok, pcmp_eq(a, a));
            m0 = pmax(m0, a);
        }
        nan = predux_any(pandnot(ptrue(ok), ok));  // a lane where some x != x
        m = predux_max(pmax(m0, m1));
    }
    for (; j < n; ++j) {
        nan = nan || std::isnan(row[j]);
        m = row[j] > m ? row[j] : m;
    }
    if (nan || std::isnan(m) || m == std::numeric_limits<S>::infinity()) {  // NaN, as exp(∞ − ∞) would give
        std::fill(row, row + n, std::numeric_limits<S>::quiet_NaN());
        return S(1);
    }
    if (m == neg_inf) {
        std::fill(row, row + n, S(0));
        return S(1);
    }
    // pass 2: exp(x − max) and the sum. Eigen's vectorised exp clamps its input (exp(−∞) would be
    // ~1e-39): subtracting the smallest normal number and clamping at 0 makes every such value an
    // exact 0 (masked keys get exactly zero probability) and leaves every value ≥ 2^-100 as it is.
    const S tiny = std::numeric_limits<S>::min();
    S sum = 0;
    j = 0;
    if (n >= w) {
        const P pm = pset1<P>(m), pt = pset1<P>(tiny), zero = pzero(pm);
        P acc = zero;
        for (; j + w <= n; j += w) {
            const P e = pmax(psub(softmax_exp(psub(ploadu<P>(row + j), pm)), pt), zero);
            pstoreu(row + j, e);
            acc = padd(acc, e);
        }
        sum = predux(acc);
    }
    if (n - j >= 3) {  // a longer tail as one padded packet (−∞ lanes give 0), not scalar exp calls
        alignas(64) S tail[64 / sizeof(S) > w ? 64 / sizeof(S) : w];
        const std::int64_t r = n - j;
        std::fill(tail, tail + w, neg_inf);
        std::copy(row + j, row + n, tail);
        const P e = pmax(psub(softmax_exp(psub(pload<P>(tail), pset1<P>(m))), pset1<P>(tiny)), pzero(pset1<P>(m)));
        pstore(tail, e);
        for (std::int64_t l = 0; l < r; ++l) {
            row[j + l] = tail[l];
            sum += tail[l];
        }
        j = n;
    }
    for (; j < n; ++j) {
        const S e = row[j] == neg_inf ? S(0) : std::exp(row[j] - m);
        row[j] = e;
        sum += e;
    }
    return S(1) / sum;
}

/// @brief Softmax of one row of n logits in place, keys with `mask[j] != 0` excluded (mask may be
/// null): softmax_row_exp, then the row scaled by the returned 1/Σ (the same bits as the
/// exponentials times that factor). A NaN or +∞ logit makes the whole row NaN; a row whose keys
/// are all masked (or all −∞) becomes zeros (the reference gives NaN there); a −∞ logit gets
/// exactly 0.
template <class S>
void softmax_row(S* row, std::int64_t n, const std::uint8_t* mask) {
    const S inv = softmax_row_exp(row, n, mask);
    if (inv == S(1)) return;  // NaN or zero rows, or one key: nothing to scale
    using namespace Eigen::internal;
    using P = typename packet_traits<S>::type;
    constexpr std::int64_t w = unpacket_traits<P>::size;
    std::int64_t j = 0;
    if (n >= w) {
        const P pi = pset1<P>(inv);
        for (; j + w <= n; j += w) pstoreu(row + j, pmul(ploadu<P>(row + j), pi));
    }
    for (; j < n; ++j) row[j] *= inv;
}

/// @brief Softmax backward of one row in place: `dp[j] = p[j]·(dp[j] − Σ_l dp[l]·p[l])` (the
/// gradient of the logits from that of the probabilities). Vectorised; the sum's order does not
/// depend on the rows' alignment (so neither does the result).
template <class S>
void softmax_backward_row(const S* p, S* dp, std::int64_t n) {
    using namespace Eigen::internal;
    using P = typename packet_traits<S>::type;
    constexpr std::int64_t w = unpacket_traits<P>::size;
    S dot = 0;
    std::int64_t j = 0;
    if (n >= w) {
        P acc = pset1<P>(S(0));
        for (; j + w <= n; j += w) acc = pmadd(ploadu<P>(p + j), ploadu<P>(dp + j), acc);
        dot = predux(acc);
    }
    for (; j < n; ++j) dot += p[j] * dp[j];
    j = 0;
    if (n >= w) {
        const P pd = pset1<P>(dot);
        for (; j + w <= n; j += w) pstoreu(dp + j, pmul(ploadu<P>(p + j), psub(ploadu<P>(dp + j), pd)));
    }
    for (; j < n; ++j) dp[j] = p[j] * (dp[j] - dot);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
