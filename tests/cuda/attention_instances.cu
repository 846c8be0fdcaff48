// The one instantiation of the CUDA fused attention (forward and backward, every storage type) in
// the test program; the test units declare them extern (attention_instances.cuh).
#define RPE_CUDA_TEST_ATTENTION_INSTANCES
#include "attention_instances.cuh"

#define RPE_CUDA_TEST_ATTENTION(S)                                                                                         \
    template void rpe::cuda::attention_forward<S>(const rpe::attention_inputs<S>&, rpe::tensor_ref<S>, rpe::tensor_ref<S>, \
                                                  const rpe::attention_options&);                                          \
    template void rpe::cuda::attention_backward<S>(const rpe::attention_inputs<S>&, const rpe::attention_gradients<S>&,    \
                                                   const rpe::attention_options&);
RPE_CUDA_TEST_ATTENTION_TYPES(RPE_CUDA_TEST_ATTENTION)
