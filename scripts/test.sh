#!/usr/bin/env bash
# The README's test command: install what is missing, configure and build build/ (Release, tests +
# benchmarks + examples + the PyTorch operators, the CUDA sources compiled when nvcc is there) and
# run every CTest test
# (CUDA tests skip without a device). Safe to run again. The sanitizer and fuzz passes are
# scripts/test_sanitizers.sh; CI (.ci/run) runs both.
#
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

for arg in "$@"; do
    case "$arg" in
        --quick) ;;  # accepted for old command lines: this script is the quick pass now
        *) rpe_log "unknown argument '$arg'; expected no argument"; exit 2 ;;
    esac
done

rpe_require_build_packages
rpe_require_torch_packages  # the bindings/torch tests (CTest label torch)
rpe_configure_and_build build
ctest --test-dir build --output-on-failure -j"$(rpe_jobs)"
