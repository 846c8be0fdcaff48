/// @file rope/custom.hpp
/// @brief rpe::rope::custom: a user-defined fixed-frequency RoPE form, without editing rpe.
#pragma once

#include <memory>
#include <type_traits>

#include "../concepts.hpp"
#include "../detail/rope_key.hpp"
#include "../detail/raise.hpp"

namespace rpe::rope {

/// @brief Any fixed-frequency policy P (rpe::RotaryPolicy: a trivially copyable, equality-comparable
/// value with `head_dim_multiple`, `float angle(row, col, pair, head_dim, height, width)` and
/// `validate()`) as a form of rpe::rotary_embedding: `r.form = rpe::rope::custom{my_form{...}}`.
/// Its cos/sin table is built from P::angle and cached by P's type and value (P's operator==),
/// on the CPU and the CUDA backend alike; nothing in rpe names P. A policy may also declare
/// `position_axes = 3` with `float angle_at(float, float, float, int pair, int head_dim) const`
/// (positions (N, 3), as rope::mrope) and `void check_head_dim(int head_dim) const`.
/// A default-constructed custom holds no policy and fails validate().
class custom {
public:
    custom() = default;
    /// @brief Holds a copy of `p`.
    template <RotaryPolicy P>
    requires(!std::is_same_v<P, custom>) explicit custom(const P& p)
        : held_(std::make_shared<const detail::rope_policy_value<P>>(p)) {}

    /// @brief The held policy's angle (radians) of pair `pair` at (row, col).
    [[nodiscard]] float angle(int row, int col, int pair, int head_dim, int height, int width) const {
        return held_->angle(row, col, pair, head_dim, height, width);
    }
    /// @brief The held policy's angle at the real coordinates (y, x) of a per-token position;
    /// a policy without `float angle_at(float y, float x, int pair, int head_dim) const` takes no
    /// positions (has_angle_at() false; rpe::rotary_embedding::positions is then refused).
    [[nodiscard]] float angle_at(float y, float x, int pair, int head_dim) const { return held_->angle_at(y, x, pair, head_dim); }
    /// @brief The held policy's angle at the ids (a0, a1, a2) of a 3-axis per-token position (a
    /// policy with `position_axes = 3` and `float angle_at(float, float, float, int pair, int
    /// head_dim) const`, e.g. rope::mrope's (t, h, w)).
    [[nodiscard]] float angle_at(float a0, float a1, float a2, int pair, int head_dim) const {
        return held_->angle_at3(a0, a1, a2, pair, head_dim);
    }
    /// @brief The number of axes of the held policy's positions: its `position_axes` (3 for
    /// rope::mrope), else 2 (also when empty).
    [[nodiscard]] int position_axes() const { return held_ ? held_->position_axes() : 2; }
    /// @brief The held policy's check_head_dim(D) when it has one (rope::mrope: the sections sum
    /// to D/2). @throws rpe::invalid_argument as the policy's.
    void check_head_dim(int head_dim) const {
        if (held_) held_->check_head_dim(head_dim);
    }
    /// @brief The layout the held policy runs in (its `required_layout`, e.g. rope::vjepa2's
    /// layout::vjepa2), −1 when it runs in any (or when empty).
    [[nodiscard]] int required_layout() const { return held_ ? held_->required_layout() : -1; }
    /// @brief Whether the held policy has angle_at (false when empty).
    [[nodiscard]] bool has_angle_at() const { return held_ && held_->has_angle_at(); }
    /// @brief The held policy's head_dim_multiple (1 when empty).
    [[nodiscard]] int head_dim_multiple() const { return held_ ? held_->head_dim_multiple() : 1; }
    /// @throws rpe::invalid_argument `[rpe.rope] custom form holds no policy` when empty, else as
    ///   the held policy's validate().
    void validate() const {
        detail::require(held_ != nullptr, "rope", "custom form holds no policy; expected rope::custom{policy}");
        held_->validate();
    }
    /// @brief The held policy, type-erased (null when empty).
    [[nodiscard]] const std::shared_ptr<const detail::rope_policy_base>& policy() const { return held_; }

    /// @brief Same policy type and value (or both empty).
    friend bool operator==(const custom& a, const custom& b) {
        if (a.held_ == b.held_) return true;
        return a.held_ && b.held_ && a.held_->equals(*b.held_);
    }

private:
    std::shared_ptr<const detail::rope_policy_base> held_;
};

}  // namespace rpe::rope
