#!/usr/bin/env bash
# Shared helpers for rpe's scripts. Source it:  source "$(dirname "$0")/common.sh"
#
#   rpe_require_packages pkg...   install the Debian packages that are missing (apt-get, as root or
#                                 via sudo); fail with a clear message when that is impossible
#   rpe_require_build_packages    the toolchain and libraries that rpe's build and tests need
#   rpe_require_torch_venv        make <repo>/.venv from bindings/torch/requirements.txt when needed
#                                 (prints its python)
#   rpe_configure_and_build DIR [cmake args...]
#                                 configure DIR (Release, tests + benchmarks + examples) and build it
set -euo pipefail

# The standard list: compiler, build tools, and the libraries rpe's targets find.
RPE_BUILD_PACKAGES=(g++ cmake make ninja-build libeigen3-dev doctest-dev nlohmann-json3-dev libbenchmark-dev libcli11-dev libstb-dev)

# Repository root (this file lives in <root>/scripts).
RPE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

rpe_log() { printf 'rpe: %s\n' "$*" >&2; }

# True when Debian package $1 is installed (not merely known to dpkg, e.g. removed with config kept).
rpe_package_installed() {
    dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed$'
}

rpe_require_packages() {
    if ! command -v dpkg >/dev/null 2>&1; then
        rpe_log "not a Debian-based system (no dpkg); make sure these are installed: $*"
        return 0
    fi
    local missing=() pkg
    for pkg in "$@"; do
        rpe_package_installed "$pkg" || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        return 0
    fi

    local -a as_root=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            as_root=(sudo)
        else
            rpe_log "missing packages: ${missing[*]}"
            rpe_log "not root and no sudo; install them with: apt-get install ${missing[*]}"
            exit 1
        fi
    fi
    rpe_log "installing missing packages: ${missing[*]}"
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
}

rpe_require_build_packages() {
    rpe_require_packages "${RPE_BUILD_PACKAGES[@]}"
    # New build trees (build/, the presets' build/<preset>) use Ninja: it schedules the many heavy
    # translation units of the test build better than make and keeps a per-unit timing log
    # (<tree>/.ninja_log). CMake ignores this for an existing tree, which keeps its generator.
    export CMAKE_GENERATOR="${CMAKE_GENERATOR:-Ninja}"
}

# The PyTorch operators (bindings/torch, CTest label torch) build and test against a virtual
# environment at <repo>/.venv made from ONE pinned file, bindings/torch/requirements.txt (torch,
# timm, numpy, pytest from the Python package index). rpe_require_torch_venv makes it when it is
# missing or was made from another version of that file (a hash kept in .venv/.rpe-requirements),
# and is a no-op otherwise; it prints the interpreter's path on stdout. A .pth file in the venv puts
# bindings/torch on its path, so that `.venv/bin/python -c 'import rpe_torch'` works once build/
# holds the operator library. A fresh machine downloads
# about 3-4 GB (torch's default Linux wheel carries its CUDA 13 libraries); pip's cache makes a
# second venv a local copy.
RPE_VENV="${RPE_VENV:-$RPE_ROOT/.venv}"
RPE_TORCH_REQUIREMENTS="$RPE_ROOT/bindings/torch/requirements.txt"
# rpe_torch_venv_ready prints the interpreter's path and succeeds when .venv is complete and made
# from the current requirements file (what rpe_require_torch_venv would leave as it is).
rpe_torch_venv_ready() {
    local want stamp="$RPE_VENV/.rpe-requirements" py="$RPE_VENV/bin/python" pth
    want="$(sha256sum "$RPE_TORCH_REQUIREMENTS" | cut -d' ' -f1)"
    pth="$(compgen -G "$RPE_VENV/lib/python3*/site-packages/rpe_torch_repo.pth" || true)"
    if [[ -x "$py" && -f "$stamp" && "$(cat "$stamp")" == "$want" && -n "$pth" ]] &&
        "$py" -c 'import torch' >/dev/null 2>&1; then
        printf '%s\n' "$py"
        return 0
    fi
    return 1
}
rpe_require_torch_venv() {
    local want stamp="$RPE_VENV/.rpe-requirements" py="$RPE_VENV/bin/python"
    if rpe_torch_venv_ready; then
        return 0
    fi
    want="$(sha256sum "$RPE_TORCH_REQUIREMENTS" | cut -d' ' -f1)"
    if ! /usr/bin/env python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
        rpe_require_packages python3-venv >&2
    fi
    rpe_log "making $RPE_VENV from ${RPE_TORCH_REQUIREMENTS#"$RPE_ROOT"/} (first time: downloads about 3-4 GB)"
    local start=$SECONDS
    if [[ ! -x "$py" ]]; then
        rm -rf "$RPE_VENV"
        python3 -m venv "$RPE_VENV" >&2
    fi
    rm -f "$stamp"  # written again only when pip succeeded
    "$RPE_VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
        -r "$RPE_TORCH_REQUIREMENTS" >&2
    # `import rpe_torch` in the venv: the package of this checkout (its operator library is found in
    # build/bindings/torch/ once built; a `pip install .` copy takes precedence over this path)
    "$py" -c 'import sysconfig, sys; print(sys.argv[1], file=open(sysconfig.get_paths()["purelib"] + "/rpe_torch_repo.pth", "w"))' \
        "$RPE_ROOT/bindings/torch"
    printf '%s\n' "$want" >"$stamp"
    rpe_log "$RPE_VENV ready in $((SECONDS - start)) s"
    printf '%s\n' "$py"
}

# Number of parallel jobs for builds and tests.
rpe_jobs() {
    nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2
}

# Configure (Release, tests + benchmarks + examples) and build the tree in $1 (default build/);
# further arguments are passed to the configure step (e.g. -DRPE_BUILD_TORCH=ON). RPE_BUILD_TARGET,
# when set, builds that target only (default: all).
# The CUDA sources (when nvcc is found) are compiled for RPE_CUDA_ARCHITECTURES (default 90, the
# GPUs this project is checked on; CMake's default in CMakeLists.txt is "90 75"): one nvcc pass
# per translation unit keeps the test build short.
# A new tree is made with Ninja (rpe_require_build_packages); an existing one keeps its generator.
rpe_configure_and_build() {
    local build_dir="${1:-$RPE_ROOT/build}"
    shift || true
    cmake -S "$RPE_ROOT" -B "$build_dir" \
        -DCMAKE_BUILD_TYPE=Release \
        -DRPE_BUILD_TESTS=ON \
        -DRPE_BUILD_BENCHMARKS=ON \
        -DRPE_BUILD_EXAMPLES=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${RPE_CUDA_ARCHITECTURES:-90}" "$@"
    cmake --build "$build_dir" -j"$(rpe_jobs)" ${RPE_BUILD_TARGET:+--target "$RPE_BUILD_TARGET"}
}
