"""Reading a TensorBoard event file: parity's reader against tensorboard's `EventAccumulator`.

    python benchmarks/tensorboard_read.py                  # 1,000,000 scalars, 3 repeats
    python benchmarks/tensorboard_read.py --scalars 200000 --repeats 5
    python benchmarks/tensorboard_read.py --writer torch   # written by SummaryWriter (slow)

The file holds the scalars of a torchtitan-like run: 10 tags (`loss_metrics/global_avg_loss`,
`grad_norm`, `lr`...) at every step, as `SummaryWriter.add_scalar` writes them (a float32
`simple_value`). By default its records are written here, byte for byte what tensorboard's
protobuf serializes (checked on a sample), and framed with the reader's numpy crc32c, because
SummaryWriter takes about 35 s per million scalars; `--writer torch` uses SummaryWriter itself.
`EventAccumulator` reads it too, checking every crc on its own, so the file is a real one.

Both readers run alternately, `--repeats` times each; the figures are medians. `EventAccumulator`
keeps every scalar (size_guidance 0). The values must be equal: same steps, same float32 bits.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.readers import read_metrics  # noqa: E402
from parity.readers.tfrecord import crc32c, masked  # noqa: E402

TAGS = [
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "throughput(tps)",
    "tflops",
    "mfu(%)",
    "time_metrics/end_to_end(s)",
    "memory/max_active(GiB)",
    "memory/max_reserved(GiB)",
]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _event(wall: float, step: int, tag: bytes, value: bytes) -> bytes:
    """Event{wall_time, step, summary{value{tag, simple_value}}}, as protobuf serializes it."""
    val = b"\x0a" + _varint(len(tag)) + tag + b"\x15" + value
    summary = b"\x0a" + _varint(len(val)) + val
    step_field = b"\x10" + _varint(step) if step else b""  # proto3 leaves out a zero
    return (
        b"\x09" + struct.pack("<d", wall) + step_field + b"\x2a" + _varint(len(summary)) + summary
    )


def _records(datas: list[bytes]) -> bytes:
    """TFRecord framing: length, masked crc32c of it, data, masked crc32c of the data."""
    lengths = np.array([len(d) for d in datas], dtype=np.int64)
    heads = np.frombuffer(lengths.astype("<u8").tobytes(), dtype=np.uint8)
    head_crc = masked(crc32c(heads, np.arange(len(datas)) * 8, np.full(len(datas), 8)))
    body = np.frombuffer(b"".join(datas), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    data_crc = masked(crc32c(body, starts, lengths))
    pack = struct.Struct("<QI").pack
    return b"".join(
        pack(n, h) + d + struct.pack("<I", c)
        for n, h, d, c in zip(
            lengths.tolist(), head_crc.tolist(), datas, data_crc.tolist(), strict=True
        )
    )


def write_events(folder: Path, n: int, writer: str) -> tuple[Path, np.ndarray]:
    """An event file of n scalars (10 tags a step); returns it and the float32 values."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n).astype(np.float32)
    steps = np.arange(n) // len(TAGS) + 1
    tags = [TAGS[i % len(TAGS)] for i in range(n)]
    if writer == "torch":
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(str(folder), max_queue=1000)
        for tag, v, s in zip(tags, values.tolist(), steps.tolist(), strict=True):
            w.add_scalar(tag, v, s)
        w.close()
        return next(folder.glob("events.out.tfevents.*")), values
    from tensorboard.compat.proto import event_pb2, summary_pb2

    wall = 1.7e9 + np.arange(n) * 1e-3
    encoded = {t: t.encode() for t in TAGS}
    raw = values.astype("<f4").tobytes()
    datas = [b"\x09" + struct.pack("<d", 1.7e9) + b"\x1a\x0dbrain.Event:2"]  # the file version
    version = event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2")
    assert version.SerializeToString() == datas[0]
    datas += [
        _event(w, s, encoded[t], raw[4 * i : 4 * i + 4])
        for i, (w, s, t) in enumerate(zip(wall.tolist(), steps.tolist(), tags, strict=True))
    ]
    for i in sorted({0, n // 2, n - 1}):  # what tensorboard's protobuf serializes
        value = summary_pb2.Summary.Value(tag=tags[i], simple_value=float(values[i]))
        event = event_pb2.Event(
            wall_time=float(wall[i]), step=int(steps[i]), summary=summary_pb2.Summary(value=[value])
        )
        assert event.SerializeToString() == datas[i + 1], f"record {i + 1} differs"
    path = folder / "events.out.tfevents.1700000000.bench.1.0"
    path.write_bytes(_records(datas))
    return path, values


def read_accumulator(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()[SCALARS]:
        events = acc.Scalars(tag)
        out[tag] = (
            np.array([e.step for e in events], dtype=np.int64),
            np.array([e.value for e in events], dtype=np.float64),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scalars", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--writer", choices=("numpy", "torch"), default="numpy")
    args = ap.parse_args()
    # imported before timing: tensorboard's import time is not counted against it
    from tensorboard.backend.event_processing import event_accumulator  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path, values = write_events(Path(tmp), args.scalars, args.writer)
        size = path.stat().st_size
        print(
            f"wrote {args.scalars:,} scalars ({size / 1e6:.1f} MB) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        ours, theirs = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            frame = read_metrics(path)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            acc = read_accumulator(path)
            theirs.append(time.perf_counter() - t0)
        present = frame.attrs["present"]
        assert sorted(acc) == sorted(frame.columns), "different tags"
        count = 0
        for tag, (steps, vals) in acc.items():
            mine = frame[tag][present[tag]]
            assert np.array_equal(mine.index.to_numpy(), steps), f"{tag}: different steps"
            assert np.array_equal(mine.to_numpy().view(np.uint64), vals.view(np.uint64)), tag
            count += len(vals)
        assert count == args.scalars == int(present.to_numpy().sum()), "different counts"
        assert not frame.attrs["skipped"]
        mine_vals = frame.to_numpy().ravel()[present.to_numpy().ravel()]
        assert np.array_equal(np.sort(mine_vals), np.sort(values.astype(np.float64)))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"equal values: {count:,} scalars, same steps and float32 bits")
    print(
        f"tensorboard read: {args.scalars:,} scalars in {a:.2f} s vs EventAccumulator {b:.2f} s: "
        f"{b / a:.1f} x (goal >= 5x)"
    )


if __name__ == "__main__":
    main()
