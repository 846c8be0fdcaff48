#!/usr/bin/env bash
# Build rpe's libFuzzer harnesses (clang 14, ASan + UBSan) in build-fuzz/ and run each one for
# SECONDS (default 5) on a copy of its seed corpus, so the repository stays clean. Exits non-zero
# when a harness crashes, leaks, times out or fails a property; the input that did it is kept in
# build-fuzz/artifacts/. See docs/fuzzing.md.
#
#   scripts/fuzz.sh [SECONDS] [HARNESS...]     HARNESS: index mapping bucket_ids npy safetensors
#
# Environment: RPE_FUZZ_BUILD_DIR (default build-fuzz), RPE_FUZZ_JOBS (default: all cores, each
# harness still runs alone), RPE_FUZZ_FLAGS (extra libFuzzer flags, e.g. "-seed=1").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

seconds="${1:-5}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
    rpe_log "usage: scripts/fuzz.sh [SECONDS>=1] [HARNESS...]"
    exit 2
fi
shift $(($# > 0 ? 1 : 0))
harnesses=("$@")
((${#harnesses[@]} > 0)) || harnesses=(index mapping bucket_ids npy safetensors)

rpe_require_build_packages
rpe_require_packages clang libclang-rt-14-dev

build_dir="${RPE_FUZZ_BUILD_DIR:-build-fuzz}"
CC=clang CXX=clang++ cmake -S . -B "$build_dir" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DRPE_BUILD_FUZZERS=ON \
    -DRPE_BUILD_TESTS=OFF -DRPE_BUILD_BENCHMARKS=OFF -DRPE_BUILD_EXAMPLES=OFF \
    -DRPE_USE_OPENMP=OFF -DRPE_ENABLE_CUDA=OFF >/dev/null
targets=()
for h in "${harnesses[@]}"; do targets+=(--target "rpe_fuzz_$h"); done
cmake --build "$build_dir" -j"${RPE_FUZZ_JOBS:-$(rpe_jobs)}" "${targets[@]}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
artifacts="$build_dir/artifacts"
mkdir -p "$artifacts"
status=0
for h in "${harnesses[@]}"; do
    cp -r "fuzz/corpus/$h" "$work/$h"
    log="$work/$h.log"
    rpe_log "fuzzing $h for ${seconds}s"
    # -timeout: one input may take at most 10 s; -malloc_limit_mb: a single allocation above
    # 256 MB is a defect (a bad header must not allocate much); the corpus copy grows, not fuzz/.
    # shellcheck disable=SC2086
    if "$build_dir/fuzz/rpe_fuzz_$h" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -malloc_limit_mb=256 -print_final_stats=1 -artifact_prefix="$artifacts/$h-" \
        ${RPE_FUZZ_FLAGS:-} "$work/$h" >"$log" 2>&1; then
        runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
        rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")"
        rpe_log "$h: ok, ${runs:-?} inputs (${rate:-?}/s)"
    else
        status=1
        tail -n 40 "$log" >&2
        rpe_log "$h: FAILED; the input is in $artifacts/ (replay: $build_dir/fuzz/rpe_fuzz_$h <file>)"
    fi
done
exit "$status"
