"""Soak: many consecutive 2-rank pairs with known answers; any false verdict, failed run or
leftover process fails it.

    python benchmarks/soak.py --pairs 50             # on demand (about 25 s a pair on 2 cores)
    python benchmarks/soak.py --pairs 2 --json       # what the CI test runs

Why: flakes (a rank that aborts at exit 1 time in 8, a port clash, an orphan worker) hide in
single runs. Two of every three pairs are legacy vs worker, which must be "aligned"; the others
(the second, fifth, ...) inject a mutant into side B, which must be "diverged". No launch may
leave a process behind (checked by launch id and by children of this process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from parity.launch import LaunchError, survivors
from parity.pair import run_pair
from parity.signals import Interrupted, cancellable, deferred
from parity.spec import JobSpec, PairSpec

MUTANTS = ("lr-before-step", "loss-summed-over-ranks", "missing-dp-factor")


def plan(i: int, steps: int) -> tuple[PairSpec, str]:
    """Pair number i (from 0) and the verdict it must get."""
    base = JobSpec(world_size=2, steps=steps, timeout_s=300)
    if i % 3 == 1:
        mutant = MUTANTS[(i // 3) % len(MUTANTS)]
        return PairSpec(base, {"trainer": "worker"}, {"trainer": "worker", "inject": [mutant]}), (
            "diverged"
        )
    return PairSpec.from_trainers(base, "legacy", "worker"), "aligned"


def _children() -> list[int]:
    """Live processes whose parent is this one (a launch must not leave any)."""
    me, found = str(os.getpid()), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[1] == me and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def soak(pairs: int, out: Path, steps: int = 3, log=print, records: list | None = None) -> dict:
    """Run ``pairs`` pairs into ``out``; returns the counts and one record per pair (appended to
    ``records`` as each pair ends, if given: what an interruption leaves)."""
    records = [] if records is None else records
    for i in range(pairs):
        pair, expected = plan(i, steps)
        start = time.monotonic()
        launches, record = [], {"pair": i, "expected": expected}
        try:
            result = run_pair(pair, out / f"pair{i:03d}")
            launches = [result.a.launch, result.b.launch]
            record["verdict"] = result.verdict
            if result.teardown:
                record["teardown"] = result.teardown_line()
        except LaunchError as e:
            launches = [e.result]
            record.update(verdict="failed", reason=e.result.reason, error=str(e).splitlines()[0])
        ids = [n.launch_id for r in launches for n in (list(r.nodes.values()) or [r])]
        record["leftovers"] = sorted({p for lid in ids for p in survivors(lid)} | set(_children()))
        record["seconds"] = round(time.monotonic() - start, 1)
        records.append(record)
        flag = "" if record["verdict"] == expected and not record["leftovers"] else "  <-- WRONG"
        log(f"pair {i + 1}/{pairs}: expected {expected}, got {record['verdict']} "
            f"({record['seconds']} s){flag}")  # fmt: skip
    return {
        "pairs": pairs,
        "false_verdicts": sum(r["verdict"] not in (r["expected"], "failed") for r in records),
        "failed": sum(r["verdict"] == "failed" for r in records),
        "leftovers": sum(bool(r["leftovers"]) for r in records),
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=50)
    p.add_argument("--steps", type=int, default=3, help="training steps per job (cheap: 2-3)")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: temp)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        print("soak: error: --pairs and --steps must be >= 1", file=sys.stderr)
        return 2
    # SIGINT, SIGTERM and SIGHUP alike (parity.signals): launches stopped, temp folder removed
    with cancellable() as owner:
        records: list[dict] = []
        out = args.out
        try:
            if out is None:
                with deferred():  # a signal waits for `out`, which the finally then removes
                    out = Path(tempfile.mkdtemp(prefix="parity-soak-"))
            summary = soak(
                args.pairs, out, args.steps, lambda s: print(s, file=sys.stderr), records
            )
        except Interrupted as e:
            if not owner:  # an outer handler reports it
                raise
            where = f"runs in {out}" if args.out else "its temporary runs removed"
            print(f"soak: interrupted by {e.signame} (exit {e.exit_code}) after {len(records)} "
                  f"of {args.pairs} pairs; {where}", file=sys.stderr)  # fmt: skip
            return e.exit_code
        finally:
            if args.out is None and out is not None:
                with deferred():
                    shutil.rmtree(out, ignore_errors=True)
    bad = summary["false_verdicts"] + summary["failed"] + summary["leftovers"]
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"soak: {summary['pairs']} pairs, {summary['false_verdicts']} false verdicts, "
            f"{summary['failed']} failed, {summary['leftovers']} with leftover processes"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
