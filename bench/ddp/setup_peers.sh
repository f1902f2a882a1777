#!/usr/bin/env bash
# Installs what the data-parallel comparison's peers need beyond the torch wheel: fairscale 0.4.13
# from PyPI (without dependencies: it runs on the environment's torch as it is).
#   bash bench/ddp/setup_peers.sh [PYTHON]   (default: the environment tools/setup.sh made)
set -euo pipefail
PYTHON=${1:-$HOME/.cache/shardopt/venv-torch-2.11.0/bin/python}
"$PYTHON" -m pip install --quiet --no-deps fairscale==0.4.13
"$PYTHON" -c "import fairscale; print('fairscale', fairscale.__version__, 'in', '$PYTHON')"
