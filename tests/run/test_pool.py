"""Warm pools (parity.run.pool; their ranks: parity.rank.serve): many jobs in one launch give the
bits separate launches give.

The parity test runs, in one pool after a job that failed there (so in the second pool): a job
with a mutant that patches torch itself, then the clean job, then the legacy trainer, and
compares them with a launch of its own (the one tests/run/test_inprocess.py needs too). The rest
drive a pool rank without torchrun.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from parity import assert_parity
from parity.files import launch_dir
from parity.judge.compare import compare_frames
from parity.plugin import ParityRunner
from parity.run.job import Run
from parity.run.launch import LaunchResult
from parity.run.pool import Pools
from parity.spec import JobSpec
from tests.specs import LAUNCH_MODES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parity
def test_pool_jobs_are_bitwise_separate_launches(parity_runner, tmp_path):
    pools = Pools(tmp_path / "pools")
    broken_spec = dataclasses.replace(LAUNCH_MODES, inject=["sampler-seed-from-time"])
    bad_spec = dataclasses.replace(LAUNCH_MODES, overrides={"val_samples": -1})
    try:
        failed = pools.run(bad_spec, tmp_path / "failed")
        broken = pools.run(broken_spec, tmp_path / "broken")
        clean = pools.run(LAUNCH_MODES, tmp_path / "clean")
        legacy = pools.run(dataclasses.replace(LAUNCH_MODES, trainer="legacy"), tmp_path / "legacy")
    finally:
        pools.close()
    assert failed is None  # its pool went down with it; launched alone it says why
    assert sorted(p.name for p in (tmp_path / "pools").iterdir()) == ["pool00-w2", "pool01-w2"]
    alone = parity_runner.job(LAUNCH_MODES, separate=True)
    assert clean.in_process and not alone.in_process
    assert_parity(clean, alone)
    import torch
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.dir / "final.safetensors")) for r in (clean, alone))
    assert all(torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa)
    assert_parity(legacy, clean)
    # the mutant (another data order) reached its own job only, and was undone after it
    diverged = compare_frames(broken.metrics, alone.metrics).failures
    assert min(r.first_divergent_step for r in diverged) == 1
    log = (launch_dir(broken.dir) / "launcher.log").read_text()
    assert "pool01-w2" in log
    assert log.startswith("# ") and f"--out {broken.dir}" in log.splitlines()[0]
    for run in (broken, clean, legacy):
        assert run.launch.ok and run.launch.duration_s > 0
        for rank in (0, 1):
            assert run.launch.rank_logs[rank].is_file()


def test_a_pool_rank_runs_queued_jobs_then_stops(tmp_path):
    """One process, no torchrun: two jobs from the queue, each run as `python -m` runs it, into
    its own logs, then stop."""
    module = tmp_path / "pooljob_demo.py"
    module.write_text(
        textwrap.dedent(
            """
            import sys
            from pathlib import Path

            print("out of", sys.argv[1])
            print("err of", sys.argv[1], file=sys.stderr)
            Path(sys.argv[1] + ".txt").write_text(" ".join(sys.argv[1:]))
            """
        )
    )
    queue = tmp_path / "queue"
    queue.mkdir()
    for n, name in enumerate(("one", "two")):
        logs = str(tmp_path / name / "logs")
        job = {"module": "pooljob_demo", "args": [str(tmp_path / name)], "logs": logs}
        (queue / f"job-{n:04d}.json").write_text(json.dumps(job))
    (queue / "job-0002.json").write_text(json.dumps({"stop": True}))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "parity.rank.serve", "--queue", str(queue),
           "--parent", str(os.getpid())]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for n, name in enumerate(("one", "two")):
        assert (tmp_path / f"{name}.txt").read_text() == str(tmp_path / name)  # as sys.argv[1:]
        done = json.loads((queue / f"done-{n:04d}.rank0.json").read_text())
        assert done["module"] == "pooljob_demo" and done["seconds"] >= 0 and done["exitcode"] == 0
        logs = tmp_path / name / "logs" / "0"
        assert (logs / "stdout.log").read_text() == f"out of {tmp_path / name}\n"
        assert (logs / "stderr.log").read_text() == f"err of {tmp_path / name}\n"
    assert "out of" not in proc.stdout


def test_a_pool_rank_exits_when_its_harness_is_gone(tmp_path):
    queue = tmp_path / "queue"
    queue.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout  # fmt: skip
    cmd = [sys.executable, "-m", "parity.rank.serve", "--queue", str(queue),
           "--parent", gone.strip()]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_pool_rank_whose_preload_fails_runs_nothing(tmp_path):
    """Exit 2 with one line naming the module, also in the queue for the harness to raise; the
    queued job is never run."""
    queue = tmp_path / "queue"
    queue.mkdir()
    job = {"module": "json.tool", "args": ["--help"], "logs": str(tmp_path / "logs")}
    (queue / "job-0000.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "parity.rank.serve", "--queue", str(queue),
           "--parent", str(os.getpid()), "--preload", "json,no_such_module_here"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    line = "preload: cannot import 'no_such_module_here': ModuleNotFoundError: No module named"
    assert proc.returncode == 2 and proc.stderr.startswith(f"parity: error: {line}")
    assert (queue / "preload-error.txt").read_text().startswith(line)
    assert not (tmp_path / "logs").exists() and not list(queue.glob("done-*"))


def test_a_pool_runs_a_job_only_in_the_folder_and_environment_it_started_in(tmp_path, monkeypatch):
    """A pool's ranks keep the folder and the variables they started with; a plain launch takes
    this process's at each job. So once a test changes them (monkeypatch.chdir, setenv), the
    next job gets a new pool, and the session's cache of runs a new run: never the old ones."""
    import parity.run.pool

    started: list[tuple] = []

    class FakePool:
        def __init__(self, folder, nproc, torchrun_args, preload):
            self.context, self.alive = parity.run.pool.context(), True
            started.append(self.context)

        def run(self, spec, out):
            return None

        def kill(self):
            self.alive = False

    monkeypatch.setattr(parity.run.pool, "Pool", FakePool)
    pools = Pools(tmp_path / "pools")
    spec = JobSpec(task="charcount-sft", world_size=2)
    monkeypatch.chdir(tmp_path)
    pools.run(spec, tmp_path / "one")
    pools.run(spec, tmp_path / "two")  # nothing changed: the same pool
    assert len(started) == 1
    (tmp_path / "hard").mkdir()
    monkeypatch.chdir(tmp_path / "hard")
    pools.run(spec, tmp_path / "three")
    monkeypatch.setenv("PROBE_MODE", "hard")
    pools.run(spec, tmp_path / "four")
    assert len(started) == 3 and started[1][0] == str(tmp_path / "hard")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # pytest's own: the same
    pools.run(spec, tmp_path / "five")
    assert len(started) == 3
    key = ParityRunner._key(spec)
    monkeypatch.chdir(tmp_path)
    assert ParityRunner._key(spec) != key


def test_runner_launches_alone_what_a_pool_cannot_run(tmp_path, monkeypatch):
    """A job the pool refuses (two nodes) or fails on is launched alone, in a folder of its own;
    one that ran in the pool is cached, and `separate=True` still launches."""
    import parity.run.job

    frame = pd.DataFrame({"train/loss": [1.0]}, index=pd.Index([1], name="step"))
    launches, pooled = [], []

    def fake(spec, out, in_process):
        launch = LaunchResult(returncode=0, timed_out=False, duration_s=1.0, run_dir=Path(out))
        return Run(spec, Path(out), launch, frame, in_process=in_process)

    def run_job(spec, out, label=None, **kwargs):
        launches.append(Path(out).name)
        return fake(spec, out, False)

    def pool_run(spec, out):
        pooled.append(Path(out).name)
        return None if spec.seed == 1 else fake(spec, out, True)

    monkeypatch.setattr(parity.run.job, "run_job", run_job)
    runner = ParityRunner(tmp_path, pool=True)
    monkeypatch.setattr(runner.pools, "run", pool_run)
    ok = runner.job(JobSpec(task="charcount-sft", world_size=2))
    assert ok.in_process and pooled == ["000-charcount-sft-worker-w2"] and not launches
    assert runner.job(JobSpec(task="charcount-sft", world_size=2)) is ok and len(pooled) == 1
    failed = runner.job(
        JobSpec(task="charcount-sft", world_size=2, seed=1)
    )  # the pool failed on it
    assert not failed.in_process and launches == ["001-charcount-sft-worker-w2-alone"]
    alone = runner.job(JobSpec(task="charcount-sft", world_size=2), separate=True)
    assert not alone.in_process and len(launches) == 2 and len(pooled) == 2
    two_nodes = JobSpec(task="charcount-sft", world_size=2, nnodes=2)
    assert Pools.refusal(two_nodes) and "one node" in Pools.refusal(two_nodes)
