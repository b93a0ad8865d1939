"""Two runs whose steps are labels, lined up by label.

A reader whose source's steps are not integers (NeMo's DLLogger lists: `[epoch, iteration]`)
numbers them 1, 2, 3, ... in the order they first appear, and keeps the labels in
attrs["step_labels"]. Two runs that log the same labels get the same numbers; one that misses a
label numbers every later one differently, so comparing by number would set `[0, 3]` against
`[0, 2]` and call the values diverged where a step is missing. ``align_step_labels`` numbers both
runs' labels on one order instead, so a step compares with the same label's step and a label
one run lacks is a missing step, named as such.
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["align_step_labels"]


def _key(label: Any) -> Hashable:
    """A label as a dict key (the lists JSON gave, as tuples)."""
    return tuple(_key(x) for x in label) if isinstance(label, (list, tuple)) else label


def _merged(a: list[Hashable], b: list[Hashable]) -> list[Hashable]:
    """Both runs' labels in one order that keeps each run's own: the longest common runs of
    labels once, what one run has between them in that run's order (a's first)."""
    out: list[Hashable] = []
    opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    for _, i1, i2, j1, j2 in opcodes:
        block = set(a[i1:i2])
        out += a[i1:i2] + [x for x in b[j1:j2] if x not in block]
    seen: set[Hashable] = set()
    return [x for x in out if not (x in seen or seen.add(x))]  # a label moved: its first place


def _renumbered(frame: pd.DataFrame, number: dict[Hashable, int]) -> pd.DataFrame:
    """``frame`` with each step replaced by its label's number, in ascending order, its attrs
    (present mask, step labels) following."""
    labels = frame.attrs["step_labels"]
    steps = np.array([number[_key(labels[s])] for s in frame.index], dtype=np.int64)
    order = np.argsort(steps, kind="stable")
    index = pd.Index(steps[order], dtype=np.int64, name="step")
    out = pd.DataFrame(frame.to_numpy()[order], index=index, columns=frame.columns)
    attrs = dict(frame.attrs)
    present = attrs.get("present")
    if isinstance(present, pd.DataFrame):
        present = present.reindex(index=frame.index, columns=frame.columns, fill_value=False)
        attrs["present"] = pd.DataFrame(present.to_numpy()[order], index=index,
                                        columns=frame.columns)  # fmt: skip
    attrs["step_labels"] = {int(steps[k]): labels[s] for k, s in enumerate(frame.index)}
    out.attrs.update(attrs)
    return out


def align_step_labels(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``a`` and ``b`` numbered on one order of their step labels where both have labels (as
    they were otherwise). A label both runs have gets one number; one only a run has gets a
    number of its own, a step the other run is missing."""
    la, lb = a.attrs.get("step_labels"), b.attrs.get("step_labels")
    if not la or not lb:
        return a, b
    keys_a = [_key(la[s]) for s in a.index]
    keys_b = [_key(lb[s]) for s in b.index]
    if keys_a == keys_b:
        return a, b
    number = {label: n for n, label in enumerate(_merged(keys_a, keys_b), 1)}
    return _renumbered(a, number), _renumbered(b, number)
