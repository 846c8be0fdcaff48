// libFuzzer harness: rpe::build_bucket_ids on small fuzzed grids (height, width <= 12, skip <= 3,
// so L <= 147 and one input runs in well under a millisecond) for every mapping and both index
// functions. Property: the builder throws our exception, or every id of every table equals the
// mapping's own id of that pair's offset, pairs touching a skip token have the extra id, and
// num_buckets() is the mapping's plus one with skip tokens.
#include <cstdint>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "fuzz_common.hpp"
#include "rpe/bucket_cache.hpp"
#include "rpe/mapping/cross.hpp"
#include "rpe/mapping/euclidean.hpp"
#include "rpe/mapping/product.hpp"
#include "rpe/mapping/quantization.hpp"

namespace {

using namespace rpe::mapping;

template <class M>
void check(const M& m, int height, int width, int skip) {
    std::shared_ptr<const rpe::bucket_ids> ids;
    try {
        ids = rpe::build_bucket_ids(m, height, width, skip);
    } catch (const rpe::invalid_argument&) {
        return;
    } catch (const rpe::out_of_range&) {
        return;
    }
    const std::string where = std::string(typeid(M).name()) + " with " + rpe_fuzz::describe(m.index) + " on " +
                              std::to_string(height) + "x" + std::to_string(width) + " skip " + std::to_string(skip);
    const int k = m.num_buckets();
    const int n = skip + height * width;
    constexpr int tables = rpe::detail::num_tables_of<M>();
    if (ids->length() != n || ids->num_tables() != tables || ids->num_buckets() != k + (skip > 0 ? 1 : 0))
        rpe_fuzz::fail(where + ": wrong length, table count or num_buckets");
    const int ow = 2 * width - 1;
    std::vector<int> expected(static_cast<std::size_t>(2 * height - 1) * ow);  // the mapping's id per offset
    for (int t = 0; t < tables; ++t) {
        for (int dr = -(height - 1); dr < height; ++dr)
            for (int dc = -(width - 1); dc < width; ++dc)
                expected[static_cast<std::size_t>(dr + height - 1) * ow + (dc + width - 1)] =
                    rpe::detail::bucket_of(m, dr, dc, t);
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < n; ++j) {
                int want = k;  // the extra (skip) bucket
                if (i >= skip && j >= skip) {
                    const int ri = (i - skip) / width, ci = (i - skip) % width;
                    const int rj = (j - skip) / width, cj = (j - skip) % width;
                    want = expected[static_cast<std::size_t>(ri - rj + height - 1) * ow + (ci - cj + width - 1)];
                }
                const int got = ids->at(t, i, j);
                if (got != want)
                    rpe_fuzz::fail(where + ": id at (table " + std::to_string(t) + ", " + std::to_string(i) + ", " +
                                   std::to_string(j) + ") = " + std::to_string(got) + ", expected " + std::to_string(want));
            }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    FuzzedDataProvider in(data, size);
    const int kind = in.ConsumeIntegralInRange<int>(0, 5);
    // mostly valid sizes, sometimes a non-positive one (the builder must refuse it)
    const int height = in.ConsumeIntegralInRange<int>(-1, 12);
    const int width = in.ConsumeIntegralInRange<int>(-1, 12);
    const int skip = in.ConsumeIntegralInRange<int>(-1, 3);
    rpe_fuzz::with_index(in, [&](const auto& g) {
        using G = std::decay_t<decltype(g)>;
        switch (kind) {
            case 0: check(euclidean<G>{g}, height, width, skip); break;
            case 1: check(quantization<G>{g}, height, width, skip); break;
            case 2: check(cross<G>{g}, height, width, skip); break;
            case 3: check(product<G>{g}, height, width, skip); break;
            case 4: check(euclidean_paper<G>{g}, height, width, skip); break;
            default: check(quantization_paper<G>{g}, height, width, skip); break;
        }
    });
    return 0;
}
