"""A matched pair: both sides run (one after the other, in one launch, or A twice first for the
noise floor), compared, diagnosed once, rerun with the first divergent step's ops traced where
that names the first differing op, summarized and reported (the orchestration layer, over
parity.run.job).

`run_pair` does all of it, as `parity pair` does; its steps are public so that a caller with its
own runs (the pytest plugin's cached and pooled ones) goes through the same ones:
`compare_pair` (or `nondeterministic_pair`), then `finish_pair` (`PairResult.diagnose`,
`trace_divergence`, `write_summary`, `write_pair_report`).

A pair folder holds a/, b/ (a-repeat/ with the noise floor, trace-a/ and trace-b/ after an op-trace
rerun), summary.json / summary.md and report.md / report.html.

A caller whose sides run elsewhere goes through the same steps: `parity check` gives `run_sides`
one `SideRun` per revision (its folder, out/base or out/head, and a runner in the revision's
worktree, which the op-trace rerun uses too) and the result a `Framing` (the revisions in the
report's labels and notes, and in summary.json).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from parity.files import LAUNCH_SUFFIX
from parity.judge import topology
from parity.judge.compare import Comparison, Policy, compare_frames, printable
from parity.judge.diagnose import Diagnosis, diagnose
from parity.judge.noise import NONDETERMINISTIC, NoiseFloor, floor_from_frames
from parity.judge.policy import Policies, parse_policies
from parity.outdir import OutDir, write_json_new, write_new
from parity.record.runfolder import metrics_path
from parity.run import job
from parity.run.early import EarlyStop, judge_stopped, truncated
from parity.run.job import Run
from parity.run.launch import LaunchError, LaunchResult
from parity.spec import JobSpec, PairSpec, SpecError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from parity.check import CheckResult
    from parity.run.trace_rerun import TraceRerun

#: the diagnosis kind after which an op-trace rerun can name the first differing op
SAME_BATCHES = "same batches, numbers differ"


@dataclass(frozen=True)
class SideRun:
    """How one side of a pair runs: its folder in the pair's folder, how progress lines and
    errors name it, and what runs it (parity.run.job.run_job's call; that one by default). One
    place for all of a side's runs, so that its op-trace rerun runs where the side ran (`parity
    check`: in the revision's worktree)."""

    folder: str
    label: str
    run: Callable[..., Run] | None = None

    def runner(self) -> Callable[..., Run]:
        """The side's runner, parity.run.job.run_job (looked up now) unless it has its own."""
        return self.run or job.run_job

    def __call__(self, spec: JobSpec, out: Path, early: EarlyStop | None = None) -> Run:
        """The side's run into out/<folder>; a failure only at teardown is returned, not raised.
        early: stopped as soon as it diverges (parity.run.early)."""
        more = {"early": early} if early is not None else {}
        return self.runner()(
            spec, out / self.folder, label=self.label, allow_teardown_failure=True, **more
        )

    def early_stop(self, a: Run, out: Path, policies, **options: Any) -> EarlyStop:
        """This side judged against ``a``'s numbers as it writes its steps, in out/<folder>."""
        return EarlyStop(a.metrics, metrics_path(out / self.folder), policies, **options)


@dataclass
class Framing:
    """What a caller that runs a pair for its own ends adds to what the pair writes (`parity
    check`: two revisions): the report's labels of the sides and the notes it leads with, the
    inputs carried into both (the report's section, parity.carry), and keys of its own in
    summary.json beside the pair's."""

    labels: tuple[str, str] = ("A", "B")
    notes: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class PairResult:
    a: Run
    b: Run
    comparison: Comparison
    dir: Path
    allow_teardown_failure: bool = False
    floor: NoiseFloor | None = None  # A vs its repeat A', with noise_floor; then b is A'
    diagnosis: Diagnosis | None = None  # parity.judge.diagnose of a vs b: see diagnose()
    trace_rerun: TraceRerun | None = None  # the op-trace rerun, when one was run
    report: Path | None = None  # report.md (report.html beside it), when one was written
    sides: tuple[SideRun, SideRun] | None = None  # how the sides ran (run_sides)
    framing: Framing = field(default_factory=Framing)

    @property
    def names(self) -> tuple[str, str]:
        """The sides' names (their folders): "a" and "b", `check`'s "base" and "head"."""
        return (self.sides[0].folder, self.sides[1].folder) if self.sides else ("a", "b")

    @property
    def teardown(self) -> list[tuple[str, LaunchResult]]:
        """(side, launch) of each side that finished training, then crashed or hung at exit."""
        runs = zip(self.names, (self.a, self.b), strict=True)
        return [(side, run.launch) for side, run in runs
                if not run.launch.ok and not run.launch.stopped_early]  # fmt: skip

    @property
    def verdict(self) -> str:
        """The metrics verdict, but "failed" after a teardown failure unless that is allowed.

        Why: a crash at exit after complete metrics is neither a clean pass nor a wrong number;
        it is never hidden, only (with allow_teardown_failure) not counted against the pair.
        "nondeterministic" when side A run twice differed (the noise floor is not zero).
        """
        if self.floor is not None and not self.floor.deterministic:
            return NONDETERMINISTIC
        return teardown_verdict(self.teardown, self.allow_teardown_failure, self.comparison)

    @property
    def ok(self) -> bool:
        return self.verdict == self.comparison.verdict and self.comparison.ok

    def teardown_line(self) -> str:
        """One line naming each side's teardown failure, or '' when there was none."""
        named = [(f"side {side.upper()}" if side in ("a", "b") else side, result)
                 for side, result in self.teardown]  # fmt: skip
        return teardown_line(named, self.comparison)

    def diagnose(self) -> Diagnosis:
        """The diagnosis of the two run folders (parity.judge.diagnose), made on first use and kept:
        the summary, the report, the op-trace rerun and the CLI all read this one."""
        if self.diagnosis is None:
            self.diagnosis = diagnose(self.a.dir, self.b.dir, self.comparison)
        return self.diagnosis

    def diagnosis_dict(self) -> dict[str, Any]:
        """The diagnosis as JSON (summary.json, `parity pair --json`), the rerun's line last."""
        found = self.diagnose().to_dict()
        if self.trace_rerun is not None:
            found["lines"].append(printable(self.trace_rerun.line()))
        return found

    def labels(self) -> tuple[str, str]:
        """How the report names the two sides (B is A's repeat when A was not deterministic)."""
        return ("A", "A' (A again)") if self.verdict == NONDETERMINISTIC else self.framing.labels

    def notes(self) -> list[str]:
        """The report's notes: the framing's, the teardown failure, where each side ran (Slurm)
        and whether that differed, the op-trace rerun's line."""
        rerun = [self.trace_rerun.line()] if self.trace_rerun is not None else []
        where = topology_notes(self.a.dir, self.b.dir, self.verdict)
        return [*self.framing.notes, *self.stop_notes(), *teardown_notes(self), *where, *rerun]

    def stop_notes(self) -> list[str]:
        """The line saying side B was stopped as it diverged (none when it ran to its end)."""
        if self.b.stopped_at is None:
            return []
        return [f"{self.labels()[1]}: {self.b.launch.stopped_early}, as soon as it diverged; both "
                f"sides compared up to step {self.b.stopped_at} (--run-out: run it to its "
                "end)"]  # fmt: skip

    def shown(self, run: Run) -> pd.DataFrame:
        """A side's metrics as the report shows them: up to the step B was stopped at."""
        if self.b.stopped_at is None:
            return run.metrics
        return truncated(run.metrics, self.b.stopped_at)


def teardown_verdict(
    teardown: list[tuple[str, LaunchResult]], allow_teardown_failure: bool, comparison: Comparison
) -> str:
    """The metrics verdict, but "failed" after a teardown failure unless that is allowed (the
    one rule for `pair` and `check`)."""
    if teardown and not allow_teardown_failure:
        return "failed"
    return comparison.verdict


def teardown_line(teardown: list[tuple[str, LaunchResult]], comparison: Comparison) -> str:
    """One line naming each (label, launch) that failed at teardown, and the metrics verdict
    the comparison gave anyway; '' when there was none."""
    parts = []
    for label, result in teardown:
        who = result.failures[0].headline() if result.failures else result.reason
        parts.append(f"{label}: {result.reason} ({who})")
    if not parts:
        return ""
    return (
        f"teardown failure after complete metrics: {'; '.join(parts)}; "
        f"metrics compared anyway: {comparison.verdict}"
    )


def topology_notes(a_dir: Path, b_dir: Path, verdict: str) -> list[str]:
    """Where each side ran when it was not this machine (Slurm), and the line saying the
    sides' topologies differ (parity.judge.topology) when they do."""
    a, b = topology.read(a_dir), topology.read(b_dir)
    notes = [f"side {side}: {topology.describe(t)}" for side, t in (("A", a), ("B", b))
             if t.get("launcher", "local") != "local" and topology.describe(t)]  # fmt: skip
    differs = topology.line(a, b, verdict)
    return notes + ([differs] if differs else [])


def teardown_notes(result: PairResult | CheckResult) -> list[str]:
    """The report's note on a teardown failure of `pair` or `check` (none without one)."""
    return [f"verdict {result.verdict}: {result.teardown_line()}"] if result.teardown else []


def side_label(side: str, spec: JobSpec) -> str:
    """How progress lines and errors name a side: `side b`, with its variant for a preset
    (`side b (worker)`)."""
    return f"side {side} ({spec.variant})" if spec.variant else f"side {side}"


def floor_of(a: Run, repeat: Run, policies: Policies | None = None) -> NoiseFloor:
    """The noise floor of two runs of one spec (A and its repeat A'), naming both."""
    floor = floor_from_frames(a.metrics, repeat.metrics, policies)
    floor.a_dir, floor.repeat_dir, floor.runs = a.dir, repeat.dir, (a, repeat)
    return floor


def measure_floor(
    spec: JobSpec,
    out: Path,
    policies: Policies | None = None,
    *,
    a: Any = None,
) -> tuple[Any, Any, NoiseFloor]:
    """Run ``spec`` (unless ``a``, a Run of it, is given) and its repeat under out/a-repeat.

    Returns (A, A', floor); raises LaunchError when either run fails.
    """
    out = Path(out).resolve()
    if a is None:
        a = job.run_job(spec, out / "a", label=side_label("a", spec))
    repeat = job.run_job(spec, out / "a-repeat", label=side_label("a'", spec))
    return a, repeat, floor_of(a, repeat, policies)


def compare_pair(
    a: Run,
    b: Run,
    out: Path,
    policies: Policies | None = None,
    *,
    allow_teardown_failure: bool = False,
    floor: NoiseFloor | None = None,
    at_source_precision: bool = False,
    allow_skipped: bool = False,
) -> PairResult:
    """The two runs of a pair compared under ``policies``: the one place a pair's result is
    made (run_pair's, check's and the pytest plugin's). ``out``: the pair's folder.
    at_source_precision, allow_skipped: as compare_frames takes them."""
    options = {"at_source_precision": at_source_precision, "allow_skipped": allow_skipped}
    if b.stopped_at is not None:  # stopped as it diverged: both sides up to there
        comparison = judge_stopped(a.metrics, b.metrics, b.stopped_at, policies, **options)
    else:
        comparison = compare_frames(a.metrics, b.metrics, policies, **options)
    return PairResult(a, b, comparison, Path(out), allow_teardown_failure, floor=floor)


def nondeterministic_pair(
    floor: NoiseFloor, out: Path, *, allow_teardown_failure: bool = False
) -> PairResult:
    """The result of a pair whose side A, run twice, differed: A against its repeat A' (B is
    not run; its verdict would say nothing), verdict "nondeterministic"."""
    a, repeat = floor.runs
    return PairResult(a, repeat, floor.comparison, Path(out), allow_teardown_failure, floor=floor)


def run_pair(
    pair: PairSpec,
    out: Path,
    policies: Mapping[str, Policy | str] | None = None,
    in_process: bool = False,
    *,
    allow_teardown_failure: bool = False,
    noise_floor: bool = False,
    trace: bool = True,
    report: bool = True,
    at_source_precision: bool = False,
) -> PairResult:
    """Everything `parity pair` does: both sides one after the other (2 cores: concurrency would
    only add noise), compared, diagnosed, rerun traced where that helps, summarized, reported.

    A side that crashes before its metrics are complete raises LaunchError. One that fails only
    at teardown is still compared; ``result.verdict`` is then "failed" unless
    allow_teardown_failure, and ``result.teardown`` / summary.json name it either way.

    in_process: both in one launch (parity.run.inprocess), the same bits at half the start-up;
    SpecError with the reason when the sides cannot share a process.

    noise_floor: run A twice first (A, then A' in out/a-repeat); if they differ, B is not run and
    the result compares A with A' (``result.b`` is A'), verdict "nondeterministic".

    trace: a pair that diverged on the same batches without op traces is rerun up to its first
    divergent step with every op of it traced (``result.trace_rerun``); the diagnosis then
    names the first differing op. report: write report.md / report.html (``result.report``).
    """
    out, policies = Path(out).resolve(), parse_policies(policies)
    spec_a, _ = pair.sides()
    if in_process and spec_a.launcher.kind != "local":
        raise SpecError("in-process runs both sides in one launch on this machine; not with "
                        f"launcher {spec_a.launcher.kind!r}")  # fmt: skip
    with OutDir.open(out) as held:
        held.claim(*PAIR_ENTRIES)  # before anything runs: refused if the user's is in the way
        with job.holding(spec_a, held):  # Slurm: the sides in one allocation
            try:
                result = run_sides(
                    pair, out, policies, in_process,
                    allow_teardown_failure=allow_teardown_failure, noise_floor=noise_floor,
                    at_source_precision=at_source_precision,
                )  # fmt: skip
            except LaunchError as e:
                write_failed(out, e, report=report)
                raise
            return finish_pair(result, trace=trace, report=report)


def pair_entries(*runs: str) -> tuple[str, ...]:
    """What a pair writes in its folder: each of ``runs`` (the sides' run folders) and the
    op-trace reruns', with their launch folders, the Slurm allocation, the summary and the
    report; claimed before anything runs (parity.outdir)."""
    folders = (*runs, "trace-a", "trace-b")
    launched = tuple(name for run in folders for name in (run, run + LAUNCH_SUFFIX))
    return launched + (job.ALLOCATION, "summary.json", "summary.md", "report.md", "report.html")


#: what `parity pair` writes in its folder: pair_entries of its sides and the noise floor's
#: repeat, and the in-process launch
PAIR_ENTRIES = (*pair_entries("a", "b", "a-repeat"), "in-process")


def run_sides(
    pair: PairSpec,
    out: Path,
    policies: Policies | None = None,
    in_process: bool = False,
    *,
    allow_teardown_failure: bool = False,
    noise_floor: bool = False,
    at_source_precision: bool = False,
    allow_skipped: bool = False,
    sides: tuple[SideRun, SideRun] | None = None,
    stop_early: bool = False,
) -> PairResult:
    """Run the pair's sides into out/a and out/b (A twice first with noise_floor) and compare
    them; nothing is written beside the runs (finish_pair does that). sides: where and how each
    side runs instead (`parity check`: each revision in its worktree, into out/base and
    out/head); not with in_process or noise_floor, which run side A here. stop_early: side B,
    run after A, is judged against A's numbers as it writes its steps and stopped as soon as
    it diverges (parity.run.early; the comparison then covers the steps up to there)."""
    out = Path(out).resolve()
    spec_a, spec_b = pair.sides()
    if sides is not None and (in_process or noise_floor):
        raise SpecError("sides of their own run neither in one process nor with a noise floor")
    sides = sides or (SideRun("a", side_label("a", spec_a)), SideRun("b", side_label("b", spec_b)))
    floor = a = None
    if noise_floor:
        a, _, floor = measure_floor(spec_a, out, policies)
        if not floor.deterministic:
            return nondeterministic_pair(floor, out, allow_teardown_failure=allow_teardown_failure)
    if in_process and a is None:  # with noise_floor, A has run (twice) already: B alone
        from parity.run.inprocess import run_pair_in_process

        a, b = run_pair_in_process(pair, out, allow_teardown_failure=True)
    elif a is None and spec_a.launcher.parallel:  # each side a Slurm job of its own, at once
        from parity.run.slurm import run_parallel

        a, b = run_parallel([lambda: sides[0](spec_a, out), lambda: sides[1](spec_b, out)])
    else:
        if a is None:
            a = sides[0](spec_a, out)
        early = None
        if stop_early and a.launch.ok:
            options = {"at_source_precision": at_source_precision, "allow_skipped": allow_skipped}
            early = sides[1].early_stop(a, out, policies, **options)
        b = sides[1](spec_b, out, early)
    result = compare_pair(
        a, b, out, policies, allow_teardown_failure=allow_teardown_failure, floor=floor,
        at_source_precision=at_source_precision, allow_skipped=allow_skipped,
    )  # fmt: skip
    result.sides = sides
    return result


def finish_pair(
    result: PairResult,
    *,
    trace: bool = True,
    report: bool = True,
    run_job: Callable[..., Any] | None = None,
) -> PairResult:
    """What follows the comparison: the diagnosis (once), the op-trace rerun (trace; its runs
    by ``run_job``, default each side's own runner: ``result.sides``, else
    parity.run.job.run_job), summary.json / summary.md after it, so that they name the first
    differing op, and report.md / report.html (report)."""
    result.diagnose()
    if trace:
        trace_divergence(result, run_job=run_job)
    write_summary(result)
    if report:
        write_pair_report(result)
    return result


def trace_divergence(
    result: PairResult, *, run_job: Callable[..., Any] | None = None
) -> TraceRerun | None:
    """A pair that diverged on the same batches without op traces: rerun both sides up to the
    first divergent step with it traced (parity.run.trace_rerun), put the traces in the run folders
    and the op comparison in the diagnosis. None (and nothing run) when there is nothing to
    do; else the rerun, kept as ``result.trace_rerun``, whose reason says why it could not."""
    from parity.run.trace_rerun import install_traces, trace_first_divergence

    found = result.diagnose()
    if result.verdict != "diverged" or found.kind != SAME_BATCHES:
        return None
    if found.ops.status != "unavailable":  # traced already: the diagnosis names the op
        return None
    print(f"{SAME_BATCHES} from step {found.step}: rerunning both sides up to it with every op "
          "traced (--no-trace, trace=False: skip)", file=sys.stderr, flush=True)  # fmt: skip
    a, b = result.a, result.b
    if run_job is None and result.sides is not None:  # each side reruns where it ran
        run_job = {"a": result.sides[0].runner(), "b": result.sides[1].runner()}
    rerun = trace_first_divergence(
        a.spec, b.spec, (a.dir, b.dir), found.step, result.dir, run_job=run_job or job.run_job
    )
    if not rerun.reason:
        install_traces(rerun, {"a": a.dir, "b": b.dir})
        _use_ops(found, rerun)
    result.trace_rerun = rerun
    return rerun


def _use_ops(found: Diagnosis, rerun: TraceRerun) -> None:
    """The diagnosis with the reruns' op comparison in place of the missing one (as
    parity.judge.diagnose reads it: the ops' errors among the diagnosis's)."""
    stale = {printable(e) for e in found.ops.errors}
    found.errors = [e for e in found.errors if e not in stale]
    found.ops = rerun.ops
    found.errors += map(printable, rerun.ops.errors)


def write_summary(result: PairResult) -> None:
    """summary.json (everything a script needs: verdicts, sides, diagnosis, teardown, noise
    floor, op-trace rerun) and summary.md (the verdict and the table) in the pair's folder."""
    comparison = result.comparison.to_dict()
    sources = {side: comparison.pop(side) for side in ("a", "b")}  # the metrics files
    summary = {
        **result.framing.summary,
        **comparison,
        "a": {"spec": result.a.spec.shown(), "dir": str(result.a.dir), "metrics": sources["a"]},
        "b": {"spec": result.b.spec.shown(), "dir": str(result.b.dir), "metrics": sources["b"]},
        "seconds": {"a": result.a.launch.duration_s, "b": result.b.launch.duration_s},
        "mode": "in-process" if result.a.in_process else "separate",
        "diagnosis": result.diagnosis_dict(),
        "verdict": result.verdict,  # "failed" after a teardown failure (comparison's otherwise)
        "metrics_verdict": result.comparison.verdict,
        "teardown": [{"side": side, **r.to_dict()} for side, r in result.teardown],
    }
    if result.trace_rerun is not None:
        summary["trace_rerun"] = result.trace_rerun.to_dict()
    if result.b.stopped_at is not None:
        summary["stopped_early"] = {"side": result.names[1], "step": result.b.stopped_at,
                                    "line": result.b.launch.stopped_early}  # fmt: skip
    if result.floor is not None:
        summary["noise_floor"] = result.floor.to_dict()
    where = {side: topology.read(run.dir) for side, run in (("a", result.a), ("b", result.b))}
    if any(where.values()):
        summary["topology"] = {**where, "line": topology.line(where["a"], where["b"],
                                                               result.verdict)}  # fmt: skip
    write_json_new(result.dir / "summary.json", summary)
    note = f"\n{result.teardown_line()}\n" if result.teardown else ""
    if summary.get("topology", {}).get("line"):
        note += f"\n{summary['topology']['line']}\n"
    if result.floor is not None:
        note += f"\n```\n{result.floor.table()}\n```\n"
    table = result.comparison.table()  # in a fence longer than any backtick run: a metric name
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", table)), default=0))
    text = f"# parity: {result.verdict}\n{note}\n{fence}\n{table}\n{fence}\n"  # can't close it
    write_new(result.dir / "summary.md", text)


def write_failed(out: Path, error: LaunchError, *, report: bool = True) -> None:
    """summary.json (verdict "failed": which run, why, the launch's account) and, with
    ``report``, report.md / report.html saying the same: a run that crashed, hung or stalled
    leaves what a CI step summary shows, where each rank waited included. A job that refused
    its arguments (bad input, exit 2) leaves nothing."""
    launch = error.result
    if launch.refused_arguments is not None:
        return
    summary = {"verdict": "failed", "run": error.label, "launch": launch.to_dict(),
               "error": str(error)}  # fmt: skip
    write_json_new(out / "summary.json", json.loads(json.dumps(summary, default=str)))
    if report:
        from parity.report import write_failure_report

        why = f" ({launch.stalled or launch.reason})"
        headline = f"{error.label or 'a run'} failed{why}" + (
            f": {launch.stacks}" if launch.stacks else ""
        )
        write_failure_report(out, headline, str(error))


def write_pair_report(result: PairResult) -> Path:
    """report.md and report.html in the pair's folder, from the result's own comparison and
    diagnosis (nothing read or compared again), with its notes; returns report.md's path,
    also kept as ``result.report``."""
    from parity.report import Report, side_of

    sides = [side_of(result.shown(run), run.dir, label)
             for run, label in zip((result.a, result.b), result.labels(), strict=True)]  # fmt: skip
    made = Report(result.comparison, *sides, result.notes(), result.diagnose(),
                  result.framing.carried)  # fmt: skip
    result.report = made.write(result.dir)
    return result.report
