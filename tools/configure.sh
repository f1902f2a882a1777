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
# ccache with the precompiled headers: it caches a file compiled against one only when told that
# the header's defines and timestamps may be ignored (its contents are still hashed) and clang
# leaves the timestamp out of the header (CMakeLists.txt); otherwise nearly every file is
# "uncacheable" and each fresh clone compiles everything again.
cache="CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
command -v ccache >/dev/null && args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=env;$cache;ccache"
                                      "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
[ -f "$build/CMakeCache.txt" ] || cmake "${args[@]}" >/dev/null
echo "$build"
