"""Noise floor: side A run twice first, so a nondeterministic environment is not blamed on B.

The nondeterministic side is the `sampler-seed-from-time` mutant (a shuffle seeded from the clock)
on a 1-rank, 2-step charcount job; the deterministic one a 1-rank custom script (cheap launches).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from parity.judge.noise import floor_from_frames
from parity.spec import JobSpec, PairSpec
from tests.judge.frames import frame

JOB = """\
import json
import sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for i in range(1, 4):
        f.write(json.dumps({"step": i, "train/loss": 1.0 / i, "perf/time": 0.1 * i}) + "\\n")
    f.write(json.dumps({"event": "end", "steps": 3}) + "\\n")
"""


def test_floor_per_metric_from_two_runs_of_one_side():
    a = frame({"loss": [2.0, 1.0, 0.5], "lr": [0.1, 0.1, 0.1], "perf/time": [1.0, 2.0, 3.0]})
    again = frame({"loss": [2.0, math.nextafter(1.0, 2.0), 0.5], "lr": [0.1] * 3,
                   "perf/time": [1.5, 2.5, 3.5]})  # fmt: skip
    floor = floor_from_frames(a, again)
    assert not floor.deterministic and floor.noisy() == ["loss"]
    assert set(floor.metrics()) == {"loss", "lr"}  # timing is ignored, as in the pair
    loss = floor.metrics()["loss"]
    assert loss["max_ulp"] == 1 and loss["first_step"] == 2 and loss["max_abs_diff"] > 0
    assert floor.metrics()["lr"]["max_ulp"] == 0
    assert "not deterministic" in floor.table() and "ulp:K" in floor.table()
    json.dumps(floor.to_dict(), allow_nan=False)
    # the floor is exact even where the pair's policy tolerates the difference
    assert not floor_from_frames(a, again, {"loss": "ulp:4"}).deterministic
    assert floor_from_frames(a, again, {"lo*": "ignore"}).deterministic  # ignored by the pair
    same = floor_from_frames(a, a)
    assert same.deterministic and same.headline().startswith("noise floor: zero")
    assert same.to_dict()["floor_is_zero"] and same.metrics()["loss"]["max_ulp"] == 0


@pytest.mark.parity
def test_nondeterministic_side_is_not_blamed_on_b(tmp_path, parity_mutant_score):
    out = tmp_path / "pair"
    cmd = [sys.executable, "-m", "parity.cli", "pair", "--task", "charcount-sft",
           "--a", "legacy", "--b", "worker",
           "--world", "1", "--steps", "2",
           "--inject-a", "sampler-seed-from-time", "--noise-floor", "--out", str(out),
           "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    parity_mutant_score("sampler-seed-from-time", proc.returncode == 4)
    assert proc.returncode == 4, proc.stderr
    result = json.loads(proc.stdout)
    assert result["verdict"] == "nondeterministic" and result["b_judged"] is False
    floor = result["noise_floor"]
    assert not floor["deterministic"] and floor["a_repeat"] == str(out / "a-repeat")
    assert floor["metrics"]["train/loss"]["first_step"] == 1
    assert floor["metrics"]["train/loss"]["max_ulp"] > 0
    assert floor["metrics"]["train/lr"]["max_ulp"] == 0  # the schedule does not see the data
    assert not (out / "b").exists()  # B was never run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "nondeterministic" and not summary["noise_floor"]["deterministic"]


@pytest.mark.parity
def test_deterministic_side_has_a_zero_floor_and_the_pair_is_judged(parity_runner, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    command = [str(script), "--out", "{out}"]
    base = JobSpec(task="custom", command=command, timeout_s=120)
    spec = PairSpec(base, {}, {"command": [*command, "--side", "b"]})  # B: a run of its own
    pair = parity_runner.pair(spec, noise_floor=True)
    assert pair.floor is not None and pair.floor.deterministic
    assert pair.verdict == "aligned" and pair.ok
    assert all(f["max_ulp"] == 0 for f in pair.floor.metrics().values())
    assert "perf/time" not in pair.floor.metrics()
    a, again = pair.floor.runs
    assert a.dir != again.dir and pair.b.dir not in (a.dir, again.dir)
