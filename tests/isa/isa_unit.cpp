// One unit of test rpe_isa_test, compiled twice: RPE_ISA_TEST_ENTRY names the entry point of the
// copy (run_baseline, run_avx2, run_avx512_bf16); the ISA flags come from CMakeLists.txt.
#include <cstdint>
#include <vector>

#include <rpe/rpe.hpp>

#include "isa_unit.hpp"

namespace {

std::vector<float> pseudo_random(std::size_t n, std::uint32_t seed) {
    std::vector<float> v(n);
    for (auto& x : v) {
        seed = seed * 1664525u + 1013904223u;
        x = static_cast<float>(seed >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;  // [-1, 1)
    }
    return v;
}

}  // namespace

isa_result RPE_ISA_TEST_ENTRY() {
    // B = 2, H = 2, a 5 × 7 grid and a class token: L = 36 (two 16-wide and four 8-wide vector
    // steps, then a tail), D = 16.
    const int B = 2, H = 2, height = 5, width = 7, skip = 1, D = 16, L = skip + height * width;
    const rpe::mapping::product<> product{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::mapping::euclidean<> euclidean{rpe::index::piecewise::from_ratio(1.9)};
    const rpe::term_config cfg{.num_heads = H, .head_dim = D, .shared_head = false, .skip = skip};
    const rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::query> on_q(product, cfg);
    const rpe::term<rpe::mapping::euclidean<>, rpe::mode::bias, rpe::target::key> on_k(euclidean, cfg);
    const rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::value> on_v(product, cfg);
    const auto tq = rpe::make_any_term(on_q), tk = rpe::make_any_term(on_k), tv = rpe::make_any_term(on_v);

    const std::size_t n = static_cast<std::size_t>(B * H * L * D);
    const auto q = pseudo_random(n, 1), k = pseudo_random(n, 2), v = pseudo_random(n, 3);
    const auto table_q = pseudo_random(static_cast<std::size_t>(H * D * on_q.num_buckets()), 4);
    const auto table_k = pseudo_random(static_cast<std::size_t>(H * on_k.num_buckets()), 5);
    const auto table_v = pseudo_random(static_cast<std::size_t>(H * on_v.num_buckets() * D), 6);
    const std::vector<std::int64_t> qkv{B, H, L, D};

    rpe::attention_inputs<float> in;
    in.q = {q.data(), qkv};
    in.k = {k.data(), qkv};
    in.v = {v.data(), qkv};
    in.height = height;
    in.width = width;
    in.rpe_q = {tq.get(), {{table_q.data(), tq->table_shape()}}};
    in.rpe_k = {tk.get(), {{table_k.data(), tk->table_shape()}}};
    in.rpe_v = {tv.get(), {{table_v.data(), tv->table_shape()}}};

    isa_result r;
    r.attention.resize(n);
    rpe::attention_forward(in, rpe::tensor_ref<float>(r.attention.data(), qkv));

    // the same attention on bf16 storage (the inputs rounded to bf16)
    const auto to_bf16 = [](const std::vector<float>& x) {
        std::vector<rpe::bf16> r(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) r[i] = rpe::bf16(x[i]);
        return r;
    };
    const auto qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), tqb = to_bf16(table_q), tkb = to_bf16(table_k),
               tvb = to_bf16(table_v);
    rpe::attention_inputs<rpe::bf16> inb;
    inb.q = {qb.data(), qkv};
    inb.k = {kb.data(), qkv};
    inb.v = {vb.data(), qkv};
    inb.height = height;
    inb.width = width;
    inb.rpe_q = {tq.get(), {{tqb.data(), tq->table_shape()}}};
    inb.rpe_k = {tk.get(), {{tkb.data(), tk->table_shape()}}};
    inb.rpe_v = {tv.get(), {{tvb.data(), tv->table_shape()}}};
    std::vector<rpe::bf16> outb(n);
    rpe::attention_forward(inb, rpe::tensor_ref<rpe::bf16>(outb.data(), qkv));
    r.attention_bf16.resize(n);
    for (std::size_t i = 0; i < n; ++i) r.attention_bf16[i] = static_cast<float>(outb[i]);
    const char* (*volatile bf16_path)() = &rpe::detail::cpu::bf16_isa;
    r.bf16_path = bf16_path();

    // the key term alone: a contextual product term on the scaled queries
    const rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key> on_key(product, cfg);
    const auto ids = on_key.bucket_ids(height, width);
    r.term.assign(static_cast<std::size_t>(B * H * L * L), 0.0f);
    on_key.forward(*ids, {table_q.data(), {H, D, on_key.num_buckets()}}, {q.data(), qkv}, {r.term.data(), {B, H, L, L}},
                   rpe::write::overwrite);

    // Called through their addresses: inline functions of one name keep one copy per program,
    // so without per-ISA namespaces both units would report the same strings.
    const char* (*volatile isa)() = &rpe::detail::cpu::simd_isa;
    const char* (*volatile ns)() = &rpe::detail::cpu::isa_namespace;
    r.isa = isa();
    r.ns = ns();
    const auto fn = &rpe::attention_forward<float>;
    r.attention_fn = reinterpret_cast<const void*>(fn);
    return r;
}
