#!/usr/bin/env bash
# The README's test command: make a venv from the project's own files, then run every test
# (fast unit tests on both cores, then the multi-rank `parity` ones). Usage: bash ci/test.sh
# [pytest args...] (a path, -k or -m given: one pytest run of just that)
# (-h or --help first: this text, and nothing else; pytest's own help: .venv/bin/pytest --help)
case "${1:-}" in  # -h/--help: the usage above, and nothing else
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PARITY_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# the harness (light: no torch) with its test tools and the log writers the readers' tests use,
# and the reference subject (worker/, its own distribution, with the pins the goldens need)
install() {
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        -e './worker' -e '.[dev,test,writers]'
}
# pip retries a dropped connection but not a download that arrives damaged (a hash mismatch);
# one more try, past pip's cache, tells a passing network fault from a real install error
if ! install; then
    echo "ci/test.sh: install failed; trying once more without pip's cache" >&2
    install --no-cache-dir
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/python" -m ruff check worker parity subjects tests benchmarks ci
"$VENV/bin/python" -m ruff format --check --quiet worker parity subjects tests benchmarks ci
# With no test selected by the caller (no path, -k or -m: CI's run), three passes: the fast tests
# on both cores (pytest-xdist: they are one process each), the multi-rank `parity` ones two at a
# time (a launch leaves a core idle while it starts, waits on pip, git, Ray or a rendezvous; a
# file's tests on one worker, so that its fixtures are made once), then the `serial` ones, which
# time a job (a stall, a timeout, a signal), with nothing beside them (tests/conftest.py); all
# run, and any failing fails the run.
for arg in "$@"; do
    case "$arg" in
        -k | -m | -k* | -m* | -n | -n* | -p | -p* | [!-]*) exec "$VENV/bin/python" -m pytest "$@" ;;
    esac
done
fast=0
shared=0
"$VENV/bin/python" -m pytest -m "not parity" -n 2 "$@" || fast=$?
"$VENV/bin/python" -m pytest -m "parity and not serial" -n 2 --dist loadfile "$@" || shared=$?
"$VENV/bin/python" -m pytest -m "parity and serial" "$@" || exit $?
[ "$shared" -eq 0 ] || exit "$shared"
exit "$fast"
