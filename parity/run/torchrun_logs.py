"""What a torchrun launch left to read: each rank's log files, torchrun's summary of the ranks
that failed (the first failure first), and the tail of a log. Apart from the launching
(parity.run.launch) because reading what a launch left needs none of its process handling: the
Slurm launcher reads its nodes' logs with it too.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parity.run.results import LaunchResult

# Log lines of a rank that died only because a peer died first (gloo / nccl / torchrun teardown).
_SECONDARY_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
)

# One entry of torchrun's ChildFailedError summary:
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 3794)  (SIGKILL)
_FAILURE_RE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)
# torchrun's agent log line, used when no summary was printed:
#   failed (exitcode: 1) local_rank: 1 (pid: 3570) of binary: ...
_AGENT_FAIL_RE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)"
)
_ROOT_MARK = "Root Cause (first observed failure):"


@dataclass
class RankFailure:
    """One rank that exited non-zero; ``signal`` is set when it was killed by a signal."""

    rank: int
    exitcode: int | None
    signal: str | None
    log_tail: str
    local_rank: int | None = None
    #: the node it ran on (a Slurm node's name), '' when the launch was on this machine
    host: str = ""
    #: set (rank -1) when a node's torchrun itself died, not one of its ranks
    node: int | None = None

    def headline(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"
        where = f" on {self.host}" if self.host else ""
        if self.rank < 0 and self.node is not None:
            return f"node {self.node}{where}: torchrun {how}"
        return f"rank {self.rank}{where}: {how}"


def find_rank_logs(log_dir: Path, before: set[str]) -> dict[int, Path]:
    """Map local rank -> stderr.log of the last attempt of this launch.

    torch 2.13 layout: ``<log_dir>/<rdzv_id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log``
    (plus ``error.json`` when the worker's main is wrapped in ``@record``).
    """
    runs = [p for p in log_dir.iterdir() if p.is_dir() and p.name not in before]
    if not runs:
        return {}
    run = max(runs, key=lambda p: p.stat().st_mtime)
    attempts = [p for p in run.glob("attempt_*") if p.name.removeprefix("attempt_").isdigit()]
    if not attempts:
        return {}
    attempt = max(attempts, key=lambda p: int(p.name.removeprefix("attempt_")))
    return {
        int(p.name): p / "stderr.log" for p in attempt.iterdir() if p.is_dir() and p.name.isdigit()
    }


def signal_name(exitcode: int) -> str | None:
    """SIGKILL for -9 (an exit code as Popen gives a killed process's); None for an exit."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def parse_failures(launcher_text: str, result: LaunchResult) -> list[RankFailure]:
    """Failed ranks from torchrun's summary, the most likely root cause first.

    torchrun names the failure with the earliest (1 s resolution) timestamp as root cause; ties
    go to the lower rank, so ranks that merely saw a peer die (SIGTERM from torchrun, gloo/nccl
    "connection closed") are moved behind the others.
    """
    entries: list[tuple[int, int, int]] = []  # (rank, local_rank, exitcode)
    root_at = launcher_text.rfind(_ROOT_MARK)
    if root_at >= 0:
        others_at = launcher_text.rfind("Failures:", 0, root_at)
        sections = [launcher_text[root_at:], launcher_text[max(others_at, 0) : root_at]]
        for section in sections:
            for m in _FAILURE_RE.finditer(section):
                entries.append((int(m["rank"]), int(m["local"]), int(m["code"])))
    else:
        for m in _AGENT_FAIL_RE.finditer(launcher_text):
            entries.append((int(m["local"]), int(m["local"]), int(m["code"])))

    failures, seen = [], set()
    for rank, local, code in entries:
        if rank in seen:
            continue
        seen.add(rank)
        tail = result.tail(local)
        failures.append(RankFailure(rank, code, signal_name(code), tail, local))

    return sorted(failures, key=secondary)  # stable: keeps torchrun's order otherwise


def secondary(f: RankFailure) -> bool:
    """A rank that probably died only because a peer died first (SIGTERM, connection closed)."""
    return f.signal == "SIGTERM" or any(m in f.log_tail for m in _SECONDARY_MARKERS)


def tail_file(path: Path, n_lines: int, max_bytes: int = 256 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return last_lines(data.decode(errors="replace"), n_lines)


def last_lines(text: str, n_lines: int) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-n_lines:])


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
