#!/usr/bin/env bash
# ci/parity.yml as a plain script: install, run the multi-rank parity tests, then check HEAD
# against a base revision with the job of ci/pair.toml. Never touches the working tree: each
# revision runs in a temporary git worktree.
# Usage: bash ci/parity-check.sh [BASE_REV]   (default origin/main)
# Env: PYTHON (default python3), PARITY_REPORT_DIR (default parity-report).
# Exit: 0 aligned, 1 diverged, 2 bad input, 3 a run failed (or pytest's code if the tests fail).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE="${1:-origin/main}"
OUT="${PARITY_REPORT_DIR:-parity-report}"
PYTHON="${PYTHON:-python3}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ./worker -e '.[test]'
"$PYTHON" -m pytest -m parity

status=0
"$PYTHON" -m parity.cli check --base "$BASE" --spec ci/pair.toml --out "$OUT" || status=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$OUT/report.md" ]; then
    cat "$OUT/report.md" >> "$GITHUB_STEP_SUMMARY"
fi
echo "parity report: $OUT/report.html ($OUT/report.md), exit $status"
exit "$status"
