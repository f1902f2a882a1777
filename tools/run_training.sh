#!/usr/bin/env bash
# Builds shardopt and trains on Fashion-MNIST with OSS on N ranks (default 2) through the
# launcher; extra arguments go to the training program (e.g. --epochs 3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${SHARDOPT_RANKS:-2}"
build="$("$root/tools/configure.sh" "$root/build")"
cmake --build "$build" -j 2 --target train_fashion_mnist
exec python3 "$root/tools/launch" -n "$ranks" "$build/train_fashion_mnist" "$@"
