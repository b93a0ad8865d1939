"""Stop at the first divergence: a run judged against numbers already known (the other side's:
a base reused from the run store or finished first, bisect's reference) as it writes its steps,
and stopped as soon as a metric leaves its policy, so that a broken change costs the steps up
to its divergence, not the whole run (the running layer).

Only what the run has finished is judged: its metrics.jsonl's whole lines (the recorder's
format, one or more records a step), of the steps before the last one begun (a step's records
can come in several writes; the last one may still be growing), under the policies and reading
options the final comparison uses (parity.judge.compare). Values once written are final (a
step given twice with other bits is an error of the reader, not a correction), so a divergence
seen in a prefix is the run's, and the first divergence is the run's own: every step before it
was judged aligned. Nothing is ever concluded from a prefix but "diverged": a run that is not
stopped is read and compared whole, as without this.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from parity.files import open_regular
from parity.judge.compare import Comparison, compare_frames
from parity.judge.policy import Policies
from parity.readers import MetricsError, read_metrics
from parity.record.runfolder import metrics_path
from parity.run.results import Stopped

_STEP = re.compile(rb'^\{"step": ?(-?\d+)')
_END = b'{"event": "end"'


class Diverging(Stopped):
    """Raised from a launch's on_tick: the run left its policy; ``line`` says where."""


class EarlyStop:
    """Follows a running job's metrics.jsonl and judges each finished step against
    ``reference`` (a canonical frame) under ``policies``; ``check`` raises Diverging once a
    metric diverges. Then ``step`` is the last step judged, ``frame`` the run's metrics up to
    it and ``comparison`` the verdict on them.

    ``until`` k: the other way round, a run that only has to confirm ``reference`` up to step k
    (check's base run again where the head was stopped there): Stopped once step k is finished
    while every step agrees; where one does not (``departed``), it runs to its end."""

    def __init__(
        self,
        reference: pd.DataFrame,
        metrics_file: Path,
        policies: Policies | None = None,
        *,
        at_source_precision: bool = False,
        allow_skipped: bool = False,
        until: int | None = None,
    ):
        self.reference, self.policies, self.until = reference, policies, until
        self.metrics_file = Path(metrics_file)
        self.options = {"at_source_precision": at_source_precision,
                        "allow_skipped": allow_skipped}  # fmt: skip
        self.offset, self.partial = 0, b""
        self.lines: list[bytes] = []  # every whole line read, for the frame at the stop
        self.unjudged: list[tuple[int, bytes]] = []  # (step, line) of the lines not judged yet
        self.last: int | None = None  # the largest step seen
        self.judged: int | None = None  # the last step judged
        self.step: int | None = None  # the step it stopped after (set with Diverging)
        self.frame: pd.DataFrame | None = None
        self.comparison: Comparison | None = None
        self.departed = False  # with until: a step differed from the reference before it
        self._tmp = tempfile.TemporaryDirectory(prefix="parity-early-")

    def _read(self) -> bool:
        """Take what the job appended since the last call (whole lines); False when the file
        is unreadable or was rewritten (then nothing is judged any more: the whole run is)."""
        try:
            with open_regular(self.metrics_file) as f:
                if f.seek(0, 2) < self.offset:
                    return False
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return True  # not written yet
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.startswith(_END):
                return False  # finished: the run is compared whole
            if m := _STEP.match(line):
                step = int(m[1])
                self.unjudged.append((step, line))
                self.last = step if self.last is None else max(self.last, step)
            self.lines.append(line)
        return True

    def check(self) -> None:
        """Judge the steps finished since the last call (each line once: the cost of a tick is
        what was written since the last one); raise Diverging at a divergence."""
        if self.step is not None or self.departed or not self._read() or self.last is None:
            return
        finished = [s for s, _ in self.unjudged if s < self.last]
        if not finished:
            return
        done = max(finished) if self.judged is None else max(self.judged, *finished)
        new = [line for s, line in self.unjudged if s <= done]
        self.unjudged = [(s, line) for s, line in self.unjudged if s > done]
        self.judged = done
        comparison = self._compare(new)
        if comparison is None:
            return
        if self.until is not None:
            if comparison.first_divergence() is not None:
                self.departed = True  # not what it confirms: the whole run is wanted
            elif done >= self.until and self._stop_at(self.until):
                raise Stopped(f"stopped after step {self.until}, where the other side was "
                              "stopped, every step the same as before")  # fmt: skip
            return
        if comparison.first_divergence() is None or not self._stop_at(done):
            return
        first = self.comparison.first_divergence()
        raise Diverging(
            f"stopped after step {done}: {first.name} diverged at step "
            f"{first.first_divergent_step} ({first.first_divergent_policy or first.policy})"
        )

    def _read_lines(self, lines: list[bytes]) -> pd.DataFrame:
        """``lines`` read as the recorder's metrics.jsonl (MetricsError where they cannot be)."""
        path = metrics_path(self._tmp.name)
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        frame = read_metrics(path, "jsonl")
        frame.attrs["source"] = str(self.metrics_file)  # what it is a part of
        return frame

    def _compare(self, lines: list[bytes]) -> Comparison | None:
        """The steps of ``lines`` against the reference's same steps; None when they cannot be
        read (the whole run's read says why)."""
        try:
            frame = self._read_lines(lines)
            reference = rows(self.reference, self.reference.index.isin(frame.index))
            return compare_frames(reference, frame, self.policies, allow_incomplete=True,
                                  allow_nothing_compared=True, **self.options)  # fmt: skip
        except MetricsError:
            return None

    def _stop_at(self, step: int) -> bool:
        """Keep the run's frame up to ``step`` and its comparison (every line read so far,
        once); False, and no stop, when they cannot be read or the divergence is not there."""
        try:
            frame = truncated(self._read_lines(self.lines), step)
            comparison = prefix_comparison(self.reference, frame, step, self.policies,
                                           **self.options)  # fmt: skip
        except MetricsError:
            return False
        if self.until is None and comparison.first_divergence() is None:
            return False
        self.step, self.frame, self.comparison = step, frame, comparison
        return True


def rows(frame: pd.DataFrame, keep) -> pd.DataFrame:
    """``frame``'s rows where ``keep`` (a boolean mask of its index), with its attrs (sources,
    precision, read notes; the cells present cut alike)."""
    cut = frame.loc[keep].copy()
    cut.attrs = dict(frame.attrs)
    present = cut.attrs.get("present")
    if isinstance(present, pd.DataFrame):
        cut.attrs["present"] = present.loc[present.index.isin(cut.index)]
    return cut


def truncated(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    """``frame``'s rows up to ``step``, with its attrs (``rows``)."""
    return rows(frame, frame.index <= step)


def prefix_comparison(
    a: pd.DataFrame,
    b: pd.DataFrame,
    step: int,
    policies: Policies | None = None,
    **options: Any,
) -> Comparison:
    """Both sides up to ``step`` compared: a pair whose side B was stopped there."""
    return compare_frames(
        truncated(a, step), truncated(b, step), policies, allow_incomplete=True,
        allow_nothing_compared=True, **options,
    )  # fmt: skip


def judge_stopped(
    a: pd.DataFrame,
    b: pd.DataFrame,
    step: int,
    policies: Policies | None = None,
    **options: Any,
) -> Comparison:
    """A pair whose side B was stopped after ``step`` as it diverged from A: what stopped it,
    again. Its verdict is "diverged" by construction; a prefix that does not diverge (B was
    judged against other numbers) is an internal error, never a verdict."""
    comparison = prefix_comparison(a, b, step, policies, **options)
    if comparison.first_divergence() is None:
        raise RuntimeError(f"a run stopped as diverging after step {step} compares "
                           f"{comparison.verdict}")  # fmt: skip
    return comparison
