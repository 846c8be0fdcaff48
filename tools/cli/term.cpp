// `rpe term`: one term applied to an input read from .npy, and the run-time term factory the
// tool shares with `rpe bench`.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <rpe/any_term.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/term.hpp>
#include <rpe/make_term.hpp>
#include <rpe/vit/swin_bias.hpp>
#include <rpe/vit/alibi_2d.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

#include "cli.hpp"

namespace rpe_cli {

namespace {

template <class T>
rpe::tensor_ref<T> view(T* data, const std::vector<std::int64_t>& shape) {
    return rpe::tensor_ref<T>(data, std::span<const std::int64_t>(shape));  // checks rank <= 4
}

// The extents of a file's shape from `first` on, which become ints (heads, head_dim, buckets,
// L), checked before any cast: an extent above 2^31 - 1 would otherwise be cut.
void check_int_extents(const std::vector<std::int64_t>& shape, const char* option, const std::string& file,
                       std::size_t first = 0) {
    for (std::size_t i = first; i < shape.size(); ++i)
        if (shape[i] > std::numeric_limits<int>::max())
            throw usage_error(option, file + " has shape " + rpe::detail::shape_string(shape) + "; extent " + std::to_string(i) +
                                          " = " + std::to_string(shape[i]) +
                                          " exceeds the int range (2147483647) of heads, "
                                          "head_dim, buckets and tokens");
}

// The most `rpe term` writes: a 4 GiB output (as `rpe buckets --out`).
constexpr std::uint64_t max_output_bytes = std::uint64_t{4} << 30;

// Elements of the output `shape` (0 when an extent is 0) with the product checked against
// overflow, against what one float buffer can hold and against the 4 GiB output cap, before
// anything is allocated.
std::size_t checked_elements(const std::vector<std::int64_t>& shape, const char* option, const std::string& what) {
    const auto limit = static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(float);
    std::uint64_t n = 1;
    bool empty = false;
    for (const std::int64_t e : shape) {
        if (e == 0)
            empty = true;
        else if (static_cast<std::uint64_t>(e) > limit / n)
            throw usage_error(option, what + " " + rpe::detail::shape_string(shape) + " has more than " + std::to_string(limit) +
                                          " float32 elements; expected a buffer this machine can address");
        else
            n *= static_cast<std::uint64_t>(e);
    }
    if (!empty && n * sizeof(float) > max_output_bytes)
        throw usage_error(option, what + " " + rpe::detail::shape_string(shape) +
                                      " would take more than 4 GiB; expected a smaller grid or input");
    return empty ? 0 : static_cast<std::size_t>(n);
}

// The tokens after --skip: the grid's H*W, or the N of --positions.
std::int64_t grid_tokens(const grid_size& g, const positions_input* pos) {
    return pos ? pos->tokens : static_cast<std::int64_t>(g.height) * g.width;
}

// The ids of `term` on the grid, or at the positions (the keys at `kpos` when given: (L, L_k) ids).
std::shared_ptr<const rpe::bucket_ids> layout_ids(const rpe::any_term<float>& term, const grid_size& g,
                                                  const positions_input* pos, const positions_input* kpos) {
    if (pos) return kpos ? term.bucket_ids(pos->ref(), kpos->ref()) : term.bucket_ids(pos->ref());
    return term.bucket_ids(g.height, g.width);
}

// "grid HxW", "positions P.npy (N tokens)" or, with key positions, "positions P.npy (N tokens),
// key positions K.npy (N_k tokens)" for the report line.
std::string layout_text(const grid_size& g, const positions_input* pos, const positions_input* kpos) {
    if (pos)
        return "positions " + pos->path + " (" + std::to_string(pos->tokens) + " tokens)" +
               (kpos ? ", key positions " + kpos->path + " (" + std::to_string(kpos->tokens) + " tokens)" : "");
    return "grid " + std::to_string(g.height) + "x" + std::to_string(g.width);
}

// The options to blame, "--grid" read as "--positions" when the tokens come from positions (and
// "--positions/--key-positions" with the keys' own positions).
std::string blame(const positions_input* pos, std::string options, const positions_input* kpos = nullptr) {
    const auto at = options.find("--grid");
    if (pos && at != std::string::npos) options.replace(at, 6, kpos ? "--positions/--key-positions" : "--positions");
    return options;
}

// Prints the output's shape, writes --out, compares with --expect; the exit status.
int finish(const std::vector<float>& out, const std::vector<std::int64_t>& out_shape, const term_options& o) {
    return write_and_compare(out, out_shape, o.out, o.expect, o.atol, o.rtol);
}

// `rpe term --mapping alibi2d --heads H --grid HxW`: CROMA's fixed bias, (1, H, L, L) ((1, H, L,
// L_k) with --key-positions), from the generated table; no --table, no --input.
int run_alibi_term(const mapping_config& m, const grid_size& g, const positions_input* pos, const positions_input* kpos,
                   const term_options& o) {
    if ((o.mode_given && o.mode != "bias") || (o.target_given && o.target != "k" && o.target != "key"))
        throw usage_error("--mode/--target",
                          m.family.family + " is a bias term on keys; drop --mode/--target or pass --mode bias --target k");
    if (!o.tables.empty()) throw usage_error("--table", m.family.family + " has a fixed, generated table; drop --table");
    if (!o.input.empty()) throw usage_error("--input", "bias mode reads no input; drop --input");
    if (o.heads < 1) throw usage_error("--heads", m.family.family + " needs --heads >= 1 (one slope per head)");
    const rpe::vit::alibi_2d_config c{.height = g.height, .width = g.width, .num_heads = o.heads, .head_dim = 1, .skip = o.skip};
    std::unique_ptr<rpe::any_term<float>> term;
    std::shared_ptr<const rpe::bucket_ids> ids;
    std::vector<float> table;
    try {
        term = rpe::make_any_term(rpe::vit::make_alibi_2d_term<float>(c));
        table = rpe::vit::alibi_2d_table<float>(c);
        ids = layout_ids(*term, g, pos, kpos);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(blame(pos, "--heads/--grid/--skip", kpos), e.what());
    } catch (const rpe::out_of_range& e) {
        throw usage_error(blame(pos, "--grid", kpos), e.what());
    }
    const std::int64_t L = o.skip + grid_tokens(g, pos), Lk = kpos ? o.skip + kpos->tokens : L;
    const std::vector<std::int64_t> out_shape{1, o.heads, L, Lk};
    std::vector<float> out(checked_elements(out_shape, blame(pos, "--grid", kpos).c_str(), "the output"));
    const std::vector<rpe::tensor_ref<const float>> refs{view<const float>(table.data(), term->table_shape())};
    term->forward(*ids, refs, {}, view<float>(out.data(), out_shape), rpe::write::overwrite);
    const auto slopes = rpe::vit::alibi_slopes(o.heads);
    std::cout << "term: " << m.describe() << ", bias on k, " << layout_text(g, pos, kpos) << ", skip " << o.skip
              << ", K = " << term->num_buckets() << "\nslopes:";
    for (const double sl : slopes) std::cout << " " << sl;
    std::cout << "\n";
    return finish(out, out_shape, o);
}

// `rpe term --mapping decomposed --table rel_pos_h.npy --table rel_pos_w.npy --input qs.npy`:
// SAM's two tables (Lh, C), (Lw, C) loaded into the Cross term (resized when their length is
// not 2H - 1 / 2W - 1, times D^1/2 for SAM's unscaled q); x = q*s (B, H, L, D) as every
// contextual key term takes it, so out = SAM's rel_h + rel_w added to the logits ((B, H, L, L_k)
// with --key-positions).
int run_decomposed_term(const mapping_config& m, const grid_size& g, const positions_input* pos, const positions_input* kpos,
                        const term_options& o) {
    if ((o.mode_given && o.mode != "contextual" && o.mode != "ctx") || (o.target_given && o.target != "k" && o.target != "key"))
        throw usage_error("--mode/--target", m.family.family + " is a contextual term on keys; drop --mode/--target");
    if (o.tables.size() != 2)
        throw usage_error("--table", "got " + std::to_string(o.tables.size()) + " table(s); " + m.family.family +
                                         " needs 2 (SAM's rel_pos_h, then rel_pos_w)");
    if (o.input.empty()) throw usage_error("--input", m.family.family + " needs an input x = q*s (B, H, L, D)");
    const auto th = load_option_npy(o.tables[0], "--table"), tw = load_option_npy(o.tables[1], "--table");
    for (const auto* t : {&th, &tw}) {
        const auto& f = o.tables[t == &th ? 0 : 1];
        if (t->shape.size() != 2)
            throw usage_error("--table", f + " has shape " + rpe::detail::shape_string(t->shape) + "; expected (length, C)");
        check_int_extents(t->shape, "--table", f);
    }
    const auto x = load_option_npy(o.input, "--input");
    if (x.shape.size() != 4)
        throw usage_error("--input", o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, L, D)");
    check_int_extents(x.shape, "--input", o.input, 1);
    const std::int64_t L = o.skip + grid_tokens(g, pos);
    if (x.shape[2] != L)
        throw usage_error(blame(pos, "--input/--grid/--skip"),
                          o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected L = " + std::to_string(L));
    const rpe::vit::decomposed_rel_pos_config c{.height = g.height,
                                                .width = g.width,
                                                .num_heads = static_cast<int>(x.shape[1]),
                                                .head_dim = static_cast<int>(x.shape[3]),
                                                .skip = o.skip};
    const auto h = to_float32(th, "--table", o.tables[0]), w = to_float32(tw, "--table", o.tables[1]),
               xd = to_float32(x, "--input", o.input);
    std::unique_ptr<rpe::any_term<float>> term;
    std::shared_ptr<const rpe::bucket_ids> ids;
    std::vector<float> t0, t1;
    try {
        const auto t = rpe::vit::make_decomposed_rel_pos_term<float>(c);
        term = rpe::make_any_term(t);
        const auto shape = t.table_shape();
        t0.resize(static_cast<std::size_t>(shape[1] * shape[2]));
        t1.resize(t0.size());
        rpe::vit::load_decomposed_rel_pos<float>(c, view<const float>(h.data(), th.shape), view<const float>(w.data(), tw.shape),
                                                 {view<float>(t0.data(), shape), view<float>(t1.data(), shape)});
        ids = layout_ids(*term, g, pos, kpos);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(blame(pos, "--table/--input/--grid/--skip", kpos), e.what());
    } catch (const rpe::out_of_range& e) {
        throw usage_error(blame(pos, "--grid", kpos), e.what());
    }
    const std::int64_t Lk = kpos ? o.skip + kpos->tokens : L;
    const std::vector<std::int64_t> out_shape{x.shape[0], x.shape[1], L, Lk};
    std::vector<float> out(checked_elements(out_shape, blame(pos, "--grid", kpos).c_str(), "the output"));
    const auto shape = term->table_shape();
    const std::vector<rpe::tensor_ref<const float>> refs{view<const float>(t0.data(), shape),
                                                         view<const float>(t1.data(), shape)};
    term->forward(*ids, refs, view<const float>(xd.data(), x.shape), view<float>(out.data(), out_shape), rpe::write::overwrite);
    std::cout << "term: " << m.describe() << ", contextual on k, " << layout_text(g, pos, kpos) << ", skip " << o.skip
              << ", K = " << term->num_buckets() << " per table, tables x D^1/2 (SAM's unscaled q)\n";
    return finish(out, out_shape, o);
}

}  // namespace

// The elements as float32; a finite float64 value beyond float32's range is refused instead of
// becoming ±infinity.
std::vector<float> to_float32(const rpe::io::npy_array& a, const char* option, const std::string& file) {
    std::vector<float> out = a.to<float>();
    if (a.dtype == "<f4" || std::none_of(out.begin(), out.end(), [](float v) { return std::isinf(v); })) return out;
    const std::vector<double> wide = a.to<double>();
    for (std::size_t i = 0; i < out.size(); ++i)
        if (std::isinf(out[i]) && std::isfinite(wide[i])) {
            std::ostringstream text;
            text << file << ": element " << i << " = " << std::setprecision(17) << wide[i]
                 << " is beyond float32's range (|x| <= 3.4028234663852886e+38); "
                 << "the term computes in float32";
            throw usage_error(option, text.str());
        }
    return out;
}

void check_output_options(const std::string& out, const std::string& expect, double atol, double rtol) {
    for (const auto& [option, value] : {std::pair<const char*, double>{"--atol", atol}, {"--rtol", rtol}})
        if (!(value >= 0) || !std::isfinite(value)) {
            std::ostringstream text;
            text << value << " is not a tolerance; expected a finite number >= 0";
            throw usage_error(option, text.str());
        }
    if (!expect.empty() && !out.empty() && same_file(out, expect))
        throw usage_error("--out/--expect", "'" + out + "' and '" + expect +
                                                "' are the same file; the comparison would read what was just written");
}

int write_and_compare(const std::vector<float>& out, const std::vector<std::int64_t>& out_shape, const std::string& out_path,
                      const std::string& expect, double atol, double rtol) {
    std::cout << "out " << rpe::detail::shape_string(out_shape) << " float32\n";
    if (!out_path.empty()) {
        rpe::io::save_npy(out_path, out.data(), out_shape);
        std::cout << "wrote " << out_path << "\n";
    }
    if (!expect.empty()) {
        const auto ref = load_option_npy(expect, "--expect");
        if (ref.shape != out_shape) {
            std::cout << "expect: " << expect << " has shape " << rpe::detail::shape_string(ref.shape) << "; MISMATCH\n";
            return 1;
        }
        const auto want = ref.to<double>();
        double worst = 0;
        std::size_t bad = 0, nan_mismatch = 0;
        for (std::size_t i = 0; i < want.size(); ++i) {
            const double got = out[i];
            if (std::isnan(got) || std::isnan(want[i])) {  // NaN matches NaN only
                nan_mismatch += std::isnan(got) != std::isnan(want[i]);
                continue;
            }
            const double d = got == want[i] ? 0.0 : std::fabs(got - want[i]);  // inf == inf: no difference
            worst = std::max(worst, d);
            bad += !(d <= atol + rtol * std::fabs(want[i]));
        }
        bad += nan_mismatch;
        std::cout << "expect: max |out - expected| = " << worst << " over " << want.size() << " values, " << bad
                  << " beyond atol + rtol*|expected|";
        if (nan_mismatch != 0) std::cout << " (" << nan_mismatch << " NaN in one and not the other)";
        std::cout << "; " << (bad == 0 ? "match" : "MISMATCH") << "\n";
        return bad == 0 ? 0 : 1;
    }
    return 0;
}

std::unique_ptr<rpe::any_term<float>> make_cli_term(const mapping_config& m, const rpe::term_spec& spec) {
    if (!spec.contextual && spec.target == rpe::target::value)
        throw usage_error("--mode/--target",
                          "bias mode on values does not exist (paper eq. 17); use --mode contextual or --target q/k");
    // every family through the registry: the mapping of m.family, in any mode and target (rpe
    // bench times decomposed and alibi2d on every slot)
    const rpe::term_options o{.contextual = spec.contextual,
                              .target = spec.target,
                              .num_heads = spec.num_heads,
                              .head_dim = spec.head_dim,
                              .shared_head = spec.shared_head,
                              .skip = spec.skip};
    return rpe::visit_mapping(m.family, {m.window.height, m.window.width},
                              [&](const auto& mapping) { return rpe::term_of<float>(mapping, o); });
}

int run_term(const mapping_config& mc, const term_options& o) {
    if (!o.key_positions.empty() && o.positions.empty()) (void)load_key_positions(o.key_positions, o.positions);  // refused
    check_grid_or_positions(!o.grid.empty(), o.positions);
    std::optional<positions_input> positions;
    if (!o.positions.empty()) positions = load_positions(o.positions);
    const std::optional<positions_input> key_positions = load_key_positions(o.key_positions, o.positions);
    const positions_input* pos = positions ? &*positions : nullptr;
    const positions_input* kpos = key_positions ? &*key_positions : nullptr;
    // at positions, their box (with key positions, the box of both): swin's default window
    const auto g = kpos ? joint_box(*pos, *kpos) : pos ? pos->box : parse_grid(o.grid, "--grid");
    const mapping_config m = mc.for_grid(g);
    if (pos) check_positions_window(m, g, kpos != nullptr);
    check_output_options(o.out, o.expect, o.atol, o.rtol);
    if (m.vit == vit_kind::alibi2d) return run_alibi_term(m, g, pos, kpos, o);
    if (m.vit == vit_kind::decomposed) return run_decomposed_term(m, g, pos, kpos, o);
    rpe::term_spec spec;
    try {
        spec.contextual = rpe::parse_contextual(o.mode);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--mode", e.what());
    }
    try {
        spec.target = rpe::parse_target(o.target);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error("--target", e.what());
    }
    if (static_cast<int>(o.tables.size()) != m.num_tables())
        throw usage_error("--table", "got " + std::to_string(o.tables.size()) + " table(s); " + m.name + " needs " +
                                         std::to_string(m.num_tables()) + (m.num_tables() == 2 ? " (rows, then cols)" : ""));
    std::vector<rpe::io::npy_array> tables;
    for (const auto& path : o.tables) tables.push_back(load_option_npy(path, "--table"));
    std::vector<std::vector<float>> table_data;
    for (std::size_t t = 0; t < tables.size(); ++t) table_data.push_back(to_float32(tables[t], "--table", o.tables[t]));
    // a (K, H) table (timm's layout; swinv2: the CPB MLP's output) becomes the term's (H, K)
    const bool swinv2 = m.kind == mapping_kind::swinv2;
    if (swinv2 || o.timm_table) {
        if (spec.contextual || spec.target != rpe::target::key)
            throw usage_error("--mode/--target", (swinv2 ? m.family.family : std::string("--timm-table")) +
                                                     " is a bias on keys; use --mode bias --target k");
        if (tables[0].shape.size() != 2)
            throw usage_error("--table",
                              o.tables[0] + " has shape " + rpe::detail::shape_string(tables[0].shape) + "; expected (K, H)");
        check_int_extents(tables[0].shape, "--table", o.tables[0]);
        const std::vector<std::int64_t> kh = tables[0].shape, hk{kh[1], kh[0]};
        std::vector<float> t(table_data[0].size());
        try {
            if (swinv2) {
                const rpe::cpb_bias<float> cpb(m.swin(), {.num_heads = static_cast<int>(kh[1]),
                                                          .sigmoid16 = m.sigmoid16,
                                                          .pretrained_h = m.pretrained.height,
                                                          .pretrained_w = m.pretrained.width});
                cpb.make_table(view<const float>(table_data[0].data(), kh), view<float>(t.data(), hk));
            } else {
                rpe::table_from_timm(view<const float>(table_data[0].data(), kh), view<float>(t.data(), hk));
            }
        } catch (const rpe::invalid_argument& e) {
            throw usage_error("--table/--window/--pretrained", e.what());
        }
        table_data[0] = std::move(t);
        tables[0].shape = hk;
    }
    const auto& ts = tables[0].shape;
    // L queries; L_k keys: L but for --key-positions of another count
    const std::int64_t L = o.skip + grid_tokens(g, pos), Lk = kpos ? o.skip + kpos->tokens : L;
    const bool value = spec.target == rpe::target::value, query = spec.target == rpe::target::query;
    // the input's rows and columns by name: k (B, H, L, D), q (B, H, L_k, D), v (B, H, L, L_k)
    const std::string rows_name = kpos && query ? "L_k" : "L", cols_name = !value ? "D" : kpos ? "L_k" : "L";
    const std::size_t want_rank = spec.contextual ? 3 : 2;
    for (std::size_t t = 0; t < tables.size(); ++t) {  // every table (Cross has two), before any view is made
        if (tables[t].shape.size() != want_rank)
            throw usage_error(
                "--table", o.tables[t] + " has shape " + rpe::detail::shape_string(tables[t].shape) + "; expected " +
                               (spec.contextual ? (spec.target == rpe::target::value ? "(Ht, K, D)" : "(Ht, D, K)") : "(Ht, K)"));
        check_int_extents(tables[t].shape, "--table", o.tables[t]);
    }

    rpe::io::npy_array x;
    std::vector<float> x_data;
    std::vector<std::int64_t> out_shape;
    if (spec.contextual) {
        if (o.input.empty()) throw usage_error("--input", "contextual mode needs an input x");
        x = load_option_npy(o.input, "--input");
        if (x.shape.size() != 4)
            throw usage_error("--input", o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, " +
                                             rows_name + ", " + cols_name + ")");
        check_int_extents(x.shape, "--input", o.input, 1);  // H, L, D (or L); B stays int64
        x_data = to_float32(x, "--input", o.input);
        spec.num_heads = static_cast<int>(x.shape[1]);
        spec.head_dim = static_cast<int>(spec.target == rpe::target::value ? ts[2] : ts[1]);
        out_shape = {x.shape[0], x.shape[1], L, value ? spec.head_dim : Lk};
    } else {
        if (!o.input.empty()) throw usage_error("--input", "bias mode reads no input; drop --input");
        spec.num_heads = static_cast<int>(ts[0]);
        out_shape = {1, ts[0], L, Lk};
    }
    spec.shared_head = ts[0] == 1;
    spec.skip = o.skip;
    // the term checks every shape against the grid, skip and tables; its message names the tensor
    const std::string culprits = blame(pos, spec.contextual ? "--table/--input/--grid/--skip" : "--table/--grid/--skip", kpos);
    std::unique_ptr<rpe::any_term<float>> term;
    std::shared_ptr<const rpe::bucket_ids> ids;
    try {
        term = make_cli_term(m, spec);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(culprits, e.what());
    }
    try {
        ids = layout_ids(*term, g, pos, kpos);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(kpos ? "--positions/--key-positions/--skip" : pos ? "--positions/--skip" : culprits, e.what());
    } catch (const rpe::out_of_range& e) {
        throw usage_error(blame(pos, "--grid", kpos), e.what());
    }

    // The term checks every shape in forward(); the shapes that size the output are checked
    // here first, so that no output is sized from an extent the term would refuse.
    for (std::size_t t = 0; t < tables.size(); ++t)
        if (tables[t].shape != term->table_shape())
            throw usage_error("--table", o.tables[t] + " has shape " + rpe::detail::shape_string(tables[t].shape) +
                                             "; expected " + rpe::detail::shape_string(term->table_shape()) +
                                             " for this mapping, mode, target and skip");
    const std::int64_t want_rows = query ? Lk : L, want_cols = value ? Lk : spec.head_dim;
    if (spec.contextual && (x.shape[2] != want_rows || x.shape[3] != want_cols))
        throw usage_error(blame(pos, "--input/--grid/--skip", kpos),
                          o.input + " has shape " + rpe::detail::shape_string(x.shape) + "; expected (B, H, " + rows_name +
                              " = " + std::to_string(want_rows) + ", " + cols_name + " = " + std::to_string(want_cols) + ")");
    // the output is sized from --grid/--skip (and the input): capped before it is allocated
    double out_elems = 1.0;
    for (const auto e : out_shape) out_elems *= static_cast<double>(e);
    if (out_elems * sizeof(float) > static_cast<double>(max_output_bytes))
        throw usage_error(blame(pos, spec.contextual ? "--input/--grid/--skip" : "--grid/--skip", kpos),
                          "the output " + rpe::detail::shape_string(out_shape) +
                              " would take more than 4 GiB; expected a smaller grid or input");
    std::vector<float> out(checked_elements(out_shape, blame(pos, "--grid", kpos).c_str(), "the output"));
    std::vector<rpe::tensor_ref<const float>> refs;
    for (std::size_t t = 0; t < tables.size(); ++t) refs.push_back(view<const float>(table_data[t].data(), tables[t].shape));
    try {
        term->forward(*ids, refs, spec.contextual ? view<const float>(x_data.data(), x.shape) : rpe::tensor_ref<const float>{},
                      view<float>(out.data(), out_shape), rpe::write::overwrite);
    } catch (const rpe::invalid_argument& e) {
        throw usage_error(culprits, e.what());
    }
    std::cout << "term: " << m.describe() << ", " << (spec.contextual ? "contextual" : "bias") << " on "
              << (spec.target == rpe::target::query ? "q"
                  : spec.target == rpe::target::key ? "k"
                                                    : "v")
              << ", " << layout_text(g, pos, kpos) << ", skip " << o.skip << ", K = " << term->num_buckets() << "\n";
    return finish(out, out_shape, o);
}

}  // namespace rpe_cli
