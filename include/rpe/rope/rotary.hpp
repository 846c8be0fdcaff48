/// @file rope/rotary.hpp
/// @brief rpe::rotary_embedding: a 2D rotary position embedding (RoPE) attached to q and k, its
/// checks and its cos/sin table (backend-neutral; the CPU rotation is backend/cpu/rope.hpp, the
/// fused attention applies it through rpe::attention_inputs::rope).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "../concepts.hpp"
#include "../detail/check.hpp"
#include "../detail/rope_key.hpp"
#include "../detail/single_flight.hpp"
#include "../error.hpp"
#include "axial.hpp"
#include "cat.hpp"
#include "custom.hpp"
#include "layout.hpp"
#include "mixed.hpp"
#include "mixed_init.hpp"
#include "../tensor.hpp"

namespace rpe {

/// @brief The form of a rotary embedding: none (std::monostate), rope::axial, rope::mixed
/// (frequencies from rotary_embedding::freqs), rope::cat, or rope::custom (any user-defined
/// fixed-frequency policy, e.g. `rope::custom{my_form{...}}`). The table cache keys a fixed form
/// by its policy's type and value (detail::rope_policy_base), so a new form adds nothing there.
using rope_form = std::variant<std::monostate, rope::axial, rope::mixed, rope::cat, rope::custom>;

/// @brief The rope_form that holds policy `p`: `p` itself for rope::axial, rope::mixed, rope::cat
/// and rope::custom, `rope::custom{p}` for any other fixed-frequency policy (rope::dinov3,
/// rope::mrope, a user's). With rpe::visit_rope: `r.form = rpe::visit_rope(spec, [](const auto& p)
/// { return rpe::rope_form_of(p); })`.
template <class P>
rope_form rope_form_of(const P& p) {
    if constexpr (std::is_same_v<P, rope::axial> || std::is_same_v<P, rope::mixed> || std::is_same_v<P, rope::cat> ||
                  std::is_same_v<P, rope::custom>)
        return rope_form(p);
    else
        return rope_form(rope::custom{p});
}

/// @brief A 2D rotary position embedding of q and k (B, H, L, D) on a height × width grid:
/// tokens `0 .. skip−1` (class, register tokens) are left unrotated, as rope-vit and timm's
/// EVA do; token `skip + t` sits at row `t div width`, column `t mod width` and its channel
/// pairs are rotated by the form's angle of the pair. `layout` (rope::layout) says which
/// channels pair j turns: `pairs` (the default) (2j, 2j+1), as complex numbers
/// `x_2j + i·x_2j+1`: `y_2j = c·x_2j − s·x_2j+1`, `y_2j+1 = s·x_2j + c·x_2j+1` (rope-vit's
/// complex product, timm's `x·cos + rot(x)·sin`); `half` (j, j + D/2), the rotate-half form
/// `y = x·cos + rotate_half(x)·sin` (DINOv3, Qwen2-VL).
/// @tparam S element type of the frequencies (float or double; rpe::bf16 on the CPU: storage, converted
/// to float to compute).
template <class S>
struct rotary_embedding {
    rope_form form;                             ///< std::monostate (no rotation) or a rope:: policy
    int skip = 0;                               ///< leading tokens left unrotated (>= 0)
    tensor_ref<const S> freqs = {};             ///< rope::mixed: (2, H, D/2) learned fx, fy; empty otherwise
    tensor_ref<S> grad_freqs = {};              ///< rope::mixed backward: (2, H, D/2), overwritten; empty = not wanted
    rope::layout layout = rope::layout::pairs;  ///< channel pairing: (2j, 2j+1), (j, j + D/2) or V-JEPA 2's (rope::vjepa2)
    /// Per-token positions instead of the grid: (N, A) float coordinates — integer or real — of
    /// the N = L − skip − queries_suffix() rotated tokens of q (and of x in the standalone rotation), in the
    /// form's coordinate frame (each policy's angle_at); A = rope_position_axes(form): 2 (row, col)
    /// for the 2D forms, 3 (t, h, w) for rope::mrope. Empty = the grid.
    tensor_ref<const float> positions = {};
    /// The fused attention's keys: (N_k, A) positions of the key tokens (e.g. another grid),
    /// N_k = L_k − skip − suffix; empty = the queries' (positions, or the grid).
    tensor_ref<const float> key_positions = {};
    /// Trailing tokens left unrotated (>= 0; SAM2's memory tokens): the keys', and the queries'
    /// unless query_suffix is set.
    int suffix = 0;
    /// Trailing unrotated tokens of the queries (and of x in the standalone rotation) when they
    /// differ from the keys': −1 (the default) = suffix. Cross-attention sets it: SAM2's queries
    /// (the current frame's grid, query_suffix = 0) attend to keys with suffix = the object-pointer
    /// tokens. Fused attention on the CPU (attention_capabilities::cross_lengths); the standalone
    /// rotation on both backends.
    int query_suffix = -1;

    /// @brief The queries' trailing unrotated tokens: query_suffix, or suffix when it is −1.
    [[nodiscard]] int queries_suffix() const { return query_suffix < 0 ? suffix : query_suffix; }

    /// @brief True unless the form is std::monostate.
    [[nodiscard]] bool enabled() const { return form.index() != 0; }
    /// @brief True for rope::mixed.
    [[nodiscard]] bool is_mixed() const { return std::holds_alternative<rope::mixed>(form); }
    /// @brief True when q (or x) or the keys take per-token positions.
    [[nodiscard]] bool has_positions() const { return positions.data != nullptr || key_positions.data != nullptr; }
};

/// @brief cos and sin of every (head, grid token, pair) angle: (Hr, N, D/2) each, Hr = 1 for the
/// fixed forms (shared by the heads) or H for rope::mixed, N = height·width; for rope::mixed
/// also the token coordinates t_x = col, t_y = row (N) that the frequency gradient needs.
template <class S>
struct rope_table {
    std::int64_t heads = 1, tokens = 0, pairs = 0;
    rope::layout layout = rope::layout::pairs;  ///< the channels of pair j (rotary_embedding::layout)
    std::vector<S> cos, sin;                    // (heads, tokens, pairs)
    std::vector<float> tx, ty;                  // (tokens): rope::mixed only
    /// @brief Offset of (head h of the call, grid token t, pair 0).
    [[nodiscard]] std::int64_t at(std::int64_t h, std::int64_t t) const { return ((heads == 1 ? 0 : h) * tokens + t) * pairs; }
};

/// @brief The number of axes of the per-token positions that `form` takes: 3 for a policy that
/// declares `position_axes = 3` (rope::mrope's (t, h, w), directly or through rope::custom),
/// else 2 (row, col).
inline int rope_position_axes(const rope_form& form) {
    return std::visit(
        [](const auto& p) {
            using P = std::remove_cvref_t<decltype(p)>;
            if constexpr (std::is_same_v<P, rope::custom>)
                return p.position_axes();
            else if constexpr (std::is_same_v<P, std::monostate>)
                return 2;
            else
                return detail::position_axes_of<P>();
        },
        form);
}

namespace detail {

/// @brief Checks a rotary embedding against (H, L, D) and the grid: the layout (rope::vjepa2 in
/// layout::vjepa2 only, and that layout for no other form), parameters of the policy,
/// skip >= 0, suffix >= 0, query_suffix >= −1, L = skip + height·width + the queries' suffix
/// (rotary_embedding::queries_suffix) and, for the fused attention's keys (`lk` ≥ 0: L_k),
/// L_k = skip + N_k + suffix, N_k the rows of key_positions, else the queries' token count (the
/// grid's or the positions'), a flat grid (depth 1), D a positive multiple of the
/// form's head_dim_multiple (and the policy's check_head_dim when it has one: rope::mrope's
/// sections sum to D/2), positions / key_positions (N, A) with A = rope_position_axes(form),
/// finite, and for rope::mixed freqs (2, H, D/2) non-null (grad_freqs, when given, is checked by
/// check_rope_gradient). `lk` < 0 (the standalone rotation): no keys, key_positions (when given)
/// as many as positions.
/// @throws rpe::invalid_argument `[rpe.<component>] rope ...` (`rope layout = pairs for a form that
///   runs in its own layout; expected rope::layout::vjepa2`; a position axis count other than
///   the form's: `rope positions has shape (N, 3); expected 2 axes (row, col)` or
///   `... (N, 2); expected 3 axes (t, h, w)`).
template <class S>
void check_rope(const rotary_embedding<S>& r, std::int64_t h, std::int64_t l, std::int64_t d, int depth, int height, int width,
                const char* component, std::int64_t lk = -1) {
    if (!r.enabled()) return;
    require(r.form.index() < std::variant_size_v<rope_form>, component, "rope form is valueless; expected a rope:: policy");
    require(r.layout == rope::layout::pairs || r.layout == rope::layout::half || r.layout == rope::layout::vjepa2, component,
            "rope layout = ", static_cast<int>(r.layout),
            "; expected rope::layout::pairs, rope::layout::half or rope::layout::vjepa2");
    // a form with a layout of its own (rope::vjepa2) runs in it alone, and that layout only with it
    const int required = std::visit(
        [](const auto& p) {
            using P = std::remove_cvref_t<decltype(p)>;
            if constexpr (std::is_same_v<P, rope::custom>)
                return p.required_layout();
            else if constexpr (std::is_same_v<P, std::monostate>)
                return -1;
            else
                return rope::required_layout_of<P>();
        },
        r.form);
    if (required >= 0)
        require(static_cast<int>(r.layout) == required, component, "rope layout = ", rope::layout_name(r.layout),
                " for a form that runs in its own layout; expected rope::layout::",
                rope::layout_name(static_cast<rope::layout>(required)), " (rope::default_layout_of)");
    else
        require(r.layout != rope::layout::vjepa2, component,
                "rope layout = vjepa2 for a form other than rope::vjepa2; expected pairs or half");
    std::visit(
        [&](const auto& p) {
            using P = std::remove_cvref_t<decltype(p)>;
            if constexpr (!std::is_same_v<P, std::monostate>) {
                p.validate();
                int multiple = 1;
                if constexpr (std::is_same_v<P, rope::custom>)
                    multiple = p.head_dim_multiple();
                else
                    multiple = P::head_dim_multiple;
                require(d >= multiple && d % multiple == 0, component, "rope needs head_dim D = ", d,
                        " to be a positive multiple of ", multiple);
                if constexpr (requires { p.check_head_dim(0); }) p.check_head_dim(static_cast<int>(d));  // mrope: sections vs D/2
            }
        },
        r.form);
    require(r.skip >= 0, component, "rope skip = ", r.skip, "; expected >= 0");
    require(r.suffix >= 0, component, "rope suffix = ", r.suffix, "; expected >= 0");
    require(r.query_suffix >= -1, component, "rope query_suffix = ", r.query_suffix, "; expected >= 0, or -1 for suffix");
    const int qsuffix = r.queries_suffix();
    if (lk < 0) lk = l - qsuffix + r.suffix;  // no keys (standalone rotation): key_positions as many as positions
    // the queries' rotated tokens, and the keys' (the same count unless at key_positions)
    const std::int64_t rotated = l - r.skip - qsuffix, rotated_k = lk - r.skip - r.suffix;
    // "suffix" in messages: the queries' count is named query_suffix when it is set apart
    const char* qs_name = r.query_suffix < 0 ? "suffix" : "query_suffix";
    if (r.has_positions()) {
        const bool fixed_has_at = std::visit(
            [](const auto& p) {
                using P = std::remove_cvref_t<decltype(p)>;
                if constexpr (std::is_same_v<P, rope::custom>)
                    return p.has_angle_at();
                else if constexpr (std::is_same_v<P, rope::mixed> || std::is_same_v<P, std::monostate>)
                    return true;
                else
                    return requires {
                        { p.angle_at(0.0f, 0.0f, 0, 4) } -> std::same_as<float>;
                    };
            },
            r.form);
        require(fixed_has_at, component,
                "rope positions are given for a form without angle_at(y, x, pair, head_dim); expected the grid");
        // the queries' and the keys' counts at their own positions (queries on the grid: the grid
        // check below; keys at the queries' positions: the count check below)
        if (r.positions.data != nullptr)
            require(rotated >= 1, component, "L = ", l, "; expected rope skip + ", qs_name, " = ", r.skip, " + ", qsuffix,
                    " below L (positions need rotated tokens)");
        if (r.key_positions.data != nullptr)
            require(rotated_k >= 1, component, "L_k = ", lk, "; expected rope skip + suffix = ", r.skip, " + ", r.suffix,
                    " below L_k (key_positions need rotated tokens)");
        const int axes = rope_position_axes(r.form);
        const auto check_positions = [&](const tensor_ref<const float>& p, const char* name, std::int64_t count) {
            if (p.data == nullptr && p.rank == 0) return;
            require(p.rank == 2 && p.extent(1) >= 2 && p.extent(1) <= 3, component, "rope ", name, " has shape ",
                    p.shape_string(), "; expected (tokens, ", axes, ") coordinates ", axes == 3 ? "(t, h, w)" : "(row, col)");
            if (axes == 2)
                require(p.extent(1) == 2, component, "rope ", name, " has shape ", p.shape_string(),
                        "; expected 2 axes (row, col), shape (", count, ", 2): the 2D forms take no third axis");
            else
                require(p.extent(1) == 3, component, "rope ", name, " has shape ", p.shape_string(),
                        "; expected 3 axes (t, h, w), shape (", count,
                        ", 3): this form (rope::mrope, rope::vjepa2) takes three position ids per token");
            check_shape(p, {count, axes}, component, (std::string("rope ") + name).c_str());
            check_nonnull(p, component, (std::string("rope ") + name).c_str());
            require(p.contiguous(), component, "rope ", name, " is a strided view; expected a contiguous buffer");
            for (std::int64_t i = 0; i < axes * count; ++i)
                require(std::isfinite(p.data[i]), component, "rope ", name, "[", i / axes, ", ", i % axes, "] = ", p.data[i],
                        "; expected finite");
        };
        check_positions(r.positions, "positions", rotated);
        check_positions(r.key_positions, "key_positions", rotated_k);
        if (r.positions.data == nullptr) {  // queries on the grid, keys at positions
            require(depth == 1, component, "rope needs a 2D grid; depth = ", depth, "; expected 1");
            require(height >= 1 && width >= 1, component, "rope grid height, width = ", height, ", ", width, "; expected >= 1");
            require(static_cast<std::int64_t>(height) * width == rotated, component, "L = ", l,
                    "; expected rope skip + height*width + ", qs_name, " = ", r.skip, " + ", height, "*", width, " + ", qsuffix);
        } else if (r.key_positions.data == nullptr) {  // keys at the queries' positions
            require(rotated_k == rotated, component, "L_k = ", lk, "; expected rope skip + N + suffix = ", r.skip, " + ", rotated,
                    " + ", r.suffix, " (the keys at the queries' positions; give key_positions for others)");
        }
    } else {
        require(depth == 1, component, "rope needs a 2D grid; depth = ", depth, "; expected 1");
        require(height >= 1 && width >= 1, component, "rope grid height, width = ", height, ", ", width, "; expected >= 1");
        if (qsuffix == 0 && l != r.skip + static_cast<std::int64_t>(height) * width)
            throw invalid_argument(
                message(component, "L = ", l, "; expected rope skip + height*width = ", r.skip, " + ", height, "*", width));
        if (qsuffix != 0 && l != r.skip + static_cast<std::int64_t>(height) * width + qsuffix)
            throw invalid_argument(message(component, "L = ", l, "; expected rope skip + height*width + ", qs_name, " = ", r.skip,
                                           " + ", height, "*", width, " + ", qsuffix));
        if (lk != r.skip + static_cast<std::int64_t>(height) * width + r.suffix)
            throw invalid_argument(message(component, "L_k = ", lk, "; expected rope skip + height*width + suffix = ", r.skip,
                                           " + ", height, "*", width, " + ", r.suffix,
                                           " (the keys on the queries' grid; give key_positions for others)"));
    }
    if (r.is_mixed()) {
        check_shape(r.freqs, {2, h, d / 2}, component, "rope freqs");
        check_nonnull(r.freqs, component, "rope freqs");
    } else {
        require(r.freqs.data == nullptr && r.freqs.rank == 0, component,
                "rope freqs is given for a fixed-frequency form; expected empty (only rope::mixed reads it)");
    }
}

/// @brief The checks of a standalone rotation (rpe::rope_forward / rope_backward on either
/// backend): x (B, H, L, D) non-null, the embedding against it (check_rope), grad_y (backward)
/// of x's shape, `out` (named `out_name`) of x's shape, non-null and separate from x, grad_y and
/// the frequencies. Returns the number of (batch, head) planes B·H.
/// @throws rpe::invalid_argument `[rpe.rope] ...`.
template <class S>
std::int64_t check_rope_call(const rotary_embedding<S>& r, int height, int width, const tensor_ref<const S>& x,
                             const tensor_ref<const S>* grad_y, const tensor_ref<S>& out, const char* out_name) {
    require(x.rank == 4, "rope", "x has shape ", x.shape_string(), "; expected (B, H, L, D)");
    const std::int64_t b = x.extent(0), h = x.extent(1), l = x.extent(2), d = x.extent(3);
    require(b >= 1 && h >= 1 && l >= 1 && d >= 1, "rope", "x has shape ", x.shape_string(), "; expected positive extents");
    check_nonnull(x, "rope", "x");
    check_rope(r, h, l, d, 1, height, width, "rope");
    if (grad_y) {
        check_shape(*grad_y, {b, h, l, d}, "rope", "grad_y");
        check_nonnull(*grad_y, "rope", "grad_y");
    }
    check_shape(out, {b, h, l, d}, "rope", out_name);
    check_nonnull(out, "rope", out_name);
    check_no_overlap(out, x, "rope", out_name, "x");
    if (grad_y) check_no_overlap(out, *grad_y, "rope", out_name, "grad_y");
    check_no_overlap(out, r.freqs, "rope", out_name, "rope freqs");
    require(r.key_positions.data == nullptr, "rope",
            "rope key_positions is given to a standalone rotation; expected "
            "positions (key_positions is the fused attention's)");
    return b * h;
}

/// @brief Checks rope grad_freqs when given (rope::mixed only): (2, H, D/2), non-null.
template <class S>
bool check_rope_gradient(const rotary_embedding<S>& r, std::int64_t h, std::int64_t d, const char* component) {
    if (r.grad_freqs.data == nullptr && r.grad_freqs.rank == 0) return false;
    require(r.is_mixed(), component, "rope grad_freqs is given for a fixed-frequency form; expected empty");
    check_shape(r.grad_freqs, {2, h, d / 2}, component, "rope grad_freqs");
    check_nonnull(r.grad_freqs, component, "rope grad_freqs");
    check_no_overlap(r.grad_freqs, r.freqs, component, "rope grad_freqs", "rope freqs");
    return true;
}

/// @brief The frequency-gradient checks of a standalone rope_backward (either backend):
/// check_rope_gradient, then grad_freqs separate from x, grad_y and grad_x. Returns whether the
/// frequencies' gradient is wanted. @throws rpe::invalid_argument `[rpe.rope] rope grad_freqs ...`.
template <class S>
bool check_rope_call_gradient(const rotary_embedding<S>& r, const tensor_ref<const S>& x, const tensor_ref<const S>& grad_y,
                              const tensor_ref<S>& grad_x) {
    if (!check_rope_gradient(r, x.extent(1), x.extent(3), "rope")) return false;
    check_no_overlap(r.grad_freqs, x, "rope", "rope grad_freqs", "x");
    check_no_overlap(r.grad_freqs, grad_y, "rope", "rope grad_freqs", "grad_y");
    check_no_overlap(r.grad_freqs, grad_x, "rope", "rope grad_freqs", "grad_x");
    return true;
}

/// @brief Builds the cos/sin table of a fixed-frequency policy (angles in float32, cos and sin
/// in double, then rounded to S). `p`: a RotaryPolicy, rope::custom or detail::rope_policy_base
/// (anything with the policies' angle()).
template <class S, class P>
rope_table<S> build_rope_table(const P& p, std::int64_t d, int height, int width) {
    rope_table<S> t;
    t.heads = 1;
    t.tokens = static_cast<std::int64_t>(height) * width;
    t.pairs = d / 2;
    t.cos.resize(static_cast<std::size_t>(t.tokens * t.pairs));
    t.sin.resize(t.cos.size());
    for (std::int64_t n = 0; n < t.tokens; ++n)
        for (std::int64_t j = 0; j < t.pairs; ++j) {
            const double a = p.angle(static_cast<int>(n / width), static_cast<int>(n % width), static_cast<int>(j),
                                     static_cast<int>(d), height, width);
            t.cos[static_cast<std::size_t>(n * t.pairs + j)] = static_cast<S>(std::cos(a));
            t.sin[static_cast<std::size_t>(n * t.pairs + j)] = static_cast<S>(std::sin(a));
        }
    return t;
}

/// @brief The table of rope::mixed from freqs (2, H, D/2) (checked by the caller) for `layout`.
template <class S>
rope_table<S> build_mixed_table(const tensor_ref<const S>& freqs, int height, int width,
                                rope::layout layout = rope::layout::pairs) {
    rope_table<S> t;
    t.layout = layout;
    t.heads = freqs.extent(1);
    t.pairs = freqs.extent(2);
    t.tokens = static_cast<std::int64_t>(height) * width;
    t.cos.resize(static_cast<std::size_t>(t.heads * t.tokens * t.pairs));
    t.sin.resize(t.cos.size());
    t.tx.resize(static_cast<std::size_t>(t.tokens));
    t.ty.resize(static_cast<std::size_t>(t.tokens));
    for (std::int64_t n = 0; n < t.tokens; ++n) {
        t.tx[static_cast<std::size_t>(n)] = static_cast<float>(n % width);
        t.ty[static_cast<std::size_t>(n)] = static_cast<float>(n / width);
    }
    const S* fx = freqs.data;
    const S* fy = freqs.data + t.heads * t.pairs;
    for (std::int64_t h = 0; h < t.heads; ++h)
        for (std::int64_t n = 0; n < t.tokens; ++n)
            for (std::int64_t j = 0; j < t.pairs; ++j) {
                // float32 as rope-vit (its frequencies are a float parameter; a double S keeps S)
                // (float cos/sin for float, as torch.polar in rope-vit)
                const std::int64_t f = h * t.pairs + j;
                const S a = rope::mixed::angle(static_cast<int>(n / width), static_cast<int>(n % width), fx[f], fy[f]);
                const auto e = static_cast<std::size_t>((h * t.tokens + n) * t.pairs + j);
                t.cos[e] = std::cos(a);
                t.sin[e] = std::sin(a);
            }
    return t;
}

/// @brief The table of `r` at per-token positions p (N, A) (row, col; or (t, h, w) for a 3-axis
/// form), checked by check_rope: heads 1 and the policy's angle_at for the fixed forms; heads H and the angle
/// `x·fx + y·fy` (rope::mixed::angle_at) for rope::mixed, with t_x = x, t_y = y for its
/// frequency gradient. Not cached itself: rope_position_table shares it through the RoPE cache.
template <class S>
rope_table<S> build_position_table(const rotary_embedding<S>& r, const tensor_ref<const float>& p, std::int64_t d) {
    rope_table<S> t;
    t.layout = r.layout;
    t.tokens = p.extent(0);
    t.pairs = d / 2;
    const float* pos = p.data;
    if (r.is_mixed()) {
        t.heads = r.freqs.extent(1);
        t.tx.resize(static_cast<std::size_t>(t.tokens));
        t.ty.resize(static_cast<std::size_t>(t.tokens));
        for (std::int64_t n = 0; n < t.tokens; ++n) {
            t.ty[static_cast<std::size_t>(n)] = pos[2 * n];
            t.tx[static_cast<std::size_t>(n)] = pos[2 * n + 1];
        }
    }
    t.cos.resize(static_cast<std::size_t>(t.heads * t.tokens * t.pairs));
    t.sin.resize(t.cos.size());
    if (r.is_mixed()) {
        const S* fx = r.freqs.data;
        const S* fy = r.freqs.data + t.heads * t.pairs;
        for (std::int64_t h = 0; h < t.heads; ++h)
            for (std::int64_t n = 0; n < t.tokens; ++n)
                for (std::int64_t j = 0; j < t.pairs; ++j) {
                    const std::int64_t f = h * t.pairs + j;
                    const S a = rope::mixed::angle_at(static_cast<S>(pos[2 * n]), static_cast<S>(pos[2 * n + 1]), fx[f], fy[f]);
                    const auto e = static_cast<std::size_t>((h * t.tokens + n) * t.pairs + j);
                    t.cos[e] = std::cos(a);
                    t.sin[e] = std::sin(a);
                }
        return t;
    }
    std::visit(
        [&](const auto& pol) {
            using P = std::remove_cvref_t<decltype(pol)>;
            if constexpr (!std::is_same_v<P, std::monostate> && !std::is_same_v<P, rope::mixed>) {
                constexpr bool two = requires {
                    { pol.angle_at(0.0f, 0.0f, 0, 4) } -> std::same_as<float>;
                };
                constexpr bool three = requires {
                    { pol.angle_at(0.0f, 0.0f, 0.0f, 0, 4) } -> std::same_as<float>;
                };
                if constexpr (std::is_same_v<P, rope::custom> || two || three) {
                    const int axes = rope_position_axes(r.form);
                    // as build_rope_table: the angle in float32, cos and sin in double
                    const auto angle = [&](const float* c, int j) -> double {
                        if constexpr (std::is_same_v<P, rope::custom>)
                            return axes == 3 ? pol.angle_at(c[0], c[1], c[2], j, static_cast<int>(d))
                                             : pol.angle_at(c[0], c[1], j, static_cast<int>(d));
                        else if constexpr (three)
                            return pol.angle_at(c[0], c[1], c[2], j, static_cast<int>(d));
                        else
                            return pol.angle_at(c[0], c[1], j, static_cast<int>(d));
                    };
                    for (std::int64_t n = 0; n < t.tokens; ++n)
                        for (std::int64_t j = 0; j < t.pairs; ++j) {
                            const double a = angle(pos + axes * n, static_cast<int>(j));
                            t.cos[static_cast<std::size_t>(n * t.pairs + j)] = static_cast<S>(std::cos(a));
                            t.sin[static_cast<std::size_t>(n * t.pairs + j)] = static_cast<S>(std::sin(a));
                        }
                }
            }
        },
        r.form);
    return t;
}

/// @brief Cache key of a table: the policy (type and value, type-erased: every parameter that
/// its operator== compares takes part; null for rope::mixed), S, D, the grid and the channel
/// layout (the table records it; its cos/sin are per pair either way), and for the tables built
/// from data (rope::mixed's learned frequencies, per-token positions) that data bit for bit.
struct rope_key {
    std::shared_ptr<const rope_policy_base> policy;  ///< the fixed form's policy; null for rope::mixed
    int scalar_bytes = 0;
    std::int64_t d = 0;
    int height = 0, width = 0;  ///< the grid; with positions, (tokens N, axes A) of the positions
    rope::layout layout = rope::layout::pairs;
    bool positions = false;           ///< at per-token positions (their values in data) instead of the grid
    std::vector<unsigned char> data;  ///< rope::mixed's freqs (2, H, D/2), then the positions (N, A): their bytes; else empty
    std::size_t data_hash = 0;        ///< hash of data (kept with it by add_data)
    /// @brief Appends `count` elements at `p` to data (their bytes) and updates data_hash.
    template <class T>
    void add_data(const T* p, std::int64_t count) {
        const auto* b = reinterpret_cast<const unsigned char*>(p);
        const std::size_t n = static_cast<std::size_t>(count) * sizeof(T);
        data.insert(data.end(), b, b + n);
        std::size_t h = data_hash ^ 0xcbf29ce484222325ULL;  // FNV-1a over 8-byte words, then the tail
        std::size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            std::uint64_t w = 0;
            std::memcpy(&w, b + i, 8);
            h = (h ^ static_cast<std::size_t>(w)) * 0x100000001b3ULL;
        }
        for (; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
        data_hash = h;
    }
    friend bool operator==(const rope_key& a, const rope_key& b) {
        if (a.scalar_bytes != b.scalar_bytes || a.d != b.d || a.height != b.height || a.width != b.width ||
            a.layout != b.layout || a.positions != b.positions || a.data_hash != b.data_hash || a.data != b.data)
            return false;
        if (!a.policy || !b.policy) return !a.policy && !b.policy && !a.data.empty();  // rope::mixed: its freqs
        return a.policy == b.policy || a.policy->equals(*b.policy);
    }
};
/// @brief Hash of a rope_key: the policy's type, the sizes and the data's hash (equal policy
/// types are told apart by ==).
struct rope_key_hash {
    std::size_t operator()(const rope_key& k) const noexcept {
        std::size_t h = k.policy ? k.policy->type().hash_code() : 0;
        auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
        mix(std::hash<std::int64_t>{}(k.d));
        mix(static_cast<std::size_t>(k.scalar_bytes));
        mix(static_cast<std::size_t>(k.height));
        mix(static_cast<std::size_t>(k.width));
        mix(static_cast<std::size_t>(k.layout));
        mix(static_cast<std::size_t>(k.positions));
        mix(k.data_hash);
        return h;
    }
};

/// @brief A key of S, D, the grid and r.layout, without policy or data.
template <class S>
rope_key sized_rope_key(const rotary_embedding<S>& r, std::int64_t d, int height, int width) {
    rope_key key;
    key.scalar_bytes = static_cast<int>(sizeof(S));
    key.d = d;
    key.height = height;
    key.width = width;
    key.layout = r.layout;
    return key;
}

/// @brief The cache key of a fixed-form table of `r` (not rope::mixed) for element type S, D and
/// the grid (and r.layout): the key of rope_table_of's host cache and of the CUDA backend's device copies.
/// @throws rpe::invalid_argument `[rpe.rope] no fixed table for this form` for none or rope::mixed.
template <class S>
rope_key rope_key_of(const rotary_embedding<S>& r, std::int64_t d, int height, int width) {
    rope_key key = sized_rope_key<S>(r, d, height, width);
    std::visit(
        [&](const auto& p) {
            using P = std::remove_cvref_t<decltype(p)>;
            if constexpr (std::is_same_v<P, rope::custom>)
                key.policy = p.policy();
            else if constexpr (RotaryPolicy<P>)
                key.policy = std::make_shared<const rope_policy_value<P>>(p);
        },
        r.form);
    require(key.policy != nullptr, "rope", "no fixed table for this form");
    return key;
}

/// The process-wide cache of RoPE tables (like rpe::bucket_cache for bucket ids), within a
/// byte budget (default_cache_budget(); rpe::set_cache_budget), least recently used out first.
inline single_flight_cache<rope_key, std::shared_ptr<const void>, rope_key_hash>& rope_cache() {
    static single_flight_cache<rope_key, std::shared_ptr<const void>, rope_key_hash> cache;
    return cache;
}

/// @brief The table of `key` from rope_cache(), made by `build()` (a rope_table<S>) on first use;
/// it counts its cos/sin (and t_x, t_y) and the key's data against the budget.
template <class S, class Build>
std::shared_ptr<const rope_table<S>> cached_rope_table(const rope_key& key, Build&& build) {
    std::size_t bytes = 0;  // of the table built by this call (the budget's count)
    auto v = rope_cache().get_or_build(
        key,
        [&]() -> std::shared_ptr<const void> {
            auto t = std::make_shared<const rope_table<S>>(build());
            bytes = (t->cos.size() + t->sin.size()) * sizeof(S) + (t->tx.size() + t->ty.size()) * sizeof(float) + key.data.size();
            return t;
        },
        [&](const std::shared_ptr<const void>&) { return bytes; });
    return std::static_pointer_cast<const rope_table<S>>(v);
}

/// @brief The cache key of the table of `r` at per-token positions p (N, A) (checked by
/// check_rope: contiguous, finite), or of rope::mixed on the grid (p null): the fixed form's
/// policy (null for rope::mixed), S, D, the layout, the grid or (N, A), and as data the
/// frequencies (rope::mixed, (2, H, D/2)) and the positions, bit for bit.
template <class S>
rope_key rope_data_key_of(const rotary_embedding<S>& r, std::int64_t d, int height, int width, const tensor_ref<const float>* p) {
    rope_key key = sized_rope_key<S>(r, d, height, width);
    if (r.is_mixed())
        key.add_data(r.freqs.data, 2 * r.freqs.extent(1) * r.freqs.extent(2));
    else
        key = rope_key_of(r, d, height, width);
    if (p) {
        key.positions = true;
        key.height = static_cast<int>(p->extent(0));
        key.width = static_cast<int>(p->extent(1));
        key.add_data(p->data, p->extent(0) * p->extent(1));
    }
    return key;
}

}  // namespace detail

/// @brief The cos/sin table of `r` for heads H, head dim D and a height × width grid, built once
/// and shared through a thread-safe cache within its byte budget (as bucket ids): the fixed
/// forms' per (policy, D, grid, S, layout); rope::mixed's per (frequency values `r.freqs`, D,
/// grid, S, layout): the frequencies are learned, so new values (a training step) make a new
/// entry and the unused ones leave the cache least recently used first.
/// @pre r checked by detail::check_rope; r.enabled().
template <class S>
std::shared_ptr<const rope_table<S>> rope_table_of(const rotary_embedding<S>& r, std::int64_t d, int height, int width) {
    if (r.is_mixed())
        return detail::cached_rope_table<S>(detail::rope_data_key_of(r, d, height, width, nullptr),
                                            [&] { return detail::build_mixed_table(r.freqs, height, width, r.layout); });
    const detail::rope_key key = detail::rope_key_of(r, d, height, width);
    return detail::cached_rope_table<S>(key, [&] {
        auto built = detail::build_rope_table<S>(*key.policy, d, height, width);
        built.layout = key.layout;
        return built;
    });
}

/// @brief The embedding of the queries alone (key_positions dropped): what a standalone
/// rotation of q applies.
template <class S>
rotary_embedding<S> query_rope(rotary_embedding<S> r) {
    r.key_positions = {};
    return r;
}
/// @brief The embedding of the keys alone: their key_positions (when given) as positions.
template <class S>
rotary_embedding<S> key_rope(rotary_embedding<S> r) {
    if (r.key_positions.data != nullptr) r.positions = r.key_positions;
    r.key_positions = {};
    r.query_suffix = -1;  // the keys' suffix
    return r;
}

/// @brief The table of `r` at per-token positions p (N, A) (r.positions or r.key_positions,
/// checked by detail::check_rope): detail::build_position_table, shared through the cache of
/// rope_table_of per (form, positions' values, D, S, layout; rope::mixed: with its frequency
/// values), so the layers of a model that share the positions share one table.
/// @pre r checked by detail::check_rope; r.enabled().
template <class S>
std::shared_ptr<const rope_table<S>> rope_position_table(const rotary_embedding<S>& r, const tensor_ref<const float>& p,
                                                         std::int64_t d) {
    return detail::cached_rope_table<S>(detail::rope_data_key_of(r, d, 0, 0, &p),
                                        [&] { return detail::build_position_table(r, p, d); });
}

/// @brief The table that rotates the queries (or x of a standalone rotation): at
/// `r.positions` when given (rope_position_table), else the grid's (rope_table_of).
/// @pre r checked by detail::check_rope; r.enabled().
template <class S>
std::shared_ptr<const rope_table<S>> rope_query_table(const rotary_embedding<S>& r, std::int64_t d, int height, int width) {
    if (r.positions.data != nullptr) return rope_position_table(r, r.positions, d);
    return rope_table_of(r, d, height, width);
}

/// @brief The table that rotates the keys of the fused attention: at `r.key_positions` when
/// given (rope_position_table), else the queries' table `query`.
template <class S>
std::shared_ptr<const rope_table<S>> rope_key_table(const rotary_embedding<S>& r, std::int64_t d,
                                                    const std::shared_ptr<const rope_table<S>>& query) {
    if (r.key_positions.data != nullptr) return rope_position_table(r, r.key_positions, d);
    return query;
}

}  // namespace rpe
