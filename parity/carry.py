"""Inputs that are not in the revision: paths git ignores (a dataset, a tokenizer) that `check`
and `bisect` copy from the user's checkout into every revision's temporary worktree.

A clean worktree holds only what the revision tracks, so a job that reads an ignored
``data/train.bin`` would crash there. The spec's ``[check] carry`` (and ``--carry``) names such
paths. Each is refused up front, with one line naming where it was given, when it is not an input
at all: tracked in git at a revision (then it is the revision's), missing in the checkout,
outside the repository (absolute, ``..``, a symlink out), or in the way of the revision's tree.

Each worktree gets a copy, never a symlink (a job could write through one into the checkout),
with its write bits cleared, so that a job that writes its data fails instead of running on other
inputs; the user's files are only read. The bytes are hashed while they are copied: the first
copy's sha256 is the record (summary.json, the report), and every later copy must hash the same,
so both revisions provably read the same data. After each run the copies' sizes and
modification times are compared with what was copied: a job that changed them (as root, whom
the cleared write bits do not stop) is a failed run.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from parity.errors import InputError
from parity.record.env import without_git_repository

__all__ = ["Carry", "CarryError", "CarriedInput", "carry_items"]

_CHUNK = 1 << 20
#: what Python (open, numpy, pickle...) says of a file that is not there
_MISSING = re.compile(r"No such file or directory: '([^'\n]+)'")


class CarryError(InputError):
    """A path to carry that is not an input outside the revision; one line naming it."""


@dataclass(frozen=True)
class CarryItem:
    """One path asked for, relative to the repository root, and where it was asked for (the
    spec file's ``[check] carry``, ``--carry``), for the error that names it."""

    path: str
    source: str = "carry"

    def error(self, text: str) -> CarryError:
        return CarryError(f"{self.source}: {self.path}: {text}")


@dataclass(frozen=True)
class CarriedInput:
    """What was carried: the path, ``file`` or ``folder``, its files and bytes, and the sha256
    of the file's bytes (a folder: of the lines ``<file sha256>  <relative path>`` sorted by
    path, what ``sha256sum`` prints for its files)."""

    path: str
    kind: str
    files: int
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        what = "file" if self.kind == "file" else f"folder of {self.files} files"
        return f"{self.path}: {what}, {self.size:,} bytes, sha256 {self.sha256}"


def carry_items(paths: Iterable[str], source: str) -> list[CarryItem]:
    """``paths`` as given in ``source``, each checked for its form: relative, inside the
    repository, not git's own folder."""
    items = []
    for given in paths:
        if not isinstance(given, str) or not given or "\0" in given:
            raise CarryError(f"{source}: {given!r} is not a path")
        item = CarryItem(given, source)
        pure = PurePosixPath(given.replace(os.sep, "/"))
        if pure.is_absolute() or ".." in pure.parts:
            raise item.error("escapes the repository: give a path relative to its root, without ..")
        if not pure.parts or pure.parts == (".",):
            raise item.error("names the whole repository; give the ignored files or folders")
        if pure.parts[0] == ".git":
            raise item.error("is git's own folder, not an input")
        items.append(CarryItem(pure.as_posix(), source))
    return items


@dataclass
class Carry:
    """The paths carried from ``root`` (the user's checkout) into each worktree, once checked
    (``check``), with their record once the first copy is made (``into``)."""

    root: Path
    items: list[CarryItem]
    record: dict[str, CarriedInput] = field(default_factory=dict)
    _copied: dict[Path, dict[str, tuple]] = field(default_factory=dict)  # tree -> stat signature

    @classmethod
    def of(cls, root: Path, items: Sequence[CarryItem]) -> Carry:
        """The carry of ``items`` (duplicates dropped): none may lead out of the repository
        (through a symlink) or lie in another. What the revisions track is checked next
        (``check_revision``), what the checkout holds last (``check_checkout``)."""
        unique = list({item.path: item for item in items}.values())
        carry = cls(Path(root).resolve(), unique)
        for item in carry.items:
            if not _inside((carry.root / item.path).resolve(), carry.root):
                raise item.error("escapes the repository (a symlink to a path outside it)")
            for other in carry.items:
                if other is not item and _under(item.path, other.path):
                    raise item.error(f"lies in {other.path}, carried too; give one of them")
        return carry

    @property
    def carried(self) -> list[CarriedInput]:
        return [self.record[i.path] for i in self.items if i.path in self.record]

    def __bool__(self) -> bool:
        return bool(self.items)

    # --- refusals ----------------------------------------------------------------------------

    def check_checkout(self) -> None:
        """Each path is a file or a folder in the checkout; a folder holds only regular files,
        none a symlink out of the repository."""
        for item in self.items:
            where = self.root / item.path
            if not os.path.lexists(where):
                raise item.error(f"is missing in the checkout {self.root}")
            if not (where.is_file() or where.is_dir()):
                raise item.error("is neither a file nor a folder")
            if where.is_dir():
                _files(where, self.root, item)

    def check_revision(self, commit: str, name: str) -> None:
        """Refuse a path the revision tracks (itself, or a file under it) or whose parent is not
        a folder in the revision's tree; ``name`` says which revision (``base``)."""
        at = f"in git at {name} ({commit[:12]})"
        for item in self.items:
            tracked = _git(self.root, "ls-tree", "-r", "-z", "--name-only", commit, "--",
                           item.path).split("\0")[0]  # fmt: skip
            if tracked == item.path:
                raise item.error(f"is tracked {at}: it is the revision's, not an input to carry")
            if tracked:
                raise item.error(f"holds {tracked}, tracked {at}: carry the ignored files by name")
            parents = _parents(item.path)
            listed = _git(self.root, "ls-tree", "-z", commit, "--", *parents) if parents else ""
            for entry in filter(None, listed.split("\0")):
                meta, _, path = entry.partition("\t")
                if path in parents and meta.split()[1] != "tree":  # git lists siblings too
                    raise item.error(f"collides with {path}, a file {at}")

    def check_range(self, good: str, bad: str) -> None:
        """Refuse a path that a commit in good..bad tracks or is in the way of (bisect checks
        out every one of them in the worktree that holds the copies)."""
        specs = sorted({p for i in self.items for p in (i.path, *_parents(i.path))})
        log = _git(self.root, "log", "--reverse", "--no-renames", "--format=commit %H",
                   "--name-only", f"{good}..{bad}", "--", *specs)  # fmt: skip
        commit = ""
        for line in log.splitlines():
            if line.startswith("commit "):
                commit = line.split()[1]
                continue
            at = f"by commit {commit[:12]} in {good[:12]}..{bad[:12]}"
            for item in self.items:
                if line == item.path:
                    raise item.error(f"is tracked {at}: it is that revision's, not an input")
                if line and (_under(line, item.path) or line in _parents(item.path)):
                    raise item.error(f"is in the way of {line}, tracked {at}")

    # --- copies ------------------------------------------------------------------------------

    def into(self, tree: Path) -> None:
        """Copy every path into ``tree`` (again where a run changed an earlier copy), write bits
        cleared; the first copy's digest is the record, a later one must equal it."""
        tree = Path(tree)
        for item in self.items:
            signature = self._copied.get(tree, {}).get(item.path)
            if signature is not None and signature == _signature(tree / item.path):
                continue
            _remove(tree / item.path)
            got = _copy(self.root / item.path, tree / item.path, self.root, item)
            known = self.record.setdefault(item.path, got)
            if known != got:
                raise item.error(f"changed in the checkout while it ran (sha256 {known.sha256}, "
                                 f"now {got.sha256})")  # fmt: skip
            self._copied.setdefault(tree, {})[item.path] = _signature(tree / item.path)

    def hint(self, tree: Path, log: str) -> str:
        """For a run that crashed on a file its worktree lacks (``log``: its log's tail) but
        the checkout has, not carried: the line that says to carry it; '' otherwise."""
        for name in _MISSING.findall(log):
            path = Path(name)
            if path.is_absolute():
                if not _inside(path, Path(tree)):
                    continue
                path = path.relative_to(tree)
            rel = PurePosixPath(path.as_posix())
            if ".." in rel.parts or any(_under(rel.as_posix(), i.path) for i in self.items):
                continue
            if os.path.lexists(self.root / rel):
                return (f"hint: {rel} is in your checkout but not in the revision's worktree "
                        f"(git does not track it): carry it with --carry {rel} or the spec's "
                        "[check] carry")  # fmt: skip
        return ""

    def changed(self, tree: Path) -> str:
        """'' when the copies in ``tree`` are as copied; else the line that fails the run."""
        for item in self.items:
            if self._copied.get(Path(tree), {}).get(item.path) != _signature(tree / item.path):
                return (f"the job changed {item.path}, an input carried read-only into its "
                        "worktree (the checkout's copy is untouched)")  # fmt: skip
        return ""


def _git(root: Path, *args: str) -> str:
    """``git ARGS`` in ``root``, pathspecs taken literally; CarryError with git's message."""
    cmd = ["git", "--literal-pathspecs", "-C", str(root), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         start_new_session=True, timeout=300,
                         env=without_git_repository(os.environ))  # fmt: skip
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise CarryError(f"git {args[0]}: {lines[-1] if lines else 'failed'}")
    return out.stdout


def _parents(path: str) -> list[str]:
    return [p.as_posix() for p in PurePosixPath(path).parents if p.parts]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _files(folder: Path, root: Path, item: CarryItem) -> list[str]:
    """The files of ``folder``, relative and sorted; a symlink out of the repository, a symlink
    to a folder or a special file in it is refused."""
    found = []
    for here, dirs, names in os.walk(folder):
        for name in dirs:
            if os.path.islink(os.path.join(here, name)):
                raise item.error(f"holds {name}, a symlink to a folder: carry its target instead")
        for name in names:
            path = Path(here, name)
            if not _inside(path.resolve(), root):
                raise item.error(f"holds {path.relative_to(folder)}, a symlink out of the "
                                 "repository")  # fmt: skip
            if not path.is_file():
                raise item.error(f"holds {path.relative_to(folder)}, which is not a regular file")
            found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def _copy(src: Path, dst: Path, root: Path, item: CarryItem) -> CarriedInput:
    """``src`` copied to ``dst`` (made new), hashed while read, write bits cleared."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        size, digest = _copy_file(src, dst)
        return CarriedInput(item.path, "file", 1, size, digest)
    lines, total = [], 0
    names = _files(src, root, item)
    dst.mkdir()
    for rel in names:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        size, digest = _copy_file(src / rel, dst / rel)
        total += size
        lines.append(f"{digest}  {rel}\n")
    folder = hashlib.sha256("".join(lines).encode()).hexdigest()
    return CarriedInput(item.path, "folder", len(names), total, folder)


def _copy_file(src: Path, dst: Path) -> tuple[int, str]:
    """Size and sha256 of the bytes written; times and mode kept, less the write bits."""
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as f, open(dst, "xb") as g:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            g.write(chunk)
            size += len(chunk)
    shutil.copystat(src, dst)
    os.chmod(dst, stat.S_IMODE(os.stat(dst).st_mode) & ~0o222)
    return size, digest.hexdigest()


def _signature(path: Path) -> tuple:
    """What a write changes: each file's relative path, size, mtime and inode (cheap: no read)."""
    if not os.path.lexists(path):
        return ()
    if not path.is_dir():
        s = os.lstat(path)
        return (("", s.st_size, s.st_mtime_ns, s.st_ino),)
    out = []
    for here, _, names in os.walk(path):
        for name in names:
            s = os.lstat(os.path.join(here, name))
            rel = os.path.relpath(os.path.join(here, name), path)
            out.append((rel, s.st_size, s.st_mtime_ns, s.st_ino))
    return tuple(sorted(out))


def _remove(path: Path) -> None:
    """An earlier copy of ours in a worktree (never the checkout's), gone before a new one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
