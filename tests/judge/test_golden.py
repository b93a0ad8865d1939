"""Golden baselines: a committed golden the CI run matches; regressions told from env changes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parity.judge.golden import (
    ENV_CHANGED,
    MATCH,
    REGRESSION,
    GoldenError,
    baseline_for,
    baselines,
    save_golden,
    verify_golden,
)
from parity.readers import MetricsError
from tests.needs import subject
from tests.specs import FIXED, PPO

ENV = {
    "environment": {"python": "3.11.7", "torch": "2.13.0+cpu", "machine": "x86_64"},
    "backend": "gloo",
    "device": "cpu",
    "world_size": 2,
}
# the same but on a host whose BLAS sums in another order (seen: a Xeon with AMX)
AMX = {**ENV, "environment": {**ENV["environment"], "cpu_isa": ["avx512f", "amx_tile"]}}


def _run(path, losses, env=ENV, extra=None):
    path.mkdir(parents=True)
    rows = [
        {"step": i + 1, "train/loss": v, "train/mfu": 0.5, **(extra or {})}
        for i, v in enumerate(losses)
    ]
    lines = [json.dumps(r) for r in rows] + [json.dumps({"event": "end", "steps": len(rows)})]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "manifest.json").write_text(json.dumps(env))
    return path


def test_golden_round_trip_and_regression(tmp_path):
    baseline = save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5, 2.25]))
    stored = (baseline / "metrics.jsonl").read_text()
    assert "train/mfu" not in stored  # timing metrics never enter a golden
    assert (
        verify_golden(tmp_path / "golden", _run(tmp_path / "same", [3.0, 2.5, 2.25])).status
        == MATCH
    )
    result = verify_golden(tmp_path / "golden", _run(tmp_path / "bad", [3.0, 2.5, 2.2500001]))
    assert result.status == REGRESSION
    assert result.comparison.metrics["train/loss"].first_divergent_step == 3


def test_a_run_not_whole_never_replaces_a_baseline(tmp_path):
    """Updating a golden from a run that wrote fewer steps and no end record (exit 0 all the
    same), or whose read skipped a record, is refused before anything is written: the good
    baseline stays."""
    golden = tmp_path / "golden"
    baseline = save_golden(golden, _run(tmp_path / "made", [3.0, 2.5, 2.25]))
    kept = (baseline / "metrics.jsonl").read_bytes()
    cut = _run(tmp_path / "cut", [3.0, 2.5])
    text = (cut / "metrics.jsonl").read_text()
    (cut / "metrics.jsonl").write_text(text[: text.index('{"event"')])  # no end record
    with pytest.raises(MetricsError, match="not whole .no end record"):
        save_golden(golden, cut)
    skipped = _run(tmp_path / "skipped", [3.0, 2.5, 2.25])
    text = (skipped / "metrics.jsonl").read_text()
    end = text.index('{"event"')  # a number a float64 cannot hold, before the end record
    (skipped / "metrics.jsonl").write_text(text[:end] + '{"step": 4, "train/loss": 1e999}\n'
                                           + text[end:])  # fmt: skip
    with pytest.raises(MetricsError, match="not whole"):
        save_golden(golden, skipped)
    assert (baseline / "metrics.jsonl").read_bytes() == kept


def test_mismatch_under_another_environment_says_rebaseline(tmp_path):
    save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5]))
    other = {**ENV, "environment": {**ENV["environment"], "torch": "2.14.1+cpu"}}
    result = verify_golden(tmp_path / "golden", _run(tmp_path / "new", [3.0, 2.4], env=other))
    assert result.status == ENV_CHANGED == "environment changed: rebaseline"
    assert result.environment_diff == {"environment.torch": ("2.13.0+cpu", "2.14.1+cpu")}
    assert "rebaseline" in result.message() and "environment.torch" in result.message()


def test_each_environment_is_judged_against_its_own_baseline(tmp_path):
    golden = tmp_path / "golden"
    old = save_golden(golden, _run(tmp_path / "old", [3.0, 2.5]))
    new = save_golden(golden, _run(tmp_path / "new", [3.0, 2.4], env=AMX))
    assert old != new and baselines(golden) == sorted([old, new])
    assert verify_golden(golden, _run(tmp_path / "a", [3.0, 2.5])).status == MATCH
    assert verify_golden(golden, _run(tmp_path / "b", [3.0, 2.4], env=AMX)).status == MATCH
    # the other host's numbers on this one: a regression against this environment's baseline
    result = verify_golden(golden, _run(tmp_path / "c", [3.0, 2.5], env=AMX))
    assert result.status == REGRESSION and result.baseline == new and result.own_environment
    assert f"baseline {new.name}, this environment's" in result.message()
    # rewriting one environment's baseline leaves the other's
    assert save_golden(golden, _run(tmp_path / "d", [3.0, 2.25], env=AMX)) == new
    assert verify_golden(golden, _run(tmp_path / "e", [3.0, 2.5])).status == MATCH
    assert verify_golden(golden, _run(tmp_path / "f", [3.0, 2.25], env=AMX)).status == MATCH


def test_an_environment_without_a_baseline_is_compared_with_the_closest(tmp_path):
    golden = tmp_path / "golden"
    save_golden(golden, _run(tmp_path / "near", [3.0, 2.5]))
    save_golden(golden, _run(tmp_path / "far", [3.0, 2.4], env={**AMX, "world_size": 4}))
    third = {**ENV, "environment": {**ENV["environment"], "cpu_isa": ["avx2"]}}
    assert baseline_for(golden, _run(tmp_path / "x", [3.0, 2.3], env=third)) is None
    result = verify_golden(golden, tmp_path / "x")
    assert result.status == ENV_CHANGED and not result.own_environment
    assert result.environment_diff == {"environment.cpu_isa": (None, ["avx2"])}
    assert "none recorded in this environment, this is the closest" in result.message()
    # equal bits in another environment are still a match
    assert verify_golden(golden, _run(tmp_path / "y", [3.0, 2.5], env=third)).status == MATCH


def test_cpu_vendor_tells_apart_unless_the_baseline_predates_it(tmp_path):
    """Hosts with the same instruction sets but another vendor (the BLAS dispatches on both) are
    two environments; a baseline made before the vendor was fingerprinted matches either, as it
    did then."""
    intel = {**ENV, "environment": {**ENV["environment"], "cpu_vendor": "GenuineIntel"}}
    amd = {**ENV, "environment": {**ENV["environment"], "cpu_vendor": "AuthenticAMD"}}
    golden = tmp_path / "golden"
    made = save_golden(golden, _run(tmp_path / "intel", [3.0, 2.5], env=intel))
    result = verify_golden(golden, _run(tmp_path / "amd", [3.0, 2.4], env=amd))
    assert result.status == ENV_CHANGED
    assert result.environment_diff == {"environment.cpu_vendor": ("GenuineIntel", "AuthenticAMD")}
    manifest = json.loads((made / "manifest.json").read_text())
    del manifest["environment"]["cpu_vendor"]  # as a baseline made before the key was recorded
    (made / "manifest.json").write_text(json.dumps(manifest))
    assert baseline_for(golden, tmp_path / "amd") == made
    assert verify_golden(golden, tmp_path / "amd").status == REGRESSION


X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 avx512fp16

processor\t: 1
vendor_id\t: SomeoneElse
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve bf16 i8mm
CPU implementer\t: 0x41
CPU part\t: 0xd40

processor\t: 1
"""


@subject
def test_cpu_facts_are_read_from_the_first_processor_on_x86_and_arm():
    """What the fingerprint's CPU keys are made of (worker.metrics_log.cpu_facts)."""
    from worker.metrics_log import cpu_facts

    intel = ["avx512f", "avx512_bf16", "amx_tile", "avx2", "fma"]
    assert cpu_facts(X86_CPUINFO) == {
        "cpu_isa": intel, "cpu_vendor": "GenuineIntel", "cpu_model": "Intel(R) Xeon(R) Processor"
    }  # fmt: skip
    arm = {"cpu_isa": ["asimd", "sve", "bf16", "i8mm"], "cpu_vendor": "0x41", "cpu_model": "0xd40"}
    assert cpu_facts(ARM_CPUINFO) == arm
    assert cpu_facts("") == {"cpu_isa": [], "cpu_vendor": None, "cpu_model": None}


def test_a_golden_of_the_older_one_baseline_layout_is_still_read(tmp_path):
    golden = _run(tmp_path / "golden", [3.0, 2.5])  # metrics.jsonl right in the golden's folder
    assert verify_golden(golden, _run(tmp_path / "a", [3.0, 2.5])).status == MATCH
    assert verify_golden(golden, _run(tmp_path / "b", [3.0, 2.4])).status == REGRESSION
    assert save_golden(golden, tmp_path / "b") == golden  # its environment: rewritten in place
    other = save_golden(golden, _run(tmp_path / "c", [3.0, 2.25], env=AMX))  # beside it
    assert other.parent == golden and baselines(golden) == [golden, other]
    assert verify_golden(golden, tmp_path / "b").status == MATCH


def test_check_against_a_golden_folder_names_its_baselines(tmp_path):
    """`parity check --golden` compares with one file: given a golden's folder it names them."""
    from parity.check import RevisionError, check_golden

    golden = tmp_path / "golden"
    old = save_golden(golden, _run(tmp_path / "old", [3.0]))
    new = save_golden(golden, _run(tmp_path / "new", [3.0], env=AMX))
    with pytest.raises(RevisionError, match="one baseline per environment; pass one of them") as e:
        check_golden(FIXED, golden, tmp_path / "out")  # refused before anything runs
    assert f"{old}/metrics.jsonl" in str(e.value) and f"{new}/metrics.jsonl" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_wrong_length_unknown_metrics_and_missing_golden_are_errors(tmp_path):
    save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5, 2.25]))
    with pytest.raises(GoldenError, match=r"golden has 3 steps .* the run has 2"):
        verify_golden(tmp_path / "golden", _run(tmp_path / "short", [3.0, 2.5]))
    # a metric the job added since: listed, not judged (it cannot have regressed)
    run = _run(tmp_path / "more", [3.0, 2.5, 2.25], extra={"train/grad_norm": 1.0})
    result = verify_golden(tmp_path / "golden", run)
    assert result.status == MATCH and result.new_metrics == ["train/grad_norm"]
    assert "not judged: 1 metrics newer than the golden (train/grad_norm)" in result.message()
    # one the job no longer logs: an error naming it
    save_golden(tmp_path / "golden2", run)
    with pytest.raises(GoldenError, match="the run no longer logs: train/grad_norm"):
        verify_golden(tmp_path / "golden2", _run(tmp_path / "fewer", [3.0, 2.5, 2.25]))
    with pytest.raises(GoldenError, match="no golden here"):
        verify_golden(tmp_path / "nothing", tmp_path / "made")


@pytest.mark.parity
@pytest.mark.parametrize(
    ("name", "spec"),
    # the PPO golden was made before the rollout gathered its layers once (Engine.gathered):
    # its match shows that change kept every bit
    [("charcount-sft-worker", FIXED), ("charcount-ppo-worker", PPO)],
)
def test_committed_golden_matches(parity_runner, parity_golden, name, spec):
    run = parity_runner.job(spec)
    golden = parity_golden.golden_dir / name
    if not parity_golden.update and baseline_for(golden, run.dir) is None:
        # bits are only promised within one environment: on a host none was recorded on, the
        # check cannot say match or regression (verify_golden says "rebaseline", tested above)
        apart = verify_golden(golden, run.dir).environment_diff
        pytest.skip(
            f"{golden}: no baseline recorded in this environment (the closest differs in "
            f"{', '.join(apart)}); `pytest -m parity -k committed_golden --parity-update-golden` "
            "adds one"
        )
    result = parity_golden.check(name, run)
    assert result.status == MATCH and result.own_environment


@pytest.mark.parity
def test_golden_check_catches_a_mutant(parity_runner, parity_golden, tmp_path):
    fixed = parity_runner.job(FIXED)
    golden = parity_golden.golden_dir / "charcount-sft-worker"
    if baseline_for(golden, fixed.dir) is None:  # a host with no committed baseline: make one
        golden = tmp_path / "golden"
        save_golden(golden, fixed.dir)
    run = parity_runner.job(dataclasses.replace(FIXED, inject=["lr-before-step"]))
    result = verify_golden(golden, run.dir)
    assert result.status == REGRESSION and result.own_environment
    assert result.comparison.metrics["train/lr"].first_divergent_step == 1
