"""A job that stopped writing steps is a hang: stopped when it has written no new step for its
stall time, not waited out to its timeout (the running layer).

The stall time (the spec's ``stall``): ``"auto"`` (the default) is ``FACTOR`` times the slowest
step so far (the longest time between two writes of new steps), at least ``FLOOR_S``; a number
of seconds; or ``"off"``. Before the first step there is no pace to judge and a job may load a
model for long, or write its metrics in a format whose steps are not counted here: the timeout
alone applies until the first step is written. Steps are counted in the run folder's
metrics.jsonl (the recorder's), as the progress display counts them; after its end record the
hang-at-exit grace applies instead.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from parity.files import open_regular

AUTO, OFF = "auto", "off"
#: "auto": this many times the slowest step so far ...
FACTOR = 5.0
#: ... but never less (an evaluation or a checkpoint between two steps takes longer than a step)
FLOOR_S = 120.0

_STEP = re.compile(rb'^\{"step": ?(-?\d+)')
_END = b'{"event": "end"'


class Stalled(Exception):
    """Raised from a launch's on_tick: the job is hung; ``line`` says how long without a step."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def stall_limit(setting: float | str, steps: int, slowest_s: float) -> float | None:
    """Seconds without a new step after which a job is hung; None: no limit (before its first
    step, or ``setting`` "off"). ``slowest_s``: the longest time between two writes of new steps
    so far (0 with one step written)."""
    if setting == OFF or steps == 0:
        return None
    if setting == AUTO:
        return max(FLOOR_S, FACTOR * slowest_s)
    return float(setting)


def explain(setting: float | str, slowest_s: float) -> str:
    """How the limit was chosen, for the failure line."""
    if setting == AUTO:
        return (f"stall \"auto\": {FACTOR:g}x the slowest step so far ({slowest_s:.1f} s), at "
                f"least {FLOOR_S:g} s")  # fmt: skip
    return f"stall = {setting:g} s"


class StallWatch:
    """Follows a running job's metrics.jsonl (new bytes only, cheap to poll twice a second):
    when new steps appear and the longest time between two such writes; ``check`` raises
    Stalled once the job has written nothing new for its stall time."""

    def __init__(
        self,
        metrics_file: Path,
        setting: float | str = AUTO,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.metrics_file, self.setting, self.clock = Path(metrics_file), setting, clock
        self.offset, self.partial = 0, b""
        self.steps: set[int] = set()
        self.last_step: int | None = None
        self.last_at: float | None = None
        self.slowest_s = 0.0
        self.ended = False

    def poll(self) -> None:
        """Read what the job appended since the last poll; a new step moves the clock."""
        try:
            with open_regular(self.metrics_file) as f:
                if f.seek(0, 2) < self.offset:  # rewritten shorter (a resume): read it again,
                    self.offset, self.partial = 0, b""  # its steps written anew are progress
                    self.steps.clear()
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        new = False
        for line in lines:
            if line.startswith(_END):
                self.ended = True
            elif (m := _STEP.match(line)) and int(m[1]) not in self.steps:
                self.steps.add(int(m[1]))
                self.last_step, new = int(m[1]), True
        if new:
            now = self.clock()
            if self.last_at is not None:
                self.slowest_s = max(self.slowest_s, now - self.last_at)
            self.last_at = now

    def check(self) -> None:
        """Raise Stalled when the job has been without a new step for longer than its limit."""
        self.poll()
        limit = stall_limit(self.setting, len(self.steps), self.slowest_s)
        if self.ended or limit is None or self.last_at is None:
            return
        idle = self.clock() - self.last_at
        if idle > limit:
            raise Stalled(
                f"no new step for {idle:.1f} s after step {self.last_step} "
                f"({explain(self.setting, self.slowest_s)})"
            )
