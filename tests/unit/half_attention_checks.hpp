// Shared checks of the fused attention on 16-bit storage (rpe::bf16, rpe::f16), called by
// test_attention_bf16.cpp and test_attention_f16.cpp on their own cases: the refused arguments of
// the forward and the backward, and the forward in chunks of batch elements.
#pragma once

#include <doctest/doctest.h>
#include <rpe/rpe.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_paths.hpp"
#include "golden.hpp"
#include "half_checks.hpp"

namespace rpe_test {

/// Whether rpe::attention_forward(in, out) / attention_backward(in, go, g, g, g) are valid calls.
template <class In, class Out>
constexpr bool forward_accepts = requires(const In& in, Out o) {
    rpe::attention_forward(in, o);
};
template <class In, class Go, class G>
constexpr bool backward_accepts = requires(const In& in, Go go, G g) {
    rpe::attention_backward(in, go, g, g, g);
};

/// Bad arguments of the 16-bit forward and backward on `in` (a call with a table on rpe_k) are
/// refused naming the argument, before any output is written; a good backward call then works;
/// mixed scalar types (H with float, or with the other 16-bit type) do not compile.
template <class H>
void check_refused_arguments(const rpe::attention_inputs<H>& in) {
    using other = std::conditional_t<std::is_same_v<H, rpe::bf16>, rpe::f16, rpe::bf16>;
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), l = in.q.extent(2), d = in.q.extent(3);
    std::vector<H> out(static_cast<std::size_t>(b * h * l * d), H(-3.0f)), small(out.size() - 1);
    const auto shape = {b, h, l, d};
    CHECK(throws_with([&] { rpe::attention_forward(in, rpe::tensor_ref<H>(small.data(), {b, h, l - 1, d})); }, "out"));
    std::vector<H> attn(static_cast<std::size_t>(l * l));
    CHECK(throws_with(
        [&] {
            rpe::attention_forward(in, rpe::tensor_ref<H>(out.data(), shape), rpe::tensor_ref<H>(attn.data(), {l, l}));
        },
        "attn"));
    auto bad = in;  // a table of the wrong shape
    bad.rpe_k.tables[0].shape[2] += 1;
    CHECK(throws_with([&] { rpe::attention_forward(bad, rpe::tensor_ref<H>(out.data(), shape)); }, "rpe_k table"));
    bad = in;  // k of another shape than q
    bad.k.shape[3] = 3;
    CHECK(throws_with([&] { rpe::attention_forward(bad, rpe::tensor_ref<H>(out.data(), shape)); }, "k has shape"));
    CHECK(throws_with([&] { rpe::attention_forward(in, rpe::tensor_ref<H>(out.data(), shape), {}, {.scale = std::nan("")}); },
                      "scale"));
    bool out_untouched = true;
    for (const auto& o : out) out_untouched = out_untouched && o.bits == H(-3.0f).bits;
    CHECK(out_untouched);
    // the backward: bad gradients are refused naming the argument, before any write
    const std::size_t n = out.size();
    std::vector<H> go(n, H(0.5f)), gq(n, H(-3.0f)), gk(n, H(-3.0f)), gv(n, H(-3.0f));
    const rpe::tensor_ref<const H> gov(go.data(), shape);
    const rpe::tensor_ref<H> gqv(gq.data(), shape), gkv(gk.data(), shape), gvv(gv.data(), shape);
    CHECK(throws_with(
        [&] {
            rpe::attention_backward(in, gov, rpe::tensor_ref<H>(gq.data(), {b, h, l - 1, d}), gkv, gvv);
        },
        "grad_q has shape"));
    CHECK(throws_with(
        [&] {
            rpe::attention_backward(in, rpe::tensor_ref<const H>(go.data(), {b, h, l, d - 1}), gqv, gkv, gvv);
        },
        "grad_out has shape"));
    CHECK(throws_with([&] { rpe::attention_backward(in, gov, gqv, rpe::tensor_ref<H>(gq.data(), shape), gvv); },
                      {"grad_k", "grad_q"}));  // overlapping outputs
    auto bad_g = in;
    std::vector<H> gt(static_cast<std::size_t>(in.rpe_k.tables[0].size()));
    rpe::tensor_ref<H> gtv;
    gtv.data = gt.data();
    gtv.rank = in.rpe_k.tables[0].rank;
    gtv.shape = in.rpe_k.tables[0].shape;
    gtv.shape[1] += 1;
    bad_g.rpe_k.grad_tables = {gtv};
    CHECK(throws_with([&] { rpe::attention_backward(bad_g, gov, gqv, gkv, gvv); }, "rpe_k grad_tables[0]"));
    std::vector<H> small_attn(static_cast<std::size_t>(l * l));
    CHECK(throws_with(
        [&] {
            rpe::attention_backward(in, {.grad_out = gov,
                                         .grad_q = gqv,
                                         .grad_k = gkv,
                                         .grad_v = gvv,
                                         .saved_attn = rpe::tensor_ref<const H>(small_attn.data(), {l, l})});
        },
        "saved_attn"));
    bool untouched = true;  // every refused call left the gradients alone
    for (std::size_t i = 0; i < n; ++i)
        untouched = untouched && gq[i].bits == H(-3.0f).bits && gk[i].bits == H(-3.0f).bits && gv[i].bits == H(-3.0f).bits;
    CHECK(untouched);
    rpe::attention_backward(in, gov, gqv, gkv, gvv);  // and a good call works
    CHECK(std::isfinite(static_cast<float>(gq[0])));
    // one scalar type per call: mixed types do not compile
    static_assert(!forward_accepts<rpe::attention_inputs<H>, rpe::tensor_ref<float>>);
    static_assert(!forward_accepts<rpe::attention_inputs<H>, rpe::tensor_ref<other>>);
    static_assert(!forward_accepts<rpe::attention_inputs<float>, rpe::tensor_ref<H>>);
    static_assert(forward_accepts<rpe::attention_inputs<H>, rpe::tensor_ref<H>>);
    static_assert(!backward_accepts<rpe::attention_inputs<H>, rpe::tensor_ref<const float>, rpe::tensor_ref<float>>);
    static_assert(!backward_accepts<rpe::attention_inputs<float>, rpe::tensor_ref<const H>, rpe::tensor_ref<H>>);
    static_assert(!backward_accepts<rpe::attention_inputs<other>, rpe::tensor_ref<const H>, rpe::tensor_ref<H>>);
    static_assert(backward_accepts<rpe::attention_inputs<H>, rpe::tensor_ref<const H>, rpe::tensor_ref<H>>);
}

/// The 16-bit forward on `in` (rpe::bf16: the portable path) in chunks of batch elements gives the
/// bits of `whole_out` / `whole_attn` (the call's out and attn in one chunk):
/// half_forward_chunk_bytes bounds the float copies it holds, 1 byte gives one batch element per
/// chunk, then chunks of 2 (and 1); with attn requested and without (the chunk holds q, k, v and
/// out only).
template <class H>
void check_chunked_forward(const rpe::attention_inputs<H>& in, const std::vector<H>& whole_out,
                           const std::vector<H>& whole_attn) {
    const std::int64_t b = in.q.extent(0), h = in.q.extent(1), l = in.q.extent(2), d = in.q.extent(3);
    const bf16_portable_path hook(true);
    auto& budget = rpe::detail::cpu::half_forward_chunk_bytes;
    const auto saved = budget.load();
    for (const std::int64_t bytes : {std::int64_t{1}, 2 * 4 * h * l * (4 * d + l)}) {
        CAPTURE(bytes);
        budget = bytes;
        std::vector<H> out(whole_out.size(), H(-3.0f)), attn(whole_attn.size(), H(-3.0f));
        rpe::attention_forward(in, rpe::tensor_ref<H>(out.data(), {b, h, l, d}), rpe::tensor_ref<H>(attn.data(), {b, h, l, l}));
        CHECK(same_bits(whole_out, out));
        CHECK(same_bits(whole_attn, attn));
        // without attn: the chunk holds q, k, v and out only
        std::vector<H> alone(whole_out.size(), H(-3.0f));
        rpe::attention_forward(in, rpe::tensor_ref<H>(alone.data(), {b, h, l, d}));
        CHECK(same_bits(whole_out, alone));
    }
    budget = saved;
}

}  // namespace rpe_test
