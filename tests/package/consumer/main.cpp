// Consumer of an installed rpe: includes the umbrella header, uses one type, prints one checkable line.
#include <rpe/rpe.hpp>

#include <cstdio>

int main() {
    float buf[6] = {};
    const rpe::tensor_ref<float> t(buf, {2, 3});
    std::printf("rpe consumer: rpe %d.%d.%d found, tensor_ref size %lld\n", RPE_VERSION_MAJOR,
                RPE_VERSION_MINOR, RPE_VERSION_PATCH, static_cast<long long>(t.size()));
    return t.size() == 6 ? 0 : 1;
}
