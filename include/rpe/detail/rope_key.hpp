/// @file detail/rope_key.hpp
/// @brief A fixed-frequency RoPE policy's value, type-erased (not API): the policy part of the
/// RoPE table caches' key, and what rpe::rope::custom holds.
#pragma once

#include <functional>
#include <typeindex>

#include "../concepts.hpp"

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
    /// The policy's validate(). @throws rpe::invalid_argument as the policy's.
    virtual void validate() const = 0;
    /// The policy's head_dim_multiple.
    [[nodiscard]] virtual int head_dim_multiple() const = 0;
};

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
        return requires(float y, float x, int p, int d) { { policy.angle_at(y, x, p, d) } -> std::same_as<float>; };
    }
    [[nodiscard]] float angle_at(float y, float x, int pair, int head_dim) const override {
        if constexpr (requires { { policy.angle_at(y, x, pair, head_dim) } -> std::same_as<float>; })
            return policy.angle_at(y, x, pair, head_dim);
        else
            return 0.0f;
    }
    void validate() const override { policy.validate(); }
    [[nodiscard]] int head_dim_multiple() const override { return P::head_dim_multiple; }
};

}  // namespace rpe::detail
