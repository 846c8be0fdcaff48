/// @file vit_digits.hpp
/// @brief A small DeiT with iRPE attention (the reference's `RPEAttention` / `RPEBlock` /
/// `VisionTransformer`), loaded from a `.safetensors` file and run in inference on the CPU with
/// Eigen and the library's fused attention, rpe::attention_forward: the model of
/// examples/vit/vit_model.hpp (which has the forward) on the weights of a file.
///
/// The model of examples/data/digits (README.md there has the equations):
///
///   image (Cin, S, S) → patch embedding (Conv2d, kernel = stride = P) → G×G patch tokens
///   (G = S / P, patch p = G·r + c) → class token prepended (token 0) → + pos_embed (all L =
///   1 + G² tokens) → depth × pre-norm block [z += proj(attn_rpe(LN1 z)); z += fc2 GELU(fc1 LN2 z)]
///   → LN of the class token → head → logits (num_classes).
///
/// Every hyperparameter comes from the file's `__metadata__` (see vit_digits_config); the
/// tensors keep the names and layouts of the DeiT / timm `state_dict`. In float the weights are
/// used in place (row-major Eigen maps over the file's aligned buffer, no copy); in double they
/// are converted once at load.
#pragma once

// rpe first: its headers bring in Eigen and the x86 intrinsics without g++ 12's AVX-512 false
// positives (rpe/backend/cpu/eigen.hpp), which the first inclusion decides.
#include <rpe/io/safetensors.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "../vit/vit_model.hpp"

namespace rpe::examples {

/// @brief The model's hyperparameters, all read from the safetensors `__metadata__`: `img_size`,
/// `patch_size`, `in_chans`, `embed_dim`, `depth`, `num_heads`, `mlp_hidden_dim`, `num_classes`,
/// `qkv_bias` (default true), `layer_norm_eps`, `rpe_on`, `rpe_num_buckets`, and the iRPE settings
/// `rpe_method`, `rpe_mode`, `rpe_alpha`/`rpe_beta`/`rpe_gamma` or `rpe_ratio`,
/// `rpe_shared_head`, `rpe_skip` (no RoPE).
using vit_digits_config = vit_config;
/// @brief Intermediate tensors of a forward (vit_trace).
template <class S>
using vit_digits_trace = vit_trace<S>;
/// @brief Seconds per stage of a forward (vit_stage_times).
using vit_digits_stage_times = vit_stage_times;

/// @brief Reproduces the data set's preprocessing of raw digits: bilinear upsampling
/// (PyTorch `F.interpolate(mode="bilinear", align_corners=False)`) from (N, in, in) to
/// (N, 1, out, out), then `(x / max_value − mean) / std`.
/// @param raw (N, in, in) values 0..max_value, row-major.
/// @return (N, 1, out, out) row-major.
/// @throws rpe::invalid_argument when `raw.size()` is not a multiple of in², or a size < 1.
template <class S>
[[nodiscard]] std::vector<S> preprocess_digits(const std::vector<std::uint8_t>& raw, int in, int out, double max_value = 16.0,
                                               double mean = 0.5, double std_dev = 0.5) {
    rpe::detail::require(in >= 1 && out >= 1, "vit_digits", "preprocess sizes in = ", in, ", out = ", out, "; expected >= 1");
    const std::size_t per = static_cast<std::size_t>(in) * in;
    rpe::detail::require(raw.size() % per == 0, "vit_digits", "raw digits hold ", raw.size(), " values; expected a multiple of ",
                         per);
    const std::size_t n = raw.size() / per;
    // PyTorch (align_corners=False): src = max(scale·(o + 0.5) − 0.5, 0), scale = in / out.
    std::vector<int> i0(static_cast<std::size_t>(out)), i1(static_cast<std::size_t>(out));
    std::vector<S> w(static_cast<std::size_t>(out));
    const S scale = static_cast<S>(in) / static_cast<S>(out);
    for (int o = 0; o < out; ++o) {
        const S s = std::max(scale * (static_cast<S>(o) + S(0.5)) - S(0.5), S(0));
        const int lo = std::min(static_cast<int>(s), in - 1);
        i0[o] = lo;
        i1[o] = std::min(lo + 1, in - 1);
        w[o] = s - static_cast<S>(lo);
    }
    std::vector<S> result(n * static_cast<std::size_t>(out) * out), rows(static_cast<std::size_t>(out) * in);
    for (std::size_t img = 0; img < n; ++img) {
        const std::uint8_t* src = raw.data() + img * per;
        for (int o = 0; o < out; ++o)  // rows first
            for (int c = 0; c < in; ++c)
                rows[o * in + c] =
                    (S(1) - w[o]) * static_cast<S>(src[i0[o] * in + c]) + w[o] * static_cast<S>(src[i1[o] * in + c]);
        S* dst = result.data() + img * out * out;
        for (int r = 0; r < out; ++r)  // then columns
            for (int o = 0; o < out; ++o) {
                const S v = (S(1) - w[o]) * rows[r * in + i0[o]] + w[o] * rows[r * in + i1[o]];
                dst[r * out + o] = (v / static_cast<S>(max_value) - static_cast<S>(mean)) / static_cast<S>(std_dev);
            }
    }
    return result;
}

/// @brief DeiT + iRPE classifier for small images, in scalar type S (float or double), loaded
/// from a `.safetensors` file: a vit_model (forward, chunks, threads, thread-safety: see there)
/// that keeps the file (float: the weights are views into its buffer) or its converted weights
/// (double) alive.
///
/// Usage:
/// @code
///   auto model = rpe::examples::vit_digits<float>::load("deit_irpe_digits_a.safetensors");
///   model.forward(rpe::tensor_ref<const float>(images, {n, 1, 16, 16}),
///                 rpe::tensor_ref<float>(logits, {n, 10}));
/// @endcode
/// forward() throws `[rpe.vit_model] ...` for a shape that does not match the config.
template <class S = float>
class vit_digits : public vit_model<S> {
public:
    /// @brief Loads weights and configuration from a `.safetensors` file (F32 tensors, DeiT
    /// state-dict names; see examples/data/digits/README.md).
    /// @throws rpe::runtime_error for an unreadable or malformed file (rpe::io::safetensors_file);
    ///   rpe::invalid_argument `[rpe.vit_digits] ...` for a missing or unparsable metadata key, an
    ///   unsupported setting (class_token false, activation other than gelu_erf, img_size not a
    ///   multiple of patch_size, img_size / patch_size beyond 46340 (tokens beyond int), embed_dim
    ///   not a multiple of num_heads, a Cross method),
    ///   `rpe_num_buckets` differing from the library's K, a missing tensor or one of another
    ///   shape or dtype; and what rpe::make_term throws for an invalid iRPE configuration.
    [[nodiscard]] static vit_digits load(const std::string& path) { return vit_digits(rpe::io::safetensors_file::load(path)); }

    /// @brief Builds the model from an already loaded file (the views stay valid: the model keeps
    /// a copy of the file object, which shares its buffer). @throws as load().
    explicit vit_digits(rpe::io::safetensors_file file) : vit_model<S>(loader(std::move(file)).model()) {}

private:
    /// Reads the configuration and the weights of a file; model() builds the vit_model on them.
    class loader {
    public:
        explicit loader(rpe::io::safetensors_file file) : owned_(std::make_shared<storage>(std::move(file))) {}

        vit_model<S> model() {
            build();
            return vit_model<S>(cfg_, std::move(w_), owned_);
        }

    private:
        /// What the weights point into: the file (float), or the converted copies (double).
        struct storage {
            explicit storage(rpe::io::safetensors_file f) : file(std::move(f)) {}
            rpe::io::safetensors_file file;
            std::deque<std::vector<S>> converted;  // double: stable addresses
        };
        const rpe::io::safetensors_file& file_() const { return owned_->file; }

        std::string meta(const char* key) const {
            try {
                return file_().metadata_value(key);
            } catch (const rpe::invalid_argument&) {
                throw rpe::invalid_argument(
                    rpe::detail::message("vit_digits", file_().file_name(), ": metadata key '", key,
                                         "' is missing; the model reads every hyperparameter from __metadata__"));
            }
        }
        bool has_meta(const char* key) const { return file_().metadata().count(key) != 0; }

        template <class T>
        T meta_number(const char* key) const {
            const std::string text = meta(key);
            T value{};
            const char* end = text.data() + text.size();
            const auto [ptr, ec] = std::from_chars(text.data(), end, value);
            if (ec != std::errc() || ptr != end)
                throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_().file_name(), ": metadata ", key, " = '",
                                                                 text, "' is not a valid ",
                                                                 std::is_integral_v<T> ? "integer" : "number"));
            return value;
        }
        int meta_positive(const char* key) const {
            const int v = meta_number<int>(key);
            rpe::detail::require(v >= 1, "vit_digits", file_().file_name(), ": metadata ", key, " = ", v, "; expected >= 1");
            return v;
        }
        bool meta_bool(const char* key) const {
            const std::string t = meta(key);
            if (t == "true" || t == "True" || t == "1") return true;
            if (t == "false" || t == "False" || t == "0") return false;
            throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_().file_name(), ": metadata ", key, " = '", t,
                                                             "'; expected true or false"));
        }

        /// Pointer to tensor `name` (F32 in the file) after checking its shape.
        const S* param(const std::string& name, const std::vector<std::int64_t>& shape) {
            const auto view = file_().template view<float>(name);
            const bool same =
                view.rank == static_cast<int>(shape.size()) && std::equal(shape.begin(), shape.end(), view.shape.begin());
            if (!same) {
                throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_().file_name(), ": tensor '", name,
                                                                 "' has shape ", view.shape_string(), "; expected ",
                                                                 rpe::detail::shape_string(shape)));
            }
            if constexpr (std::is_same_v<S, float>) {
                return view.data;
            } else {
                owned_->converted.emplace_back(view.data, view.data + view.size());
                return owned_->converted.back().data();
            }
        }

        void build() {
            auto& c = cfg_;
            if (has_meta("class_token"))
                rpe::detail::require(meta_bool("class_token"), "vit_digits", file_().file_name(),
                                     ": class_token = false is not supported");
            if (has_meta("activation"))
                rpe::detail::require(meta("activation") == "gelu_erf", "vit_digits", file_().file_name(), ": activation = '",
                                     meta("activation"), "'; expected gelu_erf");
            c.img_size = meta_positive("img_size");
            c.patch_size = meta_positive("patch_size");
            c.in_chans = meta_positive("in_chans");
            c.embed_dim = meta_positive("embed_dim");
            c.depth = meta_positive("depth");
            c.num_heads = meta_positive("num_heads");
            c.mlp_hidden_dim = meta_positive("mlp_hidden_dim");
            c.num_classes = meta_positive("num_classes");
            c.qkv_bias = has_meta("qkv_bias") ? meta_bool("qkv_bias") : true;
            c.layer_norm_eps = meta_number<double>("layer_norm_eps");
            rpe::detail::require(c.img_size % c.patch_size == 0, "vit_digits", file_().file_name(), ": img_size = ", c.img_size,
                                 " is not a multiple of patch_size = ", c.patch_size);
            rpe::detail::require(c.embed_dim % c.num_heads == 0, "vit_digits", file_().file_name(), ": embed_dim = ", c.embed_dim,
                                 " is not a multiple of num_heads = ", c.num_heads);
            c.head_dim = c.embed_dim / c.num_heads;
            c.grid = c.img_size / c.patch_size;
            rpe::detail::require(c.grid <= 46340, "vit_digits", file_().file_name(), ": img_size / patch_size = ", c.grid,
                                 "; expected at most 46340 (the 1 + grid^2 tokens must fit int)");
            c.tokens = 1 + c.grid * c.grid;

            // iRPE: one term per target in rpe_on, shared by the blocks (each block has its own tables).
            c.rpe_on = meta("rpe_on");
            c.rpe.method = rpe::parse_method(meta("rpe_method"));
            c.rpe.contextual = rpe::parse_contextual(meta("rpe_mode"));
            if (has_meta("rpe_alpha") && has_meta("rpe_beta") && has_meta("rpe_gamma")) {
                c.rpe.alpha = meta_number<double>("rpe_alpha");
                c.rpe.beta = meta_number<double>("rpe_beta");
                c.rpe.gamma = meta_number<double>("rpe_gamma");
            } else {
                c.rpe.ratio(meta_number<double>("rpe_ratio"));
            }
            c.rpe.shared_head = meta_bool("rpe_shared_head");
            c.rpe.skip = meta_number<int>("rpe_skip");
            c.rpe.num_heads = c.num_heads;
            c.rpe.head_dim = c.head_dim;
            rpe::detail::require(c.rpe.skip == 1, "vit_digits", file_().file_name(), ": rpe_skip = ", c.rpe.skip,
                                 "; expected 1 (the class token is the only token before the grid)");
            rpe::detail::require(c.rpe.method != rpe::method::cross, "vit_digits", file_().file_name(),
                                 ": rpe_method = cross (two tables per target) is not supported by this example");
            c.rpe_num_buckets = meta_number<int>("rpe_num_buckets");
            // One term per target in rpe_on (vit_model makes its own, shared by the blocks): checked
            // here against the file, and its table shape read.
            std::vector<std::int64_t> table_shape[3];
            for (const char t : c.rpe_on) {
                rpe::term_spec spec = c.rpe;
                spec.target = rpe::parse_target(std::string_view(&t, 1));
                const int slot = spec.target == rpe::target::query ? 0 : (spec.target == rpe::target::key ? 1 : 2);
                rpe::detail::require(table_shape[slot].empty(), "vit_digits", file_().file_name(), ": rpe_on = '", c.rpe_on,
                                     "' names target ", t, " twice");
                const auto term = rpe::make_term<S>(spec);
                rpe::detail::require(term->num_buckets() == c.rpe_num_buckets, "vit_digits", file_().file_name(),
                                     ": metadata rpe_num_buckets = ", c.rpe_num_buckets,
                                     " but the library computes K = ", term->num_buckets(),
                                     " for rpe_method = ", meta("rpe_method"),
                                     ", beta = ", has_meta("rpe_beta") ? meta("rpe_beta") : "2 * rpe_ratio",
                                     ", skip = ", c.rpe.skip, "; the file and rpe disagree on the bucket layout");
                rpe::detail::require(term->num_tables() == 1, "vit_digits", "a term with ", term->num_tables(),
                                     " tables is not supported by this example");
                table_shape[slot] = term->table_shape();
            }

            const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim, L = c.tokens, P = c.patch_size;
            w_.patch_w = param("patch_embed.proj.weight", {C, c.in_chans, P, P});
            w_.patch_b = param("patch_embed.proj.bias", {C});
            w_.cls_token = param("cls_token", {1, 1, C});
            w_.pos_embed = param("pos_embed", {1, L, C});
            w_.blocks.resize(static_cast<std::size_t>(c.depth));
            for (int i = 0; i < c.depth; ++i) {
                const std::string p = "blocks." + std::to_string(i) + ".";
                auto& w = w_.blocks[static_cast<std::size_t>(i)];
                w.norm1_w = param(p + "norm1.weight", {C});
                w.norm1_b = param(p + "norm1.bias", {C});
                w.qkv_w = param(p + "attn.qkv.weight", {3 * C, C});
                if (c.qkv_bias) w.qkv_b = param(p + "attn.qkv.bias", {3 * C});
                w.proj_w = param(p + "attn.proj.weight", {C, C});
                w.proj_b = param(p + "attn.proj.bias", {C});
                w.norm2_w = param(p + "norm2.weight", {C});
                w.norm2_b = param(p + "norm2.bias", {C});
                w.fc1_w = param(p + "mlp.fc1.weight", {F, C});
                w.fc1_b = param(p + "mlp.fc1.bias", {F});
                w.fc2_w = param(p + "mlp.fc2.weight", {C, F});
                w.fc2_b = param(p + "mlp.fc2.bias", {C});
                static constexpr const char* letters[3] = {"q", "k", "v"};
                for (int t = 0; t < 3; ++t) {
                    if (table_shape[t].empty()) continue;
                    const std::string name =
                        p + "attn.rpe_" + letters[t] + (c.rpe.contextual ? ".lookup_table_weight" : ".lookup_table_bias");
                    w.rpe_table[t] = param(name, table_shape[t]);
                }
            }
            w_.norm_w = param("norm.weight", {C});
            w_.norm_b = param("norm.bias", {C});
            w_.head_w = param("head.weight", {c.num_classes, C});
            w_.head_b = param("head.bias", {c.num_classes});
        }

        std::shared_ptr<storage> owned_;
        vit_digits_config cfg_;
        vit_weights<S> w_;
    };
};

}  // namespace rpe::examples
