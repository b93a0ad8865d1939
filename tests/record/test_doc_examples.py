"""The two complete loops of docs/own-trainer.md, taken from the page (not copied) and run as
written on 2 gloo ranks: each aligned with a repeat of itself, batch digests and fingerprints
included, with the metrics the page says it logs; the flat script with another learning rate
on one side is diverged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parity.judge.diagnose import diagnose, rank_agreement
from parity.spec import JobSpec, PairSpec

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "own-trainer.md"


def example(name: str) -> str:
    """The python block after `<!-- example: NAME -->` on the page."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)\n```", text, re.S)
    assert found, f"no example {name!r} in {PAGE}"
    return found.group(1) + "\n"


def _script(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    path = tmp_path_factory.mktemp("examples") / f"{name}.py"
    path.write_text(example(name), encoding="utf-8")
    return path


def _spec(script: Path, *args: str) -> JobSpec:
    return JobSpec(
        task="custom", command=[str(script), *args], world_size=2, steps=4, timeout_s=120
    )


def test_the_page_has_both_examples_and_they_compile() -> None:
    for name in ("flat-script", "function"):
        compile(example(name), name, "exec")
    flat = example("flat-script")
    assert "from parity.record import Recorder" in flat and "rec.finish()" in flat
    assert "\ndef " not in flat  # module-level code, as nanoGPT's


@pytest.mark.parity
def test_flat_script_is_aligned_with_itself_and_a_changed_lr_diverges(
    parity_runner, tmp_path_factory
) -> None:
    script = _spec(_script(tmp_path_factory, "flat-script"), "--out_dir={out}")  # {out} inside
    floor = parity_runner.floor(script)
    a, again = floor.runs
    assert floor.deterministic, floor.table()
    frame = a.metrics
    assert frame.attrs["complete"] and list(frame.index) == [0, 1, 2, 3, 4]  # step 0 kept
    assert {"train/loss", "train/grad_norm", "train/lr", "val/loss"} == set(frame.columns)
    assert frame["val/loss"].dropna().index.tolist() == [0, 2, 4]  # rank 0's eval steps
    d = diagnose(a.dir, again.dir, floor.comparison)
    assert d.kind == "aligned" and d.train.status == "same" and d.train.steps_compared == 5
    assert rank_agreement(a.dir).status == "agree"  # rank 1 logs only what ranks share
    changed = script.replace(command=[*script.command, "--learning_rate=0.02"])
    pair = parity_runner.pair(PairSpec(script, {}, {"command": changed.command}))
    assert pair.verdict == "diverged", pair.comparison.table()
    d = pair.diagnose()
    assert d.kind == "same batches, numbers differ", d.lines()


@pytest.mark.parity
def test_function_example_is_aligned_with_itself(parity_runner, tmp_path_factory) -> None:
    spec = _spec(_script(tmp_path_factory, "function"), "--out", "{out}")
    floor = parity_runner.floor(spec)
    a, again = floor.runs
    assert floor.deterministic, floor.table()
    assert a.metrics.attrs["complete"] and list(a.metrics.index) == [1, 2, 3, 4]
    assert {"train/loss", "train/grad_norm", "train/lr"} == set(a.metrics.columns)
    d = diagnose(a.dir, again.dir, floor.comparison)
    assert d.kind == "aligned" and d.train.steps_compared == 4 and d.fingerprints.status == "same"


def test_a_rank_that_records_batches_but_logs_no_step_says_so(tmp_path, capsys) -> None:
    """The trap of logging on rank 0 alone: rank 1's digests are written only by rec.log."""
    torch = pytest.importorskip("torch")
    from parity.record import Recorder

    quiet, silent = Recorder(tmp_path, rank=1), Recorder(tmp_path / "b", rank=1)
    quiet.batch(torch.arange(4))
    quiet.log(0, {})
    quiet.finish()
    assert capsys.readouterr().err == ""
    silent.batch(torch.arange(4))
    silent.finish()
    assert "rank 1 recorded batches but logged no step" in capsys.readouterr().err
