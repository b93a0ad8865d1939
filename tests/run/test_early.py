"""The early stop's judge (parity.run.early), on a metrics.jsonl grown line by line as a job
writes it: it stops at the first divergence, with the verdict and first divergence of the whole
run, and concludes nothing else from a prefix (a step still being written, a finished run, a
file rewritten, identical runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parity.judge.compare import compare_frames
from parity.readers import read_metrics
from parity.run.early import Diverging, EarlyStop, judge_stopped, prefix_comparison, truncated
from parity.run.results import Stopped


def _records(nudge_at: int | None = None, steps: int = 8, val_every: int = 2) -> list[dict]:
    """A run's records: train/loss every step, val/loss in a second record every
    ``val_every`` steps (a step written in two parts); one ULP up from ``nudge_at``."""
    records = []
    for i in range(1, steps + 1):
        loss = 1.0 / i
        if nudge_at is not None and i >= nudge_at:
            loss = math.nextafter(loss, math.inf)
        records.append({"step": i, "train/loss": loss})
        if i % val_every == 0:
            records.append({"step": i, "val/loss": 2.0 / i})
    return records


def _write(path: Path, records: list[dict], end: bool = True) -> Path:
    lines = [json.dumps(r) for r in records]
    if end:
        lines.append(json.dumps({"event": "end", "steps": records[-1]["step"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def replay(early: EarlyStop, lines: list[str]) -> int | None:
    """Append ``lines`` to the file ``early`` follows one by one, as a job writes them, checking
    after each (a launch's tick); how many were written when it stopped, None if it never did."""
    with open(early.metrics_file, "w") as f:
        for n, line in enumerate(lines, 1):
            f.write(line + "\n")
            f.flush()
            try:
                early.check()
            except Stopped:
                return n
    return None


def _replay(early: EarlyStop, path: Path, records: list[dict]) -> int | None:
    assert early.metrics_file == path
    end = json.dumps({"event": "end", "steps": records[-1]["step"]})
    return replay(early, [json.dumps(r) for r in records] + [end])


@pytest.fixture
def reference(tmp_path):
    return read_metrics(_write(tmp_path / "a" / "metrics.jsonl", _records()), "jsonl")


@pytest.fixture(autouse=True)
def _folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


@pytest.mark.parametrize("nudge_at", [1, 3, 6])
def test_stops_at_the_first_divergence_with_the_whole_run_s_verdict(tmp_path, reference, nudge_at):
    path = tmp_path / "b" / "metrics.jsonl"
    early = EarlyStop(reference, path)
    written = _replay(early, path, _records(nudge_at))
    assert written is not None and early.step == nudge_at
    whole_run = read_metrics(_write(tmp_path / "whole.jsonl", _records(nudge_at)), "jsonl")
    whole = compare_frames(reference, whole_run)
    stopped = judge_stopped(reference, early.frame, early.step)
    assert stopped.verdict == whole.verdict == "diverged"
    first, full = stopped.first_divergence(), whole.first_divergence()
    assert (first.name, first.first_divergent_step) == (full.name, full.first_divergent_step)
    assert (first.a_value, first.b_value) == (full.a_value, full.b_value)
    assert early.frame.index.max() == nudge_at and early.frame.attrs["source"] == str(path)


def test_a_step_is_judged_once_it_is_finished(tmp_path, reference):
    """Step 2's val/loss comes in a second record: step 2 is judged once step 3 has begun,
    never on its first record alone (val/loss would read as missing)."""
    path = tmp_path / "b" / "metrics.jsonl"
    records = _records()
    records[2] = {"step": 2, "val/loss": math.nextafter(1.0, 2.0)}  # step 2's second record
    early = EarlyStop(reference, path)
    assert _replay(early, path, records) == 4  # stopped when step 3's first record came
    assert early.step == 2 and early.comparison.first_divergence().name == "val/loss"


def test_identical_runs_are_never_stopped_and_nothing_else_is_concluded(tmp_path, reference):
    path = tmp_path / "b" / "metrics.jsonl"
    early = EarlyStop(reference, path)
    assert _replay(early, path, _records()) is None and early.step is None
    # a run with a metric of its own (missing in A) is left to the whole comparison
    extra = [{**r, "train/extra": 1.0} if "train/loss" in r else r for r in _records()]
    early = EarlyStop(reference, tmp_path / "b" / "extra.jsonl")
    assert _replay(early, tmp_path / "b" / "extra.jsonl", extra) is None


def test_a_rewritten_file_is_no_longer_judged(tmp_path, reference):
    path = tmp_path / "b" / "metrics.jsonl"
    early = EarlyStop(reference, path)
    _write(path, _records()[:6], end=False)
    early.check()
    path.write_text(json.dumps({"step": 1, "train/loss": 7.0}) + "\n")  # a resume from scratch
    path.write_text(path.read_text() + json.dumps({"step": 2, "train/loss": 7.0}) + "\n")
    early.check()  # shorter than what was read: the whole run decides, not a prefix
    assert early.step is None


def test_until_confirms_a_prefix_or_runs_to_the_end(tmp_path, reference):
    """Check's base run again where the head was stopped: stopped after that step while every
    step agrees with the stored run; where one does not, it runs to its end."""
    path = tmp_path / "b" / "metrics.jsonl"
    early = EarlyStop(reference, path, until=3)
    assert _replay(early, path, _records()) is not None and early.step == 3
    assert prefix_comparison(reference, early.frame, 3).ok
    early = EarlyStop(reference, tmp_path / "b" / "other.jsonl", until=5)
    assert _replay(early, tmp_path / "b" / "other.jsonl", _records(nudge_at=2)) is None
    assert early.departed


def test_a_prefix_that_does_not_diverge_is_never_a_verdict(reference):
    with pytest.raises(RuntimeError, match="compares aligned"):
        judge_stopped(reference, truncated(reference, 3), 3)


def test_diverging_is_a_stop_without_stacks():
    assert issubclass(Diverging, Stopped)
