/// @file backend/cpu/term_f16.hpp
/// @brief One term's forward and backward on rpe::f16 storage (not API: rpe::term,
/// rpe::any_term and rpe::cpu::term_forward / term_backward with S = rpe::f16 call them). Included
/// at the end of backend/cpu/term.hpp.
///
/// As bf16's (term.hpp): the tables, x, grad_out and, when accumulating, the outputs converted to
/// float once per call (F16C / AVX-512F where the unit has them, f16_kernels.hpp), the float
/// kernels (every sum in float: Cross's two tables, a shared table's gradient over heads and
/// batch), each output rounded to f16 once. So each result is bit for bit the float call's result
/// on the same values rounded to f16 once. Written once for a 16-bit storage type H with exact
/// float conversions (half_to_float / half_from_float overloads).
#pragma once

#include <span>
#include <vector>

#include "../../f16.hpp"
#include "f16_kernels.hpp"
#include "term.hpp"  // term_forward<float>, term_x_size, term_float_view (term.hpp includes this file at its end)

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

inline std::vector<float> half_to_float(const f16* src, std::int64_t n) {
    std::vector<float> out(static_cast<std::size_t>(n));
    f16_to_float(src, out.data(), n);
    return out;
}
inline void half_from_float(const float* src, f16* dst, std::int64_t n) { float_to_f16(src, dst, n); }

/// @brief term_forward on 16-bit storage H: the tables and x converted to float once, `out` too
/// when accumulating (the sum then in float), the float kernels, `out` rounded to H once.
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

/// @brief term_backward on 16-bit storage H: tables, x and grad_out converted to float once,
/// grad_x and the requested grad_tables too when accumulating, the float kernels (every sum in
/// float), each gradient rounded to H once.
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

template <bool Bias, target Tg>
void term_forward_f16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const f16>> tables, const f16* x,
                      tensor_ref<f16> out, bool accumulate) {
    term_forward_half<f16, Bias, Tg>(d, ids, tables, x, out, accumulate);
}

template <bool Bias, target Tg>
void term_backward_f16(const term_dims& d, const bucket_ids& ids, std::span<const tensor_ref<const f16>> tables, const f16* x,
                       tensor_ref<const f16> grad_out, f16* grad_x, std::span<const tensor_ref<f16>> grad_tables,
                       bool accumulate) {
    term_backward_half<f16, Bias, Tg>(d, ids, tables, x, grad_out, grad_x, grad_tables, accumulate);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail::cpu
