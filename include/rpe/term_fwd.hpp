/// @file term_fwd.hpp
/// @brief The declaration of rpe::term (defined per backend: the CPU one in term.hpp, the CUDA
/// one in backend/cuda/term.cuh), its configuration rpe::term_config and the ModeOnTarget
/// concept. Backend-free: no Eigen, no CUDA.
#pragma once

#include <type_traits>

#include "backend/tags.hpp"
#include "concepts.hpp"
#include "mode.hpp"

namespace rpe {

namespace detail {
template <class Md, target Tg>
inline constexpr bool valid_mode_target = !(std::is_same_v<Md, mode::bias> && Tg == target::value);
}  // namespace detail

/// @brief A valid (mode, target) pair: bias mode on values does not exist (paper eq. 17 defines
/// values in contextual mode only; the reference raises NotImplementedError).
template <class Md, target Tg>
concept ModeOnTarget = Mode<Md> && detail::valid_mode_target<Md, Tg>;

/// @brief A term's configuration by name, for designated initializers:
/// `rpe::term_config{.num_heads = 6, .head_dim = 64, .shared_head = true, .skip = 1}`.
/// num_heads and head_dim have no usable default (0 is rejected), so a forgotten field is an
/// error, not a silent 1; shared_head defaults to the reference's `shared_head=True`, skip to 0.
struct term_config {
    int num_heads = 0;        ///< H ≥ 1
    int head_dim = 0;         ///< D ≥ 1 (ignored by bias terms' kernels, still checked)
    bool shared_head = true;  ///< one table for all heads (Ht = 1); false: one table per head
    int skip = 0;             ///< extra tokens (class, distillation) before the grid, with their own bucket
};

/// @brief One iRPE term composed at compile time (mapping × mode × target × scalar × backend);
/// see term.hpp (CPU) and backend/cuda/term.cuh (CUDA). The run-time form is rpe::term_desc.
template <GridMapping M, Mode Md, target Tg, class S = float, Backend B = backend::cpu>
requires ModeOnTarget<Md, Tg>
class term;

}  // namespace rpe
