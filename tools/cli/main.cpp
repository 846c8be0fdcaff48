// `rpe`: bucket ids, pictures, terms and benchmarks of rpe's mappings from the command line.
//
//   rpe buckets --mapping product --ratio 1.9 --grid 14x14 --skip 1 [--out ids.npy] [--expect ref.npy]
//               (--positions P.npy instead of --grid: (L - skip, 2) integer (row, col) per token;
//                --key-positions K.npy with it: keys of their own count, (L, L_k) ids; rpe term too)
//   rpe show    --mapping product --grid 14x14 --query 7,7 [--png out.png] [--all]
//   rpe term    --mapping product --mode contextual --target k --grid 5x9 --skip 1
//               --table t.npy --input x.npy --out y.npy [--expect ref.npy]
//   rpe rope    --form axial|mixed|cat|dinov3|mrope|vjepa2|sam2 --grid 14x14 --skip 1 --input q.npy --out q_rot.npy
//               [--theta 100 | --freqs f.npy | --temperature 10000 --ref-grid 16x16 ...] [--expect ref.npy]
//   rpe bench   --mapping product,euclidean --grid 14x14 [--batch 8 --heads 6 --dim 64]
//               [--pass fwd,fwd_bwd --repeat 7 --warmup 1 --format table|csv]
//   (swin, beit, swinv2: --window HxW, default the grid; swinv2: --pretrained HxW, --no-sigmoid;
//    rpe buckets --coords c.npy writes the SwinV2 log coordinates; rpe term --timm-table reads (K, H))
//
// Exit status 0 on success, 1 on failure, 2 on a usage error (the message names the option).
#include <CLI/CLI.hpp>
#include <dlfcn.h>
#include <stb_easy_font.h>
#include <stb_image_write.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <rpe/config.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/io/atomic_file.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/quantization.hpp>
#include <rpe/vit/swin_bias.hpp>
#include <rpe/vit/alibi_2d.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

#include "cli.hpp"

namespace rpe_cli {

// ---------------------------------------------------------------------------------------------
// Mapping names and parameters
// ---------------------------------------------------------------------------------------------
std::string mapping_config::describe() const {
    std::ostringstream os;
    switch (kind) {
        case mapping_kind::shaw: os << family.family << " (1D clip, k=" << shaw.k << ")"; break;
        case mapping_kind::t5:
            os << family.family << " (1D, " << (t5.bidirectional ? "bidirectional" : "causal") << ", buckets=" << t5.buckets
               << ", max_distance=" << t5.max_distance << ")";
            break;
        case mapping_kind::swin:
        case mapping_kind::beit:
        case mapping_kind::swinv2:
            os << name << " (window ";
            if (window.height > 0)
                os << window.height << "x" << window.width;
            else
                os << "= grid";
            if (kind == mapping_kind::beit) os << ", 3 class-token buckets";
            if (kind == mapping_kind::swinv2) {
                os << ", log coords";
                if (pretrained.height > 0) os << " pretrained " << pretrained.height << "x" << pretrained.width;
                os << (sigmoid16 ? ", 16*sigmoid" : ", linear");
            }
            os << ")";
            break;
        case mapping_kind::user: {
            os << name << " (";
            const auto& reg = rpe::families();
            for (std::size_t i = 0; i < family.params.size(); ++i)
                os << (i ? " " : "") << family.params[i].first << "="
                   << reg.value_text(family, family.params[i].first, family.params[i].second);
            os << ")";
            break;
        }
        case mapping_kind::two_d:
            if (vit == vit_kind::decomposed) {
                os << name << " (SAM/MViTv2 decomposed rel pos: cross, clip index, beta = max(H, W) - 1";
                if (spec.beta > 0) os << " = " << spec.beta;
                os << ")";
                break;
            }
            if (vit == vit_kind::alibi2d) {
                os << name << " (CROMA 2D ALiBi: product, clip index, beta = max(H, W) - 1";
                if (spec.beta > 0) os << " = " << spec.beta;
                os << ", fixed table -slope_h * distance)";
                break;
            }
            os << name << " (";
            if (spec.index == rpe::index_kind::clip)
                os << "clip index, beta=" << spec.beta;
            else
                os << "piecewise index, alpha=" << spec.alpha << " beta=" << spec.beta << " gamma=" << spec.gamma;
            os << ")";
            break;
    }
    return os.str();
}

std::string mapping_names() { return rpe::families().names_text(rpe::family_kind::mapping); }

std::vector<std::string> family_group(const std::string& group) {
    std::vector<std::string> out;
    for (const auto& e : rpe::families().entries())
        if (e->info.group == group) out.push_back(e->info.name);
    return out;
}

void load_plugins(const std::vector<std::string>& paths) {
    // a refusal recorded before any plugin (a unit linked into the tool) is thrown here, not blamed on a plugin
    auto& registry = rpe::families();
    for (const auto& path : paths) {
        // RTLD_GLOBAL: the plugin's rpe symbols bind to the tool's, so the registry is one instance
        if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
            const char* why = dlerror();
            throw usage_error("--plugin", "'" + path + "' cannot be loaded: " + (why ? why : "unknown error") +
                                              "; expected a shared library that registers mappings (RPE_REGISTER_MAPPING)");
        }
        // its RPE_REGISTER_MAPPING refusals (a name already taken), recorded during its static initialisation
        const auto refused = registry.take_load_errors();
        if (!refused.empty()) {
            std::string why = refused.front();
            for (std::size_t i = 1; i < refused.size(); ++i) why += "; also " + refused[i];
            throw usage_error("--plugin", "'" + path + "' cannot be loaded: " + why +
                                              "; expected mapping names and aliases not registered yet");
        }
    }
}

mapping_config resolve_mapping(const std::string& typed, const mapping_options& o) {
    using B = rpe::builtin_family;
    const auto colon = typed.find(':');
    const std::string name = typed.substr(0, colon);
    mapping_config m;
    m.name = name;
    auto& reg = rpe::families();
    try {
        m.family = reg.defaults(name);
    } catch (const rpe::invalid_argument&) {
        throw usage_error("--mapping", "'" + name + "' is not a mapping; expected one of " + mapping_names());
    }
    auto& f = m.family;
    const int id = rpe::builtin_of(f);
    // the options, onto the parameters of the same name
    if (f.has("index")) {
        if (o.index != "piecewise" && o.index != "clip")
            throw usage_error("--index", "'" + o.index + "' is not an index function; expected piecewise or clip");
        reg.set_param(f, "index", o.index);
    }
    const bool abg = f.has("alpha") && f.has("beta") && f.has("gamma");
    if (abg) {
        f.set("alpha", o.ratio).set("beta", 2.0 * o.ratio).set("gamma", 8.0 * o.ratio);
        if (o.alpha) f.set("alpha", *o.alpha);
        if (o.beta) f.set("beta", *o.beta);
        if (o.gamma) f.set("gamma", *o.gamma);
    }
    if (f.has("k")) f.set("k", o.k);
    if (f.has("buckets")) f.set("buckets", o.buckets);
    if (f.has("max_distance")) f.set("max_distance", o.max_distance);
    const bool windowed = id == static_cast<int>(B::swin) || id == static_cast<int>(B::beit) || id == static_cast<int>(B::swinv2);
    if (windowed && !o.window.empty()) {
        m.window = parse_grid(o.window, "--window");
        f.set("window_h", m.window.height).set("window_w", m.window.width);
    }
    if (!o.pretrained.empty()) {
        if (!f.has("pretrained_h")) {
            std::string with;
            for (const auto& e : reg.entries())
                for (const auto& p : e->info.params)
                    if (p.name == "pretrained_h") with += (with.empty() ? "" : ", ") + e->info.name;
            throw usage_error("--pretrained", "only " + with + " has a pre-training window");
        }
        m.pretrained = parse_grid(o.pretrained, "--pretrained");
        f.set("pretrained_h", m.pretrained.height).set("pretrained_w", m.pretrained.width);
    }
    if (f.has("sigmoid16")) f.set("sigmoid16", o.no_sigmoid ? 0 : 1);
    // then the text's own parameters: --mapping product:index=clip,beta=4
    if (colon != std::string::npos) {
        try {
            const std::string rest = typed.substr(colon + 1);
            std::size_t at = 0;
            while (at <= rest.size()) {
                const auto comma = std::min(rest.find(',', at), rest.size());
                const std::string item = rest.substr(at, comma - at);
                const auto eq = item.find('=');
                if (eq == std::string::npos)
                    throw usage_error("--mapping",
                                      "'" + item + "' in '" + typed + "' is not param=value; " + name + " takes " + f.names());
                reg.set_param(f, item.substr(0, eq), item.substr(eq + 1));
                at = comma + 1;
            }
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--mapping", e.what());
        }
        if (windowed) m.window = {f.get_int("window_h"), f.get_int("window_w")};
        if (f.has("pretrained_h")) m.pretrained = {f.get_int("pretrained_h"), f.get_int("pretrained_w")};
    }
    // the fields the commands print, and each family's checks with the options to blame
    switch (id) {
        case static_cast<int>(B::shaw):
            m.kind = mapping_kind::shaw;
            m.shaw = rpe::mapping::shaw{.k = f.get_int("k")};
            try {
                m.shaw.validate();
            } catch (const rpe::invalid_argument& e) {
                throw usage_error("--k", e.what());
            }
            return m;
        case static_cast<int>(B::t5):
            m.kind = mapping_kind::t5;
            m.t5 = rpe::mapping::t5{.buckets = f.get_int("buckets"),
                                    .max_distance = f.get_int("max_distance"),
                                    .bidirectional = f.get("bidirectional") != 0};
            try {
                m.t5.validate();
            } catch (const rpe::invalid_argument& e) {
                throw usage_error("--buckets/--max-distance", e.what());
            }
            return m;
        case static_cast<int>(B::swin):
        case static_cast<int>(B::beit):
        case static_cast<int>(B::swinv2):
            m.kind = id == static_cast<int>(B::swin)
                         ? mapping_kind::swin
                         : (id == static_cast<int>(B::beit) ? mapping_kind::beit : mapping_kind::swinv2);
            if (m.window.height != 0 || m.window.width != 0) {
                try {
                    m.swin().validate();
                } catch (const rpe::invalid_argument& e) {
                    throw usage_error("--window", e.what());
                }
            }
            if (f.has("sigmoid16")) m.sigmoid16 = f.get("sigmoid16") != 0;
            return m;
        case static_cast<int>(B::decomposed):
        case static_cast<int>(B::alibi2d): {
            const bool alibi = id == static_cast<int>(B::alibi2d);
            m.vit = alibi ? vit_kind::alibi2d : vit_kind::decomposed;
            m.spec.method = alibi ? rpe::method::product : rpe::method::cross;
            m.spec.index = rpe::index_kind::clip;
            m.spec.beta = 0;  // set from the grid (for_grid)
            return m;
        }
        default: break;
    }
    if (id < 0 || id >= 6) {  // a plugin's family (or product3d): its own checks, through the registry
        m.kind = mapping_kind::user;
        try {
            (void)rpe::visit_mapping(f, {1, 1}, [](const auto& mm) { return rpe::bucket_ids_of(mm, 1, 1, 1, 0)->num_buckets(); });
        } catch (const rpe::invalid_argument& e) {
            throw usage_error(abg ? "--mapping/--ratio/--alpha/--beta/--gamma" : "--mapping", e.what());
        }
        return m;
    }
    m.spec.method = static_cast<rpe::method>(id);
    m.spec.index = f.get_int("index") == 1 ? rpe::index_kind::clip : rpe::index_kind::piecewise;
    m.spec.alpha = f.get("alpha");
    m.spec.beta = f.get("beta");
    m.spec.gamma = f.get("gamma");
    try {
        (void)m.spec.num_buckets();  // validates α, β, γ (or β for clip)
    } catch (const rpe::invalid_argument& e) {
        std::string why = e.what();
        if (!o.beta || !o.gamma) {  // some of α, β, γ came from the ratio: say how
            std::ostringstream r;
            r << "; --ratio " << o.ratio << " sets alpha = ratio, beta = 2*ratio, gamma = 8*ratio";
            why += r.str();
        }
        throw usage_error("--ratio/--alpha/--beta/--gamma", why);
    }
    return m;
}

bool same_file(const std::string& a, const std::string& b) {
    std::error_code ec;
    return std::filesystem::equivalent(a, b, ec) && !ec;
}

mapping_config mapping_config::for_grid(const grid_size& g) const {
    mapping_config c = *this;
    if (c.window.height == 0) c.window = g;  // swin, beit, swinv2: the window defaults to the grid
    if (c.family.has("window_h") && c.family.get("window_h") == 0 && c.family.get("window_w") == 0)
        c.family.set("window_h", g.height).set("window_w", g.width);  // decomposed, alibi2d: the grid
    if (c.vit == vit_kind::none) return c;
    try {  // decomposed, alibi2d: one bucket per offset of this grid
        c.spec.beta = c.vit == vit_kind::decomposed ? rpe::vit::decomposed_rel_pos_mapping(g.height, g.width).inner.index.beta
                                                    : rpe::vit::alibi_2d_mapping(g.height, g.width).inner.index.beta;
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--grid", e.what());
    }
    return c;
}

grid_size parse_grid(const std::string& text, const char* option) {
    grid_size g;
    auto number = [&](const std::string& s) {
        if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
            throw usage_error(option, "'" + text +
                                          "' is not a grid; expected HxW (e.g. 14x14) or L (a 1xL sequence), "
                                          "positive integers");
        if (s.size() > 9)  // beyond any grid the ids could hold; keeps stoi in range
            throw usage_error(option, "'" + text + "': side " + s + " is too large; expected at most 999999999 per side");
        return std::stoi(s);
    };
    const auto x = text.find_first_of("xX");
    if (x == std::string::npos) {
        g.height = 1;
        g.width = number(text);
    } else {
        g.height = number(text.substr(0, x));
        g.width = number(text.substr(x + 1));
    }
    if (g.height < 1 || g.width < 1) throw usage_error(option, "'" + text + "' has an empty side; expected extents >= 1");
    return g;
}

rpe::io::npy_array load_option_npy(const std::string& path, const char* option) {
    try {
        return rpe::io::load_npy(path);
    } catch (const rpe::error& e) {  // not a .npy, Fortran order, big-endian, truncated
        throw usage_error(option, e.what());
    }
}

positions_input load_positions(const std::string& path, const char* option) {
    positions_input p;
    p.path = path;
    const auto a = load_option_npy(path, option);
    if (a.is_float())
        throw usage_error(option, path + " has dtype " + a.dtype + "; expected an integer .npy (int32 or int64 coordinates)");
    const std::string n = std::string_view(option) == "--key-positions" ? "L_k - skip" : "L - skip";  // whose count
    if (a.shape.size() != 2 || a.shape[0] < 1 || (a.shape[1] != 2 && a.shape[1] != 3))
        throw usage_error(option, path + " has shape " + rpe::detail::shape_string(a.shape) + "; expected (" + n +
                                      ", 2) (row, col), or (" + n + ", 3) (t, row, col) for a 3D mapping");
    if (a.shape[0] > (std::int64_t{1} << 30))
        throw usage_error(option, path + " has shape " + rpe::detail::shape_string(a.shape) + "; expected at most 2^30 tokens");
    try {
        p.coords = a.to<std::int32_t>();
    } catch (const rpe::out_of_range& e) {
        throw usage_error(option, e.what());
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(option, e.what());
    }
    p.tokens = a.shape[0];
    p.axes = static_cast<int>(a.shape[1]);
    std::int64_t lo[2] = {0, 0}, hi[2] = {0, 0};
    for (std::int64_t i = 0; i < p.tokens; ++i)
        for (int c = 0; c < 2; ++c) {
            const std::int64_t v = p.coords[static_cast<std::size_t>(i * p.axes + p.axes - 2 + c)];
            lo[c] = i == 0 ? v : std::min(lo[c], v);
            hi[c] = i == 0 ? v : std::max(hi[c], v);
        }
    // the box as a grid for the grid-dependent mappings; beyond int the library refuses the values
    p.box.height = static_cast<int>(std::min<std::int64_t>(hi[0] - lo[0] + 1, 1 << 30));
    p.box.width = static_cast<int>(std::min<std::int64_t>(hi[1] - lo[1] + 1, 1 << 30));
    return p;
}

void check_grid_or_positions(bool grid_given, const std::string& positions) {
    if (grid_given == !positions.empty())
        throw usage_error("--grid/--positions", grid_given ? "give one of --grid HxW and --positions P.npy, not both"
                                                           : "give one of --grid HxW and --positions P.npy");
}

std::shared_ptr<const rpe::bucket_ids> build_ids(const mapping_config& mc, int height, int width, int skip) {
    const mapping_config m = mc.for_grid({height, width});
    const auto build = [&] {
        return rpe::visit_mapping(m.family, {height, width},
                                  [&](const auto& mapping) { return rpe::bucket_ids_of(mapping, 1, height, width, skip); });
    };
    try {
        if (m.kind == mapping_kind::swin || m.kind == mapping_kind::swinv2 || m.kind == mapping_kind::beit) {
            try {
                return build();
            } catch (const rpe::invalid_argument& e) {  // a grid larger than the window
                throw usage_error("--grid/--window", e.what());
            }
        }
        if (m.kind == mapping_kind::user) {
            try {
                return build();
            } catch (const rpe::invalid_argument& e) {
                throw usage_error("--mapping/--grid", e.what());
            }
        }
        return build();
    } catch (const rpe::out_of_range& e) {
        throw usage_error("--grid", e.what());
    }
}

std::optional<positions_input> load_key_positions(const std::string& key_positions, const std::string& positions) {
    if (key_positions.empty()) return std::nullopt;
    if (positions.empty())
        throw usage_error("--key-positions",
                          key_positions + " is given without --positions; expected the queries' --positions P.npy too");
    return load_positions(key_positions, "--key-positions");
}

grid_size joint_box(const positions_input& a, const positions_input& b) {
    std::int64_t lo[2] = {0, 0}, hi[2] = {0, 0};
    bool first = true;
    for (const auto* p : {&a, &b})
        for (std::int64_t i = 0; i < p->tokens; ++i)
            for (int c = 0; c < 2; ++c) {
                const std::int64_t v = p->coords[static_cast<std::size_t>(i * p->axes + p->axes - 2 + c)];
                lo[c] = first ? v : std::min(lo[c], v);
                hi[c] = first ? v : std::max(hi[c], v);
                if (c == 1) first = false;
            }
    return {static_cast<int>(std::min<std::int64_t>(hi[0] - lo[0] + 1, 1 << 30)),
            static_cast<int>(std::min<std::int64_t>(hi[1] - lo[1] + 1, 1 << 30))};
}

void check_positions_window(const mapping_config& m, const grid_size& box, bool key_positions) {
    if (m.kind != mapping_kind::swin && m.kind != mapping_kind::swinv2 && m.kind != mapping_kind::beit) return;
    const grid_size w = m.window;
    if (box.height <= w.height && box.width <= w.width) return;
    throw usage_error(
        "--positions/--window",
        std::string(key_positions ? "the queries' and keys' positions' bounding box " : "the positions' bounding box ") +
            std::to_string(box.height) + "x" + std::to_string(box.width) + " is larger than the window " +
            std::to_string(w.height) + "x" + std::to_string(w.width) + " of " + m.name +
            "; expected positions spanning at most " + std::to_string(w.height) + " rows and " + std::to_string(w.width) +
            " columns, or a larger --window (the index covers offsets within one window)");
}

namespace {

// ---------------------------------------------------------------------------------------------
// rpe buckets
// ---------------------------------------------------------------------------------------------
struct buckets_options {
    std::string grid = "14x14", out, expect, coords, positions, key_positions;
    int skip = 0;
};

// Bucket ids of the mapping at the positions of `p` (the keys at `kp` when given: (L, L_k) ids)
// after `skip` tokens (no cache); `box` the positions' box (the grid of the window mappings).
std::shared_ptr<const rpe::bucket_ids> build_position_ids(const mapping_config& mc, const positions_input& p,
                                                          const positions_input* kp, grid_size box, int skip) {
    const mapping_config m = mc.for_grid(box);
    try {
        return rpe::visit_mapping(m.family, {box.height, box.width}, [&](const auto& mapping) {
            return kp ? rpe::bucket_ids_of(mapping, p.ref(), kp->ref(), skip) : rpe::bucket_ids_of(mapping, p.ref(), skip);
        });
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(kp ? "--positions/--key-positions/--skip" : "--positions/--skip", e.what());
    } catch (const rpe::out_of_range& e) {
        throw usage_error(kp ? "--positions/--key-positions/--skip" : "--positions/--skip", e.what());
    }
}

int run_buckets(const mapping_config& mc, const buckets_options& o, bool grid_given) {
    if (!o.key_positions.empty() && o.positions.empty()) (void)load_key_positions(o.key_positions, o.positions);  // refused
    check_grid_or_positions(grid_given, o.positions);
    std::optional<positions_input> pos;
    if (!o.positions.empty()) pos = load_positions(o.positions);
    const std::optional<positions_input> kpos = load_key_positions(o.key_positions, o.positions);
    const auto g = kpos ? joint_box(*pos, *kpos) : pos ? pos->box : parse_grid(o.grid, "--grid");
    const double tokens = pos ? static_cast<double>(pos->tokens) : static_cast<double>(g.height) * g.width;
    const double key_tokens = kpos ? static_cast<double>(kpos->tokens) : tokens;
    if (!o.out.empty()) {  // (L, L_k) ids of at least 1 byte each: refused before the ids are built
        const double l = static_cast<double>(o.skip) + tokens, lk = static_cast<double>(o.skip) + key_tokens;
        if (l * lk > static_cast<double>(rpe::bucket_ids::max_bytes))
            throw usage_error("--out", (kpos ? "the (L, L_k) ids of L = " + std::to_string(static_cast<long long>(l)) +
                                                   ", L_k = " + std::to_string(static_cast<long long>(lk))
                                             : "the (L, L) ids of L = " + std::to_string(static_cast<long long>(l))) +
                                           " would take more than 4 GiB; use a smaller --grid");
    }
    if (!o.expect.empty() && !o.out.empty() && same_file(o.out, o.expect))
        throw usage_error("--out/--expect", "'" + o.out + "' and '" + o.expect +
                                                "' are the same file; the comparison would read what was just written");
    const mapping_config m = mc.for_grid(g);  // swin, beit, swinv2: the window defaults to the grid (the positions' box)
    if (pos) check_positions_window(m, g, kpos.has_value());
    const auto ids =
        pos ? build_position_ids(m, *pos, kpos ? &*kpos : nullptr, g, o.skip) : build_ids(m, g.height, g.width, o.skip);
    // n queries (rows), nk keys (columns): nk = n but for --key-positions of another count
    const int n = ids->length(), nk = ids->key_length(), k = ids->num_buckets(), tables = ids->num_tables();
    std::cout << "mapping: " << m.describe() << "\n";
    // the positions' box: frames x rows x cols for (t, row, col) positions (the ids' box depth)
    const std::string box = (ids->depth() > 1 ? std::to_string(ids->depth()) + "x" : std::string()) + std::to_string(g.height) +
                            "x" + std::to_string(g.width);
    if (kpos)
        std::cout << "positions " << o.positions << ": " << pos->tokens << " queries, key positions " << o.key_positions << ": "
                  << kpos->tokens << " keys, in a " << box << " box, skip " << o.skip << ": L = " << n << ", L_k = " << nk
                  << "\n";
    else if (pos)
        std::cout << "positions " << o.positions << ": " << pos->tokens << " tokens in a " << box << " box, skip " << o.skip
                  << ": L = " << n << "\n";
    else
        std::cout << "grid " << g.height << "x" << g.width << ", skip " << o.skip << ": L = " << n << "\n";
    std::cout << "num_buckets = " << k;
    const int sb = ids->skip_buckets();
    if (o.skip > 0) std::cout << " (" << k - sb << " + " << sb << " skip bucket" << (sb > 1 ? "s" : "") << ")";
    std::cout << " per table, " << tables << (tables == 1 ? " table" : " tables (rows, cols)") << "\n";
    for (int t = 0; t < tables; ++t) {
        // every offset (dr, dc) of the grid occurs for some pair: one pair per offset is enough
        // (O(H·W), not O(L²)), plus the extra bucket when there are skip tokens
        std::vector<char> seen(static_cast<std::size_t>(k), 0);
        // at positions: every pair of the N queries and N_k keys (O(N·N_k)), the skip tokens
        // left to the extra-bucket pairs below (their rows and columns hold only those buckets)
        for (int i = o.skip; pos && i < n; ++i)
            for (int j = o.skip; j < nk; ++j) seen[static_cast<std::size_t>(ids->at(t, i, j))] = 1;
        for (int dr = -(g.height - 1); !pos && dr < g.height; ++dr)
            for (int dc = -(g.width - 1); dc < g.width; ++dc) {
                const int i = o.skip + std::max(dr, 0) * g.width + std::max(dc, 0);
                const int j = o.skip + std::max(-dr, 0) * g.width + std::max(-dc, 0);
                seen[static_cast<std::size_t>(ids->at(t, i, j))] = 1;
            }
        if (o.skip > 0)  // the extra bucket(s): both tokens extra, only the query, only the key
            for (auto [i, j] : {std::pair{0, 0}, std::pair{0, o.skip}, std::pair{o.skip, 0}})
                seen[static_cast<std::size_t>(ids->at(t, i, j))] = 1;
        const auto used = std::count(seen.begin(), seen.end(), 1);
        std::cout << (tables > 1 ? (t == 0 ? "rows table: " : "cols table: ") : "") << "buckets used: " << used << " of " << k
                  << " allocated\n";
    }
    std::cout << "ids: " << (tables > 1 ? "2x" : "") << n << "x" << nk << ", " << ids->id_bytes() << " byte"
              << (ids->id_bytes() > 1 ? "s" : "") << " each, " << ids->bytes() << " bytes held ("
              << (ids->storage_kind() == rpe::id_storage::table ? "(L, L) table + per-offset ids"
                                                                : "per-offset ids only, rows computed on the fly")
              << ")\n";

    std::vector<std::int64_t> shape{n, nk};
    if (tables > 1) shape.insert(shape.begin(), tables);
    if (!o.out.empty()) {
        const std::size_t total = static_cast<std::size_t>(n) * static_cast<std::size_t>(nk);
        if (static_cast<double>(total) * tables * ids->id_bytes() > static_cast<double>(rpe::bucket_ids::max_bytes))
            throw usage_error("--out", "the (L, L) ids of L = " + std::to_string(n) +
                                           " would take more than 4 GiB; "
                                           "use a smaller --grid");
        auto write = [&](auto id_type) {  // rows(): table and on-the-fly ids alike, streamed in blocks
            using Id = decltype(id_type);
            rpe::io::atomic_file f(o.out, "cli");
            f.write(std::span<const std::byte>(rpe::io::encode_npy_header<Id>(shape)));
            const std::int64_t block = std::max<std::int64_t>(1, (std::int64_t{1} << 22) / nk);  // ~4 M ids per block
            std::vector<Id> buf(static_cast<std::size_t>(std::min<std::int64_t>(block, n)) * static_cast<std::size_t>(nk));
            for (int t = 0; t < tables; ++t)
                for (std::int64_t i0 = 0; i0 < n; i0 += block) {
                    const std::int64_t count = std::min<std::int64_t>(block, n - i0);
                    const Id* p = ids->rows<Id>(t, i0, count, false, buf.data());  // table storage: no copy
                    f.write(
                        std::as_bytes(std::span<const Id>(p, static_cast<std::size_t>(count) * static_cast<std::size_t>(nk))));
                }
            f.commit();
        };
        rpe::visit_id_width(ids->id_bytes(), [&]<class Id>() { write(Id{}); });
        std::cout << "wrote " << o.out << "\n";
    }
    if (!o.coords.empty()) {
        if (m.kind != mapping_kind::swinv2 && m.kind != mapping_kind::swin)
            throw usage_error("--coords", "only swin and swinv2 have log-spaced coordinates");
        const mapping_config w = m.for_grid(g);
        std::vector<float> c;
        try {
            c = rpe::relative_log_coords(w.swin(), {.pretrained_h = w.pretrained.height, .pretrained_w = w.pretrained.width});
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--window/--pretrained", e.what());
        }
        rpe::io::save_npy(o.coords, c.data(), std::vector<std::int64_t>{static_cast<std::int64_t>(c.size() / 2), 2});
        std::cout << "wrote " << o.coords << " (" << c.size() / 2
                  << ", 2) float32 log-spaced coordinates (the CPB MLP's input)\n";
    }
    if (!o.expect.empty()) {
        const auto ref = load_option_npy(o.expect, "--expect");
        if (ref.shape != shape) {
            std::cout << "expect: " << o.expect << " has another shape; MISMATCH\n";
            return 1;
        }
        const auto want = ref.to<std::int64_t>();
        std::int64_t differ = 0;
        for (int t = 0; t < tables; ++t)
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < nk; ++j) differ += ids->at(t, i, j) != want[(static_cast<std::size_t>(t) * n + i) * nk + j];
        std::cout << "expect: " << differ << " of " << want.size() << " ids differ from " << o.expect << "; "
                  << (differ == 0 ? "match" : "MISMATCH") << "\n";
        return differ == 0 ? 0 : 1;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// rpe show: ASCII map and PNG
// ---------------------------------------------------------------------------------------------
struct show_options {
    std::string grid = "14x14", query, png;
    bool all = false;
};

// The ids of every key around one query, one panel per table.
struct panel {
    std::string title;
    int height = 0, width = 0, qr = 0, qc = 0, num_buckets = 0;
    std::vector<int> ids;  // (height, width)
};

std::vector<panel> panels_of(const mapping_config& m, const grid_size& g, int qr, int qc) {
    const auto ids = build_ids(m, g.height, g.width, 0);
    std::vector<panel> out;
    for (int t = 0; t < ids->num_tables(); ++t) {
        panel p;
        p.title = m.name + (ids->num_tables() > 1 ? (t == 0 ? " (rows)" : " (cols)") : "");
        p.height = g.height;
        p.width = g.width;
        p.qr = qr;
        p.qc = qc;
        p.num_buckets = ids->num_buckets();
        const int i = qr * g.width + qc;
        for (int j = 0; j < ids->length(); ++j) p.ids.push_back(ids->at(t, i, j));
        out.push_back(std::move(p));
    }
    return out;
}

void print_panel(const panel& p) {
    const int lo = *std::min_element(p.ids.begin(), p.ids.end()), hi = *std::max_element(p.ids.begin(), p.ids.end());
    const int w = static_cast<int>(std::to_string(hi).size());
    std::cout << p.title << ": ids " << lo << ".." << hi << " of " << p.num_buckets << " (query in [ ])\n";
    for (int r = 0; r < p.height; ++r) {
        std::string line;
        for (int c = 0; c < p.width; ++c) {
            std::string id = std::to_string(p.ids[static_cast<std::size_t>(r * p.width + c)]);
            id.insert(0, static_cast<std::size_t>(w) - id.size(), ' ');
            const bool q = r == p.qr && c == p.qc;
            line += q ? "[" + id + "]" : " " + id + " ";
        }
        while (!line.empty() && line.back() == ' ') line.pop_back();
        std::cout << line << "\n";
    }
}

// An RGB canvas with rectangles and stb_easy_font text.
struct canvas {
    int width, height;
    std::vector<unsigned char> rgb;
    canvas(int w, int h) : width(w), height(h), rgb(static_cast<std::size_t>(w) * h * 3, 255) {}
    void rect(int x, int y, int w, int h, std::array<unsigned char, 3> c) {
        for (int yy = std::max(0, y); yy < std::min(height, y + h); ++yy)
            for (int xx = std::max(0, x); xx < std::min(width, x + w); ++xx)
                std::copy(c.begin(), c.end(), rgb.begin() + (static_cast<std::ptrdiff_t>(yy) * width + xx) * 3);
    }
    // text at (x, y), each font pixel drawn as scale × scale
    void text(int x, int y, const std::string& s, std::array<unsigned char, 3> c, int scale) {
        std::vector<char> buf(s.size() * 300 + 1000);
        std::string copy = s;
        const int quads = stb_easy_font_print(0, 0, copy.data(), nullptr, buf.data(), static_cast<int>(buf.size()));
        const float* v = reinterpret_cast<const float*>(buf.data());
        for (int q = 0; q < quads; ++q) {
            const float* a = v + q * 16;  // 4 vertices of (x, y, z, rgba) = 4 floats each
            const int x0 = static_cast<int>(a[0]), y0 = static_cast<int>(a[1]);
            const int x1 = static_cast<int>(a[8]), y1 = static_cast<int>(a[9]);
            rect(x + x0 * scale, y + y0 * scale, (x1 - x0) * scale, (y1 - y0) * scale, c);
        }
    }
    static int text_width(const std::string& s, int scale) {
        std::string copy = s;
        return stb_easy_font_width(copy.data()) * scale;
    }
};

// Viridis at t ∈ [0, 1], interpolated between five of its samples.
std::array<unsigned char, 3> viridis(double t) {
    static constexpr double anchors[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
    t = std::clamp(t, 0.0, 1.0) * 4.0;
    const int i = std::min(3, static_cast<int>(t));
    const double f = t - i;
    std::array<unsigned char, 3> c{};
    for (int ch = 0; ch < 3; ++ch)
        c[static_cast<std::size_t>(ch)] =
            static_cast<unsigned char>(anchors[i][ch] + f * (anchors[i + 1][ch] - anchors[i][ch]) + 0.5);
    return c;
}

void write_png(const std::vector<panel>& panels, const std::string& path) {
    constexpr int cell = 24, margin = 16, title_h = 28;
    int total_w = margin, max_h = 0;
    for (const auto& p : panels) {
        total_w += std::max(p.width * cell, canvas::text_width(p.title, 2)) + margin;
        max_h = std::max(max_h, p.height * cell);
    }
    canvas img(total_w, margin + title_h + max_h + margin);
    int x0 = margin;
    for (const auto& p : panels) {
        img.text(x0, margin, p.title, {0, 0, 0}, 2);
        const int y0 = margin + title_h;
        const int lo = *std::min_element(p.ids.begin(), p.ids.end()), hi = *std::max_element(p.ids.begin(), p.ids.end());
        for (int r = 0; r < p.height; ++r)
            for (int c = 0; c < p.width; ++c) {
                const int id = p.ids[static_cast<std::size_t>(r * p.width + c)];
                const auto col = viridis(hi > lo ? static_cast<double>(id - lo) / (hi - lo) : 0.5);
                const int x = x0 + c * cell, y = y0 + r * cell;
                img.rect(x, y, cell - 1, cell - 1, col);
                if (r == p.qr && c == p.qc) {  // the query: a red frame
                    img.rect(x, y, cell - 1, 3, {220, 20, 20});
                    img.rect(x, y + cell - 4, cell - 1, 3, {220, 20, 20});
                    img.rect(x, y, 3, cell - 1, {220, 20, 20});
                    img.rect(x + cell - 4, y, 3, cell - 1, {220, 20, 20});
                }
                const std::string label = std::to_string(id);
                const double lum = 0.299 * col[0] + 0.587 * col[1] + 0.114 * col[2];
                const std::array<unsigned char, 3> ink =
                    lum < 128 ? std::array<unsigned char, 3>{255, 255, 255} : std::array<unsigned char, 3>{0, 0, 0};
                img.text(x + (cell - 1 - canvas::text_width(label, 1)) / 2, y + 8, label, ink, 1);
            }
        x0 += std::max(p.width * cell, canvas::text_width(p.title, 2)) + margin;
    }
    // encode in memory (stbi_write_png ignores fwrite errors), then write all or nothing
    std::string png;
    const auto append = [](void* ctx, void* data, int size) {
        static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<std::size_t>(size));
    };
    if (stbi_write_png_to_func(append, &png, img.width, img.height, 3, img.rgb.data(), img.width * 3) == 0)
        throw rpe::runtime_error(rpe::detail::message("cli", "--png = '", path, "': cannot encode the PNG image"));
    rpe::io::write_file_atomically(path, png, "cli");
}

// Largest side `rpe show` draws: 256 cells per row of text; the PNG of --all is then at most
// 5 panels of 6144 x 6144 pixels (0.6 GB of RGB), far below stb's int sizes.
constexpr int max_show_side = 256;

int run_show(const mapping_config& m, const mapping_options& mo, const show_options& o) {
    const auto g = parse_grid(o.grid, "--grid");
    if (g.height > max_show_side || g.width > max_show_side)
        throw usage_error("--grid", "'" + o.grid + "' is too large to show; expected at most " + std::to_string(max_show_side) +
                                        " cells per side (use rpe buckets for larger grids)");
    int qr = g.height / 2, qc = g.width / 2;
    if (!o.query.empty()) {
        const auto comma = o.query.find(',');
        const auto bad = [&] {
            return usage_error("--query", "'" + o.query + "' is not a query cell of the " + std::to_string(g.height) + "x" +
                                              std::to_string(g.width) + " grid; expected r,c with 0 <= r < " +
                                              std::to_string(g.height) + ", 0 <= c < " + std::to_string(g.width) +
                                              " (or c alone on a 1xL grid)");
        };
        try {
            std::size_t used = 0;
            if (comma == std::string::npos) {
                if (g.height != 1) throw bad();
                qr = 0;
                qc = std::stoi(o.query, &used);
                if (used != o.query.size()) throw bad();
            } else {
                const std::string a = o.query.substr(0, comma), b = o.query.substr(comma + 1);
                qr = std::stoi(a, &used);
                if (used != a.size()) throw bad();
                qc = std::stoi(b, &used);
                if (used != b.size()) throw bad();
            }
        } catch (const std::logic_error&) {  // stoi: not a number, out of range
            throw bad();
        }
        if (qr < 0 || qr >= g.height || qc < 0 || qc >= g.width) throw bad();
    }
    std::vector<panel> panels;
    if (o.all) {
        for (const auto& name : family_group("irpe"))
            for (auto& p : panels_of(resolve_mapping(name, mo), g, qr, qc)) panels.push_back(std::move(p));
        std::cout << "all 2D mappings, " << (mo.index == "clip" ? "clip" : "piecewise") << " index";
    } else {
        panels = panels_of(m, g, qr, qc);
        std::cout << m.for_grid(g).describe();
    }
    std::cout << ", grid " << g.height << "x" << g.width << ", query (" << qr << "," << qc << ")\n";
    for (const auto& p : panels) print_panel(p);
    if (!o.png.empty()) {
        write_png(panels, o.png);
        std::cout << "wrote " << o.png << "\n";
    }
    return 0;
}

void add_mapping_options(CLI::App* app, mapping_options& mo, std::string* name) {
    if (name)
        app->add_option("--mapping", *name,
                        "mapping: NAME or NAME:param=value,... (rpe::family_spec), one of " + mapping_names() +
                            "; --plugin adds a library's own")
            ->capture_default_str();
    app->add_option("--index", mo.index, "index function of the 2D mappings: piecewise or clip")->capture_default_str();
    app->add_option("--ratio", mo.ratio, "alpha = ratio, beta = 2 ratio, gamma = 8 ratio (the reference's)")
        ->capture_default_str();
    app->add_option("--alpha", mo.alpha, "alpha of the piecewise index (overrides the ratio's)");
    app->add_option("--beta", mo.beta, "beta of the index (overrides the ratio's)");
    app->add_option("--gamma", mo.gamma, "gamma of the piecewise index (overrides the ratio's)");
    app->add_option("--k", mo.k, "shaw: clipping distance k (2k+1 buckets)")->capture_default_str();
    app->add_option("--buckets", mo.buckets, "t5: number of buckets")->capture_default_str();
    app->add_option("--max-distance", mo.max_distance, "t5: distance from which the last bucket is shared")
        ->capture_default_str();
    app->add_option("--window", mo.window, "swin, beit, swinv2: the attention window HxW (default: the grid)");
    app->add_option("--pretrained", mo.pretrained, "swinv2: pre-training window HxW of the log coordinates (default: none)");
    app->add_flag("--no-sigmoid", mo.no_sigmoid, "swinv2: the bias table is the MLP output itself (no 16*sigmoid)");
}

// An output path given as "" would silently write nothing.
const std::function<std::string(const std::string&)> non_empty_path = [](const std::string& path) {
    return path.empty() ? std::string("an empty path; expected a file name") : std::string();
};

int run(int argc, char** argv) {
    CLI::App app{
        "rpe: bucket ids, pictures, terms and benchmarks of relative position encodings (iRPE, Shaw, T5, Swin, BEiT, SwinV2)",
        "rpe"};
    app.require_subcommand(1);
    app.fallthrough();  // --plugin after the command too
    std::vector<std::string> plugins;
    app.add_option("--plugin", plugins,
                   "shared library registering its own mappings (RPE_REGISTER_MAPPING), loaded "
                   "before --mapping is read; repeatable (docs/custom_mapping.md)")
        ->check(CLI::ExistingFile);
    app.set_version_flag("--version", std::string("rpe ") + std::to_string(RPE_VERSION_MAJOR) + "." +
                                          std::to_string(RPE_VERSION_MINOR) + "." + std::to_string(RPE_VERSION_PATCH));

    mapping_options mo;
    std::string name = rpe::method_name(rpe::method::product);
    std::vector<std::string> bench_names{name};

    auto* buckets = app.add_subcommand("buckets", "bucket ids of a grid: num_buckets, buckets used, optional .npy");
    buckets_options bo;
    add_mapping_options(buckets, mo, &name);
    buckets->add_option("--grid", bo.grid, "HxW, or L for a 1xL sequence")->capture_default_str();
    buckets
        ->add_option("--positions", bo.positions,
                     "per-token integer coordinates .npy (L - skip, 2) (row, col) ((.., 3) (t, row, col) for product3d), "
                     "instead of --grid")
        ->check(CLI::ExistingFile);
    buckets
        ->add_option("--key-positions", bo.key_positions,
                     "the keys' integer coordinates .npy (L_k - skip, 2|3), with --positions (the queries'): (L, L_k) ids")
        ->check(CLI::ExistingFile);
    buckets->add_option("--skip", bo.skip, "extra tokens before the grid (class token)")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 30));
    buckets->add_option("--out", bo.out, "write the (L, L) ids ((2, L, L) for cross; (L, L_k) with --key-positions) as .npy")
        ->check(non_empty_path);
    buckets->add_option("--expect", bo.expect, "compare the ids with this .npy (exit 1 on a difference)")
        ->check(CLI::ExistingFile);
    buckets
        ->add_option("--coords", bo.coords, "swin/swinv2: write the (K, 2) log-spaced coordinates (SwinV2 CPB MLP input) as .npy")
        ->check(non_empty_path);

    auto* show = app.add_subcommand("show", "bucket id of every key around one query: ASCII map, optional PNG");
    show_options so;
    add_mapping_options(show, mo, &name);
    show->add_option("--grid", so.grid, "HxW, or L for a 1xL sequence")->capture_default_str();
    show->add_option("--query", so.query, "query cell r,c (default: the centre)");
    show->add_option("--png", so.png, "write a coloured picture (PNG)")->check(non_empty_path);
    show->add_flag("--all", so.all, "the four 2D mappings side by side (cross as its rows and cols tables)");

    auto* term = app.add_subcommand("term", "apply one term to an input (.npy in, .npy out)");
    term_options to;
    add_mapping_options(term, mo, &name);
    term->add_option("--mode", to.mode, "bias or contextual")->capture_default_str();
    term->add_option("--target", to.target, "q, k or v")->capture_default_str();
    term->add_option("--grid", to.grid, "HxW (or L): L = skip + H*W must match the input (or --positions)");
    term->add_option("--positions", to.positions,
                     "per-token integer coordinates .npy (L - skip, 2) (row, col) ((.., 3) (t, row, col) for product3d), "
                     "instead of --grid")
        ->check(CLI::ExistingFile);
    term->add_option("--key-positions", to.key_positions,
                     "the keys' integer coordinates .npy (L_k - skip, 2|3), with --positions (the queries'): output "
                     "(.., L, L_k); contextual q reads (B,H,L_k,D), v (B,H,L,L_k)")
        ->check(CLI::ExistingFile);
    term->add_option("--skip", to.skip, "extra tokens before the grid")->capture_default_str()->check(CLI::Range(0, 1 << 30));
    term->add_option("--table", to.tables,
                     "lookup table .npy (twice for cross: rows, cols; decomposed: SAM's rel_pos_h, "
                     "rel_pos_w; none for alibi2d)")
        ->check(CLI::ExistingFile);
    term->add_option("--heads", to.heads, "alibi2d: number of heads (its table is generated)")->check(CLI::Range(1, 1 << 20));
    term->add_option("--input", to.input, "x .npy: (B,H,L,D) scaled q or k, or (B,H,L,L) probabilities; none for bias")
        ->check(CLI::ExistingFile);
    term->add_option("--out", to.out, "output .npy (float32)")->check(non_empty_path);
    term->add_option("--expect", to.expect, "compare the output with this .npy (exit 1 beyond atol + rtol*|expected|)")
        ->check(CLI::ExistingFile);
    term->add_option("--atol", to.atol, "absolute tolerance of --expect")->capture_default_str();
    term->add_option("--rtol", to.rtol, "relative tolerance of --expect")->capture_default_str();
    term->add_flag("--timm-table", to.timm_table,
                   "bias: the table is in timm's (K, H) layout (swin, beit); swinv2's is always "
                   "the CPB MLP's (K, H) output");

    auto* rope = app.add_subcommand("rope", "rotary position embedding of a q or k (.npy in, .npy out)");
    rope_options ro;
    rope->add_option("--form", ro.form,
                     "a RoPE form of rpe's registry (docs/rope.md), one of " + rpe::families().names_text(rpe::family_kind::rope))
        ->capture_default_str();
    rope->add_option("--grid", ro.grid,
                     "HxW: L = skip + H*W + suffix must match the input (or --positions); TxHxW for a 3-axis form (vjepa2, "
                     "mrope): (frame, row, col) ids of T frames, L = skip + T*H*W + suffix");
    rope->add_option("--repeat", ro.repeat,
                     "with --grid HxW: the grid R times over (SAM2's memory keys: one copy per memory frame), "
                     "L = skip + R*H*W + suffix")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 24));
    rope->add_option("--skip", ro.skip, "leading tokens left unrotated (class token)")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 30));
    rope->add_option("--input", ro.input, "q or k .npy (B, H, L, D)")->required()->check(CLI::ExistingFile);
    rope->add_option("--out", ro.out, "rotated .npy (float32)")->check(non_empty_path);
    rope->add_option("--theta", ro.theta,
                     "axial: base of the frequencies (default 100); mrope: rope_theta (default 1e6, Qwen2-VL); vjepa2, sam2: "
                     "frequency base (default 10000)");
    rope->add_option("--freqs", ro.freqs, "mixed: learned frequencies .npy (2, H, D/2)")->check(CLI::ExistingFile);
    rope->add_option("--temperature", ro.temperature, "cat: band base (without --in-pixels)")->capture_default_str();
    rope->add_flag("--in-pixels", ro.in_pixels, "cat: pixel bands and [-1, 1] coordinates (timm's class default; EVA-02: off)");
    rope->add_option("--max-res", ro.max_res, "cat --in-pixels: highest resolution of the bands")->capture_default_str();
    rope->add_flag("--linear-bands", ro.linear_bands, "cat --in-pixels: linearly spaced bands");
    rope->add_option("--grid-offset", ro.grid_offset, "cat: added to the integer coordinates")->capture_default_str();
    rope->add_option("--ref-grid", ro.ref_grid, "cat: reference grid HxW (timm's ref_feat_shape; EVA-02 patch14: 16x16)");
    rope->add_flag("--xy", ro.xy, "cat: grid_indexing 'xy' (columns first)");
    rope->add_option(
        "--layout", ro.layout,
        "channel pairing: pairs ((2j, 2j+1), rope-vit, EVA-02; the default) or half ((j, j+D/2), rotate-half; dinov3's and "
        "mrope's default); vjepa2 (V-JEPA 2's own layout, vjepa2's default and only one)");
    rope->add_option("--suffix", ro.suffix, "trailing tokens left unrotated")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 30));
    rope->add_option("--sections", ro.sections, "mrope: frequency pairs T,H,W per axis (the source's mrope_section; sum D/2)")
        ->capture_default_str();
    rope->add_flag("--interleaved", ro.interleaved, "mrope: Qwen3-VL's interleaved sections");
    rope->add_option("--positions", ro.positions,
                     "per-token coordinates .npy (L - skip - suffix, 2) (row, col), or (.., 3) (t, h, w) position ids for mrope, "
                     "(frame, row, col) for vjepa2, "
                     "instead of --grid")
        ->check(CLI::ExistingFile);
    rope->add_option("--base", ro.base, "dinov3: period base (timm's temperature)")->capture_default_str();
    rope->add_option("--min-period", ro.min_period, "dinov3: smallest period (with --max-period, instead of --base)");
    rope->add_option("--max-period", ro.max_period, "dinov3: largest period (with --min-period)");
    rope->add_option("--normalize", ro.normalize, "dinov3: coordinate normalisation separate, max or min")->capture_default_str();
    rope->add_option("--shift", ro.shift, "dinov3: sampled coordinate shift DY,DX")->capture_default_str();
    rope->add_option("--jitter", ro.jitter, "dinov3: sampled jitter multipliers FY,FX")->capture_default_str();
    rope->add_option("--rescale", ro.rescale, "dinov3: sampled rescale multiplier")->capture_default_str();
    rope->add_option("--expect", ro.expect, "compare the output with this .npy (exit 1 beyond atol + rtol*|expected|)")
        ->check(CLI::ExistingFile);
    rope->add_option("--atol", ro.atol, "absolute tolerance of --expect")->capture_default_str();
    rope->add_option("--rtol", ro.rtol, "relative tolerance of --expect")->capture_default_str();

    auto* bench = app.add_subcommand("bench", "time and memory of variants for your shapes");
    bench_options be;
    add_mapping_options(bench, mo, nullptr);
    bench->add_option("--mapping", bench_names, "mappings to compare, comma-separated (all = the four 2D ones)")
        ->delimiter(',')
        ->capture_default_str();
    bench->add_option("--grid", be.grid, "HxW, or L for a 1xL sequence")->capture_default_str();
    bench->add_option("--skip", be.skip, "extra tokens")->capture_default_str()->check(CLI::Range(0, 1 << 30));
    bench->add_option("--mode", be.mode, "bias or contextual")->capture_default_str();
    bench->add_option("--batch", be.batch, "B")->capture_default_str()->check(CLI::Range(1, 1 << 30));
    bench->add_option("--heads", be.heads, "H")->capture_default_str()->check(CLI::Range(1, 1 << 30));
    bench->add_option("--dim", be.dim, "D (head dim)")->capture_default_str()->check(CLI::Range(1, 1 << 30));
    bench
        ->add_option("--repeat", be.repeat,
                     "timed rounds: each runs every variant and pass once, interleaved (the order rotated per round); "
                     "reported: median, min, quartiles, max")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 30));
    bench->add_option("--warmup", be.warmup, "untimed rounds before the timed ones")
        ->capture_default_str()
        ->check(CLI::Range(0, 1 << 30));
    bench
        ->add_option("--pass", be.passes,
                     "fwd (forward), fwd_bwd (forward + backward with the tables' gradients), comma-separated")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::IsMember({"fwd", "fwd_bwd"}));
    bench->add_option("--format", be.format, "table (for reading) or csv (one row per variant and pass, nothing else)")
        ->capture_default_str()
        ->check(CLI::IsMember({"table", "csv"}));

    const std::set<std::string> commands{"buckets", "show", "term", "rope", "bench"};
    if (argc > 1 && argv[1][0] != '-' && commands.count(argv[1]) == 0)
        throw usage_error("command",
                          std::string("'") + argv[1] + "' is not a command; expected buckets, show, term, rope or bench");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
        // CLI11's own exit codes differ per error kind; every usage error is status 2 here
        std::cerr << "rpe: error: " << e.what() << "\nRun 'rpe --help' (or 'rpe <command> --help') for the options.\n";
        return 2;
    }

    load_plugins(plugins);
    if (*buckets) return run_buckets(resolve_mapping(name, mo), bo, buckets->get_option("--grid")->count() > 0);
    if (*show) return run_show(resolve_mapping(so.all ? family_group("irpe").back() : name, mo), mo, so);
    if (*term) {
        to.mode_given = term->get_option("--mode")->count() > 0;
        to.target_given = term->get_option("--target")->count() > 0;
        return run_term(resolve_mapping(name, mo), to);
    }
    if (*rope) {
        for (const CLI::Option* opt : rope->get_options())
            if (opt->count() > 0 && !opt->get_lnames().empty()) ro.given.insert("--" + opt->get_lnames().front());
        return run_rope(ro);
    }
    std::vector<mapping_config> maps;
    for (const auto& n : bench_names) {
        if (n == "all") {
            for (const auto& a : family_group("irpe")) maps.push_back(resolve_mapping(a, mo));
        } else {
            maps.push_back(resolve_mapping(n, mo));
        }
    }
    return run_bench(maps, be);
}

}  // namespace
}  // namespace rpe_cli

int main(int argc, char** argv) {
#if defined(SIGXFSZ)
    // A file-size limit (ulimit -f) then fails the write with EFBIG, which the atomic writer
    // reports and cleans up after, instead of killing the tool midway with a partial file.
    std::signal(SIGXFSZ, SIG_IGN);
#endif
    try {
        // Ctrl-C, SIGTERM or SIGHUP during a write: the temporary file is removed and the target
        // left as it was; the tool still ends by the signal.
        rpe::io::remove_temporaries_on_signals();
        const int status = rpe_cli::run(argc, argv);
        // a report that never arrived is a failure too (stdout on a full disk or /dev/full)
        std::cout.flush();
        if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
            std::cerr << "rpe: failed: cannot write the report to standard output\n";
            return 1;
        }
        return status;
    } catch (const rpe_cli::usage_error& e) {
        std::cerr << "rpe: error: " << e.option << ": " << e.what() << "\n";
        return 2;
    } catch (const rpe::invalid_argument& e) {
        std::cerr << "rpe: error: " << e.what() << "\n";
        return 2;
    } catch (const std::exception& e) {
        std::cerr << "rpe: failed: " << e.what() << "\n";
        return 1;
    }
}
