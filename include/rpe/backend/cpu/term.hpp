/// @file backend/cpu/term.hpp
/// @brief CPU drivers of one term's forward and backward, after the shared checks of
/// detail/term_checks.hpp (not API: use rpe::term or rpe::any_term).
///
/// One instantiation per (scalar, mode, target) serves every mapping: the mapping only decides
/// the bucket ids, which arrive built. Shapes and layouts: see rpe::term.
#pragma once

#include <span>

#include "../../bucket_ids.hpp"
#include "../../detail/term_checks.hpp"
#include "../../mode.hpp"
#include "../../tensor.hpp"
#include "../../term_desc.hpp"
#include "isa.hpp"
#include "kernels.hpp"

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

/// @brief Forward of a checked term call: writes (or with `accumulate` adds) the term into `out`.
/// Cross (two tables) sums its tables' terms.
template <class S, bool Bias, target Tg>
void term_forward(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables, const S* x,
                  tensor_ref<S> out, bool accumulate) {
    const int num_tables = static_cast<int>(tables.size());
    for (int t = 0; t < num_tables; ++t) {
        const bool acc_t = accumulate || t > 0;
        const S* table = tables[static_cast<std::size_t>(t)].data;
        visit_id_width(ids.id_bytes(), [&]<class Id>() {
            const id_rows<Id> id{&ids, t, Tg == target::query};
            if constexpr (Bias)
                bias_forward(d, id, table, out.extent(0), out.extent(1), acc_t, out.data);
            else if constexpr (Tg == target::value)
                contextual_v_forward(d, id, x, table, acc_t, out.data);
            else
                contextual_qk_forward(d, id, x, table, acc_t, out.data);
        });
    }
}

/// @brief Backward of a checked term call: `grad_x` (null to skip; always null in bias mode) and
/// each non-null `grad_tables[t]`, overwritten or with `accumulate` added to.
template <class S, bool Bias, target Tg>
void term_backward(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables, const S* x,
                   tensor_ref<const S> grad_out, S* grad_x, std::span<const tensor_ref<S>> grad_tables, bool accumulate) {
    const int num_tables = static_cast<int>(tables.size());
    for (int t = 0; t < num_tables; ++t) {
        S* gt = grad_tables[static_cast<std::size_t>(t)].data;
        const S* table = tables[static_cast<std::size_t>(t)].data;
        const bool acc_x = accumulate || t > 0;
        visit_id_width(ids.id_bytes(), [&]<class Id>() {
            const id_rows<Id> id{&ids, t, Tg == target::query};
            if constexpr (Bias) {
                if (gt) bias_backward(d, id, grad_out.data, grad_out.extent(0), grad_out.extent(1), accumulate, gt);
            } else if constexpr (Tg == target::value) {
                if (grad_x) contextual_v_backward(d, id, x, table, grad_out.data, acc_x, grad_x, static_cast<S*>(nullptr));
                if (gt) contextual_v_backward(d, id, x, table, grad_out.data, accumulate, static_cast<S*>(nullptr), gt);
            } else {
                // one scatter of grad_out serves both gradients
                if (grad_x || gt) contextual_qk_backward(d, id, x, table, grad_out.data, acc_x, accumulate, grad_x, gt);
            }
        });
    }
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu

namespace rpe::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp: term_forward / term_backward instantiate the CPU kernels

/// @brief Forward of term `desc` on the CPU: writes (`write::overwrite`) or adds
/// (`write::accumulate`) the term into `out`. Shapes as rpe::term (tables: desc.num_tables()
/// views shaped desc.table_shape(); x unused ({}) in bias mode).
/// @throws rpe::invalid_argument `[rpe.term] ...` for ids built for another mapping or skip, a
///   shape that does not match, a null or overlapping buffer, before anything is written.
template <class S>
void term_forward(const term_desc& desc, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables,
                  tensor_ref<const S> x, tensor_ref<S> out, write mode) {
    detail::check_write_mode(mode);
    const auto d = detail::check_term_forward<S>(desc.layout(), desc.key(), ids, tables, x, out);
    detail::visit_mode_target(desc.layout(), [&]<bool Bias, target Tg>() {
        detail::cpu::term_forward<S, Bias, Tg>(d, ids, tables, x.data, out, mode == write::accumulate);
    });
}

/// @brief Backward of term_forward for `sum(out · grad_out)`: `grad_x` (`{}` to skip; always
/// `{}` in bias mode) and each non-empty `grad_tables[t]`, overwritten or added to (`mode`).
/// @throws as term_forward.
template <class S>
void term_backward(const term_desc& desc, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables,
                   tensor_ref<const S> x, tensor_ref<const S> grad_out, tensor_ref<S> grad_x,
                   std::span<const tensor_ref<S>> grad_tables, write mode) {
    detail::check_write_mode(mode);
    const auto d = detail::check_term_backward<S>(desc.layout(), desc.key(), ids, tables, x, grad_out, grad_x, grad_tables);
    detail::visit_mode_target(desc.layout(), [&]<bool Bias, target Tg>() {
        detail::cpu::term_backward<S, Bias, Tg>(d, ids, tables, x.data, grad_out, Bias ? nullptr : grad_x.data, grad_tables,
                                                mode == write::accumulate);
    });
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::cpu
