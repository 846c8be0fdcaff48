/// @file config.hpp
/// @brief Version, host/device macros, feature macros and the internal precondition macro.
#pragma once

#define RPE_VERSION_MAJOR 0
#define RPE_VERSION_MINOR 1
#define RPE_VERSION_PATCH 0

/// @brief `__host__ __device__` under nvcc, plain `inline` elsewhere.
#if defined(__CUDACC__)
#define RPE_HOST_DEVICE __host__ __device__ inline
#else
#define RPE_HOST_DEVICE inline
#endif

/// @brief 1 when this translation unit is compiled by nvcc (the CUDA backend is usable), else 0.
#if defined(__CUDACC__)
#define RPE_HAS_CUDA() 1
#else
#define RPE_HAS_CUDA() 0
#endif

/// @brief 1 when OpenMP is enabled for this translation unit, else 0.
#if defined(_OPENMP)
#define RPE_HAS_OPENMP() 1
#else
#define RPE_HAS_OPENMP() 0
#endif

/// @brief Internal precondition check for hot loops. Defaults to nothing in release builds
/// (NDEBUG) and to `assert` otherwise. Define `RPE_EXPECTS` before including any rpe header to
/// replace it, e.g. with a throwing check in tests.
#ifndef RPE_EXPECTS
#include <cassert>
#define RPE_EXPECTS(cond) assert(cond)
#endif
