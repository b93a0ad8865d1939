"""Every metric format into one exact pandas frame, and back out again.

The canonical frame: index "step" (int64, ascending, unique), one float64 column per metric
(names sorted), values bit for bit what the file holds. Absent cells are NaN, so a logged NaN and
an absent value look alike in the values; ``frame.attrs["present"]`` (a boolean frame of the same
shape) says which cells the source really had, and ``present_mask`` reads it robustly.

Other attrs: "source" (the file read), "format", and "complete": True/False for our jsonl (the
``{"event": "end"}`` record is there or not), None for formats without such a marker.

Caveat: pandas compares attrs in ``pd.concat``, which fails on a frame-valued attr; clear
``frame.attrs`` before concatenating read frames.

NaN payloads and signs are not kept: every text format writes a plain ``nan`` or ``NaN``.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

FORMATS = ("jsonl", "verl-console", "verl-jsonl", "csv")

_MAX_STEP = 2**63 - 1
# A verl console metric line: `step:N - k:v - ...` after whitespace or at line start (the
# lookbehind sits after the literal so the regex engine can scan for "step:" quickly).
_STEP_LINE = re.compile(r"step:(?<!\Sstep:)([0-9]+) - (.*)", re.ASCII)
_STEP_LINE_B = re.compile(rb"step:(?<!\Sstep:)[0-9]+ - .*")
_CSV_KW: dict[str, Any] = (
    {"float_precision": "round_trip"}
    if tuple(int(p) for p in pd.__version__.split(".")[:2]) < (3, 1)
    else {}  # pandas >= 3.1 has one (round-trip) converter and deprecates the option
)


class MetricsError(ValueError):
    """A metrics file that cannot be read exactly; the message names the file and line."""


class IncompleteRunError(MetricsError):
    """A run without its end record: killed or still running."""


class _DuplicateKey(Exception):
    pass


def _fail(path: Path, lineno: int | None, msg: str) -> MetricsError:
    return MetricsError(f"{path}:{lineno}: {msg}" if lineno else f"{path}: {msg}")


def _bad_key(key: str) -> bool:
    return not key or key == "step" or any(c.isspace() for c in key)


def _same(a: float, b: float) -> bool:
    """Same bits, or both NaN."""
    return a != a and b != b or np.float64(a).view(np.uint64) == np.float64(b).view(np.uint64)


# --- assembling cells into the canonical frame ------------------------------------------------


def _assemble(
    group_steps: np.ndarray,
    cell_group: np.ndarray,
    cell_col: np.ndarray,
    cell_val: np.ndarray,
    names: Sequence[str],
) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(values, present) from cells; None when one (step, metric) got two different values."""
    group_steps = np.asarray(group_steps, dtype=np.int64)
    if len(group_steps) < 2 or (group_steps[1:] > group_steps[:-1]).all():
        ustep, row = group_steps, np.asarray(cell_group, dtype=np.int64)  # the usual log
    else:
        ustep, inv = np.unique(group_steps, return_inverse=True)
        row = inv[cell_group].astype(np.int64)
    order = sorted(range(len(names)), key=lambda i: names[i])
    rank = np.empty(len(names), dtype=np.intp)
    rank[order] = np.arange(len(names))
    ncols = len(names)
    if ncols:
        flat = row * ncols
        flat += rank[cell_col]
    else:
        flat = cell_group
    vals = np.full(len(ustep) * ncols, np.nan)
    present = np.zeros(len(ustep) * ncols, dtype=bool)
    vals[flat] = cell_val
    present[flat] = True
    if int(present.sum()) != len(flat):  # some cell given twice: every copy must agree
        kept = vals[flat]
        agree = (kept.view(np.uint64) == cell_val.view(np.uint64)) | (
            np.isnan(kept) & np.isnan(cell_val)
        )
        if not agree.all():
            return None
    index = pd.Index(ustep, dtype=np.int64, name="step")
    columns = pd.Index([names[i] for i in order])
    shape = (len(ustep), ncols)
    return (
        pd.DataFrame(vals.reshape(shape), index=index, columns=columns, copy=False),
        pd.DataFrame(present.reshape(shape), index=index, columns=columns, copy=False),
    )


class _Cells:
    """Cells collected row by row (the slow, line-numbered readers)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.group: list[int] = []
        self.col: list[int] = []
        self.val: list[float] = []
        self.names: dict[str, int] = {}

    def add(self, group: int, key: str, value: float) -> None:
        self.group.append(group)
        self.col.append(self.names.setdefault(key, len(self.names)))
        self.val.append(value)

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame] | None:
        return _assemble(
            np.array(self.steps, dtype=np.int64),
            np.array(self.group, dtype=np.intp),
            np.array(self.col, dtype=np.intp),
            np.array(self.val, dtype=np.float64),
            list(self.names),
        )


# --- jsonl (ours) and verl-jsonl ----------------------------------------------------------------


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def _number(path: Path, lineno: int, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, lineno, f"value of {key!r} is not numeric: {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise _fail(path, lineno, f"value of {key!r} does not fit a float64: {value}") from None


def _step(path: Path, lineno: int, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_STEP:
        raise _fail(path, lineno, f"step must be a non-negative integer, got {value!r}")
    return value


def _read_json_lines(text: str, path: Path, fmt: str) -> tuple[_Cells, bool | None]:
    cells = _Cells()
    first_line: dict[int, int] = {}
    end_line: int | None = None
    lines = text.split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if end_line is not None:
            raise _fail(path, lineno, f"record after the end record of line {end_line}")
        try:
            rec = json.loads(line, object_pairs_hook=_pairs)
        except _DuplicateKey as e:
            raise _fail(path, lineno, f"key {e.args[0]!r} given twice") from None
        except ValueError as e:
            if lineno == len(lines):  # no newline after it: the writer was cut off
                raise _fail(
                    path, lineno, "last line is not valid JSON: file is truncated (run incomplete)"
                ) from None
            raise _fail(path, lineno, f"not valid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise _fail(path, lineno, f"record is not a JSON object: {line[:60]!r}")
        if fmt == "jsonl" and "event" in rec:
            if rec["event"] != "end" or set(rec) - {"event", "steps", "_meta"}:
                raise _fail(path, lineno, f"unknown event record: {line[:80]!r}")
            _step(path, lineno, rec.get("steps"))
            end_line = lineno
            continue
        if "step" not in rec:
            raise _fail(path, lineno, "record has no 'step'")
        step = _step(path, lineno, rec["step"])
        if step in first_line:
            raise _fail(path, lineno, f"duplicate step {step} (first at line {first_line[step]})")
        first_line[step] = lineno
        if fmt == "jsonl":
            metrics = {k: v for k, v in rec.items() if k not in ("step", "_meta")}
        else:
            extra = set(rec) - {"step", "data"}
            if extra:
                raise _fail(path, lineno, f"unexpected key {sorted(extra)[0]!r} beside step/data")
            metrics = rec.get("data")
            if not isinstance(metrics, dict):
                raise _fail(path, lineno, "'data' is not a JSON object")
        group = len(cells.steps)
        cells.steps.append(step)
        for key, value in metrics.items():
            cells.add(group, key, _number(path, lineno, key, value))
    return cells, (end_line is not None) if fmt == "jsonl" else None


# --- csv ------------------------------------------------------------------------------------------


def _read_csv(text: str, path: Path) -> _Cells:
    cells = _Cells()
    reader = csv.reader(io.StringIO(text, newline=""))
    first_line: dict[int, int] = {}
    try:
        header = next((row for row in reader if row), None)
        if header is None:
            raise _fail(path, None, "no metrics records")
        names = list(header)
        if names.count("step") != 1:
            raise _fail(path, reader.line_num, "header needs exactly one 'step' column")
        if len(set(names)) != len(names) or "" in names:
            raise _fail(path, reader.line_num, "header has empty or repeated column names")
        si = names.index("step")
        for row in reader:
            if not row:
                continue
            lineno = reader.line_num
            if len(row) != len(names):
                raise _fail(path, lineno, f"expected {len(names)} fields, got {len(row)}")
            raw_step = row[si].strip()
            if not re.fullmatch(r"[0-9]+", raw_step, re.ASCII) or int(raw_step) > _MAX_STEP:
                raise _fail(path, lineno, f"step must be a non-negative integer, got {raw_step!r}")
            step = int(raw_step)
            if step in first_line:
                raise _fail(
                    path, lineno, f"duplicate step {step} (first at line {first_line[step]})"
                )
            first_line[step] = lineno
            group = len(cells.steps)
            cells.steps.append(step)
            for i, cell in enumerate(row):
                if i == si or cell == "":
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    raise _fail(
                        path, lineno, f"value of {names[i]!r} is not numeric: {cell!r}"
                    ) from None
                cells.add(group, names[i], value)
    except csv.Error as e:
        raise _fail(path, reader.line_num, f"bad csv: {e}") from None
    return cells


# --- verl console -------------------------------------------------------------------------------


_WS = np.zeros(256, dtype=bool)
_WS[list(b" \t\n\r\x0b\x0c")] = True  # what `\S` excludes in a bytes pattern
_POW10 = 10 ** np.arange(1, 17, dtype=np.int64)  # digits of n < 2**53: 1 + #(powers <= n)


def _step_text(raw: bytes) -> tuple[bytes, np.ndarray] | None:
    """The matched step lines joined by newlines, as `b"\n".join(_STEP_LINE_B.findall(raw))`
    gives them, found with numpy instead of the regex; None when that cannot be shown cheaply.

    Also returns where each line's `step:` starts, for `_steps_are_digits`: which candidate lines
    really are `step:[0-9]+ - ...` is only known once the steps are parsed.
    """
    buf = np.frombuffer(raw, dtype=np.uint8)
    n = len(buf)
    at = np.flatnonzero(buf[: max(n - 4, 0)] == ord("s"))  # every "step:" that fits
    for k, c in enumerate(b"tep:", 1):
        at = at[buf[at + k] == c]
    if not len(at):
        return None
    # e.g. "timestep:": the regex would look further along that line
    if not (_WS[buf[np.maximum(at - 1, 0)]] | (at == 0)).all():
        return None
    newlines = np.flatnonzero(buf == ord("\n"))
    line = np.searchsorted(newlines, at)  # the line of each "step:"
    if len(at) > 1 and not (np.diff(line) > 0).all():
        return None  # two in one line: the regex takes the first that matches
    ends = np.append(newlines, n)[line]  # each match runs to the end of its line
    # one piece per run of matches that start right after the previous line's newline
    joins = np.flatnonzero(at[1:] != ends[:-1] + 1)
    firsts = np.concatenate(([0], joins + 1))
    lasts = np.append(joins, len(at) - 1)
    view = memoryview(raw)
    pieces = zip(at[firsts].tolist(), ends[lasts].tolist(), strict=True)
    text = b"\n".join([view[a:b] for a, b in pieces])
    return text, at


def _steps_are_digits(raw: bytes, at: np.ndarray, steps: np.ndarray) -> bool:
    """Whether each `step:` at `at` is followed by exactly the decimal digits of its parsed
    step (no sign, point, exponent or leading zero) and then ' - ', as the regex requires."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    if not ((steps >= 0) & (steps < 2.0**53)).all():  # also NaN
        return False
    ints = steps.astype(np.int64)
    if (ints != steps).any():
        return False
    width = 1 + np.searchsorted(_POW10, ints, side="right")
    first = at + 5
    if (first + width + 3 > len(buf)).any():
        return False
    span = np.arange(int(width.max()))
    digits = buf[np.minimum(first[:, None] + span, len(buf) - 1)]
    digits = np.where(span < width[:, None], digits, ord("0"))
    if ((digits < ord("0")) | (digits > ord("9"))).any():
        return False
    after = buf[(first + width)[:, None] + np.arange(3)]
    return bool((after == np.frombuffer(b" - ", dtype=np.uint8)).all())


@dataclass
class _Tokens:
    """One piece of a console log, tokenized: a category code and a value per ' - ' token."""

    cats: list[str]  # the key of each code ("step" among them)
    codes: np.ndarray
    vals: np.ndarray
    n_lines: int


def _maybe_bool(body: bytes, rows: np.ndarray) -> bool:
    """Whether a row of `body` read as 0 or 1 may have been true/false (some pandas read those
    as 1/0 where float() refuses them): its text ends in 'e' or 'E'. Only those rows are looked
    at, found by their newlines, so a log with no such values pays nothing."""
    if not len(rows):
        return False
    buf = np.frombuffer(body, dtype=np.uint8)
    ends = np.append(np.flatnonzero(buf == ord("\n")), len(buf))
    if len(ends) <= rows[-1]:
        return True  # not one row per line: do not guess
    last = buf[ends[rows] - 1]
    return bool(((last == ord("e")) | (last == ord("E"))).any())


def _console_tokens(raw: bytes | memoryview) -> _Tokens | None:
    """The step lines of `raw` as tokens, or None ("let the line-by-line reader decide").

    It accepts only text where the result is provably the slow reader's: each ' - ' token
    becomes one row for pandas' C parser with ':' as separator, which rejects any row that is
    not exactly `key:float`; rows with whitespace fall back. The step lines are found with numpy
    (`_step_text`, then checked by `_steps_are_digits`), else with the regex.
    """
    found = _step_text(raw)
    if found is None:
        lines = _STEP_LINE_B.findall(raw)
        if not lines:  # none in this half (maybe in the other)
            return _Tokens([], np.zeros(0, dtype=np.int8), np.zeros(0), 0)
        text, at, n_lines = b"\n".join(lines), None, len(lines)
        del lines
    else:
        (text, at), n_lines = found, len(found[1])
    body = text.replace(b" - ", b"\n")
    del text
    # a space left was inside a token; an empty last token
    if any(c in body for c in (b" ", b"\t", b"\x0b", b"\x0c", b"\x00")) or body.endswith(b"\n"):
        return None
    try:
        df = pd.read_csv(
            io.BytesIO(body),
            sep=":",
            header=None,
            names=["k", "v"],
            dtype={"k": "category", "v": np.float64},
            keep_default_na=False,
            na_values={"v": ["nan"]},
            quoting=csv.QUOTE_NONE,
            skip_blank_lines=False,
            encoding_errors="strict",
            engine="c",
            **_CSV_KW,
        )
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError):
        return None
    cats = [str(c) for c in df["k"].cat.categories]
    codes = df["k"].cat.codes.to_numpy()
    if "step" not in cats or (codes < 0).any():
        return None
    step_code = cats.index("step")
    if any(_bad_key(c) for i, c in enumerate(cats) if i != step_code):
        return None
    is_step = codes == step_code
    if int(is_step.sum()) != n_lines:  # a metric named 'step'
        return None
    vals = df["v"].to_numpy(dtype=np.float64)
    del df
    steps = vals[is_step]
    if (steps >= 2.0**53).any():
        return None
    if at is not None and not _steps_are_digits(raw, at, steps):
        return None
    if _maybe_bool(body, np.flatnonzero(((vals == 0.0) | (vals == 1.0)) & ~is_step)):
        return None
    return _Tokens(cats, codes, vals, n_lines)


_PIECE_BYTES = 4 << 20  # a log is read in pieces of about this size, on one thread per core


def _cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pieces(raw: bytes) -> list[bytes | memoryview]:
    """`raw` cut after the first newline past every `_PIECE_BYTES` (lines are read one by one,
    so nothing spans a cut); whole when it is small.

    Why pieces and not one per core: the join and `bytes.replace` of `_console_tokens` hold the
    GIL while numpy and pandas' parser release it, so with several pieces per thread one
    thread's GIL-bound part overlaps another's parsing (a 1M-line log, 88 MB, on 2 cores: about
    0.8 s in 4 MB pieces, 1.0-1.1 s in two halves)."""
    if len(raw) < 2 * _PIECE_BYTES:
        return [raw]
    view, pieces, start = memoryview(raw), [], 0
    while len(raw) - start >= 2 * _PIECE_BYTES:
        cut = raw.find(b"\n", start + _PIECE_BYTES)
        if cut < 0:
            break
        pieces.append(view[start : cut + 1])
        start = cut + 1
    if start < len(raw):
        pieces.append(view[start:])
    return pieces


def _merge(pieces: list[_Tokens]) -> _Tokens:
    """One token list from the pieces' own, their codes mapped into the union of their keys."""
    if len(pieces) == 1:
        return pieces[0]
    cats: dict[str, int] = {}
    for piece in pieces:
        for c in piece.cats:
            cats.setdefault(c, len(cats))
    codes = [np.array([cats[c] for c in p.cats], dtype=np.int32)[p.codes] for p in pieces]
    return _Tokens(
        list(cats),
        np.concatenate(codes),
        np.concatenate([p.vals for p in pieces]),
        sum(p.n_lines for p in pieces),
    )


def _console_fast(raw: bytes) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Vectorised path for well-formed logs; None means "let the line-by-line reader decide".

    A large log is read in pieces on one thread per core (numpy and pandas' parser release the
    GIL), then its tokens are merged; every check of `_console_tokens` holds for each piece.
    """
    parts = _pieces(raw)
    if len(parts) == 1:
        pieces = [_console_tokens(raw)]
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(parts), _cores())) as pool:
            pieces = list(pool.map(_console_tokens, parts))
        del parts
    if any(p is None for p in pieces):
        return None
    tokens = _merge(pieces)  # type: ignore[arg-type]
    if not tokens.n_lines:
        return None
    codes, vals, n_lines, cats = tokens.codes, tokens.vals, tokens.n_lines, tokens.cats
    step_code = cats.index("step")
    is_step = codes == step_code
    steps = vals[is_step]
    names = cats[:step_code] + cats[step_code + 1 :]
    dense = _same_keys(codes, vals, steps, n_lines, step_code, names)
    if dense is not None:
        return dense
    cell = ~is_step
    line = np.cumsum(is_step) - 1
    col = codes[cell].astype(np.intp)
    col -= col > step_code  # drop the 'step' category
    return _assemble(steps.astype(np.int64), line[cell], col, vals[cell], names)


def _same_keys(
    codes: np.ndarray,
    vals: np.ndarray,
    steps: np.ndarray,
    n_lines: int,
    step_code: int,
    names: list[str],
) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """The usual log, without the cell-by-cell assembly: every line has `step` and then the same
    keys in the same order, once each, and the steps rise. None otherwise (`_assemble` then)."""
    width = len(codes) // n_lines
    if width * n_lines != len(codes) or width != len(names) + 1:
        return None
    grid = codes.reshape(n_lines, width)
    first = grid[0]
    if first[0] != step_code or not (grid == first).all():
        return None
    ints = steps.astype(np.int64)
    if n_lines > 1 and not (ints[1:] > ints[:-1]).all():
        return None
    keys = first[1:].astype(np.intp)
    keys -= keys > step_code  # into `names`
    order = np.argsort([names[i] for i in keys], kind="stable")
    index = pd.Index(ints, dtype=np.int64, name="step")
    columns = pd.Index([names[keys[i]] for i in order])
    values = vals.reshape(n_lines, width)[:, 1:][:, order]
    present = np.ones(values.shape, dtype=bool)
    return (
        pd.DataFrame(values, index=index, columns=columns, copy=False),
        pd.DataFrame(present, index=index, columns=columns, copy=False),
    )


def _console_slow(text: str, path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Line-by-line reader: the reference semantics, and the one that names bad lines."""
    cells = _Cells()
    seen: dict[tuple[int, str], tuple[float, int]] = {}
    for lineno, line in enumerate(text.split("\n"), 1):
        m = _STEP_LINE.search(line)
        if m is None:
            continue
        step = int(m[1])
        if step > _MAX_STEP:
            raise _fail(path, lineno, f"step {step} does not fit int64")
        group = len(cells.steps)
        cells.steps.append(step)
        for token in m[2].split(" - "):
            key, colon, raw = token.rpartition(":")
            if key == "step":
                raise _fail(path, lineno, f"step {step}: a metric may not be named 'step'")
            if not colon or _bad_key(key):
                raise _fail(
                    path, lineno, f"step {step}: malformed metric {token!r} (want key:value)"
                )
            try:
                value = float(raw)
            except ValueError:
                raise _fail(path, lineno, f"value of {key!r} is not numeric: {raw!r}") from None
            prev = seen.get((step, key))
            if prev is not None and not _same(prev[0], value):
                raise _fail(
                    path,
                    lineno,
                    f"step {step}: {key!r} is {value!r} here but {prev[0]!r} at line {prev[1]}",
                )
            seen[(step, key)] = (value, lineno)
            cells.add(group, key, value)
    if not cells.steps:
        raise _fail(path, None, "no metrics records (no 'step:N - ' lines)")
    out = cells.frames()
    assert out is not None  # conflicts were raised above
    return out


# --- reading ----------------------------------------------------------------------------------


def _resolve(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
        if not p.is_file():
            raise MetricsError(f"{path}: folder has no metrics.jsonl")
    return p


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, raw.count(b"\n", 0, e.start) + 1, "not valid UTF-8") from None


def _detect(raw: bytes, path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "csv"
    head = raw.lstrip()
    if head.startswith(b"{"):
        try:
            rec = json.loads(head.split(b"\n", 1)[0])
        except ValueError:
            rec = None  # a console log may start with a printed config dict
        if isinstance(rec, dict):
            return "verl-jsonl" if isinstance(rec.get("data"), dict) else "jsonl"
    if path.suffix.lower() == ".jsonl":
        return "jsonl"  # its reader names the bad line
    if _STEP_LINE_B.search(raw):
        return "verl-console"
    if head.startswith(b"{"):
        return "jsonl"  # its reader names the bad line
    if not head:
        raise _fail(path, None, "no metrics records (empty file)")
    raise _fail(path, None, "unknown format: neither JSON lines, csv, nor verl 'step:N - ' lines")


def read_metrics(path: str | os.PathLike[str], fmt: str | None = None) -> pd.DataFrame:
    """Read a metrics file (or a run folder's metrics.jsonl) into the canonical exact frame."""
    file = _resolve(path)
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown metrics format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        raw = file.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError as e:
        raise MetricsError(f"{file}: cannot read: {e.strerror or e}") from None
    fmt = fmt or _detect(raw, file)
    complete: bool | None = None
    if fmt == "verl-console":
        if b"\r" in raw:
            raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out = _console_fast(raw)
        if out is None:
            out = _console_slow(raw.decode("utf-8", errors="replace"), file)
    else:
        text = _decode(raw, file)
        if fmt == "csv":
            cells = _read_csv(text, file)
        else:
            cells, complete = _read_json_lines(text, file, fmt)
        if not cells.steps:
            raise _fail(file, None, "no metrics records")
        out = cells.frames()
        assert out is not None  # steps are unique, keys unique per record
    frame, present = out
    frame.attrs.update(source=str(file), format=fmt, complete=complete, present=present)
    return frame


def present_mask(frame: pd.DataFrame) -> pd.DataFrame:
    """Which cells the source had: attrs["present"] aligned to the frame, or'ed with notna.

    Robust to slicing and to values set after reading (a non-NaN value is always present).
    """
    present = frame.notna()
    mask = frame.attrs.get("present")
    if isinstance(mask, pd.DataFrame) and mask.index.is_unique and mask.columns.is_unique:
        aligned = mask.reindex(index=frame.index, columns=frame.columns, fill_value=False)
        present = present | aligned.astype(bool)
    return present


# --- writing ----------------------------------------------------------------------------------


def _records(frame: pd.DataFrame) -> list[tuple[int, list[tuple[str, float]]]]:
    if not frame.index.is_unique:
        raise MetricsError("cannot write metrics: steps are not unique")
    steps = np.asarray(frame.index)
    if steps.dtype.kind not in "iu" or (len(steps) and steps.min() < 0):
        raise MetricsError("cannot write metrics: steps must be non-negative integers")
    names = [str(c) for c in frame.columns]
    values = frame.to_numpy(dtype=np.float64)
    present = present_mask(frame).to_numpy()
    order = np.argsort(steps, kind="stable")
    return [
        (int(steps[r]), [(names[c], float(values[r, c])) for c in np.flatnonzero(present[r])])
        for r in order
    ]


def _lines(frame: pd.DataFrame, fmt: str) -> list[str]:
    recs = _records(frame)
    names = [str(c) for c in frame.columns]
    if fmt == "jsonl":
        clash = {"step", "_meta", "event"} & set(names)
        if clash:
            raise MetricsError(f"cannot write jsonl: metric named {sorted(clash)[0]!r}")
        out = [json.dumps({"step": s, **dict(kv)}) for s, kv in recs]
        if frame.attrs.get("complete") is not False:
            last = max((s for s, _ in recs), default=0)
            out.append(json.dumps({"event": "end", "steps": last}))
        return out
    if fmt == "verl-jsonl":
        return [json.dumps({"step": s, "data": dict(kv)}) for s, kv in recs]
    if fmt == "verl-console":
        bad = [n for n in names if _bad_key(n)]
        if bad:
            raise MetricsError(f"cannot write verl-console: bad metric name {bad[0]!r}")
        out = []
        for s, kv in recs:
            if not kv:
                raise MetricsError(f"cannot write verl-console: step {s} has no metrics")
            out.append(" - ".join([f"step:{s}"] + [f"{k}:{v!r}" for k, v in kv]))
        return out
    if fmt == "csv":
        if "step" in names:
            raise MetricsError("cannot write csv: metric named 'step'")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["step", *names])
        for s, kv in recs:
            cells = dict(kv)
            writer.writerow([s, *(repr(cells[n]) if n in cells else "" for n in names)])
        return buf.getvalue().splitlines()
    raise ValueError(f"unknown metrics format {fmt!r}; expected one of {', '.join(FORMATS)}")


def write_metrics(frame: pd.DataFrame, path: str | os.PathLike[str], fmt: str) -> None:
    """Write exactly (float repr) and atomically; absent cells (present_mask) are left out.

    Our jsonl gets the end record unless frame.attrs["complete"] is False.
    """
    text = "".join(line + "\n" for line in _lines(frame, fmt))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
