#!/usr/bin/env bash
# The main job: set up, then verify every world-8 layout of every convention on the fake tier
# and prove an evenly spaced sample of each convention by real communication (threaded and gloo
# all-gathers), cross-checking that every tier observes the same groups. Extra flags go to
# `meshsim sweep` (e.g. --communicate 8, --junit-xml out.xml, --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
bash ci/install.sh
exec "$PYTHON" -m meshsim sweep --world-size 8 --communicate 4 "$@"
