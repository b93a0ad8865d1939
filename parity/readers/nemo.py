"""NeMo's DLLogger file: `DLLL {json}` lines, as NVIDIA's dllogger JSONStreamBackend writes them.

The backend (github.com/NVIDIA/dllogger, dllogger/logger.py; not on PyPI, whose
`nvidia-dllogger` is a placeholder) writes one line per call, `"DLLL " + json.dumps(...)`:
- a LOG record `{"timestamp": "...", "datetime": "...", "elapsedtime": "...", "type": "LOG",
  "step": STEP, "data": {metric: value}}`; the values are Python's JSON numbers (float repr, so
  float64 exactly; `NaN`/`Infinity` as json.dumps writes them);
- a METADATA record `{"type": "METADATA", "metric": ..., "metadata": {"unit", "format"}}`:
  how the stdout backend prints a metric, no values.

What STEP holds, and how it becomes the frame's step:
- an int. NeMo's DLLogger (nemo/utils/loggers/dllogger.py) is a Lightning logger, so
  Lightning calls it with `step=fit_loop.epoch_loop._batches_that_stepped` (the optimizer steps
  taken, the step its TensorBoard logger uses too) and adds an `epoch` metric. The step is that
  int.
- a list, from scripts that call dllogger themselves (NVIDIA's DeepLearningExamples):
  `[epoch, global_step]`, `[epoch, iteration]`, `[epoch, iteration, val_iteration]`. The step is
  the LAST element; the first LOG record's list length is the axis. Records whose list has
  another length (an `[epoch]` summary among `[epoch, iteration]` rows) are skipped and counted,
  and two different lists with the same last element (an iteration counter that restarts each
  epoch) are a one-line error: they have no common step axis. `[n]` is the int n.
- `[]` (a run summary, NeMo's `step=None`) and a string (`"PARAMETER"` for hyperparameters,
  also `"MEMORY"` and the like) are not per-step metrics: left out by design, said once in the
  notes. So are METADATA records and lines without the `DLLL ` prefix.

A `DLLL` line that does not parse, a LOG record without a usable step or data object, and a
value that is not a number (a string, a bool, null) are skipped and counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from parity.readers.frame import (
    FLOAT64,
    MAX_STEP,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    fail,
    finish,
)
from parity.readers.text import read_bytes

PREFIX = b"DLLL "
UNPARSED = "DLLL lines that do not parse"
NO_STEP = "LOG records without a usable step"
OTHER_SHAPE = "LOG records whose step has another shape than the first's"
NO_DATA = "LOG records without a data object"
NOT_NUMBER = "values that are not numbers"
UNKNOWN_TYPE = "DLLL records of an unknown type"


class _Unusable(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Unusable("a key given twice")
    return obj


def _step_key(step: Any) -> tuple[int, ...] | str | None:
    """The step as a tuple of ints, a label (a string) or None when it is unusable."""
    if isinstance(step, str):
        return step
    items = step if isinstance(step, list) else [step]
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_STEP:
            return None
    return tuple(items)


def _value(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


class _Reader:
    """One pass over the lines; keeps what the notes and errors need."""

    def __init__(self, path: Path, log: ReadLog) -> None:
        self.path, self.log, self.cells = path, log, Cells()
        self.shape: int | None = None  # the list length of the first usable LOG step
        self.owner: dict[int, tuple[tuple[int, ...], int]] = {}  # step -> (key, line)
        self.labels: dict[str, int] = {}
        self.left_out = {"summary": 0, "metadata": 0, "foreign": 0}

    def line(self, lineno: int, raw: bytes) -> None:
        if not raw.strip():
            return
        if not raw.startswith(PREFIX):
            if b"DLLL" in raw:  # a record cut or glued to other output
                self.log.skip(UNPARSED, lineno)
            else:
                self.left_out["foreign"] += 1
            return
        try:
            rec = json.loads(raw[len(PREFIX) :].decode("utf-8"), object_pairs_hook=_pairs)
        except (ValueError, _Unusable, RecursionError):
            self.log.skip(UNPARSED, lineno)
            return
        if not isinstance(rec, dict):
            self.log.skip(UNPARSED, lineno)
        elif rec.get("type") == "METADATA":
            self.left_out["metadata"] += 1
        elif rec.get("type") != "LOG":
            self.log.skip(UNKNOWN_TYPE, lineno)
        else:
            self.record(lineno, rec)

    def record(self, lineno: int, rec: dict[str, Any]) -> None:
        key = _step_key(rec.get("step")) if "step" in rec else None
        if isinstance(key, str):
            self.labels[key] = self.labels.get(key, 0) + 1
            return
        if key == ():
            self.left_out["summary"] += 1
            return
        if key is None:
            self.log.skip(NO_STEP, lineno)
            return
        data = rec.get("data")
        if not isinstance(data, dict):
            self.log.skip(NO_DATA, lineno)
            return
        if self.shape is None:
            self.shape = len(key)
        elif len(key) != self.shape:
            self.log.skip(OTHER_SHAPE, lineno)
            return
        step = key[-1]
        seen = self.owner.setdefault(step, (key, lineno))
        if seen[0] != key:
            raise fail(
                self.path,
                lineno,
                f"step {list(key)} maps to step {step}, as {list(seen[0])} did at line "
                f"{seen[1]}: the last element is not a global step, so these records have no "
                "common step axis",
            )
        group = self.cells.record(step, lineno)
        for name, value in data.items():
            number = _value(value)
            if number is None or not name or name == "step":
                self.log.skip(NOT_NUMBER, f"line {lineno} ({name!r})")
                continue
            self.cells.add(group, name, number)

    def notes(self) -> None:
        if self.shape is not None and self.shape > 1:
            self.log.note(
                f"steps are lists of {self.shape} numbers ([epoch, ..., step]): the step is "
                "the last one"
            )
        for label, n in self.labels.items():
            what = "hyperparameters" if label == "PARAMETER" else "a label, not a step"
            self.log.note(f"left out {n} LOG records with step {label!r} ({what})")
        words = {
            "summary": "LOG records with step [] (a run summary, no step)",
            "metadata": "METADATA records (units and print formats, no values)",
            "foreign": "lines without the 'DLLL ' prefix",
        }
        for what, n in self.left_out.items():
            if n:
                self.log.note(f"left out {n} {words[what]}")


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    raw = read_bytes(path)
    log = ReadLog()
    reader = _Reader(path, log)
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        reader.line(lineno, line.removesuffix(b"\r"))
    reader.notes()
    if not reader.cells.steps:
        why = "; ".join(log.notes + [f"{r['count']} {r['reason']}" for r in log.records()])
        raise fail(path, None, "no DLLogger LOG records with a step" + (f" ({why})" if why else ""))
    values, present = reader.cells.frames(path, options.duplicates, log)
    return finish(values, present, source=path, fmt="nemo-dllogger", precision=FLOAT64, log=log)


def _claims(path: Path, head: bytes | None) -> bool:
    if head is None:
        return False
    first = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    return first.startswith(PREFIX)


FORMATS = [
    Format(
        "nemo-dllogger",
        _read,
        _claims,
        "a file whose first line starts with `DLLL ` (NeMo's DLLogger, dllogger's JSON backend)",
        FLOAT64,
    )
]
