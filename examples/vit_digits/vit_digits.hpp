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

// rpe first: its headers bring in Eigen and the x86 intrinsics without g++ 12's AVX-512 false
// positives (rpe/backend/cpu/eigen.hpp), which the first inclusion decides.
#include <rpe/io/safetensors.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace rpe::examples {

/// @brief The model's hyperparameters, all read from the safetensors `__metadata__`.
struct vit_digits_config {
    int img_size = 0;              ///< S: input height = width (`img_size`)
    int patch_size = 0;            ///< P: patch side, conv kernel = stride (`patch_size`)
    int in_chans = 0;              ///< Cin: input channels (`in_chans`)
    int embed_dim = 0;             ///< C (`embed_dim`)
    int depth = 0;                 ///< number of blocks (`depth`)
    int num_heads = 0;             ///< H (`num_heads`)
    int head_dim = 0;              ///< D = C / H
    int mlp_hidden_dim = 0;        ///< F (`mlp_hidden_dim`)
    int num_classes = 0;           ///< outputs of the head (`num_classes`)
    bool qkv_bias = true;          ///< the qkv Linear has a bias (`qkv_bias`, default true)
    double layer_norm_eps = 1e-6;  ///< LayerNorm ε (`layer_norm_eps`)
    int grid = 0;                  ///< G = S / P: patch grid side
    int tokens = 0;                ///< L = 1 + G² (class token first)
    std::string rpe_on;            ///< the iRPE targets, a subset of "qkv" (`rpe_on`); empty = no RPE
    int rpe_num_buckets = 0;       ///< K per table, extra class-token bucket included (`rpe_num_buckets`)
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

/// @brief Seconds spent in each stage of vit_digits::forward, accumulated over its chunks (and
/// over its threads: with several threads these are CPU seconds, summing to more than the wall time).
struct vit_digits_stage_times {
    double patch_embed = 0;  ///< workspace sizing, patch gather, patch GEMM onto class token and pos_embed
    double layer_norm = 0;   ///< LN1 and LN2 of every block (with the residual biases they add)
    double qkv = 0;          ///< qkv Linear (GEMM, bias)
    double repack = 0;       ///< (B, H, L, D) attention output → (B·L, C) (q, k, v are read in place from qkv)
    double attention = 0;    ///< rpe::attention_forward (iRPE, softmax, a·v)
    double proj = 0;         ///< attention projection GEMM, accumulated into the residual stream
    double mlp = 0;          ///< fc1 and fc2 GEMMs
    double gelu = 0;         ///< exact-erf GELU over the fc1 output
    double head = 0;         ///< final LN of the class tokens and the head Linear
    /// @brief Sum of the stages.
    [[nodiscard]] double total() const { return patch_embed + layer_norm + qkv + repack + attention + proj + mlp + gelu + head; }
    /// @brief Stage by stage minimum of two measurements (for a best-of-n under load).
    [[nodiscard]] vit_digits_stage_times min(const vit_digits_stage_times& o) const {
        vit_digits_stage_times m;
        m.patch_embed = std::min(patch_embed, o.patch_embed), m.layer_norm = std::min(layer_norm, o.layer_norm);
        m.qkv = std::min(qkv, o.qkv), m.repack = std::min(repack, o.repack), m.attention = std::min(attention, o.attention);
        m.proj = std::min(proj, o.proj), m.mlp = std::min(mlp, o.mlp), m.gelu = std::min(gelu, o.gelu);
        m.head = std::min(head, o.head);
        return m;
    }
    /// @brief Adds another measurement stage by stage.
    vit_digits_stage_times& operator+=(const vit_digits_stage_times& o) {
        patch_embed += o.patch_embed, layer_norm += o.layer_norm, qkv += o.qkv, repack += o.repack;
        attention += o.attention, proj += o.proj, mlp += o.mlp, gelu += o.gelu, head += o.head;
        return *this;
    }
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

/// @brief DeiT + iRPE classifier for small images, in scalar type S (float or double).
///
/// Usage:
/// @code
///   auto model = rpe::examples::vit_digits<float>::load("deit_irpe_digits_a.safetensors");
///   model.forward(rpe::tensor_ref<const float>(images, {n, 1, 16, 16}),
///                 rpe::tensor_ref<float>(logits, {n, 10}));
/// @endcode
/// Memory: the batch is processed in chunks of chunk_size() images (default 16); a workspace is
/// O(chunk · L·(3C + F)), plus chunk · H·L² when traced, independent of N, and is kept for the
/// next call (one per thread that ran a chunk) until the model is destroyed.
/// Threads: with OpenMP, forward() runs the chunks in parallel (one workspace per thread).
/// Thread-safety: forward() is const and may run concurrently (each call takes its own workspaces
/// from a mutex-guarded pool that keeps them between calls).
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
    ///   multiple of patch_size, img_size / patch_size beyond 46340 (tokens beyond int), embed_dim
    ///   not a multiple of num_heads, a Cross method),
    ///   `rpe_num_buckets` differing from the library's K, a missing tensor or one of another
    ///   shape or dtype; and what rpe::make_term throws for an invalid iRPE configuration.
    [[nodiscard]] static vit_digits load(const std::string& path) { return vit_digits(rpe::io::safetensors_file::load(path)); }

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
    /// @param times  optional: the seconds of each stage are added to it (see vit_digits_stage_times);
    ///   null (the default) takes no timings.
    /// @throws rpe::invalid_argument `[rpe.vit_digits] ...` for a shape that does not match the
    ///   config or a null buffer; checked before anything is written.
    void forward(rpe::tensor_ref<const S> images, rpe::tensor_ref<S> logits, vit_digits_trace<S>* trace = nullptr,
                 vit_digits_stage_times* times = nullptr) const {
        const int s = cfg_.img_size;
        rpe::detail::require(
            images.rank == 4 && images.extent(1) == cfg_.in_chans && images.extent(2) == s && images.extent(3) == s, "vit_digits",
            "images have shape ", images.shape_string(), "; expected (N, ", cfg_.in_chans, ", ", s, ", ", s, ")");
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
        auto run = [&](std::int64_t ch, workspace& ws, vit_digits_stage_times* t) {
            const std::int64_t first = ch * chunk_;
            const int b = static_cast<int>(std::min<std::int64_t>(chunk_, n - first));
            forward_chunk(images.data + first * image_size, b, logits.data + first * cfg_.num_classes, ws, trace, t);
        };
#if defined(_OPENMP)
        // Chunks run in parallel, one workspace per thread (the rpe kernels and Eigen inside then
        // run serially); with a trace the chunks must be appended in order, so they run serially
        // and the parallelism is the one inside rpe and Eigen.
        if (!trace && chunks > 1 && omp_get_max_threads() > 1 && !omp_in_parallel()) {
            std::exception_ptr error;
#pragma omp parallel
            {
                auto ws_ptr = take_workspace();
                workspace& ws = *ws_ptr;
                vit_digits_stage_times mine;
#pragma omp for schedule(dynamic, 1)
                for (std::int64_t ch = 0; ch < chunks; ++ch) {
                    try {
                        run(ch, ws, times ? &mine : nullptr);
                    } catch (...) {
#pragma omp critical(rpe_vit_digits_error)
                        if (!error) error = std::current_exception();
                    }
                }
                if (times) {
#pragma omp critical(rpe_vit_digits_times)
                    *times += mine;
                }
                give_back(std::move(ws_ptr));
            }
            if (error) std::rethrow_exception(error);
            return;
        }
#endif
        auto ws = take_workspace();
        for (std::int64_t ch = 0; ch < chunks; ++ch) run(ch, *ws, times);
        give_back(std::move(ws));
    }

private:
    using clock = std::chrono::steady_clock;
    enum class slot : int { q = 0, k = 1, v = 2 };
    static slot slot_of(rpe::target t) { return t == rpe::target::query ? slot::q : (t == rpe::target::key ? slot::k : slot::v); }

    /// Weights of one pre-norm block (pointers into the file's buffer, or into owned_ in double).
    struct block_weights {
        const S *norm1_w = nullptr, *norm1_b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr, *proj_b = nullptr,
                *norm2_w = nullptr, *norm2_b = nullptr, *fc1_w = nullptr, *fc1_b = nullptr, *fc2_w = nullptr, *fc2_b = nullptr;
        const S* rpe_table[3] = {nullptr, nullptr, nullptr};  ///< q, k, v tables (null when off)
        std::vector<std::int64_t> rpe_shape[3];               ///< their shapes
    };

    /// Scratch buffers of one chunk of B images.
    struct workspace {
        std::vector<S> patches, z, h, qkv, out, attn, o, f, cls;
        /// Sizes the buffers for b images; the (b, H, L, L) probabilities only when traced.
        void resize(const vit_digits_config& c, int b, bool traced) {
            const auto rows = static_cast<std::size_t>(b) * c.tokens;
            const auto ll = static_cast<std::size_t>(c.tokens) * c.tokens;
            for (auto* buf : {&z, &h, &o}) buf->resize(rows * c.embed_dim);
            qkv.resize(rows * 3 * c.embed_dim);
            out.resize(rows * c.embed_dim);
            if (traced) attn.resize(static_cast<std::size_t>(b) * c.num_heads * ll);
            f.resize(rows * c.mlp_hidden_dim);
            patches.resize(static_cast<std::size_t>(b) * c.grid * c.grid * c.in_chans * c.patch_size * c.patch_size);
            cls.resize(static_cast<std::size_t>(b) * c.embed_dim);
        }
    };

    /// A workspace from the pool, or a new one. Workspaces are kept between forward() calls (one
    /// per concurrent user), so that a call does not allocate and page in megabytes of buffers
    /// again; one lost to an exception is simply not reused.
    std::unique_ptr<workspace> take_workspace() const {
        const std::lock_guard lock(pool_->mutex);
        if (pool_->free.empty()) return std::make_unique<workspace>();
        auto ws = std::move(pool_->free.back());
        pool_->free.pop_back();
        return ws;
    }
    /// Returns a workspace to the pool.
    void give_back(std::unique_ptr<workspace> ws) const {
        const std::lock_guard lock(pool_->mutex);
        pool_->free.push_back(std::move(ws));
    }

    // ---------------------------------------------------------------------------------------
    // Loading
    // ---------------------------------------------------------------------------------------

    std::string meta(const char* key) const {
        try {
            return file_.metadata_value(key);
        } catch (const rpe::invalid_argument&) {
            throw rpe::invalid_argument(
                rpe::detail::message("vit_digits", file_.file_name(), ": metadata key '", key,
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
        throw rpe::invalid_argument(
            rpe::detail::message("vit_digits", file_.file_name(), ": metadata ", key, " = '", t, "'; expected true or false"));
    }

    /// Pointer to tensor `name` (F32 in the file) after checking its shape.
    const S* param(const std::string& name, const std::vector<std::int64_t>& shape) {
        const auto view = file_.view<float>(name);
        const bool same =
            view.rank == static_cast<int>(shape.size()) && std::equal(shape.begin(), shape.end(), view.shape.begin());
        if (!same) {
            throw rpe::invalid_argument(rpe::detail::message("vit_digits", file_.file_name(), ": tensor '", name, "' has shape ",
                                                             view.shape_string(), "; expected ",
                                                             rpe::detail::shape_string(shape)));
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
            rpe::detail::require(meta_bool("class_token"), "vit_digits", file_.file_name(),
                                 ": class_token = false is not supported");
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
        rpe::detail::require(c.grid <= 46340, "vit_digits", file_.file_name(), ": img_size / patch_size = ", c.grid,
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
        rpe::detail::require(c.rpe.skip == 1, "vit_digits", file_.file_name(), ": rpe_skip = ", c.rpe.skip,
                             "; expected 1 (the class token is the only token before the grid)");
        rpe::detail::require(c.rpe.method != rpe::method::cross, "vit_digits", file_.file_name(),
                             ": rpe_method = cross (two tables per target) is not supported by this example");
        c.rpe_num_buckets = meta_number<int>("rpe_num_buckets");
        for (const char t : c.rpe_on) {
            rpe::term_spec spec = c.rpe;
            spec.target = rpe::parse_target(std::string_view(&t, 1));
            auto& term = terms_[static_cast<int>(slot_of(spec.target))];
            rpe::detail::require(!term, "vit_digits", file_.file_name(), ": rpe_on = '", c.rpe_on, "' names target ", t,
                                 " twice");
            term = rpe::make_term<S>(spec);
            rpe::detail::require(term->num_buckets() == c.rpe_num_buckets, "vit_digits", file_.file_name(),
                                 ": metadata rpe_num_buckets = ", c.rpe_num_buckets,
                                 " but the library computes K = ", term->num_buckets(), " for rpe_method = ", meta("rpe_method"),
                                 ", beta = ", has_meta("rpe_beta") ? meta("rpe_beta") : "2 * rpe_ratio", ", skip = ", c.rpe.skip,
                                 "; the file and rpe disagree on the bucket layout");
            rpe::detail::require(term->num_tables() == 1, "vit_digits", "a term with ", term->num_tables(),
                                 " tables is not supported by this example");
        }

        const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim, L = c.tokens, P = c.patch_size;
        patch_w_ = param("patch_embed.proj.weight", {C, c.in_chans, P, P});
        patch_b_ = param("patch_embed.proj.bias", {C});
        cls_token_ = param("cls_token", {1, 1, C});
        pos_embed_ = param("pos_embed", {1, L, C});
        // (L, C): what every image's tokens start from: class token + pos_embed[0], then
        // pos_embed[p] + the patch conv's bias (the patch GEMM is accumulated onto it).
        token_init_.assign(pos_embed_, pos_embed_ + L * C);
        map init(token_init_.data(), L, C);
        init.row(0) += crow_map(cls_token_, C);
        init.bottomRows(L - 1).rowwise() += crow_map(patch_b_, C);
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

    /// y (rows, out) = x (rows, in) · Wᵀ + b, W (out, in) row-major as nn.Linear. The bias is written first and the product accumulated onto it by the GEMM (Eigen's
    /// `noalias() =` would clear y first instead), so the bias costs no extra pass.
    static void linear(const S* x, std::int64_t rows, std::int64_t in, const S* w, const S* b, std::int64_t out, S* y) {
        map ym(y, rows, out);
        if (b)
            ym.rowwise() = crow_map(b, out);
        else
            ym.setZero();
        ym.noalias() += cmap(x, rows, in) * cmap(w, out, in).transpose();
    }

    /// z (rows, out) += x (rows, in) · Wᵀ, W (out, in) row-major, z rows `z_stride` apart: the
    /// residual add done by the GEMM itself (no temporary); the Linear's bias is left to the caller
    /// (see layer_norm's `add`).
    static void linear_accumulate(const S* x, std::int64_t rows, std::int64_t in, const S* w, std::int64_t out, S* z,
                                  std::int64_t z_stride) {
        Eigen::Map<matrix, 0, Eigen::OuterStride<>>(z, rows, out, Eigen::OuterStride<>(z_stride)).noalias() +=
            cmap(x, rows, in) * cmap(w, out, in).transpose();
    }

    /// LayerNorm over rows of length C (biased variance, two passes over a row held in L1):
    /// y_r = (x_r − mean) / sqrt(var + ε) · w + b. When `add` is not null, x_r += add is written back
    /// first (a residual Linear's pending bias), so the residual stream gets its bias in the same pass.
    /// x rows are `x_stride` apart (C for a packed matrix, L·C for the class tokens), y rows packed.
    void layer_norm(S* x, std::int64_t rows, std::int64_t x_stride, const S* add, const S* w, const S* b, S* y) const {
        // C = 64 (both digits models) gets fixed-size rows: the reductions unroll (3x faster here).
        if (cfg_.embed_dim == 64)
            layer_norm_rows<64>(x, rows, x_stride, add, w, b, y);
        else
            layer_norm_rows<Eigen::Dynamic>(x, rows, x_stride, add, w, b, y);
    }
    template <int N>
    void layer_norm_rows(S* x, std::int64_t rows, std::int64_t x_stride, const S* add, const S* w, const S* b, S* y) const {
        using row_array = Eigen::Array<S, 1, N>;
        const std::int64_t c = cfg_.embed_dim;
        const S eps = static_cast<S>(cfg_.layer_norm_eps), inv_c = S(1) / static_cast<S>(c);
        const Eigen::Map<const row_array> wa(w, c), ba(b, c);
        for (std::int64_t r = 0; r < rows; ++r) {
            Eigen::Map<row_array> xr(x + r * x_stride, c);
            if (add) xr += Eigen::Map<const row_array>(add, c);
            const S mean = xr.sum() * inv_c;
            const S var = (xr - mean).square().sum() * inv_c;
            const S inv = S(1) / std::sqrt(var + eps);
            Eigen::Map<row_array>(y + r * c, c) = (xr - mean) * inv * wa + ba;
        }
    }

    /// Accumulates the seconds since `t0` into `slot` when timing, and restarts the clock.
    static void lap(double* slot, clock::time_point& t0) {
        if (!slot) return;
        const auto t1 = clock::now();
        *slot += std::chrono::duration<double>(t1 - t0).count();
        t0 = t1;
    }

    void forward_chunk(const S* images, int b, S* logits, workspace& ws, vit_digits_trace<S>* trace,
                       vit_digits_stage_times* times) const {
        const auto& c = cfg_;
        const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens, F = c.mlp_hidden_dim;
        const std::int64_t G = c.grid, P = c.patch_size, Cin = c.in_chans, S_img = c.img_size;
        const std::int64_t rows = b * L, patch_len = Cin * P * P;
        auto t0 = clock::now();
        ws.resize(c, b, trace != nullptr);
        auto at = [times](double vit_digits_stage_times::*m) { return times ? &(times->*m) : nullptr; };

        // 1. Patch embedding as a GEMM per image: gather each patch (Cin, P, P) into a row, then
        //    z_i = token_init (class token + pos_embed, and pos_embed + conv bias on the patch rows);
        //    z_i[1:] += (G², Cin·P²) · W_peᵀ (W_pe viewed as (C, Cin·P²)).
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
        const cmap token_init(token_init_.data(), L, C), patch_w(patch_w_, C, patch_len);
        for (std::int64_t img = 0; img < b; ++img) {
            map zi(ws.z.data() + img * L * C, L, C);
            zi = token_init;
            zi.bottomRows(G * G).noalias() +=
                cmap(ws.patches.data() + img * G * G * patch_len, G * G, patch_len) * patch_w.transpose();
        }
        if (trace) trace->tokens.insert(trace->tokens.end(), ws.z.begin(), ws.z.begin() + rows * C);
        lap(at(&vit_digits_stage_times::patch_embed), t0);

        // 3. Blocks.
        // q, k, v read in place from the qkv projection (b, L, 3, H, D): strided (b, H, L, D) views
        auto qkv_view = [&](int t) {
            return rpe::tensor_ref<const S>::with_strides(ws.qkv.data() + t * C, {b, H, L, D}, {L * 3 * C, D, 3 * C, 1});
        };
        const rpe::tensor_ref<const S> q_ref = qkv_view(0), k_ref = qkv_view(1), v_ref = qkv_view(2);
        const rpe::tensor_ref<S> out_ref(ws.out.data(), {b, H, L, D}), attn_ref(ws.attn.data(), {b, H, L, L});
        const S* pending = nullptr;  // fc2 bias of the previous block, not yet added to z (C)
        for (int i = 0; i < c.depth; ++i) {
            const auto& w = blocks_[static_cast<std::size_t>(i)];
            // h = LN1(z + pending); qkv = h·W_qkvᵀ + b: (b·L, 3C), column t·C + n·D + d.
            layer_norm(ws.z.data(), rows, C, pending, w.norm1_w, w.norm1_b, ws.h.data());
            lap(at(&vit_digits_stage_times::layer_norm), t0);
            linear(ws.h.data(), rows, C, w.qkv_w, w.qkv_b, 3 * C, ws.qkv.data());
            lap(at(&vit_digits_stage_times::qkv), t0);
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
            if (trace)
                trace->attn[static_cast<std::size_t>(i)].insert(trace->attn[static_cast<std::size_t>(i)].end(), ws.attn.begin(),
                                                                ws.attn.begin() + b * H * L * L);
            lap(at(&vit_digits_stage_times::attention), t0);
            // The head reads only the class tokens, so unless traced the last block's projection, LN2
            // and MLP run on those b rows alone (z rows L·C apart); otherwise on all b·L rows.
            const bool cls_only = !trace && i == c.depth - 1;
            const std::int64_t m = cls_only ? b : rows, zs = cls_only ? L * C : C, lm = cls_only ? 1 : L;
            // (b, H, L, D) → (m, C), heads concatenated: one pass, writing o in order
            for (std::int64_t img = 0; img < b; ++img)
                for (std::int64_t l = 0; l < lm; ++l) {
                    S* row = ws.o.data() + (img * lm + l) * C;
                    for (std::int64_t n = 0; n < H; ++n) std::copy_n(ws.out.data() + ((img * H + n) * L + l) * D, D, row + n * D);
                }
            lap(at(&vit_digits_stage_times::repack), t0);
            // z += o·W_projᵀ; the bias b_proj is added by LN2's pass
            linear_accumulate(ws.o.data(), m, C, w.proj_w, C, ws.z.data(), zs);
            lap(at(&vit_digits_stage_times::proj), t0);
            // h = LN2(z += b_proj)
            layer_norm(ws.z.data(), m, zs, w.proj_b, w.norm2_w, w.norm2_b, ws.h.data());
            lap(at(&vit_digits_stage_times::layer_norm), t0);
            // f = GELU(h·W_fc1ᵀ + b_fc1)
            linear(ws.h.data(), m, C, w.fc1_w, w.fc1_b, F, ws.f.data());
            lap(at(&vit_digits_stage_times::mlp), t0);
            // exact GELU 0.5·x·(1 + erf(x/√2)); Eigen's erf is vectorised for float (a rational
            // approximation within a few ulp of std::erf) and std::erf for double
            auto f = Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>>(ws.f.data(), m * F);
            f = S(0.5) * f * (S(1) + (f * static_cast<S>(0.70710678118654752440084436210484903928483593768847)).erf());
            lap(at(&vit_digits_stage_times::gelu), t0);
            // z += f·W_fc2ᵀ; b_fc2 is added by the next LayerNorm's pass (or here when traced)
            linear_accumulate(ws.f.data(), m, F, w.fc2_w, C, ws.z.data(), zs);
            pending = w.fc2_b;
            lap(at(&vit_digits_stage_times::mlp), t0);
            if (trace) {
                map(ws.z.data(), rows, C).rowwise() += crow_map(pending, C);
                pending = nullptr;
                trace->blocks[static_cast<std::size_t>(i)].insert(trace->blocks[static_cast<std::size_t>(i)].end(), ws.z.begin(),
                                                                  ws.z.begin() + rows * C);
            }
        }

        // 4. logits = head(LN(z_0 + pending)) for the class token of each image (rows L·C apart).
        layer_norm(ws.z.data(), b, L * C, pending, norm_w_, norm_b_, ws.cls.data());
        linear(ws.cls.data(), b, C, head_w_, head_b_, c.num_classes, logits);
        lap(at(&vit_digits_stage_times::head), t0);
    }

    rpe::io::safetensors_file file_;    // keeps the float views alive
    std::deque<std::vector<S>> owned_;  // double: converted weights (stable addresses)
    vit_digits_config cfg_;
    std::unique_ptr<rpe::any_term<S>> terms_[3];  // q, k, v (null when off)
    const S *patch_w_ = nullptr, *patch_b_ = nullptr, *cls_token_ = nullptr, *pos_embed_ = nullptr;
    const S *norm_w_ = nullptr, *norm_b_ = nullptr, *head_w_ = nullptr, *head_b_ = nullptr;
    std::vector<block_weights> blocks_;
    std::vector<S> token_init_;  // (L, C): class token and patch biases folded into pos_embed
    struct workspace_pool {
        std::mutex mutex;  // behind a pointer, so the model stays movable
        std::vector<std::unique_ptr<workspace>> free;
    };
    std::unique_ptr<workspace_pool> pool_ = std::make_unique<workspace_pool>();
    int chunk_ = 16;
};

}  // namespace rpe::examples
