/// @file backend/cpu/eigen.hpp
/// @brief <Eigen/Core> (and the x86 intrinsics), as every rpe header includes them (not API).
///
/// g++ 12's AVX-512 intrinsics (avx512fintrin.h) fill the unused pass-through operand of their
/// masked builtins with `_mm512_undefined_ps()`, a deliberately self-initialised `__m512 __Y = __Y;`
/// whose value never matters (the mask is all ones). With AVX-512 enabled, g++ 12.1/12.2 report it
/// as `-Wmaybe-uninitialized` / `-Wuninitialized` wherever such an intrinsic is inlined (GCC bug
/// 105593): hundreds of warnings in Eigen's products and rpe's kernels, an error under -Werror.
/// Those warnings are located in the intrinsics headers, so ignoring the two warnings while they
/// are first included silences exactly these false positives (and nothing in the user's code or
/// rpe's own lines, whose locations lie outside this region).
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <Eigen/Core>

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic pop
#endif
