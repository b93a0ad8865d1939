"""Run a job or a matched pair under torchrun and read back what it wrote.

A run folder holds what the job wrote (metrics.jsonl, console.log, manifest.json) next to what
the launcher captured (launcher.log, logs/ per rank). A pair folder holds a/, b/ and summary.*.
"""

from __future__ import annotations

import json
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


def run_job(spec: JobSpec, out: Path) -> Run:
    """Launch one job; raise LaunchError (rank, exit code or signal, log tail) if it failed."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = launch(
        spec.to_args(out),
        nproc=spec.nproc_per_node,
        run_dir=out,
        timeout_s=spec.timeout_s,
        torchrun_args=spec.torchrun_args,
    )
    if not result.ok:
        raise LaunchError(result)
    return Run(spec, out, result, read_metrics(out))


def run_pair(pair: PairSpec, out: Path, policies: dict | None = None) -> PairResult:
    """Both sides one after the other (2 cores: concurrency would only add noise), then compare."""
    out = Path(out).resolve()
    spec_a, spec_b = pair.sides()
    a = run_job(spec_a, out / "a")
    b = run_job(spec_b, out / "b")
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
