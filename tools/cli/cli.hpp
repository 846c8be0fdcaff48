// The `rpe` command-line tool: declarations shared by its translation units.
//
// main.cpp    argument parsing (CLI11), mapping names, `rpe buckets`, `rpe show` (ASCII + PNG)
// term.cpp    run-time terms (rpe::make_term for the 2D mappings, rpe::make_any_term for the 1D
//             ones) and `rpe term`
// bench.cpp   `rpe bench`
//
// Exit status: 0 success, 1 failure (unreadable file, a result that does not match --expect),
// 2 usage error (unknown option, bad value); the message names the option.
#pragma once

#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <rpe/any_term.hpp>
#include <rpe/bucket_cache.hpp>
#include <rpe/io/npy.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/shaw.hpp>
#include <rpe/mapping/swin.hpp>
#include <rpe/mapping/t5.hpp>
#include <rpe/families.hpp>
#include <rpe/make_term.hpp>

namespace rpe_cli {

/// A bad command line: `option` is the option to blame (e.g. "--grid"), exit status 2.
struct usage_error : std::runtime_error {
    std::string option;
    usage_error(std::string opt, const std::string& what) : std::runtime_error(what), option(std::move(opt)) {}
};

/// The mapping options as typed (shared by every subcommand).
struct mapping_options {
    std::string index = "piecewise";           ///< --index piecewise|clip (2D mappings)
    double ratio = 1.9;                        ///< --ratio r: α = r, β = 2r, γ = 8r (the reference's)
    std::optional<double> alpha, beta, gamma;  ///< --alpha/--beta/--gamma override the ratio's
    int k = 16;                                ///< --k (shaw)
    int buckets = 32;                          ///< --buckets (t5)
    int max_distance = 128;                    ///< --max-distance (t5)
    std::string window;                        ///< --window HxW (swin, beit, swinv2; default: the grid)
    std::string pretrained;                    ///< --pretrained HxW (swinv2's pre-training window; default: none)
    bool no_sigmoid = false;                   ///< --no-sigmoid (swinv2: the table is the MLP output itself)
};

/// A grid `HxW` (or `L`, meaning 1xL). @throws usage_error naming `option`.
struct grid_size {
    int height = 0, width = 0;
};
grid_size parse_grid(const std::string& text, const char* option);

/// The tokens of `--positions P.npy`: (N, A) integer coordinates, (row, col) or (t, row, col),
/// as int32, and their bounding box (rows x cols) as the grid of the grid-dependent mappings
/// (swin's default window, decomposed's and alibi2d's β).
struct positions_input {
    std::string path;                  ///< the file
    std::vector<std::int32_t> coords;  ///< (tokens, axes), C order
    std::int64_t tokens = 0;           ///< N
    int axes = 2;                      ///< 2 or 3
    grid_size box{};                   ///< rows x cols spanned
    [[nodiscard]] rpe::tensor_ref<const std::int32_t> ref() const { return {coords.data(), {tokens, axes}}; }
};
/// Reads the .npy file `path` of an option. @throws usage_error(option) with the reader's message
/// (`[rpe.npy] <path>: ...`) for a file it cannot read: not a .npy, Fortran order, big-endian,
/// truncated.
rpe::io::npy_array load_option_npy(const std::string& path, const char* option);
/// Reads `--positions P.npy` (or, `option` "--key-positions", the keys' K.npy): an integer .npy
/// (int8 ... int64, uint*) of shape (N, 2) or (N, 3), N >= 1, values that fit int32 (the library
/// checks |value| <= rpe::max_position).
/// @throws usage_error(option) naming the file, its dtype or shape, or the value, or for a file
/// load_option_npy refuses.
positions_input load_positions(const std::string& path, const char* option = "--positions");
/// Exactly one of --grid (typed: `grid_given`) and --positions. @throws usage_error("--grid/--positions").
void check_grid_or_positions(bool grid_given, const std::string& positions);
/// Reads `--key-positions K.npy` (the keys' positions, any count: (L, L_k) ids), or nothing when
/// `key_positions` is empty. @throws usage_error("--key-positions") naming the file when it is
/// given without --positions (`positions` empty), or for what load_positions refuses.
std::optional<positions_input> load_key_positions(const std::string& key_positions, const std::string& positions);
/// The (rows, cols) box spanned by the positions of `a` and `b` together (their last two axes):
/// the grid of the grid-dependent mappings with --key-positions.
grid_size joint_box(const positions_input& a, const positions_input& b);

/// Which family a mapping name belongs to (user: a family a --plugin added to the registry).
enum class mapping_kind { two_d, shaw, t5, swin, beit, swinv2, user };

/// A vision-transformer encoding on a built-in 2D mapping whose β follows the grid
/// (β = max(H, W) − 1): SAM's decomposed relative position (cross, clip index) or CROMA's 2D
/// ALiBi (product, clip index, fixed table).
enum class vit_kind { none, decomposed, alibi2d };

/// A resolved, validated mapping: its registry spec (rpe::family_spec, which builds its ids and
/// terms through rpe::visit_mapping), and the same read into the fields the commands print.
struct mapping_config {
    std::string name;         ///< as typed, e.g. "product", "t5_causal" (without ":params")
    rpe::family_spec family;  ///< the registry spec (window_h/w set by for_grid)
    mapping_kind kind = mapping_kind::two_d;
    rpe::term_spec spec;        ///< method, index, α, β, γ (2D); mode/target/heads set per command
    rpe::mapping::shaw shaw{};  ///< kind == shaw
    rpe::mapping::t5 t5{};      ///< kind == t5
    grid_size window{};         ///< swin, beit, swinv2: the window; 0x0 = the grid of the command (for_grid)
    grid_size pretrained{};     ///< swinv2: pre-training window, 0x0 = none
    bool sigmoid16 = true;      ///< swinv2: table = 16*sigmoid(MLP output)
    /// The same mapping for the grid `g`: an unset window taken from it (swin, beit, swinv2), β =
    /// max(H, W) − 1 (decomposed, alibi2d). @throws usage_error("--grid") for a grid they refuse.
    [[nodiscard]] mapping_config for_grid(const grid_size& g) const;
    /// The Swin window (kinds swin, swinv2; beit's grid index).
    [[nodiscard]] rpe::mapping::swin swin() const { return {window.height, window.width}; }
    vit_kind vit = vit_kind::none;               ///< decomposed / alibi2d: spec.beta is set per grid (for_grid)
    [[nodiscard]] std::string describe() const;  ///< one line, e.g. "product (piecewise alpha=1.9 ...)"
    [[nodiscard]] int num_tables() const { return kind == mapping_kind::two_d && spec.method == rpe::method::cross ? 2 : 1; }
};
/// For the window mappings (swin, swinv2, beit) at positions: the positions' bounding box `box`
/// (the queries' and keys' together with `key_positions`) must fit the window of `m` (after
/// for_grid). @throws usage_error("--positions/--window") naming the box and the window (the
/// library's message would call the box a grid).
void check_positions_window(const mapping_config& m, const grid_size& box, bool key_positions);

/// Mapping names understood by --mapping, for messages: the registry's (plugins' included).
std::string mapping_names();

/// The names of the registry's families of `group` ("irpe": the four of --all).
std::vector<std::string> family_group(const std::string& group);

/// Loads the shared libraries of --plugin (dlopen): their RPE_REGISTER_MAPPING families join the
/// registry. @throws usage_error("--plugin") naming the file and dlerror(), or the file and the
/// registry's refusal of one of its mappings (`[rpe.registry] name = 'euc'; already registered
/// (euclidean)`); rpe::invalid_argument for a refusal recorded before any plugin was loaded.
void load_plugins(const std::vector<std::string>& paths);

/// Resolves --mapping (`name` or `name:param=value,...`) and its parameters: the options
/// (--ratio, --k, --window, ...) set the family's parameters of those names, then the text's
/// `param=value` ones. @throws usage_error naming the option at fault.
mapping_config resolve_mapping(const std::string& name, const mapping_options& o);

/// Whether two paths name the same existing file (a link and its target included).
bool same_file(const std::string& a, const std::string& b);

/// The elements of `a` as float32. @throws usage_error(option) for a finite float64 value beyond
/// float32's range (it would become infinity).
std::vector<float> to_float32(const rpe::io::npy_array& a, const char* option, const std::string& file);

/// @throws usage_error for a NaN, infinite or negative --atol/--rtol, or --out and --expect
/// naming the same file.
void check_output_options(const std::string& out, const std::string& expect, double atol, double rtol);

/// Prints the output's shape, writes `out_path` (if any), compares with `expect` (if any: NaN
/// matches NaN only; |out − expected| <= atol + rtol·|expected| elsewhere); the exit status.
int write_and_compare(const std::vector<float>& out, const std::vector<std::int64_t>& out_shape, const std::string& out_path,
                      const std::string& expect, double atol, double rtol);

/// Bucket ids of the mapping on a height × width grid after `skip` tokens (no cache).
/// @throws usage_error("--grid") when the grid is too large for the id storage.
std::shared_ptr<const rpe::bucket_ids> build_ids(const mapping_config& m, int height, int width, int skip);

/// The term of mapping `m` with mode, target, heads, head_dim, shared_head and skip from `spec`.
std::unique_ptr<rpe::any_term<float>> make_cli_term(const mapping_config& m, const rpe::term_spec& spec);

/// Options of `rpe term`.
struct term_options {
    std::string mode = "contextual", target = "k", grid, positions;  ///< positions: --positions P.npy (instead of --grid)
    std::string key_positions;  ///< --key-positions K.npy (with --positions): keys of their own count, output (..., L, L_k)
    int skip = 0;
    std::vector<std::string> tables;
    std::string input, out, expect;
    double atol = 1e-5, rtol = 1e-4;
    bool timm_table = false;    ///< --timm-table: the bias table is timm's (K, H) layout
    int heads = 0;              ///< --heads (alibi2d: one slope per head; its table is generated)
    bool mode_given = false;    ///< --mode was typed (alibi2d accepts only bias)
    bool target_given = false;  ///< --target was typed
};
int run_term(const mapping_config& m, const term_options& o);

/// Options of `rpe rope` (defaults: rope-vit's RoPE-Axial θ = 100; for cat, EVA-02's
/// configuration: temperature 10000, integer coordinates, 'ij').
struct rope_options {
    std::string form = "axial", grid, input, out, expect, freqs, ref_grid, layout, positions;
    std::string normalize = "separate", shift = "0,0", jitter = "1,1";  // dinov3
    std::string sections = "16,24,24";                                  // mrope
    bool interleaved = false;                                           // mrope
    // The options given on the command line ("--theta", ...): a form's parameter keeps the form's
    // default unless given; an option of another form's parameter is a usage error.
    std::set<std::string> given;
    int skip = 0, suffix = 0;
    int repeat = 1;  // --repeat: copies of the --grid HxW (SAM2's memory keys)
    double base = 100.0, min_period = 0.0, max_period = 0.0, rescale = 1.0;  // dinov3
    double theta = 100.0, temperature = 10000.0, max_res = 224.0, grid_offset = 0.0;
    bool in_pixels = false, linear_bands = false, xy = false;
    double atol = 1e-5, rtol = 1e-4;
};
int run_rope(const rope_options& o);

/// Options of `rpe bench`.
struct bench_options {
    std::string grid = "14x14", mode = "contextual";
    int skip = 1, batch = 8, heads = 6, dim = 64;
    int repeat = 7, warmup = 1;                         ///< interleaved timed rounds, untimed rounds before them
    std::vector<std::string> passes{"fwd", "fwd_bwd"};  ///< fwd: forward; fwd_bwd: forward + backward
    std::string format = "table";                       ///< table or csv
};
int run_bench(const std::vector<mapping_config>& maps, const bench_options& o);

}  // namespace rpe_cli
