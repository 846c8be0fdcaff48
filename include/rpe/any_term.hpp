/// @file any_term.hpp
/// @brief rpe::any_term: a term behind one run-time interface, as the attention inputs take it,
/// and rpe::make_any_term, which wraps a compile-time term (any mapping, custom ones included).
/// Terms configured by name at run time (rpe::make_term, rpe::term_spec) are in <rpe/make_term.hpp>.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cpu/isa.hpp"
#include "backend/cpu/term.hpp"
#include "bucket_cache.hpp"
#include "bucket_id_set.hpp"
#include "concepts.hpp"
#include "detail/term_checks.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "tensor.hpp"
#include "term.hpp"

namespace rpe {

/// @brief A term behind one run-time interface (virtual calls per forward/backward, nothing per
/// element). Tables are passed as spans of 1 (or 2 for Cross) views. Shapes, errors and
/// guarantees are those of rpe::term (the same shared checks run).
template <class S>
class any_term {
public:
    virtual ~any_term() = default;
    [[nodiscard]] virtual int num_tables() const = 0;                       ///< 1, or 2 for Cross
    [[nodiscard]] virtual int num_buckets() const = 0;                      ///< K with the extra bucket
    [[nodiscard]] virtual int num_heads() const = 0;                        ///< H
    [[nodiscard]] virtual int head_dim() const = 0;                         ///< D
    [[nodiscard]] virtual int skip() const = 0;                             ///< extra tokens
    [[nodiscard]] virtual bool contextual() const = 0;                      ///< mode
    [[nodiscard]] virtual rpe::target target() const = 0;                   ///< q, k or v
    [[nodiscard]] virtual std::vector<std::int64_t> table_shape() const = 0;  ///< each table's shape
    /// @brief The shared bucket ids (global cache) of this term on a depth × height × width grid
    /// (depth > 1 needs a 3D mapping), held as `storage` says. @throws as bucket_cache::get.
    [[nodiscard]] virtual std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                            id_storage storage) const = 0;
    /// @brief bucket_ids(depth, height, width, id_storage::automatic).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width) const {
        return bucket_ids(depth, height, width, id_storage::automatic);
    }
    /// @brief The shared bucket ids of this term on a height × width grid (automatic storage).
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int height, int width) const {
        return bucket_ids(1, height, width, id_storage::automatic);
    }
    /// @brief rpe::term::forward (the write mode is required). @throws rpe::invalid_argument when
    /// tables.size() != num_tables().
    virtual void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                         tensor_ref<S> out, write mode) const = 0;
    /// @brief rpe::term::backward (the write mode is required). @throws rpe::invalid_argument when a
    /// span's size != num_tables().
    virtual void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                          tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                          write mode) const = 0;
};

namespace detail {

/// @brief Where a run-time term's bucket ids come from: one mapping value, type-erased. The only
/// part of a run-time term that depends on the mapping type.
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
};

template <GridMapping M>
class id_source_for final : public id_source {
public:
    explicit id_source_for(const M& m) : key_(m) { validate_policy(m); }
    [[nodiscard]] const mapping_key_base& key() const override { return key_; }
    [[nodiscard]] std::int64_t mapping_buckets() const override { return key_.mapping.num_buckets(); }
    [[nodiscard]] int skip_buckets() const override { return skip_buckets_of<M>(); }
    [[nodiscard]] std::shared_ptr<const bucket_ids> get(int depth, int height, int width, int skip,
                                                        id_storage storage) const override {
        return bucket_cache::global().get(key_.mapping, depth, height, width, skip, storage);
    }

private:
    mapping_key<M> key_;
};

inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp: the CPU drivers are ISA-dependent

/// @brief The run-time term: an id source plus the CPU drivers of one (scalar, mode, target);
/// every mapping shares these instantiations.
template <class S, bool Bias, target Tg>
class runtime_term final : public any_term<S> {
public:
    runtime_term(std::shared_ptr<const id_source> ids, int num_tables, int num_heads, int head_dim, bool shared_head, int skip)
        : ids_(std::move(ids)),
          layout_(make_term_layout([this] { return ids_->mapping_buckets(); }, num_tables, num_heads, head_dim,
                                   shared_head, skip, Bias, Tg, ids_->skip_buckets())) {}
    [[nodiscard]] int num_tables() const override { return layout_.num_tables; }
    [[nodiscard]] int num_buckets() const override { return layout_.num_buckets; }
    [[nodiscard]] int num_heads() const override { return layout_.num_heads; }
    [[nodiscard]] int head_dim() const override { return layout_.head_dim; }
    [[nodiscard]] int skip() const override { return layout_.skip; }
    [[nodiscard]] bool contextual() const override { return !Bias; }
    [[nodiscard]] rpe::target target() const override { return Tg; }
    [[nodiscard]] std::vector<std::int64_t> table_shape() const override {
        const auto e = layout_.table_extents();
        return std::vector<std::int64_t>(e.begin(), e.begin() + layout_.table_rank());
    }
    using any_term<S>::bucket_ids;
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(int depth, int height, int width,
                                                                    id_storage storage) const override {
        return ids_->get(depth, height, width, layout_.skip, storage);
    }
    void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                 tensor_ref<S> out, write mode) const override {
        check_write_mode(mode);
        const auto d = check_term_forward<S>(layout_, ids_->key(), ids, tables, x, out);
        cpu::term_forward<S, Bias, Tg>(d, ids, tables, x.data, out, mode == write::accumulate);
    }
    void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                  write mode) const override {
        check_write_mode(mode);
        const auto d = check_term_backward<S>(layout_, ids_->key(), ids, tables, x, grad_out, grad_x, grad_tables);
        cpu::term_backward<S, Bias, Tg>(d, ids, tables, x.data, grad_out, Bias ? nullptr : grad_x.data, grad_tables,
                                        mode == write::accumulate);
    }

private:
    std::shared_ptr<const id_source> ids_;
    term_layout layout_;
};

/// @brief The run-time term of (ids, mode, target): five instantiations per scalar in all.
template <class S>
std::unique_ptr<any_term<S>> make_runtime_term(std::shared_ptr<const id_source> ids, int num_tables, bool contextual,
                                               rpe::target tg, int num_heads, int head_dim, bool shared_head, int skip) {
    auto make = [&]<bool Bias, target Tg>() -> std::unique_ptr<any_term<S>> {
        return std::make_unique<runtime_term<S, Bias, Tg>>(std::move(ids), num_tables, num_heads, head_dim, shared_head, skip);
    };
    switch (tg) {
        case target::query: return contextual ? make.template operator()<false, target::query>() : make.template operator()<true, target::query>();
        case target::key: return contextual ? make.template operator()<false, target::key>() : make.template operator()<true, target::key>();
        case target::value:
            if (contextual) return make.template operator()<false, target::value>();
            throw invalid_argument(message("term_spec", "mode = bias with target = v: bias mode on values does not exist "
                                                        "(paper eq. 17; the reference raises NotImplementedError)"));
    }
    throw invalid_argument(message("term_spec", "target = ", static_cast<int>(tg), "; expected query, key or value"));
}

}  // namespace RPE_ISA_NS
}  // namespace detail

inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp


/// @brief Wraps a compile-time term (any mapping, custom ones included) as an any_term: the same
/// configuration, the same checks and kernels, the bucket ids from the global cache.
/// @throws as rpe::term's constructor (never, for a term that was constructed).
template <class Term>
std::unique_ptr<any_term<typename Term::scalar_type>> make_any_term(const Term& t) {
    using S = typename Term::scalar_type;
    using M = typename Term::mapping_type;
    return detail::make_runtime_term<S>(std::make_shared<detail::id_source_for<M>>(t.mapping()), Term::num_tables,
                                        !Term::is_bias, Term::target_kind, t.num_heads(), t.head_dim(), t.shared_head(),
                                        t.skip());
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
