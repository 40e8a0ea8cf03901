#!/usr/bin/env bash
# Runs the suite N times under pytest-xdist to catch flaky ranks, ports and temp-dir collisions.
# Usage: bash ci/repeat.sh [N] [WORKERS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
workers=${2:-4}
for i in $(seq 1 "$runs"); do
  echo "== run $i/$runs (pytest -n $workers) =="
  "${PYTHON:-python3}" -m pytest -n "$workers" -q -p no:cacheprovider
done
