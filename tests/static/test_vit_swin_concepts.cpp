// Static tests of the Swin / BEiT mappings and of the optional mapping members they use
// (`skip_buckets`, `validate_grid`): compiling this file is the test.
#include <rpe/concepts.hpp>
#include <rpe/mapping/beit.hpp>
#include <rpe/mapping/product.hpp>
#include <rpe/mapping/swin.hpp>

namespace {

// passing: the policies are Mappings, constexpr on the host (hence usable in device code)
static_assert(rpe::Mapping<rpe::mapping::swin>);
static_assert(rpe::Mapping<rpe::mapping::beit>);
static_assert(rpe::mapping::swin{.window_h = 7, .window_w = 7}.num_buckets() == 169);
static_assert(rpe::mapping::beit{.window_h = 14, .window_w = 14}.num_buckets() == 729);  // + 3 with the class token
static_assert(rpe::mapping::swin{.window_h = 7, .window_w = 7}.bucket(0, 0) == 84);

// skip_buckets: BEiT declares 3, every other mapping gets the default 1
static_assert(rpe::detail::skip_buckets_of<rpe::mapping::beit>() == 3);
static_assert(rpe::detail::skip_buckets_of<rpe::mapping::swin>() == 1);
static_assert(rpe::detail::skip_buckets_of<rpe::mapping::product<>>() == 1);

// validate_grid is optional: a mapping with only the required members is still a Mapping
struct window_only {
    int w = 3;
    constexpr int num_buckets() const { return 2 * w - 1; }
    constexpr int bucket(int, int dc) const { return dc + w - 1; }
    void validate_grid(int, int) const {}
    friend constexpr bool operator==(const window_only&, const window_only&) = default;
};
static_assert(rpe::Mapping<window_only>);

// failing: a window mapping without operator== is not a Mapping (the cache could not tell windows apart)
struct window_without_equality {
    int w = 3;
    constexpr int num_buckets() const { return 2 * w - 1; }
    constexpr int bucket(int, int dc) const { return dc + w - 1; }
    static constexpr int skip_buckets = 3;
};
static_assert(!rpe::Mapping<window_without_equality>);

}  // namespace
