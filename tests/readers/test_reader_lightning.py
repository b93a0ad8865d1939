"""Lightning CSVLogger `metrics.csv`: files written by Lightning's own loggers (fabric's and
pytorch's `CSVLogger.log_metrics`, shaped as the pytorch Trainer logs), plus hand-made edge
cases and fuzzing."""

import csv
import io
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.readers import MetricsError, detect, read_metrics, skipped_count, write_metrics

FMT = "lightning-csv"
SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def bits(x: float) -> int:
    return int(np.float64(x).view(np.uint64))


def trainer_like_log(logger, torch, steps: int = 6) -> dict[tuple[int, str], float]:
    """Log as the pytorch Trainer does: a training row per step (float32 tensors, `epoch`),
    a validation row and an epoch-level row at the same step as a training row; a key that
    first appears after a flush (the file is rewritten under the wider header). Returns what
    each (step, metric) must read back as."""
    torch.manual_seed(0)
    want: dict[tuple[int, str], float] = {}

    def log(metrics, step):
        logger.log_metrics(metrics, step=step)
        for k, v in metrics.items():
            want[(step, k)] = v.item() if isinstance(v, torch.Tensor) else float(v)

    for step in range(steps):
        epoch = step // 3
        log({"train_loss_step": torch.rand((), dtype=torch.float32) * 3, "epoch": epoch}, step)
        if step % 3 == 2:
            log({"val_loss": torch.rand((), dtype=torch.float32), "epoch": epoch}, step)
            log({"train_loss_epoch": torch.tensor(1 / 3), "epoch": epoch}, step)
        if step == 4:
            log({"lr-SGD": 0.1 * 0.9**step, "grad_norm": math.inf, "epoch": epoch}, step)
    logger.finalize("success")
    return want


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """Two versions under one save_dir: version_0 by pytorch_lightning's CSVLogger (with
    hparams.yaml), version_1 by lightning_fabric's (no hparams.yaml)."""
    torch = pytest.importorskip("torch")
    pl_loggers = pytest.importorskip("pytorch_lightning.loggers")
    fabric_loggers = pytest.importorskip("lightning_fabric.loggers")
    root = tmp_path_factory.mktemp("pl")
    pl = pl_loggers.CSVLogger(root, flush_logs_every_n_steps=2)
    pl.log_hyperparams({"lr": 0.1})
    want0 = trainer_like_log(pl, torch)
    fabric = fabric_loggers.CSVLogger(root, flush_logs_every_n_steps=2)
    want1 = trainer_like_log(fabric, torch, steps=4)
    logs = root / "lightning_logs"
    assert (logs / "version_0" / "hparams.yaml").is_file()
    assert not (logs / "version_1" / "hparams.yaml").exists()
    return {"root": root, "logs": logs, "want": [want0, want1]}


def assert_reads(frame: pd.DataFrame, want: dict[tuple[int, str], float]) -> None:
    assert frame.index.is_unique and frame.index.is_monotonic_increasing
    assert int(frame.attrs["present"].to_numpy().sum()) == len(want)
    for (step, name), v in want.items():
        got = frame.at[step, name]
        assert bits(got) == bits(v) or math.isnan(got) and math.isnan(v), (step, name)


def test_real_files_read_bit_for_bit(lightning_runs):
    for version, want in enumerate(lightning_runs["want"]):
        path = lightning_runs["logs"] / f"version_{version}" / "metrics.csv"
        raw = path.read_bytes()
        assert b"\r\n" in raw and raw.count(b",,") > 0  # Lightning's sparse excel-dialect rows
        frame = read_metrics(path)
        assert_reads(frame, want)
        assert frame.attrs["format"] == FMT and frame.attrs["complete"] is None
        precision = dict(frame.attrs["precision"])
        if version == 0:  # 0.1 * 0.9**4 prints 0.06561: no text tells it from a rounded value
            assert precision.pop("lr-SGD") == "decimals:5"
        assert set(precision.values()) == {"float64"}
        assert skipped_count(frame) == 0 and frame.attrs["notes"] == []
    frame = read_metrics(lightning_runs["logs"] / "version_0")
    assert "epoch" in frame.columns and frame.at[5, "epoch"] == 1.0
    assert frame.at[4, "grad_norm"] == math.inf and math.isnan(frame.at[3, "val_loss"])


def test_real_folders_detection_and_runs(lightning_runs):
    root, logs = lightning_runs["root"], lightning_runs["logs"]
    for path in (root, logs, logs / "version_0", logs / "version_1" / "metrics.csv"):
        assert detect(path).name == FMT, path
    for path in (root, logs):
        with pytest.raises(MetricsError, match=r"holds 2 runs: version_0, version_1; .*--run"):
            read_metrics(path)
    assert_reads(read_metrics(logs, run="version_1"), lightning_runs["want"][1])
    assert_reads(read_metrics(root, run="0"), lightning_runs["want"][0])
    with pytest.raises(MetricsError, match=r"no run 'version_7' \(have: version_0, version_1\)"):
        read_metrics(logs, run="version_7")
    with pytest.raises(MetricsError, match=r"metrics\.csv: --run 'version_0' picks a run of a"):
        read_metrics(logs / "version_0" / "metrics.csv", run="version_0")


def test_claimed_outside_its_folder_by_its_sorted_header(lightning_runs, tmp_path):
    """fabric's file copied out of version_N: its sorted header (`epoch` before `step`) is
    Lightning's; our own csv (step first) named metrics.csv is the generic csv's."""
    src = lightning_runs["logs"] / "version_1" / "metrics.csv"
    shutil.copy(src, tmp_path / "metrics.csv")
    assert detect(tmp_path / "metrics.csv").name == FMT
    assert detect(tmp_path).name == FMT
    ours = tmp_path / "ours"
    ours.mkdir()
    frame = read_metrics(src)
    frame.attrs.clear()
    write_metrics(frame, ours / "metrics.csv", "csv")
    assert detect(ours / "metrics.csv").name == "csv"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.csv").write_text("epoch,step,loss\n0,1,0.5\n")  # unsorted: not Lightning's
    assert detect(plain / "metrics.csv").name == "csv"
    (plain / "other.csv").write_text("epoch,loss,step\r\n0,0.5,1\r\n")
    assert detect(plain / "other.csv").name == "csv"


def version_file(tmp_path: Path, text: str, name: str = "version_0") -> Path:
    folder = tmp_path / "lightning_logs" / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metrics.csv"
    path.write_bytes(text.encode())
    return path


def test_step_first_header_claimed_in_a_version_folder(tmp_path):
    path = version_file(tmp_path, "step,train_loss,val_loss\r\n0,0.5,\r\n0,,0.25\r\n")
    assert detect(path).name == FMT
    frame = read_metrics(path)
    assert frame.at[0, "train_loss"] == 0.5 and frame.at[0, "val_loss"] == 0.25


def test_duplicate_cells_follow_the_rule(tmp_path):
    text = "epoch,loss,step\r\n0,0.5,1\r\n0,0.5,1\r\n0,0.75,1\r\n1,0.25,2\r\n"
    path = version_file(tmp_path, text)
    with pytest.raises(MetricsError) as e:
        read_metrics(path)
    assert str(e.value).startswith(f"{path}:4: step 1: 'loss' ")
    assert "line 2" in str(e.value) and "--duplicates" in str(e.value)
    assert "\n" not in str(e.value)
    assert read_metrics(path, duplicates="first").at[1, "loss"] == 0.5
    last = read_metrics(path, duplicates="last")
    assert last.at[1, "loss"] == 0.75 and any("kept the last" in n for n in last.attrs["notes"])
    back = version_file(tmp_path, "loss,step\r\n1.0,1\r\n2.0,2\r\n3.0,1\r\n", "version_1")
    frame = read_metrics(back, duplicates="last")
    assert any("steps go back at line 4" in n for n in frame.attrs["notes"])


def test_rows_without_step_and_cells_not_numbers_are_counted(tmp_path):
    text = (
        "epoch,loss,phase,step\r\n"
        "0,0.5,,1\r\n"
        "0,0.25,,\r\n"
        "0,0.125,,1.5\r\n"
        "0,0.0625,warmup,2\r\n"
        "False,True,,3\r\n"
    )
    frame = read_metrics(version_file(tmp_path, text))
    assert list(frame.index) == [1, 2, 3] and skipped_count(frame) == 3
    skipped = {s["reason"]: s["where"] for s in frame.attrs["skipped"]}
    assert skipped == {
        "rows without a step": ["line 3"],
        "rows whose step is not a non-negative integer": ["line 4"],
        "cells that are not numbers": ["line 5 (phase)"],
    }
    assert frame.at[2, "loss"] == 0.0625 and "phase" not in frame.columns
    assert frame.at[3, "epoch"] == 0.0 and frame.at[3, "loss"] == 1.0  # str(bool)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("loss,step", r"metrics\.csv:1: no metrics records: the only line has no newline"),
        ("loss,step\r\n0.5,1,9\r\n0.25,2\r\n", r"metrics\.csv:2: expected 2 fields, got 3"),
        ('loss,step\r\n"0.5,1\r\n', r"metrics\.csv:\d+: expected 2 fields, got 1"),
        ("loss,step\r\n", r"metrics\.csv: no metrics records"),
        ("loss,step,loss\r\n1,1,1\r\n", r"metrics\.csv:1: header needs exactly one 'step'"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, text, pattern):
    path = version_file(tmp_path, text)
    with pytest.raises(MetricsError, match=pattern) as e:
        read_metrics(path, FMT)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(path))


def test_digits_beyond_float64_are_not_read_as_inf(tmp_path):
    from parity.readers.frame import UNFIT

    text = "loss,step\r\n" + "9" * 400 + ",1\r\n1e-400,2\r\n1e-310,3\r\ninf,4\r\n"
    frame = read_metrics(version_file(tmp_path, text))
    assert frame.attrs["skipped"] == [
        {"reason": UNFIT, "count": 2, "where": ["line 2 (loss)", "line 3 (loss)"]}
    ]
    assert frame.at[3, "loss"] == 1e-310 and frame.at[4, "loss"] == math.inf


def test_a_last_row_without_its_newline_is_a_cut_tail(tmp_path):
    """A save cut short: `0.25` of `0.2512` still parses; the row is skipped and counted, so
    compare refuses the side (no verdict from it) unless told to allow skipped records."""
    from parity.judge.compare import compare_frames
    from parity.readers import SkippedRecordsError
    from parity.readers.text import CUT_TAIL

    frame = read_metrics(version_file(tmp_path, "loss,step\r\n0.5,1\r\n0.25,2"), FMT)
    assert list(frame.index) == [1]
    assert frame.attrs["skipped"] == [{"reason": CUT_TAIL, "count": 1, "where": ["line 3"]}]
    with pytest.raises(SkippedRecordsError, match=r"metrics\.csv.*line 3"):
        compare_frames(frame, frame)
    cut = read_metrics(version_file(tmp_path, "loss,step\r\n0.5,1\r\n0.25"), FMT)  # 1 field
    assert cut.attrs["skipped"] == frame.attrs["skipped"]


# --- fuzzing ------------------------------------------------------------------------------------

cell_values = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**53), 2**53)  # past 2**53 an integer is refused: test_readers.py
    | st.booleans()
    | st.none()
)


@SETTINGS
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 6),
            st.dictionaries(st.sampled_from(["a", "epoch", "val/x", "ü"]), cell_values),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_fuzz_rows_as_dictwriter_writes_them(tmp_path, rows):
    """Any sparse rows written as Lightning's DictWriter writes them read back as the last
    value of each (step, key), bit for bit."""
    keys = sorted({"step"} | {k for _, r in rows for k, v in r.items() if v is not None})
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=keys)
    writer.writeheader()
    want: dict[tuple[int, str], float] = {}
    for step, row in rows:
        kept = {k: v for k, v in row.items() if v is not None}
        writer.writerow({**kept, "step": step})
        want.update({(step, k): float(v) for k, v in kept.items()})
    path = version_file(tmp_path, buf.getvalue())
    frame = read_metrics(path, duplicates="last")
    assert skipped_count(frame) == 0
    assert set(frame.index) == {s for s, _ in rows}
    assert_reads(frame, want)


@SETTINGS
@given(
    data=st.binary(max_size=300)
    | st.text(st.sampled_from(list('a,step\r\n"0.5e-x')), max_size=80).map(str.encode)
)
def test_fuzz_bytes_only_metrics_errors(tmp_path, data):
    path = version_file(tmp_path, "")
    path.write_bytes(data)
    for target in (path, path.parent, path.parent.parent):
        try:
            frame = read_metrics(target, FMT)
        except MetricsError as e:
            assert "\n" not in str(e) and str(e).startswith(str(target))
            continue
        assert frame.index.is_unique and frame.index.is_monotonic_increasing
