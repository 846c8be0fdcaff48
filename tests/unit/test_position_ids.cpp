// The per-pair id of tokens at positions from the bounding box's per-offset ids
// (rpe::detail::position_id, the function the CUDA attention's kernels read ids at positions
// through; rpe::bucket_ids::box() and linear_positions() give its inputs): equal to
// rpe::build_bucket_ids at positions (bucket_ids::at) at every pair, in both orientations (the
// query target reads id(j, i)), for 2D positions with key positions apart, a permuted grid, a
// BEiT mapping (three extra ids) and 3D positions; a grid has no box and no positions.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/product3d.hpp>

#include <cstdint>
#include <vector>

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_position_ids {

namespace {

using pos_ref = rpe::tensor_ref<const std::int32_t>;

// Counts the pairs (i, j) of every table where position_id(i, j) differs from ids.at(t, i, j),
// reading the box's per-offset ids as the device does (position_id(j, i) for the transposed view too).
int mismatches(const rpe::bucket_ids& ids) {
    REQUIRE(ids.at_positions());
    REQUIRE(ids.box() != nullptr);
    const rpe::detail::id_grid g = ids.grid();
    const rpe::detail::id_positions p = ids.linear_positions();
    REQUIRE(p.query != nullptr);
    REQUIRE(p.key != nullptr);
    const int n = ids.length();
    int wrong = 0;
    for (int t = 0; t < ids.num_tables(); ++t)
        ids.box()->visit_offsets(t, [&](const auto* off, std::size_t) {
            for (int i = 0; i < n; ++i)
                for (int j = 0; j < n; ++j) {
                    wrong += rpe::detail::position_id(g, p, off, i, j) != ids.at(t, i, j);
                    wrong += rpe::detail::position_id(g, p, off, j, i) != ids.at(t, j, i);
                }
        });
    return wrong;
}

}  // namespace

TEST_CASE("position ids: position_id equals build_bucket_ids at positions, key positions apart, skip 1") {
    const rpe::mapping::product<> m{rpe::index::piecewise::from_ratio(1.9)};
    // irregular (repeats, negative coordinates) query and key positions
    const std::vector<std::int32_t> q = {0, 0, 5, 1, -2, 3, 0, 0, 7, -4};
    const std::vector<std::int32_t> k = {1, 1, -3, 0, 2, 2, 9, 9, 0, 4};
    const auto self = rpe::build_bucket_ids(m, pos_ref(q.data(), {5, 2}), 1);
    const auto cross = rpe::build_bucket_ids(m, pos_ref(q.data(), {5, 2}), pos_ref(k.data(), {5, 2}), 1);
    CHECK(mismatches(*self) == 0);
    CHECK(mismatches(*cross) == 0);
    // hand-checked: the box of q and k spans rows -3..9 (13) and columns -4..9 (14); the key
    // positions are read apart from the queries'
    CHECK(cross->box()->height() == 13);
    CHECK(cross->box()->width() == 14);
    const auto pc = cross->linear_positions(), ps = self->linear_positions();
    CHECK(pc.key != pc.query);
    CHECK(ps.key == ps.query);
    // token 1 = q (0, 0), key token 2 = k (-3, 0): offset (3, 0); the box's id of that offset
    const int id = cross->at(0, 1, 2);
    CHECK(id == m.bucket(3, 0));
    // box coordinates (row − lo_r, col − lo_c) = (3, 4) and (0, 4); base = (H − 1)(2W − 1) + W − 1
    CHECK(pc.query[0] == 3 * 27 + 4);
    CHECK(pc.key[1] == 0 * 27 + 4);
    CHECK(pc.base == 12 * 27 + 13);
    // extra tokens: the extra id K − 1
    const rpe::detail::id_grid g = cross->grid();
    CHECK(g.extra == m.num_buckets());
    cross->box()->visit_offsets(0, [&](const auto* off, std::size_t) {
        CHECK(rpe::detail::position_id(g, pc, off, 0, 3) == m.num_buckets());
        CHECK(rpe::detail::position_id(g, pc, off, 3, 0) == m.num_buckets());
        CHECK(rpe::detail::position_id(g, pc, off, 1, 2) == m.bucket(3, 0));
    });
}

TEST_CASE("position ids: a permuted grid, Cross (two tables), BEiT (three extra ids) and 3D positions") {
    // a 3 x 4 grid's positions in a scrambled order, skip 1
    std::vector<std::int32_t> grid;
    for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c) grid.insert(grid.end(), {r, c});
    std::vector<std::int32_t> perm;
    for (int i : {5, 0, 11, 3, 7, 1, 9, 2, 10, 4, 8, 6}) perm.insert(perm.end(), {grid[2 * i], grid[2 * i + 1]});
    const pos_ref pp(perm.data(), {12, 2});
    SUBCASE("cross") {
        const rpe::mapping::cross<> m{rpe::index::piecewise::from_ratio(1.9)};
        const auto ids = rpe::build_bucket_ids(m, pp, 1);
        REQUIRE(ids->num_tables() == 2);
        CHECK(mismatches(*ids) == 0);
    }
    SUBCASE("beit, skip 1: class -> token, token -> class and class -> class ids") {
        const rpe::mapping::beit m{3, 4};
        const auto ids = rpe::build_bucket_ids(m, pp, pos_ref(grid.data(), {12, 2}), 1);
        CHECK(mismatches(*ids) == 0);
        const int k = ids->num_buckets();
        const auto p = ids->linear_positions();
        ids->box()->visit_offsets(0, [&](const auto* off, std::size_t) {
            CHECK(rpe::detail::position_id(ids->grid(), p, off, 0, 0) == k - 1);
            CHECK(rpe::detail::position_id(ids->grid(), p, off, 0, 5) == k - 3);
            CHECK(rpe::detail::position_id(ids->grid(), p, off, 5, 0) == k - 2);
        });
    }
    SUBCASE("3D product3d at (t, row, col), skip 2") {
        const rpe::mapping::product3d<> m{};
        std::vector<std::int32_t> p3 = {0, 0, 0, 1, 2, 1, 0, 1, 3, 2, 0, 0, 1, 1, 1, -1, 0, 2};
        std::vector<std::int32_t> k3 = {1, 0, 0, 0, 2, 2, 2, 1, 3, 0, 0, 1, 1, 2, 0, 0, 0, 0};
        const auto ids = rpe::build_bucket_ids(m, pos_ref(p3.data(), {6, 3}), pos_ref(k3.data(), {6, 3}), 2);
        CHECK(ids->box()->depth() == 4);  // t from -1 to 2
        CHECK(mismatches(*ids) == 0);
    }
}

TEST_CASE("position ids: ids of a grid have no box and no linear positions") {
    const auto ids = rpe::build_bucket_ids(rpe::mapping::product<>{rpe::index::piecewise::from_ratio(1.9)}, 3, 4, 1);
    CHECK(!ids->at_positions());
    CHECK(ids->box() == nullptr);
    const auto p = ids->linear_positions();
    CHECK(p.query == nullptr);
    CHECK(p.key == nullptr);
    CHECK(p.base == 0);
}

}  // namespace rpe_unit_position_ids
