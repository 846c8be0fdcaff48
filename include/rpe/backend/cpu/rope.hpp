/// @file backend/cpu/rope.hpp
/// @brief 2D rotary position embedding on the CPU: the row kernels that the fused attention
/// uses, and the standalone rotation of a (B, H, L, D) q or k tensor (rpe::rope_forward,
/// rpe::rope_backward).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../../detail/check.hpp"
#include "../../error.hpp"
#include "../../rope/rotary.hpp"
#include "../../tensor.hpp"
#include "isa.hpp"

namespace rpe {
namespace detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

/// Rows [i0, i0 + rb) of one (batch, head h) plane: dst = scale · R(angle) src, or with
/// `inverse` dst = scale · Rᵀ src (the backward's rotation back); tokens below skip are only
/// scaled. src and dst are (rb, D), src rows `src_stride` apart (−1: D, contiguous; 0 is a real
/// stride: one row repeated); they may be the same buffer.
template <class S>
void rope_rotate_rows(const rope_table<S>& t, std::int64_t h, std::int64_t skip, std::int64_t i0, std::int64_t rb,
                      std::int64_t d, const S* src, S* dst, S scale, bool inverse, std::int64_t src_stride = -1) {
    const S sign = inverse ? S(-1) : S(1);
    const std::int64_t ss = src_stride < 0 ? d : src_stride;
    for (std::int64_t r = 0; r < rb; ++r) {
        const std::int64_t i = i0 + r;
        const S* x = src + r * ss;
        S* y = dst + r * d;
        if (i < skip) {
            for (std::int64_t c = 0; c < d; ++c) y[c] = x[c] * scale;
            continue;
        }
        const S* cs = t.cos.data() + t.at(h, i - skip);
        const S* sn = t.sin.data() + t.at(h, i - skip);
        for (std::int64_t j = 0; j < t.pairs; ++j) {
            const S c = cs[j] * scale, s = sign * sn[j] * scale, x0 = x[2 * j], x1 = x[2 * j + 1];
            y[2 * j] = c * x0 - s * x1;
            y[2 * j + 1] = s * x0 + c * x1;
        }
    }
}

/// Angle gradients of rows [i0, i0 + rb): with y = R x (rotated, any common scale) and g the
/// gradient of y (the inverse scale), ∂/∂angle = g_2p+1·y_2p − g_2p·y_2p+1, added into
/// ga (grid tokens, D/2) at row i − skip (skip tokens have none).
template <class S>
void rope_angle_grad_rows(std::int64_t pairs, std::int64_t skip, std::int64_t i0, std::int64_t rb, const S* y, const S* g,
                          S* ga) {
    const std::int64_t d = 2 * pairs;
    for (std::int64_t r = 0; r < rb; ++r) {
        const std::int64_t i = i0 + r;
        if (i < skip) continue;
        S* a = ga + (i - skip) * pairs;
        const S* yr = y + r * d;
        const S* gr = g + r * d;
        for (std::int64_t j = 0; j < pairs; ++j) a[j] += gr[2 * j + 1] * yr[2 * j] - gr[2 * j] * yr[2 * j + 1];
    }
}

/// grad_freqs (2, H, D/2) of rope::mixed from the angle gradients ga (B·H planes, N, D/2):
/// fx[h, j] = Σ_b Σ_n t_x[n]·ga[b, h, n, j], fy likewise with t_y; summed in (b, n) order.
template <class S>
void rope_frequency_grad(const rope_table<S>& t, std::int64_t planes, std::int64_t heads, const S* ga, S* grad_freqs) {
    const std::int64_t n = t.tokens, pairs = t.pairs;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t h = 0; h < heads; ++h) {
        S* gx = grad_freqs + h * pairs;
        S* gy = grad_freqs + (heads + h) * pairs;
        std::fill(gx, gx + pairs, S(0));
        std::fill(gy, gy + pairs, S(0));
        for (std::int64_t p = h; p < planes; p += heads)
            for (std::int64_t i = 0; i < n; ++i) {
                const S* a = ga + (p * n + i) * pairs;
                const S tx = static_cast<S>(t.tx[static_cast<std::size_t>(i)]), ty = static_cast<S>(t.ty[static_cast<std::size_t>(i)]);
                for (std::int64_t j = 0; j < pairs; ++j) {
                    gx[j] += tx * a[j];
                    gy[j] += ty * a[j];
                }
            }
    }
}

}  // namespace RPE_ISA_NS
}  // namespace detail::cpu

inline namespace RPE_ISA_NS {  // see isa.hpp

/// @brief Rotates a q or k tensor by a 2D rotary position embedding: `y = R x`, token by token
/// (see rpe::rotary_embedding; tokens below `r.skip` are copied unrotated).
/// @param r the embedding (form, skip, and for rope::mixed freqs (2, H, D/2)).
/// @param height, width the grid: L = r.skip + height·width.
/// @param x (B, H, L, D) q or k, projected (before any scaling: the rotation commutes with it).
/// @param y (B, H, L, D), written; separate from x.
/// @throws rpe::invalid_argument `[rpe.rope] ...` (shapes, L, D not a multiple of 4 (axial,
///   cat) or 2 (mixed), policy parameters, overlapping buffers) before anything is written.
/// Threads: OpenMP over (batch, head) planes; results do not depend on the thread count.
/// Source: rope-vit apply_rotary_emb; timm apply_rot_embed_cat (see rpe::rope).
template <class S>
void rope_forward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<S> y) {
    const std::int64_t planes = detail::check_rope_call(r, height, width, x, static_cast<const tensor_ref<const S>*>(nullptr), y, "y");
    const std::int64_t l = x.extent(2), d = x.extent(3), heads = x.extent(1);
    if (!r.enabled()) {
        std::copy(x.data, x.data + x.size(), y.data);
        return;
    }
    const auto t = rope_table_of(r, d, height, width);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t p = 0; p < planes; ++p)
        detail::cpu::rope_rotate_rows(*t, p % heads, r.skip, 0, l, d, x.data + p * l * d, y.data + p * l * d, S(1), false);
}

/// @brief Backward of rope_forward for `sum(y · grad_y)`: `grad_x = Rᵀ grad_y` and, for
/// rope::mixed with `r.grad_freqs` given, the frequencies' gradient (2, H, D/2) (overwritten):
/// `∂/∂fx[h, p] = Σ_{b, t} col_t · (g_2p+1·y_2p − g_2p·y_2p+1)`, `fy` with row_t.
/// @param x the forward's input (B, H, L, D) (read for the frequency gradient).
/// @param grad_y (B, H, L, D); @param grad_x (B, H, L, D), written, separate from the inputs.
/// @throws as rope_forward, and `[rpe.rope] rope grad_freqs ...` for a bad grad_freqs.
template <class S>
void rope_backward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<const S> grad_y,
                   tensor_ref<S> grad_x) {
    const std::int64_t planes = detail::check_rope_call(r, height, width, x, &grad_y, grad_x, "grad_x");
    const std::int64_t l = x.extent(2), d = x.extent(3), heads = x.extent(1);
    const bool want_freqs = detail::check_rope_call_gradient(r, x, grad_y, grad_x);
    if (!r.enabled()) {
        std::copy(grad_y.data, grad_y.data + grad_y.size(), grad_x.data);
        return;
    }
    const auto t = rope_table_of(r, d, height, width);
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
                detail::cpu::rope_angle_grad_rows(pairs, r.skip, 0, l, y.data(), grad_y.data + p * l * d, ga.data() + p * n * pairs);
            }
            detail::cpu::rope_rotate_rows(*t, h, r.skip, 0, l, d, grad_y.data + p * l * d, grad_x.data + p * l * d, S(1), true);
        }
    }
    if (want_freqs) detail::cpu::rope_frequency_grad(*t, planes, heads, ga.data(), r.grad_freqs.data);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
