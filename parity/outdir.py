"""Output folders the harness owns: it removes or replaces only what it made itself.

A command writes into a folder (``--out``); every entry it makes there (a side's run folder, its
launch folder, a report) is recorded in ``OUT/.parity-out/made.json`` with its device and inode.
Before making an entry again, an existing one is removed only when that record says the harness
made that very file or folder. Anything else in the way, the user's folder, a symlink (never
followed), is refused with one line (``OutputError``, exit 2) and left as it was. So
``parity check --out .`` at a repository's root cannot delete its ``base/``, and a rerun into
the same ``--out`` starts from empty folders: no earlier run's file is read as this run's.

``OUT/.parity-out/lock`` is held (flock) while a command works in OUT; a second command on the
same folder is refused with the holder's pid and command line. Nested uses in one process (a
pair's ``run_job`` calls) share the holder's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from parity.errors import InputError
from parity.files import write_json_atomic

LEDGER_DIR = ".parity-out"
_LEDGER, _LOCK, _HOLDER = "made.json", "lock", "holder.json"


class OutputError(InputError):
    """An output path the harness may not write: not its own, or in use; one line."""


class OutDir:
    """One output folder held by this process: ``claim`` names, ``make_dir`` them, then
    ``close`` (or use it as a context manager) records what was made."""

    _held: dict[Path, OutDir] = {}
    _guard = threading.Lock()

    def __init__(self, root: Path):
        self.root = root
        self.meta = root / LEDGER_DIR
        self._users = 0
        self._fd: int | None = None
        self._made: dict[str, dict] = {}

    # --- opening and closing ---------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> OutDir:
        """The folder ``root`` held for this process (made if missing); the same object for
        nested opens. Raises OutputError when it is a file, or another command holds it."""
        root = Path(os.path.abspath(root))
        with cls._guard:
            held = cls._held.get(root)
            if held is None:
                held = cls(root)
                held._acquire()
                cls._held[root] = held
            held._users += 1
            return held

    def _acquire(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise OutputError(f"{self.root}: exists and is not a folder; give --out a folder")
        if self.meta.is_symlink() or (self.meta.exists() and not self.meta.is_dir()):
            raise OutputError(f"{self.meta}: not parity's own folder; choose another --out")
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.meta / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"{self.root}: cannot write here: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{self.root}: in use by {self._holder()}; wait for it or choose "
                              "another --out") from None  # fmt: skip
        self._fd = fd
        holder = {"pid": os.getpid(), "argv": sys.argv, "since": time.time()}
        write_json_atomic(self.meta / _HOLDER, holder)
        self._made = self._read_ledger()

    def _holder(self) -> str:
        try:
            data = json.loads((self.meta / _HOLDER).read_text(encoding="utf-8"))
            return f"pid {int(data['pid'])} ({' '.join(map(str, data['argv']))[:200]})"
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return "another parity command"

    def _read_ledger(self) -> dict[str, dict]:
        try:
            data = json.loads((self.meta / _LEDGER).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError):
            return {}  # unreadable: nothing is known to be ours, so nothing is removed
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict)}

    def close(self) -> None:
        """Record what was made (its inode) and, for the last user, release the lock."""
        with self._guard:
            self._users -= 1
            if self._users > 0:
                return
            self._held.pop(self.root, None)
        try:
            self._save(final=True)
        finally:
            if self._fd is not None:
                os.close(self._fd)  # releases the flock
                self._fd = None

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what lies in it -------------------------------------------------------------------------

    def claim(self, *names: str) -> None:
        """Make room for each name: absent or an empty folder is fine, one this harness made is
        removed, anything else raises OutputError naming it. Claimed names count as ours until
        recorded."""
        for name in names:
            self._check_name(name)
            path = self.root / name
            if os.path.lexists(path):
                if self.made_here(name):
                    _remove(path)
                elif not _empty_dir(path):  # an empty folder has nothing to lose: taken as is
                    raise OutputError(_foreign(path))
            self._made[name] = {"pending": True}
        self._save()

    def made_here(self, name: str) -> bool:
        """Whether ``root/name`` is the very entry this harness made (never through a symlink)."""
        path = self.root / name
        entry = self._made.get(name)
        if entry is None or path.is_symlink() or not os.path.lexists(path):
            return False
        if entry.get("pending"):
            return True  # claimed by a command that ended before it could record the inode
        st = os.lstat(path)
        return (entry.get("dev"), entry.get("ino")) == (st.st_dev, st.st_ino)

    def make_dir(self, name: str) -> Path:
        """An empty folder ``root/name`` (claimed first), recorded as made here."""
        self.claim(name)
        path = self.root / name
        path.mkdir(exist_ok=True)
        self._record(name)
        self._save()
        return path

    def _record(self, name: str) -> None:
        path = self.root / name
        if os.path.lexists(path) and not path.is_symlink():
            st = os.lstat(path)
            self._made[name] = {"dev": st.st_dev, "ino": st.st_ino}

    def _save(self, final: bool = False) -> None:
        if final:
            for name, entry in list(self._made.items()):
                if entry.get("pending"):
                    self._record(name)
        write_json_atomic(self.meta / _LEDGER, self._made)

    def _check_name(self, name: str) -> None:
        """A name of its own in the folder: an ``--out`` of ``/`` or ``X/.parity-out`` is none."""
        if not name or "/" in name or name in (".", "..", LEDGER_DIR):
            raise OutputError(f"{self.root}: not an entry name: {name!r}; choose another --out")


def _foreign(path: Path) -> str:
    if path.is_symlink():
        return f"{path}: a symlink in the way; parity never deletes through one: remove it or " \
               "choose another --out"  # fmt: skip
    kind = "folder" if path.is_dir() else "file"
    return (
        f"{path}: a {kind} parity did not make is in the way; it is never deleted or "
        "overwritten: move it or choose another --out"
    )


def _empty_dir(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _remove(path: Path) -> None:
    """Remove an entry this harness made; a folder's symlinks are removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def owned_dir(path: str | os.PathLike[str]) -> tuple[OutDir, Path]:
    """(the held parent folder, a fresh empty ``path`` made in it): a run folder of one's own.
    The caller closes the OutDir when done with the folder."""
    path = Path(os.path.abspath(path))
    out = OutDir.open(path.parent)
    try:
        return out, out.make_dir(path.name)
    except BaseException:
        out.close()
        raise
