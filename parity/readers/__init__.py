"""Every metric format into one exact pandas frame (the contract: parity/readers/frame.py).

One module per format; each declares its ``FORMATS`` (name, how it claims a path, how it reads
it). ``read_metrics`` picks the format by ``--format`` or by asking each in ``_MODULES`` order,
the specific ones (a TensorBoard event file, a W&B run) before the generic ones (JSON lines,
CSV, and last of all verl's console lines, which may hide in any text).

A path that is no regular file or folder (a pipe, `<(zcat m.jsonl.gz)` i.e. /dev/fd/N, a named
FIFO) can be read only once: ``read_metrics`` copies it whole into a temporary file (up to
``STREAM_LIMIT`` bytes) and detects and reads that copy, so no byte goes to format detection
alone; errors and attrs["source"] still name the path given. A FIFO no writer opens within
``FIFO_WAIT_S`` seconds is refused, not waited on forever.
"""

from __future__ import annotations

import importlib
import os
import select
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from parity.readers.frame import (
    DUPLICATE_RULES,
    HEAD_BYTES,
    Duplicates,
    Format,
    IncompleteRunError,
    MetricsError,
    ReadOptions,
    SkippedRecordsError,
    present_mask,
    read_summary,
    skipped_count,
)
from parity.readers.write import WRITABLE, write_metrics

__all__ = [
    "DUPLICATE_RULES",
    "FORMATS",
    "REGISTRY",
    "WRITABLE",
    "Format",
    "IncompleteRunError",
    "MetricsError",
    "SkippedRecordsError",
    "detect",
    "present_mask",
    "read_metrics",
    "read_summary",
    "skipped_count",
    "write_metrics",
]

# detection order: specific formats first, generic text last
_MODULES = (
    "hf",  # before tensorboard: HF's output_dir holds both, and trainer_state is float64
    "tensorboard",
    "wandb",
    "mlflow",
    "lightning",
    "nemo",
    "baselines",
    "jsonl",
    "csv_table",
    "verl_console",
)


def _registry() -> dict[str, Format]:
    out: dict[str, Format] = {}
    for name in _MODULES:
        for fmt in importlib.import_module(f"parity.readers.{name}").FORMATS:
            if fmt.name in out:
                raise RuntimeError(f"two readers named {fmt.name!r}")
            out[fmt.name] = fmt
    return out


REGISTRY: dict[str, Format] = _registry()
FORMATS: tuple[str, ...] = tuple(REGISTRY)
STREAM_LIMIT = 2 << 30  # bytes of a pipe or FIFO read into a temporary copy
FIFO_WAIT_S = 30.0  # how long a FIFO may wait for a writer (and its first bytes)
_CHUNK = 1 << 20


def _is_stream(path: Path) -> bool:
    """Whether `path` is something that exists but is neither a regular file nor a folder."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n and n % (1 << 30) == 0 else f"{n} bytes"


def _copy_stream(path: Path, dest: Path) -> None:
    """Read `path` once, to its end, into `dest`. A FIFO is opened without blocking and given
    FIFO_WAIT_S for a writer's first bytes (or its close), then read to its end."""
    fifo = stat.S_ISFIFO(path.stat().st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_NONBLOCK if fifo else 0))
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        if fifo:
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            if not poll.poll(int(FIFO_WAIT_S * 1000)):
                raise MetricsError(f"{path}: a FIFO with no writer after {FIFO_WAIT_S:g} s")
            os.set_blocking(fd, True)
        total = 0
        with dest.open("wb") as out:
            while chunk := os.read(fd, _CHUNK):
                total += len(chunk)
                if total > STREAM_LIMIT:
                    raise MetricsError(
                        f"{path}: a stream of more than {_size(STREAM_LIMIT)}; save it to a file "
                        "and give that"
                    )
                out.write(chunk)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


@contextmanager
def _readable(path: Path) -> Iterator[Path]:
    """`path` itself, or for a stream a temporary copy of all its bytes (same name, same
    folder name, for the formats that detect by them), removed afterwards."""
    if not _is_stream(path):
        yield path
        return
    folder = Path(tempfile.mkdtemp(prefix="parity-stream-"))
    try:
        copy = folder / (path.parent.name or "stream") / (path.name or "stream")
        copy.parent.mkdir()
        _copy_stream(path, copy)
        yield copy
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _as_given(text: str, copy: Path, path: Path) -> str:
    """A message or note about the copy, naming the path given instead."""
    return text.replace(str(copy), str(path)).replace(str(copy.parent), str(path.parent))


def _named(frame: pd.DataFrame, copy: Path, path: Path) -> pd.DataFrame:
    """A frame read from a stream's copy, its source and notes naming the stream."""
    if copy != path:
        frame.attrs["source"] = _as_given(str(frame.attrs.get("source", copy)), copy, path)
        frame.attrs["notes"] = [_as_given(n, copy, path) for n in frame.attrs.get("notes", [])]
    return frame


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(HEAD_BYTES)
    except OSError as e:
        raise MetricsError(f"{path}: cannot read: {e.strerror or e}") from None


def detect(path: str | os.PathLike[str]) -> Format:
    """The format that claims ``path`` (a file or a run folder); a one-line error if none does.

    A stream (a pipe, a FIFO) gives its first bytes to this and has lost them: read_metrics
    reads it once into a copy and detects on that."""
    p = Path(path)
    if not p.exists():
        raise MetricsError(f"{p}: cannot read: no such file or folder")
    if p.is_dir():
        if (p / "metrics.jsonl").is_file():  # our run folder
            return REGISTRY["jsonl"]
        for fmt in REGISTRY.values():
            if fmt.claims(p, None):
                return fmt
        raise MetricsError(
            f"{path}: folder has no metrics.jsonl, and no other run output this tool reads "
            "(TensorBoard events, a W&B run, mlruns/, trainer_state.json, metrics.csv); "
            "give the file itself or --format"
        )
    head = _head(p)
    if not head.strip():
        raise MetricsError(f"{p}: no metrics records (empty file)")
    for fmt in REGISTRY.values():
        if fmt.claims(p, head):
            return fmt
    raise MetricsError(
        f"{p}: unknown format: none of {', '.join(FORMATS)} (give --format to say which)"
    )


def read_metrics(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    run: str | None = None,
    duplicates: Duplicates = "error",
) -> pd.DataFrame:
    """Read a metrics file or run folder into the canonical exact frame (parity.readers.frame).

    fmt: a name of ``FORMATS`` (default: detected). run: which run of a folder holding several
    (TensorBoard, W&B, MLflow). duplicates: the rule for a (step, metric) logged twice with other
    bits: "error" (default) names it; "first" or "last" keeps one and says so in attrs["notes"].
    """
    if fmt is not None and fmt not in REGISTRY:
        raise ValueError(f"unknown metrics format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if duplicates not in DUPLICATE_RULES:
        raise ValueError(f"unknown duplicates rule {duplicates!r}; expected first, last or error")
    given = Path(path)
    if not given.exists():
        raise MetricsError(f"{given}: cannot read: no such file or folder")
    with _readable(given) as p:
        try:
            return _named(_read(p, fmt, ReadOptions(run=run, duplicates=duplicates)), p, given)
        except MetricsError as e:
            if p == given:
                raise
            raise type(e)(_as_given(str(e), p, given)) from None


def _read(p: Path, fmt: str | None, options: ReadOptions) -> pd.DataFrame:
    """Detect (unless fmt names the format) and read; a JSON or YAML value nested beyond
    Python's recursion limit where a reader did not expect one is a one-line error too."""
    try:
        if fmt is None:
            chosen = detect(p)
        else:
            chosen = REGISTRY[fmt]
            if p.is_dir() and fmt == "jsonl" and not (p / "metrics.jsonl").is_file():
                raise MetricsError(f"{p}: folder has no metrics.jsonl")
        return chosen.read(p, options)
    except RecursionError:
        raise MetricsError(f"{p}: cannot read: a value nested too deeply") from None
