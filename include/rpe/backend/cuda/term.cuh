/// @file backend/cuda/term.cuh
/// @brief rpe::term<M, Md, Tg, S, backend::cuda>: one RPE term on the GPU, forward and backward,
/// on device buffers, on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../bucket_ids.hpp"
#include "../../concepts.hpp"
#include "../../detail/check.hpp"
#include "../../detail/term_checks.hpp"
#include "../../error.hpp"
#include "../../mode.hpp"
#include "../../tensor.hpp"
#include "../../term_desc.hpp"
#include "../../term_fwd.hpp"
#include "../tags.hpp"
#include "bucket_ids.cuh"
#include "error.cuh"
#include "kernels.cuh"
#include "types.cuh"

namespace rpe::detail::gpu {

// The device ids that one term call reads, alive until the call's work is enqueued: on a grid the
// grid's per-offset ids (device id cache); at per-token positions (bucket_ids::at_positions()) the
// per-offset ids of the positions' bounding box (cached per box, as a grid's) and each grid
// token's linear position in it (queries, and keys when they have their own), uploaded per call
// into stream-ordered buffers (8 bytes per token and side; freed after the call's work on its
// stream). visit() gives the kernels' device_id_view: id(i, j) = detail::position_id at positions,
// the same ids as the host's bucket_ids::at.
class term_device_ids {
public:
    term_device_ids(const rpe::bucket_ids& host, cudaStream_t stream)
        : dev_(cuda::device_bucket_cache::global().get(host.at_positions() ? *host.box() : host, stream)), grid_(host.grid()) {
        if (!host.at_positions()) return;
        if (host.rectangular())
            throw not_supported(message("term", "bucket ids of ", host.grid_string(),
                                        " (keys of another count than the queries, L_k != L) are not supported by the cuda "
                                        "backend; expected keys of the queries' count"));
        const id_positions hp = host.linear_positions();
        const std::int64_t count = host.length() - host.skip();
        query_ = upload(hp.query, count, stream);
        pos_.query = query_->get();
        pos_.key = pos_.query;
        if (hp.key != hp.query) {
            key_ = upload(hp.key, count, stream);
            pos_.key = key_->get();
        }
        pos_.base = hp.base;
    }
    // Calls f(device_id_view<Id>) with table `table`'s ids, id(i, j) or with `transposed` id(j, i).
    template <class F>
    decltype(auto) visit(int table, bool transposed, F&& f) const {
        if (pos_.query) return dev_->visit(table, transposed, grid_, pos_, std::forward<F>(f));
        return dev_->visit(table, transposed, std::forward<F>(f));
    }

private:
    std::shared_ptr<const cuda::device_bucket_ids> dev_;
    id_grid grid_;
    id_positions pos_{};
    std::unique_ptr<device_buffer<std::int64_t>> query_, key_;
};

// The CUDA work of a checked term forward (d: the checked sizes; ids_dev: the device ids of the
// call's host ids): writes, or with `acc` adds, the term into out. One instantiation per
// (scalar, mode, target) serves every mapping.
template <class S, bool Bias, target Tg>
void term_forward_run(const term_dims& d, const term_device_ids& ids_dev, std::span<const tensor_ref<const S>> tables,
                      tensor_ref<const S> x, tensor_ref<S> out, bool acc, cudaStream_t stream) {
    const auto* dev = &ids_dev;
    const int num_tables = static_cast<int>(tables.size());
    using A = cuda::acc_t<S>;
    const std::int64_t n = d.length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    if constexpr (Bias) {
        for (int t = 0; t < num_tables; ++t)
            dev->visit(t, Tg == target::query, [&](const auto& id) {
                detail::gpu::gather(tables[static_cast<std::size_t>(t)].data, k, true, out.extent(1), d.table_heads, 0, false, id,
                                    n, out.extent(0) * out.extent(1), acc || t > 0, out.data, stream);
            });
    } else if constexpr (Tg == target::value) {
        detail::gpu::device_buffer<A> s(planes * n * k, stream);  // (B,H,L,K) bucket sums of a
        for (int t = 0; t < num_tables; ++t) {
            dev->visit(t, false,
                       [&](const auto& id) { detail::gpu::scatter_rows(x.data, id, n, k, planes * n, s.get(), stream); });
            detail::gpu::gemm_shape g{n, dd, k, planes, n * k, k * dd, n * dd, true, d.heads, d.table_heads};
            detail::gpu::gemm<false, false, A>(g, s.get(), tables[static_cast<std::size_t>(t)].data, out.data, acc || t > 0, A(1),
                                               stream);
        }
    } else {
        detail::gpu::device_buffer<A> tk(planes * n * k, stream);  // (B,H,L,K) T = x·table
        for (int t = 0; t < num_tables; ++t) {
            detail::gpu::gemm_shape g{n, k, dd, planes, n * dd, dd * k, n * k, true, d.heads, d.table_heads};
            detail::gpu::gemm<false, false, A>(g, x.data, tables[static_cast<std::size_t>(t)].data, tk.get(), false, A(1),
                                               stream);
            dev->visit(t, Tg == target::query, [&](const auto& id) {
                detail::gpu::gather(static_cast<const A*>(tk.get()), n * k, false, d.heads, d.table_heads, k, Tg == target::query,
                                    id, n, planes, acc || t > 0, out.data, stream);
            });
        }
    }
}

// The CUDA work of a checked term backward: grad_x (when non-empty and contextual) and each
// non-null grad_tables[t], overwritten or with `acc` added to.
template <class S, bool Bias, target Tg>
void term_backward_run(const term_dims& d, const term_device_ids& ids_dev, std::span<const tensor_ref<const S>> tables,
                       tensor_ref<const S> x, tensor_ref<const S> grad_out, tensor_ref<S> grad_x,
                       std::span<const tensor_ref<S>> grad_tables, bool acc, cudaStream_t stream) {
    const auto* dev = &ids_dev;
    const int num_tables = static_cast<int>(tables.size());
    const bool want_x = !Bias && !detail::is_empty_view(grad_x);
    using A = cuda::acc_t<S>;
    const std::int64_t n = d.length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
    if constexpr (Bias) {
        const std::int64_t gplanes = grad_out.extent(0) * grad_out.extent(1);
        detail::gpu::device_buffer<A> g(gplanes * n * k, stream);  // (Bo·Ho·L, K) bucket sums per row
        for (int t = 0; t < num_tables; ++t) {
            if (!grad_tables[static_cast<std::size_t>(t)].data) continue;
            // the sum runs over every (i, j): each row of grad with its row of (possibly transposed) ids
            dev->visit(t, Tg == target::query,
                       [&](const auto& id) { detail::gpu::scatter_rows(grad_out.data, id, n, k, gplanes * n, g.get(), stream); });
            detail::gpu::reduce_partials(static_cast<const A*>(g.get()), gplanes, grad_out.extent(1), d.table_heads, n, k, acc,
                                         grad_tables[static_cast<std::size_t>(t)].data, stream);
        }
    } else if constexpr (Tg == target::value) {
        detail::gpu::device_buffer<A> w(planes * n * k, stream);  // (B,H,L,K)
        const bool any_table = [&] {
            for (int t = 0; t < num_tables; ++t)
                if (grad_tables[static_cast<std::size_t>(t)].data) return true;
            return false;
        }();
        detail::gpu::device_buffer<A> part(any_table ? planes * k * dd : 0, stream);  // (B·H, K, D)
        for (int t = 0; t < num_tables; ++t) {
            if (want_x) {  // grad_a[i, j] (+)= (grad_out·table[h']ᵀ)[i, id(i, j)]
                detail::gpu::gemm_shape g{n, k, dd, planes, n * dd, k * dd, n * k, true, d.heads, d.table_heads};
                detail::gpu::gemm<false, true, A>(g, grad_out.data, tables[static_cast<std::size_t>(t)].data, w.get(), false,
                                                  A(1), stream);
                dev->visit(t, false, [&](const auto& id) {
                    detail::gpu::gather(static_cast<const A*>(w.get()), n * k, false, d.heads, d.table_heads, k, false, id, n,
                                        planes, acc || t > 0, grad_x.data, stream);
                });
            }
            if (grad_tables[static_cast<std::size_t>(t)].data) {  // grad_table[h'] (+)= Σ Sᵀ·grad_out
                dev->visit(t, false,
                           [&](const auto& id) { detail::gpu::scatter_rows(x.data, id, n, k, planes * n, w.get(), stream); });
                detail::gpu::gemm_shape g{k, dd, n, planes, n * k, n * dd, k * dd, false, d.heads, d.table_heads};
                detail::gpu::gemm<true, false, A>(g, w.get(), grad_out.data, part.get(), false, A(1), stream);
                detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, d.heads, d.table_heads, 1, k * dd, acc,
                                             grad_tables[static_cast<std::size_t>(t)].data, stream);
            }
        }
    } else {
        detail::gpu::device_buffer<A> g(planes * n * k, stream);      // (B,H,L,K) G = bucket sums of grad
        detail::gpu::device_buffer<A> part(planes * dd * k, stream);  // (B·H, D, K)
        for (int t = 0; t < num_tables; ++t) {
            if (!want_x && !grad_tables[static_cast<std::size_t>(t)].data) continue;
            dev->visit(t, Tg == target::query, [&](const auto& id) {
                if constexpr (Tg == target::query)
                    detail::gpu::scatter_cols(grad_out.data, id, n, k, planes, g.get(), stream);
                else
                    detail::gpu::scatter_rows(grad_out.data, id, n, k, planes * n, g.get(), stream);
            });
            if (want_x) {  // grad_x (+)= G·table[h']ᵀ
                detail::gpu::gemm_shape s{n, dd, k, planes, n * k, dd * k, n * dd, true, d.heads, d.table_heads};
                detail::gpu::gemm<false, true, A>(s, g.get(), tables[static_cast<std::size_t>(t)].data, grad_x.data, acc || t > 0,
                                                  A(1), stream);
            }
            if (grad_tables[static_cast<std::size_t>(t)].data) {  // grad_table[h'] (+)= Σ xᵀ·G
                detail::gpu::gemm_shape s{dd, k, n, planes, n * dd, n * k, dd * k, false, d.heads, d.table_heads};
                detail::gpu::gemm<true, false, A>(s, x.data, g.get(), part.get(), false, A(1), stream);
                detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, d.heads, d.table_heads, 1, dd * k, acc,
                                             grad_tables[static_cast<std::size_t>(t)].data, stream);
            }
        }
    }
}

}  // namespace rpe::detail::gpu

namespace rpe {

/// @brief The CUDA backend of rpe::term (see the primary template in term.hpp for the shapes
/// table, which holds unchanged): every tensor_ref points at **device** memory of the current
/// device, row-major, same shapes and layouts as the CPU term.
///
/// S is the storage type: float, double, __half or __nv_bfloat16; products and sums run in
/// acc_t<S> (float, or double for double) and each output is rounded to S once.
/// Every call takes the caller's `cudaStream_t` (default: the legacy default stream) and only
/// enqueues work on it: nothing waits for the GPU, except a bucket-id cache miss (first use of a
/// configuration on a device), which uploads the ids and waits for that copy. Temporary
/// buffers come from the stream-ordered allocator (cudaMallocAsync).
///
/// Ids: a grid's, or at per-token positions (ids.at_positions(): bucket_ids(positions[,
/// key_positions]), rpe::build_bucket_ids(m, positions, key_positions, skip); host objects as on
/// the CPU), every mode, target and mapping alike: the device reads the per-offset ids of the
/// positions' bounding box (uploaded once per box, as a grid's) and each token's linear position
/// in it (uploaded per call, 8 bytes per token and side, no wait), id(i, j) =
/// detail::position_id, the same ids as the CPU term's (docs/positions.md).
///
/// Algorithms (paper eqs. 15–17): contextual q/k: T = x·table per bucket (batched GEMM, (B, H, L, K) in
/// acc_t), then a gather; backward: per-(b, h, i) bucket sums of grad (scatter), then
/// grad_x = G·tableᵀ and per-(b, h) partials xᵀ·G reduced in a fixed order. Value: scatter of
/// the probabilities into buckets, then S·table; backward: gather of grad_out·tableᵀ, and Sᵀ·grad_out.
/// Bias: gather from the table; backward: bucket sums reduced in a fixed order.
/// Determinism: table gradients are reduced in a fixed order; the key-target and value
/// scatters add with shared-memory atomics, so those bucket sums (and what is computed from
/// them) may differ in the last bits between runs.
///
/// Errors: the CPU term's, from the same shared checks (detail/term_checks.hpp: `[rpe.term] ...`
/// rpe::invalid_argument, checked before any launch);
/// rpe::cuda_error `[rpe.cuda] ...` when a CUDA call fails (a launch error may also surface at a
/// later call on the stream, as always with CUDA). Thread-safety: const calls may run
/// concurrently on distinct outputs.
/// Source: paper eqs. 13–17; reference `iRPE` in microsoft/Cream `iRPE/DeiT-with-iRPE/irpe.py`.
template <Mapping M, Mode Md, target Tg, class S>
requires ModeOnTarget<Md, Tg>
class term<M, Md, Tg, S, backend::cuda> {
    static_assert(cuda::DeviceScalar<S>, "rpe: the CUDA term's scalar type must be float, double, __half or __nv_bfloat16");

public:
    using mapping_type = M;
    using mode_type = Md;
    using scalar_type = S;
    using backend_type = backend::cuda;
    using accumulator_type = cuda::acc_t<S>;                          ///< float, or double for double
    static constexpr target target_kind = Tg;                         ///< query, key or value
    static constexpr int num_tables = detail::num_tables_of<M>();     ///< 1, or 2 for Cross
    static constexpr bool is_bias = std::is_same_v<Md, mode::bias>;   ///< bias mode
    using tables_type = std::array<tensor_ref<const S>, num_tables>;  ///< the lookup table(s), device memory
    using grad_tables_type = std::array<tensor_ref<S>, num_tables>;   ///< their gradients, device memory

    /// @brief Configures the term by name, as the CPU term:
    /// `term(mapping, {.num_heads = 6, .head_dim = 64, .shared_head = true, .skip = 1})`.
    /// @throws rpe::invalid_argument `[rpe.term] ...` as the CPU term.
    term(M mapping, const term_config& config)
        : mapping_(mapping), layout_(detail::term_layout_of(mapping_, is_bias, Tg, config)) {}

    [[nodiscard]] const M& mapping() const { return mapping_; }        ///< the mapping policy
    [[nodiscard]] int num_heads() const { return layout_.num_heads; }  ///< H
    [[nodiscard]] int head_dim() const { return layout_.head_dim; }    ///< D
    [[nodiscard]] bool shared_head() const { return layout_.shared_head; }
    [[nodiscard]] int skip() const { return layout_.skip; }                  ///< extra tokens
    [[nodiscard]] int table_heads() const { return layout_.table_heads(); }  ///< Ht
    [[nodiscard]] int num_buckets() const { return layout_.num_buckets; }    ///< K, extra bucket included
    /// @brief The configuration (heads, head dim, shared tables, skip) as a term_config.
    [[nodiscard]] term_config config() const {
        return term_config{.num_heads = layout_.num_heads,
                           .head_dim = layout_.head_dim,
                           .shared_head = layout_.shared_head,
                           .skip = layout_.skip};
    }
    /// @brief Shape of each lookup table: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::vector<std::int64_t> table_shape() const {
        const auto e = layout_.table_extents();
        return std::vector<std::int64_t>(e.begin(), e.begin() + layout_.table_rank());
    }
    /// @brief The run-time layout that the shared checks use.
    [[nodiscard]] const detail::term_layout& layout() const { return layout_; }
    /// @brief This term as a backend-free descriptor (for the attention slots, or
    /// rpe::cuda::term_forward), its ids from `cache` (bucket_cache::global() when null).
    [[nodiscard]] term_desc desc(bucket_cache* cache = nullptr) const {
        return make_term_desc(mapping_, !is_bias, Tg, config(), cache);
    }

    /// @brief The shared host bucket ids of this term on a height × width grid (as the CPU term);
    /// forward/backward upload them to the device once (cuda::device_bucket_cache).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, 1, height, width, layout_.skip, id_storage::automatic);
    }
    /// @brief The shared host ids on a depth × height × width grid (depth > 1 needs a Mapping3D),
    /// as the CPU term. @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, depth, height, width, layout_.skip, id_storage::automatic);
    }
    /// @brief The host ids of this term's skip tokens followed by tokens at per-token positions
    /// ((N, 2) int32 (row, col), (N, 3) (t, row, col) for a 3D mapping; host memory, or device
    /// memory copied to the host on the legacy default stream and waited for: the ids are built on
    /// the host), as the CPU term: forward/backward upload their bounding box's per-offset ids once
    /// (cuda::device_bucket_cache) and the N linear positions per call (docs/positions.md).
    /// @throws as bucket_cache::get(m, positions, skip); rpe::cuda_error when the copy fails.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(tensor_ref<const std::int32_t> positions,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        std::vector<std::int32_t> host;
        bool copied = false;
        const auto pos = detail::gpu::host_view(positions, host, nullptr, copied);
        if (copied) RPE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        return cache.get(mapping_, pos, layout_.skip);
    }
    /// @brief As above with the keys at `key_positions` (host or device memory; queries at
    /// `positions`; another count than N gives (L, L_k) ids, which forward and backward of this
    /// backend refuse with rpe::not_supported). @throws as bucket_cache::get(m, positions,
    /// key_positions, skip); rpe::cuda_error.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(tensor_ref<const std::int32_t> positions,
                                                                    tensor_ref<const std::int32_t> key_positions,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        std::vector<std::int32_t> host, key_host;
        bool copied = false;
        const auto pos = detail::gpu::host_view(positions, host, nullptr, copied);
        const auto kpos = detail::gpu::host_view(key_positions, key_host, nullptr, copied);
        if (copied) RPE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        return cache.get(mapping_, pos, kpos, layout_.skip);
    }

    /// @brief Forward on `stream`: writes (`write::overwrite`) or adds (`write::accumulate`) the
    /// term into `out` (device memory); the mode has no default, the stream defaults to the legacy one.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers;
    ///   rpe::cuda_error when a CUDA call fails.
    void forward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x, tensor_ref<S> out, write mode,
                 cudaStream_t stream = nullptr) const {
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping());
        const auto d = detail::check_term_forward<S>(layout_, key, ids, std::span<const tensor_ref<const S>>(tables), x, out);
        const detail::gpu::term_device_ids dev(ids, stream);
        detail::gpu::term_forward_run<S, is_bias, Tg>(d, dev, std::span<const tensor_ref<const S>>(tables), x, out,
                                                      mode == write::accumulate, stream);
    }

    /// @brief Single-table convenience overload of forward.
    void forward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x, tensor_ref<S> out, write mode,
                 cudaStream_t stream = nullptr) const requires(num_tables == 1) {
        forward(ids, tables_type{table}, x, out, mode, stream);
    }

    /// @brief Backward of `sum(out · grad_out)` on `stream`, as the CPU term: `grad_x` (pass `{}`
    /// to skip, and in bias mode) and `grad_tables` (`{}` entries skip), device memory.
    /// @throws rpe::invalid_argument `[rpe.term] ...`; rpe::cuda_error when a CUDA call fails.
    void backward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x, tensor_ref<const S> grad_out,
                  tensor_ref<S> grad_x, const grad_tables_type& grad_tables, write mode, cudaStream_t stream = nullptr) const {
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping());
        const auto d = detail::check_term_backward<S>(layout_, key, ids, std::span<const tensor_ref<const S>>(tables), x,
                                                      grad_out, grad_x, std::span<const tensor_ref<S>>(grad_tables));
        const detail::gpu::term_device_ids dev(ids, stream);
        detail::gpu::term_backward_run<S, is_bias, Tg>(d, dev, std::span<const tensor_ref<const S>>(tables), x, grad_out, grad_x,
                                                       std::span<const tensor_ref<S>>(grad_tables), mode == write::accumulate,
                                                       stream);
    }

    /// @brief Single-table convenience overload of backward.
    void backward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x, tensor_ref<const S> grad_out,
                  tensor_ref<S> grad_x, tensor_ref<S> grad_table, write mode, cudaStream_t stream = nullptr) const
        requires(num_tables == 1) {
        backward(ids, tables_type{table}, x, grad_out, grad_x, grad_tables_type{grad_table}, mode, stream);
    }

private:
    M mapping_;
    detail::term_layout layout_;
};

namespace cuda {

/// @brief Forward of term `desc` on the GPU on `stream`, as rpe::cpu::term_forward: writes
/// (`write::overwrite`) or adds (`write::accumulate`) the term into `out`. Tables, x and out are
/// device memory of storage type S (float, double, __half, __nv_bfloat16), shapes as rpe::term.
/// @throws rpe::invalid_argument `[rpe.term] ...` (the shared checks, before any launch);
///   rpe::cuda_error when a CUDA call fails.
template <class S>
void term_forward(const term_desc& desc, const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables,
                  tensor_ref<const S> x, tensor_ref<S> out, write mode, cudaStream_t stream = nullptr) {
    static_assert(DeviceScalar<S>, "rpe: the CUDA term's scalar type must be float, double, __half or __nv_bfloat16");
    detail::check_write_mode(mode);
    const auto d = detail::check_term_forward<S>(desc.layout(), desc.key(), ids, tables, x, out);
    const detail::gpu::term_device_ids dev(ids, stream);
    detail::visit_mode_target(desc.layout(), [&]<bool Bias, target Tg>() {
        detail::gpu::term_forward_run<S, Bias, Tg>(d, dev, tables, x, out, mode == write::accumulate, stream);
    });
}

/// @brief Backward of term_forward for `sum(out · grad_out)` on the GPU, as
/// rpe::cpu::term_backward: `grad_x` (`{}` to skip; `{}` in bias mode) and each non-empty
/// `grad_tables[t]`, overwritten or added to (`mode`). @throws as term_forward.
template <class S>
void term_backward(const term_desc& desc, const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables,
                   tensor_ref<const S> x, tensor_ref<const S> grad_out, tensor_ref<S> grad_x,
                   std::span<const tensor_ref<S>> grad_tables, write mode, cudaStream_t stream = nullptr) {
    static_assert(DeviceScalar<S>, "rpe: the CUDA term's scalar type must be float, double, __half or __nv_bfloat16");
    detail::check_write_mode(mode);
    const auto d = detail::check_term_backward<S>(desc.layout(), desc.key(), ids, tables, x, grad_out, grad_x, grad_tables);
    const detail::gpu::term_device_ids dev(ids, stream);
    detail::visit_mode_target(desc.layout(), [&]<bool Bias, target Tg>() {
        detail::gpu::term_backward_run<S, Bias, Tg>(d, dev, tables, x, grad_out, grad_x, grad_tables, mode == write::accumulate,
                                                    stream);
    });
}

}  // namespace cuda

}  // namespace rpe
