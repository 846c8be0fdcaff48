// Custom mapping example: the Chebyshev policy of chebyshev.hpp plugged into bucket ids, the
// contextual key and value terms and the fused attention (rpe::attention_forward), checked
// against a hand-written loop. Prints one line ending in "ok".
#include <rpe/rpe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "chebyshev.hpp"

int main() {
    const example::chebyshev m{rpe::index::piecewise::from_ratio(1.9)};
    const int B = 2, H = 2, D = 8, height = 7, width = 7, skip = 1;

    // 1. bucket ids (L, L), built once per configuration in the shared cache
    const auto ids = rpe::bucket_cache::global().get(m, height, width, skip);
    const int L = ids->length(), K = ids->num_buckets();  // K = βi + 1 + 1 skip bucket = 5

    // 2. terms: contextual on keys (table (1, D, K)) and on values (table (1, K, D)), shared by the heads
    using key_term = rpe::term<example::chebyshev, rpe::mode::contextual, rpe::target::key>;
    using value_term = rpe::term<example::chebyshev, rpe::mode::contextual, rpe::target::value>;
    const auto rpe_k = rpe::make_any_term(key_term(m, {.num_heads = H, .head_dim = D, .shared_head = true, .skip = skip}));
    const auto rpe_v = rpe::make_any_term(value_term(m, {.num_heads = H, .head_dim = D, .shared_head = true, .skip = skip}));

    std::mt19937 rng(2021);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randn = [&](std::size_t n) {
        std::vector<float> v(n);
        for (auto& x : v) x = normal(rng);
        return v;
    };
    const std::size_t n = static_cast<std::size_t>(B) * H * L * D;
    const auto q = randn(n), k = randn(n), v = randn(n);
    const auto table_k = randn(static_cast<std::size_t>(D) * K), table_v = randn(static_cast<std::size_t>(K) * D);

    // 3. the fused attention: softmax((q·s)kᵀ + key term) · v + value term
    rpe::attention_inputs<float> in;
    in.q = {q.data(), {B, H, L, D}};
    in.k = {k.data(), {B, H, L, D}};
    in.v = {v.data(), {B, H, L, D}};
    in.height = height;
    in.width = width;
    in.rpe_k = {.term = rpe_k.get(), .tables = {{table_k.data(), {1, D, K}}}};
    in.rpe_v = {.term = rpe_v.get(), .tables = {{table_v.data(), {1, K, D}}}};
    std::vector<float> out(n);
    rpe::attention_forward(in, {out.data(), {B, H, L, D}});

    // 4. the same by hand, the id of each pair computed from the grid
    auto id_of = [&](int i, int j) {
        if (i < skip || j < skip) return K - 1;
        const int ri = (i - skip) / width, ci = (i - skip) % width, rj = (j - skip) / width, cj = (j - skip) % width;
        return m.bucket(ri - rj, ci - cj);
    };
    const double s = 1.0 / std::sqrt(static_cast<double>(D));
    double worst = 0;
    int id_mismatches = 0;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
            for (int i = 0; i < L; ++i) {
                const std::size_t base = static_cast<std::size_t>((b * H + h) * L) * D;
                std::vector<double> logit(static_cast<std::size_t>(L));
                for (int j = 0; j < L; ++j) {
                    id_mismatches += ids->at(0, i, j) != id_of(i, j);
                    double acc = 0;
                    for (int d = 0; d < D; ++d) {
                        const double qs = q[base + static_cast<std::size_t>(i * D + d)] * s;
                        acc += qs * (k[base + static_cast<std::size_t>(j * D + d)] +
                                     table_k[static_cast<std::size_t>(d * K + id_of(i, j))]);
                    }
                    logit[static_cast<std::size_t>(j)] = acc;
                }
                const double mx = *std::max_element(logit.begin(), logit.end());
                double sum = 0;
                for (auto& x : logit) sum += (x = std::exp(x - mx));
                for (int d = 0; d < D; ++d) {
                    double z = 0;
                    for (int j = 0; j < L; ++j)
                        z += logit[static_cast<std::size_t>(j)] / sum *
                             (v[base + static_cast<std::size_t>(j * D + d)] +
                              table_v[static_cast<std::size_t>(id_of(i, j) * D + d)]);
                    worst = std::max(worst, std::fabs(z - out[base + static_cast<std::size_t>(i * D + d)]));
                }
            }
    const int centre = skip + (height / 2) * width + width / 2;
    std::printf("custom_mapping: chebyshev K=%d L=%d id(centre, corner)=%d id mismatches=%d max|fused - loop|=%.1e %s\n", K, L,
                ids->at(0, centre, skip), id_mismatches, worst, id_mismatches == 0 && worst < 1e-4 ? "ok" : "FAILED");
    return id_mismatches == 0 && worst < 1e-4 ? 0 : 1;
}
