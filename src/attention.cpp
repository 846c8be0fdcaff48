// The one instantiation of the CPU fused attention in a program (rpe::cpu::attention_forward and
// both attention_backward overloads, float and double; rpe::bf16's and rpe::f16's forward and backward): rpe's own programs (tests, tools,
// benchmarks, examples) link the object library rpe_attention, a user's program the installed
// target rpe::attention (which adds this file to it); both define RPE_EXTERN_ATTENTION, so each
// translation unit that calls the fused attention skips its instantiation (see
// <rpe/backend/cpu/attention.hpp>). The functions live in the inline namespace of this unit's
// ISA (rpe/backend/cpu/isa.hpp): the instantiations are named inside it, so they are the
// specializations that the program's units built with the same ISA flags declare extern.
#include <rpe/attention.hpp>

namespace rpe::cpu {
inline namespace RPE_ISA_NS {

template void attention_forward<float>(const attention_inputs<float>&, tensor_ref<float>, tensor_ref<float>,
                                       const attention_options&);
template void attention_forward<double>(const attention_inputs<double>&, tensor_ref<double>, tensor_ref<double>,
                                        const attention_options&);
template void attention_backward<float>(const attention_inputs<float>&, const attention_gradients<float>&,
                                        const attention_options&);
template void attention_backward<double>(const attention_inputs<double>&, const attention_gradients<double>&,
                                         const attention_options&);
template void attention_backward<float>(const attention_inputs<float>&, tensor_ref<const float>, tensor_ref<float>,
                                        tensor_ref<float>, tensor_ref<float>, const attention_options&);
template void attention_backward<double>(const attention_inputs<double>&, tensor_ref<const double>, tensor_ref<double>,
                                         tensor_ref<double>, tensor_ref<double>, const attention_options&);
template void attention_forward<bf16>(const attention_inputs<bf16>&, tensor_ref<bf16>, tensor_ref<bf16>,
                                      const attention_options&);
template void attention_backward<bf16>(const attention_inputs<bf16>&, const attention_gradients<bf16>&, const attention_options&);
template void attention_backward<bf16>(const attention_inputs<bf16>&, tensor_ref<const bf16>, tensor_ref<bf16>, tensor_ref<bf16>,
                                       tensor_ref<bf16>, const attention_options&);
template void attention_forward<f16>(const attention_inputs<f16>&, tensor_ref<f16>, tensor_ref<f16>, const attention_options&);
template void attention_backward<f16>(const attention_inputs<f16>&, const attention_gradients<f16>&, const attention_options&);
template void attention_backward<f16>(const attention_inputs<f16>&, tensor_ref<const f16>, tensor_ref<f16>, tensor_ref<f16>,
                                      tensor_ref<f16>, const attention_options&);

}  // namespace RPE_ISA_NS
}  // namespace rpe::cpu
