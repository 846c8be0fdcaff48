// A DETR encoder layer with iRPE (microsoft/Cream, iRPE/DETR-with-iRPE, models/transformer.py
// TransformerEncoderLayer, post-norm, eval mode: no dropout) in plain C++ around rpe's fused
// attention, and the three ways to hand it a batch of images of different sizes:
//
//   padded_batch::make  every image at the top-left of the batch's largest grid, the rest padding
//                       (DETR's NestedTensor): one call on the padded grid with key_padding_mask
//                       (the reference's way), optionally with key_lengths (fewer keys computed);
//   packed_batch::make  the images' tokens one after another in one sequence
//                       (attention_inputs::packed: lengths and grids), no padding at all;
//   one call per image  (the check of both).
//
// The layer: q = k = src + pos, v = src; in-projection (3C, C); multi-head attention with iRPE
// (contextual Product on the attached targets, as --enc_rpe2d rpe-{ratio}-product-ctx-{shared}-{on},
// skip 0); out-projection; x = LayerNorm1(src + attn); out = LayerNorm2(x + W2 relu(W1 x)).
// Used by examples/03_detr/main.cpp and tests/unit/test_detr_irpe.cpp (the reference's golden data).
#pragma once

#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rpe::examples::detr {

/// @brief The layer's sizes and its iRPE configuration, as the reference's `--enc_rpe2d
/// rpe-{ratio}-product-ctx-{shared_head}-{rpe_on}` (method product, mode contextual, skip 0: DETR's
/// encoder has no class token). The reference's published models are all `rpe-{1.9,2.0}-product-ctx-1-k`.
struct layer_config {
    int d_model = 256;           ///< C
    int nhead = 8;               ///< H (head_dim D = C / H)
    int dim_feedforward = 2048;  ///< F of the FFN
    double ratio = 2.0;          ///< α = r, β = 2r, γ = 8r (2.0: 9 × 9 = 81 buckets)
    bool shared_head = true;     ///< one table for all heads
    std::string rpe_on = "k";    ///< targets: letters of "qkv"
};

/// @brief The layer's parameters, row-major, named as the reference's state dict (without the
/// `self_attn.` prefix; `rpe_X_table` is `self_attn.rpe_X.lookup_table_weight`).
struct layer_weights {
    std::vector<float> in_proj_weight, in_proj_bias;    ///< (3C, C), (3C): rows q, k, v
    std::vector<float> out_proj_weight, out_proj_bias;  ///< (C, C), (C)
    std::vector<float> linear1_weight, linear1_bias;    ///< (F, C), (F)
    std::vector<float> linear2_weight, linear2_bias;    ///< (C, F), (C)
    std::vector<float> norm1_weight, norm1_bias;        ///< (C), (C)
    std::vector<float> norm2_weight, norm2_bias;        ///< (C), (C)
    /// Per target q, k, v: (Ht, D, K) for q and k, (Ht, K, D) for v; empty when not attached.
    std::array<std::vector<float>, 3> rpe_table;
};

/// @brief How the tokens of a call are laid out: one grid for every batch element (`height`,
/// `width`; padded batches and single images), with optional key padding, or packed images.
/// Exactly the fields of rpe::attention_inputs that say where tokens are (see docs/positions.md).
struct token_layout {
    int height = 0, width = 0;                                  ///< the grid (0, 0 with packed)
    rpe::tensor_ref<const std::uint8_t> key_padding_mask = {};  ///< (B, L) nonzero = padded key, or empty
    rpe::tensor_ref<const std::int32_t> key_lengths = {};       ///< (B,) keys at index ≥ length skipped, or empty
    rpe::packed_sequences packed = {};                          ///< several images in one sequence, or none
};

/// @brief One DETR encoder layer with iRPE, forward only (float).
///
/// Thread-safety: forward() is const and may run concurrently.
class encoder_layer {
public:
    /// @throws rpe::invalid_argument `[rpe.detr_layer] ...` for sizes that do not divide, an
    ///   rpe_on with other letters than q, k, v, or weights of the wrong sizes.
    encoder_layer(layer_config c, layer_weights w) : c_(std::move(c)), w_(std::move(w)) {
        using rpe::detail::require;
        require(c_.d_model > 0 && c_.nhead > 0 && c_.d_model % c_.nhead == 0 && c_.dim_feedforward > 0, "detr_layer",
                "d_model = ", c_.d_model, ", nhead = ", c_.nhead, ", dim_feedforward = ", c_.dim_feedforward,
                "; expected positive sizes with nhead dividing d_model");
        const auto C = static_cast<std::size_t>(c_.d_model), F = static_cast<std::size_t>(c_.dim_feedforward);
        auto need = [](const std::vector<float>& v, std::size_t n, const char* name) {
            require(v.size() == n, "detr_layer", "weight ", name, " has ", v.size(), " elements; expected ", n);
        };
        need(w_.in_proj_weight, 3 * C * C, "in_proj_weight");
        need(w_.in_proj_bias, 3 * C, "in_proj_bias");
        need(w_.out_proj_weight, C * C, "out_proj_weight");
        need(w_.out_proj_bias, C, "out_proj_bias");
        need(w_.linear1_weight, F * C, "linear1_weight");
        need(w_.linear1_bias, F, "linear1_bias");
        need(w_.linear2_weight, C * F, "linear2_weight");
        need(w_.linear2_bias, C, "linear2_bias");
        for (const auto* v : {&w_.norm1_weight, &w_.norm1_bias, &w_.norm2_weight, &w_.norm2_bias}) need(*v, C, "norm*");
        for (const char t : c_.rpe_on) {
            require(t == 'q' || t == 'k' || t == 'v', "detr_layer", "rpe_on = '", c_.rpe_on, "'; expected letters of \"qkv\"");
            rpe::term_spec spec;
            spec.method = rpe::method::product;
            spec.contextual = true;
            spec.target = rpe::parse_target(std::string_view(&t, 1));
            spec.ratio(c_.ratio);
            spec.shared_head = c_.shared_head;
            spec.skip = 0;
            spec.num_heads = c_.nhead;
            spec.head_dim = c_.d_model / c_.nhead;
            const int s = slot(t);
            terms_[s] = rpe::make_term<float>(spec);
            shapes_[s] = terms_[s]->table_shape();
            std::size_t n = 1;
            for (const auto e : shapes_[s]) n *= static_cast<std::size_t>(e);
            need(w_.rpe_table[static_cast<std::size_t>(s)], n, "rpe_table");
        }
    }

    /// @brief A layer with random weights (seeded): weights N(0, 1/fan_in), biases N(0, 0.01),
    /// LayerNorm weights 1 + N(0, 0.01), iRPE tables N(0, 0.25).
    static encoder_layer random(const layer_config& c, std::uint32_t seed) {
        std::mt19937 rng(seed);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        auto fill = [&](std::size_t n, float scale, float shift = 0.0f) {
            std::vector<float> v(n);
            for (auto& e : v) e = shift + scale * normal(rng);
            return v;
        };
        const auto C = static_cast<std::size_t>(c.d_model), F = static_cast<std::size_t>(c.dim_feedforward);
        const float sc = 1.0f / std::sqrt(static_cast<float>(C)), sf = 1.0f / std::sqrt(static_cast<float>(F));
        layer_weights w;
        w.in_proj_weight = fill(3 * C * C, sc);
        w.in_proj_bias = fill(3 * C, 0.1f);
        w.out_proj_weight = fill(C * C, sc);
        w.out_proj_bias = fill(C, 0.1f);
        w.linear1_weight = fill(F * C, sc);
        w.linear1_bias = fill(F, 0.1f);
        w.linear2_weight = fill(C * F, sf);
        w.linear2_bias = fill(C, 0.1f);
        w.norm1_weight = fill(C, 0.1f, 1.0f);
        w.norm1_bias = fill(C, 0.1f);
        w.norm2_weight = fill(C, 0.1f, 1.0f);
        w.norm2_bias = fill(C, 0.1f);
        // one product table size per target: (Ht, D, K) or (Ht, K, D), K = (2·int(2r) + 1)²
        const auto k = 2 * static_cast<std::size_t>(2.0 * c.ratio) + 1;
        const auto ht = c.shared_head ? std::size_t{1} : static_cast<std::size_t>(c.nhead);
        for (const char t : c.rpe_on)
            if (t == 'q' || t == 'k' || t == 'v')
                w.rpe_table[static_cast<std::size_t>(slot(t))] = fill(ht * (C / static_cast<std::size_t>(c.nhead)) * k * k, 0.5f);
        return {c, std::move(w)};
    }

    [[nodiscard]] const layer_config& config() const { return c_; }
    /// @brief The term attached to target t ('q', 'k', 'v'), or null.
    [[nodiscard]] const rpe::any_term<float>* term(char t) const { return terms_[slot(t)].get(); }

    /// @brief The layer's forward: `attn_out = out_proj(attention(src + pos, src + pos, src))`,
    /// `out = norm2(x + linear2(relu(linear1(x))))` with `x = norm1(src + attn_out)`.
    /// @param src, pos  (B, L, C) contiguous: the tokens and their absolute position embedding.
    /// @param layout    where the tokens are (grid, key padding, or packed images).
    /// @param attn_out  (B, L, C), written: the self-attention's output (the reference's `src2`).
    /// @param out       (B, L, C), written: the layer's output; or empty to stop after attn_out.
    /// @throws rpe::invalid_argument `[rpe.detr_layer] ...` for other shapes, and what
    ///   rpe::attention_forward throws for the layout (`[rpe.attention] ...`).
    void forward(rpe::tensor_ref<const float> src, rpe::tensor_ref<const float> pos, const token_layout& layout,
                 rpe::tensor_ref<float> attn_out, rpe::tensor_ref<float> out = {}) const {
        using rpe::detail::require;
        const std::int64_t C = c_.d_model, H = c_.nhead, D = C / H;
        require(src.rank == 3 && src.contiguous() && src.extent(2) == C, "detr_layer", "src has shape ", src.shape_string(),
                "; expected (B, L, ", C, "), contiguous");
        const std::int64_t B = src.extent(0), L = src.extent(1);
        auto same = [&](auto t, const char* name) {
            require(t.rank == 3 && t.contiguous() && t.extent(0) == B && t.extent(1) == L && t.extent(2) == C, "detr_layer", name,
                    " has shape ", t.shape_string(), "; expected ", src.shape_string(), " as src, contiguous");
        };
        same(pos, "pos");
        same(attn_out, "attn_out");
        if (out.data != nullptr) same(out, "out");
        const auto n = static_cast<std::size_t>(B * L);
        const auto uc = static_cast<std::size_t>(C);

        // q, k, v = (src + pos, src + pos, src) · W_inᵀ + b_in, as (B, L, 3, H, D)
        std::vector<float> qk_in(n * uc), qkv(n * 3 * uc);
        for (std::size_t i = 0; i < n * uc; ++i) qk_in[i] = src.data[i] + pos.data[i];
        linear(qk_in.data(), n, uc, w_.in_proj_weight.data(), w_.in_proj_bias.data(), 2 * uc, qkv.data(), 3 * uc);
        linear(src.data, n, uc, w_.in_proj_weight.data() + 2 * uc * uc, w_.in_proj_bias.data() + 2 * uc, uc, qkv.data() + 2 * uc,
               3 * uc);

        // the attention on (B, H, L, D) views read in place; the library scales q by D^-1/2
        auto view = [&](std::int64_t t) {
            return rpe::tensor_ref<const float>::with_strides(qkv.data() + t * C, {B, H, L, D}, {L * 3 * C, D, 3 * C, 1});
        };
        rpe::attention_inputs<float> in;
        in.q = view(0);
        in.k = view(1);
        in.v = view(2);
        in.height = layout.height;
        in.width = layout.width;
        in.key_padding_mask = layout.key_padding_mask;
        in.key_lengths = layout.key_lengths;
        in.packed = layout.packed;
        rpe::attention_term<float>* slots[3] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (std::size_t t = 0; t < 3; ++t) {
            if (!terms_[t]) continue;
            slots[t]->term = terms_[t].get();
            slots[t]->tables = {rpe::tensor_ref<const float>(w_.rpe_table[t].data(), std::span<const std::int64_t>(shapes_[t]))};
        }
        std::vector<float> heads(n * uc);  // (B, H, L, D)
        rpe::attention_forward(in, rpe::tensor_ref<float>(heads.data(), {B, H, L, D}));

        // merge the heads to (B, L, C) (channel h·D + d) and project
        std::vector<float> merged(n * uc);
        for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t h = 0; h < H; ++h)
                for (std::int64_t l = 0; l < L; ++l)
                    std::copy_n(heads.data() + ((b * H + h) * L + l) * D, D, merged.data() + (b * L + l) * C + h * D);
        linear(merged.data(), n, uc, w_.out_proj_weight.data(), w_.out_proj_bias.data(), uc, attn_out.data, uc);
        if (out.data == nullptr) return;

        // x = norm1(src + attn_out); out = norm2(x + linear2(relu(linear1(x))))
        const auto F = static_cast<std::size_t>(c_.dim_feedforward);
        std::vector<float> x(n * uc), f(n * F), y(n * uc);
        for (std::size_t i = 0; i < n * uc; ++i) x[i] = src.data[i] + attn_out.data[i];
        layer_norm(x.data(), n, uc, w_.norm1_weight.data(), w_.norm1_bias.data());
        linear(x.data(), n, uc, w_.linear1_weight.data(), w_.linear1_bias.data(), F, f.data(), F);
        for (auto& e : f) e = std::max(e, 0.0f);
        linear(f.data(), n, F, w_.linear2_weight.data(), w_.linear2_bias.data(), uc, y.data(), uc);
        for (std::size_t i = 0; i < n * uc; ++i) out.data[i] = x[i] + y[i];
        layer_norm(out.data, n, uc, w_.norm2_weight.data(), w_.norm2_bias.data());
    }

private:
    static int slot(char t) { return t == 'q' ? 0 : (t == 'k' ? 1 : 2); }

    /// y[i, o] = b[o] + Σ_c x[i, c]·w[o, c] for n rows; x rows of `in`, y rows `y_stride` apart.
    static void linear(const float* x, std::size_t n, std::size_t in, const float* w, const float* b, std::size_t outs, float* y,
                       std::size_t y_stride) {
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t o = 0; o < outs; ++o) {
                float s = 0;
                for (std::size_t c = 0; c < in; ++c) s += x[i * in + c] * w[o * in + c];
                y[i * y_stride + o] = s + b[o];
            }
    }

    /// LayerNorm over the last axis in place (eps 1e-5, biased variance, as torch.nn.LayerNorm).
    static void layer_norm(float* x, std::size_t n, std::size_t c, const float* g, const float* b) {
        for (std::size_t i = 0; i < n; ++i) {
            float* r = x + i * c;
            double mean = 0, var = 0;
            for (std::size_t j = 0; j < c; ++j) mean += r[j];
            mean /= static_cast<double>(c);
            for (std::size_t j = 0; j < c; ++j) var += (r[j] - mean) * (r[j] - mean);
            const double inv = 1.0 / std::sqrt(var / static_cast<double>(c) + 1e-5);
            for (std::size_t j = 0; j < c; ++j) r[j] = static_cast<float>((r[j] - mean) * inv) * g[j] + b[j];
        }
    }

    layer_config c_;
    layer_weights w_;
    std::array<std::unique_ptr<rpe::any_term<float>>, 3> terms_;
    std::array<std::vector<std::int64_t>, 3> shapes_;
};

/// @brief One image's tokens: a height × width grid in row-major order, (height·width, C) each
/// for the features and the position embedding.
struct image {
    int height = 0, width = 0;
    std::vector<float> src = {}, pos = {};  ///< (height·width, C)
};

/// @brief Images padded at the bottom and right to the batch's largest height and width (DETR's
/// NestedTensor): one grid for the whole batch, with the key padding mask of the padded tokens and
/// each image's key length.
struct padded_batch {
    int height = 0, width = 0;              ///< the padded grid: the largest height and width
    std::int64_t batch = 0, tokens = 0;     ///< B, L = height·width
    std::vector<float> src, pos;            ///< (B, L, C), zeros at padded tokens
    std::vector<std::uint8_t> mask;         ///< (B, L) 1 = padded token
    std::vector<std::int32_t> key_lengths;  ///< (B,) index of the image's last valid token + 1
    std::vector<std::int32_t> valid_count;  ///< (B,) height_b·width_b

    /// @brief Pads `images` (C channels each) to one grid.
    static padded_batch make(const std::vector<image>& images, int channels) {
        padded_batch p;
        for (const auto& im : images) {
            p.height = std::max(p.height, im.height);
            p.width = std::max(p.width, im.width);
        }
        p.batch = static_cast<std::int64_t>(images.size());
        p.tokens = static_cast<std::int64_t>(p.height) * p.width;
        const auto C = static_cast<std::size_t>(channels), L = static_cast<std::size_t>(p.tokens);
        p.src.assign(images.size() * L * C, 0.0f);
        p.pos.assign(p.src.size(), 0.0f);
        p.mask.assign(images.size() * L, 1);
        for (std::size_t b = 0; b < images.size(); ++b) {
            const auto& im = images[b];
            for (int r = 0; r < im.height; ++r)
                for (int c = 0; c < im.width; ++c) {
                    const auto from = static_cast<std::size_t>(r * im.width + c), to = static_cast<std::size_t>(r * p.width + c);
                    std::copy_n(im.src.data() + from * C, C, p.src.data() + (b * L + to) * C);
                    std::copy_n(im.pos.data() + from * C, C, p.pos.data() + (b * L + to) * C);
                    p.mask[b * L + to] = 0;
                }
            // the valid keys are not a prefix unless the image is as wide as the grid: the lengths
            // cut the trailing padded rows, the mask marks the padded columns before them
            p.key_lengths.push_back((im.height - 1) * p.width + im.width);
            p.valid_count.push_back(im.height * im.width);
        }
        return p;
    }

    /// @brief The index in the padded sequence of grid token (r, c) of any image.
    [[nodiscard]] std::int64_t token(int r, int c) const { return static_cast<std::int64_t>(r) * width + c; }
};

/// @brief The images' tokens one after another in one sequence (B = 1), with the lengths and
/// grids that rpe::attention_inputs::packed takes: nothing padded, each image attended alone.
struct packed_batch {
    std::int64_t tokens = 0;            ///< L = Σ height_m·width_m
    std::vector<float> src, pos;        ///< (1, L, C)
    std::vector<std::int32_t> lengths;  ///< (M,) tokens per image
    std::vector<std::int32_t> grids;    ///< (M, 2) (height, width)
    std::vector<std::int64_t> offsets;  ///< (M,) first token of each image

    /// @brief Packs `images` (C channels each).
    static packed_batch make(const std::vector<image>& images) {
        packed_batch p;
        for (const auto& im : images) {
            p.offsets.push_back(p.tokens);
            p.lengths.push_back(im.height * im.width);
            p.grids.push_back(im.height);
            p.grids.push_back(im.width);
            p.tokens += im.height * im.width;
            p.src.insert(p.src.end(), im.src.begin(), im.src.end());
            p.pos.insert(p.pos.end(), im.pos.begin(), im.pos.end());
        }
        return p;
    }

    /// @brief The layout for encoder_layer::forward (views into this object).
    [[nodiscard]] token_layout layout() const {
        token_layout t;
        const auto m = static_cast<std::int64_t>(lengths.size());
        t.packed.lengths = {lengths.data(), {m}};
        t.packed.grids = {grids.data(), {m, 2}};
        return t;
    }
};

}  // namespace rpe::examples::detr
