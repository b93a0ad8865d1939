"""Atomic writes (a temp file in the same folder, then a rename: nothing is ever written half),
and where a run's launch files lie.

The one implementation is the recorder's (`parity.record.files`), the bottom layer; reports,
summaries and goldens refuse NaN here, where a run's own records spell it as Python does.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from parity.record.files import write_text_atomic

__all__ = ["launch_dir", "open_regular", "write_json_atomic", "write_text_atomic"]

LAUNCH_SUFFIX = ".launch"
#: in a launch folder: the folder the job ran in, and the worktree it was (report: Reproduce)
REPRODUCE_FILE = "reproduce.json"


def launch_dir(run_dir: Path) -> Path:
    """Where the harness keeps a run's launch files (launcher.log, rank logs, world records):
    beside the job's output folder, never in it, so the job starts in an empty folder."""
    run_dir = Path(run_dir)
    if run_dir.name in ("", ".."):  # "." or ".." (a metrics file's folder): named by its path
        run_dir = Path(os.path.abspath(run_dir))
    return run_dir.parent / (run_dir.name + LAUNCH_SUFFIX)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened to read, never blocking: what a running job writes, polled while it runs
    (its metrics file). OSError where it is not a regular file: a FIFO would block the open,
    and with it the loop that enforces the job's timeout; a device (/dev/zero) never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
