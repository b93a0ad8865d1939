"""Output folders (parity.outdir): the harness only adds new entries; anything already there,
an earlier run's, the user's, a symlink, is refused in one line and left as it was; one command
per folder."""

from __future__ import annotations

import json
import os
import signal
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
    with OutDir.open(tmp_path) as held, pytest.raises(OutputError, match="already there"):
        held.claim("base")
    assert (tmp_path / "base" / "config.yaml").read_text() == "mine\n"


def test_what_it_made_is_never_removed(tmp_path: Path) -> None:
    """A second command needing a name an earlier one made is refused: the earlier run's files
    stay, and none of them can be read as the new run's."""
    with OutDir.open(tmp_path) as held:
        run = held.make_dir("a")
        (run / "ranks").mkdir()
        (run / "ranks" / "rank1.jsonl").write_text("{}\n")  # a world-2 run's file
    with OutDir.open(tmp_path) as held:
        with pytest.raises(OutputError, match="a: a folder is already there"):
            held.make_dir("a")
        with pytest.raises(OutputError, match="already there"):
            held.make_dir("a")  # not taken for this command's own by the failed claim either
    assert (run / "ranks" / "rank1.jsonl").read_text() == "{}\n"


def test_an_empty_folder_is_taken_as_it_is(tmp_path: Path) -> None:
    """An empty folder has nothing to lose (`run_job(spec, tmp_path)`); one with anything in it,
    a symlink to an empty folder too, is refused."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with OutDir.open(tmp_path) as held:
        assert held.make_dir("a") == tmp_path / "a"
        (tmp_path / "a" / "x").write_text("the job's")
        with pytest.raises(OutputError, match="already there"):
            held.make_dir("a")  # once written in, never taken again
        with pytest.raises(OutputError, match="b: a symlink is already there"):
            held.make_dir("b")


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "head").symlink_to(outside)
    (out / "dangling").symlink_to(tmp_path / "nowhere")
    with OutDir.open(out) as held:
        for name in ("head", "dangling"):
            with pytest.raises(OutputError, match="symlink"):
                held.make_dir(name)
    assert (outside / "keep.txt").read_text() == "mine"
    assert (out / "head").is_symlink() and (out / "dangling").is_symlink()
    assert not (tmp_path / "nowhere").exists()


def test_nothing_recorded_can_make_it_delete(tmp_path: Path) -> None:
    """The ledger the harness once kept (OUT/.parity-out/made.json), forged with the inode of
    the user's folder, or left by an older version: read by nothing, the folder stays."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    st = os.lstat(tmp_path / "a")
    (tmp_path / ".parity-out").mkdir()
    ledger = {"a": {"dev": st.st_dev, "ino": st.st_ino}, "b": {"pending": True}}
    (tmp_path / ".parity-out" / "made.json").write_text(json.dumps(ledger))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine too")
    with OutDir.open(tmp_path) as held:
        for name in ("a", "b"):
            with pytest.raises(OutputError, match="already there"):
                held.claim(name)
    assert (tmp_path / "a" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine too"
    assert json.loads((tmp_path / ".parity-out" / "made.json").read_text()) == ledger


def test_a_fresh_folder_takes_the_first_free_name(tmp_path: Path) -> None:
    (tmp_path / "pools").mkdir()
    (tmp_path / "pools" / "x").write_text("an earlier session's")
    (tmp_path / "pools-2").symlink_to(tmp_path / "nowhere")
    with OutDir.open(tmp_path) as held:
        assert held.fresh_dir("pools") == tmp_path / "pools-3"
    assert (tmp_path / "pools" / "x").read_text() == "an earlier session's"


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
    anything runs, exit 2, the file and git status as they were; a committed ledger of an older
    version naming base/ by its inode changes nothing."""
    repo = tmp_path / "repo"
    (repo / "base").mkdir(parents=True)
    (repo / "base" / "config.yaml").write_text("lr: 1\n")
    (repo / "job.toml").write_text('task = "custom"\ncommand = ["train.py", "{out}"]\n')
    st = os.lstat(repo / "base")
    (repo / ".parity-out").mkdir()
    ledger = json.dumps({"base": {"dev": st.st_dev, "ino": st.st_ino}})
    (repo / ".parity-out" / "made.json").write_text(ledger)
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
    assert (repo / "base" / "config.yaml").read_text() == "lr: 1\n"
    assert code == 2 and "base: a folder is already there" in err
    status = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
    )
    assert status.stdout.splitlines() == ["?? .parity-out/lock"]


def test_check_golden_refuses_the_users_report_before_the_run(tmp_path: Path, capsys) -> None:
    """`parity check --golden G --out OUT` where OUT/report.md is the user's: refused before the
    job runs (no OUT/current left to block the next try), the file kept."""
    ran = tmp_path / "ran"
    script = tmp_path / "job.py"
    script.write_text(f"import pathlib, sys\npathlib.Path({str(ran)!r}).write_text('x')\n")
    spec = tmp_path / "job.toml"
    spec.write_text(f'task = "custom"\ndistributed = false\ncommand = ["{script}", "{{out}}"]\n')
    golden = tmp_path / "golden.jsonl"
    golden.write_text(COMPLETE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["check", "--golden", str(golden), "--spec", str(spec), "--out", str(out)])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "report.md" in err[0], err
    assert (out / "report.md").read_text() == "my notes\n"
    assert not ran.exists() and not (out / "current").exists()


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
    assert "report.md: a file is already there" in capsys.readouterr().err
    assert (tmp_path / "out" / "report.md").read_text() == "my notes"
    assert main(["report", str(metrics), str(metrics), "-o", str(tmp_path / "new")]) == 0


def test_a_report_the_user_edited_or_rewrote_is_kept(tmp_path: Path, capsys) -> None:
    """The user's notes in the report it wrote (same inode), or their own summary.md put where
    its own was deleted (on ext4 often under the freed inode number): the next command is
    refused, in one line, and both files stay as the user left them."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(COMPLETE)
    out = tmp_path / "out"
    assert main(["report", str(metrics), str(metrics), "-o", str(out)]) == 0
    with open(out / "report.md", "a") as f:  # edited in place: the inode the harness made
        f.write("my notes\n")
    kept = (out / "report.md").read_text()
    capsys.readouterr()
    code = main(["report", str(metrics), str(metrics), "-o", str(out)])
    assert (out / "report.md").read_text() == kept and kept.endswith("my notes\n")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "report.html: a file is already there" in err[0], err
    (out / "report.html").unlink()
    (out / "report.html").write_text("mine")  # may well take the freed inode number
    assert main(["report", str(metrics), str(metrics), "-o", str(out)]) == 2
    assert (out / "report.html").read_text() == "mine"
    assert (out / "report.md").read_text() == kept


def test_a_file_the_user_puts_under_a_claimed_name_meanwhile_is_kept(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A name found free when the command started, then taken by the user while it runs (here:
    while the report is drawn): the write is refused in one line, never a replace of their file."""
    from parity.report import Report

    metrics = tmp_path / "m.jsonl"
    metrics.write_text(COMPLETE)
    out = tmp_path / "out"
    markdown = Report.markdown

    def users_file_meanwhile(self: Report) -> str:
        (out / "report.md").write_text("mine\n")
        return markdown(self)

    monkeypatch.setattr(Report, "markdown", users_file_meanwhile)
    assert main(["report", str(metrics), str(metrics), "-o", str(out)]) == 2
    assert "report.md: a file is already there" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "mine\n"


def test_what_this_command_wrote_it_may_write_again(tmp_path: Path) -> None:
    from parity.outdir import write_new

    with OutDir.open(tmp_path) as held:
        held.claim("summary.md")
        write_new(tmp_path / "summary.md", "one\n")
        write_new(tmp_path / "summary.md", "two\n")
    assert (tmp_path / "summary.md").read_text() == "two\n"
    assert [p.name for p in tmp_path.iterdir() if p.name != ".parity-out"] == ["summary.md"]


def test_without_hard_links_the_name_is_still_never_taken_over(tmp_path: Path, monkeypatch) -> None:
    """A file system without hard links (FAT, some network mounts): written all the same, and a
    name the user took meanwhile is still refused, their file kept."""
    from parity.outdir import write_new

    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with OutDir.open(tmp_path) as held:
        held.claim("report.md", "summary.md")
        write_new(tmp_path / "report.md", "ours\n")
        write_new(tmp_path / "report.md", "ours again\n")
        (tmp_path / "summary.md").write_text("mine\n")
        with pytest.raises(OutputError, match="summary.md: a file is already there"):
            write_new(tmp_path / "summary.md", "ours\n")
    assert (tmp_path / "report.md").read_text() == "ours again\n"
    assert (tmp_path / "summary.md").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".parity-out", "report.md", "summary.md"]


def test_a_bare_or_dotted_file_name_reports(tmp_path: Path, monkeypatch, capsys) -> None:
    """`parity report a.jsonl b.jsonl -o rep` (or ./a.jsonl): the files' folder is ".", whose
    launch folder is named by its path, not an internal error."""
    monkeypatch.chdir(tmp_path)
    Path("a.jsonl").write_text(COMPLETE)
    Path("b.jsonl").write_text(COMPLETE)
    assert main(["report", "a.jsonl", "b.jsonl", "-o", "rep"]) == 0
    assert main(["report", "./a.jsonl", "./b.jsonl", "-o", "rep2"]) == 0
    assert main(["compare", "./a.jsonl", "b.jsonl"]) == 0
    assert "aligned" in Path("rep/report.md").read_text()
    assert (tmp_path / "rep2" / "report.html").is_file()


WRITER = """\
import os, sys
out = sys.argv[1]
if sys.argv[2:] != ["nothing"]:
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 1.0}\\n{"event": "end", "steps": 1}\\n')
"""


def _plain_pair(tmp_path: Path) -> Path:
    """A pair spec of one plain process per side (no torchrun): a second or so a pair."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    spec = tmp_path / "pair.toml"
    spec.write_text(f'task = "custom"\ndistributed = false\ncommand = ["{script}", "{{out}}"]\n')
    return spec


def test_a_rerun_into_the_same_out_is_refused_and_nothing_is_lost(tmp_path: Path, capsys) -> None:
    """After a clean pair the user puts folders where the pair could have written (the in-process
    launch, the op-trace reruns, a Slurm allocation) and edits its summary: the next pair into
    the same --out is refused before anything runs, one line, exit 2, and every file stays: the
    first pair's metrics too, so none of them can be judged as the second pair's."""
    spec = _plain_pair(tmp_path)
    out = tmp_path / "out"
    assert main(["pair", "--spec", str(spec), "--out", str(out)]) == 0
    mine = {
        "in-process/notes.txt": "mine 1",
        "trace-a/notes.txt": "mine 2",
        "allocation/notes.txt": "mine 3",
        "a-repeat.launch/notes.txt": "mine 4",
    }
    for name, text in mine.items():
        (out / name).parent.mkdir()
        (out / name).write_text(text)
    (out / "summary.md").write_text("my summary")
    ours = (out / "a" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["pair", "--spec", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already there" in err[0] and "choose another --out" in err[0]
    assert all((out / name).read_text() == text for name, text in mine.items())
    assert (out / "summary.md").read_text() == "my summary"
    assert (out / "a" / "metrics.jsonl").read_text() == ours


KILLED = """
import os, signal, sys
from parity.outdir import OutDir
from parity.pair import PAIR_ENTRIES
held = OutDir.open(sys.argv[1])
held.claim(*PAIR_ENTRIES)
held.make_dir("a")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_names_a_killed_command_claimed_are_not_its_own(tmp_path: Path) -> None:
    """A pair SIGKILLed after claiming its names, before making most of them: a folder the user
    then puts under one of those names is refused by the next command, never deleted."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILLED, str(out)], cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    (out / "in-process").mkdir()
    (out / "in-process" / "notes.txt").write_text("mine")
    with OutDir.open(out) as held:
        with pytest.raises(OutputError, match="in-process: a folder is already there"):
            held.claim("in-process")
        assert held.make_dir("b").is_dir()  # a name nothing took is free
    assert (out / "in-process" / "notes.txt").read_text() == "mine"
