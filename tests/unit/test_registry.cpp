// rpe's registry of term families (<rpe/registry.hpp>, <rpe/families.hpp>): every built-in
// family parses from and prints to text (round trip), aliases and their presets, the errors
// naming the parameter and value, visit_mapping / visit_rope giving the concrete policy, the terms
// by family equal to the compile-time ones, and a user's own mapping registered from this unit
// (RPE_REGISTER_MAPPING) reached by name.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <rpe/any_term.hpp>
#include <rpe/bucket_cache.hpp>
#include <rpe/families.hpp>
#include <rpe/make_term.hpp>
#include <rpe/rope/rotary.hpp>

#include "golden.hpp"

// Each unit source has its own namespace: the sources may be compiled together (RPE_TEST_UNITY).
namespace rpe_unit_registry {

namespace {

// A user's mapping, as a user writes it: the Manhattan distance through the piecewise index.
struct taxicab {
    rpe::index::piecewise index{};
    constexpr int num_buckets() const { return index.beta_int() + 1; }
    int bucket(int dr, int dc) const {
        const std::int64_t r = dr < 0 ? -std::int64_t{dr} : dr, c = dc < 0 ? -std::int64_t{dc} : dc;
        return index(r + c);
    }
    void validate() const { index.validate(); }
    friend constexpr bool operator==(const taxicab&, const taxicab&) = default;
};

}  // namespace

RPE_REGISTER_MAPPING(test_taxicab,
                     rpe::family_info{.name = "test_taxicab",
                                      .aliases = {{"test_l1", {{"alpha", 1.0}}}},
                                      .params = {rpe::family_param::number("alpha", 1.9), rpe::family_param::number("beta", 3.8),
                                                 rpe::family_param::number("gamma", 15.2)},
                                      .summary = "test: Manhattan distance"},
                     [](const rpe::family_spec& s, rpe::grid_extent) {
                         return taxicab{rpe::index::piecewise{s.get("alpha"), s.get("beta"), s.get("gamma")}};
                     });

TEST_CASE("registry: every family's spec round-trips through its text") {
    const auto& reg = rpe::families();
    int mappings = 0, ropes = 0;
    for (const auto& e : reg.entries()) {
        const auto kind = e->info.kind;
        (kind == rpe::family_kind::mapping ? mappings : ropes) += 1;
        const rpe::family_spec d = reg.defaults(e->info.name, kind);
        CHECK(rpe::parse_family_spec(rpe::to_string(d), kind) == d);
        for (const auto& a : e->info.aliases) {
            const auto s = rpe::parse_family_spec(a.name, kind);
            CHECK(s.family == e->info.name);
            CHECK(rpe::parse_family_spec(rpe::to_string(s), kind) == s);
        }
    }
    CHECK(mappings >= 15);  // 14 built-in mappings and this unit's
    CHECK(ropes == 7);      // axial, mixed, cat, dinov3, mrope, vjepa2, sam2
    // values that are not the defaults, a choice and a flag among them
    const auto p = rpe::parse_family_spec("product:index=clip,beta=4.25");
    CHECK(rpe::to_string(p) == "product:index=clip,alpha=1.9,beta=4.25,gamma=15.2");
    CHECK(rpe::parse_family_spec(rpe::to_string(p)) == p);
    const auto c = rpe::parse_family_spec("cat:in_pixels=true,max_res=0.1,ref_height=16,ref_width=16", rpe::family_kind::rope);
    CHECK(rpe::to_string(c) ==
          "cat:temperature=10000,in_pixels=true,max_res=0.1,linear_bands=false,grid_offset=0,ref_height=16,ref_width=16,xy_"
          "indexing=false");
    CHECK(rpe::parse_family_spec(rpe::to_string(c), rpe::family_kind::rope) == c);
}

TEST_CASE("registry: the reference's names are aliases, with their presets") {
    CHECK(rpe::parse_family_spec("euc").family == "euclidean");
    CHECK(rpe::parse_family_spec("quant").family == "quantization");
    CHECK(rpe::parse_family_spec("sam").family == "decomposed");
    CHECK(rpe::parse_family_spec("alibi").family == "alibi2d");
    const auto causal = rpe::parse_family_spec("t5_causal");
    CHECK(rpe::to_string(causal) == "t5:buckets=32,max_distance=128,bidirectional=false");
    CHECK(rpe::parse_family_spec("t5").get("bidirectional") == 1);
    CHECK(rpe::parse_method("euc") == rpe::method::euclidean);
    CHECK(rpe::method_name(rpe::method::quantization_paper) == "quantization_paper");
    CHECK(rpe::parse_family_spec("test_l1").get("alpha") == 1.0);  // a user's alias preset
}

TEST_CASE("registry: errors name the parameter and the value") {
    CHECK(rpe_test::throws_with(
        [] { (void)rpe::parse_family_spec("hexagonal"); },
        {"[rpe.term_spec] family = 'hexagonal'; expected one of euclidean (euc), quantization (quant), cross", "t5 (t5_causal)",
         "decomposed (sam)", "test_taxicab (test_l1)"}));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("axial"); },
                                "[rpe.term_spec] family = 'axial'; expected one of"));
    CHECK(
        rpe_test::throws_with([] { (void)rpe::parse_family_spec("spiral", rpe::family_kind::rope); },
                              "[rpe.term_spec] form = 'spiral'; expected one of axial, mixed, cat, dinov3, mrope, vjepa2, sam2"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("product:delta=1"); },
                                "[rpe.term_spec] parameter = 'delta' of product; expected one of index, alpha, beta, gamma"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("product:index=hexagon"); },
                                "[rpe.term_spec] index = 'hexagon'; expected one of piecewise, clip"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("product:alpha=x1"); },
                                "[rpe.term_spec] alpha = 'x1'; expected a number"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("shaw:k=2.5"); },
                                "[rpe.term_spec] k = 2.5; expected an integer"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("t5:bidirectional=maybe"); },
                                "[rpe.term_spec] bidirectional = 'maybe'; expected one of true, false, 1, 0"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("product:beta"); },
                                "[rpe.term_spec] parameter = 'beta' of product; expected name=value"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_method("test_taxicab"); }, "method = 'test_taxicab'"));
    // a name already taken, and a name the text form could not read back
    CHECK(rpe_test::throws_with(
        [] {
            rpe::register_mapping(rpe::family_info{.name = "product"},
                                  [](const rpe::family_spec&, rpe::grid_extent) { return taxicab{}; });
        },
        "[rpe.registry] name = 'product'; already registered"));
    CHECK(rpe_test::throws_with(
        [] {
            rpe::register_mapping(rpe::family_info{.name = "a:b"},
                                  [](const rpe::family_spec&, rpe::grid_extent) { return taxicab{}; });
        },
        "[rpe.registry] name = 'a:b'; expected a non-empty name without"));
    // a ViT family without window and grid, a mode the family does not take
    CHECK(rpe_test::throws_with([] { (void)rpe::make_term<float>(rpe::parse_family_spec("swin"), {.contextual = false}); },
                                "[rpe.term_spec] window_h = 0 of swin: the grid was not given"));
    CHECK(rpe_test::throws_with(
        [] {
            (void)rpe::make_term<float>(rpe::parse_family_spec("decomposed"), {.contextual = false}, {4, 4});
        },
        "[rpe.term_spec] mode = bias with target = k for decomposed; expected contextual on k"));
}

TEST_CASE("registry: visit_mapping gives the concrete policy of a spec") {
    using rpe::index::clip;
    using rpe::index::piecewise;
    const auto type_of = [](const char* text, rpe::grid_extent g = {}) {
        return rpe::visit_mapping(rpe::parse_family_spec(text), g, [](const auto& m) -> std::string {
            using M = std::remove_cvref_t<decltype(m)>;
            if constexpr (std::is_same_v<M, rpe::mapping::product<piecewise>>)
                return "product<piecewise> beta=" + std::to_string(m.index.beta);
            else if constexpr (std::is_same_v<M, rpe::mapping::product<clip>>)
                return "product<clip> beta=" + std::to_string(m.index.beta);
            else if constexpr (std::is_same_v<M, rpe::mapping::swin>)
                return "swin " + std::to_string(m.window_h) + "x" + std::to_string(m.window_w);
            else if constexpr (std::is_same_v<M, rpe::mapping::t5>)
                return "t5 bidirectional=" + std::to_string(m.bidirectional);
            else if constexpr (std::is_same_v<M, rpe::vit::alibi_2d_mapping_type>)
                return "alibi2d beta=" + std::to_string(m.inner.index.beta);
            else if constexpr (std::is_same_v<M, rpe::registered_mapping>)
                return "registered " + m.spec.family;
            else
                return "other";
        });
    };
    CHECK(type_of("product") == "product<piecewise> beta=3.800000");
    CHECK(type_of("product:index=clip,beta=2") == "product<clip> beta=2.000000");
    CHECK(type_of("swin", {3, 4}) == "swin 3x4");
    CHECK(type_of("swin:window_h=7,window_w=5", {3, 4}) == "swin 7x5");
    CHECK(type_of("t5_causal") == "t5 bidirectional=0");
    CHECK(type_of("alibi", {3, 5}) == "alibi2d beta=4.000000");  // beta = max(H, W) - 1
    CHECK(type_of("test_taxicab") == "registered test_taxicab");
    const auto theta = rpe::visit_rope(rpe::parse_family_spec("axial:theta=10", rpe::family_kind::rope), [](const auto& f) {
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(f)>, rpe::rope::axial>)
            return f.theta;
        else
            return -1.0f;
    });
    CHECK(theta == 10.0f);
}

TEST_CASE("registry: dinov3 and mrope parse, print and visit as the policies built by hand") {
    using rpe::family_kind;
    // DINOv3: the defaults are the released models' (base 100, separate, no augmentation)
    const auto d0 = rpe::parse_family_spec("dinov3", family_kind::rope);
    CHECK(rpe::to_string(d0) ==
          "dinov3:base=100,min_period=0,max_period=0,normalize=separate,shift_y=0,shift_x=0,jitter_y=1,jitter_x=1,rescale=1");
    const auto d = rpe::parse_family_spec(
        "dinov3:min_period=0.5,max_period=40,normalize=max,shift_y=-0.25,shift_x=0.125,jitter_y=0.75,jitter_x=1.5,rescale=0.875",
        family_kind::rope);
    CHECK(rpe::to_string(d) ==
          "dinov3:base=100,min_period=0.5,max_period=40,normalize=max,shift_y=-0.25,shift_x=0.125,jitter_y=0.75,jitter_x=1.5,"
          "rescale=0.875");
    CHECK(rpe::parse_family_spec(rpe::to_string(d), family_kind::rope) == d);
    const rpe::rope::dinov3 d_hand{.base = 100.0f,
                                   .min_period = 0.5f,
                                   .max_period = 40.0f,
                                   .normalize = rpe::rope::dinov3_normalize::max,
                                   .shift_y = -0.25f,
                                   .shift_x = 0.125f,
                                   .jitter_y = 0.75f,
                                   .jitter_x = 1.5f,
                                   .rescale = 0.875f};
    const auto as_dinov3 = [](const rpe::family_spec& s) {
        return rpe::visit_rope(s, [](const auto& f) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(f)>, rpe::rope::dinov3>)
                return f;
            else
                return rpe::rope::dinov3{.base = -1.0f};  // not a dinov3: fails the checks below
        });
    };
    CHECK(as_dinov3(d) == d_hand);
    CHECK(as_dinov3(d0) == rpe::rope::dinov3{});  // the struct's defaults are the registry's
    // M-RoPE: Qwen2-VL's defaults; Qwen3-VL's interleaved sections
    const auto m0 = rpe::parse_family_spec("mrope", family_kind::rope);
    CHECK(rpe::to_string(m0) == "mrope:theta=1e+06,section_t=16,section_h=24,section_w=24,interleaved=false");
    const auto m =
        rpe::parse_family_spec("mrope:section_t=24,section_h=20,section_w=20,theta=5e6,interleaved=true", family_kind::rope);
    CHECK(rpe::to_string(m) == "mrope:theta=5e+06,section_t=24,section_h=20,section_w=20,interleaved=true");
    CHECK(rpe::parse_family_spec(rpe::to_string(m), family_kind::rope) == m);
    const auto as_mrope = [](const rpe::family_spec& s) {
        return rpe::visit_rope(s, [](const auto& f) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(f)>, rpe::rope::mrope>)
                return f;
            else
                return rpe::rope::mrope{.theta = -1.0f};
        });
    };
    CHECK(as_mrope(m) ==
          rpe::rope::mrope{.theta = 5000000.0f, .section_t = 24, .section_h = 20, .section_w = 20, .interleaved = true});
    CHECK(as_mrope(m0) == rpe::rope::mrope{});
    // the rotary_embedding form (rope::custom around the policy) and the reference layouts
    const auto form_of = [](const rpe::family_spec& s) {
        return rpe::visit_rope(s, [](const auto& f) { return rpe::rope_form_of(f); });
    };
    const auto layout_of = [](const char* text) {
        return rpe::visit_rope(rpe::parse_family_spec(text, rpe::family_kind::rope),
                               [](const auto& f) { return rpe::rope::default_layout_of(f); });
    };
    CHECK(form_of(d) == rpe::rope_form(rpe::rope::custom{d_hand}));
    CHECK(form_of(m) == rpe::rope_form(rpe::rope::custom{as_mrope(m)}));
    CHECK(form_of(d) != form_of(d0));
    CHECK(rpe::rope_position_axes(form_of(m)) == 3);
    CHECK(rpe::rope_position_axes(form_of(d)) == 2);
    CHECK(std::holds_alternative<rpe::rope::axial>(form_of(rpe::parse_family_spec("axial", family_kind::rope))));
    CHECK(layout_of("dinov3") == rpe::rope::layout::half);
    CHECK(layout_of("mrope") == rpe::rope::layout::half);
    CHECK(layout_of("axial") == rpe::rope::layout::pairs);
    CHECK(layout_of("mixed") == rpe::rope::layout::pairs);
    CHECK(layout_of("cat") == rpe::rope::layout::pairs);
    // errors name the parameter and its value; bad values are the policy's to reject
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("dinov3:normalize=mean", rpe::family_kind::rope); },
                                "[rpe.term_spec] normalize = 'mean'; expected one of separate, max, min"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("dinov3:temperature=100", rpe::family_kind::rope); },
                                "[rpe.term_spec] parameter = 'temperature' of dinov3; expected one of base, min_period, "
                                "max_period, normalize, shift_y, shift_x, jitter_y, jitter_x, rescale"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("mrope:section_h=2.5", rpe::family_kind::rope); },
                                "[rpe.term_spec] section_h = 2.5; expected an integer"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("mrope:interleaved=yes", rpe::family_kind::rope); },
                                "[rpe.term_spec] interleaved = 'yes'; expected one of true, false, 1, 0"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("mrope:sections=16", rpe::family_kind::rope); },
                                "[rpe.term_spec] parameter = 'sections' of mrope; expected one of theta, section_t, "
                                "section_h, section_w, interleaved"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("dinov3"); },
                                "[rpe.term_spec] family = 'dinov3'; expected one of"));  // a RoPE form, not a mapping
    CHECK(
        rpe_test::throws_with([&] { as_dinov3(rpe::parse_family_spec("dinov3:rescale=-2", rpe::family_kind::rope)).validate(); },
                              "[rpe.rope] rescale = -2; expected finite and > 0"));
    CHECK(rpe_test::throws_with([&] { as_mrope(rpe::parse_family_spec("mrope:theta=-1", rpe::family_kind::rope)).validate(); },
                                "[rpe.rope] theta = -1; expected finite and > 0"));
}

TEST_CASE("registry: terms by family are the compile-time terms") {
    // product through the registry and through term_spec: the same K, table shape and ids
    rpe::term_spec ts;
    ts.skip = 1;
    ts.num_heads = 2;
    ts.head_dim = 4;
    const auto a = rpe::make_term<float>(ts);
    const auto b = rpe::make_term<float>(rpe::parse_family_spec("product"), {.num_heads = 2, .head_dim = 4, .skip = 1});
    CHECK(a->num_buckets() == 50);
    CHECK(b->num_buckets() == 50);
    CHECK(a->table_shape() == b->table_shape());
    CHECK(a->bucket_ids(5, 6) == b->bucket_ids(5, 6));  // the same cached ids: the same mapping key
    // BEiT on a 3x3 grid: (2*3-1)^2 = 25 buckets + 3 class-token buckets
    const auto beit = rpe::make_term<double>(rpe::parse_family_spec("beit"), {.contextual = false, .skip = 1}, {3, 3});
    CHECK(beit->num_buckets() == 28);
    // decomposed: two tables of 2*max(H, W) - 1 buckets
    const auto sam = rpe::make_term<float>(rpe::parse_family_spec("sam"), {.head_dim = 8}, {4, 6});
    CHECK(sam->num_tables() == 2);
    CHECK(sam->num_buckets() == 11);
}

TEST_CASE("registry: a user's mapping registered from this unit is reached by name") {
    const auto spec = rpe::parse_family_spec("test_taxicab");
    const auto term = rpe::make_term<float>(spec, {.contextual = false});
    CHECK(term->num_buckets() == 4);  // beta_int = 3 for beta = 3.8: ids 0..3
    const auto ids = term->bucket_ids(3, 3);
    // query (0, 0), keys along the row and the diagonal: |dr| + |dc| = 0, 1, 2, 2, 4 -> g = 0, 1, 2, 2, 3
    // (g(2) = round(1.9 + ln(2/1.9) / ln(8) * 1.9) = 2; g(4) = round(1.9 + ln(4/1.9) / ln(8) * 1.9) = round(2.58) = 3)
    CHECK(ids->at(0, 0, 0) == 0);
    CHECK(ids->at(0, 0, 1) == 1);
    CHECK(ids->at(0, 0, 2) == 2);
    CHECK(ids->at(0, 0, 4) == 2);
    CHECK(ids->at(0, 0, 8) == 3);
    // the fresh ids of bucket_ids_of (no cache) are the same
    const auto fresh = rpe::visit_mapping(spec, {}, [](const auto& m) { return rpe::bucket_ids_of(m, 1, 3, 3, 0); });
    for (int j = 0; j < 9; ++j) CHECK(fresh->at(0, 0, j) == ids->at(0, 0, j));
    // double, contextual on values, through the same entry
    const auto v = rpe::make_term<double>(rpe::parse_family_spec("test_l1"), {.target = rpe::target::value, .head_dim = 2});
    CHECK(v->table_shape() == std::vector<std::int64_t>{1, 4, 2});
    // invalid parameters: the index's own check
    CHECK(rpe_test::throws_with([] { (void)rpe::make_term<float>(rpe::parse_family_spec("test_taxicab:alpha=-1"), {}); },
                                "alpha = -1"));
}

TEST_CASE("registry: a registration refused at load is recorded, not thrown, and reported once") {
    // What RPE_REGISTER_MAPPING does during static initialisation (a plugin's dlopen): a name
    // already taken must not throw there (std::terminate), it is kept for the loader or first use.
    const auto taken = [](const char* name) {
        return rpe::register_mapping_at_load(rpe::family_info{.name = name},
                                             [](const rpe::family_spec&, rpe::grid_extent) { return taxicab{}; });
    };
    CHECK_FALSE(taken("euc"));
    CHECK(rpe::registry::global().find("euc")->info.name == "euclidean");  // the built-in stays
    // a loader (the `rpe` tool after dlopen) takes the messages, oldest first, and clears them
    CHECK_FALSE(taken("test_l1"));
    const auto refused = rpe::registry::global().take_load_errors();
    REQUIRE(refused.size() == 2);
    CHECK(refused[0] == "[rpe.registry] name = 'euc'; already registered (euclidean)");
    CHECK(refused[1] == "[rpe.registry] name = 'test_l1'; already registered (test_taxicab)");
    CHECK(rpe::registry::global().take_load_errors().empty());
    CHECK_NOTHROW((void)rpe::families());
    // no loader took it (a unit linked into the program): the next families() throws it, once
    CHECK_FALSE(taken("product"));
    CHECK(rpe_test::throws_with([] { (void)rpe::families(); }, "[rpe.registry] name = 'product'; already registered (product)"));
    CHECK_NOTHROW((void)rpe::families());
    // several are joined in one message
    CHECK_FALSE(taken("euc"));
    CHECK_FALSE(taken("a b"));
    CHECK(rpe_test::throws_with([] { (void)rpe::parse_family_spec("product"); },
                                "name = 'euc'; already registered (euclidean); also [rpe.registry] name = 'a b'; expected a "
                                "non-empty name"));
    CHECK(rpe::parse_family_spec("product").family == "product");
    // (a name not taken is added: test_taxicab above, through RPE_REGISTER_MAPPING)
}

}  // namespace rpe_unit_registry
