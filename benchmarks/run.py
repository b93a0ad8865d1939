"""Benchmarks of the harness, each printed with its goal; medians over repeats, peers side by side.

    python benchmarks/run.py            # everything but the suite (tens of minutes on 2 cores)
    python benchmarks/run.py --quick    # fewer repeats, smaller inputs, 20-step pairs only
    python benchmarks/run.py --suite    # also the whole `pytest -m parity` suite: time, memory

Figures: (1) harness overhead, a matched pair's wall time over the training inside it, at 20, 100
and 200 steps, two launches vs one in-process launch; (2) start-up: one launch, and the
in-process pair against it; (3) comparison throughput against a per-value Python loop; (4)
reading verl console logs against a line-by-line `re` + `float()` loop; (5) the parity suite;
(6) a second `check` against the same base: the base from the run store, a diverging head
stopped at its divergence, against today's full check.
Timings are wall-clock medians, so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from parity.judge.compare import compare_frames
from parity.readers import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _goal(ok: bool) -> str:
    return "met" if ok else "NOT met"


# --- (3) comparison ------------------------------------------------------------------------------


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
    """Two cases: equal runs (what a parity check mostly sees; distances are computed only
    where bits differ) and every value one ULP apart (the worst case)."""
    a, b = _frames(steps, 10)
    apart = pd.DataFrame(np.nextafter(b.to_numpy(), np.inf), index=b.index, columns=b.columns)
    n = a.size
    for case, other in (("equal", b), ("all 1 ulp apart", apart)):
        ours = median_time(lambda other=other: compare_frames(a, other), repeats)
        peer = median_time(lambda other=other: python_loop_compare(a, other), max(1, repeats // 2))
        rate = n / ours / 1e6
        print(f"compare   {n:,} values ({steps:,} steps x 10 metrics, {case}): {rate:.1f}M/s "
              f"(goal >= 20M/s: {_goal(rate >= 20)}); python loop {n / peer / 1e6:.1f}M values/s; "
              f"ours {peer / ours:.1f}x faster")  # fmt: skip


# --- (4) console reader --------------------------------------------------------------------------


def _console_log(path: Path, lines: int) -> None:
    """verl step lines with an unrelated log line after every nine (plain floats, full repr)."""
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
    """(4): ours and the peer take turns, so a drift of this shared host's load hits both."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "console.log"
        _console_log(path, lines)
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(repeats):
            times[0].append(median_time(lambda: read_metrics(path, "verl-console"), 1))
            times[1].append(median_time(lambda: python_loop_read(path), 1))
        ours, peer = (statistics.median(t) for t in times)
    rate = lines / ours / 1e6
    print(f"reader    {lines:,} console lines (1 in 10 unrelated): {rate:.2f}M lines/s "
          f"(goal >= 1M/s: {_goal(rate >= 1)}); re+float loop {lines / peer / 1e6:.2f}M lines/s; "
          f"ours {peer / ours:.1f}x faster")  # fmt: skip


# --- (1), (2) pairs and launches -----------------------------------------------------------------


def _train_seconds(run_dir: Path) -> float:
    """Training time measured inside the job (timing.json, written by rank 0 after fit)."""
    return float(json.loads((run_dir / "timing.json").read_text())["train_seconds"])


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (and theirs): a whole launch's tree."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _pair_once(steps: int, in_process: bool) -> tuple[float, float, float]:
    """(wall time of `parity pair`, training time inside both sides, CPU time of its process
    tree) for one 2-rank SFT pair."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "parity.cli", "pair", "--world", "2"]
        cmd += ["--task", "charcount-sft", "--a", "legacy", "--b", "worker"]
        cmd += ["--steps", str(steps), "--out", tmp, "--json"]
        cmd += ["--in-process"] if in_process else []
        start, cpu = time.perf_counter(), _children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
        if proc.returncode != 0:
            raise SystemExit(f"pair failed: {proc.stderr[-2000:]}")
        train = sum(_train_seconds(Path(tmp) / side) for side in ("a", "b"))
    return wall, train, cpu


def _launch_once(steps: int) -> tuple[float, float, float]:
    """(wall time of one 2-rank worker launch, its training time, its tree's CPU time)."""
    from parity.run.job import run_job
    from parity.spec import JobSpec

    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), _children_cpu()
        run = run_job(JobSpec(task="charcount-sft", world_size=2, steps=steps), Path(tmp) / "run")
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
        return wall, _train_seconds(run.dir), cpu


Timed = Callable[[], tuple[float, float, float]]  # one run: (wall, training inside it, CPU)


def _interleaved(fns: list[Timed], repeats: int) -> list[tuple[float, float, float, float]]:
    """Per fn: median wall, median training, median of the runs' own wall/training and median
    CPU time. The fns take turns, so a drift of this VM's speed hits each of them alike."""
    runs: list[list[tuple[float, float, float]]] = [[] for _ in fns]
    for _ in range(repeats):
        for out, fn in zip(runs, fns, strict=True):
            out.append(fn())
    return [
        (
            statistics.median(w for w, _, _ in r),
            statistics.median(t for _, t, _ in r),
            statistics.median(w / t for w, t, _ in r),
            statistics.median(c for _, _, c in r),
        )
        for r in runs
    ]


def bench_pairs(step_counts: tuple[int, ...], repeats: int) -> None:
    """(1): overhead = pair wall time / training time inside it, separate vs in-process."""
    for steps in step_counts:
        separate, in_process = _interleaved(
            [lambda s=steps: _pair_once(s, False), lambda s=steps: _pair_once(s, True)], repeats
        )
        (ws, ts, rs, _), (wi, ti, ri, _) = separate, in_process
        goal = f" (goal <= 1.15: {_goal(ri <= 1.15)})" if steps >= 200 else ""
        faster = f" (goal >= 1.3x: {_goal(ws / wi >= 1.3)})" if steps == 20 else ""
        print(f"overhead  2 ranks x {steps} steps: two launches {ws:.1f} s / training {ts:.1f} s, "
              f"ratio {rs:.2f}; in-process {wi:.1f} s / {ti:.1f} s, ratio {ri:.2f}{goal}; "
              f"in-process saves {ws - wi:.1f} s ({ws / wi:.2f}x{faster})")  # fmt: skip


def bench_startup(repeats: int) -> None:
    """(2): one launch's start-up, and a whole in-process 20-step pair against one launch."""
    (one_wall, one_train, _, one_cpu), (pair_wall, pair_train, _, pair_cpu) = _interleaved(
        [lambda: _launch_once(20), lambda: _pair_once(20, True)], repeats
    )
    startup, pair_startup = one_wall - one_train, pair_wall - pair_train
    ratio = pair_startup / startup
    print(f"start-up  one launch (2 ranks, 20 steps): {one_wall:.1f} s wall, {startup:.1f} s of it "
          f"outside training; in-process 20-step pair: {pair_wall:.1f} s wall "
          f"({pair_wall / one_wall:.2f}x one launch), {pair_startup:.1f} s outside training = "
          f"{ratio:.2f}x one launch's (goal < 1.5x: {_goal(ratio < 1.5)})")  # fmt: skip
    print(f"          CPU time of the process tree: one launch {one_cpu:.1f} s, the in-process "
          f"pair {pair_cpu:.1f} s ({pair_cpu / one_cpu:.2f}x)")  # fmt: skip


# --- (6) check: a base reused from the run store, a head stopped at its divergence ---------------

#: a one-rank torch job of 200 steps (about 25 ms each on one core): loss scaled from step 3
CHECK_JOB = """\
import json
import sys
from pathlib import Path

import torch

SCALE = {scale}  # {label}

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4096, 256), torch.randn(4096, 1)
with open(out / "metrics.jsonl", "w") as f:
    for step in range(1, 201):
        loss = torch.nn.functional.mse_loss(model(x), y) * (SCALE if step >= 3 else 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        f.write(json.dumps({{"step": step, "train/loss": loss.item()}}) + "\\n")
        f.flush()
    f.write(json.dumps({{"event": "end", "steps": 200}}) + "\\n")
"""
CHECK_SPEC = 'task = "custom"\nworld_size = 1\ncommand = ["job.py", "--out", "{out}"]\n'


def _check_repo(root: Path) -> list[str]:
    """A repository of three commits: the job, a comment (aligned), a scale from step 3."""

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(root), "-c", "user.name=b", "-c", "user.email=b@example.com"]
        return subprocess.run([*cmd, *args], check=True, capture_output=True, text=True).stdout

    root.mkdir(parents=True)
    git("init", "-q", "-b", "main")
    commits = []
    for label, scale in (("base", "1.0"), ("a comment", "1.0"), ("scaled", "1.0000001")):
        (root / "job.py").write_text(CHECK_JOB.format(scale=scale, label=label))
        (root / "spec.toml").write_text(CHECK_SPEC)
        git("add", "-A")
        git("commit", "-q", "-m", label)
        commits.append(git("rev-parse", "HEAD").strip())
    return commits


def _check_once(root: Path, base: str, head: str, *args: str) -> Timed:
    def run() -> tuple[float, float, float]:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "parity.cli", "check", "--base", base, "--head", head]
            cmd += ["--spec", "spec.toml", "--out", out, "--no-trace", *args]
            start, cpu = time.perf_counter(), _children_cpu()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
            wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
            if proc.returncode not in (0, 1):
                raise SystemExit(f"check failed: {proc.stderr[-2000:]}")
        return wall, wall, cpu

    return run


def bench_check(repeats: int) -> None:
    """(6): a second check against the same base, with the base in the run store: an aligned
    head costs one run, not two; a head that diverges at step 3 of 200 is stopped there, and
    the base run again to confirm it stops there too; each against today's full check."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        base, aligned, scaled = _check_repo(root)
        store = str(Path(tmp) / "store")
        subprocess.run([sys.executable, "-m", "parity.cli", "check", "--base", base, "--head",
                        aligned, "--spec", "spec.toml", "--out", str(Path(tmp) / "seed"),
                        "--store", store], check=True, capture_output=True, cwd=root)  # fmt: skip
        full = ("--store", "off", "--run-out")
        figures = _interleaved(
            [_check_once(root, base, aligned, *full), _check_once(root, base, aligned,
             "--store", store), _check_once(root, base, scaled, *full),
             _check_once(root, base, scaled, "--store", store)], repeats,
        )  # fmt: skip
    (a_full, *_), (a_store, *_), (d_full, *_), (d_store, *_) = figures
    print(
        f"check     aligned head, 200 steps: full check {a_full:.1f} s, base from the run "
        f"store {a_store:.1f} s ({a_full / a_store:.2f}x; goal ~2x: one run, not two)"
    )
    print(
        f"check     head diverging at step 3 of 200: full check {d_full:.1f} s, base from the "
        f"store and the head stopped early {d_store:.1f} s ({d_full / d_store:.2f}x)"
    )


# --- (5) the parity suite ------------------------------------------------------------------------


def _tree_memory_kib(root: int) -> tuple[int, int]:
    """(summed PSS, summed RSS) in KiB of `root` and every process below it, from /proc.

    PSS splits shared pages (torch's libraries in every rank) between the processes that map
    them, so its sum is what the tree really holds; RSS counts them once per process.
    """
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    parent[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree]
        tree.update(frontier)
    pss = rss = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Pss:", "Rss:")):
                        kib = int(line.split()[1])
                        pss, rss = (pss + kib, rss) if line[0] == "P" else (pss, rss + kib)
        except (OSError, ValueError):
            continue
    return pss, rss


def _suite_child(pytest_args: list[str]) -> None:
    """Run pytest (`-m parity` by default) as a child; print its wall time and memory (JSON).

    Memory: the peak over the run of the whole process tree's summed PSS and RSS, sampled every
    half second (pools, torchrun agents and ranks included), and the largest single process's
    peak RSS and the CPU time of the tree (RUSAGE_CHILDREN: this process runs the suite and
    nothing else; ranks count once their torchrun has reaped them). Training: the seconds every
    job's training loop took (its timing.json; the run folders are kept in a temp folder).
    """
    import threading

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = Path(tempfile.mkdtemp(prefix="parity-suite-runs-"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8",
           f"--parity-keep-runs={runs}", *pytest_args]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[:] = [max(p, now) for p, now in zip(peak, _tree_memory_kib(proc.pid), strict=True)]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = out.strip().splitlines() or [""]
    tail = next((x for x in reversed(lines) if " in " in x and "=" in x), lines[-1])
    failed = [x for x in lines if x.startswith(("FAILED ", "ERROR "))]  # pytest's short summary
    slowest = [x for x in lines if re.match(r"\d+\.\d+s (call|setup|teardown) ", x)]
    timings = [json.loads(t.read_text()) for t in runs.rglob("timing.json")]
    trained = [t["train_seconds"] for t in timings if "train_seconds" in t]  # jobs, not launches
    shutil.rmtree(runs, ignore_errors=True)
    report = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
              "maxrss_kib": usage.ru_maxrss, "tree_pss_kib": peak[0],
              "tree_rss_kib": peak[1], "rc": proc.returncode, "tail": tail,
              "failed": failed, "train_s": sum(trained), "jobs": len(trained),
              "slowest": slowest}  # fmt: skip
    print(json.dumps(report))


def bench_suite(pytest_args: list[str]) -> None:
    """(5): wall time and peak memory of `pytest -m parity` (goal: under 5 minutes)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--suite-child", json.dumps(pytest_args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"suite benchmark failed: {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    minutes = r["wall_s"] / 60
    print(f"suite     pytest {' '.join(pytest_args)}: {r['wall_s']:.0f} s wall ({minutes:.1f} min; "
          f"goal < 5 min: {_goal(minutes < 5)}); peak memory of the whole process tree "
          f"{r['tree_pss_kib'] / 1024:.0f} MiB PSS ({r['tree_rss_kib'] / 1024:.0f} MiB RSS), "
          f"largest process {r['maxrss_kib'] / 1024:.0f} MiB; "
          f"exit {r['rc']}: {r['tail']}")  # fmt: skip
    cores = os.cpu_count() or 1
    print(f"          CPU time of the tree {r['cpu_s']:.0f} s: {r['cpu_s'] / r['wall_s']:.2f} of "
          f"{cores} cores busy on average; even perfectly packed the suite needs "
          f"{r['cpu_s'] / cores:.0f} s here")  # fmt: skip
    print(f"          training inside it: {r['train_s']:.0f} s in {r['jobs']} jobs "
          f"({r['train_s'] / r['wall_s']:.0%} of the wall); the rest is starting ranks, "
          f"launch and failure tests, reading and comparing")  # fmt: skip
    print("          slowest tests (where a cut would count):")
    for line in r["slowest"]:
        print(f"            {line}")
    for line in r["failed"]:
        print(f"          {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a short version (a few minutes)")
    p.add_argument("--skip-pair", action="store_true", help="only compare and reader")
    p.add_argument("--suite", action="store_true", help="also time `pytest -m parity` (slow)")
    p.add_argument("--repeats", type=int, default=None, help="runs per pair figure (median)")
    p.add_argument("--no-pool", action="store_true", help="time the suite without warm pools")
    p.add_argument("--suite-child", default=None, help=argparse.SUPPRESS)  # pytest args, JSON
    p.add_argument("--only", choices=["reader", "startup", "pairs", "check"],
                   help="one figure: (4) reader, (2) startup, (1) pairs or (6) check; --repeats "
                        "runs (7, 5 for the launches, 3 for check)")  # fmt: skip
    args = p.parse_args()
    if args.suite_child is not None:
        _suite_child(json.loads(args.suite_child))
        return
    from worker.metrics_log import environment

    env = environment()  # figures move with the host: name its CPU as a golden's fingerprint does
    print(
        f"# {os.cpu_count()} CPUs ({env['machine']}: {' '.join(env['cpu_isa']) or '?'}), "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    if args.only == "reader":
        bench_reader(100_000 if args.quick else 1_000_000, args.repeats or 7)
        return
    if args.only == "startup":
        bench_startup(args.repeats or 5)
        return
    if args.only == "pairs":
        bench_pairs((20,) if args.quick else (20, 100, 200), args.repeats or 5)
        return
    if args.only == "check":
        bench_check(args.repeats or 3)
        return
    bench_compare(100_000 if args.quick else 1_000_000, 3 if args.quick else 5)
    bench_reader(100_000 if args.quick else 1_000_000, 3)
    if not args.skip_pair:
        repeats = args.repeats or (1 if args.quick else 3)
        bench_startup(repeats)
        bench_pairs((20,) if args.quick else (20, 100, 200), repeats)
        bench_check(repeats)
    if args.suite:
        bench_suite(["-m", "parity", *(["--parity-no-pool"] if args.no_pool else [])])


if __name__ == "__main__":
    main()
