// The CUDA fused attention of the test program, instantiated once: test_cuda_attention.cu and
// test_cuda_rope.cu both call rpe::cuda::attention_forward / attention_backward (float and double;
// the former also fp16 and bf16), and without these declarations each unit would compile every
// attention kernel again (nvcc's device passes, cicc and ptxas, are most of a unit's time). The
// definitions are in attention_instances.cu: the same kernels, built and run once per program.
#pragma once

#include <rpe/backend/cuda/attention.cuh>

// X(S): one storage type of the CUDA backend (rpe::cuda::DeviceScalar).
#define RPE_CUDA_TEST_ATTENTION_TYPES(X) X(float) X(double) X(__half) X(__nv_bfloat16)

#define RPE_CUDA_TEST_ATTENTION(S)                                                                                             \
    extern template void rpe::cuda::attention_forward<S>(const rpe::attention_inputs<S>&, rpe::tensor_ref<S>,                  \
                                                         rpe::tensor_ref<S>, const rpe::attention_options&);                   \
    extern template void rpe::cuda::attention_backward<S>(const rpe::attention_inputs<S>&, const rpe::attention_gradients<S>&, \
                                                          const rpe::attention_options&);
#if !defined(RPE_CUDA_TEST_ATTENTION_INSTANCES)
RPE_CUDA_TEST_ATTENTION_TYPES(RPE_CUDA_TEST_ATTENTION)
#endif
#undef RPE_CUDA_TEST_ATTENTION
