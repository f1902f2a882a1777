#!/usr/bin/env bash
# Installs what is missing (tools/setup.sh) and configures the build folder ($1, default build):
# Ninja, clang++ when present (much faster on LibTorch headers than g++), ccache when present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
venv="$("$root/tools/setup.sh" | tail -n 1)"
args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDOPT_PYTHON="$venv/bin/python")
# (Line tables only: backtraces keep their files and lines; full debug info costs about a fifth
# more compile time on LibTorch's headers.)
command -v clang++ >/dev/null && args+=(-DCMAKE_CXX_COMPILER=clang++ "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG")
command -v ccache >/dev/null && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
[ -f "$build/CMakeCache.txt" ] || cmake "${args[@]}" >/dev/null
echo "$build"
