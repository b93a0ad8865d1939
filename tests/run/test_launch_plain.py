"""parity.run.launch.launch_plain: a job that is not distributed (``distributed = false``) runs as
one plain process, ``python COMMAND``, with launch's timeout, hang-at-exit grace, Ctrl-C and
cleanup, and a failure read as rank 0's. No torchrun, so no torch: the pairs here run with a
``torch`` on the job's path that refuses to import (tests/project/test_install.py runs `check`
of such a job in a venv without torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.run.job import launcher_for
from parity.run.launch import PLAIN_LOGS, LaunchRequest, LaunchResult, launch_plain, survivors
from parity.spec import JobSpec, SpecError
from tests.run.procs import ctrl_c_once_ready, procs_mentioning

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "tests" / "jobs" / "plain_job.py"


def _run(tmp_path: Path, mode: str, **kwargs) -> LaunchResult:
    out = tmp_path / "out"
    args = [str(PLAIN), "--mode", mode, "--out", str(out)]
    result = launch_plain(LaunchRequest(args, nproc=1, run_dir=tmp_path / "launch", **kwargs))
    assert procs_mentioning(str(tmp_path)) == []
    assert survivors(result.launch_id) == []
    return result


def test_a_plain_job_runs_as_one_process_without_rank_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not even those the harness inherited (it runs inside a launch): the job would read them,
    and the start-up hook would record it as a rank of the world it is judged by."""
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29999")):  # fmt: skip
        monkeypatch.setenv(name, value)
    result = _run(tmp_path, "ok")
    assert result.ok, result.describe()
    assert list((tmp_path / "launch" / "world").glob("*.json")) == []
    assert "succeeded" in result.describe() and "no torchrun" in result.describe()
    assert json.loads((tmp_path / "out" / "env.json").read_text()) == dict.fromkeys(
        ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    )
    assert sorted(result.rank_logs) == [0]
    assert "plain job up" in result.tail(0)
    first = (tmp_path / "launch" / "launcher.log").read_text().splitlines()[0]
    assert "torch" not in first and str(PLAIN) in first  # the line that reruns it by hand


@pytest.mark.parametrize(
    ("mode", "exitcode", "signal_name", "in_tail"),
    [("raise", 1, None, "boom from the plain job"), ("exit3", 3, None, "mode=exit3"),
     ("sigkill", -9, "SIGKILL", "mode=sigkill")],
)  # fmt: skip
def test_a_failed_plain_job_is_rank_0_with_its_exit_and_log(
    tmp_path: Path, mode: str, exitcode: int, signal_name: str | None, in_tail: str
) -> None:
    result = _run(tmp_path, mode)
    assert not result.ok and result.reason == "crash"
    (failure,) = result.failures
    assert (failure.rank, failure.exitcode, failure.signal) == (0, exitcode, signal_name)
    assert in_tail in failure.log_tail
    how = f"killed by {signal_name}" if signal_name else f"exit code {exitcode}"
    assert f"rank 0: {how}" in result.describe()


def test_a_hung_plain_job_times_out_and_its_orphan_is_killed(tmp_path: Path) -> None:
    result = _run(tmp_path, "orphan", timeout_s=3)
    assert result.timed_out and result.reason == "timeout"
    assert "timed out after 3 s" in result.describe()
    orphan = int((tmp_path / "out" / "orphan.pid").read_text())
    assert not Path(f"/proc/{orphan}").exists() or "Z" in _state(orphan)


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()[0]


def test_a_plain_job_hung_after_its_output_is_killed_after_the_grace(tmp_path: Path) -> None:
    end = tmp_path / "out" / "metrics.jsonl"
    result = _run(tmp_path, "hang-at-exit", timeout_s=120, exit_grace_s=1,
                  finished=lambda: end.exists() and '"end"' in end.read_text())  # fmt: skip
    assert result.timed_out and result.duration_s < 60
    assert "killed as hung at exit" in result.describe()


def test_ctrl_c_kills_the_plain_job(tmp_path: Path, interruptible) -> None:
    code = (
        "import sys; from pathlib import Path; from parity.run.launch import LaunchRequest, "
        "launch_plain; launch_plain(LaunchRequest([sys.argv[1], '--mode', 'hang', '--out', "
        "sys.argv[2] + '/out'], nproc=1, run_dir=Path(sys.argv[2]) / 'launch', timeout_s=120))"
    )
    stdout = tmp_path / "launch" / PLAIN_LOGS / "stdout.log"

    def up() -> bool:
        return stdout.exists() and "up" in stdout.read_text()

    ctrl_c_once_ready(code, [str(PLAIN), str(tmp_path)], up, interruptible)
    assert procs_mentioning(str(tmp_path)) == []


def test_launch_plain_refuses_ranks_and_torchrun_flags(tmp_path: Path) -> None:
    for bad in ({"nproc": 2}, {"nproc": 1, "torchrun_args": ["--standalone"]}):
        with pytest.raises(ValueError, match="one process"):
            launch_plain(LaunchRequest([str(PLAIN)], run_dir=tmp_path, **bad))


def test_a_plain_job_expected_to_start_ranks_that_started_none_is_failed(tmp_path: Path) -> None:
    """expect_world 2 (``world_size = 2``): the world its ranks formed is judged, as under
    torchrun; a job that started none fails with the judge's line, never as a crash."""
    result = _run(tmp_path, "ok", expect_world=2)
    assert not result.ok and result.reason == "world" and result.failures == []
    assert result.fault.startswith("no rank recorded the world it joined (expected 2)")


def test_a_spec_that_is_not_distributed_gets_the_plain_launcher_here() -> None:
    plain = JobSpec(task="custom", command=["t.py"], distributed=False)
    assert launcher_for(plain) is launch_plain
    assert launcher_for(JobSpec(task="custom", command=["t.py"])) is not launch_plain
    with pytest.raises(SpecError, match="distributed = false runs one plain process.*torchrun"):
        JobSpec(task="custom", command=["t.py"], distributed=False, torchrun_args=["--x"])


SPEC = """\
task = "custom"
distributed = false
steps = 5
timeout_s = 120
command = ["{job}", "--out", "{{out}}"]
[env]
PYTHONPATH = "{no_torch}"
[b]
command = ["{job}", "--out", "{{out}}", "--factor", "{factor}"]
"""


@pytest.mark.parametrize(("factor", "code", "verdict"), [(1.0, 0, "aligned"),
                                                         (1.5, 1, "diverged")])  # fmt: skip
def test_a_pair_of_plain_jobs_is_judged_without_torch(tmp_path, factor, code, verdict) -> None:
    no_torch = tmp_path / "no-torch" / "torch"
    no_torch.mkdir(parents=True)
    (no_torch / "__init__.py").write_text("raise ImportError('no torch on this job\\'s path')\n")
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(job=PLAIN, no_torch=no_torch.parent, factor=factor))
    done = subprocess.run(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", str(spec), "--out",
         str(tmp_path / "pair"), "--json"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["verdict"] == verdict
    if verdict == "diverged":
        assert result["metrics"]["train/loss"]["first_divergent_step"] == 3
    html = (tmp_path / "pair" / "report.html").read_text()
    assert "launcher (one plain process)" in html and "torch.distributed.run" not in html


@pytest.mark.parametrize("writes", ["ckpt.pt", None])
def test_a_job_that_wrote_no_readable_run_is_told_where_the_harness_looked_and_what_it_reads(
    tmp_path: Path, writes: str | None
) -> None:
    """Exit 0 but no run this tool reads (a checkpoint only, or nothing): one line names the
    folder and what would have been read there (metrics.jsonl by parity.record, the formats of
    docs/logs.md, the spec's [read] format) and that the job must write where {out} says."""
    from parity.run.job import run_job
    from parity.run.launch import LaunchError

    code = "import pathlib, sys; [pathlib.Path(sys.argv[1], n).touch() for n in sys.argv[2:]]"
    spec = JobSpec(command=["-c", code, "{out}", *filter(None, [writes])], distributed=False)
    with pytest.raises(LaunchError) as info:
        run_job(spec, tmp_path / "run")
    line = info.value.result.fault
    assert "\n" not in line and f"in {tmp_path / 'run'}: the harness reads metrics.jsonl" in line
    for said in ("record_run", "docs/logs.md", "tensorboard", "[read]", "{out}"):
        assert said in line, said
    assert line.startswith("the job exited 0 but wrote " + ("no run" if writes else "nothing"))
