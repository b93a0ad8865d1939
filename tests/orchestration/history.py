"""Git repositories for the tests: `git` as a test user, `repo_state` (what a command must leave
as it was), and the history `check` and `bisect` walk (tests/orchestration/test_bisect.py and, on
Slurm, tests/run/test_slurm.py): five commits of a one-rank custom job whose third nudges
train/loss by one ULP from step 4 on, with a user's staged, unstaged and untracked edits and
bisection on top."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

JOB = """\
import json
import math
import sys
from pathlib import Path

NUDGE = {nudge}  # {label}

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "metrics.jsonl", "w") as f:
    for i in range(1, 6):
        loss = 1.0 / i
        if NUDGE and i >= 4:
            loss = math.nextafter(loss, math.inf)
        f.write(json.dumps({{"step": i, "train/loss": loss, "train/lr": 0.125}}) + "\\n")
    f.write(json.dumps({{"event": "end", "steps": 5}}) + "\\n")
"""

SPEC = """\
task = "custom"
world_size = 1
command = ["job.py", "--out", "{out}"]
timeout_s = 120

[policies]
"train/loss" = "ulp:1@-3,exact@4-"
"""

COMMITS = [
    ("first: the job", False, "one"),
    ("second: a comment", False, "two"),
    ("third: nudge the loss by one ULP", True, "three"),
    ("fourth: another comment", True, "four"),
    ("fifth: yet another comment", True, "five"),
]


def git(repo: Path, *args: str, check: bool = True) -> str:
    """``git -C repo ARGS`` as a test user; its stdout."""
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True).stdout


def new_repo(root: Path) -> Path:
    """An empty repository in ``root`` (made if missing) on branch main."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    return root


def commit(repo: Path, message: str, files: Mapping[str, str | bytes] | None = None) -> str:
    """``files`` (path in the repository: text or bytes) written, everything that git does not
    ignore staged, and committed as ``message``; the new commit."""
    for name, content in (files or {}).items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def repo_state(repo: Path, *files: str) -> dict[str, str]:
    """Everything of the user's a command must leave as it was: HEAD, branches, refs, worktrees,
    tree and index, a bisection under way, and the text of ``files``."""
    return {
        "head": git(repo, "rev-parse", "HEAD"),
        "symbolic": git(repo, "symbolic-ref", "HEAD"),
        "branches": git(repo, "branch", "--list"),
        "refs": git(repo, "for-each-ref"),
        "worktrees": git(repo, "worktree", "list", "--porcelain"),
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "unstaged": git(repo, "diff"),
        "staged": git(repo, "diff", "--cached"),
        "bisect": git(repo, "bisect", "log", check=False),
        **{name: (repo / name).read_text() for name in files},
    }


def make_repo(root: Path) -> Path:
    """The five commits in ``root``, a staged spec, an uncommitted edit and the user's own
    bisection mid-way."""
    new_repo(root)
    for subject, nudge, label in COMMITS:
        commit(root, subject, {"job.py": JOB.format(nudge=nudge, label=label)})
    (root / "spec.toml").write_text(SPEC)
    git(root, "add", "spec.toml")  # staged, never committed
    (root / "job.py").write_text(JOB.format(nudge=True, label="uncommitted edit"))
    (root / "untracked.txt").write_text("new\n")
    git(root, "bisect", "start")  # the user's own bisection, mid-way
    git(root, "bisect", "bad", "HEAD")
    return root


def commit_of(repo: Path, n: int) -> str:
    return git(repo, "rev-parse", f"HEAD~{len(COMMITS) - n}").strip()
