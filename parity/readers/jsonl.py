"""Our run folder's metrics.jsonl, and verl's file logger (`{"step": N, "data": {...}}` lines).

Both hold float64 (JSON numbers as Python's repr or orjson write them); a series whose values
all look rounded to a few decimals is read at them (frame.rounded_places), except in the
recorder's own file, which writes every float in full. Ours ends a complete run with
`{"event": "end", "steps": N}`; a run without it is incomplete, and one whose end record claims
more steps than the file holds is an error (a partial file). verl's
FileLogger (verl/utils/tracking.py) writes every value of the step: numbers, but also strings or
lists (left out, as its console logger leaves them out); 0.6 and 0.7 with json.dumps (`NaN`,
`Infinity`), 0.9 with orjson, which writes NaN and +-inf all as null (read as NaN, noted).

Records of one step merge, in both: verl writes a step's train and val metrics as two records,
and our recorder writes a second `rec.log` of a step (its eval metrics, say) as another record
of that step. Only a metric given twice at a step with other bits is a conflict (a restarted or
appended run): an error naming both lines, unless --duplicates first|last; the same bits twice
are one value. A number a float64 cannot hold (`1e999`, `1e-400`) is skipped and counted
(frame.UNFIT). A last line without its newline is read when it is a whole JSON object (a cut
one cannot be) and is an error naming it when it is not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from parity.readers.frame import (
    FLOAT64,
    MAX_STEP,
    UNFIT,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    Unfit,
    fail,
    finish,
    fit_number,
    json_float,
    shown,
    suspect,
)
from parity.readers.text import decode, read_bytes
from parity.record.runfolder import METRICS, manifest_path, metrics_path


class _DuplicateKey(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def number(path: Path, where: int | str, key: str, value: Any) -> float | None:
    """A JSON number as float64, None when a float64 cannot hold it (frame.UNFIT); anything
    else (a bool, a string) names the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Unfit)):
        raise fail(path, where, f"value of {key!r} is not numeric: {shown(value)}")
    return fit_number(value)


def step_of(path: Path, where: int | str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise fail(path, where, f"step must be a non-negative integer, got {shown(value)}")
    return value


# What a number a float64 cannot hold needs: an exponent of 3 digits or more, or 100 digits in
# a row (magnitude past 1e308 or below 1e-323 takes one or the other); a line without is exact
_HUGE_LITERAL = re.compile(r"[eE][+-]?0*[1-9][0-9]{2}|[0-9]{100}")


def _loads(line: str) -> Any:
    """One record; a float that may have overflowed or underflowed (inf, 0.0, on a line with
    such a literal) is read again from its text, so a number a float64 cannot hold comes back
    as frame.Unfit."""
    rec = json.loads(line, object_pairs_hook=_pairs)
    if (
        isinstance(rec, dict)
        and _HUGE_LITERAL.search(line)
        and any(
            suspect(v) or isinstance(v, dict) and any(map(suspect, v.values()))
            for v in rec.values()
        )
    ):
        rec = json.loads(line, object_pairs_hook=_pairs, parse_float=json_float)
    return rec


def _read_json_lines(
    text: str, path: Path, fmt: str, log: ReadLog | None = None
) -> tuple[Cells, bool | None]:
    cells = Cells()
    log = log if log is not None else ReadLog()
    end_line: int | None = None
    claimed = 0
    lines = text.split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if end_line is not None:
            raise fail(path, lineno, f"record after the end record of line {end_line}")
        try:
            rec = _loads(line)
        except _DuplicateKey as e:
            raise fail(path, lineno, f"key {e.args[0]!r} given twice") from None
        except RecursionError:
            raise fail(path, lineno, "not valid JSON: nested too deeply") from None
        except ValueError as e:
            if lineno == len(lines):  # no newline after it: the writer was cut off
                raise fail(
                    path, lineno, "last line is not valid JSON: file is truncated (run incomplete)"
                ) from None
            raise fail(path, lineno, f"not valid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise fail(path, lineno, f"record is not a JSON object: {line[:60]!r}")
        if fmt == "jsonl" and "event" in rec:
            if rec["event"] != "end" or set(rec) - {"event", "steps", "_meta"}:
                raise fail(path, lineno, f"unknown event record: {line[:80]!r}")
            claimed = step_of(path, lineno, rec.get("steps"))
            end_line = lineno
            continue
        if "step" not in rec:
            raise fail(path, lineno, "record has no 'step'")
        # a step's records merge: a cell given twice with other bits is the conflict (Cells)
        step = step_of(path, lineno, rec["step"])
        if fmt == "jsonl":
            metrics = {k: v for k, v in rec.items() if k not in ("step", "_meta")}
        else:
            extra = set(rec) - {"step", "data"}
            if extra:
                raise fail(path, lineno, f"unexpected key {sorted(extra)[0]!r} beside step/data")
            metrics = rec.get("data")
            if not isinstance(metrics, dict):
                raise fail(path, lineno, "'data' is not a JSON object")
        group = cells.record(step, lineno)
        for key, value in metrics.items():
            if fmt == "verl-jsonl" and value is None:
                log.note(_NULL_NOTE)
                value = float("nan")
            elif fmt == "verl-jsonl" and isinstance(value, (str, list, dict)):
                log.note(f"non-numeric values left out, as verl's console does (first: {key!r})")
                continue
            elif fmt == "verl-jsonl" and isinstance(value, bool):
                value = float(value)  # the console prints it True/False, read as 1/0
            got = number(path, lineno, key, value)
            if got is None:
                log.skip(UNFIT, f"line {lineno} ({key!r})")
                continue
            cells.add(group, key, got)
    if end_line is not None:
        _check_end(path, end_line, claimed, cells.steps)
    return cells, (end_line is not None) if fmt == "jsonl" else None


def _check_end(path: Path, line: int, claimed: int, steps: list[int]) -> None:
    """An end record claiming more steps than the file holds (by count and by the last step:
    the recorder writes the last step logged) marks a partial file: lines lost or cut out. No
    verdict comes from it, so it is an error naming both counts."""
    held = len(set(steps))
    last = max(steps, default=0)
    if claimed > max(held, last):
        raise fail(
            path,
            line,
            f"the end record says {claimed} steps but the file holds {held} (last step "
            f"{last}): a partial file, no verdict from it",
        )


# verl's FileLogger writes with orjson, which writes NaN, inf and -inf all as null
_NULL_NOTE = "null values read as NaN: verl's file logger (orjson) writes NaN and +-inf as null"


def _reader(fmt: str):
    def read(path: Path, options: ReadOptions):
        file = metrics_path(path) if path.is_dir() else path
        text = decode(read_bytes(file), file)
        log = ReadLog()
        cells, complete = _read_json_lines(text, file, fmt, log)
        if not cells.steps:
            raise fail(file, None, "no metrics records")
        values, present = cells.frames(file, options.duplicates, log)
        return finish(
            values, present, source=file, fmt=fmt, precision=FLOAT64, log=log, complete=complete,
            written=not _recorded(file, complete),
        )  # fmt: skip

    return read


def _recorded(file: Path, complete: bool | None) -> bool:
    """Whether the file is the recorder's (an end record, or manifest.json beside it): it
    writes every float as Python's repr, in full, so short values are what was logged."""
    return complete is True or manifest_path(file.parent).is_file()


def _first_record(head: bytes) -> Any:
    first = head.lstrip().split(b"\n", 1)[0]
    try:
        return json.loads(first)
    except (ValueError, RecursionError):
        return None


def _claims_ours(path: Path, head: bytes | None) -> bool:
    if head is None:
        return metrics_path(path).is_file()
    rec = _first_record(head)
    if isinstance(rec, dict):
        return not isinstance(rec.get("data"), dict)
    return path.suffix.lower() == ".jsonl"  # its reader names the bad line


def _claims_verl(path: Path, head: bytes | None) -> bool:
    rec = _first_record(head) if head is not None else None
    return isinstance(rec, dict) and isinstance(rec.get("data"), dict)


FORMATS = [
    Format(
        "verl-jsonl",
        _reader("verl-jsonl"),
        _claims_verl,
        "JSON lines whose first record has a `data` object (verl's file logger)",
        FLOAT64,
    ),
    Format(
        "jsonl",
        _reader("jsonl"),
        _claims_ours,
        f"a run folder with `{METRICS}`, or JSON lines with `step` and the metrics",
        "float64 (decimals(N) when every value looks rounded, not in the recorder's)",
    ),
]
