"""Runs whose steps are labels (NeMo's DLLogger `[epoch, iteration]` lists) are compared label by
label (parity/readers/labels.py): a label one run lacks is a missing step, never a value set
against the next label's."""

from __future__ import annotations

from pathlib import Path

from parity.judge.compare import compare_frames
from parity.readers import read_metrics
from tests.readers.test_reader_nemo import dll_log

LOSS = {(0, i): 2.0 / i + 0.1234567 for i in range(1, 6)}


def _write(path: Path, labels: list[tuple[int, int]]) -> Path:
    path.write_text("".join(dll_log(list(k), {"loss": LOSS[k]}, i) for i, k in enumerate(labels)))
    return path


def test_a_label_one_run_lacks_is_a_missing_step_not_a_divergence(tmp_path: Path) -> None:
    every = sorted(LOSS)
    a = read_metrics(_write(tmp_path / "a.json", every))
    c = read_metrics(_write(tmp_path / "c.json", [k for k in every if k != (0, 2)]))
    result = compare_frames(a, c)
    loss = result.metrics["loss"]
    assert result.verdict == "diverged" and loss.status == "missing", result.table()
    assert len(result.steps_only_in_a) == 1 and not result.steps_only_in_b, result.table()
    assert loss.steps_compared == 4
    assert compare_frames(c, a).steps_only_in_b == result.steps_only_in_a


def test_the_same_values_under_other_labels_do_not_align(tmp_path: Path) -> None:
    every = sorted(LOSS)
    a = read_metrics(_write(tmp_path / "a.json", every))
    text = _write(tmp_path / "b.json", every).read_text().replace("[0, ", "[1, ")
    (tmp_path / "b.json").write_text(text)
    result = compare_frames(a, read_metrics(tmp_path / "b.json"))
    assert result.verdict == "diverged" and result.metrics["loss"].steps_compared == 0


def test_the_same_labels_compare_as_read(tmp_path: Path) -> None:
    every = sorted(LOSS)
    a = read_metrics(_write(tmp_path / "a.json", every))
    b = read_metrics(_write(tmp_path / "b.json", every))
    assert compare_frames(a, b).verdict == "aligned"
