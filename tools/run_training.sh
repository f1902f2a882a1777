#!/usr/bin/env bash
# Builds shardopt and runs its main job: `shardopt train` on Fashion-MNIST with 2 local ranks
# (SHARDOPT_RANKS to change), the convolutional layers frozen for epoch 3, a checkpoint in
# ./run after every epoch, and the memory each rank holds at the end. Arguments replace the
# default ones (see `shardopt train --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks="${SHARDOPT_RANKS:-2}"
build="$("$root/tools/configure.sh" "$root/build")"
cmake --build "$build" -j 2 --target shardopt_cli
if [ $# -eq 0 ]; then
  set -- --freeze conv@3 --unfreeze conv@4 --checkpoint-dir run
fi
exec "$build/apps/shardopt/shardopt" train -n "$ranks" "$@"
