#!/usr/bin/env bash
# GPU check of rpe's CUDA backend: builds the CUDA tests and benchmarks and runs them on a machine
# with an NVIDIA GPU, the CUDA Toolkit (nvcc), CMake and a C++20 host compiler, but no package
# registry. Results (logs, test report, benchmark lines) go to OUTDIR.
#
#   scripts/gpu_check.sh --prepare       here, with network: apt-get download the Debian packages
#                                        the build needs (headers and CMake configs) into .gpu-debs/
#   scripts/gpu_check.sh [--out OUTDIR]  there: unpack .gpu-debs/*.deb with dpkg -x into a private
#                                        prefix (never /), configure (sm_90 only), build
#                                        rpe_cuda_tests and rpe_cuda_bench, run both; then, when
#                                        python3 there imports a CUDA-enabled torch, build the
#                                        rpe_torch operators against it (build-gpu-torch/, their
#                                        CUDA kernels included) and run
#                                        bindings/torch/tests/test_cuda.py (CUDA vs CPU operators).
#                                        OUTDIR defaults to build-gpu/results.
#   scripts/gpu_check.sh --no-torch ...  without the rpe_torch part
#   scripts/gpu_check.sh --configure-only  unpack and configure only (checks the prepared packages
#                                        anywhere, GPU or not)
#
# With the device tool: run --prepare first, then run `scripts/gpu_check.sh --out "$OUT"` there
# with carry [".gpu-debs"]. Exit status: that of the CUDA tests (77 = no CUDA device: skipped),
# else that of the rpe_torch CUDA tests (pytest's). Budget: about 2-3 minutes on 16 cores (4 nvcc
# translation units, one architecture), plus about 2 for rpe_torch (two Torch translation units
# and one .cu; the tests take seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
debs="$root/.gpu-debs"
packages=(libeigen3-dev doctest-dev nlohmann-json3-dev libbenchmark-dev libbenchmark1debian)

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$debs"
    rm -f "$debs"/*.deb
    (cd "$debs" && apt-get download "${packages[@]}")
    ls -l "$debs"
    exit 0
fi

out="$root/build-gpu/results"
configure_only=0
torch=1
while (($# > 0)); do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --configure-only) configure_only=1; shift ;;
        --no-torch) torch=0; shift ;;
        *) echo "usage: scripts/gpu_check.sh --prepare | [--out OUTDIR] [--configure-only] [--no-torch]" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1

prefix="${TMPDIR:-/tmp}/rpe-gpu-prefix"
shopt -s nullglob
deb_files=("$debs"/*.deb)
if ((${#deb_files[@]} == 0)); then
    echo "gpu_check: no .deb in $debs; run scripts/gpu_check.sh --prepare on a machine with network first" >&2
    exit 2
fi
rm -rf "$prefix"
mkdir -p "$prefix"
for f in "${deb_files[@]}"; do dpkg -x "$f" "$prefix"; done

nvcc_bin="$(command -v nvcc || true)"
[[ -z "$nvcc_bin" && -x /usr/local/cuda/bin/nvcc ]] && nvcc_bin=/usr/local/cuda/bin/nvcc
{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "nvcc: $("$nvcc_bin" --version | tail -n 2 | tr '\n' ' ')"
    echo "host compiler: $(c++ --version | head -n 1)"
    echo "cmake: $(cmake --version | head -n 1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
} | tee "$out/environment.txt"

build="$root/build-gpu"
usr="$prefix/usr"
arch_lib="$(ls -d "$usr"/lib/*-linux-gnu 2>/dev/null | head -n 1)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DCMAKE_CUDA_ARCHITECTURES=90 -DRPE_ENABLE_CUDA=ON \
    -DRPE_BUILD_TESTS=ON -DRPE_BUILD_BENCHMARKS=ON -DRPE_BUILD_EXAMPLES=OFF -DRPE_TEST_OPT=-O1 \
    -DCMAKE_PREFIX_PATH="$usr" \
    -DEigen3_DIR="$usr/share/eigen3/cmake" -Ddoctest_DIR="$usr/lib/cmake/doctest" \
    -Dnlohmann_json_DIR="$usr/share/cmake/nlohmann_json" -Dbenchmark_DIR="$arch_lib/cmake/benchmark" \
    >"$out/configure.log" 2>&1 || { tail -n 40 "$out/configure.log"; exit 1; }
if ((configure_only)); then
    echo "gpu_check: configured $build with the unpacked packages (--configure-only)"
    exit 0
fi
time cmake --build "$build" --target rpe_cuda_tests rpe_cuda_bench -j"$(nproc)" >"$out/build.log" 2>&1 ||
    { grep -E "error|Error" "$out/build.log" | head -n 40; exit 1; }

status=0
"$build/rpe_cuda_tests" --reporters=console --duration=true >"$out/tests.txt" 2>&1 || status=$?
tail -n 25 "$out/tests.txt"
echo "rpe_cuda_tests exit status: $status"
"$build/rpe_cuda_bench" >"$out/bench.txt" 2>&1 || echo "rpe_cuda_bench exit status: $?"
cat "$out/bench.txt"

# rpe_torch's CUDA operators against the machine's own torch (python3; nothing is installed), in
# a build tree of their own so that a torch problem leaves the results above intact.
if ((torch)); then
    py="$(command -v python3 || true)"
    if [[ -n "$py" ]] && "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        echo "torch: $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')" | tee -a "$out/environment.txt"
        tbuild="$root/build-gpu-torch"
        torch_status=0
        {
            cmake -S "$root" -B "$tbuild" -DCMAKE_BUILD_TYPE=Release \
                -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DCMAKE_CUDA_ARCHITECTURES=90 \
                -DRPE_BUILD_TESTS=OFF -DRPE_BUILD_BENCHMARKS=OFF -DRPE_BUILD_EXAMPLES=OFF \
                -DRPE_BUILD_TORCH=ON -DRPE_TORCH_PYTHON="$py" -DRPE_TORCH_CUDA=ON \
                -DCMAKE_PREFIX_PATH="$usr" -DEigen3_DIR="$usr/share/eigen3/cmake" &&
                time cmake --build "$tbuild" --target rpe_torch_ops -j"$(nproc)"
        } >"$out/torch_build.log" 2>&1 || { torch_status=$?; tail -n 40 "$out/torch_build.log"; }
        if ((torch_status == 0)); then
            RPE_TORCH_EXPECT_CUDA=1 RPE_TORCH_OPS="$tbuild/bindings/torch/librpe_torch_ops.so" \
                PYTHONPATH="$root/bindings/torch" \
                "$py" -m pytest -q -rs -p no:cacheprovider "$root/bindings/torch/tests/test_cuda.py" \
                >"$out/torch_cuda.txt" 2>&1 || torch_status=$?
            tail -n 30 "$out/torch_cuda.txt"
        fi
        echo "rpe_torch CUDA tests exit status: $torch_status"
        ((status != 0)) || status=$torch_status
    else
        echo "gpu_check: python3 does not import a CUDA-enabled torch; rpe_torch's CUDA operators not checked"
    fi
fi
exit "$status"
