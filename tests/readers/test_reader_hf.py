"""HF Trainer / TRL `trainer_state.json`: files written by transformers' own Trainer (tiny
module, CPU, a few steps with evaluation and checkpoints), plus hand-made edge cases."""

import importlib
import json
import math
import os
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.readers import MetricsError, detect, read_metrics, skipped_count
from parity.record.names import hf_metric_name as metric_name

FMT = "hf-trainer-state"
SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def bits(x: float) -> int:
    return int(np.float64(x).view(np.uint64))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """One real run: 5 steps, logging every step, eval every 2 (and at the end), checkpoints
    every 2, TensorBoard beside; its output_dir, TB folder and log_history."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("hf")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(root / "out"),
        use_cpu=True,
        logging_steps=1,
        report_to=["tensorboard"],
        max_steps=5,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        seed=0,
        disable_tqdm=True,
    )
    with mock.patch.dict(os.environ, {"TENSORBOARD_LOGGING_DIR": str(root / "tb")}):
        trainer = transformers.Trainer(
            model=Tiny(), args=args, train_dataset=data, eval_dataset=data[:8]
        )
        trainer.train()
        trainer.save_state()
    out = root / "out"
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {"out": out, "tb": root / "tb", "history": history}


def test_real_file_names_and_values(hf_run):
    """Every numeric key of every log_history row is in the frame at its step, bit for bit,
    under the name HF's TensorBoard/W&B callbacks give it."""
    frame = read_metrics(hf_run["out"] / "trainer_state.json")
    history = hf_run["history"]
    want = set()
    for row in history:
        for key, value in row.items():
            if key != "step":
                name = metric_name(key)
                want.add(name)
                assert bits(frame.at[row["step"], name]) == bits(value), (row["step"], key)
    assert set(frame.columns) == want
    assert list(frame.index) == [1, 2, 3, 4, 5]
    # the summary row lives beside the last step's train/loss, under TensorBoardCallback's names
    for name in ("train/loss", "train/train_loss", "train/train_runtime", "train/total_flos"):
        assert name in frame.columns and not math.isnan(frame.at[5, name])
    assert {"eval/loss", "eval/runtime", "train/epoch", "train/learning_rate"} <= want
    assert frame.attrs["format"] == FMT and frame.attrs["complete"] is True
    assert skipped_count(frame) == 0 and frame.attrs["notes"] == []


def test_real_file_precision(hf_run):
    """5.x does not round loss (its values prove it); speed metrics are rounded in every
    version."""
    prec = read_metrics(hf_run["out"]).attrs["precision"]
    assert prec["train/loss"] == "float64" and prec["eval/loss"] == "float64"
    assert prec["train/grad_norm"] == "float64"
    assert prec["eval/runtime"] == prec["train/train_runtime"] == "decimals:4"
    assert prec["eval/samples_per_second"] == prec["train/train_steps_per_second"] == "decimals:3"
    # a real Trainer's computed values (lr schedule, float32 grad norms, flos) are never read
    # as rounded: only the metrics HF itself rounds are
    hf_rounds = ("loss", "epoch", "runtime", "per_second")
    assert {n: p for n, p in prec.items() if not n.endswith(hf_rounds)} == dict.fromkeys(
        [n for n in prec if not n.endswith(hf_rounds)], "float64"
    )


def test_real_output_dir_detection_and_checkpoints(hf_run, tmp_path):
    out = hf_run["out"]
    assert detect(out).name == FMT and detect(out / "trainer_state.json").name == FMT
    assert read_metrics(out).attrs["source"] == str(out / "trainer_state.json")
    # no top-level state: the highest checkpoint-N, numerically, and a note saying so
    for n, src in [(2, "checkpoint-2"), (4, "checkpoint-4"), (10, "checkpoint-5")]:
        shutil.copytree(out / src, tmp_path / f"checkpoint-{n}")
    assert detect(tmp_path).name == FMT
    frame = read_metrics(tmp_path)
    assert frame.attrs["source"] == str(tmp_path / "checkpoint-10" / "trainer_state.json")
    assert any("checkpoint-10" in n and "latest" in n for n in frame.attrs["notes"])
    assert frame.attrs["complete"] is None  # a checkpoint's state has no summary row
    assert list(read_metrics(tmp_path, run="checkpoint-2").index) == [1, 2]
    with pytest.raises(MetricsError, match=r"no checkpoint 'checkpoint-7'.*checkpoint-2, "):
        read_metrics(tmp_path, run="checkpoint-7")
    with pytest.raises(MetricsError, match=r"trainer_state\.json: --run 'checkpoint-2' picks a"):
        read_metrics(out / "trainer_state.json", run="checkpoint-2")


def test_real_run_agrees_with_its_tensorboard_events(hf_run):
    """One run read from trainer_state.json and from the events HF's TensorBoardCallback wrote
    compares aligned: same names, same steps, values equal at the coarser precision."""
    from parity.judge.compare import compare_frames

    if not importlib.import_module("parity.readers.tensorboard").FORMATS:
        pytest.skip("the TensorBoard reader (parity/readers/tensorboard.py) is still a stub")
    state = read_metrics(hf_run["out"] / "trainer_state.json")
    tb = read_metrics(hf_run["tb"])
    assert set(tb.columns) == set(state.columns)
    assert compare_frames(state, tb, {"*": "exact"}).verdict == "imprecise"  # a rounded loss
    comparison = compare_frames(state, tb, {"*": "exact"}, at_source_precision=True)
    assert comparison.verdict == "aligned", comparison


# --- hand-made files ---------------------------------------------------------------------------


def write_state(path: Path, history, **extra) -> Path:
    path.write_text(json.dumps({"global_step": 0, **extra, "log_history": history}, indent=2))
    return path


def test_old_transformers_rounding_is_proved_by_the_values(tmp_path):
    """4.x rounds loss to 4 decimals, up to 4.39 epoch to 2; a value with more digits proves
    the writer did not round that metric."""
    old = write_state(
        tmp_path / "trainer_state.json",
        [
            {"loss": 2.3026, "learning_rate": 4.5e-05, "epoch": 0.33, "step": 10},
            {"loss": 2.1, "learning_rate": 4e-05, "epoch": 0.67, "step": 20},
            {"eval_loss": 2.054321234, "eval_runtime": 1.2345, "epoch": 0.67, "step": 20},
        ],
    )
    prec = read_metrics(old).attrs["precision"]
    assert prec["train/loss"] == "decimals:4" and prec["train/epoch"] == "decimals:2"
    assert prec["eval/loss"] == "float64" and prec["eval/runtime"] == "decimals:4"
    assert prec["train/learning_rate"] == "float64"
    new = write_state(
        tmp_path / "new.json",
        [
            {"loss": 2.5, "epoch": 0.3333333333333333, "step": 1},
            {"loss": 2.302585092994046, "epoch": 0.6666666666666666, "step": 2},
        ],
    )
    prec = read_metrics(new).attrs["precision"]
    assert prec["train/loss"] == "float64" and prec["train/epoch"] == "float64"


def test_values_all_written_rounded_are_read_at_their_decimals(tmp_path):
    """A log_history a callback rounded (`round(x, 4)` on every value): each metric HF does
    not round itself is read at 4 decimals too, as in any text log, not as full float64."""
    rows = [
        {"loss": round(2.3 - s * 13 / 997, 4), "grad_norm": round(1.7 + s * 37 / 991, 4), "step": s}
        for s in range(1, 6)
    ]
    prec = read_metrics(write_state(tmp_path / "trainer_state.json", rows)).attrs["precision"]
    assert prec == {"train/grad_norm": "decimals:4", "train/loss": "decimals:4"}


def test_rows_without_step_are_skipped_and_counted(tmp_path):
    path = write_state(
        tmp_path / "trainer_state.json",
        [
            {"loss": 1.0, "step": 1},
            {"loss": 2.0},
            {"loss": 3.0, "step": -1},
            {"loss": 4.0, "step": 2.0},
            {"loss": 5.0, "step": True},
            "a note",
            {"loss": 6.0, "step": 3},
        ],
    )
    frame = read_metrics(path)
    assert list(frame.index) == [1, 3] and skipped_count(frame) == 5
    skipped = {s["reason"]: s for s in frame.attrs["skipped"]}
    assert skipped["log_history rows without a step"]["where"] == ["log_history[1]"]
    assert skipped["log_history rows whose step is not a non-negative integer"]["count"] == 3
    assert skipped["log_history entries that are not objects"]["where"] == ["log_history[5]"]


def test_non_numeric_values_are_left_out_by_design(tmp_path):
    """TRL logs null where nothing was averaged; HF's TensorBoard callback drops non-numbers
    (a bool is a number to it). Left out, named in a note, not skipped."""
    path = write_state(
        tmp_path / "trainer_state.json",
        [
            {"loss": 1.5, "rewards/acc": None, "phase": "warmup", "hist": [1, 2], "step": 1},
            {"loss": 1.25, "rewards/acc": 0.5, "flag": True, "step": 2},
        ],
    )
    frame = read_metrics(path)
    assert skipped_count(frame) == 0
    assert frame.at[2, "train/rewards/acc"] == 0.5 and frame.at[2, "train/flag"] == 1.0
    assert "train/phase" not in frame.columns and "train/hist" not in frame.columns
    (note,) = frame.attrs["notes"]
    assert "hist (1), phase (1), rewards/acc (1)" in note


def test_nan_and_infinity_as_python_json_writes_them(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text('{"log_history": [{"loss": NaN, "grad_norm": Infinity, "step": 1}]}')
    frame = read_metrics(path)
    assert math.isnan(frame.at[1, "train/loss"]) and frame.attrs["present"].at[1, "train/loss"]
    assert frame.at[1, "train/grad_norm"] == math.inf


def test_resumed_run_duplicate_steps(tmp_path):
    """A log_history holding a restarted stretch: same step, other bits -> named by the
    'error' rule, kept by 'first'/'last' with notes; rows with the same bits are one value."""
    path = write_state(
        tmp_path / "trainer_state.json",
        [
            {"loss": 1.0, "epoch": 0.5, "step": 1},
            {"loss": 0.9, "epoch": 1.0, "step": 2},
            {"eval_loss": 0.95, "epoch": 1.0, "step": 2},
            {"loss": 0.91, "epoch": 1.0, "step": 2},
            {"loss": 0.8, "epoch": 1.5, "step": 3},
        ],
    )
    with pytest.raises(MetricsError) as e:
        read_metrics(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:log_history[3]: step 2: 'train/loss' ")
    assert "log_history[1]" in msg and "--duplicates" in msg and "\n" not in msg
    first = read_metrics(path, duplicates="first")
    last = read_metrics(path, duplicates="last")
    assert first.at[2, "train/loss"] == 0.9 and last.at[2, "train/loss"] == 0.91
    assert first.at[2, "eval/loss"] == 0.95
    assert any("kept the last" in n for n in last.attrs["notes"])
    back = write_state(
        tmp_path / "back.json",
        [{"loss": 1.0, "step": 1}, {"loss": 2.0, "step": 2}, {"loss": 1.5, "step": 1}],
    )
    frame = read_metrics(back, duplicates="last")
    assert any("steps go back at log_history[2]" in n for n in frame.attrs["notes"])


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"log_history": [{"loss": 1.0, "step": 1}', r"s\.json:1: not valid JSON: .*truncated"),
        ("[1, 2]", r"s\.json: not a trainer state: the JSON is not an object"),
        ('{"global_step": 3}', r"s\.json: not a trainer state: no 'log_history' list"),
        ('{"log_history": []}', r"s\.json: no metrics records"),
        ('{"log_history": [{"loss": 1}]}', r"s\.json: no metrics records"),
        ('{"log_history": [{"a": ' + "9" * 5000 + "}]}", r"s\.json: not valid JSON"),
        ('{"log_history": ' + "[" * 100000, r"s\.json"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, text, pattern):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(MetricsError, match=pattern) as e:
        read_metrics(path, FMT)
    assert "\n" not in str(e.value)


def test_detection_of_files(tmp_path):
    """By name, or a JSON object with a log_history list (indented or on one line); not JSON
    lines nor other JSON."""
    rows = [{"loss": 1.0, "step": 1}]
    pretty = write_state(tmp_path / "state.json", rows)
    assert detect(pretty).name == FMT and read_metrics(pretty).at[1, "train/loss"] == 1.0
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"log_history": rows}))
    assert detect(flat).name == FMT
    lines = tmp_path / "m.jsonl"
    lines.write_text('{"step": 1, "log_history": 2.0}\n')
    assert detect(lines).name != FMT
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"log": rows}, indent=2))
    with pytest.raises(MetricsError, match="unknown format"):
        detect(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MetricsError, match="folder has no metrics.jsonl"):
        detect(tmp_path / "empty")


# --- fuzzing ------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
row_keys = st.sampled_from(["loss", "eval_loss", "test_acc", "epoch", "grad_norm", "step", "x"])


@SETTINGS
@given(
    rows=st.lists(
        st.dictionaries(row_keys, json_values | st.integers(0, 5), max_size=5) | json_values,
        max_size=8,
    )
)
def test_fuzz_log_history_rows(tmp_path, rows):
    """Any log_history: a frame holding exactly each row's numbers, or a one-line error."""
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": rows}))
    try:
        frame = read_metrics(path, duplicates="last")
    except MetricsError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)
        return
    assert frame.index.is_unique and frame.index.is_monotonic_increasing
    want: dict[tuple[int, str], float] = {}
    for row in rows:
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            continue
        for key, v in row.items():
            if key != "step" and isinstance(v, (int, float)):
                want[(step, metric_name(key))] = float(v)
    present = frame.attrs["present"]
    assert int(present.to_numpy().sum()) == len(want)
    for (step, name), v in want.items():
        assert bits(frame.at[step, name]) == bits(v) or (
            math.isnan(v) and frame.isna().at[step, name]
        )


@SETTINGS
@given(data=st.data())
def test_fuzz_corrupted_real_file(hf_run, tmp_path, data):
    """The real file with bytes cut, flipped or inserted: a frame or a one-line error."""
    raw = bytearray((hf_run["out"] / "trainer_state.json").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["cut", "flip", "insert"]))
        if op == "cut":
            del raw[at:]
        elif op == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        if not raw:
            raw = bytearray(b"{")
    path = tmp_path / "trainer_state.json"
    path.write_bytes(bytes(raw))
    try:
        frame = read_metrics(path)
    except MetricsError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)
        return
    assert frame.index.is_unique and frame.index.is_monotonic_increasing


def test_summary_row_repeating_a_step_key(tmp_path):
    """transformers 5.24 with include_num_input_tokens_seen puts train_runtime on every step's
    row; the summary row at the last step repeats it with another value: not a conflict."""
    from parity.readers import read_metrics

    state = {
        "log_history": [
            {"loss": 2.5, "train_runtime": 0.5, "num_input_tokens_seen": 100, "step": 1},
            {"loss": 2.25, "train_runtime": 1.1, "num_input_tokens_seen": 200, "step": 2},
            {"train_loss": 2.375, "train_runtime": 1.2, "total_flos": 10.0, "step": 2},
        ]
    }
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(state, indent=2))
    f = read_metrics(path)
    assert f.loc[2, "train/train_runtime"] == 1.1 and f.loc[2, "train/train_loss"] == 2.375
    assert f.attrs["complete"] is True and f.attrs["skipped"] == []
    assert any("repeats 'train_runtime'" in n for n in f.attrs["notes"])
