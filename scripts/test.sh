#!/usr/bin/env bash
# Install what is missing, configure and build build/ (Release, tests + benchmarks + examples),
# then run every CTest test. Exits with ctest's status. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

rpe_require_build_packages
rpe_configure_and_build build

status=0
ctest --test-dir build --output-on-failure -j"$(rpe_jobs)" || status=$?
exit "$status"
