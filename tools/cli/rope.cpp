// `rpe rope`: a 2D rotary position embedding (rpe::rope_forward) applied to a q or k tensor
// read from .npy, the result written as .npy (atomically, like every output of the tool).
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <rpe/backend/cpu/rope.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/rotary.hpp>

#include "cli.hpp"

namespace rpe_cli {

namespace {

rpe::tensor_ref<const float> cref(const std::vector<float>& v, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<const float>(v.data(), std::span<const std::int64_t>(shape));
}

}  // namespace

int run_rope(const rope_options& o) {
    const auto g = parse_grid(o.grid, "--grid");
    check_output_options(o.out, o.expect, o.atol, o.rtol);
    rpe::rotary_embedding<float> r;
    r.skip = o.skip;
    std::string what;
    std::vector<float> freqs;
    std::vector<std::int64_t> freqs_shape;
    // the form and its parameters from rpe's registry (<rpe/families.hpp>)
    auto& reg = rpe::families();
    rpe::family_spec spec;
    try {
        spec = reg.defaults(o.form, rpe::family_kind::rope);
    } catch (const rpe::invalid_argument&) {
        std::vector<std::string> forms;
        for (const auto& e : reg.entries())
            if (e->info.kind == rpe::family_kind::rope) forms.push_back(e->info.name);
        std::string list;
        for (std::size_t i = 0; i < forms.size(); ++i) list += (i == 0 ? "" : (i + 1 == forms.size() ? " or " : ", ")) + forms[i];
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
        if (o.freqs.empty()) throw usage_error("--freqs", "--form " + spec.family + " needs the learned frequencies (2, H, D/2) as .npy");
        const auto f = rpe::io::load_npy(o.freqs);
        freqs = to_float32(f, "--freqs", o.freqs);
        freqs_shape = f.shape;
        if (freqs_shape.size() > 4) throw usage_error("--freqs", o.freqs + " has shape " + rpe::detail::shape_string(freqs_shape) + "; expected (2, H, D/2)");
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
            if (e->info.kind == rpe::family_kind::rope && e->info.params.empty()) with += (with.empty() ? "" : ", ") + e->info.name;
        throw usage_error("--freqs", "only --form " + with + " reads frequencies; drop --freqs");
    }
    try {
        std::visit([](const auto& p) {
            if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(p)>, std::monostate>) p.validate();
        }, r.form);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--theta/--temperature/--max-res/--grid-offset/--ref-grid", e.what());
    }
    const auto x = rpe::io::load_npy(o.input);
    if (x.shape.size() != 4) throw usage_error("--input", o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, L, D)");
    const auto x_data = to_float32(x, "--input", o.input);
    std::vector<float> y(x_data.size());
    try {
        rpe::rope_forward(r, g.height, g.width, cref(x_data, x.shape),
                          rpe::tensor_ref<float>(y.data(), std::span<const std::int64_t>(x.shape)));
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--input/--grid/--skip/--freqs", e.what());
    }
    std::cout << "rope: " << what << ", grid " << g.height << "x" << g.width << ", skip " << o.skip << "\n";
    return write_and_compare(y, x.shape, o.out, o.expect, o.atol, o.rtol);
}

}  // namespace rpe_cli
