/// @file ops_common.hpp
/// @brief What the rpe_torch operators' CPU kernels (ops.cpp) and CUDA kernels (ops_cuda.cpp)
/// share: the translation of rpe's errors into Python exceptions, the checks and preparation of
/// tensor arguments (device, dtype, 32-bit sizes, contiguity), the views the library reads
/// (rpe::tensor_ref), the terms that (method, mode, target, alpha, beta, gamma, skip) describe,
/// RoPE from its form and parameters, and the setup of the fused attention's inputs. One code
/// path, so that a bad argument gets the same exception and message from either device.
///
/// The floating tensors of a call are first checked together (check_one_dtype): tensors of
/// different dtypes are a TypeError naming the one that differs from the dtype most of them have
/// (a tie: the reference argument's) and the first one that has it, e.g. `[rpe.torch] k has dtype
/// torch.float64 but q has torch.float32; q, k, v, ... must share one dtype`. Then tensors go
/// through `prepared(t, name, dtype_rule, where)`, which checks each against the call's dtype
/// (read from one argument, `dtype_rule::ref`) with the same message. On the CPU (the default `where`) a tensor
/// on another device is a ValueError `[rpe.torch] <name> is on device <d>; expected cpu (...)`;
/// for a CUDA operator every tensor must be on the device of its first tensor argument
/// (`where::first`), else `[rpe.torch] <name> is on device cpu; expected cuda:0, the device of q
/// (...)`. Internal to bindings/torch (namespace rpe_torch::ops).
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include <rpe/any_term.hpp>
#include <rpe/attention_inputs.hpp>
#include <rpe/build_bucket_ids.hpp>
#include <rpe/families.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rope/rotary.hpp>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace rpe_torch::ops {

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

inline std::string shape_of(const at::Tensor& t) { return rpe::detail::shape_string(t.sizes()); }

// Every dimension of t fits the kernels' 32-bit indices (grid sides, lengths, heads, head dims);
// checked before any copy, so an expanded view with a huge size fails without allocating.
inline void check_int32_sizes(const at::Tensor& t, const char* name) {
    for (int64_t i = 0; i < t.dim(); ++i)
        TORCH_CHECK_VALUE(t.size(i) <= INT_MAX, "[rpe.torch] ", name, " has shape ", shape_of(t),
                          "; expected every dimension <= 2147483647 (the kernels index with 32-bit ints)");
}

// Where an operator's tensors must be: on the CPU (the CPU kernels, the default), or on the CUDA
// device of its first tensor argument `first` (the CUDA kernels, bindings/torch/src/ops_cuda.cpp).
struct where {
    c10::Device device = c10::Device(c10::kCPU);
    std::string first;  // the argument whose device the others must share ("q", "x", "tables_k[0]")
};

// t is on w's device, or a ValueError naming `name`, its device and the expected one.
inline void check_device(const at::Tensor& t, const char* name, const where& w) {
    if (w.device.is_cpu()) {
        TORCH_CHECK_VALUE(t.device().is_cpu(), "[rpe.torch] ", name, " is on device ", t.device().str(),
                          "; expected cpu (the rpe_torch operators have CPU kernels only)");
        return;
    }
    TORCH_CHECK_VALUE(t.device() == w.device, "[rpe.torch] ", name, " is on device ", t.device().str(), "; expected ",
                      w.device.str(), ", the device of ", w.first,
                      " (the rpe_torch operators do not move tensors between devices)");
}

// The dtype st as torch names it ("torch.float32", "torch.bfloat16"), for messages (as Python
// prints tensor.dtype, so that the C++ and Python checks read alike).
inline std::string dtype_name(at::ScalarType st) {
    switch (st) {
        case at::kFloat: return "torch.float32";
        case at::kDouble: return "torch.float64";
        case at::kHalf: return "torch.float16";
        case at::kBFloat16: return "torch.bfloat16";
        case at::kByte: return "torch.uint8";
        case at::kChar: return "torch.int8";
        case at::kShort: return "torch.int16";
        case at::kInt: return "torch.int32";
        case at::kLong: return "torch.int64";
        case at::kBool: return "torch.bool";
        case at::kComplexFloat: return "torch.complex64";
        case at::kComplexDouble: return "torch.complex128";
        case at::kComplexHalf: return "torch.complex32";
        case at::kUInt16: return "torch.uint16";
        case at::kUInt32: return "torch.uint32";
        case at::kUInt64: return "torch.uint64";
        default: {  // c10's name in lower case ("Float8_e4m3fn": "torch.float8_e4m3fn"), as torch prints most
            std::string name = c10::toString(st);
            for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            return "torch." + name;
        }
    }
}

// The dtype that every floating-point tensor argument of one operator call must have: `st`, read
// from the argument `ref` ("q", "x", "tables[0]", "raw"; null: a fixed dtype), and `shared`, which
// arguments share it and why, for the TypeError of prepared(). Converts to st.
struct dtype_rule {
    at::ScalarType st;
    const char* ref;                                // the argument st was read from, or null for a fixed dtype
    const char* shared;                             // e.g. "x, the tables and grad_out must share one dtype"
    operator at::ScalarType() const { return st; }  // NOLINT(google-explicit-constructor): st where a dtype is wanted
};

// What dtype_rule::shared says for each operator family (docs/torch.md, "Errors").
inline constexpr const char* attention_dtypes =
    "q, k, v, the tables, a float attn_mask, rope_freqs, grad_out and attn must share one dtype";
inline constexpr const char* term_dtypes = "x, the tables and grad_out must share one dtype";
inline constexpr const char* rope_dtypes = "x, freqs and grad_y must share one dtype";

// One floating tensor argument of an operator call, by name, for check_one_dtype (null or
// undefined: not given).
struct named_tensor {
    std::string name;
    const at::Tensor* t;
};

// The dtypes the operators' kernels compute in: float32, float64, bfloat16, float16.
inline bool kernel_float(at::ScalarType st) {
    return st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf;
}

// The floating tensors of one operator call (`args`, in argument order, the argument the call's
// dtype is read from first: q, x, tables[0]) have one dtype, or a TypeError naming the argument
// that differs: the expected dtype is the one most of them have (float32, float64, bfloat16 or
// float16; a tie goes to the earliest argument's), and the first argument of another dtype is
// named with the first one of the expected dtype (`[rpe.torch] q has dtype torch.float64 but k
// has torch.float32; ...` when k and v are float32 and q alone is float64). Called before any
// tensor is prepared, so that the argument named is the odd one out, not whichever is checked
// after the reference (prepared() then finds them all alike).
inline void check_one_dtype(const std::vector<named_tensor>& args, const char* shared) {
    std::vector<std::pair<at::ScalarType, int>> counts;  // in order of first appearance
    bool mixed = false;
    const at::Tensor* first = nullptr;
    for (const auto& a : args) {
        if (!a.t || !a.t->defined()) continue;
        const auto st = a.t->scalar_type();
        if (first && st != first->scalar_type()) mixed = true;
        if (!first) first = a.t;
        if (!kernel_float(st)) continue;  // never the expected dtype: named if it differs
        auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == st; });
        if (it == counts.end())
            counts.emplace_back(st, 1);
        else
            ++it->second;
    }
    if (!mixed || counts.empty()) return;
    auto expected = counts.front();
    for (const auto& c : counts)
        if (c.second > expected.second) expected = c;
    const named_tensor *odd = nullptr, *ref = nullptr;
    for (const auto& a : args) {
        if (!a.t || !a.t->defined()) continue;
        if (a.t->scalar_type() == expected.first) {
            if (!ref) ref = &a;
        } else if (!odd) {
            odd = &a;
        }
    }
    TORCH_CHECK_TYPE(false, "[rpe.torch] ", odd->name, " has dtype ", dtype_name(odd->t->scalar_type()), " but ", ref->name,
                     " has ", dtype_name(expected.first), "; ", shared);
}

// A defined tensor of dtype `want` on the device of `w` (the CPU by default), contiguous (copied
// once if it is not). Errors: ValueError naming `name` and its device (another device than the
// operator's: the operators never move tensors between devices); TypeError for another dtype,
// naming `name`, its dtype, the argument the call's dtype was read from and its dtype, and which
// arguments must share it (`[rpe.torch] k has dtype torch.float64 but q has torch.float32; q, k,
// v, ... must share one dtype`).
inline at::Tensor prepared(const at::Tensor& t, const char* name, const dtype_rule& want, const where& w = {}) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    check_device(t, name, w);
    if (want.ref) {
        TORCH_CHECK_TYPE(t.scalar_type() == want.st, "[rpe.torch] ", name, " has dtype ", dtype_name(t.scalar_type()), " but ",
                         want.ref, " has ", dtype_name(want.st), "; ", want.shared);
    } else {
        TORCH_CHECK_TYPE(t.scalar_type() == want.st, "[rpe.torch] ", name, " has dtype ", dtype_name(t.scalar_type()),
                         "; expected ", dtype_name(want.st), " (", want.shared, ")");
    }
    check_int32_sizes(t, name);
    return t.contiguous();
}

// q, k or v of the attention: as prepared(), but a strided tensor whose rows of D values are
// contiguous (last stride 1, e.g. a permuted view of a qkv projection) is read in place.
// The CUDA kernels read contiguous q, k, v only (rpe::cuda::attention_caps): there, as prepared().
inline at::Tensor prepared_rows(const at::Tensor& t, const char* name, const dtype_rule& want, const where& w = {}) {
    if (w.device.is_cpu() && t.defined() && t.device().is_cpu() && t.scalar_type() == want.st &&
        (t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) == 1)) {
        check_int32_sizes(t, name);
        return t;
    }
    return prepared(t, name, want, w);
}

inline at::ScalarType checked_float_type(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.defined(), "[rpe.torch] ", name, " is undefined; expected a tensor");
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble, "[rpe.torch] ", name, " has dtype ", dtype_name(st),
                     "; expected float32 or float64");
    return st;
}

// The data of t as S: float and double through data_ptr<S>() (dtype-checked); any other S (the
// CUDA storage types __half, __nv_bfloat16 over at::Half, at::BFloat16, the same bits) as the
// raw pointer, the dtype checked before by prepared().
template <class S>
S* data_of(const at::Tensor& t) {
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double> || std::is_same_v<S, std::uint8_t>)
        return t.data_ptr<S>();
    else
        return static_cast<S*>(t.data_ptr());
}

template <class S>
rpe::tensor_ref<const S> cref(const at::Tensor& t) {
    return {data_of<S>(t), std::span<const int64_t>(t.sizes().data(), static_cast<std::size_t>(t.dim()))};
}
// A view with the tensor's own strides (the attention's q, k, v; see prepared_rows).
template <class S>
rpe::tensor_ref<const S> sref(const at::Tensor& t) {
    if (t.is_contiguous()) return cref<S>(t);
    return rpe::tensor_ref<const S>::with_strides(
        data_of<S>(t), std::span<const int64_t>(t.sizes().data(), static_cast<std::size_t>(t.dim())),
        std::span<const int64_t>(t.strides().data(), static_cast<std::size_t>(t.dim())));
}
template <class S>
rpe::tensor_ref<S> mref(at::Tensor& t) {
    return {data_of<S>(t), std::span<const int64_t>(t.sizes().data(), static_cast<std::size_t>(t.dim()))};
}

inline void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* expected) {
    TORCH_CHECK_VALUE(t.dim() == rank, "[rpe.torch] ", name, " has shape ", shape_of(t), "; expected ", expected);
}

// An int64 argument narrowed to int, or a ValueError naming it (the library then checks its range).
inline int narrow(int64_t v, const char* name) {
    TORCH_CHECK_VALUE(v >= INT_MIN && v <= INT_MAX, "[rpe.torch] ", name, " = ", v, "; expected a 32-bit integer");
    return static_cast<int>(v);
}

inline std::string str(c10::string_view v) { return std::string(v.data(), v.size()); }

// The registry spec of a method: a family name or alias of rpe's registry (<rpe/families.hpp>, a
// plugin's included) whose first number / integer parameters take (alpha, beta, gamma) in order
// (iRPE: alpha, beta, gamma; swin, beit: the window rows, columns; decomposed, alibi2d: the grid;
// a user's family: its own), or a whole spec text "family:param=value,..." (alpha, beta, gamma
// then unused). Integer parameters of the ViT families are checked here with the torch message.
inline rpe::family_spec spec_of(c10::string_view method, double alpha, double beta, double gamma) {
    const std::string name = str(method);
    if (name.find(':') != std::string::npos) return rpe::parse_family_spec(name);
    auto& reg = rpe::families();
    rpe::family_spec s = reg.defaults(name);
    const auto& info = rpe::family_of(name);
    const double v[3] = {alpha, beta, gamma};
    const char* names[3] = {"alpha", "beta", "gamma"};
    int n = 0;
    for (const auto& p : info.params) {
        if (n == 3) break;
        if (p.type != rpe::family_param::kind::number && p.type != rpe::family_param::kind::integer) continue;
        if (p.type == rpe::family_param::kind::integer)
            TORCH_CHECK_VALUE(
                std::isfinite(v[n]) && v[n] == std::floor(v[n]) && std::fabs(v[n]) <= (1 << 30), "[rpe.torch] ", names[n], " = ",
                v[n], " (method '", name, "', ",
                info.group == "vit" ? (n == 0 ? "the window or grid rows" : "the window or grid columns") : "parameter " + p.name,
                "); expected an integer");
        reg.set_value(s, p.name, v[n]);
        ++n;
    }
    return s;
}

// The term that (method, mode, target, α, β, γ, skip) describe for inputs of H heads, head dim D;
// shared when the first table has one head. Every family through the registry: the iRPE methods
// as rpe::term_spec (the reference's checks), the others by rpe::make_term(family_spec); the
// families of group "vit" in their one mode (decomposed: contextual; the others: bias) on k.
// The built-in family of a method (rpe::builtin_family; < 6: an iRPE method), -1 for a plugin's.
inline int family_id(c10::string_view method) {
    const std::string n = str(method);
    return rpe::builtin_of(n.find(':') == std::string::npos ? rpe::families().defaults(n) : rpe::parse_family_spec(n));
}

// The term_spec of an iRPE method (family_id < 6): alpha, beta, gamma as given (term_spec checks
// them), or from the spec text "product:index=clip,beta=4".
inline rpe::term_spec irpe_spec(c10::string_view method, double alpha, double beta, double gamma) {
    rpe::term_spec spec;
    spec.method = static_cast<rpe::method>(family_id(method));
    spec.alpha = alpha;
    spec.beta = beta;
    spec.gamma = gamma;
    if (str(method).find(':') != std::string::npos) {
        const auto f = rpe::parse_family_spec(str(method));
        spec.index = f.get_int("index") == 1 ? rpe::index_kind::clip : rpe::index_kind::piecewise;
        spec.alpha = f.get("alpha");
        spec.beta = f.get("beta");
        spec.gamma = f.get("gamma");
    }
    return spec;
}

// The names of the parameters that a method named in the registry (no spec text) takes from
// (alpha, beta, gamma), in that order (spec_of): all three for an iRPE method, else the family's
// first number / integer parameters, at most 3 (e.g. "swin": window_h, window_w).
inline std::vector<std::string> term_values_read(c10::string_view method) {
    if (const int id = family_id(method); id >= 0 && id < 6) return {"alpha", "beta", "gamma"};
    std::vector<std::string> names;
    for (const auto& p : rpe::family_of(str(method)).params)
        if (names.size() < 3 && (p.type == rpe::family_param::kind::number || p.type == rpe::family_param::kind::integer))
            names.push_back(p.name);
    return names;
}

template <class S>
std::unique_ptr<rpe::any_term<S>> make(c10::string_view method, c10::string_view mode, rpe::target tg, double alpha, double beta,
                                       double gamma, int64_t skip, int64_t heads, int64_t head_dim, bool shared) {
    TORCH_CHECK_VALUE(skip >= 0 && skip < (int64_t{1} << 30), "[rpe.torch] skip = ", skip, "; expected >= 0");
    const bool contextual = rpe::parse_contextual(std::string_view(mode.data(), mode.size()));
    if (const int id = family_id(method); id >= 0 && id < 6) {  // alpha, beta, gamma as given: term_spec checks them
        rpe::term_spec spec = irpe_spec(method, alpha, beta, gamma);
        spec.contextual = contextual;
        spec.target = tg;
        spec.skip = static_cast<int>(skip);
        spec.num_heads = static_cast<int>(heads);
        spec.head_dim = static_cast<int>(head_dim);
        spec.shared_head = shared;
        return rpe::make_term<S>(spec);
    }
    const rpe::family_spec f = spec_of(method, alpha, beta, gamma);
    const auto& info = rpe::family_of(f.family);
    if (info.group == "vit") {
        const bool want_contextual = !info.terms.bias;
        TORCH_CHECK_VALUE(contextual == want_contextual && tg == rpe::target::key, "[rpe.torch] method = '", str(method),
                          "' with mode = ", contextual ? "contextual" : "bias", ", target = ", rpe::target_letter(tg),
                          "; expected mode = ", want_contextual ? "contextual" : "bias", " on k");
    }
    const rpe::term_options o{.contextual = contextual,
                              .target = tg,
                              .num_heads = narrow(heads, "num_heads"),
                              .head_dim = narrow(head_dim, "head_dim"),
                              .shared_head = shared,
                              .skip = static_cast<int>(skip)};
    return rpe::make_term<S>(f, o);
}

// make<float> and make<double> are instantiated once, in ops.cpp (rpe::make_term is costly to compile).
extern template std::unique_ptr<rpe::any_term<float>> make<float>(c10::string_view, c10::string_view, rpe::target, double, double,
                                                                  double, int64_t, int64_t, int64_t, bool);
extern template std::unique_ptr<rpe::any_term<double>> make<double>(c10::string_view, c10::string_view, rpe::target, double,
                                                                    double, double, int64_t, int64_t, int64_t, bool);

inline rpe::target target_of(c10::string_view target) {
    return rpe::parse_target(std::string_view(target.data(), target.size()));
}

// Heads and head dim of a term from its input and first table (shapes checked here, so that the
// library's own checks see well-formed ranks). x is unused (may be undefined) in bias mode.
struct term_dims {
    int64_t heads = 1, head_dim = 1;
    bool shared = true;
};

inline term_dims dims_of(const at::Tensor& x, at::TensorList tables, bool contextual, rpe::target tg) {
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
    check_rank(x, 4, "x", value ? "(B, H, L, L_k) attention probabilities" : "(B, H, L, D), or (B, H, L_k, D) for q");
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
std::vector<at::Tensor> prepared_tables(at::TensorList tables, const char* name, const dtype_rule& st, const where& w = {}) {
    std::vector<at::Tensor> r;
    for (std::size_t i = 0; i < tables.size(); ++i)
        r.push_back(prepared(tables[i], (std::string(name) + "[" + std::to_string(i) + "]").c_str(), st, w));
    return r;
}

// An integer index tensor of the iRPE terms (per-token positions, packed lengths / grids /
// positions, valid key lengths): undefined when not given, else the contiguous int32 tensor the
// library reads (rpe::attention_inputs::positions, packed, key_lengths; shapes and values are
// the library's checks, with its own messages): on the CPU, or for a CUDA operator (w on a CUDA
// device) on the CPU or w's device as given (rpe's CUDA attention copies device ones to the host
// for its checks). Errors: a tensor on
// another device a ValueError; a dtype other than int32 and int64 a TypeError (unsigned and
// narrower integers too, as rpe_torch's own check); values outside int32 a ValueError.
inline at::Tensor prepared_index(const c10::optional<at::Tensor>& p, const char* name, const char* what, const where& w = {}) {
    if (!p || !p->defined()) return {};
    const at::Tensor& t = *p;
    TORCH_CHECK_VALUE(t.device().is_cpu() || (!w.device.is_cpu() && t.device() == w.device), "[rpe.torch] ", name,
                      " is on device ", t.device().str(), "; expected cpu", w.device.is_cpu() ? "" : " or ",
                      w.device.is_cpu() ? "" : w.device.str(), " (", what, " are read on the host)");
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kInt || st == at::kLong, "[rpe.torch] ", name, " has dtype ", dtype_name(st),
                     "; expected an integer tensor (int32 or int64) of ", what);
    check_int32_sizes(t, name);
    if (st != at::kInt && t.numel() > 0) {
        const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
        TORCH_CHECK_VALUE(lo >= INT_MIN && hi <= INT_MAX, "[rpe.torch] ", name, " holds values in [", lo, ", ", hi,
                          "]; expected 32-bit integers");
    }
    return t.to(at::kInt).contiguous();
}

// The prepared arguments of a term operator (term_forward, term_backward): x (undefined in bias
// mode), the tables, grad_out (backward), the term (scalar T: S on the CPU; see attention_setup)
// and its bucket ids from the shared cache.
template <class T>
struct term_call {
    rpe::target tg = rpe::target::key;
    bool contextual = false;
    at::Tensor x, grad_out;
    std::vector<at::Tensor> tables;
    at::Tensor positions, key_positions;  // int32 (N, 2|3), or undefined: the grid
    term_dims d;
    std::unique_ptr<rpe::any_term<T>> term;
    std::shared_ptr<const rpe::bucket_ids> ids;

    // The forward's output, fresh and contiguous: (1, Ht, L, L_k) bias, (B, H, L, D) contextual v,
    // (B, H, L, L_k) contextual q / k (L_k = L unless key_positions of another count).
    [[nodiscard]] at::Tensor new_output() const {
        const int64_t L = ids->length(), Lk = ids->key_length();
        if (!contextual) return at::empty({1, tables[0].size(0), L, Lk}, tables[0].options());
        if (tg == rpe::target::value) return at::empty({x.size(0), x.size(1), x.size(2), d.head_dim}, x.options());
        return at::empty({x.size(0), x.size(1), L, Lk}, x.options());
    }
    // The backward's outputs, fresh: [grad_x (empty (0,) in bias mode), grad of each table].
    [[nodiscard]] std::vector<at::Tensor> new_gradients() const {
        std::vector<at::Tensor> result;
        result.push_back(contextual ? at::empty_like(x) : at::empty({0}, grad_out.options()));
        for (const auto& t : tables) result.push_back(at::empty_like(t));
        return result;
    }
};

// Checks and prepares a term operator's arguments (grad_out_in: the backward's, or null for the
// forward) on w's device, in this order: x, tables, grad_out, shapes, the term's configuration,
// the grid.
template <class S, class T = S>
term_call<T> setup_term(const c10::optional<at::Tensor>& x_opt, at::TensorList tables_in, const at::Tensor* grad_out_in,
                        c10::string_view method, c10::string_view mode, c10::string_view target, double alpha, double beta,
                        double gamma, int64_t skip, int64_t height, int64_t width, const dtype_rule& st, const where& w = {},
                        const c10::optional<at::Tensor>& positions = c10::nullopt,
                        const c10::optional<at::Tensor>& key_positions = c10::nullopt) {
    term_call<T> c;
    c.positions = prepared_index(positions, "positions", "per-token iRPE positions", w);
    c.key_positions = prepared_index(key_positions, "key_positions", "per-token iRPE key positions", w);
    TORCH_CHECK_VALUE(!c.key_positions.defined() || c.positions.defined(),
                      "[rpe.torch] key_positions is given without positions; expected positions too (the queries')");
    c.tg = target_of(target);
    c.contextual = rpe::parse_contextual(std::string_view(mode.data(), mode.size()));
    {  // the dtype: tables[0]'s, or the one most of them have (check_one_dtype)
        std::vector<named_tensor> all;
        if (!tables_in.empty()) all.push_back({"tables[0]", &tables_in[0]});
        if (c.contextual && x_opt) all.push_back({"x", &*x_opt});
        for (std::size_t i = 1; i < tables_in.size(); ++i) all.push_back({"tables[" + std::to_string(i) + "]", &tables_in[i]});
        if (grad_out_in) all.push_back({"grad_out", grad_out_in});
        check_one_dtype(all, st.shared);
    }
    if (c.contextual && x_opt) c.x = prepared(*x_opt, "x", st, w);
    c.tables = prepared_tables<S>(tables_in, "tables", st, w);
    if (grad_out_in) c.grad_out = prepared(*grad_out_in, "grad_out", st, w);
    c.d = dims_of(c.x, c.tables, c.contextual, c.tg);
    c.term = make<T>(method, mode, c.tg, alpha, beta, gamma, skip, c.d.heads, c.d.head_dim, c.d.shared);
    if (c.positions.defined()) {  // the grid (height, width) is not read
        c.ids = c.term->bucket_ids(cref<std::int32_t>(c.positions), c.key_positions.defined()
                                                                        ? cref<std::int32_t>(c.key_positions)
                                                                        : rpe::tensor_ref<const std::int32_t>{});
        return c;
    }
    TORCH_CHECK_VALUE(height >= 1 && width >= 1, "[rpe.torch] height = ", height, ", width = ", width, "; expected >= 1");
    c.ids = c.term->bucket_ids(static_cast<int>(height), static_cast<int>(width));
    return c;
}

// ---------------------------------------------------------------------------------------------
// 2D RoPE
// ---------------------------------------------------------------------------------------------

// The channel layout named `value` ("pairs", "half" or "vjepa2"; rpe::rope::layout). "vjepa2",
// V-JEPA 2's own layout, belongs to the form "vjepa2" alone (and that form to it): the library's
// check_rope refuses any other combination (`[rpe.rope] rope layout = pairs for a form that runs
// in its own layout; expected rope::layout::vjepa2`).
inline rpe::rope::layout layout_of(c10::string_view value, const char* name) {
    const std::string v = str(value);
    if (v == "pairs") return rpe::rope::layout::pairs;
    if (v == "vjepa2") return rpe::rope::layout::vjepa2;
    TORCH_CHECK_VALUE(v == "half", "[rpe.torch] ", name, " = '", v,
                      "'; expected 'pairs', 'half' or 'vjepa2' (V-JEPA 2's own, for form 'vjepa2' only)");
    return rpe::rope::layout::half;
}

// The RoPE forms of rpe's registry (<rpe/families.hpp>), as "axial, mixed, ... or mrope".
inline std::string rope_form_names() {
    std::vector<std::string> all;
    for (const auto& x : rpe::families().entries())
        if (x->info.kind == rpe::family_kind::rope) all.push_back(x->info.name);
    std::string names;
    for (std::size_t i = 0; i < all.size(); ++i) names += (i == 0 ? "" : (i + 1 == all.size() ? " or " : ", ")) + all[i];
    return names;
}

// The largest magnitude up to which float32 holds every integer exactly (2^24): an integer RoPE
// position beyond it would be read as another position.
inline constexpr int64_t max_exact_float32_position = int64_t{1} << 24;

// Integer RoPE positions `t` (N, A) of `name`, before their conversion to float32: every |value|
// <= 2^24 (max_exact_float32_position), else a ValueError naming name[n, a], the value, and the
// float32 it would be rounded to. Floating positions are not checked (their rounding to float32
// is the caller's own); int8 / uint8 / int16 / uint16 cannot exceed 2^24. One min / max reduction
// on t's device (on CUDA a sync for its two values; the library copies device positions to the
// host for its checks anyway); the offending element is looked up only on failure.
inline void check_float32_exact_positions(const at::Tensor& t, const char* name) {
    const auto st = t.scalar_type();
    if ((st != at::kInt && st != at::kLong && st != at::kUInt32 && st != at::kUInt64) || t.numel() == 0) return;
    // uint32 / uint64 have no min / max kernels: compared in float64 (exact near 2^24; int64 ones in
    // their own type, their min and max then in float64, which keeps them on their side of ±2^24)
    const at::Tensor v = st == at::kInt || st == at::kLong ? t : t.to(at::kDouble);
    const auto [lo, hi] = at::aminmax(v);
    const at::Tensor range = at::stack({lo.to(at::kDouble), hi.to(at::kDouble)}).cpu();
    const double* r = range.const_data_ptr<double>();
    constexpr int64_t lim = max_exact_float32_position;
    if (r[0] >= -static_cast<double>(lim) && r[1] <= static_cast<double>(lim)) return;
    const int64_t i = at::logical_or(v.gt(lim), v.lt(-lim)).reshape(-1).nonzero()[0][0].item<int64_t>();
    const at::Tensor e = t.reshape(-1)[i].cpu();
    std::ostringstream value, rounded;
    rounded << std::fixed << std::setprecision(0);
    const auto show = [&](auto x) {
        value << x;
        rounded << static_cast<float>(x);
    };
    if (st == at::kInt)
        show(*e.const_data_ptr<int32_t>());
    else if (st == at::kLong)
        show(*e.const_data_ptr<int64_t>());
    else if (st == at::kUInt32)
        show(*e.const_data_ptr<uint32_t>());
    else
        show(*e.const_data_ptr<uint64_t>());
    const int64_t axes = t.size(1);
    TORCH_CHECK_VALUE(false, "[rpe.torch] ", name, "[", i / axes, ", ", i % axes, "] = ", value.str(),
                      "; expected integer positions with |value| <= 2^24 = ", lim,
                      " (positions are read in float32, exact for integers up to 2^24: this one would be read as ", rounded.str(),
                      ")");
}

// Per-token positions (N, 2) (row, col) — (N, 3) for a 3-axis form (mrope: (t, h, w); vjepa2:
// (frame, row, col)) — of `name`, integer or floating: the float32 contiguous tensor the library
// reads (rpe::rotary_embedding::positions), or undefined when not given. Integer positions must
// have |value| <= 2^24 (check_float32_exact_positions: beyond it float32 would read another
// position). The library checks the axes against the form, N against L and that every value is
// finite. A CPU operator takes them on the CPU; a CUDA operator (w on a CUDA device) on the CPU or
// on w's device (rpe's CUDA backend copies device positions to the host for its checks and
// tables, and reads host ones in place).
inline at::Tensor prepared_positions(const c10::optional<at::Tensor>& p, const char* name, const where& w = {}) {
    if (!p || !p->defined()) return {};
    const at::Tensor& t = *p;
    if (w.device.is_cpu()) {
        TORCH_CHECK_VALUE(t.device().is_cpu(), "[rpe.torch] ", name, " is on device ", t.device().str(),
                          "; expected cpu, the device of the other tensors");
    } else {
        TORCH_CHECK_VALUE(t.device().is_cpu() || t.device() == w.device, "[rpe.torch] ", name, " is on device ", t.device().str(),
                          "; expected cpu or ", w.device.str(), ", the device of the other tensors");
    }
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE((at::isIntegralType(st, false) || st == at::kFloat || st == at::kDouble), "[rpe.torch] ", name,
                     " has dtype ", dtype_name(st), "; expected an integer, float32 or float64 tensor of (row, col) coordinates");
    TORCH_CHECK_VALUE(t.dim() == 2 && (t.size(1) == 2 || t.size(1) == 3), "[rpe.torch] ", name, " has shape ", shape_of(t),
                      "; expected (N, 2) per-token (row, col) coordinates, or (N, 3) for a 3-axis form ((t, h, w) for "
                      "mrope, (frame, row, col) for vjepa2)");
    check_int32_sizes(t, name);
    check_float32_exact_positions(t, name);
    return t.to(at::kFloat).contiguous();
}

// The attention's rope_query_suffix (rpe::rotary_embedding::query_suffix: the queries' trailing
// unrotated tokens when they differ from the keys' rope_suffix, e.g. SAM2's memory attention,
// whose queries have none): -1 (the default: as rope_suffix) or a count >= 0, with a RoPE form
// only. Errors: ValueError naming rope_query_suffix and its value.
inline void check_query_suffix(c10::string_view form, int64_t query_suffix) {
    TORCH_CHECK_VALUE(query_suffix >= -1 && query_suffix < (int64_t{1} << 30), "[rpe.torch] rope_query_suffix = ", query_suffix,
                      "; expected >= 0, or -1 for rope_suffix (the keys')");
    TORCH_CHECK_VALUE(query_suffix == -1 || !form.empty(), "[rpe.torch] rope_query_suffix = ", query_suffix,
                      " without a RoPE (rope_form = ''); expected -1");
}

// The rotary embedding of (form, params, skip, layout, suffix, query_suffix): form "" (none) or a RoPE form of
// rpe's registry with its parameters in the registry's order (rpe::family_info::params): "axial"
// [theta], "mixed" [] (frequencies given with the call), "cat" [temperature, in_pixels, max_res,
// linear_bands, grid_offset, ref_height, ref_width, xy_indexing], "dinov3" [base, min_period,
// max_period, normalize (0 separate, 1 max, 2 min), shift_y, shift_x, jitter_y, jitter_x, rescale],
// "mrope" [theta, section_t, section_h, section_w, interleaved], "vjepa2" [theta] (layout
// "vjepa2", its only one), "sam2" [theta]; flags as 0 / 1, a choice as its
// position; query_suffix the queries' own trailing unrotated tokens (-1: suffix; check_query_suffix).
// The policy's own validate() (through the library's checks) rejects bad values.
template <class S>
rpe::rotary_embedding<S> make_rope(c10::string_view form_in, at::ArrayRef<double> p, int64_t skip,
                                   c10::string_view channel_layout = "pairs", int64_t suffix = 0, int64_t query_suffix = -1) {
    const std::string form(form_in.data(), form_in.size());
    rpe::rotary_embedding<S> r;
    const auto need = [&](std::size_t n, const char* layout) {
        TORCH_CHECK_VALUE(p.size() == n, "[rpe.torch] rope_params holds ", p.size(), " values for form '", form, "'; expected ",
                          n, " (", layout, ")");
    };
    check_query_suffix(form_in, query_suffix);
    if (form.empty()) {
        need(0, "none");
        return r;
    }
    TORCH_CHECK_VALUE(skip >= 0 && skip < (int64_t{1} << 30), "[rpe.torch] rope skip = ", skip, "; expected >= 0");
    TORCH_CHECK_VALUE(suffix >= 0 && suffix < (int64_t{1} << 30), "[rpe.torch] rope suffix = ", suffix, "; expected >= 0");
    r.skip = static_cast<int>(skip);
    r.suffix = static_cast<int>(suffix);
    r.query_suffix = static_cast<int>(query_suffix);
    r.layout = layout_of(channel_layout, "rope layout");
    // the form and its parameters from rpe's registry (<rpe/families.hpp>), params in its order
    auto& reg = rpe::families();
    const auto e = reg.find(form);
    TORCH_CHECK_VALUE(e && e->info.kind == rpe::family_kind::rope, "[rpe.torch] rope form = '", form, "'; expected ",
                      rope_form_names());
    std::string layout;
    for (const auto& q : e->info.params) layout += (layout.empty() ? "" : ", ") + q.name;
    need(e->info.params.size(), layout.empty() ? "none: the frequencies are the freqs tensor" : layout.c_str());
    rpe::family_spec spec = reg.defaults(form, rpe::family_kind::rope);
    for (std::size_t i = 0; i < p.size(); ++i) {
        const auto& q = e->info.params[i];
        double v = p[i];
        if (q.type == rpe::family_param::kind::flag)  // 0 or 1 exactly: a 0.5 or a NaN is no flag
            TORCH_CHECK_VALUE(v == 0 || v == 1, "[rpe.torch] rope ", q.name, " = ", v, "; expected 0 or 1 (a flag)");
        if (q.type == rpe::family_param::kind::integer)
            TORCH_CHECK_VALUE(std::isfinite(v) && v == std::floor(v) && std::abs(v) < (1 << 30), "[rpe.torch] rope ", q.name,
                              " = ", v, "; expected an integer");
        if (q.type == rpe::family_param::kind::choice) {
            std::string choices;
            for (std::size_t c = 0; c < q.choices.size(); ++c)
                choices +=
                    (c == 0 ? "" : (c + 1 == q.choices.size() ? " or " : ", ")) + std::to_string(c) + " (" + q.choices[c] + ")";
            TORCH_CHECK_VALUE(v >= 0 && v < static_cast<double>(q.choices.size()) && v == std::floor(v), "[rpe.torch] rope ",
                              q.name, " = ", v, "; expected ", choices);
        }
        if (q.type == rpe::family_param::kind::number)
            spec.set(q.name, v);  // the policy's validate() checks it, with its own message
        else
            reg.set_value(spec, q.name, v);
    }
    r.form = rpe::visit_rope(spec, [](const auto& policy) { return rpe::rope_form_of(policy); });
    return r;
}

inline void check_grid(int64_t height, int64_t width) {
    TORCH_CHECK_VALUE(height >= 1 && width >= 1 && height < (1 << 30) && width < (1 << 30), "[rpe.torch] height = ", height,
                      ", width = ", width, "; expected >= 1");
}

// ---------------------------------------------------------------------------------------------
// Fused attention
// ---------------------------------------------------------------------------------------------

struct attention_args {
    at::Tensor q, k, v, grad_out, key_padding_mask, attn_mask,
        attn;  // attn: the forward's probabilities (backward), or undefined
    std::vector<at::Tensor> tables[3];
    c10::string_view methods[3], modes[3];
    std::vector<double> params;  // per slot: alpha, beta, gamma, skip
    int64_t height = 0, width = 0;
    c10::optional<double> scale;  // None: the library's 1/sqrt(D)
    c10::string_view rope_form;
    std::vector<double> rope_params;
    at::Tensor rope_freqs;
    int64_t rope_skip = 0;
    c10::string_view rope_layout = "pairs";
    at::Tensor rope_positions, rope_key_positions;  // (N, 2) as given (prepared in setup_attention), or undefined
    int64_t rope_suffix = 0;
    int64_t rope_query_suffix = -1;  // the queries' own suffix (rotary_embedding::query_suffix); -1: rope_suffix
    // the iRPE terms' index tensors as given (prepared in setup_attention: int32), or undefined:
    // per-token positions (attention_inputs::positions, key_positions), packed sequences
    // (attention_inputs::packed: lengths, grids, positions), valid key lengths (key_lengths)
    at::Tensor rpe_positions, rpe_key_positions, packed_lengths, packed_grids, packed_positions, key_lengths;
};

// rpe_positions or rpe_key_positions `p` (prepared int32, on the CPU or w's device) against one
// attached term: (tokens, axes) with tokens = `what` (e.g. "L - skip = 7 - 1 of rpe_k"), and on
// the CPU every |value| <= rpe::max_position (device ones: the library checks the values on its
// host copy). The library's own check (attention_inputs::positions, key_positions) with the
// operator's argument names. Errors: ValueError naming `name`.
inline void check_rpe_position_tensor(const at::Tensor& p, const char* name, int axes, int64_t tokens, const std::string& what) {
    const char* coords = axes == 3 ? "(t, row, col) for a 3D mapping" : "(row, col) for a 2D mapping";
    TORCH_CHECK_VALUE(p.dim() == 2 && p.size(1) == axes && p.size(0) == tokens, "[rpe.torch] ", name, " has shape ", shape_of(p),
                      "; expected (", tokens, " = ", what, ", ", axes, ") integer coordinates ", coords);
    if (!p.device().is_cpu()) return;
    const std::int32_t* d = p.data_ptr<std::int32_t>();
    for (int64_t i = 0; i < p.numel(); ++i)
        TORCH_CHECK_VALUE(d[i] <= rpe::max_position && d[i] >= -rpe::max_position, "[rpe.torch] ", name, "[", i / axes, ", ",
                          i % axes, "] = ", d[i], "; expected |value| <= rpe::max_position = ", rpe::max_position);
}

// The iRPE terms' per-token positions of the attention operators (a.rpe_positions,
// a.rpe_key_positions, prepared) against the attached terms `terms` (null: no term on that slot),
// before the library's checks, so that the messages name the operators' arguments (the library
// names its fields positions / key_positions; the RoPE's are rope_positions / rope_key_positions):
// none without a term (nothing would read them), none with packed_lengths (packed_positions are
// the packed images'), both when the keys have another length than the queries (L_k != L), and
// for each term rpe_positions (L - skip, A) and rpe_key_positions (L_k - skip, A), A its position axes, values within rpe::max_position.
// Errors: ValueError naming rpe_positions / rpe_key_positions and the term's slot.
template <class T>
void check_rpe_positions(const attention_args& a, const std::unique_ptr<rpe::any_term<T>> (&terms)[3]) {
    const bool pos = a.rpe_positions.defined(), kpos = a.rpe_key_positions.defined();
    const bool any = terms[0] || terms[1] || terms[2];
    TORCH_CHECK_VALUE(!pos || any, "[rpe.torch] rpe_positions", kpos ? " and rpe_key_positions are" : " is",
                      " given but no iRPE term (rpe_q, rpe_k, rpe_v) is attached (method_q, method_k, method_v are ''); "
                      "expected none (nothing reads them: they are the iRPE terms' positions, the RoPE's are "
                      "rope_positions / rope_key_positions)");
    if (a.packed_lengths.defined()) {
        TORCH_CHECK_VALUE(!pos,
                          "[rpe.torch] rpe_positions is given with packed_lengths; expected packed_positions (every "
                          "image's positions, image after image) instead");
        return;
    }
    static const char* slot_names[] = {"rpe_q", "rpe_k", "rpe_v"};
    const int64_t l = a.q.size(2), lk = a.k.size(2);
    for (int i = 0; i < 3; ++i) {
        if (!terms[i]) continue;
        const char* slot = slot_names[i];
        if (lk != l) {  // a grid describes one token set: the ids (L, L_k) need both (CPU and CUDA)
            const std::string lengths =
                "keys of another length than the queries (L = " + std::to_string(l) + ", L_k = " + std::to_string(lk) + ")";
            TORCH_CHECK_VALUE(pos, "[rpe.torch] ", slot, " is attached with ", lengths,
                              " and no rpe_positions; expected rpe_positions (the queries') and rpe_key_positions (the "
                              "keys'): a grid (height, width) describes one token set");
            TORCH_CHECK_VALUE(kpos, "[rpe.torch] rpe_key_positions is not given with ", lengths, " and ", slot,
                              " attached; expected the keys' positions (L_k - skip = ", lk, " - ", terms[i]->skip(), " of them)");
        }
        if (!pos) continue;
        const int64_t skip = terms[i]->skip();
        const int axes = terms[i]->position_axes();
        TORCH_CHECK_VALUE(l > skip, "[rpe.torch] L = ", l, " of q; expected more than skip = ", skip, " of ", slot,
                          " (rpe_positions need grid tokens)");
        const std::string what = "L - skip = " + std::to_string(l) + " - " + std::to_string(skip) + " of " + slot;
        check_rpe_position_tensor(a.rpe_positions, "rpe_positions", axes, l - skip, what);
        if (!kpos) continue;
        TORCH_CHECK_VALUE(lk > skip, "[rpe.torch] L_k = ", lk, " of k; expected more than skip = ", skip, " of ", slot,
                          " (rpe_key_positions need grid tokens)");
        check_rpe_position_tensor(
            a.rpe_key_positions, "rpe_key_positions", axes, lk - skip,
            lk == l ? what : "L_k - skip = " + std::to_string(lk) + " - " + std::to_string(skip) + " of " + slot);
    }
}

// T: the scalar of the terms that describe the slots (S on the CPU; on CUDA float, or double for
// double: only their rpe::term_desc is used, never a CPU kernel of them).
template <class S, class T = S>
struct attention_setup {
    std::unique_ptr<rpe::any_term<T>> terms[3];
    rpe::attention_inputs<S> in;
    rpe::attention_options opt;  // the softmax scale (rpe::attention_options::scale)
};

// The attention's floating tensor arguments, q first (the call's dtype is q's), for
// check_one_dtype and the CUDA operators' device: q, k, v, the tables of each slot, a float
// attn_mask, rope_freqs, grad_out and attn (those given).
inline std::vector<named_tensor> attention_float_tensors(const attention_args& a) {
    std::vector<named_tensor> r{{"q", &a.q}, {"k", &a.k}, {"v", &a.v}};
    static const char* slot_names[] = {"tables_q", "tables_k", "tables_v"};
    for (int i = 0; i < 3; ++i)
        for (std::size_t t = 0; t < a.tables[i].size(); ++t)
            r.push_back({std::string(slot_names[i]) + "[" + std::to_string(t) + "]", &a.tables[i][t]});
    if (a.attn_mask.defined() && a.attn_mask.scalar_type() != at::kBool) r.push_back({"attn_mask", &a.attn_mask});
    r.push_back({"rope_freqs", &a.rope_freqs});
    r.push_back({"grad_out", &a.grad_out});
    r.push_back({"attn", &a.attn});
    return r;
}

// Prepares inputs in place (contiguous, dtype-checked, on w's device) and builds the library's
// inputs and options (storage type S; terms of scalar T, see attention_setup).
template <class S, class T = S>
attention_setup<S, T> setup_attention(attention_args& a, const dtype_rule& st, const where& w = {}) {
    check_one_dtype(attention_float_tensors(a), st.shared);
    static const char* qkv_names[] = {"q", "k", "v"};
    at::Tensor* qkv[] = {&a.q, &a.k, &a.v};
    for (int i = 0; i < 3; ++i) {
        *qkv[i] = prepared_rows(*qkv[i], qkv_names[i], st, w);
        check_rank(*qkv[i], 4, qkv_names[i], "(B, H, L, D)");
    }
    const int64_t B = a.q.size(0), H = a.q.size(1), L = a.q.size(2), D = a.q.size(3);
    TORCH_CHECK_VALUE(D >= 1, "[rpe.torch] q has shape ", shape_of(a.q), "; expected D >= 1");
    TORCH_CHECK_VALUE(a.params.size() == 12, "[rpe.torch] params holds ", a.params.size(), " values; expected 12");
    attention_setup<S, T> s;
    if (a.scale) {
        const double scale = *a.scale;
        TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "[rpe.torch] scale = ", scale,
                          "; expected a positive finite number");
        // Python's D**-0.5 may differ from the library's 1/sqrt(D) in the last bit: within 4 ulp
        // it is the default (the same results as scale = None).
        const double ratio = scale * std::sqrt(static_cast<double>(D));
        if (std::abs(ratio - 1.0) > 4 * std::numeric_limits<double>::epsilon()) s.opt.scale = scale;
    }
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
            tabs[t] = prepared(tabs[t], (std::string(slot_names[i]) + "[" + std::to_string(t) + "]").c_str(), st, w);
        TORCH_CHECK_VALUE(!tabs.empty(), "[rpe.torch] ", slot_names[i], " is empty; expected 1 (or 2 for cross) tables");
        TORCH_CHECK_VALUE(tabs[0].dim() >= 1, "[rpe.torch] ", slot_names[i], "[0] is a scalar; expected a table");
        const double* p = a.params.data() + 4 * i;
        TORCH_CHECK_VALUE(p[3] >= 0 && p[3] < (1 << 30) && p[3] == std::floor(p[3]), "[rpe.torch] skip = ", p[3], " (",
                          slot_names[i], "); expected an integer >= 0");
        if (a.methods[i].find(':') == c10::string_view::npos) {  // (a spec text: check_grouped_effects)
            // values the method's family does not read (e.g. gamma for "swin") are refused, not ignored
            const auto read = term_values_read(a.methods[i]);
            static const char* const values[] = {"alpha", "beta", "gamma"};
            std::string taken;
            for (std::size_t j = 0; j < read.size(); ++j)
                taken += (j == 0 ? "" : ", ") + std::string(values[j]) + " as " + read[j];
            for (std::size_t j = read.size(); j < 3; ++j)
                TORCH_CHECK_VALUE(p[j] == 0, "[rpe.torch] params[", 4 * i + j, "] = ", p[j], " (", values[j], " of slot ",
                                  "qkv"[i], ") with method_", "qkv"[i], " = '", a.methods[i], "', which reads ",
                                  read.empty() ? std::string("none of alpha, beta, gamma") : taken,
                                  "; expected 0 (nothing reads it)");
        }
        s.terms[i] = make<T>(a.methods[i], a.modes[i], targets[i], p[0], p[1], p[2], static_cast<int64_t>(p[3]), H, D,
                             tabs[0].size(0) == 1);
        slots[i]->term = s.terms[i].get();
        for (const auto& t : tabs) slots[i]->tables.push_back(cref<S>(t));
    }
    s.in.q = sref<S>(a.q);
    s.in.k = sref<S>(a.k);
    s.in.v = sref<S>(a.v);
    a.packed_lengths = prepared_index(a.packed_lengths, "packed_lengths", "packed sequences' lengths", w);
    if (a.packed_lengths.defined()) {  // the library checks (0, 0): each image's grid is in packed
        TORCH_CHECK_VALUE(a.height >= 0 && a.width >= 0 && a.height < (1 << 30) && a.width < (1 << 30),
                          "[rpe.torch] height = ", a.height, ", width = ", a.width,
                          " with packed_lengths; expected 0, 0 (the grids are packed_grids)");
    } else {
        TORCH_CHECK_VALUE(a.height >= 1 && a.width >= 1 && a.height < (1 << 30) && a.width < (1 << 30),
                          "[rpe.torch] height = ", a.height, ", width = ", a.width, "; expected >= 1");
    }
    s.in.height = static_cast<int>(a.height);
    s.in.width = static_cast<int>(a.width);
    if (a.key_padding_mask.defined()) {
        const auto& m = a.key_padding_mask;
        if (w.device.is_cpu()) {
            TORCH_CHECK_VALUE(m.device().is_cpu(), "[rpe.torch] key_padding_mask is on device ", m.device().str(),
                              "; expected cpu");
        } else {
            check_device(m, "key_padding_mask", w);
        }
        TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || m.scalar_type() == at::kByte, "[rpe.torch] key_padding_mask has dtype ",
                         dtype_name(m.scalar_type()), "; expected bool or uint8 (true = padded key)");
        check_rank(m, 2, "key_padding_mask", "(B, L_k)");
        a.key_padding_mask = m.to(at::kByte).ne(0).to(at::kByte).contiguous();
        s.in.key_padding_mask = cref<std::uint8_t>(a.key_padding_mask);
    }
    if (a.attn_mask.defined()) {
        auto& m = a.attn_mask;
        if (m.scalar_type() == at::kBool) {
            if (w.device.is_cpu()) {
                TORCH_CHECK_VALUE(m.device().is_cpu(), "[rpe.torch] attn_mask is on device ", m.device().str(), "; expected cpu");
            } else {
                check_device(m, "attn_mask", w);
            }
            m = at::zeros(m.sizes(), a.q.options()).masked_fill(m, -std::numeric_limits<double>::infinity());
        }
        m = prepared(m, "attn_mask", st, w);
        check_rank(m, 2, "attn_mask", "(L, L_k)");
        s.in.attn_mask = cref<S>(m);
    }
    s.in.rope = make_rope<S>(a.rope_form, a.rope_params, a.rope_skip, a.rope_layout, a.rope_suffix, a.rope_query_suffix);
    if (a.rope_freqs.defined()) {
        a.rope_freqs = prepared(a.rope_freqs, "rope_freqs", st, w);
        s.in.rope.freqs = cref<S>(a.rope_freqs);
    }
    a.rope_positions = prepared_positions(a.rope_positions, "rope_positions", w);
    a.rope_key_positions = prepared_positions(a.rope_key_positions, "rope_key_positions", w);
    if (a.rope_positions.defined()) s.in.rope.positions = cref<float>(a.rope_positions);
    if (a.rope_key_positions.defined()) s.in.rope.key_positions = cref<float>(a.rope_key_positions);
    const auto index = [&](at::Tensor& t, const char* name, const char* what) {
        t = prepared_index(t, name, what, w);
        return t.defined() ? cref<std::int32_t>(t) : rpe::tensor_ref<const std::int32_t>{};
    };
    s.in.positions = index(a.rpe_positions, "rpe_positions", "per-token iRPE positions");
    s.in.key_positions = index(a.rpe_key_positions, "rpe_key_positions", "per-token iRPE key positions");
    TORCH_CHECK_VALUE(!a.rpe_key_positions.defined() || a.rpe_positions.defined(),
                      "[rpe.torch] rpe_key_positions is given without rpe_positions; expected rpe_positions too (the queries')");
    if (a.packed_lengths.defined()) s.in.packed.lengths = cref<std::int32_t>(a.packed_lengths);
    s.in.packed.grids = index(a.packed_grids, "packed_grids", "packed images' grids");
    s.in.packed.positions = index(a.packed_positions, "packed_positions", "packed images' per-token positions");
    TORCH_CHECK_VALUE(a.packed_lengths.defined() || (!a.packed_grids.defined() && !a.packed_positions.defined()), "[rpe.torch] ",
                      a.packed_grids.defined() ? "packed_grids" : "packed_positions",
                      " is given without packed_lengths; expected packed_lengths (tokens per image) too");
    s.in.key_lengths = index(a.key_lengths, "key_lengths", "valid key lengths");
    check_rpe_positions(a, s.terms);
    (void)B;
    (void)L;
    return s;
}

// The attention backward's outputs, allocated and wired into `s.in`: grad_q, grad_k, grad_v
// (contiguous, shaped as q, k, v: these may be strided views), one gradient per table of the
// query, key and value slots in that order (wired as the slots' grad_tables), and the RoPE-Mixed
// frequencies' gradient when rope_freqs is given. `grads(grad_out)` is the library's gradient
// argument; `result()` lists them in the operator's order (the frequencies' gradient last).
template <class S>
struct backward_outputs {
    at::Tensor gq, gk, gv, grad_freqs;
    std::vector<at::Tensor> tables;

    backward_outputs(const attention_args& a, rpe::attention_inputs<S>& in)
        : gq(at::empty(a.q.sizes(), a.q.options())),
          gk(at::empty(a.k.sizes(), a.k.options())),
          gv(at::empty(a.v.sizes(), a.v.options())) {
        rpe::attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int i = 0; i < 3; ++i)
            for (auto& t : a.tables[i]) {
                tables.push_back(at::empty_like(t));
                slots[i]->grad_tables.push_back(mref<S>(tables.back()));
            }
        if (in.rope.is_mixed() && a.rope_freqs.defined()) {
            grad_freqs = at::empty(a.rope_freqs.sizes(), a.rope_freqs.options());
            in.rope.grad_freqs = mref<S>(grad_freqs);
        }
    }

    rpe::attention_gradients<S> grads(const at::Tensor& grad_out) {
        return {.grad_out = cref<S>(grad_out), .grad_q = mref<S>(gq), .grad_k = mref<S>(gk), .grad_v = mref<S>(gv)};
    }

    std::vector<at::Tensor> result() const {
        std::vector<at::Tensor> r{gq, gk, gv};
        r.insert(r.end(), tables.begin(), tables.end());
        if (grad_freqs.defined()) r.push_back(grad_freqs);
        return r;
    }
};

// Refuses the grouped arguments' values that cannot have any effect (a caller's mistake would
// otherwise be a silent wrong answer), each of them only where its default is what nothing reads:
//   a slot without a method (method_q / method_k / method_v = ''): its mode must be '' and its
//     4 params (alpha, beta, gamma, skip) 0;
//   a method given as a spec text ("family:param=value,...", it sets its own parameters): its
//     slot's alpha, beta, gamma must be 0 (skip is still read);
//   no RoPE (rope_form = ''): rope_layout 'pairs', no RoPE params after the 12 term values,
//     rope_skip 0, rope_suffix 0, rope_query_suffix -1 (check_query_suffix, which also checks its
//     range with a RoPE), rope_freqs None, and no rope_positions / rope_key_positions among the
//     index tensors.
// `n_params`: the values params held as given ([] counts as 12 zeros). Errors: ValueError naming
// the argument, its list entry and its value.
inline void check_grouped_effects(const attention_args& a, std::size_t n_params) {
    static const char* const letters[] = {"q", "k", "v"};
    static const char* const values[] = {"alpha", "beta", "gamma", "skip"};
    for (int s = 0; s < 3; ++s) {
        const char* l = letters[s];
        const double* p = a.params.data() + 4 * s;
        if (a.methods[s].empty()) {
            TORCH_CHECK_VALUE(a.modes[s].empty(), "[rpe.torch] mode_", l, " = '", a.modes[s], "' (spec entry ", 2 * s + 1,
                              ") without a method (method_", l, " = ''); expected '' (slot ", l,
                              " has no term: nothing reads its mode)");
            for (int j = 0; j < 4; ++j)
                TORCH_CHECK_VALUE(p[j] == 0, "[rpe.torch] params[", 4 * s + j, "] = ", p[j], " (", values[j], " of slot ", l,
                                  ") without a method (method_", l, " = ''); expected 0 (slot ", l,
                                  " has no term: nothing reads it)");
        } else if (a.methods[s].find(':') != c10::string_view::npos) {
            for (int j = 0; j < 3; ++j)
                TORCH_CHECK_VALUE(p[j] == 0, "[rpe.torch] params[", 4 * s + j, "] = ", p[j], " (", values[j], " of slot ", l,
                                  ") with method_", l, " = '", a.methods[s],
                                  "', a spec text, which sets its own parameters; expected 0 (nothing reads it: set ", values[j],
                                  " in the text)");
        }
    }
    check_query_suffix(a.rope_form, a.rope_query_suffix);  // sizes[4]: its range, and -1 without a RoPE
    if (!a.rope_form.empty()) return;
    constexpr const char* none = " without a RoPE (rope_form = ''); expected ";
    TORCH_CHECK_VALUE(a.rope_layout == "pairs", "[rpe.torch] rope_layout = '", a.rope_layout, "' (spec entry 7)", none,
                      "'pairs' (the default: nothing reads it without a RoPE)");
    TORCH_CHECK_VALUE(a.rope_params.empty(), "[rpe.torch] params[12] = ", a.rope_params.empty() ? 0.0 : a.rope_params[0],
                      " (the first of ", a.rope_params.size(), " RoPE params; params holds ", n_params, " values)", none,
                      "12 values, the terms' alone (nothing reads RoPE params without a RoPE)");
    TORCH_CHECK_VALUE(a.rope_skip == 0, "[rpe.torch] rope_skip = ", a.rope_skip, " (sizes[2])", none,
                      "0 (the default: nothing reads it without a RoPE)");
    TORCH_CHECK_VALUE(a.rope_suffix == 0, "[rpe.torch] rope_suffix = ", a.rope_suffix, " (sizes[3])", none,
                      "0 (the default: nothing reads it without a RoPE)");
    TORCH_CHECK_VALUE(!a.rope_freqs.defined(), "[rpe.torch] rope_freqs of shape ", shape_of(a.rope_freqs), " is given", none,
                      "None (only the 'mixed' form reads it)");
    TORCH_CHECK_VALUE(!a.rope_positions.defined() && !a.rope_key_positions.defined(), "[rpe.torch] ",
                      a.rope_positions.defined() ? "rope_positions (index slot 0)" : "rope_key_positions (index slot 1)",
                      " of shape ", shape_of(a.rope_positions.defined() ? a.rope_positions : a.rope_key_positions), " is given",
                      none,
                      "none (nothing reads the RoPE's positions without a RoPE; the iRPE terms' are rpe_positions, "
                      "rpe_key_positions)");
}

// The attention operators' common arguments (attention_forward's schema in order: the backward
// has the same ones, plus grad_out and attn, which it sets itself) into attention_args, for
// setup_attention. The grouped arguments, each shorter list taking the defaults of its missing
// trailing entries (a short schema keeps torch.library's per-call cost low, docs/torch.md):
//   spec    "method_q;mode_q;method_k;mode_k;method_v;mode_v;rope_form;rope_layout" (one string,
//           semicolon-separated: torch.jit.trace takes no str[], names may hold commas; default "" each, layout "pairs");
//   params  [] (no term) or the 12 term values (alpha, beta, gamma, skip of q, k, v), then the
//           RoPE's params;
//   sizes   [height, width, rope_skip, rope_suffix, rope_query_suffix] (default 1, 1, 0, 0, -1),
//           then, when indices is not empty, all 5 and each index tensor's slot;
//   indices the index tensors given (Tensor[]: torch.jit.trace takes no Tensor?[]), each in the
//           slot sizes[5 + i] names: 0 rope_positions, 1 rope_key_positions, 2 rpe_positions,
//           3 rpe_key_positions, 4 packed_lengths, 5 packed_grids, 6 packed_positions,
//           7 key_lengths (the others: None).
// Optional tensors that are None stay undefined. Checks here, the same for the CPU and CUDA
// operators: the lists' lengths and the slots (ValueError naming the list), rope_query_suffix's
// range (check_query_suffix) and every value that cannot have any effect (check_grouped_effects:
// refused, not ignored); the other values are setup_attention's (and, on CUDA,
// attention_device's), in the order each operator makes them. The string views point into spec.
inline attention_args make_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList tq,
                                          at::TensorList tk, at::TensorList tv, c10::string_view spec,
                                          at::ArrayRef<double> params, at::ArrayRef<int64_t> sizes,
                                          const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& am,
                                          c10::optional<double> scale, const c10::optional<at::Tensor>& rope_freqs,
                                          at::TensorList indices) {
    // spec's semicolon-separated entries (views into it); "" is one empty entry, as the default
    std::vector<c10::string_view> entries;
    for (std::size_t begin = 0;;) {
        const std::size_t end = spec.find(';', begin);
        entries.push_back(spec.substr(begin, end == c10::string_view::npos ? c10::string_view::npos : end - begin));
        if (end == c10::string_view::npos) break;
        begin = end + 1;
    }
    TORCH_CHECK_VALUE(entries.size() <= 8, "[rpe.torch] spec = '", spec, "' holds ", entries.size(),
                      " semicolon-separated entries; expected at most 8: method_q, mode_q, method_k, mode_k, method_v, mode_v, "
                      "rope_form, rope_layout");
    TORCH_CHECK_VALUE(params.empty() || params.size() >= 12, "[rpe.torch] params holds ", params.size(),
                      " values; expected none (no term) or 12 (alpha, beta, gamma, skip of the q, k and v terms) followed by "
                      "the RoPE's params");
    static constexpr const char* slots =
        "height, width, rope_skip, rope_suffix, rope_query_suffix, then each index tensor's slot (0 rope_positions, 1 "
        "rope_key_positions, 2 rpe_positions, 3 rpe_key_positions, 4 packed_lengths, 5 packed_grids, 6 packed_positions, 7 "
        "key_lengths)";
    TORCH_CHECK_VALUE(indices.size() <= 8, "[rpe.torch] indices holds ", indices.size(),
                      " tensors; expected at most 8 (one per slot: rope_positions, rope_key_positions, rpe_positions, "
                      "rpe_key_positions, packed_lengths, packed_grids, packed_positions, key_lengths)");
    TORCH_CHECK_VALUE(indices.empty() ? sizes.size() <= 5 : sizes.size() == 5 + indices.size(), "[rpe.torch] sizes holds ",
                      sizes.size(), " values with ", indices.size(), " index tensors; expected ",
                      indices.empty() ? "at most 5" : "5 + one slot per index tensor", ": ", slots);
    attention_args a;
    a.q = q;
    a.k = k;
    a.v = v;
    a.tables[0] = tq.vec();
    a.tables[1] = tk.vec();
    a.tables[2] = tv.vec();
    const auto str = [&](std::size_t i, c10::string_view fallback) { return i < entries.size() ? entries[i] : fallback; };
    for (std::size_t s = 0; s < 3; ++s) {
        a.methods[s] = str(2 * s, "");
        a.modes[s] = str(2 * s + 1, "");
    }
    a.rope_form = str(6, "");
    a.rope_layout = str(7, "pairs");
    a.params = params.empty() ? std::vector<double>(12, 0.0) : std::vector<double>(params.begin(), params.begin() + 12);
    if (params.size() > 12) a.rope_params.assign(params.begin() + 12, params.end());
    const auto size = [&](std::size_t i, int64_t fallback) { return i < sizes.size() ? sizes[i] : fallback; };
    a.height = size(0, 1);
    a.width = size(1, 1);
    a.rope_skip = size(2, 0);
    a.rope_suffix = size(3, 0);
    a.rope_query_suffix = size(4, -1);
    if (kpm) a.key_padding_mask = *kpm;
    if (am) a.attn_mask = *am;
    a.scale = scale;
    if (rope_freqs) a.rope_freqs = *rope_freqs;
    at::Tensor* index[8] = {&a.rope_positions, &a.rope_key_positions, &a.rpe_positions,    &a.rpe_key_positions,
                            &a.packed_lengths, &a.packed_grids,       &a.packed_positions, &a.key_lengths};
    bool taken[8] = {};
    for (std::size_t i = 0; i < indices.size(); ++i) {
        const int64_t slot = sizes[5 + i];
        TORCH_CHECK_VALUE(slot >= 0 && slot < 8 && !taken[slot], "[rpe.torch] sizes[", 5 + i, "] = ", slot,
                          "; expected the slot of indices[", i, "], 0..7 and not given twice: ", slots);
        taken[slot] = true;
        *index[slot] = indices[i];
    }
    check_grouped_effects(a, params.empty() ? 12 : params.size());
    return a;
}

}  // namespace rpe_torch::ops
