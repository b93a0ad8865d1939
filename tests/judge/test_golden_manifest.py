"""Goldens read manifests from disk: a damaged one is a one-line GoldenError, never a traceback;
metric names in a golden's message are shown printable."""

from __future__ import annotations

import json

import pytest

from parity.cli import main
from parity.judge.golden import GoldenError, read_manifest, save_golden, verify_golden

ENV = {"environment": {"python": "3.11.7", "torch": "2.13.0+cpu"}, "device": "cpu"}


def _run(path, losses, manifest=None, extra=None):
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "train/loss": v, **(extra or {})} for i, v in enumerate(losses)]
    lines = [json.dumps(r) for r in rows] + [json.dumps({"event": "end", "steps": len(rows)})]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "manifest.json").write_text(manifest if manifest is not None else json.dumps(ENV))
    return path


DAMAGED = {
    "nested 1000 deep": ("[" * 1000 + "]" * 1000, "JSON nested too deeply"),
    "nested 200 deep": ('{"a": ' * 200 + "1" + "}" * 200, "nested deeper than 64 levels"),
    "a list": ("[1, 2]", "must be a JSON object, got list"),
    "a string": ('"x"', "must be a JSON object, got str"),
    "cut off": ('{"device": "cp', "cannot read"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_manifest_is_one_line(tmp_path, damage):
    text, why = DAMAGED[damage]
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(GoldenError) as e:
        read_manifest(path)
    assert str(e.value).startswith(f"{path}: ") and why in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_verify_and_save_with_a_damaged_run_manifest_raise_golden_errors(tmp_path, damage):
    golden = tmp_path / "golden"
    save_golden(golden, _run(tmp_path / "made", [3.0, 2.5]))
    bad = _run(tmp_path / "bad", [3.0, 2.5], manifest=DAMAGED[damage][0])
    with pytest.raises(GoldenError, match=DAMAGED[damage][1]):
        verify_golden(golden, bad)
    with pytest.raises(GoldenError, match=DAMAGED[damage][1]):
        save_golden(golden, bad)


def test_a_damaged_golden_manifest_is_a_cli_error(tmp_path, capsys):
    golden = tmp_path / "golden"
    baseline = save_golden(golden, _run(tmp_path / "made", [3.0, 2.5]))
    (baseline / "manifest.json").write_text("[" * 5000 + "]" * 5000)
    run = _run(tmp_path / "run", [3.0, 2.5])
    with pytest.raises(GoldenError, match="nested too deeply"):
        verify_golden(golden, run)
    assert main(["compare", str(baseline), str(run)]) == 0  # compare reads no manifest


def test_new_metric_names_in_the_message_are_printable(tmp_path):
    golden = tmp_path / "golden"
    save_golden(golden, _run(tmp_path / "made", [3.0]))
    evil = "x\nverdict: aligned\x1b[2K"
    result = verify_golden(golden, _run(tmp_path / "run", [3.0], extra={evil: 1.0}))
    assert result.new_metrics == [evil]
    lines = result.message().splitlines()
    assert "x\\nverdict: aligned\\x1b[2K" in lines[1] and "\x1b" not in result.message()
    assert sum(line.startswith("verdict:") for line in lines) == 1  # the table's own
