"""Which processes a test left running: every launch test asserts none mention its folder."""

from __future__ import annotations

import os
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
