"""A CSV table with one `step` column and one column per metric (verl's CSV, ours to write).

Values are float64 as Python's repr writes them (a column whose values all look rounded, e.g.
`%.4f`, is read at its decimals: frame.rounded_places); an empty cell is absent. Rows of one
step merge (a sparse table gives `1,0.5,` and `1,,0.4`: loss and val_loss of step 1); a metric
given twice at a step with other bits is a restarted or appended run: an error naming both
lines, unless --duplicates first|last. A number a float64 cannot hold (`1e999`, `1e-400`, an
integer past 2**53) and a last line without its newline (cut off) are skipped and counted.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from parity.readers.frame import (
    FLOAT64,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    beyond_max_step,
    fail,
    finish,
    text_float,
)
from parity.readers.text import CUT_TAIL, cut_tail, decode, read_bytes


def read_csv_cells(text: str, path: Path, log: ReadLog | None = None) -> Cells:
    log = log if log is not None else ReadLog()
    text, cut = cut_tail(text)
    if cut is not None:
        log.skip(CUT_TAIL, cut)
    cells = Cells()
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            why = f" (line {cut}, the only one, has no newline: cut off)" if cut else ""
            raise fail(path, None, f"no metrics records{why}")
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
            if not re.fullmatch(r"[0-9]+", raw_step, re.ASCII) or beyond_max_step(raw_step):
                raise fail(path, lineno, f"step must be a non-negative integer, got {raw_step!r}")
            group = cells.record(int(raw_step), lineno)  # a step's rows merge (Cells)
            for i, cell in enumerate(row):
                if i == si or cell == "":
                    continue
                try:
                    value = text_float(cell)
                except ValueError:
                    raise fail(
                        path, lineno, f"value of {names[i]!r} is not numeric: {cell!r}"
                    ) from None
                if value is None:
                    log.skip(UNFIT, f"line {lineno} ({names[i]!r})")
                    continue
                cells.add(group, names[i], value)
    except csv.Error as e:
        raise fail(path, reader.line_num, f"bad csv: {e}") from None
    return cells


def _read(path: Path, options: ReadOptions):
    log = ReadLog()
    cells = read_csv_cells(decode(read_bytes(path), path), path, log)
    if not cells.steps:
        why = " (the last line has no newline: cut off)" if CUT_TAIL in log.skipped else ""
        raise fail(path, None, f"no metrics records{why}")
    values, present = cells.frames(path, options.duplicates, log)
    return finish(values, present, source=path, fmt="csv", precision=FLOAT64, log=log, written=True)


def _claims(path: Path, head: bytes | None) -> bool:
    return head is not None and path.suffix.lower() == ".csv"


FORMATS = [
    Format(
        "csv",
        _read,
        _claims,
        "a `.csv` file with a `step` column",
        "float64, or decimals(N) when every value looks rounded",
    )
]
