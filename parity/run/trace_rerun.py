"""After a pair diverged on the same batches: rerun both sides up to the first divergent step
with every op of that step traced, and name the first op that differs.

The diagnosis of a pair says "same batches, numbers differ from step k" when the data matched and
the numbers did not. Then (parity.pair.trace_divergence, part of run_pair and so of `parity pair`
unless trace=False / --no-trace) `trace_first_divergence` reruns each side as it was run (same spec,
mutants included) with `--trace-step k --stop-after k`: the schedule is still the full run's, the
job only ends after step k. Where both sides saved their state before k (`--save-state-at s`),
the reruns resume from the latest such state (`--resume`) instead of training from step 1. The two
traces are compared by `parity.judge.opdiff.compare_ops`.

A preset says how its job is asked for this (parity.tasks.Task.traced; the charcount ones with
flags, PPO tracing the actor's first update of the step). A `custom` command cannot be asked for a
trace: its loop wraps the step in `parity.record.trace_ops` itself, and the reason says so.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from parity.judge.opdiff import OpDiff, compare_ops
from parity.record.runfolder import OPS_DIR
from parity.spec import JobSpec, SpecError

_STATE = re.compile(r"state_step(\d+)$")


@dataclass
class TraceRerun:
    """What the reruns found: the op comparison, where they ran, and what they cost."""

    ops: OpDiff = field(default_factory=OpDiff)
    step: int | None = None
    resumed_from: int | None = None  # the saved step both reruns started after
    dirs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""  # why nothing was rerun

    def line(self) -> str:
        if self.reason:
            return f"op trace not rerun: {self.reason}"
        start = f"from the state saved at step {self.resumed_from}" if self.resumed_from else (
            "from step 1")  # fmt: skip
        text = f"op trace: both sides rerun {start} to step {self.step}, which was traced "
        text += f"({self.seconds:.0f} s)"
        if self.ops.status == "unavailable":  # else the ops line says what the traces show
            text += f": {self.ops.detail}"
        return text

    def to_dict(self) -> dict:
        return {
            "step": self.step, "resumed_from": self.resumed_from, "dirs": self.dirs,
            "seconds": self.seconds, "reason": self.reason, "line": self.line(),
            "ops": self.ops.to_dict(),
        }  # fmt: skip


def saved_states(run_dir: Path) -> dict[int, Path]:
    """The complete states a job saved (`--save-state-at`): step -> folder."""
    out = {}
    for p in Path(run_dir).glob("state_step*"):
        m = _STATE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def trace_first_divergence(
    spec_a: JobSpec,
    spec_b: JobSpec,
    dirs: tuple[Path, Path],
    step: int | None,
    out: Path,
    *,
    run_job=None,
) -> TraceRerun:
    """Rerun A and B (run before in `dirs`) up to `step` with it traced, into out/trace-{a,b}.

    run_job: what runs each rerun (parity.run.job.run_job's call, that one by default), or one
    per side ({"a": ..., "b": ...}: `parity check` reruns each revision in its worktree)."""
    if run_job is None:
        from parity.run.job import run_job
    result = TraceRerun(step=step)
    if step is None or step < 1:
        result.reason = "the runs differ before their first training step"
        return result
    for spec in (spec_a, spec_b):
        if spec.preset is None or spec.preset.traced is None:
            result.reason = (
                f"task {spec.task!r} cannot be asked for a trace; wrap step {step} of the loop "
                "in parity.record.trace_ops and run both sides again"
            )
            return result
    states = [saved_states(d) for d in dirs]
    common = sorted(s for s in set(states[0]) & set(states[1]) if s < step)
    resumed = common[-1] if common else None
    reruns = {}
    for side, spec, saved in (("a", spec_a, states[0]), ("b", spec_b, states[1])):
        try:
            reruns[side] = spec.preset.traced(spec, step, saved.get(resumed))
        except SpecError as e:
            result.reason = str(e)
            return result
    start = time.perf_counter()
    for side, traced in reruns.items():
        folder = Path(out) / f"trace-{side}"
        run = run_job[side] if isinstance(run_job, Mapping) else run_job
        run(traced, folder, label=f"trace {side} step {step}")
        result.dirs[side] = str(folder)
    result.seconds = time.perf_counter() - start
    result.resumed_from = resumed
    result.ops = compare_ops(Path(result.dirs["a"]), Path(result.dirs["b"]))
    return result


def install_traces(rerun: TraceRerun, run_dirs: dict[str, Path]) -> None:
    """Copy each rerun's ops/ into the run folder it reran (atomically; an existing trace is
    kept), so the diagnosis and the report of the pair find them where a traced run has them."""
    for side, run_dir in run_dirs.items():
        src, dst = Path(rerun.dirs[side]) / OPS_DIR, Path(run_dir) / OPS_DIR
        if not src.is_dir() or dst.exists():
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{OPS_DIR}-", dir=run_dir))  # a new name: the job's
        try:  # files in run_dir are never removed or replaced
            shutil.copytree(src, tmp / OPS_DIR)
            os.rename(tmp / OPS_DIR, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
