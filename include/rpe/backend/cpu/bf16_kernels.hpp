/// @file backend/cpu/bf16_kernels.hpp
/// @brief bf16 kernels of the CPU backend (not API): conversions between rpe::bf16 and float, the
/// bf16 matrix product with float accumulation of the bf16 attention, and on it the bf16 Linear
/// layers y = x·Wᵀ with W packed once (bf16_linear: the whole-model bf16 benchmarks).
///
/// The instruction set is the including unit's (isa.hpp): with AVX512_BF16 (`__AVX512BF16__` and
/// `__AVX512F__`, e.g. `-march=native` on Zen 4, Cooper Lake, Sapphire Rapids) the product runs on
/// vdpbf16ps (`_mm512_dpbf16_ps`: pairs of bf16 products, exact in float, added to float
/// accumulators); such units live in the ISA namespace `avx512_bf16`, apart from the `avx512`
/// units without it. Elsewhere hw_bf16 is false and the bf16 attention converts to float and runs
/// the float kernels (attention_bf16.hpp). The conversions give the same bits on every path
/// (rpe::bf16::round_bits: to nearest, ties to even, NaN quieted, denormals kept).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "../../bf16.hpp"
#include "isa.hpp"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define RPE_HAS_AMX_BF16 1
#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
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

/// @brief The path the bf16 products of this unit take on this CPU outside AMX (the bf16 Linear
/// layers; the attention where amx_granted() is false): "AVX512_BF16" or "portable".
inline const char* bf16_isa() { return hw_bf16 && cpu_has_avx512_bf16() ? "AVX512_BF16" : "portable"; }

/// @brief Test hook (not API): while true, the bf16 attention of this ISA takes the portable path
/// (float conversion and the float kernels) even where hw_bf16 is true, and bf16_gemm_auto and
/// bf16_linear take bf16_gemm_portable.
inline std::atomic<bool> bf16_portable_only{false};

/// True when this unit is built for AMX-BF16 (namespace amx_bf16: `__AMX_TILE__`, `__AMX_BF16__`,
/// `__AVX512BF16__`, `__AVX512F__`) and so has bf16_gemm_amx.
#if defined(RPE_HAS_AMX_BF16)
inline constexpr bool hw_amx = true;
#else
inline constexpr bool hw_amx = false;
#endif

/// @brief Whether AMX tiles may run in this process: hw_amx, the CPU reports AMX-TILE and AMX-BF16
/// (CPUID leaf 7: EDX bits 24 and 22) and AVX512_BF16, and Linux grants the tile data state
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18)` returns 0; the permission
/// is per process, so every thread then may use the tiles). Asked once (a thread-safe static) on
/// the first call; false on other systems and where the request is refused (kernels before 5.16,
/// VMs without the AMX state), and then the bf16 attention takes vdpbf16ps.
inline bool amx_granted() {
#if defined(RPE_HAS_AMX_BF16) && defined(__linux__)
    static const bool ok = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!((d >> 24) & 1u) || !((d >> 22) & 1u) || !cpu_has_avx512_bf16()) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ok;
#else
    return false;
#endif
}

/// @brief Test hook (not API): while true, the bf16 attention of an amx_bf16 unit takes vdpbf16ps
/// instead of the AMX tiles (bf16_portable_only still wins).
inline std::atomic<bool> bf16_amx_off{false};

/// @brief True when the bf16 attention forward of this unit runs its block products on AMX now:
/// amx_granted() and neither test hook (bf16_amx_off, bf16_portable_only) is on.
inline bool bf16_amx_now() {
    return amx_granted() && !bf16_amx_off.load(std::memory_order_relaxed) && !bf16_portable_only.load(std::memory_order_relaxed);
}

/// @brief The path of the bf16 attention forward's products in this unit on this machine:
/// "AMX_BF16" (amx_granted()), "AVX512_BF16" or "portable" (test hooks not counted).
inline const char* bf16_attention_isa() { return amx_granted() ? "AMX_BF16" : bf16_isa(); }

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

#if defined(RPE_HAS_AMX_BF16)
/// @brief The AMX tile configuration of bf16_gemm_amx: palette 1, tiles 0–7 all 16 rows × 64 bytes
/// (tmm0–3: 16 × 16 float accumulators, tmm4–5: 16 rows × 32 bf16 of A, tmm6–7: 16 pairs × 16
/// columns of B). RAII: the constructor loads it on the calling thread (LDTILECFG, which also zeroes
/// the tiles), the destructor releases the tiles (TILERELEASE: the thread's AMX state back to its
/// initial state, so context switches stop saving it). A thread's configuration is its own: each
/// OpenMP thread that calls bf16_gemm_amx makes one first. Only where amx_granted() (else the
/// instructions fault). Any tile configuration the thread had before is lost.
struct amx_tiles {
    struct alignas(64) config {
        std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
        std::uint16_t colsb[16] = {};
        std::uint8_t rows[16] = {};
    };
    amx_tiles() {
        config c;
        for (int t = 0; t < 8; ++t) {
            c.colsb[t] = 64;
            c.rows[t] = 16;
        }
        __asm__ __volatile__("" ::: "memory");  // g++'s ldtilecfg names 8 bytes of c as its input: keep every store
        _tile_loadconfig(&c);
    }
    ~amx_tiles() { _tile_release(); }
    amx_tiles(const amx_tiles&) = delete;
    amx_tiles& operator=(const amx_tiles&) = delete;
};

/// @brief Elements of a packed B of kd × n for bf16_gemm_amx: as bf16_pack_size with kd rounded up
/// to 32 (the tiles take 16 pairs at a time); the pairs past kd must be zeros (bf16_pack_rows /
/// bf16_pack_transposed zero only bf16_pack_size(kd, n): clear the rest first).
inline std::int64_t bf16_pack_size_amx(std::int64_t kd, std::int64_t n) { return bf16_pack_size((kd + 31) / 32 * 32, n); }

/// @brief bf16_gemm on AMX: C(m, n) = alpha·A·B (+ C when `add`), A (m, kd) bf16 rows `lda` apart,
/// B packed by bf16_pack_rows / bf16_pack_transposed in a buffer of bf16_pack_size_amx(kd, n)
/// elements with zeros past kd, C float rows `ldc` apart (columns past n untouched). Needs an
/// amx_tiles on the calling thread. Blocks of 32 rows × 32 columns: 4 float accumulator tiles,
/// per 32 of kd two A tiles (loaded in place from A when the 16 rows are there and kd is a
/// multiple of 32, else copied with zeros into a per-thread buffer) and two B tiles (in place: B's
/// pair layout is the TDPBF16PS B operand), 4 TDPBF16PS; the tiles stored to a float buffer and
/// scaled, added and stored with masks. Each bf16 product is exact; the float sums in the
/// instruction's own order (round to nearest even, float denormals flushed to zero): the bound of
/// bf16_gemm_portable.
inline void bf16_gemm_amx(std::int64_t m, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* bp,
                          float* c, std::int64_t ldc, float alpha, bool add) {
    const std::int64_t npad = bf16_pack_columns(n), kpad = (kd + 31) / 32 * 32, chunks = kpad / 32;
    const int bstride = static_cast<int>(npad * 4);  // bytes between pair rows of B
    thread_local std::vector<bf16> copy;
    alignas(64) float t[32 * 32];
    const __m512 va = _mm512_set1_ps(alpha);
    for (std::int64_t i0 = 0; i0 < m; i0 += 32) {
        const std::int64_t rows = std::min<std::int64_t>(32, m - i0);
        const bf16* ap[2] = {nullptr, nullptr};
        int as[2] = {0, 0};
        for (int g = 0; g < 2 && 16 * g < rows; ++g) {
            const std::int64_t r0 = i0 + 16 * g, gr = std::min<std::int64_t>(16, m - r0);
            if (gr == 16 && kd % 32 == 0) {
                ap[g] = a + r0 * lda;
                as[g] = static_cast<int>(lda * 2);
                continue;
            }
            if (copy.size() < static_cast<std::size_t>(32 * kpad)) copy.resize(static_cast<std::size_t>(32 * kpad));
            bf16* dst = copy.data() + g * 16 * kpad;
            std::memset(static_cast<void*>(dst), 0, static_cast<std::size_t>(16 * kpad) * sizeof(bf16));
            for (std::int64_t r = 0; r < gr; ++r)
                std::memcpy(static_cast<void*>(dst + r * kpad), a + (r0 + r) * lda, static_cast<std::size_t>(kd) * sizeof(bf16));
            ap[g] = dst;
            as[g] = static_cast<int>(kpad * 2);
        }
        const bool two = rows > 16;
        // g++'s tileloadd declares no memory input: the stores into A, B and the copy before it
        __asm__ __volatile__("" ::: "memory");
        for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
            const bf16* b = bp + j0 * 2;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (std::int64_t kc = 0; kc < chunks; ++kc) {
                const bf16* bk = b + kc * 16 * npad * 2;
                _tile_loadd(6, bk, bstride);
                _tile_loadd(7, bk + 32, bstride);
                _tile_loadd(4, ap[0] + kc * 32, as[0]);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, ap[1] + kc * 32, as[1]);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, t, 128);
            _tile_stored(1, t + 16, 128);
            if (two) {
                _tile_stored(2, t + 16 * 32, 128);
                _tile_stored(3, t + 16 * 32 + 16, 128);
            }
            const std::int64_t rem = n - j0;
            const __mmask16 m0 = rem >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << rem) - 1u);
            const __mmask16 m1 =
                rem >= 32 ? __mmask16(0xffff) : (rem > 16 ? static_cast<__mmask16>((1u << (rem - 16)) - 1u) : __mmask16(0));
            for (std::int64_t r = 0; r < rows; ++r) {
                float* cr = c + (i0 + r) * ldc + j0;
                __m512 v0 = _mm512_mul_ps(_mm512_load_ps(t + r * 32), va),
                       v1 = _mm512_mul_ps(_mm512_load_ps(t + r * 32 + 16), va);
                if (add) {
                    v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
                    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
                }
                _mm512_mask_storeu_ps(cr, m0, v0);
                if (m1) _mm512_mask_storeu_ps(cr + 16, m1, v1);
            }
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// bf16 Linear layers: y = x·Wᵀ, W packed once (the whole-model bf16 benchmarks,
// examples/vit/vit_model_bf16.hpp). bf16_gemm above is the AVX512_BF16 kernel; bf16_gemm_portable
// computes the same on every unit; bf16_linear picks one and runs W's column panels and blocks of
// rows of x in parallel.
// ---------------------------------------------------------------------------------------------

// Rows [i, i + MR) of bf16_gemm_portable: MR × 32 float accumulators per column block, B's pairs
// converted to float once per pair row and used by the MR rows.
template <int MR>
inline void bf16_gemm_portable_rows(std::int64_t i, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda,
                                    const bf16* bp, float* c, std::int64_t ldc, float alpha, bool add) {
    const std::int64_t npad = bf16_pack_columns(n), pairs = (kd + 1) / 2;
    for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
        float acc[MR][32] = {};
        float b0[32], b1[32];
        const bf16* b = bp + j0 * 2;
        for (std::int64_t kk = 0; kk < pairs; ++kk) {
            const bf16* bk = b + kk * npad * 2;
            for (int j = 0; j < 32; ++j) {
                b0[j] = static_cast<float>(bk[2 * j]);
                b1[j] = static_cast<float>(bk[2 * j + 1]);
            }
            for (int r = 0; r < MR; ++r) {
                const bf16* ar = a + (i + r) * lda + 2 * kk;
                const float a0 = static_cast<float>(ar[0]), a1 = 2 * kk + 1 < kd ? static_cast<float>(ar[1]) : 0.0f;
                for (int j = 0; j < 32; ++j) acc[r][j] += a0 * b0[j] + a1 * b1[j];
            }
        }
        const std::int64_t cols = std::min<std::int64_t>(32, n - j0);
        for (int r = 0; r < MR; ++r) {
            float* cr = c + (i + r) * ldc + j0;
            for (std::int64_t j = 0; j < cols; ++j) cr[j] = add ? cr[j] + alpha * acc[r][j] : alpha * acc[r][j];
        }
    }
}

/// @brief bf16_gemm's product on every unit (no AVX512_BF16 needed): C(m, n) = alpha·A·B (+ C when
/// `add`), A (m, kd) bf16 rows `lda` apart, B (kd, n) packed by bf16_pack_rows /
/// bf16_pack_transposed, C float rows `ldc` apart (columns past n untouched). The bf16 values are
/// converted to float (exactly), each product a·b is exact in float (8 × 8 significant bits), and
/// the sums are rounded in float: |C − exact| ≤ (kd + 2)·2^-24·(|alpha|·Σ_r |a_ir·b_rj| + |C|),
/// as bf16_gemm (whose instruction also flushes float denormals to zero; this one keeps them).
inline void bf16_gemm_portable(std::int64_t m, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* bp,
                               float* c, std::int64_t ldc, float alpha, bool add) {
    constexpr int mr = 4;
    std::int64_t i = 0;
    for (; i + mr <= m; i += mr) bf16_gemm_portable_rows<mr>(i, n, kd, a, lda, bp, c, ldc, alpha, add);
    for (; i < m; ++i) bf16_gemm_portable_rows<1>(i, n, kd, a, lda, bp, c, ldc, alpha, add);
}

/// @brief True when this unit's bf16 products run on AVX512_BF16 now: hw_bf16, the CPU reports
/// the instruction, and the test hook bf16_portable_only is off.
inline bool bf16_hw_now() { return hw_bf16 && cpu_has_avx512_bf16() && !bf16_portable_only.load(std::memory_order_relaxed); }

/// @brief C(m, n) = alpha·A·B (+ C when `add`) on the path of bf16_hw_now(): bf16_gemm
/// (AVX512_BF16) or bf16_gemm_portable; same arguments and error bound as those.
inline void bf16_gemm_auto(std::int64_t m, std::int64_t n, std::int64_t kd, const bf16* a, std::int64_t lda, const bf16* bp,
                           float* c, std::int64_t ldc, float alpha, bool add) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (bf16_hw_now()) {
        bf16_gemm(m, n, kd, a, lda, bp, c, ldc, alpha, add);
        return;
    }
#endif
    bf16_gemm_portable(m, n, kd, a, lda, bp, c, ldc, alpha, add);
}

/// @brief A Linear layer's weight W (n outputs, kd inputs; nn.Linear's (out, in), row-major)
/// packed for bf16_linear: in column panels of `panel` outputs (the last one narrower when n is not
/// a multiple), panel p holding B = W[p·panel : p·panel + width]ᵀ (kd × width) as
/// bf16_pack_transposed packs it (so a narrower last panel has its own npad, its width rounded up
/// to 32), panels one after another (panel p at p·panel_size()). A panel
/// of 128 outputs is kd·256 bytes (96 KiB for kd = 384, 384 KiB for 1536): one thread's panel stays
/// in its L2 while blocks of rows of x stream past it. Made by bf16_pack_linear.
struct bf16_linear_weight {
    static constexpr std::int64_t panel = 128;  ///< outputs per panel (a multiple of 32, bf16_gemm's block)
    std::int64_t n = 0;                         ///< outputs (W's rows)
    std::int64_t kd = 0;                        ///< inputs (W's columns)
    std::vector<bf16> packed;                   ///< the panels (see above)
    /// @brief Number of panels, ⌈n / panel⌉.
    [[nodiscard]] std::int64_t panels() const { return (n + panel - 1) / panel; }
    /// @brief Elements of one full panel (the stride between panels).
    [[nodiscard]] std::int64_t panel_size() const { return bf16_pack_size(kd, panel); }
};

/// @brief Whether bf16_linear / bf16_linear_tiles run the products of the packed weight `w` on AMX
/// tiles now: a unit built for AMX-BF16 (namespace amx_bf16), the tiles granted (amx_granted()),
/// neither test hook on (bf16_amx_now()), and w's inputs a multiple of 32 (the tiles take 16 pairs
/// at a time; the packed panels hold no zeros past kd). Otherwise vdpbf16ps or the portable kernel
/// (bf16_gemm_auto).
inline bool bf16_linear_uses_amx(const bf16_linear_weight& w) { return hw_amx && w.kd % 32 == 0 && bf16_amx_now(); }

/// @brief Packs W (n, kd), rows `ldw` apart (ldw ≥ kd), for bf16_linear (see bf16_linear_weight).
/// Done once per weight (at model set-up); n ≥ 0, kd ≥ 1.
inline bf16_linear_weight bf16_pack_linear(const bf16* w, std::int64_t ldw, std::int64_t n, std::int64_t kd) {
    bf16_linear_weight pw;
    pw.n = n;
    pw.kd = kd;
    pw.packed.resize(static_cast<std::size_t>(pw.panels() * pw.panel_size()));
    for (std::int64_t p = 0; p < pw.panels(); ++p) {
        const std::int64_t j0 = p * pw.panel, width = std::min(pw.panel, n - j0);
        bf16_pack_transposed(w + j0 * ldw, ldw, kd, width, pw.packed.data() + p * pw.panel_size());
    }
    return pw;
}

/// @brief y (m, n) = x (m, kd) · Wᵀ (+ y when `add`): a Linear layer without its bias, bf16 x and
/// W, float accumulation and float y. x: bf16 rows `ldx` apart; w: W packed by bf16_pack_linear;
/// y: float rows `ldy` apart (only its first n columns are written). The tiles (blocks of 64 rows
/// of x × one panel of W) run in parallel with OpenMP (panel-major: a thread keeps its panel
/// while the rows stream), each by bf16_linear_uses_amx(w) ? bf16_gemm_amx (AMX tiles, configured
/// once per thread and call) : bf16_gemm_auto (either way the error bound of bf16_gemm_portable;
/// the paths differ in the order of the float sums). With
/// `epilogue` (a callable `(i0, rows, j0, cols, float* t, ldt)`, not `nullptr`), the tile t = the
/// rows [i0, i0 + rows) × columns [j0, j0 + cols) of x·Wᵀ (rows ldt apart) is computed into the
/// thread's own float scratch instead of y and handed to the epilogue while it is in cache (y and
/// add unused; the epilogue may overwrite t and writes the layer's outputs: bias, activation,
/// rounding to bf16; it runs concurrently for different tiles and must not throw).
template <class Epilogue>
void bf16_linear_tiles(std::int64_t m, const bf16* x, std::int64_t ldx, const bf16_linear_weight& w, float* y, std::int64_t ldy,
                       bool add, Epilogue&& epilogue) {
    constexpr bool own_tile = !std::is_same_v<std::decay_t<Epilogue>, std::nullptr_t>;
    constexpr std::int64_t mb = 64;  // rows per tile: a multiple of bf16_gemm's 8 rows
    const std::int64_t blocks = (m + mb - 1) / mb, panels = w.panels(), items = blocks * panels;
    if (m <= 0 || w.n <= 0) return;
    [[maybe_unused]] const bool amx = bf16_linear_uses_amx(w);
#if defined(_OPENMP)
#pragma omp parallel if (items > 1)
#endif
    {
        std::vector<float> tile(own_tile ? static_cast<std::size_t>(mb * w.panel) : 0);
#if defined(RPE_HAS_AMX_BF16)
        std::optional<amx_tiles> tiles;  // this thread's tile configuration, for this call
        if (amx) tiles.emplace();
#endif
        const auto gemm = [&](std::int64_t rows, std::int64_t cols, const bf16* a, const bf16* b, float* c, std::int64_t ldc,
                              bool acc) {
#if defined(RPE_HAS_AMX_BF16)
            if (amx) return bf16_gemm_amx(rows, cols, w.kd, a, ldx, b, c, ldc, 1.0f, acc);
#endif
            bf16_gemm_auto(rows, cols, w.kd, a, ldx, b, c, ldc, 1.0f, acc);
        };
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (std::int64_t item = 0; item < items; ++item) {
            const std::int64_t p = item / blocks, i0 = (item % blocks) * mb;
            const std::int64_t j0 = p * w.panel, rows = std::min(mb, m - i0), cols = std::min(w.panel, w.n - j0);
            const bf16* b = w.packed.data() + p * w.panel_size();
            if constexpr (own_tile) {
                gemm(rows, cols, x + i0 * ldx, b, tile.data(), w.panel, false);
                epilogue(i0, rows, j0, cols, tile.data(), w.panel);
            } else {
                gemm(rows, cols, x + i0 * ldx, b, y + i0 * ldy + j0, ldy, add);
            }
        }
    }
}

/// @brief y (m, n) = x (m, kd) · Wᵀ (+ y when `add`), float y rows `ldy` apart: bf16_linear_tiles
/// without an epilogue (see there for the layouts, threads and error bound).
inline void bf16_linear(std::int64_t m, const bf16* x, std::int64_t ldx, const bf16_linear_weight& w, float* y, std::int64_t ldy,
                        bool add) {
    bf16_linear_tiles(m, x, ldx, w, y, ldy, add, nullptr);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
