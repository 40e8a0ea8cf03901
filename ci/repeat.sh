#!/usr/bin/env bash
# Runs tests N times under pytest-xdist with CPU hogs beside them, and counts what failed.
#
# A verdict that depends on timing shows up here: the hogs keep every core busy, as on a loaded
# CI machine, so timeouts near the work's duration and races between ranks lose.
#
# Usage: bash ci/repeat.sh [--runs N] [--hogs K] [--workers W] [--suite harness|all] [-- ARGS]
#   --runs N     repeats (default 30)
#   --hogs K     busy-looping processes started beside the tests (default 2: one per core here)
#   --workers W  pytest-xdist workers (default 2, as the README's test command)
#   --suite      harness: tests/harness and tests/test_plugin.py (the harness, plugin and
#                broken-program tests); all: the default suite (-m "not slow") (default harness)
#   ARGS         extra pytest arguments
# Prints one line per run and a summary: runs, failed runs, each failing test with its count,
# the load average seen, and meshsim processes or temp dirs left after the runs.
# Logs: benchmarks/results/repeat-<suite>-<date>/run-<i>.log
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
runs=30 hogs=2 workers=2 suite=harness extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs=$2; shift 2 ;;
        --hogs) hogs=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        --suite) suite=$2; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "unknown argument: $1 (see the usage at the top of $0)" >&2; exit 2 ;;
    esac
done
case "$suite" in
    harness) paths=(tests/harness tests/test_plugin.py) ;;
    all) paths=() ;;
    *) echo "--suite must be harness or all, got $suite" >&2; exit 2 ;;
esac

logs="benchmarks/results/repeat-$suite-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$logs"
# A private temp dir: what the runs leave behind is counted apart from anything else's.
TMPDIR=$(mktemp -d /tmp/repeat-tmp.XXXXXX)
export TMPDIR
hog_pids=()
stop_hogs() { [ ${#hog_pids[@]} -gt 0 ] && kill "${hog_pids[@]}" 2>/dev/null || true; }
trap 'stop_hogs; rm -rf "$TMPDIR"' EXIT
for _ in $(seq 1 "$hogs"); do
    "$PY" -c "while True: pass" &
    hog_pids+=($!)
done

failed_runs=0
loads=()
start=$SECONDS
for i in $(seq 1 "$runs"); do
    log="$logs/run-$i.log"
    t0=$SECONDS
    rc=0
    "$PY" -m pytest -n "$workers" -q -p no:cacheprovider -m "not slow" "${paths[@]}" \
        "${extra[@]}" >"$log" 2>&1 || rc=$?
    load=$(cut -d' ' -f1 /proc/loadavg)
    loads+=("$load")
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$log" | tail -1)
    [ "$rc" -ne 0 ] && failed_runs=$((failed_runs + 1))
    printf 'run %2d/%d: rc=%d %4ds load %s  %s\n' "$i" "$runs" "$rc" $((SECONDS - t0)) "$load" \
        "${summary//=/}"
done
stop_hogs

echo
echo "== $suite suite: $runs runs, $hogs CPU hogs, pytest -n $workers, $((SECONDS - start)) s =="
echo "failed runs: $failed_runs of $runs"
echo "load average (1 min) at the end of each run: min $(printf '%s\n' "${loads[@]}" | sort -n | head -1), max $(printf '%s\n' "${loads[@]}" | sort -n | tail -1)"
echo "failing tests (count):"
cat "$logs"/run-*.log | grep -E '^(FAILED|ERROR) ' | sed 's/ - .*//' | sort | uniq -c | sort -rn \
    || echo "  none"
echo "meshsim processes left: $(pgrep -fc 'meshsim.harness' || true)"
echo "meshsim temp dirs left: $(find "$TMPDIR" -maxdepth 1 -name 'meshsim-*' | wc -l)"
echo "logs: $logs"
[ "$failed_runs" -eq 0 ]
