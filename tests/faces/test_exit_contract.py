"""The CLI's exit codes are a contract: a damaged input is exit 2 and one line, never a traceback.

To a CI script exit 1 means "diverged" and nothing else, so an exception the CLI did not expect
must not leave as Python's exit 1. Every command that takes files is run in-process on a corpus
of damaged inputs (empty, binary, cut, deeply nested, huge, non-UTF-8, a FIFO, bad specs, damaged
ops/ and manifest.json beside good metrics); no job is ever launched.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import parity.bisect
import parity.check
import parity.cli
import parity.judge.onpolicy
import parity.pair
import parity.run.job
import parity.run.signals
from parity.cli import EXIT_INTERNAL, main
from parity.errors import InputError

CONTRACT = {0, 1, 2, 3, 4}
MAX_LINE = 300  # the most characters of a `parity: error: ...` line
LAUNCHERS = ("launch", "launch_nodes")  # what starts a process of a job
DEEP = 5000  # nesting that exceeds Python's default recursion limit (1000)

ROWS = [
    {"step": 1, "train/loss": 2.0, "train/lr": 0.125},
    {"step": 2, "train/loss": 1.5, "train/lr": 0.125},
    {"step": 3, "train/loss": 1.25, "train/lr": 0.125},
]
END = '{"event": "end", "steps": 3}\n'
GOOD_SPEC = 'task = "custom"\nworld_size = 1\ncommand = ["job.py", "--out", "{out}"]\n'


def _jsonl(rows: list[dict], end: str = END) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows) + end


def _good_run(root: Path, rows: list[dict] = ROWS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text(_jsonl(rows))
    return root


# --- the corpus: name -> how to build it under a folder; each returns the path to pass ---------


def _file(name: str, content: bytes | str) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        path = d / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return build


def _nothing_readable(d: Path) -> Path:
    folder = d / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("no metrics here\n")
    (folder / "empty").mkdir()
    return folder


def _damaged_ops(d: Path) -> Path:
    """Good metrics that diverge from ROWS, and on both sides (d/good is the other side's folder)
    an ops/ trace whose records are not objects."""
    rows = [dict(r) for r in ROWS]
    rows[2]["train/loss"] = 1.3
    run = _good_run(d / "run", rows)
    for side in (run, d / "good"):
        (side / "ops").mkdir(parents=True)
        (side / "ops" / "rank0.jsonl").write_text("[1, 2]\n" + '"x"\n' * 3)
    return run


def _deep_manifest(d: Path) -> Path:
    run = _good_run(d / "run")
    (run / "manifest.json").write_text("[" * DEEP + "]" * DEEP)
    return run


def _deep_ranks(d: Path) -> Path:
    run = _good_run(d / "run")
    (run / "ranks").mkdir()
    deep = "[" * DEEP + "]" * DEEP
    (run / "ranks" / "rank0.jsonl").write_text(f'{{"step": 1, "x": {deep}}}\n')
    return run


_HEAD = _jsonl(ROWS[:2], end="")
DAMAGED: dict[str, Callable[[Path], Path]] = {
    "empty file": _file("metrics.jsonl", b""),
    "binary garbage": _file("garbage.bin", bytes(range(256)) * 64),
    "binary named metrics.jsonl": _file("metrics.jsonl", bytes(range(256)) * 64),
    "truncated JSONL line": _file("metrics.jsonl", _HEAD + '{"step": 3, "train/lo'),
    "JSON nested deep": _file("metrics.jsonl", '{"step": 1, "train/loss": ' + "[" * DEEP),
    "JSON nested deep, closed": _file(
        "metrics.jsonl", '{"step": 1, "train/loss": ' + "[" * DEEP + "]" * DEEP + "}\n"
    ),
    "10 MB non-numeric value": _file(
        "metrics.jsonl", json.dumps({"step": 1, "train/loss": "x" * 10_000_000}) + "\n"
    ),
    "a record that is not an object": _file("metrics.jsonl", "[1, 2, 3]\n" + END),
    "CSV cut mid-number": _file("metrics.csv", "step,train/loss\n1,0.5\n2,1.5e"),
    "CSV with a binary cell": _file("metrics.csv", b"step,train/loss\n1,\x00\xff\n"),
    "a folder with nothing readable": _nothing_readable,
    "non-UTF-8 file": _file("metrics.jsonl", b'{"step": 1, "train/loss": 0.5, "\xff\xfe": 1}\n'),
    "non-UTF-8 CSV": _file("metrics.csv", b"step,train/\xffloss\n1,0.5\n"),
    "JSON with a huge step": _file("metrics.jsonl", '{"step": 1' + "0" * 5000 + ', "x": 1.0}\n'),
}
# readable, with a verdict: the exit code must be in the contract, never a traceback
VERDICT_INPUTS: dict[str, Callable[[Path], Path]] = {
    "1e999 (overflows to inf)": _file("metrics.jsonl", _HEAD + '{"step": 3, "x": 1e999}\n'),
    "damaged ops/ trace beside metrics": _damaged_ops,
    "manifest.json nested deep": _deep_manifest,
    "ranks/ nested deep": _deep_ranks,
}


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Nothing here may start a job: every launching function of the harness refuses (a launch
    would be a bug of the test or of the CLI, and it would be slow)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a damaged input reached a launch")

    for name, module in list(sys.modules.items()):
        if name == "parity" or name.startswith("parity."):
            for attr in LAUNCHERS:
                if callable(getattr(module, attr, None)):
                    monkeypatch.setattr(module, attr, refuse)


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return code, err.splitlines()


def _assert_bad_input(code: int, err: list[str]) -> None:
    assert code == 2, err[:5]
    assert len(err) == 1, err[:5]
    assert err[0].startswith("parity: error: ") and len(err[0]) <= MAX_LINE, err[0][:400]


COMMANDS = ["compare A BAD", "compare BAD A --json", "report A BAD -o OUT"]


def _commands(bad: Path, good: Path, tmp: Path) -> dict[str, list]:
    return {
        "compare A BAD": ["compare", good, bad],
        "compare BAD A --json": ["compare", bad, good, "--json"],
        "report A BAD -o OUT": ["report", good, bad, "-o", tmp / "report"],
    }


@pytest.mark.parametrize("case", list(DAMAGED))
@pytest.mark.parametrize("command", COMMANDS)
def test_damaged_metrics_are_bad_input(case, command, tmp_path, capsys):
    bad = DAMAGED[case](tmp_path)
    good = _good_run(tmp_path / "good")
    _assert_bad_input(*_run(_commands(bad, good, tmp_path)[command], capsys))


@pytest.mark.parametrize("case", list(DAMAGED))
def test_check_with_a_damaged_golden_is_bad_input(case, tmp_path, capsys):
    bad = DAMAGED[case](tmp_path)
    spec = tmp_path / "spec.toml"
    spec.write_text(GOOD_SPEC)
    argv = ["check", "--spec", spec, "--golden", bad, "--out", tmp_path / "out"]
    _assert_bad_input(*_run(argv, capsys))


@pytest.mark.parametrize("case", list(VERDICT_INPUTS))
@pytest.mark.parametrize("command", COMMANDS)
def test_damaged_extras_keep_the_contract(case, command, tmp_path, capsys):
    """Readable metrics beside damaged extras (or an overflowing value): a verdict or exit 2,
    never a traceback; exit 2 is one line."""
    bad = VERDICT_INPUTS[case](tmp_path)
    good = _good_run(tmp_path / "good")
    code, err = _run(_commands(bad, good, tmp_path)[command], capsys)
    assert code in CONTRACT, err[:5]
    if code == 2:
        _assert_bad_input(code, err)


def test_a_fifo_is_read_or_refused_without_hanging(tmp_path, capsys):
    """A FIFO given as the metrics file: a writer answers every open with a cut record, so that
    a reader that opens it twice cannot hang."""
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:  # ENXIO: no reader yet
                assert e.errno == errno.ENXIO
                time.sleep(0.01)
                continue
            try:
                os.write(fd, b'{"step": 1, "train/lo')
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        code, err = _run(["compare", _good_run(tmp_path / "good"), fifo], capsys)
    finally:
        done.set()
        thread.join(5)
    assert time.monotonic() - start < 30
    _assert_bad_input(code, err)


# --- specs -------------------------------------------------------------------------------------

BAD_SPECS = {
    "bad TOML": 'task = "custom\nworld_size = 1\n',
    "unknown keys": 'task = "custom"\nworld_size = 1\ncommand = ["job.py"]\nwordl_size = 2\n',
    "wrong types": 'task = "custom"\nworld_size = "two"\ncommand = ["job.py"]\n',
    "non-UTF-8": b'task = "custom\xff"\nworld_size = 1\n',
    "TOML nested deep": "x = " + "[" * DEEP + "]" * DEEP + "\n",
    "a folder": None,
    "missing": "missing",
}


def _bad_spec(tmp: Path, case: str) -> Path:
    content = BAD_SPECS[case]
    path = tmp / "spec.toml"
    if content is None:
        path.mkdir()
    elif content == "missing":
        pass
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def _spec_commands(spec: Path, tmp: Path, good: Path) -> dict[str, list]:
    out = tmp / "out"
    return {
        "pair": ["pair", "--spec", spec, "--out", out],
        "check --golden": ["check", "--spec", spec, "--golden", good, "--out", out],
        "check --base": ["check", "--spec", spec, "--base", "HEAD", "--out", out],
        "bisect": ["bisect", "--spec", spec, "--good", "HEAD~1", "--bad", "HEAD", "--out", out],
    }


@pytest.mark.parametrize("case", list(BAD_SPECS))
@pytest.mark.parametrize("command", ["pair", "check --golden", "check --base", "bisect"])
def test_bad_specs_are_bad_input(case, command, tmp_path, capsys):
    spec = _bad_spec(tmp_path, case)
    good = _good_run(tmp_path / "good")
    _assert_bad_input(*_run(_spec_commands(spec, tmp_path, good)[command], capsys))


# --- user paths that are not what they should be ------------------------------------------------


def test_report_into_a_regular_file_names_it(tmp_path, capsys):
    good = _good_run(tmp_path / "good")
    target = tmp_path / "report.txt"
    target.write_text("not a folder\n")
    code, err = _run(["report", good, good, "-o", target], capsys)
    _assert_bad_input(code, err)
    assert str(target) in err[0]


def test_pair_out_below_a_regular_file_names_it(tmp_path, capsys):
    target = tmp_path / "out.txt"
    target.write_text("not a folder\n")
    spec = tmp_path / "spec.toml"
    spec.write_text(GOOD_SPEC)
    code, err = _run(["pair", "--spec", spec, "--out", target], capsys)
    _assert_bad_input(code, err)
    assert str(target) in err[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_bad_input(tmp_path, capsys):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text(_jsonl(ROWS))
    bad.chmod(0)
    try:
        code, err = _run(["compare", _good_run(tmp_path / "good"), bad], capsys)
    finally:
        bad.chmod(stat.S_IRUSR | stat.S_IWUSR)
    _assert_bad_input(code, err)


# --- onpolicy on a damaged run folder ----------------------------------------------------------


def _chain_folder(d: Path, content: bytes | None) -> Path:
    from parity.judge.onpolicy import CHAIN_DIR

    run = d / "run"
    chain = run / CHAIN_DIR
    chain.mkdir(parents=True)
    if content is not None:
        (chain / "step1-rank0.safetensors").write_bytes(content)
    return run


ONPOLICY = {
    "no chain files": None,
    "empty chain file": b"",
    "binary garbage": bytes(range(256)) * 16,
    "a header that lies": (10**12).to_bytes(8, "little") + b"{}",
    "a header nested deep": (2 * DEEP).to_bytes(8, "little") + b"[" * DEEP + b"]" * DEEP,
}


@pytest.mark.parametrize("case", ONPOLICY)
def test_onpolicy_on_a_damaged_run_folder_is_bad_input(case, tmp_path, capsys):
    run = _chain_folder(tmp_path, ONPOLICY[case])
    _assert_bad_input(*_run(["onpolicy", run], capsys))


# --- the catch-all: whatever else escapes is ours, exit 70, never 1 ------------------------------


@pytest.mark.parametrize(
    "error", [KeyError("metric"), RecursionError("maximum recursion depth"), AttributeError("x")]
)
def test_an_unexpected_exception_is_an_internal_error_never_1(error, tmp_path, capsys, monkeypatch):
    def broken(args):
        raise error

    monkeypatch.setattr(parity.cli.compare, "run", broken)
    good = _good_run(tmp_path / "good")
    assert main(["compare", str(good), str(good)]) == EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first == f"parity: internal error, please report: {type(error).__name__}: {error}"
    assert "Traceback (most recent call last)" in err  # for the report


@pytest.mark.parametrize(
    "error, line",
    [
        (
            NotADirectoryError(errno.ENOTDIR, "Not a directory", "out.txt/a"),
            "out.txt/a: Not a directory",
        ),
        (
            FileExistsError(errno.EEXIST, "File exists", "a.tmp", None, "out"),
            "a.tmp -> out: File exists",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), "/x: Permission denied"),
        (IsADirectoryError("report.md is a folder"), "report.md is a folder"),
        (
            OSError(errno.ENOSPC, "No space left on device", "out/report.md"),
            "out/report.md: No space",
        ),
    ],
)
def test_an_os_error_about_a_path_is_bad_input_naming_it(
    error, line, tmp_path, capsys, monkeypatch
):
    def raises(args):
        raise error

    monkeypatch.setattr(parity.cli.compare, "run", raises)
    good = _good_run(tmp_path / "good")
    code, err = _run(["compare", good, good], capsys)
    _assert_bad_input(code, err)
    assert err[0].startswith(f"parity: error: {line}")


def test_an_os_error_about_no_path_is_internal(tmp_path, capsys, monkeypatch):
    def raises(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(parity.cli.compare, "run", raises)
    good = _good_run(tmp_path / "good")
    assert main(["compare", str(good), str(good)]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("parity: internal error, please report: OSError: [Errno 5] Input/output")


def test_a_long_error_is_clipped_to_one_line(tmp_path, capsys, monkeypatch):
    def long_error(args):
        raise InputError("first line\n" + "y" * 5000)

    monkeypatch.setattr(parity.cli.compare, "run", long_error)
    good = _good_run(tmp_path / "good")
    code, err = _run(["compare", good, good], capsys)
    _assert_bad_input(code, err)
    assert err[0].startswith("parity: error: first line y") and "..." in err[0]


def test_a_closed_pipe_is_still_141(tmp_path, capsys, monkeypatch):
    """BrokenPipeError is an OSError: it must reach main's closed-pipe handling, not exit 2."""

    def closed(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(parity.cli.compare, "run", closed)
    monkeypatch.setattr(parity.run.signals, "quiet_closed_pipe", lambda: 141)  # pytest's stdout
    good = _good_run(tmp_path / "good")
    assert main(["compare", str(good), str(good)]) == 141
