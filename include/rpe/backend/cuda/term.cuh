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
#include <vector>

#include "../../bucket_id_set.hpp"
#include "../../concepts.hpp"
#include "../../detail/check.hpp"
#include "../../detail/term_checks.hpp"
#include "../../error.hpp"
#include "../../mode.hpp"
#include "../../tensor.hpp"
#include "../../term.hpp"
#include "../tags.hpp"
#include "bucket_ids.cuh"
#include "error.cuh"
#include "kernels.cuh"
#include "types.cuh"

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
    using accumulator_type = cuda::acc_t<S>;                         ///< float, or double for double
    static constexpr target target_kind = Tg;                       ///< query, key or value
    static constexpr int num_tables = detail::num_tables_of<M>();   ///< 1, or 2 for Cross
    static constexpr bool is_bias = std::is_same_v<Md, mode::bias>; ///< bias mode
    using tables_type = std::array<tensor_ref<const S>, num_tables>;  ///< the lookup table(s), device memory
    using grad_tables_type = std::array<tensor_ref<S>, num_tables>;   ///< their gradients, device memory

    /// @brief Configures the term by name, as the CPU term:
    /// `term(mapping, {.num_heads = 6, .head_dim = 64, .shared_head = true, .skip = 1})`.
    /// @throws rpe::invalid_argument `[rpe.term] ...` as the CPU term.
    term(M mapping, const term_config& config) : config_(mapping, config) {}

    [[nodiscard]] const M& mapping() const { return config_.mapping(); }  ///< the mapping policy
    [[nodiscard]] int num_heads() const { return config_.num_heads(); }   ///< H
    [[nodiscard]] int head_dim() const { return config_.head_dim(); }     ///< D
    [[nodiscard]] bool shared_head() const { return config_.shared_head(); }
    [[nodiscard]] int skip() const { return config_.skip(); }             ///< extra tokens
    [[nodiscard]] int table_heads() const { return config_.table_heads(); }  ///< Ht
    [[nodiscard]] int num_buckets() const { return config_.num_buckets(); }  ///< K, extra bucket included
    /// @brief Shape of each lookup table: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::vector<std::int64_t> table_shape() const { return config_.table_shape(); }

    /// @brief The shared host bucket ids of this term on a height × width grid (as the CPU term);
    /// forward/backward upload them to the device once (cuda::device_bucket_cache).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return config_.bucket_ids(height, width, cache);
    }

    /// @brief Forward on `stream`: writes (`write::overwrite`) or adds (`write::accumulate`) the
    /// term into `out` (device memory); the mode has no default, the stream defaults to the legacy one.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers;
    ///   rpe::cuda_error when a CUDA call fails.
    void forward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x, tensor_ref<S> out,
                 write mode, cudaStream_t stream = nullptr) const {
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping());
        const auto d = detail::check_term_forward<S>(config_.layout(), key, ids, std::span<const tensor_ref<const S>>(tables), x, out);
        const auto dev = cuda::device_bucket_cache::global().get(ids, stream);
        using A = accumulator_type;
        const bool acc = mode == write::accumulate;
        const std::int64_t n = d.length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
        if constexpr (is_bias) {
            for (int t = 0; t < num_tables; ++t)
                dev->visit(t, Tg == target::query, [&](const auto& id) {
                    detail::gpu::gather(tables[t].data, k, true, out.extent(1), d.table_heads, 0, false, id, n,
                                        out.extent(0) * out.extent(1), acc || t > 0, out.data, stream);
                });
        } else if constexpr (Tg == target::value) {
            detail::gpu::device_buffer<A> s(planes * n * k, stream);  // (B,H,L,K) bucket sums of a
            for (int t = 0; t < num_tables; ++t) {
                dev->visit(t, false, [&](const auto& id) { detail::gpu::scatter_rows(x.data, id, n, k, planes * n, s.get(), stream); });
                detail::gpu::gemm_shape g{n, dd, k, planes, n * k, k * dd, n * dd, true, d.heads, d.table_heads};
                detail::gpu::gemm<false, false, A>(g, s.get(), tables[t].data, out.data, acc || t > 0, A(1), stream);
            }
        } else {
            detail::gpu::device_buffer<A> tk(planes * n * k, stream);  // (B,H,L,K) T = x·table
            for (int t = 0; t < num_tables; ++t) {
                detail::gpu::gemm_shape g{n, k, dd, planes, n * dd, dd * k, n * k, true, d.heads, d.table_heads};
                detail::gpu::gemm<false, false, A>(g, x.data, tables[t].data, tk.get(), false, A(1), stream);
                dev->visit(t, Tg == target::query, [&](const auto& id) {
                    detail::gpu::gather(static_cast<const A*>(tk.get()), n * k, false, d.heads, d.table_heads, k,
                                        Tg == target::query, id, n, planes, acc || t > 0, out.data, stream);
                });
            }
        }
    }

    /// @brief Single-table convenience overload of forward.
    void forward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x, tensor_ref<S> out,
                 write mode, cudaStream_t stream = nullptr) const
        requires(num_tables == 1)
    {
        forward(ids, tables_type{table}, x, out, mode, stream);
    }

    /// @brief Backward of `sum(out · grad_out)` on `stream`, as the CPU term: `grad_x` (pass `{}`
    /// to skip, and in bias mode) and `grad_tables` (`{}` entries skip), device memory.
    /// @throws rpe::invalid_argument `[rpe.term] ...`; rpe::cuda_error when a CUDA call fails.
    void backward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, const grad_tables_type& grad_tables,
                  write mode, cudaStream_t stream = nullptr) const {
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping());
        const auto d = detail::check_term_backward<S>(config_.layout(), key, ids, std::span<const tensor_ref<const S>>(tables),
                                                      x, grad_out, grad_x, std::span<const tensor_ref<S>>(grad_tables));
        const bool want_x = !is_bias && !detail::is_empty_view(grad_x);
        const auto dev = cuda::device_bucket_cache::global().get(ids, stream);
        using A = accumulator_type;
        const bool acc = mode == write::accumulate;
        const std::int64_t n = d.length, k = d.buckets, dd = d.dim, planes = d.batch * d.heads;
        if constexpr (is_bias) {
            const std::int64_t gplanes = grad_out.extent(0) * grad_out.extent(1);
            detail::gpu::device_buffer<A> g(gplanes * n * k, stream);  // (Bo·Ho·L, K) bucket sums per row
            for (int t = 0; t < num_tables; ++t) {
                if (!grad_tables[t].data) continue;
                // the sum runs over every (i, j): each row of grad with its row of (possibly transposed) ids
                dev->visit(t, Tg == target::query, [&](const auto& id) {
                    detail::gpu::scatter_rows(grad_out.data, id, n, k, gplanes * n, g.get(), stream);
                });
                detail::gpu::reduce_partials(static_cast<const A*>(g.get()), gplanes, grad_out.extent(1), d.table_heads, n, k,
                                             acc, grad_tables[t].data, stream);
            }
        } else if constexpr (Tg == target::value) {
            detail::gpu::device_buffer<A> w(planes * n * k, stream);  // (B,H,L,K)
            const bool any_table = [&] {
                for (int t = 0; t < num_tables; ++t)
                    if (grad_tables[t].data) return true;
                return false;
            }();
            detail::gpu::device_buffer<A> part(any_table ? planes * k * dd : 0, stream);  // (B·H, K, D)
            for (int t = 0; t < num_tables; ++t) {
                if (want_x) {  // grad_a[i, j] (+)= (grad_out·table[h']ᵀ)[i, id(i, j)]
                    detail::gpu::gemm_shape g{n, k, dd, planes, n * dd, k * dd, n * k, true, d.heads, d.table_heads};
                    detail::gpu::gemm<false, true, A>(g, grad_out.data, tables[t].data, w.get(), false, A(1), stream);
                    dev->visit(t, false, [&](const auto& id) {
                        detail::gpu::gather(static_cast<const A*>(w.get()), n * k, false, d.heads, d.table_heads, k, false, id, n,
                                            planes, acc || t > 0, grad_x.data, stream);
                    });
                }
                if (grad_tables[t].data) {  // grad_table[h'] (+)= Σ Sᵀ·grad_out
                    dev->visit(t, false, [&](const auto& id) { detail::gpu::scatter_rows(x.data, id, n, k, planes * n, w.get(), stream); });
                    detail::gpu::gemm_shape g{k, dd, n, planes, n * k, n * dd, k * dd, false, d.heads, d.table_heads};
                    detail::gpu::gemm<true, false, A>(g, w.get(), grad_out.data, part.get(), false, A(1), stream);
                    detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, d.heads, d.table_heads, 1, k * dd,
                                                 acc, grad_tables[t].data, stream);
                }
            }
        } else {
            detail::gpu::device_buffer<A> g(planes * n * k, stream);  // (B,H,L,K) G = bucket sums of grad
            detail::gpu::device_buffer<A> part(planes * dd * k, stream);  // (B·H, D, K)
            for (int t = 0; t < num_tables; ++t) {
                if (!want_x && !grad_tables[t].data) continue;
                dev->visit(t, Tg == target::query, [&](const auto& id) {
                    if constexpr (Tg == target::query)
                        detail::gpu::scatter_cols(grad_out.data, id, n, k, planes, g.get(), stream);
                    else
                        detail::gpu::scatter_rows(grad_out.data, id, n, k, planes * n, g.get(), stream);
                });
                if (want_x) {  // grad_x (+)= G·table[h']ᵀ
                    detail::gpu::gemm_shape s{n, dd, k, planes, n * k, dd * k, n * dd, true, d.heads, d.table_heads};
                    detail::gpu::gemm<false, true, A>(s, g.get(), tables[t].data, grad_x.data, acc || t > 0, A(1), stream);
                }
                if (grad_tables[t].data) {  // grad_table[h'] (+)= Σ xᵀ·G
                    detail::gpu::gemm_shape s{dd, k, n, planes, n * dd, n * k, dd * k, false, d.heads, d.table_heads};
                    detail::gpu::gemm<true, false, A>(s, x.data, g.get(), part.get(), false, A(1), stream);
                    detail::gpu::reduce_partials(static_cast<const A*>(part.get()), planes, d.heads, d.table_heads, 1, dd * k,
                                                 acc, grad_tables[t].data, stream);
                }
            }
        }
    }

    /// @brief Single-table convenience overload of backward.
    void backward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, tensor_ref<S> grad_table,
                  write mode, cudaStream_t stream = nullptr) const
        requires(num_tables == 1)
    {
        backward(ids, tables_type{table}, x, grad_out, grad_x, grad_tables_type{grad_table}, mode, stream);
    }

private:
    // The configuration (constructor checks, ids, shapes) is the CPU term's: one source of truth.
    term<M, Md, Tg, float, backend::cpu> config_;
};

}  // namespace rpe
