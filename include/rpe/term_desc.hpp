/// @file term_desc.hpp
/// @brief rpe::term_desc: what a term is (mapping key, layout, id source with its cache) as one
/// backend-free run-time value, which every backend's term and attention functions take
/// (rpe::cpu::term_forward, rpe::cuda::term_forward, the attention_term slots); and
/// rpe::make_term_desc, which builds one from any mapping policy. No Eigen, no CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "bucket_cache.hpp"
#include "bucket_ids.hpp"
#include "bucket_key.hpp"
#include "concepts.hpp"
#include "detail/term_checks.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "tensor.hpp"
#include "term_fwd.hpp"

namespace rpe {

namespace detail {

/// @brief Where a run-time term's bucket ids come from: one mapping value, type-erased, and the
/// cache its ids are shared through. The only part of a run-time term that depends on the
/// mapping type.
class id_source {
public:
    virtual ~id_source() = default;
    /// @brief The mapping's key (ids handed to forward/backward must hold it).
    [[nodiscard]] virtual const mapping_key_base& key() const = 0;
    /// @brief The mapping's num_buckets(), without the skip bucket.
    [[nodiscard]] virtual std::int64_t mapping_buckets() const = 0;
    /// @brief The mapping's extra buckets with skip tokens (detail::skip_buckets_of: 1 or 3).
    [[nodiscard]] virtual int skip_buckets() const = 0;
    /// @brief The shared ids on a depth × height × width grid. @throws as bucket_cache::get.
    [[nodiscard]] virtual std::shared_ptr<const bucket_ids> get(int depth, int height, int width, int skip,
                                                                id_storage storage) const = 0;
    /// @brief The ids of tokens at per-token positions (key_positions empty: the queries'), the
    /// bounding box's per-offset ids shared through the cache. @throws as bucket_cache::get.
    [[nodiscard]] virtual std::shared_ptr<const bucket_ids> get(tensor_ref<const std::int32_t> positions,
                                                                tensor_ref<const std::int32_t> key_positions, int skip) const = 0;
    /// @brief Coordinates per position: 2 (row, col), or 3 (t, row, col) for a 3D mapping.
    [[nodiscard]] virtual int position_axes() const = 0;
};

/// @brief The id source of one mapping value M; its ids come from `cache` (the process-wide
/// bucket_cache::global() when null; a given cache must outlive the source).
template <GridMapping M>
class id_source_for final : public id_source {
public:
    explicit id_source_for(const M& m, bucket_cache* cache = nullptr) : key_(m), cache_(cache) { validate_policy(m); }
    [[nodiscard]] const mapping_key_base& key() const override { return key_; }
    [[nodiscard]] std::int64_t mapping_buckets() const override { return key_.mapping.num_buckets(); }
    [[nodiscard]] int skip_buckets() const override { return skip_buckets_of<M>(); }
    [[nodiscard]] std::shared_ptr<const bucket_ids> get(int depth, int height, int width, int skip,
                                                        id_storage storage) const override {
        bucket_cache& c = cache_ ? *cache_ : bucket_cache::global();
        return c.get(key_.mapping, depth, height, width, skip, storage);
    }
    [[nodiscard]] std::shared_ptr<const bucket_ids> get(tensor_ref<const std::int32_t> positions,
                                                        tensor_ref<const std::int32_t> key_positions, int skip) const override {
        bucket_cache& c = cache_ ? *cache_ : bucket_cache::global();
        return c.get(key_.mapping, positions, key_positions, skip);
    }
    [[nodiscard]] int position_axes() const override { return Mapping3D<M> ? 3 : 2; }

private:
    mapping_key<M> key_;
    bucket_cache* cache_;
};

/// @brief The layout of a compile-time term of mapping `m` (rpe::term on either backend) in bias
/// (else contextual) mode on target `tg`: make_term_layout's checks of `config`, then the
/// mapping's validate() and num_buckets().
/// @throws rpe::invalid_argument as make_term_layout and the mapping's validate().
template <GridMapping M>
term_layout term_layout_of(const M& m, bool bias, target tg, const term_config& config) {
    const auto buckets = [&m] {
        validate_policy(m);
        return static_cast<std::int64_t>(m.num_buckets());
    };
    return make_term_layout(buckets, num_tables_of<M>(), config.num_heads, config.head_dim, config.shared_head, config.skip, bias,
                            tg, skip_buckets_of<M>());
}

/// @brief Calls `f.template operator()<Bias, Tg>()` with the (mode, target) of `d` as template
/// arguments (five combinations; bias mode on values does not exist and is rejected by
/// make_term_layout): the one switch from a run-time layout to the kernels of either backend.
template <class F>
decltype(auto) visit_mode_target(const term_layout& d, F&& f) {
    switch (d.target) {
        case target::query:
            return d.bias ? f.template operator()<true, target::query>() : f.template operator()<false, target::query>();
        case target::key:
            return d.bias ? f.template operator()<true, target::key>() : f.template operator()<false, target::key>();
        case target::value: break;
    }
    return f.template operator()<false, target::value>();
}

}  // namespace detail

/// @brief What a term is, as a run-time value: the mapping (type-erased: its key and where its
/// bucket ids come from, with an injectable cache), the mode (bias or contextual), the target
/// (q, k, v) and the layout (heads, head dim, shared tables, skip, buckets, tables).
///
/// Backend-free and cheap to copy (the id source is shared). Every backend runs it with the same
/// names: rpe::cpu::term_forward / term_backward (backend/cpu/term.hpp), rpe::cuda::term_forward
/// / term_backward (backend/cuda/term.cuh), and the attention slots (rpe::attention_term::term)
/// of both backends' attention. Tables stay the caller's, shaped table_shape():
/// (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) contextual v.
/// Errors: the constructor throws rpe::invalid_argument `[rpe.term] ...` for num_heads < 1,
/// head_dim < 1, skip < 0, bias mode on values, or a bucket count outside [1, 2^31 − 1).
class term_desc {
public:
    /// @brief A term of `ids`' mapping with `num_tables` tables (1, or 2 for Cross), in
    /// `contextual` (else bias) mode on target `tg`, configured by `config`.
    /// @throws rpe::invalid_argument `[rpe.term] ...` (see the class comment) or when ids is null.
    term_desc(std::shared_ptr<const detail::id_source> ids, int num_tables, bool contextual, target tg, const term_config& config)
        : ids_(std::move(ids)),
          layout_(detail::make_term_layout(
              [this] {
                  detail::require(ids_ != nullptr, "term", "id source is null; expected a mapping's id source");
                  return ids_->mapping_buckets();
              },
              num_tables, config.num_heads, config.head_dim, config.shared_head, config.skip, !contextual, tg,
              ids_ ? ids_->skip_buckets() : 1)) {}

    [[nodiscard]] int num_tables() const { return layout_.num_tables; }      ///< 1, or 2 for Cross
    [[nodiscard]] int num_buckets() const { return layout_.num_buckets; }    ///< K with the extra bucket
    [[nodiscard]] int num_heads() const { return layout_.num_heads; }        ///< H
    [[nodiscard]] int head_dim() const { return layout_.head_dim; }          ///< D
    [[nodiscard]] int skip() const { return layout_.skip; }                  ///< extra tokens
    [[nodiscard]] bool shared_head() const { return layout_.shared_head; }   ///< one table for all heads
    [[nodiscard]] int table_heads() const { return layout_.table_heads(); }  ///< Ht
    [[nodiscard]] bool contextual() const { return !layout_.bias; }          ///< mode
    [[nodiscard]] rpe::target target() const { return layout_.target; }      ///< q, k or v
    /// @brief The configuration (heads, head dim, shared tables, skip) as a term_config.
    [[nodiscard]] term_config config() const {
        return term_config{.num_heads = layout_.num_heads,
                           .head_dim = layout_.head_dim,
                           .shared_head = layout_.shared_head,
                           .skip = layout_.skip};
    }
    /// @brief Each table's shape: (Ht, K) bias; (Ht, D, K) contextual q/k; (Ht, K, D) v.
    [[nodiscard]] std::vector<std::int64_t> table_shape() const {
        const auto e = layout_.table_extents();
        return std::vector<std::int64_t>(e.begin(), e.begin() + layout_.table_rank());
    }
    /// @brief The run-time layout the shared checks use.
    [[nodiscard]] const detail::term_layout& layout() const { return layout_; }
    /// @brief The mapping's key: bucket ids handed to a backend must have been built for it.
    [[nodiscard]] const detail::mapping_key_base& key() const { return ids_->key(); }

    /// @brief The shared bucket ids of this term on a depth × height × width grid (depth > 1
    /// needs a 3D mapping), held as `storage` says, from the id source's cache.
    /// @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width, id_storage storage) const {
        return ids_->get(depth, height, width, layout_.skip, storage);
    }
    /// @brief bucket_ids(depth, height, width, id_storage::automatic).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width) const {
        return bucket_ids(depth, height, width, id_storage::automatic);
    }
    /// @brief The shared bucket ids on a height × width grid (automatic storage).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width) const {
        return bucket_ids(1, height, width, id_storage::automatic);
    }
    /// @brief The bucket ids of this term's skip tokens followed by tokens at per-token positions:
    /// `positions` (N, position_axes()) int32, `key_positions` the keys' (any N_k ≥ 1: (L, L_k) ids) or empty for the
    /// queries'; see rpe::build_bucket_ids(m, positions, key_positions, skip). The bounding box's
    /// per-offset ids come from the id source's cache; the returned ids are not cached.
    /// @throws as bucket_cache::get(m, positions, key_positions, skip).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(tensor_ref<const std::int32_t> positions,
                                                                    tensor_ref<const std::int32_t> key_positions = {}) const {
        return ids_->get(positions, key_positions, layout_.skip);
    }
    /// @brief Coordinates per position this term takes: 2 (row, col), or 3 (t, row, col) for a 3D mapping.
    [[nodiscard]] int position_axes() const { return ids_->position_axes(); }

private:
    std::shared_ptr<const detail::id_source> ids_;
    detail::term_layout layout_;
};

/// @brief The descriptor of mapping `m` in `contextual` (else bias) mode on target `tg`,
/// configured by `config`, its bucket ids shared through `cache` (bucket_cache::global() when
/// null; a given cache must outlive the descriptor and its copies):
/// `rpe::make_term_desc(mapping, true, rpe::target::key, {.num_heads = 6, .head_dim = 64})`.
/// @throws rpe::invalid_argument for invalid mapping parameters, or as term_desc's constructor.
template <GridMapping M>
term_desc make_term_desc(const M& m, bool contextual, target tg, const term_config& config, bucket_cache* cache = nullptr) {
    return term_desc(std::make_shared<detail::id_source_for<M>>(m, cache), detail::num_tables_of<M>(), contextual, tg, config);
}

}  // namespace rpe
