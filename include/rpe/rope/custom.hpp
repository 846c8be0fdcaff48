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
/// on the CPU and the CUDA backend alike; nothing in rpe names P.
/// A default-constructed custom holds no policy and fails validate().
class custom {
public:
    custom() = default;
    /// @brief Holds a copy of `p`.
    template <RotaryPolicy P>
        requires(!std::is_same_v<P, custom>)
    explicit custom(const P& p) : held_(std::make_shared<const detail::rope_policy_value<P>>(p)) {}

    /// @brief The held policy's angle (radians) of pair `pair` at (row, col).
    [[nodiscard]] float angle(int row, int col, int pair, int head_dim, int height, int width) const {
        return held_->angle(row, col, pair, head_dim, height, width);
    }
    /// @brief The held policy's angle at the real coordinates (y, x) of a per-token position;
    /// a policy without `float angle_at(float y, float x, int pair, int head_dim) const` takes no
    /// positions (has_angle_at() false; rpe::rotary_embedding::positions is then refused).
    [[nodiscard]] float angle_at(float y, float x, int pair, int head_dim) const { return held_->angle_at(y, x, pair, head_dim); }
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
