"""The `parity` command line: verdicts as exit codes, --json, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from parity.cli import main
from tests.needs import subject


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "end", "steps": 3}\n')
    return path


def _rows(grad_norm_step2=1.5):
    return [
        {"step": 1, "train/loss": 2.0, "train/grad_norm": 1.25, "train/mfu": 0.1},
        {"step": 2, "train/loss": 1.5, "train/grad_norm": grad_norm_step2, "train/mfu": 0.2},
        {"step": 3, "train/loss": 1.25, "train/grad_norm": 1.0, "train/mfu": 0.3},
    ]


def test_compare_aligned_and_diverged(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _rows())
    b = _write(tmp_path / "b.jsonl", _rows())
    assert main(["compare", str(a), str(b)]) == 0
    assert "aligned" in capsys.readouterr().out
    c = _write(tmp_path / "c.jsonl", _rows(float(np.nextafter(1.5, 2.0))))
    assert main(["compare", str(a), str(c), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "diverged"
    grad = out["metrics"]["train/grad_norm"]
    assert (
        grad["status"] == "diverged" and grad["first_divergent_step"] == 2 and grad["max_ulp"] == 1
    )
    assert out["metrics"]["train/mfu"]["status"] == "ignored"
    assert main(["compare", str(a), str(c), "--policy", "train/grad_norm=ulp:1"]) == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _rows())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "train/loss": "abc"}\n')
    assert main(["compare", str(a), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.jsonl" in err
    assert main(["compare", str(a), str(a), "--policy", "train/loss=ulp"]) == 2
    assert "ulp" in capsys.readouterr().err


def test_mutants_are_listed(capsys):
    assert main(["mutants"]) == 0
    out = capsys.readouterr().out
    for name in ("old-val-loss", "lr-before-step", "grad-norm-after-clip"):
        assert name in out


def _parity(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "parity.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parity
def test_pair_command_catches_injected_bug(tmp_path):
    proc = _parity(
        "pair", "--task", "charcount-sft", "--a", "legacy", "--b", "worker",
        "--world", "2", "--steps", "3",
        "--inject-b", "lr-before-step", "--in-process", "--out", str(tmp_path / "pair"), "--json",
        "--no-trace",  # the op-trace rerun: tests/run/test_trace_rerun.py
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["verdict"] == "diverged"
    assert out["metrics"]["train/lr"]["first_divergent_step"] == 1
    assert out["metrics"]["train/loss"]["status"] == "match"  # lr logged wrong, step taken right
    for part in ("a/metrics.jsonl", "b/metrics.jsonl", "summary.json", "summary.md"):
        assert (tmp_path / "pair" / part).exists(), part
    summary = json.loads((tmp_path / "pair" / "summary.json").read_text())
    assert summary["verdict"] == "diverged" and summary["b"]["spec"]["inject"] == ["lr-before-step"]
    assert summary["mode"] == "in-process"  # one launch; the mutant reached side B only
    assert summary["a"]["metrics"].endswith("a/metrics.jsonl")  # the spec is kept beside it
    assert summary["diagnosis"]["kind"] == "same batches, numbers differ"


@pytest.mark.parity
def test_pair_command_reports_a_failed_run(tmp_path):
    proc = _parity(
        "pair", "--task", "charcount-sft", "--a", "legacy", "--b", "worker",
        "--world", "2",
        "--steps", "2", "--set", f"model={tmp_path / 'no-model'}", "--out", str(tmp_path / "pair"),
        "--json",
    )  # fmt: skip
    assert proc.returncode == 3
    assert json.loads(proc.stdout)["verdict"] == "failed"
    assert "run failed" in proc.stderr and "rank" in proc.stderr
    assert "not a model folder" in proc.stderr


def test_progress_counts_logged_steps(tmp_path):
    from parity.run.job import Progress, steps_logged

    metrics = tmp_path / "metrics.jsonl"
    assert steps_logged(metrics) == 0  # not written yet
    metrics.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    assert steps_logged(metrics) == 3  # a partial last record still counts as progress
    quiet = Progress("A", 20, metrics, enabled=False)
    quiet.tick()
    quiet.close()
    assert quiet.bar is None
    shown = Progress("A", 20, metrics, enabled=True)
    shown.tick()
    assert shown.bar.n == 3
    shown.close()


def _refusal_tail(tmp_path, capsys, *flags):
    """What a rank's stderr holds when the job refuses `flags`: the real parser's output."""
    from worker.trainers.sft_common import parse_config

    with pytest.raises(SystemExit) as info:
        parse_config(["--out", str(tmp_path), *flags])
    assert info.value.code == 2
    return capsys.readouterr().err


@subject
def test_jobs_take_no_abbreviated_flags(tmp_path, capsys):
    """--val-sample is not --val-samples: a job must run exactly the flags its spec names."""
    tail = _refusal_tail(tmp_path, capsys, "--val-sample", "3")
    assert tail.rstrip().endswith("error: unrecognized arguments: --val-sample 3")


@subject
@pytest.mark.parametrize("as_json", [False, True])
def test_a_job_that_refuses_its_arguments_is_bad_input(tmp_path, capsys, monkeypatch, as_json):
    """A misspelled override reaches the job as a flag it does not know: exit 2 and one line
    naming the spec, not "run failed" (3). Other failures with exit code 2 stay failures."""
    import parity.pair
    from parity.run.launch import LaunchError, LaunchResult, RankFailure

    tail = _refusal_tail(tmp_path, capsys, "--val-sampels", "3")
    spec = tmp_path / "pair.toml"
    spec.write_text(
        'task = "charcount-sft"\nworld_size = 2\n[overrides]\nval_sampels = 3\n'
        '[a]\ntrainer = "legacy"\n[b]\n'
    )
    failures: list[RankFailure] = []

    def refused(pair, out, policies, **kwargs):
        result = LaunchResult(returncode=1, timed_out=False, duration_s=1.0, run_dir=out / "a")
        result.failures = failures
        raise LaunchError(result)

    monkeypatch.setattr(parity.pair, "run_pair", refused)
    args = ["pair", "--spec", str(spec), "--out", str(tmp_path / "out")] + ["--json"] * as_json
    failures[:] = [RankFailure(0, 2, None, tail), RankFailure(1, -15, "SIGTERM", "")]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"parity: error: {spec}: the job refused its arguments: ")
    assert "unrecognized arguments: --val-sampels 3 (log: " in err
    refusal = LaunchError(LaunchResult(2, False, 1.0, tmp_path, failures=failures[:1]))
    assert str(refusal).splitlines()[0] == (  # in pytest and run_job too: the cause comes first
        "the job refused its arguments: unrecognized arguments: --val-sampels 3"
    )
    for first in (RankFailure(0, 2, None, "error: bad things"), RankFailure(0, 1, None, tail)):
        failures[:] = [first]  # no usage line, or not argparse's exit code: a failed run
        assert main(args) == 3
        assert "run failed" in capsys.readouterr().err


def test_a_policy_for_a_metric_whose_name_holds_an_equals_sign(tmp_path, capsys):
    """`--policy METRIC=POLICY` splits on the last '=': a logged name such as `lr=peak` can be
    given its policy (a policy never holds '=')."""
    from parity.cli import main

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"step": 1, "lr=peak": 0.1, "loss": 2.5}\n{"event": "end", "steps": 1}\n')
    b.write_text('{"step": 1, "lr=peak": 0.9, "loss": 2.5}\n{"event": "end", "steps": 1}\n')
    assert main(["compare", str(a), str(b)]) == 1
    assert main(["compare", str(a), str(b), "--policy", "lr=peak=ignore"]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--policy", "=ignore"]) == 2


def test_spec_command_prints_each_side_s_launch_line_and_runs_nothing(tmp_path, capsys):
    """`parity spec FILE --command`: torchrun and its arguments, `{out}` made OUT/a and OUT/b,
    each side's env overrides first (secrets masked); no folder is made, nothing runs."""
    path = tmp_path / "spec.toml"
    path.write_text(
        'command = ["train.py", "--out_dir", "{out}"]\nworld_size = 2\n'
        '[a.env]\nNEW_IMPL = "0"\n[b.env]\nNEW_IMPL = "1"\nAPI_TOKEN = "s3cret"\n'
    )
    assert main(["spec", str(path), "--command"]) == 0
    lines = capsys.readouterr().out.splitlines()
    a, b = lines[lines.index("# side a") + 1], lines[lines.index("# side b") + 1]
    assert a.startswith("NEW_IMPL=0 ") and "-m torch.distributed.run --standalone" in a
    assert "--nproc-per-node 2" in a and a.endswith("train.py --out_dir OUT/a")
    assert b.startswith("NEW_IMPL=1 ") and b.endswith("--out_dir OUT/b") and "s3cret" not in b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.toml"]


@pytest.fixture
def stopped(monkeypatch) -> list:
    """check_revisions and bisect stopped before any run: (job, keywords) of each call."""
    import parity.bisect
    import parity.check

    calls = []

    def stop(spec, *args, **kwargs):
        calls.append((spec, kwargs))
        raise parity.check.RevisionError("stopped before any run")

    monkeypatch.setattr(parity.check, "check_revisions", stop)
    monkeypatch.setattr(parity.bisect, "bisect", stop)
    return calls


@pytest.mark.parametrize("command", ["check", "bisect"])
def test_check_and_bisect_take_the_job_flags_pair_takes(tmp_path, capsys, stopped, command):
    """The same job flags on every command that runs jobs, named as the spec keys (the shorter
    spellings kept): the job check and bisect would run, and a pair spec refused there."""
    revs = ["--base", "v1"] if command == "check" else ["--good", "v1", "--bad", "v2"]
    args = [command, *revs, "--task", "charcount-sft", "--set", "micro_batch_size=2"]
    args += ["--world-size", "1", "--steps", "3", "--seed", "7", "--timeout-s", "90"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "stopped before any run" in capsys.readouterr().err
    (job,) = [job for job, _ in stopped]
    assert (job.task, job.world_size, job.steps, job.seed, job.timeout_s) == (
        "charcount-sft", 1, 3, 7, 90.0
    )  # fmt: skip
    assert job.micro_batch_size == 2
    assert main([*args[:-8], "--world", "2", "--timeout", "60"]) == 2  # the old spellings
    assert (stopped[-1][0].world_size, stopped[-1][0].timeout_s) == (2, 60.0)
    pair = tmp_path / "pair.toml"
    pair.write_text('task = "charcount-sft"\n[a]\ntrainer = "legacy"\n[b]\ntrainer = "worker"\n')
    assert main([command, *revs, "--spec", str(pair), "--out", str(tmp_path / "o")]) == 2
    assert "not an [a]/[b] pair" in capsys.readouterr().err and len(stopped) == 2


READING = {"--format", "--run", "--duplicates", "--allow-skipped", "--at-source-precision"}


def test_every_command_that_reads_takes_the_same_reading_flags_and_defaults():
    """compare, report, check and bisect read with one set of flags (parity.cli.common), each
    unset by default so that a spec's [read] table, else spec.READ_OPTIONS, decides; the two
    that read files given to them add a run per side and what they may accept of a file."""
    from parity.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if hasattr(a, "choices") and a.choices]
    for name in ("compare", "report", "check", "bisect"):
        actions = {f: a for a in sub.choices[name]._actions for f in a.option_strings}
        assert READING <= set(actions), name
        assert all(actions[f].default is None for f in READING), name
        files = {"--run-a", "--run-b", "--allow-missing", "--allow-incomplete"} <= set(actions)
        assert files == (name in ("compare", "report")), name


@pytest.mark.parametrize("command", ["check", "bisect"])
def test_check_and_bisect_read_and_judge_as_the_spec_and_flags_say(tmp_path, stopped, command):
    """The spec's [read] and [policies] reach the library under the flags given, read as one
    set of options, and every policy parsed (the library gets Policy objects, never text)."""
    from parity.judge.policy import Policy

    spec = tmp_path / "job.toml"
    spec.write_text('task = "custom"\ncommand = ["x.py"]\n[read]\nduplicates = "last"\n'
                    '[policies]\n"train/*" = "ulp:2"\nloss = "exact"\n')  # fmt: skip
    revs = ["--base", "v1"] if command == "check" else ["--good", "v1", "--bad", "v2"]
    flags = ["--policy", "loss=ulp:1", "--at-source-precision", "--run", "r1"]
    assert main([command, *revs, "--spec", str(spec), *flags, "--out", str(tmp_path / "o")]) == 2
    ((_, given),) = stopped
    assert given["read"] == {"format": None, "run": "r1", "duplicates": "last",
                             "allow_skipped": False, "at_source_precision": True}  # fmt: skip
    assert given["policies"] == {"loss": Policy.parse("ulp:1"), "train/*": Policy.parse("ulp:2")}


def test_a_policy_text_is_parsed_once_at_the_edge(tmp_path, capsys, monkeypatch):
    """`parity compare` with a --policy parses its text once; what judges below gets the Policy."""
    from parity.judge.policy import Policy

    a = _write(tmp_path / "a.jsonl", _rows())
    texts = []
    parse = Policy.parse.__func__

    def counted(cls, text):
        texts.append(text)
        return parse(cls, text)

    monkeypatch.setattr(Policy, "parse", classmethod(counted))
    assert main(["compare", str(a), str(a), "--policy", "train/*=ulp:3"]) == 0
    assert texts == ["ulp:3"]


def test_an_output_path_with_a_newline_prints_no_line_of_its_own(tmp_path, capsys):
    """`report -o $'rep\nparity: aligned'`: the path is printed escaped, so it cannot print a
    verdict line before the real one."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, _rows())
    _write(b, _rows(grad_norm_step2=1.75))
    code = main(["report", str(a), str(b), "-o", str(tmp_path / "rep\nverdict: aligned")])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: aligned" not in out.splitlines(), out
    assert "rep\\nverdict: aligned" in out
