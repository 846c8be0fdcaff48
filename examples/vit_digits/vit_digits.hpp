/// @file vit_digits.hpp
/// @brief A small DeiT with iRPE attention (the reference's `RPEAttention` / `RPEBlock` /
/// `VisionTransformer`), loaded from a `.safetensors` file and run in inference on the CPU with
/// Eigen and the library's fused attention, rpe::attention_forward.
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

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <rpe/io/safetensors.hpp>
#include <rpe/rpe.hpp>

namespace rpe::examples {

/// @brief The model's hyperparameters, all read from the safetensors `__metadata__`.
struct vit_digits_config {
    int img_size = 0;        ///< S: input height = width (`img_size`)
    int patch_size = 0;      ///< P: patch side, conv kernel = stride (`patch_size`)
    int in_chans = 0;        ///< Cin: input channels (`in_chans`)
    int embed_dim = 0;       ///< C (`embed_dim`)
    int depth = 0;           ///< number of blocks (`depth`)
    int num_heads = 0;       ///< H (`num_heads`)
    int head_dim = 0;        ///< D = C / H
    int mlp_hidden_dim = 0;  ///< F (`mlp_hidden_dim`)
    int num_classes = 0;     ///< outputs of the head (`num_classes`)
    bool qkv_bias = true;    ///< the qkv Linear has a bias (`qkv_bias`, default true)
    double layer_norm_eps = 1e-6;  ///< LayerNorm ε (`layer_norm_eps`)
    int grid = 0;            ///< G = S / P: patch grid side
    int tokens = 0;          ///< L = 1 + G² (class token first)
    std::string rpe_on;      ///< the iRPE targets, a subset of "qkv" (`rpe_on`); empty = no RPE
    int rpe_num_buckets = 0; ///< K per table, extra class-token bucket included (`rpe_num_buckets`)
    /// @brief The iRPE configuration shared by every target (`rpe_method`, `rpe_mode`,
    /// `rpe_alpha`/`rpe_beta`/`rpe_gamma` or `rpe_ratio`, `rpe_shared_head`, `rpe_skip`, heads,
    /// head dim); `target` is set per term.
    rpe::term_spec rpe;
};

/// @brief Intermediate tensors of a forward, for checking against the reference's (optional).
/// Each is appended to chunk by chunk, so after a call it covers every image of the batch, in order.
template <class S>
struct vit_digits_trace {
    std::vector<S> tokens;               ///< (N, L, C): after patch embedding, class token, pos_embed
    std::vector<std::vector<S>> blocks;  ///< [depth] of (N, L, C): residual stream after each block
    std::vector<std::vector<S>> attn;    ///< [depth] of (N, H, L, L): attention probabilities (after softmax)
};

/// @brief Index of the largest of `n` values (the first one on ties, as torch.argmax).
template <class S>
[[nodiscard]] int argmax(const S* v, int n) {
    return static_cast<int>(std::max_element(v, v + n) - v);
}

/// @brief Reproduces the data set's preprocessing of raw digits: bilinear upsampling
/// (PyTorch `F.interpolate(mode="bilinear", align_corners=False)`) from (N, in, in) to
/// (N, 1, out, out), then `(x / max_value − mean) / std`.
/// @param raw (N, in, in) values 0..max_value, row-major.
/// @return (N, 1, out, out) row-major.
/// @throws rpe::invalid_argument when `raw.size()` is not a multiple of in², or a size < 1.
template <class S>
[[nodiscard]] std::vector<S> preprocess_digits(const std::vector<std::uint8_t>& raw, int in, int out,
                                               double max_value = 16.0, double mean = 0.5, double std_dev = 0.5) {
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
                rows[o * in + c] = (S(1) - w[o]) * static_cast<S>(src[i0[o] * in + c]) + w[o] * static_cast<S>(src[i1[o] * in + c]);
        S* dst = result.data() + img * out * out;
        for (int r = 0; r < out; ++r)  // then columns
            for (int o = 0; o < out; ++o) {
                const S v = (S(1) - w[o]) * rows[r * in + i0[o]] + w[o] * rows[r * in + i1[o]];
                dst[r * out + o] = (v / static_cast<S>(max_value) - static_cast<S>(mean)) / static_cast<S>(std_dev);
            }
    }
    return result;
}

/// @brief DeiT + iRPE classifier for small images, in scalar type S (float or double).
///
/// Usage:
/// @code
///   auto model = rpe::examples::vit_digits<float>::load("deit_irpe_digits_a.safetensors");
///   model.forward(rpe::tensor_ref<const float>(images, {n, 1, 16, 16}),
///                 rpe::tensor_ref<float>(logits, {n, 10}));
/// @endcode
/// Memory: the batch is processed in chunks of chunk_size() images (default 64); the workspace
/// is O(chunk · (L·(3C + F) + H·L²)), independent of N.
/// Threads: with OpenMP, forward() runs the chunks in parallel (one workspace per thread).
/// Thread-safety: forward() is const and may run concurrently (each call has its own workspace).
/// Move-only (it owns its rpe terms).
template <class S = float>
class vit_digits {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "vit_digits: S must be float or double");

public:
    using scalar_type = S;
    using matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  ///< row-major
    using cmap = Eigen::Map<const matrix>;
    using map = Eigen::Map<matrix>;
    using row_vector = Eigen::Matrix<S, 1, Eigen::Dynamic>;
    using crow_map = Eigen::Map<const row_vector>;

    /// @brief Loads weights and configuration from a `.safetensors` file (F32 tensors, DeiT
    /// state-dict names; see examples/data/digits/README.md).
    /// @throws rpe::runtime_error for an unreadable or malformed file (rpe::io::safetensors_file);
    ///   rpe::invalid_argument `[rpe.vit_digits] ...` for a missing or unparsable metadata key, an
    ///   unsupported setting (class_token false, activation other than gelu_erf, img_size not a
    ///   multiple of patch_size, embed_dim not a multiple of num_heads, a Cross method),
    ///   `rpe_num_buckets` differing from the library's K, a missing tensor or one of another
    ///   shape or dtype; and what rpe::make_term throws for an invalid iRPE configuration.
    [[nodiscard]] static vit_digits load(const std::string& path) {
        return vit_digits(rpe::io::safetensors_file::load(path));
    }

    /// @brief Builds the model from an already loaded file (the views stay valid: the model keeps
    /// a copy of the file object, which shares its buffer). @throws as load().
    explicit vit_digits(rpe::io::safetensors_file file) : file_(std::move(file)) { build(); }

    vit_digits(vit_digits&&) noexcept = default;
    vit_digits& operator=(vit_digits&&) noexcept = default;
    vit_digits(const vit_digits&) = delete;
    vit_digits& operator=(const vit_digits&) = delete;

    /// @brief The hyperparameters read from the file.
    [[nodiscard]] const vit_digits_config& config() const { return cfg_; }

    /// @brief The iRPE term on target `t` (shared by all blocks), or null when `rpe_on` lacks it.
    [[nodiscard]] const rpe::any_term<S>* rpe_term(rpe::target t) const { return terms_[static_cast<int>(slot_of(t))].get(); }

    /// @brief Images per chunk of forward() (bounds its workspace).
    [[nodiscard]] int chunk_size() const { return chunk_; }
    /// @brief Sets the chunk size. @throws rpe::invalid_argument for n < 1.
    void set_chunk_size(int n) {
        rpe::detail::require(n >= 1, "vit_digits", "chunk_size = ", n, "; expected >= 1");
        chunk_ = n;
    }

    /// @brief Batch forward: logits of every image.
    /// @param images (N, Cin, S, S), row-major, preprocessed as the model was trained.
    /// @param logits (N, num_classes), written.
    /// @param trace  optional: filled with the intermediate tensors (see vit_digits_trace),
    ///   replacing what it held.
    /// @throws rpe::invalid_argument `[rpe.vit_digits] ...` for a shape that does not match the
    ///   config or a null buffer; checked before anything is written.
    void forward(rpe::tensor_ref<const S> images, rpe::tensor_ref<S> logits, vit_digits_trace<S>* trace = nullptr) const {
        const int s = cfg_.img_size;
        rpe::detail::require(images.rank == 4 && images.extent(1) == cfg_.in_chans && images.extent(2) == s &&
                                 images.extent(3) == s,
                             "vit_digits", "images have shape ", images.shape_string(), "; expected (N, ", cfg_.in_chans, ", ",
                             s, ", ", s, ")");
        const std::int64_t n = images.extent(0);
        rpe::detail::require(logits.has_shape({n, cfg_.num_classes}), "vit_digits", "logits have shape ", logits.shape_string(),
                             "; expected (", n, ", ", cfg_.num_classes, ")");
        rpe::detail::require(n == 0 || (images.data != nullptr && logits.data != nullptr), "vit_digits",
                             "images or logits is null");
        if (trace) {
            trace->tokens.clear();
            trace->blocks.assign(static_cast<std::size_t>(cfg_.depth), {});
            trace->attn.assign(static_cast<std::size_t>(cfg_.depth), {});
        }
        const std::int64_t image_size = static_cast<std::int64_t>(cfg_.in_chans) * s * s;
        const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
        auto run = [&](std::int64_t ch, workspace& ws) {
            const std::int64_t first = ch * chunk_;
            const int b = static_cast<int>(std::min<std::int64_t>(chunk_, n - first));
            forward_chunk(images.data + first * image_size, b, logits.data + first * cfg_.num_classes, ws, trace);
        };
#if defined(_OPENMP)
        // Chunks run in parallel, one workspace per thread (the rpe kernels and Eigen inside then
        // run serially); with a trace the chunks must be appended in order, so they run serially
        // and the parallelism is the one inside rpe and Eigen.
        if (!trace && chunks > 1 && omp_get_max_threads() > 1 && !omp_in_parallel()) {
            std::exception_ptr error;
#pragma omp parallel
            {
                workspace ws;
#pragma omp for schedule(dynamic, 1)
                for (std::int64_t ch = 0; ch < chunks; ++ch) {
                    try {
                        run(ch, ws);
                    } catch (...) {
#pragma omp critical(rpe_vit_digits_error)
                        if (!error) error = std::current_exception();
                    }
                }
            }
            if (error) std::rethrow_exception(error);
            return;
        }
#endif
        workspace ws;
        for (std::int64_t ch = 0; ch < chunks; ++ch) run(ch, ws);
    }

private:
    enum class slot : int { q = 0, k = 1, v = 2 };
    static slot slot_of(rpe::target t) {
        return t == rpe::target::query ? slot::q : (t == rpe::target::key ? slot::k : slot::v);
    }

    /// Weights of one pre-norm block (pointers into the file's buffer, or into owned_ in double).
    struct block_weights {
        const S *norm1_w = nullptr, *norm1_b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr,
                *proj_b = nullptr, *norm2_w = nullptr, *norm2_b = nullptr, *fc1_w = nullptr, *fc1_b = nullptr,
                *fc2_w = nullptr, *fc2_b = nullptr;
        const S* rpe_table[3] = {nullptr, nullptr, nullptr};  ///< q, k, v tables (null when off)
        std::vector<std::int64_t> rpe_shape[3];               ///< their shapes
    };

    /// Scratch buffers of one chunk of B images.
    struct workspace {
        std::vector<S> patches, z, h, qkv, q, k, v, out, attn, o, y, f, cls;
        void resize(const vit_digits_config& c, int b) {
            const auto rows = static_cast<std::size_t>(b) * c.tokens;
            const auto ll = static_cast<std::size_t>(c.tokens) * c.tokens;
            for (auto* buf : {&z, &h, &o, &y}) buf->resize(rows * c.embed_dim);
            qkv.resize(rows * 3 * c.embed_dim);
            for (auto* buf : {&q, &k, &v, &out}) buf->resize(rows * c.embed_dim);
            attn.resize(static_cast<std::size_t>(b) * c.num_heads * ll);
            f.resize(rows * c.mlp_hidden_dim);
            patches.resize(static_cast<std::size_t>(b) * c.grid * c.grid * c.in_chans * c.patch_size * c.patch_size);
            cls.resize(static_cast<std::size_t>(b) * c.embed_dim);
        }
    };

    // ---------------------------------------------------------------------------------------
    // Loading
    // ---------------------------------------------------------------------------------------

    std::string meta(const char* key) const {
        try {
            return file_.metadata_value(key);
        } catch (const rpe::invalid_argument&) {
            throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_.file_name(), ": metadata key '", key,
                                                             "' is missing; the model reads every hyperparameter from __metadata__"));
        }
    }
    bool has_meta(const char* key) const { return file_.metadata().count(key) != 0; }

    template <class T>
    T meta_number(const char* key) const {
        const std::string text = meta(key);
        T value{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (ec != std::errc() || ptr != end)
            throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_.file_name(), ": metadata ", key, " = '", text,
                                                             "' is not a valid ", std::is_integral_v<T> ? "integer" : "number"));
        return value;
    }
    int meta_positive(const char* key) const {
        const int v = meta_number<int>(key);
        rpe::detail::require(v >= 1, "vit_digits", file_.file_name(), ": metadata ", key, " = ", v, "; expected >= 1");
        return v;
    }
    bool meta_bool(const char* key) const {
        const std::string t = meta(key);
        if (t == "true" || t == "True" || t == "1") return true;
        if (t == "false" || t == "False" || t == "0") return false;
        throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_.file_name(), ": metadata ", key, " = '", t,
                                                         "'; expected true or false"));
    }

    /// Pointer to tensor `name` (F32 in the file) after checking its shape.
    const S* param(const std::string& name, const std::vector<std::int64_t>& shape) {
        const auto view = file_.view<float>(name);
        const bool same = view.rank == static_cast<int>(shape.size()) &&
                          std::equal(shape.begin(), shape.end(), view.shape.begin());
        if (!same) {
            std::string want = "(";
            for (std::size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
            want += shape.size() == 1 ? ",)" : ")";
            throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_.file_name(), ": tensor '", name, "' has shape ",
                                                             view.shape_string(), "; expected ", want));
        }
        if constexpr (std::is_same_v<S, float>) {
            return view.data;
        } else {
            owned_.emplace_back(view.data, view.data + view.size());
            return owned_.back().data();
        }
    }

    void build() {
        auto& c = cfg_;
        if (has_meta("class_token"))
            rpe::detail::require(meta_bool("class_token"), "vit_digits", file_.file_name(), ": class_token = false is not supported");
        if (has_meta("activation"))
            rpe::detail::require(meta("activation") == "gelu_erf", "vit_digits", file_.file_name(), ": activation = '",
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
        rpe::detail::require(c.img_size % c.patch_size == 0, "vit_digits", file_.file_name(), ": img_size = ", c.img_size,
                             " is not a multiple of patch_size = ", c.patch_size);
        rpe::detail::require(c.embed_dim % c.num_heads == 0, "vit_digits", file_.file_name(), ": embed_dim = ", c.embed_dim,
                             " is not a multiple of num_heads = ", c.num_heads);
        c.head_dim = c.embed_dim / c.num_heads;
        c.grid = c.img_size / c.patch_size;
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
        rpe::detail::require(c.rpe.skip == 1, "vit_digits", file_.file_name(), ": rpe_skip = ", c.rpe.skip,
                             "; expected 1 (the class token is the only token before the grid)");
        rpe::detail::require(c.rpe.method != rpe::method::cross, "vit_digits", file_.file_name(),
                             ": rpe_method = cross (two tables per target) is not supported by this example");
        c.rpe_num_buckets = meta_number<int>("rpe_num_buckets");
        for (const char t : c.rpe_on) {
            rpe::term_spec spec = c.rpe;
            spec.target = rpe::parse_target(std::string_view(&t, 1));
            auto& term = terms_[static_cast<int>(slot_of(spec.target))];
            rpe::detail::require(!term, "vit_digits", file_.file_name(), ": rpe_on = '", c.rpe_on, "' names target ", t, " twice");
            term = rpe::make_term<S>(spec);
            rpe::detail::require(term->num_buckets() == c.rpe_num_buckets, "vit_digits", file_.file_name(),
                                 ": metadata rpe_num_buckets = ", c.rpe_num_buckets, " but the library computes K = ",
                                 term->num_buckets(), " for rpe_method = ", meta("rpe_method"), ", beta = ",
                                 has_meta("rpe_beta") ? meta("rpe_beta") : "2 * rpe_ratio",
                                 ", skip = ", c.rpe.skip, "; the file and rpe disagree on the bucket layout");
            rpe::detail::require(term->num_tables() == 1, "vit_digits", "a term with ", term->num_tables(),
                                 " tables is not supported by this example");
        }

        const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim, L = c.tokens, P = c.patch_size;
        patch_w_ = param("patch_embed.proj.weight", {C, c.in_chans, P, P});
        patch_b_ = param("patch_embed.proj.bias", {C});
        cls_token_ = param("cls_token", {1, 1, C});
        pos_embed_ = param("pos_embed", {1, L, C});
        blocks_.resize(static_cast<std::size_t>(c.depth));
        for (int i = 0; i < c.depth; ++i) {
            const std::string p = "blocks." + std::to_string(i) + ".";
            auto& w = blocks_[static_cast<std::size_t>(i)];
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
                if (!terms_[t]) continue;
                const std::string name =
                    p + "attn.rpe_" + letters[t] + (c.rpe.contextual ? ".lookup_table_weight" : ".lookup_table_bias");
                w.rpe_shape[t] = terms_[t]->table_shape();
                w.rpe_table[t] = param(name, w.rpe_shape[t]);
            }
        }
        norm_w_ = param("norm.weight", {C});
        norm_b_ = param("norm.bias", {C});
        head_w_ = param("head.weight", {c.num_classes, C});
        head_b_ = param("head.bias", {c.num_classes});
    }

    // ---------------------------------------------------------------------------------------
    // Forward
    // ---------------------------------------------------------------------------------------

    /// y (rows, out) = x (rows, in) · Wᵀ + b, W (out, in) row-major as nn.Linear.
    static void linear(const S* x, std::int64_t rows, std::int64_t in, const S* w, const S* b, std::int64_t out, S* y) {
        map ym(y, rows, out);
        ym.noalias() = cmap(x, rows, in) * cmap(w, out, in).transpose();
        if (b) ym.rowwise() += crow_map(b, out);
    }

    /// LayerNorm over the last dimension (biased variance), rows of length c.
    void layer_norm(const S* x, std::int64_t rows, const S* w, const S* b, S* y) const {
        const std::int64_t c = cfg_.embed_dim;
        const S eps = static_cast<S>(cfg_.layer_norm_eps);
        for (std::int64_t r = 0; r < rows; ++r) {
            const S* xr = x + r * c;
            S* yr = y + r * c;
            S mean = 0;
            for (std::int64_t e = 0; e < c; ++e) mean += xr[e];
            mean /= static_cast<S>(c);
            S var = 0;
            for (std::int64_t e = 0; e < c; ++e) var += (xr[e] - mean) * (xr[e] - mean);
            var /= static_cast<S>(c);
            const S inv = S(1) / std::sqrt(var + eps);
            for (std::int64_t e = 0; e < c; ++e) yr[e] = (xr[e] - mean) * inv * w[e] + b[e];
        }
    }

    void forward_chunk(const S* images, int b, S* logits, workspace& ws, vit_digits_trace<S>* trace) const {
        const auto& c = cfg_;
        const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens, F = c.mlp_hidden_dim;
        const std::int64_t G = c.grid, P = c.patch_size, Cin = c.in_chans, S_img = c.img_size;
        const std::int64_t rows = b * L, patch_len = Cin * P * P;
        ws.resize(c, b);

        // 1. Patch embedding as one GEMM: gather each patch (Cin, P, P) into a row, then
        //    (b·G², Cin·P²) · W_peᵀ (W_pe viewed as (C, Cin·P²)) + bias.
        for (std::int64_t img = 0; img < b; ++img)
            for (std::int64_t r = 0; r < G; ++r)
                for (std::int64_t col = 0; col < G; ++col) {
                    S* row = ws.patches.data() + ((img * G + r) * G + col) * patch_len;
                    for (std::int64_t ch = 0; ch < Cin; ++ch)
                        for (std::int64_t ky = 0; ky < P; ++ky)
                            for (std::int64_t kx = 0; kx < P; ++kx)
                                row[(ch * P + ky) * P + kx] =
                                    images[((img * Cin + ch) * S_img + P * r + ky) * S_img + P * col + kx];
                }
        linear(ws.patches.data(), b * G * G, patch_len, patch_w_, patch_b_, C, ws.y.data());
        // 2. Tokens: z_0 = cls, z_{1+p} = t_p; z += pos_embed.
        for (std::int64_t img = 0; img < b; ++img) {
            S* zi = ws.z.data() + img * L * C;
            std::copy(cls_token_, cls_token_ + C, zi);
            std::copy(ws.y.data() + img * G * G * C, ws.y.data() + (img + 1) * G * G * C, zi + C);
            for (std::int64_t e = 0; e < L * C; ++e) zi[e] += pos_embed_[e];
        }
        if (trace) trace->tokens.insert(trace->tokens.end(), ws.z.begin(), ws.z.begin() + rows * C);

        // 3. Blocks.
        const rpe::tensor_ref<const S> q_ref(ws.q.data(), {b, H, L, D}), k_ref(ws.k.data(), {b, H, L, D}),
            v_ref(ws.v.data(), {b, H, L, D});
        const rpe::tensor_ref<S> out_ref(ws.out.data(), {b, H, L, D}), attn_ref(ws.attn.data(), {b, H, L, L});
        for (int i = 0; i < c.depth; ++i) {
            const auto& w = blocks_[static_cast<std::size_t>(i)];
            // h = LN1(z); qkv = h·W_qkvᵀ + b: (b·L, 3C), column t·C + n·D + d.
            layer_norm(ws.z.data(), rows, w.norm1_w, w.norm1_b, ws.h.data());
            linear(ws.h.data(), rows, C, w.qkv_w, w.qkv_b, 3 * C, ws.qkv.data());
            // (b, L, 3, H, D) → three (b, H, L, D)
            S* dst[3] = {ws.q.data(), ws.k.data(), ws.v.data()};
            for (std::int64_t img = 0; img < b; ++img)
                for (std::int64_t l = 0; l < L; ++l) {
                    const S* src = ws.qkv.data() + (img * L + l) * 3 * C;
                    for (int t = 0; t < 3; ++t)
                        for (std::int64_t n = 0; n < H; ++n)
                            std::copy(src + t * C + n * D, src + t * C + (n + 1) * D, dst[t] + ((img * H + n) * L + l) * D);
                }
            // attention with iRPE (the library scales q by D^-1/2 itself)
            rpe::attention_inputs<S> in;
            in.q = q_ref;
            in.k = k_ref;
            in.v = v_ref;
            in.height = c.grid;
            in.width = c.grid;
            rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
            for (int t = 0; t < 3; ++t) {
                if (!terms_[t]) continue;
                slots[t]->term = terms_[t].get();
                const auto& sh = w.rpe_shape[t];
                slots[t]->tables = {sh.size() == 2 ? rpe::tensor_ref<const S>(w.rpe_table[t], {sh[0], sh[1]})
                                                   : rpe::tensor_ref<const S>(w.rpe_table[t], {sh[0], sh[1], sh[2]})};
            }
            // fused: no (b, H, L, L) buffer unless the probabilities are traced
            rpe::attention_forward(in, out_ref, trace ? attn_ref : rpe::tensor_ref<S>{});
            if (trace) trace->attn[static_cast<std::size_t>(i)].insert(trace->attn[static_cast<std::size_t>(i)].end(),
                                                                       ws.attn.begin(), ws.attn.begin() + b * H * L * L);
            // (b, H, L, D) → (b·L, C), heads concatenated
            for (std::int64_t img = 0; img < b; ++img)
                for (std::int64_t n = 0; n < H; ++n)
                    for (std::int64_t l = 0; l < L; ++l) {
                        const S* src = ws.out.data() + ((img * H + n) * L + l) * D;
                        std::copy(src, src + D, ws.o.data() + (img * L + l) * C + n * D);
                    }
            // z += proj(o)
            linear(ws.o.data(), rows, C, w.proj_w, w.proj_b, C, ws.y.data());
            map(ws.z.data(), rows, C) += cmap(ws.y.data(), rows, C);
            // z += fc2(GELU(fc1(LN2(z))))
            layer_norm(ws.z.data(), rows, w.norm2_w, w.norm2_b, ws.h.data());
            linear(ws.h.data(), rows, C, w.fc1_w, w.fc1_b, F, ws.f.data());
            // exact GELU 0.5·x·(1 + erf(x/√2)); Eigen's erf is vectorised for float (within a few
            // ulp of std::erf) and std::erf for double
            auto f = Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>>(ws.f.data(), rows * F);
            f = S(0.5) * f * (S(1) + (f * static_cast<S>(0.70710678118654752440084436210484903928483593768847)).erf());
            linear(ws.f.data(), rows, F, w.fc2_w, w.fc2_b, C, ws.y.data());
            map(ws.z.data(), rows, C) += cmap(ws.y.data(), rows, C);
            if (trace) trace->blocks[static_cast<std::size_t>(i)].insert(trace->blocks[static_cast<std::size_t>(i)].end(),
                                                                         ws.z.begin(), ws.z.begin() + rows * C);
        }

        // 4. logits = head(LN(z_0)) for the class token of each image.
        for (std::int64_t img = 0; img < b; ++img)
            std::copy(ws.z.data() + img * L * C, ws.z.data() + img * L * C + C, ws.o.data() + img * C);
        layer_norm(ws.o.data(), b, norm_w_, norm_b_, ws.cls.data());
        linear(ws.cls.data(), b, C, head_w_, head_b_, c.num_classes, logits);
    }

    rpe::io::safetensors_file file_;            // keeps the float views alive
    std::deque<std::vector<S>> owned_;          // double: converted weights (stable addresses)
    vit_digits_config cfg_;
    std::unique_ptr<rpe::any_term<S>> terms_[3];  // q, k, v (null when off)
    const S *patch_w_ = nullptr, *patch_b_ = nullptr, *cls_token_ = nullptr, *pos_embed_ = nullptr;
    const S *norm_w_ = nullptr, *norm_b_ = nullptr, *head_w_ = nullptr, *head_b_ = nullptr;
    std::vector<block_weights> blocks_;
    int chunk_ = 64;
};

}  // namespace rpe::examples
