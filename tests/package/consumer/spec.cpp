// A second unit of the consumer: configures a term at run time through rpe::make_term, which the
// program links as the installed target rpe::make_term (instantiated once, in its own source).
#include <rpe/make_term.hpp>

int consumer_num_buckets() {
    rpe::term_spec spec;  // the reference's defaults: product, piecewise, ratio 1.9, contextual, k
    spec.num_heads = 6;
    spec.head_dim = 64;
    spec.skip = 1;
    return rpe::make_term<float>(spec)->num_buckets();
}
