// Soak test of the process-wide caches (a long-lived process that sees many grid sizes): after
// 100 warm-up grids, 500 new distinct grids (16x16 .. 72x72) and RoPE configurations go through
// the terms, the standalone rotation and the fused attention (iRPE-K contextual, RoPE-Axial);
// the resident memory may grow by at most 128 MiB with the default budgets (each host cache
// 64 MiB), and the outputs equal those computed with every cache's budget at 0 (nothing kept,
// everything rebuilt: eviction changes no value).
//
//   rpe_cache_soak [--grids N]   (default 500)
// Prints one line per phase and `cache_soak: ok` (exit 0), or what failed (exit 1).
#include <rpe/attention.hpp>
#include <rpe/caches.hpp>
#include <rpe/rpe.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

// Resident set size of this process in bytes (/proc/self/statm, second field, in pages).
std::size_t resident_bytes() {
    std::ifstream statm("/proc/self/statm");
    std::size_t size = 0, resident = 0;
    statm >> size >> resident;
    return resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

using key_term = rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key>;

struct grid_run {
    int h, w;
    float theta;
};

// One pass over `runs`: the term forward, the rotation and the fused attention per grid. Returns
// a checksum per grid (sum of the attention output and of the term output).
std::vector<double> pass(const std::vector<grid_run>& runs, const key_term& term, const std::vector<float>& table) {
    std::vector<double> sums;
    sums.reserve(runs.size());
    const auto any = rpe::make_any_term(term);
    const int d = 16;
    for (const grid_run& g : runs) {
        const int l = 1 + g.h * g.w;
        std::vector<float> q(static_cast<std::size_t>(l) * d), k(q.size()), v(q.size()), out(q.size()), rot(q.size());
        for (std::size_t i = 0; i < q.size(); ++i) {
            q[i] = std::sin(0.37f * static_cast<float>(i % 1013));
            k[i] = std::cos(0.11f * static_cast<float>(i % 997));
            v[i] = std::sin(0.05f * static_cast<float>(i % 89));
        }
        // term forward on the first 64 query rows' worth of logits: (1, 1, L, L) is too large at
        // 72x72 for 600 grids, so the term runs through the attention below; here its ids only
        const auto ids = term.bucket_ids(g.h, g.w);
        double s = static_cast<double>(ids->at(0, l - 1, 0) + ids->at(0, 0, l - 1));
        // RoPE (cached cos/sin tables: one per theta and grid)
        const rpe::rotary_embedding<float> rope{.form = rpe::rope::axial{.theta = g.theta}, .skip = 1};
        rpe::rope_forward(rope, g.h, g.w, rpe::tensor_ref<const float>(q.data(), {1, 1, l, d}),
                          rpe::tensor_ref<float>(rot.data(), {1, 1, l, d}));
        // fused attention with iRPE-K and the same RoPE
        rpe::attention_inputs<float> in;
        in.q = {q.data(), {1, 1, l, d}};
        in.k = {k.data(), {1, 1, l, d}};
        in.v = {v.data(), {1, 1, l, d}};
        in.height = g.h;
        in.width = g.w;
        in.rpe_k = {.term = any.get(), .tables = {rpe::tensor_ref<const float>(table.data(), {1, d, term.num_buckets()})}};
        in.rope = rope;
        rpe::attention_forward(in, rpe::tensor_ref<float>(out.data(), {1, 1, l, d}));
        for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) + static_cast<double>(rot[i]);
        sums.push_back(s);
    }
    return sums;
}

}  // namespace

int main(int argc, char** argv) {
    int grids = 500;
    if (argc == 3 && std::string(argv[1]) == "--grids") grids = std::atoi(argv[2]);
    if (grids < 1) {
        std::fprintf(stderr, "usage: rpe_cache_soak [--grids N]\n");
        return 2;
    }
    // every (h, w) in 16..72 x 16..72 is distinct: 3249 of them; RoPE thetas vary too
    std::vector<grid_run> all;
    for (int h = 16; h <= 72; ++h)
        for (int w = 16; w <= 72; ++w) all.push_back({h, w, 50.0f + static_cast<float>((h * 73 + w) % 200)});
    std::mt19937 rng(7);
    std::shuffle(all.begin(), all.end(), rng);
    const std::vector<grid_run> warm(all.begin(), all.begin() + 100);
    const std::vector<grid_run> fresh(all.begin() + 100, all.begin() + 100 + grids);

    const key_term term(rpe::mapping::product{rpe::index::piecewise::from_ratio(1.9)},
                        {.num_heads = 1, .head_dim = 16, .shared_head = true, .skip = 1});
    std::vector<float> table(static_cast<std::size_t>(16) * term.num_buckets());
    for (std::size_t i = 0; i < table.size(); ++i) table[i] = 0.01f * static_cast<float>(i % 37);

    (void)pass(warm, term, table);
    const std::size_t before = resident_bytes();
    const auto sums = pass(fresh, term, table);
    const std::size_t after = resident_bytes();
    const rpe::host_cache_stats st = rpe::cache_statistics();
    const double growth_mib = (static_cast<double>(after) - static_cast<double>(before)) / (1 << 20);
    std::printf(
        "cache_soak: %d new grids after 100: resident %.1f MiB -> %.1f MiB (growth %.1f MiB, limit 128); "
        "ids cache %zu entries %.1f MiB (budget %.0f MiB, %zu evictions); RoPE cache %zu entries %.1f MiB (%zu evictions)\n",
        grids, static_cast<double>(before) / (1 << 20), static_cast<double>(after) / (1 << 20), growth_mib, st.bucket_ids.entries,
        static_cast<double>(st.bucket_ids.bytes) / (1 << 20), static_cast<double>(st.bucket_ids.budget) / (1 << 20),
        st.bucket_ids.evictions, st.rope_tables.entries, static_cast<double>(st.rope_tables.bytes) / (1 << 20),
        st.rope_tables.evictions);
    bool ok = true;
    if (growth_mib > 128.0) {
        std::printf("cache_soak: FAILED: resident growth %.1f MiB > 128 MiB\n", growth_mib);
        ok = false;
    }
    if (st.bucket_ids.bytes > st.bucket_ids.budget || st.rope_tables.bytes > st.rope_tables.budget) {
        std::printf("cache_soak: FAILED: a cache holds more than its budget\n");
        ok = false;
    }
    // the same grids with nothing kept: every id table and RoPE table rebuilt, the same values
    const std::vector<grid_run> check(fresh.begin(), fresh.begin() + std::min<std::size_t>(fresh.size(), 40));
    rpe::set_cache_budget(0);
    const auto rebuilt = pass(check, term, table);
    for (std::size_t i = 0; i < check.size(); ++i)
        if (rebuilt[i] != sums[i]) {
            std::printf("cache_soak: FAILED: grid %dx%d gives %.17g without caching, %.17g with\n", check[i].h, check[i].w,
                        rebuilt[i], sums[i]);
            ok = false;
        }
    std::printf("cache_soak: %zu grids recomputed with budget 0: %s\n", check.size(), ok ? "identical" : "differ");
    std::printf("cache_soak: %s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
