// rpe::composed_attention_forward / _backward (reference `RPEAttention.forward`): every golden attention case in float and
// double (output, probabilities, grad_q/k/v, every table gradient; masked cases with their key
// padding mask), the documented zeros for a fully masked row, exact zeros at padded keys, and
// plain attention without RPE against a naive loop.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/term.hpp>
#include <rpe/make_term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_attention {

namespace {

using json = nlohmann::json;
using rpe::target;
using rpe::index::piecewise;
namespace mapping = rpe::mapping;
namespace mode = rpe::mode;
using rpe_test::cview;
using rpe_test::mview;

template <class M, class Md, target Tg, class S>
std::unique_ptr<rpe::any_term<S>> wrap(const piecewise& g, const rpe::term_config& config) {
    return rpe::make_any_term(rpe::term<M, Md, Tg, S>(M{g}, config));
}

/// The term of a golden attention case, built from compile-time types (only the seven
/// combinations the public set uses, so this file does not instantiate all of rpe::make_term).
template <class S>
std::unique_ptr<rpe::any_term<S>> term_for(const json& meta, char letter) {
    const piecewise g{meta.at("alpha").get<double>(), meta.at("beta").get<double>(), meta.at("gamma").get<double>()};
    const std::string method = meta.at("method").get<std::string>(), md = meta.at("mode").get<std::string>();
    const int heads = meta.at("heads").get<int>(), dim = meta.at("head_dim").get<int>(), skip = meta.at("skip").get<int>();
    const bool shared = meta.at("shared_head").get<bool>();
    if (method == "product" && md == "contextual") {
        if (letter == 'q')
            return wrap<mapping::product<>, mode::contextual, target::query, S>(
                g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
        if (letter == 'k')
            return wrap<mapping::product<>, mode::contextual, target::key, S>(
                g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
        return wrap<mapping::product<>, mode::contextual, target::value, S>(
            g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
    }
    if (method == "cross" && md == "contextual") {
        if (letter == 'q')
            return wrap<mapping::cross<>, mode::contextual, target::query, S>(
                g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
        if (letter == 'k')
            return wrap<mapping::cross<>, mode::contextual, target::key, S>(
                g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
        return wrap<mapping::cross<>, mode::contextual, target::value, S>(
            g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
    }
    if (method == "euclidean" && md == "bias" && letter == 'k')
        return wrap<mapping::euclidean<>, mode::bias, target::key, S>(
            g, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
    FAIL("golden attention case with an unexpected configuration: " << method << " " << md << " " << letter);
    return nullptr;
}

/// Everything one attention call needs, owning its buffers.
template <class S>
struct attention_run {
    std::int64_t b = 0, h = 0, l = 0, d = 0;
    std::vector<S> q, k, v, grad_out, out, attn, gq, gk, gv;
    std::vector<std::uint8_t> mask;
    std::unique_ptr<rpe::any_term<S>> terms[3];
    std::vector<std::vector<S>> tables, grads;  // reserved up front: attention_term holds views
    rpe::attention_inputs<S> in;

    void forward() {
        out.assign(q.size(), S(-7));
        attn.assign(static_cast<std::size_t>(b * h * l * l), S(-7));
        rpe::composed_attention_forward(in, mview(out, {b, h, l, d}), mview(attn, {b, h, l, l}));
    }
    void backward() {
        gq.assign(q.size(), S(-7));
        gk.assign(q.size(), S(-7));
        gv.assign(q.size(), S(-7));
        rpe::composed_attention_backward(in, {.grad_out = cview(grad_out, {b, h, l, d}),
                                              .grad_q = mview(gq, {b, h, l, d}),
                                              .grad_k = mview(gk, {b, h, l, d}),
                                              .grad_v = mview(gv, {b, h, l, d}),
                                              .saved_attn = cview(attn, {b, h, l, l})});
    }
};

template <class S>
void run_golden_attention(const std::string& dir) {
    const json meta = rpe_test::read_meta<json>(dir);
    attention_run<S> r;
    r.b = meta.at("batch").get<std::int64_t>();
    r.h = meta.at("heads").get<std::int64_t>();
    r.l = meta.at("L").get<std::int64_t>();
    r.d = meta.at("head_dim").get<std::int64_t>();
    const std::vector<std::int64_t> qshape{r.b, r.h, r.l, r.d};
    r.q = rpe_test::load<S>(dir, "q.npy", qshape);
    r.k = rpe_test::load<S>(dir, "k.npy", qshape);
    r.v = rpe_test::load<S>(dir, "v.npy", qshape);
    r.grad_out = rpe_test::load<S>(dir, "grad_output.npy", qshape);
    r.in.q = cview(r.q, qshape);
    r.in.k = cview(r.k, qshape);
    r.in.v = cview(r.v, qshape);
    r.in.height = meta.at("height").get<int>();
    r.in.width = meta.at("width").get<int>();
    REQUIRE(r.l == meta.at("skip").get<int>() + r.in.height * r.in.width);
    if (meta.value("key_padding_mask", false)) {
        r.mask = rpe_test::load<std::uint8_t>(dir, "key_padding_mask.npy", {r.b, r.l});
        r.in.key_padding_mask = cview(r.mask, {r.b, r.l});
    }
    const std::string on = meta.at("rpe_on").get<std::string>();
    const char letters[3] = {'q', 'k', 'v'};
    rpe::attention_term<S>* slots[3] = {&r.in.rpe_q, &r.in.rpe_k, &r.in.rpe_v};
    std::vector<std::string> grad_files;
    r.tables.reserve(6);
    r.grads.reserve(6);
    for (int t = 0; t < 3; ++t) {
        if (on.find(letters[t]) == std::string::npos) continue;
        r.terms[t] = term_for<S>(meta, letters[t]);
        slots[t]->term = r.terms[t].get();
        CHECK(r.terms[t]->num_buckets() == meta.at("num_buckets").get<int>());
        const auto shape = r.terms[t]->table_shape();
        const json& list = meta.at("rpe").at(std::string(1, letters[t])).at("tables");
        REQUIRE(static_cast<int>(list.size()) == r.terms[t]->num_tables());
        const auto ids = r.terms[t]->bucket_ids(r.in.height, r.in.width);
        for (std::size_t e = 0; e < list.size(); ++e) {
            const std::string id_file = list[e].at("bucket_ids").get<std::string>();
            rpe_test::check_exact(rpe_test::ids_matrix(*ids, static_cast<int>(e)),
                                  rpe_test::load<std::int64_t>(dir, id_file, {r.l, r.l}), id_file);
            r.tables.push_back(rpe_test::load<S>(dir, list[e].at("table").get<std::string>(), shape));
            r.grads.emplace_back(r.tables.back().size(), S(-7));  // garbage: backward overwrites
            slots[t]->tables.push_back(cview(r.tables.back(), shape));
            slots[t]->grad_tables.push_back(mview(r.grads.back(), shape));
            grad_files.push_back(list[e].at("grad").get<std::string>());
        }
    }
    r.forward();
    r.backward();
    rpe_test::check_golden(dir, meta, "output.npy", r.out);
    rpe_test::check_golden(dir, meta, "attn.npy", r.attn);
    rpe_test::check_golden(dir, meta, "grad_q.npy", r.gq);
    rpe_test::check_golden(dir, meta, "grad_k.npy", r.gk);
    rpe_test::check_golden(dir, meta, "grad_v.npy", r.gv);
    for (std::size_t e = 0; e < grad_files.size(); ++e) rpe_test::check_golden(dir, meta, grad_files[e], r.grads[e]);

    if (!r.mask.empty()) {
        // padded keys: probability exactly 0, grad_k and grad_v rows exactly 0 (golden README)
        int padded = 0;
        bool attn_zero = true, grads_zero = true, others_nonzero = true;
        for (std::int64_t bb = 0; bb < r.b; ++bb)
            for (std::int64_t j = 0; j < r.l; ++j) {
                const bool is_padded = r.mask[static_cast<std::size_t>(bb * r.l + j)] != 0;
                padded += is_padded;
                for (std::int64_t hh = 0; hh < r.h; ++hh) {
                    if (is_padded)
                        for (std::int64_t i = 0; i < r.l; ++i)
                            attn_zero =
                                attn_zero && r.attn[static_cast<std::size_t>(((bb * r.h + hh) * r.l + i) * r.l + j)] == S(0);
                    double row = 0;
                    for (std::int64_t dd = 0; dd < r.d; ++dd) {
                        const std::size_t e = static_cast<std::size_t>(((bb * r.h + hh) * r.l + j) * r.d + dd);
                        row += std::fabs(static_cast<double>(r.gk[e])) + std::fabs(static_cast<double>(r.gv[e]));
                    }
                    if (is_padded)
                        grads_zero = grads_zero && row == 0.0;
                    else
                        others_nonzero = others_nonzero && row > 0.0;
                }
            }
        CHECK(padded > 0);
        CHECK(attn_zero);
        CHECK(grads_zero);
        CHECK(others_nonzero);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("composed attention reproduces every golden attention case", S, float, double) {
    namespace fs = std::filesystem;
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(rpe_test::golden("attention")))
        if (fs::exists(e.path() / "meta.json")) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    CHECK(dirs.size() == 9);  // golden README "What is in this set"
    int masked = 0;
    for (const auto& dir : dirs) {
        INFO("case " << dir);
        masked += dir.find("_masked") != std::string::npos;
        run_golden_attention<S>(dir);
    }
    CHECK(masked == 2);
}

namespace {

/// A small random attention problem: Product ratio 1.9 contextual on q, k and v (shared tables),
/// B = 2, H = 2, D = 4, skip `skip`, `height × width` grid.
template <class S>
attention_run<S> random_run(int skip, int height, int width, unsigned seed) {
    attention_run<S> r;
    r.b = 2;
    r.h = 2;
    r.d = 4;
    r.l = skip + height * width;
    const std::size_t n = static_cast<std::size_t>(r.b * r.h * r.l * r.d);
    r.q = rpe_test::random_normal<S>(n, seed);
    r.k = rpe_test::random_normal<S>(n, seed + 1);
    r.v = rpe_test::random_normal<S>(n, seed + 2);
    r.grad_out = rpe_test::random_normal<S>(n, seed + 3);
    r.in.q = cview(r.q, {r.b, r.h, r.l, r.d});
    r.in.k = cview(r.k, {r.b, r.h, r.l, r.d});
    r.in.v = cview(r.v, {r.b, r.h, r.l, r.d});
    r.in.height = height;
    r.in.width = width;
    const piecewise g = piecewise::from_ratio(1.9);
    r.terms[0] = wrap<mapping::product<>, mode::contextual, target::query, S>(g, {.num_heads = 2, .head_dim = 4, .skip = skip});
    r.terms[1] = wrap<mapping::product<>, mode::contextual, target::key, S>(g, {.num_heads = 2, .head_dim = 4, .skip = skip});
    r.terms[2] = wrap<mapping::product<>, mode::contextual, target::value, S>(g, {.num_heads = 2, .head_dim = 4, .skip = skip});
    rpe::attention_term<S>* slots[3] = {&r.in.rpe_q, &r.in.rpe_k, &r.in.rpe_v};
    r.tables.reserve(3);
    r.grads.reserve(3);
    for (int t = 0; t < 3; ++t) {
        const auto shape = r.terms[t]->table_shape();
        r.tables.push_back(rpe_test::random_normal<S>(static_cast<std::size_t>(shape[0] * shape[1] * shape[2]),
                                                      seed + 10 + static_cast<unsigned>(t), 0.5));
        r.grads.emplace_back(r.tables.back().size());
        slots[t]->term = r.terms[t].get();
        slots[t]->tables = {cview(r.tables.back(), shape)};
        slots[t]->grad_tables = {mview(r.grads.back(), shape)};
    }
    return r;
}

}  // namespace

TEST_CASE("a row whose keys are all masked gives zeros, not NaN as in the reference (documented)") {
    using S = double;
    // no class token, so every key of batch element 1 can be masked
    attention_run<S> r = random_run<S>(0, 3, 3, 500);
    r.mask.assign(static_cast<std::size_t>(r.b * r.l), 0);
    for (std::int64_t j = 0; j < r.l; ++j) r.mask[static_cast<std::size_t>(r.l + j)] = 1;  // batch 1: all padded
    r.mask[3] = 1;                                                                         // batch 0: one padded key
    r.in.key_padding_mask = cview(r.mask, {r.b, r.l});
    r.forward();
    r.backward();
    const std::size_t half_a = r.attn.size() / 2, half_o = r.out.size() / 2;
    bool finite = true;
    for (const auto* v : {&r.out, &r.attn, &r.gq, &r.gk, &r.gv})
        for (S e : *v) finite = finite && std::isfinite(e);
    for (const auto& g : r.grads)
        for (S e : g) finite = finite && std::isfinite(e);
    CHECK(finite);
    bool zeros = true;
    for (std::size_t e = half_a; e < r.attn.size(); ++e) zeros = zeros && r.attn[e] == 0.0;
    for (std::size_t e = half_o; e < r.out.size(); ++e)
        zeros = zeros && r.out[e] == 0.0 && r.gq[e] == 0.0 && r.gk[e] == 0.0 && r.gv[e] == 0.0;
    CHECK(zeros);
    // batch element 0 is an ordinary softmax: rows sum to 1, masked key 3 has probability 0
    double worst = 0;
    bool key3_zero = true;
    for (std::int64_t row = 0; row < r.h * r.l; ++row) {
        double sum = 0;
        for (std::int64_t j = 0; j < r.l; ++j) sum += r.attn[static_cast<std::size_t>(row * r.l + j)];
        worst = std::max(worst, std::fabs(sum - 1.0));
        key3_zero = key3_zero && r.attn[static_cast<std::size_t>(row * r.l + 3)] == 0.0;
    }
    CHECK(worst < 1e-12);
    CHECK(key3_zero);
}

TEST_CASE("masking keys changes nothing but the masked logits: batch 0 unmasked equals the unmasked run") {
    using S = double;
    attention_run<S> plain = random_run<S>(1, 3, 4, 600);
    plain.forward();
    plain.backward();
    attention_run<S> masked = random_run<S>(1, 3, 4, 600);
    masked.mask.assign(static_cast<std::size_t>(masked.b * masked.l), 0);
    masked.mask[static_cast<std::size_t>(masked.l + masked.l - 1)] = 1;  // batch 1, last key
    masked.in.key_padding_mask = cview(masked.mask, {masked.b, masked.l});
    masked.forward();
    masked.backward();
    const std::size_t half = plain.out.size() / 2;
    double diff0 = 0, diff1 = 0;
    for (std::size_t e = 0; e < plain.out.size(); ++e) {
        double& diff = e < half ? diff0 : diff1;
        diff = std::max(diff, std::fabs(plain.out[e] - masked.out[e]));
    }
    CHECK(diff0 == 0.0);
    CHECK(diff1 > 1e-6);  // the mask did act on batch 1
}

TEST_CASE_TEMPLATE("attention without RPE equals softmax(q k^T / sqrt(D)) v", S, float, double) {
    attention_run<S> r;
    r.b = 1;
    r.h = 2;
    r.l = 7;
    r.d = 5;
    const std::size_t n = static_cast<std::size_t>(r.b * r.h * r.l * r.d);
    r.q = rpe_test::random_normal<S>(n, 700);
    r.k = rpe_test::random_normal<S>(n, 701);
    r.v = rpe_test::random_normal<S>(n, 702);
    r.grad_out = rpe_test::random_normal<S>(n, 703);
    r.in.q = cview(r.q, {r.b, r.h, r.l, r.d});
    r.in.k = cview(r.k, {r.b, r.h, r.l, r.d});
    r.in.v = cview(r.v, {r.b, r.h, r.l, r.d});
    r.in.height = 1;
    r.in.width = 7;
    r.forward();
    std::vector<double> out(n, 0.0);
    const double s = 1.0 / std::sqrt(5.0);
    for (std::int64_t p = 0; p < r.h; ++p)
        for (std::int64_t i = 0; i < r.l; ++i) {
            std::vector<double> logit(static_cast<std::size_t>(r.l));
            double m = -1e300, sum = 0;
            for (std::int64_t j = 0; j < r.l; ++j) {
                double dot = 0;
                for (std::int64_t dd = 0; dd < r.d; ++dd)
                    dot += static_cast<double>(r.q[static_cast<std::size_t>((p * r.l + i) * r.d + dd)]) *
                           static_cast<double>(r.k[static_cast<std::size_t>((p * r.l + j) * r.d + dd)]);
                logit[static_cast<std::size_t>(j)] = dot * s;
                m = std::max(m, dot * s);
            }
            for (auto& e : logit) sum += (e = std::exp(e - m));
            for (std::int64_t j = 0; j < r.l; ++j)
                for (std::int64_t dd = 0; dd < r.d; ++dd)
                    out[static_cast<std::size_t>((p * r.l + i) * r.d + dd)] +=
                        logit[static_cast<std::size_t>(j)] / sum *
                        static_cast<double>(r.v[static_cast<std::size_t>((p * r.l + j) * r.d + dd)]);
        }
    CHECK(rpe_test::max_abs_diff(r.out, out) <= (std::is_same_v<S, float> ? 1e-5 : 1e-13));
}

}  // namespace rpe_unit_core_attention
