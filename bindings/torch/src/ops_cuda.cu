/// @file ops_cuda.cu
/// @brief rpe's CUDA backend for the CUDA operators of rpe_torch (ops_cuda.cpp): the functions
/// of cuda_kernels.hpp, forwarding to rpe::cuda::term_forward / term_backward,
/// attention_forward / attention_backward and rope_forward / rope_backward, instantiated for the
/// four storage types of the backend (float, double, __half, __nv_bfloat16). The one nvcc
/// translation unit of the bindings: no Torch header (compile time), no CPU backend.
#include <rpe/cuda.cuh>

#include "cuda_kernels.hpp"

namespace rpe_torch::cuda {

template <class S>
void term_forward(const rpe::term_desc& desc, const rpe::bucket_ids& ids, std::span<const rpe::tensor_ref<const S>> tables,
                  rpe::tensor_ref<const S> x, rpe::tensor_ref<S> out, CUstream_st* stream) {
    rpe::cuda::term_forward<S>(desc, ids, tables, x, out, rpe::write::overwrite, stream);
}

template <class S>
void term_backward(const rpe::term_desc& desc, const rpe::bucket_ids& ids, std::span<const rpe::tensor_ref<const S>> tables,
                   rpe::tensor_ref<const S> x, rpe::tensor_ref<const S> grad_out, rpe::tensor_ref<S> grad_x,
                   std::span<const rpe::tensor_ref<S>> grad_tables, CUstream_st* stream) {
    rpe::cuda::term_backward<S>(desc, ids, tables, x, grad_out, grad_x, grad_tables, rpe::write::overwrite, stream);
}

template <class S>
void attention_forward(const rpe::attention_inputs<S>& in, rpe::tensor_ref<S> out, const rpe::attention_options& opt) {
    rpe::cuda::attention_forward<S>(in, out, rpe::tensor_ref<S>{}, opt);
}

template <class S>
void attention_backward(const rpe::attention_inputs<S>& in, const rpe::attention_gradients<S>& g,
                        const rpe::attention_options& opt) {
    rpe::cuda::attention_backward<S>(in, g, opt);
}

template <class S>
void rope_forward(const rpe::rotary_embedding<S>& r, int height, int width, rpe::tensor_ref<const S> x, rpe::tensor_ref<S> y,
                  CUstream_st* stream) {
    rpe::cuda::rope_forward<S>(r, height, width, x, y, stream);
}

template <class S>
void rope_backward(const rpe::rotary_embedding<S>& r, int height, int width, rpe::tensor_ref<const S> x,
                   rpe::tensor_ref<const S> grad_y, rpe::tensor_ref<S> grad_x, CUstream_st* stream) {
    rpe::cuda::rope_backward<S>(r, height, width, x, grad_y, grad_x, stream);
}

#define RPE_TORCH_CUDA_INSTANTIATE(S)                                                                                        \
    template void term_forward<S>(const rpe::term_desc&, const rpe::bucket_ids&, std::span<const rpe::tensor_ref<const S>>,  \
                                  rpe::tensor_ref<const S>, rpe::tensor_ref<S>, CUstream_st*);                               \
    template void term_backward<S>(const rpe::term_desc&, const rpe::bucket_ids&, std::span<const rpe::tensor_ref<const S>>, \
                                   rpe::tensor_ref<const S>, rpe::tensor_ref<const S>, rpe::tensor_ref<S>,                   \
                                   std::span<const rpe::tensor_ref<S>>, CUstream_st*);                                       \
    template void attention_forward<S>(const rpe::attention_inputs<S>&, rpe::tensor_ref<S>, const rpe::attention_options&);  \
    template void attention_backward<S>(const rpe::attention_inputs<S>&, const rpe::attention_gradients<S>&,                 \
                                        const rpe::attention_options&);                                                      \
    template void rope_forward<S>(const rpe::rotary_embedding<S>&, int, int, rpe::tensor_ref<const S>, rpe::tensor_ref<S>,   \
                                  CUstream_st*);                                                                             \
    template void rope_backward<S>(const rpe::rotary_embedding<S>&, int, int, rpe::tensor_ref<const S>,                      \
                                   rpe::tensor_ref<const S>, rpe::tensor_ref<S>, CUstream_st*);

RPE_TORCH_CUDA_INSTANTIATE(float)
RPE_TORCH_CUDA_INSTANTIATE(double)
RPE_TORCH_CUDA_INSTANTIATE(__half)
RPE_TORCH_CUDA_INSTANTIATE(__nv_bfloat16)

#undef RPE_TORCH_CUDA_INSTANTIATE

}  // namespace rpe_torch::cuda
