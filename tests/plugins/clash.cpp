// A plugin whose mapping takes a name already registered: "euc", the built-in euclidean's alias.
// The registry must refuse it at load without terminating the loader (RPE_REGISTER_MAPPING records
// the refusal; the `rpe` tool's --plugin and rpe_bench's RPE_BENCH_PLUGINS report it naming this
// file and exit non-zero). Built as a MODULE library for the CLI and benchmark tests.
#include <rpe/config.hpp>
#include <rpe/families.hpp>

namespace clash {

/// One bucket for every offset: the plugin is never meant to be used, only refused.
struct constant {
    /// @brief 1.
    RPE_HOST_DEVICE constexpr int num_buckets() const { return 1; }
    /// @brief 0 for every offset (dr, dc).
    RPE_HOST_DEVICE constexpr int bucket(int, int) const { return 0; }
    /// @brief Nothing to check.
    void validate() const {}
    friend constexpr bool operator==(const constant&, const constant&) = default;
};

}  // namespace clash

RPE_REGISTER_MAPPING(euc, rpe::family_info{.name = "euc", .summary = "a name already taken (euclidean's alias)"},
                     [](const rpe::family_spec&, rpe::grid_extent) { return clash::constant{}; });
