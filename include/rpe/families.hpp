/// @file families.hpp
/// @brief The built-in term families by name and the visitors over them: every mapping (the iRPE
/// methods, 1D Shaw and T5, 3D product, Swin, BEiT, SwinV2 CPB, SAM decomposed, 2D ALiBi) and every
/// RoPE form (axial, mixed, cat, dinov3, mrope, vjepa2, sam2), in rpe::registry. This file is the one place a built-in family's
/// name is written.
///
/// - rpe::parse_family_spec / rpe::to_string: a spec from and to text (`product:index=clip,beta=4`).
/// - rpe::visit_mapping(spec, grid, f): `f(m)` with the concrete mapping value of `spec` (a
///   built-in mapping type, or rpe::registered_mapping for a family added at run time);
///   rpe::term_of and rpe::bucket_ids_of take both, so one generic `f` serves every family.
/// - rpe::visit_rope(spec, f): `f(form)` with rope::axial, rope::mixed, rope::cat, rope::dinov3,
///   rope::mrope or rope::vjepa2 (sam2 is rope::axial with θ = 10000; rpe::rope_form_of makes a rotary_embedding's form of it, rope::default_layout_of
///   gives its reference layout).
/// - rpe::register_mapping / RPE_REGISTER_MAPPING: a user's own mapping policy, by name, from a
///   unit of the user's program or plugin (docs/custom_mapping.md).
///
/// Build cost: visit_mapping instantiates its visitor for every built-in mapping type; programs
/// that build terms by name link rpe::make_term (see <rpe/make_term.hpp>).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "any_term.hpp"
#include "build_bucket_ids.hpp"
#include "concepts.hpp"
#include "error.hpp"
#include "index/clip.hpp"
#include "index/piecewise.hpp"
#include "mapping/beit.hpp"
#include "mapping/cross.hpp"
#include "mapping/euclidean.hpp"
#include "mapping/product.hpp"
#include "mapping/product3d.hpp"
#include "mapping/quantization.hpp"
#include "mapping/shaw.hpp"
#include "mapping/swin.hpp"
#include "mapping/t5.hpp"
#include "registry.hpp"
#include "rope/axial.hpp"
#include "rope/cat.hpp"
#include "rope/dinov3.hpp"
#include "rope/mixed.hpp"
#include "rope/mrope.hpp"
#include "rope/vjepa2.hpp"
#include "vit/alibi_2d.hpp"
#include "vit/decomposed_rel_pos.hpp"

namespace rpe {

/// @brief The built-in families, in registry order (rpe::registry::entry::builtin).
// clang-format off
enum class builtin_family : int {
    euclidean, quantization, cross, product, euclidean_paper, quantization_paper,  // iRPE (rpe::method order)
    shaw, t5, product3d, swin, beit, swinv2, decomposed, alibi2d,                  // other mappings
    axial, mixed, cat, dinov3, mrope, vjepa2, sam2,                                // RoPE forms
};
// clang-format on

/// @brief Mode, target and shape of a run-time term, besides its mapping.
struct term_options {
    bool contextual = true;            ///< contextual (true) or bias (false) mode
    rpe::target target = target::key;  ///< q, k or v
    int num_heads = 1;                 ///< H
    int head_dim = 1;                  ///< D
    bool shared_head = true;           ///< one table for all heads
    int skip = 0;                      ///< extra tokens before the grid
};

/// @brief A mapping added at run time (rpe::register_mapping), as rpe::visit_mapping hands it to a
/// visitor: its registry entry, spec and grid. rpe::term_of and rpe::bucket_ids_of take it.
struct registered_mapping {
    std::shared_ptr<const registry::entry> entry;  ///< the family's operations
    family_spec spec;                              ///< its parameters
    grid_extent grid;                              ///< the grid (0 × 0: not known)
};

namespace detail {

inline std::vector<family_param> irpe_params() {
    return {family_param::choice("index", {"piecewise", "clip"}, "index function: piecewise (eq. 18) or clip (Shaw)"),
            family_param::number("alpha", 1.9, "alpha of the piecewise index"),
            family_param::number("beta", 3.8, "beta: piecewise cap, clip range"),
            family_param::number("gamma", 15.2, "gamma of the piecewise index")};
}

inline std::vector<family_param> window_params(const char* what) {
    return {family_param::integer("window_h", 0, std::string(what) + " rows (0 = the grid)"),
            family_param::integer("window_w", 0, std::string(what) + " columns (0 = the grid)")};
}

/// Adds the built-in families (registry order = rpe::builtin_family).
// (not formatted: the registry reads as a table, one family per entry)
// clang-format off
inline void add_builtin_families(registry& r) {
    const family_terms all{}, bias_k{.bias = true, .contextual = false, .key_only = true},
        contextual_k{.bias = false, .contextual = true, .key_only = true};
    auto add = [&](builtin_family id, family_info info) {
        registry::entry e;
        e.info = std::move(info);
        e.builtin = static_cast<int>(id);
        r.add(std::move(e));
    };
    const auto irpe = [&](builtin_family id, const char* name, std::vector<family_alias> aliases, const char* summary,
                          const char* group, int tables) {
        add(id, {name, std::move(aliases), irpe_params(), summary, family_kind::mapping, group, all, tables});
    };
    irpe(builtin_family::euclidean, "euclidean", {{"euc", {}}}, "iRPE Euclidean (rounded distance; reference id 0)", "irpe", 1);
    irpe(builtin_family::quantization, "quantization", {{"quant", {}}}, "iRPE Quantization (squared distance; id 1)", "irpe", 1);
    irpe(builtin_family::cross, "cross", {}, "iRPE Cross (rows and columns tables; ids 41, 42)", "irpe", 2);
    irpe(builtin_family::product, "product", {}, "iRPE Product (id 3)", "irpe", 1);
    irpe(builtin_family::euclidean_paper, "euclidean_paper", {}, "iRPE Euclidean, unrounded distance", "irpe_paper", 1);
    irpe(builtin_family::quantization_paper, "quantization_paper", {}, "iRPE Quantization, eq. 21 rank", "irpe_paper", 1);
    add(builtin_family::shaw, {"shaw", {}, {family_param::integer("k", 16, "clipping distance (2k+1 buckets)")},
                               "1D Shaw et al. (use a 1xL grid)", family_kind::mapping, "1d", all, 1});
    add(builtin_family::t5, {"t5", {{"t5_causal", {{"bidirectional", 0.0}}}},
                             {family_param::integer("buckets", 32, "number of buckets"),
                              family_param::integer("max_distance", 128, "distance from which the last bucket is shared"),
                              family_param::flag("bidirectional", true, "encoder (true) or causal decoder (false)")},
                             "1D T5 (use a 1xL grid)", family_kind::mapping, "1d", all, 1});
    add(builtin_family::product3d,
        {"product3d", {},
         {family_param::choice("index", {"piecewise", "clip"}, "index function of the three axes"),
          family_param::number("alpha_t", 1.9, "alpha of the frame axis"), family_param::number("beta_t", 3.8, "beta of the frame axis"),
          family_param::number("gamma_t", 15.2, "gamma of the frame axis"), family_param::number("alpha", 1.9, "alpha of rows and columns"),
          family_param::number("beta", 3.8, "beta of rows and columns"), family_param::number("gamma", 15.2, "gamma of rows and columns")},
         "3D product (frames x rows x columns)", family_kind::mapping, "3d", all, 1});
    add(builtin_family::swin, {"swin", {}, window_params("window"), "Swin window bias", family_kind::mapping, "vit", all, 1});
    add(builtin_family::beit, {"beit", {}, window_params("patch grid"), "BEiT (3 class-token buckets)", family_kind::mapping, "vit", all, 1});
    auto v2 = window_params("window");
    v2.push_back(family_param::integer("pretrained_h", 0, "pre-training window rows of the log coordinates (0 = none)"));
    v2.push_back(family_param::integer("pretrained_w", 0, "pre-training window columns (0 = none)"));
    v2.push_back(family_param::flag("sigmoid16", true, "table = 16*sigmoid(MLP output)"));
    add(builtin_family::swinv2, {"swinv2", {}, std::move(v2), "SwinV2 continuous position bias (Swin ids, CPB table)",
                                 family_kind::mapping, "vit", all, 1});
    add(builtin_family::decomposed, {"decomposed", {{"sam", {}}}, window_params("grid"),
                                     "SAM/MViTv2 decomposed rel pos: cross, clip index, beta = max(H, W) - 1",
                                     family_kind::mapping, "vit", contextual_k, 2});
    add(builtin_family::alibi2d, {"alibi2d", {{"alibi", {}}}, window_params("grid"),
                                  "CROMA's 2D ALiBi: product, clip index, beta = max(H, W) - 1, fixed table",
                                  family_kind::mapping, "vit", bias_k, 1});
    add(builtin_family::axial, {"axial", {}, {family_param::number("theta", 100.0, "base of the frequencies")},
                                "rope-vit RoPE-Axial", family_kind::rope, "rope", all, 0});
    add(builtin_family::mixed, {"mixed", {}, {}, "rope-vit RoPE-Mixed", family_kind::rope, "rope", all, 0});
    add(builtin_family::cat, {"cat", {},
                              {family_param::number("temperature", 10000.0, "band base (without in_pixels)"),
                               family_param::flag("in_pixels", false, "pixel bands and [-1, 1] coordinates"),
                               family_param::number("max_res", 224.0, "in_pixels: highest resolution of the bands"),
                               family_param::flag("linear_bands", false, "in_pixels: linearly spaced bands"),
                               family_param::number("grid_offset", 0.0, "added to the integer coordinates"),
                               family_param::integer("ref_height", 0, "reference grid rows (0 = none)"),
                               family_param::integer("ref_width", 0, "reference grid columns (0 = none)"),
                               family_param::flag("xy_indexing", false, "grid_indexing 'xy'")},
                              "timm RotaryEmbeddingCat", family_kind::rope, "rope", all, 0});
    // DINOv3's released models: base 100, no min/max periods, separate normalisation, no augmentation
    add(builtin_family::dinov3, {"dinov3", {},
                                 {family_param::number("base", 100.0, "period base (timm's temperature; used unless min_period and max_period)"),
                                  family_param::number("min_period", 0.0, "with max_period: the min/max period schedule (0 = none)"),
                                  family_param::number("max_period", 0.0, "with min_period (0 = none)"),
                                  family_param::choice("normalize", {"separate", "max", "min"}, "coordinate normalisation (normalize_coords)"),
                                  family_param::number("shift_y", 0.0, "sampled coordinate shift of the rows (shift_hw)"),
                                  family_param::number("shift_x", 0.0, "sampled coordinate shift of the columns"),
                                  family_param::number("jitter_y", 1.0, "sampled jitter multiplier of the rows (jitter_hw)"),
                                  family_param::number("jitter_x", 1.0, "sampled jitter multiplier of the columns"),
                                  family_param::number("rescale", 1.0, "sampled rescale multiplier of both axes")},
                                 "DINOv3 RoPE", family_kind::rope, "rope", all, 0});
    // Qwen2-VL's (and Qwen2.5-VL's) configuration: rope_theta 1e6, mrope_section [16, 24, 24]
    add(builtin_family::mrope, {"mrope", {},
                                {family_param::number("theta", 1000000.0, "rope_theta"),
                                 family_param::integer("section_t", 16, "frequency pairs on the temporal ids (mrope_section[0])"),
                                 family_param::integer("section_h", 24, "frequency pairs on the height ids (mrope_section[1])"),
                                 family_param::integer("section_w", 24, "frequency pairs on the width ids (mrope_section[2])"),
                                 family_param::flag("interleaved", false, "Qwen3-VL's interleaved sections")},
                                "Qwen-VL M-RoPE", family_kind::rope, "rope", all, 0});
    // V-JEPA 2: theta fixed at 10000 in the source
    add(builtin_family::vjepa2, {"vjepa2", {}, {family_param::number("theta", 10000.0, "frequency base")},
                                 "V-JEPA 2 3D RoPE (frame, row, col)", family_kind::rope, "rope", all, 0});
    // SAM2's memory attention: rope::axial with theta 10000 (keys at the query grid repeated, a suffix unrotated)
    add(builtin_family::sam2, {"sam2", {}, {family_param::number("theta", 10000.0, "base of the frequencies (rope_theta)")},
                               "SAM2 memory-attention RoPE (axial, theta 10000)", family_kind::rope, "rope", all, 0});
}
// clang-format on

/// The window or grid of a ViT family: the parameter, or the grid when it is 0.
inline std::pair<int, int> side_or_grid(const family_spec& s, grid_extent g) {
    const int h = s.get_int("window_h"), w = s.get_int("window_w");
    if (h > 0 || w > 0) return {h, w};
    require(g.height > 0 && g.width > 0, "term_spec", "window_h = 0 of ", s.family,
            ": the grid was not given; expected window_h and window_w, or a grid");
    return {g.height, g.width};
}

/// Calls f with the index function of `s` (piecewise or clip; prefix p for product3d's time axis).
template <class F>
decltype(auto) with_index(const family_spec& s, const char* suffix, F&& f) {
    const std::string a = std::string("alpha") + suffix, b = std::string("beta") + suffix, c = std::string("gamma") + suffix;
    if (s.get_int("index") == 1) return f(index::clip{s.get(b)});
    return f(index::piecewise{s.get(a), s.get(b), s.get(c)});
}

/// THE hookup from a mapping value to a run-time term: its id source and the shared CPU drivers.
template <class S, GridMapping M>
std::unique_ptr<any_term<S>> runtime_term_of(const M& m, const term_options& o) {
    return make_runtime_term<S>(std::make_shared<id_source_for<M>>(m), num_tables_of<M>(), o.contextual, o.target, o.num_heads,
                                o.head_dim, o.shared_head, o.skip);
}

}  // namespace detail

namespace detail {

/// The process-wide registry with the built-ins added, without reporting failures recorded at
/// load (what a registration itself uses: it must not throw an earlier plugin's failure).
inline registry& registry_with_builtins() {
    registry& r = registry::global();
    r.ensure(&detail::add_builtin_families);
    return r;
}

}  // namespace detail

/// @brief The process-wide registry with the built-in families added.
/// @throws rpe::invalid_argument `[rpe.registry] name = '...'; already registered (...)` once, when
///   a mapping registered at load (RPE_REGISTER_MAPPING in a unit linked into the program, or a
///   plugin whose loader did not call registry::take_load_errors) was refused since the last report.
inline registry& families() {
    registry& r = detail::registry_with_builtins();
    r.throw_load_errors();
    return r;
}

/// @brief Parses `family[:param=value,...]` (a mapping, or a RoPE form with kind = rope); an alias
/// gives its family with the alias's presets.
/// @throws rpe::invalid_argument `[rpe.term_spec] family = '...'; expected one of ...` and
///   `[rpe.term_spec] <param> = '...'; expected ...`.
inline family_spec parse_family_spec(std::string_view text, family_kind kind = family_kind::mapping) {
    return families().parse(text, kind);
}

/// @brief `family:param=value,...` with every parameter; parse_family_spec reads it back equal.
inline std::string to_string(const family_spec& s) { return families().print(s); }

/// @brief The built-in family of `s`, or -1 for a family added at run time.
/// @throws as parse_family_spec for an unknown family.
inline int builtin_of(const family_spec& s) {
    const auto e = families().find(s.family);
    if (!e) (void)families().defaults(s.family);  // throws, listing the names
    return e->builtin;
}

/// @brief The registry entry (description) of the family named `name` (or an alias).
/// @throws as parse_family_spec.
inline const family_info& family_of(std::string_view name, family_kind kind = family_kind::mapping) {
    const auto e = families().find(name);
    if (!e || e->info.kind != kind) (void)families().defaults(name, kind);
    return e->info;
}

/// @brief Calls `f(m)` with the mapping value of `s` on grid `g` (needed by the families whose
/// window or β follows the grid when not given: swin, beit, swinv2, decomposed, alibi2d). A family
/// added at run time gives an rpe::registered_mapping. Every call of f must return the same type.
/// @throws rpe::invalid_argument `[rpe.term_spec] ...` for an unknown family, a RoPE form, or a
///   grid-dependent family without window and grid; the mapping's own errors come from where it
///   is used (rpe::term_of, rpe::bucket_ids_of validate it).
template <class F>
decltype(auto) visit_mapping(const family_spec& s, grid_extent g, F&& f) {
    const auto e = families().find(s.family);
    if (!e || e->info.kind != family_kind::mapping) (void)families().defaults(s.family);
    if (e->builtin < 0) return f(registered_mapping{e, s, g});
    using B = builtin_family;
    switch (static_cast<B>(e->builtin)) {
        case B::euclidean:
            return detail::with_index(s, "", [&](auto i) -> decltype(auto) { return f(mapping::euclidean<decltype(i)>{i}); });
        case B::quantization:
            return detail::with_index(s, "", [&](auto i) -> decltype(auto) { return f(mapping::quantization<decltype(i)>{i}); });
        case B::cross:
            return detail::with_index(s, "", [&](auto i) -> decltype(auto) { return f(mapping::cross<decltype(i)>{i}); });
        case B::product:
            return detail::with_index(s, "", [&](auto i) -> decltype(auto) { return f(mapping::product<decltype(i)>{i}); });
        case B::euclidean_paper:
            return detail::with_index(s, "",
                                      [&](auto i) -> decltype(auto) { return f(mapping::euclidean_paper<decltype(i)>{i}); });
        case B::quantization_paper:
            return detail::with_index(s, "",
                                      [&](auto i) -> decltype(auto) { return f(mapping::quantization_paper<decltype(i)>{i}); });
        case B::shaw: return f(mapping::shaw{.k = s.get_int("k")});
        case B::t5:
            return f(mapping::t5{.buckets = s.get_int("buckets"),
                                 .max_distance = s.get_int("max_distance"),
                                 .bidirectional = s.get("bidirectional") != 0});
        case B::product3d:
            return detail::with_index(s, "_t", [&](auto t) -> decltype(auto) {
                using I = decltype(t);
                const I rc = detail::with_index(s, "", [](auto i) {
                    if constexpr (std::is_same_v<decltype(i), I>)
                        return i;
                    else
                        return I{};  // never: one index kind for the three axes
                });
                return f(mapping::product3d<I, I, I>{t, rc, rc});
            });
        case B::swin:
        case B::swinv2: {
            const auto [h, w] = detail::side_or_grid(s, g);
            return f(mapping::swin{.window_h = h, .window_w = w});
        }
        case B::beit: {
            const auto [h, w] = detail::side_or_grid(s, g);
            return f(mapping::beit{.window_h = h, .window_w = w});
        }
        case B::decomposed: {
            const auto [h, w] = detail::side_or_grid(s, g);
            return f(vit::decomposed_rel_pos_mapping(h, w));
        }
        case B::alibi2d: {
            const auto [h, w] = detail::side_or_grid(s, g);
            return f(vit::alibi_2d_mapping(h, w));
        }
        default: break;
    }
    throw invalid_argument(detail::message("term_spec", "family = '", s.family, "' is a RoPE form; expected a mapping"));
}

/// @brief Calls `f(form)` with the RoPE policy of `s` (rope::axial, rope::mixed, rope::cat,
/// rope::dinov3, rope::mrope, rope::vjepa2; sam2 gives rope::axial with its theta; the parameters as the fields of the same name, dinov3's normalize as
/// rope::dinov3_normalize). Every call of f must return the same type. The values are not checked
/// beyond their kinds: the policy's validate() does (rpe::rope_forward calls it).
/// rpe::rope_form_of(form) is the rotary_embedding form of it (rope::custom for dinov3, mrope and
/// vjepa2), rope::default_layout_of(form) its reference layout (half for dinov3 and mrope, vjepa2
/// for vjepa2, else pairs).
/// @throws rpe::invalid_argument `[rpe.term_spec] form = '...'; expected one of axial, mixed, cat, ...`.
template <class F>
decltype(auto) visit_rope(const family_spec& s, F&& f) {
    const auto e = families().find(s.family);
    if (!e || e->info.kind != family_kind::rope || e->builtin < 0) (void)families().defaults(s.family, family_kind::rope);
    const auto num = [&](const char* name) { return static_cast<float>(s.get(name)); };
    using B = builtin_family;
    switch (static_cast<B>(e->builtin)) {
        case B::axial: return f(rope::axial{.theta = num("theta")});
        case B::mixed: return f(rope::mixed{});
        case B::dinov3:
            return f(rope::dinov3{.base = num("base"),
                                  .min_period = num("min_period"),
                                  .max_period = num("max_period"),
                                  .normalize = static_cast<rope::dinov3_normalize>(s.get_int("normalize")),
                                  .shift_y = num("shift_y"),
                                  .shift_x = num("shift_x"),
                                  .jitter_y = num("jitter_y"),
                                  .jitter_x = num("jitter_x"),
                                  .rescale = num("rescale")});
        case B::vjepa2: return f(rope::vjepa2{.theta = num("theta")});
        case B::sam2: return f(rope::axial{.theta = num("theta")});
        case B::mrope:
            return f(rope::mrope{.theta = num("theta"),
                                 .section_t = s.get_int("section_t"),
                                 .section_h = s.get_int("section_h"),
                                 .section_w = s.get_int("section_w"),
                                 .interleaved = s.get("interleaved") != 0});
        default: break;  // cat
    }
    return f(rope::cat{.temperature = static_cast<float>(s.get("temperature")),
                       .in_pixels = s.get("in_pixels") != 0,
                       .max_res = static_cast<float>(s.get("max_res")),
                       .linear_bands = s.get("linear_bands") != 0,
                       .grid_offset = static_cast<float>(s.get("grid_offset")),
                       .ref_height = s.get_int("ref_height"),
                       .ref_width = s.get_int("ref_width"),
                       .xy_indexing = s.get("xy_indexing") != 0});
}

/// @brief The run-time term of mapping `m` (any GridMapping) with options `o`.
/// @throws as rpe::term's constructor, and `[rpe.term_spec] mode = bias with target = v ...`.
template <class S, GridMapping M>
std::unique_ptr<any_term<S>> term_of(const M& m, const term_options& o) {
    return detail::runtime_term_of<S>(m, o);
}

/// @brief The run-time term of a mapping added at run time.
template <class S>
std::unique_ptr<any_term<S>> term_of(const registered_mapping& m, const term_options& o) {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "rpe: the scalar type must be float or double");
    if constexpr (std::is_same_v<S, float>)
        return m.entry->term_f32(m.spec, m.grid, o.contextual, o.target, o.num_heads, o.head_dim, o.shared_head, o.skip);
    else
        return m.entry->term_f64(m.spec, m.grid, o.contextual, o.target, o.num_heads, o.head_dim, o.shared_head, o.skip);
}

/// @brief Fresh bucket ids (no cache) of mapping `m` on a depth × height × width grid (rpe::build_bucket_ids).
template <GridMapping M>
std::shared_ptr<const bucket_ids> bucket_ids_of(const M& m, int depth, int height, int width, int skip) {
    return build_bucket_ids(m, depth, height, width, skip, id_storage::automatic);
}

/// @brief The same for a mapping added at run time.
inline std::shared_ptr<const bucket_ids> bucket_ids_of(const registered_mapping& m, int depth, int height, int width, int skip) {
    return m.entry->build_ids(m.spec, grid_extent{height, width}, depth, skip);
}

/// @brief Fresh bucket ids (per-offset ids without cache) of mapping `m` for `skip` extra tokens
/// followed by tokens at per-token positions (rpe::build_bucket_ids(m, positions, skip)).
template <GridMapping M>
std::shared_ptr<const bucket_ids> bucket_ids_of(const M& m, tensor_ref<const std::int32_t> positions, int skip) {
    return build_bucket_ids(m, positions, skip);
}

/// @brief The same for a mapping added at run time: its bounding box's ids from the family's
/// build_ids (automatic storage), positions (N, 3) for a 3D family, else (N, 2).
inline std::shared_ptr<const bucket_ids> bucket_ids_of(const registered_mapping& m, tensor_ref<const std::int32_t> positions,
                                                       int skip) {
    return bucket_ids_at_positions(positions, {}, skip, m.entry->mapping_3d ? 3 : 2, [&](int depth, int height, int width) {
        return m.entry->build_ids(m.spec, grid_extent{height, width}, depth, skip);
    });
}

/// @brief As bucket_ids_of(m, positions, skip) with the keys at `key_positions` (any count N_k:
/// (L, L_k) ids, rpe::build_bucket_ids(m, positions, key_positions, skip)).
template <GridMapping M>
std::shared_ptr<const bucket_ids> bucket_ids_of(const M& m, tensor_ref<const std::int32_t> positions,
                                                tensor_ref<const std::int32_t> key_positions, int skip) {
    return build_bucket_ids(m, positions, key_positions, skip);
}

/// @brief The same for a mapping added at run time (the box spans queries and keys).
inline std::shared_ptr<const bucket_ids> bucket_ids_of(const registered_mapping& m, tensor_ref<const std::int32_t> positions,
                                                       tensor_ref<const std::int32_t> key_positions, int skip) {
    return bucket_ids_at_positions(positions, key_positions, skip, m.entry->mapping_3d ? 3 : 2,
                                   [&](int depth, int height, int width) {
                                       return m.entry->build_ids(m.spec, grid_extent{height, width}, depth, skip);
                                   });
}

/// @brief Whether a family's terms take `contextual` mode on target `tg`.
/// @throws rpe::invalid_argument `[rpe.term_spec] mode = ... with target = ... for <family>; expected ...`.
inline void check_family_terms(const family_info& f, bool contextual, target tg) {
    const bool ok = (contextual ? f.terms.contextual : f.terms.bias) && (!f.terms.key_only || tg == target::key);
    detail::require(ok, "term_spec", "mode = ", contextual ? "contextual" : "bias", " with target = ", target_letter(tg), " for ",
                    f.name, "; expected ",
                    f.terms.bias && f.terms.contextual ? "bias or contextual" : (f.terms.bias ? "bias" : "contextual"),
                    f.terms.key_only ? " on k" : "");
}

/// @brief Adds a user's mapping family: `make(spec, grid)` returns its mapping value (any
/// rpe::GridMapping) from the parameters of `info`; the family is then known by name to
/// rpe::parse_family_spec, rpe::visit_mapping, rpe::make_term, the `rpe` tool (--plugin) and
/// rpe_torch (torch.ops.load_library). The operations are compiled here, in the caller's unit.
/// @throws rpe::invalid_argument `[rpe.registry] name = '...'; already registered` (or a bad name).
template <class Factory>
void register_mapping(family_info info, Factory make) {
    using M = std::remove_cvref_t<std::invoke_result_t<Factory&, const family_spec&, grid_extent>>;
    static_assert(GridMapping<M>, "rpe::register_mapping: the factory must return a mapping policy (rpe::GridMapping)");
    info.kind = family_kind::mapping;
    info.num_tables = detail::num_tables_of<M>();
    if (info.group.empty()) info.group = "user";
    registry::entry e;
    e.info = std::move(info);
    e.mapping_3d = Mapping3D<M>;
    e.build_ids = [make](const family_spec& s, grid_extent g, int depth, int skip) {
        return build_bucket_ids(make(s, g), depth, g.height, g.width, skip, id_storage::automatic);
    };
    e.term_f32 = [make](const family_spec& s, grid_extent g, bool ctx, target tg, int h, int d, bool shared, int skip) {
        return detail::runtime_term_of<float>(make(s, g), term_options{ctx, tg, h, d, shared, skip});
    };
    e.term_f64 = [make](const family_spec& s, grid_extent g, bool ctx, target tg, int h, int d, bool shared, int skip) {
        return detail::runtime_term_of<double>(make(s, g), term_options{ctx, tg, h, d, shared, skip});
    };
    e.num_buckets = [make](const family_spec& s, grid_extent g) -> std::int64_t {
        const M m = make(s, g);
        detail::validate_policy(m);
        return m.num_buckets();
    };
    detail::registry_with_builtins().add(std::move(e));
}

/// @brief rpe::register_mapping for RPE_REGISTER_MAPPING, which runs during static initialisation:
/// never throws (an exception there terminates the process, a plugin's taking its loader down with
/// it); a refused registration (name taken, bad name) is recorded instead
/// (registry::record_load_error), for the loader to report after dlopen
/// (registry::take_load_errors) or for the next rpe::families() to throw.
/// @return whether the family was added.
template <class Factory>
bool register_mapping_at_load(family_info info, Factory make) noexcept {
    try {
        register_mapping(std::move(info), std::move(make));
        return true;
    } catch (const std::exception& e) {
        registry::global().record_load_error(e.what());
    } catch (...) {
        registry::global().record_load_error("[rpe.registry] a mapping registration failed at load (unknown exception)");
    }
    return false;
}

}  // namespace rpe

/// @brief Registers a user's mapping family when the unit is loaded (program start, or dlopen of a
/// plugin): `RPE_REGISTER_MAPPING(manhattan, rpe::family_info{.name = "manhattan", ...}, factory)`,
/// `factory(const rpe::family_spec&, rpe::grid_extent)` returning the mapping value. `id` names
/// the registration (any identifier, unique in the unit). A name already taken is refused without
/// throwing at load (rpe::register_mapping_at_load): the loader reports it (the `rpe` tool's
/// --plugin and rpe_bench's RPE_BENCH_PLUGINS exit with `[rpe.registry] name = '...'; already
/// registered (...)` naming the file), else the next rpe::families() throws it.
#define RPE_REGISTER_MAPPING(id, ...) static const bool rpe_registered_mapping_##id = ::rpe::register_mapping_at_load(__VA_ARGS__)
