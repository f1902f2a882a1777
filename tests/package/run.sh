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
