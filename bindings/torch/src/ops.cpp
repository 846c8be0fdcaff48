/// @file ops.cpp
/// @brief PyTorch operators over rpe (`TORCH_LIBRARY(rpe, ...)`, CPU kernels): every iRPE term
/// (bias / contextual on q, k, v, shared or per-head tables, Cross's two tables) forward and
/// backward, and the fused attention step forward and backward. The Python package `rpe_torch`
/// wraps them in torch.autograd.Functions and drop-in modules; docs/torch.md lists the schemas.
///
/// Bucket ids come from the library's shared cache (`rpe::bucket_cache::global()`, through
/// `any_term::bucket_ids`); no (L, L) id tensor is ever made except by the inspection operator
/// `rpe::bucket_ids`. Tensors are read in place when contiguous (else copied once by
/// `.contiguous()`); outputs are fresh tensors.
///
/// Errors: rpe's `rpe::invalid_argument` / `rpe::out_of_range` (message `[rpe.<component>] ...`)
/// become `c10::ValueError` (Python ValueError), a wrong dtype `c10::TypeError` (TypeError), a
/// tensor not on the CPU a ValueError `[rpe.torch] ...`; nothing is written before the checks.
/// This is the only translation unit that includes the Torch headers (compile time).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <rpe/any_term.hpp>
#include <rpe/make_term.hpp>
#include <rpe/attention.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

// Runs f, translating rpe's argument errors into Python ValueError (c10::ValueError).
template <class F>
decltype(auto) translating(F&& f) {
    try {
        return f();
    } catch (const rpe::invalid_argument& e) {
        TORCH_CHECK_VALUE(false, e.what());
    } catch (const rpe::out_of_range& e) {
        TORCH_CHECK_VALUE(false, e.what());
    }
}

std::string shape_of(const at::Tensor& t) {
    std::string s = "(";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + (t.dim() == 1 ? ",)" : ")");
}

// A defined CPU tensor of dtype `want`, contiguous (copied once if it is not).
at::Tensor prepared(const at::Tensor& t, const char* name, at::ScalarType want) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    TORCH_CHECK_VALUE(t.device().is_cpu(), "[rpe.torch] ", name, " is on device ", t.device().str(),
                      "; expected cpu (the rpe_torch operators have CPU kernels only)");
    TORCH_CHECK_TYPE(t.scalar_type() == want, "[rpe.torch] ", name, " has dtype ", c10::toString(t.scalar_type()),
                     "; expected ", c10::toString(want), " (the dtype of the first input)");
    return t.contiguous();
}

at::ScalarType checked_float_type(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble, "[rpe.torch] ", name, " has dtype ", c10::toString(st),
                     "; expected float32 or float64");
    return st;
}

template <class S>
rpe::tensor_ref<const S> cref(const at::Tensor& t) {
    return {t.data_ptr<S>(), std::span<const int64_t>(t.sizes().data(), static_cast<std::size_t>(t.dim()))};
}
template <class S>
rpe::tensor_ref<S> mref(at::Tensor& t) {
    return {t.data_ptr<S>(), std::span<const int64_t>(t.sizes().data(), static_cast<std::size_t>(t.dim()))};
}

void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* expected) {
    TORCH_CHECK_VALUE(t.dim() == rank, "[rpe.torch] ", name, " has shape ", shape_of(t), "; expected ", expected);
}

// The term that (method, mode, target, α, β, γ, skip) describe for inputs of H heads, head dim D;
// shared when the first table has one head.
template <class S>
std::unique_ptr<rpe::any_term<S>> make(c10::string_view method, c10::string_view mode, rpe::target tg, double alpha,
                                       double beta, double gamma, int64_t skip, int64_t heads, int64_t head_dim,
                                       bool shared) {
    rpe::term_spec spec;
    spec.method = rpe::parse_method(std::string_view(method.data(), method.size()));
    spec.contextual = rpe::parse_contextual(std::string_view(mode.data(), mode.size()));
    spec.target = tg;
    spec.alpha = alpha;
    spec.beta = beta;
    spec.gamma = gamma;
    spec.skip = static_cast<int>(skip);
    spec.num_heads = static_cast<int>(heads);
    spec.head_dim = static_cast<int>(head_dim);
    spec.shared_head = shared;
    TORCH_CHECK_VALUE(skip >= 0 && skip < (int64_t{1} << 30), "[rpe.torch] skip = ", skip, "; expected >= 0");
    return rpe::make_term<S>(spec);
}

rpe::target target_of(c10::string_view target) { return rpe::parse_target(std::string_view(target.data(), target.size())); }

// Heads and head dim of a term from its input and first table (shapes checked here, so that the
// library's own checks see well-formed ranks). x is unused (may be undefined) in bias mode.
struct term_dims {
    int64_t heads = 1, head_dim = 1;
    bool shared = true;
};

term_dims dims_of(const at::Tensor& x, at::TensorList tables, bool contextual, rpe::target tg) {
    TORCH_CHECK_VALUE(!tables.empty() && tables.size() <= 2, "[rpe.torch] tables holds ", tables.size(),
                      " tables; expected 1 (or 2 for cross)");
    const at::Tensor& t = tables[0];
    term_dims d;
    if (!contextual) {
        check_rank(t, 2, "tables[0]", "(Ht, K) for bias mode");
        d.heads = t.size(0);
        d.shared = t.size(0) == 1;
        return d;
    }
    const bool value = tg == rpe::target::value;
    check_rank(t, 3, "tables[0]", value ? "(Ht, K, D) for contextual mode on v" : "(Ht, D, K) for contextual mode on q or k");
    TORCH_CHECK_VALUE(x.defined(), "[rpe.torch] x is undefined; contextual mode needs an input");
    check_rank(x, 4, "x", value ? "(B, H, L, L) attention probabilities" : "(B, H, L, D)");
    d.heads = x.size(1);
    d.head_dim = value ? t.size(2) : x.size(3);
    d.shared = t.size(0) == 1;
    return d;
}

template <class S>
std::vector<rpe::tensor_ref<const S>> crefs(const std::vector<at::Tensor>& ts) {
    std::vector<rpe::tensor_ref<const S>> r;
    for (const auto& t : ts) r.push_back(cref<S>(t));
    return r;
}

template <class S>
std::vector<at::Tensor> prepared_tables(at::TensorList tables, const char* name, at::ScalarType st) {
    std::vector<at::Tensor> r;
    for (std::size_t i = 0; i < tables.size(); ++i)
        r.push_back(prepared(tables[i], (std::string(name) + "[" + std::to_string(i) + "]").c_str(), st));
    return r;
}

/// term_forward: see the schema in TORCH_LIBRARY below.
template <class S>
at::Tensor term_forward_impl(const c10::optional<at::Tensor>& x_opt, at::TensorList tables_in, c10::string_view method,
                             c10::string_view mode, c10::string_view target, double alpha, double beta, double gamma,
                             int64_t skip, int64_t height, int64_t width, at::ScalarType st) {
    const rpe::target tg = target_of(target);
    const bool contextual = rpe::parse_contextual(std::string_view(mode.data(), mode.size()));
    at::Tensor x = contextual && x_opt ? prepared(*x_opt, "x", st) : at::Tensor();
    const auto tables = prepared_tables<S>(tables_in, "tables", st);
    const auto d = dims_of(x, tables, contextual, tg);
    const auto term = make<S>(method, mode, tg, alpha, beta, gamma, skip, d.heads, d.head_dim, d.shared);
    TORCH_CHECK_VALUE(height >= 1 && width >= 1, "[rpe.torch] height = ", height, ", width = ", width, "; expected >= 1");
    const auto ids = term->bucket_ids(static_cast<int>(height), static_cast<int>(width));
    const int64_t L = ids->length();
    at::Tensor out;
    if (!contextual)
        out = at::empty({1, tables[0].size(0), L, L}, tables[0].options());
    else if (tg == rpe::target::value)
        out = at::empty({x.size(0), x.size(1), x.size(2), d.head_dim}, x.options());
    else
        out = at::empty({x.size(0), x.size(1), x.size(2), x.size(2)}, x.options());
    const auto views = crefs<S>(tables);
    term->forward(*ids, views, contextual ? cref<S>(x) : rpe::tensor_ref<const S>{}, mref<S>(out), rpe::write::overwrite);
    return out;
}

template <class S>
std::vector<at::Tensor> term_backward_impl(const c10::optional<at::Tensor>& x_opt, at::TensorList tables_in,
                                           const at::Tensor& grad_out_in, c10::string_view method, c10::string_view mode,
                                           c10::string_view target, double alpha, double beta, double gamma, int64_t skip,
                                           int64_t height, int64_t width, at::ScalarType st) {
    const rpe::target tg = target_of(target);
    const bool contextual = rpe::parse_contextual(std::string_view(mode.data(), mode.size()));
    at::Tensor x = contextual && x_opt ? prepared(*x_opt, "x", st) : at::Tensor();
    const auto tables = prepared_tables<S>(tables_in, "tables", st);
    const at::Tensor grad_out = prepared(grad_out_in, "grad_out", st);
    const auto d = dims_of(x, tables, contextual, tg);
    const auto term = make<S>(method, mode, tg, alpha, beta, gamma, skip, d.heads, d.head_dim, d.shared);
    TORCH_CHECK_VALUE(height >= 1 && width >= 1, "[rpe.torch] height = ", height, ", width = ", width, "; expected >= 1");
    const auto ids = term->bucket_ids(static_cast<int>(height), static_cast<int>(width));
    std::vector<at::Tensor> result;
    result.push_back(contextual ? at::empty_like(x) : at::empty({0}, grad_out.options()));
    std::vector<rpe::tensor_ref<S>> grad_views;
    for (const auto& t : tables) result.push_back(at::empty_like(t));
    for (std::size_t i = 1; i < result.size(); ++i) grad_views.push_back(mref<S>(result[i]));
    const auto views = crefs<S>(tables);
    term->backward(*ids, views, contextual ? cref<S>(x) : rpe::tensor_ref<const S>{}, cref<S>(grad_out),
                   contextual ? mref<S>(result[0]) : rpe::tensor_ref<S>{}, grad_views, rpe::write::overwrite);
    return result;
}

at::Tensor term_forward(const c10::optional<at::Tensor>& x, at::TensorList tables, c10::string_view method,
                        c10::string_view mode, c10::string_view target, double alpha, double beta, double gamma,
                        int64_t skip, int64_t height, int64_t width) {
    return translating([&] {
        TORCH_CHECK_VALUE(!tables.empty(), "[rpe.torch] tables is empty; expected 1 (or 2 for cross) tables");
        const auto st = checked_float_type(tables[0], "tables[0]");
        return st == at::kDouble ? term_forward_impl<double>(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width, st)
                                 : term_forward_impl<float>(x, tables, method, mode, target, alpha, beta, gamma, skip, height, width, st);
    });
}

std::vector<at::Tensor> term_backward(const c10::optional<at::Tensor>& x, at::TensorList tables, const at::Tensor& grad_out,
                                      c10::string_view method, c10::string_view mode, c10::string_view target, double alpha,
                                      double beta, double gamma, int64_t skip, int64_t height, int64_t width) {
    return translating([&] {
        TORCH_CHECK_VALUE(!tables.empty(), "[rpe.torch] tables is empty; expected 1 (or 2 for cross) tables");
        const auto st = checked_float_type(tables[0], "tables[0]");
        return st == at::kDouble
                   ? term_backward_impl<double>(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width, st)
                   : term_backward_impl<float>(x, tables, grad_out, method, mode, target, alpha, beta, gamma, skip, height, width, st);
    });
}

// ---------------------------------------------------------------------------------------------
// Fused attention
// ---------------------------------------------------------------------------------------------

struct attention_args {
    at::Tensor q, k, v, grad_out, key_padding_mask, attn_mask;
    std::vector<at::Tensor> tables[3];
    c10::string_view methods[3], modes[3];
    std::vector<double> params;  // per slot: alpha, beta, gamma, skip
    int64_t height = 0, width = 0;
    double scale = 0;
};

template <class S>
struct attention_setup {
    std::unique_ptr<rpe::any_term<S>> terms[3];
    rpe::attention_inputs<S> in;
    double ratio = 1;  // scale / D^-1/2: q and the contextual q tables are multiplied by it
    bool ctx_q = false;
};

// Prepares inputs in place (contiguous, dtype-checked, rescaled) and builds the library's inputs.
template <class S>
attention_setup<S> setup_attention(attention_args& a, at::ScalarType st) {
    static const char* qkv_names[] = {"q", "k", "v"};
    at::Tensor* qkv[] = {&a.q, &a.k, &a.v};
    for (int i = 0; i < 3; ++i) {
        *qkv[i] = prepared(*qkv[i], qkv_names[i], st);
        check_rank(*qkv[i], 4, qkv_names[i], "(B, H, L, D)");
    }
    const int64_t B = a.q.size(0), H = a.q.size(1), L = a.q.size(2), D = a.q.size(3);
    TORCH_CHECK_VALUE(D >= 1, "[rpe.torch] q has shape ", shape_of(a.q), "; expected D >= 1");
    TORCH_CHECK_VALUE(a.params.size() == 12, "[rpe.torch] params holds ", a.params.size(), " values; expected 12");
    TORCH_CHECK_VALUE(std::isfinite(a.scale) && a.scale > 0, "[rpe.torch] scale = ", a.scale, "; expected a positive finite number");
    attention_setup<S> s;
    // The library scales by 1/sqrt(D); another scale multiplies q and the contextual q tables by
    // the ratio. Python's D**-0.5 may differ from 1/sqrt(D) in the last bit: that is the default.
    s.ratio = a.scale / (1.0 / std::sqrt(static_cast<double>(D)));
    if (std::abs(s.ratio - 1.0) <= 4 * std::numeric_limits<double>::epsilon()) s.ratio = 1.0;
    static const char* slot_names[] = {"tables_q", "tables_k", "tables_v"};
    const rpe::target targets[] = {rpe::target::query, rpe::target::key, rpe::target::value};
    rpe::attention_term<S>* slots[] = {&s.in.rpe_q, &s.in.rpe_k, &s.in.rpe_v};
    for (int i = 0; i < 3; ++i) {
        if (a.methods[i].empty()) {
            TORCH_CHECK_VALUE(a.tables[i].empty(), "[rpe.torch] ", slot_names[i], " holds ", a.tables[i].size(),
                              " tables but no method is given for it");
            continue;
        }
        auto& tabs = a.tables[i];
        for (std::size_t t = 0; t < tabs.size(); ++t)
            tabs[t] = prepared(tabs[t], (std::string(slot_names[i]) + "[" + std::to_string(t) + "]").c_str(), st);
        TORCH_CHECK_VALUE(!tabs.empty(), "[rpe.torch] ", slot_names[i], " is empty; expected 1 (or 2 for cross) tables");
        TORCH_CHECK_VALUE(tabs[0].dim() >= 1, "[rpe.torch] ", slot_names[i], "[0] is a scalar; expected a table");
        const double* p = a.params.data() + 4 * i;
        TORCH_CHECK_VALUE(p[3] >= 0 && p[3] < (1 << 30) && p[3] == std::floor(p[3]), "[rpe.torch] skip = ", p[3],
                          " (", slot_names[i], "); expected an integer >= 0");
        s.terms[i] = make<S>(a.methods[i], a.modes[i], targets[i], p[0], p[1], p[2], static_cast<int64_t>(p[3]), H, D,
                             tabs[0].size(0) == 1);
        if (i == 0 && s.terms[i]->contextual() && s.ratio != 1.0) {
            s.ctx_q = true;
            for (auto& t : tabs) t = t * s.ratio;
        }
        slots[i]->term = s.terms[i].get();
        for (const auto& t : tabs) slots[i]->tables.push_back(cref<S>(t));
    }
    if (s.ratio != 1.0) a.q = a.q * s.ratio;
    s.in.q = cref<S>(a.q);
    s.in.k = cref<S>(a.k);
    s.in.v = cref<S>(a.v);
    TORCH_CHECK_VALUE(a.height >= 1 && a.width >= 1 && a.height < (1 << 30) && a.width < (1 << 30), "[rpe.torch] height = ",
                      a.height, ", width = ", a.width, "; expected >= 1");
    s.in.height = static_cast<int>(a.height);
    s.in.width = static_cast<int>(a.width);
    if (a.key_padding_mask.defined()) {
        const auto& m = a.key_padding_mask;
        TORCH_CHECK_VALUE(m.device().is_cpu(), "[rpe.torch] key_padding_mask is on device ", m.device().str(), "; expected cpu");
        TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || m.scalar_type() == at::kByte, "[rpe.torch] key_padding_mask has dtype ",
                         c10::toString(m.scalar_type()), "; expected bool or uint8 (true = padded key)");
        check_rank(m, 2, "key_padding_mask", "(B, L)");
        a.key_padding_mask = m.to(at::kByte).ne(0).to(at::kByte).contiguous();
        s.in.key_padding_mask = cref<std::uint8_t>(a.key_padding_mask);
    }
    if (a.attn_mask.defined()) {
        auto& m = a.attn_mask;
        if (m.scalar_type() == at::kBool) {
            TORCH_CHECK_VALUE(m.device().is_cpu(), "[rpe.torch] attn_mask is on device ", m.device().str(), "; expected cpu");
            m = at::zeros(m.sizes(), a.q.options()).masked_fill(m, -std::numeric_limits<double>::infinity());
        }
        m = prepared(m, "attn_mask", st);
        check_rank(m, 2, "attn_mask", "(L, L)");
        s.in.attn_mask = cref<S>(m);
    }
    (void)B;
    (void)L;
    return s;
}

template <class S>
at::Tensor attention_forward_impl(attention_args& a, at::ScalarType st) {
    auto s = setup_attention<S>(a, st);
    at::Tensor out = at::empty_like(a.q);
    rpe::attention_forward<S>(s.in, mref<S>(out));
    return out;
}

template <class S>
std::vector<at::Tensor> attention_backward_impl(attention_args& a, at::ScalarType st) {
    auto s = setup_attention<S>(a, st);
    a.grad_out = prepared(a.grad_out, "grad_out", st);
    at::Tensor gq = at::empty_like(a.q), gk = at::empty_like(a.k), gv = at::empty_like(a.v);
    std::vector<at::Tensor> result{gq, gk, gv};
    rpe::attention_term<S>* slots[] = {&s.in.rpe_q, &s.in.rpe_k, &s.in.rpe_v};
    for (int i = 0; i < 3; ++i)
        for (auto& t : a.tables[i]) {
            result.push_back(at::empty_like(t));
            slots[i]->grad_tables.push_back(mref<S>(result.back()));
        }
    rpe::attention_backward<S>(s.in, cref<S>(a.grad_out), mref<S>(gq), mref<S>(gk), mref<S>(gv));
    if (s.ratio != 1.0) {
        result[0].mul_(s.ratio);
        if (s.ctx_q)
            for (std::size_t t = 0; t < a.tables[0].size(); ++t) result[3 + t].mul_(s.ratio);
    }
    return result;
}

attention_args make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq, at::TensorList tk,
                         at::TensorList tv, c10::string_view mq, c10::string_view oq, c10::string_view mk, c10::string_view ok,
                         c10::string_view mv, c10::string_view ov, at::ArrayRef<double> params, int64_t height, int64_t width,
                         const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am, double scale) {
    attention_args a;
    a.q = q;
    a.k = k;
    a.v = v;
    a.tables[0] = tq.vec();
    a.tables[1] = tk.vec();
    a.tables[2] = tv.vec();
    a.methods[0] = mq;
    a.methods[1] = mk;
    a.methods[2] = mv;
    a.modes[0] = oq;
    a.modes[1] = ok;
    a.modes[2] = ov;
    a.params = params.vec();
    a.height = height;
    a.width = width;
    if (kpm) a.key_padding_mask = *kpm;
    if (am) a.attn_mask = *am;
    a.scale = scale;
    return a;
}

at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq, at::TensorList tk,
                             at::TensorList tv, c10::string_view mq, c10::string_view oq, c10::string_view mk, c10::string_view ok,
                             c10::string_view mv, c10::string_view ov, at::ArrayRef<double> params, int64_t height, int64_t width,
                             const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am, double scale) {
    return translating([&] {
        auto a = make_args(q, k, v, tq, tk, tv, mq, oq, mk, ok, mv, ov, params, height, width, kpm, am, scale);
        const auto st = checked_float_type(q, "q");
        return st == at::kDouble ? attention_forward_impl<double>(a, st) : attention_forward_impl<float>(a, st);
    });
}

std::vector<at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq,
                                           at::TensorList tk, at::TensorList tv, c10::string_view mq, c10::string_view oq,
                                           c10::string_view mk, c10::string_view ok, c10::string_view mv, c10::string_view ov,
                                           at::ArrayRef<double> params, int64_t height, int64_t width,
                                           const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                                           double scale, const at::Tensor& grad_out) {
    return translating([&] {
        auto a = make_args(q, k, v, tq, tk, tv, mq, oq, mk, ok, mv, ov, params, height, width, kpm, am, scale);
        a.grad_out = grad_out;
        const auto st = checked_float_type(q, "q");
        return st == at::kDouble ? attention_backward_impl<double>(a, st) : attention_backward_impl<float>(a, st);
    });
}

// ---------------------------------------------------------------------------------------------
// Configuration helpers
// ---------------------------------------------------------------------------------------------

int64_t num_buckets(c10::string_view method, double alpha, double beta, double gamma, int64_t skip) {
    return translating([&] {
        rpe::term_spec spec;
        spec.method = rpe::parse_method(std::string_view(method.data(), method.size()));
        spec.alpha = alpha;
        spec.beta = beta;
        spec.gamma = gamma;
        TORCH_CHECK_VALUE(skip >= 0, "[rpe.torch] skip = ", skip, "; expected >= 0");
        spec.skip = static_cast<int>(std::min<int64_t>(skip, 1));
        return static_cast<int64_t>(spec.num_buckets());
    });
}

at::Tensor bucket_ids(c10::string_view method, double alpha, double beta, double gamma, int64_t skip, int64_t height,
                      int64_t width) {
    return translating([&] {
        TORCH_CHECK_VALUE(height >= 1 && width >= 1, "[rpe.torch] height = ", height, ", width = ", width, "; expected >= 1");
        const auto term = make<float>(method, "bias", rpe::target::key, alpha, beta, gamma, skip, 1, 1, true);
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

}  // namespace

TORCH_LIBRARY(rpe, m) {
    // One term (the reference module's own output, before any transpose for q): x (B, H, L, D)
    // for contextual q/k (scaled q or k), (B, H, L, L) probabilities for v, None for bias;
    // tables: [(Ht, K)] bias, [(Ht, D, K)] contextual q/k, [(Ht, K, D)] v; two for cross (rows,
    // cols). Returns (1, Ht, L, L) bias, (B, H, L, L) contextual q/k, (B, H, L, D) v.
    m.def("term_forward(Tensor? x, Tensor[] tables, str method, str mode, str target, float alpha, float beta, "
          "float gamma, int skip, int height, int width) -> Tensor");
    // Gradients of sum(out * grad_out): [grad_x (empty for bias), grad_table_0, (grad_table_1)].
    m.def("term_backward(Tensor? x, Tensor[] tables, Tensor grad_out, str method, str mode, str target, float alpha, "
          "float beta, float gamma, int skip, int height, int width) -> Tensor[]");
    // The attention step: q, k, v (B, H, L, D) unscaled; method_* "" = no term on that slot;
    // params: (alpha, beta, gamma, skip) for q, k, v (12 values).
    m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor[] tables_q, Tensor[] tables_k, Tensor[] tables_v, "
          "str method_q, str mode_q, str method_k, str mode_k, str method_v, str mode_v, float[] params, int height, "
          "int width, Tensor? key_padding_mask, Tensor? attn_mask, float scale) -> Tensor");
    // [grad_q, grad_k, grad_v, grad tables of q, then k, then v].
    m.def("attention_backward(Tensor q, Tensor k, Tensor v, Tensor[] tables_q, Tensor[] tables_k, Tensor[] tables_v, "
          "str method_q, str mode_q, str method_k, str mode_k, str method_v, str mode_v, float[] params, int height, "
          "int width, Tensor? key_padding_mask, Tensor? attn_mask, float scale, Tensor grad_out) -> Tensor[]");
    // K with the extra bucket (skip > 0), as the reference's get_single_rpe_config.
    m.def("num_buckets(str method, float alpha, float beta, float gamma, int skip) -> int", &num_buckets);
    // The (T, L, L) int32 bucket ids (T = 2 for cross), for inspection and tests only.
    m.def("bucket_ids(str method, float alpha, float beta, float gamma, int skip, int height, int width) -> Tensor",
          &bucket_ids);
}

TORCH_LIBRARY_IMPL(rpe, CPU, m) {
    m.impl("term_forward", &term_forward);
    m.impl("term_backward", &term_backward);
    m.impl("attention_forward", &attention_forward);
    m.impl("attention_backward", &attention_backward);
}
