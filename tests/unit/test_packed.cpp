// Packed sequences (attention_inputs::packed) and valid key lengths (attention_inputs::key_lengths)
// in the fused and the composed attention (CPU): a packed batch of 4 images of different sizes
// (grids or positions, skip 0 or 1, iRPE-K contextual product, iRPE-QKV with per-head and shared
// tables, masks) equals running the images one by one (ids exact, outputs and every gradient to
// float rounding), bit-identically for 1 and 2 threads, and never reads a pair of two images; key
// lengths equal the key padding mask that marks the same keys; every bad input throws naming it.
#include <doctest/doctest.h>
#include <rpe/rpe.hpp>
#include <rpe/make_term.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu_paths.hpp"
#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_packed {

namespace {

using pos_ref = rpe::tensor_ref<const std::int32_t>;

template <class S>
std::vector<S> random_vector(std::size_t n, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<S> v(n);
    for (auto& e : v) e = static_cast<S>(normal(rng));
    return v;
}

template <class S>
double max_abs_diff(const std::vector<S>& a, const std::vector<S>& b) {
    REQUIRE(a.size() == b.size());
    double m = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
        if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
        m = std::max(m, std::abs(x - y));
    }
    return m;
}

std::size_t size_of(const std::vector<std::int64_t>& s) {
    std::size_t z = 1;
    for (auto e : s) z *= static_cast<std::size_t>(e);
    return z;
}

template <class T, class V>
rpe::tensor_ref<T> view(V& x, const std::vector<std::int64_t>& s) {
    return rpe::tensor_ref<T>(x.data(), std::span<const std::int64_t>(s.data(), s.size()));
}

/// Outputs and every gradient of one attention call.
template <class S>
struct result {
    std::vector<S> out, gq, gk, gv;
    std::vector<std::vector<S>> gt;  // table gradients, slots q, k, v in order
};

/// Forward and backward of `in` (q, k, v, terms and tables set) for grad_out `go`: the fused
/// attention, or the composed baseline (`composed`).
template <class S>
result<S> run(rpe::attention_inputs<S> in, const std::vector<S>& go, bool composed) {
    const std::vector<std::int64_t> shape{in.q.extent(0), in.q.extent(1), in.q.extent(2), in.q.extent(3)};
    const std::int64_t b = shape[0], h = shape[1], l = shape[2];
    result<S> r;
    r.out.assign(size_of(shape), S(0));
    r.gq.assign(r.out.size(), S(-7));  // overwritten
    r.gk.assign(r.out.size(), S(-7));
    r.gv.assign(r.out.size(), S(-7));
    std::size_t count = 0;
    for (auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v})
        if (slot->term) count += slot->tables.size();
    r.gt.reserve(count);
    for (auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) {
        if (!slot->term) continue;
        slot->grad_tables.clear();
        for (std::size_t t = 0; t < slot->tables.size(); ++t) {
            r.gt.emplace_back(size_of(slot->term->table_shape()), S(-7));  // overwritten
            slot->grad_tables.push_back(view<S>(r.gt.back(), slot->term->table_shape()));
        }
    }
    const rpe::attention_gradients<S> g{.grad_out = view<const S>(go, shape),
                                        .grad_q = view<S>(r.gq, shape),
                                        .grad_k = view<S>(r.gk, shape),
                                        .grad_v = view<S>(r.gv, shape)};
    if (composed) {
        std::vector<S> attn(static_cast<std::size_t>(b * h * l * l));
        rpe::composed_attention_forward(in, view<S>(r.out, shape), rpe::tensor_ref<S>(attn.data(), {b, h, l, l}));
        auto gs = g;
        gs.saved_attn = rpe::tensor_ref<const S>(attn.data(), {b, h, l, l});
        rpe::composed_attention_backward(in, gs);
    } else {
        rpe::attention_forward(in, view<S>(r.out, shape));
        rpe::attention_backward(in, g);
    }
    return r;
}

/// Tokens [off, off + len) of a contiguous (B, H, L, D) buffer, contiguous.
template <class S>
std::vector<S> rows_of(const std::vector<S>& x, std::int64_t planes, std::int64_t l, std::int64_t d, std::int64_t off,
                       std::int64_t len) {
    std::vector<S> out(static_cast<std::size_t>(planes * len * d));
    for (std::int64_t p = 0; p < planes; ++p) std::copy_n(x.begin() + (p * l + off) * d, len * d, out.begin() + p * len * d);
    return out;
}

/// One image: a grid (height, width), or positions (height, width are then 0).
struct image {
    int height = 0, width = 0;
    std::vector<std::int32_t> positions;  // (N, 2)
    [[nodiscard]] int tokens() const { return positions.empty() ? height * width : static_cast<int>(positions.size() / 2); }
};

/// A subset of a height x width grid's positions in a random order, shifted: n tokens.
std::vector<std::int32_t> scattered(int height, int width, int n, std::uint32_t seed) {
    std::vector<int> perm(static_cast<std::size_t>(height * width));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<std::int32_t> p;
    for (int i = 0; i < n; ++i) {
        p.push_back(perm[static_cast<std::size_t>(i)] / width + 3);
        p.push_back(perm[static_cast<std::size_t>(i)] % width - 2);
    }
    return p;
}

const rpe::index::piecewise pw = rpe::index::piecewise::from_ratio(1.9);

/// A packed problem: B, H, D, skip, the images, the terms (and their tables), q, k, v, grad_out.
template <class S>
struct packed_problem {
    std::int64_t b = 2, h = 2, d = 8, l = 0;
    int skip = 1;
    std::vector<image> images;
    std::vector<std::int32_t> lengths, grids, positions;
    std::vector<rpe::term_desc> terms;  // slots q, k, v: the attached ones (nullptr term = none)
    const rpe::term_desc* slot_term[3] = {nullptr, nullptr, nullptr};
    std::vector<std::vector<S>> tables;
    std::vector<S> q, k, v, go;
    std::vector<std::uint8_t> kpm;
    std::vector<S> attn_mask;

    /// qkv: rpe_q (euclidean, contextual, per-head), rpe_k (product, contextual, shared), rpe_v
    /// (cross, contextual, per-head, 2 tables); else rpe_k only (product, contextual, shared).
    packed_problem(std::vector<image> imgs, int skip_, bool qkv, std::uint32_t seed, std::int64_t b_ = 2, std::int64_t h_ = 2)
        : b(b_), h(h_), skip(skip_), images(std::move(imgs)) {
        terms.reserve(3);
        const rpe::term_config per_head{
            .num_heads = static_cast<int>(h), .head_dim = static_cast<int>(d), .shared_head = false, .skip = skip};
        const rpe::term_config shared{
            .num_heads = static_cast<int>(h), .head_dim = static_cast<int>(d), .shared_head = true, .skip = skip};
        if (qkv) {
            terms.push_back(rpe::make_term_desc(rpe::mapping::euclidean<>{pw}, true, rpe::target::query, per_head));
            slot_term[0] = &terms.back();
        }
        terms.push_back(rpe::make_term_desc(rpe::mapping::product<>{pw}, true, rpe::target::key, shared));
        slot_term[1] = &terms.back();
        if (qkv) {
            terms.push_back(rpe::make_term_desc(rpe::mapping::cross<>{pw}, true, rpe::target::value, per_head));
            slot_term[2] = &terms.back();
        }
        std::uint32_t s = seed;
        for (const auto* t : slot_term)
            if (t)
                for (int i = 0; i < t->num_tables(); ++i) tables.push_back(random_vector<S>(size_of(t->table_shape()), ++s));
        for (const auto& im : images) {
            lengths.push_back(skip + im.tokens());
            grids.push_back(im.height);
            grids.push_back(im.width);
            positions.insert(positions.end(), im.positions.begin(), im.positions.end());
            l += skip + im.tokens();
        }
        const auto n = static_cast<std::size_t>(b * h * l * d);
        q = random_vector<S>(n, seed + 101);
        k = random_vector<S>(n, seed + 102);
        v = random_vector<S>(n, seed + 103);
        go = random_vector<S>(n, seed + 104);
    }
    [[nodiscard]] bool at_positions() const { return !images.front().positions.empty(); }
    [[nodiscard]] std::vector<std::int64_t> shape(std::int64_t len) const { return {b, h, len, d}; }

    /// The terms and tables on `in`.
    void attach(rpe::attention_inputs<S>& in) const {
        std::size_t next = 0;
        rpe::attention_term<S>* slots[] = {&in.rpe_q, &in.rpe_k, &in.rpe_v};
        for (int i = 0; i < 3; ++i) {
            if (!slot_term[i]) continue;
            slots[i]->term = slot_term[i];
            for (int t = 0; t < slot_term[i]->num_tables(); ++t, ++next)
                slots[i]->tables.push_back(view<const S>(tables[next], slot_term[i]->table_shape()));
        }
    }

    /// The packed inputs (views of this problem's buffers).
    [[nodiscard]] rpe::attention_inputs<S> packed() const {
        rpe::attention_inputs<S> in;
        in.q = view<const S>(q, shape(l));
        in.k = view<const S>(k, shape(l));
        in.v = view<const S>(v, shape(l));
        const auto m = static_cast<std::int64_t>(images.size());
        in.packed.lengths = pos_ref(lengths.data(), {m});
        if (at_positions())
            in.packed.positions = pos_ref(positions.data(), {static_cast<std::int64_t>(positions.size() / 2), 2});
        else
            in.packed.grids = pos_ref(grids.data(), {m, 2});
        if (!kpm.empty()) in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(kpm.data(), {b, l});
        if (!attn_mask.empty()) in.attn_mask = view<const S>(attn_mask, {l, l});
        attach(in);
        return in;
    }

    /// Every image alone (its own contiguous q, k, v, masks; its grid or positions), fused or
    /// composed, put together: each image's rows, the table gradients summed in image order.
    [[nodiscard]] result<S> one_by_one(bool composed) const {
        result<S> all;
        all.out.assign(q.size(), S(0));
        all.gq = all.gk = all.gv = all.out;
        std::int64_t off = 0;
        for (std::size_t m = 0; m < images.size(); ++m) {
            const std::int64_t len = lengths[m];
            const auto qm = rows_of(q, b * h, l, d, off, len), km = rows_of(k, b * h, l, d, off, len),
                       vm = rows_of(v, b * h, l, d, off, len), gm = rows_of(go, b * h, l, d, off, len);
            std::vector<std::uint8_t> kpm_m;
            std::vector<S> mask_m;
            rpe::attention_inputs<S> in;
            in.q = view<const S>(qm, shape(len));
            in.k = view<const S>(km, shape(len));
            in.v = view<const S>(vm, shape(len));
            const auto& im = images[m];
            if (im.positions.empty()) {
                in.height = im.height;
                in.width = im.width;
            } else {
                in.positions = pos_ref(im.positions.data(), {static_cast<std::int64_t>(im.positions.size() / 2), 2});
            }
            if (!kpm.empty()) {
                for (std::int64_t i = 0; i < b; ++i)
                    kpm_m.insert(kpm_m.end(), kpm.begin() + i * l + off, kpm.begin() + i * l + off + len);
                in.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(kpm_m.data(), {b, len});
            }
            if (!attn_mask.empty()) {
                for (std::int64_t i = 0; i < len; ++i)
                    mask_m.insert(mask_m.end(), attn_mask.begin() + (off + i) * l + off,
                                  attn_mask.begin() + (off + i) * l + off + len);
                in.attn_mask = view<const S>(mask_m, {len, len});
            }
            attach(in);
            const auto r = run(in, gm, composed);
            for (std::int64_t p = 0; p < b * h; ++p) {
                const auto put = [&](const std::vector<S>& src, std::vector<S>& dst) {
                    std::copy_n(src.begin() + p * len * d, len * d, dst.begin() + (p * l + off) * d);
                };
                put(r.out, all.out);
                put(r.gq, all.gq);
                put(r.gk, all.gk);
                put(r.gv, all.gv);
            }
            if (m == 0)
                all.gt = r.gt;
            else
                for (std::size_t t = 0; t < r.gt.size(); ++t)
                    for (std::size_t e = 0; e < r.gt[t].size(); ++e) all.gt[t][e] += r.gt[t][e];
            off += len;
        }
        return all;
    }
};

template <class S>
void check_close(const result<S>& a, const result<S>& b, double tol) {
    CHECK(max_abs_diff(a.out, b.out) <= tol);
    CHECK(max_abs_diff(a.gq, b.gq) <= tol);
    CHECK(max_abs_diff(a.gk, b.gk) <= tol);
    CHECK(max_abs_diff(a.gv, b.gv) <= tol);
    REQUIRE(a.gt.size() == b.gt.size());
    for (std::size_t t = 0; t < a.gt.size(); ++t) CHECK(max_abs_diff(a.gt[t], b.gt[t]) <= 10 * tol);
}

template <class S>
void check_identical(const result<S>& a, const result<S>& b) {
    CHECK(a.out == b.out);
    CHECK(a.gq == b.gq);
    CHECK(a.gk == b.gk);
    CHECK(a.gv == b.gv);
    CHECK(a.gt == b.gt);
}

/// Four images of different sizes: grids (3x4, 2x5, 1x1, 4x4), or positions (scattered subsets).
std::vector<image> four_images(bool positions) {
    if (!positions) return {{3, 4, {}}, {2, 5, {}}, {1, 1, {}}, {4, 4, {}}};
    return {{0, 0, scattered(3, 4, 9, 1)},
            {0, 0, scattered(5, 5, 14, 2)},
            {0, 0, scattered(1, 1, 1, 3)},
            {0, 0, scattered(4, 6, 20, 4)}};
}

}  // namespace

TEST_CASE_TEMPLATE("packed: 4 images of different sizes equal running them one by one (fused and composed)", S, float, double) {
    const double tol = std::is_same_v<S, float> ? 2e-5 : 1e-12;
    for (const bool positions : {false, true})
        for (const int skip : {0, 1})
            for (const bool qkv : {false, true}) {
                CAPTURE(positions);
                CAPTURE(skip);
                CAPTURE(qkv);
                const packed_problem<S> pb(four_images(positions), skip, qkv, 7u + static_cast<std::uint32_t>(skip));
                const auto alone = pb.one_by_one(false);
                const auto packed = run(pb.packed(), pb.go, false);
                check_close(packed, alone, tol);
                // the composed baseline, packed and one by one, agrees
                check_close(run(pb.packed(), pb.go, true), alone, tol);
                check_close(pb.one_by_one(true), alone, tol);
                double mag = 0;
                for (S x : packed.out) mag = std::max(mag, std::abs(static_cast<double>(x)));
                CHECK(mag > 0.1);
            }
}

TEST_CASE("packed: each image's ids are exactly the ids of that image alone") {
    for (const bool positions : {false, true}) {
        const packed_problem<double> pb(four_images(positions), 1, true, 3);
        const auto in = pb.packed();
        const auto imgs = rpe::detail::packed_images(in);
        REQUIRE(imgs.size() == 4);
        std::int64_t off = 0;
        for (std::size_t m = 0; m < imgs.size(); ++m) {
            CAPTURE(m);
            CHECK(imgs[m].offset == off);
            CHECK(imgs[m].length == pb.lengths[m]);
            off += pb.lengths[m];
            const auto& im = pb.images[m];
            for (const auto* slot : {&in.rpe_q, &in.rpe_k, &in.rpe_v}) {
                const auto got = rpe::detail::ids_of(*slot, imgs[m].in);
                const auto own = im.positions.empty() ? slot->term->bucket_ids(im.height, im.width)
                                                      : slot->term->bucket_ids(pos_ref(im.positions.data(), {im.tokens(), 2}));
                REQUIRE(got->length() == pb.lengths[m]);
                REQUIRE(got->num_tables() == own->num_tables());
                int wrong = 0;
                for (int t = 0; t < got->num_tables(); ++t)
                    for (int i = 0; i < got->length(); ++i)
                        for (int j = 0; j < got->length(); ++j) wrong += got->at(t, i, j) != own->at(t, i, j);
                CHECK(wrong == 0);
            }
        }
        CHECK(off == pb.l);
    }
}

TEST_CASE("packed: masks stay within each image; pairs across images are never read") {
    packed_problem<double> pb(four_images(false), 1, true, 11);
    // the key padding mask pads two keys of image 1 and one of image 3 (batch 0), none in batch 1
    pb.kpm.assign(static_cast<std::size_t>(pb.b * pb.l), 0);
    pb.kpm[static_cast<std::size_t>(13 + 4)] = pb.kpm[static_cast<std::size_t>(13 + 7)] = 1;
    pb.kpm[static_cast<std::size_t>(13 + 11 + 2 + 5)] = 1;
    // the additive mask: random within the images, NaN across them (a read would poison the row)
    pb.attn_mask.assign(static_cast<std::size_t>(pb.l * pb.l), std::numeric_limits<double>::quiet_NaN());
    const auto noise = random_vector<double>(pb.attn_mask.size(), 5);
    std::int64_t off = 0;
    for (const auto len : pb.lengths) {
        for (std::int64_t i = off; i < off + len; ++i)
            for (std::int64_t j = off; j < off + len; ++j)
                pb.attn_mask[static_cast<std::size_t>(i * pb.l + j)] = noise[i * pb.l + j];
        off += len;
    }
    const auto alone = pb.one_by_one(false);
    check_close(run(pb.packed(), pb.go, false), alone, 1e-12);
    check_close(run(pb.packed(), pb.go, true), alone, 1e-12);
    // the padded keys' gradient rows are exactly zero
    const auto r = run(pb.packed(), pb.go, false);
    for (std::int64_t hh = 0; hh < pb.h; ++hh)
        for (std::int64_t e = 0; e < pb.d; ++e) {
            CHECK(r.gk[static_cast<std::size_t>((hh * pb.l + 17) * pb.d + e)] == 0.0);
            CHECK(r.gv[static_cast<std::size_t>((hh * pb.l + 31) * pb.d + e)] == 0.0);
        }
}

TEST_CASE("packed: results are bit-identical for 1, 2 and 3 threads") {
    // B = H = 1: every image is one (batch, head) item, fewer than the threads, so the backward runs
    // the images side by side; B = H = 2: four items per image, each image shares the threads
    for (const std::int64_t bh : {1, 2})
        for (const bool positions : {false, true}) {
            CAPTURE(bh);
            CAPTURE(positions);
            const packed_problem<float> pb(four_images(positions), 1, true, 21, bh, bh);
            rpe_test::set_threads(1);
            const auto one = run(pb.packed(), pb.go, false);
            check_close(one, pb.one_by_one(false), 2e-5);
            for (const int threads : {2, 3}) {
                rpe_test::set_threads(threads);
                check_identical(one, run(pb.packed(), pb.go, false));
            }
        }
    rpe_test::set_threads(2);
}

TEST_CASE_TEMPLATE("packed: the images run side by side give the same bits as on one thread (Eigen's products)", S, float,
                   double) {
    // B = H = 1, two images (4 x 8 and 6 x 1 grids, class token), D = 48, contextual Product/clip
    // terms on q and k (K = 626): the query term's per-plane products (L_k x K)·(K x D) are large
    // enough for Eigen's parallel product (double; float without AVX-512F), which the images run
    // side by side (nested regions of one thread) must not take.
    const std::int64_t h = 1, d = 48, l = (1 + 32) + (1 + 6);
    const std::vector<std::int32_t> lens = {33, 7}, grids = {4, 8, 6, 1};
    std::vector<S> q = random_vector<S>(static_cast<std::size_t>(h * l * d), 1), k = random_vector<S>(q.size(), 2),
                   v = random_vector<S>(q.size(), 3), go = random_vector<S>(q.size(), 4);
    rpe::attention_inputs<S> in;
    in.q = {q.data(), {1, h, l, d}};
    in.k = {k.data(), {1, h, l, d}};
    in.v = {v.data(), {1, h, l, d}};
    in.packed.lengths = {lens.data(), {2}};
    in.packed.grids = {grids.data(), {2, 2}};
    std::vector<std::unique_ptr<rpe::any_term<S>>> terms;
    std::vector<std::vector<S>> tabs;
    std::vector<std::vector<std::int64_t>> shapes;
    tabs.reserve(2);
    shapes.reserve(2);
    rpe::attention_term<S>* slots[2] = {&in.rpe_q, &in.rpe_k};
    for (int t = 0; t < 2; ++t) {
        rpe::term_spec s;
        s.method = rpe::method::product;
        s.index = rpe::index_kind::clip;
        s.beta = 12;
        s.skip = 1;
        s.target = t == 0 ? rpe::target::query : rpe::target::key;
        s.num_heads = static_cast<int>(h);
        s.head_dim = static_cast<int>(d);
        terms.push_back(rpe::make_term<S>(s));
        slots[t]->term = terms.back().get();
        const auto sh = terms.back()->table_shape();
        auto& shape = shapes.emplace_back(sh.begin(), sh.end());
        std::int64_t size = 1;
        for (const auto e : sh) size *= e;
        auto& tab = tabs.emplace_back(random_vector<S>(static_cast<std::size_t>(size), 5u + static_cast<std::uint32_t>(t)));
        slots[t]->tables.push_back(rpe::tensor_ref<const S>(tab.data(), std::span<const std::int64_t>(shape)));
    }
    const auto grads = [&](int threads) {
        rpe_test::set_threads(threads);
        std::vector<S> gq(q.size()), gk(q.size()), gv(q.size());
        rpe::attention_backward(in, rpe::tensor_ref<const S>(go.data(), {1, h, l, d}),
                                rpe::tensor_ref<S>(gq.data(), {1, h, l, d}), rpe::tensor_ref<S>(gk.data(), {1, h, l, d}),
                                rpe::tensor_ref<S>(gv.data(), {1, h, l, d}));
        gq.insert(gq.end(), gk.begin(), gk.end());
        gq.insert(gq.end(), gv.begin(), gv.end());
        return gq;
    };
    const auto one = grads(1);
    for (const int threads : {2, 4}) {
        CAPTURE(threads);
        const auto more = grads(threads);
        CHECK(std::memcmp(one.data(), more.data(), one.size() * sizeof(S)) == 0);
    }
    rpe_test::set_threads(2);
}

TEST_CASE("packed: without terms it is block-diagonal attention; plan_backward_scratch is the largest image's") {
    packed_problem<double> pb(four_images(false), 1, false, 31);
    pb.slot_term[1] = nullptr;
    pb.tables.clear();
    auto in = pb.packed();
    in.packed.grids = {};  // not needed without a term
    const auto r = run(in, pb.go, false);
    const auto alone = pb.one_by_one(false);
    check_close(r, alone, 1e-12);
    // a hand check: one token image (grid 1x1 + skip 1 = 2 tokens) at offset 24: its outputs are
    // softmax-weighted sums of its own two values only
    const std::int64_t off = 13 + 11, d = pb.d;
    const double s = 1.0 / std::sqrt(static_cast<double>(d));
    for (std::int64_t i = 0; i < 2; ++i) {
        double l0 = 0, l1 = 0;
        for (std::int64_t e = 0; e < d; ++e) {
            l0 += pb.q[static_cast<std::size_t>((off + i) * d + e)] * pb.k[static_cast<std::size_t>(off * d + e)] * s;
            l1 += pb.q[static_cast<std::size_t>((off + i) * d + e)] * pb.k[static_cast<std::size_t>((off + 1) * d + e)] * s;
        }
        const double m = std::max(l0, l1), a0 = std::exp(l0 - m), a1 = std::exp(l1 - m);
        for (std::int64_t e = 0; e < d; ++e) {
            const double want =
                (a0 * pb.v[static_cast<std::size_t>(off * d + e)] + a1 * pb.v[static_cast<std::size_t>((off + 1) * d + e)]) /
                (a0 + a1);
            CHECK(r.out[static_cast<std::size_t>((off + i) * d + e)] == doctest::Approx(want).epsilon(1e-12));
        }
    }
    const packed_problem<double> pq(four_images(false), 1, true, 32);
    const auto plan = rpe::cpu::plan_backward_scratch(pq.packed());
    rpe::attention_inputs<double> big;  // the largest image alone: 4x4 + 1 = 17 tokens
    const auto q17 = rows_of(pq.q, pq.b * pq.h, pq.l, pq.d, pq.l - 17, 17);
    big.q = big.k = big.v = view<const double>(q17, pq.shape(17));
    big.height = big.width = 4;
    pq.attach(big);
    const auto want = rpe::cpu::plan_backward_scratch(big);
    CHECK(plan.bytes == want.bytes);
    CHECK(plan.items == want.items);
}

TEST_CASE_TEMPLATE("key_lengths: equal to the key padding mask of the same keys (fused and composed)", S, float, double) {
    const double tol = std::is_same_v<S, float> ? 2e-5 : 1e-12;
    const std::int64_t b = 3, h = 2, l = 13, d = 8;
    const std::vector<std::int32_t> lengths = {13, 5, 0};  // all keys, 5 keys, none (zero output)
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(b * l), 0);
    for (std::int64_t i = 0; i < b; ++i)
        for (std::int64_t j = lengths[static_cast<std::size_t>(i)]; j < l; ++j) mask[static_cast<std::size_t>(i * l + j)] = 1;
    const rpe::term_config cfg{
        .num_heads = static_cast<int>(h), .head_dim = static_cast<int>(d), .shared_head = false, .skip = 1};
    const auto tq = rpe::make_term_desc(rpe::mapping::euclidean<>{pw}, true, rpe::target::query, cfg);
    const auto tk = rpe::make_term_desc(rpe::mapping::product<>{pw}, true, rpe::target::key, cfg);
    const auto tb = rpe::make_term_desc(rpe::mapping::quantization<>{pw}, false, rpe::target::key, cfg);
    const auto tv = rpe::make_term_desc(rpe::mapping::cross<>{pw}, true, rpe::target::value, cfg);
    const auto n = static_cast<std::size_t>(b * h * l * d);
    const auto q = random_vector<S>(n, 1), k = random_vector<S>(n, 2), v = random_vector<S>(n, 3), go = random_vector<S>(n, 4);
    const auto table_q = random_vector<S>(size_of(tq.table_shape()), 5), table_k = random_vector<S>(size_of(tk.table_shape()), 6),
               table_b = random_vector<S>(size_of(tb.table_shape()), 9),
               table_v0 = random_vector<S>(size_of(tv.table_shape()), 7),
               table_v1 = random_vector<S>(size_of(tv.table_shape()), 8);
    const std::vector<std::int64_t> shape{b, h, l, d};
    for (const bool bias_k : {false, true}) {
        CAPTURE(bias_k);
        rpe::attention_inputs<S> in;
        in.q = view<const S>(q, shape);
        in.k = view<const S>(k, shape);
        in.v = view<const S>(v, shape);
        in.height = 3;
        in.width = 4;
        in.rpe_q = {.term = &tq, .tables = {view<const S>(table_q, tq.table_shape())}};
        in.rpe_k = bias_k ? rpe::attention_term<S>{.term = &tb, .tables = {view<const S>(table_b, tb.table_shape())}}
                          : rpe::attention_term<S>{.term = &tk, .tables = {view<const S>(table_k, tk.table_shape())}};
        in.rpe_v = {.term = &tv,
                    .tables = {view<const S>(table_v0, tv.table_shape()), view<const S>(table_v1, tv.table_shape())}};
        auto with_mask = in;
        with_mask.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(mask.data(), {b, l});
        auto with_lengths = in;
        with_lengths.key_lengths = pos_ref(lengths.data(), {b});
        const auto by_mask = run(with_mask, go, false);
        const auto by_lengths = run(with_lengths, go, false);
        check_close(by_lengths, by_mask, tol);
        check_close(run(with_lengths, go, true), by_mask, tol);
        // padded keys: exactly zero grad_k, grad_v rows; batch 2 (length 0): zero output and gradients
        for (std::int64_t p = 0; p < b * h; ++p)
            for (std::int64_t j = lengths[static_cast<std::size_t>(p / h)]; j < l; ++j)
                for (std::int64_t e = 0; e < d; ++e) {
                    CHECK(by_lengths.gk[static_cast<std::size_t>((p * l + j) * d + e)] == S(0));
                    CHECK(by_lengths.gv[static_cast<std::size_t>((p * l + j) * d + e)] == S(0));
                }
        for (std::size_t e = static_cast<std::size_t>(2 * h * l * d); e < n; ++e) {
            CHECK(by_lengths.out[e] == S(0));
            CHECK(by_lengths.gq[e] == S(0));
        }
        // with the mask too (both: padded when either says so); and the attn output / saved_attn path
        auto both = with_lengths;
        std::vector<std::uint8_t> extra(mask.size(), 0);
        extra[2] = 1;  // key 2 of batch 0
        both.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(extra.data(), {b, l});
        auto mask_both = in;
        std::vector<std::uint8_t> merged = mask;
        merged[2] = 1;
        mask_both.key_padding_mask = rpe::tensor_ref<const std::uint8_t>(merged.data(), {b, l});
        check_close(run(both, go, false), run(mask_both, go, false), tol);
        std::vector<S> out(n), attn(static_cast<std::size_t>(b * h * l * l), S(-3)), attn_mask(attn.size());
        rpe::attention_forward(with_lengths, rpe::tensor_ref<S>(out.data(), shape),
                               rpe::tensor_ref<S>(attn.data(), {b, h, l, l}));
        rpe::attention_forward(with_mask, rpe::tensor_ref<S>(out.data(), shape),
                               rpe::tensor_ref<S>(attn_mask.data(), {b, h, l, l}));
        CHECK(max_abs_diff(attn, attn_mask) <= tol);
        for (std::int64_t i = 0; i < l; ++i) CHECK(attn[static_cast<std::size_t>((2 * h * l + i) * l + 3)] == S(0));
        std::vector<S> gq(n), gk(n), gv(n);
        rpe::attention_backward(with_lengths, {.grad_out = view<const S>(go, shape),
                                               .grad_q = view<S>(gq, shape),
                                               .grad_k = view<S>(gk, shape),
                                               .grad_v = view<S>(gv, shape),
                                               .saved_attn = rpe::tensor_ref<const S>(attn.data(), {b, h, l, l})});
        CHECK(max_abs_diff(gq, by_mask.gq) <= tol);
        CHECK(max_abs_diff(gk, by_mask.gk) <= tol);
        CHECK(max_abs_diff(gv, by_mask.gv) <= tol);
    }
}

TEST_CASE("key_lengths: bit-identical for 1 and 2 threads") {
    const std::int64_t b = 2, h = 3, l = 50, d = 8;
    const std::vector<std::int32_t> lengths = {37, 50};
    const auto tk = rpe::make_term_desc(rpe::mapping::product<>{pw}, true, rpe::target::key,
                                        {.num_heads = static_cast<int>(h), .head_dim = static_cast<int>(d), .skip = 1});
    const auto n = static_cast<std::size_t>(b * h * l * d);
    const auto q = random_vector<float>(n, 1), k = random_vector<float>(n, 2), v = random_vector<float>(n, 3),
               go = random_vector<float>(n, 4), table = random_vector<float>(size_of(tk.table_shape()), 5);
    const std::vector<std::int64_t> shape{b, h, l, d};
    rpe::attention_inputs<float> in;
    in.q = view<const float>(q, shape);
    in.k = view<const float>(k, shape);
    in.v = view<const float>(v, shape);
    in.height = 7;
    in.width = 7;
    in.key_lengths = pos_ref(lengths.data(), {b});
    in.rpe_k = {.term = &tk, .tables = {view<const float>(table, tk.table_shape())}};
    rpe_test::set_threads(1);
    const auto one = run(in, go, false);
    rpe_test::set_threads(2);
    const auto two = run(in, go, false);
    check_identical(one, two);
}

TEST_CASE("packed and key_lengths: bad inputs throw naming the parameter and its value") {
    packed_problem<float> pb(four_images(false), 1, false, 41);  // lengths 13, 11, 2, 17: L = 43
    std::vector<float> out(pb.q.size());
    const auto o = view<float>(out, pb.shape(pb.l));
    const auto fwd = [&](const rpe::attention_inputs<float>& in) { rpe::attention_forward(in, o); };
    auto in = pb.packed();
    std::vector<std::int32_t> lengths = pb.lengths;
    in.packed.lengths = pos_ref(lengths.data(), {0});
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.lengths has shape (0,); expected (M >= 1,) tokens per image"));
    in.packed.lengths = pos_ref(lengths.data(), {4});
    lengths[2] = 0;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] packed.lengths[2] = 0; expected >= 1 tokens per image"));
    lengths[2] = 3;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] packed.lengths sum to 44; expected L = 43 of q"));
    lengths[2] = 1;
    lengths[3] = 18;
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.lengths[2] = 1; expected more than skip = 1 of rpe_k (every image "
                                "needs grid tokens after its extra tokens)"));
    lengths = pb.lengths;
    std::vector<std::int32_t> grids = pb.grids;
    in.packed.grids = pos_ref(grids.data(), {4, 2});
    grids[4] = 2;  // image 2: 2x1 + 1 = 3 tokens, not 2
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.grids[2] = (2, 1) gives skip + height*width = 3 tokens of rpe_k; "
                                "expected packed.lengths[2] = 2"));
    grids[4] = 0;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] packed.grids[2] = (0, 1); expected positive sizes"));
    grids[4] = 1;
    grids[6] = 1 << 30;  // image 3: a product far beyond its length (and beyond int64 with a third size)
    grids[7] = 1 << 30;
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.grids[3] = (1073741824, 1073741824) gives skip + height*width = more "
                                "than 17 tokens of rpe_k; expected packed.lengths[3] = 17"));
    grids[6] = grids[7] = 4;
    // (M, 3) grids with a 2D mapping: image 0 as 2 frames of 2 x 3 (its 13 tokens), the others 1 frame
    std::vector<std::int32_t> grids3 = {2, 2, 3, 1, 2, 5, 1, 1, 1, 1, 4, 4};
    in.packed.grids = pos_ref(grids3.data(), {4, 3});
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.grids[0] = (2, 2, 3) has depth 2 with the 2D mapping of rpe_k; expected "
                                "depth = 1 (a 3D mapping for depth x height x width grids)"));
    in.packed.grids = pos_ref(grids.data(), {2, 4});
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.grids has shape (2, 4); expected (M = 4, 2) (height, width) or (M, 3) "
                                "(depth, height, width)"));
    in.packed.grids = {};
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] rpe_k is attached with packed but neither packed.grids nor packed.positions is "
                                "given; expected one of them"));
    const std::vector<std::int32_t> p(2 * 40, 0);
    in.packed.positions = pos_ref(p.data(), {40, 2});
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.positions has shape (40, 2); expected (39 = L - M*skip = 43 - 4*1 of "
                                "rpe_k, 2) integer coordinates (row, col) for a 2D mapping"));
    in.packed.grids = pos_ref(grids.data(), {4, 2});
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] packed.grids and packed.positions are both given; expected one of them"));
    in = pb.packed();
    in.height = 3;
    in.width = 4;
    CHECK(rpe_test::throws_with([&] { fwd(in); },
                                "[rpe.attention] height = 3, width = 4, depth = 1 with packed; expected 0, 0, 1 (each image's "
                                "grid is in packed.grids)"));
    in = pb.packed();
    in.positions = pos_ref(p.data(), {39, 2});
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] positions is given with packed; expected packed.positions"));
    // features not combined with packed sequences: rpe::not_supported
    in = pb.packed();
    const std::vector<std::int32_t> kl = {43, 43};
    in.key_lengths = pos_ref(kl.data(), {2});
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] { fwd(in); }, "[rpe.attention] key_lengths with packed sequences (packed; each image is attended alone"));
    in = pb.packed();
    in.rope = rpe::rotary_embedding<float>{.form = rpe::rope::axial{}};
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] { fwd(in); }, "[rpe.attention] rope with packed sequences (packed) is not supported by the cpu backend"));
    in = pb.packed();
    std::vector<float> attn(static_cast<std::size_t>(pb.b * pb.h * pb.l * pb.l));
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] {
            rpe::attention_forward(in, o, rpe::tensor_ref<float>(attn.data(), {pb.b, pb.h, pb.l, pb.l}));
        },
        "[rpe.attention] the attn output (probabilities) with packed sequences (packed) is not supported by the cpu backend"));
    std::vector<float> gq(out.size()), gk(out.size()), gv(out.size());
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] {
            rpe::attention_backward(in, {.grad_out = view<const float>(pb.go, pb.shape(pb.l)),
                                         .grad_q = view<float>(gq, pb.shape(pb.l)),
                                         .grad_k = view<float>(gk, pb.shape(pb.l)),
                                         .grad_v = view<float>(gv, pb.shape(pb.l)),
                                         .saved_attn = rpe::tensor_ref<const float>(attn.data(), {pb.b, pb.h, pb.l, pb.l})});
        },
        "[rpe.attention] the backward from saved probabilities (saved_attn) with packed sequences (packed) is not supported"));
    // key_lengths
    in = pb.packed();
    in.packed = {};
    in.height = 6;
    in.width = 7;  // 1 + 42 = 43 tokens
    std::vector<std::int32_t> klen = {43, 44};
    in.key_lengths = pos_ref(klen.data(), {1});
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] key_lengths has shape (1,); expected (2,)"));
    in.key_lengths = pos_ref(klen.data(), {2});
    CHECK(rpe_test::throws_with(
        [&] { fwd(in); },
        "[rpe.attention] key_lengths[1] = 44; expected 0 <= length <= L = 43 (keys at index >= length are padding)"));
    klen[1] = -1;
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] key_lengths[1] = -1; expected 0 <= length <= L = 43"));
    klen[1] = 43;
    in.key_lengths = pos_ref(nullptr, {2});
    CHECK(rpe_test::throws_with([&] { fwd(in); }, "[rpe.attention] key_lengths is a null buffer of shape (2,)"));
    in.key_lengths = pos_ref(klen.data(), {2});
    fwd(in);  // and now it runs
    CHECK(std::isfinite(out[0]));
    // a backend without the features (the CUDA one today) refuses them before any work
    const rpe::attention_capabilities none{.backend = "test", .strided_qkv = true, .key_padding_mask = true};
    CHECK(
        rpe_test::throws_with<rpe::not_supported>([&] { (void)rpe::detail::check_attention(in, none); },
                                                  "[rpe.attention] valid key lengths (key_lengths) is not supported by the test "
                                                  "backend"));
    CHECK(rpe_test::throws_with<rpe::not_supported>(
        [&] { (void)rpe::detail::check_attention(pb.packed(), none); },
        "[rpe.attention] packed sequences (packed) is not supported by the test backend"));
}

}  // namespace rpe_unit_packed
