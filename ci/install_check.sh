#!/usr/bin/env bash
# Runs the README's install lines verbatim in a venv that already holds a torch (the user's),
# then a downstream test on the installed plugin: the checkout line, then the wheel line. Fails
# when a line does not install, when pip swapped the torch, when the `suite` extra pulled
# meshsim's own development tools, or when the downstream test fails. Only the placeholders
# change: /path/to/meshsim becomes this checkout, dist/ a wheel built from it. meshsim is
# uninstalled from the venv afterwards; the wheel lives in a temporary directory.
#
# Usage: bash ci/install_check.sh [VENV_PYTHON]
#   VENV_PYTHON: a venv's interpreter holding torch (CI passes the torch 2.15 lane's fresh venv,
#   before meshsim's test extras go in). Without it, a throwaway venv gets ci/install_torch.sh's
#   torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source ci/python.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

if [ -n "${1:-}" ]; then
    py=$1
    venv_bin=$(dirname "$py")
else
    "$PYTHON" -m venv "$work/venv"
    py="$work/venv/bin/python"
    venv_bin="$work/venv/bin"
    PYTHON="$py" bash ci/install_torch.sh >/dev/null
fi
"$py" -m pip uninstall --quiet --yes meshsim >/dev/null 2>&1 || true
torch_before=$("$py" -c 'import torch; print(torch.__version__)')
tools_before=$("$py" -m pip list --format=freeze 2>/dev/null | grep -ciE '^(hypothesis|ruff)==' || true)
venv_site=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

# The README's fenced block after the install_check marker (Getting started must show the same
# block): one command per logical line.
"$PYTHON" - "$root/README.md" "$root/docs/getting-started.md" >"$work/lines.sh" <<'PY'
import re, sys
blocks = [
    re.search(r"ci/install_check\.sh\) -->\n```bash\n(.*?)```", open(p).read(), re.S)
    for p in sys.argv[1:]
]
if None in blocks or len({b.group(1) for b in blocks}) != 1:
    sys.exit("the install block of README.md and docs/getting-started.md must be one and the same")
block = blocks[0].group(1)
commands = [c for c in block.replace("\\\n", " ").splitlines() if c and not c.startswith("#")]
if len(commands) != 2:
    sys.exit(f"expected the checkout line and the wheel line in the README, found {commands}")
print("\n".join(commands))
PY
"$py" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$work/dist" "$root" >/dev/null

cat >"$work/test_downstream.py" <<'PY'
import pytest

import meshsim


@pytest.mark.meshsim(world_size=4, backend="threaded")
@pytest.mark.meshsim_layout("torch", mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
def test_mesh(rank, world_size, meshsim_expected):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshsim.assert_layout(meshsim.observe(mesh), meshsim_expected)
PY

check() {  # $1: which line; the installed meshsim must come from where the line says
    local where
    where=$(cd "$work" && "$py" -c 'import meshsim; print(meshsim.__file__)')
    case "$1:$where" in
        checkout:"$root"/*|wheel:"$venv_site"/*) ;;
        *) echo "install_check: the $1 line installed meshsim at $where" >&2; exit 1 ;;
    esac
    [ "$("$py" -c 'import torch; print(torch.__version__)')" = "$torch_before" ] \
        || { echo "install_check: the $1 line swapped torch $torch_before" >&2; exit 1; }
    local tools
    tools=$("$py" -m pip list --format=freeze 2>/dev/null | grep -ciE '^(hypothesis|ruff)==' || true)
    [ "$tools" = "$tools_before" ] \
        || { echo "install_check: the $1 line installed meshsim's dev tools (hypothesis, ruff)" >&2
             exit 1; }
    (cd "$work" && "$py" -m pytest -q -p no:cacheprovider test_downstream.py)
}

n=0
while IFS= read -r line; do
    n=$((n + 1))
    which=$([ $n = 1 ] && echo checkout || echo wheel)
    line=${line//\/path\/to\/meshsim/$root}
    line=${line//dist\//$work/dist/}
    echo "install_check: $which line"
    (cd "$work" && PATH="$venv_bin:$PATH" bash -c "$line" >/dev/null)
    check "$which"
    "$py" -m pip uninstall --quiet --yes meshsim
done <"$work/lines.sh"
echo "install_check: both README install lines work next to torch $torch_before" \
     "($((SECONDS - start)) s)"
