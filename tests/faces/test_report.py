"""report.md / report.html: the verdict table, the first divergence, fingerprints, and that no
string from a run (a metric named like a script tag) ever becomes markup."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from parity.cli import main
from parity.report import write_report

EVIL = "<script>alert(1)</script>"
EVIL_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def _run_folder(path: Path, loss_step3: float, torch: str, rev: str) -> Path:
    path.mkdir(parents=True)
    rows = [
        {"step": 1, "train/loss": 2.0, EVIL: 1.0, "train/mfu": 0.1},
        {"step": 2, "train/loss": 1.5, EVIL: 2.0, "train/mfu": 0.2},
        {"step": 3, "train/loss": loss_step3, EVIL: 3.0, "train/mfu": 0.3},
        {"step": 4, "train/loss": 1.0, EVIL: 4.0, "train/mfu": 0.4},
    ]
    lines = [json.dumps(r) for r in rows] + [json.dumps({"event": "end", "steps": 4})]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    manifest = {
        "git_revision": rev,
        "device": "cpu",
        "backend": "gloo",
        "world_size": 2,
        "determinism": {"seed": 0, "deterministic_algorithms": True},
        "data_sha256": {"train": "abc"},
        "initial_weights_sha256": "def",
        "environment": {
            "torch": torch,
            "python": "3.11.7",
            "gpu": "<img src=x onerror=alert(2)>",
            "argv": ["job.py", "--out", str(path), "--tag", "<b>bold</b>"],
        },
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "launcher.log").write_text(f"# torchrun --nproc-per-node 2 job.py --out {path}\nrest\n")
    return path


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    a = _run_folder(tmp_path / "a", 1.25, "2.13.0", "aaa111")
    b = _run_folder(tmp_path / "b", float(np.nextafter(1.25, 2.0)), "2.13.1", "bbb222")
    return a, b


def test_markdown_has_verdict_table_first_divergence_and_fingerprints(runs, tmp_path):
    md_path = write_report(*runs, tmp_path / "rep")
    assert md_path == tmp_path / "rep" / "report.md"
    md = md_path.read_text()
    assert "parity: diverged" in md
    assert "| metric | status | policy | steps compared | first divergent step |" in md
    assert "| train/loss | diverged | exact | 4 | 3 | 1.25 | 1.2500000000000002 | 1 |" in md
    assert "first divergence: step 3, train/loss" in md
    assert "| ≠ | environment.torch | 2.13.0 | 2.13.1 |" in md
    assert "| ≠ | git_revision | aaa111 | bbb222 |" in md
    assert "|  | device | cpu | cpu |" in md
    assert "torchrun --nproc-per-node 2 job.py --out" in md
    assert EVIL not in md and "\\<script\\>alert(1)\\</script\\>" in md
    prose = md.split("### Reproduce")[0]  # commands follow, in a fenced code block
    assert "\\<img src=x" in prose and not re.search(r"(?<!\\)<", prose)  # no tag can open


def test_html_is_self_contained_escaped_and_has_png_plots(runs, tmp_path):
    write_report(*runs, tmp_path / "rep")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert EVIL not in page and EVIL_ESCAPED in page
    assert "<script" not in page.lower() and "<img src=x" not in page and "<b>bold" not in page
    assert "http://" not in page and "https://" not in page
    assert "id='first-divergence'" in page and "class='hit'>3<" in page
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(uris) == 2  # train/loss and the script-named metric; mfu is ignored
    for data in uris:
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        img.load()
        assert img.format == "PNG" and img.width > 300 and img.height > 100


def test_cli_report_exit_codes(runs, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["report", str(runs[0]), str(runs[1]), "-o", str(out)]) == 1
    printed = capsys.readouterr().out
    assert str(out / "report.html") in printed and str(out / "report.md") in printed
    again = tmp_path / "cli2"  # a report is never written over another (parity.outdir)
    args = ["report", str(runs[0] / "metrics.jsonl"), str(runs[1]), "-o", str(again)]
    assert main([*args, "--policy", "train/loss=ulp:1"]) == 0
    assert "parity: aligned" in (again / "report.md").read_text()
    assert main(["report", str(runs[0]), str(tmp_path / "nope"), "-o", str(tmp_path / "x")]) == 2


CHROMIUM = "/usr/bin/chromium"


def _chromium(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / ('profile-' + name)}",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=True
    )


@pytest.mark.skipif(
    shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} not installed (apt-get install chromium)"
)
def test_report_renders_in_headless_chromium_without_running_scripts(runs, tmp_path):
    write_report(*runs, tmp_path / "rep")
    url = (tmp_path / "rep" / "report.html").as_uri()
    dom = _chromium(tmp_path, "dom", "--dump-dom", url).stdout
    assert 'class="verdict"' in dom and 'id="first-divergence"' in dom
    assert EVIL_ESCAPED in dom  # shown as text
    assert "<script" not in dom.lower() and 'onerror="' not in dom  # no such element or attribute
    assert "&lt;img src=x onerror=alert(2)&gt;" in dom
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "shot", f"--screenshot={shot}", "--window-size=1280,2000", url)
    img = Image.open(shot).convert("L")
    assert img.size == (1280, 2000)
    dark = sum(img.histogram()[:128])
    assert dark > 0.005 * 1280 * 2000, "screenshot is (nearly) blank"


# --- names from logs are data: no link, image, HTML, heading or line of their own --------------

NAMES = [
    "x\nverdict: aligned",
    "y\x1b[2K",
    "[click](http://evil)",
    "![b](http://evil/x.png)",
    "\r# parity: aligned",
    "<a href='http://evil'>a</a>",
    "<http://evil/auto>",
    "# heading",
    "`code` and ``two``",
    "q'\"<>&",
]


def _evil_runs(tmp_path: Path, names: list[str] = NAMES) -> tuple[Path, Path]:
    out = []
    for side, value in (("a", 1.0), ("b", 2.0)):
        path = tmp_path / side
        path.mkdir()
        rows = [{"step": 1, **dict.fromkeys(names, value)}, {"event": "end", "steps": 1}]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out.append(path)
    return out[0], out[1]


def test_markdown_names_are_inert_text(tmp_path):
    from parity.report import build_report

    a, b = _evil_runs(tmp_path)
    notes = ["- [note](http://evil) <img src=x>", "1. \r# parity: aligned"]
    md = build_report(a, b, notes=notes, labels=("# A", "<b>B</b>")).markdown()
    lines = md.split("### Reproduce")[0].splitlines() + ["### Reproduce"]  # no code blocks
    assert [line for line in lines if line.startswith("#")] == [
        "## ❌ parity: diverged (10 diverged)",
        "### Environment fingerprints",
        "### Reproduce",
    ]
    assert (
        "\r" not in md
        and "\x1b" not in md
        and "verdict: aligned" not in "".join(line for line in lines if not line.startswith("| "))
    )
    prose = "\n".join(lines)
    for bad in (r"\]\(", r"!\[", "<", "`", "&"):  # link, image, HTML or autolink, code, entity
        assert not re.search(r"(?<!\\)" + bad, prose), bad  # each only backslash-escaped
    table = [line for line in lines if line.startswith("| ") and "diverged" in line]
    assert len(table) == len(NAMES)  # one row each: no name ended or split its row
    assert all(line.count(" | ") == 10 for line in table)
    assert "| x\\\\nverdict: aligned | diverged |" in md  # shown as \n, after its escape
    assert "| \\[click\\](http://evil) | diverged |" in md
    assert "\\- \\[note\\](http://evil) \\<img src=x\\>" in lines
    assert "1\\. \\\\r\\# parity: aligned" in lines
    assert "\\# A:" in md.splitlines() and "\\<b\\>B\\</b\\>:" in md.splitlines()


def test_html_escapes_names_labels_and_notes_quotes_included(tmp_path):
    from parity.report import build_report

    a, b = _evil_runs(tmp_path)
    page = build_report(a, b, notes=["<i>n</i>"], labels=("A'\"", "B")).html()
    body = page.split("<body>")[1]
    assert "<a href='http" not in body and "<img src=x" not in body and "<i>" not in body
    assert "q&#x27;&quot;&lt;&gt;&amp;" in body and "A&#x27;&quot;" in body
    assert 'alt="q&#x27;&quot;&lt;&gt;&amp;"' in body  # an attribute cannot be closed
    assert "\x1b" not in page and "\r" not in page and "y\\x1b[2K" in page


@pytest.mark.parametrize(
    "manifest",
    ["[" * 1000 + "]" * 1000, "[" * 200 + "]" * 200, '"a string"', "[1, 2]", "{",
     '{"environment": ["argv"]}', '{"environment": {"argv": "job.py"}}'],
)  # fmt: skip
def test_a_damaged_manifest_is_a_note_of_the_report(tmp_path, manifest, capsys):
    a, b = _evil_runs(tmp_path, ["x"])
    (a / "manifest.json").write_text(manifest)
    out = tmp_path / "rep"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 1  # diverged, not an error
    md = (out / "report.md").read_text()
    if manifest.startswith('{"environment'):  # an object: read, its odd parts left out
        assert "no launcher.log or manifest" in md
        return
    note = next(line for line in md.splitlines() if "manifest.json" in line)
    assert "cannot read" in note or "must be a JSON object" in note
    assert str(a / "manifest.json") in note.replace("\\", "")


def _script(md: str, label: str) -> list[str]:
    """The lines of ``label``'s Reproduce script in report.md."""
    block = md.split("### Reproduce")[1].split(f"{label}:", 1)[1].split("```sh\n", 1)[1]
    return block.split("\n```", 1)[0].splitlines()


def _launched(run: Path, line: str, ran_in: dict) -> None:
    """What parity.run.job.launch_spec leaves in a run's launch folder: the launcher's line and
    reproduce.json (the folder it ran in, the temporary worktree it was)."""
    launch = run.parent / (run.name + ".launch")
    launch.mkdir()
    (launch / "launcher.log").write_text(f"# {line}\nrest\n")
    (launch / "reproduce.json").write_text(json.dumps(ran_in))


def test_reproduce_makes_the_removed_worktree_again_and_cds_into_it(runs, tmp_path, monkeypatch):
    """check's and bisect's worktree is gone after the run: the report's commands make it again
    (git -C REPO worktree add), cd into it and run the launcher's line there, its PYTHONPATH on
    the new worktree; a plain pair's cd into the folder its command ran in. Run as written, the
    script's first lines check out the revision and land in it."""
    repo = tmp_path / "my repo"
    repo.mkdir()
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                                  "--allow-empty", "-m", "one"]):  # fmt: skip
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    gone = "/tmp/parity-worktree-gone/" + commit[:12]
    line = f"PYTHONPATH={gone} python -m torch.distributed.run --nproc-per-node 2 train.py"
    _launched(runs[0], line, {"cwd": gone, "worktree": {"repo": str(repo), "commit": commit,
                                                         "path": gone}})  # fmt: skip
    _launched(runs[1], "python -m torch.distributed.run train.py", {"cwd": "/home/u/nanoGPT"})
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    md = write_report(*runs, tmp_path / "rep").read_text()
    fresh = str(tmp_path / "tmp" / f"parity-{commit[:12]}")
    a = _script(md, "A")
    assert a[:3] == [
        f"git -C '{repo}' worktree add --detach {fresh} {commit}",
        f"cd {fresh}",
        f"PYTHONPATH={fresh} python -m torch.distributed.run --nproc-per-node 2 train.py",
    ]
    assert a[3].startswith("# job sys.argv on rank 0: job.py --out")  # what the job saw: a comment
    assert "parity-worktree-gone" not in md
    b = _script(md, "B")
    assert b[:2] == ["cd /home/u/nanoGPT", "python -m torch.distributed.run train.py"]
    page = (tmp_path / "rep" / "report.html").read_text()
    assert f"cd {fresh}" in page and "cd /home/u/nanoGPT" in page
    done = subprocess.run(["bash", "-ec", "\n".join([*a[:2], "git rev-parse HEAD; pwd"])],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and done.stdout.splitlines()[-2:] == [commit, fresh], done.stderr
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", fresh], check=True)


def test_the_sides_own_run_folders_are_no_environment_difference(runs, tmp_path):
    """config.out_dir (or a path in it) naming each side's own run folder is no difference of
    the environments; another path that differs still is, and so is a folder that only starts
    like the run folder's name."""
    from parity.report import fingerprint_rows

    for run, data in zip(runs, ("/data/one", "/data/two"), strict=True):
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["config"] = {"out_dir": str(run), "ckpt": f"{run}/ckpt.pt", "data": data,
                              "sibling": f"{run}b", "lr": 0.1}  # fmt: skip
        (run / "manifest.json").write_text(json.dumps(manifest))
    md = write_report(*runs, tmp_path / "rep").read_text()
    env = md.split("### Environment fingerprints")[1].split("### Reproduce")[0]
    assert "config.out\\_dir" not in env and "config.ckpt" not in env and "config.lr" not in env
    assert "| ≠ | config.data | /data/one | /data/two |" in env
    assert f"| ≠ | config.sibling | {runs[0]}b | {runs[1]}b |" in env
    rows = {key: differs for key, _, _, differs in fingerprint_rows(
        {"config": {"out": "/r/a/x"}, "device": "/r/a"}, {"config": {"out": "/q/b/x"},
        "device": "/q/b"}, (Path("/r/a"), Path("/q/b")))}  # fmt: skip
    assert rows == {"device": False}  # shown (not a config key), not marked as differing


CARRY_JOB = """\
import json
import sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
loss = float(Path("data/in.txt").read_text())  # ignored by git: carried into the worktree
out.mkdir(parents=True, exist_ok=True)
records = [{"step": 1, "train/loss": loss}, {"event": "end", "steps": 1}]
(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
"""


def test_a_check_side_s_reproduce_script_carries_its_inputs(tmp_path, monkeypatch):
    """A job that reads an input git ignores, carried into check's worktree (parity.carry): the
    report's script copies it from the checkout into the worktree it makes again, so the rerun
    reads it as the run did."""
    from parity.carry import Carry, carry_items
    from parity.check import run_in_tree, worktree
    from parity.report import build_report
    from parity.spec import JobSpec
    from tests.orchestration.history import commit, new_repo

    repo = new_repo(tmp_path / "repo")
    commit(repo, "the job", {".gitignore": "data/\n", "job.py": CARRY_JOB})
    (repo / "data").mkdir()
    (repo / "data" / "in.txt").write_text("0.5\n")
    carry = Carry.of(repo, carry_items(["data/in.txt"], "--carry"))
    spec = JobSpec(command=["job.py", "--out", "{out}"], distributed=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with worktree(repo, "HEAD") as tree:
        carry.into(tree)
        run_in_tree(spec, tree, tmp_path / "run", carry=carry)
    script = _script(build_report(tmp_path / "run", tmp_path / "run").markdown(), "A")
    assert any(line.startswith("mkdir -p ") and "cp -R " in line for line in script), script
    (tmp_path / "run" / "metrics.jsonl").unlink()  # the rerun writes it again
    done = subprocess.run(["bash", "-ec", "\n".join(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"train/loss": 0.5' in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_check_side_s_reproduce_script_runs_after_its_worktree_is_gone(tmp_path, monkeypatch):
    """End to end, one plain process (no torchrun): a job run in check's temporary worktree
    records it (reproduce.json), the worktree is removed, and the report's script for that side,
    run as written, makes it again, cds into it and reruns the job there."""
    import shutil as sh

    from parity.check import run_in_tree, worktree
    from parity.report import build_report
    from parity.spec import JobSpec

    repo = tmp_path / "repo"
    repo.mkdir()
    sh.copy(Path(__file__).resolve().parents[1] / "jobs" / "plain_job.py", repo)
    for args in (
        ["init", "-q"],
        ["add", "plain_job.py"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "job"],
    ):
        subprocess.run(["git", "-C", str(repo), *args], check=True)  # fmt: skip
    spec = JobSpec(command=["plain_job.py", "--mode", "ok", "--out", "{out}"], distributed=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with worktree(repo, "HEAD") as tree:
        run_in_tree(spec, tree, tmp_path / "run")
    assert not tree.exists()
    md = build_report(tmp_path / "run", tmp_path / "run").markdown()
    script = _script(md, "A")
    assert script[0].startswith(f"git -C {repo} worktree add --detach ") and str(tree) not in md
    (tmp_path / "run" / "env.json").unlink()  # the rerun writes it again
    done = subprocess.run(["bash", "-ec", "\n".join(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "env.json").is_file()
