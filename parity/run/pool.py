"""A warm pool: one torchrun launch that stays up and runs the jobs handed to it, one at a time.

Why: on 2 CPU cores a launch spends about 10 s before its first step (Python, torch,
transformers, the process group), more than a 20-step job trains; a test session runs dozens of
jobs of the same world size. The pytest plugin sends every job it can through a pool:

    pools = Pools(folder)
    run = pools.run(spec, out)   # a Run, as run_job gives it; None: launch this one alone
    pools.close()

Each job is one side of parity.run.inprocess's `SideRunner` (modules dropped, process state and
flags restored, the job's mutants undone after it), so its metrics are bitwise those of a launch
of its own (tests/run/test_pool.py). Jobs reach the ranks as files in the pool's queue folder:
`job-0000.json`, written atomically, which every rank reads; rank 0 answers `done-0000.json`
after the job's closing barrier. No collective of our own.

A job that fails takes its pool down (a rank that raised cannot be trusted to be in step with the
others): `run` returns None and the caller launches the job alone, which gives the faithful
report; the next job starts a new pool. Ranks exit on their own once the harness process is
gone, so a killed pytest leaves no pool behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from parity.run.job import Run
    from parity.run.launch import LaunchResult
    from parity.spec import JobSpec

POLL_S = 0.02  # how often an idle rank looks for its next job
FOREVER_S = 7 * 24 * 3600.0  # the pool launch's own timeout; each job has its spec's


def _job_file(queue: Path, n: int) -> Path:
    return queue / f"job-{n:04d}.json"


def _done_file(queue: Path, n: int) -> Path:
    return queue / f"done-{n:04d}.json"


# --- harness side ---------------------------------------------------------------------------------


class _Stopped(Exception):
    """Raised from the pool launch's on_tick so that `launch` kills its processes and returns."""


class Pool:
    """One warm launch of `nproc` ranks; `run` hands it a job and waits for that job alone."""

    def __init__(self, folder: Path, nproc: int, torchrun_args: Sequence[str] = ()):
        self.folder = Path(folder).resolve()
        self.queue = self.folder / "queue"
        self.nproc, self.torchrun_args = nproc, list(torchrun_args)
        self.jobs = 0
        self.result: LaunchResult | None = None  # the launch's, once it ended
        self._stop = threading.Event()
        # set when the launch thread is done, cleanup included; waited on instead of
        # Thread.join(timeout), which a Ctrl-C breaks in CPython 3.11 (see launch_nodes)
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self.queue.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._launch, name=f"pool-{nproc}", daemon=True).start()

    def _launch(self) -> None:
        from parity.run.launch import launch

        args = ["-m", "parity.run.pool", "--queue", str(self.queue), "--parent", str(os.getpid())]
        try:
            self.result = launch(
                args,
                nproc=self.nproc,
                run_dir=self.folder,
                timeout_s=FOREVER_S,
                torchrun_args=self.torchrun_args,
                on_tick=self._tick,
                expect_world=self.nproc,
            )
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by `run` as a dead pool
            self._error = e
        finally:
            self._ended.set()

    def _tick(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    @property
    def alive(self) -> bool:
        return not self._ended.is_set() and not self._stop.is_set()

    def run(self, spec: JobSpec, out: Path) -> Run | None:
        """Run `spec` into `out`; None when the pool failed on it or it ran past its timeout
        (the pool is then gone: launch the job alone for its own report)."""
        from parity.files import launch_dir, write_json_atomic
        from parity.outdir import OutDir

        if not self.alive:
            return None
        out = Path(out).resolve()
        with OutDir.open(out.parent) as held:
            held.make_dir(out.name)
            launch_folder = held.make_dir(launch_dir(out).name)
        n, self.jobs = self.jobs, self.jobs + 1
        logs = launch_folder / "logs" / "pool" / "attempt_0"  # torchrun's: <run>/attempt_0/<rank>/
        args = spec.to_args(out)
        write_json_atomic(
            _job_file(self.queue, n), {"module": args[1], "args": args[2:], "logs": str(logs)}
        )
        done, deadline = _done_file(self.queue, n), time.monotonic() + spec.timeout_s
        try:
            while not done.exists():
                if self._ended.is_set():
                    return None
                if time.monotonic() > deadline:
                    self.kill()
                    return None
                time.sleep(POLL_S * 2)
        except BaseException:  # Ctrl-C while the job runs: the pool goes with it, now
            self.kill()
            raise
        return self._read_back(spec, out, n, json.loads(done.read_text()), logs)

    def _read_back(
        self, spec: JobSpec, out: Path, n: int, record: dict[str, Any], logs: Path
    ) -> Run | None:
        from parity.files import launch_dir, write_text_atomic
        from parity.readers import MetricsError, read_metrics
        from parity.run import world
        from parity.run.inprocess import alone_line
        from parity.run.job import Run
        from parity.run.launch import LaunchResult

        if world.judge(self.folder / "world", self.nproc):
            self.kill()  # not the world asked for: no job of it is trusted
            return None
        try:
            metrics = read_metrics(out)
        except MetricsError:
            return None  # a launch of its own says what is wrong with them
        undone = record.get("undone") or []
        lines = [
            alone_line(spec, out),
            f"# ran as job {n} of the warm pool {self.folder / 'launcher.log'}",
            *([f"# mutants undone after it: {', '.join(undone)}"] if undone else []),
        ]
        launcher_log = launch_dir(out) / "launcher.log"
        write_text_atomic(launcher_log, "\n".join(lines) + "\n")
        result = LaunchResult(
            returncode=0,
            timed_out=False,
            duration_s=float(record["seconds"]),
            run_dir=launch_dir(out),
            timeout_s=spec.timeout_s,
            launcher_log=launcher_log,
            rank_logs={r: logs / str(r) / "stderr.log" for r in range(self.nproc)},
        )
        return Run(spec, out, result, metrics, in_process=True)

    def close(self, grace_s: float = 60.0) -> None:
        """Ask the ranks to exit after their current job; kill them if they have not in grace_s."""
        from parity.files import write_json_atomic

        try:
            if not self._ended.is_set():
                write_json_atomic(_job_file(self.queue, self.jobs), {"stop": True})
                self._ended.wait(grace_s)
        finally:  # interrupted (Ctrl-C, SIGTERM, SIGHUP) while waiting: kill the ranks now
            self.kill()

    def kill(self) -> None:
        self._stop.set()
        self._ended.wait()


class Pools:
    """Warm pools by launcher shape (ranks per node, torchrun args): started on first use,
    replaced after a failure, closed together."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._pools: dict[tuple, Pool] = {}
        self._started = 0

    @staticmethod
    def refusal(spec: JobSpec) -> str | None:
        """Why `spec` cannot run in a pool (one line), or None."""
        from parity.run.inprocess import refusal

        return refusal(spec, spec)

    def run(self, spec: JobSpec, out: Path) -> Run | None:
        """The job's Run from a warm pool; None: it cannot run in one, or it failed there."""
        if self.refusal(spec) is not None:
            return None
        key = (spec.nproc_per_node, tuple(spec.torchrun_args))
        pool = self._pools.get(key)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.kill()
            name = f"pool{self._started:02d}-w{spec.nproc_per_node}"
            self._started += 1
            pool = self._pools[key] = Pool(self.folder / name, spec.nproc_per_node,
                                           spec.torchrun_args)  # fmt: skip
        return pool.run(spec, out)

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        try:
            for pool in pools:
                pool.close()
        finally:  # after an interruption, the pools not closed yet are killed at once
            for pool in pools:
                pool.kill()


# --- rank side ------------------------------------------------------------------------------------


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
    path, checked = _job_file(queue, n), time.monotonic()
    while not path.exists():
        time.sleep(POLL_S)
        if time.monotonic() - checked > 1.0:
            if not _harness_alive(parent):
                return None
            checked = time.monotonic()
    return json.loads(path.read_text())


@contextlib.contextmanager
def _logs_to(folder: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2) into folder/std*.log."""
    folder.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(folder / "stdout.log", "ab") as out, open(folder / "stderr.log", "ab") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        except BaseException:
            traceback.print_exc()  # into the job's own log as well as the pool's
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, original in zip((1, 2), saved, strict=True):
                os.dup2(original, fd)
                os.close(original)


def _serve(argv: list[str]) -> int:
    from parity.files import write_json_atomic
    from parity.run.inprocess import SideRunner, finish_distributed

    parser = argparse.ArgumentParser(prog="python -m parity.run.pool")
    parser.add_argument("--queue", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True, help="exit once this pid is gone")
    opts = parser.parse_args(argv)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    runner, n = SideRunner(), 0
    while (job := _next_job(opts.queue, n, opts.parent)) is not None and not job.get("stop"):
        with _logs_to(Path(job["logs"]) / str(local_rank)):
            record = runner.run(job["module"], job["args"])
        if rank == 0:
            write_json_atomic(_done_file(opts.queue, n), record)
        n += 1
    finish_distributed()
    return 0


def main(argv: list[str] | None = None) -> NoReturn:
    """Serve jobs as a torchrun rank until told to stop."""
    from parity.run.inprocess import run_as_rank

    run_as_rank(_serve, argv)


if __name__ == "__main__":
    main()
