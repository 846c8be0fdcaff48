/// @file cuda_kernels.hpp
/// @brief The calls of rpe's CUDA backend that the CUDA operators of rpe_torch make, declared
/// without any CUDA or Torch header: ops_cuda.cpp (the host C++ compiler, Torch's headers)
/// calls them, ops_cuda.cu (nvcc, <rpe/cuda.cuh>, no Torch header) defines them as thin
/// forwards to rpe::cuda::* and instantiates them for S = float, double, __half and
/// __nv_bfloat16. So nvcc never compiles Torch's headers and the host compiler never rpe's
/// kernels. Shapes, errors and streams are those of the rpe::cuda functions (docs/cuda.md);
/// every pointer is device memory of the current device, except the bucket ids (host objects,
/// also at per-token positions) and the attention's iRPE positions, key_positions and key_lengths
/// (device or host memory, as rpe::cuda::attention_forward takes them); nothing waits for the
/// device (except as those functions say: device positions are copied to the host and waited for).
#pragma once

#include <rpe/attention_inputs.hpp>
#include <rpe/bucket_ids.hpp>
#include <rpe/rope/rotary.hpp>
#include <rpe/tensor.hpp>
#include <rpe/term_desc.hpp>

#include <span>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace rpe_torch::cuda {

/// @brief rpe::cuda::term_forward(desc, ids, tables, x, out, rpe::write::overwrite, stream).
template <class S>
void term_forward(const rpe::term_desc& desc, const rpe::bucket_ids& ids, std::span<const rpe::tensor_ref<const S>> tables,
                  rpe::tensor_ref<const S> x, rpe::tensor_ref<S> out, CUstream_st* stream);

/// @brief rpe::cuda::term_backward(desc, ids, tables, x, grad_out, grad_x, grad_tables,
/// rpe::write::overwrite, stream).
template <class S>
void term_backward(const rpe::term_desc& desc, const rpe::bucket_ids& ids, std::span<const rpe::tensor_ref<const S>> tables,
                   rpe::tensor_ref<const S> x, rpe::tensor_ref<const S> grad_out, rpe::tensor_ref<S> grad_x,
                   std::span<const rpe::tensor_ref<S>> grad_tables, CUstream_st* stream);

/// @brief rpe::cuda::attention_forward(in, out, {}, opt) (no probabilities output on CUDA).
template <class S>
void attention_forward(const rpe::attention_inputs<S>& in, rpe::tensor_ref<S> out, const rpe::attention_options& opt);

/// @brief rpe::cuda::attention_backward(in, g, opt) (g.saved_attn must be empty on CUDA).
template <class S>
void attention_backward(const rpe::attention_inputs<S>& in, const rpe::attention_gradients<S>& g,
                        const rpe::attention_options& opt);

/// @brief rpe::cuda::rope_forward(r, height, width, x, y, stream).
template <class S>
void rope_forward(const rpe::rotary_embedding<S>& r, int height, int width, rpe::tensor_ref<const S> x, rpe::tensor_ref<S> y,
                  CUstream_st* stream);

/// @brief rpe::cuda::rope_backward(r, height, width, x, grad_y, grad_x, stream).
template <class S>
void rope_backward(const rpe::rotary_embedding<S>& r, int height, int width, rpe::tensor_ref<const S> x,
                   rpe::tensor_ref<const S> grad_y, rpe::tensor_ref<S> grad_x, CUstream_st* stream);

}  // namespace rpe_torch::cuda
