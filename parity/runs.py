"""Run a job or a matched pair under torchrun and read back what it wrote.

A run folder holds what the job wrote (metrics.jsonl, console.log, manifest.json) next to what
the launcher captured (launcher.log, logs/ per rank). A pair folder holds a/, b/ and summary.*.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from parity.compare import Comparison, compare_frames
from parity.files import write_json_atomic, write_text_atomic
from parity.launch import LaunchError, LaunchResult, launch, launch_nodes
from parity.noise import NONDETERMINISTIC, NoiseFloor, measure_floor
from parity.readers import MetricsError, read_metrics
from parity.spec import JobSpec, PairSpec

if TYPE_CHECKING:
    from parity.revisions import CheckResult


@dataclass
class Run:
    spec: JobSpec
    dir: Path
    launch: LaunchResult
    metrics: pd.DataFrame
    in_process: bool = False  # ran in one launch with the other side (parity.inprocess)

    @property
    def manifest(self) -> dict:
        path = self.dir / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else {}


@dataclass
class PairResult:
    a: Run
    b: Run
    comparison: Comparison
    dir: Path
    allow_teardown_failure: bool = False
    floor: NoiseFloor | None = None  # A vs its repeat A', with noise_floor; then b is A'

    @property
    def teardown(self) -> list[tuple[str, LaunchResult]]:
        """(side, launch) of each side that finished training, then crashed or hung at exit."""
        return [
            (side, run.launch) for side, run in (("a", self.a), ("b", self.b)) if not run.launch.ok
        ]

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
        named = [(f"side {side.upper()}", result) for side, result in self.teardown]
        return teardown_line(named, self.comparison)


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


def teardown_notes(result: PairResult | CheckResult) -> list[str]:
    """The report's note on a teardown failure of `pair` or `check` (none without one)."""
    return [f"verdict {result.verdict}: {result.teardown_line()}"] if result.teardown else []


def steps_logged(metrics_file: Path) -> int:
    """How many step records a running job has written so far (for progress, not for results)."""
    try:
        with open(metrics_file, "rb") as f:
            return sum(1 for line in f if line.startswith(b'{"step"'))
    except OSError:
        return 0


class Progress:
    """A step counter per side on a terminal (tqdm); silent in CI or when stderr is not a tty."""

    def __init__(self, label: str, total: int, metrics_file: Path, enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty() and not os.environ.get("CI")
        self.metrics_file = metrics_file
        self.bar = None
        if enabled:
            from tqdm import tqdm

            width = shutil.get_terminal_size((100, 20)).columns or 100  # 0 under some ptys
            self.bar = tqdm(
                total=total, desc=label, unit="step", file=sys.stderr, leave=True, ncols=width
            )

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(steps_logged(self.metrics_file) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.tick()
            self.bar.close()


def mark_teardown(result: LaunchResult, metrics_file: Path, since: float) -> pd.DataFrame | None:
    """For a failed launch: if ``metrics_file`` was written during it (mtime after ``since``) and
    has its end record, mark the result a teardown failure and return the metrics, else None.

    Why: the end record is written after the last training collective, so a crash after it is
    one of teardown, and the metrics are whole; anything else is a real failure.
    """
    if result.ok:
        return None
    try:
        if metrics_file.stat().st_mtime < since - 1.0:  # a stale file from an earlier run
            return None
        metrics = read_metrics(metrics_file)
    except (OSError, MetricsError):
        return None
    if metrics.attrs.get("complete") is not True:
        return None
    result.output_complete = True
    return metrics


def end_record_written(metrics_file: Path, since: float) -> bool:
    """Whether ``metrics_file`` ends with its end record, written after ``since`` (cheap: the
    last bytes only, polled while a job runs)."""
    try:
        if metrics_file.stat().st_mtime < since - 1.0:
            return False
        with open(metrics_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256))
            last = f.read().rstrip().rsplit(b"\n", 1)[-1]
    except OSError:
        return False
    return last.startswith(b'{"event": "end"')


def run_job(
    spec: JobSpec,
    out: Path,
    label: str | None = None,
    *,
    allow_teardown_failure: bool = False,
    exit_grace_s: float = 60.0,
) -> Run:
    """Launch one job; raise LaunchError (rank, exit code or signal, log tail) if it failed.

    A job that failed only at teardown (metrics complete, see ``mark_teardown``) raises too, with
    ``reason`` teardown-crash/-hang; with allow_teardown_failure its Run is returned instead,
    ``run.launch.ok`` False, so that the metrics can still be compared. A job still running
    ``exit_grace_s`` after its end record is killed as hung at exit (teardown-hang) rather than
    left to its timeout. ``spec.nnodes`` > 1 runs every node's torchrun on this machine
    (``launch_nodes``).
    """
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(label or out.name, spec.steps, out / "metrics.jsonl")
    since = time.time()
    common = dict(
        nproc=spec.nproc_per_node,
        run_dir=out,
        timeout_s=spec.timeout_s,
        torchrun_args=spec.torchrun_args,
        on_tick=progress.tick,
        finished=lambda: end_record_written(out / "metrics.jsonl", since),
        exit_grace_s=exit_grace_s,
    )
    try:
        if spec.nnodes > 1:
            join_s = min(60.0, spec.timeout_s)
            result = launch_nodes(
                spec.to_args(out), nnodes=spec.nnodes, join_timeout_s=join_s, **common
            )
        else:
            result = launch(spec.to_args(out), **common)
    finally:
        progress.close()
    if not result.ok:
        metrics = mark_teardown(result, out / "metrics.jsonl", since)
        if metrics is None or not allow_teardown_failure:
            raise LaunchError(result)
        return Run(spec, out, result, metrics)
    return Run(spec, out, result, read_metrics(out))


def run_pair(
    pair: PairSpec,
    out: Path,
    policies: dict | None = None,
    in_process: bool = False,
    *,
    allow_teardown_failure: bool = False,
    noise_floor: bool = False,
) -> PairResult:
    """Both sides one after the other (2 cores: concurrency would only add noise), then compare.

    A side that crashes before its metrics are complete raises LaunchError. One that fails only
    at teardown is still compared; ``result.verdict`` is then "failed" unless
    allow_teardown_failure, and ``result.teardown`` / summary.json name it either way.

    in_process: both in one launch (parity.inprocess), the same bits at half the start-up;
    SpecError with the reason when the sides cannot share a process.

    noise_floor: run A twice first (A, then A' in out/a-repeat); if they differ, B is not run and
    the result compares A with A' (``result.b`` is A'), verdict "nondeterministic".
    """
    out = Path(out).resolve()
    spec_a, spec_b = pair.sides()
    floor = a = None
    if noise_floor:
        a, repeat, floor = measure_floor(spec_a, out, policies)
        if not floor.deterministic:
            result = PairResult(
                a, repeat, floor.comparison, out, allow_teardown_failure, floor=floor
            )
            write_summary(result)
            return result
    if in_process and a is None:  # with noise_floor, A has run (twice) already: B alone
        from parity.inprocess import run_pair_in_process

        a, b = run_pair_in_process(pair, out, allow_teardown_failure=True)
    else:
        if a is None:
            a = run_job(spec_a, out / "a", label=f"A {spec_a.trainer}", allow_teardown_failure=True)
        b = run_job(spec_b, out / "b", label=f"B {spec_b.trainer}", allow_teardown_failure=True)
    comparison = compare_frames(a.metrics, b.metrics, policies)
    result = PairResult(a, b, comparison, out, allow_teardown_failure, floor=floor)
    write_summary(result)
    return result


def write_summary(result: PairResult) -> None:
    from parity.diagnose import diagnose

    comparison = result.comparison.to_dict()
    sources = {side: comparison.pop(side) for side in ("a", "b")}  # the metrics files
    summary = {
        **comparison,
        "a": {"spec": result.a.spec.to_dict(), "dir": str(result.a.dir), "metrics": sources["a"]},
        "b": {"spec": result.b.spec.to_dict(), "dir": str(result.b.dir), "metrics": sources["b"]},
        "seconds": {"a": result.a.launch.duration_s, "b": result.b.launch.duration_s},
        "mode": "in-process" if result.a.in_process else "separate",
        "diagnosis": diagnose(result.a.dir, result.b.dir, result.comparison).to_dict(),
        "verdict": result.verdict,  # "failed" after a teardown failure (comparison's otherwise)
        "metrics_verdict": result.comparison.verdict,
        "teardown": [{"side": side, **r.to_dict()} for side, r in result.teardown],
    }
    if result.floor is not None:
        summary["noise_floor"] = result.floor.to_dict()
    write_json_atomic(result.dir / "summary.json", summary)
    note = f"\n{result.teardown_line()}\n" if result.teardown else ""
    if result.floor is not None:
        note += f"\n```\n{result.floor.table()}\n```\n"
    table = result.comparison.table()  # in a fence longer than any backtick run: a metric name
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", table)), default=0))
    text = f"# parity: {result.verdict}\n{note}\n{fence}\n{table}\n{fence}\n"  # can't close it
    write_text_atomic(result.dir / "summary.md", text)
