"""A CSV table with one `step` column and one column per metric (verl's CSV, ours to write).

Values are float64 as Python's repr writes them; an empty cell is absent.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

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
from parity.readers.text import decode, read_bytes


def read_csv_cells(text: str, path: Path, rule: str = "error") -> Cells:
    cells = Cells()
    reader = csv.reader(io.StringIO(text, newline=""))
    first_line: dict[int, int] = {}
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            raise fail(path, None, "no metrics records")
        names = list(header)
        if names.count("step") != 1:
            raise fail(path, reader.line_num, "header needs exactly one 'step' column")
        if len(set(names)) != len(names) or "" in names:
            raise fail(path, reader.line_num, "header has empty or repeated column names")
        si = names.index("step")
        for row in reader:
            if not row:
                continue
            lineno = reader.line_num
            if len(row) != len(names):
                raise fail(path, lineno, f"expected {len(names)} fields, got {len(row)}")
            raw_step = row[si].strip()
            if not re.fullmatch(r"[0-9]+", raw_step, re.ASCII) or int(raw_step) > MAX_STEP:
                raise fail(path, lineno, f"step must be a non-negative integer, got {raw_step!r}")
            step = int(raw_step)
            if step in first_line and rule == "error":
                raise fail(
                    path,
                    lineno,
                    f"duplicate step {step} (first at line {first_line[step]}): a restarted or "
                    "appended run? choose a rule: --duplicates first|last",
                )
            first_line.setdefault(step, lineno)
            group = cells.record(step, lineno)
            for i, cell in enumerate(row):
                if i == si or cell == "":
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    raise fail(
                        path, lineno, f"value of {names[i]!r} is not numeric: {cell!r}"
                    ) from None
                cells.add(group, names[i], value)
    except csv.Error as e:
        raise fail(path, reader.line_num, f"bad csv: {e}") from None
    return cells


def _read(path: Path, options: ReadOptions):
    cells = read_csv_cells(decode(read_bytes(path), path), path, options.duplicates)
    if not cells.steps:
        raise fail(path, None, "no metrics records")
    log = ReadLog()
    values, present = cells.frames(path, options.duplicates, log)
    return finish(values, present, source=path, fmt="csv", precision=FLOAT64, log=log)


def _claims(path: Path, head: bytes | None) -> bool:
    return head is not None and path.suffix.lower() == ".csv"


FORMATS = [Format("csv", _read, _claims, "a `.csv` file with a `step` column", FLOAT64)]
