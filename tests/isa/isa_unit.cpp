// One unit of test rpe_isa_test, compiled twice: RPE_ISA_TEST_ENTRY names the entry point of the
// copy (run_baseline, run_avx2, run_avx512_bf16, run_amx_bf16); the ISA flags come from CMakeLists.txt.
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include <rpe/rpe.hpp>                      // first: Eigen includes the intrinsics headers (g++ 12 then keeps quiet about them)
#include <rpe/backend/cpu/f16_kernels.hpp>  // rpe.hpp has it already; named for what this file uses

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
    const char* (*volatile bf16_path)() = &rpe::detail::cpu::bf16_attention_isa;
    r.bf16_path = bf16_path();

    // the same attention on f16 storage (the inputs rounded to f16), and the f16 conversions of
    // this unit (hardware or portable) on a fixed sample and on every f16 value
    const auto to_f16 = [](const std::vector<float>& x) {
        std::vector<rpe::f16> r(x.size());
        for (std::size_t i = 0; i < x.size(); ++i) r[i] = rpe::f16(x[i]);
        return r;
    };
    const auto qh = to_f16(q), kh = to_f16(k), vh = to_f16(v), tqh = to_f16(table_q), tkh = to_f16(table_k),
               tvh = to_f16(table_v);
    rpe::attention_inputs<rpe::f16> inh;
    inh.q = {qh.data(), qkv};
    inh.k = {kh.data(), qkv};
    inh.v = {vh.data(), qkv};
    inh.height = height;
    inh.width = width;
    inh.rpe_q = {tq.get(), {{tqh.data(), tq->table_shape()}}};
    inh.rpe_k = {tk.get(), {{tkh.data(), tk->table_shape()}}};
    inh.rpe_v = {tv.get(), {{tvh.data(), tv->table_shape()}}};
    std::vector<rpe::f16> outh(n);
    rpe::attention_forward(inh, rpe::tensor_ref<rpe::f16>(outh.data(), qkv));
    r.attention_f16.resize(n);
    for (std::size_t i = 0; i < n; ++i) r.attention_f16[i] = static_cast<float>(outh[i]);
    std::vector<float> sample = pseudo_random(4099, 7);
    for (std::size_t i = 0; i < sample.size(); i += 3)  // ties of the normal range, then spread over the exponents
        sample[i] = std::bit_cast<float>((std::bit_cast<std::uint32_t>(sample[i]) & 0xffffe000u) | 0x1000u);
    for (std::size_t i = 1; i < sample.size(); i += 5) sample[i] = std::ldexp(sample[i], static_cast<int>(i % 48) - 30);
    for (std::uint32_t u : {0x477fe000u, 0x477ff000u, 0x477fefffu, 0x33000000u, 0x33000001u, 0x387fe000u, 0x7f800000u,
                            0xff800000u, 0x7fc00000u, 0x7f800001u, 0x80000000u, 0x00000001u})
        sample.push_back(std::bit_cast<float>(u));
    std::vector<rpe::f16> sh(sample.size());
    rpe::detail::cpu::float_to_f16(sample.data(), sh.data(), static_cast<std::int64_t>(sample.size()));
    for (const auto h : sh) r.f16_bits.push_back(h.bits);
    std::vector<rpe::f16> all(65536);
    for (std::uint32_t h = 0; h < 65536; ++h) all[h] = rpe::f16::from_bits(static_cast<std::uint16_t>(h));
    std::vector<float> wide(all.size());
    rpe::detail::cpu::f16_to_float(all.data(), wide.data(), static_cast<std::int64_t>(all.size()));
    for (const float w : wide) r.f16_wide.push_back(std::bit_cast<std::uint32_t>(w));
    const char* (*volatile f16_path)() = &rpe::detail::cpu::f16_isa;
    r.f16_path = f16_path();

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
