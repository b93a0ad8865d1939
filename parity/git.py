"""The git plumbing of `check` and `bisect`: git commands as argument lists (never a shell),
revisions resolved to commits, and temporary detached worktrees that are removed again whatever
happens.

The user's working tree, index, branches and HEAD are never touched: a revision is checked out
with ``git worktree add --detach`` into a temp folder, hooks off, and that folder and its entry
(no other: the user's worktrees are theirs) are removed on the way out, a signal
(parity.run.signals) waiting while git adds or removes it. Git's repository variables of the
caller (a hook's GIT_INDEX_FILE, a shell's GIT_DIR) are not passed to git: the repository is
the one the folder given lies in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.errors import InputError
from parity.record.env import without_git_repository
from parity.run.signals import deferred

if TYPE_CHECKING:
    from parity.carry import Carry

__all__ = [
    "RevisionError",
    "dirty",
    "git",
    "origin",
    "quiet_git",
    "repo_root",
    "resolve_revision",
    "subject",
    "worktree",
]

#: hooks and auto-gc off: a hook could touch the worktree, a gc could run for minutes
QUIET = ("-c", "core.hooksPath=/dev/null", "-c", "gc.auto=0")


class RevisionError(InputError):
    """A git command that failed (not a repo, unknown revision); the message is one line."""


def git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS`` output; RevisionError with git's own message when it fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
            env=without_git_repository(os.environ),  # a hook's GIT_INDEX_FILE: not ours to write
            start_new_session=True,  # a terminal's Ctrl-C reaches us (parity.run.signals), not git
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RevisionError(f"git {args[0]}: {e}") from None
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        raise RevisionError(f"git {' '.join(args)}: {lines[-1] if lines else 'failed'}")
    return out.stdout.strip()


def quiet_git(repo: Path, *args: str) -> str:
    """``git`` with hooks and auto-gc off: bisect's commands, which check commits out."""
    return git(repo, *QUIET, *args)


def subject(repo: Path, commit: str) -> str:
    """The first line of ``commit``'s message."""
    return quiet_git(repo, "log", "-1", "--format=%s", commit)


def repo_root(path: Path) -> Path:
    """The top folder of the repository ``path`` lies in; RevisionError outside one."""
    return Path(git(path, "rev-parse", "--show-toplevel"))


def dirty(repo: Path) -> bool:
    """Whether tracked files have uncommitted changes (they are not part of HEAD)."""
    return bool(git(repo, "status", "--porcelain", "--untracked-files=no"))


def resolve_revision(repo: Path, rev: str) -> str:
    """The commit id of ``rev``; ``--end-of-options`` keeps a rev like ``--foo`` a rev. An
    unknown one in a shallow clone (CI's default checkout) says so: it may well exist, in the
    history the clone did not fetch."""
    try:
        return git(repo, "rev-parse", "--verify", "-q", "--end-of-options", f"{rev}^{{commit}}")
    except RevisionError:
        pass
    hint = ""
    try:
        if git(repo, "rev-parse", "--is-shallow-repository") == "true":
            hint = " (this is a shallow clone: fetch more history, e.g. git fetch --unshallow)"
    except RevisionError:
        pass
    raise RevisionError(f"{repo}: unknown git revision {rev!r}{hint}")


@contextmanager
def worktree(repo: Path, commit: str, parent: Path | None = None) -> Iterator[Path]:
    """A detached checkout of ``commit`` in a temp folder (in ``parent``: a Slurm launcher's
    folder on the file system the nodes share; default the system's temp folder), removed and
    its entry removed on exit.

    A signal (parity.run.signals: SIGINT, SIGTERM, SIGHUP) waits while the worktree is added or
    removed: git killed half-way through `worktree add` leaves it registered and locked.
    """
    tmp = None
    try:
        with deferred():
            tmp = Path(tempfile.mkdtemp(prefix="parity-worktree-", dir=parent))
            path = tmp / commit[:12]
            hooks_off = ("-c", "core.hooksPath=/dev/null")  # a post-checkout hook could touch it
            git(repo, *hooks_off, "worktree", "add", "--detach", "--quiet", str(path), commit)
        _TEMPORARY[path] = repo
        yield path
    finally:  # cleanup errors must not hide the error that brought us here
        if tmp is not None:
            _TEMPORARY.pop(tmp / commit[:12], None)
            with deferred():
                _remove_worktree(repo, tmp, tmp / commit[:12])


#: the temporary worktrees that exist now (``worktree``), each with its repository: a run in
#: one records how to make it again (``origin``), since it is gone once the run is reported
_TEMPORARY: dict[Path, Path] = {}


def origin(tree: Path, carry: Carry | None = None) -> dict[str, Any]:
    """What the report needs to rerun a job that ran in ``tree`` once that is gone: for one of
    ``worktree``'s temporary worktrees, its repository, the commit checked out there now (bisect
    moves it) and its path (named in the job's command), and the inputs carried into it (where
    from, which paths: the rerun's worktree needs them too); {} for any other folder."""
    repo = _TEMPORARY.get(tree)
    if repo is None:
        return {}
    commit = git(tree, "rev-parse", "HEAD")
    made = {"repo": str(repo), "commit": commit, "path": str(tree)}
    if carry:
        made["carry"] = {"from": str(carry.root), "paths": [item.path for item in carry.items]}
    return {"worktree": made}


def _remove_worktree(repo: Path, tmp: Path, path: Path) -> None:
    """Remove the worktree at ``path`` and its entry in the repository, and no other: ``git
    worktree prune`` would also drop the entries of the user's own worktrees whose folders are
    away (moved, on a disk not mounted), their index and staged changes with them."""
    checkout = os.path.realpath(path / ".git")  # as git writes it (/var is /private/var...)
    if path.exists():
        _git_unchecked(repo, "worktree", "remove", "--force", str(path))
    shutil.rmtree(tmp, ignore_errors=True)
    for entry in _worktree_entries(repo):  # what `worktree remove` could not take (gone)
        found = _entry_checkout(entry)
        if found is not None and os.path.realpath(found) == checkout:
            shutil.rmtree(entry, ignore_errors=True)


def _worktree_entries(repo: Path) -> list[Path]:
    """The folders git keeps each linked worktree's HEAD, index and checkout path in
    (``$GIT_COMMON_DIR/worktrees/<id>``, gitrepository-layout(5))."""
    try:  # relative to the repository where git prints it so (before 2.31's --path-format)
        common = Path(repo) / git(repo, "rev-parse", "--git-common-dir")
    except RevisionError:
        return []
    folder = common / "worktrees"
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def _entry_checkout(entry: Path) -> Path | None:
    """The ``.git`` file of the checkout a worktree entry belongs to (its ``gitdir`` file)."""
    try:
        return Path((entry / "gitdir").read_text(encoding="utf-8", errors="replace").strip())
    except OSError:
        return None


def _git_unchecked(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        env=without_git_repository(os.environ),
        start_new_session=True,  # not stopped half-way by a terminal's Ctrl-C
    )
