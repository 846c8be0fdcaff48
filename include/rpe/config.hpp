/// @file config.hpp
/// @brief Version and the host/device macro.
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
