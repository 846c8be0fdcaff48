/// @file attention_inputs.hpp
/// @brief The backend-free front of the attention step: its inputs (rpe::attention_term,
/// rpe::attention_inputs), options (rpe::attention_options: softmax scale, row block, id
/// storage, CUDA stream), backward arguments (rpe::attention_gradients, saved probabilities by
/// name), each backend's capability trait (rpe::attention_capabilities) and every check. The
/// composed baseline, the CPU attention (rpe::cpu::attention_forward) and the CUDA attention
/// (rpe::cuda::attention_forward) all call it, so a bad input gets the same exception from each.
/// No Eigen, no CUDA.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "bucket_ids.hpp"
#include "bucket_key.hpp"
#include "build_bucket_ids.hpp"
#include "detail/check.hpp"
#include "detail/term_checks.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "mode.hpp"
#include "rope/rotary.hpp"
#include "tensor.hpp"
#include "term_desc.hpp"

// The CUDA runtime's stream type (cudaStream_t is CUstream_st*), declared without CUDA headers.
struct CUstream_st;

namespace rpe {

/// @brief One RPE term attached to the attention step: the term's descriptor (null = none; an
/// rpe::any_term of any scalar converts to it, or pass an rpe::term_desc), its lookup table(s)
/// (1, or 2 for Cross: rows, cols), in the backend's memory, and, for backward, where their
/// gradients go (empty = not wanted). Only the descriptor is used, never a backend's kernels of it.
template <class S>
struct attention_term {
    const term_desc* term = nullptr;               ///< the configured term, or null
    std::vector<tensor_ref<const S>> tables = {};  ///< its table(s), shapes term->table_shape()
    std::vector<tensor_ref<S>> grad_tables = {};   ///< gradients of the tables (backward), or empty
};

/// @brief Several images packed into one sequence (variable-length attention, NaFlexViT,
/// Qwen-VL's vision encoder): the attention and every attached term stay within each image, as if
/// each image ran alone (a block-diagonal layout; no (L, L) mask is made, no cross-image pair is
/// computed).
///
/// Image m holds the tokens [off_m, off_m + lengths[m]) of the sequence, `off_m` the sum of the
/// earlier lengths; its first `skip` tokens are its own extra tokens (class, distillation: each
/// image carries its own, at its start, as when it runs alone), then its grid tokens in the order of
/// its grid (row-major) or of its positions.
/// lengths: (M,) int32, M ≥ 1 images, each ≥ 1 (≥ skip + 1 with a term attached), summing to L.
/// grids: (M, 2) int32 (height, width) — (M, 3) (depth, height, width) for 3D mappings — with
/// `lengths[m] = skip + depth·height·width`; or empty with positions, or with no term attached.
/// positions: (L − M·skip, 2 or 3) int32, every image's grid-token positions, image after image
/// (as attention_inputs::positions is for one image: rows of image m are its tokens after its
/// `skip` extra ones); or empty with grids. Exactly one of grids and positions when a term is
/// attached. All views contiguous, host memory (the CUDA attention also takes device memory,
/// copied to the host and waited for).
struct packed_sequences {
    tensor_ref<const std::int32_t> lengths = {};    ///< (M,) tokens per image, its skip tokens included
    tensor_ref<const std::int32_t> grids = {};      ///< (M, 2) (height, width) or (M, 3) (depth, height, width), or empty
    tensor_ref<const std::int32_t> positions = {};  ///< (L − M·skip, 2 or 3) per-token positions, or empty
    /// @brief True when lengths are given (the inputs are packed).
    [[nodiscard]] bool enabled() const { return lengths.data != nullptr || lengths.rank != 0; }
};

/// @brief Inputs of the attention step.
///
/// q: (B, H, L, D); k, v: (B, H, L_k, D) (the same B, H, D; L_k = L in self-attention, any
/// L_k ≥ 1 in cross-attention and with KV caches: SAM2's memory attention, decoders), projected and
/// unscaled; with a term attached on a grid `L = L_k = skip + depth·height·width` (depth 1 unless
/// the terms use a 3D mapping). Keys of another length (L_k ≠ L) need a backend with
/// attention_capabilities::cross_lengths (the CPU's), take no packing (rpe::not_supported), and
/// take iRPE terms at positions only: `positions` (L − skip) and `key_positions` (L_k − skip),
/// the terms' ids (L, L_k) (rpe::invalid_argument naming positions or key_positions when either
/// is missing: a grid describes one token set). q, k, v may be strided views whose last stride is 1
/// (tensor_ref::with_strides; e.g. read in place from a packed (B, L, 3, H, D) qkv projection);
/// outputs, masks and tables are contiguous. The grid size is
/// given explicitly (the reference's default of a square ⌊√L⌋ grid is not guessed).
/// attn_mask: optional (L, L_k) additive mask (DETR's float `attn_mask`), added to the logits after
/// all RPE terms; −∞ entries mask a pair.
/// key_padding_mask: optional (B, L_k), nonzero = padded key (DETR): those logits become −∞ after
/// all RPE terms are added. Rows whose keys are all masked give zero probabilities and zero
/// output (the reference gives NaN there).
/// rope: optional 2D rotary position embedding of q and k (rpe::rotary_embedding; 2D grids only,
/// `L = rope.skip + height*width` (+ the queries' suffix); the keys at rope.key_positions or the
/// queries' positions, `L_k = rope.skip + N_k + rope.suffix`): q and k are rotated first, and everything after (q·kᵀ and
/// the iRPE terms, contextual ones included) sees the rotated q and k, as if rpe::rope_forward
/// had been applied to both before the attention.
/// positions: optional per-token positions of the iRPE terms instead of the grid (RoPE takes
/// its own, rope.positions): (L − skip, 2) int32 (row, col) — (L − skip, 3) (t, row, col) for 3D
/// mappings — of the tokens after each term's `skip` extra tokens, in any order; the terms' ids
/// are those of rpe::build_bucket_ids(m, positions, key_positions, skip) and height, width, depth
/// are then not read by the terms. key_positions: the keys' positions, (L_k − skip, 2 or 3), or
/// empty for the queries' (L_k = L only). A backend without attention_capabilities::positions refuses them;
/// given with no term attached (nothing would read them) they are refused too (rpe::invalid_argument).
/// packed: optional several images in the sequence (rpe::packed_sequences): attention and terms
/// within each image only; height, width, depth (0, 0, 1) and positions (empty) are then not used.
/// key_lengths: optional (B,) int32 valid key lengths: keys at index ≥ key_lengths[b] of batch
/// element b are padding (0 ≤ length ≤ L_k; 0: every key padded, zero output), the same results as a
/// key_padding_mask that marks them, but those keys are skipped, never computed (combined with a
/// key_padding_mask when both are given).
/// One type for both backends: views point at host memory for the CPU backend and at device
/// memory for the CUDA one (rpe::cuda::attention_inputs is this type). What a backend cannot
/// read (e.g. strided q/k/v on CUDA) is refused by the shared checks (attention_capabilities).
template <class S>
struct attention_inputs {
    using scalar_type = S;        ///< element type of q, k, v, tables, masks
    tensor_ref<const S> q, k, v;  ///< q (B, H, L, D), k and v (B, H, L_k, D); contiguous or strided (rows of D contiguous)
    int height = 0;               ///< grid rows
    int width = 0;                ///< grid columns
    attention_term<S> rpe_q, rpe_k, rpe_v;              ///< RPE on queries, keys, values (each optional)
    tensor_ref<const S> attn_mask;                      ///< (L, L_k) additive, or empty
    tensor_ref<const std::uint8_t> key_padding_mask;    ///< (B, L_k) or empty
    int depth = 1;                                      ///< grid frames (3D mappings on T x H x W video grids)
    rotary_embedding<S> rope = {};                      ///< RoPE on q and k (form std::monostate = none)
    tensor_ref<const std::int32_t> positions = {};      ///< (L − skip, 2 or 3) iRPE positions, or empty = the grid
    tensor_ref<const std::int32_t> key_positions = {};  ///< the keys' (L_k − skip, 2 or 3), or empty = positions
    packed_sequences packed = {};                       ///< several images in one sequence, or none
    tensor_ref<const std::int32_t> key_lengths = {};    ///< (B,) index after each element's last valid key, or empty = all
};

/// @brief Query rows [begin, end) of every (batch, head) (attention_options::query_rows); end = -1: up to L.
struct query_row_range {
    std::int64_t begin = 0;  ///< first row computed
    std::int64_t end = -1;   ///< one past the last row computed; -1: L (every row from begin)
    /// @brief One past the last row computed for L query rows: end, or L when end is -1.
    [[nodiscard]] std::int64_t end_of(std::int64_t l) const { return end == -1 ? l : end; }
    /// @brief Whether this is every row of L: [0, -1) (the default) or [0, L).
    [[nodiscard]] bool whole(std::int64_t l) const { return begin == 0 && end_of(l) == l; }
};

/// @brief Options of the attention step, for both backends (each ignores what it does not use).
struct attention_options {
    /// Softmax scale s of `logits = (q·s)·kᵀ + ...` (the contextual terms see q·s and k·s, as in
    /// the reference); unset: `1/sqrt(D)`. @throws rpe::invalid_argument when not finite.
    std::optional<double> scale = std::nullopt;
    /// CPU: rows of the logits computed at once per (batch, head); 0 = automatic (about 128K
    /// logits per block, at least 32 rows). Results do not depend on it beyond float rounding of
    /// the matrix products. The CUDA backend ignores it.
    std::int64_t row_block = 0;
    /// How the bucket ids are held on the host (see rpe::id_storage): `automatic` keeps (L, L)
    /// tables up to bucket_ids::auto_table_bytes and computes larger grids' ids on the fly. The
    /// CPU attention reads ids a row block at a time either way; the CUDA backend uploads the
    /// per-offset ids whatever the storage.
    id_storage storage = id_storage::automatic;
    /// CUDA: the stream the work is enqueued on (a `cudaStream_t`; null = the legacy default
    /// stream). The CPU backend ignores it.
    CUstream_st* stream = nullptr;
    /// CPU backward: the most bytes its per-item partials may take at once (gradient partials of
    /// grad_k, grad_v and the tables, the per-(key, bucket) sums and products of the contextual
    /// query tables, L·K each; see rpe::cpu::plan_backward_scratch). The (batch, head, chunk of row
    /// blocks) items are computed in waves whose partials fit; which rows form a chunk, and so the
    /// order of every sum, depends on the shape only, so the results are bit-identical for every
    /// budget and thread count. A wave of fewer items than threads leaves threads idle; one item's
    /// partials are the least it can take (a smaller budget gets that). Per-thread buffers (logits
    /// blocks) are not counted. Default 256 MiB. The forward and the CUDA backend do not use it (both check it).
    /// @throws rpe::invalid_argument `[rpe.attention] options.backward_budget_bytes = ...` when <= 0.
    std::int64_t backward_budget_bytes = std::int64_t{256} << 20;
    /// CUDA forward, fp16 and bf16: whether to take the tensor-core kernel where it applies (head
    /// dim a multiple of 16, no value term, ...: rpe::cuda::attention_forward_uses_tensor_cores,
    /// docs/cuda.md). true: yes; false: the SIMT kernel (for comparisons); unset: the process
    /// default, on, set for every call by the environment variable RPE_CUDA_ATTENTION_TENSOR_CORES
    /// (`0` off, anything else on; read once per process). The CPU backend and the backward
    /// ignore it.
    std::optional<bool> tensor_cores = std::nullopt;
    /// Forward: compute only the query rows [begin, end) of every (batch, head); the other rows of
    /// `out` (and of `attn`) are not written. Each computed row equals that row of the call on
    /// every row (a row depends on its own query only): bit for bit where the products run on
    /// cpu::simd::gemm (float, and f16 and bf16's portable path over it, on AVX-512F units); the row
    /// blocks start at begin, so Eigen's products (double; float off AVX-512F; the value terms of
    /// bf16's AVX512_BF16 path) may round differently in the last bits (a 16-bit output then by one
    /// unit in the last place). For inference where only some rows are read: a classifier whose
    /// head reads the class token computes the last block's attention for row 0 alone (`{0, 1}`:
    /// 1/L of the rows' work; the contextual query term's per-key products and the keys' packing
    /// are still made for every key). Default: every row. Backends with
    /// attention_capabilities::query_rows (the CPU: float, double, bf16, f16; not with packed
    /// sequences); the backward takes every row only.
    /// @throws rpe::invalid_argument `[rpe.attention] options.query_rows = [begin, end) ...` unless
    ///   0 <= begin <= end <= L (end = -1: L); on the backward, unless every row ([0, -1) or [0, L)).
    query_row_range query_rows = {};
};

/// @brief The backward's tensors, by name: the incoming gradient, the gradients written, and
/// optionally the forward's probabilities to reuse instead of recomputing them.
///
/// `attention_backward(in, {.grad_out = go, .grad_q = gq, .grad_k = gk, .grad_v = gv,
/// .saved_attn = attn}, opt)`. grad_out and grad_q (B, H, L, D), grad_k and grad_v (B, H, L_k, D)
/// (the shapes of q, k, v), saved_attn (B, H, L, L_k).
template <class S>
struct attention_gradients {
    tensor_ref<const S> grad_out;          ///< (B, H, L, D): gradient of the forward's `out`
    tensor_ref<S> grad_q, grad_k, grad_v;  ///< shapes of q, k, v, written (overwritten)
    /// (B, H, L, L_k): the probabilities the forward wrote to its `attn` output for the same
    /// inputs, reused instead of recomputed (same gradients up to float rounding; from other
    /// inputs they give wrong gradients: not checked against q and k), or empty to recompute.
    /// Needs a backend with attention_capabilities::saved_probabilities.
    tensor_ref<const S> saved_attn = {};
};

/// @brief What one backend's attention supports, checked once by the shared front
/// (detail::check_attention, detail::check_attention_features): a feature a backend lacks is an
/// rpe::not_supported error naming the feature and the backend, never a silent drift.
struct attention_capabilities {
    const char* backend = "";          ///< the backend's name in messages ("cpu", "cuda")
    bool strided_qkv = false;          ///< q, k, v may be strided views (rows of D contiguous)
    bool saved_probabilities = false;  ///< the forward's `attn` output and the backward from `saved_attn`
    bool rope = false;                 ///< rotary position embedding of q and k (attention_inputs::rope)
    bool rope_freqs_grad = false;      ///< the gradient of rope::mixed's frequencies (rope.grad_freqs)
    bool key_padding_mask = false;     ///< attention_inputs::key_padding_mask
    bool attn_mask = false;            ///< attention_inputs::attn_mask
    bool grid_3d = false;              ///< depth > 1 (3D mappings on T × H × W grids)
    std::int64_t max_head_dim = 0;     ///< the largest D, or 0 for no limit
    bool positions = false;            ///< per-token positions of the iRPE terms (attention_inputs::positions)
    bool packed = false;               ///< several images per sequence (attention_inputs::packed)
    bool key_lengths = false;          ///< valid key lengths per batch element (attention_inputs::key_lengths)
    /// k and v of another length than q (L_k != L: cross-attention, KV caches), and RoPE's
    /// query_suffix other than its suffix
    bool cross_lengths = false;
    bool query_rows = false;  ///< a forward on some query rows only (attention_options::query_rows)
};

namespace detail {

/// @brief The softmax scale of a call: `opt.scale`, or `1/sqrt(d)` when unset.
/// @throws rpe::invalid_argument `[rpe.attention] options.scale = ...; expected a finite value`.
inline double softmax_scale(const attention_options& opt, std::int64_t d) {
    if (!opt.scale) return 1.0 / std::sqrt(static_cast<double>(d));
    require(std::isfinite(*opt.scale), "attention", "options.scale = ", *opt.scale, "; expected a finite value");
    return *opt.scale;
}

/// @brief Checks attention_options::backward_budget_bytes (> 0).
/// @throws rpe::invalid_argument `[rpe.attention] options.backward_budget_bytes = ...; expected > 0`.
inline void check_backward_budget(const attention_options& opt) {
    require(opt.backward_budget_bytes > 0, "attention", "options.backward_budget_bytes = ", opt.backward_budget_bytes,
            "; expected > 0 (bytes)");
}

/// @brief Throws rpe::not_supported `[rpe.attention] <feature> is not supported by the <backend>
/// backend` when `used` and the backend lacks it (`supported` false).
inline void require_feature(bool used, bool supported, const attention_capabilities& caps, const char* feature) {
    if (used && !supported)
        throw not_supported(message("attention", feature, " is not supported by the ", caps.backend, " backend"));
}

/// @brief (B, H, L, D) of an attention call (L of the queries) and L_k, the keys' and values'
/// length (L_k = L in self-attention). An aggregate without defaults: every construction spells
/// all five, L_k as k.extent(2) (never assumed equal to L).
struct attention_shape {
    std::int64_t b, h, l, d;
    std::int64_t lk;  ///< keys and values: (B, H, L_k, D)
};

/// @brief Checks attention_options::query_rows against L = s.l: 0 <= begin <= end <= L, end = -1 meaning L.
/// @throws rpe::invalid_argument `[rpe.attention] options.query_rows = [begin, end) ...` otherwise.
inline void check_query_rows(const attention_options& opt, const attention_shape& s) {
    const auto& r = opt.query_rows;
    const std::int64_t end = r.end_of(s.l);
    require(r.begin >= 0 && r.end >= -1 && r.begin <= end && end <= s.l, "attention", "options.query_rows = [", r.begin, ", ",
            r.end, "); expected 0 <= begin <= end <= L = ", s.l, " (end -1: L)");
}

/// @brief Checks attention_inputs::key_lengths: (B,) int32, contiguous, non-null, each value in
/// [0, L_k]. @throws rpe::invalid_argument `[rpe.attention] key_lengths[1] = 9; expected 0 <= length
///   <= L = 8` (self-attention) or `... <= L_k = 8` (keys of another length), or naming the shape.
inline void check_key_lengths(const tensor_ref<const std::int32_t>& lengths, const attention_shape& s) {
    check_shape(lengths, {s.b}, "attention", "key_lengths");
    check_nonnull(lengths, "attention", "key_lengths");
    for (std::int64_t b = 0; b < s.b; ++b)
        require(lengths.data[b] >= 0 && lengths.data[b] <= s.lk, "attention", "key_lengths[", b, "] = ", lengths.data[b],
                "; expected 0 <= length <= ", s.lk == s.l ? "L = " : "L_k = ", s.lk, " (keys at index >= length are padding)");
}

/// @brief The checks of attention_inputs::packed that do not depend on the terms: lengths (M,)
/// int32 with M ≥ 1, each ≥ 1, summing to L of q; the grid and positions fields of the inputs
/// unused (packed.grids / packed.positions hold them); not both packed.grids and
/// packed.positions; no RoPE, no key_lengths (rpe::not_supported with packed sequences).
/// @throws rpe::invalid_argument `[rpe.attention] packed.lengths ...`, rpe::not_supported.
template <class In>
void check_packed_front(const In& in, const attention_capabilities& caps) {
    const auto& pk = in.packed;
    const std::int64_t l = in.q.extent(2);
    require(pk.lengths.rank == 1 && pk.lengths.extent(0) >= 1, "attention", "packed.lengths has shape ",
            pk.lengths.shape_string(), "; expected (M >= 1,) tokens per image");
    check_nonnull(pk.lengths, "attention", "packed.lengths");
    std::int64_t sum = 0;
    for (std::int64_t m = 0; m < pk.lengths.extent(0); ++m) {
        require(pk.lengths.data[m] >= 1, "attention", "packed.lengths[", m, "] = ", pk.lengths.data[m],
                "; expected >= 1 tokens per image");
        sum += pk.lengths.data[m];
    }
    require(sum == l, "attention", "packed.lengths sum to ", sum, "; expected L = ", l, " of q (every token in one image)");
    require(is_empty_view(in.positions) && is_empty_view(in.key_positions), "attention",
            "positions is given with packed; expected packed.positions (every image's positions, image after image) "
            "and no key_positions");
    require(in.height == 0 && in.width == 0 && in.depth == 1, "attention", "height = ", in.height, ", width = ", in.width,
            ", depth = ", in.depth, " with packed; expected 0, 0, 1 (each image's grid is in packed.grids)");
    require(is_empty_view(pk.grids) || is_empty_view(pk.positions), "attention",
            "packed.grids and packed.positions are both given; expected one of them");
    require_feature(in.rope.enabled(), false, caps, "rope with packed sequences (packed)");
    require_feature(!is_empty_view(in.key_lengths), false, caps,
                    "key_lengths with packed sequences (packed; each image is attended alone, give a "
                    "key_padding_mask for padded tokens)");
}

/// @brief Checks attention_inputs::packed against one attached term `name` (its skip and
/// position axes): each image longer than skip; packed.grids (M, 2) or (M, 3) with positive sizes
/// and `lengths[m] = skip + depth·height·width`, or packed.positions (L − M·skip, A) (check_positions).
/// @throws rpe::invalid_argument `[rpe.attention] packed.grids[1] = (3, 4) gives skip + ... tokens; expected packed.lengths[1] = ...`,
///   or `packed.grids[0] = (2, 2, 3) has depth 2 with the 2D mapping of rpe_k; ...`.
inline void check_packed_term(const packed_sequences& pk, const attention_shape& s, const term_desc& t, const char* name) {
    const std::int64_t m_count = pk.lengths.extent(0), skip = t.skip();
    for (std::int64_t m = 0; m < m_count; ++m)
        require(pk.lengths.data[m] > skip, "attention", "packed.lengths[", m, "] = ", pk.lengths.data[m],
                "; expected more than skip = ", skip, " of ", name, " (every image needs grid tokens after its extra tokens)");
    if (!is_empty_view(pk.positions)) {
        const std::string what = concat("L - M*skip = ", s.l, " - ", m_count, "*", skip, " of ", name);
        (void)check_positions(pk.positions, t.position_axes(), s.l - m_count * skip, "attention", "packed.positions",
                              what.c_str());
        return;
    }
    require(!is_empty_view(pk.grids), "attention", name,
            " is attached with packed but neither packed.grids nor packed.positions is given; expected one of them");
    require(pk.grids.rank == 2 && pk.grids.extent(0) == m_count && (pk.grids.extent(1) == 2 || pk.grids.extent(1) == 3),
            "attention", "packed.grids has shape ", pk.grids.shape_string(), "; expected (M = ", m_count,
            ", 2) (height, width) or (M, 3) (depth, height, width)");
    check_nonnull(pk.grids, "attention", "packed.grids");
    const std::int64_t a = pk.grids.extent(1);
    for (std::int64_t m = 0; m < m_count; ++m) {
        const std::int32_t* g = pk.grids.data + m * a;
        const std::int64_t depth = a == 3 ? g[0] : 1, height = g[a - 2], width = g[a - 1];
        const std::string grid =
            a == 3 ? concat("(", depth, ", ", height, ", ", width, ")") : concat("(", height, ", ", width, ")");
        require(depth >= 1 && height >= 1 && width >= 1, "attention", "packed.grids[", m, "] = ", grid,
                "; expected positive sizes");
        require(depth == 1 || t.position_axes() == 3, "attention", "packed.grids[", m, "] = ", grid, " has depth ", depth,
                " with the 2D mapping of ", name, "; expected depth = 1 (a 3D mapping for depth x height x width grids)");
        // the product step by step, stopping once past the length (int32 sizes: no overflow)
        std::int64_t tokens = depth;
        if (tokens <= pk.lengths.data[m]) tokens *= height;
        if (tokens <= pk.lengths.data[m]) tokens *= width;
        require(tokens <= pk.lengths.data[m] && skip + tokens == pk.lengths.data[m], "attention", "packed.grids[", m,
                "] = ", grid, " gives skip + ", a == 3 ? "depth*" : "", "height*width = ",
                tokens <= pk.lengths.data[m] ? std::to_string(skip + tokens) : concat("more than ", pk.lengths.data[m]),
                " tokens of ", name, "; expected packed.lengths[", m, "] = ", pk.lengths.data[m]);
    }
}

/// @brief Checks q, k, v, the grid (depth, height, width), the masks and each attached term
/// (slot, heads, head dim, skip + grid = L, tables' count and shapes) of any backend's attention
/// inputs, and the features used against the backend's capabilities `caps` (strided q/k/v,
/// RoPE, masks, 3D grids, head dim, keys of another length L_k: no packing, terms at positions only).
/// Returns (B, H, L, D) and L_k.
/// @throws rpe::invalid_argument `[rpe.attention] ...` naming the argument; rpe::not_supported
///   `[rpe.attention] <feature> is not supported by the <backend> backend`.
template <class In>
attention_shape check_attention(const In& in, const attention_capabilities& caps) {
    require(in.q.rank == 4, "attention", "q has shape ", in.q.shape_string(), "; expected (B, H, L, D)");
    attention_shape s{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3), in.k.extent(2)};  // k checked below
    require(s.b >= 1 && s.h >= 1 && s.l >= 1 && s.d >= 1, "attention", "q has shape ", in.q.shape_string(),
            "; expected positive extents");
    // q sets (B, H, L, D); k is (B, H, L_k, D) with B, H, D of q (L_k may differ: cross-attention,
    // KV caches); v has the shape of k
    if (in.k.rank != 4 || in.k.extent(0) != s.b || in.k.extent(1) != s.h || in.k.extent(3) != s.d || in.k.extent(2) < 1)
        throw invalid_argument(message("attention", "k has shape ", in.k.shape_string(), "; expected (", s.b, ", ", s.h,
                                       ", L_k >= 1, ", s.d, "): B, H, D of q ", in.q.shape_string()));
    // a backend without cross-attention, and v of the queries' length: the odd one out is k
    if (!caps.cross_lengths && s.lk != s.l && in.v.has_shape({s.b, s.h, s.l, s.d}))
        throw invalid_argument(message("attention", "k has shape ", in.k.shape_string(), "; expected ", in.q.shape_string(),
                                       ", the shape of q and v (the ", caps.backend,
                                       " backend takes keys of the queries' length)"));
    if (!in.v.has_shape({s.b, s.h, s.lk, s.d}))
        throw invalid_argument(
            message("attention", "v has shape ", in.v.shape_string(), "; expected ", in.k.shape_string(), ", the shape of k"));
    require_feature(s.lk != s.l, caps.cross_lengths, caps, "keys of another length than the queries (L_k != L)");
    // q, k, v may be strided views (rows of D contiguous) where the backend reads them so
    // (caps.strided_qkv); elsewhere a strided view is refused as not supported
    if (caps.strided_qkv) {
        check_strided_rows(in.q, "attention", "q");
        check_strided_rows(in.k, "attention", "k");
        check_strided_rows(in.v, "attention", "v");
    } else {
        static constexpr const char* qkv_names[] = {"q", "k", "v"};
        const decltype(&in.q) qkv[] = {&in.q, &in.k, &in.v};
        for (int i = 0; i < 3; ++i)
            if (!qkv[i]->contiguous())
                throw not_supported(message("attention", qkv_names[i], " is a strided view (shape ", qkv[i]->shape_string(),
                                            ", strides ", qkv[i]->strides_string(),
                                            "); strided q, k, v views are not supported by the ", caps.backend, " backend"));
        check_nonnull(in.q, "attention", "q");
        check_nonnull(in.k, "attention", "k");
        check_nonnull(in.v, "attention", "v");
    }
    require_feature(in.attn_mask.rank != 0 || in.attn_mask.data != nullptr, caps.attn_mask, caps, "attn_mask");
    require_feature(in.key_padding_mask.rank != 0 || in.key_padding_mask.data != nullptr, caps.key_padding_mask, caps,
                    "key_padding_mask");
    require_feature(in.depth > 1, caps.grid_3d, caps, "a 3D grid (depth > 1)");
    require_feature(in.rope.enabled(), caps.rope, caps, "rope");
    const bool at_positions = !is_empty_view(in.positions) || !is_empty_view(in.key_positions);
    require_feature(at_positions, caps.positions, caps, "per-token positions of the iRPE terms (positions)");
    require(!at_positions || !is_empty_view(in.positions), "attention",
            "key_positions is given without positions; expected positions too (the queries' positions)");
    // the terms are the positions' only readers: given without one, they would be ignored silently
    require(!at_positions || in.rpe_q.term || in.rpe_k.term || in.rpe_v.term, "attention",
            is_empty_view(in.key_positions) ? "positions is" : "positions and key_positions are",
            " given but no iRPE term (rpe_q, rpe_k, rpe_v) is attached; expected none (nothing reads them: they are "
            "the iRPE terms' positions; the RoPE's are rope.positions and rope.key_positions)");
    const bool packed = in.packed.enabled();
    require_feature(packed, caps.packed, caps, "packed sequences (packed)");
    const bool with_lengths = !is_empty_view(in.key_lengths);
    require_feature(with_lengths, caps.key_lengths, caps, "valid key lengths (key_lengths)");
    if (with_lengths) check_key_lengths(in.key_lengths, s);
    if (packed) check_packed_front(in, caps);
    if (s.lk != s.l) {  // cross-attention: no packing (its images attend to themselves); terms at positions only
        if (packed)
            throw not_supported(message("attention", "packed sequences with keys of another length than the queries (L = ", s.l,
                                        ", L_k = ", s.lk, "); expected L_k = L (each image attends to itself)"));
        static constexpr const char* slot_names[] = {"rpe_q", "rpe_k", "rpe_v"};
        const decltype(&in.rpe_q) term_slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int i = 0; i < 3; ++i) {
            if (!term_slots[i]->term) continue;
            // a grid (height, width) describes one token set: queries and keys of two counts need
            // the positions of each (ids (L, L_k), rpe::build_bucket_ids(m, positions, key_positions, skip))
            require(at_positions, "attention", slot_names[i],
                    " is attached with keys of another length than the queries (L = ", s.l, ", L_k = ", s.lk,
                    ") and no positions; expected positions (the queries') and key_positions (the "
                    "keys'): a grid (height, width) describes one token set");
            require(!is_empty_view(in.key_positions), "attention",
                    "key_positions is empty with keys of another length than "
                    "the queries (L = ",
                    s.l, ", L_k = ", s.lk, ") and ", slot_names[i],
                    " attached; expected the keys' "
                    "positions (L_k - skip of them)");
        }
    }
    if (caps.max_head_dim > 0 && s.d > caps.max_head_dim)
        throw not_supported(message("attention", "head dim D = ", s.d, " is not supported by the ", caps.backend,
                                    " backend; expected D <= ", caps.max_head_dim));
    if (in.attn_mask.rank != 0 || in.attn_mask.data != nullptr) {
        check_shape(in.attn_mask, {s.l, s.lk}, "attention", "attn_mask");
        check_nonnull(in.attn_mask, "attention", "attn_mask");
    }
    if (in.key_padding_mask.rank != 0 || in.key_padding_mask.data != nullptr) {
        check_shape(in.key_padding_mask, {s.b, s.lk}, "attention", "key_padding_mask");
        check_nonnull(in.key_padding_mask, "attention", "key_padding_mask");
    }
    using slot_type = std::remove_cvref_t<decltype(in.rpe_q)>;
    const slot_type* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    static constexpr const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
    static constexpr const char* table_names[] = {"rpe_q table", "rpe_k table", "rpe_v table"};
    const target wanted[] = {target::query, target::key, target::value};
    for (int i = 0; i < 3; ++i) {
        const auto& slot = *slots[i];
        if (!slot.term) continue;
        const auto& t = *slot.term;
        require(t.target() == wanted[i], "attention", names[i], " holds a term on target ", target_letter(t.target()),
                "; expected ", target_letter(wanted[i]));
        require(t.num_heads() == s.h, "attention", names[i], " has num_heads = ", t.num_heads(), "; expected H = ", s.h, " of q");
        require(t.head_dim() == s.d, "attention", names[i], " has head_dim = ", t.head_dim(), "; expected D = ", s.d, " of q");
        if (packed) {
            check_packed_term(in.packed, s, t, names[i]);
        } else if (at_positions) {
            const std::string what = "L - skip = " + std::to_string(s.l) + " - " + std::to_string(t.skip()) + " of " + names[i];
            const int axes = t.position_axes();
            require(s.l > t.skip(), "attention", "L = ", s.l, " of q; expected more than skip = ", t.skip(), " of ", names[i],
                    " (positions need grid tokens)");
            (void)check_positions(in.positions, axes, s.l - t.skip(), "attention", "positions", what.c_str());
            if (!is_empty_view(in.key_positions)) {
                require(s.lk > t.skip(), "attention", "L_k = ", s.lk, " of k; expected more than skip = ", t.skip(), " of ",
                        names[i], " (key_positions need grid tokens)");
                const std::string key_what =
                    s.lk == s.l ? what
                                : "L_k - skip = " + std::to_string(s.lk) + " - " + std::to_string(t.skip()) + " of " + names[i];
                (void)check_positions(in.key_positions, axes, s.lk - t.skip(), "attention", "key_positions", key_what.c_str());
            }
        } else if (s.l != t.skip() + static_cast<std::int64_t>(in.depth) * in.height * in.width)
            throw invalid_argument(message(
                "attention", "L = ", s.l, " of q; expected skip + ", in.depth == 1 ? "" : "depth*", "height*width = ", t.skip(),
                " + ", in.depth == 1 ? std::string() : std::to_string(in.depth) + "*", in.height, "*", in.width));
        require(static_cast<int>(slot.tables.size()) == t.num_tables(), "attention", names[i], " tables holds ",
                slot.tables.size(), " tables; expected ", t.num_tables());
        const auto shape = t.table_shape();
        for (const auto& tab : slot.tables) {
            check_shape(tab, shape, "attention", table_names[i]);
            check_nonnull(tab, "attention", table_names[i]);
        }
    }
    check_rope(in.rope, s.h, s.l, s.d, in.depth, in.height, in.width, "attention", s.lk);
    require_feature(in.rope.enabled() && in.rope.query_suffix >= 0 && in.rope.query_suffix != in.rope.suffix, caps.cross_lengths,
                    caps, "rope query_suffix other than suffix");
    return s;
}

/// @brief Throws when an output view overlaps q, k, v, the masks or the terms' tables.
template <class In, class T>
void check_output_overlap(const In& in, const tensor_ref<T>& out, std::string_view name) {
    for (const auto* x : {&in.q, &in.k, &in.v}) check_no_overlap(out, *x, "attention", name, "q/k/v");
    check_no_overlap(out, in.attn_mask, "attention", name, "attn_mask");
    check_no_overlap(out, in.key_padding_mask, "attention", name, "key_padding_mask");
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        for (const auto& t : slot->tables) check_no_overlap(out, t, "attention", name, "a lookup table");
    if constexpr (requires { in.rope; }) check_no_overlap(out, in.rope.freqs, "attention", name, "rope freqs");
}

/// @brief Checks the attention_terms' grad_tables: each given entry (data or shape set) has its
/// table's shape and data, and is separate from the inputs, from `others` (the call's other
/// buffers: grad_out, attn, grad_q/k/v) and from every other grad_tables entry.
template <class In>
void check_grad_tables(const In& in,
                       std::initializer_list<std::pair<tensor_ref<const typename In::scalar_type>, const char*>> others) {
    using S = typename In::scalar_type;
    using slot_type = std::remove_cvref_t<decltype(in.rpe_q)>;
    const slot_type* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
    static constexpr const char* names[] = {"rpe_q", "rpe_k", "rpe_v"};
    std::vector<std::pair<tensor_ref<const S>, std::string>> seen;
    for (int i = 0; i < 3; ++i) {
        const auto& slot = *slots[i];
        if (!slot.term) continue;
        require(slot.grad_tables.size() <= static_cast<std::size_t>(slot.term->num_tables()), "attention", names[i],
                " grad_tables holds ", slot.grad_tables.size(), " entries; expected at most ", slot.term->num_tables());
        for (std::size_t t = 0; t < slot.grad_tables.size(); ++t) {
            const auto& g = slot.grad_tables[t];
            if (g.data == nullptr && g.rank == 0) continue;  // not wanted
            const std::string name = std::string(names[i]) + " grad_tables[" + std::to_string(t) + "]";
            check_shape(g, slot.term->table_shape(), "attention", name);
            check_nonnull(g, "attention", name);
            check_output_overlap(in, g, name);
            for (const auto& [other, other_name] : others) check_no_overlap(g, other, "attention", name, other_name);
            for (const auto& [prev, prev_name] : seen) check_no_overlap(g, prev, "attention", name, prev_name);
            seen.emplace_back(tensor_ref<const S>(g), name);
        }
    }
}

/// @brief The forward's output checks: `out` (B, H, L, D) and, when `attn` is given (or
/// `attn_required`), `attn` (B, H, L, L_k), each non-null and separate from every input and from
/// each other. @throws rpe::invalid_argument `[rpe.attention] ...`.
template <class In, class S>
void check_attention_outputs(const In& in, const attention_shape& s, const tensor_ref<S>& out, const tensor_ref<S>& attn,
                             bool attn_required) {
    check_shape(out, {s.b, s.h, s.l, s.d}, "attention", "out");
    check_nonnull(out, "attention", "out");
    const bool with_attn = attn_required || attn.data != nullptr || attn.rank != 0;
    if (with_attn) {
        check_shape(attn, {s.b, s.h, s.l, s.lk}, "attention", "attn");
        check_nonnull(attn, "attention", "attn");
    }
    check_output_overlap(in, out, "out");
    if (with_attn) {
        check_output_overlap(in, attn, "attn");
        check_no_overlap(out, attn, "attention", "out", "attn");
    }
}

/// @brief The backward's checks of grad_out and the outputs grad_q, grad_k, grad_v (each
/// (B, H, L, D) and (B, H, L_k, D) for grad_k and grad_v, non-null, separate from the inputs, from `attn` (when given), grad_out and each
/// other) and of the terms' grad_tables. @throws rpe::invalid_argument `[rpe.attention] ...`.
template <class In, class S>
void check_attention_gradients(const In& in, const attention_shape& s, const tensor_ref<const S>& attn,
                               const tensor_ref<const S>& grad_out, const tensor_ref<S>& grad_q, const tensor_ref<S>& grad_k,
                               const tensor_ref<S>& grad_v) {
    const std::vector<std::int64_t> shape{s.b, s.h, s.l, s.d}, key_shape{s.b, s.h, s.lk, s.d};
    check_shape(grad_out, shape, "attention", "grad_out");
    check_nonnull(grad_out, "attention", "grad_out");
    const tensor_ref<S>* outs[] = {&grad_q, &grad_k, &grad_v};
    static constexpr const char* names[] = {"grad_q", "grad_k", "grad_v"};
    for (int i = 0; i < 3; ++i) {
        check_shape(*outs[i], i == 0 ? shape : key_shape, "attention", names[i]);
        check_nonnull(*outs[i], "attention", names[i]);
        check_output_overlap(in, *outs[i], names[i]);
        check_no_overlap(*outs[i], attn, "attention", names[i], "attn");
        check_no_overlap(*outs[i], grad_out, "attention", names[i], "grad_out");
        for (int j = 0; j < i; ++j) check_no_overlap(*outs[i], *outs[j], "attention", names[i], names[j]);
    }
    check_grad_tables(in, {{attn, "attn"}, {grad_out, "grad_out"}, {grad_q, "grad_q"}, {grad_k, "grad_k"}, {grad_v, "grad_v"}});
    if constexpr (requires { in.rope; }) {
        if (check_rope_gradient(in.rope, s.h, s.d, "attention")) {
            const auto& g = in.rope.grad_freqs;
            check_output_overlap(in, g, "rope grad_freqs");
            check_no_overlap(g, attn, "attention", "rope grad_freqs", "attn");
            check_no_overlap(g, grad_out, "attention", "rope grad_freqs", "grad_out");
            for (int i = 0; i < 3; ++i) check_no_overlap(g, *outs[i], "attention", "rope grad_freqs", names[i]);
            for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
                for (const auto& t : slot->grad_tables)
                    check_no_overlap(g, t, "attention", "rope grad_freqs", "a grad_tables entry");
        }
    }
}

/// @brief Every check of a forward call on a backend with capabilities `caps`: the options
/// (storage, scale, backward budget), the inputs (check_attention), the `attn` output (a backend feature) and the
/// outputs' shapes and overlaps. Returns (B, H, L, D).
/// @throws rpe::invalid_argument `[rpe.attention] ...`; rpe::not_supported for a missing feature.
template <class S>
attention_shape check_attention_forward(const attention_inputs<S>& in, const tensor_ref<S>& out, const tensor_ref<S>& attn,
                                        const attention_options& opt, const attention_capabilities& caps) {
    require_enum(opt.storage, 3, "attention", "options.storage", "automatic, table or on_the_fly");
    const auto s = check_attention(in, caps);
    (void)softmax_scale(opt, s.d);
    check_backward_budget(opt);
    require_feature(attn.data != nullptr || attn.rank != 0, caps.saved_probabilities, caps, "the attn output (probabilities)");
    require_feature((attn.data != nullptr || attn.rank != 0) && in.packed.enabled(), false, caps,
                    "the attn output (probabilities) with packed sequences (packed)");
    check_query_rows(opt, s);
    require_feature(!opt.query_rows.whole(s.l), caps.query_rows, caps, "options.query_rows (some query rows only)");
    require_feature(!opt.query_rows.whole(s.l) && in.packed.enabled(), false, caps,
                    "options.query_rows (some query rows only) with packed sequences (packed)");
    check_attention_outputs(in, s, out, attn, false);
    return s;
}

/// @brief Every check of a backward call on a backend with capabilities `caps`: as the forward's,
/// then `g.saved_attn` when given (a backend feature; (B, H, L, L_k), non-null, contiguous), the
/// RoPE frequencies' gradient (a backend feature) and the gradients' shapes and overlaps.
/// @throws rpe::invalid_argument `[rpe.attention] ...`; rpe::not_supported for a missing feature.
template <class S>
attention_shape check_attention_backward(const attention_inputs<S>& in, const attention_gradients<S>& g,
                                         const attention_options& opt, const attention_capabilities& caps) {
    require_enum(opt.storage, 3, "attention", "options.storage", "automatic, table or on_the_fly");
    const auto s = check_attention(in, caps);
    (void)softmax_scale(opt, s.d);
    check_backward_budget(opt);
    require(opt.query_rows.whole(s.l), "attention", "options.query_rows = [", opt.query_rows.begin, ", ", opt.query_rows.end,
            "); expected every row, [0, -1) or [0, L = ", s.l,
            "), in the backward (the gradients of q, k and v depend on all of them)");
    const bool saved = g.saved_attn.data != nullptr || g.saved_attn.rank != 0;
    require_feature(saved, caps.saved_probabilities, caps, "the backward from saved probabilities (saved_attn)");
    require_feature(saved && in.packed.enabled(), false, caps,
                    "the backward from saved probabilities (saved_attn) with packed sequences (packed)");
    if (saved) {
        check_shape(g.saved_attn, {s.b, s.h, s.l, s.lk}, "attention", "saved_attn");
        check_nonnull(g.saved_attn, "attention", "saved_attn");
    }
    require_feature(in.rope.enabled() && in.rope.grad_freqs.data != nullptr, caps.rope_freqs_grad, caps, "rope grad_freqs");
    check_attention_gradients(in, s, g.saved_attn, g.grad_out, g.grad_q, g.grad_k, g.grad_v);
    return s;
}

/// @brief The view of tokens [off, off + len) of `t` along `axis` (each axis in `axes`): the same
/// strides, extent `len` there (a packed image's rows of q, k, v, outputs, masks).
template <class T>
tensor_ref<T> token_slice(const tensor_ref<T>& t, std::initializer_list<int> axes, std::int64_t off, std::int64_t len) {
    if (is_empty_view(t)) return t;
    std::vector<std::int64_t> dims(static_cast<std::size_t>(t.rank)), strides(dims.size());
    T* data = t.data;
    for (int i = 0; i < t.rank; ++i) {
        dims[static_cast<std::size_t>(i)] = t.extent(i);
        strides[static_cast<std::size_t>(i)] = t.stride(i);
    }
    for (int a : axes) {
        dims[static_cast<std::size_t>(a)] = len;
        data += off * t.stride(a);
    }
    return tensor_ref<T>::with_strides(data, dims, strides);
}

/// @brief One image of a packed sequence (attention_inputs::packed): its tokens
/// [offset, offset + length) and the inputs of that image alone (views into the sequence's q, k, v
/// and masks; its grid or its rows of packed.positions; packed empty).
template <class S>
struct packed_image {
    std::int64_t offset = 0, length = 0;
    attention_inputs<S> in;
};

/// @brief The images of checked packed inputs, in order.
template <class S>
std::vector<packed_image<S>> packed_images(const attention_inputs<S>& in) {
    const auto& pk = in.packed;
    const std::int64_t m_count = pk.lengths.extent(0);
    std::int64_t skip = 0;  // the attached terms' (all equal: checked against the lengths and positions)
    for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        if (slot->term) skip = slot->term->skip();
    std::vector<packed_image<S>> out;
    out.reserve(static_cast<std::size_t>(m_count));
    std::int64_t off = 0, pos_off = 0;
    for (std::int64_t m = 0; m < m_count; ++m) {
        const std::int64_t len = pk.lengths.data[m];
        packed_image<S> img{off, len, in};
        auto& c = img.in;
        c.packed = {};
        c.q = token_slice(in.q, {2}, off, len);
        c.k = token_slice(in.k, {2}, off, len);
        c.v = token_slice(in.v, {2}, off, len);
        c.key_padding_mask = token_slice(in.key_padding_mask, {1}, off, len);
        c.attn_mask = token_slice(in.attn_mask, {0, 1}, off, len);
        if (!is_empty_view(pk.positions)) {
            const std::int64_t a = pk.positions.extent(1);
            c.positions = tensor_ref<const std::int32_t>(pk.positions.data + pos_off * a, {len - skip, a});
            pos_off += len - skip;
        } else if (!is_empty_view(pk.grids)) {
            const std::int64_t a = pk.grids.extent(1);
            const std::int32_t* g = pk.grids.data + m * a;
            c.depth = a == 3 ? g[0] : 1;
            c.height = g[a - 2];
            c.width = g[a - 1];
        }
        out.push_back(std::move(img));
        off += len;
    }
    return out;
}

/// @brief The host bucket ids of an attached term on the inputs' grid, or at the inputs'
/// positions when given (null without a term).
template <class Slot, class In>
std::shared_ptr<const bucket_ids> ids_of(const Slot& slot, const In& in, id_storage storage = id_storage::automatic) {
    if (!slot.term) return nullptr;
    if (!is_empty_view(in.positions)) return slot.term->bucket_ids(in.positions, in.key_positions);
    return slot.term->bucket_ids(in.depth, in.height, in.width, storage);
}

}  // namespace detail
}  // namespace rpe
