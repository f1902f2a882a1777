#!/bin/sh
# cuda_over_gloo.sh PYTHON LAUNCH WORKER N MODE: N ranks of cuda_gloo_worker MODE under tools/launch,
# all on the one GPU. Exits 77 (ctest: skipped) where no CUDA device is visible.
"$3" probe >/dev/null 2>&1 </dev/null
[ $? -eq 77 ] && { echo "no CUDA device visible: not run"; exit 77; }
exec "$1" "$2" -n "$4" "$3" "$5"
