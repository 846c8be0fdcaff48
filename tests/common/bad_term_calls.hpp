// The list of bad term calls that every backend must reject with the same exception and message
// (the shared checks of include/rpe/detail/term_checks.hpp). Run by tests/unit (the CPU term)
// and by tests/cuda (the CUDA term, host-side: every check fails before any CUDA call, so the
// list runs without a device). The buffers are host memory that no call may read: each call
// must throw before touching them.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/error.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/tensor.hpp>

namespace rpe_test {

/// Runs the list on three terms of one backend, each on the product mapping with
/// piecewise::from_ratio(1.9), H = 2, D = 8, shared tables, skip = 1 (3 × 3 grid: L = 10, K = 50):
/// `key` contextual on keys, `bias` bias on keys, `value` contextual on values. S: the scalar.
template <class S, class KeyTerm, class BiasTerm, class ValueTerm>
void check_bad_term_calls(const KeyTerm& key, const BiasTerm& bias, const ValueTerm& value) {
    using rpe::tensor_ref;
    using pw = rpe::index::piecewise;
    const auto ids = key.bucket_ids(3, 3);
    REQUIRE(ids->length() == 10);
    REQUIRE(key.num_buckets() == 50);
    const auto other_ids = rpe::build_bucket_ids(rpe::mapping::euclidean<pw>{pw::from_ratio(1.9)}, 3, 3, 1);
    std::vector<S> table(8 * 50), x(2 * 2 * 10 * 10), out(2 * 2 * 10 * 10), gt(8 * 50), gx(2 * 2 * 10 * 10);
    const tensor_ref<const S> tab(table.data(), {1, 8, 50}), xq(x.data(), {2, 2, 10, 8});
    const tensor_ref<S> o(out.data(), {2, 2, 10, 10});
    const tensor_ref<const S> go(out.data(), {2, 2, 10, 10});
    const tensor_ref<S> g_tab(gt.data(), {1, 8, 50}), g_x(gx.data(), {2, 2, 10, 8});
    using E = rpe::invalid_argument;
    using doctest::Contains;

    // forward, contextual key term
    CHECK_THROWS_WITH_AS(key.forward(*ids, tensor_ref<const S>(table.data(), {1, 8, 49}), xq, o, rpe::write::overwrite),
                         Contains("[rpe.term] table has shape (1, 8, 49); expected (1, 8, 50)"), E);
    CHECK_THROWS_WITH_AS(key.forward(*ids, tab, tensor_ref<const S>(x.data(), {2, 2, 9, 8}), o, rpe::write::overwrite),
                         Contains("[rpe.term] x has shape (2, 2, 9, 8); expected (B >= 1, 2, 10, 8)"), E);
    CHECK_THROWS_WITH_AS(key.forward(*ids, tab, xq, tensor_ref<S>(out.data(), {2, 2, 10, 9}), rpe::write::overwrite),
                         Contains("[rpe.term] out has shape (2, 2, 10, 9); expected (2, 2, 10, 10)"), E);
    CHECK_THROWS_WITH_AS(key.forward(*ids, tab, tensor_ref<const S>(nullptr, {2, 2, 10, 8}), o, rpe::write::overwrite),
                         Contains("[rpe.term] x is a null buffer of shape (2, 2, 10, 8)"), E);
    CHECK_THROWS_WITH_AS(key.forward(*ids, tab, xq, tensor_ref<S>(x.data(), {2, 2, 10, 10}), rpe::write::overwrite),
                         Contains("[rpe.term] out overlaps x in memory"), E);
    CHECK_THROWS_WITH_AS(key.forward(*other_ids, tab, xq, o, rpe::write::overwrite),
                         Contains("[rpe.term] bucket ids were built for another mapping"), E);
    // backward, contextual key term
    CHECK_THROWS_WITH_AS(key.backward(*ids, tab, xq, go, g_x, tensor_ref<S>(nullptr, {1, 8, 50}), rpe::write::overwrite),
                         Contains("[rpe.term] grad_tables[0] is a null buffer of shape (1, 8, 50)"), E);
    CHECK_THROWS_WITH_AS(key.backward(*ids, tab, xq, go, g_x, tensor_ref<S>(gt.data(), {1, 50, 8}), rpe::write::overwrite),
                         Contains("[rpe.term] grad_tables[0] has shape (1, 50, 8); expected (1, 8, 50)"), E);
    CHECK_THROWS_WITH_AS(key.backward(*ids, tab, xq, go, g_x, tensor_ref<S>(table.data(), {1, 8, 50}), rpe::write::overwrite),
                         Contains("[rpe.term] grad_tables[0] overlaps tables[0] in memory"), E);
    CHECK_THROWS_WITH_AS(key.backward(*ids, tab, xq, go, tensor_ref<S>(gt.data(), {2, 2, 10, 8}), g_tab, rpe::write::overwrite),
                         Contains("[rpe.term] grad_x overlaps grad_tables[0] in memory"), E);
    CHECK_THROWS_WITH_AS(key.backward(*ids, tab, xq, go, tensor_ref<S>(gx.data(), {2, 2, 10, 9}), g_tab, rpe::write::overwrite),
                         Contains("[rpe.term] grad_x has shape (2, 2, 10, 9); expected (2, 2, 10, 8)"), E);
    // bias term
    const tensor_ref<const S> btab(table.data(), {1, 50});
    CHECK_THROWS_WITH_AS(bias.forward(*ids, btab, xq, o, rpe::write::overwrite),
                         Contains("[rpe.term] x must be empty ({}) in bias mode"), E);
    CHECK_THROWS_WITH_AS(bias.forward(*ids, btab, {}, tensor_ref<S>(out.data(), {2, 3, 10, 10}), rpe::write::overwrite),
                         Contains("[rpe.term] out has shape (2, 3, 10, 10); expected (B >= 1, 2 or 1, L, L) with L = 10"), E);
    CHECK_THROWS_WITH_AS(bias.backward(*ids, btab, {}, go, g_x, tensor_ref<S>(gt.data(), {1, 50}), rpe::write::overwrite),
                         Contains("[rpe.term] grad_x must be empty ({}) in bias mode"), E);
    // contextual value term: x is the attention (B, H, L, L), out (B, H, L, D)
    const tensor_ref<const S> a(x.data(), {2, 2, 10, 10}), vtab(table.data(), {1, 50, 8});
    CHECK_THROWS_WITH_AS(value.forward(*ids, vtab, tensor_ref<const S>(x.data(), {2, 2, 10, 8}),
                                       tensor_ref<S>(out.data(), {2, 2, 10, 8}), rpe::write::overwrite),
                         Contains("[rpe.term] x has shape (2, 2, 10, 8); expected (B >= 1, 2, 10, 10)"), E);
    CHECK_THROWS_WITH_AS(value.forward(*ids, tensor_ref<const S>(table.data(), {1, 8, 50}), a,
                                       tensor_ref<S>(out.data(), {2, 2, 10, 8}), rpe::write::overwrite),
                         Contains("[rpe.term] table has shape (1, 8, 50); expected (1, 50, 8)"), E);
    // nothing was written by any of these calls
    for (const S v : out) REQUIRE(v == S(0));
    for (const S v : gt) REQUIRE(v == S(0));
    for (const S v : gx) REQUIRE(v == S(0));
}

}  // namespace rpe_test
