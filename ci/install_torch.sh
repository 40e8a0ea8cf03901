#!/usr/bin/env bash
# Installs a CPU build of torch, on this machine and on any ordinary Linux machine.
#
# Why a script: on Linux `pip install torch==2.13.0` resolves to PyPI's CUDA build, which pulls
# several GB of nvidia-* wheels that a CPU-only test run never uses. PyTorch's own CPU index
# serves the same release without them, so we ask it first. Where that index is unreachable
# (offline from PyTorch, e.g. a machine that reaches only a PyPI mirror or local wheels), the
# plain spec is used, but only after a dry run proves it resolves to a CPU build; otherwise we
# stop with a message instead of downloading the CUDA stack.
#
# Settings (environment):
#   MESHSIM_TORCH        the requirement (default: torch==2.13.0)
#   MESHSIM_TORCH_INDEX  the index to ask first (default: PyTorch's CPU index); setting it to a
#                        CUDA index (e.g. https://download.pytorch.org/whl/cu128) is how a GPU
#                        machine gets an NCCL-capable torch: the CPU-only check is then skipped.
#   PYTHON               the interpreter (default: python3)
# Usage: bash ci/install_torch.sh [--dry-run]   (--dry-run: resolve and report, install nothing)
# Exit status: 0 done (or resolvable), 1 only a CUDA build is offered, 3 no index is reachable or
# offers the release (an offline machine: install torch first, and this script keeps it).
set -euo pipefail
PY=${PYTHON:-python3}
SPEC=${MESHSIM_TORCH:-torch==2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
INDEX=${MESHSIM_TORCH_INDEX:-$CPU_INDEX}
REQUIRE_CPU=1
[ -n "${MESHSIM_TORCH_INDEX:-}" ] && [ "$MESHSIM_TORCH_INDEX" != "$CPU_INDEX" ] && REQUIRE_CPU=0
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --retries 1 --timeout 30)

installed_matches() {
    # True when the installed torch satisfies SPEC (and is a CPU build when one is required).
    "$PY" - "$SPEC" "$REQUIRE_CPU" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

spec, require_cpu = Requirement(sys.argv[1]), sys.argv[2] == "1"
have = version("torch")
ok = spec.specifier.contains(have.split("+")[0], prereleases=True)
sys.exit(0 if ok and (not require_cpu or "+cu" not in have) else 1)
PY
}

# Resolves SPEC with the given extra pip arguments, installing nothing; prints what pip would
# install and fails when that includes CUDA packages (while a CPU build is required).
resolve() {
    local report
    report=$(mktemp)
    trap 'rm -f "$report"' RETURN
    "${PIP[@]}" --dry-run --ignore-installed --report "$report" "$@" "$SPEC" 2>/dev/null || return 2
    "$PY" - "$report" "$REQUIRE_CPU" <<'PY'
import json, sys

report, require_cpu = json.load(open(sys.argv[1])), sys.argv[2] == "1"
names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
cuda = sorted(n for n in names if n.startswith("nvidia-") or n == "triton")
torch = names.get("torch", "?")
print(f"  resolves to torch {torch}" + (f" + {len(cuda)} CUDA packages" if cuda else " (CPU)"))
sys.exit(1 if require_cpu and (cuda or "+cu" in torch) else 0)
PY
}

if [ "$DRY_RUN" = 0 ] && installed_matches; then
    echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
    exit 0
fi

# Ask the chosen index first; fall back to the configured indexes (PyPI, mirrors, find-links).
found=()  # what each index said: "unreachable" (pip could not resolve there) or "CUDA"
for source in index default; do
    if [ "$source" = index ]; then args=(--index-url "$INDEX"); else args=(); fi
    echo "resolving $SPEC from ${args[1]:-the default indexes}"
    status=0
    resolve "${args[@]}" || status=$?
    if [ "$status" = 2 ]; then
        echo "  unreachable, or it offers no $SPEC"
        found+=(unreachable)
    elif [ "$status" != 0 ]; then
        found+=(CUDA)
    else
        [ "$DRY_RUN" = 1 ] && exit 0
        "${PIP[@]}" "${args[@]}" "$SPEC"
        if [ "$REQUIRE_CPU" = 1 ]; then
            "$PY" -c "import torch, sys; sys.exit(torch.version.cuda and 'installed a CUDA torch')"
        fi
        echo "installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
        exit 0
    fi
done
if [ "${found[*]}" = "unreachable unreachable" ]; then
    echo "error: no package index offers $SPEC: $INDEX and the default indexes are unreachable" \
         "from this machine or lack that release. Set MESHSIM_TORCH_INDEX to a reachable index," \
         "or install torch yourself first (this script keeps a matching one)." >&2
    exit 3
fi
echo "error: no index offers $SPEC as a CPU build ($INDEX: ${found[0]}; the default indexes:" \
     "${found[1]}, where CUDA means they would install CUDA packages). Set MESHSIM_TORCH_INDEX" \
     "to a reachable index (a CPU mirror), or to a CUDA index if you want the CUDA build." >&2
exit 1
