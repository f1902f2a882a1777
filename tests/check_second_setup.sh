#!/usr/bin/env bash
# tools/setup.sh run again where everything it installs is there (as in any build after the
# first): it installs nothing, so its whole output is one line, the virtual environment's path
# (README: "every clone on the machine reuses it; a second run installs nothing").
#
#   bash tests/check_second_setup.sh REPO
set -uo pipefail
out="$(bash "$1/tools/setup.sh" 2>&1)" || { echo "$out"; echo "check_second_setup: tools/setup.sh failed" >&2; exit 1; }
if [[ "$(printf '%s\n' "$out" | wc -l)" -ne 1 || ! -x "$out/bin/python" ]]; then
  printf '%s\n' "$out"
  echo "check_second_setup: a second run of tools/setup.sh did more than name the environment" >&2
  exit 1
fi
echo "check_second_setup: nothing installed; the environment is $out"
