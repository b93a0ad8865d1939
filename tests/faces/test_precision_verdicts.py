"""Precision, nothing compared and big integers, through the CLI's exit codes: a rounded log
judged exact is "imprecise" (5), never aligned; a pair with nothing judged, or a file whose end
record claims more steps than it holds, is bad input (2); an integer past 2**53 is not rounded
into agreement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.cli import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_IMPRECISE, main
from parity.judge.compare import NothingComparedError, compare_frames
from parity.readers import read_metrics

LOSS = 2.345678901234  # a computed loss; a float32 ULP away is B's
LOSS32 = float(np.float32(LOSS))
NEXT32 = float(np.nextafter(np.float32(LOSS), np.float32(3)))


def _csv(path, rows: list[tuple[int, str]]):
    path.write_text("step,loss\n" + "".join(f"{s},{v}\n" for s, v in rows))
    return path


def test_a_rounded_csv_is_imprecise_not_aligned(tmp_path, capsys):
    """Two runs 1 float32 ULP apart logged at 4 decimals: the same text, so no exit 0 unless
    the user accepts 4 decimals; then the verdict says so."""
    a = _csv(tmp_path / "a.csv", [(1, f"{LOSS32:.4f}")])
    b = _csv(tmp_path / "b.csv", [(1, f"{NEXT32:.4f}")])
    assert main(["compare", str(a), str(b)]) == EXIT_IMPRECISE == 5
    out = capsys.readouterr().out
    assert "loss: source holds 4 decimals; judged exact needs the full value" in out
    assert "--at-source-precision" in out and out.rstrip().endswith("verdict: imprecise")
    assert main(["compare", str(a), str(b), "--at-source-precision"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("verdict: aligned at 4 decimals")
    assert main(["compare", str(a), str(b), "--policy", "loss=close:1e-3,0"]) == 0
    c = _csv(tmp_path / "c.csv", [(1, "2.3458")])  # differs even at 4 decimals: diverged
    assert main(["compare", str(a), str(c), "--at-source-precision"]) == EXIT_DIVERGED
    assert main(["compare", str(a), str(c)]) == EXIT_DIVERGED


def test_a_rounded_torchtitan_reference_is_imprecise(tmp_path, capsys):
    a = tmp_path / "a_loss.txt"
    a.write_text("1 2.3456\n2 2.1234\n")
    assert main(["compare", str(a), str(a)]) == EXIT_IMPRECISE
    assert "source holds 4 decimals" in capsys.readouterr().out


def test_the_recorders_own_short_values_are_not_rounded(tmp_path):
    """metrics.jsonl with its end record is the recorder's: every float in full, even 2.3456."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.3456, "lr": 0.001}\n{"event": "end", "steps": 1}\n'
    )
    frame = read_metrics(run)
    assert set(frame.attrs["precision"].values()) == {"float64"}
    assert compare_frames(frame, frame).verdict == "aligned"


def test_float32_values_count_float32_ulps(tmp_path, capsys):
    """A float32 loss logged as a Python float: 1 ULP apart reads 1 ULP, in the table and JSON."""
    for name, v in (("a", LOSS32), ("b", NEXT32)):
        (tmp_path / f"{name}.jsonl").write_text(
            json.dumps({"step": 1, "loss": v}) + '\n{"event": "end", "steps": 1}\n'
        )
    args = ["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--json"]
    assert main(args) == EXIT_DIVERGED
    loss = json.loads(capsys.readouterr().out)["metrics"]["loss"]
    assert (loss["max_ulp"], loss["ulp_dtype"]) == (1, "float32")
    assert main([*args[:3], "--policy", "loss=ulp:1"]) == 0


def test_nothing_compared_is_bad_input(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("step,time,perf/mfu\n1,1.5,0.3\n2,1.6,0.31\n3,1.7,0.32\n")
    b.write_text("step,time,perf/mfu\n1,2.5,0.4\n2,2.6,0.41\n3,2.7,0.42\n")
    for command in (["compare"], ["report", "-o", str(tmp_path / "rep")]):
        assert main([command[0], str(a), str(b), *command[1:]]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "nothing compared: every metric is ignored (perf/mfu, time)" in err
    with pytest.raises(NothingComparedError):
        compare_frames(read_metrics(a), read_metrics(b))


def test_an_end_record_claiming_more_steps_is_a_partial_file(tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "loss": 2.5}\n{"event": "end", "steps": 5}\n')
    assert main(["compare", str(p), str(p)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{p}:2: the end record says 5 steps but the file holds 1" in err


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_integers_past_2_53_are_not_rounded_into_agreement(fmt, tmp_path, capsys):
    sides = []
    for name, n in (("a", 9007199254740993), ("b", 9007199254740992)):
        p = tmp_path / f"{name}.{fmt}"
        text = json.dumps({"step": 1, "tokens": n, "loss": 2.5}) if fmt == "jsonl" else ""
        p.write_text(text + "\n" if fmt == "jsonl" else f"step,tokens,loss\n1,{n},2.5\n")
        sides.append(str(p))
    flags = ["--allow-incomplete"] if fmt == "jsonl" else []
    assert main(["compare", *sides, *flags]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "53 rounded" in err and "(line " in err and "'tokens'" in err  # clipped
    # allowed, the rest is judged: a's count is no value, b's (2**53) is one: never aligned
    assert main(["compare", *sides, *flags, "--allow-skipped"]) == EXIT_DIVERGED
