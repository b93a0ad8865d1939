"""A warm pool: one torchrun launch that stays up and runs the jobs handed to it, one at a time.

Why: on 2 CPU cores a launch spends about 10 s before its first step (Python, torch,
transformers, the process group), more than a 20-step job trains; a test session runs dozens of
jobs of the same world size. The pytest plugin sends every job it can through a pool:

    pools = Pools(folder)
    run = pools.run(spec, out)   # a Run, as run_job gives it; None: launch this one alone
    pools.close()

Each rank is a warm process (parity.rank.serve, which runs in the user's ranks): torch, numpy
and the jobs' `preload` modules imported once, then a fresh child forked per job, which runs it
as `python -m` would and exits, so nothing of one job reaches the next and its metrics are
bitwise those of a launch of its own (tests/run/test_pool.py). A pool's ranks start before its
jobs are known, so pools are kept by preload list too: a job only ever runs in a pool that
imported its own list, and a module of it that fails to import is raised (SpecError), not
skipped. Jobs reach the ranks as files in the pool's queue folder: `job-0000.json`, written
atomically, which every rank reads; each rank answers `done-0000.rank<R>.json` once its child
ended (the queue's names: parity.rank.serve's).

A job that fails takes its pool down: `run` returns None and the caller launches the job alone,
which gives the faithful report; the next job starts a new pool. Ranks exit on their own once
the harness process is gone, so a killed pytest leaves no pool behind.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.rank.serve import POLL_S, done_file, job_file, job_name

if TYPE_CHECKING:
    from parity.run.job import Run
    from parity.run.launch import LaunchResult
    from parity.spec import JobSpec

FOREVER_S = 7 * 24 * 3600.0  # the pool launch's own timeout; each job has its spec's


class _Stopped(Exception):
    """Raised from the pool launch's on_tick so that `launch` kills its processes and returns."""


class Pool:
    """One warm launch of `nproc` ranks; `run` hands it a job and waits for that job alone."""

    def __init__(
        self,
        folder: Path,
        nproc: int,
        torchrun_args: Sequence[str] = (),
        preload: Sequence[str] = (),
    ):
        self.folder = Path(folder).resolve()
        self.context = context()  # what its ranks start with, and every job of it runs in
        self.queue = self.folder / "queue"
        self.nproc, self.torchrun_args = nproc, list(torchrun_args)
        self.preload = list(preload)  # what its ranks import before forking a job
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
        from parity.run.inprocess import preload_args
        from parity.run.launch import LaunchRequest, launch

        args = ["-m", "parity.rank.serve", "--queue", str(self.queue), "--parent", str(os.getpid())]
        args += preload_args(self.preload)
        try:
            request = LaunchRequest(
                args,
                nproc=self.nproc,
                run_dir=self.folder,
                timeout_s=FOREVER_S,
                torchrun_args=self.torchrun_args,
                on_tick=self._tick,
            )  # each job's world is judged on its own (_read_back)
            self.result = launch(request)
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
        (the pool is then gone: launch the job alone for its own report). SpecError: a module
        of the pool's preload failed to import (a job of another preload: ValueError)."""
        from parity.files import launch_dir, write_json_atomic
        from parity.outdir import OutDir
        from parity.run.inprocess import raise_preload_error

        if list(spec.preload) != self.preload:
            raise ValueError(f"a job of preload {spec.preload} in a pool of {self.preload}")
        if not self.alive:
            raise_preload_error(self.queue)
            return None
        out = Path(out).resolve()
        with OutDir.open(out.parent) as held:
            held.make_dir(out.name)
            launch_folder = held.make_dir(launch_dir(out).name)
        n, self.jobs = self.jobs, self.jobs + 1
        logs = launch_folder / "logs" / "pool" / "attempt_0"  # torchrun's: <run>/attempt_0/<rank>/
        args = spec.to_args(out)
        write_json_atomic(
            job_file(self.queue, n), {"module": args[1], "args": args[2:], "logs": str(logs)}
        )
        records = self._wait(n, time.monotonic() + spec.timeout_s)
        if records is None or any(r["exitcode"] for r in records):
            self.kill()  # its ranks end with the job; launched alone, it gets its own report
            raise_preload_error(self.queue)
            return None
        return self._read_back(spec, out, n, records[0], logs)

    def _wait(self, n: int, deadline: float) -> list[dict[str, Any]] | None:
        """Every rank's record of job n (rank 0's first), once each rank's child ended; None if
        the pool ended first or the job ran past its deadline (the pool is then killed)."""
        done = [done_file(self.queue, n, rank) for rank in range(self.nproc)]
        try:
            while not all(path.exists() for path in done):
                if any(path.exists() and json.loads(path.read_text())["exitcode"] for path in done):
                    break  # failed on one rank: the others will not end it
                if self._ended.is_set():
                    return None
                if time.monotonic() > deadline:
                    self.kill()
                    return None
                time.sleep(POLL_S * 2)
        except BaseException:  # Ctrl-C while the job runs: the pool goes with it, now
            self.kill()
            raise
        return [json.loads(path.read_text()) for path in done if path.exists()]

    def _read_back(
        self, spec: JobSpec, out: Path, n: int, record: dict[str, Any], logs: Path
    ) -> Run | None:
        from parity.files import launch_dir, write_text_atomic
        from parity.readers import MetricsError, read_metrics
        from parity.run import world
        from parity.run.inprocess import alone_line
        from parity.run.job import Run
        from parity.run.launch import LaunchResult

        if world.judge(self.folder / "world" / job_name(n), self.nproc):
            return None  # not the world asked for: launched alone, it is reported
        try:
            metrics = read_metrics(out)
        except MetricsError:
            return None  # a launch of its own says what is wrong with them
        lines = [
            alone_line(spec, out),
            f"# ran as job {n} of the warm pool {self.folder / 'launcher.log'}",
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
                write_json_atomic(job_file(self.queue, self.jobs), {"stop": True})
                self._ended.wait(grace_s)
        finally:  # interrupted (Ctrl-C, SIGTERM, SIGHUP) while waiting: kill the ranks now
            self.kill()

    def kill(self) -> None:
        self._stop.set()
        self._ended.wait()


#: variables that change between tests and that no job reads: not part of a pool's context
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def context() -> tuple:
    """The folder and the environment a launch starts its job in, as a plain launch would now:
    a pool's ranks keep the ones they started with, so a job runs in a pool only while they are
    this process's own (a test's monkeypatch.chdir or setenv starts a new pool)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE))
    return os.getcwd(), env


class Pools:
    """Warm pools by launcher shape (ranks per node, torchrun args) and preload list: started on
    first use, replaced after a failure or once this process's folder or environment is not the
    one the pool started with (``context``), closed together."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._pools: dict[tuple, Pool] = {}
        self._started = 0

    @staticmethod
    def refusal(spec: JobSpec) -> str | None:
        """Why `spec` cannot run in a pool (one line), or None."""
        from parity.run.inprocess import refusal

        if spec.env:  # the pool's ranks started with this process's environment alone
            return "a warm pool runs its jobs in the environment it started with; this job sets env"
        return refusal(spec, spec)

    def run(self, spec: JobSpec, out: Path) -> Run | None:
        """The job's Run from a warm pool; None: it cannot run in one, or it failed there."""
        if self.refusal(spec) is not None:
            return None
        key = (spec.nproc_per_node, tuple(spec.torchrun_args), tuple(spec.preload))
        pool = self._pools.get(key)
        if pool is None or not pool.alive or pool.context != context():
            if pool is not None:
                pool.kill()
            name = f"pool{self._started:02d}-w{spec.nproc_per_node}"
            self._started += 1
            pool = self._pools[key] = Pool(self.folder / name, spec.nproc_per_node,
                                           spec.torchrun_args, spec.preload)  # fmt: skip
        return pool.run(spec, out)

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        try:
            for pool in pools:
                pool.close()
        finally:  # after an interruption, the pools not closed yet are killed at once
            for pool in pools:
                pool.kill()
