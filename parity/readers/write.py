"""Writing a canonical frame back out: exactly (float repr) and atomically, in the text formats
the harness writes (our jsonl, verl's console and JSON lines, CSV)."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from parity.readers.frame import MetricsError, bad_key, present_mask

WRITABLE = ("jsonl", "verl-console", "verl-jsonl", "csv")


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
        bad = [n for n in names if bad_key(n)]
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
    raise MetricsError(f"unknown metrics format {fmt!r}; expected one of {', '.join(WRITABLE)}")


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
