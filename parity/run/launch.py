"""Run a job under torchrun as a subprocess, never leave processes behind, and say which rank died.
A job that is not distributed runs as one plain process instead (``launch_plain``), supervised
the same way.

torchrun (torch 2.13) starts every worker with ``start_new_session=True``, so workers are *not* in
torchrun's process group. Killing the group alone would orphan them when torchrun itself is
SIGKILLed; every process of a launch therefore also carries ``PARITY_LAUNCH_ID`` in its
environment, and cleanup kills whatever still carries it.

A job never outlives the harness, SIGKILL of the harness included: the process it starts
(torchrun, or the plain job) is SIGKILLed by the kernel when the harness dies (PR_SET_PDEATHSIG),
torchrun's ranks when torchrun dies (the start-up hook, parity/rank/sitehook), and a watchdog
process per launch (parity/run/watchdog.py) kills, when the harness ends, every process of the
launch it saw: those carrying the launch id and every descendant, a helper started with an empty
environment in a session of its own included.

What a launch is asked is one ``LaunchRequest``, the same for every launcher; what it says back,
``LaunchResult``, lives in parity.run.results, the reading of the ranks' logs and torchrun's
failure summary in parity.run.torchrun_logs, and the /proc scan for a launch's processes in
parity.run.proc_scan (their names are importable from here too).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Protocol

from parity.rank.pdeathsig import parent_death_signal
from parity.record.env import without_git_repository
from parity.run import stacks, world
from parity.run.proc_scan import carrying, kill_carrying, scan_proc
from parity.run.results import LaunchError, LaunchResult, Stopped
from parity.run.signals import deferred
from parity.run.stall import Stalled
from parity.run.torchrun_logs import (
    RankFailure,
    find_rank_logs,
    parse_failures,
    secondary,
    signal_name,
    tail_file,
)
from parity.secrets import masked_env

# what callers import from here: the launchers, their request and result, and (re-exported from
# the modules they live in) the log reading and process scanning that go with a launch
__all__ = [
    "LAUNCH_ID_ENV", "PLAIN_LOGS", "LaunchError", "LaunchRequest", "LaunchResult", "Launcher",
    "RankFailure", "carrying", "find_rank_logs", "free_port", "job_env", "kill_carrying",
    "launch", "launch_nodes", "launch_or_raise", "launch_plain", "node_rdzv_args",
    "parse_failures", "plain_command", "reproduce_line", "secondary", "signal_name", "survivors",
    "tail_file", "torchrun_command",
]  # fmt: skip

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


@dataclass(frozen=True)
class LaunchRequest:
    """One job to launch and how to watch it, the same for every launcher (``Launcher``): what
    a caller asks of a launch is written once, here, and a launcher's own settings (nodes,
    rendezvous, a Slurm allocation) stay its keywords.

    module_or_script_args: what follows torchrun (or ``python``): a script or ``-m module`` and
    the job's arguments. run_dir is the launch's own folder (launcher.log, logs/, world/), never
    the job's output folder. env: variables for the job (on top of this process's), also written
    into the reproduce line at the head of launcher.log (secrets masked).
    on_tick, if given, is called about twice a second while the job runs (progress display; it
    may raise parity.run.stall.Stalled to stop a hung job). finished, if given, is polled as
    often: once it is true (the job's output is complete), the job has ``exit_grace_s`` more to
    exit before it is killed as hung at exit, instead of waiting out the whole timeout.
    expect_world: the number of ranks that must form one process group (parity.run.world); the
    result is not ok when they did not. label names the side in a launcher's messages (Slurm's
    step; default: run_dir's name). kill_grace_s: how long a stopped job has between SIGTERM and
    SIGKILL. world_dir: where the ranks record their group (default run_dir/world; the nodes of
    a multi-node launch share one).
    """

    module_or_script_args: Sequence[str]
    nproc: int
    run_dir: Path
    timeout_s: float = 600
    env: Mapping[str, str] = field(default_factory=dict)
    torchrun_args: Sequence[str] = ()
    cwd: Path | str | None = None
    on_tick: Callable[[], None] | None = None
    finished: Callable[[], bool] | None = None
    exit_grace_s: float = 60.0
    expect_world: int | None = None
    label: str = ""
    kill_grace_s: float = 5.0
    world_dir: Path | None = None

    def __post_init__(self) -> None:
        # tuples, so that a caller's later change of its list cannot change the request
        object.__setattr__(self, "module_or_script_args", tuple(self.module_or_script_args))
        object.__setattr__(self, "torchrun_args", tuple(self.torchrun_args))
        object.__setattr__(self, "env", dict(self.env or {}))


class Launcher(Protocol):
    """What starts a job's torchruns and waits for them: ``launch`` (one here),
    ``launch_plain`` (one plain process here), ``launch_nodes`` (one per node here),
    ``parity.run.slurm.launch`` (Slurm steps), bound to their own keywords
    (parity.run.job.launcher_for). Each kills what it started on any exception, Ctrl-C and
    SIGTERM included, and says what happened in a ``LaunchResult``."""

    def __call__(self, request: LaunchRequest) -> LaunchResult: ...


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for explicit rendezvous endpoints)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(
    module_or_script_args: Sequence[str], nproc: int, log_dir: Path, torchrun_args: Sequence[str]
) -> list[str]:
    """The argv of one torchrun: ``launch`` runs it and `parity spec --command` prints it
    (parity.run.job.launch_line), so the preview is the line that runs. Without rendezvous
    arguments it is ``--standalone``."""
    rdzv = [] if _has_rdzv_args(torchrun_args) else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rdzv,
        "--nproc-per-node", str(nproc), "--log-dir", str(log_dir), "--redirects", "3",
        *torchrun_args, *module_or_script_args,
    ]  # fmt: skip


def plain_command(module_or_script_args: Sequence[str]) -> list[str]:
    """The argv of a job that is not distributed (``launch_plain``; the preview prints it)."""
    return [sys.executable, *module_or_script_args]


def node_rdzv_args(
    nnodes: int, rank: int, endpoint: str, rdzv_id: str, join_timeout_s: float
) -> list[str]:
    """The torchrun arguments of node ``rank`` in ``launch_nodes``' c10d rendezvous (the
    preview prints node 0's, with placeholders for the endpoint and id)."""
    return [
        "--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-backend", "c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"join_timeout={join_timeout_s:g}",
    ]  # fmt: skip


def launch(request: LaunchRequest) -> LaunchResult:
    """Run ``torchrun ... <module_or_script_args>`` and wait; on timeout or error kill it all
    (what each of the request's fields does: ``LaunchRequest``)."""
    run_dir = Path(request.run_dir).absolute()  # torchrun may run in another cwd
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in log_dir.iterdir()}
    cmd = torchrun_command(
        request.module_or_script_args, request.nproc, log_dir, request.torchrun_args
    )
    world_dir = Path(request.world_dir) if request.world_dir is not None else run_dir / "world"
    launcher_log = run_dir / "launcher.log"
    with open(launcher_log, "w") as log:
        log.write(f"# {reproduce_line(cmd, request.env)}\n")
        log.flush()
        env = _launch_env(world_dir, request.env)
        ended = _supervise(cmd, env, request, stdout=log, stderr=subprocess.STDOUT,
                           world_dir=world_dir)  # fmt: skip
    result = ended.result(run_dir, launcher_log, find_rank_logs(log_dir, before), world_dir)
    if request.expect_world is not None:  # stopped early too: only once its world was used
        result.set_fault("world", world.judge(world_dir, request.expect_world))
    if not result.ok and not result.timed_out and not result.stalled and not result.stopped_early:
        result.failures = parse_failures(launcher_log.read_text(errors="replace"), result)
    return result


#: where ``launch_plain`` puts its process's logs: torchrun's layout for rank 0
PLAIN_LOGS = Path("logs") / "plain" / "attempt_0" / "0"


def launch_plain(request: LaunchRequest) -> LaunchResult:
    """Run a job that is not distributed (``distributed = false``) as one plain process,
    ``python <module_or_script_args>``, as its user would by hand: no torchrun, so its
    environment needs no torch (a JAX or NumPy loop, a script that only writes metrics).

    Everything else is ``launch``'s: the same timeout, hang-at-exit grace, signal handling and
    cleanup; launcher.log holds the reproduce line and the exit, and the process's stdout and
    stderr go where torchrun puts rank 0's, so a failure reads the same (rank 0, its exit code
    or signal, its log tail). Not given the RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK,
    LOCAL_WORLD_SIZE or MASTER_* this process may have inherited (the job's ``env`` may still
    set them): a library that sees them would try to form a process group, and the start-up
    hook would record the job as a rank.

    ``expect_world`` N > 1: the job starts its own N ranks (Ray's worker actors, as verl's PPO
    trainer does; processes of its own given RANK and WORLD_SIZE), which must form one group of
    N; the start-up hook records them in run_dir/world and the launch is judged as ``launch``'s
    (parity.run.world). None or 1: the one process forms no group, nothing is judged.
    """
    if request.nproc != 1 or request.torchrun_args:
        raise ValueError("launch_plain runs one process: nproc 1, no torchrun_args")
    run_dir = Path(request.run_dir).absolute()
    rank_dir = run_dir / PLAIN_LOGS
    rank_dir.mkdir(parents=True, exist_ok=True)
    cmd = plain_command(request.module_or_script_args)
    world_dir = run_dir / "world"
    launcher_log = run_dir / "launcher.log"
    with (
        open(launcher_log, "w") as log,
        open(rank_dir / "stdout.log", "w") as out,
        open(rank_dir / "stderr.log", "w") as err,
    ):
        log.write(f"# {reproduce_line(cmd, request.env)}\n")
        log.flush()
        env = _launch_env(world_dir, request.env, plain=True)
        ranks = world_dir if (request.expect_world or 0) > 1 else None  # a job's own ranks
        ended = _supervise(cmd, env, request, stdout=out, stderr=err, world_dir=ranks, plain=True)
        how = " (timed out)" if ended.timed_out else " (stalled)" if ended.stalled else ""
        log.write(f"# exited: {ended.returncode}{how}\n")
    result = ended.result(run_dir, launcher_log, {0: rank_dir / "stderr.log"}, world_dir)
    result.started_as = "job (one process, no torchrun)"
    if request.expect_world is not None and request.expect_world > 1:
        result.set_fault("world", world.judge(world_dir, request.expect_world))
    code = result.returncode
    if not (result.ok or result.timed_out or result.stalled or result.stopped_early) and code:
        result.failures = [RankFailure(0, code, signal_name(code), result.tail(0), 0)]
    return result


#: what a launcher gives a rank; inherited by the harness (run inside a launch), not a plain
#: job's: the job would read them, and the start-up hook would take it for a rank
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def _launch_env(
    world_dir: Path, env: Mapping[str, str] | None, plain: bool = False
) -> dict[str, str]:
    """This process's environment with the job's ``env`` on top, as ``job_env`` gives it, under
    a fresh launch id; its ranks (``plain``: its one process) dump their stacks on the harness's
    signal into the stacks folder beside ``world_dir`` (parity.run.stacks). ``plain``: without
    the rank variables this process inherited (``launch_plain``)."""
    inherited = without_git_repository(os.environ)  # a hook's index is not the job's
    if plain:
        for name in _RANK_ENV:
            inherited.pop(name, None)
    full_env = job_env(world_dir, {**inherited, **(env or {})}, uuid.uuid4().hex)
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
    #: set when on_tick stopped it as it had said enough (parity.run.results.Stopped)
    stopped: str = ""

    def result(
        self, run_dir: Path, launcher_log: Path, rank_logs: dict[int, Path], world_dir: Path
    ) -> LaunchResult:
        result = LaunchResult(
            returncode=self.returncode, timed_out=self.timed_out, duration_s=self.duration_s,
            run_dir=run_dir, timeout_s=self.timeout_s, launcher_log=launcher_log,
            launch_id=self.launch_id, rank_logs=rank_logs, world_dir=world_dir,
            stalled=self.stalled, stacks=self.stacks[0], stack_files=self.stacks[1],
            stopped_early=self.stopped,
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
    request: LaunchRequest,
    *,
    stdout: IO[str],
    stderr: IO[str] | int,
    world_dir: Path | None = None,
    plain: bool = False,
) -> _Ended:
    """Start ``cmd`` in a session of its own and wait for it, watched as ``request`` says (its
    cwd, timeout, on_tick, finished and the graces; see ``launch``); on timeout or
    any exception (Ctrl-C, SIGTERM, SIGHUP: parity.run.signals) kill it and everything that
    carries its launch id, then say how it ended. A job stopped for its timeout, or for
    writing no new step (on_tick raised parity.run.stall.Stalled), is first asked for each
    rank's stacks (parity.run.stacks): the ranks recorded in ``world_dir``; for a launch
    without torchrun (``plain``), the ranks it started itself that recorded themselves there
    (Ray's workers), else its one process."""
    launch_id = env[LAUNCH_ID_ENV]
    timeout_s, on_tick, finished = request.timeout_s, request.on_tick, request.finished
    exit_grace_s, kill_grace_s = request.exit_grace_s, request.kill_grace_s
    timed_out, stalled, stopped, dumped = False, "", "", ("", [])
    start = time.monotonic()
    deadline, exit_by = start + timeout_s, None
    proc = watchdog = None
    try:
        with deferred():  # a signal (parity.run.signals) waits for `proc`, which it then stops
            proc = subprocess.Popen(
                cmd, stdout=stdout, stderr=stderr, env=env, cwd=request.cwd,
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
        dumped = _dump_stacks(proc, env, world_dir, plain)
    except Stalled as e:
        stalled = e.line
        dumped = _dump_stacks(proc, env, world_dir, plain)
    except Stopped as e:
        stopped = e.line
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
                   stalled=stalled, stacks=dumped, stopped=stopped)  # fmt: skip
    if timed_out and deadline == exit_by:
        ended.timeout_s = round(exit_by - start, 1)
        ended.hung_after_s = exit_grace_s
    return ended


def _dump_stacks(
    proc: subprocess.Popen | None, env: Mapping[str, str], world_dir: Path | None, plain: bool
) -> tuple[str, list[Path]]:
    """Each rank's stacks before the job is killed: the summary line and the files (nothing
    when the job already ended, or on any error: the kill must still come)."""
    if proc is None or proc.poll() is not None:
        return "", []
    try:
        process = proc.pid if plain else None
        return stacks.collect(Path(env[stacks.STACKS_DIR_ENV]), world_dir, process)
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


def launch_or_raise(request: LaunchRequest) -> LaunchResult:
    """``launch`` that raises ``LaunchError`` (message: ``describe()``) unless the job succeeded."""
    result = launch(request)
    if not result.ok:
        raise LaunchError(result)
    return result


class _Cancelled(Exception):
    """Raised from a node's on_tick so that its ``launch`` kills its processes and returns."""


def launch_nodes(
    request: LaunchRequest,
    *,
    nnodes: int,
    node_ranks: Sequence[int] | None = None,
    join_timeout_s: float = 60.0,
    peer_grace_s: float = 30.0,
) -> LaunchResult:
    """An ``nnodes``-node job on this machine: one torchrun per node, each through ``launch``
    with ``request`` (its nproc ranks per node).

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

    run_dir = Path(request.run_dir).absolute()
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
        if first and request.on_tick is not None:
            request.on_tick()

    def node(rank: int) -> None:
        rdzv = node_rdzv_args(nnodes, rank, endpoint, rdzv_id, join_timeout_s)
        try:
            results[rank] = launch(replace(
                request, run_dir=run_dir / f"node{rank}",
                torchrun_args=[*rdzv, *request.torchrun_args],
                on_tick=lambda: tick(rank == ranks[0]), expect_world=None,
                world_dir=run_dir / "world",
            ))  # fmt: skip
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
    merged = _merge_nodes(results, nnodes, run_dir, time.monotonic() - start, request.timeout_s,
                          endpoint, rdzv_id, join_timeout_s)  # fmt: skip
    merged.world_dir = run_dir / "world"
    if request.expect_world is not None:
        merged.set_fault("world", world.judge(merged.world_dir, request.expect_world))
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
    return scan_proc(f"{LAUNCH_ID_ENV}={launch_id}".encode(), pgid)


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


# --- torchrun's arguments ----------------------------------------------------------------------


def _has_rdzv_args(torchrun_args: Sequence[str]) -> bool:
    return any(a.split("=", 1)[0] in _RDZV_FLAGS for a in torchrun_args)
