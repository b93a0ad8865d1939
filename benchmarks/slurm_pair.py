"""What Slurm costs a pair: the charcount SFT pair at 2 nodes x 1 rank through the Slurm launcher
(one allocation) against the same pair launched locally with ``--nnodes 2``, and the effect of
the launcher's poll interval.

    python benchmarks/slurm_pair.py [--steps 4] [--repeats 3] [--polls 0.2,0.5,1.0] [--json]

Why: the sides must run on the cluster's nodes, but submission, the agent's start and the
harness's polling should not make a pair much slower than launching it here (goal: at most
1.3x the local pair's wall time, submission and polling included, at the default poll 0.5 s).
A real Slurm on this host (ci/slurm.sh: four fake nodes, needs root and Debian's packages) is
brought up for the run and stopped after it. The variants take turns, `--repeats` rounds, so
that the machine's drifts hit all of them; figures are medians of each variant's wall times
(run_pair without the op trace or report: the runs and the comparison). Exit code 1 if the
goal is not met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.pair import run_pair  # noqa: E402
from parity.spec import JobSpec, PairSpec  # noqa: E402

GOAL = 1.3
DEFAULT_POLL = 0.5


def pair_of(steps: int, launcher: dict | None) -> PairSpec:
    spec = JobSpec(task="charcount-sft", world_size=2, nnodes=2, steps=steps,
                   launcher=launcher)  # fmt: skip
    return PairSpec.from_variants(spec, "legacy", "worker")


def timed(pair: PairSpec, out: Path) -> float:
    start = time.monotonic()
    result = run_pair(pair, out, trace=False, report=False)
    seconds = time.monotonic() - start
    if result.verdict != "aligned":
        raise SystemExit(f"{out}: the pair is {result.verdict}, not aligned: not timed")
    return seconds


def measure(root: Path, steps: int, repeats: int, polls: list[float]) -> dict[str, list[float]]:
    variants = {"local --nnodes 2": None}
    for poll in polls:
        variants[f"slurm poll {poll:g} s"] = {"kind": "slurm", "poll_s": poll}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        for i, (name, launcher) in enumerate(variants.items()):
            out = root / f"{i}-{r}"
            times[name].append(timed(pair_of(steps, launcher), out))
            print(f"{name} {r + 1}/{repeats}: {times[name][-1]:.1f} s", file=sys.stderr)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--polls", default="0.2,0.5,1.0", help="poll intervals (s), comma-separated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    polls = [float(x) for x in args.polls.split(",")]
    if DEFAULT_POLL not in polls:
        polls.append(DEFAULT_POLL)
    with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
        cluster = Path(tmp) / "cluster"
        up = subprocess.run(["bash", str(ROOT / "ci" / "slurm.sh"), "up", str(cluster)],
                            capture_output=True, text=True)  # fmt: skip
        if up.returncode != 0:
            subprocess.run(["bash", str(ROOT / "ci" / "slurm.sh"), "down", str(cluster)])
            print(f"no Slurm here: {up.stderr.strip()}", file=sys.stderr)
            return 2
        os.environ["SLURM_CONF"] = str(cluster / "slurm.conf")
        try:
            times = measure(Path(tmp) / "runs", args.steps, args.repeats, polls)
        finally:
            subprocess.run(["bash", str(ROOT / "ci" / "slurm.sh"), "down", str(cluster)])
    local = statistics.median(times["local --nnodes 2"])
    rows = {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / local,
                   "runs_s": t} for name, t in times.items()}  # fmt: skip
    ratio = rows[f"slurm poll {DEFAULT_POLL:g} s"]["ratio"]
    if args.json:
        print(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": rows,
                          "goal": GOAL, "ratio": ratio}))  # fmt: skip
    else:
        print(
            f"charcount SFT pair, 2 nodes x 1 rank, {args.steps} steps, median of {args.repeats}:"
        )
        for name, row in rows.items():
            print(f"  {name:<22} {row['median_s']:6.1f} s  {row['ratio']:.2f}x")
        verdict = "met" if ratio <= GOAL else "NOT met"
        print(f"slurm (poll {DEFAULT_POLL:g} s) / local: {ratio:.2f}x (goal <= {GOAL}x: {verdict})")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
