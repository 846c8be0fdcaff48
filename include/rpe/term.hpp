/// @file term.hpp
/// @brief rpe::term: one RPE term (mapping × mode × target) with forward and backward.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/isa.hpp"
#include "backend/cpu/term.hpp"
#include "backend/tags.hpp"
#include "bf16.hpp"
#include "f16.hpp"
#include "bucket_cache.hpp"
#include "bucket_ids.hpp"
#include "concepts.hpp"
#include "detail/check.hpp"
#include "detail/term_checks.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "tensor.hpp"
#include "term_desc.hpp"
#include "term_fwd.hpp"

namespace rpe {

/// @brief One iRPE term: a mapping M (with its index function), a mode, a target, a scalar type
/// and a backend, composed at compile time.
///
/// The term holds the configuration only; the lookup table(s) stay the caller's (a parameter of
/// their model) and are passed by view, as are inputs and outputs. Shapes (B batch, H heads,
/// L = skip + height·width tokens, D head dim, K = num_buckets() with the extra bucket,
/// Ht = table_heads() = 1 when shared else H):
///
/// | mode, target        | table        | x            | out          |
/// |---------------------|--------------|--------------|--------------|
/// | bias, key / query   | (Ht, K)      | unused ({})  | (Bo, Ho, L, L), Bo ≥ 1, Ho ∈ {Ht, H}: broadcast |
/// | contextual, key     | (Ht, D, K)   | (B, H, L, D) = q·s | (B, H, L, L) |
/// | contextual, query   | (Ht, D, K)   | (B, H, L, D) = k·s | (B, H, L, L) |
/// | contextual, value   | (Ht, K, D)   | (B, H, L, L) = a   | (B, H, L, D) |
///
/// Cross has two tables (rows, cols) and two id matrices; the term is their sum.
///
/// Errors: the constructor throws rpe::invalid_argument `[rpe.term] ...` for num_heads < 1,
/// head_dim < 1, skip < 0 or invalid mapping parameters; forward/backward throw
/// rpe::invalid_argument for ids built for another configuration (mapping, skip), a shape that
/// does not match, a null or overlapping buffer. Exception guarantee: every check runs before
/// anything is written, so a call that throws leaves the outputs untouched.
/// Thread-safety: const member functions may run concurrently on distinct outputs.
/// Scalar S: float, double, rpe::bf16 or rpe::f16. bf16 is storage only: forward and backward convert the
/// tables, x, grad_out (and, with write::accumulate, the outputs) to float once per call, run the
/// float kernels (every sum in float) and round each output to bf16 once (docs/attention.md, "bf16").
/// rpe::f16 (IEEE binary16) likewise, each output rounded to f16 once (docs/attention.md, "f16").
/// Source: paper eqs. 13–17; reference `iRPE` module and `build_rpe` in microsoft/Cream
/// `iRPE/DeiT-with-iRPE/irpe.py`.
template <GridMapping M, Mode Md, target Tg, class S, Backend B>
requires ModeOnTarget<Md, Tg>  // bias mode on values does not exist
class term {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double> || std::is_same_v<S, bf16> || std::is_same_v<S, f16>,
                  "rpe: the scalar type must be float, double, rpe::bf16 or rpe::f16");
    static_assert(std::is_same_v<B, backend::cpu>,
                  "rpe: this header provides the CPU backend; include <rpe/cuda.cuh> and compile with nvcc for backend::cuda");

public:
    using mapping_type = M;
    using mode_type = Md;
    using scalar_type = S;
    using backend_type = B;
    static constexpr target target_kind = Tg;                         ///< query, key or value
    static constexpr int num_tables = detail::num_tables_of<M>();     ///< 1, or 2 for Cross
    static constexpr bool is_bias = std::is_same_v<Md, mode::bias>;   ///< bias mode
    using tables_type = std::array<tensor_ref<const S>, num_tables>;  ///< the lookup table(s)
    using grad_tables_type = std::array<tensor_ref<S>, num_tables>;   ///< their gradients

    /// @brief Configures the term by name:
    /// `term(mapping, {.num_heads = 6, .head_dim = 64, .shared_head = true, .skip = 1})`.
    /// @throws rpe::invalid_argument `[rpe.term] num_heads = ...` (see the class comment).
    term(M mapping, const term_config& config)
        : mapping_(mapping), layout_(detail::term_layout_of(mapping_, is_bias, Tg, config)) {}
    /// @brief The configuration (heads, head dim, shared tables, skip) as a term_config.
    [[nodiscard]] term_config config() const {
        return term_config{.num_heads = layout_.num_heads,
                           .head_dim = layout_.head_dim,
                           .shared_head = layout_.shared_head,
                           .skip = layout_.skip};
    }

    [[nodiscard]] const M& mapping() const { return mapping_; }        ///< the mapping policy
    [[nodiscard]] int num_heads() const { return layout_.num_heads; }  ///< H
    [[nodiscard]] int head_dim() const { return layout_.head_dim; }    ///< D
    [[nodiscard]] bool shared_head() const { return layout_.shared_head; }
    [[nodiscard]] int skip() const { return layout_.skip; }                  ///< extra tokens before the grid
    [[nodiscard]] int table_heads() const { return layout_.table_heads(); }  ///< Ht
    /// @brief K: buckets per table, the extra skip bucket included (reference `num_buckets`).
    [[nodiscard]] int num_buckets() const { return layout_.num_buckets; }
    /// @brief Shape of each lookup table: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::vector<std::int64_t> table_shape() const {
        const auto e = layout_.table_extents();
        return std::vector<std::int64_t>(e.begin(), e.begin() + layout_.table_rank());
    }
    /// @brief The run-time layout that the shared checks use (heads, head dim, K, skip, mode, target).
    [[nodiscard]] const detail::term_layout& layout() const { return layout_; }
    /// @brief This term as a backend-free descriptor (for the attention slots of either backend,
    /// or rpe::cpu::term_forward), its ids from `cache` (bucket_cache::global() when null).
    [[nodiscard]] term_desc desc(bucket_cache* cache = nullptr) const {
        return make_term_desc(mapping_, !is_bias, Tg, config(), cache);
    }

    /// @brief The shared bucket ids of this term's mapping and skip on a height × width grid.
    /// @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, 1, height, width, layout_.skip, id_storage::automatic);
    }
    /// @brief The shared bucket ids on a depth × height × width grid (depth > 1 needs a Mapping3D).
    /// @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, depth, height, width, layout_.skip, id_storage::automatic);
    }
    /// @brief As above, held as `storage` says (on_the_fly: no (L, L) table, for large grids).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width, id_storage storage,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, depth, height, width, layout_.skip, storage);
    }

    /// @brief The bucket ids of this term's skip tokens followed by tokens at per-token positions
    /// (N, 2) int32 (row, col) — (N, 3) (t, row, col) for a 3D mapping —, any order; the bounding
    /// box's per-offset ids shared through `cache`, the returned ids not cached (see
    /// rpe::build_bucket_ids(m, positions, skip)). Use them with forward/backward like a grid's.
    /// @throws as bucket_cache::get(m, positions, skip).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(tensor_ref<const std::int32_t> positions,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, positions, layout_.skip);
    }
    /// @brief As above with the keys at `key_positions` (N_k ≥ 1 of them: (L, L_k) ids when N_k ≠ N; queries at `positions`).
    /// @throws as bucket_cache::get(m, positions, key_positions, skip).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(tensor_ref<const std::int32_t> positions,
                                                                    tensor_ref<const std::int32_t> key_positions,
                                                                    bucket_cache& cache = bucket_cache::global()) const {
        return cache.get(mapping_, positions, key_positions, layout_.skip);
    }

    /// @brief Forward: writes (`write::overwrite`) or adds (`write::accumulate`, to sum terms into
    /// logits) the term into `out`; the mode has no default. See the class comment for shapes.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers.
    RPE_ISA_TAG void forward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x, tensor_ref<S> out,
                             write mode) const {
        const std::span<const tensor_ref<const S>> ts(tables);
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping_);
        const auto d = detail::check_term_forward<S>(layout_, key, ids, ts, x, out);
        detail::cpu::term_forward<S, is_bias, Tg>(d, ids, ts, x.data, out, mode == write::accumulate);
    }

    /// @brief Single-table convenience overload of forward.
    RPE_ISA_TAG void forward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x, tensor_ref<S> out,
                             write mode) const requires(num_tables == 1) {
        forward(ids, tables_type{table}, x, out, mode);
    }

    /// @brief Backward of `sum(out · grad_out)`: gradient for the input x (`grad_x`, shape of x;
    /// pass `{}` to skip it, and for bias mode) and for each table (`grad_tables`, shapes of the
    /// tables; pass `{}` entries to skip). A shared table collects every head and batch element.
    /// `mode` (no default): write::overwrite replaces the gradients, write::accumulate adds to them.
    /// @throws rpe::invalid_argument `[rpe.term] ...` for mismatched ids, shapes or buffers.
    RPE_ISA_TAG void backward(const rpe::bucket_ids& ids, const tables_type& tables, tensor_ref<const S> x,
                              tensor_ref<const S> grad_out, tensor_ref<S> grad_x, const grad_tables_type& grad_tables,
                              write mode) const {
        const std::span<const tensor_ref<const S>> ts(tables);
        const std::span<const tensor_ref<S>> gts(grad_tables);
        detail::check_write_mode(mode);
        const detail::mapping_key<M> key(mapping_);
        const auto d = detail::check_term_backward<S>(layout_, key, ids, ts, x, grad_out, grad_x, gts);
        detail::cpu::term_backward<S, is_bias, Tg>(d, ids, ts, x.data, grad_out, is_bias ? nullptr : grad_x.data, gts,
                                                   mode == write::accumulate);
    }

    /// @brief Single-table convenience overload of backward.
    RPE_ISA_TAG void backward(const rpe::bucket_ids& ids, tensor_ref<const S> table, tensor_ref<const S> x,
                              tensor_ref<const S> grad_out, tensor_ref<S> grad_x, tensor_ref<S> grad_table, write mode) const
        requires(num_tables == 1) {
        backward(ids, tables_type{table}, x, grad_out, grad_x, grad_tables_type{grad_table}, mode);
    }

private:
    M mapping_;
    detail::term_layout layout_;
};

}  // namespace rpe
