#!/usr/bin/env bash
# Everything that needs a GPU, in one go, with one results file.
#
#   tools/gpu_check.sh pack [BUILD]     on the build machine: puts the CUDA-capable binaries
#                                        (stripped of debug info) and the Fashion-MNIST files
#                                        into BUILD/gpu-pack (default build/gpu-pack), small
#                                        enough to carry to a GPU machine
#   tools/gpu_check.sh [DIR]            on the GPU machine: runs the checks with the binaries of
#                                        DIR (a pack, or a build folder; default build/gpu-pack,
#                                        else build) and writes $OUT/gpu_check.txt (or
#                                        ./gpu_check.txt without $OUT); GPU_CHECK_ONLY=a,b runs
#                                        only the checks of those names (as the results name them)
#
# A GPU machine without the project's build dependencies (GoogleTest, Google Benchmark, CLI11,
# Gloo's headers from Debian) cannot build it; there the binaries come from a pack built on a
# machine that has them (LibTorch's CUDA libraries are linked, and found on the GPU machine
# through its own PyTorch). Where no GPU is visible, it says so and exits 77 without running
# anything.
#
# The checks (each bounded by a timeout; the whole run fits in 8 minutes on an H100):
#   tests       kernels/'s tests (the 8-bit step's among them); Cuda.* and CudaFusedStep.*
#               (shardopt_tests); CudaOverGloo at
#               world 2 and 3 on the one GPU (parity, mixed, resume, the bf16 and int8 wires);
#               `shardopt train --device cuda` through the CLI test
#   benchmarks  GPT-2 small's whole step (OSS against ATen's multi-tensor at::_fused_adamw_, fp32
#               and bf16 parameters with fp32 masters) with its kernel launch count; the fused
#               step on one 100M-element shard, fp32 and on 8-bit moments; staging_bench; Muon + AdamW under OSS on CUDA
#               at world 1 and 2
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
binaries=(tests/shardopt_tests tests/cuda_gloo_worker tests/mp_worker apps/shardopt/shardopt
          kernels/tests/shardopt_kernels_test bench/cuda_step_bench bench/staging_bench bench/muon_step_bench)
data_dir=/usr/share/datasets/fashion-mnist

if [[ "${1:-}" == "pack" ]]; then
  build="${2:-$root/build}"
  pack="$build/gpu-pack"
  rm -rf "$pack"
  for b in "${binaries[@]}"; do
    [[ -x "$build/$b" ]] || { echo "gpu_check: $build/$b is missing: build the project first" >&2; exit 1; }
    mkdir -p "$pack/$(dirname "$b")"
    strip --strip-debug -o "$pack/$b" "$build/$b"
  done
  # The libraries Debian gave the build that a GPU machine's image does not have (Google
  # Benchmark); LibTorch, CUDA and the C library come from the GPU machine itself.
  mkdir -p "$pack/lib"
  for b in "${binaries[@]}"; do
    ldd "$build/$b" | awk '$3 ~ /^\// {print $3}'
  done | sort -u | grep -E '/lib(benchmark|gtest|gmock|fmt)[^/]*$' | while read -r lib; do cp -L "$lib" "$pack/lib/"; done
  mkdir -p "$pack/data"
  cp "$data_dir"/*.gz "$pack/data/"
  echo "gpu_check: packed $(du -sh "$pack" | cut -f1) into $pack; carry it (relative to the repository: ${pack#$root/})"
  exit 0
fi

dir="${1:-}"
if [[ -z "$dir" ]]; then
  for d in "$root/build/gpu-pack" "$root/build"; do [[ -x "$d/tests/shardopt_tests" ]] && { dir="$d"; break; }; done
fi
out="${OUT:-$PWD}"
results="$out/gpu_check.txt"
mkdir -p "$out"
# A Python with PyTorch: $SHARDOPT_PYTHON, else python3 (on the GPU machines, the one with torch).
python="${SHARDOPT_PYTHON:-$(command -v python3)}"

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no GPU is visible (torch.cuda.is_available() is false, or python3 has no torch): nothing run" | tee "$results"
  exit 77
fi
[[ -n "$dir" && -x "$dir/tests/shardopt_tests" ]] || {
  echo "gpu_check: no binaries: give a pack (tools/gpu_check.sh pack, carried) or a build folder" | tee "$results"
  exit 1
}
# Absolute, since some checks run from another folder.
dir="$(cd "$dir" && pwd)"
torch_lib=$("$python" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
cuda_libs=$("$python" - <<'EOF'
import glob, os, site
dirs = set()
for base in site.getsitepackages():
    for lib in glob.glob(os.path.join(base, "nvidia", "**", "libcudart.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
EOF
)
export LD_LIBRARY_PATH="$torch_lib:$cuda_libs:/usr/local/cuda/lib64:$dir/lib:${LD_LIBRARY_PATH:-}"
[[ -d "$dir/data" ]] && export SHARDOPT_DATA="$dir/data"
device=$("$python" -c "import torch; print(torch.cuda.get_device_name(0))")
{
  echo "gpu_check on $device ($(date -u +%Y-%m-%dT%H:%MZ)), binaries from $dir"
  echo "PyTorch $("$python" -c 'import torch; print(torch.__version__)'), $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/driver /')"
} >"$results"

failures=0
# step NAME TIMEOUT_S COMMAND...: runs it, its output to $out/NAME.log, one line in the results.
step() {
  local name="$1" limit="$2"
  shift 2
  if [[ -n "${GPU_CHECK_ONLY:-}" && ",$GPU_CHECK_ONLY," != *",$name,"* ]]; then
    printf '%-28s %-24s\n' "$name" "not run (GPU_CHECK_ONLY)" | tee -a "$results"
    return
  fi
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local code=$?
  local took=$((SECONDS - start))
  local verdict="passed"
  if [[ $code -eq 124 || $code -eq 137 ]]; then verdict="TIMED OUT after ${limit} s"; elif [[ $code -ne 0 ]]; then verdict="FAILED (exit $code)"; fi
  [[ "$verdict" == "passed" ]] || failures=$((failures + 1))
  printf '%-28s %-24s %4d s\n' "$name" "$verdict" "$took" | tee -a "$results"
}

cd "$root"
step kernels_tests 120 "$dir/kernels/tests/shardopt_kernels_test"
step cuda_tests 180 "$dir/tests/shardopt_tests" --gtest_filter='Cuda.*:CudaFusedStep.*'
for run in "2 parity" "3 parity" "2 mixed" "3 resume" "2 wires" "3 wires"; do
  set -- $run
  step "cuda_over_gloo_${2}_$1" 120 "$python" tools/launch -n "$1" "$dir/tests/cuda_gloo_worker" "$2"
done
step cli_cuda 240 env -C tests/apps SHARDOPT_EXE="$dir/apps/shardopt/shardopt" SHARDOPT_TOOLS="$root/tools" \
  "$python" -m unittest test_shardopt_cli.CliTest.test_cuda_trains_freezes_and_resumes_bit_exact
step oss_step_bench 240 "$dir/bench/cuda_step_bench" \
  --benchmark_filter='OssStep|Copy/100000000|AdamWFp32/.*/100000000|AdamW8/.*/100000000' \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_min_time=0.2 \
  --benchmark_out="$out/cuda_step_bench.json" --benchmark_out_format=json
step staging_bench 120 "$dir/bench/staging_bench" --sizes-mib 1,16,64
step muon_cuda_world_1 120 "$python" tools/launch -n 1 "$dir/bench/muon_step_bench" --device cuda
step muon_cuda_world_2 120 "$python" tools/launch -n 2 "$dir/bench/muon_step_bench" --device cuda

{
  echo
  echo "GPT-2 small's whole step (medians of 3; launches per step):"
  grep -E "OssStep/.*_median|Copy/100000000_median|AdamWFp32/.*_median|AdamW8/.*_median" "$out/oss_step_bench.log" 2>/dev/null || true
  echo
  echo "staging_bench:"
  cat "$out/staging_bench.log" 2>/dev/null
  echo
  echo "Muon + AdamW under OSS on CUDA:"
  grep -h '"median_step_ms"' "$out/muon_cuda_world_1.log" "$out/muon_cuda_world_2.log" 2>/dev/null || true
  echo
  echo "$failures check(s) failed"
} >>"$results"
cat "$results"
[[ $failures -eq 0 ]]
