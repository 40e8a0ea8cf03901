#!/usr/bin/env bash
# Kills the test suite with SIGKILL mid-run and counts what it left behind.
#
# A harness must leave no process and no file behind even when its caller dies without any
# chance to clean up. Each trial starts the harness and plugin tests (pytest -n 2) in a private
# temp dir, SIGKILLs the pytest process after a delay, and then counts, every second for up to
# 120 s, which of the processes that pytest had started are still alive; then the temp dirs left,
# and those left after the next meshsim run (which sweeps dirs of dead processes).
#
# Two ways to die: "pytest" SIGKILLs the pytest process only (its xdist workers lose their
# controller); "tree" SIGKILLs it and its xdist workers at once (the processes owning the gloo
# pools: nobody is left to clean up, the pool workers must notice and exit on their own).
#
# Usage: bash ci/orphans.sh [DELAY ...]   (seconds before the kill; default: 15 30 45 60 90)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
delays=("$@")
[ ${#delays[@]} -eq 0 ] && delays=(15 30 45 60 90)

descendants() {  # every process below $1, depth first
    local child
    for child in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

printf '%-6s %-7s %-11s %-9s %-17s %-13s %-11s\n' delay kill "procs@kill" "alive+5s" \
    "all-gone-after" "tmpdirs-left" "after-sweep"
for trial in "${delays[@]/%/:pytest}" "${delays[@]/%/:tree}"; do
    delay=${trial%%:*} mode=${trial##*:}
    tmp=$(mktemp -d /tmp/orphans-tmp.XXXXXX)
    TMPDIR=$tmp "$PY" -m pytest -n 2 -q -p no:cacheprovider -m "not slow" tests/harness \
        tests/test_plugin.py >/dev/null 2>&1 &
    pid=$!
    sleep "$delay"
    mapfile -t procs < <(descendants "$pid")
    if [ "$mode" = tree ]; then
        kill -9 "$pid" $(cat /proc/"$pid"/task/*/children 2>/dev/null) 2>/dev/null || true
    else
        kill -9 "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    alive5="?" gone="not within 120 s"
    for second in $(seq 1 120); do
        sleep 1
        alive=0
        for p in "${procs[@]}"; do [ -d "/proc/$p" ] && alive=$((alive + 1)); done
        [ "$second" -eq 5 ] && alive5=$alive
        if [ "$alive" -eq 0 ]; then gone="${second} s"; [ "$alive5" = "?" ] && alive5=0; break; fi
    done
    left=$(find "$tmp" -maxdepth 1 -name 'meshsim-*' | wc -l)
    TMPDIR=$tmp "$PY" -c "from meshsim.harness import run; run(lambda: 0, 2, 'gloo', timeout=120)" \
        >/dev/null 2>&1
    swept=$(find "$tmp" -maxdepth 1 -name 'meshsim-*' | wc -l)
    printf '%-6s %-7s %-11s %-9s %-17s %-13s %-11s\n' "$delay" "$mode" "${#procs[@]}" "$alive5" \
        "$gone" "$left" "$swept"
    rm -rf "$tmp"
done
