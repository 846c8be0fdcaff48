/// @file backend/cpu/attention_f16.hpp
/// @brief The fused attention forward and backward on rpe::f16 (IEEE binary16) storage (not API:
/// rpe::cpu::attention_forward / attention_backward with S = rpe::f16 call them). Included at the
/// end of backend/cpu/attention_half.hpp.
///
/// One path, fp32 compute (no CPU that rpe targets has fp16 arithmetic worth using: Zen 4 has
/// none; the conversions are in the hardware, F16C / AVX-512F, f16_kernels.hpp): the 16-bit glue of
/// attention_half.hpp, shared with bf16's portable path. q, k, v, the tables, attn_mask and the
/// RoPE frequencies converted to float once per call (contiguous copies, exact; the forward
/// converts q, k, v per chunk of batch elements, see cpu::half_forward_chunk_bytes), the float
/// forward or backward (the float kernels themselves, every sum in float), and each output
/// rounded to f16 once (to nearest even). So an f16 result is bit for bit the f16 rounding of the
/// float path's result on the same (f16-valued) inputs: its error is one f16 rounding (≤ 2^-11
/// relative, or half the subnormal step 2^-25 below 2^-14; ±∞ above 65504) on top of the float
/// path's.
#pragma once

#include <memory>

#include "../../f16.hpp"
#include "attention_half.hpp"  // half_glue (attention_half.hpp includes this file at its end)

namespace rpe::detail {
inline namespace RPE_ISA_NS {  // see backend/cpu/isa.hpp

template <class Id>
void fused_forward_f16(const attention_inputs<f16>& in, const std::shared_ptr<const bucket_ids>* ids, tensor_ref<f16> out,
                       tensor_ref<f16> attn, const attention_options& opt) {
    half_glue::forward<f16, Id>(in, ids, out, attn, opt);
}

inline void packed_forward_f16(const attention_inputs<f16>& in, tensor_ref<f16> out, const attention_options& opt) {
    half_glue::packed_forward<f16>(in, out, opt);
}

inline void fused_backward_f16(const attention_inputs<f16>& in, const attention_gradients<f16>& g, const attention_options& opt) {
    half_glue::backward<f16>(in, g, opt);
}

}  // namespace RPE_ISA_NS
}  // namespace rpe::detail
