"""`parity bisect`: git bisect driven from the harness, the user's repo left untouched.

A temp repo of five commits holds a one-rank custom job (a plain script, about 3 s a launch); the
third commit nudges train/loss by one ULP from step 4 on. The user is in the middle of a bisect
of their own, with staged, unstaged and untracked edits: all of it must survive every run. The
tests marked `parity` launch the job; the others replace each run by a fake one in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import parity.bisect
import parity.git
from parity.bisect import bisect
from parity.cli import main
from tests.orchestration.history import commit_of, git, make_repo


def snapshot(repo: Path) -> dict[str, str]:
    """Everything bisect must leave as it was, the user's own bisect state included."""
    gitdir = repo / ".git"
    return {
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "head": git(repo, "rev-parse", "HEAD"),
        "symbolic": git(repo, "symbolic-ref", "HEAD"),
        "refs": git(repo, "for-each-ref"),
        "worktrees": git(repo, "worktree", "list", "--porcelain"),
        "bisect": git(repo, "bisect", "log", check=False),
        "staged": git(repo, "diff", "--cached"),
        "unstaged": git(repo, "diff"),
        "gitdir": "\n".join(sorted(p.name for p in gitdir.iterdir())),
        "refs_files": "\n".join(sorted(str(p.relative_to(gitdir)) for p in gitdir.rglob("refs/*"))),
        "config": (gitdir / "config").read_text(),
        "job": (repo / "job.py").read_text(),
    }


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return make_repo(tmp_path_factory.mktemp("bisect-repo"))


def _bisect(repo: Path, out: Path, *extra: str) -> tuple[int, dict]:
    mp = pytest.MonkeyPatch()
    try:
        mp.chdir(repo)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["bisect", "--good", "HEAD~4", "--bad", "main", "--spec", "spec.toml",
                         "--out", str(out), "--json", *extra])  # fmt: skip
    finally:
        mp.undo()
    return code, json.loads(buf.getvalue())


def launcher_logs(folder: Path) -> list[Path]:
    """The launcher.log of each launch under ``folder``: in the run folder, or beside it in
    RUN.launch/ (where the harness keeps a run's launch files)."""
    return [*folder.glob("*/launcher.log"), *folder.glob("*.launch/launcher.log")]


def fake_runs(monkeypatch, fail: tuple[str, ...] = (), restarted: bool = False) -> list[Path]:
    """Replace each launch by a fake run in this process: it reads the checked-out job.py (its
    NUDGE and label) and writes what the job would; restarted: each step twice, a junk value
    first (read it with duplicates="last"). A commit whose label is in ``fail`` writes nothing
    (a failed run). Returns the trees it ran in."""
    trees: list[Path] = []

    def fake_run(spec, tree, run_dir, *args, **kwargs):
        trees.append(Path(tree))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        job = (Path(tree) / "job.py").read_text()
        if re.search(r"NUDGE = \w+  # (\w+)", job)[1] in fail:
            return None
        loss = math.nextafter(0.25, math.inf) if "NUDGE = True" in job else 0.25
        rows = [{"step": 4, "train/loss": 9.0}] if restarted else []
        rows.append({"step": 4, "train/loss": loss})
        lines = [json.dumps(r) + "\n" for r in rows] + ['{"event": "end", "steps": 4}\n']
        (run_dir / "metrics.jsonl").write_text("".join(lines))
        return None

    monkeypatch.setattr(parity.bisect, "run_in_tree", fake_run)
    return trees


PROGRESS = re.compile(
    r"parity bisect: \[(\d+)/~(\d+)\] ([0-9a-f]{12}) (.+): (aligned|diverged|skipped)"
)


def progress_lines(err: str) -> list[re.Match]:
    return [m for line in err.splitlines() if (m := PROGRESS.fullmatch(line))]


def test_bisection_runs_each_commit_here_and_answers_git(repo, tmp_path, monkeypatch, capsys):
    """Every commit is tested in this process (no `git bisect run`, no shell), git is answered
    good/bad from the verdict, and each tested commit gets one progress line; the reading
    options reach every read and comparison."""
    before = snapshot(repo)
    trees = fake_runs(monkeypatch, restarted=True)
    reads, compares, gits = [], [], []
    real_read, real_compare, real_git = (
        parity.bisect.read_metrics, parity.bisect.compare_frames, parity.git.git
    )  # fmt: skip

    def read(path, fmt=None, **kw):
        reads.append((fmt, kw))
        return real_read(path, fmt, **kw)

    def compare(a, b, policies=None, **kw):
        compares.append(kw)
        return real_compare(a, b, policies, **kw)

    def git_call(repo_, *args):
        gits.append(args)
        return real_git(repo_, *args)

    monkeypatch.setattr(parity.bisect, "read_metrics", read)
    monkeypatch.setattr(parity.bisect, "compare_frames", compare)
    monkeypatch.setattr(parity.git, "git", git_call)
    policies = {"train/loss": "ulp:1@-3,exact@4-"}
    read_as = {"format": "jsonl", "duplicates": "last", "allow_skipped": True}
    result = bisect(repo / "spec.toml", "HEAD~4", "main", tmp_path, repo=repo, policies=policies,
                    read=read_as)  # fmt: skip
    assert result.outcome == "found" and result.first_bad.commit == commit_of(repo, 3)
    assert result.verdict == "diverged"  # the table's word for exit 1
    assert [t.commit for t in result.tested] == [commit_of(repo, n) for n in (5, 3, 2)]
    assert len(trees) == 4  # the reference, then each tested commit: all in this process
    assert all(r == ("jsonl", {"run": None, "duplicates": "last"}) for r in reads) and reads
    assert compares == [{"allow_skipped": True, "at_source_precision": False}] * 3
    assert gits and not [a for a in gits if "bisect" in a and "run" in a]
    lines = progress_lines(capsys.readouterr().err)
    assert [(m[1], m[3], m[5]) for m in lines] == [
        ("1", commit_of(repo, 5)[:12], "diverged"),
        ("2", commit_of(repo, 3)[:12], "diverged"),
        ("3", commit_of(repo, 2)[:12], "aligned"),
    ]
    assert lines[1][4] == "third: nudge the loss by one ULP" and lines[-1][2] == "3"
    assert "# first bad commit: [" + commit_of(repo, 3) in (tmp_path / "bisect.log").read_text()
    assert json.loads((tmp_path / "bisect.json").read_text()) == json.loads(
        json.dumps(result.to_dict())
    )
    assert snapshot(repo) == before


def test_failed_runs_are_skipped_and_can_leave_it_ambiguous(repo, tmp_path, monkeypatch):
    """Every commit between good and bad fails to run: each is skipped, and git can only name
    the candidates."""
    before = snapshot(repo)
    fake_runs(monkeypatch, fail=("two", "three", "four"))
    monkeypatch.chdir(repo)
    code, result = _bisect(repo, tmp_path, "--policy", "train/loss=exact")
    assert code == 1 and result["verdict"] == "diverged" and result["first_bad"] is None
    assert result["outcome"] == "ambiguous"
    assert set(result["candidates"]) == {commit_of(repo, n) for n in (2, 3, 4, 5)}
    verdicts = {t["commit"]: t["verdict"] for t in result["tested"]}
    assert verdicts == {commit_of(repo, 5): "diverged"} | {
        commit_of(repo, n): "skipped" for n in (2, 3, 4)
    }
    assert all(t["error"] for t in result["tested"] if t["verdict"] == "skipped")
    assert "only skipped commits left" in (tmp_path / "bisect.log").read_text()
    assert snapshot(repo) == before


def test_git_s_variables_of_a_hook_or_a_shell_leave_the_user_s_repository_alone(
    tmp_path, monkeypatch
):
    """Run from a pre-commit hook (GIT_INDEX_FILE: the index being committed) or a shell that
    sets GIT_DIR and GIT_WORK_TREE, bisect's git commands would check commits out and bisect in
    the user's repository and write that index. Neither happens, and the entry of a worktree of
    the user's whose folder is away (moved, a disk not mounted) is kept, its staged file too."""
    repo = make_repo(tmp_path / "repo")
    git(repo, "worktree", "add", "-q", "-b", "feature", str(tmp_path / "wt"), "HEAD~1")
    (tmp_path / "wt" / "new.txt").write_text("staged in the user's worktree\n")
    git(tmp_path / "wt", "add", "new.txt")
    (tmp_path / "wt").rename(tmp_path / "wt-away")
    hook_index = tmp_path / "index.lock"  # what git gives a pre-commit hook
    hook_index.write_bytes((repo / ".git" / "index").read_bytes())
    before, index = snapshot(repo), hook_index.read_bytes()
    fake_runs(monkeypatch)
    with monkeypatch.context() as m:
        m.setenv("GIT_DIR", str(repo / ".git"))
        m.setenv("GIT_WORK_TREE", str(repo))
        m.setenv("GIT_INDEX_FILE", str(hook_index))
        code, result = _bisect(repo, tmp_path / "out")
    assert code == 1 and result["first_bad"]["commit"] == commit_of(repo, 3), result
    assert snapshot(repo) == before and hook_index.read_bytes() == index
    (tmp_path / "wt-away").rename(tmp_path / "wt")
    assert git(tmp_path / "wt", "status", "--porcelain") == "A  new.txt\n"


def test_a_worktree_gone_under_a_linked_folder_leaves_no_entry(tmp_path):
    """The harness's worktree in a folder reached through a symlink (macOS's /var, a Slurm
    folder), removed before the harness could (a cleaner, a crash): its entry, which git keeps
    by the resolved path, is still found and removed, and the user's worktrees are kept."""
    import shutil

    from parity.git import worktree

    repo = make_repo(tmp_path / "repo")
    (tmp_path / "real").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    before = git(repo, "worktree", "list", "--porcelain")
    with worktree(repo, commit_of(repo, 2), tmp_path / "linked") as tree:
        assert len(git(repo, "worktree", "list", "--porcelain").split("\n\n")) == 3
        shutil.rmtree(tree)
    assert git(repo, "worktree", "list", "--porcelain") == before


def test_a_job_s_own_verdict_json_is_its_own(repo, tmp_path, monkeypatch):
    """A job that writes verdict.json into its run folder keeps it: each commit's verdict goes
    beside the run folder, in its launch folder."""
    fake_runs(monkeypatch)
    real = parity.bisect.run_in_tree

    def run_writing_verdict(spec, tree, run_dir, *args, **kwargs):
        real(spec, tree, run_dir, *args, **kwargs)
        (Path(run_dir) / "verdict.json").write_text('{"the job": "its own"}\n')

    monkeypatch.setattr(parity.bisect, "run_in_tree", run_writing_verdict)
    code, result = _bisect(repo, tmp_path)
    assert code == 1 and len(result["tested"]) == 3, result
    for tested in result["tested"]:
        run = Path(tested["run"])
        assert (run / "verdict.json").read_text() == '{"the job": "its own"}\n'
        mine = json.loads((run.parent / f"{run.name}.launch" / "verdict.json").read_text())
        assert mine["verdict"] == tested["verdict"] and mine["commit"] == tested["commit"]


def test_reading_options_are_checked_before_any_run(repo, tmp_path, monkeypatch):
    trees = fake_runs(monkeypatch)
    with pytest.raises(ValueError, match="read.duplicates = 'latest' is not valid"):
        bisect(repo / "spec.toml", "HEAD~4", "main", tmp_path, repo=repo,
               read={"duplicates": "latest"})  # fmt: skip
    with pytest.raises(ValueError, match="read.format = 'yaml' is not valid"):
        bisect(repo / "spec.toml", "HEAD~4", "main", tmp_path, repo=repo, read={"format": "yaml"})
    with pytest.raises(ValueError, match="unknown key 'fmt' in \\[read\\]"):
        bisect(repo / "spec.toml", "HEAD~4", "main", tmp_path, repo=repo, read={"fmt": "jsonl"})
    assert trees == []


@pytest.fixture(scope="module")
def found(repo, tmp_path_factory):
    before = snapshot(repo)
    out = tmp_path_factory.mktemp("bisect-out")
    start = time.monotonic()
    code, result = _bisect(repo, out)
    print(f"bisect of 5 commits: {time.monotonic() - start:.1f} s")
    return code, result, before, snapshot(repo), out


@pytest.mark.parity
def test_bisect_names_the_third_commit(found, repo):
    code, result, _, _, out = found
    assert code == 1 and (result["verdict"], result["outcome"]) == ("diverged", "found")
    first = result["first_bad"]
    assert first["commit"] == commit_of(repo, 3)
    assert first["subject"] == "third: nudge the loss by one ULP"
    assert first["metric"] == "train/loss" and first["step"] == 4
    assert first["policy"] == "exact@4-"  # the piece of the spec's step policy in force
    assert first["a_value"] == 0.25 and first["b_value"] == math.nextafter(0.25, math.inf)
    assert result["good"] == commit_of(repo, 1) and result["bad"] == commit_of(repo, 5)
    verdicts = {t["commit"]: t["verdict"] for t in result["tested"]}
    assert verdicts[commit_of(repo, 5)] == "diverged" and verdicts[commit_of(repo, 3)] == "diverged"
    assert verdicts[commit_of(repo, 2)] == "aligned" and commit_of(repo, 4) not in verdicts
    assert json.loads((out / "bisect.json").read_text()) == result
    assert (out / "good" / "metrics.jsonl").is_file() and (out / "bisect.log").is_file()


@pytest.mark.parity
def test_bisect_leaves_the_repository_as_it_was(found):
    _, _, before, after, _ = found
    assert after == before
    assert "bad" in before["bisect"]  # the user's own bisection is still there
    assert len(before["worktrees"].strip().split("\n\n")) == 1


@pytest.mark.parity
def test_policy_flag_overrides_the_spec_and_aligns(repo, tmp_path):
    """ulp:1 from step 4 on tolerates the nudge: bad is aligned with good, nothing to bisect."""
    before = snapshot(repo)
    code, result = _bisect(repo, tmp_path, "--policy", "train/loss=exact@-3,ulp:1@4-")
    assert code == 0 and result["verdict"] == "aligned" and result["first_bad"] is None
    assert snapshot(repo) == before


def test_bad_input(repo, tmp_path, monkeypatch, capsys):
    before = snapshot(repo)
    monkeypatch.chdir(repo)
    base = ["bisect", "--spec", "spec.toml", "--out", str(tmp_path)]
    assert main([*base, "--good", "main", "--bad", "HEAD~2"]) == 2
    assert "not an ancestor" in capsys.readouterr().err
    assert main([*base, "--good", "nope", "--bad", "main"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main([*base, "--good", "HEAD~1", "--bad", "main", "--policy", "x=ulp:1@3-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ulp:1@3-2" in err
    assert snapshot(repo) == before


def test_interrupt_during_bisection_cleans_up(repo, tmp_path, monkeypatch):
    """No launches: fake runs, then Ctrl-C while a commit of the bisection is being tested."""
    before = snapshot(repo)
    trees = fake_runs(monkeypatch)
    real = parity.bisect.run_in_tree

    def interrupted(spec, tree, run_dir, *args, **kwargs):
        if len(trees) == 2:  # the reference and the bad commit ran: now the bisection's first
            assert git(tree, "bisect", "log").count("# bad:") == 1  # bisecting in the worktree
            raise KeyboardInterrupt
        return real(spec, tree, run_dir, *args, **kwargs)

    monkeypatch.setattr(parity.bisect, "run_in_tree", interrupted)
    monkeypatch.chdir(repo)
    with pytest.raises(KeyboardInterrupt):
        main(["bisect", "--good", "HEAD~4", "--bad", "main", "--spec", "spec.toml",
              "--out", str(tmp_path)])  # fmt: skip
    assert len(trees) == 2 and not any(t.exists() for t in trees)
    assert snapshot(repo) == before
    assert not list(tmp_path.glob("bisect.*"))  # nothing claims a bisection that did not end


@pytest.mark.parity
def test_sigint_of_the_command_stops_everything(repo, tmp_path, interruptible):
    """A real Ctrl-C (SIGINT to the parity process) while git bisect run tests a commit."""
    before = snapshot(repo)
    cmd = [sys.executable, "-m", "parity.cli", "bisect", "--good", "HEAD~4", "--bad", "main",
           "--spec", "spec.toml", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=interruptible)  # fmt: skip
    try:  # the bad commit's check is the first launch, a step of git bisect run the second
        deadline = time.monotonic() + 120
        while len(launcher_logs(tmp_path / "commits")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (-signal.SIGINT, 130), proc.stderr.read()
    assert snapshot(repo) == before


def test_text_names_the_culprit_and_what_was_tested():
    culprit = parity.bisect.TestedCommit(
        "c" * 40, "third", "diverged", "train/loss", 4, "exact@4-", 0.25, 0.25000000000000006
    )
    good = parity.bisect.TestedCommit("a" * 40, "second", "aligned")
    text = parity.bisect.BisectResult(
        "found", "g" * 40, "b" * 40, Path("out"), culprit, tested=[culprit, good]
    ).text()
    assert f"first bad commit: {'c' * 40} third" in text
    assert "train/loss at step 4 (policy exact@4-)" in text and "aligned " in text


def test_the_verdict_line_says_a_word_of_the_verdicts_table():
    """`parity bisect` ends on `verdict: WORD`: a verdict of the table (README, docs/verdicts.md)
    for its exit code (1 diverged, 0 aligned), then what it found; never `found`."""
    from parity.cli import EXIT_ALIGNED, EXIT_DIVERGED

    table = _verdicts_table()
    culprit = parity.bisect.TestedCommit("c" * 40, "third", "diverged")
    results = {
        "found": parity.bisect.BisectResult("found", "g" * 40, "b" * 40, Path("o"), culprit),
        "ambiguous": parity.bisect.BisectResult(
            "ambiguous", "g" * 40, "b" * 40, Path("o"), candidates=["c" * 40, "d" * 40]
        ),
        "aligned": parity.bisect.BisectResult("aligned", "g" * 40, "b" * 40, Path("o")),
    }
    lines = {outcome: r.verdict_line() for outcome, r in results.items()}
    assert (
        lines["found"]
        == f"verdict: diverged  (first bad commit {'c' * 12}; runs and bisect.json in o)"
    )
    assert lines["ambiguous"].startswith("verdict: diverged  (first bad commit one of 2 candidates")
    assert lines["aligned"] == "verdict: aligned  (runs and bisect.json in o)"
    for outcome, r in results.items():
        word = lines[outcome].split()[1]
        code = EXIT_ALIGNED if r.verdict == "aligned" else EXIT_DIVERGED  # cmd_bisect's rule
        assert table[word] == code and r.to_dict()["verdict"] == word
        assert r.to_dict()["outcome"] == outcome


def _verdicts_table() -> dict[str, int]:
    """verdict -> exit code, from README.md's "Verdicts and exit codes" and docs/verdicts.md."""
    root = Path(__file__).resolve().parents[2]
    rows: dict[str, int] = {}
    for doc in (root / "README.md", root / "docs" / "verdicts.md"):
        for code, word in re.findall(r"^\| (\d+) \| ([a-z ]+) \|", doc.read_text(), re.M):
            assert rows.setdefault(word, int(code)) == int(code), (doc, word)
    return rows
