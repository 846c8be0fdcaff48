/// @file vit_model.hpp
/// @brief A DeiT / ViT classifier (the reference's `VisionTransformer` with `RPEBlock`s) run in
/// inference on the CPU with its Linear layers on rpe's float product (AVX-512F builds; Eigen's
/// GEMMs elsewhere and in float64) and the library's fused attention,
/// rpe::attention_forward, with iRPE on any of q, k, v and optionally 2D RoPE on q and k.
///
/// Shared by examples/vit_digits (the digits models, weights from a `.safetensors` file) and the
/// whole-model benchmarks `model/deit_s/...` (bench/bench_model.cpp: DeiT-S with random weights).
/// The model:
///
///   image (Cin, S, S) → patch embedding (Conv2d, kernel = stride = P, done as one GEMM over the
///   gathered Cin·P·P patches) → G×G patch tokens (G = S / P, patch p = G·r + c) → class token
///   prepended (token 0) → + pos_embed (all L = 1 + G² tokens) → depth × pre-norm block
///   [z += proj(attn_rpe(LN1 z)); z += fc2 GELU(fc1 LN2 z)] → LN of the class token → head → logits.
///
/// Tensors keep the names and layouts of the DeiT / timm `state_dict` (nn.Linear weights
/// (out, in), row-major); vit_weights holds pointers to them, so a model runs on weights wherever
/// they live (a file's buffer, or make_random_vit's own storage).
#pragma once

// rpe first: its headers bring in Eigen and the x86 intrinsics without g++ 12's AVX-512 false
// positives (rpe/backend/cpu/eigen.hpp), which the first inclusion decides.
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace rpe::examples {

/// @brief A ViT's hyperparameters. Set the first group (and the iRPE / RoPE settings), then
/// derive() fills the derived fields; vit_model calls derive() itself.
struct vit_config {
    int img_size = 0;              ///< S: input height = width
    int patch_size = 0;            ///< P: patch side, conv kernel = stride
    int in_chans = 0;              ///< Cin: input channels
    int embed_dim = 0;             ///< C
    int depth = 0;                 ///< number of blocks
    int num_heads = 0;             ///< H
    int mlp_hidden_dim = 0;        ///< F
    int num_classes = 0;           ///< outputs of the head
    bool qkv_bias = true;          ///< the qkv Linear has a bias
    double layer_norm_eps = 1e-6;  ///< LayerNorm ε
    std::string rpe_on;            ///< the iRPE targets, a subset of "qkv"; empty = no iRPE
    /// @brief The iRPE configuration shared by every target (method, mode, α, β, γ, shared
    /// head, skip); `target` is set per term, heads and head dim by derive().
    rpe::term_spec rpe;
    /// @brief RoPE on q and k in every block, the class token left unrotated (skip 1);
    /// std::monostate = none. rope::mixed takes per-block frequencies (vit_block_weights::rope_freqs).
    rpe::rope_form rope = {};
    /// @brief When true, the last block's queries (vit_model; vit_model_bf16 computes every
    /// token's), attention (its class-token query rows: rpe::attention_options::query_rows),
    /// projection, LN2 and MLP run on the class tokens only
    /// (the head reads nothing else; forward() with a trace computes every token anyway); false
    /// computes every token in every block, as timm does (the MACs that vit_macs counts with
    /// `prune_last_block = false`).
    bool last_block_class_token_only = true;

    int head_dim = 0;         ///< derived: D = C / H
    int grid = 0;             ///< derived: G = S / P
    int tokens = 0;           ///< derived: L = 1 + G² (class token first)
    int rpe_num_buckets = 0;  ///< K per table, extra class-token bucket included; derived when 0

    /// @brief Checks the settings and fills head_dim, grid, tokens, rpe.num_heads, rpe.head_dim
    /// and (when 0) rpe_num_buckets. Idempotent.
    /// @throws rpe::invalid_argument `[rpe.vit_model] ...` for a size < 1 (num_classes < 0),
    ///   img_size not a multiple of patch_size, G > 46340 (L beyond int), embed_dim not a
    ///   multiple of num_heads, rpe_on with a letter other than q, k, v or one twice, iRPE with
    ///   skip != 1 or the Cross method (two tables per target), layer_norm_eps not finite and > 0;
    ///   what term_spec::num_buckets throws for invalid α, β, γ.
    void derive() {
        const char* c = "vit_model";
        for (const auto& [name, v] : {std::pair<const char*, int>{"img_size", img_size},
                                      {"patch_size", patch_size},
                                      {"in_chans", in_chans},
                                      {"embed_dim", embed_dim},
                                      {"depth", depth},
                                      {"num_heads", num_heads},
                                      {"mlp_hidden_dim", mlp_hidden_dim}})
            rpe::detail::require(v >= 1, c, name, " = ", v, "; expected >= 1");
        rpe::detail::require(num_classes >= 0, c, "num_classes = ", num_classes, "; expected >= 0");
        rpe::detail::require(std::isfinite(layer_norm_eps) && layer_norm_eps > 0, c, "layer_norm_eps = ", layer_norm_eps,
                             "; expected finite and > 0");
        rpe::detail::require(img_size % patch_size == 0, c, "img_size = ", img_size,
                             " is not a multiple of patch_size = ", patch_size);
        rpe::detail::require(embed_dim % num_heads == 0, c, "embed_dim = ", embed_dim,
                             " is not a multiple of num_heads = ", num_heads);
        grid = img_size / patch_size;
        rpe::detail::require(grid <= 46340, c, "img_size / patch_size = ", grid,
                             "; expected at most 46340 (the 1 + grid^2 tokens must fit int)");
        head_dim = embed_dim / num_heads;
        tokens = 1 + grid * grid;
        rpe.num_heads = num_heads;
        rpe.head_dim = head_dim;
        for (std::size_t i = 0; i < rpe_on.size(); ++i) {
            const char t = rpe_on[i];
            rpe::detail::require(t == 'q' || t == 'k' || t == 'v', c, "rpe_on = '", rpe_on, "'; expected letters of \"qkv\"");
            rpe::detail::require(rpe_on.find(t) == i, c, "rpe_on = '", rpe_on, "' names target ", t, " twice");
        }
        if (rpe_on.empty()) return;
        rpe::detail::require(rpe.skip == 1, c, "rpe.skip = ", rpe.skip,
                             "; expected 1 (the class token is the only token before the grid)");
        rpe::detail::require(rpe.method != rpe::method::cross, c,
                             "rpe.method = cross (two tables per target) is not supported by this model");
        if (rpe_num_buckets == 0) rpe_num_buckets = rpe.num_buckets();
    }
};

/// @brief DeiT-S (Touvron et al. 2021; the iRPE paper's DeiT-S): 224×224×3 images, patch 16
/// (G = 14, L = 197), C = 384, 6 heads (D = 64), depth 12, MLP 1536, 1000 classes, LayerNorm
/// ε 1e-6; every token computed in every block (last_block_class_token_only = false).
/// @param rpe_on iRPE targets ("", "k", "qkv", ...): contextual Product, piecewise ratio 1.9
///   (α 1.9, β 3.8, γ 15.2, K = 7·7 + 1 = 50), tables shared by the heads, skip 1, as the
///   reference's DeiT-iRPE (`get_rpe_config(ratio=1.9, method="product", mode="ctx",
///   shared_head=True, skip=1, rpe_on=...)`).
/// @param rope RoPE on q and k (e.g. rpe::rope::mixed{}: rope-vit's RoPE-Mixed), or none.
/// @throws what vit_config::derive throws.
inline vit_config deit_s_config(const std::string& rpe_on = "", rpe::rope_form rope = {}) {
    vit_config c;
    c.img_size = 224, c.patch_size = 16, c.in_chans = 3, c.embed_dim = 384, c.depth = 12, c.num_heads = 6;
    c.mlp_hidden_dim = 1536, c.num_classes = 1000;
    c.rpe_on = rpe_on;
    c.rpe.method = rpe::method::product;
    c.rpe.contextual = true;
    c.rpe.ratio(1.9);
    c.rpe.shared_head = true;
    c.rpe.skip = 1;
    c.rope = std::move(rope);
    c.last_block_class_token_only = false;
    c.derive();
    return c;
}

/// @brief Multiply-accumulates of one image's forward, by formula (the convention of the
/// iRPE paper's MACs and of fvcore: one MAC per product term of a matrix product; LayerNorm,
/// softmax, GELU, biases, residual adds, gathers and table look-ups count 0).
struct vit_mac_count {
    double patch_embed = 0;  ///< G²·(Cin·P²)·C
    double qkv = 0;          ///< depth · L·C·3C (a pruned last block: L·C·2C + C·C, its class token's query alone)
    double attention = 0;    ///< Σ_blocks 2·H·n·L·D (q·kᵀ and a·v; n = L query rows, or 1 in a pruned last block)
    double proj = 0;         ///< Σ_blocks n·C² (n = L, or 1 in a pruned last block)
    double mlp = 0;          ///< Σ_blocks 2·n·C·F
    double head = 0;         ///< C · num_classes
    /// @brief iRPE: Σ_blocks H·n·K·D per contextual term (q, k: the products of q or k with the
    /// K table vectors; v: the K per-bucket sums of a times the table; n = L, and in a pruned last
    /// block 1 for k and v, L for q: its per-key products are made for every key), 0 for bias mode
    /// (a gather).
    double rpe = 0;
    /// @brief RoPE: depth · 2 (q and k) · H·(L−1)·D · 2 (each rotated value is x·cos − y·sin),
    /// plus for rope::mixed the angles col·fx + row·fy: depth · H·(L−1)·D/2 · 2.
    double rope = 0;
    /// @brief Everything but rpe and rope.
    [[nodiscard]] double base() const { return patch_embed + qkv + attention + proj + mlp + head; }
    /// @brief base() + rpe + rope.
    [[nodiscard]] double total() const { return base() + rpe + rope; }
};

/// @brief The MACs of one image's forward for `cfg` (derived; see vit_mac_count for the formula).
/// @param prune_last_block count the last block's queries, attention rows, projection and MLP on
///   the class token only (vit_config::last_block_class_token_only).
[[nodiscard]] inline vit_mac_count vit_macs(const vit_config& cfg, bool prune_last_block) {
    const double C = cfg.embed_dim, H = cfg.num_heads, D = cfg.head_dim, L = cfg.tokens, F = cfg.mlp_hidden_dim, G = cfg.grid,
                 P = cfg.patch_size, depth = cfg.depth;
    vit_mac_count m;
    m.patch_embed = G * G * (cfg.in_chans * P * P) * C;
    const double n_all = depth * L, n = prune_last_block ? (depth - 1) * L + 1 : n_all;  // query rows of all blocks
    m.qkv = n_all * C * 2 * C + n * C * C;  // k and v of every token, q of the query rows
    m.attention = n * 2 * H * L * D;
    m.proj = n * C * C;
    m.mlp = n * 2 * C * F;
    m.head = C * cfg.num_classes;
    if (cfg.rpe.contextual)
        for (const char t : cfg.rpe_on) m.rpe += (t == 'q' ? n_all : n) * H * cfg.rpe_num_buckets * D;
    if (cfg.rope.index() != 0) {
        m.rope = depth * 2 * H * (L - 1) * D * 2;
        if (std::holds_alternative<rpe::rope::mixed>(cfg.rope)) m.rope += depth * H * (L - 1) * (D / 2) * 2;
    }
    return m;
}

/// @brief Weights of one pre-norm block, nn.Linear layouts (out, in), row-major.
template <class S>
struct vit_block_weights {
    const S* norm1_w = nullptr;  ///< (C)
    const S* norm1_b = nullptr;  ///< (C)
    const S* qkv_w = nullptr;    ///< (3C, C): rows t·C + h·D + d for t = q, k, v
    const S* qkv_b = nullptr;    ///< (3C), or null without qkv_bias
    const S* proj_w = nullptr;   ///< (C, C)
    const S* proj_b = nullptr;   ///< (C)
    const S* norm2_w = nullptr;  ///< (C)
    const S* norm2_b = nullptr;  ///< (C)
    const S* fc1_w = nullptr;    ///< (F, C)
    const S* fc1_b = nullptr;    ///< (F)
    const S* fc2_w = nullptr;    ///< (C, F)
    const S* fc2_b = nullptr;    ///< (C)
    /// q, k, v lookup tables, each of its term's table_shape() (null when the target is off).
    const S* rpe_table[3] = {nullptr, nullptr, nullptr};
    const S* rope_freqs = nullptr;  ///< (2, H, D/2) fx, fy for rope::mixed; null otherwise
};

/// @brief Every weight of a model (pointers; vit_model keeps their owner alive).
template <class S>
struct vit_weights {
    const S* patch_w = nullptr;                ///< (C, Cin, P, P)
    const S* patch_b = nullptr;                ///< (C)
    const S* cls_token = nullptr;              ///< (C)
    const S* pos_embed = nullptr;              ///< (L, C)
    const S* norm_w = nullptr;                 ///< (C)
    const S* norm_b = nullptr;                 ///< (C)
    const S* head_w = nullptr;                 ///< (num_classes, C)
    const S* head_b = nullptr;                 ///< (num_classes)
    std::vector<vit_block_weights<S>> blocks;  ///< [depth]
};

/// @brief Intermediate tensors of a forward, for checking against the reference's (optional).
/// Each is appended to chunk by chunk, so after a call it covers every image of the batch, in order.
template <class S>
struct vit_trace {
    std::vector<S> tokens;               ///< (N, L, C): after patch embedding, class token, pos_embed
    std::vector<std::vector<S>> blocks;  ///< [depth] of (N, L, C): residual stream after each block
    std::vector<std::vector<S>> attn;    ///< [depth] of (N, H, L, L): attention probabilities (after softmax)
};

/// @brief Seconds spent in each stage of vit_model::forward, accumulated over its chunks (and
/// over its threads: with several threads these are CPU seconds, summing to more than the wall time).
struct vit_stage_times {
    double patch_embed = 0;  ///< workspace sizing, patch gather, patch GEMM onto class token and pos_embed
    double layer_norm = 0;   ///< LN1 and LN2 of every block (with the residual biases they add)
    double qkv = 0;          ///< qkv Linear (GEMM, bias)
    double repack = 0;       ///< (B, H, L, D) attention output → (B·L, C) (q, k, v are read in place from qkv)
    double attention = 0;    ///< rpe::attention_forward (iRPE, RoPE, softmax, a·v)
    double proj = 0;         ///< attention projection GEMM, accumulated into the residual stream
    double mlp = 0;          ///< fc1 and fc2 GEMMs
    double gelu = 0;         ///< exact-erf GELU over the fc1 output
    double head = 0;         ///< final LN of the class tokens and the head Linear
    /// @brief Sum of the stages.
    [[nodiscard]] double total() const { return patch_embed + layer_norm + qkv + repack + attention + proj + mlp + gelu + head; }
    /// @brief Stage by stage minimum of two measurements (for a best-of-n under load).
    [[nodiscard]] vit_stage_times min(const vit_stage_times& o) const {
        vit_stage_times m;
        m.patch_embed = std::min(patch_embed, o.patch_embed), m.layer_norm = std::min(layer_norm, o.layer_norm);
        m.qkv = std::min(qkv, o.qkv), m.repack = std::min(repack, o.repack), m.attention = std::min(attention, o.attention);
        m.proj = std::min(proj, o.proj), m.mlp = std::min(mlp, o.mlp), m.gelu = std::min(gelu, o.gelu);
        m.head = std::min(head, o.head);
        return m;
    }
    /// @brief Adds another measurement stage by stage.
    vit_stage_times& operator+=(const vit_stage_times& o) {
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

/// @brief A DeiT / ViT classifier with iRPE (and optionally RoPE) attention, in scalar type S
/// (float or double), on weights given as pointers (vit_weights).
///
/// Usage (random weights, see make_random_vit; examples/vit_digits loads a file):
/// @code
///   auto model = rpe::examples::make_random_vit<float>(rpe::examples::deit_s_config("k"));
///   model.forward(rpe::tensor_ref<const float>(images, {n, 3, 224, 224}),
///                 rpe::tensor_ref<float>(logits, {n, 1000}));
/// @endcode
/// Memory: the batch is processed in chunks of chunk_size() images (default 16); a workspace is
/// O(chunk · L·(3C + F)), plus chunk · H·L² when traced, independent of N, and is kept for the
/// next call (one per thread that ran a chunk) until the model is destroyed.
/// Threads: with OpenMP, forward() runs the chunks in parallel (one workspace per thread); a
/// single chunk runs on the calling thread, with the parallelism inside rpe's kernels and the
/// Linear layers' products (rpe's float product with AVX-512F, else Eigen's; all follow
/// OMP_NUM_THREADS: one thread when it is 1).
/// Thread-safety: forward() is const and may run concurrently (each call takes its own workspaces
/// from a mutex-guarded pool that keeps them between calls).
/// Move-only (it owns its rpe terms).
template <class S = float>
class vit_model {
    static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "vit_model: S must be float or double");

public:
    using scalar_type = S;
    using matrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  ///< row-major
    using cmap = Eigen::Map<const matrix>;
    using map = Eigen::Map<matrix>;
    using row_vector = Eigen::Matrix<S, 1, Eigen::Dynamic>;
    using crow_map = Eigen::Map<const row_vector>;

    /// @brief Builds the model on `weights`, which must stay valid while the model lives;
    /// `owner` (any object, may be null) is kept alive with the model for that.
    /// @throws what vit_config::derive throws; rpe::invalid_argument `[rpe.vit_model] ...` for a
    ///   null weight (named as in the DeiT state dict, e.g. `blocks.3.mlp.fc1.weight`; qkv bias
    ///   only with qkv_bias, head only with num_classes > 0) or a wrong number of blocks; what
    ///   rpe::make_term throws for an invalid iRPE configuration; `rpe_num_buckets` differing
    ///   from the library's K.
    vit_model(vit_config cfg, vit_weights<S> weights, std::shared_ptr<const void> owner = nullptr)
        : owner_(std::move(owner)), cfg_(std::move(cfg)), w_(std::move(weights)) {
        build();
    }

    vit_model(vit_model&&) noexcept = default;
    vit_model& operator=(vit_model&&) noexcept = default;
    vit_model(const vit_model&) = delete;
    vit_model& operator=(const vit_model&) = delete;
    ~vit_model() = default;

    /// @brief The hyperparameters (derived).
    [[nodiscard]] const vit_config& config() const { return cfg_; }
    /// @brief The weights the model runs on.
    [[nodiscard]] const vit_weights<S>& weights() const { return w_; }

    /// @brief The iRPE term on target `t` (shared by all blocks), or null when `rpe_on` lacks it.
    [[nodiscard]] const rpe::any_term<S>* rpe_term(rpe::target t) const { return terms_[slot_of(t)].get(); }

    /// @brief Images per chunk of forward() (bounds its workspace).
    [[nodiscard]] int chunk_size() const { return chunk_; }
    /// @brief Sets the chunk size. @throws rpe::invalid_argument for n < 1.
    void set_chunk_size(int n) {
        rpe::detail::require(n >= 1, "vit_model", "chunk_size = ", n, "; expected >= 1");
        chunk_ = n;
    }

    /// @brief Batch forward: logits of every image.
    /// @param images (N, Cin, S, S), row-major, preprocessed as the model was trained.
    /// @param logits (N, num_classes), written.
    /// @param trace  optional: filled with the intermediate tensors (see vit_trace), replacing
    ///   what it held.
    /// @param times  optional: the seconds of each stage are added to it (see vit_stage_times);
    ///   null (the default) takes no timings.
    /// @throws rpe::invalid_argument `[rpe.vit_model] ...` for a shape that does not match the
    ///   config or a null buffer; checked before anything is written.
    void forward(rpe::tensor_ref<const S> images, rpe::tensor_ref<S> logits, vit_trace<S>* trace = nullptr,
                 vit_stage_times* times = nullptr) const {
        const int s = cfg_.img_size;
        rpe::detail::require(
            images.rank == 4 && images.extent(1) == cfg_.in_chans && images.extent(2) == s && images.extent(3) == s, "vit_model",
            "images have shape ", images.shape_string(), "; expected (N, ", cfg_.in_chans, ", ", s, ", ", s, ")");
        const std::int64_t n = images.extent(0);
        rpe::detail::require(logits.has_shape({n, cfg_.num_classes}), "vit_model", "logits have shape ", logits.shape_string(),
                             "; expected (", n, ", ", cfg_.num_classes, ")");
        rpe::detail::require(n == 0 || (images.data != nullptr && (logits.data != nullptr || cfg_.num_classes == 0)), "vit_model",
                             "images or logits is null");
        if (trace) {
            trace->tokens.clear();
            trace->blocks.assign(static_cast<std::size_t>(cfg_.depth), {});
            trace->attn.assign(static_cast<std::size_t>(cfg_.depth), {});
        }
        const std::int64_t image_size = static_cast<std::int64_t>(cfg_.in_chans) * s * s;
        const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
        auto run = [&](std::int64_t ch, workspace& ws, vit_stage_times* t) {
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
                vit_stage_times mine;
#pragma omp for schedule(dynamic, 1)
                for (std::int64_t ch = 0; ch < chunks; ++ch) {
                    try {
                        run(ch, ws, times ? &mine : nullptr);
                    } catch (...) {
#pragma omp critical(rpe_vit_model_error)
                        if (!error) error = std::current_exception();
                    }
                }
                if (times) {
#pragma omp critical(rpe_vit_model_times)
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

    /// @brief Block `block`'s attention step exactly as forward() runs it: rpe::attention_forward
    /// with the block's iRPE tables and RoPE frequencies, q, k, v read in place from the qkv
    /// projection (the library scales q by D^-1/2).
    /// @param qkv  (B, L, 3C): the qkv Linear's output, column t·C + h·D + d (t = q, k, v).
    /// @param out  (B, H, L, D), written.
    /// @param attn (B, H, L, L) probabilities, written; or empty (the fused path, no (L, L) buffer).
    /// @param rows the query rows computed (rpe::attention_options::query_rows; the others of out
    ///   and attn are not written): forward() passes {0, 1} in a last block pruned to the class
    ///   token (vit_config::last_block_class_token_only).
    /// @throws rpe::invalid_argument `[rpe.vit_model] ...` for a block outside [0, depth) or a
    ///   qkv of another shape; what rpe::attention_forward throws for out, attn or rows.
    void attention(int block, rpe::tensor_ref<const S> qkv, rpe::tensor_ref<S> out, rpe::tensor_ref<S> attn = {},
                   rpe::query_row_range rows = {}) const {
        rpe::detail::require(block >= 0 && block < cfg_.depth, "vit_model", "block = ", block, "; expected in [0, ", cfg_.depth,
                             ")");
        const std::int64_t C = cfg_.embed_dim, H = cfg_.num_heads, D = cfg_.head_dim, L = cfg_.tokens;
        rpe::detail::require(qkv.rank == 3 && qkv.contiguous() && qkv.extent(1) == L && qkv.extent(2) == 3 * C, "vit_model",
                             "qkv has shape ", qkv.shape_string(), "; expected (B, ", L, ", ", 3 * C, "), contiguous");
        const std::int64_t b = qkv.extent(0);
        // q, k, v read in place from the qkv projection (b, L, 3, H, D): strided (b, H, L, D) views
        auto view = [&](std::int64_t t) {
            return rpe::tensor_ref<const S>::with_strides(qkv.data + t * C, {b, H, L, D}, {L * 3 * C, D, 3 * C, 1});
        };
        const auto& w = w_.blocks[static_cast<std::size_t>(block)];
        rpe::attention_inputs<S> in;
        in.q = view(0);
        in.k = view(1);
        in.v = view(2);
        in.height = cfg_.grid;
        in.width = cfg_.grid;
        rpe::attention_term<S>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int t = 0; t < 3; ++t) {
            if (!terms_[t]) continue;
            slots[t]->term = terms_[t].get();
            slots[t]->tables = {rpe::tensor_ref<const S>(w.rpe_table[t], std::span<const std::int64_t>(rpe_shape_[t]))};
        }
        if (cfg_.rope.index() != 0) {
            in.rope.form = cfg_.rope;
            in.rope.skip = 1;
            if (std::holds_alternative<rpe::rope::mixed>(cfg_.rope)) in.rope.freqs = {w.rope_freqs, {2, H, D / 2}};
        }
        rpe::attention_forward(in, out, attn, rpe::attention_options{.query_rows = rows});
    }

private:
    using clock = std::chrono::steady_clock;
    static int slot_of(rpe::target t) { return t == rpe::target::query ? 0 : (t == rpe::target::key ? 1 : 2); }

    /// Scratch buffers of one chunk of B images.
    struct workspace {
        // 64-byte aligned (Eigen's allocator): the products' vector loads and stores of whole rows
        // (rows of C, 3C and F values: multiples of 16) never split a cache line
        using buffer = std::vector<S, Eigen::aligned_allocator<S>>;
        buffer patches, z, h, qkv, out, attn, o, f, cls;
        /// Sizes the buffers for b images; the (b, H, L, L) probabilities only when traced.
        void resize(const vit_config& c, int b, bool traced) {
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

    /// Checks the weights and makes the iRPE terms (one per target, shared by the blocks; each
    /// block has its own tables).
    void build() {
        auto& c = cfg_;
        c.derive();
        for (const char t : c.rpe_on) {
            rpe::term_spec spec = c.rpe;
            spec.target = rpe::parse_target(std::string_view(&t, 1));
            auto& term = terms_[slot_of(spec.target)];
            term = rpe::make_term<S>(spec);
            rpe::detail::require(term->num_buckets() == c.rpe_num_buckets, "vit_model", "rpe_num_buckets = ", c.rpe_num_buckets,
                                 " but the library computes K = ", term->num_buckets(),
                                 " for this iRPE configuration; the weights and rpe disagree on the bucket layout");
            rpe::detail::require(term->num_tables() == 1, "vit_model", "a term with ", term->num_tables(),
                                 " tables is not supported by this model");
            rpe_shape_[slot_of(spec.target)] = term->table_shape();
        }
        auto need = [](const S* p, const std::string& name) {
            rpe::detail::require(p != nullptr, "vit_model", "weight ", name, " is null");
        };
        need(w_.patch_w, "patch_embed.proj.weight");
        need(w_.patch_b, "patch_embed.proj.bias");
        need(w_.cls_token, "cls_token");
        need(w_.pos_embed, "pos_embed");
        need(w_.norm_w, "norm.weight");
        need(w_.norm_b, "norm.bias");
        if (c.num_classes > 0) {
            need(w_.head_w, "head.weight");
            need(w_.head_b, "head.bias");
        }
        rpe::detail::require(static_cast<int>(w_.blocks.size()) == c.depth, "vit_model", "weights hold ", w_.blocks.size(),
                             " blocks; expected depth = ", c.depth);
        const bool mixed = std::holds_alternative<rpe::rope::mixed>(c.rope);
        for (int i = 0; i < c.depth; ++i) {
            const auto& w = w_.blocks[static_cast<std::size_t>(i)];
            const std::string p = "blocks." + std::to_string(i) + ".";
            need(w.norm1_w, p + "norm1.weight");
            need(w.norm1_b, p + "norm1.bias");
            need(w.qkv_w, p + "attn.qkv.weight");
            if (c.qkv_bias) need(w.qkv_b, p + "attn.qkv.bias");
            need(w.proj_w, p + "attn.proj.weight");
            need(w.proj_b, p + "attn.proj.bias");
            need(w.norm2_w, p + "norm2.weight");
            need(w.norm2_b, p + "norm2.bias");
            need(w.fc1_w, p + "mlp.fc1.weight");
            need(w.fc1_b, p + "mlp.fc1.bias");
            need(w.fc2_w, p + "mlp.fc2.weight");
            need(w.fc2_b, p + "mlp.fc2.bias");
            static constexpr const char* letters[3] = {"q", "k", "v"};
            for (int t = 0; t < 3; ++t)
                if (terms_[t]) need(w.rpe_table[t], p + "attn.rpe_" + letters[t] + " table");
            if (mixed) need(w.rope_freqs, p + "attn.rope freqs");
        }

        // (L, C): what every image's tokens start from: class token + pos_embed[0], then
        // pos_embed[p] + the patch conv's bias (the patch GEMM is accumulated onto it).
        const std::int64_t C = c.embed_dim, L = c.tokens;
        token_init_.assign(w_.pos_embed, w_.pos_embed + L * C);
        map init(token_init_.data(), L, C);
        init.row(0) += crow_map(w_.cls_token, C);
        init.bottomRows(L - 1).rowwise() += crow_map(w_.patch_b, C);
    }

    // ---------------------------------------------------------------------------------------
    // Forward
    // ---------------------------------------------------------------------------------------

    /// y (rows, out) = x (rows, in) · Wᵀ + b, W (out, in) row-major as nn.Linear. The bias is
    /// written first and the product accumulated onto it by the GEMM (Eigen's `noalias() =`
    /// would clear y first instead), so the bias costs no extra pass.
    static void linear(const S* x, std::int64_t rows, std::int64_t in, const S* w, const S* b, std::int64_t out, S* y) {
        linear_strided(x, in, rows, in, w, b, out, y, out);
    }

    /// @brief Whether the Linear layers run on rpe's float product (`cpu::simd::gemm_bt`: W's
    /// 64-column strips of Wᵀ packed per call, register tiles; float with AVX-512F) rather than
    /// Eigen's: 14–24 % faster at DeiT-S's layers and 16–24 % at the digits models'
    /// (docs/benchmarks.md, "The Linear layers on rpe's product").
    static constexpr bool simd_linear =
#if defined(__AVX512F__)
        std::is_same_v<S, float>;
#else
        false;
#endif

    /// y rows `y_stride` apart += x rows `x_stride` apart · Wᵀ (W (out, in) row-major) on rpe's
    /// float product (simd_linear). Outside a parallel region and above about a million
    /// multiply-adds, the 64-column strips of y (and, with fewer strips than 2 per thread, row
    /// ranges) are shared among the OpenMP threads; every element is one in-order chain, so the
    /// result does not depend on the thread count.
    static void linear_simd(const S* x, std::int64_t x_stride, std::int64_t rows, std::int64_t in, const S* w, std::int64_t out,
                            S* y, std::int64_t y_stride) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<S, float>) {
            namespace simd = rpe::detail::cpu::simd;
            const std::int64_t strips = (out + 63) / 64;
            int threads = 1;
#if defined(_OPENMP)
            if (!omp_in_parallel() && rows * in * out >= (std::int64_t{1} << 20)) threads = omp_get_max_threads();
#endif
            // rows split only when the strips alone leave threads idle: each split packs W again
            const std::int64_t parts =
                threads > 1 && strips < 2 * threads ? std::min<std::int64_t>((2 * threads + strips - 1) / strips, rows) : 1;
            const std::int64_t part_rows = (rows + parts - 1) / parts, items = strips * parts;
            const auto run = [&](std::int64_t item, float* pack) {
                const std::int64_t j = (item % strips) * 64, r0 = (item / strips) * part_rows;
                const std::int64_t nr = std::min(part_rows, rows - r0);
                simd::gemm_bt(nr, j, std::min(j + 64, out), in, x + r0 * x_stride, x_stride, 1, w, in, y + r0 * y_stride,
                              y_stride, true, pack);
            };
            if (threads == 1 || items == 1) {
                alignas(64) float pack[simd::gemm_bt_pack_floats];
                for (std::int64_t item = 0; item < items; ++item) run(item, pack);
                return;
            }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
            {
                alignas(64) float pack[simd::gemm_bt_pack_floats];
#pragma omp for schedule(dynamic, 1)
                for (std::int64_t item = 0; item < items; ++item) run(item, pack);
            }
#endif
        }
#else
        (void)x, (void)x_stride, (void)rows, (void)in, (void)w, (void)out, (void)y, (void)y_stride;
#endif
    }

    /// linear() on rows `x_stride` apart (x) and `y_stride` apart (y): some tokens, or some of W's
    /// output rows (W (out, in) row-major, b (out) or null).
    static void linear_strided(const S* x, std::int64_t x_stride, std::int64_t rows, std::int64_t in, const S* w, const S* b,
                               std::int64_t out, S* y, std::int64_t y_stride) {
        Eigen::Map<matrix, 0, Eigen::OuterStride<>> ym(y, rows, out, Eigen::OuterStride<>(y_stride));
        if (b)
            ym.rowwise() = crow_map(b, out);
        else
            ym.setZero();
        if constexpr (simd_linear)
            linear_simd(x, x_stride, rows, in, w, out, y, y_stride);
        else
            ym.noalias() += Eigen::Map<const matrix, 0, Eigen::OuterStride<>>(x, rows, in, Eigen::OuterStride<>(x_stride)) *
                            cmap(w, out, in).transpose();
    }

    /// z (rows, out) += x (rows, in) · Wᵀ, W (out, in) row-major, z rows `z_stride` apart: the
    /// residual add done by the GEMM itself (no temporary); the Linear's bias is left to the caller
    /// (see layer_norm's `add`).
    static void linear_accumulate(const S* x, std::int64_t rows, std::int64_t in, const S* w, std::int64_t out, S* z,
                                  std::int64_t z_stride) {
        if constexpr (simd_linear)
            linear_simd(x, in, rows, in, w, out, z, z_stride);
        else
            Eigen::Map<matrix, 0, Eigen::OuterStride<>>(z, rows, out, Eigen::OuterStride<>(z_stride)).noalias() +=
                cmap(x, rows, in) * cmap(w, out, in).transpose();
    }

    /// LayerNorm over rows of length C (biased variance, two passes over a row held in L1):
    /// y_r = (x_r − mean) / sqrt(var + ε) · w + b. When `add` is not null, x_r += add is written back
    /// first (a residual Linear's pending bias), so the residual stream gets its bias in the same pass.
    /// x rows are `x_stride` apart (C for a packed matrix, L·C for the class tokens), y rows packed.
    void layer_norm(S* x, std::int64_t rows, std::int64_t x_stride, const S* add, const S* w, const S* b, S* y) const {
        // C = 64 (both digits models) gets fixed-size rows: the reductions unroll (3x faster there).
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

    void forward_chunk(const S* images, int b, S* logits, workspace& ws, vit_trace<S>* trace, vit_stage_times* times) const {
        const auto& c = cfg_;
        const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens, F = c.mlp_hidden_dim;
        const std::int64_t G = c.grid, P = c.patch_size, Cin = c.in_chans, S_img = c.img_size;
        const std::int64_t rows = b * L, patch_len = Cin * P * P;
        auto t0 = clock::now();
        ws.resize(c, b, trace != nullptr);
        auto at = [times](double vit_stage_times::*m) { return times ? &(times->*m) : nullptr; };

        // 1. Patch embedding as a GEMM per image: gather each patch (Cin, P, P) into a row, then
        //    z_i = token_init (class token + pos_embed, and pos_embed + conv bias on the patch rows);
        //    z_i[1:] += (G², Cin·P²) · W_peᵀ (W_pe viewed as (C, Cin·P²)).
        for (std::int64_t img = 0; img < b; ++img)
            for (std::int64_t r = 0; r < G; ++r)
                for (std::int64_t col = 0; col < G; ++col) {
                    S* row = ws.patches.data() + ((img * G + r) * G + col) * patch_len;
                    for (std::int64_t ch = 0; ch < Cin; ++ch)
                        for (std::int64_t ky = 0; ky < P; ++ky)
                            std::copy_n(images + ((img * Cin + ch) * S_img + P * r + ky) * S_img + P * col, P,
                                        row + (ch * P + ky) * P);
                }
        const cmap token_init(token_init_.data(), L, C);
        for (std::int64_t img = 0; img < b; ++img) {
            map zi(ws.z.data() + img * L * C, L, C);
            zi = token_init;
            linear_accumulate(ws.patches.data() + img * G * G * patch_len, G * G, patch_len, w_.patch_w, C, zi.data() + C, C);
        }
        if (trace) trace->tokens.insert(trace->tokens.end(), ws.z.begin(), ws.z.begin() + rows * C);
        lap(at(&vit_stage_times::patch_embed), t0);

        // 2. Blocks.
        const rpe::tensor_ref<const S> qkv_ref(ws.qkv.data(), {b, L, 3 * C});
        const rpe::tensor_ref<S> out_ref(ws.out.data(), {b, H, L, D}), attn_ref(ws.attn.data(), {b, H, L, L});
        const S* pending = nullptr;  // fc2 bias of the previous block, not yet added to z (C)
        for (int i = 0; i < c.depth; ++i) {
            const auto& w = w_.blocks[static_cast<std::size_t>(i)];
            // The head reads only the class tokens, so (unless traced, or configured not to) the last
            // block computes their queries and attention rows alone, and its projection, LN2 and MLP
            // run on those b rows (z rows L·C apart); otherwise on all b·L rows.
            const bool cls_only = !trace && c.last_block_class_token_only && i == c.depth - 1;
            // h = LN1(z + pending); qkv = h·W_qkvᵀ + b: (b·L, 3C), column t·C + n·D + d.
            layer_norm(ws.z.data(), rows, C, pending, w.norm1_w, w.norm1_b, ws.h.data());
            lap(at(&vit_stage_times::layer_norm), t0);
            if (cls_only) {  // k and v of every token; q of the class tokens (rows L apart) only
                linear_strided(ws.h.data(), C, rows, C, w.qkv_w + C * C, w.qkv_b ? w.qkv_b + C : nullptr, 2 * C,
                               ws.qkv.data() + C, 3 * C);
                linear_strided(ws.h.data(), L * C, b, C, w.qkv_w, w.qkv_b, C, ws.qkv.data(), L * 3 * C);
            } else {
                linear(ws.h.data(), rows, C, w.qkv_w, w.qkv_b, 3 * C, ws.qkv.data());
            }
            lap(at(&vit_stage_times::qkv), t0);
            // attention with iRPE / RoPE; fused: no (b, H, L, L) buffer unless the probabilities are traced
            attention(i, qkv_ref, out_ref, trace ? attn_ref : rpe::tensor_ref<S>{},
                      cls_only ? rpe::query_row_range{0, 1} : rpe::query_row_range{});
            if (trace)
                trace->attn[static_cast<std::size_t>(i)].insert(trace->attn[static_cast<std::size_t>(i)].end(), ws.attn.begin(),
                                                                ws.attn.begin() + b * H * L * L);
            lap(at(&vit_stage_times::attention), t0);
            const std::int64_t m = cls_only ? b : rows, zs = cls_only ? L * C : C, lm = cls_only ? 1 : L;
            // (b, H, L, D) → (m, C), heads concatenated: one pass, writing o in order
            for (std::int64_t img = 0; img < b; ++img)
                for (std::int64_t l = 0; l < lm; ++l) {
                    S* row = ws.o.data() + (img * lm + l) * C;
                    for (std::int64_t n = 0; n < H; ++n) std::copy_n(ws.out.data() + ((img * H + n) * L + l) * D, D, row + n * D);
                }
            lap(at(&vit_stage_times::repack), t0);
            // z += o·W_projᵀ; the bias b_proj is added by LN2's pass
            linear_accumulate(ws.o.data(), m, C, w.proj_w, C, ws.z.data(), zs);
            lap(at(&vit_stage_times::proj), t0);
            // h = LN2(z += b_proj)
            layer_norm(ws.z.data(), m, zs, w.proj_b, w.norm2_w, w.norm2_b, ws.h.data());
            lap(at(&vit_stage_times::layer_norm), t0);
            // f = GELU(h·W_fc1ᵀ + b_fc1)
            linear(ws.h.data(), m, C, w.fc1_w, w.fc1_b, F, ws.f.data());
            lap(at(&vit_stage_times::mlp), t0);
            // exact GELU 0.5·x·(1 + erf(x/√2)); Eigen's erf is vectorised for float (a rational
            // approximation within a few ulp of std::erf) and std::erf for double
            auto f = Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>>(ws.f.data(), m * F);
            f = S(0.5) * f * (S(1) + (f * static_cast<S>(0.70710678118654752440084436210484903928483593768847)).erf());
            lap(at(&vit_stage_times::gelu), t0);
            // z += f·W_fc2ᵀ; b_fc2 is added by the next LayerNorm's pass (or here when traced)
            linear_accumulate(ws.f.data(), m, F, w.fc2_w, C, ws.z.data(), zs);
            pending = w.fc2_b;
            lap(at(&vit_stage_times::mlp), t0);
            if (trace) {
                map(ws.z.data(), rows, C).rowwise() += crow_map(pending, C);
                pending = nullptr;
                trace->blocks[static_cast<std::size_t>(i)].insert(trace->blocks[static_cast<std::size_t>(i)].end(), ws.z.begin(),
                                                                  ws.z.begin() + rows * C);
            }
        }

        // 3. logits = head(LN(z_0 + pending)) for the class token of each image (rows L·C apart).
        if (c.num_classes > 0) {
            layer_norm(ws.z.data(), b, L * C, pending, w_.norm_w, w_.norm_b, ws.cls.data());
            linear(ws.cls.data(), b, C, w_.head_w, w_.head_b, c.num_classes, logits);
        }
        lap(at(&vit_stage_times::head), t0);
    }

    std::shared_ptr<const void> owner_;  // keeps the weights alive
    vit_config cfg_;
    vit_weights<S> w_;
    std::unique_ptr<rpe::any_term<S>> terms_[3];  // q, k, v (null when off)
    std::vector<std::int64_t> rpe_shape_[3];      // their table shapes
    std::vector<S> token_init_;                   // (L, C): class token and patch biases folded into pos_embed
    struct workspace_pool {
        std::mutex mutex;  // behind a pointer, so the model stays movable
        std::vector<std::unique_ptr<workspace>> free;
    };
    std::unique_ptr<workspace_pool> pool_ = std::make_unique<workspace_pool>();
    int chunk_ = 16;
};

/// @brief How make_random_vit draws the weights.
struct vit_random_init {
    unsigned seed = 0;      ///< std::mt19937_64 seed
    double std = 0.02;      ///< Linear weights, patch embedding, class token, pos_embed and biases: normal(0, std)
    double rpe_std = 0.02;  ///< iRPE tables: normal(0, rpe_std) (0: zero tables)
    float rope_theta = 10;  ///< rope::mixed: rope-vit's θ of init_mixed_frequencies (per-head angles uniform in [0, 2π))
};

/// @brief A model with random weights (no file, no download): LayerNorm weights 1 and biases 0,
/// everything else normal(0, init.std), iRPE tables normal(0, init.rpe_std), RoPE-Mixed
/// frequencies as rope-vit initialises them. The iRPE tables and RoPE frequencies come from a
/// second generator (seed + 1), so models of one seed that differ only in rpe_on or rope share
/// every other weight (a model with zero tables then computes what the model without iRPE does).
/// The model owns the weights (one buffer).
/// @throws what vit_config::derive and vit_model's constructor throw; rpe::invalid_argument
///   `[rpe.vit_model] ...` for a negative std.
template <class S = float>
[[nodiscard]] vit_model<S> make_random_vit(vit_config cfg, const vit_random_init& init = {}) {
    cfg.derive();
    rpe::detail::require(init.std >= 0 && init.rpe_std >= 0, "vit_model", "init std = ", init.std, ", rpe_std = ", init.rpe_std,
                         "; expected >= 0");
    const std::int64_t C = cfg.embed_dim, F = cfg.mlp_hidden_dim, L = cfg.tokens, H = cfg.num_heads, D = cfg.head_dim;
    const std::int64_t P = cfg.patch_size, K = cfg.rpe_num_buckets, N = cfg.num_classes;
    const bool mixed = std::holds_alternative<rpe::rope::mixed>(cfg.rope);
    // one table per target: (H or 1, D, K) contextual, (H or 1, K) bias; the term checks it again
    const std::int64_t table = (cfg.rpe.shared_head ? 1 : H) * (cfg.rpe.contextual ? D : 1) * K;
    const std::int64_t per_block = 4 * C + 3 * C * C + (cfg.qkv_bias ? 3 * C : 0) + C * C + C + F * C + F + C * F + C;
    const std::int64_t total = C * cfg.in_chans * P * P + C + C + L * C + 2 * C + N * C + N + cfg.depth * per_block;
    const std::int64_t extra = cfg.depth * (static_cast<std::int64_t>(cfg.rpe_on.size()) * table + (mixed ? 2 * H * (D / 2) : 0));
    auto storage = std::make_shared<std::vector<S>>(static_cast<std::size_t>(total + extra));
    S* next = storage->data();
    std::mt19937_64 rng(init.seed), rng_pos(static_cast<std::uint64_t>(init.seed) + 1);
    auto draw = [&next](std::int64_t n, std::mt19937_64& g, double std_dev) {
        std::normal_distribution<double> normal(0.0, std_dev > 0 ? std_dev : 1.0);
        S* p = next;
        for (std::int64_t i = 0; i < n; ++i) p[i] = std_dev > 0 ? static_cast<S>(normal(g)) : S(0);
        next += n;
        return static_cast<const S*>(p);
    };
    auto fill = [&next](std::int64_t n, S value) {
        S* p = next;
        std::fill_n(p, n, value);
        next += n;
        return static_cast<const S*>(p);
    };
    vit_weights<S> w;
    w.patch_w = draw(C * cfg.in_chans * P * P, rng, init.std);
    w.patch_b = draw(C, rng, init.std);
    w.cls_token = draw(C, rng, init.std);
    w.pos_embed = draw(L * C, rng, init.std);
    w.blocks.resize(static_cast<std::size_t>(cfg.depth));
    for (auto& b : w.blocks) {
        b.norm1_w = fill(C, S(1));
        b.norm1_b = fill(C, S(0));
        b.qkv_w = draw(3 * C * C, rng, init.std);
        if (cfg.qkv_bias) b.qkv_b = draw(3 * C, rng, init.std);
        b.proj_w = draw(C * C, rng, init.std);
        b.proj_b = draw(C, rng, init.std);
        b.norm2_w = fill(C, S(1));
        b.norm2_b = fill(C, S(0));
        b.fc1_w = draw(F * C, rng, init.std);
        b.fc1_b = draw(F, rng, init.std);
        b.fc2_w = draw(C * F, rng, init.std);
        b.fc2_b = draw(C, rng, init.std);
    }
    w.norm_w = fill(C, S(1));
    w.norm_b = fill(C, S(0));
    w.head_w = draw(N * C, rng, init.std);
    w.head_b = draw(N, rng, init.std);
    std::uniform_real_distribution<float> angle(0.0f, 6.283185307179586f);
    std::vector<float> angles(static_cast<std::size_t>(H)), freqs(static_cast<std::size_t>(2 * H * (D / 2)));
    for (auto& b : w.blocks) {
        for (int t = 0; t < 3; ++t)
            if (cfg.rpe_on.find("qkv"[t]) != std::string::npos) b.rpe_table[t] = draw(table, rng_pos, init.rpe_std);
        if (mixed) {
            for (auto& a : angles) a = angle(rng_pos);
            rpe::rope::init_mixed_frequencies(init.rope_theta, static_cast<int>(D), angles, freqs);
            S* p = next;
            std::copy(freqs.begin(), freqs.end(), p);
            next += static_cast<std::int64_t>(freqs.size());
            b.rope_freqs = p;
        }
    }
    return vit_model<S>(std::move(cfg), std::move(w), std::move(storage));
}

}  // namespace rpe::examples
