#!/usr/bin/env bash
# AReaL 1.0.4 for tests/real/test_areal.py: it declares torch>=2.9.1,<2.11, so it goes into the
# torch 2.10 environment (.venvs/torch-2.10.0, made by `bash ci/matrix.sh 2.10.0` or here).
# The full dependency set is ~250 packages (ray, litellm, openhands, langchain, ...) and would
# downgrade numpy; the two mesh modules need only these, so areal goes in with --no-deps.
# torch is pinned to 2.10.0 throughout. Then: .venvs/torch-2.10.0/bin/python -m pytest
# tests/real/test_areal.py (and benchmarks/live_counts.py areal-fsdp 8 with that python).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MESHSIM_VENVS:-$PWD/.venvs}/torch-2.10.0
py=$venv/bin/python
if ! "$py" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.10.0"))' 2>/dev/null
then
    MESHSIM_MATRIX_TESTS=tests/model/test_areal_fsdp.py bash ci/matrix.sh 2.10.0
fi
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.10.0" > "$pin"
PIP=("$py" -m pip install --quiet --disable-pip-version-check -c "$pin")
start=$SECONDS
"${PIP[@]}" -e ".[test]"
"${PIP[@]}" --no-deps "areal==1.0.4"
"${PIP[@]}" aiohttp httpx colorlog tenacity flask torchdata lark uvloop pyyaml \
    "hydra-core==1.4.0.dev1" "omegaconf==2.4.0.dev2" "transformers>=5.0.0,<=5.3.0" \
    ray numba pillow orjson einops aiofiles openai
printf 'installed areal 1.0.4 in %ds\n' $((SECONDS - start))
"$py" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.10.0') else 'torch changed: ' + torch.__version__)"
"$py" -c "import areal.engine.fsdp_utils.parallel, areal.experimental.models.archon.parallel_dims"
