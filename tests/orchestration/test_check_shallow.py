"""`resolve_revision` in a shallow clone: an unknown revision may only be unfetched history."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.git import RevisionError, resolve_revision
from tests.orchestration.history import git

SHALLOW = "(this is a shallow clone: fetch more history, e.g. git fetch --unshallow)"


@pytest.fixture
def clones(tmp_path: Path) -> tuple[Path, Path]:
    """A three-commit repository and a `git clone --depth 1` of it."""
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q", "-b", "main")
    for n in range(3):
        (src / "f.txt").write_text(f"{n}\n")
        git(src, "add", "f.txt")
        git(src, "commit", "-q", "-m", f"commit {n}")
    git(src, "branch", "feature", "HEAD~1")  # --depth 1 fetches main only
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{src}", str(shallow))
    return src, shallow


def test_an_unknown_revision_in_a_shallow_clone_says_so(clones):
    src, shallow = clones
    assert resolve_revision(shallow, "origin/main") == git(src, "rev-parse", "main").strip()
    with pytest.raises(RevisionError) as e:
        resolve_revision(shallow, "HEAD~1")  # in the repository, not in the clone
    assert str(e.value) == f"{shallow}: unknown git revision 'HEAD~1' {SHALLOW}"
    with pytest.raises(RevisionError, match="'origin/feature' .this is a shallow clone"):
        resolve_revision(shallow, "origin/feature")  # CI's checkout without the base branch


def test_an_unknown_revision_in_a_full_clone_has_no_hint(clones):
    src, _ = clones
    assert resolve_revision(src, "HEAD~1") == git(src, "rev-parse", "HEAD~1").strip()
    with pytest.raises(RevisionError) as e:
        resolve_revision(src, "origin/main")
    assert str(e.value) == f"{src}: unknown git revision 'origin/main'"
