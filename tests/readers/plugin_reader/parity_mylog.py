"""The `mylog` format: a `*.mylog` file, or a folder holding `train.mylog`, of JSON lines
`{"it": 3, "loss": 0.5, ...}` (the step is `it`).

Its lines are JSON objects, which the built-in jsonl format would claim too: detection finds
this one only because plugins are asked before the generic formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from parity.readers import Format
from parity.readers.frame import FLOAT64, ReadOptions, fail, finish


def _file(path: Path) -> Path:
    return path / "train.mylog" if path.is_dir() else path


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    source = _file(path)
    rows: dict[int, dict[str, float]] = {}
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record.get("it"), int):
            raise fail(source, n, "no integer 'it'")
        rows[record.pop("it")] = {k: float(v) for k, v in record.items()}
    values = pd.DataFrame.from_dict(rows, orient="index", dtype="float64").sort_index()
    values = values.reindex(sorted(values.columns), axis=1)
    values.index = values.index.astype("int64").rename("step")
    return finish(values, values.notna(), source=source, fmt="mylog", precision=FLOAT64)


def _claims(path: Path, head: bytes | None) -> bool:
    if head is None:
        return (path / "train.mylog").is_file()
    return path.suffix == ".mylog"


FORMATS = [Format("mylog", _read, _claims, "a `.mylog` file or a folder with `train.mylog`",
                  FLOAT64)]  # fmt: skip
