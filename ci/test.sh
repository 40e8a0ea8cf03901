#!/usr/bin/env bash
# The test command: set up, then run the default test suite (what CI runs).
# The real frameworks (OLMo-core, torchtitan, megatron-core, DeepSpeed) are installed too, so
# tests/real/ checks meshsim against their own group construction; if their install fails
# (no network), those tests skip with the reason and the rest still runs.
# Slow tests (full per-framework sweeps, ~6 min) are left out: run them with `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
bash ci/install.sh
if ! bash ci/install_frameworks.sh; then
  echo "WARNING: installing the real frameworks failed; tests/real/ will skip" >&2
fi
exec "$PYTHON" -m pytest -n 2 -q -m "not slow" "$@"
