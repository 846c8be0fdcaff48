// rpe::make_term and rpe::term_spec (reference `build_rpe`, `get_num_buckets`): every golden term case in float and double
// through the run-time API, the term_spec (parsing, K as the reference), and the run-time
// errors of make_term (bias on values, invalid alpha/beta/gamma).
// Properties of rpe::term on random data are in test_core_term_props.cpp.
//
// This is the one test file that instantiates rpe::make_term (about 60 term types per scalar).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rpe/any_term.hpp>
#include <rpe/bucket_cache.hpp>
#include <rpe/make_term.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_term {

namespace {

using json = nlohmann::json;
using rpe::target;
using rpe_test::cview;
using rpe_test::mview;

/// The term_spec of a golden case (meta.json fields, as the reference's get_single_rpe_config).
rpe::term_spec spec_of(const json& meta, char letter) {
    rpe::term_spec s;
    s.method = rpe::parse_method(meta.at("method").get<std::string>());
    s.contextual = rpe::parse_contextual(meta.at("mode").get<std::string>());
    s.target = rpe::parse_target(std::string(1, letter));
    s.alpha = meta.at("alpha").get<double>();
    s.beta = meta.at("beta").get<double>();
    s.gamma = meta.at("gamma").get<double>();
    s.shared_head = meta.at("shared_head").get<bool>();
    s.skip = meta.at("skip").get<int>();
    s.num_heads = meta.at("heads").get<int>();
    s.head_dim = meta.at("head_dim").get<int>();
    return s;
}

template <class S>
void run_golden_term(const std::string& dir) {
    const json meta = rpe_test::read_meta<json>(dir);
    const rpe::term_spec spec = spec_of(meta, meta.at("target").get<std::string>().at(0));
    const auto term = rpe::make_term<S>(spec);
    REQUIRE(term);
    CHECK(term->num_buckets() == meta.at("num_buckets").get<int>());
    CHECK(spec.num_buckets() == meta.at("num_buckets").get<int>());
    CHECK(term->contextual() == (meta.at("mode").get<std::string>() == "contextual"));
    const int height = meta.at("height").get<int>(), width = meta.at("width").get<int>();
    const auto ids = term->bucket_ids(height, width);
    const std::int64_t b = meta.at("batch").get<std::int64_t>(), h = spec.num_heads, l = ids->length(), d = spec.head_dim;
    REQUIRE(l == meta.at("L").get<std::int64_t>());

    const json& tables = meta.at("tables");
    REQUIRE(static_cast<int>(tables.size()) == term->num_tables());
    const std::vector<std::int64_t> tshape = term->table_shape();
    std::vector<std::vector<S>> tab, grad_tab;
    for (std::size_t t = 0; t < tables.size(); ++t) {
        rpe_test::check_exact(rpe_test::ids_matrix(*ids, static_cast<int>(t)),
                              rpe_test::load<std::int64_t>(dir, tables[t].at("bucket_ids").get<std::string>(), {l, l}),
                              tables[t].at("bucket_ids").get<std::string>());
        tab.push_back(rpe_test::load<S>(dir, tables[t].at("table").get<std::string>(), tshape));
        grad_tab.emplace_back(tab.back().size(), S(-99));  // garbage: backward must overwrite
    }
    std::vector<rpe::tensor_ref<const S>> tab_refs;
    std::vector<rpe::tensor_ref<S>> grad_refs;
    for (std::size_t t = 0; t < tab.size(); ++t) {
        tab_refs.push_back(cview(tab[t], tshape));
        grad_refs.push_back(mview(grad_tab[t], tshape));
    }
    std::vector<std::int64_t> xshape, oshape;
    if (!spec.contextual) {
        oshape = {1, tshape[0], l, l};  // the reference's broadcastable (1, Ht, L, L)
    } else if (spec.target == target::value) {
        xshape = {b, h, l, l};
        oshape = {b, h, l, d};
    } else {
        xshape = {b, h, l, d};
        oshape = {b, h, l, l};
    }
    std::vector<S> x, grad_x;
    if (!xshape.empty()) {
        x = rpe_test::load<S>(dir, "x.npy", xshape);
        grad_x.assign(x.size(), S(-99));
    }
    const auto grad_out = rpe_test::load<S>(dir, "grad_output.npy", oshape);
    std::vector<S> out(grad_out.size(), S(-99));
    const auto x_ref = xshape.empty() ? rpe::tensor_ref<const S>{} : cview(x, xshape);
    term->forward(*ids, tab_refs, x_ref, mview(out, oshape), rpe::write::overwrite);
    term->backward(*ids, tab_refs, x_ref, cview(grad_out, oshape), xshape.empty() ? rpe::tensor_ref<S>{} : mview(grad_x, xshape),
                   grad_refs, rpe::write::overwrite);

    rpe_test::check_golden(dir, meta, "output.npy", out);
    if (!xshape.empty()) rpe_test::check_golden(dir, meta, "grad_input.npy", grad_x);
    for (std::size_t t = 0; t < tables.size(); ++t) {
        rpe_test::check_golden(dir, meta, tables[t].at("grad").get<std::string>(), grad_tab[t]);
        // buckets no pair reads get exactly zero gradient (the lower half of undirected tables)
        const auto& never = meta.at("buckets_never_read").at(tables[t].at("table").get<std::string>());
        const std::int64_t k = term->num_buckets();
        bool zero = true;
        for (const auto& e : never) {
            const std::int64_t bucket = e.get<std::int64_t>();
            for (std::int64_t idx = 0; idx < static_cast<std::int64_t>(grad_tab[t].size()); ++idx) {
                // bucket index of a flat table entry: (Ht, K) / (Ht, D, K) → last axis; (Ht, K, D) → middle
                const std::int64_t kk = spec.contextual && spec.target == target::value ? (idx / d) % k : idx % k;
                if (kk == bucket) zero = zero && grad_tab[t][static_cast<std::size_t>(idx)] == S(0);
            }
        }
        CHECK(zero);
    }
}

}  // namespace

TEST_CASE_TEMPLATE("rpe::make_term reproduces every golden term case", S, float, double) {
    namespace fs = std::filesystem;
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(rpe_test::golden("term")))
        if (fs::exists(e.path() / "meta.json")) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    CHECK(dirs.size() == 20);  // all 20 (mapping, mode, target) combinations (golden README)
    for (const auto& dir : dirs) {
        INFO("case " << dir);
        run_golden_term<S>(dir);
    }
}

// ---------------------------------------------------------------------------------------------
// Run-time configuration
// ---------------------------------------------------------------------------------------------
TEST_CASE("term_spec: parsing, K as the reference, and the terms make_term builds") {
    CHECK(rpe::parse_method("euc") == rpe::method::euclidean);
    CHECK(rpe::parse_method("quant") == rpe::method::quantization);
    CHECK(rpe::parse_method("product") == rpe::method::product);
    CHECK(rpe::parse_method("cross") == rpe::method::cross);
    CHECK(rpe::parse_method("quantization_paper") == rpe::method::quantization_paper);
    CHECK(rpe::parse_contextual("ctx"));
    CHECK_FALSE(rpe::parse_contextual("bias"));
    CHECK(rpe::parse_target("q") == target::query);
    CHECK(rpe::parse_target("value") == target::value);
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_method("manhattan"); }, "method = 'manhattan'"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_contextual("ctxt"); }, "mode = 'ctxt'"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_target("x"); }, "target = 'x'"));

    // K per the reference's get_num_buckets: Product ratio 1.9 with a class token 50, Euclidean
    // ratio 20 → 81 + 1, Quantization ratio 33 → 133 + 1, Cross ratio 20 → 81 per table, DETR 81.
    rpe::term_spec s;
    s.ratio(1.9);
    CHECK(s.num_buckets() == 50);
    s.method = rpe::method::euclidean;
    CHECK(s.ratio(20).num_buckets() == 82);
    s.method = rpe::method::quantization;
    CHECK(s.ratio(33).num_buckets() == 134);
    s.method = rpe::method::cross;
    s.skip = 0;
    CHECK(s.ratio(20).num_buckets() == 81);
    s.method = rpe::method::product;
    CHECK(s.ratio(2.0).num_buckets() == 81);

    // the built term reports the spec back
    rpe::term_spec q;
    q.method = rpe::method::cross;
    q.target = target::value;
    q.num_heads = 3;
    q.head_dim = 8;
    q.shared_head = false;
    q.skip = 1;
    const auto t = rpe::make_term<double>(q);
    CHECK(t->num_tables() == 2);
    CHECK(t->num_buckets() == 8);
    CHECK(t->target() == target::value);
    CHECK(t->contextual());
    CHECK(t->table_shape() == std::vector<std::int64_t>{3, 8, 8});
    q.index = rpe::index_kind::clip;
    q.beta = 5;
    q.method = rpe::method::product;
    q.contextual = false;
    q.target = target::query;
    const auto c = rpe::make_term<float>(q);
    CHECK(c->num_buckets() == 11 * 11 + 1);
    CHECK(c->table_shape() == std::vector<std::int64_t>{3, 122});
}

TEST_CASE("errors: bias mode on values is rejected at run time (golden errors/bias_on_v)") {
    const json meta = rpe_test::read_meta<json>(rpe_test::golden("errors/bias_on_v"));
    rpe::term_spec s = spec_of(meta, 'v');
    CHECK_FALSE(s.contextual);
    CHECK(s.target == target::value);
    CHECK(rpe_test::throws_with([&] { (void)rpe::make_term<float>(s); }, {"bias", "target = v"}));
    CHECK_THROWS_AS((void)rpe::make_term<double>(s), rpe::invalid_argument);
    s.target = target::key;
    CHECK_NOTHROW((void)rpe::make_term<float>(s));  // the same spec on keys is fine
}

TEST_CASE("errors: make_term validates alpha, beta, gamma with the term_spec prefix") {
    rpe::term_spec s;
    s.alpha = 2;
    s.beta = 1;
    s.gamma = 8;
    CHECK(rpe_test::throws_with([&] { (void)rpe::make_term<float>(s); }, {"[rpe.term_spec]", "beta = 1"}));
    s.beta = 3;
    s.gamma = 2;
    CHECK(rpe_test::throws_with([&] { (void)rpe::make_term<float>(s); }, "gamma = 2"));
    s.index = rpe::index_kind::clip;
    s.beta = -1;
    CHECK(rpe_test::throws_with([&] { (void)rpe::make_term<float>(s); }, "beta = -1"));
    s.index = rpe::index_kind::piecewise;
    s.alpha = 1;
    s.beta = 2;
    s.gamma = 4;
    s.num_heads = 0;
    CHECK(rpe_test::throws_with([&] { (void)rpe::make_term<float>(s); }, "num_heads = 0"));
}

}  // namespace rpe_unit_core_term
