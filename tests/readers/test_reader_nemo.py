"""NeMo's DLLogger reader (parity/readers/nemo.py).

The writer, dllogger, is not on PyPI (`nvidia-dllogger` there is a placeholder that refuses to
install; the package lives only on github.com/NVIDIA/dllogger), so the files here are made by
`dll_log`/`dll_metadata` below, which write exactly what its JSONStreamBackend writes
(dllogger/logger.py: `"DLLL {}\\n".format(json.dumps(dict(timestamp=str(ts.timestamp()),
datetime=str(ts), elapsedtime=str(elapsed), type="LOG", step=step, data=data)))`, and for
metadata `dict(timestamp, elapsedtime, datetime, type="METADATA", metric, metadata)`). The
records NeMo writes are those of nemo/utils/loggers/dllogger.py: `step="PARAMETER"` for
hyperparameters, then Lightning's `log_metrics(metrics, step)` with an int step and an `epoch`
metric; the list steps are those of NVIDIA's DeepLearningExamples (dllogger's
examples/example_resnet_log.json).
"""

import json
import math
import re
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.judge.compare import compare_frames
from parity.readers import MetricsError, detect, present_mask, read_metrics, skipped_count
from parity.readers.text import CUT_TAIL

SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
START = datetime(2025, 3, 1, 12, 0, 0)


def dll_log(step, data, i: int = 0) -> str:
    ts = START + timedelta(seconds=1.25 * i)
    rec = dict(
        timestamp=str(ts.timestamp()),
        datetime=str(ts),
        elapsedtime=str(1.25 * i),
        type="LOG",
        step=step,
        data=data,
    )
    return f"DLLL {json.dumps(rec)}\n"


def dll_metadata(metric, metadata, i: int = 0) -> str:
    ts = START + timedelta(seconds=1.25 * i)
    rec = dict(
        timestamp=str(ts.timestamp()),
        elapsedtime=str(1.25 * i),
        datetime=str(ts),
        type="METADATA",
        metric=metric,
        metadata=metadata,
    )
    return f"DLLL {json.dumps(rec)}\n"


def losses(n: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [float(x) for x in (10.0 * np.exp(-np.arange(n) / 7) + rng.random(n) / 3)]


def nemo_file(path: Path, loss: list[float], lr: float = 3e-4) -> Path:
    """A NeMo run as Lightning drives the DLLogger: hyperparameters, then one record per step
    and a validation record at every 5th."""
    lines = [dll_log("PARAMETER", {"model.hidden_size": 64, "trainer.precision": "bf16"})]
    lines.append(dll_metadata("reduced_train_loss", {"unit": "", "format": ":.5f"}))
    for step, x in enumerate(loss, 1):
        data = {"reduced_train_loss": x, "lr": lr, "epoch": 0}
        lines.append(dll_log(step, data, step))
        if step % 5 == 0:
            lines.append(dll_log(step, {"val_loss": x + 0.5, "epoch": 0}, step))
    path.write_text("".join(lines))
    return path


def test_nemo_run_reads_exactly(tmp_path):
    loss = losses(12)
    f = nemo_file(tmp_path / "dllogger.json", loss)
    frame = read_metrics(f)
    assert detect(f).name == "nemo-dllogger"
    assert frame.attrs["format"] == "nemo-dllogger"
    assert list(frame.index) == list(range(1, 13))
    assert sorted(frame.columns) == ["epoch", "lr", "reduced_train_loss", "val_loss"]
    got = frame["reduced_train_loss"].to_numpy()
    assert got.view(np.uint64).tolist() == np.array(loss).view(np.uint64).tolist()
    assert list(present_mask(frame)["val_loss"]) == [s % 5 == 0 for s in range(1, 13)]
    assert frame.attrs["precision"] == dict.fromkeys(frame.columns, "float64")
    assert frame.attrs["skipped"] == [] and frame.attrs["complete"] is None
    notes = " | ".join(frame.attrs["notes"])
    assert "step 'PARAMETER' (hyperparameters)" in notes and "1 METADATA records" in notes


def test_planted_difference_found_at_its_step(tmp_path):
    loss = losses(20, seed=3)
    a = read_metrics(nemo_file(tmp_path / "a.json", loss))
    planted = list(loss)
    planted[6] = float(np.nextafter(planted[6], np.inf))  # step 7, one ULP
    b = read_metrics(nemo_file(tmp_path / "b.json", planted))
    same = compare_frames(a, read_metrics(nemo_file(tmp_path / "a2.json", loss)))
    assert same.verdict == "aligned"
    res = compare_frames(a, b)
    assert res.verdict == "diverged"
    m = res.metrics["reduced_train_loss"]
    assert m.first_divergent_step == 7 and m.divergent_steps == 1 and m.max_ulp == 1
    assert res.metrics["val_loss"].status == "match"


def test_nan_and_infinity_as_json_dumps_writes_them(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(dll_log(1, {"loss": math.nan, "g": math.inf}) + dll_log(2, {"loss": -0.0}))
    assert "NaN" in f.read_text() and "Infinity" in f.read_text()
    frame = read_metrics(f)
    assert math.isnan(frame.loc[1, "loss"]) and bool(present_mask(frame).loc[1, "loss"])
    assert frame.loc[1, "g"] == math.inf
    assert math.copysign(1, frame.loc[2, "loss"]) == -1


def test_list_steps_are_numbered_in_order_of_first_appearance(tmp_path):
    # DeepLearningExamples' BERT: dllogger.log(step=(epoch, global_step), ...)
    f = tmp_path / "bert.json"
    lines = [dll_log([e, s], {"step_loss": 8.0 - s / 10}) for e, s in [(0, 1), (0, 2), (1, 3)]]
    f.write_text("".join(lines))
    frame = read_metrics(f)
    assert list(frame.index) == [1, 2, 3]
    assert frame.attrs["step_labels"] == {1: [0, 1], 2: [0, 2], 3: [1, 3]}
    assert frame["step_loss"].tolist() == [8.0 - 0.1, 8.0 - 0.2, 8.0 - 0.3]
    assert any("numbered in order of first appearance" in n for n in frame.attrs["notes"])
    # steps of one number each: [n] is the int n, and there are no labels
    g = tmp_path / "one.json"
    g.write_text(dll_log([4], {"x": 1.0}) + dll_log(5, {"x": 2.0}))
    assert list(read_metrics(g).index) == [4, 5]
    assert "step_labels" not in read_metrics(g).attrs


def resnet_log(path: Path, scale: float = 1.0) -> Path:
    """The shape of dllogger's examples/example_resnet_log.json: hyperparameters, metadata,
    [epoch, iteration] rows (the iteration restarting every epoch) in two records each,
    [epoch, iteration, val_iteration] validation rows, an [epoch] summary per epoch, and the
    run's [] summary."""
    lines = [dll_log("PARAMETER", {"arch": "resnet50", "lr": 0.1})]
    lines.append(dll_metadata("train.loss", {"format": ":.5f", "type": "LOSS"}))
    for epoch in (0, 1):
        for it in (5, 10, 15, 20):
            loss = (8.5 - epoch - it / 100) * scale
            lines.append(dll_log([epoch, it], {"train.loss": loss, "train.total_ips": 545.27}))
            lines.append(dll_log([epoch, it], {"lr": 0.1, "train.data_time": 0.0024609}))
        for it in (5, 10):
            lines.append(dll_log([epoch, 25, it], {"val.top1": 0.0, "val.loss": 980.1 - it}))
        lines.append(dll_log([epoch], {"train.loss": 8.34 - epoch, "val.top1": 0.0}))
    lines.append(dll_log([], {"train.loss": 8.34, "val.top1": 0.0}))
    path.write_text("".join(lines))
    return path


def test_epoch_iteration_steps_compare_on_their_composite_step(tmp_path):
    """The iteration restarting each epoch is no common axis of its own: each step list is a
    step, in order of first appearance, its two records merged; [epoch] summaries and
    validation rows are steps too, [] and PARAMETER are left out; nothing is skipped."""
    a = read_metrics(resnet_log(tmp_path / "a.json"))
    labels = a.attrs["step_labels"]
    assert len(a.index) == 2 * (4 + 2 + 1) and a.attrs["skipped"] == []
    assert [labels[s] for s in list(a.index)[:8]] == [
        [0, 5], [0, 10], [0, 15], [0, 20], [0, 25, 5], [0, 25, 10], [0], [1, 5]
    ]  # fmt: skip
    first = a.index[0]
    assert a.loc[first, "train.loss"] == 8.5 - 0.05 and a.loc[first, "lr"] == 0.1
    again = read_metrics(resnet_log(tmp_path / "a2.json"))  # its values are short decimals
    assert compare_frames(a, again, at_source_precision=True).ok
    b = read_metrics(resnet_log(tmp_path / "b.json", scale=1 + 2**-40))
    m = compare_frames(a, b).metrics["train.loss"]
    assert m.status != "match" and labels[m.first_divergent_step] == [0, 5]
    notes = " | ".join(a.attrs["notes"])
    assert "LOG records with step [] (a run summary" in notes and "'PARAMETER'" in notes


def test_a_step_list_first_seen_after_a_later_one_is_an_error(tmp_path):
    # numbered in order of first appearance, [0, 10] after [0, 20] would contradict its order
    f = tmp_path / "resnet.json"
    f.write_text(
        dll_log([0, 5], {"train.loss": 8.5})
        + dll_log([0, 20], {"train.loss": 7.2})
        + dll_log([0, 10], {"train.loss": 7.9})
    )
    with pytest.raises(
        MetricsError,
        match=r"resnet\.json:3: step \[0, 10\] first appears after \[0, 20\] \(line 2\)",
    ):
        read_metrics(f)
    # a list seen before comes again (a second record of it, a restarted run): its step
    g = tmp_path / "again.json"
    g.write_text(
        dll_log([0, 5], {"a": 1.0}) + dll_log([0, 10], {"a": 2.0}) + dll_log([0, 5], {"b": 3.0})
    )
    frame = read_metrics(g)
    assert list(frame.index) == [1, 2] and frame.loc[1, "b"] == 3.0


def test_summaries_and_labels_noted(tmp_path):
    f = tmp_path / "mixed.json"
    f.write_text(
        dll_log("PARAMETER", {"lr": 0.1})
        + dll_log([0, 5], {"train.loss": 8.5})
        + dll_log([0, 25, 5], {"val.loss": 980.1})
        + dll_log([0, 10], {"train.loss": 8.9})
        + dll_log([0], {"train.loss": 8.3})
        + dll_log("MEMORY", {"allocated": 1024})
        + dll_log([], {"train.loss": 8.3})  # the run summary
    )
    frame = read_metrics(f)
    assert list(frame.index) == [1, 2, 3, 4] and frame.attrs["skipped"] == []
    assert frame.attrs["step_labels"] == {1: [0, 5], 2: [0, 25, 5], 3: [0, 10], 4: [0]}
    notes = " | ".join(frame.attrs["notes"])
    assert "step 'MEMORY' (a label, not a step)" in notes
    assert "1 LOG records with step [] (a run summary, no step)" in notes


def test_bad_records_are_skipped_and_counted(tmp_path):
    good = dll_log(1, {"loss": 2.5})
    f = tmp_path / "bad.json"
    f.write_text(
        good
        + 'DLLL {"type": "LOG", "step": 2, "data": {"loss": 2.4}\n'  # cut JSON
        + dll_log(3, {"loss": "2.3", "lr": True, "ok": 1.0, "n": None})
        + dll_log(4.0, {"loss": 2.2})  # a float step
        + dll_log([0, -1], {"loss": 2.1})
        + 'DLLL {"type": "LOG", "data": {"loss": 2.0}}\n'  # no step
        + 'DLLL {"type": "LOG", "step": 7, "data": 5}\n'
        + 'DLLL {"type": "EVENT", "step": 8}\n'
        + "DLLL [1, 2]\n"
        + 'DLLL {"type": "LOG", "step": 9, "step": 10, "data": {}}\n'  # a key twice
        + "some other output DLLL {\n"
        + "Epoch 0: 100%|#####| 10/10\n"
        + 'DLLL {"type": "LOG", "step": 11, "data": {"loss"'  # truncated last line
    )
    frame = read_metrics(f)
    assert list(frame.index) == [1, 3]
    assert frame.loc[3, "ok"] == 1.0 and "lr" not in frame.columns
    skipped = {s["reason"]: (s["count"], s["where"]) for s in frame.attrs["skipped"]}
    assert skipped == {
        "DLLL lines that do not parse": (4, ["line 2", "line 9", "line 10", "line 11"]),
        CUT_TAIL: (1, ["line 13"]),
        "values that are not numbers": (3, ["line 3 ('loss')", "line 3 ('lr')", "line 3 ('n')"]),
        "LOG records without a usable step": (3, ["line 4", "line 5", "line 6"]),
        "LOG records without a data object": (1, ["line 7"]),
        "DLLL records of an unknown type": (1, ["line 8"]),
    }
    assert skipped_count(frame) == 13
    assert any("1 lines without the 'DLLL ' prefix" in n for n in frame.attrs["notes"])


def test_duplicates_named_or_kept_with_a_note(tmp_path):
    f = tmp_path / "restart.json"
    f.write_text(
        dll_log(1, {"loss": 3.0})
        + dll_log(2, {"loss": 2.0})
        + dll_log(2, {"loss": 2.0, "lr": 0.1})  # the same value again: one value
        + dll_log(2, {"loss": 2.5})  # a restarted run
    )
    with pytest.raises(MetricsError, match=r"restart\.json:4: step 2: 'loss' "):
        read_metrics(f)
    first = read_metrics(f, duplicates="first")
    last = read_metrics(f, duplicates="last")
    assert first.loc[2, "loss"] == 2.0 and last.loc[2, "loss"] == 2.5
    assert any("kept the last" in n for n in last.attrs["notes"])


def test_no_records_is_one_line_error(tmp_path):
    f = tmp_path / "params.json"
    f.write_text(dll_log("PARAMETER", {"lr": 0.1}) + dll_metadata("loss", {}))
    with pytest.raises(MetricsError) as e:
        read_metrics(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: no DLLogger LOG records") and "\n" not in msg
    assert "PARAMETER" in msg


def test_detection_is_by_the_first_line(tmp_path):
    f = tmp_path / "log.txt"
    f.write_bytes(b"\xef\xbb\xbf\n\n" + dll_log(1, {"loss": 1.0}).encode())
    assert detect(f).name == "nemo-dllogger"
    assert read_metrics(f).loc[1, "loss"] == 1.0
    # DLLL lines after other output: not claimed (give --format)
    g = tmp_path / "console.txt"
    g.write_text("starting\n" + dll_log(1, {"loss": 1.0}))
    with pytest.raises(MetricsError, match="unknown format"):
        detect(g)
    assert read_metrics(g, "nemo-dllogger").loc[1, "loss"] == 1.0
    h = tmp_path / "stdout.txt"  # dllogger's StdOutBackend, not this format
    h.write_text("DLL 2025-03-01 12:00:00.000000 - 1 loss : 1.0 \n")
    with pytest.raises(MetricsError):
        detect(h)


def test_crlf_lines(tmp_path):
    f = tmp_path / "crlf.json"
    f.write_bytes(
        (dll_log(1, {"loss": 0.5}) + dll_log(2, {"loss": 0.25})).replace("\n", "\r\n").encode()
    )
    assert read_metrics(f)["loss"].tolist() == [0.5, 0.25]


def _one_line_error(e: MetricsError, path: Path) -> None:
    assert str(path) in str(e) and "\n" not in str(e)


@SETTINGS
@given(data=st.binary(max_size=400))
def test_fuzz_random_bytes(tmp_path, data):
    f = tmp_path / "fuzz.json"
    f.write_bytes(b"DLLL " + data)
    try:
        frame = read_metrics(f, "nemo-dllogger")
    except MetricsError as e:
        _one_line_error(e, f)
    else:
        assert frame.index.is_unique and frame.index.is_monotonic_increasing


@SETTINGS
@given(
    cuts=st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3)), max_size=6),
    tail=st.integers(0, 10_000),
    steps=st.lists(
        st.one_of(st.integers(-2, 5), st.lists(st.integers(0, 3), max_size=3)), max_size=6
    ),
)
def test_fuzz_corrupted_files(tmp_path, cuts, tail, steps):
    text = nemo_file(tmp_path / "base.json", losses(6)).read_text()
    text += "".join(dll_log(s, {"loss": 1.0 + i}) for i, s in enumerate(steps))
    raw = bytearray(text.encode())
    for at, junk in cuts:
        at %= len(raw) + 1
        raw[at : at + len(junk)] = junk
    raw = raw[: max(1, len(raw) - tail % 200)]
    f = tmp_path / "corrupt.json"
    f.write_bytes(bytes(raw))
    try:
        frame = read_metrics(f, "nemo-dllogger")
    except MetricsError as e:
        _one_line_error(e, f)
    else:
        assert frame.index.is_unique and frame.index.is_monotonic_increasing
        assert frame.dtypes.map(lambda d: d == np.float64).all()
        assert re.fullmatch(r"[^\n]*", " ".join(frame.attrs["notes"]))
