/// @file backend/tags.hpp
/// @brief Backend tags: rpe::backend::cpu (Eigen, OpenMP) and rpe::backend::cuda.
#pragma once

namespace rpe::backend {

/// @brief CPU backend: Eigen matrix products, OpenMP over batch × heads when enabled.
/// Header: <rpe/rpe.hpp>. The default everywhere.
struct cpu {};

/// @brief CUDA backend (compiled by nvcc only). Header: <rpe/cuda.cuh>.
struct cuda {};

}  // namespace rpe::backend
