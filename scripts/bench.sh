#!/usr/bin/env bash
# Build the benchmarks in Release (installing what is missing), run them, and write all results
# as one Google Benchmark JSON file to build/bench.json. Arguments go to the benchmark binary,
# e.g.  scripts/bench.sh --benchmark_filter='attention/deit_s' --benchmark_repetitions=5
# Families: attention*/, term/, naive/, bucket_ids/, ref/ (see docs/benchmarks.md). The whole
# suite (about 1000 cases) takes long: pass a --benchmark_filter. Threads: OMP_NUM_THREADS.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

rpe_require_build_packages
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DRPE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build --target rpe_bench -j"$(rpe_jobs)"
bench="$(find build -type f -name rpe_bench -perm -u+x | head -n 1)"
# all or nothing: the JSON goes to a temporary file next to build/bench.json, renamed over it only
# when the run succeeded (a failed or interrupted run leaves the old results, no partial file)
tmp="$(mktemp build/.bench.json.tmp-XXXXXX)"
trap 'rm -f "$tmp"' EXIT
"$bench" --benchmark_out="$tmp" --benchmark_out_format=json "$@"
# Google Benchmark exits 0 even when it could not write --benchmark_out (a full disk): keep the old
# results unless the new file is complete JSON.
if ! python3 -m json.tool "$tmp" >/dev/null 2>&1; then
    rm -f "$tmp"
    rpe_log "bench: the results file is not complete JSON (full disk?); build/bench.json is unchanged"
    exit 1
fi
chmod 644 "$tmp"
mv -f "$tmp" build/bench.json
rpe_log "results written to build/bench.json"
