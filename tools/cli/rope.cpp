// `rpe rope`: a rotary position embedding (rpe::rope_forward; every RoPE form of rpe's registry, <rpe/families.hpp>: the
// 2D forms, DINOv3, Qwen-VL's M-RoPE, V-JEPA 2, SAM2) applied to a q or k tensor read from .npy, the result written as .npy (atomically,
// like every output of the tool). The form's parameters come from the options of the same meaning; an option of
// another form's parameters is a usage error (it would be ignored).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <utility>
#include <iostream>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <rpe/backend/cpu/rope.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/rope/positions.hpp>
#include <rpe/rope/rotary.hpp>

#include "cli.hpp"

namespace rpe_cli {

namespace {

// --repeat R rotates the keys at R copies of the grid's (row, col) indices (per-token positions):
// the grid's own rotation only for forms whose grid angles are those of the integer (row, col)
// (axial, mixed, sam2, cat on an unscaled grid). DINOv3 (coordinates normalised into (-1, 1)) and
// cat with --ref-grid / --in-pixels / --grid-offset read a grid through coordinates of their own, so
// their repeated frames would not be the grid rotation: refused, naming --repeat. Compared on one
// frame: the table on the grid against the table at the grid's indices (bit for bit). A D the
// tables refuse is left to the rotation, whose message names it.
void check_repeat_form(const rpe::rotary_embedding<float>& r, const std::string& form, int height, int width, std::int64_t d) {
    rpe::rotary_embedding<float> one = r;
    one.positions = {};
    one.key_positions = {};
    one.skip = 0;
    one.suffix = 0;
    one.query_suffix = -1;
    const std::vector<float> grid = rpe::rope::repeated_grid_positions(height, width, 1);
    bool same = true;
    try {
        const auto on_grid = rpe::rope_table_of(one, d, height, width);
        const std::int64_t shape[] = {static_cast<std::int64_t>(height) * width, 2};
        const auto at_indices = rpe::rope_position_table(one, rpe::tensor_ref<const float>(grid.data(), shape), d);
        same = on_grid->cos == at_indices->cos && on_grid->sin == at_indices->sin;
    } catch (const rpe::error&) {
        return;  // the rotation below names what is wrong
    }
    if (!same)
        throw usage_error("--repeat", "--form " + form +
                                          " rotates a grid by coordinates of its own, not by its (row, col) indices, so "
                                          "copies of the indices would not rotate each frame as the grid; --repeat takes "
                                          "forms whose grid angles are the indices' (axial, mixed, sam2, cat without "
                                          "--ref-grid/--in-pixels/--grid-offset); give every key's coordinates with "
                                          "--positions instead");
}

// Integer --positions (any integer dtype of the .npy) have |value| <= 2^24: the rotation reads
// positions in float32, which holds every integer exactly only up to 2^24 (beyond it a position
// would be read as another one). Floating positions are the file's own values (not checked).
// @throws usage_error("--positions") naming the file, the element, its value and the float32 it
// would be read as.
void check_exact_positions(const rpe::io::npy_array& a, const std::string& file) {
    if (a.is_float() || a.dtype == "|b1") return;
    constexpr std::int64_t lim = std::int64_t{1} << 24;
    const auto refuse = [&](std::size_t i, auto v) {
        std::ostringstream text;
        text << std::fixed << std::setprecision(0) << file << ": element " << i << " = " << v
             << " is an integer position beyond 2^24 = " << lim
             << "; expected |value| <= 2^24 (positions are read in float32, exact for integers up to 2^24: this one "
                "would be read as "
             << static_cast<float>(v) << ")";
        throw usage_error("--positions", text.str());
    };
    if (a.dtype == "<u8") {  // beyond int64
        const auto v = a.to<std::uint64_t>();
        for (std::size_t i = 0; i < v.size(); ++i)
            if (v[i] > static_cast<std::uint64_t>(lim)) refuse(i, v[i]);
        return;
    }
    const auto v = a.to<std::int64_t>();
    for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i] > lim || v[i] < -lim) refuse(i, v[i]);
}

}  // namespace

namespace {

rpe::tensor_ref<const float> cref(const std::vector<float>& v, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<const float>(v.data(), std::span<const std::int64_t>(shape));
}

// "A,B": two finite numbers. @throws usage_error(option) naming the value.
std::pair<float, float> parse_two(const std::string& text, const char* option, const char* what) {
    const auto comma = text.find(',');
    const auto bad = [&] { return usage_error(option, "'" + text + "' is not " + what); };
    if (comma == std::string::npos) throw bad();
    const auto num = [&](const std::string& t) {
        if (t.empty()) throw bad();
        char* end = nullptr;
        const double v = std::strtod(t.c_str(), &end);
        if (end != t.c_str() + t.size() || !std::isfinite(v)) throw bad();
        return static_cast<float>(v);
    };
    return {num(text.substr(0, comma)), num(text.substr(comma + 1))};
}

// "A,B,C": three counts (0 .. 999999999). @throws usage_error(option) naming the value.
std::vector<int> parse_counts(const std::string& text, const char* option, const char* what) {
    const auto bad = [&] { return usage_error(option, "'" + text + "' is not " + what); };
    std::vector<int> v;
    std::size_t at = 0;
    for (int i = 0; i < 3; ++i) {
        const auto end = i < 2 ? text.find(',', at) : text.size();
        if (end == std::string::npos || end == at) throw bad();
        const std::string t = text.substr(at, end - at);
        if (t.find_first_not_of("0123456789") != std::string::npos || t.size() > 9) throw bad();
        v.push_back(std::stoi(t));
        at = end + 1;
    }
    return v;
}

// --grid: HxW (or L) as parse_grid, or TxHxW (frames = 0 for the 2D forms). @throws usage_error naming the value.
struct video_grid {
    int frames = 0;
    grid_size g{1, 1};
};
video_grid parse_video_grid(const std::string& text) {
    const auto x1 = text.find_first_of("xX");
    const auto x2 = x1 == std::string::npos ? std::string::npos : text.find_first_of("xX", x1 + 1);
    if (x2 == std::string::npos) return {0, parse_grid(text, "--grid")};
    const std::string t = text.substr(0, x1);
    if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string::npos || std::stoi(t) < 1)
        throw usage_error("--grid", "'" + text + "' is not a grid; expected HxW or TxHxW (e.g. 8x16x16), positive integers");
    return {std::stoi(t), parse_grid(text.substr(x1 + 1), "--grid")};
}

// The RoPE forms of rpe's registry whose default spec satisfies `pred`, as "a, b or c".
template <class Pred>
std::string forms_where(Pred pred) {
    std::vector<std::string> forms;
    for (const auto& e : rpe::families().entries())
        if (e->info.kind == rpe::family_kind::rope && pred(rpe::families().defaults(e->info.name, rpe::family_kind::rope)))
            forms.push_back(e->info.name);
    std::string list;
    for (std::size_t i = 0; i < forms.size(); ++i) list += (i == 0 ? "" : (i + 1 == forms.size() ? " or " : ", ")) + forms[i];
    return list;
}

// The options of the forms' parameters, each with the registry parameter that a form reading it has
// (rope_spec_of sets them; --freqs, mixed's, is checked by run_rope).
struct form_option {
    const char* option;
    const char* param;
};
constexpr form_option form_options[] = {{"--theta", "theta"},
                                        {"--temperature", "temperature"},
                                        {"--in-pixels", "in_pixels"},
                                        {"--max-res", "max_res"},
                                        {"--linear-bands", "linear_bands"},
                                        {"--grid-offset", "grid_offset"},
                                        {"--ref-grid", "ref_height"},
                                        {"--xy", "xy_indexing"},
                                        {"--base", "base"},
                                        {"--min-period", "min_period"},
                                        {"--max-period", "max_period"},
                                        {"--normalize", "normalize"},
                                        {"--shift", "shift_y"},
                                        {"--jitter", "jitter_y"},
                                        {"--rescale", "rescale"},
                                        {"--sections", "section_t"},
                                        {"--interleaved", "interleaved"}};

// The spec of --form with the options onto the parameters of the same meaning (a form reads the
// options of its parameters; one of another form's, given, would be ignored: refused, naming the
// option and the form; so is one of cat's other sub-mode: --temperature with --in-pixels, --max-res
// or --linear-bands without it). @throws usage_error naming the option and value.
rpe::family_spec rope_spec_of(const rope_options& o) {
    auto& reg = rpe::families();
    rpe::family_spec spec;
    try {
        spec = reg.defaults(o.form, rpe::family_kind::rope);
    } catch (const rpe::invalid_argument&) {
        throw usage_error("--form", "'" + o.form + "' is not a RoPE form; expected " +
                                        forms_where([](const rpe::family_spec&) { return true; }));
    }
    for (const auto& [option, param] : form_options)
        if (o.given.count(option) != 0 && !spec.has(param))
            throw usage_error(option, std::string("only --form ") +
                                          forms_where([param = param](const rpe::family_spec& d) { return d.has(param); }) +
                                          " reads " + option + ", not --form " + spec.family + "; drop it");
    // cat's two sub-modes read options of their own: --temperature the grid's frequencies, --max-res
    // and --linear-bands --in-pixels' pixel bands; one of the other sub-mode's, given, would be
    // ignored: refused too
    if (spec.has("in_pixels")) {
        if (o.in_pixels && o.given.count("--temperature") != 0)
            throw usage_error("--temperature",
                              "--temperature is read only without --in-pixels (--in-pixels takes pixel "
                              "bands up to --max-res instead); drop one of them");
        for (const char* option : {"--max-res", "--linear-bands"})
            if (!o.in_pixels && o.given.count(option) != 0)
                throw usage_error(option, std::string(option) +
                                              " is read only with --in-pixels (pixel bands); without it --form cat reads "
                                              "--temperature; add --in-pixels or drop " +
                                              option);
    }
    // dinov3's period schedule: --base, or --min-period with --max-period (which then replace the
    // base's schedule: --base given with them would be ignored, refused)
    if (spec.has("min_period") && o.given.count("--base") != 0 &&
        (o.given.count("--min-period") != 0 || o.given.count("--max-period") != 0))
        throw usage_error("--base",
                          "--base is read only without --min-period / --max-period (the periods replace the base's "
                          "schedule); drop one of them");
    const auto set = [&](const char* param, double v) {
        if (spec.has(param)) spec.set(param, v);
    };
    if (o.given.count("--theta") != 0) set("theta", o.theta);  // else the form's default (axial 100, as --theta's; mrope 1e6)
    set("temperature", o.temperature);
    set("in_pixels", o.in_pixels ? 1 : 0);
    set("max_res", o.max_res);
    set("linear_bands", o.linear_bands ? 1 : 0);
    set("grid_offset", o.grid_offset);
    set("xy_indexing", o.xy ? 1 : 0);
    if (!o.ref_grid.empty() && spec.has("ref_height")) {
        const auto ref = parse_grid(o.ref_grid, "--ref-grid");
        set("ref_height", ref.height);
        set("ref_width", ref.width);
    }
    set("base", o.base);
    set("min_period", o.min_period);
    set("max_period", o.max_period);
    set("rescale", o.rescale);
    if (spec.has("normalize")) {
        try {
            reg.set_param(spec, "normalize", o.normalize);
        } catch (const rpe::invalid_argument&) {
            throw usage_error("--normalize", "'" + o.normalize + "' is not a normalisation; expected separate, max or min");
        }
    }
    if (spec.has("shift_y")) {
        const auto [dy, dx] = parse_two(o.shift, "--shift", "a shift DY,DX");
        set("shift_y", dy);
        set("shift_x", dx);
    }
    if (spec.has("jitter_y")) {
        const auto [fy, fx] = parse_two(o.jitter, "--jitter", "jitter multipliers FY,FX");
        set("jitter_y", fy);
        set("jitter_x", fx);
    }
    if (spec.has("section_t")) {
        const auto v = parse_counts(o.sections, "--sections", "sections T,H,W (three counts of frequency pairs)");
        set("section_t", v[0]);
        set("section_h", v[1]);
        set("section_w", v[2]);
        set("interleaved", o.interleaved ? 1 : 0);
    }
    return spec;
}

// A parameter's value as the summary prints it (6 significant digits: 100, 0.5, 1e+06).
std::string num(double v) {
    std::ostringstream t;
    t << v;
    return t.str();
}

// What the tool prints of the form and every parameter it reads (the options' values or the form's
// defaults): the summary line's first part.
std::string describe(const rpe::family_spec& s, const rope_options& o) {
    std::ostringstream t;
    t << s.family << " (" << rpe::family_of(s.family, rpe::family_kind::rope).summary << "), ";
    if (s.params.empty()) {
        t << "frequencies from " << o.freqs;
    } else if (s.has("section_t")) {
        t << "theta " << num(s.get("theta")) << ", sections " << s.get_int("section_t") << "," << s.get_int("section_h") << ","
          << s.get_int("section_w") << (s.get("interleaved") != 0 ? ", interleaved" : "");
    } else if (s.has("base")) {
        t << (s.get("min_period") > 0 ? "periods " + num(s.get("min_period")) + ".." + num(s.get("max_period"))
                                      : "base " + num(s.get("base")));
        t << ", normalize " << rpe::families().value_text(s, "normalize", s.get("normalize")) << ", shift "
          << num(s.get("shift_y")) << "," << num(s.get("shift_x")) << ", jitter " << num(s.get("jitter_y")) << ","
          << num(s.get("jitter_x")) << ", rescale " << num(s.get("rescale"));
    } else if (s.has("theta")) {
        t << "theta " << num(s.get("theta"));
    } else {
        if (s.get("in_pixels") != 0)
            t << "pixel bands, max res " << num(s.get("max_res")) << (s.get("linear_bands") != 0 ? ", linear" : ", log")
              << " bands";
        else
            t << "temperature " << num(s.get("temperature"));
        t << ", grid offset " << num(s.get("grid_offset"));
        if (s.get_int("ref_height") > 0)
            t << ", ref grid " << s.get_int("ref_height") << "x" << s.get_int("ref_width");
        else
            t << ", no ref grid";
        t << ", indexing " << (s.get("xy_indexing") != 0 ? "xy" : "ij");
    }
    return t.str();
}

// The options whose values the form's validate() checks, for its usage error.
const char* checked_options(const rpe::family_spec& s) {
    if (s.has("section_t")) return "--theta/--sections";
    if (s.has("theta")) return "--theta";
    if (s.has("base")) return "--base/--min-period/--max-period/--jitter/--rescale";
    return "--temperature/--max-res/--grid-offset/--ref-grid";
}

}  // namespace

int run_rope(const rope_options& o) {
    if (o.grid.empty() == o.positions.empty())
        throw usage_error(o.grid.empty() ? "--grid" : "--positions", "give one of --grid HxW (or TxHxW) and --positions P.npy");
    const auto vg = o.grid.empty() ? video_grid{} : parse_video_grid(o.grid);
    auto g = vg.g;
    if (o.repeat != 1 && (o.grid.empty() || vg.frames != 0))
        throw usage_error("--repeat", "--repeat " + std::to_string(o.repeat) +
                                          " repeats a --grid HxW; expected it with --grid HxW (not with --positions or TxHxW)");
    check_output_options(o.out, o.expect, o.atol, o.rtol);
    rpe::rotary_embedding<float> r;
    r.skip = o.skip;
    r.suffix = o.suffix;
    // the form and its parameters from rpe's registry (<rpe/families.hpp>)
    const rpe::family_spec spec = rope_spec_of(o);
    const bool sections = spec.has("section_t");  // the form's sections are checked against the head
    r.form = rpe::visit_rope(spec, [](const auto& form) { return rpe::rope_form_of(form); });
    if (o.layout.empty())
        r.layout = rpe::visit_rope(spec, [](const auto& form) { return rpe::rope::default_layout_of(form); });
    else if (o.layout == "pairs")
        r.layout = rpe::rope::layout::pairs;
    else if (o.layout == "half")
        r.layout = rpe::rope::layout::half;
    else if (o.layout == "vjepa2")
        r.layout = rpe::rope::layout::vjepa2;
    else
        throw usage_error("--layout", "'" + o.layout + "' is not a channel layout; expected pairs, half or vjepa2");
    std::vector<float> freqs, positions;
    std::vector<std::int64_t> freqs_shape, positions_shape;
    const int axes = rpe::rope_position_axes(r.form);
    const auto three_axis_forms = [] {
        return forms_where([](const rpe::family_spec& d) {
            return rpe::visit_rope(d, [](const auto& f) { return rpe::rope_position_axes(rpe::rope_form_of(f)); }) == 3;
        });
    };
    if (vg.frames != 0) {  // TxHxW: the (frame, row, col) ids of the clip, as per-token positions
        if (axes != 3)
            throw usage_error("--grid", "'" + o.grid + "' is a TxHxW grid, for a form with (frame, row, col) positions (" +
                                            three_axis_forms() + "); expected HxW for --form " + spec.family);
        try {
            positions = rpe::rope::grid_positions(vg.frames, g.height, g.width);
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--grid", e.what());
        }
        positions_shape = {static_cast<std::int64_t>(positions.size() / 3), 3};
        r.positions = cref(positions, positions_shape);
    } else if (o.repeat != 1) {  // HxW repeated: SAM2's memory keys
        if (axes != 2)
            throw usage_error("--repeat", "--repeat repeats a 2D grid; --form " + spec.family + " takes 3-axis positions");
        try {
            positions = rpe::rope::repeated_grid_positions(g.height, g.width, o.repeat);
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--grid/--repeat", e.what());
        }
        positions_shape = {static_cast<std::int64_t>(positions.size() / 2), 2};
        r.positions = cref(positions, positions_shape);
    }
    if (!o.positions.empty()) {
        const auto p = load_option_npy(o.positions, "--positions");
        check_exact_positions(p, o.positions);
        positions = to_float32(p, "--positions", o.positions);
        positions_shape = p.shape;
        if (positions_shape.size() > 4)
            throw usage_error("--positions", o.positions + " has shape " + rpe::detail::shape_string(positions_shape) +
                                                 "; expected (tokens, 2) or, for " + three_axis_forms() + ", (tokens, 3)");
        r.positions = cref(positions, positions_shape);
    }
    const bool learned = std::holds_alternative<rpe::rope::mixed>(r.form);  // frequencies from --freqs
    if (!o.freqs.empty() && !learned)
        throw usage_error("--freqs", "only --form " + forms_where([](const rpe::family_spec& d) { return d.params.empty(); }) +
                                         " reads --freqs, not --form " + spec.family + "; drop it");
    if (learned) {
        if (o.freqs.empty())
            throw usage_error("--freqs", "--form " + spec.family + " needs the learned frequencies (2, H, D/2) as .npy");
        const auto f = load_option_npy(o.freqs, "--freqs");
        freqs = to_float32(f, "--freqs", o.freqs);
        freqs_shape = f.shape;
        if (freqs_shape.size() > 4)
            throw usage_error("--freqs",
                              o.freqs + " has shape " + rpe::detail::shape_string(freqs_shape) + "; expected (2, H, D/2)");
        r.freqs = cref(freqs, freqs_shape);
    }
    const std::string what = describe(spec, o);
    try {
        std::visit(
            [](const auto& p) {
                if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(p)>, std::monostate>) p.validate();
            },
            r.form);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(checked_options(spec), e.what());
    }
    const auto x = load_option_npy(o.input, "--input");
    if (x.shape.size() != 4)
        throw usage_error("--input", o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, L, D)");
    const auto x_data = to_float32(x, "--input", o.input);
    if (o.repeat != 1) check_repeat_form(r, spec.family, g.height, g.width, x.shape[3]);
    std::vector<float> y(x_data.size());
    try {
        rpe::rope_forward(r, g.height, g.width, cref(x_data, x.shape),
                          rpe::tensor_ref<float>(y.data(), std::span<const std::int64_t>(x.shape)));
    } catch (const rpe::invalid_argument& e) {
        const char* opts = sections               ? (!o.positions.empty() ? "--input/--positions/--skip/--suffix/--sections"
                                                                          : "--input/--grid/--skip/--suffix/--sections")
                           : !o.positions.empty() ? "--input/--positions/--skip/--suffix/--freqs"
                           : o.repeat != 1        ? "--input/--grid/--repeat/--skip/--suffix"
                           : vg.frames != 0       ? "--input/--grid/--skip/--suffix/--layout"
                           : axes == 3            ? "--input/--grid/--skip/--suffix/--layout"
                           : o.suffix != 0        ? "--input/--grid/--skip/--suffix/--freqs"
                                                  : "--input/--grid/--skip/--freqs";
        throw usage_error(opts, e.what());
    }
    std::cout << "rope: " << what;
    if (vg.frames != 0)
        std::cout << ", grid " << vg.frames << "x" << g.height << "x" << g.width;
    else if (o.repeat != 1)
        std::cout << ", grid " << g.height << "x" << g.width << " repeated " << o.repeat;
    else if (o.positions.empty())
        std::cout << ", grid " << g.height << "x" << g.width;
    else
        std::cout << ", positions " << o.positions;
    std::cout << ", skip " << o.skip << ", suffix " << o.suffix << ", layout " << rpe::rope::layout_name(r.layout) << "\n";
    return write_and_compare(y, x.shape, o.out, o.expect, o.atol, o.rtol);
}

}  // namespace rpe_cli
