"""Output folders: the harness only ever adds new entries; it never deletes, replaces or moves
anything that was in the folder before the command started.

A command writes into a folder (``--out``). Before anything runs it checks that every name it
will write there (a side's run folder, its launch folder, a report) is free (an empty folder,
having nothing to lose, counts as free); a name that is taken, by an earlier run or by the user,
a symlink included (never followed), is refused with one line (``OutputError``, exit 2) naming
it, and everything is left as it was. Folders are then made with ``mkdir``, which fails rather
than take one filled in the meantime. Nothing records
what the harness made, so there is no record to go stale, to be forged or to be committed: a
rerun into the same ``--out`` is refused until the earlier results are moved away, and no
earlier run's file can be read as this run's.

``OUT/.parity-out/lock`` (made empty if missing, never written) is held with flock while a
command works in OUT; a second command on the same folder is refused with the holder's pid and
command line (read from /proc/locks). Nested uses in one process (a pair's ``run_job`` calls)
share the holder's lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import threading
from pathlib import Path

from parity.errors import InputError

LEDGER_DIR = ".parity-out"  # the lock's folder (the name is kept for the tools that read it)
_LOCK = "lock"


class OutputError(InputError):
    """An output path the harness may not write: taken already, or in use; one line."""


class OutDir:
    """One output folder held by this process: ``claim`` the names a command will write, then
    ``make_dir`` them; ``close`` (or use it as a context manager) releases the lock."""

    _held: dict[Path, OutDir] = {}
    _guard = threading.Lock()

    def __init__(self, root: Path):
        self.root = root
        self.meta = root / LEDGER_DIR
        self._users = 0
        self._fd: int | None = None
        self._ours: set[str] = set()  # names claimed (found free) while this process holds it

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
            raise OutputError(f"{self.meta}: not parity's lock folder; choose another --out")
        try:
            self.meta.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.meta / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"{self.root}: cannot write here: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputError(f"{self.root}: in use by {holder}; wait for it or choose "
                              "another --out") from None  # fmt: skip
        self._fd = fd

    def close(self) -> None:
        """For the last user, release the lock."""
        with self._guard:
            self._users -= 1
            if self._users > 0:
                return
            self._held.pop(self.root, None)
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what lies in it -------------------------------------------------------------------------

    def claim(self, *names: str) -> None:
        """Check that each name is free (nothing there, or an empty folder: nothing to lose),
        before anything is written; raises OutputError naming the first one taken. A name this
        process claimed already while holding the folder is its own to write."""
        for name in names:
            self._check_name(name)
            path = self.root / name
            if name not in self._ours and os.path.lexists(path) and not _empty_dir(path):
                raise OutputError(_taken(path))
        self._ours.update(names)

    def make_dir(self, name: str) -> Path:
        """An empty folder ``root/name``, made, or taken as it is when an empty folder is there
        already; raises OutputError when anything else is there."""
        self.claim(name)
        path = self.root / name
        try:
            path.mkdir()
        except FileExistsError:
            if not _empty_dir(path):  # made, or filled, since the claim: never taken
                raise OutputError(_taken(path)) from None
        except OSError as e:
            raise OutputError(f"{path}: cannot make this folder: {e.strerror or e}") from None
        return path

    def fresh_dir(self, stem: str) -> Path:
        """A new empty folder named ``stem``, or ``stem-2``, ``stem-3``, ... the first free
        one: for a folder whose name nobody relies on (a session's warm pools)."""
        for n in range(1, 10_000):
            name = stem if n == 1 else f"{stem}-{n}"
            if not os.path.lexists(self.root / name):
                try:
                    return self.make_dir(name)
                except OutputError:
                    continue  # made meanwhile: the next name
        raise OutputError(f"{self.root / stem}: no free name left; choose another --out")

    def _check_name(self, name: str) -> None:
        """A name of its own in the folder: an ``--out`` of ``/`` or ``X/.parity-out`` is none."""
        if not name or "/" in name or name in (".", "..", LEDGER_DIR):
            raise OutputError(f"{self.root}: not an entry name: {name!r}; choose another --out")


#: each path write_new wrote, with what identifies the file it left there (device, inode, size,
#: modification time in ns): a file put there since, even under a reused inode number, is not it
_made_here: dict[Path, tuple[int, int, int, int]] = {}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def write_new(path: str | os.PathLike[str], text: str) -> None:
    """Write ``path`` whole (a temp file, then a hard link to the name, which fails where anything
    is there): a file the user put under a name after it was claimed is never replaced, but
    refused (OutputError); the file this process last wrote there with ``write_new`` is replaced
    atomically."""
    path = Path(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports are read by others
        try:
            _place(tmp, path)
        except FileExistsError:
            if _made_here.get(path) != _identity(path):
                raise OutputError(_taken(path)) from None
            os.replace(tmp, path)
        _made_here[path] = _identity(path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _place(tmp: str, path: Path) -> None:
    """``tmp`` under the name ``path``; FileExistsError when anything is there. A hard link
    where the file system has them; elsewhere (FAT, some network mounts) the name is taken
    empty with O_EXCL, then the file renamed over that empty claim."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        pass
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.replace(tmp, path)


def write_json_new(path: str | os.PathLike[str], obj: object) -> None:
    """``write_new`` of a summary-style JSON file (indented, sorted keys, no NaN)."""
    write_new(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def free_name(folder: Path, name: str, *suffixes: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ... the first one that, with each suffix appended,
    names nothing in ``folder`` (a run folder and its ``.launch`` both free)."""
    n = 1
    while True:
        candidate = name if n == 1 else f"{name}-{n}"
        if not any(os.path.lexists(folder / (candidate + s)) for s in ("", *suffixes)):
            return candidate
        n += 1


def _empty_dir(path: Path) -> bool:
    """A real folder (not a symlink to one) with nothing in it."""
    if path.is_symlink() or not path.is_dir():
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _taken(path: Path) -> str:
    if path.is_symlink():
        what = "a symlink"
    else:
        what = "a folder" if path.is_dir() else "a file"
    return (
        f"{path}: {what} is already there (an earlier run's or yours); parity never deletes, "
        "replaces or follows anything: move it away or choose another --out"
    )


def _holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s file: its pid and command line, from /proc/locks (Linux);
    "another parity command" where that cannot be read (another node of a shared file system)."""
    st = os.fstat(fd)
    pids = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; "->" a waiter
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].isdigit():
            continue
        if fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
            pids.append(int(fields[4]))
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        return f"pid {pid} ({b' '.join(argv).decode(errors='replace')[:200]})"
    return "another parity command"
