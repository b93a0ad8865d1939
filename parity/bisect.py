"""`parity bisect`: the first commit whose run leaves the good revision's numbers.

The good revision's run is the reference. The bisection is driven from this process, with the
harness as the test: ``git bisect start BAD GOOD`` in a temporary ``git worktree`` of its own,
then, for each commit git checks out there, the spec is run and compared with the reference under
the spec's policies, and git is answered ``good`` (aligned), ``bad`` (diverged) or ``skip`` (the
run failed), until it names the first bad commit. Every git call is an argument list: nothing
runs through a shell (``git bisect run`` would run its test through ``sh -c``), and a Ctrl-C,
SIGTERM or SIGHUP takes the one path of parity.run.signals: the running launch is stopped
(parity.run.launch), the worktree's bisect state reset and the worktree removed.

The user's repository is left exactly as it was: the worktree has its own HEAD and its own
bisect state (``refs/bisect/*`` and ``BISECT_*`` are per worktree), hooks and auto-gc are off,
and the worktree is reset and removed whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from parity.carry import Carry, CarryItem
from parity.check import carry_into_revisions, run_in_tree, stops_early
from parity.files import LAUNCH_SUFFIX, launch_dir, write_json_atomic
from parity.git import (
    RevisionError,
    quiet_git,
    repo_root,
    resolve_revision,
    subject,
    worktree,
)
from parity.judge.compare import Comparison, Policy, compare_frames, json_value
from parity.judge.policy import Policies, parse_policies
from parity.outdir import OutDir, write_json_new, write_new
from parity.readers import MetricsError, read_metrics, skipped_count
from parity.record.runfolder import metrics_path
from parity.run.early import EarlyStop, judge_stopped
from parity.run.job import ALLOCATION, holding
from parity.run.launch import LaunchError
from parity.run.signals import deferred
from parity.spec import JobSpec, SpecError, check_read_options, load_spec
from parity.store import RunKey, RunStore, commit_key

__all__ = ["BisectResult", "TestedCommit", "bisect", "bisect_revisions"]

_ANSWER = {"aligned": "good", "diverged": "bad"}  # anything else, a failed run: "skip"
_FIRST_BAD = re.compile(r"^([0-9a-f]{40}) is the first bad commit", re.MULTILINE)
_STEPS_LEFT = re.compile(r"\(roughly (\d+) steps?\)")
_ONLY_SKIPPED = "# only skipped commits left to test"  # git bisect log, when it cannot go on
_POSSIBLE = re.compile(r"^# possible first bad commit: \[([0-9a-f]{40})\]", re.MULTILINE)


@dataclass
class TestedCommit:
    """One commit's run against the reference: aligned, diverged, or skipped (run failed)."""

    commit: str
    subject: str
    verdict: str
    metric: str | None = None  # the first divergent metric, its step and the policy in force
    step: int | None = None
    policy: str | None = None
    a_value: float | None = None
    b_value: float | None = None
    run: str | None = None
    error: str | None = None
    reused: bool = False  # its run came from the run store (parity.store)
    stopped_at: int | None = None  # stopped after this step as it diverged (parity.run.early)


@dataclass
class BisectResult:
    """outcome: "found" (first_bad named), "aligned" (bad agrees with good: nothing to find),
    or "ambiguous" (skipped commits hide it among ``candidates``); ``verdict`` is the word of
    the verdicts table for its exit code: "aligned" (0), else "diverged" (1: bad diverges)."""

    outcome: str
    good: str
    bad: str
    out: Path
    first_bad: TestedCommit | None = None
    candidates: list[str] = field(default_factory=list)
    tested: list[TestedCommit] = field(default_factory=list)
    carried: list[dict[str, Any]] = field(default_factory=list)  # parity.carry: path, size, sha256
    reference: dict[str, Any] = field(default_factory=dict)  # the good run: reused, confirmed

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, non-finite floats as strings."""

        def clean(t: TestedCommit | None) -> dict[str, Any] | None:
            return None if t is None else {k: json_value(v) for k, v in asdict(t).items()}

        return {
            "verdict": self.verdict,
            "outcome": self.outcome,
            "good": self.good,
            "bad": self.bad,
            "out": str(self.out),
            "first_bad": clean(self.first_bad),
            "candidates": self.candidates,
            "tested": [clean(t) for t in self.tested],
            "carried": self.carried,
            "reference": self.reference,
        }

    @property
    def verdict(self) -> str:
        """The verdict of the table (README, docs/verdicts.md) the exit code says: "aligned" (0)
        when bad agrees with good, else "diverged" (1), a first bad commit named or not."""
        return "aligned" if self.outcome == "aligned" else "diverged"

    def verdict_line(self) -> str:
        """`verdict: ...` as `parity bisect` ends: the table's word, then what was found."""
        said = f"runs and bisect.json in {self.out}"
        if self.first_bad is not None:
            said = f"first bad commit {self.first_bad.commit[:12]}; {said}"
        elif self.outcome == "ambiguous":
            said = f"first bad commit one of {len(self.candidates)} candidates; {said}"
        return f"verdict: {self.verdict}  ({said})"

    def text(self) -> str:
        """What a person reads: the culprit, where it first diverged, and what was tested."""
        lines = []
        if self.outcome == "aligned":
            lines.append(f"bad {self.bad[:12]} is aligned with good {self.good[:12]}: no culprit")
        elif self.outcome == "ambiguous":
            lines.append("skipped commits (failed runs) hide the first bad commit; one of:")
            lines += [f"  {c}" for c in self.candidates]
        t = self.first_bad
        if t is not None:
            lines.append(f"first bad commit: {t.commit} {t.subject}")
            lines.append(
                f"  first divergence: {t.metric} at step {t.step} (policy {t.policy}): "
                f"good {t.a_value!r}, this commit {t.b_value!r}"
            )
        if self.reference.get("line"):
            lines.append(f"good: {self.reference['line']}")
        for t in self.tested:
            reused = " (reused run)" if t.reused else ""
            lines.append(f"  tested {t.commit[:12]} {t.verdict:<8} {t.subject}{reused}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Reading:
    """How the reference and every tested run are read and compared: the spec's `[read]`
    options (spec.check_read_options: format, run, duplicates, allow_skipped,
    at_source_precision), the same for both sides."""

    options: Mapping[str, Any]

    def frame(self, path: Path) -> pd.DataFrame:
        o = self.options
        return read_metrics(path, o["format"], run=o["run"], duplicates=o["duplicates"])

    def judging(self) -> dict[str, bool]:
        """compare_frames' keywords: what a comparison accepts of what was read."""
        keys = ("allow_skipped", "at_source_precision")
        return {key: self.options[key] for key in keys}

    def compare(self, a: Path, b: Path, policies: Policies) -> Comparison:
        return compare_frames(self.frame(a), self.frame(b), policies, **self.judging())


def _judge(tested: TestedCommit, comparison: Comparison) -> TestedCommit:
    """``tested`` with its verdict against the reference and, where it diverged, the first
    divergent metric (a metric missing on one side has no step: named all the same)."""
    tested.verdict, tested.error = comparison.verdict, None
    m = comparison.first_divergence() or next(iter(comparison.failures), None)
    if m is not None:
        tested.metric, tested.step = m.name, m.first_divergent_step
        tested.policy = m.first_divergent_policy or m.policy
        tested.a_value, tested.b_value = m.a_value, m.b_value
    return tested


@dataclass
class _Bisection:
    """One bisection's fixed inputs, its runs (each commit's, made once, or taken from the run
    store) and the commits tested so far (in test order)."""

    spec: JobSpec
    reference: Path
    out: Path
    policies: Policies
    reading: _Reading
    good: str
    bad: str
    total: int  # about how many commits it tests, the bad one included (for progress lines)
    carry: Carry | None = None  # parity.carry: the inputs copied into the worktree
    tested: dict[str, TestedCommit] = field(default_factory=dict)
    store: RunStore | None = None  # parity.store: runs reused and kept
    fresh: bool = False  # run every commit, whatever is stored (runs are still kept)
    root: Path | None = None  # the repository (the store's keys: a commit's tree)
    #: commit: (its run, reused from the store, the early stop that stopped it or None)
    runs: dict[str, tuple[Path, bool, EarlyStop | None]] = field(default_factory=dict)
    run_out: bool = False  # run every probe to its end (no early stop)
    reference_line: str = ""  # "reused run of ..." when the good run came from the store
    confirmed: str = ""  # how a reused good run was confirmed ('' until it is)

    def key(self, commit: str) -> RunKey:
        return commit_key(self.spec, self.root, commit, self.carry)

    def obtain(
        self,
        tree: Path,
        commit: str,
        run_dir: Path,
        label: str,
        fresh: bool = False,
        early: EarlyStop | None = None,
    ) -> str:
        """``commit``'s run in ``run_dir``: taken from the store where stored (not with
        ``fresh``; returns how it names that run, "reused run of ... from ..."), else run in
        ``tree`` and stored (returns ''; a run stopped early, ``early``, is not stored);
        LaunchError or MetricsError when the run fails."""
        if self.store is not None and not (self.fresh or fresh):
            got = self.store.get(self.key(commit), run_dir)
            if got is not None:
                _say(f"{label}: {got.line()}")
                return got.line()
        if self.carry is not None:
            self.carry.into(tree)  # again where the last commit's run changed the copies
        read = self.reading.options
        launch = run_in_tree(self.spec, tree, run_dir, label=label, carry=self.carry, read=read,
                             early=early)  # fmt: skip
        if self.store is not None and launch.ok and not skipped_count(self.reading.frame(run_dir)):
            meta = {"rev": commit, "commit": commit, "seconds": launch.duration_s}
            with contextlib.suppress(OSError):  # a full disk costs a later command a run
                if self.fresh or fresh:  # run again whatever was stored: it takes the place
                    self.store.forget(self.key(commit))
                self.store.put(self.key(commit), run_dir, meta)
        return ""

    def test(self, tree: Path, skip_failed: bool = True, again: bool = False) -> TestedCommit:
        """Test the commit checked out in ``tree`` (its run made once per bisection, or reused;
        ``again``: run now whatever there is); one progress line on stderr. A fresh run aligned
        with a reused good run confirms that one."""
        commit = quiet_git(tree, "rev-parse", "HEAD")
        t = self._tested(tree, commit, skip_failed, again)
        if not t.reused and t.verdict == "aligned" and self.reference_line and not self.confirmed:
            self.confirmed = f"a fresh run of {commit[:12]} is aligned with it"
        self.tested[t.commit] = t
        self.total = max(self.total, len(self.tested))
        reused = " (reused run)" if t.reused else ""
        _say(f"[{len(self.tested)}/~{self.total}] {t.commit[:12]} {t.subject}: {t.verdict}{reused}")
        return t

    def _tested(
        self, tree: Path, commit: str, skip_failed: bool, again: bool = False
    ) -> TestedCommit:
        """``commit``'s run (made now, or earlier in this bisection, or reused) judged against
        the reference; written to verdict.json in its run folder's launch folder (beside it:
        ``parity.files.launch_dir``; the run folder is the job's). A failed or unreadable run is
        "skipped" (with skip_failed; else its LaunchError or MetricsError is raised)."""
        name = commit[:12] + ("-fresh" if again else "")
        run_dir = self.out / "commits" / name
        tested = TestedCommit(commit, subject(tree, commit), "skipped", run=str(run_dir))
        try:
            if again or commit not in self.runs:
                early = self._early_stop(run_dir)
                reused = self.obtain(tree, commit, run_dir, f"commit {name}", again, early)
                stopped = early if early is not None and early.step is not None else None
                self.runs[commit] = (run_dir, bool(reused), stopped)
            run_dir, tested.reused, stopped = self.runs[commit]
            tested.run, tested.stopped_at = str(run_dir), stopped.step if stopped else None
            _judge(tested, self._comparison(run_dir, stopped))
        except (LaunchError, MetricsError) as e:
            if not skip_failed:
                raise
            tested.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        verdict = launch_dir(run_dir) / "verdict.json"  # beside the job's files, never among
        verdict.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(verdict, json_value(asdict(tested)))
        return tested

    def _early_stop(self, run_dir: Path) -> EarlyStop | None:
        """A probe judged against the reference as it writes its steps and stopped as soon as it
        diverges (parity.run.early), where its runs can be (not with run_out)."""
        if self.run_out or not stops_early(self.reading.options):
            return None
        reference = self.reading.frame(self.reference)
        return EarlyStop(reference, metrics_path(run_dir), self.policies, **self.reading.judging())

    def _comparison(self, run_dir: Path, stopped: EarlyStop | None) -> Comparison:
        """A probe's run against the reference: whole, or up to the step it was stopped at."""
        if stopped is None:
            return self.reading.compare(self.reference, run_dir, self.policies)
        reference = self.reading.frame(self.reference)
        return judge_stopped(reference, stopped.frame, stopped.step, self.policies,
                             **self.reading.judging())  # fmt: skip

    def forget_stopped(self) -> None:
        """Runs stopped against a reference that was replaced: run again when tested again."""
        self.runs = {c: run for c, run in self.runs.items() if run[2] is None}

    def result(self, verdict: str, **kw: Any) -> BisectResult:
        tested = list(self.tested.values())
        carried = [c.to_dict() for c in self.carry.carried] if self.carry is not None else []
        return BisectResult(
            verdict, self.good, self.bad, self.out, tested=tested, carried=carried,
            reference=self.reference_info(), **kw,
        )  # fmt: skip

    def reference_info(self) -> dict[str, Any]:
        """bisect.json's ``reference``: its run, and whether it was reused and how confirmed."""
        reference = {"dir": str(self.reference), "reused": bool(self.reference_line)}
        if self.reference_line:
            reference.update(line=self.reference_line, confirmed=self.confirmed)
        return reference


def _job_spec(spec: JobSpec | str | Path) -> JobSpec:
    if isinstance(spec, JobSpec):
        return spec
    loaded = load_spec(spec)
    if not isinstance(loaded, JobSpec):
        raise SpecError(f"{spec}: bisect runs one job spec, not an [a]/[b] pair")
    return loaded


def bisect(
    spec: JobSpec | str | Path,
    good: str,
    bad: str,
    out: Path,
    *,
    repo: Path | None = None,
    policies: Mapping[str, Policy | str] | None = None,
    read: Mapping[str, Any] | None = None,
    carry: Sequence[CarryItem | str] = (),
    store: RunStore | None = None,
    fresh: bool = False,
    run_out: bool = False,
) -> BisectResult:
    """Find the first commit in good..bad whose run diverges from good's run.

    Each commit's run is judged against good's as it writes its steps and stopped as soon as
    it diverges (parity.run.early; where runs are read from the recorder's metrics.jsonl);
    run_out: run each to its end.

    store: a run store (parity.store): the good run and each commit's run are taken from it
    where stored, and every run that finished is kept there. A stale key costs runs, never a
    wrong answer: what the answer rests on is confirmed by fresh runs at the end (`_confirm`),
    and the bisection walked again, each commit's run kept, where that changes anything.
    fresh: run everything, whatever is stored (the runs are still kept).

    Writes the reference run to out/good, each tested commit's run to out/commits/<sha> and its
    verdict to out/commits/<sha>.launch/verdict.json, and out/bisect.json and out/bisect.log;
    one progress line per tested commit on stderr. read: how the reference and each tested
    run are read and compared (spec.READ_OPTIONS' keys, the spec's `[read]` table: format,
    run, duplicates, allow_skipped, at_source_precision), checked before the first run.
    carry: paths git ignores copied read-only from the checkout into every tested commit's
    worktree (parity.carry), refused up front where good, bad or a commit between them tracks one.
    Raises RevisionError (bad repo or revisions), SpecError, CarryError, or LaunchError when
    the good or the bad revision's run fails.
    """
    reading = _Reading(check_read_options(read))
    spec = _job_spec(spec)
    root = repo_root(Path(repo or Path.cwd()))
    good_c, bad_c = resolve_revision(root, good), resolve_revision(root, bad)
    if good_c == bad_c:
        raise RevisionError(f"good {good!r} and bad {bad!r} are the same commit {good_c[:12]}")
    try:
        quiet_git(root, "merge-base", "--is-ancestor", good_c, bad_c)
    except RevisionError:
        raise RevisionError(f"good {good!r} is not an ancestor of bad {bad!r}") from None
    carried = carry_into_revisions(root, carry, {"good": good_c, "bad": bad_c})
    carried.check_range(good_c, bad_c)
    out = Path(out).resolve()
    with OutDir.open(out) as held:
        held.claim(*BISECT_ENTRIES)  # refused if an earlier bisect's or the user's is in the way
        held.make_dir("commits")
        with holding(spec, held) as shared:  # Slurm: every probe on the same nodes
            state = _Bisection(
                spec, out / "good", out, parse_policies(policies), reading, good_c, bad_c,
                _expected_tests(root, good_c, bad_c), carried, store=store, fresh=fresh,
                root=root, run_out=run_out,
            )  # fmt: skip
            return _bisect(state, shared)


#: `parity bisect` as the package's API names it beside check_revisions
bisect_revisions = bisect


#: what a bisection writes in its folder: the reference run, the tested commits' runs and
#: verdicts, the result and git's log
BISECT_ENTRIES = (
    "good", "good" + LAUNCH_SUFFIX, "good-fresh", "good-fresh" + LAUNCH_SUFFIX, "commits",
    ALLOCATION, "bisect.json", "bisect.log",
)  # fmt: skip


def _bisect(state: _Bisection, shared: Path | None = None) -> BisectResult:
    """The bisection itself; ``shared``: where the worktrees go (a Slurm launcher's folder on
    the file system the nodes share), default the system's temp folder."""
    root, good_c, out = state.root, state.good, state.out
    with worktree(root, good_c, shared) as tree:
        _say(f"reference run of good {good_c[:12]} {subject(root, good_c)}")
        state.reference_line = state.obtain(tree, good_c, state.reference, f"good {good_c[:12]}")
    if state.reading.frame(state.reference).attrs.get("complete") is False:  # fail once
        raise MetricsError(f"{metrics_path(state.reference)}: the good run is incomplete")
    result = _walk(state, shared)
    while (again := _confirm(state, result, shared)) is not None:
        result = again
    result.reference = state.reference_info()
    write_json_new(out / "bisect.json", result.to_dict())
    return result


def _walk(state: _Bisection, shared: Path | None) -> BisectResult:
    """Test bad, then bisect good..bad against the reference."""
    with worktree(state.root, state.bad, shared) as tree:
        _say(f"checking that bad {state.bad[:12]} diverges")
        if state.test(tree, skip_failed=False).verdict == "aligned":
            return state.result("aligned")
        return _bisect_in(tree, state)


def _confirm(state: _Bisection, result: BisectResult, shared: Path | None) -> BisectResult | None:
    """What a bisection's answer rests on, confirmed where a run of it was reused (a stale key
    costs runs, never a wrong answer): a good run that no fresh run was aligned with, and a
    first bad commit whose run was reused, each run again. None: the answer stands; else the
    bisection walked again against what the fresh runs say (each commit's run kept, so only
    commits not tested yet run)."""
    changed = False
    if state.reference_line and not state.confirmed:
        changed = _rerun_reference(state, shared)
    culprit = result.first_bad
    if not changed and culprit is not None and culprit.reused:
        with worktree(state.root, culprit.commit, shared) as tree:
            _say(f"the first bad commit's run was reused: running {culprit.commit[:12]} again")
            if state.store is not None:  # the run made now is kept in its place
                state.store.forget(state.key(culprit.commit))
            fresh = state.test(tree, again=True)
        changed = fresh.verdict != "diverged"
        if not changed:  # confirmed: the answer names the fresh run
            result.first_bad, result.tested = fresh, list(state.tested.values())
    if not changed:
        return None
    _say("a reused run was stale: bisecting again with the fresh runs")
    state.tested = {}
    return _walk(state, shared)


def _rerun_reference(state: _Bisection, shared: Path | None) -> bool:
    """The reused good run again (out/good-fresh): the same numbers confirm it (False); other
    numbers make it stale (removed from the store) and the fresh run the reference (True)."""
    fresh = state.out / "good-fresh"
    with worktree(state.root, state.good, shared) as tree:
        _say("the reused good run was never confirmed by a fresh run: running it again")
        if state.store is not None:  # the run made now is kept in its place
            state.store.forget(state.key(state.good))
        state.obtain(tree, state.good, fresh, f"good {state.good[:12]} (again)", fresh=True)
    if compare_frames(state.reading.frame(state.reference), state.reading.frame(fresh)).ok:
        state.confirmed = "run again: the same numbers"
        return False
    state.reference = fresh
    state.forget_stopped()
    state.confirmed = "run again: stale (other numbers); bisected again against the fresh run"
    return True


def _expected_tests(root: Path, good_c: str, bad_c: str) -> int:
    """About how many commits a bisection tests: the bad one, then log2 of the other candidates."""
    candidates = int(quiet_git(root, "rev-list", "--count", f"{good_c}..{bad_c}"))
    return 1 + max(candidates - 1, 0).bit_length()


def _bisect_in(tree: Path, state: _Bisection) -> BisectResult:
    """Bisect in ``tree``, whose own bisect state is reset at the end whatever happens: test the
    commit git checked out, answer git, until it names the first bad commit (or only commits
    whose run failed are left: "ambiguous", with git's candidates)."""
    try:
        output = _bisect_git(tree, "start", state.bad, state.good, "--")
        while (found := _FIRST_BAD.search(output)) is None:
            left = _STEPS_LEFT.search(output)
            if left:  # the commit checked out now, then about `left` more
                state.total = len(state.tested) + 1 + int(left[1])
            tested = state.test(tree)
            try:
                output = _bisect_git(tree, _ANSWER.get(tested.verdict, "skip"))
            except RevisionError:
                candidates = _only_skipped_left(tree)
                if candidates is None:
                    raise
                _save_log(tree, state.out)
                return state.result("ambiguous", candidates=candidates)
        _save_log(tree, state.out)
    finally:  # the worktree's own bisect state; removing the worktree drops it anyway
        with deferred(), contextlib.suppress(RevisionError):
            quiet_git(tree, "bisect", "reset", "--quiet")
    culprit = state.tested.get(found[1])
    if culprit is None:
        raise RevisionError(f"git bisect named {found[1]}, which was never tested")
    return state.result("found", first_bad=culprit)


def _bisect_git(tree: Path, *args: str) -> str:
    """One `git bisect` command; a signal waits for it (git killed half-way through a checkout
    would leave the worktree's index locked)."""
    with deferred():
        return quiet_git(tree, "bisect", *args)


def _only_skipped_left(tree: Path) -> list[str] | None:
    """When git stopped because only skipped commits are left: the commits it says may be the
    first bad one (from its bisect log); None when it stopped for another reason."""
    log = quiet_git(tree, "bisect", "log")
    if _ONLY_SKIPPED not in log:
        return None
    return _POSSIBLE.findall(log)


def _save_log(tree: Path, out: Path) -> None:
    with contextlib.suppress(RevisionError):
        write_new(out / "bisect.log", quiet_git(tree, "bisect", "log") + "\n")


def _say(text: str) -> None:
    print(f"parity bisect: {text}", file=sys.stderr, flush=True)


class _CallableModule(types.ModuleType):
    """``parity.bisect`` names this module once it is imported (Python sets the attribute), and
    the function ``bisect`` in the package's API: calling the module calls the function, so
    ``parity.bisect(...)`` works either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> BisectResult:
        return bisect(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
