"""Run a job or a matched pair under torchrun and read back what it wrote.

A run folder holds what the job wrote (metrics.jsonl, console.log, manifest.json) next to what
the launcher captured (launcher.log, logs/ per rank). A pair folder holds a/, b/ and summary.*.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from parity.compare import Comparison, compare_frames
from parity.files import write_json_atomic, write_text_atomic
from parity.launch import LaunchError, LaunchResult, launch
from parity.readers import read_metrics
from parity.spec import JobSpec, PairSpec


@dataclass
class Run:
    spec: JobSpec
    dir: Path
    launch: LaunchResult
    metrics: pd.DataFrame

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

    @property
    def ok(self) -> bool:
        return self.comparison.ok


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


def run_job(spec: JobSpec, out: Path, label: str | None = None) -> Run:
    """Launch one job; raise LaunchError (rank, exit code or signal, log tail) if it failed."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(label or out.name, spec.steps, out / "metrics.jsonl")
    try:
        result = launch(
            spec.to_args(out),
            nproc=spec.nproc_per_node,
            run_dir=out,
            timeout_s=spec.timeout_s,
            torchrun_args=spec.torchrun_args,
            on_tick=progress.tick,
        )
    finally:
        progress.close()
    if not result.ok:
        raise LaunchError(result)
    return Run(spec, out, result, read_metrics(out))


def run_pair(pair: PairSpec, out: Path, policies: dict | None = None) -> PairResult:
    """Both sides one after the other (2 cores: concurrency would only add noise), then compare."""
    out = Path(out).resolve()
    spec_a, spec_b = pair.sides()
    a = run_job(spec_a, out / "a", label=f"A {spec_a.trainer}")
    b = run_job(spec_b, out / "b", label=f"B {spec_b.trainer}")
    comparison = compare_frames(a.metrics, b.metrics, policies)
    result = PairResult(a, b, comparison, out)
    write_summary(result)
    return result


def write_summary(result: PairResult) -> None:
    summary = {
        "verdict": result.comparison.verdict,
        "a": {"spec": result.a.spec.to_dict(), "dir": str(result.a.dir)},
        "b": {"spec": result.b.spec.to_dict(), "dir": str(result.b.dir)},
        "seconds": {"a": result.a.launch.duration_s, "b": result.b.launch.duration_s},
        **result.comparison.to_dict(),
    }
    write_json_atomic(result.dir / "summary.json", summary)
    text = f"# parity: {result.comparison.verdict}\n\n```\n{result.comparison.table()}\n```\n"
    write_text_atomic(result.dir / "summary.md", text)
