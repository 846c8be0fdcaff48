/// @file ops.cpp
/// @brief PyTorch operators over rpe (`TORCH_LIBRARY(rpe, ...)`, CPU kernels): every iRPE term
/// (bias / contextual on q, k, v, shared or per-head tables, Cross's two tables) forward and
/// backward, and the fused attention step forward and backward (with an optional 2D RoPE of q
/// and k: the registry's forms, DINOv3 and M-RoPE in channel layout pairs or half, V-JEPA 2 in its
/// own layout vjepa2, on the grid or at per-token positions (CPU), with unrotated leading and
/// trailing tokens, the queries' own trailing count apart from the keys' (rope_query_suffix));
/// the ViT encodings:
/// the Swin, BEiT, SAM-decomposed and 2D-ALiBi mappings selectable by
/// name in the term and attention operators, 2D RoPE on its own, and the operators that make
/// their tables (timm's layout, SwinV2's CPB, SAM's tables and resize, ALiBi's fixed table). The
/// Python package `rpe_torch` wraps them in functions and modules; docs/torch.md
/// lists the schemas. Their fake (meta) kernels, autograd formulas and autocast rules are
/// registered from Python (rpe_torch/_registrations.py, torch.library), where torch 2.x expects them.
///
/// Bucket ids come from the library's shared cache (`rpe::bucket_cache::global()`, through
/// `any_term::bucket_ids`); no (L, L) id tensor is ever made except by the inspection operator
/// `rpe::bucket_ids`. Tensors are read in place when contiguous (else copied once by
/// `.contiguous()`; the attention's q, k, v also when only their last stride is 1, e.g. permuted
/// views of a qkv projection); outputs are fresh tensors.
///
/// dtypes: float32 and float64; bfloat16 and float16 (rpe::bf16 / rpe::f16 storage: computed in
/// float, each output rounded to bf16 / f16 once) for the term, attention, RoPE and timm-table
/// operators; one dtype per call, read from one argument (q; x; tables[0] for the term operators;
/// dtype_rule); tensors of another dtype are a TypeError naming the argument that differs from the
/// dtype most of the call's tensors have (check_one_dtype) and the first one that has it.
///
/// Errors: rpe's `rpe::invalid_argument` / `rpe::out_of_range` (message `[rpe.<component>] ...`)
/// become `c10::ValueError` (Python ValueError), a wrong dtype `c10::TypeError` (TypeError), a
/// tensor not on the CPU a ValueError `[rpe.torch] ...`; nothing is written before the checks.
/// The argument code is shared with the CUDA kernels of the same operators (ops_cuda.cpp, built
/// when torch and nvcc both have CUDA) through ops_common.hpp.
// rpe's headers first: they include the x86 intrinsics headers under their own diagnostics guard
// (rpe/backend/cpu/eigen.hpp: g++ 12's -Wmaybe-uninitialized false positives in AVX-512 intrinsics,
// GCC bug 105593), which has no effect once Torch's headers have included them.
#include <rpe/any_term.hpp>
#include <rpe/make_term.hpp>
#include <rpe/attention.hpp>
#include <rpe/backend/cpu/rope.hpp>
#include <rpe/backend/cpu/term.hpp>
#include <rpe/bf16.hpp>
#include <rpe/f16.hpp>
#include <rpe/caches.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/swin.hpp>
#include <rpe/rope/rotary.hpp>
#include <rpe/vit/swin_bias.hpp>
#include <rpe/vit/alibi_2d.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops_common.hpp"

namespace rpe_torch::ops {
// the one instantiation of each (extern in ops_common.hpp)
template std::unique_ptr<rpe::any_term<float>> make<float>(c10::string_view, c10::string_view, rpe::target, double, double,
                                                           double, int64_t, int64_t, int64_t, bool);
template std::unique_ptr<rpe::any_term<double>> make<double>(c10::string_view, c10::string_view, rpe::target, double, double,
                                                             double, int64_t, int64_t, int64_t, bool);
}  // namespace rpe_torch::ops

namespace {

using namespace rpe_torch::ops;  // the helpers shared with the CUDA kernels (ops_common.hpp)

// torch.bfloat16 tensors are read and written as rpe::bf16 (data_of: the raw pointer): both are
// the upper 16 bits of a binary32 (c10::BFloat16 holds them as its one uint16_t).
static_assert(sizeof(c10::BFloat16) == sizeof(rpe::bf16) && alignof(c10::BFloat16) == alignof(rpe::bf16),
              "c10::BFloat16 and rpe::bf16 must have the same size and alignment (reinterpreted pointers)");
// torch.float16 tensors likewise as rpe::f16: both are IEEE binary16 (c10::Half holds its bits as
// its one uint16_t).
static_assert(sizeof(c10::Half) == sizeof(rpe::f16) && alignof(c10::Half) == alignof(rpe::f16),
              "c10::Half and rpe::f16 must have the same size and alignment (reinterpreted pointers)");

// The dtype of the CPU kernels' first tensor argument `name`: float32, float64, bfloat16 or float16
// (the library's rpe::bf16 / rpe::f16 storage: computed in float, each output rounded to bf16 /
// f16 once; docs/torch.md). Errors: ValueError for an undefined tensor; TypeError for another dtype.
at::ScalarType checked_cpu_type(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf, "[rpe.torch] ", name,
                     " has dtype ", dtype_name(st), "; expected float32, float64, bfloat16 or float16");
    return st;
}

// Runs f.template operator()<S, T>() for the CPU storage type S of st (float, double, rpe::bf16,
// rpe::f16) and the scalar T of the terms that describe the call (S; float for rpe::bf16 and
// rpe::f16: the registry builds float or double terms, whose descriptors the 16-bit kernels run,
// rpe::cpu::term_forward).
template <class F>
decltype(auto) on_cpu_type(at::ScalarType st, F&& f) {
    if (st == at::kDouble) return f.template operator()<double, double>();
    if (st == at::kBFloat16) return f.template operator()<rpe::bf16, float>();
    if (st == at::kHalf) return f.template operator()<rpe::f16, float>();
    return f.template operator()<float, float>();
}

/// term_forward: see the schema in TORCH_LIBRARY below.
template <class S, class T>
at::Tensor term_forward_impl(const c10::optional<at::Tensor>& x_opt, at::TensorList tables_in, c10::string_view method,
                             c10::string_view mode, c10::string_view target, double alpha, double beta, double gamma,
                             int64_t skip, int64_t height, int64_t width, const dtype_rule& st,
                             const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& key_positions) {
    const auto c = setup_term<S, T>(x_opt, tables_in, nullptr, method, mode, target, alpha, beta, gamma, skip, height, width, st,
                                    {}, positions, key_positions);
    at::Tensor out = c.new_output();
    const auto views = crefs<S>(c.tables);
    const auto x = c.contextual ? cref<S>(c.x) : rpe::tensor_ref<const S>{};
    if constexpr (std::is_same_v<S, T>)
        c.term->forward(*c.ids, views, x, mref<S>(out), rpe::write::overwrite);
    else  // bf16 / f16 storage: the float term's descriptor on the 16-bit kernels (float inside, out rounded once)
        rpe::cpu::term_forward<S>(c.term->desc(), *c.ids, views, x, mref<S>(out), rpe::write::overwrite);
    return out;
}

template <class S, class T>
std::vector<at::Tensor> term_backward_impl(const c10::optional<at::Tensor>& x_opt, at::TensorList tables_in,
                                           const at::Tensor& grad_out_in, c10::string_view method, c10::string_view mode,
                                           c10::string_view target, double alpha, double beta, double gamma, int64_t skip,
                                           int64_t height, int64_t width, const dtype_rule& st,
                                           const c10::optional<at::Tensor>& positions,
                                           const c10::optional<at::Tensor>& key_positions) {
    const auto c = setup_term<S, T>(x_opt, tables_in, &grad_out_in, method, mode, target, alpha, beta, gamma, skip, height, width,
                                    st, {}, positions, key_positions);
    std::vector<at::Tensor> result = c.new_gradients();
    std::vector<rpe::tensor_ref<S>> grad_views;
    for (std::size_t i = 1; i < result.size(); ++i) grad_views.push_back(mref<S>(result[i]));
    const auto views = crefs<S>(c.tables);
    const auto x = c.contextual ? cref<S>(c.x) : rpe::tensor_ref<const S>{};
    const auto grad_x = c.contextual ? mref<S>(result[0]) : rpe::tensor_ref<S>{};
    if constexpr (std::is_same_v<S, T>)
        c.term->backward(*c.ids, views, x, cref<S>(c.grad_out), grad_x, grad_views, rpe::write::overwrite);
    else  // bf16 / f16: every sum in float, each gradient rounded once
        rpe::cpu::term_backward<S>(c.term->desc(), *c.ids, views, x, cref<S>(c.grad_out), grad_x, grad_views,
                                   rpe::write::overwrite);
    return result;
}

at::Tensor term_forward(const c10::optional<at::Tensor>& x, at::TensorList tables, c10::string_view method, c10::string_view mode,
                        c10::string_view target, double alpha, double beta, double gamma, int64_t skip, int64_t height,
                        int64_t width, const c10::optional<at::Tensor>& positions,
                        const c10::optional<at::Tensor>& key_positions) {
    return translating([&] {
        TORCH_CHECK_VALUE(!tables.empty(), "[rpe.torch] tables is empty; expected 1 (or 2 for cross) tables");
        const dtype_rule st{checked_cpu_type(tables[0], "tables[0]"), "tables[0]", term_dtypes};
        return on_cpu_type(st, [&]<class S, class T>() {
            return term_forward_impl<S, T>(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width, st,
                                           positions, key_positions);
        });
    });
}

std::vector<at::Tensor> term_backward(const c10::optional<at::Tensor>& x, at::TensorList tables, const at::Tensor& grad_out,
                                      c10::string_view method, c10::string_view mode, c10::string_view target, double alpha,
                                      double beta, double gamma, int64_t skip, int64_t height, int64_t width,
                                      const c10::optional<at::Tensor>& positions,
                                      const c10::optional<at::Tensor>& key_positions) {
    return translating([&] {
        TORCH_CHECK_VALUE(!tables.empty(), "[rpe.torch] tables is empty; expected 1 (or 2 for cross) tables");
        const dtype_rule st{checked_cpu_type(tables[0], "tables[0]"), "tables[0]", term_dtypes};
        return on_cpu_type(st, [&]<class S, class T>() {
            return term_backward_impl<S, T>(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width,
                                            st, positions, key_positions);
        });
    });
}

/// rope_forward / rope_backward: see the schemas in TORCH_LIBRARY below (rpe::rope_forward,
/// rpe::rope_backward).
struct rope_call {
    c10::string_view form;
    at::ArrayRef<double> params;
    const c10::optional<at::Tensor>& freqs;
    int64_t skip, height, width;
    c10::string_view layout;
    const c10::optional<at::Tensor>& positions;
    int64_t suffix;
};

template <class S>
std::vector<at::Tensor> rope_impl(const at::Tensor& x_in, const at::Tensor* grad_y_in, const rope_call& c, const dtype_rule& st) {
    check_one_dtype({{"x", &x_in}, {"freqs", c.freqs ? &*c.freqs : nullptr}, {"grad_y", grad_y_in}}, st.shared);
    const at::Tensor x = prepared(x_in, "x", st);
    auto r = make_rope<S>(c.form, c.params, c.skip, c.layout, c.suffix);
    TORCH_CHECK_VALUE(r.enabled(), "[rpe.torch] rope form = ''; expected ", rope_form_names());
    at::Tensor freqs;
    if (c.freqs && c.freqs->defined()) {
        freqs = prepared(*c.freqs, "freqs", st);
        r.freqs = cref<S>(freqs);
    }
    const at::Tensor positions = prepared_positions(c.positions, "positions");
    if (positions.defined()) r.positions = cref<float>(positions);
    check_grid(c.height, c.width);
    const int height = static_cast<int>(c.height), width = static_cast<int>(c.width);
    at::Tensor out = at::empty(x.sizes(), x.options());
    if (!grad_y_in) {
        rpe::rope_forward<S>(r, height, width, cref<S>(x), mref<S>(out));
        return {out};
    }
    const at::Tensor grad_y = prepared(*grad_y_in, "grad_y", st);
    at::Tensor grad_freqs =
        r.is_mixed() && freqs.defined() ? at::empty(freqs.sizes(), freqs.options()) : at::empty({0}, x.options());
    if (r.is_mixed() && freqs.defined()) r.grad_freqs = mref<S>(grad_freqs);
    rpe::rope_backward<S>(r, height, width, cref<S>(x), cref<S>(grad_y), mref<S>(out));
    return {out, grad_freqs};
}

at::Tensor rope_forward(const at::Tensor& x, c10::string_view form, at::ArrayRef<double> params,
                        const c10::optional<at::Tensor>& freqs, int64_t skip, int64_t height, int64_t width,
                        c10::string_view layout, const c10::optional<at::Tensor>& positions, int64_t suffix) {
    return translating([&] {
        const dtype_rule st{checked_cpu_type(x, "x"), "x", rope_dtypes};
        const rope_call c{form, params, freqs, skip, height, width, layout, positions, suffix};
        return on_cpu_type(st, [&]<class S, class T>() { return rope_impl<S>(x, nullptr, c, st)[0]; });
    });
}

std::vector<at::Tensor> rope_backward(const at::Tensor& x, const at::Tensor& grad_y, c10::string_view form,
                                      at::ArrayRef<double> params, const c10::optional<at::Tensor>& freqs, int64_t skip,
                                      int64_t height, int64_t width, c10::string_view layout,
                                      const c10::optional<at::Tensor>& positions, int64_t suffix) {
    return translating([&] {
        const dtype_rule st{checked_cpu_type(x, "x"), "x", rope_dtypes};
        const rope_call c{form, params, freqs, skip, height, width, layout, positions, suffix};
        return on_cpu_type(st, [&]<class S, class T>() { return rope_impl<S>(x, &grad_y, c, st); });
    });
}

// rope-vit's initial RoPE-Mixed frequencies (rpe::rope::init_mixed_frequencies): (2, H, D/2) float32.
at::Tensor rope_mixed_init(double theta, int64_t head_dim, const at::Tensor& angles_in) {
    return translating([&] {
        const at::Tensor angles =
            prepared(angles_in, "angles", dtype_rule{at::kFloat, nullptr, "rope_mixed_init computes in float32"});
        check_rank(angles, 1, "angles", "(H,) per-head rotations");
        const int d = narrow(head_dim, "head_dim");
        at::Tensor out = at::empty({2, angles.size(0), std::max(d, 0) / 2}, angles.options());
        rpe::rope::init_mixed_frequencies(
            static_cast<float>(theta), d,
            std::span<const float>(angles.data_ptr<float>(), static_cast<std::size_t>(angles.numel())),
            std::span<float>(out.data_ptr<float>(), static_cast<std::size_t>(out.numel())));
        return out;
    });
}

template <class S, class T>
std::vector<at::Tensor> attention_forward_impl(attention_args& a, const dtype_rule& st, bool keep_attn) {
    auto s = setup_attention<S, T>(a, st);
    at::Tensor out = at::empty(a.q.sizes(), a.q.options());  // contiguous (q may be a strided view)
    // (B, H, L, L_k): k may have another length than q (cross-attention)
    at::Tensor attn = keep_attn ? at::empty({a.q.size(0), a.q.size(1), a.q.size(2), a.k.size(2)}, a.q.options()) : at::Tensor();
    rpe::attention_forward<S>(s.in, mref<S>(out), keep_attn ? mref<S>(attn) : rpe::tensor_ref<S>{}, s.opt);
    if (keep_attn) return {out, attn};
    return {out};
}

template <class S, class T>
std::vector<at::Tensor> attention_backward_impl(attention_args& a, const dtype_rule& st) {
    auto s = setup_attention<S, T>(a, st);
    a.grad_out = prepared(a.grad_out, "grad_out", st);
    backward_outputs<S> out(a, s.in);
    auto g = out.grads(a.grad_out);
    if (a.attn.defined()) {  // the forward's probabilities: not recomputed
        a.attn = prepared(a.attn, "attn", st);
        g.saved_attn = cref<S>(a.attn);
    }
    rpe::attention_backward<S>(s.in, g, s.opt);
    return out.result();
}

at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq, at::TensorList tk,
                             at::TensorList tv, c10::string_view spec, at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                             const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                             c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs, at::TensorList indices) {
    return translating([&] {
        auto a = make_attention_args(q, k, v, tq, tk, tv, spec, params, sizes, kpm, am, scale, rope_freqs, indices);
        const dtype_rule st{checked_cpu_type(q, "q"), "q", attention_dtypes};
        return on_cpu_type(st, [&]<class S, class T>() { return attention_forward_impl<S, T>(a, st, false)[0]; });
    });
}

std::vector<at::Tensor> attention_forward_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq,
                                               at::TensorList tk, at::TensorList tv, c10::string_view spec,
                                               at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                                               const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                                               c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs,
                                               at::TensorList indices) {
    return translating([&] {
        auto a = make_attention_args(q, k, v, tq, tk, tv, spec, params, sizes, kpm, am, scale, rope_freqs, indices);
        const dtype_rule st{checked_cpu_type(q, "q"), "q", attention_dtypes};
        return on_cpu_type(st, [&]<class S, class T>() { return attention_forward_impl<S, T>(a, st, true); });
    });
}

std::vector<at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq,
                                           at::TensorList tk, at::TensorList tv, c10::string_view spec,
                                           at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                                           const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                                           c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs,
                                           at::TensorList indices, const at::Tensor& grad_out,
                                           const c10::optional<at::Tensor>& attn) {
    return translating([&] {
        auto a = make_attention_args(q, k, v, tq, tk, tv, spec, params, sizes, kpm, am, scale, rope_freqs, indices);
        a.grad_out = grad_out;
        if (attn) a.attn = *attn;
        const dtype_rule st{checked_cpu_type(q, "q"), "q", attention_dtypes};
        return on_cpu_type(st, [&]<class S, class T>() { return attention_backward_impl<S, T>(a, st); });
    });
}

// ---------------------------------------------------------------------------------------------
// Configuration helpers
// ---------------------------------------------------------------------------------------------

// The mode a family's term has when it has one only (decomposed: contextual); else bias.
const char* natural_mode(c10::string_view method) {
    const std::string name = str(method);
    const auto& info = rpe::family_of(name.substr(0, name.find(':')));
    return info.terms.bias ? "bias" : "contextual";
}

int64_t num_buckets(c10::string_view method, double alpha, double beta, double gamma, int64_t skip) {
    return translating([&] {
        if (const int id = family_id(method); id < 0 || id >= 6) {
            TORCH_CHECK_VALUE(skip >= 0, "[rpe.torch] skip = ", skip, "; expected >= 0");
            const auto term = make<float>(method, natural_mode(method), rpe::target::key, alpha, beta, gamma,
                                          std::min<int64_t>(skip, 1), 1, 1, true);
            return static_cast<int64_t>(term->num_buckets());
        }
        rpe::term_spec spec = irpe_spec(method, alpha, beta, gamma);
        TORCH_CHECK_VALUE(skip >= 0, "[rpe.torch] skip = ", skip, "; expected >= 0");
        spec.skip = static_cast<int>(std::min<int64_t>(skip, 1));
        return static_cast<int64_t>(spec.num_buckets());
    });
}

at::Tensor bucket_ids(c10::string_view method, double alpha, double beta, double gamma, int64_t skip, int64_t height,
                      int64_t width) {
    return translating([&] {
        TORCH_CHECK_VALUE(height >= 1 && width >= 1, "[rpe.torch] height = ", height, ", width = ", width, "; expected >= 1");
        const auto term = make<float>(method, natural_mode(method), rpe::target::key, alpha, beta, gamma, skip, 1, 1, true);
        const auto ids = term->bucket_ids(static_cast<int>(height), static_cast<int>(width));
        const int64_t n = ids->length(), tables = ids->num_tables();
        at::Tensor out = at::empty({tables, n, n}, at::TensorOptions().dtype(at::kInt));
        int32_t* o = out.data_ptr<int32_t>();
        for (int64_t t = 0; t < tables; ++t)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j)
                    o[(t * n + i) * n + j] = ids->at(static_cast<int>(t), static_cast<int>(i), static_cast<int>(j));
        return out;
    });
}

// ---------------------------------------------------------------------------------------------
// ViT tables: timm layout (Swin, BEiT), SwinV2 CPB, SAM decomposed, 2D ALiBi
// ---------------------------------------------------------------------------------------------

// Dispatches f.template operator()<S>(rule) on the dtype of t (float32 / float64), the argument
// `name`; `shared`: which arguments share it (dtype_rule).
template <class F>
decltype(auto) on_dtype(const at::Tensor& t, const char* name, const char* shared, F&& f) {
    const dtype_rule st{checked_float_type(t, name), name, shared};
    return st.st == at::kDouble ? f.template operator()<double>(st) : f.template operator()<float>(st);
}

// rpe::table_from_timm ((K, H) -> (H, K)) or, with to_timm, rpe::table_to_timm.
at::Tensor timm_table(const at::Tensor& in, bool to_timm) {
    return translating([&] {
        const char* name = to_timm ? "table" : "timm_table";
        const dtype_rule st{checked_cpu_type(in, name), name, "one tensor"};
        return on_cpu_type(st, [&]<class S, class T>() {  // bfloat16 and float16 too: a transpose, exact
            const at::Tensor t = prepared(in, name, st);
            check_rank(t, 2, name, to_timm ? "(H, K)" : "(K, H)");
            at::Tensor out = at::empty({t.size(1), t.size(0)}, t.options());
            if (to_timm)
                rpe::table_to_timm<S>(cref<S>(t), mref<S>(out));
            else
                rpe::table_from_timm<S>(cref<S>(t), mref<S>(out));
            return out;
        });
    });
}
at::Tensor table_from_timm(const at::Tensor& timm_table_in) { return timm_table(timm_table_in, false); }
at::Tensor table_to_timm(const at::Tensor& table) { return timm_table(table, true); }

rpe::log_coords parse_log_coords(c10::string_view mode) {
    const std::string_view m(mode.data(), mode.size());
    if (m == "swin") return rpe::log_coords::swin;
    if (m == "cr") return rpe::log_coords::cr;
    TORCH_CHECK_VALUE(false, "[rpe.torch] mode = '", std::string(m), "'; expected swin or cr");
}

// rpe::relative_log_coords: (K, 2) float32.
at::Tensor relative_log_coords(int64_t window_h, int64_t window_w, int64_t pretrained_h, int64_t pretrained_w,
                               c10::string_view mode) {
    return translating([&] {
        const auto c = rpe::relative_log_coords(
            rpe::mapping::swin{.window_h = narrow(window_h, "window_h"), .window_w = narrow(window_w, "window_w")},
            rpe::log_coords_config{.pretrained_h = narrow(pretrained_h, "pretrained_h"),
                                   .pretrained_w = narrow(pretrained_w, "pretrained_w"),
                                   .mode = parse_log_coords(mode)});
        at::Tensor out = at::empty({static_cast<int64_t>(c.size() / 2), 2}, at::TensorOptions().dtype(at::kFloat));
        std::copy(c.begin(), c.end(), out.data_ptr<float>());
        return out;
    });
}

// The rpe::cpb_bias of a window for the MLP output raw (K, H). Its coordinates (the MLP's input,
// relative_log_coords) are not used here: the "cr" recipe, defined on every window, is asked for.
template <class S>
rpe::cpb_bias<S> make_cpb(const at::Tensor& raw, int64_t window_h, int64_t window_w, bool sigmoid16) {
    check_rank(raw, 2, "raw", "(K, H), the CPB MLP's output");
    return rpe::cpb_bias<S>(
        rpe::mapping::swin{.window_h = narrow(window_h, "window_h"), .window_w = narrow(window_w, "window_w")},
        rpe::cpb_config{.num_heads = narrow(raw.size(1), "H"),
                        .head_dim = 1,
                        .sigmoid16 = sigmoid16,
                        .pretrained_h = 0,
                        .pretrained_w = 0,
                        .mode = rpe::log_coords::cr});
}

// cpb_table: the (H, K) table from raw (cpb_bias::make_table); cpb_table_backward: grad_raw.
at::Tensor cpb_table(const at::Tensor& raw_in, int64_t window_h, int64_t window_w, bool sigmoid16) {
    return translating([&] {
        return on_dtype(raw_in, "raw", "one tensor", [&]<class S>(const dtype_rule& st) {
            const at::Tensor raw = prepared(raw_in, "raw", st);
            const auto cpb = make_cpb<S>(raw, window_h, window_w, sigmoid16);
            at::Tensor table = at::empty({cpb.num_heads(), cpb.num_buckets()}, raw.options());
            cpb.make_table(cref<S>(raw), mref<S>(table));
            return table;
        });
    });
}

at::Tensor cpb_table_backward(const at::Tensor& raw_in, const at::Tensor& grad_table_in, int64_t window_h, int64_t window_w,
                              bool sigmoid16) {
    return translating([&] {
        return on_dtype(raw_in, "raw", "raw and grad_table must share one dtype", [&]<class S>(const dtype_rule& st) {
            const at::Tensor raw = prepared(raw_in, "raw", st), grad_table = prepared(grad_table_in, "grad_table", st);
            const auto cpb = make_cpb<S>(raw, window_h, window_w, sigmoid16);
            at::Tensor grad_raw = at::empty_like(raw);
            cpb.backward_table(cref<S>(raw), cref<S>(grad_table), mref<S>(grad_raw), rpe::write::overwrite);
            return grad_raw;
        });
    });
}

// cpb_bias_forward: the (1, H, L, L) bias on the window grid (cpb_bias::forward); backward: grad_raw.
at::Tensor cpb_bias_forward(const at::Tensor& raw_in, int64_t window_h, int64_t window_w, bool sigmoid16) {
    return translating([&] {
        return on_dtype(raw_in, "raw", "one tensor", [&]<class S>(const dtype_rule& st) {
            const at::Tensor raw = prepared(raw_in, "raw", st);
            const auto cpb = make_cpb<S>(raw, window_h, window_w, sigmoid16);
            const auto ids = cpb.bucket_ids();
            at::Tensor out = at::empty({1, cpb.num_heads(), ids->length(), ids->length()}, raw.options());
            cpb.forward(*ids, cref<S>(raw), mref<S>(out), rpe::write::overwrite);
            return out;
        });
    });
}

at::Tensor cpb_bias_backward(const at::Tensor& raw_in, const at::Tensor& grad_out_in, int64_t window_h, int64_t window_w,
                             bool sigmoid16) {
    return translating([&] {
        return on_dtype(raw_in, "raw", "raw and grad_out must share one dtype", [&]<class S>(const dtype_rule& st) {
            const at::Tensor raw = prepared(raw_in, "raw", st), grad_out = prepared(grad_out_in, "grad_out", st);
            const auto cpb = make_cpb<S>(raw, window_h, window_w, sigmoid16);
            at::Tensor grad_raw = at::empty_like(raw);
            cpb.backward(*cpb.bucket_ids(), cref<S>(raw), cref<S>(grad_out), mref<S>(grad_raw), rpe::write::overwrite);
            return grad_raw;
        });
    });
}

// SAM get_rel_pos's resize (rpe::vit::resize_rel_pos) and its backward.
at::Tensor resize_rel_pos(const at::Tensor& rel_pos_in, int64_t length) {
    return translating([&] {
        return on_dtype(rel_pos_in, "rel_pos", "one tensor", [&]<class S>(const dtype_rule& st) {
            const at::Tensor rel_pos = prepared(rel_pos_in, "rel_pos", st);
            check_rank(rel_pos, 2, "rel_pos", "(length, C)");
            TORCH_CHECK_VALUE(length >= 1, "[rpe.torch] length = ", length, "; expected >= 1");
            at::Tensor out = at::empty({length, rel_pos.size(1)}, rel_pos.options());
            rpe::vit::resize_rel_pos<S>(cref<S>(rel_pos), mref<S>(out));
            return out;
        });
    });
}

at::Tensor resize_rel_pos_backward(const at::Tensor& grad_out_in, int64_t in_length) {
    return translating([&] {
        return on_dtype(grad_out_in, "grad_out", "one tensor", [&]<class S>(const dtype_rule& st) {
            const at::Tensor grad_out = prepared(grad_out_in, "grad_out", st);
            check_rank(grad_out, 2, "grad_out", "(length, C)");
            TORCH_CHECK_VALUE(in_length >= 1, "[rpe.torch] in_length = ", in_length, "; expected >= 1");
            at::Tensor grad = at::empty({in_length, grad_out.size(1)}, grad_out.options());
            rpe::vit::resize_rel_pos_backward<S>(cref<S>(grad_out), mref<S>(grad), rpe::write::overwrite);
            return grad;
        });
    });
}

rpe::vit::decomposed_rel_pos_config decomposed_config(int64_t height, int64_t width, int64_t channels, int64_t skip,
                                                      bool unscaled_query) {
    return {.height = narrow(height, "height"),
            .width = narrow(width, "width"),
            .num_heads = 1,
            .head_dim = narrow(channels, "C"),
            .skip = narrow(skip, "skip"),
            .unscaled_query = unscaled_query};
}

// SAM's rel_pos_h (Lh, C), rel_pos_w (Lw, C) -> the decomposed term's two (1, C, K) tables
// (rpe::vit::load_decomposed_rel_pos, resize included).
std::vector<at::Tensor> decomposed_tables(const at::Tensor& h_in, const at::Tensor& w_in, int64_t height, int64_t width,
                                          int64_t skip, bool unscaled_query) {
    return translating([&] {
        return on_dtype(h_in, "rel_pos_h", "rel_pos_h and rel_pos_w must share one dtype", [&]<class S>(const dtype_rule& st) {
            const at::Tensor h = prepared(h_in, "rel_pos_h", st), w = prepared(w_in, "rel_pos_w", st);
            check_rank(h, 2, "rel_pos_h", "(2*height - 1, C) (other lengths are resized)");
            const auto cfg = decomposed_config(height, width, h.size(1), skip, unscaled_query);
            const int64_t k = rpe::vit::decomposed_rel_pos_mapping(cfg.height, cfg.width).num_buckets() + (skip > 0 ? 1 : 0);
            at::Tensor t0 = at::empty({1, h.size(1), k}, h.options()), t1 = at::empty({1, h.size(1), k}, h.options());
            rpe::vit::load_decomposed_rel_pos<S>(cfg, cref<S>(h), cref<S>(w), {mref<S>(t0), mref<S>(t1)});
            return std::vector<at::Tensor>{t0, t1};
        });
    });
}

std::vector<at::Tensor> decomposed_tables_backward(const at::Tensor& g0_in, const at::Tensor& g1_in, int64_t length_h,
                                                   int64_t length_w, int64_t height, int64_t width, int64_t skip,
                                                   bool unscaled_query) {
    return translating([&] {
        return on_dtype(
            g0_in, "grad_tables[0]", "grad_tables[0] and grad_tables[1] must share one dtype",
            [&]<class S>(const dtype_rule& st) {
                const at::Tensor g0 = prepared(g0_in, "grad_tables[0]", st), g1 = prepared(g1_in, "grad_tables[1]", st);
                check_rank(g0, 3, "grad_tables[0]", "(1, C, K)");
                TORCH_CHECK_VALUE(length_h >= 1 && length_w >= 1, "[rpe.torch] length_h = ", length_h, ", length_w = ", length_w,
                                  "; expected >= 1");
                const auto cfg = decomposed_config(height, width, g0.size(1), skip, unscaled_query);
                at::Tensor gh = at::empty({length_h, g0.size(1)}, g0.options()),
                           gw = at::empty({length_w, g0.size(1)}, g0.options());
                rpe::vit::load_decomposed_rel_pos_backward<S>(cfg, {cref<S>(g0), cref<S>(g1)}, mref<S>(gh), mref<S>(gw));
                return std::vector<at::Tensor>{gh, gw};
            });
    });
}

// 2D ALiBi's fixed (H, K) table (rpe::vit::alibi_2d_table) in float32 or float64.
at::Tensor alibi_2d_table(int64_t num_heads, int64_t height, int64_t width, int64_t skip, bool float64) {
    return translating([&] {
        const rpe::vit::alibi_2d_config cfg{.height = narrow(height, "height"),
                                            .width = narrow(width, "width"),
                                            .num_heads = narrow(num_heads, "num_heads"),
                                            .head_dim = 1,
                                            .skip = narrow(skip, "skip")};
        const auto fill = [&]<class S>(at::ScalarType st) {
            const auto t = rpe::vit::alibi_2d_table<S>(cfg);
            at::Tensor out = at::empty({num_heads, static_cast<int64_t>(t.size()) / num_heads}, at::TensorOptions().dtype(st));
            std::copy(t.begin(), t.end(), out.data_ptr<S>());
            return out;
        };
        return float64 ? fill.template operator()<double>(at::kDouble) : fill.template operator()<float>(at::kFloat);
    });
}

// ALiBi's per-head slopes (rpe::vit::alibi_slopes).
std::vector<double> alibi_slopes(int64_t num_heads) {
    return translating([&] { return rpe::vit::alibi_slopes(narrow(num_heads, "num_heads")); });
}

// The registry's mapping families of `group` ("" = every one, a plugin's included): canonical
// names, then (aliases = true) each one's aliases after it.
// The process-wide host caches (bucket ids, RoPE tables): budget and counters (<rpe/caches.hpp>).
void set_cache_budget(int64_t bytes) {
    if (bytes < 0) throw std::invalid_argument("[rpe.torch] bytes = " + std::to_string(bytes) + "; expected >= 0");
    rpe::set_cache_budget(static_cast<std::size_t>(bytes));
}

// [hits, misses, evictions, entries, bytes, budget] of the bucket-id cache, then of the RoPE table cache.
std::vector<int64_t> cache_stats() {
    const rpe::host_cache_stats s = rpe::cache_statistics();
    std::vector<int64_t> out;
    for (const rpe::cache_stats& c : {s.bucket_ids, s.rope_tables})
        for (const std::size_t v : {c.hits, c.misses, c.evictions, c.entries, c.bytes, c.budget})
            out.push_back(static_cast<int64_t>(v));
    return out;
}

void clear_caches() { rpe::clear_caches(); }

std::vector<std::string> families(c10::string_view group, bool aliases) {
    return translating([&] {
        std::vector<std::string> out;
        for (const auto& e : rpe::families().entries()) {
            if (e->info.kind != rpe::family_kind::mapping || (!group.empty() && e->info.group != str(group))) continue;
            out.push_back(e->info.name);
            if (aliases)
                for (const auto& a : e->info.aliases) out.push_back(a.name);
        }
        return out;
    });
}

// The canonical family name of a name or alias (ValueError `[rpe.term_spec] family = ...` if unknown).
std::string family_name(c10::string_view name) {
    return translating([&] { return rpe::families().defaults(str(name)).family; });
}

std::string family_mode(c10::string_view method) {
    return translating([&] { return std::string(natural_mode(method)); });
}

// The registry spec text of a method, alpha, beta, gamma as the term ops read them (rpe::to_string).
std::string family_spec_text(c10::string_view method, double alpha, double beta, double gamma) {
    return translating([&] { return rpe::to_string(spec_of(method, alpha, beta, gamma)); });
}

// The whole spec text (rpe::to_string: every parameter) of a term given by rpe_torch.TermSlot:
// `method` (a family name, alias or spec text "family:param=value,...") with each parameter
// names[i] set from the text values[i] (a number, true / false, a choice name) by the registry,
// then, for a family with the registry's window parameters (window_h, window_w of
// rpe::detail::window_params: 0 = the grid), the window (window_h, window_w) where they are still
// 0. Any other family keeps its own parameters (its defaults, the text's, names / values): the
// window is then only the slot's grid. Returns (the text, the family's window_h, window_w after
// that: the slot's default grid when it has no other; 0, 0 for a family without them). Throws
// ValueError naming the family, parameter and value (`[rpe.term_spec] parameter = 'foo' of
// manhattan; expected one of alpha, beta, gamma`).
std::tuple<std::string, int64_t, int64_t> slot_spec(c10::string_view method, std::vector<std::string> names,
                                                    std::vector<std::string> values, int64_t window_h, int64_t window_w) {
    return translating([&] {
        TORCH_CHECK_VALUE(names.size() == values.size(), "[rpe.torch] names holds ", names.size(), " parameters, values ",
                          values.size(), "; expected one value per name");
        TORCH_CHECK_VALUE(window_h >= 0 && window_w >= 0 && window_h < (1 << 30) && window_w < (1 << 30),
                          "[rpe.torch] window = (", window_h, ", ", window_w, "); expected sides >= 0 (0 = none)");
        auto& reg = rpe::families();
        rpe::family_spec s = rpe::parse_family_spec(str(method));
        for (std::size_t i = 0; i < names.size(); ++i) reg.set_param(s, names[i], values[i]);
        const auto& info = rpe::family_of(s.family);
        const auto has = [&](const char* n) {
            return std::any_of(info.params.begin(), info.params.end(), [&](const auto& p) { return p.name == n; });
        };
        if (!has("window_h") || !has("window_w")) return std::tuple<std::string, int64_t, int64_t>{rpe::to_string(s), 0, 0};
        if (s.get_int("window_h") == 0 && s.get_int("window_w") == 0 && (window_h > 0 || window_w > 0)) {
            reg.set_value(s, "window_h", static_cast<double>(window_h));
            reg.set_value(s, "window_w", static_cast<double>(window_w));
        }
        return std::tuple<std::string, int64_t, int64_t>{rpe::to_string(s), s.get_int("window_h"), s.get_int("window_w")};
    });
}

}  // namespace

TORCH_LIBRARY(rpe, m) {
    // One term (the reference module's own output, before any transpose for q): x (B, H, L, D)
    // for contextual q/k (scaled q or k), (B, H, L, L) probabilities for v, None for bias;
    // tables: [(Ht, K)] bias, [(Ht, D, K)] contextual q/k, [(Ht, K, D)] v; two for cross (rows,
    // cols). Returns (1, Ht, L, L) bias, (B, H, L, L) contextual q/k, (B, H, L, D) v.
    // positions: (N, 2|3) integer per-token positions instead of the grid (L = skip + N; height,
    // width not read), key_positions the keys' (default the queries'); CPU only.
    m.def(
        "term_forward(Tensor? x, Tensor[] tables, str method, str mode, str target, float alpha, float beta, "
        "float gamma, int skip, int height, int width, Tensor? positions=None, Tensor? key_positions=None) -> Tensor");
    // Gradients of sum(out * grad_out): [grad_x (empty for bias), grad_table_0, (grad_table_1)].
    m.def(
        "term_backward(Tensor? x, Tensor[] tables, Tensor grad_out, str method, str mode, str target, float alpha, "
        "float beta, float gamma, int skip, int height, int width, Tensor? positions=None, "
        "Tensor? key_positions=None) -> Tensor[]");
    // The attention step: q (B, H, L, D), k, v (B, H, L_k, D) unscaled (L_k ≠ L on the CPU without terms); the
    // rarely used arguments grouped in lists (fewer arguments: torch.library's autograd layer costs
    // O(arguments²) per call), each taking the defaults of its missing trailing entries
    // (make_attention_args):
    // spec "method_q;mode_q;method_k;mode_k;method_v;mode_v;rope_form;rope_layout" (one string,
    // semicolon-separated: torch.jit.trace takes no str[], names may hold commas; method "" = no term on that slot; default "" each,
    // layout "pairs"); params [] or the 12 term
    // values (alpha, beta, gamma, skip for q, k, v), then the RoPE's params; sizes [height, width,
    // rope_skip, rope_suffix, rope_query_suffix] (default 1, 1, 0, 0, -1); scale: the softmax scale
    // (rpe::attention_options::scale, > 0; None = 1/sqrt(D)), applied by the kernels (q·scale
    // for q·kᵀ and the contextual k term, k·scale for the contextual q term; nothing is copied).
    // indices: the index tensors given (Tensor[]: torch.jit.trace takes no Tensor?[]), each in the
    // slot sizes[5 + i] names (sizes then holds all 5 sizes first): 0 rope_positions,
    // 1 rope_key_positions, 2 rpe_positions, 3 rpe_key_positions, 4 packed_lengths, 5 packed_grids,
    // 6 packed_positions, 7 key_lengths (the others None): the RoPE's
    // per-token positions, and the iRPE terms' index tensors (integer, CPU only, not
    // differentiated; docs/positions.md): rpe_positions, rpe_key_positions (L − skip, 2|3)
    // per-token positions instead of the grid (rpe::attention_inputs::positions, key_positions);
    // packed_lengths (M,) with packed_grids (M, 2|3) or packed_positions (L − M·skip, 2|3): several
    // images in one sequence, each attended alone (attention_inputs::packed; height, width then 0,
    // 0); key_lengths (B,) valid keys per batch element (attention_inputs::key_lengths).
    // rope_query_suffix: the queries' own trailing unrotated tokens (rotary_embedding::query_suffix;
    // -1 = rope_suffix, which then counts the keys' only: SAM2's memory attention passes 0).
    // A value that nothing would read (a mode or params for a slot without a method, alpha, beta,
    // gamma a method does not read, a RoPE setting without rope_form) is a ValueError, not ignored
    // (check_grouped_effects; the registry family's unread values: setup_attention).
    m.def(
        "attention_forward(Tensor q, Tensor k, Tensor v, Tensor[] tables_q, Tensor[] tables_k, Tensor[] tables_v, "
        "str spec, float[] params, int[] sizes, Tensor? key_padding_mask, Tensor? attn_mask, float? scale, "
        "Tensor? rope_freqs, Tensor[] indices) -> Tensor");
    // [out, attn]: attention_forward that also returns the (B, H, L, L_k) probabilities, for
    // attention_backward's `attn` (the backward then does not recompute them).
    m.def(
        "attention_forward_attn(Tensor q, Tensor k, Tensor v, Tensor[] tables_q, Tensor[] tables_k, Tensor[] tables_v, "
        "str spec, float[] params, int[] sizes, Tensor? key_padding_mask, Tensor? attn_mask, float? scale, "
        "Tensor? rope_freqs, Tensor[] indices) -> Tensor[]");
    // [grad_q, grad_k, grad_v, grad tables of q, then k, then v (, grad_rope_freqs for mixed)];
    // attn: attention_forward_attn's probabilities for the same arguments, or None to recompute.
    m.def(
        "attention_backward(Tensor q, Tensor k, Tensor v, Tensor[] tables_q, Tensor[] tables_k, Tensor[] tables_v, "
        "str spec, float[] params, int[] sizes, Tensor? key_padding_mask, Tensor? attn_mask, float? scale, "
        "Tensor? rope_freqs, Tensor[] indices, Tensor grad_out, Tensor? attn=None) -> Tensor[]");
    // 2D RoPE of x (B, H, L, D), L = skip + height*width + suffix (or skip + N + suffix with
    // positions (N, 2), (N, 3) for mrope (t, h, w) and vjepa2 (frame, row, col)): a RoPE form of
    // rpe's registry, its params in the registry's order (axial [theta], mixed [] with freqs
    // (2, H, D/2), cat 8, dinov3 9, mrope 5, vjepa2 [theta], sam2 [theta]; see make_rope); layout
    // "pairs" or "half", "vjepa2" for the form vjepa2 (its only one). Returns the rotated x.
    m.def(
        "rope_forward(Tensor x, str form, float[] params, Tensor? freqs, int skip, int height, int width, "
        "str layout=\"pairs\", Tensor? positions=None, int suffix=0) -> Tensor");
    // [grad_x, grad_freqs (mixed; else empty)] of sum(y * grad_y).
    m.def(
        "rope_backward(Tensor x, Tensor grad_y, str form, float[] params, Tensor? freqs, int skip, int height, "
        "int width, str layout=\"pairs\", Tensor? positions=None, int suffix=0) -> Tensor[]");
    // rope-vit's initial RoPE-Mixed frequencies (2, H, D/2) for per-head angles (H,), float32.
    m.def("rope_mixed_init(float theta, int head_dim, Tensor angles) -> Tensor");
    // timm's (K, H) relative_position_bias_table <-> rpe's (H, K) table.
    m.def("table_from_timm(Tensor timm_table) -> Tensor");
    m.def("table_to_timm(Tensor table) -> Tensor");
    // SwinV2's log-spaced coordinates (K, 2) float32; mode "swin" or "cr"; pretrained 0 = this window.
    m.def("relative_log_coords(int window_h, int window_w, int pretrained_h, int pretrained_w, str mode) -> Tensor",
          &relative_log_coords);
    // SwinV2 CPB: the (H, K) table 16*sigmoid(raw)^T (or raw^T) from the MLP output raw (K, H), its
    // backward (grad_raw), and the (1, H, L, L) bias on the window grid with its backward.
    m.def("cpb_table(Tensor raw, int window_h, int window_w, bool sigmoid16) -> Tensor");
    m.def("cpb_table_backward(Tensor raw, Tensor grad_table, int window_h, int window_w, bool sigmoid16) -> Tensor");
    m.def("cpb_bias_forward(Tensor raw, int window_h, int window_w, bool sigmoid16) -> Tensor");
    m.def("cpb_bias_backward(Tensor raw, Tensor grad_out, int window_h, int window_w, bool sigmoid16) -> Tensor");
    // SAM get_rel_pos's linear resize of a (Lin, C) table to (length, C), and its backward.
    m.def("resize_rel_pos(Tensor rel_pos, int length) -> Tensor");
    m.def("resize_rel_pos_backward(Tensor grad_out, int in_length) -> Tensor");
    // SAM rel_pos_h (Lh, C), rel_pos_w (Lw, C) -> the "decomposed" term's tables [(1, C, K)] x 2,
    // and back (grad_rel_pos_h (length_h, C), grad_rel_pos_w (length_w, C)).
    m.def(
        "decomposed_tables(Tensor rel_pos_h, Tensor rel_pos_w, int height, int width, int skip, bool unscaled_query) "
        "-> Tensor[]");
    m.def(
        "decomposed_tables_backward(Tensor grad_rows, Tensor grad_cols, int length_h, int length_w, int height, "
        "int width, int skip, bool unscaled_query) -> Tensor[]");
    // 2D ALiBi: the fixed (H, K) table of the "alibi" term and the per-head slopes.
    m.def("alibi_2d_table(int num_heads, int height, int width, int skip, bool float64) -> Tensor", &alibi_2d_table);
    m.def("alibi_slopes(int num_heads) -> float[]", &alibi_slopes);
    // rpe's registry of term families (<rpe/families.hpp>; a library loaded with
    // torch.ops.load_library that registers its own mapping adds it): names of a group ("" =
    // all; "irpe" = the reference's four, in the order euclidean, quantization, cross, product),
    // the canonical name of an alias, and the spec text a method with (alpha, beta, gamma) means.
    m.def("families(str group=\"\", bool aliases=False) -> str[]", &families);
    m.def("family_name(str name) -> str", &family_name);
    // "contextual" for a family whose terms are contextual only (decomposed), else "bias".
    m.def("family_mode(str method) -> str", &family_mode);
    m.def("family_spec(str method, float alpha, float beta, float gamma) -> str", &family_spec_text);
    // The whole spec text of a TermSlot's term: method (name, alias or spec text), parameters set
    // by name from their text, the window into the family's window_h / window_w (when still 0).
    m.def("slot_spec(str method, str[] names, str[] values, int window_h=0, int window_w=0) -> (str, int, int)", &slot_spec);
    // The process-wide caches (bucket ids, RoPE tables; default budget 64 MiB each, or the
    // environment's RPE_CACHE_BUDGET_MB): budget in bytes, counters, clear.
    m.def("set_cache_budget(int bytes) -> ()", &set_cache_budget);
    m.def("cache_stats() -> int[]", &cache_stats);
    m.def("clear_caches() -> ()", &clear_caches);
    // K with the extra bucket (skip > 0), as the reference's get_single_rpe_config.
    m.def("num_buckets(str method, float alpha, float beta, float gamma, int skip) -> int", &num_buckets);
    // The (T, L, L) int32 bucket ids (T = 2 for cross), for inspection and tests only.
    m.def("bucket_ids(str method, float alpha, float beta, float gamma, int skip, int height, int width) -> Tensor", &bucket_ids);
}

TORCH_LIBRARY_IMPL(rpe, CPU, m) {
    m.impl("term_forward", &term_forward);
    m.impl("term_backward", &term_backward);
    m.impl("attention_forward", &attention_forward);
    m.impl("attention_forward_attn", &attention_forward_attn);
    m.impl("attention_backward", &attention_backward);
    m.impl("rope_forward", &rope_forward);
    m.impl("rope_backward", &rope_backward);
    m.impl("rope_mixed_init", &rope_mixed_init);
    m.impl("table_from_timm", &table_from_timm);
    m.impl("table_to_timm", &table_to_timm);
    m.impl("cpb_table", &cpb_table);
    m.impl("cpb_table_backward", &cpb_table_backward);
    m.impl("cpb_bias_forward", &cpb_bias_forward);
    m.impl("cpb_bias_backward", &cpb_bias_backward);
    m.impl("resize_rel_pos", &resize_rel_pos);
    m.impl("resize_rel_pos_backward", &resize_rel_pos_backward);
    m.impl("decomposed_tables", &decomposed_tables);
    m.impl("decomposed_tables_backward", &decomposed_tables_backward);
}
