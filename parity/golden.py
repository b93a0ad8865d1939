"""Golden baselines: a stored run folder (exact metrics.jsonl + the fingerprint of its environment).

A golden is itself a minimal run folder, so every reader, `parity compare`, `parity report` and
`parity check --golden` take it as it is. A mismatch is judged by the fingerprint: the same
environment means a regression; a different one (torch, CPU instruction set, backend, device,
world size) means "environment changed: rebaseline", since bitwise equality was never promised
across environments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from parity.compare import Comparison, compare_frames, default_policy
from parity.files import write_json_atomic
from parity.readers import MetricsError, read_metrics, write_metrics

FINGERPRINT_KEYS = (
    "environment.python",
    "environment.torch",
    "environment.transformers",
    "environment.machine",
    "environment.cpu_isa",
    "environment.cuda",
    "environment.gpu",
    "backend",
    "device",
    "world_size",
    "determinism.num_threads",
)

MATCH, REGRESSION, ENV_CHANGED = "match", "regression", "environment changed: rebaseline"


class GoldenError(MetricsError):
    """A golden that cannot be compared at all (missing, wrong length, unknown metrics)."""


def fingerprint(manifest: dict[str, Any]) -> dict[str, Any]:
    """The environment facts of a run manifest that decide whether bits can be reproduced."""
    out: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        node: Any = manifest
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def _compared(frame: pd.DataFrame) -> pd.DataFrame:
    """Drop metrics whose default policy ignores them (timing): they never belong in a golden."""
    keep = [c for c in frame.columns if default_policy(c).kind != "ignore"]
    out = frame[keep]
    out.attrs = {k: v for k, v in frame.attrs.items() if k != "present"}
    return out


def _manifest(folder: Path) -> dict[str, Any]:
    """A run's or golden's manifest.json, or a one-line GoldenError naming the file."""
    path = Path(folder) / "manifest.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoldenError(f"{path}: missing (the environment fingerprint is needed)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoldenError(f"{path}: cannot read: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise GoldenError(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data


def save_golden(golden_dir: Path, run_dir: Path, spec: dict | None = None) -> None:
    """Make (or rewrite) a golden from a finished run folder."""
    golden_dir = Path(golden_dir)
    frame = _compared(read_metrics(run_dir))
    manifest = _manifest(run_dir)
    golden_dir.mkdir(parents=True, exist_ok=True)
    write_metrics(frame, golden_dir / "metrics.jsonl", "jsonl")
    write_json_atomic(
        golden_dir / "manifest.json",
        {"golden": {"spec": spec or {}}, **_nest(fingerprint(manifest))},
    )


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


@dataclass
class GoldenResult:
    status: str  # MATCH, REGRESSION or ENV_CHANGED
    comparison: Comparison
    environment_diff: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == MATCH

    def message(self) -> str:
        lines = [f"golden: {self.status}"]
        for key, (g, r) in self.environment_diff.items():
            lines.append(f"  {key}: golden {g!r}, run {r!r}")
        return "\n".join(lines + [self.comparison.table()])


def verify_golden(golden_dir: Path, run_dir: Path, policies=None) -> GoldenResult:
    """Compare a finished run with its golden; GoldenError when they cannot be compared."""
    golden_dir = Path(golden_dir)
    if not (golden_dir / "metrics.jsonl").exists():
        raise GoldenError(
            f"{golden_dir}: no golden here; make it with `pytest -m parity --parity-update-golden`"
        )
    golden = _compared(read_metrics(golden_dir))
    run = _compared(read_metrics(run_dir))
    if len(golden.index) != len(run.index) or list(golden.index) != list(run.index):
        raise GoldenError(
            f"{golden_dir / 'metrics.jsonl'}: golden has {len(golden.index)} steps "
            f"({golden.index.min()}..{golden.index.max()}), the run has {len(run.index)} "
            f"({run.index.min()}..{run.index.max()})"
        )
    unknown = sorted(set(golden.columns) ^ set(run.columns))
    if unknown:
        raise GoldenError(
            f"{golden_dir / 'metrics.jsonl'}: metrics not in both golden and run: "
            + ", ".join(unknown)
        )
    comparison = compare_frames(golden, run, policies)
    stored, current = _manifest(golden_dir), _manifest(run_dir)
    fa, fb = fingerprint(stored), fingerprint(current)
    diff = {k: (fa[k], fb[k]) for k in FINGERPRINT_KEYS if fa[k] != fb[k]}
    if comparison.ok:
        return GoldenResult(MATCH, comparison, diff)
    return GoldenResult(ENV_CHANGED if diff else REGRESSION, comparison, diff)
