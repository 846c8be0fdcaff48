// doctest main of the CUDA tests (compiled by the host compiler: no nvcc pass over doctest's
// implementation). Without a usable CUDA device it prints "skipped: no CUDA device (...)" and
// exits 77, which CTest reports as skipped (SKIP_RETURN_CODE). With --host-only it runs the
// host-side suite "host" whether or not a device exists.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

namespace rpe_cuda_test {
// Defined in test_cuda_terms.cu: true when a CUDA device is usable; else `why` says why not.
// `what` receives the device's name and architecture.
bool has_device(std::string& why, std::string& what);
}  // namespace rpe_cuda_test

int main(int argc, char** argv) {
    // --host-only: the host-side test suite "host" (argument checks that fail before any CUDA
    // call), with or without a device.
    if (argc > 1 && std::string(argv[1]) == "--host-only") {
        doctest::Context context;
        context.applyCommandLine(argc - 1, argv + 1);
        context.addFilter("test-suite", "host");
        return context.run();
    }
    std::string why, what;
    if (!rpe_cuda_test::has_device(why, what)) {
        std::printf("skipped: no CUDA device (%s)\n", why.c_str());
        return 77;
    }
    std::printf("CUDA device 0: %s\n", what.c_str());
    doctest::Context context(argc, argv);
    return context.run();
}
