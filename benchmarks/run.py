"""Benchmarks of the harness, each printed with its goal; medians over repeats, peers in one run.

    python benchmarks/run.py            # everything (a few minutes on 2 cores)
    python benchmarks/run.py --quick    # fewer repeats, smaller inputs

Figures: the matched pair's wall time and its overhead over the training it checks, the cost of
one torchrun launch, comparison throughput against a per-value Python loop, and reading verl
console logs against a line-by-line `re` + `float()` loop.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from parity.compare import compare_frames
from parity.readers import read_metrics


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _frames(steps: int, metrics: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((steps, metrics))
    index = pd.Index(np.arange(1, steps + 1), name="step")
    cols = [f"train/m{i}" for i in range(metrics)]
    return pd.DataFrame(data, index=index, columns=cols), pd.DataFrame(
        data.copy(), index=index, columns=cols
    )


def python_loop_compare(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """The peer: what the common loss-compare scripts do, one value at a time."""
    out = {}
    for col in a.columns:
        first = None
        for step, x, y in zip(a.index, a[col].tolist(), b[col].tolist(), strict=True):
            if x != y and not (x != x and y != y) and first is None:
                first = step
        out[col] = first
    return out


def bench_compare(steps: int, repeats: int) -> None:
    a, b = _frames(steps, 10)
    n = a.size
    ours = median_time(lambda: compare_frames(a, b), repeats)
    peer = median_time(lambda: python_loop_compare(a, b), max(1, repeats // 2))
    print(f"compare  {n:,} values: {n / ours / 1e6:.1f}M values/s (goal >= 20M/s); "
          f"python loop {n / peer / 1e6:.1f}M values/s; ratio {peer / ours:.1f}x")  # fmt: skip


def _console_log(path: Path, lines: int) -> None:
    rng = np.random.default_rng(1)
    with open(path, "w") as f:
        for i in range(lines):
            if i % 10 == 9:
                f.write(f"(TaskRunner pid=1) INFO some unrelated log line {i}\n")
                continue
            v = [float(x) for x in rng.standard_normal(4)]
            f.write(
                f"step:{i} - train/loss:{v[0]!r} - train/grad_norm:{v[1]!r} - "
                f"train/lr:{v[2]!r} - train/mfu:{v[3]!r}\n"
            )


STEP_LINE = re.compile(r"step:(\d+) - (.*)")


def python_loop_read(path: Path) -> dict:
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            m = STEP_LINE.search(line)
            if not m:
                continue
            row = out.setdefault(int(m.group(1)), {})
            for part in m.group(2).split(" - "):
                key, _, value = part.rpartition(":")
                row[key] = float(value)
    return out


def bench_reader(lines: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "console.log"
        _console_log(path, lines)
        ours = median_time(lambda: read_metrics(path, "verl-console"), repeats)
        peer = median_time(lambda: python_loop_read(path), repeats)
    print(f"reader   {lines:,} console lines: {lines / ours / 1e6:.2f}M lines/s (goal >= 1M/s); "
          f"re+float loop {lines / peer / 1e6:.2f}M lines/s; ratio {peer / ours:.1f}x")  # fmt: skip


def bench_pair(steps: int, repeats: int) -> None:
    walls, launches, inside = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "parity.cli", "pair", "--world", "2"]
            cmd += ["--steps", str(steps), "--out", tmp, "--json"]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            walls.append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise SystemExit(f"pair failed: {proc.stderr[-2000:]}")
            summary = json.loads((Path(tmp) / "summary.json").read_text())
            launches.append(summary["seconds"]["a"] + summary["seconds"]["b"])
            inside.append(sum(_train_seconds(Path(tmp) / side) for side in ("a", "b")))
    wall, launch, train = (statistics.median(x) for x in (walls, launches, inside))
    print(f"pair     2 ranks x {steps} steps: wall {wall:.1f} s (goal: < 60 s at 20 steps); "
          f"two launches {launch:.1f} s; training inside them {train:.1f} s; "
          f"overhead wall/training {wall / train:.2f} (goal <= 1.15 at >= 200 steps); "
          f"start-up per launch {(launch - train) / 2:.1f} s")  # fmt: skip


def _train_seconds(run_dir: Path) -> float:
    """Training time measured inside the job (timing.json, written by rank 0 after fit)."""
    return float(json.loads((run_dir / "timing.json").read_text())["train_seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-pair", action="store_true")
    args = p.parse_args()
    repeats = 3 if args.quick else 5
    bench_compare(100_000 if args.quick else 1_000_000, repeats)
    bench_reader(100_000 if args.quick else 1_000_000, 3)
    if not args.skip_pair:
        for steps in (20,) if args.quick else (20, 200):
            bench_pair(steps, 1 if args.quick else 3)


if __name__ == "__main__":
    main()
