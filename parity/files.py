"""Atomic writes (a temp file in the same folder, then a rename: nothing is ever written half),
and where a run's launch files lie.

The one implementation is the recorder's (`parity.record.files`), the bottom layer; reports,
summaries and goldens refuse NaN here, where a run's own records spell it as Python does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parity.record.files import write_text_atomic

__all__ = ["launch_dir", "write_json_atomic", "write_text_atomic"]

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
