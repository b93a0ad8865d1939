"""Run a job under torchrun as a subprocess, never leave processes behind, and say which rank died.
A job that is not distributed runs as one plain process instead (``launch_plain``), supervised
the same way.

torchrun (torch 2.13) starts every worker with ``start_new_session=True``, so workers are *not* in
torchrun's process group. Killing the group alone would orphan them when torchrun itself is
SIGKILLed; every process of a launch therefore also carries ``PARITY_LAUNCH_ID`` in its
environment, and cleanup kills whatever still carries it.

A job never outlives the harness, SIGKILL of the harness included: the process it starts
(torchrun, or the plain job) is SIGKILLed by the kernel when the harness dies (PR_SET_PDEATHSIG),
torchrun's ranks when torchrun dies (the start-up hook, parity/run/sitehook), and a watchdog
process per launch (parity/run/watchdog.py) kills, when the harness ends, every process of the
launch it saw: those carrying the launch id and every descendant, a helper started with an empty
environment in a session of its own included.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from parity.run import stacks, world
from parity.run.signals import deferred, parent_death_signal
from parity.run.stall import Stalled
from parity.spec import masked_env

LAUNCH_ID_ENV = "PARITY_LAUNCH_ID"
#: what the start-up hook sets in a launch's processes (its torchrun's pid, a rank's child): not
#: passed on from a harness that itself runs inside a launch
_HOOK_STATE_ENV = ("PARITY_LAUNCHER_PID", "PARITY_WORLD_CHILD")
_WATCHDOG = Path(__file__).resolve().parent / "watchdog.py"

# torchrun arguments that configure a (multi-node) rendezvous: with these, no --standalone.
_RDZV_FLAGS = (
    "--standalone",
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--master-port",
    "--master_port",
    "--master-addr",
    "--master_addr",
)

# Log lines of a rank that died only because a peer died first (gloo / nccl / torchrun teardown).
_SECONDARY_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
)

# One entry of torchrun's ChildFailedError summary:
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 3794)  (SIGKILL)
_FAILURE_RE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)
# torchrun's agent log line, used when no summary was printed:
#   failed (exitcode: 1) local_rank: 1 (pid: 3570) of binary: ...
_AGENT_FAIL_RE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)"
)
_ROOT_MARK = "Root Cause (first observed failure):"
# argparse's last line when a job refuses its command line (exit code 2, after the usage):
#   python -m worker.sft: error: unrecognized arguments: --val-sampels 3
_ARGPARSE_ERROR = re.compile(r"^\S.*?: error: (?P<message>.+)$")


@dataclass
class RankFailure:
    """One rank that exited non-zero; ``signal`` is set when it was killed by a signal."""

    rank: int
    exitcode: int | None
    signal: str | None
    log_tail: str
    local_rank: int | None = None
    #: the node it ran on (a Slurm node's name), '' when the launch was on this machine
    host: str = ""
    #: set (rank -1) when a node's torchrun itself died, not one of its ranks
    node: int | None = None

    def headline(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"
        where = f" on {self.host}" if self.host else ""
        if self.rank < 0 and self.node is not None:
            return f"node {self.node}{where}: torchrun {how}"
        return f"rank {self.rank}{where}: {how}"


@dataclass
class LaunchResult:
    """What happened to one torchrun launch; ``describe()`` is the human-readable report."""

    returncode: int | None
    timed_out: bool
    duration_s: float
    run_dir: Path
    timeout_s: float = 0.0
    launcher_log: Path | None = None
    launch_id: str = ""
    #: local rank -> that rank's stderr.log (stdout.log lies next to it). Equal to the global rank
    #: for single-node jobs.
    rank_logs: dict[int, Path] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    #: Set by the caller when the job's own output is complete (metrics.jsonl has its end record,
    #: written during this launch): a failure is then one of teardown, after training finished.
    output_complete: bool = False
    #: Multi-node launches (``launch_nodes``): one result per node launcher started here.
    nodes: dict[int, LaunchResult] = field(default_factory=dict)
    #: Why the launch failed beyond the ranks' own reports (e.g. a node that never joined).
    note: str = ""
    #: Why the launch is failed although its ranks exited 0: the world they formed instead of
    #: the one asked for (parity.run.world), or output the job did not write; '' when none.
    fault: str = ""
    #: One word for that fault: "world" or "no-output".
    fault_kind: str = ""
    #: time.time() when the launch started (files older than this are not its output).
    started_at: float = 0.0
    #: The ranks' records of the process group each joined (parity.run.world).
    world_dir: Path | None = None
    #: Where the ranks ran: launcher ("local", "slurm"), node names by node rank, ranks per
    #: node, and with Slurm the job id and its variables (written as topology.json).
    topology: dict = field(default_factory=dict)
    #: what was started, as the report names it
    started_as: str = "torchrun job"
    #: set when the job was stopped as hung: how long it went without a new step
    stalled: str = ""
    #: where each rank waited when it was stopped (stall or timeout; parity.run.stacks), and
    #: the files that hold each rank's whole stacks
    stacks: str = ""
    stack_files: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.fault and not self.stalled

    @property
    def reason(self) -> str:
        """One word for JSON and reports: ok, teardown-crash, teardown-hang, stall (no new step
        for the job's stall time), timeout, crash.

        teardown-*: the output is complete (training finished), then a rank crashed or hung at
        exit. The metrics can be trusted, the process exit cannot; it is never reported as ok.
        """
        if self.ok:
            return "ok"
        if self.fault and self.returncode == 0 and not self.timed_out:
            return self.fault_kind
        if self.output_complete:
            return "teardown-hang" if self.timed_out else "teardown-crash"
        if self.stalled:
            return "stall"
        return "timeout" if self.timed_out else "crash"

    def set_fault(self, kind: str, line: str) -> None:
        """Fail this launch for ``line`` (a no-op when it is ''); the first fault stays."""
        if line and not self.fault:
            self.fault, self.fault_kind = line, kind

    @property
    def refused_arguments(self) -> str | None:
        """argparse's message when the job refused its command line (exit code 2 after a usage
        line, e.g. "unrecognized arguments: --val-sampels 3"): bad input, not a crash."""
        if self.ok or not self.failures or self.failures[0].exitcode != 2:
            return None
        tail = self.failures[0].log_tail
        lines = [line for line in tail.splitlines() if line.strip()]
        m = _ARGPARSE_ERROR.match(lines[-1]) if lines else None
        return m["message"] if m and "usage:" in tail else None

    def to_dict(self) -> dict:
        """JSON-able summary: reason, exit code, and each failing rank with its signal."""
        return {
            "reason": self.reason,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "run_dir": str(self.run_dir),
            "failures": [
                {
                    "rank": f.rank,
                    "exitcode": f.exitcode,
                    "signal": f.signal,
                    **({"host": f.host} if f.host else {}),
                }
                for f in self.failures
            ],  # fmt: skip
            **({"note": self.note} if self.note else {}),
            **({"fault": self.fault} if self.fault else {}),
            **({"stall": self.stalled} if self.stalled else {}),
            **({"stacks": self.stacks} if self.stacks else {}),
            **({"stack_files": [str(p) for p in self.stack_files]} if self.stack_files else {}),
        }

    def tail(self, rank: int, n_lines: int = 30) -> str:
        """Last lines of a rank's stdout and stderr (by local rank), or '' if it has no logs."""
        err = self.rank_logs.get(rank)
        if err is None:
            return ""
        parts = []
        for path in (err.with_name("stdout.log"), err):
            text = tail_file(path, n_lines)
            if text:
                parts.append(f"[{path.name}]\n{text}")
        return "\n".join(parts)

    def stack_lines(self) -> list[str]:
        """Where each rank waited when it was stopped, and the files with the whole stacks."""
        if not self.stacks:
            return []
        files = ", ".join(str(p) for p in self.stack_files)
        return [self.stacks, f"stacks: {files}"] if files else [self.stacks]

    def describe(self, n_lines: int = 30) -> str:
        """A multi-line report: outcome, failing ranks with exit code or signal, and log tails."""
        where = f"run dir {self.run_dir}"
        if self.ok:
            return f"{self.started_as} succeeded in {self.duration_s:.1f} s ({where})"
        if self.reason == self.fault_kind and self.fault:  # ranks exited 0, yet it failed
            return f"{self.fault} (launch logs: {self.run_dir})"
        lines: list[str] = []
        refused = self.refused_arguments  # bad input: say so before the rank details
        if refused is not None:
            lines.append(f"the job refused its arguments: {refused}")
        if self.output_complete:
            how = "hung" if self.timed_out else "crashed"
            first = f" ({self.failures[0].headline()})" if self.failures else ""
            lines.append(
                f"teardown failure: training finished and its metrics are complete (end record "
                f"written), then the job {how} at exit{first}"
            )
        if self.note:
            lines.append(self.note)
        if self.nodes:
            state = "timed out" if self.timed_out else f"failed with exit code {self.returncode}"
            lines.append(f"{len(self.nodes)}-node torchrun job {state} ({where})")
            if self.stalled:
                lines.append(f"stalled: {self.stalled}")
            lines += self.stack_lines()
            if self.failures:
                lines.append(f"first failure: {self.failures[0].headline()}")
            for node, result in sorted(self.nodes.items()):
                lines += [f"--- node {node} ---", _indent(result.describe(n_lines))]
            return "\n".join(lines)
        if self.stalled or self.timed_out:
            lines.append(
                f"{self.started_as} stalled: {self.stalled}; killed as hung after "
                f"{self.duration_s:.1f} s ({where})"
                if self.stalled
                else f"{self.started_as} timed out after {self.timeout_s:g} s and was killed "
                f"({where})"
            )
            lines += self.stack_lines()
            for rank in sorted(self.rank_logs):
                lines += [f"--- rank {rank} ---", _indent(self.tail(rank, n_lines) or "<empty>")]
            return "\n".join(lines)
        lines.append(
            f"{self.started_as} failed with exit code {self.returncode} after "
            f"{self.duration_s:.1f} s ({where})"
        )
        for i, failure in enumerate(self.failures):
            note = " (first failure)" if i == 0 else " (probably a consequence of the first)"
            lines.append(failure.headline() + note)
            tail = failure.log_tail if i == 0 else _last_lines(failure.log_tail, 5)
            lines.append(_indent(tail or "<no log>"))
        if not self.failures and self.launcher_log is not None:
            lines += ["no rank failure found; launcher log tail:"]
            lines.append(_indent(tail_file(self.launcher_log, n_lines) or "<empty>"))
        return "\n".join(lines)


class Launcher(Protocol):
    """What starts a job's torchruns and waits for them: ``launch`` (one here),
    ``launch_nodes`` (one per node here), ``parity.run.slurm.launch`` (Slurm steps), bound to
    their own keywords (parity.run.job.launcher_for). Each kills what it started on any exception,
    Ctrl-C and SIGTERM included, and says what happened in a ``LaunchResult``."""

    def __call__(
        self,
        module_or_script_args: list[str],
        *,
        nproc: int,
        run_dir: Path,
        timeout_s: float = ...,
        env: Mapping[str, str] | None = ...,
        torchrun_args: Sequence[str] = ...,
        cwd: Path | str | None = ...,
        on_tick: Callable[[], None] | None = ...,
        finished: Callable[[], bool] | None = ...,
        exit_grace_s: float = ...,
        expect_world: int | None = ...,
    ) -> LaunchResult: ...


class LaunchError(RuntimeError):
    """A launch that did not succeed; ``result`` holds the details, ``label`` names the side."""

    def __init__(self, result: LaunchResult, label: str = ""):
        text = result.describe()
        super().__init__(f"{label}: {text}" if label else text)
        self.result = result
        self.label = label


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for explicit rendezvous endpoints)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    module_or_script_args: list[str],
    *,
    nproc: int,
    run_dir: Path,
    timeout_s: float = 600,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: Path | str | None = None,
    kill_grace_s: float = 5.0,
    on_tick: Callable[[], None] | None = None,
    finished: Callable[[], bool] | None = None,
    exit_grace_s: float = 60.0,
    expect_world: int | None = None,
    world_dir: Path | None = None,
) -> LaunchResult:
    """Run ``torchrun ... <module_or_script_args>`` and wait; on timeout or error kill it all.

    run_dir is the launch's own folder (launcher.log, logs/, world/), never the job's output
    folder. env: variables for the job (on top of this process's), also written into the
    reproduce line at the head of launcher.log (secrets masked).
    on_tick, if given, is called about twice a second while the job runs (progress display).
    finished, if given, is polled as often: once it is true (the job's output is complete), the
    job has ``exit_grace_s`` more to exit before it is killed as hung at exit, instead of
    waiting out the whole timeout.
    expect_world: the number of ranks that must form one process group (parity.run.world); the
    result is not ok when they did not. world_dir: where the ranks record it (default
    run_dir/world; a multi-node launch shares one).
    """
    run_dir = Path(run_dir).absolute()  # torchrun may run in another cwd
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in log_dir.iterdir()}
    rdzv = [] if _has_rdzv_args(torchrun_args) else ["--standalone"]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *rdzv,
        "--nproc-per-node", str(nproc), "--log-dir", str(log_dir), "--redirects", "3",
        *torchrun_args, *module_or_script_args,
    ]  # fmt: skip
    world_dir = Path(world_dir) if world_dir is not None else run_dir / "world"
    launcher_log = run_dir / "launcher.log"
    with open(launcher_log, "w") as log:
        log.write(f"# {reproduce_line(cmd, env or {})}\n")
        log.flush()
        ended = _supervise(cmd, _launch_env(world_dir, env), cwd=cwd, stdout=log,
                           stderr=subprocess.STDOUT, timeout_s=timeout_s,
                           kill_grace_s=kill_grace_s, on_tick=on_tick, finished=finished,
                           exit_grace_s=exit_grace_s, world_dir=world_dir)  # fmt: skip
    result = ended.result(run_dir, launcher_log, find_rank_logs(log_dir, before), world_dir)
    if expect_world is not None:
        result.set_fault("world", world.judge(world_dir, expect_world))
    if not result.ok and not result.timed_out and not result.stalled:
        result.failures = parse_failures(launcher_log.read_text(errors="replace"), result)
    return result


#: where ``launch_plain`` puts its process's logs: torchrun's layout for rank 0
PLAIN_LOGS = Path("logs") / "plain" / "attempt_0" / "0"


def launch_plain(
    module_or_script_args: list[str],
    *,
    nproc: int,
    run_dir: Path,
    timeout_s: float = 600,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: Path | str | None = None,
    kill_grace_s: float = 5.0,
    on_tick: Callable[[], None] | None = None,
    finished: Callable[[], bool] | None = None,
    exit_grace_s: float = 60.0,
    expect_world: int | None = None,
) -> LaunchResult:
    """Run a job that is not distributed (``distributed = false``) as one plain process,
    ``python <module_or_script_args>``, as its user would by hand: no torchrun, so its
    environment needs no torch (a JAX or NumPy loop, a script that only writes metrics).

    Everything else is ``launch``'s: the same timeout, hang-at-exit grace, signal handling and
    cleanup; launcher.log holds the reproduce line and the exit, and the process's stdout and
    stderr go where torchrun puts rank 0's, so a failure reads the same (rank 0, its exit code
    or signal, its log tail). Not given RANK, WORLD_SIZE or MASTER_*: a library that sees them
    would try to form a process group.
    """
    if nproc != 1 or torchrun_args or expect_world not in (None, 1):
        raise ValueError("launch_plain runs one process: nproc 1, no torchrun_args, no world")
    run_dir = Path(run_dir).absolute()
    rank_dir = run_dir / PLAIN_LOGS
    rank_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *module_or_script_args]
    launcher_log = run_dir / "launcher.log"
    with (
        open(launcher_log, "w") as log,
        open(rank_dir / "stdout.log", "w") as out,
        open(rank_dir / "stderr.log", "w") as err,
    ):
        log.write(f"# {reproduce_line(cmd, env or {})}\n")
        log.flush()
        ended = _supervise(cmd, _launch_env(run_dir / "world", env, plain=True), cwd=cwd,
                           stdout=out, stderr=err, timeout_s=timeout_s,
                           kill_grace_s=kill_grace_s, on_tick=on_tick, finished=finished,
                           exit_grace_s=exit_grace_s)  # fmt: skip
        how = " (timed out)" if ended.timed_out else " (stalled)" if ended.stalled else ""
        log.write(f"# exited: {ended.returncode}{how}\n")
    result = ended.result(run_dir, launcher_log, {0: rank_dir / "stderr.log"}, run_dir / "world")
    result.started_as = "job (one process, no torchrun)"
    code = result.returncode
    if not result.ok and not result.timed_out and not result.stalled and code:
        result.failures = [RankFailure(0, code, signal_name(code), result.tail(0), 0)]
    return result


def _launch_env(
    world_dir: Path, env: Mapping[str, str] | None, plain: bool = False
) -> dict[str, str]:
    """This process's environment with the job's ``env`` on top, as ``job_env`` gives it, under
    a fresh launch id; its ranks (``plain``: its one process) dump their stacks on the harness's
    signal into the stacks folder beside ``world_dir`` (parity.run.stacks)."""
    full_env = job_env(world_dir, {**os.environ, **(env or {})}, uuid.uuid4().hex)
    return {**full_env, **stacks.stacks_env(world_dir.parent / "stacks", plain)}


def job_env(world_dir: Path, env: Mapping[str, str], launch_id: str) -> dict[str, str]:
    """``env`` as every launch gives it to its job: the world records' hook first on PYTHONPATH,
    one OpenMP thread unless set, unbuffered output, and the launch id every process of the
    launch carries (cleanup finds them by it)."""
    full_env = world.launch_env(world_dir, dict(env))
    for inherited in _HOOK_STATE_ENV:  # this launch's hook finds its own torchrun and ranks
        full_env.pop(inherited, None)
    for inherited in (stacks.STACKS_DIR_ENV, stacks.STACK_SIGNAL_ENV, stacks.STACKS_PLAIN_ENV):
        full_env.pop(inherited, None)  # an enclosing launch's: a local launch sets its own
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env[LAUNCH_ID_ENV] = launch_id
    return full_env


@dataclass
class _Ended:
    """How a supervised process ended (``_supervise``), before its logs are read."""

    returncode: int | None
    timed_out: bool
    duration_s: float
    timeout_s: float
    launch_id: str
    #: set when the job was killed as hung at exit: the grace it had after its output was done
    hung_after_s: float | None = None
    #: set when it was stopped for writing no new step for its stall time (parity.run.stall)
    stalled: str = ""
    #: where each rank waited then, and the dumps kept (parity.run.stacks)
    stacks: tuple[str, list[Path]] = ("", [])

    def result(
        self, run_dir: Path, launcher_log: Path, rank_logs: dict[int, Path], world_dir: Path
    ) -> LaunchResult:
        result = LaunchResult(
            returncode=self.returncode, timed_out=self.timed_out, duration_s=self.duration_s,
            run_dir=run_dir, timeout_s=self.timeout_s, launcher_log=launcher_log,
            launch_id=self.launch_id, rank_logs=rank_logs, world_dir=world_dir,
            stalled=self.stalled, stacks=self.stacks[0], stack_files=self.stacks[1],
        )  # fmt: skip
        if self.hung_after_s is not None:
            result.note = (
                f"the job's output was complete, but it had not exited {self.hung_after_s:g} s "
                f"later: killed as hung at exit"
            )
        return result


def _supervise(
    cmd: Sequence[str],
    env: dict[str, str],
    *,
    cwd: Path | str | None,
    stdout: IO[str],
    stderr: IO[str] | int,
    timeout_s: float,
    kill_grace_s: float,
    on_tick: Callable[[], None] | None,
    finished: Callable[[], bool] | None,
    exit_grace_s: float,
    world_dir: Path | None = None,
) -> _Ended:
    """Start ``cmd`` in a session of its own and wait for it (see ``launch``); on timeout or
    any exception (Ctrl-C, SIGTERM, SIGHUP: parity.run.signals) kill it and everything that
    carries its launch id, then say how it ended. A job stopped for its timeout, or for
    writing no new step (on_tick raised parity.run.stall.Stalled), is first asked for each
    rank's stacks (parity.run.stacks): the ranks recorded in ``world_dir``, or the one process
    of a launch without torchrun (``world_dir`` None)."""
    launch_id = env[LAUNCH_ID_ENV]
    timed_out, stalled, dumped = False, "", ("", [])
    start = time.monotonic()
    deadline, exit_by = start + timeout_s, None
    proc = watchdog = None
    try:
        with deferred():  # a signal (parity.run.signals) waits for `proc`, which it then stops
            proc = subprocess.Popen(
                cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                start_new_session=True, stdin=subprocess.DEVNULL,
                preexec_fn=parent_death_signal(os.getpid(), adopt_orphans=True),
            )  # fmt: skip
            watchdog = _start_watchdog(launch_id, proc.pid)
        while True:
            try:
                proc.wait(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
                if on_tick is not None:
                    on_tick()
                if finished is not None and exit_by is None and finished():
                    exit_by = time.monotonic() + exit_grace_s
                    deadline = min(deadline, exit_by)
    except subprocess.TimeoutExpired:
        timed_out = True
        dumped = _dump_stacks(proc, env, world_dir)
    except Stalled as e:
        stalled = e.line
        dumped = _dump_stacks(proc, env, world_dir)
    finally:
        # also reached on KeyboardInterrupt, SIGTERM, SIGHUP (parity.run.signals) or any other
        # exception in this process; a signal during the cleanup waits for its end
        with deferred():
            if proc is not None and proc.poll() is None:
                _terminate(proc, launch_id, kill_grace_s)
            if proc is not None:
                _kill_leftovers(proc.pid, launch_id)
            if watchdog is not None:
                _stop_watchdog(*watchdog)
            stacks.tidy(Path(env[stacks.STACKS_DIR_ENV]))
    assert proc is not None
    ended = _Ended(proc.returncode, timed_out, time.monotonic() - start, timeout_s, launch_id,
                   stalled=stalled, stacks=dumped)  # fmt: skip
    if timed_out and deadline == exit_by:
        ended.timeout_s = round(exit_by - start, 1)
        ended.hung_after_s = exit_grace_s
    return ended


def _dump_stacks(
    proc: subprocess.Popen | None, env: Mapping[str, str], world_dir: Path | None
) -> tuple[str, list[Path]]:
    """Each rank's stacks before the job is killed: the summary line and the files (nothing
    when the job already ended, or on any error: the kill must still come)."""
    if proc is None or proc.poll() is not None:
        return "", []
    try:
        plain = None if world_dir is not None else proc.pid
        return stacks.collect(Path(env[stacks.STACKS_DIR_ENV]), world_dir, plain)
    except Exception:  # noqa: BLE001 - the stacks are a help, never a reason not to kill
        return "", []


def _start_watchdog(launch_id: str, root: int) -> tuple[subprocess.Popen, int] | None:
    """The launch's watchdog (parity/run/watchdog.py) and the write end of its pipe: it kills
    the launch's processes once that end closes, when ``_stop_watchdog`` closes it or when this
    process dies. None where it cannot start (the harness's own cleanup still runs)."""
    read_end, write_end = os.pipe()
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_WATCHDOG), launch_id, str(root)],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return watchdog, write_end


def _stop_watchdog(watchdog: subprocess.Popen, write_end: int) -> None:
    """Close the watchdog's pipe: it kills what of the launch is still alive (a helper without
    the launch id, in a session of its own) and exits; wait for it."""
    os.close(write_end)
    try:
        watchdog.wait(timeout=30)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def reproduce_line(cmd: Sequence[str], env: Mapping[str, str]) -> str:
    """The shell line that reruns ``cmd`` with the variables the caller set (secrets masked)."""
    assigned = [f"{k}={shlex.quote(v)}" for k, v in masked_env(env).items()]
    return " ".join([*assigned, shlex.join(cmd)])


def launch_or_raise(module_or_script_args: list[str], **kwargs) -> LaunchResult:
    """``launch`` that raises ``LaunchError`` (message: ``describe()``) unless the job succeeded."""
    result = launch(module_or_script_args, **kwargs)
    if not result.ok:
        raise LaunchError(result)
    return result


class _Cancelled(Exception):
    """Raised from a node's on_tick so that its ``launch`` kills its processes and returns."""


def launch_nodes(
    module_or_script_args: list[str],
    *,
    nnodes: int,
    nproc: int,
    run_dir: Path,
    node_ranks: Sequence[int] | None = None,
    join_timeout_s: float = 60.0,
    timeout_s: float = 600,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: Path | str | None = None,
    on_tick: Callable[[], None] | None = None,
    peer_grace_s: float = 30.0,
    finished: Callable[[], bool] | None = None,
    exit_grace_s: float = 60.0,
    expect_world: int | None = None,
) -> LaunchResult:
    """An ``nnodes``-node job on this machine: one torchrun per node, each through ``launch``.

    Every node's ranks record the group they joined in ``run_dir/world``; with expect_world
    the merged result is not ok unless they formed one group of that size (parity.run.world).

    They meet at a c10d rendezvous on 127.0.0.1 (a fresh port and id); node i's launcher log and
    rank logs go to ``run_dir/node<i>``. ``node_ranks`` starts only those nodes here (the rest
    are expected from elsewhere); a node that never joins makes the others fail after
    ``join_timeout_s``, and the result's note names the rendezvous and the missing node ranks.
    Nodes still running ``peer_grace_s`` after another node failed are stopped (no hang).
    Why: checks that a job gives the same numbers across node boundaries, without a cluster.
    """
    import threading

    run_dir = Path(run_dir).absolute()
    ranks = list(range(nnodes)) if node_ranks is None else list(node_ranks)
    if not ranks or any(not 0 <= r < nnodes for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"node_ranks must be distinct, in 0..{nnodes - 1}; got {ranks}")
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"parity-{uuid.uuid4().hex[:12]}"
    stop = threading.Event()
    results: dict[int, LaunchResult] = {}
    errors: list[BaseException] = []
    # one per node, set once its launch returned (its processes killed). Waited on instead of
    # Thread.join(timeout): in CPython 3.11 a Ctrl-C inside join(timeout) marks a thread that
    # is still running as stopped, so the cleanup below would not wait for that node's kill.
    done = {rank: threading.Event() for rank in ranks}

    def tick(first: bool) -> None:
        if stop.is_set():
            raise _Cancelled
        if first and on_tick is not None:
            on_tick()

    def node(rank: int) -> None:
        rdzv = [
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-backend", "c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"join_timeout={join_timeout_s:g}",
        ]  # fmt: skip
        try:
            results[rank] = launch(
                module_or_script_args, nproc=nproc, run_dir=run_dir / f"node{rank}",
                timeout_s=timeout_s, env=env, torchrun_args=[*rdzv, *torchrun_args], cwd=cwd,
                on_tick=lambda: tick(rank == ranks[0]), finished=finished,
                exit_grace_s=exit_grace_s, world_dir=run_dir / "world",
            )  # fmt: skip
        except _Cancelled:
            if not errors:  # stopped because another node failed: say so in its result
                note = f"node {rank}: stopped {peer_grace_s:g} s after another node failed"
                results[rank] = LaunchResult(
                    None, False, time.monotonic() - start, run_dir / f"node{rank}", note=note
                )
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            stop.set()
        finally:
            done[rank].set()

    start = time.monotonic()
    for rank in ranks:
        threading.Thread(target=node, args=(rank,), daemon=True).start()
    failed_at: float | None = None
    try:
        while not all(event.is_set() for event in done.values()):
            time.sleep(0.2)
            if failed_at is None and any(not r.ok for r in list(results.values())):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > peer_grace_s:
                stop.set()
    finally:  # Ctrl-C here: every node's launch kills its processes before we go on
        stop.set()
        for event in done.values():
            event.wait()
    if errors:
        raise errors[0]
    merged = _merge_nodes(results, nnodes, run_dir, time.monotonic() - start, timeout_s,
                          endpoint, rdzv_id, join_timeout_s)  # fmt: skip
    merged.world_dir = run_dir / "world"
    if expect_world is not None:
        merged.set_fault("world", world.judge(merged.world_dir, expect_world))
    return merged


def _merge_nodes(
    results: dict[int, LaunchResult], nnodes: int, run_dir: Path, duration: float,
    timeout_s: float, endpoint: str, rdzv_id: str, join_timeout_s: float,
) -> LaunchResult:  # fmt: skip
    """One result for a multi-node launch: the first non-zero exit, all failures, a note."""
    codes = [r.returncode for _, r in sorted(results.items()) if r.returncode not in (0, None)]
    stopped = any(r.returncode is None for r in results.values())
    merged = LaunchResult(
        returncode=codes[0] if codes else (None if stopped else 0),
        timed_out=any(r.timed_out for r in results.values()),
        duration_s=duration,
        run_dir=run_dir,
        timeout_s=timeout_s,
        failures=sorted((f for _, r in sorted(results.items()) for f in r.failures), key=secondary),
        nodes=dict(sorted(results.items())),
    )
    for _, result in sorted(results.items()):  # the node that saw the stall: every rank here
        if result.stalled or result.stacks:
            merged.stalled, merged.stacks = result.stalled, result.stacks
            merged.stack_files = result.stack_files
            break
    waited = [n for n, r in sorted(results.items()) if _rendezvous_timed_out(r)]
    if waited:
        missing = [n for n in range(nnodes) if n not in waited]
        merged.note = (
            f"rendezvous {rdzv_id!r} (c10d at {endpoint}) timed out after {join_timeout_s:g} s: "
            f"node rank(s) {', '.join(map(str, waited))} waited, node rank(s) "
            f"{', '.join(map(str, missing)) or '?'} never joined ({len(waited)} of {nnodes})"
        )
    return merged


def _rendezvous_timed_out(result: LaunchResult) -> bool:
    if result.ok or result.launcher_log is None:
        return False
    return "RendezvousTimeoutError" in tail_file(result.launcher_log, 200)


def survivors(launch_id: str, pgid: int | None = None) -> list[int]:
    """Live (non-zombie) pids that carry ``launch_id`` in their env or sit in group ``pgid``."""
    needle = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z":
                continue
            if pgid is not None and int(fields[2]) == pgid:
                found.append(pid)
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(pid)
    return found


# --- process cleanup ---------------------------------------------------------------------------


def _signal_all(pids: Sequence[int], pgid: int, sig: signal.Signals) -> None:
    """Signal torchrun's group and each pid; ones that are already gone are fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _terminate(proc: subprocess.Popen, launch_id: str, grace_s: float) -> None:
    """SIGTERM torchrun and its workers, give them ``grace_s`` to exit, then SIGKILL everything."""
    _signal_all(survivors(launch_id), proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_all(survivors(launch_id), proc.pid, signal.SIGKILL)
    proc.wait()


def _kill_leftovers(pgid: int, launch_id: str) -> None:
    """SIGKILL whatever of the launch is still alive (e.g. daemons a worker spawned) and wait."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
            left = survivors(launch_id, pgid)
        except ProcessLookupError:
            left = survivors(launch_id)
        if not left:
            return
        _signal_all(left, pgid, signal.SIGKILL)
        time.sleep(0.1)


# --- logs and failure parsing ------------------------------------------------------------------


def _has_rdzv_args(torchrun_args: Sequence[str]) -> bool:
    return any(a.split("=", 1)[0] in _RDZV_FLAGS for a in torchrun_args)


def find_rank_logs(log_dir: Path, before: set[str]) -> dict[int, Path]:
    """Map local rank -> stderr.log of the last attempt of this launch.

    torch 2.13 layout: ``<log_dir>/<rdzv_id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log``
    (plus ``error.json`` when the worker's main is wrapped in ``@record``).
    """
    runs = [p for p in log_dir.iterdir() if p.is_dir() and p.name not in before]
    if not runs:
        return {}
    run = max(runs, key=lambda p: p.stat().st_mtime)
    attempts = [p for p in run.glob("attempt_*") if p.name.removeprefix("attempt_").isdigit()]
    if not attempts:
        return {}
    attempt = max(attempts, key=lambda p: int(p.name.removeprefix("attempt_")))
    return {
        int(p.name): p / "stderr.log" for p in attempt.iterdir() if p.is_dir() and p.name.isdigit()
    }


def signal_name(exitcode: int) -> str | None:
    """SIGKILL for -9 (an exit code as Popen gives a killed process's); None for an exit."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def parse_failures(launcher_text: str, result: LaunchResult) -> list[RankFailure]:
    """Failed ranks from torchrun's summary, the most likely root cause first.

    torchrun names the failure with the earliest (1 s resolution) timestamp as root cause; ties
    go to the lower rank, so ranks that merely saw a peer die (SIGTERM from torchrun, gloo/nccl
    "connection closed") are moved behind the others.
    """
    entries: list[tuple[int, int, int]] = []  # (rank, local_rank, exitcode)
    root_at = launcher_text.rfind(_ROOT_MARK)
    if root_at >= 0:
        others_at = launcher_text.rfind("Failures:", 0, root_at)
        sections = [launcher_text[root_at:], launcher_text[max(others_at, 0) : root_at]]
        for section in sections:
            for m in _FAILURE_RE.finditer(section):
                entries.append((int(m["rank"]), int(m["local"]), int(m["code"])))
    else:
        for m in _AGENT_FAIL_RE.finditer(launcher_text):
            entries.append((int(m["local"]), int(m["local"]), int(m["code"])))

    failures, seen = [], set()
    for rank, local, code in entries:
        if rank in seen:
            continue
        seen.add(rank)
        tail = result.tail(local)
        failures.append(RankFailure(rank, code, signal_name(code), tail, local))

    return sorted(failures, key=secondary)  # stable: keeps torchrun's order otherwise


def secondary(f: RankFailure) -> bool:
    """A rank that probably died only because a peer died first (SIGTERM, connection closed)."""
    return f.signal == "SIGTERM" or any(m in f.log_tail for m in _SECONDARY_MARKERS)


def tail_file(path: Path, n_lines: int, max_bytes: int = 256 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return _last_lines(data.decode(errors="replace"), n_lines)


def _last_lines(text: str, n_lines: int) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-n_lines:])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def carrying(name: str, value: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``name=value`` (Linux /proc): every
    process a launch marked, wherever it went (a session of its own, a rank reparented to init),
    which a process group cannot follow."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            if stat[stat.rindex(")") + 2 :].startswith("Z"):
                continue
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except (OSError, ValueError):
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_carrying(
    name: str, value: str, proc: subprocess.Popen | None = None, rounds: int = 100
) -> None:
    """SIGKILL every process carrying ``name=value`` (and ``proc`` while it lives) until none is
    left (a dying parent may still fork), then reap ``proc``."""
    for _ in range(rounds):
        left = carrying(name, value)
        if proc is not None and proc.poll() is None:
            left.append(proc.pid)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    if proc is not None:
        proc.wait()
