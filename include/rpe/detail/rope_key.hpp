/// @file detail/rope_key.hpp
/// @brief A fixed-frequency RoPE policy's value, type-erased (not API): the policy part of the
/// RoPE table caches' key, and what rpe::rope::custom holds.
#pragma once

#include <functional>
#include <typeindex>

#include "../concepts.hpp"
#include "../rope/layout.hpp"

namespace rpe::detail {

/// @brief Any fixed-frequency policy (rpe::RotaryPolicy) behind one interface: equality over its
/// type and value (the policy's own operator==, so every parameter takes part), its angle and
/// checks. A new form needs nothing here: its type and operator== are its key.
struct rope_policy_base {
    virtual ~rope_policy_base() = default;
    /// True when `other` holds a policy of the same type and an equal value.
    [[nodiscard]] virtual bool equals(const rope_policy_base& other) const = 0;
    /// The policy's type (hashed by the caches; equal types are told apart by equals).
    [[nodiscard]] virtual std::type_index type() const = 0;
    /// The policy's angle(row, col, pair, head_dim, height, width).
    [[nodiscard]] virtual float angle(int row, int col, int pair, int head_dim, int height, int width) const = 0;
    /// True when the policy has `angle_at(y, x, pair, head_dim)` (per-token positions).
    [[nodiscard]] virtual bool has_angle_at() const = 0;
    /// The policy's angle_at(y, x, pair, head_dim); 0 when it has none (see has_angle_at).
    [[nodiscard]] virtual float angle_at(float y, float x, int pair, int head_dim) const = 0;
    /// The number of axes of the policy's per-token positions: `P::position_axes` (3 for a
    /// policy with `angle_at(t, h, w, pair, head_dim)`), else 2.
    [[nodiscard]] virtual int position_axes() const = 0;
    /// The policy's angle_at(a0, a1, a2, pair, head_dim) of a 3-axis position; 0 when it has none.
    [[nodiscard]] virtual float angle_at3(float a0, float a1, float a2, int pair, int head_dim) const = 0;
    /// The policy's check_head_dim(head_dim) when it has one (e.g. rope::mrope's sections against
    /// D/2), else nothing. @throws rpe::invalid_argument as the policy's.
    virtual void check_head_dim(int head_dim) const = 0;
    /// The policy's validate(). @throws rpe::invalid_argument as the policy's.
    virtual void validate() const = 0;
    /// The policy's head_dim_multiple.
    [[nodiscard]] virtual int head_dim_multiple() const = 0;
    /// The layout the policy runs in (rope::required_layout_of: `P::required_layout`), −1 for any.
    [[nodiscard]] virtual int required_layout() const = 0;
};

/// @brief The number of axes of policy P's per-token positions: `P::position_axes` when declared
/// (2 or 3), else 2 (row, col).
template <class P>
constexpr int position_axes_of() {
    if constexpr (requires { P::position_axes; })
        return static_cast<int>(P::position_axes);
    else
        return 2;
}

/// @brief Policy P behind rope_policy_base.
template <RotaryPolicy P>
struct rope_policy_value final : rope_policy_base {
    P policy;
    explicit rope_policy_value(const P& p) : policy(p) {}
    [[nodiscard]] bool equals(const rope_policy_base& other) const override {
        const auto* o = dynamic_cast<const rope_policy_value<P>*>(&other);
        return o != nullptr && o->policy == policy;
    }
    [[nodiscard]] std::type_index type() const override { return typeid(P); }
    [[nodiscard]] float angle(int row, int col, int pair, int head_dim, int height, int width) const override {
        return policy.angle(row, col, pair, head_dim, height, width);
    }
    [[nodiscard]] bool has_angle_at() const override {
        if constexpr (position_axes_of<P>() == 3) return requires(float a, int p, int d) {
                { policy.angle_at(a, a, a, p, d) } -> std::same_as<float>;
            };
        else
            return requires(float y, float x, int p, int d) {
                { policy.angle_at(y, x, p, d) } -> std::same_as<float>;
            };
    }
    [[nodiscard]] float angle_at(float y, float x, int pair, int head_dim) const override {
        if constexpr (requires {
                          { policy.angle_at(y, x, pair, head_dim) } -> std::same_as<float>;
                      })
            return policy.angle_at(y, x, pair, head_dim);
        else
            return 0.0f;
    }
    [[nodiscard]] int position_axes() const override { return position_axes_of<P>(); }
    [[nodiscard]] float angle_at3(float a0, float a1, float a2, int pair, int head_dim) const override {
        if constexpr (requires {
                          { policy.angle_at(a0, a1, a2, pair, head_dim) } -> std::same_as<float>;
                      })
            return policy.angle_at(a0, a1, a2, pair, head_dim);
        else
            return 0.0f;
    }
    void check_head_dim(int head_dim) const override {
        if constexpr (requires { policy.check_head_dim(head_dim); }) policy.check_head_dim(head_dim);
    }
    void validate() const override { policy.validate(); }
    [[nodiscard]] int head_dim_multiple() const override { return P::head_dim_multiple; }
    [[nodiscard]] int required_layout() const override { return rope::required_layout_of<P>(); }
};

}  // namespace rpe::detail
