/// @file cuda.cuh
/// @brief Umbrella header of rpe's CUDA backend: rpe::term<..., rpe::backend::cuda>, device
/// bucket ids and their cache, the fused attention (rpe::cuda::attention_forward / backward, with
/// iRPE terms and 2D RoPE), the standalone RoPE rotation (rpe::cuda::rope_forward / backward), and
/// RPE_CUDA_CHECK / rpe::cuda_error. Compile with nvcc (-std=c++20 --expt-relaxed-constexpr).
/// It includes the CPU umbrella <rpe/rpe.hpp>, so both backends are available in one TU.
#pragma once

#if !defined(__CUDACC__)
#error "rpe/cuda.cuh needs nvcc (a .cu file); for the CPU backend include <rpe/rpe.hpp>"
#endif

#include "rpe.hpp"

#include "backend/cuda/attention.cuh"
#include "backend/cuda/bucket_ids.cuh"
#include "backend/cuda/error.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/term.cuh"
#include "backend/cuda/types.cuh"
