"""Baseline files: Megatron-LM's golden values and torchtitan's loss references
(parity/readers/baselines.py).

Neither writer is a package: Megatron-LM's generator lives in its repo
(tests/functional_tests/python_test_utils/common.py, read_tb_logs_as_list: `round(value, 5)`
per TensorBoard scalar, iteration 1 and every multiple of step_interval, "nan" for a missing
one; get_test_results_from_tensorboard_logs.py: `json.dump(..., indent=4)` of the pydantic
models), and torchtitan's in its repo's scripts/loss_compare.py (export_losses_to_file:
`f"{step} {loss}"` per line; `extract_losses_from_log`: the console's `loss: {:8.5f}` cut out).
So the files here are written the way those do, in the shapes of the committed files read:
Megatron-LM tests/functional_tests/test_cases/gpt/gpt3_345m_nightly_dgx_a100_1N8G_tp1_pp2/
golden_values_lts.json (dict layout, compact) and .../gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp1_pp2/
golden_values.json (list layout with `iteration_timing_avg`); torchtitan
tests/assets/losses/llama3_cuda.txt (`step loss`) and tests/assets/losses/real_pg/a10g/llama3.txt
(`# config: ...` header and `# step loss grad_norm`).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.judge.compare import compare_frames
from parity.readers import MetricsError, detect, present_mask, read_metrics, write_metrics

SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tb_values(n: int, seed: int = 0) -> dict[int, float]:
    """What a TensorBoard scalar gives back: float32 values widened to Python floats."""
    rng = np.random.default_rng(seed)
    curve = 10.9 - np.arange(n) / 20 + rng.random(n) / 50
    return {i + 1: float(np.float32(v)) for i, v in enumerate(curve)}


def golden(values: dict[int, float], train_iters: int = 50, step_size: int = 5) -> dict:
    """One metric as Megatron's read_tb_logs_as_list makes it."""
    kept = {
        k: (round(values[k], 5) if k in values else "nan")
        for k in range(1, train_iters + 1)
        if k == 1 or k % step_size == 0
    }
    return {
        "start_step": min(kept),
        "end_step": max(kept),
        "step_interval": step_size,
        "values": kept,
    }


def write_golden(path: Path, metrics: dict[str, dict], indent: int | None = 4) -> Path:
    path.write_text(json.dumps(metrics, indent=indent))  # int keys -> "1", "5", ...
    return path


# --- Megatron golden values ---------------------------------------------------------------------


def test_megatron_dict_layout(tmp_path):
    loss = tb_values(50)
    mem = {k: 685659136.0 if k < 20 else 1043027456.0 for k in range(1, 51)}
    zeros = {k: float(2000 + k) for k in range(20, 51)}  # not logged before iteration 20
    f = write_golden(
        tmp_path / "golden_values_dev_dgx_h100.json",
        {"lm loss": golden(loss), "mem-allocated-bytes": golden(mem), "num-zeros": golden(zeros)},
    )
    assert detect(f).name == "megatron-golden"
    frame = read_metrics(f)
    steps = [1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50]
    assert list(frame.index) == steps
    assert frame["lm loss"].tolist() == [round(loss[s], 5) for s in steps]
    assert frame.attrs["precision"] == dict.fromkeys(frame.columns, "decimals:5")
    assert list(present_mask(frame)["num-zeros"]) == [s >= 20 for s in steps]
    assert frame.attrs["skipped"] == []
    assert any("'num-zeros': 4 values written as \"nan\"" in n for n in frame.attrs["notes"])


def test_megatron_compact_file_as_committed(tmp_path):
    # the shape of gpt3_345m_nightly_dgx_a100_1N8G_tp1_pp2/golden_values_lts.json: one line
    f = tmp_path / "golden_values_lts.json"
    f.write_text(
        '{"lm loss": {"start_step": 1, "end_step": 10, "step_interval": 5, "values": '
        '{"1": 10.84009, "5": 10.87275, "10": 10.8333}}, "iteration-time": {"start_step": 1, '
        '"end_step": 10, "step_interval": 5, "values": {"1": 13.4701, "5": 0.1208, '
        '"10": 0.1223}}, "num-zeros": {"start_step": 1, "end_step": 10, "step_interval": 5, '
        '"values": {"1": "nan", "5": "nan", "10": 2206.0}}}'
    )
    frame = read_metrics(f)
    assert frame.loc[5, "lm loss"] == 10.87275 and frame.loc[1, "iteration-time"] == 13.4701
    assert frame.loc[10, "num-zeros"] == 2206.0 and not present_mask(frame).loc[5, "num-zeros"]


def test_megatron_list_layout(tmp_path):
    # gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp1_pp2/golden_values.json: values[i] is the
    # TensorBoard scalar at position start_step + i * step_interval
    values = [10.83377, 10.86686, 10.89018, 10.81039, 10.68443]
    f = tmp_path / "golden_values.json"
    f.write_text(
        json.dumps(
            {
                "lm loss": {"start_step": 0, "end_step": 25, "step_interval": 5, "values": values},
                "num-zeros": {
                    "start_step": 0,
                    "end_step": 25,
                    "step_interval": 5,
                    "values": [1566.0, 1800.0, 1833.0, 1834.0, 1824.0],
                },
                "iteration_timing_avg": 0.11905411764705882,
            }
        )
    )
    frame = read_metrics(f)
    assert list(frame.index) == [0, 5, 10, 15, 20]
    assert frame["lm loss"].tolist() == values
    notes = " | ".join(frame.attrs["notes"])
    assert "left out 'iteration_timing_avg'" in notes and "iteration is usually step + 1" in notes


def test_megatron_planted_difference(tmp_path):
    loss = tb_values(50, seed=1)
    a = read_metrics(write_golden(tmp_path / "a.json", {"lm loss": golden(loss)}))
    planted = dict(loss)
    planted[35] += 1e-4  # shows at 5 decimals
    b = read_metrics(write_golden(tmp_path / "b.json", {"lm loss": golden(planted)}))
    res = compare_frames(a, b)
    assert res.verdict == "diverged"
    assert res.metrics["lm loss"].first_divergent_step == 35
    assert res.metrics["lm loss"].divergent_steps == 1


def test_megatron_more_decimals_is_float64_with_a_note(tmp_path):
    f = write_golden(
        tmp_path / "g.json",
        {
            "lm loss": {
                "start_step": 1,
                "end_step": 5,
                "step_interval": 4,
                "values": {"1": 10.123456, "5": 1e-05},
            }
        },
    )
    frame = read_metrics(f)
    assert frame.attrs["precision"] == {"lm loss": "float64"}
    assert any("6 decimals" in n for n in frame.attrs["notes"])


def test_megatron_bad_values_skipped_structure_errors(tmp_path):
    f = tmp_path / "g.json"
    f.write_text(
        '{"lm loss": {"start_step": 1, "end_step": 20, "step_interval": 5, "values": '
        '{"1": 10.5, "5": "oops", "x": 10.2, "10": true, "15": null, "20": NaN, '
        '"99999999999999999999": 1.0}}}'
    )
    frame = read_metrics(f)
    assert list(frame.index) == [1, 20] and math.isnan(frame.loc[20, "lm loss"])
    skipped = {s["reason"]: (s["count"], s["where"]) for s in frame.attrs["skipped"]}
    assert skipped == {
        "golden values that are not numbers": (
            3,
            ["'lm loss' step 5", "'lm loss' step 10", "'lm loss' step 15"],
        ),
        "golden values whose step is not an integer": (
            2,
            ["'lm loss' step x", "'lm loss' step 99999999999999999999"],
        ),
    }
    for text, pattern in [
        ('{"lm loss": {"start_step": 1, "end_step": 5, "values": {}}}', "step_interval must"),
        (
            '{"lm loss": {"start_step": 1, "end_step": 5, "step_interval": 0, "values": []}}',
            "step_interval must be an integer >= 1",
        ),
        (
            '{"lm loss": {"start_step": 1, "end_step": 5, "step_interval": 5, "values": 3}}',
            "values must be a list or an object",
        ),
        ('{"lm loss": [1, 2]}', "not an object with start_step"),
        ('{"a": 1, "a": 2}', "'a'.*given twice"),
        ("[1, 2]", "must be a JSON object"),
        ('{"lm loss": {"start_step": 1,', "not valid JSON"),
        ("{}", "no golden values with a step"),
    ]:
        f.write_text(text)
        with pytest.raises(MetricsError, match=pattern) as e:
            read_metrics(f, "megatron-golden")
        assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_megatron_repeated_step_key_follows_the_rule(tmp_path):
    f = tmp_path / "g.json"
    f.write_text(
        '{"lm loss": {"start_step": 1, "end_step": 5, "step_interval": 5, '
        '"values": {"1": 10.5, "5": 10.4, "5": 10.3}}}'
    )
    with pytest.raises(MetricsError, match="step 5"):
        read_metrics(f)
    assert read_metrics(f, duplicates="last").loc[5, "lm loss"] == 10.3
    assert read_metrics(f, duplicates="first").loc[5, "lm loss"] == 10.4


def test_megatron_detection_is_narrow(tmp_path):
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"model": {"hidden": 64, "values": [1, 2]}}))
    assert detect(other).name != "megatron-golden"  # (our jsonl takes a JSON object line)
    renamed = write_golden(tmp_path / "golden.txt", {"lm loss": golden(tb_values(10), 10)})
    with pytest.raises(MetricsError, match="unknown format"):  # not a .json
        detect(renamed)
    assert read_metrics(renamed, "megatron-golden").loc[5, "lm loss"] > 0


# --- torchtitan loss reference ------------------------------------------------------------------


def export_losses(path: Path, losses: dict[int, float]) -> Path:
    """As torchtitan's scripts/loss_compare.py export_losses_to_file writes them."""
    path.write_text("".join(f"{step} {losses[step]}\n" for step in sorted(losses)))
    return path


def test_torchtitan_step_loss_file(tmp_path):
    losses = tb_values(100, seed=2)
    (tmp_path / "assets" / "losses").mkdir(parents=True)
    f = export_losses(tmp_path / "assets" / "losses" / "llama3_cuda.txt", losses)
    assert detect(f).name == "torchtitan-loss"
    frame = read_metrics(f)
    assert list(frame.columns) == ["loss_metrics/global_avg_loss"]
    got = frame["loss_metrics/global_avg_loss"].to_numpy()
    want = np.array([losses[s] for s in range(1, 101)])
    assert got.view(np.uint64).tolist() == want.view(np.uint64).tolist()
    assert frame.attrs["precision"] == {"loss_metrics/global_avg_loss": "float64"}


def test_torchtitan_header_and_grad_norm(tmp_path):
    f = tmp_path / "llama3.txt"  # a file named without "loss": the header claims it
    f.write_text(
        "# config: llama3_debugmodel_fsdp2_tp2_cp2\n# ngpu: 8\n"
        "# parallelism: FSDP=2, TP=2, CP=2\n# step loss grad_norm\n"
        "1 8.023969650268555 1.5995219945907593\n2 7.695959091186523 1.4733818769454956\n"
        "3 6.947354793548584 1.8775051832199097\n"
    )
    assert detect(f).name == "torchtitan-loss"
    frame = read_metrics(f)
    assert sorted(frame.columns) == ["grad_norm", "loss_metrics/global_avg_loss"]
    assert frame.loc[2, "grad_norm"] == 1.4733818769454956
    assert any(
        "config: llama3_debugmodel_fsdp2_tp2_cp2; ngpu: 8" in n for n in frame.attrs["notes"]
    )


def test_torchtitan_console_cut_is_fixed_decimals(tmp_path):
    # extract_losses_from_log: `loss: {:8.5f}` cut out of the console, trailing zeros and all
    f = tmp_path / "baseline_losses.txt"
    f.write_text("1 10.86720\n2 10.34561\n3 9.70040\n")
    frame = read_metrics(f)
    assert frame.attrs["precision"] == {"loss_metrics/global_avg_loss": "decimals:5"}
    assert frame.loc[3, "loss_metrics/global_avg_loss"] == 9.7004


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ("1 2.3456\n", "decimals:4"),  # one row: no fixed count of decimals to see
        ("1 2.3456\n2 2.12\n3 1.9876\n", "decimals:4"),  # repr of round(loss, 4)
        ("1 0.916859\n2 0.0123457\n3 1.5\n", "digits:6"),  # `{loss:g}`
        ("1 2.345678901234567\n", "float64"),  # one row in full
        ("1 8.023969650268555\n2 7.7\n", "float64"),
    ],
)
def test_torchtitan_rounding_without_fixed_decimals_is_read_from_the_values(tmp_path, rows, want):
    """Where no fixed number of decimals decides (one row; Python's repr of round(x, 4), whose
    trailing zeros go), the values decide as in every text log: an exact policy on `1 2.3456`
    said "aligned"."""
    f = tmp_path / "loss.txt"
    f.write_text("# step loss\n" + rows)
    frame = read_metrics(f)
    assert frame.attrs["precision"] == {"loss_metrics/global_avg_loss": want}
    b = tmp_path / "b_loss.txt"
    b.write_text(f.read_text())
    verdict = compare_frames(frame, read_metrics(b)).verdict
    assert verdict == ("aligned" if want == "float64" else "imprecise")


def test_torchtitan_baseline_against_a_run(tmp_path):
    losses = tb_values(30, seed=4)
    base = read_metrics(export_losses(tmp_path / "expected_losses.txt", losses))
    run = base.copy()
    run.attrs = {}
    run.loc[17, "loss_metrics/global_avg_loss"] = float(np.float32(losses[17] * 1.001))
    write_metrics(run, tmp_path / "run", "jsonl")  # the run: our own metrics file
    res = compare_frames(base, read_metrics(tmp_path / "run"))
    assert res.verdict == "diverged"
    assert res.metrics["loss_metrics/global_avg_loss"].first_divergent_step == 17


def test_torchtitan_bad_rows_skipped_and_counted(tmp_path):
    f = tmp_path / "losses.txt"
    f.write_text(
        "1 8.5\n2 eight\n3 7.5 1.0\n-4 7.0\nx 1\n5 1_000\n6 nan\n7 6.5\n" + "9" * 5000 + " 1\n"
    )
    frame = read_metrics(f, "torchtitan-loss")
    assert list(frame.index) == [1, 6, 7] and math.isnan(frame.loc[6].iloc[0])
    assert frame.attrs["skipped"][0]["count"] == 6
    assert any("first row skipped" in n and ":2: not a number" in n for n in frame.attrs["notes"])
    f.write_text("# step loss\n# step loss grad_norm\n1 2.0 3.0\n")
    with pytest.raises(MetricsError, match=r"losses\.txt:2: a second '# step \.\.\.' line"):
        read_metrics(f, "torchtitan-loss")
    f.write_text("hello world\n")
    with pytest.raises(
        MetricsError,
        match=r"no loss rows .*\(line 1: step must be a non-negative integer, got 'hello'\)",
    ):
        read_metrics(f, "torchtitan-loss")


def test_torchtitan_duplicates(tmp_path):
    f = tmp_path / "losses.txt"
    f.write_text("1 8.5\n2 8.0\n2 8.0\n2 7.9\n")
    with pytest.raises(MetricsError, match=r"losses\.txt:4: step 2"):
        read_metrics(f)
    assert read_metrics(f, duplicates="last").loc[2].iloc[0] == 7.9


def test_torchtitan_detection_is_narrow(tmp_path):
    generic = tmp_path / "numbers.txt"
    generic.write_text("1 2.5\n2 3.5\n")
    with pytest.raises(MetricsError, match="unknown format"):
        detect(generic)
    prose = tmp_path / "loss_notes.txt"
    prose.write_text("1 loss went down\n2 it went up\n")
    with pytest.raises(MetricsError, match="unknown format"):
        detect(prose)
    folder = tmp_path / "losses" / "real_pg" / "a10g"  # as in torchtitan's tests/assets
    folder.mkdir(parents=True)
    assert detect(export_losses(folder / "qwen3.txt", {1: 2.0, 2: 1.5})).name == "torchtitan-loss"
    with pytest.raises(MetricsError, match="unknown format"):  # no header, name or folder
        detect(export_losses(tmp_path / "llama3_cuda.txt", {1: 2.0}))
    csv = tmp_path / "loss.csv"
    csv.write_text("1 2.5\n")
    assert detect(csv).name != "torchtitan-loss"


# --- fuzz ---------------------------------------------------------------------------------------


def _frame_or_one_line_error(path: Path, fmt: str) -> None:
    try:
        frame = read_metrics(path, fmt)
    except MetricsError as e:
        assert str(path) in str(e) and "\n" not in str(e)
    else:
        assert frame.index.is_unique and frame.index.is_monotonic_increasing


@SETTINGS
@given(data=st.binary(max_size=300), fmt=st.sampled_from(["megatron-golden", "torchtitan-loss"]))
def test_fuzz_random_bytes(tmp_path, data, fmt):
    f = tmp_path / ("golden.json" if fmt == "megatron-golden" else "losses.txt")
    f.write_bytes(data)
    _frame_or_one_line_error(f, fmt)


@SETTINGS
@given(
    cuts=st.lists(st.tuples(st.integers(0, 5000), st.binary(max_size=3)), max_size=5),
    tail=st.integers(0, 400),
    fmt=st.sampled_from(["megatron-golden", "torchtitan-loss"]),
)
def test_fuzz_corrupted_files(tmp_path, cuts, tail, fmt):
    if fmt == "megatron-golden":
        f = write_golden(tmp_path / "g.json", {"lm loss": golden(tb_values(20), 20)}, indent=None)
    else:
        f = tmp_path / "l.txt"
        f.write_text("# config: x\n# step loss grad_norm\n1 8.0 1.5\n2 7.5 1.25\n3 7.25 1.0\n")
    raw = bytearray(f.read_bytes())
    for at, junk in cuts:
        at %= len(raw) + 1
        raw[at : at + len(junk)] = junk
    f.write_bytes(bytes(raw[: max(1, len(raw) - tail)]))
    _frame_or_one_line_error(f, fmt)


@SETTINGS
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True)),
        min_size=1,
        max_size=20,
        unique_by=lambda r: r[0],
    )
)
def test_torchtitan_repr_round_trips(tmp_path, rows):
    f = export_losses(tmp_path / "losses.txt", dict(rows))
    frame = read_metrics(f)
    want = dict(rows)
    got = frame["loss_metrics/global_avg_loss"]
    for step, value in want.items():
        x = got.loc[step]
        assert (math.isnan(x) and math.isnan(value)) or (
            np.float64(x).view(np.uint64) == np.float64(value).view(np.uint64)
        )
