// Consumer of an installed rpe: includes the umbrella header, uses one type, prints one checkable line.
#include <rpe/rpe.hpp>

#include <cstdio>

int consumer_num_buckets();  // spec.cpp: rpe::make_term through the installed rpe::make_term target

int main() {
    float buf[6] = {};
    const rpe::tensor_ref<float> t(buf, {2, 3});
    const int k = consumer_num_buckets();
    std::printf("rpe consumer: rpe %d.%d.%d found, tensor_ref size %lld, make_term K %d\n", RPE_VERSION_MAJOR,
                RPE_VERSION_MINOR, RPE_VERSION_PATCH, static_cast<long long>(t.size()), k);
    return t.size() == 6 && k == 50 ? 0 : 1;
}
