"""`parity check`: one spec on two git revisions in throwaway worktrees, the user's repo untouched.

A temp repo holds a tiny torchrun job whose second commit changes train/loss from step 3 on.
Launches are few (about 5 s each): one base/head check shared by the tests, one aligned check
and one golden run; failure cleanup is tested with a fake launcher.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

import parity.check
import parity.run.job
from parity.cli import main
from parity.run.launch import LaunchResult
from tests.orchestration.history import commit, git, new_repo, repo_state

pytestmark = pytest.mark.parity

JOB = """\
import json
import sys
from pathlib import Path

import torch.distributed as dist

FACTOR = {factor}


def main():
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "w") as f:
            for i in range(1, 6):
                loss = 1.0 / i * (FACTOR if i >= 3 else 1.0)
                f.write(json.dumps({{"step": i, "train/loss": loss}}) + "\\n")
            f.write(json.dumps({{"event": "end", "steps": 5}}) + "\\n")
    dist.barrier()
    dist.destroy_process_group()


main()
"""

SPEC = 'task = "custom"\nworld_size = 2\ncommand = ["job.py", "--out", "{out}"]\ntimeout_s = 120\n'


def snapshot(repo: Path) -> dict[str, str]:
    """Everything a check must leave as it was (``repo_state``), the job and the notes too."""
    return repo_state(repo, "job.py", "notes.txt")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """Two commits of job.py on main, a side branch, and uncommitted (staged, unstaged and
    untracked) edits that every check must leave alone."""
    root = tmp_path_factory.mktemp("repo")
    git(root, "init", "-q", "-b", "main")
    (root / "job.py").write_text(JOB.format(factor="1.0"))
    (root / "notes.txt").write_text("one\n")
    (root / "staged.txt").write_text("a\n")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "base")
    git(root, "branch", "side")
    (root / "job.py").write_text(JOB.format(factor="1.0000001"))
    git(root, "commit", "-q", "-am", "head: scale the loss from step 3")
    (root / "notes.txt").write_text("uncommitted edit\n")
    (root / "staged.txt").write_text("staged edit\n")
    git(root, "add", "staged.txt")
    (root / "untracked.txt").write_text("new\n")
    (root / "spec.toml").write_text(SPEC)
    return root


def _check(repo: Path, monkeypatch, capsys, *args: str) -> tuple[int, dict]:
    monkeypatch.chdir(repo)
    code = main(["check", *args, "--spec", str(repo / "spec.toml"), "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def diverged(repo, tmp_path_factory) -> tuple[int, dict, dict, dict, Path]:
    before = snapshot(repo)
    out = tmp_path_factory.mktemp("check")
    mp = pytest.MonkeyPatch()
    try:
        mp.chdir(repo)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(
                ["check", "--base", "HEAD~1", "--head", "HEAD", "--spec", "spec.toml"]
                + ["--out", str(out), "--json"]
            )
    finally:
        mp.undo()
    return code, json.loads(buf.getvalue()), before, snapshot(repo), out


def test_refactor_that_changes_a_number_diverges_at_step_3(diverged, repo):
    code, result, before, after, out = diverged
    assert code == 1
    assert result["verdict"] == "diverged"
    loss = result["metrics"]["train/loss"]
    assert loss["status"] == "diverged" and loss["first_divergent_step"] == 3
    assert loss["a_value"] == 1.0 / 3 and loss["b_value"] == 1.0 / 3 * 1.0000001
    assert result["base"] == {"rev": "HEAD~1", "commit": git(repo, "rev-parse", "HEAD~1").strip()}
    assert result["head"] == {"rev": "HEAD", "commit": after["head"].strip()}
    md = (out / "report.md").read_text()
    # 5 steps compared, or fewer where the head was stopped at its divergence (parity.run.early)
    assert "diverged" in md and re.search(
        r"\| train/loss \| diverged \| exact \| [345] \| 3 \|", md
    )
    assert (out / "report.html").is_file()
    assert (out / "base" / "metrics.jsonl").is_file() and (out / "head" / "metrics.jsonl").is_file()


def test_check_leaves_the_repository_as_it_was(diverged):
    _, _, before, after, _ = diverged
    assert after == before
    assert "notes.txt" in before["status"] and "untracked.txt" in before["status"]
    assert len(before["worktrees"].strip().split("\n\n")) == 1


def test_same_revision_twice_is_aligned(repo, tmp_path, monkeypatch, capsys):
    before = snapshot(repo)
    code, result = _check(repo, monkeypatch, capsys, "--base", "HEAD", "--out", str(tmp_path))
    assert code == 0 and result["verdict"] == "aligned"
    assert result["base"]["commit"] == result["head"]["commit"] == before["head"].strip()
    assert snapshot(repo) == before


def test_golden_file_against_the_current_tree(diverged, repo, tmp_path, monkeypatch, capsys):
    out = diverged[4]
    golden = tmp_path / "golden.jsonl"
    golden.write_bytes((out / "head" / "metrics.jsonl").read_bytes())  # current job.py is head's
    code, result = _check(
        repo, monkeypatch, capsys, "--golden", str(golden), "--out", str(tmp_path / "g")
    )
    assert code == 0 and result["verdict"] == "aligned"
    assert (tmp_path / "g" / "current" / "metrics.jsonl").is_file()
    assert (tmp_path / "g" / "report.md").is_file()


def test_bad_revision_is_bad_input(repo, tmp_path, monkeypatch, capsys):
    before = snapshot(repo)
    monkeypatch.chdir(repo)
    args = ["check", "--base", "no-such-rev", "--spec", "spec.toml", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "no-such-rev" in capsys.readouterr().err
    assert main(["check", "--base=--output=x", *args[3:]]) == 2  # a flag-like rev stays a rev
    assert not (repo / "x").exists()
    assert snapshot(repo) == before


ALONE_JOB = """\
import sys, time
import torch, torch.distributed as dist
from parity.record import Recorder
ALONE = {alone}
dist.init_process_group("gloo")
rank = dist.get_rank()
rec = Recorder(sys.argv[1])
rec.manifest({{}})
w = torch.ones(4)
for step in range(1, 5):
    g = w * (rank + 1)
    if not ALONE:
        dist.all_reduce(g)
    w = w - 0.1 * g
    rec.log(step, {{"train/loss": float(w.sum())}})
    time.sleep(0.5)
rec.finish()
dist.destroy_process_group()
"""


def test_a_head_whose_ranks_train_alone_fails_the_world_check_not_stopped_as_diverged(
    tmp_path, monkeypatch, capsys
):
    """The head joins a group of 2 and never sends anything through it (each rank trains
    alone), so its loss differs from the base's at step 1. Judged as it runs, it used to be
    stopped there and called diverged (exit 1) without its world judged; a run is stopped
    early only once its group carried a collective, so this one runs on and fails (exit 3)."""
    repo = new_repo(tmp_path / "repo")
    spec = SPEC.replace('"job.py", "--out", "{out}"', '"job.py", "{out}"')
    commit(repo, "base", {"job.py": ALONE_JOB.format(alone=False), "spec.toml": spec})
    commit(repo, "head: each rank alone", {"job.py": ALONE_JOB.format(alone=True)})
    monkeypatch.chdir(repo)
    code = main(["check", "--base", "HEAD~1", "--spec", "spec.toml", "--no-trace",
                 "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3, err
    assert "none sent anything through it" in err, err


@pytest.mark.parametrize("failure", ["run failed", "exception"])
def test_worktree_is_removed_when_the_run_fails(repo, tmp_path, monkeypatch, capsys, failure):
    """No real launch: the fake launcher fails inside the worktree, which must then be gone."""
    before = snapshot(repo)
    seen: list[Path] = []

    def fake_launch(request):
        cwd, run_dir = request.cwd, request.run_dir
        seen.append(Path(cwd))
        assert (Path(cwd) / "job.py").is_file()
        if failure == "exception":
            raise KeyboardInterrupt
        return LaunchResult(returncode=1, timed_out=False, duration_s=0.0, run_dir=run_dir)

    monkeypatch.setattr(parity.run.job, "launch", fake_launch)
    monkeypatch.chdir(repo)
    args = ["check", "--base", "HEAD~1", "--spec", "spec.toml", "--out", str(tmp_path)]
    if failure == "exception":
        with pytest.raises(KeyboardInterrupt):
            main(args)
    else:
        assert main(args) == 3
    assert len(seen) == 1 and not seen[0].exists() and not seen[0].parent.exists()
    assert snapshot(repo) == before


@pytest.mark.parametrize(
    ("against", "allowed"), [("base", False), ("base", True), ("golden", False)]
)
def test_teardown_crash_is_failed_but_metrics_are_compared(
    repo, tmp_path, monkeypatch, capsys, against, allowed
):
    """Head (or the current tree) finishes its metrics, then a rank aborts at exit (a fake
    launcher; `parity pair`'s test uses a real one): the metrics are still compared and the
    crash is named."""
    from parity.run.launch import RankFailure

    lines = [json.dumps({"step": i, "train/loss": 1.0 / i}) for i in range(1, 6)]
    metrics = "\n".join([*lines, '{"event": "end", "steps": 5}\n'])

    def fake_launch(request):
        args, run_dir = request.module_or_script_args, request.run_dir
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(metrics)
        if out.name == "base":
            return LaunchResult(returncode=0, timed_out=False, duration_s=1.0, run_dir=run_dir)
        crash = RankFailure(rank=1, exitcode=-6, signal="SIGABRT", log_tail="")
        return LaunchResult(1, False, 1.0, run_dir, failures=[crash])

    monkeypatch.setattr(parity.run.job, "launch", fake_launch)
    (tmp_path / "golden.jsonl").write_text(metrics)
    side = ["--base", "HEAD"] if against == "base" else ["--golden", str(tmp_path / "golden.jsonl")]
    flags = ["--allow-teardown-failure"] if allowed else []
    out = tmp_path / "check"
    code, result = _check(repo, monkeypatch, capsys, *side, "--out", str(out), *flags)
    assert (code, result["verdict"]) == ((0, "aligned") if allowed else (3, "failed"))
    assert result["metrics_verdict"] == "aligned"
    [teardown] = result["teardown"]
    crashed = "head" if against == "base" else "current"
    assert (teardown["side"], teardown["reason"]) == (crashed, "teardown-crash")
    assert teardown["failures"] == [{"rank": 1, "exitcode": -6, "signal": "SIGABRT"}]
    md = (out / "report.md").read_text()
    verdict = "aligned" if allowed else "failed"
    line = f"{crashed}: teardown-crash (rank 1: killed by SIGABRT); metrics compared anyway"
    assert f"verdict {verdict}: teardown failure after complete metrics: {line}: aligned" in md


def test_a_reused_run_folder_is_refused_and_kept(repo, tmp_path, monkeypatch):
    """A run folder is read with format detection, so a file an earlier run left in it (an HF
    job's trainer_state.json, say) must not be read as this run's output: a run folder already
    there is refused before anything launches, and kept. No real launch."""
    from parity.outdir import OutDir, OutputError
    from parity.spec import JobSpec

    with OutDir.open(tmp_path) as held:  # an earlier run's folder, made by the harness
        run_dir = held.make_dir("base")
    (run_dir / "trainer_state.json").write_text('{"log_history": [{"loss": 1.0, "step": 1}]}')
    seen: list[list[str]] = []

    def fake_launch(request):
        run_dir = request.run_dir
        seen.append(sorted(p.name for p in (tmp_path / "base").iterdir()))
        return LaunchResult(returncode=0, timed_out=False, duration_s=0.0, run_dir=run_dir)

    monkeypatch.setattr(parity.run.job, "launch", fake_launch)
    spec = JobSpec(task="custom", command=["job.py", "--out", "{out}"], world_size=1)
    with pytest.raises(OutputError, match="base: a folder is already there"):
        parity.check.run_in_tree(spec, repo, run_dir)
    assert seen == [] and [p.name for p in run_dir.iterdir()] == ["trainer_state.json"]


QUIET_FORMAT = """\
import pandas as pd

from parity.readers import Format
from parity.readers.frame import FLOAT64, finish


def read(path, options):
    rows = dict(line.split() for line in (path / "train.quiet").read_text().splitlines())
    values = pd.DataFrame({"train/loss": [float(v) for v in rows.values()]},
                          index=pd.Index([int(k) for k in rows], dtype="int64", name="step"))
    return finish(values, values.notna(), source=path, fmt="quiet", precision=FLOAT64)


FORMATS = [Format("quiet", read, lambda path, head: False, "named only", FLOAT64)]
"""

QUIET_JOB = """\
import sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
(out / "train.quiet").write_text("".join(f"{i} {1.0 / i!r}\\n" for i in range(1, 4)))
"""


def test_check_reads_each_revision_s_run_in_the_spec_s_read_format(tmp_path, monkeypatch, capsys):
    """A run that only its `[read]` format reads (a plugin's format that claims nothing, so it is
    never detected) is a run: check compares it (aligned), not "wrote nothing readable"."""
    from importlib.metadata import EntryPoint

    import parity.readers as readers

    (tmp_path / "quiet_format.py").write_text(QUIET_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    quiet = [EntryPoint("quiet", "quiet_format:FORMATS", "llm_parity.readers")]
    monkeypatch.setattr(readers, "entry_points", lambda group: quiet)
    readers._registry.cache_clear()
    monkeypatch.chdir(new_repo(tmp_path / "repo"))
    commit(Path.cwd(), "base", {"job.py": QUIET_JOB})
    commit(Path.cwd(), "head: a comment", {"job.py": QUIET_JOB + "# a comment\n"})
    spec = 'task = "custom"\ndistributed = false\ncommand = ["job.py", "--out", "{out}"]\n'
    (tmp_path / "spec.toml").write_text(spec + '[read]\nformat = "quiet"\n')
    try:
        code = main(["check", "--base", "HEAD~1", "--spec", str(tmp_path / "spec.toml"),
                     "--out", str(tmp_path / "out"), "--json"])  # fmt: skip
    finally:
        readers._registry.cache_clear()
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    result = json.loads(said.out.strip().splitlines()[-1])
    assert result["verdict"] == "aligned" and result["metrics"]["train/loss"]["steps_compared"] == 3


def test_check_runs_its_revisions_as_a_pair(repo, tmp_path, monkeypatch, capsys):
    """check goes through pair's one path: run_sides once, its sides the two revisions (out/base
    and out/head, each run in its worktree), then finish_pair once and one diagnosis; summary.json
    is pair's with the revisions and the carried inputs added, and `--json` prints exactly it.
    No real launch: head's fake run differs from step 3."""
    import parity.pair

    calls: dict[str, list] = {"run_sides": [], "finish_pair": [], "diagnose": [], "cwd": []}
    real = (parity.check.run_sides, parity.check.finish_pair, parity.pair.diagnose)

    def run_sides(*args, **kwargs):
        calls["run_sides"].append([(s.folder, s.label) for s in kwargs["sides"]])
        return real[0](*args, **kwargs)

    def finish_pair(result, **kwargs):
        calls["finish_pair"].append(result.names)
        return real[1](result, **kwargs)

    def diagnose(a, b, comparison=None):
        calls["diagnose"].append((a.name, b.name))
        return real[2](a, b, comparison)

    def fake_launch(request):
        args, cwd = request.module_or_script_args, Path(request.cwd)
        out = Path(args[args.index("--out") + 1])
        calls["cwd"].append((out.name, cwd.name, (cwd / "job.py").is_file()))
        factor = 1.5 if out.name == "head" else 1.0
        lines = [json.dumps({"step": i, "train/loss": 1.0 / i * (factor if i >= 3 else 1.0)})
                 for i in range(1, 6)]  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("\n".join([*lines, '{"event": "end", "steps": 5}\n']))
        return LaunchResult(0, False, 1.0, request.run_dir)

    monkeypatch.setattr(parity.check, "run_sides", run_sides)
    monkeypatch.setattr(parity.check, "finish_pair", finish_pair)
    monkeypatch.setattr(parity.pair, "diagnose", diagnose)
    monkeypatch.setattr(parity.run.job, "launch", fake_launch)
    out = tmp_path / "check"
    code, printed = _check(repo, monkeypatch, capsys, "--base", "HEAD~1", "--out", str(out))
    base, head = (git(repo, "rev-parse", rev).strip() for rev in ("HEAD~1", "HEAD"))
    labels = [("base", f"base HEAD~1 ({base[:12]})"), ("head", f"head HEAD ({head[:12]})")]
    assert calls["run_sides"] == [labels] and calls["finish_pair"] == [("base", "head")]
    assert calls["diagnose"] == [("base", "head")]
    assert calls["cwd"] == [("base", base[:12], True), ("head", head[:12], True)]
    summary = json.loads((out / "summary.json").read_text())
    assert code == 1 and printed == summary  # --json: summary.json, nothing more or less
    assert summary["verdict"] == summary["metrics_verdict"] == "diverged"
    assert summary["base"] == {"rev": "HEAD~1", "commit": base}
    assert summary["head"] == {"rev": "HEAD", "commit": head}
    assert summary["carried"] == [] and summary["teardown"] == []
    assert summary["a"]["dir"] == str(out / "base") and summary["b"]["dir"] == str(out / "head")
    assert summary["metrics"]["train/loss"]["first_divergent_step"] == 3
    assert {"kind", "lines", "ops"} <= set(summary["diagnosis"])  # pair's diagnosis
    assert (out / "summary.md").read_text().startswith("# parity: diverged")
    md = (out / "report.md").read_text()
    assert f"base HEAD\\~1 ({base[:12]})" in md and f"base = HEAD\\~1 = {base}" in md


def _worker_files(root: Path) -> dict[str, bytes]:
    """The reference subject's package and its fixtures, as files to commit (no caches)."""
    files = {}
    for top in ("worker", "fixtures"):
        for path in sorted((root / top).rglob("*")):
            skip = {"__pycache__", "llm_parity_worker.egg-info"} & set(path.parts)
            if path.is_file() and not skip:
                files[str(path.relative_to(root))] = path.read_bytes()
    return files


def test_check_names_the_first_differing_op_of_a_numerics_change(tmp_path, monkeypatch, capsys):
    """A commit that drops the loss's `* dp` (the missing-dp-factor mutant, written into the
    code): the revisions diverge on the same batches, so check, as a pair, reruns each in its
    worktree with the first divergent step traced and names the op the change was born in."""
    repo = new_repo(tmp_path / "repo")
    commit(repo, "base: the reference subject", _worker_files(Path(__file__).parents[2]))
    losses = (repo / "worker" / "losses.py").read_text()
    body = "    masked = values * mask.to(values.dtype)\n"
    assert losses.count(body) == 1
    dropped = (
        "    import dataclasses\n\n    scale = dataclasses.replace(scale, dp=1)  # the bug\n" + body
    )
    commit(
        repo,
        "head: no dp factor",
        {"worker/losses.py": losses.replace(body, dropped)},
    )
    spec = tmp_path / "spec.toml"
    spec.write_text('task = "charcount-sft"\nworld_size = 2\nsteps = 2\ntrainer = "worker"\n')
    monkeypatch.chdir(repo)
    out = tmp_path / "out"
    code = main(["check", "--base", "HEAD~1", "--spec", str(spec), "--out", str(out), "--json"])
    said = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert code == 1 and json.loads(said.out) == summary, said.err[-3000:]
    assert summary["trace_rerun"]["step"] == 1, summary.get("trace_rerun")
    ops = summary["diagnosis"]["ops"]
    assert ops["status"] == "differ" and ops["first"]["op"] == "aten.mul.Tensor", ops["line"]
    assert "scalar input differs: 2 vs 1" in ops["line"]
    assert (out / "trace-a" / "ops").is_dir() and (out / "base" / "ops").is_dir()
    assert "aten.mul.Tensor" in (out / "report.md").read_text()
