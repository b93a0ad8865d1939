"""The early stop in `check` and `bisect` (parity.run.early): a run judged against numbers
already known as it writes its steps, and stopped as soon as it diverges.

A history of a plain job (one process: no torchrun, no torch) that writes 20 steps, one every
0.15 s: its third commit nudges train/loss by one ULP from step 4 (where the spec's policy is
exact), the second and the fourth only change comments. A head stopped at its divergence gives
the verdict and the first divergence of the same head run to its end (`--run-out`); with a base
reused from the run store, the base run again to confirm a divergence stops there too; a stored
base that stopped the head with stale numbers costs runs (the base to its end, the head again),
never the verdict; bisect's probes stop alike and name the same commit. The time saved is
measured in benchmarks/run.py (`--only check`), not here: here the steps each run wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.cli import main
from tests.orchestration.history import commit, new_repo
from tests.orchestration.test_store import Launches, _make_stale, _stored_metrics

pytestmark = pytest.mark.parity

STEPS = 20

JOB = """\
import json
import math
import sys
import time
from pathlib import Path

NUDGE = {nudge}  # {label}

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for i in range(1, {steps} + 1):
        loss = 1.0 / i
        if NUDGE and i >= 4:
            loss = math.nextafter(loss, math.inf)
        f.write(json.dumps({{"step": i, "train/loss": loss, "train/lr": 0.125}}) + "\\n")
        f.flush()
        time.sleep(0.15)
    f.write(json.dumps({{"event": "end", "steps": {steps}}}) + "\\n")
"""

SPEC = """\
task = "custom"
distributed = false
command = ["job.py", "--out", "{out}"]
timeout_s = 120
"""  # one plain process: no torchrun to start (the launchers' own tests start that)

COMMITS = [("clean", False), ("a comment", False), ("nudge", True), ("b comment", True)]


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[Path, list[str]]:
    root = new_repo(tmp_path_factory.mktemp("slow-history"))
    commits = [
        commit(
            root,
            label,
            {"job.py": JOB.format(nudge=nudge, label=label, steps=STEPS), "spec.toml": SPEC},
        )  # fmt: skip
        for label, nudge in COMMITS
    ]
    return root, commits


@pytest.fixture
def launches(history, monkeypatch) -> Launches:
    monkeypatch.chdir(history[0])
    return Launches(monkeypatch)


def _steps(run: str | Path) -> int:
    lines = Path(run, "metrics.jsonl").read_text().splitlines()
    return len([ln for ln in lines if ln.startswith('{"step"')])


def _check(history, out: Path, base: int, head: int, store: Path, *more: str) -> tuple[int, dict]:
    root, commits = history
    args = ["check", "--base", commits[base], "--head", commits[head], "--spec", "spec.toml"]
    args += ["--out", str(out), "--store", str(store), "--json", "--no-trace", *more]
    code = main(args)
    summary = json.loads((out / "summary.json").read_text())
    return code, summary


def _first(summary: dict) -> tuple:
    loss = summary["metrics"]["train/loss"]
    return loss["status"], loss["first_divergent_step"], loss["a_value"], loss["b_value"]


def test_a_head_stopped_at_its_divergence_has_the_whole_run_s_verdict(history, tmp_path, launches):
    store = tmp_path / "store"
    code, early = _check(history, tmp_path / "early", 0, 2, store)
    assert code == 1 and early["verdict"] == "diverged"
    stop = early["stopped_early"]  # the first poll (every 0.5 s) that saw step 4 whole
    assert stop["side"] == "head" and 4 <= stop["step"] < STEPS
    assert _steps(tmp_path / "early" / "head") < STEPS and _steps(tmp_path / "early/base") == STEPS
    assert "as soon as it diverged" in (tmp_path / "early" / "report.md").read_text()
    # the same head run to its end: the same verdict and first divergence
    code, whole = _check(history, tmp_path / "whole", 0, 2, store, "--run-out", "--fresh")
    assert code == 1 and "stopped_early" not in whole and _steps(tmp_path / "whole/head") == STEPS
    assert _first(early) == _first(whole) == ("diverged", 4, 0.25, 0.25000000000000006)
    # a base reused from the store: the run that confirms the divergence stops at step 4 too
    launches.runs.clear()
    code, reused = _check(history, tmp_path / "reused", 0, 2, store)
    assert code == 1 and _first(reused) == _first(whole)
    assert launches.runs == ["head", "base-fresh"]
    assert reused["base"]["reused"]["stale"] is False
    assert _steps(tmp_path / "reused" / "base-fresh") < STEPS
    stopped_at = reused["stopped_early"]["step"]
    assert f"bitwise equal up to step {stopped_at}" in (tmp_path / "reused/report.md").read_text()


def test_a_stale_base_that_stopped_the_head_costs_runs_never_the_verdict(
    history, tmp_path, launches
):
    """The stored base nudged at step 4 (whole, checksums rewritten): the head, which agrees
    with the real base, is stopped there; the base run again departs from the stored one at
    step 4 and runs to its end, and the head runs again, judged against it: aligned."""
    store = tmp_path / "store"
    assert _check(history, tmp_path / "one", 0, 1, store)[0] == 0
    _make_stale(_stored_metrics(store, history[1][0]))
    launches.runs.clear()
    code, summary = _check(history, tmp_path / "two", 0, 1, store)
    assert launches.runs == ["head", "base-fresh", "head-again"]
    assert code == 0 and summary["verdict"] == "aligned", summary
    assert summary["base"]["reused"]["stale"] is True and "stopped_early" not in summary
    assert _steps(tmp_path / "two" / "base-fresh") == STEPS
    assert _steps(tmp_path / "two" / "head-again") == STEPS


def test_bisect_probes_stop_at_their_divergence_and_name_the_same_commit(
    history, tmp_path, launches
):
    root, commits = history
    args = ["bisect", "--good", commits[0], "--bad", commits[3], "--spec", "spec.toml"]
    code = main([*args, "--out", str(tmp_path / "out"), "--store", "off", "--json"])
    result = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert code == 1 and result["first_bad"]["commit"] == commits[2]
    assert result["first_bad"]["step"] == 4 and result["first_bad"]["stopped_at"] >= 4
    for tested in result["tested"]:
        stopped = tested["verdict"] == "diverged"
        assert (tested["stopped_at"] is not None) is stopped, tested
        assert (_steps(tested["run"]) < STEPS) is stopped, tested
