"""Pre-merge refactor check: one job spec run on two git revisions, or against a golden file.

Two revisions are a pair (parity.pair): each runs as a side, in its own temporary worktree
(parity.git: ``git worktree add --detach``, removed again whatever happens), with cwd
and PYTHONPATH at that folder, so ``-m pkg`` and script paths resolve to the revision's own code,
not to the installed package. `run_sides` runs and compares them, `finish_pair` diagnoses them
once, reruns them with the first divergent step's ops traced where that names the first
differing op (each in its worktree again), and writes pair's summary.json / summary.md and
report.md / report.html, with the revisions and the carried inputs added (a `Framing`).
The user's working tree, index, branches and HEAD are never touched.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.carry import Carry, CarryItem, carry_items
from parity.files import launch_dir
from parity.git import RevisionError, dirty, origin, repo_root, resolve_revision, worktree
from parity.judge.compare import Comparison, Policy, compare_frames
from parity.judge.diagnose import Diagnosis
from parity.judge.golden import fingerprint
from parity.judge.policy import Policies, parse_policies
from parity.outdir import OutDir
from parity.pair import (
    Framing,
    PairResult,
    SideRun,
    compare_pair,
    finish_pair,
    pair_entries,
    run_sides,
    teardown_line,
    teardown_notes,
    teardown_verdict,
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
from parity.run.early import EarlyStop, prefix_comparison
from parity.run.job import (
    Run,
    detected,
    holding,
    launch_spec,
    mark_teardown,
    no_run_line,
    stopped_run,
)
from parity.run.launch import LaunchError, LaunchResult
from parity.spec import JobSpec, PairSpec, check_read_options, read_keywords
from parity.store import RunKey, RunStore, StoredRun, commit_key

__all__ = [
    "CHECK_ENTRIES",
    "CheckResult",
    "RevisionError",
    "check_golden",
    "check_revisions",
    "resolve_revision",
    "run_in_tree",
    "tree_runner",
    "worktree",
]

#: the sides of a check, each its run folder's name: base (side A) and head (side B)
SIDES = ("base", "head")

#: where the base runs again when a base reused from the run store and the head disagree, and
#: the head where it had been stopped early against a reused base that turned out stale
FRESH_BASE, HEAD_AGAIN = "base-fresh", "head-again"

#: what a check of two revisions writes in its folder (parity.pair.pair_entries)
CHECK_ENTRIES = pair_entries(*SIDES, FRESH_BASE, HEAD_AGAIN)


def stops_early(read: Mapping[str, Any]) -> bool:
    """Whether runs read as ``read`` says (spec.READ_OPTIONS) can be judged as they write their
    steps: the recorder's metrics.jsonl, its values final (a step given twice is an error)."""
    recorded = read["format"] in (None, "jsonl") and read["run"] is None
    return recorded and read["duplicates"] == "error"


@dataclass
class CheckResult:
    """A run of the current tree against a golden file (`check_golden`)."""

    comparison: Comparison
    report: Path  # report.md; report.html lies next to it
    a_dir: Path
    b_dir: Path
    a_rev: str | None  # None: the golden file / the current tree
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


def run_in_tree(
    spec: JobSpec,
    tree: Path,
    run_dir: Path,
    allow_teardown: bool = False,
    label: str | None = None,
    carry: Carry | None = None,
    read: Mapping[str, Any] | None = None,
    early: EarlyStop | None = None,
) -> LaunchResult:
    """Run ``spec`` under torchrun with cwd and PYTHONPATH at ``tree``; raise LaunchError.

    run_dir is made new (parity.run.job.launch_spec: one already there is refused, never
    removed, so nothing an earlier run left is read as this run's). allow_teardown: a run that
    failed only at teardown (complete metrics, see `mark_teardown`) is returned, not ok and with its
    reason, for the caller to compare and report. carry: the inputs copied into ``tree``
    (parity.carry); a run that changed them failed, whatever its exit. read: how the run is
    read (spec.READ_OPTIONS, the spec's `[read]`): a run that only its named format reads is
    a run, not "nothing readable". early: stopped as soon as it diverges (parity.run.early);
    such a launch is returned as it is (``stopped_early``), its metrics in ``early``.
    """
    run_dir = Path(run_dir).resolve()  # the job's cwd is elsewhere
    label = label or run_dir.name
    paths = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    result = launch_spec(
        spec, run_dir, label, cwd=tree, env=env, origin=origin(tree, carry), early=early
    )
    if result.stopped_early and not result.fault:  # a wrong world fails below
        return result
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
    options = check_read_options(read)
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


def tree_runner(
    tree: Path, carry: Carry | None = None, read: Mapping[str, Any] | None = None
) -> Callable[..., Run]:
    """parity.run.job.run_job's call for jobs run in ``tree`` (`run_in_tree`), each read as the
    spec's `[read]` says: a check's side in its revision's worktree, and its op-trace rerun.
    ``carry`` is copied into ``tree`` before each run (again where an earlier run changed it)."""
    options = check_read_options(read)

    def run(
        spec: JobSpec,
        out: Path,
        label: str | None = None,
        *,
        allow_teardown_failure: bool = False,
        early: EarlyStop | None = None,
    ) -> Run:
        if carry is not None:
            carry.into(tree)
        launch = run_in_tree(spec, tree, out, allow_teardown_failure, label, carry, read, early)
        if launch.stopped_early and early is not None:
            return stopped_run(spec, out, launch, early)
        out = Path(out).resolve()
        return Run(spec, out, launch, _read_run(out, options))

    return run


def _read_run(out: Path, options: Mapping[str, Any]):
    """A run folder's metrics as a check reads its runs (the spec's [read], checked)."""
    return read_metrics(out, options["format"], run=options["run"],
                        duplicates=options["duplicates"])  # fmt: skip


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
    trace: bool = True,
    store: RunStore | None = None,
    fresh: bool = False,
    run_out: bool = False,
) -> PairResult:
    """Run ``spec`` at ``base`` and at ``head`` (default HEAD) as a pair, side A and side B
    (parity.pair: `run_sides`, then `finish_pair`), each in its revision's worktree.

    store: a run store (parity.store): the base is taken from it where a run with its key is
    stored (only the head runs), and each side that ran and finished is stored for the next
    check. A reused base that disagrees with the head (or was made in another environment, by
    the runs' manifests) is run again into out/base-fresh, and the verdict is that run's: a
    stale key costs a run, never a verdict. fresh: run the base even where it is stored (the
    runs are still stored). The head runs after the base and is judged against its numbers as
    it writes its steps, and stopped as soon as it diverges (parity.run.early: the sides are
    then compared up to there, the verdict and first divergence those of a whole run); run_out:
    run it to its end.

    Runs go to out/base and out/head, summary.json / summary.md and the report to out, the
    op-trace rerun (trace: where the sides diverged on the same batches) to out/trace-a and
    out/trace-b; any of those names already taken (an earlier run's, the user's) is refused
    before anything runs (parity.outdir). summary.json is pair's, with ``base`` and ``head``
    (each its ``rev`` and ``commit``) and ``carried``. Raises RevisionError (bad repo or
    revision), LaunchError (a run failed) or MetricsError (a run wrote bad metrics). A run that
    failed only at teardown is compared anyway and named in ``result.teardown``; the verdict
    is then "failed" unless allow_teardown_failure, as in `parity pair`. read: how each side is
    read (spec.READ_OPTIONS: format, run, duplicates, allow_skipped, at_source_precision).
    carry: paths git ignores copied read-only from the checkout into both worktrees
    (parity.carry; each refused up front where it is not such an input).
    """
    root = repo_root(Path(repo or Path.cwd()))
    revs = {"base": base, "head": head or "HEAD"}
    commits = {side: resolve_revision(root, rev) for side, rev in revs.items()}
    carried = carry_into_revisions(root, carry, commits)
    warning = ""
    if head is None and dirty(root):
        warning = "uncommitted changes in the working tree are not part of head (HEAD)"
        print(f"parity: warning: {warning}", file=sys.stderr)
    options, policies = check_read_options(read), parse_policies(policies)
    out = Path(out).resolve()
    with OutDir.open(out) as held:
        held.claim(*CHECK_ENTRIES)
        with holding(spec, held) as shared, contextlib.ExitStack() as trees:
            sides = []
            for side in SIDES:  # both worktrees stay until the op-trace rerun is done
                tree = trees.enter_context(worktree(root, commits[side], shared))
                label = f"{side} {revs[side]} ({commits[side][:12]})"
                sides.append(SideRun(side, label, tree_runner(tree, carried, read)))
            stored = Stored(store, spec, root, commits, revs, carried, options, fresh)
            compare = {
                "allow_teardown_failure": allow_teardown_failure,
                "at_source_precision": options["at_source_precision"],
                "allow_skipped": options["allow_skipped"],
            }
            try:
                result = run_sides(
                    PairSpec(spec), out, policies, sides=(stored.base_side(sides[0]), sides[1]),
                    stop_early=not run_out and stops_early(options), **compare,
                )  # fmt: skip
                result.sides = (sides[0], sides[1])  # an op-trace rerun runs, never reuses
                if stored.reused is not None and stored.disagrees(result):
                    result = stored.run_base_again(result, sides, policies, compare)
            except LaunchError as e:
                write_failed(out, e)
                raise
            stored.keep(result)
            labels = [stored.label(sides[0].label), sides[1].label]
            result.framing = _framing(revs, commits, carried, labels, warning, stored)
            return finish_pair(result, trace=trace)


class Stored:
    """A check's use of the run store (parity.store): its base taken from it where stored, run
    again where that reused base disagrees with the head, and the runs that finished kept."""

    def __init__(
        self,
        store: RunStore | None,
        spec: JobSpec,
        root: Path,
        commits: Mapping[str, str],
        revs: Mapping[str, str],
        carried: Carry,
        read: Mapping[str, Any],
        fresh: bool,
    ):
        self.store, self.spec, self.revs, self.commits = store, spec, revs, commits
        self.read, self.fresh = read, fresh
        self.reused: StoredRun | None = None
        self.again = ""  # why a reused base was run again ('' when it was not)
        self.stale = False  # the reused base differed from the base run again
        self.fresh_until: int | None = None  # the step the base run again stopped after
        self.keys: dict[str, RunKey] = {}
        if store is not None:
            self.keys = {side: commit_key(spec, root, commits[side], carried) for side in SIDES}

    def base_side(self, side: SideRun) -> SideRun:
        """The base's side: its run taken from the store where one is stored (and not fresh),
        else run, and stored as soon as it finished whole (a head that then fails costs the
        next check only the head)."""
        if self.store is None:
            return side

        def run(spec: JobSpec, out: Path, label: str | None = None, **_: Any) -> Run:
            if not self.fresh:
                self.reused = self.store.get(self.keys["base"], Path(out))
            if self.reused is None:
                ran = side.runner()(spec, out, label=label, allow_teardown_failure=True)
                self._put("base", ran)
                return ran
            print(f"parity: base: {self.reused.line()} (--fresh: run it again)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return self._run_of(spec, Path(out))

        return SideRun(side.folder, side.label, run)

    def _run_of(self, spec: JobSpec, out: Path) -> Run:
        """The reused run as a side's run: its metrics read as the check reads its runs."""
        out = out.resolve()
        launch = LaunchResult(0, False, 0.0, out, started_as="run reused from the run store")
        return Run(spec, out, launch, _read_run(out, self.read))

    def disagrees(self, result: PairResult) -> bool:
        """Whether the reused base must run again: the pair is not aligned, or the runs'
        manifests say they were made in different environments (parity.judge.golden)."""
        if not result.comparison.ok:
            self.again = f"the reused base and the head: {result.comparison.verdict}"
        elif fingerprint(result.a.manifest) != fingerprint(result.b.manifest):
            self.again = "the reused base was made in another environment (its manifest)"
        return bool(self.again)

    def run_base_again(
        self,
        result: PairResult,
        sides: Sequence[SideRun],
        policies: Policies,
        compare: Mapping[str, Any],
    ) -> PairResult:
        """The pair again with the base run now into out/base-fresh: the verdict is this one's.
        A fresh base whose numbers differ from the stored run's makes that one stale (removed
        from the store; the fresh one is kept in its place)."""
        print(f"parity: {self.again}: running the base again before the verdict",
              file=sys.stderr, flush=True)  # fmt: skip
        again = SideRun(FRESH_BASE, sides[0].label, sides[0].run)
        head, head_side = result.b, sides[1]
        until = None  # a head stopped at step k: the base needs its steps up to k alone
        if head.stopped_at is not None:
            until = EarlyStop(result.a.metrics, metrics_path(result.dir / FRESH_BASE), None,
                              until=head.stopped_at)  # fmt: skip
        base = again(self.spec, result.dir, until)
        if base.stopped_at is not None:  # default policies: exact
            same = prefix_comparison(result.a.metrics, base.metrics, base.stopped_at)
        else:
            same = compare_frames(result.a.metrics, base.metrics)
        self.stale, self.fresh_until = not same.ok, base.stopped_at
        if self.stale and self.store is not None:
            print(f"parity: the stored base {self.reused.dir} was stale: removed from the run "
                  "store", file=sys.stderr, flush=True)  # fmt: skip
            self.store.forget(self.keys["base"])
        if head.stopped_at is not None and self._head_again(base, head, policies, compare):
            head_side = SideRun(HEAD_AGAIN, sides[1].label, sides[1].run)
            print("parity: the head was stopped against the stale base: running it again",
                  file=sys.stderr, flush=True)  # fmt: skip
            early = head_side.early_stop(base, result.dir, policies, **_options(compare))
            head = head_side(self.spec, result.dir, early)
        fresh = compare_pair(base, head, result.dir, policies, **compare)
        fresh.sides = (again, head_side)
        return fresh

    @staticmethod
    def _head_again(base: Run, head: Run, policies, compare: Mapping[str, Any]) -> bool:
        """Whether a head stopped early against the reused base must run again: up to its stop
        it does not diverge from the base run now (it was stopped by a stale run's numbers)."""
        prefix = prefix_comparison(base.metrics, head.metrics, head.stopped_at, policies,
                                   **_options(compare))  # fmt: skip
        return prefix.first_divergence() is None

    def keep(self, result: PairResult) -> None:
        """Each side that ran here and finished whole, put in the store under its key (the
        base once: `base_side` stored it as it finished)."""
        for side, run in (("base", result.a), ("head", result.b)):
            if side == "base" and run.dir.name == "base":
                continue  # the stored run itself, or stored as it finished
            self._put(side, run)

    def _put(self, side: str, run: Run) -> None:
        """``run`` in the store under ``side``'s key, where it finished whole; with --fresh in
        place of what was stored (that may be stale: the fresh run is what now holds)."""
        if self.store is None or not run.launch.ok or skipped_count(run.metrics):
            return
        meta = {"rev": self.revs[side], "commit": self.commits[side],
                "seconds": run.launch.duration_s}  # fmt: skip
        with contextlib.suppress(OSError):  # a full disk costs the next check a run
            if self.fresh:
                self.store.forget(self.keys[side])
            self.store.put(self.keys[side], run.dir, meta)

    def label(self, label: str) -> str:
        """The base's label in the report: reused, or run again."""
        if self.reused is None:
            return label
        return f"{label}, run again" if self.again else f"{label}, reused"

    def notes(self) -> list[str]:
        if self.reused is None:
            return []
        notes = [f"base: {self.reused.line()} (run store {self.store.root})"]
        if self.again:
            upto = f" up to step {self.fresh_until}" if self.fresh_until is not None else ""
            stale = (
                "; the stored run differed from the run again: stale, removed from the store"
                if self.stale
                else f"; the stored run and the run again are bitwise equal{upto}"
            )
            notes.append(f"{self.again}: the base ran again into {FRESH_BASE}/, and the verdict "
                         f"is that run's{stale}")  # fmt: skip
        return notes

    def summary(self) -> dict[str, Any]:
        if self.reused is None:
            return {}
        return {"reused": {"line": self.reused.line(), "key": self.reused.key.digest,
                           "store": str(self.store.root), "run_again": self.again or None,
                           "stale": self.stale}}  # fmt: skip


def _framing(
    revs: Mapping[str, str],
    commits: Mapping[str, str],
    carried: Carry,
    labels: Sequence[str],
    warning: str,
    stored: Stored,
) -> Framing:
    """What check adds to its pair: the revisions in the report's labels and notes, the dirty
    tree's warning, a base reused from the run store, and in summary.json the revisions and the
    inputs carried into both."""
    notes = [f"{side} = {revs[side]} = {commits[side]}" for side in SIDES]
    notes.append("each side ran in `git worktree add --detach DIR COMMIT`, cwd DIR, PYTHONPATH=DIR")
    notes += stored.notes()
    summary = {side: {"rev": revs[side], "commit": commits[side]} for side in SIDES}
    summary["base"].update(stored.summary())
    summary["carried"] = [c.to_dict() for c in carried.carried]
    return Framing(
        (labels[0], labels[1]), notes + ([warning] if warning else []),
        [c.line() for c in carried.carried], summary,
    )  # fmt: skip


def _options(compare: Mapping[str, Any]) -> dict[str, Any]:
    """The reading options of a check's comparison keywords (for an early stop's judge)."""
    return {k: compare[k] for k in ("at_source_precision", "allow_skipped")}


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


def _run_names(dirs) -> list[str]:
    """The entries a run folder takes in its parent: itself and its launch folder."""
    return [name for d in dirs for name in (d.name, launch_dir(d).name)]


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
    options = read_keywords(check_read_options(read))
    frame = read_metrics(golden, options["fmt"], run=options["run_a"],
                         duplicates=options["duplicates"])  # fmt: skip
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
        held.claim(*_run_names([run_dir]), "report.md", "report.html")  # before the run
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
