#!/usr/bin/env bash
# Installs what shardopt needs when it is missing, and prints nothing else on a second run.
#   - Debian packages: compilers' helpers, Gloo headers, GoogleTest, Benchmark, the dataset.
#   - The PyTorch wheel (LibTorch + its Python side) and matplotlib from PyPI, into a virtual environment kept
#     under ${SHARDOPT_CACHE:-~/.cache/shardopt}, keyed by the pinned version, so that every clone
#     on this machine reuses it.
# Prints the path of the virtual environment on its last line.
set -euo pipefail

TORCH_VERSION="${SHARDOPT_TORCH_VERSION:-2.11.0}"
CACHE="${SHARDOPT_CACHE:-$HOME/.cache/shardopt}"
VENV="${SHARDOPT_VENV:-$CACHE/venv-torch-$TORCH_VERSION}"

apt_packages=(cmake ninja-build ccache clang g++ zlib1g-dev libgloo-dev libgtest-dev libgmock-dev
              libbenchmark-dev libcli11-dev nlohmann-json3-dev libclang-rt-dev dataset-fashion-mnist
              python3-venv)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q >&2 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" >&2
fi

# The venv is complete only once the marker exists: an interrupted install is redone.
if [ ! -f "$VENV/.shardopt-complete" ]; then
  echo "setup: installing torch==$TORCH_VERSION into $VENV (several GB, once per machine)" >&2
  mkdir -p "$CACHE"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy >&2
  touch "$VENV/.shardopt-complete"
fi
# torchao: the reference 8-bit optimizer state is tested against (tests/python/state_codes_reference.py).
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchao') is None)" 2>/dev/null; then
  echo "setup: installing torchao into $VENV" >&2
  "$VENV/bin/pip" install -q "torchao==0.18.0" >&2
fi
# matplotlib draws `shardopt memory`'s chart.
if ! "$VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  echo "setup: installing matplotlib into $VENV" >&2
  "$VENV/bin/pip" install -q matplotlib >&2
fi
echo "$VENV"
