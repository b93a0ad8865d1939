"""Run one job under torchrun and read back what it wrote (the running layer; a matched pair
of jobs is parity.pair).

A run folder holds what the job wrote (metrics.jsonl, console.log, manifest.json) next to what
the launcher captured (launcher.log, logs/ per rank).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from parity.launch import LaunchError, LaunchResult, launch, launch_nodes
from parity.readers import MetricsError, read_metrics
from parity.spec import JobSpec


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
