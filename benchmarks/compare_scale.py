"""compare_frames at scale: many metrics with few steps, and many steps with many metrics.

    python benchmarks/compare_scale.py           # 400,000 metrics x 10 steps, 1,000 x 1,000
    python benchmarks/compare_scale.py --quick   # 100,000 x 10 and 500 x 500, fewer repeats

Each shape is compared twice: two equal runs, and runs one value 1 ULP apart (the one metric
that differs is judged in full, the rest in bulk). The frames carry the attrs a reader gives them
(the present mask, a precision per metric), as `parity compare` sees them. Printed per case: the
median time of compare_frames, values per second against the goal (>= 20M values/s, what
`benchmarks/run.py` asks of a 10-metric comparison, printed beside it), and the peak memory
compare_frames allocates (tracemalloc, in a separate untimed run) next to the frames' own size.
Exit 1 when a goal is missed or a verdict is wrong.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.judge.compare import Comparison, compare_frames  # noqa: E402
from parity.readers.frame import finish  # noqa: E402

GOAL = 20.0  # million values per second


def frames(steps: int, metrics: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two equal read-like frames: random values, every cell present, attrs as readers set."""
    data = np.random.default_rng(0).standard_normal((steps, metrics))
    index = pd.Index(np.arange(1, steps + 1), name="step")
    columns = pd.Index([f"train/m{i:07d}" for i in range(metrics)])
    out = []
    for values in (data, data.copy()):
        frame = pd.DataFrame(values, index=index, columns=columns, copy=False)
        present = pd.DataFrame(np.ones(values.shape, dtype=bool), index=index, columns=columns)
        out.append(finish(frame, present, source="bench", fmt="jsonl"))
    return out[0], out[1]


def one_ulp_apart(frame: pd.DataFrame) -> tuple[pd.DataFrame, str, int]:
    """A copy of ``frame`` with the value of its middle metric at its middle step 1 ULP up."""
    values = frame.to_numpy().copy()
    row, col = len(frame.index) // 2, len(frame.columns) // 2
    values[row, col] = np.nextafter(values[row, col], np.inf)
    other = pd.DataFrame(values, index=frame.index, columns=frame.columns, copy=False)
    other.attrs = dict(frame.attrs)
    return other, str(frame.columns[col]), int(frame.index[row])


def median_time(a: pd.DataFrame, b: pd.DataFrame, repeats: int) -> tuple[float, Comparison]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = compare_frames(a, b)
        times.append(time.perf_counter() - start)
    assert result is not None
    return statistics.median(times), result


def peak_mib(a: pd.DataFrame, b: pd.DataFrame) -> float:
    """What compare_frames allocates at its peak (numpy arrays included), in MiB."""
    tracemalloc.start()
    try:
        compare_frames(a, b)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def verdict_ok(result: Comparison, diverged: tuple[str, int] | None) -> bool:
    """Equal runs are aligned; the 1-ULP pair fails in exactly that metric, at that step."""
    if diverged is None:
        return result.ok and not result.failures
    failures = result.failures
    name, step = diverged
    return (
        not result.ok
        and [m.name for m in failures] == [name]
        and failures[0].first_divergent_step == step
        and failures[0].max_ulp == 1
    )


def bench(steps: int, metrics: int, repeats: int) -> bool:
    a, b = frames(steps, metrics)
    apart, name, step = one_ulp_apart(b)
    size = 2 * a.size * (8 + 1) / 2**20  # float64 values and a boolean present mask, per side
    ok = True
    for case, other, diverged in (("equal", b, None), ("1 value 1 ULP apart", apart, (name, step))):
        seconds, result = median_time(a, other, repeats)
        rate = a.size / seconds / 1e6
        right = verdict_ok(result, diverged)
        met = rate >= GOAL and right
        ok &= met
        print(
            f"compare {a.size:>10,} values ({steps:,} steps x {metrics:,} metrics, {case}): "
            f"{seconds * 1e3:8.1f} ms, {rate:6.1f}M values/s (goal >= {GOAL:.0f}M/s: "
            f"{'met' if rate >= GOAL else 'NOT met'}); verdict {result.verdict}"
            + ("" if right else " (WRONG)")
            + f"; peak {peak_mib(a, other):.0f} MiB allocated by compare (frames {size:.0f} MiB)"
        )
    return ok


def few_metrics(steps: int, repeats: int) -> None:
    """benchmarks/run.py's figure: 10 metrics with many steps, where per-metric costs vanish."""
    a, b = frames(steps, 10)
    seconds, _ = median_time(a, b, repeats)
    print(
        f"compare {a.size:>10,} values ({steps:,} steps x 10 metrics, equal; benchmarks/run.py's "
        f"case): {seconds * 1e3:8.1f} ms, {a.size / seconds / 1e6:6.1f}M values/s"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller frames, fewer repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (median)")
    args = p.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    ok = bench(10, 100_000 if args.quick else 400_000, repeats)
    ok &= bench(500 if args.quick else 1_000, 500 if args.quick else 1_000, repeats)
    few_metrics(100_000 if args.quick else 1_000_000, repeats)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    print(f"process max RSS {rss:.0f} MiB; goals {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
