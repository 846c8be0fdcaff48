/// @file backend/cuda/rope.cuh
/// @brief 2D rotary position embedding on the GPU: the standalone rotation of a (B, H, L, D) q or
/// k tensor (rpe::cuda::rope_forward, rpe::cuda::rope_backward), the device copies of the
/// fixed forms' cos/sin tables and their cache, and the kernels that the CUDA attention uses for
/// rpe::cuda::attention_inputs::rope. Same notation as backend/cpu/rope.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>

#include "../../detail/single_flight.hpp"
#include "bucket_ids.cuh"
#include "../../error.hpp"
#include "../../rope/rotary.hpp"
#include "../../tensor.hpp"
#include "error.cuh"
#include "kernels.cuh"
#include "types.cuh"

namespace rpe::detail::gpu {

/// The cos/sin table as the kernels read it: cos and sin (heads, tokens, pairs) in the
/// accumulation type, heads 1 (fixed forms, shared by the heads) or H (rope::mixed); grid token
/// t = i − skip of row i sits at column t mod width, row t div width.
template <class A>
struct rope_view {
    const A* cos = nullptr;
    const A* sin = nullptr;
    std::int64_t heads = 1, tokens = 0, pairs = 0, skip = 0;
    int width = 1;
    rope::layout layout = rope::layout::pairs;  ///< channels of pair j: (2j, 2j+1) or (j, j + D/2)
    /// Channel of pair j's first element within a row; the second is `pair_step()` further.
    RPE_HOST_DEVICE std::int64_t pair_channel(std::int64_t j) const { return rope::first_channel(layout, j, pairs); }
    /// Distance between the two channels of a pair (1 or D/2).
    RPE_HOST_DEVICE std::int64_t pair_step() const { return rope::pair_stride(layout, pairs); }
    /// Offset of (head h of the call, grid token t, pair 0), as rpe::rope_table::at.
    RPE_HOST_DEVICE std::int64_t at(std::int64_t h, std::int64_t t) const { return ((heads == 1 ? 0 : h) * tokens + t) * pairs; }
};

}  // namespace rpe::detail::gpu

namespace rpe::cuda {

/// @brief Device copy of a fixed-form rpe::rope_table (rope::axial, rope::cat): cos and sin
/// (1, N, D/2) in A (float or double), uploaded once from the host table that
/// rpe::rope_table_of builds (angles in float32, cos and sin in double, rounded to A). Immutable;
/// owns its device memory.
template <class A>
class device_rope_table {
public:
    /// @brief Uploads `host` to the current device on `stream` and waits for that copy.
    /// @throws rpe::cuda_error when an allocation or copy fails.
    device_rope_table(const rope_table<A>& host, cudaStream_t stream)
        : heads_(host.heads), tokens_(host.tokens), pairs_(host.pairs) {
        RPE_CUDA_CHECK(cudaGetDevice(&device_));
        const std::size_t bytes = host.cos.size() * sizeof(A);
        try {
            RPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&cos_), bytes == 0 ? 1 : bytes));
            RPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&sin_), bytes == 0 ? 1 : bytes));
            // pageable host memory: wait for the copies (once per table and device)
            RPE_CUDA_CHECK(cudaMemcpyAsync(cos_, host.cos.data(), bytes, cudaMemcpyHostToDevice, stream));
            RPE_CUDA_CHECK(cudaMemcpyAsync(sin_, host.sin.data(), bytes, cudaMemcpyHostToDevice, stream));
            RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
        } catch (...) {
            release();
            throw;
        }
    }
    device_rope_table(const device_rope_table&) = delete;
    device_rope_table& operator=(const device_rope_table&) = delete;
    ~device_rope_table() { release(); }

    /// @brief The kernels' view of the table for `skip` leading unrotated tokens, rows of `width`
    /// and the channel layout.
    [[nodiscard]] detail::gpu::rope_view<A> view(std::int64_t skip, int width, rope::layout layout = rope::layout::pairs) const {
        return {cos_, sin_, heads_, tokens_, pairs_, skip, width, layout};
    }
    [[nodiscard]] int device() const { return device_; }  ///< the CUDA device holding the table
    /// @brief Device bytes held (cos and sin).
    [[nodiscard]] std::int64_t bytes() const { return 2 * heads_ * tokens_ * pairs_ * static_cast<std::int64_t>(sizeof(A)); }

private:
    void release() noexcept {
        if (cos_) (void)cudaFree(cos_);
        if (sin_) (void)cudaFree(sin_);
        cos_ = sin_ = nullptr;
    }

    std::int64_t heads_, tokens_, pairs_;
    int device_ = 0;
    A* cos_ = nullptr;
    A* sin_ = nullptr;
};

/// @brief Thread-safe cache of the fixed forms' device tables keyed by (policy, D, grid, element
/// type, device) (the host cache's rpe::detail::rope_key, the policy type-erased, plus the device): one upload per key,
/// like rpe::cuda::device_bucket_cache for bucket ids. rope::mixed is never cached (its
/// frequencies are learned; its table is computed on the device at each call).
class device_rope_cache {
public:
    /// @brief The device table of the fixed form `r` (float or double) for D and the grid on the
    /// current device, built by rpe::rope_table_of and uploaded on first use.
    /// @pre r checked by rpe::detail::check_rope; r.enabled(), not rope::mixed.
    /// @throws rpe::cuda_error when the device query, allocation or copy fails.
    template <class A>
    std::shared_ptr<const device_rope_table<A>> get(const rotary_embedding<A>& r, std::int64_t d, int height, int width,
                                                    cudaStream_t stream = nullptr) {
        int device = 0;
        RPE_CUDA_CHECK(cudaGetDevice(&device));
        const entry_key key{detail::rope_key_of(r, d, height, width), device};
        std::size_t bytes = 0;  // device bytes of the table uploaded by this call (the budget's count)
        auto v = entries_.get_or_build(
            key,
            [&]() -> std::shared_ptr<const void> {
                const auto host = rope_table_of(r, d, height, width);
                bytes = host->cos.size() * sizeof(A) * 2;
                return std::make_shared<const device_rope_table<A>>(*host, stream);
            },
            [&](const std::shared_ptr<const void>&) { return bytes; });
        return std::static_pointer_cast<const device_rope_table<A>>(v);
    }
    /// @brief Number of entries held.
    [[nodiscard]] std::size_t size() const { return entries_.size(); }
    /// @brief Uploads since construction (or the last clear).
    [[nodiscard]] std::size_t builds() const { return entries_.builds(); }
    /// @brief Drops every entry (tables already handed out stay valid).
    void clear() { entries_.clear(); }
    /// @brief Sets the byte budget of the device tables held (least recently used dropped past it).
    void set_budget(std::size_t bytes) { entries_.set_budget(bytes); }
    /// @brief The byte budget in force (default: detail::default_cache_budget()).
    [[nodiscard]] std::size_t budget() const { return entries_.budget(); }
    /// @brief Hits, misses, evictions, entries and device bytes held.
    [[nodiscard]] cache_stats stats() const { return entries_.stats(); }
    /// @brief The process-wide cache that rope_forward, rope_backward and the attention use.
    static device_rope_cache& global() {
        static device_rope_cache cache;
        return cache;
    }

private:
    struct entry_key {
        detail::rope_key key;
        int device = 0;
        bool operator==(const entry_key& o) const { return device == o.device && key == o.key; }
    };
    struct entry_hash {
        std::size_t operator()(const entry_key& k) const {
            return detail::rope_key_hash{}(k.key) * 31u ^ std::hash<int>{}(k.device);
        }
    };
    detail::single_flight_cache<entry_key, std::shared_ptr<const void>, entry_hash> entries_;
};

}  // namespace rpe::cuda

namespace rpe::detail::gpu {

// rope::mixed's table (H, N, D/2) from freqs (2, H, D/2) (device, storage S): the angle
// col·fx + row·fy of rope::mixed::angle (float32; double for double, as build_mixed_table) with
// each product and the sum rounded as on the host (no fused multiply-add, so the angles are the
// host's bit for bit), then cos and sin (the device's, within 2 ulp of the host's).
template <class S, class A>
__global__ void rope_mixed_table_kernel(const S* __restrict__ freqs, std::int64_t heads, std::int64_t tokens, std::int64_t pairs,
                                        int width, A* __restrict__ cos_out, A* __restrict__ sin_out) {
    const std::int64_t total = heads * tokens * pairs;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, n = (e / pairs) % tokens, h = e / (pairs * tokens);
        const A fx = to_acc(freqs[h * pairs + j]), fy = to_acc(freqs[(heads + h) * pairs + j]);
        const int row = static_cast<int>(n / width), col = static_cast<int>(n % width);
        A a;
        if constexpr (std::is_same_v<A, float>)
            a = __fadd_rn(__fmul_rn(static_cast<float>(col), fx), __fmul_rn(static_cast<float>(row), fy));
        else
            a = __dadd_rn(__dmul_rn(static_cast<double>(col), fx), __dmul_rn(static_cast<double>(row), fy));
        cos_out[e] = cos(a);
        sin_out[e] = sin(a);
    }
}

// y = R x (or Rᵀ x with `inverse`) for x, y (planes, L, D), one thread per channel pair; tokens
// below skip are copied. x and y may be the same buffer (each thread reads its pair, then writes it).
template <class S, class A>
__global__ void rope_rotate_kernel(rope_view<A> t, const S* x, S* y, std::int64_t planes, std::int64_t heads, std::int64_t n,
                                   bool inverse) {
    const std::int64_t pairs = t.pairs, total = planes * n * pairs;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, r = e / pairs, i = r % n, h = (r / n) % heads;
        const std::int64_t c0 = r * 2 * pairs + t.pair_channel(j), c1 = c0 + t.pair_step();
        const A x0 = to_acc(x[c0]), x1 = to_acc(x[c1]);
        if (i < t.skip) {
            y[c0] = from_acc<S>(x0);
            y[c1] = from_acc<S>(x1);
            continue;
        }
        const std::int64_t o = t.at(h, i - t.skip) + j;
        const A c = t.cos[o], s = inverse ? -t.sin[o] : t.sin[o];
        y[c0] = from_acc<S>(c * x0 - s * x1);
        y[c1] = from_acc<S>(s * x0 + c * x1);
    }
}

// The angle gradient of one channel pair (c0, c1): with y = R x and g the gradient of y,
// ∂/∂angle = g_c1·y_c0 − g_c0·y_c1 (y from x first when `rotate`).
template <class S, class A>
__device__ inline A rope_angle_grad(const S* y, const S* g, std::int64_t c0, std::int64_t c1, bool rotate, A c, A s) {
    A y0 = to_acc(y[c0]), y1 = to_acc(y[c1]);
    if (rotate) {
        const A r0 = c * y0 - s * y1;
        y1 = s * y0 + c * y1;
        y0 = r0;
    }
    return to_acc(g[c1]) * y0 - to_acc(g[c0]) * y1;
}

// Per-plane partials of rope::mixed's frequency gradient: one thread per (plane p, pair j), a
// serial loop over the grid tokens (deterministic):
//   part[0, p, j] = Σ_t col_t · a(p, t, j),  part[1, p, j] = Σ_t row_t · a(p, t, j),
// a the angle gradient of (y0, g0) plus, when y1 is given, of (y1, g1) (q and k in the attention).
template <class S, class A>
__global__ void rope_angle_partials_kernel(rope_view<A> t, const S* __restrict__ y0, const S* __restrict__ g0,
                                           const S* __restrict__ y1, const S* __restrict__ g1, bool rotate, std::int64_t planes,
                                           std::int64_t heads, std::int64_t n, A* __restrict__ part) {
    const std::int64_t pairs = t.pairs, total = planes * pairs;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, p = e / pairs, h = p % heads;
        A sx = 0, sy = 0;
        for (std::int64_t tok = 0; tok < t.tokens; ++tok) {
            const std::int64_t c0 = (p * n + t.skip + tok) * 2 * pairs + t.pair_channel(j), c1 = c0 + t.pair_step();
            const std::int64_t o = t.at(h, tok) + j;
            const A c = t.cos[o], s = t.sin[o];
            A a = rope_angle_grad<S, A>(y0, g0, c0, c1, rotate, c, s);
            if (y1) a += rope_angle_grad<S, A>(y1, g1, c0, c1, rotate, c, s);
            sx += static_cast<A>(static_cast<float>(tok % t.width)) * a;
            sy += static_cast<A>(static_cast<float>(tok / t.width)) * a;
        }
        part[p * pairs + j] = sx;
        part[(planes + p) * pairs + j] = sy;
    }
}

/// The cos/sin table of one call on the device: the cached device copy for the fixed forms, or
/// rope::mixed's table computed on the device from `r.freqs` (device memory) into stream-ordered
/// buffers freed at scope exit.
template <class S>
class rope_call_table {
public:
    using A = acc_t<S>;
    /// @pre r checked by check_rope against (H = heads, D = d) and the grid; r.enabled().
    rope_call_table(const rotary_embedding<S>& r, std::int64_t heads, std::int64_t d, int height, int width, cudaStream_t stream)
        : cos_(r.is_mixed() ? heads * height * width * (d / 2) : 0, stream),
          sin_(r.is_mixed() ? heads * height * width * (d / 2) : 0, stream) {
        if (r.layout == rope::layout::vjepa2)
            throw not_supported(message("rope",
                                        "rope::vjepa2 (V-JEPA 2's channel layout, rope::layout::vjepa2) is not supported by "
                                        "the cuda backend; expected pairs or half (the CPU backend takes rope::vjepa2)"));
        if (rope_position_axes(r.form) == 3)
            throw not_supported(message("rope",
                                        "rope::mrope (a form with 3-axis positions (t, h, w)) is not supported by the "
                                        "cuda backend; expected a 2D form (the CPU backend takes rope::mrope)"));
        if (r.has_positions() || r.suffix != 0)
            throw not_supported(message("rope",
                                        "rope positions, key_positions and suffix are not supported by the cuda "
                                        "backend; expected the grid (the CPU backend takes them)"));
        const std::int64_t tokens = static_cast<std::int64_t>(height) * width, pairs = d / 2;
        if (r.is_mixed()) {
            view_ = {cos_.get(), sin_.get(), heads, tokens, pairs, r.skip, width, r.layout};
            const std::int64_t total = heads * tokens * pairs;
            rope_mixed_table_kernel<S, A>
                <<<grid_for(total, 256), 256, 0, stream>>>(r.freqs.data, heads, tokens, pairs, width, cos_.get(), sin_.get());
            check_launch("rope_mixed_table_kernel");
        } else {
            rotary_embedding<A> fixed;  // the same form and skip in A (float or double): the host table's type
            fixed.form = r.form;
            fixed.skip = r.skip;
            fixed.layout = r.layout;
            table_ = cuda::device_rope_cache::global().get(fixed, d, height, width, stream);
            view_ = table_->view(r.skip, width, r.layout);
        }
    }
    [[nodiscard]] const rope_view<A>& view() const { return view_; }

private:
    device_buffer<A> cos_, sin_;
    std::shared_ptr<const cuda::device_rope_table<A>> table_;
    rope_view<A> view_{};
};

/// y = R x (Rᵀ x with `inverse`) for x, y (planes, L, D) on `stream`; x == y allowed.
template <class S>
void rope_rotate(const rope_view<acc_t<S>>& t, const S* x, S* y, std::int64_t planes, std::int64_t heads, std::int64_t n,
                 bool inverse, cudaStream_t stream) {
    const std::int64_t total = planes * n * t.pairs;
    rope_rotate_kernel<S, acc_t<S>><<<grid_for(total, 256), 256, 0, stream>>>(t, x, y, planes, heads, n, inverse);
    check_launch("rope_rotate_kernel");
}

/// rope::mixed's grad_freqs (2, H, D/2) (overwritten) from the angle gradients of (y0, g0) and,
/// when y1 is given, (y1, g1), all (planes, L, D): per-plane partials, then the fixed-order
/// reduction over the batch of the table gradients (reduce_partials). Deterministic.
template <class S>
void rope_frequency_grad(const rope_view<acc_t<S>>& t, const S* y0, const S* g0, const S* y1, const S* g1, bool rotate,
                         std::int64_t planes, std::int64_t heads, std::int64_t n, S* grad_freqs, cudaStream_t stream) {
    using A = acc_t<S>;
    const std::int64_t pairs = t.pairs;
    device_buffer<A> part(2 * planes * pairs, stream);  // (2, planes, D/2)
    rope_angle_partials_kernel<S, A>
        <<<grid_for(planes * pairs, 128), 128, 0, stream>>>(t, y0, g0, y1, g1, rotate, planes, heads, n, part.get());
    check_launch("rope_angle_partials_kernel");
    for (int axis = 0; axis < 2; ++axis)  // out[axis, h, j] = Σ_b part[axis, b·H + h, j]
        reduce_partials(static_cast<const A*>(part.get() + axis * planes * pairs), planes, heads, heads, 1, pairs, false,
                        grad_freqs + axis * heads * pairs, stream);
}

}  // namespace rpe::detail::gpu

namespace rpe::cuda {

/// @brief Rotates a q or k tensor by a 2D rotary position embedding on the GPU: `y = R x`, token
/// by token, as rpe::rope_forward (see rpe::rotary_embedding; tokens below `r.skip` are copied).
/// @param r the embedding (form, skip; for rope::mixed freqs (2, H, D/2) in device memory).
/// @param height, width the grid: L = r.skip + height·width.
/// @param x (B, H, L, D), device; @param y (B, H, L, D), device, written, separate from x.
/// @param stream the caller's stream; nothing waits except a fixed form's first use of a
///   (policy, D, grid, device), which uploads its table and waits for that copy.
/// @pre S float, double, __half or __nv_bfloat16 (cos, sin and products in acc_t<S>; one
///   rounding to S per output element). The fixed forms' tables are rpe::rope_table_of's
///   (float for float, __half and bf16; double for double), cached per device; rope::mixed's
///   is computed on the device at each call (angles in float32, as on the CPU; double for double).
/// @throws rpe::invalid_argument `[rpe.rope] ...` with the CPU's messages (the same
///   rpe::detail::check_rope_call) before any CUDA call; rpe::cuda_error.
/// Source: rope-vit apply_rotary_emb; timm apply_rot_embed_cat (see rpe::rope).
template <class S>
void rope_forward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<S> y,
                  cudaStream_t stream = nullptr) {
    const std::int64_t planes =
        detail::check_rope_call(r, height, width, x, static_cast<const tensor_ref<const S>*>(nullptr), y, "y");
    const std::int64_t heads = x.extent(1), l = x.extent(2), d = x.extent(3);
    if (!r.enabled()) {
        RPE_CUDA_CHECK(
            cudaMemcpyAsync(y.data, x.data, static_cast<std::size_t>(x.size()) * sizeof(S), cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const detail::gpu::rope_call_table<S> table(r, heads, d, height, width, stream);
    detail::gpu::rope_rotate<S>(table.view(), x.data, y.data, planes, heads, l, false, stream);
}

/// @brief Backward of rope_forward on the GPU, as rpe::rope_backward: `grad_x = Rᵀ grad_y` and,
/// for rope::mixed with `r.grad_freqs` given (device, (2, H, D/2), overwritten), the
/// frequencies' gradient `∂/∂fx[h, p] = Σ_{b, t} col_t · (g_2p+1·y_2p − g_2p·y_2p+1)`, `fy`
/// with row_t, y = R x recomputed; summed per (b, h) plane over the tokens, then over the batch
/// in a fixed order (deterministic; not the CPU's summation order, so equal to rounding).
/// @param x the forward's input (B, H, L, D) (read for the frequency gradient); @param grad_y
///   (B, H, L, D); @param grad_x (B, H, L, D), written, separate from the inputs; device.
/// @throws as rope_forward, and `[rpe.rope] rope grad_freqs ...` for a bad grad_freqs.
template <class S>
void rope_backward(const rotary_embedding<S>& r, int height, int width, tensor_ref<const S> x, tensor_ref<const S> grad_y,
                   tensor_ref<S> grad_x, cudaStream_t stream = nullptr) {
    const std::int64_t planes = detail::check_rope_call(r, height, width, x, &grad_y, grad_x, "grad_x");
    const bool want_freqs = detail::check_rope_call_gradient(r, x, grad_y, grad_x);
    const std::int64_t heads = x.extent(1), l = x.extent(2), d = x.extent(3);
    if (!r.enabled()) {
        RPE_CUDA_CHECK(cudaMemcpyAsync(grad_x.data, grad_y.data, static_cast<std::size_t>(grad_y.size()) * sizeof(S),
                                       cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const detail::gpu::rope_call_table<S> table(r, heads, d, height, width, stream);
    if (want_freqs)
        detail::gpu::rope_frequency_grad<S>(table.view(), x.data, grad_y.data, nullptr, nullptr, true, planes, heads, l,
                                            r.grad_freqs.data, stream);
    detail::gpu::rope_rotate<S>(table.view(), grad_y.data, grad_x.data, planes, heads, l, true, stream);
}

/// @brief What each device cache did and holds (hits, misses, evictions, entries, device bytes, budget).
struct device_cache_stats {
    cache_stats bucket_ids;   ///< rpe::cuda::device_bucket_cache::global()
    cache_stats rope_tables;  ///< rpe::cuda::device_rope_cache::global()
};

/// @brief Sets the byte budget of the process-wide device caches (bucket ids, RoPE tables; each
/// on its own) and drops least recently used entries down to it at once (their device memory is
/// freed once no running call holds them). The host caches have rpe::set_cache_budget.
inline void set_cache_budget(std::size_t bytes) {
    device_bucket_cache::global().set_budget(bytes);
    device_rope_cache::global().set_budget(bytes);
}

/// @brief The counters and holdings of the process-wide device caches.
inline device_cache_stats cache_statistics() {
    return {device_bucket_cache::global().stats(), device_rope_cache::global().stats()};
}

}  // namespace rpe::cuda
