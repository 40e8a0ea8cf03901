#!/usr/bin/env bash
# Runs the default suite and the main job on each torch release, one venv per release.
#
# Usage: bash ci/matrix.sh [--strict] [VERSION ...]
#        (default versions: 2.9.1 2.10.0 2.13.0 2.14.1 2.15.0, the supported range; 2.6.0
#        is below the floor and fails at the meshsim install)
#
# --strict: exit 1 when any release fails to install, fails a test or fails the main job (CI's
# compatibility lane runs `bash ci/matrix.sh --strict 2.15.0`); without it the table is the
# result and the exit status is 0.
#
# Each release gets its own venv, .venvs/torch-<version> (MESHSIM_VENVS sets the folder),
# created on first use and reused after. torch is installed first and pinned: meshsim and its
# test extras are installed with a constraint on that exact torch, so pip never swaps it.
# Releases with no CPU wheel on the configured indexes come as the CUDA build (2-5 GB, runs on
# the CPU). A machine-wide pip constraint (a cap such as torch<=2.14.1 in /etc/xdg/pip) is not
# applied inside these venvs: each holds exactly the release asked for, and every install there
# pins torch to it. The real frameworks are not installed (tests/real skips); the suite is the
# README's test command without them, the main job `meshsim sweep --world-size 8 --communicate 2`.
# Prints a table (torch, suite, main job, minutes) and saves it with the logs under
# benchmarks/results/matrix-<date>/. MESHSIM_MATRIX_TESTS narrows the suite (pytest paths or
# -k expressions, e.g. "tests/harness"), for a quick look at one release.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venvs=${MESHSIM_VENVS:-$root/.venvs}
strict=0
if [ "${1:-}" = "--strict" ]; then
    strict=1
    shift
fi
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.9.1 2.10.0 2.13.0 2.14.1 2.15.0)
out="benchmarks/results/matrix-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out" "$venvs"
export PIP_CONSTRAINT=/dev/null  # see above: the venv's own pin on torch is the constraint

summary() {  # the pytest summary line of a log, without the '=' rulers
    grep -E '(passed|failed|error).* in [0-9.]+s' "$1" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//'
}

rows=()
failed=0
for v in "${versions[@]}"; do
    venv="$venvs/torch-$v"
    py="$venv/bin/python"
    log="$out/torch-$v"
    start=$SECONDS
    echo "== torch $v ($venv) =="
    [ -x "$py" ] || python3 -m venv "$venv"
    have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
    if [ "$have" != "$v" ]; then
        # The CPU build where PyTorch's CPU index is reachable; else the configured indexes' build
        # (the CUDA one for most releases: 2-5 GB, runs on the CPU).
        "$py" -m pip install --quiet --disable-pip-version-check --retries 0 --timeout 20 \
            --index-url https://download.pytorch.org/whl/cpu "torch==$v" >"$log-install.log" 2>&1 \
            || "$py" -m pip install --quiet --disable-pip-version-check "torch==$v" \
                >>"$log-install.log" 2>&1 \
            || { rows+=("| $v | install failed (see $log-install.log) | - | - |"); failed=1; continue; }
    fi
    "$py" -m pip install --quiet --disable-pip-version-check -c <(echo "torch==$v") -e ".[test]" \
        >>"$log-install.log" 2>&1 \
        || { rows+=("| $v | meshsim install failed (see $log-install.log) | - | - |"); failed=1; continue; }
    # shellcheck disable=SC2086 - MESHSIM_MATRIX_TESTS is a list of pytest arguments
    "$py" -m pytest -m "not slow" --ignore=tests/real -n 2 -q -p no:cacheprovider \
        ${MESHSIM_MATRIX_TESTS:-} >"$log-suite.log" 2>&1 || failed=1
    main="ok"
    "$venv/bin/meshsim" sweep --world-size 8 --communicate 2 >"$log-main.log" 2>&1 \
        || { main="failed (rc $?)"; failed=1; }
    built=$("$py" -c 'import torch; print(torch.__version__)')
    rows+=("| $built | $(summary "$log-suite.log") | $main | $(((SECONDS - start) / 60)) |")
done

{
    echo "ci/matrix.sh, $(date +%Y-%m-%d), $(nproc) cores"
    echo
    echo "| torch | default suite (no tests/real) | main job | minutes |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$out/table.md"
if [ "$strict" = 1 ] && [ "$failed" = 1 ]; then
    echo "ci/matrix.sh --strict: a release failed (logs under $out)" >&2
    tail -n 30 "$out"/*-suite.log >&2 || true
    exit 1
fi
