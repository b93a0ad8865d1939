"""How a run folder is written: whole files atomically (a temp file in the same folder, then a
rename), logs append-only, one complete line per write, flushed. A crash leaves either the old
file or the new one, and at worst a cut last line, which every reader takes as the end of an
incomplete run; the end record (`{"event": "end", "steps": N}`) is always written last.

One exception to append-only: a log that keeps one record a step (ranks/rank{r}.jsonl,
fingerprints.jsonl) may rewrite the last line it wrote (`replace_last`), when a step is logged
in two calls. The file is cut back to that line's start and the merged line written: a crash
between leaves the file without that step's line (and without an end record), never a mix.

Floats go through Python's json: the shortest repr, which reads back bit for bit; NaN and
Infinity are spelled as Python writes them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; run folders and reports are read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """A manifest-style JSON file: indented, sorted keys, anything else (a Path) as str()."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def console_line(step: int, metrics: dict[str, Any]) -> str:
    """verl's console format: `step:N - key:value - ...` with full repr precision."""
    return " - ".join([f"step:{step}"] + [f"{k}:{v!r}" for k, v in metrics.items()])


class LineLog:
    """One append-only UTF-8 text file: each `write` is one complete line, flushed at once."""

    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(self.path, "ab" if append else "wb")
        self._last: int | None = None  # where the last line this log wrote starts

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")  # encoded before anything is written
        self._last = self._file.tell()
        self._file.write(data)
        self._file.flush()

    def record(self, record: dict[str, Any]) -> None:
        self.write(json.dumps(record))  # serialised before anything is written

    def replace_last(self, record: dict[str, Any]) -> None:
        """Rewrite the last line this log wrote as `record` (see the module doc)."""
        if self._last is None:
            raise RuntimeError(f"{self.path}: no line written here to replace")
        data = (json.dumps(record) + "\n").encode("utf-8")
        self._file.truncate(self._last)
        self._file.seek(self._last)
        self._file.write(data)
        self._file.flush()

    def keep_before(self, step: int, step_of: Callable[[str], int | None]) -> None:
        """Rewrite the file (atomically) with only its lines of a step before `step`: later
        steps, the end record and a cut last line go; then go on appending."""
        self.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [x for x in lines if (s := step_of(x)) is not None and s < step]
        write_text_atomic(self.path, "".join(kept))
        self._file = open(self.path, "ab")
        self._last = None

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def jsonl_step(line: str) -> int | None:
    """The step of a JSONL record (None for the end record or a cut last line)."""
    try:
        return json.loads(line).get("step")
    except ValueError:
        return None  # a truncated last line of a killed run


def console_step(line: str) -> int | None:
    head = line.split(" - ", 1)[0]
    return int(head[5:]) if head.startswith("step:") and head[5:].isdigit() else None
