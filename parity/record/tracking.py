"""What the recorder's loggers for other libraries share (parity.record.lightning,
parity.record.accelerate): one base, RecordingLogger (the run folder, the config, the Recorder
made at first use), their values as numbers, and a step's repeated keys left out.

Libraries log a step in several calls and repeat keys in them (Lightning's `epoch` on every
call); Recorder.log refuses a key the step already has, as the readers would refuse the run, so
a repeat with the same value is dropped here and only another value reaches the refusal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from parity.record.recorder import Recorder, as_number


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


class RecordingLogger:
    """The part of a library's logger that records (ParityLogger, ParityTracker): the run folder,
    the config for manifest.json, the Recorder made at first use, a step's values logged once.

    Put first among the bases (`class ParityLogger(RecordingLogger, Logger)`): its __init__
    calls the library's base's with no arguments. The Recorder is made lazily because the
    library forms the process group (whose rank and world size the Recorder records) after
    the logger is constructed."""

    def __init__(self, out: str | Path, *, manifest: Mapping[str, Any] | None = None):
        super().__init__()
        self.out = Path(out)
        self.manifest_extra = dict(manifest or {})
        self._config: dict[str, Any] = {}
        self._recorder: Recorder | None = None
        self._merger = StepMerger()

    @property
    def recorder(self) -> Recorder:
        """This rank's Recorder, made (and the manifest written) at first use."""
        if self._recorder is None:
            self._recorder = Recorder(self.out)
            self._write_manifest()
        return self._recorder

    def _write_manifest(self) -> None:
        assert self._recorder is not None
        self._recorder.manifest(self._config, **self.manifest_extra)

    def _add_config(self, values: Mapping[str, Any]) -> None:
        """The run's config in manifest.json (rewritten with what is added later)."""
        self._config.update(values)
        if self._recorder is None:
            _ = self.recorder  # made, with the manifest
        else:
            self._write_manifest()

    def _log_step(self, step: int | None, values: Mapping[str, Any], how: str) -> None:
        """The numeric values the step does not have yet, at `step`; how: the call to make,
        for the error when the library gave no step (runs are compared by step)."""
        if step is None:
            raise ValueError(f"{type(self).__name__}: {how}: runs are compared by step")
        new = self._merger.new(step, numbers(values))
        if new:
            self.recorder.log(step, new)

    def _end(self, success: bool) -> None:
        """The end records when the run succeeded; otherwise the files closed without them
        (the run reads as incomplete). Nothing when nothing was recorded or already ended."""
        if self._recorder is None or self._recorder.finished:
            return
        if success:
            self._recorder.finish()
        else:
            self._recorder.close()
