"""The processes that carry a mark in their environment, found in /proc (Linux): how a
launch finds every process of its own, wherever it went (a session of its own, a rank reparented
to init), which a process group cannot follow; and their kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def scan_proc(needle: bytes, pgid: int | None = None) -> list[int]:
    """Live (non-zombie) pids other than this one whose environment holds the ``name=value``
    entry ``needle``, or that sit in process group ``pgid``: the one /proc walk behind both the
    cleanup of a launch (parity.run.launch.survivors) and ``carrying``. A process that is gone
    meanwhile, or not ours to read, is skipped."""
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z":
                continue
            if pgid is not None and int(fields[2]) == pgid:
                found.append(pid)
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(pid)
    return found


def carrying(name: str, value: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``name=value`` (Linux /proc): every
    process a launch marked, wherever it went (a session of its own, a rank reparented to init),
    which a process group cannot follow."""
    return scan_proc(f"{name}={value}".encode())


def kill_carrying(
    name: str, value: str, proc: subprocess.Popen | None = None, rounds: int = 100
) -> None:
    """SIGKILL every process carrying ``name=value`` (and ``proc`` while it lives) until none is
    left (a dying parent may still fork), then reap ``proc``."""
    for _ in range(rounds):
        left = carrying(name, value)
        if proc is not None and proc.poll() is None:
            left.append(proc.pid)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    if proc is not None:
        proc.wait()
