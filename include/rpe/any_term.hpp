/// @file any_term.hpp
/// @brief rpe::any_term: a CPU term behind one run-time interface (an rpe::term_desc with virtual
/// CPU forward/backward), and rpe::make_any_term, which wraps a compile-time term (any mapping,
/// custom ones included).
/// Terms configured by name at run time (rpe::make_term, rpe::term_spec) are in <rpe/make_term.hpp>.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cpu/isa.hpp"
#include "backend/cpu/term.hpp"
#include "bucket_cache.hpp"
#include "bucket_ids.hpp"
#include "concepts.hpp"
#include "detail/term_checks.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "tensor.hpp"
#include "term.hpp"
#include "term_desc.hpp"

namespace rpe {

/// @brief A term behind one run-time interface on the CPU: its descriptor (rpe::term_desc, the
/// backend-free part, which the attention slots of both backends take) and virtual CPU forward
/// and backward (one virtual call per call, nothing per element). Tables are passed as spans of
/// 1 (or 2 for Cross) views. Shapes, errors and guarantees are those of rpe::term (the same
/// shared checks run); rpe::cpu::term_forward / term_backward run a bare descriptor the same way.
template <class S>
class any_term : public term_desc {
public:
    virtual ~any_term() = default;
    /// @brief rpe::term::forward (the write mode is required). @throws rpe::invalid_argument when
    /// tables.size() != num_tables().
    virtual void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                         tensor_ref<S> out, write mode) const = 0;
    /// @brief rpe::term::backward (the write mode is required). @throws rpe::invalid_argument when a
    /// span's size != num_tables().
    virtual void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                          tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                          write mode) const = 0;
    /// @brief The backend-free descriptor of this term.
    [[nodiscard]] const term_desc& desc() const { return *this; }

protected:
    explicit any_term(term_desc d) : term_desc(std::move(d)) {}
    any_term(const any_term&) = default;
    any_term& operator=(const any_term&) = default;
};

namespace detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp: the CPU drivers are ISA-dependent

/// @brief The run-time term: a descriptor plus the CPU drivers of one (scalar, mode, target);
/// every mapping shares these instantiations.
template <class S, bool Bias, target Tg>
class runtime_term final : public any_term<S> {
public:
    explicit runtime_term(term_desc d) : any_term<S>(std::move(d)) {}
    void forward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                 tensor_ref<S> out, write mode) const override {
        check_write_mode(mode);
        const auto d = check_term_forward<S>(this->layout(), this->key(), ids, tables, x, out);
        cpu::term_forward<S, Bias, Tg>(d, ids, tables, x.data, out, mode == write::accumulate);
    }
    void backward(const rpe::bucket_ids& ids, std::span<const tensor_ref<const S>> tables, tensor_ref<const S> x,
                  tensor_ref<const S> grad_out, tensor_ref<S> grad_x, std::span<const tensor_ref<S>> grad_tables,
                  write mode) const override {
        check_write_mode(mode);
        const auto d = check_term_backward<S>(this->layout(), this->key(), ids, tables, x, grad_out, grad_x, grad_tables);
        cpu::term_backward<S, Bias, Tg>(d, ids, tables, x.data, grad_out, Bias ? nullptr : grad_x.data, grad_tables,
                                        mode == write::accumulate);
    }
};

/// @brief The CPU run-time term of a descriptor: five instantiations per scalar in all.
template <class S>
std::unique_ptr<any_term<S>> make_runtime_term(term_desc desc) {
    return detail::visit_mode_target(desc.layout(), [&]<bool Bias, target Tg>() -> std::unique_ptr<any_term<S>> {
        return std::make_unique<runtime_term<S, Bias, Tg>>(std::move(desc));
    });
}

/// @brief The run-time term of (ids, mode, target).
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for bias mode on values or an unknown
///   target, `[rpe.term] ...` as term_desc's constructor.
template <class S>
std::unique_ptr<any_term<S>> make_runtime_term(std::shared_ptr<const id_source> ids, int num_tables, bool contextual,
                                               rpe::target tg, int num_heads, int head_dim, bool shared_head, int skip) {
    if (tg == target::value && !contextual)
        throw invalid_argument(message("term_spec",
                                       "mode = bias with target = v: bias mode on values does not exist "
                                       "(paper eq. 17; the reference raises NotImplementedError)"));
    if (tg != target::query && tg != target::key && tg != target::value)
        throw invalid_argument(message("term_spec", "target = ", static_cast<int>(tg), "; expected query, key or value"));
    return make_runtime_term<S>(
        term_desc(std::move(ids), num_tables, contextual, tg,
                  term_config{.num_heads = num_heads, .head_dim = head_dim, .shared_head = shared_head, .skip = skip}));
}

}  // namespace RPE_ISA_NS
}  // namespace detail

inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

/// @brief Wraps a compile-time term (any mapping, custom ones included) as an any_term: the same
/// configuration, the same checks and kernels, the bucket ids from `cache` (the process-wide
/// bucket_cache::global() when null; a given cache must outlive the term).
/// @throws as rpe::term's constructor (never, for a term that was constructed).
template <class Term>
std::unique_ptr<any_term<typename Term::scalar_type>> make_any_term(const Term& t, bucket_cache* cache = nullptr) {
    using S = typename Term::scalar_type;
    return detail::make_runtime_term<S>(make_term_desc(t.mapping(), !Term::is_bias, Term::target_kind, t.config(), cache));
}

}  // namespace RPE_ISA_NS
}  // namespace rpe
