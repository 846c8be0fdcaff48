// `rpe rope`: a rotary position embedding (rpe::rope_forward; the 2D forms, DINOv3, Qwen-VL's M-RoPE) applied to a q or k tensor
// read from .npy, the result written as .npy (atomically, like every output of the tool).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <tuple>
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
#include <rpe/rope/dinov3.hpp>
#include <rpe/rope/mrope.hpp>
#include <rpe/rope/rotary.hpp>

#include "cli.hpp"

namespace rpe_cli {

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

// The DINOv3 policy from the options. @throws usage_error naming the option and value.
rpe::rope::dinov3 dinov3_of(const rope_options& o, std::string& what) {
    rpe::rope::dinov3 p;
    p.base = static_cast<float>(o.base);
    p.min_period = static_cast<float>(o.min_period);
    p.max_period = static_cast<float>(o.max_period);
    if (o.normalize == "separate")
        p.normalize = rpe::rope::dinov3_normalize::separate;
    else if (o.normalize == "max")
        p.normalize = rpe::rope::dinov3_normalize::max;
    else if (o.normalize == "min")
        p.normalize = rpe::rope::dinov3_normalize::min;
    else
        throw usage_error("--normalize", "'" + o.normalize + "' is not a normalisation; expected separate, max or min");
    std::tie(p.shift_y, p.shift_x) = parse_two(o.shift, "--shift", "a shift DY,DX");
    std::tie(p.jitter_y, p.jitter_x) = parse_two(o.jitter, "--jitter", "jitter multipliers FY,FX");
    p.rescale = static_cast<float>(o.rescale);
    try {
        p.validate();
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--base/--min-period/--max-period/--jitter/--rescale", e.what());
    }
    what = "dinov3 (DINOv3 RoPE), ";
    what += p.min_period > 0.0f ? "periods " + std::to_string(o.min_period) + ".." + std::to_string(o.max_period)
                                : "base " + std::to_string(o.base);
    what += ", normalize " + o.normalize;
    return p;
}

// The M-RoPE policy from the options. @throws usage_error naming the option and value.
rpe::rope::mrope mrope_of(const rope_options& o, std::string& what) {
    rpe::rope::mrope p;
    if (o.theta_given) p.theta = static_cast<float>(o.theta);
    int v[3] = {0, 0, 0};
    {
        const auto bad = [&] {
            return usage_error("--sections", "'" + o.sections + "' is not sections T,H,W (three counts of frequency pairs)");
        };
        std::size_t at = 0;
        for (int i = 0; i < 3; ++i) {
            const auto end = i < 2 ? o.sections.find(',', at) : o.sections.size();
            if (end == std::string::npos || end == at) throw bad();
            const std::string t = o.sections.substr(at, end - at);
            if (t.find_first_not_of("0123456789") != std::string::npos || t.size() > 9) throw bad();
            v[i] = std::stoi(t);
            at = end + 1;
        }
    }
    p.section_t = v[0];
    p.section_h = v[1];
    p.section_w = v[2];
    p.interleaved = o.interleaved;
    try {
        p.validate();
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--theta/--sections", e.what());
    }
    std::ostringstream text;
    text << "mrope (Qwen-VL M-RoPE), theta " << p.theta << ", sections " << v[0] << "," << v[1] << "," << v[2]
         << (p.interleaved ? ", interleaved" : "");
    what = text.str();
    return p;
}

}  // namespace

int run_rope(const rope_options& o) {
    if (o.grid.empty() == o.positions.empty())
        throw usage_error(o.grid.empty() ? "--grid" : "--positions", "give one of --grid HxW and --positions P.npy");
    const auto g = o.grid.empty() ? grid_size{1, 1} : parse_grid(o.grid, "--grid");
    check_output_options(o.out, o.expect, o.atol, o.rtol);
    rpe::rotary_embedding<float> r;
    r.skip = o.skip;
    r.suffix = o.suffix;
    const bool dinov3 = o.form == "dinov3", mrope = o.form == "mrope";
    if (!mrope && (o.interleaved || o.sections != rope_options{}.sections))
        throw usage_error(o.interleaved ? "--interleaved" : "--sections",
                          "only --form mrope reads " + std::string(o.interleaved ? "--interleaved" : "--sections") + "; drop it");
    if (o.layout.empty())
        r.layout = dinov3 || mrope ? rpe::rope::layout::half : rpe::rope::layout::pairs;
    else if (o.layout == "pairs")
        r.layout = rpe::rope::layout::pairs;
    else if (o.layout == "half")
        r.layout = rpe::rope::layout::half;
    else
        throw usage_error("--layout", "'" + o.layout + "' is not a channel layout; expected pairs or half");
    std::string what;
    std::vector<float> freqs, positions;
    std::vector<std::int64_t> freqs_shape, positions_shape;
    if (!o.positions.empty()) {
        const auto p = rpe::io::load_npy(o.positions);
        positions = to_float32(p, "--positions", o.positions);
        positions_shape = p.shape;
        if (positions_shape.size() > 4)
            throw usage_error("--positions", o.positions + " has shape " + rpe::detail::shape_string(positions_shape) +
                                                 "; expected (tokens, 2) or, for mrope, (tokens, 3)");
        r.positions = cref(positions, positions_shape);
    }
    if (dinov3 || mrope) {
        if (!o.freqs.empty()) throw usage_error("--freqs", "only --form mixed reads frequencies; drop --freqs");
        if (dinov3)
            r.form = rpe::rope::custom{dinov3_of(o, what)};
        else
            r.form = rpe::rope::custom{mrope_of(o, what)};
    } else {
        // the form and its parameters from rpe's registry (<rpe/families.hpp>) (dinov3 above)
        auto& reg = rpe::families();
        rpe::family_spec spec;
        try {
            spec = reg.defaults(o.form, rpe::family_kind::rope);
        } catch (const rpe::invalid_argument&) {
            std::vector<std::string> forms;
            for (const auto& e : reg.entries())
                if (e->info.kind == rpe::family_kind::rope) forms.push_back(e->info.name);
            forms.emplace_back("dinov3");
            forms.emplace_back("mrope");
            std::string list;
            for (std::size_t i = 0; i < forms.size(); ++i)
                list += (i == 0 ? "" : (i + 1 == forms.size() ? " or " : ", ")) + forms[i];
            throw usage_error("--form", "'" + o.form + "' is not a RoPE form; expected " + list);
        }
        const auto set = [&](const char* param, double v) {
            if (spec.has(param)) spec.set(param, v);
        };
        set("theta", o.theta);
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
        r.form = rpe::visit_rope(spec, [](const auto& form) { return rpe::rope_form(form); });
        const bool learned = std::holds_alternative<rpe::rope::mixed>(r.form);  // frequencies from --freqs
        what = spec.family + " (" + rpe::family_of(spec.family, rpe::family_kind::rope).summary + "), ";
        if (learned) {
            if (o.freqs.empty())
                throw usage_error("--freqs", "--form " + spec.family + " needs the learned frequencies (2, H, D/2) as .npy");
            const auto f = rpe::io::load_npy(o.freqs);
            freqs = to_float32(f, "--freqs", o.freqs);
            freqs_shape = f.shape;
            if (freqs_shape.size() > 4)
                throw usage_error("--freqs",
                                  o.freqs + " has shape " + rpe::detail::shape_string(freqs_shape) + "; expected (2, H, D/2)");
            r.freqs = cref(freqs, freqs_shape);
            what += "frequencies from " + o.freqs;
        } else if (spec.has("theta")) {
            what += "theta " + std::to_string(o.theta);
        } else {
            what += o.in_pixels ? std::string("pixel bands") : "temperature " + std::to_string(o.temperature);
        }
        if (!o.freqs.empty() && !learned) {
            std::string with;
            for (const auto& e : reg.entries())
                if (e->info.kind == rpe::family_kind::rope && e->info.params.empty())
                    with += (with.empty() ? "" : ", ") + e->info.name;
            throw usage_error("--freqs", "only --form " + with + " reads frequencies; drop --freqs");
        }
        try {
            std::visit(
                [](const auto& p) {
                    if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(p)>, std::monostate>) p.validate();
                },
                r.form);
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--theta/--temperature/--max-res/--grid-offset/--ref-grid", e.what());
        }
    }
    const auto x = rpe::io::load_npy(o.input);
    if (x.shape.size() != 4)
        throw usage_error("--input", o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, L, D)");
    const auto x_data = to_float32(x, "--input", o.input);
    std::vector<float> y(x_data.size());
    try {
        rpe::rope_forward(r, g.height, g.width, cref(x_data, x.shape),
                          rpe::tensor_ref<float>(y.data(), std::span<const std::int64_t>(x.shape)));
    } catch (const rpe::invalid_argument& e) {
        const char* opts = mrope                  ? (!o.positions.empty() ? "--input/--positions/--skip/--suffix/--sections"
                                                                          : "--input/--grid/--skip/--suffix/--sections")
                           : !o.positions.empty() ? "--input/--positions/--skip/--suffix/--freqs"
                           : o.suffix != 0        ? "--input/--grid/--skip/--suffix/--freqs"
                                                  : "--input/--grid/--skip/--freqs";
        throw usage_error(opts, e.what());
    }
    std::cout << "rope: " << what;
    if (o.positions.empty())
        std::cout << ", grid " << g.height << "x" << g.width;
    else
        std::cout << ", positions " << o.positions;
    std::cout << ", skip " << o.skip << ", suffix " << o.suffix << ", layout " << rpe::rope::layout_name(r.layout) << "\n";
    return write_and_compare(y, x.shape, o.out, o.expect, o.atol, o.rtol);
}

}  // namespace rpe_cli
