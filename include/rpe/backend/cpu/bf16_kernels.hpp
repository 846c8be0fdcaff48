/// @file backend/cpu/bf16_kernels.hpp
/// @brief bf16 kernels of the CPU backend (not API): conversions between rpe::bf16 and float, and
/// the bf16 matrix product with float accumulation of the bf16 attention.
///
/// The instruction set is the including unit's (isa.hpp): with AVX512_BF16 (`__AVX512BF16__` and
/// `__AVX512F__`, e.g. `-march=native` on Zen 4, Cooper Lake, Sapphire Rapids) the product runs on
/// vdpbf16ps (`_mm512_dpbf16_ps`: pairs of bf16 products, exact in float, added to float
/// accumulators); such units live in the ISA namespace `avx512_bf16`, apart from the `avx512`
/// units without it. Elsewhere hw_bf16 is false and the bf16 attention converts to float and runs
/// the float kernels (attention_bf16.hpp). The conversions give the same bits on every path
/// (rpe::bf16::round_bits: to nearest, ties to even, NaN quieted, denormals kept).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "../../bf16.hpp"
#include "isa.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

/// True when this unit's bf16 products take AVX512_BF16 (vdpbf16ps).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline constexpr bool hw_bf16 = true;
#else
inline constexpr bool hw_bf16 = false;
#endif

/// @brief Whether the running CPU reports AVX512_BF16 (`__builtin_cpu_supports`, checked once; true
/// where the compiler has no such builtin). The AVX512_BF16 path also requires it, so a unit built
/// with `-mavx512bf16` that runs on an AVX-512 CPU without the instruction takes the portable path.
inline bool cpu_has_avx512_bf16() {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
    static const bool ok = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512bf16") != 0;
    }();
    return ok;
#else
    return true;
#endif
}

/// @brief The path the bf16 attention of this unit takes on this CPU: "AVX512_BF16" or "portable".
inline const char* bf16_isa() { return hw_bf16 && cpu_has_avx512_bf16() ? "AVX512_BF16" : "portable"; }

/// @brief Test hook (not API): while true, the bf16 attention of this ISA takes the portable path
/// (float conversion and the float kernels) even where hw_bf16 is true.
inline std::atomic<bool> bf16_portable_only{false};

/// @brief dst[i] = float(src[i]) for i < n (exact).
inline void bf16_to_float(const bf16* src, float* dst, std::int64_t n) {
    std::int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// @brief dst[i] = bf16(src[i]) for i < n: to nearest, ties to even (the bits of bf16::round_bits on
/// every path).
inline void float_to_bf16(const float* src, bf16* dst, std::int64_t n) {
    std::int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_loadu_si512(src + i);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
        const __m512i bias = _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        const __m512i r = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                                                  _mm512_or_si512(_mm512_srli_epi32(u, 16), quiet));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; ++i) dst[i] = bf16(src[i]);
}

/// @brief B of bf16_gemm packed in pairs along its inner dimension: `(kd + 1)/2` pairs × `npad`
/// columns × 2, element (r, j) of B (r < kd, j < n) at `[(r/2·npad + j)·2 + r%2]`, zeros elsewhere.
/// npad: n rounded up to 32 (bf16_gemm reads 32 columns at a time).
inline std::int64_t bf16_pack_columns(std::int64_t n) { return (n + 31) / 32 * 32; }
/// @brief Elements of a packed B of kd × n (see bf16_pack_columns).
inline std::int64_t bf16_pack_size(std::int64_t kd, std::int64_t n) { return (kd + 1) / 2 * bf16_pack_columns(n) * 2; }

/// @brief Packs Bᵀ given as rows: B(r, j) = rows[j·sl + r] (r < kd, j < n), e.g. B = kᵀ from the
/// (L, D) rows of k, for q·kᵀ.
inline void bf16_pack_transposed(const bf16* rows, std::int64_t sl, std::int64_t kd, std::int64_t n, bf16* bp) {
    const std::int64_t npad = bf16_pack_columns(n);
    std::memset(static_cast<void*>(bp), 0, static_cast<std::size_t>(bf16_pack_size(kd, n)) * sizeof(bf16));
    for (std::int64_t j = 0; j < n; ++j) {
        const bf16* row = rows + j * sl;
        for (std::int64_t r = 0; r < kd; ++r) bp[((r / 2) * npad + j) * 2 + (r & 1)] = row[r];
    }
}

/// @brief Packs B given as rows: B(r, j) = rows[r·sl + j] (r < kd, j < n), e.g. B = v from its
/// (L, D) rows, for P·v.
inline void bf16_pack_rows(const bf16* rows, std::int64_t sl, std::int64_t kd, std::int64_t n, bf16* bp) {
    const std::int64_t npad = bf16_pack_columns(n);
    std::memset(static_cast<void*>(bp), 0, static_cast<std::size_t>(bf16_pack_size(kd, n)) * sizeof(bf16));
    for (std::int64_t r = 0; r < kd; ++r) {
        const bf16* row = rows + r * sl;
        bf16* dst = bp + (r / 2) * npad * 2 + (r & 1);
        for (std::int64_t j = 0; j < n; ++j) dst[j * 2] = row[j];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace simd {
// The 32 bits of A(i, 2·pair), A(i, 2·pair + 1) (a zero for the second past an odd kd's end).
inline int bf16_pair(const bf16* row, std::int64_t pair, std::int64_t kd) {
    if (2 * pair + 1 < kd) {
        std::int32_t v;
        std::memcpy(&v, row + 2 * pair, 4);
        return v;
    }
    return static_cast<int>(row[2 * pair].bits);
}

// Rows [i, i + MR) of bf16_gemm: MR × 32 float accumulators per column block.
template <int MR>
inline void bf16_gemm_rows(std::int64_t i, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* bp,
                           float* c, std::int64_t ldc, float alpha, bool add) {
    const std::int64_t npad = bf16_pack_columns(n), pairs = (kd + 1) / 2;
    const __m512 va = _mm512_set1_ps(alpha);
    for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
        __m512 acc[MR][2];
        for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const bf16* b = bp + j0 * 2;
        for (std::int64_t kk = 0; kk < pairs; ++kk) {
            const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + kk * npad * 2));
            const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + kk * npad * 2 + 32));
            for (int r = 0; r < MR; ++r) {
                const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(bf16_pair(a + (i + r) * lda, kk, kd)));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
            }
        }
        const std::int64_t rem = n - j0;
        const __mmask16 m0 = rem >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << rem) - 1u);
        const __mmask16 m1 =
            rem >= 32 ? __mmask16(0xffff) : (rem > 16 ? static_cast<__mmask16>((1u << (rem - 16)) - 1u) : __mmask16(0));
        for (int r = 0; r < MR; ++r) {
            float* cr = c + (i + r) * ldc + j0;
            __m512 v0 = _mm512_mul_ps(acc[r][0], va), v1 = _mm512_mul_ps(acc[r][1], va);
            if (add) {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
            }
            _mm512_mask_storeu_ps(cr, m0, v0);
            if (m1) _mm512_mask_storeu_ps(cr + 16, m1, v1);
        }
    }
}
}  // namespace simd

/// @brief C(m, n) = alpha·A·B (+ C when `add`), float accumulation on vdpbf16ps: A (m, kd) bf16 rows
/// `lda` apart (read in pairs), B packed by bf16_pack_rows / bf16_pack_transposed, C float rows
/// `ldc` apart. Each bf16 product is exact in float; the sums are rounded in float (to nearest
/// even; the instruction flushes float denormals to zero).
inline void bf16_gemm(std::int64_t m, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* bp, float* c,
                      std::int64_t ldc, float alpha, bool add) {
    constexpr int mr = 8;
    std::int64_t i = 0;
    for (; i + mr <= m; i += mr) simd::bf16_gemm_rows<mr>(i, n, kd, a, lda, bp, c, ldc, alpha, add);
    switch (m - i) {
        case 7: simd::bf16_gemm_rows<7>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 6: simd::bf16_gemm_rows<6>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 5: simd::bf16_gemm_rows<5>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 4: simd::bf16_gemm_rows<4>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 3: simd::bf16_gemm_rows<3>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 2: simd::bf16_gemm_rows<2>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        case 1: simd::bf16_gemm_rows<1>(i, n, kd, a, lda, bp, c, ldc, alpha, add); break;
        default: break;
    }
}
#endif

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
