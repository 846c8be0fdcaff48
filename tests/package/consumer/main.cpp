// Consumer of an installed rpe: includes the umbrella header, uses one type, calls make_term and the
// fused attention from units of their own (their installed targets), prints one checkable line.
#include <rpe/rpe.hpp>

#include <cstdio>
#include <vector>

int consumer_num_buckets();                   // spec.cpp: rpe::make_term through the installed rpe::make_term target
std::vector<float> consumer_attention_row();  // attention.cpp: the installed rpe::attention target

int main() {
    float buf[6] = {};
    const rpe::tensor_ref<float> t(buf, {2, 3});
    const int k = consumer_num_buckets();
    const std::vector<float> o = consumer_attention_row();  // (2, 3) in both rows
    std::printf("rpe consumer: rpe %d.%d.%d found, tensor_ref size %lld, make_term K %d, attention out %g %g %g %g\n",
                RPE_VERSION_MAJOR, RPE_VERSION_MINOR, RPE_VERSION_PATCH, static_cast<long long>(t.size()), k, o[0], o[1], o[2],
                o[3]);
    const bool attention_ok = o == std::vector<float>{2, 3, 2, 3};
    return t.size() == 6 && k == 50 && attention_ok ? 0 : 1;
}
