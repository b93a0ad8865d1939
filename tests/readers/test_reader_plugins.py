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
    MetricsError,
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
    "rogue_plugin": (
        "import threading\n"
        "import pandas as pd\n"
        "from parity.readers import Format\n"
        "from parity.readers.frame import finish\n"
        "RELEASE = threading.Event()\n"
        "def frame(kind):\n"
        "    index = pd.Index([1, 2], dtype='int64', name='step')\n"
        "    good = pd.DataFrame({'loss': [0.5, 0.25]}, index=index)\n"
        "    if kind == 'none':\n"
        "        return pd.DataFrame({'loss': [None, None]}, index=index)\n"
        "    if kind == 'absent':\n"
        "        v = pd.DataFrame({'loss': [float('nan')] * 2}, index=index)\n"
        "        return finish(v, v.notna(), source='x', fmt='rogue')\n"
        "    if kind == 'float-index':\n"
        "        v = good.set_axis(pd.Index([1.0, 2.0], name='step'))\n"
        "        return finish(v, v.notna(), source='x', fmt='rogue')\n"
        "    if kind == 'unsorted':\n"
        "        v = good.set_axis(pd.Index([2, 1], name='step'))\n"
        "        return finish(v, v.notna(), source='x', fmt='rogue')\n"
        "    if kind == 'bare':\n"
        "        return good\n"
        "    if kind == 'list':\n"
        "        return [0.5, 0.25]\n"
        "    return finish(good, good.notna(), source='x', fmt='rogue')\n"
        "def make(kind, claims=lambda p, h: True):\n"
        "    return [Format('rogue', lambda p, o: frame(kind), claims, 'all', 'float64')]\n"
        "def boom(*args):\n"
        "    raise RuntimeError('kaboom\\nsecond line')\n"
        "def slow(path, head):\n"
        "    RELEASE.wait(60)\n"
        "    return True\n"
        "GREEDY = make('none')\n"
        "GOOD = make('good')\n"
        "for kind in ('none', 'absent', 'float-index', 'unsorted', 'bare', 'list'):\n"
        "    globals()['BAD_' + kind.upper().replace('-', '_')] = make(kind)\n"
        "RAISES_IN_CLAIMS = [Format('rogue', lambda p, o: frame('good'), boom, 'all', 'float64')]\n"
        "RAISES_IN_READ = [Format('rogue', boom, lambda p, h: True, 'all', 'float64')]\n"
        "SLOW = [Format('rogue', lambda p, o: frame('good'), slow, 'all', 'float64')]\n"
    ),
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


def test_a_plugin_is_asked_after_every_built_in_format(plugins, tmp_path):
    plugins(mylog="mylog_plugin:FORMATS")
    names = list(REGISTRY)
    assert names == [*readers._BUILTIN_SPECIFIC, *readers._BUILTIN_GENERIC, "mylog"]
    assert list(FORMATS) == names and "mylog" in FORMATS
    # a folder no built-in claims is mylog's, and so is the file by name
    folder = tmp_path / "run"
    folder.mkdir()
    path = _mylog(folder / "train.mylog", [2.0, 1.5])
    assert detect(folder).name == "mylog" and detect(folder) is REGISTRY["mylog"]
    frame = read_metrics(folder)
    assert frame.attrs["format"] == "mylog" and list(frame["loss"]) == [2.0, 1.5]
    assert read_metrics(path, "mylog").equals(frame)
    # JSON lines are the built-in jsonl's, which refuses these (no step) and names the plugin
    assert detect(path).name == "jsonl"
    with pytest.raises(MetricsError, match=r"claims it too, .* give --format mylog to read it"):
        read_metrics(path)


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
    with pytest.raises(MetricsError, match=r"no.*step") as refused:
        read_metrics(path)  # the built-in jsonl's own error: the plugin is not needed for it
    assert "claims it too" not in str(refused.value)
    folder = tmp_path / "mine"
    folder.mkdir()
    _mylog(folder / "train.mylog", [1.0])
    for read in (lambda: read_metrics(folder), lambda: read_metrics(path, "mylog")):
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


# --- a plugin cannot take a built-in format's file, nor pass for the harness ---------------------

ROGUE = "reader plugin rogue = rogue_plugin:{} (llm_parity.readers), format 'rogue'"


def _jsonl_file(path: Path, losses: list[float]) -> Path:
    lines = [json.dumps({"step": i, "loss": x}) for i, x in enumerate(losses, 1)]
    path.write_text("\n".join([*lines, json.dumps({"event": "end", "steps": len(losses)})]) + "\n")
    return path


def test_a_plugin_that_claims_every_file_does_not_take_the_built_in_ones(plugins, tmp_path):
    """A plugin claiming everything and reading None everywhere judged two diverging jsonl
    files 'aligned': they are the built-in jsonl's, and its frame is refused when named."""
    plugins(rogue="rogue_plugin:GREEDY")
    a, b = (
        _jsonl_file(tmp_path / "a.jsonl", [2.0, 1.5]),
        _jsonl_file(tmp_path / "b.jsonl", [2.0, 1.75]),
    )
    assert detect(a).name == "jsonl"
    assert main(["compare", str(a), str(b)]) == 1
    assert main(["compare", str(a), str(b), "--format", "rogue"]) == 2


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("NONE", "metric 'loss' is object, not float64"),
        ("ABSENT", "metric 'loss' has no value at any step"),
        ("FLOAT_INDEX", "its index must be 'step' of int64, not 'step' of float64"),
        ("UNSORTED", "its steps must be unique and ascending"),
        ("BARE", "attrs['present'] must be a boolean frame of its shape (build it with finish)"),
        ("LIST", "it gave list, not a pandas DataFrame"),
    ],
)
def test_a_plugin_frame_that_breaks_the_contract_is_the_plugins_bad_input(
    plugins, tmp_path, capsys, kind, why
):
    plugins(rogue=f"rogue_plugin:BAD_{kind}")
    path = tmp_path / "a.txt"
    path.write_text("anything\n")
    expected = (
        f"{ROGUE.format('BAD_' + kind)}: read of {path} gave a frame against the reader "
        f"contract: {why}"
    )
    with pytest.raises(ReaderPluginError) as info:
        read_metrics(path)
    assert str(info.value) == expected
    assert main(["compare", str(path), str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, however long the path
    assert line.startswith(f"parity: error: {ROGUE.format('BAD_' + kind)}: read of ")
    # its end: after the last quoted value, which a line over MAX_ERROR_LINE loses first (a long
    # temporary path: pytest-xdist's adds a folder)
    assert line.endswith(why.rsplit("'", 1)[-1])


def test_a_plugin_frame_that_keeps_the_contract_is_read(plugins, tmp_path):
    plugins(rogue="rogue_plugin:GOOD")
    path = tmp_path / "a.txt"
    path.write_text("anything\n")
    assert list(read_metrics(path)["loss"]) == [0.5, 0.25]


@pytest.mark.parametrize("where", ["CLAIMS", "READ"])
def test_a_plugin_that_raises_is_named_with_the_file_exit_2(plugins, tmp_path, capsys, where):
    plugins(rogue=f"rogue_plugin:RAISES_IN_{where}")
    path = tmp_path / "a.txt"
    path.write_text("anything\n")
    done = "claims({})" if where == "CLAIMS" else "read of {}"
    expected = (
        f"{ROGUE.format('RAISES_IN_' + where)}: {done.format(path)} failed: RuntimeError: kaboom"
    )
    with pytest.raises(ReaderPluginError) as info:
        read_metrics(path)
    assert str(info.value) == expected
    assert main(["compare", str(path), str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"parity: error: {expected}"]


def test_a_plugin_claims_that_does_not_answer_is_abandoned(plugins, tmp_path, monkeypatch):
    import rogue_plugin

    monkeypatch.setattr(readers, "CLAIMS_LIMIT_S", 0.2)
    plugins(rogue="rogue_plugin:SLOW")
    path = tmp_path / "a.txt"
    path.write_text("anything\n")
    try:
        with pytest.raises(
            ReaderPluginError, match=r"claims\(.*a\.txt\) did not answer within 0\.2 s"
        ):
            read_metrics(path)
    finally:
        rogue_plugin.RELEASE.set()  # the abandoned thread ends
