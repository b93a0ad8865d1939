"""`resolve_revision` in a shallow clone: an unknown revision may only be unfetched history."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from parity.check import RevisionError, resolve_revision

SHALLOW = "(this is a shallow clone: fetch more history, e.g. git fetch --unshallow)"


def _git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def clones(tmp_path: Path) -> tuple[Path, Path]:
    """A three-commit repository and a `git clone --depth 1` of it."""
    src = tmp_path / "src"
    src.mkdir()
    _git(src, "init", "-q", "-b", "main")
    for n in range(3):
        (src / "f.txt").write_text(f"{n}\n")
        _git(src, "add", "f.txt")
        _git(src, "commit", "-q", "-m", f"commit {n}")
    _git(src, "branch", "feature", "HEAD~1")  # --depth 1 fetches main only
    shallow = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{src}", str(shallow))
    return src, shallow


def test_an_unknown_revision_in_a_shallow_clone_says_so(clones):
    src, shallow = clones
    assert resolve_revision(shallow, "origin/main") == _git(src, "rev-parse", "main")
    with pytest.raises(RevisionError) as e:
        resolve_revision(shallow, "HEAD~1")  # in the repository, not in the clone
    assert str(e.value) == f"{shallow}: unknown git revision 'HEAD~1' {SHALLOW}"
    with pytest.raises(RevisionError, match="'origin/feature' .this is a shallow clone"):
        resolve_revision(shallow, "origin/feature")  # CI's checkout without the base branch


def test_an_unknown_revision_in_a_full_clone_has_no_hint(clones):
    src, _ = clones
    assert resolve_revision(src, "HEAD~1") == _git(src, "rev-parse", "HEAD~1")
    with pytest.raises(RevisionError) as e:
        resolve_revision(src, "origin/main")
    assert str(e.value) == f"{src}: unknown git revision 'origin/main'"
