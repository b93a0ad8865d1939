"""Every metric format into one exact pandas frame (the contract: parity/readers/frame.py).

One module per format; each declares its ``FORMATS`` (name, how it claims a path, how it reads
it). ``read_metrics`` picks the format by ``--format`` or by asking each in ``_MODULES`` order,
the specific ones (a TensorBoard event file, a W&B run) before the generic ones (JSON lines,
CSV, and last of all verl's console lines, which may hide in any text).

Installed packages add formats in the ``llm_parity.readers`` entry points, each giving a
``Format`` or an iterable of them:

    [project.entry-points."llm_parity.readers"]
    mylog = "mypkg.readers:FORMATS"

They are asked after every built-in format: a plugin never takes a path a built-in format
claims unless the user names it (``--format NAME``), so a plugin that claims too much cannot
turn a file of ours into its own reading of it. Where the built-in reader then refuses the
path and a plugin claims it, the error says so and which ``--format`` to give. They load
lazily, once per process, the first time a plugin is needed (a path no built-in claims, a
name that is no built-in one): a package that fails to import then fails the reads that need
it, with a one-line ``ReaderPluginError`` naming its entry point, never ``import
parity.readers`` (the CLI imports it for every command), and a read of a built-in format
never loads them. A format name given twice (by two entry points, or one and a built-in) is
that error too. ``REGISTRY`` (name -> Format) is strict: it raises that error. ``FORMATS``
(the names, for argparse's choices and messages) never raises: with a plugin broken it holds
the built-in names and lets any name through its ``in``, so that the read itself says what is
wrong.

A plugin's code is the user's input, not the harness: an exception from its ``claims`` or
``read`` (other than an ``InputError``, which already says what is wrong with the file), and a
frame that breaks the contract (parity.readers.contract: a column of ``None``, a float index),
are each a one-line ``ReaderPluginError`` naming the entry point, its module and the path (exit
2), never an internal error and never a verdict. ``claims`` must answer within
``CLAIMS_LIMIT_S``: it runs in a daemon thread that is abandoned, not killed (Python cannot
kill a thread), when it does not; the error names the plugin, and the thread ends with the
process. ``read`` has no limit (a big run takes long to read).

A path that is no regular file or folder (a pipe, `<(zcat m.jsonl.gz)` i.e. /dev/fd/N, a named
FIFO) can be read only once: ``read_metrics`` copies it whole into a temporary file (up to
``STREAM_LIMIT`` bytes) and detects and reads that copy, so no byte goes to format detection
alone; errors and attrs["source"] still name the path given. A FIFO no writer opens within
``FIFO_WAIT_S`` seconds is refused, not waited on forever.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import select
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pandas as pd

from parity.errors import InputError
from parity.readers.contract import frame_problem
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
from parity.record.runfolder import METRICS, metrics_path

__all__ = [
    "DUPLICATE_RULES",
    "FORMATS",
    "REGISTRY",
    "WRITABLE",
    "Format",
    "IncompleteRunError",
    "MetricsError",
    "ReadOptionError",
    "ReaderPluginError",
    "SkippedRecordsError",
    "detect",
    "present_mask",
    "read_metrics",
    "read_summary",
    "skipped_count",
    "write_metrics",
]

PLUGIN_GROUP = "llm_parity.readers"
CLAIMS_LIMIT_S = 5.0  # how long a plugin's claims() may take to answer
# detection order: specific formats first, then generic text, then the plugins'
_SPECIFIC = (
    "hf",  # before tensorboard: HF's output_dir holds both, and trainer_state is float64
    "tensorboard",
    "wandb",
    "mlflow",
    "lightning",
    "nemo",
    "baselines",
)
_GENERIC = ("jsonl", "csv_table", "verl_console")
_MODULES = _SPECIFIC + _GENERIC


class ReadOptionError(InputError):
    """An option of read_metrics that names no format or duplicates rule."""


class ReaderPluginError(InputError):
    """A package's reader entry point that cannot be loaded, gives no Format, or gives a name
    another format has; the message names the entry point."""


def _builtin(modules: tuple[str, ...]) -> dict[str, tuple[Format, str]]:
    """The formats of parity's own reader modules: name -> (Format, where it comes from)."""
    out: dict[str, tuple[Format, str]] = {}
    for name in modules:
        for fmt in importlib.import_module(f"parity.readers.{name}").FORMATS:
            if fmt.name in out:
                raise RuntimeError(f"two readers named {fmt.name!r}")
            out[fmt.name] = (fmt, f"parity.readers.{name}")
    return out


_BUILTIN_SPECIFIC = _builtin(_SPECIFIC)
_BUILTIN_GENERIC = _builtin(_GENERIC)
_BUILTIN = {**_BUILTIN_SPECIFIC, **_BUILTIN_GENERIC}


def _entry(ep: EntryPoint) -> str:
    return f"{ep.name} = {ep.value} ({PLUGIN_GROUP})"


def _formats_of(ep: EntryPoint) -> list[Format]:
    """The Formats one entry point gives (a Format or an iterable of them)."""
    try:
        given = ep.load()
    except Exception as e:  # the package's own failure, said with its entry point
        said = (str(e).strip().splitlines() or [""])[0]
        raise ReaderPluginError(f"reader plugin {_entry(ep)} cannot be loaded: "
                                f"{type(e).__name__}: {said}") from None  # fmt: skip
    if isinstance(given, Format):
        return [given]
    items = list(given) if isinstance(given, Iterable) and not isinstance(given, str) else None
    if not items or not all(isinstance(f, Format) for f in items):
        raise ReaderPluginError(f"reader plugin {_entry(ep)} gives {type(given).__name__}, "
                                "not a parity.readers.Format or an iterable of them")  # fmt: skip
    return items


def _first_line(e: BaseException) -> str:
    said = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {said}" if said else type(e).__name__


def _claims_in_time(fmt: Format, who: str, path: Path, head: bytes | None) -> bool:
    """A plugin's claims(path, head), in a daemon thread given CLAIMS_LIMIT_S to answer: a
    thread cannot be killed, so one that does not answer is abandoned with an error."""
    answer: list[object] = []

    def ask() -> None:
        try:
            answer.append(bool(fmt.claims(path, head)))
        except BaseException as e:  # handed to the caller's thread, said there
            answer.append(e)

    thread = threading.Thread(target=ask, name=f"parity-claims-{fmt.name}", daemon=True)
    thread.start()
    thread.join(CLAIMS_LIMIT_S)
    if not answer:
        raise ReaderPluginError(f"{who}: claims({path}) did not answer within "
                                f"{CLAIMS_LIMIT_S:g} s")  # fmt: skip
    if isinstance(answer[0], InputError | KeyboardInterrupt):
        raise answer[0]
    if isinstance(answer[0], BaseException):
        raise ReaderPluginError(f"{who}: claims({path}) failed: {_first_line(answer[0])}")
    return bool(answer[0])


def _read_checked(fmt: Format, who: str, path: Path, options: ReadOptions) -> pd.DataFrame:
    """A plugin's read(path, options), its failure and a frame that breaks the contract each
    a ReaderPluginError naming the plugin and the path; an InputError of its own passes."""
    try:
        frame = fmt.read(path, options)
    except InputError:
        raise
    except Exception as e:  # the plugin's own failure, said with its entry point
        raise ReaderPluginError(f"{who}: read of {path} failed: {_first_line(e)}") from None
    problem = frame_problem(frame, fmt.name)
    if problem:
        raise ReaderPluginError(f"{who}: read of {path} gave a frame against the reader "
                                f"contract: {problem}")  # fmt: skip
    return frame


def _guarded(fmt: Format, ep: EntryPoint) -> Format:
    """A plugin's Format whose claims is bounded in time and whose failures and frames are
    checked, each error naming the entry point and its module."""
    who = f"reader plugin {_entry(ep)}, format {fmt.name!r}"
    return dataclasses.replace(
        fmt,
        claims=lambda path, head: _claims_in_time(fmt, who, path, head),
        read=lambda path, options: _read_checked(fmt, who, path, options),
    )


@cache
def _registry() -> dict[str, Format]:
    """Every format in detection order: specific built-ins, generic built-ins, then the
    plugins' (by entry point name), guarded. Raises ReaderPluginError for a plugin that cannot
    be used."""
    seen = {name: f"the built-in {origin}" for name, (_, origin) in _BUILTIN.items()}
    plugins: dict[str, Format] = {}
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: (e.name, e.value)):
        for fmt in _formats_of(ep):
            if fmt.name in seen:
                raise ReaderPluginError(f"reader format {fmt.name!r} is given twice: by entry "
                                        f"point {_entry(ep)} and by {seen[fmt.name]}")  # fmt: skip
            seen[fmt.name] = f"entry point {_entry(ep)}"
            plugins[fmt.name] = _guarded(fmt, ep)
    return {**{name: fmt for name, (fmt, _) in _BUILTIN.items()}, **plugins}


def _plugins() -> list[Format]:
    """The plugins' formats, guarded, in detection order (ReaderPluginError as _registry)."""
    return [fmt for name, fmt in _registry().items() if name not in _BUILTIN]


class _Registry(Mapping[str, Format]):
    """name -> Format, the plugins' loaded at the first lookup of a name no built-in has, or at
    the first walk over all (detection)."""

    def __getitem__(self, name: str) -> Format:
        return _BUILTIN[name][0] if name in _BUILTIN else _registry()[name]

    def __contains__(self, name: object) -> bool:
        return name in _BUILTIN or name in _registry()

    def __iter__(self) -> Iterator[str]:
        return iter(_registry())

    def __len__(self) -> int:
        return len(_registry())


class _Names(Sequence[str]):
    """The format names, in detection order, for choices and messages: never raises. With a
    plugin broken, the built-in names, and any name is ``in``: the read says what is wrong."""

    def _names(self) -> tuple[str, ...]:
        try:
            return tuple(_registry())
        except ReaderPluginError:
            return tuple(_BUILTIN_SPECIFIC) + tuple(_BUILTIN_GENERIC)

    def __contains__(self, name: object) -> bool:
        if name in _BUILTIN:
            return True
        try:
            return name in _registry()
        except ReaderPluginError:
            return True

    def __getitem__(self, index):  # type: ignore[override]
        return self._names()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


REGISTRY: Mapping[str, Format] = _Registry()
FORMATS: Sequence[str] = _Names()
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


def _claimant(p: Path, head: bytes | None) -> Format | None:
    """The first format that claims ``p``: the built-in ones first, the plugins (loaded only
    now) when none of them does."""
    for fmt, _ in _BUILTIN.values():
        if fmt.claims(p, head):
            return fmt
    for fmt in _plugins():
        if fmt.claims(p, head):
            return fmt
    return None


def _plugin_hint(p: Path) -> str:
    """' (the reader plugin ... claims it too: give --format NAME)' where a plugin claims
    ``p``, which a built-in format claimed first and refused; '' where none does (or none can
    be loaded or asked: the built-in's error stands alone)."""
    try:
        head = None if p.is_dir() else _head(p)
        names = [fmt.name for fmt in _plugins() if fmt.claims(p, head)]
    except InputError:
        return ""
    if not names:
        return ""
    return (f" (the reader plugin format {names[0]!r} claims it too, after the built-in ones: "
            f"give --format {names[0]} to read it so)")  # fmt: skip


def detect(path: str | os.PathLike[str]) -> Format:
    """The format that claims ``path`` (a file or a run folder); a one-line error if none does.

    A stream (a pipe, a FIFO) gives its first bytes to this and has lost them: read_metrics
    reads it once into a copy and detects on that."""
    p = Path(path)
    if not p.exists():
        raise MetricsError(f"{p}: cannot read: no such file or folder")
    if p.is_dir():
        if metrics_path(p).is_file():  # our run folder
            return REGISTRY["jsonl"]
        found = _claimant(p, None)
        if found is not None:
            return found
        raise MetricsError(
            f"{path}: folder has no {METRICS}, and no other run output this tool reads "
            "(TensorBoard events, a W&B run, mlruns/, trainer_state.json, metrics.csv); "
            "give the file itself or --format"
        )
    head = _head(p)
    if not head.strip():
        raise MetricsError(f"{p}: no metrics records (empty file)")
    found = _claimant(p, head)
    if found is not None:
        return found
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
        raise ReadOptionError(
            f"unknown metrics format {fmt!r}; expected one of {', '.join(REGISTRY)}"
        )
    if duplicates not in DUPLICATE_RULES:
        raise ReadOptionError(
            f"unknown duplicates rule {duplicates!r}; expected first, last or error"
        )
    given = Path(path)
    if not given.exists():
        raise MetricsError(f"{given}: cannot read: no such file or folder")
    with _readable(given) as p:
        try:
            return _named(_read(p, fmt, ReadOptions(run=run, duplicates=duplicates)), p, given)
        except (MetricsError, ReaderPluginError) as e:
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
            if p.is_dir() and fmt == "jsonl" and not metrics_path(p).is_file():
                raise MetricsError(f"{p}: folder has no {METRICS}")
        try:
            return chosen.read(p, options)
        except MetricsError as e:
            hint = _plugin_hint(p) if fmt is None and chosen.name in _BUILTIN else ""
            if not hint:
                raise
            raise type(e)(f"{e}{hint}") from None
    except RecursionError:
        raise MetricsError(f"{p}: cannot read: a value nested too deeply") from None
