// The custom mapping of examples/01_custom_mapping (Chebyshev distance), as docs/custom_mapping.md
// shows it: concept, hand-checked ids, validate() and its own cache entries. Its term and the
// fused attention are exercised by the example itself (CTest example.custom_mapping).
#include <doctest/doctest.h>

#include <rpe/bucket_cache.hpp>
#include <rpe/concepts.hpp>
#include <rpe/mapping/product.hpp>

#include "../../examples/01_custom_mapping/chebyshev.hpp"
#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_custom_mapping_example {

TEST_CASE("custom mapping example: Chebyshev ids by hand") {
    static_assert(rpe::Mapping<example::chebyshev>);
    const example::chebyshev m{rpe::index::piecewise::from_ratio(1.9)};
    // ratio 1.9: g(0..7) = 0 1 2 2 3 3 3 3 (test_core_index.cpp); K = βi + 1 = 4
    CHECK(m.num_buckets() == 4);
    CHECK(m.bucket(0, 0) == 0);
    CHECK(m.bucket(1, -1) == 1);  // max(1, 1) = 1
    CHECK(m.bucket(-1, 0) == 1);
    CHECK(m.bucket(2, 1) == 2);   // max(2, 1) = 2
    CHECK(m.bucket(-3, 3) == 2);  // 3 → 2
    CHECK(m.bucket(1, -4) == 3);  // 4 → 3
    CHECK(m.bucket(-9, 0) == 3);
    const auto ids = rpe::build_bucket_ids(m, 5, 5, 1);
    CHECK(ids->num_buckets() == 5);
    CHECK(ids->at(0, 0, 7) == 4);           // class token: the extra id
    CHECK(ids->at(0, 1 + 12, 1 + 0) == 2);  // centre (2,2) → corner (0,0): distance 2
    CHECK(ids->at(0, 1 + 12, 1 + 7) == 1);  // (2,2) → (1,2)
    CHECK(ids->at(0, 1 + 0, 1 + 24) == 3);  // (0,0) → (4,4): distance 4
}

TEST_CASE("custom mapping example: validate and cache key") {
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::build_bucket_ids(example::chebyshev{rpe::index::piecewise{2.0, 1.0, 8.0}}, 3, 3, 0);
        },
        "beta = 1"));
    rpe::bucket_cache cache;
    const example::chebyshev m{rpe::index::piecewise::from_ratio(1.9)};
    const auto a = cache.get(m, 4, 4, 0);
    CHECK(cache.get(example::chebyshev{rpe::index::piecewise::from_ratio(1.9)}, 4, 4, 0).get() == a.get());
    CHECK(cache.get(example::chebyshev{rpe::index::piecewise::from_ratio(2.0)}, 4, 4, 0).get() != a.get());
    CHECK(cache.get(rpe::mapping::product<>{m.index}, 4, 4, 0).get() != a.get());
    CHECK(cache.builds() == 3);
}

}  // namespace rpe_unit_custom_mapping_example
