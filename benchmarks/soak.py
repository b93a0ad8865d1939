"""Soak: many consecutive 2-rank pairs with known answers; any false verdict, failed run or
leftover process fails it.

    python benchmarks/soak.py --pairs 50             # on demand (about 25 s a pair on 2 cores)
    python benchmarks/soak.py --pairs 2 --json       # what the CI test runs
    python benchmarks/soak.py --pairs 6 --reuse --contend   # one --out for all, a rival command

--reuse runs every pair into the same folder: a rerun there must be refused before anything
runs (exit 2) with the earlier results kept (parity.outdir never deletes), which the soak then
moves aside, as a user would, for the next pair; --contend starts a second `parity pair` on
that folder while each pair runs, which must be refused (exit 2, naming this process). Beside
the pairs, a file of the user's in --out and a folder outside it, linked from --out, must come
out untouched.

Why: flakes (a rank that aborts at exit 1 time in 8, a port clash, an orphan worker) hide in
single runs. Two of every three pairs are legacy vs worker, which must be "aligned"; the others
(the second, fifth, ...) inject a mutant into side B, which must be "diverged". No launch may
leave a process behind (checked by launch id and by children of this process).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from parity.outdir import LEDGER_DIR, OutputError
from parity.pair import run_pair
from parity.run.launch import LaunchError, survivors
from parity.run.signals import Interrupted, cancellable, deferred
from parity.spec import JobSpec, PairSpec

MUTANTS = ("lr-before-step", "loss-summed-over-ranks", "missing-dp-factor")


def plan(i: int, steps: int) -> tuple[PairSpec, str]:
    """Pair number i (from 0) and the verdict it must get."""
    base = JobSpec(task="charcount-sft", world_size=2, steps=steps, timeout_s=300)
    if i % 3 == 1:
        mutant = MUTANTS[(i // 3) % len(MUTANTS)]
        return PairSpec(base, {"trainer": "worker"}, {"trainer": "worker", "inject": [mutant]}), (
            "diverged"
        )
    return PairSpec.from_variants(base, "legacy", "worker"), "aligned"


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


def _held(folder: Path) -> bool:
    """Whether some command holds ``folder`` (parity.outdir's lock) right now."""
    try:
        fd = os.open(folder / LEDGER_DIR / "lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _contend(folder: Path, done: threading.Event, record: dict) -> None:
    """Once ``folder`` is held, run a second `parity pair` on it; it must be refused (exit 2,
    naming this process as the holder)."""
    while not _held(folder):
        if done.wait(0.05):
            record["contended"] = "never held"
            return
    cmd = [sys.executable, "-m", "parity.cli", "pair", "--task", "charcount-sft",
           "--world", "1", "--steps", "1",
           "--timeout", "5", "--out", str(folder)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    refused = proc.returncode == 2 and f"in use by pid {os.getpid()}" in proc.stderr
    record["contended"] = "refused" if refused else f"exit {proc.returncode}: {proc.stderr[-200:]}"


def _rerun(pair: PairSpec, folder: Path, aside: Path) -> str:
    """A pair into ``folder``, which holds the previous pair: "refused" when it is refused with
    every file kept; then the previous pair is moved to ``aside``."""
    before = sorted((p, p.stat().st_size) for p in folder.rglob("*") if p.is_file())
    try:
        run_pair(pair, folder, trace=False, report=False)
        outcome = "ran"
    except OutputError:
        outcome = "refused"
    after = sorted((p, p.stat().st_size) for p in folder.rglob("*") if p.is_file())
    folder.rename(aside)
    return outcome if before == after else f"{outcome}, files changed"


def _canary(out: Path) -> tuple[Path, Path]:
    """A file of the user's in ``out`` and a folder outside it linked from ``out``."""
    outside = Path(tempfile.mkdtemp(prefix="parity-soak-outside-"))
    (outside / "keep.txt").write_text("the user's\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.txt").write_text("the user's notes\n")
    (out / "outside").symlink_to(outside)
    return out / "notes.txt", outside


def _untouched(notes: Path, outside: Path) -> bool:
    try:
        return (
            notes.read_text() == "the user's notes\n"
            and sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
            and (outside / "keep.txt").read_text() == "the user's\n"
        )
    except OSError:
        return False


def soak(
    pairs: int,
    out: Path,
    steps: int = 3,
    log=print,
    records: list | None = None,
    *,
    reuse: bool = False,
    contend: bool = False,
) -> dict:
    """Run ``pairs`` pairs into ``out``; returns the counts and one record per pair (appended to
    ``records`` as each pair ends, if given: what an interruption leaves). reuse: every pair
    into one folder; contend: a rival command on it during each pair."""
    records = [] if records is None else records
    notes, outside = _canary(out)
    try:
        summary = _soak(pairs, out, steps, log, records, reuse, contend)
        summary["outside_touched"] = not _untouched(notes, outside)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    return summary


def _soak(
    pairs: int, out: Path, steps: int, log, records: list, reuse: bool, contend: bool
) -> dict:
    for i in range(pairs):
        pair, expected = plan(i, steps)
        start = time.monotonic()
        launches, record = [], {"pair": i, "expected": expected}
        folder = out / ("pair" if reuse else f"pair{i:03d}")
        if reuse and i:
            record["rerun"] = _rerun(pair, folder, out / f"pair{i - 1:03d}")
        done = threading.Event()
        rival = threading.Thread(target=_contend, args=(folder, done, record), daemon=True)
        if contend:
            rival.start()
        try:
            result = run_pair(pair, folder, trace=False, report=False)  # timings as before
            launches = [result.a.launch, result.b.launch]
            record["verdict"] = result.verdict
            if result.teardown:
                record["teardown"] = result.teardown_line()
        except LaunchError as e:
            launches = [e.result]
            record.update(verdict="failed", reason=e.result.reason, error=str(e).splitlines()[0])
        finally:
            done.set()
            if contend:
                rival.join()
        ids = [n.launch_id for r in launches for n in (list(r.nodes.values()) or [r])]
        record["leftovers"] = sorted({p for lid in ids for p in survivors(lid)} | set(_children()))
        record["seconds"] = round(time.monotonic() - start, 1)
        records.append(record)
        wrong = record["verdict"] != expected or record["leftovers"]
        flag = "  <-- WRONG" if wrong or record.get("contended", "refused") != "refused" else ""
        log(f"pair {i + 1}/{pairs}: expected {expected}, got {record['verdict']} "
            f"({record['seconds']} s){flag}")  # fmt: skip
    return {
        "pairs": pairs,
        "false_verdicts": sum(r["verdict"] not in (r["expected"], "failed") for r in records),
        "failed": sum(r["verdict"] == "failed" for r in records),
        "leftovers": sum(bool(r["leftovers"]) for r in records),
        "not_refused": sum(
            r.get(k, "refused") != "refused" for r in records for k in ("contended", "rerun")
        ),
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=50)
    p.add_argument("--steps", type=int, default=3, help="training steps per job (cheap: 2-3)")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: temp)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--reuse", action="store_true", help="every pair into one folder")
    p.add_argument(
        "--contend", action="store_true", help="a second command on the folder during each pair"
    )
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        print("soak: error: --pairs and --steps must be >= 1", file=sys.stderr)
        return 2
    # SIGINT, SIGTERM and SIGHUP alike (parity.run.signals): launches stopped, temp folder removed
    with cancellable() as owner:
        records: list[dict] = []
        out = args.out
        try:
            if out is None:
                with deferred():  # a signal waits for `out`, which the finally then removes
                    out = Path(tempfile.mkdtemp(prefix="parity-soak-"))
            summary = soak(
                args.pairs, out, args.steps, lambda s: print(s, file=sys.stderr), records,
                reuse=args.reuse, contend=args.contend,
            )  # fmt: skip
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
    bad += summary["not_refused"] + summary["outside_touched"]
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"soak: {summary['pairs']} pairs, {summary['false_verdicts']} false verdicts, "
            f"{summary['failed']} failed, {summary['leftovers']} with leftover processes, "
            f"{summary['not_refused']} rival commands not refused, outside --out "
            f"{'TOUCHED' if summary['outside_touched'] else 'untouched'}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
