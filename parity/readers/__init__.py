"""Every metric format into one exact pandas frame (the contract: parity/readers/frame.py).

One module per format; each declares its ``FORMATS`` (name, how it claims a path, how it reads
it). ``read_metrics`` picks the format by ``--format`` or by asking each in ``_MODULES`` order,
the specific ones (a TensorBoard event file, a W&B run) before the generic ones (JSON lines,
CSV, and last of all verl's console lines, which may hide in any text).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pandas as pd

from parity.readers.frame import (
    DUPLICATE_RULES,
    HEAD_BYTES,
    Duplicates,
    Format,
    IncompleteRunError,
    MetricsError,
    ReadOptions,
    SkippedRecordsError,
    present_mask,
    read_summary,
    skipped_count,
)
from parity.readers.write import WRITABLE, write_metrics

__all__ = [
    "DUPLICATE_RULES",
    "FORMATS",
    "REGISTRY",
    "WRITABLE",
    "Format",
    "IncompleteRunError",
    "MetricsError",
    "SkippedRecordsError",
    "detect",
    "present_mask",
    "read_metrics",
    "read_summary",
    "skipped_count",
    "write_metrics",
]

# detection order: specific formats first, generic text last
_MODULES = (
    "hf",  # before tensorboard: HF's output_dir holds both, and trainer_state is float64
    "tensorboard",
    "wandb",
    "mlflow",
    "lightning",
    "nemo",
    "baselines",
    "jsonl",
    "csv_table",
    "verl_console",
)


def _registry() -> dict[str, Format]:
    out: dict[str, Format] = {}
    for name in _MODULES:
        for fmt in importlib.import_module(f"parity.readers.{name}").FORMATS:
            if fmt.name in out:
                raise RuntimeError(f"two readers named {fmt.name!r}")
            out[fmt.name] = fmt
    return out


REGISTRY: dict[str, Format] = _registry()
FORMATS: tuple[str, ...] = tuple(REGISTRY)


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(HEAD_BYTES)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None


def detect(path: str | os.PathLike[str]) -> Format:
    """The format that claims ``path`` (a file or a run folder); a one-line error if none does."""
    p = Path(path)
    if not p.exists():
        raise MetricsError(f"{p}: cannot read: no such file or folder")
    if p.is_dir():
        if (p / "metrics.jsonl").is_file():  # our run folder
            return REGISTRY["jsonl"]
        for fmt in REGISTRY.values():
            if fmt.claims(p, None):
                return fmt
        raise MetricsError(
            f"{path}: folder has no metrics.jsonl, and no other run output this tool reads "
            "(TensorBoard events, a W&B run, mlruns/, trainer_state.json, metrics.csv); "
            "give the file itself or --format"
        )
    head = _head(p)
    if not head.strip():
        raise MetricsError(f"{p}: no metrics records (empty file)")
    for fmt in REGISTRY.values():
        if fmt.claims(p, head):
            return fmt
    raise MetricsError(
        f"{p}: unknown format: none of {', '.join(FORMATS)} (give --format to say which)"
    )


def read_metrics(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    run: str | None = None,
    duplicates: Duplicates = "error",
) -> pd.DataFrame:
    """Read a metrics file or run folder into the canonical exact frame (parity.readers.frame).

    fmt: a name of ``FORMATS`` (default: detected). run: which run of a folder holding several
    (TensorBoard, W&B, MLflow). duplicates: the rule for a (step, metric) logged twice with other
    bits: "error" (default) names it; "first" or "last" keeps one and says so in attrs["notes"].
    """
    if fmt is not None and fmt not in REGISTRY:
        raise ValueError(f"unknown metrics format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if duplicates not in DUPLICATE_RULES:
        raise ValueError(f"unknown duplicates rule {duplicates!r}; expected first, last or error")
    p = Path(path)
    if fmt is None:
        chosen = detect(p)
    else:
        if not p.exists():
            raise MetricsError(f"{p}: cannot read: no such file or folder")
        chosen = REGISTRY[fmt]
        if p.is_dir() and fmt == "jsonl" and not (p / "metrics.jsonl").is_file():
            raise MetricsError(f"{path}: folder has no metrics.jsonl")
    return chosen.read(p, ReadOptions(run=run, duplicates=duplicates))
