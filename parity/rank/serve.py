"""A warm pool's rank: a warm process (parity.rank.warm) that runs the jobs of its queue, one
after the other, each in a fresh child, until told to stop or its harness is gone.

    torchrun ... -m parity.rank.serve --queue DIR --parent PID [--preload M,N]

The harness side (parity.run.pool) writes job n as `job-NNNN.json` in the queue folder
(atomically: {"module", "args", "logs"}, or {"stop": true}); every rank reads it, forks a child
that runs it as `python -m` would (its stdout and stderr into logs/<local rank>/std*.log, its
world records into world/job-NNNN), and answers `done-NNNN.rank<R>.json` (the child's record)
once the child ended. A job that fails on a rank ends that rank, exiting as the job did. The
queue's names are defined here, and the harness takes them from here.

Runs in the user's ranks: standard library, torch (through parity.rank.warm) and parity.record
only (parity.rank).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from parity.rank.warm import preload, run_forked, run_warm
from parity.record.files import write_json_atomic

POLL_S = 0.02  # how often an idle rank looks for its next job


def job_file(queue: Path, n: int) -> Path:
    """Job n as the harness hands it over (or the stop)."""
    return queue / f"job-{n:04d}.json"


def done_file(queue: Path, n: int, rank: int) -> Path:
    """Rank `rank`'s record of job n, written once its child ended."""
    return queue / f"done-{n:04d}.rank{rank}.json"


def job_name(n: int) -> str:
    """Job n's name: its world records' folder (world/job-NNNN) and its rendezvous store's key."""
    return f"job-{n:04d}"


def _harness_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _next_job(queue: Path, n: int, parent: int) -> dict[str, Any] | None:
    """Wait for job n; None once the harness that feeds this pool is gone."""
    path, checked = job_file(queue, n), time.monotonic()
    while not path.exists():
        time.sleep(POLL_S)
        if time.monotonic() - checked > 1.0:
            if not _harness_alive(parent):
                return None
            checked = time.monotonic()
    return json.loads(path.read_text())


def _serve(argv: list[str]) -> int:
    """Fork a child per queued job (parity.rank.warm.run_forked), one after the other; a job
    that fails on this rank ends it, exiting as the job did."""
    parser = argparse.ArgumentParser(prog="python -m parity.rank.serve")
    parser.add_argument("--queue", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True, help="exit once this pid is gone")
    parser.add_argument("--preload", default="", help="modules to import first, comma-separated")
    opts = parser.parse_args(argv)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    preload([name for name in opts.preload.split(",") if name], opts.queue)
    n = 0
    while (job := _next_job(opts.queue, n, opts.parent)) is not None and not job.get("stop"):
        logs = Path(job["logs"]) / str(local_rank)
        record = run_forked(job["module"], job["args"], job_name(n), logs)
        write_json_atomic(done_file(opts.queue, n, rank), record)
        if record["exitcode"]:
            return record["exitcode"]
        n += 1
    return 0


def main(argv: list[str] | None = None) -> None:
    """Serve jobs as a torchrun rank until told to stop."""
    run_warm(_serve, argv)


if __name__ == "__main__":
    main()
