"""A matched pair: both sides run (one after the other, in one launch, or A twice first for the
noise floor), compared, and summarized (the orchestration layer, over parity.runs).

A pair folder holds a/, b/ (a-repeat/ with the noise floor) and summary.json / summary.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity import runs
from parity.compare import Comparison, Policy, compare_frames
from parity.diagnose import diagnose
from parity.files import LAUNCH_SUFFIX, write_json_atomic, write_text_atomic
from parity.launch import LaunchResult
from parity.noise import NONDETERMINISTIC, NoiseFloor, floor_from_frames
from parity.outdir import OutDir
from parity.runs import Run
from parity.spec import JobSpec, PairSpec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from parity.revisions import CheckResult


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


def side_label(side: str, spec: JobSpec) -> str:
    """How progress lines and errors name a side: `side b`, with its trainer for a preset."""
    return f"side {side}" if spec.task == "custom" else f"side {side} ({spec.trainer})"


def measure_floor(
    spec: JobSpec,
    out: Path,
    policies: Mapping[str, Policy | str] | None = None,
    *,
    a: Any = None,
) -> tuple[Any, Any, NoiseFloor]:
    """Run ``spec`` (unless ``a``, a Run of it, is given) and its repeat under out/a-repeat.

    Returns (A, A', floor); raises LaunchError when either run fails.
    """
    out = Path(out).resolve()
    if a is None:
        a = runs.run_job(spec, out / "a", label=side_label("a", spec))
    repeat = runs.run_job(spec, out / "a-repeat", label=side_label("a'", spec))
    floor = floor_from_frames(a.metrics, repeat.metrics, policies)
    floor.a_dir, floor.repeat_dir, floor.runs = a.dir, repeat.dir, (a, repeat)
    return a, repeat, floor


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
    with OutDir.open(out) as held:
        held.claim(*PAIR_ENTRIES)  # before anything runs: refused if the user's is in the way
        return _run_pair(
            pair, spec_a, spec_b, out, policies, in_process, allow_teardown_failure, noise_floor
        )


#: what a pair writes in its folder: the sides' run and launch folders, the noise floor's
#: repeat, the in-process launch, the op-trace reruns, the summary and the report
PAIR_ENTRIES = tuple(
    name
    for side in ("a", "b", "a-repeat", "trace-a", "trace-b")
    for name in (side, side + LAUNCH_SUFFIX)
) + ("in-process", "summary.json", "summary.md", "report.md", "report.html")


def _run_pair(
    pair: PairSpec,
    spec_a: JobSpec,
    spec_b: JobSpec,
    out: Path,
    policies: dict | None,
    in_process: bool,
    allow_teardown_failure: bool,
    noise_floor: bool,
) -> PairResult:
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
            a = runs.run_job(
                spec_a, out / "a", label=side_label("a", spec_a), allow_teardown_failure=True
            )
        b = runs.run_job(
            spec_b, out / "b", label=side_label("b", spec_b), allow_teardown_failure=True
        )
    comparison = compare_frames(a.metrics, b.metrics, policies)
    result = PairResult(a, b, comparison, out, allow_teardown_failure, floor=floor)
    write_summary(result)
    return result


def write_summary(result: PairResult) -> None:
    comparison = result.comparison.to_dict()
    sources = {side: comparison.pop(side) for side in ("a", "b")}  # the metrics files
    summary = {
        **comparison,
        "a": {"spec": result.a.spec.shown(), "dir": str(result.a.dir), "metrics": sources["a"]},
        "b": {"spec": result.b.spec.shown(), "dir": str(result.b.dir), "metrics": sources["b"]},
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
