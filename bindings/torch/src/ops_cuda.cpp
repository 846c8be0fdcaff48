/// @file ops_cuda.cpp
/// @brief The CUDA kernels of the rpe_torch operators (`TORCH_LIBRARY_IMPL(rpe, CUDA, m)`), over
/// rpe's CUDA backend: term_forward / term_backward (rpe::cuda::term_forward / term_backward),
/// attention_forward / attention_backward (rpe::cuda::attention_forward / backward, with iRPE
/// terms, masks and 2D RoPE) and rope_forward / rope_backward (rpe::cuda::rope_forward /
/// backward), in float32, float64, float16 and bfloat16 (rpe's storage types; sums in float32,
/// float64 for float64). Built only when torch and nvcc both have CUDA (CMake option
/// RPE_TORCH_CUDA); the library then loads on a machine without a GPU as well.
///
/// Arguments are checked and prepared by the code the CPU kernels use (ops_common.hpp), so a bad
/// argument gets the CPU's exception and message; in addition every tensor must be on the CUDA
/// device most of the operator's tensors are on (ValueError naming the odd one out: `[rpe.torch]
/// x is on device cpu; expected cuda:0, the device of tables[0] (...)`; most on the CPU: `...
/// tables_k[0] is on device cuda:0; expected cpu, the device of q`), q, k, v are made contiguous (the CUDA attention
/// reads no strided views), and the work is enqueued on Torch's current stream of that device
/// (at::cuda::getCurrentCUDAStream) under a device guard; outputs are fresh contiguous tensors
/// there, and nothing waits for the device (except the first upload of a bucket-id or RoPE
/// configuration per device, see docs/cuda.md).
///
/// What rpe's CUDA backend does not have is refused with a Python exception naming it: the
/// probabilities output (`attention_forward_attn`: NotImplementedError) and the backward from
/// saved probabilities (`attn`: ValueError). Keys of another length than the queries (L_k != L)
/// and RoPE's `rope_query_suffix` run as on the CPU (SAM2's memory attention in one call). The iRPE
/// terms' per-token positions (`positions`, `key_positions` of the term operators, `rpe_positions`,
/// `rpe_key_positions` of the attention), packed sequences (`packed_lengths`, `packed_grids`,
/// `packed_positions`) and valid key lengths (`key_lengths`) are integer tensors
/// on the CPU or the operator's device (ValueError naming one on another device, TypeError for a
/// dtype that is not an integer one; converted to int32): the attention passes them to rpe's CUDA
/// attention as they are (device ones are copied to the host there, for the checks, the images'
/// token ranges and the ids; packed sequences run image after image, docs/cuda.md);
/// the term operators copy device positions to the CPU (the ids are built on the host), then rpe's
/// CUDA terms upload the bounding box's per-offset ids and the linear positions (docs/positions.md).
/// The table operators (timm layout, CPB, SAM, rope_mixed_init), small host computations in rpe,
/// run on the CPU with their tensors copied there and back (on_the_host).
/// RoPE per-token positions (`positions`, `rope_positions`, `rope_key_positions`: on the CPU or the
/// operator's device), suffix tokens, mrope and vjepa2 run as rpe's CUDA backend runs them.
///
/// The rpe CUDA calls themselves are in ops_cuda.cu (nvcc), declared by cuda_kernels.hpp: this
/// file is compiled by the host C++ compiler.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda_kernels.hpp"
#include "ops_common.hpp"

namespace {

using namespace rpe_torch::ops;

// The dtype of t for the CUDA kernels: float32, float64, float16 or bfloat16 (TypeError otherwise).
at::ScalarType checked_cuda_float_type(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, "[rpe.torch] ", name,
                     " has dtype ", dtype_name(st), "; expected float32, float64, float16 or bfloat16");
    return st;
}

// Calls f.template operator()<S, T>() with S the CUDA backend's storage type of dtype st
// (float, double, __half, __nv_bfloat16: the same bits as at::Half, at::BFloat16) and T the
// scalar of the terms that describe the slots (double for double, else float; only their
// rpe::term_desc is used).
template <class F>
decltype(auto) on_cuda_dtype(at::ScalarType st, F&& f) {
    switch (st) {
        case at::kDouble: return f.template operator()<double, double>();
        case at::kHalf: return f.template operator()<__half, float>();
        case at::kBFloat16: return f.template operator()<__nv_bfloat16, float>();
        default: return f.template operator()<float, float>();
    }
}

// The device of a CUDA operator, which every tensor argument in `args` must share (checked by
// prepared()): the one most of them are on (a tie goes to the earliest argument's; an undefined
// tensor is skipped), so that the argument named by a mismatch is the odd one out. `index`: the
// integer index tensors, which may also be on the CPU (not counted; a CUDA one still makes the
// call a CUDA call). Errors: ValueError when most arguments are on the CPU, naming the first CUDA
// tensor (`[rpe.torch] tables_k[0] is on device cuda:0; expected cpu, the device of q ...`), or
// when none is a CUDA tensor (the dispatcher calls a CUDA kernel only when some argument is one).
where cuda_device_of(const std::vector<named_tensor>& args, const std::vector<named_tensor>& index = {}) {
    std::vector<std::pair<c10::Device, int>> counts;  // in order of first appearance
    for (const auto& a : args) {
        if (!a.t || !a.t->defined()) continue;
        auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == a.t->device(); });
        if (it == counts.end())
            counts.emplace_back(a.t->device(), 1);
        else
            ++it->second;
    }
    if (!counts.empty()) {
        auto expected = counts.front();
        for (const auto& c : counts)
            if (c.second > expected.second) expected = c;
        const auto first_on = [&](c10::Device d) {
            for (const auto& a : args)
                if (a.t && a.t->defined() && a.t->device() == d) return a.name;
            return std::string();
        };
        if (expected.first.is_cuda()) return where{expected.first, first_on(expected.first)};
        for (const auto* list : {&args, &index})
            for (const auto& a : *list)
                TORCH_CHECK_VALUE(!a.t || !a.t->defined() || !a.t->device().is_cuda(), "[rpe.torch] ", a.name, " is on device ",
                                  a.t->device().str(), "; expected ", expected.first.str(), ", the device of ",
                                  first_on(expected.first), " (the rpe_torch operators do not move tensors between devices)");
    }
    for (const auto& a : index)
        if (a.t && a.t->defined() && a.t->device().is_cuda()) return where{a.t->device(), a.name};
    TORCH_CHECK_VALUE(false, "[rpe.torch] no argument is a CUDA tensor; expected the CUDA kernel's inputs on a CUDA device");
    return {};
}

CUstream_st* current_stream(const where& w) { return at::cuda::getCurrentCUDAStream(w.device.index()).stream(); }

// ---------------------------------------------------------------------------------------------
// Terms
// ---------------------------------------------------------------------------------------------

template <class S, class T>
std::vector<at::Tensor> term_cuda(const c10::optional<at::Tensor>& x, at::TensorList tables, const at::Tensor* grad_out,
                                  c10::string_view method, c10::string_view mode, c10::string_view target, double alpha,
                                  double beta, double gamma, int64_t skip, int64_t height, int64_t width, const dtype_rule& st,
                                  const where& w, const c10::optional<at::Tensor>& positions,
                                  const c10::optional<at::Tensor>& key_positions) {
    // per-token positions: checked (the CPU or w's device, integer), then on the CPU: the term's
    // host ids are built from them (rpe's CUDA term uploads the box's ids and the linear positions)
    const auto on_host = [&](const c10::optional<at::Tensor>& p, const char* name,
                             const char* what) -> c10::optional<at::Tensor> {
        const at::Tensor t = prepared_index(p, name, what, w);
        if (!t.defined()) return c10::nullopt;
        return t.cpu();
    };
    const auto c = setup_term<S, T>(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width, st, w,
                                    on_host(positions, "positions", "per-token iRPE positions"),
                                    on_host(key_positions, "key_positions", "per-token iRPE key positions"));
    const auto views = crefs<S>(c.tables);
    const rpe::tensor_ref<const S> xv = c.contextual ? cref<S>(c.x) : rpe::tensor_ref<const S>{};
    if (!grad_out) {
        at::Tensor out = c.new_output();
        rpe_torch::cuda::term_forward<S>(c.term->desc(), *c.ids, views, xv, mref<S>(out), current_stream(w));
        return {out};
    }
    std::vector<at::Tensor> result = c.new_gradients();
    std::vector<rpe::tensor_ref<S>> grad_views;
    for (std::size_t i = 1; i < result.size(); ++i) grad_views.push_back(mref<S>(result[i]));
    rpe_torch::cuda::term_backward<S>(c.term->desc(), *c.ids, views, xv, cref<S>(c.grad_out),
                                      c.contextual ? mref<S>(result[0]) : rpe::tensor_ref<S>{}, grad_views, current_stream(w));
    return result;
}

std::vector<at::Tensor> term_dispatch(const c10::optional<at::Tensor>& x, at::TensorList tables, const at::Tensor* grad_out,
                                      c10::string_view method, c10::string_view mode, c10::string_view target, double alpha,
                                      double beta, double gamma, int64_t skip, int64_t height, int64_t width,
                                      const c10::optional<at::Tensor>& positions,
                                      const c10::optional<at::Tensor>& key_positions) {
    TORCH_CHECK_VALUE(!tables.empty(), "[rpe.torch] tables is empty; expected 1 (or 2 for cross) tables");
    std::vector<named_tensor> args{{"tables[0]", &tables[0]}, {"x", x ? &*x : nullptr}};  // tables[0] first: the reference
    for (std::size_t i = 1; i < tables.size(); ++i) args.push_back({"tables[" + std::to_string(i) + "]", &tables[i]});
    args.push_back({"grad_out", grad_out});
    const where w = cuda_device_of(
        args, {{"positions", positions ? &*positions : nullptr}, {"key_positions", key_positions ? &*key_positions : nullptr}});
    const dtype_rule st{checked_cuda_float_type(tables[0], "tables[0]"), "tables[0]", term_dtypes};
    const c10::cuda::CUDAGuard guard(w.device);
    return on_cuda_dtype(st, [&]<class S, class T>() {
        return term_cuda<S, T>(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width, st, w,
                               positions, key_positions);
    });
}

at::Tensor term_forward(const c10::optional<at::Tensor>& x, at::TensorList tables, c10::string_view method, c10::string_view mode,
                        c10::string_view target, double alpha, double beta, double gamma, int64_t skip, int64_t height,
                        int64_t width, const c10::optional<at::Tensor>& positions,
                        const c10::optional<at::Tensor>& key_positions) {
    return translating([&] {
        return term_dispatch(x, tables, nullptr, method, mode, target, alpha, beta, gamma, skip, height, width, positions,
                             key_positions)[0];
    });
}

std::vector<at::Tensor> term_backward(const c10::optional<at::Tensor>& x, at::TensorList tables, const at::Tensor& grad_out,
                                      c10::string_view method, c10::string_view mode, c10::string_view target, double alpha,
                                      double beta, double gamma, int64_t skip, int64_t height, int64_t width,
                                      const c10::optional<at::Tensor>& positions,
                                      const c10::optional<at::Tensor>& key_positions) {
    return translating([&] {
        return term_dispatch(x, tables, &grad_out, method, mode, target, alpha, beta, gamma, skip, height, width, positions,
                             key_positions);
    });
}

// ---------------------------------------------------------------------------------------------
// 2D RoPE
// ---------------------------------------------------------------------------------------------

template <class S>
std::vector<at::Tensor> rope_cuda(const at::Tensor& x_in, const at::Tensor* grad_y_in, c10::string_view form,
                                  at::ArrayRef<double> params, const c10::optional<at::Tensor>& freqs_in, int64_t skip,
                                  int64_t height, int64_t width, c10::string_view layout,
                                  const c10::optional<at::Tensor>& positions, int64_t suffix, const dtype_rule& st,
                                  const where& w) {
    check_one_dtype({{"x", &x_in}, {"freqs", freqs_in ? &*freqs_in : nullptr}, {"grad_y", grad_y_in}}, st.shared);
    const at::Tensor x = prepared(x_in, "x", st, w);
    auto r = make_rope<S>(form, params, skip, layout, suffix);
    TORCH_CHECK_VALUE(r.enabled(), "[rpe.torch] rope form = ''; expected ", rope_form_names());
    at::Tensor freqs;
    if (freqs_in && freqs_in->defined()) {
        freqs = prepared(*freqs_in, "freqs", st, w);
        r.freqs = cref<S>(freqs);
    }
    const at::Tensor pos = prepared_positions(positions, "positions", w);  // on the CPU or w's device
    if (pos.defined()) r.positions = cref<float>(pos);
    check_grid(height, width);
    const int h = static_cast<int>(height), wd = static_cast<int>(width);
    at::Tensor out = at::empty(x.sizes(), x.options());
    if (!grad_y_in) {
        rpe_torch::cuda::rope_forward<S>(r, h, wd, cref<S>(x), mref<S>(out), current_stream(w));
        return {out};
    }
    const at::Tensor grad_y = prepared(*grad_y_in, "grad_y", st, w);
    at::Tensor grad_freqs =
        r.is_mixed() && freqs.defined() ? at::empty(freqs.sizes(), freqs.options()) : at::empty({0}, x.options());
    if (r.is_mixed() && freqs.defined()) r.grad_freqs = mref<S>(grad_freqs);
    rpe_torch::cuda::rope_backward<S>(r, h, wd, cref<S>(x), cref<S>(grad_y), mref<S>(out), current_stream(w));
    return {out, grad_freqs};
}

std::vector<at::Tensor> rope_dispatch(const at::Tensor& x, const at::Tensor* grad_y, c10::string_view form,
                                      at::ArrayRef<double> params, const c10::optional<at::Tensor>& freqs, int64_t skip,
                                      int64_t height, int64_t width, c10::string_view layout,
                                      const c10::optional<at::Tensor>& positions, int64_t suffix) {
    const where w = cuda_device_of({{"x", &x}, {"freqs", freqs ? &*freqs : nullptr}, {"grad_y", grad_y}},
                                   {{"positions", positions ? &*positions : nullptr}});
    const dtype_rule st{checked_cuda_float_type(x, "x"), "x", rope_dtypes};
    const c10::cuda::CUDAGuard guard(w.device);
    return on_cuda_dtype(st, [&]<class S, class T>() {
        return rope_cuda<S>(x, grad_y, form, params, freqs, skip, height, width, layout, positions, suffix, st, w);
    });
}

at::Tensor rope_forward(const at::Tensor& x, c10::string_view form, at::ArrayRef<double> params,
                        const c10::optional<at::Tensor>& freqs, int64_t skip, int64_t height, int64_t width,
                        c10::string_view layout, const c10::optional<at::Tensor>& positions, int64_t suffix) {
    return translating(
        [&] { return rope_dispatch(x, nullptr, form, params, freqs, skip, height, width, layout, positions, suffix)[0]; });
}

std::vector<at::Tensor> rope_backward(const at::Tensor& x, const at::Tensor& grad_y, c10::string_view form,
                                      at::ArrayRef<double> params, const c10::optional<at::Tensor>& freqs, int64_t skip,
                                      int64_t height, int64_t width, c10::string_view layout,
                                      const c10::optional<at::Tensor>& positions, int64_t suffix) {
    return translating(
        [&] { return rope_dispatch(x, &grad_y, form, params, freqs, skip, height, width, layout, positions, suffix); });
}

// ---------------------------------------------------------------------------------------------
// Fused attention
// ---------------------------------------------------------------------------------------------

// The CUDA device of the attention's arguments (cuda_device_of: the one most of q, k, v, the
// tables, the masks, the RoPE frequencies, grad_out are on; the index tensors may be on the CPU).
where attention_device(const attention_args& a) {
    std::vector<named_tensor> args = attention_float_tensors(a);
    if (a.attn_mask.defined() && a.attn_mask.scalar_type() == at::kBool) args.push_back({"attn_mask", &a.attn_mask});
    args.push_back({"key_padding_mask", &a.key_padding_mask});
    return cuda_device_of(args, {{"rope_positions", &a.rope_positions},
                                 {"rope_key_positions", &a.rope_key_positions},
                                 {"rpe_positions", &a.rpe_positions},
                                 {"rpe_key_positions", &a.rpe_key_positions},
                                 {"key_lengths", &a.key_lengths},
                                 {"packed_lengths", &a.packed_lengths},
                                 {"packed_grids", &a.packed_grids},
                                 {"packed_positions", &a.packed_positions}});
}

template <class S, class T>
at::Tensor attention_forward_cuda(attention_args& a, const dtype_rule& st, const where& w) {
    auto s = setup_attention<S, T>(a, st, w);
    s.opt.stream = current_stream(w);
    at::Tensor out = at::empty(a.q.sizes(), a.q.options());
    rpe_torch::cuda::attention_forward<S>(s.in, mref<S>(out), s.opt);
    return out;
}

template <class S, class T>
std::vector<at::Tensor> attention_backward_cuda(attention_args& a, const dtype_rule& st, const where& w) {
    auto s = setup_attention<S, T>(a, st, w);
    s.opt.stream = current_stream(w);
    a.grad_out = prepared(a.grad_out, "grad_out", st, w);
    backward_outputs<S> out(a, s.in);
    rpe_torch::cuda::attention_backward<S>(s.in, out.grads(a.grad_out), s.opt);
    return out.result();
}

at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq, at::TensorList tk,
                             at::TensorList tv, c10::string_view spec, at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                             const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                             c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs, at::TensorList indices) {
    return translating([&] {
        auto a = make_attention_args(q, k, v, tq, tk, tv, spec, params, sizes, kpm, am, scale, rope_freqs, indices);
        const where w = attention_device(a);
        const dtype_rule st{checked_cuda_float_type(q, "q"), "q", attention_dtypes};
        const c10::cuda::CUDAGuard guard(w.device);
        return on_cuda_dtype(st, [&]<class S, class T>() { return attention_forward_cuda<S, T>(a, st, w); });
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
        TORCH_CHECK_VALUE(!attn || !attn->defined(),
                          "[rpe.torch] attn (the forward's saved probabilities) is not supported by the cuda backend: rpe's "
                          "CUDA attention keeps no (B, H, L, L) buffer and recomputes them; expected attn = None");
        a.grad_out = grad_out;
        const where w = attention_device(a);
        const dtype_rule st{checked_cuda_float_type(q, "q"), "q", attention_dtypes};
        const c10::cuda::CUDAGuard guard(w.device);
        return on_cuda_dtype(st, [&]<class S, class T>() { return attention_backward_cuda<S, T>(a, st, w); });
    });
}

// attention_forward_attn: refused (rpe's CUDA attention has no probabilities output), after the
// device checks of attention_forward, so that a call dispatched here by one CUDA tensor among CPU
// ones (a CUDA table with CPU q, k, v) names that tensor instead.
std::vector<at::Tensor> attention_forward_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq,
                                               at::TensorList tk, at::TensorList tv, c10::string_view spec,
                                               at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                                               const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                                               c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs,
                                               at::TensorList indices) {
    return translating([&] {
        auto a = make_attention_args(q, k, v, tq, tk, tv, spec, params, sizes, kpm, am, scale, rope_freqs, indices);
        (void)attention_device(a);
        TORCH_CHECK_NOT_IMPLEMENTED(false,
                                    "[rpe.torch] rpe::attention_forward_attn (the attention's probabilities output, "
                                    "rpe_torch.attention(save_attn=True)) is not supported by the cuda backend: rpe's CUDA "
                                    "attention keeps no (B, H, L, L) buffer; use attention_forward (save_attn=False: the "
                                    "backward recomputes the probabilities)");
        return std::vector<at::Tensor>{};
    });
}

// The table operators (timm layout, SwinV2 CPB, SAM resize and tables, rope_mixed_init): rpe
// computes these small tables on the host (O(K·H), docs/cuda.md), so their CUDA kernel is a
// round trip: every CUDA tensor argument is copied to the CPU (which waits for the device), the
// CPU kernel runs (its checks and messages), and every tensor result is copied to the device of
// the first CUDA argument. Boxed: one function for all of them.
void on_the_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const std::size_t n_args = op.schema().arguments().size(), n_out = op.schema().returns().size();
    c10::optional<c10::Device> device;
    const auto to_cpu = [&](const at::Tensor& t) {
        if (!t.defined() || !t.is_cuda()) return t;
        if (!device) device = t.device();
        return t.cpu();
    };
    for (std::size_t i = stack->size() - n_args; i < stack->size(); ++i) {
        c10::IValue& v = (*stack)[i];
        if (v.isTensor()) {
            v = to_cpu(v.toTensor());
        } else if (v.isTensorList()) {
            c10::List<at::Tensor> list;
            for (const at::Tensor& t : v.toTensorList()) list.push_back(to_cpu(t));
            v = list;
        }
    }
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    if (!device) return;
    for (std::size_t i = stack->size() - n_out; i < stack->size(); ++i) {
        c10::IValue& v = (*stack)[i];
        if (v.isTensor()) {
            v = v.toTensor().to(*device);
        } else if (v.isTensorList()) {
            c10::List<at::Tensor> list;
            for (const at::Tensor& t : v.toTensorList()) list.push_back(t.to(*device));
            v = list;
        }
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(rpe, CUDA, m) {
    m.impl("term_forward", &term_forward);
    m.impl("term_backward", &term_backward);
    m.impl("attention_forward", &attention_forward);
    m.impl("attention_backward", &attention_backward);
    m.impl("rope_forward", &rope_forward);
    m.impl("rope_backward", &rope_backward);
    m.impl("attention_forward_attn", &attention_forward_attn);
    for (const char* name :
         {"rope_mixed_init", "table_from_timm", "table_to_timm", "cpb_table", "cpb_table_backward", "cpb_bias_forward",
          "cpb_bias_backward", "resize_rel_pos", "resize_rel_pos_backward", "decomposed_tables", "decomposed_tables_backward"})
        m.impl(name, torch::CppFunction::makeFromBoxedFunction<&on_the_host>());
}
