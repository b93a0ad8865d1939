"""`check` and `bisect` with inputs that are not in the revision (parity.carry).

A temp repo whose job reads `data/train.bin` and the files of `data/tok/`, both ignored by git
(as nanoGPT ignores its `*.bin` and `*.pkl`): a clean worktree lacks them. History on main: the
job, a comment, a one-ULP nudge of the loss, another comment; a branch `writer` whose job appends
to its data. The job is one plain process (`distributed = false`), about a second a launch.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from parity.cli import main
from tests.orchestration.history import commit, git, new_repo, repo_state

pytestmark = pytest.mark.parity

JOB = """\
import json
import math
import sys
from pathlib import Path

NUDGE = {nudge}  # {label}

out = Path(sys.argv[sys.argv.index("--out") + 1])
data = Path("data/train.bin").read_bytes()
tok = [p.read_bytes() for p in sorted(Path("data/tok").iterdir())]
if {write}:
    with open("data/train.bin", "ab") as f:
        f.write(b"overwritten")
base = (sum(data) + sum(map(len, tok))) / 1000
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for i in range(1, 5):
        loss = base / i
        if NUDGE and i >= 3:
            loss = math.nextafter(loss, math.inf)
        f.write(json.dumps({{"step": i, "train/loss": loss}}) + "\\n")
    f.write(json.dumps({{"event": "end", "steps": 4}}) + "\\n")
"""

SPEC = """\
task = "custom"
distributed = false
command = ["job.py", "--out", "{{out}}"]
timeout_s = 60
{check}"""

CARRY = '\n[check]\ncarry = ["data/train.bin", "data/tok"]\n'
COMMITS = [("the job", False), ("a comment", False), ("nudge the loss", True), ("comment", True)]


def job(nudge: bool, label: str, write: bool = False) -> str:
    return JOB.format(nudge=nudge, label=label, write=write)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = new_repo(tmp_path_factory.mktemp("carry"))
    (root / ".gitignore").write_text("*.bin\ndata/tok/\nspec*.toml\n")
    (root / "data" / "tok").mkdir(parents=True)
    (root / "data" / "prepare.py").write_text("# makes train.bin\n")
    (root / "data" / "train.bin").write_bytes(bytes(range(256)) * 4)
    (root / "data" / "tok" / "vocab.txt").write_text("a b c\n")
    (root / "data" / "tok" / "merges.txt").write_text("a b\n")
    for subject, nudge in COMMITS:
        commit(root, subject, {"job.py": job(nudge, subject)})
    git(root, "checkout", "-q", "-b", "writer", "main~3")
    commit(root, "the job writes its data", {"job.py": job(False, "writer", write=True)})
    git(root, "checkout", "-q", "-b", "tracks", "main~3")
    (root / "data" / "extra.bin").write_bytes(b"extra")
    git(root, "add", "-f", "data/extra.bin")  # an ignored file tracked all the same
    commit(root, "track a data file")
    git(root, "rm", "-q", "--cached", "data/extra.bin")
    commit(root, "untrack it again")
    git(root, "checkout", "-q", "main")
    (root / "spec.toml").write_text(SPEC.format(check=CARRY))
    (root / "spec-bare.toml").write_text(SPEC.format(check=""))
    (root / "data" / "train.bin").chmod(0o644)
    return root


def cli(repo: Path, *args: str) -> tuple[int, str, str]:
    """`parity ARGS` run in ``repo``: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def user_files(repo: Path) -> dict[str, tuple[bytes, int]]:
    """The carried files' bytes and modes in the user's checkout."""
    return {
        p: ((repo / p).read_bytes(), (repo / p).stat().st_mode)
        for p in ("data/train.bin", "data/tok/vocab.txt", "data/tok/merges.txt")
    }


def test_without_carry_the_revision_lacks_its_data(repo, tmp_path):
    code, _, err = cli(repo, "check", "--base", "main~3", "--head", "main~2",
                       "--spec", "spec-bare.toml", "--out", str(tmp_path))  # fmt: skip
    assert code == 3
    assert "FileNotFoundError" in err
    assert ("hint: data/train.bin is in your checkout but not in the revision's worktree (git "
            "does not track it): carry it with --carry data/train.bin") in err  # fmt: skip
    report = (tmp_path / "report.md").read_text()  # the CI step summary says so too
    assert report.startswith("# parity: failed\n") and "carry it with --carry" in report
    assert json.loads((tmp_path / "summary.json").read_text())["verdict"] == "failed"


def test_carried_inputs_are_aligned_and_recorded(repo, tmp_path):
    before, files = repo_state(repo), user_files(repo)
    code, out, _ = cli(repo, "check", "--base", "main~3", "--head", "main~2",
                       "--spec", "spec.toml", "--out", str(tmp_path), "--json")  # fmt: skip
    assert code == 0, out
    data = (repo / "data" / "train.bin").read_bytes()
    listing = "".join(
        f"{sha256((repo / 'data' / 'tok' / n).read_bytes())}  {n}\n"
        for n in ("merges.txt", "vocab.txt")
    )
    expected = [
        {"path": "data/train.bin", "kind": "file", "files": 1, "size": len(data),
         "sha256": sha256(data)},
        {"path": "data/tok", "kind": "folder", "files": 2, "size": 10,
         "sha256": sha256(listing.encode())},
    ]  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["carried"] == expected and summary["verdict"] == "aligned"
    assert json.loads(out.splitlines()[-1])["carried"] == expected
    md = (tmp_path / "report.md").read_text()
    assert "### Inputs carried into each revision" in md
    assert f"data/train.bin: file, 1,024 bytes, sha256 {sha256(data)}" in md
    assert "Inputs carried into each revision" in (tmp_path / "report.html").read_text()
    assert repo_state(repo) == before and user_files(repo) == files


@pytest.mark.parametrize(
    ("carry", "says"),
    [
        ("job.py", "job.py: is tracked in git at base"),
        ("data", "data: holds data/prepare.py, tracked in git at base"),
        ("job.py/x", "job.py/x: collides with job.py, a file in git at base"),
        ("data/nope.bin", "data/nope.bin: is missing in the checkout"),
        ("../outside.bin", "../outside.bin: escapes the repository"),
        ("/etc/hostname", "/etc/hostname: escapes the repository"),
        ("data/link.bin", "data/link.bin: escapes the repository (a symlink"),
        ("data/tok data/tok/vocab.txt", "data/tok/vocab.txt: lies in data/tok, carried too"),
    ],
)
def test_paths_that_are_not_inputs_are_refused(repo, tmp_path, carry, says):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    link = repo / "data" / "link.bin"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    try:
        flags = [f"--carry={path}" for path in carry.split()]
        code, out, err = cli(repo, "check", "--base", "main~3", "--spec", "spec-bare.toml",
                             *flags, "--out", str(tmp_path / "o"))  # fmt: skip
    finally:
        link.unlink()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("parity: error: --carry: ")
    assert says in err
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_refusal_names_the_spec_file(repo, tmp_path):
    (repo / "spec-tracked.toml").write_text(SPEC.format(check='[check]\ncarry = ["job.py"]\n'))
    code, _, err = cli(repo, "bisect", "--good", "main~3", "--bad", "main",
                       "--spec", "spec-tracked.toml", "--out", str(tmp_path))  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "spec-tracked.toml: [check] carry: job.py: is tracked in git at good" in err


def test_bisect_with_carried_inputs_names_the_nudge(repo, tmp_path):
    before, files = repo_state(repo), user_files(repo)
    code, out, err = cli(repo, "bisect", "--good", "main~3", "--bad", "main",
                         "--spec", "spec-bare.toml", "--carry", "data/train.bin",
                         "--carry", "data/tok", "--out", str(tmp_path), "--json")  # fmt: skip
    assert code == 1, err
    result = json.loads(out)
    assert result["first_bad"]["commit"] == git(repo, "rev-parse", "main~1").strip()
    assert result["first_bad"]["metric"] == "train/loss" and result["first_bad"]["step"] == 3
    assert [c["path"] for c in result["carried"]] == ["data/train.bin", "data/tok"]
    assert json.loads((tmp_path / "bisect.json").read_text())["carried"] == result["carried"]
    assert all(t["verdict"] != "skipped" for t in result["tested"])
    assert repo_state(repo) == before and user_files(repo) == files


def test_a_job_that_writes_its_carried_data_fails(repo, tmp_path):
    before, files = repo_state(repo), user_files(repo)
    code, _, err = cli(repo, "check", "--base", "main~3", "--head", "writer",
                       "--spec", "spec.toml", "--out", str(tmp_path))  # fmt: skip
    assert code == 3
    assert "data/train.bin" in err and ("changed" in err or "Permission" in err)
    assert repo_state(repo) == before and user_files(repo) == files


def test_bisect_refuses_a_path_a_commit_between_tracks(repo, tmp_path):
    code, _, err = cli(repo, "bisect", "--good", "main~3", "--bad", "tracks",
                       "--spec", "spec-bare.toml", "--carry", "data/extra.bin",
                       "--out", str(tmp_path))  # fmt: skip
    middle = git(repo, "rev-parse", "tracks~1").strip()[:12]
    assert code == 2 and err.count("\n") == 1
    assert f"--carry: data/extra.bin: is tracked by commit {middle} in " in err


def test_the_spec_key_is_checked(repo):
    (repo / "spec-bad.toml").write_text(SPEC.format(check='[check]\ncarry = "data/train.bin"\n'))
    code, _, err = cli(repo, "spec", "spec-bad.toml")
    assert code == 2 and "spec-bad.toml: check.carry must be a list of paths" in err
    (repo / "spec-bad.toml").write_text(SPEC.format(check="[check]\ncary = []\n"))
    code, _, err = cli(repo, "spec", "spec-bad.toml")
    assert code == 2 and "unknown key 'cary' in [check]" in err
