#!/usr/bin/env bash
# The verl lane: verl 0.9.1 pins transformers<5.11 while the transformers extra is 5.23.0, so
# verl gets its own venv (.venvs/verl-0.9.1, created once, reused). A .pth file lets that venv
# see the main environment (torch 2.13 CPU, meshsim, pytest); what verl pins (transformers,
# tensordict, ray, ...) installs into the venv and shadows the main copies. Torch is never
# replaced: ci/constraints-frameworks.txt pins it. Then the real-verl tests run there.
# Usage: bash ci/verl.sh [pytest args]   (after ci/install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
VENV=${VERL_VENV:-.venvs/verl-0.9.1}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    main_site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$main_site" > "$venv_site/meshsim-main-environment.pth"
fi
start=$SECONDS
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c ci/constraints-frameworks.txt "verl==0.9.1"; then
    echo "WARNING: installing verl failed; tests/real/test_verl.py will skip" >&2
fi
printf 'installed verl in %ds\n' $((SECONDS - start))
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 'torch changed: ' + torch.__version__)"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/real/test_verl.py "$@"
