// The shared list of bad term calls (tests/common/bad_term_calls.hpp) on the CPU term, the
// run-time term (make_any_term) and the factory's term (make_term): one set of checks, one
// message each. tests/cuda runs the same list on the CUDA term.
#include <doctest/doctest.h>

#include <span>
#include <type_traits>

#include <rpe/any_term.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rpe.hpp>

#include "../common/bad_term_calls.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_term_checks {

namespace {

using pw = rpe::index::piecewise;
using P = rpe::mapping::product<pw>;

// An any_term seen through the compile-time term's single-table signatures.
template <class S>
struct any_view {
    const rpe::any_term<S>& t;
    [[nodiscard]] int num_buckets() const { return t.num_buckets(); }
    [[nodiscard]] auto bucket_ids(int h, int w) const { return t.bucket_ids(h, w); }
    void forward(const rpe::bucket_ids& ids, rpe::tensor_ref<const S> table, rpe::tensor_ref<const S> x, rpe::tensor_ref<S> out,
                 rpe::write mode) const {
        t.forward(ids, std::span<const rpe::tensor_ref<const S>>(&table, 1), x, out, mode);
    }
    void backward(const rpe::bucket_ids& ids, rpe::tensor_ref<const S> table, rpe::tensor_ref<const S> x,
                  rpe::tensor_ref<const S> grad_out, rpe::tensor_ref<S> grad_x, rpe::tensor_ref<S> grad_table,
                  rpe::write mode) const {
        t.backward(ids, std::span<const rpe::tensor_ref<const S>>(&table, 1), x, grad_out, grad_x,
                   std::span<const rpe::tensor_ref<S>>(&grad_table, 1), mode);
    }
};

}  // namespace

TEST_CASE_TEMPLATE("bad term calls get the shared checks' message on the CPU term", S, float, double) {
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, S> key(P{pw::from_ratio(1.9)},
                                                                       {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::bias, rpe::target::key, S> bias(P{pw::from_ratio(1.9)},
                                                                  {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::contextual, rpe::target::value, S> value(P{pw::from_ratio(1.9)},
                                                                           {.num_heads = 2, .head_dim = 8, .skip = 1});
    rpe_test::check_bad_term_calls<S>(key, bias, value);
}

TEST_CASE("bad term calls get the same messages from make_any_term and make_term terms") {
    using S = float;
    const rpe::term<P, rpe::mode::contextual, rpe::target::key, S> key(P{pw::from_ratio(1.9)},
                                                                       {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::bias, rpe::target::key, S> bias(P{pw::from_ratio(1.9)},
                                                                  {.num_heads = 2, .head_dim = 8, .skip = 1});
    const rpe::term<P, rpe::mode::contextual, rpe::target::value, S> value(P{pw::from_ratio(1.9)},
                                                                           {.num_heads = 2, .head_dim = 8, .skip = 1});
    const auto ak = rpe::make_any_term(key), ab = rpe::make_any_term(bias), av = rpe::make_any_term(value);
    rpe_test::check_bad_term_calls<S>(any_view<S>{*ak}, any_view<S>{*ab}, any_view<S>{*av});

    rpe::term_spec spec;
    spec.ratio(1.9);
    spec.num_heads = 2;
    spec.head_dim = 8;
    spec.skip = 1;
    const auto mk = rpe::make_term<S>(spec);
    spec.contextual = false;
    const auto mb = rpe::make_term<S>(spec);
    spec.contextual = true;
    spec.target = rpe::target::value;
    const auto mv = rpe::make_term<S>(spec);
    rpe_test::check_bad_term_calls<S>(any_view<S>{*mk}, any_view<S>{*mb}, any_view<S>{*mv});
}

TEST_CASE("make_term rejects enum values outside their enums") {
    rpe::term_spec spec;
    spec.method = static_cast<rpe::method>(9);
    CHECK_THROWS_WITH_AS((void)rpe::make_term<float>(spec), doctest::Contains("[rpe.term_spec] method = 9"),
                         rpe::invalid_argument);
    spec = {};
    spec.index = static_cast<rpe::index_kind>(5);
    CHECK_THROWS_WITH_AS((void)rpe::make_term<float>(spec), doctest::Contains("[rpe.term_spec] index = 5"),
                         rpe::invalid_argument);
    spec = {};
    spec.target = static_cast<rpe::target>(7);
    CHECK_THROWS_WITH_AS((void)rpe::make_term<float>(spec), doctest::Contains("target = 7"), rpe::invalid_argument);
}

TEST_CASE("every rpe exception is an rpe::error whose id() is its message's prefix") {
    auto id_of = [](auto&& f) -> std::string {
        try {
            f();
        } catch (const rpe::error& e) {
            CHECK(std::string(e.what()).rfind("[" + std::string(e.id()) + "] ", 0) == 0);
            CHECK(dynamic_cast<const std::exception*>(&e) != nullptr);
            return std::string(e.id());
        }
        return "no exception";
    };
    CHECK(id_of([] {
              (void)rpe::term<P, rpe::mode::bias, rpe::target::key>(P{pw::from_ratio(1.9)},
                                                                    {.num_heads = 0, .head_dim = 8, .skip = 1});
          }) == "rpe.term");
    const auto ids = rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, 3, 3, 1);
    CHECK(id_of([&] { (void)ids->at(0, 10, 0); }) == "rpe.bucket_ids");
    CHECK(id_of([] { (void)rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, 0, 3, 1); }) == "rpe.bucket_ids");
    // the standard bases still see them
    CHECK_THROWS_AS((void)ids->at(0, 10, 0), std::out_of_range);
    CHECK_THROWS_AS((void)rpe::build_bucket_ids(P{pw::from_ratio(1.9)}, 0, 3, 1), std::invalid_argument);
}

// The configuration is named only: the positional (mapping, heads, head_dim, shared, skip) form is
// gone, so swapped heads/head_dim or bool/skip cannot compile.
static_assert(std::is_constructible_v<rpe::term<P, rpe::mode::contextual, rpe::target::key>, P, rpe::term_config>);
static_assert(!std::is_constructible_v<rpe::term<P, rpe::mode::contextual, rpe::target::key>, P, int, int, bool, int>);
static_assert(!std::is_constructible_v<rpe::term<P, rpe::mode::bias, rpe::target::query>, P, int, int, bool, int>);

// The write mode has no default: forward/backward without it do not compile (term and any_term).
template <class T, class S = float>
concept forward_without_mode = requires(const T& t, const rpe::bucket_ids& ids, rpe::tensor_ref<const S> tab,
                                        rpe::tensor_ref<S> out) {
    t.forward(ids, tab, tab, out);
};
template <class T, class S = float>
concept forward_with_mode = requires(const T& t, const rpe::bucket_ids& ids, rpe::tensor_ref<const S> tab,
                                     rpe::tensor_ref<S> out) {
    t.forward(ids, tab, tab, out, rpe::write::overwrite);
};
template <class T, class S = float>
concept backward_without_mode = requires(const T& t, const rpe::bucket_ids& ids, rpe::tensor_ref<const S> tab,
                                         rpe::tensor_ref<S> g) {
    t.backward(ids, tab, tab, tab, g, g);
};
template <class T, class S = float>
concept any_forward_without_mode = requires(const T& t, const rpe::bucket_ids& ids,
                                            std::span<const rpe::tensor_ref<const S>> tabs, rpe::tensor_ref<const S> x,
                                            rpe::tensor_ref<S> out) {
    t.forward(ids, tabs, x, out);
};
template <class T, class S = float>
concept any_forward_with_mode = requires(const T& t, const rpe::bucket_ids& ids, std::span<const rpe::tensor_ref<const S>> tabs,
                                         rpe::tensor_ref<const S> x, rpe::tensor_ref<S> out) {
    t.forward(ids, tabs, x, out, rpe::write::accumulate);
};
static_assert(forward_with_mode<rpe::term<P, rpe::mode::contextual, rpe::target::key>>);
static_assert(!forward_without_mode<rpe::term<P, rpe::mode::contextual, rpe::target::key>>);
static_assert(!backward_without_mode<rpe::term<P, rpe::mode::contextual, rpe::target::key>>);
static_assert(any_forward_with_mode<rpe::any_term<float>>);
static_assert(!any_forward_without_mode<rpe::any_term<float>>);

TEST_CASE("term_config: the named configuration reaches the term, and a missing field is an error") {
    const rpe::term<P, rpe::mode::contextual, rpe::target::key> named(
        P{pw::from_ratio(1.9)}, {.num_heads = 6, .head_dim = 64, .shared_head = false, .skip = 1});
    CHECK(named.num_heads() == 6);
    CHECK(named.head_dim() == 64);
    CHECK_FALSE(named.shared_head());
    CHECK(named.skip() == 1);
    CHECK(named.table_shape() == std::vector<std::int64_t>{6, 64, 50});
    const rpe::term_config c = named.config();
    CHECK((c.num_heads == 6 && c.head_dim == 64 && !c.shared_head && c.skip == 1));
    // defaults: shared_head = true (the reference's shared_head=True), skip = 0
    const rpe::term<P, rpe::mode::contextual, rpe::target::key> defaults(P{pw::from_ratio(1.9)},
                                                                         {.num_heads = 6, .head_dim = 64});
    CHECK(defaults.shared_head());
    CHECK(defaults.skip() == 0);
    CHECK(defaults.table_shape() == std::vector<std::int64_t>{1, 64, 49});
    using T = rpe::term<P, rpe::mode::bias, rpe::target::query>;
    CHECK_THROWS_WITH_AS(T(P{pw::from_ratio(1.9)}, {.head_dim = 8}), doctest::Contains("[rpe.term] num_heads = 0; expected >= 1"),
                         rpe::invalid_argument);
    CHECK_THROWS_WITH_AS(T(P{pw::from_ratio(1.9)}, {.num_heads = 2}), doctest::Contains("[rpe.term] head_dim = 0; expected >= 1"),
                         rpe::invalid_argument);
}

}  // namespace rpe_unit_term_checks
