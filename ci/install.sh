#!/usr/bin/env bash
# Installs meshsim and its test tools on a fresh machine.
# torch is pinned to the local CPU build first: an unpinned torch would pull GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
