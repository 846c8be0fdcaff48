/// @file concepts.hpp
/// @brief The concepts that constrain rpe's policies: IndexFunction, Mapping, RotaryPolicy, Mode, Backend.
///
/// A policy that does not satisfy its concept fails at the point of use with the concept's name
/// in the diagnostic, e.g. "the required expression 'm.bucket(dr, dc)' is invalid".
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace rpe {

namespace mode {
struct bias;
struct contextual;
}  // namespace mode

namespace backend {
struct cpu;
struct cuda;
}  // namespace backend

/// @brief An index function g: integer offset or real distance → signed index in [−βi, βi].
template <class F>
concept IndexFunction =
    // a policy is a plain value: copied into kernels, compared as part of a cache key
    std::is_trivially_copyable_v<F> && std::equality_comparable<F> && requires(const F f, std::int64_t offset, float distance) {
    // βi: the output half-width, so outputs are in [−βi, βi] and 2βi+1 values exist
    { f.beta_int() } -> std::same_as<int>;
    // g at an integer offset (Product, Cross, Quantization feed integers)
    { f(offset) } -> std::same_as<int>;
    // g at a real distance (Euclidean feeds a rounded or real distance)
    { f(distance) } -> std::same_as<int>;
};

/// @brief A 2D mapping: offset (dr, dc) = (r_i − r_j, c_i − c_j) → bucket id in [0, num_buckets()).
///
/// Optional members: `static constexpr int num_tables` (default 1; Cross has 2, one id per table:
/// then `bucket(dr, dc, table)` gives the id in table `table`), `void validate() const`
/// (host-side parameter check that throws; called once when a term or bucket ids are built),
/// `void validate_grid(int height, int width) const` (host-side check of the grid the ids are
/// built on, e.g. a window that bounds the offsets), and `static constexpr int skip_buckets`
/// (1, the default: every pair touching a skip token shares one extra bucket; or 3, BEiT's
/// class→token, token→class and class→class buckets, see detail::skip_buckets_of).
template <class M>
concept Mapping =
    // a policy is a plain value: copied into kernels, compared as part of the cache key
    std::is_trivially_copyable_v<M> && std::equality_comparable<M> && requires(const M m, int dr, int dc) {
    // ids per table before the extra (skip) bucket; the table has this many rows (+1 with skip)
    { m.num_buckets() } -> std::convertible_to<int>;
    // id of the offset in table 0, in [0, num_buckets())
    { m.bucket(dr, dc) } -> std::convertible_to<int>;
};

/// @brief A 3D mapping for video tokens: offset (dt, dr, dc) = (t_i − t_j, r_i − r_j, c_i − c_j)
/// → bucket id in [0, num_buckets()), on a depth × height × width grid (frames × rows × columns).
/// It declares `static constexpr int dimensions = 3` (this tells it from Cross, whose
/// `bucket(dr, dc, table)` also takes three ints). One table; optional `void validate() const`.
template <class M>
concept Mapping3D = std::is_trivially_copyable_v<M> && std::equality_comparable<M> &&
    requires(const M m, int dt, int dr, int dc) {
    requires M::dimensions == 3;
    { m.num_buckets() } -> std::convertible_to<int>;
    { m.bucket(dt, dr, dc) } -> std::convertible_to<int>;
};

/// @brief Any mapping a term, the bucket ids and the attention accept: a 2D Mapping (images;
/// sequences as 1 × L grids) or a Mapping3D (video).
template <class M>
concept GridMapping = Mapping<M> || Mapping3D<M>;

/// @brief A fixed-frequency 2D rotary position embedding (rpe::rope::axial, rpe::rope::cat):
/// the rotation angle of channel pair `pair` (channels 2·pair, 2·pair + 1) of a head of
/// `head_dim` channels at grid token (row, col) of a height × width grid. The learned-frequency
/// form (rpe::rope::mixed) takes its frequencies from a tensor and is not such a policy.
template <class R>
concept RotaryPolicy =
    // a policy is a plain value: copied into kernels, compared as part of the cache key
    std::is_trivially_copyable_v<R> && std::equality_comparable<R> &&
    requires(const R r, int row, int col, int pair, int head_dim, int height, int width) {
    // head_dim must be a multiple of this (4 for the 2D forms: D/4 bands per axis)
    { R::head_dim_multiple } -> std::convertible_to<int>;
    // the angle in radians, float32 as the sources compute it
    { r.angle(row, col, pair, head_dim, height, width) } -> std::same_as<float>;
    // host-side parameter check that throws
    r.validate();
};

/// @brief A mode tag: rpe::mode::bias (eq. 14) or rpe::mode::contextual (eqs. 15–17).
template <class Md>
concept Mode = std::same_as<Md, mode::bias> || std::same_as<Md, mode::contextual>;

/// @brief A backend tag: rpe::backend::cpu (Eigen) or rpe::backend::cuda.
template <class B>
concept Backend = std::same_as<B, backend::cpu> || std::same_as<B, backend::cuda>;

namespace detail {

/// @brief Number of tables (and of id matrices) of mapping M: `M::num_tables`, else 1.
template <class M>
constexpr int num_tables_of() {
    if constexpr (requires { M::num_tables; })
        return static_cast<int>(M::num_tables);
    else
        return 1;
}

/// @brief Id of (dr, dc) in table `table` of mapping m.
template <class M>
constexpr int bucket_of(const M& m, int dr, int dc, int table) {
    if constexpr (num_tables_of<M>() > 1)
        return static_cast<int>(m.bucket(dr, dc, table));
    else
        return static_cast<int>(m.bucket(dr, dc));
}

/// @brief Extra buckets of mapping M for pairs that touch a skip token: `M::skip_buckets`, else 1.
/// With 1, every such pair has id K−1. With 3 (BEiT), K−3 when only the query is a skip token
/// (class → token), K−2 when only the key is (token → class), K−1 when both are.
template <class M>
constexpr int skip_buckets_of() {
    if constexpr (requires { M::skip_buckets; }) {
        static_assert(M::skip_buckets == 1 || M::skip_buckets == 3,
                      "rpe: a mapping's skip_buckets must be 1 (one shared extra bucket) or 3 (BEiT's three)");
        return static_cast<int>(M::skip_buckets);
    } else {
        return 1;
    }
}

/// @brief Calls `m.validate_grid(height, width)` when the mapping has one (host side).
template <class M>
void validate_grid_of(const M& m, int height, int width) {
    if constexpr (requires { m.validate_grid(height, width); }) m.validate_grid(height, width);
}

/// @brief Calls `p.validate()` when the policy has one.
template <class P>
void validate_policy(const P& p) {
    if constexpr (requires { p.validate(); }) p.validate();
}

}  // namespace detail
}  // namespace rpe
