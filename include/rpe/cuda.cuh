/// @file cuda.cuh
/// @brief Umbrella header of rpe's CUDA backend: rpe::term<..., rpe::backend::cuda>,
/// rpe::cuda::term_forward / term_backward over an rpe::term_desc, device bucket ids and their
/// cache, the fused attention (rpe::cuda::attention_forward / backward, with iRPE terms and 2D
/// RoPE), the standalone RoPE rotation (rpe::cuda::rope_forward / backward), and RPE_CUDA_CHECK /
/// rpe::cuda_error. Compile with nvcc (-std=c++20 --expt-relaxed-constexpr).
/// It includes the backend-free core <rpe/core.hpp> and nothing of the CPU backend (no Eigen);
/// include <rpe/rpe.hpp> as well to use both backends in one TU.
#pragma once

#if !defined(__CUDACC__)
#error "rpe/cuda.cuh needs nvcc (a .cu file); for the CPU backend include <rpe/rpe.hpp>"
#endif

#include "core.hpp"

#include "backend/cuda/attention.cuh"
#include "backend/cuda/bucket_ids.cuh"
#include "backend/cuda/error.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/term.cuh"
#include "backend/cuda/types.cuh"
