"""`parity ci`: the CI recipe for a user's own repository, as a GitHub Actions workflow or a plain
bash script for any other CI (GitLab, Jenkins, Buildkite) or a laptop.

Both do the same five things: a clone with the whole history (so that the merge base with the
target branch exists), the project's own install (a line the user edits), the harness installed
into that same environment, ``parity check`` of HEAD against that merge base with the user's job
spec, and the report kept (appended to the step summary, uploaded as an artifact). The exit code
is ``parity check``'s, so that 1 only ever means "diverged"; a merge base that cannot be found is
2 (bad input) and an install that fails 3 (nothing could run), never 1.

The templates are plain text with ``@NAME@`` holes, filled with values quoted for bash; nothing
here runs anything.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from parity.record.env import without_git_repository
from parity.spec import JobSpec, SpecError, load_policies, load_read_options, load_spec

DEFAULT_INSTALL = "pip install llm-parity"
DEFAULT_PROJECT_INSTALL = "pip install -e ."
DEFAULT_PYTHON = "3.11"
DEFAULT_SCRIPT_BASE = "origin/main"
REPORT_DIR = "parity-report"
FORMATS = ("github", "script")

_EXIT_LINE = (
    "Exit: 0 aligned, 1 diverged, 2 bad input (the spec, or no merge base), 3 a run failed (or\n"
    "# the install), 5 imprecise, 70 a bug of the harness."
)

GITHUB = """\
# The parity check of this repository: HEAD (a pull request's merge commit) against its merge base
# with the target branch, the job of @SPEC_TEXT@ run on both, each in a temporary git worktree.
# Written by `parity ci`; edit the install steps to your project's. Report: the "parity-report"
# artifact, and report.md in the run's summary.
# @EXIT@
name: parity

on:
  pull_request:
  workflow_dispatch:

jobs:
  parity:
    runs-on: ubuntu-latest
    timeout-minutes: 60
    env:
      OMP_NUM_THREADS: "1"
    steps:
      - name: Check out with the whole history
        uses: actions/checkout@v4
        with:
          fetch-depth: 0  # the merge base with the target branch must be in the clone

      - uses: actions/setup-python@v5
        with:
          python-version: "@PYTHON@"

      - name: Install the project
        run: |
          # EDIT: your project's own install (its torch included)
          @PROJECT_INSTALL@
@HARNESS_STEP@
      - name: Parity check against the merge base
        id: check
@TARGET_ENV@        run: |
          ref=@BASE_REF@
          base="$(git merge-base "$ref" HEAD)" || {
            echo "::error::no merge base of $ref and HEAD (fetch-depth 0?)"; exit 2; }
          echo "base: the merge base of $ref and HEAD, $base"
          code=0
          parity check --base "$base" --spec @SPEC@ --out @OUT@ || code=$?
          echo "exit-code=$code" >> "$GITHUB_OUTPUT"
          exit "$code"

      - name: Step summary
        if: always()
        run: |
          if [ -f @OUT@/report.md ]; then
            cat @OUT@/report.md >> "$GITHUB_STEP_SUMMARY"
          fi

      - name: Upload the report
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: parity-report
          path: @OUT@
          if-no-files-found: ignore
"""

GITHUB_HARNESS_STEP = """
      - name: Install the harness
        run: |
          @INSTALL@
"""

# with no --base: the pull request's target branch, or the default branch on a manual run
GITHUB_TARGET_ENV = """\
        env:
          TARGET: ${{ github.base_ref || github.event.repository.default_branch }}
"""

SCRIPT = """\
#!/usr/bin/env bash
# The parity check of this repository for any CI (GitLab, Jenkins, Buildkite) or by hand: HEAD
# against its merge base with BASE_REF, the job of @SPEC_TEXT@ run on both, each in a temporary
# git worktree (the working tree is never touched). Written by `parity ci --format script`.
# Usage: bash parity-check.sh [BASE_REF]   (default: $PARITY_BASE, else @DEFAULT_BASE_TEXT@)
# The clone needs the history down to the merge base (GitLab: GIT_DEPTH=0; Jenkins: no shallow
# clone). Report: @OUT_TEXT@/ (report.md, report.html); when that folder is there already (a
# second run in the same checkout), a new folder in it named by the time. Nothing is deleted.
# Appends report.md to $GITHUB_STEP_SUMMARY when that is set.
# @EXIT@
set -uo pipefail
cd "$(git rev-parse --show-toplevel)" || exit 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# EDIT: your project's own install (its torch included)
@PROJECT_INSTALL@ || { echo "parity-check: the project's install failed" >&2; exit 3; }
# the harness, into the same environment
@INSTALL@ || { echo "parity-check: the harness's install failed" >&2; exit 3; }

DEFAULT_BASE=@DEFAULT_BASE@
BASE_REF="${1:-${PARITY_BASE:-$DEFAULT_BASE}}"
BASE="$(git merge-base "$BASE_REF" HEAD)" || {
    echo "parity-check: no merge base of $BASE_REF and HEAD (a shallow clone?)" >&2; exit 2; }

# a fresh report folder: parity check never writes into an earlier one
OUT=@OUT@
if [ -e "$OUT" ]; then
    stamp="$(date -u +%Y%m%dT%H%M%SZ)"
    next="$OUT/$stamp" n=1
    while [ -e "$next" ]; do n=$((n + 1)); next="$OUT/$stamp-$n"; done
    OUT="$next"
fi
echo "parity-check: HEAD against $BASE_REF's merge base ${BASE:0:12}; report in $OUT"

status=0
parity check --base "$BASE" --spec @SPEC@ --out "$OUT" || status=$?
if [ -n "${GITHUB_STEP_SUMMARY:-}" ] && [ -f "$OUT/report.md" ]; then
    cat "$OUT/report.md" >> "$GITHUB_STEP_SUMMARY"
fi
echo "parity-check: report $OUT/report.md ($OUT/report.html), exit $status"
exit "$status"
"""


def check_spec(path: Path) -> JobSpec:
    """The spec loaded as `parity spec` loads it (its policies and [read] table too), so that a
    recipe is never printed for a spec `parity check` would refuse in CI."""
    loaded = load_spec(path)
    load_policies(path)
    load_read_options(path)
    if not isinstance(loaded, JobSpec):
        raise SpecError(f"{path}: check runs one job spec on both sides, not an [a]/[b] pair")
    return loaded


def spec_in_repo(path: Path) -> tuple[str, str | None]:
    """The spec's path as CI sees it: relative to the top of the repository that holds it, where
    CI steps run (so `parity ci` may be run from anywhere); with a warning when no repository
    holds it, since a CI checkout would not have it."""
    where = path.parent.resolve() / path.name  # the link itself, where the spec is a link
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=where.parent, capture_output=True,
            text=True, timeout=30, env=without_git_repository(os.environ),
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        top = ""
    if not top:
        return path.as_posix(), f"{path} is in no git repository: CI will not find it"
    try:
        return where.relative_to(Path(top).resolve()).as_posix(), None
    except ValueError:  # a repository's top that git names by another path
        return path.as_posix(), f"{path}: cannot place it in the repository {top}"


def render(
    spec: str,
    fmt: str = "github",
    base: str | None = None,
    install: str = DEFAULT_INSTALL,
    project_install: str = DEFAULT_PROJECT_INSTALL,
    python: str = DEFAULT_PYTHON,
) -> str:
    """The workflow (fmt "github") or bash script (fmt "script") checking ``spec`` (a path
    relative to the repository's top) against the merge base with ``base`` (default: the target
    branch on GitHub, origin/main in the script). An empty ``install`` leaves the harness's
    install out (already in the environment)."""
    if fmt not in FORMATS:
        raise SpecError(f"unknown CI format {fmt!r} (one of {', '.join(FORMATS)})")
    holes = {"@SPEC@": shlex.quote(spec), "@SPEC_TEXT@": spec, "@EXIT@": _EXIT_LINE,
             "@OUT@": REPORT_DIR, "@OUT_TEXT@": REPORT_DIR}  # fmt: skip
    if fmt == "github":
        holes["@PYTHON@"] = python
        holes["@PROJECT_INSTALL@"] = project_install or "true"
        harness = GITHUB_HARNESS_STEP.replace("@INSTALL@", install) if install.strip() else ""
        holes["@HARNESS_STEP@"] = harness
        holes["@TARGET_ENV@"] = "" if base else GITHUB_TARGET_ENV
        holes["@BASE_REF@"] = shlex.quote(base) if base else '"origin/$TARGET"'
        text = GITHUB
    else:
        holes["@PROJECT_INSTALL@"] = project_install.strip() or ":"
        holes["@INSTALL@"] = install.strip() or ": the harness is in this environment already"
        holes["@DEFAULT_BASE@"] = shlex.quote(base or DEFAULT_SCRIPT_BASE)
        holes["@DEFAULT_BASE_TEXT@"] = base or DEFAULT_SCRIPT_BASE
        text = SCRIPT
    for hole, value in holes.items():
        text = text.replace(hole, value)
    return text
