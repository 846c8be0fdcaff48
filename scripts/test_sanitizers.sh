#!/usr/bin/env bash
# The second half of CI: every CTest test under AddressSanitizer + UndefinedBehaviorSanitizer
# (CMake workflow preset asan, build/asan), the tests that start threads under ThreadSanitizer
# (preset tsan, build/tsan), and a short smoke run of every fuzzer (scripts/fuzz.sh). Installs
# what is missing; safe to run again. Takes longer than scripts/test.sh (three more builds).
# The presets leave out the tests whose result does not depend on the build's flags
# (format.clang_format, header_size.policies: scripts/test.sh runs them) and the benchmarks.
#
#   scripts/test_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

if (($# > 0)); then
    rpe_log "unknown argument '$1'; expected no argument"
    exit 2
fi

rpe_require_build_packages
export CMAKE_BUILD_PARALLEL_LEVEL="$(rpe_jobs)" CTEST_PARALLEL_LEVEL="$(rpe_jobs)"
for preset in asan tsan; do
    rpe_log "workflow preset $preset"
    cmake --workflow --preset "$preset"
done

# Fuzzers: a few seconds each (the longer run is documented in docs/fuzzing.md).
bash scripts/fuzz.sh 5
