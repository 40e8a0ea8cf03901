#!/usr/bin/env bash
# Installs the real frameworks behind meshsim[olmo-core|torchtitan|megatron|deepspeed|accelerate|
# transformers|lightning] so tests/real/ runs their own group-construction code, timing each.
# Run after ci/install.sh (torch 2.13.0 CPU must already be installed): every install is
# constrained by ci/constraints-frameworks.txt so no framework pulls another torch.
# Usage: bash ci/install_frameworks.sh [olmo-core torchtitan megatron deepspeed]
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
PY=$PYTHON
CONSTRAINTS="$PWD/ci/constraints-frameworks.txt"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")

# DeepSpeed's setup.py imports torch, so it must build against the installed torch
# (--no-build-isolation), and DS_BUILD_OPS=0 skips compiling its C++/CUDA ops at install time
# (none are needed to build groups). Its build backend needs these present first.
DEEPSPEED_BUILD_DEPS=(setuptools wheel ninja packaging py-cpuinfo hjson psutil)

install() {
    local name=$1
    local start=$SECONDS
    case "$name" in
        olmo-core) "${PIP[@]}" "ai2-olmo-core==3.0.0" ;;
        torchtitan) "${PIP[@]}" "torchtitan==0.3.0" ;;
        # megatron-core's wheel declares no dependencies; hierarchical CP groups need einops.
        megatron) "${PIP[@]}" "megatron-core==0.16.1" einops ;;
        deepspeed)
            "${PIP[@]}" "${DEEPSPEED_BUILD_DEPS[@]}"
            DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed==0.19.8"
            ;;
        accelerate) "${PIP[@]}" "accelerate==1.15.0" ;;
        transformers) "${PIP[@]}" "transformers==5.23.0" "accelerate==1.15.0" ;;
        lightning) "${PIP[@]}" "lightning==2.6.6" ;;
        *) echo "unknown framework: $name (olmo-core, torchtitan, megatron, deepspeed," \
                "accelerate, transformers, lightning)" >&2
           return 2 ;;
    esac
    printf 'installed %-11s in %4ds\n' "$name" $((SECONDS - start))
}

total=$SECONDS
frameworks=("$@")
[ ${#frameworks[@]} -eq 0 ] && frameworks=(
    olmo-core torchtitan megatron deepspeed accelerate transformers lightning
)
for framework in "${frameworks[@]}"; do
    install "$framework"
done
printf 'installed %d framework(s) in %ds\n' ${#frameworks[@]} $((SECONDS - total))
"$PY" - <<'PY'
import importlib.metadata as md

for dist in ("torch", "ai2-olmo-core", "torchtitan", "megatron-core", "deepspeed", "accelerate",
             "transformers", "lightning"):
    try:
        print(f"  {dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist}: not installed")
PY
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 'torch changed: ' + torch.__version__)"
