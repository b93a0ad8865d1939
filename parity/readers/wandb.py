"""Weights & Biases runs, read offline from the run's own record log (`run-<id>.wandb`).

A run folder (`wandb/run-*`, `wandb/offline-run-*`) holds `run-<id>.wandb`: the stream of
protobuf `Record`s that wandb writes for online and offline runs alike (wandb 0.31 offline
writes nothing else with metrics: no `files/wandb-history.jsonl`, no `wandb-summary.json`), so
it is the source of truth. Framing (wandb's `datastore.py`, wandb-core's `pkg/leveldb`): a
7-byte file header `:W&B`, 0xBEE1, version 0, then LevelDB-log chunks in 32 KiB blocks, each
`crc:u32 len:u16 type:u8 data`, type FULL/FIRST/MIDDLE/LAST. The checksum is plain zlib CRC-32
(IEEE, not LevelDB's masked CRC-32C) of the type byte and the data. A block's last < 7 bytes
are zero padding.

Metrics come from `Record.history` (field 2): `HistoryRecord{item: HistoryItem{key: 1,
nested_key: 2, value_json: 16, ...}, step: HistoryStep{num: 1}}`. wandb 0.31 writes every key
as a `nested_key` path (`{"a": {"b": 1}}` is `a.b`, as the W&B UI names it); older versions
wrote `key` with a JSON object. Values are JSON, read as float64 exactly; strings, bools,
lists and media (a path with a `_type` leaf, e.g. a histogram or a table) are not metrics. A
number a float64 cannot hold (`1e999`, `1e-400`, an integer beyond 1.8e308) is skipped and
counted (frame.UNFIT).

Steps: `_step` is the step given to `wandb.log(..., step=N)`, else wandb's count of log calls.
HF's WandbCallback logs without a step and puts the trainer's step in `train/global_step`: in a
run that has that key it is the step, and a record without it cannot be placed (skipped).
W&B's own keys (`_step`, `_runtime`, `_timestamp`, `_wandb.*`) are not metrics. A run is
complete when its exit record says exit code 0.

Folders: a run folder, the `wandb/` folder of runs, or the folder holding `wandb/` (the `dir`
given to `wandb.init`, the working folder by default), as a folder holding `mlruns/` is MLflow's.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

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
    unfit,
)
from parity.readers.text import read_bytes
from parity.readers.wire import WireError, varint

MAGIC = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
RUNS_DIR = "wandb"  # what wandb.init(dir=D) makes in D
BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_SEED = [zlib.crc32(bytes([t])) for t in range(5)]  # the CRC covers the type byte first
HF_STEP = "train/global_step"
INTERNAL = ("_step", "_runtime", "_timestamp")
CUT = "records cut off at the end of the file (run still writing, or killed)"
UNDECODED = "history records that do not decode"
NO_STEP = "history records without a usable step"
BIG_INT = "integer values a float64 cannot hold exactly"


class _Bad(Exception):
    """A record whose protobuf does not decode."""


_UNSET = object()
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
# HistoryItem's wire types: key, nested_key, none, boolean, integer, number, text, json, value_json
_WIRE = {1: 2, 2: 2, 3: 0, 4: 0, 5: 0, 6: 1, 7: 2, 8: 2, 16: 2}


# --- framing -----------------------------------------------------------------------------------


def records(raw: bytes, path: Path, log: ReadLog) -> list[tuple[int, bytes]]:
    """(byte offset of its first chunk, payload) of every record. A damaged chunk is a one-line
    error naming its byte; a stream cut at the end is counted in `log` as skipped."""
    if not raw.startswith(MAGIC):
        if len(raw) < HEADER and MAGIC.startswith(raw):
            log.skip(CUT, "byte 0")
            return []
        raise fail(path, None, "not a W&B run log (no ':W&B' file header)")
    out: list[tuple[int, bytes]] = []
    parts: list[bytes] = []
    start = pos = HEADER
    n = len(raw)
    while pos < n:
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's zero padding
            if any(raw[pos : pos + left]):
                raise fail(path, f"byte {pos}", "block padding is not zero (damaged file)")
            pos += left
            continue
        if pos + HEADER > n:
            break
        crc, length, kind = struct.unpack_from("<IHB", raw, pos)
        if crc == length == kind == 0 and not any(raw[pos : pos + left]):
            if pos + left < n:  # zeroes inside the stream: a torn write, records lost there
                raise fail(path, f"byte {pos}", "zeroed block inside the log (damaged file)")
            break  # a torn write at the end
        if not FULL <= kind <= LAST:
            raise fail(path, f"byte {pos}", f"unknown chunk type {kind} (damaged file)")
        end = pos + HEADER + length
        if end > pos + left:
            raise fail(path, f"byte {pos}", "chunk runs past its 32 KiB block (damaged file)")
        if end > n:
            break
        data = raw[pos + HEADER : end]
        if zlib.crc32(data, _SEED[kind]) != crc:
            raise fail(path, f"byte {pos}", "chunk checksum mismatch (damaged file)")
        if (kind in (FULL, FIRST)) == bool(parts):
            what = "a record's first chunk" if kind in (FULL, FIRST) else "a record's next chunk"
            raise fail(path, f"byte {pos}", f"expected {what} (damaged file)")
        if kind == FULL:
            out.append((pos, data))
        elif kind == FIRST:
            start, parts = pos, [data]
        else:
            parts.append(data)
            if kind == LAST:
                out.append((start, b"".join(parts)))
                parts = []
        pos = end
    if pos < n or parts:
        log.skip(CUT, f"byte {start if parts else pos}")
    return out


# --- minimal protobuf --------------------------------------------------------------------------


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of a message: an int for varints, (start, end) of
    length-delimited fields, the raw bytes of fixed ones."""
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:  # the usual one-byte varints, without a call
            pos += 1
        else:
            tag, pos = varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise _Bad("field number 0")
        if wire == 0:
            value, pos = varint(buf, pos, end)
            yield field, 0, value
        elif wire == 2:
            if pos < end and buf[pos] < 0x80:
                size = buf[pos]
                pos += 1
            else:
                size, pos = varint(buf, pos, end)
            if pos + size > end:
                raise _Bad("field runs past its message")
            yield field, 2, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise _Bad("field runs past its message")
            yield field, wire, buf[pos : pos + size]
            pos += size
        else:
            raise _Bad(f"wire type {wire}")


def _text(buf: bytes, span: tuple[int, int]) -> str:
    try:
        return buf[span[0] : span[1]].decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("string not UTF-8") from None


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _item(buf: bytes, start: int, end: int) -> tuple[str, object]:
    """One HistoryItem: its key (nested keys joined by '.') and its value as JSON gives it (the
    typed `value` oneof where set, else `value_json`)."""
    key, nested, typed, value_json = "", [], _UNSET, None
    for field, wire, v in _fields(buf, start, end):
        if _WIRE.get(field, wire) != wire:
            raise _Bad(f"field {field}: wire type {wire}")
        if field == 1:
            key = _text(buf, v)
        elif field == 2:
            nested.append(_text(buf, v))
        elif field in (3, 4, 7):  # none, boolean, text: not a metric
            typed = None
        elif field == 5:  # sint64, zigzag
            typed = (v >> 1) ^ -(v & 1)
        elif field == 6:
            typed = struct.unpack("<d", v)[0]
        elif field == 8:
            typed = _json(buf, v)
        elif field == 16:
            value_json = v
    key = key or ".".join(nested)
    if not key:
        raise _Bad("item without a key")
    if typed is not _UNSET:
        return key, typed
    return key, None if value_json is None else _json(buf, value_json)


def _json(buf: bytes, span: tuple[int, int]) -> object:
    """A JSON value; numbers (the usual value) without json.loads: an integer literal as an int
    (so one that a float64 cannot hold is seen), any other as float() rounds it, as json does."""
    text = buf[span[0] : span[1]]
    number = _NUMBER.fullmatch(text)
    try:
        if number and (number.lastindex or text == b"-0"):  # wandb-core writes -0.0 as "-0"
            value = float(text)
            return Unfit(text.decode("ascii")) if unfit(text, value) else value
        if number:
            return int(text)
        return json.loads(text.decode("utf-8"), parse_float=json_float)
    except ValueError:  # UnicodeDecodeError too
        raise _Bad("value is not JSON") from None


def _history(buf: bytes, start: int, end: int) -> tuple[dict[str, object], int | None]:
    """A HistoryRecord's items by key and its HistoryStep's num (None when absent)."""
    items: dict[str, object] = {}
    step = None
    for field, wire, v in _fields(buf, start, end):
        if field == 1 and wire == 2:
            key, value = _item(buf, *v)
            items[key] = value
        elif field == 2 and wire == 2:
            step = 0
            for f, w, num in _fields(buf, *v):
                if f == 1 and w == 0:
                    step = _int64(num)
        elif field in (1, 2):
            raise _Bad(f"field {field}: wire type {wire}")
    return items, step


def _flat(key: str, value: object, out: dict[str, object]) -> None:
    """A JSON object's leaves as `key.sub` (how wandb 0.31 writes them); media (an object with
    `_type`) is left out."""
    if isinstance(value, dict):
        if "_type" not in value:
            for k, v in value.items():
                _flat(f"{key}.{k}", v, out)
    else:
        out[key] = value


def _metrics(items: dict[str, object]) -> dict[str, object]:
    """Items without media paths (those under a prefix that has a `_type` leaf)."""
    media = {k[: -len("._type")] + "." for k in items if k.endswith("._type")}
    out: dict[str, object] = {}
    for key, value in items.items():
        if media and any(key.startswith(m) for m in media) or key == "_type":
            continue
        _flat(key, value, out)
    return out


def _step_value(value: object) -> int | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        return None
    return value


def _internal(key: str) -> bool:
    return key in INTERNAL or key == "_wandb" or key.startswith("_wandb.")


# --- reading -----------------------------------------------------------------------------------


def read_log(raw: bytes, path: Path, options: ReadOptions) -> pd.DataFrame:
    """The frame of one `.wandb` file's bytes (apart from a file, for the fuzz tests)."""
    log = ReadLog()
    history: list[tuple[int, dict[str, object], int | None]] = []
    exit_code: int | None = None
    for offset, data in records(raw, path, log):
        where = f"record at byte {offset}"
        try:
            for field, wire, v in _fields(data, 0, len(data)):
                if field == 2 and wire == 2:
                    items, step = _history(data, *v)
                    history.append((offset, _metrics(items), step))
                elif field == 18 and wire == 2:
                    exit_code = 0
                    for f, w, code in _fields(data, *v):
                        if f == 1 and w == 0:
                            exit_code = _int64(code)
        except (_Bad, WireError, RecursionError):  # RecursionError: JSON nested too deep
            log.skip(UNDECODED, where)
    hf = any(_step_value(m.get(HF_STEP)) is not None for _, m, _ in history)
    cells = Cells()
    for offset, metrics, num in history:
        where = f"record at byte {offset}"
        if hf:
            step = _step_value(metrics.get(HF_STEP))
        elif "_step" in metrics:
            step = _step_value(metrics["_step"])
        else:
            step = num if num is not None and num >= 0 else None
        values = {}
        for key, value in metrics.items():
            if _internal(key) or hf and key == HF_STEP:
                continue
            whole = isinstance(value, int) and not isinstance(value, bool)
            if whole and abs(value) < 2**1024 and float(value) != value:
                log.skip(BIG_INT, where)  # past 2**53: a float64 would round it
            elif isinstance(value, Unfit) or isinstance(value, int) and fit_number(value) is None:
                log.skip(UNFIT, where)
            elif whole:
                values[key] = float(value)
            elif isinstance(value, float):
                values[key] = value
        if not values:
            continue
        if step is None:
            log.skip(NO_STEP if not hf else f"history records without {HF_STEP}", where)
            continue
        group = cells.record(step, where)
        for key, value in values.items():
            cells.add(group, key, value)
    if hf:
        log.note(
            f"steps from {HF_STEP!r} (HF Trainer's step); W&B's _step (its count of log "
            "calls) left out"
        )
    else:
        log.note("steps from W&B's '_step' (wandb.log's step=, else its count of log calls)")
    if exit_code not in (None, 0):
        log.note(f"the run exited with code {exit_code}")
    if not cells.steps and not log.skipped:
        raise fail(path, None, "no numeric history records")
    values, present = cells.frames(path, options.duplicates, log)
    done = exit_code == 0
    why = "no exit record" if exit_code is None else f"exited with code {exit_code}"
    return finish(values, present, source=path, fmt="wandb", log=log, complete=done, written=True,
                  incomplete=why)  # fmt: skip


# --- run folders -------------------------------------------------------------------------------


def _is_run_dir(path: Path) -> bool:
    name = path.name.startswith(("run-", "offline-run-"))
    return name and path.is_dir() and any(path.glob("*.wandb"))


def _run_dirs(folder: Path) -> list[Path]:
    try:
        kids = sorted(folder.iterdir())
    except OSError:
        return []
    return [p for p in kids if _is_run_dir(p) and not p.is_symlink()]


def _names(path: Path) -> set[str]:
    """What --run may call a run: its folder's name, its id, its .wandb file's name."""
    if path.suffix == ".wandb":
        return {path.name, path.stem.removeprefix("run-")}
    return {path.name, path.name.rsplit("-", 1)[-1]}


def _holds_runs(folder: Path) -> bool:
    """Whether `folder` is the one given to wandb.init(dir=...): its `wandb/` holds runs."""
    runs = folder / RUNS_DIR
    return runs.is_dir() and not _is_run_dir(folder) and bool(_run_dirs(runs))


def locate(path: Path, options: ReadOptions) -> Path:
    """The `.wandb` file of a file, run folder, folder of runs or folder holding `wandb/`
    (`--run` picks one)."""
    run, picked = options.run, False
    if path.is_dir() and not any(path.glob("*.wandb")) and not _run_dirs(path):
        if _holds_runs(path):
            path = path / RUNS_DIR
    if path.is_dir() and not any(path.glob("*.wandb")):
        if run == "latest-run" and (path / "latest-run").is_dir():
            return locate(path / "latest-run", ReadOptions())
        runs = _run_dirs(path)
        if not runs:
            raise fail(path, None, "no W&B runs (run-*/offline-run-* folders with a .wandb file)")
        if run is not None:
            chosen = [r for r in runs if run in _names(r)]
            if not chosen:
                names = ", ".join(r.name for r in runs)
                raise fail(path, None, f"no W&B run {run!r} here; its runs: {names}")
            runs, picked = chosen, True
        if len(runs) > 1:
            names = ", ".join(r.name for r in runs)
            raise fail(path, None, f"{len(runs)} W&B runs: {names} (choose one: --run NAME or ID)")
        path = runs[0]
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise fail(path, None, f"several .wandb files: {names} (give the file itself)")
        path = files[0]
    if run is not None and not picked and run not in _names(path) | _names(path.parent):
        raise fail(path, None, f"--run {run!r}: this file is run {path.stem.removeprefix('run-')}")
    return path


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    file = locate(path, options)
    return read_log(read_bytes(file), file, options)


def _claims(path: Path, head: bytes | None) -> bool:
    if head is not None:
        return head.startswith(MAGIC[:6]) or path.suffix == ".wandb"
    return _is_run_dir(path) or bool(_run_dirs(path)) or _holds_runs(path)


FORMATS = [
    Format(
        "wandb",
        _read,
        _claims,
        "a W&B run folder (`wandb/run-*`, `wandb/offline-run-*`), a `wandb/` folder of them, the "
        "folder holding `wandb/` (wandb.init's `dir`), or a `.wandb` file",
        FLOAT64,
    )
]
