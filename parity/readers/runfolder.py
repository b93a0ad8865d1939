"""The run folder's per-rank and fingerprint files, read (what the diagnosis judges).

    ranks/rank{r}.jsonl   every rank's own metrics and, in ``_meta.data``, its batch digests
    fingerprints.jsonl    rank 0's hash of every parameter and gradient at chosen steps

The names are parity.record.runfolder's (the recorder writes what that module names); here
they are read into plain dicts, every malformed record a one-line DiagnosisError naming the file
and line. Judging them (A against B, rank against rank) is parity.judge.diagnose's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parity.readers.frame import MetricsError
from parity.record.runfolder import (
    FINGERPRINTS,
    RANKS_DIR,
    numbered_files,
    ranks_dir,
)

__all__ = [
    "DiagnosisError",
    "rank_files",
    "read_fingerprints",
    "read_rank_data",
    "records",
    "run_folder",
]


class DiagnosisError(MetricsError):
    """A diagnosis file that cannot be read; the message names the file and line."""


def run_folder(path: str | os.PathLike[str]) -> Path | None:
    """The run folder of a run folder or of a metrics file in one (None for a bare log file)."""
    p = Path(path)
    if p.is_dir():
        return p
    parent = p.parent
    has = (parent / RANKS_DIR).is_dir() or (parent / FINGERPRINTS).is_file()
    return parent if has else None


def records(path: Path) -> tuple[list[tuple[int, dict]], bool]:
    """(line number, record) of a JSONL file with an optional end record; complete or not.

    A last line cut off mid-write (no newline) is dropped and makes the file incomplete.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DiagnosisError(f"{path}: cannot read: {e}") from None
    lines = text.split("\n")
    out: list[tuple[int, dict]] = []
    seen: dict[int, int] = {}
    end: int | None = None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if end is not None:
            raise DiagnosisError(f"{path}:{lineno}: record after the end record of line {end}")
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:
            if lineno == len(lines):  # no newline after it: the writer was cut off
                return out, False
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise DiagnosisError(f"{path}:{lineno}: not valid JSON: {why}") from None
        if not isinstance(rec, dict):
            raise DiagnosisError(f"{path}:{lineno}: record is not a JSON object")
        if "event" in rec:
            if rec.get("event") != "end":
                raise DiagnosisError(f"{path}:{lineno}: unknown event {rec.get('event')!r}")
            end = lineno
            continue
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DiagnosisError(f"{path}:{lineno}: 'step' must be a non-negative integer")
        if step in seen:
            raise DiagnosisError(f"{path}:{lineno}: duplicate step {step} (line {seen[step]})")
        seen[step] = lineno
        out.append((lineno, rec))
    return out, end is not None


def rank_files(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """rank -> its ranks/rank{r}.jsonl, by rank ({} without a ranks/ folder)."""
    folder = ranks_dir(run_dir)
    try:
        return numbered_files(folder)
    except OSError as e:
        raise DiagnosisError(f"{folder}: cannot read: {e}") from None


def read_rank_data(run_dir: str | os.PathLike[str]) -> dict[int, dict[int, dict[str, dict]]]:
    """rank -> step -> {kind: {"hash", and counts}}, kinds as the job digested them (SFT: train,
    val; PPO also prompts, rollout).

    {} when the run has no ranks/ folder; DiagnosisError on a malformed record.
    """
    out: dict[int, dict[int, dict[str, dict]]] = {}
    for rank, path in rank_files(run_dir).items():
        steps: dict[int, dict[str, dict]] = {}
        for lineno, rec in records(path)[0]:
            meta = rec.get("_meta", {})
            data = meta.get("data", {}) if isinstance(meta, dict) else None
            where = f"{path}:{lineno}: step {rec['step']}"
            if not isinstance(data, dict):
                raise DiagnosisError(f"{where}: _meta.data is not a JSON object")
            for kind, d in data.items():
                if not isinstance(d, dict) or not isinstance(d.get("hash"), str):
                    raise DiagnosisError(f"{where}: _meta.data.{kind}.hash is not a string")
            steps[rec["step"]] = data
        out[rank] = steps
    return out


def read_fingerprints(path: str | os.PathLike[str]) -> dict[int, dict[str, dict[str, Any]]]:
    """step -> {"params": {name: hash}, "grads": {name: hash or None}} from fingerprints.jsonl."""
    path = Path(path)
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for lineno, rec in records(path)[0]:
        for key in ("params", "grads"):
            table = rec.get(key)
            if not isinstance(table, dict) or not all(
                isinstance(v, str) or v is None for v in table.values()
            ):
                raise DiagnosisError(
                    f"{path}:{lineno}: step {rec['step']}: {key!r} must map names to hashes"
                )
        out[rec["step"]] = {"params": rec["params"], "grads": rec["grads"]}
    return out
