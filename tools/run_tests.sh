#!/usr/bin/env bash
# Builds shardopt and runs the whole test suite (installs what is missing first).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$("$root/tools/configure.sh" "${1:-$root/build}")"
cmake --build "$build" -j 2
ctest --test-dir "$build" -j 2 --output-on-failure --timeout 600
