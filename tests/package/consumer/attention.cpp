// A third unit of the consumer: calls the fused attention, which the program links as the
// installed target rpe::attention (instantiated once, in its own source; this unit only declares
// it, RPE_EXTERN_ATTENTION).
#include <rpe/attention.hpp>

#include <vector>

// One (batch, head) plane, L = 2 tokens on a 1x2 grid, D = 2, no terms: q = k = 0 gives equal
// probabilities, so each output row is the mean of v's rows, (1 + 3) / 2 = 2 and (2 + 4) / 2 = 3.
std::vector<float> consumer_attention_row() {
    const std::vector<float> zero(4, 0.0f), v{1, 2, 3, 4};
    std::vector<float> out(4, -1.0f);
    rpe::attention_inputs<float> in;
    in.q = rpe::tensor_ref<const float>(zero.data(), {1, 1, 2, 2});
    in.k = rpe::tensor_ref<const float>(zero.data(), {1, 1, 2, 2});
    in.v = rpe::tensor_ref<const float>(v.data(), {1, 1, 2, 2});
    in.height = 1;
    in.width = 2;
    rpe::attention_forward<float>(in, rpe::tensor_ref<float>(out.data(), {1, 1, 2, 2}));
    return {out[0], out[1], out[2], out[3]};
}
