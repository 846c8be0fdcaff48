// A user's own mapping by name, as a plugin: the Manhattan (taxicab) distance |dr| + |dc| through
// rpe's piecewise index, registered into rpe's registry from this unit alone (no fork). Built as
// a shared library, it makes "manhattan" a mapping of the `rpe` tool
// (`rpe show --plugin librpe_example_manhattan.so --mapping manhattan`) and of rpe_torch
// (`torch.ops.load_library(...)`); linked into a program, of rpe::make_term and
// rpe::visit_mapping there. See docs/custom_mapping.md.
#include <cstdint>

#include <rpe/config.hpp>
#include <rpe/families.hpp>
#include <rpe/index/piecewise.hpp>

namespace example {

/// @brief Manhattan mapping (undirected): `id = g(|dr| + |dc|)` ∈ [0, βi], `num_buckets() = βi + 1`.
/// Every key on the diamond at distance d around the query shares one bucket.
struct manhattan {
    rpe::index::piecewise index{};  ///< g, applied to the Manhattan distance

    /// @brief `βi + 1`.
    RPE_HOST_DEVICE constexpr int num_buckets() const { return index.beta_int() + 1; }
    /// @brief Id of offset (dr, dc), in [0, βi].
    RPE_HOST_DEVICE int bucket(int dr, int dc) const {
        const std::int64_t r = dr < 0 ? -static_cast<std::int64_t>(dr) : dr;
        const std::int64_t c = dc < 0 ? -static_cast<std::int64_t>(dc) : dc;
        return index(r + c);
    }
    /// @brief @throws rpe::invalid_argument for invalid α, β, γ (the index's own check).
    void validate() const { index.validate(); }
    friend constexpr bool operator==(const manhattan&, const manhattan&) = default;
};

}  // namespace example

// The name, its parameters (with defaults: what `manhattan` alone means) and how a spec becomes
// the policy. alpha, beta, gamma come first: the rpe_torch ops pass their (alpha, beta, gamma) to
// a family's first three number parameters, and the `rpe` tool's --ratio/--alpha/--beta/--gamma
// set parameters of those names.
RPE_REGISTER_MAPPING(manhattan,
                     rpe::family_info{.name = "manhattan",
                                      .aliases = {{"taxicab", {}}},
                                      .params = {rpe::family_param::number("alpha", 1.9, "alpha of the piecewise index"),
                                                 rpe::family_param::number("beta", 3.8, "beta of the piecewise index"),
                                                 rpe::family_param::number("gamma", 15.2, "gamma of the piecewise index")},
                                      .summary = "Manhattan distance |dr| + |dc| through the piecewise index"},
                     [](const rpe::family_spec& s, rpe::grid_extent) {
                         return example::manhattan{rpe::index::piecewise{s.get("alpha"), s.get("beta"), s.get("gamma")}};
                     });
