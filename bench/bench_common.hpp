// Helpers shared by the benchmark files (not part of the library): grids, random buffers, the
// memory cap, and the naive O(L²·D) contextual term used as a baseline.
#pragma once

#include <benchmark/benchmark.h>
#include <rpe/rpe.hpp>  // before Eigen: see rpe/backend/cpu/eigen.hpp (g++ 12 AVX-512 warnings)

#include <Eigen/Core>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace rpe_bench {

/// A grid of the benchmark tables: height × width patches after `skip` extra tokens.
struct grid {
    int height, width, skip;
    [[nodiscard]] std::int64_t length() const { return skip + static_cast<std::int64_t>(height) * width; }
    /// "14x14+1", "28x28", "25x38" (names of the benchmarks).
    [[nodiscard]] std::string name() const {
        std::string s = std::to_string(height) + "x" + std::to_string(width);
        if (skip > 0) {  // appended piece by piece: "+" + string trips g++ 12's false -Wrestrict
            s += '+';
            s += std::to_string(skip);
        }
        return s;
    }
};

/// DeiT (14×14 + class token), 28×28, 56×56, the DETR encoder's 25×38.
inline const std::vector<grid>& term_grids() {
    static const std::vector<grid> g{{14, 14, 1}, {28, 28, 0}, {56, 56, 0}, {25, 38, 0}};
    return g;
}

/// Largest buffer total a benchmark allocates, in bytes: RPE_BENCH_MAX_GB (default 3 GB). A case
/// above it is reported as skipped (e.g. the value term on 56×56 at batch 8 in double needs 7.6 GB).
inline std::int64_t max_bytes() {
    const char* env = std::getenv("RPE_BENCH_MAX_GB");
    const double gb = env ? std::atof(env) : 3.0;
    return static_cast<std::int64_t>(gb * 1e9);
}

/// True (and the state marked as skipped) when `bytes` exceed max_bytes().
inline bool too_big(benchmark::State& state, std::int64_t bytes) {
    if (bytes <= max_bytes()) return false;
    state.SkipWithError(("needs " + std::to_string(bytes / 1000000) + " MB > RPE_BENCH_MAX_GB").c_str());
    return true;
}

/// `n` normal(0, scale) values from a fixed seed.
template <class S>
std::vector<S> random_vector(std::int64_t n, double scale = 1.0, unsigned seed = 7) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, scale);
    std::vector<S> v(static_cast<std::size_t>(n));
    for (auto& e : v) e = static_cast<S>(normal(rng));
    return v;
}

/// The naive contextual key term, O(B·H·L²·D): out[b,h,i,j] = x[b,h,i,:] · r[id(i,j), :], one dot
/// product per (query, key) pair (Eigen-vectorised), parallel over (b, h) like rpe's kernels.
/// x (B, H, L, D); table_kd (K, D) (a shared table, transposed so a bucket's vector is contiguous);
/// ids (L, L); out (B, H, L, L). Source: paper eq. 15 evaluated pair by pair.
template <class S, class Id>
void naive_contextual_key(const S* x, const S* table_kd, const Id* ids, std::int64_t planes, std::int64_t n, std::int64_t d,
                          S* out) {
    using vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (std::int64_t p = 0; p < planes; ++p)
        for (std::int64_t i = 0; i < n; ++i) {
            const Eigen::Map<const vec> xi(x + (p * n + i) * d, d);
            const Id* idi = ids + i * n;
            S* oi = out + (p * n + i) * n;
            for (std::int64_t j = 0; j < n; ++j)
                oi[j] = xi.dot(Eigen::Map<const vec>(table_kd + static_cast<std::int64_t>(idi[j]) * d, d));
        }
}

}  // namespace rpe_bench
