#!/usr/bin/env bash
# The main job on its embedded default: set up, then verify every layout of every convention
# at world size 8 on the default backends.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
exec meshsim sweep --world-size 8 "$@"
