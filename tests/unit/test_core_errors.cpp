// Errors (docs/errors.md): every bad input at the host API throws one of rpe's
// exceptions, whose message names the parameter and its value, and a call that throws writes
// nothing. (Bias mode on values: run time in test_core_term.cpp, compile time in
// tests/static/test_concepts.cpp.)
#include <doctest/doctest.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/backend/cpu/composed_attention.hpp>
#include <rpe/error.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_errors {

namespace {

using rpe::target;
using rpe::index::piecewise;
using rpe_test::cview;
using rpe_test::mview;
using rpe_test::throws_with;
namespace mapping = rpe::mapping;
namespace mode = rpe::mode;

constexpr double qnan = std::numeric_limits<double>::quiet_NaN();
constexpr double pinf = std::numeric_limits<double>::infinity();

const piecewise r19 = piecewise::from_ratio(1.9);

// Each rpe exception derives from exactly one of the three standard exceptions.
template <class E>
constexpr int standard_bases = int{std::is_base_of_v<std::invalid_argument, E>} + int{std::is_base_of_v<std::out_of_range, E>} +
                               int{std::is_base_of_v<std::runtime_error, E>};
static_assert(std::is_base_of_v<std::invalid_argument, rpe::invalid_argument> && standard_bases<rpe::invalid_argument> == 1);
static_assert(std::is_base_of_v<std::out_of_range, rpe::out_of_range> && standard_bases<rpe::out_of_range> == 1);
static_assert(std::is_base_of_v<std::runtime_error, rpe::runtime_error> && standard_bases<rpe::runtime_error> == 1);
static_assert(std::is_base_of_v<std::exception, rpe::invalid_argument> && std::is_base_of_v<std::exception, rpe::out_of_range> &&
              std::is_base_of_v<std::exception, rpe::runtime_error>);

// A custom mapping with a wrong id: `bad` for the offset (1, 0), 0 elsewhere.
struct faulty_mapping {
    int bad = 5;
    int num_buckets() const { return 5; }
    int bucket(int dr, int dc) const { return dr == 1 && dc == 0 ? bad : 0; }
    friend bool operator==(const faulty_mapping&, const faulty_mapping&) = default;
};

using key_term = rpe::term<mapping::product<>, mode::contextual, target::key, double>;
using value_term = rpe::term<mapping::product<>, mode::contextual, target::value, double>;
using bias_term = rpe::term<mapping::product<>, mode::bias, target::key, double>;

}  // namespace

TEST_CASE("errors: every rpe exception is caught as std::exception and as its standard base") {
    bool caught = false;
    try {
        piecewise{2.0, 1.0, 8.0}.validate();
    } catch (const std::exception& e) {
        caught = std::string(e.what()).rfind("[rpe.", 0) == 0;  // stable prefix
    }
    CHECK(caught);
    CHECK_THROWS_AS((piecewise{2.0, 1.0, 8.0}.validate()), std::invalid_argument);
    CHECK_THROWS_AS((void)rpe::build_bucket_ids(faulty_mapping{}, 3, 3, 0), std::out_of_range);
    CHECK_THROWS_AS((void)rpe::build_bucket_ids(mapping::product<>{r19}, 3, 3, 0)->at(0, 9, 0), rpe::out_of_range);
}

TEST_CASE("errors: invalid alpha, beta, gamma name the parameter and its value") {
    SUBCASE("through piecewise::validate") {
        CHECK(throws_with([] { piecewise{2.0, 1.0, 8.0}.validate(); }, {"[rpe.index.piecewise]", "beta = 1", "alpha = 2"}));
        CHECK(throws_with([] { piecewise{2.0, 3.0, 2.0}.validate(); }, "gamma = 2"));    // γ = α
        CHECK(throws_with([] { piecewise{2.0, 3.0, 1.5}.validate(); }, "gamma = 1.5"));  // γ < α
        CHECK(throws_with([] { piecewise{0.0, 3.0, 8.0}.validate(); }, "alpha = 0"));
        CHECK(throws_with([] { piecewise{-1.0, 3.0, 8.0}.validate(); }, "alpha = -1"));
        CHECK(throws_with([] { piecewise{qnan, 3.0, 8.0}.validate(); }, "alpha = nan"));
        CHECK(throws_with([] { piecewise{1.0, qnan, 8.0}.validate(); }, "beta = nan"));
        CHECK(throws_with([] { piecewise{1.0, 3.0, qnan}.validate(); }, "gamma = nan"));
        CHECK(throws_with([] { piecewise{pinf, 3.0, 8.0}.validate(); }, "alpha = inf"));
        CHECK(throws_with([] { piecewise{1.0, pinf, 8.0}.validate(); }, "beta = inf"));
        CHECK(throws_with([] { piecewise{1.0, 3.0, pinf}.validate(); }, "gamma = inf"));
        CHECK(throws_with([] { piecewise{1.0, 3.0, -pinf}.validate(); }, "gamma = -inf"));
        CHECK(throws_with([] { piecewise{1.0, 2e9, 4e9}.validate(); }, "beta = 2000000000"));  // beyond 2^30
        CHECK_NOTHROW((piecewise{2.0, 2.0, 8.0}.validate()));                                  // β = α is allowed
        CHECK_NOTHROW(r19.validate());
    }
    SUBCASE("through clip::validate") {
        CHECK(throws_with([] { rpe::index::clip{-1.0}.validate(); }, {"[rpe.index.clip]", "beta = -1"}));
        CHECK(throws_with([] { rpe::index::clip{qnan}.validate(); }, "beta = nan"));
        CHECK_NOTHROW(rpe::index::clip{0.0}.validate());
    }
    SUBCASE("through the term constructor, build_bucket_ids and the cache") {
        const mapping::product<> bad{piecewise{2.0, 1.0, 8.0}};
        CHECK(throws_with([&] { (void)key_term(bad, {.num_heads = 2, .head_dim = 4, .skip = 1}); }, "beta = 1"));
        CHECK(throws_with([&] { (void)rpe::build_bucket_ids(bad, 3, 3, 1); }, "beta = 1"));
        rpe::bucket_cache cache;
        CHECK(throws_with([&] { (void)cache.get(mapping::euclidean<>{piecewise{qnan, 3.0, 8.0}}, 3, 3, 1); }, "alpha = nan"));
        CHECK(throws_with(
            [&] {
                (void)rpe::build_bucket_ids(mapping::cross<>{piecewise{1.0, 3.0, 0.5}}, 3, 3, 1);
            },
            "gamma = 0.5"));
    }
}

TEST_CASE("errors: grid, skip, heads and head_dim out of range") {
    const mapping::product<> m{r19};
    CHECK(throws_with([&] { (void)rpe::build_bucket_ids(m, -1, 4, 0); }, "height = -1"));
    CHECK(throws_with([&] { (void)rpe::build_bucket_ids(m, 0, 4, 0); }, "height = 0"));
    CHECK(throws_with([&] { (void)rpe::build_bucket_ids(m, 4, -2, 0); }, "width = -2"));
    CHECK(throws_with([&] { (void)rpe::build_bucket_ids(m, 4, 4, -1); }, "skip = -1"));
    CHECK(throws_with<rpe::out_of_range>([&] { (void)rpe::build_bucket_ids(m, 65536, 65536, 0); }, "L = skip + height*width"));
    const key_term t(m, {.num_heads = 2, .head_dim = 4});
    CHECK(throws_with([&] { (void)t.bucket_ids(-3, 3); }, "height = -3"));
    CHECK(throws_with([&] { (void)key_term(m, {.num_heads = 0, .head_dim = 4}); }, "num_heads = 0"));
    CHECK(throws_with([&] { (void)key_term(m, {.num_heads = 2, .head_dim = 0}); }, "head_dim = 0"));
    CHECK(throws_with([&] { (void)key_term(m, {.num_heads = 2, .head_dim = 4, .skip = -1}); }, "skip = -1"));
    float buf[4] = {};
    CHECK(throws_with([&] { (void)rpe::tensor_ref<float>(buf, {2, -3}); }, "extent -3"));
    CHECK(throws_with([&] { (void)rpe::tensor_ref<float>(buf, {1, 1, 1, 1, 1}); }, "rank 5"));
    CHECK(throws_with<rpe::out_of_range>([&] { (void)rpe::tensor_ref<float>(buf, {1 << 30, 1 << 30, 1 << 30}); }, "overflows"));
}

TEST_CASE("errors: a custom mapping returning an id outside 0..num_buckets-1 is rpe::out_of_range") {
    CHECK(throws_with<rpe::out_of_range>([] { (void)rpe::build_bucket_ids(faulty_mapping{5}, 3, 3, 1); },
                                         {"bucket id 5", "dr = 1", "dc = 0", "[0, 5)"}));
    CHECK(throws_with<rpe::out_of_range>([] { (void)rpe::build_bucket_ids(faulty_mapping{-1}, 3, 3, 0); }, "bucket id -1"));
    CHECK_NOTHROW((void)rpe::build_bucket_ids(faulty_mapping{4}, 3, 3, 0));  // 4 < 5 is fine
    // ... also through a term over it
    const rpe::term<faulty_mapping, mode::contextual, target::key> t(faulty_mapping{}, {.num_heads = 1, .head_dim = 2});
    rpe::bucket_cache cache;
    CHECK_THROWS_AS((void)t.bucket_ids(2, 2, cache), rpe::out_of_range);
}

TEST_CASE("errors: forward and backward reject mismatched ids, shapes and buffers, and write nothing") {
    // a valid key-term problem: H = 2, D = 4, per-head tables, skip 1, 3x4 grid (L = 13), B = 2
    rpe_test::term_problem<key_term> p(
        key_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 4, .shared_head = false, .skip = 1}), 2, 3, 4, 77);
    REQUIRE(p.l == 13);
    std::vector<double> out(static_cast<std::size_t>(p.out_size()), 42.0);
    const auto out_ref = mview(out, p.oshape);
    auto unchanged = [&] {
        for (double e : out)
            if (e != 42.0) return false;
        return true;
    };
    REQUIRE_NOTHROW(p.term.forward(*p.ids, p.table_refs(), p.x_ref(), out_ref, rpe::write::overwrite));  // the baseline is valid
    std::fill(out.begin(), out.end(), 42.0);

    SUBCASE("ids of another grid: height*width + skip != L of x") {
        const auto ids = p.term.bucket_ids(4, 4);  // L = 17
        CHECK(throws_with([&] { p.term.forward(*ids, p.table_refs(), p.x_ref(), out_ref, rpe::write::overwrite); },
                          {"x has shape (2, 2, 13, 4)", "17"}));
    }
    SUBCASE("ids of another mapping: different alpha") {
        const auto ids = rpe::build_bucket_ids(mapping::product<>{piecewise{1.0, 3.8, 15.2}}, 3, 4, 1);
        CHECK(throws_with([&] { p.term.forward(*ids, p.table_refs(), p.x_ref(), out_ref, rpe::write::overwrite); },
                          "another mapping"));
    }
    SUBCASE("ids of another mapping type") {
        const auto ids = rpe::build_bucket_ids(mapping::euclidean<>{r19}, 3, 4, 1);
        CHECK(throws_with([&] { p.term.forward(*ids, p.table_refs(), p.x_ref(), out_ref, rpe::write::overwrite); },
                          "another mapping"));
    }
    SUBCASE("ids of another skip") {
        const auto ids = rpe::build_bucket_ids(mapping::product<>{r19}, 3, 4, 0);
        CHECK(throws_with([&] { p.term.forward(*ids, p.table_refs(), p.x_ref(), out_ref, rpe::write::overwrite); },
                          {"skip = 0", "skip = 1"}));
    }
    SUBCASE("table with the wrong K") {
        std::vector<double> t(2 * 4 * 49);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {cview(t, {2, 4, 49})}, p.x_ref(), out_ref, rpe::write::overwrite);
            },
            {"table has shape (2, 4, 49)", "expected (2, 4, 50)"}));
    }
    SUBCASE("table with the wrong D") {
        std::vector<double> t(2 * 5 * 50);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {cview(t, {2, 5, 50})}, p.x_ref(), out_ref, rpe::write::overwrite);
            },
            "table has shape (2, 5, 50)"));
    }
    SUBCASE("table with the wrong Ht (shared layout for a per-head term)") {
        std::vector<double> t(1 * 4 * 50);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {cview(t, {1, 4, 50})}, p.x_ref(), out_ref, rpe::write::overwrite);
            },
            "table has shape (1, 4, 50)"));
    }
    SUBCASE("table in the value layout (Ht, K, D)") {
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {cview(p.tables[0], {2, 50, 4})}, p.x_ref(), out_ref, rpe::write::overwrite);
            },
            "(2, 50, 4)"));
    }
    SUBCASE("x with the wrong head count") {
        std::vector<double> x(2 * 3 * 13 * 4);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), cview(x, {2, 3, 13, 4}), out_ref, rpe::write::overwrite);
            },
            "x has shape (2, 3, 13, 4)"));
    }
    SUBCASE("x with the wrong head dim") {
        std::vector<double> x(2 * 2 * 13 * 5);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), cview(x, {2, 2, 13, 5}), out_ref, rpe::write::overwrite);
            },
            "x has shape (2, 2, 13, 5)"));
    }
    SUBCASE("out with the wrong shape") {
        std::vector<double> o(2 * 2 * 13 * 12);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), p.x_ref(), mview(o, {2, 2, 13, 12}), rpe::write::overwrite);
            },
            "out has shape (2, 2, 13, 12)"));
    }
    SUBCASE("null buffers") {
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), p.x_ref(), rpe_test::view<double>(nullptr, p.oshape),
                               rpe::write::overwrite);
            },
            "out is a null buffer"));
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), rpe_test::view<const double>(nullptr, p.xshape), out_ref,
                               rpe::write::overwrite);
            },
            "x is a null buffer"));
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {rpe_test::view<const double>(nullptr, p.tshape)}, p.x_ref(), out_ref,
                               rpe::write::overwrite);
            },
            "table is a null buffer"));
    }
    SUBCASE("out aliasing an input") {
        // out (2, 2, 13, 13) laid over x's buffer (x has 2·2·13·4 elements; give it room)
        std::vector<double> big(static_cast<std::size_t>(p.out_size()));
        std::copy(p.x.begin(), p.x.end(), big.begin());
        const auto x_alias = cview(big, p.xshape);
        CHECK(throws_with([&] { p.term.forward(*p.ids, p.table_refs(), x_alias, mview(big, p.oshape), rpe::write::overwrite); },
                          "out overlaps x"));
        std::vector<double> t_big(static_cast<std::size_t>(p.out_size()));
        CHECK(throws_with(
            [&] { p.term.forward(*p.ids, {cview(t_big, p.tshape)}, p.x_ref(), mview(t_big, p.oshape), rpe::write::overwrite); },
            "out overlaps table"));
    }
    SUBCASE("backward: gradient buffers aliasing inputs, wrong shapes; gradients untouched") {
        std::vector<double> gx(p.x.size(), 42.0), gt(p.tables[0].size(), 42.0);
        const auto gx_ref = mview(gx, p.xshape);
        const auto gt_ref = mview(gt, p.tshape);
        auto untouched = [&] {
            for (double e : gx)
                if (e != 42.0) return false;
            for (double e : gt)
                if (e != 42.0) return false;
            return true;
        };
        std::vector<double> g_big(p.grad_out.size());
        std::copy(p.grad_out.begin(), p.grad_out.end(), g_big.begin());
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(g_big, p.oshape), mview(g_big, p.xshape), {gt_ref},
                                rpe::write::overwrite);
            },
            "grad_x overlaps grad_out"));
        CHECK(untouched());
        std::vector<double> tab = p.tables[0];
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, {cview(tab, p.tshape)}, p.x_ref(), cview(p.grad_out, p.oshape), gx_ref,
                                {mview(tab, p.tshape)}, rpe::write::overwrite);
            },
            "grad_tables[0] overlaps tables[0]"));
        CHECK(untouched());
        std::vector<double> gt_wrong(1 * 4 * 50);
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), gx_ref,
                                {mview(gt_wrong, {1, 4, 50})}, rpe::write::overwrite);
            },
            "grad_tables[0] has shape (1, 4, 50)"));
        CHECK(untouched());
        std::vector<double> gx_wrong(2 * 2 * 13 * 3);
        CHECK(throws_with(
            [&] {
                p.term.backward(*p.ids, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), mview(gx_wrong, {2, 2, 13, 3}),
                                {gt_ref}, rpe::write::overwrite);
            },
            "grad_x has shape (2, 2, 13, 3)"));
        CHECK(untouched());
        const auto other = rpe::build_bucket_ids(mapping::product<>{r19}, 3, 4, 2);
        CHECK(throws_with(
            [&] {
                p.term.backward(*other, p.table_refs(), p.x_ref(), cview(p.grad_out, p.oshape), gx_ref, {gt_ref},
                                rpe::write::overwrite);
            },
            "skip = 2"));
        CHECK(untouched());
    }
    CHECK(unchanged());  // no partial write (for the backward subcase, out was never passed)
}

TEST_CASE("errors: bias and value terms check their own shapes") {
    SUBCASE("bias: out heads must be Ht or H, x must be empty") {
        rpe_test::term_problem<bias_term> p(
            bias_term(mapping::product<>{r19}, {.num_heads = 3, .head_dim = 4, .shared_head = false, .skip = 1}), 1, 3, 3, 78);
        std::vector<double> out(static_cast<std::size_t>(2 * 2 * p.l * p.l), 42.0);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), {}, mview(out, {2, 2, p.l, p.l}), rpe::write::overwrite);
            },
            "out has shape (2, 2, 10, 10)"));
        std::vector<double> x(static_cast<std::size_t>(3 * p.l * 4));
        std::vector<double> out_ok(static_cast<std::size_t>(3 * p.l * p.l), 42.0);
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), cview(x, {1, 3, p.l, 4}), mview(out_ok, {1, 3, p.l, p.l}),
                               rpe::write::overwrite);
            },
            "x must be empty"));
        for (double e : out) CHECK_EQ(e, 42.0);
        bool untouched = true;
        for (double e : out_ok) untouched = untouched && e == 42.0;
        CHECK(untouched);
    }
    SUBCASE("value: x is (B, H, L, L), out (B, H, L, D), table (Ht, K, D)") {
        rpe_test::term_problem<value_term> p(value_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 4, .skip = 1}), 1,
                                             3, 3, 79);
        std::vector<double> out(static_cast<std::size_t>(p.out_size()), 42.0);
        std::vector<double> x_qk(static_cast<std::size_t>(2 * p.l * 4));
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, p.table_refs(), cview(x_qk, {1, 2, p.l, 4}), mview(out, p.oshape), rpe::write::overwrite);
            },
            "x has shape (1, 2, 10, 4)"));
        CHECK(throws_with(
            [&] {
                p.term.forward(*p.ids, {cview(p.tables[0], {1, 4, 50})}, p.x_ref(), mview(out, p.oshape), rpe::write::overwrite);
            },
            "table has shape (1, 4, 50)"));
        bool untouched = true;
        for (double e : out) untouched = untouched && e == 42.0;
        CHECK(untouched);
    }
}

namespace {

/// A valid attention problem (B = 1, H = 2, L = 1 + 3·3, D = 4) with a contextual Product term on
/// keys and one on values (shared tables), and output buffers prefilled with 42.
struct attention_setup {
    using S = double;
    static constexpr std::int64_t B = 1, H = 2, L = 10, D = 4;
    std::vector<S> q = rpe_test::random_normal<S>(B * H * L * D, 1), k = rpe_test::random_normal<S>(B * H * L * D, 2),
                   v = rpe_test::random_normal<S>(B * H * L * D, 3), g = rpe_test::random_normal<S>(B * H * L * D, 4);
    std::unique_ptr<rpe::any_term<S>> tk =
        rpe::make_any_term(key_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 4, .skip = 1}));
    std::unique_ptr<rpe::any_term<S>> tv =
        rpe::make_any_term(value_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 4, .skip = 1}));
    std::vector<S> table_k = std::vector<S>(4 * 50, 0.25), table_v = std::vector<S>(50 * 4, 0.25);
    std::vector<S> out = std::vector<S>(B * H * L * D, 42.0), attn = std::vector<S>(B * H * L * L, 42.0);
    std::vector<S> gq = out, gk = out, gv = out;
    rpe::attention_inputs<S> in;

    attention_setup() {
        in.q = cview(q, {B, H, L, D});
        in.k = cview(k, {B, H, L, D});
        in.v = cview(v, {B, H, L, D});
        in.height = 3;
        in.width = 3;
        in.rpe_k = {tk.get(), {cview(table_k, tk->table_shape())}, {}};
    }
    void forward() { rpe::composed_attention_forward(in, mview(out, {B, H, L, D}), mview(attn, {B, H, L, L})); }
    void backward() {
        rpe::composed_attention_backward(in, {.grad_out = cview(g, {B, H, L, D}),
                                              .grad_q = mview(gq, {B, H, L, D}),
                                              .grad_k = mview(gk, {B, H, L, D}),
                                              .grad_v = mview(gv, {B, H, L, D}),
                                              .saved_attn = cview(attn, {B, H, L, L})});
    }
    [[nodiscard]] bool untouched() const {
        for (const auto* buf : {&out, &attn, &gq, &gk, &gv})
            for (S e : *buf)
                if (e != 42.0) return false;
        return true;
    }
};

}  // namespace

TEST_CASE("errors: composed attention checks its inputs before writing") {
    attention_setup a;
    auto forward = [&] { a.forward(); };
    auto backward = [&] { a.backward(); };
    SUBCASE("grid that does not match L") {
        a.in.width = 4;
        CHECK(throws_with(forward, {"L = 10", "1 + 3*4"}));
        CHECK(throws_with(backward, {"L = 10", "1 + 3*4"}));
    }
    SUBCASE("term on the wrong slot") {
        a.in.rpe_q = a.in.rpe_k;
        CHECK(throws_with(forward, "rpe_q holds a term on target k"));
    }
    SUBCASE("term with another head count") {
        const auto t3 = rpe::make_any_term(key_term(mapping::product<>{r19}, {.num_heads = 3, .head_dim = 4, .skip = 1}));
        a.in.rpe_k.term = t3.get();
        CHECK(throws_with(forward, "rpe_k has num_heads = 3"));
    }
    SUBCASE("term with another head dim") {
        const auto t8 = rpe::make_any_term(key_term(mapping::product<>{r19}, {.num_heads = 2, .head_dim = 8, .skip = 1}));
        a.in.rpe_k.term = t8.get();
        CHECK(throws_with(forward, "rpe_k has head_dim = 8"));
    }
    SUBCASE("mask with the wrong shape") {
        std::vector<std::uint8_t> mask(static_cast<std::size_t>(a.L));
        a.in.key_padding_mask = cview(mask, {a.L});
        CHECK(throws_with(forward, "key_padding_mask has shape (10,)"));
    }
    SUBCASE("k with another shape") {
        a.in.k = cview(a.k, {a.B, a.H, 2 * a.L, a.D / 2});  // another head dim
        CHECK(throws_with(forward, "k has shape (1, 2, 20, 2); expected (1, 2, L_k >= 1, 4): B, H, D of q (1, 2, 10, 4)"));
        a.in.k = cview(a.k, {a.B, a.H, a.L - 1, a.D});  // k alone of another length: the composed baseline takes L_k = L
        CHECK(throws_with(forward,
                          "k has shape (1, 2, 9, 4); expected (1, 2, 10, 4), the shape of q and v (the composed backend "
                          "takes keys of the queries' length)"));
    }
    SUBCASE("null q") {
        a.in.q = rpe_test::view<const double>(nullptr, {a.B, a.H, a.L, a.D});
        CHECK(throws_with(forward, "q is a null buffer"));
    }
    SUBCASE("output of the wrong shape") {
        CHECK(throws_with(
            [&] {
                rpe::composed_attention_forward(a.in, mview(a.out, {a.B, a.H, a.L, a.D}),
                                                mview(a.attn, {a.B, a.H, a.L, a.L - 1}));
            },
            "attn has shape (1, 2, 10, 9)"));
    }
    SUBCASE("backward: grad table of the wrong shape") {
        std::vector<double> gt(4 * 49);
        a.in.rpe_k.grad_tables = {mview(gt, {1, 4, 49})};
        CHECK(throws_with(backward, "rpe_k grad_tables[0] has shape (1, 4, 49)"));
    }
    CHECK(a.untouched());
}

// composed_attention_forward/_backward check every term's tables before writing any output.
TEST_CASE("errors: composed attention writes nothing when a term's tables are wrong") {
    attention_setup a;
    SUBCASE("key term table with the wrong K, forward") {
        std::vector<double> t(4 * 49);
        a.in.rpe_k.tables = {cview(t, {1, 4, 49})};
        CHECK(throws_with([&] { a.forward(); }, "table has shape (1, 4, 49)"));
        CHECK(a.untouched());
    }
    SUBCASE("Cross term given one table, forward") {
        const auto tc = rpe::make_any_term(rpe::term<mapping::cross<>, mode::contextual, target::key, double>(
            {r19}, {.num_heads = 2, .head_dim = 4, .skip = 1}));
        a.in.rpe_k.term = tc.get();
        CHECK(throws_with([&] { a.forward(); }, "tables holds 1 tables; expected 2"));
        CHECK(a.untouched());
    }
    SUBCASE("value term table in the (Ht, D, K) layout, forward") {
        a.in.rpe_v = {a.tv.get(), {cview(a.table_v, {1, 4, 50})}, {}};
        CHECK(throws_with([&] { a.forward(); }, "table has shape (1, 4, 50)"));
        CHECK(a.untouched());
    }
    SUBCASE("value term table in the (Ht, D, K) layout, backward") {
        a.in.rpe_v = {a.tv.get(), {cview(a.table_v, {1, 4, 50})}, {}};
        CHECK(throws_with([&] { a.backward(); }, "table has shape (1, 4, 50)"));
        CHECK(a.untouched());
    }
}

// The composed attention rejects outputs that overlap an input, as rpe::term does.
TEST_CASE("errors: composed attention rejects an output aliasing an input") {
    using S = double;
    const std::int64_t B = 1, H = 1, L = 4, D = 4;
    std::vector<S> qkv = rpe_test::random_normal<S>(static_cast<std::size_t>(3 * L * D), 5);
    std::vector<S> attn(static_cast<std::size_t>(L * L));
    rpe::attention_inputs<S> in;
    in.q = rpe_test::view<const S>(qkv.data(), {B, H, L, D});
    in.k = rpe_test::view<const S>(qkv.data() + L * D, {B, H, L, D});
    in.v = rpe_test::view<const S>(qkv.data() + 2 * L * D, {B, H, L, D});
    in.height = 2;
    in.width = 2;
    CHECK(throws_with(
        [&] {
            rpe::composed_attention_forward(in, rpe_test::view<S>(qkv.data() + 2 * L * D, {B, H, L, D}),
                                            mview(attn, {B, H, L, L}));
        },
        "overlaps"));
}

}  // namespace rpe_unit_core_errors
