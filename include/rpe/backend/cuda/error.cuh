/// @file backend/cuda/error.cuh
/// @brief rpe::cuda_error and RPE_CUDA_CHECK: CUDA runtime failures as exceptions (nvcc only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../../error.hpp"

namespace rpe {

/// @brief A CUDA runtime call failed (no device, out of device memory, a failed launch, …).
/// Derives from rpe::runtime_error (and so from std::runtime_error); `code()` is the
/// cudaError_t, the message `[rpe.cuda] <expr> failed at <file>:<line>: <cudaGetErrorString>`.
class cuda_error : public runtime_error {
public:
    cuda_error(cudaError_t code, const std::string& what) : runtime_error(what), code_(code) {}
    /// @brief The CUDA error code.
    [[nodiscard]] cudaError_t code() const noexcept { return code_; }

private:
    cudaError_t code_;
};

namespace detail {

/// @brief Throws rpe::cuda_error when `code != cudaSuccess` (and clears the sticky-free last error).
inline void cuda_check(cudaError_t code, const char* expr, const char* file, int line) {
    if (code == cudaSuccess) return;
    (void)cudaGetLastError();  // clear a non-sticky error so that later calls start clean
    throw cuda_error(code, message("cuda", expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(code), ": ",
                                   cudaGetErrorString(code)));
}

}  // namespace detail
}  // namespace rpe

/// @brief Evaluates a CUDA runtime call and throws rpe::cuda_error with its error string on failure.
#define RPE_CUDA_CHECK(expr) ::rpe::detail::cuda_check((expr), #expr, __FILE__, __LINE__)
