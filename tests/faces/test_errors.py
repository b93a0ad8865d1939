"""One base class for bad input: every error that means "what you gave is wrong" is an
InputError (so the CLI's exit 2), and whatever else escapes a command is a bug of ours (exit 70).
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pandas as pd
import pytest

import parity.cli
from parity.cli import EXIT_INTERNAL, main
from parity.errors import InputError, PolicyError, SpecError
from parity.judge.compare import Policy, compare_frames
from parity.judge.golden import GoldenError, read_manifest
from parity.judge.onpolicy import KINDS
from parity.outdir import OutDir, OutputError
from parity.readers import MetricsError, write_metrics

# (module, class): each one's errors mean bad input of the user's
INPUT_ERRORS = [
    ("parity.errors", "SpecError"),
    ("parity.errors", "PolicyError"),
    ("parity.spec", "SpecError"),
    ("parity.tasks", "TaskError"),
    ("parity.judge.compare", "PolicyError"),
    ("parity.readers.frame", "MetricsError"),
    ("parity.readers.frame", "IncompleteRunError"),
    ("parity.readers.frame", "SkippedRecordsError"),
    ("parity.readers", "ReadOptionError"),
    ("parity.readers", "ReaderPluginError"),
    ("parity.outdir", "OutputError"),
    ("parity.judge.golden", "GoldenError"),
    ("parity.judge.diagnose", "DiagnosisError"),
    ("parity.judge.opdiff", "OpTraceError"),
    ("parity.judge.onpolicy", "ChainError"),
    ("parity.check", "RevisionError"),
]


@pytest.mark.parametrize("module, name", INPUT_ERRORS, ids=[n for _, n in INPUT_ERRORS])
def test_every_bad_input_class_is_an_input_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, InputError) and issubclass(cls, ValueError)


def test_spec_error_is_still_importable_from_spec():
    from parity.spec import SpecError as FromSpec

    assert FromSpec is SpecError


# --- policies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "bogus",
        "ulp:x",
        "close:nan",
        "exact@5-1",
        "exact@1-5,ulp:2@3-",
        "exact,ulp:1",
        "exact@x",
        f"ulp:{2**64}",  # more than any two float64 are apart: was an OverflowError when judged
        "exact@" + "1" * 5000,  # was int()'s own ValueError (more than 4300 digits)
        f"exact@1-{2**63}",  # past the largest step
    ],
)
def test_a_bad_policy_text_is_a_policy_error(text):
    with pytest.raises(PolicyError, match="^bad policy") as e:
        Policy.parse(text)
    assert isinstance(e.value, ValueError)  # callers that caught ValueError still do


def test_a_bad_policy_object_is_a_policy_error():
    with pytest.raises(PolicyError, match="ulp must be"):
        Policy("ulp", ulp=-1)


def test_the_largest_ulp_policy_judges_without_overflow():
    """The largest K is one below 2**64 - 1 (that is NaN's and inf's distance from a number)."""
    a = pd.DataFrame({"x": [1.0, 2.0]}, index=pd.Index([1, 2], name="step"))
    b = pd.DataFrame({"x": [1.0, 2.5]}, index=pd.Index([1, 2], name="step"))
    assert compare_frames(a, b, {"x": f"ulp:{2**64 - 2}"}).ok


def test_a_huge_ulp_on_the_command_line_is_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n{"event": "end", "steps": 1}\n')
    assert main(["compare", str(run), str(run), "--policy", f"x=ulp:{2**64}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("parity: error: --policy: 'x': bad policy"), err


# --- other bad input -----------------------------------------------------------------------------


def test_frames_with_repeated_metric_names_are_a_metrics_error():
    a = pd.DataFrame([[1.0, 2.0]], columns=["x", "x"], index=pd.Index([1], name="step"))
    with pytest.raises(MetricsError, match="frame a: steps and metric names must be unique"):
        compare_frames(a, a)


def test_an_unknown_format_to_write_is_a_metrics_error(tmp_path):
    frame = pd.DataFrame({"x": [1.0]}, index=pd.Index([1], name="step"))
    with pytest.raises(MetricsError, match="unknown metrics format 'parquet'"):
        write_metrics(frame, tmp_path / "m.parquet", "parquet")


@pytest.mark.parametrize("name", ["", ".parity-out", "a/b", ".."])
def test_an_output_that_is_no_entry_name_is_an_output_error(tmp_path, name):
    with OutDir.open(tmp_path) as held, pytest.raises(OutputError, match="not an entry name"):
        held.make_dir(name)


def test_a_manifest_with_a_huge_integer_is_a_golden_error(tmp_path):
    """json.loads raises int()'s plain ValueError for an integer of over 4300 digits."""
    path = tmp_path / "manifest.json"
    path.write_text('{"seed": ' + "7" * 5000 + "}")
    with pytest.raises(GoldenError, match="cannot read"):
        read_manifest(path)


def _chain_file(tmp_path, meta, tensors=None):
    from safetensors.numpy import save_file

    run = tmp_path / "run"
    (run / "onpolicy").mkdir(parents=True)
    tensors = tensors or {"decode/0": np.zeros(3, dtype=np.float32)}
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file(tensors, str(run / "onpolicy" / "step00001-rank0.safetensors"), {"meta": text})
    return run


SCALAR = {f"{kind}/0": np.zeros((), np.float32) for kind in KINDS}  # one value, not one a token


@pytest.mark.parametrize(
    "meta, tensors",
    [
        ([], None),  # a JSON list: was a TypeError
        ({"world": 1}, None),  # no 'sequences': was a KeyError
        ({"sequences": "2", "world": 1}, None),
        ({"sequences": 1, "world": "x"}, None),  # was int()'s ValueError
        ({"sequences": 1, "world": 0}, None),
        ({"sequences": 1, "world": 1, "layers": 3}, None),
        ({"sequences": 1, "world": 1}, SCALAR),  # was len() of a 0-d array: a TypeError
    ],
    ids=["list", "no sequences", "text count", "text world", "world 0", "layers", "scalar"],
)
def test_a_chain_file_with_a_damaged_meta_is_bad_input(meta, tensors, tmp_path, capsys):
    run = _chain_file(tmp_path, meta, tensors)
    code = main(["onpolicy", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.startswith("parity: error: ") and "onpolicy" in err


# --- the CLI: InputError is exit 2, any other ValueError is ours ---------------------------------


def _good_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n{"event": "end", "steps": 1}\n')
    return str(run)


def test_an_internal_value_error_is_exit_70_not_bad_input(tmp_path, capsys, monkeypatch):
    def broken(args):
        raise ValueError("boom")

    monkeypatch.setattr(parity.cli.compare, "run", broken)
    run = _good_run(tmp_path)
    assert main(["compare", run, run]) == EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "parity: internal error, please report: ValueError: boom"


@pytest.mark.parametrize(
    "error", [PolicyError("bad policy 'x'"), SpecError("job.toml: bad"), InputError("bad")]
)
def test_an_input_error_is_exit_2(error, tmp_path, capsys, monkeypatch):
    def refused(args):
        raise error

    monkeypatch.setattr(parity.cli.compare, "run", refused)
    run = _good_run(tmp_path)
    assert main(["compare", run, run]) == 2
    assert capsys.readouterr().err == f"parity: error: {error}\n"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("metrics.csv", "step,loss\n" + "9" * 5000 + ",1.0\n"),
        ("train.log", "step:" + "9" * 5000 + " - train/loss:1.0\n"),
    ],
)
def test_a_step_of_thousands_of_digits_is_bad_input(tmp_path, capsys, name, text):
    """int() refuses more than 4300 digits with a bare ValueError: a reader says it in one line
    (exit 2), never as an internal error."""
    from parity.cli import main

    path = tmp_path / name
    path.write_text(text)
    assert main(["compare", str(path), str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parity: error: ") and err.count("\n") == 1, err[:300]
