"""`parity onpolicy`: a PPO run's rollout-vs-trainer log-prob chain (parity.judge.onpolicy)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.cli.common import EXIT_ALIGNED, EXIT_DIVERGED, job_arguments, one_job


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    onpolicy = sub.add_parser(
        "onpolicy",
        help="rollout-vs-trainer log-prob chain of a PPO job: trainer m vs n, trainer vs "
        "rollout prefill, rollout decode vs prefill; names the first link that breaks",
    )
    onpolicy.add_argument(
        "run",
        nargs="?",
        help="a run folder holding the chain (onpolicy/); else the job given "
        "by --spec or --task is run first (a job that writes the chain)",
    )
    onpolicy.add_argument("--out", default="runs/onpolicy", help="run folder of the job it runs")
    job_arguments(onpolicy)
    onpolicy.add_argument(
        "--max-ulp", type=int, default=0, help="float32 ULPs a link may differ by (default 0)"
    )
    onpolicy.add_argument("--json", action="store_true", help="print one JSON object")
    onpolicy.set_defaults(func=run)
    return onpolicy


def run(args: argparse.Namespace) -> int:
    """Judge a PPO run's on-policy chain; without a run folder, run the PPO job first."""
    from parity.judge.onpolicy import judge_chain, load_chain

    folder = Path(args.run) if args.run else _run_job(args)
    result = judge_chain(load_chain(folder), max_ulp=args.max_ulp)
    if args.json:
        print(json.dumps({"run": str(folder), **result.to_dict()}, allow_nan=False))
    else:
        print(result.table())
        print(f"verdict: {result.verdict()}")
    return EXIT_ALIGNED if result.ok else EXIT_DIVERGED


def _run_job(args: argparse.Namespace) -> Path:
    from parity.run.job import run_job

    spec = one_job(args, "onpolicy runs one job")
    out = Path(args.out)
    run_job(spec, out, label=f"onpolicy {spec.variant or spec.task}")
    return out
