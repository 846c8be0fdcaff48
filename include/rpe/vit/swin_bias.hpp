/// @file vit/swin_bias.hpp
/// @brief Swin / BEiT relative position bias tables in timm's layout, and SwinV2's continuous
/// position bias (CPB): the log-spaced relative coordinates of each Swin bucket, and a bias term
/// whose table a user callable (the CPB MLP) produces, with gradients back to the MLP's output.
///
/// Layouts: timm keeps a relative position bias table as (K, num_heads); rpe's bias terms read
/// (Ht, K). table_from_timm / table_to_timm convert. The Swin mapping's bucket k is the offset
/// (dr, dc) = (k / (2Ww − 1) − (Wh − 1), k % (2Ww − 1) − (Ww − 1)), row-major over
/// dr ∈ [−(Wh−1), Wh−1], dc ∈ [−(Ww−1), Ww−1] — the order of timm's coordinate tables.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "../bucket_cache.hpp"
#include "../bucket_ids.hpp"
#include "../detail/check.hpp"
#include "../detail/validate.hpp"
#include "../error.hpp"
#include "../mapping/swin.hpp"
#include "../mode.hpp"
#include "../tensor.hpp"
#include "../term.hpp"

namespace rpe {

namespace detail {
/// @brief Checks a (rows, cols) → (cols, rows) transpose's views and returns (rows, cols).
template <class S>
std::pair<std::int64_t, std::int64_t> check_transpose(tensor_ref<const S> src, tensor_ref<S> dst, const char* src_name,
                                                      const char* dst_name) {
    require(src.rank == 2, "swin_bias", src_name, " has shape ", src.shape_string(), "; expected rank 2");
    check_shape(dst, {src.extent(1), src.extent(0)}, "swin_bias", dst_name);
    check_nonnull(src, "swin_bias", src_name);
    check_nonnull(dst, "swin_bias", dst_name);
    check_no_overlap(dst, src, "swin_bias", dst_name, src_name);
    return {src.extent(0), src.extent(1)};
}
}  // namespace detail

/// @brief rpe's (H, K) bias table from timm's `relative_position_bias_table` (K, H) (Swin, BEiT):
/// `table[h, k] = timm_table[k, h]`.
/// @throws rpe::invalid_argument `[rpe.swin_bias] table has shape (...); expected (H, K)` for a
///   mismatched shape, a null or overlapping buffer.
template <class S>
void table_from_timm(tensor_ref<const S> timm_table, tensor_ref<S> table) {
    const auto [k, h] = detail::check_transpose(timm_table, table, "timm_table", "table");
    for (std::int64_t b = 0; b < k; ++b)
        for (std::int64_t j = 0; j < h; ++j) table.data[j * k + b] = timm_table.data[b * h + j];
}

/// @brief timm's (K, H) layout from rpe's (H, K) table (or its gradient): the inverse of table_from_timm.
/// @throws as table_from_timm (`timm_table has shape ...`).
template <class S>
void table_to_timm(tensor_ref<const S> table, tensor_ref<S> timm_table) {
    const auto [h, k] = detail::check_transpose(table, timm_table, "table", "timm_table");
    for (std::int64_t j = 0; j < h; ++j)
        for (std::int64_t b = 0; b < k; ++b) timm_table.data[b * h + j] = table.data[j * k + b];
}

/// @brief The two log-spaced coordinate recipes of timm's `gen_relative_log_coords`.
enum class log_coords {
    swin,  ///< SwinV2: `sign(x)·log2(1 + |x|)/3` with x = 8·d/(W − 1) (or 8·d/(pretrained W − 1))
    cr,    ///< timm's "cr" variant: `sign(d)·ln(1 + |d|)`, no normalisation
};

/// @brief Options of relative_log_coords, by name: `{.pretrained_h = 12, .pretrained_w = 12}`.
struct log_coords_config {
    int pretrained_h = 0;                ///< pre-training window rows; 0 (with pretrained_w 0): normalise by this window
    int pretrained_w = 0;                ///< pre-training window columns
    log_coords mode = log_coords::swin;  ///< swin (SwinV2) or cr
};

/// @brief The SwinV2 continuous-position-bias coordinates of every bucket of `window`: a (K, 2)
/// row-major float32 array, K = (2Wh − 1)(2Ww − 1) in mapping::swin's bucket order, entry
/// (k, 0) for the row offset dr and (k, 1) for the column offset dc of bucket k.
///
/// swin mode, per axis with offset d and divisor n = pretrained − 1 when `pretrained_h > 0`, else
/// window − 1: `x = float(d) / float(n) * 8.0f`, `coord = sign(x) · log2f(1 + |x|) / 3.0f`, all in
/// float32 (values in [−1, 1] inside the pre-training window; a window larger than the
/// pre-training one extrapolates beyond). cr mode: `sign(d) · logf(1 + |d|)`.
/// Equal to timm's float32 results up to the rounding of the platform's log2f/logf (within 1 ulp
/// on the golden cases, tests/unit/test_vit_swin.cpp).
/// @throws rpe::invalid_argument `[rpe.log_coords] window_h = 1 with pretrained_h = 0 divides by
///   zero; ...` (swin mode needs each divisor ≥ 1: window ≥ 2 without a pre-training window),
///   `pretrained_h = ... / pretrained_w = ...` (both 0, or both ≥ 2), `mode = ...`, and the
///   window's own validation.
/// Source: Liu et al., "Swin Transformer V2" (CVPR 2022), eq. 4 (log-spaced coordinates);
/// timm `gen_relative_log_coords` (huggingface/pytorch-image-models `timm/layers/pos_embed_rel.py`)
/// and `WindowAttention._make_pair_wise_relative_positions` (`timm/models/swin_transformer_v2.py`).
inline std::vector<float> relative_log_coords(const mapping::swin& window, const log_coords_config& config = {}) {
    window.validate();
    detail::require_enum(config.mode, 2, "log_coords", "mode", "log_coords::swin or log_coords::cr");
    const int wh = window.window_h, ww = window.window_w;
    int nh = wh - 1, nw = ww - 1;
    if (config.mode == log_coords::swin) {
        const int ph = config.pretrained_h, pw = config.pretrained_w;
        const bool none = ph == 0 && pw == 0;
        detail::require(none || (ph >= 2 && pw >= 2 && ph <= 8192 && pw <= 8192), "log_coords", "pretrained_h = ", ph,
                        ", pretrained_w = ", pw, "; expected both 0 (normalise by the window) or both in [2, 8192]");
        if (!none) nh = ph - 1, nw = pw - 1;
        detail::require(nh >= 1, "log_coords", "window_h = ", wh, " with pretrained_h = 0 divides by zero (window_h - 1 = 0)",
                        "; expected window_h >= 2, or a pre-training window");
        detail::require(nw >= 1, "log_coords", "window_w = ", ww, " with pretrained_w = 0 divides by zero (window_w - 1 = 0)",
                        "; expected window_w >= 2, or a pre-training window");
    }
    const auto coord = [&](int d, int n) -> float {
        float y = 0.0f;
        if (config.mode == log_coords::cr) {
            y = std::log(1.0f + std::fabs(static_cast<float>(d)));
        } else {
            const float x = static_cast<float>(d) / static_cast<float>(n) * 8.0f;
            y = std::log2(1.0f + std::fabs(x)) / 3.0f;
        }
        return d > 0 ? y : (d < 0 ? -y : 0.0f);
    };
    std::vector<float> out(static_cast<std::size_t>(window.num_buckets()) * 2);
    std::size_t e = 0;
    for (int dr = -(wh - 1); dr <= wh - 1; ++dr)
        for (int dc = -(ww - 1); dc <= ww - 1; ++dc) {
            out[e++] = coord(dr, nh);
            out[e++] = coord(dc, nw);
        }
    return out;
}

/// @brief Configuration of a cpb_bias, by name: `{.num_heads = 4, .head_dim = 32, .pretrained_h = 12, .pretrained_w = 12}`.
struct cpb_config {
    int num_heads = 0;                   ///< H ≥ 1: the MLP's outputs per bucket
    int head_dim = 1;                    ///< D of the attention the term joins (checked there; the bias ignores it)
    bool sigmoid16 = true;               ///< table = 16·sigmoid(MLP output) (SwinV2); false: the output itself
    int pretrained_h = 0;                ///< pre-training window (log_coords_config), 0: this window
    int pretrained_w = 0;                ///< pre-training window columns
    log_coords mode = log_coords::swin;  ///< coordinate recipe
};

/// @brief SwinV2's continuous position bias: an rpe bias term on a Swin window whose (H, K) table is
/// made from the output of a user's MLP on the buckets' log-spaced coordinates.
///
/// Flow (timm `WindowAttention.forward` of swin_transformer_v2.py):
/// `raw = mlp(coords())` (K, H) — the MLP's output, timm's `cpb_mlp(relative_coords_table).view(-1, H)`;
/// `table[h, k] = 16·sigmoid(raw[k, h])` (or `raw[k, h]` without `sigmoid16`), (H, K);
/// `logits[b, h, i, j] += table[h, id(i, j)]`, id of mapping::swin on the window grid.
/// The term (term()) is an ordinary `rpe::term<mapping::swin, mode::bias, target::key, S>` with
/// per-head tables and no skip tokens, so the fused attention takes it as an rpe_k bias term
/// (`rpe::make_any_term(cpb.term())`, its table from make_table); the attention's table gradient
/// then goes through backward_table to the MLP's output, and from there through the user's MLP.
/// forward/backward run the single term on its own (they allocate the (H, K) table).
/// SwinV2's cosine attention (normalised q, k times a clamped logit scale) is the caller's: pass
/// q already normalised and scaled so that the attention's q·s·kᵀ is the cosine logit.
/// Errors: rpe::invalid_argument `[rpe.cpb] ...` naming the argument (shapes, null or overlapping
/// buffers), plus relative_log_coords' and the term's. Thread-safety: const members may run
/// concurrently on distinct outputs. Source: Liu et al., "Swin Transformer V2" (CVPR 2022), §3.3
/// eq. 3; timm `WindowAttention` in huggingface/pytorch-image-models `timm/models/swin_transformer_v2.py`.
template <class S = float>
class cpb_bias {
public:
    using term_type = rpe::term<mapping::swin, mode::bias, target::key, S>;  ///< the bias term it feeds

    /// @brief The bias of `window` with `config`. @throws as relative_log_coords and the term.
    cpb_bias(mapping::swin window, const cpb_config& config)
        : config_(config),
          term_(window,
                term_config{.num_heads = config.num_heads, .head_dim = config.head_dim, .shared_head = false, .skip = 0}) {
        const auto c = relative_log_coords(window, {config.pretrained_h, config.pretrained_w, config.mode});
        coords_.assign(c.begin(), c.end());
    }

    [[nodiscard]] const term_type& term() const { return term_; }                  ///< the Swin bias term
    [[nodiscard]] const mapping::swin& window() const { return term_.mapping(); }  ///< the window
    [[nodiscard]] int num_heads() const { return config_.num_heads; }              ///< H
    [[nodiscard]] int num_buckets() const { return term_.num_buckets(); }          ///< K = (2Wh−1)(2Ww−1)
    [[nodiscard]] const cpb_config& config() const { return config_; }             ///< the configuration
    /// @brief The MLP's input: (K, 2) coordinates (relative_log_coords, float32 values in S).
    [[nodiscard]] tensor_ref<const S> coords() const { return {coords_.data(), {num_buckets(), 2}}; }
    /// @brief The window's bucket ids (L = Wh·Ww), shared through `cache`. @throws as bucket_cache::get.
    [[nodiscard]] std::shared_ptr<const rpe::bucket_ids> bucket_ids(bucket_cache& cache = bucket_cache::global()) const {
        return term_.bucket_ids(window().window_h, window().window_w, cache);
    }

    /// @brief The (H, K) table from the MLP's output `raw` (K, H): `16·sigmoid(raw[k, h])` or `raw[k, h]`.
    /// @throws rpe::invalid_argument `[rpe.cpb] raw has shape ...; expected (K, H)` (likewise `table`
    ///   (H, K)), null or overlapping buffers.
    void make_table(tensor_ref<const S> raw, tensor_ref<S> table) const {
        check_raw(raw, "raw");
        check_table(table, "table");
        detail::check_no_overlap(table, raw, "cpb", "table", "raw");
        const std::int64_t k = num_buckets(), h = num_heads();
        for (std::int64_t b = 0; b < k; ++b)
            for (std::int64_t j = 0; j < h; ++j) table.data[j * k + b] = activate(raw.data[b * h + j]);
    }

    /// @brief Calls `mlp(coords(), raw)` — the user's MLP writes its (K, H) output into `raw` — then
    /// make_table(raw, table). `mlp`: any callable `void(tensor_ref<const S> coords, tensor_ref<S> raw)`.
    /// @throws as make_table (checked before the call), and what mlp throws.
    template <class Mlp>
    void make_table(Mlp&& mlp, tensor_ref<S> raw, tensor_ref<S> table) const {
        check_raw(raw, "raw");
        check_table(table, "table");
        detail::check_no_overlap(table, raw, "cpb", "table", "raw");
        std::forward<Mlp>(mlp)(coords(), raw);
        make_table(tensor_ref<const S>(raw), table);
    }

    /// @brief Gradient w.r.t. the MLP's output from the gradient of the (H, K) table:
    /// `grad_raw[k, h] (+)= grad_table[h, k] · 16·σ(raw[k, h])·(1 − σ(raw[k, h]))` (or `· 1`
    /// without sigmoid16); `mode` (required): write::overwrite (=) or write::accumulate (+=).
    /// @throws rpe::invalid_argument `[rpe.cpb] ...` as make_table.
    void backward_table(tensor_ref<const S> raw, tensor_ref<const S> grad_table, tensor_ref<S> grad_raw, write mode) const {
        detail::check_write_mode(mode);
        check_raw(raw, "raw");
        check_table(grad_table, "grad_table");
        check_raw(grad_raw, "grad_raw");
        detail::check_no_overlap(grad_raw, raw, "cpb", "grad_raw", "raw");
        detail::check_no_overlap(grad_raw, grad_table, "cpb", "grad_raw", "grad_table");
        const std::int64_t k = num_buckets(), h = num_heads();
        for (std::int64_t b = 0; b < k; ++b)
            for (std::int64_t j = 0; j < h; ++j) {
                const S g = grad_table.data[j * k + b] * derivative(raw.data[b * h + j]);
                S& dst = grad_raw.data[b * h + j];
                dst = mode == write::accumulate ? dst + g : g;
            }
    }

    /// @brief The bias on its own: `out[b, h, i, j] (+)= table[h, id(i, j)]`, out (Bo, H, L, L) or
    /// (Bo, 1, L, L) as the bias term, L = Wh·Ww, table from make_table(raw); `mode` (required):
    /// write::overwrite (=) or write::accumulate (+=), also for backward's grad_raw.
    /// @throws as make_table and term_type::forward.
    RPE_ISA_TAG void forward(const rpe::bucket_ids& ids, tensor_ref<const S> raw, tensor_ref<S> out, write mode) const {
        std::vector<S> table(static_cast<std::size_t>(num_heads()) * static_cast<std::size_t>(num_buckets()));
        make_table(raw, {table.data(), {num_heads(), num_buckets()}});
        term_.forward(ids, {table.data(), {num_heads(), num_buckets()}}, {}, out, mode);
    }

    /// @brief Backward of forward: `grad_raw` (K, H) of `sum(out · grad_out)`.
    /// @throws as backward_table and term_type::backward.
    RPE_ISA_TAG void backward(const rpe::bucket_ids& ids, tensor_ref<const S> raw, tensor_ref<const S> grad_out,
                              tensor_ref<S> grad_raw, write mode) const {
        check_raw(raw, "raw");
        check_raw(grad_raw, "grad_raw");
        const std::int64_t n = static_cast<std::int64_t>(num_heads()) * num_buckets();
        std::vector<S> table(static_cast<std::size_t>(n)), grad_table(static_cast<std::size_t>(n));
        make_table(raw, {table.data(), {num_heads(), num_buckets()}});
        term_.backward(ids, {table.data(), {num_heads(), num_buckets()}}, {}, grad_out, {},
                       {grad_table.data(), {num_heads(), num_buckets()}}, write::overwrite);
        backward_table(raw, {grad_table.data(), {num_heads(), num_buckets()}}, grad_raw, mode);
    }

private:
    [[nodiscard]] S sigmoid(S x) const { return S(1) / (S(1) + std::exp(-x)); }
    [[nodiscard]] S activate(S x) const { return config_.sigmoid16 ? S(16) * sigmoid(x) : x; }
    [[nodiscard]] S derivative(S x) const {
        if (!config_.sigmoid16) return S(1);
        const S s = sigmoid(x);
        return S(16) * s * (S(1) - s);
    }
    template <class T>
    void check_raw(const tensor_ref<T>& t, const char* name) const {
        detail::check_shape(t, {num_buckets(), num_heads()}, "cpb", name);
        detail::check_nonnull(t, "cpb", name);
    }
    template <class T>
    void check_table(const tensor_ref<T>& t, const char* name) const {
        detail::check_shape(t, {num_heads(), num_buckets()}, "cpb", name);
        detail::check_nonnull(t, "cpb", name);
    }

    cpb_config config_;
    term_type term_;
    std::vector<S> coords_;
};

}  // namespace rpe
