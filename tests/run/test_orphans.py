"""No process of a launch outlives it: not when the harness is SIGKILLed (torchrun, its ranks, the
plain job), not a helper the job started with an empty environment in a session of its own
(parity.run.launch, parity/run/watchdog.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.run.launch import PLAIN_LOGS, LaunchRequest, launch_plain
from tests.run.procs import procs_mentioning

ROOT = Path(__file__).resolve().parents[2]
DUMMY = ROOT / "tests" / "jobs" / "dummy_job.py"
PLAIN = ROOT / "tests" / "jobs" / "plain_job.py"


def _gone_within(text: str, seconds: float) -> list[str]:
    """The processes mentioning ``text`` still alive after ``seconds`` (or [] once none is)."""
    deadline = time.monotonic() + seconds
    while (left := procs_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_mentioning(text: str) -> None:
    """What a failed test left, SIGKILLed by pid."""
    for line in procs_mentioning(text):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dead(pid: int) -> bool:
    """Gone, or a zombie (killed, not yet reaped by whoever it was reparented to)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].startswith("Z")


HELPER_JOB = """\
import subprocess, sys, time
from pathlib import Path
here = Path(sys.argv[1])
helper = subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(300)",
                           str(here)], env={}, stdout=subprocess.DEVNULL)
(here / "helper.pid").write_text(str(helper.pid))
time.sleep(1)
"""


DAEMON_JOB = """\
import subprocess, sys, time
from pathlib import Path
here = Path(sys.argv[1])
sleeper = f"{sys.executable} -c 'import time; time.sleep(300)' {here} </dev/null >/dev/null 2>&1"
subprocess.run(["/bin/sh", "-c", f"setsid {sleeper} & echo $! > {here}/helper.pid"], env={})
time.sleep(1)
"""


@pytest.mark.parametrize("job", [HELPER_JOB, DAEMON_JOB], ids=["child", "double-fork"])
def test_a_helper_with_an_empty_environment_in_its_own_session_is_killed(
    tmp_path: Path, job: str
) -> None:
    """It carries no launch id; the watchdog knew it as the job's child, or (its parent, a shell,
    gone before the watchdog's next look) as an orphan the launch's root adopted."""
    script = tmp_path / "job.py"
    script.write_text(job)
    try:
        request = LaunchRequest([str(script), str(tmp_path)], 1, tmp_path / "launch")
        result = launch_plain(request)
        assert result.ok, result.describe()
        helper = int((tmp_path / "helper.pid").read_text())
        assert _gone_within(str(tmp_path), 2) == []
        assert _dead(helper)
    finally:
        _kill_mentioning(str(tmp_path))


HARNESS = {
    "torchrun": (
        "import sys; from pathlib import Path; "
        "from parity.run.launch import LaunchRequest, launch; "
        "launch(LaunchRequest([sys.argv[1], sys.argv[2]], nproc=2, "
        "run_dir=Path(sys.argv[2]) / 'launch', env={'DUMMY_MODE': 'hang'}, timeout_s=120))",
        DUMMY,
        lambda folder: [p for p in folder.glob("launch/logs/*/attempt_0/*/stdout.log")
                        if "up" in p.read_text()],
    ),
    "plain": (
        "import sys; from pathlib import Path; from parity.run.launch import LaunchRequest, "
        "launch_plain; launch_plain(LaunchRequest([sys.argv[1], '--mode', 'hang', '--out', "
        "sys.argv[2] + '/out'], nproc=1, run_dir=Path(sys.argv[2]) / 'launch', timeout_s=120))",
        PLAIN,
        lambda folder: [p for p in [folder / "launch" / PLAIN_LOGS / "stdout.log"]
                        if p.exists() and "up" in p.read_text()],
    ),
}  # fmt: skip


@pytest.mark.parity
@pytest.mark.parametrize("kind", sorted(HARNESS))
def test_a_sigkilled_harness_leaves_no_job_running(tmp_path: Path, kind: str) -> None:
    """SIGKILL runs no cleanup of the harness: torchrun and its ranks (or the plain job) must
    still end, at once, so that none writes into a later run's folder."""
    code, job, up = HARNESS[kind]
    harness = subprocess.Popen([sys.executable, "-c", code, str(job), str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(up(tmp_path)) < (2 if kind == "torchrun" else 1):
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.2)
        harness.kill()
        harness.wait()
        assert _gone_within(str(tmp_path), 5) == []
    finally:
        harness.kill()
        _kill_mentioning(str(tmp_path))
