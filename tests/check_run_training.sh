#!/usr/bin/env bash
# tools/run_training.sh runs `shardopt train -n $SHARDOPT_RANKS` with its default options when
# given none, and with the arguments given instead of them (README): run here against stand-ins
# for the configure step, cmake and the tool, each of which says what it was asked.
set -euo pipefail
root="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tools" "$work/bin" "$work/build/apps/shardopt"
cp "$root/tools/run_training.sh" "$work/tools/"
printf '#!/bin/sh\necho "$1"\n' >"$work/tools/configure.sh"
printf '#!/bin/sh\nexit 0\n' >"$work/bin/cmake"
printf '#!/bin/sh\necho "shardopt $*"\n' >"$work/build/apps/shardopt/shardopt"
chmod +x "$work/tools/configure.sh" "$work/bin/cmake" "$work/build/apps/shardopt/shardopt"
expect() {
  local want="$1"; shift
  local got
  got="$(env "$@")"
  [[ "$got" == "$want" ]] || { echo "run_training.sh: expected '$want', got '$got'" >&2; exit 1; }
}
expect "shardopt train -n 2 --freeze conv@3 --unfreeze conv@4 --checkpoint-dir run" \
  -u SHARDOPT_RANKS PATH="$work/bin:$PATH" bash "$work/tools/run_training.sh"
# The README's own example.
expect "shardopt train -n 3 --epochs 3" PATH="$work/bin:$PATH" SHARDOPT_RANKS=3 bash "$work/tools/run_training.sh" --epochs 3
echo "run_training.sh: defaults without arguments, the arguments instead of them"
