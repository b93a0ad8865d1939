"""Run a job's torchruns on a Slurm cluster, through Slurm's own tools only (sbatch, srun,
scontrol, squeue, scancel): the Slurm launcher beside parity.run.launch's local one.

One allocation runs every side: one ``sbatch`` of a small agent script that waits, on the
allocation's first node, for the harness to queue a side (a script in the allocation's folder,
on the file system shared with the nodes), runs it with ``srun`` (one task per node, each a
torchrun with ``--nnodes N --node-rank $SLURM_NODEID`` meeting at the first node's NodeAddr),
and writes its exit status. So the two sides of a pair, check's two revisions and bisect's
probes run one after the other on the same nodes with the same rank-to-node map: bit-exactness
across nodes is only promised within one allocation, or on identical topology. A launch outside
a held allocation (``hold``) makes one for itself.

Why an agent and not a fixed batch script of both sides: check's worktrees, bisect's next commit
and the op-trace rerun are only known once the earlier runs are read, and the agent lets them
all use the allocation the first side waited for. A thread of the harness touches a heartbeat
file while it holds the allocation; an agent whose harness went quiet (killed with SIGKILL) ends
on its own, a running side with it.

Faults come back as the local launcher's do, in a ``LaunchResult``: the failing rank with its
node and log tail; a step past the job's timeout_s cancelled (``scancel JOB.STEP``); Slurm's own
end of the job (TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, CANCELLED) with its state and reason; an
allocation pending past ``max_pending_s``, or whose files never appear here (the folder is not
on a shared file system), cancelled and failed. ``sbatch`` refusing the request is bad input
(``SlurmRefused``, exit 2, with Slurm's message). Ctrl-C, SIGTERM and SIGHUP cancel whatever was
submitted (parity.run.signals), and nothing is left queued.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from parity.errors import InputError
from parity.files import write_text_atomic
from parity.record.env import without_git_repository
from parity.run import world
from parity.run.launch import LAUNCH_ID_ENV, LaunchRequest, job_env, reproduce_line
from parity.run.proc_scan import kill_carrying
from parity.run.results import LaunchResult
from parity.run.signals import deferred
from parity.run.torchrun_logs import (
    RankFailure,
    find_rank_logs,
    parse_failures,
    secondary,
    signal_name,
    tail_file,
)
from parity.secrets import secret_vars
from parity.spec import LauncherSpec

__all__ = ["Allocation", "SlurmRefused", "cancel_all", "hold", "launch", "run_parallel"]

#: Slurm's job states after which nothing more runs
ENDED = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT", "GONE",
}  # fmt: skip
HEARTBEAT_S = 30  # an agent whose harness has not touched its heartbeat for this long ends
BEAT_EVERY_S = 2.0  # how often the harness touches it (a thread, whatever the harness does)
STATE_EVERY_S = 2.0  # how often Slurm itself is asked (files are looked at every poll_s)
#: how long a step that ended by a signal waits for Slurm to show the job ended: at its time
#: limit Slurm signals the step and the agent alike, so the step's exit can come first
SIGNALLED_STEP_S = 3.0
#: srun's line for a task that failed:  srun: error: n2: task 1: Exited with exit code 1
_SRUN_TASK = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+)")
_SRUN_SIGNALS = {"Killed": 9, "Terminated": 15, "Aborted": 6, "Segmentation fault": 11,
                 "Interrupt": 2, "Hangup": 1, "Bus error": 7}  # fmt: skip


class SlurmRefused(InputError):
    """sbatch refused the request (bad partition, too many nodes, a bad time): Slurm's own
    message; bad input, exit 2."""


@dataclass
class JobState:
    """One job as Slurm shows it (``scontrol show job``); state GONE once Slurm forgot it."""

    job_id: str
    state: str
    reason: str = ""
    exit_code: str = ""
    nodes: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def line(self) -> str:
        parts = [f"Slurm job {self.job_id}: {self.state}"]
        if self.reason and self.reason != "None":
            parts.append(f"reason {self.reason}")
        if self.exit_code and self.exit_code != "0:0":
            parts.append(f"exit code {self.exit_code} (status:signal)")
        if self.nodes:
            parts.append(f"nodes {self.nodes}")
        return ", ".join(parts)


def slurm_command(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """One Slurm client command, its output captured; not found is bad input (not a submit
    host)."""
    try:
        return subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout_s,
            stdin=subprocess.DEVNULL, start_new_session=True,  # not cut by a terminal's Ctrl-C
            env=without_git_repository(os.environ),  # sbatch passes its environment on to jobs
        )  # fmt: skip
    except FileNotFoundError:
        raise InputError(f"{args[0]}: not found: the slurm launcher runs where Slurm's client "
                         "tools are (a login or submit host)") from None  # fmt: skip


def job_state(job_id: str) -> JobState:
    """The job's state, reason, exit code and nodes; GONE when Slurm no longer knows it."""
    done = slurm_command("scontrol", "show", "job", "-o", job_id)
    if done.returncode != 0:
        return JobState(job_id, "GONE")
    fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    state = fields.get("JobState", "UNKNOWN")
    nodes = fields.get("NodeList", "")
    return JobState(job_id, state, fields.get("Reason", ""), fields.get("ExitCode", ""),
                    "" if nodes == "(null)" else nodes)  # fmt: skip


def hostnames(nodelist: str) -> list[str]:
    """``n[1-2]`` -> ["n1", "n2"], as Slurm expands it."""
    if not nodelist:
        return []
    done = slurm_command("scontrol", "show", "hostnames", nodelist)
    return done.stdout.split() if done.returncode == 0 else [nodelist]


def cancel(job_id: str, wait_s: float = 30.0) -> None:
    """``scancel`` the job and wait (bounded) until Slurm shows it ended: nothing left queued."""
    slurm_command("scancel", job_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if job_state(job_id).state in ENDED:
            return
        time.sleep(0.2)


# --- the agent: one sbatch, every side a step in it ---------------------------------------------

_AGENT = r"""#!/bin/bash
# parity's agent in a Slurm allocation: runs each queued side (steps/N.sh) in order, writes
# steps/N.exit, and ends when released (the file `release`) or when the harness went quiet (its
# heartbeat file unchanged for {heartbeat} s by this node's clock), also while a side runs: the
# batch script's end ends the job, and Slurm then kills its running step.
D={folder}
cd "$D" || exit 97
env | grep '^SLURM' | sort > slurm.env.tmp && mv slurm.env.tmp slurm.env
{{ echo "$SLURM_JOB_ID"; hostname; }} > started.tmp && mv started.tmp started
last_beat="" quiet_since=$(date +%s)
harness_quiet() {{
    local beat now
    beat=$(stat -c %Y heartbeat 2>/dev/null || echo gone)
    now=$(date +%s)
    if [ "$beat" != "$last_beat" ]; then last_beat=$beat; quiet_since=$now; fi
    [ $(( now - quiet_since )) -gt {heartbeat} ]
}}
ended_quiet() {{
    echo "parity agent: the harness went quiet for {heartbeat} s: ending" >&2
    exit 3
}}
n=0
while [ ! -e release ]; do
    if [ -e "steps/$n.sh" ]; then
        bash "steps/$n.sh" &
        step=$!
        while kill -0 "$step" 2>/dev/null; do
            harness_quiet && ended_quiet
            sleep 0.5
        done
        wait "$step"
        echo $? > "steps/$n.exit.tmp" && mv "steps/$n.exit.tmp" "steps/$n.exit"
        n=$((n + 1))
        continue
    fi
    harness_quiet && ended_quiet
    sleep 0.1
done
"""


class Allocation:
    """One sbatch allocation of ``nodes`` nodes whose agent runs the sides the harness queues.

    ``folder`` (on the file system the nodes share) holds the agent, its log, the queued steps
    and their exit codes; each side's own logs go to its launch folder.
    """

    _live: set[Allocation] = set()  # every allocation this process submitted and not ended
    _lock = threading.Lock()

    def __init__(self, launcher: LauncherSpec, nodes: int, folder: Path):
        self.launcher, self.nodes = launcher, nodes
        self.folder = Path(folder).absolute()
        self.job_id = ""
        self.steps = 0
        self.node_names: list[str] = []
        self.failure = ""  # why the allocation could not be used (pending, not shared, ended)
        self.ended_state: JobState | None = None
        self.launch_ids: list[str] = []  # of the sides it ran: their processes carry them
        self._beating = threading.Event()  # set: the heartbeat thread stops

    # -- submit and wait for the agent
    def submit(self) -> None:
        """sbatch the agent (refused: SlurmRefused with Slurm's message)."""
        (self.folder / "steps").mkdir(parents=True, exist_ok=True)
        self.beat()
        threading.Thread(target=self._beat_until_ended, name="parity-slurm-heartbeat",
                         daemon=True).start()  # fmt: skip
        agent = self.folder / "agent.sh"
        write_text_atomic(agent, _AGENT.format(folder=shlex.quote(str(self.folder)),
                                               heartbeat=HEARTBEAT_S))  # fmt: skip
        cmd = ["sbatch", "--parsable", "--job-name", "parity", f"--nodes={self.nodes}",
               f"--ntasks-per-node={self.launcher.ntasks_per_node}",
               f"--output={self.folder / 'agent.log'}", f"--chdir={self.folder}"]  # fmt: skip
        if self.launcher.partition:
            cmd.append(f"--partition={self.launcher.partition}")
        if self.launcher.time:
            cmd.append(f"--time={self.launcher.time}")
        cmd += [*self.launcher.sbatch_args, str(agent)]
        with deferred():  # a signal now waits for the job id, so that the job is cancelled
            done = slurm_command(*cmd)
            if done.returncode == 0:
                self.job_id = done.stdout.strip().split(";")[0]
                with Allocation._lock:
                    Allocation._live.add(self)
        write_text_atomic(self.folder / "sbatch.txt", f"{shlex.join(cmd)}\n{done.stdout}"
                          f"{done.stderr}")  # fmt: skip
        if done.returncode != 0:
            self._beating.set()
            message = " ".join(line.strip() for line in done.stderr.splitlines() if line.strip())
            raise SlurmRefused(f"sbatch refused the allocation ({self.nodes} node(s)): "
                               f"{message or f'exit code {done.returncode}'}")  # fmt: skip

    def beat(self) -> None:
        (self.folder / "heartbeat").touch()

    def _beat_until_ended(self) -> None:
        """Touch the heartbeat every BEAT_EVERY_S while the allocation is held, whatever the
        harness is doing meanwhile (a worktree made, runs compared): only a harness that is gone
        goes quiet."""
        while not self._beating.wait(BEAT_EVERY_S):
            with contextlib.suppress(OSError):
                self.beat()

    def wait_started(self, on_tick: Callable[[], None] | None = None) -> bool:
        """Wait until the agent runs (its `started` file is here); False with ``failure`` set
        when it was pending too long, ended, or its files never appeared (the allocation is then
        cancelled)."""
        started = self.folder / "started"
        pending_since, running_since = time.monotonic(), None
        asked, state = 0.0, JobState(self.job_id, "PENDING")
        said = False
        while not started.exists():
            now = time.monotonic()
            if now - asked >= STATE_EVERY_S:
                asked, state = now, job_state(self.job_id)
            if state.ended:
                self.ended_state = state
                return self._fail(f"the allocation ended before it ran anything: {state.line()}")
            if state.state == "PENDING":
                if not said and now - pending_since > 5:
                    print(f"parity: Slurm job {self.job_id} pending ({state.reason})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    said = True
                if now - pending_since > self.launcher.max_pending_s:
                    return self._fail(
                        f"Slurm job {self.job_id} was still pending after "
                        f"{self.launcher.max_pending_s:g} s (reason {state.reason}): cancelled"
                    )
            elif running_since is None:
                running_since = now
            elif now - running_since > self.launcher.visible_s:
                return self._fail(
                    f"Slurm job {self.job_id} runs on {state.nodes}, but its agent's file "
                    f"{started} did not appear here within {self.launcher.visible_s:g} s: the "
                    "folder must be on a file system shared with the nodes"
                )
            if on_tick is not None:
                on_tick()
            self.beat()
            time.sleep(min(self.launcher.poll_s, 0.5))
        self.node_names = hostnames(job_state(self.job_id).nodes)
        return True

    def _fail(self, why: str) -> bool:
        self.failure = why
        self.cancel()
        return False

    # -- end
    def release(self, wait_s: float = 30.0) -> None:
        """Let the agent end (no more sides), then make sure the job is gone."""
        if not self.job_id:
            return
        (self.folder / "release").touch()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if job_state(self.job_id).ended:
                break
            time.sleep(0.2)
        self.cancel()

    def cancel(self) -> None:
        """scancel the job (whatever it runs) and wait until Slurm shows it ended; then kill
        what of its sides still runs here (a one-host cluster: a rank its torchrun left)."""
        self._beating.set()
        if self.job_id:
            cancel(self.job_id)
        for launch_id in self.launch_ids:
            kill_carrying(LAUNCH_ID_ENV, launch_id)
        with Allocation._lock:
            Allocation._live.discard(self)

    # -- one side
    def run(self, side: Side) -> LaunchResult:
        """Queue one side, wait for it (progress, timeout, hung at exit), and read its result."""
        start = time.monotonic()
        if self.failure:
            return side.failed(self.failure, start)
        if not self.node_names and not self.wait_started(side.request.on_tick):
            return side.failed(self.failure, start, self.ended_state)
        seq = self.queue(side)
        try:
            return self._wait(side, seq, start)
        finally:  # the step removes it when it starts; one that never started, here
            (self.folder / "steps" / f"{seq}.env").unlink(missing_ok=True)

    def queue(self, side: Side) -> int:
        """Write the side's step for the agent; its number. The job's secrets (variables whose
        names hold TOKEN, KEY, SECRET or PASSWORD) go to ``steps/N.env``, readable by this user
        only, which the step reads and removes as it starts: never into the step script, which
        the nodes' users may read and which stays after the run."""
        seq = self.steps
        self.steps += 1
        self.launch_ids.append(side.launch_id)
        secrets_file = self.folder / "steps" / f"{seq}.env"
        env = side.environment()
        secrets = secret_vars(env)
        if secrets:
            _write_private(secrets_file, "".join(f"export {k}={shlex.quote(v)}\n"
                                                 for k, v in secrets.items()))  # fmt: skip
        public = {k: v for k, v in env.items() if k not in secrets}
        script = side.script(self, public, secrets_file if secrets else None)
        write_text_atomic(self.folder / "steps" / f"{seq}.sh", script)
        return seq

    def _wait(self, side: Side, seq: int, start: float) -> LaunchResult:
        """Wait for step ``seq`` (progress, timeout, hung at exit) and read its result."""
        exit_file = self.folder / "steps" / f"{seq}.exit"
        request = side.request
        queued = time.monotonic()  # the side's timeout counts from here, not from the queue's
        deadline, exit_by, timed_out, note = queued + request.timeout_s, None, False, ""
        asked = time.monotonic()
        while not exit_file.exists():
            now = time.monotonic()
            if now - asked >= STATE_EVERY_S:
                asked, state = now, job_state(self.job_id)
                if state.ended and not exit_file.exists():
                    return self._ended_under(side, state, start)
            if now >= deadline:
                timed_out = True
                step = f"{self.job_id}.{side.step_id() or '?'}"
                if exit_by is not None and deadline == exit_by:
                    note = (f"the job's output was complete, but it had not exited "
                            f"{request.exit_grace_s:g} s later: killed as hung at exit "
                            f"(scancel {step})")  # fmt: skip
                else:
                    note = (f"timed out after {request.timeout_s:g} s (the job's timeout_s): its "
                            f"step was cancelled (scancel {step})")  # fmt: skip
                self._cancel_step(side, exit_file)
                break
            if request.on_tick is not None:
                request.on_tick()
            if request.finished is not None and exit_by is None and request.finished():
                exit_by = now + request.exit_grace_s
                deadline = min(deadline, exit_by)
            self.beat()
            time.sleep(self.launcher.poll_s)
        code = _read_int(exit_file)
        if code is not None and code > 128 and not timed_out:
            state = self._ended_within(SIGNALLED_STEP_S)
            if state is not None:  # Slurm ended the job (its time limit): that is the reason
                return self._ended_under(side, state, start)
        return side.result(self, code, start, timed_out=timed_out, note=note)

    def _ended_within(self, wait_s: float) -> JobState | None:
        """The job's state once Slurm shows it ended, within ``wait_s``; None if it runs on."""
        deadline = time.monotonic() + wait_s
        while True:
            state = job_state(self.job_id)
            if state.ended:
                return state
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)

    def _ended_under(self, side: Side, state: JobState, start: float) -> LaunchResult:
        """The side's result when the allocation ended while it ran (TIMEOUT, NODE_FAIL, ...)."""
        self.ended_state = state
        self.failure = f"the allocation ended while {side.label} ran: {state.line()}"
        with Allocation._lock:
            Allocation._live.discard(self)
        return side.result(self, None, start, note=self.failure, state=state)

    def _cancel_step(self, side: Side, exit_file: Path, wait_s: float = 30.0) -> None:
        """scancel this side's srun step (the agent goes on to the next side)."""
        step = side.step_id()
        if step is not None:
            slurm_command("scancel", f"{self.job_id}.{step}")
        deadline = time.monotonic() + wait_s
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not exit_file.exists():  # the step would not end: the allocation cannot go on
            self.failure = f"side {side.label}'s step would not end after scancel"
            self.cancel()


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically, readable and writable by this user only from the
    moment the file exists."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# --- one side: its step script and its result --------------------------------------------------


@dataclass
class Side:
    """One torchrun job to run on the allocation's nodes: the request every launcher is given
    (parity.run.launch.LaunchRequest) plus what only Slurm needs, its nodes and its launcher."""

    request: LaunchRequest
    nnodes: int
    launcher: LauncherSpec

    def __post_init__(self) -> None:
        self.run_dir = Path(self.request.run_dir).absolute()
        self.cwd = Path(self.request.cwd).absolute() if self.request.cwd is not None else None
        self.launch_id = uuid.uuid4().hex
        self.world_dir = self.run_dir / "world"
        self.label = self.request.label or self.run_dir.name

    def node_dir(self, node: int) -> Path:
        return self.run_dir / f"node{node}"

    def environment(self) -> dict[str, str]:
        """The job's variables, as every launch gives them (parity.run.launch.job_env)."""
        return job_env(self.world_dir, self.request.env, self.launch_id)

    def script(
        self, allocation: Allocation, env: Mapping[str, str], secrets_file: Path | None = None
    ) -> str:
        """The step the agent runs: the rendezvous at the first node's NodeAddr, then srun of
        one torchrun per node. Its own output (srun's messages) goes to srun.log. ``env`` is
        exported by the script; ``secrets_file`` (the rest) is read, then removed, first."""
        for node in range(self.nnodes):
            (self.node_dir(node) / "logs").mkdir(parents=True, exist_ok=True)
        secrets = shlex.quote(str(secrets_file)) if secrets_file is not None else ""
        # the static rendezvous: node rank i (SLURM_NODEID) gets ranks i*nproc.., the same
        # rank-to-node map for every side (c10d's would follow the order the nodes joined in)
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
            "--node-rank", "$SLURM_NODEID", "--master-addr", "$PARITY_MASTER_ADDR",
            "--master-port", "$PARITY_MASTER_PORT", "--nproc-per-node", str(self.request.nproc),
            "--log-dir", f"{self.run_dir}/node$SLURM_NODEID/logs", "--redirects", "3",
            *self.request.torchrun_args, *self.request.module_or_script_args,
        ]  # fmt: skip
        node_script = self.run_dir / "node.sh"
        write_text_atomic(node_script, "\n".join([
            "#!/bin/bash",
            "# one node's torchrun (srun runs it once per node)",
            f'echo "$SLURM_NODEID $SLURMD_NODENAME $SLURM_STEP_ID" > '
            f'{shlex.quote(str(self.run_dir))}/node$SLURM_NODEID/slurm-node',
            "exec " + " ".join(_shell_word(w) for w in torchrun),
            "",
        ]))  # fmt: skip
        srun = ["srun", f"--nodes={self.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                f"--output={self.run_dir}/node%n/launcher.log", *self.launcher.srun_args,
                "bash", str(node_script)]  # fmt: skip
        python = shlex.quote(sys.executable)
        lines = [
            "#!/bin/bash",
            f"# {self.label}: rerun with {reproduce_line(torchrun, self.request.env)}",
            f"exec > {shlex.quote(str(self.run_dir / 'srun.log'))} 2>&1",
            *([f". {secrets} || exit 97", f"rm -f {secrets}"] if secrets else []),
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            f"cd {shlex.quote(str(self.cwd or Path.cwd()))} || exit 97",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "addr=$(scontrol show node \"$head\" | grep -o 'NodeAddr=[^ ]*' | head -n 1 "
            "| cut -d= -f2)",
            f"port=$({python} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); "
            "print(s.getsockname()[1])')",
            'export PARITY_MASTER_ADDR="${addr:-$head}" PARITY_MASTER_PORT="$port"',
            'echo "rendezvous: node 0 ($head) at $PARITY_MASTER_ADDR:$PARITY_MASTER_PORT"',
            shlex.join(srun),
            "",
        ]  # fmt: skip
        return "\n".join(lines)

    def step_id(self) -> str | None:
        """The srun step's id (each node writes it when its torchrun starts)."""
        for node in range(self.nnodes):
            try:
                return (self.node_dir(node) / "slurm-node").read_text().split()[2]
            except (OSError, IndexError):
                continue
        return None

    def hosts(self) -> dict[int, str]:
        """Node rank -> the Slurm node its torchrun ran on."""
        found = {}
        for node in range(self.nnodes):
            try:
                found[node] = (self.node_dir(node) / "slurm-node").read_text().split()[1]
            except (OSError, IndexError):
                continue
        return found

    def failed(self, why: str, start: float, state: JobState | None = None) -> LaunchResult:
        """A result for a side that never ran (the allocation could not be had)."""
        result = LaunchResult(None, state is not None and state.state == "TIMEOUT",
                              time.monotonic() - start, self.run_dir, self.request.timeout_s,
                              launch_id=self.launch_id, note=why)  # fmt: skip
        result.topology = {"launcher": "slurm"}
        return result

    def result(
        self,
        allocation: Allocation,
        code: int | None,
        start: float,
        *,
        timed_out: bool = False,
        note: str = "",
        state: JobState | None = None,
    ) -> LaunchResult:
        """Each node's torchrun log and rank logs read into one LaunchResult, as a local
        multi-node launch gives it, with the node each failing rank ran on."""
        kill_carrying(LAUNCH_ID_ENV, self.launch_id)  # a one-host cluster's leftovers
        hosts = self.hosts()
        srun_text = tail_file(self.run_dir / "srun.log", 200)
        node_codes = _node_codes(srun_text, hosts)
        nodes: dict[int, LaunchResult] = {}
        failures: list[RankFailure] = []
        for node in range(self.nnodes):
            log = self.node_dir(node) / "launcher.log"
            if not log.exists() and node not in hosts:
                continue
            rc = node_codes.get(node, 0 if code == 0 else None)
            result = LaunchResult(
                rc,
                False,
                time.monotonic() - start,
                self.node_dir(node),
                launcher_log=log,
                rank_logs=find_rank_logs(self.node_dir(node) / "logs", set()),
            )
            if rc not in (0, None):
                found = parse_failures(log.read_text(errors="replace") if log.exists() else "",
                                       result)  # fmt: skip
                if not found:  # the torchrun itself died: the node is what failed
                    found = [RankFailure(-1, rc, signal_name(rc), tail_file(log, 30),
                                         node=node)]  # fmt: skip
                for f in found:
                    f.host = hosts.get(node, "")
                result.failures = found
                failures += found
            nodes[node] = result
        state = state or (allocation.ended_state if code is None else None)
        merged = LaunchResult(
            returncode=code if state is None else None,
            timed_out=timed_out or (state is not None and state.state == "TIMEOUT"),
            duration_s=time.monotonic() - start,
            run_dir=self.run_dir,
            timeout_s=self.request.timeout_s,
            launcher_log=self.run_dir / "srun.log",
            launch_id=self.launch_id,
            failures=sorted(failures, key=secondary),
            nodes=nodes,
            note=note,
            world_dir=self.world_dir,
        )
        if code not in (0, None) and not failures and srun_text:
            merged.note = merged.note or f"srun failed (exit code {code}): {_last(srun_text)}"
        nproc = self.request.nproc
        merged.topology = {
            "launcher": "slurm",
            "job_id": allocation.job_id,
            "nodes": [hosts.get(n, "?") for n in range(self.nnodes)],
            "nproc_per_node": nproc,
            "ranks": [hosts.get(r // nproc, "?") for r in range(self.nnodes * nproc)],
            "allocation_nodes": allocation.node_names,
            "slurm": _slurm_env(allocation.folder / "slurm.env"),
        }
        if self.request.expect_world is not None and merged.ok:
            merged.set_fault("world", world.judge(self.world_dir, self.request.expect_world))
        return merged


def _shell_word(word: str) -> str:
    """A word for the node script: quoted, but $SLURM_NODEID and $PARITY_MASTER_* expanded
    (they are only known on the node)."""
    if "$SLURM_NODEID" in word or "$PARITY_MASTER_" in word:
        return '"' + re.sub(r'(["\\`])', r"\\\1", word) + '"'
    return shlex.quote(word)


def _node_codes(srun_text: str, hosts: Mapping[int, str]) -> dict[int, int]:
    """Node rank -> exit code (-signal) of its task, from srun's "task N: ..." lines (one task
    per node: the task id is the node rank)."""
    codes: dict[int, int] = {}
    for m in _SRUN_TASK.finditer(srun_text):
        how = m["how"].strip()
        exited = re.match(r"Exited with exit code (\d+)", how)
        code = int(exited[1]) if exited else -_SRUN_SIGNALS.get(how.split(" (")[0], 9)
        for part in m["tasks"].split(","):
            lo, _, hi = part.partition("-")
            for task in range(int(lo), int(hi or lo) + 1):
                codes[task] = code
    return codes


def _last(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


#: the batch script's own task variables, not the job's
_TASK_VARIABLES = {"SLURMD_NODENAME", "SLURM_GTIDS", "SLURM_LOCALID", "SLURM_NODEID",
                   "SLURM_PROCID", "SLURM_TASK_PID", "SLURM_TOPOLOGY_ADDR"}  # fmt: skip


def _slurm_env(path: Path) -> dict[str, str]:
    """The job's SLURM_* variables, as the agent saw them."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k: v for k, v in pairs if k not in _TASK_VARIABLES}


# --- what parity.run.job calls --------------------------------------------------------------------

_held: dict[tuple[LauncherSpec, int], Allocation] = {}


@contextlib.contextmanager
def hold(launcher: LauncherSpec, nodes: int, folder: Path) -> Iterator[Allocation]:
    """One allocation for every launch of ``launcher`` on ``nodes`` nodes inside the block (a
    pair's sides, check's revisions, bisect's probes, the op-trace rerun); released after it,
    cancelled on any exception (Ctrl-C, SIGTERM, SIGHUP included)."""
    key = (launcher, nodes)
    if key in _held:  # an outer block holds one already
        yield _held[key]
        return
    with _allocated(launcher, nodes, folder, key) as allocation:
        yield allocation


@contextlib.contextmanager
def _allocated(
    launcher: LauncherSpec, nodes: int, folder: Path, key: tuple | None = None
) -> Iterator[Allocation]:
    """A submitted allocation, held under ``key`` (for ``launch``) while the block runs."""
    allocation = Allocation(launcher, nodes, folder)
    allocation.submit()
    if key is not None:
        _held[key] = allocation
    try:
        yield allocation
    except BaseException:
        with deferred():
            allocation.cancel()
        raise
    finally:
        _held.pop(key, None)
    with deferred():
        allocation.release()


def launch(request: LaunchRequest, *, launcher: LauncherSpec, nnodes: int) -> LaunchResult:
    """``parity.run.launch.launch`` on Slurm: the job's torchruns as a step of the held allocation
    (``hold``), or of one made for this launch alone (in run_dir/allocation)."""
    side = Side(request, nnodes, launcher)
    nodes = launcher.nodes or nnodes
    held = _held.get((launcher, nodes)) if not launcher.parallel else None
    if held is not None:
        result = held.run(side)
    else:
        with _allocated(launcher, nodes, side.run_dir / "allocation") as allocation:
            result = allocation.run(side)
    return result


def cancel_all() -> None:
    """scancel every allocation this process submitted that has not ended (the parallel sides'
    threads, when the main thread is interrupted)."""
    with Allocation._lock:
        live = list(Allocation._live)
    for allocation in live:
        allocation.cancel()


def run_parallel(calls: Sequence[Callable[[], object]]) -> list[object]:
    """Run each call in a thread of its own (each side its own Slurm job, at once) and return
    their results in order (an exception of one is raised). Interrupted in the main thread:
    every allocation submitted is cancelled, the threads end, then the interrupt goes on."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)
    done = [threading.Event() for _ in calls]

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            errors[i] = e
        finally:
            done[i].set()

    for i in range(len(calls)):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    try:
        while not all(event.is_set() for event in done):
            time.sleep(0.2)
    except BaseException:
        with deferred():
            cancel_all()
            for event in done:
                event.wait(60)
        raise
    for error in errors:
        if error is not None:
            raise error
    return results
