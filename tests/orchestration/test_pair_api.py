"""The library API: `parity.run_pair` does what `parity pair` does (runs, comparison, one
diagnosis, the op-trace rerun, summary and report), and `import parity` exports the user API
lazily, without torch or pytest. Fast: the runs are run folders written by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import parity.pair
import parity.run.job
import parity.run.trace_rerun
from parity.cli import main
from parity.judge.opdiff import OPS_DIR, OpDiff
from parity.readers import read_metrics
from parity.run.job import Run
from parity.run.launch import LaunchResult
from parity.spec import JobSpec, PairSpec

STEPS = 3
FIRST_OP = "aten.mul.Tensor"


def _lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [*records, {"event": "end", "steps": STEPS}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _write_run(folder: Path, loss_from: int | None) -> None:
    """A run folder as a job writes it: metrics.jsonl, and rank 0's record with the digest of
    its batches (the same on both sides: the pair differs in its numbers, from loss_from)."""
    metrics, rank = [], []
    for step in range(1, STEPS + 1):
        loss = 2.0 / step + (1e-9 if loss_from is not None and step >= loss_from else 0.0)
        metrics.append({"step": step, "train/loss": loss, "train/lr": 0.001})
        data = {"train": {"hash": f"t{step}", "micro_batches": 2, "tokens": 50}}
        rank.append({"step": step, "train/loss": loss, "train/lr": 0.001, "_meta": {"data": data}})
    _lines(folder / "metrics.jsonl", metrics)
    _lines(folder / "ranks" / "rank0.jsonl", rank)


@pytest.fixture
def fake_runs(monkeypatch):
    """parity.run.job.run_job writes a run folder instead of launching: side B ("worker") differs
    from step 2; a traced rerun (trace-a/, trace-b/) leaves an ops/ trace, whose comparison
    names FIRST_OP. Returns the folders run, in order."""
    ran: list[str] = []

    def run_job(spec, out, label=None, **kwargs):
        out = Path(out)
        ran.append(out.name)
        _write_run(out, 2 if spec.variant == "worker" else None)
        if out.name.startswith("trace-"):
            (out / OPS_DIR).mkdir()
            (out / OPS_DIR / "rank0.jsonl").write_text("")
        return Run(spec, out, LaunchResult(0, False, 1.0, out), read_metrics(out))

    first = {"op": FIRST_OP, "where": FIRST_OP, "ulp": 1, "src": "worker/losses.py:1"}
    ops = OpDiff("differ", step=2, rank=0, ops_compared=3, first=first, origin="born here")
    monkeypatch.setattr(parity.run.job, "run_job", run_job)
    monkeypatch.setattr(parity.run.trace_rerun, "compare_ops", lambda a, b: ops)
    return ran


@pytest.fixture
def diagnoses(monkeypatch) -> list[tuple]:
    """Every call of parity.pair's diagnose, recorded."""
    calls: list[tuple] = []
    real = parity.pair.diagnose

    def counted(a, b, comparison=None):
        calls.append((a, b))
        return real(a, b, comparison)

    monkeypatch.setattr(parity.pair, "diagnose", counted)
    return calls


PAIR = PairSpec.from_variants(JobSpec(task="charcount-sft", steps=STEPS), "legacy", "worker")


def test_run_pair_reruns_diagnoses_once_and_summarizes_after_the_rerun(
    tmp_path, fake_runs, diagnoses, capsys
):
    out = tmp_path / "pair"
    result = parity.pair.run_pair(PAIR, out)
    assert fake_runs == ["a", "b", "trace-a", "trace-b"]
    assert len(diagnoses) == 1  # the summary, the rerun, the report and the CLI share one
    assert result.verdict == "diverged" and result.trace_rerun.step == 2
    assert result.diagnosis.ops.first["op"] == FIRST_OP
    assert (out / "a" / OPS_DIR).is_dir() and (out / "b" / OPS_DIR).is_dir()  # installed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diagnosis"] == result.diagnosis_dict()
    assert summary["diagnosis"]["ops"]["first"]["op"] == FIRST_OP  # written after the rerun
    assert summary["diagnosis"]["lines"][-1].startswith("op trace: both sides rerun from step 1")
    assert summary["trace_rerun"] == result.trace_rerun.to_dict()
    assert result.report == out / "report.md"
    report = result.report.read_text()
    assert FIRST_OP in report and "op trace: both sides rerun from step 1" in report
    assert (out / "report.html").is_file()
    stdout, stderr = capsys.readouterr()
    assert stdout == ""  # progress goes to stderr: `--json` stdout stays one object
    assert "same batches, numbers differ from step 2: rerunning both sides" in stderr


def test_run_pair_without_trace_or_report(tmp_path, fake_runs, diagnoses):
    out = tmp_path / "pair"
    result = parity.pair.run_pair(PAIR, out, trace=False, report=False)
    assert fake_runs == ["a", "b"] and len(diagnoses) == 1
    assert result.trace_rerun is None and result.report is None
    assert not (out / "report.md").exists() and not (out / "trace-a").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert "trace_rerun" not in summary and summary["diagnosis"]["ops"]["status"] == "unavailable"
    assert summary["diagnosis"]["kind"] == "same batches, numbers differ"


def test_an_aligned_pair_is_not_rerun(tmp_path, fake_runs, diagnoses):
    pair = PairSpec.from_variants(JobSpec(task="charcount-sft", steps=STEPS), "legacy", "legacy")
    result = parity.pair.run_pair(pair, tmp_path / "pair")
    assert result.verdict == "aligned" and result.trace_rerun is None
    assert fake_runs == ["a", "b"] and len(diagnoses) == 1 and result.report.is_file()


def test_the_cli_prints_what_run_pair_wrote(tmp_path, fake_runs, diagnoses, capsys):
    out = tmp_path / "pair"
    args = ["pair", "--task", "charcount-sft", "--a", "legacy", "--b", "worker"]
    assert main([*args, "--steps", str(STEPS), "--out", str(out), "--json"]) == 1
    stdout, stderr = capsys.readouterr()
    printed = json.loads(stdout)  # one object: the rerun's progress line went to stderr
    summary = json.loads((out / "summary.json").read_text())
    assert printed["diagnosis"] == summary["diagnosis"] and len(diagnoses) == 1
    assert printed["trace_rerun"] == summary["trace_rerun"]
    assert printed["report"] == str(out / "report.html") and printed["out"] == str(out)
    assert "rerunning both sides" in stderr


def test_write_summary_alone_diagnoses_once(tmp_path, diagnoses):
    """A PairResult made elsewhere (the plugin's) is diagnosed on first use, then kept."""
    _write_run(tmp_path / "a", None)
    _write_run(tmp_path / "b", 2)
    spec = JobSpec(task="charcount-sft", steps=STEPS)
    a, b = (Run(spec, d, LaunchResult(0, False, 1.0, d), read_metrics(d))
            for d in (tmp_path / "a", tmp_path / "b"))  # fmt: skip
    result = parity.pair.compare_pair(a, b, tmp_path)
    parity.pair.write_summary(result)
    parity.pair.write_pair_report(result)
    assert result.diagnose().kind == "same batches, numbers differ" and len(diagnoses) == 1


# --- the package's API ----------------------------------------------------------------------


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_parity_and_its_run_pair_import_neither_torch_nor_pytest():
    code = (
        "import parity, sys; parity.run_pair; parity.JobSpec; "
        "print('torch' in sys.modules, 'pytest' in sys.modules)"
    )
    assert _python(code) == "False False"


def test_every_public_name_resolves_and_is_listed():
    """In a fresh interpreter: here, test files may have imported parity.bisect (the module)
    before the package's `bisect` (the function) was asked for."""
    code = (
        "import json, parity\n"
        "names = {n: type(getattr(parity, n)).__name__ for n in parity.__all__}\n"
        "print(json.dumps([names, sorted(set(parity.__all__) - set(dir(parity))),"
        " parity.bisect.__module__, callable(parity.bisect)]))\n"
    )
    names, not_in_dir, bisect_module, bisect_callable = json.loads(_python(code))
    commands = {  # one function per command: pair, compare, report, check, bisect
        "run_pair", "compare_runs", "build_report", "check_revisions", "check_golden",
        "bisect", "bisect_revisions",
    }  # fmt: skip
    parts = {"run_job", "JobSpec", "PairSpec", "compare_frames", "read_metrics", "Policy",
             "RunStore", "assert_parity"}  # fmt: skip
    errors = {"InputError", "SpecError", "MetricsError", "RevisionError", "LaunchError"}
    assert set(names) == commands | parts | errors and not not_in_dir
    assert names["JobSpec"] == "type" and names["run_pair"] == "function"
    assert {names[n] for n in commands} == {"function"} and {names[n] for n in errors} == {"type"}
    assert (bisect_module, bisect_callable) == ("parity.bisect", True)  # the function


def test_parity_bisect_is_callable_after_its_module_is_imported():
    """`import parity.bisect` makes `parity.bisect` the module (Python sets it): calling it still
    calls the function of the same name."""
    import parity
    import parity.bisect as module

    assert callable(parity.bisect) and module.bisect.__name__ == "bisect"
    assert parity.bisect.BisectResult is module.BisectResult


def test_compare_runs_is_parity_compare(tmp_path, capsys):
    """The API's compare_runs gives what `parity compare` prints, for the same two files."""
    import parity
    from parity.cli import main

    for name, loss in (("a", 0.5), ("b", 0.5000000000000001)):
        (tmp_path / f"{name}.jsonl").write_text(
            f'{{"step": 1, "train/loss": {loss!r}}}\n{{"event": "end", "steps": 1}}\n'
        )
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    comparison = parity.compare_runs(a, b)
    assert main(["compare", str(a), str(b), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert comparison.verdict == printed["verdict"] == "diverged"
    assert comparison.to_dict()["metrics"] == printed["metrics"]
    assert parity.compare_runs(a, b, {"train/loss": "ulp:1"}).verdict == "aligned"
