"""Reliability: teardown crashes vs real failures, multi-node launches, tiny val sets, soak.

The torchrun tests use tests/jobs/dummy_job.py (seconds) or the charcount job with 1-2 steps.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from parity.cli import EXIT_RUN_FAILED, main
from parity.judge.compare import compare_frames
from parity.pair import PairResult
from parity.readers import read_metrics
from parity.run.job import Run, mark_teardown, run_job
from parity.run.launch import (
    LaunchError,
    LaunchRequest,
    LaunchResult,
    RankFailure,
    launch_nodes,
    survivors,
)
from parity.spec import JobSpec
from tests.needs import subject
from tests.run.procs import ctrl_c_once_ready, procs_mentioning

DUMMY = Path(__file__).resolve().parents[1] / "jobs" / "dummy_job.py"


def _dummy(mode: str, **changes) -> JobSpec:
    command = [str(DUMMY), "--out", "{out}", "--mode", mode]
    return JobSpec(task="custom", world_size=2, command=command, **changes)


def _no_survivors(result: LaunchResult) -> None:
    for one in result.nodes.values() or [result]:
        assert survivors(one.launch_id) == [], one.describe()


# --- teardown: finished then crashed, vs crashed before finishing ------------------------------


@pytest.mark.parity
def test_teardown_crash_is_failed_but_metrics_are_compared(tmp_path: Path, capsys) -> None:
    ok, bad = _dummy("ok"), _dummy("abort-at-exit")
    spec = tmp_path / "pair.toml"
    spec.write_text(
        f'task = "custom"\nworld_size = 2\ncommand = {ok.command!r}\n'
        f"[b]\ncommand = {bad.command!r}\n".replace("'", '"')
    )
    code = main(["pair", "--spec", str(spec), "--out", str(tmp_path / "pair"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == EXIT_RUN_FAILED
    assert (out["verdict"], out["metrics_verdict"]) == ("failed", "aligned")
    [teardown] = out["teardown"]
    assert (teardown["side"], teardown["reason"]) == ("b", "teardown-crash")
    assert teardown["failures"][0] == {"rank": 1, "exitcode": -6, "signal": "SIGABRT"}
    summary = json.loads((tmp_path / "pair" / "summary.json").read_text())
    assert (summary["verdict"], summary["metrics_verdict"]) == ("failed", "aligned")
    md = (tmp_path / "pair" / "summary.md").read_text()
    assert "side B: teardown-crash (rank 1: killed by SIGABRT)" in md
    report = (tmp_path / "pair" / "report.md").read_text()
    assert "verdict failed: teardown failure after complete metrics" in report

    # the same runs with the teardown failure allowed: the metrics' verdict, still named
    dirs = {side: tmp_path / "pair" / side for side in "ab"}
    crash = LaunchResult(1, False, 1.0, dirs["b"], failures=[RankFailure(1, -6, "SIGABRT", "")])
    crash.output_complete = True
    a = Run(ok, dirs["a"], LaunchResult(0, False, 1.0, dirs["a"]), read_metrics(dirs["a"]))
    b = Run(bad, dirs["b"], crash, read_metrics(dirs["b"]))
    allowed = PairResult(a, b, compare_frames(a.metrics, b.metrics), tmp_path, True)
    assert (allowed.verdict, allowed.ok) == ("aligned", True)
    assert [side for side, _ in allowed.teardown] == ["b"]
    assert "side B: teardown-crash" in allowed.teardown_line()
    assert PairResult(a, b, allowed.comparison, tmp_path).verdict == "failed"

    with pytest.raises(LaunchError) as info:  # a single job: raised, with the reason up front
        run_job(bad, tmp_path / "single")
    assert info.value.result.reason == "teardown-crash"
    assert str(info.value).startswith("teardown failure: training finished")
    assert "rank 1: killed by SIGABRT" in str(info.value)


@pytest.mark.parity
def test_abort_before_the_end_record_is_a_crash(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        run_job(_dummy("abort-early"), tmp_path)
    result = info.value.result
    assert (result.reason, result.output_complete) == ("crash", False)
    assert "teardown" not in str(info.value)
    first = result.failures[0]
    assert (first.rank, first.signal) == (1, "SIGABRT")
    assert read_metrics(tmp_path).attrs["complete"] is False  # 2 steps, no end record
    _no_survivors(result)


@pytest.mark.parity
def test_hang_at_exit_is_a_teardown_hang_killed_after_the_exit_grace(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:  # not the 300 s timeout: 1 s after the end record
        run_job(_dummy("hang-at-exit", timeout_s=300), tmp_path, exit_grace_s=1)
    assert time.monotonic() - start < 60
    result = info.value.result
    assert (result.reason, result.timed_out) == ("teardown-hang", True)
    assert "then the job hung at exit" in str(info.value)
    assert "had not exited 1 s later: killed as hung at exit" in str(info.value)
    _no_survivors(result)


def test_end_record_written_reads_only_a_fresh_last_line(tmp_path: Path) -> None:
    from parity.run.job import end_record_written

    path = tmp_path / "metrics.jsonl"
    assert not end_record_written(path, 0)
    path.write_text('{"step": 1, "a": 1.0}\n')
    assert not end_record_written(path, 0)
    path.write_text('{"step": 1, "a": 1.0}\n' * 100 + '{"event": "end", "steps": 1}\n')
    assert end_record_written(path, 0)
    assert not end_record_written(path, time.time() + 60)  # a stale file from an earlier run


def test_mark_teardown_needs_a_fresh_complete_file(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n{"event": "end", "steps": 1}\n')

    def failed() -> LaunchResult:
        return LaunchResult(1, False, 1.0, tmp_path, failures=[RankFailure(1, -6, "SIGABRT", "")])

    stale = failed()
    assert mark_teardown(stale, metrics, since=time.time() + 60) is None  # older than the launch
    assert stale.reason == "crash"
    fresh = failed()
    assert mark_teardown(fresh, metrics, since=time.time()) is not None
    assert fresh.reason == "teardown-crash" and fresh.to_dict()["failures"][0]["rank"] == 1
    metrics.write_text('{"step": 1, "loss": 1.0}\n')  # no end record: training did not finish
    incomplete = failed()
    assert mark_teardown(incomplete, metrics, since=time.time()) is None
    assert incomplete.reason == "crash"
    metrics.unlink()
    assert mark_teardown(failed(), metrics, since=0) is None
    ok = LaunchResult(0, False, 1.0, tmp_path)
    assert mark_teardown(ok, metrics, since=0) is None and ok.reason == "ok"


# --- multi-node on one machine -----------------------------------------------------------------


@pytest.mark.parity
def test_two_nodes_give_the_same_bits_as_one(parity_runner, tmp_path: Path) -> None:
    one = parity_runner.job(JobSpec(task="charcount-sft", world_size=2, steps=2))
    two = run_job(JobSpec(task="charcount-sft", world_size=2, steps=2, nnodes=2), tmp_path / "two")
    assert sorted(two.launch.nodes) == [0, 1]
    assert two.manifest["world_size"] == 2
    comparison = compare_frames(one.metrics, two.metrics)
    assert comparison.ok, comparison.table()
    assert comparison.metrics["train/loss"].exact_matches == 2
    _no_survivors(two.launch)


@pytest.mark.parity
def test_a_node_that_never_joins_is_named(tmp_path: Path) -> None:
    start = time.monotonic()
    result = launch_nodes(
        LaunchRequest([str(DUMMY), "--out", str(tmp_path / "out")], 1, tmp_path, timeout_s=60),
        nnodes=2, node_ranks=[0], join_timeout_s=2,
    )  # fmt: skip
    assert time.monotonic() - start < 40
    assert not result.ok and not result.timed_out
    assert "node rank(s) 0 waited, node rank(s) 1 never joined (1 of 2)" in result.note
    assert "c10d at 127.0.0.1:" in result.note
    assert result.describe().splitlines()[0] == result.note
    _no_survivors(result)
    with pytest.raises(ValueError, match="node_ranks"):
        launch_nodes(LaunchRequest(["x"], 1, tmp_path), nnodes=2, node_ranks=[2])


@pytest.mark.parity
def test_a_rank_failing_on_one_node_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    args = [str(DUMMY), "--out", str(tmp_path / "out"), "--mode", "exit3"]
    result = launch_nodes(
        LaunchRequest(args, 1, tmp_path, timeout_s=90),
        nnodes=2, join_timeout_s=30, peer_grace_s=10,
    )  # fmt: skip
    assert not result.ok and not result.timed_out and result.reason == "crash"
    assert (result.failures[0].rank, result.failures[0].exitcode) == (1, 3), result.describe()
    assert "2-node torchrun job failed" in result.describe()
    assert "first failure: rank 1: exit code 3" in result.describe()
    _no_survivors(result)


@pytest.mark.parity
def test_ctrl_c_during_a_multi_node_launch_leaves_nothing(tmp_path: Path, interruptible) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from parity.run.launch import LaunchRequest, launch_nodes; "
        "launch_nodes(LaunchRequest([sys.argv[1], sys.argv[2], '--mode', 'hang'], nproc=1, "
        "run_dir=Path(sys.argv[2]), timeout_s=120), nnodes=2)"
    )
    ctrl_c_once_ready(
        code, [str(DUMMY), str(tmp_path)],
        lambda: sum("up" in p.read_text()
                    for p in tmp_path.glob("node*/logs/*/attempt_0/*/stdout.log")) >= 2,
        interruptible, ready_s=90, exit_s=30,
    )  # fmt: skip
    assert procs_mentioning(str(tmp_path)) == []


_SLOW_NODE_0_CLEANUP = """
import sys, time
from pathlib import Path
import parity.run.launch as launch_module

def fake_launch(request):
    run_dir, on_tick = request.run_dir, request.on_tick
    run_dir.mkdir(parents=True)
    (run_dir / "up").write_text("")
    try:
        while True:
            time.sleep(0.05)
            on_tick()
    finally:  # node 0 takes longer to kill its processes than node 1
        time.sleep(1.5 if run_dir.name == "node0" else 0)
        (run_dir / "cleaned").write_text("")

launch_module.launch = fake_launch
launch_module.launch_nodes(launch_module.LaunchRequest(["x"], 1, Path(sys.argv[1])), nnodes=2)
"""


def test_ctrl_c_waits_for_every_node_to_clean_up(tmp_path: Path, interruptible) -> None:
    """CPython 3.11's Thread.join(timeout), interrupted by Ctrl-C, marks a running thread as
    stopped; launch_nodes must still wait for the slow node's cleanup before it exits."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _SLOW_NODE_0_CLEANUP, str(tmp_path)], preexec_fn=interruptible
    )
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"node{n}" / "up").exists() for n in (0, 1)):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # launch_nodes is in its wait loop now
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=30) != 0
    finally:
        parent.kill()
    assert (tmp_path / "node1" / "cleaned").exists()
    assert (tmp_path / "node0" / "cleaned").exists(), "exited before node 0 had cleaned up"


# --- a val set smaller than one batch: a correct value or a one-line error, never NaN ----------


@pytest.mark.parity
def test_val_set_smaller_than_a_batch_gives_the_true_value(parity_runner, oracle_val_loss) -> None:
    # 3 val samples, global batch 16, 2 ranks: shares of 2 and 1, one partial micro-batch each
    base = JobSpec(
        task="charcount-sft",
        world_size=2,
        steps=1,
        overrides={"val_samples": 3, "val_before_train": True},
    )
    runs = [parity_runner.job(replace(base, trainer=t)) for t in ("legacy", "worker")]
    values = [run.metrics["val/loss"][0] for run in runs]
    assert values[0] == values[1]  # the legacy (fixed formula) and worker trainers, bitwise
    assert math.isfinite(values[0])
    assert abs(values[0] - oracle_val_loss(samples=3)) <= 1e-6 * values[0]


@pytest.mark.parity
def test_val_set_smaller_than_the_world_is_a_one_line_error(tmp_path: Path) -> None:
    spec = JobSpec(task="charcount-sft", world_size=2, steps=1, overrides={"val_samples": 1})
    with pytest.raises(LaunchError) as info:
        run_job(spec, tmp_path)
    first = info.value.result.failures[0]
    last = first.log_tail.strip().splitlines()[-1]
    assert first.exitcode == 1 and last.startswith("error: "), first.log_tail
    assert "val.jsonl: 1 val samples for 2 ranks (--val-samples 1)" in last


@subject
def test_negative_val_samples_is_refused(tmp_path: Path) -> None:
    from worker.trainers.sft_common import parse_config

    with pytest.raises(SystemExit, match="--val-samples must be >= 0"):
        parse_config(["--out", str(tmp_path), "--val-samples", "-1"])


@subject
def test_legacy_val_formula_refuses_a_val_set_smaller_than_a_batch(tmp_path: Path) -> None:
    """The old formula drops the last partial batch (drop_last): with none left it was NaN."""
    from worker.trainers.legacy_sft import LegacySFTTrainer
    from worker.trainers.sft_common import SFTJob, parse_config

    argv = ["--out", str(tmp_path), "--trainer", "legacy", "--val-loss", "legacy"]
    job = SFTJob.build(parse_config([*argv, "--val-samples", "8", "--steps", "1"]))
    try:
        with pytest.raises(SystemExit, match="val set of 8 samples is smaller than one batch"):
            LegacySFTTrainer(job).validate()
    finally:
        job.log.close()


# --- soak: the short version of benchmarks/soak.py ---------------------------------------------


@pytest.mark.parity
def test_soak_short(tmp_path: Path) -> None:
    """Two pairs (one must align, one must diverge) through the on-demand soak script, both
    into one reused folder, each with a rival command on it that must be refused; a file of the
    user's in the folder and one outside it, linked from it, untouched."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    cmd = [sys.executable, str(script), "--pairs", "2", "--steps", "2", "--json"]
    cmd += ["--reuse", "--contend"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert [r["expected"] for r in summary["records"]] == ["aligned", "diverged"]
    assert [r["verdict"] for r in summary["records"]] == ["aligned", "diverged"]
    assert summary["false_verdicts"] == summary["failed"] == summary["leftovers"] == 0
    assert [r["contended"] for r in summary["records"]] == ["refused", "refused"]
    assert summary["not_refused"] == 0 and summary["outside_touched"] is False


# --- bad input: the gaps left by test_readers / test_spec / test_golden / test_compare ----------


def _frame(values: dict[str, list[float]]):
    import pandas as pd

    n = len(next(iter(values.values())))
    return pd.DataFrame(values, index=pd.Index(range(1, n + 1), name="step"))


@pytest.mark.parametrize(
    ("policy", "verdict"),
    [
        ("exact", "diverged"),
        ("ulp:3", "diverged"),
        ("close:1e-6,0", "diverged"),
        ("close:1,1e300", "diverged"),  # no tolerance bridges inf and -inf
        ("ignore", "aligned"),
    ],
)
def test_non_finite_values_are_judged_by_policy(policy: str, verdict: str) -> None:
    inf, nan = math.inf, math.nan
    # z, judged exact and equal, keeps the ignore case from comparing nothing (never aligned)
    a = _frame({"x": [inf, nan, 1.0, -inf], "y": [inf, nan, -inf, 0.0], "z": [0.5] * 4})
    b = _frame({"x": [inf, nan, 1.0, inf], "y": [inf, nan, -inf, 0.0], "z": [0.5] * 4})
    c = compare_frames(a, b, {"x": policy, "y": policy})
    assert c.verdict == verdict
    x, y = c.metrics["x"], c.metrics["y"]
    assert y.status == ("ignored" if policy == "ignore" else "match")  # inf = inf, nan = nan
    if policy != "ignore":
        assert (x.first_divergent_step, x.divergent_steps) == (4, 1)
    json.dumps(c.to_dict(), allow_nan=False)  # the --json output stays strict JSON


def test_finite_versus_overflow_is_never_close() -> None:
    a, b = _frame({"x": [math.inf]}), _frame({"x": [1.7976931348623157e308]})
    for policy in ("close:1,0", "close:0,1e308", "ulp:1000"):
        assert compare_frames(a, b, {"x": policy}).verdict == "diverged", policy


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": -1}, "steps must be >= 1, got -1"),
        ({"steps": 2.5}, "steps must be an integer, got 2.5"),
        ({"nnodes": 0}, "nnodes must be >= 1, got 0"),
        ({"global_batch_size": 0}, "global_batch_size must be >= 1"),
        ({"timeout_s": math.nan}, "timeout_s must be > 0 and finite, got nan"),
        ({"timeout_s": math.inf}, "timeout_s must be > 0 and finite, got inf"),
        ({"timeout_s": -5}, "timeout_s must be > 0"),
    ],
)
def test_impossible_spec_values_are_one_line_errors(changes: dict, message: str) -> None:
    from parity.spec import SpecError

    with pytest.raises(SpecError) as info:
        JobSpec(**{"task": "charcount-sft", **changes})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_nan_timeout_in_a_toml_spec_is_refused(tmp_path: Path) -> None:
    from parity.spec import SpecError, load_spec

    path = tmp_path / "spec.toml"
    path.write_text("timeout_s = nan\n")
    with pytest.raises(SpecError, match=r"spec\.toml: timeout_s must be > 0 and finite, got nan"):
        load_spec(path)


def test_golden_manifest_problems_are_one_line_errors(tmp_path: Path) -> None:
    from parity.judge.golden import GoldenError, save_golden, verify_golden

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"event": "end", "steps": 1}\n')
    with pytest.raises(GoldenError, match=r"run/manifest\.json: missing"):
        save_golden(tmp_path / "g", run)
    (run / "manifest.json").write_text('{"world_size": 2}')
    baseline = save_golden(tmp_path / "g", run)
    assert verify_golden(tmp_path / "g", run).ok
    whole = (baseline / "manifest.json").read_text()
    for text, message in (("{bad", "cannot read: Expecting"), ("[]", "must be a JSON object")):
        (baseline / "manifest.json").write_text(text)
        with pytest.raises(
            GoldenError, match=f"{baseline.name}/manifest\\.json: {message}"
        ) as info:
            verify_golden(tmp_path / "g", run)
        assert "\n" not in str(info.value)
    shifted = tmp_path / "shifted"  # as many steps as the golden, but other step numbers
    shifted.mkdir()
    (shifted / "metrics.jsonl").write_text('{"step": 2, "a": 1.0}\n{"event": "end", "steps": 2}\n')
    (shifted / "manifest.json").write_text('{"world_size": 2}')
    (baseline / "manifest.json").write_text(whole)
    with pytest.raises(
        GoldenError, match=r"golden has 1 steps \(1\.\.1\), the run has 1 \(2\.\.2\)"
    ):
        verify_golden(tmp_path / "g", shifted)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"event": "end", "steps": 0}\n', "no metrics records"),
        ('{"step": "1", "a": 1.0}\n', ":1: step must be a non-negative integer, got '1'"),
        ('{"step": 1, "a": {"b": 1}}\n', ":1: value of 'a' is not numeric"),
        ('{"step": 1, "a": 1}\n\x00\x00\n', ":2: not valid JSON"),
        ('{"step": 1, "a": 1}\n{"step": 3, "a": 1}\n{"step": 2, "a": 1}\n', None),
    ],
    ids=["only-end-record", "string-step", "nested-value", "nul-bytes", "unordered-steps"],
)
def test_more_malformed_metric_files(tmp_path: Path, text: str, message: str | None) -> None:
    from parity.readers import MetricsError

    path = tmp_path / "m.jsonl"
    path.write_text(text)
    if message is None:  # steps out of order are read in step order, not refused
        assert list(read_metrics(path).index) == [1, 2, 3]
        return
    with pytest.raises(MetricsError) as info:
        read_metrics(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)
