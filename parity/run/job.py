"""Run one job under torchrun and read back what it wrote (the running layer; a matched pair
of jobs is parity.pair).

A run folder holds only what the job wrote (metrics.jsonl, console.log, manifest.json); what the
launcher captured (launcher.log, logs/ per rank, world/: the process group each rank joined) lies
beside it in RUN.launch/.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from parity.files import REPRODUCE_FILE, launch_dir, open_regular, write_json_atomic
from parity.outdir import OutDir
from parity.readers import FORMATS, MetricsError, detect, read_metrics
from parity.record.runfolder import METRICS, manifest_path, metrics_path
from parity.run import world
from parity.run.early import EarlyStop
from parity.run.launch import (
    Launcher,
    LaunchError,
    LaunchRequest,
    LaunchResult,
    launch,
    launch_nodes,
    launch_plain,
    node_rdzv_args,
    plain_command,
    reproduce_line,
    torchrun_command,
)
from parity.run.stall import StallWatch
from parity.spec import JobSpec


@dataclass
class Run:
    spec: JobSpec
    dir: Path
    launch: LaunchResult
    metrics: pd.DataFrame
    in_process: bool = False  # ran in one launch with the other side (parity.run.inprocess)
    #: the step after which it was stopped as it diverged (parity.run.early); its metrics end
    #: there. None: it ran to its end
    stopped_at: int | None = None

    @property
    def manifest(self) -> dict:
        path = manifest_path(self.dir)
        return json.loads(path.read_text()) if path.exists() else {}


def steps_logged(metrics_file: Path) -> int:
    """How many steps a running job has written so far (for progress, not for results): the
    distinct steps of its records, a step logged in two calls once."""
    try:
        with open_regular(metrics_file) as f:
            return len({m[1] for line in f if (m := _STEP.match(line))})
    except OSError:
        return 0


_STEP = re.compile(rb'\{"step": ?(-?\d+)')


class Progress:
    """A side's steps as the job writes them, so that a long run never looks hung: a tqdm bar on a
    terminal; elsewhere (CI logs, a pipe) a line on stderr when the count moved, at most every
    ``every_s`` seconds, and one at the start and the end. enabled=False: silent."""

    def __init__(
        self,
        label: str,
        total: int,
        metrics_file: Path,
        enabled: bool | None = None,
        every_s: float = 10.0,
    ):
        self.label, self.total, self.metrics_file = label, total, metrics_file
        self.bar = None
        self.lines = False
        self.every_s = every_s
        self.start = self.shown_at = time.monotonic()
        self.shown = 0
        terminal = sys.stderr.isatty() and not os.environ.get("CI")
        if enabled is None:
            enabled, self.lines = terminal, not terminal
        if enabled:
            from tqdm import tqdm

            width = shutil.get_terminal_size((100, 20)).columns or 100  # 0 under some ptys
            self.bar = tqdm(
                total=total, desc=label, unit="step", file=sys.stderr, leave=True, ncols=width
            )
        elif self.lines:
            self._say("started")

    def _say(self, what: str) -> None:
        print(f"parity: {self.label}: {what}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(steps_logged(self.metrics_file) - self.bar.n)
        elif self.lines and time.monotonic() - self.shown_at >= self.every_s:
            self.shown_at = time.monotonic()
            steps = steps_logged(self.metrics_file)
            seconds = round(self.shown_at - self.start)
            if steps != self.shown:
                self._say(f"step {steps}/{self.total} ({seconds} s)")
            else:
                self._say(f"running ({seconds} s, {steps} steps written)")
            self.shown = steps

    def close(self, interrupted: bool = False) -> None:
        """End the display; interrupted: no closing line (the command's own says what
        happened, in one line)."""
        if self.bar is not None:
            self.tick()
            self.bar.close()
        elif self.lines and not interrupted:
            steps = steps_logged(self.metrics_file)
            self._say(f"ended after {time.monotonic() - self.start:.0f} s ({steps} steps written)")


def mark_teardown(result: LaunchResult, metrics_file: Path, since: float) -> pd.DataFrame | None:
    """For a failed launch: if ``metrics_file`` was written during it (mtime after ``since``) and
    has its end record, mark the result a teardown failure and return the metrics, else None.

    Why: the end record is written after the last training collective, so a crash after it is
    one of teardown, and the metrics are whole; anything else is a real failure.
    """
    if result.ok or result.fault:  # a run of the wrong world is never compared
        return None
    if not metrics_file.is_file():  # none, or no regular file (a FIFO: a read would wait)
        return None
    try:
        if metrics_file.stat().st_mtime < since - 1.0:  # a stale file from an earlier run
            return None
        metrics = read_metrics(metrics_file)
    except (OSError, MetricsError):
        return None
    if metrics.attrs.get("complete") is not True:
        return None
    result.output_complete = True
    return metrics


def end_record_written(metrics_file: Path, since: float) -> bool:
    """Whether ``metrics_file`` ends with its end record, written after ``since`` (cheap: the
    last bytes only, polled while a job runs)."""
    try:
        if metrics_file.stat().st_mtime < since - 1.0:
            return False
        with open_regular(metrics_file) as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256))
            last = f.read().rstrip().rsplit(b"\n", 1)[-1]
    except OSError:
        return False
    return last.startswith(b'{"event": "end"')


def launcher_for(spec: JobSpec) -> Launcher:
    """The launcher of ``spec`` (parity.run.launch.Launcher): one torchrun here, one per node here
    (a c10d rendezvous on 127.0.0.1), or Slurm steps (parity.run.slurm, ``spec.launcher``); a job
    that is not distributed runs here as one plain process (``launch_plain``: no torch needed)."""
    if spec.launcher.kind == "slurm":
        from parity.run import slurm

        return functools.partial(slurm.launch, launcher=spec.launcher, nnodes=spec.nnodes)
    if not spec.distributed:
        return launch_plain
    if spec.nnodes > 1:
        join_s = _join_timeout(spec)
        return functools.partial(launch_nodes, nnodes=spec.nnodes, join_timeout_s=join_s)
    return launch


def _join_timeout(spec: JobSpec) -> float:
    """How long the nodes of a several-node job here wait for each other to join."""
    return min(60.0, spec.timeout_s)


def launch_spec(
    spec: JobSpec,
    out: Path,
    label: str,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    exit_grace_s: float = 60.0,
    origin: Mapping[str, Any] | None = None,
    early: EarlyStop | None = None,
) -> LaunchResult:
    """Launch ``spec`` with ``out`` as its output folder: the one way every job is started.

    ``out`` and its launch folder (parity.files.launch_dir: launcher.log, rank logs, the world
    records) are made new and empty; either already there is refused, never removed
    (parity.outdir). The job runs with the spec's env (then ``env``: PYTHONPATH for a worktree),
    one torchrun per node, on this machine or, with a Slurm launcher (``spec.launcher``), as a
    step of the held allocation (``holding``; parity.run.slurm); where they ran is written as the
    launch folder's topology.json. A job whose ranks did not form one group of
    ``spec.world_size`` (``expect_world``), or one that exited 0 having written nothing at all,
    is failed.
    The folder it ran in (and ``origin``: the temporary worktree it was, for check and bisect)
    goes to the launch folder's reproduce.json, for the report's commands to rerun it later.
    ``early``: judged as it writes its steps (parity.run.early: it follows out's metrics.jsonl)
    and stopped as soon as it diverges (the result's ``stopped_early``), on this machine's
    one-node launchers; elsewhere it runs to its end.
    """
    out = Path(out).resolve()
    if early is not None and not early_stoppable(spec):
        early = None
    with OutDir.open(out.parent) as held:
        held.make_dir(out.name)
        logs = held.make_dir(launch_dir(out).name)
        progress = Progress(label, spec.steps, metrics_path(out))
        since = time.time()
        on_tick = progress.tick
        if spec.launcher.kind != "slurm":  # Slurm: the timeout alone (docs/clusters.md)
            ranks = expect_world(spec)
            used = (lambda: world.used(logs / "world")) if ranks and ranks > 1 else None
            on_tick = _watching(progress, StallWatch(metrics_path(out), spec.stall), early, used)
        request = LaunchRequest(
            spec.to_args(out),
            nproc=spec.nproc_per_node,
            run_dir=logs,
            timeout_s=spec.timeout_s,
            env={**spec.env, **(env or {})},
            torchrun_args=spec.torchrun_args,
            cwd=cwd,
            on_tick=on_tick,
            finished=lambda: end_record_written(metrics_path(out), since),
            exit_grace_s=exit_grace_s,
            expect_world=expect_world(spec),
            label=label,
        )
        try:
            result = launcher_for(spec)(request)
        except BaseException:
            progress.close(interrupted=True)
            raise
        progress.close()
        if not result.topology:  # this machine: every node rank on it
            result.topology = {"launcher": "local", "nodes": [socket.gethostname()] * spec.nnodes,
                               "nproc_per_node": spec.nproc_per_node}  # fmt: skip
        write_json_atomic(logs / "topology.json", result.topology)
        ran_in = {"cwd": str(Path(cwd or Path.cwd()).absolute()), **(origin or {})}
        write_json_atomic(logs / REPRODUCE_FILE, ran_in)
    result.started_at = since
    if result.ok and not any(out.iterdir()):
        result.set_fault("no-output", no_run_line(out, "nothing"))
    return result


def expect_world(spec: JobSpec) -> int | None:
    """The ranks that must form one group in ``spec``'s launch: its world_size, for a plain job
    (``distributed = false``) too when it starts ranks of its own (world_size > 1: Ray's workers,
    say); None for a plain job of one process, which forms no group."""
    return spec.world_size if spec.distributed or spec.world_size > 1 else None


def _watching(
    progress: Progress,
    watch: StallWatch,
    early: EarlyStop | None = None,
    world_used: Callable[[], bool] | None = None,
) -> Callable[[], None]:
    """The launch's on_tick: the progress display, then the stall check (which raises
    parity.run.stall.Stalled; the launcher then takes each rank's stack and kills the job),
    then the early stop's judgement (parity.run.early.Diverging: the launcher stops the job),
    once ``world_used`` says the ranks' group carried a collective (parity.run.world.used):
    a run whose ranks each train alone runs to its end and fails the world check, never
    stopped as diverged."""
    proven = world_used is None

    def tick() -> None:
        nonlocal proven
        progress.tick()
        watch.check()
        if early is not None:
            proven = proven or world_used()
            if proven:
                early.check()

    return tick


def early_stoppable(spec: JobSpec) -> bool:
    """Whether ``spec``'s launches can be stopped at a divergence: one node on this machine
    (Slurm's and several nodes' launches run to their end)."""
    return spec.launcher.kind != "slurm" and spec.nnodes == 1


def stopped_run(spec: JobSpec, out: Path, result: LaunchResult, early: EarlyStop) -> Run:
    """The Run of a launch stopped as it diverged: its metrics up to the step judged."""
    assert early.frame is not None and early.step is not None
    return Run(spec, Path(out).resolve(), result, early.frame, stopped_at=early.step)


ALLOCATION = "allocation"  # the folder of a pair's (check's, bisect's) one Slurm allocation


@contextlib.contextmanager
def holding(spec: JobSpec, held: OutDir) -> Iterator[Path | None]:
    """Every launch of ``spec``'s launcher inside the block shares one allocation (Slurm: the
    sides of a pair, check's revisions, bisect's probes, on the same nodes), kept in the
    folder ``allocation`` of ``held``, which is yielded: it is on the file system the nodes
    share, where check and bisect put their worktrees. None (and nothing held) for a local
    launcher; a parallel one gets the folder but each launch its own job."""
    if spec.launcher.kind != "slurm":
        yield None
        return
    from parity.run import slurm

    folder = held.make_dir(ALLOCATION)
    if spec.launcher.parallel:
        yield folder
        return
    with slurm.hold(spec.launcher, spec.launcher.nodes or spec.nnodes, folder):
        yield folder


def run_job(
    spec: JobSpec,
    out: Path,
    label: str | None = None,
    *,
    allow_teardown_failure: bool = False,
    exit_grace_s: float = 60.0,
    early: EarlyStop | None = None,
) -> Run:
    """Launch one job (``launch_spec``); raise LaunchError (rank, exit code or signal, log
    tail; or the world its ranks formed instead) if it failed, its message led by ``label``
    when one is given (a pair's "side b").

    A job that failed only at teardown (metrics complete, see ``mark_teardown``) raises too, with
    ``reason`` teardown-crash/-hang; with allow_teardown_failure its Run is returned instead,
    ``run.launch.ok`` False, so that the metrics can still be compared. A job still running
    ``exit_grace_s`` after its end record is killed as hung at exit (teardown-hang) rather than
    left to its timeout. ``spec.nnodes`` > 1 runs every node's torchrun on this machine
    (``launch_nodes``). ``early``: stopped as soon as it diverges (``launch_spec``); its Run
    then holds the steps judged, ``stopped_at`` the last.
    """
    out = Path(out).resolve()
    result = launch_spec(spec, out, label or out.name, exit_grace_s=exit_grace_s, early=early)
    if result.stopped_early and early is not None and not result.fault:  # a wrong world fails
        return stopped_run(spec, out, result, early)
    if not result.ok:
        metrics = mark_teardown(result, metrics_path(out), result.started_at)
        if metrics is None or not allow_teardown_failure:
            raise LaunchError(result, label or "")
        return Run(spec, out, result, metrics)
    return Run(spec, out, result, read_output(result, out, label or ""))


def read_output(result: LaunchResult, out: Path, label: str, **read: Any) -> pd.DataFrame:
    """The metrics a successful launch wrote into ``out``; a folder with nothing readable fails
    the launch (LaunchError, reason no-output), since the job did not give what it was run for."""
    try:
        return read_metrics(out, **read)
    except MetricsError:
        if detected(out):
            raise  # the job's output is there, but damaged: bad input, said as such
        result.set_fault("no-output", no_run_line(out))
        raise LaunchError(result, label) from None


def launch_line(spec: JobSpec, out: Path) -> str:
    """The shell line ``spec`` is launched with into ``out``, as launcher.log's first line will
    say it (env overrides first, secrets masked), without running anything: for `parity spec
    --command`. Its argv comes from the builders ``launch``, ``launch_plain`` and
    ``launch_nodes`` run (parity.run.launch), so it cannot drift from them. Several nodes: node
    0's torchrun, PORT and RDZV_ID for the rendezvous made at launch; Slurm runs the same job
    in its steps."""
    args = spec.to_args(out)
    if not spec.distributed:
        return reproduce_line(plain_command(args), spec.env)
    run_dir, rdzv = launch_dir(out), []
    if spec.nnodes > 1:
        run_dir = run_dir / "node0"
        rdzv = node_rdzv_args(spec.nnodes, 0, "127.0.0.1:PORT", "RDZV_ID", _join_timeout(spec))
    torchrun_args = [*rdzv, *spec.torchrun_args]
    cmd = torchrun_command(args, spec.nproc_per_node, run_dir / "logs", torchrun_args)
    return reproduce_line(cmd, spec.env)


def no_run_line(out: Path, what: str = "no run this tool reads") -> str:
    """The one line of a job that exited 0 without the run it was launched for: where the
    harness looked and what it would have read there."""
    return (
        f"the job exited 0 but wrote {what} in {out}: the harness reads {METRICS} there "
        "(parity.record's record_run(out) writes it) or a log in a format docs/logs.md lists "
        f"({', '.join(FORMATS)}; the spec's [read] format); the job must write into the folder "
        "its command's {out} names"
    )


def detected(out: Path) -> bool:
    """Whether some reader claims ``out`` (it holds a run in a known format)."""
    try:
        detect(out)
    except MetricsError:
        return False
    return True
