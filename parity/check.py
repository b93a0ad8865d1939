"""Pre-merge refactor check: one job spec run on two git revisions, or against a golden file.

The user's working tree, index, branches and HEAD are never touched: each revision is checked
out with ``git worktree add --detach`` into a temp folder, which is removed and pruned again
whatever happens. The job runs with cwd and PYTHONPATH at that folder, so ``-m pkg`` and script
paths resolve to the revision's own code, not to the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.carry import Carry, CarryItem, carry_items
from parity.errors import InputError
from parity.files import launch_dir
from parity.judge.compare import Comparison, Policy
from parity.judge.diagnose import Diagnosis
from parity.outdir import OutDir, write_json_new
from parity.pair import (
    teardown_line,
    teardown_notes,
    teardown_verdict,
    topology_notes,
    write_failed,
)
from parity.readers import (
    MetricsError,
    SkippedRecordsError,
    read_metrics,
    read_summary,
    skipped_count,
)
from parity.record.runfolder import metrics_path
from parity.report import Report, build_report
from parity.run.job import detected, holding, launch_spec, mark_teardown, no_run_line
from parity.run.launch import LaunchError, LaunchResult
from parity.run.signals import deferred
from parity.spec import READ_OPTIONS, JobSpec

__all__ = [
    "CheckResult",
    "RevisionError",
    "check_golden",
    "check_revisions",
    "resolve_revision",
    "run_in_tree",
    "worktree",
]


class RevisionError(InputError):
    """A git command that failed (not a repo, unknown revision); the message is one line."""


@dataclass
class CheckResult:
    comparison: Comparison
    report: Path  # report.md; report.html lies next to it
    a_dir: Path
    b_dir: Path
    a_rev: str | None  # commit ids; None for the golden file / the current tree
    b_rev: str | None
    teardown: list[tuple[str, LaunchResult]] = field(default_factory=list)  # (side, launch)
    allow_teardown_failure: bool = False
    diagnosis: Diagnosis | None = None  # parity.judge.diagnose, computed once, for the report
    carried: list[dict[str, Any]] = field(default_factory=list)  # parity.carry: path, size, sha256

    @property
    def verdict(self) -> str:
        """The metrics verdict, but "failed" after a teardown failure unless that is allowed."""
        return teardown_verdict(self.teardown, self.allow_teardown_failure, self.comparison)

    def teardown_line(self) -> str:
        return teardown_line(self.teardown, self.comparison)


def git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS`` output; RevisionError with git's own message when it fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
            start_new_session=True,  # a terminal's Ctrl-C reaches us (parity.run.signals), not git
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RevisionError(f"git {args[0]}: {e}") from None
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        raise RevisionError(f"git {' '.join(args)}: {lines[-1] if lines else 'failed'}")
    return out.stdout.strip()


def repo_root(path: Path) -> Path:
    return Path(git(path, "rev-parse", "--show-toplevel"))


def resolve_revision(repo: Path, rev: str) -> str:
    """The commit id of ``rev``; ``--end-of-options`` keeps a rev like ``--foo`` a rev. An
    unknown one in a shallow clone (CI's default checkout) says so: it may well exist, in the
    history the clone did not fetch."""
    try:
        return git(repo, "rev-parse", "--verify", "-q", "--end-of-options", f"{rev}^{{commit}}")
    except RevisionError:
        pass
    hint = ""
    try:
        if git(repo, "rev-parse", "--is-shallow-repository") == "true":
            hint = " (this is a shallow clone: fetch more history, e.g. git fetch --unshallow)"
    except RevisionError:
        pass
    raise RevisionError(f"{repo}: unknown git revision {rev!r}{hint}")


@contextmanager
def worktree(repo: Path, commit: str, parent: Path | None = None) -> Iterator[Path]:
    """A detached checkout of ``commit`` in a temp folder (in ``parent``: a Slurm launcher's
    folder on the file system the nodes share; default the system's temp folder), removed and
    pruned on exit.

    A signal (parity.run.signals: SIGINT, SIGTERM, SIGHUP) waits while the worktree is added or
    removed: git killed half-way through `worktree add` leaves it registered and locked.
    """
    tmp = None
    try:
        with deferred():
            tmp = Path(tempfile.mkdtemp(prefix="parity-worktree-", dir=parent))
            path = tmp / commit[:12]
            hooks_off = ("-c", "core.hooksPath=/dev/null")  # a post-checkout hook could touch it
            git(repo, *hooks_off, "worktree", "add", "--detach", "--quiet", str(path), commit)
        _TEMPORARY[path] = repo
        yield path
    finally:  # cleanup errors must not hide the error that brought us here
        if tmp is not None:
            _TEMPORARY.pop(tmp / commit[:12], None)
            with deferred():
                _remove_worktree(repo, tmp, tmp / commit[:12])


#: the temporary worktrees that exist now (``worktree``), each with its repository: a run in
#: one records how to make it again (``origin``), since it is gone once the run is reported
_TEMPORARY: dict[Path, Path] = {}


def origin(tree: Path, carry: Carry | None = None) -> dict[str, Any]:
    """What the report needs to rerun a job that ran in ``tree`` once that is gone: for one of
    ``worktree``'s temporary worktrees, its repository, the commit checked out there now (bisect
    moves it) and its path (named in the job's command), and the inputs carried into it (where
    from, which paths: the rerun's worktree needs them too); {} for any other folder."""
    repo = _TEMPORARY.get(tree)
    if repo is None:
        return {}
    commit = git(tree, "rev-parse", "HEAD")
    made = {"repo": str(repo), "commit": commit, "path": str(tree)}
    if carry:
        made["carry"] = {"from": str(carry.root), "paths": [item.path for item in carry.items]}
    return {"worktree": made}


def _remove_worktree(repo: Path, tmp: Path, path: Path) -> None:
    if path.exists():
        _git_unchecked(repo, "worktree", "remove", "--force", str(path))
    shutil.rmtree(tmp, ignore_errors=True)
    _git_unchecked(repo, "worktree", "prune")


def _git_unchecked(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # not stopped half-way by a terminal's Ctrl-C
    )


def run_in_tree(
    spec: JobSpec,
    tree: Path,
    run_dir: Path,
    allow_teardown: bool = False,
    label: str | None = None,
    carry: Carry | None = None,
    read: Mapping[str, Any] | None = None,
) -> LaunchResult:
    """Run ``spec`` under torchrun with cwd and PYTHONPATH at ``tree``; raise LaunchError.

    run_dir is made new (parity.run.job.launch_spec: one already there is refused, never
    removed, so nothing an earlier run left is read as this run's). allow_teardown: a run that
    failed only at teardown (complete metrics, see `mark_teardown`) is returned, not ok and with its
    reason, for the caller to compare and report. carry: the inputs copied into ``tree``
    (parity.carry); a run that changed them failed, whatever its exit. read: how the run is
    read (spec.READ_OPTIONS, the spec's `[read]`): a run that only its named format reads is
    a run, not "nothing readable".
    """
    run_dir = Path(run_dir).resolve()  # the job's cwd is elsewhere
    label = label or run_dir.name
    paths = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    result = launch_spec(spec, run_dir, label, cwd=tree, env=env, origin=origin(tree, carry))
    if not result.ok:
        whole = mark_teardown(result, metrics_path(run_dir), result.started_at) is not None
        if not (whole and allow_teardown):  # reason: teardown-* or crash
            _hint_carry(result, tree, carry)
            raise LaunchError(result, label)
    elif not _readable(run_dir, read):
        result.set_fault("no-output", no_run_line(run_dir))
        raise LaunchError(result, label)
    if carry is not None and (changed := carry.changed(tree)):
        result.set_fault("carried-input", changed)
        raise LaunchError(result, label)
    return result


def _readable(run_dir: Path, read: Mapping[str, Any] | None) -> bool:
    """Whether ``run_dir`` holds a run to compare: one some format claims, or one the `[read]`
    format reads (a format that is not detected, a plugin's that claims nothing, must be named
    and is then read as named)."""
    if detected(run_dir):
        return True  # a run the named format cannot read: the comparison says why, naming it
    options = {**READ_OPTIONS, **(read or {})}
    if options["format"] is None:
        return False
    try:
        read_metrics(run_dir, options["format"], run=options["run"], duplicates="last")
    except MetricsError:
        return False
    return True


def _hint_carry(result: LaunchResult, tree: Path, carry: Carry | None) -> None:
    """A crash on a file the checkout has but git does not track: say to carry it."""
    logs = "\n".join(f.log_tail for f in result.failures)
    hint = carry.hint(tree, logs) if carry is not None else ""
    if hint:
        result.note = f"{result.note}\n{hint}" if result.note else hint


def _dirty(repo: Path) -> bool:
    return bool(git(repo, "status", "--porcelain", "--untracked-files=no"))


def check_revisions(
    spec: JobSpec,
    base: str,
    head: str | None,
    out: Path,
    *,
    repo: Path | None = None,
    policies: Mapping[str, Policy | str] | None = None,
    allow_teardown_failure: bool = False,
    read: Mapping[str, Any] | None = None,
    carry: Sequence[CarryItem | str] = (),
) -> CheckResult:
    """Run ``spec`` at ``base`` and at ``head`` (default HEAD), compare, write the report.

    Runs go to out/base and out/head, the report to out; any of those names already taken
    (an earlier run's, the user's) is refused before anything runs (parity.outdir). Raises
    RevisionError (bad repo or revision), LaunchError (a run failed) or MetricsError (a run
    wrote bad metrics). A run that failed only at teardown is compared anyway and named in
    ``result.teardown``; the verdict is then "failed" unless allow_teardown_failure, as in
    `parity pair`. read: how each side is read (spec.READ_OPTIONS: format, run, duplicates,
    allow_skipped). carry: paths git ignores copied read-only from the checkout into both
    worktrees (parity.carry; each refused up front where it is not such an input), recorded in
    summary.json and the report.
    """
    root = repo_root(Path(repo or Path.cwd()))
    revs = {"base": base, "head": head or "HEAD"}
    commits = {side: resolve_revision(root, rev) for side, rev in revs.items()}
    carried = carry_into_revisions(root, carry, commits)
    notes = [f"{side} = {revs[side]} = {commits[side]}" for side in revs]
    notes.append("each side ran in `git worktree add --detach DIR COMMIT`, cwd DIR, PYTHONPATH=DIR")
    if head is None and _dirty(root):
        warning = "uncommitted changes in the working tree are not part of head (HEAD)"
        print(f"parity: warning: {warning}", file=sys.stderr)
        notes.append(warning)
    out = Path(out).resolve()
    dirs = {side: out / side for side in revs}
    labels = [f"{side} {revs[side]} ({commits[side][:12]})" for side in revs]
    launches = {}
    with OutDir.open(out) as held:
        held.claim(*_run_names(dirs.values()), "summary.json")
        with holding(spec, held) as shared:  # Slurm: both revisions on the same nodes
            try:
                for side, label in zip(revs, labels, strict=True):
                    with worktree(root, commits[side], shared) as tree:
                        carried.into(tree)
                        launches[side] = run_in_tree(
                            spec, tree, dirs[side], True, label, carried, read
                        )
            except LaunchError as e:
                write_failed(out, e)
                raise
        notes += topology_notes(dirs["base"], dirs["head"], "")
        report = build_report(
            dirs["base"], dirs["head"], policies, labels=labels, notes=notes, **_read(read)
        )
        report.carried = [c.line() for c in carried.carried]
        result = CheckResult(
            report.comparison, out / "report.md", dirs["base"], dirs["head"], commits["base"],
            commits["head"], _failed(launches), allow_teardown_failure,
        )  # fmt: skip
        result.carried = [c.to_dict() for c in carried.carried]
        _write_summary(result, out)
        return _written(result, report, out)


def carry_into_revisions(
    root: Path, carry: Sequence[CarryItem | str], commits: Mapping[str, str]
) -> Carry:
    """The inputs to carry into each revision's worktree, refused before anything runs where
    one is missing, outside the repository, or tracked by (in the way of) a revision."""
    items = [i if isinstance(i, CarryItem) else carry_items([i], "carry")[0] for i in carry]
    carried = Carry.of(root, items)
    for name, commit in commits.items():
        carried.check_revision(commit, name)
    carried.check_checkout()
    return carried


def _write_summary(result: CheckResult, out: Path) -> None:
    """summary.json: the verdict, the two commits and the inputs carried into both."""
    summary = {
        "verdict": result.verdict, "base": result.a_rev, "head": result.b_rev,
        "carried": result.carried,
    }  # fmt: skip
    write_json_new(out / "summary.json", summary)


def _run_names(dirs) -> list[str]:
    """The entries a run folder takes in its parent: itself and its launch folder."""
    return [name for d in dirs for name in (d.name, launch_dir(d).name)]


def _read(read: Mapping[str, Any] | None) -> dict[str, Any]:
    """build_report's keywords for how both sides are read (spec.READ_OPTIONS)."""
    options = {**READ_OPTIONS, **(read or {})}
    both = {"run": options["run"], "duplicates": options["duplicates"]}
    return {
        "fmt": options["format"], "allow_skipped": options["allow_skipped"],
        "at_source_precision": options["at_source_precision"], "read_a": both, "read_b": both,
    }  # fmt: skip


def _failed(launches: Mapping[str, LaunchResult]) -> list[tuple[str, LaunchResult]]:
    return [(side, result) for side, result in launches.items() if not result.ok]


def _written(result: CheckResult, report: Report, out: Path) -> CheckResult:
    """``result`` once its report is written, with the teardown failures among its notes."""
    report.notes += teardown_notes(result)
    result.report = report.write(out)
    result.diagnosis = report.diagnosis
    return result


def check_golden(
    spec: JobSpec,
    golden: Path,
    out: Path,
    *,
    tree: Path | None = None,
    policies: Mapping[str, Policy | str] | None = None,
    allow_teardown_failure: bool = False,
    read: Mapping[str, Any] | None = None,
) -> CheckResult:
    """Run ``spec`` once on the current tree (the repo root, else cwd) and compare with a stored
    metrics file or run folder (any readable format); the run goes to out/current. A teardown
    failure is handled as in `check_revisions`."""
    if tree is None:
        try:
            tree = repo_root(Path.cwd())
        except RevisionError:
            tree = Path.cwd()
    golden = Path(golden)
    if golden.is_dir() and not metrics_path(golden).is_file():
        from parity.judge.golden import baselines

        if found := baselines(golden):  # which one is right is for the user to say
            raise RevisionError(
                f"{golden}: a golden with one baseline per environment; pass one of them: "
                + ", ".join(str(metrics_path(b)) for b in found)
            )
    options = _read(read)
    frame = read_metrics(golden, options["fmt"], **options["read_a"])
    if skipped_count(frame) and not options["allow_skipped"]:  # fails before the run, not after
        raise SkippedRecordsError(
            f"{golden}: {read_summary(frame, 'golden')}; no verdict from a partial read "
            "(--allow-skipped to compare anyway)"
        )
    out = Path(out).resolve()
    run_dir = out / "current"
    inside = {run_dir, launch_dir(run_dir)}
    if inside & {golden.resolve(), *golden.resolve().parents}:
        raise RevisionError(f"{golden}: golden file lies in the run folder {run_dir}")
    with OutDir.open(out) as held:
        held.claim(*_run_names([run_dir]))
        launch_result = run_in_tree(
            spec, Path(tree).resolve(), run_dir, True, "current tree", read=read
        )
        notes = [f"golden = {golden}", f"current = the working tree at {tree}, as it is now"]
        report = build_report(
            golden, run_dir, policies, labels=["golden", "current"], notes=notes, **options
        )
        result = CheckResult(
            report.comparison, out / "report.md", golden, run_dir, None, None,
            _failed({"current": launch_result}), allow_teardown_failure,
        )  # fmt: skip
        return _written(result, report, out)
