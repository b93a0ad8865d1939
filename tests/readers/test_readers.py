"""Readers: every format round-trips float64 bit for bit, and every bad file is a MetricsError."""

import json
import math
import random
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parity.readers import (
    FORMATS,
    WRITABLE,
    IncompleteRunError,
    MetricsError,
    present_mask,
    read_metrics,
    write_metrics,
)
from parity.readers.verl_console import (
    _STEP_LINE,
    _STEP_LINE_B,
    _console_fast,
    _console_slow,
    _maybe_bool,
    _pieces,
    _step_text,
    _steps_are_digits,
)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
EDGES = [0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308, -math.inf, math.inf, math.nan]
floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    EDGES
)
KEYS = [
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/global_tokens",
    "train/total_tokens(B)",
    "val/loss",
    "a.b<c>",
    "critic/score/mean@1",
    "ключ",
]
keys = st.sampled_from(KEYS) | st.text(
    st.characters(blacklist_categories=("Z", "C")),
    min_size=1,
    max_size=10,
).filter(lambda k: k not in ("step", "_meta", "event"))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    nan = np.isnan(a)
    return bool(
        (nan == np.isnan(b)).all() and (a[~nan].view(np.uint64) == b[~nan].view(np.uint64)).all()
    )


def assert_same_frame(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    assert got.index.name == "step" and got.index.dtype == np.int64
    assert list(got.index) == list(want.index)
    assert (got.dtypes == np.float64).all()
    assert (present_mask(got).to_numpy() == present_mask(want).to_numpy()).all()
    assert same_bits(got.to_numpy(), want.to_numpy())


@st.composite
def frames(draw):
    """A canonical frame with attrs["present"]; every step and every metric has a cell."""
    names = sorted(draw(st.sets(keys, min_size=1, max_size=5)))
    steps = sorted(draw(st.sets(st.integers(0, 2**40), min_size=1, max_size=6)))
    values = np.array(
        draw(st.lists(floats, min_size=len(steps) * len(names), max_size=len(steps) * len(names)))
    ).reshape(len(steps), len(names))
    present = np.array(
        draw(st.lists(st.booleans(), min_size=values.size, max_size=values.size))
    ).reshape(values.shape)
    present[np.arange(len(steps)), draw(st.integers(0, len(names) - 1))] = True
    present[draw(st.integers(0, len(steps) - 1)), np.arange(len(names))] = True
    values[~present] = np.nan
    index = pd.Index(steps, dtype=np.int64, name="step")
    frame = pd.DataFrame(values, index=index, columns=names)
    frame.attrs["present"] = pd.DataFrame(present, index=index, columns=names)
    return frame


@SETTINGS
@given(frame=frames(), fmt=st.sampled_from(WRITABLE))
def test_round_trip_every_format(tmp_path, frame, fmt):
    path = tmp_path / f"m.{fmt}"
    write_metrics(frame, path, fmt)
    got = read_metrics(path, fmt)
    assert_same_frame(got, frame)
    assert got.attrs["format"] == fmt and got.attrs["source"] == str(path)
    assert got.attrs["complete"] is (True if fmt == "jsonl" else None)
    if fmt == "verl-console":  # the vectorised and the line-by-line reader agree
        slow, slow_present = _console_slow(path.read_text(), path)
        slow.attrs["present"] = slow_present
        assert_same_frame(slow, got)


NOISE = [
    "INFO 2025-01-01 12:00:00 starting trainer",
    "(TaskRunner pid=7) Training Progress:  10%|#         | 1/10 [00:01<00:09]",
    "Traceback (most recent call last):\tnot a step line",
    "my_step:3 - x:1",
    "step:abc - x:1",
    "{'train/loss': 0.5}",
    "",
    "   ",
]
PREFIXES = ["", "(TaskRunner pid=123) ", "\x1b[36m(TaskRunner pid=9)\x1b[0m ", "INFO 12:00 "]


@SETTINGS
@given(frame=frames(), seed=st.integers(0, 2**32 - 1))
def test_console_hand_written_lines(tmp_path, frame, seed):
    """Keys shuffled per line, prefixes, noise between lines, a step split over two lines."""
    rng = random.Random(seed)
    present = frame.attrs["present"]
    lines = []
    for step, row in frame.iterrows():
        items = [(k, v) for k, v in row.items() if present.at[step, k]]
        rng.shuffle(items)
        cut = rng.randint(1, len(items))
        for part in (items[:cut], items[cut:]):
            if part:
                body = " - ".join(f"{k}:{v!r}" for k, v in part)
                lines.append(f"{rng.choice(PREFIXES)}step:{step} - {body}")
            lines.extend(rng.sample(NOISE, rng.randint(0, 2)))
    path = tmp_path / "console.log"
    # the last line ends with its newline (one without is a cut tail: test_cut_last_line_...)
    path.write_text("\n".join(rng.sample(NOISE, 2) + lines) + "\n")
    got = read_metrics(path)
    assert got.attrs["format"] == "verl-console" and got.attrs["complete"] is None
    assert_same_frame(got, frame)


def test_console_repeated_value_is_fine_conflict_is_not(tmp_path):
    path = tmp_path / "c.log"
    path.write_text("step:1 - a:0.5 - b:1\nnoise\nstep:1 - a:0.5\n")
    assert read_metrics(path).loc[1, "a"] == 0.5
    path.write_text("step:1 - a:0.5 - b:1\nnoise\nstep:1 - a:0.5000000000000001\n")
    with pytest.raises(MetricsError, match=r"c\.log:3: step 1: 'a' is 0\.5000000000000001 here"):
        read_metrics(path)
    path.write_text("step:2 - a:0.0 - a:-0.0\n")  # bits differ
    with pytest.raises(MetricsError, match=r"c\.log:1: step 2: 'a'"):
        read_metrics(path)


def test_console_values_and_keys(tmp_path):
    path = tmp_path / "c.log"
    path.write_text(
        "step:0 - train/total_tokens(B):0.001 - x:nan - y:-inf - z:inf - w:-0.0 - n:7 - k:v:2\n"
    )
    f = read_metrics(path)
    assert f.loc[0, "train/total_tokens(B)"] == 0.001 and f.loc[0, "n"] == 7.0
    assert math.isnan(f.loc[0, "x"]) and present_mask(f).loc[0, "x"]
    assert f.loc[0, "y"] == -math.inf and f.loc[0, "z"] == math.inf
    assert math.copysign(1, f.loc[0, "w"]) == -1
    assert f.loc[0, "k:v"] == 2.0  # the key is everything before the last ':'


decimal = st.from_regex(r"[+-]?[0-9]{1,25}(\.[0-9]{0,25})?([eE][+-]?[0-9]{1,3})?", fullmatch=True)


@SETTINGS
@given(values=st.lists(decimal | st.sampled_from(["nan", "inf", "-inf", "1e-400"]), min_size=1))
@example(values=["10000000000000001"])  # past 2**53: read as 1e16 by the fast path once
def test_console_decimals_parse_like_python_float(tmp_path, values):
    """pandas' C float parser (the fast path) must round exactly like float(); a number a
    float64 cannot hold (1e-400, 1e999) is skipped and counted, never read as 0.0 or inf."""
    from parity.readers.frame import UNFIT, unfit

    path = tmp_path / "c.log"
    path.write_text("".join(f"step:{i} - v:{v}\n" for i, v in enumerate(values)))
    got = read_metrics(path)
    lost = [i for i, v in enumerate(values) if unfit(v, float(v))]
    kept = [i for i in range(len(values)) if i not in lost]
    column = got.reindex(columns=["v"])["v"]
    assert same_bits(column.reindex(kept).to_numpy(), np.array([float(values[i]) for i in kept]))
    present = present_mask(got).reindex(columns=["v"], fill_value=False)["v"]
    assert not present.reindex(lost, fill_value=False).any()
    skipped = {s["reason"]: s["count"] for s in got.attrs["skipped"]}
    assert skipped == ({UNFIT: len(lost)} if lost else {})


KEY = ["a", "b", "a:b", "-", "step", "", "a b", "é", "x\t", "nan", "1", "True", ":", "k-"]
VAL = ["1", "1.5", "-0.0", "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "true", "FALSE", "1e5"]
VAL += ["1e", "", " 1", "1 ", "1_0", "0x1", "+1", ".5", "5.", "- 5", "1\t", "0", "e", "١", "--1"]
SEP = [" - "] * 8 + [" -  ", "  - ", " -", "- ", " - - "]


@st.composite
def near_valid_line(draw):
    """verl console lines with plausible mistakes in keys, values, separators and steps."""
    tokens = draw(
        st.lists(
            st.tuples(
                st.sampled_from(KEY),
                st.sampled_from([":", ":", "::", "", ": "]),
                st.sampled_from(VAL),
            ).map("".join),
            min_size=1,
            max_size=4,
        )
    )
    body = tokens[0] + "".join(draw(st.sampled_from(SEP)) + t for t in tokens[1:])
    prefix = draw(st.sampled_from(["", "x ", "(p) ", "y", "\t"]))
    step = draw(st.sampled_from(["0", "1", "007", "99999999999999999999", "9007199254740993"]))
    end = draw(st.sampled_from(["", "", " - ", " ", "\t"]))
    return f"{prefix}step:{step} - {body}{end}"


def _assert_fast_is_slow_or_declines(text: str) -> None:
    """The fast path, whole and in pieces on several threads, either declines (None) or gives
    exactly the line-by-line reader's frame."""
    import parity.readers.verl_console

    whole = _console_fast(text.encode())
    with mock.patch.object(
        parity.readers.verl_console, "_PIECE_BYTES", 4
    ):  # 8 bytes or more: in pieces
        pieces = _console_fast(text.encode())
    try:
        slow = _console_slow(text, Path("x.log"))
    except MetricsError:
        assert whole is None and pieces is None
        return
    for fast in (whole, pieces):
        if fast is not None:
            fast[0].attrs["present"], slow[0].attrs["present"] = fast[1], slow[1]
            assert_same_frame(fast[0], slow[0])


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(
        near_valid_line() | st.sampled_from(["noise", "", "step:x - a:1"]), min_size=1, max_size=5
    )
)
def test_console_fast_path_never_disagrees(lines):
    """The fast path never disagrees with the line-by-line reader."""
    text = "\n".join(lines)
    _assert_fast_is_slow_or_declines(text)


@st.composite
def same_keys_log(draw):
    """Logs whose step lines share their keys (the usual log), with plausible
    mistakes in values, separators and steps, and noise between the lines."""
    keys = draw(st.lists(st.sampled_from(KEY), min_size=1, max_size=3))
    lines = []
    for _ in range(draw(st.integers(1, 4))):
        seps = [" - "] + [draw(st.sampled_from(SEP)) for _ in keys[1:]]
        values = [draw(st.sampled_from(VAL)) for _ in keys]
        body = "".join(f"{s}{k}:{v}" for s, k, v in zip(seps, keys, values, strict=True))
        step = draw(st.sampled_from(["0", "1", "2", "007", "3", "9007199254740993"]))
        lines.append(f"step:{step}{body}")
        lines += draw(st.lists(st.sampled_from(["noise", "", "x step:y"]), max_size=1))
    return "\n".join(lines)


@settings(max_examples=300, deadline=None)
@given(text=same_keys_log())
def test_console_same_keys_never_disagrees(text):
    """The same for logs with one set of keys, which skip the cell-by-cell assembly."""
    _assert_fast_is_slow_or_declines(text)


def test_console_same_keys_skip_the_cell_assembly(monkeypatch):
    """The usual log (one set of keys, rising steps) is built without `_assemble`."""
    import parity.readers.verl_console

    text = b"step:1 - b:1.5 - a:nan\nnoise\nstep:2 - b:-2e-05 - a:3\nstep:3 - b:0 - a:1"
    monkeypatch.setattr(parity.readers.verl_console, "assemble", None)  # would raise if called
    frame, present = _console_fast(text)
    assert list(frame.columns) == ["a", "b"] and list(frame.index) == [1, 2, 3]
    assert frame["b"].tolist() == [1.5, -2e-05, 0.0] and present.to_numpy().all()
    monkeypatch.setattr(parity.readers.verl_console, "_PIECE_BYTES", 4)  # in pieces, merged
    assert _console_fast(text)[0].equals(frame)


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=30),
       size=st.integers(1, 16), end=st.booleans())  # fmt: skip
def test_pieces_cut_only_after_newlines(lines, size, end):
    """The pieces put back together are the log; each but the last ends with a newline and is
    at least `_PIECE_BYTES` long; a log under two pieces' worth stays whole."""
    import parity.readers.verl_console

    raw = b"\n".join(lines) + (b"\n" if end else b"")
    with mock.patch.object(parity.readers.verl_console, "_PIECE_BYTES", size):
        pieces = [bytes(p) for p in _pieces(raw)]
    assert b"".join(pieces) == raw
    assert all(p.endswith(b"\n") and len(p) >= size for p in pieces[:-1])
    assert len(pieces) == 1 or len(pieces[-1]) > 0
    if len(raw) < 2 * size:
        assert pieces == [raw]


def test_maybe_bool_looks_only_at_rows_read_as_0_or_1():
    """The true/false guard: a 0/1 row whose text ends in e/E declines the fast path; other
    rows ending in 'e' (a key, an exponent-free value elsewhere) do not matter."""
    body = b"step:1\na:true\nb:0.5\nc:1\nd:FALSE"
    assert _maybe_bool(body, np.array([1])) and _maybe_bool(body, np.array([4]))
    assert not _maybe_bool(body, np.array([3])) and not _maybe_bool(body, np.array([], int))
    assert _maybe_bool(body, np.array([9]))  # more rows than lines: decline, do not guess


def test_console_piece_without_step_lines(monkeypatch):
    """A piece with only other output (start-up logs) is empty, not a reason to decline."""
    import parity.readers.verl_console

    text = b"loading\n" * 8 + b"step:1 - a:1\nstep:2 - a:2"
    whole = _console_fast(text)
    monkeypatch.setattr(parity.readers.verl_console, "_PIECE_BYTES", 4)
    pieces = _console_fast(text)
    assert whole is not None and pieces is not None and pieces[0].equals(whole[0])
    assert _console_fast(b"loading\n" * 8) is None  # no step line at all: the slow reader says


STEP_TEXT_LINES = [
    "step:1 - a:1",
    "step:12 - a:1 - b:2",
    "(TaskRunner pid=1) step:3 - a:1",
    "\tstep:4 - a:1",
    "timestep:5 - a:1",
    "x step:6 - a:1 step:7 - b:1",
    "step:8",
    "step:007 - a:1",
    "step:1.0 - a:1",
    "step:9 -a:1",
    "noise",
    "",
]


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.sampled_from(STEP_TEXT_LINES) | near_valid_line(), max_size=8))
def test_step_lines_found_by_numpy_are_the_regex_lines(lines):
    """The numpy line finder takes every `step:` to its line end, or declines; with the digits
    check that the parsed steps then pass, that is exactly the regex's lines."""
    raw = "\n".join(lines).encode()
    found = _step_text(raw)
    if found is None:
        return
    text, at = found
    assert list(at) == [m.start() for m in re.finditer(rb"step:", raw)]
    candidates = [raw[a:].split(b"\n", 1)[0] for a in at]
    assert text == b"\n".join(candidates)
    heads = [c[5:].split(b" - ", 1)[0] for c in candidates]
    try:
        steps = np.array([float(h) for h in heads])
    except ValueError:
        return  # the C parser refuses these too
    regex = all(re.match(rb"[0-9]+ - ", c[5:]) for c in candidates)
    plain = all(re.fullmatch(rb"0|[1-9][0-9]{0,15}", h) and int(h) < 2**53 for h in heads)
    assert _steps_are_digits(raw, at, steps) == (regex and plain)
    if regex:
        assert text == b"\n".join(_STEP_LINE_B.findall(raw))


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_jsonl_ours(tmp_path):
    path = _write(
        tmp_path,
        "metrics.jsonl",
        '{"step": 0, "val/loss": 2.5}\n'
        '{"step": 1, "train/loss": 0.123, "train/lr": 1e-05, "_meta": {"epoch": 0}}\n'
        '{"step": 2, "train/loss": NaN, "train/lr": Infinity, "n": 3}\n'
        '{"event": "end", "steps": 2}\n',
    )
    f = read_metrics(tmp_path)  # a run folder
    assert f.attrs["complete"] is True and f.attrs["format"] == "jsonl"
    assert list(f.columns) == ["n", "train/loss", "train/lr", "val/loss"]
    assert list(f.index) == [0, 1, 2]
    assert f.loc[1, "train/lr"] == 1e-05 and f.loc[2, "n"] == 3.0
    assert present_mask(f).loc[2, "train/loss"] and not present_mask(f).loc[0, "train/loss"]
    path.write_text('{"step": 0, "a": 1.0}\n')
    assert read_metrics(path).attrs["complete"] is False


def test_detection(tmp_path):
    cases = {
        "jsonl": '{"step": 1, "a": 1.0}\n',
        "verl-jsonl": '{"step": 1, "data": {"a": 1.0}}\n',
        "verl-console": "noise\n(TaskRunner pid=1) step:1 - a:1.0\n",
        "csv": "step,a\n1,1.0\n",
    }
    for fmt, text in cases.items():
        name = "m.csv" if fmt == "csv" else "m.log"
        assert read_metrics(_write(tmp_path, name, text)).attrs["format"] == fmt
    with pytest.raises(MetricsError, match=r"m\.log: unknown format"):
        read_metrics(_write(tmp_path, "m.log", "hello\nworld\n"))


ERRORS = [
    ("m.jsonl", None, '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.', r":2: .*truncated"),
    ("m.jsonl", None, '{"step": 1, "a": 1.0}\n{"step": 2, "a": }\n', r":2: not valid JSON"),
    (
        "m.jsonl",
        None,
        '{"step": 1, "a": 1.0}\n{"step": 2, "a": "abc"}\n',
        r":2: value of 'a' is not numeric: 'abc'",
    ),
    ("m.jsonl", None, '{"step": 1, "a": true}\n', r":1: value of 'a' is not numeric"),
    ("m.jsonl", None, '{"step": 1, "a": null}\n', r":1: value of 'a' is not numeric"),
    (
        "m.jsonl",
        None,
        '{"step": 5, "a": 1}\n\n{"step": 5, "a": 2}\n',
        r":3: step 5: 'a' is 2\.0 here but 1\.0 at line 1: logged twice",
    ),
    ("m.jsonl", None, '{"step": 1, "a": 1, "a": 2}\n', r":1: key 'a' given twice"),
    ("m.jsonl", None, '{"step": -1, "a": 1}\n', r":1: step must be a non-negative integer"),
    ("m.jsonl", None, '{"step": 1.0, "a": 1}\n', r":1: step must be a non-negative integer"),
    ("m.jsonl", None, '{"a": 1}\n', r":1: record has no 'step'"),
    (
        "m.jsonl",
        None,
        '{"event": "end", "steps": 1}\n{"step": 2, "a": 1}\n',
        r":2: record after the end",
    ),
    ("m.jsonl", None, '{"event": "start"}\n', r":1: unknown event"),
    ("m.jsonl", None, "[1, 2]\n", r":1: record is not a JSON object"),
    (
        "m.jsonl",
        "verl-jsonl",
        '{"step": 1, "data": {"a": 1}}\n{"step": 1, "data": {"a": 2}}\n',
        r":2: step 1: 'a' is 2\.0 here but 1\.0 at line 1",
    ),
    ("m.jsonl", "verl-jsonl", '{"step": 1, "data": {}, "t": 3}\n', r":1: unexpected key 't'"),
    ("m.csv", None, "step,a\n1,1.0\n2,x\n", r":3: value of 'a' is not numeric: 'x'"),
    ("m.csv", None, "step,a\n1,1.0\n1,1.5\n", r":3: step 1: 'a' is 1\.5 here but 1\.0 at line 2"),
    ("m.csv", None, "step,a\n1,1.0,3\n", r":2: expected 2 fields, got 3"),
    ("m.csv", None, "a,b\n1,1.0\n", r":1: header needs exactly one 'step' column"),
    ("m.csv", None, "step,a\n-1,1.0\n", r":2: step must be a non-negative integer"),
]


@pytest.mark.parametrize(("name", "fmt", "text", "pattern"), ERRORS)
def test_errors_name_file_and_line(tmp_path, name, fmt, text, pattern):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MetricsError, match=pattern) as info:
        read_metrics(path, fmt)
    assert str(info.value).startswith(f"{path}:")
    assert "\n" not in str(info.value)


SKIPPED_LINES = [
    ("x\nstep:1 - a:1.0\nstep:2 - a:abc\n", 3, r"step 2: value of 'a' is not numeric: 'abc'"),
    ("step:1 - a:1.0 - oops\nstep:2 - a:1.0\n", 1, r"step 1: malformed metric 'oops'"),
    ("step:1 - a:1.0 - \nstep:2 - a:1.0\n", 1, r"step 1: malformed metric ''"),
    ("step:1 - a b:1.0\nstep:2 - a:1.0\n", 1, r"step 1: malformed metric"),
    ("step:1 - step:1.0\nstep:2 - a:1.0\n", 1, r"step 1: a metric may not be named 'step'"),
]


@pytest.mark.parametrize(("text", "line", "pattern"), SKIPPED_LINES)
def test_console_lines_that_do_not_parse_are_counted_and_refused(tmp_path, text, line, pattern):
    """A step line that does not parse is skipped, counted with its line, and compare refuses
    the side (no verdict from a partial read) unless skipped records are allowed."""
    from parity.judge.compare import compare_frames
    from parity.readers import SkippedRecordsError

    path = _write(tmp_path, "c.log", text)
    frame = read_metrics(path)
    assert frame.attrs["skipped"] == [
        {"reason": "metric lines that do not parse", "count": 1, "where": [f"line {line}"]}
    ]
    assert any(re.search(pattern, n) for n in frame.attrs["notes"])
    with pytest.raises(
        SkippedRecordsError, match=rf"c\.log: .*1 records skipped.*line {line}"
    ) as e:
        compare_frames(frame, frame)
    assert "\n" not in str(e.value) and "--allow-skipped" in str(e.value)
    assert compare_frames(frame, frame, allow_skipped=True).ok


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("step:1 - a:1.0 - oops\n", r"c\.log:1: no metrics records .*malformed metric 'oops'"),
        ("step:1 - step:1.0\n", r"c\.log:1: no metrics records .*may not be named 'step'"),
    ],
)
def test_console_with_no_line_that_parses(tmp_path, text, pattern):
    with pytest.raises(MetricsError, match=pattern):
        read_metrics(_write(tmp_path, "c.log", text))


@pytest.mark.parametrize("fmt", [None, *WRITABLE])
def test_empty_file(tmp_path, fmt):
    path = _write(tmp_path, "m.jsonl", "\n\n")
    with pytest.raises(MetricsError, match=r"m\.jsonl: no metrics records"):
        read_metrics(path, fmt)


def test_bom_and_crlf(tmp_path):
    for fmt, text in [
        ("verl-console", "step:1 - a:1.5\r\n"),
        ("jsonl", '{"step": 1, "a": 1.5}\r\n'),
    ]:
        path = tmp_path / "m.txt"
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        f = read_metrics(path)
        assert f.attrs["format"] == fmt and f.loc[1, "a"] == 1.5


def test_invalid_utf8(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1.0}\n\xff\n')
    with pytest.raises(MetricsError, match=r"m\.jsonl:2: not valid UTF-8"):
        read_metrics(path)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(MetricsError, match="folder has no metrics.jsonl"):
        read_metrics(tmp_path)
    with pytest.raises(MetricsError, match="cannot read"):
        read_metrics(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="unknown metrics format"):
        read_metrics(_write(tmp_path, "m.jsonl", "{}\n"), "yaml")
    assert issubclass(IncompleteRunError, MetricsError)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.binary(max_size=200)
    | st.text(st.sampled_from(list('{}[]":,. -0123456789aestpNIn\n\t\r')), max_size=200).map(
        str.encode
    ),
    fmt=st.sampled_from([None, *FORMATS]),
)
def test_fuzz_only_metrics_errors(tmp_path, data, fmt):
    path = tmp_path / "fuzz.txt"
    path.write_bytes(data)
    try:
        frame = read_metrics(path, fmt)
    except MetricsError:
        return
    assert frame.index.is_monotonic_increasing and frame.index.is_unique


def test_write_is_atomic_and_keeps_nan_presence(tmp_path):
    frame = pd.DataFrame(
        {"a": [np.nan, 1.0], "b": [2.0, np.nan]}, index=pd.Index([1, 2], name="step")
    )
    frame.attrs["present"] = pd.DataFrame(
        {"a": [True, True], "b": [True, False]}, index=frame.index
    )
    path = tmp_path / "out" / "m.jsonl"
    write_metrics(frame, path, "jsonl")
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 2, "a": 1.0}
    assert lines[0] == '{"step": 1, "a": NaN, "b": 2.0}'
    assert json.loads(lines[-1]) == {"event": "end", "steps": 2}
    assert [p.name for p in path.parent.iterdir()] == ["m.jsonl"]
    frame.attrs["complete"] = False
    write_metrics(frame, path, "jsonl")
    assert read_metrics(path).attrs["complete"] is False
    with pytest.raises(MetricsError, match="bad metric name"):
        write_metrics(frame.rename(columns={"a": "a b"}), tmp_path / "c.log", "verl-console")


def test_step_line_regex_needs_whitespace_before_step():
    assert _STEP_LINE.search("(pid=1) step:3 - a:1")[1] == "3"
    assert _STEP_LINE.search("global_step:3 - a:1") is None


def test_verl_file_logger_values_as_orjson_writes_them(tmp_path):
    """verl's FileLogger writes every value with orjson: null for NaN and +-inf, and strings or
    lists beside the numbers; its console leaves non-numbers out, and so does the reader, saying
    so (and bools count 1/0, as pformat prints them for the console)."""
    path = _write(
        tmp_path,
        "v.jsonl",
        '{"step":1,"data":{"a":0.5,"b":null,"c":"x","d":[1,2],"e":true}}\n',
    )
    f = read_metrics(path)
    assert f.attrs["format"] == "verl-jsonl" and list(f.columns) == ["a", "b", "e"]
    assert f.loc[1, "a"] == 0.5 and np.isnan(f.loc[1, "b"]) and f.loc[1, "e"] == 1.0
    assert any("null values read as NaN" in n for n in f.attrs["notes"])
    assert any("non-numeric values left out" in n for n in f.attrs["notes"])


def test_every_reader_module_declares_its_formats():
    import importlib

    from parity.readers import _MODULES, REGISTRY

    for name in _MODULES:
        module = importlib.import_module(f"parity.readers.{name}")
        assert module.FORMATS, f"parity.readers.{name} declares no FORMATS"
        for fmt in module.FORMATS:
            assert REGISTRY[fmt.name] is fmt and fmt.detected_by and fmt.precision


def test_docs_list_every_format():
    """docs/logs.md's table of formats names each reader, as it detects and its precision."""
    from parity.readers import REGISTRY

    logs = (Path(__file__).resolve().parents[2] / "docs" / "logs.md").read_text()
    for fmt in REGISTRY.values():
        assert f"| `{fmt.name}` | {fmt.detected_by} | {fmt.precision} |" in logs, fmt.name


def test_verl_file_logger_train_and_val_records_of_one_step_merge(tmp_path):
    """verl writes train and val metrics of a step as two records (seen in 0.6.1 and 0.7.0)."""
    path = _write(
        tmp_path,
        "v.jsonl",
        '{"step": 2, "data": {"train/loss": 4.5}}\n{"step": 2, "data": {"val/loss": 2.25}}\n'
        '{"step": 2, "data": {"val/loss": 2.25}}\n',
    )
    f = read_metrics(path)
    assert f.loc[2, "train/loss"] == 4.5 and f.loc[2, "val/loss"] == 2.25
    assert f.attrs["notes"] == [] and f.attrs["skipped"] == []
