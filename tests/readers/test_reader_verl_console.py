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
import pandas as pd
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


DECIMALS = st.decimals(-100, 100, places=4, allow_nan=False, allow_infinity=False).map(float)
COLUMN = st.lists(
    DECIMALS  # a log rounded at 4 places (read at its decimals) ...
    | st.floats(allow_nan=True, allow_infinity=True)  # ... or in full, huge, inf, nan
    | st.integers(-(10**12), 10**12).map(float)
    | st.sampled_from([0.1, 0.5, 1e-4, 0.3125]),
    min_size=1,
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(columns=st.lists(COLUMN, min_size=1, max_size=3), float32=st.booleans())
def test_precision_is_infer_decimals_without_sorting_every_column(columns, float32):
    """The read's precision: what finish(written=True) gives (frame.infer_decimals), though
    columns whose first values are written in full skip frame.rounded_places."""
    from parity.readers.frame import FLOAT32, infer_decimals
    from parity.readers.verl_console import _written_precision

    n = max(len(c) for c in columns)
    frame = pd.DataFrame({f"m{i}": c + [np.nan] * (n - len(c)) for i, c in enumerate(columns)})
    precision = {"m0": FLOAT32} if float32 else {}

    def every(p: dict) -> dict:  # as finish() takes a precision: float64 where none is named
        return {c: p.get(c, "float64") for c in frame.columns}

    assert every(_written_precision(frame, precision)) == infer_decimals(frame, every(precision))


def test_a_log_in_full_precision_sorts_no_column(tmp_path, monkeypatch):
    """A long log whose values are Python reprs in full asks frame.rounded_places nothing (it
    sorts each column: a fifth of a read's time before), and one rounded at 4 places is still
    read at them."""
    import parity.readers.frame

    rng = np.random.default_rng(0)
    full = "".join(f"step:{i} - a:{rng.standard_normal()!r} - b:{i / 7!r}\n" for i in range(500))
    rounded = "".join(f"step:{i} - a:{rng.standard_normal():.4f}\n" for i in range(500))
    (tmp_path / "full.log").write_text(full)
    (tmp_path / "rounded.log").write_text(rounded)
    asked = []
    real = parity.readers.frame.rounded_places
    monkeypatch.setattr(
        parity.readers.frame, "rounded_places", lambda x: asked.append(1) or real(x)
    )
    assert read_metrics(tmp_path / "full.log", "verl-console").attrs["precision"] == {
        "a": "float64",
        "b": "float64",
    }
    assert not asked
    assert read_metrics(tmp_path / "rounded.log", "verl-console").attrs["precision"] == {
        "a": "decimals:4"
    }


SEPARATOR = st.sampled_from([" - "] * 6 + [" -  ", "  - ", " -", "- ", " - - ", " -\t", ""])
TOKEN = st.sampled_from(["a:1", "b:-2e-05", "x-y:-1", "c: 3", "-", "", "d:nan", "e:-", "f:1 "])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(SEPARATOR, TOKEN), max_size=4), min_size=1, max_size=4))
def test_rows_are_the_replaced_tokens_or_none(lines):
    """`_rows`, numpy's stand-in for `text.replace(b" - ", b"\n")`: the same rows (after a
    line's first, each key with '- ' in front), or None where the replace would leave a space or
    tab in a token or an empty token, or a token the parser refuses anyway (' - - - ' replaced
    leaves a '-' without ':')."""
    from parity.readers.verl_console import _rows

    text = "\n".join("step:1" + "".join(s + t for s, t in line) for line in lines).encode()
    replaced = text.replace(b" - ", b"\n")
    clean = not any(c in replaced for c in b" \t") and b"\n\n" not in replaced
    clean = clean and not replaced.endswith(b"\n")
    body = _rows(text)
    assert body is None or clean
    if body is None:
        assert not clean or any(b":" not in row for row in replaced.split(b"\n"))
    else:
        assert [r.removeprefix(b"- ") for r in body.split(b"\n")] == replaced.split(b"\n")


def test_a_metric_named_step_is_left_to_the_line_reader(tmp_path):
    """`_rows` keeps '- ' before each later key: '- step' taken off is the lines' own 'step',
    which the vectorised reader must decline (the line reader names it), not take for steps."""
    from parity.readers.frame import MetricsError
    from parity.readers.verl_console import _console_fast

    text = b"step:1 - step:1 - a:1\nstep:2 - step:2 - a:2\n"
    assert _console_fast(text) is None
    (tmp_path / "x.log").write_bytes(text)
    with pytest.raises(MetricsError, match="may not be named 'step'"):
        read_metrics(tmp_path / "x.log", "verl-console")
