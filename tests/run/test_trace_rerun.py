"""A pair that diverged on the same batches is rerun up to its first divergent step with every op
of that step traced (parity.run.trace_rerun): `parity pair` (parity.pair.run_pair) does it by itself
and names the first differing op, in its output and its summary.json; a saved state before the
step is resumed from; PPO traces the actor's update."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parity.cli import main
from parity.judge.opdiff import compare_ops
from parity.run.trace_rerun import saved_states, trace_first_divergence
from parity.spec import JobSpec
from tests.specs import PPO, SEQ_MEAN
from worker.presets import traced as traced_spec

# --- fast: what is rerun, from where ------------------------------------------------------------


def test_traced_spec_stops_after_the_step_and_keeps_the_rest():
    spec = JobSpec(
        task="charcount-sft", steps=10, overrides={"save_state_at": 2, "val_every": 5}, inject=["x"]
    )
    traced = traced_spec(spec, 4, None)
    assert traced.overrides == {"val_every": 5, "trace_step": 4, "stop_after": 4}
    assert traced.steps == 10 and traced.inject == ["x"]  # the schedule is the full run's
    assert traced_spec(spec, 4, "s").overrides["resume"] == "s"


def _fake_runs(tmp_path, states_a, states_b):
    calls = []

    def run_job(spec, folder, label=None):
        calls.append((spec, folder))
        folder.mkdir(parents=True)

    dirs = (tmp_path / "a", tmp_path / "b")
    for d, states in zip(dirs, (states_a, states_b), strict=True):
        for s in states:
            (d / f"state_step{s}").mkdir(parents=True)
        d.mkdir(exist_ok=True)
    return dirs, calls, run_job


def test_the_latest_state_both_sides_saved_before_the_step_is_resumed(tmp_path):
    dirs, calls, run_job = _fake_runs(tmp_path, [1, 3, 6], [1, 3])
    assert sorted(saved_states(dirs[0])) == [1, 3, 6]
    spec = JobSpec(task="charcount-sft", steps=10)
    rerun = trace_first_divergence(spec, spec, dirs, 5, tmp_path / "out", run_job=run_job)
    assert rerun.resumed_from == 3 and not rerun.reason
    assert [c[0].overrides["resume"] for c in calls] == [str(d / "state_step3") for d in dirs]
    assert [c[1].name for c in calls] == ["trace-a", "trace-b"]
    assert rerun.line().startswith("op trace: both sides rerun from the state saved at step 3 ")
    # none before the step: from step 1
    dirs, calls, run_job = _fake_runs(tmp_path / "2", [6], [6])
    rerun = trace_first_divergence(spec, spec, dirs, 5, tmp_path / "out2", run_job=run_job)
    assert rerun.resumed_from is None and "resume" not in calls[0][0].overrides


def test_what_cannot_be_rerun_says_why(tmp_path):
    dirs, calls, run_job = _fake_runs(tmp_path, [], [])
    custom = JobSpec(task="custom", command=["train.py", "{out}"])
    rerun = trace_first_divergence(custom, custom, dirs, 2, tmp_path / "o", run_job=run_job)
    assert "wrap step 2 of the loop in parity.record.trace_ops" in rerun.line() and not calls
    spec = JobSpec(task="charcount-sft", steps=3)
    rerun = trace_first_divergence(spec, spec, dirs, 0, tmp_path / "o", run_job=run_job)
    assert "before their first training step" in rerun.reason and not calls


# --- the real thing -----------------------------------------------------------------------------


@pytest.mark.parity
def test_pair_reruns_and_names_the_first_differing_op(tmp_path, capsys):
    out = tmp_path / "pair"
    code = main([
        "pair", "--task", "charcount-sft", "--a", "legacy", "--b", "worker",
        "--world", "2", "--steps", "3",
        "--inject-b", "missing-dp-factor",
        "--out", str(out), "--json",
    ])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["trace_rerun"]["step"] == 1, data.get("trace_rerun")
    ops = data["diagnosis"]["ops"]
    assert ops["status"] == "differ" and ops["first"]["op"] == "aten.mul.Tensor", ops["line"]
    # legacy's loss line in A, the worker's in B; the mutant's scalar: dp 2 vs 1
    assert "vs worker/losses.py" in ops["line"] and "scalar input differs: 2 vs 1" in ops["line"]
    assert any(line.startswith("op trace: both sides rerun from step 1") for line in
               data["diagnosis"]["lines"])  # fmt: skip
    assert (out / "a" / "ops").is_dir() and (out / "trace-b" / "ops").is_dir()
    summary = json.loads((out / "summary.json").read_text())  # run_pair writes it after the rerun
    assert summary["diagnosis"] == data["diagnosis"]  # names the first differing op too
    assert summary["trace_rerun"] == data["trace_rerun"]
    report = (out / "report.md").read_text()
    assert "aten.mul.Tensor" in report and "op trace: both sides rerun" in report
    assert "op trace cost (rank 0): a " in report  # the traced step's seconds, ops and size


@pytest.mark.parity
def test_rerun_resumes_from_a_saved_state(parity_runner, tmp_path):
    base = JobSpec(task="charcount-sft", world_size=2, steps=3, overrides={"save_state_at": 1})
    a = parity_runner.job(base)
    b = parity_runner.job(dataclasses.replace(base, inject=["missing-dp-factor"]))
    rerun = trace_first_divergence(a.spec, b.spec, (a.dir, b.dir), 2, tmp_path)
    assert rerun.resumed_from == 1 and rerun.ops.step == 2, rerun.line()
    assert rerun.ops.status == "differ", rerun.ops.line()
    for side in "ab":  # resumed at 2, ended after it
        lines = (tmp_path / f"trace-{side}" / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(x).get("step") for x in lines]
        assert [s for s in steps if s is not None] == [2], steps


@pytest.mark.parity
def test_ppo_traces_the_actor_update(tmp_path):
    """seq-mean-dp-scaling at 2 ranks: born in the policy loss's normalizer, a scalar."""
    spec = dataclasses.replace(PPO, steps=2, overrides={**PPO.overrides, **SEQ_MEAN})
    mutant = dataclasses.replace(spec, inject=["seq-mean-dp-scaling"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    dirs = (tmp_path / "a", tmp_path / "b")
    rerun = trace_first_divergence(spec, mutant, dirs, 1, tmp_path)
    d = compare_ops(tmp_path / "trace-a", tmp_path / "trace-b")
    assert rerun.ops.status == d.status == "differ", d.line()
    assert (d.first["op"], d.origin) == ("aten.div.Tensor", "scalar argument"), d.line()
    assert d.first["src"].startswith("worker/losses.py"), d.line()
