"""Lightning's CSVLogger: `<save_dir>/lightning_logs/version_N/metrics.csv`.

What Lightning writes (`lightning.fabric.loggers.csv_logs` and `lightning.pytorch.loggers.
csv_logs`, the same code in `lightning_fabric` / `pytorch_lightning` 2.x): `log_metrics(metrics,
step)` keeps `{k: v.item() if a tensor else v, "step": step}`, and `save()` (every
`flush_logs_every_n_steps` and at the end) appends the kept rows with `csv.DictWriter`: the
excel dialect (`\\r\\n` line ends), `str()` of each value, an empty cell for a key the row
lacks. The header is every key seen so far, sorted (`step` among them); a new key rewrites the
whole file under the wider header. (1.9 kept the keys in first-seen order and rewrote the
whole file from memory at each save, always with `hparams.yaml` beside it: the same cells.)
The pytorch Trainer logs a dict per call: training metrics every `log_every_n_steps`,
validation and epoch-level metrics in rows of their own at the same `step` (the optimizer
steps taken), each row with an `epoch` column. The pytorch logger also writes `hparams.yaml`
beside the file.

So rows of one step merge into that step; a cell given twice with other bits follows the
duplicates rule. `epoch` is a metric like the others (Lightning's TensorBoard logger writes it
so too). Values are `str` of a Python float, i.e. its repr, which reads back to the same
float64 (a float32 tensor's `.item()` is a float64 holding the float32 value, and its repr keeps
it exactly): precision float64. An int is its digits, a bool `True`/`False` (1.0, 0.0). A cell
that is none of these is skipped and counted, and so is a number a float64 cannot hold
(`1e999`, `1e-400`: frame.UNFIT); a row without a step likewise, and a last row without its
newline (cut off by a save still writing or killed: a number cut there still parses). (A
numpy float32 given as is, not as a tensor, is written as its shortest float32 text, `0.1`,
which reads back as the float64 0.1: the file cannot tell, so it stays float64; against a
float32 source such as TensorBoard it is judged in float32 anyway.)

Detection: the name `metrics.csv`, a header with one `step` column, and Lightning's marks: the
file sits in `version_N/` or beside `hparams.yaml`, or its header is sorted with `step` not
first (which a table written step-first, like ours, is not). A folder: a `version_N` one, a
`lightning_logs` one holding versions, or the save_dir above it; several versions are several
runs (`--run version_N` picks one).
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pandas as pd

from parity.readers.frame import (
    FLOAT64,
    UNFIT,
    Cells,
    Duplicates,
    Format,
    MetricsError,
    ReadLog,
    ReadOptions,
    beyond_max_step,
    fail,
    finish,
    text_float,
)
from parity.readers.text import CUT_TAIL, cut_tail, decode, read_bytes

METRICS_FILE = "metrics.csv"
LOGS_DIR = "lightning_logs"
_VERSION = re.compile(r"version_([0-9]+)")
_BOOLS = {"True": 1.0, "False": 0.0}
NO_STEP = "rows without a step"
BAD_STEP = "rows whose step is not a non-negative integer"
NOT_NUMBER = "cells that are not numbers"


def _cell(text: str) -> float | str:
    """A cell as Lightning wrote it (str of a float, an int or a bool), or why it is skipped."""
    if text in _BOOLS:
        return _BOOLS[text]
    try:
        value = text_float(text)
    except ValueError:
        return NOT_NUMBER
    return UNFIT if value is None else value  # UNFIT: not what the file's number holds


def _good_header(names: list[str]) -> bool:
    """A metrics header: exactly one `step`, no empty or repeated names."""
    return names.count("step") == 1 and "" not in names and len(set(names)) == len(names)


def _header(first_line: bytes) -> list[str] | None:
    """The header's names if the file's first line is a metrics header, else None."""
    try:
        text = first_line.removeprefix(b"\xef\xbb\xbf").decode("utf-8").rstrip("\r")
        names = next(csv.reader([text]), None)
    except (UnicodeDecodeError, csv.Error):
        return None
    return names if names and _good_header(names) else None


def _read_file(file: Path, rule: Duplicates, log: ReadLog) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(values, present) of a metrics.csv (row by row: 100k rows of 3 metrics in about 1 s)."""
    text = decode(read_bytes(file), file)
    return _read_rows(text, file, log).frames(file, rule, log)


def _read_rows(text: str, file: Path, log: ReadLog) -> Cells:
    """The cells of each row with a step; what cannot be used is skipped and counted."""
    text, cut = cut_tail(text)
    if cut is not None:
        log.skip(CUT_TAIL, cut)
    reader = csv.reader(io.StringIO(text, newline=""))
    cells = Cells()
    try:
        names = next(reader, None)
        if names is None and cut is not None:
            raise fail(file, cut, "no metrics records: the only line has no newline (cut off)")
        if not names or not _good_header(names):
            raise fail(file, 1, "header needs exactly one 'step' column and unique names")
        si = names.index("step")
        last_step: int | None = None
        for row in reader:
            lineno = reader.line_num
            if not row:
                continue
            if len(row) != len(names):
                raise fail(file, lineno, f"expected {len(names)} fields, got {len(row)}")
            raw_step = row[si].strip()
            if not raw_step:
                log.skip(NO_STEP, lineno)
                continue
            if not (raw_step.isascii() and raw_step.isdigit()) or beyond_max_step(raw_step):
                log.skip(BAD_STEP, lineno)
                continue
            step = int(raw_step)
            if last_step is not None and step < last_step:
                log.note(
                    f"steps go back at line {lineno} (step {step} after {last_step}): "
                    "a resumed or appended run?"
                )
            last_step = step
            group = cells.record(step, lineno)
            for i, text_value in enumerate(row):
                if i == si or text_value == "":
                    continue
                value = _cell(text_value)
                if isinstance(value, str):
                    log.skip(value, f"line {lineno} ({names[i]})")
                    continue
                cells.add(group, names[i], value)
    except csv.Error as e:
        raise fail(file, reader.line_num, f"bad csv: {e}") from None
    if not cells.steps:
        why = f"; line {cut}, the last, has no newline: cut off" if cut is not None else ""
        raise fail(file, None, f"no metrics records (no row with a step{why})")
    return cells


def _versions(folder: Path) -> dict[str, Path]:
    """The runs under a folder: its children that hold a Lightning metrics.csv, by name."""
    try:
        children = [d for d in folder.iterdir() if d.is_dir()]
    except OSError:
        return {}
    found = [d for d in children if _is_lightning(d / METRICS_FILE)]

    def order(d: Path) -> tuple[int, int, str]:
        m = _VERSION.fullmatch(d.name)
        return (0, int(m[1]), "") if m else (1, 0, d.name)

    return {d.name: d / METRICS_FILE for d in sorted(found, key=order)}


def _runs(path: Path) -> dict[str, Path]:
    """Run name -> metrics.csv for a folder: a version folder, lightning_logs, or the save_dir
    above it."""
    if _is_lightning(path / METRICS_FILE):
        return {path.name: path / METRICS_FILE}
    runs = _versions(path)
    if not runs and (path / LOGS_DIR).is_dir():
        runs = _versions(path / LOGS_DIR)
    return runs


def _pick(path: Path, run: str | None) -> Path:
    runs = _runs(path)
    if not runs:
        raise fail(path, None, f"no Lightning {METRICS_FILE} here nor in version_N folders")
    if run is None:
        if len(runs) > 1:
            raise fail(
                path, None, f"holds {len(runs)} runs: {', '.join(runs)}; choose one with --run"
            )
        return next(iter(runs.values()))
    name = run if run in runs else f"version_{run}"
    if name not in runs:
        raise fail(path, None, f"no run {run!r} (have: {', '.join(runs)})")
    return runs[name]


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    if path.is_dir():
        file = _pick(path, options.run)
    elif options.run is not None:
        raise fail(path, None, f"--run {options.run!r} picks a run of a folder; this is one file")
    else:
        file = path
    log = ReadLog()
    values, present = _read_file(file, options.duplicates, log)
    return finish(
        values, present, source=file, fmt="lightning-csv", precision=FLOAT64, log=log,
        written=True,
    )  # fmt: skip


def _is_lightning(file: Path, head: bytes | None = None) -> bool:
    """Whether `file` is a Lightning CSVLogger metrics.csv (see the module doc)."""
    if file.name != METRICS_FILE:
        return False
    if head is None:
        try:
            with file.open("rb") as f:
                head = f.readline(64 << 10)
        except OSError:
            return False
    names = _header(head.split(b"\n", 1)[0])
    if names is None:
        return False
    folder = file.parent
    if _VERSION.fullmatch(folder.name) or (folder / "hparams.yaml").is_file():
        return True
    return names == sorted(names) and names[0] != "step"


def _claims(path: Path, head: bytes | None) -> bool:
    if head is not None:
        return _is_lightning(path, head)
    try:
        return bool(_runs(path))
    except (OSError, MetricsError):
        return False


FORMATS = [
    Format(
        "lightning-csv",
        _read,
        _claims,
        "Lightning CSVLogger's `metrics.csv` (in `version_N/`, beside `hparams.yaml`, or with "
        "its sorted header), a `version_N` or `lightning_logs` folder, or the save_dir above",
        FLOAT64,
    )
]
