"""Reading a file's bytes and text with errors that name it (shared by the text formats)."""

from __future__ import annotations

import codecs
from pathlib import Path

from parity.readers.frame import MetricsError, fail


def read_bytes(path: Path) -> bytes:
    """The file's bytes without a UTF-8 byte-order mark; a one-line error if it can't be read."""
    try:
        return path.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None


def decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(path, raw.count(b"\n", 0, e.start) + 1, "not valid UTF-8") from None
