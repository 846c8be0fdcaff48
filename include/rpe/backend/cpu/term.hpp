/// @file backend/cpu/term.hpp
/// @brief CPU drivers of one term's forward and backward, after the shared checks of
/// detail/term_checks.hpp (not API: use rpe::term or rpe::any_term).
///
/// One instantiation per (scalar, mode, target) serves every mapping: the mapping only decides
/// the bucket ids, which arrive built. Shapes and layouts: see rpe::term. 16-bit storage runs the
/// float kernels on float copies, each output rounded once, by one driver for both types
/// (term_forward_half, term_backward_half): rpe::bf16 (term_forward_bf16, term_backward_bf16;
/// rpe::bf16's scalar conversions) and rpe::f16 (term_f16.hpp, the conversions in hardware where
/// the unit has them).
#pragma once

#include <span>
#include <type_traits>
#include <vector>

#include "../../bf16.hpp"
#include "../../f16.hpp"
#include "../../bucket_ids.hpp"
#include "../../detail/term_checks.hpp"
#include "../../mode.hpp"
#include "../../tensor.hpp"
#include "../../term_desc.hpp"
#include "isa.hpp"
#include "kernels.hpp"

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

template <bool Bias, target Tg>
void term_forward_bf16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const bf16>> tables, const bf16* x,
                       tensor_ref<bf16> out, bool accumulate);
template <bool Bias, target Tg>
void term_backward_bf16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const bf16>> tables, const bf16* x,
                        tensor_ref<const bf16> grad_out, bf16* grad_x, std::span<const tensor_ref<bf16>> grad_tables,
                        bool accumulate);
template <bool Bias, target Tg>
void term_forward_f16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const f16>> tables, const f16* x,
                      tensor_ref<f16> out, bool accumulate);
template <bool Bias, target Tg>
void term_backward_f16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const f16>> tables, const f16* x,
                       tensor_ref<const f16> grad_out, f16* grad_x, std::span<const tensor_ref<f16>> grad_tables,
                       bool accumulate);

/// @brief Forward of a checked term call: writes (or with `accumulate` adds) the term into `out`.
/// Cross (two tables) sums its tables' terms. S = rpe::bf16: term_forward_bf16; rpe::f16:
/// term_forward_f16.
template <class S, bool Bias, target Tg>
void term_forward(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables, const S* x,
                  tensor_ref<S> out, bool accumulate) {
    if constexpr (std::is_same_v<S, bf16>) {
        term_forward_bf16<Bias, Tg>(d, ids, tables, x, out, accumulate);
    } else if constexpr (std::is_same_v<S, f16>) {
        term_forward_f16<Bias, Tg>(d, ids, tables, x, out, accumulate);
    } else {
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
}

/// @brief Backward of a checked term call: `grad_x` (null to skip; always null in bias mode) and
/// each non-null `grad_tables[t]`, overwritten or with `accumulate` added to. S = rpe::bf16:
/// term_backward_bf16; rpe::f16: term_backward_f16.
template <class S, bool Bias, target Tg>
void term_backward(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const S>> tables, const S* x,
                   tensor_ref<const S> grad_out, S* grad_x, std::span<const tensor_ref<S>> grad_tables, bool accumulate) {
    if constexpr (std::is_same_v<S, bf16>) {
        term_backward_bf16<Bias, Tg>(d, ids, tables, x, grad_out, grad_x, grad_tables, accumulate);
    } else if constexpr (std::is_same_v<S, f16>) {
        term_backward_f16<Bias, Tg>(d, ids, tables, x, grad_out, grad_x, grad_tables, accumulate);
    } else {
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
}

// Elements of a term's x: none (bias), (B, H, L, L_k) (value), (B, H, L, D) (key), (B, H, L_k, D) (query).
template <bool Bias, target Tg>
std::int64_t term_x_size(const term_dims& d) {
    if constexpr (Bias) return 0;
    if constexpr (Tg == target::value) return d.batch * d.heads * d.length * d.key_length;
    return d.batch * d.heads * (Tg == target::query ? d.key_length : d.length) * d.dim;
}

// The float copies of 16-bit storage H: half_to_float (n values as a float vector, exact) and
// half_from_float (n floats rounded to H once, to nearest even), one overload pair per type.
// rpe::bf16: its scalar conversions (the bits of bf16_kernels.hpp's vector ones); rpe::f16:
// term_f16.hpp, in the hardware where the unit has it (declared here for the drivers below).
inline std::vector<float> half_to_float(const bf16* src, std::int64_t n) {
    std::vector<float> out(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(src[i]);
    return out;
}
inline void half_from_float(const float* src, bf16* dst, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16(src[i]);
}
inline std::vector<float> half_to_float(const f16* src, std::int64_t n);
inline void half_from_float(const float* src, f16* dst, std::int64_t n);

// A float view of `f` with the shape of `t` (contiguous).
template <class T, class U>
tensor_ref<T> term_float_view(T* f, const tensor_ref<U>& t) {
    tensor_ref<T> v;
    v.data = f;
    v.rank = t.rank;
    v.shape = t.shape;
    return v;
}

/// @brief term_forward on 16-bit storage H (rpe::bf16, rpe::f16): the tables and x converted to
/// float once, `out` too when accumulating (the sum then in float), the float kernels (Cross: both
/// tables summed in float), `out` rounded to H once.
template <class H, bool Bias, target Tg>
void term_forward_half(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const H>> tables, const H* x,
                       tensor_ref<H> out, bool accumulate) {
    std::vector<std::vector<float>> tf;
    std::vector<tensor_ref<const float>> tv;
    tf.reserve(tables.size());  // the views below point into these vectors
    for (const auto& t : tables) {
        tf.push_back(half_to_float(t.data, t.size()));
        tv.push_back(term_float_view<const float>(tf.back().data(), t));
    }
    const std::vector<float> xf = half_to_float(x, term_x_size<Bias, Tg>(d));
    std::vector<float> of =
        accumulate ? half_to_float(out.data, out.size()) : std::vector<float>(static_cast<std::size_t>(out.size()));
    term_forward<float, Bias, Tg>(d, ids, std::span<const tensor_ref<const float>>(tv), xf.empty() ? nullptr : xf.data(),
                                  term_float_view<float>(of.data(), out), accumulate);
    half_from_float(of.data(), out.data, out.size());
}

/// @brief term_backward on 16-bit storage H (rpe::bf16, rpe::f16): tables, x and grad_out
/// converted to float once, grad_x and the requested grad_tables too when accumulating, the float
/// kernels (every sum, a shared table's over heads and batch included, in float), each gradient
/// rounded to H once.
template <class H, bool Bias, target Tg>
void term_backward_half(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const H>> tables, const H* x,
                        tensor_ref<const H> grad_out, H* grad_x, std::span<const tensor_ref<H>> grad_tables, bool accumulate) {
    std::vector<std::vector<float>> tf, gf;
    std::vector<tensor_ref<const float>> tv;
    std::vector<tensor_ref<float>> gv;
    tf.reserve(tables.size());  // the views below point into these vectors
    gf.reserve(grad_tables.size());
    for (const auto& t : tables) {
        tf.push_back(half_to_float(t.data, t.size()));
        tv.push_back(term_float_view<const float>(tf.back().data(), t));
    }
    for (const auto& g : grad_tables) {
        if (!g.data) {
            gf.emplace_back();
            gv.emplace_back();  // not wanted
            continue;
        }
        gf.push_back(accumulate ? half_to_float(g.data, g.size()) : std::vector<float>(static_cast<std::size_t>(g.size())));
        gv.push_back(term_float_view<float>(gf.back().data(), g));
    }
    const std::int64_t nx = term_x_size<Bias, Tg>(d);
    const std::vector<float> xf = half_to_float(x, nx), gof = half_to_float(grad_out.data, grad_out.size());
    std::vector<float> gxf = grad_x ? (accumulate ? half_to_float(grad_x, nx) : std::vector<float>(static_cast<std::size_t>(nx)))
                                    : std::vector<float>{};
    term_backward<float, Bias, Tg>(d, ids, std::span<const tensor_ref<const float>>(tv), xf.empty() ? nullptr : xf.data(),
                                   term_float_view<const float>(gof.data(), grad_out), grad_x ? gxf.data() : nullptr,
                                   std::span<const tensor_ref<float>>(gv), accumulate);
    if (grad_x) half_from_float(gxf.data(), grad_x, nx);
    for (std::size_t t = 0; t < grad_tables.size(); ++t)
        if (grad_tables[t].data) half_from_float(gf[t].data(), grad_tables[t].data, grad_tables[t].size());
}

/// @brief term_forward on rpe::bf16 storage: the tables and x converted to float once, `out` too
/// when accumulating (the sum then in float), the float kernels (Cross: both tables summed in
/// float), `out` rounded to bf16 once.
template <bool Bias, target Tg>
void term_forward_bf16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const bf16>> tables, const bf16* x,
                       tensor_ref<bf16> out, bool accumulate) {
    term_forward_half<bf16, Bias, Tg>(d, ids, tables, x, out, accumulate);
}

/// @brief term_backward on rpe::bf16 storage: tables, x and grad_out converted to float once,
/// grad_x and the requested grad_tables too when accumulating, the float kernels (every sum, a
/// shared table's over heads and batch included, in float), each gradient rounded to bf16 once.
template <bool Bias, target Tg>
void term_backward_bf16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const bf16>> tables, const bf16* x,
                        tensor_ref<const bf16> grad_out, bf16* grad_x, std::span<const tensor_ref<bf16>> grad_tables,
                        bool accumulate) {
    term_backward_half<bf16, Bias, Tg>(d, ids, tables, x, grad_out, grad_x, grad_tables, accumulate);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu

namespace rpe::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp: term_forward / term_backward instantiate the CPU kernels

/// @brief Forward of term `desc` on the CPU: writes (`write::overwrite`) or adds
/// (`write::accumulate`) the term into `out`. Shapes as rpe::term (tables: desc.num_tables()
/// views shaped desc.table_shape(); x unused ({}) in bias mode).
/// @tparam S float, double, rpe::bf16 or rpe::f16 (16-bit storage: the tables, x and, when
///   accumulating, out converted to float, the float kernels, out rounded to bf16 / f16 once).
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
/// S = rpe::bf16 or rpe::f16: the inputs (and, when accumulating, the gradients) converted to
/// float, every sum in float, each gradient rounded to bf16 / f16 once (the table gradients are
/// bf16 / f16 values).
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

#include "term_f16.hpp"  // detail::cpu::term_forward_f16 / term_backward_f16, over the float kernels above
