#!/usr/bin/env bash
# Runs every test whose ranks run at once, as processes (multiprocess.*, cli.*, resilience.*,
# plan.*) or as threads of one process (the GoogleTest suites), several times in a row under
# `ctest -j 8` (the processor model in tests/CMakeLists.txt), with CPU-bound processes running beside them, and stops at the first failure: the
# proof that they do not depend on an idle machine. (Not the fuzzers, the package build or the
# docs check: no rank waits on another there.)
#
#   tools/stress_tests.sh [BUILD_DIR] [RUNS] [BURNERS] [REGEX]     (defaults: build 5 2, every entry)
#
# REGEX picks the entries (ctest -R), for example to repeat one timed test fifty times.
#
# Prints one line per run (its wall time and result) and exits non-zero on a failed run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
runs="${2:-5}"
burners="${3:-2}"
only=()
[[ -n "${4:-}" ]] && only=(-R "$4")
[[ -f "$build/CTestTestfile.cmake" ]] || { echo "stress_tests: $build is not a build folder (run tools/run_tests.sh first)" >&2; exit 2; }

pids=()
stop_burners() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_burners EXIT
for ((i = 0; i < burners; ++i)); do
  (while :; do :; done) &
  pids+=($!)
done

for ((run = 1; run <= runs; ++run)); do
  log="$build/stress-run-$run.log"
  start=$(date +%s)
  if ctest --test-dir "$build" -j 8 --timeout 600 --output-on-failure -E '^(fuzz|package|docs|readme)\.' "${only[@]}" >"$log" 2>&1; then
    result="passed"
  else
    result="FAILED"
  fi
  summary=$(grep -E "tests passed|tests failed" "$log" | tail -1)
  echo "run $run of $runs with $burners CPU-bound processes beside: $result in $(($(date +%s) - start)) s ($summary); log $log"
  [[ "$result" == "passed" ]] || exit 1
done
