"""Readers against inputs of every kind: pipes and FIFOs read whole, numbers a float64 cannot
hold, last lines cut off, JSON nested past Python's recursion limit, huge values in errors, and
the real shapes of sparse CSVs and merged JSON lines."""

import json
import os
import threading
from pathlib import Path

import pytest

import parity.readers as readers
from parity.judge.compare import compare_frames
from parity.readers import MetricsError, SkippedRecordsError, read_metrics
from parity.readers.frame import HARD_MESSAGE, MAX_MESSAGE, UNFIT, clip_message, unfit
from parity.readers.text import CUT_TAIL


def _jsonl(steps: int) -> bytes:
    """Our metrics.jsonl of `steps` steps: well over HEAD_BYTES for steps >= 20000."""
    lines = [json.dumps({"step": s, "train/loss": 1 / (s + 3), "lr": 1e-4}) for s in range(steps)]
    lines.append(json.dumps({"event": "end", "steps": steps - 1}))
    return ("\n".join(lines) + "\n").encode()


def _read_within(path, seconds: float = 20.0, **kw):
    """read_metrics in a thread: a read that blocks (a FIFO's open) fails the test, not hangs."""
    out: dict = {}

    def run():
        try:
            out["frame"] = read_metrics(path, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"read_metrics({path}) still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["frame"]


def _same(a, b) -> None:
    pd_a, pd_b = a.copy(), b.copy()
    assert list(pd_a.index) == list(pd_b.index) and list(pd_a.columns) == list(pd_b.columns)
    assert (pd_a.to_numpy().view("u8") == pd_b.to_numpy().view("u8")).all()
    assert a.attrs["complete"] == b.attrs["complete"]


# --- pipes and FIFOs -----------------------------------------------------------------------------


def test_a_pipe_is_read_whole(tmp_path):
    """`<(zcat m.jsonl.gz)` is /dev/fd/N, a pipe: the bytes format detection reads are not lost
    to the reader (a 1.6 MB stream, more than the 1 MiB detection head)."""
    data = _jsonl(30000)
    assert len(data) > 1.5 * readers.HEAD_BYTES
    regular = tmp_path / "m.jsonl"
    regular.write_bytes(data)
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        got = _read_within(f"/dev/fd/{r}")
    finally:
        writer.join(5)
        os.close(r)
    _same(got, read_metrics(regular))
    assert got.attrs["source"] == f"/dev/fd/{r}" and got.attrs["format"] == "jsonl"


def _feed_fifo(fifo: Path, payload: bytes) -> threading.Thread:
    def run():
        with open(fifo, "wb") as f:
            f.write(payload)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_fifo_is_read_whole_and_errors_name_it(tmp_path):
    data = _jsonl(30000)
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)
    regular = tmp_path / "copy" / "m.jsonl"
    regular.parent.mkdir()
    regular.write_bytes(data)
    writer = _feed_fifo(fifo, data)
    got = _read_within(fifo)
    writer.join(5)
    _same(got, read_metrics(regular))
    assert got.attrs["source"] == str(fifo)
    # an error names the FIFO and its line, never the copy read
    writer = _feed_fifo(fifo, b'{"step": 1, "a": 1.0}\n{"step": 2, "a": "x"}\n')
    with pytest.raises(MetricsError, match=rf"^{fifo}:2: value of 'a' is not numeric"):
        _read_within(fifo)
    writer.join(5)
    # the copy has the FIFO's name: formats detected by name still are
    fifo_csv = tmp_path / "m.csv"
    os.mkfifo(fifo_csv)
    writer = _feed_fifo(fifo_csv, b"step,a\n1,0.5\n")
    frame = _read_within(fifo_csv)
    writer.join(5)
    assert frame.attrs["format"] == "csv" and frame.attrs["source"] == str(fifo_csv)


def test_a_fifo_with_no_writer_is_refused_in_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "FIFO_WAIT_S", 0.3)
    fifo = tmp_path / "nobody.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(MetricsError, match=rf"^{fifo}: a FIFO with no writer after 0\.3 s$"):
        _read_within(fifo, seconds=10)


def test_a_stream_over_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "STREAM_LIMIT", 1000)
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as f:
            try:
                f.write(_jsonl(200))
            except BrokenPipeError:
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(MetricsError, match=r"a stream of more than 1000 bytes") as e:
            _read_within(f"/dev/fd/{r}")
    finally:
        os.close(r)
        writer.join(5)
    assert "\n" not in str(e.value)


# --- numbers a float64 cannot hold ---------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"step,loss\r1,0.5\r2,0.25\r", b"step,loss\n1,0.5\r2,0.25\r"])
def test_lines_ending_in_a_carriage_return_alone_are_named(tmp_path: Path, raw: bytes) -> None:
    """Classic Mac OS line endings (CR alone; a header written apart may end in LF): named as
    such, not as a last line cut off. CRLF is read as ever."""
    path = tmp_path / "m.csv"
    path.write_bytes(raw)
    with pytest.raises(MetricsError, match="carriage return alone") as e:
        read_metrics(path)
    assert "\n" not in str(e.value)
    path.write_bytes(
        b"".join(line + b"\r\n" for line in raw.replace(b"\n", b"\r").split(b"\r")[:-1])
    )
    assert list(read_metrics(path)["loss"]) == [0.5, 0.25]


def test_unfit_is_overflow_and_underflow_only():
    assert unfit("1e999", float("1e999")) and unfit("-2e999", float("-2e999"))
    assert unfit("1e-400", 0.0) and unfit("2.5e-324", 0.0) and unfit(b"1E-999", 0.0)
    assert unfit("0." + "0" * 400 + "1", 0.0)
    for text in ("Infinity", "-inf", "INF", "nan", "0.0", "-0.0", "0e-999", "1e-310", "5e-324"):
        assert not unfit(text, float(text)), text
    # a counter past 2**53 with a zero fraction is lost as one without; a float64's repr is not
    for text in ("9007199254740993", "9007199254740993.0", "-9007199254740993.00"):
        assert unfit(text, float(text)), text
    for text in ("9007199254740994.0", repr(2.0**60), "1.2345678901234567e+20"):
        assert not unfit(text, float(text)), text


def _mlflow(tmp_path: Path, lines: str) -> Path:
    root = tmp_path / "mlruns"
    run = root / "0" / "r1"
    (run / "metrics").mkdir(parents=True)
    (root / "0" / "meta.yaml").write_text("name: Default\nlifecycle_stage: active\n")
    (run / "meta.yaml").write_text("run_name: r\nstatus: 3\nlifecycle_stage: active\n")
    (run / "metrics" / "loss").write_text(lines)
    return root


def _dll(step, data: str) -> str:
    return f'DLLL {{"type": "LOG", "step": {json.dumps(step)}, "data": {data}}}\n'


# (file name, text, where the unfit numbers are); every file also holds a value that fits
UNFIT_CASES = {
    "jsonl": (
        "m.jsonl",
        '{"step": 1, "a": 1e999, "b": 0.5}\n{"step": 2, "a": -2e999, "b": 1e-400}\n'
        '{"step": 3, "a": Infinity, "b": 1e-310}\n{"event": "end", "steps": 3}\n',
        ["line 1 ('a')", "line 2 ('a')", "line 2 ('b')"],
    ),
    "verl-jsonl": (
        "v.jsonl",
        '{"step": 1, "data": {"a": 1e999, "b": 0.5}}\n{"step": 3, "data": {"a": 1.5}}\n',
        ["line 1 ('a')"],
    ),
    "csv": (
        "m.csv",
        "step,a,b\n1,1e999,0.5\n2,1e-400,\n3,inf,1e-310\n",
        ["line 2 ('a')", "line 3 ('a')"],
    ),
    "verl-console": (
        "c.log",
        "step:1 - a:1e999 - b:0.5\nstep:2 - a:np.float32(1e-50) - b:-inf\nstep:3 - a:1e-310\n",
        ["line 1 ('a')", "line 2 ('a')"],
    ),
    "torchtitan-loss": (
        "losses/run_loss.txt",
        "1 10.5\n2 1e999\n3 1e-400\n4 9.5\n",
        ["line 2 ('loss_metrics/global_avg_loss')", "line 3 ('loss_metrics/global_avg_loss')"],
    ),
    "nemo-dllogger": (
        "dll.json",
        _dll(1, '{"loss": 1e999, "lr": 0.1}') + _dll(2, '{"loss": 2.5, "n": ' + "9" * 400 + "}"),
        ["line 1 ('loss')", "line 2 ('n')"],
    ),
    "megatron-golden": (
        "golden_values.json",
        '{"lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1, '
        '"values": {"1": 10.84009, "2": 1e999, "3": 1e-400}}}\n',
        ["'lm loss' step 2", "'lm loss' step 3"],
    ),
    "lightning-csv": (
        "lightning_logs/version_0/metrics.csv",
        "loss,step\r\n1e999,1\r\n0.5,2\r\n",
        ["line 2 (loss)"],
    ),
    "hf-trainer-state": (
        "trainer_state.json",
        '{"log_history": [{"loss": 1e999, "step": 1}, {"loss": 0.5, "step": 2}]}\n',
        ["log_history[0] ('loss')"],
    ),
}


@pytest.mark.parametrize("fmt", sorted(UNFIT_CASES))
def test_a_number_a_float64_cannot_hold_is_a_skipped_record(tmp_path, fmt):
    """1e999 is no inf and 1e-400 no 0.0: each is skipped and counted with its line, so
    compare refuses the side naming the file; Infinity and 1e-310 are values."""
    name, text, where = UNFIT_CASES[fmt]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    frame = read_metrics(path)
    assert frame.attrs["format"] == fmt
    skipped = {s["reason"]: s["where"] for s in frame.attrs["skipped"]}
    assert skipped == {UNFIT: where}
    with pytest.raises(SkippedRecordsError, match=rf"{path.name}.*{len(where)} records skipped"):
        compare_frames(frame, frame)


def test_spelled_infinities_and_subnormals_are_values(tmp_path):
    frame = read_metrics(_write(tmp_path, "m.csv", "step,a,b\n3,inf,1e-310\n"))
    assert frame.loc[3, "a"] == float("inf") and frame.loc[3, "b"] == 1e-310
    assert frame.attrs["skipped"] == []
    jl = read_metrics(_write(tmp_path, "m.jsonl", '{"step": 3, "a": -Infinity, "b": 5e-324}\n'))
    assert jl.loc[3, "a"] == float("-inf") and jl.loc[3, "b"] == 5e-324
    console = read_metrics(
        _write(tmp_path, "c.log", "step:1 - a:0.0 - b:-0.0 - c:inf - d:0e-999\n")
    )
    assert console.attrs["skipped"] == [] and console.loc[1, "c"] == float("inf")


def test_mlflow_file_store_skips_what_a_float64_cannot_hold(tmp_path):
    frame = read_metrics(_mlflow(tmp_path, "1 1e999 1\n2 0.5 2\n3 1e-400 3\n4 inf 4\n"))
    skipped = {s["reason"]: s["where"] for s in frame.attrs["skipped"]}
    assert skipped == {UNFIT: ["metrics/loss:1", "metrics/loss:3"]}
    assert frame.loc[4, "loss"] == float("inf") and list(frame.index) == [2, 4]


def test_console_fast_path_leaves_unfit_numbers_to_the_line_reader():
    from parity.readers.verl_console import _console_fast

    assert _console_fast(b"step:1 - a:1e-400\n") is None
    assert _console_fast(b"step:1 - a:1e999\n") is None
    assert _console_fast(b"step:1 - a:0.0 - b:-inf - c:Infinity - d:-0.000\n") is not None
    assert _console_fast(b"step:1 - a:0e5\n") is None  # a digit 1-9: left to the line reader


# --- a last line cut off -------------------------------------------------------------------------

CUT_CASES = [
    ("m.csv", "step,a\n1,0.5\n2,0.12", 3),  # 0.1234 cut
    ("c.log", "step:1 - a:0.5\nstep:2 - a:0.12", 2),
    ("c.log", "noise\nstep:1 - a:0.5\r\n(TaskRunner pid=3) step:2 - a:0.12", 3),
    ("losses/t_loss.txt", "1 10.5\n2 10.4", 2),
    ("c.log", "step:1 - a:0.5\nste", 2),  # cut before its values: only `step:`'s start left
    ("c.log", "step:1 - a:0.5\n(TaskRunner pid=3) step:2 -", 2),
    ("c.log", "step:1 - a:0.5\n 50%|#####     | 1/2 [00:01<00:01]s", 2),
]


@pytest.mark.parametrize(("name", "text", "line"), CUT_CASES)
def test_a_cut_last_line_is_a_cut_tail(tmp_path, name, text, line):
    """No newline at the end: the run is still writing or was killed, and a number cut there
    still parses; the line is skipped and counted, so no verdict comes from it."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    frame = read_metrics(path)
    assert list(frame.index) == [1]
    assert frame.attrs["skipped"] == [{"reason": CUT_TAIL, "count": 1, "where": [f"line {line}"]}]
    with pytest.raises(SkippedRecordsError, match=rf"line {line}"):
        compare_frames(frame, frame)


def test_a_cut_tail_without_a_step_line_loses_nothing(tmp_path):
    path = _write(tmp_path, "c.log", "step:1 - a:0.5\n 50%|#####     | 1/2 [00:01<00:01]")
    frame = read_metrics(path)
    assert frame.attrs["skipped"] == [] and frame.loc[1, "a"] == 0.5
    for tail in ("saving checkpoints", "timeste", "global_step:2 -"):  # no step line's start
        frame = read_metrics(_write(tmp_path, "c.log", f"step:1 - a:0.5\n{tail}"))
        assert frame.attrs["skipped"] == [], tail
    with pytest.raises(MetricsError, match=r"c\.log:1: no metrics records: the only step line"):
        read_metrics(_write(tmp_path, "c.log", "step:1 - a:0.5"))


# --- JSON nested past Python's recursion limit ---------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize(
    ("name", "text", "pattern"),
    [
        ("m.jsonl", '{"step": 1, "a": 1}\n{"step": 2, "a": NEST}\n', r"m\.jsonl:2: "),
        ("m.jsonl", "NEST\n", r"m\.jsonl:1: "),
        ("v.jsonl", '{"step": 1, "data": {"a": 1}}\n{"step": 2, "data": NEST}\n', r"v\.jsonl:2: "),
        ("trainer_state.json", '{"log_history": [{"step": 1, "loss": NEST}]}', r"state\.json"),
        (
            "golden_values.json",
            '{"lm loss": {"start_step": 0, "end_step": 1, "step_interval": NEST, "values": []}}',
            r"golden_values\.json",
        ),
    ],
)
def test_json_nested_deep_is_a_one_line_error(tmp_path, name, text, pattern, depth):
    path = _write(tmp_path, name, text.replace("NEST", _nested(depth)))
    with pytest.raises(MetricsError, match=pattern) as e:
        read_metrics(path)
    assert "\n" not in str(e.value) and len(str(e.value)) <= HARD_MESSAGE


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_json_nested_deep_in_dllogger_and_mlflow_is_skipped_or_refused(tmp_path, depth):
    path = _write(tmp_path, "d.json", _dll(1, '{"a": 1.0}') + f"DLLL {_nested(depth)}\n")
    frame = read_metrics(path)
    assert frame.attrs["skipped"] == [
        {"reason": "DLLL lines that do not parse", "count": 1, "where": ["line 2"]}
    ]
    root = _mlflow(tmp_path, "1 0.5 1\n")
    (root / "0" / "r1" / "meta.yaml").write_text(_nested(depth))
    with pytest.raises(MetricsError, match="no MLflow runs"):
        read_metrics(root)


# --- bounded errors ------------------------------------------------------------------------------


def test_a_huge_value_is_elided_in_errors_and_notes(tmp_path):
    huge = "x" * 10_000_000
    big = huge[:100_000]  # Python's csv refuses a field over 128 KiB in one line of its own
    path = _write(tmp_path, "m.csv", f"step,a\n1,0.5\n2,{big}\n")
    with pytest.raises(MetricsError) as e:
        read_metrics(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: value of 'a' is not numeric: 'xxx") and "...'" in msg
    assert len(msg) <= MAX_MESSAGE
    path = _write(tmp_path, "m.jsonl", json.dumps({"step": 1, "a": huge}) + "\n")
    with pytest.raises(MetricsError, match=r"m\.jsonl:1: value of 'a' is not numeric") as e:
        read_metrics(path)
    assert len(str(e.value)) <= MAX_MESSAGE
    path = _write(tmp_path, "c.log", f"step:1 - a:0.5\nstep:2 - a:{huge}\n")
    frame = read_metrics(path)
    assert all(len(n) <= MAX_MESSAGE for n in frame.attrs["notes"])
    with pytest.raises(SkippedRecordsError) as e:
        compare_frames(frame, frame)
    assert len(str(e.value)) <= HARD_MESSAGE and "--allow-skipped" in str(e.value)


def test_clip_keeps_short_messages_and_the_path():
    assert clip_message("a/b.csv:3: short") == "a/b.csv:3: short"
    path = "/very/long/" + "p" * 120 + "/m.csv:3:"
    msg = clip_message(f"{path} value got {'9' * 5000} and the advice at the end")
    assert msg.startswith(path) and msg.endswith("and the advice at the end")
    assert len(msg) <= MAX_MESSAGE
    words = clip_message("word " * 1000)
    assert len(words) <= HARD_MESSAGE and " ... " in words
    assert str(SkippedRecordsError("x " * 2000)).count("x") < 500  # subclasses clip too


# --- real shapes ---------------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_sparse_csv_rows_of_one_step_merge(tmp_path):
    frame = read_metrics(_write(tmp_path, "m.csv", "step,loss,val_loss\n1,0.5,\n1,,0.4\n2,0.3,\n"))
    assert frame.loc[1, "loss"] == 0.5 and frame.loc[1, "val_loss"] == 0.4
    assert list(frame.index) == [1, 2] and frame.attrs["skipped"] == []
    twice = _write(tmp_path, "t.csv", "step,loss,val_loss\n1,0.5,\n1,0.6,0.4\n")
    with pytest.raises(MetricsError, match=r"t\.csv:3: step 1: 'loss' is 0\.6 here but 0\.5 at"):
        read_metrics(twice)
    assert read_metrics(twice, duplicates="last").loc[1, "loss"] == 0.6


def test_jsonl_records_of_one_step_merge(tmp_path):
    path = _write(
        tmp_path,
        "metrics.jsonl",
        '{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/loss": 0.25}\n'
        '{"step": 2, "eval/loss": 0.75}\n{"event": "end", "steps": 2}\n',
    )
    frame = read_metrics(path)
    assert frame.loc[2, "train/loss"] == 0.25 and frame.loc[2, "eval/loss"] == 0.75
    assert list(frame.index) == [1, 2] and frame.attrs["complete"] is True
    path.write_text('{"step": 2, "a": 0.25}\n{"step": 2, "a": 0.5}\n')
    with pytest.raises(MetricsError, match=r":2: step 2: 'a' is 0\.5 here but 0\.25 at line 1"):
        read_metrics(path)
    assert read_metrics(path, duplicates="first").loc[2, "a"] == 0.25
