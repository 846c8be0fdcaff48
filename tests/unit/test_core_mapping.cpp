// 2D mappings and bucket ids (reference `get_bucket_ids_2d`, `get_num_buckets`): every golden bucket_ids case exactly, the table
// sizes K of the reference configs, undirected ranges, direction, the crop property, the id width,
// the extra (skip) bucket, and the paper variants against hand-computed ids.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <rpe/bucket_cache.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/quantization.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_core_mapping {

namespace {

using rpe::index::clip;
using rpe::index::piecewise;
namespace mapping = rpe::mapping;

const piecewise r19 = piecewise::from_ratio(1.9);

// Name of a mapping type in the golden folder names (bucket_ids/<name>_<h>x<w>_skip<s>_r1.9).
template <class M>
constexpr const char* golden_name() {
    if constexpr (std::is_same_v<M, mapping::euclidean<>>)
        return "euclidean";
    else if constexpr (std::is_same_v<M, mapping::quantization<>>)
        return "quantization";
    else if constexpr (std::is_same_v<M, mapping::cross<>>)
        return "cross";
    else
        return "product";
}

/// Token index of grid cell (r, c) in a grid of width w after `skip` extra tokens.
int token(int r, int c, int w, int skip) { return skip + r * w + c; }

}  // namespace

TEST_CASE_TEMPLATE("bucket ids match every golden bucket_ids case exactly", M, mapping::euclidean<>, mapping::quantization<>,
                   mapping::cross<>, mapping::product<>) {
    const M m{r19};
    const int grids[2][2] = {{7, 7}, {5, 9}};
    int cases = 0;
    for (const auto& hw : grids)
        for (int skip : {0, 1}) {
            const std::string name = std::string("bucket_ids/") + golden_name<M>() + "_" + std::to_string(hw[0]) + "x" +
                                     std::to_string(hw[1]) + "_skip" + std::to_string(skip) + "_r1.9";
            INFO("case " << name);
            const std::string dir = rpe_test::golden(name);
            const auto ids = rpe::build_bucket_ids(m, hw[0], hw[1], skip);
            const std::int64_t n = skip + hw[0] * hw[1];
            REQUIRE(ids->length() == n);
            CHECK(ids->height() == hw[0]);
            CHECK(ids->width() == hw[1]);
            CHECK(ids->skip() == skip);
            // meta.json num_buckets: Product 49 (+1), the others 7 (+1) per table
            CHECK(ids->num_buckets() == m.num_buckets() + (skip > 0 ? 1 : 0));
            if constexpr (rpe::detail::num_tables_of<M>() == 2) {
                REQUIRE(ids->num_tables() == 2);
                rpe_test::check_exact(rpe_test::ids_matrix(*ids, 0),
                                      rpe_test::load<std::int64_t>(dir, "bucket_ids_rows.npy", {n, n}), "rows");
                rpe_test::check_exact(rpe_test::ids_matrix(*ids, 1),
                                      rpe_test::load<std::int64_t>(dir, "bucket_ids_cols.npy", {n, n}), "cols");
            } else {
                REQUIRE(ids->num_tables() == 1);
                rpe_test::check_exact(rpe_test::ids_matrix(*ids), rpe_test::load<std::int64_t>(dir, "bucket_ids.npy", {n, n}),
                                      "ids");
            }
            ++cases;
        }
    CHECK(cases == 4);
}

TEST_CASE("table sizes K of the reference configs (get_num_buckets)") {
    // Product ratio 1.9: (2·3+1)² = 49 buckets, 50 with the class token (the paper's example).
    const mapping::product<> deit{piecewise::from_ratio(1.9)};
    CHECK(deit.num_buckets() == 49);
    CHECK(rpe::build_bucket_ids(deit, 14, 14, 1)->num_buckets() == 50);
    // Euclidean ratio 20: β = 40, 2·40+1 = 81 (+1 with a class token).
    const mapping::euclidean<> euc{piecewise::from_ratio(20.0)};
    CHECK(euc.num_buckets() == 81);
    CHECK(rpe::build_bucket_ids(euc, 3, 3, 1)->num_buckets() == 82);
    // Quantization ratio 33: β = 66, 2·66+1 = 133 (+1).
    const mapping::quantization<> quant{piecewise::from_ratio(33.0)};
    CHECK(quant.num_buckets() == 133);
    CHECK(rpe::build_bucket_ids(quant, 3, 3, 1)->num_buckets() == 134);
    // Cross ratio 20: 81 per table, two tables.
    const mapping::cross<> cross{piecewise::from_ratio(20.0)};
    CHECK(cross.num_buckets() == 81);
    const auto cross_ids = rpe::build_bucket_ids(cross, 3, 3, 0);
    CHECK(cross_ids->num_buckets() == 81);
    CHECK(cross_ids->num_tables() == 2);
    // DETR encoder: Product ratio 2.0, no class token: (2·4+1)² = 81.
    const mapping::product<> detr{piecewise::from_ratio(2.0)};
    CHECK(detr.num_buckets() == 81);
    CHECK(rpe::build_bucket_ids(detr, 5, 7, 0)->num_buckets() == 81);
}

TEST_CASE_TEMPLATE("undirected mappings: ids from beta_int to 2 beta_int, symmetric", M, mapping::euclidean<>,
                   mapping::quantization<>, mapping::euclidean_paper<>, mapping::quantization_paper<>) {
    for (const piecewise g : {piecewise::from_ratio(1.9), piecewise::from_ratio(2.0), piecewise{1.0, 2.0, 4.0}}) {
        const M m{g};
        const int b = g.beta_int();
        const auto ids = rpe::build_bucket_ids(m, 9, 11, 0);
        const int n = ids->length();
        int lo = 1 << 30, hi = -1;
        bool symmetric = true;
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j) {
                const int id = ids->at(0, i, j);
                lo = std::min(lo, id);
                hi = std::max(hi, id);
                symmetric = symmetric && id == ids->at(0, j, i);
            }
        CAPTURE(g.alpha);
        CHECK(lo == b);      // distance 0 → g(0) + βi
        CHECK(hi == 2 * b);  // a 9x11 grid reaches saturation for these ratios
        CHECK(symmetric);
    }
}

TEST_CASE("directed mappings: Product and Cross distinguish (dr, dc) from (-dr, -dc)") {
    const auto prod = rpe::build_bucket_ids(mapping::product<>{r19}, 4, 5, 1);
    const auto cross = rpe::build_bucket_ids(mapping::cross<>{r19}, 4, 5, 1);
    const int n = prod->length();
    int prod_asym = 0, rows_asym = 0, cols_asym = 0;
    for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j) {
            prod_asym += prod->at(0, i, j) != prod->at(0, j, i);
            rows_asym += cross->at(0, i, j) != cross->at(0, j, i);
            cols_asym += cross->at(1, i, j) != cross->at(1, j, i);
        }
    CHECK(prod_asym > 0);
    CHECK(rows_asym > 0);
    CHECK(cols_asym > 0);
    // Hand values (ratio 1.9, βi = 3, 7 ids per axis): token 1 = cell (0,0), token 1+5+1 = (1,1).
    // id(i,j) has offset (dr, dc) = (r_i − r_j, c_i − c_j) = (−1, −1): (g(−1)+3)·7 + g(−1)+3 = 2·7+2 = 16;
    // id(j,i): (1, 1) → 4·7+4 = 32.
    const int a = token(0, 0, 5, 1), b = token(1, 1, 5, 1);
    CHECK(prod->at(0, a, b) == 16);
    CHECK(prod->at(0, b, a) == 32);
    CHECK(cross->at(0, a, b) == 2);  // rows: g(−1)+3
    CHECK(cross->at(1, b, a) == 4);  // cols: g(1)+3
    // (dr, dc) = (−3, 2): rows g(−3)+3 = 1, cols g(2)+3 = 5; Product 1·7+5 = 12.
    const int c = token(0, 3, 5, 1), d = token(3, 1, 5, 1);
    CHECK(prod->at(0, c, d) == 12);
    CHECK(cross->at(0, c, d) == 1);
    CHECK(cross->at(1, c, d) == 5);
}

TEST_CASE_TEMPLATE("crop property: a smaller grid's ids are the top-left crop of a larger grid's", M, mapping::euclidean<>,
                   mapping::quantization<>, mapping::cross<>, mapping::product<>, mapping::euclidean_paper<>,
                   mapping::quantization_paper<>) {
    // Ids depend only on offsets; token (r, c) of an h×w grid is token (r, c) of the
    // H×W grid (grid coordinates, not flat indices), extra tokens map to themselves.
    const M m{r19};
    for (int skip : {0, 1, 3}) {
        CAPTURE(skip);
        const int H = 9, W = 11, h = 4, w = 6;
        const auto big = rpe::build_bucket_ids(m, H, W, skip);
        const auto small = rpe::build_bucket_ids(m, h, w, skip);
        auto to_big = [&](int t) { return t < skip ? t : skip + ((t - skip) / w) * W + (t - skip) % w; };
        bool same = true;
        for (int t = 0; t < small->num_tables(); ++t)
            for (int i = 0; i < small->length(); ++i)
                for (int j = 0; j < small->length(); ++j) same = same && small->at(t, i, j) == big->at(t, to_big(i), to_big(j));
        CHECK(same);
        // and the crop is not the trivial flat-prefix crop, which differs (rows have another width)
        bool flat_same = true;
        for (int i = 0; i < small->length(); ++i)
            for (int j = 0; j < small->length(); ++j) flat_same = flat_same && small->at(0, i, j) == big->at(0, i, j);
        CHECK_FALSE(flat_same);
    }
}

TEST_CASE("id width: 1 byte up to 256 ids, 2 bytes up to 65536, 4 beyond") {
    SUBCASE("every reference config fits one byte") {
        const auto ids = rpe::build_bucket_ids(mapping::product<>{r19}, 14, 14, 1);
        CHECK(ids->id_bytes() == 1);
        // bytes(): the (L, L) table plus the (2H-1)(2W-1) per-offset ids, per table
        CHECK(ids->bytes() == 197 * 197 + 27 * 27);
        CHECK(rpe::build_bucket_ids(mapping::cross<>{piecewise::from_ratio(20.0)}, 5, 5, 1)->bytes() == 2 * (26 * 26 + 9 * 9));
    }
    SUBCASE("product with clip beta = 8: 17^2 = 289 buckets need 2 bytes, ids above 255 survive") {
        const mapping::product<clip> m{clip{8.0}};
        CHECK(m.num_buckets() == 289);
        const auto ids = rpe::build_bucket_ids(m, 9, 9, 0);
        CHECK(ids->id_bytes() == 2);
        CHECK(ids->bytes() == (81 * 81 + 17 * 17) * 2);
        // cell (8,8) to cell (0,0): (dr, dc) = (8, 8) → (8+8)·17 + 8+8 = 288 (the largest id)
        CHECK(ids->at(0, token(8, 8, 9, 0), token(0, 0, 9, 0)) == 288);
        CHECK(ids->at(0, token(0, 0, 9, 0), token(8, 8, 9, 0)) == 0);
        CHECK(ids->at(0, token(4, 4, 9, 0), token(4, 4, 9, 0)) == 144);  // (0,0) → 8·17+8
    }
    SUBCASE("the width holds the largest id, not the count: 255 + extra = 256 ids fit one byte") {
        // Euclidean with clip beta = 127: 2·127+1 = 255 buckets, the extra id 255 with skip.
        const mapping::euclidean<clip> m{clip{127.0}};
        const auto with_skip = rpe::build_bucket_ids(m, 2, 2, 1);
        CHECK(with_skip->num_buckets() == 256);
        CHECK(with_skip->id_bytes() == 1);
        CHECK(with_skip->at(0, 0, 0) == 255);
        // beta = 128: 257 buckets, largest id 256 → 2 bytes even without skip
        const auto wide = rpe::build_bucket_ids(mapping::euclidean<clip>{clip{128.0}}, 2, 2, 0);
        CHECK(wide->num_buckets() == 257);
        CHECK(wide->id_bytes() == 2);
    }
    SUBCASE("more than 65536 ids: 4 bytes") {
        // Product with clip beta = 128: 257² = 66049 buckets.
        const auto ids = rpe::build_bucket_ids(mapping::product<clip>{clip{128.0}}, 2, 2, 1);
        CHECK(ids->num_buckets() == 66050);
        CHECK(ids->id_bytes() == 4);
        CHECK(ids->at(0, 0, 0) == 66049);
        CHECK(ids->at(0, 1, 1) == 128 * 257 + 128);  // offset (0, 0)
    }
}

TEST_CASE_TEMPLATE("extra bucket on every pair touching a skip token", M, mapping::euclidean<>, mapping::quantization<>,
                   mapping::cross<>, mapping::product<>) {
    const M m{r19};
    for (int skip : {0, 1, 3}) {
        CAPTURE(skip);
        const int h = 4, w = 3;
        const auto ids = rpe::build_bucket_ids(m, h, w, skip);
        const int k = m.num_buckets();
        CHECK(ids->num_buckets() == k + (skip > 0 ? 1 : 0));
        CHECK(ids->length() == skip + h * w);
        bool ok = true;
        for (int t = 0; t < ids->num_tables(); ++t)
            for (int i = 0; i < ids->length(); ++i)
                for (int j = 0; j < ids->length(); ++j) {
                    const int id = ids->at(t, i, j);
                    if (i < skip || j < skip) {
                        ok = ok && id == k;  // the extra id K (= num_buckets() − 1 with skip)
                    } else {
                        const int ri = (i - skip) / w, ci = (i - skip) % w, rj = (j - skip) / w, cj = (j - skip) % w;
                        int expected = 0;
                        if constexpr (rpe::detail::num_tables_of<M>() == 2)
                            expected = m.bucket(ri - rj, ci - cj, t);
                        else
                            expected = m.bucket(ri - rj, ci - cj);
                        ok = ok && id == expected && id < k;
                    }
                }
        CHECK(ok);
    }
}

TEST_CASE("paper variants: euclidean_paper and quantization_paper against hand-computed ids") {
    // g for ratio 1.9 (α = 1.9, ln(γ/α) = ln 8, β − α = 1.9): v(x) = 1.9 + ln(x/1.9)/ln 8 · 1.9
    //   v(2) = 1.947 → 2, v(3) = 2.317 → 2, v(√13 = 3.606) = 2.485 → 2, v(4) = 2.580 → 3;
    // inside α: g(x) = round(x). βi = 3 is added to every id.
    SUBCASE("euclidean_paper differs from euclidean beyond alpha: (dr, dc) = (3, 2)") {
        const mapping::euclidean<> code{r19};
        const mapping::euclidean_paper<> paper{r19};
        // code: round(√13) = 4 → g(4) = 3 → 6; paper: g(3.606) = 2 → 5
        CHECK(code.bucket(3, 2) == 6);
        CHECK(paper.bucket(3, 2) == 5);
        CHECK(code.bucket(-2, 3) == 6);
        CHECK(paper.bucket(-2, 3) == 5);
        // and the built grids differ there too
        const auto a = rpe::build_bucket_ids(code, 4, 4, 0), b = rpe::build_bucket_ids(paper, 4, 4, 0);
        CHECK(a->at(0, token(3, 2, 4, 0), token(0, 0, 4, 0)) == 6);
        CHECK(b->at(0, token(3, 2, 4, 0), token(0, 0, 4, 0)) == 5);
    }
    SUBCASE("euclidean_paper equals euclidean inside alpha") {
        const mapping::euclidean<> code{r19};
        const mapping::euclidean_paper<> paper{r19};
        int inside = 0;
        for (int dr = -2; dr <= 2; ++dr)
            for (int dc = -2; dc <= 2; ++dc)
                if (dr * dr + dc * dc <= 1.9 * 1.9) {  // distances 0, 1, √2
                    CAPTURE(dr);
                    CAPTURE(dc);
                    CHECK(code.bucket(dr, dc) == paper.bucket(dr, dc));
                    ++inside;
                }
        CHECK(inside == 9);
        CHECK(paper.bucket(0, 0) == 3);
        CHECK(paper.bucket(1, 0) == 4);
        CHECK(paper.bucket(1, 1) == 4);  // round(√2) = 1
    }
    SUBCASE("quantization_paper ranks the distinct distances (paper eq. 21)") {
        // Distances 0, 1, √2, 2, √5, √8, 3 (squares 0, 1, 2, 4, 5, 8, 9) are ranks 0..6; with
        // clip beta = 100 (identity on these ranks) the ids are rank + 100; the code's
        // quantization indexes the squared distance instead: 0, 1, 2, 4, 5, 8, 9 (+ 100).
        const mapping::quantization_paper<clip> paper{clip{100.0}};
        const mapping::quantization<clip> code{clip{100.0}};
        const int offsets[7][2] = {{0, 0}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {2, 2}, {3, 0}};
        const int squares[7] = {0, 1, 2, 4, 5, 8, 9};
        for (int r = 0; r < 7; ++r) {
            CAPTURE(r);
            CHECK(paper.bucket(offsets[r][0], offsets[r][1]) == 100 + r);
            CHECK(paper.bucket(-offsets[r][1], offsets[r][0]) == 100 + r);
            CHECK(code.bucket(offsets[r][0], offsets[r][1]) == 100 + squares[r]);
        }
    }
    SUBCASE("quantization_paper vs quantization at ratio 1.9") {
        const mapping::quantization_paper<> paper{r19};
        const mapping::quantization<> code{r19};
        // (1,0) and (1,1) get different ids (eq. 21's point): ranks 1, 2 → g = 1, 2 → 4, 5.
        CHECK(paper.bucket(1, 0) == 4);
        CHECK(paper.bucket(1, 1) == 5);
        // the code's quantization: squares 1, 2 → g(1) = 1, g(2) = 2 → 4, 5 as well;
        CHECK(code.bucket(1, 0) == 4);
        CHECK(code.bucket(1, 1) == 5);
        // they part at (2, 0): code g(4) = 3 → 6; paper rank(4) = 3 (0, 1, 2 below) → g(3) = 2 → 5.
        CHECK(code.bucket(2, 0) == 6);
        CHECK(paper.bucket(2, 0) == 5);
        // far away both saturate at 2βi = 6
        CHECK(code.bucket(10, 10) == 6);
        CHECK(paper.bucket(10, 10) == 6);
    }
}

}  // namespace rpe_unit_core_mapping
