#!/usr/bin/env bash
# The soak run (not part of CI's budget): 2 ranks, OSS + ShardedDDP on the test model for 20,000
# steps (or $1), a freeze or unfreeze every 500 steps and a checkpoint every 2,000; each rank
# prints its resident memory after warm-up and at its highest since, threads and file
# descriptors then and at the end, and fails if it leaves the all-reduce reference.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$("$root/tools/configure.sh" "$root/build")"
cmake --build "$build" -j 2 --target mp_worker
dir="$(mktemp -d /tmp/shardopt-soak-XXXXXX)"
trap 'rm -rf "$dir"' EXIT
time python3 "$root/tools/launch" -n 2 "$build/tests/mp_worker" soak "${1:-20000}" "$dir"
