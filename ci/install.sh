#!/usr/bin/env bash
# Installs meshsim and its test tools on a fresh machine: a CPU torch first (ci/install_torch.sh
# keeps pip from pulling the CUDA build and its GBs of nvidia packages), then the project.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
PY=$PYTHON
bash ci/install_torch.sh
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
