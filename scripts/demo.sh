#!/usr/bin/env bash
# The main job: install what is missing, configure build/ (Release), build the digits demo and run
# it: two DeiT + iRPE models trained with the reference on the UCI handwritten digits classify the
# 450 test images; the demo prints accuracy, agreement with the reference logits and images/s.
# The program it runs is DEMO_TARGET (a CMake target); override with RPE_DEMO_TARGET.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

DEMO_TARGET="${RPE_DEMO_TARGET:-vit_digits}"

rpe_require_build_packages
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DRPE_BUILD_TESTS=ON -DRPE_BUILD_BENCHMARKS=ON \
      -DRPE_BUILD_EXAMPLES=ON >/dev/null
cmake --build build --target "$DEMO_TARGET" rpe_cli -j"$(rpe_jobs)"  # and the `rpe` tool the README uses next
bin="$(find build/examples -type f -name "$DEMO_TARGET" -perm -u+x | head -n 1)"
rpe_log "demo: running $bin $*"
exec "$bin" "$@"
