#!/usr/bin/env bash
# The test command: set up, then run the default test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
exec "${PYTHON:-python3}" -m pytest -n 2 -q "$@"
