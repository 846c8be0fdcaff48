// Shared helpers of the unit tests that pin the CPU backend's execution: the OpenMP thread count
// (set_threads) and the bf16 kernels' path (bf16_portable_path, bf16_amx_off_path).
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <rpe/backend/cpu/bf16_kernels.hpp>

namespace rpe_test {

/// Sets the OpenMP thread count of the following parallel regions (no-op without OpenMP).
inline void set_threads([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
}

/// While alive, the bf16 products and the bf16 attention take the portable path (with false:
/// their default path); the default is restored at scope exit.
struct bf16_portable_path {
    explicit bf16_portable_path(bool on) { rpe::detail::cpu::bf16_portable_only = on; }
    ~bf16_portable_path() { rpe::detail::cpu::bf16_portable_only = false; }
    bf16_portable_path(const bf16_portable_path&) = delete;
    bf16_portable_path& operator=(const bf16_portable_path&) = delete;
};

/// While alive, the bf16 attention of an amx_bf16 unit takes vdpbf16ps instead of the AMX tiles
/// (with false: its default path); the default is restored at scope exit.
struct bf16_amx_off_path {
    explicit bf16_amx_off_path(bool on) { rpe::detail::cpu::bf16_amx_off = on; }
    ~bf16_amx_off_path() { rpe::detail::cpu::bf16_amx_off = false; }
    bf16_amx_off_path(const bf16_amx_off_path&) = delete;
    bf16_amx_off_path& operator=(const bf16_amx_off_path&) = delete;
};

}  // namespace rpe_test
