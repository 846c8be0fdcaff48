// Gradient checks by central finite differences in double: for every (mode, target) term and for
// the composed attention with q, k and v RPE and a key padding mask.
//
// L(θ) = Σ out · G for a fixed random G; each analytic gradient (x, every table; q, k, v) is
// compared with (L(θ + h) − L(θ − h)) / 2h, h = 1e-6, per element:
//   |analytic − numeric| / max(|analytic|, |numeric|, 1e-2) < 1e-6.
// The terms are linear in each parameter, so the difference quotient is exact up to rounding
// (≈ 1e-10 here: L is summed in long double); the softmax adds a truncation error O(h²).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

#if defined(_OPENMP)
#include <omp.h>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_gradcheck {
#endif

namespace {

using rpe::target;
using rpe::index::piecewise;
namespace mapping = rpe::mapping;
namespace mode = rpe::mode;
using rpe_test::cview;
using rpe_test::mview;

constexpr double step = 1e-6;
constexpr double max_rel_error = 1e-6;
constexpr double rel_floor = 1e-2;  // gradients below this are compared in absolute terms (x 1e-2)

double dot(const std::vector<double>& a, const std::vector<double>& b) {
    long double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<long double>(a[i]) * static_cast<long double>(b[i]);
    return static_cast<double>(s);
}

/// Compares `analytic` with central differences of `loss` over the entries of `param`; returns
/// the worst relative error (and logs where it was).
double check_param(std::vector<double>& param, const std::vector<double>& analytic, const std::function<double()>& loss,
                   const std::string& name) {
    REQUIRE(param.size() == analytic.size());
    double worst = 0;
    std::size_t worst_i = 0;
    double worst_a = 0, worst_n = 0;
    for (std::size_t i = 0; i < param.size(); ++i) {
        const double numeric = rpe_test::central_difference(param, i, step, loss);
        const double rel = std::fabs(analytic[i] - numeric) / std::max({std::fabs(analytic[i]), std::fabs(numeric), rel_floor});
        if (!(rel <= worst)) {
            worst = std::isnan(rel) ? 1e300 : rel;
            worst_i = i;
            worst_a = analytic[i];
            worst_n = numeric;
        }
    }
    INFO(name << ": worst relative error " << worst << " at element " << worst_i << " (analytic " << worst_a << ", numeric "
              << worst_n << ") of " << param.size());
    CHECK(worst < max_rel_error);
    return worst;
}

const piecewise r19 = piecewise::from_ratio(1.9);

/// Runs the kernels on one thread while alive. A gradient check makes thousands of forward calls
/// on tiny problems; each would open an OpenMP team (the contextual kernels parallelise whenever
/// B·H > 1), which on a loaded CI machine (ctest -j) costs up to 100× the arithmetic. The
/// parallel paths are covered by the golden tests; here only the math matters.
struct single_thread {
#if defined(_OPENMP)
    int saved = omp_get_max_threads();
    single_thread() { omp_set_num_threads(1); }
    ~single_thread() { omp_set_num_threads(saved); }
#else
    single_thread() {}   // without OpenMP the kernels are serial already; user-provided so an
    ~single_thread() {}  // unused guard does not warn
#endif
    single_thread(const single_thread&) = delete;
    single_thread& operator=(const single_thread&) = delete;
};

}  // namespace

TEST_CASE_TEMPLATE("gradient check of each (mode, target) term", T,
                   rpe::term<mapping::product<>, mode::bias, target::key, double>,
                   rpe::term<mapping::product<>, mode::bias, target::query, double>,
                   rpe::term<mapping::product<>, mode::contextual, target::key, double>,
                   rpe::term<mapping::product<>, mode::contextual, target::query, double>,
                   rpe::term<mapping::product<>, mode::contextual, target::value, double>,
                   rpe::term<mapping::cross<>, mode::bias, target::key, double>,
                   rpe::term<mapping::cross<>, mode::contextual, target::query, double>,
                   rpe::term<mapping::cross<>, mode::contextual, target::value, double>,
                   rpe::term<mapping::euclidean<>, mode::contextual, target::key, double>) {
    const single_thread guard;
    for (bool shared : {true, false}) {
        CAPTURE(shared);
        rpe_test::term_problem<T> p(
            T(typename T::mapping_type{r19}, {.num_heads = 2, .head_dim = 3, .shared_head = shared, .skip = 1}), 2, 3, 3,
            shared ? 900 : 901);
        if constexpr (T::is_bias) {  // broadcast output (B, H, L, L): the table collects batch and heads
            p.oshape = {2, 2, p.l, p.l};
            p.grad_out = rpe_test::random_normal<double>(static_cast<std::size_t>(p.out_size()), 905);
        }
        const auto loss = [&] { return dot(p.forward(), p.grad_out); };
        std::vector<std::vector<double>> gt;
        std::vector<double> gx(p.x.size());
        p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape),
                        p.xshape.empty() ? rpe::tensor_ref<double>{} : mview(gx, p.xshape), p.grad_refs(gt),
                        rpe::write::overwrite);
        if (!p.xshape.empty()) check_param(p.x, gx, loss, "x");
        for (std::size_t t = 0; t < gt.size(); ++t) check_param(p.tables[t], gt[t], loss, "table " + std::to_string(t));
        // the check has teeth: an analytic gradient off by 1e-4 in one entry is caught
        {
            const double saved = p.tables[0][5];
            p.tables[0][5] = saved + step;
            const double up = loss();
            p.tables[0][5] = saved - step;
            const double down = loss();
            p.tables[0][5] = saved;
            const double wrong = gt[0][5] + 1e-4, numeric = (up - down) / (2 * step);
            const double worst = std::fabs(wrong - numeric) / std::max({std::fabs(wrong), std::fabs(numeric), rel_floor});
            CHECK(worst > max_rel_error);
        }
    }
}

TEST_CASE("gradient check of the composed attention with q, k, v RPE and a key padding mask") {
    using S = double;
    const single_thread guard;
    const std::int64_t B = 2, H = 2, D = 3, height = 3, width = 3, skip = 1, L = skip + height * width;
    const std::vector<std::int64_t> qshape{B, H, L, D};
    const std::size_t n = static_cast<std::size_t>(B * H * L * D);
    std::vector<S> q = rpe_test::random_normal<S>(n, 1000), k = rpe_test::random_normal<S>(n, 1001),
                   v = rpe_test::random_normal<S>(n, 1002), g = rpe_test::random_normal<S>(n, 1003);
    // batch 1: bottom row and right column padded (as DETR), the class token never
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(B * L), 0);
    for (int r = 0; r < height; ++r)
        for (int c = 0; c < width; ++c)
            if (r == height - 1 || c == width - 1) mask[static_cast<std::size_t>(L + skip + r * width + c)] = 1;
    // per-head tables on keys (Product), shared on queries (Cross, two tables), per-head on values
    const auto tk = rpe::make_any_term(rpe::term<mapping::product<>, mode::contextual, target::key, S>(
        {r19}, {.num_heads = 2, .head_dim = 3, .shared_head = false, .skip = 1}));
    const auto tq = rpe::make_any_term(
        rpe::term<mapping::cross<>, mode::contextual, target::query, S>({r19}, {.num_heads = 2, .head_dim = 3, .skip = 1}));
    const auto tv = rpe::make_any_term(rpe::term<mapping::product<>, mode::contextual, target::value, S>(
        {r19}, {.num_heads = 2, .head_dim = 3, .shared_head = false, .skip = 1}));
    auto size_of = [](const std::vector<std::int64_t>& s) {
        std::size_t z = 1;
        for (auto e : s) z *= static_cast<std::size_t>(e);
        return z;
    };
    std::vector<std::vector<S>> tables = {rpe_test::random_normal<S>(size_of(tk->table_shape()), 1010, 0.5),
                                          rpe_test::random_normal<S>(size_of(tq->table_shape()), 1011, 0.5),
                                          rpe_test::random_normal<S>(size_of(tq->table_shape()), 1012, 0.5),
                                          rpe_test::random_normal<S>(size_of(tv->table_shape()), 1013, 0.5)};
    std::vector<std::vector<S>> grads;
    for (const auto& t : tables) grads.emplace_back(t.size());

    rpe::attention_inputs<S> in;
    in.q = cview(q, qshape);
    in.k = cview(k, qshape);
    in.v = cview(v, qshape);
    in.height = height;
    in.width = width;
    in.key_padding_mask = cview(mask, {B, L});
    in.rpe_k = {tk.get(), {cview(tables[0], tk->table_shape())}, {mview(grads[0], tk->table_shape())}};
    in.rpe_q = {tq.get(),
                {cview(tables[1], tq->table_shape()), cview(tables[2], tq->table_shape())},
                {mview(grads[1], tq->table_shape()), mview(grads[2], tq->table_shape())}};
    in.rpe_v = {tv.get(), {cview(tables[3], tv->table_shape())}, {mview(grads[3], tv->table_shape())}};

    std::vector<S> out(n), attn(static_cast<std::size_t>(B * H * L * L));
    const auto loss = [&] {
        rpe::composed_attention_forward(in, mview(out, qshape), mview(attn, {B, H, L, L}));
        return dot(out, g);
    };
    (void)loss();
    std::vector<S> gq(n), gk(n), gv(n);
    rpe::composed_attention_backward(in, {.grad_out = cview(g, qshape),
                                          .grad_q = mview(gq, qshape),
                                          .grad_k = mview(gk, qshape),
                                          .grad_v = mview(gv, qshape),
                                          .saved_attn = cview(attn, {B, H, L, L})});
    check_param(q, gq, loss, "q");
    check_param(k, gk, loss, "k");
    check_param(v, gv, loss, "v");
    const char* names[4] = {"table_k", "table_q_rows", "table_q_cols", "table_v"};
    for (std::size_t t = 0; t < tables.size(); ++t) check_param(tables[t], grads[t], loss, names[t]);
}

}  // namespace rpe_unit_core_gradcheck
