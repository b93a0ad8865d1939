"""`parity bisect`: the first commit whose run diverges from a good one's (parity.bisect)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.cli.common import (
    EXIT_ALIGNED,
    EXIT_DIVERGED,
    carry,
    job_arguments,
    one_job,
    policies,
    read_options,
    revision_arguments,
    store,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bis = sub.add_parser(
        "bisect", help="git bisect driven by the harness: the first commit whose run diverges"
    )
    bis.add_argument("--good", required=True, help="revision whose run is the reference")
    bis.add_argument("--bad", required=True, help="a later revision whose run diverges")
    job_arguments(bis)
    bis.add_argument("--out", default="runs/bisect", help="reference, tested runs, bisect.json")
    revision_arguments(bis, "the good revision and every commit")
    bis.set_defaults(func=run)
    return bis


def run(args: argparse.Namespace) -> int:
    from parity.bisect import bisect

    judged, read = policies(args), read_options(args)
    job = one_job(args, "bisect runs one job spec")
    result = bisect(
        job, args.good, args.bad, Path(args.out), policies=judged, read=read, carry=carry(args),
        store=store(args.store), fresh=args.fresh, run_out=args.run_out,
    )  # fmt: skip
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(result.text())
        print(result.verdict_line())
    return EXIT_ALIGNED if result.verdict == "aligned" else EXIT_DIVERGED
