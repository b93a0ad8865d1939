"""Reading a file's bytes and text with errors that name it (shared by the text formats), and
the cut tail every line-based reader leaves out.

A text log's last line without its newline was cut off by a run still writing or killed: a
number cut there (`0.12` of `0.1234`) still parses, as a wrong value. So every text reader
skips such a line and counts it (``CUT_TAIL``, with its line): no verdict comes from it.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import TypeVar

from parity.readers.frame import MetricsError, fail

CUT_TAIL = "last lines cut off (no newline at the end: a run still writing, or killed)"
T = TypeVar("T", str, bytes)


def read_bytes(path: Path) -> bytes:
    """The file's bytes without a UTF-8 byte-order mark; a one-line error if it can't be read."""
    try:
        return path.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None


def decode(raw: bytes, path: Path, lines: bool = True) -> str:
    """``raw`` as UTF-8 text; a one-line error where it is not, or where its ``lines`` end in a
    carriage return alone (classic Mac OS): no newline, so every reader of lines would call the
    whole file one line cut off."""
    if lines and b"\r" in raw[raw.rfind(b"\n") + 1 :].strip():  # after the last newline
        raise fail(path, None, "lines end in a carriage return alone (classic Mac OS line "
                   "endings): convert them to newlines, e.g. tr '\\r' '\\n'")  # fmt: skip
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(path, raw.count(b"\n", 0, e.start) + 1, "not valid UTF-8") from None


def cut_tail(text: T) -> tuple[T, int | None]:
    """`text` without a last line that has no newline after it, and that line's number; `text`
    and None when it ends with a newline (or only blanks follow the last one)."""
    newline = "\n" if isinstance(text, str) else b"\n"
    start = text.rfind(newline) + 1  # type: ignore[arg-type]
    if not text[start:].strip():
        return text, None
    return text[:start], text.count(newline, 0, start) + 1  # type: ignore[arg-type]
