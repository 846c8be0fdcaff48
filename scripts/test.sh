#!/usr/bin/env bash
# Install what is missing, configure and build build/ (Release, tests + benchmarks + examples),
# run every CTest test; then the same tests under AddressSanitizer + UndefinedBehaviorSanitizer
# and under ThreadSanitizer (CMake workflow presets asan and tsan, build/asan and build/tsan), and
# a short smoke run of every fuzzer (scripts/fuzz.sh). Safe to run again.
#
#   scripts/test.sh           everything (what CI runs)
#   scripts/test.sh --quick   the Release build and its tests only
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

quick=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        *) rpe_log "unknown argument '$arg'; expected --quick or nothing"; exit 2 ;;
    esac
done

rpe_require_build_packages
rpe_configure_and_build build
ctest --test-dir build --output-on-failure -j"$(rpe_jobs)"
((quick)) && exit 0

# Sanitizer workflows: configure + build + test each (tests exclude the bench label).
export CMAKE_BUILD_PARALLEL_LEVEL="$(rpe_jobs)" CTEST_PARALLEL_LEVEL="$(rpe_jobs)"
for preset in asan tsan; do
    rpe_log "workflow preset $preset"
    cmake --workflow --preset "$preset"
done

# Fuzzers: a few seconds each (the longer run is documented in docs/fuzzing.md).
bash scripts/fuzz.sh 5
