// CUDA terms against the CPU backend: random inputs (skip tokens, shared and per-head tables,
// Cross, large K, accumulate mode) in float, double, fp16 and bf16; the golden term vectors in
// float32; the device bucket-id cache; the mapping math evaluated on the device; errors.
//
// Tolerance of a CUDA-vs-CPU check (docs/cuda.md): |gpu − cpu| ≤ ε·(|cpu| + rms(cpu)), with
// ε = 2·u(S)·√N for fp16/bf16 (u the unit roundoff, N the length of the longest sum feeding the
// element; the CPU runs in float32 on the unrounded inputs) and ε = 8·u(S)·√N for float/double
// (same inputs, another summation order).
#include <doctest/doctest.h>

#include <rpe/backend/cuda/term.cuh>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/product3d.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/quantization.hpp>
#include <rpe/mapping/swin.hpp>
#include <rpe/make_term.hpp>
#include <rpe/term_desc.hpp>
#include <rpe/term.hpp>
#include <rpe/vit/alibi_2d.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_test.cuh"
#include "../common/bad_term_calls.hpp"
#include "golden_cases.hpp"

namespace {

using namespace rpe_cuda_test;
using rpe::backend::cuda;
using pw = rpe::index::piecewise;

// As the CPU term: configured by name only (no positional (mapping, heads, head_dim, shared, skip)).
using cuda_key_term = rpe::term<rpe::mapping::product<pw>, rpe::mode::contextual, rpe::target::key, float, cuda>;
static_assert(std::is_constructible_v<cuda_key_term, rpe::mapping::product<pw>, rpe::term_config>);
static_assert(!std::is_constructible_v<cuda_key_term, rpe::mapping::product<pw>, int, int, bool, int>);

template <class S>
double eps_for(double n) {
    const double u = rpe::cuda::unit_roundoff<S>();
    const bool low = std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
    return (low ? 2.0 : 8.0) * u * std::sqrt(std::max(n, 1.0));
}

inline double rms(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x * x;
    return v.empty() ? 0 : std::sqrt(s / static_cast<double>(v.size()));
}

template <class S>
void check_vs_cpu(const std::string& what, const std::vector<double>& gpu, const std::vector<double>& cpu, double n) {
    const double e = eps_for<S>(n);
    check_close(what, gpu, cpu, e * rms(cpu), e);
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
    return std::vector<double>(v.begin(), v.end());
}

/// One random problem for term<M, Md, Tg, ·>: the CUDA term in storage type S against the CPU
/// term in C (double for double, else float) on the same float inputs and the same host ids,
/// `make_ids(cpu_term)` (a grid's, or ids at per-token positions).
template <class S, class M, class Md, rpe::target Tg, class MakeIds>
void compare_term_ids(const M& m, int batch, int heads, int dim, bool shared, int skip, MakeIds&& make_ids, bool accumulate,
                      unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const rpe::term<M, Md, Tg, C> cpu(m, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
    const rpe::term<M, Md, Tg, S, cuda> gpu(m, {.num_heads = heads, .head_dim = dim, .shared_head = shared, .skip = skip});
    constexpr bool bias = std::is_same_v<Md, rpe::mode::bias>;
    constexpr int nt = rpe::detail::num_tables_of<M>();
    const std::shared_ptr<const rpe::bucket_ids> ids = make_ids(cpu);
    const std::int64_t b = batch, h = heads, l = ids->length(), d = dim, k = cpu.num_buckets();
    const auto tshape = cpu.table_shape();
    std::vector<std::int64_t> xshape, oshape;
    if (bias) {
        oshape = {b, h, l, l};  // a batch and all heads: the broadcast form
    } else if (Tg == rpe::target::value) {
        xshape = {b, h, l, l};
        oshape = {b, h, l, d};
    } else {
        xshape = {b, h, l, d};
        oshape = {b, h, l, l};
    }
    INFO("L = " << l << ", K = " << k << ", S = " << sizeof(S) << " bytes, accumulate = " << accumulate);

    std::vector<std::vector<float>> tab(nt), gtab0(nt);
    for (int t = 0; t < nt; ++t) {
        tab[t] = random_floats(count(tshape), seed + 10 + t, 0.5f);
        gtab0[t] = accumulate ? random_floats(count(tshape), seed + 20 + t) : std::vector<float>(count(tshape), 0.f);
    }
    const auto x = xshape.empty() ? std::vector<float>{} : random_floats(count(xshape), seed + 1);
    const auto out0 = accumulate ? random_floats(count(oshape), seed + 2) : std::vector<float>(count(oshape), 0.f);
    const auto gout = random_floats(count(oshape), seed + 3);
    const auto gx0 = xshape.empty()
                         ? std::vector<float>{}
                         : (accumulate ? random_floats(count(xshape), seed + 4) : std::vector<float>(count(xshape), 0.f));

    // CPU (C, unrounded inputs)
    auto cv = [](const std::vector<float>& v) { return std::vector<C>(v.begin(), v.end()); };
    std::vector<std::vector<C>> ctab(nt), cgtab(nt);
    typename decltype(cpu)::tables_type ctrefs;
    typename decltype(cpu)::grad_tables_type cgrefs;
    for (int t = 0; t < nt; ++t) {
        ctab[t] = cv(tab[t]);
        cgtab[t] = cv(gtab0[t]);
        ctrefs[t] = view<const C>(ctab[t].data(), tshape);
        cgrefs[t] = view<C>(cgtab[t].data(), tshape);
    }
    auto cx = cv(x), cout = cv(out0), cgout = cv(gout), cgx = cv(gx0);
    const auto cx_ref = xshape.empty() ? rpe::tensor_ref<const C>{} : view<const C>(cx.data(), xshape);
    const auto mode = accumulate ? rpe::write::accumulate : rpe::write::overwrite;
    cpu.forward(*ids, ctrefs, cx_ref, view<C>(cout.data(), oshape), mode);
    cpu.backward(*ids, ctrefs, cx_ref, view<const C>(cgout.data(), oshape),
                 xshape.empty() ? rpe::tensor_ref<C>{} : view<C>(cgx.data(), xshape), cgrefs, mode);

    // GPU (S, inputs rounded to S), on a stream of its own
    cudaStream_t stream = nullptr;
    RPE_CUDA_CHECK(cudaStreamCreate(&stream));
    std::vector<std::unique_ptr<device_vec<S>>> dtab, dgtab;
    typename decltype(gpu)::tables_type gtrefs;
    typename decltype(gpu)::grad_tables_type ggrefs;
    for (int t = 0; t < nt; ++t) {
        dtab.push_back(std::make_unique<device_vec<S>>(to_storage<S>(tab[t])));
        dgtab.push_back(std::make_unique<device_vec<S>>(to_storage<S>(gtab0[t])));
        gtrefs[t] = dtab[t]->cref(tshape);
        ggrefs[t] = dgtab[t]->ref(tshape);
    }
    device_vec<S> dx(to_storage<S>(x)), dgout(to_storage<S>(gout)), dgx(to_storage<S>(gx0));
    // overwrite mode must not read the old contents: fill them with a value that would show
    device_vec<S> dout(to_storage<S>(accumulate ? out0 : std::vector<float>(out0.size(), 1234.f)));
    const auto dx_ref = xshape.empty() ? rpe::tensor_ref<const S>{} : dx.cref(xshape);
    gpu.forward(*ids, gtrefs, dx_ref, dout.ref(oshape), mode, stream);
    gpu.backward(*ids, gtrefs, dx_ref, dgout.cref(oshape), xshape.empty() ? rpe::tensor_ref<S>{} : dgx.ref(xshape), ggrefs, mode,
                 stream);
    RPE_CUDA_CHECK(cudaStreamSynchronize(stream));
    RPE_CUDA_CHECK(cudaStreamDestroy(stream));

    const double n_fwd = bias ? 1.0 : (Tg == rpe::target::value ? static_cast<double>(l + k * d) : static_cast<double>(d));
    const double n_bwd = static_cast<double>(b * h * l * l);
    check_vs_cpu<S>("out", to_double(dout.host()), as_double(cout), n_fwd + (accumulate ? 1 : 0));
    if (!xshape.empty()) check_vs_cpu<S>("grad_x", to_double(dgx.host()), as_double(cgx), static_cast<double>(l * k + k * d));
    for (int t = 0; t < nt; ++t)
        check_vs_cpu<S>("grad_table[" + std::to_string(t) + "]", to_double(dgtab[t]->host()), as_double(cgtab[t]), n_bwd);
}

/// compare_term_ids on a height × width grid.
template <class S, class M, class Md, rpe::target Tg>
void compare_term(const M& m, int batch, int heads, int dim, bool shared, int skip, int height, int width, bool accumulate,
                  unsigned seed) {
    compare_term_ids<S, M, Md, Tg>(
        m, batch, heads, dim, shared, skip, [&](const auto& t) { return t.bucket_ids(height, width); }, accumulate, seed);
}

template <class S>
void random_suite(bool accumulate, unsigned seed) {
    const pw g = pw::from_ratio(1.9);
    using P = rpe::mapping::product<pw>;
    using X = rpe::mapping::cross<pw>;
    using E = rpe::mapping::euclidean<pw>;
    using Q = rpe::mapping::quantization<pw>;
    using ctx = rpe::mode::contextual;
    using bias = rpe::mode::bias;
    using rpe::target;
    SUBCASE("product, contextual key, shared, skip 1") {
        compare_term<S, P, ctx, target::key>(P{g}, 2, 3, 8, true, 1, 5, 6, accumulate, seed);
    }
    SUBCASE("product, contextual query, per head, skip 0") {
        compare_term<S, P, ctx, target::query>(P{g}, 2, 3, 8, false, 0, 4, 7, accumulate, seed);
    }
    SUBCASE("euclidean, contextual value, shared, skip 1") {
        compare_term<S, E, ctx, target::value>(E{g}, 2, 2, 16, true, 1, 5, 5, accumulate, seed);
    }
    SUBCASE("cross, bias key, per head, skip 1") {
        compare_term<S, X, bias, target::key>(X{g}, 2, 3, 4, false, 1, 6, 5, accumulate, seed);
    }
    SUBCASE("quantization, bias query, shared, skip 0") {
        compare_term<S, Q, bias, target::query>(Q{g}, 1, 2, 4, true, 0, 5, 4, accumulate, seed);
    }
    SUBCASE("cross, contextual query, shared, skip 0") {
        compare_term<S, X, ctx, target::query>(X{g}, 1, 2, 8, true, 0, 5, 7, accumulate, seed);
    }
    SUBCASE("cross, contextual value, per head, skip 1") {
        compare_term<S, X, ctx, target::value>(X{g}, 2, 2, 8, false, 1, 4, 6, accumulate, seed);
    }
    SUBCASE("SAM decomposed rel pos: cross, clip index, contextual key, shared, 4 x 6 grid") {
        const auto m = rpe::vit::decomposed_rel_pos_mapping(4, 6);
        compare_term<S, decltype(m), ctx, target::key>(m, 2, 3, 8, true, 0, 4, 6, accumulate, seed);
    }
    SUBCASE("2D ALiBi: product, clip index, bias key, per head, 5 x 5 grid") {
        const auto m = rpe::vit::alibi_2d_mapping(5, 5);
        compare_term<S, decltype(m), bias, target::key>(m, 1, 4, 4, false, 0, 5, 5, accumulate, seed);
    }
    SUBCASE("product, contextual key and value, K beyond the shared-memory histogram") {
        // ratio 23: beta_int 46, K = 93^2 + 1 = 8650 buckets: the scatter falls back to global atomics
        const P big{pw::from_ratio(23.0)};
        compare_term<S, P, ctx, target::key>(big, 1, 2, 8, true, 1, 9, 10, accumulate, seed);
        compare_term<S, P, ctx, target::value>(big, 1, 2, 8, false, 1, 9, 10, accumulate, seed);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda term matches the CPU term on random inputs", S, float, double, __half, __nv_bfloat16) {
    random_suite<S>(false, 100);
}

TEST_CASE_TEMPLATE("cuda term in accumulate mode matches the CPU term", S, float, __half) { random_suite<S>(true, 200); }

namespace {

/// `count` random coordinates in [lo, hi] (repeats, gaps and negative values when lo < 0).
std::vector<std::int32_t> random_coords(int count, int lo, int hi, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> coord(lo, hi);
    std::vector<std::int32_t> out(static_cast<std::size_t>(count));
    for (auto& c : out) c = coord(rng);
    return out;
}

/// The make_ids of compare_term_ids for tokens at `pos` ((N, axes) int32), keys at `kpos` (empty:
/// the queries'): the CPU term's bucket_ids(positions, key_positions), which the CUDA term takes too.
auto at_positions(const std::vector<std::int32_t>& pos, const std::vector<std::int32_t>& kpos, int axes) {
    return [&pos, &kpos, axes](const auto& t) {
        const std::vector<std::int64_t> shape{static_cast<std::int64_t>(pos.size()) / axes, axes};
        const auto p = view<const std::int32_t>(pos.data(), shape);
        const auto k = kpos.empty() ? rpe::tensor_ref<const std::int32_t>{} : view<const std::int32_t>(kpos.data(), shape);
        const auto ids = t.bucket_ids(p, k);
        REQUIRE(ids->at_positions());
        return ids;
    };
}

/// The 3D case of compare_term_ids through the descriptor functions (a 3D mapping has no
/// rpe::term class): rpe::cuda::term_forward / term_backward in S against rpe::cpu::term_forward
/// / term_backward in C on the same float inputs and the same ids at positions `pos` ((N, 3)),
/// keys at `kpos` (empty: the queries'); overwrite mode.
template <class S>
void compare_desc_at(const rpe::term_desc& desc, const std::vector<std::int32_t>& pos, const std::vector<std::int32_t>& kpos,
                     int batch, unsigned seed) {
    using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
    const std::vector<std::int64_t> pshape{static_cast<std::int64_t>(pos.size()) / 3, 3};
    const auto ids =
        desc.bucket_ids(view<const std::int32_t>(pos.data(), pshape),
                        kpos.empty() ? rpe::tensor_ref<const std::int32_t>{} : view<const std::int32_t>(kpos.data(), pshape));
    REQUIRE(ids->at_positions());
    const bool bias = !desc.contextual();
    const bool value = desc.target() == rpe::target::value;
    const int nt = desc.num_tables();
    const std::int64_t b = batch, h = desc.num_heads(), l = ids->length(), d = desc.head_dim(), k = desc.num_buckets();
    const auto tshape = desc.table_shape();
    std::vector<std::int64_t> xshape, oshape;
    if (bias) {
        oshape = {b, h, l, l};
    } else if (value) {
        xshape = {b, h, l, l};
        oshape = {b, h, l, d};
    } else {
        xshape = {b, h, l, d};
        oshape = {b, h, l, l};
    }
    INFO("3D at positions: L = " << l << ", K = " << k << ", S = " << sizeof(S) << " bytes");
    std::vector<std::vector<float>> tab(nt);
    for (int t = 0; t < nt; ++t) tab[t] = random_floats(count(tshape), seed + 10 + t, 0.5f);
    const auto x = xshape.empty() ? std::vector<float>{} : random_floats(count(xshape), seed + 1);
    const auto gout = random_floats(count(oshape), seed + 3);

    // CPU (C)
    auto cv = [](const std::vector<float>& v) { return std::vector<C>(v.begin(), v.end()); };
    std::vector<std::vector<C>> ctab(nt), cgtab(nt);
    std::vector<rpe::tensor_ref<const C>> ctrefs;
    std::vector<rpe::tensor_ref<C>> cgrefs;
    for (int t = 0; t < nt; ++t) {
        ctab[t] = cv(tab[t]);
        cgtab[t].assign(tab[t].size(), C(0));
        ctrefs.push_back(view<const C>(ctab[t].data(), tshape));
        cgrefs.push_back(view<C>(cgtab[t].data(), tshape));
    }
    auto cx = cv(x), cgout = cv(gout);
    std::vector<C> cout(static_cast<std::size_t>(count(oshape))), cgx(x.size());
    const auto cx_ref = xshape.empty() ? rpe::tensor_ref<const C>{} : view<const C>(cx.data(), xshape);
    rpe::cpu::term_forward<C>(desc, *ids, ctrefs, cx_ref, view<C>(cout.data(), oshape), rpe::write::overwrite);
    rpe::cpu::term_backward<C>(desc, *ids, ctrefs, cx_ref, view<const C>(cgout.data(), oshape),
                               xshape.empty() ? rpe::tensor_ref<C>{} : view<C>(cgx.data(), xshape), cgrefs,
                               rpe::write::overwrite);

    // GPU (S)
    std::vector<std::unique_ptr<device_vec<S>>> dtab, dgtab;
    std::vector<rpe::tensor_ref<const S>> gtrefs;
    std::vector<rpe::tensor_ref<S>> ggrefs;
    for (int t = 0; t < nt; ++t) {
        dtab.push_back(std::make_unique<device_vec<S>>(to_storage<S>(tab[t])));
        dgtab.push_back(std::make_unique<device_vec<S>>(to_storage<S>(std::vector<float>(tab[t].size(), 99.f))));
        gtrefs.push_back(dtab[t]->cref(tshape));
        ggrefs.push_back(dgtab[t]->ref(tshape));
    }
    device_vec<S> dx(to_storage<S>(x)), dgout(to_storage<S>(gout)), dgx(x.size()), dout(cout.size());
    const auto dx_ref = xshape.empty() ? rpe::tensor_ref<const S>{} : dx.cref(xshape);
    rpe::cuda::term_forward<S>(desc, *ids, gtrefs, dx_ref, dout.ref(oshape), rpe::write::overwrite);
    rpe::cuda::term_backward<S>(desc, *ids, gtrefs, dx_ref, dgout.cref(oshape),
                                xshape.empty() ? rpe::tensor_ref<S>{} : dgx.ref(xshape), ggrefs, rpe::write::overwrite);

    const double n_fwd = bias ? 1.0 : (value ? static_cast<double>(l + k * d) : static_cast<double>(d));
    check_vs_cpu<S>("out", to_double(dout.host()), as_double(cout), n_fwd);
    if (!xshape.empty()) check_vs_cpu<S>("grad_x", to_double(dgx.host()), as_double(cgx), static_cast<double>(l * k + k * d));
    for (int t = 0; t < nt; ++t)
        check_vs_cpu<S>("grad_table[" + std::to_string(t) + "]", to_double(dgtab[t]->host()), as_double(cgtab[t]),
                        static_cast<double>(b * h * l * l));
}

template <class S>
void positions_suite(unsigned seed) {
    const pw g = pw::from_ratio(1.9);
    using P = rpe::mapping::product<pw>;
    using X = rpe::mapping::cross<pw>;
    using P3 = rpe::mapping::product3d<pw>;
    using ctx = rpe::mode::contextual;
    using bias = rpe::mode::bias;
    using rpe::target;
    const std::vector<std::int32_t> none;
    const auto grid45 = permuted_grid(1, 4, 5, seed);  // a 4 x 5 grid's 20 positions, scrambled
    const auto irregular = random_coords(2 * 23, -4, 6, seed + 1), keys = random_coords(2 * 23, -4, 6, seed + 2);
    const auto grid234 = permuted_grid(2, 3, 4, seed + 3);  // 24 tokens of a 2 x 3 x 4 grid
    const auto irregular3 = random_coords(3 * 17, -2, 3, seed + 4), keys3 = random_coords(3 * 17, -2, 3, seed + 5);
    SUBCASE("permuted grid: contextual key, shared, skip 1") {
        compare_term_ids<S, P, ctx, target::key>(P{g}, 2, 3, 8, true, 1, at_positions(grid45, none, 2), false, seed);
    }
    SUBCASE("permuted grid: contextual query, per head, skip 0") {
        compare_term_ids<S, P, ctx, target::query>(P{g}, 2, 3, 8, false, 0, at_positions(grid45, none, 2), false, seed);
    }
    SUBCASE("permuted grid: contextual value, shared, skip 1, accumulate") {
        compare_term_ids<S, P, ctx, target::value>(P{g}, 2, 2, 8, true, 1, at_positions(grid45, none, 2), true, seed);
    }
    SUBCASE("key positions apart: contextual key, per head, skip 1") {
        compare_term_ids<S, P, ctx, target::key>(P{g}, 2, 2, 8, false, 1, at_positions(irregular, keys, 2), false, seed);
    }
    SUBCASE("key positions apart: contextual query, shared, skip 1") {
        compare_term_ids<S, P, ctx, target::query>(P{g}, 1, 2, 8, true, 1, at_positions(irregular, keys, 2), false, seed);
    }
    SUBCASE("key positions apart: contextual value, per head, skip 0") {
        compare_term_ids<S, P, ctx, target::value>(P{g}, 2, 2, 8, false, 0, at_positions(irregular, keys, 2), false, seed);
    }
    SUBCASE("key positions apart: bias key and query, per head, skip 1") {
        compare_term_ids<S, P, bias, target::key>(P{g}, 2, 3, 4, false, 1, at_positions(irregular, keys, 2), false, seed);
        compare_term_ids<S, P, bias, target::query>(P{g}, 2, 3, 4, false, 1, at_positions(irregular, keys, 2), true, seed);
    }
    SUBCASE("cross: contextual key (two tables), irregular positions, skip 1") {
        compare_term_ids<S, X, ctx, target::key>(X{g}, 2, 2, 8, true, 1, at_positions(irregular, none, 2), false, seed);
    }
    SUBCASE("cross: contextual query and bias key, key positions apart, skip 1") {
        compare_term_ids<S, X, ctx, target::query>(X{g}, 1, 2, 8, false, 1, at_positions(irregular, keys, 2), false, seed);
        compare_term_ids<S, X, bias, target::key>(X{g}, 2, 2, 4, false, 1, at_positions(irregular, keys, 2), false, seed);
    }
    // 3D (product3d, a Mapping3D: the descriptor functions)
    const P3 m3{g, g, g};
    auto desc3 = [&](bool contextual, target tg, bool shared, int skip) {
        return rpe::make_term_desc(m3, contextual, tg, {.num_heads = 2, .head_dim = 8, .shared_head = shared, .skip = skip});
    };
    SUBCASE("3D: contextual key and value on a permuted 2 x 3 x 4 grid, skip 1") {
        compare_desc_at<S>(desc3(true, target::key, true, 1), grid234, none, 2, seed);
        compare_desc_at<S>(desc3(true, target::value, false, 1), grid234, none, 1, seed);
    }
    SUBCASE("3D: contextual query and bias query, key positions apart, skip 1") {
        compare_desc_at<S>(desc3(true, target::query, false, 1), irregular3, keys3, 2, seed);
        compare_desc_at<S>(desc3(false, target::query, true, 1), irregular3, keys3, 2, seed);
    }
    SUBCASE("cross: contextual value, permuted grid, skip 0") {
        compare_term_ids<S, X, ctx, target::value>(X{g}, 2, 2, 8, false, 0, at_positions(grid45, none, 2), false, seed);
    }
}

}  // namespace

// Ids at per-token positions (docs/positions.md): the CUDA term reads the bounding box's per-offset
// ids and the tokens' linear positions; the CPU term at the same positions is the reference.
TEST_CASE_TEMPLATE("cuda term at per-token positions matches the CPU term", S, float, double, __half) { positions_suite<S>(400); }

TEST_CASE("ids at a grid's own coordinates give the grid's term (cuda)") {
    // positions equal to the grid's own coordinates in token order: the grid's ids exactly, so
    // the CUDA term at positions equals the CUDA term on the grid (same device, same order of sums)
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::bias, rpe::target::key, float, cuda> t(
        P{pw::from_ratio(1.9)}, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1});
    std::vector<std::int32_t> coords;
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 5; ++c) coords.insert(coords.end(), {r, c});
    const auto grid = t.bucket_ids(4, 5);
    const auto at = t.bucket_ids(view<const std::int32_t>(coords.data(), {20, 2}));
    REQUIRE(at->at_positions());
    const auto table = random_floats(2 * t.num_buckets(), 9);
    device_vec<float> dtable(table), a(2 * 21 * 21), b(2 * 21 * 21);
    const std::vector<std::int64_t> tshape{2, t.num_buckets()}, oshape{1, 2, 21, 21};
    t.forward(*grid, dtable.cref(tshape), {}, a.ref(oshape), rpe::write::overwrite);
    t.forward(*at, dtable.cref(tshape), {}, b.ref(oshape), rpe::write::overwrite);
    CHECK(a.host() == b.host());  // a gather: bit-identical
}

namespace {

// Runs f(term type tag) for the golden case's compile-time term type (piecewise index).
template <class S, class F>
void with_golden_term(const term_case& c, F&& f) {
    const pw g{c.alpha, c.beta, c.gamma};
    auto by_mode = [&](auto mapping) {
        using M = decltype(mapping);
        using ctx = rpe::mode::contextual;
        using bias = rpe::mode::bias;
        if (c.contextual) {
            if (c.target == 'k')
                f(rpe::term<M, ctx, rpe::target::key, S, cuda>(
                    mapping, {.num_heads = c.heads, .head_dim = c.head_dim, .shared_head = c.shared_head, .skip = c.skip}));
            else if (c.target == 'q')
                f(rpe::term<M, ctx, rpe::target::query, S, cuda>(
                    mapping, {.num_heads = c.heads, .head_dim = c.head_dim, .shared_head = c.shared_head, .skip = c.skip}));
            else
                f(rpe::term<M, ctx, rpe::target::value, S, cuda>(
                    mapping, {.num_heads = c.heads, .head_dim = c.head_dim, .shared_head = c.shared_head, .skip = c.skip}));
        } else {
            if (c.target == 'k')
                f(rpe::term<M, bias, rpe::target::key, S, cuda>(
                    mapping, {.num_heads = c.heads, .head_dim = c.head_dim, .shared_head = c.shared_head, .skip = c.skip}));
            else
                f(rpe::term<M, bias, rpe::target::query, S, cuda>(
                    mapping, {.num_heads = c.heads, .head_dim = c.head_dim, .shared_head = c.shared_head, .skip = c.skip}));
        }
    };
    if (c.method == "product")
        by_mode(rpe::mapping::product<pw>{g});
    else if (c.method == "cross")
        by_mode(rpe::mapping::cross<pw>{g});
    else if (c.method == "euclidean")
        by_mode(rpe::mapping::euclidean<pw>{g});
    else if (c.method == "quantization")
        by_mode(rpe::mapping::quantization<pw>{g});
    else
        FAIL("unknown method " << c.method);
}

}  // namespace

TEST_CASE("cuda term matches the golden term vectors in float32") {
    const auto cases = load_term_cases(std::string(RPE_TEST_DATA_DIR) + "/golden");
    REQUIRE(cases.size() >= 20);
    for (const auto& c : cases) {
        INFO("case " << c.name);
        with_golden_term<float>(c, [&](const auto& t) {
            using T = std::decay_t<decltype(t)>;
            const auto ids = t.bucket_ids(c.height, c.width);
            std::vector<std::unique_ptr<device_vec<float>>> dt, dg;
            typename T::tables_type trefs;
            typename T::grad_tables_type grefs;
            REQUIRE(static_cast<int>(c.tables.size()) == T::num_tables);
            for (int u = 0; u < T::num_tables; ++u) {
                dt.push_back(std::make_unique<device_vec<float>>(c.tables[u]));
                dg.push_back(std::make_unique<device_vec<float>>(c.tables[u].size()));
                trefs[u] = dt[u]->cref(c.table_shape);
                grefs[u] = dg[u]->ref(c.table_shape);
            }
            device_vec<float> dx(c.x), dgo(c.grad_out), dout(c.grad_out.size()), dgx(c.x.size());
            const auto xr = c.x.empty() ? rpe::tensor_ref<const float>{} : dx.cref(c.x_shape);
            t.forward(*ids, trefs, xr, dout.ref(c.out_shape), rpe::write::overwrite);
            t.backward(*ids, trefs, xr, dgo.cref(c.out_shape), c.x.empty() ? rpe::tensor_ref<float>{} : dgx.ref(c.x_shape), grefs,
                       rpe::write::overwrite);
            const auto out = dout.host();
            check_close(c.name + " output", as_double(out), c.out.values, c.out.atol, c.out.rtol);
            if (!c.x.empty())
                check_close(c.name + " grad_input", as_double(dgx.host()), c.grad_x.values, c.grad_x.atol, c.grad_x.rtol);
            for (int u = 0; u < T::num_tables; ++u)
                check_close(c.name + " " + c.grad_tables[u].file, as_double(dg[u]->host()), c.grad_tables[u].values,
                            c.grad_tables[u].atol, c.grad_tables[u].rtol);
        });
    }
}

namespace {
template <class View>
__global__ void eval_ids_kernel(View v, std::int64_t n, std::int32_t* out) {
    const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e < n * n) out[e] = static_cast<std::int32_t>(v(e / n, e % n));
}

template <class View>
__global__ void eval_row_kernel(View v, std::int64_t i, std::int64_t n, std::int32_t* out) {
    const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j < n) out[j] = static_cast<std::int32_t>(v(i, j));
}

// The ids of table t as the kernels see them, evaluated on the device: out[i·L + j] = id(i, j),
// out[L² + i·L + j] = id(j, i) (the transposed view).
void device_ids(const rpe::cuda::device_bucket_ids& d, int t, std::vector<std::int32_t>& out) {
    const std::int64_t n = d.length();
    rpe_cuda_test::device_vec<std::int32_t> buf(static_cast<std::size_t>(2 * n * n));
    for (int transposed = 0; transposed < 2; ++transposed)
        d.visit(t, transposed == 1, [&](const auto& view) {
            const auto blocks = static_cast<unsigned>((n * n + 127) / 128);
            eval_ids_kernel<<<blocks, 128>>>(view, n, buf.get() + transposed * n * n);
            RPE_CUDA_CHECK(cudaGetLastError());
        });
    out = buf.host();
}
}  // namespace

TEST_CASE("device bucket ids are cached per configuration and device") {
    auto& cache = rpe::cuda::device_bucket_cache::global();
    cache.clear();
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::bias, rpe::target::key, float, cuda> t1(P{pw::from_ratio(1.9)},
                                                                          {.num_heads = 2, .head_dim = 4, .skip = 1});
    const rpe::term<P, rpe::mode::bias, rpe::target::key, float, cuda> t0(P{pw::from_ratio(1.9)},
                                                                          {.num_heads = 2, .head_dim = 4});
    const auto a = cache.get(*t1.bucket_ids(5, 5));
    const auto b = cache.get(*t1.bucket_ids(5, 5));
    CHECK(a.get() == b.get());
    CHECK(cache.builds() == 1);
    const auto c = cache.get(*t0.bucket_ids(5, 5));  // same mapping and grid, other skip: other ids
    CHECK(c.get() != a.get());
    CHECK(cache.builds() == 2);
    CHECK(a->length() == 26);
    CHECK(a->num_buckets() == 50);
    CHECK(a->id_bytes() == 1);
    CHECK(c->num_buckets() == 49);
    // the device holds the per-offset ids only ((2H-1)(2W-1) bytes), and its id views give the
    // host's ids in both orientations
    CHECK(a->bytes() == 9 * 9);
    const auto ids = t1.bucket_ids(5, 5);
    std::vector<std::int32_t> got(2 * 26 * 26, -1);
    device_ids(*a, 0, got);
    int wrong = 0;
    for (int i = 0; i < 26; ++i)
        for (int j = 0; j < 26; ++j) wrong += (got[i * 26 + j] != ids->at(0, i, j)) + (got[676 + i * 26 + j] != ids->at(0, j, i));
    CHECK(wrong == 0);
}

TEST_CASE("device ids at per-token positions: the host's ids through the views, both orientations") {
    using P = rpe::mapping::product<pw>;
    using X = rpe::mapping::cross<pw>;
    const auto pos = random_coords(2 * 13, -3, 5, 11), kpos = random_coords(2 * 13, -3, 5, 12);
    const std::vector<std::int64_t> shape{13, 2};
    const auto p = view<const std::int32_t>(pos.data(), shape), k = view<const std::int32_t>(kpos.data(), shape);
    const std::shared_ptr<const rpe::bucket_ids> cases[] = {rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, p, 1),
                                                            rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, p, k, 2),
                                                            rpe::build_bucket_ids(X{pw::from_ratio(1.9)}, p, k, 1)};
    for (const auto& ids : cases) {
        REQUIRE(ids->at_positions());
        const std::int64_t n = ids->length();
        const rpe::detail::gpu::term_device_ids dev(*ids, nullptr);
        for (int t = 0; t < ids->num_tables(); ++t) {
            CAPTURE(t);
            rpe_cuda_test::device_vec<std::int32_t> buf(static_cast<std::size_t>(2 * n * n));
            for (int transposed = 0; transposed < 2; ++transposed)
                dev.visit(t, transposed == 1, [&](const auto& view) {
                    eval_ids_kernel<<<static_cast<unsigned>((n * n + 127) / 128), 128>>>(view, n, buf.get() + transposed * n * n);
                    RPE_CUDA_CHECK(cudaGetLastError());
                });
            const auto got = buf.host();
            // the transposed view is the query target's: the host's transposed rows (offset
            // kpos_j − qpos_i; id(j, i) only when the keys share the queries' positions)
            std::vector<std::int32_t> row_buf(static_cast<std::size_t>(n));
            int wrong = 0;
            for (std::int64_t i = 0; i < n; ++i) {
                const std::int32_t* query_row = ids->rows<std::int32_t>(t, i, 1, true, row_buf.data());
                for (std::int64_t j = 0; j < n; ++j)
                    wrong += (got[static_cast<std::size_t>(i * n + j)] != ids->at(t, static_cast<int>(i), static_cast<int>(j))) +
                             (got[static_cast<std::size_t>(n * n + i * n + j)] != query_row[j]);
            }
            CHECK(wrong == 0);
        }
    }
}

TEST_CASE("device ids of a 256 x 256 grid: per-offset ids only, the host's ids through the views") {
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::bias, rpe::target::key, float, cuda> t(P{pw::from_ratio(1.9)},
                                                                         {.num_heads = 2, .head_dim = 4, .skip = 1});
    const auto ids = t.bucket_ids(256, 256);  // L = 65537: on-the-fly on the host
    CHECK(ids->storage_kind() == rpe::id_storage::on_the_fly);
    const auto dev = rpe::cuda::device_bucket_cache::global().get(*ids);
    CHECK(dev->bytes() == 511 * 511 * ids->id_bytes());  // 261 kB, not 2 x 4.3 GB of (L, L) ids
    // rows of both views against the host (all of L^2 would be 4.3 G comparisons)
    const std::int64_t n = ids->length();
    rpe_cuda_test::device_vec<std::int32_t> buf(static_cast<std::size_t>(n));
    for (const std::int64_t i : {std::int64_t{0}, std::int64_t{1}, std::int64_t{300}, std::int64_t{40000}, n - 1})
        for (const bool transposed : {false, true}) {
            CAPTURE(i);
            CAPTURE(transposed);
            dev->visit(0, transposed, [&](const auto& view) {
                eval_row_kernel<<<static_cast<unsigned>((n + 127) / 128), 128>>>(view, i, n, buf.get());
                RPE_CUDA_CHECK(cudaGetLastError());
            });
            const auto got = buf.host();
            int wrong = 0;
            for (std::int64_t j = 0; j < n; ++j)
                wrong += got[static_cast<std::size_t>(j)] != (transposed ? ids->at(0, j, i) : ids->at(0, i, j));
            CHECK(wrong == 0);
        }
}

namespace {
template <class M>
__global__ void buckets_on_device(M m, int height, int width, int table, int* out) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    const int ow = 2 * width - 1;
    if (e >= (2 * height - 1) * ow) return;
    out[e] = rpe::detail::bucket_of(m, e / ow - (height - 1), e % ow - (width - 1), table);
}

template <class M>
int device_host_bucket_mismatches(const M& m, int height, int width) {
    const int cells = (2 * height - 1) * (2 * width - 1);
    int wrong = 0;
    for (int t = 0; t < rpe::detail::num_tables_of<M>(); ++t) {
        device_vec<int> d(static_cast<std::size_t>(cells));
        buckets_on_device<<<(cells + 127) / 128, 128>>>(m, height, width, t, d.get());
        RPE_CUDA_CHECK(cudaGetLastError());
        const auto got = d.host();
        for (int e = 0; e < cells; ++e)
            wrong +=
                got[e] != rpe::detail::bucket_of(m, e / (2 * width - 1) - (height - 1), e % (2 * width - 1) - (width - 1), t);
    }
    return wrong;
}
}  // namespace

TEST_CASE("mapping math gives the same buckets on the device as on the host") {
    // The kernels read ids built on the host; this checks that the RPE_HOST_DEVICE policies also
    // agree on the device (logf there is not the host's: a difference would show here).
    for (double ratio : {1.9, 2.0, 20.0, 33.0}) {
        const pw g = pw::from_ratio(ratio);
        INFO("ratio " << ratio);
        CHECK(device_host_bucket_mismatches(rpe::mapping::product<pw>{g}, 40, 40) == 0);
        CHECK(device_host_bucket_mismatches(rpe::mapping::cross<pw>{g}, 40, 40) == 0);
        CHECK(device_host_bucket_mismatches(rpe::mapping::euclidean<pw>{g}, 40, 40) == 0);
        CHECK(device_host_bucket_mismatches(rpe::mapping::quantization<pw>{g}, 40, 40) == 0);
    }
    // the ViT encodings' mappings (issue 15): clip index with beta from the grid
    CHECK(device_host_bucket_mismatches(rpe::vit::decomposed_rel_pos_mapping(40, 33), 40, 33) == 0);
    CHECK(device_host_bucket_mismatches(rpe::vit::alibi_2d_mapping(33, 40), 33, 40) == 0);
}

TEST_CASE("cuda term rejects bad arguments before any launch") {
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, float, cuda> t(P{pw::from_ratio(1.9)},
                                                                               {.num_heads = 2, .head_dim = 8, .skip = 1});
    const auto ids = t.bucket_ids(3, 3);  // L = 10, K = 50
    device_vec<float> table(8 * 50), x(2 * 2 * 10 * 8), out(2 * 2 * 10 * 10);
    CHECK_THROWS_AS(
        t.forward(*ids, table.cref({1, 8, 49}), x.cref({2, 2, 10, 8}), out.ref({2, 2, 10, 10}), rpe::write::overwrite),
        rpe::invalid_argument);
    CHECK_THROWS_AS(t.forward(*ids, table.cref({1, 8, 50}), x.cref({2, 2, 9, 8}), out.ref({2, 2, 10, 10}), rpe::write::overwrite),
                    rpe::invalid_argument);
    CHECK_THROWS_AS(t.forward(*ids, table.cref({1, 8, 50}), x.cref({2, 2, 10, 8}), x.ref({2, 2, 10, 10}), rpe::write::overwrite),
                    rpe::invalid_argument);
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, float, cuda> t0(P{pw::from_ratio(1.9)},
                                                                                {.num_heads = 2, .head_dim = 8});
    CHECK_THROWS_WITH_AS(
        t0.forward(*ids, table.cref({1, 8, 49}), x.cref({2, 2, 10, 8}), out.ref({2, 2, 10, 10}), rpe::write::overwrite),
        doctest::Contains("[rpe.term] bucket ids have skip = 1"), rpe::invalid_argument);
    try {
        RPE_CUDA_CHECK(cudaSetDevice(100000));
        FAIL("cudaSetDevice(100000) succeeded");
    } catch (const rpe::cuda_error& e) {
        CHECK(std::string(e.what()).find("[rpe.cuda] cudaSetDevice(100000) failed") == 0);
        CHECK(e.code() != cudaSuccess);
        CHECK(dynamic_cast<const rpe::runtime_error*>(&e) != nullptr);
    }
    RPE_CUDA_CHECK(cudaSetDevice(0));
}

// The shared list of bad calls, host-side: every check fails before any CUDA call, so this runs
// without a device too (CTest cuda.host_checks runs `rpe_cuda_tests --host-only`).
TEST_SUITE("host") {
TEST_CASE("cuda term rejects the shared list of bad calls with the CPU term's messages") {
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, float, cuda> key(P{pw::from_ratio(1.9)},
                                                                                 {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::bias, rpe::target::key, float, cuda> bias(P{pw::from_ratio(1.9)},
                                                                            {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::contextual, rpe::target::value, float, cuda> value(P{pw::from_ratio(1.9)},
                                                                                     {.num_heads = 2, .head_dim = 8, .skip = 1});
    rpe_test::check_bad_term_calls<float>(key, bias, value);
}

TEST_CASE("the device id cache refuses ids at positions (their box goes up instead) before any CUDA call") {
    using P = rpe::mapping::product<pw>;
    const std::vector<std::int32_t> pos = {0, 0, 1, 2, 3, 1};
    const auto ids = rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, rpe::tensor_ref<const std::int32_t>(pos.data(), {3, 2}), 1);
    REQUIRE(ids->at_positions());
    CHECK(ids->box() != nullptr);
    CHECK(!ids->box()->at_positions());
    try {
        (void)rpe::cuda::device_bucket_cache::global().get(*ids);
        FAIL("ids at positions were accepted by the device id cache");
    } catch (const rpe::not_supported& e) {
        CHECK(std::string(e.what()).find("[rpe.bucket_ids] bucket ids at per-token positions (3 positions) are not a grid's") ==
              0);
    }
}

TEST_CASE("device_id_view at positions gives bucket_ids::at (evaluated on the host over host copies)") {
    // the view the kernels get at positions (the box's per-offset ids, the ids' grid and linear
    // positions), here over the host's own arrays: every pair, both orientations, 2D and 3D, Cross
    using P = rpe::mapping::product<pw>;
    using X = rpe::mapping::cross<pw>;
    using P3 = rpe::mapping::product3d<pw>;
    const pw g = pw::from_ratio(1.9);
    const auto pos = random_coords(2 * 13, -3, 5, 11), kpos = random_coords(2 * 13, -3, 5, 12);
    const auto pos3 = random_coords(3 * 11, -2, 3, 13), kpos3 = random_coords(3 * 11, -2, 3, 14);
    const auto p = view<const std::int32_t>(pos.data(), {13, 2}), k = view<const std::int32_t>(kpos.data(), {13, 2});
    const auto p3 = view<const std::int32_t>(pos3.data(), {11, 3}), k3 = view<const std::int32_t>(kpos3.data(), {11, 3});
    const std::shared_ptr<const rpe::bucket_ids> cases[] = {
        rpe::build_bucket_ids(P{g}, p, 1), rpe::build_bucket_ids(P{g}, p, k, 2), rpe::build_bucket_ids(X{g}, p, k, 1),
        rpe::build_bucket_ids(P3{g, g, g}, p3, k3, 1)};
    for (const auto& ids : cases) {
        REQUIRE(ids->at_positions());
        const int n = ids->length();
        for (int t = 0; t < ids->num_tables(); ++t)
            ids->box()->visit_offsets(t, [&](const auto* off, std::size_t) {
                using Id = std::remove_cvref_t<decltype(*off)>;
                int wrong = 0;
                // transposed (the query target): bucket_ids::rows(..., transposed), the id of offset
                // kpos_j − qpos_i (id(j, i) when the keys are at the queries' positions)
                std::vector<std::int64_t> row(static_cast<std::size_t>(n));
                for (const bool transposed : {false, true}) {
                    const rpe::cuda::device_id_view<Id> v{off, ids->grid(), transposed, ids->linear_positions()};
                    for (int i = 0; i < n; ++i) {
                        const std::int64_t* r = ids->rows<std::int64_t>(t, i, 1, true, row.data());
                        for (int j = 0; j < n; ++j) wrong += v(i, j) != (transposed ? r[j] : ids->at(t, i, j));
                    }
                }
                CHECK(wrong == 0);
            });
    }
}

TEST_CASE("cuda term at positions: the shared checks run before any CUDA call") {
    // host buffers: ids at 3 positions (L = 4) against x and out of L = 5 fail in the shared checks
    using P = rpe::mapping::product<pw>;
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, float, cuda> key(P{pw::from_ratio(1.9)},
                                                                                 {.num_heads = 1, .head_dim = 2, .skip = 1});
    const std::vector<std::int32_t> pos = {0, 0, 1, 2, 3, 1};
    const auto ids = key.bucket_ids(rpe::tensor_ref<const std::int32_t>(pos.data(), {3, 2}));
    REQUIRE(ids->length() == 4);
    std::vector<float> table(2 * 50), x(5 * 2), out(5 * 5);
    CHECK_THROWS_AS(key.forward(*ids, {table.data(), {1, 2, 50}}, {x.data(), {1, 1, 5, 2}}, {out.data(), {1, 1, 5, 5}},
                                rpe::write::overwrite),
                    rpe::invalid_argument);
    CHECK_THROWS_AS(key.backward(*ids, {table.data(), {1, 2, 50}}, {x.data(), {1, 1, 5, 2}}, {out.data(), {1, 1, 5, 5}},
                                 {x.data(), {1, 1, 5, 2}}, {table.data(), {1, 2, 50}}, rpe::write::overwrite),
                    rpe::invalid_argument);
}
}  // TEST_SUITE("host")

namespace rpe_cuda_test {
bool has_device(std::string& why, std::string& what) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        why = err != cudaSuccess ? cudaGetErrorString(err) : "0 devices";
        (void)cudaGetLastError();
        return false;
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        what = std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
               std::to_string(prop.multiProcessorCount) + " SMs";
    return true;
}
}  // namespace rpe_cuda_test

TEST_CASE("cuda Swin and BEiT bias terms match the CPU term (BEiT's three class-token buckets included)") {
    using rpe::target;
    using bias = rpe::mode::bias;
    const rpe::mapping::swin sw{.window_h = 4, .window_w = 5};
    const rpe::mapping::beit be{.window_h = 3, .window_w = 4};
    compare_term<float, rpe::mapping::swin, bias, target::key>(sw, 2, 3, 8, false, 0, 4, 5, false, 300);
    compare_term<float, rpe::mapping::swin, bias, target::key>(sw, 1, 2, 8, false, 0, 3, 5, true,
                                                               310);  // a grid below the window
    compare_term<float, rpe::mapping::beit, bias, target::key>(be, 2, 3, 8, false, 1, 3, 4, false, 320);
    compare_term<float, rpe::mapping::beit, bias, target::query>(be, 2, 2, 8, true, 1, 3, 4, false, 330);
    CHECK(device_host_bucket_mismatches(rpe::mapping::swin{.window_h = 7, .window_w = 7}, 7, 7) == 0);
    CHECK(device_host_bucket_mismatches(rpe::mapping::beit{.window_h = 14, .window_w = 12}, 14, 12) == 0);
}
