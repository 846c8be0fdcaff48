// Quick start: the contextual iRPE key term of DeiT-S, added to attention logits.
#include <rpe/rpe.hpp>
#include <cstdio>
#include <vector>

int main() {
    // Contextual Product on keys, ratio 1.9 (α=1.9, β=3.8, γ=15.2), table shared by 6 heads, class token.
    using key_term = rpe::term<rpe::mapping::product<>, rpe::mode::contextual, rpe::target::key>;
    const key_term rpe_k(rpe::mapping::product{rpe::index::piecewise::from_ratio(1.9)},
                         {.num_heads = 6, .head_dim = 64, .shared_head = true, .skip = 1});
    const auto ids = rpe_k.bucket_ids(14, 14);  // (197, 197) bucket ids, 1 byte each, shared cache
    const int B = 2, H = 6, L = ids->length(), D = 64, K = rpe_k.num_buckets();  // K = 7*7 + 1 = 50
    std::vector<float> qs(B * H * L * D, 0.125f), table(D * K, 0.5f), logits(B * H * L * L, 1.0f);
    rpe_k.forward(*ids, {table.data(), {1, D, K}}, {qs.data(), {B, H, L, D}}, {logits.data(), {B, H, L, L}},
                  rpe::write::accumulate);  // logits[b,h,i,j] += Σ_d qs[b,h,i,d] · table[0,d,id(i,j)]
    std::printf("quickstart: K=%d L=%d id_bytes=%d logits[0]=%g\n", K, L, ids->id_bytes(), logits[0]);
}
