"""Cancellation as CI does it (SIGINT, SIGTERM, SIGHUP alike) and quiet closed pipes.

Each long-running command gets a signal while its launches run (a tiny `task = "custom"` job
whose ranks write their pid, then sleep; the signal goes once every rank's pid file is there).
Afterwards: the right exit code (130, 143, 129), exactly one line printed after the signal, on
stderr (stdout stays empty; a pytest session's stdout is pytest's own report), no traceback, no
process left (the ranks by pid, the command's own process group, anything naming the test's
folder), no temporary folder left (TMPDIR is the test's own; pytest's --basetemp is kept by
pytest's rules), no worktree registered and the user's repository as it was; what was
completely written before the signal is kept.

Signals per command: all three on `pair` (separate launches, the cheapest); SIGTERM on `check`
(the reported bug) and on a pooled pytest session (Slurm, Kubernetes); SIGHUP on `bisect` (it
already handled Ctrl-C); SIGINT on `pair --in-process`; SIGHUP on the soak. About 2 s a launch;
in-process and pooled jobs run one rank, which imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.run import signals
from tests.orchestration.history import git, repo_state
from tests.run.procs import procs_mentioning

ROOT = Path(__file__).resolve().parents[2]

# The job: the ranks form their process group, rank 0 writes three steps (and the end record
# unless SLEEP); with SLEEP every rank then writes OUT/pids/rank<r>.pid and sleeps. `train(argv)`
# for in-process launches and warm pools.
JOB = """\
import json
import os
import sys
import time
from pathlib import Path

SLEEP = {sleep}
NUDGE = {nudge}


def train(argv):
    import torch.distributed as dist

    if not dist.is_initialized():  # a launch of its own; in-process and pools have one
        dist.init_process_group("gloo")
    dist.barrier()  # the ranks form their world (parity.run.world checks it)
    out = Path(argv[argv.index("--out") + 1])
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        with open(out / "metrics.jsonl", "w") as f:
            for i in range(1, 4):
                loss = 1.0 / i + (1e-3 if NUDGE and i >= 2 else 0.0)
                f.write(json.dumps({{"step": i, "train/loss": loss}}) + "\\n")
            if not SLEEP:
                f.write(json.dumps({{"event": "end", "steps": 3}}) + "\\n")
    if SLEEP:
        (out / "pids").mkdir(exist_ok=True)
        tmp = out / "pids" / f".rank{{rank}}"
        tmp.write_text(str(os.getpid()))
        tmp.rename(out / "pids" / f"rank{{rank}}.pid")
        time.sleep(300)


if __name__ == "__main__":
    train(sys.argv[1:])
"""

SCRIPT_SPEC = (
    'task = "custom"\nworld_size = 2\ncommand = ["job.py", "--out", "{out}"]\ntimeout_s = 120\n'
)
MODULE_SPEC = SCRIPT_SPEC.replace('["job.py"', '["-m", "job"')
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def _job(sleep: bool, nudge: bool = False) -> str:
    return JOB.format(sleep=sleep, nudge=nudge)


def _default_signals() -> None:
    """Popen(preexec_fn=...): the child starts with the three signals at their defaults, also
    when this test run ignores one (a shell's background job ignores SIGINT, nohup SIGHUP)."""
    for sig in signals.SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _snapshot(repo: Path) -> dict[str, str]:
    """What a command must leave as it was (``repo_state``), git's own admin files too."""
    admin = "\n".join(sorted(p.name for p in (repo / ".git").iterdir()))
    return {**repo_state(repo), "admin": admin}


def _repo(root: Path, commits: list[tuple[str, str]]) -> Path:
    """A repo with job.py at each (subject, source) commit and uncommitted edits on top."""
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    for subject, source in commits:
        (root / "job.py").write_text(source)
        git(root, "add", "job.py")
        git(root, "commit", "-q", "-m", subject)
    (root / "spec.toml").write_text(SCRIPT_SPEC)
    git(root, "add", "spec.toml")  # staged, never committed
    (root / "job.py").write_text(_job(sleep=False) + "# uncommitted edit\n")
    (root / "untracked.txt").write_text("new\n")
    return root


class SignalledRun:
    """A command run to the moment every wait file exists, then sent `sig`; what it left."""

    def __init__(self, cmd: list[str], cwd: Path, wait_for, sig: int, tmp: Path, timeout=90):
        self.tmpdir = tmp / "tmpdir"  # the command's TMPDIR: must be empty afterwards
        self.tmpdir.mkdir(exist_ok=True)
        out_path, err_path = tmp / "stdout.txt", tmp / "stderr.txt"
        env = {**os.environ, "TMPDIR": str(self.tmpdir), "PYTHONPATH": str(ROOT)}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_default_signals,
            )  # fmt: skip
            try:
                deadline = time.monotonic() + timeout
                while not (pid_files := wait_for()):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"never got to the launches:\n{err_path.read_text()[-3000:]}")
                    time.sleep(0.05)
                self.pids = [int(f.read_text()) for f in pid_files]
                before = err_path.stat().st_size
                proc.send_signal(sig)
                sent = time.monotonic()
                self.returncode = proc.wait(timeout=60)
                self.seconds = time.monotonic() - sent
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.pgid = proc.pid
        self.stdout = out_path.read_text()
        self.stderr = err_path.read_text()
        self.after = err_path.read_bytes()[before:].decode()  # printed after the signal

    def assert_clean(self, sig: int, line_start: str, folder: Path) -> None:
        assert self.returncode == EXIT[sig], self.stderr[-3000:]
        assert self.seconds < 20, "stopped by a fallback's kill, not by its own cleanup"
        assert "Traceback" not in self.stderr + self.stdout, self.stderr[-3000:]
        lines = self.after.splitlines()
        assert len(lines) == 1 and lines[0].startswith(line_start), self.after
        assert f"interrupted by {signal.Signals(sig).name}" in lines[0]
        assert self.pids and not [p for p in self.pids if _alive(p)], "ranks left running"
        assert _group(self.pgid) == [], "the command's process group is not empty"
        assert procs_mentioning(str(folder)) == []
        assert list(self.tmpdir.iterdir()) == [], "temporary folders left"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return not stat[stat.rindex(")") + 2 :].startswith("Z")


def _group(pgid: int) -> list[int]:
    """Live processes in process group `pgid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _alive(int(entry.name)):
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                found.append(int(entry.name))
    return found


def _pid_files(*folders: Path, ranks: int = 2):
    """wait_for: the pid files of every rank, in the first folder that has them all."""

    def ready() -> list[Path]:
        for folder in folders:
            files = [folder / "pids" / f"rank{r}.pid" for r in range(ranks)]
            if all(f.exists() for f in files):
                return files
        return []

    return ready


def _glob_pid_files(root: Path, ranks: int = 2):
    def ready() -> list[Path]:
        for pids in root.glob("**/pids"):
            files = [pids / f"rank{r}.pid" for r in range(ranks)]
            if all(f.exists() for f in files):
                return files
        return []

    return ready


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "parity.cli", *args]


# --- pair ----------------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize(
    ("sig", "in_process"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGHUP, False),
     (signal.SIGINT, True)],
    ids=["INT", "TERM", "HUP", "INT-in-process"],
)  # fmt: skip
def test_pair(tmp_path: Path, sig: int, in_process: bool) -> None:
    (tmp_path / "job.py").write_text(_job(sleep=True))
    ranks = 1 if in_process else 2  # an in-process rank imports torch: one is enough
    spec = MODULE_SPEC.replace("world_size = 2", f"world_size = {ranks}")
    (tmp_path / "spec.toml").write_text(spec)
    out = tmp_path / "runs"
    cmd = _cli("pair", "--spec", "spec.toml", "--out", str(out))
    run = SignalledRun(
        cmd + (["--in-process"] if in_process else []), tmp_path,
        _pid_files(out / "a", ranks=ranks), sig, tmp_path,
    )  # fmt: skip
    run.assert_clean(sig, "parity: pair interrupted", tmp_path)
    assert run.stdout == ""
    assert str(out) in run.after
    assert (out / "a" / "metrics.jsonl").exists()  # what the job wrote is kept


# --- check ---------------------------------------------------------------------------------------


@pytest.mark.parity
def test_check_sigterm(tmp_path: Path) -> None:
    """Base runs to its end, head's launch is running: base's run is kept, no worktree stays."""
    repo = _repo(tmp_path / "repo", [("base", _job(sleep=False)), ("head", _job(sleep=True))])
    git(repo, "branch", "side")
    before = _snapshot(repo)
    out = tmp_path / "out"
    cmd = _cli("check", "--base", "HEAD~1", "--head", "main", "--spec", "spec.toml",
               "--out", str(out))  # fmt: skip
    run = SignalledRun(cmd, repo, _pid_files(out / "head"), signal.SIGTERM, tmp_path)
    run.assert_clean(signal.SIGTERM, "parity: check interrupted", tmp_path)
    assert run.stdout == ""
    assert "worktrees removed" in run.after and str(out) in run.after
    assert _snapshot(repo) == before
    assert len(git(repo, "worktree", "list").splitlines()) == 1
    assert (out / "base" / "metrics.jsonl").read_text().rstrip().endswith('"steps": 3}')


# --- bisect --------------------------------------------------------------------------------------


@pytest.mark.parity
def test_bisect_sighup(tmp_path: Path) -> None:
    """good (a), a commit whose job sleeps (b), bad (c): the signal comes while `git bisect run`
    tests b in the bisect's worktree; the user is in the middle of a bisect of their own."""
    commits = [("a: good", _job(sleep=False)), ("b: sleeps", _job(sleep=True)),
               ("c: bad", _job(sleep=False, nudge=True))]  # fmt: skip
    repo = _repo(tmp_path / "repo", commits)
    git(repo, "bisect", "start")
    git(repo, "bisect", "bad", "HEAD")
    before = _snapshot(repo)
    out = tmp_path / "out"
    middle = git(repo, "rev-parse", "HEAD~1").strip()[:12]
    cmd = _cli("bisect", "--good", "HEAD~2", "--bad", "main", "--spec", "spec.toml",
               "--out", str(out))  # fmt: skip
    wait = _pid_files(out / "commits" / middle)
    run = SignalledRun(cmd, repo, wait, signal.SIGHUP, tmp_path)
    run.assert_clean(signal.SIGHUP, "parity: bisect interrupted", tmp_path)
    assert run.stdout == ""
    assert "bisect state removed" in run.after
    assert _snapshot(repo) == before
    assert (out / "good" / "metrics.jsonl").exists()  # the reference and the bad commit's
    bad = git(repo, "rev-parse", "main").strip()[:12]  # verdict were complete: kept
    assert (
        json.loads((out / "commits" / f"{bad}.launch" / "verdict.json").read_text())["verdict"]
        == "diverged"
    )


# --- pytest with a warm pool, and the soak -------------------------------------------------------

INNER_TEST = """\
from parity.spec import JobSpec


def test_sleeps_in_the_pool(parity_runner):
    spec = JobSpec(task="custom", world_size=1, command=["-m", "job", "--out", "{out}"],
                   timeout_s=120)
    run = parity_runner.job(spec)
    assert run.in_process  # it ran in the warm pool
"""


@pytest.mark.parity
def test_pooled_pytest_session_sigterm(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(_job(sleep=True))
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    base = tmp_path / "basetemp"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
           str(base), "test_inner.py"]  # fmt: skip
    wait = _glob_pid_files(base, ranks=1)  # a pool's rank imports torch: one is enough
    run = SignalledRun(cmd, tmp_path, wait, signal.SIGTERM, tmp_path)
    assert (base / "parity-runs0" / "pools").is_dir()  # the job ran in a warm pool
    run.assert_clean(signal.SIGTERM, "parity: pytest session interrupted", tmp_path)
    assert "warm pools and launches stopped" in run.after
    assert "1 passed" not in run.stdout


SOAK = """\
import sys
sys.path.insert(0, sys.argv[1])
import soak
from parity.spec import JobSpec, PairSpec

base = JobSpec(task="custom", world_size=2, command=["-m", "job", "--out", "{out}"],
               timeout_s=120)
soak.plan = lambda i, steps: (PairSpec(base, {}, {}), "aligned")
sys.exit(soak.main(["--pairs", "3"]))
"""


@pytest.mark.parity
def test_soak_sighup(tmp_path: Path) -> None:
    """The soak's runs go to a temp folder, which goes with the interruption."""
    (tmp_path / "job.py").write_text(_job(sleep=True))
    cmd = [sys.executable, "-c", SOAK, str(ROOT / "benchmarks")]
    wait = _glob_pid_files(tmp_path / "tmpdir")
    run = SignalledRun(cmd, tmp_path, wait, signal.SIGHUP, tmp_path)
    run.assert_clean(signal.SIGHUP, "soak: interrupted", tmp_path)
    assert "after 0 of 3 pairs" in run.after


# --- closed pipes --------------------------------------------------------------------------------


def _into_closed_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader is gone before anything is written (`| head`)."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(
            _cli(*args), cwd=cwd, env=env, stdout=write, stderr=subprocess.PIPE, text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)


def test_compare_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    for name, nudge in (("a", 0.0), ("b", 1e-3)):
        lines = [json.dumps({"step": i, "train/loss": 1.0 / i + nudge}) for i in range(1, 200)]
        lines.append(json.dumps({"event": "end", "steps": 199}))
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    proc = _into_closed_pipe(["compare", "a.jsonl", "b.jsonl"], tmp_path)
    assert (proc.returncode, proc.stderr) == (signals.EXIT_CLOSED_PIPE, "")


def test_mutants_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    proc = _into_closed_pipe(["mutants"], ROOT)
    assert (proc.returncode, proc.stderr) == (signals.EXIT_CLOSED_PIPE, "")


# --- parity.run.signals itself (in this process) ----------------------------------------------


@pytest.fixture
def handler():
    """This module's handler for the test, the previous handlers (whichever) back after it."""
    restore = signals.install()
    try:
        yield
    finally:
        restore()


@pytest.mark.parametrize("sig", signals.SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_each_signal_raises_interrupted(handler, sig: int) -> None:
    with pytest.raises(signals.Interrupted) as caught:
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises here, in the main thread
    assert isinstance(caught.value, KeyboardInterrupt)
    assert (caught.value.signum, caught.value.exit_code) == (sig, EXIT[sig])
    assert signals.received() == sig


def test_deferred_holds_a_signal_and_later_ones_are_ignored(handler) -> None:
    """SIGINT, then CI's SIGTERM during the cleanup: the cleanup ends, the first one counts."""
    done = []
    with pytest.raises(signals.Interrupted) as caught:
        with signals.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("cleanup")
        pytest.fail("not raised at the end of the deferred block")
    assert done == ["cleanup"] and caught.value.signum == signal.SIGINT
    os.kill(os.getpid(), signal.SIGTERM)  # an interruption is under way: ignored
    time.sleep(0.05)
    assert signals.received() == signal.SIGINT


def test_an_ignored_signal_stays_ignored() -> None:
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals.cancellable() as owner:
            if owner:
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
