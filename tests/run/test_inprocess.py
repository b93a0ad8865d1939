"""In-process pairs: both sides in one torchrun launch give the bits two launches give.

The parity tests compare an in-process pair with the same jobs launched one by one (which other
tests need anyway, so the runner's cache shares them); the rest check the refusals and the reset
without launching anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity import assert_parity
from parity.files import launch_dir
from parity.rank.warm import PRELOAD_ERROR, SEPARATOR, _parse
from parity.run.inprocess import command, raise_preload_error, refusal
from parity.spec import JobSpec, PairSpec, SpecError
from tests.needs import subject
from tests.specs import LAUNCH_MODES

ROOT = Path(__file__).resolve().parents[2]


def _same_weights(run, other) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r.dir / "final.safetensors")) for r in (run, other))
    return wa.keys() == wb.keys() and all(
        torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa
    )


@pytest.mark.parity
def test_each_side_is_bitwise_its_own_launch_with_its_own_mutants(parity_runner):
    """lr-before-step on side B only. Side A, run first in the same processes, is bitwise a
    clean launch of its own (every metric, the val loss at each evaluation, the final weights);
    B matches the mutant job run on its own (its peer may be a warm pool's job, which
    test_pool.py shows to be bitwise a launch of its own). Each side's folder holds what a launch
    writes, and its launcher.log's first line reproduces that side alone. (Every preset with
    every mutant: test_fastpaths.py.)"""
    broken = {"trainer": "worker", "inject": ["lr-before-step"]}
    pair = PairSpec(LAUNCH_MODES, {"trainer": "legacy"}, broken)
    together = parity_runner.pair_in_process(pair)
    spec_a, spec_b = pair.sides()
    alone = [parity_runner.job(spec_a, separate=True), parity_runner.job(spec_b)]
    for run, other in zip((together.a, together.b), alone, strict=True):
        assert run.in_process
        comparison = assert_parity(run, other)  # every metric exact; mfu (a timing) ignored
        assert comparison.metrics["train/loss"].steps_compared == LAUNCH_MODES.steps
        val = comparison.metrics["val/loss"]
        assert val.status == "match" and val.steps_compared == 3  # before, between, after
        assert _same_weights(run, other)
        for name in ("metrics.jsonl", "console.log", "manifest.json", "timing.json"):
            assert (run.dir / name).is_file(), name
        first = (launch_dir(run.dir) / "launcher.log").read_text().splitlines()[0]
        assert first.startswith("# ") and f"--out {run.dir}" in first  # reproduces the side
    assert not alone[0].in_process
    lr = together.b.metrics["train/lr"]
    assert lr[1] != alone[0].metrics["train/lr"][1]


# --- without launching --------------------------------------------------------------------------


def test_refusals_are_one_line():
    base = JobSpec(task="charcount-sft", world_size=2)
    assert refusal(base, dataclasses.replace(base, trainer="legacy")) is None
    assert refusal(base, dataclasses.replace(base, inject=["lr-before-step"])) is None
    reason = refusal(base, dataclasses.replace(base, world_size=1))
    assert reason and "world_size" in reason and "\n" not in reason
    two_nodes = dataclasses.replace(base, nnodes=2)
    assert "one node" in refusal(two_nodes, two_nodes)
    script = JobSpec(task="custom", command=["train.py", "--out", "{out}"])
    assert "script" in refusal(script, script)
    assert base.preload == ["worker.boot"]  # the preset's
    reason = refusal(base, dataclasses.replace(base, preload=[]))
    assert reason and "same preload" in reason
    with_env = dataclasses.replace(base, env={"OMP_NUM_THREADS": "2"})
    assert refusal(with_env, dataclasses.replace(with_env, trainer="legacy")) is None  # shared
    assert "same env" in refusal(base, with_env)
    from parity.run.pool import Pools

    assert "env" in Pools.refusal(with_env) and Pools.refusal(base) is None
    from parity.run.inprocess import alone_line  # each side's launcher.log: its launch alone

    assert alone_line(with_env, Path("a")).startswith("# OMP_NUM_THREADS=2 ")


@subject  # the command's own process knows the subject's presets only when it is installed
def test_refusal_is_exit_2_before_any_launch(tmp_path):
    spec = tmp_path / "pair.toml"
    spec.write_text(
        'task = "charcount-sft"\nworld_size = 2\n[a]\ntrainer = "legacy"\n[b]\nworld_size = 1\n'
    )
    cmd = [sys.executable, "-m", "parity.cli", "pair", "--in-process", "--spec", str(spec)]
    proc = subprocess.run(cmd + ["--out", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "same world_size" in proc.stderr
    assert not (tmp_path / "in-process").exists()


def test_command_runs_each_side_with_its_own_mutants(tmp_path):
    base = JobSpec(task="charcount-sft", world_size=2, inject=["lr-before-step"])
    specs = [JobSpec(task="charcount-sft", world_size=2, trainer="legacy"), base]
    args = command(specs, [tmp_path / "a", tmp_path / "b"], tmp_path / "t.json")
    assert args[:2] == ["-m", "parity.rank.warm"] and args.count("parity.rank.mutants") == 1
    opts, sides = _parse(args[2:])
    assert [m for m, _ in sides] == ["worker.sft", "parity.rank.mutants"]
    assert sides[0][1][sides[0][1].index("--trainer") + 1] == "legacy"
    side_args = sides[1][1]  # parity.rank.mutants's: the mutants, then the job
    assert side_args[:4] == ["--mutants", "lr-before-step", "-m", "worker.sft"]
    assert side_args[side_args.index("--out") + 1] == str(tmp_path / "b")
    assert opts.timing == tmp_path / "t.json" and SEPARATOR not in side_args
    with pytest.raises(SystemExit, match="-m MODULE"):
        _parse(["-m", "worker.sft", SEPARATOR, "train.py"])


SIDE = """
import json, os, sys
import sharedstate  # a package of neither side's: its state is process state

def train(argv):
    out = argv[0]
    seen = {"calls": sharedstate.note(), "env": os.environ.get("SIDE_SET"), "argv": sys.argv[1:]}
    os.environ["SIDE_SET"] = out
    with open(out, "w") as f:
        json.dump(seen, f)
    if len(argv) > 1:
        sys.exit(int(argv[1]))

if __name__ == "__main__":
    train(sys.argv[1:])
"""


def _sides_without_torchrun(tmp_path: Path, *sides: list[str]) -> subprocess.CompletedProcess:
    """`python -m parity.rank.warm` with these sides of statejob_demo, as one rank."""
    (tmp_path / "sharedstate.py").write_text("CALLS = []\ndef note():\n    CALLS.append(1)\n"
                                             "    return len(CALLS)\n")  # fmt: skip
    (tmp_path / "statejob_demo.py").write_text(SIDE)
    cmd = [sys.executable, "-m", "parity.rank.warm"]
    for k, args in enumerate(sides):
        cmd += [SEPARATOR] * bool(k) + ["-m", "statejob_demo", *args]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_each_side_is_a_fresh_process(tmp_path):
    """What side A leaves in any module, the environment or argv, side B never sees: each side
    runs in a child of its own, as `python -m MODULE ARGS` (its argv, its exit)."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    proc = _sides_without_torchrun(tmp_path, [str(a)], [str(b)])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(a.read_text()) == {"calls": 1, "env": None, "argv": [str(a)]}
    assert json.loads(b.read_text()) == {"calls": 1, "env": None, "argv": [str(b)]}


PRELOADED = """
import sys
BEFORE_TORCH = "torch" not in sys.modules  # the job's own preload comes before numpy and torch
CALLS = []
def note():
    CALLS.append(1)
    return len(CALLS)
"""
PRELOADED_JOB = """
import json, sys
import sharedstate
with open(sys.argv[1], "w") as f:
    json.dump({"calls": sharedstate.note(), "before_torch": sharedstate.BEFORE_TORCH}, f)
"""


def test_the_preload_is_imported_first_and_each_side_gets_it_fresh(tmp_path):
    """`--preload sharedstate`: imported by the warm process before numpy and torch; side A's
    call does not reach side B, which finds the module as the warm process imported it."""
    (tmp_path / "sharedstate.py").write_text(PRELOADED)
    (tmp_path / "preloaded_demo.py").write_text(PRELOADED_JOB)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    cmd = [sys.executable, "-m", "parity.rank.warm", "--preload", "sharedstate",
           "-m", "preloaded_demo", str(a), SEPARATOR, "-m", "preloaded_demo", str(b)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for side in (a, b):
        assert json.loads(side.read_text()) == {"calls": 1, "before_torch": True}


def test_a_preload_that_fails_to_import_ends_the_rank_with_one_line(tmp_path):
    """Exit 2, one line naming the module on stderr and beside the timing file, no side run."""
    (tmp_path / "statejob_demo.py").write_text(SIDE)
    (tmp_path / "broken_boot.py").write_text("raise RuntimeError('no GPU here\\nsecond line')\n")
    a = tmp_path / "a.json"
    cmd = [sys.executable, "-m", "parity.rank.warm", "--timing", str(tmp_path / "t.json"),
           "--preload", "broken_boot", "-m", "statejob_demo", str(a)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    line = "preload: cannot import 'broken_boot': RuntimeError: no GPU here"
    assert proc.returncode == 2 and proc.stderr == f"parity: error: {line}\n"
    assert (tmp_path / PRELOAD_ERROR).read_text() == line + "\n" and not a.exists()
    with pytest.raises(SpecError, match=f"^{line}$"):
        raise_preload_error(tmp_path)


def test_a_failed_side_ends_the_rank_with_its_exit_code(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    proc = _sides_without_torchrun(tmp_path, [str(a), "3"], [str(b)])
    assert proc.returncode == 3 and a.is_file() and not b.exists()


def test_runner_reuses_sides_whichever_way_they_ran(tmp_path, monkeypatch):
    """One launch for a pair with neither side run; a cached side is reused by `job`, but
    `job(separate=True)` and a pair with one side cached launch on their own."""
    import pandas as pd

    import parity.run.inprocess
    import parity.run.job
    from parity.plugin import ParityRunner
    from parity.run.job import Run
    from parity.run.launch import LaunchResult

    launches = []

    def fake_run(spec, out, in_process=False):
        frame = pd.DataFrame({"train/loss": [1.0]}, index=pd.Index([1], name="step"))
        launch = LaunchResult(returncode=0, timed_out=False, duration_s=1.0, run_dir=Path(out))
        return Run(spec, Path(out), launch, frame, in_process=in_process)

    def run_job(spec, out, label=None, **kwargs):
        launches.append(("job", spec.trainer))
        return fake_run(spec, out)

    def run_pair_in_process(pair, out, **kwargs):
        launches.append(("in-process",))
        a, b = pair.sides()
        return fake_run(a, Path(out) / "a", True), fake_run(b, Path(out) / "b", True)

    monkeypatch.setattr(parity.run.job, "run_job", run_job)
    monkeypatch.setattr(parity.run.inprocess, "run_pair_in_process", run_pair_in_process)
    runner = ParityRunner(tmp_path)
    base = JobSpec(task="charcount-sft", world_size=2)
    pair = PairSpec.from_variants(base, "legacy", "worker")
    result = runner.pair(pair, in_process=True)
    assert launches == [("in-process",)] and result.a.in_process and result.ok
    assert runner.job(dataclasses.replace(base, trainer="legacy")) is result.a
    assert runner.pair(pair, in_process=True).b is result.b and len(launches) == 1
    alone = runner.job(base, separate=True)
    assert not alone.in_process and launches[-1] == ("job", "worker")
    assert runner.job(base, separate=True) is alone and len(launches) == 2
    other = PairSpec.from_variants(dataclasses.replace(base, steps=3), "legacy", "worker")
    runner.job(other.sides()[1])
    runner.pair(other, in_process=True)
    assert launches[2:] == [("job", "worker"), ("job", "legacy")]
    with pytest.raises(Exception, match="same world_size"):
        runner.pair(PairSpec(base, {}, {"world_size": 1}), in_process=True)
