"""The frame contract (parity.readers.frame) as a check: what a reader's frame must be before it
is judged.

The built-in readers build their frames with ``frame.finish`` and keep the contract by
construction; a reader from another package (the ``llm_parity.readers`` entry points) may not.
A frame that breaks it could be judged wrongly: a column of ``None`` reads as "absent at every
step" and two such columns as a match; an index of floats or of repeated steps lines up the
wrong steps. ``frame_problem`` says in a few words what is wrong, or None when nothing is.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from parity.readers.frame import FLOAT32, FLOAT64

_PRECISION_PART = re.compile(
    rf"^(?:{FLOAT64}|{FLOAT32}|float16|decimals:\d{{1,3}}|digits:[1-9]\d{{0,2}})$"
)


def precision_problem(text: object) -> str | None:
    """What is wrong with a precision text ("float64", "float32,decimals:4", "digits:6", ...),
    or None. digits:S is S significant digits (`%g`: 6), S at least 1."""
    if not isinstance(text, str) or not all(_PRECISION_PART.fullmatch(p) for p in text.split(",")):
        return f"precision {text!r} is none of float64, float32, float16, decimals:N, digits:S"
    return None


def _index_problem(frame: pd.DataFrame) -> str | None:
    index = frame.index
    if index.name != "step" or index.dtype != np.int64:
        return f"its index must be 'step' of int64, not {index.name!r} of {index.dtype}"
    if not index.is_unique or not index.is_monotonic_increasing:
        return "its steps must be unique and ascending"
    return None


def _columns_problem(frame: pd.DataFrame) -> str | None:
    names = list(frame.columns)
    if not all(isinstance(n, str) and n for n in names):
        return "its column names must be non-empty strings"
    if names != sorted(set(names)):
        return "its columns must be unique and sorted by name"
    wrong = [(n, t) for n, t in zip(names, frame.dtypes, strict=True) if t != np.float64]
    if wrong:
        return f"metric {wrong[0][0]!r} is {wrong[0][1]}, not float64"
    return None


def _attrs_problem(frame: pd.DataFrame, name: str) -> str | None:
    attrs = frame.attrs
    present = attrs.get("present")
    if not isinstance(present, pd.DataFrame) or present.shape != frame.shape:
        return "attrs['present'] must be a boolean frame of its shape (build it with finish)"
    if not present.index.equals(frame.index) or list(present.columns) != list(frame.columns):
        return "attrs['present'] must have its steps and metrics"
    if not all(t == np.bool_ for t in present.dtypes):
        return "attrs['present'] must hold booleans"
    has = present.to_numpy(dtype=bool) | frame.notna().to_numpy()
    empty = [c for c, n in zip(frame.columns, has.sum(axis=0), strict=True) if not n]
    if empty:
        return f"metric {empty[0]!r} has no value at any step"
    precision = attrs.get("precision")
    if not isinstance(precision, dict) or set(precision) != set(frame.columns):
        return "attrs['precision'] must give each metric's precision (build it with finish)"
    for text in precision.values():
        if problem := precision_problem(text):
            return problem
    if attrs.get("format") != name:
        return f"attrs['format'] is {attrs.get('format')!r}, not its format name {name!r}"
    if not isinstance(attrs.get("skipped"), list) or not isinstance(attrs.get("notes"), list):
        return "attrs['skipped'] and attrs['notes'] must be lists (build it with finish)"
    return None


def frame_problem(frame: object, name: str) -> str | None:
    """What breaks the frame contract in a frame the format ``name`` read, or None: a DataFrame
    with an int64 'step' index (unique, ascending), sorted unique metric names, float64 columns,
    each metric present at some step, and finish's attrs (present, precision, format, skipped,
    notes)."""
    if not isinstance(frame, pd.DataFrame):
        return f"it gave {type(frame).__name__}, not a pandas DataFrame"
    return _index_problem(frame) or _columns_problem(frame) or _attrs_problem(frame, name)
