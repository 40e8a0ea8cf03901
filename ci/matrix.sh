#!/usr/bin/env bash
# Runs the release-dependent tests and the main job on each torch release, one venv per release.
#
# Usage: bash ci/matrix.sh [--strict] [--full | --install-only] [VERSION ...]
#        (default versions: 2.9.1 2.10.0 2.13.0 2.14.1 2.15.0, the supported range; 2.6.0
#        is below the floor and fails at the meshsim install)
#
# --strict: exit 1 when any release fails to install, fails a test or fails the main job (CI's
# compatibility lane runs `bash ci/matrix.sh --strict 2.15.0`); without it the table is the
# result and the exit status is 0.
# --full: the whole default suite (no tests/real) instead of the release-dependent tests.
# --install-only: make each release's venv and install its torch, nothing else (CI starts the
# newest release's multi-GB download this way in the background while the main suite runs).
#
# What runs on each release: the tests listed in ci/release_tests.txt (what depends on the
# release: the harness tiers, torch_private, the model's release rules, live builds and checks,
# the data-flow checks, the plugin; the pure reference, the CLI's reference verbs and the docs
# examples do not import torch and run once, in the README's test command), then the README's
# install lines in the release's venv (ci/install_check.sh: torch kept, no dev tools, a
# downstream test passes), then the main job `meshsim sweep --world-size 8 --communicate 2`,
# which builds every world-8 layout of every convention live on the fake tier and proves a
# sample of each on threaded and gloo.
#
# Each release gets its own venv, .venvs/torch-<version> (MESHSIM_VENVS sets the folder),
# created on first use and reused after. torch is installed first and pinned: meshsim and its
# test extras are installed with a constraint on that exact torch, so pip never swaps it.
# Releases with no CPU wheel on the configured indexes come as the CUDA build (2-5 GB, runs on
# the CPU). A machine-wide pip constraint (a cap such as torch<=2.14.1 in /etc/xdg/pip) is not
# applied inside these venvs: each holds exactly the release asked for, and every install there
# pins torch to it. The real frameworks are not installed (tests/real skips).
# Prints a table (torch, suite, main job, minutes) and saves it with the logs under
# benchmarks/results/matrix-<date>/. MESHSIM_MATRIX_TESTS replaces the test selection (pytest
# paths or -k expressions, e.g. "tests/harness"), for a quick look at one release.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venvs=${MESHSIM_VENVS:-$root/.venvs}
strict=0
full=0
install_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --strict) strict=1 ;;
        --full) full=1 ;;
        --install-only) install_only=1 ;;
        -*) echo "ci/matrix.sh: unknown flag $1 (--strict, --full, --install-only)" >&2; exit 2 ;;
        *) break ;;
    esac
    shift
done
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
    if [ "$install_only" = 1 ]; then
        echo "torch $v installed in $venv ($((SECONDS - start)) s)"
        continue
    fi
    if ! bash ci/install_check.sh "$py" >"$log-install-check.log" 2>&1; then
        rows+=("| $v | the README's install lines failed (see $log-install-check.log) | - | - |")
        failed=1
        continue
    fi
    "$py" -m pip install --quiet --disable-pip-version-check -c <(echo "torch==$v") -e ".[test]" \
        >>"$log-install.log" 2>&1 \
        || { rows+=("| $v | meshsim install failed (see $log-install.log) | - | - |"); failed=1; continue; }
    if [ -n "${MESHSIM_MATRIX_TESTS:-}" ]; then
        read -r -a tests <<<"$MESHSIM_MATRIX_TESTS"
    elif [ "$full" = 1 ]; then
        tests=()
    else
        mapfile -t tests < <(grep -vE '^\s*(#|$)' ci/release_tests.txt)
    fi
    "$py" -m pytest -m "not slow" --ignore=tests/real -n 2 -q -p no:cacheprovider \
        "${tests[@]}" >"$log-suite.log" 2>&1 || failed=1
    main="ok"
    "$venv/bin/meshsim" sweep --world-size 8 --communicate 2 >"$log-main.log" 2>&1 \
        || { main="failed (rc $?)"; failed=1; }
    built=$("$py" -c 'import torch; print(torch.__version__)')
    rows+=("| $built | $(summary "$log-suite.log") | $main | $(((SECONDS - start) / 60)) |")
done

[ "$install_only" = 1 ] && { [ "$failed" = 0 ] || [ "$strict" = 0 ]; exit $?; }
{
    echo "ci/matrix.sh, $(date +%Y-%m-%d), $(nproc) cores"
    echo
    echo "| torch | $([ "$full" = 1 ] && echo "default suite (no tests/real)" || echo "release-dependent tests") | main job | minutes |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$out/table.md"
if [ "$strict" = 1 ] && [ "$failed" = 1 ]; then
    echo "ci/matrix.sh --strict: a release failed (logs under $out)" >&2
    tail -n 30 "$out"/*-suite.log "$out"/*-install-check.log >&2 2>/dev/null || true
    exit 1
fi
