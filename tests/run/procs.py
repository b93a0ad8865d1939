"""Which processes a test left running: every launch test asserts none mention its folder; and
the Ctrl-C of a launch once its job is up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def procs_mentioning(text: str) -> list[str]:
    """Live (non-zombie) processes whose command line contains ``text`` (a test's unique
    folder), as "pid state: command line" so that a failing assertion shows what was left."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and text.encode() in cmdline:
            found.append(f"{entry.name} {state}: {cmdline.decode(errors='replace').strip()}")
    return found


def ctrl_c_once_ready(
    code: str,
    args: list[str],
    ready: Callable[[], bool],
    preexec: Callable[[], None],
    *,
    ready_s: float = 60,
    exit_s: float = 20,
) -> None:
    """Run ``python -c code *args`` (a launch); once ``ready()`` (its job is up), Ctrl-C it: it
    must exit non-zero within ``exit_s``. ``preexec``: the ``interruptible`` fixture. The
    caller then asserts what the launch left running."""
    parent = subprocess.Popen([sys.executable, "-c", code, *args], preexec_fn=preexec)
    try:
        deadline = time.monotonic() + ready_s
        while not ready():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.2)
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=exit_s) != 0
    finally:
        parent.kill()
