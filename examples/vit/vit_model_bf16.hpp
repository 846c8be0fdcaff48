/// @file vit_model_bf16.hpp
/// @brief vit_model's forward with bf16 storage of weights and activations and float accumulation,
/// the way a CPU bf16 inference engine runs a ViT (the whole-model benchmarks
/// `model/deit_s/{none,k,qkv}/bf16`, bench/bench_model.cpp; `examples/02_deit_s --bf16`).
///
/// What is bf16, what is float, and where values are rounded (docs/benchmarks.md, "Whole model"):
/// - Weights: every parameter is rounded to bf16 once, at set-up (as `model.to(torch.bfloat16)`).
///   The matrices of the patch embedding, qkv, projection, fc1, fc2 and head are kept in bf16,
///   packed for rpe::detail::cpu::bf16_linear (panels of Wᵀ, outside any timing); the iRPE tables
///   and RoPE frequencies in bf16 (rpe::attention_forward on rpe::bf16 takes them so); the short
///   vectors (biases, LayerNorm weights, class token, pos_embed) as float copies of their bf16
///   values (the same values, converted once instead of at every use).
/// - Matrix products: bf16 × bf16 with float accumulation (AMX tiles where the unit is built for
///   AMX-BF16 and the OS grants them, for layers whose inputs are a multiple of 32; else vdpbf16ps
///   on AVX512_BF16, else the portable kernel: rpe::detail::cpu::bf16_linear). Every operand of a product is bf16: the
///   image patches (rounded when gathered), LN1 / LN2 / final-LN outputs, q, k, v, the attention
///   output, the GELU output.
/// - Rounded to bf16 (each once, to nearest even): patches; LayerNorm outputs (computed in float
///   from the float residual stream); qkv (float accumulators + bias, rounded once: what the
///   attention reads); inside the fused attention what its bf16 path rounds (the probabilities
///   before P·v on AVX512_BF16; docs/attention.md "bf16 storage") and its output; the GELU output
///   (fc1's float accumulators + bias → exact-erf GELU in float → rounded once, in the GEMM's
///   epilogue while the tile is in cache: no float (rows, F) buffer, no rounding between fc1 and
///   GELU).
/// - Float: the residual stream z (the projection and fc2 accumulate onto it in float, and the
///   patch embedding onto the float class token + pos_embed), LayerNorm statistics, softmax and
///   the iRPE terms inside the attention, GELU, biases, the logits. This is what PyTorch's CPU
///   autocast to bf16 keeps in float too (LayerNorm in float; residual adds of float and bf16
///   promote to float), while its Linear layers round their outputs to bf16.
///
/// Compared with vit_model<float> on the same bf16-rounded weights (bf16_rounded_model) and
/// bf16-rounded images, the logits differ only by the activation roundings above (tests/unit/
/// test_vit_model.cpp; the set-up check of bench/bench_model.cpp).
#pragma once

#include "vit_model.hpp"  // rpe (and Eigen) first, see there

#include <rpe/backend/cpu/bf16_kernels.hpp>
#include <rpe/bf16.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace rpe::examples {

/// @brief A copy of `model` whose parameters are all rounded to bf16 (to nearest even) and held as
/// float: the float model that vit_model_bf16 computes in bf16, the reference of its checks.
/// @throws what vit_model's constructor throws (it does not for a model that was built).
[[nodiscard]] inline vit_model<float> bf16_rounded_model(const vit_model<float>& model) {
    const auto& c = model.config();
    const auto& w = model.weights();
    const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim, L = c.tokens, H = c.num_heads, D = c.head_dim;
    const std::int64_t P = c.patch_size, N = c.num_classes;
    auto storage = std::make_shared<std::vector<std::vector<float>>>();
    storage->reserve(static_cast<std::size_t>(8 + c.depth * 16));
    // a rounded copy of p[0, n) (null stays null); the inner vectors keep their buffers when moved
    auto keep = [&storage](const float* p, std::int64_t n) -> const float* {
        if (!p) return nullptr;
        auto& v = storage->emplace_back(static_cast<std::size_t>(n));
        for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = rpe::round_to_bf16(p[i]);
        return v.data();
    };
    std::int64_t table[3] = {0, 0, 0};
    for (const auto t : {rpe::target::query, rpe::target::key, rpe::target::value})
        if (const auto* term = model.rpe_term(t)) {
            std::int64_t n = 1;
            for (const auto e : term->table_shape()) n *= e;
            table[t == rpe::target::query ? 0 : (t == rpe::target::key ? 1 : 2)] = n;
        }
    vit_weights<float> r;
    r.patch_w = keep(w.patch_w, C * c.in_chans * P * P);
    r.patch_b = keep(w.patch_b, C);
    r.cls_token = keep(w.cls_token, C);
    r.pos_embed = keep(w.pos_embed, L * C);
    r.norm_w = keep(w.norm_w, C);
    r.norm_b = keep(w.norm_b, C);
    r.head_w = keep(w.head_w, N * C);
    r.head_b = keep(w.head_b, N);
    for (const auto& b : w.blocks) {
        auto& o = r.blocks.emplace_back();
        o.norm1_w = keep(b.norm1_w, C);
        o.norm1_b = keep(b.norm1_b, C);
        o.qkv_w = keep(b.qkv_w, 3 * C * C);
        o.qkv_b = keep(b.qkv_b, 3 * C);
        o.proj_w = keep(b.proj_w, C * C);
        o.proj_b = keep(b.proj_b, C);
        o.norm2_w = keep(b.norm2_w, C);
        o.norm2_b = keep(b.norm2_b, C);
        o.fc1_w = keep(b.fc1_w, F * C);
        o.fc1_b = keep(b.fc1_b, F);
        o.fc2_w = keep(b.fc2_w, C * F);
        o.fc2_b = keep(b.fc2_b, C);
        for (int t = 0; t < 3; ++t) o.rpe_table[t] = keep(b.rpe_table[t], table[t]);
        o.rope_freqs = keep(b.rope_freqs, 2 * H * (D / 2));
    }
    vit_model<float> out(c, std::move(r), storage);
    out.set_chunk_size(model.chunk_size());
    return out;
}

/// @brief The forward of a vit_model<float> in bf16 storage with float accumulation (see the file
/// comment for what is rounded where), on the model's parameters rounded to bf16.
///
/// Usage (the benchmark's DeiT-S):
/// @code
///   const auto model = rpe::examples::make_random_vit<float>(rpe::examples::deit_s_config("k"));
///   const rpe::examples::vit_model_bf16 bf(model);  // rounds and packs the weights once
///   bf.forward(rpe::tensor_ref<const float>(images, {n, 3, 224, 224}),
///              rpe::tensor_ref<float>(logits, {n, 1000}));
/// @endcode
/// Images and logits are float (the images are rounded to bf16 as their patches are gathered).
/// The batch runs in chunks of chunk_size() images, one after another, each with the parallelism
/// inside rpe's kernels (the bf16 Linear layers' tiles and the attention: OMP_NUM_THREADS);
/// forward() is const and may run concurrently (workspaces from a mutex-guarded pool, kept between
/// calls). The bf16 model keeps its own copy of everything (the float model may be destroyed).
class vit_model_bf16 {
public:
    /// @brief Rounds `model`'s parameters to bf16 and packs its matrices (bf16_rounded_model, then
    /// rpe::detail::cpu::bf16_pack_linear for each Linear).
    /// @throws what bf16_rounded_model throws.
    explicit vit_model_bf16(const vit_model<float>& model) : rounded_(bf16_rounded_model(model)), chunk_(model.chunk_size()) {
        build();
    }

    vit_model_bf16(vit_model_bf16&&) noexcept = default;
    vit_model_bf16& operator=(vit_model_bf16&&) noexcept = default;
    vit_model_bf16(const vit_model_bf16&) = delete;
    vit_model_bf16& operator=(const vit_model_bf16&) = delete;
    ~vit_model_bf16() = default;

    /// @brief The hyperparameters (derived).
    [[nodiscard]] const vit_config& config() const { return rounded_.config(); }
    /// @brief The float model on the same bf16-rounded parameters (its reference).
    [[nodiscard]] const vit_model<float>& rounded_float_model() const { return rounded_; }
    /// @brief Images per chunk of forward() (the float model's at construction).
    [[nodiscard]] int chunk_size() const { return chunk_; }
    /// @brief Sets the chunk size. @throws rpe::invalid_argument for n < 1.
    void set_chunk_size(int n) {
        rpe::detail::require(n >= 1, "vit_model", "chunk_size = ", n, "; expected >= 1");
        chunk_ = n;
    }
    /// @brief "AMX_BF16", "AVX512_BF16" or "portable": the path of this unit's bf16 products on this
    /// CPU now (AMX: the Linear layers whose inputs are a multiple of 32, and the attention; the
    /// others take vdpbf16ps).
    [[nodiscard]] static const char* isa() {
        namespace cpu = rpe::detail::cpu;
        if (cpu::hw_amx && cpu::bf16_amx_now()) return "AMX_BF16";
        return cpu::bf16_hw_now() ? "AVX512_BF16" : "portable";
    }

    /// @brief Batch forward: logits of every image (see vit_model::forward).
    /// @param images (N, Cin, S, S) float, rounded to bf16 as the patches are gathered.
    /// @param logits (N, num_classes) float, written.
    /// @param times  optional: the seconds of each stage are added to it (GELU runs inside the fc1
    ///   tiles and counts under mlp; gelu stays 0).
    /// @throws rpe::invalid_argument `[rpe.vit_model] ...` for a shape that does not match the
    ///   config or a null buffer; checked before anything is written.
    void forward(rpe::tensor_ref<const float> images, rpe::tensor_ref<float> logits, vit_stage_times* times = nullptr) const {
        const auto& c = config();
        const int s = c.img_size;
        rpe::detail::require(images.rank == 4 && images.extent(1) == c.in_chans && images.extent(2) == s && images.extent(3) == s,
                             "vit_model", "images have shape ", images.shape_string(), "; expected (N, ", c.in_chans, ", ", s,
                             ", ", s, ")");
        const std::int64_t n = images.extent(0);
        rpe::detail::require(logits.has_shape({n, c.num_classes}), "vit_model", "logits have shape ", logits.shape_string(),
                             "; expected (", n, ", ", c.num_classes, ")");
        rpe::detail::require(n == 0 || (images.data != nullptr && (logits.data != nullptr || c.num_classes == 0)), "vit_model",
                             "images or logits is null");
        const std::int64_t image_size = static_cast<std::int64_t>(c.in_chans) * s * s;
        auto ws = take_workspace();
        for (std::int64_t first = 0; first < n; first += chunk_) {
            const int b = static_cast<int>(std::min<std::int64_t>(chunk_, n - first));
            forward_chunk(images.data + first * image_size, b, logits.data + first * c.num_classes, *ws, times);
        }
        give_back(std::move(ws));
    }

    /// @brief Block `block`'s attention step exactly as forward() runs it: rpe::attention_forward on
    /// rpe::bf16 with the block's bf16 iRPE tables and RoPE frequencies, q, k, v read in place.
    /// @param qkv (B, L, 3C) bf16: the qkv Linear's output, column t·C + h·D + d (t = q, k, v).
    /// @param out (B, H, L, D) bf16, written.
    /// @param rows the query rows computed (rpe::attention_options::query_rows; the others of out
    ///   are not written): forward() passes {0, 1} in a last block pruned to the class token.
    /// @throws rpe::invalid_argument `[rpe.vit_model] ...` for a block outside [0, depth) or a qkv
    ///   of another shape; what rpe::attention_forward throws for out or rows.
    void attention(int block, rpe::tensor_ref<const rpe::bf16> qkv, rpe::tensor_ref<rpe::bf16> out,
                   rpe::query_row_range rows = {}) const {
        const auto& c = config();
        rpe::detail::require(block >= 0 && block < c.depth, "vit_model", "block = ", block, "; expected in [0, ", c.depth, ")");
        const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens;
        rpe::detail::require(qkv.rank == 3 && qkv.contiguous() && qkv.extent(1) == L && qkv.extent(2) == 3 * C, "vit_model",
                             "qkv has shape ", qkv.shape_string(), "; expected (B, ", L, ", ", 3 * C, "), contiguous");
        const std::int64_t b = qkv.extent(0);
        auto view = [&](std::int64_t t) {  // (b, H, L, D) strided views of the (b, L, 3, H, D) buffer
            return rpe::tensor_ref<const rpe::bf16>::with_strides(qkv.data + t * C, {b, H, L, D}, {L * 3 * C, D, 3 * C, 1});
        };
        const auto& w = blocks_[static_cast<std::size_t>(block)];
        rpe::attention_inputs<rpe::bf16> in;
        in.q = view(0);
        in.k = view(1);
        in.v = view(2);
        in.height = c.grid;
        in.width = c.grid;
        rpe::attention_term<rpe::bf16>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int t = 0; t < 3; ++t) {
            if (w.rpe_table[t].empty()) continue;
            slots[t]->term = terms_[t];
            slots[t]->tables = {
                rpe::tensor_ref<const rpe::bf16>(w.rpe_table[t].data(), std::span<const std::int64_t>(shapes_[t]))};
        }
        if (c.rope.index() != 0) {
            in.rope.form = c.rope;
            in.rope.skip = 1;
            if (std::holds_alternative<rpe::rope::mixed>(c.rope)) in.rope.freqs = {w.rope_freqs.data(), {2, H, D / 2}};
        }
        rpe::attention_forward(in, out, {}, rpe::attention_options{.query_rows = rows});
    }

private:
    using clock = std::chrono::steady_clock;
    using bf16 = rpe::bf16;
    using packed = rpe::detail::cpu::bf16_linear_weight;

    /// A block's bf16 parameters (the float ones are read from rounded_).
    struct block_weights {
        packed qkv, proj, fc1, fc2;
        std::vector<bf16> rpe_table[3];  // empty when the target is off
        std::vector<bf16> rope_freqs;    // (2, H, D/2) for rope::mixed, else empty
    };

    /// Scratch buffers of one chunk of b images: bf16 activations, the float residual stream z.
    struct workspace {
        std::vector<bf16> patches, h, qkv, out, o, f, cls;
        std::vector<float> z, row;
        void resize(const vit_config& c, int b) {
            const auto rows = static_cast<std::size_t>(b) * c.tokens;
            for (auto* buf : {&h, &o, &out}) buf->resize(rows * c.embed_dim);
            z.resize(rows * c.embed_dim);
            qkv.resize(rows * 3 * c.embed_dim);
            f.resize(rows * c.mlp_hidden_dim);
            patches.resize(static_cast<std::size_t>(b) * c.grid * c.grid * c.in_chans * c.patch_size * c.patch_size);
            cls.resize(static_cast<std::size_t>(b) * c.embed_dim);
            row.resize(static_cast<std::size_t>(std::max(c.embed_dim, c.patch_size)));
        }
    };

    static std::vector<bf16> to_bf16(const float* p, std::int64_t n) {
        std::vector<bf16> v(static_cast<std::size_t>(p ? n : 0));
        if (p) rpe::detail::cpu::float_to_bf16(p, v.data(), n);
        return v;
    }
    static packed pack(const float* w, std::int64_t out, std::int64_t in) {
        const auto b = to_bf16(w, out * in);
        return rpe::detail::cpu::bf16_pack_linear(b.data(), in, out, in);
    }

    void build() {
        const auto& c = config();
        const auto& w = rounded_.weights();
        const std::int64_t C = c.embed_dim, F = c.mlp_hidden_dim, L = c.tokens, H = c.num_heads, D = c.head_dim;
        for (const auto t : {rpe::target::query, rpe::target::key, rpe::target::value}) {
            const int s = t == rpe::target::query ? 0 : (t == rpe::target::key ? 1 : 2);
            terms_[s] = rounded_.rpe_term(t);
            if (terms_[s]) shapes_[s] = terms_[s]->table_shape();
        }
        std::int64_t table[3] = {0, 0, 0};
        for (int t = 0; t < 3; ++t) {
            table[t] = terms_[t] ? 1 : 0;
            for (const auto e : shapes_[t]) table[t] *= e;
        }
        patch_w_ = pack(w.patch_w, C, static_cast<std::int64_t>(c.in_chans) * c.patch_size * c.patch_size);
        if (c.num_classes > 0) head_w_ = pack(w.head_w, c.num_classes, C);
        for (const auto& b : w.blocks) {
            auto& o = blocks_.emplace_back();
            o.qkv = pack(b.qkv_w, 3 * C, C);
            o.proj = pack(b.proj_w, C, C);
            o.fc1 = pack(b.fc1_w, F, C);
            o.fc2 = pack(b.fc2_w, C, F);
            for (int t = 0; t < 3; ++t) o.rpe_table[t] = to_bf16(b.rpe_table[t], table[t]);
            o.rope_freqs = to_bf16(b.rope_freqs, 2 * H * (D / 2));
        }
        // (L, C) what every image's tokens start from (as vit_model): class token + pos_embed[0],
        // then pos_embed[p] + the patch conv's bias; float, from the bf16-rounded parameters
        token_init_.assign(w.pos_embed, w.pos_embed + L * C);
        for (std::int64_t j = 0; j < C; ++j) token_init_[static_cast<std::size_t>(j)] += w.cls_token[j];
        for (std::int64_t l = 1; l < L; ++l)
            for (std::int64_t j = 0; j < C; ++j) token_init_[static_cast<std::size_t>(l * C + j)] += w.patch_b[j];
    }

    std::unique_ptr<workspace> take_workspace() const {
        const std::lock_guard lock(pool_->mutex);
        if (pool_->free.empty()) return std::make_unique<workspace>();
        auto ws = std::move(pool_->free.back());
        pool_->free.pop_back();
        return ws;
    }
    void give_back(std::unique_ptr<workspace> ws) const {
        const std::lock_guard lock(pool_->mutex);
        pool_->free.push_back(std::move(ws));
    }

    static void lap(double* slot, clock::time_point& t0) {
        if (!slot) return;
        const auto t1 = clock::now();
        *slot += std::chrono::duration<double>(t1 - t0).count();
        t0 = t1;
    }

    /// LayerNorm in float over rows of the float stream x (rows `x_stride` apart; x_r += add first
    /// and written back when `add` is not null, as vit_model::layer_norm), each output row rounded
    /// once to bf16 into y (rows packed, C long). `row`: C floats of scratch.
    void layer_norm(float* x, std::int64_t rows, std::int64_t x_stride, const float* add, const float* w, const float* b, bf16* y,
                    float* row) const {
        using row_array = Eigen::Array<float, 1, Eigen::Dynamic>;
        const std::int64_t c = config().embed_dim;
        const float eps = static_cast<float>(config().layer_norm_eps), inv_c = 1.0f / static_cast<float>(c);
        const Eigen::Map<const row_array> wa(w, c), ba(b, c);
        Eigen::Map<row_array> out(row, c);
        for (std::int64_t r = 0; r < rows; ++r) {
            Eigen::Map<row_array> xr(x + r * x_stride, c);
            if (add) xr += Eigen::Map<const row_array>(add, c);
            const float mean = xr.sum() * inv_c;
            const float var = (xr - mean).square().sum() * inv_c;
            const float inv = 1.0f / std::sqrt(var + eps);
            out = (xr - mean) * inv * wa + ba;
            rpe::detail::cpu::float_to_bf16(row, y + r * c, c);
        }
    }

    void forward_chunk(const float* images, int b, float* logits, workspace& ws, vit_stage_times* times) const {
        namespace cpu = rpe::detail::cpu;
        const auto& c = config();
        const auto& fw = rounded_.weights();
        const std::int64_t C = c.embed_dim, H = c.num_heads, D = c.head_dim, L = c.tokens, F = c.mlp_hidden_dim;
        const std::int64_t G = c.grid, P = c.patch_size, Cin = c.in_chans, S_img = c.img_size;
        const std::int64_t rows = b * L, patch_len = Cin * P * P;
        auto t0 = clock::now();
        ws.resize(c, b);
        auto at = [times](double vit_stage_times::*m) { return times ? &(times->*m) : nullptr; };

        // 1. Patch embedding: patches gathered and rounded to bf16 (G², Cin·P²) per image; z_i =
        //    token_init (float), z_i[1:] += patches · W_peᵀ (bf16 GEMM accumulated in float).
        for (std::int64_t img = 0; img < b; ++img)
            for (std::int64_t r = 0; r < G; ++r)
                for (std::int64_t col = 0; col < G; ++col) {
                    bf16* row = ws.patches.data() + ((img * G + r) * G + col) * patch_len;
                    for (std::int64_t ch = 0; ch < Cin; ++ch)
                        for (std::int64_t ky = 0; ky < P; ++ky)
                            cpu::float_to_bf16(images + ((img * Cin + ch) * S_img + P * r + ky) * S_img + P * col,
                                               row + (ch * P + ky) * P, P);
                }
        for (std::int64_t img = 0; img < b; ++img) {
            float* zi = ws.z.data() + img * L * C;
            std::copy(token_init_.begin(), token_init_.end(), zi);
            cpu::bf16_linear(G * G, ws.patches.data() + img * G * G * patch_len, patch_len, patch_w_, zi + C, C, true);
        }
        lap(at(&vit_stage_times::patch_embed), t0);

        // 2. Blocks.
        const rpe::tensor_ref<const bf16> qkv_ref(ws.qkv.data(), {b, L, 3 * C});
        const rpe::tensor_ref<bf16> out_ref(ws.out.data(), {b, H, L, D});
        const float* pending = nullptr;  // fc2 bias of the previous block, not yet added to z (C)
        for (int i = 0; i < c.depth; ++i) {
            const auto& w = blocks_[static_cast<std::size_t>(i)];
            const auto& fb = fw.blocks[static_cast<std::size_t>(i)];
            // h = bf16(LN1(z + pending))
            layer_norm(ws.z.data(), rows, C, pending, fb.norm1_w, fb.norm1_b, ws.h.data(), ws.row.data());
            lap(at(&vit_stage_times::layer_norm), t0);
            // qkv = bf16(h·W_qkvᵀ + b): (b·L, 3C), column t·C + n·D + d
            bf16* qkv = ws.qkv.data();
            const float* qkv_b = fb.qkv_b;
            cpu::bf16_linear_tiles(
                rows, ws.h.data(), C, w.qkv, nullptr, 0, false,
                [qkv, qkv_b, C](std::int64_t i0, std::int64_t m, std::int64_t j0, std::int64_t n, float* t, std::int64_t ldt) {
                    for (std::int64_t r = 0; r < m; ++r) {
                        float* tr = t + r * ldt;
                        if (qkv_b)
                            for (std::int64_t j = 0; j < n; ++j) tr[j] += qkv_b[j0 + j];
                        cpu::float_to_bf16(tr, qkv + (i0 + r) * 3 * C + j0, n);
                    }
                });
            lap(at(&vit_stage_times::qkv), t0);
            const bool cls_only = c.last_block_class_token_only && i == c.depth - 1;
            attention(i, qkv_ref, out_ref, cls_only ? rpe::query_row_range{0, 1} : rpe::query_row_range{});
            lap(at(&vit_stage_times::attention), t0);
            const std::int64_t m = cls_only ? b : rows, zs = cls_only ? L * C : C, lm = cls_only ? 1 : L;
            // (b, H, L, D) → (m, C) bf16, heads concatenated
            for (std::int64_t img = 0; img < b; ++img)
                for (std::int64_t l = 0; l < lm; ++l) {
                    bf16* row = ws.o.data() + (img * lm + l) * C;
                    for (std::int64_t n = 0; n < H; ++n) std::copy_n(ws.out.data() + ((img * H + n) * L + l) * D, D, row + n * D);
                }
            lap(at(&vit_stage_times::repack), t0);
            // z += o·W_projᵀ (float); b_proj is added by LN2's pass
            cpu::bf16_linear(m, ws.o.data(), C, w.proj, ws.z.data(), zs, true);
            lap(at(&vit_stage_times::proj), t0);
            // h = bf16(LN2(z += b_proj))
            layer_norm(ws.z.data(), m, zs, fb.proj_b, fb.norm2_w, fb.norm2_b, ws.h.data(), ws.row.data());
            lap(at(&vit_stage_times::layer_norm), t0);
            // f = bf16(GELU(h·W_fc1ᵀ + b_fc1)), exact-erf GELU in float on each tile (Eigen's
            // vectorised erf, as vit_model<float>)
            bf16* f = ws.f.data();
            const float* fc1_b = fb.fc1_b;
            cpu::bf16_linear_tiles(
                m, ws.h.data(), C, w.fc1, nullptr, 0, false,
                [f, fc1_b, F](std::int64_t i0, std::int64_t rm, std::int64_t j0, std::int64_t n, float* t, std::int64_t ldt) {
                    using array = Eigen::Array<float, Eigen::Dynamic, 1>;
                    const Eigen::Map<const array> bias(fc1_b + j0, n);
                    for (std::int64_t r = 0; r < rm; ++r) {
                        Eigen::Map<array> x(t + r * ldt, n);
                        x += bias;
                        x = 0.5f * x * (1.0f + (x * 0.70710678118654752440f).erf());
                        cpu::float_to_bf16(x.data(), f + (i0 + r) * F + j0, n);
                    }
                });
            // z += f·W_fc2ᵀ (float); b_fc2 is added by the next LayerNorm's pass
            cpu::bf16_linear(m, ws.f.data(), F, w.fc2, ws.z.data(), zs, true);
            pending = fb.fc2_b;
            lap(at(&vit_stage_times::mlp), t0);
        }

        // 3. logits = head_b + bf16(LN(z_0 + pending)) · W_headᵀ for the class token of each image.
        if (c.num_classes > 0) {
            layer_norm(ws.z.data(), b, L * C, pending, fw.norm_w, fw.norm_b, ws.cls.data(), ws.row.data());
            for (int img = 0; img < b; ++img) std::copy_n(fw.head_b, c.num_classes, logits + img * c.num_classes);
            cpu::bf16_linear(b, ws.cls.data(), C, head_w_, logits, c.num_classes, true);
        }
        lap(at(&vit_stage_times::head), t0);
    }

    vit_model<float> rounded_;             // the parameters, rounded to bf16 (the float ones are read here)
    const rpe::term_desc* terms_[3] = {};  // q, k, v (rounded_'s terms; null when off)
    std::vector<std::int64_t> shapes_[3];  // their table shapes
    packed patch_w_, head_w_;              // (C, Cin·P²), (num_classes, C)
    std::vector<block_weights> blocks_;    // [depth]
    std::vector<float> token_init_;        // (L, C)
    struct workspace_pool {
        std::mutex mutex;
        std::vector<std::unique_ptr<workspace>> free;
    };
    std::unique_ptr<workspace_pool> pool_ = std::make_unique<workspace_pool>();
    int chunk_ = 16;
};

}  // namespace rpe::examples
