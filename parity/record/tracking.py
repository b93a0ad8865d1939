"""What the recorder's loggers for other libraries share (parity.record.lightning,
parity.record.accelerate): their values as numbers, and a step's repeated keys left out.

Libraries log a step in several calls and repeat keys in them (Lightning's `epoch` on every
call); Recorder.log refuses a key the step already has, as the readers would refuse the run, so
a repeat with the same value is dropped here and only another value reaches the refusal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from parity.record.recorder import as_number


def _same(a: Any, b: Any) -> bool:
    """The same value (the same bits for floats), or both NaN: a repeat, not another value."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or a != a and b != b
    return a == b


def numbers(values: Mapping[str, Any]) -> dict[str, Any]:
    """The numeric values (a one-element tensor through .item()); strings and anything else
    left out, as TensorBoard's loggers leave them."""
    out = {}
    for key, value in values.items():
        value = as_number(value)
        if isinstance(value, (int, float)):
            out[key] = value
    return out


class StepMerger:
    """What the current step has logged so far, to drop a key repeated with the same value."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._given: dict[str, Any] = {}

    def new(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """This call's values the step does not have yet with the same value."""
        if step != self._step:
            self._step, self._given = step, {}
        given = self._given
        fresh = {k: v for k, v in values.items() if not (k in given and _same(given[k], v))}
        given.update(fresh)
        return fresh
