#!/usr/bin/env bash
# ci/parity.yml as a plain script: install, run the multi-rank parity tests, then check HEAD
# against a base revision with the job of ci/pair.toml. Never touches the working tree: each
# revision runs in a temporary git worktree.
# Usage: bash ci/parity-check.sh [BASE_REV]   (default origin/main)
# Env: PYTHON (default python3), PARITY_REPORT_DIR (default parity-report).
# Report: PARITY_REPORT_DIR; when it is there already (an earlier run in this checkout), a new
# folder in it named by the UTC time (printed). Nothing is deleted or overwritten.
# Exit: 0 aligned, 1 diverged, 2 bad input, 3 a run failed or the parity tests failed (pytest's
# own output says which test; its exit code 1 is not passed on, since 1 only means "diverged").
case "${1:-}" in  # -h/--help: the usage above, and nothing else
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
BASE="${1:-origin/main}"
OUT="${PARITY_REPORT_DIR:-parity-report}"
PYTHON="${PYTHON:-python3}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ./worker -e '.[test]'
if ! "$PYTHON" -m pytest -m parity; then
    echo "parity-check: the parity tests failed (above); no check run: exit 3" >&2
    exit 3
fi

# a fresh report folder: parity check never writes into an earlier one
if [ -e "$OUT" ]; then
    stamp="$(date -u +%Y%m%dT%H%M%SZ)"
    next="$OUT/$stamp" n=1
    while [ -e "$next" ]; do n=$((n + 1)); next="$OUT/$stamp-$n"; done
    OUT="$next"
fi
echo "parity-check: HEAD against $BASE; report in $OUT"

status=0
"$PYTHON" -m parity.cli check --base "$BASE" --spec ci/pair.toml --out "$OUT" || status=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$OUT/report.md" ]; then
    cat "$OUT/report.md" >> "$GITHUB_STEP_SUMMARY"
fi
echo "parity report: $OUT/report.html ($OUT/report.md), exit $status"
exit "$status"
