/// @file backend/cpu/rope.hpp
/// @brief 2D rotary position embedding on the CPU: the row kernels that the fused attention
/// uses, and the standalone rotation of a (B, H, L, D) q or k tensor (rpe::rope_forward,
/// rpe::rope_backward).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "../../bf16.hpp"
#include "../../f16.hpp"
#include "../../detail/check.hpp"
#include "../../error.hpp"
#include "../../rope/rotary.hpp"
#include "../../tensor.hpp"
#include "isa.hpp"

namespace rpe {
namespace detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

#if defined(__GNUC__) || defined(__clang__)
#define RPE_ROPE_ROW_KERNEL __attribute__((noinline))
#else
#define RPE_ROPE_ROW_KERNEL
#endif

/// `a·b + c` rounded once where the target has a fused multiply-add (then explicit, so the
/// vectorised body, its scalar remainder and every call site round alike, whatever the
/// alignment or the compiler's contraction choices), else `a·b` rounded, then the sum.
template <class S>
inline S rope_mul_add(S a, S b, S c) {
#if defined(__FMA__) || defined(__aarch64__)
    return __builtin_fma(a, b, c);
#else
    return a * b + c;
#endif
}
template <>
inline float rope_mul_add<float>(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/// One row in the pairs layout: y_2j = c·x_2j − s·x_2j+1, y_2j+1 = s·x_2j + c·x_2j+1 with
/// c = scale·cos_j, s = sign·scale·sin_j (the second product rounded, the first fused where the
/// target has FMA: rope_mul_add). One compiled copy that both layouts run, so that `half` is
/// `pairs` on permuted channels bit for bit.
template <class S>
RPE_ROPE_ROW_KERNEL void rope_rotate_pairs_row(const S* cs, const S* sn, std::int64_t np, const S* x, S* y, S scale, S sign) {
    for (std::int64_t j = 0; j < np; ++j) {
        const S c = cs[j] * scale, s = sign * sn[j] * scale, x0 = x[2 * j], x1 = x[2 * j + 1];
        const S sx1 = s * x1, cx1 = c * x1;
        y[2 * j] = rope_mul_add(c, x0, -sx1);
        y[2 * j + 1] = rope_mul_add(s, x0, cx1);
    }
}

/// One row in the half layout: pair j is channels (j, j + np), turned with the operations of
/// rope_rotate_pairs_row in the same order (c = scale·cos_j, s = sign·scale·sin_j, the second
/// product rounded, then one fused step), so `half` equals `pairs` on permuted channels bit for
/// bit; its loads and stores are contiguous (no interleaving shuffles, no copy). x and y may be
/// the same row.
template <class S>
RPE_ROPE_ROW_KERNEL void rope_rotate_half_row(const S* cs, const S* sn, std::int64_t np, const S* x, S* y, S scale, S sign) {
    const S* xb = x + np;
    S* yb = y + np;
    for (std::int64_t j = 0; j < np; ++j) {
        const S c = cs[j] * scale, s = sign * sn[j] * scale, x0 = x[j], x1 = xb[j];
        const S sx1 = s * x1, cx1 = c * x1;
        y[j] = rope_mul_add(c, x0, -sx1);
        yb[j] = rope_mul_add(s, x0, cx1);
    }
}

/// One row's angle gradients in the pairs layout: a_j += g_2j+1·y_2j − g_2j·y_2j+1 (rounded as
/// rope_rotate_pairs_row: the second product, then one fused step where the target has FMA).
template <class S>
RPE_ROPE_ROW_KERNEL void rope_angle_grad_pairs_row(std::int64_t np, const S* yr, const S* gr, S* a) {
    for (std::int64_t j = 0; j < np; ++j) {
        const S gy = gr[2 * j] * yr[2 * j + 1];
        const S v = rope_mul_add(gr[2 * j + 1], yr[2 * j], -gy);
        a[j] = a[j] + v;
    }
}

/// Row x (D = 2·np channels) of the half layout in the pairs order: out_2j = x_j, out_2j+1 = x_j+np.
template <class S>
void rope_half_to_pairs(const S* x, std::int64_t np, S* out) {
    for (std::int64_t j = 0; j < np; ++j) {
        out[2 * j] = x[j];
        out[2 * j + 1] = x[j + np];
    }
}

/// One row in V-JEPA 2's layout (rope::layout::vjepa2; d channels, slices of s = 2·⌊⌊d/3⌋/2⌋):
/// in slice a, channel l takes entry e = a·s/2 + (l mod s/2) and partners l xor 1:
/// y_l = c_e·x_l − s_e·x_l+1 (l even), y_l = c_e·x_l + s_e·x_l−1 (l odd), times `scale`; from 3s on
/// y = scale·x. With `transpose`, the transpose map (the backward's): g_l = c_e(l)·x_l + s_e(l+1)·x_l+1
/// (l even), g_l = c_e(l)·x_l − s_e(l−1)·x_l−1 (l odd). Products rounded, then the sum, as the
/// source's `x·cos + rot(x)·sin`. x and y may be the same row.
template <class S>
RPE_ROPE_ROW_KERNEL void rope_rotate_vjepa2_row(const S* cs, const S* sn, std::int64_t d, const S* x, S* y, S scale,
                                                bool transpose) {
    const std::int64_t s = 2 * ((d / 3) / 2), m = s / 2;
    for (std::int64_t a = 0; a < 3; ++a)
        for (std::int64_t l = 0; l < s; l += 2) {
            const std::int64_t c = a * s + l, e0 = a * m + l % m, e1 = a * m + (l + 1) % m;
            const S x0 = x[c], x1 = x[c + 1];
            if (!transpose) {
                const S p0 = cs[e0] * x0, q0 = sn[e0] * x1, p1 = cs[e1] * x1, q1 = sn[e1] * x0;
                y[c] = (p0 - q0) * scale;
                y[c + 1] = (p1 + q1) * scale;
            } else {
                const S p0 = cs[e0] * x0, q0 = sn[e1] * x1, p1 = cs[e1] * x1, q1 = sn[e0] * x0;
                y[c] = (p0 + q0) * scale;
                y[c + 1] = (p1 - q1) * scale;
            }
        }
    for (std::int64_t c = 3 * s; c < d; ++c) y[c] = x[c] * scale;
}

/// Rows [i0, i0 + rb) of one (batch, head h) plane: dst = scale · R(angle) src, or with
/// `inverse` dst = scale · Rᵀ src (the backward's rotation back); tokens below skip and from
/// skip + t.tokens on (the suffix) are only scaled. Pair j is the channels of t.layout
/// ((2j, 2j+1) or (j, j + D/2); half rows go through rope_rotate_half_row, the pairs kernel's
/// arithmetic on contiguous halves; vjepa2 rows go through rope_rotate_vjepa2_row, whose
/// `inverse` is the transpose map). src and dst are (rb, D), src rows `src_stride` apart (−1: D, contiguous; 0 is a real
/// stride: one row repeated); they may be the same buffer.
template <class S>
void rope_rotate_rows(const rope_table<S>& t, std::int64_t h, std::int64_t skip, std::int64_t i0, std::int64_t rb, std::int64_t d,
                      const S* src, S* dst, S scale, bool inverse, std::int64_t src_stride = -1) {
    const S sign = inverse ? S(-1) : S(1);
    const std::int64_t ss = src_stride < 0 ? d : src_stride, np = t.pairs;
    const bool half = t.layout == rope::layout::half;
    for (std::int64_t r = 0; r < rb; ++r) {
        const std::int64_t i = i0 + r;
        const S* x = src + r * ss;
        S* y = dst + r * d;
        if (i < skip || i - skip >= t.tokens) {
            for (std::int64_t c = 0; c < d; ++c) y[c] = x[c] * scale;
            continue;
        }
        const S* cs = t.cos.data() + t.at(h, i - skip);
        const S* sn = t.sin.data() + t.at(h, i - skip);
        if (t.layout == rope::layout::vjepa2) {
            rope_rotate_vjepa2_row(cs, sn, d, x, y, scale, inverse);
            continue;
        }
        if (half)
            rope_rotate_half_row(cs, sn, np, x, y, scale, sign);
        else
            rope_rotate_pairs_row(cs, sn, np, x, y, scale, sign);
    }
}

/// Angle gradients of rows [i0, i0 + rb): with y = R x (rotated, any common scale) and g the
/// gradient of y (the inverse scale), ∂/∂angle = g_b·y_a − g_a·y_b for the pair's channels
/// (a, b) of `layout`, added into ga (rotated tokens, D/2) at row i − skip (skip tokens and the
/// suffix, from skip + tokens on, have none).
template <class S>
void rope_angle_grad_rows(std::int64_t pairs, std::int64_t skip, std::int64_t i0, std::int64_t rb, const S* y, const S* g, S* ga,
                          rope::layout layout, std::int64_t tokens) {
    const std::int64_t d = 2 * pairs;
    const bool half = layout == rope::layout::half;
    std::vector<S> buf(half ? static_cast<std::size_t>(2 * d) : 0);  // y, g interleaved
    for (std::int64_t r = 0; r < rb; ++r) {
        const std::int64_t i = i0 + r;
        if (i < skip || i - skip >= tokens) continue;
        S* a = ga + (i - skip) * pairs;
        const S* yr = y + r * d;
        const S* gr = g + r * d;
        if (half) {
            rope_half_to_pairs(yr, pairs, buf.data());
            rope_half_to_pairs(gr, pairs, buf.data() + d);
            yr = buf.data();
            gr = buf.data() + d;
        }
        rope_angle_grad_pairs_row(pairs, yr, gr, a);
    }
}

/// grad_freqs (2, H, D/2) of rope::mixed from the angle gradients ga (B·H planes, N, D/2):
/// fx[h, j] = Σ_b Σ_n t_x[n]·ga[b, h, n, j], fy likewise with t_y; summed in (b, n) order,
/// overwriting grad_freqs (or added to it with `accumulate`).
template <class S>
void rope_frequency_grad(const rope_table<S>& t, std::int64_t planes, std::int64_t heads, const S* ga, S* grad_freqs,
                         bool accumulate = false) {
    const std::int64_t n = t.tokens, pairs = t.pairs;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t h = 0; h < heads; ++h) {
        S* gx = grad_freqs + h * pairs;
        S* gy = grad_freqs + (heads + h) * pairs;
        if (!accumulate) {
            std::fill(gx, gx + pairs, S(0));
            std::fill(gy, gy + pairs, S(0));
        }
        for (std::int64_t p = h; p < planes; p += heads)
            for (std::int64_t i = 0; i < n; ++i) {
                const S* a = ga + (p * n + i) * pairs;
                const S tx = static_cast<S>(t.tx[static_cast<std::size_t>(i)]),
                        ty = static_cast<S>(t.ty[static_cast<std::size_t>(i)]);
                for (std::int64_t j = 0; j < pairs; ++j) {
                    gx[j] += tx * a[j];
                    gy[j] += ty * a[j];
                }
            }
    }
}

/// Float copies of a 16-bit (rpe::bf16 or rpe::f16) rotation's tensors: x (and grad_y) converted
/// once, the embedding with its frequencies in float (rope::mixed) and a float grad_freqs buffer
/// when one is wanted.
struct rope_float_copies {
    std::vector<float> x, grad_y, freqs, grad_freqs, y;
    rotary_embedding<float> r;
};

// The embedding's fields, mirrored: this fails to compile when rotary_embedding gains a field
// (forward it in rope_float_copies_of and in the 16-bit attentions' float inputs, or refuse it
// for 16-bit storage).
template <class H>
struct rope_known_fields {
    rope_form form;
    int skip;
    tensor_ref<const H> freqs;
    tensor_ref<H> grad_freqs;
    rope::layout layout;
    tensor_ref<const float> positions, key_positions;
    int suffix;
    int query_suffix;
};
static_assert(sizeof(rope_known_fields<bf16>) == sizeof(rotary_embedding<bf16>) &&
                  sizeof(rope_known_fields<f16>) == sizeof(rotary_embedding<f16>),
              "rpe::rotary_embedding gained a field: forward it in detail::cpu::rope_float_copies_of (backend/cpu/rope.hpp) "
              "and detail::half_glue::float_inputs (backend/cpu/attention_half.hpp)");

// Scalar conversions of H = rpe::bf16 or rpe::f16 (the types' own, the bits of bf16_kernels.hpp's
// and f16_kernels.hpp's vector ones): this header stays free of the intrinsics headers.
template <class H>
std::vector<float> rope_to_float(const tensor_ref<const H>& t) {
    std::vector<float> out(static_cast<std::size_t>(t.size()));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(t.data[i]);
    return out;
}

// n floats rounded to H (to nearest, ties to even), once.
template <class H>
void rope_round_to(const float* src, H* dst, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = H(src[i]);
}

template <class H>
void rope_float_copies_of(const rotary_embedding<H>& r, const tensor_ref<const H>& x,
                          std::type_identity_t<const tensor_ref<const H>*> grad_y, bool want_freqs, rope_float_copies& c) {
    c.r.form = r.form;
    c.r.skip = r.skip;
    c.r.layout = r.layout;
    c.r.positions = r.positions;
    c.r.key_positions = r.key_positions;
    c.r.suffix = r.suffix;
    c.r.query_suffix = r.query_suffix;
    if (r.freqs.data) {
        c.freqs = rope_to_float(r.freqs);
        c.r.freqs.data = c.freqs.data();
        c.r.freqs.rank = r.freqs.rank;
        c.r.freqs.shape = r.freqs.shape;
    }
    if (want_freqs) {
        c.grad_freqs.resize(static_cast<std::size_t>(r.grad_freqs.size()));
        c.r.grad_freqs.data = c.grad_freqs.data();
        c.r.grad_freqs.rank = r.grad_freqs.rank;
        c.r.grad_freqs.shape = r.grad_freqs.shape;
    }
    c.x = rope_to_float(x);
    if (grad_y) c.grad_y = rope_to_float(*grad_y);
    c.y.resize(c.x.size());
}

}  // namespace RPE_ISA_NS
}  // namespace detail::cpu

inline namespace RPE_ISA_NS {  // see isa.hpp

/// @brief Rotates a q or k tensor by a 2D rotary position embedding: `y = R x`, token by token
/// (see rpe::rotary_embedding; the `r.skip` leading and `r.queries_suffix()` trailing tokens (its
/// query_suffix, or suffix when that is −1) are copied unrotated).
/// @param r the embedding (form, skip, suffix, layout, optional per-token positions (N, 2), and
///   for rope::mixed freqs (2, H, D/2)).
/// @param height, width the grid: L = r.skip + height·width + r.queries_suffix() (unused with
///   r.positions: L = r.skip + N + r.queries_suffix()).
/// @param x (B, H, L, D) q or k, projected (before any scaling: the rotation commutes with it).
/// @param y (B, H, L, D), written; separate from x.
/// @throws rpe::invalid_argument `[rpe.rope] ...` (shapes, L, D not a multiple of 4 (axial,
///   cat) or 2 (mixed), policy parameters, overlapping buffers) before anything is written.
/// Threads: OpenMP over (batch, head) planes; results do not depend on the thread count.
/// @tparam S float, double, rpe::bf16 or rpe::f16 (16-bit storage of x, y and the frequencies: x
///   and the frequencies converted to float once, the float rotation, y rounded to bf16 / f16 once).
/// Source: rope-vit apply_rotary_emb; timm apply_rot_embed_cat (see rpe::rope).
template <class S>
void rope_forward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<S> y) {
    const std::int64_t planes =
        detail::check_rope_call(r, height, width, x, static_cast<const tensor_ref<const S>*>(nullptr), y, "y");
    if constexpr (std::is_same_v<S, bf16> || std::is_same_v<S, f16>) {
        detail::cpu::rope_float_copies c;
        (void)planes;
        detail::cpu::rope_float_copies_of(r, x, nullptr, false, c);
        const auto shape = {x.extent(0), x.extent(1), x.extent(2), x.extent(3)};
        rope_forward<float>(c.r, height, width, tensor_ref<const float>(c.x.data(), shape), tensor_ref<float>(c.y.data(), shape));
        detail::cpu::rope_round_to(c.y.data(), y.data, y.size());
    } else {
        const std::int64_t l = x.extent(2), d = x.extent(3), heads = x.extent(1);
        if (!r.enabled()) {
            std::copy(x.data, x.data + x.size(), y.data);
            return;
        }
        const auto t = rope_query_table(r, d, height, width);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
        for (std::int64_t p = 0; p < planes; ++p)
            detail::cpu::rope_rotate_rows(*t, p % heads, r.skip, 0, l, d, x.data + p * l * d, y.data + p * l * d, S(1), false);
    }
}

/// @brief Backward of rope_forward for `sum(y · grad_y)`: `grad_x = Rᵀ grad_y` and, for
/// rope::mixed with `r.grad_freqs` given, the frequencies' gradient (2, H, D/2) (overwritten):
/// `∂/∂fx[h, p] = Σ_{b, t} col_t · (g_b·y_a − g_a·y_b)` over the pair's channels (a, b), `fy`
/// with row_t (the positions' x and y with r.positions).
/// @param x the forward's input (B, H, L, D) (read for the frequency gradient).
/// @param grad_y (B, H, L, D); @param grad_x (B, H, L, D), written, separate from the inputs.
/// @tparam S float, double, rpe::bf16 or rpe::f16 (16-bit storage: x, grad_y and the frequencies
///   converted to float once, the float backward (the frequency gradient summed in float), grad_x
///   and grad_freqs rounded to bf16 / f16 once).
/// @throws as rope_forward, and `[rpe.rope] rope grad_freqs ...` for a bad grad_freqs.
template <class S>
void rope_backward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<const S> grad_y,
                   tensor_ref<S> grad_x) {
    const std::int64_t planes = detail::check_rope_call(r, height, width, x, &grad_y, grad_x, "grad_x");
    const std::int64_t l = x.extent(2), d = x.extent(3), heads = x.extent(1);
    const bool want_freqs = detail::check_rope_call_gradient(r, x, grad_y, grad_x);
    if constexpr (std::is_same_v<S, bf16> || std::is_same_v<S, f16>) {
        (void)planes, (void)l, (void)d, (void)heads;
        detail::cpu::rope_float_copies c;
        detail::cpu::rope_float_copies_of(r, x, &grad_y, want_freqs, c);
        const auto shape = {x.extent(0), x.extent(1), x.extent(2), x.extent(3)};
        rope_backward<float>(c.r, height, width, tensor_ref<const float>(c.x.data(), shape),
                             tensor_ref<const float>(c.grad_y.data(), shape), tensor_ref<float>(c.y.data(), shape));
        detail::cpu::rope_round_to(c.y.data(), grad_x.data, grad_x.size());
        if (want_freqs) detail::cpu::rope_round_to(c.grad_freqs.data(), r.grad_freqs.data, r.grad_freqs.size());
    } else {
        if (!r.enabled()) {
            std::copy(grad_y.data, grad_y.data + grad_y.size(), grad_x.data);
            return;
        }
        const auto t = rope_query_table(r, d, height, width);
        const std::int64_t n = t->tokens, pairs = t->pairs;
        std::vector<S> ga(want_freqs ? static_cast<std::size_t>(planes * n * pairs) : 0);
#if defined(_OPENMP)
#pragma omp parallel
#endif
        {
            std::vector<S> y(want_freqs ? static_cast<std::size_t>(l * d) : 0);
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
            for (std::int64_t p = 0; p < planes; ++p) {
                const std::int64_t h = p % heads;
                if (want_freqs) {
                    detail::cpu::rope_rotate_rows(*t, h, r.skip, 0, l, d, x.data + p * l * d, y.data(), S(1), false);
                    detail::cpu::rope_angle_grad_rows(pairs, r.skip, 0, l, y.data(), grad_y.data + p * l * d,
                                                      ga.data() + p * n * pairs, t->layout, n);
                }
                detail::cpu::rope_rotate_rows(*t, h, r.skip, 0, l, d, grad_y.data + p * l * d, grad_x.data + p * l * d, S(1),
                                              true);
            }
        }
        if (want_freqs) detail::cpu::rope_frequency_grad(*t, planes, heads, ga.data(), r.grad_freqs.data);
    }
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
