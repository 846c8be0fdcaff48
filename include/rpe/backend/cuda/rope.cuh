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
#include <vector>

#include "../../detail/single_flight.hpp"
#include "bucket_ids.cuh"
#include "../../error.hpp"
#include "../../rope/rotary.hpp"
#include "../../rope/rounding.hpp"
#include "../../tensor.hpp"
#include "error.cuh"
#include "kernels.cuh"
#include "types.cuh"

namespace rpe::detail::gpu {

/// The cos/sin table as the kernels read it: cos and sin (heads, tokens, pairs) in the
/// accumulation type, heads 1 (fixed forms, shared by the heads) or H (rope::mixed); rotated
/// token t = i − skip of row i (0 <= t < tokens; rows from skip + tokens on are the suffix,
/// copied) sits at column t mod width, row t div width of the grid, or at `pos` (device,
/// (tokens, 2) (row, col) floats) when given (rope::mixed at per-token positions: its frequency
/// gradient reads them).
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
    const float* pos = nullptr;  ///< rope::mixed at positions: (tokens, 2) (row, col), device; null = the grid
    /// Column (x) of rotated token t: pos[t, 1], or t mod width on the grid.
    RPE_HOST_DEVICE float col_of(std::int64_t t) const { return pos ? pos[2 * t + 1] : static_cast<float>(t % width); }
    /// Row (y) of rotated token t: pos[t, 0], or t div width on the grid.
    RPE_HOST_DEVICE float row_of(std::int64_t t) const { return pos ? pos[2 * t] : static_cast<float>(t / width); }
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
    /// @brief The device table of the fixed form `r` (float or double) at the per-token positions
    /// `p` (N, A) (host memory, checked by check_rope) for D on the current device: the host's
    /// rpe::rope_position_table (the CPU's table bit for bit), uploaded on first use per (policy,
    /// positions' values, D, type, layout, device), so the layers that share positions share it.
    /// @pre r checked by rpe::detail::check_rope; r.enabled(), not rope::mixed.
    /// @throws rpe::cuda_error when the device query, allocation or copy fails.
    template <class A>
    std::shared_ptr<const device_rope_table<A>> get_at(const rotary_embedding<A>& r, const tensor_ref<const float>& p,
                                                       std::int64_t d, cudaStream_t stream = nullptr) {
        int device = 0;
        RPE_CUDA_CHECK(cudaGetDevice(&device));
        const entry_key key{detail::rope_data_key_of(r, d, 0, 0, &p), device};
        std::size_t bytes = 0;
        auto v = entries_.get_or_build(
            key,
            [&]() -> std::shared_ptr<const void> {
                const auto host = rope_position_table(r, p, d);
                bytes = host->cos.size() * sizeof(A) * 2 + key.key.data.size();
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
// x·fx + y·fy of rope::mixed::angle / angle_at (float32; double for double, as build_mixed_table
// and build_position_table) with each product and the sum rounded as on the host (no fused
// multiply-add, so the angles are the host's bit for bit), then cos and sin (the device's, within
// 2 ulp of the host's). (y, x) = (row, col) = (n div width, n mod width) of the grid, or
// (pos[n, 0], pos[n, 1]) at per-token positions `pos` (device, (N, 2), null = the grid).
template <class S, class A>
__global__ void rope_mixed_table_kernel(const S* __restrict__ freqs, std::int64_t heads, std::int64_t tokens, std::int64_t pairs,
                                        int width, const float* __restrict__ pos, A* __restrict__ cos_out,
                                        A* __restrict__ sin_out) {
    const std::int64_t total = heads * tokens * pairs;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, n = (e / pairs) % tokens, h = e / (pairs * tokens);
        const A fx = to_acc(freqs[h * pairs + j]), fy = to_acc(freqs[(heads + h) * pairs + j]);
        // the host's coordinates: float (int row, col converted; or the positions' floats), then A
        const float row = pos ? pos[2 * n] : static_cast<float>(static_cast<int>(n / width)),
                    col = pos ? pos[2 * n + 1] : static_cast<float>(static_cast<int>(n % width));
        A a;
        if constexpr (std::is_same_v<A, float>)
            a = __fadd_rn(__fmul_rn(col, fx), __fmul_rn(row, fy));
        else
            a = __dadd_rn(__dmul_rn(static_cast<double>(col), fx), __dmul_rn(static_cast<double>(row), fy));
        cos_out[e] = cos(a);
        sin_out[e] = sin(a);
    }
}

// y = R x (or Rᵀ x with `inverse`) for x, y (planes, L, D), one thread per channel pair; tokens
// below skip and from skip + t.tokens on (the suffix) are copied. x and y may be the same
// buffer (each thread reads its pair, then writes it). V-JEPA 2's layout (rope::layout::vjepa2,
// D = 2·pairs, slices of s = 2·⌊⌊D/3⌋/2⌋ channels, m = s/2): thread j takes channels (c, c + 1),
// c = 2j; from 3s on they are copied; else in slice a = c div s, l = c mod s, channel c reads
// entry e0 = a·m + (l mod m), channel c + 1 entry e1 = a·m + ((l + 1) mod m):
// y_c = cos_e0·x_c − sin_e0·x_c+1, y_c+1 = cos_e1·x_c+1 + sin_e1·x_c, and with `inverse` the
// transpose map y_c = cos_e0·x_c + sin_e1·x_c+1, y_c+1 = cos_e1·x_c+1 − sin_e0·x_c, each product
// rounded, then the sum (no fused multiply-add), as rope_rotate_vjepa2_row on the CPU.
template <class S, class A>
__global__ void rope_rotate_kernel(rope_view<A> t, const S* x, S* y, std::int64_t planes, std::int64_t heads, std::int64_t n,
                                   bool inverse) {
    const std::int64_t pairs = t.pairs, total = planes * n * pairs;
    const bool vjepa2 = t.layout == rope::layout::vjepa2;
    const std::int64_t slice = 2 * (((2 * pairs) / 3) / 2), half_slice = slice / 2;  // vjepa2's s and m
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, r = e / pairs, i = r % n, h = (r / n) % heads;
        const std::int64_t c0 = r * 2 * pairs + t.pair_channel(j), c1 = c0 + t.pair_step();
        const A x0 = to_acc(x[c0]), x1 = to_acc(x[c1]);
        if (i < t.skip || i - t.skip >= t.tokens || (vjepa2 && 2 * j >= 3 * slice)) {
            y[c0] = from_acc<S>(x0);
            y[c1] = from_acc<S>(x1);
            continue;
        }
        if (vjepa2) {
            const std::int64_t a = (2 * j) / slice, l = (2 * j) % slice, base = t.at(h, i - t.skip);
            const std::int64_t e0 = base + a * half_slice + l % half_slice, e1 = base + a * half_slice + (l + 1) % half_slice;
            const A p0 = detail::rounded_product(t.cos[e0], x0), p1 = detail::rounded_product(t.cos[e1], x1);
            if (!inverse) {
                y[c0] = from_acc<S>(p0 - detail::rounded_product(t.sin[e0], x1));
                y[c1] = from_acc<S>(p1 + detail::rounded_product(t.sin[e1], x0));
            } else {
                y[c0] = from_acc<S>(p0 + detail::rounded_product(t.sin[e1], x1));
                y[c1] = from_acc<S>(p1 - detail::rounded_product(t.sin[e0], x0));
            }
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
// serial loop over the rotated tokens (deterministic):
//   part[0, p, j] = Σ_t x_t · a(p, t, j),  part[1, p, j] = Σ_t y_t · a(p, t, j),
// a the angle gradient of (y0, g0) at t0's table and coordinates (x_t, y_t) = (t0.col_of(t),
// t0.row_of(t)), plus, when y1 is given, that of (y1, g1) at t1's (q and k in the attention; the
// keys may sit at other positions): the x and y sums of each taken separately, then added.
template <class S, class A>
__device__ inline void rope_angle_partial_sums(const rope_view<A>& t, const S* y, const S* g, bool rotate, std::int64_t p,
                                               std::int64_t h, std::int64_t j, std::int64_t n, A& sx, A& sy) {
    for (std::int64_t tok = 0; tok < t.tokens; ++tok) {
        const std::int64_t c0 = (p * n + t.skip + tok) * 2 * t.pairs + t.pair_channel(j), c1 = c0 + t.pair_step();
        const std::int64_t o = t.at(h, tok) + j;
        const A a = rope_angle_grad<S, A>(y, g, c0, c1, rotate, t.cos[o], t.sin[o]);
        sx += static_cast<A>(t.col_of(tok)) * a;
        sy += static_cast<A>(t.row_of(tok)) * a;
    }
}

template <class S, class A>
__global__ void rope_angle_partials_kernel(rope_view<A> t0, const S* __restrict__ y0, const S* __restrict__ g0, rope_view<A> t1,
                                           const S* __restrict__ y1, const S* __restrict__ g1, bool rotate, std::int64_t planes,
                                           std::int64_t heads, std::int64_t n, std::int64_t n1, A* __restrict__ part) {
    const std::int64_t pairs = t0.pairs, total = planes * pairs;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
        const std::int64_t j = e % pairs, p = e / pairs, h = p % heads;
        A sx = 0, sy = 0;
        rope_angle_partial_sums<S, A>(t0, y0, g0, rotate, p, h, j, n, sx, sy);
        if (y1) rope_angle_partial_sums<S, A>(t1, y1, g1, rotate, p, h, j, n1, sx, sy);
        part[p * pairs + j] = sx;
        part[(planes + p) * pairs + j] = sy;
    }
}

/// Host copies of an embedding's per-token positions and key_positions ((N, A) floats each, in
/// device (or managed) memory: copied on `stream` and waited for) and the embedding `r` with them
/// in their place: what the shared checks (check_rope reads the positions' values) and the host
/// table builder (rope_position_table) take. Positions in host memory (cudaPointerGetAttributes
/// says host or unregistered, or fails: no device) are read in place; a positions field that is
/// not a non-null contiguous rank-2 view is left as given: the checks refuse it before reading it.
template <class S>
struct host_rope_positions {
    std::vector<float> positions, key_positions;
    rotary_embedding<S> r;
    host_rope_positions(const rotary_embedding<S>& in, cudaStream_t stream) : r(in) {
        copy(in.positions, positions, r.positions, stream);
        copy(in.key_positions, key_positions, r.key_positions, stream);
        if (!positions.empty() || !key_positions.empty()) RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    host_rope_positions(const host_rope_positions&) = delete;  // r points into the vectors
    host_rope_positions& operator=(const host_rope_positions&) = delete;

private:
    static void copy(const tensor_ref<const float>& p, std::vector<float>& host, tensor_ref<const float>& out,
                     cudaStream_t stream) {
        if (p.data == nullptr || p.rank != 2 || !p.contiguous() || p.size() <= 0) return;
        cudaPointerAttributes at{};
        if (cudaPointerGetAttributes(&at, p.data) != cudaSuccess) {
            (void)cudaGetLastError();  // no device, or not a CUDA pointer: host memory
            return;
        }
        if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged) return;  // host memory: read in place
        host.resize(static_cast<std::size_t>(p.size()));
        RPE_CUDA_CHECK(cudaMemcpyAsync(host.data(), p.data, host.size() * sizeof(float), cudaMemcpyDefault, stream));
        out.data = host.data();
    }
};

/// The cos/sin table of one side of a call (q or x, or the keys) on the device: at per-token
/// positions `host_p` (host copy, (N, A); null = the grid) or on the grid, with r.skip leading and
/// the remaining trailing tokens (r.suffix) unrotated. The fixed forms' table is the host's
/// (rope_table_of on the grid, rope_position_table at positions: the CPU's values bit for bit),
/// uploaded once per key to the device cache; rope::mixed's is computed on the device from
/// `r.freqs` (device memory) and the positions (uploaded from `host_p` into a stream-ordered
/// buffer) into stream-ordered buffers freed at scope exit.
template <class S>
class rope_call_table {
public:
    using A = acc_t<S>;
    /// @pre r checked by check_rope against (H = heads, D = d) and the grid (its positions given
    ///   as host copies, host_rope_positions); r.enabled().
    rope_call_table(const rotary_embedding<S>& r, const tensor_ref<const float>* host_p, std::int64_t heads, std::int64_t d,
                    int height, int width, cudaStream_t stream)
        : cos_(r.is_mixed() ? heads * tokens_of(host_p, height, width) * (d / 2) : 0, stream),
          sin_(r.is_mixed() ? heads * tokens_of(host_p, height, width) * (d / 2) : 0, stream),
          pos_(r.is_mixed() && host_p ? 2 * host_p->extent(0) : 0, stream) {
        const std::int64_t tokens = tokens_of(host_p, height, width), pairs = d / 2;
        if (r.is_mixed()) {
            const float* pos = nullptr;
            if (host_p) {  // pageable source: the copy is staged before cudaMemcpyAsync returns
                RPE_CUDA_CHECK(cudaMemcpyAsync(pos_.get(), host_p->data, static_cast<std::size_t>(2 * tokens) * sizeof(float),
                                               cudaMemcpyHostToDevice, stream));
                pos = pos_.get();
            }
            view_ = {cos_.get(), sin_.get(), heads, tokens, pairs, r.skip, width, r.layout, pos};
            const std::int64_t total = heads * tokens * pairs;
            rope_mixed_table_kernel<S, A><<<grid_for(total, 256), 256, 0, stream>>>(r.freqs.data, heads, tokens, pairs, width,
                                                                                    pos, cos_.get(), sin_.get());
            check_launch("rope_mixed_table_kernel");
        } else {
            rotary_embedding<A> fixed;  // the same form and skip in A (float or double): the host table's type
            fixed.form = r.form;
            fixed.skip = r.skip;
            fixed.layout = r.layout;
            if (host_p)
                table_ = cuda::device_rope_cache::global().get_at(fixed, *host_p, d, stream);
            else
                table_ = cuda::device_rope_cache::global().get(fixed, d, height, width, stream);
            view_ = table_->view(r.skip, width, r.layout);
        }
    }
    [[nodiscard]] const rope_view<A>& view() const { return view_; }

private:
    static std::int64_t tokens_of(const tensor_ref<const float>* host_p, int height, int width) {
        return host_p ? host_p->extent(0) : static_cast<std::int64_t>(height) * width;
    }
    device_buffer<A> cos_, sin_;
    device_buffer<float> pos_;
    std::shared_ptr<const cuda::device_rope_table<A>> table_;
    rope_view<A> view_{};
};

/// The positions of the queries (or x) of `r` (host copies): r.positions, or null for the grid.
template <class S>
const tensor_ref<const float>* query_positions(const rotary_embedding<S>& r) {
    return r.positions.data ? &r.positions : nullptr;
}

/// y = R x (Rᵀ x with `inverse`) for x, y (planes, L, D) on `stream`; x == y allowed.
template <class S>
void rope_rotate(const rope_view<acc_t<S>>& t, const S* x, S* y, std::int64_t planes, std::int64_t heads, std::int64_t n,
                 bool inverse, cudaStream_t stream) {
    const std::int64_t total = planes * n * t.pairs;
    rope_rotate_kernel<S, acc_t<S>><<<grid_for(total, 256), 256, 0, stream>>>(t, x, y, planes, heads, n, inverse);
    check_launch("rope_rotate_kernel");
}

/// rope::mixed's grad_freqs (2, H, D/2) (overwritten) from the angle gradients of (y0, g0) at
/// table t0 and, when y1 is given, (y1, g1) at table t1 (the keys' in the attention), y0 and g0
/// (planes, n, D), y1 and g1 (planes, n1, D): per-plane partials, then the fixed-order reduction over the batch of the table
/// gradients (reduce_partials). Deterministic.
template <class S>
void rope_frequency_grad(const rope_view<acc_t<S>>& t0, const S* y0, const S* g0, const rope_view<acc_t<S>>& t1, const S* y1,
                         const S* g1, bool rotate, std::int64_t planes, std::int64_t heads, std::int64_t n, std::int64_t n1,
                         S* grad_freqs, cudaStream_t stream) {
    using A = acc_t<S>;
    const std::int64_t pairs = t0.pairs;
    device_buffer<A> part(2 * planes * pairs, stream);  // (2, planes, D/2)
    rope_angle_partials_kernel<S, A>
        <<<grid_for(planes * pairs, 128), 128, 0, stream>>>(t0, y0, g0, t1, y1, g1, rotate, planes, heads, n, n1, part.get());
    check_launch("rope_angle_partials_kernel");
    for (int axis = 0; axis < 2; ++axis)  // out[axis, h, j] = Σ_b part[axis, b·H + h, j]
        reduce_partials(static_cast<const A*>(part.get() + axis * planes * pairs), planes, heads, heads, 1, pairs, false,
                        grad_freqs + axis * heads * pairs, stream);
}

}  // namespace rpe::detail::gpu

namespace rpe::cuda {

/// @brief Rotates a q or k tensor by a 2D rotary position embedding on the GPU: `y = R x`, token
/// by token, as rpe::rope_forward (see rpe::rotary_embedding; the `r.skip` leading and `r.queries_suffix()`
/// trailing tokens are copied).
/// @param r the embedding (form, skip, suffix, layout; for rope::mixed freqs (2, H, D/2) in device
///   memory; optional per-token positions (N, A) float, N = L − skip − r.queries_suffix(), A =
///   rpe::rope_position_axes(form), in device memory (copied to the host and waited for: the
///   checks read them, and a fixed form's table at positions is rpe::rope_position_table's,
///   uploaded once per positions' values) or host memory (read in place)).
/// @param height, width the grid: L = r.skip + height·width + r.queries_suffix() (unused with r.positions).
/// @param x (B, H, L, D), device; @param y (B, H, L, D), device, written, separate from x.
/// @param stream the caller's stream; nothing waits except a fixed form's first use of a
///   (policy, D, grid, device), which uploads its table and waits for that copy.
/// @pre S float, double, __half or __nv_bfloat16 (cos, sin and products in acc_t<S>; one
///   rounding to S per output element). The fixed forms' tables are rpe::rope_table_of's
///   (float for float, __half and bf16; double for double), cached per device; rope::mixed's
///   is computed on the device at each call (angles in float32, as on the CPU, bit for bit;
///   double for double; then the device's cos and sin: within 2 ulp of the CPU's), at the grid or
///   at the positions, its frequency gradient weighing each token by its column and row or its
///   positions' x and y.
/// @throws rpe::invalid_argument `[rpe.rope] ...` with the CPU's messages (the same
///   rpe::detail::check_rope_call) before any CUDA call; rpe::cuda_error.
/// Source: rope-vit apply_rotary_emb; timm apply_rot_embed_cat (see rpe::rope).
template <class S>
void rope_forward(const rotary_embedding<S>& r_in, int height, int width, tensor_ref<const S> x, tensor_ref<S> y,
                  cudaStream_t stream = nullptr) {
    const detail::gpu::host_rope_positions<S> hp(r_in, stream);  // the checks read the positions
    const rotary_embedding<S>& r = hp.r;
    const std::int64_t planes =
        detail::check_rope_call(r, height, width, x, static_cast<const tensor_ref<const S>*>(nullptr), y, "y");
    const std::int64_t heads = x.extent(1), l = x.extent(2), d = x.extent(3);
    if (!r.enabled()) {
        RPE_CUDA_CHECK(
            cudaMemcpyAsync(y.data, x.data, static_cast<std::size_t>(x.size()) * sizeof(S), cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const detail::gpu::rope_call_table<S> table(r, detail::gpu::query_positions(r), heads, d, height, width, stream);
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
void rope_backward(const rotary_embedding<S>& r_in, int height, int width, tensor_ref<const S> x, tensor_ref<const S> grad_y,
                   tensor_ref<S> grad_x, cudaStream_t stream = nullptr) {
    const detail::gpu::host_rope_positions<S> hp(r_in, stream);  // the checks read the positions
    const rotary_embedding<S>& r = hp.r;
    const std::int64_t planes = detail::check_rope_call(r, height, width, x, &grad_y, grad_x, "grad_x");
    const bool want_freqs = detail::check_rope_call_gradient(r, x, grad_y, grad_x);
    const std::int64_t heads = x.extent(1), l = x.extent(2), d = x.extent(3);
    if (!r.enabled()) {
        RPE_CUDA_CHECK(cudaMemcpyAsync(grad_x.data, grad_y.data, static_cast<std::size_t>(grad_y.size()) * sizeof(S),
                                       cudaMemcpyDeviceToDevice, stream));
        return;
    }
    const detail::gpu::rope_call_table<S> table(r, detail::gpu::query_positions(r), heads, d, height, width, stream);
    if (want_freqs)
        detail::gpu::rope_frequency_grad<S>(table.view(), x.data, grad_y.data, table.view(), nullptr, nullptr, true, planes,
                                            heads, l, 0, r.grad_freqs.data, stream);
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
