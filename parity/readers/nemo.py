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
  int; so is `[n]` when every step of the file is one number.
- a list, from scripts that call dllogger themselves (NVIDIA's DeepLearningExamples):
  `[epoch, global_step]`, `[epoch, iteration]` (the iteration restarting every epoch),
  `[epoch, iteration, val_iteration]` for validation rows, `[epoch]` for an epoch's summary
  (dllogger's examples/example_resnet_log.json has them all). Once one step has two numbers or
  more, every step is its list, and the lists are numbered 1, 2, 3, ... in the order they first
  appear: records of one list merge into one step, and the frame's
  attrs["step_labels"] = {step: list} keeps what each step was (said in the notes too). Two
  runs are compared label by label (parity.readers.labels: a list one run lacks is a
  missing step, not a value set against the next list's). Lists of
  one length have an order of their own; one that first appears after a later one of its length
  (`[0, 10]` first seen after `[0, 20]`) makes the numbering contradict it: a one-line error.
- `[]` (a run summary, NeMo's `step=None`) and a string (`"PARAMETER"` for hyperparameters,
  also `"MEMORY"` and the like) are not per-step metrics: left out by design, said once in the
  notes. So are METADATA records and lines without the `DLLL ` prefix.

A `DLLL` line that does not parse (the last one, without its newline: cut off), a LOG record
without a usable step or data object, a value that is not a number (a string, a bool, null)
and a number a float64 cannot hold (`1e999`, frame.UNFIT) are skipped and counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from parity.readers.frame import (
    FLOAT64,
    MAX_STEP,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    Unfit,
    fail,
    finish,
    fit_number,
    json_float,
)
from parity.readers.text import CUT_TAIL, read_bytes

PREFIX = b"DLLL "
UNPARSED = "DLLL lines that do not parse"
NO_STEP = "LOG records without a usable step"
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


def _value(value: Any) -> float | str:
    """A data value as float64, or why it is skipped."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Unfit)):
        return NOT_NUMBER
    number = fit_number(value)
    return UNFIT if number is None else number


def _label(key: tuple[int, ...]) -> str:
    return str(list(key))


class _Reader:
    """One pass over the lines, then the steps (``frame``); keeps what the notes and errors
    need."""

    def __init__(self, path: Path, log: ReadLog) -> None:
        self.path, self.log = path, log
        self.rows: list[tuple[int, tuple[int, ...], dict[str, Any]]] = []  # line, step, data
        self.labels: dict[str, int] = {}
        self.left_out = {"summary": 0, "metadata": 0, "foreign": 0}

    def line(self, lineno: int, raw: bytes, last: bool = False) -> None:
        """One line; `last`: it has no newline after it (a cut one does not parse)."""
        if not raw.strip():
            return
        unparsed = CUT_TAIL if last else UNPARSED
        if not raw.startswith(PREFIX):
            if b"DLLL" in raw:  # a record cut or glued to other output
                self.log.skip(unparsed, lineno)
            else:
                self.left_out["foreign"] += 1
            return
        try:
            text = raw[len(PREFIX) :].decode("utf-8")
            rec = json.loads(text, object_pairs_hook=_pairs, parse_float=json_float)
        except (ValueError, _Unusable, RecursionError):
            self.log.skip(unparsed, lineno)
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
        self.rows.append((lineno, key, data))

    def steps(self) -> dict[tuple[int, ...], int] | None:
        """Each step list's number in order of first appearance, when some list has two
        numbers or more; None when every step is one number (that number is the step)."""
        if all(len(key) == 1 for _, key, _ in self.rows):
            return None
        number: dict[tuple[int, ...], int] = {}
        newest: dict[int, tuple[tuple[int, ...], int]] = {}  # length -> (latest new list, line)
        for lineno, key, _ in self.rows:
            if key in number:
                continue
            before = newest.get(len(key))
            if before is not None and key < before[0]:
                raise fail(
                    self.path,
                    lineno,
                    f"step {_label(key)} first appears after {_label(before[0])} (line "
                    f"{before[1]}): numbered in order of first appearance, the steps would "
                    "contradict their own order",
                )
            newest[len(key)] = (key, lineno)
            number[key] = len(number) + 1
        return number

    def frame_cells(self) -> tuple[Cells, dict[int, list[int]] | None]:
        """The cells at their steps, and the step labels when the steps are numbered lists."""
        numbers = self.steps()
        cells = Cells()
        for lineno, key, data in self.rows:
            group = cells.record(key[0] if numbers is None else numbers[key], lineno)
            for name, value in data.items():
                number = _value(value) if name and name != "step" else NOT_NUMBER
                if isinstance(number, str):
                    self.log.skip(number, f"line {lineno} ({name!r})")
                    continue
                cells.add(group, name, number)
        if numbers is None:
            return cells, None
        labels = {n: list(key) for key, n in numbers.items()}
        shown = ", ".join(f"{n} = {_label(k)}" for k, n in list(numbers.items())[:4])
        more = f", ..., {len(numbers)} = {labels[len(numbers)]}" if len(numbers) > 4 else ""
        self.log.note(
            "steps are lists ([epoch, iteration], ...), numbered in order of first appearance "
            f"(attrs step_labels): {shown}{more}"
        )
        return cells, labels

    def notes(self) -> None:
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
    lines = raw.split(b"\n")
    for lineno, line in enumerate(lines, 1):
        reader.line(lineno, line.removesuffix(b"\r"), last=lineno == len(lines))
    cells, labels = reader.frame_cells()
    reader.notes()
    if not cells.steps:
        why = "; ".join(log.notes + [f"{r['count']} {r['reason']}" for r in log.records()])
        raise fail(path, None, "no DLLogger LOG records with a step" + (f" ({why})" if why else ""))
    values, present = cells.frames(path, options.duplicates, log)
    return finish(
        values,
        present,
        source=path,
        fmt="nemo-dllogger",
        precision=FLOAT64,
        log=log,
        step_labels=labels,
        written=True,
    )


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
