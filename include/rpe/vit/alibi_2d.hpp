/// @file vit/alibi_2d.hpp
/// @brief 2D ALiBi (CROMA): a fixed per-head slope times the Euclidean patch distance, subtracted
/// from the logits, as rpe's bias term on a mapping that gives every offset its own bucket.
///
/// `logits[b, h, i, j] += −m_h · √(Δr² + Δc²)`, with ALiBi's slopes m_h (Press et al.) and no
/// learned parameter. In rpe it is the bias term on keys of `mapping::product<index::clip>` with
/// β = max(H, W) − 1 (one bucket per offset (Δr, Δc), none clipped on the grid) and a fixed,
/// generated (H, K) table `−m_h·dist(bucket)` (alibi_2d_table): the fused attention, the CUDA
/// term and the bucket cache run it unchanged. Nothing learns it: pass no `grad_tables` for it
/// (q, k, v still get their gradients through it).
///
/// Limits: the mapping is bounded to the H × W grid it was built for (mapping::within_grid): a
/// taller or wider grid, where the clip index would merge far offsets into the edge buckets and
/// give them a wrong distance, is rejected with `[rpe.mapping.within_grid] grid = ... is larger
/// than the HxW grid the term was built for` by the bucket ids, the cache and the attention; a
/// smaller grid reads a subset of the buckets (the same bias as on the full grid).
/// CROMA uses square grids; rpe allows H ≠ W with the same formula.
/// Source: antofuller/CROMA `use_croma.py` (`get_2dalibi` and its `get_slopes`); Fuller et al.,
/// CROMA (NeurIPS 2023); Press et al., ALiBi (ICLR 2022).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "../detail/check.hpp"
#include "../error.hpp"
#include "../index/clip.hpp"
#include "../mapping/product.hpp"
#include "../mapping/within_grid.hpp"
#include "../mode.hpp"
#include "../tensor.hpp"
#include "../term.hpp"

namespace rpe::vit {

/// @brief Largest head count alibi_slopes accepts (far beyond any model; keeps 2^k exact).
inline constexpr int max_alibi_heads = 1 << 20;

/// @brief ALiBi's per-head slopes, in double, as CROMA's `get_slopes(num_heads)` computes them in
/// Python: for n a power of two, `m_i = start·start^i` with `start = 2^(−2^(−(log2 n − 3)))`
/// (n = 8: 1/2, 1/4, …, 1/256); otherwise the 2^⌊log2 n⌋ slopes of the nearest lower power of two,
/// then every other slope of 2·2^⌊log2 n⌋ heads until n slopes.
/// @throws rpe::invalid_argument `[rpe.vit.alibi] num_heads = ...; expected 1 <= num_heads <= 2^20`.
inline std::vector<double> alibi_slopes(int num_heads) {
    detail::require(num_heads >= 1 && num_heads <= max_alibi_heads, "vit.alibi", "num_heads = ", num_heads,
                    "; expected 1 <= num_heads <= 2^20");
    const auto power_of_two = [](int n) {
        const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(n)) - 3.0)));
        std::vector<double> s(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) s[static_cast<std::size_t>(i)] = start * std::pow(start, static_cast<double>(i));
        return s;
    };
    int closest = 1;
    while (closest * 2 <= num_heads) closest *= 2;
    if (closest == num_heads) return power_of_two(num_heads);
    auto out = power_of_two(closest);
    const auto twice = power_of_two(2 * closest);
    for (int i = 0; static_cast<int>(out.size()) < num_heads; i += 2) out.push_back(twice[static_cast<std::size_t>(i)]);
    return out;
}

/// @brief The mapping type of 2D ALiBi: Product with a clip index, bounded to the grid it was
/// built for.
using alibi_2d_mapping_type = mapping::within_grid<mapping::product<index::clip>>;
static_assert(Mapping<alibi_2d_mapping_type> && alibi_2d_mapping_type::num_tables == 1);

/// @brief The mapping of 2D ALiBi on an H × W grid: `mapping::product<index::clip>` with
/// β = max(H, W) − 1, so bucket `(Δr + β)·(2β + 1) + (Δc + β)` is offset (Δr, Δc) alone, in
/// `mapping::within_grid{.height = H, .width = W}`, which rejects a taller or wider grid.
/// @throws rpe::invalid_argument `[rpe.vit.alibi] height = ...` for a side < 1 or > 23170 (the
///   (2β+1)² buckets must fit in int).
inline alibi_2d_mapping_type alibi_2d_mapping(int height, int width) {
    // (2·max(H, W) − 1)² buckets must fit in int: max(H, W) <= 23170
    detail::require(height >= 1 && height <= 23170, "vit.alibi", "height = ", height, "; expected 1 <= height <= 23170");
    detail::require(width >= 1 && width <= 23170, "vit.alibi", "width = ", width, "; expected 1 <= width <= 23170");
    return {.inner = mapping::product<index::clip>{index::clip{static_cast<double>((height > width ? height : width) - 1)}},
            .height = height,
            .width = width};
}

/// @brief The term type of 2D ALiBi: bias mode on keys of the product mapping (clip index, bounded
/// to its grid).
template <class S = float>
using alibi_2d_term = term<alibi_2d_mapping_type, mode::bias, target::key, S>;

/// @brief Configuration of 2D ALiBi.
struct alibi_2d_config {
    int height = 0;     ///< grid rows (CROMA: √num_patches)
    int width = 0;      ///< grid columns
    int num_heads = 0;  ///< H: one slope per head
    int head_dim = 0;   ///< D (the term checks it against the attention's; the bias ignores it)
    int skip = 0;       ///< tokens before the grid (CROMA: none): their pairs get bias 0
};

/// @brief The term of `c`: `alibi_2d_term<S>(alibi_2d_mapping(H, W), {.num_heads, .head_dim,
/// .shared_head = false, .skip})`; its table has shape (H, K), K = (2·max(H, W) − 1)² (+1 with skip).
/// @throws rpe::invalid_argument `[rpe.vit.alibi] ...` for a bad grid, `[rpe.term] ...` for bad
///   heads, head_dim or skip.
template <class S = float>
alibi_2d_term<S> make_alibi_2d_term(const alibi_2d_config& c) {
    return alibi_2d_term<S>(alibi_2d_mapping(c.height, c.width),
                            term_config{.num_heads = c.num_heads, .head_dim = c.head_dim, .shared_head = false, .skip = c.skip});
}

/// @brief Fills the fixed (H, K) table of 2D ALiBi: bucket of (Δr, Δc) ↦
/// `−(S(m_h) · S(√(Δr² + Δc²)))` for every |Δr|, |Δc| ≤ β (the distance's square root in double,
/// the product in S, as CROMA multiplies its float32 slopes by the Python float distance); the
/// skip bucket (skip > 0) is 0.
/// @throws rpe::invalid_argument `[rpe.vit.alibi] ...` for a bad grid or head count, a table of
///   another shape than (H, K), or a null table.
/// Complexity O(H·K).
template <class S>
void alibi_2d_table(const alibi_2d_config& c, tensor_ref<S> table) {
    const auto m = alibi_2d_mapping(c.height, c.width);
    const auto slopes = alibi_slopes(c.num_heads);
    detail::require(c.skip >= 0, "vit.alibi", "skip = ", c.skip, "; expected >= 0");
    const std::int64_t k = m.num_buckets() + (c.skip > 0 ? 1 : 0), b = m.inner.index.beta_int();
    detail::check_shape(table, {c.num_heads, k}, "vit.alibi", "table");
    detail::check_nonnull(table, "vit.alibi", "table");
    for (int h = 0; h < c.num_heads; ++h) {
        S* row = table.data + h * k;
        const S slope = static_cast<S>(slopes[static_cast<std::size_t>(h)]);
        for (std::int64_t dr = -b; dr <= b; ++dr)
            for (std::int64_t dc = -b; dc <= b; ++dc) {
                const S dist = static_cast<S>(std::sqrt(static_cast<double>(dr * dr + dc * dc)));
                row[m.bucket(static_cast<int>(dr), static_cast<int>(dc))] = -(slope * dist);
            }
        if (c.skip > 0) row[k - 1] = S(0);
    }
}

/// @brief alibi_2d_table into a new (H, K) row-major vector.
/// @throws as alibi_2d_table.
template <class S = float>
std::vector<S> alibi_2d_table(const alibi_2d_config& c) {
    const auto m = alibi_2d_mapping(c.height, c.width);
    detail::require(c.num_heads >= 1 && c.num_heads <= max_alibi_heads, "vit.alibi", "num_heads = ", c.num_heads,
                    "; expected 1 <= num_heads <= 2^20");
    const std::int64_t k = m.num_buckets() + (c.skip > 0 ? 1 : 0);
    std::vector<S> t(static_cast<std::size_t>(c.num_heads * k));
    alibi_2d_table<S>(c, tensor_ref<S>(t.data(), {c.num_heads, k}));
    return t;
}

}  // namespace rpe::vit
