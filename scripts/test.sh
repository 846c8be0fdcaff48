#!/usr/bin/env bash
# The README's test command: install what is missing, make the Python environment .venv/ (torch,
# timm, numpy, pytest pinned in bindings/torch/requirements.txt), configure and build build/
# (Release, tests + benchmarks + examples + the PyTorch operators built against .venv's torch, the
# CUDA sources compiled when nvcc is there) and run every CTest test (CUDA tests skip without a
# device). Safe to run again, also after scripts/demo.sh configured build/ without torch: the
# torch operators are always asked for (-DRPE_BUILD_TORCH=ON), and the run fails when no torch
# test was registered. The sanitizer and fuzz passes are
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
rpe_require_packages clang-format-14  # test format.clang_format (the sources follow .clang-format)
# The bindings/torch build and tests (CTest label torch) need .venv. When it must be made (a fresh
# machine downloads torch, 3-4 GB), pip runs in the background while everything that does not
# need torch is built; the torch operators are added to the same tree once it is there.
if ! venv_python="$(rpe_torch_venv_ready)"; then
    venv_dir="$(mktemp -d)"
    # its own session (process group), so that a failed build stops pip and its children too
    setsid bash -c 'source scripts/common.sh && rpe_require_torch_venv' >"$venv_dir/python" 2>"$venv_dir/log" &
    venv_pid=$!
    trap 'kill -- "-$venv_pid" 2>/dev/null || true; rm -rf "$venv_dir"' EXIT
    rpe_log "making .venv in the background (log: $venv_dir/log); building the unit tests meanwhile"
    # the unit tests only: the rest (the torch operators among them) builds in parallel below
    RPE_BUILD_TARGET=rpe_unit_tests rpe_configure_and_build build -DRPE_BUILD_TORCH=OFF
    if ! wait "$venv_pid"; then
        cat "$venv_dir/log" >&2
        rpe_log "making .venv failed (log above)"
        exit 1
    fi
    cat "$venv_dir/log" >&2
    venv_python="$(cat "$venv_dir/python")"
fi
rpe_configure_and_build build -DRPE_BUILD_TORCH=ON -DRPE_TORCH_PYTHON="$venv_python"
# The torch tests are expected here: a build tree without them is an error, never a silent pass.
torch_tests="$(ctest --test-dir build -N -L torch | sed -n 's/^Total Tests: //p')"
if [[ -z "$torch_tests" || "$torch_tests" -eq 0 ]]; then
    rpe_log "no CTest test with label torch in build/ (RPE_BUILD_TORCH is OFF?); expected the rpe_torch tests"
    exit 1
fi
ctest --test-dir build --output-on-failure -j"$(rpe_jobs)"
