"""In-process pairs: both sides in one torchrun launch give the bits two launches give.

The parity tests compare an in-process pair with the same jobs launched one by one (which other
tests need anyway, so the runner's cache shares them); the rest check the refusals and the reset
without launching anything.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from parity import assert_parity
from parity.files import launch_dir
from parity.run.inprocess import (
    SEPARATOR,
    SideRunner,
    _Baseline,
    _parse,
    _unwrap_mutants,
    command,
    refusal,
)
from parity.spec import JobSpec, PairSpec
from tests.specs import LAUNCH_MODES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parity
def test_in_process_pair_is_bitwise_two_launches(parity_runner):
    pair = PairSpec.from_variants(LAUNCH_MODES, "legacy", "worker")
    together = parity_runner.pair_in_process(pair)
    spec_a, spec_b = pair.sides()
    alone = [parity_runner.job(spec_a, separate=True), parity_runner.job(spec_b, separate=True)]
    for run, other in zip((together.a, together.b), alone, strict=True):
        assert run.in_process and not other.in_process
        comparison = assert_parity(run, other)  # every metric exact; mfu (a timing) ignored
        assert comparison.metrics["train/loss"].steps_compared == LAUNCH_MODES.steps
        val = comparison.metrics["val/loss"]
        assert val.status == "match" and val.steps_compared == 3  # before, between, after
        wa, wb = (load_file(str(r.dir / "final.safetensors")) for r in (run, other))
        assert all(torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa)
        for name in ("metrics.jsonl", "console.log", "manifest.json", "timing.json"):
            assert (run.dir / name).is_file(), name
        first = (launch_dir(run.dir) / "launcher.log").read_text().splitlines()[0]
        assert first.startswith("# ") and f"--out {run.dir}" in first  # reproduces the side
    assert_parity(together.a, together.b)  # and the pair itself is aligned


@pytest.mark.parity
def test_each_side_gets_its_own_mutants(parity_runner):
    """lr-before-step on side B only: B matches the mutant job run on its own, and side A (run
    first, in the same processes) a clean launch. B's peer may be a warm pool's job, which
    test_pool.py shows to be bitwise a launch of its own."""
    broken = {"trainer": "worker", "inject": ["lr-before-step"]}
    pair = PairSpec(LAUNCH_MODES, {"trainer": "legacy"}, broken)
    together = parity_runner.pair_in_process(pair)
    spec_a, spec_b = pair.sides()
    legacy = parity_runner.job(spec_a, separate=True)
    assert_parity(together.a, legacy)
    assert_parity(together.b, parity_runner.job(spec_b))
    lr = together.b.metrics["train/lr"]
    assert lr[1] != legacy.metrics["train/lr"][1]


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
    assert args[:2] == ["-m", "parity.run.inprocess"] and args.count("parity.run.mutants") == 1
    opts, sides = _parse(args[2:])
    assert [m for m, _ in sides] == ["worker.sft", "parity.run.mutants"]
    assert sides[0][1][sides[0][1].index("--trainer") + 1] == "legacy"
    module, side_args, mutants, _ = _unwrap_mutants(*sides[1])
    assert (module, mutants) == ("worker.sft", ["lr-before-step"])
    assert side_args[side_args.index("--out") + 1] == str(tmp_path / "b")
    assert opts.timing == tmp_path / "t.json" and SEPARATOR not in side_args
    with pytest.raises(SystemExit, match="-m MODULE"):
        _parse(["-m", "worker.sft", SEPARATOR, "train.py"])


def test_mutants_are_undone_after_their_side(tmp_path):
    """Every catalogue mutant applied, then undone: nothing they replaced outside the job's
    packages survives (torch's DistributedSampler among them). In a process of its own, since
    the worker modules it patches are this session's too."""
    script = (
        "import sys\n"
        "from torch.utils.data import DistributedSampler\n"
        "from parity.run.mutants import apply_mutants\n"
        "from parity.run.inprocess import Patches\n"
        "from worker.mutants import MUTANTS\n"
        "before = DistributedSampler.set_epoch, DistributedSampler.__init__\n"
        "patches = Patches(skip={'worker'})\n"
        "apply_mutants(sorted(MUTANTS))\n"
        "assert DistributedSampler.set_epoch is not before[0]\n"
        "undone = patches.undo('worker.mutants')\n"
        "assert (DistributedSampler.set_epoch, DistributedSampler.__init__) == before\n"
        "assert not patches.undo('worker.mutants')\n"
        "print('\\n'.join(sorted(undone)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "torch.utils.data.distributed.DistributedSampler.__init__",
        "torch.utils.data.distributed.DistributedSampler.set_epoch",
    ]


def test_baseline_restores_what_a_job_changes(monkeypatch):
    monkeypatch.setenv("PARITY_TEST_KEEP", "1")
    monkeypatch.delenv("PARITY_TEST_NEW", raising=False)
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    baseline = _Baseline.take()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    baseline.restore()
    try:
        os.environ["PARITY_TEST_NEW"] = "1"
        os.environ["PARITY_TEST_KEEP"] = "2"
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(not deterministic)
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        gc.disable()
        baseline.restore()
        assert gc.isenabled()
        assert "PARITY_TEST_NEW" not in os.environ and os.environ["PARITY_TEST_KEEP"] == "1"
        assert torch.get_default_dtype() == dtype and torch.get_num_threads() == threads
        assert torch.are_deterministic_algorithms_enabled() == deterministic
        assert (random.random(), np.random.rand()) == expected[:2]
        assert torch.equal(torch.rand(1), expected[2])
    finally:
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(deterministic)
        gc.enable()


def test_a_side_that_froze_its_models_still_has_them_freed(tmp_path, monkeypatch):
    """A job may pause the collector and freeze its start-up's objects (worker.entry does):
    after its side, its models are still freed (before the next side or the group's end), and
    the collector runs for the next side as it did before the first."""
    (tmp_path / "frozenjob_demo.py").write_text(
        textwrap.dedent(
            """
            import gc, weakref
            import frozenjob_refs

            class Model:  # in a reference cycle, as wrapped modules are
                def __init__(self):
                    self.me = self

            def train(argv):
                frozenjob_refs.collector_on.append(gc.isenabled())
                gc.disable()
                model = Model()
                frozenjob_refs.models.append(weakref.ref(model))
                gc.freeze()
            """
        )
    )
    refs = types.ModuleType("frozenjob_refs")
    refs.models, refs.collector_on = [], []
    monkeypatch.setitem(sys.modules, "frozenjob_refs", refs)
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = SideRunner()
    try:
        runner.run("frozenjob_demo", [])
        assert refs.models[0]() is None and gc.get_freeze_count() == 0
        runner.run("frozenjob_demo", [])
        assert refs.models[1]() is None
        assert refs.collector_on == [True, True]  # the reset turned it back on for side 2
    finally:
        gc.enable()
        gc.unfreeze()


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
