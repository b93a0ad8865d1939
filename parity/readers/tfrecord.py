"""TFRecord framing, as TensorBoard's event files use it: per record a uint64 length, its masked
crc32c, the data and the data's masked crc32c. numpy finds and checks every record of a file at
once (crc32c four bytes a step, long records in chunks combined in order), so the framing is not
the bottleneck of reading a million scalars.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pandas as pd

from parity.readers.frame import ReadLog, fail

TRUNCATED = "truncated last records (a run still writing, or killed)"

# --- crc32c (Castagnoli) of many records at once -------------------------------------------


def _zeros(v: np.ndarray, k: int) -> np.ndarray:
    """crc registers `v` after k zero bytes (linear in v)."""
    for _ in range(k):
        v = _TABLE[v & 0xFF] ^ (v >> 8)
    return v


_TABLE = np.arange(256, dtype=np.uint32)
for _ in range(8):
    _TABLE = np.where(_TABLE & 1, (_TABLE >> 1) ^ np.uint32(0x82F63B78), _TABLE >> 1)
_TABLE = _TABLE.astype(np.uint32)
_LOW = _zeros(np.arange(1 << 16, dtype=np.uint32), 4)  # four bytes a step: two 16-bit tables
_HIGH = _zeros(np.arange(1 << 16, dtype=np.uint32) << 16, 4)
_CHUNK = 1024  # a longer record is checked in chunks of this size, combined in order
_ONES = np.full(_CHUNK + 1, 0xFFFFFFFF, dtype=np.uint32)  # the initial register after k zeros
for _k in range(1, _CHUNK + 1):
    _ONES[_k] = _zeros(_ONES[_k - 1 : _k], 1)[0]
_BITS = _zeros(np.uint32(1) << np.arange(32, dtype=np.uint32), _CHUNK).reshape(4, 8)
_SHIFT = [  # a register after _CHUNK zero bytes, as 4 tables of its bytes
    np.bitwise_xor.reduce(np.where(np.arange(256)[:, None] >> np.arange(8) & 1, b, 0), 1).tolist()
    for b in _BITS
]


def windows(buf: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """buf[a : a + width] for each a, as one array (a copy)."""
    return np.lib.stride_tricks.sliding_window_view(buf, width)[at]


def _raw(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """crc registers from 0 over buf[s:s+l] front-padded with zeros to `width` (a no-op)."""
    out = np.empty(len(starts), dtype=np.uint32)
    near = starts < width  # the padding would start before the buffer: a padded copy
    if near.any():
        head = np.concatenate([np.zeros(width, dtype=np.uint8), buf[: 2 * width]])
        out[near] = _raw(head, starts[near] + width, lengths[near], width)
    step = (1 << 22) // width
    for a in range(0, len(starts) if not near.all() else 0, step):
        far = ~near[a : a + step]
        pad = width - lengths[a : a + step][far]
        mat = windows(buf, starts[a : a + step][far] - pad, width)
        if len(pad) and pad.min() == pad.max():  # records of one length
            mat[:, : pad[0]] = 0
        else:
            mat[np.arange(width) < pad[:, None]] = 0
        crc = np.zeros(len(mat), dtype=np.uint32)
        for word in np.ascontiguousarray(mat.view("<u4").T):
            crc ^= word
            crc = _LOW[crc & 0xFFFF] ^ _HIGH[crc >> 16]
        out[a : a + step][far] = crc
    return out


def crc32c(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """crc32c of buf[s:s+l] for each (s, l): records of one length (where few, of one width)
    together, four bytes a numpy pass; records over _CHUNK bytes in chunks."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    out = np.empty(len(starts), dtype=np.uint32)
    group, size = pd.factorize(lengths)
    count = np.bincount(group, minlength=len(size))
    width = np.where(
        size <= 64, size + 7 & ~7, 2 ** np.ceil(np.log2(np.maximum(size, 1))).astype(np.int64)
    )
    width = np.maximum(np.where(count >= 256, size + 3 & ~3, width), 4)
    for w in np.unique(width[size <= _CHUNK]).tolist():
        i = np.flatnonzero((width[group] == w) & (lengths <= _CHUNK))
        out[i] = _raw(buf, starts[i], lengths[i], w) ^ _ONES[lengths[i]]
    t0, t1, t2, t3 = _SHIFT
    for i in np.flatnonzero(lengths > _CHUNK).tolist():
        k, first = -(-int(lengths[i]) // _CHUNK), (int(lengths[i]) - 1) % _CHUNK + 1
        at = starts[i] + np.append(0, first + _CHUNK * np.arange(k - 1))
        chunks = _raw(buf, at, np.append(first, np.full(k - 1, _CHUNK)), _CHUNK).tolist()
        reg = chunks[0] ^ int(_ONES[first])
        for c in chunks[1:]:
            reg = t0[reg & 255] ^ t1[reg >> 8 & 255] ^ t2[reg >> 16 & 255] ^ t3[reg >> 24] ^ c
        out[i] = reg
    return out ^ np.uint32(0xFFFFFFFF)


def masked(crc: np.ndarray) -> np.ndarray:
    """TFRecord's masked crc: rotated right by 15 bits plus a constant."""
    crc = np.asarray(crc, dtype=np.uint32)
    return ((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)


def masked_crc(data: bytes) -> int:
    return int(masked(crc32c(np.frombuffer(data, np.uint8), [0], [len(data)]))[0])


# --- records ---------------------------------------------------------------------------------


def _u(buf: np.ndarray, at: np.ndarray, size: int) -> np.ndarray:
    """The little-endian unsigned integer of `size` bytes at each offset."""
    if not len(at):
        return np.zeros(0, dtype=np.int64)
    return windows(buf, at, size).view(f"<u{size}").ravel().astype(np.int64)


def _check(path: Path, at: np.ndarray, crc: np.ndarray, want: np.ndarray, what: str) -> None:
    if (crc != want).any():
        k = int(np.argmax(crc != want))
        raise fail(path, f"record {k} at byte {int(at[k])}", f"corrupted record ({what} crc)")


def frame_records(raw: bytes, path: Path, log: ReadLog) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each record's data, every crc checked; a cut-off tail is skipped."""
    buf, n, offsets, p = np.frombuffer(raw, np.uint8), len(raw), [], 0
    u64 = struct.Struct("<Q").unpack_from
    while p + 12 <= n:  # each record's offset follows from the one before
        offsets.append(p)
        p += u64(raw, p)[0] + 16
    at = np.array(offsets, dtype=np.int64)
    size = _u(buf, at, 8)
    _check(path, at, masked(crc32c(buf, at, np.full(len(at), 8))), _u(buf, at + 8, 4), "length")
    if p != n:  # the writer was cut off in a record (p > n) or in a header
        cut = p > n
        where = f"record {len(at) - cut} at byte {at[-1] if cut else p}"
        log.skip(TRUNCATED, f"{path.name}: {where}")
        at, size = (at[:-1], size[:-1]) if cut else (at, size)
    _check(path, at, masked(crc32c(buf, at + 12, size)), _u(buf, at + 12 + size, 4), "data")
    return at + 12, size


# --- the usual scalar event, decoded with numpy ----------------------------------------------
