#!/usr/bin/env bash
# Installs shardopt from BUILD into a temporary prefix, then configures, builds and runs the
# consumer project beside this script against that prefix only.
set -euo pipefail
build="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d /tmp/shardopt-package-XXXXXX)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > /dev/null
# The tests' view of the insides and the benchmarks' model shapes (models/) are not part of the
# package; the rendezvous store the launcher starts is.
if [[ -e "$work/prefix/include/shardopt/testing" ]]; then
  echo "package: include/shardopt/testing/ was installed" >&2
  exit 1
fi
library="$(find "$work/prefix" -name 'libshardopt.a' | head -1)"
[[ -n "$library" ]] || { echo "package: libshardopt.a was not installed" >&2; exit 1; }
if nm -C "$library" | grep -q 'testing::Introspection'; then
  echo "package: the installed library carries testing::Introspection" >&2
  exit 1
fi
if find "$work/prefix" -name 'gpt2.h' -o -name 'llama.h' | grep -q .; then
  echo "package: models/ (gpt2.h, llama.h) was installed" >&2
  exit 1
fi
[[ -x "$work/prefix/bin/shardopt-store" ]] || { echo "package: bin/shardopt-store was not installed" >&2; exit 1; }
compiler="$(grep -E '^CMAKE_CXX_COMPILER:' "$build/CMakeCache.txt" | cut -d= -f2)"
launcher="$(grep -E '^CMAKE_CXX_COMPILER_LAUNCHER:' "$build/CMakeCache.txt" | cut -d= -f2- || true)"
cmake -S "$here" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_COMPILER="$compiler" ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"} > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/build/consumer" "$work"
"$work/prefix/bin/shardopt-launch" -n 2 --timeout 120 "$work/build/consumer"
"$work/prefix/bin/shardopt" --version
# How the package finds LibTorch (README): through the build's Python environment, which another
# SHARDOPT_PYTHON replaces (a missing one finds nothing), unless Torch_DIR names LibTorch itself.
python="$(grep -E '^SHARDOPT_PYTHON:' "$build/CMakeCache.txt" | cut -d= -f2)"
torch_dir="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch"
configure_only() {
  cmake -S "$here" -B "$work/$1" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER="$compiler" \
        "${@:2}" > "$work/$1.log" 2>&1
}
if configure_only no-python -DSHARDOPT_PYTHON=/nonexistent/python; then
  echo "package: found LibTorch with SHARDOPT_PYTHON pointing nowhere: the override is not what finds it" >&2
  exit 1
fi
configure_only torch-dir -DSHARDOPT_PYTHON=/nonexistent/python -DTorch_DIR="$torch_dir" \
  || { cat "$work/torch-dir.log"; echo "package: Torch_DIR did not find LibTorch" >&2; exit 1; }
