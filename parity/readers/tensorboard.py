"""TensorBoard event files (`events.out.tfevents.*`): every scalar, bit for bit.

Why not tensorboard's `EventAccumulator`: the library is heavy (protobuf, grpc, its plugins),
keeps a reservoir sample unless told otherwise and decodes record by record in Python; 1M
scalars take it tens of seconds. Here numpy frames the TFRecords (uint64 length, its masked
crc32c, the data, the data's masked crc32c), checks every crc and decodes the usual scalar event
at once; a small hand-written protobuf decoder (field numbers from tensorboard/compat/proto)
reads the rest. benchmarks/tensorboard_read.py times both.

A crc mismatch is a one-line error naming the file and the record's byte offset; a last record
cut short (a run still writing, or killed) is skipped and counted. Tag = metric name, as
torchtitan (`loss_metrics/global_avg_loss`, `grad_norm`, `lr`), HF's TensorBoardCallback
(`train/loss`, `eval/loss`), Megatron (`lm loss`), verl, Lightning and NeMo write them;
Megatron's `... vs samples` twins are on a samples axis, not steps: left out, noted. A scalar
is a `simple_value` (float32) or a one-number tensor of a tag whose first metadata names the
"scalars" plugin (TF's writers keep it on a tag's first value only): DT_FLOAT float32, DT_DOUBLE
float64, DT_HALF/DT_BFLOAT16 "float16"/"bfloat16" (noted), integers float64 when exact. A
float32 metric whose every value is the float32 of a decimal with N places (3..5) is
"float32,decimals:N" (frame.float32_rounded_places): HF's Trainer logs `round(loss, 4)`, and a
float32 of 4 decimals cannot show a difference of one ULP.
Histograms, images, text and the like are ignored by design, named once in the notes.

Runs: a file; a folder whose event files sit in one folder (several files there: one run
restarted, read in the order they were written); or a folder of such folders (torchtitan writes
one timestamped subfolder per launch, Lightning `version_N`), where `--run` names one.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pandas as pd

from parity.readers.frame import (
    FLOAT32,
    Cells,
    Format,
    ReadLog,
    ReadOptions,
    assemble,
    decimals,
    fail,
    finish,
    float32_rounded_places,
)
from parity.readers.tfrecord import frame_records, masked_crc, windows
from parity.readers.wire import varint

_NAME = "events.out.tfevents"
SAMPLES_AXIS = " vs samples"
BAD_EVENT = "records that are not a valid Event"
NOT_ONE = "scalar summaries that are not one number"
BAD_INT = "integer scalars that do not fit a float64 exactly"
NEGATIVE = "scalars at a negative step"
BAD_TAG = "scalars whose tag is empty or not UTF-8"
_PRECISIONS = ("float64", "float32", "float16", "bfloat16")  # finer to coarser

_MD = b"\x4a\x0b\x0a\x09\x0a\x07scalars"  # metadata { plugin_data { plugin_name: "scalars" } }
_SIMPLE, _TENSOR_MD, _TENSOR = 0, 1, 2  # kinds of scalar
# What follows the tag in an Event's one Value: prefix, value bytes, suffix, kind. simple_value
# (torch's add_scalar, TF1, Keras), or a tensor {dtype, float_val or double_val} as torch's
# add_scalar(new_style=True[, double_precision]) writes it, or with an empty tensor_shape as
# tensorboard's summary API does, with the "scalars" metadata or (after a tag's first) without.
_TEMPLATES = [(b"\x15", 4, b"", _SIMPLE)] + [
    (b"\x42" + bytes([len(t) + n]) + t, n, md, _TENSOR_MD if md else _TENSOR)
    for base, n in ((b"\x08\x01\x2a\x04", 4), (b"\x08\x02\x32\x08", 8))
    for t in (base, base[:2] + b"\x12\x00" + base[2:])
    for md in (_MD, b"")
]


def _fast(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Records that are `Event{wall_time, step, summary{value{tag, <template>}}}` with one-byte
    lengths, decoded at once: (kind or -1 for `_event` to decide, step, tag offset and length,
    value, precision). buf: the file and 64 zero bytes."""
    ok = (end - start >= 16) & (buf[start] == 0x09)
    p = start + 9
    has_step = buf[p] == 0x10
    digits = windows(buf, p + 1, 9).astype(np.int64)  # a step below 2**63: at most 9 bytes
    last = digits < 0x80
    n = np.argmax(last, axis=1) + 1
    ok &= ~has_step | last.any(axis=1)
    digits[np.arange(9) >= n[:, None]] = 0
    step = np.where(has_step, ((digits & 0x7F) << 7 * np.arange(9)).sum(axis=1), 0)
    q = p + np.where(has_step, 1 + n, 0)  # the summary
    size, tag_len = buf[q + 1].astype(np.int64), buf[q + 5].astype(np.int64)
    ok &= (buf[q] == 0x2A) & (size < 0x80) & (q + 2 + size == end) & (buf[q + 2] == 0x0A)
    ok &= (buf[q + 3] == size - 2) & (buf[q + 4] == 0x0A) & (tag_len < 0x80)
    rest = end - (q + 6 + tag_len)
    kind, value, prec = np.full(len(start), -1, np.int8), np.zeros(len(start)), np.ones_like(q)
    for prefix, width, suffix, k in _TEMPLATES:
        i = np.flatnonzero(ok & (rest == len(prefix) + width + len(suffix)))
        got = windows(buf, end[i] - rest[i], len(prefix) + width + len(suffix))
        fixed = np.r_[0 : len(prefix), len(prefix) + width : got.shape[1]]
        i = i[(got[:, fixed] == np.frombuffer(prefix + suffix, np.uint8)).all(axis=1)]
        got = windows(buf, end[i] - rest[i] + len(prefix), width)
        kind[i], value[i], prec[i] = k, got.view(f"<f{width}").ravel(), width == 4
    return kind, step, q + 6, tag_len, value, prec


def _tag_codes(buf: np.ndarray, at: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
    """Tag codes and the tags: rows hashed and factorized, each checked against the first row of
    its code (np.unique sorts them instead if two tags share a hash)."""
    codes, names = np.zeros(len(at), dtype=np.int64), []
    for t in np.unique(n).tolist():
        i = np.flatnonzero(n == t)
        rows = windows(buf, at[i], -(-t // 8) * 8 or 8)
        rows[:, t:] = 0
        h = np.zeros(len(i), dtype=np.uint64)
        for w in rows.view("<u8").T:
            h = h * np.uint64(0x100000001B3) ^ w
        local, uniq = pd.factorize(h)
        first = np.zeros(len(uniq), dtype=np.int64)
        first[local[::-1]] = np.arange(len(i))[::-1]
        if not (rows == rows[first][local]).all():
            _, first, local = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        codes[i] = local.ravel() + len(names)
        names += [rows[f, :t].tobytes() for f in first.tolist()]
    return codes, names


# --- the general decoder: a few fields of Event, Summary.Value and TensorProto -------------


class _Bad(Exception):
    pass


def _fields(b: bytes, i: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field, wire type, start, end) of each field of a message; a varint's value as end."""
    out = []
    while i < end:
        key, i = varint(b, i, end)
        if key & 7 == 0:
            value, j = varint(b, i, end)
            out.append((key >> 3, 0, i, value))
            i = j
            continue
        size, i = varint(b, i, end) if key & 7 == 2 else ({1: 8, 5: 4}.get(key & 7, -1), i)
        if key >> 3 == 0 or size < 0 or i + size > end:
            raise _Bad
        out.append((key >> 3, key & 7, i, i + size))
        i += size
    return out


def _first(b: bytes, i: int, end: int, field: int, wire: int) -> tuple[int, int] | None:
    return next(((s, e) for f, w, s, e in _fields(b, i, end) if (f, w) == (field, wire)), None)


# dtype: tensor_content's type, the field of its values, that field's wire type unpacked
_DTYPES = {1: ("<f4", 5, 5), 2: ("<f8", 6, 1), 3: ("<i4", 7, 0), 4: ("u1", 7, 0)}
_DTYPES |= {5: ("<i2", 7, 0), 6: ("i1", 7, 0), 9: ("<i8", 10, 0), 10: ("u1", 11, 0)}
_DTYPES |= {14: ("<u2", 13, 0), 17: ("<u2", 7, 0), 19: ("<u2", 13, 0), 22: ("<u4", 16, 0)}
_DTYPES |= {23: ("<u8", 17, 0)}
_SIGNED = {3: 32, 5: 16, 6: 8, 9: 64}  # int_val and int64_val hold two's complement varints


def _tensor(b: bytes, i: int, end: int) -> tuple[float, str] | str:
    """A one-number tensor's value and precision, or why it is not one."""
    fields = _fields(b, i, end)
    dtype = next((v for f, w, _, v in fields if (f, w) == (1, 0)), 0)
    if dtype not in _DTYPES:
        return NOT_ONE
    content, field, unpacked = _DTYPES[dtype]
    numel, numbers = 1, []
    for f, w, s, e in fields:
        if (f, w) == (2, 2):  # tensor_shape { dim { size } }
            for _, _, ds, de in [x for x in _fields(b, s, e) if x[:2] == (2, 2)]:
                numel *= next((v for g, x, _, v in _fields(b, ds, de) if (g, x) == (1, 0)), 0)
        elif (f, w) == (4, 2) and e > s:
            numbers = np.frombuffer(b[s:e], dtype=content).tolist()  # ValueError if ragged
        elif f == field and w == 2 and unpacked != 0:
            numbers += np.frombuffer(b[s:e], dtype=content).tolist()
        elif f == field and w == 2:
            while s < e:
                v, s = varint(b, s, e)
                numbers.append(v)
        elif f == field and w == unpacked:
            numbers.append(e if w == 0 else np.frombuffer(b[s:e], dtype=content)[0].item())
        elif f == field:
            raise _Bad
    if numel != 1 or len(numbers) != 1:
        return NOT_ONE
    v = numbers[0]
    if dtype in (1, 2):
        return float(v), _PRECISIONS[2 - dtype]
    if dtype in (14, 19):  # the 16 bits of a half or a bfloat16
        half = np.array([v & 0xFFFF], dtype=np.uint16)
        if dtype == 19:
            return float(half.view(np.float16)[0]), "float16"
        return float((half.astype(np.uint32) << 16).view(np.float32)[0]), "bfloat16"
    if dtype in _SIGNED:
        v = (v & (1 << _SIGNED[dtype]) - 1) ^ 1 << _SIGNED[dtype] - 1
        v -= 1 << _SIGNED[dtype] - 1
    v = int(bool(v)) if dtype == 10 else int(v)
    return (float(v), "float64") if float(v) == v else BAD_INT


_OTHER = {3: "histograms", 4: "images", 5: "histograms", 6: "audio"}


def _event(b: bytes, s: int, e: int) -> tuple[int, list[tuple], set[str]]:
    """An Event's step, its values as (tag, kind, (value, precision) or why not, plugin or
    None), and what else it holds (graphs, run metadata)."""
    step, values, other = 0, [], set()
    for f, w, fs, fe in _fields(b, s, e):
        if f == 2 and w != 0:
            raise _Bad
        if f == 2:
            step = fe - (fe >> 63 << 64)
        elif (f, w) == (5, 2):
            values += [_value(b, *x[2:]) for x in _fields(b, fs, fe) if x[:2] == (1, 2)]
        elif f in (4, 8, 9):
            other.add("run metadata" if f == 8 else "graphs")
    return step, values, other


def _value(b: bytes, s: int, e: int) -> tuple:
    tag, kind, value, plugin = b"", None, None, None
    for f, w, fs, fe in _fields(b, s, e):
        if (f, w) == (1, 2):
            tag = b[fs:fe]
        elif (f, w) == (2, 5):
            kind, value = _SIMPLE, (struct.unpack("<f", b[fs:fe])[0], "float32")
        elif (f, w) == (8, 2):
            kind, value = _TENSOR, _tensor(b, fs, fe)
        elif f in _OTHER:
            kind = _OTHER[f]
        elif (f, w) == (9, 2):  # metadata { plugin_data { plugin_name } }
            data = _first(b, fs, fe, 1, 2)
            name = _first(b, *data, 1, 2) if data else None
            plugin = b[slice(*name)].decode("utf-8", "replace") if name else ""
    return tag, kind, value, plugin


# --- a run: its files' values in record order, then the frame ------------------------------

_COLS = ("record", "tag", "step", "value", "precision", "kind", "why")


class _Run:
    """A run's values in record order (numbered across its files) as columns `_COLS` (why:
    why the value is not a number, or ""); every tag's plugin is its first metadata's."""

    def __init__(self) -> None:
        self.tags: dict[str, int] = {}
        self.cols: list[tuple] = []  # per file: the numpy-decoded values' columns
        self.slow: list[tuple] = []  # the other values, one tuple each
        self.meta: list[tuple[int, int, str]] = []  # (record, tag, plugin name)
        self.ignored: dict[str, set[int]] = {}
        self.files: list[tuple[Path, int, np.ndarray]] = []  # (file, first record, offsets)

    def place(self, record: int) -> str:
        file, first, offsets = next(f for f in reversed(self.files) if f[1] <= record)
        name = f"{file.name}: " if len(self.files) > 1 else ""
        return f"{name}record {record - first} at byte {int(offsets[record - first])}"

    def tag(self, raw: bytes) -> int:
        try:
            return self.tags.setdefault(raw.decode("utf-8"), len(self.tags)) if raw else -1
        except UnicodeDecodeError:
            return -1

    def read(self, path: Path, log: ReadLog) -> None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise fail(path, None, f"cannot read: {e.strerror or e}") from None
        start, length = frame_records(raw, path, log)
        base = self.files[-1][1] + len(self.files[-1][2]) if self.files else 0
        self.files.append((path, base, start - 12))
        buf = np.concatenate([np.frombuffer(raw, dtype=np.uint8), np.zeros(64, dtype=np.uint8)])
        cut = [slice(a, a + 65536) for a in range(0, len(start) or 1, 65536)]
        parts = [_fast(buf, start[c], start[c] + length[c]) for c in cut]
        kind, step, tag_at, tag_len, value, prec = (
            np.concatenate(c) for c in zip(*parts, strict=True)
        )
        ok = np.flatnonzero(kind >= 0)
        codes, names = _tag_codes(buf, tag_at[ok], tag_len[ok])
        tag = np.array([self.tag(n) for n in names] + [-1], dtype=np.int64)[codes]
        ok, tag = ok[tag >= 0], tag[tag >= 0]  # an empty or non-UTF-8 tag: `_event` says so
        why = np.full(len(ok), "", dtype=object)
        self.cols.append((base + ok, tag, step[ok], value[ok], prec[ok], kind[ok], why))
        md = np.flatnonzero(kind[ok] == _TENSOR_MD)
        _, first = np.unique(tag[md], return_index=True)
        self.meta += [(base + int(ok[md[i]]), int(tag[md[i]]), "scalars") for i in first.tolist()]
        rest = np.ones(len(start), dtype=bool)
        rest[ok] = False
        for k in np.flatnonzero(rest).tolist():
            self._slow(raw, base + k, int(start[k]), int(start[k] + length[k]), log)

    def _slow(self, raw: bytes, record: int, start: int, end: int, log: ReadLog) -> None:
        try:
            step, values, other = _event(raw, start, end)
        except (_Bad, struct.error, ValueError):
            return log.skip(BAD_EVENT, self.place(record))
        for what in other:
            self.ignored.setdefault(what, set())
        for raw_tag, kind, value, plugin in values:
            tag = self.tag(raw_tag)
            if tag >= 0 and plugin is not None:
                self.meta.append((record, tag, plugin))
            if kind not in (_SIMPLE, _TENSOR):  # a histogram, an image...; or metadata alone
                self.ignored.setdefault(kind or plugin or "empty values", set()).update(
                    {tag} - {-1}
                )
            elif tag < 0:
                log.skip(BAD_TAG, self.place(record))
            else:
                (number, prec), why = (value, "") if isinstance(value, tuple) else ((0, 0), value)
                prec = _PRECISIONS.index(prec) if why == "" else 0
                self.slow.append((record, tag, step, number, prec, kind, why))

    def frame(self, source: Path, options: ReadOptions, log: ReadLog) -> pd.DataFrame:
        """The scalars' frame: a simple_value, or a tensor of a tag of the "scalars" plugin;
        other tensors and the samples axis left out (noted), steps that go back noted."""
        plugin: dict[int, str] = {}
        for _, tag, name in sorted(self.meta, key=lambda m: m[0]):
            plugin.setdefault(tag, name)
        names = list(self.tags)
        slow = list(zip(*self.slow, strict=True)) or [()] * len(_COLS)
        c = {  # every file's numpy-decoded values, then the others, in their dtypes
            k: np.concatenate(
                [f[i] for f in self.cols] + [np.array(slow[i], self.cols[0][i].dtype)]
            )
            for i, k in enumerate(_COLS)
        }
        if len(self.slow):
            c = {k: v[np.argsort(c["record"], kind="stable")] for k, v in c.items()}
        rec, tag, step = (c[k].astype(np.int64) for k in ("record", "tag", "step"))
        scalars = np.array([plugin.get(t) == "scalars" for t in range(len(names))] + [False])
        keep = (c["kind"] == _SIMPLE) | scalars[tag]
        for t in np.unique(tag[~keep]).tolist():
            self.ignored.setdefault(plugin.get(t) or "tensors of no plugin", set()).add(t)
        for why in (c["why"], np.where(step < 0, NEGATIVE, "")):
            for i in np.flatnonzero(keep & (why != "")).tolist():
                log.skip(why[i], self.place(int(rec[i])))
                keep[i] = False
        ignored = [f"{k} {_few([names[t] for t in v])}" for k, v in sorted(self.ignored.items())]
        if ignored:
            log.note("ignored, not scalars: " + "; ".join(x.strip() for x in ignored))
        axis = np.array([n.endswith(SAMPLES_AXIS) for n in names] + [False])[tag] & keep
        if axis.any():
            dropped = [names[t] for t in np.unique(tag[axis]).tolist()]
            log.note(f"left out the tags on a samples axis, not steps: {_few(dropped)}")
        keep &= ~axis
        if not keep.any():
            raise fail(source, None, "no scalar summaries in the event files")
        first = np.r_[True, rec[keep][1:] != rec[keep][:-1]]  # (records are in order)
        urec, group = rec[keep][first], np.cumsum(first) - 1
        steps = np.zeros(len(urec), dtype=np.int64)
        steps[group] = step[keep]
        top = np.maximum.accumulate(steps)
        for g in np.flatnonzero(steps[1:] < top[:-1])[:3].tolist():
            log.note(
                f"steps go back at {self.place(int(urec[g + 1]))}: step {int(steps[g + 1])} "
                f"after step {int(top[g])} (a restarted run? --duplicates {options.duplicates})"
            )
        col, used = pd.factorize(tag[keep])
        cols, value = [names[t] for t in used.tolist()], c["value"][keep].astype(np.float64)
        out = assemble(steps, group, col, value, cols)
        if out is None:  # a step logged again with other bits: the rule, or an error naming it
            cells = Cells()
            cells.steps, cells.group, cells.col, cells.val = steps, group, col, value
            cells.where = [self.place(r) for r in urec.tolist()]
            cells.names = {name: i for i, name in enumerate(cols)}
            out = cells.frames(source, options.duplicates, log)
        rank = np.zeros(len(cols), dtype=np.int64)
        np.maximum.at(rank, col, c["precision"][keep].astype(np.int64))
        precision = {n: _PRECISIONS[r] for n, r in zip(cols, rank.tolist(), strict=True)}
        half = [n for n, p in precision.items() if p in _PRECISIONS[2:]]
        if half:
            log.note(f"stored in 16 bits (float16 or bfloat16, see precision): {_few(half)}")
        return finish(
            *out, source=source, fmt="tensorboard", precision=_rounded(out[0], precision), log=log
        )


def _rounded(values: pd.DataFrame, precision: dict[str, str]) -> dict[str, str]:
    """``precision`` with each float32 metric whose values were rounded to N decimals before
    they became float32 (HF's Trainer logs `round(loss, 4)`; its TensorBoardCallback writes that
    as a simple_value) at "float32,decimals:N" (frame.float32_rounded_places): a float32 of
    4 decimals cannot show a difference of one float32 ULP either."""
    out = dict(precision)
    for name, p in precision.items():
        if p == FLOAT32:
            n = float32_rounded_places(values[name].to_numpy(dtype=np.float64))
            if n is not None:
                out[name] = f"{FLOAT32},{decimals(n)}"
    return out


def _few(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > 3 else ""
    return ", ".join(map(repr, sorted(names)[:3])) + more


def _order(file: Path) -> tuple[int, str]:
    """Event files in the order they were written: the timestamp in their name, then the name."""
    stamp = file.name.split(_NAME, 1)[-1].lstrip(".").split(".", 1)[0]
    return (int(stamp) if stamp.isdigit() else 0, file.name)


def event_runs(folder: Path) -> dict[str, list[Path]]:
    """The runs under a folder: each folder holding event files (its path relative to `folder`,
    "." for `folder` itself), with its files in the order they were written."""
    runs = {}
    for here, _, files in sorted(os.walk(folder)):
        found = sorted((Path(here) / f for f in files if _NAME in f), key=_order)
        if found:
            runs[Path(here).relative_to(folder).as_posix()] = found
    return runs


def _read(path: Path, options: ReadOptions) -> pd.DataFrame:
    files, source = [path], path
    if path.is_dir():
        runs = event_runs(path)
        listed, name = ", ".join(runs), next(iter(runs), ".")
        if options.run is not None:  # a subfolder's path: "a/b", "a/b/", "./a/b", "."
            name = Path(options.run).as_posix()
        if not runs:
            raise fail(path, None, f"no TensorBoard event files ({_NAME}.*) in this folder")
        if options.run is None and len(runs) > 1:
            raise fail(path, None, f"{len(runs)} TensorBoard runs ({listed}): pick one with --run")
        if name not in runs:
            raise fail(path, None, f"no TensorBoard run {options.run!r} here (runs: {listed})")
        files, source = runs[name], path if name == "." else path / name
    elif options.run is not None:
        raise fail(path, None, f"--run {options.run!r} picks a run of a folder, not of a file")
    log, run = ReadLog(), _Run()
    for file in files:
        run.read(file, log)
    return run.frame(source, options, log)


def _claims(path: Path, head: bytes | None) -> bool:
    if head is None:
        return any(_NAME in f for _, _, files in os.walk(path) for f in files)
    return (
        _NAME in path.name
        or (  # or a first record that is an Event, its length crc right
            len(head) >= 16
            and masked_crc(head[:8]) == struct.unpack_from("<I", head, 8)[0]
            and b"brain.Event:" in head[12:64]
        )
    )


FORMATS = [
    Format(
        "tensorboard",
        _read,
        _claims,
        f"a TensorBoard event file (`{_NAME}.*`), or a folder of them (`--run` picks one run of "
        "several)",
        "float32 (`simple_value`, DT_FLOAT tensors), float32 and decimals(N) when every value "
        "is the float32 of a rounded decimal; float64 (DT_DOUBLE, integers)",
    )
]
