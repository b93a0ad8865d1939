"""Metric formats of other packages (the llm_parity.readers entry points, parity.readers).

In one process, with the entry points replaced by a list of the test's own: a plugin's format
is asked after the specific built-in ones and before the generic ones; a broken plugin, a name
given twice, an entry point that gives no Format are each one line naming the entry point, and
only when every format is needed (never at import, nor for a read of a built-in format by name).
tests/project/test_install.py installs the same plugin (tests/readers/plugin_reader) with pip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import parity.readers as readers
from parity.cli import main
from parity.errors import InputError
from parity.readers import (
    FORMATS,
    REGISTRY,
    ReaderPluginError,
    ReadOptionError,
    detect,
    read_metrics,
)

ROOT = Path(__file__).resolve().parents[2]
GROUP = "llm_parity.readers"
BUILTIN = [*readers._BUILTIN_SPECIFIC, *readers._BUILTIN_GENERIC]
MODULES = {
    "mylog_plugin": "from parity_mylog import FORMATS\n",
    "broken_plugin": "import no_such_module_here\n",
    "clash_plugin": (
        "import dataclasses\n"
        "from parity.readers import REGISTRY\n"
        "JSONL = dataclasses.replace(REGISTRY['jsonl'])\n"
        "from parity_mylog import FORMATS\n"
    ),
    "word_plugin": "WORD = 'mylog'\n",
}


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """plugins(name=value, ...): these entry points, and no other, in llm_parity.readers."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    for name, text in MODULES.items():
        (folder / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "readers" / "plugin_reader"))
    monkeypatch.syspath_prepend(str(folder))

    def use(**given: str) -> None:
        eps = [EntryPoint(name, value, GROUP) for name, value in given.items()]
        monkeypatch.setattr(readers, "entry_points", lambda group: eps if group == GROUP else [])
        readers._registry.cache_clear()

    yield use
    readers._registry.cache_clear()


def _mylog(path: Path, losses: list[float]) -> Path:
    lines = [json.dumps({"it": i, "loss": x}) for i, x in enumerate(losses, 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _jsonl_run(folder: Path) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    return folder


def test_a_plugin_is_asked_after_the_specific_formats_and_before_the_generic(plugins, tmp_path):
    plugins(mylog="mylog_plugin:FORMATS")
    names = list(REGISTRY)
    assert names == [*readers._BUILTIN_SPECIFIC, "mylog", *readers._BUILTIN_GENERIC]
    assert list(FORMATS) == names and "mylog" in FORMATS
    # JSON lines the generic jsonl format would claim (and refuse: no step) are mylog's
    path = _mylog(tmp_path / "a.mylog", [2.0, 1.5])
    assert detect(path).name == "mylog" and detect(path) is REGISTRY["mylog"]
    frame = read_metrics(path)
    assert frame.attrs["format"] == "mylog" and list(frame["loss"]) == [2.0, 1.5]
    folder = tmp_path / "run"
    folder.mkdir()
    _mylog(folder / "train.mylog", [2.0, 1.5])
    assert read_metrics(folder, "mylog").equals(frame)


def test_the_cli_takes_a_plugin_format_by_name(plugins, tmp_path, capsys):
    plugins(mylog="mylog_plugin:FORMATS")
    a, b = _mylog(tmp_path / "a.mylog", [2.0, 1.5]), _mylog(tmp_path / "b.mylog", [2.0, 1.75])
    assert main(["compare", str(a), str(a), "--format", "mylog"]) == 0
    assert main(["compare", str(a), str(b), "--format", "mylog"]) == 1
    assert "[mylog]" in capsys.readouterr().out


def test_a_broken_plugin_fails_only_the_reads_that_need_it(plugins, tmp_path, capsys):
    plugins(mylog="mylog_plugin:FORMATS", broken="broken_plugin:FORMATS")
    run = _jsonl_run(tmp_path / "run")
    assert read_metrics(run).loc[1, "loss"] == 0.5  # our run folder: no plugin asked
    assert read_metrics(run / "metrics.jsonl", "jsonl").loc[1, "loss"] == 0.5
    assert REGISTRY["jsonl"] is readers._BUILTIN["jsonl"][0]
    assert list(FORMATS) == BUILTIN and "mylog" in FORMATS  # argparse lets it through
    expected = (
        "reader plugin broken = broken_plugin:FORMATS (llm_parity.readers) cannot be loaded: "
        "ModuleNotFoundError: No module named 'no_such_module_here'"
    )
    path = _mylog(tmp_path / "a.mylog", [1.0])
    for read in (lambda: read_metrics(path), lambda: read_metrics(path, "mylog")):
        with pytest.raises(ReaderPluginError) as info:
            read()
        assert str(info.value) == expected
    assert main(["compare", str(path), str(path), "--format", "mylog"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"parity: error: {expected}"]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            {"mine": "clash_plugin:JSONL"},
            "reader format 'jsonl' is given twice: by entry point mine = clash_plugin:JSONL "
            "(llm_parity.readers) and by the built-in parity.readers.jsonl",
        ),
        (
            {"one": "mylog_plugin:FORMATS", "two": "clash_plugin:FORMATS"},
            "reader format 'mylog' is given twice: by entry point two = clash_plugin:FORMATS "
            "(llm_parity.readers) and by entry point one = mylog_plugin:FORMATS "
            "(llm_parity.readers)",
        ),
        (
            {"word": "word_plugin:WORD"},
            "reader plugin word = word_plugin:WORD (llm_parity.readers) gives str, not a "
            "parity.readers.Format or an iterable of them",
        ),
    ],
    ids=["clash-with-a-builtin", "clash-of-two-plugins", "no-format"],
)
def test_a_plugin_that_gives_no_new_format_is_one_line(plugins, tmp_path, given, expected):
    plugins(**given)
    with pytest.raises(ReaderPluginError) as info:
        dict(REGISTRY)
    assert str(info.value) == expected
    assert isinstance(info.value, InputError)


def test_importing_the_cli_and_reading_our_run_folder_ask_no_entry_point(tmp_path):
    run = _jsonl_run(tmp_path / "run")
    code = (
        "import importlib.metadata as m\n"
        "def boom(*a, **k): raise SystemExit('entry points asked')\n"
        "m.entry_points = boom\n"
        "import parity.cli, parity.readers as r\n"
        f"print(r.read_metrics({str(run)!r}, 'jsonl').loc[1, 'loss'], r.read_metrics({str(run)!r})"
        ".loc[1, 'loss'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "0.5 0.5", out.stderr


def test_a_bad_read_option_is_an_input_error(tmp_path):
    run = _jsonl_run(tmp_path / "run")
    with pytest.raises(ReadOptionError, match=r"^unknown metrics format 'yaml'; expected one of"):
        read_metrics(run, "yaml")
    with pytest.raises(ReadOptionError, match=r"^unknown duplicates rule 'both'"):
        read_metrics(run, duplicates="both")  # type: ignore[arg-type]
    assert issubclass(ReadOptionError, InputError) and issubclass(ReaderPluginError, InputError)
