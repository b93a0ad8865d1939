"""parity.run.launch: real torchrun runs of tests/jobs/dummy_job.py, and fast unit tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import parity.run.launch as launch_module
from parity.files import launch_dir
from parity.run.job import launch_line, launch_spec
from parity.run.launch import (
    LAUNCH_ID_ENV,
    LaunchError,
    LaunchRequest,
    LaunchResult,
    _has_rdzv_args,
    _kill_leftovers,
    carrying,
    free_port,
    launch,
    launch_or_raise,
    parse_failures,
    survivors,
)
from parity.spec import JobSpec
from tests.run.procs import ctrl_c_once_ready, procs_mentioning

DUMMY = Path(__file__).resolve().parents[1] / "jobs" / "dummy_job.py"


def _run(tmp_path: Path, mode: str, **kwargs) -> LaunchResult:
    env = {"DUMMY_MODE": mode, "DUMMY_RANK": "1", "DUMMY_OUT": str(tmp_path / "out")}
    # the run dir on the worker command line lets the orphan check find the workers
    args = [str(DUMMY), str(tmp_path)]
    result = launch(LaunchRequest(args, nproc=2, run_dir=tmp_path, env=env, **kwargs))
    _assert_no_orphans(tmp_path, result)
    return result


def _assert_no_orphans(tmp_path: Path, result: LaunchResult) -> None:
    assert procs_mentioning(str(tmp_path)) == []
    assert survivors(result.launch_id) == []


class _NotStarted(Exception):
    """Raised in place of starting the launch's processes: the argv is already logged."""


@pytest.mark.parametrize(
    "shape",
    [
        {"world_size": 2, "torchrun_args": ["--max-restarts", "0"]},
        {"world_size": 1, "distributed": False},
        {"world_size": 4, "nnodes": 2},
    ],
    ids=["torchrun", "plain", "two-nodes"],
)
def test_the_previewed_launch_line_is_the_one_launch_runs(shape, tmp_path, monkeypatch) -> None:
    """`parity spec --command`'s line (launch_line) equals launcher.log's first line of the real
    launch of the same spec, env and secrets included; two nodes: node 0's, the rendezvous'
    endpoint and id made at launch standing for the preview's PORT and RDZV_ID."""

    def not_started(*args, **kwargs):
        raise _NotStarted

    monkeypatch.setattr(launch_module, "_supervise", not_started)
    env = {"NEW_IMPL": "1", "API_TOKEN": "s3cret"}
    spec = JobSpec(task="custom", command=["train.py", "--out", "{out}"], env=env, **shape)
    out = tmp_path / "run"
    with pytest.raises(_NotStarted):
        launch_spec(spec, out, "a")
    node = "node0/" if spec.nnodes > 1 else ""
    logged = (launch_dir(out) / f"{node}launcher.log").read_text().splitlines()[0]
    logged = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", logged)
    logged = re.sub(r"--rdzv-id parity-\w+", "--rdzv-id RDZV_ID", logged)
    assert logged == f"# {launch_line(spec, out)}"
    assert "s3cret" not in logged


@pytest.mark.parity
def test_ok_run_writes_metrics_and_logs(tmp_path: Path) -> None:
    result = _run(tmp_path, "ok")
    assert result.ok, result.describe()
    assert result.failures == []
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert records[-1] == {"event": "end", "steps": 3}
    assert sorted(result.rank_logs) == [0, 1]
    assert all(p.exists() for p in result.rank_logs.values())
    assert "rank 1 up" in result.tail(1)
    assert (tmp_path / "launcher.log").exists()
    assert "succeeded" in result.describe()


@pytest.mark.parity
def test_raise_names_rank_and_traceback(tmp_path: Path) -> None:
    env = {"DUMMY_MODE": "raise", "DUMMY_RANK": "1"}
    with pytest.raises(LaunchError) as info:
        launch_or_raise(LaunchRequest([str(DUMMY), str(tmp_path)], 2, tmp_path, env=env))
    result = info.value.result
    _assert_no_orphans(tmp_path, result)
    first = result.failures[0]
    assert (first.rank, first.exitcode, first.signal) == (1, 1, None)
    assert "boom from rank 1" in first.log_tail
    assert "rank 1: exit code 1" in str(info.value)
    assert "boom from rank 1" in str(info.value)


@pytest.mark.parity
def test_sigkill_reports_signal(tmp_path: Path) -> None:
    result = _run(tmp_path, "sigkill")
    assert not result.ok and not result.timed_out
    first = result.failures[0]
    assert (first.rank, first.exitcode, first.signal) == (1, -9, "SIGKILL")
    assert "rank 1: killed by SIGKILL" in result.describe()


@pytest.mark.parity
def test_hung_collective_times_out_and_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    # ranks are up 3-5 s after the start (5.2 s seen in a slow period of this VM): the
    # timeout leaves room for a VM twice as slow, so that their "up" lines are in the report
    result = _run(tmp_path, "hang", timeout_s=12)
    assert time.monotonic() - start < 24
    assert result.timed_out and not result.ok
    report = result.describe()
    assert "timed out after 12 s" in report
    assert "rank 0 up" in report and "rank 1 up" in report


@pytest.mark.parity
def test_exit_code_with_explicit_rendezvous(tmp_path: Path) -> None:
    # multi-node style arguments go through untouched (no --standalone)
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    result = _run(tmp_path, "exit3", torchrun_args=args)
    assert "--standalone" not in (tmp_path / "launcher.log").read_text().splitlines()[0]
    first = result.failures[0]
    assert (first.rank, first.exitcode, first.signal) == (1, 3, None)


# --- fast tests without torchrun ---------------------------------------------------------------

_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
job.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_13:18:57
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 3793)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3793
[2]:
  time      : 2026-12-02_13:18:57
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -6 (pid: 3795)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 3795
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_13:18:57
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 3794)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    RuntimeError: Connection closed by peer
============================================================
"""


def _fake_result(tmp_path: Path, logs: dict[int, str]) -> LaunchResult:
    rank_logs = {}
    for rank, text in logs.items():
        d = tmp_path / str(rank)
        d.mkdir()
        (d / "stdout.log").write_text(f"rank {rank} up\n")
        (d / "stderr.log").write_text(text)
        rank_logs[rank] = d / "stderr.log"
    return LaunchResult(1, False, 1.0, tmp_path, rank_logs=rank_logs)


def test_parse_summary_puts_likely_root_cause_first(tmp_path: Path) -> None:
    logs = {0: "RuntimeError: Connection closed by peer\n", 1: "", 2: "double free\n"}
    result = _fake_result(tmp_path, logs)
    failures = parse_failures(_SUMMARY, result)
    assert [(f.rank, f.exitcode, f.signal) for f in failures] == [
        (2, -6, "SIGABRT"),
        (0, 1, None),
        (1, -15, "SIGTERM"),
    ]
    assert "double free" in failures[0].log_tail and "rank 2 up" in failures[0].log_tail
    result.failures = failures
    report = result.describe()
    assert report.index("rank 2: killed by SIGABRT") < report.index("rank 0: exit code 1")


def test_parse_agent_line_without_summary(tmp_path: Path) -> None:
    text = "E1202 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 3794) of binary: python\n"
    failures = parse_failures(text, _fake_result(tmp_path, {0: "", 1: "oom\n"}))
    assert [(f.rank, f.signal) for f in failures] == [(1, "SIGKILL")]


def test_a_job_gets_none_of_git_s_repository_variables(tmp_path: Path, monkeypatch) -> None:
    """A hook's GIT_INDEX_FILE or a shell's GIT_DIR would point the job's git (the recorder's
    revision, a job's own `git status`, which rewrites the index) at the caller's repository
    from a check's worktree: a launch drops them, and the rest of the environment reaches it."""
    for name in ("GIT_INDEX_FILE", "GIT_DIR", "GIT_WORK_TREE", "GIT_CONFIG_KEY_0"):
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("GIT_AUTHOR_NAME", "kept")
    env = launch_module._launch_env(tmp_path / "world", {"MY_VAR": "1"})
    assert not {"GIT_INDEX_FILE", "GIT_DIR", "GIT_WORK_TREE", "GIT_CONFIG_KEY_0"} & set(env)
    assert env["GIT_AUTHOR_NAME"] == "kept" and env["MY_VAR"] == "1"


def test_rdzv_detection_and_free_port() -> None:
    assert not _has_rdzv_args([])
    assert not _has_rdzv_args(["--max-restarts", "0"])
    assert _has_rdzv_args(["--nnodes", "2"])
    assert _has_rdzv_args(["--rdzv_endpoint=host:1234"])
    assert _has_rdzv_args(["--master-port", "29500"])
    assert 0 < free_port() < 65536


def test_describe_without_parsed_failures_shows_launcher_log(tmp_path: Path) -> None:
    log = tmp_path / "launcher.log"
    log.write_text("usage: torchrun ...\nerror: unrecognized arguments\n")
    result = LaunchResult(2, False, 0.5, tmp_path, launcher_log=log)
    assert "unrecognized arguments" in result.describe()
    assert "exit code 2" in str(LaunchError(result))


def test_orphan_in_its_own_session_is_killed() -> None:
    """A marked grandchild that escaped into a new session (as torchrun workers do) is found."""
    launch_id = "test-" + os.urandom(4).hex()
    env = {**os.environ, LAUNCH_ID_ENV: launch_id}
    spawn = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "stdout=subprocess.DEVNULL, "
        "start_new_session=True); print(p.pid)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn], env=env, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    orphan = int(parent.communicate()[0])
    assert parent.returncode == 0
    assert orphan in survivors(launch_id)
    _kill_leftovers(parent.pid, launch_id)  # the parent's group is gone, like a killed torchrun
    assert survivors(launch_id) == []


def test_every_launcher_takes_one_request() -> None:
    """What a launch runs is one ``LaunchRequest``, the same for each launcher (their own
    settings are keywords after it), and a caller's later change of its lists cannot reach it."""
    import dataclasses
    import inspect

    from parity.run import slurm

    for launcher in (launch, launch_module.launch_plain, launch_module.launch_nodes, slurm.launch):
        params = list(inspect.signature(launcher).parameters.values())
        assert params[0].name == "request", launcher.__name__
        assert all(p.kind is p.KEYWORD_ONLY for p in params[1:]), launcher.__name__
    args, env = ["job.py"], {"SEED": "1"}
    request = LaunchRequest(args, nproc=2, run_dir=Path("r"), env=env, torchrun_args=["--x"])
    args.append("--late")
    env["LATE"] = "1"
    assert request.module_or_script_args == ("job.py",) and request.env == {"SEED": "1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.nproc = 4  # type: ignore[misc]


def test_proc_scan_finds_marked_or_grouped_processes_but_no_zombie() -> None:
    """``carrying`` and ``survivors`` share one /proc walk: a process is found by the mark in its
    environment or (``survivors``' pgid) by its group, and one that exited unreaped is not."""
    mark = "test-" + os.urandom(4).hex()
    marked_env = {**os.environ, LAUNCH_ID_ENV: mark}
    marked = subprocess.Popen(["sleep", "60"], env=marked_env, start_new_session=True)
    unmarked = subprocess.Popen(["sleep", "60"], start_new_session=True)
    zombie = subprocess.Popen(["true"], env=marked_env)
    try:
        deadline = time.monotonic() + 10
        while ") Z " not in Path(f"/proc/{zombie.pid}/stat").read_text():
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.02)
        assert carrying(LAUNCH_ID_ENV, mark) == [marked.pid]
        assert survivors(mark) == [marked.pid]
        assert sorted(survivors(mark, unmarked.pid)) == sorted([marked.pid, unmarked.pid])
    finally:
        for proc in (marked, unmarked):
            proc.kill()
        for proc in (marked, unmarked, zombie):
            proc.wait()


@pytest.mark.parity
def test_ctrl_c_in_parent_kills_the_job(tmp_path: Path, interruptible) -> None:
    """KeyboardInterrupt while waiting must not leave torchrun or its workers running."""
    code = (
        "import sys; from pathlib import Path; "
        "from parity.run.launch import LaunchRequest, launch; "
        "launch(LaunchRequest([sys.argv[1], sys.argv[2]], nproc=2, run_dir=Path(sys.argv[2]), "
        "env={'DUMMY_MODE': 'hang'}, timeout_s=120))"
    )
    logs = tmp_path / "logs"
    ctrl_c_once_ready(
        code, [str(DUMMY), str(tmp_path)],
        lambda: any("up" in p.read_text() for p in logs.glob("*/attempt_0/*/stdout.log")),
        interruptible,
    )  # fmt: skip
    assert procs_mentioning(str(tmp_path)) == []
