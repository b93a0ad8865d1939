"""verl's console as verl prints it: tqdm's bar on the same stream, Ray's prefixes, pformat'ed
numpy values. The log is made the way verl makes it (its LocalLogger's line built with
`pprint.pformat`, a real tqdm bar writing into the same stream, as `2>&1` gives), so a planted
difference at any step must be found at that step, and no step may go unread."""

from __future__ import annotations

import io
import numbers
import pprint
import re
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tqdm import tqdm

from parity.judge.compare import compare_frames
from parity.readers import read_metrics


def verl_line(data: dict, step: int) -> str:
    """verl/utils/logger/aggregate_logger.py: concat_dict_to_str (0.6.1 to 0.9.1)."""
    out = [f"step:{step}"]
    for k, v in data.items():
        if isinstance(v, numbers.Number):
            out.append(f"{k}:{pprint.pformat(v)}")
    return " - ".join(out)


def metrics(step: int, bump: int | None = None) -> dict:
    loss = np.float64(2.5) / np.float64(step + 1)
    if bump == step:
        loss = np.nextafter(loss, np.inf)  # one ULP: the smallest difference there is
    return {
        "train/loss": loss,
        "train/grad_norm": float(1.0 / (step + 3)),
        "train/lr": 1e-5 * step,
        "train/global_tokens": np.int64(1000 * step),
        "actor/entropy": np.float32(0.1) * np.float32(step),
        "perf/max_memory_allocated_gb": 3.25 + 0.001 * step,
        "training/global_step": step,
    }


def console_log(path: Path, steps: int, bump: int | None = None, prefix: str = "") -> Path:
    """Training progress on a real tqdm bar and verl's lines on stdout, in one stream."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        print("INFO: starting the trainer, config:", {"lr": 1e-5})
        bar = tqdm(total=steps, desc="Training Progress", file=buf, mininterval=0)
        for step in range(1, steps + 1):
            bar.update(1)
            print(prefix + verl_line(metrics(step, bump), step), flush=True)
        bar.close()
    path.write_text(buf.getvalue())
    return path


def test_every_step_read_behind_a_progress_bar(tmp_path):
    path = console_log(tmp_path / "a.log", 5)
    raw = path.read_bytes()  # the bar really is in front of the lines, on the same line
    assert len(re.findall(rb"it/s\] *step:[0-9]+ - ", raw)) == 5
    frame = read_metrics(path)
    assert list(frame.index) == [1, 2, 3, 4, 5]
    assert frame.attrs["skipped"] == []
    assert frame.loc[3, "train/loss"] == np.float64(2.5) / np.float64(4)
    assert frame.loc[3, "train/global_tokens"] == 3000.0
    assert frame.loc[2, "actor/entropy"] == float(np.float32(0.1) * np.float32(2))
    assert frame.attrs["precision"]["actor/entropy"] == "float32"
    assert frame.attrs["precision"]["train/loss"] == "float64"


@pytest.mark.parametrize("step", [1, 3, 5])
def test_the_issue_case_a_changed_loss_is_found(tmp_path, step):
    """The issue's case: 1 of 5 steps was read and a changed loss called aligned."""
    a = read_metrics(console_log(tmp_path / "a.log", 5))
    b = read_metrics(console_log(tmp_path / "b.log", 5, bump=step))
    c = compare_frames(a, b)
    assert c.verdict == "diverged"
    loss = c.metrics["train/loss"]
    assert loss.first_divergent_step == step and loss.max_ulp == 1
    assert [m for m in c.failures] == [loss]
    assert c.metrics["perf/max_memory_allocated_gb"].status == "ignored"
    assert c.reads["a"]["steps"] == 5 and "read 5 steps from" in c.table()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.integers(1, 12),
    data=st.data(),
    prefix=st.sampled_from(["", "(TaskRunner pid=4711) ", "\x1b[36m(TaskRunner pid=9)\x1b[0m "]),
)
def test_planted_difference_found_at_its_step(tmp_path, steps, data, prefix):
    bump = data.draw(st.integers(1, steps))
    a = read_metrics(console_log(tmp_path / "a.log", steps, prefix=prefix))
    b = read_metrics(console_log(tmp_path / "b.log", steps, bump=bump, prefix=prefix))
    assert len(a.index) == len(b.index) == steps
    c = compare_frames(a, b)
    assert c.metrics["train/loss"].first_divergent_step == bump
    assert c.verdict == "diverged" and len(c.failures) == 1


def test_pformat_values_of_numpy_one_and_two(tmp_path):
    """numpy >= 2 prints `np.float64(x)`, numpy 1.x the bare value: both read the same."""
    path = tmp_path / "c.log"
    path.write_text(
        "step:1 - a:np.float64(0.1) - b:np.float32(0.1) - c:np.int64(7) - d:np.float64(nan)"
        " - e:np.float64(-inf) - f:True - g:0.1\n"
        "step:2 - a:0.1 - b:0.1 - c:7 - d:nan - e:-inf - f:False - g:np.float64(0.1)\n"
    )
    f = read_metrics(path)
    assert f.loc[1, "a"] == f.loc[2, "a"] == 0.1
    assert f.loc[1, "b"] == float(np.float32(0.1)) and f.loc[2, "b"] == 0.1
    assert f.attrs["precision"]["b"] == "float32"  # a float32 value was seen in this metric
    assert f.loc[1, "c"] == 7.0 and np.isnan(f.loc[1, "d"]) and f.loc[1, "e"] == -np.inf
    assert (f.loc[1, "f"], f.loc[2, "f"]) == (1.0, 0.0)
    # judged in float32 where a side holds float32: 0.1 and float32(0.1) are then the same
    assert compare_frames(f.loc[[1]], f.loc[[1]]).ok


def test_float32_metric_judged_in_float32(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("step:1 - x:np.float32(0.1)\nstep:2 - x:np.float32(0.25)\n")
    b.write_text("step:1 - x:0.1\nstep:2 - x:0.2500001\n")
    c = compare_frames(read_metrics(a), read_metrics(b))
    x = c.metrics["x"]
    assert x.precision == "float32" and x.first_divergent_step == 2
    assert x.max_ulp == 3  # in float32 ULPs: 0.25 and float32(0.2500001) are 3 apart
    assert "judged at float32" in c.table()


def test_name_running_into_step_is_not_a_step_line(tmp_path):
    path = tmp_path / "c.log"
    path.write_text(
        "timestep:4 - x:1\nglobal_step:5 - x:1\ntrain/step:6 - x:1\n"
        "epoch 1: 100%|##| 2/2 [00:01<00:00]step:7 - x:1.5\n"
    )
    f = read_metrics(path)
    assert list(f.index) == [7] and f.loc[7, "x"] == 1.5


def test_ray_repeated_suffix(tmp_path):
    path = tmp_path / "c.log"
    path.write_text(
        "(TaskRunner pid=1) step:1 - x:0.5 [repeated 2x across cluster] (Ray deduplicates logs"
        " by default.)\n"
    )
    assert read_metrics(path).loc[1, "x"] == 0.5


def test_duplicates_rule_for_a_restarted_run(tmp_path):
    path = tmp_path / "c.log"
    path.write_text("step:1 - x:1.0\nstep:2 - x:2.0\nrestarting\nstep:2 - x:2.5\nstep:3 - x:3.0\n")
    with pytest.raises(Exception, match=r"c\.log:4: step 2: 'x' is 2\.5 here but 2\.0 at line 2"):
        read_metrics(path)
    last = read_metrics(path, duplicates="last")
    assert last.loc[2, "x"] == 2.5 and list(last.index) == [1, 2, 3]
    assert "kept the last" in last.attrs["notes"][0]
    assert read_metrics(path, duplicates="first").loc[2, "x"] == 2.0


def test_cli_refuses_a_partial_read_unless_allowed(tmp_path, capsys, monkeypatch):
    from parity.cli import main

    monkeypatch.chdir(tmp_path)  # short paths: the error line is clipped at 300 characters
    a = console_log(Path("a.log"), 4)
    b = Path("b.log")
    lines = a.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b"train/lr:", b"train/lr:oops")  # step 2's line breaks
    b.write_bytes(b"\n".join(lines))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "b.log: read 3 steps" in err and "1 records skipped" in err and "line 4" in err
    assert "'train/lr' is not numeric" in err and "--allow-skipped" in err
    assert main(["compare", str(a), str(b), "--allow-skipped"]) == 1  # step 2 missing in b
    out = capsys.readouterr().out
    assert "b: read 3 steps from" in out and "1 records skipped" in out


def test_cli_duplicates_rule(tmp_path, capsys):
    from parity.cli import main

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("step:1 - x:1.0\nstep:2 - x:2.5\n")
    b.write_text("step:1 - x:1.0\nstep:2 - x:2.0\nrestart\nstep:2 - x:2.5\n")
    assert main(["compare", str(a), str(b)]) == 2
    assert "step 2: 'x' is 2.5 here but 2.0 at line 2" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--duplicates", "last"]) == 0
    assert "kept the last" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--duplicates", "first"]) == 1


def test_one_verl_run_read_from_its_console_and_its_file_logger(tmp_path):
    """Cross-format: verl's console and its FileLogger (orjson with numpy, as in
    verl/utils/tracking.py) hold the same run; where the console shows a float32 value, the
    file's shortest float32 digits read as float64 are judged in float32 and agree."""
    orjson = pytest.importorskip("orjson")
    console = console_log(tmp_path / "console.log", 6)
    with (tmp_path / "run.jsonl").open("wb") as f:
        for step in range(1, 7):
            record = {"step": step, "data": metrics(step)}
            f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    a, b = read_metrics(console), read_metrics(tmp_path / "run.jsonl")
    assert b.attrs["format"] == "verl-jsonl"
    c = compare_frames(a, b)
    assert c.ok, c.table()
    assert c.metrics["actor/entropy"].precision == "float32"
    assert c.metrics["train/loss"].precision == "float64"


def test_a_warning_glued_to_a_step_line(tmp_path):
    """Seen in verl 0.7.0's `2>&1` output: a DataLoader worker's UserWarning written after the
    last value of a step line, before its newline. The values are read; the warning is left out
    and noted, not taken for part of the last value."""
    path = tmp_path / "c.log"
    warning = (
        "/venv/lib/python3.11/site-packages/torchdata/stateful_dataloader/stateful_dataloader.py"
        ":386: UserWarning: This DataLoader will create 8 worker processes in total."
    )
    path.write_text(
        "step:1 - train/loss:1.5 - train/total_tokens(B):0.0\n"
        f"step:2 - train/loss:1.25 - train/total_tokens(B):0.0{warning}\n"
        "  warnings.warn(\n\n"
        "step:3 - train/loss:np.float64(1.0) - train/total_tokens(B):3.2e-06\n"
    )
    f = read_metrics(path)
    assert list(f.index) == [1, 2, 3] and f.attrs["skipped"] == []
    assert f.loc[2, "train/loss"] == 1.25 and f.loc[2, "train/total_tokens(B)"] == 0.0
    assert any("other output glued to a step line" in n for n in f.attrs["notes"])
