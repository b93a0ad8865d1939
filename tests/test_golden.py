"""Golden baselines: a committed golden the CI run matches; regressions told from env changes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from specs import FIXED

from parity.golden import ENV_CHANGED, MATCH, REGRESSION, GoldenError, save_golden, verify_golden

ENV = {
    "environment": {"python": "3.11.7", "torch": "2.13.0+cpu", "machine": "x86_64"},
    "backend": "gloo",
    "device": "cpu",
    "world_size": 2,
}


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
    save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5, 2.25]))
    stored = (tmp_path / "golden" / "metrics.jsonl").read_text()
    assert "train/mfu" not in stored  # timing metrics never enter a golden
    assert (
        verify_golden(tmp_path / "golden", _run(tmp_path / "same", [3.0, 2.5, 2.25])).status
        == MATCH
    )
    result = verify_golden(tmp_path / "golden", _run(tmp_path / "bad", [3.0, 2.5, 2.2500001]))
    assert result.status == REGRESSION
    assert result.comparison.metrics["train/loss"].first_divergent_step == 3


def test_mismatch_under_another_environment_says_rebaseline(tmp_path):
    save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5]))
    other = {**ENV, "environment": {**ENV["environment"], "torch": "2.14.1+cpu"}}
    result = verify_golden(tmp_path / "golden", _run(tmp_path / "new", [3.0, 2.4], env=other))
    assert result.status == ENV_CHANGED == "environment changed: rebaseline"
    assert result.environment_diff == {"environment.torch": ("2.13.0+cpu", "2.14.1+cpu")}
    assert "rebaseline" in result.message() and "environment.torch" in result.message()


def test_wrong_length_unknown_metrics_and_missing_golden_are_errors(tmp_path):
    save_golden(tmp_path / "golden", _run(tmp_path / "made", [3.0, 2.5, 2.25]))
    with pytest.raises(GoldenError, match=r"golden has 3 steps .* the run has 2"):
        verify_golden(tmp_path / "golden", _run(tmp_path / "short", [3.0, 2.5]))
    with pytest.raises(GoldenError, match="metrics not in both golden and run: train/grad_norm"):
        run = _run(tmp_path / "more", [3.0, 2.5, 2.25], extra={"train/grad_norm": 1.0})
        verify_golden(tmp_path / "golden", run)
    with pytest.raises(GoldenError, match="no golden here"):
        verify_golden(tmp_path / "nothing", tmp_path / "made")


@pytest.mark.parity
def test_charcount_sft_matches_committed_golden(parity_runner, parity_golden):
    result = parity_golden.check("charcount-sft-worker", parity_runner.job(FIXED))
    assert result.status == MATCH


@pytest.mark.parity
def test_golden_check_catches_a_mutant(parity_runner, parity_golden):
    run = parity_runner.job(dataclasses.replace(FIXED, inject=["lr-before-step"]))
    result = verify_golden(parity_golden.golden_dir / "charcount-sft-worker", run.dir)
    assert result.status == REGRESSION
    assert result.comparison.metrics["train/lr"].first_divergent_step == 1
