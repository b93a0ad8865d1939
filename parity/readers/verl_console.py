"""verl's console lines, as verl prints them: `step:N - key:value - ...`.

verl's LocalLogger prints `"step:{step} - " + " - ".join(f"{k}:{pprint.pformat(v)}")` for every
number in the step's metrics (verl/utils/logger/aggregate_logger.py, 0.6 to 0.9). So a value is
what `pformat` gives: a Python float's repr, `True`/`False`, and with numpy >= 2
`np.float64(0.5)`, `np.float32(0.1)` or `np.int64(3)` (numpy 1.x prints numpy scalars bare).
A `np.float32(...)` value holds float32 only: its metric's precision is float32.

The log people have is rarely clean: tqdm's progress bar on the same stream (`2>&1`) leaves the
bar in front of the next printed line (`... 1/5 [00:01<00:04]step:2 - ...`), Ray prefixes lines
with its actor (`(TaskRunner pid=7) `, colored), and other output comes between. A step line
starts at `step:` wherever it is, unless a name runs into it (`global_step:`, `timestep:`,
`train/step:`). A line that is a step line but does not parse is skipped and counted, never
dropped in silence; so is a value a float64 cannot hold (`1e999`, `1e-400`: frame.UNFIT), and
a last step line without its newline (cut off by a run still writing, or killed: a value cut
mid-number still parses), even one cut before its values, down to the start of its `step:`
(`ste` after a newline, a bar or a Ray prefix).

Two readers with one meaning: a vectorised one (numpy finds the lines and their ` - `
separators, pandas' C parser reads `key:float` tokens) for the usual log, and the line-by-line
reference, which decides everything the fast one cannot prove.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parity.readers.frame import (
    FLOAT32,
    FLOAT64,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    Unfit,
    assemble,
    bad_key,
    beyond_max_step,
    fail,
    finish,
    infer_decimals,
    unfit,
    written_in_full,
)
from parity.readers.text import CUT_TAIL, cut_tail, read_bytes

# A verl console metric line: `step:N - k:v - ...` where no name runs into `step:` (the
# lookbehind sits after the literal so the regex engine can scan for "step:" quickly).
_NAME = "A-Za-z0-9_/.\\-"
_STEP_LINE = re.compile(r"step:(?<![" + _NAME + r"]step:)([0-9]+) - (.*)", re.ASCII)
_STEP_LINE_B = re.compile(rb"step:(?<![" + _NAME.encode() + rb"]step:)[0-9]+ - .*")
# The start of a step line at the very end, cut before its first value (`ste`, `step:12 -`)
_STEP_HEAD_B = re.compile(
    rb"(?<![" + _NAME.encode() + rb"])s(?:t(?:e(?:p(?::(?:[0-9]+(?: -?)?)?)?)?)?)?\Z"
)
# Ray's log deduplication appends this to a line it saw on several actors
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\].*$")
# A Python warning another process wrote to the same stream (`2>&1`) before this line's newline:
# `/path/FILE.py:LINE: SomeWarning: message` (warnings.formatwarning), glued to the last value
_WARNING_TAIL = re.compile(r"\.py:\d+: \w*(?:Warning|Error): ")
_NP_SCALAR = re.compile(r"np\.(float64|float32|float16|u?int(?:8|16|32|64))\((.*)\)")
_CSV_KW: dict[str, Any] = (
    {"float_precision": "round_trip"}
    if tuple(int(p) for p in pd.__version__.split(".")[:2]) < (3, 1)
    else {}  # pandas >= 3.1 has one (round-trip) converter and deprecates the option
)
UNPARSED = "metric lines that do not parse"


_WS = np.zeros(256, dtype=bool)
_WS[list(b" \t\n\r\x0b\x0c")] = True  # what `\S` excludes in a bytes pattern
_POW10 = 10 ** np.arange(1, 17, dtype=np.int64)  # digits of n < 2**53: 1 + #(powers <= n)


def _step_text(raw: bytes) -> tuple[bytearray, np.ndarray] | None:
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
    text = bytearray(b"\n").join([view[a:b] for a, b in pieces])  # `_rows` works in it
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


def _row_ends(body: bytes) -> tuple[np.ndarray, np.ndarray]:
    """`body` as bytes, and where each of its rows ends (its newline, or the end)."""
    buf = np.frombuffer(body, dtype=np.uint8)
    return buf, np.append(np.flatnonzero(buf == ord("\n")), len(buf))


def _maybe_bool(body: bytes, rows: np.ndarray) -> bool:
    """Whether a row of `body` read as 0 or 1 may have been true/false (some pandas read those
    as 1/0 where float() refuses them): its text ends in 'e' or 'E'. Only those rows are looked
    at, found by their newlines, so a log with no such values pays nothing."""
    if not len(rows):
        return False
    buf, ends = _row_ends(body)
    if len(ends) <= rows[-1]:
        return True  # not one row per line: do not guess
    last = buf[ends[rows] - 1]
    return bool(((last == ord("e")) | (last == ord("E"))).any())


def _rows(text: bytes | bytearray) -> bytearray | None:
    """The rows of `text.replace(b" - ", b"\n")` for pandas' parser, found with numpy: the first
    space of each ' - ' made a newline, so that each token after a line's first keeps '- ' in
    front of its key (`_keys` takes it off). Unlike the replace, which holds the GIL, numpy lets
    the other pieces' threads run meanwhile. None where the replace would leave a space inside a
    token, or an empty token, or where the text holds whitespace the parser may skip. A
    bytearray is changed in place."""
    if any(c in text for c in (b"\t", b"\x0b", b"\x0c", b"\x00")):
        return None
    buf = np.frombuffer(text, dtype=np.uint8)
    n = len(buf)
    dash = np.flatnonzero(buf[1:-1] == ord("-")) + 1
    seps = dash[(buf[dash - 1] == ord(" ")) & (buf[dash + 1] == ord(" "))] - 1  # each ' - '
    if np.count_nonzero(buf == ord(" ")) != 2 * len(seps) or (np.diff(seps) < 4).any():
        return None  # another space, or two ' - ' sharing one (' - - '), or an empty token
    after = seps + 3
    if len(after) and (after[-1] == n or (buf[np.minimum(after, n - 1)] == ord("\n")).any()):
        return None  # an empty last token
    body = text if isinstance(text, bytearray) else bytearray(text)
    np.frombuffer(body, dtype=np.uint8)[seps] = ord("\n")
    return body


def _keys(cats: list[str]) -> list[str] | None:
    """The keys of `_rows`' categories: 'step' (each line's first token), the others without
    their '- '; None when one is neither, or two keys are one (a metric named 'step')."""
    keys = [c if c == "step" else c[2:] if c.startswith("- ") else "" for c in cats]
    return keys if all(keys) and len(set(keys)) == len(keys) else None


_WINDOW = 40  # bytes of a row's end looked at by `_maybe_unfit`


def _maybe_unfit(body: bytes, rows: np.ndarray, vals: np.ndarray) -> bool:
    """Whether a row of `body` read as 0.0 or +-inf may be a number a float64 cannot hold
    (frame.unfit: pandas' parser, like float(), reads 1e-400 as 0.0 and 1e999 as inf): a 0.0
    whose text has a nonzero digit, an inf whose text spells no `inf`. Only those rows are
    looked at, in the last `_WINDOW` bytes of each; a longer value is not judged here."""
    if not len(rows):
        return False
    buf, ends = _row_ends(body)
    if len(ends) <= rows[-1]:
        return True  # not one row per line: do not guess
    at = ends[rows][:, None] - _WINDOW + np.arange(_WINDOW)
    window = np.where(at >= 0, buf[np.maximum(at, 0)], ord("\n"))
    colon = window == ord(":")
    if not colon.any(axis=1).all():
        return True  # a value longer than the window
    start = _WINDOW - np.argmax(colon[:, ::-1], axis=1)  # just after each row's last ':'
    value = np.arange(_WINDOW) >= start[:, None]
    nonzero = ((window >= ord("1")) & (window <= ord("9")) & value).any(axis=1)
    spelled = (((window == ord("i")) | (window == ord("I"))) & value).any(axis=1)
    zero = vals[rows] == 0.0
    return bool((zero & nonzero).any() or (~zero & ~spelled).any())


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
        text, at, n_lines = bytearray(b"\n").join(lines), None, len(lines)
        del lines
    else:
        (text, at), n_lines = found, len(found[1])
    body = _rows(text)
    del text
    if body is None:
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
    cats = _keys([str(c) for c in df["k"].cat.categories])
    codes = df["k"].cat.codes.to_numpy()
    if cats is None or "step" not in cats or (codes < 0).any():
        return None
    step_code = cats.index("step")
    if any(bad_key(c) for i, c in enumerate(cats) if i != step_code):
        return None
    is_step = codes == step_code
    if int(is_step.sum()) != n_lines:  # a metric named 'step'
        return None
    vals = df["v"].to_numpy(dtype=np.float64)
    del df
    steps = vals[is_step]
    if (steps >= 2.0**53).any():
        return None
    big = np.abs(vals[~is_step]) >= 2.0**53
    if (big & np.isfinite(vals[~is_step])).any():  # maybe an integer a float64 cannot hold
        return None
    if at is not None and not _steps_are_digits(raw, at, steps):
        return None
    if _maybe_bool(body, np.flatnonzero(((vals == 0.0) | (vals == 1.0)) & ~is_step)):
        return None
    if _maybe_unfit(body, np.flatnonzero(((vals == 0.0) | np.isinf(vals)) & ~is_step), vals):
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

    Why pieces and not one per core: the join of `_console_tokens` and pandas' parser hold the
    GIL (pandas 3.1: two parses on two threads take as long as one after the other) while
    numpy releases it, so with several pieces per thread one thread's numpy part (the lines,
    the separators of `_rows`, the steps' digits) overlaps another's parsing (a 1M-line log,
    88 MB, on 2 cores: about 0.8 s in 4 MB pieces, 1.0-1.1 s in two halves)."""
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
    return assemble(steps.astype(np.int64), line[cell], col, vals[cell], names)


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


def _value(raw: str) -> tuple[float, str] | Unfit | None:
    """A value as pformat printed it, with its precision; Unfit for a number its type cannot
    hold, None if it is not one."""
    text = raw.strip()
    m = _NP_SCALAR.fullmatch(text)
    kind = "float64"
    if m:
        kind, text = m[1], m[2]
    if text in ("True", "False") and kind == "float64":
        return float(text == "True"), FLOAT64
    try:
        if kind.startswith(("int", "uint")):
            return float(int(text)), FLOAT64
        if kind == "float32":
            value, precision = float(np.float32(text)), FLOAT32
        elif kind == "float16":
            value, precision = float(np.float16(text)), "float16"
        else:
            value, precision = float(text), FLOAT64
    except OverflowError:
        return Unfit(text)
    except ValueError:
        return None
    return Unfit(text) if unfit(text, value) else (value, precision)


def _line_cells(
    m: re.Match[str], lineno: int
) -> tuple[int, list[tuple[str, float, str]], list[str]] | str:
    """A step line's step, (key, value, precision) cells and the keys whose number a float64
    cannot hold, or why it does not parse."""
    if beyond_max_step(m[1]):
        return f"step {m[1][:30]}{'...' if len(m[1]) > 30 else ''} does not fit int64"
    step = int(m[1])
    out, unfit_keys = [], []
    for token in _RAY_REPEATED.sub("", m[2]).split(" - "):
        key, colon, raw = token.rpartition(":")
        if key == "step":
            return f"step {step}: a metric may not be named 'step'"
        if not colon or bad_key(key):
            return f"step {step}: malformed metric {token!r} (want key:value)"
        value = _value(raw)
        if value is None:
            return f"step {step}: value of {key!r} is not numeric: {raw!r}"
        if isinstance(value, Unfit):
            unfit_keys.append(key)
            continue
        out.append((key, *value))
    return step, out, unfit_keys


def _glued_output(segment: str, start: int) -> int | None:
    """Where a Python warning glued to the line's last value starts, or None. The last token is
    `key:value/path.py:N: ...Warning: ...`; a key holds no ':' and a value no '/', so the path
    starts at the first '/' after the token's first ':'."""
    tail = _WARNING_TAIL.search(segment, start)
    if tail is None:
        return None
    token = segment.rfind(" - ", start, tail.start())
    token = start if token < 0 else token + 3
    colon = segment.find(":", token, tail.start())
    slash = segment.find("/", colon + 1, tail.start()) if colon >= 0 else -1
    return slash if slash > colon + 1 else None


def _console_slow(
    text: str, path: Path, rule: str = "error", log: ReadLog | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Line-by-line reader: the reference semantics, and the one that names bad lines."""
    log = log if log is not None else ReadLog()
    cells = Cells()
    first_why: str | None = None
    for lineno, line in enumerate(text.split("\n"), 1):
        # a progress bar's "\r" starts a new screen line, not a new line of the file
        for segment in line.split("\r") if "\r" in line else (line,):
            m = _STEP_LINE.search(segment)
            if m is None:
                continue
            cut = _glued_output(segment, m.start(2))
            if cut is not None:
                log.note(f"other output glued to a step line left out (first: line {lineno})")
                m = _STEP_LINE.search(segment[:cut])
                assert m is not None  # the step line's start is before the cut
            got = _line_cells(m, lineno)
            if isinstance(got, str):
                log.skip(UNPARSED, lineno)
                first_why = first_why or f"{lineno}: {got}"
                continue
            step, items, unfit_keys = got
            group = cells.record(step, lineno)
            for key, value, precision in items:
                cells.add(group, key, value, precision)
            for key in unfit_keys:
                log.skip(UNFIT, f"line {lineno} ({key!r})")
    if not cells.steps:
        why = f" ({first_why.split(': ', 1)[1]})" if first_why else ""
        raise fail(
            path,
            first_why.split(":")[0] if first_why else None,
            f"no metrics records (no 'step:N - ' lines that parse){why}",
        )
    if first_why:
        log.note(f"first line skipped: {path}:{first_why}")
    values, present = cells.frames(path, rule, log)  # type: ignore[arg-type]
    values.attrs["precision"] = dict(cells.precision)
    return values, present


def _cut_step_line(raw: bytes, start: int) -> bool:
    """Whether the last line (from `start`, without its newline) is a step line cut off: one
    cut inside its values, or cut before them, so that only its start is left (`ste`,
    `step:12 -`). Either way a step was being written; reading on would judge a step short."""
    return bool(_STEP_LINE_B.search(raw, start) or _STEP_HEAD_B.search(raw, start))


_HEAD = 64  # values of a column looked at by `_written_in_full`


def _written_in_full(x: np.ndarray) -> bool:
    """Whether a column's first values already show it holds its values in full
    (frame.written_in_full): this spares frame.infer_decimals sorting a long column of
    full-precision values (a fifth of a read's time)."""
    return written_in_full(x[:_HEAD])


def _written_precision(values: pd.DataFrame, precision: dict[str, str]) -> dict[str, str]:
    """What finish(written=True) would make of `precision` (frame.infer_decimals), asking it
    only about the float64 columns `_written_in_full` cannot rule out."""
    unsure = [
        c
        for c in values.columns
        if precision.get(str(c), FLOAT64) == FLOAT64
        and not _written_in_full(values[c].to_numpy(dtype=np.float64))
    ]
    return infer_decimals(values[unsure], precision) if unsure else dict(precision)


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    raw = read_bytes(path)
    if b"\r" in raw:
        raw = raw.replace(b"\r\n", b"\n")
    log = ReadLog()
    whole, cut = cut_tail(raw)
    if cut is not None and _cut_step_line(raw, len(whole)):
        log.skip(CUT_TAIL, cut)
        raw = whole
        if _STEP_LINE_B.search(raw) is None:
            raise fail(path, cut, "no metrics records: the only step line has no newline (cut off)")
    out = _console_fast(raw.replace(b"\r", b"\n") if b"\r" in raw else raw)
    precision: dict[str, str] = {}
    if out is None:  # line numbers count the file's lines ("\n"), not a bar's "\r"
        out = _console_slow(raw.decode("utf-8", errors="replace"), path, options.duplicates, log)
        precision = out[0].attrs.pop("precision", {})
    values, present = out
    return finish(
        values, present, source=path, fmt="verl-console",
        precision=_written_precision(values, precision), log=log,
    )  # fmt: skip


def _claims(path: Path, head: bytes | None) -> bool:
    return head is not None and _STEP_LINE_B.search(head) is not None


FORMATS = [
    Format(
        "verl-console",
        _read,
        _claims,
        "a text file with verl's `step:N - key:value` lines, among any other output",
        "float64 (float32 for `np.float32(...)` values)",
    )
]
