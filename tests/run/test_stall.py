"""A hung job is stopped when it writes no new step for its stall time (parity.run.stall), not
waited out to its timeout, and the failure names where each rank waits, from the stacks every
rank dumps on the harness's signal (parity.run.stacks) before it is killed: the torchrun launch,
the plain one, and the timeout path. tests/jobs/stall_job.py hangs on purpose."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from parity.cli import main
from parity.errors import SpecError
from parity.run.job import run_job
from parity.run.launch import LaunchError, survivors
from parity.run.stacks import STACK_SIGNAL, summary
from parity.run.stall import FLOOR_S, Stalled, StallWatch, stall_limit
from parity.spec import JobSpec
from tests.run.procs import procs_mentioning

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "jobs" / "stall_job.py"


def _line(text: str) -> int:
    """The line of stall_job.py that holds ``text``."""
    return next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if text in line)


def _failed(spec: JobSpec, out: Path) -> tuple[LaunchError, float]:
    """Run ``spec``, which must fail; the error and the seconds from its last step written to
    the failure."""
    with pytest.raises(LaunchError) as caught:
        run_job(spec, out)
    failed_at = time.time()
    assert survivors(caught.value.result.launch_id) == []
    assert procs_mentioning(str(out)) == []
    return caught.value, failed_at - (out / "metrics.jsonl").stat().st_mtime


@pytest.mark.parity
def test_a_collective_only_rank_0_entered_is_named_well_before_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(f'command = ["{JOB}", "--out", "{{out}}"]\nworld_size = 2\n'
                    f"timeout_s = 300\nstall = 3\n")  # fmt: skip
    start = time.monotonic()
    code = main(["pair", "--spec", str(spec), "--out", str(tmp_path / "pair"), "--json"])
    took = time.monotonic() - start
    assert code == 3 and took < 60
    verdict = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert verdict["verdict"] == "failed" and verdict["reason"] == "stall"
    assert verdict["stall"].startswith("no new step for 3.") and "stall = 3 s" in verdict["stall"]
    reduce_at, barrier_at = _line("dist.all_reduce(self.value)"), _line("dist.barrier()")
    assert verdict["stacks"] == (
        f"rank 0 waits in all_reduce at stall_job.py:{reduce_at} (inside rec.log); "
        f"rank 1 in barrier at stall_job.py:{barrier_at}"
    )
    assert verdict["stacks"] in verdict["error"]  # the line the CLI prints
    for rank, path in enumerate(verdict["stack_files"]):
        assert Path(path).name == f"rank{rank}.txt"
        assert "most recent call first" in Path(path).read_text()
    assert f"stacks: {', '.join(verdict['stack_files'])}" in verdict["error"]
    # what a CI step summary shows: the report says which side stalled and where each rank waits
    report = (tmp_path / "pair" / "report.md").read_text()
    assert report.startswith("# parity: failed\n") and "(no new step for 3." in report
    assert verdict["stacks"].split(" at ")[0] in report and verdict["stack_files"][1] in report
    assert "parity: failed" in (tmp_path / "pair" / "report.html").read_text()
    summary = json.loads((tmp_path / "pair" / "summary.json").read_text())
    assert summary["verdict"] == "failed" and summary["launch"]["reason"] == "stall"


@pytest.mark.parity
def test_a_plain_job_that_sleeps_is_named_at_its_line(tmp_path: Path) -> None:
    spec = JobSpec(command=[str(JOB), "--out", "{out}", "--mode", "sleep", "--steps", "2"],
                   distributed=False, stall=2, timeout_s=300)  # fmt: skip
    error, detected_s = _failed(spec, tmp_path / "run")
    result = error.result
    assert result.reason == "stall" and not result.timed_out
    line = _line("time.sleep(3600)")
    assert result.stacks.startswith(f"rank 0 waits at stall_job.py:{line} in main: time.sleep(")
    assert [p.name for p in result.stack_files] == ["rank0.txt"]
    assert 2.0 < detected_s < 8.0, detected_s  # the stall time, the dump's wait, the kill


@pytest.mark.parity
def test_a_timeout_also_names_where_each_rank_waits(tmp_path: Path) -> None:
    spec = JobSpec(command=[str(JOB), "--out", "{out}"], world_size=2, stall="off", timeout_s=20)
    error, _ = _failed(spec, tmp_path / "run")
    result = error.result
    assert result.reason == "timeout" and result.timed_out and not result.stalled
    assert result.stacks.startswith("rank 0 waits in all_reduce at stall_job.py:")
    assert "rank 1 in barrier at stall_job.py:" in result.stacks
    text = str(error)
    assert "timed out after 20 s" in text and result.stacks in text
    assert sorted(p.name for p in result.stack_files) == ["rank0.txt", "rank1.txt"]


@pytest.mark.parity
def test_a_plain_job_s_own_ranks_are_named_where_they_wait(tmp_path: Path) -> None:
    """A plain job that starts its own 2 ranks (as Ray's workers are started: RANK and
    WORLD_SIZE given before the interpreter starts), one of which never joins the all-reduce:
    at the timeout, each of those ranks is asked for its stacks, not the plain process."""
    job = Path(__file__).resolve().parents[1] / "jobs" / "plain_ranks.py"
    spec = JobSpec(command=[str(job), "--out", "{out}", "--hang"], distributed=False,
                   world_size=2, timeout_s=25)  # fmt: skip
    with pytest.raises(LaunchError) as caught:
        run_job(spec, tmp_path / "run")
    result = caught.value.result
    assert survivors(result.launch_id) == [] and procs_mentioning(str(tmp_path / "run")) == []
    assert result.reason == "timeout" and result.timed_out
    assert result.stacks.startswith("rank 0 waits in all_reduce at "), result.stacks
    assert "; rank 1 at <string>:" in result.stacks, result.stacks  # where it sleeps
    assert sorted(p.name for p in result.stack_files) == ["rank0.txt", "rank1.txt"]


FIFO_JOB = """\
import os, sys, time
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
os.mkfifo(os.path.join(out, "metrics.jsonl"))  # an open of it blocks until a writer comes
time.sleep(3600)
"""


@pytest.mark.parity
def test_a_metrics_file_that_is_a_fifo_cannot_stop_the_timeout(tmp_path: Path) -> None:
    """The harness polls the metrics file while the job runs; a FIFO there blocked that open,
    and with it the loop that enforces the timeout: the command hung for good. It is now no
    file to read, and the job is stopped at its timeout (exit 3)."""
    import subprocess
    import sys

    job = tmp_path / "fifo_job.py"
    job.write_text(FIFO_JOB)
    spec = tmp_path / "pair.toml"
    spec.write_text(f'task = "custom"\ndistributed = false\ntimeout_s = 4\n'
                    f'command = ["{job}", "{{out}}"]\n')  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "parity.cli", "pair", "--spec", str(spec), "--out",
         str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "timed out" in done.stderr or "timeout" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 30  # the timeout, the stacks' wait: no read of the FIFO
    assert procs_mentioning(str(tmp_path / "out")) == []


def test_a_job_that_ends_normally_leaves_no_stacks_folder(tmp_path: Path) -> None:
    from parity.run.launch import LaunchRequest, launch_plain

    script = tmp_path / "quick.py"
    script.write_text("print('done')\n")
    result = launch_plain(LaunchRequest([str(script)], 1, tmp_path / "launch"))
    assert result.ok and not result.stacks
    assert not (tmp_path / "launch" / "stacks").exists()


# --- the stall time's arithmetic, no launch -----------------------------------------------------


def test_auto_is_five_times_the_slowest_step_with_a_floor_and_nothing_before_the_first() -> None:
    assert stall_limit("auto", steps=0, slowest_s=0.0) is None  # start-up: the timeout alone
    assert stall_limit("auto", steps=1, slowest_s=0.0) == FLOOR_S
    assert stall_limit("auto", steps=5, slowest_s=10.0) == FLOOR_S  # 50 s: the floor
    assert stall_limit("auto", steps=5, slowest_s=60.0) == 300.0
    assert stall_limit(3, steps=1, slowest_s=100.0) == 3.0
    assert stall_limit("off", steps=9, slowest_s=1.0) is None


def test_the_watch_measures_the_slowest_gap_between_new_steps(tmp_path: Path) -> None:
    metrics, now = tmp_path / "metrics.jsonl", [0.0]
    watch = StallWatch(metrics, "auto", clock=lambda: now[0])
    watch.check()  # no file yet: nothing
    metrics.write_text('{"step": 1, "loss": 1}\n{"step": 1, "lr": 2}\n')
    now[0] = 5.0
    watch.check()
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 1}\n{"step": 3, "lo')  # a line being written: not yet
    now[0] = 35.0
    watch.check()
    assert watch.steps == {1, 2} and watch.slowest_s == 30.0
    now[0] = 35.0 + 5 * 30.0 - 1
    watch.check()  # within 5x the slowest step
    now[0] = 35.0 + 5 * 30.0 + 1
    with pytest.raises(Stalled, match=r"no new step for 151.0 s after step 2 \(stall \"auto\""):
        watch.check()
    metrics.write_text('{"step": 1, "loss": 1}\n')  # a resume rewrote it: steps again count
    watch.check()
    assert watch.steps == {1} and watch.last_at == now[0]
    with open(metrics, "a") as f:
        f.write('{"event": "end", "steps": 3}\n')
    now[0] += 1000
    watch.check()  # the end record: the hang-at-exit grace's business from here


def test_stall_is_auto_off_or_seconds() -> None:
    assert JobSpec(command=["x.py"]).stall == "auto"
    assert JobSpec(command=["x.py"], stall=30).stall == 30
    for bad in ("soon", 0, -1, float("inf"), True):
        with pytest.raises(SpecError, match="stall"):
            JobSpec(command=["x.py"], stall=bad)


def test_the_summary_names_each_rank_and_one_without_a_dump() -> None:
    dump = (
        "Thread 0x01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 324 in wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        "Current thread 0x02 (most recent call first):\n"
        '  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", '
        "line 5356 in broadcast\n"
        '  File "/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in '
        "wrapper\n"
        '  File "/repo/train.py", line 240 in main\n'
        '  File "/repo/train.py", line 300 in <module>\n'
    )
    assert summary({1: "", 0: dump}) == (
        f"rank 0 waits in broadcast at train.py:240; rank 1: no stack (no dump on signal "
        f"{STACK_SIGNAL})"
    )
