// Static tests of rpe's concepts (include/rpe/concepts.hpp) and of the term's compile-time
// composition: for each concept a passing and a failing case. Compiling this file is the test
// (tests/static/CMakeLists.txt builds it as an object library; there is no main).
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <rpe/backend/tags.hpp>
#include <rpe/concepts.hpp>
#include <rpe/index/clip.hpp>
#include <rpe/index/piecewise.hpp>
#include <rpe/mapping/cross.hpp>
#include <rpe/mapping/euclidean.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/quantization.hpp>
#include <rpe/mapping/within_grid.hpp>
#include <rpe/mode.hpp>
#include <rpe/rope/axial.hpp>
#include <rpe/rope/cat.hpp>
#include <rpe/rope/mixed.hpp>
#include <rpe/term.hpp>
#include <rpe/vit/alibi_2d.hpp>
#include <rpe/vit/decomposed_rel_pos.hpp>

namespace {

// ---------------------------------------------------------------------------------------------
// IndexFunction: trivially copyable, ==, beta_int() -> int, f(int64) -> int, f(float) -> int
// ---------------------------------------------------------------------------------------------
static_assert(rpe::IndexFunction<rpe::index::piecewise>);
static_assert(rpe::IndexFunction<rpe::index::clip>);

struct index_ok {
    int beta_int() const { return 1; }
    int operator()(std::int64_t) const { return 0; }
    int operator()(float) const { return 0; }
    friend bool operator==(const index_ok&, const index_ok&) = default;
};
static_assert(rpe::IndexFunction<index_ok>);

struct index_without_beta_int {
    int operator()(std::int64_t) const { return 0; }
    int operator()(float) const { return 0; }
    friend bool operator==(const index_without_beta_int&, const index_without_beta_int&) = default;
};
static_assert(!rpe::IndexFunction<index_without_beta_int>);

struct index_returning_long {  // the index must be exactly int
    int beta_int() const { return 1; }
    long operator()(std::int64_t) const { return 0; }
    long operator()(float) const { return 0; }
    friend bool operator==(const index_returning_long&, const index_returning_long&) = default;
};
static_assert(!rpe::IndexFunction<index_returning_long>);

struct index_not_trivially_copyable {  // cannot be copied into a kernel
    std::vector<int> table;
    int beta_int() const { return 1; }
    int operator()(std::int64_t) const { return 0; }
    int operator()(float) const { return 0; }
    friend bool operator==(const index_not_trivially_copyable&, const index_not_trivially_copyable&) = default;
};
static_assert(!rpe::IndexFunction<index_not_trivially_copyable>);

struct index_without_equality {  // cannot be part of a cache key
    int beta_int() const { return 1; }
    int operator()(std::int64_t) const { return 0; }
    int operator()(float) const { return 0; }
};
static_assert(!rpe::IndexFunction<index_without_equality>);
static_assert(!rpe::IndexFunction<int>);

// ---------------------------------------------------------------------------------------------
// Mapping: trivially copyable, ==, num_buckets(), bucket(dr, dc)
// ---------------------------------------------------------------------------------------------
static_assert(rpe::Mapping<rpe::mapping::euclidean<>>);
static_assert(rpe::Mapping<rpe::mapping::quantization<>>);
static_assert(rpe::Mapping<rpe::mapping::cross<>>);
static_assert(rpe::Mapping<rpe::mapping::product<>>);
static_assert(rpe::Mapping<rpe::mapping::euclidean_paper<>>);
static_assert(rpe::Mapping<rpe::mapping::quantization_paper<>>);
static_assert(rpe::Mapping<rpe::mapping::product<rpe::index::clip>>);
static_assert(rpe::Mapping<rpe::mapping::euclidean<index_ok>>);
static_assert(rpe::detail::num_tables_of<rpe::mapping::cross<>>() == 2);
static_assert(rpe::detail::num_tables_of<rpe::mapping::product<>>() == 1);
// the ViT encodings (issue 15) are built-in mappings with a clip index: Cross (2 tables), Product,
// each bounded to its grid by mapping::within_grid (same tables, skip buckets and ids as the inner)
static_assert(std::is_same_v<decltype(rpe::vit::decomposed_rel_pos_mapping(1, 1)),
                             rpe::mapping::within_grid<rpe::mapping::cross<rpe::index::clip>>>);
static_assert(std::is_same_v<decltype(rpe::vit::alibi_2d_mapping(1, 1)),
                             rpe::mapping::within_grid<rpe::mapping::product<rpe::index::clip>>>);
static_assert(!rpe::Mapping3D<rpe::vit::decomposed_rel_pos_mapping_type> &&
              rpe::detail::skip_buckets_of<rpe::vit::alibi_2d_mapping_type>() == 1);
static_assert(rpe::Mapping<decltype(rpe::vit::decomposed_rel_pos_mapping(1, 1))>);
static_assert(rpe::detail::num_tables_of<decltype(rpe::vit::decomposed_rel_pos_mapping(1, 1))>() == 2);
static_assert(rpe::Mapping<decltype(rpe::vit::alibi_2d_mapping(1, 1))>);
static_assert(rpe::vit::decomposed_rel_pos_term<float>::num_tables == 2 && !rpe::vit::decomposed_rel_pos_term<float>::is_bias &&
              rpe::vit::decomposed_rel_pos_term<float>::target_kind == rpe::target::key);
static_assert(rpe::vit::alibi_2d_term<double>::is_bias && rpe::vit::alibi_2d_term<double>::target_kind == rpe::target::key);

struct mapping_ok {
    int num_buckets() const { return 3; }
    int bucket(int, int) const { return 0; }
    friend bool operator==(const mapping_ok&, const mapping_ok&) = default;
};
static_assert(rpe::Mapping<mapping_ok>);

struct mapping_without_bucket {
    int num_buckets() const { return 3; }
    friend bool operator==(const mapping_without_bucket&, const mapping_without_bucket&) = default;
};
static_assert(!rpe::Mapping<mapping_without_bucket>);

struct mapping_without_num_buckets {
    int bucket(int, int) const { return 0; }
    friend bool operator==(const mapping_without_num_buckets&, const mapping_without_num_buckets&) = default;
};
static_assert(!rpe::Mapping<mapping_without_num_buckets>);

struct mapping_with_mutable_bucket {  // bucket must be callable on a const mapping
    int num_buckets() const { return 3; }
    int bucket(int, int) { return 0; }
    friend bool operator==(const mapping_with_mutable_bucket&, const mapping_with_mutable_bucket&) = default;
};
static_assert(!rpe::Mapping<mapping_with_mutable_bucket>);

struct mapping_not_trivially_copyable {
    std::string name;
    int num_buckets() const { return 3; }
    int bucket(int, int) const { return 0; }
    friend bool operator==(const mapping_not_trivially_copyable&, const mapping_not_trivially_copyable&) = default;
};
static_assert(!rpe::Mapping<mapping_not_trivially_copyable>);

struct mapping_without_equality {
    int num_buckets() const { return 3; }
    int bucket(int, int) const { return 0; }
};
static_assert(!rpe::Mapping<mapping_without_equality>);
static_assert(!rpe::Mapping<rpe::index::piecewise>);  // an index function is not a mapping

// ---------------------------------------------------------------------------------------------
// RotaryPolicy: the fixed-frequency RoPE forms; rope::mixed (frequencies from a tensor) is not one
// ---------------------------------------------------------------------------------------------
static_assert(rpe::RotaryPolicy<rpe::rope::axial>);
static_assert(rpe::RotaryPolicy<rpe::rope::cat>);
static_assert(!rpe::RotaryPolicy<rpe::rope::mixed>);

struct rotary_ok {
    static constexpr int head_dim_multiple = 2;
    float angle(int, int, int, int, int, int) const { return 0.0f; }
    void validate() const {}
    friend bool operator==(const rotary_ok&, const rotary_ok&) = default;
};
static_assert(rpe::RotaryPolicy<rotary_ok>);

struct rotary_double_angle {  // the angle is float32, as the sources compute it
    static constexpr int head_dim_multiple = 2;
    double angle(int, int, int, int, int, int) const { return 0.0; }
    void validate() const {}
    friend bool operator==(const rotary_double_angle&, const rotary_double_angle&) = default;
};
static_assert(!rpe::RotaryPolicy<rotary_double_angle>);

struct rotary_without_multiple {
    float angle(int, int, int, int, int, int) const { return 0.0f; }
    void validate() const {}
    friend bool operator==(const rotary_without_multiple&, const rotary_without_multiple&) = default;
};
static_assert(!rpe::RotaryPolicy<rotary_without_multiple>);

// ---------------------------------------------------------------------------------------------
// Mode and Backend: exactly the tags
// ---------------------------------------------------------------------------------------------
static_assert(rpe::Mode<rpe::mode::bias>);
static_assert(rpe::Mode<rpe::mode::contextual>);
static_assert(!rpe::Mode<int>);
static_assert(!rpe::Mode<rpe::backend::cpu>);
static_assert(!rpe::Mode<const rpe::mode::bias>);

static_assert(rpe::Backend<rpe::backend::cpu>);
static_assert(rpe::Backend<rpe::backend::cuda>);
static_assert(!rpe::Backend<rpe::mode::contextual>);
static_assert(!rpe::Backend<void>);

// ---------------------------------------------------------------------------------------------
// rpe::term composition. A dependent wrapper concept: a bare `!requires { typename term<bad>; }`
// is a hard error on g++ 12 (STYLE.md).
// ---------------------------------------------------------------------------------------------
template <class M, class Md, rpe::target Tg, class S = float, class B = rpe::backend::cpu>
concept term_formable = requires {
    typename rpe::term<M, Md, Tg, S, B>;
};

static_assert(term_formable<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key>);
static_assert(term_formable<rpe::mapping::cross<>, rpe::mode::bias, rpe::target::query, double>);
static_assert(term_formable<mapping_ok, rpe::mode::contextual, rpe::target::value>);
static_assert(!term_formable<mapping_without_bucket, rpe::mode::contextual, rpe::target::key>);         // not a Mapping
static_assert(!term_formable<rpe::index::piecewise, rpe::mode::contextual, rpe::target::key>);          // not a Mapping
static_assert(!term_formable<rpe::mapping::product<>, int, rpe::target::key>);                          // not a Mode
static_assert(!term_formable<rpe::mapping::product<>, rpe::mode::bias, rpe::target::key, float, int>);  // not a Backend

// Bias mode on values: rejected by rpe::term's requires-clause (concept rpe::ModeOnTarget).
static_assert(!term_formable<rpe::mapping::product<>, rpe::mode::bias, rpe::target::value>);
static_assert(!rpe::detail::valid_mode_target<rpe::mode::bias, rpe::target::value>);
static_assert(rpe::detail::valid_mode_target<rpe::mode::bias, rpe::target::key>);
static_assert(rpe::detail::valid_mode_target<rpe::mode::bias, rpe::target::query>);
static_assert(rpe::detail::valid_mode_target<rpe::mode::contextual, rpe::target::value>);

// Compile-time facts of a term type
using ctx_cross_v = rpe::term<rpe::mapping::cross<>, rpe::mode::contextual, rpe::target::value, double>;
static_assert(ctx_cross_v::num_tables == 2 && !ctx_cross_v::is_bias && ctx_cross_v::target_kind == rpe::target::value);
static_assert(std::is_same_v<ctx_cross_v::scalar_type, double> && std::is_same_v<ctx_cross_v::backend_type, rpe::backend::cpu>);
static_assert(rpe::term<rpe::mapping::product<>, rpe::mode::bias, rpe::target::key>::is_bias);

}  // namespace

static_assert(rpe::ModeOnTarget<rpe::mode::contextual, rpe::target::value>);
static_assert(!rpe::ModeOnTarget<rpe::mode::bias, rpe::target::value>);
