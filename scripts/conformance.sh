#!/usr/bin/env bash
# Run the golden-vector conformance runner on DIR (every folder under it holding a meta.json).
# Builds build/tools/rpe_conformance if needed (installing what is missing), then runs it.
# Exit status: 0 only when every case passed and at least one case ran.
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: scripts/conformance.sh DIR   (e.g. tests/data/golden)" >&2
    exit 2
fi
dir="$(cd "$1" 2>/dev/null && pwd)" || { echo "conformance: no such folder: $1" >&2; exit 2; }
cd "$(dirname "$0")/.."
source scripts/common.sh

rpe_require_build_packages
if [[ ! -f build/CMakeCache.txt ]]; then
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build --target rpe_conformance -j"$(rpe_jobs)" >/dev/null
runner="$(find build -type f -name rpe_conformance -perm -u+x | head -n 1)"
exec "$runner" "$dir"
