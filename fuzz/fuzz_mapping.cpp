// libFuzzer harness: every mapping (euclidean, quantization, cross, product, euclidean_paper,
// quantization_paper) over both index functions, with fuzzed parameters and offsets.
// Properties: validate() throws our exception, or every id lies in [0, num_buckets()) in every
// table; undirected mappings give (dr, dc), (dc, dr) and (-dr, dc) the same id; for small squared
// distances quantization_paper equals a direct count of the sums of two squares (eq. 21).
#include <cstdint>
#include <string>
#include <type_traits>
#include <typeinfo>

#include "fuzz_common.hpp"
#include "rpe/concepts.hpp"
#include "rpe/mapping/cross.hpp"
#include "rpe/mapping/euclidean.hpp"
#include "rpe/mapping/product.hpp"
#include "rpe/mapping/quantization.hpp"

namespace {

using namespace rpe::mapping;

// The paper's rank by definition: how many m < n are a sum of two squares (slow; small n only).
std::int64_t rank_by_definition(std::int64_t n) {
    std::int64_t rank = 0;
    for (std::int64_t m = 0; m < n; ++m) {
        bool found = false;
        for (std::int64_t a = 0; a * a <= m && !found; ++a)
            for (std::int64_t b = a; a * a + b * b <= m && !found; ++b) found = a * a + b * b == m;
        rank += found ? 1 : 0;
    }
    return rank;
}

template <class M>
std::string where(const M& m, int dr, int dc) {
    return std::string(typeid(M).name()) + " with " + rpe_fuzz::describe(m.index) + " at (dr, dc) = (" + std::to_string(dr) +
           ", " + std::to_string(dc) + ")";
}

template <class M>
void check(const M& m, FuzzedDataProvider& in) {
    try {
        m.validate();
    } catch (const rpe::invalid_argument&) {
        return;
    } catch (const rpe::out_of_range&) {
        return;
    }
    const int k = m.num_buckets();
    if (k < 1) rpe_fuzz::fail(where(m, 0, 0) + ": num_buckets() = " + std::to_string(k));
    constexpr bool paper_rank = requires { M::is_sum_of_two_squares(0); };
    constexpr bool undirected = !requires { m.bucket(0, 0, 0); }
    &&!std::is_same_v<M, product<decltype(m.index)>>;
    // quantization_paper costs O(dr^2 + dc^2) per call (until g saturates): keep one input fast.
    const int limit = paper_rank ? 300 : std::numeric_limits<int>::max();
    for (int n = 0; n < 8 && in.remaining_bytes() > 0; ++n) {
        const int dr = rpe_fuzz::consume_offset(in, limit), dc = rpe_fuzz::consume_offset(in, limit);
        for (int t = 0; t < rpe::detail::num_tables_of<M>(); ++t) {
            const int id = rpe::detail::bucket_of(m, dr, dc, t);
            if (id < 0 || id >= k)
                rpe_fuzz::fail(where(m, dr, dc) + ": id " + std::to_string(id) + " in table " + std::to_string(t) +
                               " outside [0, " + std::to_string(k) + ")");
        }
        if constexpr (undirected) {
            const int id = m.bucket(dr, dc);
            if (m.bucket(dc, dr) != id || m.bucket(-dr, dc) != id)
                rpe_fuzz::fail(where(m, dr, dc) + ": undirected mapping gives (dc, dr) or (-dr, dc) another id");
        }
        if constexpr (paper_rank) {
            const std::int64_t sq = static_cast<std::int64_t>(dr) * dr + static_cast<std::int64_t>(dc) * dc;
            if (sq <= 1000) {
                const int want = m.index(rank_by_definition(sq)) + m.index.beta_int();
                if (m.bucket(dr, dc) != want)
                    rpe_fuzz::fail(where(m, dr, dc) + ": id " + std::to_string(m.bucket(dr, dc)) + ", by definition " +
                                   std::to_string(want));
            }
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    const int kind = in.ConsumeIntegralInRange<int>(0, 5);
    rpe_fuzz::with_index(in, [&](const auto& g) {
        using G = std::decay_t<decltype(g)>;
        switch (kind) {
            case 0: check(euclidean<G>{g}, in); break;
            case 1: check(quantization<G>{g}, in); break;
            case 2: check(cross<G>{g}, in); break;
            case 3: check(product<G>{g}, in); break;
            case 4: check(euclidean_paper<G>{g}, in); break;
            default: check(quantization_paper<G>{g}, in); break;
        }
    });
    return 0;
}
