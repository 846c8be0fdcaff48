/// @file backend/cpu/term_f16.hpp
/// @brief One term's forward and backward on rpe::f16 storage (not API: rpe::term,
/// rpe::any_term and rpe::cpu::term_forward / term_backward with S = rpe::f16 call them). Included
/// at the end of backend/cpu/term.hpp.
///
/// As bf16's, by the same driver (term.hpp's term_forward_half / term_backward_half): the tables,
/// x, grad_out and, when accumulating, the outputs converted to float once per call (F16C /
/// AVX-512F where the unit has them, f16_kernels.hpp: the half_to_float / half_from_float
/// overloads below), the float kernels (every sum in float: Cross's two tables, a shared table's
/// gradient over heads and batch), each output rounded to f16 once. So each result is bit for bit
/// the float call's result on the same values rounded to f16 once.
#pragma once

#include <span>
#include <vector>

#include "../../f16.hpp"
#include "f16_kernels.hpp"
#include "term.hpp"  // term_forward_half / term_backward_half (term.hpp includes this file at its end)

namespace rpe::detail::cpu {
inline namespace RPE_ISA_NS {  // see isa.hpp

// n f16 values as a float vector (exact) and n floats rounded to f16 once (declared in term.hpp).
inline std::vector<float> half_to_float(const f16* src, std::int64_t n) {
    std::vector<float> out(static_cast<std::size_t>(n));
    f16_to_float(src, out.data(), n);
    return out;
}
inline void half_from_float(const float* src, f16* dst, std::int64_t n) { float_to_f16(src, dst, n); }

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
