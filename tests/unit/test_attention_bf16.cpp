// The bf16 attention forward (rpe::attention_forward on rpe::bf16 storage): rpe::bf16's rounding
// (hand-checked bits), the vdpbf16ps product against double, and the forward against the float64
// composed attention on the same bf16 values, on both paths (AVX512_BF16 where this build has it,
// and the portable float path, forced with the test hook bf16_portable_only): no RPE, contextual
// Product on k, on q, k, v, bias and Cross terms, shared and per-head tables, skip tokens, both
// masks, strided q/k/v, 1 or 2 threads, RoPE, key_lengths, packed sequences; every golden
// attention case in bf16; errors.
//
// Tolerance (docs/attention.md, "bf16"): the inputs are bf16 values, exact in float and double, so
// the reference sees the same problem. The products accumulate in float (error ~D·2^-24 relative),
// the softmax and the iRPE terms run in float; what is left is bf16 rounding of unit roundoff
// u = 2^-8 (8 significant bits): the output rounded once (≤ u·|out|) and, on the AVX512_BF16
// path, the probabilities rounded to bf16 before P·v (≤ u·Σ_j p_ij·|v_jd|). So each output
// element must satisfy |out − ref| ≤ u·(|ref| + Σ_j p_ij·|v_jd|) + 1e-5·(1 + |ref| + Σ_j p_ij·|v_jd|)
// (the last term: the float computation), and each probability |attn − ref| ≤ u·ref + 1e-6.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "golden.hpp"

namespace {

using rpe::bf16;
namespace cpu = rpe::detail::cpu;
constexpr double u_bf16 = 1.0 / 256;  // 2^-8

// While alive, the bf16 attention takes the portable path (or, with false, its default path).
struct portable_path {
    explicit portable_path(bool on) { cpu::bf16_portable_only = on; }
    ~portable_path() { cpu::bf16_portable_only = false; }
    portable_path(const portable_path&) = delete;
    portable_path& operator=(const portable_path&) = delete;
};

void set_threads([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
}

template <class T>
rpe::tensor_ref<const T> table_view(const std::vector<T>& t, const std::vector<std::int64_t>& shape) {
    rpe::tensor_ref<const T> r;
    r.data = t.data();
    r.rank = static_cast<int>(shape.size());
    for (std::size_t i = 0; i < shape.size(); ++i) r.shape[i] = shape[i];
    return r;
}

// One attention problem in bf16 and in double with the same values (the bf16 ones, exactly).
struct pair_case {
    std::int64_t b = 0, h = 0, l = 0, d = 0;
    std::vector<bf16> q, k, v, mask_add;
    std::vector<double> qd, kd, vd, mask_d;
    std::vector<std::uint8_t> kpm;
    std::vector<std::vector<bf16>> tables;
    std::vector<std::vector<double>> tables_d;
    std::vector<std::unique_ptr<rpe::any_term<double>>> terms;
    rpe::attention_inputs<bf16> in;
    rpe::attention_inputs<double> ind;
    std::mt19937 rng;

    pair_case(std::int64_t b_, std::int64_t h_, std::int64_t d_, int height, int width, int skip, std::uint32_t seed)
        : b(b_), h(h_), l(skip + height * width), d(d_), rng(seed) {
        for (auto [x, y] : {std::pair{&q, &qd}, std::pair{&k, &kd}, std::pair{&v, &vd}}) fill(*x, *y, b * h * l * d, 1.0);
        in.q = {q.data(), {b, h, l, d}};
        in.k = {k.data(), {b, h, l, d}};
        in.v = {v.data(), {b, h, l, d}};
        ind.q = {qd.data(), {b, h, l, d}};
        ind.k = {kd.data(), {b, h, l, d}};
        ind.v = {vd.data(), {b, h, l, d}};
        in.height = ind.height = height;
        in.width = ind.width = width;
        tables.reserve(6);
        tables_d.reserve(6);
    }
    // n values N(0, sigma²) rounded to bf16, into x (bf16) and y (the same values as double)
    void fill(std::vector<bf16>& x, std::vector<double>& y, std::int64_t n, double sigma) {
        std::normal_distribution<double> normal(0.0, sigma);
        x.resize(static_cast<std::size_t>(n));
        y.resize(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) {
            x[i] = bf16(static_cast<float>(normal(rng)));
            y[i] = static_cast<double>(x[i]);
        }
    }
    void add_term(rpe::method method, bool contextual, rpe::target target, bool shared, int skip, double ratio = 1.9) {
        rpe::term_spec spec;
        spec.method = method;
        spec.contextual = contextual;
        spec.target = target;
        spec.ratio(ratio);
        spec.shared_head = shared;
        spec.skip = skip;
        spec.num_heads = static_cast<int>(h);
        spec.head_dim = static_cast<int>(d);
        terms.push_back(rpe::make_term<double>(spec));
        const auto& t = *terms.back();
        rpe::attention_term<bf16>* slot = target == rpe::target::query ? &in.rpe_q
                                          : target == rpe::target::key ? &in.rpe_k
                                                                       : &in.rpe_v;
        rpe::attention_term<double>* slot_d = target == rpe::target::query ? &ind.rpe_q
                                              : target == rpe::target::key ? &ind.rpe_k
                                                                           : &ind.rpe_v;
        slot->term = slot_d->term = &t;  // one descriptor serves both scalar types
        const auto shape = t.table_shape();
        std::int64_t size = 1;
        for (auto e : shape) size *= e;
        for (int n = 0; n < t.num_tables(); ++n) {
            fill(tables.emplace_back(), tables_d.emplace_back(), size, 0.5);
            slot->tables.push_back(table_view(tables.back(), shape));
            slot_d->tables.push_back(table_view(tables_d.back(), shape));
        }
    }
    void add_key_padding_mask(bool whole_batch_element) {
        kpm.resize(static_cast<std::size_t>(b * l));
        std::uniform_int_distribution<int> coin(0, 3);
        for (auto& m : kpm) m = static_cast<std::uint8_t>(coin(rng) == 0);
        if (whole_batch_element) std::fill(kpm.begin(), kpm.begin() + l, std::uint8_t{1});  // fully masked rows
        in.key_padding_mask = ind.key_padding_mask = {kpm.data(), {b, l}};
    }
    void add_attn_mask() {
        fill(mask_add, mask_d, l * l, 1.0);
        std::uniform_int_distribution<int> die(0, 5);
        for (std::size_t i = 0; i < mask_add.size(); ++i)
            if (die(rng) == 0) {
                mask_add[i] = bf16(-std::numeric_limits<float>::infinity());
                mask_d[i] = -std::numeric_limits<double>::infinity();
            }
        in.attn_mask = {mask_add.data(), {l, l}};
        ind.attn_mask = {mask_d.data(), {l, l}};
    }
};

// The float64 composed attention on the case's values, and each output's error bound (file comment).
struct reference {
    std::vector<double> out, attn, bound;
};

reference reference_of(pair_case& c, const rpe::attention_options& opt = {}) {
    reference r;
    r.out.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.d), -3.0);
    r.attn.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.l), -3.0);
    rpe::composed_attention_forward(c.ind, rpe::tensor_ref<double>(r.out.data(), {c.b, c.h, c.l, c.d}),
                                    rpe::tensor_ref<double>(r.attn.data(), {c.b, c.h, c.l, c.l}), opt);
    r.bound.resize(r.out.size());
    for (std::int64_t p = 0; p < c.b * c.h; ++p)
        for (std::int64_t i = 0; i < c.l; ++i)
            for (std::int64_t e = 0; e < c.d; ++e) {
                double pv = 0;  // Σ_j p_ij·|v_je|
                for (std::int64_t j = 0; j < c.l; ++j)
                    pv += r.attn[static_cast<std::size_t>((p * c.l + i) * c.l + j)] *
                          std::fabs(c.vd[static_cast<std::size_t>((p * c.l + j) * c.d + e)]);
                const std::size_t x = static_cast<std::size_t>((p * c.l + i) * c.d + e);
                const double ref = std::fabs(r.out[x]);
                r.bound[x] = u_bf16 * (ref + pv) + 1e-5 * (1 + ref + pv);
            }
    return r;
}

struct bf16_results {
    std::vector<bf16> out, attn;
};

bf16_results run_bf16(pair_case& c, bool portable, const rpe::attention_options& opt = {}) {
    const portable_path hook(portable);
    bf16_results r;
    r.out.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.d), bf16(-3.0f));
    r.attn.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.l), bf16(-3.0f));
    rpe::attention_forward(c.in, rpe::tensor_ref<bf16>(r.out.data(), {c.b, c.h, c.l, c.d}),
                           rpe::tensor_ref<bf16>(r.attn.data(), {c.b, c.h, c.l, c.l}), opt);
    return r;
}

// Worst |got − ref| / bound over the outputs (≤ 1 passes); probabilities checked within u·p + 1e-6.
double check_against(const bf16_results& got, const reference& ref) {
    double worst = 0;
    for (std::size_t x = 0; x < ref.out.size(); ++x) {
        const double g = static_cast<double>(got.out[x]);
        REQUIRE(std::isfinite(g));
        worst = std::max(worst, std::fabs(g - ref.out[x]) / ref.bound[x]);
    }
    double worst_p = 0;
    for (std::size_t x = 0; x < ref.attn.size(); ++x)
        worst_p = std::max(worst_p, std::fabs(static_cast<double>(got.attn[x]) - ref.attn[x]) / (u_bf16 * ref.attn[x] + 1e-6));
    CHECK(worst <= 1.0);
    CHECK(worst_p <= 1.0);
    return worst;
}

// Whether rpe::attention_forward(in, out) is a valid call for these types.
template <class In, class Out>
constexpr bool forward_accepts = requires(const In& in, Out o) {
    rpe::attention_forward(in, o);
};

bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

TEST_CASE("rpe::bf16 rounds to nearest, ties to even; NaN, infinities, signed zero and denormals") {
    CHECK(bf16(1.0f).bits == 0x3f80);
    CHECK(bf16(-2.0f).bits == 0xc000);
    CHECK(bf16(-0.0f).bits == 0x8000);
    // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7: to 1; 1 + 3·2^-8 between 1 + 2^-7 and
    // 1 + 2^-6 (even): to 1 + 2^-6; just above the half rounds up
    CHECK(bf16(1.0f + 0x1p-8f).bits == 0x3f80);
    CHECK(bf16(1.0f + 3 * 0x1p-8f).bits == 0x3f82);
    CHECK(bf16(1.0f + 0x1p-8f + 0x1p-16f).bits == 0x3f81);
    CHECK(static_cast<float>(bf16(3.140625f)) == 3.140625f);  // 8 significant bits: exact
    CHECK(bf16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
    CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7f80);  // above the largest bf16: ∞
    CHECK(bf16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
    const bf16 nan(std::numeric_limits<float>::quiet_NaN());
    CHECK(std::isnan(static_cast<float>(nan)));
    CHECK(std::isnan(static_cast<float>(bf16(std::bit_cast<float>(0x7f800001u)))));  // a signalling NaN stays NaN
    CHECK(bf16(0x1p-133f).bits == 0x0001);                                           // the smallest bf16 denormal is kept
    CHECK(bf16(0x1p-135f).bits == 0x0000);                                           // a quarter of it rounds to 0
    CHECK(rpe::round_to_bf16(0.1f) == 0.10009765625f);
    CHECK(static_cast<double>(bf16::from_bits(0x4049)) == 3.140625);
}

TEST_CASE("bf16 conversions: the vector paths give the scalar rounding's bits (random bit patterns, NaNs, ties)") {
    std::mt19937 rng(3);
    std::vector<float> x(4099);
    for (auto& e : x) e = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    for (std::size_t i = 0; i < x.size(); i += 7)
        x[i] = std::bit_cast<float>((std::bit_cast<std::uint32_t>(x[i]) & 0xffff0000u) | 0x8000u);
    std::vector<bf16> got(x.size());
    cpu::float_to_bf16(x.data(), got.data(), static_cast<std::int64_t>(x.size()));
    bool same = true;
    for (std::size_t i = 0; i < x.size(); ++i) same = same && got[i].bits == bf16::round_bits(x[i]);
    CHECK(same);
    std::vector<float> back(x.size());
    cpu::bf16_to_float(got.data(), back.data(), static_cast<std::int64_t>(x.size()));
    bool exact = true;
    for (std::size_t i = 0; i < x.size(); ++i)
        exact = exact && std::bit_cast<std::uint32_t>(back[i]) == static_cast<std::uint32_t>(got[i].bits) << 16;
    CHECK(exact);
}

TEST_CASE("bf16 product with float accumulation (vdpbf16ps) against double, odd sizes and tails") {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    CHECK(std::string(cpu::bf16_isa()) == "AVX512_BF16");
    for (const auto [m, n, kd] : {std::array<std::int64_t, 3>{1, 1, 1}, std::array<std::int64_t, 3>{9, 33, 7},
                                  std::array<std::int64_t, 3>{17, 16, 64}, std::array<std::int64_t, 3>{8, 65, 197}}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(kd);
        std::mt19937 rng(static_cast<std::uint32_t>(m * 1000 + n * 10 + kd));
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<bf16> a(static_cast<std::size_t>(m * (kd + 1))), b(static_cast<std::size_t>(kd * n)), bt(b.size());
        for (auto& e : a) e = bf16(normal(rng));
        for (auto& e : b) e = bf16(normal(rng));
        for (std::int64_t r = 0; r < kd; ++r)
            for (std::int64_t j = 0; j < n; ++j)
                bt[static_cast<std::size_t>(j * kd + r)] = b[static_cast<std::size_t>(r * n + j)];
        std::vector<bf16> bp(static_cast<std::size_t>(cpu::bf16_pack_size(kd, n))), bpt(bp.size());
        cpu::bf16_pack_rows(b.data(), n, kd, n, bp.data());
        cpu::bf16_pack_transposed(bt.data(), kd, kd, n, bpt.data());
        CHECK(std::equal(bp.begin(), bp.end(), bpt.begin()));
        std::vector<float> c(static_cast<std::size_t>(m * (n + 3)), 0.5f);
        const std::int64_t lda = kd + 1, ldc = n + 3;  // rows further apart than their length
        cpu::bf16_gemm(m, n, kd, a.data(), lda, bp.data(), c.data(), ldc, 0.25f, true);
        double worst = 0;
        for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) {
                double ref = 0, mag = 0;
                for (std::int64_t r = 0; r < kd; ++r) {
                    const double x = static_cast<double>(a[static_cast<std::size_t>(i * lda + r)]) *
                                     static_cast<double>(b[static_cast<std::size_t>(r * n + j)]);
                    ref += x;
                    mag += std::fabs(x);
                }
                ref = 0.5 + 0.25 * ref;
                // float sums of exact products: ≤ kd·2^-24·Σ|a·b| (and the scaling's rounding)
                const double bound = (static_cast<double>(kd) + 2) * 0x1p-24 * (0.25 * mag + std::fabs(ref) + 0.5);
                worst = std::max(worst, std::fabs(static_cast<double>(c[static_cast<std::size_t>(i * ldc + j)]) - ref) / bound);
            }
        CHECK(worst <= 1.0);
        bool untouched = true;  // the columns past n of each row are not written
        for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = n; j < ldc; ++j) untouched = untouched && c[static_cast<std::size_t>(i * ldc + j)] == 0.5f;
        CHECK(untouched);
    }
#else
    CHECK(std::string(cpu::bf16_isa()) == "portable");
    MESSAGE("this build has no AVX512_BF16: only the portable bf16 path is tested");
#endif
}

TEST_CASE("bf16 attention forward against the float64 composed attention: none, iRPE-K, iRPE-QKV, bias, Cross, masks") {
    struct config {
        const char* name;
        std::int64_t b, h, d;
        int height, width, skip;
        const char* terms;  // per letter: P contextual Product, p shared-table Product... (see below)
        bool shared, kpm, attn_mask;
    };
    // terms: "k" contextual Product on k; "qkv" on q, k and v; "Bk" bias Euclidean on k; "Cq" Cross on q
    const config configs[] = {
        {"none", 2, 3, 16, 3, 4, 1, "", true, false, false},
        {"k shared", 2, 3, 16, 4, 4, 1, "k", true, false, false},
        {"k per head, no skip", 1, 2, 8, 5, 3, 0, "k", false, false, false},
        {"qkv shared", 2, 2, 8, 4, 5, 1, "qkv", true, false, false},
        {"qkv per head, masks", 2, 2, 6, 3, 3, 1, "qkv", false, true, true},
        {"bias k, odd D", 1, 3, 5, 4, 4, 1, "Bk", false, false, true},
        {"Cross q, skip 2", 2, 2, 8, 3, 4, 2, "Cq", true, true, false},
        {"deit-like k, D 64", 1, 2, 64, 7, 7, 1, "k", true, false, false},
    };
    int paths_differ = 0;
    for (const auto& cf : configs) {
        CAPTURE(cf.name);
        pair_case c(cf.b, cf.h, cf.d, cf.height, cf.width, cf.skip, 11);
        const std::string t = cf.terms;
        if (t == "k") c.add_term(rpe::method::product, true, rpe::target::key, cf.shared, cf.skip);
        if (t == "qkv")
            for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value})
                c.add_term(rpe::method::product, true, tg, cf.shared, cf.skip);
        if (t == "Bk") c.add_term(rpe::method::euclidean, false, rpe::target::key, cf.shared, cf.skip);
        if (t == "Cq") c.add_term(rpe::method::cross, true, rpe::target::query, cf.shared, cf.skip);
        if (cf.kpm) c.add_key_padding_mask(true);
        if (cf.attn_mask) c.add_attn_mask();
        const auto ref = reference_of(c);
        std::vector<bf16> first;
        for (const bool portable : {false, true}) {
            CAPTURE(portable);
            const auto got = run_bf16(c, portable);
            if (!portable) first = got.out;
            // the hook switches the path: where this build has AVX512_BF16, the two differ (the
            // probabilities rounded to bf16 before P·v) unless every row is fully masked
            if (portable && std::string(cpu::bf16_isa()) == "AVX512_BF16") paths_differ += !same_bits(first, got.out);
            const double worst = check_against(got, ref);
            MESSAGE(std::string(cf.name) << (portable ? std::string(" portable") : std::string(" default path"))
                                         << ": worst |out - ref| / bound " << worst);
        }
    }
    if (std::string(cpu::bf16_isa()) == "AVX512_BF16") CHECK(paths_differ == static_cast<int>(std::size(configs)));
}

TEST_CASE("bf16 attention forward on random configurations (terms, shared tables, skip, masks, row blocks), both paths") {
    const rpe::method methods[] = {rpe::method::product, rpe::method::cross, rpe::method::euclidean, rpe::method::quantization};
    double worst = 0;
    for (std::uint32_t seed = 1; seed <= 24; ++seed) {
        CAPTURE(seed);
        std::mt19937 rng(seed);
        auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
        const int skip = uni(0, 2);
        pair_case c(uni(1, 2), uni(1, 3), uni(1, 9), uni(1, 5), uni(1, 6), skip, seed);
        for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value}) {
            if (uni(0, 2) == 0) continue;
            c.add_term(methods[uni(0, 3)], tg == rpe::target::value || uni(0, 2) != 0, tg, uni(0, 1) == 1, skip,
                       uni(0, 1) ? 1.9 : 1.0);
        }
        if (uni(0, 1)) c.add_key_padding_mask(uni(0, 2) == 0);
        if (uni(0, 1)) c.add_attn_mask();
        const rpe::attention_options opt{.row_block = uni(0, 4)};
        const auto ref = reference_of(c, opt);
        for (const bool portable : {false, true}) {
            CAPTURE(portable);
            worst = std::max(worst, check_against(run_bf16(c, portable, opt), ref));
        }
    }
    MESSAGE("random configurations: worst |out - ref| / bound " << worst);
}

TEST_CASE("bf16 attention: strided q, k, v and 1 or 2 threads give the same bits") {
    pair_case c(2, 2, 8, 4, 4, 1, 5);
    c.add_term(rpe::method::product, true, rpe::target::query, false, 1);
    c.add_term(rpe::method::product, true, rpe::target::key, false, 1);
    c.add_term(rpe::method::product, true, rpe::target::value, true, 1);
    for (const bool portable : {false, true}) {
        CAPTURE(portable);
        set_threads(1);
        const auto one = run_bf16(c, portable);
        set_threads(2);
        const auto two = run_bf16(c, portable);
        CHECK(same_bits(one.out, two.out));
        CHECK(same_bits(one.attn, two.attn));
        // the same q, k, v read in place from a packed (B, L, 3, H, D) buffer
        std::vector<bf16> packed(static_cast<std::size_t>(c.b * c.l * 3 * c.h * c.d));
        for (std::int64_t bb = 0; bb < c.b; ++bb)
            for (std::int64_t hh = 0; hh < c.h; ++hh)
                for (std::int64_t i = 0; i < c.l; ++i)
                    for (std::int64_t e = 0; e < c.d; ++e) {
                        const std::size_t src = static_cast<std::size_t>(((bb * c.h + hh) * c.l + i) * c.d + e);
                        const std::size_t dst = static_cast<std::size_t>((((bb * c.l + i) * 3) * c.h + hh) * c.d + e);
                        packed[dst] = c.q[src];
                        packed[dst + static_cast<std::size_t>(c.h * c.d)] = c.k[src];
                        packed[dst + static_cast<std::size_t>(2 * c.h * c.d)] = c.v[src];
                    }
        const std::int64_t sb = c.l * 3 * c.h * c.d, sh = c.d, sl = 3 * c.h * c.d;
        const auto saved = c.in;
        c.in.q = rpe::tensor_ref<const bf16>::with_strides(packed.data(), {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
        c.in.k = rpe::tensor_ref<const bf16>::with_strides(packed.data() + c.h * c.d, {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
        c.in.v = rpe::tensor_ref<const bf16>::with_strides(packed.data() + 2 * c.h * c.d, {c.b, c.h, c.l, c.d}, {sb, sh, sl, 1});
        const auto strided = run_bf16(c, portable);
        c.in = saved;
        CHECK(same_bits(one.out, strided.out));
    }
    set_threads(2);
}

TEST_CASE("bf16 attention with RoPE: rotated in float (the portable path on every machine)") {
    pair_case c(1, 2, 8, 4, 4, 1, 9);
    c.add_term(rpe::method::product, true, rpe::target::key, true, 1);
    c.in.rope = {.form = rpe::rope::axial{.theta = 100.0f}, .skip = 1};
    c.ind.rope = {.form = rpe::rope::axial{.theta = 100.0f}, .skip = 1};
    const auto ref = reference_of(c);
    const auto a = run_bf16(c, false), b = run_bf16(c, true);
    check_against(a, ref);
    CHECK(same_bits(a.out, b.out));  // RoPE always takes the portable path
}

TEST_CASE("bf16 attention with key_lengths and packed sequences: the portable path, against the float64 composed attention") {
    SUBCASE("key_lengths (qkv contextual Product, key padding mask too)") {
        pair_case c(3, 2, 8, 4, 4, 1, 21);  // L = 17
        for (auto tg : {rpe::target::query, rpe::target::key, rpe::target::value})
            c.add_term(rpe::method::product, true, tg, true, 1);
        c.add_key_padding_mask(false);
        const std::vector<std::int32_t> lengths{5, 17, 1};
        for (std::int64_t bb = 0; bb < c.b; ++bb)  // keep one valid key per batch element: no fully masked row
            c.kpm[static_cast<std::size_t>(bb * c.l)] = 0;
        c.in.key_lengths = c.ind.key_lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {c.b});
        const auto ref = reference_of(c);
        const auto a = run_bf16(c, false), b = run_bf16(c, true);
        check_against(a, ref);
        CHECK(same_bits(a.out, b.out));  // key_lengths always takes the portable path
        CHECK(same_bits(a.attn, b.attn));
        // the padded keys' probabilities are exactly zero; batch element 2 attends to key 0 alone
        for (std::int64_t p = 0; p < c.b * c.h; ++p)
            for (std::int64_t i = 0; i < c.l; ++i)
                for (std::int64_t j = lengths[static_cast<std::size_t>(p / c.h)]; j < c.l; ++j)
                    CHECK(static_cast<float>(a.attn[static_cast<std::size_t>((p * c.l + i) * c.l + j)]) == 0.0f);
        for (std::int64_t i = 0; i < c.l; ++i)
            CHECK(static_cast<float>(a.attn[static_cast<std::size_t>(((2 * c.h) * c.l + i) * c.l)]) == 1.0f);
    }
    SUBCASE("packed: 3 images (grids 2x3, 3x3, 1x4, a class token each), Product on k and v") {
        pair_case c(2, 2, 8, 1, 21, 1, 23);  // L = 7 + 10 + 5 = 22
        c.add_term(rpe::method::product, true, rpe::target::key, false, 1);
        c.add_term(rpe::method::product, true, rpe::target::value, true, 1);
        c.add_attn_mask();
        for (std::int64_t i = 0; i < c.l; ++i) {  // the class tokens' columns stay finite: no fully masked row
            c.mask_add[static_cast<std::size_t>(i * c.l)] = bf16(0.0f);
            c.mask_d[static_cast<std::size_t>(i * c.l)] = 0.0;
            for (std::int64_t j : {7, 17}) {
                c.mask_add[static_cast<std::size_t>(i * c.l + j)] = bf16(0.0f);
                c.mask_d[static_cast<std::size_t>(i * c.l + j)] = 0.0;
            }
        }
        const std::vector<std::int32_t> lengths{7, 10, 5}, grids{2, 3, 3, 3, 1, 4};
        for (auto* in : {&c.in.packed, &c.ind.packed}) {
            in->lengths = rpe::tensor_ref<const std::int32_t>(lengths.data(), {3});
            in->grids = rpe::tensor_ref<const std::int32_t>(grids.data(), {3, 2});
        }
        c.in.height = c.in.width = c.ind.height = c.ind.width = 0;
        const auto ref = reference_of(c);
        // no attn output with packed sequences: the outputs alone, within the same bounds
        std::vector<bf16> outs[2];
        for (const bool portable : {false, true}) {
            const portable_path hook(portable);
            auto& out = outs[portable ? 1 : 0];
            out.assign(static_cast<std::size_t>(c.b * c.h * c.l * c.d), bf16(-3.0f));
            rpe::attention_forward(c.in, rpe::tensor_ref<bf16>(out.data(), {c.b, c.h, c.l, c.d}));
            double worst = 0;
            for (std::size_t x = 0; x < ref.out.size(); ++x) {
                const double g = static_cast<double>(out[x]);
                REQUIRE(std::isfinite(g));
                REQUIRE(std::isfinite(ref.out[x]));
                worst = std::max(worst, std::fabs(g - ref.out[x]) / ref.bound[x]);
            }
            CHECK(worst <= 1.0);
            MESSAGE(std::string("packed") << (portable ? " portable" : " default path") << ": worst |out - ref| / bound "
                                          << worst);
        }
        CHECK(same_bits(outs[0], outs[1]));  // packed sequences always take the portable path
        // the reference's probabilities across images are zero (the bound above assumes it)
        CHECK(ref.attn[static_cast<std::size_t>(0 * c.l + 7)] == 0.0);
        // the attn output is refused with packed sequences, as for float
        std::vector<bf16> out(static_cast<std::size_t>(c.b * c.h * c.l * c.d)),
            attn(static_cast<std::size_t>(c.b * c.h * c.l * c.l));
        CHECK(rpe_test::throws_with<rpe::not_supported>(
            [&] {
                rpe::attention_forward(c.in, rpe::tensor_ref<bf16>(out.data(), {c.b, c.h, c.l, c.d}),
                                       rpe::tensor_ref<bf16>(attn.data(), {c.b, c.h, c.l, c.l}));
            },
            {"attn output", "packed"}));
    }
}

namespace {

// A golden attention case in bf16: q, k, v, tables (float files) rounded to bf16; the term from
// rpe::make_term (its spec from meta.json).
void run_golden_bf16(const std::string& dir, double& worst_kernel, double& worst_golden) {
    using json = nlohmann::json;
    const json meta = rpe_test::read_meta<json>(dir);
    const std::int64_t b = meta.at("batch").get<std::int64_t>(), h = meta.at("heads").get<std::int64_t>(),
                       l = meta.at("L").get<std::int64_t>(), d = meta.at("head_dim").get<std::int64_t>();
    const int height = meta.at("height").get<int>(), width = meta.at("width").get<int>(), skip = meta.at("skip").get<int>();
    pair_case c(b, h, d, height, width, skip, 1);
    const std::vector<std::int64_t> qshape{b, h, l, d};
    auto round_into = [](const std::vector<float>& src, std::vector<bf16>& x, std::vector<double>& y) {
        x.resize(src.size());
        y.resize(src.size());
        for (std::size_t i = 0; i < src.size(); ++i) {
            x[i] = bf16(src[i]);
            y[i] = static_cast<double>(x[i]);
        }
    };
    round_into(rpe_test::load<float>(dir, "q.npy", qshape), c.q, c.qd);
    round_into(rpe_test::load<float>(dir, "k.npy", qshape), c.k, c.kd);
    round_into(rpe_test::load<float>(dir, "v.npy", qshape), c.v, c.vd);
    if (meta.value("key_padding_mask", false)) {
        c.kpm = rpe_test::load<std::uint8_t>(dir, "key_padding_mask.npy", {b, l});
        c.in.key_padding_mask = c.ind.key_padding_mask = {c.kpm.data(), {b, l}};
    }
    const std::string on = meta.at("rpe_on").get<std::string>(), method = meta.at("method").get<std::string>();
    const char letters[3] = {'q', 'k', 'v'};
    const rpe::target targets[3] = {rpe::target::query, rpe::target::key, rpe::target::value};
    for (int t = 0; t < 3; ++t) {
        if (on.find(letters[t]) == std::string::npos) continue;
        rpe::term_spec spec;
        spec.method = method == "product" ? rpe::method::product
                      : method == "cross" ? rpe::method::cross
                                          : rpe::method::euclidean;
        spec.contextual = meta.at("mode").get<std::string>() == "contextual";
        spec.target = targets[t];
        spec.alpha = meta.at("alpha").get<double>();
        spec.beta = meta.at("beta").get<double>();
        spec.gamma = meta.at("gamma").get<double>();
        spec.shared_head = meta.at("shared_head").get<bool>();
        spec.skip = skip;
        spec.num_heads = static_cast<int>(h);
        spec.head_dim = static_cast<int>(d);
        c.terms.push_back(rpe::make_term<double>(spec));
        const auto& term = *c.terms.back();
        REQUIRE(term.num_buckets() == meta.at("num_buckets").get<int>());
        rpe::attention_term<bf16>* slot = t == 0 ? &c.in.rpe_q : t == 1 ? &c.in.rpe_k : &c.in.rpe_v;
        rpe::attention_term<double>* slot_d = t == 0 ? &c.ind.rpe_q : t == 1 ? &c.ind.rpe_k : &c.ind.rpe_v;
        slot->term = slot_d->term = &term;
        const auto shape = term.table_shape();
        for (const auto& e : meta.at("rpe").at(std::string(1, letters[t])).at("tables")) {
            round_into(rpe_test::load<float>(dir, e.at("table").get<std::string>(), shape), c.tables.emplace_back(),
                       c.tables_d.emplace_back());
            slot->tables.push_back(table_view(c.tables.back(), shape));
            slot_d->tables.push_back(table_view(c.tables_d.back(), shape));
        }
    }
    const auto ref = reference_of(c);
    // the golden outputs (float64, from the unrounded inputs)
    const auto golden_out = rpe_test::load<double>(dir, "output_f64.npy", qshape);
    for (const bool portable : {false, true}) {
        CAPTURE(portable);
        const auto got = run_bf16(c, portable);
        worst_kernel = std::max(worst_kernel, check_against(got, ref));
        // against the golden output: the kernel's bound plus the effect of rounding the inputs to
        // bf16 (relative 2^-8 on q, k, v and the tables: logits move by ~2^-7·s·Σ|q||k| ≲ 2^-5 here,
        // outputs by about that times |v|): within 2^-5·(1 + |golden|); measured 2^-7.3
        double w = 0;
        for (std::size_t x = 0; x < golden_out.size(); ++x)
            w = std::max(w, std::fabs(static_cast<double>(got.out[x]) - golden_out[x]) / (1 + std::fabs(golden_out[x])));
        CHECK(w <= 0x1p-5);
        worst_golden = std::max(worst_golden, w);
    }
}

}  // namespace

TEST_CASE("bf16 attention reproduces every golden attention case (bf16-rounded inputs)") {
    namespace fs = std::filesystem;
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(rpe_test::golden("attention")))
        if (fs::exists(e.path() / "meta.json")) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    CHECK(dirs.size() == 9);
    double worst_kernel = 0, worst_golden = 0;
    for (const auto& dir : dirs) {
        INFO("case " << dir);
        run_golden_bf16(dir, worst_kernel, worst_golden);
    }
    MESSAGE("golden in bf16: worst |out - ref| / bound " << worst_kernel << "; worst |out - golden| / (1 + |golden|) "
                                                         << worst_golden);
}

TEST_CASE("bf16 attention: bad arguments are refused; the bf16 backward is not supported") {
    pair_case c(1, 2, 4, 2, 3, 1, 2);
    c.add_term(rpe::method::product, true, rpe::target::key, true, 1);
    std::vector<bf16> out(static_cast<std::size_t>(c.b * c.h * c.l * c.d)), small(out.size() - 1);
    // out of the wrong shape
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::attention_forward(c.in, rpe::tensor_ref<bf16>(small.data(), {c.b, c.h, c.l - 1, c.d}));
        },
        "out"));
    // attn of the wrong shape
    std::vector<bf16> attn(static_cast<std::size_t>(c.l * c.l));
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::attention_forward(c.in, rpe::tensor_ref<bf16>(out.data(), {c.b, c.h, c.l, c.d}),
                                   rpe::tensor_ref<bf16>(attn.data(), {c.l, c.l}));
        },
        "attn"));
    // a table of the wrong shape
    auto bad = c.in;
    bad.rpe_k.tables[0].shape[2] += 1;
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::attention_forward(bad, rpe::tensor_ref<bf16>(out.data(), {c.b, c.h, c.l, c.d}));
        },
        "rpe_k table"));
    // k of another shape than q
    bad = c.in;
    bad.k.shape[3] = 3;
    CHECK(rpe_test::throws_with(
        [&] {
            rpe::attention_forward(bad, rpe::tensor_ref<bf16>(out.data(), {c.b, c.h, c.l, c.d}));
        },
        "k has shape"));
    // the backward in bf16
    std::vector<bf16> g(out.size());
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] {
            rpe::attention_backward(c.in, rpe::tensor_ref<const bf16>(g.data(), {c.b, c.h, c.l, c.d}),
                                    rpe::tensor_ref<bf16>(g.data(), {c.b, c.h, c.l, c.d}),
                                    rpe::tensor_ref<bf16>(g.data(), {c.b, c.h, c.l, c.d}),
                                    rpe::tensor_ref<bf16>(g.data(), {c.b, c.h, c.l, c.d}));
        },
        {"backward in bf16", "not supported"}));
    // mixed types are refused at compile time: one scalar type per call
    static_assert(!forward_accepts<rpe::attention_inputs<bf16>, rpe::tensor_ref<float>>);
    static_assert(!forward_accepts<rpe::attention_inputs<float>, rpe::tensor_ref<bf16>>);
    static_assert(forward_accepts<rpe::attention_inputs<bf16>, rpe::tensor_ref<bf16>>);
}
