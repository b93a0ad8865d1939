"""The recorder as other libraries' loggers, each with the real library on 2 gloo ranks under
torchrun: Lightning's (parity.record.lightning, tests/jobs/lightning_run.py) and accelerate's
tracker (parity.record.accelerate, tests/jobs/accelerate_tracker.py). Each run is aligned with
a repeat of itself, writes the metrics as logged, the manifest and the batch digests, and a
different learning rate on side B is diverged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.judge.diagnose import diagnose, read_rank_data
from parity.spec import JobSpec, PairSpec

pytest.importorskip("torch")  # the loggers are the recorder's
from parity.record.tracking import RecordingLogger, StepMerger, numbers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "jobs"


def _spec(script: str, env: dict[str, str] | None = None) -> JobSpec:
    command = [str(JOBS / script), "--out", "{out}"]
    return JobSpec(
        task="custom", command=command, world_size=2, steps=4, timeout_s=180, env=env or {}
    )


def _changed_lr(parity_runner, spec: JobSpec, lr: str):
    pair = parity_runner.pair(PairSpec(spec, {}, {"command": [*spec.command, "--lr", lr]}))
    assert pair.verdict == "diverged", pair.comparison.table()
    failed = {m.name: m.first_divergent_step for m in pair.comparison.failures}
    assert "train/lr" in failed and "train/loss" in failed, pair.comparison.table()
    return pair


def test_a_repeated_key_with_the_same_value_is_dropped_another_value_is_kept() -> None:
    merger = StepMerger()
    assert merger.new(1, {"loss": 2.0, "epoch": 0}) == {"loss": 2.0, "epoch": 0}
    assert merger.new(1, {"val": 1.5, "epoch": 0}) == {"val": 1.5}
    assert merger.new(1, {"epoch": 1}) == {"epoch": 1}  # Recorder.log refuses it, as it should
    assert merger.new(2, {"epoch": 0}) == {"epoch": 0}
    assert numbers({"a": 1, "b": "text", "c": 2.5, "d": None}) == {"a": 1, "c": 2.5}


@pytest.mark.parametrize("library", ["lightning", "accelerate"])
def test_both_loggers_are_one_base_that_records_in_process(library, tmp_path) -> None:
    """ParityLogger and ParityTracker take their run folder, config, lazy Recorder and step
    logging from RecordingLogger, and write the same run folder through it (one process)."""
    if library == "lightning":
        pytest.importorskip("pytorch_lightning")
        from parity.record.lightning import ParityLogger as cls
    else:
        pytest.importorskip("accelerate")
        from parity.record.accelerate import ParityTracker as cls
    assert issubclass(cls, RecordingLogger) and "__init__" not in vars(cls)
    logger = cls(tmp_path / "run", manifest={"note": "x"})
    assert not (tmp_path / "run").exists()  # nothing made before the first use
    log = logger.log_metrics if library == "lightning" else logger.log
    with pytest.raises(ValueError, match=f"{cls.__name__}: .*runs are compared by step"):
        log({"loss": 1.0})
    if library == "lightning":
        logger.log_hyperparams({"lr": 0.1})
    else:
        logger.store_init_configuration({"lr": 0.1})
    log({"loss": 2.0, "epoch": 0, "name": "text"}, step=1)
    log({"val": 1.5, "epoch": 0}, step=1)
    logger.finalize("success") if library == "lightning" else logger.finish()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lines if "event" not in x][0] == {"step": 1, "loss": 2.0, "epoch": 0}
    assert lines[-1]["event"] and logger.recorder.finished
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["config"], manifest["note"]) == ({"lr": 0.1}, "x")


@pytest.mark.parity
def test_lightning_logger_aligned_with_itself_and_a_changed_lr_diverges(parity_runner) -> None:
    pytest.importorskip("pytorch_lightning")
    spec = _spec("lightning_run.py")
    floor = parity_runner.floor(spec)
    a, again = floor.runs
    assert floor.deterministic, floor.table()
    frame = a.metrics
    assert frame.attrs["complete"] and list(frame.index) == [0, 1, 2, 3]
    assert {"train/loss", "train/lr", "val/loss", "epoch"} == set(frame.columns)
    assert frame["val/loss"].dropna().index.tolist() == [1, 3]
    manifest = json.loads((a.dir / "manifest.json").read_text())
    assert (manifest["config"], manifest["world_size"]) == ({"lr": 0.1}, 2)
    assert sorted(read_rank_data(a.dir)) == [0, 1]
    d = diagnose(a.dir, again.dir, floor.comparison)
    assert d.kind == "aligned" and d.train.steps_compared == 4
    _changed_lr(parity_runner, spec, "0.2")


@pytest.mark.parity
def test_accelerate_tracker_aligned_with_itself_and_a_changed_lr_diverges(parity_runner) -> None:
    pytest.importorskip("accelerate")
    spec = _spec("accelerate_tracker.py", {"ACCELERATE_USE_CPU": "true"})
    floor = parity_runner.floor(spec)
    a, again = floor.runs
    assert floor.deterministic, floor.table()
    frame = a.metrics
    assert frame.attrs["complete"] and list(frame.index) == [1, 2, 3, 4]
    assert {"train/loss", "train/lr"} == set(frame.columns)
    manifest = json.loads((a.dir / "manifest.json").read_text())
    assert (manifest["config"]["lr"], manifest["world_size"]) == (0.01, 2)
    assert sorted(read_rank_data(a.dir)) == [0]  # accelerate runs trackers on rank 0 only
    d = diagnose(a.dir, again.dir, floor.comparison)
    assert d.kind == "aligned" and d.train.steps_compared == 4
    _changed_lr(parity_runner, spec, "0.02")
