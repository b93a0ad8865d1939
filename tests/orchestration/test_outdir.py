"""Output folders (parity.outdir): the harness removes or replaces only what it made; anything
of the user's in the way is refused in one line and left as it was; one command per folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.cli import main
from parity.outdir import OutDir, OutputError
from tests.orchestration.history import git

ROOT = Path(__file__).resolve().parents[2]
COMPLETE = '{"step": 1, "a": 1.0}\n{"event": "end", "steps": 1}\n'


def test_the_users_folder_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.yaml").write_text("mine\n")
    with OutDir.open(tmp_path) as held, pytest.raises(OutputError, match="did not make"):
        held.claim("base")
    assert (tmp_path / "base" / "config.yaml").read_text() == "mine\n"


def test_what_it_made_is_made_fresh_next_time(tmp_path: Path) -> None:
    with OutDir.open(tmp_path) as held:
        run = held.make_dir("a")
        (run / "ranks").mkdir()
        (run / "ranks" / "rank1.jsonl").write_text("{}\n")  # a world-2 run's file
    with OutDir.open(tmp_path) as held:
        assert held.made_here("a")
        assert not any(held.make_dir("a").iterdir())  # nothing of the earlier run is left


def test_a_folder_replaced_by_the_user_is_not_ours(tmp_path: Path) -> None:
    """The record holds the inode the harness made: a folder of the same name made since is
    the user's."""
    with OutDir.open(tmp_path) as held:
        held.make_dir("a")
    os.rename(tmp_path / "a", tmp_path / "moved")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    with OutDir.open(tmp_path) as held, pytest.raises(OutputError, match="did not make"):
        held.claim("a")
    assert (tmp_path / "a" / "notes.txt").exists()


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "head").symlink_to(outside)
    with OutDir.open(out) as held, pytest.raises(OutputError, match="symlink"):
        held.claim("head")
    assert (outside / "keep.txt").read_text() == "mine"
    assert (out / "head").is_symlink()


def test_a_symlink_inside_a_folder_it_made_is_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    with OutDir.open(tmp_path / "out") as held:
        (held.make_dir("a") / "link").symlink_to(outside)
        held.claim("a")
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_file_is_no_output_folder(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        OutDir.open(tmp_path / "f")


def test_nested_opens_share_the_lock(tmp_path: Path) -> None:
    with OutDir.open(tmp_path) as outer, OutDir.open(tmp_path) as inner:
        assert outer is inner
    with OutDir.open(tmp_path):  # released
        pass


HOLD = """
import sys, time
from parity.outdir import OutDir
with OutDir.open(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def held_elsewhere(tmp_path: Path):
    """``tmp_path/out`` held by another process (as a running `parity pair` holds it)."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield out, proc.pid
    proc.kill()
    proc.wait()


def test_a_second_command_on_a_held_folder_is_refused(held_elsewhere, capsys) -> None:
    out, pid = held_elsewhere
    code = main(
        ["pair", "--task", "charcount-sft", "--world", "1", "--steps", "1", "--out", str(out)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert f"in use by pid {pid}" in err[0]


def test_check_out_dot_keeps_the_repositorys_tracked_base(tmp_path: Path, capsys) -> None:
    """`parity check --out .` at a repository's root whose base/ is tracked: refused before
    anything runs, exit 2, the file and git status as they were."""
    repo = tmp_path / "repo"
    (repo / "base").mkdir(parents=True)
    (repo / "base" / "config.yaml").write_text("lr: 1\n")
    (repo / "job.toml").write_text('task = "custom"\ncommand = ["train.py", "{out}"]\n')
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "one")
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        code = main(["check", "--base", "HEAD", "--spec", "job.toml", "--out", "."])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2 and "base: a folder parity did not make is in the way" in err
    assert (repo / "base" / "config.yaml").read_text() == "lr: 1\n"
    status = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
    )
    assert status.stdout.splitlines() == ["?? .parity-out/"]


def test_pair_and_report_into_a_file_are_bad_input(tmp_path: Path, capsys) -> None:
    target = tmp_path / "file"
    target.write_text("mine")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(COMPLETE)
    for argv in (
        ["pair", "--task", "charcount-sft", "--world", "1", "--steps", "1", "--out", str(target)],
        ["report", str(metrics), str(metrics), "-o", str(target)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a folder" in err[0], err
    assert target.read_text() == "mine"


def test_report_does_not_overwrite_the_users_report(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(COMPLETE)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").write_text("my notes")
    assert main(["report", str(metrics), str(metrics), "-o", str(tmp_path / "out")]) == 2
    assert "report.md: a file parity did not make" in capsys.readouterr().err
    assert (tmp_path / "out" / "report.md").read_text() == "my notes"
    assert main(["report", str(metrics), str(metrics), "-o", str(tmp_path / "new")]) == 0
    assert main(["report", str(metrics), str(metrics), "-o", str(tmp_path / "new")]) == 0


WRITER = """\
import os, sys
out = sys.argv[1]
if sys.argv[2:] != ["nothing"]:
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 1.0}\\n{"event": "end", "steps": 1}\\n')
"""


@pytest.mark.parity
def test_a_rerun_into_the_same_out_is_judged_on_its_own_files(tmp_path: Path, capsys) -> None:
    """The second pair's side b writes nothing: failed (exit 3) with the reason, not judged
    aligned on the first pair's metrics.jsonl, which is gone with its folder."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    spec = tmp_path / "pair.toml"
    spec.write_text(f'task = "custom"\ncommand = ["{script}", "{{out}}"]\n')
    out = tmp_path / "out"
    assert main(["pair", "--spec", str(spec), "--out", str(out)]) == 0
    spec.write_text(spec.read_text() + f'[b]\ncommand = ["{script}", "{{out}}", "nothing"]\n')
    capsys.readouterr()
    assert main(["pair", "--spec", str(spec), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "side b: the job exited 0 but wrote nothing in" in err, err
    assert not (out / "b" / "metrics.jsonl").exists()
